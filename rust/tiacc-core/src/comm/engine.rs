//! The multi-channel engine: one worker thread per channel, each running its
//! queue of collectives in order.
//!
//! Buckets go to channels round-robin by bucket index. DDP launches buckets
//! in index order on every rank, so every channel sees the same sequence of
//! collectives on every rank, which is what lets several channels run
//! concurrently without deadlock. Each collective first compares a tag
//! (kind, per-channel sequence number, bucket, dtype, size) across ranks, so
//! diverging ranks raise instead of mixing unrelated buffers.

use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use super::algo::{Algorithm, Flat, Groups};
use super::codec::{self, Compression};
use super::dtype::DType;
use super::transport::{Aborter, Deadline, OpKind, OpTag, Transport};
use crate::error::{Error, Result};

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

/// What a job does with its buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    /// Sum over ranks; divide by the world size first when `average`
    /// (DDP's gradient averaging, done before the sum so half types
    /// cannot overflow).
    Allreduce { average: bool },
    /// Copy `root`'s buffer to every rank.
    Broadcast { root: usize },
    /// Wait for every rank (the buffer is ignored).
    Barrier,
}

/// Called exactly once with the job's outcome, on the channel thread.
pub type Completion = Box<dyn FnOnce(Result<()>) + Send>;

/// Called with a failure before the channel breaks its connections (so
/// before peers see the failure). It may publish the error and return the
/// first failure another rank published, which is appended to the error:
/// ranks that only saw a neighbour hang up then still name the root cause.
pub type FailureHook = Arc<dyn Fn(&Error) -> Option<String> + Send + Sync>;

/// One collective on one buffer.
pub struct Job {
    pub op: Collective,
    pub buf: RawBuf,
    pub dtype: DType,
    /// Bucket index: picks the channel and is checked across ranks.
    pub bucket: u64,
    pub done: Completion,
}

/// How allreduces treat their buckets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineOptions {
    /// Wire type for float32/float64 buckets.
    pub compression: Compression,
    /// Multiplier applied before the half-precision cast (divided out after).
    pub compression_scale: f64,
    /// Refuse to send a bucket holding NaN or infinity.
    pub nan_check: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            compression: Compression::None,
            compression_scale: 1.0,
            nan_check: false,
        }
    }
}

struct Channel {
    queue: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

/// The engine of one process: its channels and their threads.
pub struct Engine {
    rank: usize,
    size: usize,
    timeout: Duration,
    channels: Vec<Channel>,
    /// The process that started the channel threads: a forked child (a
    /// DataLoader worker) has a copy of this struct but not the threads.
    owner_pid: u32,
}

impl Engine {
    /// Starts one thread per channel, each owning one world transport and
    /// running the flat ring.
    pub fn new(
        transports: Vec<Box<dyn Transport>>,
        timeout: Duration,
        options: EngineOptions,
        on_failure: Option<FailureHook>,
    ) -> Result<Self> {
        let channels = transports
            .into_iter()
            .map(|world| (Groups::flat(world), Box::new(Flat) as Box<dyn Algorithm>))
            .collect();
        Self::with_channels(channels, timeout, options, on_failure)
    }

