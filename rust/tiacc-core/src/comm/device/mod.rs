//! The device engine's logic, apart from any framework: its channels
//! ([`DeviceChannels`]: NCCL communicators or TCP rings, the watchdog, the
//! `auto` probe, the failure rule), the backend that runs the algorithms
//! ([`crate::comm::algo`], [`crate::comm::sharded`]) on device buffers, and
//! the [`Kernels`] trait through which the framework that owns the buffers
//! (torch, in the Python bindings) supplies its element-wise operations.

pub mod backend;
pub mod engine;
pub mod kernels;

pub use backend::{Comms, DeviceBackend, NcclGroups, Slot, PROBE_BUCKET};
pub use engine::{DeviceChannels, NcclIds, WATCH_POLL};
pub use kernels::{KernelError, KernelResult, Kernels, Span};
