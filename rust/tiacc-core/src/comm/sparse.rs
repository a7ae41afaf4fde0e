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

use std::cell::RefCell;
use std::collections::HashMap;

use half::f16;

use super::backend::{Backend, GroupId, Mem, Shards, TopKBlock};
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

/// The order of selection as an integer: `|v|` under [`f32::total_cmp`].
/// `abs` only clears the sign bit, and for floats without it (NaNs
/// included) the total order is the order of their bits as unsigned
/// integers.
#[inline]
fn magnitude(v: f32) -> u32 {
    v.to_bits() & 0x7FFF_FFFF
}

/// Where a selection of the `k` largest magnitudes cuts, in index order:
/// every entry of a magnitude above `key`, and the first `ties` entries
/// (the lowest indices) of magnitude exactly `key`.
#[derive(Debug, Clone, Copy)]
struct Cut {
    key: u32,
    ties: usize,
}

impl Cut {
    /// The cut for the `k` largest of `keys` (reordered), `1 <= k <= len`.
    fn among(keys: &mut [u32], k: usize) -> Cut {
        let (_, &mut key, _) = keys.select_nth_unstable(keys.len() - k);
        let above = keys.iter().filter(|&&m| m > key).count();
        Cut {
            key,
            ties: k - above,
        }
    }

    /// The cut for the `k` largest magnitudes of `values`, `1 <= k <=
    /// len`: radix selection on the magnitude bits (one counting pass on
    /// the high 16 bits, one on the low 15 bits of the bucket the cut
    /// falls in), without copying the values.
    fn exact(values: &[f32], k: usize) -> Cut {
        let mut high = vec![0usize; 1 << 16];
        for &v in values {
            high[(magnitude(v) >> 15) as usize] += 1;
        }
        let (bucket, above_bucket) = from_top(&high, k);
        let mut low = vec![0usize; 1 << 15];
        for &v in values {
            let m = magnitude(v);
            if (m >> 15) as usize == bucket {
                low[(m & 0x7FFF) as usize] += 1;
            }
        }
        let (rest, above_rest) = from_top(&low, k - above_bucket);
        Cut {
            key: ((bucket << 15) | rest) as u32,
            ties: k - above_bucket - above_rest,
        }
    }

    /// Moves the entries the cut takes from `found` (in index order) to
    /// its front, in order; returns how many. Without branches on the data:
    /// whether an entry is taken is as good as random.
    fn compact(mut self, found: &mut [(u32, f32)]) -> usize {
        let mut taken = 0;
        for q in 0..found.len() {
            let e = found[q];
            let m = magnitude(e.1);
            let tie = m == self.key;
            let take = (m > self.key) | (tie & (self.ties > 0));
            found[taken] = e;
            taken += take as usize;
            self.ties -= (tie & take) as usize;
        }
        taken
    }

    /// Whether the next entry in index order, of magnitude `m`, is taken.
    #[inline]
    fn take(&mut self, m: u32) -> bool {
        if m > self.key {
            true
        } else if m == self.key && self.ties > 0 {
            self.ties -= 1;
            true
        } else {
            false
        }
    }
}

/// The highest bucket of `counts` at which the count from the top reaches
/// `k`, and the count in the buckets above it.
fn from_top(counts: &[usize], k: usize) -> (usize, usize) {
    let mut above = 0;
    for (bucket, &c) in counts.iter().enumerate().rev() {
        if above + c >= k {
            return (bucket, above);
        }
        above += c;
    }
    (0, above)
}

