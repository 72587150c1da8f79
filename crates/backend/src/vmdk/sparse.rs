//! A hosted sparse extent (`KDMV`) on the block-table core: grains are the core's blocks,
//! the grain directory and grain tables are read once at open into the core's table, and a
//! new grain is written data first, then its grain table entry (and the redundant one).
//!
//! Grain tables missing from the directory (a directory entry of 0) are made at open when the
//! extent is opened for writing: zeroed tables appended at the file's end, then the directory
//! entries pointing at them; so an allocation never has to make a table, and never writes
//! anywhere but into the new grain and one table entry (or two, with the redundant tables).
//!
//! streamOptimized extents (compressed grains behind markers) are read-only: their table
//! entries are flagged, and [`BlockFormat::read_flagged`] inflates the grain.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use crate::blocktable::{both, sharing, BlockFormat, Entry, Layout, ParseError, Table, MAX_HOST};
use crate::fields::le32;
use crate::ringfile::RingFile;

use super::header::{Header, FLAG_COMPRESSED, FLAG_REDUNDANT, FLAG_ZEROED_GRAIN, GD_AT_END, MAGIC};

const SECTOR: u64 = 512;

/// An entry flag: the grain is compressed behind a grain marker.
const COMPRESSED: u8 = 1;

/// A grain marker: the guest sector (u64) and the compressed size (u32) before the data.
const MARKER: u64 = 12;

/// The format state the core calls back into.
pub struct Sparse {
    grain_bytes: u64,
    gtes: u64,
    /// Each grain table's file offset (bytes), by directory index.
    gd: Vec<u64>,
    /// The redundant tables' offsets, when the extent keeps them.
    rgd: Option<Vec<u64>>,
    /// Grains live below here (a grain table entry holds a u32 sector number).
    max_host: u64,
}

