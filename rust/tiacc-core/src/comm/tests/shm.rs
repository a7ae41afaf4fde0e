//! Shared memory: every collective gives the TCP ring's bytes, results
//! kept in shared memory, and its failures (another collective, a
//! timeout, an abort).

use super::*;

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
        let tag = allreduce_tag(round as u64, 0, dtype, buf.len() as u64);
        t.allreduce_with(&mut buf, &summing(Some(&tag), dtype, 1.0, 0))
            .unwrap();
        out.push(buf);
        let mut buf = wavy(rank + round + 2, len, dtype);
        let divisor = if round == 0 { p as f64 } else { 3.0 };
        let checked = (round == 0).then_some(&tag);
        t.allreduce_with(&mut buf, &summing(checked, dtype, divisor, 0))
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
        let tag = allreduce_tag(10 + seed as u64, bucket, dtype, buf.len() as u64);
        let checked = (bucket == 5).then_some(&tag);
        let shared = t
            .allreduce_shared(&mut buf, &summing(checked, dtype, p as f64, bucket))
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
                .allreduce_shared(&mut buf, &summing(None, DType::F32, p as f64, bucket))
                .unwrap()
                .expect("a result in shared memory");
            assert_eq!(shared.len(), len * 4);
            // SAFETY: as above, read before this bucket's next allreduce.
            let bytes = unsafe { shared.as_slice() }.to_vec();
            results.push((shared.as_ptr() as usize, bytes, shared));
        }
        let empty = group
            .allreduce_shared(&mut [], &summing(None, DType::F32, 1.0, 3))
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
                ring.allreduce_with(&mut buf, &summing(None, DType::F32, p as f64, 0))
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
        let tag = allreduce_tag(0, if rank == 1 { 9 } else { 4 }, DType::F32, 8);
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
            let tag = allreduce_tag(
                0,
                if rank == 1 { 9 } else { 4 },
                DType::F32,
                buf.len() as u64,
            );
            let err = group
                .allreduce_with(&mut buf, &summing(Some(&tag), DType::F32, 3.0, 0))
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
            let how = Reduction {
                op,
                ..summing(Some(&tag), dtype, 1.0, 0)
            };
            t.allreduce_with(&mut buf, &how).unwrap();
            assert_eq!(
                decode(dtype, &buf),
                want,
                "allreduce {dtype:?} {op:?} p={p}"
            );
            let mut buf = encode(dtype, &values(rank));
            let how = Reduction {
                op,
                ..summing(None, dtype, 1.0, 0)
            };
            t.reduce_scatter_with(&mut buf, &how).unwrap();
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
