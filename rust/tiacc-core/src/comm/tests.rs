//! Multi-rank tests: every rank is a thread, every ring real TCP on loopback.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::algo::AlgoSettings;
use super::dtype::tests::{decode, encode};
use super::dtype::{shard_range, DType, ReduceOp};
use super::engine::{Collective, Engine};
use super::host::Groups;
use super::tcp::{random_token, RingListener, TcpRing};
use super::transport::{Deadline, OpKind, OpTag, Transport};
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
    let handles: Vec<_> = ls
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let addrs = addrs.clone();
            std::thread::spawn(move || {
                l.connect(
                    &addrs,
                    rank,
                    &token,
                    channels,
                    Deadline::after(Duration::from_secs(20)),
                )
                .unwrap()
            })
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

#[test]
fn allreduce_sums_every_dtype_and_size_identically_on_every_rank() {
    for p in 1..=5 {
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            for len in [0usize, 1, 3, p + 1, 1000, 40_003] {
                let results = on_every_rank(p, move |rank, ring| {
                    let mut buf = encode(dtype, &rank_values(rank, len));
                    ring.allreduce(&mut buf, dtype, deadline()).unwrap();
                    buf
                });
                let inputs: Vec<Vec<f64>> = (0..p).map(|r| rank_values(r, len)).collect();
                let expected: Vec<f64> = (0..len)
                    .map(|i| inputs.iter().map(|v| v[i]).sum())
                    .collect();
                assert_eq!(
                    decode(dtype, &results[0]),
                    expected,
                    "p={p} {dtype:?} len={len}"
                );
                for other in &results[1..] {
                    assert_eq!(
                        other, &results[0],
                        "ranks differ: p={p} {dtype:?} len={len}"
                    );
                }
            }
        }
    }
}

#[test]
fn float_sums_are_bitwise_identical_across_ranks() {
    // Values whose sum depends on the order of additions.
    let results = on_every_rank(4, |rank, ring| {
        let values: Vec<f64> = (0..10_001)
            .map(|i| ((i * 31 + rank) as f64).sin() * 1e3)
            .collect();
        let mut buf = encode(DType::F32, &values);
        ring.allreduce(&mut buf, DType::F32, deadline()).unwrap();
        buf
    });
    assert!(results.iter().all(|r| r == &results[0]));
    // And the sum itself, within float32's rounding of 3 additions.
    for (i, got) in decode(DType::F32, &results[0]).iter().enumerate() {
        let want: f64 = (0..4)
            .map(|rank| (((i * 31 + rank) as f64).sin() * 1e3) as f32 as f64)
            .sum();
        assert!((got - want).abs() < 1e-3, "{i}: {got} vs {want}");
    }
}

#[test]
fn reduce_scatter_allgather_broadcast_barrier() {
    let p = 3;
    let len = 10;
    let results = on_every_rank(p, move |rank, ring| {
        let mut rs = encode(DType::F64, &rank_values(rank, len));
        ring.reduce_scatter(&mut rs, DType::F64, deadline())
            .unwrap();
        let mine = shard_range(len, p, rank);
        let rs_shard = decode(DType::F64, &rs[mine.start * 8..mine.end * 8]);

        let mut ag = vec![0u8; len];
        for i in shard_range(len, p, rank) {
            ag[i] = (rank * 10 + i) as u8;
        }
        ring.allgather(&mut ag, 1, deadline()).unwrap();

        let mut bc = if rank == 1 {
            vec![42u8; 100_000]
        } else {
            vec![0u8; 100_000]
        };
        ring.broadcast(&mut bc, 1, deadline()).unwrap();
        ring.barrier(deadline()).unwrap();
        (rs_shard, ag, bc)
    });
    for (rank, (rs_shard, ag, bc)) in results.iter().enumerate() {
        let mine = shard_range(len, p, rank);
        let expected: Vec<f64> = mine
            .clone()
            .map(|i| (0..p).map(|r| rank_values(r, len)[i]).sum())
            .collect();
        assert_eq!(rs_shard, &expected);
        for owner in 0..p {
            for i in shard_range(len, p, owner) {
                assert_eq!(ag[i], (owner * 10 + i) as u8);
            }
        }
        assert!(bc.iter().all(|&b| b == 42));
    }
}

#[test]
fn several_channels_carry_independent_collectives() {
    let p = 3;
    let results = with_engines(p, 3, Default::default(), |rank, engine| {
        (0..7u64)
            .map(|bucket| {
                let len = 1000 + bucket as usize * 517;
                allreduce_f32(
                    engine,
                    &rank_values(rank + bucket as usize, len),
                    true,
                    bucket,
                )
            })
            .collect::<Vec<_>>()
    });
    for (bucket, got) in results[0].iter().enumerate() {
        let len = got.len();
        let inputs: Vec<Vec<f64>> = (0..p).map(|r| rank_values(r + bucket, len)).collect();
        for (i, v) in got.iter().enumerate() {
            let sum: f64 = inputs.iter().map(|x| x[i] / p as f64).sum();
            assert!(
                (v - sum).abs() < 1e-5,
                "bucket {bucket} element {i}: {v} vs {sum}"
            );
        }
        for other in &results[1..] {
            assert_eq!(&other[bucket], got);
        }
    }
}

#[test]
fn mismatched_collectives_raise_on_every_rank_naming_the_odd_rank() {
    let errors = on_every_rank(3, |rank, ring| {
        let bytes = if rank == 2 { 400 } else { 800 };
        let tag = OpTag {
            op: 0,
            kind: OpKind::Allreduce,
            seq: 1,
            bucket: 0,
            dtype: DType::F32.code(),
            bytes,
        };
        ring.agree(&tag, deadline()).unwrap_err().to_string()
    });
    for msg in &errors {
        assert!(msg.contains("rank 2 issued"), "{msg}");
        assert!(msg.contains("400 bytes"), "{msg}");
    }
}

#[test]
fn checked_allreduce_sums_and_catches_a_diverging_rank_without_an_extra_round() {
    let tag = |bytes: u64| OpTag {
        op: 0,
        kind: OpKind::Allreduce,
        seq: 1,
        bucket: 4,
        dtype: DType::F32.code(),
        bytes,
    };
    let sums = on_every_rank(3, move |rank, ring| {
        let mut buf = encode(DType::F32, &rank_values(rank, 100));
        ring.allreduce_checked(&tag(400), &mut buf, DType::F32, deadline())
            .unwrap();
        decode(DType::F32, &buf)
    });
    let want: Vec<f64> = (0..100)
        .map(|i| (0..3).map(|r| rank_values(r, 100)[i]).sum())
        .collect();
    for (rank, got) in sums.iter().enumerate() {
        assert_eq!(got, &want, "rank {rank}");
    }

    let errors = on_every_rank(3, move |rank, ring| {
        let len = if rank == 1 { 90 } else { 100 };
        let mut buf = encode(DType::F32, &rank_values(rank, len));
        let err = ring
            .allreduce_checked(&tag(len as u64 * 4), &mut buf, DType::F32, deadline())
            .unwrap_err();
        ring.abort(); // what the engine does after a failure
        err.to_string()
    });
    // Rank 2 reads rank 1's header and names it; the others fail because
    // the ring was aborted.
    assert!(errors[2].contains("rank 1 issued"), "{}", errors[2]);
    assert!(errors[2].contains("360 bytes"), "{}", errors[2]);
    for msg in &errors {
        assert!(msg.contains("rank"), "{msg}");
    }
}

