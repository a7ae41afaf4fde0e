//! Shared memory between the ranks of one host.
//!
//! A group whose members all run on the same host (the world on one node,
//! or the intra-node group of the 2D allreduce) moves its data through one
//! shared mapping per channel instead of loopback TCP: no system call and
//! no kernel copy per byte, only memory copies and the sums.
//!
//! The group is first formed as a TCP ring ([`super::tcp`]); [`attach`]
//! then checks over that ring that every member sees the same host, and
//! member 0 creates the mapping. If any step fails (another host, another
//! user, a full `/dev/shm`), every member keeps the TCP ring, so the choice
//! is always the same on all members.
//!
//! # Layout and protocol
//!
//! ```text
//! control page   per member: the barrier count it reached (own cache line)
//!                the wake-up word (a futex), the abort word
//! tags           two sets x members x 32 bytes (collective headers)
//! data           three sets x members x slot bytes
//! ```
//!
//! A collective runs in pieces, one barrier each. For piece k every member
//! writes what the others need into its slot of set `k % 3`, waits at the
//! barrier, then reads from the others' slots. A buffer's elements are
//! split into the same shards as the ring's ([`shard_range`]), and each
//! slot holds a sub-chunk of every shard, so member `s` alone sums shard `s`
//! (into its own slot), in the ring's order (member `s + 1` first, `s`
//! last): results are bit for bit those of the TCP ring. An allreduce reads
//! the sums of piece k after the barrier of piece k + 1 (every member
//! reaches it only once its sum of piece k is written), so it needs one
//! barrier per piece, plus one at the end. A set is written again three
//! pieces later, after a barrier every member reaches only once done
//! reading it. A checked allreduce writes its header into the tag cells
//! with the first piece and compares them after that piece's barrier
//! (before its buffer changes), so it needs no barrier of its own; DDP's
//! division by the world size is done while the parts are copied into the
//! slots, each element divided once, exactly as the ring divides it.
//!
//! # Results left in shared memory
//!
//! [`ShmGroup::allreduce_shared`] (DDP's buckets) skips the gather: each
//! member writes the sums of its shard into a region of its own mapping
//! that every member maps, one region per bucket, and every member reads
//! the whole result from there (DDP copies it into the gradients, which it
//! would otherwise do from the bucket). That saves a third of the bytes a
//! member moves. A region is written again only by the next allreduce of
//! the same bucket and length, after its first barrier, which every member
//! reaches only once it is done with the previous result (DDP reads it
//! before the next backward pass). Member 0 creates a region the first
//! time a bucket needs it; when `/dev/shm` cannot hold it, every member
//! falls back to the gather for good.
//!
//! Waits spin briefly, then sleep on the futex; the last member to arrive
//! wakes the others. While sleeping, a member checks the deadline, the
//! abort word and whether the members it waits for still exist (their
//! process ids), so a killed peer is named at once and a stopped one at the
//! timeout, as with TCP.
//!
//! [`shard_range`]: crate::comm::dtype::shard_range
//! [`ShmGroup::allreduce_shared`]: crate::comm::Transport::allreduce_shared

mod attach;
mod collective;
mod segment;

pub use attach::attach;
pub(crate) use attach::NOT_ONE_HOST;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::mapping::Mapping;
use super::transport::{check_agreement, Deadline, Failed, OpTag};
use crate::error::{Error, Result};
use segment::{futex_wait, process_alive, Segment};

/// Bytes of one set of slots (all members together); a piece of a
/// collective moves at most this much per member and set.
const SET_BYTES: usize = 4 << 20;
/// Sets of slots, used in turn by successive pieces.
const SETS: usize = 3;
/// Most bytes of results a group keeps in shared memory. Beyond it, the
/// regions no allreduce used lately go (those of DDP's first buckets,
/// before it rebuilt them), then a new bucket's result stays private.
const REGION_BYTES: usize = 2 << 30;
/// Smallest slot, for groups of many members.
const MIN_SLOT: usize = 64 << 10;
/// Members one control page holds (one cache line each after the header).
pub const MAX_MEMBERS: usize = 60;
const PAGE: usize = 4096;
const LINE: usize = 64;
const MAGIC: u64 = 0x5449_4143_4353_484d; // "TIACCSHM"
/// Offsets in the control page.
const WAKE: usize = LINE;
const ABORT: usize = 2 * LINE;
const WAITERS: usize = 3 * LINE;
const ARRIVED: usize = 4 * LINE;
/// How long one sleep lasts before the deadline, the abort word and the
/// peers' processes are checked again.
const SLEEP_SLICE: Duration = Duration::from_millis(20);
/// Busy polls before sleeping: short, since ranks may share cores.
const SPINS: u32 = 64;
/// Abort word of an abort that names no member.
const NO_CULPRIT: u32 = u32::MAX;
/// The abort word holds 1 + the culprit member in its low bits and what
/// happened in its top byte, so that every member raises the same kind of
/// error as the one that saw the failure, whoever reports first.
const KIND_SHIFT: u32 = 24;
const KIND_FAILED: u32 = 1;
const KIND_TIMED_OUT: u32 = 2;

