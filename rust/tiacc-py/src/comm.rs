//! The CPU engine's Python face: launch detection, rendezvous helpers, the
//! failure board over the c10d store and the getters both engines share
//! (with `device.rs`), and `CommEngine`, which converts for the core's
//! [`setup::CommEngine`] (where the engine is set up, connected and its
//! algorithm decided).
//!
//! The Python shim (`tiacc_training/torch/distributed/`) owns the torch
//! objects: it exchanges addresses and the job token through the c10d
//! store and passes tensors here as (object, data pointer, byte length,
//! dtype). The object is kept alive until the collective completes.

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use tiacc_core::comm::collective::check_root;
use tiacc_core::comm::progress::{self, RankTimes, StepTimes};
use tiacc_core::comm::setup::{self, EngineSetup, TcpSetup};
use tiacc_core::comm::tcp;
use tiacc_core::comm::{
    Collective, CollectiveCall, Completion, Counters, DType, Engine, FailureBoard, Job, RawBuf,
    Reduce, Runner, SharedBytes,
};
use tiacc_core::config;

use crate::config::PyCommConfig;
use crate::errors::{to_pyerr, ResultExt};
use crate::store::{engine_setup, PyStore};

/// How this process was launched (`tiacc_core::config::launch_env`: torchrun,
/// mpirun, SLURM, horovodrun, MPICH, PMIx) as a dict, or
/// `None` when no launcher set it up. Raises `ConfigError` on bad values.
#[pyfunction]
#[pyo3(text_signature = "() -> Optional[dict[str, Any]]")]
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

/// A fresh random job token.
#[pyfunction]
#[pyo3(text_signature = "() -> bytes")]
pub fn random_token(py: Python<'_>) -> PyResult<Bound<'_, PyBytes>> {
    let token = tcp::random_token().py()?;
    Ok(PyBytes::new(py, &token))
}

/// The local IP address that routes to `host` (for advertising).
#[pyfunction]
#[pyo3(text_signature = "(host: str, port: int) -> str")]
pub fn local_addr_towards(host: &str, port: u16) -> String {
    tcp::local_addr_towards(host, port).to_string()
}

/// This host's network interfaces that have an IPv4 address, in the
/// system's order, as `(name, address, prefix length or None)`.
#[pyfunction]
#[pyo3(text_signature = "() -> list[tuple[str, str, Optional[int]]]")]
pub fn network_interfaces() -> PyResult<Vec<(String, String, Option<u8>)>> {
    let interfaces = config::system_interfaces().py()?;
    Ok(interfaces
        .into_iter()
        .filter_map(|i| i.ipv4.map(|ip| (i.name, ip.to_string(), i.prefix_len)))
        .collect())
}

/// The interface this host reaches other hosts through when no variable
/// names one and the route to the rendezvous stays on this host
/// (`tiacc_core::config::outward_interface`), as `(name, address)`, or
/// `None` when it has none but loopback and local bridges.
#[pyfunction]
#[pyo3(text_signature = "() -> Optional[tuple[str, str]]")]
pub fn outward_interface() -> PyResult<Option<(String, String)>> {
    let interfaces = config::system_interfaces().py()?;
    Ok(config::outward_interface(&interfaces)
        .and_then(|i| i.ipv4.map(|ip| (i.name.clone(), ip.to_string()))))
}

/// The lines rank 0 logs about clearly slow ranks (empty: none), from every
/// rank's `(rank, host, gpu or None, steps, compute seconds, communication
/// seconds)`; see `tiacc_core::comm::progress::slow_ranks` for the rule.
#[pyfunction]
#[pyo3(
    text_signature = "(samples: list[tuple[int, str, Optional[str], int, float, float]]) \
        -> list[str]"
)]
pub fn slow_ranks(samples: Vec<(usize, String, Option<String>, u64, f64, f64)>) -> Vec<String> {
    let ranks: Vec<RankTimes> = samples
        .into_iter()
        .map(|(rank, host, gpu, steps, compute, comm)| RankTimes {
            rank,
            host,
            gpu,
            times: StepTimes {
                steps,
                compute,
                comm,
            },
        })
        .collect();
    progress::slow_ranks(&ranks)
}

