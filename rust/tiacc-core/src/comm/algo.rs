//! The allreduce algorithms, written once against [`Backend`].
//!
//! [`Algorithm::allreduce`] is everything that happens to one bucket: the
//! NaN check, DDP's averaging, half-precision compression, and the
//! reduction itself: a flat allreduce over the world, or the 2D
//! (hierarchical) allreduce (reduce-scatter inside the node, allreduce of
//! each shard across nodes, allgather inside the node), either of them
//! optionally Top-K sparse. The CPU path (TCP) and the CUDA path (NCCL) run
//! this same code; only their [`Backend`]s differ.

use super::backend::{Backend, GroupId, GroupSum, Mem, TwoDJob};
use std::sync::Arc;

use super::codec::Compression;
use super::counters::{wire_of, wire_since, Counters, Path};
use super::dtype::{shard_range, DType};
use super::mapping::SharedBytes;
use super::sharded::ReduceScatterPlan;
use super::sparse::{sparse_allreduce, DgcOptions, SparseState, TopKOptions};
use super::transport::OpTag;
use crate::config::{self, CommConfig};
use crate::error::{Error, Result};

/// What the algorithm does to a bucket, derived from the configuration
/// ([`AlgoSettings::from_config`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AlgoSettings {
    /// Wire type of whole float32/float64 buckets.
    pub compression: Compression,
    /// Wire type of the 2D inter-node step only (scope `inter` with 2D).
    pub inter_compression: Compression,
    /// `compression` and `inter_compression` of torch.distributed's
    /// reduce-scatters (opt-in, the same scope rules).
    pub reduce_scatter_compression: Compression,
    pub reduce_scatter_inter_compression: Compression,
    /// Multiplier applied before a half-precision cast, divided out after.
    pub scale: f64,
    /// Refuse to send a bucket holding NaN or infinity.
    pub nan_check: bool,
    /// With the 2D groups present: buckets of at most this many bytes use
    /// the 2D allreduce. `None`: always flat.
    pub hierarchical_threshold: Option<u64>,
    /// Top-K sparsification, when on.
    pub topk: Option<TopKOptions>,
    /// Top-K's momentum correction, clipping and warm-up.
    pub dgc: DgcOptions,
}

impl Default for AlgoSettings {
    fn default() -> Self {
        AlgoSettings {
            compression: Compression::None,
            inter_compression: Compression::None,
            reduce_scatter_compression: Compression::None,
            reduce_scatter_inter_compression: Compression::None,
            scale: 1.0,
            nan_check: false,
            hierarchical_threshold: None,
            topk: None,
            dgc: DgcOptions::default(),
        }
    }
}

impl AlgoSettings {
    /// The settings for a job of `world` ranks, `local_size` of them per
    /// node when the launcher said, with the 2D groups when `hierarchical`.
    ///
    /// Compression scope `inter` compresses only what crosses nodes: with
    /// 2D that is exactly its inter-node step; with the flat ring it is the
    /// whole ring when the job spans nodes, and nothing on one node.
    pub fn from_config(
        config: &CommConfig,
        world: usize,
        local_size: Option<usize>,
        hierarchical: bool,
    ) -> Self {
        let scoped = |codec: Compression| match (config.compression_inter_only, hierarchical) {
            (false, _) => (codec, Compression::None),
            (true, true) => (Compression::None, codec),
            (true, false) if config::spans_nodes(world, local_size) => (codec, Compression::None),
            (true, false) => (Compression::None, Compression::None),
        };
        let (compression, inter_compression) = scoped(config.compression);
        let (reduce_scatter_compression, reduce_scatter_inter_compression) =
            scoped(config.reduce_scatter_compression);
        AlgoSettings {
            compression,
            inter_compression,
            reduce_scatter_compression,
            reduce_scatter_inter_compression,
            scale: config.compression_scale,
            nan_check: config.nan_check,
            hierarchical_threshold: hierarchical.then_some(config.hierarchical_threshold),
            topk: TopKOptions::from_config(config),
            dgc: DgcOptions {
                momentum: config.topk_momentum,
                masking: config.topk_momentum_masking,
                warmup_steps: config.topk_warmup_steps,
                clip_norm: config.topk_clip_norm,
            },
        }
    }
}

