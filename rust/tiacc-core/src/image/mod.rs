//! Images: header probing, and decoding to RGB pixels.

pub mod decode;
pub mod fused;
pub mod jpeg;
pub mod probe;
pub mod resample;