/// The element types the engine's collectives carry, by torch name
/// (`"float32"`, `"int64"`, `"bool"`, ...): torch.distributed's CPU
/// collectives of other types are forwarded to gloo.
#[pyfunction]
#[pyo3(text_signature = "() -> list[str]")]
pub fn collective_dtypes() -> Vec<&'static str> {
    DType::ALL.iter().map(|d| d.name()).collect()
}

/// The reductions the engine's collectives compute (`"sum"`, `"product"`,
/// `"min"`, `"max"`, and `"avg"`: the sum divided by the world size, the
/// quotient rounded toward zero for integers; not for bool).
#[pyfunction]
#[pyo3(text_signature = "() -> list[str]")]
pub fn collective_ops() -> Vec<&'static str> {
    Reduce::names()
}

/// The job's failure board, a Python object with `publish(message) -> str |
/// None`, `peek() -> str | None`, `record(rank, text)` and `records(size) ->
/// list[str | None]` (the c10d store underneath).
pub(crate) struct PyBoard(Py<PyAny>);

impl FailureBoard for PyBoard {
    fn publish(&self, message: &str) -> Option<String> {
        self.call("publish", Some(message))
    }

    fn peek(&self) -> Option<String> {
        self.call("peek", None)
    }

    fn record_progress(&self, rank: usize, record: &str) {
        Python::try_attach(|py| {
            if let Err(e) = self.0.call_method1(py, "record", (rank, record)) {
                e.write_unraisable(py, None);
            }
        });
    }

    fn progress(&self, size: usize) -> Vec<Option<String>> {
        Python::try_attach(|py| match self.0.call_method1(py, "records", (size,)) {
            Ok(list) => list.extract::<Vec<Option<String>>>(py).ok(),
            Err(e) => {
                e.write_unraisable(py, None);
                None
            }
        })
        .flatten()
        .filter(|v| v.len() == size)
        .unwrap_or_else(|| vec![None; size])
    }
}

impl PyBoard {
    pub(crate) fn wrap(board: Option<Py<PyAny>>) -> Option<Arc<dyn FailureBoard>> {
        board.map(|b| Arc::new(PyBoard(b)) as Arc<dyn FailureBoard>)
    }

    fn call(&self, method: &str, message: Option<&str>) -> Option<String> {
        // No attach while the interpreter shuts down: nobody is left to tell.
        Python::try_attach(|py| {
            let result = match message {
                Some(m) => self.0.call_method1(py, method, (m,)),
                None => self.0.call_method0(py, method),
            };
            match result {
                Ok(first) => first.extract::<Option<String>>(py).ok().flatten(),
                Err(e) => {
                    e.write_unraisable(py, None);
                    None
                }
            }
        })
        .flatten()
    }
}

/// An engine's counters as Python sees them (both engines' `counters()`):
/// `{(path, codec): {"buckets", "bytes_in", "wire_bytes", "wire": {"world",
/// "intra", "inter"}}}` for every path and codec that carried a bucket
/// (`tiacc_core::comm::counters`). `None` (an engine not connected yet)
/// gives an empty dict.
pub(crate) fn counters_dict<'py>(
    py: Python<'py>,
    counters: Option<&Counters>,
) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    for row in counters.map(Counters::snapshot).unwrap_or_default() {
        let wire = PyDict::new(py);
        for (name, bytes) in ["world", "intra", "inter"].into_iter().zip(row.wire) {
            wire.set_item(name, bytes)?;
        }
        let entry = PyDict::new(py);
        entry.set_item("buckets", row.buckets)?;
        entry.set_item("bytes_in", row.bytes_in)?;
        entry.set_item("wire_bytes", row.wire_total())?;
        entry.set_item("wire", wire)?;
        out.set_item((row.path.name(), row.codec.name()), entry)?;
    }
    Ok(out)
}

