//! Packing image files into `tf.train.Example` records, in parallel, with
//! output that does not depend on the number of workers.
//!
//! This is what the packing tools (`img2tfrecord`) run. It sits beside
//! `tfrecord` and `image` rather than inside either: it reads image headers
//! (`image`) and writes records (`tfrecord`), and `tfrecord` itself knows
//! nothing about images.

use std::fs;
use std::path::PathBuf;

use bytes::Bytes;
use prost::Message;
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::image::probe::probe_image;
use crate::tfrecord::example::{Example, Feature};
use crate::tfrecord::writer::{DatasetSummary, RecordLocation, ShardedWriter};

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
    use crate::image::testing::{encode, gradient};
    use crate::tfrecord::index::read_index;
    use crate::tfrecord::record::RecordReader;
    use std::path::Path;

    /// A 3x2 PNG made by the `image` crate.
    fn png(w: u32, h: u32) -> Vec<u8> {
        encode(&gradient(w, h, 7), image::ImageFormat::Png)
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
