//! `CommConfig`: the engine configuration, whole, as a Python object.
//!
//! Read from the environment by the engine's own parsers; the arguments of
//! `init_tiacc_training` go through the same parsers
//! (`CommConfig.with_overrides`), so Python keeps no copy of the schema.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyString};

use tiacc_core::comm::dtype::DType;
use tiacc_core::comm::sparse::TopKOptions;
use tiacc_core::config::startup::{CudaRoute, Job};
use tiacc_core::config::{self, CommConfig, TransportChoice};
use tiacc_core::Error;

use crate::errors::{to_pyerr, ResultExt};

/// The communication engine's configuration (immutable).
#[pyclass(module = "tiacc_training._engine", name = "CommConfig", frozen)]
pub struct PyCommConfig {
    pub inner: CommConfig,
}

/// The Python types each argument accepts, and how its value is spelled
/// for the engine's parser.
fn argument_text(name: &str, value: &Bound<'_, PyAny>) -> PyResult<String> {
    let is_bool = value.is_instance_of::<PyBool>();
    let is_int = value.is_instance_of::<PyInt>() && !is_bool;
    let wrong = |expected: &str| {
        PyTypeError::new_err(format!(
            "{name} must be {expected}, got {}",
            value.repr().map_or_else(|_| "?".into(), |r| r.to_string())
        ))
    };
    match name {
        "enable" | "nan_check" | "topk_momentum_masking" if is_bool || is_int => {
            Ok(if value.is_truthy()? { "1" } else { "0" }.into())
        }
        "enable" | "nan_check" | "topk_momentum_masking" => Err(wrong("a bool")),
        "fusion_threshold" | "num_streams" | "topk_warmup_steps" if is_int => {
            Ok(value.str()?.to_string())
        }
        "fusion_threshold" => Err(wrong("an int (bytes)")),
        "num_streams" => Err(wrong("an int")),
        "topk_warmup_steps" => Err(wrong("an int (steps)")),
        "timeout" | "topk_momentum" | "topk_clip_norm"
            if is_int || value.is_instance_of::<PyFloat>() =>
        {
            Ok(value.str()?.to_string())
        }
        "timeout" => Err(wrong("a number of seconds")),
        "topk_momentum" | "topk_clip_norm" => Err(wrong("a number")),
        _ if value.is_instance_of::<PyString>() => Ok(value.str()?.to_string()),
        _ => Err(wrong("a str")),
    }
}

#[pymethods]
impl PyCommConfig {
    /// The configuration from the environment (defaults where unset). Raises
    /// `ConfigError` naming the variable when a value does not parse.
    #[staticmethod]
    #[pyo3(text_signature = "() -> CommConfig")]
    fn from_env() -> PyResult<Self> {
        Ok(PyCommConfig {
            inner: CommConfig::from_env().py()?,
        })
    }

    /// This configuration with `init_tiacc_training`'s arguments applied
    /// (`None` values are skipped). A value of the wrong type raises
    /// `TypeError`; one the variable's parser refuses raises `ValueError`
    /// naming the argument.
    #[pyo3(text_signature = "(self, overrides: dict[str, Any]) -> CommConfig")]
    fn with_overrides(&self, overrides: &Bound<'_, PyDict>) -> PyResult<Self> {
        let mut pairs = Vec::new();
        for (key, value) in overrides.iter() {
            let name: String = key.extract()?;
            if value.is_none() {
                continue;
            }
            let text = argument_text(&name, &value)?;
            pairs.push((name, text));
        }
        let refs: Vec<(&str, &str)> = pairs
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect();
        match self.inner.with_overrides(&refs) {
            Ok(inner) => Ok(PyCommConfig { inner }),
            Err(err @ (Error::Config { .. } | Error::InvalidArgument(_))) => {
                Err(PyValueError::new_err(err.to_string()))
            }
            Err(err) => Err(to_pyerr(err)),
        }
    }

    /// Whether `other` makes the same engine (whatever set the values).
    #[pyo3(text_signature = "(self, other: CommConfig) -> bool")]
    fn same_settings(&self, other: &PyCommConfig) -> bool {
        self.inner.same_settings(&other.inner)
    }

