//! An engine's state across steps (`tiacc_core::comm::state::EngineState`)
//! as a Python dict, both ways (`CommEngine.state()` / `load_state()`, and
//! `DeviceEngine`'s):
//!
//! ```text
//! {"rank": int, "world_size": int, "settings": {name: str},
//!  "buckets": {index: {"steps": int, "residual": bytes | None,
//!                      "velocity": bytes | None, "previous_sum": bytes | None}}}
//! ```
//!
//! Buffers are float32 in the machine's byte order. A dict that is not of
//! this shape is a `ValueError` naming the key; whether a well-formed state
//! fits an engine is the engine's check.

use std::collections::BTreeMap;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyDict};

use tiacc_core::comm::{BucketState, EngineState};

/// `state` as the dict of the module docs.
pub(crate) fn to_dict<'py>(py: Python<'py>, state: &EngineState) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("rank", state.rank)?;
    out.set_item("world_size", state.world_size)?;
    out.set_item("settings", &state.settings)?;
    let buckets = PyDict::new(py);
    for (&index, bucket) in &state.buckets {
        let entry = PyDict::new(py);
        entry.set_item("steps", bucket.steps)?;
        for (_, name, buf) in bucket.buffers() {
            entry.set_item(name, buf.map(|b| PyBytes::new(py, b)))?;
        }
        buckets.set_item(index, entry)?;
    }
    out.set_item("buckets", buckets)?;
    Ok(out)
}

/// The dict of the module docs as an [`EngineState`].
pub(crate) fn from_dict(state: &Bound<'_, PyDict>) -> PyResult<EngineState> {
    let buckets = item(state, "buckets", "")?;
    let buckets = buckets
        .cast::<PyDict>()
        .map_err(|_| bad("buckets", "a dict of bucket index to bucket state"))?;
    let mut out = BTreeMap::new();
    for (index, entry) in buckets.iter() {
        let index: u64 = index
            .extract()
            .map_err(|_| bad("buckets", "bucket indices that are non-negative ints"))?;
        let at = format!("buckets[{index}]");
        let entry = entry
            .cast::<PyDict>()
            .map_err(|_| bad(&at, "a dict with steps, residual, velocity, previous_sum"))?;
        let buffer = |name: &str| -> PyResult<Option<Vec<u8>>> {
            let value = item(entry, name, &at)?;
            if value.is_none() {
                return Ok(None);
            }
            let bytes: PyBackedBytes = value
                .extract()
                .map_err(|_| bad(&format!("{at}[{name:?}]"), "bytes or None"))?;
            Ok(Some(bytes.to_vec()))
        };
        let steps = item(entry, "steps", &at)?
            .extract::<u64>()
            .map_err(|_| bad(&format!("{at}[\"steps\"]"), "a non-negative int"))?;
        out.insert(
            index,
            BucketState {
                steps,
                residual: buffer("residual")?,
                velocity: buffer("velocity")?,
                previous_sum: buffer("previous_sum")?,
            },
        );
    }
    Ok(EngineState {
        rank: item(state, "rank", "")?
            .extract()
            .map_err(|_| bad("rank", "a non-negative int"))?,
        world_size: item(state, "world_size", "")?
            .extract()
            .map_err(|_| bad("world_size", "a positive int"))?,
        settings: item(state, "settings", "")?
            .extract()
            .map_err(|_| bad("settings", "a dict of str to str"))?,
        buckets: out,
    })
}

/// `dict[key]`, or a `ValueError` naming the key (under `at`).
fn item<'py>(dict: &Bound<'py, PyDict>, key: &str, at: &str) -> PyResult<Bound<'py, PyAny>> {
    dict.get_item(key)?.ok_or_else(|| {
        let at = if at.is_empty() {
            String::new()
        } else {
            format!("{at} ")
        };
        PyValueError::new_err(format!("engine state: {at}has no {key:?}"))
    })
}

fn bad(key: &str, expected: &str) -> PyErr {
    PyValueError::new_err(format!("engine state: {key} must be {expected}"))
}
