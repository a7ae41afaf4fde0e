//! Packing image files into `tf.train.Example` records, in parallel, with
//! output that does not depend on the number of workers.

use std::fs;
use std::io::Cursor;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use prost::Message;
use rayon::prelude::*;

use super::example::{Example, Feature};
use super::writer::{DatasetSummary, RecordLocation, ShardedWriter};
use crate::error::{Error, Result};

/// Image formats the packer accepts.
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

/// Size from the first start-of-frame segment of a JPEG.
fn jpeg_size(data: &[u8]) -> std::result::Result<(u32, u32), String> {
    let truncated = || "JPEG header is truncated before its start-of-frame segment".to_string();
    let mut at = 2; // after SOI
    loop {
        if *data.get(at).ok_or_else(truncated)? != 0xFF {
            return Err(format!("JPEG marker expected at byte {at}"));
        }
        while data.get(at) == Some(&0xFF) {
            at += 1; // fill bytes
        }
        let marker = *data.get(at).ok_or_else(truncated)?;
        at += 1;
        match marker {
            // Markers without a length field.
            0x01 | 0xD0..=0xD8 => continue,
            0xD9 => return Err("JPEG ends before a start-of-frame segment".into()),
            0xDA => return Err("JPEG scan data before a start-of-frame segment".into()),
            _ => {}
        }
        let length = usize::from(be16(data, at).ok_or_else(truncated)?);
        if length < 2 {
            return Err(format!(
                "JPEG segment at byte {at} has invalid length {length}"
            ));
        }
        // SOF0..SOF15 except DHT (C4), JPG (C8) and DAC (CC):
        // length(2) precision(1) height(2) width(2) components(1) ...
        if (0xC0..=0xCF).contains(&marker) && !matches!(marker, 0xC4 | 0xC8 | 0xCC) {
            if length < 8 {
                return Err(format!(
                    "JPEG start-of-frame segment too short ({length} bytes)"
                ));
            }
            let height = be16(data, at + 3).ok_or_else(truncated)?;
            let width = be16(data, at + 5).ok_or_else(truncated)?;
            return Ok((u32::from(width), u32::from(height)));
        }
        at += length;
    }
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

/// One image to pack.
#[derive(Debug, Clone)]
pub struct PackItem {
    /// The file to read.
    pub path: PathBuf,
    /// Stored as `image/filename`.
    pub filename: String,
    /// The label column of the dataset index.
    pub label: i64,
    /// Size the caller expects (e.g. from COCO annotations), checked
    /// against the header.
    pub expect_size: Option<(u32, u32)>,
    /// Extra features, added as given (labels, boxes, ids...).
    pub features: Vec<(String, Feature)>,
}

/// Options of an [`ImagePacker`].
#[derive(Debug, Clone, Copy)]
pub struct PackOptions {
    /// Threads that read and encode; 0 packs in the calling thread.
    pub workers: usize,
    /// Write `image/format` in lower case (`jpeg`, as the TensorFlow object
    /// detection scripts do) rather than upper case (`JPEG`, ImageNet's).
    pub lowercase_format: bool,
}

/// Serialized Example for one item: the original encoded bytes, never
/// re-encoded, plus header-derived and caller-given features.
pub fn build_record(item: &PackItem, lowercase_format: bool) -> Result<BuiltRecord> {
    let data = fs::read(&item.path).map_err(|e| Error::io(&item.path, e))?;
    let image_bytes = data.len() as u64;
    let info = probe_image(&data, &item.path)?;
    if let Some((w, h)) = item.expect_size {
        if (w, h) != (info.width, info.height) {
            return Err(Error::BadImage {
                path: item.path.clone(),
                reason: format!(
                    "header says {}x{} but the annotations say {w}x{h}",
                    info.width, info.height
                ),
            });
        }
    }
    let format = if lowercase_format {
        info.format.name().to_ascii_lowercase()
    } else {
        info.format.name().to_string()
    };
    let mut features: Vec<(String, Feature)> = vec![
        ("image/encoded".into(), Feature::bytes([Bytes::from(data)])),
        ("image/format".into(), Feature::bytes([format.into_bytes()])),
        (
            "image/filename".into(),
            Feature::bytes([item.filename.clone().into_bytes()]),
        ),
        (
            "image/height".into(),
            Feature::int64([i64::from(info.height)]),
        ),
        (
            "image/width".into(),
            Feature::int64([i64::from(info.width)]),
        ),
    ];
    features.extend(item.features.iter().cloned());
    Ok(BuiltRecord {
        payload: Example::from_features(features).encode_to_vec(),
        image_bytes,
    })
}

/// A serialized Example and the size of the image file inside it.
#[derive(Debug)]
pub struct BuiltRecord {
    pub payload: Vec<u8>,
    pub image_bytes: u64,
}

/// What happened to one item.
#[derive(Debug)]
pub enum PackOutcome {
    Packed(RecordLocation),
    /// The item could not be read or is not an image; nothing was written.
    Failed(Error),
}

/// Items built in parallel per batch while the previous batch is written.
const PIPELINE_BATCH: usize = 16;

/// Serialized records (or per-item errors) of one batch, in item order.
type Built = Vec<Result<BuiltRecord>>;

/// Packs images into a [`ShardedWriter`], preserving item order.
pub struct ImagePacker {
    writer: ShardedWriter,
    pool: Option<rayon::ThreadPool>,
    options: PackOptions,
    image_bytes: u64,
}

impl ImagePacker {
    /// A packer writing dataset `name` into `out_dir`.
    pub fn new(writer: ShardedWriter, options: PackOptions) -> Result<Self> {
        let pool = match options.workers {
            0 => None,
            n => Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .thread_name(|i| format!("tiacc-pack-{i}"))
                    .build()
                    .map_err(|e| {
                        Error::InvalidArgument(format!("cannot start {n} workers: {e}"))
                    })?,
            ),
        };
        Ok(ImagePacker {
            writer,
            pool,
            options,
            image_bytes: 0,
        })
    }

    /// Total bytes of the encoded images packed so far.
    pub fn image_bytes(&self) -> u64 {
        self.image_bytes
    }

    /// Records written so far.
    pub fn records(&self) -> u64 {
        self.writer.records()
    }

    /// Packs `items` in order. Per-item failures are returned as outcomes;
    /// an error from writing the output stops the packer.
    pub fn add(&mut self, items: &[PackItem]) -> Result<Vec<PackOutcome>> {
        let lower = self.options.lowercase_format;
        let build = |batch: &[PackItem]| -> Built {
            batch
                .par_iter()
                .map(|item| build_record(item, lower))
                .collect()
        };
        let writer = &mut self.writer;
        let image_bytes = &mut self.image_bytes;
        let mut outcomes = Vec::with_capacity(items.len());
        let mut write = |batch: &[PackItem], built: Built| -> Result<Vec<PackOutcome>> {
            batch
                .iter()
                .zip(built)
                .map(|(item, record)| match record {
                    Ok(record) => {
                        *image_bytes += record.image_bytes;
                        writer
                            .write(&record.payload, item.label)
                            .map(PackOutcome::Packed)
                    }
                    Err(e) => Ok(PackOutcome::Failed(e)),
                })
                .collect()
        };
        match &self.pool {
            None => {
                for item in items {
                    let built = vec![build_record(item, lower)];
                    outcomes.extend(write(std::slice::from_ref(item), built)?);
                }
            }
            Some(pool) => pool.install(|| -> Result<()> {
                // Build batch i while batch i-1 is written.
                let mut pending: Option<(&[PackItem], Built)> = None;
                for batch in items.chunks(PIPELINE_BATCH) {
                    let (built, written) = rayon::join(
                        || build(batch),
                        || pending.take().map(|(b, r)| write(b, r)).transpose(),
                    );
                    outcomes.extend(written?.into_iter().flatten());
                    pending = Some((batch, built));
                }
                if let Some((b, r)) = pending {
                    outcomes.extend(write(b, r)?);
                }
                Ok(())
            })?,
        }
        Ok(outcomes)
    }

    /// Publishes the dataset.
    pub fn finish(&mut self) -> Result<DatasetSummary> {
        self.writer.finish()
    }

    /// Discards everything written.
    pub fn abort(&mut self) {
        self.writer.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tfrecord::index::read_index;
    use crate::tfrecord::record::RecordReader;

    /// A 3x2 PNG made by the `image` crate.
    fn png(w: u32, h: u32) -> Vec<u8> {
        let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, 7]));
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageFormat::Png).unwrap();
        out.into_inner()
    }

    fn item(path: PathBuf, label: i64) -> PackItem {
        PackItem {
            filename: path.file_name().unwrap().to_string_lossy().into_owned(),
            path,
            label,
            expect_size: None,
            features: vec![("image/class/label".into(), Feature::int64([label]))],
        }
    }

    fn encoded(w: u32, h: u32, format: image::ImageFormat) -> Vec<u8> {
        let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, 7]));
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, format).unwrap();
        out.into_inner()
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
            &[0xFF, 0xD8, 0xFF, 0xC0, 0x00, 0x05, 0x08, 0x00],
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
        let info = probe_image(&png(3, 2), Path::new("a.png")).unwrap();
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
        let truncated = &png(3, 2)[..20];
        assert!(probe_image(truncated, Path::new("c.png")).is_err());
    }

    fn pack(dir: &Path, workers: usize, items: &[PackItem]) -> (Vec<PackOutcome>, Vec<u8>) {
        let out = dir.join(format!("out{workers}"));
        let writer = ShardedWriter::create(&out, "ds", 2).unwrap();
        let mut packer = ImagePacker::new(
            writer,
            PackOptions {
                workers,
                lowercase_format: false,
            },
        )
        .unwrap();
        let outcomes = packer.add(items).unwrap();
        packer.finish().unwrap();
        let mut all = fs::read(out.join("ds.index")).unwrap();
        for i in 0..3 {
            all.extend(fs::read(out.join(format!("ds-0000{i}.tfrecord"))).unwrap_or_default());
        }
        (outcomes, all)
    }

    #[test]
    fn packs_in_order_skips_bad_and_is_worker_independent() {
        let dir = tempfile::tempdir().unwrap();
        let mut items = Vec::new();
        for i in 0..40 {
            let p = dir.path().join(format!("img{i}.png"));
            if i == 5 {
                fs::write(&p, b"garbage").unwrap();
            } else {
                fs::write(&p, png(4 + i, 3)).unwrap();
            }
            items.push(item(p, i64::from(i)));
        }
        let (outcomes, bytes0) = pack(dir.path(), 0, &items);
        let (_, bytes1) = pack(dir.path(), 1, &items);
        let (_, bytes2) = pack(dir.path(), 2, &items);
        assert_eq!(bytes0, bytes1);
        assert_eq!(bytes0, bytes2);
        assert!(matches!(
            outcomes[5],
            PackOutcome::Failed(Error::BadImage { .. })
        ));
        let index = read_index(&dir.path().join("out2/ds.index")).unwrap();
        assert_eq!(index.len(), 39);
        let e = &index[5]; // item 6: the failed item took no slot
        let r = RecordReader::open(dir.path().join("out2").join(&e.shard_file), true).unwrap();
        let ex = Example::parse(r.read_at(e.offset).unwrap(), "").unwrap();
        assert_eq!(ex.first_int64("image/class/label"), Some(6));
        assert_eq!(ex.first_int64("image/width"), Some(10));
        assert_eq!(ex.first_int64("image/height"), Some(3));
        assert_eq!(ex.first_bytes("image/format").unwrap().as_ref(), b"PNG");
        assert_eq!(
            ex.first_bytes("image/encoded").unwrap().as_ref(),
            png(10, 3).as_slice()
        );
    }

    #[test]
    fn expected_size_mismatch_fails_the_item() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.png");
        fs::write(&p, png(3, 2)).unwrap();
        let mut it = item(p, 0);
        it.expect_size = Some((2, 3));
        let msg = build_record(&it, true).unwrap_err().to_string();
        assert!(
            msg.contains("header says 3x2 but the annotations say 2x3"),
            "{msg}"
        );
    }
}
