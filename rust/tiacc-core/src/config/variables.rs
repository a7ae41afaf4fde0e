//! Every variable's name, with what it means, and the defaults: the
//! variables applied in order ([`VARIABLES`]), the arguments that override
//! them ([`ARGUMENTS`]), the interface variables and the names carried over
//! from AIACC and Horovod that mean nothing here ([`IGNORED`]).

use std::time::Duration;

use super::Setting;

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

/// Top-K's own settings (what [`TOPK`] turns on), with their variables: every
/// rank must share them, and they mean nothing while Top-K is off.
pub(crate) const TOPK_OPTIONS: &[(Setting, &str)] = &[
    (Setting::TopKRatio, TOPK_RATIO),
    (Setting::TopKThreshold, TOPK_THRESHOLD),
    (Setting::TopKFp16, TOPK_FP16),
    (Setting::TopKMomentum, TOPK_MOMENTUM),
    (Setting::TopKMomentumMasking, TOPK_MOMENTUM_MASKING),
    (Setting::TopKWarmupSteps, TOPK_WARMUP_STEPS),
    (Setting::TopKClipNorm, TOPK_CLIP_NORM),
];

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
/// Where each rank writes the engine's timeline, a Chrome trace of every
/// bucket's steps (`crate::comm::timeline`); unset: none is written.
pub const TIMELINE: &str = "TIACC_TRAINING_TIMELINE";
/// Prints the NCCL path's waits on stderr (`crate::comm::nccl::trace`).
pub const NCCL_TRACE: &str = "TIACC_TRAINING_NCCL_TRACE";
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

/// NCCL's own switch for several ranks on one GPU (NCCL 2.30 and later).
/// Read, never set: it decides whether ranks sharing a GPU may use NCCL.
pub const NCCL_MULTI_RANK_GPU: &str = "NCCL_MULTI_RANK_GPU_ENABLE";

/// The first NCCL release that runs several ranks on one GPU (with
/// [`NCCL_MULTI_RANK_GPU`] set); older ones fail with "Duplicate GPU detected".
pub const NCCL_MULTI_RANK_GPU_SINCE: (u32, u32, u32) = (2, 30, 0);

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

/// Variables read where they act rather than into the configuration: the
/// engine's timeline and the NCCL path's trace on stderr.
pub const DIAGNOSTIC_VARIABLES: [&str; 2] = [TIMELINE, NCCL_TRACE];

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
