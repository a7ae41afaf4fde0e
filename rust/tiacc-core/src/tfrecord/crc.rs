//! CRC32C (Castagnoli) and TensorFlow's CRC masking.
//!
//! TFRecord stores `mask(crc32c(bytes))` rather than the raw checksum, so
//! that a CRC computed over data that itself contains CRCs stays robust.

const MASK_DELTA: u32 = 0xa282_ead8;

/// Plain CRC32C of `data` (hardware accelerated where the CPU allows).
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

/// TensorFlow's mask: rotate right by 15 bits, then add a constant.
pub fn mask(crc: u32) -> u32 {
    crc.rotate_right(15).wrapping_add(MASK_DELTA)
}

/// Inverse of [`mask`].
pub fn unmask(masked: u32) -> u32 {
    masked.wrapping_sub(MASK_DELTA).rotate_left(15)
}

/// `mask(crc32c(data))`, the value TFRecord writes.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    mask(crc32c(data))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn castagnoli_check_value() {
        // The standard check value of CRC-32C (iSCSI): a different polynomial
        // from zlib's CRC-32, whose check value is 0xCBF43926.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn rfc3720_vectors() {
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
        let ascending: Vec<u8> = (0u8..32).collect();
        assert_eq!(crc32c(&ascending), 0x46DD_794E);
    }

    #[test]
    fn mask_roundtrip_and_known_value() {
        for crc in [0u32, 1, 0xdead_beef, u32::MAX, 0xE306_9283] {
            assert_eq!(unmask(mask(crc)), crc);
        }
        // rotate_right(0xE3069283, 15) = 0x2507C60D; + 0xa282ead8 = 0xC78AB0E5.
        assert_eq!(masked_crc32c(b"123456789"), 0xC78A_B0E5);
    }
}
