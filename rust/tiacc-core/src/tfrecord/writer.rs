//! Writers that never leave a file that looks complete but is not.
//!
//! * [`RecordFileWriter`] writes one TFRecord file under a temporary name and
//!   renames it into place after an fsync.
//! * [`ShardedWriter`] writes a whole dataset (shards, their DALI `.idx`
//!   files and the dataset index) into a hidden staging directory beside the
//!   output, then publishes it: the old index is removed first, shards are
//!   renamed into place, and the new index is renamed last. The index is the
//!   completion marker: a dataset without one is incomplete. A staging
//!   directory left by a killed run is removed by the next run.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use super::index::{format_dali_idx, format_index, IndexEntry};
use super::record::write_record;
use crate::error::{Error, Result};

/// Write buffer per open file. Payloads at least this large bypass it and go
/// to the kernel straight from the caller's buffer (one copy fewer), small
/// ones are gathered into writes of this size.
const WRITE_BUFFER: usize = 64 << 10;

/// Bytes written between two requests to start write-back.
const WRITEBACK_STEP: u64 = 8 << 20;

/// Asks the kernel to start writing `len` bytes at `offset` of `file` to disk
/// without waiting, so that the fsync at the end of a shard only waits for
/// the tail instead of the whole shard. Best effort: a failure here only
/// means the fsync does all the work.
#[cfg(target_os = "linux")]
fn start_writeback(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return;
    };
    // SAFETY: sync_file_range only reads its integer arguments; the fd is
    // valid for the lifetime of `file`, which outlives the call.
    unsafe {
        libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE);
    }
}

#[cfg(not(target_os = "linux"))]
fn start_writeback(_file: &File, _offset: u64, _len: u64) {}

/// An open TFRecord file being appended to.
struct OpenFile {
    path: PathBuf,
    out: BufWriter<File>,
    offset: u64,
    /// Everything before this offset has been handed to write-back.
    writeback_from: u64,
    records: Vec<(u64, u64)>,
}

impl OpenFile {
    fn create(path: PathBuf) -> Result<Self> {
        let file = File::create(&path).map_err(|e| Error::io(&path, e))?;
        Ok(OpenFile {
            path,
            out: BufWriter::with_capacity(WRITE_BUFFER, file),
            offset: 0,
            writeback_from: 0,
            records: Vec::new(),
        })
    }

    fn append(&mut self, payload: &[u8]) -> Result<u64> {
        let at = self.offset;
        let written = write_record(&mut self.out, payload).map_err(|e| Error::io(&self.path, e))?;
        self.offset += written;
        self.records.push((at, written));
        // Bytes still in the BufWriter are not in the kernel yet; they are at
        // most WRITE_BUFFER and go out with the next step.
        let in_kernel = self.offset - self.out.buffer().len() as u64;
        if in_kernel - self.writeback_from >= WRITEBACK_STEP {
            start_writeback(
                self.out.get_ref(),
                self.writeback_from,
                in_kernel - self.writeback_from,
            );
            self.writeback_from = in_kernel;
        }
        Ok(at)
    }

    /// Flushes; the file is not fsynced yet.
    fn flush(self) -> Result<FlushedFile> {
        let OpenFile {
            path, out, records, ..
        } = self;
        let file = out
            .into_inner()
            .map_err(|e| Error::io(&path, e.into_error()))?;
        Ok(FlushedFile {
            file,
            path,
            records,
        })
    }

    /// Flushes and fsyncs; returns the path and the `(offset, size)` list.
    fn close(self) -> Result<(PathBuf, Vec<(u64, u64)>)> {
        let FlushedFile {
            file,
            path,
            records,
        } = self.flush()?;
        file.sync_all().map_err(|e| Error::io(&path, e))?;
        Ok((path, records))
    }
}

/// A written file whose data may still be only in the page cache.
struct FlushedFile {
    file: File,
    path: PathBuf,
    /// `(offset, framed size)` of every record.
    records: Vec<(u64, u64)>,
}

