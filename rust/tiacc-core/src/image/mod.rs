//! Images: header probing, decoding to RGB pixels, and the fused path
//! (each image's geometry drawn, then rendered in one pass).

pub mod decode;
pub mod fused;
pub mod jpeg;
pub mod probe;
pub mod resample;
pub mod sampling;
#[cfg(test)]
pub(crate) mod testing;
