//! `IndexedDataset`: random access to a packed dataset (an index and its
//! TFRecord shards). Python's `IndexedDataset` (public as `IndexTFRDataset`)
//! wraps it; the Rust core's type has the same name.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use numpy::{
    PyArray1, PyArray3, PyArray4, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};
use tiacc_core::dataset::{
    batch_shape, sampled_batch_shape, BatchOut, EncodedImages as CoreImages,
    IndexedDataset as CoreDataset, Rendering,
};
use tiacc_core::image::decode::RgbImage;
use tiacc_core::image::fused::{Geometry, Output};
use tiacc_core::image::sampling::{
    sample_reproduced, Draws, Placement, ResizeTo, Sampler as CoreSampler, TorchCpuRng,
};

use crate::errors::ResultExt;

/// Nanoseconds the data methods of this process ran with the GIL released.
static RELEASED_NS: AtomicU64 = AtomicU64::new(0);

/// `f` with the GIL released, its time added to [`RELEASED_NS`].
fn released<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> T {
    py.detach(|| {
        let start = Instant::now();
        let out = f();
        let spent = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        RELEASED_NS.fetch_add(spent, Ordering::Relaxed);
        out
    })
}

/// Seconds the data methods of this process (reads, decodes, renders, whole
/// batches) have run with the GIL released, in every thread together: the
/// rest of a batch's time in them held the GIL. (An image drawn from torch
/// inside `load_batch` takes the GIL back for its draws: about one in five
/// thousand, counted as released.)
#[pyfunction]
#[pyo3(text_signature = "() -> float")]
pub fn data_gil_released_seconds() -> f64 {
    RELEASED_NS.load(Ordering::Relaxed) as f64 * 1e-9
}

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

    /// list[tuple[int, int]]: `(width, height)` of each image, from its header.
    #[getter]
    fn sizes(&self) -> Vec<(u32, u32)> {
        self.inner.sizes().to_vec()
    }

    /// list[int]: The record numbers, in order.
    #[getter]
    fn indices(&self) -> Vec<usize> {
        self.inner.indices().to_vec()
    }

    /// The encoded bytes of the image at `position`.
    #[pyo3(text_signature = "(self, position: int) -> bytes")]
    fn encoded<'py>(&self, py: Python<'py>, position: usize) -> PyResult<Bound<'py, PyBytes>> {
        let data = self.inner.data().get(position).ok_or_else(|| {
            PyValueError::new_err(format!(
                "position {position} is out of range for {} images",
                self.inner.data().len()
            ))
        })?;
        Ok(PyBytes::new(py, data))
    }

    /// Every image's bytes in one uint8 array (copied with the GIL
    /// released), the offsets where each starts (and the end: one more
    /// than the images), and whether each is a JPEG: what a device decoder
    /// takes as slices, without a copy per image.
    #[pyo3(text_signature = "(self) -> tuple[Any, list[int], list[bool]]")]
    fn packed<'py>(&self, py: Python<'py>) -> (Bound<'py, PyArray1<u8>>, Vec<usize>, Vec<bool>) {
        let (bytes, offsets, jpeg) = released(py, || self.inner.packed());
        (PyArray1::from_vec(py, bytes), offsets, jpeg)
    }

    /// The images at `positions`, in that order (the bytes are shared).
    #[pyo3(text_signature = "(self, positions: list[int]) -> EncodedImages")]
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
    #[pyo3(text_signature = "(root: _Path, index: _Path)")]
    fn new(py: Python<'_>, root: PathBuf, index: PathBuf) -> PyResult<Self> {
        let inner = released(py, || CoreDataset::open(&root, &index)).py()?;
        Ok(IndexedDataset { inner })
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// Labels of all records as an int64 array.
    #[pyo3(text_signature = "(self) -> Any")]
    fn labels<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, self.inner.labels())
    }

    /// `(shard_path, offset)` of record `index`.
    #[pyo3(text_signature = "(self, index: int) -> tuple[str, int]")]
    fn location(&self, index: usize) -> PyResult<(PathBuf, u64)> {
        let (path, offset) = self.inner.location(index).py()?;
        Ok((path.to_path_buf(), offset))
    }

    /// The encoded image bytes of record `index`.
    #[pyo3(text_signature = "(self, index: int) -> bytes")]
    fn image_bytes<'py>(&self, py: Python<'py>, index: usize) -> PyResult<Bound<'py, PyBytes>> {
        let data = released(py, || self.inner.image_bytes(index)).py()?;
        Ok(PyBytes::new(py, &data))
    }

    /// The encoded images of `indices`, read in parallel.
    #[pyo3(
        signature = (indices, threads = 0),
        text_signature = "(self, indices: list[int], threads: int = 0) -> list[bytes]"
    )]
    fn image_bytes_batch<'py>(
        &self,
        py: Python<'py>,
        indices: Vec<usize>,
        threads: usize,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let all = released(py, || self.inner.image_bytes_batch(&indices, threads)).py()?;
        Ok(all.iter().map(|d| PyBytes::new(py, d)).collect())
    }

    /// Record `index` decoded to an `(H, W, 3)` uint8 RGB array.
    #[pyo3(text_signature = "(self, index: int) -> Any")]
    fn decode<'py>(&self, py: Python<'py>, index: usize) -> PyResult<Bound<'py, PyArray3<u8>>> {
        let img = released(py, || self.inner.decode(index)).py()?;
        to_array(py, img)
    }

    /// `indices` read and decoded in parallel with the GIL released; a list
    /// of `(H, W, 3)` uint8 RGB arrays.
    #[pyo3(
        signature = (indices, threads = 0),
        text_signature = "(self, indices: list[int], threads: int = 0) -> list[Any]"
    )]
    fn decode_batch<'py>(
        &self,
        py: Python<'py>,
        indices: Vec<usize>,
        threads: usize,
    ) -> PyResult<Vec<Bound<'py, PyArray3<u8>>>> {
        let images = released(py, || self.inner.decode_batch(&indices, threads)).py()?;
        images.into_iter().map(|img| to_array(py, img)).collect()
    }

    /// `(width, height)` of the images of `indices`, from their headers.
    #[pyo3(
        signature = (indices, threads = 0),
        text_signature = "(self, indices: list[int], threads: int = 0) -> list[tuple[int, int]]"
    )]
    fn image_sizes(
        &self,
        py: Python<'_>,
        indices: Vec<usize>,
        threads: usize,
    ) -> PyResult<Vec<(u32, u32)>> {
        released(py, || self.inner.image_sizes(&indices, threads)).py()
    }

    /// Reads the images of `indices` and their sizes in parallel with the
    /// GIL released, for `render_images`.
    #[pyo3(
        signature = (indices, threads = 0),
        text_signature = "(self, indices: list[int], threads: int = 0) -> EncodedImages"
    )]
    fn read_images(
        &self,
        py: Python<'_>,
        indices: Vec<usize>,
        threads: usize,
    ) -> PyResult<EncodedImages> {
        let inner = released(py, || self.inner.read_images(&indices, threads)).py()?;
        Ok(EncodedImages { inner })
    }

    /// Decodes, crops, resizes, flips and converts `indices` in one pass
    /// each, in parallel with the GIL released, into `out`: a C-contiguous
    /// `(N, 3, H, W)` float32 array (normalised with `mean`/`std`) or uint8
    /// array. Each geometry is `((left, top, width, height) crop,
    /// (width, height) resize, (left, top, width, height) window, flip)`.
    #[pyo3(
        signature = (indices, geometries, out, mean = None, std = None, downscale = true, threads = 0),
        text_signature = "(self, indices: list[int], geometries: list[Any], out: Any, \
        mean: Optional[tuple[float, float, float]] = None, \
        std: Optional[tuple[float, float, float]] = None, downscale: bool = True, \
        threads: int = 0) -> None"
    )]
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
        render_into(py, geometries, out, mean, std, downscale, |how, buf| {
            self.inner.render_batch(&indices, how, buf, threads)
        })
    }

    /// `render_batch` of images read by `read_images` (from this dataset).
    #[pyo3(
        signature = (images, geometries, out, mean = None, std = None, downscale = true, threads = 0),
        text_signature = "(self, images: EncodedImages, geometries: list[Any], out: Any, \
        mean: Optional[tuple[float, float, float]] = None, \
        std: Optional[tuple[float, float, float]] = None, downscale: bool = True, \
        threads: int = 0) -> None"
    )]
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
        render_into(py, geometries, out, mean, std, downscale, |how, buf| {
            self.inner.render_images(&images.inner, how, buf, threads)
        })
    }

    /// Reads `indices`, draws each image's geometry with `sampler` from a
    /// reproduction of the torch CPU generator whose `get_state()` is in
    /// `state`, and renders them into `out` as `render_batch` does: all in
    /// one call with the GIL released, taken again only for an image the
    /// reproduction cannot decide (drawn by `draws` from `generator`).
    /// `state` is then the state torch's own draws would have left, for the
    /// caller's `generator.set_state()`.
    #[pyo3(
        signature = (indices, sampler, state, generator, draws, fused_multiply_add, out, mean = None, std = None, downscale = true, threads = 0),
        text_signature = "(self, indices: list[int], sampler: Sampler, state: Any, generator: Any, \
        draws: Any, fused_multiply_add: bool, out: Any, \
        mean: Optional[tuple[float, float, float]] = None, \
        std: Optional[tuple[float, float, float]] = None, downscale: bool = True, \
        threads: int = 0) -> None"
    )]
    #[allow(clippy::too_many_arguments)]
    fn load_batch(
        &self,
        py: Python<'_>,
        indices: Vec<usize>,
        sampler: &Sampler,
        state: &Bound<'_, PyArray1<u8>>,
        generator: &Bound<'_, PyAny>,
        draws: &Bound<'_, PyAny>,
        fused_multiply_add: bool,
        out: &Bound<'_, PyAny>,
        mean: Option<[f32; 3]>,
        std: Option<[f32; 3]>,
        downscale: bool,
        threads: usize,
    ) -> PyResult<()> {
        let shape = sampled_batch_shape(&sampler.inner, indices.len()).py()?;
        let mut state = state.try_readwrite()?;
        let state = state.as_slice_mut()?;
        let mut rng = TorchCpuRng::from_state(state, fused_multiply_add).py()?;
        let source = TorchSource {
            generator: generator.clone().unbind(),
            draws: draws.clone().unbind(),
            fused_multiply_add,
        };
        let core = &sampler.inner;
        let mut failed: Option<PyErr> = None;
        let result = with_out(py, out, shape, mean, std, |output, buf| {
            let from_torch = |width, height, before: &TorchCpuRng| {
                Python::attach(|py| source.draw_one(py, core, width, height, before)).map_err(|e| {
                    failed = Some(e);
                    tiacc_core::error::Error::InvalidArgument("drawing from torch failed".into())
                })
            };
            self.inner.load_batch(
                &indices, core, &mut rng, from_torch, downscale, output, buf, threads,
            )?;
            state.copy_from_slice(&rng.state());
            Ok(())
        });
        if let Some(e) = failed {
            return Err(e);
        }
        result
    }
}

