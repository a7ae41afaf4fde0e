//! The bounded wait on a non-blocking NCCL initialisation (or call):
//! [`await_ready`] polls it until it completes or its deadline passes. A
//! leaf of `nccl/`: the communicator uses it, it uses no other part of
//! `nccl/`.

use std::time::Duration;

use crate::comm::Deadline;
use crate::error::{Error, Result};

/// What a poll of a non-blocking communicator found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// `ncclSuccess`: the operation completed.
    Ready,
    /// `ncclInProgress`: not yet.
    InProgress,
}

/// How often a non-blocking initialisation (or call) is polled.
const READY_POLL: Duration = Duration::from_millis(2);

/// Waits until `poll` says ready, fails with its error, or `deadline`
/// passes: then `abort` runs and the error is a `CommTimeout` with `what`
/// (as a test-visible function, so the deadline logic runs without a GPU).
pub fn await_ready(
    mut poll: impl FnMut() -> Result<Readiness>,
    abort: impl FnOnce(),
    deadline: Deadline,
    rank: usize,
    what: impl FnOnce() -> String,
) -> Result<()> {
    loop {
        match poll() {
            Ok(Readiness::Ready) => return Ok(()),
            Ok(Readiness::InProgress) => {}
            Err(err) => {
                abort();
                return Err(err);
            }
        }
        let left = deadline.remaining();
        if left.is_zero() {
            abort();
            return Err(Error::CommTimeout {
                peer: rank,
                message: format!(
                    "{} did not complete within {:.1}s (a rank never joined, or the network \
                     between ranks is down); it was aborted",
                    what(),
                    deadline.timeout.as_secs_f64()
                ),
            });
        }
        std::thread::sleep(READY_POLL.min(left));
    }
}
