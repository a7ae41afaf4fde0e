//! `DeviceEngine`: buckets held in torch tensors (CUDA buckets), reduced by
//! the same algorithms as CPU buckets through the core's device engine
//! ([`tiacc_core::comm::setup::DeviceEngine`]: its set-up, connection and
//! algorithm decision; [`tiacc_core::comm::device`]: its channels, NCCL
//! communicators or TCP rings, watchdog, `auto` probe and failure rule).
//! This module converts:
//! Python's arguments in, the core's errors out, and [`TorchOps`], the
//! core's [`Kernels`] as the methods of a Python object of torch
//! operations (`tiacc_training.torch.distributed._kernels.TorchKernels`)
//! that the shim runs inside `torch.cuda.stream(channel stream)`, so they
//! are ordered with the collectives. Scratch tensors come from it too.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use tiacc_core::comm::backend::{Mem, Momentum, TopKBlock};
use tiacc_core::comm::device::{KernelError, KernelResult, Kernels, Slot, Span};
use tiacc_core::comm::setup::{self, DeviceTransport, EngineSetup, TcpSetup};
use tiacc_core::comm::{CollectiveCall, DType, Runner};
use tiacc_core::Error;

use crate::comm::{counters_dict, engine_setup_view, PyBoard};
use crate::config::PyCommConfig;
use crate::errors::{to_pyerr, ResultExt};
use crate::nccl::load;
use crate::store::{engine_setup, PyStore};

/// The device engine of one process (see the module docs): the core's
/// [`setup::DeviceEngine`] over torch tensors, and the torch kernels.
#[pyclass(module = "tiacc_training._engine")]
pub struct DeviceEngine {
    /// The configuration object it was built from (the `config` getter).
    config: Py<PyCommConfig>,
    kernels: Py<PyAny>,
    core: setup::DeviceEngine<Py<PyAny>>,
}

/// A flat uint8 tensor's memory, checked.
fn tensor_mem(tensor: &Bound<'_, PyAny>) -> PyResult<Mem> {
    let dtype = tensor.getattr("dtype")?.str()?.to_string();
    if dtype != "torch.uint8" || !tensor.call_method0("is_contiguous")?.is_truthy()? {
        return Err(PyValueError::new_err(format!(
            "expected a contiguous torch.uint8 tensor (a bucket's bytes), got {dtype}"
        )));
    }
    let addr: usize = tensor.call_method0("data_ptr")?.extract()?;
    let bytes: usize = tensor.call_method0("numel")?.extract()?;
    if bytes > 0 && addr == 0 {
        return Err(PyValueError::new_err(
            "a non-empty tensor with a null data pointer",
        ));
    }
    Ok(Mem::new(addr, bytes))
}

/// A flat uint8 tensor as the slot a device collective runs on.
fn tensor_slot(tensor: Bound<'_, PyAny>) -> PyResult<Slot<Py<PyAny>>> {
    let mem = tensor_mem(&tensor)?;
    Ok(Slot {
        buffer: tensor.unbind(),
        mem,
    })
}

