//! A real [`NcclCommunicator`] over `FakeNccl`, Rust fakes of NCCL's
//! functions (nothing loaded): non-blocking and bounded initialisation, and
//! calls stuck in NCCL ended by the watchdog or an abort.

use super::*;

#[test]
fn a_non_blocking_init_is_polled_until_ready_and_aborted_at_its_deadline() {
    use crate::comm::nccl::ready::{await_ready, Readiness};
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

/// An in-process fake of NCCL for one communicator. The handle the fake
/// functions below receive is a pointer to one of these, a `static` of the
/// test that uses it, so tests running in parallel never share counters.
struct FakeNccl {
    /// `ncclAllReduce` calls.
    all_reduces: AtomicUsize,
    /// `ncclCommGetAsyncError` calls.
    polls: AtomicUsize,
    /// `ncclCommAbort` calls.
    aborts: AtomicUsize,
    /// Set by `ncclCommAbort`: the handle is freed from then on.
    aborted: AtomicBool,
    /// Calls other than `ncclCommAbort` that used the handle after it
    /// (a use after free in real NCCL).
    after_abort: AtomicUsize,
    /// Calls (other than `ncclCommAbort`) inside the fake right now, and how
    /// often one began while another was inside (NCCL is not thread-safe).
    busy: AtomicUsize,
    overlaps: AtomicUsize,
    /// Calls of functions these tests never expect.
    unexpected: AtomicUsize,
    /// Another fake whose abort this one's `ncclCommAbort` waits for (at
    /// most [`ABORT_STALL`]): freeing a communicator synchronises the
    /// device, which waits for the other's kernel stuck on a missing peer.
    waits_for: std::sync::atomic::AtomicPtr<FakeNccl>,
    /// Whether that wait ended because the other was aborted.
    waited_ok: AtomicBool,
}

/// How long a fake `ncclCommAbort` waits for the other fake's abort.
const ABORT_STALL: Duration = Duration::from_secs(10);

/// Leaves [`FakeNccl::enter`]'s count when a fake call returns.
struct InFake(&'static FakeNccl);

impl Drop for InFake {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, SeqCst);
    }
}

impl FakeNccl {
    const fn new() -> Self {
        FakeNccl {
            all_reduces: AtomicUsize::new(0),
            polls: AtomicUsize::new(0),
            aborts: AtomicUsize::new(0),
            aborted: AtomicBool::new(false),
            after_abort: AtomicUsize::new(0),
            busy: AtomicUsize::new(0),
            overlaps: AtomicUsize::new(0),
            unexpected: AtomicUsize::new(0),
            waits_for: std::sync::atomic::AtomicPtr::new(std::ptr::null_mut()),
            waited_ok: AtomicBool::new(false),
        }
    }

    /// The communicator handle that stands for `self`.
    fn handle(&'static self) -> ffi::NcclComm {
        self as *const FakeNccl as ffi::NcclComm
    }

    /// The fake behind `comm`.
    ///
    /// # Safety
    /// `comm` must be a handle made by [`FakeNccl::handle`].
    unsafe fn of(comm: ffi::NcclComm) -> &'static FakeNccl {
        // SAFETY: by this function's contract `comm` points to a `static`
        // FakeNccl, valid for the whole run and only used through atomics.
        unsafe { &*(comm as *const FakeNccl) }
    }

    /// Records a call (other than `ncclCommAbort`) on the handle.
    fn enter(&'static self) -> InFake {
        if self.busy.fetch_add(1, SeqCst) > 0 {
            self.overlaps.fetch_add(1, SeqCst);
        }
        if self.aborted.load(SeqCst) {
            self.after_abort.fetch_add(1, SeqCst);
        }
        InFake(self)
    }
}

/// `ncclInternalError`.
const FAKE_INTERNAL_ERROR: ffi::NcclResult = 3;
/// `ncclInvalidUsage`: what the fakes these tests never expect return.
const FAKE_INVALID_USAGE: ffi::NcclResult = 5;

// The fake functions never unwind (a panic cannot cross `extern "C"`):
// they only touch atomics and the out-pointers NCCL's API defines.

extern "C" fn fake_get_version(_version: *mut std::ffi::c_int) -> ffi::NcclResult {
    FAKE_INVALID_USAGE
}

