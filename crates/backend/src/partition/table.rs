//! Reading a disk's partition table: MBR (primaries, and logical partitions in the chain of
//! extended boot records) and GPT (header and entry array checked against their CRCs, the
//! backup header when the primary is damaged). Every number comes from the image and is
//! untrusted: each is checked against the image's size before anything is read, the EBR chain
//! is bounded and may not loop, and the GPT entry array has a size cap.

use std::collections::HashSet;
use std::fmt;
use std::io;

use super::crc32::crc32;
use crate::fields::{le16, le32, le64};

/// Partition tables use 512-byte sectors on image files; GPT is also looked for with 4096-byte
/// ones (a disk image copied from a 4Kn drive).
pub const SECTOR: u64 = 512;

/// The most logical partitions followed in an extended partition's chain (Linux's own limit
/// is its minor numbers; a chain this long is damage or an attack).
pub const MAX_LOGICAL: usize = 256;

/// The largest GPT entry array read (the usual one is 16 KiB: 128 entries of 128 bytes).
pub const MAX_GPT_ARRAY: u64 = 4 << 20;

/// Where the partition table's bytes come from: the image as its backend serves it (so a
/// table inside a qcow2 or VMDK image, or behind NBD, is read the same way).
#[allow(async_fn_in_trait)] // used on one thread, never sent
pub trait Source {
    /// The image's size in bytes.
    fn size(&self) -> u64;
    /// Fills `buf` from `off`; it is an error if the image ends first.
    async fn read(&mut self, off: u64, buf: &mut [u8]) -> io::Result<()>;
}

/// Which kind of table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// The DOS partition table of the first sector.
    Mbr,
    /// The GUID partition table (behind a protective MBR).
    Gpt,
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Scheme::Mbr => "MBR",
            Scheme::Gpt => "GPT",
        })
    }
}

/// What a partition is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    /// An MBR primary partition, with its type byte.
    Primary(u8),
    /// The MBR extended partition: a container of logical partitions, not a filesystem.
    Extended,
    /// A logical partition inside the extended one, with its type byte.
    Logical(u8),
    /// A GPT entry (its type GUID, as text).
    Gpt(String),
}

/// One partition, as Linux numbers it: MBR primaries 1–4 by slot, logical partitions 5 on in
/// chain order, GPT entries by their index in the array plus one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    /// The number Linux gives it (`sda<number>`).
    pub number: u32,
    /// First byte in the image.
    pub start: u64,
    /// Length in bytes.
    pub len: u64,
    /// What it is.
    pub kind: Kind,
}

/// A disk's partitions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    /// MBR or GPT.
    pub scheme: Scheme,
    /// Every partition there is, in number order.
    pub parts: Vec<Part>,
}