impl AlgoSettings {
    /// How torch.distributed's reduce-scatters and all-gathers run: over
    /// the 2D groups whenever the allreduce goes 2D (forced, or `auto`'s
    /// choice; every size, since the bytes crossing nodes shrink for any),
    /// compressed as [`AlgoSettings::from_config`] scoped it.
    pub fn reduce_scatter_plan(&self) -> ReduceScatterPlan {
        ReduceScatterPlan {
            two_d: self.hierarchical_threshold.is_some(),
            compression: self.reduce_scatter_compression,
            inter_compression: self.reduce_scatter_inter_compression,
            scale: self.scale,
        }
    }
}

/// One channel's algorithm: its settings, the Top-K bookkeeping and the
/// engine's counters, where it records every bucket it finishes.
#[derive(Debug, Clone)]
pub struct Algorithm {
    settings: AlgoSettings,
    /// Each bucket's Top-K length and step count.
    sparse: SparseState,
    counters: Arc<Counters>,
}

impl Algorithm {
    /// An algorithm with counters of its own.
    pub fn new(settings: AlgoSettings) -> Self {
        Self::with_counters(settings, Arc::new(Counters::new()))
    }

    /// An algorithm recording into `counters` (shared by an engine's channels).
    pub fn with_counters(settings: AlgoSettings, counters: Arc<Counters>) -> Self {
        Algorithm {
            settings,
            sparse: SparseState::default(),
            counters,
        }
    }

    pub fn settings(&self) -> &AlgoSettings {
        &self.settings
    }

    /// The counters this algorithm records into.
    pub fn counters(&self) -> &Arc<Counters> {
        &self.counters
    }

    /// Each bucket's Top-K length and step count (the buffers themselves
    /// live in the backend).
    pub fn sparse_state(&self) -> &SparseState {
        &self.sparse
    }

    /// Replaces the Top-K bookkeeping (a checkpoint's, see
    /// [`super::state`]); the backend's buffers must match it.
    pub fn set_sparse_state(&mut self, sparse: SparseState) {
        self.sparse = sparse;
    }

    /// Sums the bucket's bytes over the world, divided by the world
    /// size first when `average` (DDP's gradient averaging, done before the
    /// sum so half types cannot overflow). Every rank ends with identical
    /// bytes.
    pub fn allreduce(&mut self, b: &mut dyn Backend, bucket: Bucket, average: bool) -> Result<()> {
        self.run(b, bucket, average, false).map(|_| ())
    }

    /// [`Algorithm::allreduce`], except that a flat dense sum (no
    /// compression, no Top-K, no 2D) may leave its result in memory every
    /// rank of the host maps instead of in `buf`: it is then returned, and
    /// `buf` is scratch (see [`Backend::allreduce_shared`]).
    pub fn allreduce_shared(
        &mut self,
        b: &mut dyn Backend,
        bucket: Bucket,
        average: bool,
    ) -> Result<Option<SharedBytes>> {
        self.run(b, bucket, average, true)
    }

    fn run(
        &mut self,
        b: &mut dyn Backend,
        bucket: Bucket,
        average: bool,
        share: bool,
    ) -> Result<Option<SharedBytes>> {
        let before = wire_of(b);
        let (path, codec, result) = self.run_uncounted(b, bucket, average, share)?;
        let wire = wire_since(before, wire_of(b));
        self.counters
            .record(path, codec, bucket.buf.bytes as u64, wire);
        Ok(result)
    }

