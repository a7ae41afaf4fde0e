//! The fused augmentation path: decode, crop, resize, flip and convert one
//! image in a single pass, writing straight into its slot of a batch.
//!
//! The random parameters are drawn by the caller (with torchvision's own
//! `get_params`, so the distributions and the random stream are PyTorch's);
//! this module only applies them. The geometry is that of torchvision on PIL
//! images: crop the source, resample the crop with PIL's bilinear filter
//! (bit-exact, see [`super::resample`]), cut a window out of the result
//! (a center crop; zeros where it reaches past the image, as torchvision
//! pads), and mirror it.

use std::cell::RefCell;

use super::decode::{decode_jpeg_region_rgbx, decode_rgb_scaled, is_jpeg, rgb_to_rgbx};
use super::jpeg::with_decoder;
use super::resample::{self, resample, Request, RgbxView, SOURCE_BPP};

/// Where the output pixels come from, in the coordinates of each step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Crop of the source image: left, top, width, height (source pixels,
    /// inside the image).
    pub crop: (u32, u32, u32, u32),
    /// The crop is resampled to this width and height.
    pub resize: (u32, u32),
    /// The output is this window of the resampled image: left, top, width,
    /// height; parts outside the resampled image are zero.
    pub window: (i64, i64, u32, u32),
    /// Mirror the output left-right.
    pub flip: bool,
}

/// How output pixels are written.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Output {
    /// `uint8` CHW, as `PILToTensor` gives.
    Uint8,
    /// `float32` CHW: `(v / 255 - mean[c]) / std[c]`, as `ToTensor` then
    /// `Normalize` give (mean 0 and std 1 without `Normalize`).
    Float { mean: [f32; 3], std: [f32; 3] },
}

/// The largest JPEG scale denominator (1, 2, 4 or 8) whose decode still
/// holds at least as many pixels as the resampled crop in each direction,
/// so that the resample never has to upsample what the decoder shrank.
pub fn choose_denominator(g: &Geometry) -> usize {
    let (_, _, cw, ch) = g.crop;
    let (rw, rh) = g.resize;
    let factor = f64::min(f64::from(cw) / f64::from(rw), f64::from(ch) / f64::from(rh));
    [8, 4, 2]
        .into_iter()
        .find(|&d| factor >= d as f64)
        .unwrap_or(1)
}

/// Renders `data` (an encoded image) through `g` into `out`, which holds
/// `3 * window_height * window_width` values (CHW). With `downscale`, JPEGs
/// are decoded at the reduced scale [`choose_denominator`] allows.
pub fn render(
    data: &[u8],
    g: &Geometry,
    downscale: bool,
    output: Output,
    out: OutputSlice<'_>,
) -> Result<(), String> {
    let (_, _, ww, wh) = g.window;
    let want = (ww as usize)
        .checked_mul(wh as usize)
        .and_then(|n| n.checked_mul(3));
    if want != Some(out.len()) {
        return Err(format!(
            "output slot holds {} values, not 3x{wh}x{ww}",
            out.len()
        ));
    }
    with_scratch(|scratch| {
        let Scratch { pixels, resample } = scratch;
        if is_jpeg(data) {
            let denom = if downscale { choose_denominator(g) } else { 1 };
            with_decoder(|dec| {
                let header = dec.read_header(data)?;
                let (sw, sh) = (header.width.div_ceil(denom), header.height.div_ceil(denom));
                let crop = CropInDecoded::new(g, denom, sw, sh)?;
                // Decode only the rows and columns the crop needs, plus a
                // margin: smooth chroma upsampling reads one sample beyond
                // each edge, so without it the border pixels of a region
                // differ from a full decode. The left edge is rounded down to
                // an iMCU boundary, as libjpeg-turbo requires.
                let mcu = header.scaled_mcu_width(denom);
                let x0 = crop.ix0.saturating_sub(REGION_MARGIN);
                let x0 = x0 - x0 % mcu;
                let y0 = crop.iy0.saturating_sub(REGION_MARGIN);
                let x1 = (crop.ix1 + REGION_MARGIN).min(sw);
                let y1 = (crop.iy1 + REGION_MARGIN).min(sh);
                let region = (x0, y0, x1 - x0, y1 - y0);
                decode_jpeg_region_rgbx(dec, data, &header, denom, region, pixels)?;
                let img = Decoded {
                    pixels,
                    width: x1 - x0,
                    x: x0,
                    y: y0,
                };
                finish(img, &crop, g, output, out, resample)
            })
        } else {
            let img = decode_rgb_scaled(data, 1)?;
            rgb_to_rgbx(&img.pixels, pixels);
            let crop = CropInDecoded::new(g, 1, img.width, img.height)?;
            let img = Decoded {
                pixels,
                width: img.width,
                x: 0,
                y: 0,
            };
            finish(img, &crop, g, output, out, resample)
        }
    })
}

