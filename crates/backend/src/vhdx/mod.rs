//! VHDX images (Hyper-V), fixed and dynamic, served through the block-table core
//! ([`crate::blocktable`]). The structures and their checks are in [`ondisk`].
//!
//! The layout (MS-VHDX 1.0): the first 1 MiB is the header section: the file type identifier
//! (`vhdxfile` at 0), two headers (at 64 KiB and 128 KiB, each with a CRC-32C and a sequence
//! number: the valid one with the higher number is current) and the region table (at 192 KiB,
//! a copy at 256 KiB) locating the BAT and metadata regions. The metadata region gives the
//! block size, the virtual disk size and the sector sizes. The BAT holds one 64-bit entry per
//! payload block (state in the low 3 bits, file offset in MiB in the high 44), with a sector
//! bitmap entry after every chunk of `2^23 × logical sector size / block size` payload entries.
//!
//! **The log.** A header whose log GUID is not zero has log entries that must be replayed
//! before its metadata can be trusted. fusex does not replay the log: such an image is refused
//! (read-only too) in one line naming the fix: `qemu-img check -r all` or opening it in
//! Hyper-V replays it; QEMU leaves a log GUID whose log has no valid entries in place, and
//! `qemu-img convert -O vhdx` then makes a clean copy. fusex itself never writes the log.
//!
//! **Writing.** Before anything else is written, the header goes to the non-current slot with
//! the next sequence number and new file and data write GUIDs (the spec's rule for a file being
//! modified), log GUID still zero, and is flushed: from then on it is the current header.
//! A new block is appended at the end of the file (1 MiB aligned): [`BlockFormat::reserve`]
//! extends the file over it, the core writes the data, then [`BlockFormat::commit`] writes the
//! block's BAT entry (FULLY_PRESENT) in place. QEMU journals that entry through the log; fusex
//! writes it directly, which is crash-safe for the same reason as the other block-table
//! formats: the entry is one aligned 8-byte write (a sector write never tears it), it is
//! written only after the data, and the block's space is fresh file space that reads as zeroes,
//! so a crash leaves either the old entry (the block leaked) or the new one over data that is
//! either written or zeroes, never someone else's bytes.

mod ondisk;

use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::blocktable::{self, BlockFormat, Entry, Layout, Table, TableImage};
use crate::lock::{lock_file, Claim, Locking};
use crate::ringfile::RingFile;
use crate::OpenError;

pub use ondisk::FILE_ID;
use ondisk::{state, Region, MIB};

