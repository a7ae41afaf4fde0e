//! torch's reduce-scatter and all-gather over the 2D groups, and the
//! compressed reduce-scatter ([`crate::comm::sharded`]), on 2 x 2 engines.

use super::*;
use crate::comm::codec::Compression;
use crate::comm::counters::{CounterRow, Path};

/// Elements of each rank's block in these tests (not a multiple of the
/// ranks, so blocks do not line up with any shard of the whole buffer).
const BLOCK: usize = 1001;

/// Every rank's buffer, its intra-node and inter-node transports' moves,
/// and its engine's counters.
type GridRun = (Vec<Vec<f64>>, Vec<(Moves, Moves)>, Vec<Vec<CounterRow>>);

/// Runs `op` on float32 buffers of 4 blocks on 2 nodes x 2 ranks: every
/// rank's buffer, what its intra-node and inter-node transports carried,
/// and its engine's counters.
fn run_on_grid(
    settings: AlgoSettings,
    op: Collective,
    input: impl Fn(usize, usize) -> f64 + Send + Sync + Clone + 'static,
) -> GridRun {
    let (groups, moves) = counted_two_by_two_groups();
    let per_rank = groups
        .into_iter()
        .map(|groups| vec![(groups, settings)])
        .collect();
    let out = on_engines(per_rank, move |rank, engine| {
        let values: Vec<f64> = (0..4 * BLOCK).map(|i| input(rank, i)).collect();
        let mut buf = encode(DType::F32, &values);
        engine.run(op, &mut buf, DType::F32, 0).unwrap();
        (decode(DType::F32, &buf), engine.counters().snapshot())
    });
    let (results, counters) = out.into_iter().unzip();
    (results, moves, counters)
}

fn two_d(inter: Compression) -> AlgoSettings {
    AlgoSettings {
        hierarchical_threshold: Some(1),
        reduce_scatter_inter_compression: inter,
        ..Default::default()
    }
}

/// What each group's transport carried: `(kind, element size, bytes)`.
fn carried(moves: &Moves) -> Vec<(&'static str, usize, usize)> {
    moves.lock().unwrap().clone()
}

#[test]
fn a_two_d_reduce_scatter_is_the_exact_sum_and_crosses_nodes_with_half_the_buffer() {
    for mean in [false, true] {
        let op = Collective::ReduceScatter {
            op: ReduceOp::Sum,
            mean,
        };
        let (results, moves, counters) = run_on_grid(two_d(Compression::None), op, two_d_value);
        for (rank, got) in results.iter().enumerate() {
            for i in 0..BLOCK {
                let g = rank * BLOCK + i;
                let sum: f64 = (0..4).map(|r| two_d_value(r, g)).sum();
                let want = if mean { sum / 4.0 } else { sum };
                assert_eq!(got[g], want, "rank {rank} element {g} (mean {mean})");
            }
            let (intra, inter) = &moves[rank];
            // The whole buffer inside the node, this local rank's two
            // blocks across nodes: one block crosses the link per rank.
            assert_eq!(carried(intra), vec![("reduce-scatter", 4, 4 * BLOCK * 4)]);
            assert_eq!(carried(inter), vec![("reduce-scatter", 4, 2 * BLOCK * 4)]);
            let row = &counters[rank][0];
            assert_eq!(
                (row.path, row.codec),
                (Path::Collective2d, Compression::None)
            );
            assert_eq!(row.wire[0], 0, "rank {rank}: nothing on the world ring");
            assert!(
                row.wire[2] > 0,
                "rank {rank}: the inter-node group carried it"
            );
        }
    }
}

