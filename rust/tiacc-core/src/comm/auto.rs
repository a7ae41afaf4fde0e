//! `TIACC_TRAINING_ALGORITHM=auto`: flat or 2D, measured at start-up.
//!
//! When a job spans nodes of several ranks each, the engine (the TCP one for
//! CPU buckets, the device one for CUDA buckets over NCCL) connects both the
//! world group and the 2D groups, then times the real algorithms on a probe
//! buffer before the first bucket, through the same [`Backend`] the buckets
//! use ([`probe`]): the flat ring against the 2D allreduce over [`ROUNDS`]
//! rounds, then an allreduce on the intra-node and on the inter-node group
//! alone, and the chosen one with fp16 compression (to say what compression
//! would gain; it is never switched on by itself, because it changes the
//! numerics).
//!
//! One timing is easily fooled on a loaded machine (a stall doubles either
//! algorithm's time), so the choice does not rest on it alone: across
//! nodes of several ranks 2D is the prior, because it moves fewer bytes
//! over the link between nodes, and flat replaces it only when it is
//! faster by [`MARGIN`] both in the median of the rounds and in most of
//! them ([`decide`]). Every rank contributes its timings to one allreduce,
//! so every rank sees the same numbers and makes the same choice.

use std::time::{Duration, Instant};

use super::algo::{AlgoSettings, Algorithm, Bucket};
use super::backend::{Backend, GroupId, GroupSum, Mem};
use super::codec::Compression;
use super::dtype::DType;
use super::host::{GroupSet, Groups, HostBackend};
use super::transport::{Deadline, OpKind, OpTag};
use crate::error::{Error, Result};

/// Largest probe: big enough that bandwidth, not latency, decides (DDP's
/// buckets are tens of MB), small enough to cost well under a second on a
/// 1 Gbit/s link.
pub const MAX_PROBE_BYTES: usize = 4 << 20;
/// Smallest probe.
pub const MIN_PROBE_BYTES: usize = 256 << 10;

/// Rounds of flat against 2D. A single round decides nothing on a loaded
/// machine: one stall doubles either time. With five, the median and the
/// majority both ignore up to two disturbed rounds, and the whole race of
/// a 4 MiB probe still costs well under a second between two nodes at
/// 1 Gbit/s (a round, flat and 2D, takes about 85 to 170 ms there).
pub const ROUNDS: usize = 5;

/// How much faster the challenger must be than the prior to be chosen, in
/// the median of the rounds and in most rounds: across nodes of several
/// ranks, flat wins only when 2D takes at least 1.25x flat's time. A
/// smaller gap is within what a busy machine makes of two timings, and
/// the prior's advantage (fewer bytes over the link between nodes) grows
/// with the buckets, which are larger than the probe.
pub const MARGIN: f64 = 1.25;

/// One of the two algorithms the probe races.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Candidate {
    Flat,
    TwoD,
}

impl Candidate {
    fn name(self) -> &'static str {
        match self {
            Candidate::Flat => "flat",
            Candidate::TwoD => "2d",
        }
    }
}

/// One round of the race: flat and 2D on the probe, each averaged over the
/// ranks (seconds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Round {
    pub flat_s: f64,
    pub two_d_s: f64,
}

impl Round {
    fn of(self, c: Candidate) -> f64 {
        match c {
            Candidate::Flat => self.flat_s,
            Candidate::TwoD => self.two_d_s,
        }
    }
}

/// What the probe measured, averaged over the ranks (seconds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Probe {
    /// Bytes of the probe buffer (float32).
    pub bytes: usize,
    /// The race of flat against 2D, in the order the rounds ran.
    pub rounds: [Round; ROUNDS],
    /// The chosen algorithm with fp16 compression.
    pub fp16_s: f64,
    /// An allreduce of the probe inside the node.
    pub intra_s: f64,
    /// An allreduce across nodes of one rank's 2D shard of the probe.
    pub inter_s: f64,
    /// A 4-byte allreduce across nodes.
    pub inter_latency_s: f64,
    pub intra_size: usize,
    pub nodes: usize,
}

/// What the rounds of a race say ([`decide`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Verdict {
    /// The choice.
    pub two_d: bool,
    /// What is chosen unless the rounds clearly say otherwise: 2D when the
    /// job spans several nodes of several ranks each, else flat.
    pub prior: Candidate,
    /// Median over the rounds (seconds).
    pub flat_s: f64,
    pub two_d_s: f64,
    /// Rounds in which the prior was faster.
    pub prior_faster: usize,
    /// Rounds in which the other one was faster by at least [`MARGIN`].
    pub challenger_wins: usize,
    /// Rounds in all.
    pub rounds: usize,
}

