//! The image packer behind `img2tfrecord`.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use tiacc_core::pack::{ImagePacker as CorePacker, PackItem, PackOptions, PackOutcome};
use tiacc_core::tfrecord::writer::ShardedWriter;
use tiacc_core::Error;

use crate::errors::ResultExt;
use crate::features::features_from_dict;
use crate::records::summary_dict;

/// Packs image files into a sharded TFRecord dataset, in order, with
/// `workers` threads reading and encoding in parallel.
#[pyclass(module = "tiacc_training._engine")]
pub struct ImagePacker {
    inner: CorePacker,
}

type PyItem<'py> = (
    PathBuf,
    String,
    i64,
    Option<(u32, u32)>,
    Option<Bound<'py, PyAny>>,
);

#[pymethods]
impl ImagePacker {
    #[new]
    #[pyo3(
        signature = (out_dir, name, records_per_shard, workers = 0, lowercase_format = false),
        text_signature = "(out_dir: _Path, name: str, records_per_shard: int, workers: int = 0, \
            lowercase_format: bool = False)"
    )]
    fn new(
        py: Python<'_>,
        out_dir: PathBuf,
        name: &str,
        records_per_shard: u64,
        workers: usize,
        lowercase_format: bool,
    ) -> PyResult<Self> {
        let inner = py
            .detach(|| {
                let writer = ShardedWriter::create(out_dir, name, records_per_shard)?;
                CorePacker::new(
                    writer,
                    PackOptions {
                        workers,
                        lowercase_format,
                    },
                )
            })
            .py()?;
        Ok(ImagePacker { inner })
    }

    /// Packs `items`, each `(path, filename, label, expect_size, features)`
    /// where `expect_size` is `(width, height)` or None and `features` a dict
    /// of extra features or None. Returns the failed items as
    /// `(position, kind, message)` with kind "missing", "io" or "image".
    #[pyo3(text_signature = "(self, items: list[tuple[_Path, str, int, \
        Optional[tuple[int, int]], Optional[dict[str, Any]]]]) -> list[tuple[int, str, str]]")]
    fn add(
        &mut self,
        py: Python<'_>,
        items: Vec<PyItem<'_>>,
    ) -> PyResult<Vec<(usize, &'static str, String)>> {
        let items: Vec<PackItem> = items
            .into_iter()
            .map(|(path, filename, label, expect_size, features)| {
                Ok(PackItem {
                    path,
                    filename,
                    label,
                    expect_size,
                    features: match features {
                        Some(f) => features_from_dict(&f)?,
                        None => Vec::new(),
                    },
                })
            })
            .collect::<PyResult<_>>()?;
        let outcomes = py.detach(|| self.inner.add(&items)).py()?;
        Ok(outcomes
            .into_iter()
            .enumerate()
            .filter_map(|(i, outcome)| match outcome {
                PackOutcome::Packed(_) => None,
                PackOutcome::Failed(e) => {
                    let kind = match &e {
                        Error::Io { source, .. }
                            if source.kind() == std::io::ErrorKind::NotFound =>
                        {
                            "missing"
                        }
                        Error::Io { .. } => "io",
                        _ => "image",
                    };
                    Some((i, kind, e.to_string()))
                }
            })
            .collect())
    }

    /// Publishes the dataset; returns a summary dict (plus `image_bytes`).
    #[pyo3(text_signature = "(self) -> dict[str, Any]")]
    fn finish<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let summary = py.detach(|| self.inner.finish()).py()?;
        let d = summary_dict(py, &summary)?;
        d.set_item("image_bytes", self.inner.image_bytes())?;
        Ok(d)
    }

    /// Discards everything written; the output directory is untouched.
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
