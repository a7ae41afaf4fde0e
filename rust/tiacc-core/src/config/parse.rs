//! The parsers of values: each error names the variable (or argument) and
//! says what was expected; an empty value is unset.

use std::time::Duration;

use super::MAX_NUM_STREAMS;
use crate::error::{Error, Result};

/// `name`'s value through `lookup`: `None` when unset or blank, an error
/// when it is not UTF-8.
pub(super) fn read(
    lookup: &impl Fn(&str) -> Option<std::ffi::OsString>,
    name: &str,
) -> Result<Option<String>> {
    match lookup(name) {
        None => Ok(None),
        Some(v) => match v.into_string() {
            Ok(s) if s.trim().is_empty() => Ok(None),
            Ok(s) => Ok(Some(s)),
            Err(raw) => Err(Error::Config {
                variable: name.to_string(),
                value: raw.to_string_lossy().into_owned(),
                expected: "valid UTF-8".to_string(),
            }),
        },
    }
}

/// The error for `variable`'s `value`, which is not `expected`.
pub(super) fn bad(variable: &str, value: &str, expected: &str) -> Error {
    Error::Config {
        variable: variable.to_string(),
        value: value.to_string(),
        expected: expected.to_string(),
    }
}

/// Parses `1/0`, `true/false`, `yes/no`, `on/off` (any case).
pub fn parse_bool(variable: &str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(bad(
            variable,
            value,
            "one of 1/0, true/false, yes/no, on/off",
        )),
    }
}

pub(super) fn parse_usize(variable: &str, value: &str) -> Result<usize> {
    value
        .trim()
        .parse()
        .map_err(|_| bad(variable, value, "a non-negative integer"))
}

pub(super) fn parse_positive_u64(variable: &str, value: &str) -> Result<u64> {
    match value.trim().parse::<u64>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(bad(variable, value, "a positive integer number of bytes")),
    }
}

/// Parses a channel count in `1..=MAX_NUM_STREAMS`.
pub fn parse_num_streams(variable: &str, value: &str) -> Result<usize> {
    match value.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_NUM_STREAMS).contains(&n) => Ok(n),
        _ => Err(bad(
            variable,
            value,
            &format!("an integer from 1 to {MAX_NUM_STREAMS}"),
        )),
    }
}

/// Parses a positive number of seconds (fractions allowed).
pub fn parse_seconds(variable: &str, value: &str) -> Result<Duration> {
    match value.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Duration::from_secs_f64(s)),
        _ => Err(bad(variable, value, "a positive number of seconds")),
    }
}
