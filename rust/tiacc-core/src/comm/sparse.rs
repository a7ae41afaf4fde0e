//! Top-K sparsification with error feedback (LightCC's `LIGHT_TOPK_*`).
//!
//! Each rank adds the residual it kept from earlier steps to its bucket,
//! sends only the `k = ceil(ratio * n)` entries of largest magnitude as
//! (index, value) pairs, and keeps the rest as the new residual. Ranks
//! allgather their pairs and every rank scatter-adds them in rank order, so
//! all ranks end with identical bytes. With the 2D hierarchy the node first
//! reduces densely and only the inter-node step is sparse.

use std::collections::HashMap;

use half::f16;

use super::algo::{Algorithm, Groups};
use super::dtype::DType;
use super::transport::{Deadline, OpTag, Transport};
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

/// Wraps a dense algorithm: float32 buckets of at least the threshold go
/// sparse, everything else goes to `dense`.
pub struct TopK {
    pub options: TopKOptions,
    pub dense: Box<dyn Algorithm>,
    /// Residual per (bucket index, piece length); a bucket whose length
    /// changes (DDP rebuilt its buckets) clears them all.
    residuals: HashMap<u64, Vec<f32>>,
}

impl TopK {
    pub fn new(options: TopKOptions, dense: Box<dyn Algorithm>) -> Self {
        TopK {
            options,
            dense,
            residuals: HashMap::new(),
        }
    }

    /// Sparse allreduce of `data` (float32) over `group`.
    fn sparse(
        &mut self,
        group: &mut dyn Transport,
        bucket: u64,
        data: &mut [u8],
        deadline: Deadline,
    ) -> Result<()> {
        let n = data.len() / 4;
        if n == 0 {
            return Ok(());
        }
        let stale = self.residuals.get(&bucket).is_some_and(|r| r.len() != n);
        if stale {
            self.residuals.clear();
        }
        let residual = self.residuals.entry(bucket).or_insert_with(|| vec![0.0; n]);
        let mut corrected: Vec<f32> = data
            .chunks_exact(4)
            .zip(residual.iter())
            .map(|(c, r)| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]) + r)
            .collect();
        let k = ((n as f64 * self.options.ratio).ceil() as usize).clamp(1, n);
        let chosen = top_k(&corrected, k);
        let value_size = if self.options.fp16_values { 2 } else { 4 };
        let block = k * (4 + value_size);
        let (rank, size) = (group.rank(), group.size());
        let mut all = vec![0u8; block * size];
        {
            let mine = &mut all[rank * block..(rank + 1) * block];
            let (indices, values) = mine.split_at_mut(k * 4);
            for (j, &i) in chosen.iter().enumerate() {
                indices[j * 4..j * 4 + 4].copy_from_slice(&i.to_le_bytes());
                let v = corrected[i as usize];
                if self.options.fp16_values {
                    values[j * 2..j * 2 + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
                } else {
                    values[j * 4..j * 4 + 4].copy_from_slice(&v.to_le_bytes());
                }
            }
        }
        // Error feedback: what was not sent stays for the next step (what
        // was sent is subtracted as sent, including its fp16 rounding).
        for &i in &chosen {
            let v = corrected[i as usize];
            let sent = if self.options.fp16_values {
                f16::from_f32(v).to_f32()
            } else {
                v
            };
            corrected[i as usize] = v - sent;
        }
        *residual = corrected;

        group.allgather(&mut all, 1, deadline)?;
        let mut out = vec![0f32; n];
        for r in 0..size {
            let piece = &all[r * block..(r + 1) * block];
            let (indices, values) = piece.split_at(k * 4);
            for j in 0..k {
                let i = u32::from_le_bytes([
                    indices[j * 4],
                    indices[j * 4 + 1],
                    indices[j * 4 + 2],
                    indices[j * 4 + 3],
                ]) as usize;
                if i >= n {
                    return Err(Error::Comm {
                        peer: Some(r),
                        message: format!(
                            "rank {rank}: rank {r} sent Top-K index {i} for bucket {bucket} \
                             of {n} elements"
                        ),
                    });
                }
                let v = if self.options.fp16_values {
                    f16::from_le_bytes([values[j * 2], values[j * 2 + 1]]).to_f32()
                } else {
                    f32::from_le_bytes([
                        values[j * 4],
                        values[j * 4 + 1],
                        values[j * 4 + 2],
                        values[j * 4 + 3],
                    ])
                };
                out[i] += v;
            }
        }
        for (c, v) in data.chunks_exact_mut(4).zip(out) {
            c.copy_from_slice(&v.to_ne_bytes());
        }
        Ok(())
    }
}

impl Algorithm for TopK {
    fn name(&self) -> &'static str {
        "topk"
    }

    fn allreduce(
        &mut self,
        groups: &mut Groups,
        tag: &OpTag,
        buf: &mut [u8],
        dtype: DType,
        deadline: Deadline,
    ) -> Result<()> {
        if dtype != DType::F32 || (buf.len() as u64) < self.options.threshold {
            return self.dense.allreduce(groups, tag, buf, dtype, deadline);
        }
        match groups.hierarchy.as_mut() {
            // Dense inside the node, sparse across nodes.
            Some(h) => h.reduce(tag, buf, dtype, deadline, |inter, shard| {
                self.sparse(inter, tag.bucket, shard, deadline)
            }),
            None => {
                groups.world.agree(tag, deadline)?;
                self.sparse(groups.world.as_mut(), tag.bucket, buf, deadline)
            }
        }
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
}
