//! The communication engine's Python face: configuration, rendezvous
//! helpers and `CommEngine`.
//!
//! The Python shim (`tiacc_training/torch/distributed.py`) owns the torch
//! objects: it exchanges addresses and the job token through the c10d
//! store and passes tensors here as (object, data pointer, byte length,
//! dtype). The object is kept alive until the collective completes.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use tiacc_core::comm::algo::{Algorithm, Flat, Groups, Hierarchy, Layout, TwoD};
use tiacc_core::comm::codec::Compression;
use tiacc_core::comm::sparse::{TopK, TopKOptions};
use tiacc_core::comm::tcp::{self, RingListener, TOKEN_LEN};
use tiacc_core::comm::{
    Collective, Completion, DType, Deadline, Engine, EngineOptions, FailureHook, Job, RawBuf,
};
use tiacc_core::config::{self, CommConfig};

use crate::errors::{to_pyerr, ResultExt};

/// The engine configuration from the environment, as a dict. Raises
/// `ConfigError` naming the variable when a value does not parse.
#[pyfunction]
pub fn comm_config(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let c = CommConfig::from_env().py()?;
    let d = PyDict::new(py);
    d.set_item("enabled", c.enabled)?;
    d.set_item("fusion_threshold", c.fusion_threshold)?;
    d.set_item("fusion_threshold_set", c.fusion_threshold_set)?;
    d.set_item("num_streams", c.num_streams)?;
    d.set_item("timeout", c.timeout.as_secs_f64())?;
    d.set_item("socket_addr", c.socket_addr.map(|ip| ip.to_string()))?;
    d.set_item("transport", c.transport.name())?;
    d.set_item(
        "nccl_library",
        c.nccl_library.map(|p| p.to_string_lossy().into_owned()),
    )?;
    d.set_item("compression", c.compression.name())?;
    d.set_item("compression_inter_only", c.compression_inter_only)?;
    d.set_item("compression_scale", c.compression_scale)?;
    d.set_item("nan_check", c.nan_check)?;
    d.set_item("two_d", c.two_d)?;
    d.set_item("intra_size", c.intra_size)?;
    d.set_item("hierarchical_threshold", c.hierarchical_threshold)?;
    d.set_item("topk", c.topk)?;
    d.set_item("topk_ratio", c.topk_ratio)?;
    d.set_item("topk_threshold", c.topk_threshold)?;
    d.set_item("topk_fp16", c.topk_fp16)?;
    Ok(d)
}

/// How this process was launched (torchrun, mpirun, SLURM) as a dict, or
/// `None` when no launcher set it up. Raises `ConfigError` on bad values.
#[pyfunction]
pub fn launch_env(py: Python<'_>) -> PyResult<Option<Bound<'_, PyDict>>> {
    let Some(l) = config::launch_env().py()? else {
        return Ok(None);
    };
    let d = PyDict::new(py);
    d.set_item("launcher", l.launcher)?;
    d.set_item("rank", l.rank)?;
    d.set_item("world_size", l.world_size)?;
    d.set_item("local_rank", l.local_rank)?;
    d.set_item("local_size", l.local_size)?;
    d.set_item("master_addr", l.master_addr)?;
    d.set_item("master_port", l.master_port)?;
    Ok(Some(d))
}

/// Validates a `num_streams` value given as a Python argument.
#[pyfunction]
pub fn check_num_streams(value: &str) -> PyResult<usize> {
    config::parse_num_streams("num_streams", value).py()
}

/// Validates a `transport` value given as a Python argument; returns its
/// canonical name (`auto`, `nccl` or `tcp`).
#[pyfunction]
pub fn check_transport(value: &str) -> PyResult<&'static str> {
    config::TransportChoice::parse("transport", value)
        .map(|t| t.name())
        .py()
}