extern "C" fn fake_get_unique_id(_id: *mut ffi::NcclUniqueId) -> ffi::NcclResult {
    FAKE_INVALID_USAGE
}

extern "C" fn fake_comm_init_rank(
    _comm: *mut ffi::NcclComm,
    _nranks: std::ffi::c_int,
    _id: ffi::NcclUniqueId,
    _rank: std::ffi::c_int,
) -> ffi::NcclResult {
    FAKE_INVALID_USAGE
}

extern "C" fn fake_group() -> ffi::NcclResult {
    FAKE_INVALID_USAGE
}

extern "C" fn fake_error_string(_result: ffi::NcclResult) -> *const std::ffi::c_char {
    c"fake NCCL error".as_ptr()
}

/// A call on the handle that these tests never expect.
///
/// # Safety
/// `comm` must be a handle made by [`FakeNccl::handle`].
unsafe fn fake_unexpected(comm: ffi::NcclComm) -> ffi::NcclResult {
    // SAFETY: every communicator these tests build holds a FakeNccl handle.
    let fake = unsafe { FakeNccl::of(comm) };
    let _in = fake.enter();
    fake.unexpected.fetch_add(1, SeqCst);
    FAKE_INVALID_USAGE
}

unsafe extern "C" fn fake_comm_destroy(comm: ffi::NcclComm) -> ffi::NcclResult {
    // SAFETY: as in `fake_unexpected`.
    unsafe { fake_unexpected(comm) }
}

/// `ncclCommAbort`: records the call; the handle is freed from now on.
unsafe extern "C" fn fake_comm_abort(comm: ffi::NcclComm) -> ffi::NcclResult {
    // SAFETY: as in `fake_unexpected`.
    let fake = unsafe { FakeNccl::of(comm) };
    fake.aborts.fetch_add(1, SeqCst);
    // The abort flag is set first (the kernel stops), then the memory is
    // freed, which waits for the other communicator's kernel.
    fake.aborted.store(true, SeqCst);
    let other = fake.waits_for.load(SeqCst);
    if !other.is_null() {
        // SAFETY: `waits_for` only ever holds a pointer to a `static` FakeNccl.
        let other = unsafe { &*other };
        let start = Instant::now();
        while !other.aborted.load(SeqCst) && start.elapsed() < ABORT_STALL {
            std::thread::sleep(Duration::from_millis(1));
        }
        fake.waited_ok.store(other.aborted.load(SeqCst), SeqCst);
    }
    ffi::NCCL_SUCCESS
}

/// `ncclCommGetAsyncError`: the communicator's work stays in progress (a
/// peer never posts its collective) until it is aborted; then an error.
unsafe extern "C" fn fake_get_async_error(
    comm: ffi::NcclComm,
    error: *mut ffi::NcclResult,
) -> ffi::NcclResult {
    // SAFETY: as in `fake_unexpected`.
    let fake = unsafe { FakeNccl::of(comm) };
    let _in = fake.enter();
    fake.polls.fetch_add(1, SeqCst);
    let state = if fake.aborted.load(SeqCst) {
        FAKE_INTERNAL_ERROR
    } else {
        ffi::NCCL_IN_PROGRESS
    };
    // SAFETY: `error` is the valid out-pointer ncclCommGetAsyncError's
    // callers pass.
    unsafe { *error = state };
    ffi::NCCL_SUCCESS
}

/// `ncclAllReduce` on a non-blocking communicator whose peer never posts
/// its collective: accepted, not finished (`ncclInProgress`).
unsafe extern "C" fn fake_all_reduce(
    _send: *const std::ffi::c_void,
    _recv: *mut std::ffi::c_void,
    _count: usize,
    _dtype: ffi::NcclDataType,
    _op: ffi::NcclRedOp,
    comm: ffi::NcclComm,
    _stream: ffi::CudaStream,
) -> ffi::NcclResult {
    // SAFETY: as in `fake_unexpected`.
    let fake = unsafe { FakeNccl::of(comm) };
    let _in = fake.enter();
    fake.all_reduces.fetch_add(1, SeqCst);
    ffi::NCCL_IN_PROGRESS
}

