//! Bilinear resampling with antialiasing, computed exactly as Pillow's
//! `Image.resize(size, BILINEAR, box)` computes it: the same triangle filter
//! widened by the downscale factor, the same 22-bit fixed-point weights and
//! rounding, horizontal pass first into an 8-bit intermediate. With the same
//! input pixels the output is identical to PIL's, which is what torchvision
//! transforms use on PIL images.

/// Fixed-point precision of the weights (Pillow: 32 - 8 - 2).
const PRECISION_BITS: u32 = 22;

/// Weights of one output pixel: the first input index and its taps.
#[derive(Debug, Clone)]
struct Taps {
    first: usize,
    weights: Vec<i32>,
}

/// Pillow's `precompute_coeffs` for the bilinear filter: output pixel `x`
/// covers `in0 + (x + 0.5) * scale` with `scale = (in1 - in0) / out_size`.
fn coefficients(in_size: usize, in0: f64, in1: f64, out_size: usize) -> Vec<Taps> {
    let scale = (in1 - in0) / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filterscale; // the bilinear filter's support is 1
    let ss = 1.0 / filterscale;
    (0..out_size)
        .map(|xx| {
            let center = in0 + (xx as f64 + 0.5) * scale;
            // C's (int) truncates toward zero.
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64).max(0) as usize;
            let xmax = xmax.saturating_sub(xmin);
            let mut k: Vec<f64> = (0..xmax)
                .map(|x| {
                    let t = ((x + xmin) as f64 - center + 0.5) * ss;
                    (1.0 - t.abs()).max(0.0)
                })
                .collect();
            let total: f64 = k.iter().sum();
            if total != 0.0 {
                k.iter_mut().for_each(|w| *w /= total);
            }
            let weights = k
                .iter()
                .map(|&w| {
                    let scaled = w * f64::from(1u32 << PRECISION_BITS);
                    // Pillow rounds half away from zero.
                    if scaled < 0.0 {
                        (scaled - 0.5) as i32
                    } else {
                        (scaled + 0.5) as i32
                    }
                })
                .collect();
            Taps {
                first: xmin,
                weights,
            }
        })
        .collect()
}

/// Pillow's rounding bias: half of the fixed-point unit.
const ROUNDING: i32 = 1 << (PRECISION_BITS - 1);

// Accumulators fit in i32 as in Pillow: 255 * 2^22 (weights sum to 2^22,
// bilinear weights are never negative) stays below 2^31.
#[inline]
fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// An interleaved 8-bit RGB view of `width x height` pixels whose rows
/// start `stride` bytes apart (a sub-rectangle of a larger image).
#[derive(Debug, Clone, Copy)]
pub struct RgbView<'a> {
    pub pixels: &'a [u8],
    pub width: usize,
    pub height: usize,
    pub stride: usize,
}