impl Table {
    /// The partitions, for an error message: `1 (1 MiB at 1 MiB), 2 (...)`.
    pub fn listing(&self) -> String {
        if self.parts.is_empty() {
            return "none".into();
        }
        self.parts
            .iter()
            .map(|p| {
                let what = if p.kind == Kind::Extended {
                    ", extended"
                } else {
                    ""
                };
                format!(
                    "{} ({} at {}{what})",
                    p.number,
                    human(p.len),
                    human(p.start)
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// A size for people: whole KiB/MiB/GiB when exact, else bytes.
fn human(n: u64) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if n >= 1 << shift && n.is_multiple_of(1 << shift) {
            return format!("{} {unit}", n >> shift);
        }
    }
    format!("{n} bytes")
}

/// Why no partition table could be read.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    /// The first sector does not end in 0x55AA.
    #[error("it has no partition table (no MBR signature at the end of its first sector)")]
    NoTable,
    /// An MBR that is not one, or whose numbers do not fit the image.
    #[error("its MBR is damaged: {0}")]
    BadMbr(String),
    /// A protective MBR whose GPT cannot be used.
    #[error("its GPT is damaged: {0}")]
    BadGpt(String),
    /// Reading the image failed.
    #[error("cannot read its partition table: {0}")]
    Io(io::Error),
}

/// One of the four 16-byte entries of an MBR or EBR.
#[derive(Clone, Copy, Debug)]
struct Entry {
    boot: u8,
    kind: u8,
    lba: u64,
    sectors: u64,
}

fn entries(sector: &[u8; 512]) -> [Entry; 4] {
    std::array::from_fn(|i| {
        let e = &sector[446 + 16 * i..446 + 16 * (i + 1)];
        Entry {
            boot: e[0],
            kind: e[4],
            lba: le32(e, 8) as u64,
            sectors: le32(e, 12) as u64,
        }
    })
}

fn is_extended(kind: u8) -> bool {
    matches!(kind, 0x05 | 0x0f | 0x85)
}

const GPT_PROTECTIVE: u8 = 0xee;

/// Reads the partition table of `src`.
pub async fn read<S: Source>(src: &mut S) -> Result<Table, TableError> {
    let size = src.size();
    if size < SECTOR {
        return Err(TableError::NoTable);
    }
    let mut mbr = [0u8; 512];
    src.read(0, &mut mbr).await.map_err(TableError::Io)?;
    if mbr[510..512] != [0x55, 0xaa] {
        return Err(TableError::NoTable);
    }
    let slots = entries(&mbr);
    for (i, e) in slots.iter().enumerate() {
        if e.boot != 0 && e.boot != 0x80 {
            return Err(TableError::BadMbr(format!(
                "entry {} has boot flag {:#04x} (0x00 or 0x80 expected): this first sector is \
                 no partition table",
                i + 1,
                e.boot
            )));
        }
    }
    if slots.iter().any(|e| e.kind == GPT_PROTECTIVE) {
        return gpt(src, size).await;
    }
    mbr_parts(src, size, &slots).await
}

/// The byte range of `sectors` sectors from `lba`, checked to lie inside the image.
fn range(
    lba: u64,
    sectors: u64,
    size: u64,
    what: &dyn Fn() -> String,
) -> Result<(u64, u64), String> {
    let start = lba.checked_mul(SECTOR);
    let len = sectors.checked_mul(SECTOR);
    match (start, len) {
        (Some(s), Some(l)) if s.checked_add(l).is_some_and(|e| e <= size) => Ok((s, l)),
        _ => Err(format!(
            "{} (sectors {lba}..{}) reaches past the image's end ({size} bytes)",
            what(),
            lba.saturating_add(sectors)
        )),
    }
}

async fn mbr_parts<S: Source>(
    src: &mut S,
    size: u64,
    slots: &[Entry; 4],
) -> Result<Table, TableError> {
    let mut parts = Vec::new();
    let mut extended = None;
    for (i, e) in slots.iter().enumerate() {
        if e.kind == 0 || e.sectors == 0 {
            continue;
        }
        let number = i as u32 + 1;
        let (start, len) = range(e.lba, e.sectors, size, &|| format!("partition {number}"))
            .map_err(TableError::BadMbr)?;
        if start == 0 {
            return Err(TableError::BadMbr(format!(
                "partition {number} starts at sector 0, over the MBR itself"
            )));
        }
        let kind = if is_extended(e.kind) {
            if extended.is_some() {
                return Err(TableError::BadMbr(
                    "it has two extended partitions".to_string(),
                ));
            }
            extended = Some((e.lba, e.sectors));
            Kind::Extended
        } else {
            Kind::Primary(e.kind)
        };
        parts.push(Part {
            number,
            start,
            len,
            kind,
        });
    }
    if let Some((ext_lba, ext_sectors)) = extended {
        logical(src, size, ext_lba, ext_sectors, &mut parts).await?;
    }
    Ok(Table {
        scheme: Scheme::Mbr,
        parts,
    })
}

/// Walks the chain of extended boot records: each holds one logical partition (its start
/// relative to that EBR) and a link to the next EBR (relative to the extended partition's
/// start). Bounded by [`MAX_LOGICAL`], refusing a link back to an EBR already read and any
/// EBR or partition outside the extended partition.
async fn logical<S: Source>(
    src: &mut S,
    size: u64,
    ext_lba: u64,
    ext_sectors: u64,
    parts: &mut Vec<Part>,
) -> Result<(), TableError> {
    let ext_end = ext_lba + ext_sectors; // checked by `range` already
    let mut seen = HashSet::new();
    let mut ebr = ext_lba;
    let mut number = 5;
    for _ in 0..MAX_LOGICAL {
        if !seen.insert(ebr) {
            return Err(TableError::BadMbr(format!(
                "its chain of logical partitions loops back to sector {ebr}"
            )));
        }
        if ebr < ext_lba || ebr >= ext_end {
            return Err(TableError::BadMbr(format!(
                "an extended boot record at sector {ebr} lies outside the extended partition \
                 (sectors {ext_lba}..{ext_end})"
            )));
        }
        let mut sector = [0u8; 512];
        src.read(ebr * SECTOR, &mut sector)
            .await
            .map_err(TableError::Io)?;
        if sector[510..512] != [0x55, 0xaa] {
            // Linux stops at an EBR without the signature (an empty extended partition has
            // none at all).
            return Ok(());
        }
        let e = entries(&sector);
        let (data, link) = (e[0], e[1]);
        if data.kind != 0 && data.sectors != 0 {
            let lba = ebr.saturating_add(data.lba);
            if lba <= ebr || lba.saturating_add(data.sectors) > ext_end {
                return Err(TableError::BadMbr(format!(
                    "logical partition {number} (sectors {lba}..{}) lies outside the extended \
                     partition (sectors {ext_lba}..{ext_end})",
                    lba.saturating_add(data.sectors)
                )));
            }
            let (start, len) = range(lba, data.sectors, size, &|| {
                format!("logical partition {number}")
            })
            .map_err(TableError::BadMbr)?;
            parts.push(Part {
                number,
                start,
                len,
                kind: Kind::Logical(data.kind),
            });
            number += 1;
        }
        if link.kind == 0 || link.sectors == 0 || !is_extended(link.kind) {
            return Ok(());
        }
        ebr = ext_lba.saturating_add(link.lba);
    }
    Err(TableError::BadMbr(format!(
        "its extended partition chains more than {MAX_LOGICAL} logical partitions"
    )))
}

/// A GPT header's fields fusex uses.
struct Header {
    entries_lba: u64,
    count: u64,
    entry_size: u64,
    entries_crc: u32,
    first_usable: u64,
    last_usable: u64,
}

/// Reads and checks the GPT header at `lba` with `lbs`-byte sectors.
async fn header<S: Source>(src: &mut S, lbs: u64, lba: u64) -> Result<Header, String> {
    let size = src.size();
    let at = lba
        .checked_mul(lbs)
        .filter(|&a| a.checked_add(lbs).is_some_and(|e| e <= size))
        .ok_or_else(|| format!("header at sector {lba} lies past the image's end"))?;
    let mut h = vec![0u8; lbs as usize];
    src.read(at, &mut h).await.map_err(|e| e.to_string())?;
    if &h[0..8] != b"EFI PART" {
        return Err(format!("no GPT header signature at sector {lba}"));
    }
    let hsize = le32(&h, 12) as u64;
    if !(92..=lbs).contains(&hsize) {
        return Err(format!("header at sector {lba} claims {hsize} bytes"));
    }
    let want = le32(&h, 16);
    let mut copy = h[..hsize as usize].to_vec();
    copy[16..20].fill(0);
    if crc32(&copy) != want {
        return Err(format!("header at sector {lba} fails its CRC"));
    }
    if le64(&h, 24) != lba {
        return Err(format!(
            "header at sector {lba} says it is at sector {}",
            le64(&h, 24)
        ));
    }
    let hdr = Header {
        first_usable: le64(&h, 40),
        last_usable: le64(&h, 48),
        entries_lba: le64(&h, 72),
        count: le32(&h, 80) as u64,
        entry_size: le32(&h, 84) as u64,
        entries_crc: le32(&h, 88),
    };
    if hdr.entry_size < 128 || !hdr.entry_size.is_power_of_two() || hdr.entry_size > lbs * 8 {
        return Err(format!(
            "header at sector {lba} gives entries of {} bytes (128 × a power of two expected)",
            hdr.entry_size
        ));
    }
    if hdr.count * hdr.entry_size > MAX_GPT_ARRAY {
        return Err(format!(
            "header at sector {lba} gives {} entries of {} bytes, more than fusex reads ({} MiB)",
            hdr.count,
            hdr.entry_size,
            MAX_GPT_ARRAY >> 20
        ));
    }
    if hdr.first_usable > hdr.last_usable
        || hdr.last_usable.checked_mul(lbs).is_none_or(|e| e >= size)
    {
        return Err(format!(
            "header at sector {lba} gives usable sectors {}..={} outside the image",
            hdr.first_usable, hdr.last_usable
        ));
    }
    Ok(hdr)
}

/// Reads a GPT: the primary header at sector 1, or the backup its alternate field (or the
/// last sector) names when the primary is damaged; 512-byte sectors, then 4096-byte ones.
async fn gpt<S: Source>(src: &mut S, size: u64) -> Result<Table, TableError> {
    let mut why = Vec::new();
    for lbs in [SECTOR, 4096] {
        if size < lbs * 3 {
            continue;
        }
        let last = size / lbs - 1;
        match header(src, lbs, 1).await {
            Ok(h) => match gpt_entries(src, lbs, &h).await {
                Ok(t) => return Ok(t),
                Err(e) => why.push(e),
            },
            Err(e) => {
                if lbs == 4096 && e.starts_with("no GPT header signature") {
                    continue;
                }
                why.push(e)
            }
        }
        // The primary is unusable: the backup at the disk's last sector.
        if let Ok(h) = header(src, lbs, last).await {
            if let Ok(t) = gpt_entries(src, lbs, &h).await {
                tracing::warn!(
                    "the primary GPT is damaged ({}): using the backup GPT at the image's end",
                    why.last().map_or("", |s| s.as_str())
                );
                return Ok(t);
            }
        }
    }
    Err(TableError::BadGpt(if why.is_empty() {
        "a protective MBR but no GPT header".into()
    } else {
        format!("{}, and no usable backup", why.join("; "))
    }))
}

async fn gpt_entries<S: Source>(src: &mut S, lbs: u64, h: &Header) -> Result<Table, String> {
    let size = src.size();
    let bytes = h.count * h.entry_size; // bounded by `header`
    let at = h
        .entries_lba
        .checked_mul(lbs)
        .filter(|a| a.checked_add(bytes).is_some_and(|e| e <= size))
        .ok_or_else(|| {
            format!(
                "entry array at sector {} lies past the image's end",
                h.entries_lba
            )
        })?;
    let mut array = vec![0u8; bytes as usize];
    src.read(at, &mut array).await.map_err(|e| e.to_string())?;
    if crc32(&array) != h.entries_crc {
        return Err("its entry array fails its CRC".into());
    }
    let mut parts = Vec::new();
    for (i, e) in array.chunks_exact(h.entry_size as usize).enumerate() {
        if e[..16].iter().all(|&b| b == 0) {
            continue;
        }
        let number = i as u32 + 1;
        let (first, last) = (le64(e, 32), le64(e, 40));
        if first > last || first < h.first_usable || last > h.last_usable {
            return Err(format!(
                "partition {number} (sectors {first}..={last}) lies outside the usable sectors \
                 {}..={}",
                h.first_usable, h.last_usable
            ));
        }
        // Inside the usable area, which `header` checked against the image's size.
        parts.push(Part {
            number,
            start: first * lbs,
            len: (last - first + 1) * lbs,
            kind: Kind::Gpt(guid(&e[..16])),
        });
    }
    Ok(Table {
        scheme: Scheme::Gpt,
        parts,
    })
}

/// A GUID as GPT stores it (the first three fields little-endian), in its usual text form.
fn guid(b: &[u8]) -> String {
    format!(
        "{:08X}-{:04X}-{:04X}-{:02X}{:02X}-{}",
        le32(b, 0),
        le16(b, 4),
        le16(b, 6),
        b[8],
        b[9],
        b[10..16]
            .iter()
            .map(|x| format!("{x:02X}"))
            .collect::<String>()
    )
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// An image in memory.
    pub struct Mem(pub Vec<u8>);

    impl Source for Mem {
        fn size(&self) -> u64 {
            self.0.len() as u64
        }
        async fn read(&mut self, off: u64, buf: &mut [u8]) -> io::Result<()> {
            let off = off as usize;
            let src = self
                .0
                .get(off..off + buf.len())
                .ok_or_else(|| io::Error::from_raw_os_error(libc::EIO))?;
            buf.copy_from_slice(src);
            Ok(())
        }
    }

    fn run(img: &mut Mem) -> Result<Table, TableError> {
        let eng = engine::Engine::new(&engine::EngineConfig::default()).unwrap();
        eng.block_on(read(img)).unwrap()
    }

    /// The table read from `img`, checked to be a `scheme` table, and its partitions as
    /// (number, start, length).
    fn parts_of(img: Vec<u8>, scheme: Scheme) -> (Table, Vec<(u32, u64, u64)>) {
        let t = run(&mut Mem(img)).unwrap();
        assert_eq!(t.scheme, scheme);
        let got = t.parts.iter().map(|p| (p.number, p.start, p.len)).collect();
        (t, got)
    }

    fn put_entry(img: &mut [u8], sector: u64, slot: usize, kind: u8, lba: u32, n: u32) {
        let at = sector as usize * 512 + 446 + 16 * slot;
        img[at + 4] = kind;
        img[at + 8..at + 12].copy_from_slice(&lba.to_le_bytes());
        img[at + 12..at + 16].copy_from_slice(&n.to_le_bytes());
        let sig = sector as usize * 512 + 510;
        img[sig..sig + 2].copy_from_slice(&[0x55, 0xaa]);
    }

    /// An MBR disk of 8 MiB: primaries 1 and 2, extended 3 with logicals 5 and 6.
    pub fn mbr_disk() -> Vec<u8> {
        let mut img = vec![0u8; 8 << 20];
        put_entry(&mut img, 0, 0, 0x83, 2048, 2048);
        put_entry(&mut img, 0, 1, 0x83, 4096, 2048);
        put_entry(&mut img, 0, 2, 0x05, 6144, 8192);
        // EBR 1 at 6144: logical at +2048, next EBR at ext+4096.
        put_entry(&mut img, 6144, 0, 0x83, 2048, 1024);
        put_entry(&mut img, 6144, 1, 0x05, 4096, 3072);
        // EBR 2 at 10240: logical at +2048, no next.
        put_entry(&mut img, 10240, 0, 0x83, 2048, 1024);
        img
    }

    #[test]
    fn mbr_with_logical_partitions() {
        let (t, got) = parts_of(mbr_disk(), Scheme::Mbr);
        assert_eq!(
            got,
            [
                (1, 1 << 20, 1 << 20),
                (2, 2 << 20, 1 << 20),
                (3, 3 << 20, 4 << 20),
                (5, (6144 + 2048) * 512, 512 << 10),
                (6, (10240 + 2048) * 512, 512 << 10),
            ]
        );
        assert_eq!(t.parts[2].kind, Kind::Extended);
    }

    #[test]
    fn a_looping_ebr_chain_is_refused() {
        let mut img = mbr_disk();
        // EBR 2 links back to EBR 1.
        put_entry(&mut img, 10240, 1, 0x05, 0, 3072);
        let e = run(&mut Mem(img)).unwrap_err().to_string();
        assert!(e.contains("loops back"), "{e}");
    }

    #[test]
    fn hostile_mbr_numbers_are_refused() {
        let mut img = mbr_disk();
        put_entry(&mut img, 0, 0, 0x83, u32::MAX - 5, u32::MAX);
        let e = run(&mut Mem(img)).unwrap_err().to_string();
        assert!(e.contains("past the image's end"), "{e}");
        let mut img = mbr_disk();
        put_entry(&mut img, 6144, 0, 0x83, 2048, 9000);
        let e = run(&mut Mem(img)).unwrap_err().to_string();
        assert!(e.contains("outside the extended partition"), "{e}");
        let mut img = mbr_disk();
        img[446] = 0x12;
        let e = run(&mut Mem(img)).unwrap_err().to_string();
        assert!(e.contains("boot flag"), "{e}");
        let e = run(&mut Mem(vec![0u8; 4096])).unwrap_err().to_string();
        assert!(e.contains("no partition table"), "{e}");
        let e = run(&mut Mem(vec![0u8; 100])).unwrap_err().to_string();
        assert!(e.contains("no partition table"), "{e}");
    }

    /// A GPT disk of 8 MiB with partitions 1 (1 MiB at 1 MiB) and 3 (2 MiB at 4 MiB).
    pub fn gpt_disk() -> Vec<u8> {
        let mut img = vec![0u8; 8 << 20];
        let sectors = img.len() as u64 / 512;
        put_entry(&mut img, 0, 0, GPT_PROTECTIVE, 1, (sectors - 1) as u32);
        let mut array = vec![0u8; 128 * 128];
        for (i, first, last) in [(0usize, 2048u64, 4095u64), (2, 8192, 12287)] {
            let e = &mut array[i * 128..(i + 1) * 128];
            e[0] = 0xaf; // a type GUID that is not all zero
            e[32..40].copy_from_slice(&first.to_le_bytes());
            e[40..48].copy_from_slice(&last.to_le_bytes());
        }
        let write_header = |img: &mut Vec<u8>, lba: u64, alt: u64, entries: u64| {
            let mut h = vec![0u8; 92];
            h[0..8].copy_from_slice(b"EFI PART");
            h[8..12].copy_from_slice(&0x0001_0000u32.to_le_bytes());
            h[12..16].copy_from_slice(&92u32.to_le_bytes());
            h[24..32].copy_from_slice(&lba.to_le_bytes());
            h[32..40].copy_from_slice(&alt.to_le_bytes());
            h[40..48].copy_from_slice(&34u64.to_le_bytes());
            h[48..56].copy_from_slice(&(sectors - 34).to_le_bytes());
            h[72..80].copy_from_slice(&entries.to_le_bytes());
            h[80..84].copy_from_slice(&128u32.to_le_bytes());
            h[84..88].copy_from_slice(&128u32.to_le_bytes());
            h[88..92].copy_from_slice(&crc32(&array).to_le_bytes());
            let c = crc32(&h);
            h[16..20].copy_from_slice(&c.to_le_bytes());
            let at = lba as usize * 512;
            img[at..at + 92].copy_from_slice(&h);
            let e = entries as usize * 512;
            img[e..e + array.len()].copy_from_slice(&array);
        };
        write_header(&mut img, 1, sectors - 1, 2);
        write_header(&mut img, sectors - 1, 1, sectors - 33);
        img
    }

    #[test]
    fn gpt_and_its_backup() {
        let (t, got) = parts_of(gpt_disk(), Scheme::Gpt);
        assert_eq!(got, [(1, 1 << 20, 1 << 20), (3, 4 << 20, 2 << 20)]);
        // A damaged primary header: the backup serves.
        let mut img = gpt_disk();
        img[512 + 40] ^= 1;
        assert_eq!(run(&mut Mem(img)).unwrap().parts, t.parts);
        // A damaged entry array under both headers: refused.
        let mut img = gpt_disk();
        img[2 * 512 + 33] ^= 1;
        let n = img.len();
        img[n - 33 * 512 + 33] ^= 1;
        let e = run(&mut Mem(img)).unwrap_err().to_string();
        assert!(e.contains("fails its CRC"), "{e}");
    }

    #[test]
    fn hostile_gpt_numbers_are_refused() {
        // An entry past the usable area, with CRCs made to match.
        let mut img = gpt_disk();
        let sectors = img.len() as u64 / 512;
        let e = 2 * 512 + 40;
        img[e..e + 8].copy_from_slice(&(sectors + 10).to_le_bytes());
        let array_crc = crc32(&img[1024..1024 + 128 * 128]);
        img[512 + 88..512 + 92].copy_from_slice(&array_crc.to_le_bytes());
        primary_refused(img, "outside the usable sectors");
        // A huge entry count.
        let mut img = gpt_disk();
        img[512 + 80..512 + 84].copy_from_slice(&u32::MAX.to_le_bytes());
        primary_refused(img, "more than fusex reads");
    }

    /// A [`gpt_disk`] whose primary header was changed, its CRC made to match and the backup
    /// destroyed (so the primary's verdict stands): refused with an error naming `want`.
    fn primary_refused(mut img: Vec<u8>, want: &str) {
        img[512 + 16..512 + 20].fill(0);
        let c = crc32(&img[512..512 + 92]);
        img[512 + 16..512 + 20].copy_from_slice(&c.to_le_bytes());
        let n = img.len();
        img[n - 512..n - 504].fill(0);
        let err = run(&mut Mem(img)).unwrap_err().to_string();
        assert!(err.contains(want), "{err}");
    }
}

#[cfg(test)]
mod props {
    use super::tests::{gpt_disk, mbr_disk, Mem};
    use super::*;
    use proptest::prelude::*;

    fn run(img: Vec<u8>) -> (u64, Result<Table, TableError>) {
        let size = img.len() as u64;
        let eng = engine::Engine::new(&engine::EngineConfig::default()).unwrap();
        (size, eng.block_on(read(&mut Mem(img))).unwrap())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// Any bytes in the table sectors of a valid disk (MBR, EBRs, GPT header and array):
        /// no panic, and every partition found lies inside the image.
        #[test]
        fn damaged_tables_never_escape(
            gpt in any::<bool>(),
            flips in proptest::collection::vec((0usize..40 * 512, any::<u8>()), 1..24),
        ) {
            let mut img = if gpt { gpt_disk() } else { mbr_disk() };
            for (at, v) in flips {
                // The first sectors, the EBRs at 6144 and 10240, the backup GPT at the end.
                let at = match at / 512 {
                    0..=33 => at,
                    34..=36 => 6144 * 512 + at % 512,
                    37 => 10240 * 512 + at % 512,
                    _ => img.len() - 512 + at % 512,
                };
                img[at] = v;
            }
            let (size, r) = run(img);
            if let Ok(t) = r {
                for p in t.parts {
                    prop_assert!(p.start.checked_add(p.len).is_some_and(|e| e <= size));
                }
            }
        }
    }
}
