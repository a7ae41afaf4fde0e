//! The adaptive mixed-precision policy: a small state machine that answers,
//! once per call with the caller's counter (step or epoch), whether the next
//! forward pass should run under autocast.
//!
//! Every duration below is in units of the caller's counter.
//!
//! **Policy 0 (time).** On iff `start <= counter < end` (`end` exclusive;
//! no `end` means on forever from `start`).
//!
//! **Policy 1 (time + learning rate).** As policy 0, but an *event* forces
//! fp32 for `hold` counter units: off iff `counter < hold_until`, where an
//! event at counter `e` sets `hold_until = max(hold_until, e + hold)`.
//! Events are watched on every call, inside the time window or not:
//! - learning-rate change: `|lr - ref| > LR_TOLERANCE * max(|lr|, |ref|)`
//!   where `ref` is the first learning rate seen, then the learning rate at
//!   the last lr event (so a step decay fires once; a per-step schedule
//!   fires once per 10 % of cumulative change);
//! - abnormal loss: with at least `LOSS_MIN_SAMPLES` of the last
//!   `LOSS_WINDOW` finite losses recorded, the new loss is abnormal iff
//!   `|loss - mean| > max(LOSS_SIGMAS * std, LOSS_REL_FLOOR * |mean|)`
//!   (population deviation of the window, computed before the new loss
//!   joins it; the new loss joins it either way).
//!
//! **Policy 2 (loss trend).** Measurement windows are
//! `[k*interval, k*interval + interval_hold)` for `k >= 1`; inside one the
//! answer is on (a trial). The losses passed at counters in
//! `(k*interval, k*interval + interval_hold]` (the loss argument is the
//! previous step's loss, so these are the losses of the trial's steps) are
//! fitted with a least-squares line; at the first call with
//! `counter >= k*interval + interval_hold` the relative drop over the window,
//! `r = -slope * interval_hold / max(|mean loss|, 1e-12)`, decides until the
//! next window: too fast (`r > TREND_FAST`) or too slow (`r < TREND_SLOW`)
//! turns mixed precision off, otherwise on. Fewer than `TREND_MIN_POINTS`
//! points keep the previous verdict. Before the first verdict it is on.
//!
//! **Scaler guard (all policies).** Unless `cooldown == 0`, a *trip* turns
//! mixed precision off for a cool-down of `cooldown << level` counter units
//! (`[e, e + len)`), whatever the policy says. Trips: a non-finite loss; a
//! non-finite scale or one below `SCALE_FLOOR`; a scale at least
//! `SCALE_COLLAPSE` times below the highest scale seen since the guard was
//! last armed; `OVERFLOW_LIMIT` scale decreases (each means an overflowed,
//! skipped step) within the last `OVERFLOW_WINDOW` calls. `level` is 0,
//! or the previous level + 1 (at most `MAX_BACKOFF`) when the trip comes
//! less than one previous cool-down length after the previous cool-down
//! ended. Scale observations continue during a cool-down; when it ends the
//! guard re-arms (peak = current scale, overflow history cleared).
//!
//! **Counter going backwards.** Treated as a restart: all state is reset
//! as if freshly built (the reset count is kept), then the call proceeds.
//! Resuming a run goes through [`AmpPolicy::state`] / [`AmpPolicy::from_state`].

mod stats;

use crate::error::{Error, Result};
use stats::LossWindow;
pub use stats::TrendSums;

