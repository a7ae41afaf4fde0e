//! The host backend: buffers in host memory, collectives over
//! [`Transport`]s (TCP), kernels in Rust. Every call blocks until done.
//!
//! The 2D allreduce is pipelined here: while the inter-node step of chunk
//! `k` runs on a helper thread, the channel thread runs the intra-node
//! reduce-scatter of chunk `k + 1` and the allgather of chunk `k - 1`
//! ([`HostBackend::two_d`]), so the link between nodes stays busy from the
//! first chunk to the last.

use std::collections::HashMap;
use std::sync::mpsc;

use super::algo::{two_d_in_order, Layout};
use super::backend::{Backend, GroupId, GroupSum, Mem, Momentum, Shards, TopKBlock, TwoDJob};
use super::codec;
use super::dtype::DType;
use super::mapping::SharedBytes;
use super::sparse;
use super::timeline::{self, Args};
use super::transport::{Aborter, Deadline, OpTag, Reduction, Transport};
use super::turns::Turn;
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

    /// What carries each group's bytes: `("world", medium)`, then the 2D
    /// groups' (`"intra-node"`, `"inter-node"`) when present.
    pub fn media(&self) -> Vec<(&'static str, &'static str)> {
        let mut out = vec![("world", self.world.medium())];
        if let Some(h) = &self.hierarchy {
            out.push(("intra-node", h.intra.medium()));
            out.push(("inter-node", h.inter.medium()));
        }
        out
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

/// The transports a [`HostBackend`] runs its collectives on.
pub trait GroupSet: Send {
    /// The transport of `group`, if this set has it.
    fn get(&mut self, group: GroupId) -> Option<&mut dyn Transport>;
    /// [`GroupSet::get`], shared.
    fn get_ref(&self, group: GroupId) -> Option<&dyn Transport>;
    /// Whether the intra-node and inter-node groups are both here.
    fn hierarchical(&self) -> bool;
    /// The world rank of member `index` of `group`.
    fn world_rank(&self, group: GroupId, index: usize) -> usize;
    /// The intra-node and inter-node transports, borrowed apart (for the
    /// pipelined 2D allreduce), and the layout they follow.
    fn split_two_d(&mut self) -> Option<(&mut dyn Transport, &mut dyn Transport, Layout)>;
}

impl GroupSet for Groups {
    /// The world stands in for absent 2D groups (the algorithm only asks
    /// for those when [`Groups::hierarchy`] is set).
    fn get(&mut self, group: GroupId) -> Option<&mut dyn Transport> {
        Some(match (group, self.hierarchy.as_mut()) {
            (GroupId::Intra, Some(h)) => h.intra.as_mut(),
            (GroupId::Inter, Some(h)) => h.inter.as_mut(),
            _ => self.world.as_mut(),
        })
    }

    fn get_ref(&self, group: GroupId) -> Option<&dyn Transport> {
        match (group, self.hierarchy.as_ref()) {
            (GroupId::World, _) => Some(self.world.as_ref()),
            (GroupId::Intra, Some(h)) => Some(h.intra.as_ref()),
            (GroupId::Inter, Some(h)) => Some(h.inter.as_ref()),
            _ => None,
        }
    }

    fn hierarchical(&self) -> bool {
        self.hierarchy.is_some()
    }

    fn world_rank(&self, group: GroupId, index: usize) -> usize {
        let members = match (group, &self.hierarchy) {
            (GroupId::Intra, Some(h)) => h.layout.intra_members(),
            (GroupId::Inter, Some(h)) => h.layout.inter_members(),
            _ => return index,
        };
        members.get(index).copied().unwrap_or(index)
    }

    fn split_two_d(&mut self) -> Option<(&mut dyn Transport, &mut dyn Transport, Layout)> {
        let h = self.hierarchy.as_mut()?;
        Some((h.intra.as_mut(), h.inter.as_mut(), h.layout))
    }
}

/// The inter-node group alone, lent to the pipeline's helper thread.
struct InterOnly<'a> {
    inter: &'a mut dyn Transport,
    layout: Layout,
}

