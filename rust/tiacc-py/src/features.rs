//! Conversion between Python feature dicts and `tf.train.Example`.
//!
//! A feature value may be a scalar (bytes, str, int, float), a list or tuple
//! of them, or a numpy array; its `tf.train.Feature` kind follows the Python
//! types (bytes/str -> BytesList, int/bool -> Int64List, float ->
//! FloatList; a list mixing ints and floats is a FloatList). Decoding gives
//! `{name: list[bytes] | list[int] | list[float]}`.

use numpy::PyReadonlyArray1;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple,
};
use tiacc_core::tfrecord::example::{Example, Feature, Kind};

enum Scalar {
    Bytes(Vec<u8>),
    Int(i64),
    Float(f64),
}

fn scalar(key: &str, item: &Bound<'_, PyAny>) -> PyResult<Scalar> {
    if let Ok(b) = item.cast::<PyBytes>() {
        Ok(Scalar::Bytes(b.as_bytes().to_vec()))
    } else if let Ok(s) = item.cast::<PyString>() {
        Ok(Scalar::Bytes(s.to_cow()?.as_bytes().to_vec()))
    } else if let Ok(b) = item.cast::<PyByteArray>() {
        Ok(Scalar::Bytes(b.to_vec()))
    } else if item.is_instance_of::<PyBool>() || item.is_instance_of::<PyInt>() {
        item.extract::<i64>().map(Scalar::Int).map_err(|_| {
            PyValueError::new_err(format!(
                "feature {key:?}: integer {item} does not fit in int64"
            ))
        })
    } else if item.is_instance_of::<PyFloat>() {
        Ok(Scalar::Float(item.extract::<f64>()?))
    } else if item.hasattr("__index__")? {
        // numpy integer scalars and other integer-likes.
        Ok(Scalar::Int(
            item.call_method0("__index__")?.extract::<i64>()?,
        ))
    } else if item.hasattr("__float__")? {
        Ok(Scalar::Float(
            item.call_method0("__float__")?.extract::<f64>()?,
        ))
    } else {
        Err(PyTypeError::new_err(format!(
            "feature {key:?}: unsupported value type {} (expected bytes, str, int or float)",
            item.get_type().name()?
        )))
    }
}

fn from_numpy(key: &str, value: &Bound<'_, PyAny>) -> PyResult<Feature> {
    let py = value.py();
    let np = py.import("numpy")?;
    let kind: String = value.getattr("dtype")?.getattr("kind")?.extract()?;
    let flat = |dtype: &str| -> PyResult<Bound<'_, PyAny>> {
        np.call_method1(
            "ascontiguousarray",
            (value.call_method0("ravel")?, np.getattr(dtype)?),
        )
    };
    match kind.as_str() {
        "i" | "u" | "b" => {
            let arr = flat("int64")?;
            let arr: PyReadonlyArray1<i64> = arr.extract()?;
            Ok(Feature::int64(arr.as_slice()?.iter().copied()))
        }
        "f" => {
            let arr = flat("float32")?;
            let arr: PyReadonlyArray1<f32> = arr.extract()?;
            Ok(Feature::float(arr.as_slice()?.iter().copied()))
        }
        "S" | "U" | "O" => {
            let list = value.call_method0("ravel")?.call_method0("tolist")?;
            if list.len()? == 0 {
                // The dtype says bytes even when there are no elements.
                return Ok(Feature::bytes(Vec::<Vec<u8>>::new()));
            }
            from_sequence(key, &list)
        }
        other => Err(PyTypeError::new_err(format!(
            "feature {key:?}: numpy dtype kind {other:?} cannot be stored in a tf.train.Feature"
        ))),
    }
}

fn from_sequence(key: &str, seq: &Bound<'_, PyAny>) -> PyResult<Feature> {
    let items: Vec<Scalar> = seq
        .try_iter()?
        .map(|item| scalar(key, &item?))
        .collect::<PyResult<_>>()?;
    if items.is_empty() {
        return Err(PyValueError::new_err(format!(
            "feature {key:?}: an empty list has no type; pass an empty numpy array with a dtype (e.g. numpy.array([], dtype=numpy.int64))"
        )));
    }
    let all_bytes = items.iter().all(|s| matches!(s, Scalar::Bytes(_)));
    let any_bytes = items.iter().any(|s| matches!(s, Scalar::Bytes(_)));
    let any_float = items.iter().any(|s| matches!(s, Scalar::Float(_)));
    if any_bytes && !all_bytes {
        return Err(PyTypeError::new_err(format!(
            "feature {key:?}: a list mixes bytes/str with numbers"
        )));
    }
    Ok(if all_bytes {
        Feature::bytes(items.into_iter().map(|s| match s {
            Scalar::Bytes(b) => b,
            _ => unreachable!("checked all_bytes"),
        }))
    } else if any_float {
        Feature::float(items.into_iter().map(|s| match s {
            Scalar::Int(i) => i as f32,
            Scalar::Float(f) => f as f32,
            Scalar::Bytes(_) => unreachable!("checked any_bytes"),
        }))
    } else {
        Feature::int64(items.into_iter().map(|s| match s {
            Scalar::Int(i) => i,
            _ => unreachable!("no floats and no bytes"),
        }))
    })
}

/// Converts one Python value to a feature.
pub fn feature_from_py(key: &str, value: &Bound<'_, PyAny>) -> PyResult<Feature> {
    if value.is_instance_of::<PyList>() || value.is_instance_of::<PyTuple>() {
        from_sequence(key, value)
    } else if value.hasattr("dtype")? && value.hasattr("ravel")? {
        from_numpy(key, value)
    } else {
        from_sequence(key, &PyList::new(value.py(), [value])?.into_any())
    }
}

/// Converts a `{name: value}` dict to `(name, feature)` pairs.
pub fn features_from_dict(dict: &Bound<'_, PyAny>) -> PyResult<Vec<(String, Feature)>> {
    let dict = dict
        .cast::<PyDict>()
        .map_err(|_| PyTypeError::new_err("features must be a dict mapping names to values"))?;
    dict.iter()
        .map(|(k, v)| {
            let key: String = k
                .extract()
                .map_err(|_| PyTypeError::new_err(format!("feature name {k} is not a str")))?;
            let feature = feature_from_py(&key, &v)?;
            Ok((key, feature))
        })
        .collect()
}

/// Converts an Example to `{name: list}`.
pub fn example_to_dict<'py>(py: Python<'py>, example: &Example) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    for (name, feature) in example.feature_map() {
        let list = match &feature.kind {
            Some(Kind::BytesList(l)) => {
                PyList::new(py, l.value.iter().map(|b| PyBytes::new(py, b)))?
            }
            Some(Kind::Int64List(l)) => PyList::new(py, &l.value)?,
            Some(Kind::FloatList(l)) => PyList::new(py, &l.value)?,
            None => PyList::empty(py),
        };
        out.set_item(name, list)?;
    }
    Ok(out)
}