/// Relative learning-rate change that counts as a change (policy 1).
pub const LR_TOLERANCE: f64 = 0.1;
/// Recent losses kept for the fluctuation test (policy 1).
pub const LOSS_WINDOW: usize = 20;
/// Losses needed before a loss can be judged abnormal (policy 1).
pub const LOSS_MIN_SAMPLES: usize = 5;
/// Deviations from the mean that make a loss abnormal (policy 1).
pub const LOSS_SIGMAS: f64 = 4.0;
/// Smallest abnormal deviation, relative to the mean (policy 1).
pub const LOSS_REL_FLOOR: f64 = 0.02;
/// Points needed for a trend verdict (policy 2).
pub const TREND_MIN_POINTS: u64 = 3;
/// Relative drop per window above which the loss falls too fast (policy 2).
pub const TREND_FAST: f64 = 0.5;
/// Relative drop per window below which the loss falls too slowly (policy 2).
pub const TREND_SLOW: f64 = 0.01;
/// A loss scale below this trips the guard.
pub const SCALE_FLOOR: f64 = 1.0;
/// A fall by this factor from the peak scale trips the guard.
pub const SCALE_COLLAPSE: f64 = 1024.0;
/// Calls over which scale decreases are counted.
pub const OVERFLOW_WINDOW: usize = 32;
/// Scale decreases within the window that trip the guard.
pub const OVERFLOW_LIMIT: usize = 6;
/// Most doublings of the cool-down.
pub const MAX_BACKOFF: u32 = 4;

/// Which rule decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// 0: a time window.
    Time,
    /// 1: a time window plus holds on learning-rate changes and loss spikes.
    TimeLr,
    /// 2: periodic trials judged by the loss trend.
    Loss,
}

impl Kind {
    /// The policy number of the TI-ACC documents.
    pub fn number(self) -> u8 {
        match self {
            Kind::Time => 0,
            Kind::TimeLr => 1,
            Kind::Loss => 2,
        }
    }

    /// Parses a policy number.
    pub fn from_number(n: i64) -> Result<Self> {
        match n {
            0 => Ok(Kind::Time),
            1 => Ok(Kind::TimeLr),
            2 => Ok(Kind::Loss),
            _ => Err(Error::InvalidArgument(format!(
                "policy must be 0 (time), 1 (time + learning rate) or 2 (loss), got {n}"
            ))),
        }
    }
}

/// The policy's parameters (durations in counter units).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub kind: Kind,
    /// First counter of the time window (policies 0 and 1).
    pub start: u64,
    /// First counter after the time window; None = no end.
    pub end: Option<u64>,
    /// Length of a hold (policy 1; required there).
    pub hold: Option<u64>,
    /// Period of the measurement windows (policy 2).
    pub interval: u64,
    /// Length of a measurement window (policy 2).
    pub interval_hold: u64,
    /// Base cool-down of the scaler guard; 0 disables the guard.
    pub cooldown: u64,
}

impl Config {
    /// Checks the parameters the policy needs.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if let Some(end) = self.end {
            if matches!(self.kind, Kind::Time | Kind::TimeLr) && end <= self.start {
                return bad(format!(
                    "end_time ({end}) must be greater than start_time ({})",
                    self.start
                ));
            }
        }
        match self.kind {
            Kind::Time => {}
            Kind::TimeLr => match self.hold {
                None => return bad("policy 1 requires hold_time (hold_step)".into()),
                Some(0) => return bad("hold_time must be at least 1".into()),
                Some(_) => {}
            },
            Kind::Loss => {
                if self.interval == 0 {
                    return bad("interval_time must be at least 1".into());
                }
                if self.interval_hold == 0 || self.interval_hold >= self.interval {
                    return bad(format!(
                        "interval_hold_time ({}) must be at least 1 and less than interval_time ({})",
                        self.interval_hold, self.interval
                    ));
                }
            }
        }
        Ok(())
    }
}

/// What the caller tells the policy on one call.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Observation {
    pub counter: u64,
    pub lr: Option<f64>,
    pub loss: Option<f64>,
    /// The GradScaler's scale; None without an enabled scaler.
    pub scale: Option<f64>,
}

/// Why the last answer was what it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// No call yet.
    None,
    BeforeStart,
    InWindow,
    AfterEnd,
    Hold,
    Trial,
    TrendDefault,
    TrendOk,
    TrendFast,
    TrendSlow,
    Cooldown,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::None => "none",
            Reason::BeforeStart => "before_start",
            Reason::InWindow => "window",
            Reason::AfterEnd => "after_end",
            Reason::Hold => "hold",
            Reason::Trial => "trial",
            Reason::TrendDefault => "trend_default",
            Reason::TrendOk => "trend_ok",
            Reason::TrendFast => "trend_fast",
            Reason::TrendSlow => "trend_slow",
            Reason::Cooldown => "cooldown",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        [
            Reason::None,
            Reason::BeforeStart,
            Reason::InWindow,
            Reason::AfterEnd,
            Reason::Hold,
            Reason::Trial,
            Reason::TrendDefault,
            Reason::TrendOk,
            Reason::TrendFast,
            Reason::TrendSlow,
            Reason::Cooldown,
        ]
        .into_iter()
        .find(|r| r.as_str() == s)
        .ok_or_else(|| Error::InvalidArgument(format!("unknown decision reason {s:?}")))
    }
}

