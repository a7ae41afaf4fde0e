//! torch's sharded collectives (`reduce_scatter_tensor`,
//! `all_gather_into_tensor`) over the 2D groups, and the compressed
//! reduce-scatter, written once against [`Backend`].
//!
//! The buffer holds one equal block per world rank, block `r` for rank `r`;
//! world rank `r` is local rank `r % L` of node `r / L` (`L` ranks per
//! node, `N` nodes, see [`super::algo::Layout`]). The 2D forms move the
//! blocks in a local-major order, block `(node, local)` at position
//! `local * N + node`, so that what each step needs is contiguous:
//!
//! * reduce-scatter: a reduce-scatter inside the node of the reordered
//!   buffer leaves local rank `l` the node's sum of the `N` blocks of the
//!   ranks with local rank `l`; a reduce-scatter of those across nodes
//!   leaves each rank its own block. What crosses the link per node is
//!   `L * (N - 1)` blocks, against `W - 1` for a ring over the `W = L * N`
//!   ranks (2 against 3 on 2 x 2), and only that step is compressed under
//!   scope `inter`.
//! * all-gather: the reverse: an all-gather across nodes of this rank's
//!   block among the ranks of its local rank, then an all-gather inside the
//!   node of those `N` blocks, then the blocks back in rank order.
//!
//! Sums are exact without compression (a different order of additions
//! than a flat ring's, as any two algorithms' are). The reorder costs two
//! copies of the buffer in memory, small next to what the link carries.

use super::backend::{Backend, GroupId, Mem, Shards};
use super::codec::Compression;
use super::dtype::DType;
use super::transport::OpTag;
use crate::error::{Error, Result};

/// How a reduce-scatter runs: over the 2D groups or the world, and what is
/// compressed (see [`super::algo::AlgoSettings`]: the same scope rules as
/// the allreduce of DDP's buckets).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReduceScatterPlan {
    /// Over the intra-node and inter-node groups (the backend has them).
    pub two_d: bool,
    /// Wire type of the whole reduce-scatter.
    pub compression: Compression,
    /// Wire type of the inter-node step only (with `two_d`).
    pub inter_compression: Compression,
    /// Multiplier applied before a half-precision cast, divided out after.
    pub scale: f64,
}

impl ReduceScatterPlan {
    /// The codec that applies to `dtype` (`None` for integers and halves).
    pub fn codec(&self, dtype: DType) -> Compression {
        let whole = self.compression.wire_dtype(dtype).map(|_| self.compression);
        let inter = self
            .inter_compression
            .wire_dtype(dtype)
            .filter(|_| self.two_d)
            .map(|_| self.inter_compression);
        whole.or(inter).unwrap_or(Compression::None)
    }
}

/// The 2D groups' shape as this rank sees it.
#[derive(Debug, Clone, Copy)]
struct Grid {
    /// Ranks per node, and this rank's local rank.
    locals: usize,
    local: usize,
    /// Nodes, and this rank's node.
    nodes: usize,
    node: usize,
}

impl Grid {
    fn of(b: &dyn Backend) -> Self {
        Grid {
            locals: b.size(GroupId::Intra),
            local: b.rank(GroupId::Intra),
            nodes: b.size(GroupId::Inter),
            node: b.rank(GroupId::Inter),
        }
    }

    fn world(self) -> usize {
        self.locals * self.nodes
    }

    /// Where world rank `node * L + local`'s block sits in the reordered
    /// buffer.
    fn reordered(self, node: usize, local: usize) -> usize {
        local * self.nodes + node
    }

    /// `(rank order, reordered)` block positions, every block once.
    fn moves(self) -> impl Iterator<Item = (usize, usize)> {
        (0..self.nodes).flat_map(move |n| {
            (0..self.locals).map(move |l| (n * self.locals + l, self.reordered(n, l)))
        })
    }
}

/// Bytes of one rank's block of `buf`, checked to split into `parts`.
fn block_bytes(buf: Mem, dtype_size: usize, parts: usize) -> Result<usize> {
    if parts == 0 || buf.bytes % (parts * dtype_size) != 0 {
        return Err(Error::InvalidArgument(format!(
            "{} bytes do not split into {parts} equal blocks of whole {dtype_size}-byte elements",
            buf.bytes
        )));
    }
    Ok(buf.bytes / parts)
}

