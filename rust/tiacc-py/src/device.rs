//! `DeviceEngine`: buckets held in torch tensors (CUDA buckets), reduced by
//! the same algorithms as CPU buckets ([`Algorithm`]) through the core's
//! device backend ([`tiacc_core::comm::device`]).
//!
//! * Collectives: NCCL communicators per channel (world, and with 2D the
//!   intra-node and inter-node groups), enqueued on the channel's CUDA
//!   stream; or, for CPU tensors (the tests' way of running this exact code
//!   without a GPU), the TCP rings.
//! * Kernels: [`TorchOps`], the core's [`Kernels`] as the methods of a
//!   Python object of torch operations (`tiacc_training.torch.
//!   distributed._kernels.TorchKernels`) that the shim runs inside
//!   `torch.cuda.stream(channel stream)`, so they are ordered with the
//!   collectives. Scratch tensors come from it too.
//!
//! The hook's thread runs the algorithm: every call only enqueues work
//! (NCCL), nothing waits on the device except the NaN check's one flag.
//! The NCCL watchdog ([`Watchdog`]) bounds the wait of each bucket; any
//! failure goes through the engine's [`Failures`] (published, recorded,
//! every communicator aborted) and is raised at the next call.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use tiacc_core::comm::auto;
use tiacc_core::comm::backend::{Backend, Mem, TopKBlock};
use tiacc_core::comm::device::{
    Comms, DeviceBackend, KernelError, KernelResult, Kernels, NcclGroups, Slot, Span, PROBE_BUCKET,
};
use tiacc_core::comm::engine::channel_of;
use tiacc_core::comm::host::Groups;
use tiacc_core::comm::nccl::{
    Group, NcclCommunicator, NcclUniqueId, Pending, Tracker, Watchdog, Watched,
};
use tiacc_core::comm::progress::{self, Position, Progress, Recorder};
use tiacc_core::comm::transport::{Aborter, OpKind, OpTag};
use tiacc_core::comm::{Algorithm, Counters, DType, Deadline, Failures};
use tiacc_core::Error;

use crate::comm::{counters_dict, engine_getters, EngineInfo, PyBoard, TcpSetup};
use crate::config::PyCommConfig;
use crate::errors::{to_pyerr, ResultExt};
use crate::nccl::{load, unique_id_from};

/// How often the watchdog checks a pending bucket.
const WATCH_POLL: Duration = Duration::from_millis(5);

/// One channel: its communicators, its algorithm state and its Top-K residuals.
struct Channel {
    comms: Comms,
    algorithm: Algorithm,
    residuals: HashMap<u64, Slot<Py<PyAny>>>,
    seq: u64,
    /// The bucket and step of the collective enqueued last (for `watch`).
    last: Option<Position>,
}

/// Which collectives a [`DeviceEngine`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Collectives {
    Nccl,
    Tcp,
}

