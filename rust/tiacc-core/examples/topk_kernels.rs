//! Times the host Top-K kernels (`sparse::pack`, `sparse::sum`) against the
//! first implementation kept below as `baseline`, and checks that both give
//! the same bytes.
//!
//! ```text
//! cargo run --release -p tiacc-core --example topk_kernels -- [n] [ratio] [iterations] [threads]
//! ```
//!
//! Defaults: 5M float32 (20 MB), ratio 0.01, 15 timed iterations, 4 ranks'
//! blocks summed, run in a rayon pool of 1 thread (`threads` lists pool
//! sizes to compare, e.g. `1,2`; only code that uses rayon sees them).

use std::time::Instant;

use tiacc_core::comm::backend::TopKBlock;
use tiacc_core::comm::sparse::{pack, sum};

#[path = "../src/comm/sparse/reference.rs"]
mod reference;

/// The kernels as first written: an n-float corrected copy, an n-entry
/// index array and a quickselect over it, an n-float accumulator.
mod baseline {
    use half::f16;
    use tiacc_core::comm::backend::TopKBlock;

    use super::reference::write_chosen;

    fn f32_at(bytes: &[u8], i: usize) -> f32 {
        f32::from_ne_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]])
    }

    fn top_k(values: &[f32], k: usize) -> Vec<u32> {
        let n = values.len();
        let mut idx: Vec<u32> = (0..n as u32).collect();
        if k == 0 {
            return Vec::new();
        }
        if k < n {
            idx.select_nth_unstable_by(k - 1, |&a, &b| {
                let (va, vb) = (values[a as usize].abs(), values[b as usize].abs());
                vb.total_cmp(&va).then(a.cmp(&b))
            });
            idx.truncate(k);
        }
        idx.sort_unstable();
        idx
    }

    pub fn pack(data: &[u8], residual: &mut [u8], layout: TopKBlock, out: &mut [u8]) {
        let k = layout.k;
        let mut corrected: Vec<f32> = data
            .chunks_exact(4)
            .zip(residual.chunks_exact(4))
            .map(|(d, r)| f32_at(d, 0) + f32_at(r, 0))
            .collect();
        let chosen = top_k(&corrected, k);
        out.fill(0);
        let offset = layout.values_offset();
        write_chosen(&mut corrected, &chosen, layout.fp16_values, out, offset);
        for (r, v) in residual.chunks_exact_mut(4).zip(corrected) {
            r.copy_from_slice(&v.to_ne_bytes());
        }
    }

    pub fn sum(gathered: &[u8], layout: TopKBlock, out: &mut [u8]) {
        let (n, k) = (layout.n, layout.k);
        let mut acc = vec![0f32; n];
        for block in gathered.chunks_exact(layout.bytes()) {
            let (indices, values) = block.split_at(layout.values_offset());
            for j in 0..k {
                let i = u32::from_le_bytes([
                    indices[j * 4],
                    indices[j * 4 + 1],
                    indices[j * 4 + 2],
                    indices[j * 4 + 3],
                ]) as usize;
                acc[i] += if layout.fp16_values {
                    f16::from_le_bytes([values[j * 2], values[j * 2 + 1]]).to_f32()
                } else {
                    f32::from_le_bytes([
                        values[j * 4],
                        values[j * 4 + 1],
                        values[j * 4 + 2],
                        values[j * 4 + 3],
                    ])
                };
            }
        }
        for (c, v) in out.chunks_exact_mut(4).zip(acc) {
            c.copy_from_slice(&v.to_ne_bytes());
        }
    }
}

/// Deterministic pseudo-random numbers (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A standard normal (Box-Muller).
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform().max(1e-300), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// Gradient-like values: layers of random sizes, each with its own scale.
fn gradient(n: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed);
    let mut out = Vec::with_capacity(4 * n);
    while out.len() < 4 * n {
        let layer = 1000 + (rng.next() % 400_000) as usize;
        let scale = 10f64.powf(-4.0 + 3.0 * rng.uniform());
        for _ in 0..layer.min(n - out.len() / 4) {
            out.extend_from_slice(&((rng.normal() * scale) as f32).to_ne_bytes());
        }
    }
    out
}

/// Native-endian float32s of a buffer the allocator aligned.
fn floats(b: &[u8]) -> &[f32] {
    // SAFETY: any 4 bytes are a valid f32; align_to returns aligned f32s.
    let (head, body, tail) = unsafe { b.align_to::<f32>() };
    assert!(head.is_empty() && tail.is_empty(), "unaligned buffer");
    body
}

fn floats_mut(b: &mut [u8]) -> &mut [f32] {
    // SAFETY: as in `floats`.
    let (head, body, tail) = unsafe { b.align_to_mut::<f32>() };
    assert!(head.is_empty() && tail.is_empty(), "unaligned buffer");
    body
}

/// The floor of pack: the one pass over data and residual it must make.
fn add_assign(r: &mut [f32], d: &[f32]) {
    for (y, x) in r.iter_mut().zip(d) {
        *y += *x;
    }
}

