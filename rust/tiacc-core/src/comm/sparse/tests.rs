//! Tests of the selection, the host kernels and the sparse allreduce.

use half::f16;

use super::pack::pack_with;
use super::reference::write_chosen;
use super::select::{add_mask, add_mask_portable, magnitude, mix};
use super::*;

#[test]
fn picks_the_largest_magnitudes() {
    let v = [0.1, -5.0, 3.0, 0.0, -0.2, 4.0];
    assert_eq!(top_k(&v, 3), vec![1, 2, 5]);
    assert_eq!(top_k(&v, 6), vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(top_k(&v, 0), Vec::<u32>::new());
    // Ties break by index, deterministically.
    assert_eq!(top_k(&[1.0, -1.0, 1.0], 2), vec![0, 1]);
}

#[test]
fn blocks_are_aligned_and_k_is_at_least_one() {
    let b = TopKBlock::new(1000, 0.01, true, 3);
    assert_eq!((b.k, b.value_size(), b.bytes()), (10, 2, 64));
    let b = TopKBlock::new(3, 0.01, false, 2);
    assert_eq!((b.k, b.bytes()), (1, 8));
    assert_eq!(TopKBlock::new(10, 1.0, false, 1).k, 10);
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn read(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32_at(c, 0)).collect()
}

/// Deterministic pseudo-random numbers (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Values of one of several kinds: spread (normal-ish, of
    /// different scales), few distinct (ties, zeros of both signs), or
    /// special (NaNs with different payloads and signs, infinities,
    /// subnormals).
    fn values(&mut self, n: usize, kind: usize) -> Vec<f32> {
        (0..n)
            .map(|_| match kind {
                0 => {
                    let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                    u * u * u * 10f32.powi(self.below(7) as i32 - 4)
                }
                1 => [0.0, -0.0, 1.0, -1.0, 2.0, 0.5, -2.0][self.below(7)],
                _ => match self.below(12) {
                    0 => f32::from_bits(0x7FC0_0000 | (self.next() as u32 & 0xFF)),
                    1 => f32::from_bits(0xFF80_0001 | (self.next() as u32 & 0x3F_FFFF)),
                    2 => f32::INFINITY,
                    3 => f32::NEG_INFINITY,
                    4 => f32::from_bits(self.next() as u32 & 0x807F_FFFF),
                    5 => -0.0,
                    6 => 0.0,
                    7 => f32::MAX,
                    _ => (self.next() >> 40) as f32 - (1u64 << 23) as f32,
                },
            })
            .collect()
    }
}

/// The selection by its definition: sorted by magnitude (total order
/// of the absolute values), ties to the lower index.
fn reference_top_k(values: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..values.len() as u32).collect();
    idx.sort_by(|&a, &b| {
        let (va, vb) = (values[a as usize].abs(), values[b as usize].abs());
        vb.total_cmp(&va).then(a.cmp(&b))
    });
    idx.truncate(k);
    idx.sort_unstable();
    idx
}

