//! Element types the engine reduces, and their reductions.
//!
//! Half types (float16, bfloat16) are added (and multiplied) in float32 and
//! rounded once per operation (round to nearest even), so a ring hop never
//! loses more than one half-precision rounding; their minimum and maximum
//! pick one of the two values, bit for bit. Integers wrap on overflow (as
//! torch's and gloo's integer sums do); bool sums are a logical or and
//! products a logical and, as gloo computes them.

use half::{bf16, f16, slice::HalfFloatSliceExt};

use crate::error::{Error, Result};

/// Element type of a communication buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I8,
    U8,
    I32,
    I64,
    Bool,
}

/// How a reduction combines the ranks' elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Product,
    Min,
    Max,
}

impl ReduceOp {
    /// Every operation, in code order.
    pub const ALL: [ReduceOp; 4] = [
        ReduceOp::Sum,
        ReduceOp::Product,
        ReduceOp::Min,
        ReduceOp::Max,
    ];

    /// Parses `sum`, `product` (or `prod`), `min` and `max`, in any case
    /// (torch's `ReduceOp` names).
    pub fn parse(name: &str) -> Result<Self> {
        let name = name.trim().to_ascii_lowercase();
        let name = name.trim_start_matches("reduceop.");
        Ok(match name {
            "sum" => ReduceOp::Sum,
            "product" | "prod" => ReduceOp::Product,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "unsupported reduce op {other:?}: the engine reduces with sum, product, min \
                     and max"
                )))
            }
        })
    }

    /// Lower-case name, as torch spells it.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Product => "product",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
        }
    }

    /// A small stable code, used in the collective headers ranks compare.
    pub fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Product => 1,
            ReduceOp::Min => 2,
            ReduceOp::Max => 3,
        }
    }

    /// The operation of [`ReduceOp::code`].
    pub fn from_code(code: u8) -> Option<Self> {
        ReduceOp::ALL.into_iter().find(|op| op.code() == code)
    }
}