    /// [`Algorithm::run`] without the counters: the result, and the path
    /// and codec that produced it.
    fn run_uncounted(
        &mut self,
        b: &mut dyn Backend,
        bucket: Bucket,
        average: bool,
        share: bool,
    ) -> Result<(Path, Compression, Option<SharedBytes>)> {
        let Bucket { tag, buf, dtype } = bucket;
        let (rank, size) = (b.rank(GroupId::World), b.size(GroupId::World));
        if self.settings.nan_check {
            if let Some((index, value)) = b.first_non_finite(buf, dtype)? {
                return Err(Error::Comm {
                    peer: Some(rank),
                    message: format!(
                        "rank {rank}: bucket {} holds a non-finite gradient ({value} at element \
                         {index} of {}); it was not sent to the other ranks (NaN check is on)",
                        tag.bucket,
                        buf.bytes / dtype.size()
                    ),
                });
            }
        }
        let divisor = if average && size > 1 {
            size as f64
        } else {
            1.0
        };
        let wire = self
            .settings
            .compression
            .wire_dtype(dtype)
            .filter(|_| size > 1);
        let Some(wire) = wire else {
            return self.reduce(b, bucket, divisor, share);
        };
        let codec = self.settings.compression;
        let scale = self.settings.scale;
        let sent = b.alloc(buf.bytes / dtype.size() * wire.size())?;
        b.encode(buf, dtype, scale / divisor, sent, wire)?;
        let wire_tag = OpTag {
            op: 0,
            dtype: wire.code(),
            bytes: sent.bytes as u64,
            ..*tag
        };
        let on_wire = Bucket {
            tag: &wire_tag,
            buf: sent,
            dtype: wire,
        };
        let (path, _, _) = self.reduce(b, on_wire, 1.0, false)?;
        b.decode(sent, wire, 1.0 / scale, buf, dtype)?;
        Ok((path, codec, None))
    }

    /// The reduction proper of `buf / divisor`: flat or 2D, dense or Top-K
    /// (the path it took, and the codec of a compressed inter-node step).
    /// A flat dense sum leaves the division to the backend (a transport
    /// that copies the data divides on the way), and its result in shared
    /// memory when `share` and the backend can; the others divide first.
    fn reduce(
        &mut self,
        b: &mut dyn Backend,
        bucket: Bucket,
        divisor: f64,
        share: bool,
    ) -> Result<(Path, Compression, Option<SharedBytes>)> {
        let Bucket { tag, buf, dtype } = bucket;
        let none = Compression::None;
        let sparse = self.settings.topk.filter(|o| o.applies(dtype, buf.bytes));
        let two_d = b.hierarchical()
            && self
                .settings
                .hierarchical_threshold
                .is_some_and(|t| buf.bytes as u64 <= t);
        if !two_d && sparse.is_none() {
            let sum = GroupSum {
                tag: Some(tag),
                divisor,
                ..GroupSum::plain(GroupId::World, dtype)
            };
            if share {
                let shared = b.allreduce_shared(buf, &sum)?;
                return Ok((Path::Ring, none, shared));
            }
            b.allreduce(buf, &sum)?;
            return Ok((Path::Ring, none, None));
        }
        let dense_two_d = two_d && sparse.is_none();
        if divisor != 1.0 && !dense_two_d {
            // The dense 2D allreduce divides on its way instead (below).
            b.div(buf, dtype, divisor)?;
        }
        if let (false, Some(options)) = (two_d, sparse) {
            b.agree(GroupId::World, tag)?;
            let (dgc, state) = (&self.settings.dgc, &mut self.sparse);
            sparse_allreduce(b, GroupId::World, tag.bucket, buf, &options, dgc, state)?;
            return Ok((Path::TopK, none, None));
        }
        // Checking the tag inside every node and across nodes covers every rank.
        b.agree(GroupId::Intra, tag)?;
        b.agree(GroupId::Inter, tag)?;
        if let Some(options) = sparse {
            // One piece: the Top-K selection is over the whole bucket.
            let shards = b.reduce_scatter(GroupId::Intra, buf, dtype)?;
            let (dgc, state) = (&self.settings.dgc, &mut self.sparse);
            sparse_allreduce(
                b,
                GroupId::Inter,
                tag.bucket,
                shards.mine,
                &options,
                dgc,
                state,
            )?;
            b.allgather(GroupId::Intra, shards, buf, dtype.size())?;
            return Ok((Path::TwoDTopK, none, None));
        }
        let wire = self.settings.inter_compression.wire_dtype(dtype);
        let codec = wire.map_or(none, |_| self.settings.inter_compression);
        let scale = self.settings.scale;
        let step = move |b: &mut dyn Backend, mine: Mem| inter_dense(b, mine, dtype, wire, scale);
        let chunks = pipeline_chunks(buf, dtype, b.pipelines())?;
        let job = TwoDJob {
            dtype,
            divisor,
            chunks: &chunks,
            inter: &step,
        };
        b.two_d(job)?;
        Ok((Path::TwoD, codec, None))
    }
}