fn write_synced(path: &Path, text: &str) -> Result<()> {
    let mut f = File::create(path).map_err(|e| Error::io(path, e))?;
    f.write_all(text.as_bytes())
        .and_then(|_| f.sync_all())
        .map_err(|e| Error::io(path, e))
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, e))
}

fn rename(from: &Path, to: &Path) -> Result<()> {
    fs::rename(from, to).map_err(|e| Error::io(to, e))
}

fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Writes a single TFRecord file atomically: nothing appears at `path` until
/// [`finish`](Self::finish) succeeds.
pub struct RecordFileWriter {
    target: PathBuf,
    file: Option<OpenFile>,
}

impl RecordFileWriter {
    /// Starts writing; the data goes to a hidden temporary file beside `path`.
    pub fn create(path: impl Into<PathBuf>) -> Result<Self> {
        let target: PathBuf = path.into();
        let file_name = target
            .file_name()
            .ok_or_else(|| {
                Error::InvalidArgument(format!("{}: not a file path", target.display()))
            })?
            .to_string_lossy()
            .into_owned();
        let tmp = parent_dir(&target).join(format!(".{file_name}.tmp-{}", std::process::id()));
        Ok(RecordFileWriter {
            file: Some(OpenFile::create(tmp)?),
            target,
        })
    }

    fn open(&mut self) -> Result<&mut OpenFile> {
        self.file.as_mut().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{}: writer is already closed",
                self.target.display()
            ))
        })
    }

    /// Appends one record; returns its offset.
    pub fn write(&mut self, payload: &[u8]) -> Result<u64> {
        self.open()?.append(payload)
    }

    /// Bytes written so far.
    pub fn offset(&self) -> u64 {
        self.file.as_ref().map_or(0, |f| f.offset)
    }

    /// Fsyncs and renames the file into place; returns `(offset, size)` of
    /// every record.
    pub fn finish(&mut self) -> Result<Vec<(u64, u64)>> {
        let file = self.file.take().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{}: writer is already closed",
                self.target.display()
            ))
        })?;
        let (tmp, records) = file.close()?;
        rename(&tmp, &self.target)?;
        sync_dir(&parent_dir(&self.target))?;
        Ok(records)
    }

    /// Discards everything written; no file appears at the target.
    pub fn abort(&mut self) {
        if let Some(file) = self.file.take() {
            let path = file.path.clone();
            drop(file);
            let _ = fs::remove_file(path);
        }
    }

    /// Whether the writer is still open.
    pub fn is_open(&self) -> bool {
        self.file.is_some()
    }
}

impl Drop for RecordFileWriter {
    fn drop(&mut self) {
        self.abort();
    }
}

/// Where a record went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordLocation {
    pub shard: u32,
    pub offset: u64,
}

/// What a finished [`ShardedWriter`] produced.
#[derive(Debug, Clone)]
pub struct DatasetSummary {
    pub out_dir: PathBuf,
    pub index_path: PathBuf,
    pub shard_files: Vec<String>,
    pub records: u64,
    /// Total bytes of all shards.
    pub bytes: u64,
}

/// The file name of shard `idx` of dataset `name`.
pub fn shard_file_name(name: &str, idx: u32) -> String {
    format!("{name}-{idx:05}.tfrecord")
}

/// The DALI index file name for a shard file name.
pub fn dali_idx_name(shard_file: &str) -> String {
    format!("{shard_file}.idx")
}

/// The dataset index file name of dataset `name`.
pub fn index_file_name(name: &str) -> String {
    format!("{name}.index")
}

const STAGING_TAG: &str = ".partial-";

fn staging_prefix(name: &str) -> String {
    format!(".{name}{STAGING_TAG}")
}

/// Checks that a dataset name can be used in file names and index lines.
pub fn validate_dataset_name(name: &str) -> Result<()> {
    let bad = name.is_empty()
        || name.starts_with('.')
        || name
            .chars()
            .any(|c| c == '/' || c == '\\' || c.is_control());
    if bad {
        return Err(Error::InvalidArgument(format!(
            "dataset name {name:?} must be non-empty, not start with '.', and contain no path separators or control characters"
        )));
    }
    Ok(())
}

