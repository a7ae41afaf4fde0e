//! A trace of the NCCL path's waits on stderr, for diagnosing a hang on a
//! GPU node where no debugger runs: `TIACC_TRAINING_NCCL_TRACE=1` prints a
//! line when a call enters and leaves NCCL, when a call waits on
//! `ncclInProgress`, when the watchdog takes a collective, sees another
//! rank's failure or its deadline, and around every abort. Off by default
//! (read once); each line names the thread, so interleaved threads of one
//! rank stay apart.

use std::sync::OnceLock;
use std::time::Instant;

/// The variable that turns the trace on (`1`, `true`, `yes`, `on`).
pub use crate::config::NCCL_TRACE as TRACE_VAR;

struct Trace {
    on: bool,
    start: Instant,
}

fn trace() -> &'static Trace {
    static TRACE: OnceLock<Trace> = OnceLock::new();
    TRACE.get_or_init(|| Trace {
        on: std::env::var(TRACE_VAR).is_ok_and(|v| is_on(&v)),
        start: Instant::now(),
    })
}

/// Whether a value of [`TRACE_VAR`] turns the trace on.
pub fn is_on(value: &str) -> bool {
    matches!(
        value.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "yes" | "on"
    )
}

/// Whether the trace is on in this process.
pub fn enabled() -> bool {
    trace().on
}

/// Prints one trace line (seconds since the first, the thread, `what`)
/// when the trace is on; `what` is only built then.
pub fn note(what: impl FnOnce() -> String) {
    let t = trace();
    if !t.on {
        return;
    }
    let thread = std::thread::current();
    let name = thread
        .name()
        .map_or_else(|| format!("{:?}", thread.id()), str::to_string);
    eprintln!(
        "tiacc_training nccl trace {:.3}s [{name}]: {}",
        t.start.elapsed().as_secs_f64(),
        what()
    );
}

#[cfg(test)]
mod tests {
    use super::is_on;

    #[test]
    fn the_trace_is_on_only_for_a_yes() {
        for value in ["1", "true", " Yes ", "ON"] {
            assert!(is_on(value), "{value}");
        }
        for value in ["", "0", "false", "no", "off", "2"] {
            assert!(!is_on(value), "{value}");
        }
    }
}
