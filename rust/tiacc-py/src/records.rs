//! TFRecord reading, writing and verification for Python.

use std::path::PathBuf;

use pyo3::exceptions::PyStopIteration;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use tiacc_core::tfrecord::example::Example;
use tiacc_core::tfrecord::record::{RecordReader as CoreReader, SizedFile};
use tiacc_core::tfrecord::writer::{
    DatasetSummary, RecordFileWriter, ShardedWriter as CoreShardedWriter,
};
use tiacc_core::tfrecord::{build_index as build, index, record, verify};

use crate::errors::ResultExt;
use crate::features::{example_to_dict, features_from_dict};

/// CRC32C (Castagnoli) of `data`.
#[pyfunction]
#[pyo3(text_signature = "(data: bytes) -> int")]
pub fn crc32c(data: &[u8]) -> u32 {
    tiacc_core::tfrecord::crc::crc32c(data)
}

/// TensorFlow's masked CRC32C of `data`, as stored in TFRecord files.
#[pyfunction]
#[pyo3(text_signature = "(data: bytes) -> int")]
pub fn masked_crc32c(data: &[u8]) -> u32 {
    tiacc_core::tfrecord::crc::masked_crc32c(data)
}

/// The complete framed TFRecord for `payload`.
#[pyfunction]
#[pyo3(text_signature = "(payload: bytes) -> bytes")]
pub fn frame_record<'py>(py: Python<'py>, payload: &[u8]) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &record::frame(payload))
}

/// Serializes a feature dict as a `tf.train.Example`.
#[pyfunction]
#[pyo3(text_signature = "(features: dict[str, Any]) -> bytes")]
pub fn encode_example<'py>(
    py: Python<'py>,
    features: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    use prost::Message;
    let example = Example::from_features(features_from_dict(features)?);
    Ok(PyBytes::new(py, &example.encode_to_vec()))
}

/// Parses a serialized `tf.train.Example` into `{name: list}`.
#[pyfunction]
#[pyo3(text_signature = "(payload: bytes) -> dict[str, list[Any]]")]
pub fn decode_example<'py>(py: Python<'py>, payload: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    let example = Example::parse(payload.to_vec(), "").py()?;
    example_to_dict(py, &example)
}

/// Random-access reader of one TFRecord file.
#[pyclass(module = "tiacc_training._engine", frozen)]
pub struct RecordReader {
    inner: CoreReader<SizedFile>,
}

#[pymethods]
impl RecordReader {
    #[new]
    #[pyo3(
        signature = (path, verify = true),
        text_signature = "(path: _Path, verify: bool = True)"
    )]
    fn new(py: Python<'_>, path: PathBuf, verify: bool) -> PyResult<Self> {
        let inner = py.detach(|| CoreReader::open(path, verify)).py()?;
        Ok(RecordReader { inner })
    }

    /// The payload of the record whose header starts at `offset`.
    #[pyo3(text_signature = "(self, offset: int) -> bytes")]
    fn read<'py>(&self, py: Python<'py>, offset: u64) -> PyResult<Bound<'py, PyBytes>> {
        let payload = py.detach(|| self.inner.read_at(offset)).py()?;
        Ok(PyBytes::new(py, &payload))
    }

    /// The record at `offset` decoded as a `tf.train.Example` dict.
    #[pyo3(text_signature = "(self, offset: int) -> dict[str, list[Any]]")]
    fn read_example<'py>(&self, py: Python<'py>, offset: u64) -> PyResult<Bound<'py, PyDict>> {
        let example = py
            .detach(|| {
                let payload = self.inner.read_at(offset)?;
                let location = format!(" in {} at offset {offset}", self.inner.path().display());
                Example::parse(payload, &location)
            })
            .py()?;
        example_to_dict(py, &example)
    }

    /// Iterates `(offset, payload)` from `start`.
    #[pyo3(signature = (start = 0), text_signature = "(self, start: int = 0) -> RecordIterator")]
    fn scan(slf: Py<Self>, start: u64) -> RecordIterator {
        RecordIterator {
            reader: slf,
            offset: std::sync::Mutex::new(Some(start)),
        }
    }

    /// int: File size in bytes.
    #[getter]
    fn size(&self) -> u64 {
        self.inner.size()
    }

    /// str: The file path.
    #[getter]
    fn path(&self) -> PathBuf {
        self.inner.path().to_path_buf()
    }
}

