//! Turns on the link between nodes, shared by an engine's channels.
//!
//! Channels exist to overlap one bucket's work with another's. Between
//! nodes that backfires: two large buckets sending at once share the same
//! link, each finishes later than it would alone, and competing TCP flows
//! through one bottleneck lose throughput to each other. So when a job spans
//! nodes, each job (bucket collective) crosses the link only in its turn:
//! in submission order, one job at a time, while everything else (NaN
//! checks, casts, the intra-node steps of 2D, other buckets' queueing)
//! still runs concurrently.
//!
//! Submission order is the same on every rank (DDP launches buckets in
//! index order), so every rank hands out the same turns in the same order,
//! and job `j` only ever waits for jobs before it: no cycle of waits can
//! form across ranks.

use std::collections::BTreeSet;
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use super::transport::{Aborter, Deadline};
use crate::error::{Error, Result};

#[derive(Default)]
struct State {
    /// The job whose turn it is.
    next: u64,
    /// Jobs after `next` that have already passed (they finished, or never
    /// needed the link).
    passed_early: BTreeSet<u64>,
    aborted: bool,
}

/// The turn order of one engine.
#[derive(Default)]
pub struct LinkTurns {
    state: Mutex<State>,
    changed: Condvar,
}

impl LinkTurns {
    pub fn new() -> Arc<Self> {
        Arc::new(LinkTurns::default())
    }

    /// Job `seq`'s turn, not yet taken.
    pub fn turn(self: &Arc<Self>, seq: u64) -> Turn {
        Turn {
            turns: Arc::clone(self),
            seq,
            held: false,
        }
    }

    /// A handle that wakes every waiter with an error (after a failure).
    pub fn aborter(self: &Arc<Self>) -> Aborter {
        let turns = Arc::clone(self);
        Box::new(move || {
            turns.lock().aborted = true;
            turns.changed.notify_all();
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait_for(&self, seq: u64, deadline: Deadline) -> Result<()> {
        let mut state = self.lock();
        loop {
            if state.aborted {
                return Err(Error::Comm {
                    peer: None,
                    message: "the engine was aborted while this bucket waited for the link".into(),
                });
            }
            if state.next == seq {
                return Ok(());
            }
            let remaining = deadline.remaining();
            if remaining.is_zero() {
                return Err(Error::Comm {
                    peer: None,
                    message: format!(
                        "timed out after {:.1}s waiting for collective #{} (another channel) to \
                         finish crossing the link between nodes",
                        deadline.timeout.as_secs_f64(),
                        state.next
                    ),
                });
            }
            state = self
                .changed
                .wait_timeout(state, remaining)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    fn pass(&self, seq: u64) {
        let mut state = self.lock();
        if seq == state.next {
            state.next += 1;
            loop {
                let next = state.next;
                if !state.passed_early.remove(&next) {
                    break;
                }
                state.next += 1;
            }
        } else if seq > state.next {
            state.passed_early.insert(seq);
        }
        drop(state);
        self.changed.notify_all();
    }
}

/// One job's turn: [`Turn::take`] waits for it; dropping the turn passes
/// it on (exactly once, whether it was taken, failed or never needed).
pub struct Turn {
    turns: Arc<LinkTurns>,
    seq: u64,
    held: bool,
}

impl Turn {
    /// Waits until every earlier job has passed its turn (no-op once held).
    pub fn take(&mut self, deadline: Deadline) -> Result<()> {
        if !self.held {
            self.turns.wait_for(self.seq, deadline)?;
            self.held = true;
        }
        Ok(())
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.turns.pass(self.seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn deadline(ms: u64) -> Deadline {
        Deadline::after(Duration::from_millis(ms))
    }

    #[test]
    fn turns_go_in_submission_order_and_skip_jobs_that_passed() {
        let turns = LinkTurns::new();
        let (mut t0, t1, mut t2) = (turns.turn(0), turns.turn(1), turns.turn(2));
        // Job 2 must wait for 0 and 1.
        assert!(t2.take(deadline(20)).is_err());
        drop(t1); // never needed the link
        assert!(t2.take(deadline(20)).is_err());
        t0.take(deadline(20)).unwrap();
        let waiter = std::thread::spawn(move || t2.take(deadline(5000)).map(|()| t2));
        std::thread::sleep(Duration::from_millis(20));
        drop(t0);
        let t2 = waiter.join().unwrap().unwrap();
        drop(t2);
        turns.turn(3).take(deadline(20)).unwrap();
    }

    #[test]
    fn an_abort_wakes_the_waiters() {
        let turns = LinkTurns::new();
        let _t0 = turns.turn(0);
        let mut t1 = turns.turn(1);
        let abort = turns.aborter();
        let waiter = std::thread::spawn(move || t1.take(deadline(5000)));
        std::thread::sleep(Duration::from_millis(20));
        abort();
        let err = waiter.join().unwrap().unwrap_err().to_string();
        assert!(err.contains("aborted"), "{err}");
    }
}
