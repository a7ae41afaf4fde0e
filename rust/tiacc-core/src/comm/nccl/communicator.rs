//! A safe NCCL communicator.
//!
//! NCCL collectives are enqueued on a CUDA stream and return at once; a
//! peer that never joins shows up as a stream that never finishes, not as
//! an error. [`super::watch()`] therefore polls `ncclCommGetAsyncError` and a
//! caller-supplied "is it done" test (a CUDA event query) until a deadline,
//! and aborts the communicator when the deadline passes, which ends the
//! kernels still waiting on peers.

use std::ffi::{c_int, c_void};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use super::ffi::{self, CudaStream, NcclComm, NcclDataType, NcclRedOp, NcclResult, NcclUniqueId};
use super::library::{comm_error, NcclLibrary};
use super::ready::{await_ready, Readiness};
use super::trace;
use crate::comm::{DType, Deadline};
use crate::error::{Error, Result};

/// Which group of ranks a communicator spans (named in errors).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    /// Every rank.
    World,
    /// The ranks of one node (2D allreduce).
    Intra,
    /// One rank per node (2D allreduce).
    Inter,
}

impl Group {
    /// Parses `world`, `intra` or `inter`.
    pub fn parse(name: &str) -> Result<Self> {
        match name.trim().to_ascii_lowercase().as_str() {
            "world" => Ok(Group::World),
            "intra" => Ok(Group::Intra),
            "inter" => Ok(Group::Inter),
            other => Err(Error::InvalidArgument(format!(
                "unknown communicator group {other:?}: expected world, intra or inter"
            ))),
        }
    }

    /// The group's name.
    pub fn name(self) -> &'static str {
        match self {
            Group::World => "world",
            Group::Intra => "intra",
            Group::Inter => "inter",
        }
    }
}

impl fmt::Display for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Reduction of a collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the group size (NCCL's `ncclAvg`).
    Avg,
}

impl ReduceOp {
    fn nccl(self) -> NcclRedOp {
        match self {
            ReduceOp::Sum => NcclRedOp::Sum,
            ReduceOp::Avg => NcclRedOp::Avg,
        }
    }
}

/// A device buffer: a raw CUDA pointer and its element count. The engine
/// never dereferences it; NCCL does, on the GPU, in stream order.
#[derive(Debug, Clone, Copy)]
pub struct DevicePtr(pub *mut c_void);

/// One NCCL communicator (one group, one channel).
///
/// Collectives are serialised by an internal lock (NCCL communicators are
/// not thread-safe); [`NcclCommunicator::abort`] does not take that lock,
/// so the watchdog can abort while a launch is stuck inside NCCL.
pub struct NcclCommunicator {
    lib: Arc<NcclLibrary>,
    comm: NcclComm,
    rank: usize,
    size: usize,
    group: Group,
    /// Serialises calls that use `comm`.
    issue: Mutex<()>,
    /// Set once, by abort or destroy; later calls fail without touching NCCL.
    closed: AtomicBool,
    /// Calls inside NCCL right now (see `enter`/`abort`).
    inflight: AtomicUsize,
    /// Why the communicator was closed, for later calls' errors.
    reason: Mutex<Option<String>>,
    /// Made in NCCL's non-blocking mode: calls may return `ncclInProgress`,
    /// and are then waited for (up to `wait`) before the next one.
    non_blocking: bool,
    wait: Duration,
    /// Bytes of the send buffers handed to NCCL's collectives so far.
    given: AtomicU64,
    /// The thread running `ncclCommAbort` (see [`NcclCommunicator::abort`]).
    aborting: Mutex<Option<std::thread::JoinHandle<()>>>,
}

// SAFETY: `comm` is an opaque handle owned by this value. NCCL allows a
// communicator to be used from any thread as long as calls are not
// concurrent; every call except abort goes through the `issue` lock, and
// abort is NCCL's documented way to end operations blocked in another thread.
unsafe impl Send for NcclCommunicator {}
// SAFETY: see `Send`; shared access is serialised by `issue` and the
// `closed`/`inflight` protocol.
unsafe impl Sync for NcclCommunicator {}

impl fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclCommunicator")
            .field("group", &self.group)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

