//! The engine's torch collectives and its counters.

use super::*;

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
) -> Vec<Vec<crate::comm::counters::CounterRow>> {
    on_engines(per_rank, move |rank, engine| {
        f(rank, engine);
        engine.counters().snapshot()
    })
}

#[test]
fn engine_counters_count_the_bytes_the_ring_sent() {
    use crate::comm::codec::Compression;
    use crate::comm::counters::Path;
    // 3 ranks, 12 float32 (48 bytes): shards of 4 elements. A ring
    // allreduce sends 2 (p - 1) = 4 shards per rank: 4 x 16 bytes in
    // float32, 4 x 8 bytes on the float16 wire.
    for (compression, wire) in [(Compression::None, 64), (Compression::Fp16, 32)] {
        let settings = AlgoSettings {
            compression,
            ..Default::default()
        };
        let rows = counted_runs(flat_channels(3, 1, settings), |rank, engine| {
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
    use crate::comm::counters::Path;
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
    use crate::comm::codec::Compression;
    use crate::comm::counters::Path;
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
