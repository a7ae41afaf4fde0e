//! Multi-rank tests: every rank is a thread, every ring real TCP on loopback.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::algo::AlgoSettings;
use super::collective::Collective;
use super::dtype::tests::{decode, encode};
use super::dtype::{shard_range, DType, ReduceOp};
use super::engine::Engine;
use super::host::Groups;
use super::tcp::{random_token, RingListener, TcpRing};
use super::transport::{Deadline, OpKind, OpTag, Reduction, Transport};
use crate::error::Error;

const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

fn listeners(p: usize) -> (Vec<RingListener>, Vec<SocketAddr>) {
    let ls: Vec<RingListener> = (0..p)
        .map(|_| RingListener::bind(LOCALHOST).unwrap())
        .collect();
    let addrs = ls.iter().map(RingListener::addr).collect();
    (ls, addrs)
}

/// Forms `channels` rings of `p` ranks; result[rank][channel].
fn rings(p: usize, channels: usize) -> Vec<Vec<TcpRing>> {
    let token = random_token().unwrap();
    let (ls, addrs) = listeners(p);
    on_listeners(ls, &addrs, move |rank, l, addrs| {
        l.connect(
            addrs,
            rank,
            &token,
            channels,
            Deadline::after(Duration::from_secs(20)),
        )
        .unwrap()
    })
}

