//! Top-K sparsification with error feedback (LightCC's `LIGHT_TOPK_*`).
//!
//! Each rank adds the residual it kept from earlier steps to its bucket,
//! sends only the `k = ceil(ratio * n)` entries of largest magnitude as
//! (index, value) pairs, and keeps the rest as the new residual. Ranks
//! allgather their pairs and every rank adds them up in rank order, so all
//! ranks end with identical bytes. With the 2D hierarchy the node first
//! reduces densely and only the inter-node step is sparse.
//!
//! Opt-in, for optimisers with momentum ([`DgcOptions`], after Deep
//! Gradient Compression, Lin et al. 2018): momentum correction (each rank
//! keeps a velocity `u = m * u + g` and accumulates `v += u`; Top-K selects
//! from `v`), optionally momentum factor masking (what was sent is zeroed
//! in `u` as in `v`, where float16 values leave only their rounding),
//! local gradient clipping, and a warm-up from a high density to the
//! ratio. The user's optimiser keeps its own momentum `m`: with `S_t` the
//! averaged sparse sum of step `t`, DDP is handed `G_t = S_t - m * S_{t-1}`,
//! so its momentum buffer `m * M_{t-1} + G_t` equals `S_t` (by induction
//! from `M_0 = G_0 = S_0`) and the optimiser's step is DGC's step.
//!
//! The step itself ([`sparse_allreduce`]) runs on any [`Backend`]; this
//! module also holds the host kernels ([`pack`], [`sum`], and for the
//! momentum correction [`clip_norm`], [`momentum_step`], [`mask_sent`],
//! [`momentum_correct`]) that the host backend runs for it. The device
//! backend runs the same kernels as torch operations, on the same wire
//! layout ([`TopKBlock`]).

use std::collections::HashMap;

use half::f16;

use super::backend::{Backend, GroupId, Mem, Shards};
use super::dtype::DType;
use crate::error::{Error, Result};

/// Top-K settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TopKOptions {
    /// Fraction of entries sent, in (0, 1].
    pub ratio: f64,
    /// Only buckets of at least this many bytes are sparsified.
    pub threshold: u64,
    /// Send values as float16 instead of float32.
    pub fp16_values: bool,
}

impl TopKOptions {
    /// Whether a bucket of `dtype` and `bytes` is sparsified (float32
    /// buckets of at least the threshold; the others go dense).
    pub fn applies(&self, dtype: DType, bytes: usize) -> bool {
        dtype == DType::F32 && bytes as u64 >= self.threshold
    }
}

/// The density a Top-K warm-up starts from (DGC's first stage, 25%), or the
/// ratio when that is higher.
pub const WARMUP_START_DENSITY: f64 = 0.25;

/// Momentum correction, clipping and warm-up for Top-K (see the module
/// docs). The default changes nothing: plain Top-K with error feedback.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DgcOptions {
    /// The optimiser's momentum; 0 turns the correction off.
    pub momentum: f64,
    /// Zero the velocity where entries were sent (momentum factor masking).
    pub masking: bool,
    /// Allreduces of a bucket over which its density falls from
    /// [`WARMUP_START_DENSITY`] to the ratio; 0: no warm-up.
    pub warmup_steps: u64,
    /// Each rank scales its share of the averaged gradient of a bucket to
    /// an L2 norm of at most `clip_norm / sqrt(ranks exchanging)`.
    pub clip_norm: Option<f64>,
}

impl Default for DgcOptions {
    fn default() -> Self {
        DgcOptions {
            momentum: 0.0,
            masking: false,
            warmup_steps: 0,
            clip_norm: None,
        }
    }
}

