//! The primitives every transport provides, on contiguous byte buffers.
//!
//! Algorithms (flat ring, 2D, sparse) are written against [`Transport`], so
//! they run unchanged over TCP and NCCL. Buffers hold native-endian
//! elements; reductions are sums unless a [`ReduceOp`] says otherwise
//! (torch.distributed's collectives). Every call carries a [`Deadline`]: a
//! peer that stops answering is an error naming it, never a hang.

use std::time::{Duration, Instant};

use super::dtype::{DType, ReduceOp};
use super::mapping::SharedBytes;
use crate::error::{Error, Result};

/// When a collective must have finished, and the timeout it came from (for
/// error messages).
#[derive(Debug, Clone, Copy)]
pub struct Deadline {
    pub at: Instant,
    pub timeout: Duration,
}

impl Deadline {
    /// A deadline `timeout` from now.
    pub fn after(timeout: Duration) -> Self {
        Deadline {
            at: Instant::now() + timeout,
            timeout,
        }
    }

    /// Time left, zero once passed.
    pub fn remaining(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }
}

/// Which collective a rank is about to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum OpKind {
    Allreduce = 1,
    ReduceScatter = 2,
    Allgather = 3,
    Broadcast = 4,
    Barrier = 5,
    AllToAll = 6,
}

impl OpKind {
    fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => OpKind::Allreduce,
            2 => OpKind::ReduceScatter,
            3 => OpKind::Allgather,
            4 => OpKind::Broadcast,
            5 => OpKind::Barrier,
            6 => OpKind::AllToAll,
            _ => return None,
        })
    }
}

/// What a rank says it is about to do. Ranks exchange tags before moving
/// data so that a rank with a different bucket layout raises instead of
/// mixing unrelated gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpTag {
    pub kind: OpKind,
    /// Per-channel sequence number of the collective.
    pub seq: u64,
    /// DDP bucket index (or any caller-chosen id).
    pub bucket: u64,
    /// Element type code ([`DType::code`]), 0 for untyped operations.
    pub dtype: u8,
    /// Reduction code ([`ReduceOp::code`]; 0, a sum, for the rest).
    pub op: u8,
    /// Buffer length in bytes.
    pub bytes: u64,
}

impl OpTag {
    /// Encoded size of a tag.
    pub const LEN: usize = 32;

    /// Fixed little-endian encoding.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[0] = self.kind as u8;
        out[1] = self.dtype;
        out[2] = self.op;
        out[8..16].copy_from_slice(&self.seq.to_le_bytes());
        out[16..24].copy_from_slice(&self.bucket.to_le_bytes());
        out[24..32].copy_from_slice(&self.bytes.to_le_bytes());
        out
    }

    /// Decodes [`OpTag::encode`]'s bytes; `None` if they are not a tag.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != Self::LEN {
            return None;
        }
        let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().unwrap_or([0; 8]));
        Some(OpTag {
            kind: OpKind::from_code(bytes[0])?,
            dtype: bytes[1],
            op: bytes[2],
            seq: u64_at(8),
            bucket: u64_at(16),
            bytes: u64_at(24),
        })
    }

    /// Human-readable description used in mismatch errors.
    pub fn describe(&self) -> String {
        let dtype = DType::from_code(self.dtype).map_or("untyped", DType::name);
        let op = match ReduceOp::from_code(self.op) {
            Some(ReduceOp::Sum) | None => String::new(),
            Some(op) => format!(", {}", op.name()),
        };
        format!(
            "{:?} #{} of bucket {} ({} bytes, {dtype}{op})",
            self.kind, self.seq, self.bucket, self.bytes
        )
    }
}

/// Checks that a broadcast's `root` is a member of a group of `size`.
pub(crate) fn check_root(root: usize, size: usize) -> Result<()> {
    if root >= size {
        return Err(Error::InvalidArgument(format!(
            "broadcast root {root} is not a rank of a group of {size}"
        )));
    }
    Ok(())
}

/// Checks that every member's tag (`tags`, gathered by member) is `mine`;
/// otherwise an `Error::Comm` whose message (prefixed by `ctx`) says who
/// issued what.
pub(crate) fn check_agreement(
    tags: &[Option<OpTag>],
    mine: &OpTag,
    world: impl Fn(usize) -> usize,
    ctx: impl FnOnce(&str) -> String,
) -> Result<()> {
    if tags.iter().all(|t| *t == Some(*mine)) {
        return Ok(());
    }
    let (peer, message) = disagreement(tags, world);
    Err(Error::Comm {
        peer,
        message: ctx(&message),
    })
}

