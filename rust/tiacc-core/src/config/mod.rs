//! Every environment variable the engine reads: name, default, parser, doc.
//!
//! This is the only module that reads the environment. Precedence is
//! explicit Python argument > environment variable > default: the Python
//! shim passes its arguments to [`CommConfig::with_overrides`], which parses
//! them with the same parsers as the variables. A value that does not parse
//! is an error naming the variable (or argument), never a silent default.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::comm::codec::Compression;
use crate::error::{Error, Result};

mod iface;
mod scan;
pub mod startup;

pub use iface::{system_interfaces, Interface};
pub use scan::{closest_known, edit_distance, known_names, SCAN_PREFIXES};

/// Largest fused bucket in bytes (DDP's `bucket_cap_mb`, in bytes, as the
/// TI-ACC documents give it).
pub const FUSION_THRESHOLD: &str = "TIACC_TRAINING_FUSION_THRESHOLD";
/// Number of communication channels (one NCCL stream or one set of TCP
/// connections and a worker thread each).
pub const NUM_STREAMS: &str = "TIACC_TRAINING_NUM_NCCL_STREAMS";
/// Seconds a collective may wait on a peer before it fails.
pub const TIMEOUT: &str = "TIACC_TRAINING_TIMEOUT";
/// `1` turns the engine off: DDP then communicates natively.
pub const DISABLE: &str = "TIACC_TRAINING_DISABLE";
/// Address this rank's TCP transport listens on and advertises.
pub const SOCKET_ADDR: &str = "TIACC_TRAINING_SOCKET_ADDR";
/// Which transport carries CUDA gradients: `auto`, `nccl` or `tcp`.
pub const TRANSPORT: &str = "TIACC_TRAINING_TRANSPORT";
/// Path of the NCCL library to load instead of searching for one.
pub const NCCL_LIBRARY: &str = "TIACC_TRAINING_NCCL_LIBRARY";
/// `1` (default): ranks of one host exchange CPU gradients through shared
/// memory; `0`: through loopback TCP.
pub const SHM: &str = "TIACC_TRAINING_SHM";
/// What serves torch.distributed's CPU collectives of the default group:
/// `tiacc` (the engine's backend, default), `tiacc-process-group` (the same
/// backend in the form every torch 2.x takes, even where the newer one
/// works) or `gloo`.
pub const COLLECTIVES: &str = "TIACC_TRAINING_COLLECTIVES";
/// What serves torch.distributed's CUDA collectives of groups that asked
/// for NCCL (or for torch's default): `nccl` (default, as asked) or `tiacc`
/// (the "tiacc" backend's device engine over NCCL, ops it does not run
/// forwarded to NCCL).
pub const CUDA_COLLECTIVES: &str = "TIACC_TRAINING_CUDA_COLLECTIVES";

/// Gradient compression on the wire: `none`, `fp16` or `bf16`.
pub const COMPRESSION: &str = "TIACC_TRAINING_COMPRESSION";
/// AIACC's name: `0` fp16, `1` none, `2` fp16 between nodes only.
pub const PERSEUS_DTYPE: &str = "PERSEUS_ALLREDUCE_DTYPE";
/// Which traffic is compressed: `all`, or `inter` (between nodes only).
pub const COMPRESSION_SCOPE: &str = "TIACC_TRAINING_COMPRESSION_SCOPE";
/// Opt-in compression of the reduce-scatters torch.distributed runs on the
/// engine (FSDP's gradients): `none`, `fp16` or `bf16`, with the scope and
/// scale of [`COMPRESSION`].
pub const REDUCE_SCATTER_COMPRESSION: &str = "TIACC_TRAINING_REDUCE_SCATTER_COMPRESSION";
/// Gradients are multiplied by this before the half-precision cast and
/// divided by it after (after the division by the world size).
pub const COMPRESSION_SCALE: &str = "TIACC_TRAINING_COMPRESSION_SCALE";
/// AIACC's name for the compression scale.
pub const PERSEUS_SCALE: &str = "PERSEUS_ALLREDUCE_GRADIENT_SCALE";
/// `1`: a bucket holding NaN or infinity raises before it is sent.
pub const NAN_CHECK: &str = "TIACC_TRAINING_NAN_CHECK";
/// AIACC's names for the NaN check (its documents spell it both ways).
pub const PERSEUS_NAN_CHECK: [&str; 2] =
    ["PERSEUS_ALLREDUCE_NANCHECK", "PERSEUS_ALLREDUCE_NANHECK"];

/// Which allreduce: `auto` (measured at start-up when the job spans
/// nodes), `flat` (one ring over every rank) or `2d` (hierarchical).
pub const ALGORITHM: &str = "TIACC_TRAINING_ALGORITHM";
/// AIACC's name: `0` flat, `1` 2D; unset lets the engine choose.
pub const PERSEUS_MODE: &str = "PERSEUS_ALLREDUCE_MODE";
/// `1`: hierarchical (2D) allreduce, `0`: flat (LightCC's name).
pub const TWO_D: &str = "LIGHT_2D_ALLREDUCE";
/// Ranks per node for the 2D allreduce (default: the launcher's local size).
pub const INTRA_SIZE: &str = "LIGHT_INTRA_SIZE";
/// Only buckets of at most this many bytes use the 2D allreduce.
pub const HIERARCHICAL_THRESHOLD: &str = "LIGHT_HIERARCHICAL_THRESHOLD";
/// `1`: Top-K sparsification with error feedback (LightCC's name).
pub const TOPK: &str = "LIGHT_TOPK_ALLREDUCE";
/// Fraction of entries Top-K sends.
pub const TOPK_RATIO: &str = "LIGHT_TOPK_RATIO";
/// Only buckets of at least this many bytes are sparsified.
pub const TOPK_THRESHOLD: &str = "LIGHT_TOPK_THRESHOLD";
/// `1`: Top-K values travel as float16.
pub const TOPK_FP16: &str = "LIGHT_TOPK_FP16";
/// The optimiser's momentum: Top-K with momentum correction (DGC); 0 = off.
pub const TOPK_MOMENTUM: &str = "TIACC_TRAINING_TOPK_MOMENTUM";
/// `1`: momentum correction with DGC's momentum factor masking.
pub const TOPK_MOMENTUM_MASKING: &str = "TIACC_TRAINING_TOPK_MOMENTUM_MASKING";
/// Steps over which Top-K's density falls from 25% to the ratio.
pub const TOPK_WARMUP_STEPS: &str = "TIACC_TRAINING_TOPK_WARMUP_STEPS";
/// Norm each bucket's averaged gradient is clipped to before Top-K.
pub const TOPK_CLIP_NORM: &str = "TIACC_TRAINING_TOPK_CLIP_NORM";

/// Every this many steps the ranks compare their compute times and rank 0
/// logs any rank clearly slower than the median (0: off).
pub const PERF_CHECK_N_STEPS: &str = "TIACC_TRAINING_PERF_CHECK_N_STEPS";
/// AIACC's name for the slow-rank check.
pub const PERSEUS_PERF_CHECK_N_STEPS: &str = "PERSEUS_PERF_CHECK_N_STEPS";

/// AIACC's upper bound on communication streams: our channels.
pub const PERSEUS_STREAMS: &str = "PERSEUS_ALLREDUCE_STREAMS";
/// AIACC's fusion granularity: `F` makes each bucket 1/F of the model's
/// gradient bytes (0: automatic, our default).
pub const PERSEUS_FUSION: &str = "PERSEUS_ALLREDUCE_FUSION";
/// Horovod's fusion buffer in bytes: our fusion threshold (0: no fusion).
pub const HOROVOD_FUSION_THRESHOLD: &str = "HOROVOD_FUSION_THRESHOLD";
/// Horovod's hierarchical allreduce switch: our 2D allreduce (`1`) or the
/// flat ring (`0`).
pub const HOROVOD_HIERARCHICAL: &str = "HOROVOD_HIERARCHICAL_ALLREDUCE";
/// Backward passes per communication: the DDP hook communicates once every
/// N passes, the gradients accumulating locally in between.
pub const ACCUMULATE_N_STEPS: &str = "TIACC_TRAINING_ACCUMULATE_N_STEPS";
/// AIACC's name for local gradient accumulation.
pub const PERSEUS_ACCUMULATE_N_STEPS: &str = "PERSEUS_ACCUMULATE_N_STEPS";
/// `1`: an unknown `TIACC_TRAINING_`/`LIGHT_`/`PERSEUS_` variable is an
/// error on every rank instead of a warning.
pub const STRICT: &str = "TIACC_TRAINING_STRICT";

/// AIACC's interface for gloo traffic: where our TCP transport binds.
pub const PERSEUS_GLOO_INTERFACE: &str = "PERSEUS_GLOO_NETWORK_INTERFACE";
/// torch's gloo interface variable (the first name of a list).
pub const GLOO_SOCKET_IFNAME: &str = "GLOO_SOCKET_IFNAME";
/// AIACC's interface for NCCL traffic.
pub const PERSEUS_NCCL_INTERFACE: &str = "PERSEUS_NCCL_NETWORK_INTERFACE";
/// NCCL's own interface variable, read, never set or changed (NCCL reads
/// it itself); its list format (`^` excludes, `=` matches exactly,
/// otherwise prefixes) is honoured.
pub const NCCL_SOCKET_IFNAME: &str = "NCCL_SOCKET_IFNAME";

/// The variables that choose the interface of our TCP transport, in order
/// of precedence, after [`SOCKET_ADDR`].
pub const INTERFACE_VARIABLES: [&str; 4] = [
    PERSEUS_GLOO_INTERFACE,
    GLOO_SOCKET_IFNAME,
    PERSEUS_NCCL_INTERFACE,
    NCCL_SOCKET_IFNAME,
];