/// Writes a buffer larger than the last-level cache, so that every timed
/// call starts with its buffers out of cache (as after a backward pass).
fn evict(scratch: &mut [u64]) {
    for (i, x) in scratch.iter_mut().enumerate() {
        *x = x.wrapping_add(i as u64);
    }
    std::hint::black_box(scratch);
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Wall-clock and CPU (all threads of the process) seconds of `f`, after
/// evicting the cache. The CPU time leaves out time spent preempted, which
/// on a shared machine is most of the noise.
fn timed(scratch: &mut [u64], f: impl FnOnce()) -> (f64, f64) {
    evict(scratch);
    let (wall, cpu) = (Instant::now(), cpu_seconds());
    f();
    (wall.elapsed().as_secs_f64(), cpu_seconds() - cpu)
}

fn cpu_seconds() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec for the call to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Medians of (wall, cpu) samples, in milliseconds.
#[derive(Default)]
struct Samples(Vec<f64>, Vec<f64>);

impl Samples {
    fn push(&mut self, (wall, cpu): (f64, f64)) {
        self.0.push(wall);
        self.1.push(cpu);
    }

    fn wall(&self) -> f64 {
        1e3 * median(self.0.clone())
    }

    fn cpu(&self) -> f64 {
        1e3 * median(self.1.clone())
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args.get(1).map_or(5_000_000, |s| s.parse().expect("n"));
    let ratio: f64 = args.get(2).map_or(0.01, |s| s.parse().expect("ratio"));
    let iterations: usize = args.get(3).map_or(15, |s| s.parse().expect("iterations"));
    let pools: Vec<usize> = args.get(4).map_or(vec![1], |s| {
        s.split(',').map(|t| t.parse().expect("threads")).collect()
    });
    let ranks = 4;
    // A few steps' worth of gradients per rank, reused round robin.
    let steps: Vec<Vec<Vec<u8>>> = (0..ranks)
        .map(|r| {
            (0..3)
                .map(|s| gradient(n, (1 + 10 * r + s) as u64))
                .collect()
        })
        .collect();
    let mut scratch = vec![0u64; 8 << 20];
    for fp16 in [false, true] {
        let layout = TopKBlock::new(n, ratio, fp16, ranks);
        for &threads in &pools {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("pool");
            pool.install(|| {
                let mut residual_old = vec![vec![0u8; 4 * n]; ranks];
                let mut residual_new = residual_old.clone();
                let mut residual_floor = residual_old.clone();
                let mut gathered_old = vec![0u8; layout.bytes() * ranks];
                let mut gathered_new = gathered_old.clone();
                let mut dense_old = vec![0u8; 4 * n];
                let mut dense_new = dense_old.clone();
                let mut dense_floor = dense_old.clone();
                let (mut pack_old, mut pack_new, mut pack_floor) = <[Samples; 3]>::default().into();
                let (mut sum_old, mut sum_new, mut sum_floor) = <[Samples; 3]>::default().into();
                // Two warm-up steps, then the timed ones.
                for it in 0..iterations + 2 {
                    let keep = it >= 2;
                    for r in 0..ranks {
                        let data = &steps[r][it % 3];
                        let block = r * layout.bytes()..(r + 1) * layout.bytes();
                        let old = timed(&mut scratch, || {
                            baseline::pack(data, &mut residual_old[r], layout, &mut gathered_old[block.clone()])
                        });
                        let new = timed(&mut scratch, || {
                            pack(data, &mut residual_new[r], layout, &mut gathered_new[block])
                        });
                        let floor = timed(&mut scratch, || {
                            add_assign(floats_mut(&mut residual_floor[r]), floats(data))
                        });
                        if keep {
                            pack_old.push(old);
                            pack_new.push(new);
                            pack_floor.push(floor);
                        }
                    }
                    assert!(gathered_old == gathered_new, "pack output differs at step {it}");
                    assert!(residual_old == residual_new, "residuals differ at step {it}");
                    let old = timed(&mut scratch, || baseline::sum(&gathered_old, layout, &mut dense_old));
                    let new = timed(&mut scratch, || {
                        sum(&gathered_new, layout, &mut dense_new, |r| (r, format!("rank {r}"))).expect("sum")
                    });
                    assert!(dense_old == dense_new, "sum output differs at step {it}");
                    let floor = timed(&mut scratch, || {
                        floats_mut(&mut dense_floor).fill(0.0);
                        std::hint::black_box(&mut dense_floor);
                    });
                    if keep {
                        sum_old.push(old);
                        sum_new.push(new);
                        sum_floor.push(floor);
                    }
                }
                let values = if fp16 { "fp16" } else { "fp32" };
                println!(
                    "n={n} k={} values={values} threads={threads} (medians of {} packs, {} sums; wall ms [cpu ms])",
                    layout.k,
                    pack_new.0.len(),
                    sum_new.0.len(),
                );
                for (what, old, new, floor, floor_what) in [
                    ("pack", &pack_old, &pack_new, &pack_floor, "r += d"),
                    ("sum ", &sum_old, &sum_new, &sum_floor, "zero fill"),
                ] {
                    println!(
                        "  {what}: baseline {:7.2} [{:7.2}]  new {:6.2} [{:6.2}]  speedup {:5.1}x [{:5.1}x]  floor ({floor_what}) {:5.2} [{:5.2}]",
                        old.wall(),
                        old.cpu(),
                        new.wall(),
                        new.cpu(),
                        old.wall() / new.wall(),
                        old.cpu() / new.cpu(),
                        floor.wall(),
                        floor.cpu(),
                    );
                }
            });
        }
    }
}
