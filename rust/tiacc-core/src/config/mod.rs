//! Every environment variable the engine reads: name, default, parser, doc.
//!
//! This is the only module that reads the environment. Precedence is
//! explicit Python argument > environment variable > default: the Python
//! shim passes its arguments to [`CommConfig::with_overrides`], which parses
//! them with the same parsers as the variables. A value that does not parse
//! is an error naming the variable (or argument), never a silent default.
//!
//! The parts: the variables' names and defaults (`variables.rs`), the
//! parsers of values (`parse.rs`), the settings that are one of a few names
//! (`choices.rs`), what each variable sets (`apply.rs`), the settings every
//! rank must share (`shared.rs`), launch detection (`launch.rs`), the scan
//! for unknown names (`scan.rs`), network interfaces (`iface.rs`) and the
//! start-up report (`startup.rs`).

use std::collections::BTreeMap;
use std::time::Duration;

use crate::error::{Error, Result};

mod apply;
mod choices;
mod iface;
mod launch;
mod parse;
mod scan;
mod shared;
pub mod startup;
mod variables;

pub use choices::{
    AlgorithmChoice, CollectivesChoice, Compression, CudaCollectivesChoice, TransportChoice,
};
pub use iface::{outward_interface, system_interfaces, Interface};
pub use launch::{launch_env, launch_env_from, LaunchEnv, OTHER_LAUNCHERS};
use parse::read;
pub use parse::{parse_bool, parse_num_streams, parse_seconds};
pub use scan::{closest_known, edit_distance, known_names, SCAN_PREFIXES};
pub use shared::check_same_on_every_rank;
pub use variables::*;

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
    /// the names for the prefixes we own ([`SCAN_PREFIXES`]): each one we do
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::ffi::OsString;

    pub(super) fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
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
}
