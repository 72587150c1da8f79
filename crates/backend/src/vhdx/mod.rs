//! VHDX images (Hyper-V), fixed and dynamic, served through the block-table core
//! ([`crate::blocktable`]). The structures and their checks are in `ondisk`.
//!
//! The layout (MS-VHDX 1.0): the first 1 MiB is the header section: the file type identifier
//! (`vhdxfile` at 0), two headers (at 64 KiB and 128 KiB, each with a CRC-32C and a sequence
//! number: the valid one with the higher number is current) and the region table (at 192 KiB,
//! a copy at 256 KiB) locating the BAT and metadata regions. The metadata region gives the
//! block size, the virtual disk size and the sector sizes. The BAT holds one 64-bit entry per
//! payload block (state in the low 3 bits, file offset in MiB in the high 44), with a sector
//! bitmap entry after every chunk of `2^23 × logical sector size / block size` payload entries.
//!
//! **Differencing images** (the "has parent" flag) are served read-only: their parent locator
//! names the parent VHDX (`parent`: found and opened under the policy qcow2 backing files
//! get, its data write GUID checked against the child's `parent_linkage`), and blocks the
//! child does not hold are read from it. A NOT_PRESENT or UNDEFINED block reads the parent's
//! bytes, ZERO and UNMAPPED read zeroes, FULLY_PRESENT the child's block, and
//! PARTIALLY_PRESENT goes sector by sector after the chunk's sector bitmap (a set bit: the
//! child's sector; clear: the parent's), runs of sectors in one transfer each.
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
mod parent;

use std::future::Future;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::pin::Pin;

use crate::blocktable::{self, BlockFormat, Entry, Layout, Table, TableImage};
use crate::lock::{lock_file, Claim, Locking};
use crate::qcow2::named;
use crate::ringfile::RingFile;
use crate::{BlockBackend, OpenError};

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
    /// Bytes of a logical sector (a parent's must be its child's).
    logical_sector: u64,
    /// A differencing image's sector bitmaps and parent (boxed: the parent is a VHDX image
    /// itself).
    diff: Option<Box<Differencing>>,
}

/// The [`Entry::Data`] flag of a differencing image's PARTIALLY_PRESENT block: its sectors
/// are the child's or the parent's as the chunk's sector bitmap says.
const PARTIAL: u8 = 1;

/// What reading a differencing image needs beyond its BAT.
struct Differencing {
    /// Bytes of a logical sector: one bit of a sector bitmap each.
    logical_sector: u64,
    /// File offset of each chunk's sector bitmap block; 0 where there is none or it is bad
    /// (the chunk's partially present blocks are then bad entries).
    bitmaps: Box<[u64]>,
    /// The parent, opened read-only.
    parent: VhdxBackend,
}

/// Bytes of a sector bitmap read at once: the bits of 2048 sectors (1 MiB of 512-byte ones).
const BITMAP_CHUNK: usize = 256;

impl Differencing {
    /// Fills `buf` with the parent's bytes at guest offset `off`: zeroes past the parent's end
    /// (a parent smaller than its child). Boxed: the parent's read contains this one's.
    fn read_parent<'a>(
        &'a self,
        off: u64,
        buf: &'a mut [u8],
    ) -> Pin<Box<dyn Future<Output = io::Result<()>> + 'a>> {
        Box::pin(async move {
            let n = self.parent.size().saturating_sub(off).min(buf.len() as u64) as usize;
            let (inside, past) = buf.split_at_mut(n);
            past.fill(0);
            if !inside.is_empty() {
                self.parent.read(inside, off).await?;
            }
            Ok(())
        })
    }
}

