//! Each image's geometry for the fused path: torchvision's random crops and
//! flips, drawn from PyTorch's random stream, and its deterministic resizes
//! and centre crops.
//!
//! The draws are those of `RandomResizedCrop.get_params` (v1) and its v2
//! counterpart, and of `RandomHorizontalFlip`: per attempt one
//! `torch.empty(1).uniform_(scale)`, one `torch.exp(torch.empty(1).uniform_(log_ratio))`,
//! then two `torch.randint` once a crop fits; a flip is `torch.rand(1) < p`.
//! They come from a [`Draws`]: either [`TorchCpuRng`], which reproduces
//! PyTorch's CPU generator (its Mersenne Twister and its float and integer
//! transformations) on a copy of the generator's state, or a source that
//! calls torch itself. The caller checks once that [`TorchCpuRng`] matches
//! the running torch before using it.
//!
//! One draw is not reproduced bit for bit: torch's float32 `exp` is its own
//! vectorised one, which can differ from the C library's in the last bit.
//! [`TorchCpuRng`] therefore gives the range of values torch may have
//! computed (two units in the last place either way); where that range
//! leads to one crop, the crop is torch's; where it could lead to two (a
//! rounding boundary within those few units: about one 500 x 375 image in
//! five thousand),
//! the image is [`Unsure`] and [`sample_reproduced`] draws it from torch
//! itself.

use crate::error::{Error, Result};
use crate::image::fused::Geometry;

/// Where the random numbers of [`Sampler::sample`] come from. Each method
/// is one torch call of torchvision's, in the default dtype float32.
pub trait Draws {
    /// Error of the source (none for [`TorchCpuRng`]).
    type Error;
    /// `torch.empty(1).uniform_(low, high).item()`.
    fn uniform(&mut self, low: f64, high: f64) -> Result<f64, Self::Error>;
    /// `torch.exp(torch.empty(1).uniform_(low, high)).item()`, as the
    /// smallest and largest value torch may have computed (equal when the
    /// source is torch).
    fn exp_uniform(&mut self, low: f64, high: f64) -> Result<(f64, f64), Self::Error>;
    /// The error of a draw whose range of values leads to more than one
    /// crop.
    fn unsure(&self) -> Self::Error;
    /// `torch.randint(0, high, (1,)).item()`.
    fn randint(&mut self, high: u64) -> Result<u64, Self::Error>;
    /// `bool(torch.rand(1) < p)`.
    fn flip(&mut self, p: f64) -> Result<bool, Self::Error>;
}

/// Bytes of `torch.Generator.get_state()` for a CPU generator.
pub const TORCH_STATE_BYTES: usize = 5056;
const MT_N: usize = 624;
const MT_M: usize = 397;
// Offsets in the state: the initial seed (u64), `left` (i32), `seeded`
// (i32), `next` (u64), then the 624 words of the twister, each as a u64.
const LEFT_AT: usize = 8;
const NEXT_AT: usize = 16;
const WORDS_AT: usize = 24;

/// PyTorch's CPU generator, reproduced on a copy of its state.
///
/// `fused_multiply_add` picks how `uniform_` scales a float32 draw into
/// `[low, high)`: torch computes `x * (high - low) + low`, which its compiler
/// may fuse into one rounding; which one the running torch does is found by
/// comparing with it.
#[derive(Clone)]
pub struct TorchCpuRng {
    words: [u32; MT_N],
    left: i32,
    next: usize,
    fused_multiply_add: bool,
    bytes: Vec<u8>,
}

