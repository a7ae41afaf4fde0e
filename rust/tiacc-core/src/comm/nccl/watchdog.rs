//! The watchdog thread of an NCCL engine: it waits for each enqueued
//! collective in turn (see [`watch`]) and turns a timeout, an NCCL error or
//! another rank's failure into the engine's failure ([`Failures::fail`]:
//! published, recorded, every channel aborted). The engine raises the
//! recorded failure at its next call.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::trace;
use super::watch::{watch, Watched};
use crate::comm::failure::Failures;
use crate::comm::progress::{self, Position, Progress};
use crate::comm::Deadline;
use crate::error::{Error, Result};

/// How long a collective may run before the job's failure board is read,
/// and how often after that (a store round trip; normal collectives finish
/// long before).
pub const BOARD_POLL: Duration = Duration::from_secs(1);

/// A collective enqueued on a CUDA stream.
pub struct Pending {
    /// The communicators it runs on (their asynchronous errors are polled).
    pub comms: Vec<Arc<dyn Watched + Send + Sync>>,
    /// Whether the stream has passed it (a CUDA event query).
    pub is_done: Box<dyn FnMut() -> Result<bool> + Send>,
    pub deadline: Deadline,
    /// Its bucket and step, when the engine tracks progress ([`Tracker`]).
    pub at: Option<Position>,
}

/// The engine's progress, which the watchdog marks collectives finished in
/// and uses to say where every rank was when one times out.
pub struct Tracker {
    pub progress: Arc<Progress>,
    pub rank: usize,
    pub size: usize,
}

/// The thread, and the queue feeding it.
pub struct Watchdog {
    queue: Mutex<Option<mpsc::Sender<Pending>>>,
    thread: Option<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
}

impl Watchdog {
    /// Starts the thread; `poll` is how often a pending collective is checked.
    pub fn start(failures: Arc<Failures>, poll: Duration) -> Result<Self> {
        Self::start_tracking(failures, poll, None)
    }

    /// [`Watchdog::start`], marking finished collectives in `tracker`'s
    /// progress and attributing timeouts from the ranks' records.
    pub fn start_tracking(
        failures: Arc<Failures>,
        poll: Duration,
        tracker: Option<Tracker>,
    ) -> Result<Self> {
        let (tx, rx) = mpsc::channel::<Pending>();
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("tiacc-nccl-watchdog".into())
            .spawn(move || run(rx, &failures, poll, &stopping, tracker.as_ref()))
            .map_err(|e| Error::Comm {
                peer: None,
                message: format!("cannot start the NCCL watchdog thread: {e}"),
            })?;
        Ok(Watchdog {
            queue: Mutex::new(Some(tx)),
            thread: Some(thread),
            stop,
        })
    }

    /// Queues `pending` behind the collectives already queued.
    pub fn submit(&self, pending: Pending) {
        if let Some(q) = self
            .queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            let _ = q.send(pending);
        }
    }

    /// Stops the thread without waiting for queued work.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run(
    rx: mpsc::Receiver<Pending>,
    failures: &Failures,
    poll: Duration,
    stop: &AtomicBool,
    tracker: Option<&Tracker>,
) {
    for mut pending in rx {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let tracked = tracker.zip(pending.at);
        if failures.first().is_some() {
            if let Some((t, _)) = tracked {
                t.progress.complete();
            }
            // Everything is aborted already; the engine raises the failure.
            continue;
        }
        let comms: Vec<&dyn Watched> = pending
            .comms
            .iter()
            .map(|c| c.as_ref() as &dyn Watched)
            .collect();
        let start = Instant::now();
        let mut next_board_check = start + BOARD_POLL;
        let is_done = || {
            if stop.load(Ordering::SeqCst) {
                return Ok(true);
            }
            (pending.is_done)()
        };
        let peer_failed = || {
            let now = Instant::now();
            if now < next_board_check {
                return None;
            }
            next_board_check = now + BOARD_POLL;
            trace::note(|| format!("watchdog: reading the failure board for {:?}", pending.at));
            let first = failures.published();
            trace::note(|| format!("watchdog: the failure board says {first:?}"));
            first
        };
        trace::note(|| format!("watchdog: watching {:?}", pending.at));
        let result = watch(&comms, pending.deadline, poll, is_done, peer_failed);
        trace::note(|| match &result {
            Ok(()) => format!("watchdog: {:?} finished", pending.at),
            Err(e) => format!("watchdog: {:?} failed: {e}", pending.at),
        });
        if let Some((t, _)) = tracked {
            t.progress.complete();
        }
        if let Err(err) = result {
            let err = match (tracked, failures.board()) {
                (Some((t, at)), Some(board)) if failures.first().is_none() => {
                    progress::attribute_timeout(err, at, &t.progress, board, t.rank, t.size)
                }
                _ => err,
            };
            failures.fail(err);
        }
    }
}