impl Vhdx {
    /// Reads `buf` at `within` of partially present `block` (its data at `host`): each run of
    /// sectors whose bitmap bits agree in one transfer, from the child where they are set and
    /// from the parent where they are clear.
    async fn read_partial(
        &self,
        d: &Differencing,
        file: &RingFile,
        block: u64,
        host: u64,
        within: u64,
        buf: &mut [u8],
    ) -> io::Result<()> {
        let eio = || io::Error::from_raw_os_error(libc::EIO);
        let bitmap = usize::try_from(block / self.ratio)
            .ok()
            .and_then(|c| d.bitmaps.get(c))
            .copied()
            .filter(|&b| b != 0)
            .ok_or_else(eio)?;
        let lss = d.logical_sector;
        let end = within + buf.len() as u64;
        // The block's first sector's bit in its chunk's bitmap, and the request's sectors.
        let base = (block % self.ratio) * (self.block_size / lss);
        let (first, last) = (within / lss, (end - 1) / lss);
        let guest = block * self.block_size;
        let mut bits = [0u8; BITMAP_CHUNK];
        // The run being gathered: where it starts (block offset) and whether its bits are set.
        let mut run: Option<(u64, bool)> = None;
        let mut s = first;
        while s <= last {
            let byte = (base + s) / 8;
            let n = ((base + last) / 8 + 1 - byte).min(BITMAP_CHUNK as u64) as usize;
            file.read_full(&mut bits[..n], bitmap + byte).await?;
            let loaded_last = ((byte + n as u64) * 8 - 1 - base).min(last);
            while s <= loaded_last {
                let bit = base + s;
                let set = bits[(bit / 8 - byte) as usize] >> (bit % 8) & 1 != 0;
                match run {
                    Some((_, was)) if was == set => {}
                    Some((from, was)) => {
                        let to = s * lss;
                        let piece = &mut buf[(from - within) as usize..(to - within) as usize];
                        self.read_run(d, file, was, host + from, guest + from, piece)
                            .await?;
                        run = Some((to, set));
                    }
                    None => run = Some((within, set)),
                }
                s += 1;
            }
        }
        if let Some((from, set)) = run {
            let piece = &mut buf[(from - within) as usize..];
            self.read_run(d, file, set, host + from, guest + from, piece)
                .await?;
        }
        Ok(())
    }

    /// One run of a partially present block: from the child's file at `at`, or the parent's
    /// guest bytes at `guest`.
    async fn read_run(
        &self,
        d: &Differencing,
        file: &RingFile,
        child: bool,
        at: u64,
        guest: u64,
        buf: &mut [u8],
    ) -> io::Result<()> {
        if child {
            file.read_full(buf, at).await
        } else {
            d.read_parent(guest, buf).await
        }
    }
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

    async fn read_flagged(
        &self,
        file: &RingFile,
        _table: &Table,
        block: u64,
        entry: Entry,
        within: u64,
        buf: &mut [u8],
    ) -> io::Result<()> {
        match (entry, self.diff.as_deref()) {
            (Entry::Data { host, flags }, Some(d)) if flags == PARTIAL && !buf.is_empty() => {
                self.read_partial(d, file, block, host, within, buf).await
            }
            (Entry::Data { host, .. }, _) => file.read_full(buf, host + within).await,
            _ => Err(io::Error::from_raw_os_error(libc::EIO)),
        }
    }

    async fn read_unallocated(&self, off: u64, buf: &mut [u8]) -> io::Result<()> {
        match self.diff.as_deref() {
            Some(d) => d.read_parent(off, buf).await,
            None => {
                buf.fill(0);
                Ok(())
            }
        }
    }