#[pymethods]
impl DeviceEngine {
    /// An engine for `size` ranks, this one `rank`, built from `config`.
    ///
    /// `kernels` provides the torch operations (on the tensors' device);
    /// `transport` is `nccl` (CUDA tensors) or `tcp` (CPU tensors, which
    /// needs `host` to listen on); `board` is the job's failure board;
    /// `store` and `prefix` are where the ranks agree the 2D layout when the
    /// configuration asks for the 2D groups (`group`: a group of the "tiacc"
    /// backend, which runs flat where its ranks do not form whole nodes).
    #[new]
    #[pyo3(
        signature = (
            config, rank, size, kernels, transport="nccl", board=None,
            local_size=None, local_rank=None, store=None, prefix=None, group=false, host=None
        ),
        text_signature = "(config: CommConfig, rank: int, size: int, kernels: Any, \
            transport: str = 'nccl', board: Any = None, local_size: Optional[int] = None, \
            local_rank: Optional[int] = None, store: Any = None, prefix: Optional[str] = None, \
            group: bool = False, host: Optional[str] = None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        config: Bound<'_, PyCommConfig>,
        rank: usize,
        size: usize,
        kernels: Py<PyAny>,
        transport: &str,
        board: Option<Py<PyAny>>,
        local_size: Option<usize>,
        local_rank: Option<usize>,
        store: Option<Py<PyAny>>,
        prefix: Option<&str>,
        group: bool,
        host: Option<&str>,
    ) -> PyResult<Self> {
        let py = config.py();
        let placement = setup::Placement {
            local_size,
            local_rank,
        };
        let agreed = engine_setup(&config, rank, size, placement, store, prefix, group)?;
        // The tensors' device type (`cpu`, `cuda`): the core decides what
        // each transport takes.
        let device: String = kernels
            .bind(py)
            .getattr("device")?
            .getattr("type")?
            .extract()?;
        let transport = DeviceTransport::parse_for(transport, host, &device).py()?;
        let core = setup::DeviceEngine::new(agreed, transport, PyBoard::wrap(board)).py()?;
        Ok(DeviceEngine {
            config: config.unbind(),
            kernels,
            core,
        })
    }

    /// str: `nccl` or `tcp`.
    #[getter]
    fn transport(&self) -> &'static str {
        self.core.transport()
    }

    /// bool: Whether a `connect_*` call has completed and `shutdown` has not run.
    #[getter]
    fn connected(&self) -> bool {
        self.core.channels().connected()
    }

    /// Connects over the engine's transport with what the ranks exchange
    /// through `store` (a c10d store) under keys starting with `prefix`:
    /// with NCCL, joins the communicators (per channel the world's and,
    /// with the 2D allreduce, the node's and the inter-node group's) from
    /// unique ids each group's first member makes with the library
    /// `search_dirs` and `library` find, on the calling thread's current
    /// CUDA device; with TCP, forms the rings from every rank's addresses
    /// and the job token. Waits at most `timeout` seconds for the other
    /// ranks' keys (`CommTimeoutError` names those missing); blocks without
    /// the GIL while members join.
    #[pyo3(
        signature = (store, prefix, timeout, search_dirs=Vec::new(), library=None),
        text_signature = "(self, store: Any, prefix: str, timeout: float, \
            search_dirs: list[str] = ..., library: Optional[str] = None) -> None"
    )]
    fn connect_store(
        &mut self,
        py: Python<'_>,
        store: Py<PyAny>,
        prefix: &str,
        timeout: f64,
        search_dirs: Vec<String>,
        library: Option<String>,
    ) -> PyResult<()> {
        let ops = torch_ops(py, &self.kernels);
        let stream = probe_stream(&ops, &self.core)?;
        let (rank, core) = (self.core.setup().rank(), &mut self.core);
        PyStore::through(py, store, prefix, rank, timeout, |rendezvous| {
            let library = move || load(search_dirs, library);
            core.connect_through(&ops, rendezvous, library, stream)
        })
    }

    /// Runs the allreduce of a bucket: `buf` is its bytes (a flat uint8
    /// view), `dtype` its element type. With NCCL every step is enqueued on
    /// `stream` (the channel's; the caller runs this inside that stream's
    /// context so the kernels are ordered with it) and this returns at once;
    /// with TCP it returns when done. Raises the engine's failure, if any.
    #[pyo3(
        signature = (buf, dtype, bucket, average=true, stream=0),
        text_signature = "(self, buf: Any, dtype: str, bucket: int, average: bool = True, \
            stream: int = 0) -> None"
    )]
    fn allreduce(
        &self,
        py: Python<'_>,
        buf: Bound<'_, PyAny>,
        dtype: &str,
        bucket: u64,
        average: bool,
        stream: usize,
    ) -> PyResult<()> {
        let dtype = DType::parse(dtype).py()?;
        let slot = tensor_slot(buf)?;
        let ops = torch_ops(py, &self.kernels);
        self.core
            .channels()
            .allreduce(&ops, slot, dtype, bucket, average, stream)
            .map_err(to_pyerr)
    }

    /// Runs one of torch.distributed's collectives on `buf`, a flat uint8
    /// view of a tensor of `dtype` (one equal block per rank for
    /// `"reduce_scatter"`, which leaves this rank's block reduced and the
    /// rest scratch, and `"allgather"`; `"allreduce"` reduces the whole):
    /// exact, over the 2D groups where the algorithm goes 2D, the
    /// reduce-scatter compressed where the configuration asks. `reduce` is
    /// `"sum"` or `"avg"` (floating-point types). Enqueued on `stream` like
    /// a bucket (NCCL), or done when it returns (TCP).
    #[pyo3(
        signature = (collective, buf, dtype, bucket, reduce="sum", stream=0),
        text_signature = "(self, collective: str, buf: Any, dtype: str, bucket: int, \
            reduce: str = 'sum', stream: int = 0) -> None"
    )]
    #[allow(clippy::too_many_arguments)]
    fn collective(
        &self,
        py: Python<'_>,
        collective: &str,
        buf: Bound<'_, PyAny>,
        dtype: &str,
        bucket: u64,
        reduce: &str,
        stream: usize,
    ) -> PyResult<()> {
        let dtype = DType::parse(dtype).py()?;
        let call = CollectiveCall::parse(Runner::Device, collective, reduce).py()?;
        let op = call.device().py()?;
        let slot = tensor_slot(buf)?;
        call.check(dtype, slot.mem.bytes, self.core.setup().size())
            .py()?;
        let ops = torch_ops(py, &self.kernels);
        self.core
            .channels()
            .collective(&ops, op, slot, dtype, bucket, stream)
            .map_err(to_pyerr)
    }

    /// Hands the watchdog the completion test of the work just enqueued on
    /// `channel` (a CUDA event's `query`); it bounds the wait by the
    /// timeout. Nothing to do on TCP, whose calls return when done.
    #[pyo3(text_signature = "(self, channel: int, is_done: Callable[[], bool]) -> None")]
    fn watch(&self, py: Python<'_>, channel: usize, is_done: Py<PyAny>) -> PyResult<()> {
        let ops = torch_ops(py, &self.kernels);
        let is_done = Box::new(move || {
            Python::attach(|py| is_done.call0(py)?.extract::<bool>(py)).map_err(|e| Error::Comm {
                peer: None,
                message: format!("the completion test of a bucket failed: {e}"),
            })
        });
        self.core.channels().watch(&ops, channel, is_done);
        Ok(())
    }

    /// What the engine carried so far, per path and codec (the same form
    /// as `CommEngine.counters()`; NCCL's wire bytes are the buffers handed
    /// to its calls).
    #[pyo3(text_signature = "(self) -> dict[tuple[str, str], EngineCounters]")]
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        counters_dict(py, Some(self.core.channels().counters()))
    }

    /// `(steps, compute seconds, communication seconds)` since the last call
    /// (see `tiacc_core::comm::progress`); call it just before a step's
    /// first bucket.
    #[pyo3(text_signature = "(self) -> tuple[int, float, float]")]
    fn step_times(&self) -> (u64, f64, f64) {
        let t = self.core.channels().progress().take_times();
        (t.steps, t.compute, t.comm)
    }

    /// The engine's state across steps (Top-K's residuals, the momentum
    /// correction's buffers and each bucket's step count) as a dict (the
    /// form of `CommEngine.state()`), once the device finished the work
    /// enqueued so far. Raises `CommError` once the engine failed or was
    /// shut down.
    #[pyo3(text_signature = "(self) -> dict[str, Any]")]
    fn state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let ops = torch_ops(py, &self.kernels);
        let state = self.core.channels().export_state(&ops).map_err(to_pyerr)?;
        crate::state::to_dict(py, &state)
    }

    /// Replaces the engine's state across steps with `state` (a dict as
    /// `state()` returns), each bucket's buffers allocated and loaded on
    /// the channel it runs on; with `channel`, only that channel's buckets
    /// (the caller runs this inside that channel's stream context, once per
    /// channel). Raises `ValueError` naming the key when `state` is
    /// malformed or does not fit this engine; nothing is imported then.
    #[pyo3(
        signature = (state, channel=None),
        text_signature = "(self, state: dict[str, Any], channel: Optional[int] = None) -> None"
    )]
    fn load_state(
        &self,
        py: Python<'_>,
        state: &Bound<'_, PyDict>,
        channel: Option<usize>,
    ) -> PyResult<()> {
        let state = crate::state::from_dict(state)?;
        let ops = torch_ops(py, &self.kernels);
        self.core
            .channels()
            .import_state(&ops, &state, channel)
            .map_err(to_pyerr)
    }

    /// Raises the engine's failure (a timeout, an NCCL error, a failure on
    /// another rank), if there was one, or a `CommError` once shut down.
    #[pyo3(text_signature = "(self) -> None")]
    fn check(&self) -> PyResult<()> {
        self.core.channels().check().map_err(to_pyerr)
    }

    /// Stops the watchdog and aborts the communicators (never waits on
    /// peers). Safe to call twice.
    #[pyo3(text_signature = "(self) -> None")]
    fn shutdown(&mut self, py: Python<'_>) {
        let ops = torch_ops(py, &self.kernels);
        self.core.shutdown(&ops);
    }
}

