//! What an allreduce algorithm needs from the place its buffers live.
//!
//! The algorithms ([`super::algo::Algorithm`]) are written once against
//! [`Backend`]: collectives on the world, intra-node and inter-node groups,
//! and the few element-wise kernels around them (averaging, half-precision
//! casts, the non-finite check, Top-K packing and its momentum correction).
//! Two backends implement it:
//!
//! * [`super::host::HostBackend`]: host memory, TCP transports, kernels in
//!   Rust. Collectives block until done (CPU tensors, and CUDA tensors
//!   staged through host memory).
//! * the device backend of the Python bindings: torch tensors (CUDA, or CPU
//!   in tests), NCCL communicators enqueued on a CUDA stream, kernels as
//!   torch operations on that stream. Nothing waits on the host.
//!
//! Buffers are named by [`Mem`]: an address and a length in bytes. A
//! backend only accepts a `Mem` inside memory it was handed for the current
//! operation or allocated itself, and checks that before touching it.

use std::ops::Range;

use super::dtype::{shard_range, DType};
use super::mapping::SharedBytes;
use super::transport::{Deadline, OpTag, Reduction};
use crate::error::{Error, Result};

/// A span of bytes in a backend's memory (host or device addresses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mem {
    pub addr: usize,
    pub bytes: usize,
}

impl Mem {
    pub fn new(addr: usize, bytes: usize) -> Self {
        Mem { addr, bytes }
    }

    /// Bytes `range` of this span.
    pub fn slice(self, range: Range<usize>) -> Result<Mem> {
        if range.start > range.end || range.end > self.bytes {
            return Err(Error::InvalidArgument(format!(
                "bytes {range:?} are outside a buffer of {} bytes",
                self.bytes
            )));
        }
        Ok(Mem::new(self.addr + range.start, range.len()))
    }

    /// Elements `range` of this span read as `dtype`.
    pub fn elems(self, dtype: DType, range: Range<usize>) -> Result<Mem> {
        let e = dtype.size();
        self.slice(range.start * e..range.end * e)
    }

    /// The first `bytes` bytes.
    pub fn prefix(self, bytes: usize) -> Result<Mem> {
        self.slice(0..bytes)
    }

    /// One past the last byte.
    pub fn end(self) -> usize {
        self.addr + self.bytes
    }

    /// Whether `other` lies entirely within this span.
    pub fn contains(self, other: Mem) -> bool {
        other.addr >= self.addr && other.end() <= self.end()
    }

    /// Whether the two spans share a byte.
    pub fn overlaps(self, other: Mem) -> bool {
        self.addr < other.end() && other.addr < self.end() && self.bytes > 0 && other.bytes > 0
    }
}

/// The groups of ranks a collective can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupId {
    /// Every rank.
    World,
    /// The ranks of this rank's node.
    Intra,
    /// This rank and the ranks of the same local rank on the other nodes.
    Inter,
}

impl GroupId {
    pub fn name(self) -> &'static str {
        match self {
            GroupId::World => "world",
            GroupId::Intra => "intra-node",
            GroupId::Inter => "inter-node",
        }
    }
}

/// One sum over a group, as an algorithm asks a backend for it.
#[derive(Debug, Clone, Copy)]
pub struct GroupSum<'a> {
    /// The ranks it runs on.
    pub group: GroupId,
    /// The header every rank checks on the way, when given (its bucket
    /// also keys a result left in shared memory).
    pub tag: Option<&'a OpTag>,
    /// The elements' type.
    pub dtype: DType,
    /// Each element is divided by this before the sum (1: not divided).
    pub divisor: f64,
}

impl<'a> GroupSum<'a> {
    /// A plain sum of `dtype` elements over `group`: no header, nothing
    /// divided.
    pub fn plain(group: GroupId, dtype: DType) -> Self {
        GroupSum {
            group,
            tag: None,
            dtype,
            divisor: 1.0,
        }
    }

    /// This sum as a transport runs it, by `deadline`.
    pub fn reduction(&self, deadline: Deadline) -> Reduction<'a> {
        Reduction {
            tag: self.tag,
            bucket: self.tag.map_or(0, |t| t.bucket),
            divisor: self.divisor,
            ..Reduction::sum(self.dtype, deadline)
        }
    }
}

/// Where a reduce-scatter left the shards of a buffer.
///
/// `mine` is this rank's reduced shard: elements
/// `shard_range(n, size, rank)` of the buffer, wherever the backend keeps
/// them. `whole` is the memory holding every shard (the buffer itself, or a
/// padded copy on backends whose collectives need equal shards); the
/// matching [`Backend::allgather`] gathers there and copies back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shards {
    pub whole: Mem,
    pub mine: Mem,
}