    /// Every setting as a dict (names as the attributes).
    #[pyo3(text_signature = "(self) -> dict[str, Any]")]
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.inner;
        let d = PyDict::new(py);
        d.set_item("enabled", c.enabled)?;
        d.set_item("fusion_threshold", c.fusion_threshold)?;
        d.set_item("num_streams", c.num_streams)?;
        d.set_item("timeout", c.timeout.as_secs_f64())?;
        d.set_item("socket_addr", self.socket_addr())?;
        d.set_item("transport", c.transport.name())?;
        d.set_item("nccl_library", self.nccl_library())?;
        d.set_item("compression", c.compression.name())?;
        d.set_item("compression_inter_only", c.compression_inter_only)?;
        d.set_item("compression_scale", c.compression_scale)?;
        d.set_item(
            "reduce_scatter_compression",
            c.reduce_scatter_compression.name(),
        )?;
        d.set_item("nan_check", c.nan_check)?;
        d.set_item("shared_memory", c.shared_memory)?;
        d.set_item("collectives", c.collectives.name())?;
        d.set_item("cuda_collectives", c.cuda_collectives.name())?;
        d.set_item("algorithm", c.algorithm.name())?;
        d.set_item("intra_size", c.intra_size)?;
        d.set_item("hierarchical_threshold", c.hierarchical_threshold)?;
        d.set_item("topk", c.topk)?;
        d.set_item("topk_ratio", c.topk_ratio)?;
        d.set_item("topk_threshold", c.topk_threshold)?;
        d.set_item("topk_fp16", c.topk_fp16)?;
        d.set_item("topk_momentum", c.topk_momentum)?;
        d.set_item("topk_momentum_masking", c.topk_momentum_masking)?;
        d.set_item("topk_warmup_steps", c.topk_warmup_steps)?;
        d.set_item("topk_clip_norm", c.topk_clip_norm)?;
        d.set_item("nccl_multi_rank_gpu", c.nccl_multi_rank_gpu)?;
        d.set_item("perf_check_n_steps", c.perf_check_n_steps)?;
        d.set_item("fusion_fraction", c.fusion_fraction)?;
        d.set_item("accumulate_n_steps", c.accumulate_n_steps)?;
        d.set_item("nccl_socket_ifname", c.nccl_socket_ifname.as_deref())?;
        Ok(d)
    }

    /// bool: `TIACC_TRAINING_STRICT=1`: unknown names and gradient buckets that
    /// would leave the engine are errors.
    #[getter]
    fn strict(&self) -> bool {
        self.inner.strict
    }

    /// int: Backward passes per communication of the DDP hook (1: every pass;
    /// `TIACC_TRAINING_ACCUMULATE_N_STEPS`, AIACC's
    /// `PERSEUS_ACCUMULATE_N_STEPS`).
    #[getter]
    fn accumulate_n_steps(&self) -> u64 {
        self.inner.accumulate_n_steps
    }

    /// The DDP bucket cap in bytes for a model with `gradient_bytes` bytes
    /// of gradients (AIACC's `PERSEUS_ALLREDUCE_FUSION` is a fraction of
    /// them; otherwise the fusion threshold).
    #[pyo3(text_signature = "(self, gradient_bytes: int) -> int")]
    fn bucket_bytes(&self, gradient_bytes: u64) -> u64 {
        self.inner.bucket_bytes(gradient_bytes)
    }

    /// Optional[str]: The value NCCL is to find in `NCCL_SOCKET_IFNAME` where that is
    /// unset (from AIACC's `PERSEUS_NCCL_NETWORK_INTERFACE`), else `None`.
    #[getter]
    fn nccl_socket_ifname(&self) -> Option<String> {
        self.inner.nccl_socket_ifname.clone()
    }

    /// str: What serves torch.distributed's CPU collectives: `"tiacc"`, `"tiacc-process-group"` or
    /// `"gloo"` (`TIACC_TRAINING_COLLECTIVES`).
    #[getter]
    fn collectives(&self) -> &'static str {
        self.inner.collectives.name()
    }

    /// str: What serves torch.distributed's CUDA collectives: `"nccl"` or `"tiacc"`
    /// (`TIACC_TRAINING_CUDA_COLLECTIVES`).
    #[getter]
    fn cuda_collectives(&self) -> &'static str {
        self.inner.cuda_collectives.name()
    }

    /// int: Steps between two slow-rank checks (0: off).
    #[getter]
    fn perf_check_n_steps(&self) -> u64 {
        self.inner.perf_check_n_steps
    }

    /// The settings every rank must share, as text to exchange between
    /// ranks (see `check_same_config`).
    #[pyo3(text_signature = "(self) -> str")]
    fn shared_fingerprint(&self) -> String {
        self.inner.shared_fingerprint()
    }

    /// bool: Whether DDP uses the engine at all.
    #[getter]
    fn enabled(&self) -> bool {
        self.inner.enabled
    }

    /// int: The bucket cap in bytes.
    #[getter]
    fn fusion_threshold(&self) -> u64 {
        self.inner.fusion_threshold
    }

    /// int: The number of channels.
    #[getter]
    fn num_streams(&self) -> usize {
        self.inner.num_streams
    }

    /// float: The per-collective timeout in seconds.
    #[getter]
    fn timeout(&self) -> f64 {
        self.inner.timeout.as_secs_f64()
    }

    /// Optional[str]: The address to listen on and advertise (an IP literal), if set.
    #[getter]
    fn socket_addr(&self) -> Option<String> {
        self.inner.socket_addr.map(|ip| ip.to_string())
    }

    /// str: The transport of CUDA gradients (CPU gradients always use TCP).
    #[getter]
    fn transport(&self) -> &'static str {
        self.inner.transport.name()
    }

    /// Optional[str]: The NCCL library to load instead of searching, if set.
    #[getter]
    fn nccl_library(&self) -> Option<String> {
        self.inner
            .nccl_library
            .as_ref()
            .map(|p| p.to_string_lossy().into_owned())
    }

    /// str: `auto`, `flat` or `2d`.
    #[getter]
    fn algorithm(&self) -> &'static str {
        self.inner.algorithm.name()
    }

    /// Whether Top-K sparsifies a bucket of `dtype` (`"torch.float32"`,
    /// ...) and `nbytes` bytes under these settings; the others go dense.
    #[pyo3(text_signature = "(self, dtype: str, nbytes: int) -> bool")]
    fn topk_applies(&self, dtype: &str, nbytes: usize) -> PyResult<bool> {
        let dtype = DType::parse(dtype).py()?;
        Ok(TopKOptions::from_config(&self.inner).is_some_and(|t| t.applies(dtype, nbytes)))
    }

    /// Whether NCCL `version` runs several ranks on one GPU here
    /// (`NCCL_MULTI_RANK_GPU_ENABLE` and NCCL 2.30 or later).
    #[pyo3(text_signature = "(self, version: tuple[int, int, int]) -> bool")]
    fn nccl_allows_shared_gpu(&self, version: (u32, u32, u32)) -> bool {
        config::nccl_allows_shared_gpu(version, self.inner.nccl_multi_rank_gpu)
    }

    /// The start-up report: `(lines, [(variable, warning), ...])`.
    ///
    /// `cuda` is `None` without a CUDA device, else `(transport,
    /// nccl_version or None, reason or None)` for CUDA buckets.
    #[pyo3(
        signature = (world, launcher, local_size=None, cuda=None),
        text_signature = "(self, world: int, launcher: str, local_size: Optional[int] = None, \
            cuda: Optional[tuple[str, Optional[tuple[int, int, int]], Optional[str]]] = None) \
            -> tuple[list[str], list[tuple[str, str]]]"
    )]
    #[allow(clippy::type_complexity)]
    fn startup(
        &self,
        world: usize,
        launcher: String,
        local_size: Option<usize>,
        cuda: Option<(String, Option<(u32, u32, u32)>, Option<String>)>,
    ) -> PyResult<(Vec<String>, Vec<(String, String)>)> {
        let cuda = match cuda {
            None => None,
            Some((transport, nccl_version, reason)) => Some(CudaRoute {
                transport: TransportChoice::parse("transport", &transport).py()?,
                nccl_version,
                reason,
            }),
        };
        let report = self.inner.startup(&Job {
            world,
            launcher,
            local_size,
            cuda,
        });
        let warnings = report
            .warnings
            .into_iter()
            .map(|w| (w.variable, w.message))
            .collect();
        Ok((report.lines, warnings))
    }

    fn __repr__(&self) -> String {
        format!("CommConfig({:?})", self.inner)
    }
}