#[test]
fn a_silent_peer_times_out_naming_it() {
    let mut per_rank = rings(2, 1);
    let mut silent = per_rank.pop().unwrap();
    let mut ring = per_rank.pop().unwrap().remove(0);
    let start = Instant::now();
    let mut buf = vec![0u8; 4096];
    let err = ring
        .allreduce(
            &mut buf,
            DType::F32,
            Deadline::after(Duration::from_millis(300)),
        )
        .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(5));
    match &err {
        Error::CommTimeout { peer, message } => {
            assert_eq!(*peer, 1);
            assert!(message.contains("waiting for rank 1"), "{message}");
        }
        other => panic!("expected a timeout, got {other}"),
    }
    // The ring is now broken for good, and says why.
    let again = ring
        .allreduce(&mut buf, DType::F32, deadline())
        .unwrap_err();
    assert!(again.to_string().contains("earlier failure"), "{again}");
    drop(silent.pop());
}

#[test]
fn a_dead_peer_fails_the_others_quickly() {
    let per_rank = rings(3, 1);
    let mut handles = Vec::new();
    for (rank, mut chans) in per_rank.into_iter().enumerate() {
        handles.push(std::thread::spawn(move || {
            let mut ring = chans.remove(0);
            if rank == 2 {
                drop(ring); // the process died: its sockets close
                return None;
            }
            let mut buf = vec![0u8; 1 << 20];
            let start = Instant::now();
            let err = ring
                .allreduce(&mut buf, DType::F32, deadline())
                .unwrap_err();
            ring.abort(); // what the engine does after a failure
            Some((err.to_string(), start.elapsed()))
        }));
    }
    let results: Vec<_> = handles
        .into_iter()
        .filter_map(|h| h.join().unwrap())
        .collect();
    assert_eq!(results.len(), 2);
    for (msg, took) in results {
        assert!(took < Duration::from_secs(10), "{msg}");
        assert!(msg.contains("rank 2") || msg.contains("rank 1"), "{msg}");
        assert!(msg.contains("exited or failed"), "{msg}");
    }
}

#[test]
fn a_connection_with_the_wrong_token_is_dropped_and_rendezvous_goes_on() {
    let token = random_token().unwrap();
    let (ls, addrs) = listeners(2);
    // A stranger reaches rank 1's port before rank 0 does.
    let mut stranger = TcpStream::connect(addrs[1]).unwrap();
    let mut hello = b"TIACCv1\0".to_vec();
    hello.extend_from_slice(&[0u8; 16]);
    hello.extend_from_slice(&[0u8; 12]);
    stranger.write_all(&hello).unwrap();

    let handles: Vec<_> = ls
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let addrs = addrs.clone();
            std::thread::spawn(move || {
                let mut rings = l.connect(&addrs, rank, &token, 1, deadline()).unwrap();
                let mut buf = encode(DType::F32, &[rank as f64 + 1.0]);
                rings[0]
                    .allreduce(&mut buf, DType::F32, deadline())
                    .unwrap();
                decode(DType::F32, &buf)
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), vec![3.0]);
    }
    stranger
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut byte = [0u8; 1];
    let n = stranger.read(&mut byte).unwrap_or(0);
    assert_eq!(n, 0, "the stranger's connection must be closed");
}

