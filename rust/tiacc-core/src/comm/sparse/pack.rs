//! The wire format's host kernels: packing a rank's block of (index,
//! value) pairs out of the residual, and summing the gathered blocks.

use std::cell::RefCell;

use half::f16;

use super::select::{add, add_collect, estimate, magnitude, Cut};
use super::{f32_at, floats, floats_mut};
use crate::comm::backend::TopKBlock;
use crate::error::{Error, Result};

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

/// Host kernel of [`Backend::topk_pack`](crate::comm::Backend::topk_pack) (float32, native-endian buffers).
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
pub(super) fn pack_with(
    d: &[f32],
    r: &mut [f32],
    layout: TopKBlock,
    out: &mut [u8],
    threshold: Option<u32>,
) {
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

/// Host kernel of [`Backend::topk_sum`](crate::comm::Backend::topk_sum). `describe(r)` names block `r`'s
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
