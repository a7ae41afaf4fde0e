//! The host backend: buffers in host memory, collectives over
//! [`Transport`]s (TCP), kernels in Rust. Every call blocks until done.

use std::collections::HashMap;

use super::algo::Layout;
use super::backend::{Backend, GroupId, Mem, Shards};
use super::codec;
use super::dtype::DType;
use super::sparse::{self, TopKBlock};
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
    /// Which world ranks the two groups hold.
    pub layout: Layout,
}

impl Groups {
    /// Groups of the world only.
    pub fn flat(world: Box<dyn Transport>) -> Self {
        Groups {
            world,
            hierarchy: None,
        }
    }

    /// The transport of `group`; the world stands in for absent 2D groups
    /// (the algorithm only asks for those when [`Groups::hierarchy`] is set).
    fn get(&mut self, group: GroupId) -> &mut dyn Transport {
        match (group, self.hierarchy.as_mut()) {
            (GroupId::Intra, Some(h)) => h.intra.as_mut(),
            (GroupId::Inter, Some(h)) => h.inter.as_mut(),
            _ => self.world.as_mut(),
        }
    }

    fn get_ref(&self, group: GroupId) -> Option<&dyn Transport> {
        match (group, self.hierarchy.as_ref()) {
            (GroupId::World, _) => Some(self.world.as_ref()),
            (GroupId::Intra, Some(h)) => Some(h.intra.as_ref()),
            (GroupId::Inter, Some(h)) => Some(h.inter.as_ref()),
            _ => None,
        }
    }

    /// The world rank of member `index` of `group`.
    pub fn world_rank(&self, group: GroupId, index: usize) -> usize {
        let members = match (group, &self.hierarchy) {
            (GroupId::Intra, Some(h)) => h.layout.intra_members(),
            (GroupId::Inter, Some(h)) => h.layout.inter_members(),
            _ => return index,
        };
        members.get(index).copied().unwrap_or(index)
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

/// [`Backend`] over host memory and blocking transports.
///
/// An operation starts with [`HostBackend::begin`], which lends the job's
/// buffer, and ends with [`HostBackend::end`], which takes back the scratch
/// memory. A [`Mem`] is only used after checking that it lies inside the
/// lent buffer, a scratch allocation of the current operation or a
/// residual.
pub struct HostBackend {
    pub groups: Groups,
    deadline: Deadline,
    lent: Option<Mem>,
    in_use: Vec<Vec<u8>>,
    pool: Vec<Vec<u8>>,
    residuals: HashMap<u64, Vec<u8>>,
}

/// A checked span as a mutable slice.
///
/// # Safety
/// `m` must have passed [`HostBackend::check`] in the current operation,
/// and no other slice of the same bytes may be live while this one is.
unsafe fn slice_of<'a>(m: Mem) -> &'a mut [u8] {
    if m.bytes == 0 {
        return &mut [];
    }
    // SAFETY: the caller's contract: `m` lies inside memory this backend
    // owns (a Vec not resized while handed out) or was lent exclusively for
    // the operation, and the slice is the only access to it.
    unsafe { std::slice::from_raw_parts_mut(m.addr as *mut u8, m.bytes) }
}

fn span(v: &[u8]) -> Mem {
    Mem::new(v.as_ptr() as usize, v.len())
}

impl HostBackend {
    pub fn new(groups: Groups, deadline: Deadline) -> Self {
        HostBackend {
            groups,
            deadline,
            lent: None,
            in_use: Vec::new(),
            pool: Vec::new(),
            residuals: HashMap::new(),
        }
    }

    /// Starts an operation on `buf`, bounded by `deadline`; returns its span.
    ///
    /// # Safety
    /// `buf` must stay valid, and untouched by anything else, until
    /// [`HostBackend::end`].
    pub unsafe fn begin(&mut self, buf: &mut [u8], deadline: Deadline) -> Mem {
        self.deadline = deadline;
        let m = span(buf);
        self.lent = Some(m);
        m
    }

    /// Ends the operation: forgets the lent buffer, keeps scratch for reuse.
    pub fn end(&mut self) {
        self.lent = None;
        self.pool.append(&mut self.in_use);
    }

    /// Errors unless `m` lies inside memory of the current operation.
    fn check(&self, m: Mem) -> Result<()> {
        let known = m.bytes == 0
            || self.lent.is_some_and(|l| l.contains(m))
            || self.in_use.iter().any(|v| span(v).contains(m))
            || self.residuals.values().any(|v| span(v).contains(m));
        if known {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "host backend: {} bytes at {:#x} are not memory of the current operation",
                m.bytes, m.addr
            )))
        }
    }

    fn slice(&mut self, m: Mem) -> Result<&mut [u8]> {
        self.check(m)?;
        // SAFETY: checked above; the slice borrows `self` mutably, so no
        // other slice from this backend is live while it is.
        Ok(unsafe { slice_of(m) })
    }

    /// A source and a destination that do not overlap.
    fn pair(&mut self, src: Mem, dst: Mem) -> Result<(&[u8], &mut [u8])> {
        self.check(src)?;
        self.check(dst)?;
        if src.overlaps(dst) {
            return Err(Error::InvalidArgument(
                "host backend: source and destination overlap".into(),
            ));
        }
        // SAFETY: both checked above and disjoint; both borrow `self`
        // mutably, so nothing else from this backend is live meanwhile.
        Ok(unsafe { (&*slice_of(src), slice_of(dst)) })
    }

    /// Two buffers that do not overlap, both writable.
    fn pair_mut(&mut self, a: Mem, b: Mem) -> Result<(&mut [u8], &mut [u8])> {
        self.check(a)?;
        self.check(b)?;
        if a.overlaps(b) {
            return Err(Error::InvalidArgument(
                "host backend: element-wise operands overlap".into(),
            ));
        }
        // SAFETY: both checked above and disjoint; both borrow `self`
        // mutably, so nothing else from this backend is live meanwhile.
        Ok(unsafe { (slice_of(a), slice_of(b)) })
    }

    /// `group`'s transport and a checked slice of `m`, borrowed together.
    fn comm(&mut self, group: GroupId, m: Mem) -> Result<(&mut dyn Transport, &mut [u8])> {
        self.check(m)?;
        // SAFETY: checked above; the transport never touches backend memory
        // except through this slice.
        let buf = unsafe { slice_of(m) };
        Ok((self.groups.get(group), buf))
    }
}

