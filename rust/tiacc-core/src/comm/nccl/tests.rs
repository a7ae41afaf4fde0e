//! Loader tests. They need no GPU: loading NCCL, resolving its functions,
//! ncclGetVersion, ncclGetErrorString and ncclGetUniqueId are host-only.
//! The tests that need the library are `#[ignore]`d, so that a plain
//! `cargo test` lists them as not run; `make test-rust` runs them with
//! `--ignored` when it finds the `nvidia-nccl` wheel in the repository's
//! `.venv` (or the file `TIACC_TEST_NCCL_LIBRARY` names), and there a
//! missing library fails them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::*;
use crate::error::Error;

/// The wheel's library in `<repo>/.venv`, or the file the test variable names.
fn venv_nccl() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TIACC_TEST_NCCL_LIBRARY") {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    let lib_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/lib");
    std::fs::read_dir(lib_dir)
        .ok()?
        .flatten()
        .map(|e| {
            e.path()
                .join("site-packages/nvidia/nccl/lib")
                .join(LIBRARY_NAME)
        })
        .find(|p| p.is_file())
}

/// The library, which a test run with `--ignored` requires.
fn nccl_library() -> PathBuf {
    venv_nccl().unwrap_or_else(|| {
        panic!(
            "no {LIBRARY_NAME} in the repository's .venv: install torch with CUDA there, or \
             set TIACC_TEST_NCCL_LIBRARY to the file"
        )
    })
}

/// Whether this machine has an NVIDIA GPU (then NCCL's init can succeed).
fn has_gpu() -> bool {
    Path::new("/dev/nvidia0").exists()
}

fn comm_message(err: Error) -> String {
    match err {
        Error::Comm { message, .. } => message,
        other => panic!("expected Error::Comm, got {other:?}"),
    }
}

#[test]
#[ignore = "needs the NCCL library: make test-rust runs it with --ignored where it finds one"]
fn loads_from_an_explicit_path_and_reports_a_recent_version() {
    let path = nccl_library();
    let lib = NcclLibrary::open_path(&path).unwrap();
    let version = lib.version();
    assert!(version >= MIN_VERSION, "{version:?}");
    assert_eq!(version.0, 2);
    assert!(lib.path().ends_with(LIBRARY_NAME), "{}", lib.path());
}

#[test]
#[ignore = "needs the NCCL library: make test-rust runs it with --ignored where it finds one"]
fn the_explicit_setting_wins_and_directories_are_searched() {
    let path = nccl_library();
    let by_file = NcclLibrary::load(&NcclSearch {
        explicit: Some(path.clone()),
        dirs: vec![PathBuf::from("/nonexistent")],
    })
    .unwrap();
    let by_dir = NcclLibrary::load(&NcclSearch {
        explicit: None,
        dirs: vec![
            PathBuf::from("/nonexistent/dir"),
            path.parent().unwrap().to_path_buf(),
        ],
    })
    .unwrap();
    assert_eq!(by_file.version(), by_dir.version());
}

#[test]
fn a_missing_explicit_file_is_a_comm_error_naming_it() {
    let err = NcclLibrary::load(&NcclSearch {
        explicit: Some(PathBuf::from("/nonexistent/libnccl.so.2")),
        dirs: vec![],
    })
    .unwrap_err();
    let message = comm_message(err);
    assert!(message.contains("/nonexistent/libnccl.so.2"), "{message}");
    assert!(message.contains("TIACC_TRAINING_NCCL_LIBRARY"), "{message}");
}

#[test]
fn a_library_that_is_not_nccl_names_the_missing_symbol() {
    let err = NcclLibrary::open_path(Path::new("libc.so.6")).unwrap_err();
    let message = comm_message(err);
    assert!(message.contains("ncclGetVersion"), "{message}");
    assert!(message.contains("libc.so.6"), "{message}");
}