/// Why the members' tags differ: the members grouped by what they issued,
/// the largest group (the first on a tie) taken as the intended collective
/// and the first member of another group returned as the culprit (as a
/// world rank, through `world`).
fn disagreement(tags: &[Option<OpTag>], world: impl Fn(usize) -> usize) -> (Option<usize>, String) {
    let mut groups: Vec<(Option<OpTag>, Vec<usize>)> = Vec::new();
    for (r, t) in tags.iter().enumerate() {
        let r = world(r);
        match groups.iter_mut().find(|(g, _)| g == t) {
            Some((_, ranks)) => ranks.push(r),
            None => groups.push((*t, vec![r])),
        }
    }
    let majority = (0..groups.len())
        .max_by_key(|&i| (groups[i].1.len(), std::cmp::Reverse(i)))
        .unwrap_or(0);
    let odd = groups
        .iter()
        .enumerate()
        .find(|(i, _)| *i != majority)
        .and_then(|(_, (_, ranks))| ranks.first().copied());
    let described: Vec<String> = groups
        .iter()
        .map(|(t, ranks)| {
            let what = t.map_or("an unreadable header".to_string(), |t| t.describe());
            let names: Vec<String> = ranks.iter().map(usize::to_string).collect();
            let noun = if ranks.len() == 1 { "rank" } else { "ranks" };
            format!("{noun} {} issued {what}", names.join(", "))
        })
        .collect();
    (
        odd,
        format!(
            "ranks disagree on the next collective (different bucket layouts or a different \
             order of calls): {}",
            described.join("; ")
        ),
    )
}

/// A channel's failure state, shared by the transports: once a collective
/// failed, the members are out of step, and every later collective fails at
/// once with the first failure's cause.
#[derive(Debug, Default)]
pub(crate) struct Failed(Option<(Option<usize>, String)>);

impl Failed {
    /// An error naming the earlier failure, if there was one; `ctx`
    /// prefixes the message (rank, channel).
    pub(crate) fn check(&self, ctx: impl FnOnce(&str) -> String) -> Result<()> {
        match &self.0 {
            None => Ok(()),
            Some((peer, why)) => Err(Error::Comm {
                peer: *peer,
                message: ctx(&format!(
                    "the channel is unusable after an earlier failure: {why}"
                )),
            }),
        }
    }

    /// Records `err` as the channel's failure; returns the rank it names.
    pub(crate) fn record(&mut self, err: &Error) -> Option<usize> {
        let peer = match err {
            Error::Comm { peer, .. } => *peer,
            Error::CommTimeout { peer, .. } => Some(*peer),
            _ => None,
        };
        self.0 = Some((peer, err.to_string()));
        peer
    }

    /// Marks the channel aborted, unless it already failed.
    pub(crate) fn aborted(&mut self) {
        if self.0.is_none() {
            self.0 = Some((None, "the channel was aborted".to_string()));
        }
    }
}

/// How one reduction runs, besides its buffer: every transport's reducing
/// collectives take it.
#[derive(Debug, Clone, Copy)]
pub struct Reduction<'a> {
    /// The header every rank checks first, when given.
    pub tag: Option<&'a OpTag>,
    /// The elements' type.
    pub dtype: DType,
    /// How elements combine.
    pub op: ReduceOp,
    /// Each element is divided by this before it is combined (1: not
    /// divided).
    pub divisor: f64,
    /// Which bucket it reduces: the key of a result left in shared memory
    /// ([`Transport::allreduce_shared`]).
    pub bucket: u64,
    /// When it must have finished.
    pub deadline: Deadline,
}

impl<'a> Reduction<'a> {
    /// A plain sum of `dtype` elements: no header, nothing divided, bucket 0.
    pub fn sum(dtype: DType, deadline: Deadline) -> Self {
        Reduction {
            tag: None,
            dtype,
            op: ReduceOp::Sum,
            divisor: 1.0,
            bucket: 0,
            deadline,
        }
    }

    /// Divides `buf` in place by the divisor (when not 1), as transports
    /// that do not divide on the way do first.
    pub fn divide(&self, buf: &mut [u8]) {
        if self.divisor != 1.0 {
            self.dtype.div_assign(buf, self.divisor);
        }
    }
}

/// Collective primitives over one group of ranks on one channel.
pub trait Transport: Send {
    /// This process's rank in the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// What carries the group's bytes (`"tcp"` or `"shared memory"`), for
    /// logs and checks.
    fn medium(&self) -> &'static str;

    /// Payload bytes this rank has sent to the other members so far, over
    /// the transport's life: what the TCP ring wrote to its socket (the
    /// 32-byte collective headers not counted), or what a shared-memory
    /// member wrote for the others to read. Only grows.
    fn bytes_sent(&self) -> u64;

