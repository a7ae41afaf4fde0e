//! Whole-file checks used by the verify tool: every CRC of a shard, every
//! line of an index against the record boundaries of its shards.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use rayon::prelude::*;

use super::example::Example;
use super::index::{read_dali_idx, read_index_numbered, shard_path};
use super::record::RecordReader;
use crate::error::{Error, Result};

/// What a verified shard holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardReport {
    pub records: u64,
    pub bytes: u64,
}

/// Reads every record of `path`, checking both CRCs of each and, with
/// `check_examples`, that each payload parses as a `tf.train.Example`.
/// Returns the record offsets with the report.
pub fn scan_shard(path: &Path, check_examples: bool) -> Result<(ShardReport, Vec<u64>)> {
    let reader = RecordReader::open(path, true)?;
    let mut scan = reader.scan();
    let mut buf = Vec::new();
    let mut offsets = Vec::new();
    while let Some(at) = scan.next_into(&mut buf)? {
        if check_examples {
            let payload = Bytes::from(std::mem::take(&mut buf));
            Example::parse(
                payload.clone(),
                &format!(" in {} at offset {at}", path.display()),
            )?;
            // Take the allocation back for the next record when nothing else holds it.
            buf = Vec::from(payload);
        }
        offsets.push(at);
    }
    Ok((
        ShardReport {
            records: offsets.len() as u64,
            bytes: reader.size(),
        },
        offsets,
    ))
}

/// Verifies one shard (see [`scan_shard`]) and the DALI `.idx` beside it,
/// if there is one.
pub fn verify_shard(path: &Path, check_examples: bool) -> Result<ShardReport> {
    let (report, offsets) = scan_shard(path, check_examples)?;
    check_dali_idx(path, &offsets)?;
    Ok(report)
}

/// What a verified dataset index covers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IndexReport {
    pub entries: u64,
    pub shards: u64,
    pub records: u64,
    pub bytes: u64,
}

/// Checks that every index line names an existing shard and points at the
/// first byte of one of its records, and verifies every record of every shard
/// the index names (in parallel over shards). Also checks a DALI `.idx`
/// beside each shard when there is one.
pub fn verify_index(index_path: &Path, check_examples: bool) -> Result<IndexReport> {
    verify_index_with_progress(index_path, check_examples, &|_| {})
}

/// [`verify_index`], calling `on_shard(bytes)` each time a shard is verified
/// (from the worker threads, in no particular order), for progress bars.
pub fn verify_index_with_progress(
    index_path: &Path,
    check_examples: bool,
    on_shard: &(dyn Fn(u64) + Sync),
) -> Result<IndexReport> {
    let entries = read_index_numbered(index_path)?;
    let dir = index_path.parent().unwrap_or(Path::new("."));
    // (line number, offset) of the entries of each shard.
    let mut by_shard: BTreeMap<&str, Vec<(usize, u64)>> = BTreeMap::new();
    for (line, entry) in &entries {
        by_shard
            .entry(entry.shard_file.as_str())
            .or_default()
            .push((*line, entry.offset));
    }
    let reports: Vec<ShardReport> = by_shard
        .par_iter()
        .map(|(shard_file, refs)| {
            let path = shard_path(dir, shard_file);
            let (report, offsets) = scan_shard(&path, check_examples).map_err(|e| match e {
                Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                    Error::MissingShard {
                        index: index_path.to_path_buf(),
                        line: refs[0].0,
                        shard: path.clone(),
                        kind: source.kind(),
                        reason: format!("shard {} does not exist", path.display()),
                    }
                }
                other => other,
            })?;
            for &(line, offset) in refs {
                check_boundary(&offsets, offset, report.bytes).map_err(|why| Error::BadIndex {
                    path: index_path.to_path_buf(),
                    line,
                    reason: format!("offset {offset} in {}: {why}", path.display()),
                })?;
            }
            check_dali_idx(&path, &offsets)?;
            on_shard(report.bytes);
            Ok(report)
        })
        .collect::<Result<_>>()?;
    Ok(IndexReport {
        entries: entries.len() as u64,
        shards: reports.len() as u64,
        records: reports.iter().map(|r| r.records).sum(),
        bytes: reports.iter().map(|r| r.bytes).sum(),
    })
}

fn check_boundary(offsets: &[u64], offset: u64, file_len: u64) -> std::result::Result<(), String> {
    if offset >= file_len {
        return Err(format!("past the end of the shard ({file_len} bytes)"));
    }
    match offsets.binary_search(&offset) {
        Ok(_) => Ok(()),
        Err(i) => Err(format!(
            "not a record boundary (the record before it starts at {})",
            offsets[i.saturating_sub(1)]
        )),
    }
}