/// Whether the file at `path` starts with the VHDX file type identifier.
pub fn probe(path: &Path) -> io::Result<bool> {
    let f = std::fs::File::open(path)?;
    let mut magic = [0u8; 8];
    match f.read_exact_at(&mut magic, 0) {
        Ok(()) => Ok(magic == FILE_ID),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

/// A VHDX image's layout, for the block-table core.
pub struct Vhdx {
    bat_offset: u64,
    block_size: u64,
    /// Payload blocks per chunk of the BAT.
    ratio: u64,
}

/// A VHDX image being served.
pub type VhdxBackend = TableImage<Vhdx>;

impl BlockFormat for Vhdx {
    fn name(&self) -> &'static str {
        "vhdx"
    }

    fn footprint(&self) -> u64 {
        self.block_size
    }

    fn data_at(&self, host: u64) -> u64 {
        host
    }

    async fn reserve(&self, file: &RingFile, host: u64, end: u64) -> io::Result<bool> {
        // A BAT entry holds whole MiB in 44 bits.
        if !host.is_multiple_of(MIB) || host >> 20 >= 1 << 44 {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        let old_len = file.file().metadata()?.len();
        file.extend_to(end)?;
        Ok(host >= old_len)
    }

    async fn commit(&self, file: &RingFile, block: u64, host: u64) -> io::Result<Entry> {
        let at = self.bat_offset + 8 * ondisk::payload_index(block, self.ratio);
        file.write_full(&ondisk::present_entry(host).to_le_bytes(), at)
            .await?;
        Ok(Entry::Data { host, flags: 0 })
    }
}

/// Why parsing failed: the image (one line for the user) or the OS.
#[derive(Debug)]
enum ParseError {
    Bad(String),
    Io(io::Error),
}

impl From<io::Error> for ParseError {
    fn from(e: io::Error) -> ParseError {
        ParseError::Io(e)
    }
}

impl From<String> for ParseError {
    fn from(s: String) -> ParseError {
        ParseError::Bad(s)
    }
}

impl From<&str> for ParseError {
    fn from(s: &str) -> ParseError {
        ParseError::Bad(s.to_string())
    }
}

/// Opens the VHDX image at `path`, locked as QEMU's `vhdx` driver locks it. Writable, its
/// header is updated (new write GUIDs) before this returns.
pub fn open(path: &Path, writable: bool, locking: Locking) -> Result<VhdxBackend, OpenError> {
    let shown = path.display().to_string();
    let (file, len) = blocktable::open_file(path, writable)?;
    lock_file(
        file.file(),
        Claim::qcow2(locking, writable),
        &format!("image {shown}"),
    )?;
    let map = |e| match e {
        ParseError::Bad(reason) => OpenError::Format {
            path: shown.clone(),
            format: "vhdx",
            reason,
        },
        ParseError::Io(e) => OpenError::from_io(&shown, e),
    };
    let parsed = parse(file.file(), len, writable).map_err(map)?;
    if writable {
        begin_writing(file.file(), &parsed.header).map_err(|e| OpenError::from_io(&shown, e))?;
    }
    tracing::debug!(path = %shown, size = parsed.layout.size, "opened vhdx image");
    Ok(TableImage::new(
        file,
        parsed.vhdx,
        parsed.table,
        parsed.layout,
    ))
}

/// The current header as read at open, to base the next one on.
struct CurrentHeader {
    slot: usize,
    seq: u64,
    bytes: Vec<u8>,
}

struct Parsed {
    vhdx: Vhdx,
    table: Table,
    layout: Layout,
    header: CurrentHeader,
}

/// A random GUID (version 4).
fn new_guid() -> io::Result<ondisk::Guid> {
    let mut g = [0u8; 16];
    let mut got = 0;
    while got < g.len() {
        // SAFETY: the pointer and length name the unfilled tail of `g`, which outlives the call.
        let n = unsafe { libc::getrandom(g[got..].as_mut_ptr().cast(), g.len() - got, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        got += n as usize;
    }
    g[7] = (g[7] & 0x0f) | 0x40; // data3's high nibble: version 4 (little-endian)
    g[8] = (g[8] & 0x3f) | 0x80; // the variant
    Ok(g)
}

/// Writes the next header (new file and data write GUIDs, the next sequence number) into the
/// slot that is not current, and flushes it, before the session's first change to the file.
fn begin_writing(f: &std::fs::File, h: &CurrentHeader) -> io::Result<()> {
    let seq = h.seq.checked_add(1).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            "the header's sequence number is at its maximum",
        )
    })?;
    let next = ondisk::next_header(&h.bytes, seq, new_guid()?, new_guid()?);
    f.write_all_at(&next, ondisk::HEADER_AT[1 - h.slot])?;
    f.sync_data()
}

/// Reads `f` (of `len` bytes) as a VHDX image.
fn parse(f: &std::fs::File, len: u64, writable: bool) -> Result<Parsed, ParseError> {
    if len < ondisk::HEADER_SECTION {
        return Err("it is shorter than a VHDX header section (1 MiB): check the path".into());
    }
    let mut id = [0u8; 8];
    f.read_exact_at(&mut id, 0)?;
    if id != FILE_ID {
        return Err(
            "it has no VHDX file type identifier ('vhdxfile'): check the path, or use \
                    --format raw"
                .into(),
        );
    }
    let mut raw = [vec![0u8; ondisk::HEADER_LEN], vec![0u8; ondisk::HEADER_LEN]];
    for (b, at) in raw.iter_mut().zip(ondisk::HEADER_AT) {
        f.read_exact_at(b, at)?;
    }
    let (slot, h) =
        ondisk::current_header([ondisk::parse_header(&raw[0]), ondisk::parse_header(&raw[1])])?;
    if h.log_guid != [0; 16] {
        return Err(
            "its header names a log (the log GUID is set: it was not closed cleanly, and \
             the log may hold changes not yet written into the image), and fusex does not \
             replay VHDX logs: replay it with `qemu-img check -r all` or by opening it in \
             Hyper-V; if fusex still refuses it, `qemu-img convert -O vhdx` makes a clean copy"
                .into(),
        );
    }
    let mut used = vec![Region {
        offset: 0,
        length: ondisk::HEADER_SECTION,
    }];
    if h.log_length > 0 {
        let log = Region {
            offset: h.log_offset,
            length: h.log_length,
        };
        if !log.offset.is_multiple_of(MIB)
            || !log.length.is_multiple_of(MIB)
            || log.offset < ondisk::HEADER_SECTION
            || log.end() > len
        {
            return Err(format!(
                "its header puts the log at {:#x} ({:#x} bytes), not whole MiB inside the \
                 file: the header is damaged",
                log.offset, log.length
            )
            .into());
        }
        used.push(log);
    }
    let regions = read_regions(f)?;
    for (what, r) in [("BAT", regions.bat), ("metadata", regions.metadata)] {
        if r.end() > len || used.iter().any(|u| u.overlaps(r)) {
            return Err(format!(
                "its {what} region at {:#x} ({:#x} bytes) lies outside the file or over the \
                 header section, the log or another region: the image is damaged",
                r.offset, r.length
            )
            .into());
        }
        used.push(r);
    }
    let p = read_params(f, regions.metadata)?;
    if p.has_parent {
        return Err(
            "it is a differencing image (its data depends on a parent image), which fusex \
                    does not serve: make a standalone copy with `qemu-img convert -O vhdx`"
                .into(),
        );
    }
    let blocks = p.size.div_ceil(p.block_size);
    let ratio = ondisk::chunk_ratio(p.logical_sector, p.block_size);
    let entries = ondisk::bat_entries(blocks, ratio);
    if entries.saturating_mul(8) > regions.bat.length {
        return Err(format!(
            "its BAT region ({} bytes) is too small for the {entries} entries a disk of {} \
             bytes in {}-byte blocks needs: the image is damaged",
            regions.bat.length, p.size, p.block_size
        )
        .into());
    }
    let table = Table::new(blocks).map_err(|e| e.to_string())?;
    let mut end = used.iter().map(|r| r.end()).max().unwrap_or(0);
    let bad = read_bat(f, len, &regions.bat, &used, &p, ratio, &table, &mut end)?;
    if let Some(&first) = bad.first() {
        let what = format!(
            "the BAT entry of block {first} is invalid (a state fusex does not serve, or a \
             block outside the file, over its metadata or over another block){}",
            match bad.len() - 1 {
                0 => String::new(),
                n => format!(" (and {n} more)"),
            }
        );
        if writable {
            return Err(format!(
                "{what}: the image is damaged; export it read-only (those blocks fail with \
                 EIO) or repair it with `qemu-img convert`"
            )
            .into());
        }
        tracing::warn!("vhdx image: {what}: reading those blocks fails with EIO");
    }
    // New blocks go past every block and structure, at a whole MiB.
    let next_free = end.max(len).next_multiple_of(MIB);
    let [h0, h1] = raw;
    Ok(Parsed {
        vhdx: Vhdx {
            bat_offset: regions.bat.offset,
            block_size: p.block_size,
            ratio,
        },
        table,
        layout: Layout {
            block_shift: p.block_size.trailing_zeros(),
            size: p.size,
            next_free,
            writable,
        },
        header: CurrentHeader {
            slot,
            seq: h.seq,
            bytes: if slot == 0 { h0 } else { h1 },
        },
    })
}

/// The region table, or its copy when the first is damaged.
fn read_regions(f: &std::fs::File) -> Result<ondisk::Regions, ParseError> {
    let mut b = vec![0u8; ondisk::REGION_LEN];
    let mut first = None;
    for at in ondisk::REGION_AT {
        f.read_exact_at(&mut b, at)?;
        match ondisk::parse_regions(&b) {
            Ok(r) => return Ok(r),
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }
    Err(format!(
        "its region table is not valid ({}), nor is its copy: the image is damaged",
        first.unwrap_or_default()
    )
    .into())
}

/// The metadata items fusex needs, from the metadata region.
fn read_params(f: &std::fs::File, region: Region) -> Result<ondisk::Params, ParseError> {
    if region.length < ondisk::METADATA_TABLE_LEN as u64 {
        return Err("its metadata region is smaller than its table: the image is damaged".into());
    }
    let mut table = vec![0u8; ondisk::METADATA_TABLE_LEN];
    f.read_exact_at(&mut table, region.offset)?;
    let items = ondisk::parse_metadata_table(&table, region.length)?;
    let read = |item: Option<(u64, u64)>, what: &str, buf: &mut [u8]| -> Result<(), ParseError> {
        match item {
            Some((off, len)) if len >= buf.len() as u64 => {
                Ok(f.read_exact_at(buf, region.offset + off)?)
            }
            Some(_) => Err(format!("its metadata item {what} is too short").into()),
            None => Err(format!("its metadata has no {what}: the image is damaged").into()),
        }
    };
    let (mut fp, mut size, mut lss, mut pss) = ([0u8; 8], [0u8; 8], [0u8; 4], [0u8; 4]);
    read(items.file_parameters, "file parameters", &mut fp)?;
    read(items.disk_size, "virtual disk size", &mut size)?;
    read(items.logical_sector, "logical sector size", &mut lss)?;
    read(items.physical_sector, "physical sector size", &mut pss)?;
    Ok(ondisk::parse_params(&fp, &size, &lss, &pss)?)
}

/// BAT entries read at once: 512 KiB.
const BAT_CHUNK: u64 = 64 << 10;

/// Reads the BAT into `table`, checking every payload entry: a FULLY_PRESENT block must lie
/// inside the file, clear of `used` and of every other block. Returns the bad blocks, sorted;
/// raises `end` past every block (and sector bitmap block) in the file.
#[allow(clippy::too_many_arguments)]
fn read_bat(
    f: &std::fs::File,
    len: u64,
    bat: &Region,
    used: &[Region],
    p: &ondisk::Params,
    ratio: u64,
    table: &Table,
    end: &mut u64,
) -> Result<Vec<u64>, ParseError> {
    let blocks = table.len();
    let entries = ondisk::bat_entries(blocks, ratio);
    let bs = p.block_size;
    let mut bad = Vec::new();
    // Each present block as (offset in MiB << 23 | block): a block past 2^41 MiB is outside
    // any file, and the table holds fewer than 2^23 blocks.
    let mut placed: Vec<u64> = Vec::new();
    let mut buf = vec![0u8; (BAT_CHUNK.min(entries) * 8) as usize];
    let mut i = 0u64;
    while i < entries {
        let n = BAT_CHUNK.min(entries - i);
        let b = &mut buf[..(n * 8) as usize];
        f.read_exact_at(b, bat.offset + 8 * i)?;
        for (k, w) in b.chunks_exact(8).enumerate() {
            let index = i + k as u64;
            let (st, host) = ondisk::decode_entry(ondisk::le64(w, 0));
            let Some(block) = ondisk::block_of_index(index, ratio) else {
                // Fixed and dynamic images have no sector bitmaps; one present anyway is
                // never read, but no new block goes over it.
                if st == state::SB_PRESENT && host.saturating_add(MIB) <= len {
                    *end = (*end).max(host + MIB);
                }
                continue;
            };
            match st {
                state::NOT_PRESENT | state::UNDEFINED | state::UNMAPPED | state::UNMAPPED_V095 => {}
                state::ZERO => table.set(block, Entry::Zero),
                state::FULLY_PRESENT => {
                    let r = Region {
                        offset: host,
                        length: bs,
                    };
                    if host < ondisk::HEADER_SECTION
                        || host >> 20 >= 1 << 41
                        || r.end() > len
                        || used.iter().any(|u| u.overlaps(r))
                    {
                        bad.push(block);
                    } else {
                        *end = (*end).max(r.end());
                        placed.push(((host >> 20) << 23) | block);
                    }
                }
                // Differencing images only.
                state::PARTIALLY_PRESENT => bad.push(block),
                // 4 is reserved.
                _ => bad.push(block),
            }
        }
        i += n;
    }
    placed.sort_unstable();
    let mib = |v: u64| (v >> 23) << 20;
    let block_of = |v: u64| v & ((1 << 23) - 1);
    for pair in placed.windows(2) {
        if mib(pair[0]) + bs > mib(pair[1]) {
            bad.extend([block_of(pair[0]), block_of(pair[1])]);
        }
    }
    for &v in &placed {
        table.set(
            block_of(v),
            Entry::Data {
                host: mib(v),
                flags: 0,
            },
        );
    }
    bad.sort_unstable();
    bad.dedup();
    for &b in &bad {
        table.set(b, Entry::Bad);
    }
    Ok(bad)
}

#[cfg(test)]
mod tests;
