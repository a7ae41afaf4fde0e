//! Allreduce algorithms, written once against [`Transport`].
//!
//! A channel owns the transports of the groups it talks to and one
//! algorithm that decides which primitives to run on which group: the flat
//! ring over the world, or the 2D (hierarchical) allreduce over the
//! intra-node and inter-node groups.

use super::codec::{self, Compression};
use super::dtype::{shard_range, DType};
use super::transport::{Aborter, Deadline, OpTag, Transport};
use crate::error::{Error, Result};

/// The groups one channel communicates over.
pub struct Groups {
    /// Every rank of the job.
    pub world: Box<dyn Transport>,
    /// The ranks of this node, and this rank's peers of the same local rank
    /// on the other nodes (both present, or neither).
    pub hierarchy: Option<Hierarchy>,
}

/// The two groups of the 2D allreduce.
pub struct Hierarchy {
    pub intra: Box<dyn Transport>,
    pub inter: Box<dyn Transport>,
}

impl Hierarchy {
    /// The 2D pattern: reduce-scatter inside the node, `inter_step` on this
    /// rank's shard over the inter-node group, allgather inside the node.
    /// Checking the tag inside every node and across nodes covers every rank.
    pub fn reduce(
        &mut self,
        tag: &OpTag,
        buf: &mut [u8],
        dtype: DType,
        deadline: Deadline,
        inter_step: impl FnOnce(&mut dyn Transport, &mut [u8]) -> Result<()>,
    ) -> Result<()> {
        self.intra.agree(tag, deadline)?;
        self.inter.agree(tag, deadline)?;
        let elem = dtype.size();
        self.intra.reduce_scatter(buf, dtype, deadline)?;
        let mine = shard_range(buf.len() / elem, self.intra.size(), self.intra.rank());
        inter_step(
            self.inter.as_mut(),
            &mut buf[mine.start * elem..mine.end * elem],
        )?;
        self.intra.allgather(buf, elem, deadline)
    }
}

impl Groups {
    /// Groups of the world only.
    pub fn flat(world: Box<dyn Transport>) -> Self {
        Groups {
            world,
            hierarchy: None,
        }
    }

    /// Breaks every transport after a failure.
    pub fn abort(&mut self) {
        self.world.abort();
        if let Some(h) = &mut self.hierarchy {
            h.intra.abort();
            h.inter.abort();
        }
    }

    /// Handles that break every transport of these groups from elsewhere.
    pub fn aborters(&self) -> Vec<Aborter> {
        let mut out = vec![self.world.aborter()];
        if let Some(h) = &self.hierarchy {
            out.push(h.intra.aborter());
            out.push(h.inter.aborter());
        }
        out
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

/// The 2D allreduce for buckets of at most `threshold` bytes (larger ones
/// use the flat ring): reduce-scatter inside the node, allreduce of each
/// shard across nodes by the ranks holding it (all shards in parallel), then
/// allgather inside the node. Every rank ends with identical bytes: each
/// shard is reduced once per node in a fixed order and then copied.
///
/// With `inter_compression`, only the inter-node step is cast to half
/// precision (scaled by `scale`); intra-node traffic stays full precision.
pub struct TwoD {
    pub threshold: u64,
    pub inter_compression: Compression,
    pub scale: f64,
}

impl Algorithm for TwoD {
    fn name(&self) -> &'static str {
        "2d"
    }

    fn allreduce(
        &mut self,
        groups: &mut Groups,
        tag: &OpTag,
        buf: &mut [u8],
        dtype: DType,
        deadline: Deadline,
    ) -> Result<()> {
        let Some(h) = groups
            .hierarchy
            .as_mut()
            .filter(|_| buf.len() as u64 <= self.threshold)
        else {
            return Flat.allreduce(groups, tag, buf, dtype, deadline);
        };
        let (compression, scale) = (self.inter_compression, self.scale);
        h.reduce(
            tag,
            buf,
            dtype,
            deadline,
            |inter, shard| match compression.wire_dtype(dtype) {
                None => inter.allreduce(shard, dtype, deadline),
                Some(wire) => {
                    let mut half = vec![0u8; shard.len() / dtype.size() * wire.size()];
                    codec::encode(shard, dtype, scale, &mut half, wire);
                    inter.allreduce(&mut half, wire, deadline)?;
                    codec::decode(&half, wire, 1.0 / scale, shard, dtype);
                    Ok(())
                }
            },
        )
    }
}

/// Which node each rank is on, from the launcher's local size: ranks
/// `node * intra_size .. (node + 1) * intra_size` share a node (torchrun and
/// `mpirun --map-by slot` number ranks that way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub rank: usize,
    pub world: usize,
    pub intra_size: usize,
}

impl Layout {
    /// Checks that the world splits into whole nodes.
    pub fn new(rank: usize, world: usize, intra_size: usize) -> Result<Self> {
        if intra_size == 0 || world % intra_size != 0 || rank >= world {
            return Err(Error::InvalidArgument(format!(
                "2D allreduce: a world of {world} ranks does not split into nodes of \
                 {intra_size} ranks (LIGHT_INTRA_SIZE / the launcher's local size)"
            )));
        }
        Ok(Layout {
            rank,
            world,
            intra_size,
        })
    }

    pub fn node(&self) -> usize {
        self.rank / self.intra_size
    }

    pub fn local_rank(&self) -> usize {
        self.rank % self.intra_size
    }

    pub fn nodes(&self) -> usize {
        self.world / self.intra_size
    }

    /// World ranks of this rank's node, in local-rank order.
    pub fn intra_members(&self) -> Vec<usize> {
        let first = self.node() * self.intra_size;
        (first..first + self.intra_size).collect()
    }

    /// World ranks with this rank's local rank, in node order.
    pub fn inter_members(&self) -> Vec<usize> {
        (0..self.nodes())
            .map(|n| n * self.intra_size + self.local_rank())
            .collect()
    }
}
