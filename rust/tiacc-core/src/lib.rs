//! tiacc-training engine core.
//!
//! Pure Rust with no Python dependency, so every piece is testable with
//! `cargo test`. The `tiacc-py` crate wraps it for Python.

pub mod amp;
pub mod comm;
pub mod config;
pub mod dataset;
pub mod error;
pub mod image;
pub mod pack;
pub mod pool;
pub mod tfrecord;

pub use error::{Corruption, Error, Result};
