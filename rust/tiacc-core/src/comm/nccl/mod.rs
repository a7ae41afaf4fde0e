//! The NCCL transport's foundation: our own FFI over `libnccl.so.2`,
//! loaded at run time (no link-time dependency, no CUDA toolkit to build).
//!
//! ```text
//! library.rs       find + dlopen libnccl.so.2, resolve ~15 functions, check the version
//! ffi.rs           nccl.h's types, enum values and function signatures
//! communicator.rs  NcclCommunicator (collectives on raw device pointers and a
//!                  raw CUDA stream)
//! ready.rs         await_ready: the bounded wait on a non-blocking init or
//!                  call (a leaf: uses nothing else in nccl/)
//! watch.rs         watch(): the bounded wait on every collective (deadline,
//!                  NCCL's async errors, another rank's failure)
//! watchdog.rs      the thread that waits for each enqueued collective
//! trace.rs         TIACC_TRAINING_NCCL_TRACE: the waits on stderr
//! ```
//!
//! The Python shim owns CUDA: it passes device pointers and
//! `torch.cuda.Stream.cuda_stream` handles, and keeps tensors alive until
//! the stream has passed the collective.

pub mod communicator;
pub mod ffi;
pub mod library;
pub mod ready;
pub mod trace;
pub mod watch;
pub mod watchdog;

pub use communicator::{DevicePtr, Group, NcclCommunicator, ReduceOp};
pub use ffi::{NcclUniqueId, UNIQUE_ID_BYTES};
pub use library::{NcclLibrary, NcclSearch, LIBRARY_NAME, MIN_VERSION};
pub use watch::{watch, Watched};
pub use watchdog::{Pending, Tracker, Watchdog};

#[cfg(test)]
mod tests;