/// Names users carry over from AIACC and Horovod that have no meaning in
/// this engine, and why: each set one gets one start-up line saying so.
pub const IGNORED: &[(&str, &str)] = &[
    (
        "HOROVOD_CYCLE_TIME",
        "Horovod's background cycle; the engine has none: a bucket goes out as soon as DDP \
         hands it over",
    ),
    (
        "HOROVOD_CACHE_CAPACITY",
        "Horovod's response cache; the engine has no coordinator whose answers to cache",
    ),
    (
        "HOROVOD_HIERARCHICAL_ALLGATHER",
        "DDP gradients are allreduced; the only allgather (Top-K's) follows the allreduce's \
         algorithm",
    ),
    (
        "HOROVOD_AUTOTUNE",
        "no autotuner; TIACC_TRAINING_ALGORITHM=auto measures flat against 2D at start-up",
    ),
    (
        "HOROVOD_GPU_OPERATIONS",
        "TIACC_TRAINING_TRANSPORT chooses what carries CUDA gradients",
    ),
    (
        "PERSEUS_GRADIENT_MOMENTUM",
        "AIACC's gossip compression, which this engine does not have; Top-K's momentum \
         correction is TIACC_TRAINING_TOPK_MOMENTUM",
    ),
];

/// LightCC's default hierarchical threshold (1 GiB).
pub const DEFAULT_HIERARCHICAL_THRESHOLD: u64 = 1 << 30;

/// DDP's own default bucket size (25 MiB), used when nothing is set.
pub const DEFAULT_FUSION_THRESHOLD: u64 = 25 * 1024 * 1024;
/// Default number of channels.
pub const DEFAULT_NUM_STREAMS: usize = 2;
/// Default collective timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// Most channels we accept; each costs connections and a thread.
pub const MAX_NUM_STREAMS: usize = 64;

/// What serves torch.distributed's CPU collectives ([`COLLECTIVES`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CollectivesChoice {
    /// The engine's "tiacc" backend (ops it does not implement go to gloo),
    /// in the newest form the running torch can construct.
    #[default]
    Tiacc,
    /// The same backend as a torch.distributed `ProcessGroup` subclass, the
    /// form every torch 2.x takes, even where the newer one works.
    TiaccProcessGroup,
    /// torch's gloo, as the script asked.
    Gloo,
}

impl CollectivesChoice {
    /// Parses `tiacc`, `tiacc-process-group` or `gloo` (any case); errors
    /// name `variable`.
    pub fn parse(variable: &str, value: &str) -> Result<Self> {
        match value.trim().to_ascii_lowercase().as_str() {
            "tiacc" => Ok(CollectivesChoice::Tiacc),
            "tiacc-process-group" => Ok(CollectivesChoice::TiaccProcessGroup),
            "gloo" => Ok(CollectivesChoice::Gloo),
            _ => Err(bad(variable, value, "tiacc, tiacc-process-group or gloo")),
        }
    }

    /// Lower-case name, as parsed.
    pub fn name(self) -> &'static str {
        match self {
            CollectivesChoice::Tiacc => "tiacc",
            CollectivesChoice::TiaccProcessGroup => "tiacc-process-group",
            CollectivesChoice::Gloo => "gloo",
        }
    }
}

/// What serves torch.distributed's CUDA collectives ([`CUDA_COLLECTIVES`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CudaCollectivesChoice {
    /// torch's NCCL backend, as the script asked.
    #[default]
    Nccl,
    /// The "tiacc" backend's CUDA side: the device engine's channels.
    Tiacc,
}

impl CudaCollectivesChoice {
    /// Parses `nccl` or `tiacc` (any case); errors name `variable`.
    pub fn parse(variable: &str, value: &str) -> Result<Self> {
        match value.trim().to_ascii_lowercase().as_str() {
            "nccl" => Ok(CudaCollectivesChoice::Nccl),
            "tiacc" => Ok(CudaCollectivesChoice::Tiacc),
            _ => Err(bad(variable, value, "nccl or tiacc")),
        }
    }

    /// Lower-case name, as parsed.
    pub fn name(self) -> &'static str {
        match self {
            CudaCollectivesChoice::Nccl => "nccl",
            CudaCollectivesChoice::Tiacc => "tiacc",
        }
    }
}

/// Which transport carries gradients ([`TRANSPORT`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// NCCL for CUDA tensors when NCCL loads and CUDA is available, else TCP.
    #[default]
    Auto,
    /// NCCL for CUDA tensors; an error at initialisation when it cannot be used.
    Nccl,
    /// TCP for everything (CUDA tensors staged through host memory).
    Tcp,
}

impl TransportChoice {
    /// Parses `auto`, `nccl` or `tcp` (any case); errors name `variable`.
    pub fn parse(variable: &str, value: &str) -> Result<Self> {
        match value.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(TransportChoice::Auto),
            "nccl" => Ok(TransportChoice::Nccl),
            "tcp" => Ok(TransportChoice::Tcp),
            _ => Err(bad(variable, value, "auto, nccl or tcp")),
        }
    }

    /// The choice's name.
    pub fn name(self) -> &'static str {
        match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Nccl => "nccl",
            TransportChoice::Tcp => "tcp",
        }
    }
}

/// Which allreduce algorithm runs ([`ALGORITHM`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AlgorithmChoice {
    /// Flat on one node; across nodes of several ranks each, whichever of
    /// flat and 2D the start-up probe measures faster (on CPU buckets over
    /// TCP and on CUDA buckets over NCCL alike).
    #[default]
    Auto,
    /// One ring over every rank.
    Flat,
    /// Reduce-scatter inside each node, allreduce across nodes, allgather.
    TwoD,
}

impl AlgorithmChoice {
    /// Parses `auto`, `flat` or `2d` (any case); errors name `variable`.
    pub fn parse(variable: &str, value: &str) -> Result<Self> {
        match value.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(AlgorithmChoice::Auto),
            "flat" | "ring" => Ok(AlgorithmChoice::Flat),
            "2d" | "hierarchical" => Ok(AlgorithmChoice::TwoD),
            _ => Err(bad(variable, value, "auto, flat or 2d")),
        }
    }

    /// The choice's name.
    pub fn name(self) -> &'static str {
        match self {
            AlgorithmChoice::Auto => "auto",
            AlgorithmChoice::Flat => "flat",
            AlgorithmChoice::TwoD => "2d",
        }
    }
}

/// NCCL's own switch for several ranks on one GPU (NCCL 2.30 and later).
/// Read, never set: it decides whether ranks sharing a GPU may use NCCL.
pub const NCCL_MULTI_RANK_GPU: &str = "NCCL_MULTI_RANK_GPU_ENABLE";

/// The first NCCL release that runs several ranks on one GPU (with
/// [`NCCL_MULTI_RANK_GPU`] set); older ones fail with "Duplicate GPU detected".
pub const NCCL_MULTI_RANK_GPU_SINCE: (u32, u32, u32) = (2, 30, 0);

/// One setting of [`CommConfig`], for recording what set it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Setting {
    Enabled,
    FusionThreshold,
    NumStreams,
    Timeout,
    SocketAddr,
    Transport,
    NcclLibrary,
    SharedMemory,
    Collectives,
    CudaCollectives,
    Compression,
    CompressionScope,
    ReduceScatterCompression,
    CompressionScale,
    NanCheck,
    Algorithm,
    IntraSize,
    HierarchicalThreshold,
    TopK,
    TopKRatio,
    TopKThreshold,
    TopKFp16,
    TopKMomentum,
    TopKMomentumMasking,
    TopKWarmupSteps,
    TopKClipNorm,
    NcclMultiRankGpu,
    PerfCheckNSteps,
    AccumulateNSteps,
}

/// The environment variables, in the order they are applied: AIACC's
/// aliases before our own names, so ours win when both are set.
pub const VARIABLES: &[&str] = &[
    DISABLE,
    PERSEUS_FUSION,
    HOROVOD_FUSION_THRESHOLD,
    FUSION_THRESHOLD,
    PERSEUS_STREAMS,
    NUM_STREAMS,
    TIMEOUT,
    SOCKET_ADDR,
    TRANSPORT,
    NCCL_LIBRARY,
    SHM,
    COLLECTIVES,
    CUDA_COLLECTIVES,
    PERSEUS_DTYPE,
    COMPRESSION,
    COMPRESSION_SCOPE,
    REDUCE_SCATTER_COMPRESSION,
    PERSEUS_SCALE,
    COMPRESSION_SCALE,
    PERSEUS_MODE,
    HOROVOD_HIERARCHICAL,
    TWO_D,
    ALGORITHM,
    INTRA_SIZE,
    HIERARCHICAL_THRESHOLD,
    TOPK,
    TOPK_RATIO,
    TOPK_THRESHOLD,
    TOPK_FP16,
    TOPK_MOMENTUM,
    TOPK_MOMENTUM_MASKING,
    TOPK_WARMUP_STEPS,
    TOPK_CLIP_NORM,
    PERSEUS_NAN_CHECK[0],
    PERSEUS_NAN_CHECK[1],
    NAN_CHECK,
    NCCL_MULTI_RANK_GPU,
    PERSEUS_PERF_CHECK_N_STEPS,
    PERF_CHECK_N_STEPS,
    PERSEUS_ACCUMULATE_N_STEPS,
    ACCUMULATE_N_STEPS,
];

/// The arguments of `init_tiacc_training` that override a variable, and
/// the variable whose parser reads them. `enable` is `DISABLE` inverted.
pub const ARGUMENTS: &[(&str, &str)] = &[
    ("enable", DISABLE),
    ("fusion_threshold", FUSION_THRESHOLD),
    ("num_streams", NUM_STREAMS),
    ("timeout", TIMEOUT),
    ("transport", TRANSPORT),
    ("compression", COMPRESSION),
    ("nan_check", NAN_CHECK),
    ("topk_momentum", TOPK_MOMENTUM),
    ("topk_momentum_masking", TOPK_MOMENTUM_MASKING),
    ("topk_warmup_steps", TOPK_WARMUP_STEPS),
    ("topk_clip_norm", TOPK_CLIP_NORM),
];

