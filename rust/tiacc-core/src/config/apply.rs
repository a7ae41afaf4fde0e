//! What each variable sets: its value, parsed, applied to a
//! [`CommConfig`], and the setting recorded as set by it.

use super::choices::Compression;
use super::parse::{bad, parse_bool, parse_num_streams, parse_positive_u64, parse_seconds};
use super::variables::*;
use super::{
    AlgorithmChoice, CollectivesChoice, CommConfig, CudaCollectivesChoice, Setting, TransportChoice,
};
use crate::error::{Error, Result};

impl CommConfig {
    /// Parses `value` with `variable`'s parser into this configuration;
    /// errors name `label` (the variable, or the argument it came from).
    pub(super) fn apply(&mut self, variable: &str, label: &str, value: &str) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::super::tests::env;
    use super::*;

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
