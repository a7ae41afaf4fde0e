//! Loader tests. They need no GPU: loading NCCL, resolving its functions,
//! ncclGetVersion, ncclGetErrorString and ncclGetUniqueId are host-only.
//! The tests that need the library are `#[ignore]`d, so that a plain
//! `cargo test` lists them as not run; `make test-rust` runs them with
//! `--ignored` when it finds the `nvidia-nccl` wheel in the repository's
//! `.venv` (or the file `TIACC_TEST_NCCL_LIBRARY` names), and there a
//! missing library fails them.
//!
//! The watchdog's tests run on stand-ins: `FakeComm`/`SyncComm` for its
//! logic (`tests/watchdog.rs`), and a real [`NcclCommunicator`] over
//! `FakeNccl`, Rust fakes of NCCL's functions (nothing loaded), for its
//! interplay with a call that waits on NCCL (`tests/stuck.rs`).

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::*;
use crate::comm::progress::tests::MemBoard;
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

mod stuck;
mod watchdog;