#[test]
fn a_two_d_reduce_scatter_can_compress_only_what_crosses_nodes() {
    for wire in [DType::F16, DType::BF16] {
        let op = Collective::ReduceScatter {
            op: ReduceOp::Sum,
            mean: false,
        };
        let settings = two_d(compression_for(wire));
        let (results, moves, counters) = run_on_grid(settings, op, two_d_value);
        let mut rounded = 0;
        for (rank, got) in results.iter().enumerate() {
            for i in 0..BLOCK {
                let g = rank * BLOCK + i;
                // Node sums exact, then cast; the sum across nodes in `wire`.
                let want = two_d_reference(g, wire, false, true);
                assert_eq!(got[g], want, "{wire:?}: rank {rank} element {g}");
                rounded += usize::from(want != two_d_reference(g, wire, false, false));
            }
            let (intra, inter) = &moves[rank];
            assert_eq!(carried(intra), vec![("reduce-scatter", 4, 4 * BLOCK * 4)]);
            assert_eq!(carried(inter), vec![("reduce-scatter", 2, 2 * BLOCK * 2)]);
            let row = &counters[rank][0];
            assert_eq!(
                (row.path, row.codec),
                (Path::Collective2d, compression_for(wire))
            );
        }
        assert!(
            rounded > BLOCK,
            "{wire:?}: only {rounded} elements were rounded"
        );
    }
}

#[test]
fn a_two_d_all_gather_fills_every_block_and_sends_each_block_across_once() {
    let own = |rank: usize, i: usize| {
        if i / BLOCK == rank {
            two_d_value(rank, i)
        } else {
            f64::NAN
        }
    };
    let (results, moves, counters) =
        run_on_grid(two_d(Compression::Bf16), Collective::Allgather, own);
    for (rank, got) in results.iter().enumerate() {
        for (g, &v) in got.iter().enumerate() {
            assert_eq!(v, two_d_value(g / BLOCK, g), "rank {rank} element {g}");
        }
        let (intra, inter) = &moves[rank];
        // Never compressed: gathered values are the senders' bits.
        assert_eq!(carried(inter), vec![("allgather", 4, 2 * BLOCK * 4)]);
        assert_eq!(carried(intra), vec![("allgather", 4, 4 * BLOCK * 4)]);
        let row = &counters[rank][0];
        assert_eq!(
            (row.path, row.codec),
            (Path::Collective2d, Compression::None)
        );
    }
}

#[test]
fn reductions_other_than_a_sum_stay_on_the_exact_world_ring() {
    let op = Collective::ReduceScatter {
        op: ReduceOp::Max,
        mean: false,
    };
    let (results, moves, counters) = run_on_grid(two_d(Compression::Fp16), op, two_d_value);
    for (rank, got) in results.iter().enumerate() {
        for i in 0..BLOCK {
            let g = rank * BLOCK + i;
            let want = (0..4).map(|r| two_d_value(r, g)).fold(f64::MIN, f64::max);
            assert_eq!(got[g], want, "rank {rank} element {g}");
        }
        assert!(carried(&moves[rank].0).is_empty() && carried(&moves[rank].1).is_empty());
        let row = &counters[rank][0];
        assert_eq!((row.path, row.codec), (Path::Collective, Compression::None));
    }
}

#[test]
fn a_flat_reduce_scatter_compresses_the_whole_ring_when_asked() {
    let settings = AlgoSettings {
        reduce_scatter_compression: Compression::Bf16,
        ..Default::default()
    };
    let results = with_engines(4, 1, settings, |rank, engine| {
        let values: Vec<f64> = (0..4 * BLOCK).map(|i| two_d_value(rank, i)).collect();
        let mut buf = encode(DType::F32, &values);
        let op = Collective::ReduceScatter {
            op: ReduceOp::Sum,
            mean: true,
        };
        engine.run(op, &mut buf, DType::F32, 0).unwrap();
        (decode(DType::F32, &buf), engine.counters().snapshot())
    });
    let mut rounded = 0;
    for (rank, (got, counters)) in results.iter().enumerate() {
        for i in 0..BLOCK {
            let g = rank * BLOCK + i;
            let exact: f64 = (0..4).map(|r| two_d_value(r, g)).sum::<f64>() / 4.0;
            // Four bfloat16 roundings of values below 6: within 2^-6.
            assert!(
                (got[g] - exact).abs() <= 0.016,
                "rank {rank} element {g}: {}",
                got[g]
            );
            rounded += usize::from(got[g] != exact);
        }
        let row = &counters[0];
        assert_eq!((row.path, row.codec), (Path::Collective, Compression::Bf16));
        assert_eq!(
            row.wire[0] as usize,
            3 * BLOCK * 2,
            "rank {rank}: a ring of bfloat16"
        );
    }
    assert!(rounded > BLOCK, "only {rounded} elements were rounded");
}