/// Indices of the `k` entries of largest magnitude, ascending; ties go to
/// the lower index. Linear time (radix selection), no sort.
pub fn top_k(values: &[f32], k: usize) -> Vec<u32> {
    let k = k.min(values.len());
    if k == 0 {
        return Vec::new();
    }
    let mut cut = Cut::exact(values, k);
    let mut chosen = Vec::with_capacity(k);
    for (i, &v) in values.iter().enumerate() {
        if cut.take(magnitude(v)) {
            chosen.push(i as u32);
        }
    }
    chosen
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

/// Entries per group of the candidate scan: one bit mask per group says
/// which are candidates.
const GROUP: usize = 64;
/// Candidates of a group written out without branching; more take a loop.
const STORED: usize = 4;
/// The threshold estimate samples this many runs of [`SAMPLE_RUN`]
/// consecutive entries (a cache line each, where aligned).
const SAMPLE_RUNS: usize = 1024;
const SAMPLE_RUN: usize = 16;

/// A well-mixed 64-bit hash (the splitmix64 finaliser).
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A magnitude that, very likely, a little more than `k` entries of
/// `d + r` reach: the matching quantile of a sample, lowered by a margin of
/// six standard deviations. Only speed depends on it: the selection is
/// exact whatever it returns.
fn estimate(d: &[f32], r: &[f32], k: usize) -> u32 {
    let n = r.len();
    let span = n / SAMPLE_RUNS;
    let mut sample: Vec<u32>;
    let want = if span < 4 * SAMPLE_RUN {
        sample = d.iter().zip(r).map(|(x, y)| magnitude(x + y)).collect();
        k
    } else {
        sample = Vec::with_capacity(SAMPLE_RUNS * SAMPLE_RUN);
        for j in 0..SAMPLE_RUNS {
            // A run at a pseudo-random place in each span, so that data
            // with a period does not bias the sample.
            let start = j * span + (mix(j as u64) % (span - SAMPLE_RUN + 1) as u64) as usize;
            let run = start..start + SAMPLE_RUN;
            sample.extend(
                d[run.clone()]
                    .iter()
                    .zip(&r[run])
                    .map(|(x, y)| magnitude(x + y)),
            );
        }
        let expected = sample.len() as f64 * k as f64 / n as f64;
        (expected + 6.0 * expected.sqrt() + 8.0).ceil() as usize
    };
    let s = sample.len();
    if want == 0 || s == 0 {
        return 0;
    }
    let (_, &mut t, _) = sample.select_nth_unstable(s - want.min(s));
    t
}

/// `r = d + r`. (Operand order does not matter: addition commutes, except
/// for which payload NaN + NaN carries, which no compiler promises.)
fn add(d: &[f32], r: &mut [f32]) {
    for (x, y) in d.iter().zip(r) {
        *y += *x;
    }
}

/// `r = d + r` over one group (at most 64 entries), and the mask of its
/// entries of magnitude at least `t` (bit `j` for entry `j`), `t <= 2^31`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn add_mask(d: &[f32], r: &mut [f32], t: u32) -> u64 {
    use std::arch::x86_64::{
        _mm_add_ps, _mm_and_si128, _mm_castps_si128, _mm_castsi128_ps, _mm_cmpgt_epi32,
        _mm_loadu_ps, _mm_movemask_ps, _mm_set1_epi32, _mm_storeu_ps,
    };
    let mut mask = 0u64;
    let mut quads = d.chunks_exact(4).zip(r.chunks_exact_mut(4));
    // SAFETY: SSE and SSE2 are part of every x86_64 target. Each load and
    // store covers exactly the 4 floats of one chunk of length 4 (unaligned
    // accesses are allowed), and the chunks of `r` are exclusive borrows.
    unsafe {
        // Magnitudes are below 2^31, so a signed comparison with t - 1
        // (at least -1) is `magnitude >= t`.
        let below = _mm_set1_epi32((t as i32).wrapping_sub(1));
        let no_sign = _mm_set1_epi32(0x7FFF_FFFF);
        for (q, (x, y)) in (&mut quads).enumerate() {
            let v = _mm_add_ps(_mm_loadu_ps(x.as_ptr()), _mm_loadu_ps(y.as_ptr()));
            _mm_storeu_ps(y.as_mut_ptr(), v);
            let hit = _mm_cmpgt_epi32(_mm_and_si128(_mm_castps_si128(v), no_sign), below);
            mask |= (_mm_movemask_ps(_mm_castsi128_ps(hit)) as u64) << (4 * q);
        }
    }
    let done = d.len() / 4 * 4;
    let rest = d[done..].iter().zip(&mut r[done..]);
    for (j, (x, y)) in (done..).zip(rest) {
        *y += *x;
        mask |= ((magnitude(*y) >= t) as u64) << j;
    }
    mask
}

