//! Where each rank is in the job: which bucket of which step it has
//! submitted, how long it computed and how long it communicated.
//!
//! * **Hang attribution.** Every engine keeps a [`Progress`]. A
//!   [`Recorder`] thread writes it to the job's board (the c10d store) at
//!   most once per [`RECORD_PERIOD`], and only when it changed, so a rank
//!   that stops moving has its last position in the store within about
//!   half a second. When a collective times out, the rank reads every
//!   rank's record and [`attribute`]s the hang: which ranks had not reached
//!   the bucket and step it waits on (with their last record), which had,
//!   and which left no record. The hot path only
//!   takes an uncontended lock per submitted and per finished collective.
//! * **Step times.** A step starts when bucket 0 is submitted (DDP launches
//!   buckets in index order, so bucket 0 comes first in every step). The
//!   time during which at least one collective of this rank is in flight is
//!   its communication time; the rest of the step is its compute time
//!   (forward, backward up to the first bucket, optimizer, data loading).
//!   A slow rank computes longer; its peers wait in their collectives, so
//!   comparing compute times across ranks finds it ([`slow_ranks`]).

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::failure::FailureBoard;
use crate::error::{Error, Result};

/// The shortest time between two writes of a rank's record to the store.
pub const RECORD_PERIOD: Duration = Duration::from_millis(500);
/// How long stopping a recorder waits for its thread.
const STOP_GRACE: Duration = Duration::from_millis(200);
/// How often the recorder thread looks for a change.
const RECORD_TICK: Duration = Duration::from_millis(100);

/// A rank is reported slow when its compute time per step is at least this
/// many times the median rank's ...
pub const SLOW_RATIO: f64 = 1.25;
/// ... and at least this much longer per step (so that noise on very short
/// steps is not reported).
pub const SLOW_MARGIN: Duration = Duration::from_millis(5);

/// A bucket of a step. Steps count from 1 (the first step an engine saw).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Position {
    pub step: u64,
    pub bucket: u64,
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "bucket {} of step {}", self.bucket, self.step)
    }
}

#[derive(Debug, Default)]
struct State {
    /// Steps started (submissions of bucket 0).
    steps: u64,
    /// The last collective submitted.
    submitted: Option<Position>,
    /// Collectives submitted and not finished.
    in_flight: u64,
    /// Bumped on every change (the recorder writes only after one).
    version: u64,
    /// When the current stretch with something in flight began.
    busy_since: Option<Instant>,
    /// Communication time accumulated since the last [`Progress::take_times`].
    comm: Duration,
    /// When the first step since the last [`Progress::take_times`] began.
    window_start: Option<Instant>,
    /// Steps begun since then.
    window_steps: u64,
}

/// One rank's progress through the job (see the module docs).
#[derive(Debug, Default)]
pub struct Progress {
    state: Mutex<State>,
}

/// Compute and communication time of a rank over some steps.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepTimes {
    /// Whole steps measured.
    pub steps: u64,
    /// Seconds without any of this rank's collectives in flight.
    pub compute: f64,
    /// Seconds with at least one in flight.
    pub comm: f64,
}

impl Progress {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A collective of `bucket` is submitted; returns its position. Bucket 0
    /// begins a new step.
    pub fn submit(&self, bucket: u64) -> Position {
        self.submit_at(bucket, Instant::now())
    }

    /// [`Progress::submit`] at the instant `now`.
    fn submit_at(&self, bucket: u64, now: Instant) -> Position {
        let mut s = self.lock();
        if bucket == 0 || s.steps == 0 {
            s.steps += 1;
            s.window_steps += 1;
            s.window_start.get_or_insert(now);
        }
        let at = Position {
            step: s.steps,
            bucket,
        };
        s.submitted = Some(at);
        if s.in_flight == 0 {
            s.busy_since = Some(now);
        }
        s.in_flight += 1;
        s.version += 1;
        at
    }

    /// A submitted collective finished (or failed).
    pub fn complete(&self) {
        self.complete_at(Instant::now())
    }

    /// [`Progress::complete`] at the instant `now`.
    fn complete_at(&self, now: Instant) {
        let mut s = self.lock();
        s.in_flight = s.in_flight.saturating_sub(1);
        if s.in_flight == 0 {
            if let Some(since) = s.busy_since.take() {
                s.comm += now.saturating_duration_since(since);
            }
        }
        s.version += 1;
    }

