//! The C types of `nccl.h` that the engine uses, and the table of function
//! pointers resolved from the library.
//!
//! Only the ABI is reproduced here: enum values and struct layouts as NCCL
//! documents them. Every pointer in [`Functions`] is resolved once, when the
//! library is loaded, and the [`libloading::Library`] that owns the code is
//! kept alive beside it (see `library.rs`).

use std::ffi::{c_char, c_int, c_void};

use crate::comm::DType;
use crate::error::{Error, Result};

/// `ncclResult_t`.
pub type NcclResult = c_int;
/// `ncclSuccess`.
pub const NCCL_SUCCESS: NcclResult = 0;
/// `ncclInProgress`: a non-blocking operation has not finished yet.
pub const NCCL_IN_PROGRESS: NcclResult = 7;

/// `ncclComm_t`: an opaque communicator handle.
pub type NcclComm = *mut c_void;
/// `cudaStream_t`: an opaque stream handle (torch's `Stream.cuda_stream`).
pub type CudaStream = *mut c_void;

/// Bytes in an `ncclUniqueId` (`NCCL_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: 128 opaque bytes that rank 0 creates and every rank
/// passes to `ncclCommInitRank`. Passed by value, as in the C API.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclUniqueId {
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

impl NcclUniqueId {
    /// The id's bytes (for the rendezvous store).
    pub fn to_bytes(&self) -> [u8; UNIQUE_ID_BYTES] {
        self.internal.map(|b| b as u8)
    }

    /// An id from the bytes another rank published.
    pub fn from_bytes(bytes: &[u8; UNIQUE_ID_BYTES]) -> Self {
        NcclUniqueId {
            internal: bytes.map(|b| b as c_char),
        }
    }

    /// An id from bytes of any length: [`Error::InvalidArgument`] unless
    /// there are exactly [`UNIQUE_ID_BYTES`].
    pub fn from_slice(bytes: &[u8]) -> Result<Self> {
        let bytes: &[u8; UNIQUE_ID_BYTES] = bytes.try_into().map_err(|_| {
            Error::InvalidArgument(format!(
                "an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {}",
                bytes.len()
            ))
        })?;
        Ok(NcclUniqueId::from_bytes(bytes))
    }
}

impl std::fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The id is a rendezvous secret of sorts; show only its size.
        write!(f, "NcclUniqueId({UNIQUE_ID_BYTES} bytes)")
    }
}

/// `NCCL_CONFIG_UNDEF_INT`: "leave this field at NCCL's default".
pub const CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// The `magic` that `NCCL_CONFIG_INITIALIZER` writes.
pub const CONFIG_MAGIC: u32 = 0xcafe_beef;
/// The config version we fill in: NCCL 2.14.0, the first with
/// `ncclCommInitRankConfig`, whose `ncclConfig_t` is exactly [`NcclConfig`].
pub const CONFIG_VERSION: u32 = 21_400;

/// The leading fields of `ncclConfig_t`, as NCCL 2.14 defined the whole
/// struct. Later releases append fields; NCCL reads only the `size` bytes a
/// caller declares and keeps its defaults for the rest.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NcclConfig {
    pub size: usize,
    pub magic: u32,
    pub version: u32,
    pub blocking: c_int,
    pub cga_cluster_size: c_int,
    pub min_ctas: c_int,
    pub max_ctas: c_int,
    pub net_name: *const c_char,
}