impl Verdict {
    fn challenger(&self) -> Candidate {
        match self.prior {
            Candidate::Flat => Candidate::TwoD,
            Candidate::TwoD => Candidate::Flat,
        }
    }

    /// Rounds the challenger must win by [`MARGIN`] to be chosen.
    fn majority(&self) -> usize {
        self.rounds / 2 + 1
    }
}

/// Flat or 2D from the rounds of a race (each already averaged over the
/// ranks, so that every rank decides alike) and the topology: across
/// `nodes` >= 2 of `intra_size` >= 2 ranks each, 2D is the prior (per rank
/// a ring over p ranks sends 2 (p - 1) / p of the buffer, most of it to
/// other nodes; 2D sends only 2 (n - 1) / n of a 1/k shard across nodes),
/// otherwise flat is. The other one is chosen only when it is faster by
/// [`MARGIN`] in the median of the rounds and in a majority of them.
pub fn decide(rounds: &[Round], intra_size: usize, nodes: usize) -> Verdict {
    let prior = if nodes >= 2 && intra_size >= 2 {
        Candidate::TwoD
    } else {
        Candidate::Flat
    };
    let challenger = match prior {
        Candidate::Flat => Candidate::TwoD,
        Candidate::TwoD => Candidate::Flat,
    };
    let clearly = |prior_s: f64, challenger_s: f64| prior_s >= MARGIN * challenger_s;
    let prior_faster = rounds
        .iter()
        .filter(|r| r.of(prior) < r.of(challenger))
        .count();
    let challenger_wins = rounds
        .iter()
        .filter(|r| clearly(r.of(prior), r.of(challenger)))
        .count();
    let flat_s = median(rounds.iter().map(|r| r.flat_s));
    let two_d_s = median(rounds.iter().map(|r| r.two_d_s));
    let median_of = |c: Candidate| match c {
        Candidate::Flat => flat_s,
        Candidate::TwoD => two_d_s,
    };
    let mut verdict = Verdict {
        two_d: false,
        prior,
        flat_s,
        two_d_s,
        prior_faster,
        challenger_wins,
        rounds: rounds.len(),
    };
    let switch = !rounds.is_empty()
        && clearly(median_of(prior), median_of(challenger))
        && challenger_wins >= verdict.majority();
    let chosen = if switch { challenger } else { prior };
    verdict.two_d = chosen == Candidate::TwoD;
    verdict
}

/// The median of `values` (the mean of the middle two for an even count;
/// NaN for none).
fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The choice and the one line that explains it.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub two_d: bool,
    pub line: String,
}

impl Probe {
    /// What the rounds say ([`decide`] on this job's topology).
    pub fn verdict(&self) -> Verdict {
        decide(&self.rounds, self.intra_size, self.nodes)
    }

    /// Flat or 2D ([`decide`]); the line says what was measured and why,
    /// and also names the engine's `channels` and whether they take turns
    /// on the link between nodes (the TCP engine's [`super::turns`]).
    pub fn decide(&self, channels: usize, turns: bool) -> Decision {
        let v = self.verdict();
        let (name, best) = if v.two_d {
            ("2d", v.two_d_s)
        } else {
            ("flat", v.flat_s)
        };
        let ms = |s: f64| s * 1e3;
        // Bus bandwidth of a ring allreduce: 2 (p - 1) / p of the buffer
        // leaves each rank.
        let bus = |bytes: f64, p: usize, s: f64| {
            2.0 * (p as f64 - 1.0) / p as f64 * bytes / s.max(1e-9) / 1e6
        };
        let shard = self.bytes as f64 / self.intra_size.max(1) as f64;
        let turns = if turns {
            ", taking turns between nodes"
        } else {
            ""
        };
        let (prior, challenger) = (v.prior.name(), v.challenger().name());
        Decision {
            two_d: v.two_d,
            line: format!(
                "auto: chose {name} ({} rounds of a {:.1} MiB probe: median flat {:.1} ms, \
                 2d {:.1} ms; {prior} faster in {} of {}, {challenger} by >= {MARGIN:.2}x in {}; \
                 {challenger} needs >= {MARGIN:.2}x in the median and in {} of {} to win); \
                 links: intra-node {:.0} MB/s over {} ranks, inter-node {:.0} MB/s over {} \
                 nodes with {:.2} ms latency; channels={channels}{turns}; \
                 compression stays off (it changes numerics): fp16 would take {:.1} ms \
                 ({:.2}x; TIACC_TRAINING_COMPRESSION=fp16)",
                v.rounds,
                self.bytes as f64 / (1 << 20) as f64,
                ms(v.flat_s),
                ms(v.two_d_s),
                v.prior_faster,
                v.rounds,
                v.challenger_wins,
                v.majority(),
                v.rounds,
                bus(self.bytes as f64, self.intra_size, self.intra_s),
                self.intra_size,
                bus(shard, self.nodes, self.inter_s),
                self.nodes,
                ms(self.inter_latency_s),
                ms(self.fp16_s),
                best / self.fp16_s.max(1e-9),
            ),
        }
    }
}

