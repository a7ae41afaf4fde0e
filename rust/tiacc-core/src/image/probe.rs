//! Image format and size from the header alone, without decoding pixels.

use std::io::Cursor;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use crate::error::{Error, Result};

/// Image formats the engine reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFormat {
    Jpeg,
    Png,
    Bmp,
    WebP,
}

impl ImageFormat {
    /// Upper-case name, as TensorFlow's ImageNet scripts write `image/format`.
    pub fn name(self) -> &'static str {
        match self {
            ImageFormat::Jpeg => "JPEG",
            ImageFormat::Png => "PNG",
            ImageFormat::Bmp => "BMP",
            ImageFormat::WebP => "WEBP",
        }
    }
}

/// Format and size read from an image's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageInfo {
    pub format: ImageFormat,
    pub width: u32,
    pub height: u32,
}

/// Reads format and dimensions from the header of an encoded image, without
/// decoding the pixels. The format comes from the content, not the name.
///
/// JPEG and PNG headers are read here directly (the common case, and without
/// copying the file); other formats go through the `image` crate's probes.
pub fn probe_image(data: &[u8], path: &Path) -> Result<ImageInfo> {
    let bad = |reason: String| Error::BadImage {
        path: path.to_path_buf(),
        reason,
    };
    let (format, (width, height)) = if data.starts_with(&[0xFF, 0xD8]) {
        (ImageFormat::Jpeg, jpeg_size(data).map_err(bad)?)
    } else if data.starts_with(PNG_SIGNATURE) {
        (ImageFormat::Png, png_size(data).map_err(bad)?)
    } else {
        probe_other(data).map_err(bad)?
    };
    if width == 0 || height == 0 {
        return Err(bad(format!("image has zero size {width}x{height}")));
    }
    Ok(ImageInfo {
        format,
        width,
        height,
    })
}

const PNG_SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";

fn be16(data: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(data.get(at..at + 2)?.try_into().ok()?))
}

/// One marker segment of a JPEG header: the marker and the segment's bytes
/// after its 2-byte length field.
struct Segment<'a> {
    marker: u8,
    /// Offset of the length field, for messages.
    at: usize,
    body: &'a [u8],
}

/// Walks the marker segments of a JPEG header, from after SOI up to (not
/// including) the first scan (SOS); the first malformed byte ends the walk
/// with an error.
struct Segments<'a> {
    data: &'a [u8],
    at: usize,
    done: bool,
}

impl<'a> Segments<'a> {
    fn new(data: &'a [u8]) -> Self {
        Segments {
            data,
            at: 2,
            done: false,
        }
    }

    fn step(&mut self) -> std::result::Result<Option<Segment<'a>>, String> {
        let data = self.data;
        let truncated = || "JPEG header is truncated".to_string();
        loop {
            let at = self.at;
            if *data.get(at).ok_or_else(truncated)? != 0xFF {
                return Err(format!("JPEG marker expected at byte {at}"));
            }
            while data.get(self.at) == Some(&0xFF) {
                self.at += 1; // fill bytes
            }
            let marker = *data.get(self.at).ok_or_else(truncated)?;
            self.at += 1;
            match marker {
                // Markers without a length field.
                0x01 | 0xD0..=0xD8 => continue,
                0xD9 => return Err("JPEG ends (EOI) before its first scan".into()),
                0xDA => return Ok(None),
                _ => {}
            }
            let length = usize::from(be16(data, self.at).ok_or_else(truncated)?);
            if length < 2 {
                return Err(format!(
                    "JPEG segment at byte {} has invalid length {length}",
                    self.at
                ));
            }
            let at = self.at;
            let body = data.get(at + 2..at + length).ok_or_else(truncated)?;
            self.at += length;
            return Ok(Some(Segment { marker, at, body }));
        }
    }
}

impl<'a> Iterator for Segments<'a> {
    type Item = std::result::Result<Segment<'a>, String>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let item = self.step().transpose();
        if !matches!(item, Some(Ok(_))) {
            self.done = true;
        }
        item
    }
}

/// SOF0..SOF15 except DHT (C4), JPG (C8) and DAC (CC).
fn is_start_of_frame(marker: u8) -> bool {
    (0xC0..=0xCF).contains(&marker) && !matches!(marker, 0xC4 | 0xC8 | 0xCC)
}

/// Size from the first start-of-frame segment of a JPEG.
pub(crate) fn jpeg_size(data: &[u8]) -> std::result::Result<(u32, u32), String> {
    for segment in Segments::new(data) {
        let Segment { marker, at, body } = segment?;
        if is_start_of_frame(marker) {
            // precision(1) height(2) width(2) components(1) ...
            if body.len() < 6 {
                return Err(format!(
                    "JPEG start-of-frame segment at byte {at} is too short"
                ));
            }
            let height = be16(body, 1).expect("checked length");
            let width = be16(body, 3).expect("checked length");
            return Ok((u32::from(width), u32::from(height)));
        }
    }
    Err("JPEG has no start-of-frame segment before its first scan".into())
}

/// Whether a JPEG carries Adobe's APP14 marker. CMYK JPEGs written by
/// Photoshop (and by PIL) store inverted values and say so with it.
pub fn jpeg_has_adobe_marker(data: &[u8]) -> bool {
    Segments::new(data)
        .map_while(|s| s.ok())
        .any(|s| s.marker == 0xEE && s.body.starts_with(b"Adobe"))
}