/// A fresh random job token.
#[pyfunction]
pub fn random_token(py: Python<'_>) -> PyResult<Bound<'_, PyBytes>> {
    let token = tcp::random_token().py()?;
    Ok(PyBytes::new(py, &token))
}

/// The local IP address that routes to `host` (for advertising).
#[pyfunction]
pub fn local_addr_towards(host: &str, port: u16) -> String {
    tcp::local_addr_towards(host, port).to_string()
}

/// One process's communication engine over TCP.
///
/// Created with the rank, world size, channel count and timeout; it listens
/// at once (`address`). After every rank's address and the job token have
/// been exchanged, `connect` forms the rings and starts the channel threads.
#[pyclass(module = "tiacc_training._engine")]
pub struct CommEngine {
    rank: usize,
    size: usize,
    num_channels: usize,
    timeout: Duration,
    listener: Option<RingListener>,
    address: String,
    options: EngineOptions,
    /// The 2D allreduce's groups, when it is on.
    two_d: Option<TwoDSetup>,
    /// Top-K sparsification, when it is on.
    topk: Option<TopKOptions>,
    engine: Option<Engine>,
}

/// Listeners and settings of the 2D allreduce's two groups.
struct TwoDSetup {
    layout: Layout,
    threshold: u64,
    inter_compression: Compression,
    intra: Option<RingListener>,
    inter: Option<RingListener>,
    intra_address: String,
    inter_address: String,
}

#[pymethods]
impl CommEngine {
    #[new]
    #[pyo3(signature = (
        rank, size, num_channels, timeout, host,
        compression="none", compression_scale=1.0, nan_check=false,
        intra_size=None, hierarchical_threshold=1073741824, compression_inter_only=false,
        topk_ratio=None, topk_threshold=1048576, topk_fp16=false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        rank: usize,
        size: usize,
        num_channels: usize,
        timeout: f64,
        host: &str,
        compression: &str,
        compression_scale: f64,
        nan_check: bool,
        intra_size: Option<usize>,
        hierarchical_threshold: u64,
        compression_inter_only: bool,
        topk_ratio: Option<f64>,
        topk_threshold: u64,
        topk_fp16: bool,
    ) -> PyResult<Self> {
        if let Some(r) = topk_ratio {
            if !(r > 0.0 && r <= 1.0) {
                return Err(PyValueError::new_err(format!(
                    "topk_ratio must be in (0, 1], got {r}"
                )));
            }
        }
        let topk = topk_ratio.map(|ratio| TopKOptions {
            ratio,
            threshold: topk_threshold,
            fp16_values: topk_fp16,
        });
        let mut compression = Compression::parse("compression", compression).py()?;
        if !(compression_scale.is_finite() && compression_scale > 0.0) {
            return Err(PyValueError::new_err(format!(
                "compression_scale must be a positive number, got {compression_scale}"
            )));
        }
        if size == 0 || rank >= size {
            return Err(PyValueError::new_err(format!(
                "rank {rank} is not a rank of a group of {size}"
            )));
        }
        if !(1..=config::MAX_NUM_STREAMS).contains(&num_channels) {
            return Err(PyValueError::new_err(format!(
                "num_channels must be from 1 to {}, got {num_channels}",
                config::MAX_NUM_STREAMS
            )));
        }
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(PyValueError::new_err(format!(
                "timeout must be a positive number of seconds, got {timeout}"
            )));
        }
        let ip: IpAddr = host.parse().map_err(|_| {
            PyValueError::new_err(format!("host must be an IP address, got {host:?}"))
        })?;
        let listener = RingListener::bind(ip).py()?;
        let address = listener.addr().to_string();
        let two_d = match intra_size {
            None => None,
            Some(intra_size) => {
                let layout = Layout::new(rank, size, intra_size).py()?;
                let intra = RingListener::bind(ip).py()?;
                let inter = RingListener::bind(ip).py()?;
                // With the 2D allreduce, "between nodes only" is exactly its
                // inter-node step; the intra-node steps stay full precision.
                let inter_compression = if compression_inter_only {
                    std::mem::replace(&mut compression, Compression::None)
                } else {
                    Compression::None
                };
                Some(TwoDSetup {
                    layout,
                    threshold: hierarchical_threshold,
                    inter_compression,
                    intra_address: intra.addr().to_string(),
                    inter_address: inter.addr().to_string(),
                    intra: Some(intra),
                    inter: Some(inter),
                })
            }
        };
        Ok(CommEngine {
            rank,
            size,
            num_channels,
            timeout: Duration::from_secs_f64(timeout),
            listener: Some(listener),
            address,
            options: EngineOptions {
                compression,
                compression_scale,
                nan_check,
            },
            two_d,
            topk,
            engine: None,
        })
    }

    /// `ip:port` this rank listens on.
    #[getter]
    fn address(&self) -> &str {
        &self.address
    }

    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    #[getter]
    fn size(&self) -> usize {
        self.size
    }

    #[getter]
    fn num_channels(&self) -> usize {
        self.num_channels
    }

    #[getter]
    fn timeout(&self) -> f64 {
        self.timeout.as_secs_f64()
    }

    /// `ip:port` of this rank's intra-node and inter-node listeners, when
    /// the 2D allreduce is on.
    #[getter]
    fn two_d_addresses(&self) -> Option<(String, String)> {
        self.two_d
            .as_ref()
            .map(|t| (t.intra_address.clone(), t.inter_address.clone()))
    }

    /// World ranks of this rank's node and of its inter-node group, when the
    /// 2D allreduce is on.
    #[getter]
    fn two_d_members(&self) -> Option<(Vec<usize>, Vec<usize>)> {
        self.two_d
            .as_ref()
            .map(|t| (t.layout.intra_members(), t.layout.inter_members()))
    }

    /// The wire compression (`none`, `fp16`, `bf16`).
    #[getter]
    fn compression(&self) -> &'static str {
        self.options.compression.name()
    }

    /// Whether buckets are checked for NaN/infinity before sending.
    #[getter]
    fn nan_check(&self) -> bool {
        self.options.nan_check
    }

    /// Whether `connect` has completed and `shutdown` has not run.
    #[getter]
    fn connected(&self) -> bool {
        self.engine.is_some()
    }

    /// Forms the rings with every rank's `addresses` (indexed by rank) and
    /// the job `token`, then starts the channel threads. Blocks (without the
    /// GIL) until every connection is up or the timeout passes.
    ///
    /// `on_failure(message) -> str | None`, if given, is called when a
    /// collective fails, before peers can notice; it may publish the message
    /// and return the job's first published failure (appended to errors).
    ///
    /// With the 2D allreduce on, `intra_addresses` and `inter_addresses` are
    /// the members' `two_d_addresses` (in `two_d_members` order).
    #[pyo3(signature = (addresses, token, on_failure=None, intra_addresses=None, inter_addresses=None))]
    fn connect(
        &mut self,
        py: Python<'_>,
        addresses: Vec<String>,
        token: &[u8],
        on_failure: Option<Py<PyAny>>,
        intra_addresses: Option<Vec<String>>,
        inter_addresses: Option<Vec<String>>,
    ) -> PyResult<()> {
        if addresses.len() != self.size {
            return Err(PyValueError::new_err(format!(
                "expected {} addresses (one per rank), got {}",
                self.size,
                addresses.len()
            )));
        }
        let token: [u8; TOKEN_LEN] = token.try_into().map_err(|_| {
            PyValueError::new_err(format!(
                "the job token must be {TOKEN_LEN} bytes, got {}",
                token.len()
            ))
        })?;
        let addrs = parse_addresses(&addresses)?;
        // The 2D groups: (listener, member addresses, index in the group).
        let mut groups_2d = None;
        if let Some(t) = self.two_d.as_mut() {
            let (Some(intra_list), Some(inter_list)) = (intra_addresses, inter_addresses) else {
                return Err(PyValueError::new_err(
                    "the 2D allreduce is on: connect() needs intra_addresses and inter_addresses",
                ));
            };
            let (intra_n, inter_n) = (t.layout.intra_size, t.layout.nodes());
            if intra_list.len() != intra_n || inter_list.len() != inter_n {
                return Err(PyValueError::new_err(format!(
                    "expected {intra_n} intra-node and {inter_n} inter-node addresses, got {} and {}",
                    intra_list.len(),
                    inter_list.len()
                )));
            }
            let (Some(intra), Some(inter)) = (t.intra.take(), t.inter.take()) else {
                return Err(PyValueError::new_err(
                    "connect() was already called on this engine",
                ));
            };
            groups_2d = Some((
                (intra, parse_addresses(&intra_list)?, t.layout.local_rank()),
                (inter, parse_addresses(&inter_list)?, t.layout.node()),
                t.threshold,
                t.inter_compression,
            ));
        }
        let listener = self
            .listener
            .take()
            .ok_or_else(|| PyValueError::new_err("connect() was already called on this engine"))?;
        let (rank, channels, timeout, options, topk) = (
            self.rank,
            self.num_channels,
            self.timeout,
            self.options,
            self.topk,
        );
        // The channel's algorithm: dense (flat or 2D), optionally inside Top-K.
        let wrap = move |dense: Box<dyn Algorithm>| -> Box<dyn Algorithm> {
            match topk {
                Some(o) => Box::new(TopK::new(o, dense)),
                None => dense,
            }
        };
        let hook: Option<FailureHook> = on_failure.map(|callback| {
            Arc::new(move |err: &tiacc_core::Error| {
                let message = err.to_string();
                Python::try_attach(|py| match callback.call1(py, (message,)) {
                    Ok(first) => first.extract::<Option<String>>(py).ok().flatten(),
                    Err(e) => {
                        e.write_unraisable(py, None);
                        None
                    }
                })
                .flatten()
            }) as FailureHook
        });
        let engine = py
            .detach(move || {
                let deadline = Deadline::after(timeout);
                let world = listener.connect(&addrs, rank, &token, channels, deadline)?;
                let Some((intra, inter, threshold, inter_compression)) = groups_2d else {
                    let spec = world
                        .into_iter()
                        .map(|r| (Groups::flat(Box::new(r)), wrap(Box::new(Flat))))
                        .collect();
                    return Engine::with_channels(spec, timeout, options, hook);
                };
                let intra_rings = intra
                    .0
                    .connect(&intra.1, intra.2, &token, channels, deadline)?;
                let inter_rings = inter
                    .0
                    .connect(&inter.1, inter.2, &token, channels, deadline)?;
                let spec = world
                    .into_iter()
                    .zip(intra_rings.into_iter().zip(inter_rings))
                    .map(|(w, (a, e))| {
                        let groups = Groups {
                            world: Box::new(w),
                            hierarchy: Some(Hierarchy {
                                intra: Box::new(a),
                                inter: Box::new(e),
                            }),
                        };
                        let algorithm = wrap(Box::new(TwoD {
                            threshold,
                            inter_compression,
                            scale: options.compression_scale,
                        }));
                        (groups, algorithm)
                    })
                    .collect();
                Engine::with_channels(spec, timeout, options, hook)
            })
            .py()?;
        self.engine = Some(engine);
        Ok(())
    }

    /// Queues an allreduce of a tensor's `nbytes` bytes at `ptr` and returns
    /// at once; `future.set_result(tensor)` (or `set_exception`) is called
    /// from the channel thread when it finishes. The caller must not touch
    /// the tensor's memory until then; this object keeps it alive.
    #[pyo3(signature = (tensor, ptr, nbytes, dtype, bucket, average, future))]
    #[allow(clippy::too_many_arguments)]
    fn allreduce_async(
        &self,
        tensor: Py<PyAny>,
        ptr: usize,
        nbytes: usize,
        dtype: &str,
        bucket: u64,
        average: bool,
        future: Py<PyAny>,
    ) -> PyResult<()> {
        let engine = self.engine()?;
        let dtype = DType::parse(dtype).py()?;
        check_buffer(ptr, nbytes, Some(dtype))?;
        let done: Completion = Box::new(move |result| {
            // No attach while the interpreter shuts down: the future has no
            // one left to wait on it.
            Python::try_attach(|py| {
                let outcome = match result {
                    Ok(()) => future.call_method1(py, "set_result", (tensor,)),
                    Err(err) => {
                        let exc = to_pyerr(err).into_value(py);
                        future.call_method1(py, "set_exception", (exc,))
                    }
                };
                if let Err(err) = outcome {
                    err.write_unraisable(py, None);
                }
            });
        });
        // SAFETY: the Python shim passes a live tensor's data pointer and byte
        // size; `tensor` is moved into the completion, so its storage lives
        // until the job is done, and DDP does not touch a bucket's buffer
        // before the returned future completes.
        let buf = unsafe { RawBuf::new(ptr as *mut u8, nbytes) };
        engine.submit(Job {
            op: Collective::Allreduce { average },
            buf,
            dtype,
            bucket,
            done,
        });
        Ok(())
    }

    /// Allreduces `nbytes` bytes at `ptr` in place and waits (GIL released).
    #[pyo3(signature = (ptr, nbytes, dtype, bucket=0, average=false))]
    fn allreduce(
        &self,
        py: Python<'_>,
        ptr: usize,
        nbytes: usize,
        dtype: &str,
        bucket: u64,
        average: bool,
    ) -> PyResult<()> {
        let dtype = DType::parse(dtype).py()?;
        self.run_blocking(
            py,
            Collective::Allreduce { average },
            ptr,
            nbytes,
            Some(dtype),
            bucket,
        )
    }

    /// Copies `root`'s `nbytes` bytes at `ptr` to every rank and waits.
    #[pyo3(signature = (ptr, nbytes, root, bucket=0))]
    fn broadcast(
        &self,
        py: Python<'_>,
        ptr: usize,
        nbytes: usize,
        root: usize,
        bucket: u64,
    ) -> PyResult<()> {
        if root >= self.size {
            return Err(PyValueError::new_err(format!(
                "root {root} is not a rank of a group of {}",
                self.size
            )));
        }
        // Bytes travel as-is; the dtype is not used.
        self.run_blocking(
            py,
            Collective::Broadcast { root },
            ptr,
            nbytes,
            None,
            bucket,
        )
    }

    /// Waits until every rank has entered the barrier.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        self.run_blocking(py, Collective::Barrier, 0, 0, None, 0)
    }

    /// Finishes queued collectives and stops the channel threads. Safe to
    /// call twice.
    fn shutdown(&mut self, py: Python<'_>) {
        self.listener = None;
        if let Some(mut engine) = self.engine.take() {
            py.detach(move || engine.shutdown());
        }
    }
}

