//! The device engine's channels, apart from any framework: each channel's
//! communicators (NCCL, or TCP for host buffers), algorithm and Top-K
//! state; the failure rule, the NCCL watchdog, the job's progress and the
//! counters; joining the NCCL communicators and the `auto` probe.
//!
//! The framework's side (the Python bindings) hands in the buffers and its
//! [`Kernels`]; every call here only enqueues work on NCCL (nothing waits on
//! the device except the NaN check's one flag), and TCP calls return when
//! done. The watchdog bounds each bucket's wait; any failure goes through
//! [`Failures`] (published, recorded, every communicator aborted) and is
//! returned by the next call.
//!
//! The channels' state across steps (Top-K's buffers and step counts) is
//! exported and imported as an [`EngineState`] ([`DeviceChannels::export_state`],
//! [`DeviceChannels::import_state`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::Duration;

use super::backend::{Comms, DeviceBackend, NcclGroups, Slot, PROBE_BUCKET};
use super::kernels::{Kernels, Span};
use crate::comm::algo::{AlgoSettings, Algorithm, Bucket, Layout};
use crate::comm::auto::{self, Probe};
use crate::comm::backend::{Backend, GroupId, GroupSum, Shards};
use crate::comm::codec::Compression;
use crate::comm::collective::DeviceCollective;
use crate::comm::counters::{wire_of, wire_since, Counters, Path};
use crate::comm::dtype::DType;
use crate::comm::engine::channel_of;
use crate::comm::failure::{FailureBoard, Failures};
use crate::comm::host::Groups;
use crate::comm::nccl::{
    Group, NcclCommunicator, NcclLibrary, NcclUniqueId, Pending, Tracker, Watchdog, Watched,
};
use crate::comm::progress::{self, Position, Progress, Recorder};
use crate::comm::sharded;
use crate::comm::state::{self, EngineState};
use crate::comm::transport::{Aborter, Deadline, OpKind, OpTag};
use crate::error::{Error, Result};

/// How often the watchdog checks a pending bucket.
pub const WATCH_POLL: Duration = Duration::from_millis(5);

/// How long a shutdown waits for its communicators' `ncclCommAbort`s.
pub const SHUTDOWN_ABORT_WAIT: Duration = Duration::from_secs(10);

/// One channel: its communicators, its algorithm state and its Top-K
/// residuals (buffers of type `B`).
struct Channel<B> {
    comms: Comms,
    algorithm: Algorithm,
    residuals: HashMap<u64, Slot<B>>,
    seq: u64,
    /// The bucket and step of the collective enqueued last (for `watch`).
    last: Option<Position>,
}

/// The NCCL unique ids of every communicator a rank joins, per channel:
/// the world's, and with the 2D groups this rank's place and the
/// intra-node and inter-node ones.
pub struct NcclIds {
    pub world: Vec<NcclUniqueId>,
    pub two_d: Option<(Layout, Vec<NcclUniqueId>, Vec<NcclUniqueId>)>,
}

/// A device engine's channels and their shared state (see the module docs).
pub struct DeviceChannels<B> {
    rank: usize,
    size: usize,
    timeout: Duration,
    failures: Arc<Failures>,
    channels: Vec<Mutex<Channel<B>>>,
    /// Each channel's NCCL communicators, for the watchdog.
    watched: Vec<Vec<Arc<NcclCommunicator>>>,
    watchdog: Option<Watchdog>,
    closed: bool,
    /// Where this rank is in the job ([`progress`]).
    progress: Arc<Progress>,
    /// Writes `progress` to the board (when there is one).
    recorder: Option<Recorder>,
    /// What the channels carried ([`crate::comm::counters`]).
    counters: Arc<Counters>,
    /// The settings the channels' state depends on
    /// ([`state::settings_of`]), once opened.
    state_settings: BTreeMap<String, String>,
}