impl GroupSet for InterOnly<'_> {
    fn get(&mut self, group: GroupId) -> Option<&mut dyn Transport> {
        (group == GroupId::Inter).then_some(&mut *self.inter)
    }

    fn get_ref(&self, group: GroupId) -> Option<&dyn Transport> {
        (group == GroupId::Inter).then_some(&*self.inter)
    }

    fn hierarchical(&self) -> bool {
        false
    }

    fn world_rank(&self, group: GroupId, index: usize) -> usize {
        match group {
            GroupId::Inter => self.layout.inter_members().get(index).copied(),
            _ => None,
        }
        .unwrap_or(index)
    }

    fn split_two_d(&mut self) -> Option<(&mut dyn Transport, &mut dyn Transport, Layout)> {
        None
    }
}

/// The memory of one operation: the lent buffer, scratch and residuals.
#[derive(Default)]
struct HostMem {
    lent: Option<Mem>,
    in_use: Vec<Vec<u8>>,
    pool: Vec<Vec<u8>>,
    residuals: HashMap<u64, Vec<u8>>,
}

/// A checked span as a mutable slice.
///
/// # Safety
/// `m` must have passed [`HostMem::check`] in the current operation, and no
/// other slice of the same bytes may be live while this one is.
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

impl HostMem {
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
        // other slice from this memory is live while it is.
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
        // mutably, so nothing else from this memory is live meanwhile.
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

    fn alloc(&mut self, bytes: usize) -> Mem {
        let mut v = self.pool.pop().unwrap_or_default();
        v.clear();
        v.resize(bytes, 0);
        let m = span(&v);
        self.in_use.push(v);
        m
    }
}

/// [`Backend`] over host memory and blocking transports.
///
/// An operation starts with [`HostBackend::begin`], which lends the job's
/// buffer, and ends with [`HostBackend::end`], which takes back the scratch
/// memory. A [`Mem`] is only used after checking that it lies inside the
/// lent buffer, a scratch allocation of the current operation or a
/// residual.
pub struct HostBackend<G: GroupSet = Groups> {
    pub groups: G,
    deadline: Deadline,
    mem: HostMem,
    /// This operation's turn on the link between nodes, when the engine
    /// orders them (see [`super::turns`]): taken before the first
    /// collective that crosses the link, passed on at [`HostBackend::end`].
    turn: Option<Turn>,
}

impl<G: GroupSet> HostBackend<G> {
    pub fn new(groups: G, deadline: Deadline) -> Self {
        HostBackend {
            groups,
            deadline,
            mem: HostMem::default(),
            turn: None,
        }
    }

    /// Starts an operation on `buf`, bounded by `deadline`; returns its span.
    ///
    /// # Safety
    /// `buf` must stay valid, and untouched by anything else, until
    /// [`HostBackend::end`].
    pub unsafe fn begin(&mut self, buf: &mut [u8], deadline: Deadline, turn: Option<Turn>) -> Mem {
        self.deadline = deadline;
        self.turn = turn;
        let m = span(buf);
        self.mem.lent = Some(m);
        m
    }

    /// Ends the operation: forgets the lent buffer, keeps scratch for reuse,
    /// passes the link turn on.
    pub fn end(&mut self) {
        self.turn = None;
        self.mem.lent = None;
        let mem = &mut self.mem;
        mem.pool.append(&mut mem.in_use);
    }

    /// The buffer kept across steps under `key` ([`Backend::residual`]), if
    /// there is one.
    pub fn state_buffer(&self, key: u64) -> Option<&[u8]> {
        self.mem.residuals.get(&key).map(Vec::as_slice)
    }

    /// Keeps `bytes` across steps under `key`, as [`Backend::residual`]
    /// would have (a checkpoint's buffer, [`super::state`]).
    pub fn set_state_buffer(&mut self, key: u64, bytes: Vec<u8>) {
        self.mem.residuals.insert(key, bytes);
    }

    /// `m`'s bytes, once checked to lie inside memory of the current
    /// operation.
    pub fn bytes(&mut self, m: Mem) -> Result<&mut [u8]> {
        self.mem.slice(m)
    }