#[test]
fn rendezvous_times_out_when_a_rank_never_shows_up() {
    let token = random_token().unwrap();
    let (mut ls, addrs) = listeners(2);
    let _absent = ls.pop().unwrap(); // listens, never connects
    let l = ls.pop().unwrap();
    let err = l
        .connect(
            &addrs,
            0,
            &token,
            1,
            Deadline::after(Duration::from_millis(300)),
        )
        .unwrap_err();
    assert!(matches!(err, Error::CommTimeout { peer: 1, .. }), "{err}");
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
    let per_rank = rings(p, channels)
        .into_iter()
        .map(|chans| {
            chans
                .into_iter()
                .map(|c| (Groups::flat(Box::new(c)), settings))
                .collect()
        })
        .collect();
    on_engines(per_rank, f)
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

#[test]
fn half_precision_compression_averages_within_its_precision() {
    use super::codec::Compression;
    for compression in [Compression::Fp16, Compression::Bf16] {
        let options = AlgoSettings {
            compression,
            scale: 4.0,
            ..Default::default()
        };
        let p = 3;
        let results = with_engines(p, 2, options, |rank, engine| {
            let values: Vec<f64> = (0..5000)
                .map(|i| ((i + rank * 7) as f64).sin() * 100.0)
                .collect();
            allreduce_f32(engine, &values, true, 3)
        });
        for (i, got) in results[0].iter().enumerate() {
            let mean: f64 = (0..p)
                .map(|r| ((i + r * 7) as f64).sin() * 100.0)
                .sum::<f64>()
                / p as f64;
            let tolerance = if compression == Compression::Bf16 {
                2.0
            } else {
                0.2
            };
            assert!(
                (got - mean).abs() < tolerance,
                "{compression:?} {i}: {got} vs {mean}"
            );
        }
        assert!(results.iter().all(|r| r == &results[0]), "ranks differ");
        // The values went through the half type: most means are off by
        // more than float32's rounding of them (a mutant that sends float32
        // keeps every one within about 1e-5).
        let off = results[0]
            .iter()
            .enumerate()
            .filter(|&(i, got)| {
                let mean: f64 = (0..p)
                    .map(|r| ((i + r * 7) as f64).sin() * 100.0)
                    .sum::<f64>()
                    / p as f64;
                (got - mean).abs() > 1e-3
            })
            .count();
        assert!(
            off > 5000 / 2,
            "{compression:?}: only {off} of 5000 rounded"
        );
    }
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

/// An integer `2..=6` or `-6..=-2` off by a small fraction (below half the
/// wire type's spacing there, so the cast rounds it to the integer, up or
/// down), for rank `rank`'s element `i`.
fn off_integer(wire: DType, rank: usize, i: usize) -> f64 {
    let m = (i * 7 + rank * 3) % 10;
    let j = if m < 5 {
        -(m as f64) - 2.0
    } else {
        m as f64 - 3.0
    };
    // 2^-12 is below half the float16 spacing at 2 (2^-10); 2^-9 below half
    // bfloat16's (2^-7).
    let delta = if wire == DType::F16 {
        2f64.powi(-12)
    } else {
        2f64.powi(-9)
    };
    let s = if (i + rank) % 3 == 0 { -1.0 } else { 1.0 };
    j + s * delta
}

#[test]
fn half_precision_compression_sums_each_ranks_share_rounded_to_the_wire_type() {
    // 4 ranks averaging with scale 2: each rank's share is x * 2 / 4, cast
    // to the wire type (rounded to an integer by construction), summed
    // (integers: exact in any order) and divided by 2. The exact mean
    // differs from that wherever the fractions do not cancel.
    let (p, len, scale) = (4usize, 3001usize, 2.0);
    for wire in [DType::F16, DType::BF16] {
        let settings = AlgoSettings {
            compression: compression_for(wire),
            scale,
            ..Default::default()
        };
        let input = move |r: usize, i: usize| 2.0 * off_integer(wire, r, i);
        let results = with_engines(p, 2, settings, move |rank, engine| {
            let values: Vec<f64> = (0..len).map(|i| input(rank, i)).collect();
            allreduce_f32(engine, &values, true, 3)
        });
        let factor = scale / p as f64;
        let mut rounded = 0;
        for i in 0..len {
            let shares: Vec<f64> = (0..p)
                .map(|r| round_to(wire, input(r, i) * factor))
                .collect();
            assert!(
                shares.iter().all(|v| v.fract() == 0.0),
                "{wire:?} {i}: {shares:?}"
            );
            let want = (shares.iter().sum::<f64>() / scale) as f32 as f64;
            let exact = (0..p).map(|r| input(r, i)).sum::<f64>() / p as f64;
            for (rank, got) in results.iter().enumerate() {
                assert_eq!(got[i], want, "{wire:?} rank {rank} element {i}");
            }
            if results[0][i] != exact {
                rounded += 1;
            }
        }
        // Every element whose fractions do not cancel (3 of 4 do not).
        assert!(
            rounded > len / 2,
            "{wire:?}: only {rounded} of {len} rounded"
        );
    }
}

#[test]
fn the_nan_check_stops_a_bucket_before_it_is_sent_and_names_the_rank() {
    let options = AlgoSettings {
        nan_check: true,
        ..Default::default()
    };
    let errors = with_engines(3, 2, options, |rank, engine| {
        let mut values = vec![1.0; 100];
        if rank == 1 {
            values[42] = f64::NAN;
        }
        let mut buf = encode(DType::F32, &values);
        let err = engine
            .run(
                Collective::Allreduce { average: false },
                &mut buf,
                DType::F32,
                5,
            )
            .unwrap_err();
        (err.to_string(), decode(DType::F32, &buf))
    });
    let (msg, buf) = &errors[1];
    assert!(
        msg.contains("rank 1: bucket 5 holds a non-finite gradient"),
        "{msg}"
    );
    assert!(msg.contains("element 42"), "{msg}");
    // The other ranks fail too and their buffers never saw the NaN.
    for (rank, (msg, buf)) in errors.iter().enumerate() {
        if rank != 1 {
            assert!(msg.contains("rank"), "{msg}");
            assert!(
                buf.iter().all(|v| v.is_finite()),
                "rank {rank} received the NaN"
            );
        }
    }
    assert!(buf[42].is_nan());
}

/// What one transport was asked to move: (collective, bytes per element,
/// bytes).
type Moves = std::sync::Arc<std::sync::Mutex<Vec<(&'static str, usize, usize)>>>;

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
    fn allreduce_op(
        &mut self,
        tag: Option<&OpTag>,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        deadline: Deadline,
    ) -> crate::error::Result<()> {
        self.record("allreduce", dtype.size(), buf.len());
        self.inner.allreduce_op(tag, buf, dtype, op, deadline)
    }
    fn reduce_scatter_op(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        deadline: Deadline,
    ) -> crate::error::Result<()> {
        self.record("reduce-scatter", dtype.size(), buf.len());
        self.inner.reduce_scatter_op(buf, dtype, op, deadline)
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

/// Bytes per element of everything `moves` recorded, and the bytes in all.
fn moved(moves: &Moves) -> (Vec<usize>, usize) {
    let m = moves.lock().unwrap();
    let mut elems: Vec<usize> = m.iter().map(|&(_, e, _)| e).collect();
    elems.sort_unstable();
    elems.dedup();
    (elems, m.iter().map(|&(_, _, b)| b).sum())
}

/// 2 nodes x 2 ranks: groups per world rank, each with a 2D hierarchy.
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

fn run_two_d(
    threshold: u64,
    inter_compression: super::codec::Compression,
    len: usize,
) -> Vec<Vec<f64>> {
    run_two_d_with(
        AlgoSettings {
            hierarchical_threshold: Some(threshold),
            inter_compression,
            ..Default::default()
        },
        len,
    )
}

fn run_two_d_with(settings: AlgoSettings, len: usize) -> Vec<Vec<f64>> {
    let per_rank = two_by_two_groups()
        .into_iter()
        .map(|groups| vec![(groups, settings)])
        .collect();
    on_engines(per_rank, move |rank, engine| {
        allreduce_f32(engine, &rank_values(rank, len), false, 0)
    })
}

#[test]
fn two_d_allreduce_equals_the_flat_sum_on_every_rank() {
    use super::codec::Compression;
    // Uneven lengths: not divisible by the intra size, smaller than it, and
    // long enough to be pipelined in chunks (5.2 MB: 2 chunks).
    for len in [0usize, 1, 3, 1001, 40_000, 1_300_001] {
        for threshold in [u64::MAX, 0] {
            let results = run_two_d(threshold, Compression::None, len);
            let inputs: Vec<Vec<f64>> = (0..4).map(|r| rank_values(r, len)).collect();
            let expected: Vec<f64> = (0..len)
                .map(|i| inputs.iter().map(|v| v[i]).sum())
                .collect();
            for (rank, got) in results.iter().enumerate() {
                assert_eq!(
                    got, &expected,
                    "len {len} threshold {threshold} rank {rank}"
                );
            }
        }
    }
}

#[test]
fn channels_taking_turns_on_the_link_sum_every_bucket() {
    use super::engine::{Job, RawBuf};
    use std::sync::mpsc;
    // 3 channels of 2D groups per rank; 7 buckets in flight at once, some
    // pipelined in chunks, some flat (over the threshold), some tiny.
    let settings = AlgoSettings {
        hierarchical_threshold: Some(3 << 20),
        ..Default::default()
    };
    let per_rank: Vec<Vec<ChannelSpec>> = {
        let mut channels: Vec<Vec<ChannelSpec>> = (0..4).map(|_| Vec::new()).collect();
        for _ in 0..3 {
            for (rank, groups) in two_by_two_groups().into_iter().enumerate() {
                channels[rank].push((groups, settings));
            }
        }
        channels
    };
    let lens = [700_000usize, 10, 1_100_000, 3, 50_000, 700_001, 0];
    let results = on_engines_with_turns(per_rank, true, move |rank, engine| {
        let (tx, rx) = mpsc::channel();
        let mut bufs: Vec<Vec<u8>> = lens
            .iter()
            .map(|&len| encode(DType::F32, &rank_values(rank, len)))
            .collect();
        for (bucket, buf) in bufs.iter_mut().enumerate() {
            let tx = tx.clone();
            engine.submit(Job {
                op: Collective::Allreduce { average: false },
                // SAFETY: `bufs` outlives every job: the loop below waits for
                // all completions before reading or dropping it.
                buf: unsafe { RawBuf::new(buf.as_mut_ptr(), buf.len()) },
                dtype: DType::F32,
                bucket: bucket as u64,
                share: false,
                done: Box::new(move |r| tx.send((bucket, r)).unwrap()),
            });
        }
        for _ in 0..lens.len() {
            let (bucket, r) = rx.recv().unwrap();
            r.unwrap_or_else(|e| panic!("rank {rank} bucket {bucket}: {e}"));
        }
        bufs.iter()
            .map(|b| decode(DType::F32, b))
            .collect::<Vec<_>>()
    });
    for (bucket, &len) in lens.iter().enumerate() {
        let inputs: Vec<Vec<f64>> = (0..4).map(|r| rank_values(r, len)).collect();
        let expected: Vec<f64> = (0..len)
            .map(|i| inputs.iter().map(|v| v[i]).sum())
            .collect();
        for (rank, got) in results.iter().enumerate() {
            assert_eq!(got[bucket], expected, "rank {rank} bucket {bucket}");
        }
    }
}

#[test]
fn the_auto_probe_gives_every_rank_the_same_numbers() {
    use super::auto::measure;
    let handles: Vec<_> = two_by_two_groups()
        .into_iter()
        .map(|groups| {
            std::thread::spawn(move || {
                let (groups, probe) = measure(groups, 1 << 20, deadline());
                assert!(groups.hierarchy.is_some());
                probe.unwrap()
            })
        })
        .collect();
    let probes: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(probes.iter().all(|p| *p == probes[0]), "{probes:?}");
    let p = probes[0];
    assert_eq!((p.bytes, p.intra_size, p.nodes), (1 << 20, 2, 2));
    assert!(p.flat_s > 0.0 && p.two_d_s > 0.0 && p.fp16_s > 0.0 && p.inter_latency_s > 0.0);
    let decision = p.decide(1, true);
    assert_eq!(decision.two_d, p.two_d_s < p.flat_s);
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

/// The 2D allreduce of [`two_d_value`]: every rank's result, and what its
/// intra-node and inter-node transports carried.
fn run_two_d_values(settings: AlgoSettings, len: usize) -> (Vec<Vec<f64>>, Vec<(Moves, Moves)>) {
    let (groups, moves) = counted_two_by_two_groups();
    let per_rank = groups
        .into_iter()
        .map(|groups| vec![(groups, settings)])
        .collect();
    let results = on_engines(per_rank, move |rank, engine| {
        let values: Vec<f64> = (0..len).map(|i| two_d_value(rank, i)).collect();
        allreduce_f32(engine, &values, false, 0)
    });
    (results, moves)
}

/// Checks every rank's result of a 2D allreduce against `want(i)` and
/// returns how many elements differ from `other(i)`.
fn check_two_d(
    results: &[Vec<f64>],
    want: impl Fn(usize) -> f64,
    other: impl Fn(usize) -> f64,
    what: &str,
) -> usize {
    let mut differ = 0;
    for i in 0..results[0].len() {
        let w = want(i);
        for (rank, got) in results.iter().enumerate() {
            assert_eq!(got[i], w, "{what}: rank {rank} element {i}");
        }
        if w != other(i) {
            differ += 1;
        }
    }
    differ
}

#[test]
fn two_d_pipelines_a_compressed_copy_of_the_bucket() {
    // Whole-bucket fp16: every rank's input is cast, and the node sums and
    // the sum across nodes are float16 additions (the chunks are scratch
    // memory holding the cast). 2.6M elements: a pipeline of 4 chunks.
    let settings = AlgoSettings {
        hierarchical_threshold: Some(u64::MAX),
        compression: super::codec::Compression::Fp16,
        ..Default::default()
    };
    let len = 2_600_001;
    let (results, moves) = run_two_d_values(settings, len);
    // Both steps carry float16: each rank's half of the bucket crosses the
    // node (reduce-scatter and allgather), a quarter of it the link.
    for (rank, (intra, inter)) in moves.iter().enumerate() {
        let ((intra_elems, intra_bytes), (inter_elems, inter_bytes)) = (moved(intra), moved(inter));
        assert_eq!(
            (intra_elems, inter_elems),
            (vec![2], vec![2]),
            "rank {rank}"
        );
        assert_eq!(intra_bytes, 2 * 2 * len, "rank {rank}");
        assert!(
            inter_bytes.abs_diff(len) <= 16,
            "rank {rank}: {inter_bytes}"
        );
    }
    let want = |i| two_d_reference(i, DType::F16, true, true);
    let exact = |i| two_d_reference(i, DType::F16, false, false);
    let inter_only = |i| two_d_reference(i, DType::F16, false, true);
    let vs_exact = check_two_d(&results, want, exact, "fp16, scope all");
    assert!(
        vs_exact > len / 2,
        "only {vs_exact} of {len} differ from the exact sum"
    );
    let vs_inter = check_two_d(&results, want, inter_only, "fp16, scope all");
    assert!(
        vs_inter > len / 10,
        "only {vs_inter} differ from scope inter"
    );
}

#[test]
fn two_d_can_compress_only_between_nodes() {
    use super::codec::Compression;
    // Scope inter: the node sums are exact (float32), then cast to float16
    // and summed across nodes in float16. 999 elements: one chunk; 1.3M: a
    // pipeline of 2 chunks.
    for len in [999, 1_300_001] {
        let settings = AlgoSettings {
            hierarchical_threshold: Some(u64::MAX),
            inter_compression: Compression::Fp16,
            ..Default::default()
        };
        let (results, moves) = run_two_d_values(settings, len);
        // float32 inside the node (the whole bucket in the reduce-scatter
        // and the allgather), float16 only between nodes (this rank's
        // half of the bucket).
        for (rank, (intra, inter)) in moves.iter().enumerate() {
            let ((intra_elems, intra_bytes), (inter_elems, inter_bytes)) =
                (moved(intra), moved(inter));
            assert_eq!(
                (intra_elems, inter_elems),
                (vec![4], vec![2]),
                "rank {rank}"
            );
            assert_eq!(intra_bytes, 2 * 4 * len, "rank {rank}");
            assert!(
                inter_bytes.abs_diff(len) <= 16,
                "rank {rank}: {inter_bytes}"
            );
        }
        let want = |i| two_d_reference(i, DType::F16, false, true);
        let exact = |i| two_d_reference(i, DType::F16, false, false);
        let all = |i| two_d_reference(i, DType::F16, true, true);
        // Compressed: not the exact sum...
        let vs_exact = check_two_d(&results, want, exact, "fp16, scope inter");
        assert!(
            vs_exact > len / 2,
            "only {vs_exact} of {len} differ from the exact sum"
        );
        // ...and only between nodes: not what casting every input gives.
        let vs_all = check_two_d(&results, want, all, "fp16, scope inter");
        assert!(
            vs_all > len / 10,
            "only {vs_all} of {len} differ from scope all"
        );
    }
}

/// Indices of the `k` entries of largest magnitude, ties to the lower
/// index, ascending: by a sort, independently of the engine's selection.
fn largest_k(values: &[f32], k: usize) -> Vec<u32> {
    let mut order: Vec<u32> = (0..values.len() as u32).collect();
    order.sort_by(|&a, &b| {
        let (x, y) = (values[a as usize].abs(), values[b as usize].abs());
        y.total_cmp(&x).then(a.cmp(&b))
    });
    order.truncate(k);
    order.sort_unstable();
    order
}

#[test]
fn top_k_sends_the_largest_entries_and_feeds_back_the_rest() {
    use super::sparse::TopKOptions;
    let p = 3;
    let n = 200;
    let data = move |rank: usize, step: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 13 + rank * 7 + step * 3) % 23) as f32 - 11.0) * 0.5)
            .collect()
    };
    let options = TopKOptions {
        ratio: 0.1,
        threshold: 0,
        fp16_values: false,
    };
    let settings = AlgoSettings {
        topk: Some(options),
        ..Default::default()
    };
    let results = with_engines(p, 1, settings, move |rank, engine| {
        (0..2)
            .map(|step| {
                let values: Vec<f64> = data(rank, step).iter().map(|&v| v as f64).collect();
                allreduce_f32(engine, &values, false, 9)
            })
            .collect::<Vec<_>>()
    });
    assert!(results.iter().all(|r| r == &results[0]), "ranks differ");

    // Reference: the same selection and error feedback, computed locally.
    let k = 20;
    let mut residuals = vec![vec![0f32; n]; p];
    for (step, got) in results[0].iter().enumerate() {
        let mut expected = vec![0f32; n];
        for (rank, residual) in residuals.iter_mut().enumerate() {
            let corrected: Vec<f32> = data(rank, step)
                .iter()
                .zip(residual.iter())
                .map(|(v, r)| v + r)
                .collect();
            let chosen = largest_k(&corrected, k);
            *residual = corrected.clone();
            for &i in &chosen {
                expected[i as usize] += corrected[i as usize];
                residual[i as usize] = 0.0;
            }
        }
        let expected: Vec<f64> = expected.iter().map(|&v| v as f64).collect();
        assert_eq!(got, &expected, "step {step}");
        // Sparse: at most k entries from each rank, not the dense sum.
        assert!(got.iter().filter(|v| **v != 0.0).count() <= p * k);
        let dense: Vec<f64> = (0..n)
            .map(|i| (0..p).map(|r| data(r, step)[i] as f64).sum())
            .collect();
        assert_ne!(got, &dense, "step {step}");
    }
}

