//! Bilinear resampling with antialiasing, computed exactly as Pillow's
//! `Image.resize(size, BILINEAR, box)` computes it: the same triangle filter
//! widened by the downscale factor, the same 22-bit fixed-point weights and
//! rounding, horizontal pass first into an 8-bit intermediate. With the same
//! input pixels the output is identical to PIL's, which is what torchvision
//! transforms use on PIL images.
//!
//! Layout, chosen for speed (the arithmetic is Pillow's either way): the
//! source has 4 bytes per pixel (RGB plus one unused byte), so that one
//! pixel's three channels are one 4-lane vector in the horizontal pass; that
//! pass writes three planes (one per channel), so the vertical pass and the
//! CHW output are plain contiguous loops. Both passes are compiled twice,
//! the second time for AVX2 (picked at run time), and all buffers live in a
//! reusable [`Scratch`].

use std::ops::Range;

/// Fixed-point precision of the weights (Pillow: 32 - 8 - 2).
const PRECISION_BITS: u32 = 22;

/// Pillow's rounding bias: half of the fixed-point unit.
const ROUNDING: i32 = 1 << (PRECISION_BITS - 1);

// Accumulators fit in i32 as in Pillow: 255 * 2^22 (weights sum to 2^22,
// bilinear weights are never negative) stays below 2^31.
#[inline(always)]
fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Bytes per source pixel: R, G, B and one unused byte.
pub const SOURCE_BPP: usize = 4;

/// The fixed-point weights of one axis, flat, `stride` per output pixel:
/// output pixel `i` is the weighted sum of `stride` inputs from `start[i]`,
/// weights `weights[i * stride..][..stride]`, of which only `len[i]` from
/// `first[i]` are non-zero. Every window has the same length so that the
/// horizontal pass's inner loop has a fixed trip count; `start` differs from
/// `first` only where a window would end past the input (zero weights add
/// nothing, so the sums are Pillow's).
#[derive(Debug, Default)]
struct Coefficients {
    start: Vec<usize>,
    first: Vec<usize>,
    len: Vec<usize>,
    weights: Vec<i32>,
    stride: usize,
    /// Whether every window fits the input (it does unless the input is
    /// narrower than `stride`).
    windows_fit: bool,
    /// Floating-point weights of one output pixel, before rounding.
    work: Vec<f64>,
}

impl Coefficients {
    /// Pillow's `precompute_coeffs` for the bilinear filter, then its
    /// `normalize_coeffs_8bpc`: output pixel `x` covers
    /// `in0 + (x + 0.5) * scale` with `scale = (in1 - in0) / out_size`.
    fn compute(&mut self, in_size: usize, in0: f64, in1: f64, out_size: usize) {
        let scale = (in1 - in0) / out_size as f64;
        let filterscale = scale.max(1.0);
        let support = filterscale; // the bilinear filter's support is 1
        let ss = 1.0 / filterscale;
        self.stride = support.ceil() as usize * 2 + 1;
        self.windows_fit = in_size >= self.stride;
        self.start.clear();
        self.first.clear();
        self.len.clear();
        self.weights.clear();
        self.weights.resize(out_size * self.stride, 0);
        for xx in 0..out_size {
            let center = in0 + (xx as f64 + 0.5) * scale;
            // C's (int) truncates toward zero.
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64).max(0) as usize;
            let n = xmax.saturating_sub(xmin).min(self.stride);
            self.work.clear();
            self.work.extend((0..n).map(|x| {
                let t = ((x + xmin) as f64 - center + 0.5) * ss;
                (1.0 - t.abs()).max(0.0)
            }));
            let total: f64 = self.work.iter().sum();
            let start = if self.windows_fit {
                xmin.min(in_size - self.stride)
            } else {
                xmin
            };
            let out = &mut self.weights[xx * self.stride + (xmin - start)..][..n];
            for (o, &k) in out.iter_mut().zip(&self.work) {
                let k = if total != 0.0 { k / total } else { k };
                let scaled = k * f64::from(1u32 << PRECISION_BITS);
                // Pillow rounds half away from zero.
                *o = if scaled < 0.0 {
                    (scaled - 0.5) as i32
                } else {
                    (scaled + 0.5) as i32
                };
            }
            self.start.push(start);
            self.first.push(xmin);
            self.len.push(n);
        }
    }

    /// First input and non-zero weights of output pixel `i`.
    #[inline(always)]
    fn taps(&self, i: usize) -> (usize, &[i32]) {
        let (first, start) = (self.first[i], self.start[i]);
        (
            first,
            &self.weights[i * self.stride + (first - start)..][..self.len[i]],
        )
    }
}