impl TorchCpuRng {
    /// The generator whose state `torch.Generator.get_state()` returned.
    pub fn from_state(state: &[u8], fused_multiply_add: bool) -> Result<Self> {
        let bad = |why: String| Error::InvalidArgument(format!("torch generator state: {why}"));
        if state.len() != TORCH_STATE_BYTES {
            return Err(bad(format!(
                "{} bytes, expected {TORCH_STATE_BYTES} (a CPU generator's get_state())",
                state.len()
            )));
        }
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&state[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let mut b = [0u8; 4];
        b.copy_from_slice(&state[LEFT_AT..LEFT_AT + 4]);
        let left = i32::from_le_bytes(b);
        let next = u64_at(NEXT_AT);
        if !(1..=MT_N as i32).contains(&left) || next > MT_N as u64 {
            return Err(bad(format!("left={left}, next={next} out of range")));
        }
        let mut words = [0u32; MT_N];
        for (i, word) in words.iter_mut().enumerate() {
            let value = u64_at(WORDS_AT + 8 * i);
            *word = u32::try_from(value)
                .map_err(|_| bad(format!("word {i} is {value}, wider than 32 bits")))?;
        }
        Ok(TorchCpuRng {
            words,
            left,
            next: next as usize,
            fused_multiply_add,
            bytes: state.to_vec(),
        })
    }

    /// The state to give back to `torch.Generator.set_state()`: the bytes
    /// it came from with the twister's position and words brought forward.
    pub fn state(&self) -> Vec<u8> {
        let mut out = self.bytes.clone();
        out[LEFT_AT..LEFT_AT + 4].copy_from_slice(&self.left.to_le_bytes());
        out[NEXT_AT..NEXT_AT + 8].copy_from_slice(&(self.next as u64).to_le_bytes());
        for (i, word) in self.words.iter().enumerate() {
            let at = WORDS_AT + 8 * i;
            out[at..at + 8].copy_from_slice(&u64::from(*word).to_le_bytes());
        }
        out
    }

    fn twist(u: u32, v: u32) -> u32 {
        let mixed = (u & 0x8000_0000) | (v & 0x7fff_ffff);
        (mixed >> 1) ^ if v & 1 == 1 { 0x9908_b0df } else { 0 }
    }

    fn refill(&mut self) {
        let w = &mut self.words;
        for i in 0..MT_N - MT_M {
            w[i] = w[i + MT_M] ^ Self::twist(w[i], w[i + 1]);
        }
        for i in MT_N - MT_M..MT_N - 1 {
            w[i] = w[i + MT_M - MT_N] ^ Self::twist(w[i], w[i + 1]);
        }
        w[MT_N - 1] = w[MT_M - 1] ^ Self::twist(w[MT_N - 1], w[0]);
        self.left = MT_N as i32;
        self.next = 0;
    }

    /// One 32-bit draw (the generator's `random()`).
    pub fn random(&mut self) -> u32 {
        self.left -= 1;
        if self.left == 0 {
            self.refill();
        }
        let mut y = self.words[self.next];
        self.next += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// One 64-bit draw (`random64()`: two 32-bit draws, the first high).
    pub fn random64(&mut self) -> u64 {
        let high = u64::from(self.random());
        (high << 32) | u64::from(self.random())
    }

    /// `torch.empty(1).uniform_(low, high)` in float32.
    pub fn uniform_f32(&mut self, low: f64, high: f64) -> f32 {
        let (low, high) = (low as f32, high as f32);
        let x = (self.random() & 0x00ff_ffff) as f32 * (1.0 / 16_777_216.0);
        if self.fused_multiply_add {
            x.mul_add(high - low, low)
        } else {
            x * (high - low) + low
        }
    }
}

/// An image whose crop [`TorchCpuRng`] cannot decide (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unsure;

/// Units in the last place by which torch's `exp` may differ from ours.
const EXP_ULPS: u32 = 2;

impl Draws for TorchCpuRng {
    type Error = Unsure;

    fn uniform(&mut self, low: f64, high: f64) -> Result<f64, Unsure> {
        Ok(f64::from(self.uniform_f32(low, high)))
    }

    fn exp_uniform(&mut self, low: f64, high: f64) -> Result<(f64, f64), Unsure> {
        let value = self.uniform_f32(low, high).exp();
        if !value.is_finite() || value <= f32::MIN_POSITIVE {
            return Err(Unsure);
        }
        // Positive finite floats are ordered as their bits.
        let bits = value.to_bits();
        let below = f32::from_bits(bits - EXP_ULPS);
        let above = f32::from_bits(bits + EXP_ULPS);
        if !above.is_finite() {
            return Err(Unsure);
        }
        Ok((f64::from(below), f64::from(above)))
    }

    fn unsure(&self) -> Unsure {
        Unsure
    }

    fn randint(&mut self, high: u64) -> Result<u64, Unsure> {
        Ok(if high >= 1 << 32 {
            self.random64() % high
        } else {
            u64::from(self.random()) % high
        })
    }

    fn flip(&mut self, p: f64) -> Result<bool, Unsure> {
        Ok(self.uniform_f32(0.0, 1.0) < p as f32)
    }
}

/// [`Sampler::sample_all`] drawing from `rng`; an image it is [`Unsure`]
/// of is drawn by `from_torch(k, state)` instead: image `k` drawn from the
/// generator in `state` (the state before its draws), returning its
/// geometry and the generator after them.
pub fn sample_reproduced<E>(
    sampler: &Sampler,
    sizes: &[(u32, u32)],
    rng: &mut TorchCpuRng,
    mut from_torch: impl FnMut(usize, &TorchCpuRng) -> Result<(Geometry, TorchCpuRng), E>,
) -> Result<Vec<Geometry>, E> {
    let mut out = Vec::with_capacity(sizes.len());
    for (k, &(w, h)) in sizes.iter().enumerate() {
        let before = rng.clone();
        match sampler.sample(w, h, rng) {
            Ok(g) => out.push(g),
            Err(Unsure) => {
                let (g, after) = from_torch(k, &before)?;
                out.push(g);
                *rng = after;
            }
        }
    }
    Ok(out)
}

/// `Resize`'s size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ResizeTo {
    /// `(height, width)`: that size.
    Exact(u32, u32),
    /// An int: the shorter edge becomes this (at most `max_size` the longer).
    Shorter(u32),
    /// v2's `size=None`: the longer edge becomes `max_size`.
    Longer,
}

/// How the image becomes the output, before the flip.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Placement {
    /// `RandomResizedCrop`: a random crop resized to `output` `(height, width)`.
    ResizedCrop {
        scale: (f64, f64),
        /// The logarithms of the ratio bounds, as the transform computed them
        /// (float32 values).
        log_ratio: (f64, f64),
        /// The smaller and larger ratio bound.
        ratio_range: (f64, f64),
        output: (u32, u32),
    },
    /// `Resize`, then optionally `CenterCrop` to `(height, width)`.
    Resize {
        size: ResizeTo,
        max_size: Option<u32>,
        center: Option<(u32, u32)>,
    },
    /// `CenterCrop` to `(height, width)`.
    Center { crop: (u32, u32) },
}

