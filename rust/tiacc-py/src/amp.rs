//! The mixed-precision policy's Python face. The shim
//! (`tiacc_training/torch/tiacc_torch_warp.py`) validates the arguments and
//! reads the GradScaler; this class only converts values.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use tiacc_core::amp::{self, AmpPolicy as CorePolicy, Config, Kind, Observation, State, TrendSums};

use crate::errors::ResultExt;

/// The decision state machine of `MixedPrecision_TrainingPolicy`.
#[pyclass(module = "tiacc_training._engine")]
pub struct AmpPolicy {
    inner: CorePolicy,
}

#[pymethods]
impl AmpPolicy {
    #[new]
    #[pyo3(
        signature = (policy, start, end, hold, interval, interval_hold, cooldown),
        text_signature = "(policy: int, start: int, end: Optional[int], hold: Optional[int], \
            interval: int, interval_hold: int, cooldown: int)"
    )]
    fn new(
        policy: i64,
        start: u64,
        end: Option<u64>,
        hold: Option<u64>,
        interval: u64,
        interval_hold: u64,
        cooldown: u64,
    ) -> PyResult<Self> {
        let config = Config {
            kind: Kind::from_number(policy).py()?,
            start,
            end,
            hold,
            interval,
            interval_hold,
            cooldown,
        };
        Ok(AmpPolicy {
            inner: CorePolicy::new(config).py()?,
        })
    }

    /// One decision: true = run the next step under autocast.
    #[pyo3(
        signature = (counter, lr=None, loss=None, scale=None),
        text_signature = "(self, counter: int, lr: Optional[float] = None, \
            loss: Optional[float] = None, scale: Optional[float] = None) -> bool"
    )]
    fn decide(
        &mut self,
        counter: u64,
        lr: Option<f64>,
        loss: Option<f64>,
        scale: Option<f64>,
    ) -> bool {
        self.inner.decide(Observation {
            counter,
            lr,
            loss,
            scale,
        })
    }

    /// str: Why the last decision was what it was.
    #[getter]
    fn last_reason(&self) -> &'static str {
        self.inner.last_reason().as_str()
    }

    /// Optional[str]: What last tripped the scaler guard, or None.
    #[getter]
    fn last_trip(&self) -> Option<&'static str> {
        self.inner.last_trip().map(|t| t.as_str())
    }

    /// bool: True while a guard cool-down runs.
    #[getter]
    fn cooling(&self) -> bool {
        self.inner.cooling()
    }

    /// The parameters as a dict.
    #[pyo3(text_signature = "(self) -> dict[str, Optional[int]]")]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.inner.config();
        let d = PyDict::new(py);
        d.set_item("policy", c.kind.number())?;
        d.set_item("start", c.start)?;
        d.set_item("end", c.end)?;
        d.set_item("hold", c.hold)?;
        d.set_item("interval", c.interval)?;
        d.set_item("interval_hold", c.interval_hold)?;
        d.set_item("cooldown", c.cooldown)?;
        Ok(d)
    }

    /// The state as a flat dict of numbers, lists of numbers or booleans,
    /// strings and None (JSON-serialisable, storable by `torch.save`).
    #[pyo3(text_signature = "(self) -> dict[str, Any]")]
    fn state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.state();
        let d = PyDict::new(py);
        d.set_item("last_counter", s.last_counter)?;
        d.set_item("resets", s.resets)?;
        d.set_item("last_enabled", s.last_enabled)?;
        d.set_item("last_reason", s.last_reason.as_str())?;
        d.set_item("hold_until", s.hold_until)?;
        d.set_item("ref_lr", s.ref_lr)?;
        d.set_item("losses", s.losses)?;
        d.set_item("verdict", s.verdict.map(|v| v.as_str()))?;
        d.set_item("trend_window", s.trend_window)?;
        d.set_item("trend_n", s.trend.n)?;
        d.set_item("trend_sum_x", s.trend.sum_x)?;
        d.set_item("trend_sum_y", s.trend.sum_y)?;
        d.set_item("trend_sum_xx", s.trend.sum_xx)?;
        d.set_item("trend_sum_xy", s.trend.sum_xy)?;
        d.set_item("last_scale", s.last_scale)?;
        d.set_item("peak_scale", s.peak_scale)?;
        d.set_item("overflows", s.overflows)?;
        d.set_item("cool_until", s.cool_until)?;
        d.set_item("cool_level", s.cool_level)?;
        d.set_item("last_cool_end", s.last_cool_end)?;
        d.set_item("trips", s.trips)?;
        d.set_item("last_trip", s.last_trip.map(|t| t.as_str()))?;
        Ok(d)
    }

    /// Replaces the state with one from `state()` (same parameters).
    #[pyo3(text_signature = "(self, state: dict[str, Any]) -> None")]
    fn load_state(&mut self, state: &Bound<'_, PyDict>) -> PyResult<()> {
        macro_rules! field {
            ($key:literal, $ty:ty) => {{
                let item = state.get_item($key)?.ok_or_else(|| {
                    PyValueError::new_err(concat!("policy state is missing ", stringify!($key)))
                })?;
                item.extract::<$ty>().map_err(|e| {
                    let e: PyErr = e.into();
                    PyTypeError::new_err(format!("policy state field {:?}: {e}", $key))
                })?
            }};
        }
        let last_reason: String = field!("last_reason", String);
        let verdict: Option<String> = field!("verdict", Option<String>);
        let last_trip: Option<String> = field!("last_trip", Option<String>);
        let s = State {
            last_counter: field!("last_counter", Option<u64>),
            resets: field!("resets", u64),
            last_enabled: field!("last_enabled", bool),
            last_reason: amp::Reason::parse(&last_reason).py()?,
            hold_until: field!("hold_until", Option<u64>),
            ref_lr: field!("ref_lr", Option<f64>),
            losses: field!("losses", Vec<f64>),
            verdict: verdict.map(|v| amp::Verdict::parse(&v)).transpose().py()?,
            trend_window: field!("trend_window", Option<u64>),
            trend: TrendSums {
                n: field!("trend_n", u64),
                sum_x: field!("trend_sum_x", f64),
                sum_y: field!("trend_sum_y", f64),
                sum_xx: field!("trend_sum_xx", f64),
                sum_xy: field!("trend_sum_xy", f64),
            },
            last_scale: field!("last_scale", Option<f64>),
            peak_scale: field!("peak_scale", Option<f64>),
            overflows: field!("overflows", Vec<bool>),
            cool_until: field!("cool_until", Option<u64>),
            cool_level: field!("cool_level", u32),
            last_cool_end: field!("last_cool_end", Option<u64>),
            trips: field!("trips", u64),
            last_trip: last_trip.map(|t| amp::Trip::parse(&t)).transpose().py()?,
        };
        self.inner = CorePolicy::from_state(self.inner.config().clone(), s).py()?;
        Ok(())
    }
}