/// What the probe needs from a backend besides its collectives: moving a
/// few host bytes in and out of its memory, and waiting for the work it
/// has enqueued (the host backend's collectives are done when they
/// return; the device backend's are only enqueued on a CUDA stream, and a
/// clock read before they finish would time the enqueueing).
pub trait Probing: Backend {
    /// Copies `src` into `dst`, memory of the current operation.
    fn write(&mut self, dst: Mem, src: &[u8]) -> Result<()>;
    /// Copies `src` (memory of the current operation) out, once the work
    /// enqueued before has finished.
    fn read(&mut self, src: Mem, dst: &mut [u8]) -> Result<()>;
    /// Returns once everything enqueued so far has finished.
    fn finish(&mut self) -> Result<()>;
}

impl<G: GroupSet> Probing for HostBackend<G> {
    fn write(&mut self, dst: Mem, src: &[u8]) -> Result<()> {
        let out = self.bytes(dst)?;
        if out.len() != src.len() {
            return Err(length_mismatch(out.len(), src.len()));
        }
        out.copy_from_slice(src);
        Ok(())
    }

    fn read(&mut self, src: Mem, dst: &mut [u8]) -> Result<()> {
        let from = self.bytes(src)?;
        if from.len() != dst.len() {
            return Err(length_mismatch(from.len(), dst.len()));
        }
        dst.copy_from_slice(from);
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

fn length_mismatch(mem: usize, host: usize) -> Error {
    Error::InvalidArgument(format!(
        "the algorithm probe copies {host} bytes to or from a span of {mem}"
    ))
}

/// The probe's length for a requested one (a bucket cap): clamped to the
/// probe limits, whole float32 elements.
pub fn probe_bytes(requested: usize) -> usize {
    (requested.clamp(MIN_PROBE_BYTES, MAX_PROBE_BYTES) / 4) * 4
}

/// [`probe`] on the host backend over `groups` (which must hold the 2D
/// hierarchy), with a probe of [`probe_bytes`]`(bytes)`, the whole probe
/// bounded by `deadline`. Every rank must call this at the same point.
pub fn measure(groups: Groups, bytes: usize, deadline: Deadline) -> (Groups, Result<Probe>) {
    measure_skewed(groups, bytes, deadline, &unskewed)
}

/// [`measure`], each timing of the race shifted by `skew` (see
/// [`probe_skewed`]).
pub(crate) fn measure_skewed(
    groups: Groups,
    bytes: usize,
    deadline: Deadline,
    skew: &Skew,
) -> (Groups, Result<Probe>) {
    let mut backend = HostBackend::new(groups, deadline);
    let mut buf = vec![0u8; probe_bytes(bytes)];
    // SAFETY: `buf` lives, untouched by anything else, until `end` below.
    let mem = unsafe { backend.begin(&mut buf, deadline, None) };
    let result = probe_skewed(&mut backend, mem, skew);
    backend.end();
    (backend.groups, result)
}

/// What a test adds to this rank's timing of one candidate in one round
/// of the race (0-based), standing in for a link or a machine that stalled
/// during that run without waiting for it; the engines add nothing.
pub(crate) type Skew = dyn Fn(Candidate, usize) -> Duration;

fn unskewed(_: Candidate, _: usize) -> Duration {
    Duration::ZERO
}

/// Times the algorithms on backend `b` (which must hold the 2D groups) with
/// `buf`, zeroed float32 memory of the current operation (its length as
/// [`probe_bytes`] gives it): [`ROUNDS`] rounds of flat against 2D (which
/// one goes first alternates), then the chosen one with fp16 compression,
/// the intra-node and inter-node groups alone, and the latency between
/// nodes. Every rank must call this at the same point, with the same
/// length; every rank gets the same numbers.
pub fn probe<B: Probing>(b: &mut B, buf: Mem) -> Result<Probe> {
    probe_skewed(b, buf, &unskewed)
}

/// [`probe`], `skew(candidate, round)` added to this rank's time of each
/// run of the race.
fn probe_skewed<B: Probing>(b: &mut B, buf: Mem, skew: &Skew) -> Result<Probe> {
    if !b.hierarchical() {
        return Err(Error::InvalidArgument(
            "the algorithm probe needs the 2D groups".into(),
        ));
    }
    let bytes = (buf.bytes / 4) * 4;
    if bytes == 0 {
        return Err(Error::InvalidArgument(
            "the algorithm probe needs a buffer of at least one float32".into(),
        ));
    }
    let flat = AlgoSettings::default();
    let two_d = AlgoSettings {
        hierarchical_threshold: Some(u64::MAX),
        ..flat
    };
    let (intra_size, nodes) = (b.size(GroupId::Intra), b.size(GroupId::Inter));
    let mut seq = 0u64;
    let mut time = |b: &mut B, settings: AlgoSettings, len: usize| -> Result<f64> {
        seq += 1;
        let tag = OpTag {
            op: 0,
            kind: OpKind::Allreduce,
            seq,
            bucket: u64::MAX - seq,
            dtype: DType::F32.code(),
            bytes: len as u64,
        };
        let mem = buf.prefix(len)?;
        b.finish()?;
        let start = Instant::now();
        let bucket = Bucket {
            tag: &tag,
            buf: mem,
            dtype: DType::F32,
        };
        Algorithm::new(settings).allreduce(b, bucket, true)?;
        b.finish()?;
        Ok(start.elapsed().as_secs_f64())
    };
    // Warm-up: connections, TCP windows and NCCL's lazily made channels
    // open before anything is timed.
    let warm = bytes.min(64 << 10);
    time(b, flat, warm)?;
    time(b, two_d, warm)?;
    // The race: flat and 2D in turn, the first of each round alternating,
    // so that neither always runs on a link the other has just warmed or
    // congested.
    let mut own = [0.0; 2 * ROUNDS];
    for (round, pair) in own.chunks_exact_mut(2).enumerate() {
        let order = if round % 2 == 0 {
            [Candidate::Flat, Candidate::TwoD]
        } else {
            [Candidate::TwoD, Candidate::Flat]
        };
        for c in order {
            let (settings, slot) = match c {
                Candidate::Flat => (flat, 0),
                Candidate::TwoD => (two_d, 1),
            };
            pair[slot] = time(b, settings, bytes)? + skew(c, round).as_secs_f64();
        }
    }
    // One exchange for every round: the ranks decide on the same numbers,
    // so they agree on which algorithm runs next and on the choice.
    let all = average(b, own)?;
    let mut rounds = [Round {
        flat_s: 0.0,
        two_d_s: 0.0,
    }; ROUNDS];
    for (r, pair) in rounds.iter_mut().zip(all.chunks_exact(2)) {
        *r = Round {
            flat_s: pair[0],
            two_d_s: pair[1],
        };
    }
    let best = if decide(&rounds, intra_size, nodes).two_d {
        two_d
    } else {
        flat
    };
    let fp16_s = time(
        b,
        AlgoSettings {
            compression: Compression::Fp16,
            ..best
        },
        bytes,
    )?;
    let group_time = |b: &mut B, group: GroupId, len: usize| -> Result<f64> {
        let mem = buf.prefix(len)?;
        b.finish()?;
        let start = Instant::now();
        b.allreduce(mem, &GroupSum::plain(group, DType::F32))?;
        b.finish()?;
        Ok(start.elapsed().as_secs_f64())
    };
    let intra_s = group_time(b, GroupId::Intra, bytes)?;
    let shard = (bytes / intra_size / 4).max(1) * 4;
    let inter_s = group_time(b, GroupId::Inter, shard)?;
    let mut inter_latency_s = f64::MAX;
    for _ in 0..3 {
        inter_latency_s = inter_latency_s.min(group_time(b, GroupId::Inter, 4)?);
    }
    let [fp16_s, intra_s, inter_s, inter_latency_s] =
        average(b, [fp16_s, intra_s, inter_s, inter_latency_s])?;
    Ok(Probe {
        bytes,
        rounds,
        fp16_s,
        intra_s,
        inter_s,
        inter_latency_s,
        intra_size,
        nodes,
    })
}

/// Every rank's `times`, averaged over the world (so that every rank
/// decides on the same numbers).
fn average<B: Probing, const N: usize>(b: &mut B, times: [f64; N]) -> Result<[f64; N]> {
    let world = b.size(GroupId::World) as f64;
    let mut wire: Vec<u8> = times.iter().flat_map(|t| t.to_ne_bytes()).collect();
    let mem = b.alloc(wire.len())?;
    b.write(mem, &wire)?;
    b.allreduce(mem, &GroupSum::plain(GroupId::World, DType::F64))?;
    b.read(mem, &mut wire)?;
    let mut out = [0.0; N];
    for (t, bytes) in out.iter_mut().zip(wire.chunks_exact(8)) {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(bytes);
        *t = f64::from_ne_bytes(raw) / world;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rounds of (flat, 2d) in milliseconds.
    fn rounds(ms: [(f64, f64); ROUNDS]) -> [Round; ROUNDS] {
        ms.map(|(flat, two_d)| Round {
            flat_s: flat / 1e3,
            two_d_s: two_d / 1e3,
        })
    }

    /// A probe of 4 MiB between 2 nodes of 2 ranks with `rounds`.
    fn probe(rounds: [Round; ROUNDS]) -> Probe {
        Probe {
            bytes: 4 << 20,
            rounds,
            fp16_s: 0.085,
            intra_s: 0.004,
            inter_s: 0.080,
            inter_latency_s: 0.0002,
            intra_size: 2,
            nodes: 2,
        }
    }

    #[test]
    fn the_faster_algorithm_wins_and_the_line_says_why() {
        let p = probe(rounds([
            (240.0, 160.0),
            (250.0, 150.0),
            (230.0, 170.0),
            (240.0, 160.0),
            (245.0, 165.0),
        ]));
        let d = p.decide(2, true);
        assert!(d.two_d);
        assert!(
            d.line.starts_with(
                "auto: chose 2d (5 rounds of a 4.0 MiB probe: median flat 240.0 ms, \
                 2d 160.0 ms; 2d faster in 5 of 5, flat by >= 1.25x in 0; \
                 flat needs >= 1.25x in the median and in 3 of 5 to win); links: "
            ),
            "{}",
            d.line
        );
        assert!(d.line.contains("channels=2, taking turns"), "{}", d.line);
        assert!(
            d.line.contains("fp16 would take 85.0 ms (1.88x"),
            "{}",
            d.line
        );
        let flat = probe(rounds([(100.0, 160.0); ROUNDS])).decide(1, false);
        assert!(!flat.two_d, "{}", flat.line);
        assert!(
            flat.line.starts_with(
                "auto: chose flat (5 rounds of a 4.0 MiB probe: median flat 100.0 ms, \
                 2d 160.0 ms; 2d faster in 0 of 5, flat by >= 1.25x in 5;"
            ),
            "{}",
            flat.line
        );
        assert!(
            flat.line.contains("channels=1; compression"),
            "{}",
            flat.line
        );
        // fp16 is compared with the chosen one.
        assert!(flat.line.contains("(1.18x;"), "{}", flat.line);
    }

    #[test]
    fn one_round_where_a_stall_doubled_2d_does_not_choose_flat() {
        // The start-up that chose flat from one timing: flat 50.2 ms, 2d
        // 100.2 ms, among rounds where 2D is the faster.
        let p = probe(rounds([
            (72.1, 41.3),
            (50.2, 100.2),
            (70.4, 40.9),
            (73.0, 42.0),
            (71.8, 41.1),
        ]));
        let v = p.verdict();
        assert!(v.two_d);
        assert_eq!((v.prior_faster, v.challenger_wins, v.rounds), (4, 1, 5));
        let d = p.decide(1, true);
        assert!(d.two_d);
        assert!(
            d.line.starts_with(
                "auto: chose 2d (5 rounds of a 4.0 MiB probe: median flat 71.8 ms, \
                 2d 41.3 ms; 2d faster in 4 of 5, flat by >= 1.25x in 1;"
            ),
            "{}",
            d.line
        );
        // Even two such rounds of five leave 2D.
        let mut two = p.rounds;
        two[3] = Round {
            flat_s: 0.0502,
            two_d_s: 0.1002,
        };
        assert!(decide(&two, 2, 2).two_d);
    }

    #[test]
    fn flat_only_marginally_faster_in_every_round_stays_2d() {
        // A delay of the same size on 2D in every round, leaving flat
        // faster but by less than the margin.
        let v = decide(
            &rounds([
                (50.0, 60.0),
                (52.0, 61.0),
                (49.0, 60.5),
                (51.0, 62.0),
                (50.5, 61.5),
            ]),
            2,
            2,
        );
        assert!(v.two_d);
        assert_eq!((v.prior_faster, v.challenger_wins), (0, 0));
        // Just under the margin everywhere, too.
        let v = decide(&rounds([(100.0, 124.9); ROUNDS]), 2, 2);
        assert!(v.two_d);
        // At the margin, flat wins.
        let v = decide(&rounds([(100.0, 125.0); ROUNDS]), 2, 2);
        assert!(!v.two_d);
    }

    #[test]
    fn flat_consistently_faster_by_a_wide_margin_wins() {
        let v = decide(
            &rounds([
                (40.0, 80.0),
                (42.0, 79.0),
                (39.0, 81.0),
                (41.0, 150.0),
                (40.5, 80.5),
            ]),
            4,
            3,
        );
        assert!(!v.two_d);
        assert_eq!(
            (v.prior, v.prior_faster, v.challenger_wins),
            (Candidate::TwoD, 0, 5)
        );
        assert_eq!((v.flat_s, v.two_d_s), (0.0405, 0.0805));
        // Three clear rounds of five are enough, when the median agrees.
        let v = decide(
            &rounds([
                (40.0, 80.0),
                (60.0, 50.0),
                (40.0, 80.0),
                (60.0, 50.0),
                (40.0, 80.0),
            ]),
            2,
            2,
        );
        assert!(!v.two_d);
        assert_eq!((v.prior_faster, v.challenger_wins), (2, 3));
    }

    #[test]
    fn flat_must_win_in_the_median_and_in_most_rounds() {
        // The median says flat by 4x, but flat is clearly faster in only
        // 2 of 5 rounds.
        let v = decide(
            &rounds([
                (10.0, 100.0),
                (10.0, 100.0),
                (50.0, 40.0),
                (50.0, 40.0),
                (10.0, 12.0),
            ]),
            2,
            2,
        );
        assert!(v.two_d);
        assert_eq!((v.flat_s, v.two_d_s), (0.01, 0.04));
        assert_eq!(v.challenger_wins, 2);
        // Flat is clearly faster in 3 of 5 rounds, but the median is 2D's.
        let v = decide(
            &rounds([
                (10.0, 13.0),
                (20.0, 26.0),
                (30.0, 39.0),
                (100.0, 20.0),
                (100.0, 20.0),
            ]),
            2,
            2,
        );
        assert!(v.two_d);
        assert_eq!(v.challenger_wins, 3);
        assert!(v.two_d_s < v.flat_s);
    }

    #[test]
    fn without_nodes_of_several_ranks_flat_is_the_prior() {
        // The probe runs only with the 2D groups (2 or more nodes of 2 or
        // more ranks); were it asked otherwise, 2D would need the margin.
        let slightly = rounds([(50.0, 45.0); ROUNDS]);
        for (intra_size, nodes) in [(1, 4), (4, 1)] {
            let v = decide(&slightly, intra_size, nodes);
            assert_eq!(v.prior, Candidate::Flat);
            assert!(!v.two_d, "{intra_size} x {nodes}");
        }
        let clearly = rounds([(100.0, 40.0); ROUNDS]);
        assert!(decide(&clearly, 1, 4).two_d);
        let mut p = probe(slightly);
        p.intra_size = 1;
        let line = p.decide(1, false).line;
        assert!(
            line.contains("flat faster in 0 of 5, 2d by >= 1.25x in 0; 2d needs >= 1.25x"),
            "{line}"
        );
    }

    #[test]
    fn no_rounds_keep_the_prior() {
        let v = decide(&[], 2, 2);
        assert!(v.two_d);
        assert_eq!((v.rounds, v.prior_faster, v.challenger_wins), (0, 0, 0));
        assert!(!decide(&[], 1, 2).two_d);
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median([3.0, 1.0, 2.0].into_iter()), 2.0);
        assert_eq!(median([4.0, 1.0, 3.0, 2.0].into_iter()), 2.5);
        assert!(median(std::iter::empty()).is_nan());
    }
}
