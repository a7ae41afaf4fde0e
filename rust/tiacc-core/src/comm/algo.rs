//! Allreduce algorithms, written once against [`Transport`].
//!
//! A channel owns the transports of the groups it talks to and one
//! algorithm that decides which primitives to run on which group. The flat
//! ring is the only algorithm so far; hierarchical (2D) and sparse
//! algorithms add groups (intra-node, inter-node) to [`Groups`].

use super::dtype::DType;
use super::transport::{Aborter, Deadline, OpTag, Transport};
use crate::error::Result;

/// The groups one channel communicates over.
pub struct Groups {
    /// Every rank of the job.
    pub world: Box<dyn Transport>,
}

impl Groups {
    /// Breaks every transport after a failure.
    pub fn abort(&mut self) {
        self.world.abort();
    }

    /// Handles that break every transport of these groups from elsewhere.
    pub fn aborters(&self) -> Vec<Aborter> {
        vec![self.world.aborter()]
    }
}

/// Turns an allreduce into transport primitives.
pub trait Algorithm: Send {
    /// Short name for logs.
    fn name(&self) -> &'static str;
    /// Sums `buf` over the world; every rank ends with identical bytes.
    fn allreduce(
        &mut self,
        groups: &mut Groups,
        tag: &OpTag,
        buf: &mut [u8],
        dtype: DType,
        deadline: Deadline,
    ) -> Result<()>;
}

/// One allreduce over the whole world (a ring on TCP).
pub struct Flat;

impl Algorithm for Flat {
    fn name(&self) -> &'static str {
        "flat"
    }

    fn allreduce(
        &mut self,
        groups: &mut Groups,
        tag: &OpTag,
        buf: &mut [u8],
        dtype: DType,
        deadline: Deadline,
    ) -> Result<()> {
        groups.world.allreduce_checked(tag, buf, dtype, deadline)
    }
}
