//! The bounded wait on NCCL collectives: [`watch`] waits for the work
//! enqueued on communicators, polling for completion, NCCL's asynchronous
//! errors, another rank's failure and the deadline, and aborts the
//! communicators when one of the last three comes first
//! ([`super::watchdog`] runs it on its thread).

use std::time::Duration;

use super::communicator::{Group, NcclCommunicator};
use super::trace;
use crate::comm::Deadline;
use crate::error::{Error, Result};

/// What [`watch`] needs from a communicator (a trait so that the watchdog's
/// logic is tested without a GPU).
pub trait Watched {
    /// The group, this rank and the group size (for messages).
    fn location(&self) -> (Group, usize, usize);
    /// `Ok(Some(error))` once the communicator has failed asynchronously.
    fn async_error(&self) -> Result<Option<Error>>;
    /// Ends outstanding operations; later calls fail with `reason`.
    fn abort(&self, reason: &str);
}

impl Watched for NcclCommunicator {
    fn location(&self) -> (Group, usize, usize) {
        (self.group(), self.rank(), self.size())
    }

    fn async_error(&self) -> Result<Option<Error>> {
        NcclCommunicator::async_error(self)
    }

    fn abort(&self, reason: &str) {
        NcclCommunicator::abort(self, reason)
    }
}

/// Waits until `is_done()` says the work enqueued on `comms` has finished,
/// polling every `poll` (at most) until `deadline`.
///
/// * NCCL reports an asynchronous error on one of them: every communicator
///   in `comms` is aborted and the error (`Error::Comm`, with NCCL's text)
///   returned.
/// * `peer_failed()` returns another rank's failure (published on the
///   job's failure board): the communicators are aborted and an
///   `Error::Comm` carrying that failure returned.
/// * The deadline passes: the communicators are aborted and
///   `Error::CommTimeout` returned, naming the group and this rank (NCCL
///   does not say which peer is missing, so `peer` is this rank).
/// * `is_done` fails: its error is returned (the communicators are left as is).
pub fn watch(
    comms: &[&dyn Watched],
    deadline: Deadline,
    poll: Duration,
    mut is_done: impl FnMut() -> Result<bool>,
    mut peer_failed: impl FnMut() -> Option<String>,
) -> Result<()> {
    let poll = poll.max(Duration::from_micros(50));
    let abort_all = |reason: &str| {
        trace::note(|| {
            format!(
                "watchdog: aborting {} communicator(s): {reason}",
                comms.len()
            )
        });
        comms.iter().for_each(|c| c.abort(reason));
    };
    loop {
        for comm in comms {
            if let Some(err) = comm.async_error()? {
                abort_all(&err.to_string());
                return Err(err);
            }
        }
        if is_done()? {
            return Ok(());
        }
        if let Some(first) = peer_failed() {
            let (group, rank, size) = comms.first().map_or((Group::World, 0, 0), |c| c.location());
            let message = format!(
                "{group} communicator, rank {rank} of {size}: an NCCL collective was abandoned \
                 because another rank failed: {first}"
            );
            abort_all(&message);
            return Err(Error::Comm {
                peer: None,
                message,
            });
        }
        let left = deadline.remaining();
        if left.is_zero() {
            let (group, rank, size) = comms.first().map_or((Group::World, 0, 0), |c| c.location());
            let message = format!(
                "{group} communicator, rank {rank} of {size}: an NCCL collective did not finish \
                 within {:?} (a peer is missing, stalled or issued a different collective); \
                 the communicator was aborted",
                deadline.timeout
            );
            abort_all(&message);
            return Err(Error::CommTimeout {
                peer: rank,
                message,
            });
        }
        std::thread::sleep(poll.min(left));
    }
}