/// Size from a PNG's IHDR chunk, which must come first.
fn png_size(data: &[u8]) -> std::result::Result<(u32, u32), String> {
    let ihdr = data.get(8..24).ok_or("PNG header is truncated")?;
    if &ihdr[4..8] != b"IHDR" {
        return Err("PNG does not start with an IHDR chunk".into());
    }
    let width = u32::from_be_bytes(ihdr[8..12].try_into().expect("4 bytes"));
    let height = u32::from_be_bytes(ihdr[12..16].try_into().expect("4 bytes"));
    Ok((width, height))
}

/// BMP and WebP (and recognisable but unsupported formats) via `image`.
fn probe_other(data: &[u8]) -> std::result::Result<(ImageFormat, (u32, u32)), String> {
    let probe = || -> std::result::Result<(ImageFormat, (u32, u32)), String> {
        let reader = image::ImageReader::new(Cursor::new(data))
            .with_guessed_format()
            .map_err(|e| e.to_string())?;
        let format = match reader.format() {
            Some(image::ImageFormat::Bmp) => ImageFormat::Bmp,
            Some(image::ImageFormat::WebP) => ImageFormat::WebP,
            Some(other) => return Err(format!("unsupported image format {other:?}")),
            None => return Err("unrecognised file format (not JPEG, PNG, BMP or WebP)".into()),
        };
        let size = reader.into_dimensions().map_err(|e| e.to_string())?;
        Ok((format, size))
    };
    // The probes are third-party code fed untrusted bytes: a panic there must
    // become an error for this file, not abort the whole run.
    catch_unwind(AssertUnwindSafe(probe))
        .unwrap_or_else(|_| Err("the image decoder panicked on this file".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::testing::{encode, gradient};

    fn encoded(w: u32, h: u32, format: image::ImageFormat) -> Vec<u8> {
        encode(&gradient(w, h, 7), format)
    }

    #[test]
    fn probe_every_format() {
        for (format, expected) in [
            (image::ImageFormat::Jpeg, ImageFormat::Jpeg),
            (image::ImageFormat::Png, ImageFormat::Png),
            (image::ImageFormat::Bmp, ImageFormat::Bmp),
            (image::ImageFormat::WebP, ImageFormat::WebP),
        ] {
            let info = probe_image(&encoded(37, 23, format), Path::new("x")).unwrap();
            assert_eq!((info.format, info.width, info.height), (expected, 37, 23));
        }
    }

    #[test]
    fn jpeg_header_edge_cases() {
        // SOI, APP0 (length 4), fill bytes, progressive SOF2 with 640x480.
        let sof2 = [
            0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x04, 0xAA, 0xBB, 0xFF, 0xFF, 0xC2, 0x00, 0x0B, 0x08,
            0x01, 0xE0, 0x02, 0x80, 0x03, 0x01, 0x11, 0x00,
        ];
        assert_eq!(jpeg_size(&sof2), Ok((640, 480)));
        // A DHT (C4) segment is not a frame header and is skipped.
        let dht_first = [
            0xFF, 0xD8, 0xFF, 0xC4, 0x00, 0x03, 0x00, 0xFF, 0xC0, 0x00, 0x08, 0x08, 0x00, 0x02,
            0x00, 0x03, 0x01,
        ];
        assert_eq!(jpeg_size(&dht_first), Ok((3, 2)));
        for bad in [
            &[0xFF, 0xD8][..],
            &[0xFF, 0xD8, 0x00],
            &[0xFF, 0xD8, 0xFF, 0xD9],
            &[0xFF, 0xD8, 0xFF, 0xDA, 0x00, 0x02],
            &[0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x01],
            &[0xFF, 0xD8, 0xFF, 0xC0, 0x00, 0x05, 0x08, 0x00, 0x01],
            &[0xFF, 0xD8, 0xFF, 0xE0, 0xFF, 0xFF],
        ] {
            assert!(jpeg_size(bad).is_err(), "{bad:?}");
        }
        // Zero height (defined later by a DNL marker) is refused.
        let zero = [
            0xFF, 0xD8, 0xFF, 0xC0, 0x00, 0x08, 0x08, 0x00, 0x00, 0x00, 0x10, 0x01,
        ];
        assert!(probe_image(&zero, Path::new("z.jpg")).is_err());
    }

    #[test]
    fn adobe_marker() {
        let plain = encoded(4, 4, image::ImageFormat::Jpeg);
        assert!(!jpeg_has_adobe_marker(&plain));
        let mut adobe = vec![0xFF, 0xD8, 0xFF, 0xEE, 0x00, 0x0E];
        adobe.extend_from_slice(b"Adobe\x00\x64\x00\x00\x00\x00\x02");
        adobe.extend_from_slice(&plain[2..]);
        assert!(jpeg_has_adobe_marker(&adobe));
        assert_eq!(jpeg_size(&adobe), jpeg_size(&plain));
    }

    #[test]
    fn png_header_edge_cases() {
        let good = encoded(5, 9, image::ImageFormat::Png);
        assert_eq!(png_size(&good), Ok((5, 9)));
        assert!(png_size(&good[..20]).is_err());
        let mut not_ihdr = good.clone();
        not_ihdr[12..16].copy_from_slice(b"IDAT");
        assert!(png_size(&not_ihdr).is_err());
    }

    #[test]
    fn probe_reads_header() {
        let info =
            probe_image(&encoded(3, 2, image::ImageFormat::Png), Path::new("a.png")).unwrap();
        assert_eq!(
            info,
            ImageInfo {
                format: ImageFormat::Png,
                width: 3,
                height: 2
            }
        );
        let err = probe_image(b"not an image at all", Path::new("b.jpg")).unwrap_err();
        assert!(
            err.to_string().starts_with("b.jpg: not a readable image"),
            "{err}"
        );
        let truncated = &encoded(3, 2, image::ImageFormat::Png)[..20];
        assert!(probe_image(truncated, Path::new("c.png")).is_err());
    }
}