    /// Starts one thread per channel with its own groups and algorithm.
    pub fn with_channels(
        channels_spec: Vec<(Groups, Box<dyn Algorithm>)>,
        timeout: Duration,
        options: EngineOptions,
        on_failure: Option<FailureHook>,
    ) -> Result<Self> {
        let Some((first, _)) = channels_spec.first() else {
            return Err(Error::InvalidArgument(
                "an engine needs at least one channel".into(),
            ));
        };
        let (rank, size) = (first.world.rank(), first.world.size());
        let (groups, algorithms): (Vec<Groups>, Vec<Box<dyn Algorithm>>) =
            channels_spec.into_iter().unzip();
        // A failure on one channel breaks them all: DDP waits on every
        // bucket, so a sibling blocked on a dead job would otherwise only end
        // at its timeout.
        let abort_all: Arc<Vec<Aborter>> =
            Arc::new(groups.iter().flat_map(Groups::aborters).collect());
        let first_failure: Arc<Mutex<Option<Error>>> = Arc::default();
        let mut channels = Vec::with_capacity(groups.len());
        for (index, (groups, algorithm)) in groups.into_iter().zip(algorithms).enumerate() {
            let (tx, rx) = mpsc::channel::<Job>();
            let abort_all = Arc::clone(&abort_all);
            let first_failure = Arc::clone(&first_failure);
            let on_failure = on_failure.clone();
            let thread = std::thread::Builder::new()
                .name(format!("tiacc-comm-{index}"))
                .spawn(move || {
                    let ctx = ChannelContext {
                        timeout,
                        options,
                        abort_all: &abort_all,
                        first_failure: &first_failure,
                        on_failure,
                        scratch: Vec::new(),
                    };
                    channel_loop(groups, algorithm, rx, ctx)
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
            owner_pid: std::process::id(),
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

    /// The channel a bucket runs on.
    pub fn channel_of(&self, bucket: u64) -> usize {
        (bucket % self.channels.len() as u64) as usize
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
        let rejected = match queue {
            Some(q) => q.send(job).err().map(|e| e.0),
            None => Some(job),
        };
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
            done: Box::new(move |result| {
                let _ = tx.send(result);
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

    /// Finishes queued jobs and stops the channel threads.
    pub fn shutdown(&mut self) {
        for channel in &mut self.channels {
            channel.queue = None;
        }
        if std::process::id() != self.owner_pid {
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
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// What a channel thread needs besides its groups and jobs.
struct ChannelContext<'a> {
    timeout: Duration,
    options: EngineOptions,
    abort_all: &'a [Aborter],
    /// The first failure on any channel of this engine.
    first_failure: &'a Mutex<Option<Error>>,
    on_failure: Option<FailureHook>,
    /// Wire buffer for compressed buckets, reused.
    scratch: Vec<u8>,
}

fn channel_loop(
    mut groups: Groups,
    mut algorithm: Box<dyn Algorithm>,
    jobs: mpsc::Receiver<Job>,
    mut ctx: ChannelContext<'_>,
) {
    let timeout = ctx.timeout;
    for (seq, mut job) in (1u64..).zip(jobs) {
        let deadline = Deadline::after(timeout);
        let dtype = job.dtype;
        let buf = job.buf.as_mut_slice();
        let kind = match job.op {
            Collective::Allreduce { .. } => OpKind::Allreduce,
            Collective::Broadcast { .. } => OpKind::Broadcast,
            Collective::Barrier => OpKind::Barrier,
        };
        let typed = matches!(job.op, Collective::Allreduce { .. });
        let tag = OpTag {
            kind,
            seq,
            bucket: job.bucket,
            dtype: if typed { dtype.code() } else { 0 },
            bytes: buf.len() as u64,
        };
        let result = if typed && buf.len() % dtype.size() != 0 {
            Err(Error::InvalidArgument(format!(
                "bucket {}: {} bytes is not a whole number of {} elements",
                job.bucket,
                buf.len(),
                dtype.name()
            )))
        } else {
            match job.op {
                Collective::Allreduce { average } => allreduce(
                    &mut groups,
                    algorithm.as_mut(),
                    &mut ctx,
                    &tag,
                    buf,
                    dtype,
                    average,
                    deadline,
                ),
                Collective::Broadcast { root } => groups
                    .world
                    .agree(&tag, deadline)
                    .and_then(|()| groups.world.broadcast(buf, root, deadline)),
                Collective::Barrier => groups
                    .world
                    .agree(&tag, deadline)
                    .and_then(|()| groups.world.barrier(deadline)),
            }
        };
        let result = result
            .map_err(|err| match &ctx.on_failure {
                Some(hook) => with_root_cause(err, hook.as_ref()),
                None => err,
            })
            .map_err(|err| first_on_this_engine(err, ctx.first_failure));
        if result.is_err() {
            groups.abort();
            for abort in ctx.abort_all {
                abort();
            }
        }
        (job.done)(result);
    }
}

/// One allreduce job: NaN check, averaging, optional compression.
#[allow(clippy::too_many_arguments)]
fn allreduce(
    groups: &mut Groups,
    algorithm: &mut dyn Algorithm,
    ctx: &mut ChannelContext<'_>,
    tag: &OpTag,
    buf: &mut [u8],
    dtype: DType,
    average: bool,
    deadline: Deadline,
) -> Result<()> {
    let (rank, size) = (groups.world.rank(), groups.world.size());
    if ctx.options.nan_check {
        if let Some((index, value)) = codec::first_non_finite(buf, dtype) {
            return Err(Error::Comm {
                peer: Some(rank),
                message: format!(
                    "rank {rank}: bucket {} holds a non-finite gradient ({value} at element \
                     {index} of {}); it was not sent to the other ranks (NaN check is on)",
                    tag.bucket,
                    buf.len() / dtype.size()
                ),
            });
        }
    }
    let divisor = if average && size > 1 {
        size as f64
    } else {
        1.0
    };
    let wire = ctx
        .options
        .compression
        .wire_dtype(dtype)
        .filter(|_| size > 1);
    let Some(wire) = wire else {
        if divisor != 1.0 {
            dtype.div_assign(buf, divisor);
        }
        return algorithm.allreduce(groups, tag, buf, dtype, deadline);
    };
    let elems = buf.len() / dtype.size();
    let scale = ctx.options.compression_scale;
    ctx.scratch.resize(elems * wire.size(), 0);
    codec::encode(buf, dtype, scale / divisor, &mut ctx.scratch, wire);
    let wire_tag = OpTag {
        dtype: wire.code(),
        bytes: ctx.scratch.len() as u64,
        ..*tag
    };
    algorithm.allreduce(groups, &wire_tag, &mut ctx.scratch, wire, deadline)?;
    codec::decode(&ctx.scratch, wire, 1.0 / scale, buf, dtype);
    Ok(())
}

/// The failure to report: the first one on any channel of this engine. A
/// channel's failure aborts its siblings, whose own errors ("connection
/// aborted") are only symptoms; they report the cause (a timeout stays a
/// timeout whichever bucket DDP looks at first).
fn first_on_this_engine(err: Error, first: &Mutex<Option<Error>>) -> Error {
    let mut first = first.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(cause) = first.as_ref().and_then(copy_comm_error) {
        return cause;
    }
    *first = copy_comm_error(&err);
    err
}

/// A copy of a communication error (the other kinds are not replayed).
fn copy_comm_error(err: &Error) -> Option<Error> {
    match err {
        Error::Comm { peer, message } => Some(Error::Comm {
            peer: *peer,
            message: message.clone(),
        }),
        Error::CommTimeout { peer, message } => Some(Error::CommTimeout {
            peer: *peer,
            message: message.clone(),
        }),
        _ => None,
    }
}

/// Appends the first failure reported by any rank, when it is not this one.
fn with_root_cause(err: Error, hook: &(dyn Fn(&Error) -> Option<String> + Send + Sync)) -> Error {
    let Some(first) = hook(&err) else {
        return err;
    };
    if first == err.to_string() {
        return err;
    }
    let note = format!(" [first failure reported in this job: {first}]");
    match err {
        Error::Comm { peer, message } => Error::Comm {
            peer,
            message: message + &note,
        },
        Error::CommTimeout { peer, message } => Error::CommTimeout {
            peer,
            message: message + &note,
        },
        other => other,
    }
}