/// Defines fakes of calls on a handle that these tests never expect (each
/// [`fake_unexpected`]): NCCL's arguments as given, then the communicator
/// and the stream.
macro_rules! unexpected_on_comm {
    ($($name:ident($($arg:ident: $ty:ty),*);)*) => {$(
        unsafe extern "C" fn $name(
            $($arg: $ty,)*
            comm: ffi::NcclComm,
            _stream: ffi::CudaStream,
        ) -> ffi::NcclResult {
            // SAFETY: as in `fake_unexpected`.
            unsafe { fake_unexpected(comm) }
        }
    )*};
}

unexpected_on_comm! {
    fake_reduce_scatter(
        _send: *const std::ffi::c_void,
        _recv: *mut std::ffi::c_void,
        _count: usize,
        _dtype: ffi::NcclDataType,
        _op: ffi::NcclRedOp
    );
    fake_all_gather(
        _send: *const std::ffi::c_void,
        _recv: *mut std::ffi::c_void,
        _count: usize,
        _dtype: ffi::NcclDataType
    );
    fake_broadcast(
        _send: *const std::ffi::c_void,
        _recv: *mut std::ffi::c_void,
        _count: usize,
        _dtype: ffi::NcclDataType,
        _root: std::ffi::c_int
    );
    fake_send(
        _send: *const std::ffi::c_void,
        _count: usize,
        _dtype: ffi::NcclDataType,
        _peer: std::ffi::c_int
    );
    fake_recv(
        _recv: *mut std::ffi::c_void,
        _count: usize,
        _dtype: ffi::NcclDataType,
        _peer: std::ffi::c_int
    );
}

/// NCCL's function table, pointing at the fakes above.
const FAKE_NCCL: ffi::Functions = ffi::Functions {
    get_version: fake_get_version,
    get_unique_id: fake_get_unique_id,
    comm_init_rank: fake_comm_init_rank,
    comm_abort: fake_comm_abort,
    comm_destroy: fake_comm_destroy,
    comm_get_async_error: fake_get_async_error,
    all_reduce: fake_all_reduce,
    reduce_scatter: fake_reduce_scatter,
    all_gather: fake_all_gather,
    broadcast: fake_broadcast,
    send: fake_send,
    recv: fake_recv,
    group_start: fake_group,
    group_end: fake_group,
    get_error_string: fake_error_string,
    comm_init_rank_config: None,
    get_last_error: None,
};

/// Rank 0 of a world of 2, non-blocking, over `fake`'s handle; a call that
/// NCCL leaves in progress is waited for up to `wait`.
fn fake_communicator(fake: &'static FakeNccl, wait: Duration) -> Arc<NcclCommunicator> {
    let lib = Arc::new(NcclLibrary::from_functions(FAKE_NCCL, (2, 30, 7)));
    Arc::new(NcclCommunicator::from_handle(
        lib,
        fake.handle(),
        0,
        2,
        Group::World,
        wait,
    ))
}

type Outcome = crate::error::Result<()>;

/// Starts an allreduce on `comm` in its own thread (the DDP hook's enqueue)
/// and returns once it waits on NCCL's `ncclInProgress`, holding the
/// communicator's call lock; its outcome comes on the channel.
fn start_a_stuck_all_reduce(
    comm: &Arc<NcclCommunicator>,
    fake: &'static FakeNccl,
) -> (JoinHandle<()>, Receiver<Outcome>) {
    let (tx, rx) = mpsc::channel();
    let caller = comm.clone();
    let thread = std::thread::spawn(move || {
        let null = std::ptr::null_mut();
        // SAFETY: the fake ncclAllReduce reads neither the buffers nor the
        // stream, so null ones are as good as any.
        let outcome = unsafe {
            caller.all_reduce(
                DevicePtr(null),
                DevicePtr(null),
                1024,
                crate::comm::DType::F32,
                ReduceOp::Avg,
                null,
            )
        };
        let _ = tx.send(outcome);
    });
    let start = Instant::now();
    while fake.polls.load(SeqCst) == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the allreduce never reached its wait for ncclInProgress"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(fake.all_reduces.load(SeqCst), 1);
    (thread, rx)
}

