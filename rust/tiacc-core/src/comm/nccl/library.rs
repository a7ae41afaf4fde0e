//! Finding and loading `libnccl.so.2` at run time.
//!
//! Search order (the first hit wins):
//! 1. an explicit path (`TIACC_TRAINING_NCCL_LIBRARY`); when given it is
//!    the only candidate, and a missing file is an error naming it;
//! 2. the copy already loaded in the process (torch loads its own; two
//!    NCCLs in one process would each keep their own state), found with
//!    `dlopen(RTLD_NOLOAD)`;
//! 3. `libnccl.so.2` in each directory the caller passes (the Python shim
//!    passes the `nvidia-nccl` wheel's `lib` directory; this crate does not
//!    guess Python paths);
//! 4. plain `libnccl.so.2` through the dynamic loader's own search.

use std::ffi::{c_int, c_void, CStr};
use std::path::{Path, PathBuf};

use libloading::os::unix::Library;

use super::ffi::{self, decode_version, Functions, NcclComm, NcclResult, NcclUniqueId};
use crate::error::{Error, Result};

/// The file name NCCL 2 is installed under.
pub const LIBRARY_NAME: &str = "libnccl.so.2";

/// The oldest NCCL accepted. bfloat16 and `ncclAvg` need 2.10; 2.12 is the
/// floor we support so that the tested range is one torch 2.x builds with
/// (torch 2.0's wheels already bundle 2.14).
pub const MIN_VERSION: (u32, u32, u32) = (2, 12, 0);

/// Where to look for NCCL.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NcclSearch {
    /// A file to load and nothing else (`TIACC_TRAINING_NCCL_LIBRARY`).
    pub explicit: Option<PathBuf>,
    /// Directories to try after the copy already in the process.
    pub dirs: Vec<PathBuf>,
}

/// A loaded NCCL: the library handle and the functions resolved from it.
pub struct NcclLibrary {
    fns: Functions,
    version: (u32, u32, u32),
    /// Where the code came from (the real file when the loader says).
    path: String,
    /// Keeps the code the pointers in `fns` point into mapped. Never
    /// closed: NCCL starts threads of its own (bootstrap, proxy) that may
    /// outlive every communicator, and unloading the code under them
    /// crashes the process (seen in this crate's tests). A loaded NCCL
    /// stays for the life of the process, as torch's does. `None` only for
    /// the in-process fakes of this crate's tests, which load nothing.
    _library: Option<std::mem::ManuallyDrop<Library>>,
}

impl std::fmt::Debug for NcclLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclLibrary")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish()
    }
}

impl NcclLibrary {
    /// Loads NCCL following the search order of this module.
    pub fn load(search: &NcclSearch) -> Result<Self> {
        if let Some(path) = &search.explicit {
            if !path.is_file() {
                return Err(comm_error(format!(
                    "NCCL library {} (TIACC_TRAINING_NCCL_LIBRARY) does not exist or is not a file",
                    path.display()
                )));
            }
            return Self::open_path(path);
        }
        let mut tried = Vec::new();
        match Self::already_loaded() {
            Ok(Some(lib)) => return Ok(lib),
            Ok(None) => tried.push(format!("{LIBRARY_NAME} (not loaded in this process)")),
            // A loaded but unusable NCCL must not be shadowed by another copy.
            Err(e) => return Err(e),
        }
        for dir in &search.dirs {
            let candidate = dir.join(LIBRARY_NAME);
            if !candidate.is_file() {
                tried.push(format!("{} (no such file)", candidate.display()));
                continue;
            }
            match Self::open_path(&candidate) {
                Ok(lib) => return Ok(lib),
                Err(e) => tried.push(e.to_string()),
            }
        }
        match Self::open_name(LIBRARY_NAME) {
            Ok(lib) => Ok(lib),
            Err(e) => {
                tried.push(e.to_string());
                Err(comm_error(format!(
                    "cannot load NCCL; tried: {}",
                    tried.join("; ")
                )))
            }
        }
    }