/// Removes staging directories of `name` in `out_dir` left by processes that
/// no longer run. A staging directory of a live process is an error: two
/// writers must not produce the same dataset at once.
fn clear_stale_staging(out_dir: &Path, name: &str) -> Result<()> {
    let prefix = staging_prefix(name);
    let entries = fs::read_dir(out_dir).map_err(|e| Error::io(out_dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(out_dir, e))?;
        let file_name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = file_name.strip_prefix(&prefix) else {
            continue;
        };
        let alive = pid.parse::<u32>().is_ok_and(|pid| {
            pid != std::process::id() && Path::new(&format!("/proc/{pid}")).exists()
        });
        if alive {
            return Err(Error::InvalidArgument(format!(
                "{}: another process (pid {pid}) is writing dataset {name:?} here; wait for it or stop it",
                entry.path().display()
            )));
        }
        fs::remove_dir_all(entry.path()).map_err(|e| Error::io(entry.path(), e))?;
    }
    Ok(())
}

/// Writes a dataset as fixed-size shards plus indexes, published atomically
/// by [`finish`](Self::finish).
pub struct ShardedWriter {
    out_dir: PathBuf,
    name: String,
    records_per_shard: u64,
    staging: PathBuf,
    current: Option<(u32, OpenFile)>,
    closed_shards: Vec<String>,
    /// The fsync of the last closed shard (and the write of its `.idx`), run
    /// in the background while the next shard is written.
    syncing: Option<JoinHandle<Result<()>>>,
    entries: Vec<IndexEntry>,
    bytes: u64,
    done: bool,
}

impl ShardedWriter {
    /// Prepares to write dataset `name` into `out_dir` (created if needed).
    pub fn create(out_dir: impl Into<PathBuf>, name: &str, records_per_shard: u64) -> Result<Self> {
        let out_dir = out_dir.into();
        validate_dataset_name(name)?;
        if records_per_shard == 0 {
            return Err(Error::InvalidArgument(
                "records_per_shard must be at least 1".into(),
            ));
        }
        fs::create_dir_all(&out_dir).map_err(|e| Error::io(&out_dir, e))?;
        clear_stale_staging(&out_dir, name)?;
        let staging = out_dir.join(format!("{}{}", staging_prefix(name), std::process::id()));
        fs::create_dir(&staging).map_err(|e| Error::io(&staging, e))?;
        Ok(ShardedWriter {
            out_dir,
            name: name.to_string(),
            records_per_shard,
            staging,
            current: None,
            closed_shards: Vec::new(),
            syncing: None,
            entries: Vec::new(),
            bytes: 0,
            done: false,
        })
    }

    /// Records written so far.
    pub fn records(&self) -> u64 {
        self.entries.len() as u64
    }

    /// Appends a record with its label; returns where it went.
    pub fn write(&mut self, payload: &[u8], label: i64) -> Result<RecordLocation> {
        if self.done {
            return Err(Error::InvalidArgument(format!(
                "dataset {:?} is already finished",
                self.name
            )));
        }
        let shard = u32::try_from(self.records() / self.records_per_shard)
            .map_err(|_| Error::InvalidArgument("too many shards (more than 2^32)".into()))?;
        if self.current.as_ref().is_some_and(|(idx, _)| *idx != shard) {
            self.close_current()?;
        }
        if self.current.is_none() {
            let path = self.staging.join(shard_file_name(&self.name, shard));
            self.current = Some((shard, OpenFile::create(path)?));
        }
        let (_, file) = self.current.as_mut().expect("opened above");
        let offset = file.append(payload)?;
        self.entries.push(IndexEntry {
            shard_file: shard_file_name(&self.name, shard),
            shard,
            offset,
            label,
        });
        Ok(RecordLocation { shard, offset })
    }

