//! Gradient codecs applied around an allreduce: half-precision compression
//! and the non-finite check.
//!
//! Compression casts a float32/float64 bucket to float16 or bfloat16 for the
//! wire, after dividing by the world size (DDP's averaging) and multiplying
//! by an optional scale, so the sum of every rank's values stays in range;
//! the reduced values are cast back and divided by the scale. Half-precision
//! buckets travel as they are.

use half::{bf16, f16};

use super::dtype::{f16_bytes_to_f32, f32_to_f16_bytes, DType, F16_BLOCK};
pub use crate::config::Compression;

/// The wire type a compression setting casts a bucket to (the setting,
/// its names and its parse are `config`'s).
impl Compression {
    /// The wire type for a bucket of `dtype`, or `None` to send it as is.
    pub fn wire_dtype(self, dtype: DType) -> Option<DType> {
        match (self, dtype) {
            (Compression::None, _) | (_, DType::F16 | DType::BF16) => None,
            // Integers and bools travel as they are.
            (_, d) if !d.is_float() => None,
            (Compression::Fp16, _) => Some(DType::F16),
            (Compression::Bf16, _) => Some(DType::BF16),
        }
    }
}

fn read(dtype: DType, bytes: &[u8]) -> f64 {
    match dtype {
        DType::F32 => f32::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as f64,
        DType::F64 => f64::from_ne_bytes(bytes[..8].try_into().unwrap_or([0; 8])),
        DType::F16 => f16::from_ne_bytes([bytes[0], bytes[1]]).to_f64(),
        DType::BF16 => bf16::from_ne_bytes([bytes[0], bytes[1]]).to_f64(),
        DType::I8 => i8::from_ne_bytes([bytes[0]]) as f64,
        DType::U8 | DType::Bool => bytes[0] as f64,
        DType::I32 => i32::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as f64,
        DType::I64 => i64::from_ne_bytes(bytes[..8].try_into().unwrap_or([0; 8])) as f64,
    }
}

/// Casts `src` (elements of `dtype`) times `factor` into `dst` (elements of
/// the half type `wire`), rounding to nearest even.
pub fn encode(src: &[u8], dtype: DType, factor: f64, dst: &mut [u8], wire: DType) {
    let factor32 = factor as f32;
    if (dtype, wire) == (DType::F32, DType::F16) {
        // The common case, in blocks through the vectorised conversion.
        let mut values = [0f32; F16_BLOCK];
        for (s, d) in src.chunks(4 * F16_BLOCK).zip(dst.chunks_mut(2 * F16_BLOCK)) {
            let n = s.len() / 4;
            for (v, c) in values[..n].iter_mut().zip(s.chunks_exact(4)) {
                *v = f32::from_ne_bytes([c[0], c[1], c[2], c[3]]) * factor32;
            }
            f32_to_f16_bytes(&values[..n], d);
        }
        return;
    }
    for (s, d) in src.chunks_exact(dtype.size()).zip(dst.chunks_exact_mut(2)) {
        let v = match dtype {
            DType::F32 => f32::from_ne_bytes([s[0], s[1], s[2], s[3]]) * factor32,
            _ => (read(dtype, s) * factor) as f32,
        };
        let out = match wire {
            DType::BF16 => bf16::from_f32(v).to_ne_bytes(),
            _ => f16::from_f32(v).to_ne_bytes(),
        };
        d.copy_from_slice(&out);
    }
}