/// A torch CPU generator, and the object that draws from it with torch's
/// calls (`_random_params.TorchDraws`).
struct TorchSource {
    generator: Py<PyAny>,
    draws: Py<PyAny>,
    fused_multiply_add: bool,
}

impl TorchSource {
    /// The generator's state, reproduced.
    fn state(&self, py: Python<'_>) -> PyResult<TorchCpuRng> {
        let state = self
            .generator
            .bind(py)
            .call_method0("get_state")?
            .call_method0("numpy")?;
        let state: PyReadonlyArray1<'_, u8> = state.extract()?;
        TorchCpuRng::from_state(state.as_slice()?, self.fused_multiply_add).py()
    }

    /// Moves the generator to `rng`'s state.
    fn set_state(&self, py: Python<'_>, rng: &TorchCpuRng) -> PyResult<()> {
        let state = PyArray1::from_vec(py, rng.state());
        let tensor = py.import("torch")?.call_method1("from_numpy", (state,))?;
        self.generator
            .bind(py)
            .call_method1("set_state", (tensor,))?;
        Ok(())
    }

    /// One image drawn by torch from the state `before`: its geometry and
    /// the generator after.
    fn draw_one(
        &self,
        py: Python<'_>,
        sampler: &CoreSampler,
        width: u32,
        height: u32,
        before: &TorchCpuRng,
    ) -> PyResult<(Geometry, TorchCpuRng)> {
        self.set_state(py, before)?;
        let geometry = sampler.sample(width, height, &mut PyDraws(self.draws.bind(py)))?;
        Ok((geometry, self.state(py)?))
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
    downscale: bool,
    render: impl FnOnce(&Rendering<'_>, BatchOut<'_>) -> tiacc_core::error::Result<()> + Send,
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
    let shape = batch_shape(&geometries).py()?;
    with_out(py, out, shape, mean, std, |output, buf| {
        let how = Rendering {
            geometries: &geometries,
            downscale,
            output,
        };
        render(&how, buf)
    })
}

/// Checks that `out` is a C-contiguous float32 or uint8 array of `shape`
/// and runs `fill` on its buffer with the GIL released.
fn with_out(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    shape: [usize; 4],
    mean: Option<[f32; 3]>,
    std: Option<[f32; 3]>,
    fill: impl FnOnce(Output, BatchOut<'_>) -> tiacc_core::error::Result<()> + Send,
) -> PyResult<()> {
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
        released(py, || fill(output, BatchOut::Float(buf))).py()
    } else if let Ok(arr) = out.cast::<PyArray4<u8>>() {
        check(arr.shape())?;
        let mut rw = arr.try_readwrite()?;
        let buf = rw.as_slice_mut()?;
        released(py, || fill(Output::Uint8, BatchOut::Uint8(buf))).py()
    } else {
        Err(PyTypeError::new_err(
            "out must be a C-contiguous 4-D numpy array of float32 or uint8",
        ))
    }
}

/// The geometry of a fused transform chain (see
/// `tiacc_core::image::sampling`): built by the Python plan, sampled here.
#[pyclass(module = "tiacc_training._engine", frozen)]
pub struct Sampler {
    inner: CoreSampler,
}

/// Draws that call torch: an object with `uniform(low, high)`,
/// `exp_uniform(low, high)`, `randint(high)` and `flip(p)`.
struct PyDraws<'a, 'py>(&'a Bound<'py, PyAny>);

impl Draws for PyDraws<'_, '_> {
    type Error = PyErr;

