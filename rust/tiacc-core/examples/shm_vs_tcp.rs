//! Allreduce time of one host's ranks: shared memory against loopback TCP.
//!
//! `cargo run --release -p tiacc-core --example shm_vs_tcp [ranks] [MiB] [reps]`
//! (defaults 4, 16, 10). Every rank is a thread with its own buffer; the
//! transports alternate round by round so that load from elsewhere on the
//! machine hits them alike: TCP, shared memory, and shared memory leaving
//! the result in a region every rank maps (as for DDP's buckets: no
//! gather). Prints the median of each.

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use tiacc_core::comm::shm;
use tiacc_core::comm::tcp::{random_token, RingListener};
use tiacc_core::comm::{DType, Deadline, Reduction, Transport};

fn groups(p: usize, shared_memory: bool) -> Vec<Box<dyn Transport>> {
    let token = random_token().expect("token");
    let listeners: Vec<RingListener> = (0..p)
        .map(|_| RingListener::bind(IpAddr::V4(Ipv4Addr::LOCALHOST)).expect("bind"))
        .collect();
    let addrs: Vec<_> = listeners.iter().map(RingListener::addr).collect();
    let handles: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let addrs = addrs.clone();
            std::thread::spawn(move || {
                let deadline = Deadline::after(Duration::from_secs(60));
                let ring = l
                    .connect(&addrs, rank, &token, 1, deadline)
                    .expect("connect")
                    .remove(0);
                if shared_memory {
                    let mut why = None;
                    let group = shm::attach(ring, deadline, &mut why).expect("attach");
                    assert!(why.is_none(), "{why:?}");
                    group
                } else {
                    Box::new(ring) as Box<dyn Transport>
                }
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("join"))
        .collect()
}

/// One timed allreduce on every rank (the result left in shared memory
/// when `shared`, as DDP's buckets are); the slowest rank's time.
fn round(
    groups: Vec<Box<dyn Transport>>,
    bytes: usize,
    shared: bool,
) -> (Vec<Box<dyn Transport>>, Duration) {
    let handles: Vec<_> = groups
        .into_iter()
        .enumerate()
        .map(|(rank, mut g)| {
            std::thread::spawn(move || {
                let mut buf: Vec<u8> = (0..bytes / 4)
                    .flat_map(|i| ((i % 97) as f32 + rank as f32).to_ne_bytes())
                    .collect();
                let deadline = Deadline::after(Duration::from_secs(60));
                let start = Instant::now();
                if shared {
                    g.allreduce_shared(&mut buf, &Reduction::sum(DType::F32, deadline))
                        .expect("allreduce");
                } else {
                    g.allreduce(&mut buf, DType::F32, deadline)
                        .expect("allreduce");
                }
                (g, start.elapsed())
            })
        })
        .collect();
    let mut out = Vec::new();
    let mut slowest = Duration::ZERO;
    for h in handles {
        let (g, t) = h.join().expect("join");
        slowest = slowest.max(t);
        out.push(g);
    }
    (out, slowest)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let p = args.first().copied().unwrap_or(4);
    let bytes = args.get(1).copied().unwrap_or(16) << 20;
    let reps = args.get(2).copied().unwrap_or(10);
    let mut tcp = groups(p, false);
    let mut shm = groups(p, true);
    let (mut t_tcp, mut t_shm, mut t_shared) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..reps {
        let (g, t) = round(tcp, bytes, false);
        tcp = g;
        t_tcp.push(t);
        let (g, t) = round(shm, bytes, false);
        shm = g;
        t_shm.push(t);
        let (g, t) = round(shm, bytes, true);
        shm = g;
        t_shared.push(t);
    }
    let ms = |v: Vec<Duration>| median(v).as_secs_f64() * 1e3;
    let (a, b, c) = (ms(t_tcp), ms(t_shm), ms(t_shared));
    println!(
        "{p} ranks, {} MiB float32 allreduce, median of {reps}: TCP {a:.1} ms, shared memory \
         {b:.1} ms ({:.2}x), result left in shared memory {c:.1} ms ({:.2}x)",
        bytes >> 20,
        a / b,
        a / c
    );
}