/// Casts `src` (half type `wire`) times `factor` back into `dst` (`dtype`).
pub fn decode(src: &[u8], wire: DType, factor: f64, dst: &mut [u8], dtype: DType) {
    if (wire, dtype) == (DType::F16, DType::F32) {
        let mut values = [0f32; F16_BLOCK];
        for (s, d) in src.chunks(2 * F16_BLOCK).zip(dst.chunks_mut(4 * F16_BLOCK)) {
            let n = s.len() / 2;
            f16_bytes_to_f32(s, &mut values[..n]);
            for (v, c) in values[..n].iter().zip(d.chunks_exact_mut(4)) {
                // In f64 like the general path below, so results do not
                // depend on which path ran (a factor of 1 changes nothing).
                let v = if factor == 1.0 {
                    *v
                } else {
                    (*v as f64 * factor) as f32
                };
                c.copy_from_slice(&v.to_ne_bytes());
            }
        }
        return;
    }
    for (s, d) in src.chunks_exact(2).zip(dst.chunks_exact_mut(dtype.size())) {
        let v = read(wire, s) * factor;
        match dtype {
            DType::F32 => d.copy_from_slice(&(v as f32).to_ne_bytes()),
            DType::F64 => d.copy_from_slice(&v.to_ne_bytes()),
            DType::F16 => d.copy_from_slice(&f16::from_f64(v).to_ne_bytes()),
            DType::BF16 => d.copy_from_slice(&bf16::from_f64(v).to_ne_bytes()),
            // Never a compressed type's destination (integers are not
            // compressed); converted as a cast would.
            DType::I8 => d.copy_from_slice(&(v as i8).to_ne_bytes()),
            DType::U8 => d.copy_from_slice(&(v as u8).to_ne_bytes()),
            DType::Bool => d.copy_from_slice(&[u8::from(v != 0.0)]),
            DType::I32 => d.copy_from_slice(&(v as i32).to_ne_bytes()),
            DType::I64 => d.copy_from_slice(&(v as i64).to_ne_bytes()),
        }
    }
}

/// The first non-finite element (NaN or infinity) of `buf` and its value.
pub fn first_non_finite(buf: &[u8], dtype: DType) -> Option<(usize, f64)> {
    buf.chunks_exact(dtype.size())
        .map(|c| read(dtype, c))
        .enumerate()
        .find(|(_, v)| !v.is_finite())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::dtype::tests::{decode as dec, encode as enc};

    #[test]
    fn parses_and_picks_wire_types() {
        assert_eq!(Compression::parse("X", "FP16").unwrap(), Compression::Fp16);
        assert_eq!(
            Compression::parse("X", "bfloat16").unwrap(),
            Compression::Bf16
        );
        let err = Compression::parse("TIACC_TRAINING_COMPRESSION", "int8").unwrap_err();
        assert!(err.to_string().contains("TIACC_TRAINING_COMPRESSION"));
        assert_eq!(Compression::Fp16.wire_dtype(DType::F32), Some(DType::F16));
        assert_eq!(Compression::Bf16.wire_dtype(DType::F64), Some(DType::BF16));
        assert_eq!(Compression::Fp16.wire_dtype(DType::BF16), None);
        assert_eq!(Compression::None.wire_dtype(DType::F32), None);
    }

    #[test]
    fn round_trips_within_half_precision() {
        let values = [1.0, -0.5, 3.25, 1e-3, 65504.0 * 4.0];
        for wire in [DType::F16, DType::BF16] {
            let src = enc(DType::F32, &values);
            let mut half = vec![0u8; values.len() * 2];
            encode(&src, DType::F32, 0.25, &mut half, wire);
            let mut back = vec![0u8; src.len()];
            decode(&half, wire, 4.0, &mut back, DType::F32);
            for (got, want) in dec(DType::F32, &back).iter().zip(values) {
                assert!(
                    (got - want).abs() <= want.abs() * 1e-2,
                    "{wire:?}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn finds_nan_and_infinity() {
        assert_eq!(
            first_non_finite(&enc(DType::F32, &[1.0, 2.0]), DType::F32),
            None
        );
        let (i, v) = first_non_finite(&enc(DType::F64, &[1.0, f64::NAN, 3.0]), DType::F64).unwrap();
        assert_eq!(i, 1);
        assert!(v.is_nan());
        let (i, _) =
            first_non_finite(&enc(DType::BF16, &[0.0, 1.0, f64::INFINITY]), DType::BF16).unwrap();
        assert_eq!(i, 2);
    }
}
