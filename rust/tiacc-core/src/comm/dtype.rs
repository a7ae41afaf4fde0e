//! Element types the engine reduces, and their sums.
//!
//! Half types (float16, bfloat16) are added in float32 and rounded once per
//! addition (round to nearest even), so a ring hop never loses more than one
//! half-precision rounding.

use half::{bf16, f16, slice::HalfFloatSliceExt};

use crate::error::{Error, Result};

/// Element type of a communication buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
}

impl DType {
    /// Parses the names torch and numpy use (`float32`, `torch.float16`, `bf16`, ...).
    pub fn parse(name: &str) -> Result<Self> {
        let name = name.trim().trim_start_matches("torch.");
        Ok(match name {
            "float32" | "float" | "f32" => DType::F32,
            "float64" | "double" | "f64" => DType::F64,
            "float16" | "half" | "f16" => DType::F16,
            "bfloat16" | "bf16" => DType::BF16,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "unsupported dtype {other:?}: the engine reduces float32, float64, float16 and bfloat16"
                )))
            }
        })
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 => 8,
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// The torch name of the type.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
        }
    }

    /// A small stable code, used in the collective headers ranks compare.
    pub fn code(self) -> u8 {
        match self {
            DType::F32 => 1,
            DType::F64 => 2,
            DType::F16 => 3,
            DType::BF16 => 4,
        }
    }

    /// `acc[i] += src[i]` element-wise over whole elements of both slices.
    /// Both are native-endian element bytes of the same length.
    pub fn add_assign(self, acc: &mut [u8], src: &[u8]) {
        debug_assert_eq!(acc.len(), src.len());
        match self {
            DType::F32 => zip_map::<4>(acc, src, |a, b| {
                (f32::from_ne_bytes(a) + f32::from_ne_bytes(b)).to_ne_bytes()
            }),
            DType::F64 => zip_map::<8>(acc, src, |a, b| {
                (f64::from_ne_bytes(a) + f64::from_ne_bytes(b)).to_ne_bytes()
            }),
            DType::F16 => {
                let (mut x, mut y) = ([0f32; F16_BLOCK], [0f32; F16_BLOCK]);
                for (a, b) in acc.chunks_mut(2 * F16_BLOCK).zip(src.chunks(2 * F16_BLOCK)) {
                    let n = a.len() / 2;
                    f16_bytes_to_f32(a, &mut x[..n]);
                    f16_bytes_to_f32(b, &mut y[..n]);
                    for (x, y) in x[..n].iter_mut().zip(&y[..n]) {
                        *x += y;
                    }
                    f32_to_f16_bytes(&x[..n], a);
                }
            }
            DType::BF16 => zip_map::<2>(acc, src, |a, b| {
                let sum = bf16::from_ne_bytes(a).to_f32() + bf16::from_ne_bytes(b).to_f32();
                bf16::from_f32(sum).to_ne_bytes()
            }),
        }
    }

    /// `buf[i] /= divisor` element-wise (half types computed in float32),
    /// exactly as [`DType::div_into`] computes it.
    pub fn div_assign(self, buf: &mut [u8], divisor: f64) {
        // One block at a time through a copy that stays in L1, so that the
        // quotient is written once, in `div_into`.
        let mut block = [0u8; DIV_BLOCK];
        for chunk in buf.chunks_mut(DIV_BLOCK) {
            let src = &mut block[..chunk.len()];
            src.copy_from_slice(chunk);
            self.div_into(src, chunk, divisor);
        }
    }

    /// `dst[i] = src[i] / divisor` element-wise over whole elements of both
    /// slices (of the same length); half types are computed in float32.
    ///
    /// When the divisor is a power of two (DDP's world sizes usually are)
    /// and its reciprocal is a normal number, the quotient is computed as a
    /// product with that reciprocal: the exact quotient and the exact
    /// product are then the same real number, so IEEE rounding gives the
    /// same bits (NaN and infinities included), several times faster.
    pub fn div_into(self, src: &[u8], dst: &mut [u8], divisor: f64) {
        debug_assert_eq!(src.len(), dst.len());
        let d32 = divisor as f32;
        let by = exact_reciprocal_f32(d32);
        let quotient = |x: f32| by.map_or(x / d32, |r| x * r);
        match self {
            DType::F32 => {
                map_into::<4>(src, dst, |a| quotient(f32::from_ne_bytes(a)).to_ne_bytes())
            }
            DType::F64 => {
                let by = exact_reciprocal_f64(divisor);
                map_into::<8>(src, dst, |a| {
                    let x = f64::from_ne_bytes(a);
                    by.map_or(x / divisor, |r| x * r).to_ne_bytes()
                })
            }
            DType::F16 => {
                let mut x = [0f32; F16_BLOCK];
                for (s, o) in src.chunks(2 * F16_BLOCK).zip(dst.chunks_mut(2 * F16_BLOCK)) {
                    let n = s.len() / 2;
                    f16_bytes_to_f32(s, &mut x[..n]);
                    x[..n].iter_mut().for_each(|v| *v = quotient(*v));
                    f32_to_f16_bytes(&x[..n], o);
                }
            }
            DType::BF16 => map_into::<2>(src, dst, |a| {
                bf16::from_f32(quotient(bf16::from_ne_bytes(a).to_f32())).to_ne_bytes()
            }),
        }
    }
}

