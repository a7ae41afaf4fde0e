//! Index files that give random access into TFRecord shards.
//!
//! * The dataset index (`NAME.index`), one tab-separated line per record:
//!   `shard_file  shard_idx  offset  label`. `shard_file` is the shard's file
//!   name relative to the index's directory, `shard_idx` its number, `offset`
//!   the byte offset of the record's header and `label` the class id (the
//!   image id for COCO; -1 when a record has no label).
//! * DALI's per-shard `.idx`, one line per record: `offset size`, where size
//!   counts the 16 framing bytes.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// One line of a dataset index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexEntry {
    pub shard_file: String,
    pub shard: u32,
    pub offset: u64,
    pub label: i64,
}

impl IndexEntry {
    /// The line as written to the index, with its trailing newline.
    pub fn to_line(&self) -> String {
        format!(
            "{}\t{}\t{}\t{}\n",
            self.shard_file, self.shard, self.offset, self.label
        )
    }

    /// Parses one line (without its newline); the error is the reason only.
    pub fn parse_line(line: &str) -> std::result::Result<Self, String> {
        let cols: Vec<&str> = line.split('\t').collect();
        if cols.len() != 4 {
            return Err(format!(
                "expected 4 tab-separated columns (shard_file, shard_idx, offset, label), found {}: {line:?}",
                cols.len()
            ));
        }
        let shard_file = cols[0].trim();
        if shard_file.is_empty() {
            return Err("empty shard file name".into());
        }
        let number = |what: &str, text: &str| -> std::result::Result<i128, String> {
            text.trim()
                .parse::<i128>()
                .map_err(|_| format!("{what} is not an integer: {text:?}"))
        };
        let shard = u32::try_from(number("shard_idx", cols[1])?)
            .map_err(|_| format!("shard_idx out of range: {:?}", cols[1]))?;
        let offset = u64::try_from(number("offset", cols[2])?)
            .map_err(|_| format!("offset out of range: {:?}", cols[2]))?;
        let label = i64::try_from(number("label", cols[3])?)
            .map_err(|_| format!("label out of range: {:?}", cols[3]))?;
        Ok(IndexEntry {
            shard_file: shard_file.to_string(),
            shard,
            offset,
            label,
        })
    }
}

/// The whole text of an index for `entries`.
pub fn format_index(entries: &[IndexEntry]) -> String {
    let mut out = String::with_capacity(entries.len() * 40);
    for e in entries {
        out.push_str(&e.to_line());
    }
    out
}

/// Reads a dataset index. Blank lines are ignored; any other malformed line
/// is an error naming the file and the 1-based line number.
pub fn read_index(path: &Path) -> Result<Vec<IndexEntry>> {
    Ok(read_index_numbered(path)?
        .into_iter()
        .map(|(_, entry)| entry)
        .collect())
}

/// Like [`read_index`], with the 1-based line number of every entry.
pub fn read_index_numbered(path: &Path) -> Result<Vec<(usize, IndexEntry)>> {
    let text = read_text(path)?;
    let mut entries = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let entry = IndexEntry::parse_line(line).map_err(|reason| Error::BadIndex {
            path: path.to_path_buf(),
            line: i + 1,
            reason,
        })?;
        entries.push((i + 1, entry));
    }
    Ok(entries)
}

/// DALI `.idx` text for records at `(offset, framed_size)`.
pub fn format_dali_idx(records: &[(u64, u64)]) -> String {
    let mut out = String::with_capacity(records.len() * 16);
    for (offset, size) in records {
        let _ = writeln!(out, "{offset} {size}");
    }
    out
}

/// Reads a DALI `.idx` file: `(offset, framed_size)` per line.
pub fn read_dali_idx(path: &Path) -> Result<Vec<(u64, u64)>> {
    let text = read_text(path)?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |reason: String| Error::BadIndex {
            path: path.to_path_buf(),
            line: i + 1,
            reason,
        };
        let cols: Vec<&str> = line.split_whitespace().collect();
        if cols.len() != 2 {
            return Err(bad(format!("expected `offset size`, found {line:?}")));
        }
        let parse = |t: &str| {
            t.parse::<u64>()
                .map_err(|_| bad(format!("not a non-negative integer: {t:?}")))
        };
        out.push((parse(cols[0])?, parse(cols[1])?));
    }
    Ok(out)
}

/// The path of a shard named in an index at `index_path`.
pub fn shard_path(index_dir: &Path, shard_file: &str) -> PathBuf {
    index_dir.join(shard_file)
}

fn read_text(path: &Path) -> Result<String> {
    let bytes = fs::read(path).map_err(|e| Error::io(path, e))?;
    String::from_utf8(bytes).map_err(|e| Error::BadIndex {
        path: path.to_path_buf(),
        line: 1 + e.as_bytes()[..e.utf8_error().valid_up_to()]
            .iter()
            .filter(|&&b| b == b'\n')
            .count(),
        reason: "not valid UTF-8 text".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_roundtrip() {
        let e = IndexEntry {
            shard_file: "train-00003.tfrecord".into(),
            shard: 3,
            offset: 123_456,
            label: -1,
        };
        let line = e.to_line();
        assert_eq!(line, "train-00003.tfrecord\t3\t123456\t-1\n");
        assert_eq!(IndexEntry::parse_line(line.trim_end()).unwrap(), e);
    }

    #[test]
    fn malformed_lines_name_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.index");
        fs::write(&p, "a\t0\t0\t1\n\na\t0\tzero\t1\n").unwrap();
        let err = read_index(&p).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("x.index:3:"), "{msg}");
        assert!(msg.contains("offset is not an integer"), "{msg}");

        for bad in ["a\t0\t0", "a\t-1\t0\t0", "a\t0\t-5\t0", "\t0\t0\t0"] {
            assert!(IndexEntry::parse_line(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn dali_idx_roundtrip() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.idx");
        fs::write(&p, format_dali_idx(&[(0, 20), (20, 116)])).unwrap();
        assert_eq!(read_dali_idx(&p).unwrap(), vec![(0, 20), (20, 116)]);
        fs::write(&p, "0 20\n20\n").unwrap();
        assert!(read_dali_idx(&p)
            .unwrap_err()
            .to_string()
            .contains("s.idx:2:"));
    }
}
