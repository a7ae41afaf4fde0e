//! The Python exception hierarchy and the one mapping from engine errors.
//!
//! ```text
//! RuntimeError
//! └── TiaccError
//!     ├── ConfigError
//!     ├── CommError
//!     │   └── CommTimeoutError
//!     ├── DataError
//!     │   ├── CorruptRecordError
//!     │   ├── DataFileNotFoundError  (also a FileNotFoundError)
//!     │   ├── DataPermissionError    (also a PermissionError)
//!     │   └── RecordDecodeError      (also a DecodeError)
//!     └── DecodeError
//!         └── RecordDecodeError
//! ```
//!
//! The two classes with two bases cannot be declared with
//! `create_exception!` (one base only): [`register`] creates them with
//! Python's `type()` and keeps them for [`to_pyerr`].
//!
//! The orphan rule forbids `impl From<tiacc_core::Error> for PyErr` here, so
//! the mapping is [`to_pyerr`], reached through [`ResultExt::py`].

use std::io::ErrorKind;

use pyo3::exceptions::{PyFileNotFoundError, PyPermissionError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyModule, PyTuple, PyType};
use pyo3::IntoPyObjectExt;
use tiacc_core::Error;

pyo3::create_exception!(
    tiacc_training.errors,
    TiaccError,
    PyRuntimeError,
    "Root of every error raised by tiacc-training's engine."
);
pyo3::create_exception!(
    tiacc_training.errors,
    ConfigError,
    TiaccError,
    "A configuration value (argument or environment variable) is invalid.\n\n\
     Attributes:\n    variable (str): The variable or argument whose value is invalid."
);
pyo3::create_exception!(
    tiacc_training.errors,
    CommError,
    TiaccError,
    "A collective communication failed.\n\n\
     Attributes:\n    peer (Optional[int]): The rank whose connection or data failed, if one did."
);
pyo3::create_exception!(
    tiacc_training.errors,
    CommTimeoutError,
    CommError,
    "A peer did not answer within the communication timeout.\n\n\
     Attributes:\n    peer (int): The rank that did not answer."
);
pyo3::create_exception!(
    tiacc_training.errors,
    DataError,
    TiaccError,
    "A data file (shard, index, list) could not be read or is invalid."
);
pyo3::create_exception!(
    tiacc_training.errors,
    CorruptRecordError,
    DataError,
    "A TFRecord's framing or checksum is wrong; `path` and `offset` locate it.\n\n\
     Attributes:\n    path (str): The file.\n    offset (int): Where the record starts."
);
pyo3::create_exception!(
    tiacc_training.errors,
    DecodeError,
    TiaccError,
    "A file is not a readable image.\n\n\
     Attributes:\n    path (str): The file."
);

/// `DataFileNotFoundError(DataError, FileNotFoundError)`, made by [`register`].
static FILE_NOT_FOUND: PyOnceLock<Py<PyType>> = PyOnceLock::new();
/// `DataPermissionError(DataError, PermissionError)`, made by [`register`].
static PERMISSION: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// A subclass of `DataError` and of the built-in OS error `os_base`.
///
/// Its `str()` is `BaseException`'s (the message alone): `OSError`'s would
/// print `[Errno 2] ...` once `errno` is set.
fn data_os_error(
    py: Python<'_>,
    name: &str,
    os_base: Bound<'_, PyType>,
    doc: &str,
) -> PyResult<Py<PyType>> {
    let builtins = py.import("builtins")?;
    let bases = PyTuple::new(py, [py.get_type::<DataError>(), os_base])?;
    let namespace = PyDict::new(py);
    namespace.set_item("__module__", "tiacc_training.errors")?;
    namespace.set_item("__qualname__", name)?;
    namespace.set_item("__doc__", doc)?;
    namespace.set_item(
        "__str__",
        builtins.getattr("BaseException")?.getattr("__str__")?,
    )?;
    let ty = builtins.getattr("type")?.call1((name, bases, namespace))?;
    Ok(ty.cast_into::<PyType>()?.unbind())
}