/// The geometry of a fused transform chain.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampler {
    pub placement: Placement,
    /// `RandomHorizontalFlip`'s `p`, if the chain flips.
    pub flip_p: Option<f64>,
}

impl Sampler {
    /// The output `(height, width)` of every image, if it is the same for all.
    pub fn output_size(&self) -> Option<(u32, u32)> {
        match self.placement {
            Placement::ResizedCrop { output, .. } => Some(output),
            Placement::Resize {
                center: Some(crop), ..
            }
            | Placement::Center { crop } => Some(crop),
            Placement::Resize {
                size: ResizeTo::Exact(h, w),
                ..
            } => Some((h, w)),
            Placement::Resize { .. } => None,
        }
    }

    /// Whether drawing from `draws` can only succeed: every `uniform_`
    /// range is ordered, as torch requires (else torch's own error is the
    /// one to raise, so such a chain draws from torch).
    pub fn ranges_ordered(&self) -> bool {
        match self.placement {
            Placement::ResizedCrop {
                scale, log_ratio, ..
            } => scale.0 as f32 <= scale.1 as f32 && log_ratio.0 as f32 <= log_ratio.1 as f32,
            _ => true,
        }
    }

    /// The geometry of a `width x height` image, drawing from `draws` in
    /// torchvision's order.
    pub fn sample<D: Draws>(
        &self,
        width: u32,
        height: u32,
        draws: &mut D,
    ) -> Result<Geometry, D::Error> {
        let geometry = match self.placement {
            Placement::ResizedCrop {
                scale,
                log_ratio,
                ratio_range,
                output: (oh, ow),
            } => {
                let (top, left, h, w) =
                    resized_crop(width, height, scale, log_ratio, ratio_range, draws)?;
                Geometry {
                    crop: (left, top, w, h),
                    resize: (ow, oh),
                    window: (0, 0, ow, oh),
                    flip: false,
                }
            }
            Placement::Resize {
                size,
                max_size,
                center,
            } => {
                let (rh, rw) = resized_size(height, width, size, max_size);
                Geometry {
                    crop: (0, 0, width, height),
                    resize: (rw, rh),
                    window: match center {
                        Some(crop) => center_window(rh, rw, crop),
                        None => (0, 0, rw, rh),
                    },
                    flip: false,
                }
            }
            Placement::Center { crop } => Geometry {
                crop: (0, 0, width, height),
                resize: (width, height),
                window: center_window(height, width, crop),
                flip: false,
            },
        };
        let flip = match self.flip_p {
            Some(p) => draws.flip(p)?,
            None => false,
        };
        Ok(Geometry { flip, ..geometry })
    }

    /// [`Self::sample`] of each `(width, height)`, in order.
    pub fn sample_all<D: Draws>(
        &self,
        sizes: &[(u32, u32)],
        draws: &mut D,
    ) -> Result<Vec<Geometry>, D::Error> {
        sizes
            .iter()
            .map(|&(w, h)| self.sample(w, h, draws))
            .collect()
    }
}