impl BlockFormat for Sparse {
    fn name(&self) -> &'static str {
        "vmdk"
    }

    fn footprint(&self) -> u64 {
        self.grain_bytes
    }

    async fn reserve(&self, file: &RingFile, _host: u64, end: u64) -> io::Result<bool> {
        if end > self.max_host {
            // A grain table entry cannot point there.
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        // The whole grain exists in the file from now on (qemu-img check wants every grain
        // inside it), and past the old end it reads as zeroes.
        file.extend_to(end)?;
        Ok(true)
    }

    async fn commit(&self, file: &RingFile, block: u64, host: u64) -> io::Result<Entry> {
        let (gt, i) = ((block / self.gtes) as usize, block % self.gtes);
        let value = ((host / SECTOR) as u32).to_le_bytes();
        let at = self.gd.get(gt).copied().unwrap_or(0);
        if at == 0 {
            // Every table was made at open; a missing one means the table was bad.
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        let redundant = self
            .rgd
            .as_ref()
            .and_then(|r| r.get(gt))
            .copied()
            .filter(|&r| r != 0);
        // The two tables' entries at once: each lands whole or not at all (one aligned 4-byte
        // write), and the grain is in use only once both did.
        let second = async {
            match redundant {
                Some(r) => file.write_full(&value, r + 4 * i).await,
                None => Ok(()),
            }
        };
        both(file.write_full(&value, at + 4 * i), second).await?;
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
        let Entry::Data { host, .. } = entry else {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        };
        let eio = || io::Error::from_raw_os_error(libc::EIO);
        let mut head = [0u8; MARKER as usize];
        file.read_full(&mut head, host).await?;
        let lba = u64::from_le_bytes(head[..8].try_into().unwrap_or_default());
        let size = u32::from_le_bytes(head[8..12].try_into().unwrap_or_default()) as u64;
        // A compressed grain is no larger than the grain (plus deflate's few bytes of framing
        // for data that does not compress).
        if size == 0 || size > self.grain_bytes + 4096 || lba != block * (self.grain_bytes / SECTOR)
        {
            return Err(eio());
        }
        let mut packed = vec![0u8; size as usize];
        file.read_full(&mut packed, host + MARKER).await?;
        let grain = miniz_oxide::inflate::decompress_to_vec_zlib_with_limit(
            &packed,
            self.grain_bytes as usize,
        )
        .map_err(|_| eio())?;
        let from = within as usize;
        for (i, b) in buf.iter_mut().enumerate() {
            // A short last grain reads as zeroes past its end.
            *b = grain.get(from + i).copied().unwrap_or(0);
        }
        Ok(())
    }

    async fn write_flagged(
        &self,
        _file: &RingFile,
        _table: &Table,
        _block: u64,
        _entry: Entry,
        _within: u64,
        _data: &[u8],
    ) -> io::Result<Entry> {
        // Compressed extents are opened read-only.
        Err(io::Error::from_raw_os_error(libc::EROFS))
    }
}

/// What opening a sparse extent found.
pub struct Opened {
    /// The format state.
    pub fmt: Sparse,
    /// Every grain's entry.
    pub table: Table,
    /// For the core.
    pub layout: Layout,
    /// The embedded descriptor's bytes, if any.
    pub descriptor: Option<Vec<u8>>,
}

/// A byte range of metadata in the file.
type Range = (u64, u64);

fn overlaps(a: Range, b: Range) -> bool {
    a.0 < b.1 && b.0 < a.1
}

/// `n` bytes of `f` at `off`, which the caller checked lie inside it.
fn read_at(f: &File, off: u64, n: u64) -> io::Result<Vec<u8>> {
    let mut v = vec![0u8; n as usize];
    f.read_exact_at(&mut v, off)?;
    Ok(v)
}

/// The header in force: the first sector's, or for a stream the footer's (the sector before
/// the end-of-stream marker, after a footer marker).
fn header(f: &File, len: u64) -> Result<(Header, Option<Range>), ParseError> {
    if len < SECTOR {
        return Err("it is shorter than a sparse extent header"
            .to_string()
            .into());
    }
    let first = Header::parse(&read_at(f, 0, SECTOR)?)?;
    if first.gd_offset != GD_AT_END {
        return Ok((first, None));
    }
    if len < 3 * SECTOR {
        return Err(
            "its grain directory is in a footer, but the file ends first"
                .to_string()
                .into(),
        );
    }
    let tail = read_at(f, len - 3 * SECTOR, 3 * SECTOR)?;
    let marker_type = u32::from_le_bytes(tail[12..16].try_into().unwrap_or_default());
    let eos = &tail[1024..];
    let footer_ok = u32::from_le_bytes(tail[8..12].try_into().unwrap_or_default()) == 0
        && marker_type == 3
        && eos.iter().all(|&b| b == 0)
        && u32::from_le_bytes(tail[512..516].try_into().unwrap_or_default()) == MAGIC;
    if !footer_ok {
        return Err(
            "its grain directory is in a footer, but there is no valid footer at the \
                    file's end (an unfinished stream?)"
                .to_string()
                .into(),
        );
    }
    let footer = Header::parse(&tail[512..1024])?;
    if footer.gd_offset == GD_AT_END {
        return Err("its footer does not say where the grain directory is"
            .to_string()
            .into());
    }
    Ok((footer, Some((len - 3 * SECTOR, len))))
}

/// Sector `s` as a byte offset with `n` bytes after it inside a file of `len` bytes.
fn inside(s: u64, n: u64, len: u64) -> Option<Range> {
    let at = s.checked_mul(SECTOR)?;
    let end = at.checked_add(n)?;
    (end <= len).then_some((at, end))
}

/// How many grains of an extent with header `h` are served when `served` guest bytes of it
/// are (None: all of its capacity): the table holds those grains only, so a header claiming
/// a far larger capacity than its descriptor line costs no memory.
fn served_grains(h: &Header, served: Option<u64>) -> u64 {
    match served {
        Some(bytes) => h.grains().min(bytes.div_ceil(h.grain_bytes())),
        None => h.grains(),
    }
}

/// The grain table entries [`open`] will hold for a sparse extent file of `len` bytes of which
/// `served` guest bytes are served: read from its header alone, so a descriptor's extents can
/// be counted before any table is made.
pub fn entries(f: &File, len: u64, served: Option<u64>) -> Result<u64, ParseError> {
    let (h, _) = header(f, len)?;
    Ok(served_grains(&h, served))
}

/// Reads a sparse extent file of `len` bytes: header, embedded descriptor, grain directory
/// and tables, every grain's entry checked (inside the file, clear of metadata and of other
/// grains; a bad one fails its reads with EIO, and makes a writable open fail). For writing,
/// missing grain tables are made now (see the module docs). Only the first `served` guest
/// bytes (rounded up to a grain; None: the header's capacity) are read and served: a
/// descriptor gives each extent its length, and the rest of the extent is never addressed.
pub fn open(f: &File, len: u64, writable: bool, served: Option<u64>) -> Result<Opened, ParseError> {
    let (h, footer) = header(f, len)?;
    let compressed = h.flags & FLAG_COMPRESSED != 0;
    if compressed && writable {
        return Err(
            "it is streamOptimized (compressed grains), which fusex serves read-only: \
                    drop --writable, or convert it with qemu-img convert -O vmdk"
                .to_string()
                .into(),
        );
    }
    let mut fixed: Vec<Range> = vec![(0, SECTOR)];
    fixed.extend(footer);
    let descriptor = if h.desc_offset != 0 && h.desc_size != 0 {
        let r = inside(h.desc_offset, h.desc_size * SECTOR, len)
            .ok_or_else(|| "its embedded descriptor lies past the file's end".to_string())?;
        fixed.push(r);
        Some(read_at(f, r.0, r.1 - r.0)?)
    } else {
        None
    };
    let grains = served_grains(&h, served);
    let table = Table::new(grains)?;
    // The directory entries of the served grains' tables (only those are read or made).
    let gdes = grains.div_ceil(h.gtes as u64);
    let gd_bytes = gdes * 4;
    let dir = |off: u64, what: &str| -> Result<Vec<u64>, ParseError> {
        let r = inside(off, gd_bytes, len)
            .ok_or_else(|| format!("its {what} (sector {off}) lies past the file's end"))?;
        if overlaps(r, (0, SECTOR)) {
            return Err(format!("its {what} overlaps the header").into());
        }
        let raw = read_at(f, r.0, gd_bytes)?;
        Ok(raw
            .chunks_exact(4)
            .map(|c| le32(c, 0) as u64 * SECTOR)
            .collect())
    };
    let mut gd = dir(h.gd_offset, "grain directory")?;
    fixed.push((
        h.gd_offset * SECTOR,
        (h.gd_offset * SECTOR + gd_bytes).next_multiple_of(SECTOR),
    ));
    let redundant = h.flags & FLAG_REDUNDANT != 0 && h.rgd_offset != 0 && !compressed;
    let mut rgd = if redundant {
        let r = dir(h.rgd_offset, "redundant grain directory")?;
        fixed.push((
            h.rgd_offset * SECTOR,
            (h.rgd_offset * SECTOR + gd_bytes).next_multiple_of(SECTOR),
        ));
        Some(r)
    } else {
        None
    };
    let gt_bytes = h.gt_bytes();
    // Grain tables: inside the file, clear of the fixed metadata and of each other; a bad
    // one makes its grains bad.
    let mut tables: Vec<(Range, usize, bool)> = Vec::new();
    let mut bad_gt = vec![false; gd.len()];
    let mut bad_rgt = false;
    for (redundant, list) in [(false, Some(&gd)), (true, rgd.as_ref())] {
        let Some(list) = list else { continue };
        for (i, &off) in list.iter().enumerate() {
            if off == 0 {
                continue;
            }
            let ok = inside(off / SECTOR, gt_bytes, len)
                .filter(|r| !fixed.iter().any(|&m| overlaps(*r, m)));
            match ok {
                Some(r) => tables.push((r, i, redundant)),
                None if redundant => bad_rgt = true,
                None => bad_gt[i] = true,
            }
        }
    }
    tables.sort();
    for w in 0..tables.len().saturating_sub(1) {
        let ((a, ia, ra), (b, ib, rb)) = (tables[w], tables[w + 1]);
        if overlaps(a, b) {
            for (i, r) in [(ia, ra), (ib, rb)] {
                if r {
                    bad_rgt = true;
                } else {
                    bad_gt[i] = true;
                }
            }
        }
    }
    let mut meta: Vec<Range> = fixed.clone();
    meta.extend(tables.iter().map(|t| t.0));
    meta.sort();
    let hits_meta = |r: Range| {
        // Ranges are sorted by start: only those starting before r's end can overlap.
        let upto = meta.partition_point(|m| m.0 < r.1);
        meta[..upto].iter().any(|&m| overlaps(r, m))
    };
    let grain_bytes = h.grain_bytes();
    let zeroed = h.flags & FLAG_ZEROED_GRAIN != 0;
    // (sector, grain): a grain table entry is a u32 sector and the table has at most 8 Mi
    // grains, so 8 bytes a grain.
    let mut grains_at: Vec<(u32, u32)> = Vec::new();
    let mut bad = 0u64;
    for (gt, &off) in gd.iter().enumerate() {
        let first = gt as u64 * h.gtes as u64;
        let count = (h.gtes as u64).min(grains.saturating_sub(first));
        if bad_gt[gt] {
            for b in first..first + count {
                table.set(b, Entry::Bad);
            }
            bad += count;
            continue;
        }
        if off == 0 {
            continue;
        }
        let raw = read_at(f, off, gt_bytes)?;
        for i in 0..count {
            let at = i as usize * 4;
            let v = le32(&raw, at) as u64;
            let block = first + i;
            let entry = match v {
                0 => Entry::Unallocated,
                1 if zeroed => Entry::Zero,
                v => {
                    let host = v * SECTOR;
                    let span = if compressed { MARKER } else { grain_bytes };
                    let end = host + span;
                    if host >= len || end > MAX_HOST || hits_meta((host, end)) {
                        Entry::Bad
                    } else {
                        if !compressed {
                            grains_at.push((v as u32, block as u32));
                        }
                        Entry::Data {
                            host,
                            flags: if compressed { COMPRESSED } else { 0 },
                        }
                    }
                }
            };
            if entry == Entry::Bad {
                bad += 1;
            }
            table.set(block, entry);
        }
    }
    // Two grains sharing file space: both bad (a write to one would change the other).
    for blk in sharing(&mut grains_at, SECTOR, grain_bytes) {
        if table.get(blk) != Entry::Bad {
            table.set(blk, Entry::Bad);
            bad += 1;
        }
    }
    let mut next_free = len
        .next_multiple_of(SECTOR)
        .max(h.overhead.saturating_mul(SECTOR));
    if writable {
        if bad > 0 || bad_gt.iter().any(|&b| b) || bad_rgt {
            return Err(format!(
                "{bad} of its grain table entries (or its grain tables) point outside the file, \
                 into its metadata or at another grain's data: fusex serves it read-only only \
                 (drop --writable; `qemu-img check` shows the damage)"
            )
            .into());
        }
        let table_span = gt_bytes.next_multiple_of(SECTOR);
        // Missing tables (and their redundant twins): zeroed space first, then the entries.
        const PAST: &str = "its grain tables would lie past what a directory entry can address";
        // The space a new table takes from `next_free` (whose start a hostile header may put
        // near the end of u64: checked, never wrapped back over the metadata), ending where a
        // directory entry (a 32-bit sector number) still reaches.
        let claim = |next_free: &mut u64| -> Result<u64, String> {
            let at = *next_free;
            *next_free = at
                .checked_add(table_span)
                .filter(|end| end / SECTOR <= u32::MAX as u64)
                .ok_or(PAST)?;
            Ok(at)
        };
        let mut made = Vec::new();
        for (i, off) in gd.iter_mut().enumerate() {
            if *off != 0 {
                continue;
            }
            let at = claim(&mut next_free)?;
            let twin = match rgd.as_mut() {
                Some(r) if r.get(i) == Some(&0) => {
                    let t = claim(&mut next_free)?;
                    r[i] = t;
                    Some(t)
                }
                _ => None,
            };
            *off = at;
            made.push((i, at, twin));
        }
        if !made.is_empty() {
            if f.metadata()?.len() < next_free {
                f.set_len(next_free)?;
            }
            for (i, at, twin) in made {
                let v = ((at / SECTOR) as u32).to_le_bytes();
                f.write_all_at(&v, h.gd_offset * SECTOR + 4 * i as u64)?;
                if let Some(t) = twin {
                    let v = ((t / SECTOR) as u32).to_le_bytes();
                    f.write_all_at(&v, h.rgd_offset * SECTOR + 4 * i as u64)?;
                }
            }
            f.sync_data()?;
        }
    }
    Ok(Opened {
        fmt: Sparse {
            grain_bytes,
            gtes: h.gtes as u64,
            gd,
            rgd,
            max_host: (u32::MAX as u64) * SECTOR,
        },
        table,
        layout: Layout {
            block_shift: grain_bytes.trailing_zeros(),
            size: (h.capacity * SECTOR).min(grains * grain_bytes),
            next_free,
            writable,
        },
        descriptor,
    })
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A sparse extent of 128 grains of 4 KiB (64 per grain table), redundant tables, the
    /// zeroed-grain flag; the first four entries of grain tables `gt0` and `gt1` (None: no
    /// table), grains at sectors 8, 16 and 24.
    pub(super) fn image(gt0: Option<[u32; 4]>, gt1: Option<[u32; 4]>) -> tempfile::NamedTempFile {
        let mut b = vec![0u8; 32 * 512];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&1u32.to_le_bytes());
        b[8..12].copy_from_slice(&(1u32 | FLAG_REDUNDANT | FLAG_ZEROED_GRAIN).to_le_bytes());
        b[12..20].copy_from_slice(&1024u64.to_le_bytes());
        b[20..28].copy_from_slice(&8u64.to_le_bytes());
        b[44..48].copy_from_slice(&64u32.to_le_bytes());
        b[48..56].copy_from_slice(&2u64.to_le_bytes());
        b[56..64].copy_from_slice(&1u64.to_le_bytes());
        b[64..72].copy_from_slice(&8u64.to_le_bytes());
        for (i, (gt, sector, twin)) in [(gt0, 3u32, 5u32), (gt1, 4, 6)].into_iter().enumerate() {
            let Some(gt) = gt else { continue };
            b[512 + 4 * i..512 + 4 * i + 4].copy_from_slice(&sector.to_le_bytes());
            b[1024 + 4 * i..1024 + 4 * i + 4].copy_from_slice(&twin.to_le_bytes());
            for (j, v) in gt.iter().enumerate() {
                for s in [sector, twin] {
                    let at = s as usize * 512 + 4 * j;
                    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
                }
            }
        }
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().write_all_at(&b, 0).unwrap();
        f
    }

    #[test]
    fn every_entry_is_checked() {
        let f = image(Some([8, 0, 16, 1]), Some([24, 24, 3, 0xffff]));
        let o = open(f.as_file(), 32 * 512, false, None).ok().unwrap();
        assert!((4..64)
            .chain(68..128)
            .all(|i| o.table.get(i) == Entry::Unallocated));
        let got: Vec<Entry> = [0, 1, 2, 3, 64, 65, 66, 67]
            .iter()
            .map(|&i| o.table.get(i))
            .collect();
        let data = |s: u64| Entry::Data {
            host: s * 512,
            flags: 0,
        };
        assert_eq!(
            got,
            [
                data(8),
                Entry::Unallocated,
                data(16),
                Entry::Zero,
                // Two grains at one place, a grain in a grain table, one past the end.
                Entry::Bad,
                Entry::Bad,
                Entry::Bad,
                Entry::Bad,
            ]
        );
        match open(f.as_file(), 32 * 512, true, None) {
            Err(ParseError::Bad(why)) => assert!(why.contains("read-only only"), "{why}"),
            _ => panic!("a writable open of a damaged extent must fail"),
        }
    }

    #[test]
    fn a_writable_open_makes_missing_tables() {
        let f = image(Some([8, 0, 16, 0]), None);
        let o = open(f.as_file(), 32 * 512, true, None).ok().unwrap();
        // Table 1 and its twin appended at the old end (sector 32), then the directories.
        assert_eq!(o.fmt.gd, [3 * 512, 32 * 512]);
        assert_eq!(o.fmt.rgd.as_deref(), Some(&[5 * 512, 33 * 512][..]));
        assert_eq!(o.layout.next_free, 34 * 512);
        let mut e = [0u8; 4];
        f.as_file().read_exact_at(&mut e, 512 + 4).unwrap();
        assert_eq!(u32::from_le_bytes(e), 32);
        f.as_file().read_exact_at(&mut e, 1024 + 4).unwrap();
        assert_eq!(u32::from_le_bytes(e), 33);
        assert_eq!(f.as_file().metadata().unwrap().len(), 34 * 512);
    }

    /// A header whose metadata overhead reaches past 2^32 sectors, or to the end of the u64
    /// range, leaves no room for a missing table: a writable open is refused and writes nothing
    /// (a wrapped end once put the new tables over the header).
    #[test]
    fn missing_tables_past_any_address_are_refused() {
        let f = image(Some([8, 0, 16, 0]), None);
        for overhead in [1 << 32, u64::MAX / 512, u64::MAX / 256, u64::MAX] {
            f.as_file()
                .write_all_at(&overhead.to_le_bytes(), 64)
                .unwrap();
            let before = std::fs::read(f.path()).unwrap();
            match open(f.as_file(), 32 * 512, true, None) {
                Err(ParseError::Bad(why)) => assert!(why.contains("past what"), "{why}"),
                _ => panic!("overhead {overhead}: a writable open must fail"),
            }
            assert_eq!(
                std::fs::read(f.path()).unwrap(),
                before,
                "overhead {overhead}"
            );
        }
    }
}