/// Iterator returned by `RecordReader.scan()`.
///
/// Yields:
///     tuple[int, bytes]: Each record's `(offset, payload)`.
#[pyclass(module = "tiacc_training._engine", frozen)]
pub struct RecordIterator {
    reader: Py<RecordReader>,
    /// Next offset; `None` once finished or failed.
    offset: std::sync::Mutex<Option<u64>>,
}

#[pymethods]
impl RecordIterator {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<(u64, Bound<'py, PyBytes>)> {
        let reader = self.reader.get();
        let mut guard = self
            .offset
            .lock()
            .map_err(|_| PyStopIteration::new_err(()))?;
        let Some(at) = *guard else {
            return Err(PyStopIteration::new_err(()));
        };
        if at == reader.inner.size() {
            *guard = None;
            return Err(PyStopIteration::new_err(()));
        }
        let mut buf = Vec::new();
        match py.detach(|| reader.inner.read_into(at, &mut buf)) {
            Ok(next) => {
                *guard = Some(next);
                Ok((at, PyBytes::new(py, &buf)))
            }
            Err(e) => {
                *guard = None;
                Err(crate::errors::to_pyerr(e))
            }
        }
    }
}

/// Writes one TFRecord file; it appears at `path` only when closed.
#[pyclass(module = "tiacc_training._engine")]
pub struct RecordWriter {
    inner: RecordFileWriter,
}

#[pymethods]
impl RecordWriter {
    #[new]
    #[pyo3(text_signature = "(path: _Path)")]
    fn new(path: PathBuf) -> PyResult<Self> {
        Ok(RecordWriter {
            inner: RecordFileWriter::create(path).py()?,
        })
    }

    /// Appends a raw payload; returns its offset.
    #[pyo3(text_signature = "(self, payload: bytes) -> int")]
    fn write(&mut self, py: Python<'_>, payload: &[u8]) -> PyResult<u64> {
        py.detach(|| self.inner.write(payload)).py()
    }

    /// Appends a feature dict as a `tf.train.Example`; returns its offset.
    #[pyo3(text_signature = "(self, features: dict[str, Any]) -> int")]
    fn write_example(&mut self, py: Python<'_>, features: &Bound<'_, PyAny>) -> PyResult<u64> {
        use prost::Message;
        let payload = Example::from_features(features_from_dict(features)?).encode_to_vec();
        py.detach(|| self.inner.write(&payload)).py()
    }

    /// Fsyncs and renames into place; returns `[(offset, size)]`.
    #[pyo3(text_signature = "(self) -> list[tuple[int, int]]")]
    fn close(&mut self, py: Python<'_>) -> PyResult<Vec<(u64, u64)>> {
        py.detach(|| self.inner.finish()).py()
    }

    /// Discards the file.
    #[pyo3(text_signature = "(self) -> None")]
    fn abort(&mut self) {
        self.inner.abort();
    }

    /// bool: Whether the writer is still open.
    #[getter]
    fn is_open(&self) -> bool {
        self.inner.is_open()
    }
}

pub fn summary_dict<'py>(py: Python<'py>, s: &DatasetSummary) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("out_dir", &s.out_dir)?;
    d.set_item("index_path", &s.index_path)?;
    d.set_item("shard_files", &s.shard_files)?;
    d.set_item("records", s.records)?;
    d.set_item("bytes", s.bytes)?;
    Ok(d)
}

/// Writes a dataset as shards + indexes, published atomically by `finish()`.
#[pyclass(module = "tiacc_training._engine")]
pub struct ShardedWriter {
    inner: CoreShardedWriter,
}

#[pymethods]
impl ShardedWriter {
    #[new]
    #[pyo3(text_signature = "(out_dir: _Path, name: str, records_per_shard: int)")]
    fn new(py: Python<'_>, out_dir: PathBuf, name: &str, records_per_shard: u64) -> PyResult<Self> {
        let inner = py
            .detach(|| CoreShardedWriter::create(out_dir, name, records_per_shard))
            .py()?;
        Ok(ShardedWriter { inner })
    }