#[test]
fn top_k_residuals_reset_when_a_bucket_changes_length() {
    use super::algo::Algorithm;
    use super::host::HostBackend;
    use super::sparse::TopKOptions;
    let ring = rings(1, 1).pop().unwrap().pop().unwrap();
    let options = TopKOptions {
        ratio: 0.25,
        threshold: 0,
        fp16_values: false,
    };
    let mut algorithm = Algorithm::new(AlgoSettings {
        topk: Some(options),
        ..Default::default()
    });
    let mut backend = HostBackend::new(Groups::flat(Box::new(ring)), deadline());
    let mut step = |values: &[f64]| {
        let tag = OpTag {
            op: 0,
            kind: OpKind::Allreduce,
            seq: 1,
            bucket: 0,
            dtype: DType::F32.code(),
            bytes: values.len() as u64 * 4,
        };
        let mut buf = encode(DType::F32, values);
        // SAFETY: `buf` lives, untouched elsewhere, until `end`.
        let mem = unsafe { backend.begin(&mut buf, deadline(), None) };
        let result = algorithm.allreduce(&mut backend, &tag, mem, DType::F32, false);
        backend.end();
        result.unwrap();
        decode(DType::F32, &buf)
    };
    // 8 values, k = 2: the two largest go, the rest stay as residual.
    assert_eq!(
        step(&[1., 2., 3., 4., 5., 6., 7., 8.]),
        vec![0., 0., 0., 0., 0., 0., 7., 8.]
    );
    // Same layout: residuals are added back (1..6 + 1 each).
    assert_eq!(step(&[1.; 8]), vec![0., 0., 0., 0., 6., 7., 0., 0.]);
    // DDP rebuilt its buckets (new length): old residuals are dropped.
    assert_eq!(step(&[1., 0., 0., 9.]), vec![0., 0., 0., 9.]);
}