impl Shards {
    /// The shards of `buf` (`elems` elements of `elem` bytes) in place, for
    /// a group of `size` with this rank at `rank`.
    pub fn in_place(buf: Mem, elem: usize, size: usize, rank: usize) -> Result<Self> {
        let r = shard_range(buf.bytes / elem, size, rank);
        Ok(Shards {
            whole: buf,
            mine: buf.slice(r.start * elem..r.end * elem)?,
        })
    }
}

/// Collectives and kernels on one channel's memory.
///
/// Collectives sum. On a blocking backend they are done when they return;
/// on a stream-ordered one they are enqueued in call order, and kernels are
/// enqueued on the same stream, so the order of calls is the order of work.
pub trait Backend {
    /// This rank's index in `group`.
    fn rank(&self, group: GroupId) -> usize;
    /// Number of ranks in `group` (1 for a group this backend lacks).
    fn size(&self, group: GroupId) -> usize;
    /// Whether the intra-node and inter-node groups exist.
    fn hierarchical(&self) -> bool;

    /// Bytes this rank has sent on `group` so far ([`super::Transport::bytes_sent`],
    /// or the bytes handed to NCCL's calls); 0 for a group this backend
    /// lacks. Read before and after a bucket for its counters.
    fn bytes_sent(&self, group: GroupId) -> u64;
    /// Checks that every rank of `group` is about to run `tag`. Backends
    /// that cannot check without waiting on the device do nothing.
    fn agree(&mut self, group: GroupId, tag: &OpTag) -> Result<()>;
    /// Sums `buf` over `sum.group` as `sum` says (its tag checked on the
    /// way, each element divided first, by [`Backend::div`]'s rule).
    fn allreduce(&mut self, buf: Mem, sum: &GroupSum) -> Result<()>;
    /// [`Backend::allreduce`] over the world, except that the result may be
    /// left in memory every rank of the host maps (see
    /// [`super::Transport::allreduce_shared`]; keyed by the tag's bucket):
    /// then it is returned and `buf` is scratch. This one leaves it in
    /// `buf`.
    fn allreduce_shared(&mut self, buf: Mem, sum: &GroupSum) -> Result<Option<SharedBytes>> {
        self.allreduce(buf, sum)?;
        Ok(None)
    }
    /// Sums `buf` over `group`, leaving each rank its shard.
    fn reduce_scatter(&mut self, group: GroupId, buf: Mem, dtype: DType) -> Result<Shards>;
    /// Gathers every rank's `shards.mine` (of `elem`-byte elements) into
    /// `dst`, the buffer the shards were cut from.
    fn allgather(&mut self, group: GroupId, shards: Shards, dst: Mem, elem: usize) -> Result<()>;

    /// Scratch memory for the current operation (zeroed), released when it ends.
    fn alloc(&mut self, bytes: usize) -> Result<Mem>;
    /// The Top-K residual of `key` (`bytes` bytes of float32, zero when new;
    /// [`super::sparse::StateBuf::key`] names a bucket's other buffers that
    /// live across steps, which are kept the same way).
    fn residual(&mut self, key: u64, bytes: usize) -> Result<Mem>;
    /// Drops every Top-K residual (and the other buffers kept with them).
    fn clear_residuals(&mut self);

    /// `dst = src` (equal lengths, not overlapping).
    fn copy(&mut self, src: Mem, dst: Mem) -> Result<()>;
    /// `buf[i] /= divisor`.
    fn div(&mut self, buf: Mem, dtype: DType, divisor: f64) -> Result<()>;
    /// `dst = (wire) (src * factor)`, rounding to nearest even.
    fn encode(&mut self, src: Mem, dtype: DType, factor: f64, dst: Mem, wire: DType) -> Result<()>;
    /// `dst = (dtype) (src * factor)`.
    fn decode(&mut self, src: Mem, wire: DType, factor: f64, dst: Mem, dtype: DType) -> Result<()>;
    /// The first NaN or infinity in `buf`: its element index and value.
    fn first_non_finite(&mut self, buf: Mem, dtype: DType) -> Result<Option<(usize, f64)>>;
    /// Top-K selection with error feedback on float32 `data`, see
    /// [`super::sparse`]: `residual += data`; the `k` entries of `residual`
    /// of largest magnitude (ties to the lower index) go to `out` as
    /// [`TopKBlock`] says; what was sent is subtracted from
    /// `residual`.
    fn topk_pack(&mut self, data: Mem, residual: Mem, layout: TopKBlock, out: Mem) -> Result<()>;
    /// `out = 0`, then the pairs of every block of `gathered` added into
    /// `out` (float32), block by block in rank order. `group` names the
    /// senders in errors.
    fn topk_sum(
        &mut self,
        gathered: Mem,
        layout: TopKBlock,
        out: Mem,
        group: GroupId,
        bucket: u64,
    ) -> Result<()>;