/// How long abort waits for a call in NCCL to return before it aborts
/// underneath it (NCCL's abort is what unblocks a stuck call).
const ABORT_GRACE: Duration = Duration::from_millis(200);

/// A communicator handle moved to the thread that aborts it.
struct SendComm(NcclComm);

// SAFETY: the handle is an opaque pointer that NCCL lets any thread pass to
// ncclCommAbort; once the communicator is closed, the aborting thread is
// the only user left (calls see `closed`, abort and destroy run once).
unsafe impl Send for SendComm {}

/// One `ncclCommAbort`, on the thread [`NcclCommunicator::abort`] starts.
struct AbortJob {
    lib: Arc<NcclLibrary>,
    comm: SendComm,
    place: String,
}

impl AbortJob {
    fn run(self) {
        let AbortJob { lib, comm, place } = self;
        // SAFETY: the communicator was live and is now closed by the one
        // `abort` that won the `closed` swap: no call reaches NCCL on it any
        // more, and this is its only abort/destroy. A call still stuck
        // inside NCCL is what abort exists to end (NCCL supports aborting
        // from another thread).
        let result = unsafe { (lib.fns().comm_abort)(comm.0) };
        trace::note(|| format!("{place}: ncclCommAbort returned {result}"));
    }
}

impl NcclCommunicator {
    /// Joins the communicator `id` as `rank` of `size`, bounded by
    /// `deadline`: `ncclCommInitRankConfig` in non-blocking mode, polled
    /// with `ncclCommGetAsyncError` until it completes, fails, or the
    /// deadline passes (then `ncclCommAbort` ends it and the error is a
    /// `CommTimeout`). NCCL before 2.14 has no non-blocking mode: there it
    /// is [`NcclCommunicator::init`], bounded only by NCCL itself. The
    /// calling thread's current CUDA device is the communicator's device.
    pub fn init_bounded(
        lib: Arc<NcclLibrary>,
        id: &NcclUniqueId,
        rank: usize,
        size: usize,
        group: Group,
        deadline: Deadline,
    ) -> Result<Self> {
        let Some(init_config) = lib.fns().comm_init_rank_config else {
            return Self::init(lib, id, rank, size, group);
        };
        check_rank(rank, size)?;
        let (nranks, me) = (to_c_int(size, "size")?, to_c_int(rank, "rank")?);
        let mut comm: NcclComm = std::ptr::null_mut();
        let mut config = ffi::NcclConfig::non_blocking();
        // SAFETY: `comm` and `config` are valid pointers for the call (NCCL
        // copies the config), the id is passed by value as declared, and
        // rank/size were checked above.
        let result = unsafe { init_config(&mut comm, nranks, *id, me, &mut config) };
        let place = format!("{group} communicator, rank {rank} of {size}");
        if (result != ffi::NCCL_SUCCESS && result != ffi::NCCL_IN_PROGRESS) || comm.is_null() {
            let err = lib
                .check(result, "ncclCommInitRankConfig")
                .err()
                .unwrap_or_else(|| {
                    comm_error("ncclCommInitRankConfig returned no communicator".into())
                });
            if !comm.is_null() {
                // SAFETY: the handle NCCL returned, aborted once, never used again.
                let _ = unsafe { (lib.fns().comm_abort)(comm) };
            }
            return Err(comm_error(format!("{place}: {err}")));
        }
        let built = Self::wrap(lib, comm, rank, size, group, Some(deadline.timeout));
        await_ready(
            || built.readiness("ncclCommInitRankConfig"),
            || built.abort("its initialisation did not complete"),
            deadline,
            rank,
            || format!("{place}: ncclCommInitRankConfig"),
        )?;
        Ok(built)
    }

    /// Polls `ncclCommGetAsyncError` once, without the `issue` lock (used
    /// while initialising, and inside [`NcclCommunicator::call`]).
    fn readiness(&self, what: &str) -> Result<Readiness> {
        let mut state: NcclResult = ffi::NCCL_SUCCESS;
        // SAFETY: `comm` is live (it is only freed by abort/destroy, which
        // the caller has not run) and `state` is a valid out-pointer.
        let result = unsafe { (self.lib.fns().comm_get_async_error)(self.comm, &mut state) };
        self.lib
            .check_comm(result, "ncclCommGetAsyncError", self.comm)?;
        match state {
            ffi::NCCL_SUCCESS => Ok(Readiness::Ready),
            ffi::NCCL_IN_PROGRESS => Ok(Readiness::InProgress),
            _ => Err(self
                .lib
                .check_comm(state, what, self.comm)
                .err()
                .map(|e| self.locate(e))
                .unwrap_or_else(|| comm_error(format!("{what} failed")))),
        }
    }