/// Locks a channel, waiting with the framework's lock released (the
/// holder may need it to finish).
fn lock<'a, B, K: Kernels>(kernels: &K, m: &'a Mutex<Channel<B>>) -> MutexGuard<'a, Channel<B>> {
    loop {
        match m.try_lock() {
            Ok(guard) => return guard,
            Err(TryLockError::Poisoned(p)) => return p.into_inner(),
            Err(TryLockError::WouldBlock) => kernels.unlocked(std::thread::yield_now),
        }
    }
}

impl<B> DeviceChannels<B> {
    /// An engine of `size` ranks, this one `rank`, with no channel yet;
    /// `board` is the job's failure board (progress is recorded there).
    pub fn new(
        rank: usize,
        size: usize,
        timeout: Duration,
        board: Option<Arc<dyn FailureBoard>>,
    ) -> Result<Self> {
        let progress = Arc::new(Progress::new());
        let recorder = board
            .clone()
            .map(|b| Recorder::start(progress.clone(), b, rank))
            .transpose()?;
        Ok(DeviceChannels {
            rank,
            size,
            timeout,
            failures: Arc::new(Failures::new(board)),
            channels: Vec::new(),
            watched: Vec::new(),
            watchdog: None,
            closed: false,
            progress,
            recorder,
            counters: Arc::new(Counters::new()),
            state_settings: BTreeMap::new(),
        })
    }

    /// Whether channels are open and [`DeviceChannels::shutdown`] has not run.
    pub fn connected(&self) -> bool {
        !self.channels.is_empty() && !self.closed
    }

    /// Whether channels were opened (even if shut down since).
    pub fn opened(&self) -> bool {
        !self.channels.is_empty()
    }

    pub fn counters(&self) -> &Arc<Counters> {
        &self.counters
    }

    pub fn progress(&self) -> &Arc<Progress> {
        &self.progress
    }

    /// The channel bucket `bucket` runs on.
    pub fn channel_of(&self, bucket: u64) -> usize {
        channel_of(bucket, self.channels.len().max(1))
    }

    /// Joins every NCCL communicator of `ids` from `lib` on the calling
    /// thread's CUDA device, each bounded by the timeout; blocks until
    /// every member joined.
    pub fn join_nccl(&self, lib: Arc<NcclLibrary>, ids: &NcclIds) -> Result<Vec<NcclGroups>> {
        let (rank, size, timeout) = (self.rank, self.size, self.timeout);
        let join = |id: &NcclUniqueId, rank: usize, size: usize, group: Group| {
            NcclCommunicator::init_bounded(
                lib.clone(),
                id,
                rank,
                size,
                group,
                Deadline::after(timeout),
            )
            .map(Arc::new)
        };
        let mut out = Vec::with_capacity(ids.world.len());
        for (c, id) in ids.world.iter().enumerate() {
            let world = join(id, rank, size, Group::World)?;
            let two_d = match &ids.two_d {
                None => None,
                Some((l, a, e)) => Some((
                    join(&a[c], l.local_rank(), l.intra_size, Group::Intra)?,
                    join(&e[c], l.node(), l.nodes(), Group::Inter)?,
                )),
            };
            out.push(NcclGroups { world, two_d });
        }
        Ok(out)
    }

    /// Watches NCCL channels: their communicators are aborted on a failure
    /// and polled by the watchdog, which bounds every pending bucket.
    pub fn watch_nccl(&mut self, groups: &[NcclGroups]) -> Result<()> {
        self.watched = groups.iter().map(NcclGroups::all).collect();
        let aborters = self.watched.iter().flatten().map(|comm| {
            let comm = comm.clone();
            Box::new(move || comm.abort("aborted after a failure on this engine")) as Aborter
        });
        self.failures.add_aborters(aborters);
        let tracker = Tracker {
            progress: self.progress.clone(),
            rank: self.rank,
            size: self.size,
        };
        self.watchdog = Some(Watchdog::start_tracking(
            self.failures.clone(),
            WATCH_POLL,
            Some(tracker),
        )?);
        Ok(())
    }