engine_setup_view!(DeviceEngine);

impl DeviceEngine {
    fn setup(&self) -> &EngineSetup {
        self.core.setup()
    }

    fn tcp_setup(&self) -> Option<&TcpSetup> {
        self.core.tcp()
    }
}

/// The core's kernels over an engine's `TorchKernels`.
fn torch_ops<'a, 'py>(py: Python<'py>, kernels: &'a Py<PyAny>) -> TorchOps<'a, 'py> {
    TorchOps {
        py,
        kernels: kernels.bind(py),
    }
}

/// The stream the caller runs on, when connecting runs `auto`'s probe
/// (asked of the kernels only then).
fn probe_stream(
    ops: &TorchOps<'_, '_>,
    core: &setup::DeviceEngine<Py<PyAny>>,
) -> PyResult<Option<usize>> {
    if !core.probes() {
        return Ok(None);
    }
    Ok(Some(ops.kernels.call_method0("current_stream")?.extract()?))
}

/// [`Kernels`] as torch operations: the methods of a
/// `tiacc_training.torch.distributed._kernels.TorchKernels`, called with the
/// interpreter held; collectives and waits run with it released.
struct TorchOps<'a, 'py> {
    py: Python<'py>,
    kernels: &'a Bound<'py, PyAny>,
}