/// [`add_mask`] without vector instructions (other targets, and the
/// tests, which compare the two).
#[cfg(any(test, not(target_arch = "x86_64")))]
#[inline(always)]
fn add_mask_portable(d: &[f32], r: &mut [f32], t: u32) -> u64 {
    let mut mask = 0u64;
    for (j, (x, y)) in d.iter().zip(r).enumerate() {
        *y += *x;
        mask |= ((magnitude(*y) >= t) as u64) << j;
    }
    mask
}

#[cfg(not(target_arch = "x86_64"))]
use add_mask_portable as add_mask;

/// `r = d + r`, collecting (index, value) of the entries of magnitude at
/// least `t`, in index order, into `found[..len]`; the `len`, or `None`
/// when there are more than `cap`. `found` is grown as needed and left
/// at its full length for the next call (rewriting it costs time).
fn add_collect(
    d: &[f32],
    r: &mut [f32],
    t: u32,
    cap: usize,
    found: &mut Vec<(u32, f32)>,
) -> Option<usize> {
    // Magnitudes are below 2^31: any larger threshold means none.
    let t = t.min(1 << 31);
    // Room for a whole group past `cap`: a group writes its first STORED
    // slots whether or not it has that many candidates.
    if found.len() < cap + GROUP {
        found.resize(cap + GROUP, (0, 0.0));
    }
    let mut len = 0;
    let mut groups = d.chunks(GROUP).zip(r.chunks_mut(GROUP)).enumerate();
    for (g, (dc, rc)) in &mut groups {
        let mask = add_mask(dc, rc, t);
        let (base, last) = (g * GROUP, rc.len() - 1);
        let slots = &mut found[len..len + GROUP];
        let mut m = mask;
        for slot in &mut slots[..STORED] {
            // Past the last candidate this writes a junk slot, overwritten
            // later or beyond the final length.
            let j = (m.trailing_zeros() as usize).min(last);
            *slot = ((base + j) as u32, rc[j]);
            m &= m.wrapping_sub(1);
        }
        for slot in &mut slots[STORED..] {
            if m == 0 {
                break;
            }
            let j = m.trailing_zeros() as usize;
            *slot = ((base + j) as u32, rc[j]);
            m &= m - 1;
        }
        len += mask.count_ones() as usize;
        if len > cap {
            for (_, (dc, rc)) in groups {
                add(dc, rc);
            }
            return None;
        }
    }
    Some(len)
}

/// Buffers of [`pack`] kept from call to call on each thread: fresh memory
/// would be faulted in page by page on every call.
#[derive(Default)]
struct Scratch {
    found: Vec<(u32, f32)>,
    keys: Vec<u32>,
}

/// Scratch buffers larger than this (entries) are not kept.
const SCRATCH_KEPT: usize = 1 << 22;

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Runs `f` with this thread's scratch buffers (fresh ones when the
/// thread's are unavailable, as while it exits).
fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    let take = |cell: &RefCell<Scratch>| cell.try_borrow_mut().map(|mut s| std::mem::take(&mut *s));
    let mut scratch = SCRATCH
        .try_with(take)
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default();
    let out = f(&mut scratch);
    if scratch.found.len() <= SCRATCH_KEPT {
        let _ = SCRATCH.try_with(|cell| cell.try_borrow_mut().map(|mut s| *s = scratch));
    }
    out
}

/// Writes the chosen pairs of one block, in order, and takes what was sent
/// out of the residual. Slots left unwritten are zeroed when it is dropped
/// (the block is not zeroed first: it is written once).
struct Sender<'a> {
    indices: std::slice::ChunksExactMut<'a, u8>,
    values: std::slice::ChunksExactMut<'a, u8>,
    fp16: bool,
}

impl<'a> Sender<'a> {
    fn new(out: &'a mut [u8], layout: TopKBlock) -> Self {
        let (indices, values) = out.split_at_mut(layout.values_offset().min(out.len()));
        let size = layout.value_size();
        let (values, padding) = values.split_at_mut(values.len() / size * size);
        padding.fill(0);
        let (indices, padding) = indices.split_at_mut(indices.len() / 4 * 4);
        padding.fill(0);
        Sender {
            indices: indices.chunks_exact_mut(4),
            values: values.chunks_exact_mut(size),
            fp16: layout.fp16_values,
        }
    }