impl Backend for HostBackend {
    fn rank(&self, group: GroupId) -> usize {
        self.groups.get_ref(group).map_or(0, |t| t.rank())
    }

    fn size(&self, group: GroupId) -> usize {
        self.groups.get_ref(group).map_or(1, |t| t.size())
    }

    fn hierarchical(&self) -> bool {
        self.groups.hierarchy.is_some()
    }

    fn agree(&mut self, group: GroupId, tag: &OpTag) -> Result<()> {
        let deadline = self.deadline;
        self.groups.get(group).agree(tag, deadline)
    }

    fn allreduce(
        &mut self,
        group: GroupId,
        tag: Option<&OpTag>,
        buf: Mem,
        dtype: DType,
    ) -> Result<()> {
        let deadline = self.deadline;
        let (t, s) = self.comm(group, buf)?;
        match tag {
            Some(tag) => t.allreduce_checked(tag, s, dtype, deadline),
            None => t.allreduce(s, dtype, deadline),
        }
    }

    fn reduce_scatter(&mut self, group: GroupId, buf: Mem, dtype: DType) -> Result<Shards> {
        let deadline = self.deadline;
        let (t, s) = self.comm(group, buf)?;
        t.reduce_scatter(s, dtype, deadline)?;
        let (size, rank) = (t.size(), t.rank());
        Shards::in_place(buf, dtype.size(), size, rank)
    }

    fn allgather(&mut self, group: GroupId, shards: Shards, dst: Mem, elem: usize) -> Result<()> {
        if shards.whole != dst {
            return Err(Error::InvalidArgument(
                "host backend: shards are gathered where they were cut".into(),
            ));
        }
        let deadline = self.deadline;
        let (t, s) = self.comm(group, dst)?;
        t.allgather(s, elem, deadline)
    }

