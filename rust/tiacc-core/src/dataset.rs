//! A packed dataset: an index plus its shards, read by record number.
//!
//! The index (`NAME.index`, see [`crate::tfrecord::index`]) is loaded once;
//! each shard it names is opened once, at construction, so that a missing
//! shard fails early with its path. Reads are positional (`pread`), so one
//! dataset serves any number of threads, and CRCs are verified.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::image::decode::{decode_rgb, RgbImage};
use crate::image::fused::{render, Geometry, Output, OutputSlice};
use crate::image::probe::probe_image;
use crate::pool;
use crate::tfrecord::example::{Example, Kind};
use crate::tfrecord::index::{read_index_numbered, shard_path};
use crate::tfrecord::record::{RecordReader, SizedFile};

/// The feature holding the encoded image.
pub const IMAGE_KEY: &str = "image/encoded";

/// Random access to the records of a packed dataset.
pub struct IndexedDataset {
    shards: Vec<RecordReader<SizedFile>>,
    /// `(shard slot, offset)` per record, in index order.
    records: Vec<(u32, u64)>,
    labels: Vec<i64>,
}

impl IndexedDataset {
    /// Loads `index_path`, resolving shard names against `dir`.
    pub fn open(dir: &Path, index_path: &Path) -> Result<Self> {
        let entries = read_index_numbered(index_path)?;
        let mut slots: HashMap<String, u32> = HashMap::new();
        let mut shards = Vec::new();
        let mut records = Vec::with_capacity(entries.len());
        let mut labels = Vec::with_capacity(entries.len());
        for (line, entry) in entries {
            let slot = match slots.get(&entry.shard_file) {
                Some(&slot) => slot,
                None => {
                    let path = shard_path(dir, &entry.shard_file);
                    let reader = RecordReader::open(&path, true).map_err(|e| match e {
                        Error::Io { source, .. } => Error::BadIndex {
                            path: index_path.to_path_buf(),
                            line,
                            reason: format!("shard {}: {source}", path.display()),
                        },
                        other => other,
                    })?;
                    let slot = u32::try_from(shards.len())
                        .map_err(|_| Error::InvalidArgument("more than 2^32 shards".into()))?;
                    shards.push(reader);
                    slots.insert(entry.shard_file, slot);
                    slot
                }
            };
            records.push((slot, entry.offset));
            labels.push(entry.label);
        }
        Ok(IndexedDataset {
            shards,
            records,
            labels,
        })
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether the dataset has no records.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The label of every record, in index order.
    pub fn labels(&self) -> &[i64] {
        &self.labels
    }

    /// Paths of the shards, in first-use order.
    pub fn shard_paths(&self) -> impl Iterator<Item = &Path> {
        self.shards.iter().map(|r| r.path())
    }

    /// Shard path and offset of record `index`.
    pub fn location(&self, index: usize) -> Result<(&Path, u64)> {
        let &(slot, offset) = self.records.get(index).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "index {index} is out of range for a dataset of {} records",
                self.records.len()
            ))
        })?;
        Ok((self.shards[slot as usize].path(), offset))
    }

    /// The parsed Example of record `index`.
    pub fn example(&self, index: usize) -> Result<Example> {
        let (path, offset) = self.location(index)?;
        let &(slot, _) = &self.records[index];
        let payload = self.shards[slot as usize].read_at(offset)?;
        Example::parse(
            payload,
            &format!(
                " in {} at offset {offset} (dataset index {index})",
                path.display()
            ),
        )
    }

    /// The encoded image bytes of record `index`.
    pub fn image_bytes(&self, index: usize) -> Result<Bytes> {
        let example = self.example(index)?;
        let (path, offset) = self.location(index)?;
        let missing = |reason: String| Error::RecordFeature {
            path: path.to_path_buf(),
            offset,
            index,
            reason,
        };
        match example.get(IMAGE_KEY).and_then(|f| f.kind.as_ref()) {
            Some(Kind::BytesList(list)) if !list.value.is_empty() => Ok(list.value[0].clone()),
            Some(Kind::BytesList(_)) => Err(missing(format!("feature {IMAGE_KEY:?} is empty"))),
            Some(_) => Err(missing(format!(
                "feature {IMAGE_KEY:?} is not a bytes list"
            ))),
            None => Err(missing(format!("no feature {IMAGE_KEY:?}"))),
        }
    }

    /// Record `index`'s image decoded to RGB.
    pub fn decode(&self, index: usize) -> Result<RgbImage> {
        let data = self.image_bytes(index)?;
        decode_rgb(&data).map_err(|reason| self.image_error(index, reason))
    }

    /// Reads and decodes `indices` in parallel on a pool of `threads`
    /// threads (0: all cores); results in the order of `indices`.
    pub fn decode_batch(&self, indices: &[usize], threads: usize) -> Result<Vec<RgbImage>> {
        map_batch(indices, threads, |i| self.decode(i))
    }

    fn image_error(&self, index: usize, reason: String) -> Error {
        match self.location(index) {
            Ok((path, offset)) => Error::RecordImage {
                path: path.to_path_buf(),
                offset,
                index,
                reason,
            },
            Err(e) => e,
        }
    }

    /// `(width, height)` of each image of `indices`, from its header.
    pub fn image_sizes(&self, indices: &[usize], threads: usize) -> Result<Vec<(u32, u32)>> {
        map_batch(indices, threads, |i| {
            let data = self.image_bytes(i)?;
            let info = probe_image(&data, Path::new("")).map_err(|e| match e {
                Error::BadImage { reason, .. } => self.image_error(i, reason),
                other => other,
            })?;
            Ok((info.width, info.height))
        })
    }

    /// Renders `indices` through the fused path (see
    /// [`crate::image::fused::render`]) into `out`, one equal slot per image
    /// in order, in parallel on `threads` threads.
    pub fn render_batch(
        &self,
        indices: &[usize],
        geometries: &[Geometry],
        downscale: bool,
        output: Output,
        out: BatchOut<'_>,
        threads: usize,
    ) -> Result<()> {
        if indices.len() != geometries.len() || indices.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "{} indices but {} geometries",
                indices.len(),
                geometries.len()
            )));
        }
        let one = |i: usize, g: &Geometry, slot: OutputSlice<'_>| -> Result<()> {
            let data = self.image_bytes(i)?;
            render(&data, g, downscale, output, slot).map_err(|reason| self.image_error(i, reason))
        };
        let run = || match out {
            BatchOut::Uint8(buf) => {
                for_each_slot(buf, indices, geometries, |s| OutputSlice::Uint8(s), one)
            }
            BatchOut::Float(buf) => {
                for_each_slot(buf, indices, geometries, |s| OutputSlice::Float(s), one)
            }
        };
        pool::pool(threads)?.install(run)
    }

    /// Reads the encoded images of `indices` in parallel.
    pub fn image_bytes_batch(&self, indices: &[usize], threads: usize) -> Result<Vec<Bytes>> {
        map_batch(indices, threads, |i| self.image_bytes(i))
    }
}