    fn close_current(&mut self) -> Result<()> {
        if let Some((idx, file)) = self.current.take() {
            self.bytes += file.offset;
            let FlushedFile {
                file,
                path,
                records,
            } = file.flush()?;
            let shard_file = shard_file_name(&self.name, idx);
            let idx_path = path.with_file_name(dali_idx_name(&shard_file));
            // At most one shard is being synced at a time.
            self.wait_for_sync()?;
            self.syncing = Some(std::thread::spawn(move || {
                file.sync_all().map_err(|e| Error::io(&path, e))?;
                write_synced(&idx_path, &format_dali_idx(&records))
            }));
            self.closed_shards.push(shard_file);
        }
        Ok(())
    }

    fn wait_for_sync(&mut self) -> Result<()> {
        match self.syncing.take() {
            None => Ok(()),
            Some(handle) => handle.join().unwrap_or_else(|_| {
                Err(Error::io(
                    &self.staging,
                    std::io::Error::other("the thread syncing a shard panicked"),
                ))
            }),
        }
    }

    /// Closes the last shard, writes the index and publishes the dataset.
    pub fn finish(&mut self) -> Result<DatasetSummary> {
        if self.done {
            return Err(Error::InvalidArgument(format!(
                "dataset {:?} is already finished",
                self.name
            )));
        }
        self.close_current()?;
        self.wait_for_sync()?;
        let index_name = index_file_name(&self.name);
        write_synced(
            &self.staging.join(&index_name),
            &format_index(&self.entries),
        )?;
        sync_dir(&self.staging)?;

        // The old index goes first: from here until the new index lands, the
        // dataset reads as incomplete.
        let index_path = self.out_dir.join(&index_name);
        match fs::remove_file(&index_path) {
            Ok(()) => sync_dir(&self.out_dir)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(&index_path, e)),
        }
        self.remove_old_shards()?;
        for shard_file in &self.closed_shards {
            for file in [shard_file.clone(), dali_idx_name(shard_file)] {
                rename(&self.staging.join(&file), &self.out_dir.join(&file))?;
            }
        }
        sync_dir(&self.out_dir)?;
        rename(&self.staging.join(&index_name), &index_path)?;
        sync_dir(&self.out_dir)?;
        fs::remove_dir(&self.staging).map_err(|e| Error::io(&self.staging, e))?;
        self.done = true;
        Ok(DatasetSummary {
            out_dir: self.out_dir.clone(),
            index_path,
            shard_files: self.closed_shards.clone(),
            records: self.records(),
            bytes: self.bytes,
        })
    }

    /// Removes shards of an earlier dataset with the same name that the new
    /// one does not overwrite (it may have had more shards).
    fn remove_old_shards(&self) -> Result<()> {
        let prefix = format!("{}-", self.name);
        let entries = fs::read_dir(&self.out_dir).map_err(|e| Error::io(&self.out_dir, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| Error::io(&self.out_dir, e))?;
            let file_name = entry.file_name().to_string_lossy().into_owned();
            let Some(rest) = file_name.strip_prefix(&prefix) else {
                continue;
            };
            let number = rest
                .strip_suffix(".tfrecord")
                .or_else(|| rest.strip_suffix(".tfrecord.idx"));
            let is_old_shard =
                number.is_some_and(|n| n.len() >= 5 && n.bytes().all(|b| b.is_ascii_digit()));
            if is_old_shard {
                fs::remove_file(entry.path()).map_err(|e| Error::io(entry.path(), e))?;
            }
        }
        Ok(())
    }

    /// Discards the staging directory; the output directory is untouched.
    pub fn abort(&mut self) {
        self.current = None;
        let _ = self.wait_for_sync();
        if !self.done {
            self.done = true;
            let _ = fs::remove_dir_all(&self.staging);
        }
    }
}

