//! A small safe wrapper over libjpeg-turbo's TurboJPEG 3 API (through
//! `turbojpeg-sys`): header reading, DCT-domain scaling and partial
//! (cropped) decompression, which the higher-level `turbojpeg` crate does not
//! expose. One decoder per thread; see [`with_decoder`].

use std::cell::RefCell;
use std::ffi::CStr;
use std::ptr::NonNull;

use turbojpeg_sys as tj;

use super::probe::jpeg_size;

/// The most pixels one decode may produce: Pillow's decompression-bomb error
/// threshold (2 x `Image.MAX_IMAGE_PIXELS`). A header can claim 65535 x 65535
/// pixels in a few hundred bytes; this refuses to allocate for it.
pub const MAX_PIXELS: usize = 178_956_970;

/// What the header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JpegHeader {
    pub width: usize,
    pub height: usize,
    /// Chroma subsampling (`TJSAMP_*`), which fixes the iMCU width.
    pub subsamp: i32,
    /// CMYK or YCCK: decoded as CMYK, converted by the caller.
    pub cmyk: bool,
}

impl JpegHeader {
    /// Width of an iMCU at `1/denom` scale: cropped decodes must start at a
    /// multiple of it.
    pub fn scaled_mcu_width(&self, denom: usize) -> usize {
        // tjMCUWidth: 444 8, 422 16, 420 16, gray 8, 440 8, 411 32, 441 8.
        let mcu = match self.subsamp {
            1 | 2 => 16,
            5 => 32,
            _ => 8,
        };
        (mcu / denom).max(1)
    }
}

/// The pixel layout of a decode (CMYK images always decode to CMYK).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// 3 bytes per pixel.
    Rgb,
    /// 4 bytes per pixel, the fourth unused: what the resampler reads.
    Rgbx,
}

/// An owned TurboJPEG decompressor handle.
pub struct JpegDecoder {
    handle: NonNull<std::ffi::c_void>,
}

impl JpegDecoder {
    /// Creates a decompressor.
    pub fn new() -> Result<Self, String> {
        // SAFETY: tj3Init has no preconditions; it returns NULL on failure,
        // which NonNull::new turns into an error.
        let raw = unsafe { tj::tj3Init(tj::TJINIT_TJINIT_DECOMPRESS as i32) };
        NonNull::new(raw)
            .map(|handle| JpegDecoder { handle })
            .ok_or_else(|| "libjpeg-turbo could not create a decompressor".to_string())
    }

    fn error(&self) -> String {
        // SAFETY: the handle is valid; tj3GetErrorStr returns a pointer to a
        // NUL-terminated string owned by the handle (or a static one), which
        // is copied before the handle is used again.
        unsafe {
            let msg = tj::tj3GetErrorStr(self.handle.as_ptr());
            if msg.is_null() {
                "unknown libjpeg-turbo error".into()
            } else {
                CStr::from_ptr(msg).to_string_lossy().into_owned()
            }
        }
    }

    fn get(&self, param: tj::TJPARAM) -> i32 {
        // SAFETY: the handle is valid and `param` is a TJPARAM constant.
        unsafe { tj::tj3Get(self.handle.as_ptr(), param as i32) }
    }

    /// Reads the header of `data`.
    pub fn read_header(&mut self, data: &[u8]) -> Result<JpegHeader, String> {
        // Our own scan first: TurboJPEG can report success on data with no
        // frame header at all, leaving the previous image's parameters in
        // the handle. Its answer must agree with this one.
        let (sof_w, sof_h) = jpeg_size(data)?;
        // SAFETY: the handle is valid; the pointer and length describe `data`,
        // which TurboJPEG only reads during the call.
        let rc = unsafe {
            tj::tj3DecompressHeader(self.handle.as_ptr(), data.as_ptr(), data.len() as _)
        };
        if rc != 0 {
            return Err(self.error());
        }
        let (width, height) = (
            self.get(tj::TJPARAM_TJPARAM_JPEGWIDTH),
            self.get(tj::TJPARAM_TJPARAM_JPEGHEIGHT),
        );
        if i64::from(width) != i64::from(sof_w) || i64::from(height) != i64::from(sof_h) {
            return Err(format!(
                "libjpeg-turbo read a {width}x{height} header where the frame says {sof_w}x{sof_h}"
            ));
        }
        if width <= 0 || height <= 0 {
            return Err(format!("JPEG has invalid size {width}x{height}"));
        }
        let colorspace = self.get(tj::TJPARAM_TJPARAM_COLORSPACE);
        Ok(JpegHeader {
            width: width as usize,
            height: height as usize,
            subsamp: self.get(tj::TJPARAM_TJPARAM_SUBSAMP),
            cmyk: colorspace == tj::TJCS_TJCS_CMYK as i32
                || colorspace == tj::TJCS_TJCS_YCCK as i32,
        })
    }