impl DgcOptions {
    /// The density of allreduce `step` (0-based) of a bucket: during the
    /// warm-up it falls geometrically from [`WARMUP_START_DENSITY`] (at step
    /// 0) towards `ratio` (reached at `warmup_steps`). Every rank computes
    /// the same value from the same step count.
    pub fn density(&self, ratio: f64, step: u64) -> f64 {
        let start = WARMUP_START_DENSITY.max(ratio);
        if step >= self.warmup_steps {
            return ratio;
        }
        let progress = step as f64 / self.warmup_steps as f64;
        start * (ratio / start).powf(progress)
    }
}

/// A bucket's per-rank buffers that live across steps (in the backend,
/// like the residual).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateBuf {
    /// Error feedback: what was not sent yet (`v` with momentum correction).
    Residual,
    /// The momentum correction's velocity `u`.
    Velocity,
    /// The last averaged sparse sum `S_{t-1}`.
    PreviousSum,
}

impl StateBuf {
    /// The key of `bucket`'s buffer in [`Backend::residual`]: the bucket
    /// itself for the residual, the top bits tell the others apart.
    pub fn key(self, bucket: u64) -> Result<u64> {
        if bucket >> 60 != 0 {
            return Err(Error::InvalidArgument(format!(
                "Top-K: bucket index {bucket} is too large"
            )));
        }
        Ok(match self {
            StateBuf::Residual => bucket,
            StateBuf::Velocity => bucket | 1 << 62,
            StateBuf::PreviousSum => bucket | 2 << 62,
        })
    }
}

/// The bookkeeping of one channel's sparse allreduces.
#[derive(Debug, Clone, Default)]
pub struct SparseState {
    /// Elements of each bucket's state buffers: when one changes (DDP
    /// rebuilt its buckets) every buffer is dropped.
    lens: HashMap<u64, usize>,
    /// Sparse allreduces of each bucket so far (the same on every rank).
    steps: HashMap<u64, u64>,
}

/// One rank's block of (index, value) pairs in the allgathered buffer: `k`
/// indices (u32), then `k` values (float32 or float16), little-endian,
/// padded to a multiple of 8 bytes so that every block starts aligned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopKBlock {
    /// Elements of the dense buffer.
    pub n: usize,
    /// Pairs per rank.
    pub k: usize,
    /// Values travel as float16.
    pub fp16_values: bool,
    /// Blocks in the gathered buffer (ranks of the group).
    pub parts: usize,
}

impl TopKBlock {
    /// The layout for `n` elements at `ratio` over `parts` ranks.
    pub fn new(n: usize, ratio: f64, fp16_values: bool, parts: usize) -> Self {
        let k = ((n as f64 * ratio).ceil() as usize).clamp(1, n.max(1));
        TopKBlock {
            n,
            k,
            fp16_values,
            parts,
        }
    }

    /// Bytes per value.
    pub fn value_size(&self) -> usize {
        if self.fp16_values {
            2
        } else {
            4
        }
    }

    /// Offset of the values inside a block.
    pub fn values_offset(&self) -> usize {
        4 * self.k
    }

    /// Bytes of one block.
    pub fn bytes(&self) -> usize {
        (self.k * (4 + self.value_size())).next_multiple_of(8)
    }
}

/// Indices of the `k` entries of largest magnitude, ascending. Linear time
/// (quickselect), not a full sort.
pub fn top_k(values: &[f32], k: usize) -> Vec<u32> {
    let n = values.len();
    let mut idx: Vec<u32> = (0..n as u32).collect();
    if k == 0 {
        return Vec::new();
    }
    if k < n {
        // Descending by magnitude; the index breaks ties so every run of the
        // same data picks the same entries.
        idx.select_nth_unstable_by(k - 1, |&a, &b| {
            let (va, vb) = (values[a as usize].abs(), values[b as usize].abs());
            vb.total_cmp(&va).then(a.cmp(&b))
        });
        idx.truncate(k);
    }
    idx.sort_unstable();
    idx
}