    /// `group`'s transport, once it is this operation's turn on the link
    /// if `group` crosses it (every group but the intra-node one).
    fn transport(&mut self, group: GroupId) -> Result<&mut dyn Transport> {
        let crosses = group != GroupId::Intra || !self.groups.hierarchical();
        if let Some(turn) = self.turn.as_mut().filter(|_| crosses) {
            let _wait = timeline::span("link turn", Args::default());
            turn.take(self.deadline)?;
        }
        self.groups.get(group).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "host backend: no {} group in this stage",
                group.name()
            ))
        })
    }

    /// `group`'s transport and a checked slice of `m`, borrowed together.
    fn comm(&mut self, group: GroupId, m: Mem) -> Result<(&mut dyn Transport, &mut [u8])> {
        self.mem.check(m)?;
        // SAFETY: checked above; the transport never touches backend memory
        // except through this slice.
        let buf = unsafe { slice_of(m) };
        Ok((self.transport(group)?, buf))
    }

    /// The pipelined 2D allreduce of `chunks` (see the module doc).
    ///
    /// The channel thread runs the intra-node steps in the fixed order
    /// reduce-scatter 0, reduce-scatter 1, allgather 0, reduce-scatter 2,
    /// allgather 1, ... (the same on every rank, so the intra ring never
    /// sees two ranks disagree), and a helper thread runs `inter` on each
    /// chunk's shard in chunk order once its reduce-scatter is done. The
    /// allgather of chunk `k` waits for chunk `k`'s inter-node step.
    fn pipelined_two_d(&mut self, job: TwoDJob<'_>) -> Result<()> {
        let TwoDJob {
            dtype,
            divisor,
            chunks,
            inter,
        } = job;
        for &c in chunks {
            self.mem.check(c)?;
        }
        let deadline = self.deadline;
        // The helper may touch the chunks (the lent buffer, or scratch
        // holding its compressed copy) and nothing else of this operation.
        let lent = match (chunks.first(), chunks.last()) {
            (Some(first), Some(last)) => Some(Mem::new(first.addr, last.end() - first.addr)),
            _ => None,
        };
        let Some((intra, inter_transport, layout)) = self.groups.split_two_d() else {
            return two_d_in_order(self, job);
        };
        let abort_inter = inter_transport.aborter();
        // The link is crossed by the helper: it takes the turn (if not
        // already held) and passes it on when its last chunk is through.
        let turn = self.turn.take();
        let (isize, irank) = (intra.size(), intra.rank());
        let (ready_tx, ready_rx) = mpsc::channel::<Mem>();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let bucket = timeline::current_bucket();
        let thread = std::thread::current();
        let helper_name = format!("{} inter-node", thread.name().unwrap_or("tiacc-comm"));
        std::thread::scope(|scope| {
            let helper = std::thread::Builder::new().name(helper_name).spawn_scoped(
                scope,
                move || -> Result<()> {
                    let _bucket = timeline::on_bucket(bucket);
                    let mut stage = HostBackend::new(
                        InterOnly {
                            inter: inter_transport,
                            layout,
                        },
                        deadline,
                    );
                    stage.mem.lent = lent;
                    stage.turn = turn;
                    // Ends when the channel thread stops sending (done, or failed).
                    for (k, shard) in ready_rx.into_iter().enumerate() {
                        let _chunk = timeline::span("chunk", chunk_args(shard, k));
                        inter(&mut stage, shard)?;
                        if done_tx.send(()).is_err() {
                            break;
                        }
                    }
                    Ok(())
                },
            );
            let helper = match helper {
                Ok(helper) => helper,
                Err(e) => {
                    return Err(Error::Comm {
                        peer: None,
                        message: format!(
                            "cannot start the inter-node stage of the 2D allreduce: {e}"
                        ),
                    })
                }
            };
            let run = || -> Result<()> {
                // SAFETY (every slice below): chunks are disjoint spans of the
                // lent buffer (checked above). This thread touches chunk `k`
                // (reduce-scatter) and chunk `k - 1` (allgather, after its
                // inter-node step reported done); the helper only touches the
                // shard of a chunk between its reduce-scatter and its done
                // message, so no byte has two live slices at once.
                let shard_of =
                    |c: Mem| Shards::in_place(c, dtype.size(), isize, irank).map(|s| s.mine);
                let gather = |intra: &mut dyn Transport, k: usize| -> Result<()> {
                    let waited = timeline::span("wait for inter-node", chunk_args(chunks[k], k));
                    done_rx.recv().map_err(|_| stage_stopped())?;
                    drop(waited);
                    let _span = timeline::span("allgather", intra_args(chunks[k], k));
                    intra.allgather(unsafe { slice_of(chunks[k]) }, dtype.size(), deadline)
                };
                for (k, &c) in chunks.iter().enumerate() {
                    let scattered = timeline::span("reduce-scatter", intra_args(c, k));
                    // The division rides on the reduce-scatter's copies
                    // (shared memory divides while it copies; TCP first).
                    let how = Reduction {
                        divisor,
                        ..Reduction::sum(dtype, deadline)
                    };
                    intra.reduce_scatter_with(unsafe { slice_of(c) }, &how)?;
                    drop(scattered);
                    ready_tx.send(shard_of(c)?).map_err(|_| stage_stopped())?;
                    if k > 0 {
                        gather(&mut *intra, k - 1)?;
                    }
                }
                drop(ready_tx);
                match chunks.len() {
                    0 => Ok(()),
                    n => gather(&mut *intra, n - 1),
                }
            };
            let result = run();
            if result.is_err() {
                // The helper may wait on a peer for this chunk: end it now.
                abort_inter();
            }
            let helped = helper.join().unwrap_or_else(|_| {
                Err(Error::Comm {
                    peer: None,
                    message: "the inter-node stage of the 2D allreduce panicked".into(),
                })
            });
            // The helper's own failure is the cause when both failed.
            helped.and(result)
        })
    }
}