/// Raises `ConfigError` naming the first shared setting whose value differs
/// between ranks (both values, and which ranks have which);
/// `fingerprints[r]` is rank `r`'s `CommConfig.shared_fingerprint()`.
#[pyfunction]
#[pyo3(text_signature = "(rank: int, fingerprints: list[str]) -> None")]
pub fn check_same_config(rank: usize, fingerprints: Vec<String>) -> PyResult<()> {
    config::check_same_on_every_rank(rank, &fingerprints).py()
}

/// The configuration from the environment, as a dict. Raises `ConfigError`
/// naming the variable when a value does not parse.
#[pyfunction]
#[pyo3(text_signature = "() -> dict[str, Any]")]
pub fn comm_config(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    PyCommConfig::from_env()?.to_dict(py)
}

/// Whether NCCL `version` runs several ranks on one GPU once
/// `NCCL_MULTI_RANK_GPU_ENABLE` is on (`enabled`): the core's rule, for
/// code that sets that variable for ranks it starts.
#[pyfunction]
#[pyo3(
    signature = (version, enabled=true),
    text_signature = "(version: tuple[int, int, int], enabled: bool = True) -> bool"
)]
pub fn nccl_allows_shared_gpu(version: (u32, u32, u32), enabled: bool) -> bool {
    config::nccl_allows_shared_gpu(version, enabled)
}
