//! `DeviceEngine`: buckets held in torch tensors (CUDA buckets), reduced by
//! the same algorithms as CPU buckets ([`Algorithm`]) through a device
//! backend.
//!
//! * Collectives: NCCL communicators per channel (world, and with 2D the
//!   intra-node and inter-node groups), enqueued on the channel's CUDA
//!   stream; or, for CPU tensors (the tests' way of running this exact code
//!   without a GPU), the TCP rings.
//! * Kernels: a Python object of torch operations (`tiacc_training.torch.
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

use tiacc_core::comm::auto::{self, Probing};
use tiacc_core::comm::backend::TopKBlock;
use tiacc_core::comm::backend::{Backend, GroupId, Mem, Shards};
use tiacc_core::comm::dtype::shard_range;
use tiacc_core::comm::engine::channel_of;
use tiacc_core::comm::host::Groups;
use tiacc_core::comm::nccl::{
    DevicePtr, Group, NcclCommunicator, NcclUniqueId, Pending, ReduceOp, Tracker, Watchdog, Watched,
};
use tiacc_core::comm::progress::{self, Position, Progress, Recorder};
use tiacc_core::comm::transport::{Aborter, OpKind, OpTag, Transport};
use tiacc_core::comm::{Algorithm, Counters, DType, Deadline, Failures};
use tiacc_core::Error;

use crate::comm::{counters_dict, engine_getters, EngineInfo, PyBoard, TcpSetup};
use crate::config::PyCommConfig;
use crate::errors::{to_pyerr, ResultExt};
use crate::nccl::{load, unique_id_from};

/// How often the watchdog checks a pending bucket.
const WATCH_POLL: Duration = Duration::from_millis(5);

/// The bucket number the `auto` probe's errors carry (no bucket of a model).
const PROBE_BUCKET: u64 = u64::MAX;

/// A torch tensor (flat uint8) and the memory it covers.
struct Slot {
    tensor: Py<PyAny>,
    mem: Mem,
}

/// The NCCL communicators of one channel.
struct NcclGroups {
    world: Arc<NcclCommunicator>,
    /// Intra-node and inter-node communicators, with the 2D allreduce.
    two_d: Option<(Arc<NcclCommunicator>, Arc<NcclCommunicator>)>,
}

impl NcclGroups {
    fn get(&self, group: GroupId) -> &Arc<NcclCommunicator> {
        match (group, &self.two_d) {
            (GroupId::Intra, Some((intra, _))) => intra,
            (GroupId::Inter, Some((_, inter))) => inter,
            _ => &self.world,
        }
    }

    /// The world communicator, then the 2D ones when present.
    fn all(&self) -> Vec<Arc<NcclCommunicator>> {
        let mut out = vec![self.world.clone()];
        if let Some((a, e)) = &self.two_d {
            out.push(a.clone());
            out.push(e.clone());
        }
        out
    }
}

/// A channel's collectives.
enum Comms {
    Nccl(NcclGroups),
    /// TCP rings over host memory (CPU tensors only).
    Tcp(Groups),
}

