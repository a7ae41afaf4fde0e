//! A packed dataset: an index plus its shards, read by record number.
//!
//! The index (`NAME.index`, see [`crate::tfrecord::index`]) is loaded once;
//! each shard it names is opened once, at construction, so that a missing
//! shard fails early with its path. Reads are positional (`pread`), so one
//! dataset serves any number of threads, and CRCs are verified. A shard
//! that changes on disk after it was opened (rewritten, truncated, deleted,
//! replaced) fails every later read of it with [`Error::FileChanged`]
//! naming the shard and the offset.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::image::decode::{decode_rgb, RgbImage};
use crate::image::fused::{render, Geometry, Output, OutputSlice};
use crate::image::probe::probe_image;
use crate::image::sampling::{sample_reproduced, Sampler, TorchCpuRng};
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
    /// Unique per opened dataset (see [`EncodedImages`]).
    id: u64,
}

/// The next [`IndexedDataset`]'s id.
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

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
                        Error::Io { source, .. } => Error::MissingShard {
                            index: index_path.to_path_buf(),
                            line,
                            shard: path.clone(),
                            kind: source.kind(),
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
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
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
        // A record error rather than a bare MalformedExample, so that the
        // error carries the shard, offset and index as fields.
        Example::parse(payload, "").map_err(|e| match e {
            Error::MalformedExample { reason, .. } => Error::RecordFeature {
                path: path.to_path_buf(),
                offset,
                index,
                reason: format!("malformed tf.train.Example: {reason}"),
            },
            other => other,
        })
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
            self.image_size(i, &self.image_bytes(i)?)
        })
    }

    /// `(width, height)` of record `index`'s image `data`, from its header.
    fn image_size(&self, index: usize, data: &[u8]) -> Result<(u32, u32)> {
        let info = probe_image(data, Path::new("")).map_err(|e| match e {
            Error::BadImage { reason, .. } => self.image_error(index, reason),
            other => other,
        })?;
        Ok((info.width, info.height))
    }

    /// Reads the encoded images of `indices` and their sizes (from the
    /// headers) in parallel, for [`Self::render_images`]: the fused path
    /// needs the sizes to draw each image's parameters, then the bytes, and
    /// this way reads each record once.
    pub fn read_images(&self, indices: &[usize], threads: usize) -> Result<EncodedImages> {
        let read = map_batch(indices, threads, |i| {
            let data = self.image_bytes(i)?;
            let size = self.image_size(i, &data)?;
            Ok((data, size))
        })?;
        let (data, sizes) = read.into_iter().unzip();
        Ok(EncodedImages {
            dataset: self.id,
            indices: indices.to_vec(),
            data,
            sizes,
        })
    }

    /// Renders `indices` through the fused path (see
    /// [`crate::image::fused::render`]) as `how` says into `out`, one equal
    /// slot per image in order, in parallel on `threads` threads.
    pub fn render_batch(
        &self,
        indices: &[usize],
        how: &Rendering<'_>,
        out: BatchOut<'_>,
        threads: usize,
    ) -> Result<()> {
        let job = RenderJob { indices, how };
        self.render(&job, out, threads, |k| self.image_bytes(indices[k]))
    }

    /// [`Self::render_batch`] of images read by [`Self::read_images`] (of
    /// this dataset), without reading them again.
    pub fn render_images(
        &self,
        images: &EncodedImages,
        how: &Rendering<'_>,
        out: BatchOut<'_>,
        threads: usize,
    ) -> Result<()> {
        if images.dataset != self.id {
            return Err(Error::InvalidArgument(
                "these images were read from another dataset".into(),
            ));
        }
        let job = RenderJob {
            indices: &images.indices,
            how,
        };
        self.render(&job, out, threads, |k| Ok(images.data[k].clone()))
    }

    /// Renders image `k` of `job` (its bytes from `data(k)`) into slot `k`
    /// of `out`, in parallel (in this thread when `threads` is 1).
    fn render(
        &self,
        job: &RenderJob<'_>,
        out: BatchOut<'_>,
        threads: usize,
        data: impl Fn(usize) -> Result<Bytes> + Sync,
    ) -> Result<()> {
        let (n, how) = (job.indices.len(), job.how);
        if n != how.geometries.len() || n == 0 {
            return Err(Error::InvalidArgument(format!(
                "{n} indices but {} geometries",
                how.geometries.len()
            )));
        }
        let one = |k: usize, slot: OutputSlice<'_>| -> Result<()> {
            let i = job.indices[k];
            render(
                &data(k)?,
                &how.geometries[k],
                how.downscale,
                how.output,
                slot,
            )
            .map_err(|reason| self.image_error(i, reason))
        };
        let run = || match out {
            BatchOut::Uint8(buf) => {
                pool::advise_huge_pages(buf);
                for_each_slot(buf, n, threads, |s| OutputSlice::Uint8(s), one)
            }
            BatchOut::Float(buf) => {
                pool::advise_huge_pages(buf);
                for_each_slot(buf, n, threads, |s| OutputSlice::Float(s), one)
            }
        };
        if threads == 1 {
            return run();
        }
        pool::pool(threads)?.install(run)
    }

    /// A whole batch in one call: reads `indices`, draws each image's
    /// geometry with `sampler` from `rng` (a reproduction of torch's CPU
    /// generator, left where torch's own draws would have left it) and
    /// renders them into `out` (of [`sampled_batch_shape`]) as
    /// [`Self::render_images`] does. An image the reproduction cannot decide
    /// is drawn by `from_torch(width, height, before)` (the generator's
    /// state before its draws), which returns its geometry and the
    /// generator after them.
    #[allow(clippy::too_many_arguments)]
    pub fn load_batch(
        &self,
        indices: &[usize],
        sampler: &Sampler,
        rng: &mut TorchCpuRng,
        mut from_torch: impl FnMut(u32, u32, &TorchCpuRng) -> Result<(Geometry, TorchCpuRng)>,
        downscale: bool,
        output: Output,
        out: BatchOut<'_>,
        threads: usize,
    ) -> Result<()> {
        let images = self.read_images(indices, threads)?;
        let geometries = sample_reproduced(sampler, images.sizes(), rng, |k, before| {
            let (width, height) = images.sizes()[k];
            from_torch(width, height, before)
        })?;
        let how = Rendering {
            geometries: &geometries,
            downscale,
            output,
        };
        self.render_images(&images, &how, out, threads)
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

/// Splits `buf` into `n` equal slots and renders slot `k` with `one(k, _)`,
/// in parallel unless `threads` is 1.
fn for_each_slot<T: Send>(
    buf: &mut [T],
    n: usize,
    threads: usize,
    slot: for<'a> fn(&'a mut [T]) -> OutputSlice<'a>,
    one: impl Fn(usize, OutputSlice<'_>) -> Result<()> + Sync,
) -> Result<()> {
    if buf.len() % n != 0 {
        return Err(Error::InvalidArgument(format!(
            "a batch buffer of {} values does not split into {n} equal slots",
            buf.len()
        )));
    }
    let size = buf.len() / n;
    if threads == 1 || size == 0 {
        return (0..n).try_for_each(|k| one(k, slot(&mut buf[k * size..(k + 1) * size])));
    }
    buf.par_chunks_mut(size)
        .enumerate()
        .try_for_each(|(k, s)| one(k, slot(s)))
}

/// How a batch's images are rendered ([`IndexedDataset::render_batch`]):
/// image `k` through `geometries[k]`.
#[derive(Debug, Clone, Copy)]
pub struct Rendering<'a> {
    /// Each image's crop, resize, window and flip.
    pub geometries: &'a [Geometry],
    /// JPEGs may be decoded at a reduced scale where the crop allows.
    pub downscale: bool,
    /// The output's type (and normalisation).
    pub output: Output,
}