/// One bucket as an [`Algorithm`] reduces it: its header, its bytes and
/// their element type.
#[derive(Debug, Clone, Copy)]
pub struct Bucket<'a> {
    pub tag: &'a OpTag,
    pub buf: Mem,
    pub dtype: DType,
}

/// The inter-node step of the 2D allreduce on one shard: a plain sum
/// across nodes, or through `wire` (half precision, scaled) when only the
/// inter-node traffic is compressed.
fn inter_dense(
    b: &mut dyn Backend,
    mine: Mem,
    dtype: DType,
    wire: Option<DType>,
    scale: f64,
) -> Result<()> {
    let Some(wire) = wire else {
        return b.allreduce(mine, &GroupSum::plain(GroupId::Inter, dtype));
    };
    let half = b.alloc(mine.bytes / dtype.size() * wire.size())?;
    b.encode(mine, dtype, scale, half, wire)?;
    b.allreduce(half, &GroupSum::plain(GroupId::Inter, wire))?;
    b.decode(half, wire, 1.0 / scale, mine, dtype)
}

/// Target size of one chunk of a pipelined 2D allreduce: small enough
/// that the first reduce-scatter and the last allgather (the steps the
/// pipeline cannot hide) are short, large enough that per-collective costs
/// stay negligible.
pub const PIPELINE_CHUNK_BYTES: usize = 2 << 20;
/// Most chunks one bucket is cut into.
pub const MAX_PIPELINE_CHUNKS: usize = 16;
/// A bucket of a few MiB is still cut into [`MIN_PIPELINE_CHUNKS`] chunks
/// of at least this size, so that filling and draining the pipeline (the
/// first chunk's reduce-scatter, the last one's allgather) stays short.
pub const MIN_PIPELINE_CHUNK_BYTES: usize = 512 << 10;
/// Chunks of a bucket of at least 4 x [`MIN_PIPELINE_CHUNK_BYTES`].
pub const MIN_PIPELINE_CHUNKS: usize = 4;

/// The chunks a 2D allreduce of `buf` runs in: consecutive, element-aligned
/// and nearly equal, the same on every rank (they depend only on the
/// length). One chunk when the backend does not pipeline.
pub fn pipeline_chunks(buf: Mem, dtype: DType, pipelines: bool) -> Result<Vec<Mem>> {
    let elems = buf.bytes / dtype.size();
    let n = if pipelines {
        let small = (buf.bytes / MIN_PIPELINE_CHUNK_BYTES).min(MIN_PIPELINE_CHUNKS);
        (buf.bytes / PIPELINE_CHUNK_BYTES)
            .max(small)
            .clamp(1, MAX_PIPELINE_CHUNKS)
    } else {
        1
    };
    (0..n)
        .map(|i| buf.elems(dtype, shard_range(elems, n, i)))
        .collect()
}

