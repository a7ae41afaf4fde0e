//! The Top-K pack's last step as first written: the chosen entries go out
//! (indices, then values) and what was not sent stays behind. The kernels
//! are checked against it (`tests.rs`) and timed against it
//! (`examples/topk_kernels.rs`, which takes this file by path), so it names
//! nothing of the crate.

use half::f16;

/// Writes the entries `chosen` of `corrected` into the Top-K block `out`:
/// the indices (u32, little-endian) from the start, the values (float16
/// when `fp16_values`, else float32, little-endian) from `values_offset`.
/// Each chosen entry of `corrected` keeps what rounding to the wire lost
/// (the error feedback). The rest of `out` is left as it is.
pub fn write_chosen(
    corrected: &mut [f32],
    chosen: &[u32],
    fp16_values: bool,
    out: &mut [u8],
    values_offset: usize,
) {
    let (indices, values) = out.split_at_mut(values_offset);
    for (j, &i) in chosen.iter().enumerate() {
        indices[j * 4..j * 4 + 4].copy_from_slice(&i.to_le_bytes());
        let v = corrected[i as usize];
        let sent = if fp16_values {
            let h = f16::from_f32(v);
            values[j * 2..j * 2 + 2].copy_from_slice(&h.to_le_bytes());
            h.to_f32()
        } else {
            values[j * 4..j * 4 + 4].copy_from_slice(&v.to_le_bytes());
            v
        };
        corrected[i as usize] = v - sent;
    }
}