/// What tripped the scaler guard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trip {
    NonFiniteLoss,
    NonFiniteScale,
    ScaleFloor,
    ScaleCollapse,
    Overflow,
}

impl Trip {
    pub fn as_str(self) -> &'static str {
        match self {
            Trip::NonFiniteLoss => "nonfinite_loss",
            Trip::NonFiniteScale => "nonfinite_scale",
            Trip::ScaleFloor => "scale_floor",
            Trip::ScaleCollapse => "scale_collapse",
            Trip::Overflow => "overflow",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        [
            Trip::NonFiniteLoss,
            Trip::NonFiniteScale,
            Trip::ScaleFloor,
            Trip::ScaleCollapse,
            Trip::Overflow,
        ]
        .into_iter()
        .find(|t| t.as_str() == s)
        .ok_or_else(|| Error::InvalidArgument(format!("unknown guard trip {s:?}")))
    }
}

/// Policy 2's verdict from the last finished measurement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Ok,
    Fast,
    Slow,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Fast => "fast",
            Verdict::Slow => "slow",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "ok" => Ok(Verdict::Ok),
            "fast" => Ok(Verdict::Fast),
            "slow" => Ok(Verdict::Slow),
            _ => Err(Error::InvalidArgument(format!(
                "unknown trend verdict {s:?}"
            ))),
        }
    }
}

/// Everything the policy remembers, as plain values, so that a resumed run
/// decides exactly as an uninterrupted one.
#[derive(Debug, Clone, PartialEq)]
pub struct State {
    pub last_counter: Option<u64>,
    pub resets: u64,
    pub last_enabled: bool,
    pub last_reason: Reason,
    // Policy 1.
    pub hold_until: Option<u64>,
    pub ref_lr: Option<f64>,
    pub losses: Vec<f64>,
    // Policy 2.
    pub verdict: Option<Verdict>,
    pub trend_window: Option<u64>,
    pub trend: TrendSums,
    // Guard.
    pub last_scale: Option<f64>,
    pub peak_scale: Option<f64>,
    pub overflows: Vec<bool>,
    pub cool_until: Option<u64>,
    pub cool_level: u32,
    pub last_cool_end: Option<u64>,
    pub trips: u64,
    pub last_trip: Option<Trip>,
}

impl Default for State {
    fn default() -> Self {
        State {
            last_counter: None,
            resets: 0,
            last_enabled: false,
            last_reason: Reason::None,
            hold_until: None,
            ref_lr: None,
            losses: Vec::new(),
            verdict: None,
            trend_window: None,
            trend: TrendSums::default(),
            last_scale: None,
            peak_scale: None,
            overflows: Vec::new(),
            cool_until: None,
            cool_level: 0,
            last_cool_end: None,
            trips: 0,
            last_trip: None,
        }
    }
}

impl State {
    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(format!("invalid policy state: {m}")));
        if self.losses.len() > LOSS_WINDOW || self.losses.iter().any(|v| !v.is_finite()) {
            return bad(format!(
                "losses must be at most {LOSS_WINDOW} finite numbers"
            ));
        }
        if self.overflows.len() > OVERFLOW_WINDOW {
            return bad(format!(
                "overflows must hold at most {OVERFLOW_WINDOW} entries"
            ));
        }
        if self.cool_level > MAX_BACKOFF {
            return bad(format!("cool_level must be at most {MAX_BACKOFF}"));
        }
        if !self.trend.is_finite() {
            return bad("trend sums must be finite".into());
        }
        let finite = |v: Option<f64>| v.is_none_or(|x| x.is_finite());
        if !finite(self.ref_lr) || !finite(self.last_scale) || !finite(self.peak_scale) {
            return bad("ref_lr, last_scale and peak_scale must be finite or None".into());
        }
        Ok(())
    }
}