fn stage_stopped() -> Error {
    Error::Comm {
        peer: None,
        message: "the inter-node stage of the 2D allreduce stopped".into(),
    }
}

impl<G: GroupSet> Backend for HostBackend<G> {
    fn rank(&self, group: GroupId) -> usize {
        self.groups.get_ref(group).map_or(0, |t| t.rank())
    }

    fn size(&self, group: GroupId) -> usize {
        self.groups.get_ref(group).map_or(1, |t| t.size())
    }

    fn hierarchical(&self) -> bool {
        self.groups.hierarchical()
    }

    fn bytes_sent(&self, group: GroupId) -> u64 {
        self.groups.get_ref(group).map_or(0, |t| t.bytes_sent())
    }

    fn agree(&mut self, group: GroupId, tag: &OpTag) -> Result<()> {
        let deadline = self.deadline;
        let _span = timeline::span(
            "agree",
            Args {
                group: Some(group.name()),
                ..Args::default()
            },
        );
        self.transport(group)?.agree(tag, deadline)
    }

    fn allreduce(&mut self, buf: Mem, sum: &GroupSum) -> Result<()> {
        let _span = timeline::span("allreduce", group_args(sum.group, buf));
        let how = sum.reduction(self.deadline);
        let (t, s) = self.comm(sum.group, buf)?;
        t.allreduce_with(s, &how)
    }

    fn allreduce_shared(&mut self, buf: Mem, sum: &GroupSum) -> Result<Option<SharedBytes>> {
        let _span = timeline::span("allreduce", group_args(sum.group, buf));
        let how = sum.reduction(self.deadline);
        let (t, s) = self.comm(sum.group, buf)?;
        t.allreduce_shared(s, &how)
    }

    fn reduce_scatter(&mut self, group: GroupId, buf: Mem, dtype: DType) -> Result<Shards> {
        let _span = timeline::span("reduce-scatter", group_args(group, buf));
        let deadline = self.deadline;
        let (t, s) = self.comm(group, buf)?;
        t.reduce_scatter(s, dtype, deadline)?;
        let (size, rank) = (t.size(), t.rank());
        Shards::in_place(buf, dtype.size(), size, rank)
    }

    fn allgather(&mut self, group: GroupId, shards: Shards, dst: Mem, elem: usize) -> Result<()> {
        let _span = timeline::span("allgather", group_args(group, dst));
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
        Ok(self.mem.alloc(bytes))
    }