/// The sparse allreduce of float32 `data` over `group`, with error
/// feedback and, when `dgc` asks, momentum correction. `state` remembers
/// each bucket's length (when one changes, DDP rebuilt its buckets and every
/// residual is dropped) and step count (for the warm-up).
pub fn sparse_allreduce(
    b: &mut dyn Backend,
    group: GroupId,
    bucket: u64,
    data: Mem,
    options: &TopKOptions,
    dgc: &DgcOptions,
    state: &mut SparseState,
) -> Result<()> {
    let n = data.bytes / 4;
    if n == 0 {
        return Ok(());
    }
    if state.lens.get(&bucket).is_some_and(|&len| len != n) {
        b.clear_residuals();
        state.lens.clear();
    }
    state.lens.insert(bucket, n);
    let step = state.steps.entry(bucket).or_insert(0);
    let density = dgc.density(options.ratio, *step);
    *step += 1;
    let residual = b.residual(StateBuf::Residual.key(bucket)?, n * 4)?;
    let (size, rank) = (b.size(group), b.rank(group));
    let layout = TopKBlock::new(n, density, options.fp16_values, size);
    let gathered = b.alloc(layout.bytes() * size)?;
    // Equal blocks: shard r of the gathered buffer is rank r's block.
    let shards = Shards::in_place(gathered, 1, size, rank)?;
    if let Some(norm) = dgc.clip_norm {
        // DGC's local clipping: `data` is this rank's share of the average,
        // so the threshold of the sum is split as sqrt(size).
        b.clip_norm(data, norm / (size as f64).sqrt())?;
    }
    let momentum = dgc.momentum != 0.0;
    if !momentum {
        b.topk_pack(data, residual, layout, shards.mine)?;
    } else {
        let velocity = b.residual(StateBuf::Velocity.key(bucket)?, n * 4)?;
        b.momentum_step(velocity, data, dgc.momentum)?;
        b.topk_pack(velocity, residual, layout, shards.mine)?;
        if dgc.masking {
            b.topk_mask(shards.mine, layout, velocity)?;
        }
    }
    b.allgather(group, shards, gathered, 1)?;
    b.topk_sum(gathered, layout, data, group, bucket)?;
    if momentum {
        let previous = b.residual(StateBuf::PreviousSum.key(bucket)?, n * 4)?;
        b.momentum_correct(data, previous, dgc.momentum)?;
    }
    Ok(())
}

fn f32_at(bytes: &[u8], i: usize) -> f32 {
    f32::from_ne_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]])
}

/// Host kernel of [`Backend::topk_pack`] (float32, native-endian buffers).
pub fn pack(data: &[u8], residual: &mut [u8], layout: TopKBlock, out: &mut [u8]) {
    let k = layout.k;
    let mut corrected: Vec<f32> = data
        .chunks_exact(4)
        .zip(residual.chunks_exact(4))
        .map(|(d, r)| f32_at(d, 0) + f32_at(r, 0))
        .collect();
    let chosen = top_k(&corrected, k);
    out.fill(0);
    let (indices, values) = out.split_at_mut(layout.values_offset());
    for (j, &i) in chosen.iter().enumerate() {
        indices[j * 4..j * 4 + 4].copy_from_slice(&i.to_le_bytes());
        let v = corrected[i as usize];
        // Error feedback: what was not sent stays for the next step (what
        // was sent is subtracted as sent, including its fp16 rounding).
        let sent = if layout.fp16_values {
            let h = f16::from_f32(v);
            values[j * 2..j * 2 + 2].copy_from_slice(&h.to_le_bytes());
            h.to_f32()
        } else {
            values[j * 4..j * 4 + 4].copy_from_slice(&v.to_le_bytes());
            v
        };
        corrected[i as usize] = v - sent;
    }
    for (r, v) in residual.chunks_exact_mut(4).zip(corrected) {
        r.copy_from_slice(&v.to_ne_bytes());
    }
}

