//! What the engine carried: per algorithm and codec, the buckets, the
//! bytes handed in and the bytes this rank sent on each group.
//!
//! One [`Counters`] belongs to an engine (the host engine's channels and
//! the device engine's channels share it); [`super::algo::Algorithm`]
//! records every bucket it finished, and the engine's torch.distributed
//! collectives are recorded under [`Path::Collective`]. The bytes sent are
//! what the transports count where they send ([`super::Transport::bytes_sent`]:
//! the TCP ring's payload, the bytes a member writes into shared memory for
//! the others, the buffers handed to NCCL), read before and after a bucket
//! on the channel that ran it. Everything is a relaxed atomic: recording
//! takes no lock, and a snapshot taken while buckets run may mix two
//! buckets' worth of fields, which is fine for counters.

use std::sync::atomic::{AtomicU64, Ordering};

use super::backend::{Backend, GroupId};
use super::codec::Compression;

/// How a bucket was reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// The flat allreduce over the world (ring on TCP, slots in shared
    /// memory, one NCCL allreduce).
    Ring,
    /// Top-K over the world.
    TopK,
    /// The 2D allreduce (intra-node reduce-scatter, inter-node allreduce,
    /// intra-node allgather).
    TwoD,
    /// The 2D allreduce whose inter-node step is Top-K.
    TwoDTopK,
    /// torch.distributed's collectives run by the engine (the `tiacc`
    /// backend) on the world: exact, or a compressed reduce-scatter.
    Collective,
    /// torch.distributed's reduce-scatters and all-gathers over the 2D
    /// groups ([`super::sharded`]).
    Collective2d,
}

impl Path {
    /// Every path, in the order of [`Path::index`].
    pub const ALL: [Path; 6] = [
        Path::Ring,
        Path::TopK,
        Path::TwoD,
        Path::TwoDTopK,
        Path::Collective,
        Path::Collective2d,
    ];

    /// The name used in counters, logs and the summary line.
    pub fn name(self) -> &'static str {
        match self {
            Path::Ring => "ring",
            Path::TopK => "topk",
            Path::TwoD => "2d",
            Path::TwoDTopK => "2d+topk",
            Path::Collective => "collective",
            Path::Collective2d => "collective-2d",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

const CODECS: [Compression; 3] = [Compression::None, Compression::Fp16, Compression::Bf16];

fn codec_index(codec: Compression) -> usize {
    match codec {
        Compression::None => 0,
        Compression::Fp16 => 1,
        Compression::Bf16 => 2,
    }
}

/// The groups bytes are counted on, in the order of [`Wire`]'s fields.
pub const GROUPS: [GroupId; 3] = [GroupId::World, GroupId::Intra, GroupId::Inter];

/// Bytes sent on each group: world, intra-node, inter-node.
pub type Wire = [u64; 3];

/// What `b` has sent so far on each group of [`GROUPS`].
pub fn wire_of(b: &dyn Backend) -> Wire {
    GROUPS.map(|g| b.bytes_sent(g))
}

/// `after - before`, per group (a transport's count only grows).
pub fn wire_since(before: Wire, after: Wire) -> Wire {
    [0, 1, 2].map(|i| after[i].saturating_sub(before[i]))
}

#[derive(Debug, Default)]
struct Cell {
    buckets: AtomicU64,
    bytes_in: AtomicU64,
    wire: [AtomicU64; 3],
}

/// One row of [`Counters::snapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterRow {
    pub path: Path,
    pub codec: Compression,
    /// Buckets (or collectives) finished.
    pub buckets: u64,
    /// Bytes of those buffers as handed to the engine.
    pub bytes_in: u64,
    /// Bytes this rank sent on the world, intra-node and inter-node groups.
    pub wire: Wire,
}

impl CounterRow {
    /// Bytes sent on every group together.
    pub fn wire_total(&self) -> u64 {
        self.wire.iter().sum()
    }
}

/// An engine's counters (see the module docs).
#[derive(Debug, Default)]
pub struct Counters {
    cells: [[Cell; 3]; 6],
}

impl Counters {
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts one finished bucket of `bytes_in` bytes reduced by `path`
    /// with `codec`, which sent `wire` bytes on each group.
    pub fn record(&self, path: Path, codec: Compression, bytes_in: u64, wire: Wire) {
        let cell = &self.cells[path.index()][codec_index(codec)];
        cell.buckets.fetch_add(1, Ordering::Relaxed);
        cell.bytes_in.fetch_add(bytes_in, Ordering::Relaxed);
        for (w, n) in cell.wire.iter().zip(wire) {
            if n > 0 {
                w.fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    /// Every (path, codec) that carried at least one bucket, in a fixed
    /// order (path, then codec).
    pub fn snapshot(&self) -> Vec<CounterRow> {
        let mut rows = Vec::new();
        for path in Path::ALL {
            for codec in CODECS {
                let cell = &self.cells[path.index()][codec_index(codec)];
                let buckets = cell.buckets.load(Ordering::Relaxed);
                if buckets == 0 {
                    continue;
                }
                rows.push(CounterRow {
                    path,
                    codec,
                    buckets,
                    bytes_in: cell.bytes_in.load(Ordering::Relaxed),
                    wire: [0, 1, 2].map(|i| cell.wire[i].load(Ordering::Relaxed)),
                });
            }
        }
        rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_add_up_per_path_and_codec() {
        let c = Counters::new();
        assert!(c.snapshot().is_empty());
        c.record(Path::Ring, Compression::Fp16, 400, [100, 0, 0]);
        c.record(Path::Ring, Compression::Fp16, 400, [100, 0, 0]);
        c.record(Path::TwoD, Compression::None, 64, [0, 32, 16]);
        let rows = c.snapshot();
        assert_eq!(rows.len(), 2);
        assert_eq!(
            rows[0],
            CounterRow {
                path: Path::Ring,
                codec: Compression::Fp16,
                buckets: 2,
                bytes_in: 800,
                wire: [200, 0, 0],
            }
        );
        assert_eq!((rows[1].path.name(), rows[1].codec.name()), ("2d", "none"));
        assert_eq!(rows[1].wire_total(), 48);
    }
}