/// Runs [`watch`] on `comm` in its own thread (the watchdog's), as the
/// engine does: the work never finishes; the outcome and the time it took
/// come on the channel, so that a watchdog stuck for good fails the test
/// instead of hanging it.
fn watch_in_a_thread(
    comm: &Arc<NcclCommunicator>,
    deadline: crate::comm::Deadline,
    mut peer_failed: impl FnMut() -> Option<String> + Send + 'static,
) -> Receiver<(Outcome, Duration)> {
    let (tx, rx) = mpsc::channel();
    let watched = comm.clone();
    std::thread::spawn(move || {
        let start = Instant::now();
        let outcome = watch(
            &[&*watched as &dyn Watched],
            deadline,
            Duration::from_millis(5),
            || Ok(false),
            &mut peer_failed,
        );
        let _ = tx.send((outcome, start.elapsed()));
    });
    rx
}

/// How long the tests below give the watchdog and the stuck call to
/// return (the fix takes milliseconds; without it, the call's own wait).
const RETURN_WITHIN: Duration = Duration::from_secs(5);

/// Waits for the stuck call's outcome, which must say that the communicator
/// was closed for `reason`, and checks what reached the fake NCCL.
fn the_stuck_call_ends_closed(
    comm: Arc<NcclCommunicator>,
    fake: &'static FakeNccl,
    caller: (JoinHandle<()>, Receiver<Outcome>),
    reason: &str,
) {
    let (thread, outcome) = caller;
    let outcome = outcome.recv_timeout(RETURN_WITHIN).unwrap_or_else(|_| {
        panic!("the allreduce still waits on NCCL {RETURN_WITHIN:?} after the abort")
    });
    thread.join().unwrap();
    let message = comm_message(outcome.expect_err("the allreduce succeeded"));
    assert!(
        message.contains("ncclAllReduce: the world communicator (rank 0 of 2) is closed"),
        "{message}"
    );
    assert!(message.contains(reason), "{message}");
    assert!(comm.is_closed());
    assert_eq!(comm.bytes_given(), 0, "a failed allreduce was counted");
    assert!(
        comm.wait_aborted(RETURN_WITHIN),
        "ncclCommAbort did not return"
    );
    drop(comm); // aborts again, which must not reach NCCL
    assert_eq!(fake.aborts.load(SeqCst), 1, "ncclCommAbort runs once");
    assert_eq!(
        fake.after_abort.load(SeqCst),
        0,
        "NCCL was called on the handle after ncclCommAbort freed it"
    );
    assert_eq!(
        fake.overlaps.load(SeqCst),
        0,
        "two calls were inside NCCL at once"
    );
    assert_eq!(fake.all_reduces.load(SeqCst), 1);
    assert_eq!(fake.unexpected.load(SeqCst), 0);
}

/// The hang found on an H100: one rank's gradient check failed and it
/// never posted its allreduce; on the others the DDP hook's enqueue
/// returned `ncclInProgress` and waited on NCCL holding the communicator's
/// call lock, and the watchdog's poll of the asynchronous error waited for
/// that lock, so it never read the failure board (nor its deadline) and
/// every rank hung until killed. The watchdog must get past the stuck call,
/// see the other rank's failure, and abort, which ends the call's wait.
#[test]
fn another_ranks_failure_ends_a_collective_stuck_in_progress_holding_the_lock() {
    static FAKE: FakeNccl = FakeNccl::new();
    let failure = "rank 1: bucket 0 holds a non-finite gradient";
    // The call alone would wait 30 s, the watchdog's deadline 60 s.
    let comm = fake_communicator(&FAKE, Duration::from_secs(30));
    let caller = start_a_stuck_all_reduce(&comm, &FAKE);
    let posted = Instant::now();
    let watchdog = watch_in_a_thread(
        &comm,
        crate::comm::Deadline::after(Duration::from_secs(60)),
        move || (posted.elapsed() >= Duration::from_millis(50)).then(|| failure.to_string()),
    );
    let (outcome, took) = watchdog.recv_timeout(RETURN_WITHIN).unwrap_or_else(|_| {
        panic!(
            "the watchdog did not return within {RETURN_WITHIN:?}: it waits behind the stuck \
             allreduce for the communicator's lock and never reads the failure board"
        )
    });
    assert!(took < Duration::from_secs(2), "the watchdog took {took:?}");
    let message = comm_message(outcome.expect_err("the watchdog saw no failure"));
    assert!(
        message.starts_with(
            "world communicator, rank 0 of 2: an NCCL collective was abandoned because another \
             rank failed: rank 1: bucket 0 holds a non-finite gradient"
        ),
        "{message}"
    );
    the_stuck_call_ends_closed(comm, &FAKE, caller, failure);
}

