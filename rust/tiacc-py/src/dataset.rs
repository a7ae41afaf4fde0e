//! `IndexedDataset`: random access to a packed dataset (an index and its
//! TFRecord shards). Python's `IndexedDataset` (public as `IndexTFRDataset`)
//! wraps it; the Rust core's type has the same name.

use std::path::PathBuf;

use numpy::{PyArray1, PyArray3, PyArray4, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tiacc_core::dataset::{BatchOut, EncodedImages as CoreImages, IndexedDataset as CoreDataset};
use tiacc_core::image::decode::RgbImage;
use tiacc_core::image::fused::{Geometry, Output};

use crate::errors::ResultExt;

/// Random access to the records of a packed dataset (index + shards).
#[pyclass(module = "tiacc_training._engine", frozen)]
pub struct IndexedDataset {
    inner: CoreDataset,
}

/// Encoded images read by `IndexedDataset.read_images`, with their sizes, to
/// render with `IndexedDataset.render_images` without reading them again.
#[pyclass(module = "tiacc_training._engine", frozen)]
pub struct EncodedImages {
    inner: CoreImages,
}

#[pymethods]
impl EncodedImages {
    fn __len__(&self) -> usize {
        self.inner.indices().len()
    }

    /// `(width, height)` of each image, from its header.
    #[getter]
    fn sizes(&self) -> Vec<(u32, u32)> {
        self.inner.sizes().to_vec()
    }

    /// The record numbers, in order.
    #[getter]
    fn indices(&self) -> Vec<usize> {
        self.inner.indices().to_vec()
    }

    /// The encoded bytes of the image at `position`.
    fn encoded<'py>(&self, py: Python<'py>, position: usize) -> PyResult<Bound<'py, PyBytes>> {
        let data = self.inner.data().get(position).ok_or_else(|| {
            PyValueError::new_err(format!(
                "position {position} is out of range for {} images",
                self.inner.data().len()
            ))
        })?;
        Ok(PyBytes::new(py, data))
    }

    /// The images at `positions`, in that order (the bytes are shared).
    fn select(&self, positions: Vec<usize>) -> PyResult<EncodedImages> {
        Ok(EncodedImages {
            inner: self.inner.select(&positions).py()?,
        })
    }
}

/// `render_batch`'s geometry tuples.
type GeometryTuple = ((u32, u32, u32, u32), (u32, u32), (i64, i64, u32, u32), bool);

fn to_array<'py>(py: Python<'py>, img: RgbImage) -> PyResult<Bound<'py, PyArray3<u8>>> {
    let (h, w) = (img.height, img.width);
    PyArray1::from_vec(py, img.pixels).reshape([h, w, 3])
}