/// The device engine of one process (see the module docs).
#[pyclass(module = "tiacc_training._engine")]
pub struct DeviceEngine {
    info: EngineInfo,
    kernels: Py<PyAny>,
    transport: Collectives,
    tcp: Option<TcpSetup>,
    failures: Arc<Failures>,
    channels: Vec<Mutex<Channel>>,
    /// Each channel's NCCL communicators, for the watchdog.
    watched: Vec<Vec<Arc<NcclCommunicator>>>,
    watchdog: Option<Watchdog>,
    closed: bool,
    /// Where this rank is in the job ([`progress`]).
    progress: Arc<Progress>,
    /// Writes `progress` to the board (when there is one).
    recorder: Option<Recorder>,
    /// What the channels carried ([`tiacc_core::comm::counters`]).
    counters: Arc<Counters>,
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

#[pymethods]
impl DeviceEngine {
    /// An engine for `size` ranks, this one `rank`, built from `config`.
    ///
    /// `kernels` provides the torch operations (on the tensors' device);
    /// `transport` is `nccl` (CUDA tensors) or `tcp` (CPU tensors, which
    /// needs `host` to listen on); `board` is the job's failure board;
    /// `intra_size` turns the 2D groups on when the configuration asks for
    /// them.
    #[new]
    #[pyo3(signature = (
        config, rank, size, kernels, transport="nccl", board=None,
        local_size=None, intra_size=None, host=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        config: Bound<'_, PyCommConfig>,
        rank: usize,
        size: usize,
        kernels: Py<PyAny>,
        transport: &str,
        board: Option<Py<PyAny>>,
        local_size: Option<usize>,
        intra_size: Option<usize>,
        host: Option<&str>,
    ) -> PyResult<Self> {
        let py = config.py();
        let info = EngineInfo::new(config, rank, size, local_size, intra_size)?;
        let (transport, tcp) = match (transport, host) {
            ("nccl", _) => (Collectives::Nccl, None),
            ("tcp", Some(host)) => {
                // TCP collectives read and write the tensors' memory from
                // the host: only CPU tensors qualify.
                let device = kernels.bind(py).getattr("device")?;
                let kind: String = device.getattr("type")?.extract()?;
                if kind != "cpu" {
                    return Err(PyValueError::new_err(format!(
                        "transport 'tcp' runs on CPU tensors, but the kernels are on {kind}; \
                         CUDA tensors go over TCP through host staging"
                    )));
                }
                (
                    Collectives::Tcp,
                    Some(TcpSetup::bind(rank, size, host, info.layout)?),
                )
            }
            ("tcp", None) => {
                return Err(PyValueError::new_err(
                    "transport 'tcp' needs the host address to listen on",
                ))
            }
            (other, _) => {
                return Err(PyValueError::new_err(format!(
                    "transport must be 'nccl' or 'tcp', got {other:?}"
                )))
            }
        };
        let board = PyBoard::wrap(board);
        let progress = Arc::new(Progress::new());
        let recorder = board
            .clone()
            .map(|b| Recorder::start(progress.clone(), b, rank))
            .transpose()
            .py()?;
        Ok(DeviceEngine {
            info,
            kernels,
            transport,
            tcp,
            failures: Arc::new(Failures::new(board)),
            channels: Vec::new(),
            watched: Vec::new(),
            watchdog: None,
            closed: false,
            progress,
            recorder,
            counters: Arc::new(Counters::new()),
        })
    }