#[test]
fn top_k_momentum_correction_matches_a_local_reference_on_every_rank() {
    use super::backend::TopKBlock;
    use super::sparse::{DgcOptions, TopKOptions};
    let (p, n, steps) = (3, 200, 6);
    let data = move |rank: usize, step: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 13 + rank * 7 + step * 3) % 23) as f32 - 11.0) * 0.25 * step as f32)
            .collect()
    };
    for masking in [false, true] {
        let dgc = DgcOptions {
            momentum: 0.9,
            masking,
            warmup_steps: 3,
            clip_norm: Some(60.0),
        };
        let options = TopKOptions {
            ratio: 0.05,
            threshold: 0,
            fp16_values: false,
        };
        let settings = AlgoSettings {
            topk: Some(options),
            dgc,
            ..Default::default()
        };
        let results = with_engines(p, 1, settings, move |rank, engine| {
            (0..steps)
                .map(|step| {
                    let values: Vec<f64> = data(rank, step).iter().map(|&v| v as f64).collect();
                    allreduce_f32(engine, &values, false, 4)
                })
                .collect::<Vec<_>>()
        });
        assert!(results.iter().all(|r| r == &results[0]), "ranks differ");

        // Reference: clip, velocity, accumulation, selection, masking, the
        // rank-order sum and the correction, in the kernels' float32 order.
        let m = 0.9f32;
        let max = (60.0 / (p as f64).sqrt()) as f32;
        let (mut u, mut v) = (vec![vec![0f32; n]; p], vec![vec![0f32; n]; p]);
        let mut previous = vec![0f32; n];
        let mut clipped = 0;
        for (step, got) in results[0].iter().enumerate() {
            let k = TopKBlock::new(n, dgc.density(0.05, step as u64), false, p).k;
            let mut sum = vec![0f32; n];
            for rank in 0..p {
                let mut g = data(rank, step);
                let sq: f64 = g.iter().map(|&x| x as f64 * x as f64).sum();
                let norm = sq.sqrt() as f32;
                if norm > max {
                    clipped += 1;
                    g.iter_mut().for_each(|x| *x *= max / norm);
                }
                for i in 0..n {
                    u[rank][i] = m * u[rank][i] + g[i];
                    v[rank][i] += u[rank][i];
                }
                for &i in &largest_k(&v[rank], k) {
                    let i = i as usize;
                    sum[i] += v[rank][i];
                    v[rank][i] = 0.0;
                    if masking {
                        u[rank][i] = 0.0;
                    }
                }
            }
            let expected: Vec<f64> = sum
                .iter()
                .zip(&previous)
                .map(|(s, q)| (s - m * q) as f64)
                .collect();
            previous = sum;
            assert_eq!(got, &expected, "masking {masking} step {step} (k {k})");
        }
        assert!(clipped > 0 && clipped < p * steps, "clipped {clipped}");
    }
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