/// Reduce-scatter of `buf` (one block per world rank) divided by
/// `divisor`: this rank's block of `buf` ends up holding the sum over every
/// rank of their block for it, divided. Every other byte of `buf` is
/// scratch afterwards. Returns this rank's block.
///
/// Without compression the sum is exact and divided afterwards; a
/// compressed one divides before the cast (as DDP's buckets do, so half
/// types cannot overflow).
pub fn reduce_scatter(
    b: &mut dyn Backend,
    tag: &OpTag,
    buf: Mem,
    dtype: DType,
    divisor: f64,
    plan: &ReduceScatterPlan,
) -> Result<Mem> {
    let (rank, size) = (b.rank(GroupId::World), b.size(GroupId::World));
    let block = block_bytes(buf, dtype.size(), size)?;
    let mine = buf.slice(rank * block..(rank + 1) * block)?;
    let two_d = plan.two_d && b.hierarchical();
    if two_d {
        b.agree(GroupId::Intra, tag)?;
        b.agree(GroupId::Inter, tag)?;
    } else {
        b.agree(GroupId::World, tag)?;
    }
    let whole_wire = plan.compression.wire_dtype(dtype).filter(|_| size > 1);
    if let Some(wire) = whole_wire {
        let sent = b.alloc(buf.bytes / dtype.size() * wire.size())?;
        b.encode(buf, dtype, plan.scale / divisor, sent, wire)?;
        let reduced = reduce_scatter_plain(b, sent, wire, two_d, None)?;
        b.decode(reduced, wire, 1.0 / plan.scale, mine, dtype)?;
        return Ok(mine);
    }
    let inter_wire = plan
        .inter_compression
        .wire_dtype(dtype)
        .filter(|_| two_d)
        .map(|wire| (wire, plan.scale / divisor));
    let reduced = reduce_scatter_plain(b, buf, dtype, two_d, inter_wire)?;
    match inter_wire {
        // Already divided before the inter-node cast.
        Some((wire, _)) => b.decode(reduced, wire, 1.0 / plan.scale, mine, dtype)?,
        None => {
            if reduced != mine {
                b.copy(reduced, mine)?;
            }
            if divisor != 1.0 {
                b.div(mine, dtype, divisor)?;
            }
        }
    }
    Ok(mine)
}

/// The sum of this rank's block over every rank, wherever it ends up (in
/// `dtype`, or in the inter-node wire type when `inter_wire` gives one with
/// the factor applied before its cast).
fn reduce_scatter_plain(
    b: &mut dyn Backend,
    buf: Mem,
    dtype: DType,
    two_d: bool,
    inter_wire: Option<(DType, f64)>,
) -> Result<Mem> {
    if !two_d {
        return Ok(b.reduce_scatter(GroupId::World, buf, dtype)?.mine);
    }
    let grid = Grid::of(b);
    let block = block_bytes(buf, dtype.size(), grid.world())?;
    let reordered = b.alloc(buf.bytes)?;
    for (from, to) in grid.moves() {
        b.copy(
            buf.slice(from * block..(from + 1) * block)?,
            reordered.slice(to * block..(to + 1) * block)?,
        )?;
    }
    // This rank's local rank's N blocks, summed over the node.
    let node_sum = b.reduce_scatter(GroupId::Intra, reordered, dtype)?.mine;
    let Some((wire, factor)) = inter_wire else {
        return Ok(b.reduce_scatter(GroupId::Inter, node_sum, dtype)?.mine);
    };
    let half = b.alloc(node_sum.bytes / dtype.size() * wire.size())?;
    b.encode(node_sum, dtype, factor, half, wire)?;
    Ok(b.reduce_scatter(GroupId::Inter, half, wire)?.mine)
}

/// All-gather of `buf` (one block per world rank, this rank's at its
/// rank) over the 2D groups: afterwards every block holds its rank's.
pub fn allgather_two_d(b: &mut dyn Backend, tag: &OpTag, buf: Mem, elem: usize) -> Result<()> {
    b.agree(GroupId::Intra, tag)?;
    b.agree(GroupId::Inter, tag)?;
    let grid = Grid::of(b);
    let block = block_bytes(buf, elem, grid.world())?;
    let rank = grid.node * grid.locals + grid.local;
    let reordered = b.alloc(buf.bytes)?;
    let at = |i: usize| reordered.slice(i * block..(i + 1) * block);
    // The blocks of this rank's local rank, in node order, then the node's.
    let column =
        reordered.slice(grid.local * grid.nodes * block..(grid.local + 1) * grid.nodes * block)?;
    let own = at(grid.reordered(grid.node, grid.local))?;
    b.copy(buf.slice(rank * block..(rank + 1) * block)?, own)?;
    let across = Shards {
        whole: column,
        mine: own,
    };
    b.allgather(GroupId::Inter, across, column, elem)?;
    let inside = Shards {
        whole: reordered,
        mine: column,
    };
    b.allgather(GroupId::Intra, inside, reordered, elem)?;
    for (to, from) in grid.moves() {
        b.copy(at(from)?, buf.slice(to * block..(to + 1) * block)?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reorder_visits_every_block_once() {
        let grid = Grid {
            locals: 3,
            local: 1,
            nodes: 2,
            node: 0,
        };
        let moves: Vec<_> = grid.moves().collect();
        // Rank 4 is local rank 1 of node 1: position 1 * 2 + 1.
        assert_eq!(moves[4], (4, 3));
        let mut to: Vec<_> = moves.iter().map(|&(_, t)| t).collect();
        to.sort_unstable();
        assert_eq!(to, (0..6).collect::<Vec<_>>());
    }

    #[test]
    fn plans_compress_only_float_types() {
        let plan = ReduceScatterPlan {
            two_d: true,
            compression: Compression::None,
            inter_compression: Compression::Bf16,
            scale: 1.0,
        };
        assert_eq!(plan.codec(DType::F32), Compression::Bf16);
        assert_eq!(plan.codec(DType::I64), Compression::None);
        let flat = ReduceScatterPlan {
            two_d: false,
            ..plan
        };
        assert_eq!(flat.codec(DType::F32), Compression::None);
    }
}
