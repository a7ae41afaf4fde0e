//! Selecting the `k` entries of largest magnitude: the exact radix
//! selection, and the sampled threshold with the candidate scan that
//! adds the residual on the way.

/// The order of selection as an integer: `|v|` under [`f32::total_cmp`].
/// `abs` only clears the sign bit, and for floats without it (NaNs
/// included) the total order is the order of their bits as unsigned
/// integers.
#[inline]
pub(super) fn magnitude(v: f32) -> u32 {
    v.to_bits() & 0x7FFF_FFFF
}

/// Where a selection of the `k` largest magnitudes cuts, in index order:
/// every entry of a magnitude above `key`, and the first `ties` entries
/// (the lowest indices) of magnitude exactly `key`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Cut {
    key: u32,
    ties: usize,
}

impl Cut {
    /// The cut for the `k` largest of `keys` (reordered), `1 <= k <= len`.
    pub(super) fn among(keys: &mut [u32], k: usize) -> Cut {
        let (_, &mut key, _) = keys.select_nth_unstable(keys.len() - k);
        let above = keys.iter().filter(|&&m| m > key).count();
        Cut {
            key,
            ties: k - above,
        }
    }

    /// The cut for the `k` largest magnitudes of `values`, `1 <= k <=
    /// len`: radix selection on the magnitude bits (one counting pass on
    /// the high 16 bits, one on the low 15 bits of the bucket the cut
    /// falls in), without copying the values.
    pub(super) fn exact(values: &[f32], k: usize) -> Cut {
        let mut high = vec![0usize; 1 << 16];
        for &v in values {
            high[(magnitude(v) >> 15) as usize] += 1;
        }
        let (bucket, above_bucket) = from_top(&high, k);
        let mut low = vec![0usize; 1 << 15];
        for &v in values {
            let m = magnitude(v);
            if (m >> 15) as usize == bucket {
                low[(m & 0x7FFF) as usize] += 1;
            }
        }
        let (rest, above_rest) = from_top(&low, k - above_bucket);
        Cut {
            key: ((bucket << 15) | rest) as u32,
            ties: k - above_bucket - above_rest,
        }
    }

    /// Moves the entries the cut takes from `found` (in index order) to
    /// its front, in order; returns how many. Without branches on the data:
    /// whether an entry is taken is as good as random.
    pub(super) fn compact(mut self, found: &mut [(u32, f32)]) -> usize {
        let mut taken = 0;
        for q in 0..found.len() {
            let e = found[q];
            let m = magnitude(e.1);
            let tie = m == self.key;
            let take = (m > self.key) | (tie & (self.ties > 0));
            found[taken] = e;
            taken += take as usize;
            self.ties -= (tie & take) as usize;
        }
        taken
    }

    /// Whether the next entry in index order, of magnitude `m`, is taken.
    #[inline]
    pub(super) fn take(&mut self, m: u32) -> bool {
        if m > self.key {
            true
        } else if m == self.key && self.ties > 0 {
            self.ties -= 1;
            true
        } else {
            false
        }
    }
}

/// The highest bucket of `counts` at which the count from the top reaches
/// `k`, and the count in the buckets above it.
fn from_top(counts: &[usize], k: usize) -> (usize, usize) {
    let mut above = 0;
    for (bucket, &c) in counts.iter().enumerate().rev() {
        if above + c >= k {
            return (bucket, above);
        }
        above += c;
    }
    (0, above)
}

/// Indices of the `k` entries of largest magnitude, ascending; ties go to
/// the lower index. Linear time (radix selection), no sort.
pub fn top_k(values: &[f32], k: usize) -> Vec<u32> {
    let k = k.min(values.len());
    if k == 0 {
        return Vec::new();
    }
    let mut cut = Cut::exact(values, k);
    let mut chosen = Vec::with_capacity(k);
    for (i, &v) in values.iter().enumerate() {
        if cut.take(magnitude(v)) {
            chosen.push(i as u32);
        }
    }
    chosen
}

/// Entries per group of the candidate scan: one bit mask per group says
/// which are candidates.
const GROUP: usize = 64;
/// Candidates of a group written out without branching; more take a loop.
const STORED: usize = 4;
/// The threshold estimate samples this many runs of [`SAMPLE_RUN`]
/// consecutive entries (a cache line each, where aligned).
const SAMPLE_RUNS: usize = 1024;
const SAMPLE_RUN: usize = 16;

/// A well-mixed 64-bit hash (the splitmix64 finaliser).
pub(super) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A magnitude that, very likely, a little more than `k` entries of
/// `d + r` reach: the matching quantile of a sample, lowered by a margin of
/// six standard deviations. Only speed depends on it: the selection is
/// exact whatever it returns.
pub(super) fn estimate(d: &[f32], r: &[f32], k: usize) -> u32 {
    let n = r.len();
    let span = n / SAMPLE_RUNS;
    let mut sample: Vec<u32>;
    let want = if span < 4 * SAMPLE_RUN {
        sample = d.iter().zip(r).map(|(x, y)| magnitude(x + y)).collect();
        k
    } else {
        sample = Vec::with_capacity(SAMPLE_RUNS * SAMPLE_RUN);
        for j in 0..SAMPLE_RUNS {
            // A run at a pseudo-random place in each span, so that data
            // with a period does not bias the sample.
            let start = j * span + (mix(j as u64) % (span - SAMPLE_RUN + 1) as u64) as usize;
            let run = start..start + SAMPLE_RUN;
            sample.extend(
                d[run.clone()]
                    .iter()
                    .zip(&r[run])
                    .map(|(x, y)| magnitude(x + y)),
            );
        }
        let expected = sample.len() as f64 * k as f64 / n as f64;
        (expected + 6.0 * expected.sqrt() + 8.0).ceil() as usize
    };
    let s = sample.len();
    if want == 0 || s == 0 {
        return 0;
    }
    let (_, &mut t, _) = sample.select_nth_unstable(s - want.min(s));
    t
}