impl DType {
    /// Every type, in code order.
    pub const ALL: [DType; 9] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::I64,
        DType::Bool,
    ];

    /// Parses the names torch and numpy use (`float32`, `torch.float16`,
    /// `bf16`, `int64`, `torch.uint8`, `bool`, ...).
    pub fn parse(name: &str) -> Result<Self> {
        let name = name.trim().trim_start_matches("torch.");
        Ok(match name {
            "float32" | "float" | "f32" => DType::F32,
            "float64" | "double" | "f64" => DType::F64,
            "float16" | "half" | "f16" => DType::F16,
            "bfloat16" | "bf16" => DType::BF16,
            "int8" | "i8" => DType::I8,
            "uint8" | "u8" => DType::U8,
            "int32" | "int" | "i32" => DType::I32,
            "int64" | "long" | "i64" => DType::I64,
            "bool" => DType::Bool,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "unsupported dtype {other:?}: the engine reduces float32, float64, float16, \
                     bfloat16, int8, uint8, int32, int64 and bool"
                )))
            }
        })
    }

    /// Whether the type is a floating-point one.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// Whether an average means something: every type but bool (integers
    /// take the quotient rounded toward zero, as NCCL's integer mean).
    pub fn averages(self) -> bool {
        self != DType::Bool
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// The torch name of the type.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::Bool => "bool",
        }
    }

    /// A small stable code, used in the collective headers ranks compare.
    pub fn code(self) -> u8 {
        match self {
            DType::F32 => 1,
            DType::F64 => 2,
            DType::F16 => 3,
            DType::BF16 => 4,
            DType::I8 => 5,
            DType::U8 => 6,
            DType::I32 => 7,
            DType::I64 => 8,
            DType::Bool => 9,
        }
    }

    /// The type of [`DType::code`].
    pub fn from_code(code: u8) -> Option<Self> {
        DType::ALL.into_iter().find(|d| d.code() == code)
    }

    /// `acc[i] = op(acc[i], src[i])` element-wise over whole elements of
    /// both slices (native-endian element bytes of the same length). The
    /// result does not depend on the order of the two operands.
    pub fn reduce_assign(self, op: ReduceOp, acc: &mut [u8], src: &[u8]) {
        debug_assert_eq!(acc.len(), src.len());
        if op == ReduceOp::Sum && self.is_float() {
            return self.add_assign(acc, src);
        }
        macro_rules! ints {
            ($t:ty, $n:literal) => {
                zip_map::<$n>(acc, src, |a, b| {
                    let (a, b) = (<$t>::from_ne_bytes(a), <$t>::from_ne_bytes(b));
                    match op {
                        ReduceOp::Sum => a.wrapping_add(b),
                        ReduceOp::Product => a.wrapping_mul(b),
                        ReduceOp::Min => a.min(b),
                        ReduceOp::Max => a.max(b),
                    }
                    .to_ne_bytes()
                })
            };
        }
        match self {
            DType::I8 => ints!(i8, 1),
            DType::U8 => ints!(u8, 1),
            DType::I32 => ints!(i32, 4),
            DType::I64 => ints!(i64, 8),
            DType::Bool => zip_map::<1>(acc, src, |[a], [b]| {
                let (a, b) = (a != 0, b != 0);
                [u8::from(match op {
                    ReduceOp::Sum | ReduceOp::Max => a || b,
                    ReduceOp::Product | ReduceOp::Min => a && b,
                })]
            }),
            DType::F32 => zip_map::<4>(acc, src, |a, b| {
                let (x, y) = (f32::from_ne_bytes(a), f32::from_ne_bytes(b));
                match op {
                    ReduceOp::Product => (x * y).to_ne_bytes(),
                    _ => pick(op, x, y, a, b),
                }
            }),
            DType::F64 => zip_map::<8>(acc, src, |a, b| {
                let (x, y) = (f64::from_ne_bytes(a), f64::from_ne_bytes(b));
                match op {
                    ReduceOp::Product => (x * y).to_ne_bytes(),
                    _ => pick(op, x, y, a, b),
                }
            }),
            DType::F16 => zip_map::<2>(acc, src, |a, b| {
                let (x, y) = (
                    f16::from_ne_bytes(a).to_f32(),
                    f16::from_ne_bytes(b).to_f32(),
                );
                match op {
                    ReduceOp::Product => f16::from_f32(x * y).to_ne_bytes(),
                    _ => pick(op, x, y, a, b),
                }
            }),
            DType::BF16 => zip_map::<2>(acc, src, |a, b| {
                let (x, y) = (
                    bf16::from_ne_bytes(a).to_f32(),
                    bf16::from_ne_bytes(b).to_f32(),
                );
                match op {
                    ReduceOp::Product => bf16::from_f32(x * y).to_ne_bytes(),
                    _ => pick(op, x, y, a, b),
                }
            }),
        }
    }

    /// `acc[i] += src[i]` element-wise over whole elements of both slices.
    /// Both are native-endian element bytes of the same length.
    pub fn add_assign(self, acc: &mut [u8], src: &[u8]) {
        debug_assert_eq!(acc.len(), src.len());
        match self {
            DType::I8 | DType::U8 | DType::I32 | DType::I64 | DType::Bool => {
                self.reduce_assign(ReduceOp::Sum, acc, src)
            }
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
            // Integers: the quotient rounded toward zero (torch's
            // `div(..., rounding_mode="trunc")`); bools are left as they are.
            DType::I8 => map_into::<1>(src, dst, |a| {
                ((i8::from_ne_bytes(a) as f64 / divisor).trunc() as i8).to_ne_bytes()
            }),
            DType::U8 => map_into::<1>(src, dst, |a| {
                ((u8::from_ne_bytes(a) as f64 / divisor).trunc() as u8).to_ne_bytes()
            }),
            DType::I32 => map_into::<4>(src, dst, |a| {
                ((i32::from_ne_bytes(a) as f64 / divisor).trunc() as i32).to_ne_bytes()
            }),
            DType::I64 => map_into::<8>(src, dst, |a| {
                let x = i64::from_ne_bytes(a);
                match exact_integer(divisor) {
                    Some(d) if d != 0 => x.wrapping_div(d),
                    _ => (x as f64 / divisor).trunc() as i64,
                }
                .to_ne_bytes()
            }),
            DType::Bool => dst.copy_from_slice(src),
        }
    }
}