    /// `nccl` or `tcp`.
    #[getter]
    fn transport(&self) -> &'static str {
        match self.transport {
            Collectives::Nccl => "nccl",
            Collectives::Tcp => "tcp",
        }
    }

    /// Whether a `connect_*` call has completed and `shutdown` has not run.
    #[getter]
    fn connected(&self) -> bool {
        !self.channels.is_empty() && !self.closed
    }

    /// Joins the NCCL communicators: per channel, the world one from
    /// `world_ids[c]` and, with the 2D allreduce, the intra-node and
    /// inter-node ones from `intra_ids[c]` and `inter_ids[c]`. Blocks
    /// (GIL released) until every member joined; the calling thread's
    /// current CUDA device is the communicators' device.
    #[pyo3(signature = (world_ids, intra_ids=None, inter_ids=None, search_dirs=Vec::new(), library=None))]
    fn connect_nccl(
        &mut self,
        py: Python<'_>,
        world_ids: Vec<Vec<u8>>,
        intra_ids: Option<Vec<Vec<u8>>>,
        inter_ids: Option<Vec<Vec<u8>>>,
        search_dirs: Vec<String>,
        library: Option<String>,
    ) -> PyResult<()> {
        if self.transport != Collectives::Nccl || !self.channels.is_empty() {
            return Err(PyValueError::new_err(
                "connect_nccl() needs an unconnected engine with transport 'nccl'",
            ));
        }
        let ids = |list: &[Vec<u8>], what: &str| -> PyResult<Vec<NcclUniqueId>> {
            if list.len() != self.info.num_channels {
                return Err(PyValueError::new_err(format!(
                    "expected {} {what} NCCL ids (one per channel), got {}",
                    self.info.num_channels,
                    list.len()
                )));
            }
            list.iter().map(|b| unique_id_from(b)).collect()
        };
        let world_ids = ids(&world_ids, "world")?;
        let two_d_ids = match (self.info.layout, intra_ids, inter_ids) {
            (None, _, _) => None,
            (Some(layout), Some(a), Some(e)) => {
                Some((layout, ids(&a, "intra")?, ids(&e, "inter")?))
            }
            (Some(_), _, _) => {
                return Err(PyValueError::new_err(
                    "the 2D allreduce is on: connect_nccl() needs intra_ids and inter_ids",
                ))
            }
        };
        let (rank, size) = (self.info.rank, self.info.size);
        // Each communicator's initialisation is bounded by the timeout.
        let timeout = self.info.timeout;
        let groups = py
            .detach(move || -> tiacc_core::Result<Vec<NcclGroups>> {
                let lib = load(search_dirs, library)?;
                let mut out = Vec::with_capacity(world_ids.len());
                for (c, id) in world_ids.iter().enumerate() {
                    let world = NcclCommunicator::init_bounded(
                        lib.clone(),
                        id,
                        rank,
                        size,
                        Group::World,
                        Deadline::after(timeout),
                    )?;
                    let two_d = match &two_d_ids {
                        None => None,
                        Some((l, a, e)) => {
                            let intra = NcclCommunicator::init_bounded(
                                lib.clone(),
                                &a[c],
                                l.local_rank(),
                                l.intra_size,
                                Group::Intra,
                                Deadline::after(timeout),
                            )?;
                            let inter = NcclCommunicator::init_bounded(
                                lib.clone(),
                                &e[c],
                                l.node(),
                                l.nodes(),
                                Group::Inter,
                                Deadline::after(timeout),
                            )?;
                            Some((Arc::new(intra), Arc::new(inter)))
                        }
                    };
                    out.push(NcclGroups {
                        world: Arc::new(world),
                        two_d,
                    });
                }
                Ok(out)
            })
            .py()?;
        self.watched = groups.iter().map(NcclGroups::all).collect();
        let aborters = self.watched.iter().flatten().map(|comm| {
            let comm = comm.clone();
            Box::new(move || comm.abort("aborted after a failure on this engine")) as Aborter
        });
        self.failures.add_aborters(aborters);
        let tracker = Tracker {
            progress: self.progress.clone(),
            rank: self.info.rank,
            size: self.info.size,
        };
        self.watchdog =
            Some(Watchdog::start_tracking(self.failures.clone(), WATCH_POLL, Some(tracker)).py()?);
        let mut comms: Vec<Comms> = groups.into_iter().map(Comms::Nccl).collect();
        let chosen = match comms.first_mut() {
            Some(first) => self.choose_algorithm(py, first)?,
            None => None,
        };
        if chosen == Some(false) {
            // Flat it is: the 2D communicators would only hold GPU memory.
            let unused: Vec<_> = comms
                .iter_mut()
                .filter_map(|c| match c {
                    Comms::Nccl(g) => g.two_d.take(),
                    Comms::Tcp(_) => None,
                })
                .collect();
            py.detach(move || {
                for comm in unused.into_iter().flat_map(|(a, e)| [a, e]) {
                    // Nothing is queued on them (the probe waited for its
                    // work); a failing destroy leaves them closed anyway.
                    let _ = comm.destroy();
                }
            });
            // Each channel's watched list is `NcclGroups::all`: world first.
            for watched in &mut self.watched {
                watched.truncate(1);
            }
        }
        self.channels = comms.into_iter().map(|c| self.channel(c)).collect();
        Ok(())
    }

    /// Forms the TCP rings (transport `tcp`): every rank's `addresses`, the
    /// job `token`, and with the 2D allreduce the members' addresses.
    #[pyo3(signature = (addresses, token, intra_addresses=None, inter_addresses=None))]
    fn connect(
        &mut self,
        py: Python<'_>,
        addresses: Vec<String>,
        token: &[u8],
        intra_addresses: Option<Vec<String>>,
        inter_addresses: Option<Vec<String>>,
    ) -> PyResult<()> {
        let Some(tcp) = self.tcp.as_mut().filter(|_| self.channels.is_empty()) else {
            return Err(PyValueError::new_err(
                "connect() needs an unconnected engine with transport 'tcp'",
            ));
        };
        let groups = tcp.connect(
            py,
            addresses,
            token,
            intra_addresses,
            inter_addresses,
            self.info.num_channels,
            self.info.config.get().inner.shared_memory,
            self.info.timeout,
        )?;
        self.failures
            .add_aborters(groups.iter().flat_map(Groups::aborters));
        let mut comms: Vec<Comms> = groups.into_iter().map(Comms::Tcp).collect();
        if let Some(first) = comms.first_mut() {
            self.choose_algorithm(py, first)?;
        }
        self.channels = comms.into_iter().map(|c| self.channel(c)).collect();
        Ok(())
    }

    /// The channel (and so the CUDA stream) bucket `bucket` runs on.
    fn channel_of(&self, bucket: u64) -> usize {
        channel_of(bucket, self.info.num_channels)
    }

    /// Runs the allreduce of a bucket: `buf` is its bytes (a flat uint8
    /// view), `dtype` its element type. With NCCL every step is enqueued on
    /// `stream` (the channel's; the caller runs this inside that stream's
    /// context so the kernels are ordered with it) and this returns at once;
    /// with TCP it returns when done. Raises the engine's failure, if any.
    #[pyo3(signature = (buf, dtype, bucket, average=true, stream=0))]
    fn allreduce(
        &self,
        py: Python<'_>,
        buf: Bound<'_, PyAny>,
        dtype: &str,
        bucket: u64,
        average: bool,
        stream: usize,
    ) -> PyResult<()> {
        self.check()?;
        let dtype = DType::parse(dtype).py()?;
        let mem = tensor_mem(&buf)?;
        if mem.bytes % dtype.size() != 0 {
            return Err(PyValueError::new_err(format!(
                "bucket {bucket}: {} bytes is not a whole number of {} elements",
                mem.bytes,
                dtype.name()
            )));
        }
        let channel_index = self.channel_of(bucket);
        let mut channel = lock(py, &self.channels[channel_index]);
        channel.seq += 1;
        let at = self.progress.submit(bucket);
        channel.last = Some(at);
        let tag = OpTag {
            op: 0,
            kind: OpKind::Allreduce,
            seq: channel.seq,
            bucket,
            dtype: dtype.code(),
            bytes: mem.bytes as u64,
        };
        let Channel {
            comms,
            algorithm,
            residuals,
            ..
        } = &mut *channel;
        let ops = TorchOps {
            py,
            kernels: self.kernels.bind(py),
        };
        let mut backend = DeviceBackend {
            kernels: &ops,
            comms,
            residuals,
            slots: vec![Slot {
                buffer: buf.unbind(),
                mem,
            }],
            stream,
            deadline: Deadline::after(self.info.timeout),
            world_rank: self.info.rank,
            bucket,
        };
        let result = algorithm.allreduce(&mut backend, &tag, mem, dtype, average);
        drop(backend);
        // TCP collectives are done here; NCCL ones when the watchdog sees
        // them finish (unless enqueueing failed).
        let tcp = matches!(comms, Comms::Tcp(_));
        if tcp || result.is_err() {
            self.progress.complete();
        }
        match result {
            Ok(()) => Ok(()),
            Err(err) => {
                let err = match self.failures.board() {
                    Some(board) if tcp && self.failures.first().is_none() => {
                        let (rank, size) = (self.info.rank, self.info.size);
                        py.detach(|| {
                            progress::attribute_timeout(err, at, &self.progress, board, rank, size)
                        })
                    }
                    _ => err,
                };
                let err = self.failures.fail(err);
                if let Comms::Tcp(groups) = comms {
                    groups.abort();
                }
                Err(to_pyerr(err))
            }
        }
    }

    /// Hands the watchdog the completion test of the work just enqueued on
    /// `channel` (a CUDA event's `query`); it bounds the wait by the
    /// timeout. Nothing to do on TCP, whose calls return when done.
    fn watch(&self, py: Python<'_>, channel: usize, is_done: Py<PyAny>) -> PyResult<()> {
        let (Some(dog), Some(comms)) = (&self.watchdog, self.watched.get(channel)) else {
            return Ok(());
        };
        let comms = comms
            .iter()
            .map(|c| c.clone() as Arc<dyn Watched + Send + Sync>)
            .collect();
        let at = self
            .channels
            .get(channel)
            .and_then(|c| lock(py, c).last.take());
        dog.submit(Pending {
            at,
            comms,
            is_done: Box::new(move || {
                Python::attach(|py| is_done.call0(py)?.extract::<bool>(py)).map_err(|e| {
                    Error::Comm {
                        peer: None,
                        message: format!("the completion test of a bucket failed: {e}"),
                    }
                })
            }),
            deadline: Deadline::after(self.info.timeout),
        });
        Ok(())
    }

    /// What the engine carried so far, per path and codec (the same form
    /// as `CommEngine.counters()`; NCCL's wire bytes are the buffers handed
    /// to its calls).
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        counters_dict(py, Some(&self.counters))
    }

    /// `(steps, compute seconds, communication seconds)` since the last call
    /// (see `tiacc_core::comm::progress`); call it just before a step's
    /// first bucket.
    fn step_times(&self) -> (u64, f64, f64) {
        let t = self.progress.take_times();
        (t.steps, t.compute, t.comm)
    }

    /// Raises the engine's failure (a timeout, an NCCL error, a failure on
    /// another rank), if there was one, or a `CommError` once shut down.
    fn check(&self) -> PyResult<()> {
        if let Some(err) = self.failures.first() {
            return Err(to_pyerr(err));
        }
        if self.closed || self.channels.is_empty() {
            return Err(to_pyerr(Error::Comm {
                peer: None,
                message: format!(
                    "rank {}: the device engine is not connected or was shut down",
                    self.info.rank
                ),
            }));
        }
        Ok(())
    }

    /// Stops the watchdog and aborts the communicators (never waits on
    /// peers). Safe to call twice.
    fn shutdown(&mut self, py: Python<'_>) {
        self.closed = true;
        let watchdog = self.watchdog.take();
        let recorder = self.recorder.take();
        let comms: Vec<_> = self.watched.iter().flatten().cloned().collect();
        py.detach(move || {
            drop(recorder);
            drop(watchdog);
            for comm in comms {
                comm.abort("the tiacc engine was shut down");
            }
        });
        if let Some(tcp) = self.tcp.as_mut() {
            tcp.close();
        }
        self.channels.clear();
    }
}

