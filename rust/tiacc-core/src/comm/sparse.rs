//! Top-K sparsification with error feedback (LightCC's `LIGHT_TOPK_*`).
//!
//! Each rank adds the residual it kept from earlier steps to its bucket,
//! sends only the `k = ceil(ratio * n)` entries of largest magnitude as
//! (index, value) pairs, and keeps the rest as the new residual. Ranks
//! allgather their pairs and every rank adds them up in rank order, so all
//! ranks end with identical bytes. With the 2D hierarchy the node first
//! reduces densely and only the inter-node step is sparse.
//!
//! The step itself ([`sparse_allreduce`]) runs on any [`Backend`]; this
//! module also holds the host kernels ([`pack`], [`sum`]) that the host
//! backend runs for it. The device backend runs the same kernels as torch
//! operations, on the same wire layout ([`TopKBlock`]).

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
/// feedback. `residual_lens` remembers each bucket's length: when one
/// changes (DDP rebuilt its buckets) every residual is dropped.
pub fn sparse_allreduce(
    b: &mut dyn Backend,
    group: GroupId,
    bucket: u64,
    data: Mem,
    options: &TopKOptions,
    residual_lens: &mut HashMap<u64, usize>,
) -> Result<()> {
    let n = data.bytes / 4;
    if n == 0 {
        return Ok(());
    }
    if residual_lens.get(&bucket).is_some_and(|&len| len != n) {
        b.clear_residuals();
        residual_lens.clear();
    }
    residual_lens.insert(bucket, n);
    let residual = b.residual(bucket, n * 4)?;
    let (size, rank) = (b.size(group), b.rank(group));
    let layout = TopKBlock::new(n, options.ratio, options.fp16_values, size);
    let gathered = b.alloc(layout.bytes() * size)?;
    // Equal blocks: shard r of the gathered buffer is rank r's block.
    let shards = Shards::in_place(gathered, 1, size, rank)?;
    b.topk_pack(data, residual, layout, shards.mine)?;
    b.allgather(group, shards, gathered, 1)?;
    b.topk_sum(gathered, layout, data, group, bucket)
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
}
