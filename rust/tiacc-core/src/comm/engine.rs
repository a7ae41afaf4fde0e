//! The multi-channel engine: one worker thread per channel, each running its
//! queue of collectives in order.
//!
//! Buckets go to channels round-robin by bucket index. DDP launches buckets
//! in index order on every rank, so every channel sees the same sequence of
//! collectives on every rank, which is what lets several channels run
//! concurrently without deadlock. Each collective first compares a tag
//! (kind, per-channel sequence number, bucket, dtype, size) across ranks, so
//! diverging ranks raise instead of mixing unrelated buffers.
//!
//! When the job spans nodes, the channels take turns on the link between
//! nodes in submission order ([`super::turns`]), so several channels never
//! make a step slower than one.
//!
//! The engine's state across steps (Top-K's buffers and step counts, kept
//! by each channel thread) is exported and imported through the same
//! queues ([`Engine::export_state`], [`Engine::import_state`]), so it is
//! read and replaced between the jobs queued before and after.

use std::collections::{BTreeMap, HashMap};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::algo::{AlgoSettings, Algorithm, Bucket};
use super::backend::Backend;
use super::codec::Compression;
use super::collective::{check_average, Collective};
use super::counters::{wire_of, wire_since, Counters, Path};
use super::dtype::{DType, ReduceOp};
use super::failure::{FailureBoard, Failures};
use super::host::{Groups, HostBackend};
use super::mapping::SharedBytes;
use super::progress::{self, Position, Progress, Recorder};
use super::sharded::{self, ReduceScatterPlan};
use super::state::{self, BucketState, EngineState};
use super::timeline::{self, Args};
use super::transport::{Deadline, OpTag, Reduction, Transport};
use super::turns::LinkTurns;
use crate::error::{Error, Result};

/// The channel of bucket `bucket` among `channels`: round-robin by bucket
/// index, the same rule on every rank and in every engine (DDP launches
/// buckets in index order everywhere, so each channel sees the same
/// sequence of collectives on every rank).
pub fn channel_of(bucket: u64, channels: usize) -> usize {
    (bucket % channels.max(1) as u64) as usize
}

/// A buffer owned elsewhere (a torch tensor's storage) that a channel thread
/// reads and writes while a collective runs.
pub struct RawBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a RawBuf is only created through `RawBuf::new`, whose contract
// makes the memory exclusively the engine's until the job's completion
// runs; moving that exclusive access to a channel thread is sound.
unsafe impl Send for RawBuf {}

impl RawBuf {
    /// Wraps `len` bytes at `ptr`.
    ///
    /// # Safety
    /// The memory must be valid for reads and writes of `len` bytes, and
    /// nothing else may access it, until the job's completion has been
    /// called (the caller keeps the owning object alive in the completion).
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        RawBuf { ptr, len }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: `RawBuf::new`'s contract: valid, exclusive, `len` bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// Called exactly once with the job's outcome, on the channel thread:
/// where the result is when it is not in the job's buffer (see
/// [`Job::share`]).
pub type Completion = Box<dyn FnOnce(Result<Option<SharedBytes>>) + Send>;

/// One collective on one buffer.
pub struct Job {
    pub op: Collective,
    pub buf: RawBuf,
    pub dtype: DType,
    /// Bucket index: picks the channel and is checked across ranks.
    pub bucket: u64,
    /// An allreduce may leave its result in shared memory instead of
    /// `buf` ([`Algorithm::allreduce_shared`]), valid until the next one of
    /// the same bucket and length starts (DDP's buckets).
    pub share: bool,
    pub done: Completion,
}

/// What a channel thread takes from its queue.
enum Work {
    /// A job, with its submission number, position and when it was
    /// submitted.
    Job(u64, Position, Instant, Job),
    /// Hand the channel's state across steps back.
    Export(mpsc::Sender<Result<BTreeMap<u64, BucketState>>>),
    /// Hand back the length (float32 elements) of each bucket whose
    /// buffers the channel keeps.
    Lengths(mpsc::Sender<HashMap<u64, usize>>),
    /// Replace the channel's state across steps with these buckets'.
    Import(BTreeMap<u64, BucketState>, mpsc::Sender<Result<()>>),
}

struct Channel {
    queue: Option<mpsc::Sender<Work>>,
    thread: Option<JoinHandle<()>>,
}

/// The engine of one process: its channels and their threads.
pub struct Engine {
    rank: usize,
    size: usize,
    timeout: Duration,
    channels: Vec<Channel>,
    /// Jobs submitted so far; numbers them (see [`super::turns`]). Locked
    /// around numbering and queueing so numbers follow queue order.
    submitted: Mutex<u64>,
    /// The process that started the channel threads: a forked child (a
    /// DataLoader worker) has a copy of this struct but not the threads.
    owner_pid: u32,
    /// Where this rank is in the job ([`super::progress`]).
    progress: Arc<Progress>,
    /// Writes `progress` to the board (when there is one).
    recorder: Option<Recorder>,
    /// What the channels carried ([`super::counters`]).
    counters: Arc<Counters>,
    /// The engine's failure rule; a failed engine exports no state.
    failures: Arc<Failures>,
    /// The settings its state depends on ([`state::settings_of`]).
    state_settings: BTreeMap<String, String>,
}

impl Engine {
    /// Starts one thread per channel, each owning one world transport and
    /// running `settings` over it (flat: no 2D groups; one node, no turns).
    pub fn new(
        transports: Vec<Box<dyn Transport>>,
        timeout: Duration,
        settings: AlgoSettings,
        board: Option<Arc<dyn FailureBoard>>,
    ) -> Result<Self> {
        let channels = transports
            .into_iter()
            .map(|world| (Groups::flat(world), settings))
            .collect();
        Self::with_channels(channels, timeout, board, false)
    }