/// The DALI index beside a shard, if any, must list exactly its records.
fn check_dali_idx(shard: &Path, offsets: &[u64]) -> Result<()> {
    let mut idx = shard.as_os_str().to_owned();
    idx.push(".idx");
    let idx = PathBuf::from(idx);
    if !idx.exists() {
        return Ok(());
    }
    let lines = read_dali_idx(&idx)?;
    let file_len = std::fs::metadata(shard)
        .map_err(|e| Error::io(shard, e))?
        .len();
    for (i, (offset, size)) in lines.iter().enumerate() {
        let end = offsets.get(i + 1).copied().unwrap_or(file_len);
        if offsets.get(i) != Some(offset) || end.checked_sub(*offset) != Some(*size) {
            return Err(Error::BadIndex {
                path: idx,
                line: i + 1,
                reason: format!(
                    "`{offset} {size}` does not match record {i} of {} ({})",
                    shard.display(),
                    match offsets.get(i) {
                        Some(o) => format!("offset {o}, size {}", end - o),
                        None => "the shard has fewer records".into(),
                    }
                ),
            });
        }
    }
    if lines.len() != offsets.len() {
        return Err(Error::BadIndex {
            path: idx,
            line: lines.len() + 1,
            reason: format!(
                "lists {} records but {} holds {}",
                lines.len(),
                shard.display(),
                offsets.len()
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tfrecord::example::Feature;
    use crate::tfrecord::writer::ShardedWriter;
    use prost::Message;
    use std::fs;

    fn dataset(dir: &Path) -> PathBuf {
        let mut w = ShardedWriter::create(dir, "ds", 3).unwrap();
        for i in 0..7 {
            let ex = Example::from_features([("label", Feature::int64([i]))]);
            w.write(&ex.encode_to_vec(), i).unwrap();
        }
        w.finish().unwrap().index_path
    }

    #[test]
    fn good_dataset_verifies() {
        let dir = tempfile::tempdir().unwrap();
        let report = verify_index(&dataset(dir.path()), true).unwrap();
        assert_eq!((report.entries, report.shards, report.records), (7, 3, 7));
    }

    #[test]
    fn index_offset_inside_a_record_is_reported_with_its_line() {
        let dir = tempfile::tempdir().unwrap();
        let index = dataset(dir.path());
        let text = fs::read_to_string(&index).unwrap();
        let bad = text.replacen(
            "ds-00000.tfrecord\t0\t0\t0",
            "ds-00000.tfrecord\t0\t5\t0",
            1,
        );
        fs::write(&index, bad).unwrap();
        let msg = verify_index(&index, false).unwrap_err().to_string();
        assert!(
            msg.contains("ds.index:1:") && msg.contains("not a record boundary"),
            "{msg}"
        );
    }

    #[test]
    fn index_offset_past_end() {
        let dir = tempfile::tempdir().unwrap();
        let index = dataset(dir.path());
        let mut text = fs::read_to_string(&index).unwrap();
        text.push_str("ds-00001.tfrecord\t1\t99999\t0\n");
        fs::write(&index, text).unwrap();
        let msg = verify_index(&index, false).unwrap_err().to_string();
        assert!(
            msg.contains("ds.index:8:") && msg.contains("past the end"),
            "{msg}"
        );
    }

    #[test]
    fn progress_counts_every_shard_once() {
        let dir = tempfile::tempdir().unwrap();
        let index = dataset(dir.path());
        let seen = std::sync::Mutex::new(Vec::new());
        let report =
            verify_index_with_progress(&index, true, &|bytes| seen.lock().unwrap().push(bytes))
                .unwrap();
        let seen = seen.into_inner().unwrap();
        assert_eq!(seen.len() as u64, report.shards);
        assert_eq!(seen.iter().sum::<u64>(), report.bytes);
    }

    #[test]
    fn missing_shard_names_the_index_line() {
        let dir = tempfile::tempdir().unwrap();
        let index = dataset(dir.path());
        fs::remove_file(dir.path().join("ds-00002.tfrecord")).unwrap();
        let err = verify_index(&index, false).unwrap_err();
        assert_eq!(err.io_kind(), Some(std::io::ErrorKind::NotFound));
        let msg = err.to_string();
        assert!(
            msg.contains("ds.index:7:") && msg.contains("does not exist"),
            "{msg}"
        );
    }

    #[test]
    fn malformed_example_is_caught_only_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.tfrecord");
        let mut w = crate::tfrecord::writer::RecordFileWriter::create(&path).unwrap();
        w.write(&[0x0a, 0x05, 0x01]).unwrap();
        w.finish().unwrap();
        assert!(verify_shard(&path, false).is_ok());
        let msg = verify_shard(&path, true).unwrap_err().to_string();
        assert!(msg.contains("x.tfrecord at offset 0"), "{msg}");
    }

    #[test]
    fn wrong_dali_idx_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let index = dataset(dir.path());
        fs::write(dir.path().join("ds-00001.tfrecord.idx"), "0 17\n").unwrap();
        let msg = verify_index(&index, false).unwrap_err().to_string();
        assert!(msg.contains("ds-00001.tfrecord.idx:1:"), "{msg}");
    }
}