    /// Decodes `data` (whose header was just read into `header`) at
    /// `1/denom` scale, only the region `(x, y, w, h)` of the scaled image
    /// (`x` a multiple of [`JpegHeader::scaled_mcu_width`]), into the first
    /// `w * h * channels` bytes of `out` (3 channels for [`Layout::Rgb`], 4
    /// for [`Layout::Rgbx`] and for CMYK), which is grown to hold them but
    /// never shrunk.
    pub fn decode(
        &mut self,
        data: &[u8],
        header: &JpegHeader,
        denom: usize,
        region: (usize, usize, usize, usize),
        layout: Layout,
        out: &mut Vec<u8>,
    ) -> Result<(), String> {
        let (x, y, w, h) = region;
        let (sw, sh) = (header.width.div_ceil(denom), header.height.div_ceil(denom));
        if w.saturating_mul(h) > MAX_PIXELS {
            return Err(format!(
                "a {w}x{h} decode exceeds the limit of {MAX_PIXELS} pixels (a decompression bomb?)"
            ));
        }
        if w == 0 || h == 0 || x + w > sw || y + h > sh || x % header.scaled_mcu_width(denom) != 0 {
            return Err(format!(
                "invalid JPEG region {w}x{h}+{x}+{y} of a {sw}x{sh} image at scale 1/{denom}"
            ));
        }
        let (format, channels) = match (header.cmyk, layout) {
            (true, _) => (tj::TJPF_TJPF_CMYK, 4),
            (false, Layout::Rgb) => (tj::TJPF_TJPF_RGB, 3),
            (false, Layout::Rgbx) => (tj::TJPF_TJPF_RGBX, 4),
        };
        let int = |v: usize| i32::try_from(v).map_err(|_| format!("JPEG dimension {v} too large"));
        let scaling = tj::tjscalingfactor {
            num: 1,
            denom: int(denom)?,
        };
        let full = (x, y, w, h) == (0, 0, sw, sh);
        let crop = if full {
            // TJUNCROPPED
            tj::tjregion {
                x: 0,
                y: 0,
                w: 0,
                h: 0,
            }
        } else {
            tj::tjregion {
                x: int(x)?,
                y: int(y)?,
                w: int(w)?,
                h: int(h)?,
            }
        };
        // Callers reuse `out` across images: keeping its length saves
        // zero-filling its tail again whenever the next image is larger.
        let len = w * h * channels;
        if out.len() < len {
            out.resize(len, 0);
        }
        let pitch = int(w * channels)?;
        // SAFETY: the handle is valid and its header was read from `data`
        // (checked region against it above). `out` holds at least
        // `pitch * h` bytes, the size TurboJPEG writes for a `w x h` region
        // of this pixel format; `data` is only read during the call.
        let rc = unsafe {
            if tj::tj3SetScalingFactor(self.handle.as_ptr(), scaling) != 0
                || tj::tj3SetCroppingRegion(self.handle.as_ptr(), crop) != 0
            {
                -2
            } else {
                tj::tj3Decompress8(
                    self.handle.as_ptr(),
                    data.as_ptr(),
                    data.len() as _,
                    out.as_mut_ptr(),
                    pitch,
                    format,
                )
            }
        };
        if rc != 0 {
            // Warnings (recoverable corruption) still produce an image, as
            // PIL accepts them; a truncated file is an error, as in PIL.
            // SAFETY: the handle is valid.
            let code = unsafe { tj::tj3GetErrorCode(self.handle.as_ptr()) };
            let msg = self.error();
            let warning = rc == -1 && code == tj::TJERR_TJERR_WARNING as i32;
            if !warning || msg.contains("Premature end") {
                return Err(msg);
            }
        }
        Ok(())
    }
}

impl Drop for JpegDecoder {
    fn drop(&mut self) {
        // SAFETY: the handle came from tj3Init and is destroyed exactly once.
        unsafe { tj::tj3Destroy(self.handle.as_ptr()) }
    }
}

thread_local! {
    static DECODER: RefCell<Option<JpegDecoder>> = const { RefCell::new(None) };
}

/// Runs `f` with this thread's decoder, created on first use.
pub fn with_decoder<R>(f: impl FnOnce(&mut JpegDecoder) -> Result<R, String>) -> Result<R, String> {
    DECODER.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(JpegDecoder::new()?);
        }
        f(slot.as_mut().expect("set above"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::testing::{encode, gradient};

    fn jpeg(w: u32, h: u32) -> Vec<u8> {
        encode(&gradient(w, h, 99), image::ImageFormat::Jpeg)
    }

    #[test]
    fn cropped_decode_equals_region_of_full_decode() {
        let data = jpeg(96, 80);
        with_decoder(|d| {
            let header = d.read_header(&data)?;
            assert_eq!((header.width, header.height), (96, 80));
            let mcu = header.scaled_mcu_width(1);
            let mut full = Vec::new();
            d.decode(&data, &header, 1, (0, 0, 96, 80), Layout::Rgb, &mut full)?;
            let mut part = Vec::new();
            let (x, y, w, h) = (mcu * 2, 13, 40, 30);
            d.decode(&data, &header, 1, (x, y, w, h), Layout::Rgb, &mut part)?;
            for row in 0..h {
                let a = &part[row * w * 3..(row + 1) * w * 3];
                let start = ((y + row) * 96 + x) * 3;
                assert_eq!(a, &full[start..start + w * 3], "row {row}");
            }
            let mut half = Vec::new();
            d.decode(&data, &header, 2, (0, 0, 48, 40), Layout::Rgb, &mut half)?;
            assert_eq!(half.len(), 48 * 40 * 3);
            assert!(d
                .decode(&data, &header, 1, (3, 0, 8, 8), Layout::Rgb, &mut part)
                .is_err());
            assert!(d
                .decode(&data, &header, 1, (0, 0, 97, 8), Layout::Rgb, &mut part)
                .is_err());
            Ok(())
        })
        .unwrap();
    }

    #[test]
    fn garbage_is_an_error_even_after_a_good_image() {
        assert!(with_decoder(|d| d.read_header(b"\xff\xd8nonsense")).is_err());
        let good = jpeg(16, 16);
        let mut zeroed = good.clone();
        zeroed[2..].fill(0);
        with_decoder(|d| {
            d.read_header(&good)?;
            assert!(d.read_header(&zeroed).is_err());
            Ok(())
        })
        .unwrap();
    }
}