    /// `ncclCommInitRank`: joins the communicator `id` as `rank` of `size`.
    /// Blocks until every rank has joined; the calling thread's current
    /// CUDA device is the communicator's device.
    pub fn init(
        lib: Arc<NcclLibrary>,
        id: &NcclUniqueId,
        rank: usize,
        size: usize,
        group: Group,
    ) -> Result<Self> {
        check_rank(rank, size)?;
        let (nranks, me) = (to_c_int(size, "size")?, to_c_int(rank, "rank")?);
        let mut comm: NcclComm = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer, the id is passed by value
        // as the C API declares, and rank/size were checked above. Failure
        // (no GPU, peers missing) is reported through the result code.
        let result = unsafe { (lib.fns().comm_init_rank)(&mut comm, nranks, *id, me) };
        if result != ffi::NCCL_SUCCESS || comm.is_null() {
            let err = lib
                .check(result, "ncclCommInitRank")
                .err()
                .unwrap_or_else(|| comm_error("ncclCommInitRank returned no communicator".into()));
            return Err(comm_error(format!(
                "{group} communicator, rank {rank} of {size}: {err}"
            )));
        }
        Ok(Self::wrap(lib, comm, rank, size, group, None))
    }

    /// A live handle, blocking (`wait` is `None`) or non-blocking, whose
    /// calls that return `ncclInProgress` are waited for up to `wait`.
    fn wrap(
        lib: Arc<NcclLibrary>,
        comm: NcclComm,
        rank: usize,
        size: usize,
        group: Group,
        wait: Option<Duration>,
    ) -> Self {
        NcclCommunicator {
            lib,
            comm,
            rank,
            size,
            group,
            issue: Mutex::new(()),
            closed: AtomicBool::new(false),
            inflight: AtomicUsize::new(0),
            reason: Mutex::new(None),
            non_blocking: wait.is_some(),
            wait: wait.unwrap_or(Duration::ZERO),
            given: AtomicU64::new(0),
            aborting: Mutex::new(None),
        }
    }

