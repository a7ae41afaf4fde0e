//! The collectives: how a buffer is cut into pieces that pass through
//! the slots, and the `Transport` implementation built on them.

use std::ops::Range;
use std::sync::Arc;

use super::segment::{create_file, open_file};
use super::{ShmGroup, NO_CULPRIT, PAGE, REGION_BYTES, SETS};
use crate::comm::dtype::{shard_range, DType, ReduceOp};
use crate::comm::mapping::{map_shared, Mapping, SharedBytes};
use crate::comm::transport::{check_root, Aborter, Deadline, OpTag, Reduction, Transport};
use crate::error::{Error, Result};

impl ShmGroup {
    /// Elements of every shard that one piece carries.
    fn piece_elems(&self, elem: usize) -> usize {
        (self.seg.slot / self.size / elem).max(1)
    }

    fn next_set(&mut self) -> usize {
        let set = (self.pieces % SETS as u64) as usize;
        self.pieces += 1;
        set
    }

    /// How a buffer of `bytes` bytes (elements of `elem`) is cut.
    fn cut(&self, bytes: usize, elem: usize) -> Cut {
        let shards: Vec<Range<usize>> = (0..self.size)
            .map(|s| shard_range(bytes / elem, self.size, s))
            .collect();
        let c = self.piece_elems(elem);
        let pieces = shards[0].len().div_ceil(c);
        Cut {
            shards,
            c,
            elem,
            pieces,
        }
    }

