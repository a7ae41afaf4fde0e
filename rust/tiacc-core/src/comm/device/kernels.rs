//! What the device backend needs from the framework that owns the device
//! memory: scratch buffers and the element-wise kernels around the
//! collectives, enqueued in call order on the current stream.
//!
//! The Python bindings implement [`Kernels`] with torch operations on
//! tensors (CUDA tensors in training, CPU tensors in the bindings' tests);
//! this crate's tests implement it over host memory.

use crate::comm::backend::{Mem, Momentum, TopKBlock};
use crate::comm::dtype::DType;

/// Bytes `offset .. offset + bytes` of one buffer, as a kernel takes them.
#[derive(Debug)]
pub struct Span<'a, B> {
    pub buffer: &'a B,
    pub offset: usize,
    pub bytes: usize,
}

impl<B> Clone for Span<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for Span<'_, B> {}

/// Why a kernel failed: the framework's own message. The backend adds the
/// rank and the bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelError(pub String);

impl<E: std::fmt::Display> From<E> for KernelError {
    fn from(e: E) -> Self {
        KernelError(e.to_string())
    }
}

pub type KernelResult<T> = std::result::Result<T, KernelError>;

/// The device operations of one channel (see the module docs). Element
/// counts are derived from the spans' bytes and the types named.
pub trait Kernels {
    /// One device buffer (a flat byte tensor), kept alive while held.
    type Buffer;

    /// A zeroed scratch buffer of `bytes` bytes, and its memory.
    fn empty(&self, bytes: usize) -> KernelResult<(Self::Buffer, Mem)>;
    /// `dst = src` (equal lengths).
    fn copy(&self, src: Span<'_, Self::Buffer>, dst: Span<'_, Self::Buffer>) -> KernelResult<()>;
    /// `buf[i] /= divisor`, elements of `dtype`.
    fn div(&self, buf: Span<'_, Self::Buffer>, dtype: DType, divisor: f64) -> KernelResult<()>;
    /// `dst = (to) (src * factor)`, rounding to nearest even.
    fn cast(
        &self,
        src: Span<'_, Self::Buffer>,
        from: DType,
        factor: f64,
        dst: Span<'_, Self::Buffer>,
        to: DType,
    ) -> KernelResult<()>;
    /// The first NaN or infinity: its element index and value.
    fn first_non_finite(
        &self,
        buf: Span<'_, Self::Buffer>,
        dtype: DType,
    ) -> KernelResult<Option<(usize, f64)>>;
    /// Top-K selection with error feedback (see [`crate::comm::sparse`]).
    fn topk_pack(
        &self,
        data: Span<'_, Self::Buffer>,
        residual: Span<'_, Self::Buffer>,
        out: Span<'_, Self::Buffer>,
        layout: TopKBlock,
    ) -> KernelResult<()>;
    /// `out = 0`, then every block of `gathered` added in, in rank order.
    fn topk_sum(
        &self,
        gathered: Span<'_, Self::Buffer>,
        out: Span<'_, Self::Buffer>,
        layout: TopKBlock,
    ) -> KernelResult<()>;
    /// Scales float32 `buf` to an L2 norm of at most `max_norm`.
    fn clip_norm(&self, buf: Span<'_, Self::Buffer>, max_norm: f64) -> KernelResult<()>;
    /// Momentum kernel `op` on `first` and `second` (see [`Momentum`]).
    fn momentum(
        &self,
        op: Momentum,
        first: Span<'_, Self::Buffer>,
        second: Span<'_, Self::Buffer>,
        momentum: f64,
    ) -> KernelResult<()>;
    /// Zeroes `buf`'s float32 entries at the indices of `block`, one
    /// rank's block laid out as `layout` says.
    fn topk_mask(
        &self,
        block: Span<'_, Self::Buffer>,
        layout: TopKBlock,
        buf: Span<'_, Self::Buffer>,
    ) -> KernelResult<()>;
    /// Copies host bytes into `dst`.
    fn load(&self, dst: Span<'_, Self::Buffer>, data: &[u8]) -> KernelResult<()>;
    /// `src`'s bytes on the host, once the work enqueued before is done.
    fn fetch(&self, src: Span<'_, Self::Buffer>) -> KernelResult<Vec<u8>>;
    /// Returns once everything enqueued so far has finished.
    fn synchronize(&self) -> KernelResult<()>;
    /// Runs blocking work (a collective, a wait) with whatever lock the
    /// framework holds released (Python's interpreter lock).
    fn unlocked<R: Send>(&self, work: impl FnOnce() -> R + Send) -> R;
}