/// The communication engine's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct CommConfig {
    /// Whether DDP should use the engine at all.
    pub enabled: bool,
    /// Bucket cap in bytes.
    pub fusion_threshold: u64,
    /// Bucket cap as a fraction of the model's gradient bytes (1/F), when
    /// AIACC's [`PERSEUS_FUSION`] set it; see [`CommConfig::bucket_bytes`].
    pub fusion_fraction: Option<u32>,
    /// Number of channels.
    pub num_streams: usize,
    /// Per-collective timeout.
    pub timeout: Duration,
    /// Listen/advertise address override (IP literal), if any.
    pub socket_addr: Option<std::net::IpAddr>,
    /// Transport for CUDA gradients (CPU gradients always use TCP).
    pub transport: TransportChoice,
    /// NCCL library to load instead of searching, if set.
    pub nccl_library: Option<std::path::PathBuf>,
    /// Wire type for float32/float64 buckets.
    pub compression: Compression,
    /// Compress only traffic between nodes.
    pub compression_inter_only: bool,
    /// Wire type of torch.distributed's reduce-scatters (opt-in).
    pub reduce_scatter_compression: Compression,
    /// Multiplier applied before the half-precision cast.
    pub compression_scale: f64,
    /// Refuse to send non-finite gradients.
    pub nan_check: bool,
    /// Whether ranks of one host use shared memory for CPU gradients.
    pub shared_memory: bool,
    /// What serves torch.distributed's CPU collectives.
    pub collectives: CollectivesChoice,
    /// What serves torch.distributed's CUDA collectives.
    pub cuda_collectives: CudaCollectivesChoice,
    /// Flat, 2D, or measured at start-up.
    pub algorithm: AlgorithmChoice,
    /// Ranks per node for the 2D allreduce, when set.
    pub intra_size: Option<usize>,
    /// Largest bucket (bytes) that uses the 2D allreduce.
    pub hierarchical_threshold: u64,
    /// Use Top-K sparsification.
    pub topk: bool,
    /// Fraction of entries sent.
    pub topk_ratio: f64,
    /// Smallest bucket (bytes) that is sparsified.
    pub topk_threshold: u64,
    /// Send Top-K values as float16.
    pub topk_fp16: bool,
    /// The optimiser's momentum for Top-K's momentum correction (0: off).
    pub topk_momentum: f64,
    /// Zero the velocity where Top-K sent (momentum factor masking).
    pub topk_momentum_masking: bool,
    /// Top-K warm-up, in allreduces of a bucket (0: none).
    pub topk_warmup_steps: u64,
    /// Top-K's local gradient clipping threshold, when set.
    pub topk_clip_norm: Option<f64>,
    /// NCCL may run several ranks on one GPU ([`NCCL_MULTI_RANK_GPU`]).
    pub nccl_multi_rank_gpu: bool,
    /// Steps between two slow-rank checks (0: off).
    pub perf_check_n_steps: u64,
    /// What NCCL gets as `NCCL_SOCKET_IFNAME` where that is unset: AIACC's
    /// [`PERSEUS_NCCL_INTERFACE`], as an exact name (`=eth0`).
    pub nccl_socket_ifname: Option<String>,
    /// Backward passes per communication of the DDP hook (1: every pass).
    pub accumulate_n_steps: u64,
    /// The variable or argument that set each setting not at its default.
    pub set_by: BTreeMap<Setting, String>,
    /// What reading the environment found to say: unknown names, ignored
    /// aliases, an alias overridden by our own name. The start-up report
    /// puts them first among its warnings.
    pub notices: Vec<startup::Warning>,
    /// `TIACC_TRAINING_STRICT=1`: an unknown name, and a gradient bucket
    /// that would leave the engine for torch's own allreduce, are errors.
    pub strict: bool,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            enabled: true,
            fusion_threshold: DEFAULT_FUSION_THRESHOLD,
            fusion_fraction: None,
            num_streams: DEFAULT_NUM_STREAMS,
            timeout: DEFAULT_TIMEOUT,
            socket_addr: None,
            transport: TransportChoice::Auto,
            nccl_library: None,
            compression: Compression::None,
            compression_inter_only: false,
            reduce_scatter_compression: Compression::None,
            compression_scale: 1.0,
            nan_check: false,
            shared_memory: true,
            collectives: CollectivesChoice::Tiacc,
            cuda_collectives: CudaCollectivesChoice::Nccl,
            algorithm: AlgorithmChoice::Auto,
            intra_size: None,
            hierarchical_threshold: DEFAULT_HIERARCHICAL_THRESHOLD,
            topk: false,
            topk_ratio: 0.01,
            topk_threshold: 1 << 20,
            topk_fp16: false,
            topk_momentum: 0.0,
            topk_momentum_masking: false,
            topk_warmup_steps: 0,
            topk_clip_norm: None,
            nccl_multi_rank_gpu: false,
            perf_check_n_steps: 0,
            nccl_socket_ifname: None,
            accumulate_n_steps: 1,
            set_by: BTreeMap::new(),
            notices: Vec::new(),
            strict: false,
        }
    }
}

impl CommConfig {
    /// Reads the configuration from the process environment, with the scan
    /// for unknown names ([`CommConfig::from_vars`]).
    pub fn from_env() -> Result<Self> {
        Self::from_vars(std::env::vars_os(), &system_interfaces)
    }

    /// Reads the configuration from `vars` (an environment's name-value
    /// pairs), resolving interface names through `interfaces`, and scans
    /// the names for the prefixes we own ([`ScanPrefixes`]): each one we do
    /// not know, and each ignored alias ([`IGNORED`]), becomes one notice
    /// (an unknown one naming the closest known name). With
    /// `TIACC_TRAINING_STRICT=1` an unknown name is a `Error::Config`
    /// naming it and the suggestion instead.
    pub fn from_vars(
        vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
        interfaces: &dyn Fn() -> Result<Vec<Interface>>,
    ) -> Result<Self> {
        let map: BTreeMap<String, std::ffi::OsString> = vars
            .into_iter()
            .filter_map(|(name, value)| Some((name.into_string().ok()?, value)))
            .collect();
        let lookup = |name: &str| map.get(name).cloned();
        let strict = match read(&lookup, STRICT)? {
            Some(value) => parse_bool(STRICT, &value)?,
            None => false,
        };
        let mut notices = scan::scan(&map, strict)?;
        let mut config = Self::from_lookup_with(&lookup, interfaces)?;
        notices.append(&mut config.notices);
        config.notices = notices;
        config.strict = strict;
        Ok(config)
    }