/// Host kernel of [`Backend::topk_sum`]. `describe(r)` names block `r`'s
/// sender in the error raised for an index out of range.
pub fn sum(
    gathered: &[u8],
    layout: TopKBlock,
    out: &mut [u8],
    describe: impl Fn(usize) -> (usize, String),
) -> Result<()> {
    let (n, k) = (layout.n, layout.k);
    let mut acc = vec![0f32; n];
    for (r, block) in gathered.chunks_exact(layout.bytes()).enumerate() {
        let (indices, values) = block.split_at(layout.values_offset());
        for j in 0..k {
            let i = u32::from_le_bytes([
                indices[j * 4],
                indices[j * 4 + 1],
                indices[j * 4 + 2],
                indices[j * 4 + 3],
            ]) as usize;
            if i >= n {
                let (peer, what) = describe(r);
                return Err(Error::Comm {
                    peer: Some(peer),
                    message: format!("{what} sent Top-K index {i} for a buffer of {n} elements"),
                });
            }
            acc[i] += if layout.fp16_values {
                f16::from_le_bytes([values[j * 2], values[j * 2 + 1]]).to_f32()
            } else {
                f32::from_le_bytes([
                    values[j * 4],
                    values[j * 4 + 1],
                    values[j * 4 + 2],
                    values[j * 4 + 3],
                ])
            };
        }
    }
    for (c, v) in out.chunks_exact_mut(4).zip(acc) {
        c.copy_from_slice(&v.to_ne_bytes());
    }
    Ok(())
}

/// Host kernel of [`Backend::clip_norm`]: scales float32 `buf` by
/// `max_norm / norm` when its L2 norm is above `max_norm`. The sum of
/// squares is taken in float64 (so its order does not show in float32),
/// the norm, threshold and factor in float32.
pub fn clip_norm(buf: &mut [u8], max_norm: f64) {
    let sum: f64 = buf
        .chunks_exact(4)
        .map(|c| {
            let x = f32_at(c, 0) as f64;
            x * x
        })
        .sum();
    let (norm, max) = (sum.sqrt() as f32, max_norm as f32);
    if norm > max {
        let scale = max / norm;
        for c in buf.chunks_exact_mut(4) {
            c.copy_from_slice(&(f32_at(c, 0) * scale).to_ne_bytes());
        }
    }
}

/// Host kernel of [`Backend::momentum_step`]: `velocity = momentum *
/// velocity + data` (float32, each operation rounded).
pub fn momentum_step(velocity: &mut [u8], data: &[u8], momentum: f64) {
    let m = momentum as f32;
    for (u, d) in velocity.chunks_exact_mut(4).zip(data.chunks_exact(4)) {
        let product = m * f32_at(u, 0);
        u.copy_from_slice(&(product + f32_at(d, 0)).to_ne_bytes());
    }
}

/// Host kernel of [`Backend::topk_mask`]: zeroes the entries of float32
/// `buf` named by the indices of `block` (one rank's [`TopKBlock`]).
pub fn mask_sent(block: &[u8], layout: TopKBlock, buf: &mut [u8]) {
    let n = buf.len() / 4;
    for c in block[..layout.values_offset()].chunks_exact(4) {
        let i = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize;
        if i < n {
            buf[i * 4..i * 4 + 4].fill(0);
        }
    }
}

/// Host kernel of [`Backend::momentum_correct`]: `(data, previous) =
/// (data - momentum * previous, data)` (float32, each operation rounded).
pub fn momentum_correct(data: &mut [u8], previous: &mut [u8], momentum: f64) {
    let m = momentum as f32;
    for (d, p) in data.chunks_exact_mut(4).zip(previous.chunks_exact_mut(4)) {
        let sum = f32_at(d, 0);
        let product = m * f32_at(p, 0);
        d.copy_from_slice(&(sum - product).to_ne_bytes());
        p.copy_from_slice(&sum.to_ne_bytes());
    }
}

#[cfg(test)]
mod tests {
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
}