/// Runs `f(rank, group)` on every member of a shared-memory group.
fn on_every_member<T: Send + 'static>(
    p: usize,
    f: impl Fn(usize, &mut dyn Transport) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let handles: Vec<_> = shm_groups(p)
        .into_iter()
        .enumerate()
        .map(|(rank, mut group)| {
            let f = f.clone();
            std::thread::spawn(move || f(rank, group.as_mut()))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Order-dependent values, so a different summation order shows.
fn wavy(rank: usize, len: usize, dtype: DType) -> Vec<u8> {
    let values: Vec<f64> = (0..len)
        .map(|i| ((i * 31 + rank * 7) as f64).sin() * 1e3)
        .collect();
    encode(dtype, &values)
}

/// Every collective of a sequence, on one transport per member: two
/// checked allreduces (several pieces each), allreduces divided by the
/// group size and by 3 (checked or not), a plain allreduce, a
/// reduce-scatter, an allgather, a broadcast from the last member and a
/// barrier.
fn collective_sequence(
    rank: usize,
    p: usize,
    len: usize,
    dtype: DType,
    t: &mut dyn Transport,
) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for round in 0..2 {
        let mut buf = wavy(rank + round, len, dtype);
        let tag = OpTag {
            op: 0,
            kind: OpKind::Allreduce,
            seq: round as u64,
            bucket: 0,
            dtype: dtype.code(),
            bytes: buf.len() as u64,
        };
        t.allreduce_checked(&tag, &mut buf, dtype, deadline())
            .unwrap();
        out.push(buf);
        let mut buf = wavy(rank + round + 2, len, dtype);
        let divisor = if round == 0 { p as f64 } else { 3.0 };
        let checked = (round == 0).then_some(&tag);
        t.allreduce_divided(checked, &mut buf, dtype, divisor, deadline())
            .unwrap();
        out.push(buf);
    }
    let mut plain = wavy(rank + 4, len, dtype);
    t.allreduce(&mut plain, dtype, deadline()).unwrap();
    out.push(plain);
    // Results that may stay in shared memory: bucket 5 twice (its region
    // again), bucket 6 between, checked or not.
    for (bucket, seed) in [(5u64, 13usize), (6, 14), (5, 15)] {
        let mut buf = wavy(rank + seed, len, dtype);
        let tag = OpTag {
            op: 0,
            kind: OpKind::Allreduce,
            seq: 10 + seed as u64,
            bucket,
            dtype: dtype.code(),
            bytes: buf.len() as u64,
        };
        let checked = (bucket == 5).then_some(&tag);
        let shared = t
            .allreduce_shared(checked, &mut buf, dtype, p as f64, bucket, deadline())
            .unwrap();
        // SAFETY: read before this bucket's next shared allreduce, which
        // no member starts before this one reaches it too.
        out.push(shared.map_or(buf, |s| unsafe { s.as_slice() }.to_vec()));
    }
    let mut rs = wavy(rank + 5, len, dtype);
    t.reduce_scatter(&mut rs, dtype, deadline()).unwrap();
    let mine = shard_range(len, p, rank);
    let e = dtype.size();
    out.push(rs[mine.start * e..mine.end * e].to_vec());
    let mut ag = wavy(rank + 9, len, dtype);
    t.allgather(&mut ag, e, deadline()).unwrap();
    out.push(ag);
    let mut bc = wavy(rank + 11, len, dtype);
    t.broadcast(&mut bc, p - 1, deadline()).unwrap();
    out.push(bc);
    t.barrier(deadline()).unwrap();
    out
}

/// Checks every member's [`collective_sequence`] against sums computed
/// here in float64 from the inputs (as `dtype` holds them), within the
/// rounding of the partial sums (every element of short buffers, every
/// 101st of long ones), and the allgather and broadcast bytes.
fn check_sequence(p: usize, len: usize, dtype: DType, results: &[Vec<Vec<u8>>]) {
    // Element `i` of `wavy(rank, ..)`, as `dtype` holds it.
    let input = |rank: usize, i: usize| -> f64 {
        let v = ((i * 31 + rank * 7) as f64).sin() * 1e3;
        decode(dtype, &encode(dtype, &[v]))[0]
    };
    let sum = |seed: usize, divisor: f64, i: usize| -> f64 {
        (0..p).map(|r| input(r + seed, i)).sum::<f64>() / divisor
    };
    // Each partial sum (at most 4 x 1e3) rounded once per addition.
    let eps = match dtype {
        DType::F16 => 2f64.powi(-10),
        DType::BF16 => 2f64.powi(-7),
        DType::F32 => 2f64.powi(-23),
        _ => 2f64.powi(-52),
    };
    let tolerance = 4e3 * eps * p as f64;
    let pf = p as f64;
    // (output index, input seed, divisor): see collective_sequence.
    let sums = [
        (0usize, 0usize, 1.0),
        (1, 2, pf),
        (2, 1, 1.0),
        (3, 3, 3.0),
        (4, 4, 1.0),
        (5, 13, pf),
        (6, 14, pf),
        (7, 15, pf),
    ];
    let stride = if len > 10_000 { 101 } else { 1 };
    let e = dtype.size();
    let at = |bytes: &[u8], i: usize| decode(dtype, &bytes[i * e..(i + 1) * e])[0];
    let gathered: Vec<Vec<u8>> = (0..p).map(|owner| wavy(owner + 9, len, dtype)).collect();
    let broadcast = wavy(p - 1 + 11, len, dtype);
    for (rank, out) in results.iter().enumerate() {
        let what = format!("p={p} {dtype:?} len={len} rank {rank}");
        for &(o, seed, divisor) in &sums {
            assert_eq!(out[o].len(), len * e, "{what} output {o}");
            for i in (0..len).step_by(stride) {
                let (got, want) = (at(&out[o], i), sum(seed, divisor, i));
                let d = (got - want).abs();
                assert!(d <= tolerance, "{what} output {o} [{i}]: {got} vs {want}");
            }
        }
        // The reduce-scatter: this member's shard.
        let mine = shard_range(len, p, rank);
        for i in mine.clone().step_by(stride) {
            let (got, want) = (at(&out[8], i - mine.start), sum(5, 1.0, i));
            assert!(
                (got - want).abs() <= tolerance,
                "{what} reduce-scatter [{i}]"
            );
        }
        for (owner, bytes) in gathered.iter().enumerate() {
            let range = shard_range(len, p, owner);
            let (a, b) = (range.start * e, range.end * e);
            assert_eq!(out[9][a..b], bytes[a..b], "{what} allgather");
        }
        assert_eq!(out[10], broadcast, "{what} broadcast");
    }
}

#[test]
fn shared_memory_gives_the_tcp_rings_bytes_for_every_collective() {
    for p in [2usize, 3, 4] {
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
            // Up to several pieces per collective (a piece carries 4 MiB / p).
            for len in [0usize, 1, p + 1, 1000, 700_003] {
                let tcp = on_every_rank(p, move |rank, ring| {
                    collective_sequence(rank, p, len, dtype, ring)
                });
                let shm = on_every_member(p, move |rank, group| {
                    collective_sequence(rank, p, len, dtype, group)
                });
                assert_eq!(shm, tcp, "p={p} {dtype:?} len={len}");
                check_sequence(p, len, dtype, &shm);
            }
        }
    }
}

#[test]
fn shared_memory_leaves_a_buckets_result_in_one_region_until_its_next_allreduce() {
    let p = 3;
    let len = 300_001;
    let seen = on_every_member(p, move |rank, group| {
        let mut results = Vec::new();
        for (step, bucket) in [(0usize, 1u64), (0, 2), (1, 1), (1, 2)] {
            let mut buf = wavy(rank + 7 * step + bucket as usize, len, DType::F32);
            let shared = group
                .allreduce_shared(None, &mut buf, DType::F32, p as f64, bucket, deadline())
                .unwrap()
                .expect("a result in shared memory");
            assert_eq!(shared.len(), len * 4);
            // SAFETY: as above, read before this bucket's next allreduce.
            let bytes = unsafe { shared.as_slice() }.to_vec();
            results.push((shared.as_ptr() as usize, bytes, shared));
        }
        let empty = group
            .allreduce_shared(None, &mut [], DType::F32, 1.0, 3, deadline())
            .unwrap();
        assert!(empty.is_none(), "an empty bucket needs no region");
        // One region per bucket: step 1 reused step 0's, and a result
        // read now is that of the bucket's last allreduce.
        assert_eq!(results[0].0, results[2].0);
        assert_eq!(results[1].0, results[3].0);
        assert_ne!(results[0].0, results[1].0);
        // SAFETY: no member runs another allreduce of bucket 1.
        assert_eq!(unsafe { results[0].2.as_slice() }, &results[2].1[..]);
        results
            .into_iter()
            .map(|(_, bytes, _)| bytes)
            .collect::<Vec<_>>()
    });
    let tcp = on_every_rank(p, move |rank, ring| {
        [(0usize, 1u64), (0, 2), (1, 1), (1, 2)]
            .iter()
            .map(|&(step, bucket)| {
                let mut buf = wavy(rank + 7 * step + bucket as usize, len, DType::F32);
                ring.allreduce_divided(None, &mut buf, DType::F32, p as f64, deadline())
                    .unwrap();
                buf
            })
            .collect::<Vec<_>>()
    });
    assert_eq!(seen, tcp);
}

#[test]
fn shared_memory_names_the_rank_that_issued_another_collective() {
    let errors = on_every_member(3, |rank, group| {
        let tag = OpTag {
            op: 0,
            kind: OpKind::Allreduce,
            seq: 0,
            bucket: if rank == 1 { 9 } else { 4 },
            dtype: DType::F32.code(),
            bytes: 8,
        };
        group.agree(&tag, deadline()).unwrap_err()
    });
    for err in errors {
        assert!(matches!(err, Error::Comm { peer: Some(1), .. }), "{err}");
        assert!(err.to_string().contains("rank 1 issued"), "{err}");
    }
}

