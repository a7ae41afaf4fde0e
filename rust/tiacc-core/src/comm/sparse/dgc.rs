//! Host kernels of the momentum correction (DGC): clipping, the
//! velocity step, masking what was sent and the correction.

use super::f32_at;
use crate::comm::backend::{Momentum, TopKBlock};

/// Host kernel of [`Backend::clip_norm`](crate::comm::Backend::clip_norm): scales float32 `buf` by
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

/// Host kernel of [`Backend::momentum`](crate::comm::Backend::momentum):
/// runs `op` on `first` and `second`.
pub fn momentum(op: Momentum, first: &mut [u8], second: &mut [u8], momentum: f64) {
    match op {
        Momentum::Step => momentum_step(first, second, momentum),
        Momentum::Correct => momentum_correct(first, second, momentum),
    }
}

/// [`Momentum::Step`]: `velocity = momentum * velocity + data` (float32,
/// each operation rounded).
pub fn momentum_step(velocity: &mut [u8], data: &[u8], momentum: f64) {
    let m = momentum as f32;
    for (u, d) in velocity.chunks_exact_mut(4).zip(data.chunks_exact(4)) {
        let product = m * f32_at(u, 0);
        u.copy_from_slice(&(product + f32_at(d, 0)).to_ne_bytes());
    }
}

/// Host kernel of [`Backend::topk_mask`](crate::comm::Backend::topk_mask): zeroes the entries of float32
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

/// [`Momentum::Correct`]: `(data, previous) = (data - momentum * previous,
/// data)` (float32, each operation rounded).
pub fn momentum_correct(data: &mut [u8], previous: &mut [u8], momentum: f64) {
    let m = momentum as f32;
    for (d, p) in data.chunks_exact_mut(4).zip(previous.chunks_exact_mut(4)) {
        let sum = f32_at(d, 0);
        let product = m * f32_at(p, 0);
        d.copy_from_slice(&(sum - product).to_ne_bytes());
        p.copy_from_slice(&sum.to_ne_bytes());
    }
}
