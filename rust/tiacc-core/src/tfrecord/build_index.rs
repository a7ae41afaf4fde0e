//! Building a dataset index for shards written by other tools (TensorFlow's
//! ImageNet scripts, for instance), so `IndexedDataset` can read them.

use std::path::{Path, PathBuf};

use bytes::Bytes;
use rayon::prelude::*;

use super::example::Example;
use super::index::IndexEntry;
use super::record::RecordReader;
use crate::error::{Error, Result};

/// What [`build_index`] found.
#[derive(Debug, Clone)]
pub struct BuiltIndex {
    pub entries: Vec<IndexEntry>,
    /// Records without an int64 `label_key` (labelled -1 in the index).
    pub unlabelled: u64,
}

/// Scans `shards` (every CRC verified, every payload parsed) and lists their
/// records in order with the first value of the int64 feature `label_key`.
/// Shard names in the entries are relative to `index_dir`.
pub fn build_index(shards: &[PathBuf], index_dir: &Path, label_key: &str) -> Result<BuiltIndex> {
    let per_shard: Vec<(Vec<IndexEntry>, u64)> = shards
        .par_iter()
        .enumerate()
        .map(|(idx, path)| {
            let shard = u32::try_from(idx)
                .map_err(|_| Error::InvalidArgument("more than 2^32 shards".into()))?;
            let name = relative_name(path, index_dir)?;
            let reader = RecordReader::open(path, true)?;
            let mut scan = reader.scan();
            let mut buf = Vec::new();
            let mut entries = Vec::new();
            let mut unlabelled = 0;
            while let Some(offset) = scan.next_into(&mut buf)? {
                let payload = Bytes::from(std::mem::take(&mut buf));
                let location = format!(" in {} at offset {offset}", path.display());
                let label = Example::parse(payload, &location)?.first_int64(label_key);
                unlabelled += u64::from(label.is_none());
                entries.push(IndexEntry {
                    shard_file: name.clone(),
                    shard,
                    offset,
                    label: label.unwrap_or(-1),
                });
            }
            Ok((entries, unlabelled))
        })
        .collect::<Result<_>>()?;
    let unlabelled = per_shard.iter().map(|(_, u)| u).sum();
    Ok(BuiltIndex {
        entries: per_shard.into_iter().flat_map(|(e, _)| e).collect(),
        unlabelled,
    })
}

/// `path` relative to `dir` when it lies inside it, else the absolute path.
fn relative_name(path: &Path, dir: &Path) -> Result<String> {
    let abs = |p: &Path| std::path::absolute(p).map_err(|e| Error::io(p, e));
    let (path_abs, dir_abs) = (abs(path)?, abs(dir)?);
    let name = path_abs
        .strip_prefix(&dir_abs)
        .map_or_else(|_| path_abs.clone(), Path::to_path_buf);
    let text = name.to_str().ok_or_else(|| {
        Error::InvalidArgument(format!("{}: shard path is not UTF-8", path.display()))
    })?;
    if text.contains(['\t', '\n', '\r']) {
        return Err(Error::InvalidArgument(format!(
            "{}: a shard path with a tab or line break cannot be indexed",
            path.display()
        )));
    }
    Ok(text.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tfrecord::example::Feature;
    use crate::tfrecord::writer::RecordFileWriter;
    use prost::Message;

    #[test]
    fn indexes_foreign_shards() {
        let dir = tempfile::tempdir().unwrap();
        let mut shards = Vec::new();
        for s in 0..2 {
            let path = dir.path().join(format!("train-0000{s}-of-00002"));
            let mut w = RecordFileWriter::create(&path).unwrap();
            for i in 0..3 {
                let mut features = vec![("image/encoded", Feature::bytes([vec![1u8; 10]]))];
                if !(s == 1 && i == 2) {
                    features.push(("image/class/label", Feature::int64([s * 10 + i])));
                }
                w.write(&Example::from_features(features).encode_to_vec())
                    .unwrap();
            }
            w.finish().unwrap();
            shards.push(path);
        }
        let built = build_index(&shards, dir.path(), "image/class/label").unwrap();
        assert_eq!(built.unlabelled, 1);
        let summary: Vec<_> = built
            .entries
            .iter()
            .map(|e| (e.shard_file.as_str(), e.shard, e.label))
            .collect();
        assert_eq!(
            summary,
            [
                ("train-00000-of-00002", 0, 0),
                ("train-00000-of-00002", 0, 1),
                ("train-00000-of-00002", 0, 2),
                ("train-00001-of-00002", 1, 10),
                ("train-00001-of-00002", 1, 11),
                ("train-00001-of-00002", 1, -1),
            ]
        );
        let first = Example::from_features([
            ("image/encoded", Feature::bytes([vec![1u8; 10]])),
            ("image/class/label", Feature::int64([0])),
        ]);
        assert_eq!(built.entries[0].offset, 0);
        assert_eq!(built.entries[1].offset, 16 + first.encoded_len() as u64);
    }
}
