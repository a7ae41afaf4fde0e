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

use std::ffi::CString;
use std::ops::Range;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::dtype::{shard_range, DType, ReduceOp};
use super::mapping::{map_shared, Mapping, SharedBytes};
use super::tcp::TcpRing;
use super::transport::{check_agreement, Aborter, Deadline, Failed, OpTag, Transport};
use crate::error::{Error, Result};

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

/// The mapping, shared by the group and its aborter.
struct Segment {
    map: Mapping,
    members: usize,
    slot: usize,
}

impl Segment {
    fn layout(members: usize) -> (usize, usize) {
        let slot = (SET_BYTES / members).max(MIN_SLOT) / LINE * LINE;
        let tags = (2 * members * OpTag::LEN).div_ceil(PAGE) * PAGE;
        (slot, PAGE + tags + SETS * members * slot)
    }

    /// Maps the file `fd` (of `Segment::layout(members).1` bytes).
    fn map(fd: i32, members: usize) -> std::io::Result<Segment> {
        let (slot, len) = Segment::layout(members);
        Ok(Segment {
            map: Mapping {
                base: map_shared(fd, len)?,
                len,
            },
            members,
            slot,
        })
    }

    fn u64_at(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset % LINE == 0 && offset + 8 <= PAGE);
        // SAFETY: the offset is inside the control page, 8-byte aligned (the
        // mapping is page aligned), and that memory is only ever accessed
        // through atomics of this width, by every process.
        unsafe { &*(self.map.base.add(offset) as *const AtomicU64) }
    }

    fn u32_at(&self, offset: usize) -> &AtomicU32 {
        debug_assert!(offset % LINE == 0 && offset + 4 <= PAGE);
        // SAFETY: as in `u64_at`, for a 4-byte atomic.
        unsafe { &*(self.map.base.add(offset) as *const AtomicU32) }
    }

    fn arrived(&self, member: usize) -> &AtomicU64 {
        self.u64_at(ARRIVED + member * LINE)
    }

    fn tag_ptr(&self, set: usize, member: usize) -> *mut u8 {
        let at = PAGE + (set * self.members + member) * OpTag::LEN;
        // SAFETY: inside the tag area of the mapping (see `layout`).
        unsafe { self.map.base.add(at) }
    }

    fn slot_ptr(&self, set: usize, member: usize) -> *mut u8 {
        let tags = (2 * self.members * OpTag::LEN).div_ceil(PAGE) * PAGE;
        let at = PAGE + tags + (set * self.members + member) * self.slot;
        // SAFETY: inside the data area of the mapping (see `layout`).
        unsafe { self.map.base.add(at) }
    }

    /// Sets the abort word (first caller wins) and wakes every sleeper.
    fn abort(&self, code: u32) {
        let _ = self
            .u32_at(ABORT)
            .compare_exchange(0, code, Ordering::SeqCst, Ordering::SeqCst);
        self.wake();
    }

    fn wake(&self) {
        self.u32_at(WAKE).fetch_add(1, Ordering::SeqCst);
        if self.u32_at(WAITERS).load(Ordering::SeqCst) > 0 {
            futex_wake(self.u32_at(WAKE));
        }
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid, aligned 4-byte word of a shared
    // mapping (not FUTEX_PRIVATE: waiters are other processes).
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0,
        );
    }
}

/// Sleeps while `word` holds `expected`, at most `timeout`.
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a valid, aligned 4-byte word of a shared
    // mapping with a relative timeout that outlives the call. Every outcome
    // (woken, timed out, value changed, interrupted) is handled by the
    // caller re-checking its condition.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0,
        );
    }
}

/// Whether process `pid` is still running: gone, or a zombie not yet
/// reaped by its launcher, means it exited.
fn process_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which ends at the last ')'.
        Ok(stat) => !matches!(
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next()),
            Some('Z' | 'X')
        ),
        Err(_) => false,
    }
}

/// Where a member runs, as far as sharing memory goes. Members that agree
/// on all three parts see the same `/dev/shm` and each other's process ids.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Whereabouts {
    /// The machine (its boot id) and the network namespace: nodes emulated
    /// with network namespaces on one machine stay apart, as real nodes
    /// are.
    node: u64,
    /// The process-id namespace: a member checks that the others live.
    pids: u64,
    /// The `/dev/shm` file system itself (device and inode), not the mount
    /// namespace: `ip netns exec` and some launchers give every process a
    /// mount namespace of its own over the same `/dev/shm`, while a
    /// container with a private one has another device.
    shm: u64,
}

impl Whereabouts {
    const BYTES: usize = 24;