    /// Appends a payload with its index label; returns `(shard, offset)`.
    #[pyo3(
        signature = (payload, label = -1),
        text_signature = "(self, payload: bytes, label: int = -1) -> tuple[int, int]"
    )]
    fn write(&mut self, py: Python<'_>, payload: &[u8], label: i64) -> PyResult<(u32, u64)> {
        let loc = py.detach(|| self.inner.write(payload, label)).py()?;
        Ok((loc.shard, loc.offset))
    }

    /// Publishes the dataset; returns a summary dict.
    #[pyo3(text_signature = "(self) -> dict[str, Any]")]
    fn finish<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let summary = py.detach(|| self.inner.finish()).py()?;
        summary_dict(py, &summary)
    }

    /// Discards everything written.
    #[pyo3(text_signature = "(self) -> None")]
    fn abort(&mut self) {
        self.inner.abort();
    }

    /// int: Records written so far.
    #[getter]
    fn records(&self) -> u64 {
        self.inner.records()
    }
}

/// Verifies every record of a shard; returns `(records, bytes)`.
#[pyfunction]
#[pyo3(
    signature = (path, check_examples = true),
    text_signature = "(path: _Path, check_examples: bool = True) -> tuple[int, int]"
)]
pub fn verify_shard(py: Python<'_>, path: PathBuf, check_examples: bool) -> PyResult<(u64, u64)> {
    let r = py
        .detach(|| verify::verify_shard(&path, check_examples))
        .py()?;
    Ok((r.records, r.bytes))
}

/// Verifies an index against its shards; returns a summary dict.
///
/// `progress`, if given, is called with each verified shard's size in bytes
/// (from the worker threads, holding the GIL). The first exception it raises
/// stops further calls and is raised once the verification ends.
#[pyfunction]
#[pyo3(
    signature = (path, check_examples = true, progress = None),
    text_signature = "(path: _Path, check_examples: bool = True, \
        progress: Optional[Callable[[int], Any]] = None) -> dict[str, int]"
)]
pub fn verify_index<'py>(
    py: Python<'py>,
    path: PathBuf,
    check_examples: bool,
    progress: Option<Py<PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let failed: std::sync::Mutex<Option<PyErr>> = std::sync::Mutex::new(None);
    let on_shard = |bytes: u64| {
        let Some(callback) = &progress else { return };
        let mut failed = failed.lock().unwrap_or_else(|e| e.into_inner());
        if failed.is_none() {
            if let Err(e) = Python::attach(|py| callback.call1(py, (bytes,))) {
                *failed = Some(e);
            }
        }
    };
    let r = py
        .detach(|| verify::verify_index_with_progress(&path, check_examples, &on_shard))
        .py()?;
    if let Some(e) = failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(e);
    }
    let d = PyDict::new(py);
    d.set_item("entries", r.entries)?;
    d.set_item("shards", r.shards)?;
    d.set_item("records", r.records)?;
    d.set_item("bytes", r.bytes)?;
    Ok(d)
}

/// Reads a dataset index: a list of `(shard_file, shard_idx, offset, label)`.
#[pyfunction]
#[pyo3(text_signature = "(path: _Path) -> list[tuple[str, int, int, int]]")]
pub fn read_index(py: Python<'_>, path: PathBuf) -> PyResult<Vec<(String, u32, u64, i64)>> {
    let entries = py.detach(|| index::read_index(&path)).py()?;
    Ok(entries
        .into_iter()
        .map(|e| (e.shard_file, e.shard, e.offset, e.label))
        .collect())
}

/// Indexes shards written by other tools: `(index_text, unlabelled)`, where
/// the text has one `shard_file\tshard_idx\toffset\tlabel` line per record.
#[pyfunction]
#[pyo3(
    signature = (shards, index_dir, label_key = "image/class/label"),
    text_signature = "(shards: list[_Path], index_dir: _Path, \
        label_key: str = 'image/class/label') -> tuple[str, int]"
)]
pub fn build_index(
    py: Python<'_>,
    shards: Vec<PathBuf>,
    index_dir: PathBuf,
    label_key: &str,
) -> PyResult<(String, u64)> {
    let built = py
        .detach(|| build::build_index(&shards, &index_dir, label_key))
        .py()?;
    Ok((index::format_index(&built.entries), built.unlabelled))
}