/// Resamples the region `box_ = (x0, y0, x1, y1)` of `src` (fractional
/// source coordinates) to `out_w x out_h`, then returns only the output
/// rows `rows` and columns `cols` (a crop of the resized image, computed
/// without computing the rest). The result is interleaved RGB.
pub fn resample(
    src: RgbView<'_>,
    box_: (f64, f64, f64, f64),
    out_w: usize,
    out_h: usize,
    cols: std::ops::Range<usize>,
    rows: std::ops::Range<usize>,
) -> Vec<u8> {
    let (x0, y0, x1, y1) = box_;
    let horizontal = out_w != src.width || x0 != 0.0 || x1 != src.width as f64;
    let vertical = out_h != src.height || y0 != 0.0 || y1 != src.height as f64;
    let xtaps = horizontal.then(|| coefficients(src.width, x0, x1, out_w));
    let ytaps = vertical.then(|| coefficients(src.height, y0, y1, out_h));

    // Source rows the wanted output rows read.
    let (row_lo, row_hi) = match &ytaps {
        Some(t) => {
            let wanted = &t[rows.clone()];
            let lo = wanted.iter().map(|t| t.first).min().unwrap_or(0);
            let hi = wanted
                .iter()
                .map(|t| t.first + t.weights.len())
                .max()
                .unwrap_or(0);
            (lo, hi)
        }
        None => (rows.start, rows.end),
    };

    // Horizontal pass over the needed source rows, only the wanted columns.
    let ncols = cols.len();
    let mid_rows = row_hi - row_lo;
    let mut mid = vec![0u8; mid_rows * ncols * 3];
    for (r, sy) in (row_lo..row_hi).enumerate() {
        let src_row = &src.pixels[sy * src.stride..sy * src.stride + src.width * 3];
        let out_row = &mut mid[r * ncols * 3..(r + 1) * ncols * 3];
        match &xtaps {
            Some(taps) => {
                for (t, out_px) in taps[cols.clone()].iter().zip(out_row.chunks_exact_mut(3)) {
                    let src_px = &src_row[t.first * 3..(t.first + t.weights.len()) * 3];
                    let (mut r, mut g, mut b) = (ROUNDING, ROUNDING, ROUNDING);
                    for (&w, p) in t.weights.iter().zip(src_px.chunks_exact(3)) {
                        r += i32::from(p[0]) * w;
                        g += i32::from(p[1]) * w;
                        b += i32::from(p[2]) * w;
                    }
                    out_px[0] = clip8(r);
                    out_px[1] = clip8(g);
                    out_px[2] = clip8(b);
                }
            }
            None => out_row.copy_from_slice(&src_row[cols.start * 3..cols.end * 3]),
        }
    }

    // Vertical pass: whole rows at a time, so the inner loop is contiguous.
    let nrows = rows.len();
    let stride = ncols * 3;
    let mut out = vec![0u8; nrows * stride];
    let mut acc = vec![0i32; stride];
    for (r, oy) in rows.clone().enumerate() {
        let out_row = &mut out[r * stride..(r + 1) * stride];
        match &ytaps {
            Some(taps) => {
                let t = &taps[oy];
                acc.fill(ROUNDING);
                for (k, &w) in t.weights.iter().enumerate() {
                    let m = t.first + k - row_lo;
                    let mid_row = &mid[m * stride..(m + 1) * stride];
                    for (a, &v) in acc.iter_mut().zip(mid_row) {
                        *a += i32::from(v) * w;
                    }
                }
                for (o, &a) in out_row.iter_mut().zip(&acc) {
                    *o = clip8(a);
                }
            }
            None => {
                let m = oy - row_lo;
                out_row.copy_from_slice(&mid[m * stride..(m + 1) * stride]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(pixels: &[u8], width: usize, height: usize) -> RgbView<'_> {
        RgbView {
            pixels,
            width,
            height,
            stride: width * 3,
        }
    }

    #[test]
    fn identity_is_a_copy() {
        let px: Vec<u8> = (0..4 * 3 * 3).map(|v| v as u8).collect();
        let out = resample(view(&px, 4, 3), (0.0, 0.0, 4.0, 3.0), 4, 3, 0..4, 0..3);
        assert_eq!(out, px);
        let cropped = resample(view(&px, 4, 3), (0.0, 0.0, 4.0, 3.0), 4, 3, 1..3, 1..2);
        assert_eq!(cropped, px[15..21].to_vec());
    }

    #[test]
    fn constant_image_stays_constant() {
        let px = vec![200u8; 37 * 23 * 3];
        let out = resample(
            view(&px, 37, 23),
            (0.0, 0.0, 37.0, 23.0),
            9,
            17,
            0..9,
            0..17,
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
        let out = resample(view(&row, 8, 1), (0.0, 0.0, 8.0, 1.0), 4, 1, 0..4, 0..1);
        let firsts: Vec<u8> = out.chunks(3).map(|p| p[0]).collect();
        // Image.fromarray(...).resize((4, 1), Image.BILINEAR) gives these.
        assert_eq!(firsts, vec![14, 75, 25, 86]);
    }

    #[test]
    fn window_equals_crop_of_full_output() {
        let px: Vec<u8> = (0..50 * 40 * 3).map(|v| (v * 7 % 251) as u8).collect();
        let full = resample(
            view(&px, 50, 40),
            (2.0, 3.0, 47.0, 39.0),
            30,
            20,
            0..30,
            0..20,
        );
        let part = resample(
            view(&px, 50, 40),
            (2.0, 3.0, 47.0, 39.0),
            30,
            20,
            5..25,
            4..16,
        );
        for (r, y) in (4..16).enumerate() {
            assert_eq!(
                &part[r * 20 * 3..(r + 1) * 20 * 3],
                &full[(y * 30 + 5) * 3..(y * 30 + 25) * 3]
            );
        }
    }
}