impl NcclConfig {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`: initialisation and
    /// later calls return at once (`ncclInProgress`) and their completion is
    /// polled with `ncclCommGetAsyncError`.
    pub fn non_blocking() -> Self {
        NcclConfig {
            size: std::mem::size_of::<NcclConfig>(),
            magic: CONFIG_MAGIC,
            version: CONFIG_VERSION,
            blocking: 0,
            cga_cluster_size: CONFIG_UNDEF_INT,
            min_ctas: CONFIG_UNDEF_INT,
            max_ctas: CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
        }
    }
}

/// `ncclDataType_t` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum NcclDataType {
    Int8 = 0,
    Uint8 = 1,
    Int32 = 2,
    Uint32 = 3,
    Int64 = 4,
    Uint64 = 5,
    Float16 = 6,
    Float32 = 7,
    Float64 = 8,
    /// Since NCCL 2.10.
    Bfloat16 = 9,
}

impl From<DType> for NcclDataType {
    fn from(dtype: DType) -> Self {
        match dtype {
            DType::F32 => NcclDataType::Float32,
            DType::F64 => NcclDataType::Float64,
            DType::F16 => NcclDataType::Float16,
            DType::BF16 => NcclDataType::Bfloat16,
            DType::I8 => NcclDataType::Int8,
            DType::U8 | DType::Bool => NcclDataType::Uint8,
            DType::I32 => NcclDataType::Int32,
            DType::I64 => NcclDataType::Int64,
        }
    }
}

/// `ncclRedOp_t` values (the built-in operations).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum NcclRedOp {
    Sum = 0,
    Prod = 1,
    Max = 2,
    Min = 3,
    /// Since NCCL 2.10.
    Avg = 4,
}

pub type GetVersionFn = unsafe extern "C" fn(version: *mut c_int) -> NcclResult;
pub type GetUniqueIdFn = unsafe extern "C" fn(id: *mut NcclUniqueId) -> NcclResult;
pub type CommInitRankFn = unsafe extern "C" fn(
    comm: *mut NcclComm,
    nranks: c_int,
    id: NcclUniqueId,
    rank: c_int,
) -> NcclResult;
/// `ncclCommInitRankConfig` (NCCL 2.14 and later).
pub type CommInitRankConfigFn = unsafe extern "C" fn(
    comm: *mut NcclComm,
    nranks: c_int,
    id: NcclUniqueId,
    rank: c_int,
    config: *mut NcclConfig,
) -> NcclResult;
pub type CommFn = unsafe extern "C" fn(comm: NcclComm) -> NcclResult;
pub type CommGetAsyncErrorFn =
    unsafe extern "C" fn(comm: NcclComm, error: *mut NcclResult) -> NcclResult;
pub type AllReduceFn = unsafe extern "C" fn(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: NcclDataType,
    op: NcclRedOp,
    comm: NcclComm,
    stream: CudaStream,
) -> NcclResult;
/// `ncclReduceScatter`; `count` is the per-rank (received) count.
pub type ReduceScatterFn = AllReduceFn;
/// `ncclAllGather`; `count` is the per-rank (sent) count.
pub type AllGatherFn = unsafe extern "C" fn(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: NcclDataType,
    comm: NcclComm,
    stream: CudaStream,
) -> NcclResult;
pub type BroadcastFn = unsafe extern "C" fn(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: NcclDataType,
    root: c_int,
    comm: NcclComm,
    stream: CudaStream,
) -> NcclResult;
pub type SendFn = unsafe extern "C" fn(
    send: *const c_void,
    count: usize,
    dtype: NcclDataType,
    peer: c_int,
    comm: NcclComm,
    stream: CudaStream,
) -> NcclResult;
pub type RecvFn = unsafe extern "C" fn(
    recv: *mut c_void,
    count: usize,
    dtype: NcclDataType,
    peer: c_int,
    comm: NcclComm,
    stream: CudaStream,
) -> NcclResult;
pub type GroupFn = unsafe extern "C" fn() -> NcclResult;
pub type GetErrorStringFn = unsafe extern "C" fn(result: NcclResult) -> *const c_char;
pub type GetLastErrorFn = unsafe extern "C" fn(comm: NcclComm) -> *const c_char;

/// The NCCL functions the engine calls, resolved from one library.
#[derive(Clone, Copy)]
pub struct Functions {
    pub get_version: GetVersionFn,
    pub get_unique_id: GetUniqueIdFn,
    pub comm_init_rank: CommInitRankFn,
    pub comm_abort: CommFn,
    pub comm_destroy: CommFn,
    pub comm_get_async_error: CommGetAsyncErrorFn,
    pub all_reduce: AllReduceFn,
    pub reduce_scatter: ReduceScatterFn,
    pub all_gather: AllGatherFn,
    pub broadcast: BroadcastFn,
    pub send: SendFn,
    pub recv: RecvFn,
    pub group_start: GroupFn,
    pub group_end: GroupFn,
    pub get_error_string: GetErrorStringFn,
    /// `ncclCommInitRankConfig` (NCCL 2.14 and later), when present.
    pub comm_init_rank_config: Option<CommInitRankConfigFn>,
    /// `ncclGetLastError` (NCCL 2.13 and later), when present.
    pub get_last_error: Option<GetLastErrorFn>,
}

/// Splits NCCL's integer version code into (major, minor, patch).
///
/// NCCL 2.9 changed the encoding from `major*1000 + minor*100 + patch` to
/// `major*10000 + minor*100 + patch` (minor versions reached 10).
pub fn decode_version(code: c_int) -> (u32, u32, u32) {
    let code = code.max(0) as u32;
    if code >= 10_000 {
        (code / 10_000, (code % 10_000) / 100, code % 100)
    } else {
        (code / 1000, (code % 1000) / 100, code % 100)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_is_nccl_2_14_s_layout_with_blocking_off() {
        let c = NcclConfig::non_blocking();
        // size_t, two unsigned ints, four ints, one pointer (x86-64/aarch64).
        assert_eq!(c.size, 8 + 4 + 4 + 4 * 4 + 8);
        assert_eq!(std::mem::offset_of!(NcclConfig, blocking), 16);
        assert_eq!(std::mem::offset_of!(NcclConfig, net_name), 32);
        assert_eq!((c.magic, c.version, c.blocking), (0xcafebeef, 21400, 0));
        assert_eq!(c.min_ctas, i32::MIN);
        assert!(c.net_name.is_null());
    }

    #[test]
    fn versions_decode_in_both_encodings() {
        assert_eq!(decode_version(23007), (2, 30, 7));
        assert_eq!(decode_version(21204), (2, 12, 4));
        assert_eq!(decode_version(2804), (2, 8, 4));
        assert_eq!(decode_version(-1), (0, 0, 0));
    }

    #[test]
    fn unique_ids_round_trip_through_bytes() {
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i * 7) as u8;
        }
        let id = NcclUniqueId::from_bytes(&bytes);
        assert_eq!(id.to_bytes(), bytes);
        assert_eq!(std::mem::size_of::<NcclUniqueId>(), UNIQUE_ID_BYTES);
    }

    #[test]
    fn dtypes_map_to_nccl_codes() {
        assert_eq!(NcclDataType::from(DType::F32) as i32, 7);
        assert_eq!(NcclDataType::from(DType::F16) as i32, 6);
        assert_eq!(NcclDataType::from(DType::BF16) as i32, 9);
        assert_eq!(NcclDataType::from(DType::F64) as i32, 8);
        assert_eq!(NcclRedOp::Avg as i32, 4);
    }
}