/// The shape `(N, 3, H, W)` of a batch rendered through `geometries`: at
/// least one, every one with the same window.
pub fn batch_shape(geometries: &[Geometry]) -> Result<[usize; 4]> {
    let (_, _, ww, wh) = geometries
        .first()
        .map(|g| g.window)
        .ok_or_else(|| Error::InvalidArgument("render_batch needs at least one index".into()))?;
    if geometries
        .iter()
        .any(|g| (g.window.2, g.window.3) != (ww, wh))
    {
        return Err(Error::InvalidArgument(
            "every geometry must output the same window size".into(),
        ));
    }
    Ok([geometries.len(), 3, wh as usize, ww as usize])
}

/// The shape `(N, 3, H, W)` of a batch of `n` images placed by `sampler`
/// ([`IndexedDataset::load_batch`]): its output size must not vary, and
/// `n` must be at least one.
pub fn sampled_batch_shape(sampler: &Sampler, n: usize) -> Result<[usize; 4]> {
    let (h, w) = sampler.output_size().ok_or_else(|| {
        Error::InvalidArgument(
            "this sampler's output size differs per image: it cannot batch".into(),
        )
    })?;
    if n == 0 {
        return Err(Error::InvalidArgument(
            "load_batch needs at least one index".into(),
        ));
    }
    Ok([n, 3, h as usize, w as usize])
}