/// Buffers reused from one resample to the next.
#[derive(Debug, Default)]
pub struct Scratch {
    x: Coefficients,
    y: Coefficients,
    /// The horizontal pass's output: three planes of `rows x cols`.
    mid: Vec<u8>,
    acc: Vec<i32>,
    row: Vec<u8>,
    /// Per output column, in output order: the byte offset of its first
    /// source pixel in a row, and of its weights.
    columns: Vec<(usize, usize)>,
}

impl Scratch {
    /// Bytes held, to let callers drop a scratch grown by a huge image.
    pub fn capacity_bytes(&self) -> usize {
        self.mid.capacity()
            + 4 * self.acc.capacity()
            + self.row.capacity()
            + 16 * self.columns.capacity()
    }
}

/// A `width x height` source of [`SOURCE_BPP`]-byte pixels whose rows start
/// `stride` bytes apart (a sub-rectangle of a larger image).
#[derive(Debug, Clone, Copy)]
pub struct RgbxView<'a> {
    pub pixels: &'a [u8],
    pub width: usize,
    pub height: usize,
    pub stride: usize,
}

/// What to compute: the region `box_ = (x0, y0, x1, y1)` of the source
/// (fractional coordinates) resized to `out_w x out_h`, of which only the
/// output rows `rows` and columns `cols` are wanted, mirrored left-right if
/// `flip`.
#[derive(Debug, Clone)]
pub struct Request {
    pub box_: (f64, f64, f64, f64),
    pub out_w: usize,
    pub out_h: usize,
    pub cols: Range<usize>,
    pub rows: Range<usize>,
    pub flip: bool,
}

/// Resamples `src` as `req` says, handing each finished output row to
/// `emit(channel, row, values)`: `row` counts from `req.rows.start`, and
/// `values` holds `req.cols.len()` values of that channel (in mirrored order
/// when `req.flip`).
pub fn resample(
    src: RgbxView<'_>,
    req: &Request,
    scratch: &mut Scratch,
    emit: impl FnMut(usize, usize, &[u8]),
) {
    let (x0, y0, x1, y1) = req.box_;
    let horizontal = req.out_w != src.width || x0 != 0.0 || x1 != src.width as f64;
    let vertical = req.out_h != src.height || y0 != 0.0 || y1 != src.height as f64;
    let Scratch {
        x,
        y,
        mid,
        acc,
        row,
        columns,
    } = scratch;
    if horizontal {
        x.compute(src.width, x0, x1, req.out_w);
    }
    if vertical {
        y.compute(src.height, y0, y1, req.out_h);
    }
    let (x, y) = (horizontal.then_some(&*x), vertical.then_some(&*y));
    // Where each output column reads, in output order.
    columns.clear();
    let order = |j: usize| {
        if req.flip {
            req.cols.end - 1 - j
        } else {
            req.cols.start + j
        }
    };
    columns.extend((0..req.cols.len()).map(order).map(|xx| match x {
        Some(x) if x.windows_fit => (x.start[xx] * SOURCE_BPP, xx * x.stride),
        Some(x) => (x.first[xx] * SOURCE_BPP, xx),
        None => (xx * SOURCE_BPP, 0),
    }));

    // Source rows the wanted output rows read.
    let (row_lo, row_hi) = match y {
        Some(y) => {
            let lo = req.rows.clone().map(|r| y.first[r]).min().unwrap_or(0);
            let hi = req
                .rows
                .clone()
                .map(|r| y.first[r] + y.len[r])
                .max()
                .unwrap_or(0);
            (lo, hi)
        }
        None => (req.rows.start, req.rows.end),
    };
    let ncols = req.cols.len();
    // The passes overwrite every value they read: growing a buffer is the
    // only zero-filling needed, shrinking it would only cause more.
    let mid_len = 3 * (row_hi - row_lo) * ncols;
    if mid.len() < mid_len {
        mid.resize(mid_len, 0);
    }
    acc.resize(ncols, 0);
    row.resize(ncols, 0);
    let pass = Pass {
        src,
        x,
        y,
        columns,
        rows: req.rows.clone(),
        row_lo,
        row_hi,
    };
    pass.run(&mut mid[..mid_len], acc, row, emit);
}