/// Whether the sign bit of a float's native-endian bytes is set.
#[inline]
fn negative<const N: usize>(bytes: [u8; N]) -> bool {
    let top = if cfg!(target_endian = "little") {
        bytes[N - 1]
    } else {
        bytes[0]
    };
    top & 0x80 != 0
}

/// `divisor` as an integer, when it is one.
fn exact_integer(divisor: f64) -> Option<i64> {
    (divisor.fract() == 0.0 && divisor.abs() < 9.0e18).then_some(divisor as i64)
}

/// The minimum or maximum of two floats (`x`, `y`, read from the bytes
/// `a`, `b`), returned as the bytes of the one picked: a NaN wins (as in
/// `torch.minimum`; of two NaNs, the one whose bytes sort first), then the
/// smaller (larger) value, and of `-0.0` and `0.0` the negative (positive)
/// one, so the result does not depend on the order of the operands.
#[inline]
fn pick<T: PartialOrd + Copy, const N: usize>(
    op: ReduceOp,
    x: T,
    y: T,
    a: [u8; N],
    b: [u8; N],
) -> [u8; N] {
    #[allow(clippy::eq_op)]
    let (x_nan, y_nan) = (x != x, y != y);
    let first = match (x_nan, y_nan) {
        (true, true) => a <= b,
        (true, false) => true,
        (false, true) => false,
        _ if x == y => negative(a) == (op == ReduceOp::Min),
        _ => (x < y) == (op == ReduceOp::Min),
    };
    if first {
        a
    } else {
        b
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
                DType::I8 => out.extend((v as i8).to_ne_bytes()),
                DType::U8 => out.extend((v as u8).to_ne_bytes()),
                DType::I32 => out.extend((v as i32).to_ne_bytes()),
                DType::I64 => out.extend((v as i64).to_ne_bytes()),
                DType::Bool => out.push(u8::from(v != 0.0)),
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
                DType::I8 => i8::from_ne_bytes(c.try_into().unwrap()) as f64,
                DType::U8 | DType::Bool => c[0] as f64,
                DType::I32 => i32::from_ne_bytes(c.try_into().unwrap()) as f64,
                DType::I64 => i64::from_ne_bytes(c.try_into().unwrap()) as f64,
            })
            .collect()
    }

    #[test]
    fn parses_torch_names() {
        assert_eq!(DType::parse("torch.float32").unwrap(), DType::F32);
        assert_eq!(DType::parse("bfloat16").unwrap(), DType::BF16);
        assert_eq!(DType::parse("half").unwrap(), DType::F16);
        assert_eq!(DType::parse("torch.int64").unwrap(), DType::I64);
        assert_eq!(DType::parse("torch.uint8").unwrap(), DType::U8);
        assert_eq!(DType::parse("bool").unwrap(), DType::Bool);
        assert!(DType::parse("complex64")
            .unwrap_err()
            .to_string()
            .contains("complex64"));
        for dtype in DType::ALL {
            assert_eq!(DType::parse(dtype.name()).unwrap(), dtype);
            assert_eq!(DType::from_code(dtype.code()), Some(dtype));
        }
        for op in ReduceOp::ALL {
            assert_eq!(ReduceOp::parse(op.name()).unwrap(), op);
            assert_eq!(ReduceOp::from_code(op.code()), Some(op));
        }
        assert_eq!(ReduceOp::parse("PRODUCT").unwrap(), ReduceOp::Product);
        assert!(ReduceOp::parse("band")
            .unwrap_err()
            .to_string()
            .contains("band"));
    }

    /// `op` over two values as f64 (the reference the kernels must match
    /// on values every type holds exactly).
    fn reference(op: ReduceOp, a: f64, b: f64) -> f64 {
        match op {
            ReduceOp::Sum => a + b,
            ReduceOp::Product => a * b,
            ReduceOp::Min => a.min(b),
            ReduceOp::Max => a.max(b),
        }
    }

    #[test]
    fn every_op_reduces_every_type_exactly() {
        let a = [3.0, -2.0, 0.0, 7.0, -1.0, 5.0];
        let b = [-4.0, -2.0, 6.0, 1.0, 2.0, 0.0];
        for dtype in DType::ALL {
            let fits = |v: f64| match dtype {
                DType::U8 => v.abs(),
                DType::Bool => (v != 0.0) as u8 as f64,
                _ => v,
            };
            let (a, b): (Vec<f64>, Vec<f64>) = (a.map(fits).to_vec(), b.map(fits).to_vec());
            for op in ReduceOp::ALL {
                let mut acc = encode(dtype, &a);
                dtype.reduce_assign(op, &mut acc, &encode(dtype, &b));
                let want: Vec<f64> = a
                    .iter()
                    .zip(&b)
                    .map(|(&x, &y)| match dtype {
                        // A logical or (sum, max) or and (product, min).
                        DType::Bool => match op {
                            ReduceOp::Sum | ReduceOp::Max => (x + y).min(1.0),
                            _ => x * y,
                        },
                        _ => reference(op, x, y),
                    })
                    .collect();
                assert_eq!(decode(dtype, &acc), want, "{dtype:?} {op:?}");
                // Either order of the operands gives the same bits.
                let mut other = encode(dtype, &b);
                dtype.reduce_assign(op, &mut other, &encode(dtype, &a));
                assert_eq!(other, acc, "{dtype:?} {op:?} commutes");
            }
        }
    }

    #[test]
    fn integer_sums_and_products_wrap_as_torch_computes_them() {
        let mut acc = 120i8.to_ne_bytes().to_vec();
        DType::I8.reduce_assign(ReduceOp::Sum, &mut acc, &10i8.to_ne_bytes());
        assert_eq!(acc, (-126i8).to_ne_bytes());
        let mut acc = 200u8.to_ne_bytes().to_vec();
        DType::U8.reduce_assign(ReduceOp::Product, &mut acc, &2u8.to_ne_bytes());
        assert_eq!(acc, 144u8.to_ne_bytes());
        let mut acc = i64::MAX.to_ne_bytes().to_vec();
        DType::I64.reduce_assign(ReduceOp::Sum, &mut acc, &1i64.to_ne_bytes());
        assert_eq!(acc, i64::MIN.to_ne_bytes());
        // Values beyond float64's exact integers stay exact.
        let big = (1i64 << 60) + 1;
        let mut acc = big.to_ne_bytes().to_vec();
        DType::I64.reduce_assign(ReduceOp::Max, &mut acc, &(1i64 << 60).to_ne_bytes());
        assert_eq!(acc, big.to_ne_bytes());
    }

    #[test]
    fn float_min_and_max_pick_one_operand_nan_first_and_signed_zeros_in_order() {
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            let nan = encode(dtype, &[f64::NAN]);
            let one = encode(dtype, &[1.0]);
            for op in [ReduceOp::Min, ReduceOp::Max] {
                for (x, y) in [(&nan, &one), (&one, &nan)] {
                    let mut acc = x.clone();
                    dtype.reduce_assign(op, &mut acc, y);
                    assert!(decode(dtype, &acc)[0].is_nan(), "{dtype:?} {op:?}");
                }
            }
            let (neg, pos) = (encode(dtype, &[-0.0]), encode(dtype, &[0.0]));
            for (x, y) in [(&neg, &pos), (&pos, &neg)] {
                let mut min = x.clone();
                dtype.reduce_assign(ReduceOp::Min, &mut min, y);
                assert_eq!(&min, &neg, "{dtype:?} min(-0, 0)");
                let mut max = x.clone();
                dtype.reduce_assign(ReduceOp::Max, &mut max, y);
                assert_eq!(&max, &pos, "{dtype:?} max(-0, 0)");
            }
        }
        // Half products are computed in float32 and rounded once.
        let mut acc = encode(DType::F16, &[2049.0 / 2.0]);
        DType::F16.reduce_assign(ReduceOp::Product, &mut acc, &encode(DType::F16, &[2.0]));
        assert_eq!(decode(DType::F16, &acc), vec![2048.0]);
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