/// Runs `f(rank, listener, addrs)` for every rank's listener, each on a
/// thread of its own; the results by rank.
fn on_listeners<T: Send + 'static>(
    ls: Vec<RingListener>,
    addrs: &[SocketAddr],
    f: impl Fn(usize, RingListener, &[SocketAddr]) -> T + Send + Clone + 'static,
) -> Vec<T> {
    let handles: Vec<_> = ls
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let (addrs, f) = (addrs.to_vec(), f.clone());
            std::thread::spawn(move || f(rank, l, &addrs))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Runs `f(rank, ring)` on every rank of one channel, in parallel.
fn on_every_rank<T: Send + 'static>(
    p: usize,
    f: impl Fn(usize, &mut TcpRing) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let handles: Vec<_> = rings(p, 1)
        .into_iter()
        .enumerate()
        .map(|(rank, mut chans)| {
            let f = f.clone();
            std::thread::spawn(move || f(rank, &mut chans[0]))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn deadline() -> Deadline {
    Deadline::after(Duration::from_secs(20))
}

/// Small integers sum exactly in every type, so results can be compared
/// with `==`.
fn rank_values(rank: usize, len: usize) -> Vec<f64> {
    (0..len)
        .map(|i| ((i * 7 + rank * 3) % 11) as f64 - 5.0)
        .collect()
}

/// One channel of an engine: its groups and algorithm settings.
type ChannelSpec = (Groups, AlgoSettings);

/// Starts one engine per rank from its channels and runs `f(rank, engine)`
/// on every rank in parallel.
fn on_engines<T: Send + 'static>(
    per_rank: Vec<Vec<ChannelSpec>>,
    f: impl Fn(usize, &Engine) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    on_engines_with_turns(per_rank, false, f)
}

/// [`on_engines`], the channels taking turns on the link when `turns`.
fn on_engines_with_turns<T: Send + 'static>(
    per_rank: Vec<Vec<ChannelSpec>>,
    turns: bool,
    f: impl Fn(usize, &Engine) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let handles: Vec<_> = per_rank
        .into_iter()
        .enumerate()
        .map(|(rank, channels)| {
            let f = f.clone();
            std::thread::spawn(move || {
                let engine =
                    Engine::with_channels(channels, Duration::from_secs(20), None, turns).unwrap();
                f(rank, &engine)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// [`on_engines`] over `channels` flat rings of `p` ranks.
fn with_engines<T: Send + 'static>(
    p: usize,
    channels: usize,
    settings: AlgoSettings,
    f: impl Fn(usize, &Engine) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    on_engines(flat_channels(p, channels, settings), f)
}

/// `channels` flat rings of `p` ranks, each with `settings`: result[rank].
fn flat_channels(p: usize, channels: usize, settings: AlgoSettings) -> Vec<Vec<ChannelSpec>> {
    rings(p, channels)
        .into_iter()
        .map(|chans| {
            chans
                .into_iter()
                .map(|c| (Groups::flat(Box::new(c)), settings))
                .collect()
        })
        .collect()
}

/// The header of a summing allreduce of `bytes` bytes of `dtype`.
fn allreduce_tag(seq: u64, bucket: u64, dtype: DType, bytes: u64) -> OpTag {
    OpTag {
        op: 0,
        kind: OpKind::Allreduce,
        seq,
        bucket,
        dtype: dtype.code(),
        bytes,
    }
}

/// Allreduces `values` as float32 on `bucket` and returns the result.
fn allreduce_f32(engine: &Engine, values: &[f64], average: bool, bucket: u64) -> Vec<f64> {
    let mut buf = encode(DType::F32, values);
    engine
        .run(
            Collective::Allreduce { average },
            &mut buf,
            DType::F32,
            bucket,
        )
        .unwrap();
    decode(DType::F32, &buf)
}

/// `v` rounded to the nearest value of `wire` (float16 or bfloat16), ties
/// to even: the codec's cast, computed here with the `half` crate.
fn round_to(wire: DType, v: f64) -> f64 {
    match wire {
        DType::F16 => half::f16::from_f64(v).to_f64(),
        DType::BF16 => half::bf16::from_f64(v).to_f64(),
        other => panic!("{other:?} is not a wire type"),
    }
}

/// A wire type's counterpart in [`Compression`].
fn compression_for(wire: DType) -> super::codec::Compression {
    use super::codec::Compression;
    match wire {
        DType::F16 => Compression::Fp16,
        _ => Compression::Bf16,
    }
}

/// What one transport was asked to move: (collective, bytes per element,
/// bytes).
type Moves = std::sync::Arc<std::sync::Mutex<Vec<(&'static str, usize, usize)>>>;

/// A sum of `dtype` elements divided by `divisor`, checked against `tag`
/// when given, keyed by `bucket`, within the tests' deadline.
fn summing<'a>(tag: Option<&'a OpTag>, dtype: DType, divisor: f64, bucket: u64) -> Reduction<'a> {
    Reduction {
        tag,
        divisor,
        bucket,
        ..Reduction::sum(dtype, deadline())
    }
}

/// A transport that records the size of every collective it carries, and
/// hands it to the transport inside.
struct Counted {
    inner: Box<dyn Transport>,
    moves: Moves,
}

impl Counted {
    fn record(&self, what: &'static str, elem: usize, bytes: usize) {
        self.moves.lock().unwrap().push((what, elem, bytes));
    }
}

impl Transport for Counted {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn medium(&self) -> &'static str {
        self.inner.medium()
    }
    fn bytes_sent(&self) -> u64 {
        self.inner.bytes_sent()
    }
    fn agree(&mut self, tag: &OpTag, deadline: Deadline) -> crate::error::Result<()> {
        self.inner.agree(tag, deadline)
    }
    fn allreduce_with(&mut self, buf: &mut [u8], how: &Reduction) -> crate::error::Result<()> {
        self.record("allreduce", how.dtype.size(), buf.len());
        self.inner.allreduce_with(buf, how)
    }
    fn reduce_scatter_with(&mut self, buf: &mut [u8], how: &Reduction) -> crate::error::Result<()> {
        self.record("reduce-scatter", how.dtype.size(), buf.len());
        self.inner.reduce_scatter_with(buf, how)
    }
    fn allgather(
        &mut self,
        buf: &mut [u8],
        elem: usize,
        deadline: Deadline,
    ) -> crate::error::Result<()> {
        self.record("allgather", elem, buf.len());
        self.inner.allgather(buf, elem, deadline)
    }
    fn broadcast(
        &mut self,
        buf: &mut [u8],
        root: usize,
        deadline: Deadline,
    ) -> crate::error::Result<()> {
        self.record("broadcast", 1, buf.len());
        self.inner.broadcast(buf, root, deadline)
    }
    fn barrier(&mut self, deadline: Deadline) -> crate::error::Result<()> {
        self.inner.barrier(deadline)
    }
    fn abort(&mut self) {
        self.inner.abort()
    }
    fn aborter(&self) -> super::transport::Aborter {
        self.inner.aborter()
    }
}

/// [`two_by_two_groups`] with every rank's intra-node and inter-node
/// transports [`Counted`]: the groups, and per rank what each carried.
fn counted_two_by_two_groups() -> (Vec<Groups>, Vec<(Moves, Moves)>) {
    let mut moves = Vec::new();
    let groups = two_by_two_groups()
        .into_iter()
        .map(|mut g| {
            let h = g.hierarchy.take().unwrap();
            let (intra, inter) = (Moves::default(), Moves::default());
            moves.push((intra.clone(), inter.clone()));
            g.hierarchy = Some(super::host::Hierarchy {
                intra: Box::new(Counted {
                    inner: h.intra,
                    moves: intra,
                }),
                inter: Box::new(Counted {
                    inner: h.inter,
                    moves: inter,
                }),
                layout: h.layout,
            });
            g
        })
        .collect();
    (groups, moves)
}

/// 2 nodes x 2 ranks: groups per world rank, each with a 2D hierarchy.
/// Runs `f` on a thread for each rank of [`two_by_two_groups`], with its
/// rank and groups; what each returned, in rank order.
fn on_two_by_two<T: Send + 'static>(
    f: impl Fn(usize, Groups) -> T + Send + Clone + 'static,
) -> Vec<T> {
    let handles: Vec<_> = two_by_two_groups()
        .into_iter()
        .enumerate()
        .map(|(rank, groups)| {
            let f = f.clone();
            std::thread::spawn(move || f(rank, groups))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn two_by_two_groups() -> Vec<Groups> {
    use super::algo::Layout;
    use super::host::Hierarchy;
    let mut world: Vec<Option<TcpRing>> = rings(4, 1).into_iter().map(|mut c| c.pop()).collect();
    let mut intra: Vec<Vec<Option<TcpRing>>> = (0..2)
        .map(|_| rings(2, 1).into_iter().map(|mut c| c.pop()).collect())
        .collect();
    let mut inter: Vec<Vec<Option<TcpRing>>> = (0..2)
        .map(|_| rings(2, 1).into_iter().map(|mut c| c.pop()).collect())
        .collect();
    (0..4)
        .map(|rank| {
            let layout = Layout::new(rank, 4, 2).unwrap();
            let (node, local) = (layout.node(), layout.local_rank());
            Groups {
                world: Box::new(world[rank].take().unwrap()),
                hierarchy: Some(Hierarchy {
                    intra: Box::new(intra[node][local].take().unwrap()),
                    inter: Box::new(inter[local][node].take().unwrap()),
                    layout,
                }),
            }
        })
        .collect()
}

/// Rank `rank`'s element `i` for the 2D compression tests: an integer in
/// `-6..=6` plus a multiple of 2^-12 in `-6..=6`. float32 holds these and
/// every sum of them exactly; float16 holds them only near zero.
fn two_d_value(rank: usize, i: usize) -> f64 {
    let j = ((i * 7 + rank * 3) % 13) as f64 - 6.0;
    let t = ((i * 5 + rank * 11) % 13) as f64 - 6.0;
    j + t * 2f64.powi(-12)
}

/// What the 2D allreduce of [`two_d_value`] over 2 nodes x 2 ranks gives
/// element `i`, rounding to `wire` where the codec does: each rank's input
/// (`inputs`), each node's sum and the sum across nodes (`sums`). The
/// intra-node and inter-node steps add two values each, so the order of
/// additions cannot matter.
fn two_d_reference(i: usize, wire: DType, inputs: bool, sums: bool) -> f64 {
    let r = |v: f64, on: bool| if on { round_to(wire, v) } else { v };
    let x: Vec<f64> = (0..4).map(|rank| r(two_d_value(rank, i), inputs)).collect();
    let nodes = [r(x[0] + x[1], sums), r(x[2] + x[3], sums)];
    r(nodes[0] + nodes[1], sums) as f32 as f64
}

/// One channel's ring per member, moved to shared memory (all members are
/// threads of this process, so they share the host); result[rank].
fn shm_groups(p: usize) -> Vec<Box<dyn Transport>> {
    let handles: Vec<_> = rings(p, 1)
        .into_iter()
        .map(|mut chans| {
            let ring = chans.remove(0);
            std::thread::spawn(move || {
                let mut why = None;
                let group = super::shm::attach(ring, deadline(), &mut why).unwrap();
                assert!(why.is_none(), "shared memory refused: {why:?}");
                group
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

mod compression;
mod device;
mod engine;
mod ring;
mod sharded;
mod shm;
mod state;
mod top_k;
mod two_d;
