//! The shared mapping itself: its layout, the futex and the files in
//! `/dev/shm` behind it.

use std::ffi::CString;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use super::{ABORT, ARRIVED, LINE, MIN_SLOT, PAGE, SETS, SET_BYTES, WAITERS, WAKE};
use crate::comm::mapping::{map_shared, Mapping};
use crate::comm::transport::OpTag;

/// The mapping, shared by the group and its aborter.
pub(super) struct Segment {
    pub(super) map: Mapping,
    pub(super) members: usize,
    pub(super) slot: usize,
}

impl Segment {
    pub(super) fn layout(members: usize) -> (usize, usize) {
        let slot = (SET_BYTES / members).max(MIN_SLOT) / LINE * LINE;
        let tags = (2 * members * OpTag::LEN).div_ceil(PAGE) * PAGE;
        (slot, PAGE + tags + SETS * members * slot)
    }

    /// Maps the file `fd` (of `Segment::layout(members).1` bytes).
    pub(super) fn map(fd: i32, members: usize) -> std::io::Result<Segment> {
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

    pub(super) fn u64_at(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset % LINE == 0 && offset + 8 <= PAGE);
        // SAFETY: the offset is inside the control page, 8-byte aligned (the
        // mapping is page aligned), and that memory is only ever accessed
        // through atomics of this width, by every process.
        unsafe { &*(self.map.base.add(offset) as *const AtomicU64) }
    }

    pub(super) fn u32_at(&self, offset: usize) -> &AtomicU32 {
        debug_assert!(offset % LINE == 0 && offset + 4 <= PAGE);
        // SAFETY: as in `u64_at`, for a 4-byte atomic.
        unsafe { &*(self.map.base.add(offset) as *const AtomicU32) }
    }

    pub(super) fn arrived(&self, member: usize) -> &AtomicU64 {
        self.u64_at(ARRIVED + member * LINE)
    }

    pub(super) fn tag_ptr(&self, set: usize, member: usize) -> *mut u8 {
        let at = PAGE + (set * self.members + member) * OpTag::LEN;
        // SAFETY: inside the tag area of the mapping (see `layout`).
        unsafe { self.map.base.add(at) }
    }

    pub(super) fn slot_ptr(&self, set: usize, member: usize) -> *mut u8 {
        let tags = (2 * self.members * OpTag::LEN).div_ceil(PAGE) * PAGE;
        let at = PAGE + tags + (set * self.members + member) * self.slot;
        // SAFETY: inside the data area of the mapping (see `layout`).
        unsafe { self.map.base.add(at) }
    }

    /// Sets the abort word (first caller wins) and wakes every sleeper.
    pub(super) fn abort(&self, code: u32) {
        let _ = self
            .u32_at(ABORT)
            .compare_exchange(0, code, Ordering::SeqCst, Ordering::SeqCst);
        self.wake();
    }

    pub(super) fn wake(&self) {
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
pub(super) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
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
pub(super) fn process_alive(pid: i32) -> bool {
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

/// Creates and sizes to `len` bytes (with real pages: a full `/dev/shm`
/// fails here, not later with SIGBUS) a file of its own in `/dev/shm`.
pub(super) fn create_file(len: usize) -> std::result::Result<(String, i32), String> {
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

pub(super) fn open_file(path: &str) -> std::result::Result<i32, String> {
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

pub(super) fn map_and_close(fd: i32, members: usize) -> std::result::Result<Segment, String> {
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