    fn uniform(&mut self, low: f64, high: f64) -> PyResult<f64> {
        self.0.call_method1("uniform", (low, high))?.extract()
    }

    fn exp_uniform(&mut self, low: f64, high: f64) -> PyResult<(f64, f64)> {
        let value: f64 = self.0.call_method1("exp_uniform", (low, high))?.extract()?;
        Ok((value, value))
    }

    fn unsure(&self) -> PyErr {
        // Never: torch's own value is one value.
        PyValueError::new_err("a draw from torch gave a range of values")
    }

    fn randint(&mut self, high: u64) -> PyResult<u64> {
        self.0.call_method1("randint", (high,))?.extract()
    }

    fn flip(&mut self, p: f64) -> PyResult<bool> {
        self.0.call_method1("flip", (p,))?.extract()
    }
}

fn geometry_tuple(g: Geometry) -> GeometryTuple {
    (g.crop, g.resize, g.window, g.flip)
}

#[pymethods]
impl Sampler {
    /// `kind` is `"rrc"` (`RandomResizedCrop`: `scale`, `log_ratio`,
    /// `ratio` and `output` `(height, width)`), `"resize"` (`size`: `[h, w]`,
    /// `[n]` or None, `max_size`, and `center` `(height, width)` of a
    /// following `CenterCrop`) or `"center"` (`center`); `flip_p` is
    /// `RandomHorizontalFlip`'s `p`.
    #[new]
    #[pyo3(
        signature = (kind, *, output = None, scale = None, log_ratio = None, ratio = None, size = None, max_size = None, center = None, flip_p = None),
        text_signature = "(kind: str, *, output: Optional[tuple[int, int]] = None, \
            scale: Optional[tuple[float, float]] = None, \
            log_ratio: Optional[tuple[float, float]] = None, \
            ratio: Optional[tuple[float, float]] = None, size: Optional[list[int]] = None, \
            max_size: Optional[int] = None, center: Optional[tuple[int, int]] = None, \
            flip_p: Optional[float] = None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        kind: &str,
        output: Option<(u32, u32)>,
        scale: Option<(f64, f64)>,
        log_ratio: Option<(f64, f64)>,
        ratio: Option<(f64, f64)>,
        size: Option<Vec<u32>>,
        max_size: Option<u32>,
        center: Option<(u32, u32)>,
        flip_p: Option<f64>,
    ) -> PyResult<Self> {
        let need = |what: &str| PyValueError::new_err(format!("Sampler({kind:?}) needs {what}"));
        let placement = match kind {
            "rrc" => {
                let ratio = ratio.ok_or_else(|| need("ratio"))?;
                Placement::ResizedCrop {
                    scale: scale.ok_or_else(|| need("scale"))?,
                    log_ratio: log_ratio.ok_or_else(|| need("log_ratio"))?,
                    ratio_range: (ratio.0.min(ratio.1), ratio.0.max(ratio.1)),
                    output: output.ok_or_else(|| need("output"))?,
                }
            }
            "resize" => Placement::Resize {
                size: match size.as_deref() {
                    Some([h, w]) => ResizeTo::Exact(*h, *w),
                    Some([n]) => ResizeTo::Shorter(*n),
                    None if max_size.is_some() => ResizeTo::Longer,
                    _ => return Err(need("size: [h, w], [n], or None with max_size")),
                },
                max_size,
                center,
            },
            "center" => Placement::Center {
                crop: center.ok_or_else(|| need("center"))?,
            },
            other => {
                return Err(PyValueError::new_err(format!(
                    "Sampler kind must be 'rrc', 'resize' or 'center', got {other:?}"
                )))
            }
        };
        Ok(Sampler {
            inner: CoreSampler { placement, flip_p },
        })
    }

