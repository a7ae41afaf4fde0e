//! The engine's state across steps, as a checkpoint holds it.
//!
//! Under Top-K each channel keeps, per bucket: the error-feedback residual
//! (what was not sent yet), with the momentum correction the velocity `u`
//! and the last averaged sparse sum `S_{t-1}` ([`StateBuf`], in the
//! backend), and the count of the bucket's sparse allreduces, which the
//! warm-up's density reads ([`SparseState`], in the [`super::Algorithm`]).
//! Nothing else an engine keeps changes what a later step computes: the
//! per-channel sequence numbers only tag collectives (a fresh engine starts
//! them at 0 on every rank alike), the counters and step times are
//! statistics.
//!
//! [`EngineState`] is that state for one engine, keyed by bucket index, so
//! it is independent of the channel count: an engine importing it puts each
//! bucket's state on the channel that bucket runs on
//! ([`super::engine::channel_of`]). It names the rank and world size it was
//! saved on and the settings it depends on ([`settings_of`]); a state that
//! does not fit an engine is an [`Error::StateMismatch`] naming what
//! differs, and nothing is imported. Buffers are float32 in the machine's
//! byte order (little-endian on every platform the engine builds for).

use std::collections::{BTreeMap, HashMap};

use super::algo::AlgoSettings;
use super::sparse::{SparseState, StateBuf};
use crate::error::{Error, Result};

/// One bucket's state.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BucketState {
    /// Sparse allreduces of the bucket so far (Top-K's warm-up reads it).
    pub steps: u64,
    /// The error-feedback residual (float32 bytes), `None` when the bucket
    /// keeps no buffers (they were dropped when DDP rebuilt its buckets).
    pub residual: Option<Vec<u8>>,
    /// The momentum correction's velocity, with the correction on.
    pub velocity: Option<Vec<u8>>,
    /// The last averaged sparse sum, with the correction on.
    pub previous_sum: Option<Vec<u8>>,
}

impl BucketState {
    /// The buffers this bucket keeps, with their names.
    pub fn buffers(&self) -> [(StateBuf, &'static str, Option<&Vec<u8>>); 3] {
        [
            (StateBuf::Residual, "residual", self.residual.as_ref()),
            (StateBuf::Velocity, "velocity", self.velocity.as_ref()),
            (
                StateBuf::PreviousSum,
                "previous_sum",
                self.previous_sum.as_ref(),
            ),
        ]
    }
}

/// One engine's state across steps (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EngineState {
    /// The rank that saved it.
    pub rank: usize,
    /// The world size it was saved in.
    pub world_size: usize,
    /// The settings it depends on, by name ([`settings_of`]).
    pub settings: BTreeMap<String, String>,
    /// Each bucket's state, by bucket index.
    pub buckets: BTreeMap<u64, BucketState>,
}

