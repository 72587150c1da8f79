//! VHD images (Virtual PC / Hyper-V "VHD", QEMU's `vpc` driver), fixed and dynamic, served
//! through the block-table core ([`crate::blocktable`]).
//!
//! The on-disk format, as fusex reads and writes it (all fields big-endian):
//!
//! - **Footer**, 512 bytes, the last sector of the file; a dynamic image also keeps a copy in
//!   its first sector. Cookie `conectix` (0), data offset (16, u64: where the dynamic header is),
//!   creator application (28, 4 bytes), current size (48, u64), geometry (56: cylinders u16,
//!   heads u8, sectors per track u8), disk type (60, u32: 2 fixed, 3 dynamic, 4 differencing),
//!   checksum (64, u32: the one's complement of the sum of all other bytes).
//! - **Dynamic header**, 1024 bytes at the footer's data offset: cookie `cxsparse` (0), table
//!   offset (16, u64: the BAT), max table entries (28, u32), block size (32, u32), checksum (36,
//!   u32, as the footer's).
//! - **BAT**: one u32 per block, the block's first sector in the file, `0xFFFFFFFF` when
//!   unallocated. An allocated block is its sector bitmap (one bit per sector, most significant
//!   bit first, padded to whole sectors) followed by its data. A sector whose bit is clear reads
//!   as zeroes.
//!
//! The disk's size follows QEMU: the footer's current size for images made by Hyper-V,
//! Disk2vhd, XenServer/XenConverter and QEMU's `force_size` (creator `win `, `d2v `, `tap\0`,
//! `CTXS`, `qem2`) or with the largest CHS geometry, otherwise cylinders × heads × sectors
//! (what Virtual PC and QEMU's default `vpc` images use); at most 2040 GiB.
//!
//! A fixed image is its data then the footer: a block table whose every entry maps the block
//! to the same file offset. A dynamic image allocates a block on the first write into it:
//! [`BlockFormat::reserve`] writes the footer after the new block (the file's last sector is a
//! valid footer at every moment), [`BlockFormat::prepare`] writes the block's bitmap with every
//! bit set (the block's data area is fresh file space, which reads as zeroes), then the data,
//! then [`BlockFormat::commit`] writes the BAT entry. A block whose bitmap is not known to be
//! full (images made elsewhere) reads its bitmap and serves clear sectors as zeroes; a write
//! there zeroes the rest of any clear sector it covers in part, writes the data, then sets the
//! bits.

use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::blocktable::{self, BlockFormat, Entry, Layout, ParseError, Table, TableImage};
use crate::fields::{be16, be32, be64};
use crate::lock::Locking;
use crate::ringfile::RingFile;
use crate::OpenError;

/// The footer's cookie: a dynamic image starts with it (for `--format auto`).
pub const VHD_COOKIE: [u8; 8] = *b"conectix";
const DYNAMIC_COOKIE: [u8; 8] = *b"cxsparse";

const SECTOR: u64 = 512;
const FOOTER_LEN: usize = 512;
const HEADER_LEN: usize = 1024;
const DISK_FIXED: u32 = 2;
const DISK_DYNAMIC: u32 = 3;
const DISK_DIFFERENCING: u32 = 4;
/// QEMU's limit: 2040 GiB.
const MAX_SECTORS: u64 = 0xff00_0000;
/// The largest CHS geometry (65535 cylinders, 16 heads, 255 sectors per track).
const MAX_GEOMETRY: u64 = 65535 * 16 * 255;
/// BAT value of an unallocated block.
const UNALLOCATED: u32 = 0xffff_ffff;
/// Flag of a block whose bitmap has not been read yet.
const BITMAP_UNKNOWN: u8 = 1;
/// Flag of a block whose bitmap has clear bits.
const BITMAP_PARTIAL: u8 = 2;
/// A fixed image is mapped in blocks of at least this (2 MiB), more for huge images so the
/// table stays at most 64 Ki entries.
const FIXED_MIN_SHIFT: u32 = 21;
const FIXED_MAX_ENTRIES: u64 = 1 << 16;