    /// Checks that every rank is about to run the same collective; the
    /// error names the ranks whose tag differs.
    fn agree(&mut self, tag: &OpTag, deadline: Deadline) -> Result<()>;

    /// Sums `buf` over all ranks; every rank ends with bitwise-identical bytes.
    fn allreduce(&mut self, buf: &mut [u8], dtype: DType, deadline: Deadline) -> Result<()> {
        self.allreduce_with(buf, &Reduction::sum(dtype, deadline))
    }

    /// Reduces `buf` over all ranks as `how` says (its tag checked first
    /// when given, each element divided by its divisor, by
    /// [`DType::div_assign`]'s rule, before anything is combined); every
    /// rank ends with bitwise-identical bytes. Each element is combined in
    /// the same order as a sum is.
    fn allreduce_with(&mut self, buf: &mut [u8], how: &Reduction) -> Result<()>;

    /// [`Transport::allreduce_with`], except that the result may be left in
    /// memory every rank of the host maps instead of in `buf` (then
    /// returned; `buf` is scratch). It stays the result until the next such
    /// allreduce of the same `how.bucket` and length starts. This one leaves
    /// it in `buf` and returns `None`.
    fn allreduce_shared(&mut self, buf: &mut [u8], how: &Reduction) -> Result<Option<SharedBytes>> {
        self.allreduce_with(buf, how)?;
        Ok(None)
    }

    /// Sums `buf` over all ranks into this rank's shard
    /// (`dtype::shard_range(len, size, rank)`); the rest of `buf` is scratch.
    fn reduce_scatter(&mut self, buf: &mut [u8], dtype: DType, deadline: Deadline) -> Result<()> {
        self.reduce_scatter_with(buf, &Reduction::sum(dtype, deadline))
    }

    /// [`Transport::reduce_scatter`] reducing as `how` says (as
    /// [`Transport::allreduce_with`] does).
    fn reduce_scatter_with(&mut self, buf: &mut [u8], how: &Reduction) -> Result<()>;

    /// Each rank's shard of `buf` (elements of `elem_size` bytes, partitioned
    /// by `dtype::shard_range`) is copied to every rank.
    fn allgather(&mut self, buf: &mut [u8], elem_size: usize, deadline: Deadline) -> Result<()>;

    /// All-to-all of equal blocks: `buf` holds `size` blocks of equal
    /// length, block `j` for member `j`; afterwards block `j` holds what
    /// member `j` had for this member. Built on
    /// [`Transport::allgather`] of every member's whole buffer (so it moves
    /// `size` times the bytes a dedicated exchange would), the same on
    /// every transport.
    fn alltoall(&mut self, buf: &mut [u8], deadline: Deadline) -> Result<()> {
        let (size, rank) = (self.size(), self.rank());
        if buf.len() % size.max(1) != 0 {
            return Err(Error::InvalidArgument(format!(
                "all-to-all: {} bytes do not split into {size} equal blocks",
                buf.len()
            )));
        }
        if size <= 1 || buf.is_empty() {
            return self.barrier(deadline);
        }
        let (len, block) = (buf.len(), buf.len() / size);
        // Member j's whole buffer is element j of the gathered buffer.
        let mut all = vec![0u8; len * size];
        all[rank * len..(rank + 1) * len].copy_from_slice(buf);
        self.allgather(&mut all, 1, deadline)?;
        for (j, out) in buf.chunks_exact_mut(block).enumerate() {
            let at = j * len + rank * block;
            out.copy_from_slice(&all[at..at + block]);
        }
        Ok(())
    }

    /// Copies `root`'s `buf` to every rank.
    fn broadcast(&mut self, buf: &mut [u8], root: usize, deadline: Deadline) -> Result<()>;

    /// Returns once every rank has entered the barrier.
    fn barrier(&mut self, deadline: Deadline) -> Result<()>;

    /// Breaks the transport after a failure so that peers fail at once
    /// instead of waiting for their timeout. Later calls fail.
    fn abort(&mut self);

    /// A handle that breaks this transport from another thread (used when a
    /// sibling channel fails, so a collective blocked here ends too).
    fn aborter(&self) -> Aborter;
}

/// Breaks a transport from any thread; see [`Transport::aborter`].
pub type Aborter = Box<dyn Fn() + Send + Sync>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip() {
        let tag = OpTag {
            kind: OpKind::Allreduce,
            seq: 7,
            bucket: 3,
            dtype: DType::BF16.code(),
            op: ReduceOp::Max.code(),
            bytes: 1 << 40,
        };
        assert_eq!(OpTag::decode(&tag.encode()), Some(tag));
        assert!(tag.describe().contains("bucket 3"));
        assert!(tag.describe().contains("bfloat16, max"));
        assert_eq!(OpTag::decode(&[0u8; 32]), None);
    }
}
