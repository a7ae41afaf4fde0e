//! The engines' state across steps in a checkpoint ([`crate::comm::state`]):
//! a state exported after `k` steps and imported into fresh engines gives,
//! on the next steps, the bits the uninterrupted engines give; without it
//! the bits differ; a state that does not fit is refused, naming what.

use std::sync::Arc;

use super::device::{watched_channels, HostKernels, Shared};
use super::*;
use crate::comm::device::{Comms, DeviceChannels, Kernels, Slot, Span};
use crate::comm::sparse::{DgcOptions, TopKOptions};
use crate::comm::state::EngineState;

/// Top-K at 5% with everything that keeps state: the momentum correction
/// (with masking), clipping and a warm-up longer than the first part.
fn settings() -> AlgoSettings {
    AlgoSettings {
        topk: Some(TopKOptions {
            ratio: 0.05,
            threshold: 0,
            fp16_values: false,
        }),
        dgc: DgcOptions {
            momentum: 0.9,
            masking: true,
            warmup_steps: 5,
            clip_norm: Some(40.0),
        },
        ..Default::default()
    }
}

/// Bucket lengths of the model: several buckets, so they spread over the
/// channels.
const LENS: [usize; 4] = [300, 128, 257, 64];

/// A gradient that changes from step to step, different on every rank.
fn gradient(rank: usize, step: usize, bucket: usize, n: usize) -> Vec<f64> {
    (0..n)
        .map(|i| {
            let x = ((i * 31 + rank * 17 + step * 7 + bucket * 5) % 41) as f64 - 20.0;
            x * 0.125 * (1.0 + (step % 3) as f64)
        })
        .collect()
}

/// Steps `steps` of every bucket on `engine`: each step's results, as bits.
fn run_steps(engine: &Engine, rank: usize, steps: std::ops::Range<usize>) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for step in steps {
        for (bucket, &n) in LENS.iter().enumerate() {
            let mut buf = encode(DType::F32, &gradient(rank, step, bucket, n));
            engine
                .run(
                    Collective::Allreduce { average: true },
                    &mut buf,
                    DType::F32,
                    bucket as u64,
                )
                .unwrap();
            out.push(buf);
        }
    }
    out
}

#[test]
fn a_cpu_engine_resumed_from_its_state_continues_bit_for_bit() {
    let (p, k, total) = (3, 3, 8);
    let whole = with_engines(p, 2, settings(), move |rank, e| {
        run_steps(e, rank, 0..total)
    });
    // Interrupted after k steps: the state of 2 channels ...
    let first = with_engines(p, 2, settings(), move |rank, e| {
        (run_steps(e, rank, 0..k), e.export_state().unwrap())
    });
    let states: Arc<Vec<EngineState>> = Arc::new(first.iter().map(|f| f.1.clone()).collect());
    for (rank, (part, state)) in first.iter().enumerate() {
        assert_eq!(part[..], whole[rank][..k * LENS.len()], "rank {rank}");
        assert_eq!(state.rank, rank);
        assert_eq!(state.buckets.len(), LENS.len());
        let b = &state.buckets[&2];
        assert_eq!(b.steps, k as u64);
        assert_eq!(b.residual.as_ref().map(Vec::len), Some(257 * 4));
        assert!(b.velocity.is_some() && b.previous_sum.is_some());
    }
    // ... imported into 3 fresh channels: each bucket lands on its new one.
    let resumed = {
        let states = states.clone();
        with_engines(p, 3, settings(), move |rank, e| {
            e.import_state(&states[rank]).unwrap();
            run_steps(e, rank, k..total)
        })
    };
    // Without the state, the same steps give other bits.
    let fresh = with_engines(p, 3, settings(), move |rank, e| {
        run_steps(e, rank, k..total)
    });
    for rank in 0..p {
        let rest = &whole[rank][k * LENS.len()..];
        assert!(resumed[rank] == rest, "rank {rank}: resumed differs");
        assert!(
            fresh[rank] != rest,
            "rank {rank}: a fresh engine gave the same bits"
        );
    }
    // Exported again, the resumed engines' state is the uninterrupted one's.
    let again = with_engines(p, 2, settings(), move |rank, e| {
        e.import_state(&states[rank]).unwrap();
        run_steps(e, rank, k..total);
        e.export_state().unwrap()
    });
    let end = with_engines(p, 1, settings(), move |rank, e| {
        run_steps(e, rank, 0..total);
        e.export_state().unwrap()
    });
    assert_eq!(again, end);
}

