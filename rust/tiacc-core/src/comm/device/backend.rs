//! The device backend: [`Backend`] over buffers that a framework owns
//! (torch tensors), reduced through NCCL communicators enqueued on a
//! stream, or through the TCP rings when the buffers are host memory (how
//! the bindings' tests run this code without a GPU). The framework's
//! kernels come through [`Kernels`].

use std::collections::HashMap;
use std::sync::Arc;

use super::kernels::{KernelError, Kernels, Span};
use crate::comm::algo::two_d_in_order;
use crate::comm::auto::Probing;
use crate::comm::backend::{Backend, GroupId, GroupSum, Mem, Momentum, Shards, TopKBlock, TwoDJob};
use crate::comm::dtype::{shard_range, DType};
use crate::comm::host::Groups;
use crate::comm::nccl::{DevicePtr, NcclCommunicator, ReduceOp};
use crate::comm::transport::{Deadline, OpTag, Transport};
use crate::error::{Error, Result};

/// The bucket number the `auto` probe's errors carry (no bucket of a model).
pub const PROBE_BUCKET: u64 = u64::MAX;

fn dptr(addr: usize) -> DevicePtr {
    DevicePtr(addr as *mut std::ffi::c_void)
}

fn sptr(addr: usize) -> *mut std::ffi::c_void {
    addr as *mut std::ffi::c_void
}

/// A device buffer and the memory it covers.
pub struct Slot<B> {
    pub buffer: B,
    pub mem: Mem,
}

/// The NCCL communicators of one channel.
pub struct NcclGroups {
    pub world: Arc<NcclCommunicator>,
    /// Intra-node and inter-node communicators, with the 2D allreduce.
    pub two_d: Option<(Arc<NcclCommunicator>, Arc<NcclCommunicator>)>,
}

impl NcclGroups {
    pub fn get(&self, group: GroupId) -> &Arc<NcclCommunicator> {
        match (group, &self.two_d) {
            (GroupId::Intra, Some((intra, _))) => intra,
            (GroupId::Inter, Some((_, inter))) => inter,
            _ => &self.world,
        }
    }

    /// The world communicator, then the 2D ones when present.
    pub fn all(&self) -> Vec<Arc<NcclCommunicator>> {
        let mut out = vec![self.world.clone()];
        if let Some((a, e)) = &self.two_d {
            out.push(a.clone());
            out.push(e.clone());
        }
        out
    }
}

/// A channel's collectives.
pub enum Comms {
    Nccl(NcclGroups),
    /// TCP rings over host memory (CPU tensors only).
    Tcp(Groups),
}

/// [`Backend`] over a framework's device buffers, for one operation.
pub struct DeviceBackend<'a, K: Kernels> {
    pub kernels: &'a K,
    pub comms: &'a mut Comms,
    pub residuals: &'a mut HashMap<u64, Slot<K::Buffer>>,
    /// The operation's buffer (when it has one), then its scratch buffers.
    pub slots: Vec<Slot<K::Buffer>>,
    /// The stream NCCL enqueues on (0 for TCP).
    pub stream: usize,
    pub deadline: Deadline,
    pub world_rank: usize,
    /// The bucket, for errors ([`PROBE_BUCKET`]: the `auto` probe).
    pub bucket: u64,
}

