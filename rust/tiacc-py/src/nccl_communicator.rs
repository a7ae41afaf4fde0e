//! `NcclCommunicator`: one NCCL communicator driven from Python, for tests
//! only (the device engine joins its communicators through the core). Built
//! with the cargo feature `nccl-communicator`, which the normal build leaves
//! off: `maturin develop --release --features nccl-communicator`.
//!
//! The Python shim owns CUDA: it passes device pointers (`data_ptr()`),
//! element counts and raw stream handles (`torch.cuda.Stream.cuda_stream`),
//! and keeps tensors alive (`record_stream`) until the stream has passed
//! the collective. Nothing here touches device memory from the host.

use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use tiacc_core::comm::nccl::{
    self, DevicePtr, Group, NcclCommunicator as CoreCommunicator, NcclUniqueId, ReduceOp,
};
use tiacc_core::comm::{DType, Deadline};

use crate::errors::ResultExt;
use crate::nccl::{load, seconds};

/// How long `abort` waits for NCCL to free the communicator.
const ABORT_WAIT: Duration = Duration::from_secs(10);

/// One NCCL communicator: one group (`world`, `intra`, `inter`) on one
/// channel. Built on every rank from the same unique id; the constructor
/// blocks (GIL released) until every rank has joined, on the calling
/// thread's current CUDA device. With `timeout` (seconds), joining is
/// bounded: NCCL's non-blocking initialisation, aborted at the deadline
/// (`CommTimeoutError`).
#[pyclass(module = "tiacc_training._engine", frozen)]
pub struct NcclCommunicator {
    inner: Arc<CoreCommunicator>,
}