/// One channel: its communicators, its algorithm state and its Top-K residuals.
struct Channel {
    comms: Comms,
    algorithm: Algorithm,
    residuals: HashMap<u64, Slot>,
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

fn dptr(addr: usize) -> DevicePtr {
    DevicePtr(addr as *mut std::ffi::c_void)
}

fn sptr(addr: usize) -> *mut std::ffi::c_void {
    addr as *mut std::ffi::c_void
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
        let kernels = self.kernels.bind(py);
        let mut backend = DeviceBackend {
            py,
            kernels,
            comms,
            residuals,
            slots: vec![Slot {
                tensor: buf.unbind(),
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
        let mut backend = DeviceBackend {
            py,
            kernels,
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

/// [`Backend`] over torch tensors, for one allreduce.
struct DeviceBackend<'a, 'py> {
    py: Python<'py>,
    kernels: &'a Bound<'py, PyAny>,
    comms: &'a mut Comms,
    residuals: &'a mut HashMap<u64, Slot>,
    /// The bucket, then this operation's scratch tensors.
    slots: Vec<Slot>,
    stream: usize,
    deadline: Deadline,
    world_rank: usize,
    bucket: u64,
}

impl<'py> DeviceBackend<'_, 'py> {
    /// The tensor holding `m`, and `m`'s byte offset in it.
    fn find(&self, m: Mem) -> tiacc_core::Result<(&Py<PyAny>, usize)> {
        self.slots
            .iter()
            .chain(self.residuals.values())
            .find(|s| s.mem.contains(m))
            .map(|s| (&s.tensor, m.addr - s.mem.addr))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "device backend: {} bytes at {:#x} are not memory of the current operation",
                    m.bytes, m.addr
                ))
            })
    }

    /// `(tensor, byte offset, bytes)` of `m`, as the kernels take it.
    fn arg(&self, m: Mem) -> tiacc_core::Result<(Py<PyAny>, usize, usize)> {
        let (t, offset) = self.find(m)?;
        Ok((t.clone_ref(self.py), offset, m.bytes))
    }

    /// Calls kernel `name`; its failure becomes this rank's error.
    fn kernel<'k>(
        &'k self,
        name: &str,
        args: impl pyo3::call::PyCallArgs<'py>,
    ) -> tiacc_core::Result<Bound<'py, PyAny>> {
        self.kernels.call_method1(name, args).map_err(|e| {
            let what = match self.bucket {
                PROBE_BUCKET => "the auto probe".to_string(),
                b => format!("bucket {b}"),
            };
            Error::Comm {
                peer: Some(self.world_rank),
                message: format!(
                    "rank {}: {what}: the {name} kernel failed: {e}",
                    self.world_rank
                ),
            }
        })
    }

    fn new_slot(&mut self, bytes: usize) -> tiacc_core::Result<Slot> {
        let tensor = self.kernel("empty", (bytes,))?;
        let mem = tensor_mem(&tensor).map_err(|e| Error::Comm {
            peer: Some(self.world_rank),
            message: format!("the empty kernel returned an unusable tensor: {e}"),
        })?;
        Ok(Slot {
            tensor: tensor.unbind(),
            mem,
        })
    }

    /// `m` as a host slice (TCP collectives on CPU tensors).
    fn host(&self, m: Mem) -> tiacc_core::Result<&'static mut [u8]> {
        self.find(m)?;
        if m.bytes == 0 {
            return Ok(&mut []);
        }
        // SAFETY: `m` lies inside a tensor this operation holds (checked
        // above), whose memory is host memory: the engine only takes the TCP
        // transport for CPU tensors (the shim's contract, as for the host
        // engine). The slice is only used by the one collective it is made
        // for, while the tensor is alive and nothing else touches it.
        Ok(unsafe { std::slice::from_raw_parts_mut(m.addr as *mut u8, m.bytes) })
    }

    fn tcp(&mut self, group: GroupId) -> tiacc_core::Result<&mut dyn Transport> {
        let Comms::Tcp(groups) = &mut *self.comms else {
            return Err(Error::InvalidArgument(
                "device backend: a TCP collective on an NCCL channel".into(),
            ));
        };
        Ok(match (group, groups.hierarchy.as_mut()) {
            (GroupId::Intra, Some(h)) => h.intra.as_mut(),
            (GroupId::Inter, Some(h)) => h.inter.as_mut(),
            _ => groups.world.as_mut(),
        })
    }

    /// Reduce-scatter of equal chunks of `whole` (`chunk` elements each),
    /// in place: this rank's chunk is reduced where it lies.
    fn reduce_scatter_equal(
        &mut self,
        group: GroupId,
        whole: Mem,
        chunk: usize,
        dtype: DType,
    ) -> tiacc_core::Result<()> {
        let (deadline, stream, rank) = (self.deadline, self.stream, self.rank(group));
        let size = self.size(group);
        // NCCL's in-place form: the receive buffer is this rank's chunk of
        // the send buffer. Both transports get these same pointers.
        let (send, recv) = (whole.addr, whole.addr + rank * chunk * dtype.size());
        match &*self.comms {
            Comms::Nccl(g) => {
                let comm = g.get(group).clone();
                self.py.detach(move || {
                    // SAFETY: `whole` is device memory of a live tensor of
                    // this operation holding `chunk * size` elements (the
                    // caller padded it), `recv` is this rank's chunk inside
                    // it, and the tensors stay alive for the stream (the
                    // shim's record_stream).
                    unsafe {
                        comm.reduce_scatter(
                            dptr(send),
                            dptr(recv),
                            chunk,
                            dtype,
                            ReduceOp::Sum,
                            sptr(stream),
                        )
                    }
                })
            }
            Comms::Tcp(_) => {
                let span = in_place(send, recv, chunk * dtype.size(), size, rank, true)?;
                let buf = self.host(span)?;
                let py = self.py;
                let t = self.tcp(group)?;
                py.detach(move || t.reduce_scatter(buf, dtype, deadline))
            }
        }
    }

    /// Allgather of equal chunks of `whole` (`chunk` bytes each), in place.
    fn allgather_equal(
        &mut self,
        group: GroupId,
        whole: Mem,
        chunk: usize,
    ) -> tiacc_core::Result<()> {
        let (deadline, stream, rank) = (self.deadline, self.stream, self.rank(group));
        let size = self.size(group);
        // NCCL's in-place form: the send buffer is this rank's chunk of the
        // receive buffer. Both transports get these same pointers.
        let (send, recv) = (whole.addr + rank * chunk, whole.addr);
        match &*self.comms {
            Comms::Nccl(g) => {
                let comm = g.get(group).clone();
                self.py.detach(move || {
                    // SAFETY: as in `reduce_scatter_equal`: `whole` holds
                    // `chunk * size` bytes and `send` is this rank's chunk
                    // inside it.
                    unsafe { comm.all_gather_bytes(dptr(send), dptr(recv), chunk, sptr(stream)) }
                })
            }
            Comms::Tcp(_) => {
                let span = in_place(send, recv, chunk, size, rank, false)?;
                let buf = self.host(span)?;
                let py = self.py;
                let t = self.tcp(group)?;
                py.detach(move || t.allgather(buf, 1, deadline))
            }
        }
    }
}