/// A group of members on one host, moving data through shared memory.
pub struct ShmGroup {
    seg: Arc<Segment>,
    rank: usize,
    size: usize,
    channel: usize,
    /// Process id of each member, to tell a dead peer from a slow one.
    pids: Vec<i32>,
    /// Each member's address, for messages.
    hosts: Vec<String>,
    /// World rank of each member and the group's name, for messages.
    members: Vec<usize>,
    group: &'static str,
    /// Barriers this member has passed.
    barriers: u64,
    /// Pieces run so far (the set of piece k is `k % SETS`).
    pieces: u64,
    /// Tag exchanges so far.
    agreements: u64,
    /// Results kept in shared memory by (bucket, bytes), with the count of
    /// shared allreduces when each was last used, the least recent first.
    regions: Vec<((u64, usize), u64, Arc<Mapping>)>,
    /// Shared allreduces so far.
    shared_runs: u64,
    /// Whether results may stay in shared memory (off once `/dev/shm` could
    /// not hold a region, on every member alike).
    sharing: bool,
    broken: Failed,
    /// Bytes this member wrote into shared memory for the others to read.
    sent: u64,
}

impl ShmGroup {
    fn world(&self, member: usize) -> usize {
        self.members.get(member).copied().unwrap_or(member)
    }

    fn ctx(&self, what: &str) -> String {
        let group = if self.group == "world" {
            "shared memory".to_string()
        } else {
            format!("{} ring, shared memory", self.group)
        };
        format!(
            "rank {} channel {} ({group}): {what}",
            self.world(self.rank),
            self.channel
        )
    }

    fn check_usable(&self) -> Result<()> {
        self.broken.check(|what| self.ctx(what))
    }

