//! The start-up report: which transport each kind of gradient bucket takes
//! and exactly what applies to it, and a warning for every setting that
//! cannot apply (never silently ignored).

use super::choices::Compression;
use super::{spans_nodes, AlgorithmChoice, CommConfig, Setting, TransportChoice};
use super::{
    COMPRESSION, COMPRESSION_SCALE, COMPRESSION_SCOPE, HIERARCHICAL_THRESHOLD, INTRA_SIZE,
    NCCL_LIBRARY, TOPK, TOPK_FP16, TOPK_MOMENTUM, TOPK_MOMENTUM_MASKING, TOPK_OPTIONS, TWO_D,
};

/// What the job looks like when the report is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    pub world: usize,
    /// `torchrun`, `mpirun`, `slurm`, `none` or `user` (group made by the script).
    pub launcher: String,
    /// Ranks per node, when the launcher said.
    pub local_size: Option<usize>,
    /// Where CUDA buckets go; `None` when torch sees no CUDA device.
    pub cuda: Option<CudaRoute>,
}

/// The transport CUDA buckets take, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaRoute {
    /// `Nccl`, or `Tcp` (host staging).
    pub transport: TransportChoice,
    /// The NCCL version loaded, when one is.
    pub nccl_version: Option<(u32, u32, u32)>,
    /// Why this transport, when it is not what was asked for.
    pub reason: Option<String>,
}

/// A setting that has no effect in this job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    /// The variable or argument that set it.
    pub variable: String,
    pub message: String,
}

/// The report: lines to log on rank 0, and warnings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Startup {
    pub lines: Vec<String>,
    pub warnings: Vec<Warning>,
}

impl CommConfig {
    /// The start-up report for `job`. Its warnings start with what
    /// reading the environment noticed ([`CommConfig::notices`]).
    pub fn startup(&self, job: &Job) -> Startup {
        if !self.enabled {
            return Startup {
                lines: vec![format!(
                    "tiacc engine disabled: DDP communicates natively (fusion_threshold={})",
                    self.fusion_text()
                )],
                warnings: self.notices.clone(),
            };
        }
        let accumulate = match self.accumulate_n_steps {
            1 => String::new(),
            n => format!(" accumulate_n_steps={n} (one communication every {n} backward passes)"),
        };
        let mut lines = vec![format!(
            "DDP communication through the tiacc engine: world_size={} launcher={} channels={} \
             fusion_threshold={} timeout={}s{accumulate}",
            job.world,
            job.launcher,
            self.num_streams,
            self.fusion_text(),
            self.timeout.as_secs_f64()
        )];
        lines.push(format!(
            "  CPU buckets: {}; {}",
            self.cpu_medium(job),
            self.applies(job)
        ));
        lines.push(match &job.cuda {
            None => "  CUDA buckets: none (torch sees no CUDA device)".to_string(),
            Some(route) => {
                let requested = self.transport.name();
                let transport = match (route.transport, route.nccl_version) {
                    (TransportChoice::Nccl, Some((a, b, c))) => format!("nccl {a}.{b}.{c}"),
                    (TransportChoice::Nccl, None) => "nccl".to_string(),
                    _ => "tcp with host staging".to_string(),
                };
                let reason = route
                    .reason
                    .as_ref()
                    .map_or(String::new(), |r| format!(": {r}"));
                let what = self.applies(job);
                format!("  CUDA buckets: {transport} (transport {requested}{reason}); {what}")
            }
        });
        let mut warnings = self.notices.clone();
        warnings.extend(self.warnings(job));
        Startup { lines, warnings }
    }