/// Python's `int(round(x))`: halves to even.
fn round_half_even(x: f64) -> i64 {
    x.round_ties_even() as i64
}

/// `RandomResizedCrop.get_params`: `(top, left, height, width)`.
fn resized_crop<D: Draws>(
    width: u32,
    height: u32,
    scale: (f64, f64),
    log_ratio: (f64, f64),
    (min_ratio, max_ratio): (f64, f64),
    draws: &mut D,
) -> Result<(u32, u32, u32, u32), D::Error> {
    let (iw, ih) = (i64::from(width), i64::from(height));
    let area = (iw * ih) as f64;
    for _ in 0..10 {
        let target_area = area * draws.uniform(scale.0, scale.1)?;
        let (least, most) = draws.exp_uniform(log_ratio.0, log_ratio.1)?;
        // w grows and h shrinks with the ratio: equal at both ends, equal
        // for every value between.
        let w = round_half_even((target_area * least).sqrt());
        let h = round_half_even((target_area / least).sqrt());
        if (w, h)
            != (
                round_half_even((target_area * most).sqrt()),
                round_half_even((target_area / most).sqrt()),
            )
        {
            return Err(draws.unsure());
        }
        if 0 < w && w <= iw && 0 < h && h <= ih {
            let top = draws.randint((ih - h + 1) as u64)?;
            let left = draws.randint((iw - w + 1) as u64)?;
            return Ok((top as u32, left as u32, h as u32, w as u32));
        }
    }
    // No fit in ten tries: the central crop, no draws.
    let in_ratio = width as f64 / height as f64;
    let (w, h) = if in_ratio < min_ratio {
        (iw, round_half_even(iw as f64 / min_ratio))
    } else if in_ratio > max_ratio {
        (round_half_even(ih as f64 * max_ratio), ih)
    } else {
        (iw, ih)
    };
    Ok((
        (ih - h).div_euclid(2) as u32,
        (iw - w).div_euclid(2) as u32,
        h as u32,
        w as u32,
    ))
}

/// `Resize`'s output `(height, width)` for a PIL image, as torchvision
/// computes it.
fn resized_size(height: u32, width: u32, size: ResizeTo, max_size: Option<u32>) -> (u32, u32) {
    let (short, long) = if width <= height {
        (width, height)
    } else {
        (height, width)
    };
    let (short, long) = (f64::from(short), f64::from(long));
    let (new_short, new_long) = match size {
        ResizeTo::Exact(h, w) => return (h, w),
        ResizeTo::Longer => {
            let max = f64::from(max_size.unwrap_or(0));
            ((max * short / long) as u32, max as u32)
        }
        ResizeTo::Shorter(requested) => {
            let requested = f64::from(requested);
            let (mut s, mut l) = (requested, (requested * long / short).trunc());
            if let Some(max) = max_size.map(f64::from) {
                if l > max {
                    (s, l) = ((max * s / l).trunc(), max);
                }
            }
            (s as u32, l as u32)
        }
    };
    if width <= height {
        (new_long, new_short)
    } else {
        (new_short, new_long)
    }
}