/// The pack of the first implementation: a corrected copy, the
/// reference selection, the residual rewritten.
fn reference_pack(d: &[f32], r: &mut [f32], layout: TopKBlock) -> Vec<u8> {
    let mut corrected: Vec<f32> = d.iter().zip(r.iter()).map(|(x, y)| x + y).collect();
    let chosen = reference_top_k(&corrected, layout.k);
    let mut out = vec![0u8; layout.bytes()];
    let offset = layout.values_offset();
    write_chosen(
        &mut corrected,
        &chosen,
        layout.fp16_values,
        &mut out,
        offset,
    );
    r.copy_from_slice(&corrected);
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Data and residual of `n` entries of `kind`. NaNs are put in one of
/// the two only: with NaNs in both, which payload the sum carries is
/// not specified.
fn inputs(rng: &mut Rng, n: usize, kind: usize) -> (Vec<f32>, Vec<f32>) {
    let d = rng.values(n, kind);
    let mut r = rng.values(n, kind);
    for (x, y) in d.iter().zip(r.iter_mut()) {
        if x.is_nan() && y.is_nan() {
            *y = 1.0;
        }
    }
    (d, r)
}

/// Sizes around the group size, and above the size from which the
/// threshold is estimated from a sample (65,536).
const SIZES: [usize; 11] = [1, 2, 3, 63, 64, 65, 129, 1000, 4097, 65_536, 70_001];

/// Counts to select from `n`: the extremes, around the share from
/// which the cut is made over the whole residual (n / 8), and one at
/// random (fewer for large `n`, to keep unoptimised test runs short).
fn ks(n: usize, rng: &mut Rng) -> Vec<usize> {
    let mut ks = if n > 5000 {
        vec![1, n / 100, n / 8, n / 8 + 1, n]
    } else {
        vec![1, 2, n / 100, n / 8, n / 8 + 1, n / 2, n - 1, n]
    };
    ks.push(1 + rng.below(n));
    ks.retain(|&k| k >= 1 && k <= n);
    ks.sort_unstable();
    ks.dedup();
    ks
}

#[test]
fn top_k_matches_the_definition() {
    let mut rng = Rng(1);
    for &n in &SIZES {
        for kind in 0..3 {
            let v = rng.values(n, kind);
            for k in ks(n, &mut rng) {
                assert_eq!(
                    top_k(&v, k),
                    reference_top_k(&v, k),
                    "n {n} kind {kind} k {k}"
                );
            }
        }
    }
}

#[test]
fn pack_matches_the_reference_bit_for_bit() {
    let mut rng = Rng(2);
    for &n in &SIZES {
        for kind in 0..3 {
            for (x, k) in ks(n, &mut rng).into_iter().enumerate() {
                for fp16 in [false, true] {
                    // Large sizes: one value width per count.
                    if n > 5000 && fp16 == (x % 2 == 0) {
                        continue;
                    }
                    let layout = TopKBlock {
                        n,
                        k,
                        fp16_values: fp16,
                        parts: 1,
                    };
                    let (d, r) = inputs(&mut rng, n, kind);
                    let mut want_r = r.clone();
                    let want = reference_pack(&d, &mut want_r, layout);
                    let mut got_r = f32s(&r);
                    let mut got = vec![0xAA; layout.bytes()];
                    pack(&f32s(&d), &mut got_r, layout, &mut got);
                    let what = format!("n {n} kind {kind} fp16 {fp16} k {k}");
                    assert_eq!(got, want, "{what}: block");
                    assert_eq!(bits(&read(&got_r)), bits(&want_r), "{what}: residual");
                }
            }
        }
    }
}

#[test]
fn any_candidate_threshold_gives_the_same_result() {
    // Thresholds from none (the cut over the whole residual), through
    // too low (more candidates than kept: cut over the whole residual)
    // and the exact cut, to too high (fewer than k candidates).
    let mut rng = Rng(3);
    for &n in &[65usize, 4097, 70_001] {
        for kind in 0..3 {
            for k in ks(n, &mut rng) {
                let layout = TopKBlock::new(n, k as f64 / n as f64, kind == 1, 1);
                let (d, r) = inputs(&mut rng, n, kind);
                let mut want_r = r.clone();
                let want = reference_pack(&d, &mut want_r, layout);
                let corrected: Vec<f32> = d.iter().zip(&r).map(|(x, y)| x + y).collect();
                let mut sorted: Vec<u32> = corrected.iter().map(|&v| magnitude(v)).collect();
                sorted.sort_unstable_by(|a, b| b.cmp(a));
                let exact = sorted[layout.k - 1];
                let thresholds = [
                    None,
                    Some(0),
                    Some(exact.saturating_sub(1)),
                    Some(exact),
                    Some(exact + 1),
                    Some(0x7F80_0000),
                    Some(u32::MAX),
                    Some(rng.next() as u32),
                ];
                for t in thresholds {
                    let mut got_r = r.clone();
                    let mut got = vec![0x55; layout.bytes()];
                    pack_with(&d, &mut got_r, layout, &mut got, t);
                    let what = format!("n {n} kind {kind} k {k} t {t:?}");
                    assert_eq!(got, want, "{what}: block");
                    assert_eq!(bits(&got_r), bits(&want_r), "{what}: residual");
                }
            }
        }
    }
}

#[test]
fn the_vector_mask_matches_the_portable_one() {
    let mut rng = Rng(4);
    for len in [1, 3, 4, 5, 17, 63, 64] {
        for kind in 0..3 {
            let (d, r) = inputs(&mut rng, len, kind);
            for t in [
                0,
                1,
                0x3F80_0000,
                0x7F80_0000,
                0x7FFF_FFFF,
                1 << 31,
                rng.next() as u32 >> 1,
            ] {
                let (mut a, mut b) = (r.clone(), r.clone());
                let got = add_mask(&d, &mut a, t);
                let want = add_mask_portable(&d, &mut b, t);
                assert_eq!(got, want, "len {len} kind {kind} t {t:#x}");
                assert_eq!(bits(&a), bits(&b));
            }
        }
    }
}

#[test]
fn unaligned_buffers_give_the_same_bytes() {
    let mut rng = Rng(5);
    let n = 1001;
    let layout = TopKBlock::new(n, 0.05, false, 2);
    let (d, r) = inputs(&mut rng, n, 0);
    let (d2, r2) = inputs(&mut rng, n, 0);
    let b = layout.bytes();
    // Aligned: two ranks' blocks, and their sum.
    let (mut want_r, mut want_r2) = (f32s(&r), f32s(&r2));
    let mut want = vec![0u8; 2 * b];
    pack(&f32s(&d), &mut want_r, layout, &mut want[..b]);
    pack(&f32s(&d2), &mut want_r2, layout, &mut want[b..]);
    let mut want_sum = vec![0u8; 4 * n];
    sum(&want, layout, &mut want_sum, |r| (r, format!("rank {r}"))).unwrap();
    // The same bytes, one past an aligned address.
    let shifted = |b: &[u8]| [&[0u8][..], b].concat();
    let (data, mut residual) = (shifted(&f32s(&d)), shifted(&f32s(&r)));
    let mut out = vec![0u8; b + 1];
    pack(&data[1..], &mut residual[1..], layout, &mut out[1..]);
    assert_eq!(&residual[1..], &want_r[..]);
    assert_eq!(&out[1..], &want[..b]);
    let gathered = shifted(&want);
    let mut dense = vec![0xEEu8; 4 * n + 1];
    sum(&gathered[1..], layout, &mut dense[1..], |r| {
        (r, format!("rank {r}"))
    })
    .unwrap();
    assert_eq!(&dense[1..], &want_sum[..]);
}

/// Bits, with every NaN as one: which payload NaN + NaN carries is not
/// specified (the compiler may order the operands either way).
fn canonical(v: &[f32]) -> Vec<u32> {
    v.iter()
        .map(|x| if x.is_nan() { u32::MAX } else { x.to_bits() })
        .collect()
}

/// Sums the blocks as the first implementation did: an accumulator,
/// block by block, pair by pair.
fn reference_sum(gathered: &[u8], layout: TopKBlock) -> Vec<f32> {
    let mut acc = vec![0f32; layout.n];
    for block in gathered.chunks_exact(layout.bytes()) {
        let (indices, values) = block.split_at(layout.values_offset());
        for j in 0..layout.k {
            let i = u32::from_le_bytes(indices[4 * j..4 * j + 4].try_into().unwrap());
            acc[i as usize] += if layout.fp16_values {
                f16::from_le_bytes(values[2 * j..2 * j + 2].try_into().unwrap()).to_f32()
            } else {
                f32::from_le_bytes(values[4 * j..4 * j + 4].try_into().unwrap())
            };
        }
    }
    acc
}

#[test]
fn sum_adds_in_rank_order_like_the_reference() {
    let mut rng = Rng(6);
    for &n in &[1usize, 65, 4097, 70_001] {
        for fp16 in [false, true] {
            for parts in [1, 3, 4] {
                for ascending in [true, false] {
                    let k = 1 + rng.below(n);
                    let layout = TopKBlock {
                        n,
                        k,
                        fp16_values: fp16,
                        parts,
                    };
                    let mut gathered = vec![0u8; parts * layout.bytes()];
                    for block in gathered.chunks_exact_mut(layout.bytes()) {
                        if ascending {
                            // What pack sends.
                            let kind = rng.below(3);
                            let (d, mut r) = inputs(&mut rng, n, kind);
                            r.fill(0.0);
                            pack(&f32s(&d), &mut f32s(&r), layout, block);
                        } else {
                            // Any order, repeats included.
                            let (indices, values) = block.split_at_mut(4 * k);
                            for c in indices.chunks_exact_mut(4) {
                                c.copy_from_slice(&(rng.below(n) as u32).to_le_bytes());
                            }
                            let kind = rng.below(3);
                            let v = rng.values(k, kind);
                            for (j, x) in v.iter().enumerate() {
                                if fp16 {
                                    values[2 * j..2 * j + 2]
                                        .copy_from_slice(&f16::from_f32(*x).to_le_bytes());
                                } else {
                                    values[4 * j..4 * j + 4].copy_from_slice(&x.to_le_bytes());
                                }
                            }
                        }
                    }
                    let mut out = vec![0x77u8; 4 * n];
                    sum(&gathered, layout, &mut out, |r| (r, format!("rank {r}"))).unwrap();
                    let what = format!("n {n} fp16 {fp16} parts {parts} ascending {ascending}");
                    assert_eq!(
                        canonical(&read(&out)),
                        canonical(&reference_sum(&gathered, layout)),
                        "{what}"
                    );
                }
            }
        }
    }
}

#[test]
fn a_bad_index_leaves_the_output_untouched() {
    let layout = TopKBlock::new(8, 0.25, true, 3);
    let mut gathered = vec![0u8; 3 * layout.bytes()];
    for (r, block) in gathered.chunks_exact_mut(layout.bytes()).enumerate() {
        block[..4].copy_from_slice(&(r as u32).to_le_bytes());
        block[4..8].copy_from_slice(&(7 + r as u32).to_le_bytes());
    }
    let mut out = vec![0x11u8; 32];
    let err = sum(&gathered, layout, &mut out, |r| (r, format!("rank {r}"))).unwrap_err();
    // Block 1 is the first with an index out of range (8).
    assert!(
        err.to_string()
            .contains("rank 1 sent Top-K index 8 for a buffer of 8 elements"),
        "{err}"
    );
    assert_eq!(out, vec![0x11u8; 32]);
}

#[test]
fn error_feedback_over_steps_is_exact() {
    // Residuals carried over several steps equal the reference's.
    let mut rng = Rng(7);
    let n = 100_003;
    for fp16 in [false, true] {
        let layout = TopKBlock::new(n, 0.01, fp16, 1);
        let mut want_r = vec![0f32; n];
        let mut got_r = f32s(&want_r);
        for step in 0..5 {
            let d = rng.values(n, step % 2);
            let want = reference_pack(&d, &mut want_r, layout);
            let mut got = vec![0u8; layout.bytes()];
            pack(&f32s(&d), &mut got_r, layout, &mut got);
            assert_eq!(got, want, "fp16 {fp16} step {step}");
            assert_eq!(
                bits(&read(&got_r)),
                bits(&want_r),
                "fp16 {fp16} step {step}"
            );
        }
    }
}

#[test]
fn pack_sends_the_largest_and_keeps_the_rest() {
    let layout = TopKBlock::new(5, 0.4, false, 1);
    let data = f32s(&[1.0, -3.0, 0.5, 2.0, 0.0]);
    let mut residual = f32s(&[0.0, 0.0, 0.0, 1.5, 0.0]);
    let mut out = vec![0xAAu8; layout.bytes()];
    pack(&data, &mut residual, layout, &mut out);
    // corrected = [1, -3, 0.5, 3.5, 0]: indices 1 and 3 go.
    assert_eq!(&out[..8], &[1, 0, 0, 0, 3, 0, 0, 0]);
    assert_eq!(read(&out[8..16]), vec![-3.0, 3.5]);
    assert_eq!(read(&residual), vec![1.0, 0.0, 0.5, 0.0, 0.0]);
    let mut dense = vec![0u8; 20];
    sum(&out, layout, &mut dense, |r| (r, format!("rank {r}"))).unwrap();
    assert_eq!(read(&dense), vec![0.0, -3.0, 0.0, 3.5, 0.0]);
}

#[test]
fn fp16_values_feed_back_their_rounding() {
    let layout = TopKBlock::new(2, 0.5, true, 1);
    let data = f32s(&[1.0001, 0.0]);
    let mut residual = f32s(&[0.0, 0.0]);
    let mut out = vec![0u8; layout.bytes()];
    pack(&data, &mut residual, layout, &mut out);
    let sent = f16::from_le_bytes([out[4], out[5]]).to_f32();
    assert_eq!(sent, f16::from_f32(1.0001).to_f32());
    assert_eq!(read(&residual)[0], 1.0001f32 - sent);
}

#[test]
fn an_index_out_of_range_names_the_sender() {
    let layout = TopKBlock::new(4, 0.25, false, 2);
    let mut gathered = vec![0u8; 2 * layout.bytes()];
    gathered[layout.bytes()..layout.bytes() + 4].copy_from_slice(&9u32.to_le_bytes());
    let mut out = vec![0u8; 16];
    let err = sum(&gathered, layout, &mut out, |r| {
        (r + 10, format!("rank {}", r + 10))
    })
    .unwrap_err();
    assert!(
        err.to_string().contains("rank 11 sent Top-K index 9"),
        "{err}"
    );
}

#[test]
fn the_warm_up_falls_geometrically_to_the_ratio() {
    let dgc = DgcOptions {
        warmup_steps: 3,
        ..DgcOptions::default()
    };
    let d: Vec<f64> = (0..5).map(|t| dgc.density(1.0 / 256.0, t)).collect();
    // 25%, then a factor 4 per step down to 1/256 at step 3 (DGC's stages).
    let want = [0.25, 1.0 / 16.0, 1.0 / 64.0, 1.0 / 256.0, 1.0 / 256.0];
    for (got, want) in d.iter().zip(want) {
        assert!((got - want).abs() < 1e-12 * want, "{d:?}");
    }
    assert_eq!(d[3], 1.0 / 256.0);
    // A ratio above the start density has nothing to warm up from.
    assert_eq!(dgc.density(0.5, 0), 0.5);
    assert_eq!(DgcOptions::default().density(0.01, 0), 0.01);
}

#[test]
fn state_buffers_have_distinct_keys() {
    let keys: Vec<u64> = [
        StateBuf::Residual,
        StateBuf::Velocity,
        StateBuf::PreviousSum,
    ]
    .iter()
    .flat_map(|s| [0, 7].map(|b| s.key(b).unwrap()))
    .collect();
    let mut unique = keys.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), keys.len(), "{keys:?}");
    assert_eq!(StateBuf::Residual.key(7).unwrap(), 7);
    assert!(StateBuf::Velocity.key(1 << 60).is_err());
}