    /// The times of the steps begun since the last call, which are whole
    /// when this is called just before the next step's bucket 0 is
    /// submitted (the hook does); the next window begins at that bucket.
    pub fn take_times(&self) -> StepTimes {
        self.take_times_at(Instant::now())
    }

    /// [`Progress::take_times`] at the instant `now`.
    fn take_times_at(&self, now: Instant) -> StepTimes {
        let mut s = self.lock();
        let Some(start) = s.window_start.take() else {
            return StepTimes::default();
        };
        // Communication still in flight counts up to now.
        let mut comm = s.comm;
        if let Some(since) = s.busy_since {
            comm += now.saturating_duration_since(since);
            s.busy_since = Some(now);
        }
        let total = now.saturating_duration_since(start);
        let times = StepTimes {
            steps: s.window_steps,
            compute: total.saturating_sub(comm).as_secs_f64(),
            comm: comm.as_secs_f64(),
        };
        s.comm = Duration::ZERO;
        s.window_steps = 0;
        times
    }

    /// This rank's record as written to the store.
    pub fn record(&self) -> Record {
        let s = self.lock();
        Record {
            submitted: s.submitted,
            in_flight: s.in_flight,
            unix_ms: unix_ms(),
        }
    }

    fn version(&self) -> u64 {
        self.lock().version
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A rank's position as kept in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// The last collective it submitted (`None`: none yet).
    pub submitted: Option<Position>,
    /// How many of its collectives were unfinished.
    pub in_flight: u64,
    /// When it was written (milliseconds since the Unix epoch).
    pub unix_ms: u64,
}

impl Record {
    /// The store encoding: `v1 STEP BUCKET IN_FLIGHT UNIX_MS` (step 0:
    /// nothing submitted yet).
    pub fn encode(&self) -> String {
        let (step, bucket) = self.submitted.map_or((0, 0), |p| (p.step, p.bucket));
        format!("v1 {step} {bucket} {} {}", self.in_flight, self.unix_ms)
    }

    /// Decodes [`Record::encode`]'s text; `None` if it is not a record.
    pub fn decode(text: &str) -> Option<Self> {
        let mut parts = text.split_ascii_whitespace();
        if parts.next()? != "v1" {
            return None;
        }
        let mut next = || parts.next()?.parse::<u64>().ok();
        let (step, bucket, in_flight, unix_ms) = (next()?, next()?, next()?, next()?);
        Some(Record {
            submitted: (step > 0).then_some(Position { step, bucket }),
            in_flight,
            unix_ms,
        })
    }