    /// TCP channels' groups break on a failure.
    pub fn watch_tcp(&self, groups: &[Groups]) {
        self.failures
            .add_aborters(groups.iter().flat_map(Groups::aborters));
    }

    /// Times flat against 2D (`TIACC_TRAINING_ALGORITHM=auto`) on `comms`,
    /// through the backend buckets use, in a scratch buffer of `bytes` on
    /// `stream`. NCCL's steps are only enqueued: the watchdog bounds the
    /// probe as it bounds a bucket, aborting every communicator at the
    /// deadline so that the wait ends.
    pub fn probe<K: Kernels<Buffer = B>>(
        &self,
        kernels: &K,
        comms: &mut Comms,
        bytes: usize,
        stream: usize,
    ) -> Result<Probe> {
        let deadline = Deadline::after(self.timeout);
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
            kernels,
            comms,
            residuals: &mut residuals,
            slots: Vec::new(),
            stream,
            deadline,
            world_rank: self.rank,
            bucket: PROBE_BUCKET,
        };
        let result = backend
            .alloc(bytes)
            .and_then(|buf| auto::probe(&mut backend, buf));
        drop(backend);
        done.store(true, Ordering::SeqCst);
        result.map_err(|e| self.failures.fail(e))
    }

    /// Flat was chosen: closes the 2D communicators of `comms` (they would
    /// only hold device memory) and stops watching them.
    pub fn drop_two_d<K: Kernels>(&mut self, kernels: &K, comms: &mut [Comms]) {
        let unused: Vec<_> = comms
            .iter_mut()
            .filter_map(|c| match c {
                Comms::Nccl(g) => g.two_d.take(),
                Comms::Tcp(_) => None,
            })
            .collect();
        kernels.unlocked(move || {
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

    /// Opens one channel per element of `comms`, each running `settings`.
    pub fn open(&mut self, comms: Vec<Comms>, settings: AlgoSettings) {
        let intra_size = comms.first().and_then(|c| match c {
            Comms::Nccl(g) => g.two_d.as_ref().map(|(intra, _)| intra.size()),
            Comms::Tcp(g) => g.hierarchy.as_ref().map(|h| h.layout.intra_size),
        });
        self.state_settings = state::settings_of(&settings, intra_size);
        self.channels = comms
            .into_iter()
            .map(|comms| {
                Mutex::new(Channel {
                    comms,
                    algorithm: Algorithm::with_counters(settings, Arc::clone(&self.counters)),
                    residuals: HashMap::new(),
                    seq: 0,
                    last: None,
                })
            })
            .collect();
    }

    /// Runs the allreduce of a bucket held in `buf` (elements of `dtype`):
    /// with NCCL every step is enqueued on `stream` and this returns at
    /// once; with TCP it returns when done. Returns the engine's failure,
    /// if any.
    pub fn allreduce<K: Kernels<Buffer = B>>(
        &self,
        kernels: &K,
        buf: Slot<B>,
        dtype: DType,
        bucket: u64,
        average: bool,
        stream: usize,
    ) -> Result<()> {
        let mem = buf.mem;
        self.run(
            kernels,
            buf,
            dtype,
            bucket,
            stream,
            OpKind::Allreduce,
            |b, algorithm, tag| {
                let bucket = Bucket {
                    tag,
                    buf: mem,
                    dtype,
                };
                algorithm.allreduce(b, bucket, average)
            },
        )
    }

    /// Runs one of torch.distributed's collectives on `buf` (one equal
    /// block per rank for the sharded ones), exact unless the
    /// configuration compresses reduce-scatters, as the CPU engine runs
    /// them ([`crate::comm::sharded`]: over the 2D groups when the
    /// channel's algorithm goes 2D), enqueued on `stream` like a bucket.
    pub fn collective<K: Kernels<Buffer = B>>(
        &self,
        kernels: &K,
        op: DeviceCollective,
        buf: Slot<B>,
        dtype: DType,
        bucket: u64,
        stream: usize,
    ) -> Result<()> {
        let mean = matches!(
            op,
            DeviceCollective::Allreduce { mean: true }
                | DeviceCollective::ReduceScatter { mean: true }
        );
        // The kernels divide floating-point elements only (NCCL itself
        // averages integers: the caller leaves those to it).
        if mean && !dtype.is_float() {
            return Err(Error::InvalidArgument(format!(
                "the device engine averages floating-point elements only, not {}",
                dtype.name()
            )));
        }
        let mem = buf.mem;
        let kind = match op {
            DeviceCollective::Allreduce { .. } => OpKind::Allreduce,
            DeviceCollective::ReduceScatter { .. } => OpKind::ReduceScatter,
            DeviceCollective::Allgather => OpKind::Allgather,
        };
        let size = self.size;
        self.run(
            kernels,
            buf,
            dtype,
            bucket,
            stream,
            kind,
            |b, algorithm, tag| {
                let divisor = |mean: bool| if mean && size > 1 { size as f64 } else { 1.0 };
                let mut plan = algorithm.settings().reduce_scatter_plan();
                plan.two_d &= b.hierarchical();
                let before = wire_of(b);
                let (path, codec) = match op {
                    DeviceCollective::Allreduce { mean } => {
                        b.agree(GroupId::World, tag)?;
                        let sum = GroupSum {
                            tag: Some(tag),
                            ..GroupSum::plain(GroupId::World, dtype)
                        };
                        b.allreduce(mem, &sum)?;
                        if divisor(mean) != 1.0 {
                            b.div(mem, dtype, divisor(mean))?;
                        }
                        (Path::Collective, Compression::None)
                    }
                    DeviceCollective::ReduceScatter { mean } => {
                        sharded::reduce_scatter(b, tag, mem, dtype, divisor(mean), &plan)?;
                        let path = if plan.two_d {
                            Path::Collective2d
                        } else {
                            Path::Collective
                        };
                        (path, plan.codec(dtype))
                    }
                    DeviceCollective::Allgather if plan.two_d => {
                        sharded::allgather_two_d(b, tag, mem, dtype.size())?;
                        (Path::Collective2d, Compression::None)
                    }
                    DeviceCollective::Allgather => {
                        b.agree(GroupId::World, tag)?;
                        let (rank, size) = (b.rank(GroupId::World), b.size(GroupId::World));
                        let shards = Shards::in_place(mem, dtype.size(), size, rank)?;
                        b.allgather(GroupId::World, shards, mem, dtype.size())?;
                        (Path::Collective, Compression::None)
                    }
                };
                let wire = wire_since(before, wire_of(b));
                algorithm
                    .counters()
                    .record(path, codec, mem.bytes as u64, wire);
                Ok(())
            },
        )
    }

    /// Runs `body` on the channel of `bucket` with a device backend over
    /// `buf`: the channel's sequence number and the job's progress, then
    /// the failure rule on an error (hang attribution on TCP, every
    /// communicator aborted, the failure kept for the next call).
    #[allow(clippy::too_many_arguments)]
    fn run<K: Kernels<Buffer = B>>(
        &self,
        kernels: &K,
        buf: Slot<B>,
        dtype: DType,
        bucket: u64,
        stream: usize,
        kind: OpKind,
        body: impl FnOnce(&mut DeviceBackend<'_, K>, &mut Algorithm, &OpTag) -> Result<()>,
    ) -> Result<()> {
        self.check()?;
        let mem = buf.mem;
        if mem.bytes % dtype.size() != 0 {
            return Err(Error::InvalidArgument(format!(
                "bucket {bucket}: {} bytes is not a whole number of {} elements",
                mem.bytes,
                dtype.name()
            )));
        }
        let mut channel = lock(kernels, &self.channels[self.channel_of(bucket)]);
        channel.seq += 1;
        let at = self.progress.submit(bucket);
        channel.last = Some(at);
        let tag = OpTag {
            op: 0,
            kind,
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
        let mut backend = DeviceBackend {
            kernels,
            comms,
            residuals,
            slots: vec![buf],
            stream,
            deadline: Deadline::after(self.timeout),
            world_rank: self.rank,
            bucket,
        };
        let result = body(&mut backend, algorithm, &tag);
        drop(backend);
        // TCP collectives are done here; NCCL ones when the watchdog sees
        // them finish (unless enqueueing failed).
        let tcp = matches!(comms, Comms::Tcp(_));
        if tcp || result.is_err() {
            self.progress.complete();
        }
        result.map_err(|err| {
            let err = match self.failures.board() {
                Some(board) if tcp && self.failures.first().is_none() => {
                    let (rank, size, progress) = (self.rank, self.size, &self.progress);
                    kernels.unlocked(|| {
                        progress::attribute_timeout(err, at, progress, board, rank, size)
                    })
                }
                _ => err,
            };
            let err = self.failures.fail(err);
            if let Comms::Tcp(groups) = comms {
                groups.abort();
            }
            err
        })
    }

    /// Hands the watchdog the completion test of the work just enqueued on
    /// `channel` (a CUDA event's query); it bounds the wait by the timeout.
    /// Nothing to do on TCP, whose calls return when done.
    pub fn watch<K: Kernels>(
        &self,
        kernels: &K,
        channel: usize,
        is_done: Box<dyn FnMut() -> Result<bool> + Send>,
    ) {
        let (Some(dog), Some(comms)) = (&self.watchdog, self.watched.get(channel)) else {
            return;
        };
        let comms = comms
            .iter()
            .map(|c| c.clone() as Arc<dyn Watched + Send + Sync>)
            .collect();
        let at = self
            .channels
            .get(channel)
            .and_then(|c| lock(kernels, c).last.take());
        dog.submit(Pending {
            at,
            comms,
            is_done,
            deadline: Deadline::after(self.timeout),
        });
    }

    /// The engine's failure (a timeout, an NCCL error, a failure on another
    /// rank), if there was one, or an error once shut down.
    pub fn check(&self) -> Result<()> {
        if let Some(err) = self.failures.first() {
            return Err(err);
        }
        if self.closed || self.channels.is_empty() {
            return Err(Error::Comm {
                peer: None,
                message: format!(
                    "rank {}: the device engine is not connected or was shut down",
                    self.rank
                ),
            });
        }
        Ok(())
    }

    /// The channels' state across steps ([`crate::comm::state`]), once the
    /// device finished the work enqueued so far (the kernels' synchronize,
    /// then each buffer fetched). Errors when the engine failed or is shut
    /// down, or a kernel fails.
    pub fn export_state<K: Kernels<Buffer = B>>(&self, kernels: &K) -> Result<EngineState> {
        self.check()?;
        kernels
            .synchronize()
            .map_err(|e| self.kernel_failed("synchronize", e))?;
        let mut buckets = BTreeMap::new();
        for m in &self.channels {
            let channel = lock(kernels, m);
            let part = state::export_channel(channel.algorithm.sparse_state(), |key| {
                let Some(slot) = channel.residuals.get(&key) else {
                    return Ok(None);
                };
                let span = Span {
                    buffer: &slot.buffer,
                    offset: 0,
                    bytes: slot.mem.bytes,
                };
                let bytes = kernels
                    .fetch(span)
                    .map_err(|e| self.kernel_failed("fetch", e))?;
                Ok(Some(bytes))
            })?;
            buckets.extend(part);
        }
        Ok(EngineState {
            rank: self.rank,
            world_size: self.size,
            settings: self.state_settings.clone(),
            buckets,
        })
    }

    /// Replaces the channels' state across steps with `state` (exported by
    /// an engine of the same rank, world size and settings, with any number
    /// of channels): each bucket's buffers are allocated and loaded through
    /// `kernels` on the channel that bucket runs on. With `only`, only that
    /// channel's buckets are replaced (the framework allocates them on that
    /// channel's stream), after the whole state was checked. A state that
    /// does not fit ([`EngineState::check_fits`], or a bucket whose length
    /// differs from the one a channel already ran) is an
    /// [`Error::StateMismatch`] and nothing is imported.
    pub fn import_state<K: Kernels<Buffer = B>>(
        &self,
        kernels: &K,
        state: &EngineState,
        only: Option<usize>,
    ) -> Result<()> {
        self.check()?;
        if let Some(c) = only.filter(|&c| c >= self.channels.len()) {
            return Err(Error::InvalidArgument(format!(
                "channel {c} is not one of the engine's {} channels",
                self.channels.len()
            )));
        }
        state.check_fits(self.rank, self.size, &self.state_settings)?;
        let mut guards: Vec<_> = self.channels.iter().map(|m| lock(kernels, m)).collect();
        let of = |c: usize| {
            state
                .buckets
                .iter()
                .filter(move |(b, _)| self.channel_of(**b) == c)
        };
        for (c, channel) in guards.iter().enumerate() {
            state::check_lengths(of(c), channel.algorithm.sparse_state().lens())?;
        }
        for (c, channel) in guards.iter_mut().enumerate() {
            if only.is_some_and(|o| o != c) {
                continue;
            }
            let Channel {
                algorithm,
                residuals,
                ..
            } = &mut **channel;
            residuals.clear();
            let sparse = state::import_channel(of(c), |key, bytes| {
                let (buffer, mem) = kernels
                    .empty(bytes.len())
                    .map_err(|e| self.kernel_failed("empty", e))?;
                let span = Span {
                    buffer: &buffer,
                    offset: 0,
                    bytes: mem.bytes,
                };
                kernels
                    .load(span, bytes)
                    .map_err(|e| self.kernel_failed("load", e))?;
                residuals.insert(key, Slot { buffer, mem });
                Ok(())
            });
            match sparse {
                Ok(sparse) => algorithm.set_sparse_state(sparse),
                Err(err) => {
                    // Half a state is no state: the channel starts afresh.
                    residuals.clear();
                    algorithm.set_sparse_state(Default::default());
                    return Err(err);
                }
            }
        }
        Ok(())
    }

    /// A kernel's failure while exporting or importing the state.
    fn kernel_failed(&self, name: &str, e: super::kernels::KernelError) -> Error {
        Error::Comm {
            peer: Some(self.rank),
            message: format!(
                "rank {}: the engine state: the {name} kernel failed: {}",
                self.rank, e.0
            ),
        }
    }

    /// Records `err` as the engine's failure (see [`Failures::fail`]).
    pub fn fail(&self, err: Error) -> Error {
        self.failures.fail(err)
    }

    /// Stops the watchdog and aborts the communicators (never waits on
    /// peers). Safe to call twice.
    pub fn shutdown<K: Kernels>(&mut self, kernels: &K) {
        self.closed = true;
        let watchdog = self.watchdog.take();
        let recorder = self.recorder.take();
        let comms: Vec<_> = self.watched.iter().flatten().cloned().collect();
        kernels.unlocked(move || {
            drop(recorder);
            drop(watchdog);
            // Every abort starts before any is waited for (see
            // `NcclCommunicator::abort`); then a bounded wait, so that the
            // communicators are gone before a new engine builds its own,
            // and a stuck one cannot hold up the shutdown for good.
            for comm in &comms {
                comm.abort("the tiacc engine was shut down");
            }
            for comm in &comms {
                comm.wait_aborted(SHUTDOWN_ABORT_WAIT);
            }
        });
        self.channels.clear();
    }
}
