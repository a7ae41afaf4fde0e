//! The packed dataset behind `IndexTFRDataset`.

use std::path::PathBuf;

use numpy::{PyArray1, PyArray3, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tiacc_core::dataset::IndexedDataset;
use tiacc_core::image::decode::RgbImage;

use crate::errors::ResultExt;

/// Random access to the records of a packed dataset (index + shards).
#[pyclass(module = "tiacc_training._engine", frozen)]
pub struct PackedDataset {
    inner: IndexedDataset,
}

fn to_array<'py>(py: Python<'py>, img: RgbImage) -> PyResult<Bound<'py, PyArray3<u8>>> {
    let (h, w) = (img.height, img.width);
    PyArray1::from_vec(py, img.pixels).reshape([h, w, 3])
}

#[pymethods]
impl PackedDataset {
    #[new]
    fn new(py: Python<'_>, root: PathBuf, index: PathBuf) -> PyResult<Self> {
        let inner = py.detach(|| IndexedDataset::open(&root, &index)).py()?;
        Ok(PackedDataset { inner })
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// Labels of all records as an int64 array.
    fn labels<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, self.inner.labels())
    }

    /// `(shard_path, offset)` of record `index`.
    fn location(&self, index: usize) -> PyResult<(PathBuf, u64)> {
        let (path, offset) = self.inner.location(index).py()?;
        Ok((path.to_path_buf(), offset))
    }

    /// The encoded image bytes of record `index`.
    fn image_bytes<'py>(&self, py: Python<'py>, index: usize) -> PyResult<Bound<'py, PyBytes>> {
        let data = py.detach(|| self.inner.image_bytes(index)).py()?;
        Ok(PyBytes::new(py, &data))
    }

    /// The encoded images of `indices`, read in parallel.
    #[pyo3(signature = (indices, threads = 0))]
    fn image_bytes_batch<'py>(
        &self,
        py: Python<'py>,
        indices: Vec<usize>,
        threads: usize,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let all = py
            .detach(|| self.inner.image_bytes_batch(&indices, threads))
            .py()?;
        Ok(all.iter().map(|d| PyBytes::new(py, d)).collect())
    }

    /// Record `index` decoded to an `(H, W, 3)` uint8 RGB array.
    fn decode<'py>(&self, py: Python<'py>, index: usize) -> PyResult<Bound<'py, PyArray3<u8>>> {
        let img = py.detach(|| self.inner.decode(index)).py()?;
        to_array(py, img)
    }

    /// `indices` read and decoded in parallel with the GIL released; a list
    /// of `(H, W, 3)` uint8 RGB arrays.
    #[pyo3(signature = (indices, threads = 0))]
    fn decode_batch<'py>(
        &self,
        py: Python<'py>,
        indices: Vec<usize>,
        threads: usize,
    ) -> PyResult<Vec<Bound<'py, PyArray3<u8>>>> {
        let images = py
            .detach(|| self.inner.decode_batch(&indices, threads))
            .py()?;
        images.into_iter().map(|img| to_array(py, img)).collect()
    }
}