/// `r = d + r`. (Operand order does not matter: addition commutes, except
/// for which payload NaN + NaN carries, which no compiler promises.)
pub(super) fn add(d: &[f32], r: &mut [f32]) {
    for (x, y) in d.iter().zip(r) {
        *y += *x;
    }
}

/// `r = d + r` over one group (at most 64 entries), and the mask of its
/// entries of magnitude at least `t` (bit `j` for entry `j`), `t <= 2^31`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn add_mask(d: &[f32], r: &mut [f32], t: u32) -> u64 {
    use std::arch::x86_64::{
        _mm_add_ps, _mm_and_si128, _mm_castps_si128, _mm_castsi128_ps, _mm_cmpgt_epi32,
        _mm_loadu_ps, _mm_movemask_ps, _mm_set1_epi32, _mm_storeu_ps,
    };
    let mut mask = 0u64;
    let mut quads = d.chunks_exact(4).zip(r.chunks_exact_mut(4));
    // SAFETY: SSE and SSE2 are part of every x86_64 target. Each load and
    // store covers exactly the 4 floats of one chunk of length 4 (unaligned
    // accesses are allowed), and the chunks of `r` are exclusive borrows.
    unsafe {
        // Magnitudes are below 2^31, so a signed comparison with t - 1
        // (at least -1) is `magnitude >= t`.
        let below = _mm_set1_epi32((t as i32).wrapping_sub(1));
        let no_sign = _mm_set1_epi32(0x7FFF_FFFF);
        for (q, (x, y)) in (&mut quads).enumerate() {
            let v = _mm_add_ps(_mm_loadu_ps(x.as_ptr()), _mm_loadu_ps(y.as_ptr()));
            _mm_storeu_ps(y.as_mut_ptr(), v);
            let hit = _mm_cmpgt_epi32(_mm_and_si128(_mm_castps_si128(v), no_sign), below);
            mask |= (_mm_movemask_ps(_mm_castsi128_ps(hit)) as u64) << (4 * q);
        }
    }
    let done = d.len() / 4 * 4;
    let rest = d[done..].iter().zip(&mut r[done..]);
    for (j, (x, y)) in (done..).zip(rest) {
        *y += *x;
        mask |= ((magnitude(*y) >= t) as u64) << j;
    }
    mask
}

/// [`add_mask`] without vector instructions (other targets, and the
/// tests, which compare the two).
#[cfg(any(test, not(target_arch = "x86_64")))]
#[inline(always)]
pub(super) fn add_mask_portable(d: &[f32], r: &mut [f32], t: u32) -> u64 {
    let mut mask = 0u64;
    for (j, (x, y)) in d.iter().zip(r).enumerate() {
        *y += *x;
        mask |= ((magnitude(*y) >= t) as u64) << j;
    }
    mask
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) use add_mask_portable as add_mask;

/// `r = d + r`, collecting (index, value) of the entries of magnitude at
/// least `t`, in index order, into `found[..len]`; the `len`, or `None`
/// when there are more than `cap`. `found` is grown as needed and left
/// at its full length for the next call (rewriting it costs time).
pub(super) fn add_collect(
    d: &[f32],
    r: &mut [f32],
    t: u32,
    cap: usize,
    found: &mut Vec<(u32, f32)>,
) -> Option<usize> {
    // Magnitudes are below 2^31: any larger threshold means none.
    let t = t.min(1 << 31);
    // Room for a whole group past `cap`: a group writes its first STORED
    // slots whether or not it has that many candidates.
    if found.len() < cap + GROUP {
        found.resize(cap + GROUP, (0, 0.0));
    }
    let mut len = 0;
    let mut groups = d.chunks(GROUP).zip(r.chunks_mut(GROUP)).enumerate();
    for (g, (dc, rc)) in &mut groups {
        let mask = add_mask(dc, rc, t);
        let (base, last) = (g * GROUP, rc.len() - 1);
        let slots = &mut found[len..len + GROUP];
        let mut m = mask;
        for slot in &mut slots[..STORED] {
            // Past the last candidate this writes a junk slot, overwritten
            // later or beyond the final length.
            let j = (m.trailing_zeros() as usize).min(last);
            *slot = ((base + j) as u32, rc[j]);
            m &= m.wrapping_sub(1);
        }
        for slot in &mut slots[STORED..] {
            if m == 0 {
                break;
            }
            let j = m.trailing_zeros() as usize;
            *slot = ((base + j) as u32, rc[j]);
            m &= m - 1;
        }
        len += mask.count_ones() as usize;
        if len > cap {
            for (_, (dc, rc)) in groups {
                add(dc, rc);
            }
            return None;
        }
    }
    Some(len)
}