#[test]
fn clipping_scales_down_to_the_norm_and_leaves_small_buckets() {
    let mut buf = f32s(&[3.0, -4.0]);
    clip_norm(&mut buf, 1.0);
    assert_eq!(read(&buf), vec![3.0 * 0.2, -4.0 * 0.2]);
    let mut small = f32s(&[0.3, 0.4]);
    clip_norm(&mut small, 1.0);
    assert_eq!(read(&small), vec![0.3, 0.4]);
}

#[test]
fn velocity_masking_and_correction_kernels() {
    let mut u = f32s(&[1.0, 2.0, -4.0]);
    momentum_step(&mut u, &f32s(&[0.5, 0.0, 1.0]), 0.5);
    assert_eq!(read(&u), vec![1.0, 1.0, -1.0]);
    let layout = TopKBlock::new(3, 0.5, false, 1);
    let mut block = vec![0u8; layout.bytes()];
    block[..8].copy_from_slice(&[2, 0, 0, 0, 0, 0, 0, 0]);
    mask_sent(&block, layout, &mut u);
    assert_eq!(read(&u), vec![0.0, 1.0, 0.0]);
    let (mut data, mut previous) = (f32s(&[1.0, 2.0, 0.0]), f32s(&[2.0, 0.0, -1.0]));
    momentum_correct(&mut data, &mut previous, 0.5);
    assert_eq!(read(&data), vec![0.0, 2.0, 0.5]);
    assert_eq!(read(&previous), vec![1.0, 2.0, 0.0]);
}