    fn describe(&self, now_ms: u64) -> String {
        let age = now_ms.saturating_sub(self.unix_ms) as f64 / 1000.0;
        let last = match self.submitted {
            None => "no collective submitted yet".to_string(),
            Some(p) => format!("last submitted {p}, {} unfinished", self.in_flight),
        };
        format!("{last}; recorded {age:.1}s before this error")
    }
}

/// What a timed-out rank says about every rank's position: which ranks had
/// not reached `at`, which had (and were waiting in it or beyond it), and
/// which left no readable record. `records[r]` is rank `r`'s record text.
pub fn attribute(at: Position, records: &[Option<String>], now_unix_ms: u64) -> String {
    let mut behind = Vec::new();
    let mut reached = Vec::new();
    let mut unknown = Vec::new();
    for (rank, text) in records.iter().enumerate() {
        match text.as_deref().and_then(Record::decode) {
            None => unknown.push(rank),
            Some(r) if r.submitted.is_none_or(|p| p < at) => {
                behind.push(format!("rank {rank} ({})", r.describe(now_unix_ms)))
            }
            Some(_) => reached.push(rank),
        }
    }
    let ranks = |v: &[usize]| {
        let names: Vec<String> = v.iter().map(usize::to_string).collect();
        let noun = if v.len() == 1 { "rank" } else { "ranks" };
        format!("{noun} {}", names.join(", "))
    };
    let mut parts = Vec::new();
    if !behind.is_empty() {
        parts.push(format!("had not reached {at}: {}", behind.join(", ")));
    }
    if !reached.is_empty() {
        parts.push(format!("{} had reached it", ranks(&reached)));
    }
    if !unknown.is_empty() {
        parts.push(format!("{} left no record", ranks(&unknown)));
    }
    format!("[where the ranks were: {}]", parts.join("; "))
}

/// Appends the attribution of a timeout at `at` to `err` (other errors pass
/// through), from the others' records on the board and this rank's own
/// position. Nothing is appended when the board answers nothing.
pub fn attribute_timeout(
    err: Error,
    at: Position,
    progress: &Progress,
    board: &dyn FailureBoard,
    rank: usize,
    size: usize,
) -> Error {
    let Error::CommTimeout { peer, message } = err else {
        return err;
    };
    // Only read: a board that cannot be reached answers nothing at once,
    // where a write could wait on it (this rank's own record is current
    // anyway: it has not moved for the whole timeout).
    let mut records = board.progress(size);
    if records.iter().all(Option::is_none) {
        return Error::CommTimeout { peer, message };
    }
    if let Some(mine) = records.get_mut(rank) {
        *mine = Some(progress.record().encode());
    }
    let note = attribute(at, &records, unix_ms());
    Error::CommTimeout {
        peer,
        message: format!("{message} {note}"),
    }
}

/// Writes a [`Progress`] to the board when it changed, at most once per
/// [`RECORD_PERIOD`], from its own thread.
pub struct Recorder {
    stop: Arc<(Mutex<bool>, Condvar)>,
    stopped: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Recorder {
    /// Writes the first record now and starts the thread.
    pub fn start(
        progress: Arc<Progress>,
        board: Arc<dyn FailureBoard>,
        rank: usize,
    ) -> Result<Self> {
        let mut written = progress.version();
        board.record_progress(rank, &progress.record().encode());
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let stopped = Arc::new(AtomicBool::new(false));
        let (stop2, stopped2) = (stop.clone(), stopped.clone());
        let thread = std::thread::Builder::new()
            .name("tiacc-progress".into())
            .spawn(move || {
                // The first change is written at once: a rank that stops
                // soon after start still leaves a record of its first step.
                let mut last_write = Instant::now()
                    .checked_sub(RECORD_PERIOD)
                    .unwrap_or_else(Instant::now);
                let (flag, wake) = &*stop2;
                let mut stopping = flag.lock().unwrap_or_else(PoisonError::into_inner);
                while !*stopping {
                    stopping = wake
                        .wait_timeout(stopping, RECORD_TICK)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                    let version = progress.version();
                    if *stopping || version == written || last_write.elapsed() < RECORD_PERIOD {
                        continue;
                    }
                    drop(stopping);
                    board.record_progress(rank, &progress.record().encode());
                    written = version;
                    last_write = Instant::now();
                    stopping = flag.lock().unwrap_or_else(PoisonError::into_inner);
                }
                stopped2.store(true, Ordering::SeqCst);
            })
            .map_err(|e| Error::Comm {
                peer: None,
                message: format!("rank {rank}: cannot start the progress recorder thread: {e}"),
            })?;
        Ok(Recorder {
            stop,
            stopped,
            thread: Some(thread),
        })
    }

    /// Stops the thread. Waits a moment for a write in progress; a write
    /// that is still blocked then (its board may wait for a lock the caller
    /// holds, such as Python's) finishes on its own and the thread ends.
    pub fn stop(&mut self) {
        let (flag, wake) = &*self.stop;
        *flag.lock().unwrap_or_else(PoisonError::into_inner) = true;
        wake.notify_all();
        let start = Instant::now();
        while !self.is_stopped() && start.elapsed() < STOP_GRACE {
            std::thread::sleep(Duration::from_millis(1));
        }
        if let Some(thread) = self.thread.take() {
            if self.is_stopped() {
                let _ = thread.join();
            }
        }
    }

    /// Whether the thread has ended.
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One rank's share of a slow-rank check.
#[derive(Debug, Clone, PartialEq)]
pub struct RankTimes {
    pub rank: usize,
    /// Where it runs: host name, and GPU when it has one.
    pub host: String,
    pub gpu: Option<String>,
    pub times: StepTimes,
}

/// The ranks whose compute time per step is clearly above the median
/// rank's: at least [`SLOW_RATIO`] times it and [`SLOW_MARGIN`] more. The
/// median of an even number of ranks is the lower middle one (with two
/// ranks, the faster one is the reference). One line per slow rank, the
/// slowest first, naming its rank, host, GPU and how much slower it is.
pub fn slow_ranks(ranks: &[RankTimes]) -> Vec<String> {
    let per_step = |t: &StepTimes| {
        (
            t.compute / t.steps.max(1) as f64,
            t.comm / t.steps.max(1) as f64,
        )
    };
    let measured: Vec<&RankTimes> = ranks.iter().filter(|r| r.times.steps > 0).collect();
    if measured.len() < 2 {
        return Vec::new();
    }
    let mut computes: Vec<f64> = measured.iter().map(|r| per_step(&r.times).0).collect();
    computes.sort_by(f64::total_cmp);
    let median = computes[(computes.len() - 1) / 2];
    let mut slow: Vec<(f64, String)> = measured
        .iter()
        .filter_map(|r| {
            let (compute, comm) = per_step(&r.times);
            let clearly =
                compute >= median * SLOW_RATIO && compute - median >= SLOW_MARGIN.as_secs_f64();
            clearly.then(|| {
                let gpu = r
                    .gpu
                    .as_deref()
                    .map_or(String::new(), |g| format!(", GPU {g}"));
                let line =
                    format!(
                    "rank {} (host {}{gpu}) is slower than the median rank: {:.1} ms of compute \
                     per step against {:.1} ms ({:.2}x, +{:.1} ms) over the last {} steps; its \
                     communication took {:.1} ms per step",
                    r.rank,
                    r.host,
                    compute * 1e3,
                    median * 1e3,
                    if median > 0.0 { compute / median } else { f64::INFINITY },
                    (compute - median) * 1e3,
                    r.times.steps,
                    comm * 1e3,
                );
                (compute, line)
            })
        })
        .collect();
    slow.sort_by(|a, b| b.0.total_cmp(&a.0));
    slow.into_iter().map(|(_, line)| line).collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A board that keeps progress records in memory, as the store does
    /// (also the NCCL watchdog's tests' board).
    #[derive(Default)]
    pub(crate) struct MemBoard(Mutex<HashMap<usize, String>>);

    impl FailureBoard for MemBoard {
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
    fn steps_begin_at_bucket_zero_and_records_round_trip() {
        let p = Progress::new();
        assert_eq!(p.record().submitted, None);
        assert_eq!(p.submit(0), Position { step: 1, bucket: 0 });
        assert_eq!(p.submit(1), Position { step: 1, bucket: 1 });
        p.complete();
        assert_eq!(p.submit(0), Position { step: 2, bucket: 0 });
        let r = p.record();
        assert_eq!(
            (r.submitted, r.in_flight),
            (Some(Position { step: 2, bucket: 0 }), 2)
        );
        assert_eq!(Record::decode(&r.encode()), Some(r));
        assert_eq!(Record::decode("garbage"), None);
        // A first collective that is not bucket 0 still opens step 1.
        assert_eq!(Progress::new().submit(7).step, 1);
    }

    #[test]
    fn the_attribution_names_who_had_not_reached_the_bucket() {
        let at = Position { step: 4, bucket: 2 };
        let rec = |step, bucket| {
            Some(
                Record {
                    submitted: Some(Position { step, bucket }),
                    in_flight: 1,
                    unix_ms: 10_000,
                }
                .encode(),
            )
        };
        let text = attribute(at, &[rec(4, 2), rec(3, 5), rec(4, 3), None], 12_500);
        assert!(
            text.contains("had not reached bucket 2 of step 4: rank 1 (last submitted bucket 5 of step 3, 1 unfinished; recorded 2.5s before this error)"),
            "{text}"
        );
        assert!(text.contains("ranks 0, 2 had reached it"), "{text}");
        assert!(text.contains("rank 3 left no record"), "{text}");
    }

    #[test]
    fn a_timeout_is_attributed_from_the_board_and_other_errors_pass() {
        let board = MemBoard::default();
        board.record_progress(1, "v1 2 5 0 0");
        let p = Progress::new();
        p.submit(0);
        p.submit(0);
        let at = p.submit(0);
        let err = Error::CommTimeout {
            peer: 1,
            message: "rank 0: timed out waiting for rank 1".into(),
        };
        let err = attribute_timeout(err, at, &p, &board, 0, 2);
        let text = err.to_string();
        assert!(matches!(err, Error::CommTimeout { peer: 1, .. }));
        assert!(
            text.contains("had not reached bucket 0 of step 3: rank 1"),
            "{text}"
        );
        assert!(text.contains("rank 0 had reached it"), "{text}");
        let other = Error::Comm {
            peer: Some(1),
            message: "closed".into(),
        };
        let text = attribute_timeout(other, at, &p, &board, 0, 2).to_string();
        assert_eq!(text, "closed");
    }

    #[test]
    fn the_recorder_writes_changes_at_a_low_rate() {
        let board = Arc::new(MemBoard::default());
        let p = Arc::new(Progress::new());
        let mut rec = Recorder::start(p.clone(), board.clone(), 3).unwrap();
        assert_eq!(
            board.progress(4)[3].as_deref().map(|t| &t[..8]),
            Some("v1 0 0 0")
        );
        p.submit(0);
        let start = Instant::now();
        while !board.progress(4)[3]
            .as_deref()
            .unwrap()
            .starts_with("v1 1 0 1")
        {
            assert!(start.elapsed() < Duration::from_secs(5), "not recorded");
            std::thread::sleep(Duration::from_millis(20));
        }
        // The next change is written no sooner than a period after the
        // last write (an order of events, which a slow machine cannot break).
        let written = Instant::now();
        p.submit(1);
        while !board.progress(4)[3]
            .as_deref()
            .unwrap()
            .starts_with("v1 1 1 2")
        {
            assert!(written.elapsed() < Duration::from_secs(5), "not recorded");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(written.elapsed() >= RECORD_PERIOD - Duration::from_millis(150));
        rec.stop();
        assert!(rec.is_stopped());
    }

    #[test]
    fn compute_and_communication_times_split_each_step() {
        // Three steps of 20 ms communication then 10 ms compute, on a clock
        // of the test's own: the split is exact, whatever the machine does.
        let p = Progress::new();
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        for step in 0..3 {
            p.submit_at(0, ms(30 * step));
            p.complete_at(ms(30 * step + 20));
        }
        let t = p.take_times_at(ms(90));
        assert_eq!(t.steps, 3);
        assert!((t.comm - 0.060).abs() < 1e-9, "{t:?}");
        assert!((t.compute - 0.030).abs() < 1e-9, "{t:?}");
        // The next window begins at the next step.
        assert_eq!(p.take_times_at(ms(100)), StepTimes::default());
        // Communication still in flight counts up to the call, and on from it.
        p.submit_at(0, ms(100));
        let t = p.take_times_at(ms(110));
        assert_eq!(t.steps, 1);
        assert!(
            (t.comm - 0.010).abs() < 1e-9 && t.compute.abs() < 1e-9,
            "{t:?}"
        );
        p.complete_at(ms(115));
        p.submit_at(0, ms(120));
        let t = p.take_times_at(ms(120));
        assert!((t.comm - 0.005).abs() < 1e-9, "{t:?}");
        assert_eq!(Progress::new().take_times(), StepTimes::default());
    }

    #[test]
    fn a_clearly_slower_rank_is_named_with_its_host_and_gpu() {
        let times = |compute: f64| StepTimes {
            steps: 10,
            compute: compute * 10.0,
            comm: 0.1,
        };
        let ranks = vec![
            RankTimes {
                rank: 0,
                host: "a".into(),
                gpu: None,
                times: times(0.010),
            },
            RankTimes {
                rank: 1,
                host: "b".into(),
                gpu: Some("cuda:1 (H100)".into()),
                times: times(0.050),
            },
            RankTimes {
                rank: 2,
                host: "a".into(),
                gpu: None,
                times: times(0.011),
            },
        ];
        let lines = slow_ranks(&ranks);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].starts_with("rank 1 (host b, GPU cuda:1 (H100))"),
            "{}",
            lines[0]
        );
        assert!(
            lines[0].contains("50.0 ms of compute per step against 11.0 ms"),
            "{}",
            lines[0]
        );
        // Within the ratio or the margin: nobody is named.
        let close = vec![
            ranks[0].clone(),
            RankTimes {
                times: times(0.012),
                ..ranks[2].clone()
            },
        ];
        assert!(slow_ranks(&close).is_empty());
        let tiny = vec![
            RankTimes {
                times: times(0.001),
                ..ranks[0].clone()
            },
            RankTimes {
                times: times(0.004),
                ..ranks[2].clone()
            },
        ];
        assert!(slow_ranks(&tiny).is_empty());
        assert!(slow_ranks(&ranks[..1]).is_empty());
    }
}
