//! VDI images (VirtualBox), static and dynamic, served through the block-table core
//! ([`crate::blocktable`]).
//!
//! The on-disk format, as fusex reads and writes it (all fields little-endian):
//!
//! - **Header**, the first 512 bytes: a text line (0..64), signature `0xbeda107f` (64), version
//!   (68: 1.1 as `0x00010001`), image type (76: 1 dynamic, 2 static; 3 undo and 4 differencing
//!   are not served), block map offset (340, u32), data offset (344, u32), sector size (360,
//!   512), disk size (368, u64), block size (376, u32), extra bytes per block (380, u32: 0),
//!   blocks in the image (384, u32), blocks allocated (388, u32), the image's UUIDs (392..456:
//!   a non-null link or parent UUID makes a differencing image).
//! - **Block map** at its offset: one u32 per block, the index of its data block
//!   (`0xFFFFFFFF` unallocated, `0xFFFFFFFE` discarded: both read as zeroes).
//! - **Data**: data block `k` at `data offset + k × block size`.
//!
//! A new block takes the next index past every block in use: [`BlockFormat::reserve`] extends
//! the file over it, the core writes the data, then [`BlockFormat::commit`] writes its block map
//! entry and then the header's count of allocated blocks (which `qemu-img check` compares with
//! the map).

use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::blocktable::{
    self, BlockFormat, Entry, Layout, ParseError, Table, TableImage, MAX_ENTRIES,
};
use crate::fields::{le32, le64};
use crate::lock::Locking;
use crate::ringfile::RingFile;
use crate::OpenError;

/// The signature at offset 64 (for `--format auto`).
pub const VDI_SIGNATURE: u32 = 0xbeda_107f;
const SIGNATURE_AT: u64 = 64;
const VERSION_1_1: u32 = 0x0001_0001;
const TYPE_DYNAMIC: u32 = 1;
const TYPE_STATIC: u32 = 2;
const HEADER_LEN: usize = 512;
const SECTOR: u64 = 512;
const UNALLOCATED: u32 = 0xffff_ffff;
const DISCARDED: u32 = 0xffff_fffe;
/// Where the header keeps its count of allocated blocks.
const ALLOCATED_AT: u64 = 388;