/// Everything both passes need, with the coefficients computed.
struct Pass<'a> {
    src: RgbxView<'a>,
    x: Option<&'a Coefficients>,
    y: Option<&'a Coefficients>,
    columns: &'a [(usize, usize)],
    rows: Range<usize>,
    row_lo: usize,
    row_hi: usize,
}

impl Pass<'_> {
    fn run(
        &self,
        mid: &mut [u8],
        acc: &mut [i32],
        row: &mut [u8],
        mut emit: impl FnMut(usize, usize, &[u8]),
    ) {
        #[cfg(target_arch = "x86_64")]
        if let Some(simd) = x86::Avx2::detect() {
            // SAFETY: `simd` exists, so the CPU supports AVX2: the only
            // requirement of `run_avx2`.
            unsafe { self.run_avx2(simd, mid, acc, row, &mut emit) };
            return;
        }
        self.horizontal(mid, Portable);
        self.vertical(mid, acc, row, &mut emit);
    }

    /// Both passes compiled for AVX2 (the vertical one autovectorised).
    ///
    /// # Safety
    ///
    /// The CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn run_avx2(
        &self,
        simd: x86::Avx2,
        mid: &mut [u8],
        acc: &mut [i32],
        row: &mut [u8],
        emit: &mut dyn FnMut(usize, usize, &[u8]),
    ) {
        self.horizontal(mid, simd);
        self.vertical(mid, acc, row, emit);
    }

    /// Horizontal pass over the needed source rows, only the wanted columns
    /// (in output order), into three planes.
    #[inline(always)]
    fn horizontal(&self, mid: &mut [u8], kernel: impl Kernel) {
        // A fixed window length lets the compiler unroll the kernel's loop.
        match self.x {
            Some(x) if x.windows_fit => match x.stride {
                3 => self.horizontal_with::<3>(mid, kernel),
                5 => self.horizontal_with::<5>(mid, kernel),
                7 => self.horizontal_with::<7>(mid, kernel),
                9 => self.horizontal_with::<9>(mid, kernel),
                _ => self.horizontal_with::<WINDOW>(mid, kernel),
            },
            Some(_) => self.horizontal_with::<TAPS>(mid, kernel),
            None => self.horizontal_with::<COPY>(mid, kernel),
        }
    }

    /// [`Self::horizontal`] with windows of `K` taps, or [`WINDOW`],
    /// [`TAPS`], [`COPY`] (each a constant, so the branches on it vanish).
    #[inline(always)]
    fn horizontal_with<const K: usize>(&self, mid: &mut [u8], kernel: impl Kernel) {
        let ncols = self.columns.len();
        if ncols == 0 {
            return;
        }
        let plane = (self.row_hi - self.row_lo) * ncols;
        let (r_plane, rest) = mid.split_at_mut(plane);
        let (g_plane, b_plane) = rest.split_at_mut(plane);
        let rows = r_plane
            .chunks_exact_mut(ncols)
            .zip(g_plane.chunks_exact_mut(ncols))
            .zip(b_plane.chunks_exact_mut(ncols));
        for (sy, ((r_out, g_out), b_out)) in (self.row_lo..self.row_hi).zip(rows) {
            let src_row = &self.src.pixels[sy * self.src.stride..][..self.src.width * SOURCE_BPP];
            let outs = r_out.iter_mut().zip(g_out.iter_mut()).zip(b_out.iter_mut());
            for (&(offset, w), ((r, g), b)) in self.columns.iter().zip(outs) {
                let px = match (K, self.x) {
                    (COPY, _) | (_, None) => {
                        let p = &src_row[offset..][..3];
                        [p[0], p[1], p[2]]
                    }
                    (TAPS, Some(x)) => {
                        let (_, weights) = x.taps(w);
                        kernel
                            .weighted_sum(&src_row[offset..][..weights.len() * SOURCE_BPP], weights)
                    }
                    (WINDOW, Some(x)) => {
                        let weights = &x.weights[w..][..x.stride];
                        kernel.weighted_sum(&src_row[offset..][..x.stride * SOURCE_BPP], weights)
                    }
                    (_, Some(x)) => {
                        let weights = &x.weights[w..][..K];
                        kernel.weighted_sum(&src_row[offset..][..K * SOURCE_BPP], weights)
                    }
                };
                (*r, *g, *b) = (px[0], px[1], px[2]);
            }
        }
    }

    /// Vertical pass: one output row of one channel at a time, so the inner
    /// loops are contiguous (and vectorise).
    #[inline(always)]
    fn vertical(
        &self,
        mid: &[u8],
        acc: &mut [i32],
        row: &mut [u8],
        emit: &mut dyn FnMut(usize, usize, &[u8]),
    ) {
        let ncols = self.columns.len();
        if ncols == 0 {
            return;
        }
        let plane = (self.row_hi - self.row_lo) * ncols;
        for (r, oy) in self.rows.clone().enumerate() {
            for c in 0..3 {
                let channel = &mid[c * plane..][..plane];
                match self.y {
                    Some(y) => {
                        let (first, weights) = y.taps(oy);
                        acc.fill(ROUNDING);
                        for (k, &w) in weights.iter().enumerate() {
                            let m = first + k - self.row_lo;
                            for (a, &v) in acc.iter_mut().zip(&channel[m * ncols..][..ncols]) {
                                *a += i32::from(v) * w;
                            }
                        }
                        for (o, &a) in row.iter_mut().zip(acc.iter()) {
                            *o = clip8(a);
                        }
                        emit(c, r, row);
                    }
                    None => {
                        let m = oy - self.row_lo;
                        emit(c, r, &channel[m * ncols..][..ncols]);
                    }
                }
            }
        }
    }
}

