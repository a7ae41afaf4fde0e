//! The settings every rank must share: each rank's fingerprint of them,
//! and the check that compares the ranks' fingerprints at start-up.

use super::variables::*;
use super::{CommConfig, Setting};
use crate::error::{Error, Result};

/// The settings every rank must share, by our variable name: the ones that
/// change what a rank sends, how it takes part in a collective, or which
/// store exchanges it joins, in the fingerprint's order: these, then
/// [`TOPK_OPTIONS`], then [`SHARED_LAST`]. (Per-rank settings such as the
/// listen address, the NCCL library path or the timeout may differ.)
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
];

/// The settings every rank must share that come after Top-K's own
/// ([`TOPK_OPTIONS`]) in the fingerprint.
const SHARED_LAST: &[(Setting, &str)] = &[
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
        [SHARED, TOPK_OPTIONS, SHARED_LAST]
            .concat()
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

#[cfg(test)]
mod tests {
    use super::super::tests::env;
    use super::*;

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
}