    fn residual(&mut self, key: u64, bytes: usize) -> Result<Mem> {
        let v = self.mem.residuals.entry(key).or_default();
        if v.len() != bytes {
            *v = vec![0; bytes];
        }
        Ok(span(v))
    }

    fn clear_residuals(&mut self) {
        self.mem.residuals.clear();
    }

    fn copy(&mut self, src: Mem, dst: Mem) -> Result<()> {
        same_length(src, dst)?;
        let (s, d) = self.mem.pair(src, dst)?;
        d.copy_from_slice(s);
        Ok(())
    }

    fn div(&mut self, buf: Mem, dtype: DType, divisor: f64) -> Result<()> {
        let _span = timeline::span("divide", bytes_args(buf));
        dtype.div_assign(self.mem.slice(buf)?, divisor);
        Ok(())
    }

    fn encode(&mut self, src: Mem, dtype: DType, factor: f64, dst: Mem, wire: DType) -> Result<()> {
        let _span = timeline::span("encode", bytes_args(src));
        let (s, d) = self.mem.pair(src, dst)?;
        codec::encode(s, dtype, factor, d, wire);
        Ok(())
    }

    fn decode(&mut self, src: Mem, wire: DType, factor: f64, dst: Mem, dtype: DType) -> Result<()> {
        let _span = timeline::span("decode", bytes_args(dst));
        let (s, d) = self.mem.pair(src, dst)?;
        codec::decode(s, wire, factor, d, dtype);
        Ok(())
    }

    fn first_non_finite(&mut self, buf: Mem, dtype: DType) -> Result<Option<(usize, f64)>> {
        let _span = timeline::span("NaN check", bytes_args(buf));
        Ok(codec::first_non_finite(self.mem.slice(buf)?, dtype))
    }

    fn topk_pack(&mut self, data: Mem, residual: Mem, layout: TopKBlock, out: Mem) -> Result<()> {
        for m in [data, residual, out] {
            self.mem.check(m)?;
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
        let (g, o) = self.mem.pair(gathered, out)?;
        sparse::sum(g, layout, o, |r| {
            let peer = peers.get(r).copied().unwrap_or(r);
            (peer, format!("rank {rank}: bucket {bucket}: rank {peer}"))
        })
    }

    fn pipelines(&self) -> bool {
        true
    }

    fn two_d(&mut self, job: TwoDJob<'_>) -> Result<()> {
        if job.chunks.len() < 2 {
            return two_d_in_order(self, job);
        }
        self.pipelined_two_d(job)
    }

    fn clip_norm(&mut self, buf: Mem, max_norm: f64) -> Result<()> {
        sparse::clip_norm(self.mem.slice(buf)?, max_norm);
        Ok(())
    }

    fn momentum(&mut self, op: Momentum, first: Mem, second: Mem, momentum: f64) -> Result<()> {
        same_length(first, second)?;
        let (a, b) = self.mem.pair_mut(first, second)?;
        sparse::momentum(op, a, b, momentum);
        Ok(())
    }

    fn topk_mask(&mut self, block: Mem, layout: TopKBlock, buf: Mem) -> Result<()> {
        if block.bytes < layout.values_offset() {
            return Err(Error::InvalidArgument(
                "host backend: a Top-K block shorter than its indices".into(),
            ));
        }
        let (k, b) = self.mem.pair(block, buf)?;
        sparse::mask_sent(k, layout, b);
        Ok(())
    }
}

/// A timeline event's `args` for chunk `k` of a pipelined 2D allreduce.
fn chunk_args(m: Mem, k: usize) -> Args {
    Args {
        chunk: Some(k),
        ..bytes_args(m)
    }
}

/// [`chunk_args`] of an intra-node step.
fn intra_args(m: Mem, k: usize) -> Args {
    Args {
        group: Some(GroupId::Intra.name()),
        ..chunk_args(m, k)
    }
}

/// A timeline event's `args` for a step over `group` on `m`.
fn group_args(group: GroupId, m: Mem) -> Args {
    Args {
        group: Some(group.name()),
        ..bytes_args(m)
    }
}

/// A timeline event's `args` for a step on `m`.
fn bytes_args(m: Mem) -> Args {
    Args {
        bytes: Some(m.bytes as u64),
        ..Args::default()
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