/// [`Pass::horizontal_with`]'s window kinds other than a fixed length:
/// windows of any one length, each pixel's own taps, a plain copy.
const WINDOW: usize = 0;
const TAPS: usize = usize::MAX;
const COPY: usize = usize::MAX - 1;

/// One output pixel of the horizontal pass: the weighted sum of `taps`
/// (one [`SOURCE_BPP`]-byte pixel per weight), rounded and clipped.
trait Kernel: Copy {
    fn weighted_sum(self, taps: &[u8], weights: &[i32]) -> [u8; 3];
}

/// Plain Rust, for any CPU.
#[derive(Clone, Copy)]
struct Portable;

impl Kernel for Portable {
    #[inline(always)]
    fn weighted_sum(self, taps: &[u8], weights: &[i32]) -> [u8; 3] {
        let mut acc = [ROUNDING; 3];
        for (p, &w) in taps.chunks_exact(SOURCE_BPP).zip(weights) {
            for (a, &v) in acc.iter_mut().zip(p) {
                *a += i32::from(v) * w;
            }
        }
        acc.map(clip8)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Kernel, PRECISION_BITS, ROUNDING, SOURCE_BPP};

    /// Proof that the CPU supports AVX2 (and so SSE4.1): only [`Avx2::detect`]
    /// makes one.
    #[derive(Clone, Copy)]
    pub(super) struct Avx2(());