#[pymethods]
impl NcclCommunicator {
    #[new]
    #[pyo3(
        signature = (unique_id, rank, size, search_dirs=Vec::new(), library=None, group="world", timeout=None),
        text_signature = "(unique_id: bytes, rank: int, size: int, search_dirs: list[str] = ..., \
            library: Optional[str] = None, group: str = 'world', timeout: Optional[float] = None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        unique_id: &[u8],
        rank: usize,
        size: usize,
        search_dirs: Vec<String>,
        library: Option<String>,
        group: &str,
        timeout: Option<f64>,
    ) -> PyResult<Self> {
        let timeout = timeout.map(|t| seconds("timeout", t)).transpose()?;
        let id = unique_id_from(unique_id)?;
        let group = Group::parse(group).py()?;
        if size == 0 || rank >= size {
            return Err(PyValueError::new_err(format!(
                "rank {rank} is not a rank of a group of {size}"
            )));
        }
        let inner = py
            .detach(|| {
                let lib = load(search_dirs, library)?;
                match timeout {
                    Some(t) => CoreCommunicator::init_bounded(
                        lib,
                        &id,
                        rank,
                        size,
                        group,
                        Deadline::after(t),
                    ),
                    None => CoreCommunicator::init(lib, &id, rank, size, group),
                }
            })
            .py()?;
        Ok(NcclCommunicator {
            inner: Arc::new(inner),
        })
    }

    /// int: This rank in the group.
    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    /// int: The group's number of ranks.
    #[getter]
    fn size(&self) -> usize {
        self.inner.size()
    }

    /// str: The group: `world`, `intra` or `inter`.
    #[getter]
    fn group(&self) -> &'static str {
        self.inner.group().name()
    }

    /// tuple[int, int, int]: NCCL's version as (major, minor, patch).
    #[getter]
    fn version(&self) -> (u32, u32, u32) {
        self.inner.library().version()
    }

    /// bool: Whether `abort` or `destroy` has run.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// Enqueues an allreduce of `count` elements from device pointer `send`
    /// into `recv` (may be equal) on CUDA stream `stream`; `op` is `sum` or
    /// `avg`. Returns once enqueued. The caller keeps both buffers alive
    /// until the stream has passed the collective.
    #[pyo3(
        signature = (send, recv, count, dtype, stream, op="sum"),
        text_signature = "(self, send: int, recv: int, count: int, dtype: str, stream: int, \
            op: str = 'sum') -> None"
    )]
    #[allow(clippy::too_many_arguments)]
    fn allreduce(
        &self,
        py: Python<'_>,
        send: usize,
        recv: usize,
        count: usize,
        dtype: &str,
        stream: usize,
        op: &str,
    ) -> PyResult<()> {
        let (dtype, op) = (DType::parse(dtype).py()?, parse_op(op)?);
        check_ptrs(&[send, recv], count)?;
        let comm = self.inner.clone();
        py.detach(move || {
            // SAFETY: the Python shim passes device pointers of live CUDA
            // tensors holding `count` elements of `dtype` on this
            // communicator's device, a live stream handle of that device,
            // and keeps the tensors alive for the stream (record_stream).
            unsafe { comm.all_reduce(dptr(send), dptr(recv), count, dtype, op, sptr(stream)) }
        })
        .py()
    }

    /// Enqueues a reduce-scatter: `send` holds `recv_count * size`
    /// elements, this rank's reduced block (`recv_count`) lands in `recv`.
    #[pyo3(
        signature = (send, recv, recv_count, dtype, stream, op="sum"),
        text_signature = "(self, send: int, recv: int, recv_count: int, dtype: str, stream: int, \
            op: str = 'sum') -> None"
    )]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        send: usize,
        recv: usize,
        recv_count: usize,
        dtype: &str,
        stream: usize,
        op: &str,
    ) -> PyResult<()> {
        let (dtype, op) = (DType::parse(dtype).py()?, parse_op(op)?);
        check_ptrs(&[send, recv], recv_count)?;
        let comm = self.inner.clone();
        py.detach(move || {
            // SAFETY: as in `allreduce`, with `send` holding
            // `recv_count * size` elements and `recv` `recv_count`.
            unsafe {
                comm.reduce_scatter(dptr(send), dptr(recv), recv_count, dtype, op, sptr(stream))
            }
        })
        .py()
    }

    /// Enqueues an allgather: each rank's `send_count` elements at `send`
    /// land, in rank order, in `recv` (`send_count * size` elements).
    #[pyo3(
        signature = (send, recv, send_count, dtype, stream),
        text_signature = "(self, send: int, recv: int, send_count: int, dtype: str, \
            stream: int) -> None"
    )]
    fn allgather(
        &self,
        py: Python<'_>,
        send: usize,
        recv: usize,
        send_count: usize,
        dtype: &str,
        stream: usize,
    ) -> PyResult<()> {
        let dtype = DType::parse(dtype).py()?;
        check_ptrs(&[send, recv], send_count)?;
        let comm = self.inner.clone();
        py.detach(move || {
            // SAFETY: as in `allreduce`, with `send` holding `send_count`
            // elements and `recv` `send_count * size`.
            unsafe { comm.all_gather(dptr(send), dptr(recv), send_count, dtype, sptr(stream)) }
        })
        .py()
    }

    /// Enqueues a broadcast of `count` elements from `root`'s `send` to
    /// every rank's `recv`.
    #[pyo3(
        signature = (send, recv, count, dtype, root, stream),
        text_signature = "(self, send: int, recv: int, count: int, dtype: str, root: int, \
            stream: int) -> None"
    )]
    #[allow(clippy::too_many_arguments)]
    fn broadcast(
        &self,
        py: Python<'_>,
        send: usize,
        recv: usize,
        count: usize,
        dtype: &str,
        root: usize,
        stream: usize,
    ) -> PyResult<()> {
        let dtype = DType::parse(dtype).py()?;
        check_ptrs(&[send, recv], count)?;
        let comm = self.inner.clone();
        py.detach(move || {
            // SAFETY: as in `allreduce`.
            unsafe { comm.broadcast(dptr(send), dptr(recv), count, dtype, root, sptr(stream)) }
        })
        .py()
    }

    /// NCCL's asynchronous error as text, or `None` while healthy (or while
    /// another call holds the communicator: that call reports it).
    #[pyo3(text_signature = "(self) -> Optional[str]")]
    fn async_error(&self, py: Python<'_>) -> PyResult<Option<String>> {
        let comm = self.inner.clone();
        let err = py.detach(move || comm.async_error()).py()?;
        Ok(err.map(|e| e.to_string()))
    }

    /// Waits (GIL released between polls) until `is_done()` returns true
    /// (typically a CUDA event's `query`), checking NCCL's asynchronous
    /// error every `poll_interval` seconds. After `timeout` seconds the
    /// communicator is aborted and `CommTimeoutError` raised, naming the
    /// group and this rank; an NCCL error aborts it and raises `CommError`.
    #[pyo3(
        signature = (is_done, timeout, poll_interval=0.001),
        text_signature = "(self, is_done: Callable[[], bool], timeout: float, \
            poll_interval: float = 0.001) -> None"
    )]
    fn watch(
        &self,
        py: Python<'_>,
        is_done: Py<PyAny>,
        timeout: f64,
        poll_interval: f64,
    ) -> PyResult<()> {
        let timeout = seconds("timeout", timeout)?;
        let poll = seconds("poll_interval", poll_interval)?;
        let comm = self.inner.clone();
        py.detach(move || {
            let is_done = || {
                Python::attach(|py| is_done.call0(py)?.extract::<bool>(py)).map_err(|e| {
                    tiacc_core::Error::Comm {
                        peer: None,
                        message: format!("the completion test passed to watch() failed: {e}"),
                    }
                })
            };
            nccl::watch(&[&*comm], Deadline::after(timeout), poll, is_done, || None)
        })
        .py()
    }

    /// Aborts outstanding operations and frees the communicator (never
    /// waits for peers; waits up to 10 s for NCCL to free it, which it does
    /// on a thread of its own). Later calls raise `CommError` with `reason`.
    #[pyo3(
        signature = (reason="aborted by the caller"),
        text_signature = "(self, reason: str = 'aborted by the caller') -> None"
    )]
    fn abort(&self, py: Python<'_>, reason: &str) {
        let comm = self.inner.clone();
        let reason = reason.to_string();
        py.detach(move || {
            comm.abort(&reason);
            comm.wait_aborted(ABORT_WAIT);
        });
    }

    /// Waits for queued work and frees the communicator. Call only when
    /// every peer is healthy; `abort` is the way out otherwise.
    #[pyo3(text_signature = "(self) -> None")]
    fn destroy(&self, py: Python<'_>) -> PyResult<()> {
        let comm = self.inner.clone();
        py.detach(move || comm.destroy()).py()
    }
}

/// An NCCL unique id from the bytes another rank published.
fn unique_id_from(bytes: &[u8]) -> PyResult<NcclUniqueId> {
    NcclUniqueId::from_slice(bytes).py()
}

fn parse_op(op: &str) -> PyResult<ReduceOp> {
    match op {
        "sum" => Ok(ReduceOp::Sum),
        "avg" => Ok(ReduceOp::Avg),
        other => Err(PyValueError::new_err(format!(
            "op must be 'sum' or 'avg', got {other:?}"
        ))),
    }
}

fn check_ptrs(ptrs: &[usize], count: usize) -> PyResult<()> {
    if count > 0 && ptrs.contains(&0) {
        return Err(PyValueError::new_err(
            "null device pointer for a non-empty buffer",
        ));
    }
    Ok(())
}

fn dptr(addr: usize) -> DevicePtr {
    DevicePtr(addr as *mut std::ffi::c_void)
}

fn sptr(addr: usize) -> *mut std::ffi::c_void {
    addr as *mut std::ffi::c_void
}