    /// A non-blocking communicator around `comm`, a handle that `lib`'s
    /// functions (fakes of NCCL's, in this crate's tests) accept; calls that
    /// return `ncclInProgress` are waited for up to `wait`.
    #[cfg(test)]
    pub(crate) fn from_handle(
        lib: Arc<NcclLibrary>,
        comm: NcclComm,
        rank: usize,
        size: usize,
        group: Group,
        wait: Duration,
    ) -> Self {
        assert!(!comm.is_null(), "a communicator needs a non-null handle");
        Self::wrap(lib, comm, rank, size, group, Some(wait))
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    pub fn group(&self) -> Group {
        self.group
    }

    pub fn library(&self) -> &Arc<NcclLibrary> {
        &self.lib
    }

    /// Bytes of the send buffers handed to this communicator's collectives
    /// so far (an allreduce's buffer, a reduce-scatter's whole input, an
    /// allgather's or broadcast's part), counted when NCCL accepted the call.
    pub fn bytes_given(&self) -> u64 {
        self.given.load(Ordering::Relaxed)
    }

    fn count(&self, bytes: usize) {
        self.given.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Whether abort or destroy has run.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Runs `call` on the live handle, serialised with other calls, and
    /// maps its result. Fails without calling NCCL once closed.
    fn call(&self, what: &str, call: impl FnOnce(NcclComm) -> NcclResult) -> Result<()> {
        let guard = self.issue.lock().unwrap_or_else(|p| p.into_inner());
        self.call_locked(guard, what, call)
    }

    /// [`NcclCommunicator::call`] when no other call holds the `issue`
    /// lock; `Ok(None)` without calling NCCL when one does.
    fn try_call(
        &self,
        what: &str,
        call: impl FnOnce(NcclComm) -> NcclResult,
    ) -> Result<Option<()>> {
        let guard = match self.issue.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return Ok(None),
        };
        self.call_locked(guard, what, call).map(Some)
    }

    fn call_locked(
        &self,
        _guard: MutexGuard<'_, ()>,
        what: &str,
        call: impl FnOnce(NcclComm) -> NcclResult,
    ) -> Result<()> {
        // Dekker-style handshake with `abort`: either this call sees
        // `closed`, or abort sees `inflight > 0` and waits for it.
        self.inflight.fetch_add(1, Ordering::SeqCst);
        if self.closed.load(Ordering::SeqCst) {
            self.inflight.fetch_sub(1, Ordering::SeqCst);
            return Err(self.closed_error(what));
        }
        // The watchdog's poll of the asynchronous error runs every few
        // milliseconds: the trace leaves it out.
        let traced = what != "ncclCommGetAsyncError";
        if traced {
            trace::note(|| format!("{}: {what} enters NCCL", self.place()));
        }
        let result = call(self.comm);
        if traced {
            trace::note(|| format!("{}: {what} returned {result}", self.place()));
        }
        let outcome = if self.non_blocking && result == ffi::NCCL_IN_PROGRESS {
            // Non-blocking mode: the call goes on in NCCL's own thread
            // (setting up connections, or waiting for room behind work a
            // missing peer holds up); it must finish before the next. An
            // abort from another thread (the watchdog, after another
            // rank's failure or the deadline) ends the wait: the next poll
            // sees `closed` and leaves, so abort's grace period sees
            // `inflight` drop before it frees the handle.
            await_ready(
                || {
                    if self.is_closed() {
                        return Err(self.closed_error(what));
                    }
                    self.readiness(what)
                },
                || {},
                Deadline::after(self.wait),
                self.rank,
                || {
                    format!(
                        "{} communicator, rank {} of {}: {what}",
                        self.group, self.rank, self.size
                    )
                },
            )
        } else {
            self.lib.check_comm(result, what, self.comm)
        };
        self.inflight.fetch_sub(1, Ordering::SeqCst);
        if traced && result == ffi::NCCL_IN_PROGRESS {
            trace::note(|| {
                let how = outcome
                    .as_ref()
                    .map_or_else(|e| e.to_string(), |()| "ready".into());
                format!("{}: {what} waited for ncclInProgress: {how}", self.place())
            });
        }
        outcome.map_err(|e| self.locate(e))
    }

    /// The group and rank, for the trace.
    fn place(&self) -> String {
        format!(
            "{} communicator rank {} of {}",
            self.group, self.rank, self.size
        )
    }

    fn closed_error(&self, what: &str) -> Error {
        let reason = self
            .reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or_else(|| "it was shut down".to_string());
        comm_error(format!(
            "{what}: the {} communicator (rank {} of {}) is closed: {reason}",
            self.group, self.rank, self.size
        ))
    }

    /// Prefixes an error with the group and rank.
    fn locate(&self, err: Error) -> Error {
        match err {
            Error::Comm { peer, message } => Error::Comm {
                peer,
                message: format!(
                    "{} communicator, rank {} of {}: {message}",
                    self.group, self.rank, self.size
                ),
            },
            other => other,
        }
    }

    /// Sums (or averages) `count` elements at `send` over the group into
    /// `recv` (may equal `send`), enqueued on `stream`.
    ///
    /// # Safety
    /// `send` and `recv` must be device pointers to at least `count`
    /// elements of `dtype` on this communicator's device, `stream` a live
    /// stream of that device (or null for the legacy default stream), and
    /// the buffers must stay allocated until the stream passes this work.
    pub unsafe fn all_reduce(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: CudaStream,
    ) -> Result<()> {
        let f = self.lib.fns().all_reduce;
        let sent = count * dtype.size();
        self.call("ncclAllReduce", |comm| {
            // SAFETY: the caller guarantees the pointers, count and stream
            // (this function's contract); `comm` is live (checked in `call`).
            unsafe {
                f(
                    send.0,
                    recv.0,
                    count,
                    NcclDataType::from(dtype),
                    op.nccl(),
                    comm,
                    stream,
                )
            }
        })
        .inspect(|()| self.count(sent))
    }

    /// Reduces `recv_count * size` elements at `send` over the group; rank
    /// `r` receives block `r` (`recv_count` elements) at `recv`.
    ///
    /// # Safety
    /// As [`NcclCommunicator::all_reduce`], with `send` holding
    /// `recv_count * size` elements and `recv` `recv_count`.
    pub unsafe fn reduce_scatter(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recv_count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: CudaStream,
    ) -> Result<()> {
        let f = self.lib.fns().reduce_scatter;
        let sent = recv_count * self.size * dtype.size();
        self.call("ncclReduceScatter", |comm| {
            // SAFETY: as in `all_reduce`, under this function's contract.
            unsafe {
                f(
                    send.0,
                    recv.0,
                    recv_count,
                    NcclDataType::from(dtype),
                    op.nccl(),
                    comm,
                    stream,
                )
            }
        })
        .inspect(|()| self.count(sent))
    }

    /// Gathers `send_count` elements from every rank into `recv`
    /// (`send_count * size` elements, in rank order).
    ///
    /// # Safety
    /// As [`NcclCommunicator::all_reduce`], with `send` holding
    /// `send_count` elements and `recv` `send_count * size`.
    pub unsafe fn all_gather(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        send_count: usize,
        dtype: DType,
        stream: CudaStream,
    ) -> Result<()> {
        let f = self.lib.fns().all_gather;
        let sent = send_count * dtype.size();
        self.call("ncclAllGather", |comm| {
            // SAFETY: as in `all_reduce`, under this function's contract.
            unsafe {
                f(
                    send.0,
                    recv.0,
                    send_count,
                    NcclDataType::from(dtype),
                    comm,
                    stream,
                )
            }
        })
        .inspect(|()| self.count(sent))
    }

    /// Gathers `send_bytes` bytes from every rank into `recv`
    /// (`send_bytes * size` bytes, in rank order): an allgather of any
    /// element type, moved as bytes.
    ///
    /// # Safety
    /// As [`NcclCommunicator::all_reduce`], with `send` holding `send_bytes`
    /// bytes and `recv` `send_bytes * size`.
    pub unsafe fn all_gather_bytes(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        send_bytes: usize,
        stream: CudaStream,
    ) -> Result<()> {
        let f = self.lib.fns().all_gather;
        let sent = send_bytes;
        self.call("ncclAllGather", |comm| {
            // SAFETY: as in `all_reduce`, under this function's contract.
            unsafe {
                f(
                    send.0,
                    recv.0,
                    send_bytes,
                    NcclDataType::Uint8,
                    comm,
                    stream,
                )
            }
        })
        .inspect(|()| self.count(sent))
    }

    /// Copies `count` elements at `root`'s `send` to every rank's `recv`.
    ///
    /// # Safety
    /// As [`NcclCommunicator::all_reduce`] (`send` is read on `root` only).
    pub unsafe fn broadcast(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        root: usize,
        stream: CudaStream,
    ) -> Result<()> {
        if root >= self.size {
            return Err(Error::InvalidArgument(format!(
                "root {root} is not a rank of a group of {}",
                self.size
            )));
        }
        // Only the root's buffer is sent.
        let sent = if root == self.rank {
            count * dtype.size()
        } else {
            0
        };
        let root = to_c_int(root, "root")?;
        let f = self.lib.fns().broadcast;
        self.call("ncclBroadcast", |comm| {
            // SAFETY: as in `all_reduce`, under this function's contract;
            // `root` is a rank of the group (checked above).
            unsafe {
                f(
                    send.0,
                    recv.0,
                    count,
                    NcclDataType::from(dtype),
                    root,
                    comm,
                    stream,
                )
            }
        })
        .inspect(|()| self.count(sent))
    }

    /// The communicator's asynchronous error: `Ok(None)` while healthy (or
    /// still initialising, or while another call holds the communicator),
    /// `Ok(Some(error))` once NCCL reports a failure.
    pub fn async_error(&self) -> Result<Option<Error>> {
        let mut state: NcclResult = ffi::NCCL_SUCCESS;
        let f = self.lib.fns().comm_get_async_error;
        // Never waits behind a call in progress: the watchdog polls this,
        // and a collective whose enqueue waits on NCCL (behind work that a
        // missing peer holds up) would otherwise keep it from reading the
        // failure board and the deadline, the only things that end such a
        // wait. That call polls the same state itself meanwhile.
        let polled = self.try_call("ncclCommGetAsyncError", |comm| {
            // SAFETY: `comm` is live (checked in `call_locked`) and `state`
            // is a valid out-pointer.
            unsafe { f(comm, &mut state) }
        })?;
        if polled.is_none() {
            return Ok(None);
        }
        if state == ffi::NCCL_SUCCESS || state == ffi::NCCL_IN_PROGRESS {
            return Ok(None);
        }
        let what = "asynchronous error";
        Ok(self
            .lib
            .check_comm(state, what, std::ptr::null_mut())
            .err()
            .map(|e| self.locate(e)))
    }

    /// `ncclCommAbort`: ends outstanding operations and frees the
    /// communicator. Safe from any thread, idempotent; later calls fail
    /// with `reason`.
    pub fn abort(&self, reason: &str) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        *self.reason.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.to_string());
        trace::note(|| format!("{}: abort ({reason})", self.place()));
        // Give a call already inside NCCL a moment to return normally.
        let start = Instant::now();
        while self.inflight.load(Ordering::SeqCst) > 0 && start.elapsed() < ABORT_GRACE {
            std::thread::sleep(Duration::from_millis(1));
        }
        trace::note(|| {
            let inflight = self.inflight.load(Ordering::SeqCst);
            format!(
                "{}: ncclCommAbort with {inflight} call(s) still in NCCL",
                self.place()
            )
        });
        // ncclCommAbort runs on a thread of its own: freeing a
        // communicator's memory synchronises the device, so it waits for
        // every kernel still running, among them other communicators'
        // collectives stuck on the same missing peer until their own abort
        // sets their abort flag. An engine aborts its communicators one
        // after the other (every channel, the 2D groups): run in line, the
        // first abort would wait for kernels only the later ones end.
        let job = self.abort_job();
        let spawned = std::thread::Builder::new()
            .name("tiacc-nccl-abort".into())
            .spawn(move || job.run());
        match spawned {
            Ok(thread) => *self.aborting.lock().unwrap_or_else(|p| p.into_inner()) = Some(thread),
            // No thread to be had: abort in line rather than not at all.
            Err(_) => self.abort_job().run(),
        }
    }

    /// The `ncclCommAbort` of this (closed) communicator's handle.
    fn abort_job(&self) -> AbortJob {
        AbortJob {
            lib: self.lib.clone(),
            comm: SendComm(self.comm),
            place: self.place(),
        }
    }

    /// Waits up to `within` for this communicator's `ncclCommAbort` to
    /// return: `true` once it has (or when there was none to wait for).
    pub fn wait_aborted(&self, within: Duration) -> bool {
        let start = Instant::now();
        loop {
            let done = self
                .aborting
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .is_none_or(|t| t.is_finished());
            if done {
                return true;
            }
            if start.elapsed() >= within {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// `ncclCommDestroy`: waits for this communicator's queued work, then
    /// frees it. Use when every stream that ran its collectives is done.
    pub fn destroy(&self) -> Result<()> {
        let _guard = self.issue.lock().unwrap_or_else(|p| p.into_inner());
        if self.closed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        *self.reason.lock().unwrap_or_else(|p| p.into_inner()) = Some("it was destroyed".into());
        // SAFETY: the handle is live, `closed` is now set (no new calls) and
        // we hold `issue` (no call in flight).
        let result = unsafe { (self.lib.fns().comm_destroy)(self.comm) };
        self.lib
            .check(result, "ncclCommDestroy")
            .map_err(|e| self.locate(e))
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        // Abort, not destroy: destroy waits for queued GPU work, which
        // hangs if a peer is gone; abort never waits.
        self.abort("it was dropped");
    }
}

/// Refuses a rank outside its group before any NCCL call.
pub(crate) fn check_rank(rank: usize, size: usize) -> Result<()> {
    if size == 0 || rank >= size {
        return Err(Error::InvalidArgument(format!(
            "rank {rank} is not a rank of a group of {size}"
        )));
    }
    Ok(())
}

fn to_c_int(value: usize, what: &str) -> Result<c_int> {
    c_int::try_from(value)
        .map_err(|_| Error::InvalidArgument(format!("{what} {value} does not fit a C int")))
}