#[test]
fn a_two_d_cpu_engine_resumes_from_its_state() {
    let settings = AlgoSettings {
        hierarchical_threshold: Some(u64::MAX),
        ..settings()
    };
    let run = |states: Option<Arc<Vec<EngineState>>>, steps: std::ops::Range<usize>| {
        let per_rank = two_by_two_groups()
            .into_iter()
            .map(|groups| vec![(groups, settings)])
            .collect();
        on_engines(per_rank, move |rank, e| {
            if let Some(s) = &states {
                e.import_state(&s[rank]).unwrap();
            }
            (run_steps(e, rank, steps.clone()), e.export_state().unwrap())
        })
    };
    let whole = run(None, 0..6);
    let first = run(None, 0..2);
    let states = Arc::new(first.into_iter().map(|f| f.1).collect::<Vec<_>>());
    // 2D sparsifies each rank's shard of the bucket: 300 elements over 2.
    assert_eq!(
        states[0].buckets[&0].residual.as_ref().map(Vec::len),
        Some(150 * 4)
    );
    assert_eq!(states[0].settings["intra_size"], "2");
    let resumed = run(Some(states), 2..6);
    for rank in 0..4 {
        assert!(
            resumed[rank].0 == whole[rank].0[2 * LENS.len()..],
            "rank {rank}"
        );
        assert_eq!(resumed[rank].1, whole[rank].1, "rank {rank}");
    }
}

#[test]
fn a_state_that_does_not_fit_is_refused_and_nothing_changes() {
    let outcomes = with_engines(2, 2, settings(), move |rank, e| {
        run_steps(e, rank, 0..2);
        let mine = e.export_state().unwrap();
        let mismatch = |state: &EngineState| match e.import_state(state).unwrap_err() {
            Error::StateMismatch {
                key,
                expected,
                found,
            } => (key, expected, found),
            other => panic!("rank {rank}: not a StateMismatch: {other}"),
        };
        let other_rank = EngineState {
            rank: 1 - rank,
            ..mine.clone()
        };
        let other_setting = {
            let mut s = mine.clone();
            s.settings.insert("topk_ratio".into(), "0.1".into());
            s
        };
        let other_length = {
            let mut s = mine.clone();
            let b = s.buckets.get_mut(&1).unwrap();
            for buf in [&mut b.residual, &mut b.velocity, &mut b.previous_sum] {
                buf.as_mut().unwrap().truncate(100 * 4);
            }
            s
        };
        let found = [
            mismatch(&other_rank),
            mismatch(&other_setting),
            mismatch(&other_length),
        ];
        // Nothing was imported: the state is still the engine's own.
        assert_eq!(e.export_state().unwrap(), mine);
        found
    });
    for (rank, [r, s, l]) in outcomes.into_iter().enumerate() {
        assert_eq!(r.0, "rank");
        assert!(r.1.contains(&format!("rank {rank}")), "{r:?}");
        assert!(r.2.contains(&format!("rank {}", 1 - rank)), "{r:?}");
        assert_eq!(s.0, "setting topk_ratio");
        assert!(s.1.contains("0.05") && s.2.contains("0.1"), "{s:?}");
        assert_eq!(l.0, "bucket 1");
        assert!(l.1.starts_with("512 bytes") && l.2 == "400 bytes", "{l:?}");
    }
}

/// A device engine of one channel over `groups`, its buckets in host
/// buffers ([`HostKernels`]): steps `steps` of every bucket after importing
/// `state`, each step's results and the state at the end.
fn device_steps(
    rank: usize,
    groups: Groups,
    settings: AlgoSettings,
    state: Option<EngineState>,
    steps: std::ops::Range<usize>,
) -> (Vec<Vec<u8>>, EngineState) {
    let kernels = HostKernels;
    let mut engine = watched_channels(rank, &groups);
    engine.open(vec![Comms::Tcp(groups)], settings);
    if let Some(s) = state {
        engine.import_state(&kernels, &s, None).unwrap();
    }
    let mut out = Vec::new();
    for step in steps {
        for (bucket, &n) in LENS.iter().enumerate() {
            let bytes = encode(DType::F32, &gradient(rank, step, bucket, n));
            let (buffer, mem) = kernels.empty(bytes.len()).unwrap();
            let span = Span {
                buffer: &buffer,
                offset: 0,
                bytes: mem.bytes,
            };
            kernels.load(span, &bytes).unwrap();
            let slot = Slot {
                buffer: buffer.clone(),
                mem,
            };
            engine
                .allreduce(&kernels, slot, DType::F32, bucket as u64, true, 0)
                .unwrap();
            out.push(kernels.fetch(span).unwrap());
        }
    }
    let state = engine.export_state(&kernels).unwrap();
    engine.shutdown(&kernels);
    (out, state)
}

