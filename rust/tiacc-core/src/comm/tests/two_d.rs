//! The 2D allreduce over 2 nodes x 2 ranks: its sums, its compression,
//! channels taking turns on the link, and the auto probe.

use super::*;

/// Bytes per element of everything `moves` recorded, and the bytes in all.
fn moved(moves: &Moves) -> (Vec<usize>, usize) {
    let m = moves.lock().unwrap();
    let mut elems: Vec<usize> = m.iter().map(|&(_, e, _)| e).collect();
    elems.sort_unstable();
    elems.dedup();
    (elems, m.iter().map(|&(_, _, b)| b).sum())
}

fn run_two_d(
    threshold: u64,
    inter_compression: crate::comm::codec::Compression,
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
    use crate::comm::codec::Compression;
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
    use crate::comm::engine::{Job, RawBuf};
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
    use crate::comm::auto::measure;
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
    assert!(p.rounds.iter().all(|r| r.flat_s > 0.0 && r.two_d_s > 0.0));
    assert!(p.fp16_s > 0.0 && p.inter_latency_s > 0.0);
    let decision = p.decide(1, true);
    let name = if decision.two_d { "2d" } else { "flat" };
    let start = format!("auto: chose {name} (5 rounds of a 1.0 MiB probe: median flat ");
    assert!(decision.line.starts_with(&start), "{}", decision.line);
}

/// [`crate::comm::auto::measure_skewed`] on a 2 x 2 world, every rank
/// adding `skew`: every rank's probe (they must agree).
fn skewed_auto_probe(
    skew: fn(crate::comm::auto::Candidate, usize) -> Duration,
) -> crate::comm::auto::Probe {
    use crate::comm::auto::measure_skewed;
    let handles: Vec<_> = two_by_two_groups()
        .into_iter()
        .map(|groups| {
            std::thread::spawn(move || {
                let (_, probe) = measure_skewed(groups, 1, deadline(), &skew);
                probe.unwrap()
            })
        })
        .collect();
    let probes: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(probes.iter().all(|p| *p == probes[0]), "{probes:?}");
    probes[0]
}

#[test]
fn the_auto_probe_is_not_fooled_by_delays_on_2d_in_a_minority_of_rounds() {
    use crate::comm::auto::{Candidate, ROUNDS};
    // Loopback times both in about a millisecond and says nothing about
    // a link between nodes; the skews stand in for one, as at 1 Gbit/s
    // (2D moving half of flat's bytes between nodes), scaled far above
    // anything loopback adds so that the outcome does not hang on this
    // machine's load. On rounds 1 and 3, a stall doubles 2D's time.
    fn delayed(round: usize) -> bool {
        round == 1 || round == 3
    }
    let p = skewed_auto_probe(|c, round| match c {
        Candidate::Flat => Duration::from_secs(2),
        Candidate::TwoD if delayed(round) => Duration::from_secs(5),
        Candidate::TwoD => Duration::from_secs(1),
    });
    for (round, r) in p.rounds.iter().enumerate() {
        assert!(r.flat_s >= 2.0, "round {round}: {r:?}");
        if delayed(round) {
            assert!(r.two_d_s >= 5.0, "round {round}: {r:?}");
        } else {
            assert!((1.0..2.0).contains(&r.two_d_s), "round {round}: {r:?}");
        }
    }
    let v = p.verdict();
    // The delayed rounds count as flat's, clearly; the rest as 2D's.
    assert_eq!(
        (v.rounds, v.prior_faster, v.challenger_wins),
        (ROUNDS, 3, 2)
    );
    assert!(v.two_d);
    let d = p.decide(1, true);
    assert!(
        d.line
            .contains("; 2d faster in 3 of 5, flat by >= 1.25x in 2;"),
        "{}",
        d.line
    );
    assert!(
        d.two_d
            && d.line
                .starts_with("auto: chose 2d (5 rounds of a 0.2 MiB probe")
    );
    // Delays on 2D in a majority of rounds do choose flat.
    let p = skewed_auto_probe(|c, round| match c {
        Candidate::Flat => Duration::from_secs(2),
        Candidate::TwoD if round != 2 => Duration::from_secs(5),
        Candidate::TwoD => Duration::from_secs(1),
    });
    let v = p.verdict();
    assert_eq!((v.prior_faster, v.challenger_wins), (1, 4));
    assert!(!v.two_d && p.decide(1, true).line.starts_with("auto: chose flat"));
}

