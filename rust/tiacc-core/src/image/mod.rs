//! Images: header probing, and decoding to RGB pixels.

pub mod decode;
pub mod fused;
pub mod jpeg;
pub mod probe;
pub mod resample;
#[cfg(test)]
pub(crate) mod testing;