#[test]
fn a_checked_allreduce_on_shared_memory_names_the_odd_rank_before_touching_the_buffer() {
    // The header travels with the first piece; with no piece (empty
    // buffers) it takes a barrier of its own. Rank 1 issued another bucket.
    for len in [0usize, 10, 700_003] {
        let results = on_every_member(3, move |rank, group| {
            let mut buf = wavy(rank, len, DType::F32);
            let tag = OpTag {
                op: 0,
                kind: OpKind::Allreduce,
                seq: 0,
                bucket: if rank == 1 { 9 } else { 4 },
                dtype: DType::F32.code(),
                bytes: buf.len() as u64,
            };
            let err = group
                .allreduce_divided(Some(&tag), &mut buf, DType::F32, 3.0, deadline())
                .unwrap_err();
            (err, buf == wavy(rank, len, DType::F32))
        });
        for (err, untouched) in results {
            assert!(matches!(err, Error::Comm { peer: Some(1), .. }), "{err}");
            assert!(
                err.to_string().contains("rank 1 issued"),
                "len={len}: {err}"
            );
            assert!(untouched, "len={len}: the buffer changed before the check");
        }
    }
}

#[test]
fn shared_memory_times_out_naming_the_missing_rank_and_aborts_wake_waiters() {
    let mut groups = shm_groups(3);
    let absent = groups.pop().unwrap(); // rank 2 never calls
    let mut one = groups.pop().unwrap();
    let mut zero = groups.pop().unwrap();
    let short = || Deadline::after(Duration::from_millis(300));
    let waiter = std::thread::spawn(move || {
        let started = Instant::now();
        let err = one
            .barrier(Deadline::after(Duration::from_secs(20)))
            .unwrap_err();
        (err, started.elapsed())
    });
    let err = zero.barrier(short()).unwrap_err();
    assert!(matches!(err, Error::CommTimeout { peer: 2, .. }), "{err}");
    assert!(err.to_string().contains("waiting for rank 2"), "{err}");
    // Rank 0's failure aborts the group: rank 1 stops long before its own
    // deadline, with the same kind of error, naming rank 2.
    let (err, waited) = waiter.join().unwrap();
    assert!(matches!(err, Error::CommTimeout { peer: 2, .. }), "{err}");
    assert!(waited < Duration::from_secs(10), "{waited:?}");
    // Later calls fail at once.
    assert!(zero.barrier(short()).is_err());
    drop(absent);
}

#[test]
fn an_aborter_ends_a_wait_on_shared_memory_from_another_thread() {
    let mut groups = shm_groups(2);
    let _absent = groups.pop().unwrap();
    let mut zero = groups.pop().unwrap();
    let abort = zero.aborter();
    let started = Instant::now();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        abort();
    });
    let err = zero
        .barrier(Deadline::after(Duration::from_secs(20)))
        .unwrap_err();
    killer.join().unwrap();
    assert!(matches!(err, Error::Comm { .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));
}

/// Small values every type holds exactly, whose products over 4 ranks
/// stay exact too: rank `rank`'s element `i`.
fn op_value(dtype: DType, rank: usize, i: usize) -> f64 {
    let v = ((i * 5 + rank * 3) % 7) as f64 - 3.0;
    match dtype {
        DType::U8 => v.abs(),
        DType::Bool => ((i + rank) % 3 == 0) as u8 as f64,
        _ => v,
    }
}

/// torch.distributed's collectives with every reduction on one transport
/// per member: allreduce and reduce-scatter with `op` (checked against a
/// reference computed here), allgather and all-to-all of equal blocks.
fn op_sequence(rank: usize, p: usize, len: usize, dtypes: &[DType], t: &mut dyn Transport) {
    for &dtype in dtypes {
        for op in ReduceOp::ALL {
            let values = |r: usize| (0..len).map(|i| op_value(dtype, r, i)).collect::<Vec<_>>();
            let want: Vec<f64> = (0..len)
                .map(|i| {
                    let all = (0..p).map(|r| op_value(dtype, r, i));
                    let v = match op {
                        ReduceOp::Sum => all.sum(),
                        ReduceOp::Product => all.product(),
                        ReduceOp::Min => all.fold(f64::INFINITY, f64::min),
                        ReduceOp::Max => all.fold(f64::NEG_INFINITY, f64::max),
                    };
                    if dtype == DType::Bool {
                        (v != 0.0) as u8 as f64
                    } else {
                        v
                    }
                })
                .collect();
            let tag = OpTag {
                op: op.code(),
                kind: OpKind::Allreduce,
                seq: 1,
                bucket: 0,
                dtype: dtype.code(),
                bytes: (len * dtype.size()) as u64,
            };
            let mut buf = encode(dtype, &values(rank));
            t.allreduce_op(Some(&tag), &mut buf, dtype, op, deadline())
                .unwrap();
            assert_eq!(
                decode(dtype, &buf),
                want,
                "allreduce {dtype:?} {op:?} p={p}"
            );
            let mut buf = encode(dtype, &values(rank));
            t.reduce_scatter_op(&mut buf, dtype, op, deadline())
                .unwrap();
            let mine = shard_range(len, p, rank);
            let e = dtype.size();
            assert_eq!(
                decode(dtype, &buf[mine.start * e..mine.end * e]),
                want[mine],
                "reduce-scatter {dtype:?} {op:?} p={p}"
            );
        }
    }
    // All-to-all: block j of rank r holds r * 1000 + j * 10 + k.
    let block = len / p;
    let mine: Vec<f64> = (0..p)
        .flat_map(|j| (0..block).map(move |k| (rank * 1000 + j * 10 + k) as f64))
        .collect();
    let mut buf = encode(DType::I64, &mine);
    t.alltoall(&mut buf, deadline()).unwrap();
    let want: Vec<f64> = (0..p)
        .flat_map(|j| (0..block).map(move |k| (j * 1000 + rank * 10 + k) as f64))
        .collect();
    assert_eq!(decode(DType::I64, &buf), want, "all-to-all p={p}");
}

#[test]
fn every_reduce_op_and_all_to_all_are_exact_on_tcp_and_shared_memory() {
    for p in [2usize, 3, 4] {
        let all = &DType::ALL[..];
        on_every_rank(p, move |rank, ring| op_sequence(rank, p, p * 3, all, ring));
        on_every_member(p, move |rank, group| {
            op_sequence(rank, p, p * 3, all, group)
        });
    }
    // Several pieces per collective on shared memory.
    let wide = &[DType::I64, DType::BF16][..];
    for p in [2usize, 4] {
        let len = p * 150_000;
        on_every_rank(p, move |rank, ring| op_sequence(rank, p, len, wide, ring));
        on_every_member(p, move |rank, group| op_sequence(rank, p, len, wide, group));
    }
}