/// `f` over `indices`, in order: in the calling thread when `threads` is 1,
/// else in parallel on this process's pool of `threads` threads.
fn map_batch<T: Send>(
    indices: &[usize],
    threads: usize,
    f: impl Fn(usize) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    if threads == 1 {
        return indices.iter().map(|&i| f(i)).collect();
    }
    pool::pool(threads)?.install(|| indices.par_iter().map(|&i| f(i)).collect())
}

/// Splits `buf` into one equal slot per index and renders each in parallel.
fn for_each_slot<T: Send>(
    buf: &mut [T],
    indices: &[usize],
    geometries: &[Geometry],
    slot: for<'a> fn(&'a mut [T]) -> OutputSlice<'a>,
    one: impl Fn(usize, &Geometry, OutputSlice<'_>) -> Result<()> + Sync,
) -> Result<()> {
    let n = indices.len();
    if buf.len() % n != 0 {
        return Err(Error::InvalidArgument(format!(
            "a batch buffer of {} values does not split into {n} equal slots",
            buf.len()
        )));
    }
    buf.par_chunks_mut(buf.len() / n)
        .zip(indices.par_iter().zip(geometries))
        .try_for_each(|(s, (&i, g))| one(i, g, slot(s)))
}

/// A whole batch's output buffer (`N` equal slots).
pub enum BatchOut<'a> {
    Uint8(&'a mut [u8]),
    Float(&'a mut [f32]),
}

/// The default location of a shard list's directory for an index path.
pub fn index_dir(index_path: &Path) -> PathBuf {
    index_path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::testing::encode;
    use crate::tfrecord::example::Feature;
    use crate::tfrecord::writer::ShardedWriter;
    use prost::Message;

    fn png(seed: u8) -> Vec<u8> {
        let img = image::RgbImage::from_fn(5, 4, |x, y| image::Rgb([seed, x as u8, y as u8]));
        encode(&img, image::ImageFormat::Png)
    }

    fn dataset(dir: &Path) -> IndexedDataset {
        let mut w = ShardedWriter::create(dir, "ds", 3).unwrap();
        for i in 0..7u8 {
            let ex = Example::from_features([
                (IMAGE_KEY, Feature::bytes([png(i)])),
                ("image/class/label", Feature::int64([i64::from(i)])),
            ]);
            w.write(&ex.encode_to_vec(), i64::from(i) * 10).unwrap();
        }
        let bad = Example::from_features([(IMAGE_KEY, Feature::bytes([b"\xff\xd8junk".to_vec()]))]);
        w.write(&bad.encode_to_vec(), 99).unwrap();
        let none = Example::from_features([("other", Feature::int64([1]))]);
        w.write(&none.encode_to_vec(), 98).unwrap();
        let index = w.finish().unwrap().index_path;
        IndexedDataset::open(dir, &index).unwrap()
    }

    #[test]
    fn reads_labels_and_images() {
        let dir = tempfile::tempdir().unwrap();
        let ds = dataset(dir.path());
        assert_eq!(ds.len(), 9);
        assert_eq!(&ds.labels()[..3], &[0, 10, 20]);
        let img = ds.decode(4).unwrap();
        assert_eq!((img.width, img.height, img.pixels[0]), (5, 4, 4));
        let batch = ds.decode_batch(&[6, 0, 3], 2).unwrap();
        assert_eq!(
            batch.iter().map(|b| b.pixels[0]).collect::<Vec<_>>(),
            vec![6, 0, 3]
        );
        assert_eq!(ds.decode_batch(&[1], 1).unwrap()[0].pixels[0], 1);
    }

    #[test]
    fn errors_name_shard_offset_and_index() {
        let dir = tempfile::tempdir().unwrap();
        let ds = dataset(dir.path());
        let msg = ds.decode(7).unwrap_err().to_string();
        assert!(msg.contains("ds-00002.tfrecord: record at offset"), "{msg}");
        assert!(
            msg.contains("(dataset index 7): image is not decodable"),
            "{msg}"
        );
        let msg = ds.decode_batch(&[0, 8], 2).unwrap_err().to_string();
        assert!(
            msg.contains("(dataset index 8): no feature \"image/encoded\""),
            "{msg}"
        );
        assert!(matches!(ds.decode(9), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn missing_shard_fails_at_open_with_path() {
        let dir = tempfile::tempdir().unwrap();
        drop(dataset(dir.path()));
        std::fs::remove_file(dir.path().join("ds-00001.tfrecord")).unwrap();
        let err = IndexedDataset::open(dir.path(), &dir.path().join("ds.index"))
            .err()
            .unwrap();
        let msg = err.to_string();
        assert!(
            msg.contains("ds.index:4:") && msg.contains("ds-00001.tfrecord"),
            "{msg}"
        );
    }
}