    fn unallocated_is_data(&self) -> bool {
        self.diff.is_some()
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

/// How to open a VHDX image.
#[derive(Clone, Copy, Debug, Default)]
pub struct VhdxOptions {
    /// Open for writing (a differencing image is then refused: it is served read-only).
    pub writable: bool,
    /// How the image and its parents are locked (see [`crate::lock`]).
    pub locking: Locking,
    /// Refuse to open a differencing image's parent: for untrusted images, whose parent
    /// locator could name any file.
    pub no_backing: bool,
    /// When root serves an image another user owns, open its parent with root's credentials
    /// rather than the owner's (see [`crate::qcow2::named`]).
    pub trust_backing: bool,
}

/// Opens the VHDX image at `path`, locked as QEMU's `vhdx` driver locks it, with its chain of
/// parents if it is a differencing image. Writable, its header is updated (new write GUIDs)
/// before this returns.
pub fn open(path: &Path, opts: VhdxOptions) -> Result<VhdxBackend, OpenError> {
    let shown = path.display().to_string();
    let (file, len) = blocktable::open_file(path, opts.writable)?;
    lock_file(
        file.file(),
        Claim::qcow2(opts.locking, opts.writable),
        &format!("image {shown}"),
    )?;
    let mut chain =
        parent::Chain::new(file.file(), &opts).map_err(|e| OpenError::from_io(&shown, e))?;
    Ok(open_opened(file, len, path, opts.writable, &mut chain)?.0)
}

/// Serves the VHDX image open (and locked) as `file`, of `len` bytes, at `path`; a
/// differencing image's parents are opened through `chain`. Returns the image and its current
/// header's data write GUID (what a child's `parent_linkage` names).
fn open_opened(
    file: RingFile,
    len: u64,
    path: &Path,
    writable: bool,
    chain: &mut parent::Chain,
) -> Result<(VhdxBackend, ondisk::Guid), OpenError> {
    let shown = path.display().to_string();
    let bad = |reason: String| OpenError::Format {
        path: shown.clone(),
        format: "vhdx",
        reason,
    };
    let map = |e| match e {
        ParseError::Bad(reason) => bad(reason),
        ParseError::Io(e) => OpenError::from_io(&shown, e),
    };
    let mut parsed = parse(file.file(), len, writable, chain.entries_left()).map_err(map)?;
    chain.hold_entries(parsed.table.len());
    if let Some(d) = parsed.diff.take() {
        let (pfile, plen, ppath) = chain.open_parent(path, &d.locator)?;
        let p = named::shown_path(&ppath);
        let (parent, guid) =
            open_opened(pfile, plen, &ppath, false, chain).map_err(|e| match e {
                e @ OpenError::Lock(_) => e,
                e => bad(format!("its parent: {e}")),
            })?;
        if guid != d.locator.linkage && d.locator.linkage2 != Some(guid) {
            return Err(bad(format!(
                "its parent {p} has data write GUID {}, not the {} its parent_linkage names: \
                 the parent was written (or replaced) since this differencing image was made, \
                 so the two no longer make one disk",
                ondisk::show_guid(&guid),
                ondisk::show_guid(&d.locator.linkage)
            )));
        }
        let plss = parent.format().logical_sector;
        if plss != d.logical_sector {
            return Err(bad(format!(
                "its parent {p} has {plss}-byte logical sectors, not {} as the child: they \
                 must be the same",
                d.logical_sector
            )));
        }
        tracing::debug!(path = %shown, parent = %p, "opened vhdx parent");
        parsed.vhdx.diff = Some(Box::new(Differencing {
            logical_sector: d.logical_sector,
            bitmaps: d.bitmaps,
            parent,
        }));
    }
    if writable {
        begin_writing(file.file(), &parsed.header).map_err(|e| OpenError::from_io(&shown, e))?;
    }
    tracing::debug!(path = %shown, size = parsed.layout.size, "opened vhdx image");
    Ok((
        TableImage::new(file, parsed.vhdx, parsed.table, parsed.layout),
        parsed.data_write_guid,
    ))
}

/// The current header as read at open, to base the next one on.
struct CurrentHeader {
    slot: usize,
    seq: u64,
    bytes: Vec<u8>,
}

/// What a differencing image's parse found, for opening its parent.
struct DiffParsed {
    locator: ondisk::ParentLocator,
    logical_sector: u64,
    bitmaps: Box<[u64]>,
}

struct Parsed {
    vhdx: Vhdx,
    table: Table,
    layout: Layout,
    header: CurrentHeader,
    data_write_guid: ondisk::Guid,
    diff: Option<DiffParsed>,
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

/// Reads `f` (of `len` bytes) as a VHDX image, refusing a block table of more than `entries`
/// entries (what the chain of differencing images it belongs to has left of its bound).
fn parse(f: &std::fs::File, len: u64, writable: bool, entries: u64) -> Result<Parsed, ParseError> {
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
    let (p, locator) = read_params(f, regions.metadata)?;
    if p.has_parent && writable {
        return Err(
            "it is a differencing image (its data depends on a parent image), which fusex \
             serves read-only: drop --writable, or make a standalone copy with \
             `qemu-img convert -O vhdx` (from a read-only fusex export of it)"
                .into(),
        );
    }
    let blocks = p.size.div_ceil(p.block_size);
    if blocks > entries && blocks <= blocktable::MAX_ENTRIES {
        return Err(format!(
            "it is the parent of a differencing image, and with it the chain's block tables \
             would hold more than {} entries ({} MiB of memory), more than fusex holds for a \
             chain",
            parent::CHAIN_ENTRIES,
            (parent::CHAIN_ENTRIES * 8) >> 20
        )
        .into());
    }
    let ratio = ondisk::chunk_ratio(p.logical_sector, p.block_size);
    let entries = if p.has_parent {
        ondisk::diff_bat_entries(blocks, ratio)
    } else {
        ondisk::bat_entries(blocks, ratio)
    };
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
    let (bad, bitmaps) = read_bat(f, len, &regions.bat, &used, &p, ratio, &table, &mut end)?;
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
            logical_sector: p.logical_sector,
            diff: None,
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
        data_write_guid: h.data_write_guid,
        diff: locator.map(|locator| DiffParsed {
            locator,
            logical_sector: p.logical_sector,
            bitmaps,
        }),
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

/// The metadata items fusex needs, from the metadata region: the parameters, and for a
/// differencing image its parent locator.
fn read_params(
    f: &std::fs::File,
    region: Region,
) -> Result<(ondisk::Params, Option<ondisk::ParentLocator>), ParseError> {
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
    let p = ondisk::parse_params(&fp, &size, &lss, &pss)?;
    if !p.has_parent {
        return Ok((p, None));
    }
    // At most 1 MiB: the metadata table's check bounds every item.
    let Some((off, len)) = items.parent_locator else {
        return Err(
            "it is a differencing image (\"has parent\") but its metadata has no parent \
             locator: the image is damaged"
                .into(),
        );
    };
    let mut b = vec![0u8; len as usize];
    f.read_exact_at(&mut b, region.offset + off)?;
    let locator = ondisk::parse_parent_locator(&b)?;
    Ok((p, Some(locator)))
}

/// BAT entries read at once: 512 KiB.
const BAT_CHUNK: u64 = 64 << 10;

/// Reads the BAT into `table`, checking every payload entry: a FULLY_PRESENT block (and, in a
/// differencing image, a PARTIALLY_PRESENT one) must lie inside the file, clear of `used` and
/// of every other block. Returns the bad blocks, sorted, and for a differencing image each
/// chunk's sector bitmap block (0 for none; one outside the file, over metadata or over a
/// block is not used, and the chunk's partially present blocks are bad); raises `end` past
/// every block (and sector bitmap block) in the file.
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
) -> Result<(Vec<u64>, Box<[u64]>), ParseError> {
    let blocks = table.len();
    let diff = p.has_parent;
    let entries = if diff {
        ondisk::diff_bat_entries(blocks, ratio)
    } else {
        ondisk::bat_entries(blocks, ratio)
    };
    let bs = p.block_size;
    let mut bad = Vec::new();
    // Each present block as (offset in MiB << 23 | block): a block past 2^41 MiB is outside
    // any file, and the table holds fewer than 2^23 blocks.
    let mut placed: Vec<u64> = Vec::new();
    // Differencing: partially present blocks (ascending) and each chunk's sector bitmap (at
    // most 2^23 / 16 chunks: the table's bound over the smallest chunk ratio).
    let mut partial: Vec<u64> = Vec::new();
    let mut bitmaps = vec![
        0u64;
        if diff {
            blocks.div_ceil(ratio) as usize
        } else {
            0
        }
    ];
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
                if st != state::SB_PRESENT {
                    continue;
                }
                let r = Region {
                    offset: host,
                    length: ondisk::SB_BLOCK,
                };
                if !diff {
                    // Fixed and dynamic images have no sector bitmaps; one present anyway
                    // is never read, but no new block goes over it.
                    if r.end() <= len {
                        *end = (*end).max(r.end());
                    }
                } else if host >= ondisk::HEADER_SECTION
                    && host >> 20 < 1 << 41
                    && r.end() <= len
                    && !used.iter().any(|u| u.overlaps(r))
                {
                    *end = (*end).max(r.end());
                    if let Some(slot) = bitmaps.get_mut((index / (ratio + 1)) as usize) {
                        *slot = host;
                    }
                }
                continue;
            };
            if block >= blocks {
                // The last chunk of a differencing image's BAT past the disk's end.
                continue;
            }
            match st {
                state::NOT_PRESENT | state::UNDEFINED => {}
                // Zeroes, not the parent's bytes, in a differencing image too.
                state::UNMAPPED | state::UNMAPPED_V095 if diff => table.set(block, Entry::Zero),
                state::UNMAPPED | state::UNMAPPED_V095 => {}
                state::ZERO => table.set(block, Entry::Zero),
                state::FULLY_PRESENT | state::PARTIALLY_PRESENT
                    if st == state::FULLY_PRESENT || diff =>
                {
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
                        if st == state::PARTIALLY_PRESENT {
                            partial.push(block);
                        }
                    }
                }
                // PARTIALLY_PRESENT outside a differencing image, and the reserved 4.
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
    if diff {
        check_bitmaps(&mut bitmaps, &placed, bs, &mut bad);
        for &b in &partial {
            if bitmaps[(b / ratio) as usize] == 0 {
                bad.push(b);
            }
        }
    }
    for &v in &placed {
        let block = block_of(v);
        let flags = if partial.binary_search(&block).is_ok() {
            PARTIAL
        } else {
            0
        };
        table.set(
            block,
            Entry::Data {
                host: mib(v),
                flags,
            },
        );
    }
    bad.sort_unstable();
    bad.dedup();
    for &b in &bad {
        table.set(b, Entry::Bad);
    }
    Ok((bad, bitmaps.into_boxed_slice()))
}

/// Drops every sector bitmap block that overlaps another or a payload block (`placed`, sorted
/// as [`read_bat`] packs it, of `bs` bytes each); such a payload block is bad too, since which
/// of the two entries is wrong cannot be told.
fn check_bitmaps(bitmaps: &mut [u64], placed: &[u64], bs: u64, bad: &mut Vec<u64>) {
    let mut sb: Vec<(u64, usize)> = bitmaps
        .iter()
        .enumerate()
        .filter(|(_, &h)| h != 0)
        .map(|(c, &h)| (h, c))
        .collect();
    sb.sort_unstable();
    let mut drop = vec![false; sb.len()];
    for k in 1..sb.len() {
        if sb[k - 1].0 + ondisk::SB_BLOCK > sb[k].0 {
            drop[k - 1] = true;
            drop[k] = true;
        }
    }
    for (k, &(h, _)) in sb.iter().enumerate() {
        // Payload blocks are all `bs` long: of those starting before this bitmap ends, the
        // last one reaches furthest.
        let before = placed.partition_point(|&v| (v >> 23) << 20 < h + ondisk::SB_BLOCK);
        if let Some(&v) = before.checked_sub(1).and_then(|j| placed.get(j)) {
            if ((v >> 23) << 20) + bs > h {
                drop[k] = true;
                bad.push(v & ((1 << 23) - 1));
            }
        }
    }
    for (k, &(_, c)) in sb.iter().enumerate() {
        if drop[k] {
            bitmaps[c] = 0;
        }
    }
}

#[cfg(test)]
mod tests;
