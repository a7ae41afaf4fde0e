//! The watchdog's logic on stand-ins (`FakeComm`, `SyncComm`): done,
//! deadline, asynchronous error, another rank's failure, and the thread
//! that records the first failure.

use super::*;

/// A communicator stand-in for the watchdog's logic.
#[derive(Default)]
struct FakeComm {
    fail_after_polls: Option<usize>,
    polls: std::cell::Cell<usize>,
    aborted: std::cell::RefCell<Option<String>>,
}

impl Watched for FakeComm {
    fn location(&self) -> (Group, usize, usize) {
        (Group::Inter, 3, 4)
    }

    fn async_error(&self) -> crate::error::Result<Option<Error>> {
        self.polls.set(self.polls.get() + 1);
        Ok(match self.fail_after_polls {
            Some(n) if self.polls.get() > n => Some(Error::Comm {
                peer: None,
                message: "inter communicator, rank 3 of 4: remote process exited".into(),
            }),
            _ => None,
        })
    }

    fn abort(&self, reason: &str) {
        *self.aborted.borrow_mut() = Some(reason.to_string());
    }
}

#[test]
fn the_watchdog_returns_when_the_work_is_done() {
    let comm = FakeComm::default();
    let mut queries = 0;
    let deadline = crate::comm::Deadline::after(std::time::Duration::from_secs(10));
    watch(
        &[&comm],
        deadline,
        std::time::Duration::from_micros(100),
        || {
            queries += 1;
            Ok(queries == 3)
        },
        || None,
    )
    .unwrap();
    assert_eq!(queries, 3);
    assert!(comm.aborted.borrow().is_none());
}

#[test]
fn the_watchdog_aborts_and_names_group_and_rank_at_the_deadline() {
    let comm = FakeComm::default();
    let deadline = crate::comm::Deadline::after(std::time::Duration::from_millis(30));
    let start = std::time::Instant::now();
    let err = watch(
        &[&comm],
        deadline,
        std::time::Duration::from_millis(1),
        || Ok(false),
        || None,
    )
    .unwrap_err();
    assert!(start.elapsed() >= std::time::Duration::from_millis(30));
    match &err {
        Error::CommTimeout { peer, message } => {
            assert_eq!(*peer, 3);
            assert!(
                message.contains("inter communicator, rank 3 of 4"),
                "{message}"
            );
            assert!(message.contains("aborted"), "{message}");
        }
        other => panic!("expected CommTimeout, got {other:?}"),
    }
    assert!(
        comm.aborted.borrow().is_some(),
        "the communicator was not aborted"
    );
}

#[test]
fn the_watchdog_aborts_on_an_asynchronous_error() {
    let comm = FakeComm {
        fail_after_polls: Some(2),
        ..FakeComm::default()
    };
    let deadline = crate::comm::Deadline::after(std::time::Duration::from_secs(10));
    let err = watch(
        &[&comm],
        deadline,
        std::time::Duration::from_micros(100),
        || Ok(false),
        || None,
    )
    .unwrap_err();
    let message = comm_message(err);
    assert!(message.contains("remote process exited"), "{message}");
    assert_eq!(comm.aborted.borrow().as_deref(), Some(message.as_str()));
}

#[test]
fn a_failing_completion_test_is_returned_without_abort() {
    let comm = FakeComm::default();
    let deadline = crate::comm::Deadline::after(std::time::Duration::from_secs(10));
    let err = watch(
        &[&comm],
        deadline,
        std::time::Duration::from_micros(100),
        || Err(Error::InvalidArgument("event query failed".into())),
        || None,
    )
    .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)));
    assert!(comm.aborted.borrow().is_none());
}

#[test]
fn the_watchdog_aborts_every_communicator_when_another_rank_failed() {
    let (a, b) = (FakeComm::default(), FakeComm::default());
    let deadline = crate::comm::Deadline::after(std::time::Duration::from_secs(10));
    let mut checks = 0;
    let err = watch(
        &[&a, &b],
        deadline,
        std::time::Duration::from_micros(100),
        || Ok(false),
        || {
            checks += 1;
            (checks == 3).then(|| "rank 1: bucket 3 holds a non-finite gradient".to_string())
        },
    )
    .unwrap_err();
    let message = comm_message(err);
    assert!(
        message.contains("abandoned because another rank failed"),
        "{message}"
    );
    assert!(
        message.contains("rank 1: bucket 3 holds a non-finite gradient"),
        "{message}"
    );
    assert!(a.aborted.borrow().is_some() && b.aborted.borrow().is_some());
}