    fn here() -> Self {
        let link = |ns: &str| {
            std::fs::read_link(ns)
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        };
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        let shm = std::fs::metadata("/dev/shm")
            .map(|m| {
                use std::os::unix::fs::MetadataExt;
                format!("{}:{}", m.dev(), m.ino())
            })
            .unwrap_or_default();
        Whereabouts {
            node: fingerprint(&format!("{boot}|{}", link("/proc/self/ns/net"))),
            // `why_apart` compares `node` first: the other two need no boot id.
            pids: fingerprint(&link("/proc/self/ns/pid")),
            shm: fingerprint(&shm),
        }
    }

    fn write(&self, out: &mut [u8]) {
        for (i, part) in [self.node, self.pids, self.shm].into_iter().enumerate() {
            out[8 * i..8 * (i + 1)].copy_from_slice(&part.to_le_bytes());
        }
    }

    fn read(from: &[u8]) -> Self {
        let part =
            |i: usize| u64::from_le_bytes(from[8 * i..8 * (i + 1)].try_into().unwrap_or([0; 8]));
        Whereabouts {
            node: part(0),
            pids: part(1),
            shm: part(2),
        }
    }

    /// Why members placed as `all` (world ranks `ranks`) cannot share
    /// memory, if they cannot. Members on other nodes are the usual case
    /// (2D, several nodes); the others are a setup the user may want to
    /// change, so the message names two ranks involved.
    fn why_apart(all: &[Whereabouts], ranks: &[usize]) -> Option<String> {
        let first = all[0];
        if all.iter().any(|w| w.node != first.node) {
            return Some(NOT_ONE_HOST.into());
        }
        let apart = |what: &str, same: &dyn Fn(&Whereabouts) -> bool| {
            all.iter().position(|w| !same(w)).map(|m| {
                format!(
                    "ranks {} and {} run on one host but see {what}",
                    ranks[0], ranks[m]
                )
            })
        };
        apart(
            "different /dev/shm file systems (containers need a shared one, \
             e.g. docker --ipc=host)",
            &|w| w.shm == first.shm,
        )
        .or_else(|| {
            apart(
                "different process-id namespaces (containers need a shared one, \
                 e.g. docker --pid=host)",
                &|w| w.pids == first.pids,
            )
        })
    }
}

/// Why a group spanning nodes keeps TCP; not worth a message.
pub(crate) const NOT_ONE_HOST: &str = "its members are not all on one host";