    /// Reads the configuration through `lookup` (the environment, or a map
    /// in tests), without the scan for unknown names.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<std::ffi::OsString>) -> Result<Self> {
        Self::from_lookup_with(&lookup, &system_interfaces)
    }

    fn from_lookup_with(
        lookup: &impl Fn(&str) -> Option<std::ffi::OsString>,
        interfaces: &dyn Fn() -> Result<Vec<Interface>>,
    ) -> Result<Self> {
        let mut config = CommConfig::default();
        let mut given: BTreeMap<&str, String> = BTreeMap::new();
        for &variable in VARIABLES {
            if let Some(value) = read(lookup, variable)? {
                let before = config.clone();
                config.apply(variable, variable, &value)?;
                config.note_override(&before, variable, &value, &given);
                given.insert(variable, value);
            }
        }
        config.choose_interface(lookup, interfaces)?;
        Ok(config)
    }

    /// After `variable` was applied over `before`: one notice for each
    /// setting another variable had set to something else, naming both
    /// (`given` holds the values applied so far).
    fn note_override(
        &mut self,
        before: &CommConfig,
        variable: &str,
        value: &str,
        given: &BTreeMap<&str, String>,
    ) {
        if self.same_settings(before) {
            return;
        }
        let mut overridden: Vec<&str> = Vec::new();
        for (setting, label) in &self.set_by {
            if label != variable {
                continue;
            }
            if let Some(previous) = before.source(*setting) {
                if previous != variable && !overridden.contains(&previous) {
                    overridden.push(previous);
                }
            }
        }
        for previous in overridden {
            let Some(previous_value) = given.get(previous) else {
                continue;
            };
            self.notices.push(startup::Warning {
                variable: previous.to_string(),
                message: format!(
                    "is set to {:?} and {variable} to {:?}, which disagree: {variable} wins",
                    previous_value.trim(),
                    value.trim()
                ),
            });
        }
    }

    /// The address our TCP transport binds to and advertises, from an
    /// interface variable ([`INTERFACE_VARIABLES`], first set wins) when
    /// [`SOCKET_ADDR`] is not set; a notice for each other one set to
    /// something else (none for `NCCL_SOCKET_IFNAME`, which is NCCL's).
    /// Also what NCCL is to be handed ([`CommConfig::nccl_socket_ifname`]).
    fn choose_interface(
        &mut self,
        lookup: &impl Fn(&str) -> Option<std::ffi::OsString>,
        interfaces: &dyn Fn() -> Result<Vec<Interface>>,
    ) -> Result<()> {
        let mut set: Vec<(&str, String)> = Vec::new();
        for variable in INTERFACE_VARIABLES {
            if let Some(value) = read(lookup, variable)? {
                set.push((variable, value.trim().to_string()));
            }
        }
        let nccl_set = set.iter().any(|(v, _)| *v == NCCL_SOCKET_IFNAME);
        if let Some((_, name)) = set.iter().find(|(v, _)| *v == PERSEUS_NCCL_INTERFACE) {
            if !nccl_set {
                self.nccl_socket_ifname = Some(format!("={name}"));
            }
        }
        let (winner, winning_value) = match (self.socket_addr, set.first()) {
            (Some(ip), _) => (SOCKET_ADDR, ip.to_string()),
            (None, None) => return Ok(()),
            (None, Some((variable, value))) => {
                let ip = iface::resolve(variable, value, &interfaces()?)?;
                self.socket_addr = Some(std::net::IpAddr::V4(ip));
                self.set_by
                    .insert(Setting::SocketAddr, variable.to_string());
                (*variable, value.clone())
            }
        };
        for (variable, value) in &set {
            if *variable == winner || *variable == NCCL_SOCKET_IFNAME || *value == winning_value {
                continue;
            }
            self.notices.push(startup::Warning {
                variable: variable.to_string(),
                message: format!(
                    "is set to {value:?} and {winner} to {winning_value:?}: our TCP transport \
                     uses {winner}"
                ),
            });
        }
        Ok(())
    }

    /// The bucket cap for a model with `gradient_bytes` bytes of gradients:
    /// 1/F of them under AIACC's [`PERSEUS_FUSION`], else
    /// [`CommConfig::fusion_threshold`].
    pub fn bucket_bytes(&self, gradient_bytes: u64) -> u64 {
        match self.fusion_fraction {
            Some(f) => gradient_bytes.div_ceil(u64::from(f)).max(1),
            None => self.fusion_threshold,
        }
    }

    /// This configuration with `overrides` applied: `(argument, value)`
    /// pairs of [`ARGUMENTS`], each parsed exactly like its variable (an
    /// error names the argument).
    pub fn with_overrides(&self, overrides: &[(&str, &str)]) -> Result<Self> {
        let mut config = self.clone();
        for &(argument, value) in overrides {
            let Some(&(_, variable)) = ARGUMENTS.iter().find(|(a, _)| *a == argument) else {
                return Err(Error::InvalidArgument(format!(
                    "unknown setting {argument:?}: expected one of {}",
                    ARGUMENTS
                        .iter()
                        .map(|(a, _)| *a)
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            };
            if argument == "enable" {
                config.enabled = parse_bool(argument, value)?;
                config.set_by.insert(Setting::Enabled, argument.to_string());
            } else {
                config.apply(variable, argument, value)?;
            }
        }
        Ok(config)
    }

    /// Whether two configurations make the same engine (whatever set them).
    pub fn same_settings(&self, other: &CommConfig) -> bool {
        let strip = |c: &CommConfig| CommConfig {
            set_by: BTreeMap::new(),
            notices: Vec::new(),
            ..c.clone()
        };
        strip(self) == strip(other)
    }

    /// What set `setting`: a variable or argument name, `None` at its default.
    pub fn source(&self, setting: Setting) -> Option<&str> {
        self.set_by.get(&setting).map(String::as_str)
    }

    /// Ranks per node for the 2D allreduce: `LIGHT_INTRA_SIZE`, else the
    /// launcher's `local_size`.
    pub fn intra_size_for(&self, local_size: Option<usize>) -> Result<usize> {
        self.intra_size.or(local_size).ok_or_else(|| Error::Config {
            variable: INTRA_SIZE.to_string(),
            value: String::new(),
            expected: format!(
                "the number of ranks per node, which {}={} needs and the launcher did not give",
                self.source(Setting::Algorithm).unwrap_or(ALGORITHM),
                self.algorithm.name()
            ),
        })
    }

    /// Whether an engine of a `world`-rank job (`local_size` ranks per
    /// node, when the launcher said) connects the 2D groups: always when
    /// 2D is forced; under `auto`, when the job spans whole nodes of
    /// several ranks each (the start-up probe then picks flat or 2D).
    pub fn two_d_groups(&self, world: usize, local_size: Option<usize>) -> bool {
        match self.algorithm {
            AlgorithmChoice::TwoD => true,
            AlgorithmChoice::Flat => false,
            AlgorithmChoice::Auto => {
                let per_node = self.intra_size.or(local_size).unwrap_or(1);
                per_node > 1 && per_node < world && world % per_node == 0
            }
        }
    }

    /// Parses `value` with `variable`'s parser into this configuration;
    /// errors name `label` (the variable, or the argument it came from).
    fn apply(&mut self, variable: &str, label: &str, value: &str) -> Result<()> {
        let setting = match variable {
            DISABLE => {
                self.enabled = !parse_bool(label, value)?;
                Setting::Enabled
            }
            FUSION_THRESHOLD => {
                self.fusion_threshold = parse_positive_u64(label, value)?;
                self.fusion_fraction = None;
                Setting::FusionThreshold
            }
            HOROVOD_FUSION_THRESHOLD => {
                // Horovod's 0 turns fusion off: every gradient its own bucket.
                let bytes: u64 = value
                    .trim()
                    .parse()
                    .map_err(|_| bad(label, value, "a number of bytes (0: no fusion)"))?;
                self.fusion_threshold = bytes.max(1);
                self.fusion_fraction = None;
                Setting::FusionThreshold
            }
            PERSEUS_FUSION => {
                let f = match value.trim().parse::<u32>() {
                    Ok(f) if f <= 128 => f,
                    _ => {
                        return Err(bad(
                            label,
                            value,
                            "an integer from 0 (automatic) to 128 (each bucket 1/128 of the \
                             model's gradient bytes)",
                        ))
                    }
                };
                self.fusion_fraction = (f > 0).then_some(f);
                self.fusion_threshold = DEFAULT_FUSION_THRESHOLD;
                Setting::FusionThreshold
            }
            PERSEUS_STREAMS | NUM_STREAMS => {
                self.num_streams = parse_num_streams(label, value)?;
                Setting::NumStreams
            }
            TIMEOUT => {
                self.timeout = parse_seconds(label, value)?;
                Setting::Timeout
            }
            SOCKET_ADDR => {
                let ip = value
                    .trim()
                    .parse()
                    .map_err(|_| bad(label, value, "an IP address"))?;
                self.socket_addr = Some(ip);
                Setting::SocketAddr
            }
            TRANSPORT => {
                self.transport = TransportChoice::parse(label, value)?;
                Setting::Transport
            }
            NCCL_LIBRARY => {
                // Existence is checked when the library is loaded, where the
                // error can say what else was tried.
                self.nccl_library = Some(std::path::PathBuf::from(value.trim()));
                Setting::NcclLibrary
            }
            PERSEUS_DTYPE => {
                (self.compression, self.compression_inter_only) = match value.trim() {
                    "0" => (Compression::Fp16, false),
                    "1" => (Compression::None, false),
                    "2" => (Compression::Fp16, true),
                    _ => {
                        return Err(bad(
                            label,
                            value,
                            "0 (fp16), 1 (none) or 2 (fp16 between nodes)",
                        ))
                    }
                };
                self.set_by
                    .insert(Setting::CompressionScope, label.to_string());
                Setting::Compression
            }
            COMPRESSION => {
                self.compression = Compression::parse(label, value)?;
                Setting::Compression
            }
            REDUCE_SCATTER_COMPRESSION => {
                self.reduce_scatter_compression = Compression::parse(label, value)?;
                Setting::ReduceScatterCompression
            }
            COMPRESSION_SCOPE => {
                self.compression_inter_only = match value.trim().to_ascii_lowercase().as_str() {
                    "all" => false,
                    "inter" => true,
                    _ => return Err(bad(label, value, "all or inter")),
                };
                Setting::CompressionScope
            }
            PERSEUS_SCALE | COMPRESSION_SCALE => {
                self.compression_scale = match value.trim().parse::<f64>() {
                    Ok(x) if x.is_finite() && x > 0.0 => x,
                    _ => return Err(bad(label, value, "a positive number")),
                };
                Setting::CompressionScale
            }
            TWO_D => {
                self.algorithm = match parse_bool(label, value)? {
                    true => AlgorithmChoice::TwoD,
                    false => AlgorithmChoice::Flat,
                };
                Setting::Algorithm
            }
            HOROVOD_HIERARCHICAL => {
                self.algorithm = match parse_bool(label, value)? {
                    true => AlgorithmChoice::TwoD,
                    false => AlgorithmChoice::Flat,
                };
                Setting::Algorithm
            }
            PERSEUS_MODE => {
                self.algorithm = match value.trim() {
                    "0" => AlgorithmChoice::Flat,
                    "1" => AlgorithmChoice::TwoD,
                    _ => return Err(bad(label, value, "0 (flat) or 1 (two levels)")),
                };
                Setting::Algorithm
            }
            ALGORITHM => {
                self.algorithm = AlgorithmChoice::parse(label, value)?;
                Setting::Algorithm
            }
            INTRA_SIZE => {
                self.intra_size = Some(match value.trim().parse::<usize>() {
                    Ok(n) if n > 0 => n,
                    _ => return Err(bad(label, value, "a positive number of ranks per node")),
                });
                Setting::IntraSize
            }
            HIERARCHICAL_THRESHOLD => {
                self.hierarchical_threshold = parse_positive_u64(label, value)?;
                Setting::HierarchicalThreshold
            }
            TOPK => {
                self.topk = parse_bool(label, value)?;
                Setting::TopK
            }
            TOPK_RATIO => {
                self.topk_ratio = match value.trim().parse::<f64>() {
                    Ok(r) if r > 0.0 && r <= 1.0 => r,
                    _ => return Err(bad(label, value, "a fraction in (0, 1]")),
                };
                Setting::TopKRatio
            }
            TOPK_THRESHOLD => {
                self.topk_threshold = value
                    .trim()
                    .parse()
                    .map_err(|_| bad(label, value, "a number of bytes"))?;
                Setting::TopKThreshold
            }
            TOPK_FP16 => {
                self.topk_fp16 = parse_bool(label, value)?;
                Setting::TopKFp16
            }
            TOPK_MOMENTUM => {
                self.topk_momentum = match value.trim().parse::<f64>() {
                    Ok(m) if (0.0..1.0).contains(&m) => m,
                    _ => return Err(bad(label, value, "the optimiser's momentum, in [0, 1)")),
                };
                Setting::TopKMomentum
            }
            TOPK_MOMENTUM_MASKING => {
                self.topk_momentum_masking = parse_bool(label, value)?;
                Setting::TopKMomentumMasking
            }
            TOPK_WARMUP_STEPS => {
                self.topk_warmup_steps = value
                    .trim()
                    .parse()
                    .map_err(|_| bad(label, value, "a number of steps"))?;
                Setting::TopKWarmupSteps
            }
            TOPK_CLIP_NORM => {
                self.topk_clip_norm = match value.trim().parse::<f64>() {
                    Ok(c) if c.is_finite() && c > 0.0 => Some(c),
                    _ => return Err(bad(label, value, "a positive norm")),
                };
                Setting::TopKClipNorm
            }
            NAN_CHECK => {
                self.nan_check = parse_bool(label, value)?;
                Setting::NanCheck
            }
            SHM => {
                self.shared_memory = value.trim() == "auto" || parse_bool(label, value)?;
                Setting::SharedMemory
            }
            COLLECTIVES => {
                self.collectives = CollectivesChoice::parse(label, value)?;
                Setting::Collectives
            }
            CUDA_COLLECTIVES => {
                self.cuda_collectives = CudaCollectivesChoice::parse(label, value)?;
                Setting::CudaCollectives
            }
            v if PERSEUS_NAN_CHECK.contains(&v) => {
                self.nan_check = parse_bool(label, value)?;
                Setting::NanCheck
            }
            PERF_CHECK_N_STEPS | PERSEUS_PERF_CHECK_N_STEPS => {
                self.perf_check_n_steps = value
                    .trim()
                    .parse()
                    .map_err(|_| bad(label, value, "a number of steps (0: off)"))?;
                Setting::PerfCheckNSteps
            }
            ACCUMULATE_N_STEPS | PERSEUS_ACCUMULATE_N_STEPS => {
                self.accumulate_n_steps = match value.trim().parse::<u64>() {
                    Ok(n) if n > 0 => n,
                    _ => {
                        return Err(bad(
                            label,
                            value,
                            "a positive number of backward passes per communication",
                        ))
                    }
                };
                Setting::AccumulateNSteps
            }
            NCCL_MULTI_RANK_GPU => {
                // NCCL's variable, read as NCCL reads it (an integer, 0 = off);
                // never an error of ours.
                self.nccl_multi_rank_gpu = value.trim().parse::<i64>().is_ok_and(|n| n != 0);
                Setting::NcclMultiRankGpu
            }
            other => {
                return Err(Error::InvalidArgument(format!(
                    "{other} is not a configuration variable"
                )))
            }
        };
        self.set_by.insert(setting, label.to_string());
        Ok(())
    }
}

/// The settings every rank must share, by our variable name: the ones that
/// change what a rank sends, how it takes part in a collective, or which
/// store exchanges it joins. (Per-rank settings such as the listen address,
/// the NCCL library path or the timeout may differ.)
const SHARED: &[(Setting, &str)] = &[
    (Setting::Enabled, DISABLE),
    (Setting::FusionThreshold, FUSION_THRESHOLD),
    (Setting::NumStreams, NUM_STREAMS),
    (Setting::Transport, TRANSPORT),
    (Setting::Compression, COMPRESSION),
    (Setting::CompressionScope, COMPRESSION_SCOPE),
    (
        Setting::ReduceScatterCompression,
        REDUCE_SCATTER_COMPRESSION,
    ),
    (Setting::CompressionScale, COMPRESSION_SCALE),
    (Setting::NanCheck, NAN_CHECK),
    (Setting::Algorithm, ALGORITHM),
    (Setting::IntraSize, INTRA_SIZE),
    (Setting::HierarchicalThreshold, HIERARCHICAL_THRESHOLD),
    (Setting::TopK, TOPK),
    (Setting::TopKRatio, TOPK_RATIO),
    (Setting::TopKThreshold, TOPK_THRESHOLD),
    (Setting::TopKFp16, TOPK_FP16),
    (Setting::TopKMomentum, TOPK_MOMENTUM),
    (Setting::TopKMomentumMasking, TOPK_MOMENTUM_MASKING),
    (Setting::TopKWarmupSteps, TOPK_WARMUP_STEPS),
    (Setting::TopKClipNorm, TOPK_CLIP_NORM),
    (Setting::PerfCheckNSteps, PERF_CHECK_N_STEPS),
    (Setting::AccumulateNSteps, ACCUMULATE_N_STEPS),
];

impl CommConfig {
    /// The value of a shared setting, as text.
    fn shared_value(&self, setting: Setting) -> String {
        match setting {
            Setting::Enabled => (!self.enabled as u8).to_string(),
            Setting::FusionThreshold => match self.fusion_fraction {
                Some(f) => format!("1/{f} of the gradient bytes"),
                None => self.fusion_threshold.to_string(),
            },
            Setting::NumStreams => self.num_streams.to_string(),
            Setting::Transport => self.transport.name().to_string(),
            Setting::Compression => self.compression.name().to_string(),
            Setting::CompressionScope => if self.compression_inter_only {
                "inter"
            } else {
                "all"
            }
            .to_string(),
            Setting::ReduceScatterCompression => self.reduce_scatter_compression.name().to_string(),
            Setting::CompressionScale => self.compression_scale.to_string(),
            Setting::NanCheck => (self.nan_check as u8).to_string(),
            Setting::Algorithm => self.algorithm.name().to_string(),
            Setting::IntraSize => self.intra_size.map_or("unset".into(), |n| n.to_string()),
            Setting::HierarchicalThreshold => self.hierarchical_threshold.to_string(),
            Setting::TopK => (self.topk as u8).to_string(),
            Setting::TopKRatio => self.topk_ratio.to_string(),
            Setting::TopKThreshold => self.topk_threshold.to_string(),
            Setting::TopKFp16 => (self.topk_fp16 as u8).to_string(),
            Setting::TopKMomentum => self.topk_momentum.to_string(),
            Setting::TopKMomentumMasking => (self.topk_momentum_masking as u8).to_string(),
            Setting::TopKWarmupSteps => self.topk_warmup_steps.to_string(),
            Setting::TopKClipNorm => self
                .topk_clip_norm
                .map_or("unset".into(), |c| c.to_string()),
            Setting::PerfCheckNSteps => self.perf_check_n_steps.to_string(),
            Setting::AccumulateNSteps => self.accumulate_n_steps.to_string(),
            _ => String::new(),
        }
    }

    /// The settings every rank must share, one `VARIABLE\tVALUE\tSOURCE`
    /// line each (SOURCE: what set it, or `default`). Ranks exchange this
    /// at start-up and compare with [`check_same_on_every_rank`].
    pub fn shared_fingerprint(&self) -> String {
        SHARED
            .iter()
            .map(|&(setting, variable)| {
                let source = self.source(setting).unwrap_or("default");
                format!("{variable}\t{}\t{source}\n", self.shared_value(setting))
            })
            .collect()
    }
}

/// Compares the ranks' [`CommConfig::shared_fingerprint`]s (`fingerprints[r]`
/// is rank `r`'s). The first setting whose value differs is a
/// `Error::Config` naming the variable, this rank's value, and which ranks
/// have which value (and what set it on them).
pub fn check_same_on_every_rank(rank: usize, fingerprints: &[String]) -> Result<()> {
    let parse = |text: &str| -> Vec<(String, String, String)> {
        text.lines()
            .filter_map(|line| {
                let mut f = line.splitn(3, '\t');
                Some((f.next()?.into(), f.next()?.into(), f.next()?.into()))
            })
            .collect()
    };
    let all: Vec<_> = fingerprints.iter().map(|f| parse(f)).collect();
    let Some(mine) = all.get(rank) else {
        return Err(Error::InvalidArgument(format!(
            "rank {rank} is not among the {} fingerprints",
            all.len()
        )));
    };
    for (i, (variable, value, _)) in mine.iter().enumerate() {
        // Ranks grouped by value, in rank order of first appearance.
        let mut groups: Vec<(String, Vec<usize>, String)> = Vec::new();
        for (r, theirs) in all.iter().enumerate() {
            let (v, source) = match theirs.get(i) {
                Some((name, v, source)) if name == variable => (v.clone(), source.clone()),
                _ => (
                    "(unknown: a different version of tiacc_training)".into(),
                    String::new(),
                ),
            };
            match groups.iter_mut().find(|(g, _, _)| *g == v) {
                Some((_, ranks, _)) => ranks.push(r),
                None => groups.push((v, vec![r], source)),
            }
        }
        if groups.len() < 2 {
            continue;
        }
        let described: Vec<String> = groups
            .iter()
            .map(|(v, ranks, source)| {
                let names: Vec<String> = ranks.iter().map(usize::to_string).collect();
                let noun = if ranks.len() == 1 { "rank" } else { "ranks" };
                let by = match source.as_str() {
                    "" => String::new(),
                    "default" => " (the default)".to_string(),
                    s => format!(" (set by {s})"),
                };
                format!(
                    "{noun} {} {} {v}{by}",
                    names.join(", "),
                    if ranks.len() == 1 { "has" } else { "have" }
                )
            })
            .collect();
        return Err(Error::Config {
            variable: variable.clone(),
            value: value.clone(),
            expected: format!(
                "the same value on every rank, but {}; set it the same way for every rank",
                described.join(" and ")
            ),
        });
    }
    Ok(())
}

/// Whether a job of `world` ranks with `local_size` per node (when the
/// launcher said) spans several nodes; unknown counts as yes.
pub fn spans_nodes(world: usize, local_size: Option<usize>) -> bool {
    local_size.is_none_or(|l| l < world)
}

/// Whether NCCL `version` lets several ranks share one GPU, with
/// [`NCCL_MULTI_RANK_GPU`] set as `enabled`.
pub fn nccl_allows_shared_gpu(version: (u32, u32, u32), enabled: bool) -> bool {
    enabled && version >= NCCL_MULTI_RANK_GPU_SINCE
}

/// How the processes of this job were launched and where they rendezvous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// `torchrun`, `mpirun` or `slurm`.
    pub launcher: &'static str,
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    /// Ranks on this node, when the launcher says.
    pub local_size: Option<usize>,
    /// Rendezvous host (`MASTER_ADDR`), when known.
    pub master_addr: Option<String>,
    /// Rendezvous port (`MASTER_PORT`), when set.
    pub master_port: Option<u16>,
}

/// Launchers read after torchrun, Open MPI and SLURM, each as `(name, rank,
/// size, local rank, local size)` variables: horovodrun's, MPICH's Hydra
/// and a PMIx launcher's (which shares `PMI_SIZE` with Hydra).
pub const OTHER_LAUNCHERS: [(&str, &str, &str, &str, &str); 3] = [
    (
        "horovodrun",
        "HOROVOD_RANK",
        "HOROVOD_SIZE",
        "HOROVOD_LOCAL_RANK",
        "HOROVOD_LOCAL_SIZE",
    ),
    (
        "mpich",
        "PMI_RANK",
        "PMI_SIZE",
        "MPI_LOCALRANKID",
        "MPI_LOCALNRANKS",
    ),
    (
        "pmix",
        "PMIX_RANK",
        "PMI_SIZE",
        "PMIX_LOCAL_RANK",
        "PMIX_LOCAL_SIZE",
    ),
];

/// Detects the launcher from the environment: torchrun (`RANK`,
/// `WORLD_SIZE`, `LOCAL_RANK`), Open MPI (`OMPI_COMM_WORLD_*`), SLURM
/// (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`), then the
/// [`OTHER_LAUNCHERS`] (horovodrun's rendezvous address,
/// `HOROVOD_GLOO_RENDEZVOUS_ADDR` and `_PORT`, stands in for `MASTER_ADDR`
/// and `MASTER_PORT`). `Ok(None)` when none of them set this process up.
pub fn launch_env() -> Result<Option<LaunchEnv>> {
    launch_env_from(|name| std::env::var_os(name))
}

/// [`launch_env`] reading through `lookup`.
pub fn launch_env_from(
    lookup: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> Result<Option<LaunchEnv>> {
    let get = |name: &str| read(&lookup, name);
    let count = |name: &str| -> Result<Option<usize>> {
        get(name)?.map(|v| parse_usize(name, &v)).transpose()
    };
    let master_addr = get("MASTER_ADDR")?.map(|v| v.trim().to_string());
    let master_port = get("MASTER_PORT")?
        .map(|v| {
            v.trim()
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| bad("MASTER_PORT", &v, "a TCP port number (1-65535)"))
        })
        .transpose()?;

    let found = if let (Some(rank), Some(world)) = (count("RANK")?, count("WORLD_SIZE")?) {
        let local_rank = count("LOCAL_RANK")?.unwrap_or(0);
        Some((
            "torchrun",
            "RANK",
            rank,
            world,
            local_rank,
            count("LOCAL_WORLD_SIZE")?,
        ))
    } else if let (Some(rank), Some(world)) = (
        count("OMPI_COMM_WORLD_RANK")?,
        count("OMPI_COMM_WORLD_SIZE")?,
    ) {
        let local_rank = count("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(0);
        let local_size = count("OMPI_COMM_WORLD_LOCAL_SIZE")?;
        Some((
            "mpirun",
            "OMPI_COMM_WORLD_RANK",
            rank,
            world,
            local_rank,
            local_size,
        ))
    } else if let (Some(rank), Some(world)) = (count("SLURM_PROCID")?, count("SLURM_NTASKS")?) {
        let local_rank = count("SLURM_LOCALID")?.unwrap_or(0);
        let local_size = match get("SLURM_TASKS_PER_NODE")? {
            Some(v) => first_tasks_per_node(&v),
            None => None,
        };
        Some(("slurm", "SLURM_PROCID", rank, world, local_rank, local_size))
    } else {
        other_launcher(&count)?
    };
    let Some((launcher, rank_var, rank, world_size, local_rank, local_size)) = found else {
        return Ok(None);
    };
    if world_size == 0 || rank >= world_size {
        return Err(Error::Config {
            variable: rank_var.to_string(),
            value: rank.to_string(),
            expected: format!("a rank below the world size {world_size}"),
        });
    }
    let master_addr = match (master_addr, launcher) {
        (Some(addr), _) => Some(addr),
        (None, "slurm") => get("SLURM_LAUNCH_NODE_IPADDR")?,
        (None, "horovodrun") => get("HOROVOD_GLOO_RENDEZVOUS_ADDR")?.map(|v| v.trim().to_string()),
        (None, _) => None,
    };
    let master_port = match (master_port, launcher) {
        (None, "horovodrun") => get("HOROVOD_GLOO_RENDEZVOUS_PORT")?
            .map(|v| {
                v.trim()
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| {
                        bad(
                            "HOROVOD_GLOO_RENDEZVOUS_PORT",
                            &v,
                            "a TCP port number (1-65535)",
                        )
                    })
            })
            .transpose()?,
        (port, _) => port,
    };
    Ok(Some(LaunchEnv {
        launcher,
        rank,
        world_size,
        local_rank,
        local_size,
        master_addr,
        master_port,
    }))
}

/// What one of the [`OTHER_LAUNCHERS`] set, the first whose rank variable
/// is set: a rank without its size is an error naming both.
#[allow(clippy::type_complexity)]
fn other_launcher(
    count: &impl Fn(&str) -> Result<Option<usize>>,
) -> Result<
    Option<(
        &'static str,
        &'static str,
        usize,
        usize,
        usize,
        Option<usize>,
    )>,
> {
    for (name, rank_var, size_var, local_rank_var, local_size_var) in OTHER_LAUNCHERS {
        let Some(rank) = count(rank_var)? else {
            continue;
        };
        let Some(world) = count(size_var)? else {
            return Err(Error::Config {
                variable: size_var.to_string(),
                value: String::new(),
                expected: format!("the world size, since {rank_var}={rank} is set"),
            });
        };
        let local_rank = count(local_rank_var)?.unwrap_or(0);
        return Ok(Some((
            name,
            rank_var,
            rank,
            world,
            local_rank,
            count(local_size_var)?,
        )));
    }
    Ok(None)
}

/// SLURM writes `2(x3),1` style task counts; the first node's count is
/// enough for a homogeneous job.
fn first_tasks_per_node(value: &str) -> Option<usize> {
    let first = value.split(',').next()?;
    first.split('(').next()?.trim().parse().ok()
}

fn read(
    lookup: &impl Fn(&str) -> Option<std::ffi::OsString>,
    name: &str,
) -> Result<Option<String>> {
    match lookup(name) {
        None => Ok(None),
        Some(v) => match v.into_string() {
            Ok(s) if s.trim().is_empty() => Ok(None),
            Ok(s) => Ok(Some(s)),
            Err(raw) => Err(Error::Config {
                variable: name.to_string(),
                value: raw.to_string_lossy().into_owned(),
                expected: "valid UTF-8".to_string(),
            }),
        },
    }
}

fn bad(variable: &str, value: &str, expected: &str) -> Error {
    Error::Config {
        variable: variable.to_string(),
        value: value.to_string(),
        expected: expected.to_string(),
    }
}

/// Parses `1/0`, `true/false`, `yes/no`, `on/off` (any case).
pub fn parse_bool(variable: &str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(bad(
            variable,
            value,
            "one of 1/0, true/false, yes/no, on/off",
        )),
    }
}