#[test]
fn a_file_that_is_not_a_library_is_a_comm_error() {
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join(LIBRARY_NAME);
    std::fs::write(&fake, b"not an ELF file").unwrap();
    let message = comm_message(NcclLibrary::open_path(&fake).unwrap_err());
    assert!(message.contains(&fake.display().to_string()), "{message}");
    // In the directory search a broken candidate is reported, not fatal
    // by itself; the final error lists what was tried.
    let err = NcclLibrary::load(&NcclSearch {
        explicit: None,
        dirs: vec![dir.path().to_path_buf()],
    });
    if let Err(err) = err {
        let message = comm_message(err);
        assert!(message.contains("tried"), "{message}");
    }
}

#[test]
#[ignore = "needs the NCCL library: make test-rust runs it with --ignored where it finds one"]
fn error_codes_map_to_nccl_text() {
    let path = nccl_library();
    let lib = NcclLibrary::open_path(&path).unwrap();
    assert_eq!(lib.check(0, "ncclAllReduce").ok(), Some(()));
    for (code, words) in [
        (1, "cuda"),
        (2, "system"),
        (3, "internal"),
        (4, "invalid argument"),
        (5, "invalid usage"),
    ] {
        let text = lib.error_string(code).to_lowercase();
        assert!(text.contains(words), "code {code}: {text}");
        let message = comm_message(lib.check(code, "ncclAllReduce").unwrap_err());
        assert!(message.starts_with("ncclAllReduce failed"), "{message}");
        assert!(message.contains(&format!("NCCL error {code}")), "{message}");
        assert!(message.to_lowercase().contains(words), "{message}");
    }
    // Unknown codes still produce a message, not a crash.
    assert!(!lib.error_string(9999).is_empty());
}

#[test]
#[ignore = "needs the NCCL library: make test-rust runs it with --ignored where it finds one"]
fn unique_ids_are_128_random_bytes() {
    let path = nccl_library();
    let lib = NcclLibrary::open_path(&path).unwrap();
    match (lib.unique_id(), lib.unique_id()) {
        (Ok(a), Ok(b)) => {
            assert_eq!(a.to_bytes().len(), UNIQUE_ID_BYTES);
            assert_ne!(a, b, "two ids must differ");
        }
        // ncclGetUniqueId needs a usable network interface for its
        // bootstrap address; a sandbox without one gets a clean error.
        (Err(e), _) | (_, Err(e)) => {
            let message = comm_message(e);
            assert!(message.contains("ncclGetUniqueId"), "{message}");
            eprintln!("ncclGetUniqueId unavailable here: {message}");
        }
    }
}

#[test]
#[ignore = "needs the NCCL library: make test-rust runs it with --ignored where it finds one"]
fn init_of_a_world_of_one_fails_cleanly_without_a_gpu_and_works_with_one() {
    let path = nccl_library();
    let lib = Arc::new(NcclLibrary::open_path(&path).unwrap());
    let id = lib
        .unique_id()
        .expect("ncclGetUniqueId (it needs a network interface for its bootstrap address)");
    match NcclCommunicator::init(lib, &id, 0, 1, Group::World) {
        Ok(comm) => {
            assert!(
                has_gpu(),
                "ncclCommInitRank succeeded on a machine without a GPU"
            );
            drop(comm);
        }
        Err(err) => {
            let message = comm_message(err);
            assert!(!has_gpu(), "a world of one failed on a GPU: {message}");
            assert!(
                message.contains("world communicator, rank 0 of 1"),
                "{message}"
            );
            assert!(message.contains("ncclCommInitRank"), "{message}");
        }
    }
}

#[test]
fn bad_ranks_are_rejected_before_nccl_is_called() {
    for (rank, size) in [(2, 2), (0, 0), (5, 3)] {
        let err = communicator::check_rank(rank, size).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
        assert!(err.to_string().contains(&format!("rank {rank}")), "{err}");
    }
    communicator::check_rank(1, 2).unwrap();
}

#[test]
fn groups_parse_and_print() {
    for g in [Group::World, Group::Intra, Group::Inter] {
        assert_eq!(Group::parse(g.name()).unwrap(), g);
    }
    assert!(Group::parse("galaxy").is_err());
}

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
    use super::watchdog::{Pending, Watchdog};
    use crate::comm::failure::Failures;
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

/// A board that keeps records in memory, as the store does.
#[derive(Default)]
struct MemBoard(std::sync::Mutex<std::collections::HashMap<usize, String>>);