/// Buffers one thread reuses from image to image.
#[derive(Default)]
struct Scratch {
    /// Decoded pixels, 4 bytes each.
    pixels: Vec<u8>,
    resample: resample::Scratch,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// A thread keeps at most this much scratch memory between images: a huge
/// image's buffers are freed after use.
const KEEP_SCRATCH_BYTES: usize = 64 << 20;

/// Runs `f` with this thread's scratch buffers.
fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => {
            let result = f(&mut scratch);
            if scratch.pixels.capacity() + scratch.resample.capacity_bytes() > KEEP_SCRATCH_BYTES {
                *scratch = Scratch::default();
            }
            result
        }
        // Only reachable by re-entering from inside `f`: use fresh buffers.
        Err(_) => f(&mut Scratch::default()),
    })
}

/// Decoded pixels ([`SOURCE_BPP`] bytes each), `width` wide, whose pixel
/// (0, 0) is pixel `(x, y)` of the (scaled) image.
struct Decoded<'a> {
    pixels: &'a [u8],
    width: usize,
    x: usize,
    y: usize,
}

/// Decoded pixels kept around a JPEG region so that its pixels equal those
/// of a full decode (measured: 1 suffices for 4:2:0; 2 for good measure).
const REGION_MARGIN: usize = 2;

/// The crop in decoded pixels: exact at full scale, fractional when scaled,
/// with the integer region that covers it.
struct CropInDecoded {
    box_: (f64, f64, f64, f64),
    ix0: usize,
    iy0: usize,
    ix1: usize,
    iy1: usize,
}

impl CropInDecoded {
    fn new(g: &Geometry, denom: usize, width: usize, height: usize) -> Result<Self, String> {
        let (cl, ct, cw, ch) = g.crop;
        let d = denom as f64;
        let (x0, y0) = (f64::from(cl) / d, f64::from(ct) / d);
        let (x1, y1) = (
            (f64::from(cl) + f64::from(cw)) / d,
            (f64::from(ct) + f64::from(ch)) / d,
        );
        if cw == 0 || ch == 0 || x1 > width as f64 || y1 > height as f64 {
            return Err(format!(
                "crop {cw}x{ch}+{cl}+{ct} does not fit the image (decoded at 1/{denom}: {width}x{height})"
            ));
        }
        Ok(CropInDecoded {
            box_: (x0, y0, x1, y1),
            ix0: x0.floor() as usize,
            iy0: y0.floor() as usize,
            ix1: (x1.ceil() as usize).min(width),
            iy1: (y1.ceil() as usize).min(height),
        })
    }
}

/// Resamples the crop out of `img` and writes the output slot (whose size
/// the caller checked).
fn finish(
    img: Decoded<'_>,
    crop: &CropInDecoded,
    g: &Geometry,
    output: Output,
    out: OutputSlice<'_>,
    scratch: &mut resample::Scratch,
) -> Result<(), String> {
    // View exactly the covering region so that the filter stays inside the
    // crop, as it does when torchvision crops before resizing.
    let (vx, vy) = (crop.ix0 - img.x, crop.iy0 - img.y);
    let stride = img.width * SOURCE_BPP;
    let view = RgbxView {
        pixels: &img.pixels[vy * stride + vx * SOURCE_BPP..],
        width: crop.ix1 - crop.ix0,
        height: crop.iy1 - crop.iy0,
        stride,
    };
    let (x0, y0, x1, y1) = crop.box_;
    let (fx, fy) = (crop.ix0 as f64, crop.iy0 as f64);
    let box_ = (x0 - fx, y0 - fy, x1 - fx, y1 - fy);

    let (rw, rh) = (g.resize.0 as usize, g.resize.1 as usize);
    let (wl, wt, ww, wh) = g.window;
    let (ww, wh) = (ww as usize, wh as usize);
    let plane = ww * wh;
    // The part of the window inside the resampled image.
    let inside = |start: i64, len: usize, size: usize| {
        let lo = start.clamp(0, size as i64) as usize;
        let hi = start.saturating_add(len as i64).clamp(0, size as i64) as usize;
        lo..hi.max(lo)
    };
    let cols = inside(wl, ww, rw);
    let rows = inside(wt, wh, rh);
    if plane == 0 {
        return Ok(());
    }
    if cols.is_empty() || rows.is_empty() {
        // Nothing of the image shows: all padding.
        match out {
            OutputSlice::Uint8(out) => out.fill(0),
            OutputSlice::Float(out) => {
                let table = float_table(output)?;
                for (c, channel) in out.chunks_exact_mut(plane).enumerate() {
                    channel.fill(table[c][0]);
                }
            }
        }
        return Ok(());
    }
    let covered = cols.len() == ww && rows.len() == wh;
    // Where the first value of each resampled row goes in its output row
    // (rows arrive mirrored when flipping).
    let (ox, oy) = (
        (cols.start as i64 - wl) as usize,
        (rows.start as i64 - wt) as usize,
    );
    let x_start = if g.flip { ww - ox - cols.len() } else { ox };
    let req = Request {
        box_,
        out_w: rw,
        out_h: rh,
        cols,
        rows,
        flip: g.flip,
    };
    let at = move |c: usize, r: usize| c * plane + (oy + r) * ww + x_start;
    match out {
        OutputSlice::Uint8(out) => {
            if !covered {
                out.fill(0); // padding is a zero pixel
            }
            resample(view, &req, scratch, |c, r, values| {
                out[at(c, r)..][..values.len()].copy_from_slice(values);
            });
        }
        OutputSlice::Float(out) => {
            let table = float_table(output)?;
            if !covered {
                for (c, channel) in out.chunks_exact_mut(plane).enumerate() {
                    channel.fill(table[c][0]); // padding is a zero pixel
                }
            }
            resample(view, &req, scratch, |c, r, values| {
                let t = &table[c];
                for (o, &v) in out[at(c, r)..][..values.len()].iter_mut().zip(values) {
                    *o = t[usize::from(v)];
                }
            });
        }
    }
    Ok(())
}