/// As above with no failure on the board: the watchdog's deadline passes,
/// and its abort ends the stuck call.
#[test]
fn the_watchdogs_deadline_ends_a_collective_stuck_in_progress_holding_the_lock() {
    static FAKE: FakeNccl = FakeNccl::new();
    let comm = fake_communicator(&FAKE, Duration::from_secs(30));
    let caller = start_a_stuck_all_reduce(&comm, &FAKE);
    let limit = Duration::from_millis(100);
    let watchdog = watch_in_a_thread(&comm, crate::comm::Deadline::after(limit), || None);
    let (outcome, took) = watchdog.recv_timeout(RETURN_WITHIN).unwrap_or_else(|_| {
        panic!(
            "the watchdog did not return within {RETURN_WITHIN:?}: it waits behind the stuck \
             allreduce for the communicator's lock and never reads its deadline"
        )
    });
    // Only an upper bound, against a watchdog that never returns: the
    // deadline starts before the watchdog's thread does, so its own clock
    // may read less than the limit.
    assert!(took < Duration::from_secs(2), "the watchdog took {took:?}");
    let Err(Error::CommTimeout { peer, message }) = outcome else {
        panic!("expected a CommTimeout, got {outcome:?}")
    };
    assert_eq!(peer, 0);
    assert!(
        message.starts_with(
            "world communicator, rank 0 of 2: an NCCL collective did not finish within 100ms"
        ),
        "{message}"
    );
    the_stuck_call_ends_closed(comm, &FAKE, caller, "did not finish within 100ms");
}

/// The second hang of that H100 run's kind: an engine aborts its
/// communicators one after the other (every channel's, the 2D groups'),
/// and freeing the first one's memory synchronises the device, which waits
/// for the second one's kernel, stuck on the missing peer until the second
/// one's abort. Aborting must not wait for NCCL: both aborts return at
/// once, and both `ncclCommAbort`s then finish.
#[test]
fn communicators_aborted_one_after_the_other_do_not_wait_for_each_other() {
    static A: FakeNccl = FakeNccl::new();
    static B: FakeNccl = FakeNccl::new();
    A.waits_for
        .store(&B as *const FakeNccl as *mut FakeNccl, SeqCst);
    B.waits_for
        .store(&A as *const FakeNccl as *mut FakeNccl, SeqCst);
    let (a, b) = (
        fake_communicator(&A, Duration::from_secs(30)),
        fake_communicator(&B, Duration::from_secs(30)),
    );
    let (tx, rx) = mpsc::channel();
    let (first, second) = (a.clone(), b.clone());
    std::thread::spawn(move || {
        let start = Instant::now();
        first.abort("rank 1 failed");
        second.abort("rank 1 failed");
        let _ = tx.send(start.elapsed());
    });
    let took = rx.recv_timeout(RETURN_WITHIN).unwrap_or_else(|_| {
        panic!("aborting two communicators in turn took over {RETURN_WITHIN:?}: the first abort waits for the second one's kernel")
    });
    assert!(took < Duration::from_secs(2), "the aborts took {took:?}");
    assert!(a.wait_aborted(RETURN_WITHIN) && b.wait_aborted(RETURN_WITHIN));
    assert!(A.waited_ok.load(SeqCst) && B.waited_ok.load(SeqCst));
    assert_eq!((A.aborts.load(SeqCst), B.aborts.load(SeqCst)), (1, 1));
    drop((a, b)); // aborts again, which must not reach NCCL
    assert_eq!((A.aborts.load(SeqCst), B.aborts.load(SeqCst)), (1, 1));
    assert_eq!(A.after_abort.load(SeqCst) + B.after_abort.load(SeqCst), 0);
}
