//! The settings that are one of a few names, each parsed from its
//! variable's value (any case) and named back as parsed.

use super::parse::bad;
use crate::error::{Error, Result};

/// What serves torch.distributed's CPU collectives
/// ([`COLLECTIVES`](super::COLLECTIVES)).
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

/// What serves torch.distributed's CUDA collectives
/// ([`CUDA_COLLECTIVES`](super::CUDA_COLLECTIVES)).
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

/// Which transport carries gradients ([`TRANSPORT`](super::TRANSPORT)).
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

/// Which allreduce algorithm runs ([`ALGORITHM`](super::ALGORITHM)).
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

/// What a bucket is cast to on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Fp16,
    Bf16,
}

impl Compression {
    /// Parses `none`, `fp16`/`float16`, `bf16`/`bfloat16`.
    pub fn parse(variable: &str, value: &str) -> Result<Self> {
        match value.trim().to_ascii_lowercase().as_str() {
            "none" | "" | "fp32" | "off" => Ok(Compression::None),
            "fp16" | "float16" | "half" => Ok(Compression::Fp16),
            "bf16" | "bfloat16" => Ok(Compression::Bf16),
            _ => Err(Error::Config {
                variable: variable.to_string(),
                value: value.to_string(),
                expected: "one of none, fp16, bf16".to_string(),
            }),
        }
    }

    /// Lower-case name for logs.
    pub fn name(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Fp16 => "fp16",
            Compression::Bf16 => "bf16",
        }
    }
}
