//! `TIACC_TRAINING_ALGORITHM=auto`: flat or 2D, measured once at start-up.
//!
//! When a job spans nodes of several ranks each, the engine (the TCP one for
//! CPU buckets, the device one for CUDA buckets over NCCL) connects both the
//! world group and the 2D groups, then times the real algorithms on a probe
//! buffer before the first bucket, through the same [`Backend`] the buckets
//! use ([`probe`]): the flat ring, the 2D allreduce,
//! each alone on the intra-node and inter-node groups, and the chosen one
//! with fp16 compression (to say what compression would gain; it is never
//! switched on by itself, because it changes the numerics). Every rank
//! contributes its timings to one allreduce, so every rank sees the same
//! numbers and makes the same choice.

use std::time::Instant;

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

/// What the probe measured, averaged over the ranks (seconds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Probe {
    /// Bytes of the probe buffer (float32).
    pub bytes: usize,
    pub flat_s: f64,
    pub two_d_s: f64,
    /// The faster of the two with fp16 compression.
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

/// The choice and the one line that explains it.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub two_d: bool,
    pub line: String,
}

impl Probe {
    /// Picks the faster algorithm; the line also names the engine's
    /// `channels` and whether they take turns on the link between nodes
    /// (the TCP engine's [`super::turns`]).
    pub fn decide(&self, channels: usize, turns: bool) -> Decision {
        let two_d = self.two_d_s < self.flat_s;
        let (name, best) = if two_d {
            ("2d", self.two_d_s)
        } else {
            ("flat", self.flat_s)
        };
        let ms = |s: f64| s * 1e3;
        // Bus bandwidth of a ring allreduce: 2 (p - 1) / p of the buffer
        // leaves each rank.
        let bus = |bytes: f64, p: usize, s: f64| {
            2.0 * (p as f64 - 1.0) / p as f64 * bytes / s.max(1e-9) / 1e6
        };
        let shard = self.bytes as f64 / self.intra_size as f64;
        let turns = if turns {
            ", taking turns between nodes"
        } else {
            ""
        };
        Decision {
            two_d,
            line: format!(
                "auto: chose {name} (a {:.1} MiB probe took flat {:.1} ms, 2d {:.1} ms); links: \
                 intra-node {:.0} MB/s over {} ranks, inter-node {:.0} MB/s over {} nodes with \
                 {:.2} ms latency; channels={channels}{turns}; \
                 compression stays off (it changes numerics): fp16 would take {:.1} ms \
                 ({:.2}x; TIACC_TRAINING_COMPRESSION=fp16)",
                self.bytes as f64 / (1 << 20) as f64,
                ms(self.flat_s),
                ms(self.two_d_s),
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
    let mut backend = HostBackend::new(groups, deadline);
    let mut buf = vec![0u8; probe_bytes(bytes)];
    // SAFETY: `buf` lives, untouched by anything else, until `end` below.
    let mem = unsafe { backend.begin(&mut buf, deadline, None) };
    let result = probe(&mut backend, mem);
    backend.end();
    (backend.groups, result)
}

/// Times the algorithms on backend `b` (which must hold the 2D groups) with
/// `buf`, zeroed float32 memory of the current operation (its length as
/// [`probe_bytes`] gives it). Every rank must call this at the same point,
/// with the same length; every rank gets the same numbers.
pub fn probe<B: Probing>(b: &mut B, buf: Mem) -> Result<Probe> {
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
    let (mut flat_s, mut two_d_s) = (f64::MAX, f64::MAX);
    for _ in 0..2 {
        flat_s = flat_s.min(time(b, flat, bytes)?);
        two_d_s = two_d_s.min(time(b, two_d, bytes)?);
    }
    // Ranks must agree on which one runs next: decide on the averages.
    let [flat_s, two_d_s] = average(b, [flat_s, two_d_s])?;
    let best = if two_d_s < flat_s { two_d } else { flat };
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
        flat_s,
        two_d_s,
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

    #[test]
    fn the_faster_algorithm_wins_and_the_line_says_why() {
        let probe = Probe {
            bytes: 4 << 20,
            flat_s: 0.240,
            two_d_s: 0.160,
            fp16_s: 0.085,
            intra_s: 0.004,
            inter_s: 0.080,
            inter_latency_s: 0.0002,
            intra_size: 2,
            nodes: 2,
        };
        let d = probe.decide(2, true);
        assert!(d.two_d);
        assert!(d.line.starts_with("auto: chose 2d"), "{}", d.line);
        assert!(d.line.contains("flat 240.0 ms, 2d 160.0 ms"), "{}", d.line);
        assert!(d.line.contains("channels=2, taking turns"), "{}", d.line);
        assert!(
            d.line.contains("fp16 would take 85.0 ms (1.88x"),
            "{}",
            d.line
        );
        let flat = Probe {
            flat_s: 0.1,
            ..probe
        }
        .decide(1, false);
        assert!(!flat.two_d && flat.line.starts_with("auto: chose flat"));
        assert!(
            flat.line.contains("channels=1; compression"),
            "{}",
            flat.line
        );
    }
}