    /// The region for the result of bucket `key.0` of `key.1` bytes: kept
    /// from an earlier allreduce, or made now by every member together
    /// (after agreeing on `tag`, so that they make the same one); `None`
    /// when results cannot stay in shared memory.
    fn region(
        &mut self,
        key: (u64, usize),
        tag: Option<&OpTag>,
        deadline: Deadline,
    ) -> Result<Option<Arc<Mapping>>> {
        self.shared_runs += 1;
        let now = self.shared_runs;
        if let Some(i) = self.regions.iter().position(|(k, ..)| *k == key) {
            let (_, _, region) = self.regions.remove(i);
            self.regions.push((key, now, Arc::clone(&region)));
            return Ok(Some(region));
        }
        if !self.sharing || key.1 == 0 {
            return Ok(None);
        }
        // Every member holds the same regions (they see the same
        // allreduces), so they drop the same ones: those not used in the
        // last round over every region, least recent first.
        let stale = now.saturating_sub(self.regions.len() as u64 + 1);
        let mut kept: usize = self.regions.iter().map(|(k, ..)| k.1).sum();
        while kept + key.1 > REGION_BYTES && self.regions.first().is_some_and(|r| r.1 < stale) {
            kept -= self.regions.remove(0).0 .1;
        }
        if kept + key.1 > REGION_BYTES {
            return Ok(None);
        }
        if let Some(tag) = tag {
            self.exchange_tags(tag, deadline)?;
        }
        let what = "making a shared result";
        let len = key.1.div_ceil(PAGE) * PAGE;
        // 1. Member 0 creates the file and posts its name (1, name) or 0.
        let mut cell = [0u8; OpTag::LEN];
        let mut created = None;
        if self.rank == 0 {
            // An error here is a full `/dev/shm`: the results stay private.
            if let Ok((path, fd)) = create_file(len) {
                let name = path.trim_start_matches("/dev/shm/").as_bytes();
                if name.len() < cell.len() {
                    cell[0] = 1;
                    cell[1..=name.len()].copy_from_slice(name);
                    created = Some(fd);
                } else {
                    // SAFETY: closing our own descriptor once.
                    unsafe { libc::close(fd) };
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        let cells = self.exchange_cells(&cell, deadline, what)?;
        if cells[0][0] != 1 {
            self.sharing = false;
            return Ok(None);
        }
        let end = cells[0][1..]
            .iter()
            .position(|b| *b == 0)
            .map_or(cells[0].len(), |e| e + 1);
        let path = format!("/dev/shm/{}", String::from_utf8_lossy(&cells[0][1..end]));
        // 2. Everyone maps it and says whether that worked.
        let fd = match created {
            Some(fd) => Ok(fd),
            None => open_file(&path),
        };
        let mapped = fd.and_then(|fd| {
            let base = map_shared(fd, len).map_err(|e| format!("cannot map {path}: {e}"));
            // SAFETY: closing our own descriptor once; a mapping stays valid.
            unsafe { libc::close(fd) };
            base
        });
        let ok = [u8::from(mapped.is_ok()); OpTag::LEN];
        let oks = self.exchange_cells(&ok, deadline, what)?;
        if self.rank == 0 {
            // Every member has opened it: the memory now lives as long as
            // a mapping does, even after a crash.
            let _ = std::fs::remove_file(&path);
        }
        let region = mapped.map(|base| Arc::new(Mapping { base, len }));
        if oks.iter().any(|c| c[0] != 1) {
            self.sharing = false;
            return Ok(None);
        }
        let region = region.map_err(|message| Error::Comm {
            peer: None,
            message,
        })?;
        self.regions.push((key, now, Arc::clone(&region)));
        Ok(Some(region))
    }

    /// Sums or gathers `buf` through the slots, as `pass` says. A sum
    /// writes the others' parts divided by `pass.divisor` (once per
    /// element, as `DType::div_assign` would) and divides our own part in
    /// place just before summing it; a tag travels with the first piece and
    /// is checked after its barrier, before `buf` changes.
    fn pieces_through(&mut self, buf: &mut [u8], pass: &Pass, deadline: Deadline) -> Result<()> {
        let cut = self.cut(buf.len(), pass.elem);
        if cut.pieces == 0 {
            // No piece for the header to travel with.
            return pass
                .tag
                .map_or(Ok(()), |tag| self.exchange_tags(tag, deadline));
        }
        let r = self.rank;
        let mut tag_set = pass.tag.map(|tag| (self.post_tag(tag), tag));
        // The set of the piece whose sums the others still have to read.
        let mut summed: Option<(usize, usize)> = None;
        for k in 0..cut.pieces {
            let set = self.next_set();
            // Write the parts the others need: their shards (sum) or our
            // own (gather). Our own shard's part stays in `buf` for a sum.
            let mut written = 0;
            for j in 0..self.size {
                if pass.sum.is_some() != (j == r) {
                    let part = cut.part(j, k);
                    let src = &buf[part];
                    let dst = self.own_slot(set, cut.sub(j), src.len());
                    match pass.sum {
                        Some(dtype) if pass.divisor != 1.0 => {
                            dtype.div_into(src, dst, pass.divisor)
                        }
                        _ => dst.copy_from_slice(src),
                    }
                    written += src.len() as u64;
                }
            }
            self.sent += written;
            self.barrier_wait(deadline, pass.what)?;
            if let Some((tag_set, tag)) = tag_set.take() {
                self.check_tags(tag_set, tag)?;
            }
            // Every member wrote its sums of the previous piece before
            // arriving at this barrier.
            if let Some((prev_set, prev)) = summed.take() {
                self.gather_piece(buf, &cut, prev_set, prev);
            }
            match pass.sum {
                Some(dtype) => {
                    let part = cut.part(r, k);
                    if pass.into.is_some() || pass.gather {
                        // The sums of our shard, which the others read.
                        self.sent += part.len() as u64;
                    }
                    let mine = &mut buf[part.clone()];
                    if pass.divisor != 1.0 {
                        dtype.div_assign(mine, pass.divisor);
                    }
                    match pass.into {
                        Some(region) => {
                            // SAFETY: our own shard's bytes of the region
                            // (`part` lies in a buffer of the region's
                            // length); only this member writes them, and no
                            // member reads them before the last barrier.
                            let out = unsafe {
                                std::slice::from_raw_parts_mut(
                                    region.base.add(part.start),
                                    part.len(),
                                )
                            };
                            self.sum_piece(mine, out, &cut, set, pass);
                        }
                        None => {
                            let acc = self.own_slot(set, cut.sub(r), mine.len());
                            self.sum_piece(mine, acc, &cut, set, pass);
                            mine.copy_from_slice(acc);
                            if pass.gather {
                                summed = Some((set, k));
                            }
                        }
                    }
                }
                None => self.gather_piece(buf, &cut, set, k),
            }
        }
        if let Some((set, k)) = summed {
            self.barrier_wait(deadline, pass.what)?;
            self.gather_piece(buf, &cut, set, k);
        } else if pass.into.is_some() {
            // Every sum is in the region before anyone reads it.
            self.barrier_wait(deadline, pass.what)?;
        }
        Ok(())
    }

    /// Sums this member's part `mine` of a piece (set `set`) in the ring's
    /// order into `acc`: sub-chunk `r` of our own slot, where the others
    /// read it after the next barrier, or our shard's bytes of a region.
    fn sum_piece(&self, mine: &[u8], acc: &mut [u8], cut: &Cut, set: usize, pass: &Pass) {
        let (p, r) = (self.size, self.rank);
        let (at, len) = (cut.sub(r), mine.len());
        let (dtype, op) = (pass.sum.unwrap_or(DType::U8), pass.op);
        acc.copy_from_slice(self.slot(set, (r + 1) % p, at, len));
        for step in 2..p {
            dtype.reduce_assign(op, acc, self.slot(set, (r + step) % p, at, len));
        }
        // Our own values last, as on the ring.
        dtype.reduce_assign(op, acc, mine);
    }

    /// Copies every other member's part of piece `k` (set `set`) into `buf`.
    fn gather_piece(&self, buf: &mut [u8], cut: &Cut, set: usize, k: usize) {
        for j in (0..self.size).filter(|&j| j != self.rank) {
            let dst = &mut buf[cut.part(j, k)];
            dst.copy_from_slice(self.slot(set, j, cut.sub(j), dst.len()));
        }
    }
}

/// How [`ShmGroup::pieces_through`] cuts a buffer: the members' shards (in
/// elements, as the ring's), the elements of every shard one piece
/// carries, and the number of pieces.
struct Cut {
    shards: Vec<Range<usize>>,
    c: usize,
    elem: usize,
    pieces: usize,
}

impl Cut {
    /// Where sub-chunk `j` (the part of shard `j`) starts in a slot, in bytes.
    fn sub(&self, j: usize) -> usize {
        j * self.c * self.elem
    }

    /// The bytes of `buf` that piece `k` carries of shard `s`.
    fn part(&self, s: usize, k: usize) -> Range<usize> {
        let shard = &self.shards[s];
        let start = (shard.start + k * self.c).min(shard.end);
        let end = (start + self.c).min(shard.end);
        start * self.elem..end * self.elem
    }
}

/// What one run of [`ShmGroup::pieces_through`] does.
struct Pass<'a> {
    /// Sum this member's shard in this type; `None`: only gather.
    sum: Option<DType>,
    /// How the shard's elements are combined (a sum unless torch asked
    /// for another reduction).
    op: ReduceOp,
    /// Bytes per element.
    elem: usize,
    /// Gather every shard back after the sums (allreduce) or not
    /// (reduce-scatter).
    gather: bool,
    /// Every element is divided by this before any sum (1: not at all).
    divisor: f64,
    /// The collective's header, checked against every member's.
    tag: Option<&'a OpTag>,
    /// Where the sums go instead of `buf` and the gather (an allreduce
    /// whose result stays in shared memory).
    into: Option<&'a Mapping>,
    /// What the members wait in, for messages.
    what: &'static str,
}

impl<'a> Pass<'a> {
    /// Reduces as `how` says (its tag checked on the way, its divisor
    /// applied while the parts are copied into the slots) and gathers the
    /// result back into the buffer, nothing kept in shared memory.
    fn reduce(how: &Reduction<'a>, what: &'static str) -> Self {
        Pass {
            sum: Some(how.dtype),
            op: how.op,
            elem: how.dtype.size(),
            gather: true,
            divisor: how.divisor,
            tag: how.tag,
            into: None,
            what,
        }
    }
}

impl Transport for ShmGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn medium(&self) -> &'static str {
        "shared memory"
    }