/// A thread-safe stand-in for the watchdog thread's tests.
#[derive(Default)]
struct SyncComm {
    aborted: std::sync::Mutex<Option<String>>,
}

impl Watched for SyncComm {
    fn location(&self) -> (Group, usize, usize) {
        (Group::World, 0, 2)
    }
    fn async_error(&self) -> crate::error::Result<Option<Error>> {
        Ok(None)
    }
    fn abort(&self, reason: &str) {
        *self.aborted.lock().unwrap() = Some(reason.to_string());
    }
}

#[test]
fn the_watchdog_thread_records_the_first_failure_and_aborts_the_engine() {
    use crate::comm::failure::Failures;
    use crate::comm::nccl::watchdog::{Pending, Watchdog};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;

    let failures = Arc::new(Failures::new(None));
    let engine_aborts = Arc::new(AtomicUsize::new(0));
    let counter = engine_aborts.clone();
    failures.add_aborters([Box::new(move || {
        counter.fetch_add(1, Ordering::SeqCst);
    }) as crate::comm::transport::Aborter]);
    let dog = Watchdog::start(failures.clone(), std::time::Duration::from_millis(1)).unwrap();
    let comm = Arc::new(SyncComm::default());
    let done = Arc::new(AtomicBool::new(false));
    let flag = done.clone();
    dog.submit(Pending {
        comms: vec![comm.clone()],
        is_done: Box::new(move || Ok(flag.load(Ordering::SeqCst))),
        deadline: crate::comm::Deadline::after(std::time::Duration::from_secs(10)),
        at: None,
    });
    done.store(true, Ordering::SeqCst);
    dog.submit(Pending {
        comms: vec![comm.clone()],
        is_done: Box::new(|| Ok(false)),
        deadline: crate::comm::Deadline::after(std::time::Duration::from_millis(20)),
        at: None,
    });
    let start = std::time::Instant::now();
    while failures.first().is_none() && start.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let err = failures.first().expect("the timeout was recorded");
    assert!(matches!(err, Error::CommTimeout { .. }), "{err}");
    assert!(comm.aborted.lock().unwrap().is_some());
    assert_eq!(engine_aborts.load(Ordering::SeqCst), 1);
    // Work submitted after the failure is not waited on.
    dog.submit(Pending {
        comms: vec![comm],
        is_done: Box::new(|| Ok(false)),
        deadline: crate::comm::Deadline::after(std::time::Duration::from_secs(600)),
        at: None,
    });
    drop(dog); // stops and joins at once
}

#[test]
fn the_watchdog_says_which_ranks_had_not_reached_a_timed_out_bucket() {
    use crate::comm::failure::Failures;
    use crate::comm::nccl::watchdog::{Pending, Tracker, Watchdog};
    use crate::comm::progress::Progress;
    use crate::comm::FailureBoard;
    use std::sync::Arc;
    let board = Arc::new(MemBoard::default());
    // Rank 1 last recorded bucket 3 of step 1; rank 2 is in step 2.
    board.record_progress(1, "v1 1 3 0 0");
    board.record_progress(2, "v1 2 1 1 0");
    let failures = Arc::new(Failures::new(Some(board.clone())));
    let progress = Arc::new(Progress::new());
    let tracker = Tracker {
        progress: progress.clone(),
        rank: 0,
        size: 3,
    };
    let dog = Watchdog::start_tracking(
        failures.clone(),
        std::time::Duration::from_millis(1),
        Some(tracker),
    )
    .unwrap();
    progress.submit(0);
    let at = progress.submit(0);
    dog.submit(Pending {
        comms: vec![Arc::new(SyncComm::default())],
        is_done: Box::new(|| Ok(false)),
        deadline: crate::comm::Deadline::after(std::time::Duration::from_millis(20)),
        at: Some(at),
    });
    let start = std::time::Instant::now();
    while failures.first().is_none() && start.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let text = failures
        .first()
        .expect("the timeout was recorded")
        .to_string();
    assert!(
        text.contains(
            "had not reached bucket 0 of step 2: rank 1 (last submitted bucket 3 of step 1"
        ),
        "{text}"
    );
    assert!(text.contains("ranks 0, 2 had reached it"), "{text}");
    // The abandoned collective is no longer counted in flight.
    assert!(progress.record().in_flight <= 1, "{text}");
    drop(dog);
}