/// What the correction is for: an optimiser with momentum `m` (torch's
/// SGD: `M_0 = G_0`, `M_t = m * M_{t-1} + G_t`) that is handed `G_t =
/// S_t - m * S_{t-1}` holds `M_t = S_t`, so it steps by DGC's sums.
#[test]
fn an_optimiser_with_momentum_handed_the_corrected_sums_steps_by_the_sums() {
    let m = 0.9;
    let n = 64;
    let mut previous = vec![0u8; 4 * n];
    let mut buffer: Option<Vec<f32>> = None;
    for t in 0..200u32 {
        // Sparse-looking sums: most entries zero, some large.
        let sums: Vec<f32> = (0..n as u32)
            .map(|i| {
                let h = (i.wrapping_mul(2654435761) ^ t.wrapping_mul(40503))
                    .wrapping_mul(2246822519)
                    >> 16;
                if h % 5 == 0 {
                    (h % 2001) as f32 / 100.0 - 10.0
                } else {
                    0.0
                }
            })
            .collect();
        let mut grad = f32s(&sums);
        momentum_correct(&mut grad, &mut previous, m);
        let grad = read(&grad);
        let buf = match buffer.take() {
            None => grad,
            Some(b) => b.iter().zip(&grad).map(|(b, g)| m as f32 * b + g).collect(),
        };
        for (got, want) in buf.iter().zip(&sums) {
            assert!(
                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                "step {t}: {got} vs {want}"
            );
        }
        buffer = Some(buf);
    }
}