/// The fixed thresholds of the policy, by name.
#[pyfunction]
#[pyo3(text_signature = "() -> dict[str, Union[int, float]]")]
pub fn amp_constants(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("LR_TOLERANCE", amp::LR_TOLERANCE)?;
    d.set_item("LOSS_WINDOW", amp::LOSS_WINDOW)?;
    d.set_item("LOSS_MIN_SAMPLES", amp::LOSS_MIN_SAMPLES)?;
    d.set_item("LOSS_SIGMAS", amp::LOSS_SIGMAS)?;
    d.set_item("LOSS_REL_FLOOR", amp::LOSS_REL_FLOOR)?;
    d.set_item("TREND_MIN_POINTS", amp::TREND_MIN_POINTS)?;
    d.set_item("TREND_FAST", amp::TREND_FAST)?;
    d.set_item("TREND_SLOW", amp::TREND_SLOW)?;
    d.set_item("SCALE_FLOOR", amp::SCALE_FLOOR)?;
    d.set_item("SCALE_COLLAPSE", amp::SCALE_COLLAPSE)?;
    d.set_item("OVERFLOW_WINDOW", amp::OVERFLOW_WINDOW)?;
    d.set_item("OVERFLOW_LIMIT", amp::OVERFLOW_LIMIT)?;
    d.set_item("MAX_BACKOFF", amp::MAX_BACKOFF)?;
    Ok(d)
}
