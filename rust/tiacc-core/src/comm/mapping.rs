//! Shared memory mappings, and the bytes of one that a shared allreduce
//! returns ([`SharedBytes`]): what the shared-memory transport ([`super::shm`])
//! makes and what the transport trait ([`super::transport`]) hands out,
//! kept apart from both so that neither names the other's types.

use std::sync::Arc;

/// Maps `len` bytes of the file `fd`, shared and writable.
pub(crate) fn map_shared(fd: i32, len: usize) -> std::io::Result<*mut u8> {
    // SAFETY: a fresh shared mapping of an open file descriptor; the
    // kernel picks the address; the result is checked below.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(base.cast())
}

/// A shared mapping of `len` bytes at `base`, unmapped on drop: a group's
/// segment, or a region holding one bucket's result.
pub(crate) struct Mapping {
    pub(crate) base: *mut u8,
    pub(crate) len: usize,
}

// SAFETY: plain shared memory that lives until `Drop`. Every access from
// several threads or processes goes through atomics (the control page) or
// follows the barrier protocol (see `shm`'s module docs), which gives each
// byte of the slots and regions one writer at a time, and readers only
// after the barrier that follows the write.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only exposes raw pointers.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` are a mapping made by `map_shared`, unmapped
        // only here, once.
        unsafe {
            libc::munmap(self.base.cast(), self.len);
        }
    }
}

/// The result of [`super::transport::Transport::allreduce_shared`] on
/// shared memory: bytes in shared memory, the same on every member. The
/// mapping lives as long as this value; its bytes stay the result until the
/// next allreduce of the same bucket and length starts.
pub struct SharedBytes {
    region: Arc<Mapping>,
    len: usize,
}

impl SharedBytes {
    /// `len` bytes at the start of `region`.
    pub(crate) fn new(region: Arc<Mapping>, len: usize) -> Self {
        debug_assert!(len <= region.len);
        SharedBytes { region, len }
    }

    /// Address of the first byte.
    pub fn as_ptr(&self) -> *const u8 {
        self.region.base
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    ///
    /// # Safety
    ///
    /// No member of the group may start another shared allreduce of the
    /// same bucket and length while the slice lives: that one writes them.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes of a live mapping (held by `region`), written
        // before the barrier that ended the allreduce that returned this,
        // and by the caller's promise not again while the slice lives.
        unsafe { std::slice::from_raw_parts(self.region.base, self.len) }
    }
}

impl std::fmt::Debug for SharedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SharedBytes({} bytes at {:p})",
            self.len, self.region.base
        )
    }
}