/// `RecordDecodeError`: a record in a shard whose image cannot be decoded.
/// It is bad data in a shard (a `DataError`) and an undecodable image (a
/// `DecodeError`), so it derives from both; `create_exception!` takes one
/// base, so the class is made by calling `type` once.
static RECORD_DECODE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn record_decode_error(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    RECORD_DECODE_ERROR
        .get_or_try_init(py, || {
            let bases = PyTuple::new(
                py,
                [py.get_type::<DecodeError>(), py.get_type::<DataError>()],
            )?;
            let namespace = PyDict::new(py);
            namespace.set_item("__module__", "tiacc_training.errors")?;
            namespace.set_item(
                "__doc__",
                concat!(
                    "A record whose image cannot be decoded; `path`, `offset` and `index` ",
                    "locate it.\n\nAttributes:\n",
                    "    path (str): The shard.\n",
                    "    offset (int): Where the record starts.\n",
                    "    index (int): The record's position in the dataset.",
                ),
            )?;
            let class = py
                .get_type::<PyType>()
                .call1(("RecordDecodeError", bases, namespace))?
                .cast_into::<PyType>()?;
            Ok(class.unbind())
        })
        .map(|class| class.bind(py))
}

/// Adds the exception classes to the extension module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("RecordDecodeError", record_decode_error(py)?)?;
    m.add("TiaccError", py.get_type::<TiaccError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("CommError", py.get_type::<CommError>())?;
    m.add("CommTimeoutError", py.get_type::<CommTimeoutError>())?;
    m.add("DataError", py.get_type::<DataError>())?;
    m.add("CorruptRecordError", py.get_type::<CorruptRecordError>())?;
    m.add("DecodeError", py.get_type::<DecodeError>())?;
    let not_found = FILE_NOT_FOUND.get_or_try_init(py, || {
        data_os_error(
            py,
            "DataFileNotFoundError",
            py.get_type::<PyFileNotFoundError>(),
            "A shard, index or list does not exist (a DataError and a FileNotFoundError).\n\n\
             Attributes:\n    path (str): The file, or the index naming a missing shard.",
        )
    })?;
    m.add("DataFileNotFoundError", not_found.bind(py))?;
    let permission = PERMISSION.get_or_try_init(py, || {
        data_os_error(
            py,
            "DataPermissionError",
            py.get_type::<PyPermissionError>(),
            "A shard, index or list may not be read or written (a DataError and a PermissionError).\n\n\
             Attributes:\n    path (str): The file, or the index naming a forbidden shard.",
        )
    })?;
    m.add("DataPermissionError", permission.bind(py))?;
    Ok(())
}