/// The state machine.
#[derive(Debug, Clone)]
pub struct AmpPolicy {
    config: Config,
    state: State,
    losses: LossWindow,
}

impl AmpPolicy {
    /// A fresh policy; fails when `config` lacks what its policy needs.
    pub fn new(config: Config) -> Result<Self> {
        config.validate()?;
        Ok(AmpPolicy {
            config,
            state: State::default(),
            losses: LossWindow::default(),
        })
    }

    /// A policy that continues from `state` (from [`AmpPolicy::state`]).
    pub fn from_state(config: Config, state: State) -> Result<Self> {
        config.validate()?;
        state.validate()?;
        let losses = LossWindow::from_values(state.losses.clone());
        Ok(AmpPolicy {
            config,
            state,
            losses,
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// A snapshot of the state.
    pub fn state(&self) -> State {
        let mut s = self.state.clone();
        s.losses = self.losses.values();
        s
    }

    pub fn last_reason(&self) -> Reason {
        self.state.last_reason
    }

    pub fn last_trip(&self) -> Option<Trip> {
        self.state.last_trip
    }

    /// True while a guard cool-down is running.
    pub fn cooling(&self) -> bool {
        self.state.cool_until.is_some()
    }

    /// Answers one call: true = run the next step under autocast.
    pub fn decide(&mut self, obs: Observation) -> bool {
        if self
            .state
            .last_counter
            .is_some_and(|last| obs.counter < last)
        {
            let resets = self.state.resets + 1;
            self.state = State {
                resets,
                ..State::default()
            };
            self.losses = LossWindow::default();
        }
        self.state.last_counter = Some(obs.counter);
        let cooling = self.guard(&obs);
        let (enabled, reason) = match self.config.kind {
            Kind::Time => self.window(obs.counter),
            Kind::TimeLr => {
                self.watch_events(&obs);
                if self.state.hold_until.is_some_and(|u| obs.counter < u) {
                    (false, Reason::Hold)
                } else {
                    self.window(obs.counter)
                }
            }
            Kind::Loss => self.trend(&obs),
        };
        let (enabled, reason) = if cooling {
            (false, Reason::Cooldown)
        } else {
            (enabled, reason)
        };
        self.state.last_enabled = enabled;
        self.state.last_reason = reason;
        enabled
    }

    fn window(&self, counter: u64) -> (bool, Reason) {
        if counter < self.config.start {
            (false, Reason::BeforeStart)
        } else if self.config.end.is_some_and(|end| counter >= end) {
            (false, Reason::AfterEnd)
        } else {
            (true, Reason::InWindow)
        }
    }

    /// Policy 1's events: a learning-rate change or an abnormal loss.
    fn watch_events(&mut self, obs: &Observation) {
        let mut event = false;
        if let Some(lr) = obs.lr.filter(|v| v.is_finite()) {
            match self.state.ref_lr {
                None => self.state.ref_lr = Some(lr),
                Some(r) => {
                    if (lr - r).abs() > LR_TOLERANCE * lr.abs().max(r.abs()) {
                        self.state.ref_lr = Some(lr);
                        event = true;
                    }
                }
            }
        }
        if let Some(loss) = obs.loss.filter(|v| v.is_finite()) {
            if self.losses.len() >= LOSS_MIN_SAMPLES {
                if let Some((mean, std)) = self.losses.mean_std() {
                    let limit = (LOSS_SIGMAS * std).max(LOSS_REL_FLOOR * mean.abs());
                    if (loss - mean).abs() > limit {
                        event = true;
                    }
                }
            }
            self.losses.push(loss, LOSS_WINDOW);
        }
        if event {
            let hold = self.config.hold.unwrap_or(1);
            let until = obs.counter.saturating_add(hold);
            self.state.hold_until = Some(self.state.hold_until.map_or(until, |u| u.max(until)));
        }
    }

    /// Policy 2: trials and trend verdicts.
    fn trend(&mut self, obs: &Observation) -> (bool, Reason) {
        let (interval, len) = (self.config.interval, self.config.interval_hold);
        let counter = obs.counter;
        if let Some(k) = self.state.trend_window {
            let start = k.saturating_mul(interval);
            let end = start.saturating_add(len);
            if counter > start && counter <= end {
                if let Some(loss) = obs.loss.filter(|v| v.is_finite()) {
                    self.state.trend.push((counter - start) as f64, loss);
                }
            }
            if counter >= end {
                if let Some((slope, mean)) = self.state.trend.fit(TREND_MIN_POINTS) {
                    let drop = -slope * len as f64 / mean.abs().max(1e-12);
                    if drop.is_finite() {
                        self.state.verdict = Some(if drop > TREND_FAST {
                            Verdict::Fast
                        } else if drop < TREND_SLOW {
                            Verdict::Slow
                        } else {
                            Verdict::Ok
                        });
                    }
                }
                self.state.trend_window = None;
                self.state.trend = TrendSums::default();
            }
        }
        let k = counter / interval;
        let in_window = k >= 1 && counter - k * interval < len;
        if in_window {
            if self.state.trend_window != Some(k) {
                self.state.trend_window = Some(k);
                self.state.trend = TrendSums::default();
            }
            return (true, Reason::Trial);
        }
        match self.state.verdict {
            None => (true, Reason::TrendDefault),
            Some(Verdict::Ok) => (true, Reason::TrendOk),
            Some(Verdict::Fast) => (false, Reason::TrendFast),
            Some(Verdict::Slow) => (false, Reason::TrendSlow),
        }
    }

    /// The scaler guard; returns true while cooling down.
    fn guard(&mut self, obs: &Observation) -> bool {
        if self.config.cooldown == 0 {
            return false;
        }
        let st = &mut self.state;
        let scale = obs.scale;
        let decreased = matches!((st.last_scale, scale), (Some(l), Some(s)) if s < l);
        st.last_scale = scale.filter(|s| s.is_finite());
        if let Some(until) = st.cool_until {
            if obs.counter < until {
                return true;
            }
            // The cool-down is over: re-arm.
            st.cool_until = None;
            st.last_cool_end = Some(until);
            st.overflows.clear();
            st.peak_scale = st.last_scale;
        }
        let mut trip = None;
        if obs.loss.is_some_and(|l| !l.is_finite()) {
            trip = Some(Trip::NonFiniteLoss);
        }
        match scale {
            None => {
                st.overflows.clear();
                st.peak_scale = None;
            }
            Some(s) if !s.is_finite() => {
                trip = trip.or(Some(Trip::NonFiniteScale));
            }
            Some(s) => {
                st.overflows.push(decreased);
                if st.overflows.len() > OVERFLOW_WINDOW {
                    st.overflows.remove(0);
                }
                let peak = st.peak_scale.map_or(s, |p| p.max(s));
                st.peak_scale = Some(peak);
                if s < SCALE_FLOOR {
                    trip = trip.or(Some(Trip::ScaleFloor));
                } else if s * SCALE_COLLAPSE <= peak {
                    trip = trip.or(Some(Trip::ScaleCollapse));
                } else if st.overflows.iter().filter(|d| **d).count() >= OVERFLOW_LIMIT {
                    trip = trip.or(Some(Trip::Overflow));
                }
            }
        }
        let Some(trip) = trip else {
            return false;
        };
        let base = self.config.cooldown;
        let previous_len = base.saturating_mul(1 << st.cool_level);
        st.cool_level = match st.last_cool_end {
            Some(end) if obs.counter < end.saturating_add(previous_len) => {
                (st.cool_level + 1).min(MAX_BACKOFF)
            }
            _ => 0,
        };
        st.cool_until = Some(
            obs.counter
                .saturating_add(base.saturating_mul(1 << st.cool_level)),
        );
        st.trips += 1;
        st.last_trip = Some(trip);
        st.overflows.clear();
        st.peak_scale = st.last_scale;
        true
    }
}

#[cfg(test)]
mod tests;