/// What both engines (`CommEngine`, `DeviceEngine`) show of their set-up: the
/// configuration object they were built from (field `config`), what their
/// core engine's [`EngineSetup`] holds and their listeners' addresses (from
/// inherent `fn setup(&self) -> &EngineSetup` and `fn tcp_setup(&self) ->
/// Option<&TcpSetup>`), and the channel a bucket runs on.
macro_rules! engine_setup_view {
    ($engine:ty) => {
        #[pymethods]
        impl $engine {
            /// CommConfig: The configuration this engine was built from.
            #[getter]
            fn config(&self, py: Python<'_>) -> Py<PyCommConfig> {
                self.config.clone_ref(py)
            }

            /// int: This rank.
            #[getter]
            fn rank(&self) -> usize {
                self.setup().rank()
            }

            /// int: The number of ranks.
            #[getter]
            fn size(&self) -> usize {
                self.setup().size()
            }

            /// int: The number of channels.
            #[getter]
            fn num_channels(&self) -> usize {
                self.setup().num_channels()
            }

            /// The channel (with NCCL, the CUDA stream) bucket `bucket` runs on.
            #[pyo3(text_signature = "(self, bucket: int) -> int")]
            fn channel_of(&self, bucket: u64) -> usize {
                tiacc_core::comm::engine::channel_of(bucket, self.setup().num_channels())
            }

            /// float: The per-collective timeout in seconds.
            #[getter]
            fn timeout(&self) -> f64 {
                self.setup().timeout().as_secs_f64()
            }

            /// str: The wire compression of whole buckets (`none`, `fp16`, `bf16`).
            #[getter]
            fn compression(&self) -> &'static str {
                self.setup().settings().compression.name()
            }

            /// bool: Whether buckets are checked for NaN/infinity before sending.
            #[getter]
            fn nan_check(&self) -> bool {
                self.setup().settings().nan_check
            }

            /// bool: Whether buckets take the 2D allreduce (up to the hierarchical
            /// threshold), as forced or as `auto` chose.
            #[getter]
            fn two_d(&self) -> bool {
                self.setup().two_d()
            }

            /// Optional[str]: The line explaining what
            /// `TIACC_TRAINING_ALGORITHM=auto` measured and chose when the engine
            /// connected, or `None` when it did not run (a forced choice, or no whole
            /// nodes of several ranks).
            #[getter]
            fn auto_choice(&self) -> Option<String> {
                self.setup().auto_choice().map(str::to_string)
            }

            /// Optional[str]: The line rank 0 logs when a group (`group=True`)
            /// runs flat because its ranks do not form whole nodes, else `None`.
            #[getter]
            fn layout_note(&self) -> Option<String> {
                self.setup().layout_note().map(str::to_string)
            }

            /// Optional[tuple[list[int], list[int]]]: World ranks of this rank's
            /// node and of its inter-node group, when the 2D groups are connected.
            #[getter]
            fn two_d_members(&self) -> Option<(Vec<usize>, Vec<usize>)> {
                self.setup().two_d_members()
            }

            /// Optional[str]: `ip:port` this rank listens on (TCP rings, before connecting).
            #[getter]
            fn address(&self) -> Option<String> {
                self.tcp_setup().and_then(TcpSetup::address)
            }

            /// Optional[tuple[str, str]]: `ip:port` of this rank's intra-node and
            /// inter-node listeners, when the 2D groups are on (TCP rings, before
            /// connecting).
            #[getter]
            fn two_d_addresses(&self) -> Option<(String, String)> {
                self.tcp_setup().and_then(TcpSetup::two_d_addresses)
            }
        }
    };
}
pub(crate) use engine_setup_view;

/// An allreduce's result left in memory the ranks of one host share
/// (`CommEngine.allreduce_async(..., share=True)`): `ptr` and `nbytes`
/// describe it, and the memory stays mapped while this object lives.
#[pyclass(module = "tiacc_training._engine", frozen)]
pub struct SharedResult {
    bytes: SharedBytes,
}