#[cfg(test)]
mod props {
    use super::*;
    use crate::blocktable::{testing, TableImage};
    use proptest::prelude::*;

    /// A streamOptimized extent of 128 grains of 4 KiB (64 per grain table, no redundant
    /// tables): grains 0, 1, 2 and 64 compressed behind their markers from sector 8 on,
    /// each grain's bytes its number.
    fn stream_image() -> tempfile::NamedTempFile {
        let mut b = vec![0u8; 8 * 512];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&3u32.to_le_bytes());
        let flags = 1u32 | FLAG_COMPRESSED | super::super::header::FLAG_MARKERS;
        b[8..12].copy_from_slice(&flags.to_le_bytes());
        b[12..20].copy_from_slice(&1024u64.to_le_bytes());
        b[20..28].copy_from_slice(&8u64.to_le_bytes());
        b[44..48].copy_from_slice(&64u32.to_le_bytes());
        b[56..64].copy_from_slice(&2u64.to_le_bytes());
        b[64..72].copy_from_slice(&8u64.to_le_bytes());
        b[77] = 1;
        // The directory at sector 2, its tables at sectors 3 and 4.
        b[1024..1028].copy_from_slice(&3u32.to_le_bytes());
        b[1028..1032].copy_from_slice(&4u32.to_le_bytes());
        for g in [0u64, 1, 2, 64] {
            let packed = miniz_oxide::deflate::compress_to_vec_zlib(&[g as u8; 4096], 6);
            let sector = (b.len() / 512) as u32;
            let entry = if g < 64 { 3 * 512 + 4 * g } else { 4 * 512 } as usize;
            b[entry..entry + 4].copy_from_slice(&sector.to_le_bytes());
            b.extend_from_slice(&(g * 8).to_le_bytes());
            b.extend_from_slice(&(packed.len() as u32).to_le_bytes());
            b.extend_from_slice(&packed);
            b.resize(b.len().next_multiple_of(512), 0);
        }
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().write_all_at(&b, 0).unwrap();
        f
    }

    /// Opens the extent in `f` read-only and reads every grain of it: never a panic, every
    /// grain it maps inside the file and clear of the header, and each read either fills the
    /// grain or fails (bounded: a compressed grain inflates to one grain at most).
    fn open_and_read_all(f: &tempfile::NamedTempFile) -> Result<(), TestCaseError> {
        let len = f.as_file().metadata().unwrap().len();
        let Ok(o) = open(f.as_file(), len, false, None) else {
            return Ok(());
        };
        for b in 0..o.table.len() {
            if let Entry::Data { host, .. } = o.table.get(b) {
                // Never the header, never past the end.
                prop_assert!((512..len).contains(&host), "grain {b} at {host}");
            }
        }
        let file = RingFile::from_file(f.reopen().unwrap(), f.path(), false).unwrap();
        let img = TableImage::new(file, o.fmt, o.table, o.layout);
        let size = crate::BlockBackend::size(&img);
        let grain = img.format().grain_bytes;
        let eng = testing::engine();
        let mut buf = vec![0u8; grain as usize];
        for at in (0..size).step_by(grain as usize) {
            let n = grain.min(size - at) as usize;
            let _ = eng.block_on(img.read(&mut buf[..n], at)).unwrap();
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// A valid small extent with random bytes planted in its header and tables: opening
        /// and reading every grain never panic, and every grain it maps lies inside the file,
        /// clear of the header.
        #[test]
        fn planted_damage_is_contained(
            flips in proptest::collection::vec((0usize..8 * 512, any::<u8>()), 1..16),
        ) {
            let f = super::tests::image(Some([8, 0, 16, 1]), Some([24, 0, 0, 0]));
            for (at, v) in flips {
                f.as_file().write_all_at(&[v], at as u64).unwrap();
            }
            open_and_read_all(&f)?;
        }

        /// The same for a streamOptimized extent, with bytes planted anywhere: in the header,
        /// the tables, the grain markers and the compressed data.
        #[test]
        fn planted_damage_in_compressed_grains_is_contained(
            flips in proptest::collection::vec((0usize..12 * 512, any::<u8>()), 1..16),
        ) {
            let f = stream_image();
            let len = f.as_file().metadata().unwrap().len() as usize;
            for (at, v) in flips {
                f.as_file().write_all_at(&[v], (at % len) as u64).unwrap();
            }
            open_and_read_all(&f)?;
        }
    }

    /// The undamaged stream image reads as written: the proptest above starts from a good one.
    #[test]
    fn the_stream_image_reads() {
        let f = stream_image();
        let len = f.as_file().metadata().unwrap().len();
        let o = open(f.as_file(), len, false, None).ok().unwrap();
        let file = RingFile::from_file(f.reopen().unwrap(), f.path(), false).unwrap();
        let img = TableImage::new(file, o.fmt, o.table, o.layout);
        for (g, want) in [(0u64, 0u8), (1, 1), (2, 2), (3, 0), (64, 64), (127, 0)] {
            assert_eq!(
                testing::read(&img, g * 4096, 4096).unwrap(),
                [want; 4096],
                "{g}"
            );
        }
    }
}