/// The settings an engine's state depends on, by name: Top-K's (on or off,
/// ratio, threshold, value type), the momentum correction's, clipping and
/// warm-up, the whole-bucket compression (which decides whether Top-K
/// applies) and the 2D algorithm with its ranks per node (2D sparsifies
/// each rank's shard, not the bucket). `intra_size` counts only with 2D.
pub fn settings_of(settings: &AlgoSettings, intra_size: Option<usize>) -> BTreeMap<String, String> {
    let topk = settings.topk;
    let dgc = settings.dgc;
    let entries = [
        (
            "topk",
            if topk.is_some() { "on" } else { "off" }.to_string(),
        ),
        (
            "topk_ratio",
            topk.map_or("-".into(), |o| format!("{:?}", o.ratio)),
        ),
        (
            "topk_threshold",
            topk.map_or("-".into(), |o| o.threshold.to_string()),
        ),
        (
            "topk_fp16",
            topk.map_or("-".into(), |o| o.fp16_values.to_string()),
        ),
        ("topk_momentum", format!("{:?}", dgc.momentum)),
        ("topk_momentum_masking", dgc.masking.to_string()),
        ("topk_warmup_steps", dgc.warmup_steps.to_string()),
        (
            "topk_clip_norm",
            dgc.clip_norm.map_or("none".into(), |c| format!("{c:?}")),
        ),
        ("compression", settings.compression.name().to_string()),
        (
            "two_d",
            settings
                .hierarchical_threshold
                .map_or("off".into(), |t| format!("buckets of at most {t} bytes")),
        ),
        (
            "intra_size",
            match (settings.hierarchical_threshold, intra_size) {
                (Some(_), Some(n)) => n.to_string(),
                _ => "-".into(),
            },
        ),
    ];
    entries
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

fn mismatch(
    key: impl Into<String>,
    expected: impl Into<String>,
    found: impl Into<String>,
) -> Error {
    Error::StateMismatch {
        key: key.into(),
        expected: expected.into(),
        found: found.into(),
    }
}

fn describe(buf: Option<&Vec<u8>>) -> String {
    buf.map_or("none".into(), |b| format!("{} bytes", b.len()))
}

impl EngineState {
    /// Checks that this state fits an engine of `rank` in a world of
    /// `world_size` built with `settings` ([`settings_of`]): the same rank
    /// and world size; for a state holding any bucket, the same settings;
    /// and every bucket's buffers whole float32 values of one length, with
    /// the velocity and last sum exactly when the momentum correction is
    /// on.
    pub fn check_fits(
        &self,
        rank: usize,
        world_size: usize,
        settings: &BTreeMap<String, String>,
    ) -> Result<()> {
        if self.rank != rank {
            return Err(mismatch(
                "rank",
                format!("rank {rank} (this engine's)"),
                format!("rank {} (the rank that saved the state)", self.rank),
            ));
        }
        if self.world_size != world_size {
            return Err(mismatch(
                "world size",
                format!("{world_size} ranks (this engine's)"),
                format!("{} ranks (when the state was saved)", self.world_size),
            ));
        }
        if self.buckets.is_empty() {
            return Ok(());
        }
        let names = settings.keys().chain(self.settings.keys());
        for name in names {
            let (mine, theirs) = (settings.get(name), self.settings.get(name));
            if mine != theirs {
                let show = |v: Option<&String>| v.map_or("not set".into(), |v| format!("{v:?}"));
                return Err(mismatch(
                    format!("setting {name}"),
                    format!("{} (this engine's)", show(mine)),
                    format!("{} (when the state was saved)", show(theirs)),
                ));
            }
        }
        let momentum = settings
            .get("topk_momentum")
            .is_some_and(|m| m.parse::<f64>().is_ok_and(|m| m != 0.0));
        for (&bucket, state) in &self.buckets {
            check_bucket(bucket, state, momentum)?;
        }
        Ok(())
    }
}

/// One bucket's buffers: see [`EngineState::check_fits`].
fn check_bucket(bucket: u64, state: &BucketState, momentum: bool) -> Result<()> {
    if StateBuf::Residual.key(bucket).is_err() {
        return Err(mismatch(
            format!("bucket {bucket}"),
            "a bucket index below 2^60",
            bucket.to_string(),
        ));
    }
    let Some(residual) = &state.residual else {
        for (_, name, buf) in state.buffers() {
            if let Some(b) = buf {
                return Err(mismatch(
                    format!("bucket {bucket} residual"),
                    format!("{} bytes (as its {name})", b.len()),
                    "none",
                ));
            }
        }
        return Ok(());
    };
    if residual.is_empty() || residual.len() % 4 != 0 {
        return Err(mismatch(
            format!("bucket {bucket} residual"),
            "a whole, non-zero number of float32 values (a multiple of 4 bytes)",
            format!("{} bytes", residual.len()),
        ));
    }
    for (which, name, buf) in state.buffers() {
        if which == StateBuf::Residual {
            continue;
        }
        let expected = if momentum {
            format!(
                "{} bytes (its residual's; the momentum correction is on)",
                residual.len()
            )
        } else {
            "none (the momentum correction is off)".into()
        };
        let fits = match buf {
            Some(b) => momentum && b.len() == residual.len(),
            None => !momentum,
        };
        if !fits {
            return Err(mismatch(
                format!("bucket {bucket} {name}"),
                expected,
                describe(buf),
            ));
        }
    }
    Ok(())
}

/// Checks the buckets of `buckets` that a channel already keeps buffers for
/// (`lens`, in float32 elements) against their length there: importing a
/// state into an engine that has run steps must not change a bucket's size.
pub fn check_lengths<'a>(
    buckets: impl IntoIterator<Item = (&'a u64, &'a BucketState)>,
    lens: &HashMap<u64, usize>,
) -> Result<()> {
    for (bucket, state) in buckets {
        let (Some(&n), Some(residual)) = (lens.get(bucket), &state.residual) else {
            continue;
        };
        if residual.len() != n * 4 {
            return Err(mismatch(
                format!("bucket {bucket}"),
                format!("{} bytes (this engine's bucket so far)", n * 4),
                format!("{} bytes", residual.len()),
            ));
        }
    }
    Ok(())
}