/// FNV-1a: a stable fingerprint, not a security measure.
fn fingerprint(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

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

/// Forms the shared-memory group over `ring`'s members when they are all
/// on this host, else returns the ring. Every member returns the same kind.
/// `reason` receives why shared memory was not used, when it was wanted.
pub fn attach(
    mut ring: TcpRing,
    deadline: Deadline,
    reason: &mut Option<String>,
) -> Result<Box<dyn Transport>> {
    let size = ring.size();
    if !(2..=MAX_MEMBERS).contains(&size) {
        return Ok(Box::new(ring));
    }
    let rank = ring.rank();
    // 1. Who is where: whereabouts, process id and address of every member.
    const WHO: usize = 96;
    const PID: usize = Whereabouts::BYTES;
    const HOST: usize = PID + 8;
    let mut who = vec![0u8; WHO * size];
    {
        let mine = &mut who[WHO * rank..WHO * (rank + 1)];
        Whereabouts::here().write(mine);
        mine[PID..PID + 4].copy_from_slice(&(std::process::id() as i32).to_le_bytes());
        let host = ring.local_host();
        let n = host.len().min(WHO - HOST);
        mine[HOST..HOST + n].copy_from_slice(&host.as_bytes()[..n]);
    }
    ring.allgather(&mut who, WHO, deadline)?;
    let places: Vec<Whereabouts> = who.chunks_exact(WHO).map(Whereabouts::read).collect();
    if let Some(why) = Whereabouts::why_apart(&places, ring.members()) {
        *reason = Some(why);
        return Ok(Box::new(ring));
    }
    let pids: Vec<i32> = who
        .chunks_exact(WHO)
        .map(|c| i32::from_le_bytes(c[PID..PID + 4].try_into().unwrap_or([0; 4])))
        .collect();
    let hosts: Vec<String> = who
        .chunks_exact(WHO)
        .map(|c| {
            let text = &c[HOST..];
            let end = text.iter().position(|b| *b == 0).unwrap_or(text.len());
            String::from_utf8_lossy(&text[..end]).into_owned()
        })
        .collect();

    // 2. Member 0 creates the file and sends its name (empty: failed).
    let mut name = [0u8; 128];
    let mut created = None;
    if rank == 0 {
        match create_file(Segment::layout(size).1) {
            Ok((path, fd)) => {
                let bytes = path.as_bytes();
                name[..bytes.len()].copy_from_slice(bytes);
                created = Some((path, fd));
            }
            Err(why) => *reason = Some(why),
        }
    }
    ring.broadcast(&mut name, 0, deadline)?;
    let len = name.iter().position(|b| *b == 0).unwrap_or(name.len());
    if len == 0 {
        reason.get_or_insert_with(|| "member 0 could not create the shared segment".into());
        return Ok(Box::new(ring));
    }
    let path = String::from_utf8_lossy(&name[..len]).into_owned();

    // 3. Everyone maps it and says whether that worked.
    let mapped = match created {
        Some((_, fd)) => map_and_close(fd, size),
        None => open_file(&path).and_then(|fd| map_and_close(fd, size)),
    };
    let mut oks = vec![0u8; size];
    oks[rank] = u8::from(mapped.is_ok());
    ring.allgather(&mut oks, 1, deadline)?;
    if rank == 0 {
        // Every member has opened it (or given up): the name can go, and the
        // memory is freed when the last member unmaps it, even after a crash.
        let _ = std::fs::remove_file(&path);
    }
    if let Some(bad) = oks.iter().position(|ok| *ok == 0) {
        *reason = Some(match &mapped {
            Err(e) => e.clone(),
            Ok(_) => format!("member {bad} could not map {path}"),
        });
        return Ok(Box::new(ring));
    }
    let seg = mapped.map_err(|e| Error::Comm {
        peer: None,
        message: e,
    })?;
    let mut group = ShmGroup {
        seg: Arc::new(seg),
        rank,
        size,
        channel: ring.channel(),
        pids,
        hosts,
        members: ring.members().to_vec(),
        group: ring.group(),
        barriers: 0,
        pieces: 0,
        agreements: 0,
        regions: Vec::new(),
        shared_runs: 0,
        sharing: true,
        broken: Failed::default(),
        sent: 0,
    };
    if rank == 0 {
        group.seg.u64_at(0).store(MAGIC, Ordering::SeqCst);
    }
    // 4. A first barrier through the mapping proves it is shared.
    group.barrier(deadline)?;
    if group.seg.u64_at(0).load(Ordering::SeqCst) != MAGIC {
        return Err(Error::Comm {
            peer: Some(group.world(0)),
            message: group.ctx("the shared segment does not hold member 0's mark"),
        });
    }
    Ok(Box::new(group))
}

/// Creates and sizes to `len` bytes (with real pages: a full `/dev/shm`
/// fails here, not later with SIGBUS) a file of its own in `/dev/shm`.
fn create_file(len: usize) -> std::result::Result<(String, i32), String> {
    let mut random = [0u8; 8];
    let suffix = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut random))
        .map(|()| {
            random
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        })
        .map_err(|e| format!("cannot read /dev/urandom: {e}"))?;
    let path = format!("/dev/shm/tiacc-{}-{suffix}", std::process::id());
    let c = CString::new(path.clone()).map_err(|e| e.to_string())?;
    // SAFETY: a NUL-terminated path; O_EXCL so we never reuse a stranger's file.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
            0o600,
        )
    };
    if fd < 0 {
        return Err(format!(
            "cannot create {path}: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: `fd` is the file just opened; posix_fallocate returns an errno.
    let rc = unsafe { libc::posix_fallocate(fd, 0, len as libc::off_t) };
    if rc != 0 {
        // SAFETY: closing our own descriptor once.
        unsafe { libc::close(fd) };
        let _ = std::fs::remove_file(&path);
        return Err(format!(
            "cannot reserve {} MiB in /dev/shm for {path}: {} (a container may need a \
             larger --shm-size)",
            len >> 20,
            std::io::Error::from_raw_os_error(rc)
        ));
    }
    Ok((path, fd))
}

fn open_file(path: &str) -> std::result::Result<i32, String> {
    let c = CString::new(path).map_err(|e| e.to_string())?;
    // SAFETY: a NUL-terminated path.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(format!(
            "cannot open {path}: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(fd)
}

fn map_and_close(fd: i32, members: usize) -> std::result::Result<Segment, String> {
    let (_, len) = Segment::layout(members);
    // SAFETY: `fd` is an open descriptor we own; fstat fills `st`.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let size_ok = unsafe { libc::fstat(fd, &mut st) } == 0 && st.st_size as usize == len;
    let mapped = if size_ok {
        Segment::map(fd, members).map_err(|e| format!("cannot map the shared segment: {e}"))
    } else {
        Err("the shared segment has an unexpected size".to_string())
    };
    // SAFETY: closing our own descriptor once; the mapping stays valid.
    unsafe { libc::close(fd) };
    mapped
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

    fn allreduce_op(
        &mut self,
        tag: Option<&OpTag>,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        deadline: Deadline,
    ) -> Result<()> {
        let pass = Pass {
            op,
            sum: Some(dtype),
            elem: dtype.size(),
            gather: true,
            divisor: 1.0,
            tag,
            into: None,
            what: "allreduce",
        };
        self.guarded(|g| g.pieces_through(buf, &pass, deadline))
    }

    /// The tag travels with the first piece (no barrier of its own).
    fn allreduce_checked(
        &mut self,
        tag: &OpTag,
        buf: &mut [u8],
        dtype: DType,
        deadline: Deadline,
    ) -> Result<()> {
        self.allreduce_divided(Some(tag), buf, dtype, 1.0, deadline)
    }

    /// The division happens while the parts are copied into the slots.
    fn allreduce_divided(
        &mut self,
        tag: Option<&OpTag>,
        buf: &mut [u8],
        dtype: DType,
        divisor: f64,
        deadline: Deadline,
    ) -> Result<()> {
        let pass = Pass {
            op: ReduceOp::Sum,
            sum: Some(dtype),
            elem: dtype.size(),
            gather: true,
            divisor,
            tag,
            into: None,
            what: "allreduce",
        };
        self.guarded(|g| g.pieces_through(buf, &pass, deadline))
    }

    /// The sums go into a region every member maps, and nothing is
    /// gathered (module docs).
    fn allreduce_shared(
        &mut self,
        tag: Option<&OpTag>,
        buf: &mut [u8],
        dtype: DType,
        divisor: f64,
        bucket: u64,
        deadline: Deadline,
    ) -> Result<Option<SharedBytes>> {
        let len = buf.len();
        let region = self.guarded(|g| g.region((bucket, len), tag, deadline))?;
        let Some(region) = region else {
            self.allreduce_divided(tag, buf, dtype, divisor, deadline)?;
            return Ok(None);
        };
        let pass = Pass {
            op: ReduceOp::Sum,
            sum: Some(dtype),
            elem: dtype.size(),
            gather: false,
            divisor,
            tag,
            into: Some(&region),
            what: "allreduce",
        };
        self.guarded(|g| g.pieces_through(buf, &pass, deadline))?;
        Ok(Some(SharedBytes::new(region, len)))
    }

    fn reduce_scatter_op(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        deadline: Deadline,
    ) -> Result<()> {
        let pass = Pass {
            op,
            sum: Some(dtype),
            elem: dtype.size(),
            gather: false,
            divisor: 1.0,
            tag: None,
            into: None,
            what: "reduce-scatter",
        };
        self.guarded(|g| g.pieces_through(buf, &pass, deadline))
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
        if root >= self.size {
            return Err(Error::InvalidArgument(format!(
                "broadcast root {root} is not a rank of a group of {}",
                self.size
            )));
        }
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

#[cfg(test)]
mod tests {
    use super::{Whereabouts, NOT_ONE_HOST};

    fn at(node: u64, pids: u64, shm: u64) -> Whereabouts {
        Whereabouts { node, pids, shm }
    }

    #[test]
    fn whereabouts_round_trip_and_this_process_agrees_with_itself() {
        let here = Whereabouts::here();
        assert_eq!(here, Whereabouts::here());
        let mut bytes = [0u8; Whereabouts::BYTES];
        here.write(&mut bytes);
        assert_eq!(Whereabouts::read(&bytes), here);
    }

    #[test]
    fn members_apart_are_told_apart_by_what_differs_and_named_by_world_rank() {
        let ranks = [4, 5, 6];
        assert_eq!(Whereabouts::why_apart(&[at(1, 2, 3); 3], &ranks), None);
        let other_node = [at(1, 2, 3), at(1, 2, 3), at(9, 2, 3)];
        assert_eq!(
            Whereabouts::why_apart(&other_node, &ranks).as_deref(),
            Some(NOT_ONE_HOST)
        );
        let other_shm = Whereabouts::why_apart(&[at(1, 2, 3), at(1, 2, 7), at(1, 2, 3)], &ranks)
            .expect("a private /dev/shm keeps them apart");
        assert!(
            other_shm.starts_with("ranks 4 and 5 run on one host")
                && other_shm.contains("/dev/shm"),
            "{other_shm}"
        );
        let other_pids = Whereabouts::why_apart(&[at(1, 2, 3), at(1, 2, 3), at(1, 8, 3)], &ranks)
            .expect("another pid namespace keeps them apart");
        assert!(
            other_pids.starts_with("ranks 4 and 6") && other_pids.contains("process-id"),
            "{other_pids}"
        );
    }
}
