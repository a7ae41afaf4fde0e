//! Decoding encoded images to 8-bit RGB, with the pixels PIL's
//! `Image.open(f).convert("RGB")` gives.
//!
//! JPEG goes through libjpeg-turbo (PIL's decoder too, with the same default
//! settings: accurate integer IDCT, smooth chroma upsampling), so the pixels
//! are identical. CMYK JPEGs are converted the way PIL converts them
//! (inverted when an Adobe marker says so). Other formats go through the
//! `image` crate; alpha is dropped, as `convert("RGB")` does.

use std::panic::{catch_unwind, AssertUnwindSafe};

use super::jpeg::{with_decoder, JpegDecoder, JpegHeader, Layout};
use super::probe::jpeg_has_adobe_marker;

/// Row-major interleaved RGB pixels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub width: usize,
    pub height: usize,
    /// `height * width * 3` bytes.
    pub pixels: Vec<u8>,
}

/// Decodes `data`; the error is the reason, for the caller to locate.
pub fn decode_rgb(data: &[u8]) -> Result<RgbImage, String> {
    decode_rgb_scaled(data, 1)
}

/// Whether `data` is a JPEG (the only format decoded at reduced scale).
pub fn is_jpeg(data: &[u8]) -> bool {
    data.starts_with(&[0xFF, 0xD8])
}

/// Decodes `data`, a JPEG at `1/denom` of its size (`denom` in 1, 2, 4, 8:
/// libjpeg-turbo scales in the DCT domain, far cheaper than a full decode);
/// other formats always at full size.
pub fn decode_rgb_scaled(data: &[u8], denom: usize) -> Result<RgbImage, String> {
    if is_jpeg(data) {
        with_decoder(|dec| {
            let header = dec.read_header(data)?;
            let (w, h) = (header.width.div_ceil(denom), header.height.div_ceil(denom));
            decode_jpeg_region(dec, data, &header, denom, (0, 0, w, h))
        })
    } else {
        decode_other(data)
    }
}

/// Decodes the region `(x, y, w, h)` of a JPEG at `1/denom` scale to RGB.
pub fn decode_jpeg_region(
    dec: &mut JpegDecoder,
    data: &[u8],
    header: &JpegHeader,
    denom: usize,
    region: (usize, usize, usize, usize),
) -> Result<RgbImage, String> {
    if !matches!(denom, 1 | 2 | 4 | 8) {
        return Err(format!("unsupported JPEG scale 1/{denom}"));
    }
    let mut pixels = Vec::new();
    dec.decode(data, header, denom, region, Layout::Rgb, &mut pixels)?;
    let channels = if header.cmyk { 4 } else { 3 };
    pixels.truncate(region.2 * region.3 * channels);
    if header.cmyk {
        pixels = cmyk_to_rgb(&pixels, jpeg_has_adobe_marker(data));
    }
    Ok(RgbImage {
        width: region.2,
        height: region.3,
        pixels,
    })
}

/// Like [`decode_jpeg_region`], but into the first `w * h * 4` bytes of
/// `out` (reused, see [`JpegDecoder::decode`]), 4 bytes per pixel: R, G, B
/// and an unused fourth byte.
pub fn decode_jpeg_region_rgbx(
    dec: &mut JpegDecoder,
    data: &[u8],
    header: &JpegHeader,
    denom: usize,
    region: (usize, usize, usize, usize),
    out: &mut Vec<u8>,
) -> Result<(), String> {
    if !matches!(denom, 1 | 2 | 4 | 8) {
        return Err(format!("unsupported JPEG scale 1/{denom}"));
    }
    dec.decode(data, header, denom, region, Layout::Rgbx, out)?;
    if header.cmyk {
        // CMYK and RGBX are both 4 bytes per pixel: convert in place.
        let inverted = jpeg_has_adobe_marker(data);
        for px in out[..region.2 * region.3 * 4].chunks_exact_mut(4) {
            let [c, m, y, k] = [px[0], px[1], px[2], px[3]];
            let rgb = cmyk_pixel_to_rgb([c, m, y, k], inverted);
            px[..3].copy_from_slice(&rgb);
        }
    }
    Ok(())
}

/// Interleaved RGB to RGBX (4 bytes per pixel) into `out` (reused).
pub fn rgb_to_rgbx(rgb: &[u8], out: &mut Vec<u8>) {
    out.clear();
    out.extend(rgb.chunks_exact(3).flat_map(|p| [p[0], p[1], p[2], 0xFF]));
}