/// The whole buffer of an in-place collective on equal chunks of
/// `chunk_bytes`, checking NCCL's in-place rule: this rank's chunk of the
/// whole buffer is the receive buffer (`scatter`) or the send buffer.
fn in_place(
    send: usize,
    recv: usize,
    chunk_bytes: usize,
    size: usize,
    rank: usize,
    scatter: bool,
) -> tiacc_core::Result<Mem> {
    let (whole, mine) = if scatter { (send, recv) } else { (recv, send) };
    if mine != whole + rank * chunk_bytes {
        return Err(Error::InvalidArgument(format!(
            "device backend: not an in-place collective: rank {rank}'s chunk at {mine:#x}, \
             expected {:#x}",
            whole + rank * chunk_bytes
        )));
    }
    Ok(Mem::new(whole, chunk_bytes * size))
}

impl Backend for DeviceBackend<'_, '_> {
    fn rank(&self, group: GroupId) -> usize {
        match &*self.comms {
            Comms::Nccl(g) => g.get(group).rank(),
            Comms::Tcp(g) => match (group, &g.hierarchy) {
                (GroupId::Intra, Some(h)) => h.intra.rank(),
                (GroupId::Inter, Some(h)) => h.inter.rank(),
                _ => g.world.rank(),
            },
        }
    }

    fn size(&self, group: GroupId) -> usize {
        match &*self.comms {
            Comms::Nccl(g) => g.get(group).size(),
            Comms::Tcp(g) => match (group, &g.hierarchy) {
                (GroupId::Intra, Some(h)) => h.intra.size(),
                (GroupId::Inter, Some(h)) => h.inter.size(),
                _ => g.world.size(),
            },
        }
    }