/// `CenterCrop`'s window `(left, top, width, height)` of a `height x width`
/// image, padding (outside the image: zeros) included.
fn center_window(height: u32, width: u32, (ch, cw): (u32, u32)) -> (i64, i64, u32, u32) {
    let (h, w, ch_, cw_) = (
        i64::from(height),
        i64::from(width),
        i64::from(ch),
        i64::from(cw),
    );
    let pad = |want: i64, have: i64, extra: i64| {
        if want > have {
            (want - have + extra).div_euclid(2)
        } else {
            0
        }
    };
    let (pl, pt) = (pad(cw_, w, 0), pad(ch_, h, 0));
    let (pr, pb) = (pad(cw_, w, 1), pad(ch_, h, 1));
    let (ph, pw) = (h + pt + pb, w + pl + pr);
    if (ph, pw) == (ch_, cw_) {
        return (-pl, -pt, cw, ch);
    }
    let top = round_half_even((ph - ch_) as f64 / 2.0);
    let left = round_half_even((pw - cw_) as f64 / 2.0);
    (left - pl, top - pt, cw, ch)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state as torch's `manual_seed(seed)` leaves it (its initialisation
    /// of the twister: `left = 1`, `next = 0`).
    fn seeded(seed: u32) -> TorchCpuRng {
        let mut words = [0u32; MT_N];
        words[0] = seed;
        for i in 1..MT_N {
            words[i] = 1_812_433_253u32
                .wrapping_mul(words[i - 1] ^ (words[i - 1] >> 30))
                .wrapping_add(i as u32);
        }
        let mut bytes = vec![0u8; TORCH_STATE_BYTES];
        bytes[0..8].copy_from_slice(&u64::from(seed).to_le_bytes());
        bytes[LEFT_AT..LEFT_AT + 4].copy_from_slice(&1i32.to_le_bytes());
        for (i, word) in words.iter().enumerate() {
            let at = WORDS_AT + 8 * i;
            bytes[at..at + 8].copy_from_slice(&u64::from(*word).to_le_bytes());
        }
        TorchCpuRng::from_state(&bytes, false).unwrap()
    }

    #[test]
    fn the_twister_gives_the_reference_sequence() {
        // std::mt19937 seeded 5489: its 10000th output is 4123659995.
        let mut rng = seeded(5489);
        let first = rng.random();
        assert_eq!(first, 3_499_211_612);
        let mut last = first;
        for _ in 1..10_000 {
            last = rng.random();
        }
        assert_eq!(last, 4_123_659_995);
    }

    #[test]
    fn the_state_round_trips_through_its_bytes() {
        let mut rng = seeded(7);
        for _ in 0..1000 {
            rng.random();
        }
        let again = TorchCpuRng::from_state(&rng.state(), false).unwrap();
        let (mut a, mut b) = (rng.clone(), again);
        for _ in 0..2000 {
            assert_eq!(a.random(), b.random());
        }
    }

    #[test]
    fn a_malformed_state_is_refused_with_its_reason() {
        let err = TorchCpuRng::from_state(&[0u8; 10], false).err().unwrap();
        assert!(err.to_string().contains("10 bytes"), "{err}");
        let mut bytes = seeded(1).state();
        bytes[LEFT_AT..LEFT_AT + 4].copy_from_slice(&0i32.to_le_bytes());
        let err = TorchCpuRng::from_state(&bytes, false).err().unwrap();
        assert!(err.to_string().contains("left=0"), "{err}");
    }

    #[test]
    fn crops_fit_their_image_and_the_fallback_is_central() {
        let sampler = Sampler {
            placement: Placement::ResizedCrop {
                scale: (0.08, 1.0),
                log_ratio: ((3.0f64 / 4.0).ln(), (4.0f64 / 3.0).ln()),
                ratio_range: (0.75, 4.0 / 3.0),
                output: (224, 224),
            },
            flip_p: Some(0.5),
        };
        let mut rng = seeded(3);
        let mut flips = 0;
        for &(w, h) in &[(500, 375), (375, 500), (1, 1), (3000, 20), (224, 224)] {
            for _ in 0..200 {
                let g = sampler.sample(w, h, &mut rng).unwrap();
                let (l, t, cw, ch) = g.crop;
                assert!(
                    cw > 0 && ch > 0 && l + cw <= w && t + ch <= h,
                    "{g:?} of {w}x{h}"
                );
                assert_eq!((g.resize, g.window), ((224, 224), (0, 0, 224, 224)));
                flips += usize::from(g.flip);
            }
        }
        assert!((300..700).contains(&flips), "{flips} flips of 1000");
        // A 3000 x 20 strip never fits a ratio in [3/4, 4/3]: the central
        // crop of the widest allowed ratio.
        let mut rng = seeded(4);
        let g = sampler.sample(3000, 20, &mut rng).unwrap();
        assert_eq!(g.crop, ((3000 - 27) / 2, 0, 27, 20));
    }

    #[test]
    fn resize_and_center_crop_as_torchvision() {
        assert_eq!(
            resized_size(375, 500, ResizeTo::Shorter(256), None),
            (256, 341)
        );
        assert_eq!(
            resized_size(500, 375, ResizeTo::Shorter(256), None),
            (341, 256)
        );
        assert_eq!(
            resized_size(375, 500, ResizeTo::Shorter(256), Some(300)),
            (225, 300)
        );
        assert_eq!(
            resized_size(375, 500, ResizeTo::Longer, Some(100)),
            (75, 100)
        );
        assert_eq!(resized_size(375, 500, ResizeTo::Exact(7, 9), None), (7, 9));
        assert_eq!(center_window(256, 341, (224, 224)), (58, 16, 224, 224));
        // Smaller than the crop: padded, the image centred.
        assert_eq!(center_window(100, 101, (224, 224)), (-61, -62, 224, 224));
    }
}
