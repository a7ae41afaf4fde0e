//! torch's c10d store as the core's rendezvous [`Store`], and the one rule
//! for waiting on the ranks' keys (`wait_for`) that every start-up exchange
//! uses.

use std::sync::Mutex;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use tiacc_core::comm::setup::{EngineSetup, Placement, Scope};
use tiacc_core::comm::{Rendezvous, Store};
use tiacc_core::Error;

use crate::config::PyCommConfig;
use crate::errors::{to_pyerr, ResultExt};
use crate::nccl::seconds;

/// A c10d store (`set`, `get`, `wait`, `check`), called with the interpreter
/// attached. The Python exception of a call that failed is kept, so that
/// the caller raises the store's own error rather than a copy of its text.
pub(crate) struct PyStore {
    store: Py<PyAny>,
    failure: Mutex<Option<PyErr>>,
}

impl PyStore {
    pub(crate) fn new(store: Py<PyAny>) -> Self {
        PyStore {
            store,
            failure: Mutex::new(None),
        }
    }

    /// The exception for `err`, an error of a call made through this store:
    /// the store's own where it failed ([`Error::Store`]); otherwise `err`
    /// converted, caused by the store's failure if one came first (a wait
    /// that timed out, named by the ranks it missed).
    fn raise(&self, py: Python<'_>, err: Error) -> PyErr {
        let kept = self
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        match (err, kept) {
            (Error::Store { .. }, Some(own)) => own,
            (err, kept) => {
                let converted = to_pyerr(err);
                converted.set_cause(py, kept);
                converted
            }
        }
    }

    /// Runs `exchange` with a rendezvous through `store` (a c10d store)
    /// under `prefix`, for `rank`, waiting at most `timeout` seconds on the
    /// others; raises the store's own exception where the store failed.
    pub(crate) fn through<T>(
        py: Python<'_>,
        store: Py<PyAny>,
        prefix: &str,
        rank: usize,
        timeout: f64,
        exchange: impl FnOnce(&Rendezvous<'_>) -> Result<T, Error>,
    ) -> PyResult<T> {
        let store = PyStore::new(store);
        let rendezvous = Rendezvous {
            store: &store,
            prefix,
            rank,
            timeout: seconds("timeout", timeout)?,
        };
        exchange(&rendezvous).map_err(|err| store.raise(py, err))
    }

    fn call<T>(
        &self,
        key: &str,
        call: impl FnOnce(Python<'_>, &Bound<'_, PyAny>) -> PyResult<T>,
    ) -> Result<T, Error> {
        Python::attach(|py| call(py, self.store.bind(py))).map_err(|err| {
            let reason = err.to_string();
            *self.failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(err);
            Error::Store {
                key: key.to_string(),
                reason,
            }
        })
    }
}

impl Store for PyStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), Error> {
        self.call(key, |py, store| {
            store.call_method1("set", (key, PyBytes::new(py, value)))?;
            Ok(())
        })
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, Error> {
        self.call(key, |_, store| store.call_method1("get", (key,))?.extract())
    }

    fn wait(&self, keys: &[String], timeout: Duration) -> Result<(), Error> {
        let first = keys.first().map(String::as_str).unwrap_or_default();
        self.call(first, |py, store| {
            let kwargs = PyDict::new(py);
            kwargs.set_item("seconds", timeout.as_secs_f64())?;
            let delta = py
                .import("datetime")?
                .getattr("timedelta")?
                .call((), Some(&kwargs))?;
            store.call_method1("wait", (keys.to_vec(), delta))?;
            Ok(())
        })
    }

    fn check(&self, key: &str) -> bool {
        Python::attach(|py| {
            self.store
                .bind(py)
                .call_method1("check", (vec![key],))
                .and_then(|answer| answer.extract::<bool>())
                .unwrap_or(false)
        })
    }
}

/// An engine's set-up for `rank` of `size`, the 2D layout agreed with the
/// other ranks through `store` (a c10d store) under `prefix`, waiting at
/// most the configuration's timeout (GIL released while the store waits);
/// `group`: for a group of the "tiacc" backend. Without `store`, no 2D
/// groups.
#[allow(clippy::too_many_arguments)]
pub(crate) fn engine_setup(
    config: &Bound<'_, PyCommConfig>,
    rank: usize,
    size: usize,
    placement: Placement,
    store: Option<Py<PyAny>>,
    prefix: Option<&str>,
    group: bool,
) -> PyResult<EngineSetup> {
    let (py, config) = (config.py(), &config.get().inner);
    let (store, prefix) = match (store, prefix) {
        (None, _) => return EngineSetup::new(config, rank, size, placement, None).py(),
        (Some(store), Some(prefix)) => (store, prefix),
        (Some(_), None) => {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "a store needs the prefix of its keys",
            ))
        }
    };
    let scope = if group { Scope::Group } else { Scope::World };
    let timeout = config.timeout.as_secs_f64();
    PyStore::through(py, store, prefix, rank, timeout, |rendezvous| {
        py.detach(|| EngineSetup::new(config, rank, size, placement, Some((rendezvous, scope))))
    })
}

/// Waits for `keys` in `store` (`owners[i]` publishes `keys[i]`), at most
/// `timeout` seconds (GIL released while the store waits).
///
/// Raises:
///     CommTimeoutError: a key is still missing; the message names its
///         ranks, this `rank` and the exchange `what` (`peer` is the first
///         of them).
#[pyfunction]
#[pyo3(
    text_signature = "(store: Any, keys: list[str], owners: list[int], timeout: float, \
        rank: int, what: str) -> None"
)]
pub fn wait_for(
    py: Python<'_>,
    store: Py<PyAny>,
    keys: Vec<String>,
    owners: Vec<usize>,
    timeout: f64,
    rank: usize,
    what: &str,
) -> PyResult<()> {
    if keys.len() != owners.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "wait_for: {} keys but {} owners",
            keys.len(),
            owners.len()
        )));
    }
    PyStore::through(py, store, "", rank, timeout, |rendezvous| {
        py.detach(|| rendezvous.wait_for(&keys, &owners, what))
    })
}
