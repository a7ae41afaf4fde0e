//! Top-K sparsification through the engine: what is sent, the
//! residuals, and the momentum correction.

use super::*;

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
    use crate::comm::sparse::TopKOptions;
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
    use crate::comm::algo::{Algorithm, Bucket};
    use crate::comm::host::HostBackend;
    use crate::comm::sparse::TopKOptions;
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
        let tag = allreduce_tag(1, 0, DType::F32, values.len() as u64 * 4);
        let mut buf = encode(DType::F32, values);
        // SAFETY: `buf` lives, untouched elsewhere, until `end`.
        let mem = unsafe { backend.begin(&mut buf, deadline(), None) };
        let result = algorithm.allreduce(
            &mut backend,
            Bucket {
                tag: &tag,
                buf: mem,
                dtype: DType::F32,
            },
            false,
        );
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
    use crate::comm::backend::TopKBlock;
    use crate::comm::sparse::{DgcOptions, TopKOptions};
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
