//! The engine's timeline: `TIACC_TRAINING_TIMELINE=<path>` writes every
//! bucket's life on this rank as a Chrome trace (open it in
//! `chrome://tracing` or <https://ui.perfetto.dev>).
//!
//! Each rank writes its own file, `<path>.rank<N>.json` (or `<path>` with
//! `{rank}` replaced, when the value holds it). Events are complete events
//! (`"ph": "X"`) in microseconds since the Unix epoch, so the files of the
//! ranks of one host line up when merged; `pid` is the rank, `tid` the
//! thread, named by metadata events:
//!
//! - `queued` (from DDP handing the bucket over to its channel taking it)
//!   and `bucket` (the whole allreduce) on the channel thread; torch's
//!   other collectives on the engine are `queued collective` and
//!   `collective`;
//! - inside a bucket, one event per step: `reduce-scatter`, `allgather`,
//!   `allreduce` (`args.group`: world, intra-node or inter-node),
//!   `encode`/`decode` (the casts of compression), `divide`, `NaN check`,
//!   `agree` (the bucket's header checked across the group: it lasts until
//!   the last rank of the group has handed the bucket over) and `link turn`
//!   (waiting for the other channels to leave the link between nodes);
//! - the inter-node step of a pipelined 2D allreduce on its own thread
//!   (`<channel> inter-node`), one event per chunk (`args.chunk`): that
//!   row is the link between nodes, busy or idle.
//!
//! Off (the default) it costs one relaxed load per step. On, an event is
//! formatted and appended under a lock; the file is flushed at least every
//! [`FLUSH_INTERVAL`] and when an engine shuts down, and after every flush
//! it is a complete JSON array.

use std::cell::Cell;
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The variable naming the timeline's file.
pub use crate::config::TIMELINE as TIMELINE_VAR;

/// Longest time events wait in memory before they reach the file.
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(500);

/// The file a rank writes for the value `value` of [`TIMELINE_VAR`].
pub fn path_for(value: &str, rank: usize) -> String {
    if value.contains("{rank}") {
        value.replace("{rank}", &rank.to_string())
    } else {
        format!("{value}.rank{rank}.json")
    }
}

struct Writer {
    out: BufWriter<File>,
    rank: usize,
    /// Thread names and their trace ids, in order of first event.
    threads: HashMap<String, u64>,
    last_flush: Instant,
    /// Whether the file's array ends with `]` that the next event overwrites.
    closed: bool,
}

struct Timeline {
    /// Whether the variable was set: events are recorded from the first
    /// engine on.
    wanted: Option<String>,
    /// The process's clock origin: an `Instant` and the Unix time it was.
    origin: Instant,
    origin_us: f64,
    writer: Mutex<Option<Writer>>,
}

/// Whether events are recorded: set once the file is open (a file that
/// cannot be opened leaves it off).
static ON: AtomicBool = AtomicBool::new(false);

fn timeline() -> &'static Timeline {
    static TIMELINE: OnceLock<Timeline> = OnceLock::new();
    TIMELINE.get_or_init(|| {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Timeline {
            wanted: std::env::var(TIMELINE_VAR)
                .ok()
                .filter(|v| !v.trim().is_empty()),
            origin: Instant::now(),
            origin_us: now.as_secs_f64() * 1e6,
            writer: Mutex::new(None),
        }
    })
}

/// Opens this process's timeline file for `rank`, if the variable asks for
/// one and none is open yet (the first engine of the process names the
/// file: called where an engine starts). A file that cannot be created is
/// reported on stderr once and the timeline stays off: tracing never fails
/// a job.
pub fn start(rank: usize) {
    let t = timeline();
    let Some(value) = &t.wanted else {
        return;
    };
    let mut writer = t.writer.lock().unwrap_or_else(PoisonError::into_inner);
    if writer.is_some() {
        return;
    }
    let path = path_for(value, rank);
    match Writer::create(&path, rank) {
        Ok(w) => {
            *writer = Some(w);
            ON.store(true, Ordering::Release);
        }
        Err(e) => eprintln!("tiacc-training: {TIMELINE_VAR}: cannot write {path}: {e}"),
    }
}

/// Whether events are being recorded.
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Writes what is buffered and ends the array (the file is then valid JSON).
pub fn flush() {
    if !enabled() {
        return;
    }
    let mut writer = timeline()
        .writer
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(w) = writer.as_mut() {
        w.flush();
    }
}

impl Writer {
    /// Creates `path` and writes the array's start and the process's name.
    fn create(path: &str, rank: usize) -> std::io::Result<Self> {
        let mut out = BufWriter::new(File::create(path)?);
        write!(
            out,
            "[\n{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{rank},\"tid\":0,\
             \"args\":{{\"name\":\"rank {rank}\"}}}}"
        )?;
        Ok(Writer {
            out,
            rank,
            threads: HashMap::new(),
            last_flush: Instant::now(),
            closed: false,
        })
    }

    fn flush(&mut self) {
        self.last_flush = Instant::now();
        if self.closed {
            let _ = self.out.flush();
            return;
        }
        let done = self
            .out
            .write_all(b"\n]\n")
            .and_then(|()| self.out.flush())
            .and_then(|()| self.out.seek(SeekFrom::Current(-3)).map(drop));
        self.closed = done.is_ok();
    }