    /// Loads the NCCL at `path` (a file name, or a path with a slash).
    pub fn open_path(path: &Path) -> Result<Self> {
        // SAFETY: loading a shared library runs its initialisers. NCCL's (and
        // any library the user names in place of it) are ordinary C/C++
        // static constructors with no preconditions on the caller; the
        // handle is kept for as long as any pointer resolved from it.
        let lib = unsafe { Library::open(Some(path), libc::RTLD_NOW | libc::RTLD_LOCAL) }
            .map_err(|e| comm_error(format!("cannot load NCCL library {}: {e}", path.display())))?;
        Self::from_library(lib, path.display().to_string())
    }

    fn open_name(name: &str) -> Result<Self> {
        Self::open_path(Path::new(name))
    }

    /// The NCCL this process already loaded (torch's), if any.
    fn already_loaded() -> Result<Option<Self>> {
        // SAFETY: with RTLD_NOLOAD the loader only returns a new reference
        // to a library that is already mapped (its initialisers have run);
        // nothing is loaded.
        let opened = unsafe {
            Library::open(
                Some(LIBRARY_NAME),
                libc::RTLD_NOW | libc::RTLD_LOCAL | libc::RTLD_NOLOAD,
            )
        };
        match opened {
            Ok(lib) => {
                Self::from_library(lib, format!("{LIBRARY_NAME} (already loaded)")).map(Some)
            }
            Err(_) => Ok(None),
        }
    }

    /// Resolves every function and checks the version.
    fn from_library(library: Library, described: String) -> Result<Self> {
        let missing = |symbol: &str, e: libloading::Error| {
            comm_error(format!(
                "{described} is not a usable NCCL: symbol {symbol} is missing ({e})"
            ))
        };
        macro_rules! resolve {
            ($name:literal, $ty:ty) => {{
                // SAFETY: the symbol is looked up by its C name in NCCL's
                // exported API and typed as `nccl.h` declares it (ffi.rs);
                // the pointer is copied out of the `Symbol` and stays valid
                // because `library` is stored next to it in `NcclLibrary`.
                let symbol = unsafe { library.get::<$ty>(concat!($name, "\0").as_bytes()) };
                *symbol.map_err(|e| missing($name, e))?
            }};
        }
        let fns = Functions {
            get_version: resolve!("ncclGetVersion", ffi::GetVersionFn),
            get_unique_id: resolve!("ncclGetUniqueId", ffi::GetUniqueIdFn),
            comm_init_rank: resolve!("ncclCommInitRank", ffi::CommInitRankFn),
            comm_abort: resolve!("ncclCommAbort", ffi::CommFn),
            comm_destroy: resolve!("ncclCommDestroy", ffi::CommFn),
            comm_get_async_error: resolve!("ncclCommGetAsyncError", ffi::CommGetAsyncErrorFn),
            all_reduce: resolve!("ncclAllReduce", ffi::AllReduceFn),
            reduce_scatter: resolve!("ncclReduceScatter", ffi::ReduceScatterFn),
            all_gather: resolve!("ncclAllGather", ffi::AllGatherFn),
            broadcast: resolve!("ncclBroadcast", ffi::BroadcastFn),
            send: resolve!("ncclSend", ffi::SendFn),
            recv: resolve!("ncclRecv", ffi::RecvFn),
            group_start: resolve!("ncclGroupStart", ffi::GroupFn),
            group_end: resolve!("ncclGroupEnd", ffi::GroupFn),
            get_error_string: resolve!("ncclGetErrorString", ffi::GetErrorStringFn),
            // SAFETY: as in `resolve!`; this one is optional (NCCL >= 2.14).
            comm_init_rank_config: unsafe {
                library.get::<ffi::CommInitRankConfigFn>(b"ncclCommInitRankConfig\0")
            }
            .ok()
            .map(|s| *s),
            // SAFETY: as in `resolve!`; this one is optional (NCCL >= 2.13).
            get_last_error: unsafe { library.get::<ffi::GetLastErrorFn>(b"ncclGetLastError\0") }
                .ok()
                .map(|s| *s),
        };
        let path = real_path(fns.get_version as *const c_void).unwrap_or(described);
        let mut code: c_int = 0;
        // SAFETY: ncclGetVersion writes one int through a valid pointer and
        // needs no initialised state (no GPU, no communicator).
        let result = unsafe { (fns.get_version)(&mut code) };
        let mut lib = NcclLibrary {
            fns,
            version: (0, 0, 0),
            path,
            _library: Some(std::mem::ManuallyDrop::new(library)),
        };
        lib.check(result, "ncclGetVersion")?;
        lib.version = decode_version(code);
        if lib.version < MIN_VERSION {
            let (a, b, c) = lib.version;
            let (x, y, _) = MIN_VERSION;
            return Err(comm_error(format!(
                "NCCL {a}.{b}.{c} at {} is too old: the engine needs NCCL {x}.{y} or later",
                lib.path
            )));
        }
        Ok(lib)
    }

