//! What happens when a collective fails, for every engine (TCP channels and
//! NCCL channels alike).
//!
//! 1. The failure is published on the job's [`FailureBoard`] unless
//!    another rank's came first; the first one published is appended to
//!    this rank's error, so ranks that only saw a neighbour hang up still
//!    name the root cause.
//! 2. The first failure on this engine is the one every later error
//!    reports: a channel aborted because a sibling failed reports the
//!    sibling's error, not its own "connection aborted" symptom.
//! 3. Every channel is aborted, so collectives blocked elsewhere end now
//!    instead of at their timeout (DDP waits on every bucket).

use std::sync::{Arc, Mutex, PoisonError};

use super::transport::Aborter;
use crate::error::Error;

/// Where ranks publish the first failure of a job (the c10d store).
pub trait FailureBoard: Send + Sync {
    /// Publishes `message` unless a failure is already there; returns the
    /// first failure published (this one, or an earlier one), if the board
    /// could be reached.
    fn publish(&self, message: &str) -> Option<String>;
    /// The first failure published so far, if any.
    fn peek(&self) -> Option<String>;
    /// Keeps `record` as rank `rank`'s progress record
    /// ([`super::progress`]); boards without one ignore it.
    fn record_progress(&self, _rank: usize, _record: &str) {}
    /// The progress records of ranks `0 .. size` (`None` where a rank has
    /// none, or the board cannot be read), without waiting.
    fn progress(&self, size: usize) -> Vec<Option<String>> {
        vec![None; size]
    }
}

/// The failure state of one engine.
#[derive(Default)]
pub struct Failures {
    first: Mutex<Option<Error>>,
    aborters: Mutex<Vec<Aborter>>,
    board: Option<Arc<dyn FailureBoard>>,
}

impl Failures {
    pub fn new(board: Option<Arc<dyn FailureBoard>>) -> Self {
        Failures {
            first: Mutex::new(None),
            aborters: Mutex::new(Vec::new()),
            board,
        }
    }

    /// Registers handles that break this engine's channels.
    pub fn add_aborters(&self, aborters: impl IntoIterator<Item = Aborter>) {
        self.aborters
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(aborters);
    }

    /// Handles a failure (see the module docs) and returns the error to report.
    pub fn fail(&self, err: Error) -> Error {
        let err = self.with_root_cause(err);
        let err = {
            let mut first = self.first.lock().unwrap_or_else(PoisonError::into_inner);
            match first.as_ref().and_then(copy_comm_error) {
                Some(cause) => cause,
                None => {
                    *first = copy_comm_error(&err);
                    err
                }
            }
        };
        for abort in self
            .aborters
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            abort();
        }
        err
    }

    /// The failure recorded on this engine, if any (a copy to raise again).
    pub fn first(&self) -> Option<Error> {
        self.first
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(copy_comm_error)
    }

    /// The job's board, when there is one.
    pub fn board(&self) -> Option<&dyn FailureBoard> {
        self.board.as_deref()
    }

    /// A failure another rank published, if any.
    pub fn published(&self) -> Option<String> {
        self.board.as_ref()?.peek().filter(|m| !m.is_empty())
    }

    /// Appends the first failure reported by any rank, when it is not this one.
    fn with_root_cause(&self, err: Error) -> Error {
        let Some(board) = &self.board else {
            return err;
        };
        let Some(first) = board.publish(&err.to_string()) else {
            return err;
        };
        if first.is_empty() || first == err.to_string() || err.to_string().contains(&first) {
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
}

/// A copy of a communication error (the other kinds are not replayed).
pub fn copy_comm_error(err: &Error) -> Option<Error> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Board(Mutex<String>);

    impl FailureBoard for Board {
        fn publish(&self, message: &str) -> Option<String> {
            let mut first = self.0.lock().unwrap();
            if first.is_empty() {
                *first = message.to_string();
            }
            Some(first.clone())
        }
        fn peek(&self) -> Option<String> {
            Some(self.0.lock().unwrap().clone())
        }
    }

    fn comm(message: &str) -> Error {
        Error::Comm {
            peer: None,
            message: message.into(),
        }
    }

    #[test]
    fn the_first_failure_wins_and_every_channel_is_aborted() {
        let board = Arc::new(Board(Mutex::new(String::new())));
        board.publish("rank 3: bucket 1 holds a non-finite gradient");
        let failures = Failures::new(Some(board));
        let aborted = Arc::new(AtomicUsize::new(0));
        let counter = aborted.clone();
        failures.add_aborters([Box::new(move || {
            counter.fetch_add(1, Ordering::SeqCst);
        }) as Aborter]);
        assert!(failures.published().unwrap().contains("rank 3"));

        let err = failures.fail(comm("rank 0: rank 1 closed the connection"));
        let text = err.to_string();
        assert!(text.starts_with("rank 0: rank 1 closed"), "{text}");
        assert!(
            text.contains("[first failure reported in this job: rank 3"),
            "{text}"
        );
        // A sibling's later symptom reports the first failure instead.
        let later = failures.fail(comm("connection aborted"));
        assert_eq!(later.to_string(), text);
        assert_eq!(failures.first().unwrap().to_string(), text);
        assert_eq!(aborted.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn without_a_board_errors_pass_through() {
        let failures = Failures::new(None);
        assert!(failures.published().is_none() && failures.first().is_none());
        let err = failures.fail(Error::CommTimeout {
            peer: 2,
            message: "waiting for rank 2".into(),
        });
        assert!(matches!(err, Error::CommTimeout { peer: 2, .. }));
    }
}