impl Drop for ShardedWriter {
    fn drop(&mut self) {
        self.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tfrecord::index::{read_dali_idx, read_index};
    use crate::tfrecord::record::RecordReader;

    #[test]
    fn single_file_appears_only_on_finish() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("one.tfrecord");
        let mut w = RecordFileWriter::create(&target).unwrap();
        assert_eq!(w.write(b"abc").unwrap(), 0);
        assert_eq!(w.write(b"de").unwrap(), 19);
        assert!(!target.exists());
        assert_eq!(w.finish().unwrap(), vec![(0, 19), (19, 18)]);
        let r = RecordReader::open(&target, true).unwrap();
        assert_eq!(r.read_at(19).unwrap(), b"de");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn aborted_single_file_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut w = RecordFileWriter::create(dir.path().join("x.tfrecord")).unwrap();
            w.write(b"abc").unwrap();
        }
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn sharded_layout_and_indexes() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("ds");
        let mut w = ShardedWriter::create(&out, "ds", 2).unwrap();
        let locs: Vec<_> = (0..5)
            .map(|i| w.write(format!("rec{i}").as_bytes(), i).unwrap())
            .collect();
        assert_eq!(
            locs[2],
            RecordLocation {
                shard: 1,
                offset: 0
            }
        );
        assert!(!out.join("ds.index").exists());
        let summary = w.finish().unwrap();
        assert_eq!(summary.records, 5);
        assert_eq!(summary.shard_files.len(), 3);
        let mut names: Vec<_> = fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "ds-00000.tfrecord",
                "ds-00000.tfrecord.idx",
                "ds-00001.tfrecord",
                "ds-00001.tfrecord.idx",
                "ds-00002.tfrecord",
                "ds-00002.tfrecord.idx",
                "ds.index"
            ]
        );
        let index = read_index(&out.join("ds.index")).unwrap();
        assert_eq!(index.len(), 5);
        for (i, e) in index.iter().enumerate() {
            let r = RecordReader::open(out.join(&e.shard_file), true).unwrap();
            assert_eq!(r.read_at(e.offset).unwrap(), format!("rec{i}").as_bytes());
            assert_eq!(e.label, i as i64);
        }
        assert_eq!(
            read_dali_idx(&out.join("ds-00001.tfrecord.idx")).unwrap(),
            vec![(0, 20), (20, 20)]
        );
    }

    #[test]
    fn rerun_replaces_and_removes_extra_old_shards() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = ShardedWriter::create(dir.path(), "ds", 1).unwrap();
        for i in 0..3 {
            w.write(b"old", i).unwrap();
        }
        w.finish().unwrap();
        fs::write(dir.path().join("other.txt"), "keep me").unwrap();
        let mut w = ShardedWriter::create(dir.path(), "ds", 10).unwrap();
        w.write(b"new", 0).unwrap();
        w.finish().unwrap();
        assert!(dir.path().join("ds-00000.tfrecord").exists());
        assert!(!dir.path().join("ds-00001.tfrecord").exists());
        assert!(!dir.path().join("ds-00002.tfrecord.idx").exists());
        assert!(dir.path().join("other.txt").exists());
        assert_eq!(read_index(&dir.path().join("ds.index")).unwrap().len(), 1);
    }

    #[test]
    fn dropped_writer_leaves_output_untouched() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut w = ShardedWriter::create(dir.path(), "ds", 1).unwrap();
            w.write(b"x", 0).unwrap();
            w.write(b"y", 0).unwrap();
        }
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn stale_staging_from_dead_process_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        // pid 0 never names a running process we could collide with.
        let stale = dir.path().join(".ds.partial-0");
        fs::create_dir(&stale).unwrap();
        fs::write(stale.join("ds-00000.tfrecord"), b"half").unwrap();
        let mut w = ShardedWriter::create(dir.path(), "ds", 1).unwrap();
        assert!(!stale.exists());
        w.write(b"x", 0).unwrap();
        w.finish().unwrap();
    }

    #[test]
    fn bad_names_and_sizes() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["", ".hidden", "a/b", "tab\there"] {
            assert!(
                ShardedWriter::create(dir.path(), name, 1).is_err(),
                "{name:?}"
            );
        }
        assert!(ShardedWriter::create(dir.path(), "ok", 0).is_err());
    }
}