#[pymethods]
impl SharedResult {
    /// int: Address of the first byte.
    #[getter]
    fn ptr(&self) -> usize {
        self.bytes.as_ptr() as usize
    }

    /// int: Length in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.bytes.len()
    }

    fn __repr__(&self) -> String {
        format!("SharedResult(nbytes={})", self.bytes.len())
    }
}

/// One process's communication engine for CPU buckets over TCP.
///
/// Created from the configuration, the rank and world size, the address to
/// listen on and (for the 2D groups) the store and prefix under which the
/// ranks agree their node layout; it listens at once (`address`). After
/// every rank's address and the job token have been exchanged, `connect`
/// forms the rings and starts the channel threads.
#[pyclass(module = "tiacc_training._engine")]
pub struct CommEngine {
    /// The configuration object it was built from (the `config` getter).
    config: Py<PyCommConfig>,
    core: setup::CommEngine,
}

#[pymethods]
impl CommEngine {
    /// `channels` overrides the configuration's number of channels (the
    /// torch.distributed backend runs its collectives in order on one).
    #[new]
    #[pyo3(
        signature = (
            config, rank, size, host, board=None, local_size=None, local_rank=None,
            store=None, prefix=None, group=false, channels=None
        ),
        text_signature = "(config: CommConfig, rank: int, size: int, host: str, board: Any = None, \
            local_size: Optional[int] = None, local_rank: Optional[int] = None, \
            store: Any = None, prefix: Optional[str] = None, group: bool = False, \
            channels: Optional[int] = None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        config: Bound<'_, PyCommConfig>,
        rank: usize,
        size: usize,
        host: &str,
        board: Option<Py<PyAny>>,
        local_size: Option<usize>,
        local_rank: Option<usize>,
        store: Option<Py<PyAny>>,
        prefix: Option<&str>,
        group: bool,
        channels: Option<usize>,
    ) -> PyResult<Self> {
        let placement = setup::Placement {
            local_size,
            local_rank,
        };
        let mut agreed = engine_setup(&config, rank, size, placement, store, prefix, group)?;
        if let Some(n) = channels {
            agreed = agreed.with_channels(n).py()?;
        }
        let core = setup::CommEngine::new(agreed, host, PyBoard::wrap(board)).py()?;
        Ok(CommEngine {
            config: config.unbind(),
            core,
        })
    }

    /// bool: Whether `connect` has completed and `shutdown` has not run.
    #[getter]
    fn connected(&self) -> bool {
        self.core.connected()
    }

    /// dict[str, str]: What carries each group's bytes, once connected:
    /// `"world"` (and with the 2D groups `"intra-node"` and `"inter-node"`)
    /// to `"tcp"` or `"shared memory"`. Ranks of one host use shared memory unless
    /// `TIACC_TRAINING_SHM=0`, or it could not be set up (said once on
    /// stderr, except for groups that span nodes).
    #[getter]
    fn transports(&self) -> std::collections::BTreeMap<&'static str, &'static str> {
        self.core.media().iter().copied().collect()
    }

    /// Forms the rings with every rank's addresses and the job token,
    /// exchanged through `store` (a c10d store) under keys starting with
    /// `prefix`, then starts the channel threads. Waits at most `timeout`
    /// seconds for the other ranks' keys (`CommTimeoutError` names those
    /// missing) and for every connection; blocks without the GIL except
    /// while calling the store.
    #[pyo3(text_signature = "(self, store: Any, prefix: str, timeout: float) -> None")]
    fn connect_store(
        &mut self,
        py: Python<'_>,
        store: Py<PyAny>,
        prefix: &str,
        timeout: f64,
    ) -> PyResult<()> {
        let (rank, core) = (self.core.setup().rank(), &mut self.core);
        PyStore::through(py, store, prefix, rank, timeout, |rendezvous| {
            py.detach(move || core.connect_through(rendezvous))
        })
    }

    /// Queues an allreduce of a tensor's `nbytes` bytes at `ptr` and returns
    /// at once; `future.set_result(tensor)` (or `set_exception`) is called
    /// from the channel thread when it finishes. The caller must not touch
    /// the tensor's memory until then; this object keeps it alive.
    ///
    /// With `share`, the result may instead stay in memory the ranks of the
    /// host share: the future's value is then a `SharedResult` and the
    /// tensor's bytes are scratch. Its bytes stay the result until the next
    /// `share` allreduce of the same bucket and size starts (DDP reads a
    /// bucket's result before the next backward pass).
    #[pyo3(
        signature = (tensor, ptr, nbytes, dtype, bucket, average, future, share=false),
        text_signature = "(self, tensor: Any, ptr: int, nbytes: int, dtype: str, bucket: int, \
            average: bool, future: Any, share: bool = False) -> None"
    )]
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
        share: bool,
    ) -> PyResult<()> {
        let engine = self.engine()?;
        let dtype = DType::parse(dtype).py()?;
        check_buffer(ptr, nbytes, Some(dtype))?;
        let done = completion(tensor, future);
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
            share,
            done,
        });
        Ok(())
    }

    /// Queues one of torch.distributed's collectives on the tensor
    /// memory of `nbytes` bytes at `ptr` (elements of `dtype`) and returns
    /// at once; `future.set_result(tensor)` (or `set_exception`) is called
    /// from the channel thread when it finishes, as for
    /// `allreduce_async`, and `tensor` is kept alive until then.
    ///
    /// `collective` is `"allreduce"` (with `reduce`: `"sum"`, `"product"`,
    /// `"min"`, `"max"`, or `"avg"`, the sum divided by the world size),
    /// `"reduce_scatter"` (with `reduce`; the result is this rank's equal
    /// shard of the buffer, the rest is scratch), `"allgather"` (this
    /// rank's equal shard to every rank), `"alltoall"` (equal blocks),
    /// `"broadcast"` (from `root`) or `"barrier"` (no buffer). Collectives
    /// run in submission order on the channel of `bucket`.
    #[pyo3(
        signature = (collective, tensor, ptr, nbytes, dtype, future, reduce="sum", root=0, bucket=0),
        text_signature = "(self, collective: str, tensor: Any, ptr: int, nbytes: int, dtype: str, \
            future: Any, reduce: str = 'sum', root: int = 0, bucket: int = 0) -> None"
    )]
    #[allow(clippy::too_many_arguments)]
    fn collective_async(
        &self,
        collective: &str,
        tensor: Py<PyAny>,
        ptr: usize,
        nbytes: usize,
        dtype: &str,
        future: Py<PyAny>,
        reduce: &str,
        root: usize,
        bucket: u64,
    ) -> PyResult<()> {
        let engine = self.engine()?;
        let dtype = DType::parse(dtype).py()?;
        let call = CollectiveCall::parse(Runner::Host, collective, reduce).py()?;
        let size = self.core.setup().size();
        let op = call.job(root, size).py()?;
        check_buffer(ptr, nbytes, Some(dtype))?;
        call.check(dtype, nbytes, size).py()?;
        let done = completion(tensor, future);
        // SAFETY: the Python shim passes a live tensor's data pointer and
        // byte size; `tensor` is moved into the completion, so its storage
        // lives until the job is done, and the shim does not touch the
        // memory before the future completes (torch's contract for an
        // asynchronous collective's tensors).
        let buf = unsafe { RawBuf::new(ptr as *mut u8, nbytes) };
        engine.submit(Job {
            op,
            buf,
            dtype,
            bucket,
            share: false,
            done,
        });
        Ok(())
    }

    /// Allreduces `nbytes` bytes at `ptr` in place and waits (GIL released).
    #[pyo3(
        signature = (ptr, nbytes, dtype, bucket=0, average=false),
        text_signature = "(self, ptr: int, nbytes: int, dtype: str, bucket: int = 0, \
            average: bool = False) -> None"
    )]
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
    #[pyo3(
        signature = (ptr, nbytes, root, bucket=0),
        text_signature = "(self, ptr: int, nbytes: int, root: int, bucket: int = 0) -> None"
    )]
    fn broadcast(
        &self,
        py: Python<'_>,
        ptr: usize,
        nbytes: usize,
        root: usize,
        bucket: u64,
    ) -> PyResult<()> {
        check_root(root, self.core.setup().size()).py()?;
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
    #[pyo3(text_signature = "(self) -> None")]
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        self.run_blocking(py, Collective::Barrier, 0, 0, None, 0)
    }

    /// `(steps, compute seconds, communication seconds)` since the last call
    /// (see `tiacc_core::comm::progress`); call it just before a step's
    /// first bucket. Zeros before `connect`.
    #[pyo3(text_signature = "(self) -> tuple[int, float, float]")]
    fn step_times(&self) -> (u64, f64, f64) {
        self.core.engine().ok().map_or((0, 0.0, 0.0), |e| {
            let t = e.progress().take_times();
            (t.steps, t.compute, t.comm)
        })
    }

    /// What the engine carried so far (see `counters_dict`); empty before
    /// `connect`, kept after `shutdown`.
    #[pyo3(text_signature = "(self) -> dict[tuple[str, str], EngineCounters]")]
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        counters_dict(py, self.core.counters())
    }

    /// The engine's state across steps (Top-K's residuals, the momentum
    /// correction's buffers and each bucket's step count) as a dict (see
    /// `tiacc_training.torch.distributed._engine_state`), read once the
    /// collectives queued before this call are done; waits without the GIL.
    /// Raises `CommError` once the engine failed or was shut down.
    #[pyo3(text_signature = "(self) -> dict[str, Any]")]
    fn state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let engine = self.engine()?;
        let state = py.detach(|| engine.export_state()).py()?;
        crate::state::to_dict(py, &state)
    }

    /// Replaces the engine's state across steps with `state` (a dict as
    /// `state()` returns), each bucket's on the channel it runs on, after
    /// the collectives queued before; waits without the GIL. Raises
    /// `ValueError` naming the key when `state` is malformed or does not
    /// fit this engine (another rank, world size or setting, a bucket of
    /// another size); nothing is imported then.
    #[pyo3(text_signature = "(self, state: dict[str, Any]) -> None")]
    fn load_state(&self, py: Python<'_>, state: &Bound<'_, PyDict>) -> PyResult<()> {
        let state = crate::state::from_dict(state)?;
        let engine = self.engine()?;
        py.detach(|| engine.import_state(&state)).py()
    }

    /// Finishes queued collectives and stops the channel threads. Safe to
    /// call twice.
    #[pyo3(text_signature = "(self) -> None")]
    fn shutdown(&mut self, py: Python<'_>) {
        let core = &mut self.core;
        py.detach(move || core.shutdown());
    }
}

engine_setup_view!(CommEngine);

impl CommEngine {
    fn setup(&self) -> &EngineSetup {
        self.core.setup()
    }

    fn tcp_setup(&self) -> Option<&TcpSetup> {
        Some(self.core.tcp())
    }

    fn engine(&self) -> PyResult<&Engine> {
        self.core.engine().py()
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

/// The completion of a job whose result is reported through a
/// `torch.futures.Future`: `set_result(tensor)` (or a `SharedResult` when
/// the result stayed in shared memory), or `set_exception`.
fn completion(tensor: Py<PyAny>, future: Py<PyAny>) -> Completion {
    Box::new(move |result| {
        // No attach while the interpreter shuts down: the future has no
        // one left to wait on it.
        Python::try_attach(|py| {
            let outcome = match result {
                Ok(Some(bytes)) => Py::new(py, SharedResult { bytes })
                    .and_then(|shared| future.call_method1(py, "set_result", (shared,))),
                Ok(None) => future.call_method1(py, "set_result", (tensor,)),
                Err(err) => {
                    let exc = to_pyerr(err).into_value(py);
                    future.call_method1(py, "set_exception", (exc,))
                }
            };
            if let Err(err) = outcome {
                err.write_unraisable(py, None);
            }
        });
    })
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
