//! Fixed-width integer fields of on-disk structures (image headers, block tables, partition
//! tables), read at a byte offset the caller has checked lies inside the buffer: one copy of
//! these readers for every format instead of one per parser.

/// The little-endian u16 at `at`.
pub(crate) fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// The little-endian u32 at `at`.
pub(crate) fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The little-endian u64 at `at`.
pub(crate) fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(eight(b, at))
}

/// The big-endian u16 at `at`.
pub(crate) fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

/// The big-endian u32 at `at`.
pub(crate) fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The big-endian u64 at `at`.
pub(crate) fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(eight(b, at))
}

fn eight(b: &[u8], at: usize) -> [u8; 8] {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_read_in_their_byte_order() {
        let b: Vec<u8> = (1..=10).collect();
        assert_eq!(le16(&b, 1), 0x0302);
        assert_eq!(be16(&b, 1), 0x0203);
        assert_eq!(le32(&b, 0), 0x0403_0201);
        assert_eq!(be32(&b, 0), 0x0102_0304);
        assert_eq!(le64(&b, 2), 0x0a09_0807_0605_0403);
        assert_eq!(be64(&b, 2), 0x0304_0506_0708_090a);
    }
}