#[test]
fn the_engine_runs_torch_collectives_in_order_and_averages_after_the_sum() {
    let p = 3;
    let results = with_engines(p, 1, AlgoSettings::default(), move |rank, engine| {
        let mut out = Vec::new();
        let mut buf = encode(DType::F32, &[rank as f64 + 1.0, 2.0 * rank as f64]);
        let mean = Collective::AllreduceOp {
            op: ReduceOp::Sum,
            mean: true,
        };
        engine.run(mean, &mut buf, DType::F32, 0).unwrap();
        out.push(decode(DType::F32, &buf));
        let mut buf = encode(DType::I32, &[rank as f64 - 1.0, 4.0, 5.0 * rank as f64]);
        let max = Collective::AllreduceOp {
            op: ReduceOp::Max,
            mean: false,
        };
        engine.run(max, &mut buf, DType::I32, 0).unwrap();
        out.push(decode(DType::I32, &buf));
        let mut buf = encode(DType::I64, &[rank as f64; 3]);
        let rs = Collective::ReduceScatter {
            op: ReduceOp::Min,
            mean: false,
        };
        engine.run(rs, &mut buf, DType::I64, 0).unwrap();
        out.push(decode(DType::I64, &buf[rank * 8..rank * 8 + 8]));
        let mut buf = vec![0u8; 3 * 2];
        buf[rank * 2..rank * 2 + 2].copy_from_slice(&[rank as u8, 7]);
        engine
            .run(Collective::Allgather, &mut buf, DType::U8, 0)
            .unwrap();
        out.push(decode(DType::U8, &buf));
        let mut buf = encode(
            DType::I8,
            &[
                rank as f64 * 10.0,
                rank as f64 * 10.0 + 1.0,
                rank as f64 * 10.0 + 2.0,
            ],
        );
        engine
            .run(Collective::AllToAll, &mut buf, DType::I8, 0)
            .unwrap();
        out.push(decode(DType::I8, &buf));
        // An average of integers is the sum, then the quotient rounded
        // toward zero: 8 / 3 and -8 / 3 are 2 and -2.
        let r = rank as f64;
        let mut buf = encode(DType::I64, &[r * r + 1.0, -(r * r) - 1.0]);
        engine.run(mean, &mut buf, DType::I64, 0).unwrap();
        out.push(decode(DType::I64, &buf));
        // A mean reduce-scatter divides this rank's shard only: blocks of
        // two, rank r contributes r + 1 and 10 * r to every block.
        let block = [rank as f64 + 1.0, 10.0 * rank as f64];
        let mut buf = encode(DType::F32, &block.repeat(p));
        let rs_mean = Collective::ReduceScatter {
            op: ReduceOp::Sum,
            mean: true,
        };
        engine.run(rs_mean, &mut buf, DType::F32, 0).unwrap();
        out.push(decode(DType::F32, &buf[rank * 8..rank * 8 + 8]));
        // An average of bools is refused, with a typed error.
        let mut buf = encode(DType::Bool, &[1.0]);
        let err = engine.run(mean, &mut buf, DType::Bool, 0).unwrap_err();
        assert!(err.to_string().contains("bool"), "{err}");
        out
    });
    for (rank, out) in results.iter().enumerate() {
        assert_eq!(out[0], vec![2.0, 2.0]);
        assert_eq!(out[1], vec![1.0, 4.0, 10.0]);
        assert_eq!(out[2], vec![0.0]);
        assert_eq!(out[3], vec![0.0, 7.0, 1.0, 7.0, 2.0, 7.0]);
        let r = rank as f64;
        assert_eq!(out[4], vec![r, 10.0 + r, 20.0 + r]);
        assert_eq!(out[5], vec![2.0, -2.0]);
        // (1 + 2 + 3) / 3 and (0 + 10 + 20) / 3.
        assert_eq!(out[6], vec![2.0, 10.0]);
    }
}

/// The counters of every rank's engine after `f` ran on it, as rows.
fn counted_runs(
    per_rank: Vec<Vec<ChannelSpec>>,
    f: impl Fn(usize, &Engine) + Send + Sync + Clone + 'static,
) -> Vec<Vec<super::counters::CounterRow>> {
    on_engines(per_rank, move |rank, engine| {
        f(rank, engine);
        engine.counters().snapshot()
    })
}

#[test]
fn engine_counters_count_the_bytes_the_ring_sent() {
    use super::codec::Compression;
    use super::counters::Path;
    // 3 ranks, 12 float32 (48 bytes): shards of 4 elements. A ring
    // allreduce sends 2 (p - 1) = 4 shards per rank: 4 x 16 bytes in
    // float32, 4 x 8 bytes on the float16 wire.
    for (compression, wire) in [(Compression::None, 64), (Compression::Fp16, 32)] {
        let settings = AlgoSettings {
            compression,
            ..Default::default()
        };
        let per_rank = rings(3, 1)
            .into_iter()
            .map(|chans| {
                chans
                    .into_iter()
                    .map(|c| (Groups::flat(Box::new(c)), settings))
                    .collect()
            })
            .collect();
        let rows = counted_runs(per_rank, |rank, engine| {
            for bucket in 0..2 {
                allreduce_f32(engine, &rank_values(rank, 12), true, bucket);
            }
            // A broadcast of 10 bytes from rank 0 along the ring 0 -> 1 -> 2:
            // rank 0 sends them, rank 1 forwards them, rank 2 sends nothing.
            let mut bytes = [rank as u8; 10];
            engine
                .run(Collective::Broadcast { root: 0 }, &mut bytes, DType::U8, 7)
                .unwrap();
        });
        for (rank, rows) in rows.iter().enumerate() {
            assert_eq!(rows.len(), 2, "rank {rank}: {rows:?}");
            let ring = rows[0];
            assert_eq!((ring.path, ring.codec), (Path::Ring, compression));
            assert_eq!((ring.buckets, ring.bytes_in), (2, 2 * 48), "rank {rank}");
            assert_eq!(ring.wire, [2 * wire, 0, 0], "rank {rank}, {compression:?}");
            let collective = rows[1];
            assert_eq!(collective.path, Path::Collective);
            assert_eq!((collective.buckets, collective.bytes_in), (1, 10));
            let forwarded = if rank == 2 { 0 } else { 10 };
            assert_eq!(collective.wire, [forwarded, 0, 0], "rank {rank}");
        }
    }
}

#[test]
fn engine_counters_count_what_shared_memory_members_wrote() {
    use super::counters::Path;
    // 2 members, 12 float32: each writes the other's half (24 bytes) and
    // the sums of its own half (24 bytes) for the other to read.
    let per_rank = shm_groups(2)
        .into_iter()
        .map(|g| vec![(Groups::flat(g), AlgoSettings::default())])
        .collect();
    let rows = counted_runs(per_rank, |rank, engine| {
        allreduce_f32(engine, &rank_values(rank, 12), false, 0);
    });
    for (rank, rows) in rows.iter().enumerate() {
        assert_eq!(rows.len(), 1, "rank {rank}: {rows:?}");
        assert_eq!(rows[0].path, Path::Ring);
        assert_eq!((rows[0].buckets, rows[0].bytes_in), (1, 48));
        assert_eq!(rows[0].wire, [48, 0, 0], "rank {rank}");
    }
}

#[test]
fn engine_counters_show_scope_inter_compressing_only_between_nodes() {
    use super::codec::Compression;
    use super::counters::Path;
    // 2 nodes of 2, 1000 float32 (4000 bytes), one chunk. Inside the node
    // (a ring of 2) the reduce-scatter sends the other half (2000 bytes)
    // and the allgather our half (2000): float32. Between nodes this
    // rank's 500 elements go as float16 (1000 bytes) through a ring of 2,
    // which sends half of them twice: 1000 bytes.
    let settings = AlgoSettings {
        hierarchical_threshold: Some(u64::MAX),
        inter_compression: Compression::Fp16,
        ..Default::default()
    };
    let per_rank = two_by_two_groups()
        .into_iter()
        .map(|groups| vec![(groups, settings)])
        .collect();
    let rows = counted_runs(per_rank, |rank, engine| {
        allreduce_f32(engine, &rank_values(rank, 1000), false, 0);
    });
    for (rank, rows) in rows.iter().enumerate() {
        assert_eq!(rows.len(), 1, "rank {rank}: {rows:?}");
        assert_eq!(
            (rows[0].path, rows[0].codec),
            (Path::TwoD, Compression::Fp16)
        );
        assert_eq!((rows[0].buckets, rows[0].bytes_in), (1, 4000));
        assert_eq!(rows[0].wire, [0, 4000, 1000], "rank {rank}");
    }
}

mod device;
mod sharded;
mod state;