impl<K: Kernels> DeviceBackend<'_, K> {
    /// The buffer holding `m`, and `m`'s byte offset in it.
    fn find(&self, m: Mem) -> Result<(&K::Buffer, usize)> {
        self.slots
            .iter()
            .chain(self.residuals.values())
            .find(|s| s.mem.contains(m))
            .map(|s| (&s.buffer, m.addr - s.mem.addr))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "device backend: {} bytes at {:#x} are not memory of the current operation",
                    m.bytes, m.addr
                ))
            })
    }

    /// `m` as a kernel takes it.
    fn arg(&self, m: Mem) -> Result<Span<'_, K::Buffer>> {
        let (buffer, offset) = self.find(m)?;
        Ok(Span {
            buffer,
            offset,
            bytes: m.bytes,
        })
    }

    /// A kernel's failure as this rank's error.
    fn failed(&self, name: &str, e: KernelError) -> Error {
        let what = match self.bucket {
            PROBE_BUCKET => "the auto probe".to_string(),
            b => format!("bucket {b}"),
        };
        Error::Comm {
            peer: Some(self.world_rank),
            message: format!(
                "rank {}: {what}: the {name} kernel failed: {}",
                self.world_rank, e.0
            ),
        }
    }

    fn new_slot(&mut self, bytes: usize) -> Result<Slot<K::Buffer>> {
        let (buffer, mem) = self
            .kernels
            .empty(bytes)
            .map_err(|e| self.failed("empty", e))?;
        Ok(Slot { buffer, mem })
    }

    /// `m` as a host slice (TCP collectives on CPU tensors).
    fn host(&self, m: Mem) -> Result<&'static mut [u8]> {
        self.find(m)?;
        if m.bytes == 0 {
            return Ok(&mut []);
        }
        // SAFETY: `m` lies inside a tensor this operation holds (checked
        // above), whose memory is host memory: the engine only takes the TCP
        // transport for CPU tensors (the shim's contract, as for the host
        // engine). The slice is only used by the one collective it is made
        // for, while the tensor is alive and nothing else touches it.
        Ok(unsafe { std::slice::from_raw_parts_mut(m.addr as *mut u8, m.bytes) })
    }

    fn tcp(&mut self, group: GroupId) -> Result<&mut dyn Transport> {
        let Comms::Tcp(groups) = &mut *self.comms else {
            return Err(Error::InvalidArgument(
                "device backend: a TCP collective on an NCCL channel".into(),
            ));
        };
        Ok(match (group, groups.hierarchy.as_mut()) {
            (GroupId::Intra, Some(h)) => h.intra.as_mut(),
            (GroupId::Inter, Some(h)) => h.inter.as_mut(),
            _ => groups.world.as_mut(),
        })
    }

    /// Reduce-scatter of equal chunks of `whole` (`chunk` elements each),
    /// in place: this rank's chunk is reduced where it lies.
    fn reduce_scatter_equal(
        &mut self,
        group: GroupId,
        whole: Mem,
        chunk: usize,
        dtype: DType,
    ) -> Result<()> {
        let (deadline, stream, rank) = (self.deadline, self.stream, self.rank(group));
        let size = self.size(group);
        // NCCL's in-place form: the receive buffer is this rank's chunk of
        // the send buffer. Both transports get these same pointers.
        let (send, recv) = (whole.addr, whole.addr + rank * chunk * dtype.size());
        match &*self.comms {
            Comms::Nccl(g) => {
                let comm = g.get(group).clone();
                self.kernels.unlocked(move || {
                    // SAFETY: `whole` is device memory of a live tensor of
                    // this operation holding `chunk * size` elements (the
                    // caller padded it), `recv` is this rank's chunk inside
                    // it, and the tensors stay alive for the stream (the
                    // shim's record_stream).
                    unsafe {
                        comm.reduce_scatter(
                            dptr(send),
                            dptr(recv),
                            chunk,
                            dtype,
                            ReduceOp::Sum,
                            sptr(stream),
                        )
                    }
                })
            }
            Comms::Tcp(_) => {
                let span = in_place(send, recv, chunk * dtype.size(), size, rank, true)?;
                let buf = self.host(span)?;
                let kernels = self.kernels;
                let t = self.tcp(group)?;
                kernels.unlocked(move || t.reduce_scatter(buf, dtype, deadline))
            }
        }
    }

    /// Allgather of equal chunks of `whole` (`chunk` bytes each), in place.
    fn allgather_equal(&mut self, group: GroupId, whole: Mem, chunk: usize) -> Result<()> {
        let (deadline, stream, rank) = (self.deadline, self.stream, self.rank(group));
        let size = self.size(group);
        // NCCL's in-place form: the send buffer is this rank's chunk of the
        // receive buffer. Both transports get these same pointers.
        let (send, recv) = (whole.addr + rank * chunk, whole.addr);
        match &*self.comms {
            Comms::Nccl(g) => {
                let comm = g.get(group).clone();
                self.kernels.unlocked(move || {
                    // SAFETY: as in `reduce_scatter_equal`: `whole` holds
                    // `chunk * size` bytes and `send` is this rank's chunk
                    // inside it.
                    unsafe { comm.all_gather_bytes(dptr(send), dptr(recv), chunk, sptr(stream)) }
                })
            }
            Comms::Tcp(_) => {
                let span = in_place(send, recv, chunk, size, rank, false)?;
                let buf = self.host(span)?;
                let kernels = self.kernels;
                let t = self.tcp(group)?;
                kernels.unlocked(move || t.allgather(buf, 1, deadline))
            }
        }
    }
}