    /// A library whose functions are `fns` (Rust fakes of NCCL's API in
    /// this crate's tests): nothing is loaded and no version is checked.
    #[cfg(test)]
    pub(crate) fn from_functions(fns: Functions, version: (u32, u32, u32)) -> Self {
        NcclLibrary {
            fns,
            version,
            path: "in-process fake NCCL (tests)".to_string(),
            _library: None,
        }
    }

    /// NCCL's version as (major, minor, patch).
    pub fn version(&self) -> (u32, u32, u32) {
        self.version
    }

    /// Where the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    pub(crate) fn fns(&self) -> &Functions {
        &self.fns
    }

    /// `ncclGetErrorString(code)`.
    pub fn error_string(&self, code: NcclResult) -> String {
        // SAFETY: ncclGetErrorString accepts any code (unknown ones get a
        // generic text) and returns a pointer to a static NUL-terminated
        // string, or null, which is checked.
        let text = unsafe { (self.fns.get_error_string)(code) };
        if text.is_null() {
            return format!("unknown NCCL result {code}");
        }
        // SAFETY: non-null, static and NUL-terminated (see above).
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }

    /// `ncclGetLastError(comm)` when the library has it and says something.
    pub(crate) fn last_error(&self, comm: NcclComm) -> Option<String> {
        let get = self.fns.get_last_error?;
        // SAFETY: ncclGetLastError accepts a null or live communicator and
        // returns a pointer to a NUL-terminated string it owns (thread-local
        // or per-communicator), read at once and copied.
        let text = unsafe { get(comm) };
        if text.is_null() {
            return None;
        }
        // SAFETY: non-null and NUL-terminated (see above).
        let s = unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .trim()
            .to_string();
        (!s.is_empty()).then_some(s)
    }

    /// Maps an NCCL result to `Ok` or an [`Error::Comm`] with NCCL's text.
    pub fn check(&self, result: NcclResult, what: &str) -> Result<()> {
        self.check_comm(result, what, std::ptr::null_mut())
    }

    /// [`NcclLibrary::check`] adding `ncclGetLastError(comm)`'s detail.
    pub(crate) fn check_comm(&self, result: NcclResult, what: &str, comm: NcclComm) -> Result<()> {
        if result == ffi::NCCL_SUCCESS {
            return Ok(());
        }
        let detail = self
            .last_error(comm)
            .map(|d| format!(": {d}"))
            .unwrap_or_default();
        Err(comm_error(format!(
            "{what} failed: NCCL error {result} ({}){detail}",
            self.error_string(result)
        )))
    }

    /// A fresh `ncclUniqueId` (rank 0 makes one per communicator).
    pub fn unique_id(&self) -> Result<NcclUniqueId> {
        let mut id = NcclUniqueId {
            internal: [0; ffi::UNIQUE_ID_BYTES],
        };
        // SAFETY: ncclGetUniqueId fills the 128-byte struct behind a valid
        // pointer; it needs no GPU.
        let result = unsafe { (self.fns.get_unique_id)(&mut id) };
        self.check(result, "ncclGetUniqueId")?;
        Ok(id)
    }
}

/// The file that holds `addr`, as the dynamic loader reports it.
fn real_path(addr: *const c_void) -> Option<String> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr only reads the loader's tables and fills `info`; it
    // returns 0 (and we return None) when `addr` is in no loaded object.
    let found = unsafe { libc::dladdr(addr, info.as_mut_ptr()) };
    if found == 0 {
        return None;
    }
    // SAFETY: dladdr succeeded, so `info` is initialised.
    let info = unsafe { info.assume_init() };
    if info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader,
    // valid while the object is loaded (we hold a handle); copied at once.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(name.to_string_lossy().into_owned())
}

pub(crate) fn comm_error(message: String) -> Error {
    Error::Comm {
        peer: None,
        message,
    }
}