impl CommEngine {
    fn engine(&self) -> PyResult<&Engine> {
        self.engine.as_ref().ok_or_else(|| {
            to_pyerr(tiacc_core::Error::Comm {
                peer: None,
                message: format!(
                    "rank {}: the communication engine is not connected (call connect() first) or was shut down",
                    self.rank
                ),
            })
        })
    }

    fn run_blocking(
        &self,
        py: Python<'_>,
        op: Collective,
        ptr: usize,
        nbytes: usize,
        dtype: Option<DType>,
        bucket: u64,
    ) -> PyResult<()> {
        let engine = self.engine()?;
        check_buffer(ptr, nbytes, dtype)?;
        let addr = ptr;
        py.detach(move || {
            let buf: &mut [u8] = if nbytes == 0 {
                &mut []
            } else {
                // SAFETY: the caller passes a live buffer of `nbytes` bytes
                // (non-null, checked above) that it keeps alive and untouched
                // for the duration of this blocking call (the Python shim
                // holds the tensor in its frame).
                unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, nbytes) }
            };
            engine.run(op, buf, dtype.unwrap_or(DType::F32), bucket)
        })
        .py()
    }
}

fn parse_addresses(addresses: &[String]) -> PyResult<Vec<SocketAddr>> {
    addresses
        .iter()
        .enumerate()
        .map(|(i, a)| {
            a.parse::<SocketAddr>()
                .map_err(|_| PyValueError::new_err(format!("address #{i} {a:?} is not ip:port")))
        })
        .collect()
}

fn check_buffer(ptr: usize, nbytes: usize, dtype: Option<DType>) -> PyResult<()> {
    if nbytes > 0 && ptr == 0 {
        return Err(PyValueError::new_err(
            "null data pointer for a non-empty buffer",
        ));
    }
    let Some(dtype) = dtype else {
        return Ok(());
    };
    if nbytes % dtype.size() != 0 {
        return Err(PyValueError::new_err(format!(
            "{nbytes} bytes is not a whole number of {} elements",
            dtype.name()
        )));
    }
    Ok(())
}
