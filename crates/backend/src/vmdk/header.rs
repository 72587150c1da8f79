//! The hosted sparse extent header (`KDMV`, 512 bytes at the start of a sparse extent file,
//! and for streamOptimized images a copy in the footer that holds the real grain directory
//! offset). Every field is checked before anything is sized or read from it.

use crate::fields::{le16, le32, le64};

/// `KDMV` as a little-endian u32 at offset 0.
pub const MAGIC: u32 = 0x564d_444b;

/// A grain directory offset of "in the footer" (streamOptimized images written as a stream).
pub const GD_AT_END: u64 = u64::MAX;

/// flags: the redundant grain directory and tables are kept.
pub const FLAG_REDUNDANT: u32 = 1 << 1;
/// flags: a grain table entry of 1 means "reads as zeroes".
pub const FLAG_ZEROED_GRAIN: u32 = 1 << 2;
/// flags: grains are compressed (streamOptimized).
pub const FLAG_COMPRESSED: u32 = 1 << 16;
/// flags: metadata is preceded by markers (streamOptimized).
pub const FLAG_MARKERS: u32 = 1 << 17;

/// The largest grain, in sectors (64 MiB; VMware's grains are 64 KiB).
pub const MAX_GRAIN_SECTORS: u64 = 1 << 17;
/// The most entries one grain table may have (VMware and QEMU write 512).
pub const MAX_GTES: u32 = 1 << 16;
/// The fewest: fewer would make the grain directory (held in memory at open, one entry per
/// table) as large as the grain table entries themselves.
pub const MIN_GTES: u32 = 64;
/// The largest compressed grain, in sectors: each read of one inflates it whole into memory.
pub const MAX_COMPRESSED_GRAIN_SECTORS: u64 = 2048;

/// A checked header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// 1, 2 or 3.
    pub version: u32,
    /// See the `FLAG_*` constants.
    pub flags: u32,
    /// The extent's size in sectors.
    pub capacity: u64,
    /// Sectors per grain (a power of two).
    pub grain: u64,
    /// Where the embedded descriptor is, in sectors (0: none).
    pub desc_offset: u64,
    /// Its size in sectors.
    pub desc_size: u64,
    /// Entries per grain table.
    pub gtes: u32,
    /// The redundant grain directory, in sectors.
    pub rgd_offset: u64,
    /// The grain directory, in sectors ([`GD_AT_END`]: see the footer).
    pub gd_offset: u64,
    /// Sectors of metadata at the file's start (grain data follows).
    pub overhead: u64,
    /// 1: deflate.
    pub compression: u16,
}

/// Whether `b` starts with the sparse extent magic.
pub fn is_sparse(b: &[u8]) -> bool {
    b.len() >= 4 && le32(b, 0) == MAGIC
}

impl Header {
    /// Parses and checks the header in `b` (at least 512 bytes).
    pub fn parse(b: &[u8]) -> Result<Header, String> {
        if b.len() < 512 || !is_sparse(b) {
            return Err("no sparse extent header (KDMV) at its start".into());
        }
        let h = Header {
            version: le32(b, 4),
            flags: le32(b, 8),
            capacity: le64(b, 12),
            grain: le64(b, 20),
            desc_offset: le64(b, 28),
            desc_size: le64(b, 36),
            gtes: le32(b, 44),
            rgd_offset: le64(b, 48),
            gd_offset: le64(b, 56),
            overhead: le64(b, 64),
            compression: le16(b, 77),
        };
        if !(1..=3).contains(&h.version) {
            return Err(format!(
                "sparse extent version {} (fusex reads 1 to 3)",
                h.version
            ));
        }
        if h.grain == 0 || !h.grain.is_power_of_two() || h.grain > MAX_GRAIN_SECTORS {
            return Err(format!(
                "a grain of {} sectors (a power of two up to {MAX_GRAIN_SECTORS} expected)",
                h.grain
            ));
        }
        if !(MIN_GTES..=MAX_GTES).contains(&h.gtes) {
            return Err(format!(
                "{} entries per grain table ({MIN_GTES} to {MAX_GTES} expected)",
                h.gtes
            ));
        }
        if h.flags & FLAG_COMPRESSED != 0 && h.grain > MAX_COMPRESSED_GRAIN_SECTORS {
            return Err(format!(
                "compressed grains of {} sectors (fusex inflates grains of up to 1 MiB)",
                h.grain
            ));
        }
        if h.capacity > super::descriptor::MAX_SECTORS {
            return Err(format!(
                "a capacity of {} sectors, more than a disk can hold",
                h.capacity
            ));
        }
        if h.flags & FLAG_COMPRESSED != 0 && h.compression != 1 {
            return Err(format!(
                "compression algorithm {} (only deflate, 1, exists)",
                h.compression
            ));
        }
        if h.desc_size > super::descriptor::MAX_DESCRIPTOR >> 9 {
            return Err(format!(
                "an embedded descriptor of {} sectors, more than fusex reads",
                h.desc_size
            ));
        }
        Ok(h)
    }