/// `(tensor, byte offset, bytes)`: a span as the Python kernels take it.
type Arg = (Py<PyAny>, usize, usize);

impl<'py> TorchOps<'_, 'py> {
    fn arg(&self, s: Span<'_, Py<PyAny>>) -> Arg {
        (s.buffer.clone_ref(self.py), s.offset, s.bytes)
    }

    fn call(
        &self,
        name: &str,
        args: impl pyo3::call::PyCallArgs<'py>,
    ) -> KernelResult<Bound<'py, PyAny>> {
        Ok(self.kernels.call_method1(name, args)?)
    }
}

impl Kernels for TorchOps<'_, '_> {
    type Buffer = Py<PyAny>;

    fn empty(&self, bytes: usize) -> KernelResult<(Py<PyAny>, Mem)> {
        let tensor = self.call("empty", (bytes,))?;
        let mem = tensor_mem(&tensor)
            .map_err(|e| KernelError(format!("it returned an unusable tensor: {e}")))?;
        Ok((tensor.unbind(), mem))
    }

    fn copy(&self, src: Span<'_, Py<PyAny>>, dst: Span<'_, Py<PyAny>>) -> KernelResult<()> {
        let ((s, so, n), (d, dof, _)) = (self.arg(src), self.arg(dst));
        self.call("copy", (s, so, d, dof, n)).map(drop)
    }

    fn div(&self, buf: Span<'_, Py<PyAny>>, dtype: DType, divisor: f64) -> KernelResult<()> {
        let (t, o, n) = self.arg(buf);
        self.call("div", (t, o, n, dtype.name(), divisor)).map(drop)
    }

