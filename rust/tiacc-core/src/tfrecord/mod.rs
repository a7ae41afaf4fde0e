//! TFRecord files exactly as TensorFlow writes them, `tf.train.Example`
//! payloads, index files, and the sharded writer used by the packing tools.
//! Nothing here decodes or inspects images (packing images is `crate::pack`).
//!
//! A record on disk is:
//!
//! ```text
//! u64 little-endian payload length
//! u32 masked CRC32C of those 8 length bytes
//! payload bytes
//! u32 masked CRC32C of the payload
//! ```

pub mod build_index;
pub mod crc;
pub mod example;
pub mod index;
pub mod record;
pub mod verify;
pub mod writer;