    /// Sends entry `i` of corrected value `v`; returns the residual to
    /// keep there.
    #[inline]
    fn send(&mut self, i: usize, v: f32) -> f32 {
        if let Some(c) = self.indices.next() {
            c.copy_from_slice(&(i as u32).to_le_bytes());
        }
        // Error feedback: what was not sent stays for the next step (what
        // was sent is subtracted as sent, including its fp16 rounding).
        let sent = if self.fp16 {
            let h = f16::from_f32(v);
            if let Some(c) = self.values.next() {
                c.copy_from_slice(&h.to_le_bytes());
            }
            h.to_f32()
        } else {
            if let Some(c) = self.values.next() {
                c.copy_from_slice(&v.to_le_bytes());
            }
            v
        };
        v - sent
    }
}

impl Drop for Sender<'_> {
    fn drop(&mut self) {
        for c in self.indices.by_ref().chain(self.values.by_ref()) {
            c.fill(0);
        }
    }
}

/// Host kernel of [`Backend::topk_pack`] (float32, native-endian buffers).
///
/// `residual += data` in place; the `k` entries of largest magnitude are
/// found by estimating the cut from a sample, collecting the entries above
/// the estimate in the same pass as the addition, and selecting exactly
/// among those (or, when the estimate misses, by a radix selection over
/// the residual).
pub fn pack(data: &[u8], residual: &mut [u8], layout: TopKBlock, out: &mut [u8]) {
    let n = data.len().min(residual.len()) / 4;
    let (data, residual) = (&data[..4 * n], &mut residual[..4 * n]);
    if let Some(d) = floats(data) {
        if let Some(r) = floats_mut(residual) {
            pack_floats(d, r, layout, out);
            return;
        }
    }
    // Unaligned buffers: through aligned copies.
    let d: Vec<f32> = data.chunks_exact(4).map(|c| f32_at(c, 0)).collect();
    let mut r: Vec<f32> = residual.chunks_exact(4).map(|c| f32_at(c, 0)).collect();
    pack_floats(&d, &mut r, layout, out);
    for (c, v) in residual.chunks_exact_mut(4).zip(r) {
        c.copy_from_slice(&v.to_ne_bytes());
    }
}

fn pack_floats(d: &[f32], r: &mut [f32], layout: TopKBlock, out: &mut [u8]) {
    let (n, k) = (r.len(), layout.k.min(r.len()));
    // A large share is cheaper to cut over the whole residual than through
    // candidates (which would take memory in proportion).
    let threshold = (k > 0 && 8 * k <= n).then(|| estimate(d, r, k));
    pack_with(d, r, layout, out, threshold);
}

/// [`pack_floats`] collecting candidates of magnitude at least `threshold`
/// (`None`: cutting over the whole residual). The threshold only changes
/// the speed, never the result.
fn pack_with(d: &[f32], r: &mut [f32], layout: TopKBlock, out: &mut [u8], threshold: Option<u32>) {
    let (n, k) = (r.len(), layout.k.min(r.len()));
    let mut sender = Sender::new(out, layout);
    if k == 0 {
        add(d, r);
        return;
    }
    if let Some(t) = threshold {
        let cap = (2 * k + 4096).min(n);
        // Complete with at least k: the k-th largest magnitude is at least
        // t, so every entry the selection takes is among those found.
        let done = with_scratch(|Scratch { found, keys }| {
            let Some(len) = add_collect(d, r, t, cap, found).filter(|&len| len >= k) else {
                return false;
            };
            let found = &mut found[..len];
            keys.clear();
            keys.extend(found.iter().map(|&(_, v)| magnitude(v)));
            let cut = Cut::among(keys, k);
            let taken = cut.compact(found);
            for &(i, v) in &found[..taken] {
                // Only stored: the value came with the candidate.
                let kept = sender.send(i as usize, v);
                if let Some(slot) = r.get_mut(i as usize) {
                    *slot = kept;
                }
            }
            true
        });
        if done {
            return;
        }
    } else {
        add(d, r);
    }
    // The residual now holds the corrected values.
    let mut cut = Cut::exact(r, k);
    for (i, v) in r.iter_mut().enumerate() {
        if cut.take(magnitude(*v)) {
            *v = sender.send(i, *v);
        }
    }
}