/// `1 / d` when `d` is a positive power of two whose reciprocal is a
/// normal float32 (then `x * (1 / d)` rounds exactly as `x / d`).
fn exact_reciprocal_f32(d: f32) -> Option<f32> {
    let power_of_two = d.is_normal() && d > 0.0 && d.to_bits() & 0x007f_ffff == 0;
    Some(1.0 / d).filter(|r| power_of_two && r.is_normal())
}

/// [`exact_reciprocal_f32`] for float64.
fn exact_reciprocal_f64(d: f64) -> Option<f64> {
    let power_of_two = d.is_normal() && d > 0.0 && d.to_bits() & 0x000f_ffff_ffff_ffff == 0;
    Some(1.0 / d).filter(|r| power_of_two && r.is_normal())
}

/// Bytes [`DType::div_assign`] divides at a time (a multiple of every
/// element size).
const DIV_BLOCK: usize = 4096;

/// Elements per block of the float16 fast paths below.
pub(crate) const F16_BLOCK: usize = 512;

/// float16 bytes (native-endian) to float32, `out.len()` elements of at
/// most [`F16_BLOCK`]. The `half` crate's slice conversion uses the CPU's
/// F16C instructions when it has them (checked at run time), several times
/// faster than converting one value at a time, with the same results (the
/// conversion is exact).
pub(crate) fn f16_bytes_to_f32(bytes: &[u8], out: &mut [f32]) {
    let mut halves = [f16::ZERO; F16_BLOCK];
    let halves = &mut halves[..out.len()];
    for (h, c) in halves.iter_mut().zip(bytes.chunks_exact(2)) {
        *h = f16::from_ne_bytes([c[0], c[1]]);
    }
    halves.convert_to_f32_slice(out);
}

/// float32 to float16 bytes, rounded to nearest even (as `f16::from_f32`),
/// `values.len()` elements of at most [`F16_BLOCK`].
pub(crate) fn f32_to_f16_bytes(values: &[f32], bytes: &mut [u8]) {
    let mut halves = [f16::ZERO; F16_BLOCK];
    let halves = &mut halves[..values.len()];
    halves.convert_from_f32_slice(values);
    for (h, c) in halves.iter().zip(bytes.chunks_exact_mut(2)) {
        c.copy_from_slice(&h.to_ne_bytes());
    }
}

// Byte-array element access keeps the buffers free of alignment
// requirements (receive staging is a plain Vec<u8>); the loops still
// vectorise because the arrays are fixed-size.
#[inline]
fn zip_map<const N: usize>(acc: &mut [u8], src: &[u8], f: impl Fn([u8; N], [u8; N]) -> [u8; N]) {
    for (a, b) in acc.chunks_exact_mut(N).zip(src.chunks_exact(N)) {
        let (Ok(x), Ok(y)) = (<[u8; N]>::try_from(&*a), <[u8; N]>::try_from(b)) else {
            continue;
        };
        a.copy_from_slice(&f(x, y));
    }
}

#[inline]
fn map_into<const N: usize>(src: &[u8], dst: &mut [u8], f: impl Fn([u8; N]) -> [u8; N]) {
    for (s, d) in src.chunks_exact(N).zip(dst.chunks_exact_mut(N)) {
        let Ok(x) = <[u8; N]>::try_from(s) else {
            continue;
        };
        d.copy_from_slice(&f(x));
    }
}