    /// What carries CPU buckets between the ranks of `job`: shared memory
    /// between the ranks of a host (unless `TIACC_TRAINING_SHM=0`), TCP
    /// between hosts. The engine logs what it connected when it does.
    fn cpu_medium(&self, job: &Job) -> &'static str {
        match job.local_size {
            _ if job.world <= 1 => "in process (a world of one)",
            _ if !self.shared_memory => "tcp (TIACC_TRAINING_SHM=0)",
            Some(n) if n >= job.world => "shared memory (one host)",
            Some(1) => "tcp (one rank per host)",
            _ => "shared memory between the ranks of a host, tcp between hosts",
        }
    }

    /// The bucket cap as the report gives it: what a DDP model built
    /// without `bucket_cap_mb` gets (each model's own is logged when it is
    /// built).
    fn fusion_text(&self) -> String {
        match self.fusion_fraction {
            Some(f) => format!(
                "1/{f} of each model's gradient bytes (from {}; for DDP models built without \
                 bucket_cap_mb)",
                self.source(Setting::FusionThreshold).unwrap_or("")
            ),
            None => format!(
                "{} bytes (bucket_cap_mb={:.2} for DDP models built without one)",
                self.fusion_threshold,
                self.fusion_threshold as f64 / (1024.0 * 1024.0)
            ),
        }
    }

    /// The algorithm, compression, Top-K and NaN check, as they apply.
    fn applies(&self, job: &Job) -> String {
        let per_node = match (self.intra_size, job.local_size) {
            (Some(n), _) => format!("{n} ranks per node from {INTRA_SIZE}"),
            (None, Some(n)) => format!("{n} ranks per node from the launcher"),
            (None, None) => "ranks per node unknown".to_string(),
        };
        let algorithm = match self.algorithm {
            AlgorithmChoice::TwoD => format!(
                "2d ({per_node}; buckets <= {} bytes, larger ones flat)",
                self.hierarchical_threshold
            ),
            AlgorithmChoice::Flat => "flat ring".to_string(),
            AlgorithmChoice::Auto if self.two_d_groups(job.world, job.local_size) => {
                format!("auto (flat or 2d, measured when the engine connects; {per_node})")
            }
            AlgorithmChoice::Auto => {
                format!(
                    "flat ring (auto: no whole nodes of several ranks to go 2d over; {per_node})"
                )
            }
        };
        let compression = match (self.compression, self.compression_inter_only) {
            (Compression::None, _) => "none".to_string(),
            (c, false) => c.name().to_string(),
            (c, true) => format!("{} between nodes only", c.name()),
        };
        let scale = if self.compression != Compression::None && self.compression_scale != 1.0 {
            format!(" (scale {})", self.compression_scale)
        } else {
            String::new()
        };
        let topk = if self.topk {
            format!(
                "{} of float32 buckets >= {} bytes, {} values, error feedback{}",
                self.topk_ratio,
                self.topk_threshold,
                if self.topk_fp16 { "float16" } else { "float32" },
                self.topk_dgc()
            )
        } else {
            "off".to_string()
        };
        let nan = if self.nan_check { "on" } else { "off" };
        let reduce_scatter = match (self.reduce_scatter_compression, self.compression_inter_only) {
            (Compression::None, _) => String::new(),
            (c, false) => format!(" reduce_scatter_compression={}", c.name()),
            (c, true) => format!(
                " reduce_scatter_compression={} between nodes only",
                c.name()
            ),
        };
        format!(
            "algorithm={algorithm} compression={compression}{scale} top-k={topk} \
             nan_check={nan}{reduce_scatter}"
        )
    }

    /// Top-K's momentum correction, warm-up and clipping, as they apply.
    fn topk_dgc(&self) -> String {
        let mut out = String::new();
        if self.topk_momentum != 0.0 {
            out += &format!(
                ", momentum correction for an optimiser with momentum {} (DGC{})",
                self.topk_momentum,
                if self.topk_momentum_masking {
                    ", momentum factor masking"
                } else {
                    ""
                }
            );
        }
        if self.topk_warmup_steps > 0 {
            out += &format!(", warm-up over {} steps", self.topk_warmup_steps);
        }
        if let Some(norm) = self.topk_clip_norm {
            out += &format!(", local clipping to norm {norm}");
        }
        out
    }

    fn warnings(&self, job: &Job) -> Vec<Warning> {
        let mut out = Vec::new();
        let mut warn = |setting: Setting, fallback: &str, message: String| {
            out.push(Warning {
                variable: self.source(setting).unwrap_or(fallback).to_string(),
                message,
            });
        };
        let compressing = self.compression != Compression::None;
        if self.algorithm == AlgorithmChoice::Flat {
            for (setting, name) in [
                (Setting::IntraSize, INTRA_SIZE),
                (Setting::HierarchicalThreshold, HIERARCHICAL_THRESHOLD),
            ] {
                if self.source(setting).is_some() {
                    let by = self.source(Setting::Algorithm).unwrap_or(TWO_D);
                    warn(
                        setting,
                        name,
                        format!("has no effect: {by} makes the allreduce flat"),
                    );
                }
            }
        }
        if !self.topk {
            for &(setting, name) in TOPK_OPTIONS {
                if self.source(setting).is_some() {
                    warn(setting, name, format!("has no effect without {TOPK}=1"));
                }
            }
        }
        if self.topk && self.topk_momentum == 0.0 {
            let setting = Setting::TopKMomentumMasking;
            if self.source(setting).is_some() {
                let message = format!("has no effect while {TOPK_MOMENTUM} is 0");
                warn(setting, TOPK_MOMENTUM_MASKING, message);
            }
        }
        if !compressing {
            for (setting, name) in [
                (Setting::CompressionScale, COMPRESSION_SCALE),
                (Setting::CompressionScope, COMPRESSION_SCOPE),
            ] {
                if self.source(setting).is_some() {
                    warn(
                        setting,
                        name,
                        format!("has no effect while {COMPRESSION} is none"),
                    );
                }
            }
        }
        if job.world == 1 {
            for (on, setting, name) in [
                (compressing, Setting::Compression, COMPRESSION),
                (
                    self.algorithm == AlgorithmChoice::TwoD,
                    Setting::Algorithm,
                    TWO_D,
                ),
                (self.topk, Setting::TopK, TOPK),
            ] {
                if on {
                    warn(
                        setting,
                        name,
                        "has no effect in a world of one rank: no gradient leaves this process"
                            .to_string(),
                    );
                }
            }
            return out;
        }
        if self.topk && compressing && !self.compression_inter_only {
            let by = self.source(Setting::Compression).unwrap_or(COMPRESSION);
            let wire = self.compression.name();
            warn(
                Setting::TopK,
                TOPK,
                format!(
                    "has no effect: {by} casts float32 buckets to {wire} before the reduction, \
                     and Top-K sparsifies float32 buckets only; for half-precision Top-K values \
                     set {TOPK_FP16}=1 and leave {by} at none"
                ),
            );
        }
        let one_node = !spans_nodes(job.world, job.local_size);
        if self.algorithm == AlgorithmChoice::TwoD && one_node && self.intra_size.is_none() {
            warn(
                Setting::Algorithm,
                TWO_D,
                format!(
                    "the job runs on one node ({} ranks per node): the 2D allreduce has no \
                     inter-node step and moves the same bytes as the flat ring",
                    job.world
                ),
            );
        }
        if compressing
            && self.compression_inter_only
            && self.algorithm != AlgorithmChoice::TwoD
            && one_node
        {
            warn(
                Setting::CompressionScope,
                COMPRESSION_SCOPE,
                "compresses traffic between nodes only, and the job runs on one node: nothing \
                 is compressed"
                    .to_string(),
            );
        }
        let nccl_used = job
            .cuda
            .as_ref()
            .is_some_and(|r| r.transport == TransportChoice::Nccl);
        if self.nccl_library.is_some() && !nccl_used {
            warn(
                Setting::NcclLibrary,
                NCCL_LIBRARY,
                "is not used: no gradient goes over NCCL in this job".to_string(),
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::{ALGORITHM, TOPK_CLIP_NORM, TOPK_RATIO, TOPK_WARMUP_STEPS};
    use super::*;
    use std::collections::HashMap;
    use std::ffi::OsString;

    fn config(pairs: &[(&str, &str)]) -> CommConfig {
        let map: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        CommConfig::from_lookup(move |name| map.get(name).cloned()).unwrap()
    }

    fn job(world: usize, local_size: Option<usize>, cuda: Option<CudaRoute>) -> Job {
        Job {
            world,
            launcher: "torchrun".into(),
            local_size,
            cuda,
        }
    }

    fn nccl() -> Option<CudaRoute> {
        Some(CudaRoute {
            transport: TransportChoice::Nccl,
            nccl_version: Some((2, 30, 7)),
            reason: None,
        })
    }

    #[test]
    fn auto_is_measured_across_nodes_on_tcp_and_on_nccl_alike() {
        let s = config(&[]).startup(&job(8, Some(4), nccl()));
        for line in &s.lines[1..3] {
            assert!(
                line.contains("algorithm=auto (flat or 2d, measured when the engine connects"),
                "{line}"
            );
        }
        let one_node = config(&[]).startup(&job(4, Some(4), None));
        assert!(one_node.lines[1].contains("algorithm=flat ring (auto: no whole nodes"));
        assert!(one_node.warnings.is_empty(), "{:?}", one_node.warnings);
        let forced = config(&[(ALGORITHM, "flat"), (INTRA_SIZE, "2")]).startup(&job(4, None, None));
        assert!(forced.lines[1].contains("algorithm=flat ring compression"));
        let warned: Vec<&str> = forced
            .warnings
            .iter()
            .map(|w| w.variable.as_str())
            .collect();
        assert_eq!(warned, vec![INTRA_SIZE]);
        assert!(forced.warnings[0]
            .message
            .contains("TIACC_TRAINING_ALGORITHM makes the allreduce flat"));
    }

    #[test]
    fn each_kind_of_bucket_gets_a_line_saying_what_applies() {
        let c = config(&[
            (TWO_D, "1"),
            ("TIACC_TRAINING_COMPRESSION", "fp16"),
            (COMPRESSION_SCOPE, "inter"),
            ("TIACC_TRAINING_NAN_CHECK", "1"),
        ]);
        let s = c.startup(&job(4, Some(2), nccl()));
        assert!(s.lines[0].contains("world_size=4 launcher=torchrun channels=2"));
        for line in &s.lines[1..] {
            assert!(
                line.contains("algorithm=2d (2 ranks per node from the launcher"),
                "{line}"
            );
            assert!(
                line.contains("compression=fp16 between nodes only"),
                "{line}"
            );
            assert!(line.contains("nan_check=on"), "{line}");
        }
        assert!(s.lines[1].starts_with(
            "  CPU buckets: shared memory between the ranks of a host, tcp between hosts;"
        ));
        assert!(s.lines[2].starts_with("  CUDA buckets: nccl 2.30.7 (transport auto);"));
        let t = config(&[]).startup(&job(2, Some(2), None));
        assert!(t.lines[1].starts_with("  CPU buckets: shared memory (one host);"));
        let t = config(&[("TIACC_TRAINING_SHM", "0")]).startup(&job(2, Some(2), None));
        assert!(t.lines[1].starts_with("  CPU buckets: tcp (TIACC_TRAINING_SHM=0);"));
        let t = config(&[]).startup(&job(4, Some(1), None));
        assert!(t.lines[1].starts_with("  CPU buckets: tcp (one rank per host);"));
        let t = config(&[]).startup(&job(1, None, None));
        assert!(t.lines[1].starts_with("  CPU buckets: in process (a world of one);"));
        assert!(s.warnings.is_empty(), "{:?}", s.warnings);

        let staged = CudaRoute {
            transport: TransportChoice::Tcp,
            nccl_version: None,
            reason: Some("ranks 0, 1 share a GPU".into()),
        };
        let s = config(&[]).startup(&job(2, Some(2), Some(staged)));
        assert!(s.lines[2].contains("tcp with host staging (transport auto: ranks 0, 1 share"));
        let s = config(&[]).startup(&job(2, Some(2), None));
        assert!(s.lines[2].contains("CUDA buckets: none"));
    }

    #[test]
    fn settings_that_cannot_apply_are_warnings_naming_the_variable() {
        let names = |s: &Startup| -> Vec<String> {
            s.warnings.iter().map(|w| w.variable.clone()).collect()
        };
        let c = config(&[
            (TWO_D, "0"),
            (INTRA_SIZE, "2"),
            (TOPK_RATIO, "0.1"),
            (COMPRESSION_SCALE, "4"),
            (NCCL_LIBRARY, "/x/libnccl.so.2"),
        ]);
        let s = c.startup(&job(4, Some(2), None));
        assert_eq!(
            names(&s),
            vec![INTRA_SIZE, TOPK_RATIO, COMPRESSION_SCALE, NCCL_LIBRARY]
        );

        let s = config(&[(TOPK, "1"), ("PERSEUS_ALLREDUCE_DTYPE", "0")]).startup(&job(
            4,
            Some(2),
            None,
        ));
        assert_eq!(names(&s), vec![TOPK]);
        assert!(
            s.warnings[0].message.contains("PERSEUS") || s.warnings[0].message.contains("fp16")
        );

        let s = config(&[(TWO_D, "1"), (COMPRESSION, "bf16")]).startup(&job(1, None, None));
        assert_eq!(names(&s), vec![COMPRESSION, TWO_D]);

        let s = config(&[(TWO_D, "1")]).startup(&job(4, Some(4), nccl()));
        assert_eq!(names(&s), vec![TWO_D]);
        let s = config(&[(COMPRESSION, "fp16"), (COMPRESSION_SCOPE, "inter")]).startup(&job(
            4,
            Some(4),
            nccl(),
        ));
        assert_eq!(names(&s), vec![COMPRESSION_SCOPE]);

        // An argument is named as such.
        let c = config(&[(TOPK, "1")])
            .with_overrides(&[("compression", "bf16")])
            .unwrap();
        let s = c.startup(&job(4, Some(2), None));
        assert_eq!(names(&s), vec![TOPK]);
        assert!(s.warnings[0].message.contains("compression"));
    }

    #[test]
    fn a_disabled_engine_says_so() {
        let s = config(&[("TIACC_TRAINING_DISABLE", "1")]).startup(&job(2, None, None));
        assert_eq!(s.lines.len(), 1);
        assert!(s.lines[0].starts_with("tiacc engine disabled"));
    }

    #[test]
    fn top_k_momentum_correction_is_reported_and_warned_about_without_top_k() {
        let c = config(&[
            (TOPK, "1"),
            (TOPK_MOMENTUM, "0.9"),
            (TOPK_WARMUP_STEPS, "100"),
            (TOPK_CLIP_NORM, "2"),
        ]);
        let s = c.startup(&job(4, Some(4), None));
        assert!(s.warnings.is_empty(), "{:?}", s.warnings);
        assert!(
            s.lines[1].contains(
                "error feedback, momentum correction for an optimiser with momentum 0.9 (DGC), \
                 warm-up over 100 steps, local clipping to norm 2"
            ),
            "{}",
            s.lines[1]
        );
        let s =
            config(&[(TOPK_MOMENTUM, "0.9"), (TOPK_CLIP_NORM, "2")]).startup(&job(4, None, None));
        let names: Vec<&str> = s.warnings.iter().map(|w| w.variable.as_str()).collect();
        assert_eq!(names, vec![TOPK_MOMENTUM, TOPK_CLIP_NORM]);
        assert!(s.warnings[0]
            .message
            .contains("without LIGHT_TOPK_ALLREDUCE=1"));
        let s = config(&[(TOPK, "1"), (TOPK_MOMENTUM_MASKING, "1")]).startup(&job(4, None, None));
        assert_eq!(s.warnings.len(), 1);
        assert_eq!(s.warnings[0].variable, TOPK_MOMENTUM_MASKING);
        let c = config(&[
            (TOPK, "1"),
            (TOPK_MOMENTUM, "0.9"),
            (TOPK_MOMENTUM_MASKING, "1"),
        ]);
        let s = c.startup(&job(4, None, None));
        assert!(
            s.lines[1].contains("(DGC, momentum factor masking)"),
            "{}",
            s.lines[1]
        );
    }
}