    fn hierarchical(&self) -> bool {
        match &*self.comms {
            Comms::Nccl(g) => g.two_d.is_some(),
            Comms::Tcp(g) => g.hierarchy.is_some(),
        }
    }

    /// NCCL: the bytes handed to the group's communicator; TCP: what its
    /// ring sent.
    fn bytes_sent(&self, group: GroupId) -> u64 {
        match &*self.comms {
            Comms::Nccl(g) => match (group, &g.two_d) {
                (GroupId::World, _) => g.world.bytes_given(),
                (_, None) => 0,
                (_, Some(_)) => g.get(group).bytes_given(),
            },
            Comms::Tcp(g) => match (group, &g.hierarchy) {
                (GroupId::World, _) => g.world.bytes_sent(),
                (GroupId::Intra, Some(h)) => h.intra.bytes_sent(),
                (GroupId::Inter, Some(h)) => h.inter.bytes_sent(),
                (_, None) => 0,
            },
        }
    }

    fn agree(&mut self, group: GroupId, tag: &OpTag) -> tiacc_core::Result<()> {
        // NCCL cannot compare tags without waiting on the device; DDP gives
        // every rank the same bucket layout.
        if matches!(&*self.comms, Comms::Nccl(_)) {
            return Ok(());
        }
        let (deadline, tag) = (self.deadline, *tag);
        let py = self.py;
        let t = self.tcp(group)?;
        py.detach(move || t.agree(&tag, deadline))
    }

    fn allreduce(
        &mut self,
        group: GroupId,
        tag: Option<&OpTag>,
        buf: Mem,
        dtype: DType,
    ) -> tiacc_core::Result<()> {
        let (deadline, stream, tag) = (self.deadline, self.stream, tag.copied());
        match &*self.comms {
            Comms::Nccl(g) => {
                self.find(buf)?;
                let comm = g.get(group).clone();
                let (addr, count) = (buf.addr, buf.bytes / dtype.size());
                self.py.detach(move || {
                    // SAFETY: `buf` lies inside a live device tensor of this
                    // operation (checked above) holding `count` elements,
                    // on the channel stream's device; the tensor stays alive
                    // for the stream (the shim's record_stream).
                    unsafe {
                        comm.all_reduce(
                            dptr(addr),
                            dptr(addr),
                            count,
                            dtype,
                            ReduceOp::Sum,
                            sptr(stream),
                        )
                    }
                })
            }
            Comms::Tcp(_) => {
                let s = self.host(buf)?;
                let py = self.py;
                let t = self.tcp(group)?;
                py.detach(move || t.allreduce_divided(tag.as_ref(), s, dtype, 1.0, deadline))
            }
        }
    }

    fn reduce_scatter(
        &mut self,
        group: GroupId,
        buf: Mem,
        dtype: DType,
    ) -> tiacc_core::Result<Shards> {
        let (size, rank, e) = (self.size(group), self.rank(group), dtype.size());
        let n = buf.bytes / e;
        let chunk = n.div_ceil(size);
        // Collectives on equal chunks: pad into scratch when `n` does not
        // split evenly (the valid elements of every chunk are the same as
        // `shard_range`'s).
        let whole = if n % size == 0 {
            buf
        } else {
            let padded = self.alloc(chunk * size * e)?;
            self.copy(buf, padded.prefix(buf.bytes)?)?;
            padded
        };
        self.reduce_scatter_equal(group, whole, chunk, dtype)?;
        let valid = shard_range(n, size, rank).len();
        let start = rank * chunk * e;
        Ok(Shards {
            whole,
            mine: whole.slice(start..start + valid * e)?,
        })
    }