/// The exception for a data problem: `DataError`, or its OS-error subclass
/// when an operating-system error of a kind Python names is behind it. The
/// OS-error attributes (`errno`, `strerror`, `filename`) are set in that case.
fn data_error(
    py: Python<'_>,
    message: String,
    kind: Option<ErrorKind>,
    raw_errno: Option<i32>,
    filename: Option<&std::path::Path>,
) -> (PyErr, Vec<(&'static str, Py<PyAny>)>) {
    let (cell, errno) = match kind {
        Some(ErrorKind::NotFound) => (&FILE_NOT_FOUND, 2), // ENOENT
        Some(ErrorKind::PermissionDenied) => (&PERMISSION, 13), // EACCES
        _ => return (DataError::new_err(message), vec![]),
    };
    let Some(ty) = cell.get(py) else {
        return (DataError::new_err(message), vec![]);
    };
    let strerror = match kind {
        Some(ErrorKind::NotFound) => "No such file or directory",
        _ => "Permission denied",
    };
    let mut attrs = vec![
        ("errno", any(py, raw_errno.unwrap_or(errno))),
        ("strerror", any(py, strerror)),
    ];
    if let Some(f) = filename {
        attrs.push(("filename", path_obj(py, f)));
    }
    (PyErr::from_type(ty.bind(py).clone(), (message,)), attrs)
}

/// Maps an engine error to its Python exception, with attributes that
/// locate the problem (`path`, `offset`, `line`) where the error has them.
pub fn to_pyerr(err: Error) -> PyErr {
    let message = err.to_string();
    Python::attach(|py| {
        let (exc, attrs): (PyErr, Vec<(&str, Py<PyAny>)>) = match &err {
            Error::Io { path, source } => {
                let (exc, mut attrs) = data_error(
                    py,
                    message,
                    Some(source.kind()),
                    source.raw_os_error(),
                    Some(path),
                );
                attrs.push(("path", path_obj(py, path)));
                (exc, attrs)
            }
            Error::MissingShard {
                index,
                line,
                shard,
                kind,
                ..
            } => {
                let (exc, mut attrs) = data_error(py, message, Some(*kind), None, Some(shard));
                attrs.push(("path", path_obj(py, index)));
                attrs.push(("line", any(py, *line)));
                attrs.push(("shard", path_obj(py, shard)));
                (exc, attrs)
            }
            Error::CorruptRecord { path, offset, .. } => (
                CorruptRecordError::new_err(message),
                vec![("path", path_obj(py, path)), ("offset", any(py, *offset))],
            ),
            Error::FileChanged { path, offset, .. } => (
                DataError::new_err(message),
                vec![("path", path_obj(py, path)), ("offset", any(py, *offset))],
            ),
            Error::MalformedExample { .. } => (DataError::new_err(message), vec![]),
            Error::BadIndex { path, line, .. } => (
                DataError::new_err(message),
                vec![("path", path_obj(py, path)), ("line", any(py, *line))],
            ),
            Error::BadImage { path, .. } => (
                DecodeError::new_err(message),
                vec![("path", path_obj(py, path))],
            ),
            Error::RecordImage {
                path,
                offset,
                index,
                ..
            } => (
                // Registered at import, so this lookup does not fail; if it
                // did, the error would still be a DecodeError.
                match record_decode_error(py) {
                    Ok(class) => PyErr::from_type(class.clone(), message),
                    Err(_) => DecodeError::new_err(message),
                },
                vec![
                    ("path", path_obj(py, path)),
                    ("offset", any(py, *offset)),
                    ("index", any(py, *index)),
                ],
            ),
            Error::RecordFeature {
                path,
                offset,
                index,
                ..
            } => (
                DataError::new_err(message),
                vec![
                    ("path", path_obj(py, path)),
                    ("offset", any(py, *offset)),
                    ("index", any(py, *index)),
                ],
            ),
            Error::InvalidArgument(_) | Error::Collective(_) => {
                (PyValueError::new_err(message), vec![])
            }
            Error::Config { variable, .. } => (
                ConfigError::new_err(message),
                vec![("variable", any(py, variable.as_str()))],
            ),
            Error::Comm { peer, .. } => {
                (CommError::new_err(message), vec![("peer", any(py, *peer))])
            }
            Error::CommTimeout { peer, .. } => (
                CommTimeoutError::new_err(message),
                vec![("peer", any(py, *peer))],
            ),
            Error::Store { key, .. } => (
                CommError::new_err(message),
                vec![("key", any(py, key.as_str()))],
            ),
            Error::StateMismatch {
                key,
                expected,
                found,
            } => (
                PyValueError::new_err(message),
                vec![
                    ("key", any(py, key.as_str())),
                    ("expected", any(py, expected.as_str())),
                    ("found", any(py, found.as_str())),
                ],
            ),
        };
        let value = exc.value(py);
        for (name, obj) in attrs {
            // Setting an attribute on a fresh exception instance cannot
            // reasonably fail; if it does the exception is still raised.
            let _ = value.setattr(name, obj);
        }
        exc
    })
}

fn path_obj(py: Python<'_>, path: &std::path::Path) -> Py<PyAny> {
    any(py, path.to_string_lossy())
}

fn any<'py, T: IntoPyObjectExt<'py>>(py: Python<'py>, value: T) -> Py<PyAny> {
    value.into_py_any(py).unwrap_or_else(|_| py.None())
}

/// `.py()` turns an engine result into a Python result.
pub trait ResultExt<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> ResultExt<T> for Result<T, Error> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_pyerr)
    }
}