#[test]
fn the_auto_probe_needs_the_2d_groups() {
    use crate::comm::auto::measure;
    let mut groups = two_by_two_groups().remove(0);
    groups.hierarchy = None;
    let (_, probe) = measure(groups, 1, deadline());
    assert!(
        matches!(probe, Err(Error::InvalidArgument(ref m)) if m.contains("2D groups")),
        "{probe:?}"
    );
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

/// Checks what every rank's transports carried in a 2D allreduce of
/// `len` float32 elements: elements of `intra_elem` bytes inside the node
/// (the whole bucket, in the reduce-scatter and the allgather), float16
/// between nodes (this rank's half of the bucket, a quarter crossing the
/// link).
fn check_two_d_moves(moves: &[(Moves, Moves)], intra_elem: usize, len: usize) {
    for (rank, (intra, inter)) in moves.iter().enumerate() {
        let ((intra_elems, intra_bytes), (inter_elems, inter_bytes)) = (moved(intra), moved(inter));
        assert_eq!(
            (intra_elems, inter_elems),
            (vec![intra_elem], vec![2]),
            "rank {rank}"
        );
        assert_eq!(intra_bytes, 2 * intra_elem * len, "rank {rank}");
        assert!(
            inter_bytes.abs_diff(len) <= 16,
            "rank {rank}: {inter_bytes}"
        );
    }
}

/// Checks every rank's result of a float16-compressed 2D allreduce of
/// `len` elements against `want` (as [`check_two_d`]), and that it is
/// compressed: it differs from the exact sum in more than half of the
/// elements, and from `other` (the other compression scope, named
/// `other_name`) in more than a tenth.
fn check_compressed_two_d(
    results: &[Vec<f64>],
    what: &str,
    want: impl Fn(usize) -> f64 + Copy,
    other: impl Fn(usize) -> f64,
    other_name: &str,
) {
    let len = results[0].len();
    let exact = |i| two_d_reference(i, DType::F16, false, false);
    let vs_exact = check_two_d(results, want, exact, what);
    assert!(
        vs_exact > len / 2,
        "{what}: only {vs_exact} of {len} differ from the exact sum"
    );
    let vs_other = check_two_d(results, want, other, what);
    assert!(
        vs_other > len / 10,
        "{what}: only {vs_other} of {len} differ from {other_name}"
    );
}

#[test]
fn two_d_pipelines_a_compressed_copy_of_the_bucket() {
    // Whole-bucket fp16: every rank's input is cast, and the node sums and
    // the sum across nodes are float16 additions (the chunks are scratch
    // memory holding the cast). 2.6M elements: a pipeline of 4 chunks.
    let settings = AlgoSettings {
        hierarchical_threshold: Some(u64::MAX),
        compression: crate::comm::codec::Compression::Fp16,
        ..Default::default()
    };
    let len = 2_600_001;
    let (results, moves) = run_two_d_values(settings, len);
    // Both steps carry float16.
    check_two_d_moves(&moves, 2, len);
    let want = |i| two_d_reference(i, DType::F16, true, true);
    let inter_only = |i| two_d_reference(i, DType::F16, false, true);
    check_compressed_two_d(&results, "fp16, scope all", want, inter_only, "scope inter");
}

#[test]
fn two_d_can_compress_only_between_nodes() {
    use crate::comm::codec::Compression;
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
        // float32 inside the node, float16 only between nodes.
        check_two_d_moves(&moves, 4, len);
        // Compressed, and only between nodes: not what casting every input
        // gives.
        let want = |i| two_d_reference(i, DType::F16, false, true);
        let all = |i| two_d_reference(i, DType::F16, true, true);
        check_compressed_two_d(&results, "fp16, scope inter", want, all, "scope all");
    }
}