/// Creator applications whose images give their size in the footer's current size field.
const SIZE_FROM_FOOTER: [&[u8; 4]; 5] = [b"win ", b"qem2", b"d2v ", b"CTXS", b"tap\0"];

/// Whether the file at `path` starts with a VHD footer copy (dynamic and differencing images:
/// a fixed image has its footer only at the end and is not probed, as QEMU does not).
pub fn probe(path: &Path) -> io::Result<bool> {
    let f = std::fs::File::open(path)?;
    let mut magic = [0u8; 8];
    match f.read_exact_at(&mut magic, 0) {
        Ok(()) => Ok(magic == VHD_COOKIE),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

/// The one's complement of the sum of every byte of `b` outside `skip..skip + 4`.
fn checksum(b: &[u8], skip: usize) -> u32 {
    let sum = b
        .iter()
        .enumerate()
        .filter(|(i, _)| !(skip..skip + 4).contains(i))
        .fold(0u32, |s, (_, &x)| s.wrapping_add(u32::from(x)));
    !sum
}

/// Checks the `what` (`part` in the advice) held in `b`: that it starts with `cookie` (else
/// `missing`) and its checksum at `at`.
fn check_sum(
    b: &[u8],
    cookie: &[u8; 8],
    missing: &str,
    at: usize,
    what: &str,
    part: &str,
) -> Result<(), String> {
    if b[..8] != *cookie {
        return Err(missing.into());
    }
    let stored = be32(b, at);
    let computed = checksum(b, at);
    if stored != computed {
        return Err(format!(
            "its {what} checksum is wrong (stored {stored:#010x}, computed {computed:#010x}): \
             the {part} is damaged"
        ));
    }
    Ok(())
}

/// What fusex uses of a footer.
#[derive(Debug, PartialEq, Eq)]
struct Footer {
    disk_type: u32,
    /// Guest size in bytes.
    size: u64,
    data_offset: u64,
}

fn parse_footer(b: &[u8; FOOTER_LEN]) -> Result<Footer, String> {
    let missing = "no VHD footer cookie";
    check_sum(b, &VHD_COOKIE, missing, 64, "footer", "footer")?;
    let chs = u64::from(be16(b, 56)) * u64::from(b[58]) * u64::from(b[59]);
    let creator: &[u8; 4] = b[28..32].try_into().unwrap_or(&[0; 4]);
    let sectors = if chs == MAX_GEOMETRY || SIZE_FROM_FOOTER.contains(&creator) {
        be64(b, 48) / SECTOR
    } else {
        chs
    };
    if sectors > MAX_SECTORS {
        return Err(format!(
            "its footer gives a disk of {} bytes, more than VHD's 2040 GiB: the footer is \
             corrupt",
            u128::from(sectors) * 512
        ));
    }
    Ok(Footer {
        disk_type: be32(b, 60),
        size: sectors * SECTOR,
        data_offset: be64(b, 16),
    })
}

/// What fusex uses of a dynamic header.
#[derive(Debug, PartialEq, Eq)]
struct DynHeader {
    table_offset: u64,
    max_entries: u32,
    block_size: u64,
}

fn parse_header(b: &[u8; HEADER_LEN]) -> Result<DynHeader, String> {
    let missing = "no dynamic header (cookie 'cxsparse') where the footer points";
    check_sum(b, &DYNAMIC_COOKIE, missing, 36, "dynamic header", "header")?;
    let block_size = u64::from(be32(b, 32));
    blocktable::check_block_size(block_size)?;
    Ok(DynHeader {
        table_offset: be64(b, 16),
        max_entries: be32(b, 28),
        block_size,
    })
}

/// Bytes of a block's sector bitmap: a bit per sector, padded to whole sectors.
fn bitmap_len(block_size: u64) -> u64 {
    (block_size / SECTOR).div_ceil(8).next_multiple_of(SECTOR)
}

/// A VHD image's layout, for the block-table core.
pub struct Vhd {
    kind: Kind,
}

enum Kind {
    /// Data at offset 0, the footer after it: nothing is ever allocated.
    Fixed,
    Dynamic {
        /// The footer as read at open, written again after every new block.
        footer: Box<[u8; FOOTER_LEN]>,
        bat_offset: u64,
        block_size: u64,
        bitmap_len: u64,
    },
}

/// A VHD image being served.
pub type VhdBackend = TableImage<Vhd>;

/// Sets every bit of a new block's bitmap (written in pieces of this).
static ONES: [u8; 4096] = [0xff; 4096];

impl Vhd {
    /// Whether the bitmap of the block at `host` has a bit set for each of its sectors.
    async fn bitmap_full(&self, file: &RingFile, host: u64, block_size: u64) -> io::Result<bool> {
        let sectors = block_size / SECTOR;
        let mut chunk = [0u8; 512];
        let mut done = 0u64; // sectors checked
        while done < sectors {
            let n = ((sectors - done).div_ceil(8)).min(chunk.len() as u64) as usize;
            file.read_full(&mut chunk[..n], host + done / 8).await?;
            for (i, &b) in chunk[..n].iter().enumerate() {
                let left = sectors - done - 8 * i as u64;
                let want = if left >= 8 { 0xff } else { !(0xffu8 >> left) };
                if b & want != want {
                    return Ok(false);
                }
            }
            done += 8 * n as u64;
        }
        Ok(true)
    }

    /// Calls `each(sector, set)` for the bitmap bits of sectors `first..=last` of the block at
    /// `host`, reading the bitmap in pieces of a sector.
    async fn bits(
        &self,
        file: &RingFile,
        host: u64,
        first: u64,
        last: u64,
        mut each: impl FnMut(u64, bool),
    ) -> io::Result<()> {
        let mut chunk = [0u8; 512];
        let mut byte = first / 8;
        while byte <= last / 8 {
            let n = (last / 8 + 1 - byte).min(chunk.len() as u64) as usize;
            file.read_full(&mut chunk[..n], host + byte).await?;
            for (i, &b) in chunk[..n].iter().enumerate() {
                for bit in 0..8u64 {
                    let s = (byte + i as u64) * 8 + bit;
                    if (first..=last).contains(&s) {
                        each(s, b & (0x80 >> bit) != 0);
                    }
                }
            }
            byte += n as u64;
        }
        Ok(())
    }

    /// Sets the bitmap bits of sectors `first..=last` of the block at `host`.
    async fn set_bits(&self, file: &RingFile, host: u64, first: u64, last: u64) -> io::Result<()> {
        let mut chunk = [0u8; 512];
        let mut byte = first / 8;
        while byte <= last / 8 {
            let n = (last / 8 + 1 - byte).min(chunk.len() as u64) as usize;
            file.read_full(&mut chunk[..n], host + byte).await?;
            for (i, b) in chunk[..n].iter_mut().enumerate() {
                for bit in 0..8u64 {
                    if (first..=last).contains(&((byte + i as u64) * 8 + bit)) {
                        *b |= 0x80 >> bit;
                    }
                }
            }
            file.write_full(&chunk[..n], host + byte).await?;
            byte += n as u64;
        }
        Ok(())
    }

    /// For a block first met with its bitmap unread: reads it and records whether it is full
    /// (a plain block from then on) or partial. Returns the entry now in force.
    async fn resolve(
        &self,
        file: &RingFile,
        table: &Table,
        block: u64,
        entry: Entry,
    ) -> io::Result<Entry> {
        let (Entry::Data { host, flags }, Kind::Dynamic { block_size, .. }) = (entry, &self.kind)
        else {
            return Ok(entry);
        };
        if flags != BITMAP_UNKNOWN {
            return Ok(entry);
        }
        let full = self.bitmap_full(file, host, *block_size).await?;
        let now = Entry::Data {
            host,
            flags: if full { 0 } else { BITMAP_PARTIAL },
        };
        // Bits are only ever set, so "full" stays true; a racing writer may have moved it on.
        table.replace(block, entry, now);
        Ok(now)
    }
}

impl BlockFormat for Vhd {
    fn name(&self) -> &'static str {
        "vhd"
    }

    fn footprint(&self) -> u64 {
        match &self.kind {
            Kind::Fixed => 0,
            Kind::Dynamic {
                block_size,
                bitmap_len,
                ..
            } => bitmap_len + block_size,
        }
    }

    fn data_at(&self, host: u64) -> u64 {
        match &self.kind {
            Kind::Fixed => host,
            Kind::Dynamic { bitmap_len, .. } => host + bitmap_len,
        }
    }

    async fn reserve(&self, file: &RingFile, host: u64, end: u64) -> io::Result<bool> {
        let Kind::Dynamic { footer, .. } = &self.kind else {
            // Every block of a fixed image is allocated.
            return Err(io::Error::from_raw_os_error(libc::EIO));
        };
        // The BAT holds the block's first sector in 32 bits (the last value means unallocated).
        if !host.is_multiple_of(SECTOR) || host / SECTOR >= u64::from(UNALLOCATED) {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        let old_len = file.file().metadata()?.len();
        // The footer goes after the new block first: the old one (where the block's bitmap
        // goes) is overwritten only once the file ends in a valid footer again.
        file.write_full(&footer[..], end).await?;
        Ok(self.data_at(host) >= old_len)
    }

    async fn prepare(&self, file: &RingFile, _block: u64, host: u64) -> io::Result<()> {
        let Kind::Dynamic { bitmap_len, .. } = &self.kind else {
            return Ok(());
        };
        let mut at = 0;
        while at < *bitmap_len {
            let n = (bitmap_len - at).min(ONES.len() as u64) as usize;
            file.write_full(&ONES[..n], host + at).await?;
            at += n as u64;
        }
        Ok(())
    }

    async fn commit(&self, file: &RingFile, block: u64, host: u64) -> io::Result<Entry> {
        let Kind::Dynamic { bat_offset, .. } = &self.kind else {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        };
        let sector =
            u32::try_from(host / SECTOR).map_err(|_| io::Error::from_raw_os_error(libc::ENOSPC))?;
        file.write_full(&sector.to_be_bytes(), bat_offset + 4 * block)
            .await?;
        Ok(Entry::Data { host, flags: 0 })
    }

    async fn read_flagged(
        &self,
        file: &RingFile,
        table: &Table,
        block: u64,
        entry: Entry,
        within: u64,
        buf: &mut [u8],
    ) -> io::Result<()> {
        let entry = self.resolve(file, table, block, entry).await?;
        let Entry::Data { host, flags } = entry else {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        };
        file.read_full(buf, self.data_at(host) + within).await?;
        if flags == 0 || buf.is_empty() {
            return Ok(());
        }
        let end = within + buf.len() as u64;
        let (first, last) = (within / SECTOR, (end - 1) / SECTOR);
        self.bits(file, host, first, last, |s, set| {
            if !set {
                // The part of sector `s` inside the request reads as zeroes.
                let a = (s * SECTOR).max(within) - within;
                let b = ((s + 1) * SECTOR).min(end) - within;
                buf[a as usize..b as usize].fill(0);
            }
        })
        .await
    }

    async fn write_flagged(
        &self,
        file: &RingFile,
        table: &Table,
        block: u64,
        entry: Entry,
        within: u64,
        data: &[u8],
    ) -> io::Result<Entry> {
        let entry = self.resolve(file, table, block, entry).await?;
        let Entry::Data { host, flags } = entry else {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        };
        let base = self.data_at(host);
        if flags == 0 || data.is_empty() {
            file.write_full(data, base + within).await?;
            return Ok(entry);
        }
        let end = within + data.len() as u64;
        let (first, last) = (within / SECTOR, (end - 1) / SECTOR);
        // A clear sector the write covers only in part: its other bytes must read as zeroes
        // once its bit is set, whatever the file holds there now.
        let mut pad = [None, None];
        self.bits(file, host, first, last, |s, set| {
            let partial = s * SECTOR < within || (s + 1) * SECTOR > end;
            if !set && partial && (s == first || s == last) {
                pad[usize::from(s != first)] = Some(s);
            }
        })
        .await?;
        for s in pad.into_iter().flatten() {
            file.write_full(&[0u8; SECTOR as usize], base + s * SECTOR)
                .await?;
        }
        file.write_full(data, base + within).await?;
        self.set_bits(file, host, first, last).await?;
        let Kind::Dynamic { block_size, .. } = &self.kind else {
            return Ok(entry);
        };
        let full = self.bitmap_full(file, host, *block_size).await?;
        Ok(Entry::Data {
            host,
            flags: if full { 0 } else { BITMAP_PARTIAL },
        })
    }
}

/// Opens the VHD image at `path` (fixed or dynamic), locked as QEMU's `vpc` driver locks it.
pub fn open(path: &Path, writable: bool, locking: Locking) -> Result<VhdBackend, OpenError> {
    blocktable::open_image(path, writable, locking, "vhd", parse)
}

/// Reads `f` (of `len` bytes) as a VHD image: its layout, block table and geometry.
fn parse(f: &std::fs::File, len: u64, writable: bool) -> Result<(Vhd, Table, Layout), ParseError> {
    blocktable::at_least(len, FOOTER_LEN as u64, "a VHD footer")?;
    let mut footer = Box::new([0u8; FOOTER_LEN]);
    f.read_exact_at(&mut footer[..], 0)?;
    if footer[..8] != VHD_COOKIE {
        f.read_exact_at(&mut footer[..], len - FOOTER_LEN as u64)?;
        if footer[..8] != VHD_COOKIE {
            return Err(
                "no VHD footer (cookie 'conectix') at its start or end: check the path, \
                        or use --format raw"
                    .to_string()
                    .into(),
            );
        }
    }
    let ft = parse_footer(&footer)?;
    match ft.disk_type {
        DISK_FIXED => parse_fixed(&ft, len, writable),
        DISK_DYNAMIC => parse_dynamic(f, footer, &ft, len, writable),
        DISK_DIFFERENCING => Err("it is a differencing image (its data depends on a parent \
                                  image), which fusex does not serve: make a standalone copy \
                                  with `qemu-img convert -O vpc`"
            .to_string()
            .into()),
        t => Err(format!("its footer gives an unknown disk type {t}").into()),
    }
}

fn parse_fixed(ft: &Footer, len: u64, writable: bool) -> Result<(Vhd, Table, Layout), ParseError> {
    let data = len - FOOTER_LEN as u64;
    if ft.size > data {
        return Err(format!(
            "its footer gives a disk of {} bytes but the file holds only {data} bytes before \
             the footer: the image is truncated",
            ft.size
        )
        .into());
    }
    let mut shift = FIXED_MIN_SHIFT;
    while ft.size.div_ceil(1 << shift) > FIXED_MAX_ENTRIES {
        shift += 1;
    }
    let table = Table::new(ft.size.div_ceil(1 << shift))?;
    for i in 0..table.len() {
        table.set(
            i,
            Entry::Data {
                host: i << shift,
                flags: 0,
            },
        );
    }
    Ok((
        Vhd { kind: Kind::Fixed },
        table,
        Layout {
            block_shift: shift,
            size: ft.size,
            next_free: len,
            writable,
        },
    ))
}

/// Whether `a..a + al` and `b..b + bl` overlap.
fn overlaps(a: u64, al: u64, b: u64, bl: u64) -> bool {
    a < b.saturating_add(bl) && b < a.saturating_add(al)
}

fn parse_dynamic(
    f: &std::fs::File,
    footer: Box<[u8; FOOTER_LEN]>,
    ft: &Footer,
    len: u64,
    writable: bool,
) -> Result<(Vhd, Table, Layout), ParseError> {
    let hdr_at = ft.data_offset;
    if hdr_at < SECTOR || hdr_at.saturating_add(HEADER_LEN as u64) > len {
        return Err(format!(
            "its footer puts the dynamic header at {hdr_at:#x}, outside the file ({len} bytes): \
             the footer is corrupt"
        )
        .into());
    }
    let mut hb = [0u8; HEADER_LEN];
    f.read_exact_at(&mut hb, hdr_at)?;
    let h = parse_header(&hb)?;
    let bs = h.block_size;
    let needed = ft.size.div_ceil(bs);
    if u64::from(h.max_entries) < needed {
        return Err(format!(
            "its block table has {} entries of {bs} bytes, less than the disk's {} bytes: the \
             header is corrupt",
            h.max_entries, ft.size
        )
        .into());
    }
    let table = Table::new(needed)?;
    let bat_len = (u64::from(h.max_entries) * 4).next_multiple_of(SECTOR);
    let bat = h.table_offset;
    if bat < SECTOR
        || bat.saturating_add(needed * 4) > len
        || overlaps(bat, bat_len, hdr_at, HEADER_LEN as u64)
    {
        return Err(format!(
            "its block table at {bat:#x} lies outside the file or over its header: the header \
             is corrupt"
        )
        .into());
    }
    let mut raw = vec![0u8; (needed * 4) as usize];
    f.read_exact_at(&mut raw, bat)?;
    let bitmap = bitmap_len(bs);
    let footprint = bitmap + bs;
    let metadata = [(0, SECTOR), (hdr_at, HEADER_LEN as u64), (bat, bat_len)];
    let mut end = metadata
        .iter()
        .map(|&(a, l)| a + l)
        .max()
        .unwrap_or(0)
        .next_multiple_of(SECTOR);
    let mut bad = Vec::new();
    let mut placed = Vec::new();
    for (i, w) in raw.chunks_exact(4).enumerate() {
        let i = i as u64;
        let v = be32(w, 0);
        if v == UNALLOCATED {
            continue;
        }
        let host = u64::from(v) * SECTOR;
        let fits = host + footprint <= len;
        if !fits
            || metadata
                .iter()
                .any(|&(a, l)| overlaps(host, footprint, a, l))
        {
            table.set(i, Entry::Bad);
            bad.push(i);
            continue;
        }
        end = end.max(host + footprint);
        // Sector and index both fit 32 bits (the BAT's own width, and the table's bound).
        placed.push((v, i as u32));
    }
    bad.extend(blocktable::sharing(&mut placed, SECTOR, footprint));
    for &(v, i) in &placed {
        table.set(
            u64::from(i),
            Entry::Data {
                host: u64::from(v) * SECTOR,
                flags: BITMAP_UNKNOWN,
            },
        );
    }
    let what = |first| {
        format!(
            "the block table entry of block {first} points outside the file, into its \
             metadata or at another block's space"
        )
    };
    blocktable::settle_bad(&table, bad, writable, "vhd", what, "qemu-img convert")?;
    // New blocks go where the footer is now (its last sector), or past every block and table.
    let next_free = (len - FOOTER_LEN as u64).next_multiple_of(SECTOR).max(end);
    Ok((
        Vhd {
            kind: Kind::Dynamic {
                footer,
                bat_offset: bat,
                block_size: bs,
                bitmap_len: bitmap,
            },
        },
        table,
        Layout {
            block_shift: bs.trailing_zeros(),
            size: ft.size,
            next_free,
            writable,
        },
    ))
}

#[cfg(test)]
mod tests;
