//! Gradient communication: element types, the transport trait, the TCP
//! transport, allreduce algorithms and the multi-channel engine.
//!
//! ```text
//! Engine::submit(job) --bucket % channels--> channel thread (FIFO)
//!     agree on the op tag -> algorithm -> transport primitives -> job.done(result)
//! ```

pub mod algo;
pub mod codec;
pub mod dtype;
pub mod engine;
pub mod nccl;
pub mod sparse;
pub mod tcp;
pub mod transport;

pub use dtype::DType;
pub use engine::{Collective, Completion, Engine, EngineOptions, FailureHook, Job, RawBuf};
pub use transport::{Deadline, OpKind, OpTag, Transport};

#[cfg(test)]
mod tests;