/// What [`IndexedDataset::render`] renders: image `k` is record
/// `indices[k]`, rendered as `how` says.
struct RenderJob<'a> {
    indices: &'a [usize],
    how: &'a Rendering<'a>,
}

/// Encoded images read by [`IndexedDataset::read_images`], with their sizes.
pub struct EncodedImages {
    /// The id of the dataset that read them.
    dataset: u64,
    indices: Vec<usize>,
    data: Vec<Bytes>,
    sizes: Vec<(u32, u32)>,
}

impl EncodedImages {
    /// The record numbers, in order.
    pub fn indices(&self) -> &[usize] {
        &self.indices
    }

    /// `(width, height)` of each image, in order.
    pub fn sizes(&self) -> &[(u32, u32)] {
        &self.sizes
    }

    /// The encoded bytes of each image, in order.
    pub fn data(&self) -> &[Bytes] {
        &self.data
    }

    /// Every image's bytes one after another, the offsets where each
    /// starts (and the end: one more than the images), and whether each is
    /// a JPEG: what a device decoder takes as slices.
    pub fn packed(&self) -> (Vec<u8>, Vec<usize>, Vec<bool>) {
        let mut offsets = Vec::with_capacity(self.data.len() + 1);
        let mut bytes = Vec::with_capacity(self.data.iter().map(|d| d.len()).sum());
        for d in &self.data {
            offsets.push(bytes.len());
            bytes.extend_from_slice(d);
        }
        offsets.push(bytes.len());
        let jpeg = self
            .data
            .iter()
            .map(|d| d.starts_with(b"\xff\xd8\xff"))
            .collect();
        (bytes, offsets, jpeg)
    }

