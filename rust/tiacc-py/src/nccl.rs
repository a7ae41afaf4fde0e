//! NCCL's Python face: loading the library, its version and unique ids
//! (the device engine joins its communicators through the core; a
//! communicator of its own for Python is `nccl_communicator.rs`, built only
//! with the cargo feature `nccl-communicator`).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use tiacc_core::comm::nccl::{NcclLibrary, NcclSearch};

use crate::errors::ResultExt;

/// Libraries loaded so far, by how they were searched for (dlopen is
/// reference-counted, but resolving and version-checking once is enough).
static LOADED: Mutex<Vec<(NcclSearch, Arc<NcclLibrary>)>> = Mutex::new(Vec::new());

pub(crate) fn load(
    search_dirs: Vec<String>,
    library: Option<String>,
) -> Result<Arc<NcclLibrary>, tiacc_core::Error> {
    let search = NcclSearch {
        explicit: library.filter(|l| !l.trim().is_empty()).map(PathBuf::from),
        dirs: search_dirs.into_iter().map(PathBuf::from).collect(),
    };
    let mut loaded = LOADED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, lib)) = loaded.iter().find(|(s, _)| *s == search) {
        return Ok(lib.clone());
    }
    let lib = Arc::new(NcclLibrary::load(&search)?);
    loaded.push((search, lib.clone()));
    Ok(lib)
}

/// The NCCL version as (major, minor, patch). `library` is an explicit file
/// (only it is tried); otherwise the copy already loaded in the process,
/// then `search_dirs`, then the loader's search. Raises `CommError` naming
/// what was tried when NCCL cannot be loaded.
#[pyfunction]
#[pyo3(
    signature = (search_dirs=Vec::new(), library=None),
    text_signature = "(search_dirs: list[str] = ..., library: Optional[str] = None) \
        -> tuple[int, int, int]"
)]
pub fn nccl_version(
    py: Python<'_>,
    search_dirs: Vec<String>,
    library: Option<String>,
) -> PyResult<(u32, u32, u32)> {
    py.detach(|| load(search_dirs, library).map(|l| l.version()))
        .py()
}

/// The file NCCL was loaded from (same search as `nccl_version`).
#[pyfunction]
#[pyo3(
    signature = (search_dirs=Vec::new(), library=None),
    text_signature = "(search_dirs: list[str] = ..., library: Optional[str] = None) -> str"
)]
pub fn nccl_library_path(
    py: Python<'_>,
    search_dirs: Vec<String>,
    library: Option<String>,
) -> PyResult<String> {
    py.detach(|| load(search_dirs, library).map(|l| l.path().to_string()))
        .py()
}

/// A fresh 128-byte `ncclUniqueId` (rank 0 makes one per communicator and
/// publishes it through the c10d store).
#[pyfunction]
#[pyo3(
    signature = (search_dirs=Vec::new(), library=None),
    text_signature = "(search_dirs: list[str] = ..., library: Optional[str] = None) -> bytes"
)]
pub fn nccl_unique_id<'py>(
    py: Python<'py>,
    search_dirs: Vec<String>,
    library: Option<String>,
) -> PyResult<Bound<'py, PyBytes>> {
    let id = py.detach(|| load(search_dirs, library)?.unique_id()).py()?;
    Ok(PyBytes::new(py, &id.to_bytes()))
}

pub(crate) fn seconds(name: &str, value: f64) -> PyResult<Duration> {
    if value.is_finite() && value > 0.0 && value < 1e9 {
        Ok(Duration::from_secs_f64(value))
    } else {
        Err(PyValueError::new_err(format!(
            "{name} must be a positive number of seconds, got {value}"
        )))
    }
}