engine_getters!(DeviceEngine);

impl DeviceEngine {
    fn tcp_setup(&self) -> Option<&TcpSetup> {
        self.tcp.as_ref()
    }

    /// Under `TIACC_TRAINING_ALGORITHM=auto` with the 2D groups connected:
    /// times flat against 2D on the first channel's groups
    /// ([`auto::probe`], through the backend buckets use), keeps the faster
    /// in the settings the channels are built with, and says why in
    /// `auto_choice`. Returns whether 2D was chosen, `None` when nothing was
    /// measured.
    fn choose_algorithm(&mut self, py: Python<'_>, comms: &mut Comms) -> PyResult<Option<bool>> {
        let Some(bytes) = self.info.auto_probe_bytes() else {
            return Ok(None);
        };
        let kernels = self.kernels.bind(py);
        let stream: usize = kernels.call_method0("current_stream")?.extract()?;
        let deadline = Deadline::after(self.info.timeout);
        // NCCL's steps are only enqueued: the watchdog bounds the probe as
        // it bounds a bucket (a peer that never arrives), aborting every
        // communicator at the deadline so that the wait below ends.
        let done = Arc::new(AtomicBool::new(false));
        if let (Some(dog), Comms::Nccl(g)) = (&self.watchdog, &*comms) {
            let flag = done.clone();
            dog.submit(Pending {
                at: None,
                comms: vec![g.world.clone() as Arc<dyn Watched + Send + Sync>],
                is_done: Box::new(move || Ok(flag.load(Ordering::SeqCst))),
                deadline,
            });
        }
        let mut residuals = HashMap::new();
        let ops = TorchOps { py, kernels };
        let mut backend = DeviceBackend {
            kernels: &ops,
            comms,
            residuals: &mut residuals,
            slots: Vec::new(),
            stream,
            deadline,
            world_rank: self.info.rank,
            bucket: PROBE_BUCKET,
        };
        let result = backend
            .alloc(bytes)
            .and_then(|buf| auto::probe(&mut backend, buf));
        drop(backend);
        done.store(true, Ordering::SeqCst);
        let probe = result.map_err(|e| to_pyerr(self.failures.fail(e)))?;
        // The device engine's channels do not take turns on the link.
        Ok(Some(self.info.adopt(&probe, false)))
    }