    /// Starts one thread per channel with its own groups and settings.
    /// With `link_turns` (a job spanning nodes, several channels), the
    /// channels take turns on the link between nodes.
    pub fn with_channels(
        channels_spec: Vec<(Groups, AlgoSettings)>,
        timeout: Duration,
        board: Option<Arc<dyn FailureBoard>>,
        link_turns: bool,
    ) -> Result<Self> {
        let Some((first, _)) = channels_spec.first() else {
            return Err(Error::InvalidArgument(
                "an engine needs at least one channel".into(),
            ));
        };
        let (rank, size) = (first.world.rank(), first.world.size());
        timeline::start(rank);
        let intra_size = first.hierarchy.as_ref().map(|h| h.layout.intra_size);
        let state_settings = state::settings_of(&channels_spec[0].1, intra_size);
        let failures = Arc::new(Failures::new(board.clone()));
        failures.add_aborters(channels_spec.iter().flat_map(|(g, _)| g.aborters()));
        let progress = Arc::new(Progress::new());
        let counters = Arc::new(Counters::new());
        let recorder = board
            .clone()
            .map(|b| Recorder::start(progress.clone(), b, rank))
            .transpose()?;
        let turns = (link_turns && channels_spec.len() > 1).then(LinkTurns::new);
        if let Some(t) = &turns {
            failures.add_aborters([t.aborter()]);
        }
        let mut channels = Vec::with_capacity(channels_spec.len());
        for (index, (groups, settings)) in channels_spec.into_iter().enumerate() {
            let (tx, rx) = mpsc::channel::<Work>();
            let failures = Arc::clone(&failures);
            let progress = Arc::clone(&progress);
            let turns = turns.clone();
            let counters = Arc::clone(&counters);
            let thread = std::thread::Builder::new()
                .name(format!("tiacc-comm-{index}"))
                .spawn(move || {
                    let backend = HostBackend::new(groups, Deadline::after(timeout));
                    let algorithm = Algorithm::with_counters(settings, counters);
                    channel_loop(backend, algorithm, rx, timeout, &failures, turns, &progress)
                })
                .map_err(|e| Error::Comm {
                    peer: None,
                    message: format!("rank {rank}: cannot start channel thread {index}: {e}"),
                })?;
            channels.push(Channel {
                queue: Some(tx),
                thread: Some(thread),
            });
        }
        Ok(Engine {
            rank,
            size,
            timeout,
            channels,
            submitted: Mutex::new(0),
            owner_pid: std::process::id(),
            progress,
            recorder,
            counters,
            failures,
            state_settings,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    pub fn num_channels(&self) -> usize {
        self.channels.len()
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Where this rank is in the job, and its step times.
    pub fn progress(&self) -> &Arc<Progress> {
        &self.progress
    }

    /// What the channels carried so far, per path and codec.
    pub fn counters(&self) -> &Arc<Counters> {
        &self.counters
    }

    /// The channel a bucket runs on.
    pub fn channel_of(&self, bucket: u64) -> usize {
        channel_of(bucket, self.channels.len())
    }

    /// Queues `job` on its bucket's channel. The completion runs on the
    /// channel thread, or here at once if the engine is shut down (or this
    /// is a forked child, which has no channel threads).
    pub fn submit(&self, job: Job) {
        if std::process::id() != self.owner_pid {
            (job.done)(Err(Error::Comm {
                peer: None,
                message: format!(
                    "rank {}: the communication engine belongs to the parent process; a forked \
                     child cannot use it",
                    self.rank
                ),
            }));
            return;
        }
        let channel = self.channel_of(job.bucket);
        let queue = self.channels[channel].queue.as_ref();
        let mut submitted = self
            .submitted
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let rejected = match queue {
            Some(q) => {
                let at = self.progress.submit(job.bucket);
                match q.send(Work::Job(*submitted, at, Instant::now(), job)) {
                    Ok(()) => None,
                    Err(mpsc::SendError(work)) => {
                        self.progress.complete();
                        match work {
                            Work::Job(_, _, _, job) => Some(job),
                            // Only the job sent above comes back.
                            _ => None,
                        }
                    }
                }
            }
            None => Some(job),
        };
        if rejected.is_none() {
            *submitted += 1;
        }
        drop(submitted);
        if let Some(job) = rejected {
            (job.done)(Err(Error::Comm {
                peer: None,
                message: format!("rank {}: the communication engine is shut down", self.rank),
            }));
        }
    }

    /// Runs one collective and waits for it (`dtype` only matters for
    /// allreduce).
    pub fn run(&self, op: Collective, buf: &mut [u8], dtype: DType, bucket: u64) -> Result<()> {
        let (tx, rx) = mpsc::channel();
        // SAFETY: `buf` is exclusively borrowed for this whole call, and the
        // call does not return before the completion has run (recv below).
        let raw = unsafe { RawBuf::new(buf.as_mut_ptr(), buf.len()) };
        self.submit(Job {
            op,
            buf: raw,
            dtype,
            bucket,
            share: false,
            done: Box::new(move |result| {
                let _ = tx.send(result.map(|_| ()));
            }),
        });
        // The completion always runs (the channel loop calls it for every
        // job it takes, and drains its queue when it stops), so this returns.
        rx.recv().unwrap_or_else(|_| {
            Err(Error::Comm {
                peer: None,
                message: format!("rank {}: a channel thread stopped unexpectedly", self.rank),
            })
        })
    }

    /// The engine's state across steps ([`super::state`]): every channel's,
    /// read once the jobs queued before this call are done (call it between
    /// steps, when no bucket of the current step is still queued).
    ///
    /// Errors when the engine failed (its buffers may hold half a step), is
    /// shut down, or this is a forked child.
    pub fn export_state(&self) -> Result<EngineState> {
        if let Some(err) = self.failures.first() {
            return Err(Error::Comm {
                peer: None,
                message: format!(
                    "rank {}: the engine failed, so its state is not that of a finished step: {err}",
                    self.rank
                ),
            });
        }
        let replies = self.ask_channels(|_, tx| Some(Work::Export(tx)))?;
        let mut buckets = BTreeMap::new();
        for part in replies {
            buckets.extend(part.recv().map_err(|_| self.stopped())??);
        }
        Ok(EngineState {
            rank: self.rank,
            world_size: self.size,
            settings: self.state_settings.clone(),
            buckets,
        })
    }

    /// Replaces the engine's state across steps with `state` (exported by
    /// an engine of the same rank, world size and settings, with any number
    /// of channels): each bucket's state goes to the channel that bucket
    /// runs on, between the jobs queued before and after this call. A
    /// state that does not fit ([`EngineState::check_fits`], or a bucket
    /// whose length differs from the one this engine already ran) is an
    /// [`Error::StateMismatch`] and nothing is imported.
    pub fn import_state(&self, state: &EngineState) -> Result<()> {
        state.check_fits(self.rank, self.size, &self.state_settings)?;
        let lengths = self.ask_channels(|_, tx| Some(Work::Lengths(tx)))?;
        for (channel, lens) in lengths.into_iter().enumerate() {
            let lens = lens.recv().map_err(|_| self.stopped())?;
            let mine = state
                .buckets
                .iter()
                .filter(|(b, _)| self.channel_of(**b) == channel);
            state::check_lengths(mine, &lens)?;
        }
        let mut parts: Vec<BTreeMap<u64, BucketState>> = vec![BTreeMap::new(); self.channels.len()];
        for (&bucket, b) in &state.buckets {
            parts[self.channel_of(bucket)].insert(bucket, b.clone());
        }
        let mut parts = parts.into_iter();
        let replies = self.ask_channels(|_, tx| parts.next().map(|part| Work::Import(part, tx)))?;
        for reply in replies {
            reply.recv().map_err(|_| self.stopped())??;
        }
        Ok(())
    }

    /// Queues `make(channel, reply)` on every channel; the receivers of the
    /// replies, in channel order.
    fn ask_channels<T>(
        &self,
        mut make: impl FnMut(usize, mpsc::Sender<T>) -> Option<Work>,
    ) -> Result<Vec<mpsc::Receiver<T>>> {
        if std::process::id() != self.owner_pid {
            return Err(Error::Comm {
                peer: None,
                message: format!(
                    "rank {}: the communication engine belongs to the parent process; a forked \
                     child cannot use it",
                    self.rank
                ),
            });
        }
        let mut out = Vec::with_capacity(self.channels.len());
        for (index, channel) in self.channels.iter().enumerate() {
            let (tx, rx) = mpsc::channel();
            let sent = match (make(index, tx), channel.queue.as_ref()) {
                (Some(work), Some(q)) => q.send(work).is_ok(),
                _ => false,
            };
            if !sent {
                return Err(Error::Comm {
                    peer: None,
                    message: format!("rank {}: the communication engine is shut down", self.rank),
                });
            }
            out.push(rx);
        }
        Ok(out)
    }

    fn stopped(&self) -> Error {
        Error::Comm {
            peer: None,
            message: format!("rank {}: a channel thread stopped unexpectedly", self.rank),
        }
    }

    /// Finishes queued jobs and stops the channel threads.
    pub fn shutdown(&mut self) {
        for channel in &mut self.channels {
            channel.queue = None;
        }
        if std::process::id() != self.owner_pid {
            std::mem::forget(self.recorder.take());
            // The threads live in the parent; there is nothing to join here.
            for channel in &mut self.channels {
                std::mem::forget(channel.thread.take());
            }
            return;
        }
        for channel in &mut self.channels {
            if let Some(thread) = channel.thread.take() {
                let _ = thread.join();
            }
        }
        self.recorder = None;
        timeline::flush();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// How a reduce-scatter or all-gather runs when it leaves the world
/// transport's exact ring (see [`super::sharded`]): over the 2D groups when
/// the allreduce goes 2D, or compressed (a summing reduce-scatter of a
/// float type, when asked). `None`: the world transport runs it, as it
/// runs every other reduction and every other op.
fn sharded_plan(
    op: &Collective,
    algorithm: &Algorithm,
    hierarchical: bool,
    dtype: DType,
    size: usize,
) -> Option<ReduceScatterPlan> {
    let mut plan = algorithm.settings().reduce_scatter_plan();
    plan.two_d &= hierarchical;
    let compressed = size > 1 && plan.codec(dtype) != Compression::None;
    match op {
        Collective::ReduceScatter {
            op: ReduceOp::Sum, ..
        } if plan.two_d || compressed => Some(plan),
        Collective::Allgather if plan.two_d => Some(ReduceScatterPlan {
            compression: Compression::None,
            inter_compression: Compression::None,
            ..plan
        }),
        _ => None,
    }
}

fn channel_loop(
    mut backend: HostBackend,
    mut algorithm: Algorithm,
    work: mpsc::Receiver<Work>,
    timeout: Duration,
    failures: &Failures,
    turns: Option<Arc<LinkTurns>>,
    progress: &Progress,
) {
    let mut seq = 0u64;
    for item in work {
        let (number, at, job) = match item {
            Work::Job(number, at, submitted, job) => {
                let _bucket = timeline::on_bucket(Some(job.bucket));
                timeline::since(
                    timeline_names(&job.op).0,
                    submitted,
                    Args {
                        bytes: Some(job.buf.len as u64),
                        ..Args::default()
                    },
                );
                (number, at, job)
            }
            Work::Export(reply) => {
                let part = state::export_channel(algorithm.sparse_state(), |key| {
                    Ok(backend.state_buffer(key).map(<[u8]>::to_vec))
                });
                let _ = reply.send(part);
                continue;
            }
            Work::Lengths(reply) => {
                let _ = reply.send(algorithm.sparse_state().lens().clone());
                continue;
            }
            Work::Import(buckets, reply) => {
                backend.clear_residuals();
                let sparse = state::import_channel(&buckets, |key, bytes| {
                    backend.set_state_buffer(key, bytes.to_vec());
                    Ok(())
                });
                let done = match sparse {
                    Ok(sparse) => {
                        algorithm.set_sparse_state(sparse);
                        Ok(())
                    }
                    Err(err) => {
                        // Half a state is no state: the channel starts afresh.
                        backend.clear_residuals();
                        algorithm.set_sparse_state(Default::default());
                        Err(err)
                    }
                };
                let _ = reply.send(done);
                continue;
            }
        };
        seq += 1;
        run_job(
            &mut backend,
            &mut algorithm,
            (seq, number, at, job),
            timeout,
            failures,
            turns.as_ref(),
            progress,
        );
    }
}

/// A job's two events on the timeline (its wait in the queue, its run):
/// DDP's bucket allreduces, or one of torch's other collectives.
fn timeline_names(op: &Collective) -> (&'static str, &'static str) {
    match op {
        Collective::Allreduce { .. } => ("queued", "bucket"),
        _ => ("queued collective", "collective"),
    }
}

/// Runs one job on its channel: `seq` is its number on this channel,
/// `number` its submission number (for the link turns).
fn run_job(
    backend: &mut HostBackend,
    algorithm: &mut Algorithm,
    (seq, number, at, mut job): (u64, u64, Position, Job),
    timeout: Duration,
    failures: &Failures,
    turns: Option<&Arc<LinkTurns>>,
    progress: &Progress,
) {
    let (rank, size) = (backend.groups.world.rank(), backend.groups.world.size());
    let deadline = Deadline::after(timeout);
    let _bucket = timeline::on_bucket(Some(job.bucket));
    let whole = timeline::span(
        timeline_names(&job.op).1,
        Args {
            bytes: Some(job.buf.len as u64),
            ..Args::default()
        },
    );
    // Every job takes part in the turns, even one that fails before
    // reaching the link: dropping its turn passes it on.
    let mut turn = turns.map(|t| t.turn(number));
    let dtype = job.dtype;
    let buf = job.buf.as_mut_slice();
    let typed = !matches!(job.op, Collective::Broadcast { .. } | Collective::Barrier);
    let tag = OpTag {
        op: job.op.reduce_op().map_or(0, ReduceOp::code),
        kind: job.op.kind(),
        seq,
        bucket: job.bucket,
        dtype: if typed { dtype.code() } else { 0 },
        bytes: buf.len() as u64,
    };
    let before = wire_of(backend);
    let sharded_plan = sharded_plan(&job.op, algorithm, backend.hierarchical(), dtype, size);
    let mean = matches!(
        job.op,
        Collective::AllreduceOp { mean: true, .. } | Collective::ReduceScatter { mean: true, .. }
    );
    let result = if let Err(e) = check_average(mean, dtype) {
        Err(e)
    } else if typed && buf.len() % dtype.size() != 0 {
        Err(Error::InvalidArgument(format!(
            "bucket {}: {} bytes is not a whole number of {} elements",
            job.bucket,
            buf.len(),
            dtype.name()
        )))
    } else if let Some(plan) = sharded_plan {
        // SAFETY: the job's buffer is the engine's alone until its
        // completion runs (`RawBuf::new`'s contract), after `end` below.
        let mem = unsafe { backend.begin(buf, deadline, turn.take()) };
        let result = match job.op {
            Collective::ReduceScatter { mean, .. } => {
                let divisor = if mean && size > 1 { size as f64 } else { 1.0 };
                sharded::reduce_scatter(backend, &tag, mem, dtype, divisor, &plan).map(drop)
            }
            _ => sharded::allgather_two_d(backend, &tag, mem, dtype.size()),
        };
        backend.end();
        result.map(|()| None)
    } else {
        match job.op {
            Collective::Allreduce { average } => {
                // SAFETY: the job's buffer is the engine's alone until its
                // completion runs (`RawBuf::new`'s contract), and that is
                // after `end` below.
                let mem = unsafe { backend.begin(buf, deadline, turn.take()) };
                let bucket = Bucket {
                    tag: &tag,
                    buf: mem,
                    dtype,
                };
                let result = if job.share {
                    algorithm.allreduce_shared(backend, bucket, average)
                } else {
                    algorithm.allreduce(backend, bucket, average).map(|()| None)
                };
                backend.end();
                result
            }
            Collective::Broadcast { root } => {
                let world = backend.groups.world.as_mut();
                turn.as_mut()
                    .map_or(Ok(()), |t| t.take(deadline))
                    .and_then(|()| world.agree(&tag, deadline))
                    .and_then(|()| world.broadcast(buf, root, deadline))
                    .map(|()| None)
            }
            Collective::Barrier => {
                let world = backend.groups.world.as_mut();
                turn.as_mut()
                    .map_or(Ok(()), |t| t.take(deadline))
                    .and_then(|()| world.agree(&tag, deadline))
                    .and_then(|()| world.barrier(deadline))
                    .map(|()| None)
            }
            Collective::AllreduceOp { op, mean } => {
                let world = backend.groups.world.as_mut();
                // The header travels with the data (no round of its own).
                turn.as_mut()
                    .map_or(Ok(()), |t| t.take(deadline))
                    .and_then(|()| {
                        let how = Reduction {
                            tag: Some(&tag),
                            op,
                            ..Reduction::sum(dtype, deadline)
                        };
                        world.allreduce_with(buf, &how)
                    })
                    .map(|()| {
                        if mean && size > 1 {
                            dtype.div_assign(buf, size as f64);
                        }
                        None
                    })
            }
            Collective::ReduceScatter { .. } | Collective::Allgather | Collective::AllToAll => {
                let world = backend.groups.world.as_mut();
                turn.as_mut()
                    .map_or(Ok(()), |t| t.take(deadline))
                    .and_then(|()| world.agree(&tag, deadline))
                    .and_then(|()| match job.op {
                        Collective::ReduceScatter { op, mean } => {
                            let how = Reduction {
                                op,
                                ..Reduction::sum(dtype, deadline)
                            };
                            world.reduce_scatter_with(buf, &how).map(|()| {
                                if mean && size > 1 {
                                    let block = buf.len() / size;
                                    let shard = &mut buf[rank * block..(rank + 1) * block];
                                    dtype.div_assign(shard, size as f64);
                                }
                            })
                        }
                        Collective::Allgather => world.allgather(buf, dtype.size(), deadline),
                        _ => world.alltoall(buf, deadline),
                    })
                    .map(|()| None)
            }
        }
    };
    drop(turn);
    if result.is_ok() && !matches!(job.op, Collective::Allreduce { .. }) {
        // The algorithm counts DDP's buckets; these are torch's collectives.
        let wire = wire_since(before, wire_of(backend));
        let bytes = tag.bytes;
        let (path, codec) = match sharded_plan {
            Some(plan) if plan.two_d => (Path::Collective2d, plan.codec(dtype)),
            Some(plan) => (Path::Collective, plan.codec(dtype)),
            None => (Path::Collective, Compression::None),
        };
        algorithm.counters().record(path, codec, bytes, wire);
    }
    drop(whole);
    progress.complete();
    let result = result.map_err(|err| {
        // A timeout says where every rank was (unless another rank's
        // failure came first: then that one is the cause).
        let err = match failures.board() {
            Some(board) if failures.first().is_none() => {
                progress::attribute_timeout(err, at, progress, board, rank, size)
            }
            _ => err,
        };
        let err = failures.fail(err);
        backend.groups.abort();
        err
    });
    (job.done)(result);
}