    /// Bytes per grain.
    pub fn grain_bytes(&self) -> u64 {
        self.grain << 9
    }

    /// Guest bytes one grain table covers.
    pub fn gt_coverage(&self) -> u64 {
        self.grain_bytes() * self.gtes as u64
    }

    /// Grains in the extent (the last may be partial).
    pub fn grains(&self) -> u64 {
        self.capacity.div_ceil(self.grain)
    }

    /// Entries of the grain directory.
    pub fn gdes(&self) -> u64 {
        self.grains().div_ceil(self.gtes as u64)
    }

    /// Bytes of one grain table on disk.
    pub fn gt_bytes(&self) -> u64 {
        self.gtes as u64 * 4
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A header as qemu-img writes one for a 1 GiB monolithicSparse image.
    pub fn header_bytes() -> Vec<u8> {
        let mut b = vec![0u8; 512];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&1u32.to_le_bytes());
        b[8..12].copy_from_slice(&3u32.to_le_bytes());
        b[12..20].copy_from_slice(&(2u64 << 20).to_le_bytes());
        b[20..28].copy_from_slice(&128u64.to_le_bytes());
        b[28..36].copy_from_slice(&1u64.to_le_bytes());
        b[36..44].copy_from_slice(&20u64.to_le_bytes());
        b[44..48].copy_from_slice(&512u32.to_le_bytes());
        b[48..56].copy_from_slice(&21u64.to_le_bytes());
        b[56..64].copy_from_slice(&50u64.to_le_bytes());
        b[64..72].copy_from_slice(&128u64.to_le_bytes());
        b
    }

    #[test]
    fn a_good_header() {
        let h = Header::parse(&header_bytes()).unwrap();
        assert_eq!(h.grain_bytes(), 64 << 10);
        assert_eq!(h.grains(), 16384);
        assert_eq!(h.gdes(), 32);
        assert_eq!(h.gt_coverage(), 32 << 20);
    }

    #[test]
    fn hostile_headers() {
        let set = |at: usize, v: &[u8]| {
            let mut b = header_bytes();
            b[at..at + v.len()].copy_from_slice(v);
            Header::parse(&b).unwrap_err()
        };
        assert!(set(20, &96u64.to_le_bytes()).contains("power of two"));
        assert!(set(20, &0u64.to_le_bytes()).contains("power of two"));
        assert!(set(20, &(1u64 << 40).to_le_bytes()).contains("power of two"));
        assert!(set(12, &u64::MAX.to_le_bytes()).contains("capacity"));
        assert!(set(44, &0u32.to_le_bytes()).contains("grain table"));
        assert!(set(44, &u32::MAX.to_le_bytes()).contains("grain table"));
        assert!(set(44, &16u32.to_le_bytes()).contains("grain table"));
        let mut b = header_bytes();
        b[8..12].copy_from_slice(&(FLAG_COMPRESSED).to_le_bytes());
        b[77] = 1;
        b[20..28].copy_from_slice(&4096u64.to_le_bytes());
        assert!(Header::parse(&b).unwrap_err().contains("compressed grains"));
        assert!(set(4, &7u32.to_le_bytes()).contains("version"));
        assert!(set(36, &u64::MAX.to_le_bytes()).contains("descriptor"));
        assert!(set(0, b"XXXX").contains("KDMV"));
        assert!(Header::parse(&[0u8; 10]).is_err());
    }
}