/// One channel's state: every bucket it counted steps or keeps buffers for,
/// each buffer read through `read(key)` ([`StateBuf::key`]).
pub fn export_channel(
    sparse: &SparseState,
    mut read: impl FnMut(u64) -> Result<Option<Vec<u8>>>,
) -> Result<BTreeMap<u64, BucketState>> {
    let mut out = BTreeMap::new();
    let buckets = sparse.steps().keys().chain(sparse.lens().keys());
    for &bucket in buckets {
        if out.contains_key(&bucket) {
            continue;
        }
        let mut state = BucketState {
            steps: sparse.steps().get(&bucket).copied().unwrap_or(0),
            ..Default::default()
        };
        if sparse.lens().contains_key(&bucket) {
            state.residual = read(StateBuf::Residual.key(bucket)?)?;
            state.velocity = read(StateBuf::Velocity.key(bucket)?)?;
            state.previous_sum = read(StateBuf::PreviousSum.key(bucket)?)?;
        }
        out.insert(bucket, state);
    }
    Ok(out)
}

/// Imports `buckets` (checked by [`EngineState::check_fits`]) into one
/// channel whose buffers were cleared: every buffer goes through
/// `write(key, bytes)`; returns the bookkeeping the channel's algorithm
/// takes.
pub fn import_channel<'a>(
    buckets: impl IntoIterator<Item = (&'a u64, &'a BucketState)>,
    mut write: impl FnMut(u64, &[u8]) -> Result<()>,
) -> Result<SparseState> {
    let (mut lens, mut steps) = (HashMap::new(), HashMap::new());
    for (&bucket, state) in buckets {
        if state.steps > 0 {
            steps.insert(bucket, state.steps);
        }
        let Some(residual) = &state.residual else {
            continue;
        };
        lens.insert(bucket, residual.len() / 4);
        for (which, _, buf) in state.buffers() {
            if let Some(bytes) = buf {
                write(which.key(bucket)?, bytes)?;
            }
        }
    }
    Ok(SparseState::from_parts(lens, steps))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::sparse::{DgcOptions, TopKOptions};

    fn settings(momentum: f64) -> AlgoSettings {
        AlgoSettings {
            topk: Some(TopKOptions {
                ratio: 0.1,
                threshold: 0,
                fp16_values: false,
            }),
            dgc: DgcOptions {
                momentum,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn state(momentum: bool) -> EngineState {
        let m = if momentum { 0.9 } else { 0.0 };
        let buf = |n: usize| Some(vec![1u8; n]);
        EngineState {
            rank: 1,
            world_size: 2,
            settings: settings_of(&settings(m), None),
            buckets: BTreeMap::from([
                (
                    3,
                    BucketState {
                        steps: 4,
                        residual: buf(40),
                        velocity: if momentum { buf(40) } else { None },
                        previous_sum: if momentum { buf(40) } else { None },
                    },
                ),
                (
                    5,
                    BucketState {
                        steps: 2,
                        ..Default::default()
                    },
                ),
            ]),
        }
    }

    fn error(s: &EngineState, rank: usize, m: f64) -> (String, String, String, String) {
        let err = s
            .check_fits(rank, 2, &settings_of(&settings(m), None))
            .unwrap_err();
        let text = err.to_string();
        match err {
            Error::StateMismatch {
                key,
                expected,
                found,
            } => (key, expected, found, text),
            other => panic!("not a StateMismatch: {other:?}"),
        }
    }

    #[test]
    fn a_state_fits_the_engine_it_came_from() {
        for momentum in [false, true] {
            let m = if momentum { 0.9 } else { 0.0 };
            state(momentum)
                .check_fits(1, 2, &settings_of(&settings(m), None))
                .unwrap();
        }
    }

    #[test]
    fn another_rank_world_or_setting_is_named_with_both_values() {
        let s = state(false);
        let (key, expected, found, text) = error(&s, 0, 0.0);
        assert_eq!(key, "rank");
        assert!(
            expected.contains("rank 0") && found.contains("rank 1"),
            "{text}"
        );
        let err = s
            .check_fits(1, 4, &settings_of(&settings(0.0), None))
            .unwrap_err()
            .to_string();
        assert!(err.contains("world size") && err.contains("4 ranks") && err.contains("2 ranks"));
        let (key, expected, found, _) = error(&s, 1, 0.5);
        assert_eq!(key, "setting topk_momentum");
        assert!(expected.contains("0.5") && found.contains("0.0"));
        // An empty state depends on no setting.
        let empty = EngineState {
            buckets: BTreeMap::new(),
            ..s
        };
        empty
            .check_fits(1, 2, &settings_of(&AlgoSettings::default(), Some(2)))
            .unwrap();
    }

    #[test]
    fn buffers_that_do_not_match_name_the_bucket_and_both_sizes() {
        let mut s = state(true);
        s.buckets.get_mut(&3).unwrap().velocity = Some(vec![0; 36]);
        let (key, expected, found, text) = error(&s, 1, 0.9);
        assert_eq!(key, "bucket 3 velocity", "{text}");
        assert!(
            expected.starts_with("40 bytes") && found == "36 bytes",
            "{text}"
        );
        assert!(
            text.contains("bucket 3 velocity: expected 40 bytes"),
            "{text}"
        );

        let mut s = state(true);
        s.buckets.get_mut(&3).unwrap().previous_sum = None;
        let (key, _, found, _) = error(&s, 1, 0.9);
        assert_eq!(
            (key.as_str(), found.as_str()),
            ("bucket 3 previous_sum", "none")
        );

        let mut s = state(false);
        s.buckets.get_mut(&3).unwrap().residual = Some(vec![0; 6]);
        let (key, _, found, _) = error(&s, 1, 0.0);
        assert_eq!(
            (key.as_str(), found.as_str()),
            ("bucket 3 residual", "6 bytes")
        );

        let mut s = state(false);
        s.buckets.get_mut(&3).unwrap().velocity = Some(vec![0; 40]);
        let (key, expected, _, _) = error(&s, 1, 0.0);
        assert_eq!(key, "bucket 3 velocity");
        assert!(expected.contains("momentum correction is off"));

        let mut s = state(false);
        s.buckets.insert(1 << 61, BucketState::default());
        let (key, _, _, _) = error(&s, 1, 0.0);
        assert_eq!(key, format!("bucket {}", 1u64 << 61));
    }

    #[test]
    fn lengths_are_checked_against_buckets_an_engine_already_ran() {
        let s = state(false);
        check_lengths(&s.buckets, &HashMap::from([(3, 10), (7, 99)])).unwrap();
        let err = check_lengths(&s.buckets, &HashMap::from([(3, 12)])).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the engine state does not fit this engine: bucket 3: expected 48 bytes (this \
             engine's bucket so far), found 40 bytes"
        );
    }

    #[test]
    fn a_channel_round_trips_through_export_and_import() {
        let s = state(true);
        let mut kept = HashMap::new();
        let sparse = import_channel(&s.buckets, |key, bytes| {
            kept.insert(key, bytes.to_vec());
            Ok(())
        })
        .unwrap();
        assert_eq!(sparse.lens(), &HashMap::from([(3, 10)]));
        assert_eq!(sparse.steps(), &HashMap::from([(3, 4), (5, 2)]));
        assert_eq!(kept.len(), 3);
        let back = export_channel(&sparse, |key| Ok(kept.get(&key).cloned())).unwrap();
        assert_eq!(back, s.buckets);
    }
}