    fn allgather(
        &mut self,
        group: GroupId,
        shards: Shards,
        dst: Mem,
        _elem: usize,
    ) -> tiacc_core::Result<()> {
        let size = self.size(group);
        if shards.whole.bytes % size != 0 || shards.whole.bytes < dst.bytes {
            return Err(Error::InvalidArgument(format!(
                "device backend: {} bytes of shards do not split into {size} equal chunks \
                 covering {} bytes",
                shards.whole.bytes, dst.bytes
            )));
        }
        self.allgather_equal(group, shards.whole, shards.whole.bytes / size)?;
        if shards.whole != dst {
            self.copy(shards.whole.prefix(dst.bytes)?, dst)?;
        }
        Ok(())
    }

    /// Stream-ordered: the chunks run one after another on the channel's
    /// stream (the algorithm hands over a single chunk, see `pipelines`).
    fn two_d(
        &mut self,
        dtype: DType,
        chunks: &[Mem],
        inter: &tiacc_core::comm::backend::InterStep,
    ) -> tiacc_core::Result<()> {
        tiacc_core::comm::algo::two_d_in_order(self, dtype, chunks, inter)
    }

    fn alloc(&mut self, bytes: usize) -> tiacc_core::Result<Mem> {
        let slot = self.new_slot(bytes)?;
        let mem = slot.mem;
        self.slots.push(slot);
        Ok(mem)
    }

    fn residual(&mut self, key: u64, bytes: usize) -> tiacc_core::Result<Mem> {
        if let Some(s) = self.residuals.get(&key).filter(|s| s.mem.bytes == bytes) {
            return Ok(s.mem);
        }
        let slot = self.new_slot(bytes)?;
        let mem = slot.mem;
        self.residuals.insert(key, slot);
        Ok(mem)
    }

    fn clear_residuals(&mut self) {
        self.residuals.clear();
    }

    fn copy(&mut self, src: Mem, dst: Mem) -> tiacc_core::Result<()> {
        if src.bytes != dst.bytes {
            return Err(Error::InvalidArgument(format!(
                "device backend: a copy of {} bytes into {} bytes",
                src.bytes, dst.bytes
            )));
        }
        let (s, so, n) = self.arg(src)?;
        let (d, dof, _) = self.arg(dst)?;
        self.kernel("copy", (s, so, d, dof, n)).map(drop)
    }

    fn div(&mut self, buf: Mem, dtype: DType, divisor: f64) -> tiacc_core::Result<()> {
        let (t, o, n) = self.arg(buf)?;
        self.kernel("div", (t, o, n, dtype.name(), divisor))
            .map(drop)
    }

    fn encode(
        &mut self,
        src: Mem,
        dtype: DType,
        factor: f64,
        dst: Mem,
        wire: DType,
    ) -> tiacc_core::Result<()> {
        let (s, so, sn) = self.arg(src)?;
        let (d, dof, dn) = self.arg(dst)?;
        let args = (s, so, sn, dtype.name(), factor, d, dof, dn, wire.name());
        self.kernel("cast", args).map(drop)
    }

    fn decode(
        &mut self,
        src: Mem,
        wire: DType,
        factor: f64,
        dst: Mem,
        dtype: DType,
    ) -> tiacc_core::Result<()> {
        let (s, so, sn) = self.arg(src)?;
        let (d, dof, dn) = self.arg(dst)?;
        let args = (s, so, sn, wire.name(), factor, d, dof, dn, dtype.name());
        self.kernel("cast", args).map(drop)
    }

    fn first_non_finite(
        &mut self,
        buf: Mem,
        dtype: DType,
    ) -> tiacc_core::Result<Option<(usize, f64)>> {
        let (t, o, n) = self.arg(buf)?;
        let found = self.kernel("first_non_finite", (t, o, n, dtype.name()))?;
        found
            .extract::<Option<(usize, f64)>>()
            .map_err(|e| Error::Comm {
                peer: Some(self.world_rank),
                message: format!("the first_non_finite kernel returned an unexpected value: {e}"),
            })
    }