    fn alloc(&mut self, bytes: usize) -> Result<Mem> {
        let mut v = self.pool.pop().unwrap_or_default();
        v.clear();
        v.resize(bytes, 0);
        let m = span(&v);
        self.in_use.push(v);
        Ok(m)
    }

    fn residual(&mut self, key: u64, bytes: usize) -> Result<Mem> {
        let v = self.residuals.entry(key).or_default();
        if v.len() != bytes {
            *v = vec![0; bytes];
        }
        Ok(span(v))
    }

    fn clear_residuals(&mut self) {
        self.residuals.clear();
    }

    fn div(&mut self, buf: Mem, dtype: DType, divisor: f64) -> Result<()> {
        dtype.div_assign(self.slice(buf)?, divisor);
        Ok(())
    }

    fn encode(&mut self, src: Mem, dtype: DType, factor: f64, dst: Mem, wire: DType) -> Result<()> {
        let (s, d) = self.pair(src, dst)?;
        codec::encode(s, dtype, factor, d, wire);
        Ok(())
    }

    fn decode(&mut self, src: Mem, wire: DType, factor: f64, dst: Mem, dtype: DType) -> Result<()> {
        let (s, d) = self.pair(src, dst)?;
        codec::decode(s, wire, factor, d, dtype);
        Ok(())
    }

    fn first_non_finite(&mut self, buf: Mem, dtype: DType) -> Result<Option<(usize, f64)>> {
        Ok(codec::first_non_finite(self.slice(buf)?, dtype))
    }

    fn topk_pack(&mut self, data: Mem, residual: Mem, layout: TopKBlock, out: Mem) -> Result<()> {
        for m in [data, residual, out] {
            self.check(m)?;
        }
        if data.overlaps(residual) || data.overlaps(out) || residual.overlaps(out) {
            return Err(Error::InvalidArgument(
                "host backend: Top-K buffers overlap".into(),
            ));
        }
        // SAFETY: all three checked above and pairwise disjoint; they borrow
        // nothing else of this backend while the kernel runs.
        let (d, r, o) = unsafe { (&*slice_of(data), slice_of(residual), slice_of(out)) };
        sparse::pack(d, r, layout, o);
        Ok(())
    }

    fn topk_sum(
        &mut self,
        gathered: Mem,
        layout: TopKBlock,
        out: Mem,
        group: GroupId,
        bucket: u64,
    ) -> Result<()> {
        let rank = self.rank(GroupId::World);
        let peers: Vec<usize> = (0..layout.parts)
            .map(|r| self.groups.world_rank(group, r))
            .collect();
        let (g, o) = self.pair(gathered, out)?;
        sparse::sum(g, layout, o, |r| {
            let peer = peers.get(r).copied().unwrap_or(r);
            (peer, format!("rank {rank}: bucket {bucket}: rank {peer}"))
        })
    }

    fn clip_norm(&mut self, buf: Mem, max_norm: f64) -> Result<()> {
        sparse::clip_norm(self.slice(buf)?, max_norm);
        Ok(())
    }

    fn momentum_step(&mut self, velocity: Mem, data: Mem, momentum: f64) -> Result<()> {
        same_length(velocity, data)?;
        let (d, u) = self.pair(data, velocity)?;
        sparse::momentum_step(u, d, momentum);
        Ok(())
    }

    fn topk_mask(&mut self, block: Mem, layout: TopKBlock, buf: Mem) -> Result<()> {
        if block.bytes < layout.values_offset() {
            return Err(Error::InvalidArgument(
                "host backend: a Top-K block shorter than its indices".into(),
            ));
        }
        let (k, b) = self.pair(block, buf)?;
        sparse::mask_sent(k, layout, b);
        Ok(())
    }

    fn momentum_correct(&mut self, data: Mem, previous: Mem, momentum: f64) -> Result<()> {
        same_length(data, previous)?;
        let (d, p) = self.pair_mut(data, previous)?;
        sparse::momentum_correct(d, p, momentum);
        Ok(())
    }
}

/// Errors unless two element-wise operands have the same length.
fn same_length(a: Mem, b: Mem) -> Result<()> {
    if a.bytes == b.bytes {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "host backend: element-wise operands of {} and {} bytes",
            a.bytes, b.bytes
        )))
    }
}