    fn bytes_sent(&self) -> u64 {
        self.sent
    }

    fn agree(&mut self, tag: &OpTag, deadline: Deadline) -> Result<()> {
        self.guarded(|g| g.exchange_tags(tag, deadline))
    }

    /// The tag travels with the first piece (no barrier of its own), and
    /// the division happens while the parts are copied into the slots.
    fn allreduce_with(&mut self, buf: &mut [u8], how: &Reduction) -> Result<()> {
        let pass = Pass::reduce(how, "allreduce");
        self.guarded(|g| g.pieces_through(buf, &pass, how.deadline))
    }

    /// The sums go into a region every member maps, and nothing is
    /// gathered (module docs).
    fn allreduce_shared(&mut self, buf: &mut [u8], how: &Reduction) -> Result<Option<SharedBytes>> {
        let len = buf.len();
        let key = (how.bucket, len);
        let region = self.guarded(|g| g.region(key, how.tag, how.deadline))?;
        let Some(region) = region else {
            self.allreduce_with(buf, how)?;
            return Ok(None);
        };
        let pass = Pass {
            gather: false,
            into: Some(&region),
            ..Pass::reduce(how, "allreduce")
        };
        self.guarded(|g| g.pieces_through(buf, &pass, how.deadline))?;
        Ok(Some(SharedBytes::new(region, len)))
    }