    fn channel(&self, comms: Comms) -> Mutex<Channel> {
        Mutex::new(Channel {
            comms,
            algorithm: Algorithm::with_counters(self.info.settings, Arc::clone(&self.counters)),
            residuals: HashMap::new(),
            seq: 0,
            last: None,
        })
    }
}

/// Locks a channel without holding the GIL while waiting (its holder may
/// need the GIL to finish).
fn lock<'a>(py: Python<'_>, m: &'a Mutex<Channel>) -> MutexGuard<'a, Channel> {
    loop {
        match m.try_lock() {
            Ok(guard) => return guard,
            Err(TryLockError::Poisoned(p)) => return p.into_inner(),
            Err(TryLockError::WouldBlock) => py.detach(std::thread::yield_now),
        }
    }
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

    fn momentum_step(
        &self,
        velocity: Span<'_, Py<PyAny>>,
        data: Span<'_, Py<PyAny>>,
        momentum: f64,
    ) -> KernelResult<()> {
        let ((u, uo, n), (d, dof, _)) = (self.arg(velocity), self.arg(data));
        self.call("momentum_step", (u, uo, d, dof, n / 4, momentum))
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

    fn momentum_correct(
        &self,
        data: Span<'_, Py<PyAny>>,
        previous: Span<'_, Py<PyAny>>,
        momentum: f64,
    ) -> KernelResult<()> {
        let ((d, dof, n), (p, po, _)) = (self.arg(data), self.arg(previous));
        self.call("momentum_correct", (d, dof, p, po, n / 4, momentum))
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