    /// Whether [`Backend::two_d`] overlaps the steps of consecutive chunks
    /// (the algorithm then cuts buckets into several).
    fn pipelines(&self) -> bool {
        false
    }
    /// The 2D allreduce `job`: per chunk, its division, a reduce-scatter
    /// inside the node, the inter-node step on this rank's shard, an
    /// allgather inside the node. Backends that do not pipeline call
    /// [`super::algo::two_d_in_order`].
    fn two_d(&mut self, job: TwoDJob<'_>) -> Result<()>;
    /// Scales float32 `buf` so that its L2 norm is at most `max_norm`: the
    /// sum of squares in float64, the norm rounded to float32, and when it
    /// is above `max_norm` (as float32) every element multiplied by
    /// `max_norm / norm` (float32).
    fn clip_norm(&mut self, buf: Mem, max_norm: f64) -> Result<()>;
    /// Runs momentum kernel `op` on `first` and `second` (of one length).
    fn momentum(&mut self, op: Momentum, first: Mem, second: Mem, momentum: f64) -> Result<()>;
    /// Zeroes the float32 entries of `buf` at the indices of `block`, one
    /// rank's block laid out as `layout` says (momentum factor masking).
    fn topk_mask(&mut self, block: Mem, layout: TopKBlock, buf: Mem) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_slice_and_compare() {
        let m = Mem::new(1000, 64);
        assert_eq!(m.slice(8..16).unwrap(), Mem::new(1008, 8));
        assert_eq!(m.elems(DType::F32, 2..4).unwrap(), Mem::new(1008, 8));
        assert!(m.slice(60..70).is_err());
        assert!(m.contains(Mem::new(1010, 54)) && !m.contains(Mem::new(1010, 55)));
        assert!(m.overlaps(Mem::new(1063, 4)) && !m.overlaps(Mem::new(1064, 4)));
        let s = Shards::in_place(m, 4, 3, 2).unwrap();
        // 16 elements in shards of 6, 6, 4.
        assert_eq!(s.mine, Mem::new(1048, 16));
    }
}

/// What the 2D allreduce does to each chunk's shard between the intra-node
/// reduce-scatter and allgather (it may run on another thread).
pub type InterStep<'a> = dyn Fn(&mut dyn Backend, Mem) -> Result<()> + Sync + 'a;

/// A 2D allreduce as the algorithm hands it to [`Backend::two_d`]: the
/// chunks (consecutive spans of one buffer of `dtype`), the divisor each
/// element is divided by before it is summed, and the inter-node step run
/// on each chunk's shard.
#[derive(Clone, Copy)]
pub struct TwoDJob<'a> {
    pub dtype: DType,
    pub divisor: f64,
    pub chunks: &'a [Mem],
    pub inter: &'a InterStep<'a>,
}

/// The two element-wise momentum kernels of DGC's momentum correction, on
/// two float32 buffers of one length (`first`, `second`), each product and
/// sum or difference rounded to float32 separately (no fused multiply-add).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Momentum {
    /// `velocity = (float32) momentum * velocity + data` (first: the
    /// velocity, second: the data).
    Step,
    /// `(data, previous) = (data - (float32) momentum * previous, data)`
    /// (first: the data, second: the previous sum).
    Correct,
}

impl Momentum {
    /// The kernel's name (the device kernels' method, a failure's subject).
    pub fn name(self) -> &'static str {
        match self {
            Momentum::Step => "momentum_step",
            Momentum::Correct => "momentum_correct",
        }
    }
}

/// One rank's block of (index, value) pairs in the allgathered buffer: `k`
/// indices (u32), then `k` values (float32 or float16), little-endian,
/// padded to a multiple of 8 bytes so that every block starts aligned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopKBlock {
    /// Elements of the dense buffer.
    pub n: usize,
    /// Pairs per rank.
    pub k: usize,
    /// Values travel as float16.
    pub fp16_values: bool,
    /// Blocks in the gathered buffer (ranks of the group).
    pub parts: usize,
}

impl TopKBlock {
    /// The layout for `n` elements at `ratio` over `parts` ranks.
    pub fn new(n: usize, ratio: f64, fp16_values: bool, parts: usize) -> Self {
        let k = ((n as f64 * ratio).ceil() as usize).clamp(1, n.max(1));
        TopKBlock {
            n,
            k,
            fp16_values,
            parts,
        }
    }

    /// Bytes per value.
    pub fn value_size(&self) -> usize {
        if self.fp16_values {
            2
        } else {
            4
        }
    }

    /// Offset of the values inside a block.
    pub fn values_offset(&self) -> usize {
        4 * self.k
    }

    /// Bytes of one block.
    pub fn bytes(&self) -> usize {
        (self.k * (4 + self.value_size())).next_multiple_of(8)
    }
}