/// The 2D allreduce `job`, one chunk after another: for each, its
/// division, the reduce-scatter inside the node, the inter-node step on
/// this rank's shard, the allgather inside the node. Backends that cannot
/// overlap the steps run this; the host backend pipelines the same steps
/// (and divides while its reduce-scatter copies).
pub fn two_d_in_order(b: &mut dyn Backend, job: TwoDJob<'_>) -> Result<()> {
    for &c in job.chunks {
        if job.divisor != 1.0 {
            b.div(c, job.dtype, job.divisor)?;
        }
        let shards = b.reduce_scatter(GroupId::Intra, c, job.dtype)?;
        (job.inter)(b, shards.mine)?;
        b.allgather(GroupId::Intra, shards, c, job.dtype.size())?;
    }
    Ok(())
}

/// Which node each rank is on: ranks `node * intra_size .. (node + 1) *
/// intra_size` share a node (torchrun and `mpirun --map-by slot` number
/// ranks that way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub rank: usize,
    pub world: usize,
    pub intra_size: usize,
}

impl Layout {
    /// Checks that the world splits into whole nodes.
    pub fn new(rank: usize, world: usize, intra_size: usize) -> Result<Self> {
        if intra_size == 0 || world % intra_size != 0 || rank >= world {
            return Err(Error::Config {
                variable: config::INTRA_SIZE.to_string(),
                value: intra_size.to_string(),
                expected: format!(
                    "a number of ranks per node that divides the world of {world} ranks (set \
                     {} or launch the same number of ranks on every node)",
                    config::INTRA_SIZE
                ),
            });
        }
        Ok(Layout {
            rank,
            world,
            intra_size,
        })
    }

    /// [`Layout::new`], checked against where the ranks run: `hosts[r]` is
    /// rank `r`'s host name and its local rank when the launcher gave one.
    /// Every node group must be on one host, in local-rank order.
    pub fn from_hosts(
        rank: usize,
        intra_size: usize,
        hosts: &[(String, Option<usize>)],
    ) -> Result<Self> {
        let layout = Layout::new(rank, hosts.len(), intra_size)?;
        let bad = |expected: String| Error::Config {
            variable: config::INTRA_SIZE.to_string(),
            value: intra_size.to_string(),
            expected,
        };
        for (r, (host, local)) in hosts.iter().enumerate() {
            let first = r / intra_size * intra_size;
            if *host != hosts[first].0 {
                return Err(bad(format!(
                    "the number of ranks per host, launched node by node: rank {r} is on host \
                     {host} but rank {first} of the same node group (ranks {first}..{}) is on {}",
                    first + intra_size - 1,
                    hosts[first].0
                )));
            }
            if let Some(local) = local.filter(|&l| l != r % intra_size) {
                return Err(bad(format!(
                    "the number of ranks per host: rank {r} has local rank {local}, expected {} \
                     with {intra_size} ranks per node",
                    r % intra_size
                )));
            }
        }
        Ok(layout)
    }

    pub fn node(&self) -> usize {
        self.rank / self.intra_size
    }

    pub fn local_rank(&self) -> usize {
        self.rank % self.intra_size
    }

    pub fn nodes(&self) -> usize {
        self.world / self.intra_size
    }

    /// World ranks of this rank's node, in local-rank order.
    pub fn intra_members(&self) -> Vec<usize> {
        let first = self.node() * self.intra_size;
        (first..first + self.intra_size).collect()
    }

