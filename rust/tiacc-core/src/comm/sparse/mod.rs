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

mod dgc;
mod pack;
#[cfg(test)]
mod reference;
mod select;
#[cfg(test)]
mod tests;

pub use dgc::{clip_norm, mask_sent, momentum, momentum_correct, momentum_step};
pub use pack::{pack, sum};
pub use select::top_k;

use std::collections::HashMap;

use super::backend::{Backend, GroupId, Mem, Momentum, Shards, TopKBlock};
use super::dtype::DType;
use crate::config::CommConfig;
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
    /// The Top-K settings of `config`, `None` when Top-K is off.
    pub fn from_config(config: &CommConfig) -> Option<Self> {
        config.topk.then_some(TopKOptions {
            ratio: config.topk_ratio,
            threshold: config.topk_threshold,
            fp16_values: config.topk_fp16,
        })
    }

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

impl SparseState {
    /// A state with these buffer lengths (elements) and step counts, as a
    /// checkpoint restores it ([`super::state`]).
    pub fn from_parts(lens: HashMap<u64, usize>, steps: HashMap<u64, u64>) -> Self {
        SparseState { lens, steps }
    }

    /// Elements of each bucket's state buffers (buckets whose buffers are
    /// kept).
    pub fn lens(&self) -> &HashMap<u64, usize> {
        &self.lens
    }

    /// Sparse allreduces of each bucket so far (Top-K's warm-up reads them).
    pub fn steps(&self) -> &HashMap<u64, u64> {
        &self.steps
    }
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
        b.momentum(Momentum::Step, velocity, data, dgc.momentum)?;
        b.topk_pack(velocity, residual, layout, shards.mine)?;
        if dgc.masking {
            b.topk_mask(shards.mine, layout, velocity)?;
        }
    }
    b.allgather(group, shards, gathered, 1)?;
    b.topk_sum(gathered, layout, data, group, bucket)?;
    if momentum {
        let previous = b.residual(StateBuf::PreviousSum.key(bucket)?, n * 4)?;
        b.momentum(Momentum::Correct, data, previous, dgc.momentum)?;
    }
    Ok(())
}

/// `bytes` as native-endian float32s, when aligned and a whole number of them.
fn floats(bytes: &[u8]) -> Option<&[f32]> {
    // SAFETY: every 4-byte pattern is a valid f32, and `align_to` only puts
    // whole, correctly aligned f32s in the middle part.
    let (head, body, tail) = unsafe { bytes.align_to::<f32>() };
    (head.is_empty() && tail.is_empty()).then_some(body)
}

/// [`floats`], mutably.
fn floats_mut(bytes: &mut [u8]) -> Option<&mut [f32]> {
    // SAFETY: as in `floats`; any f32 written is 4 valid bytes.
    let (head, body, tail) = unsafe { bytes.align_to_mut::<f32>() };
    (head.is_empty() && tail.is_empty()).then_some(body)
}

fn f32_at(bytes: &[u8], i: usize) -> f32 {
    f32::from_ne_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]])
}