    /// The images at positions `positions`, in that order (no copy of the
    /// bytes).
    pub fn select(&self, positions: &[usize]) -> Result<EncodedImages> {
        let n = self.indices.len();
        if let Some(&bad) = positions.iter().find(|&&k| k >= n) {
            return Err(Error::InvalidArgument(format!(
                "position {bad} is out of range for {n} images"
            )));
        }
        Ok(EncodedImages {
            dataset: self.dataset,
            indices: positions.iter().map(|&k| self.indices[k]).collect(),
            data: positions.iter().map(|&k| self.data[k].clone()).collect(),
            sizes: positions.iter().map(|&k| self.sizes[k]).collect(),
        })
    }
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
    fn payload_that_is_not_an_example_names_shard_offset_and_index() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = ShardedWriter::create(dir.path(), "ds", 2).unwrap();
        w.write(
            &Example::from_features([(IMAGE_KEY, Feature::bytes([png(1)]))]).encode_to_vec(),
            0,
        )
        .unwrap();
        // A length-delimited field whose length runs past the payload.
        w.write(b"\x0a\xff\x01oops", 1).unwrap();
        let index = w.finish().unwrap().index_path;
        let ds = IndexedDataset::open(dir.path(), &index).unwrap();
        match ds.decode(1).unwrap_err() {
            Error::RecordFeature {
                path,
                offset,
                index,
                reason,
            } => {
                assert!(path.ends_with("ds-00000.tfrecord"), "{path:?}");
                assert_eq!((offset, index), (ds.location(1).unwrap().1, 1));
                assert!(reason.starts_with("malformed tf.train.Example"), "{reason}");
            }
            other => panic!("expected RecordFeature, got {other:?}"),
        }
        assert_eq!(ds.decode(0).unwrap().pixels[0], 1);
    }

    #[test]
    fn missing_shard_fails_at_open_with_path() {
        let dir = tempfile::tempdir().unwrap();
        drop(dataset(dir.path()));
        std::fs::remove_file(dir.path().join("ds-00001.tfrecord")).unwrap();
        let err = IndexedDataset::open(dir.path(), &dir.path().join("ds.index"))
            .err()
            .unwrap();
        assert_eq!(err.io_kind(), Some(std::io::ErrorKind::NotFound));
        let msg = err.to_string();
        assert!(
            msg.contains("ds.index:4:") && msg.contains("ds-00001.tfrecord"),
            "{msg}"
        );
    }

    #[test]
    fn images_read_once_render_like_a_batch() {
        let dir = tempfile::tempdir().unwrap();
        let ds = dataset(dir.path());
        let indices = [3, 0, 6];
        let images = ds.read_images(&indices, 2).unwrap();
        assert_eq!(images.indices(), &indices);
        assert_eq!(images.sizes(), &[(5, 4); 3]);
        assert_eq!(ds.image_sizes(&indices, 1).unwrap(), images.sizes());
        let g = Geometry {
            crop: (1, 0, 4, 4),
            resize: (3, 2),
            window: (0, 0, 3, 2),
            flip: true,
        };
        let geometries = [g; 3];
        let how = Rendering {
            geometries: &geometries,
            downscale: true,
            output: Output::Uint8,
        };
        for threads in [1, 2] {
            let mut a = vec![0u8; 3 * 18];
            let mut b = vec![1u8; 3 * 18];
            ds.render_batch(&indices, &how, BatchOut::Uint8(&mut a), threads)
                .unwrap();
            ds.render_images(&images, &how, BatchOut::Uint8(&mut b), threads)
                .unwrap();
            assert_eq!(a, b);
            assert_eq!(a[36], 6); // red of image 6 (its seed)
        }
        let other = IndexedDataset::open(dir.path(), &dir.path().join("ds.index")).unwrap();
        let mut buf = vec![0u8; 3 * 18];
        let err = other
            .render_images(&images, &how, BatchOut::Uint8(&mut buf), 1)
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        let msg = ds.read_images(&[0, 7], 1).err().unwrap().to_string();
        assert!(msg.contains("(dataset index 7)"), "{msg}");
    }

    #[test]
    fn a_batch_is_shaped_by_one_window_and_needs_an_image() {
        let at = |w, h| Geometry {
            crop: (0, 0, 8, 8),
            resize: (8, 8),
            window: (0, 0, w, h),
            flip: false,
        };
        assert_eq!(batch_shape(&[at(4, 3), at(4, 3)]).unwrap(), [2, 3, 3, 4]);
        let message = |r: Result<[usize; 4]>| r.unwrap_err().to_string();
        assert_eq!(
            message(batch_shape(&[at(4, 3), at(3, 4)])),
            "every geometry must output the same window size"
        );
        assert_eq!(
            message(batch_shape(&[])),
            "render_batch needs at least one index"
        );
    }
}
