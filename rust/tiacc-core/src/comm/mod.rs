//! Gradient communication: element types, the transport trait, the TCP
//! transport, the allreduce algorithms and the multi-channel engine.
//!
//! ```text
//! set-up (both): setup::CommEngine / setup::DeviceEngine listen, connect, run the
//!                   auto probe and decide the algorithm (EngineSetup), then:
//! CPU buckets:  Engine::submit(job) --bucket % channels--> channel thread (FIFO)
//!                   Algorithm::allreduce over a HostBackend (TCP transports, Rust kernels)
//! CUDA buckets: setup::DeviceEngine's DeviceChannels (device/), called on the hook's thread
//!                   Algorithm::allreduce over a device backend (NCCL on a CUDA stream,
//!                   torch kernels), then the NCCL watchdog bounds the wait
//! ```

pub mod algo;
pub mod auto;
pub mod backend;
pub mod codec;
pub mod collective;
pub mod counters;
pub mod device;
pub mod dtype;
pub mod engine;
pub mod failure;
pub mod groups;
pub mod host;
pub mod mapping;
pub mod nccl;
pub mod progress;
pub mod setup;
pub mod sharded;
pub mod shm;
pub mod sparse;
pub mod state;
pub mod store;
pub mod tcp;
pub mod timeline;
pub mod transport;
pub mod turns;

pub use algo::{AlgoSettings, Algorithm, Bucket, Layout};
pub use backend::{Backend, GroupId, Mem, Shards};
pub use collective::{
    Collective, CollectiveCall, CollectiveName, DeviceCollective, Reduce, Runner,
};
pub use counters::{CounterRow, Counters, Path};
pub use dtype::{DType, ReduceOp};
pub use engine::{Completion, Engine, Job, RawBuf};
pub use failure::{FailureBoard, Failures};
pub use mapping::SharedBytes;
pub use state::{BucketState, EngineState};
pub use store::{Rendezvous, Store};
pub use transport::{Deadline, OpKind, OpTag, Reduction, Transport};

#[cfg(test)]
mod tests;