#[pymethods]
impl IndexedDataset {
    #[new]
    fn new(py: Python<'_>, root: PathBuf, index: PathBuf) -> PyResult<Self> {
        let inner = py.detach(|| CoreDataset::open(&root, &index)).py()?;
        Ok(IndexedDataset { inner })
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

    /// `(width, height)` of the images of `indices`, from their headers.
    #[pyo3(signature = (indices, threads = 0))]
    fn image_sizes(
        &self,
        py: Python<'_>,
        indices: Vec<usize>,
        threads: usize,
    ) -> PyResult<Vec<(u32, u32)>> {
        py.detach(|| self.inner.image_sizes(&indices, threads)).py()
    }

    /// Reads the images of `indices` and their sizes in parallel with the
    /// GIL released, for `render_images`.
    #[pyo3(signature = (indices, threads = 0))]
    fn read_images(
        &self,
        py: Python<'_>,
        indices: Vec<usize>,
        threads: usize,
    ) -> PyResult<EncodedImages> {
        let inner = py
            .detach(|| self.inner.read_images(&indices, threads))
            .py()?;
        Ok(EncodedImages { inner })
    }

    /// Decodes, crops, resizes, flips and converts `indices` in one pass
    /// each, in parallel with the GIL released, into `out`: a C-contiguous
    /// `(N, 3, H, W)` float32 array (normalised with `mean`/`std`) or uint8
    /// array. Each geometry is `((left, top, width, height) crop,
    /// (width, height) resize, (left, top, width, height) window, flip)`.
    #[pyo3(signature = (indices, geometries, out, mean = None, std = None, downscale = true, threads = 0))]
    #[allow(clippy::too_many_arguments)]
    fn render_batch(
        &self,
        py: Python<'_>,
        indices: Vec<usize>,
        geometries: Vec<GeometryTuple>,
        out: &Bound<'_, PyAny>,
        mean: Option<[f32; 3]>,
        std: Option<[f32; 3]>,
        downscale: bool,
        threads: usize,
    ) -> PyResult<()> {
        render_into(py, geometries, out, mean, std, |g, output, buf| {
            self.inner
                .render_batch(&indices, g, downscale, output, buf, threads)
        })
    }

    /// `render_batch` of images read by `read_images` (from this dataset).
    #[pyo3(signature = (images, geometries, out, mean = None, std = None, downscale = true, threads = 0))]
    #[allow(clippy::too_many_arguments)]
    fn render_images(
        &self,
        py: Python<'_>,
        images: &EncodedImages,
        geometries: Vec<GeometryTuple>,
        out: &Bound<'_, PyAny>,
        mean: Option<[f32; 3]>,
        std: Option<[f32; 3]>,
        downscale: bool,
        threads: usize,
    ) -> PyResult<()> {
        if geometries.len() != images.inner.indices().len() {
            return Err(PyValueError::new_err(format!(
                "{} images but {} geometries",
                images.inner.indices().len(),
                geometries.len()
            )));
        }
        render_into(py, geometries, out, mean, std, |g, output, buf| {
            self.inner
                .render_images(&images.inner, g, downscale, output, buf, threads)
        })
    }
}

/// Checks `out` against `geometries` and runs `render` on its buffer with
/// the GIL released.
fn render_into(
    py: Python<'_>,
    geometries: Vec<GeometryTuple>,
    out: &Bound<'_, PyAny>,
    mean: Option<[f32; 3]>,
    std: Option<[f32; 3]>,
    render: impl FnOnce(&[Geometry], Output, BatchOut<'_>) -> tiacc_core::error::Result<()> + Send,
) -> PyResult<()> {
    let geometries: Vec<Geometry> = geometries
        .into_iter()
        .map(|(crop, resize, window, flip)| Geometry {
            crop,
            resize,
            window,
            flip,
        })
        .collect();
    let n = geometries.len();
    let (_, _, ww, wh) = geometries
        .first()
        .map(|g| g.window)
        .ok_or_else(|| PyValueError::new_err("render_batch needs at least one index"))?;
    if geometries
        .iter()
        .any(|g| (g.window.2, g.window.3) != (ww, wh))
    {
        return Err(PyValueError::new_err(
            "every geometry must output the same window size",
        ));
    }
    let shape = [n, 3, wh as usize, ww as usize];
    let check = |got: &[usize]| -> PyResult<()> {
        if got != shape {
            return Err(PyValueError::new_err(format!(
                "out has shape {got:?}, expected {shape:?}"
            )));
        }
        Ok(())
    };
    if let Ok(arr) = out.cast::<PyArray4<f32>>() {
        check(arr.shape())?;
        let mut rw = arr.try_readwrite()?;
        let buf = rw.as_slice_mut()?;
        let output = Output::Float {
            mean: mean.unwrap_or([0.0; 3]),
            std: std.unwrap_or([1.0; 3]),
        };
        py.detach(|| render(&geometries, output, BatchOut::Float(buf)))
            .py()
    } else if let Ok(arr) = out.cast::<PyArray4<u8>>() {
        check(arr.shape())?;
        let mut rw = arr.try_readwrite()?;
        let buf = rw.as_slice_mut()?;
        py.detach(|| render(&geometries, Output::Uint8, BatchOut::Uint8(buf)))
            .py()
    } else {
        Err(PyTypeError::new_err(
            "out must be a C-contiguous 4-D numpy array of float32 or uint8",
        ))
    }
}