    fn reduce_scatter_with(&mut self, buf: &mut [u8], how: &Reduction) -> Result<()> {
        let pass = Pass {
            gather: false,
            ..Pass::reduce(how, "reduce-scatter")
        };
        self.guarded(|g| g.pieces_through(buf, &pass, how.deadline))
    }

    fn allgather(&mut self, buf: &mut [u8], elem_size: usize, deadline: Deadline) -> Result<()> {
        let pass = Pass {
            op: ReduceOp::Sum,
            sum: None,
            elem: elem_size.max(1),
            gather: true,
            divisor: 1.0,
            tag: None,
            into: None,
            what: "allgather",
        };
        self.guarded(|g| g.pieces_through(buf, &pass, deadline))
    }

    fn broadcast(&mut self, buf: &mut [u8], root: usize, deadline: Deadline) -> Result<()> {
        check_root(root, self.size)?;
        self.guarded(|g| {
            let slot = g.seg.slot;
            for start in (0..buf.len()).step_by(slot) {
                let piece = start..(start + slot).min(buf.len());
                let set = g.next_set();
                if g.rank == root {
                    let src = &buf[piece.clone()];
                    g.own_slot(set, 0, src.len()).copy_from_slice(src);
                    g.sent += src.len() as u64;
                }
                g.barrier_wait(deadline, "broadcast")?;
                if g.rank != root {
                    let dst = &mut buf[piece];
                    dst.copy_from_slice(g.slot(set, root, 0, dst.len()));
                }
            }
            Ok(())
        })
    }

    fn barrier(&mut self, deadline: Deadline) -> Result<()> {
        self.guarded(|g| g.barrier_wait(deadline, "barrier"))
    }

    fn abort(&mut self) {
        self.seg.abort(NO_CULPRIT);
        self.broken.aborted();
    }

    fn aborter(&self) -> Aborter {
        let seg = Arc::clone(&self.seg);
        Box::new(move || seg.abort(NO_CULPRIT))
    }
}