/// One rank's block of a gathered buffer.
struct Block<'a> {
    indices: &'a [u8],
    values: &'a [u8],
    fp16: bool,
}

impl<'a> Block<'a> {
    fn new(bytes: &'a [u8], layout: TopKBlock) -> Self {
        let (indices, values) = bytes.split_at(layout.values_offset().min(bytes.len()));
        Block {
            indices: &indices[..indices.len() / 4 * 4],
            values,
            fp16: layout.fp16_values,
        }
    }

    fn len(&self) -> usize {
        self.indices.len() / 4
    }

    fn indices(&self) -> impl Iterator<Item = usize> + 'a {
        self.indices
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize)
    }

    #[inline]
    fn index(&self, j: usize) -> usize {
        let c = &self.indices[4 * j..4 * j + 4];
        u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize
    }

    #[inline]
    fn value(&self, j: usize) -> f32 {
        if self.fp16 {
            let c = &self.values[2 * j..2 * j + 2];
            f16::from_le_bytes([c[0], c[1]]).to_f32()
        } else {
            let c = &self.values[4 * j..4 * j + 4];
            f32::from_le_bytes([c[0], c[1], c[2], c[3]])
        }
    }
}

/// Elements of `out` zeroed and summed at a time when every block's
/// indices ascend, so that each piece is still in cache for its sums.
const TILE: usize = 4096;

/// Host kernel of [`Backend::topk_sum`]. `describe(r)` names block `r`'s
/// sender in the error raised for an index out of range.
pub fn sum(
    gathered: &[u8],
    layout: TopKBlock,
    out: &mut [u8],
    describe: impl Fn(usize) -> (usize, String),
) -> Result<()> {
    let n = layout.n;
    let blocks: Vec<Block> = match layout.bytes() {
        0 => Vec::new(),
        bytes => gathered
            .chunks_exact(bytes)
            .map(|b| Block::new(b, layout))
            .collect(),
    };
    // Every index is checked before `out` is touched. Ascending indices
    // (what `pack` sends) allow summing piece by piece.
    let mut ascending = true;
    for (r, block) in blocks.iter().enumerate() {
        let mut previous = 0;
        for i in block.indices() {
            if i >= n {
                let (peer, what) = describe(r);
                return Err(Error::Comm {
                    peer: Some(peer),
                    message: format!("{what} sent Top-K index {i} for a buffer of {n} elements"),
                });
            }
            ascending &= i >= previous;
            previous = i;
        }
    }
    let m = n.min(out.len() / 4);
    let out = &mut out[..4 * m];
    if let Some(o) = floats_mut(out) {
        scatter(&blocks, ascending, o);
        return Ok(());
    }
    // An unaligned `out`: through an aligned copy.
    let mut o = vec![0f32; m];
    scatter(&blocks, ascending, &mut o);
    for (c, v) in out.chunks_exact_mut(4).zip(o) {
        c.copy_from_slice(&v.to_ne_bytes());
    }
    Ok(())
}

/// `out = 0`, then every block's pairs added in, block by block; indices
/// are below `n` (those from `out.len()` on are dropped). Each element
/// receives its additions in rank order either way.
fn scatter(blocks: &[Block], ascending: bool, out: &mut [f32]) {
    if !ascending {
        out.fill(0.0);
        for block in blocks {
            for (j, i) in block.indices().enumerate() {
                if let Some(o) = out.get_mut(i) {
                    *o += block.value(j);
                }
            }
        }
        return;
    }
    let mut next = vec![0usize; blocks.len()];
    for (t, tile) in out.chunks_mut(TILE).enumerate() {
        tile.fill(0.0);
        let (start, end) = (t * TILE, t * TILE + tile.len());
        for (block, j) in blocks.iter().zip(next.iter_mut()) {
            while *j < block.len() {
                let i = block.index(*j);
                if i >= end {
                    break;
                }
                if let Some(o) = tile.get_mut(i.wrapping_sub(start)) {
                    *o += block.value(*j);
                }
                *j += 1;
            }
        }
    }
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
        let (indices, values) = out.split_at_mut(layout.values_offset());
        for (j, &i) in chosen.iter().enumerate() {
            indices[j * 4..j * 4 + 4].copy_from_slice(&i.to_le_bytes());
            let v = corrected[i as usize];
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
}