fn parse_usize(variable: &str, value: &str) -> Result<usize> {
    value
        .trim()
        .parse()
        .map_err(|_| bad(variable, value, "a non-negative integer"))
}

fn parse_positive_u64(variable: &str, value: &str) -> Result<u64> {
    match value.trim().parse::<u64>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(bad(variable, value, "a positive integer number of bytes")),
    }
}

/// Parses a channel count in `1..=MAX_NUM_STREAMS`.
pub fn parse_num_streams(variable: &str, value: &str) -> Result<usize> {
    match value.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_NUM_STREAMS).contains(&n) => Ok(n),
        _ => Err(bad(
            variable,
            value,
            &format!("an integer from 1 to {MAX_NUM_STREAMS}"),
        )),
    }
}

/// Parses a positive number of seconds (fractions allowed).
pub fn parse_seconds(variable: &str, value: &str) -> Result<Duration> {
    match value.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Duration::from_secs_f64(s)),
        _ => Err(bad(variable, value, "a positive number of seconds")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::ffi::OsString;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let map: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn defaults_when_nothing_is_set() {
        let c = CommConfig::from_lookup(env(&[])).unwrap();
        assert_eq!(c, CommConfig::default());
        assert!(c.enabled);
    }

    #[test]
    fn reads_every_variable() {
        let c = CommConfig::from_lookup(env(&[
            (FUSION_THRESHOLD, "25217728"),
            (NUM_STREAMS, "3"),
            (TIMEOUT, "2.5"),
            (DISABLE, "yes"),
            (SOCKET_ADDR, "10.0.0.2"),
        ]))
        .unwrap();
        assert_eq!(c.fusion_threshold, 25217728);
        assert_eq!(c.source(Setting::FusionThreshold), Some(FUSION_THRESHOLD));
        assert_eq!(c.num_streams, 3);
        assert_eq!(c.timeout, Duration::from_millis(2500));
        assert!(!c.enabled);
        assert_eq!(c.socket_addr, Some("10.0.0.2".parse().unwrap()));
    }

    #[test]
    fn bad_values_name_the_variable() {
        for (var, value) in [
            (NUM_STREAMS, "abc"),
            (NUM_STREAMS, "0"),
            (NUM_STREAMS, "1000"),
            (FUSION_THRESHOLD, "-5"),
            (FUSION_THRESHOLD, "0"),
            (TIMEOUT, "soon"),
            (TIMEOUT, "-1"),
            (DISABLE, "maybe"),
            (SOCKET_ADDR, "eth0"),
        ] {
            let err = CommConfig::from_lookup(env(&[(var, value)])).unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains(var), "{msg}");
            assert!(msg.contains(value), "{msg}");
        }
    }

    #[test]
    fn the_algorithm_is_auto_unless_a_variable_forces_it() {
        let algo = |pairs: &[(&str, &str)]| CommConfig::from_lookup(env(pairs)).unwrap();
        assert_eq!(algo(&[]).algorithm, AlgorithmChoice::Auto);
        assert_eq!(algo(&[(TWO_D, "1")]).algorithm, AlgorithmChoice::TwoD);
        assert_eq!(algo(&[(TWO_D, "0")]).algorithm, AlgorithmChoice::Flat);
        assert_eq!(
            algo(&[(PERSEUS_MODE, "1")]).algorithm,
            AlgorithmChoice::TwoD
        );
        // Our name wins over the aliases.
        let c = algo(&[(PERSEUS_MODE, "1"), (ALGORITHM, "flat")]);
        assert_eq!(c.algorithm, AlgorithmChoice::Flat);
        assert_eq!(c.source(Setting::Algorithm), Some(ALGORITHM));
        for (var, value) in [(ALGORITHM, "fastest"), (PERSEUS_MODE, "2")] {
            let msg = CommConfig::from_lookup(env(&[(var, value)]))
                .unwrap_err()
                .to_string();
            assert!(msg.contains(var) && msg.contains(value), "{msg}");
        }
        // Auto connects the 2D groups for measuring engines on whole nodes
        // of several ranks, across nodes only.
        let auto = algo(&[]);
        assert!(auto.two_d_groups(8, Some(4)));
        assert!(!auto.two_d_groups(4, Some(4)));
        assert!(!auto.two_d_groups(8, Some(1)));
        assert!(!auto.two_d_groups(8, None));
        assert!(!auto.two_d_groups(6, Some(4)));
        assert!(algo(&[(TWO_D, "1")]).two_d_groups(4, Some(4)));
    }

    #[test]
    fn compression_and_nan_check_with_aiacc_aliases() {
        let c = CommConfig::from_lookup(env(&[
            (COMPRESSION, "bf16"),
            (COMPRESSION_SCOPE, "inter"),
            (COMPRESSION_SCALE, "8"),
            (NAN_CHECK, "1"),
        ]))
        .unwrap();
        assert_eq!(c.compression, Compression::Bf16);
        assert!(c.compression_inter_only && c.nan_check);
        assert_eq!(c.compression_scale, 8.0);

        let c = CommConfig::from_lookup(env(&[
            (PERSEUS_DTYPE, "2"),
            (PERSEUS_SCALE, "5"),
            ("PERSEUS_ALLREDUCE_NANHECK", "1"),
        ]))
        .unwrap();
        assert_eq!(c.compression, Compression::Fp16);
        assert!(c.compression_inter_only && c.nan_check);
        assert_eq!(c.compression_scale, 5.0);

        // Our own names win over the aliases.
        let c =
            CommConfig::from_lookup(env(&[(PERSEUS_DTYPE, "0"), (COMPRESSION, "none")])).unwrap();
        assert_eq!(c.compression, Compression::None);

        let c = CommConfig::from_lookup(env(&[
            (TWO_D, "1"),
            (INTRA_SIZE, "4"),
            (HIERARCHICAL_THRESHOLD, "2097152"),
        ]))
        .unwrap();
        assert_eq!(c.algorithm, AlgorithmChoice::TwoD);
        assert_eq!((c.intra_size, c.hierarchical_threshold), (Some(4), 2097152));

        let c = CommConfig::from_lookup(env(&[
            (TOPK, "1"),
            (TOPK_RATIO, "0.05"),
            (TOPK_THRESHOLD, "0"),
            (TOPK_FP16, "1"),
        ]))
        .unwrap();
        assert!(c.topk && c.topk_fp16);
        assert_eq!((c.topk_ratio, c.topk_threshold), (0.05, 0));

        for (var, value) in [
            (TOPK_RATIO, "0"),
            (TOPK_RATIO, "1.5"),
            (TOPK_THRESHOLD, "-1"),
            (TOPK_FP16, "2"),
            (TWO_D, "yes please"),
            (INTRA_SIZE, "0"),
            (HIERARCHICAL_THRESHOLD, "big"),
            (COMPRESSION, "int8"),
            (COMPRESSION_SCOPE, "intra"),
            (COMPRESSION_SCALE, "0"),
            (PERSEUS_DTYPE, "3"),
            (NAN_CHECK, "sometimes"),
            (SHM, "maybe"),
        ] {
            let err = CommConfig::from_lookup(env(&[(var, value)])).unwrap_err();
            assert!(err.to_string().contains(var), "{err}");
        }
    }

    #[test]
    fn collectives_default_to_tiacc_and_name_the_variable_on_bad_values() {
        let choice =
            |pairs: &[(&str, &str)]| CommConfig::from_lookup(env(pairs)).map(|c| c.collectives);
        assert_eq!(choice(&[]).unwrap(), CollectivesChoice::Tiacc);
        assert_eq!(
            choice(&[(COLLECTIVES, " GLOO ")]).unwrap(),
            CollectivesChoice::Gloo
        );
        assert_eq!(
            choice(&[(COLLECTIVES, "Tiacc-Process-Group")]).unwrap(),
            CollectivesChoice::TiaccProcessGroup
        );
        assert_eq!(
            choice(&[(COLLECTIVES, "tiacc")]).unwrap(),
            CollectivesChoice::Tiacc
        );
        let err = choice(&[(COLLECTIVES, "mpi")]).unwrap_err().to_string();
        assert!(err.contains(COLLECTIVES) && err.contains("mpi"), "{err}");
    }

    #[test]
    fn cuda_collectives_default_to_nccl_and_name_the_variable_on_bad_values() {
        let choice = |pairs: &[(&str, &str)]| {
            CommConfig::from_lookup(env(pairs)).map(|c| c.cuda_collectives)
        };
        assert_eq!(choice(&[]).unwrap(), CudaCollectivesChoice::Nccl);
        assert_eq!(
            choice(&[(CUDA_COLLECTIVES, " Tiacc ")]).unwrap(),
            CudaCollectivesChoice::Tiacc
        );
        assert_eq!(
            choice(&[(CUDA_COLLECTIVES, "nccl")]).unwrap(),
            CudaCollectivesChoice::Nccl
        );
        let err = choice(&[(CUDA_COLLECTIVES, "gloo")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(CUDA_COLLECTIVES) && err.contains("gloo"),
            "{err}"
        );
    }

    #[test]
    fn shared_memory_is_on_unless_turned_off() {
        let on =
            |pairs: &[(&str, &str)]| CommConfig::from_lookup(env(pairs)).unwrap().shared_memory;
        assert!(on(&[]));
        assert!(on(&[(SHM, "auto")]) && on(&[(SHM, "1")]));
        assert!(!on(&[(SHM, "0")]) && !on(&[(SHM, "off")]));
    }

    #[test]
    fn transport_and_nccl_library_are_read() {
        let c = CommConfig::from_lookup(env(&[])).unwrap();
        assert_eq!(c.transport, TransportChoice::Auto);
        assert_eq!(c.nccl_library, None);
        for (value, expected) in [
            ("auto", TransportChoice::Auto),
            ("NCCL", TransportChoice::Nccl),
            (" tcp ", TransportChoice::Tcp),
        ] {
            let c = CommConfig::from_lookup(env(&[(TRANSPORT, value)])).unwrap();
            assert_eq!(c.transport, expected, "{value}");
            assert_eq!(
                TransportChoice::parse(TRANSPORT, value).unwrap().name(),
                expected.name()
            );
        }
        let c = CommConfig::from_lookup(env(&[(NCCL_LIBRARY, "/opt/nccl/libnccl.so.2")])).unwrap();
        assert_eq!(
            c.nccl_library.as_deref(),
            Some(std::path::Path::new("/opt/nccl/libnccl.so.2"))
        );
        // An empty value counts as unset, like every other variable.
        let c = CommConfig::from_lookup(env(&[(NCCL_LIBRARY, " ")])).unwrap();
        assert_eq!(c.nccl_library, None);
    }

    #[test]
    fn a_bad_transport_names_the_variable() {
        let err = CommConfig::from_lookup(env(&[(TRANSPORT, "infiniband")])).unwrap_err();
        match &err {
            Error::Config {
                variable, value, ..
            } => {
                assert_eq!(variable, TRANSPORT);
                assert_eq!(value, "infiniband");
            }
            other => panic!("expected a Config error, got {other:?}"),
        }
        assert!(err.to_string().contains("auto, nccl or tcp"), "{err}");
    }

    #[test]
    fn overrides_go_through_the_variables_parsers_and_name_the_argument() {
        let base =
            CommConfig::from_lookup(env(&[(COMPRESSION, "bf16"), (NUM_STREAMS, "3")])).unwrap();
        let c = base
            .with_overrides(&[
                ("compression", "FP16"),
                ("num_streams", "4"),
                ("enable", "0"),
                ("transport", " TCP "),
                ("timeout", "2.5"),
                ("nan_check", "true"),
                ("fusion_threshold", "1048576"),
            ])
            .unwrap();
        assert_eq!(c.compression, Compression::Fp16);
        assert_eq!((c.num_streams, c.enabled), (4, false));
        assert_eq!(c.transport, TransportChoice::Tcp);
        assert_eq!(c.timeout, Duration::from_millis(2500));
        assert!(c.nan_check);
        assert_eq!(c.fusion_threshold, 1 << 20);
        assert_eq!(c.source(Setting::Compression), Some("compression"));
        assert_eq!(base.source(Setting::Compression), Some(COMPRESSION));
        assert!(!c.same_settings(&base));
        assert!(base.same_settings(&base.with_overrides(&[("num_streams", "3")]).unwrap()));

        for (argument, value) in [
            ("num_streams", "0"),
            ("compression", "int8"),
            ("timeout", "-1"),
            ("fusion_threshold", "0"),
            ("transport", "udp"),
            ("enable", "perhaps"),
        ] {
            match base.with_overrides(&[(argument, value)]).unwrap_err() {
                Error::Config { variable, .. } => assert_eq!(variable, argument),
                other => panic!("{argument}: {other:?}"),
            }
        }
        let err = base.with_overrides(&[("streams", "2")]).unwrap_err();
        assert!(err.to_string().contains("num_streams"), "{err}");
    }

    #[test]
    fn shared_gpus_need_nccl_2_30_and_its_switch() {
        let c = CommConfig::from_lookup(env(&[(NCCL_MULTI_RANK_GPU, "1")])).unwrap();
        assert!(c.nccl_multi_rank_gpu);
        for value in ["0", "no", ""] {
            let c = CommConfig::from_lookup(env(&[(NCCL_MULTI_RANK_GPU, value)])).unwrap();
            assert!(!c.nccl_multi_rank_gpu, "{value}");
        }
        assert!(nccl_allows_shared_gpu((2, 30, 7), true));
        assert!(!nccl_allows_shared_gpu((2, 28, 9), true));
        assert!(!nccl_allows_shared_gpu((2, 30, 7), false));
        assert!(spans_nodes(4, Some(2)) && spans_nodes(4, None) && !spans_nodes(4, Some(4)));
        let err = CommConfig::default().intra_size_for(None).unwrap_err();
        assert!(err.to_string().contains(INTRA_SIZE), "{err}");
        assert_eq!(CommConfig::default().intra_size_for(Some(8)).unwrap(), 8);
    }

    #[test]
    fn launchers_are_detected() {
        let t = launch_env_from(env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (t.launcher, t.rank, t.world_size, t.local_rank),
            ("torchrun", 3, 4, 1)
        );
        assert_eq!(t.master_port, Some(29500));

        let m = launch_env_from(env(&[
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "16"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "5"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "8"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (m.launcher, m.rank, m.world_size, m.local_rank),
            ("mpirun", 5, 16, 5)
        );
        assert_eq!(m.local_size, Some(8));
        assert_eq!(m.master_addr, None);

        let s = launch_env_from(env(&[
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_TASKS_PER_NODE", "4(x2)"),
            ("SLURM_LAUNCH_NODE_IPADDR", "10.1.1.1"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((s.launcher, s.rank, s.local_size), ("slurm", 2, Some(4)));
        assert_eq!(s.master_addr.as_deref(), Some("10.1.1.1"));

        let h = launch_env_from(env(&[
            ("HOROVOD_RANK", "2"),
            ("HOROVOD_SIZE", "3"),
            ("HOROVOD_LOCAL_RANK", "0"),
            ("HOROVOD_LOCAL_SIZE", "1"),
            ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "10.2.2.2"),
            ("HOROVOD_GLOO_RENDEZVOUS_PORT", "4000"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((h.launcher, h.rank, h.world_size), ("horovodrun", 2, 3));
        assert_eq!(
            (h.master_addr.as_deref(), h.master_port),
            (Some("10.2.2.2"), Some(4000))
        );
        let p = launch_env_from(env(&[("PMIX_RANK", "3"), ("PMI_SIZE", "4")]))
            .unwrap()
            .unwrap();
        assert_eq!(
            (p.launcher, p.rank, p.local_rank, p.local_size),
            ("pmix", 3, 0, None)
        );
        // Open MPI sets PMIx's variables too: its own win.
        let m = launch_env_from(env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("PMIX_RANK", "1"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(m.launcher, "mpirun");

        assert_eq!(launch_env_from(env(&[])).unwrap(), None);
    }

    #[test]
    fn bad_launcher_values_are_errors() {
        let err = launch_env_from(env(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(err.to_string().contains("RANK"));
        let err = launch_env_from(env(&[("RANK", "2"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(err.to_string().contains("RANK"));
        let err = launch_env_from(env(&[("MASTER_PORT", "99999")])).unwrap_err();
        assert!(err.to_string().contains("MASTER_PORT"));
        let err = launch_env_from(env(&[("PMI_RANK", "1")])).unwrap_err();
        assert!(err.to_string().contains("PMI_SIZE") && err.to_string().contains("PMI_RANK=1"));
        let err =
            launch_env_from(env(&[("HOROVOD_RANK", "4"), ("HOROVOD_SIZE", "4")])).unwrap_err();
        assert!(err.to_string().contains("HOROVOD_RANK"), "{err}");
    }

    #[test]
    fn the_slow_rank_check_is_off_by_default_and_has_aiacc_s_name() {
        let c = CommConfig::from_lookup(env(&[])).unwrap();
        assert_eq!(c.perf_check_n_steps, 0);
        let c = CommConfig::from_lookup(env(&[(PERSEUS_PERF_CHECK_N_STEPS, "50")])).unwrap();
        assert_eq!(c.perf_check_n_steps, 50);
        let c = CommConfig::from_lookup(env(&[
            (PERSEUS_PERF_CHECK_N_STEPS, "50"),
            (PERF_CHECK_N_STEPS, "20"),
        ]))
        .unwrap();
        assert_eq!(c.perf_check_n_steps, 20);
        assert_eq!(c.source(Setting::PerfCheckNSteps), Some(PERF_CHECK_N_STEPS));
        for var in [PERF_CHECK_N_STEPS, PERSEUS_PERF_CHECK_N_STEPS] {
            let err = CommConfig::from_lookup(env(&[(var, "often")])).unwrap_err();
            assert!(err.to_string().contains(var), "{err}");
        }
    }

    #[test]
    fn ranks_with_different_shared_settings_are_a_config_error_naming_both_values() {
        let fp = |pairs: &[(&str, &str)]| {
            CommConfig::from_lookup(env(pairs))
                .unwrap()
                .shared_fingerprint()
        };
        let same = vec![fp(&[]), fp(&[(TIMEOUT, "5")]), fp(&[])];
        check_same_on_every_rank(1, &same).unwrap();
        let streams = vec![fp(&[]), fp(&[(NUM_STREAMS, "3")]), fp(&[])];
        for rank in 0..3 {
            let err = check_same_on_every_rank(rank, &streams).unwrap_err();
            let Error::Config { variable, .. } = &err else {
                panic!("{err:?}")
            };
            assert_eq!(variable, NUM_STREAMS);
            let text = err.to_string();
            assert!(
                text.contains("ranks 0, 2 have 2 (the default) and rank 1 has 3 (set by TIACC_TRAINING_NUM_NCCL_STREAMS)"),
                "{text}"
            );
        }
        // An alias on one rank and our name on another, same value: fine.
        let alias = vec![fp(&[(PERSEUS_DTYPE, "1")]), fp(&[(COMPRESSION, "none")])];
        check_same_on_every_rank(0, &alias).unwrap();
        let compression = vec![fp(&[(COMPRESSION, "fp16")]), fp(&[(PERSEUS_DTYPE, "1")])];
        let text = check_same_on_every_rank(0, &compression)
            .unwrap_err()
            .to_string();
        assert!(
            text.starts_with("TIACC_TRAINING_COMPRESSION=\"fp16\""),
            "{text}"
        );
        assert!(
            text.contains("rank 1 has none (set by PERSEUS_ALLREDUCE_DTYPE)"),
            "{text}"
        );
        let algo = vec![fp(&[(ALGORITHM, "2d")]), fp(&[(ALGORITHM, "flat")])];
        let text = check_same_on_every_rank(1, &algo).unwrap_err().to_string();
        assert!(
            text.contains("rank 0 has 2d") && text.contains("rank 1 has flat"),
            "{text}"
        );
    }

    #[test]
    fn top_k_momentum_correction_settings() {
        let c = CommConfig::from_lookup(env(&[])).unwrap();
        assert_eq!(c.topk_momentum, 0.0);
        assert!(!c.topk_momentum_masking);
        assert_eq!((c.topk_warmup_steps, c.topk_clip_norm), (0, None));
        let c = CommConfig::from_lookup(env(&[
            (TOPK_MOMENTUM, "0.9"),
            (TOPK_MOMENTUM_MASKING, "1"),
            (TOPK_WARMUP_STEPS, "200"),
            (TOPK_CLIP_NORM, "2.5"),
        ]))
        .unwrap();
        assert_eq!(c.topk_momentum, 0.9);
        assert!(c.topk_momentum_masking);
        assert_eq!((c.topk_warmup_steps, c.topk_clip_norm), (200, Some(2.5)));
        assert_eq!(c.source(Setting::TopKMomentum), Some(TOPK_MOMENTUM));
        for (var, value) in [
            (TOPK_MOMENTUM, "1"),
            (TOPK_MOMENTUM, "-0.1"),
            (TOPK_MOMENTUM, "high"),
            (TOPK_MOMENTUM_MASKING, "2"),
            (TOPK_WARMUP_STEPS, "-3"),
            (TOPK_WARMUP_STEPS, "1.5"),
            (TOPK_CLIP_NORM, "0"),
            (TOPK_CLIP_NORM, "inf"),
        ] {
            let err = CommConfig::from_lookup(env(&[(var, value)])).unwrap_err();
            assert!(err.to_string().contains(var), "{err}");
        }
        let o = c
            .with_overrides(&[
                ("topk_momentum", "0.95"),
                ("topk_momentum_masking", "0"),
                ("topk_warmup_steps", "10"),
                ("topk_clip_norm", "1"),
            ])
            .unwrap();
        assert_eq!((o.topk_momentum, o.topk_warmup_steps), (0.95, 10));
        assert_eq!(
            (o.topk_momentum_masking, o.topk_clip_norm),
            (false, Some(1.0))
        );
        assert_eq!(o.source(Setting::TopKClipNorm), Some("topk_clip_norm"));
        match c.with_overrides(&[("topk_momentum", "1.5")]).unwrap_err() {
            Error::Config { variable, .. } => assert_eq!(variable, "topk_momentum"),
            other => panic!("{other:?}"),
        }
    }
}