    impl Avx2 {
        pub(super) fn detect() -> Option<Self> {
            is_x86_feature_detected!("avx2").then_some(Avx2(()))
        }
    }

    impl Kernel for Avx2 {
        /// A pixel's four bytes are one vector: one multiply-add per tap for
        /// all channels. Same integer arithmetic as [`super::Portable`].
        #[inline(always)]
        fn weighted_sum(self, taps: &[u8], weights: &[i32]) -> [u8; 3] {
            assert!(taps.len() >= weights.len() * SOURCE_BPP);
            // SAFETY: `self` exists, so the CPU has SSE4.1 (implied by AVX2).
            // Each unaligned 4-byte read is of pixel k < weights.len(),
            // inside `taps` (asserted above).
            unsafe {
                let mut acc = _mm_set1_epi32(ROUNDING);
                for (k, &w) in weights.iter().enumerate() {
                    let p = taps
                        .as_ptr()
                        .add(k * SOURCE_BPP)
                        .cast::<i32>()
                        .read_unaligned();
                    let px = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(p));
                    acc = _mm_add_epi32(acc, _mm_mullo_epi32(px, _mm_set1_epi32(w)));
                }
                // clip8 of each lane: the shift, then saturation to i16 and
                // to u8 clamps to 0..=255 exactly as `clip8` does.
                let v = _mm_srai_epi32::<{ PRECISION_BITS as i32 }>(acc);
                let v = _mm_packus_epi16(_mm_packs_epi32(v, v), v);
                let [r, g, b, _] = _mm_cvtsi128_si32(v).to_le_bytes();
                [r, g, b]
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RGB test pixels as a 4-byte source (the fourth byte is noise, which
    /// must never reach the output).
    fn rgbx(rgb: &[u8]) -> Vec<u8> {
        rgb.chunks(3)
            .enumerate()
            .flat_map(|(i, p)| [p[0], p[1], p[2], (i * 37) as u8])
            .collect()
    }

    /// Runs a resample and returns interleaved RGB, as Pillow lays it out.
    fn run(
        rgb: &[u8],
        (width, height): (usize, usize),
        box_: (f64, f64, f64, f64),
        out: (usize, usize),
        cols: Range<usize>,
        rows: Range<usize>,
        flip: bool,
    ) -> Vec<u8> {
        let px = rgbx(rgb);
        let src = RgbxView {
            pixels: &px,
            width,
            height,
            stride: width * SOURCE_BPP,
        };
        let ncols = cols.len();
        let mut got = vec![0u8; rows.len() * ncols * 3];
        let req = Request {
            box_,
            out_w: out.0,
            out_h: out.1,
            cols,
            rows,
            flip,
        };
        resample(src, &req, &mut Scratch::default(), |c, r, values| {
            for (j, &v) in values.iter().enumerate() {
                got[(r * ncols + j) * 3 + c] = v;
            }
        });
        got
    }

    #[test]
    fn identity_is_a_copy() {
        let px: Vec<u8> = (0..4 * 3 * 3).map(|v| v as u8).collect();
        let b = (0.0, 0.0, 4.0, 3.0);
        assert_eq!(run(&px, (4, 3), b, (4, 3), 0..4, 0..3, false), px);
        assert_eq!(
            run(&px, (4, 3), b, (4, 3), 1..3, 1..2, false),
            px[15..21].to_vec()
        );
        // Mirrored: pixels 2 then 1 of row 1.
        assert_eq!(
            run(&px, (4, 3), b, (4, 3), 1..3, 1..2, true),
            [&px[18..21], &px[15..18]].concat()
        );
    }

    #[test]
    fn constant_image_stays_constant() {
        let px = vec![200u8; 37 * 23 * 3];
        let out = run(
            &px,
            (37, 23),
            (0.0, 0.0, 37.0, 23.0),
            (9, 17),
            0..9,
            0..17,
            false,
        );
        assert!(out.iter().all(|&v| v == 200));
    }

    #[test]
    fn halving_matches_pillow() {
        // Downscale by 2: the triangle filter is widened to a support of 2.
        let row: Vec<u8> = [0u8, 0, 100, 100, 0, 0, 100, 100]
            .iter()
            .flat_map(|&v| [v, v, v])
            .collect();
        let out = run(
            &row,
            (8, 1),
            (0.0, 0.0, 8.0, 1.0),
            (4, 1),
            0..4,
            0..1,
            false,
        );
        let firsts: Vec<u8> = out.chunks(3).map(|p| p[0]).collect();
        // Image.fromarray(...).resize((4, 1), Image.BILINEAR) gives these.
        assert_eq!(firsts, vec![14, 75, 25, 86]);
    }

    #[test]
    fn window_equals_crop_of_full_output_and_flip_mirrors_it() {
        let px: Vec<u8> = (0..50 * 40 * 3).map(|v| (v * 7 % 251) as u8).collect();
        let b = (2.0, 3.0, 47.0, 39.0);
        let full = run(&px, (50, 40), b, (30, 20), 0..30, 0..20, false);
        let part = run(&px, (50, 40), b, (30, 20), 5..25, 4..16, false);
        let mirrored = run(&px, (50, 40), b, (30, 20), 5..25, 4..16, true);
        for (r, y) in (4..16).enumerate() {
            let want = &full[(y * 30 + 5) * 3..(y * 30 + 25) * 3];
            assert_eq!(&part[r * 20 * 3..(r + 1) * 20 * 3], want);
            let rev: Vec<u8> = want.chunks(3).rev().flatten().copied().collect();
            assert_eq!(&mirrored[r * 20 * 3..(r + 1) * 20 * 3], rev.as_slice());
        }
    }

    #[test]
    fn scratch_reuse_gives_the_same_result() {
        let px: Vec<u8> = (0..31 * 29 * 3).map(|v| (v * 13 % 253) as u8).collect();
        let src = rgbx(&px);
        let view = RgbxView {
            pixels: &src,
            width: 31,
            height: 29,
            stride: 31 * SOURCE_BPP,
        };
        let mut scratch = Scratch::default();
        let mut results = Vec::new();
        for (w, h) in [(64, 50), (7, 5), (64, 50)] {
            let req = Request {
                box_: (1.5, 0.25, 30.0, 28.5),
                out_w: w,
                out_h: h,
                cols: 0..w,
                rows: 0..h,
                flip: false,
            };
            let mut sum = 0u64;
            resample(view, &req, &mut scratch, |c, r, v| {
                sum += v
                    .iter()
                    .enumerate()
                    .map(|(j, &x)| u64::from(x) * (j + 3 * r + c + 1) as u64)
                    .sum::<u64>()
            });
            results.push(sum);
        }
        assert_eq!(results[0], results[2]);
    }

    /// Pillow's algorithm written plainly (f64 weights rounded to 22 bits,
    /// horizontal pass to 8 bits, then vertical), for comparison.
    fn reference(
        rgb: &[u8],
        width: usize,
        height: usize,
        box_: (f64, f64, f64, f64),
        (out_w, out_h): (usize, usize),
    ) -> Vec<u8> {
        fn weights(in_size: usize, in0: f64, in1: f64, out_size: usize) -> Vec<(usize, Vec<i32>)> {
            let scale = (in1 - in0) / out_size as f64;
            let support = scale.max(1.0);
            (0..out_size)
                .map(|xx| {
                    let center = in0 + (xx as f64 + 0.5) * scale;
                    let xmin = ((center - support + 0.5) as i64).max(0) as usize;
                    let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
                    let k: Vec<f64> = (xmin..xmax)
                        .map(|x| (1.0 - ((x as f64 - center + 0.5) / support).abs()).max(0.0))
                        .collect();
                    let total: f64 = k.iter().sum();
                    let w = k.iter().map(|v| (v / total * 4194304.0 + 0.5) as i32);
                    (xmin, w.collect())
                })
                .collect()
        }
        let (x0, y0, x1, y1) = box_;
        let hx = out_w != width || x0 != 0.0 || x1 != width as f64;
        let vy = out_h != height || y0 != 0.0 || y1 != height as f64;
        let mut mid = vec![0u8; height * out_w * 3];
        for y in 0..height {
            for (xx, (first, w)) in weights(width, x0, x1, out_w).into_iter().enumerate() {
                for c in 0..3 {
                    mid[(y * out_w + xx) * 3 + c] = if hx {
                        let acc = w.iter().enumerate().fold(ROUNDING, |a, (k, &w)| {
                            a + i32::from(rgb[(y * width + first + k) * 3 + c]) * w
                        });
                        clip8(acc)
                    } else {
                        rgb[(y * width + xx) * 3 + c]
                    };
                }
            }
        }
        let mut out = vec![0u8; out_h * out_w * 3];
        for (yy, (first, w)) in weights(height, y0, y1, out_h).into_iter().enumerate() {
            for i in 0..out_w * 3 {
                out[yy * out_w * 3 + i] = if vy {
                    let acc = w.iter().enumerate().fold(ROUNDING, |a, (k, &w)| {
                        a + i32::from(mid[(first + k) * out_w * 3 + i]) * w
                    });
                    clip8(acc)
                } else {
                    mid[yy * out_w * 3 + i]
                };
            }
        }
        out
    }

    #[test]
    fn equals_the_plain_algorithm_across_window_lengths() {
        let (w, h) = (41, 23);
        let px: Vec<u8> = (0..w * h * 3).map(|v| (v * 11 % 241) as u8).collect();
        // Upscaling, and downscaling by 1.5 to 9x: every window length, the
        // generic one, and sources narrower than the window.
        for (box_, out) in [
            ((0.0, 0.0, 41.0, 23.0), (60, 30)),
            ((1.5, 2.0, 40.0, 21.5), (25, 15)),
            ((0.0, 0.0, 41.0, 23.0), (13, 9)),
            ((3.0, 0.0, 38.0, 23.0), (9, 6)),
            ((0.0, 1.0, 41.0, 22.0), (5, 4)),
            ((0.0, 0.0, 41.0, 23.0), (4, 2)),
            ((0.0, 0.0, 41.0, 23.0), (41, 7)),
            ((0.5, 0.0, 3.5, 23.0), (1, 23)),
        ] {
            let want = reference(&px, w, h, box_, out);
            let got = run(&px, (w, h), box_, out, 0..out.0, 0..out.1, false);
            assert_eq!(got, want, "{box_:?} -> {out:?}");
        }
        // A source narrower than its window (4 pixels, 9 taps).
        let narrow: Vec<u8> = (0..4 * 3 * 3).map(|v| (v * 29 % 256) as u8).collect();
        let b = (0.0, 0.0, 4.0, 3.0);
        assert_eq!(
            run(&narrow, (4, 3), b, (1, 3), 0..1, 0..3, false),
            reference(&narrow, 4, 3, b, (1, 3))
        );
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_kernel_equals_portable_kernel() {
        let Some(simd) = x86::Avx2::detect() else {
            return;
        };
        let taps: Vec<u8> = (0..4 * 9).map(|v| (v * 67 % 256) as u8).collect();
        let mut c = Coefficients::default();
        for (in_size, out_size) in [(9, 3), (9, 1), (5, 9), (9, 2)] {
            c.compute(in_size, 0.0, in_size as f64, out_size);
            for i in 0..out_size {
                let (first, w) = c.taps(i);
                let t = &taps[first * SOURCE_BPP..][..w.len() * SOURCE_BPP];
                assert_eq!(simd.weighted_sum(t, w), Portable.weighted_sum(t, w));
            }
        }
        // Extremes: all 255 with weights summing to one, all 0.
        let ones = [255u8; 8];
        let half = [1 << (PRECISION_BITS - 1); 2];
        assert_eq!(simd.weighted_sum(&ones, &half), [255; 3]);
        assert_eq!(simd.weighted_sum(&[0; 8], &half), [0; 3]);
    }
}