    fn thread_id(&mut self) -> u64 {
        let thread = std::thread::current();
        let name = thread
            .name()
            .map_or_else(|| format!("{:?}", thread.id()), str::to_string);
        if let Some(&id) = self.threads.get(&name) {
            return id;
        }
        let id = self.threads.len() as u64 + 1;
        let line = format!(
            ",\n{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":{},\"tid\":{id},\
             \"args\":{{\"name\":\"{}\"}}}}",
            self.rank,
            escape(&name)
        );
        self.write(&line);
        self.threads.insert(name, id);
        id
    }

    /// Appends one complete event of the calling thread (`args`: the
    /// fields of its `args` object), flushing when the last flush is
    /// [`FLUSH_INTERVAL`] old.
    fn event(&mut self, name: &str, ts_us: f64, dur_us: f64, args: &str) {
        let tid = self.thread_id();
        let line = format!(
            ",\n{{\"name\":\"{name}\",\"cat\":\"tiacc\",\"ph\":\"X\",\"ts\":{ts_us:.3},\
             \"dur\":{dur_us:.3},\"pid\":{},\"tid\":{tid},\"args\":{{{args}}}}}",
            self.rank
        );
        self.write(&line);
        if self.last_flush.elapsed() >= FLUSH_INTERVAL {
            self.flush();
        }
    }

    fn write(&mut self, line: &str) {
        // After a flush the array's end sits where this line goes: the
        // seek back left it to be overwritten.
        self.closed = false;
        let _ = self.out.write_all(line.as_bytes());
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

/// What an event adds to its name (`args`): the bucket, the bytes, the
/// group and the chunk, where known.
#[derive(Debug, Clone, Copy, Default)]
pub struct Args {
    pub bytes: Option<u64>,
    pub group: Option<&'static str>,
    pub chunk: Option<usize>,
}

fn record(name: &'static str, start: Instant, end: Instant, args: Args) {
    let t = timeline();
    let ts = t.origin_us + start.saturating_duration_since(t.origin).as_secs_f64() * 1e6;
    let dur = end.saturating_duration_since(start).as_secs_f64() * 1e6;
    let mut fields = Vec::with_capacity(4);
    if let Some(bucket) = BUCKET.with(Cell::get) {
        fields.push(format!("\"bucket\":{bucket}"));
    }
    if let Some(bytes) = args.bytes {
        fields.push(format!("\"bytes\":{bytes}"));
    }
    if let Some(group) = args.group {
        fields.push(format!("\"group\":\"{group}\""));
    }
    if let Some(chunk) = args.chunk {
        fields.push(format!("\"chunk\":{chunk}"));
    }
    let mut writer = t.writer.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(w) = writer.as_mut() {
        w.event(name, ts, dur, &fields.join(","));
    }
}

thread_local! {
    /// The bucket this thread works on, for the events it records.
    static BUCKET: Cell<Option<u64>> = const { Cell::new(None) };
}

/// The bucket the calling thread works on (see [`on_bucket`]).
pub fn current_bucket() -> Option<u64> {
    BUCKET.with(Cell::get)
}

/// Marks the calling thread as working on `bucket` until the guard drops.
pub fn on_bucket(bucket: Option<u64>) -> BucketGuard {
    let before = BUCKET.with(|b| b.replace(bucket));
    BucketGuard { before }
}

/// Restores the thread's previous bucket when dropped.
pub struct BucketGuard {
    before: Option<u64>,
}

impl Drop for BucketGuard {
    fn drop(&mut self) {
        BUCKET.with(|b| b.set(self.before));
    }
}

/// One timed step; recorded when dropped, if the timeline is on.
#[must_use = "a span records when it is dropped"]
pub struct Span {
    name: &'static str,
    start: Option<Instant>,
    args: Args,
}

/// Starts a span named `name` with `args`.
pub fn span(name: &'static str, args: Args) -> Span {
    Span {
        name,
        start: enabled().then(Instant::now),
        args,
    }
}

/// Records an event that started at `start` and ends now (a bucket's time
/// in its channel's queue).
pub fn since(name: &'static str, start: Instant, args: Args) {
    if enabled() {
        record(name, start, Instant::now(), args);
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some(start) = self.start {
            record(self.name, start, Instant::now(), self.args);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_gets_its_own_file() {
        assert_eq!(path_for("/tmp/tl", 3), "/tmp/tl.rank3.json");
        assert_eq!(path_for("/tmp/tl-{rank}.json", 0), "/tmp/tl-0.json");
    }

    #[test]
    fn the_file_is_a_json_array_after_every_flush() {
        let path = std::env::temp_dir().join(format!("tiacc-timeline-{}.json", std::process::id()));
        let path = path.to_string_lossy().into_owned();
        let mut w = Writer::create(&path, 2).unwrap();
        w.event("bucket", 10.0, 5.5, "\"bucket\":0");
        w.flush();
        let first = std::fs::read_to_string(&path).unwrap();
        assert!(
            first.starts_with("[\n{") && first.ends_with("}\n]\n"),
            "{first}"
        );
        w.event("allreduce", 12.0, 1.0, "\"group\":\"world\"");
        w.flush();
        w.flush();
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        assert!(text.ends_with("}\n]\n"), "{text}");
        assert_eq!(text.matches("\"ph\":\"X\"").count(), 2, "{text}");
        assert_eq!(text.matches(']').count(), 1, "{text}");
        // One thread name, written once, before its first event.
        assert_eq!(text.matches("thread_name").count(), 1, "{text}");
        assert!(text.contains("\"dur\":5.500,\"pid\":2"), "{text}");
    }

    #[test]
    fn thread_names_are_escaped() {
        assert_eq!(escape(r#"a"b\c"#), r#"a\"b\\c"#);
    }
}