/// PIL's CMYK -> RGB: `channel = (255 - k) - (value * (255 - k)) / 255`
/// with its rounding division; Adobe CMYK is stored inverted.
fn cmyk_to_rgb(cmyk: &[u8], inverted: bool) -> Vec<u8> {
    let mut rgb = Vec::with_capacity(cmyk.len() / 4 * 3);
    for px in cmyk.chunks_exact(4) {
        rgb.extend(cmyk_pixel_to_rgb([px[0], px[1], px[2], px[3]], inverted));
    }
    rgb
}

/// One pixel of [`cmyk_to_rgb`].
fn cmyk_pixel_to_rgb(px: [u8; 4], inverted: bool) -> [u8; 3] {
    let muldiv255 = |a: u32, b: u32| {
        let t = a * b + 128;
        ((t >> 8) + t) >> 8
    };
    let v = |i: usize| u32::from(if inverted { 255 - px[i] } else { px[i] });
    let nk = 255 - v(3);
    [0, 1, 2].map(|c| (nk - muldiv255(v(c), nk)) as u8)
}

fn decode_other(data: &[u8]) -> Result<RgbImage, String> {
    let decode = || -> Result<RgbImage, String> {
        let img = image::load_from_memory(data).map_err(|e| e.to_string())?;
        let rgb = img.into_rgb8();
        let (width, height) = (rgb.width() as usize, rgb.height() as usize);
        Ok(RgbImage {
            width,
            height,
            pixels: rgb.into_raw(),
        })
    };
    // Third-party decoders fed untrusted bytes: a panic is this image's error.
    catch_unwind(AssertUnwindSafe(decode))
        .unwrap_or_else(|_| Err("the image decoder panicked on this data".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::testing::encode;

    #[test]
    fn png_is_lossless() {
        let img =
            image::RgbImage::from_fn(7, 5, |x, y| image::Rgb([x as u8 * 30, y as u8 * 40, 9]));
        let out = decode_rgb(&encode(&img, image::ImageFormat::Png)).unwrap();
        assert_eq!((out.width, out.height), (7, 5));
        assert_eq!(out.pixels, img.into_raw());
    }

    #[test]
    fn jpeg_decodes_close_to_source() {
        let img =
            image::RgbImage::from_fn(64, 48, |x, y| image::Rgb([x as u8 * 4, y as u8 * 5, 128]));
        let out = decode_rgb(&encode(&img, image::ImageFormat::Jpeg)).unwrap();
        assert_eq!((out.width, out.height), (64, 48));
        let mean_abs: f64 = out
            .pixels
            .iter()
            .zip(img.as_raw())
            .map(|(a, b)| f64::from((i16::from(*a) - i16::from(*b)).abs()))
            .sum::<f64>()
            / out.pixels.len() as f64;
        assert!(mean_abs < 3.0, "{mean_abs}");
    }

    #[test]
    fn scaled_jpeg_decode() {
        let img =
            image::RgbImage::from_fn(64, 50, |x, y| image::Rgb([x as u8 * 4, y as u8 * 5, 128]));
        let jpeg = encode(&img, image::ImageFormat::Jpeg);
        for denom in [1, 2, 4, 8] {
            let out = decode_rgb_scaled(&jpeg, denom).unwrap();
            assert_eq!(
                (out.width, out.height),
                (64 / denom, 50_usize.div_ceil(denom))
            );
            assert_eq!(out.pixels.len(), out.width * out.height * 3);
        }
        assert!(decode_rgb_scaled(&jpeg, 3).is_err());
        // Other formats ignore the scale.
        let png = encode(&img, image::ImageFormat::Png);
        assert_eq!(decode_rgb_scaled(&png, 4).unwrap().width, 64);
    }

    #[test]
    fn garbage_and_truncated_data_are_errors() {
        assert!(decode_rgb(b"\xff\xd8garbage").is_err());
        assert!(decode_rgb(b"not an image").is_err());
        let img = image::RgbImage::from_fn(32, 32, |x, _| image::Rgb([x as u8, 0, 0]));
        let jpeg = encode(&img, image::ImageFormat::Jpeg);
        assert!(decode_rgb(&jpeg[..jpeg.len() / 3]).is_err() || decode_rgb(&jpeg[..40]).is_err());
    }

    #[test]
    fn cmyk_conversion_matches_pil_formula() {
        // c, m, y, k = 0, 255, 128, 0 (not inverted) -> 255, 0, 127
        assert_eq!(cmyk_to_rgb(&[0, 255, 128, 0], false), vec![255, 0, 127]);
        // Inverted storage of the same values.
        assert_eq!(cmyk_to_rgb(&[255, 0, 127, 255], true), vec![255, 0, 127]);
        // Full black ink.
        assert_eq!(cmyk_to_rgb(&[0, 0, 0, 255], false), vec![0, 0, 0]);
    }
}