/// Every 8-bit value's output per channel, computed as `ToTensor` and
/// `Normalize` compute it: `(v / 255 - mean) / std` in float32.
fn float_table(output: Output) -> Result<[[f32; 256]; 3], String> {
    let Output::Float { mean, std } = output else {
        return Err("a float output slot needs Output::Float".into());
    };
    let mut table = [[0f32; 256]; 3];
    for (c, t) in table.iter_mut().enumerate() {
        for (v, slot) in t.iter_mut().enumerate() {
            *slot = (v as f32 / 255.0 - mean[c]) / std[c];
        }
    }
    Ok(table)
}

/// A batch slot to write one image into.
pub enum OutputSlice<'a> {
    Uint8(&'a mut [u8]),
    Float(&'a mut [f32]),
}

impl OutputSlice<'_> {
    fn len(&self) -> usize {
        match self {
            OutputSlice::Uint8(s) => s.len(),
            OutputSlice::Float(s) => s.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::testing::encode;

    fn png(w: u32, h: u32) -> (Vec<u8>, image::RgbImage) {
        let img = image::RgbImage::from_fn(w, h, |x, y| {
            image::Rgb([x as u8 * 3, y as u8 * 5, (x + y) as u8])
        });
        (encode(&img, image::ImageFormat::Png), img)
    }

    #[test]
    fn plain_crop_flip_uint8() {
        let (data, img) = png(10, 8);
        let g = Geometry {
            crop: (2, 1, 4, 3),
            resize: (4, 3),
            window: (0, 0, 4, 3),
            flip: true,
        };
        let mut out = vec![0u8; 3 * 4 * 3];
        render(&data, &g, true, Output::Uint8, OutputSlice::Uint8(&mut out)).unwrap();
        // Channel 0, row 0 holds source row 1, columns 5, 4, 3, 2 (mirrored).
        let expect: Vec<u8> = (2..6).rev().map(|x| img.get_pixel(x, 1)[0]).collect();
        assert_eq!(&out[..4], expect.as_slice());
        // Channel 1 (green) of the last row is source row 3.
        assert_eq!(out[12 + 8], img.get_pixel(5, 3)[1]);
    }

    #[test]
    fn window_padding_is_zero_then_normalized() {
        let (data, _) = png(4, 4);
        let g = Geometry {
            crop: (0, 0, 4, 4),
            resize: (4, 4),
            window: (-1, -1, 6, 6),
            flip: false,
        };
        let mut out = vec![9f32; 3 * 36];
        let output = Output::Float {
            mean: [0.5, 0.5, 0.5],
            std: [0.25, 0.25, 0.25],
        };
        render(&data, &g, true, output, OutputSlice::Float(&mut out)).unwrap();
        assert_eq!(out[0], -2.0); // padding: (0 - 0.5) / 0.25
        assert_eq!(out[7], (0.0 / 255.0 - 0.5) / 0.25); // pixel (0, 0) is black
    }

    #[test]
    fn denominator_choice() {
        let g = |cw, ch, rw, rh| Geometry {
            crop: (0, 0, cw, ch),
            resize: (rw, rh),
            window: (0, 0, rw, rh),
            flip: false,
        };
        assert_eq!(choose_denominator(&g(500, 375, 224, 224)), 1);
        assert_eq!(choose_denominator(&g(900, 600, 224, 224)), 2);
        assert_eq!(choose_denominator(&g(2000, 1800, 224, 224)), 8);
        assert_eq!(choose_denominator(&g(1000, 300, 224, 224)), 1);
    }

    #[test]
    fn bad_crop_and_slot_size_are_errors() {
        let (data, _) = png(4, 4);
        let g = Geometry {
            crop: (2, 2, 4, 4),
            resize: (4, 4),
            window: (0, 0, 4, 4),
            flip: false,
        };
        let mut out = vec![0u8; 48];
        assert!(render(&data, &g, true, Output::Uint8, OutputSlice::Uint8(&mut out)).is_err());
        let ok = Geometry {
            crop: (0, 0, 4, 4),
            ..g
        };
        let mut small = vec![0u8; 47];
        assert!(render(
            &data,
            &ok,
            true,
            Output::Uint8,
            OutputSlice::Uint8(&mut small)
        )
        .is_err());
    }
}