    /// The arguments that build it again, read back from what it holds:
    /// how it is pickled (DataLoader workers started with spawn or
    /// forkserver receive the dataset pickled).
    fn __getnewargs_ex__<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyTuple>, Bound<'py, PyDict>)> {
        let kwargs = PyDict::new(py);
        let kind = match self.inner.placement {
            Placement::ResizedCrop {
                scale,
                log_ratio,
                ratio_range,
                output,
            } => {
                kwargs.set_item("scale", scale)?;
                kwargs.set_item("log_ratio", log_ratio)?;
                kwargs.set_item("ratio", ratio_range)?;
                kwargs.set_item("output", output)?;
                "rrc"
            }
            Placement::Resize {
                size,
                max_size,
                center,
            } => {
                let size = match size {
                    ResizeTo::Exact(h, w) => Some(vec![h, w]),
                    ResizeTo::Shorter(n) => Some(vec![n]),
                    ResizeTo::Longer => None,
                };
                kwargs.set_item("size", size)?;
                kwargs.set_item("max_size", max_size)?;
                kwargs.set_item("center", center)?;
                "resize"
            }
            Placement::Center { crop } => {
                kwargs.set_item("center", crop)?;
                "center"
            }
        };
        kwargs.set_item("flip_p", self.inner.flip_p)?;
        Ok((PyTuple::new(py, [kind])?, kwargs))
    }

    /// Optional[tuple[int, int]]: `(height, width)` of every output, or None when it varies.
    #[getter]
    fn output_size(&self) -> Option<(u32, u32)> {
        self.inner.output_size()
    }

    /// bool: Whether every random range is ordered (torch refuses the others;
    /// such a chain must draw from torch to raise torch's error).
    #[getter]
    fn ranges_ordered(&self) -> bool {
        self.inner.ranges_ordered()
    }

    /// The geometries of images of `sizes` (`(width, height)` each), drawn
    /// from a reproduction of the torch CPU `generator` (its state read,
    /// and set to where torch's own draws would have left it); an image
    /// the reproduction cannot decide is drawn with `draws` (torch's calls).
    #[pyo3(
        text_signature = "(self, sizes: list[tuple[int, int]], generator: Any, draws: Any, \
        fused_multiply_add: bool) -> list[Any]"
    )]
    fn sample(
        &self,
        py: Python<'_>,
        sizes: Vec<(u32, u32)>,
        generator: &Bound<'_, PyAny>,
        draws: &Bound<'_, PyAny>,
        fused_multiply_add: bool,
    ) -> PyResult<Vec<GeometryTuple>> {
        let source = TorchSource {
            generator: generator.clone().unbind(),
            draws: draws.clone().unbind(),
            fused_multiply_add,
        };
        let mut rng = source.state(py)?;
        let geometries = sample_reproduced(&self.inner, &sizes, &mut rng, |k, before| {
            let (width, height) = sizes[k];
            source.draw_one(py, &self.inner, width, height, before)
        })?;
        source.set_state(py, &rng)?;
        Ok(geometries.into_iter().map(geometry_tuple).collect())
    }

    /// The geometries of images of `sizes`, drawing from `draws` (an
    /// object with `uniform`, `exp_uniform`, `randint` and `flip`, each one
    /// torch call).
    #[pyo3(text_signature = "(self, sizes: list[tuple[int, int]], draws: Any) -> list[Any]")]
    fn sample_with(
        &self,
        sizes: Vec<(u32, u32)>,
        draws: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<GeometryTuple>> {
        let geometries = self.inner.sample_all(&sizes, &mut PyDraws(draws))?;
        Ok(geometries.into_iter().map(geometry_tuple).collect())
    }
}

/// `count` draws of `torch.empty(1).uniform_(low, high)` (followed by the
/// C library's float32 `exp` when `exp`), reproduced from the torch CPU
/// generator whose `get_state()` is `state`: how the caller checks the
/// reproduction against the running torch.
#[pyfunction]
#[pyo3(
    signature = (state, fused_multiply_add, low, high, count, exp = false),
    text_signature = "(state: Any, fused_multiply_add: bool, low: float, high: float, count: int, \
        exp: bool = False) -> list[float]"
)]
pub fn torch_cpu_uniform(
    state: PyReadonlyArray1<'_, u8>,
    fused_multiply_add: bool,
    low: f64,
    high: f64,
    count: usize,
    exp: bool,
) -> PyResult<Vec<f64>> {
    let mut rng = TorchCpuRng::from_state(state.as_slice()?, fused_multiply_add).py()?;
    let mut values = Vec::with_capacity(count);
    for _ in 0..count {
        let value = rng.uniform_f32(low, high);
        values.push(f64::from(if exp { value.exp() } else { value }));
    }
    Ok(values)
}