    fn topk_pack(
        &mut self,
        data: Mem,
        residual: Mem,
        layout: TopKBlock,
        out: Mem,
    ) -> tiacc_core::Result<()> {
        let (d, dof, _) = self.arg(data)?;
        let (r, ro, _) = self.arg(residual)?;
        let (o, oo, _) = self.arg(out)?;
        let args = (d, dof, r, ro, o, oo, layout.n, layout.k, layout.fp16_values);
        self.kernel("topk_pack", args).map(drop)
    }

    fn topk_sum(
        &mut self,
        gathered: Mem,
        layout: TopKBlock,
        out: Mem,
        _group: GroupId,
        _bucket: u64,
    ) -> tiacc_core::Result<()> {
        let (g, go, _) = self.arg(gathered)?;
        let (o, oo, _) = self.arg(out)?;
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
        self.kernel("topk_sum", args).map(drop)
    }

    fn clip_norm(&mut self, buf: Mem, max_norm: f64) -> tiacc_core::Result<()> {
        let (t, o, n) = self.arg(buf)?;
        self.kernel("clip_norm", (t, o, n / 4, max_norm)).map(drop)
    }

    fn momentum_step(&mut self, velocity: Mem, data: Mem, momentum: f64) -> tiacc_core::Result<()> {
        let (u, uo, n) = self.arg(velocity)?;
        let (d, dof, dn) = self.arg(data)?;
        same_length(n, dn)?;
        self.kernel("momentum_step", (u, uo, d, dof, n / 4, momentum))
            .map(drop)
    }

    fn topk_mask(&mut self, block: Mem, layout: TopKBlock, buf: Mem) -> tiacc_core::Result<()> {
        let (k, ko, kn) = self.arg(block)?;
        let (b, bo, bn) = self.arg(buf)?;
        if kn < layout.values_offset() {
            return Err(Error::InvalidArgument(
                "device backend: a Top-K block shorter than its indices".into(),
            ));
        }
        self.kernel("topk_mask", (k, ko, layout.k, b, bo, bn / 4))
            .map(drop)
    }

    fn momentum_correct(
        &mut self,
        data: Mem,
        previous: Mem,
        momentum: f64,
    ) -> tiacc_core::Result<()> {
        let (d, dof, n) = self.arg(data)?;
        let (p, po, pn) = self.arg(previous)?;
        same_length(n, pn)?;
        self.kernel("momentum_correct", (d, dof, p, po, n / 4, momentum))
            .map(drop)
    }
}

/// Errors unless two element-wise operands have the same length in bytes.
fn same_length(a: usize, b: usize) -> tiacc_core::Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "device backend: element-wise operands of {a} and {b} bytes"
        )))
    }
}

/// What the `auto` probe needs besides the collectives: the kernels move
/// its timings in and out of device memory and wait for the device.
impl Probing for DeviceBackend<'_, '_> {
    fn write(&mut self, dst: Mem, src: &[u8]) -> tiacc_core::Result<()> {
        if dst.bytes != src.len() {
            return Err(Error::InvalidArgument(format!(
                "device backend: {} bytes written to a span of {}",
                src.len(),
                dst.bytes
            )));
        }
        let (t, o, _) = self.arg(dst)?;
        let data = PyBytes::new(self.py, src);
        self.kernel("load", (t, o, data)).map(drop)
    }

    fn read(&mut self, src: Mem, dst: &mut [u8]) -> tiacc_core::Result<()> {
        let (t, o, n) = self.arg(src)?;
        let got = self.kernel("fetch", (t, o, n))?;
        let bytes = got
            .cast::<PyBytes>()
            .map_err(|e| Error::InvalidArgument(format!("the fetch kernel: {e}")))?
            .as_bytes();
        if bytes.len() != dst.len() {
            return Err(Error::InvalidArgument(format!(
                "device backend: the fetch kernel gave {} bytes, {} were asked for",
                bytes.len(),
                dst.len()
            )));
        }
        dst.copy_from_slice(bytes);
        Ok(())
    }

    fn finish(&mut self) -> tiacc_core::Result<()> {
        self.kernel("synchronize", ()).map(drop)
    }
}