/// The element range of shard `index` when `len` elements are split into
/// `parts` contiguous shards of `ceil(len / parts)` elements (the last ones
/// shorter, possibly empty). Every rank computes the same partition, and it
/// is the one of a collective on equal shards over `len` padded to a
/// multiple of `parts` (NCCL's reduce-scatter and allgather), so padded and
/// unpadded buffers agree on every shard's elements.
pub fn shard_range(len: usize, parts: usize, index: usize) -> std::ops::Range<usize> {
    let chunk = len.div_ceil(parts.max(1));
    let start = (index * chunk).min(len);
    start..(start + chunk).min(len)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Encodes f64 values as `dtype` bytes (test helper).
    pub fn encode(dtype: DType, values: &[f64]) -> Vec<u8> {
        let mut out = Vec::with_capacity(values.len() * dtype.size());
        for &v in values {
            match dtype {
                DType::F32 => out.extend((v as f32).to_ne_bytes()),
                DType::F64 => out.extend(v.to_ne_bytes()),
                DType::F16 => out.extend(f16::from_f64(v).to_ne_bytes()),
                DType::BF16 => out.extend(bf16::from_f64(v).to_ne_bytes()),
            }
        }
        out
    }

    /// Decodes `dtype` bytes to f64 (test helper).
    pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
        bytes
            .chunks_exact(dtype.size())
            .map(|c| match dtype {
                DType::F32 => f32::from_ne_bytes(c.try_into().unwrap()) as f64,
                DType::F64 => f64::from_ne_bytes(c.try_into().unwrap()),
                DType::F16 => f16::from_ne_bytes(c.try_into().unwrap()).to_f64(),
                DType::BF16 => bf16::from_ne_bytes(c.try_into().unwrap()).to_f64(),
            })
            .collect()
    }

    #[test]
    fn parses_torch_names() {
        assert_eq!(DType::parse("torch.float32").unwrap(), DType::F32);
        assert_eq!(DType::parse("bfloat16").unwrap(), DType::BF16);
        assert_eq!(DType::parse("half").unwrap(), DType::F16);
        assert!(DType::parse("int64")
            .unwrap_err()
            .to_string()
            .contains("int64"));
    }

    #[test]
    fn sums_every_type() {
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            let mut a = encode(dtype, &[1.0, -2.5, 96.0]);
            let b = encode(dtype, &[0.5, 2.5, 4.0]);
            dtype.add_assign(&mut a, &b);
            assert_eq!(decode(dtype, &a), vec![1.5, 0.0, 100.0], "{dtype:?}");
            dtype.div_assign(&mut a, 4.0);
            assert_eq!(decode(dtype, &a), vec![0.375, 0.0, 25.0], "{dtype:?}");
        }
    }

    #[test]
    fn dividing_into_another_buffer_gives_the_in_place_bits() {
        // Longer than one block of `div_assign`, and not a multiple of it.
        let values: Vec<f64> = (0..3001).map(|i| (i as f64 * 0.37).sin() * 1e4).collect();
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            for divisor in [3.0, 4.0, 7.0] {
                let src = encode(dtype, &values);
                let mut in_place = src.clone();
                dtype.div_assign(&mut in_place, divisor);
                let mut into = vec![0u8; src.len()];
                dtype.div_into(&src, &mut into, divisor);
                assert_eq!(into, in_place, "{dtype:?} / {divisor}");
                assert_ne!(into, src, "{dtype:?} / {divisor}");
            }
        }
    }

    #[test]
    fn half_sums_round_once_from_float32() {
        // 2048 + 1 is not representable in f16 (spacing 2 there): round to even.
        let mut a = encode(DType::F16, &[2048.0]);
        DType::F16.add_assign(&mut a, &encode(DType::F16, &[1.0]));
        assert_eq!(decode(DType::F16, &a), vec![2048.0]);
        let mut a = encode(DType::F16, &[2050.0]);
        DType::F16.add_assign(&mut a, &encode(DType::F16, &[1.0]));
        assert_eq!(decode(DType::F16, &a), vec![2052.0]);
    }

    #[test]
    fn shards_cover_the_buffer_exactly() {
        for len in [0usize, 1, 5, 7, 64, 1001] {
            for parts in 1..6 {
                let mut next = 0;
                let chunk = len.div_ceil(parts);
                for i in 0..parts {
                    let r = shard_range(len, parts, i);
                    assert_eq!(r.start, next);
                    assert!(r.len() <= chunk);
                    // Only the shards at the end are short.
                    assert!(r.len() == chunk || r.end == len, "{len} {parts} {i}");
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn float16_fast_paths_match_one_value_at_a_time() {
        // Every float16 value (NaNs, infinities, subnormals included)
        // against a spread of others, over a length that is not a multiple
        // of the block.
        let all: Vec<u8> = (0..=u16::MAX).flat_map(|bits| bits.to_ne_bytes()).collect();
        let other: Vec<u8> = (0..=u16::MAX)
            .flat_map(|i| i.wrapping_mul(40503).to_ne_bytes())
            .collect();
        let scalar = |a: [u8; 2], b: [u8; 2]| {
            f16::from_f32(f16::from_ne_bytes(a).to_f32() + f16::from_ne_bytes(b).to_f32())
        };
        let mut sum = all.clone();
        DType::F16.add_assign(&mut sum, &other);
        let mut quotient = all.clone();
        DType::F16.div_assign(&mut quotient, 3.0);
        for i in 0..all.len() / 2 {
            let (a, b) = (
                [all[2 * i], all[2 * i + 1]],
                [other[2 * i], other[2 * i + 1]],
            );
            let got = f16::from_ne_bytes([sum[2 * i], sum[2 * i + 1]]);
            let want = scalar(a, b);
            assert!(
                got == want || (got.is_nan() && want.is_nan()),
                "{a:?} + {b:?}"
            );
            let got = f16::from_ne_bytes([quotient[2 * i], quotient[2 * i + 1]]);
            let want = f16::from_f32(f16::from_ne_bytes(a).to_f32() / 3.0);
            assert!(got == want || (got.is_nan() && want.is_nan()), "{a:?} / 3");
        }
    }

    #[test]
    fn power_of_two_divisors_give_the_bits_of_a_true_division() {
        // Every float16 and bfloat16 value, and float32/float64 values
        // spread over their whole bit space (subnormals, infinities and
        // NaNs included), against a plain division, for the sizes DDP
        // divides by and one that is not a power of two.
        let same32 =
            |got: f32, want: f32| got.to_bits() == want.to_bits() || got.is_nan() && want.is_nan();
        for divisor in [2.0, 4.0, 8.0, 1024.0, 6.0] {
            let d = divisor as f32;
            let halves: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_ne_bytes()).collect();
            for dtype in [DType::F16, DType::BF16] {
                let mut out = vec![0u8; halves.len()];
                dtype.div_into(&halves, &mut out, divisor);
                for (c, o) in halves.chunks_exact(2).zip(out.chunks_exact(2)) {
                    let (x, got) = match dtype {
                        DType::F16 => (
                            f16::from_ne_bytes([c[0], c[1]]).to_f32(),
                            f16::from_ne_bytes([o[0], o[1]]).to_f32(),
                        ),
                        _ => (
                            bf16::from_ne_bytes([c[0], c[1]]).to_f32(),
                            bf16::from_ne_bytes([o[0], o[1]]).to_f32(),
                        ),
                    };
                    let want = match dtype {
                        DType::F16 => f16::from_f32(x / d).to_f32(),
                        _ => bf16::from_f32(x / d).to_f32(),
                    };
                    assert!(same32(got, want), "{dtype:?} {x} / {divisor}");
                }
            }
            let singles: Vec<u8> = (0..=u32::MAX)
                .step_by(4099)
                .flat_map(|b| b.to_ne_bytes())
                .collect();
            let mut out = vec![0u8; singles.len()];
            DType::F32.div_into(&singles, &mut out, divisor);
            for (c, o) in singles.chunks_exact(4).zip(out.chunks_exact(4)) {
                let x = f32::from_ne_bytes(c.try_into().unwrap());
                let got = f32::from_ne_bytes(o.try_into().unwrap());
                assert!(same32(got, x / d), "{x:e} / {divisor}");
            }
            let doubles: Vec<u8> = (0..=u64::MAX)
                .step_by(0x0000_1a2b_3c4d_5e6f)
                .flat_map(|b| b.to_ne_bytes())
                .collect();
            let mut out = vec![0u8; doubles.len()];
            DType::F64.div_into(&doubles, &mut out, divisor);
            for (c, o) in doubles.chunks_exact(8).zip(out.chunks_exact(8)) {
                let x = f64::from_ne_bytes(c.try_into().unwrap());
                let got = f64::from_ne_bytes(o.try_into().unwrap());
                let want = x / divisor;
                assert!(
                    got.to_bits() == want.to_bits() || got.is_nan() && want.is_nan(),
                    "{x:e} / {divisor}"
                );
            }
        }
    }
}