impl crate::comm::failure::FailureBoard for MemBoard {
    fn publish(&self, message: &str) -> Option<String> {
        Some(message.to_string())
    }
    fn peek(&self) -> Option<String> {
        None
    }
    fn record_progress(&self, rank: usize, record: &str) {
        self.0.lock().unwrap().insert(rank, record.to_string());
    }
    fn progress(&self, size: usize) -> Vec<Option<String>> {
        let map = self.0.lock().unwrap();
        (0..size).map(|r| map.get(&r).cloned()).collect()
    }
}

#[test]
fn the_watchdog_says_which_ranks_had_not_reached_a_timed_out_bucket() {
    use super::watchdog::{Pending, Tracker, Watchdog};
    use crate::comm::failure::Failures;
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

#[test]
fn a_non_blocking_init_is_polled_until_ready_and_aborted_at_its_deadline() {
    use super::communicator::{await_ready, Readiness};
    use std::cell::Cell;
    use std::time::{Duration, Instant};

    // Ready after a few polls: no abort.
    let polls = Cell::new(0);
    let aborted = Cell::new(false);
    await_ready(
        || {
            polls.set(polls.get() + 1);
            Ok(if polls.get() < 4 {
                Readiness::InProgress
            } else {
                Readiness::Ready
            })
        },
        || aborted.set(true),
        crate::comm::Deadline::after(Duration::from_secs(10)),
        0,
        || "init".into(),
    )
    .unwrap();
    assert_eq!((polls.get(), aborted.get()), (4, false));

    // Never ready (a peer never arrives): aborted at the deadline, a
    // CommTimeout naming what did not complete.
    let start = Instant::now();
    let err = await_ready(
        || Ok(Readiness::InProgress),
        || aborted.set(true),
        crate::comm::Deadline::after(Duration::from_millis(60)),
        3,
        || "world communicator, rank 3 of 4: ncclCommInitRankConfig".into(),
    )
    .unwrap_err();
    let waited = start.elapsed();
    assert!(aborted.get());
    assert!(waited >= Duration::from_millis(60), "{waited:?}");
    let Error::CommTimeout { peer, message } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(*peer, 3);
    assert!(
        message.starts_with(
            "world communicator, rank 3 of 4: ncclCommInitRankConfig did not complete within 0.1s"
        ),
        "{message}"
    );

    // An NCCL error while initialising: aborted, the error passed on.
    aborted.set(false);
    let err = await_ready(
        || {
            Err(Error::Comm {
                peer: None,
                message: "ncclSystemError".into(),
            })
        },
        || aborted.set(true),
        crate::comm::Deadline::after(Duration::from_secs(10)),
        0,
        || "init".into(),
    )
    .unwrap_err();
    assert!(
        aborted.get() && err.to_string().contains("ncclSystemError"),
        "{err}"
    );
}

#[test]
#[ignore = "needs the NCCL library: make test-rust runs it with --ignored where it finds one"]
fn a_bounded_init_whose_peer_never_comes_fails_at_its_deadline() {
    // Rank 0 of 2 whose rank 1 never joins: without a GPU the init fails at
    // once, with one it waits for the peer until the deadline; either way
    // the error names the communicator and comes by the deadline.
    let path = nccl_library();
    let lib = Arc::new(NcclLibrary::open_path(&path).unwrap());
    let id = lib
        .unique_id()
        .expect("ncclGetUniqueId (it needs a network interface for its bootstrap address)");
    let limit = std::time::Duration::from_secs(if has_gpu() { 5 } else { 20 });
    let start = std::time::Instant::now();
    let deadline = crate::comm::Deadline::after(limit);
    let err = NcclCommunicator::init_bounded(lib, &id, 0, 2, Group::World, deadline).unwrap_err();
    let message = match err {
        // Without a GPU: NCCL's own error at once.
        Error::Comm { message, .. } => message,
        // With one: the peer never came.
        Error::CommTimeout { message, .. } if has_gpu() => message,
        other => panic!("expected a CommError, got {other:?}"),
    };
    assert!(
        message.contains("world communicator, rank 0 of 2"),
        "{message}"
    );
    assert!(
        start.elapsed() < limit + std::time::Duration::from_secs(5),
        "{message}"
    );
}