/// Whether the file at `path` carries the VDI signature.
pub fn probe(path: &Path) -> io::Result<bool> {
    let f = std::fs::File::open(path)?;
    let mut b = [0u8; 4];
    match f.read_exact_at(&mut b, SIGNATURE_AT) {
        Ok(()) => Ok(u32::from_le_bytes(b) == VDI_SIGNATURE),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

/// What fusex uses of a header.
#[derive(Debug, PartialEq, Eq)]
struct Header {
    image_type: u32,
    offset_bmap: u64,
    offset_data: u64,
    /// Guest size in bytes (whole sectors, as QEMU counts it).
    size: u64,
    block_size: u64,
    blocks: u32,
}

fn parse_header(b: &[u8; HEADER_LEN]) -> Result<Header, String> {
    let sig = le32(b, 64);
    if sig != VDI_SIGNATURE {
        return Err(format!(
            "no VDI signature (found {sig:#010x}): check the path, or use --format raw"
        ));
    }
    let version = le32(b, 68);
    if version != VERSION_1_1 {
        return Err(format!(
            "it is VDI version {}.{}, fusex serves 1.1",
            version >> 16,
            version & 0xffff
        ));
    }
    let image_type = le32(b, 76);
    let null = |o: usize| b[o..o + 16].iter().all(|&x| x == 0);
    if image_type == 4 || !null(424) || !null(440) {
        return Err(
            "it is a differencing image (its data depends on a parent image), which \
                    fusex does not serve: make a standalone copy with `qemu-img convert -O vdi`"
                .into(),
        );
    }
    if image_type != TYPE_DYNAMIC && image_type != TYPE_STATIC {
        return Err(format!(
            "its image type {image_type} is neither dynamic (1) nor static (2)"
        ));
    }
    let (offset_bmap, offset_data) = (u64::from(le32(b, 340)), u64::from(le32(b, 344)));
    if !offset_bmap.is_multiple_of(SECTOR) || !offset_data.is_multiple_of(SECTOR) {
        return Err(format!(
            "its block map ({offset_bmap:#x}) or data ({offset_data:#x}) offset is not a \
             multiple of 512: the header is corrupt"
        ));
    }
    let sector_size = le32(b, 360);
    if u64::from(sector_size) != SECTOR {
        return Err(format!("its sector size {sector_size} is not 512"));
    }
    let block_size = u64::from(le32(b, 376));
    blocktable::check_block_size(block_size)?;
    let extra = le32(b, 380);
    if extra != 0 {
        return Err(format!(
            "its blocks carry {extra} extra bytes each, which fusex does not support"
        ));
    }
    let blocks = le32(b, 384);
    let disk_size = le64(b, 368);
    let room = u64::from(blocks) * block_size;
    if disk_size > room {
        return Err(format!(
            "its disk size {disk_size} is more than its {blocks} blocks hold ({room}): the \
             header is corrupt"
        ));
    }
    Ok(Header {
        image_type,
        offset_bmap,
        offset_data,
        size: disk_size / SECTOR * SECTOR,
        block_size,
        blocks,
    })
}

/// A VDI image's layout, for the block-table core.
pub struct Vdi {
    offset_bmap: u64,
    offset_data: u64,
    block_size: u64,
    blocks: u32,
    /// Blocks mapped: what the header's count says once the map is written. Held while the
    /// count is written, so the last write carries the highest count.
    allocated: tokio::sync::Mutex<u32>,
}

/// A VDI image being served.
pub type VdiBackend = TableImage<Vdi>;

impl BlockFormat for Vdi {
    fn name(&self) -> &'static str {
        "vdi"
    }

    fn footprint(&self) -> u64 {
        self.block_size
    }

    async fn reserve(&self, file: &RingFile, host: u64, end: u64) -> io::Result<bool> {
        let index = host
            .checked_sub(self.offset_data)
            .map(|d| d / self.block_size);
        if index.is_none_or(|k| k >= u64::from(self.blocks)) {
            // The block map cannot name a block there.
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        let old_len = file.file().metadata()?.len();
        file.extend_to(end)?;
        Ok(host >= old_len)
    }

    async fn commit(&self, file: &RingFile, block: u64, host: u64) -> io::Result<Entry> {
        let index = u32::try_from(host.saturating_sub(self.offset_data) / self.block_size)
            .map_err(|_| io::Error::from_raw_os_error(libc::ENOSPC))?;
        file.write_full(&index.to_le_bytes(), self.offset_bmap + 4 * block)
            .await?;
        let mut n = self.allocated.lock().await;
        *n += 1;
        file.write_full(&n.to_le_bytes(), ALLOCATED_AT).await?;
        Ok(Entry::Data { host, flags: 0 })
    }
}

/// Opens the VDI image at `path`, locked as QEMU's `vdi` driver locks it.
pub fn open(path: &Path, writable: bool, locking: Locking) -> Result<VdiBackend, OpenError> {
    blocktable::open_image(path, writable, locking, "vdi", parse)
}

/// Reads `f` (of `len` bytes) as a VDI image: its layout and block table.
fn parse(f: &std::fs::File, len: u64, writable: bool) -> Result<(Vdi, Table, Layout), ParseError> {
    blocktable::at_least(len, HEADER_LEN as u64, "a VDI header")?;
    let mut hb = [0u8; HEADER_LEN];
    f.read_exact_at(&mut hb, 0)?;
    let h = parse_header(&hb)?;
    let blocks = u64::from(h.blocks);
    if blocks > MAX_ENTRIES {
        return Err(blocktable::TooLarge { entries: blocks }.into());
    }
    let map_len = (blocks * 4).next_multiple_of(SECTOR);
    if h.offset_bmap < HEADER_LEN as u64
        || h.offset_bmap + blocks * 4 > len
        || h.offset_data < h.offset_bmap + map_len
    {
        return Err(format!(
            "its block map at {:#x} lies outside the file, over the header or over the data at \
             {:#x}: the header is corrupt",
            h.offset_bmap, h.offset_data
        )
        .into());
    }
    let table = Table::new(blocks)?;
    let mut raw = vec![0u8; (blocks * 4) as usize];
    f.read_exact_at(&mut raw, h.offset_bmap)?;
    // Which block each data index is used by, to find two blocks sharing one.
    let mut users: Vec<(u32, u32)> = Vec::new();
    let mut bad = Vec::new();
    for (i, w) in raw.chunks_exact(4).enumerate() {
        let i = i as u64;
        match le32(w, 0) {
            UNALLOCATED => {}
            DISCARDED => table.set(i, Entry::Zero),
            k => {
                let host = h.offset_data + u64::from(k) * h.block_size;
                if k >= h.blocks || host + h.block_size > len {
                    table.set(i, Entry::Bad);
                    bad.push(i);
                } else {
                    // `i` fits 32 bits: the table holds at most `MAX_ENTRIES`.
                    users.push((k, i as u32));
                }
            }
        }
    }
    // Data blocks are `block_size` apart: two blocks share one when their indexes are equal.
    bad.extend(blocktable::sharing(&mut users, h.block_size, h.block_size));
    let mut next = 0u64;
    let mut count = 0u32;
    for &(k, i) in &users {
        table.set(
            u64::from(i),
            Entry::Data {
                host: h.offset_data + u64::from(k) * h.block_size,
                flags: 0,
            },
        );
        next = next.max(u64::from(k) + 1);
        count += 1;
    }
    let what = |first| {
        format!(
            "the block map entry of block {first} points past the image's data blocks or at a \
             data block another block uses"
        )
    };
    blocktable::settle_bad(&table, bad, writable, "vdi", what, "qemu-img check -r all")?;
    tracing::debug!(
        static_image = h.image_type == TYPE_STATIC,
        blocks = h.blocks,
        allocated = count,
        "vdi block map"
    );
    Ok((
        Vdi {
            offset_bmap: h.offset_bmap,
            offset_data: h.offset_data,
            block_size: h.block_size,
            blocks: h.blocks,
            allocated: tokio::sync::Mutex::new(count),
        },
        table,
        Layout {
            block_shift: h.block_size.trailing_zeros(),
            size: h.size,
            next_free: h.offset_data + next * h.block_size,
            writable,
        },
    ))
}

#[cfg(test)]
mod tests;
