//! The device backend ([`crate::comm::device`]) without a framework: its
//! kernels over host memory ([`HostKernels`]) and its collectives over the
//! TCP rings, running the same algorithms as the host backend, on 2 nodes
//! x 2 ranks. The results must be the host engine's, bit for bit.

use std::collections::HashMap;

use super::*;
use crate::comm::algo::{Algorithm, Bucket};
use crate::comm::backend::{Mem, Momentum, TopKBlock};
use crate::comm::codec::{self, Compression};
use crate::comm::device::{
    Comms, DeviceBackend, DeviceChannels, KernelResult, Kernels, Slot, Span,
};
use crate::comm::sharded::{self, ReduceScatterPlan};
use crate::comm::sparse::{self, TopKOptions};

/// A host allocation a [`HostKernels`] hands out, freed when dropped.
pub(super) struct HostBuffer {
    ptr: *mut u8,
    len: usize,
}

impl HostBuffer {
    fn zeroed(len: usize) -> Self {
        let boxed = vec![0u8; len].into_boxed_slice();
        HostBuffer {
            len: boxed.len(),
            ptr: Box::into_raw(boxed).cast::<u8>(),
        }
    }

    fn mem(&self) -> Mem {
        Mem::new(self.ptr as usize, self.len)
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` and `len` came from `Box::into_raw` of a boxed
        // slice of `len` bytes in `zeroed`, and are freed only here.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr, self.len,
            )))
        }
    }
}

// SAFETY: a HostBuffer owns its allocation; the backend hands its bytes to
// one kernel or collective at a time.
unsafe impl Send for HostBuffer {}
// SAFETY: as for Send: shared handles only read the pointer; the bytes are
// written by one kernel or collective at a time.
unsafe impl Sync for HostBuffer {}

/// What [`HostKernels`] hands out: a shared handle, so a test can keep one
/// to read a bucket the engine took.
pub(super) type Shared = std::sync::Arc<HostBuffer>;

/// [`Kernels`] over host memory: the host backend's own kernels.
pub(super) struct HostKernels;

/// Device channels of rank `rank` of four whose watchdog watches the TCP
/// `groups` they are to be opened on.
pub(super) fn watched_channels(rank: usize, groups: &Groups) -> DeviceChannels<Shared> {
    let engine = DeviceChannels::<Shared>::new(rank, 4, Duration::from_secs(20), None).unwrap();
    engine.watch_tcp(std::slice::from_ref(groups));
    engine
}

/// `span`'s bytes.
///
/// # Safety
/// No other slice of the same bytes may be live while this one is: the
/// device backend passes each kernel disjoint spans of live buffers.
#[allow(clippy::mut_from_ref)]
unsafe fn bytes<'a>(span: Span<'a, Shared>) -> &'a mut [u8] {
    assert!(
        span.offset + span.bytes <= span.buffer.len,
        "a span past its buffer"
    );
    // SAFETY: inside the buffer (checked above), which outlives the span;
    // exclusivity is the caller's contract.
    unsafe { std::slice::from_raw_parts_mut(span.buffer.ptr.add(span.offset), span.bytes) }
}

impl Kernels for HostKernels {
    type Buffer = Shared;

    fn empty(&self, n: usize) -> KernelResult<(Shared, Mem)> {
        let buffer = HostBuffer::zeroed(n);
        let mem = buffer.mem();
        Ok((Shared::new(buffer), mem))
    }

    fn copy(&self, src: Span<'_, Shared>, dst: Span<'_, Shared>) -> KernelResult<()> {
        // SAFETY: the backend's spans of one kernel do not overlap.
        unsafe { bytes(dst).copy_from_slice(bytes(src)) };
        Ok(())
    }

    fn div(&self, buf: Span<'_, Shared>, dtype: DType, divisor: f64) -> KernelResult<()> {
        // SAFETY: one span.
        dtype.div_assign(unsafe { bytes(buf) }, divisor);
        Ok(())
    }

    fn cast(
        &self,
        src: Span<'_, Shared>,
        from: DType,
        factor: f64,
        dst: Span<'_, Shared>,
        to: DType,
    ) -> KernelResult<()> {
        // SAFETY: the backend's spans of one kernel do not overlap.
        let (s, d) = unsafe { (bytes(src), bytes(dst)) };
        if to.size() < from.size() {
            codec::encode(s, from, factor, d, to);
        } else {
            codec::decode(s, from, factor, d, to);
        }
        Ok(())
    }

    fn first_non_finite(
        &self,
        buf: Span<'_, Shared>,
        dtype: DType,
    ) -> KernelResult<Option<(usize, f64)>> {
        // SAFETY: one span.
        Ok(codec::first_non_finite(unsafe { bytes(buf) }, dtype))
    }

    fn topk_pack(
        &self,
        data: Span<'_, Shared>,
        residual: Span<'_, Shared>,
        out: Span<'_, Shared>,
        layout: TopKBlock,
    ) -> KernelResult<()> {
        // SAFETY: the backend's spans of one kernel do not overlap.
        unsafe { sparse::pack(bytes(data), bytes(residual), layout, bytes(out)) };
        Ok(())
    }

    fn topk_sum(
        &self,
        gathered: Span<'_, Shared>,
        out: Span<'_, Shared>,
        layout: TopKBlock,
    ) -> KernelResult<()> {
        // SAFETY: the backend's spans of one kernel do not overlap.
        let (g, o) = unsafe { (bytes(gathered), bytes(out)) };
        Ok(sparse::sum(g, layout, o, |r| (r, format!("rank {r}")))?)
    }

    fn clip_norm(&self, buf: Span<'_, Shared>, max_norm: f64) -> KernelResult<()> {
        // SAFETY: one span.
        sparse::clip_norm(unsafe { bytes(buf) }, max_norm);
        Ok(())
    }

    fn momentum(
        &self,
        op: Momentum,
        first: Span<'_, Shared>,
        second: Span<'_, Shared>,
        momentum: f64,
    ) -> KernelResult<()> {
        // SAFETY: the backend's spans of one kernel do not overlap.
        unsafe { sparse::momentum(op, bytes(first), bytes(second), momentum) };
        Ok(())
    }

    fn topk_mask(
        &self,
        block: Span<'_, Shared>,
        layout: TopKBlock,
        buf: Span<'_, Shared>,
    ) -> KernelResult<()> {
        // SAFETY: the backend's spans of one kernel do not overlap.
        unsafe { sparse::mask_sent(bytes(block), layout, bytes(buf)) };
        Ok(())
    }

    fn load(&self, dst: Span<'_, Shared>, data: &[u8]) -> KernelResult<()> {
        // SAFETY: one span.
        unsafe { bytes(dst).copy_from_slice(data) };
        Ok(())
    }

    fn fetch(&self, src: Span<'_, Shared>) -> KernelResult<Vec<u8>> {
        // SAFETY: one span.
        Ok(unsafe { bytes(src) }.to_vec())
    }

    fn synchronize(&self) -> KernelResult<()> {
        Ok(())
    }

    fn unlocked<R: Send>(&self, work: impl FnOnce() -> R + Send) -> R {
        work()
    }
}

/// Runs `f` on every rank of 2 nodes x 2 ranks with a device backend over
/// `input(rank)` (float32): every rank's buffer afterwards.
fn on_device_grid(
    input: impl Fn(usize) -> Vec<f64> + Send + Sync + Clone + 'static,
    f: impl Fn(&mut DeviceBackend<'_, HostKernels>, Mem) -> crate::error::Result<()>
        + Send
        + Sync
        + Clone
        + 'static,
) -> Vec<Vec<f64>> {
    let handles: Vec<_> = two_by_two_groups()
        .into_iter()
        .enumerate()
        .map(|(rank, groups)| {
            let (input, f) = (input.clone(), f.clone());
            std::thread::spawn(move || {
                let bytes = encode(DType::F32, &input(rank));
                let (buffer, mem) = HostKernels.empty(bytes.len()).unwrap();
                HostKernels
                    .load(
                        Span {
                            buffer: &buffer,
                            offset: 0,
                            bytes: bytes.len(),
                        },
                        &bytes,
                    )
                    .unwrap();
                let mut comms = Comms::Tcp(groups);
                let mut residuals = HashMap::new();
                let mut backend = DeviceBackend {
                    kernels: &HostKernels,
                    comms: &mut comms,
                    residuals: &mut residuals,
                    slots: vec![Slot { buffer, mem }],
                    stream: 0,
                    deadline: deadline(),
                    world_rank: rank,
                    bucket: 0,
                };
                f(&mut backend, mem).unwrap();
                let span = Span {
                    buffer: &backend.slots[0].buffer,
                    offset: 0,
                    bytes: mem.bytes,
                };
                decode(DType::F32, &HostKernels.fetch(span).unwrap())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Loads `values` as float32 into a fresh host buffer, hands its slot to
/// `op` (a collective over it) and reads the buffer back once `op` returns.
fn through_host_slot(values: &[f64], op: impl FnOnce(Slot<Shared>)) -> Vec<f64> {
    let bytes = encode(DType::F32, values);
    let (buffer, mem) = HostKernels.empty(bytes.len()).unwrap();
    let span = Span {
        buffer: &buffer,
        offset: 0,
        bytes: mem.bytes,
    };
    HostKernels.load(span, &bytes).unwrap();
    op(Slot {
        buffer: buffer.clone(),
        mem,
    });
    decode(DType::F32, &HostKernels.fetch(span).unwrap())
}

fn tag(bytes: usize) -> OpTag {
    allreduce_tag(1, 0, DType::F32, bytes as u64)
}

/// What the host engine gives for the same allreduce (its own backend).
fn host_allreduce(settings: AlgoSettings, len: usize) -> Vec<Vec<f64>> {
    let per_rank = two_by_two_groups()
        .into_iter()
        .map(|groups| vec![(groups, settings)])
        .collect();
    on_engines(per_rank, move |rank, engine| {
        let values: Vec<f64> = (0..len).map(|i| two_d_value(rank, i)).collect();
        allreduce_f32(engine, &values, true, 0)
    })
}

#[test]
fn the_device_backend_reduces_as_the_host_engine_does() {
    // 1001 elements: shards that do not split evenly (the device backend
    // pads them), and buckets small enough for one 2D chunk.
    let len = 1001;
    let settings = [
        AlgoSettings::default(),
        AlgoSettings {
            hierarchical_threshold: Some(u64::MAX),
            ..Default::default()
        },
        AlgoSettings {
            hierarchical_threshold: Some(u64::MAX),
            inter_compression: Compression::Fp16,
            ..Default::default()
        },
        AlgoSettings {
            compression: Compression::Bf16,
            ..Default::default()
        },
        AlgoSettings {
            topk: Some(TopKOptions {
                ratio: 0.1,
                threshold: 0,
                fp16_values: false,
            }),
            ..Default::default()
        },
        AlgoSettings {
            hierarchical_threshold: Some(u64::MAX),
            topk: Some(TopKOptions {
                ratio: 0.1,
                threshold: 0,
                fp16_values: true,
            }),
            ..Default::default()
        },
    ];
    for settings in settings {
        let want = host_allreduce(settings, len);
        let got = on_device_grid(
            move |rank| (0..len).map(|i| two_d_value(rank, i)).collect(),
            move |b, mem| {
                let mut algorithm = Algorithm::new(settings);
                algorithm.allreduce(
                    b,
                    Bucket {
                        tag: &tag(mem.bytes),
                        buf: mem,
                        dtype: DType::F32,
                    },
                    true,
                )
            },
        );
        assert_eq!(got, want, "{settings:?}");
    }
}

#[test]
fn the_device_backend_runs_the_sharded_collectives_over_the_2d_groups() {
    const BLOCK: usize = 333;
    let plan = ReduceScatterPlan {
        two_d: true,
        compression: Compression::None,
        inter_compression: Compression::None,
        scale: 1.0,
    };
    let scattered = on_device_grid(
        |rank| (0..4 * BLOCK).map(|i| two_d_value(rank, i)).collect(),
        move |b, mem| {
            sharded::reduce_scatter(b, &tag(mem.bytes), mem, DType::F32, 4.0, &plan).map(drop)
        },
    );
    for (rank, got) in scattered.iter().enumerate() {
        let mine = rank * BLOCK..(rank + 1) * BLOCK;
        for (g, &v) in got.iter().enumerate().filter(|(g, _)| mine.contains(g)) {
            let mean = (0..4).map(|r| two_d_value(r, g)).sum::<f64>() / 4.0;
            assert_eq!(v, mean, "rank {rank} element {g}");
        }
    }
    let gathered = on_device_grid(
        |rank| {
            (0..4 * BLOCK)
                .map(|i| {
                    if i / BLOCK == rank {
                        two_d_value(rank, i)
                    } else {
                        0.0
                    }
                })
                .collect()
        },
        |b, mem| sharded::allgather_two_d(b, &tag(mem.bytes), mem, 4),
    );
    for (rank, got) in gathered.iter().enumerate() {
        for (g, &v) in got.iter().enumerate() {
            assert_eq!(v, two_d_value(g / BLOCK, g), "rank {rank} element {g}");
        }
    }
}

#[test]
fn device_channels_probe_open_and_reduce_buckets_without_a_framework() {
    let len = 4096;
    let outcomes = on_two_by_two(move |rank, groups| {
        let mut engine = watched_channels(rank, &groups);
        let mut comms = vec![Comms::Tcp(groups)];
        // The auto probe through the device backend: every rank
        // measures the same numbers (they are exchanged).
        let probe = engine.probe(&HostKernels, &mut comms[0], 1 << 16, 0);
        let two_d = probe.unwrap().decide(1, false).two_d;
        let settings = AlgoSettings {
            hierarchical_threshold: two_d.then_some(u64::MAX),
            ..Default::default()
        };
        engine.open(comms, settings);
        assert!(engine.connected());
        let mut results = Vec::new();
        for bucket in 0..2u64 {
            let values: Vec<f64> = (0..len)
                .map(|i| two_d_value(rank, i + bucket as usize))
                .collect();
            let got = through_host_slot(&values, |slot| {
                engine
                    .allreduce(&HostKernels, slot, DType::F32, bucket, false, 0)
                    .unwrap_or_else(|e| panic!("rank {rank} bucket {bucket}: {e}"));
            });
            results.push(got);
        }
        engine.shutdown(&HostKernels);
        assert!(!engine.connected());
        (two_d, results)
    });
    // Every rank chose the same algorithm and holds the exact sums.
    assert!(outcomes.iter().all(|o| o.0 == outcomes[0].0));
    for (rank, (_, buckets)) in outcomes.iter().enumerate() {
        for (bucket, got) in buckets.iter().enumerate() {
            for (i, &v) in got.iter().enumerate() {
                let sum: f64 = (0..4).map(|r| two_d_value(r, i + bucket)).sum();
                assert_eq!(v, sum, "rank {rank} bucket {bucket} element {i}");
            }
        }
    }
}

#[test]
fn device_channels_run_torch_s_collectives_over_the_2d_groups() {
    use crate::comm::collective::DeviceCollective;
    use crate::comm::counters::Path;
    const BLOCK: usize = 257;
    let outcomes = on_two_by_two(move |rank, groups| {
        let mut engine = watched_channels(rank, &groups);
        let settings = AlgoSettings {
            hierarchical_threshold: Some(u64::MAX),
            ..Default::default()
        };
        engine.open(vec![Comms::Tcp(groups)], settings);
        let run = |op: DeviceCollective, values: Vec<f64>, bucket: u64| {
            through_host_slot(&values, |slot| {
                engine
                    .collective(&HostKernels, op, slot, DType::F32, bucket, 0)
                    .unwrap_or_else(|e| panic!("rank {rank} {op:?}: {e}"));
            })
        };
        let input: Vec<f64> = (0..4 * BLOCK).map(|i| two_d_value(rank, i)).collect();
        let scattered = run(
            DeviceCollective::ReduceScatter { mean: true },
            input.clone(),
            0,
        );
        let own: Vec<f64> = (0..4 * BLOCK)
            .map(|i| {
                if i / BLOCK == rank {
                    two_d_value(rank, i)
                } else {
                    0.0
                }
            })
            .collect();
        let gathered = run(DeviceCollective::Allgather, own, 1);
        let summed = run(DeviceCollective::Allreduce { mean: false }, input, 2);
        let ints = engine.collective(
            &HostKernels,
            DeviceCollective::Allreduce { mean: true },
            Slot {
                buffer: HostKernels.empty(8).unwrap().0,
                mem: Mem::new(0, 0),
            },
            DType::I32,
            3,
            0,
        );
        let paths: Vec<Path> = engine
            .counters()
            .snapshot()
            .iter()
            .map(|r| r.path)
            .collect();
        engine.shutdown(&HostKernels);
        (scattered, gathered, summed, ints.is_err(), paths)
    });
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        let (scattered, gathered, summed, int_mean_refused, paths) = outcome;
        for i in 0..4 * BLOCK {
            let sum: f64 = (0..4).map(|r| two_d_value(r, i)).sum();
            if i / BLOCK == rank {
                assert_eq!(
                    scattered[i],
                    sum / 4.0,
                    "rank {rank} reduce-scatter element {i}"
                );
            }
            assert_eq!(
                gathered[i],
                two_d_value(i / BLOCK, i),
                "rank {rank} all-gather {i}"
            );
            assert_eq!(summed[i], sum, "rank {rank} all-reduce element {i}");
        }
        assert!(
            int_mean_refused,
            "rank {rank}: an integer mean was not refused"
        );
        assert_eq!(
            paths,
            vec![Path::Collective, Path::Collective2d],
            "rank {rank}"
        );
    }
}

#[test]
fn a_device_engine_over_tcp_connects_probes_and_adopts_the_same_choice_on_every_rank() {
    use crate::comm::setup::{DeviceEngine, DeviceTransport, EngineSetup};
    use crate::comm::store::TcpPeers;
    use crate::comm::tcp::random_token;
    use crate::config::{AlgorithmChoice, CommConfig};
    let config = CommConfig {
        algorithm: AlgorithmChoice::Auto,
        num_streams: 1,
        shared_memory: false,
        timeout: Duration::from_secs(20),
        fusion_threshold: 1,
        ..CommConfig::default()
    };
    let engines: Vec<DeviceEngine<Shared>> = (0..4)
        .map(|rank| {
            let layout = crate::comm::Layout::new(rank, 4, 2).unwrap();
            let setup = EngineSetup::with_layout(&config, rank, 4, Some(2), Some(layout)).unwrap();
            let tcp = DeviceTransport::parse("tcp", Some("127.0.0.1")).unwrap();
            DeviceEngine::new(setup, tcp, None).unwrap()
        })
        .collect();
    let addresses: Vec<String> = engines
        .iter()
        .map(|e| e.tcp().unwrap().address().unwrap())
        .collect();
    let two_d: Vec<(String, String)> = engines
        .iter()
        .map(|e| e.tcp().unwrap().two_d_addresses().unwrap())
        .collect();
    let token = random_token().unwrap();
    let len = 1000;
    let handles: Vec<_> = engines
        .into_iter()
        .enumerate()
        .map(|(rank, mut engine)| {
            let (addresses, two_d) = (addresses.clone(), two_d.clone());
            std::thread::spawn(move || {
                assert_eq!(engine.transport(), "tcp");
                assert!(engine.probes());
                let (intra, inter) = engine.setup().two_d_members().unwrap();
                let intra: Vec<String> = intra.iter().map(|&r| two_d[r].0.clone()).collect();
                let inter: Vec<String> = inter.iter().map(|&r| two_d[r].1.clone()).collect();
                let peers = TcpPeers {
                    addresses: &addresses,
                    token: &token,
                    intra_addresses: Some(&intra),
                    inter_addresses: Some(&inter),
                };
                // Without the stream the probe needs, nothing connects.
                let err = engine.connect_tcp(&HostKernels, &peers, None).unwrap_err();
                assert!(err.to_string().contains("stream"), "{err}");
                assert!(engine.tcp().unwrap().address().is_some());
                engine.connect_tcp(&HostKernels, &peers, Some(0)).unwrap();
                assert!(engine.channels().connected());
                let again = engine.connect_tcp(&HostKernels, &peers, Some(0));
                assert!(again.is_err());
                let values: Vec<f64> = (0..len).map(|i| two_d_value(rank, i)).collect();
                let got = through_host_slot(&values, |slot| {
                    engine
                        .channels()
                        .allreduce(&HostKernels, slot, DType::F32, 0, false, 0)
                        .unwrap();
                });
                let line = engine.setup().auto_choice().map(str::to_string);
                let two_d = engine.setup().two_d();
                engine.shutdown(&HostKernels);
                assert!(!engine.channels().connected());
                (line, two_d, got)
            })
        })
        .collect();
    let outcomes: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let line = outcomes[0].0.clone().expect("auto ran");
    // The device engine's channels do not take turns on the link.
    assert!(line.contains("channels=1; compression"), "{line}");
    assert_eq!(outcomes[0].1, line.starts_with("auto: chose 2d"));
    for (rank, (l, two_d, got)) in outcomes.iter().enumerate() {
        assert_eq!(l.as_deref(), Some(line.as_str()), "rank {rank}");
        assert_eq!(*two_d, outcomes[0].1, "rank {rank}");
        for (i, &v) in got.iter().enumerate() {
            let sum: f64 = (0..4).map(|r| two_d_value(r, i)).sum();
            assert_eq!(v, sum, "rank {rank} element {i}");
        }
    }
}