/// The whole buffer of an in-place collective on equal chunks of
/// `chunk_bytes`, checking NCCL's in-place rule: this rank's chunk of the
/// whole buffer is the receive buffer (`scatter`) or the send buffer.
fn in_place(
    send: usize,
    recv: usize,
    chunk_bytes: usize,
    size: usize,
    rank: usize,
    scatter: bool,
) -> Result<Mem> {
    let (whole, mine) = if scatter { (send, recv) } else { (recv, send) };
    if mine != whole + rank * chunk_bytes {
        return Err(Error::InvalidArgument(format!(
            "device backend: not an in-place collective: rank {rank}'s chunk at {mine:#x}, \
             expected {:#x}",
            whole + rank * chunk_bytes
        )));
    }
    Ok(Mem::new(whole, chunk_bytes * size))
}

impl<K: Kernels> Backend for DeviceBackend<'_, K> {
    fn rank(&self, group: GroupId) -> usize {
        match &*self.comms {
            Comms::Nccl(g) => g.get(group).rank(),
            Comms::Tcp(g) => match (group, &g.hierarchy) {
                (GroupId::Intra, Some(h)) => h.intra.rank(),
                (GroupId::Inter, Some(h)) => h.inter.rank(),
                _ => g.world.rank(),
            },
        }
    }

    fn size(&self, group: GroupId) -> usize {
        match &*self.comms {
            Comms::Nccl(g) => g.get(group).size(),
            Comms::Tcp(g) => match (group, &g.hierarchy) {
                (GroupId::Intra, Some(h)) => h.intra.size(),
                (GroupId::Inter, Some(h)) => h.inter.size(),
                _ => g.world.size(),
            },
        }
    }

    fn hierarchical(&self) -> bool {
        match &*self.comms {
            Comms::Nccl(g) => g.two_d.is_some(),
            Comms::Tcp(g) => g.hierarchy.is_some(),
        }
    }

    /// NCCL: the bytes handed to the group's communicator; TCP: what its
    /// ring sent.
    fn bytes_sent(&self, group: GroupId) -> u64 {
        match &*self.comms {
            Comms::Nccl(g) => match (group, &g.two_d) {
                (GroupId::World, _) => g.world.bytes_given(),
                (_, None) => 0,
                (_, Some(_)) => g.get(group).bytes_given(),
            },
            Comms::Tcp(g) => match (group, &g.hierarchy) {
                (GroupId::World, _) => g.world.bytes_sent(),
                (GroupId::Intra, Some(h)) => h.intra.bytes_sent(),
                (GroupId::Inter, Some(h)) => h.inter.bytes_sent(),
                (_, None) => 0,
            },
        }
    }

    fn agree(&mut self, group: GroupId, tag: &OpTag) -> Result<()> {
        // NCCL cannot compare tags without waiting on the device; DDP gives
        // every rank the same bucket layout.
        if matches!(&*self.comms, Comms::Nccl(_)) {
            return Ok(());
        }
        let (deadline, tag) = (self.deadline, *tag);
        let kernels = self.kernels;
        let t = self.tcp(group)?;
        kernels.unlocked(move || t.agree(&tag, deadline))
    }

    /// The division is the backend's own kernel ([`Backend::div`]), before
    /// the sum.
    fn allreduce(&mut self, buf: Mem, sum: &GroupSum) -> Result<()> {
        let (group, dtype) = (sum.group, sum.dtype);
        if sum.divisor != 1.0 {
            self.div(buf, dtype, sum.divisor)?;
        }
        let (deadline, stream, tag) = (self.deadline, self.stream, sum.tag.copied());
        match &*self.comms {
            Comms::Nccl(g) => {
                self.find(buf)?;
                let comm = g.get(group).clone();
                let (addr, count) = (buf.addr, buf.bytes / dtype.size());
                self.kernels.unlocked(move || {
                    // SAFETY: `buf` lies inside a live device tensor of this
                    // operation (checked above) holding `count` elements,
                    // on the channel stream's device; the tensor stays alive
                    // for the stream (the shim's record_stream).
                    unsafe {
                        comm.all_reduce(
                            dptr(addr),
                            dptr(addr),
                            count,
                            dtype,
                            ReduceOp::Sum,
                            sptr(stream),
                        )
                    }
                })
            }
            Comms::Tcp(_) => {
                let s = self.host(buf)?;
                let kernels = self.kernels;
                let t = self.tcp(group)?;
                kernels.unlocked(move || {
                    let plain = GroupSum::plain(group, dtype);
                    let tagged = GroupSum {
                        tag: tag.as_ref(),
                        ..plain
                    };
                    t.allreduce_with(s, &tagged.reduction(deadline))
                })
            }
        }
    }

    fn reduce_scatter(&mut self, group: GroupId, buf: Mem, dtype: DType) -> Result<Shards> {
        let (size, rank, e) = (self.size(group), self.rank(group), dtype.size());
        let n = buf.bytes / e;
        let chunk = n.div_ceil(size);
        // Collectives on equal chunks: pad into scratch when `n` does not
        // split evenly (the valid elements of every chunk are the same as
        // `shard_range`'s).
        let whole = if n % size == 0 {
            buf
        } else {
            let padded = self.alloc(chunk * size * e)?;
            self.copy(buf, padded.prefix(buf.bytes)?)?;
            padded
        };
        self.reduce_scatter_equal(group, whole, chunk, dtype)?;
        let valid = shard_range(n, size, rank).len();
        let start = rank * chunk * e;
        Ok(Shards {
            whole,
            mine: whole.slice(start..start + valid * e)?,
        })
    }

    fn allgather(&mut self, group: GroupId, shards: Shards, dst: Mem, _elem: usize) -> Result<()> {
        let size = self.size(group);
        if shards.whole.bytes % size != 0 || shards.whole.bytes < dst.bytes {
            return Err(Error::InvalidArgument(format!(
                "device backend: {} bytes of shards do not split into {size} equal chunks \
                 covering {} bytes",
                shards.whole.bytes, dst.bytes
            )));
        }
        self.allgather_equal(group, shards.whole, shards.whole.bytes / size)?;
        if shards.whole != dst {
            self.copy(shards.whole.prefix(dst.bytes)?, dst)?;
        }
        Ok(())
    }

    /// Stream-ordered: the chunks run one after another on the channel's
    /// stream (the algorithm hands over a single chunk, see `pipelines`).
    fn two_d(&mut self, job: TwoDJob<'_>) -> Result<()> {
        two_d_in_order(self, job)
    }

    fn alloc(&mut self, bytes: usize) -> Result<Mem> {
        let slot = self.new_slot(bytes)?;
        let mem = slot.mem;
        self.slots.push(slot);
        Ok(mem)
    }

    fn residual(&mut self, key: u64, bytes: usize) -> Result<Mem> {
        if let Some(s) = self.residuals.get(&key).filter(|s| s.mem.bytes == bytes) {
            return Ok(s.mem);
        }
        let slot = self.new_slot(bytes)?;
        let mem = slot.mem;
        self.residuals.insert(key, slot);
        Ok(mem)
    }

    fn clear_residuals(&mut self) {
        self.residuals.clear();
    }

    fn copy(&mut self, src: Mem, dst: Mem) -> Result<()> {
        same_length(src.bytes, dst.bytes)?;
        let (s, d) = (self.arg(src)?, self.arg(dst)?);
        self.kernels.copy(s, d).map_err(|e| self.failed("copy", e))
    }

    fn div(&mut self, buf: Mem, dtype: DType, divisor: f64) -> Result<()> {
        let b = self.arg(buf)?;
        self.kernels
            .div(b, dtype, divisor)
            .map_err(|e| self.failed("div", e))
    }

    fn encode(&mut self, src: Mem, dtype: DType, factor: f64, dst: Mem, wire: DType) -> Result<()> {
        let (s, d) = (self.arg(src)?, self.arg(dst)?);
        self.kernels
            .cast(s, dtype, factor, d, wire)
            .map_err(|e| self.failed("cast", e))
    }

    fn decode(&mut self, src: Mem, wire: DType, factor: f64, dst: Mem, dtype: DType) -> Result<()> {
        let (s, d) = (self.arg(src)?, self.arg(dst)?);
        self.kernels
            .cast(s, wire, factor, d, dtype)
            .map_err(|e| self.failed("cast", e))
    }

    fn first_non_finite(&mut self, buf: Mem, dtype: DType) -> Result<Option<(usize, f64)>> {
        let b = self.arg(buf)?;
        self.kernels
            .first_non_finite(b, dtype)
            .map_err(|e| self.failed("first_non_finite", e))
    }

    fn topk_pack(&mut self, data: Mem, residual: Mem, layout: TopKBlock, out: Mem) -> Result<()> {
        let (d, r, o) = (self.arg(data)?, self.arg(residual)?, self.arg(out)?);
        self.kernels
            .topk_pack(d, r, o, layout)
            .map_err(|e| self.failed("topk_pack", e))
    }

    fn topk_sum(
        &mut self,
        gathered: Mem,
        layout: TopKBlock,
        out: Mem,
        _group: GroupId,
        _bucket: u64,
    ) -> Result<()> {
        let (g, o) = (self.arg(gathered)?, self.arg(out)?);
        self.kernels
            .topk_sum(g, o, layout)
            .map_err(|e| self.failed("topk_sum", e))
    }

    fn clip_norm(&mut self, buf: Mem, max_norm: f64) -> Result<()> {
        let b = self.arg(buf)?;
        self.kernels
            .clip_norm(b, max_norm)
            .map_err(|e| self.failed("clip_norm", e))
    }

    fn momentum(&mut self, op: Momentum, first: Mem, second: Mem, momentum: f64) -> Result<()> {
        same_length(first.bytes, second.bytes)?;
        let (a, b) = (self.arg(first)?, self.arg(second)?);
        self.kernels
            .momentum(op, a, b, momentum)
            .map_err(|e| self.failed(op.name(), e))
    }

    fn topk_mask(&mut self, block: Mem, layout: TopKBlock, buf: Mem) -> Result<()> {
        if block.bytes < layout.values_offset() {
            return Err(Error::InvalidArgument(
                "device backend: a Top-K block shorter than its indices".into(),
            ));
        }
        let (k, b) = (self.arg(block)?, self.arg(buf)?);
        self.kernels
            .topk_mask(k, layout, b)
            .map_err(|e| self.failed("topk_mask", e))
    }
}

/// Errors unless two element-wise operands have the same length in bytes.
fn same_length(a: usize, b: usize) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "device backend: element-wise operands of {a} and {b} bytes"
        )))
    }
}

/// What the `auto` probe needs besides the collectives: the kernels move
/// its timings in and out of device memory and wait for the device.
impl<K: Kernels> Probing for DeviceBackend<'_, K> {
    fn write(&mut self, dst: Mem, src: &[u8]) -> Result<()> {
        same_length(dst.bytes, src.len())?;
        let d = self.arg(dst)?;
        self.kernels
            .load(d, src)
            .map_err(|e| self.failed("load", e))
    }

    fn read(&mut self, src: Mem, dst: &mut [u8]) -> Result<()> {
        let s = self.arg(src)?;
        let bytes = self.kernels.fetch(s).map_err(|e| self.failed("fetch", e))?;
        if bytes.len() != dst.len() {
            return Err(Error::InvalidArgument(format!(
                "device backend: the fetch kernel gave {} bytes, {} were asked for",
                bytes.len(),
                dst.len()
            )));
        }
        dst.copy_from_slice(&bytes);
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        self.kernels
            .synchronize()
            .map_err(|e| self.failed("synchronize", e))
    }
}