    /// World ranks with this rank's local rank, in node order.
    pub fn inter_members(&self) -> Vec<usize> {
        (0..self.nodes())
            .map(|n| n * self.intra_size + self.local_rank())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_split_the_world_into_nodes() {
        let l = Layout::new(5, 8, 4).unwrap();
        assert_eq!((l.node(), l.local_rank(), l.nodes()), (1, 1, 2));
        assert_eq!(l.intra_members(), vec![4, 5, 6, 7]);
        assert_eq!(l.inter_members(), vec![1, 5]);
        let err = Layout::new(0, 6, 4).unwrap_err();
        assert!(matches!(&err, Error::Config { variable, .. } if variable == "LIGHT_INTRA_SIZE"));
    }

    #[test]
    fn layouts_are_checked_against_hosts() {
        let hosts = |v: &[(&str, Option<usize>)]| -> Vec<(String, Option<usize>)> {
            v.iter().map(|(h, l)| (h.to_string(), *l)).collect()
        };
        let good = hosts(&[("a", Some(0)), ("a", Some(1)), ("b", Some(0)), ("b", None)]);
        assert_eq!(Layout::from_hosts(2, 2, &good).unwrap().node(), 1);
        let split = hosts(&[("a", None), ("b", None), ("b", None), ("b", None)]);
        let err = Layout::from_hosts(0, 2, &split).unwrap_err().to_string();
        assert!(err.contains("rank 1 is on host b but rank 0"), "{err}");
        let order = hosts(&[("a", Some(1)), ("a", Some(0))]);
        let err = Layout::from_hosts(0, 2, &order).unwrap_err().to_string();
        assert!(err.contains("rank 0 has local rank 1, expected 0"), "{err}");
    }

    #[test]
    fn pipeline_chunks_cover_the_buffer_in_whole_elements() {
        let buf = Mem::new(4096, 9 * PIPELINE_CHUNK_BYTES + 12);
        let chunks = pipeline_chunks(buf, DType::F32, true).unwrap();
        assert_eq!(chunks.len(), 9);
        assert_eq!(chunks[0].addr, buf.addr);
        for pair in chunks.windows(2) {
            assert_eq!(pair[0].end(), pair[1].addr);
        }
        assert_eq!(chunks[8].end(), buf.end());
        assert!(chunks.iter().all(|c| c.bytes % 4 == 0));
        let huge = Mem::new(0, 1000 * PIPELINE_CHUNK_BYTES);
        assert_eq!(
            pipeline_chunks(huge, DType::F16, true).unwrap().len(),
            MAX_PIPELINE_CHUNKS
        );
        assert_eq!(
            pipeline_chunks(huge, DType::F16, false).unwrap(),
            vec![huge]
        );
        // A bucket of a few MiB: 4 chunks of at least 512 KiB.
        let few = Mem::new(0, 4_500_000);
        let chunks = pipeline_chunks(few, DType::F32, true).unwrap();
        assert_eq!(chunks.len(), MIN_PIPELINE_CHUNKS);
        assert!(chunks.iter().all(|c| c.bytes >= MIN_PIPELINE_CHUNK_BYTES));
        let two = Mem::new(0, 2 * MIN_PIPELINE_CHUNK_BYTES + 8);
        assert_eq!(pipeline_chunks(two, DType::F32, true).unwrap().len(), 2);
        let small = Mem::new(0, 100);
        assert_eq!(
            pipeline_chunks(small, DType::F32, true).unwrap(),
            vec![small]
        );
    }

    #[test]
    fn compression_scope_inter_compresses_what_crosses_nodes() {
        let config = CommConfig {
            compression: Compression::Fp16,
            compression_inter_only: true,
            ..Default::default()
        };
        let two_d = AlgoSettings::from_config(&config, 4, Some(2), true);
        assert_eq!(
            (two_d.compression, two_d.inter_compression),
            (Compression::None, Compression::Fp16)
        );
        assert!(two_d.hierarchical_threshold.is_some());
        let flat = AlgoSettings::from_config(&config, 4, Some(2), false);
        assert_eq!(flat.compression, Compression::Fp16);
        let one_node = AlgoSettings::from_config(&config, 4, Some(4), false);
        assert_eq!(one_node.compression, Compression::None);
        let all = AlgoSettings::from_config(
            &CommConfig {
                compression_inter_only: false,
                ..config
            },
            4,
            Some(4),
            false,
        );
        assert_eq!(all.compression, Compression::Fp16);
    }
}