fn on_device_engines(
    settings: AlgoSettings,
    states: Option<Vec<EngineState>>,
    steps: std::ops::Range<usize>,
) -> Vec<(Vec<Vec<u8>>, EngineState)> {
    let mut states = states.map(|s| s.into_iter().map(Some).collect::<Vec<_>>());
    let handles: Vec<_> = two_by_two_groups()
        .into_iter()
        .enumerate()
        .map(|(rank, groups)| {
            let state = states.as_mut().and_then(|s| s[rank].take());
            let steps = steps.clone();
            std::thread::spawn(move || device_steps(rank, groups, settings, state, steps))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn a_device_engine_resumed_from_its_state_continues_bit_for_bit() {
    for two_d in [false, true] {
        let settings = AlgoSettings {
            hierarchical_threshold: two_d.then_some(u64::MAX),
            ..settings()
        };
        let whole = on_device_engines(settings, None, 0..7);
        let first = on_device_engines(settings, None, 0..3);
        let states: Vec<EngineState> = first.into_iter().map(|f| f.1).collect();
        let resumed = on_device_engines(settings, Some(states), 3..7);
        let fresh = on_device_engines(settings, None, 3..7);
        for rank in 0..4 {
            let rest = &whole[rank].0[3 * LENS.len()..];
            assert!(
                resumed[rank].0 == rest,
                "2D {two_d} rank {rank}: resumed differs"
            );
            assert!(
                fresh[rank].0 != rest,
                "2D {two_d} rank {rank}: fresh is the same"
            );
            assert_eq!(resumed[rank].1, whole[rank].1, "2D {two_d} rank {rank}");
        }
        // The device engine's state is the CPU engine's: a device state
        // resumes a CPU engine (and the other way round).
        if !two_d {
            let states = Arc::new(on_device_engines(settings, None, 0..3));
            let per_rank = two_by_two_groups()
                .into_iter()
                .map(|groups| vec![(groups, settings)])
                .collect();
            let cpu = on_engines(per_rank, move |rank, e| {
                e.import_state(&states[rank].1).unwrap();
                run_steps(e, rank, 3..7)
            });
            for rank in 0..4 {
                assert!(cpu[rank] == whole[rank].0[3 * LENS.len()..], "rank {rank}");
            }
        }
    }
}

#[test]
fn a_device_engine_refuses_a_state_that_does_not_fit() {
    let handles: Vec<_> = two_by_two_groups()
        .into_iter()
        .enumerate()
        .map(|(rank, groups)| {
            std::thread::spawn(move || {
                let kernels = HostKernels;
                let mut engine =
                    DeviceChannels::<Shared>::new(rank, 4, Duration::from_secs(20), None).unwrap();
                engine.open(vec![Comms::Tcp(groups)], settings());
                let state = EngineState {
                    rank: (rank + 1) % 4,
                    world_size: 4,
                    ..Default::default()
                };
                let rank_err = engine.import_state(&kernels, &state, None).unwrap_err();
                let channel_err = engine
                    .import_state(
                        &kernels,
                        &EngineState {
                            rank,
                            world_size: 4,
                            ..Default::default()
                        },
                        Some(3),
                    )
                    .unwrap_err();
                engine.shutdown(&kernels);
                let closed = engine.export_state(&kernels).unwrap_err();
                (
                    rank_err.to_string(),
                    channel_err.to_string(),
                    closed.to_string(),
                )
            })
        })
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        let (r, c, closed) = h.join().unwrap();
        assert!(
            r.contains(&format!("expected rank {rank}"))
                && r.contains(&format!("found rank {}", (rank + 1) % 4)),
            "{r}"
        );
        assert!(
            c.contains("channel 3 is not one of the engine's 1 channels"),
            "{c}"
        );
        assert!(
            closed.contains("not connected or was shut down"),
            "{closed}"
        );
    }
}