    /// Runs `f`; a failure marks the group unusable and tells the peers.
    fn guarded<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.check_usable()?;
        let result = f(self);
        if let Err(err) = &result {
            let peer = self.broken.record(err);
            // Peers blocked in this group stop at once, naming the culprit.
            let culprit = peer
                .and_then(|p| self.members.iter().position(|m| *m == p))
                .unwrap_or(self.rank);
            let kind = match err {
                Error::CommTimeout { .. } => KIND_TIMED_OUT,
                _ => KIND_FAILED,
            };
            self.seg.abort((kind << KIND_SHIFT) | (1 + culprit as u32));
        }
        result
    }

    /// Waits until every member has passed as many barriers as this one.
    fn barrier_wait(&mut self, deadline: Deadline, what: &str) -> Result<()> {
        self.barriers += 1;
        let target = self.barriers;
        let seg = Arc::clone(&self.seg);
        seg.arrived(self.rank).store(target, Ordering::SeqCst);
        let all_in =
            |seg: &Segment| (0..self.size).all(|m| seg.arrived(m).load(Ordering::SeqCst) >= target);
        if all_in(&seg) {
            // Complete, whatever a member that passed it did since (an abort
            // shows at the next barrier): as for a member that was waiting,
            // so that every member reports a failure seen after a barrier
            // (a header check) the same way, and not as an abort it caused.
            seg.wake();
            return Ok(());
        }
        let mut spins = 0u32;
        loop {
            let seen = seg.u32_at(WAKE).load(Ordering::SeqCst);
            if all_in(&seg) {
                return Ok(());
            }
            self.check_abort()?;
            if spins < SPINS {
                spins += 1;
                if spins % 16 == 0 {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            let remaining = deadline.remaining();
            let late: Vec<usize> = (0..self.size)
                .filter(|&m| seg.arrived(m).load(Ordering::SeqCst) < target)
                .collect();
            if let Some(&dead) = late.iter().find(|&&m| !process_alive(self.pids[m])) {
                return Err(self.exited(dead, what));
            }
            if remaining.is_zero() {
                let names: Vec<String> = late.iter().map(|&m| self.world(m).to_string()).collect();
                let first = late.first().map_or(0, |&m| self.world(m));
                return Err(Error::CommTimeout {
                    peer: first,
                    message: self.ctx(&format!(
                        "timed out after {:.1}s waiting for rank {} during {what} (ranks that \
                         had not arrived: {})",
                        deadline.timeout.as_secs_f64(),
                        first,
                        names.join(", ")
                    )),
                });
            }
            let waiters = seg.u32_at(WAITERS);
            waiters.fetch_add(1, Ordering::SeqCst);
            if !all_in(&seg) && seg.u32_at(ABORT).load(Ordering::SeqCst) == 0 {
                futex_wait(seg.u32_at(WAKE), seen, remaining.min(SLEEP_SLICE));
            }
            waiters.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn check_abort(&self) -> Result<()> {
        let code = self.seg.u32_at(ABORT).load(Ordering::SeqCst);
        if code == 0 {
            return Ok(());
        }
        let kind = code >> KIND_SHIFT;
        let member = ((code & ((1 << KIND_SHIFT) - 1)) as usize).wrapping_sub(1);
        if code == NO_CULPRIT || member == self.rank || member >= self.size {
            return Err(Error::Comm {
                peer: None,
                message: self.ctx("the group was aborted after a failure on another channel"),
            });
        }
        let peer = self.world(member);
        if kind == KIND_TIMED_OUT {
            return Err(Error::CommTimeout {
                peer,
                message: self.ctx(&format!(
                    "the group was aborted: a member timed out waiting for rank {peer}"
                )),
            });
        }
        if !process_alive(self.pids[member]) {
            return Err(self.exited(member, "a collective"));
        }
        Err(Error::Comm {
            peer: Some(peer),
            message: self.ctx(&format!(
                "the group was aborted after a failure involving rank {peer} (see the first \
                 error reported)"
            )),
        })
    }

    /// The error for member `m`, whose process is gone.
    fn exited(&self, m: usize, what: &str) -> Error {
        let peer = self.world(m);
        Error::Comm {
            peer: Some(peer),
            message: self.ctx(&format!(
                "rank {peer} at {} (process {}) exited during {what} (it was killed or failed; \
                 see its own error)",
                self.hosts[m], self.pids[m]
            )),
        }
    }

    /// Bytes `at..at + len` of member `m`'s slot of set `set`.
    fn slot(&self, set: usize, m: usize, at: usize, len: usize) -> &[u8] {
        debug_assert!(at + len <= self.seg.slot, "shared-memory slot overrun");
        // SAFETY: inside member m's slot: callers stay within it (a piece
        // carries at most `piece_elems` of every shard; a broadcast piece
        // is at most a slot). By the protocol (module docs) no member
        // writes this set again before every member reaches a barrier that
        // it only reaches once done reading.
        unsafe { std::slice::from_raw_parts(self.seg.slot_ptr(set, m).add(at), len) }
    }

    /// Bytes `at..at + len` of this member's own slot of set `set`.
    #[allow(clippy::mut_from_ref)]
    fn own_slot(&self, set: usize, at: usize, len: usize) -> &mut [u8] {
        debug_assert!(at + len <= self.seg.slot, "shared-memory slot overrun");
        // SAFETY: inside our own slot (see `slot`); by the protocol only
        // this member touches it until it passes the next barrier, and the
        // callers hold one such slice at a time, over bytes that neither
        // `buf` nor the other members' slots share.
        unsafe { std::slice::from_raw_parts_mut(self.seg.slot_ptr(set, self.rank).add(at), len) }
    }

    /// Writes our tag into its cell (the next of the two sets); returns
    /// the set, whose cells every member reads after the next barrier.
    fn post_tag(&mut self, tag: &OpTag) -> usize {
        self.post_cell(&tag.encode())
    }

    /// Writes `mine` into our cell of the next set of tag cells; returns
    /// the set, whose cells every member reads after the next barrier.
    fn post_cell(&mut self, mine: &[u8; OpTag::LEN]) -> usize {
        let set = (self.agreements % 2) as usize;
        self.agreements += 1;
        // SAFETY: our own 32-byte tag cell; no member reads it before the
        // next barrier, nor writes it (same parity) before the one after.
        unsafe {
            std::ptr::copy_nonoverlapping(
                mine.as_ptr(),
                self.seg.tag_ptr(set, self.rank),
                mine.len(),
            )
        };
        set
    }

    /// Posts our tag, waits for every member's and compares them.
    fn exchange_tags(&mut self, tag: &OpTag, deadline: Deadline) -> Result<()> {
        let set = self.post_tag(tag);
        self.barrier_wait(deadline, "exchanging collective headers")?;
        self.check_tags(set, tag)
    }

    /// Every member's cell of set `set` (posted before the barrier just
    /// passed).
    fn cells(&self, set: usize) -> Vec<[u8; OpTag::LEN]> {
        (0..self.size)
            .map(|m| {
                let mut bytes = [0u8; OpTag::LEN];
                // SAFETY: member m's tag cell, written before the barrier.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        self.seg.tag_ptr(set, m),
                        bytes.as_mut_ptr(),
                        bytes.len(),
                    )
                };
                bytes
            })
            .collect()
    }

    /// Posts `mine`, waits for every member's and returns them all.
    fn exchange_cells(
        &mut self,
        mine: &[u8; OpTag::LEN],
        deadline: Deadline,
        what: &str,
    ) -> Result<Vec<[u8; OpTag::LEN]>> {
        let set = self.post_cell(mine);
        self.barrier_wait(deadline, what)?;
        Ok(self.cells(set))
    }

    /// Compares every member's tag of set `set` (posted before the barrier
    /// just passed) with ours.
    fn check_tags(&self, set: usize, tag: &OpTag) -> Result<()> {
        let tags: Vec<Option<OpTag>> = self.cells(set).iter().map(|c| OpTag::decode(c)).collect();
        check_agreement(&tags, tag, |m| self.world(m), |m| self.ctx(m))
    }
}
