//! What happens when a collective fails, for every engine (TCP channels and
//! NCCL channels alike).
//!
//! 1. The failure is published on the job's [`FailureBoard`] unless
//!    another rank's came first; the first one published is appended to
//!    this rank's error, so ranks that only saw a neighbour hang up still
//!    name the root cause. When the root cause is a timeout, such a
//!    symptom is raised as a timeout too (naming the rank the first one
//!    waited for), so every rank reports the same kind of failure.
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
        let first = self.board.as_ref()?.peek()?;
        Some(decode(&first).1.to_string()).filter(|m| !m.is_empty())
    }

    /// Appends the first failure reported by any rank, when it is not this one.
    fn with_root_cause(&self, err: Error) -> Error {
        let Some(board) = &self.board else {
            return err;
        };
        let Some(first) = board.publish(&encode(&err)) else {
            return err;
        };
        let (timed_out, first) = decode(&first);
        if first.is_empty() || first == err.to_string() || err.to_string().contains(first) {
            return err;
        }
        let note = format!(" [first failure reported in this job: {first}]");
        match err {
            Error::Comm { peer, message } => match timed_out {
                Some(waited_for) => Error::CommTimeout {
                    peer: waited_for,
                    message: message + &note,
                },
                None => Error::Comm {
                    peer,
                    message: message + &note,
                },
            },
            Error::CommTimeout { peer, message } => Error::CommTimeout {
                peer,
                message: message + &note,
            },
            other => other,
        }
    }
}

/// Marks a timeout on the board: `TIMEOUT_MARK`, the rank waited for,
/// `TIMEOUT_MARK`, then the message.
const TIMEOUT_MARK: char = '\u{1}';

/// The board's text for `err`.
fn encode(err: &Error) -> String {
    match err {
        Error::CommTimeout { peer, message } => {
            format!("{TIMEOUT_MARK}{peer}{TIMEOUT_MARK}{message}")
        }
        other => other.to_string(),
    }
}

/// A board text's message, and the rank waited for when it is a timeout.
fn decode(text: &str) -> (Option<usize>, &str) {
    let parsed = text.strip_prefix(TIMEOUT_MARK).and_then(|rest| {
        let (peer, message) = rest.split_once(TIMEOUT_MARK)?;
        Some((peer.parse().ok()?, message))
    });
    match parsed {
        Some((peer, message)) => (Some(peer), message),
        None => (None, text),
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
    fn a_neighbour_s_symptom_of_a_timeout_is_raised_as_a_timeout() {
        let board = Arc::new(Board(Mutex::new(String::new())));
        let first = Failures::new(Some(board.clone()));
        let err = first.fail(Error::CommTimeout {
            peer: 1,
            message: "rank 2: timed out waiting for rank 1".into(),
        });
        assert_eq!(err.to_string(), "rank 2: timed out waiting for rank 1");
        let other = Failures::new(Some(board));
        assert_eq!(
            other.published().as_deref(),
            Some("rank 2: timed out waiting for rank 1")
        );
        let err = other.fail(comm("rank 0: rank 2 closed its connection"));
        let Error::CommTimeout { peer, message } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(*peer, 1);
        assert_eq!(
            message,
            "rank 0: rank 2 closed its connection [first failure reported in this job: rank 2: \
             timed out waiting for rank 1]"
        );
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
