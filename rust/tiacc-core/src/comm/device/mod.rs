//! The device engine's logic, apart from any framework: the backend that
//! runs the algorithms ([`crate::comm::algo`], [`crate::comm::sharded`]) on
//! device buffers through NCCL (or TCP for host buffers), and the
//! [`Kernels`] trait through which the framework that owns the buffers
//! (torch, in the Python bindings) supplies its element-wise operations.

pub mod backend;
pub mod kernels;

pub use backend::{Comms, DeviceBackend, NcclGroups, Slot, PROBE_BUCKET};
pub use kernels::{KernelError, KernelResult, Kernels, Span};