    fn cast(
        &self,
        src: Span<'_, Py<PyAny>>,
        from: DType,
        factor: f64,
        dst: Span<'_, Py<PyAny>>,
        to: DType,
    ) -> KernelResult<()> {
        let ((s, so, sn), (d, dof, dn)) = (self.arg(src), self.arg(dst));
        let args = (s, so, sn, from.name(), factor, d, dof, dn, to.name());
        self.call("cast", args).map(drop)
    }

    fn first_non_finite(
        &self,
        buf: Span<'_, Py<PyAny>>,
        dtype: DType,
    ) -> KernelResult<Option<(usize, f64)>> {
        let (t, o, n) = self.arg(buf);
        let found = self.call("first_non_finite", (t, o, n, dtype.name()))?;
        found
            .extract::<Option<(usize, f64)>>()
            .map_err(|e| KernelError(format!("it returned an unexpected value: {e}")))
    }

    fn topk_pack(
        &self,
        data: Span<'_, Py<PyAny>>,
        residual: Span<'_, Py<PyAny>>,
        out: Span<'_, Py<PyAny>>,
        layout: TopKBlock,
    ) -> KernelResult<()> {
        let ((d, dof, _), (r, ro, _), (o, oo, _)) =
            (self.arg(data), self.arg(residual), self.arg(out));
        let args = (d, dof, r, ro, o, oo, layout.n, layout.k, layout.fp16_values);
        self.call("topk_pack", args).map(drop)
    }

    fn topk_sum(
        &self,
        gathered: Span<'_, Py<PyAny>>,
        out: Span<'_, Py<PyAny>>,
        layout: TopKBlock,
    ) -> KernelResult<()> {
        let ((g, go, _), (o, oo, _)) = (self.arg(gathered), self.arg(out));
        let args = (
            g,
            go,
            layout.parts,
            layout.bytes(),
            o,
            oo,
            layout.n,
            layout.k,
            layout.fp16_values,
        );
        self.call("topk_sum", args).map(drop)
    }

    fn clip_norm(&self, buf: Span<'_, Py<PyAny>>, max_norm: f64) -> KernelResult<()> {
        let (t, o, n) = self.arg(buf);
        self.call("clip_norm", (t, o, n / 4, max_norm)).map(drop)
    }

    fn momentum(
        &self,
        op: Momentum,
        first: Span<'_, Py<PyAny>>,
        second: Span<'_, Py<PyAny>>,
        momentum: f64,
    ) -> KernelResult<()> {
        let ((a, ao, n), (b, bo, _)) = (self.arg(first), self.arg(second));
        self.call(op.name(), (a, ao, b, bo, n / 4, momentum))
            .map(drop)
    }

    fn topk_mask(
        &self,
        block: Span<'_, Py<PyAny>>,
        layout: TopKBlock,
        buf: Span<'_, Py<PyAny>>,
    ) -> KernelResult<()> {
        let ((b, bo, _), (t, to, n)) = (self.arg(block), self.arg(buf));
        self.call("topk_mask", (b, bo, layout.k, t, to, n / 4))
            .map(drop)
    }

    fn load(&self, dst: Span<'_, Py<PyAny>>, data: &[u8]) -> KernelResult<()> {
        let (t, o, _) = self.arg(dst);
        let data = PyBytes::new(self.py, data);
        self.call("load", (t, o, data)).map(drop)
    }

    fn fetch(&self, src: Span<'_, Py<PyAny>>) -> KernelResult<Vec<u8>> {
        let (t, o, n) = self.arg(src);
        let got = self.call("fetch", (t, o, n))?;
        let bytes = got
            .cast::<PyBytes>()
            .map_err(|e| KernelError(e.to_string()))?;
        Ok(bytes.as_bytes().to_vec())
    }

    fn synchronize(&self) -> KernelResult<()> {
        self.call("synchronize", ()).map(drop)
    }

    fn unlocked<R: Send>(&self, work: impl FnOnce() -> R + Send) -> R {
        self.py.detach(work)
    }
}
