//! VHDX on-disk structures (MS-VHDX 1.0), parsed from byte buffers: no I/O here, so every check
//! is unit-tested on bytes built by hand. All integers are little-endian; GUIDs are stored as
//! Microsoft lays them out (the first three groups little-endian, the last eight bytes as
//! written).

/// 1 MiB: the unit of every region offset and length, and of BAT file offsets.
pub(super) const MIB: u64 = 1 << 20;
/// The file type identifier's signature at offset 0 (for `--format auto`).
pub const FILE_ID: [u8; 8] = *b"vhdxfile";
/// The two headers' offsets (64 KiB and 128 KiB).
pub(super) const HEADER_AT: [u64; 2] = [64 << 10, 128 << 10];
/// Bytes of a header its checksum covers.
pub(super) const HEADER_LEN: usize = 4096;
/// The region table's offset and its copy's (192 KiB and 256 KiB).
pub(super) const REGION_AT: [u64; 2] = [192 << 10, 256 << 10];
/// Bytes of a region table its checksum covers.
pub(super) const REGION_LEN: usize = 64 << 10;
/// Bytes of the metadata table at the start of the metadata region.
pub(super) const METADATA_TABLE_LEN: usize = 64 << 10;
/// The header section (file identifier, headers, region tables) is the file's first 1 MiB.
pub(super) const HEADER_SECTION: u64 = MIB;
/// Largest virtual disk the format allows: 64 TiB.
pub(super) const MAX_DISK: u64 = 64 << 40;
/// Block sizes the format allows: powers of two from 1 MiB to 256 MiB.
pub(super) const MIN_BLOCK: u64 = MIB;
pub(super) const MAX_BLOCK: u64 = 256 * MIB;
/// Most entries in a region table or metadata table.
const MAX_TABLE_ENTRIES: u32 = 2047;
/// A metadata item is at most 1 MiB.
const MAX_ITEM_LEN: u32 = 1 << 20;

/// Payload BAT entry states (the low 3 bits of an entry).
pub(super) mod state {
    /// Not in the file: reads as zeroes (fixed and dynamic images).
    pub const NOT_PRESENT: u8 = 0;
    /// Contents undefined: fusex reads zeroes.
    pub const UNDEFINED: u8 = 1;
    /// Reads as zeroes.
    pub const ZERO: u8 = 2;
    /// Unmapped (trimmed): fusex reads zeroes.
    pub const UNMAPPED: u8 = 3;
    /// Unmapped in the 0.95 draft of the format, which some old images carry.
    pub const UNMAPPED_V095: u8 = 5;
    /// The whole block is in the file at the entry's offset.
    pub const FULLY_PRESENT: u8 = 6;
    /// Differencing only: the sector bitmap says which sectors are here.
    pub const PARTIALLY_PRESENT: u8 = 7;
    /// A sector bitmap entry whose block is in the file.
    pub const SB_PRESENT: u8 = 6;
}

/// Bytes of a sector bitmap block: one bit per logical sector of a chunk (2^23 sectors).
pub(super) const SB_BLOCK: u64 = MIB;

/// A GUID as stored on disk.
pub(super) type Guid = [u8; 16];

/// The on-disk bytes of GUID `d1-d2-d3-d4`.
const fn guid(d1: u32, d2: u16, d3: u16, d4: [u8; 8]) -> Guid {
    let a = d1.to_le_bytes();
    let b = d2.to_le_bytes();
    let c = d3.to_le_bytes();
    [
        a[0], a[1], a[2], a[3], b[0], b[1], c[0], c[1], d4[0], d4[1], d4[2], d4[3], d4[4], d4[5],
        d4[6], d4[7],
    ]
}

/// Region: the block allocation table.
pub(super) const BAT_REGION: Guid = guid(
    0x2dc2_7766,
    0xf623,
    0x4200,
    [0x9d, 0x64, 0x11, 0x5e, 0x9b, 0xfd, 0x4a, 0x08],
);
/// Region: the metadata.
pub(super) const METADATA_REGION: Guid = guid(
    0x8b7c_a206,
    0x4790,
    0x4b9a,
    [0xb8, 0xfe, 0x57, 0x5f, 0x05, 0x0f, 0x88, 0x6e],
);
/// Metadata item: file parameters (block size, flags).
pub(super) const FILE_PARAMETERS: Guid = guid(
    0xcaa1_6737,
    0xfa36,
    0x4d43,
    [0xb3, 0xb6, 0x33, 0xf0, 0xaa, 0x44, 0xe7, 0x6b],
);
/// Metadata item: virtual disk size.
pub(super) const DISK_SIZE: Guid = guid(
    0x2fa5_4224,
    0xcd1b,
    0x4876,
    [0xb2, 0x11, 0x5d, 0xbe, 0xd8, 0x3b, 0xf4, 0xb8],
);
/// Metadata item: page 83 data (the disk's SCSI identifier; not used by fusex).
pub(super) const PAGE83: Guid = guid(
    0xbeca_12ab,
    0xb2e6,
    0x4523,
    [0x93, 0xef, 0xc3, 0x09, 0xe0, 0x00, 0xc7, 0x46],
);
/// Metadata item: logical sector size.
pub(super) const LOGICAL_SECTOR: Guid = guid(
    0x8141_bf1d,
    0xa96f,
    0x4709,
    [0xba, 0x47, 0xf2, 0x33, 0xa8, 0xfa, 0xab, 0x5f],
);
/// Metadata item: physical sector size.
pub(super) const PHYSICAL_SECTOR: Guid = guid(
    0xcda3_48c7,
    0x445d,
    0x4471,
    [0x9c, 0xc9, 0xe9, 0x88, 0x52, 0x51, 0xc5, 0x56],
);
/// Metadata item: parent locator (differencing images).
pub(super) const PARENT_LOCATOR: Guid = guid(
    0xa8d3_5f2d,
    0xb30b,
    0x454d,
    [0xab, 0xf7, 0xd3, 0xd8, 0x48, 0x34, 0xab, 0x0c],
);
/// Parent locator type: the parent is a VHDX file (the only type the format defines).
pub(super) const VHDX_LOCATOR_TYPE: Guid = guid(
    0xb04a_efb7,
    0xd19e,
    0x4a81,
    [0xb7, 0x89, 0x25, 0xb8, 0xe9, 0x44, 0x59, 0x13],
);

const fn crc_table() -> [u32; 256] {
    // CRC-32C (Castagnoli), reflected polynomial.
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0x82f6_3b78
            } else {
                c >> 1
            };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
}

static CRC_TABLE: [u32; 256] = crc_table();

fn crc_update(mut crc: u32, data: &[u8]) -> u32 {
    for &b in data {
        crc = CRC_TABLE[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    crc
}

/// CRC-32C of `data`.
#[cfg(test)]
pub(super) fn crc32c(data: &[u8]) -> u32 {
    !crc_update(!0, data)
}

/// CRC-32C of `data` with its checksum field (4 bytes at `at`) taken as zero, as VHDX computes
/// a structure's checksum.
pub(super) fn checksum(data: &[u8], at: usize) -> u32 {
    let (head, rest) = data.split_at(at.min(data.len()));
    let tail = rest.get(4..).unwrap_or(&[]);
    !crc_update(crc_update(crc_update(!0, head), &[0; 4]), tail)
}

/// Stores `checksum(data, at)` at `at` (the caller's buffer holds the field).
pub(super) fn seal(data: &mut [u8], at: usize) {
    let c = checksum(data, at);
    data[at..at + 4].copy_from_slice(&c.to_le_bytes());
}

pub(super) fn le16(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}

pub(super) fn le32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

pub(super) fn le64(b: &[u8], o: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(w)
}

fn guid_at(b: &[u8], o: usize) -> Guid {
    let mut g = [0u8; 16];
    g.copy_from_slice(&b[o..o + 16]);
    g
}

/// What fusex uses of a header: signature `head` (0), checksum (4), sequence number (8), file
/// write GUID (16), data write GUID (32), log GUID (48), log version (64, u16), version (66,
/// u16: 1), log length (68, u32), log offset (72, u64).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Header {
    pub seq: u64,
    /// Changed before the first change of a session's guest data: a differencing child names
    /// its parent's (`parent_linkage`), so a parent written since no longer matches.
    pub data_write_guid: Guid,
    pub log_guid: Guid,
    pub log_length: u64,
    pub log_offset: u64,
}

/// Offsets of the header fields fusex rewrites.
pub(super) const SEQ_AT: usize = 8;
pub(super) const FILE_WRITE_GUID_AT: usize = 16;
pub(super) const DATA_WRITE_GUID_AT: usize = 32;
const CHECKSUM_AT: usize = 4;

/// Parses one header (its first [`HEADER_LEN`] bytes).
pub(super) fn parse_header(b: &[u8]) -> Result<Header, String> {
    if b.len() < HEADER_LEN {
        return Err("short header".into());
    }
    let b = &b[..HEADER_LEN];
    if b[..4] != *b"head" {
        return Err("no 'head' signature".into());
    }
    let (stored, computed) = (le32(b, CHECKSUM_AT), checksum(b, CHECKSUM_AT));
    if stored != computed {
        return Err(format!(
            "checksum {stored:#010x} where its bytes give {computed:#010x}"
        ));
    }
    let version = le16(b, 66);
    if version != 1 {
        return Err(format!("version {version}, not 1"));
    }
    Ok(Header {
        seq: le64(b, SEQ_AT),
        data_write_guid: guid_at(b, DATA_WRITE_GUID_AT),
        log_guid: guid_at(b, 48),
        log_length: u64::from(le32(b, 68)),
        log_offset: le64(b, 72),
    })
}

/// The current header of the two: the valid one, or of two valid ones the one with the higher
/// sequence number (the first on a tie). Returns its slot (0 or 1).
pub(super) fn current_header(h: [Result<Header, String>; 2]) -> Result<(usize, Header), String> {
    match h {
        [Ok(a), Ok(b)] => Ok(if b.seq > a.seq { (1, b) } else { (0, a) }),
        [Ok(a), Err(_)] => Ok((0, a)),
        [Err(_), Ok(b)] => Ok((1, b)),
        [Err(a), Err(b)] => Err(format!(
            "neither of its headers is valid (at 64 KiB: {a}; at 128 KiB: {b}): the image is \
             damaged"
        )),
    }
}

/// The header to write before the first change of a session: `current`'s bytes with sequence
/// number `seq`, new file and data write GUIDs, and a fresh checksum.
pub(super) fn next_header(current: &[u8], seq: u64, file_write: Guid, data_write: Guid) -> Vec<u8> {
    let mut h = current[..HEADER_LEN].to_vec();
    h[SEQ_AT..SEQ_AT + 8].copy_from_slice(&seq.to_le_bytes());
    h[FILE_WRITE_GUID_AT..FILE_WRITE_GUID_AT + 16].copy_from_slice(&file_write);
    h[DATA_WRITE_GUID_AT..DATA_WRITE_GUID_AT + 16].copy_from_slice(&data_write);
    seal(&mut h, CHECKSUM_AT);
    h
}

/// A region of the file: `offset..offset + length`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Region {
    pub offset: u64,
    pub length: u64,
}

impl Region {
    /// One past its last byte.
    pub fn end(self) -> u64 {
        self.offset.saturating_add(self.length)
    }

    /// Whether it shares a byte with `o`.
    pub fn overlaps(self, o: Region) -> bool {
        self.offset < o.end() && o.offset < self.end()
    }
}

/// The regions fusex needs.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Regions {
    pub bat: Region,
    pub metadata: Region,
}

/// Parses a region table: signature `regi` (0), checksum (4, over 64 KiB), entry count (8, at
/// most 2047), then 32-byte entries from 16: GUID, file offset (u64), length (u32), flags (u32,
/// bit 0: required). Offsets and lengths are whole MiB past the header section; a required
/// region fusex does not know, or the BAT or metadata region missing or given twice, is refused.
pub(super) fn parse_regions(b: &[u8]) -> Result<Regions, String> {
    if b.len() < REGION_LEN || b[..4] != *b"regi" {
        return Err("no 'regi' signature".into());
    }
    let b = &b[..REGION_LEN];
    let (stored, computed) = (le32(b, CHECKSUM_AT), checksum(b, CHECKSUM_AT));
    if stored != computed {
        return Err(format!(
            "checksum {stored:#010x} where its bytes give {computed:#010x}"
        ));
    }
    let count = le32(b, 8);
    if count > MAX_TABLE_ENTRIES {
        return Err(format!("{count} entries, more than 2047"));
    }
    let (mut bat, mut metadata) = (None, None);
    for i in 0..count as usize {
        let e = &b[16 + 32 * i..16 + 32 * (i + 1)];
        let id = guid_at(e, 0);
        let r = Region {
            offset: le64(e, 16),
            length: u64::from(le32(e, 24)),
        };
        let slot = match id {
            BAT_REGION => &mut bat,
            METADATA_REGION => &mut metadata,
            _ if le32(e, 28) & 1 != 0 => {
                return Err(format!(
                    "a required region {} fusex does not know",
                    show_guid(&id)
                ))
            }
            _ => continue,
        };
        if !r.offset.is_multiple_of(MIB)
            || !r.length.is_multiple_of(MIB)
            || r.length == 0
            || r.offset < HEADER_SECTION
        {
            return Err(format!(
                "a region at {:#x} of {:#x} bytes, not whole MiB past the header section",
                r.offset, r.length
            ));
        }
        if slot.replace(r).is_some() {
            return Err("a region given twice".into());
        }
    }
    match (bat, metadata) {
        (Some(bat), Some(metadata)) => Ok(Regions { bat, metadata }),
        _ => Err("no BAT or no metadata region".into()),
    }
}

/// The known metadata items' places: (offset in the region, length).
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Items {
    pub file_parameters: Option<(u64, u64)>,
    pub disk_size: Option<(u64, u64)>,
    pub logical_sector: Option<(u64, u64)>,
    pub physical_sector: Option<(u64, u64)>,
    pub page83: Option<(u64, u64)>,
    pub parent_locator: Option<(u64, u64)>,
}

/// Parses the metadata table at the start of a metadata region of `region_len` bytes: signature
/// `metadata` (0), entry count (10, u16, at most 2047), then 32-byte entries from 32: item GUID,
/// offset (u32, from the region's start, at least 64 KiB), length (u32, at most 1 MiB), flags
/// (u32, bit 2: required). Every item must lie inside the region; a required item fusex does
/// not know, or a known one given twice, is refused.
pub(super) fn parse_metadata_table(b: &[u8], region_len: u64) -> Result<Items, String> {
    if b.len() < METADATA_TABLE_LEN || b[..8] != *b"metadata" {
        return Err("its metadata table has no 'metadata' signature".into());
    }
    let count = u32::from(le16(b, 10));
    if count > MAX_TABLE_ENTRIES {
        return Err(format!(
            "its metadata table has {count} entries, more than 2047"
        ));
    }
    let mut items = Items::default();
    for i in 0..count as usize {
        let e = &b[32 + 32 * i..32 + 32 * (i + 1)];
        let id = guid_at(e, 0);
        let (off, len) = (le32(e, 16), le32(e, 20));
        let slot = match id {
            FILE_PARAMETERS => &mut items.file_parameters,
            DISK_SIZE => &mut items.disk_size,
            LOGICAL_SECTOR => &mut items.logical_sector,
            PHYSICAL_SECTOR => &mut items.physical_sector,
            PAGE83 => &mut items.page83,
            PARENT_LOCATOR => &mut items.parent_locator,
            _ if le32(e, 24) & 4 != 0 => {
                return Err(format!(
                    "its metadata has a required item {} fusex does not know",
                    show_guid(&id)
                ))
            }
            _ => continue,
        };
        let (off, len) = (u64::from(off), u64::from(len));
        if len > u64::from(MAX_ITEM_LEN)
            || (len > 0 && off < METADATA_TABLE_LEN as u64)
            || off + len > region_len
        {
            return Err(format!(
                "its metadata item {} at {off:#x} of {len} bytes lies outside the metadata \
                 region or over its table: the image is damaged",
                show_guid(&id)
            ));
        }
        if slot.replace((off, len)).is_some() {
            return Err(format!(
                "its metadata gives item {} twice: the image is damaged",
                show_guid(&id)
            ));
        }
    }
    Ok(items)
}

/// The disk's parameters, from the metadata items.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Params {
    pub block_size: u64,
    pub has_parent: bool,
    pub size: u64,
    pub logical_sector: u64,
}

/// Checks the metadata item values: file parameters (block size u32, flags u32: bit 0 leave
/// blocks allocated, bit 1 has parent), virtual disk size (u64), logical and physical sector
/// sizes (u32 each).
pub(super) fn parse_params(
    file_parameters: &[u8; 8],
    disk_size: &[u8; 8],
    logical: &[u8; 4],
    physical: &[u8; 4],
) -> Result<Params, String> {
    let block_size = u64::from(le32(file_parameters, 0));
    let flags = le32(file_parameters, 4);
    if !block_size.is_power_of_two() || !(MIN_BLOCK..=MAX_BLOCK).contains(&block_size) {
        return Err(format!(
            "its block size {block_size} is not a power of two from 1 MiB to 256 MiB: the \
             image is damaged"
        ));
    }
    let logical_sector = u64::from(le32(logical, 0));
    let physical_sector = le32(physical, 0);
    if !matches!(logical_sector, 512 | 4096) || !matches!(physical_sector, 512 | 4096) {
        return Err(format!(
            "its sector sizes (logical {logical_sector}, physical {physical_sector}) are not \
             512 or 4096: the image is damaged"
        ));
    }
    let size = le64(disk_size, 0);
    if size > MAX_DISK || !size.is_multiple_of(logical_sector) {
        return Err(format!(
            "its virtual disk size {size} is more than VHDX's 64 TiB or not a multiple of its \
             {logical_sector}-byte sectors: the image is damaged"
        ));
    }
    Ok(Params {
        block_size,
        has_parent: flags & 2 != 0,
        size,
        logical_sector,
    })
}

/// Payload blocks per chunk: the payload entries between two sector bitmap entries in the BAT
/// (2^23 sectors' worth of blocks; a power of two from 16 to 2^15).
pub(super) fn chunk_ratio(logical_sector: u64, block_size: u64) -> u64 {
    ((1u64 << 23) * logical_sector / block_size).max(1)
}

/// BAT index of payload block `block`: a sector bitmap entry follows every chunk.
pub(super) fn payload_index(block: u64, ratio: u64) -> u64 {
    block + block / ratio
}

/// BAT entries of a fixed or dynamic image of `blocks` payload blocks: the last one is the last
/// payload block's.
pub(super) fn bat_entries(blocks: u64, ratio: u64) -> u64 {
    match blocks {
        0 => 0,
        n => n + (n - 1) / ratio,
    }
}

/// For BAT index `i`: the payload block it describes, or None for a sector bitmap entry.
pub(super) fn block_of_index(i: u64, ratio: u64) -> Option<u64> {
    if (i + 1).is_multiple_of(ratio + 1) {
        None
    } else {
        Some(i - i / (ratio + 1))
    }
}

/// A BAT entry's state and file offset (bytes: the high 44 bits count MiB).
pub(super) fn decode_entry(w: u64) -> (u8, u64) {
    ((w & 7) as u8, w & !(MIB - 1))
}

/// A FULLY_PRESENT entry for the block at file offset `host` (whole MiB).
pub(super) fn present_entry(host: u64) -> u64 {
    (host & !(MIB - 1)) | u64::from(state::FULLY_PRESENT)
}

/// A GUID as text, for messages.
pub(super) fn show_guid(g: &Guid) -> String {
    format!(
        "{:08x}-{:04x}-{:04x}-{:02x}{:02x}-{}",
        le32(g, 0),
        le16(g, 4),
        le16(g, 6),
        g[8],
        g[9],
        g[10..]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    )
}

/// BAT entries of a differencing image of `blocks` payload blocks: every chunk whole, so the
/// last entry is the sector bitmap entry of the chunk holding the last payload block.
pub(super) fn diff_bat_entries(blocks: u64, ratio: u64) -> u64 {
    blocks.div_ceil(ratio).saturating_mul(ratio + 1)
}

/// BAT index of chunk `chunk`'s sector bitmap entry: after the chunk's `ratio` payload entries.
#[cfg(test)]
pub(super) fn bitmap_index(chunk: u64, ratio: u64) -> u64 {
    (chunk + 1) * (ratio + 1) - 1
}

/// Bytes of the parent locator header: locator type GUID, reserved (u16), key/value count (u16).
const LOCATOR_HEADER: usize = 20;
/// Bytes of one key/value entry: key offset (u32), value offset (u32), key length (u16), value
/// length (u16); offsets from the item's start, lengths in bytes.
const LOCATOR_ENTRY: usize = 12;

/// What a VHDX parent locator says about the parent: its identity and where to look for it.
/// Unknown keys are ignored, as the format allows other implementations to add their own.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct ParentLocator {
    /// `parent_linkage`: the parent's data write GUID when this child was made.
    pub linkage: Guid,
    /// `parent_linkage2`: a second GUID accepted while a merge into the parent is under way.
    pub linkage2: Option<Guid>,
    /// `relative_path`: from the child's directory, `\` separated.
    pub relative_path: Option<String>,
    /// `volume_path`: `\\?\Volume{GUID}\...`.
    pub volume_path: Option<String>,
    /// `absolute_win32_path`: `\\?\d:\...` or a UNC share.
    pub absolute_win32_path: Option<String>,
}

/// Parses a parent locator item (`b` is the whole item, at most 1 MiB since the metadata
/// table bounds items): a header, then `count` entries whose keys and values are non-empty
/// UTF-16LE strings inside the item. The locator type must be VHDX's; `parent_linkage` must be
/// there and a GUID; keys must not repeat; at least one path must be given.
pub(super) fn parse_parent_locator(b: &[u8]) -> Result<ParentLocator, String> {
    let damaged = |what: String| format!("its parent locator {what}: the image is damaged");
    if b.len() < LOCATOR_HEADER {
        return Err(damaged(format!(
            "is {} bytes, shorter than its header",
            b.len()
        )));
    }
    let kind = guid_at(b, 0);
    if kind != VHDX_LOCATOR_TYPE {
        return Err(format!(
            "its parent locator has type {}, not VHDX's ({}): fusex serves only VHDX parents",
            show_guid(&kind),
            show_guid(&VHDX_LOCATOR_TYPE)
        ));
    }
    let count = usize::from(le16(b, 18));
    if LOCATOR_HEADER + count * LOCATOR_ENTRY > b.len() {
        return Err(damaged(format!(
            "claims {count} entries, more than its {} bytes hold",
            b.len()
        )));
    }
    let text = |off: u32, len: u16, what: &str| -> Result<String, String> {
        let (off, len) = (off as usize, usize::from(len));
        if off == 0 || len == 0 || len % 2 != 0 || off.saturating_add(len) > b.len() {
            return Err(damaged(format!(
                "has a {what} at {off:#x} of {len} bytes, outside it, empty or of an odd length"
            )));
        }
        let units: Vec<u16> = b[off..off + len]
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        let s = String::from_utf16(&units)
            .map_err(|_| damaged(format!("has a {what} that is not valid UTF-16")))?;
        if s.contains('\0') {
            return Err(damaged(format!("has a {what} with a NUL character")));
        }
        Ok(s)
    };
    let mut loc = ParentLocator::default();
    let mut linkage = None;
    let mut seen: Vec<String> = Vec::new();
    for i in 0..count {
        let e = &b[LOCATOR_HEADER + i * LOCATOR_ENTRY..][..LOCATOR_ENTRY];
        let key = text(le32(e, 0), le16(e, 8), "key")?;
        let value = text(le32(e, 4), le16(e, 10), "value")?;
        if seen.contains(&key) {
            return Err(damaged(format!(
                "gives key {} twice",
                crate::qcow2::named::shown(&key)
            )));
        }
        let guid_value = || {
            parse_guid_text(&value).ok_or_else(|| {
                damaged(format!(
                    "gives {key} {}, not a GUID",
                    crate::qcow2::named::shown(&value)
                ))
            })
        };
        match key.as_str() {
            "parent_linkage" => linkage = Some(guid_value()?),
            "parent_linkage2" => loc.linkage2 = Some(guid_value()?),
            "relative_path" => loc.relative_path = Some(value),
            "volume_path" => loc.volume_path = Some(value),
            "absolute_win32_path" => loc.absolute_win32_path = Some(value),
            _ => {}
        }
        seen.push(key);
    }
    loc.linkage = linkage.ok_or_else(|| damaged("has no parent_linkage".into()))?;
    if loc.relative_path.is_none() && loc.volume_path.is_none() && loc.absolute_win32_path.is_none()
    {
        return Err(damaged(
            "names no path (relative_path, volume_path or absolute_win32_path)".into(),
        ));
    }
    Ok(loc)
}

/// A GUID written as text (`{83ed0ec3-24c8-49a6-a959-5e4bf1288bfb}`, braces optional, either
/// case) in its on-disk layout; None if it is not one.
pub(super) fn parse_guid_text(s: &str) -> Option<Guid> {
    let s = s
        .strip_prefix('{')
        .and_then(|t| t.strip_suffix('}'))
        .unwrap_or(s);
    let groups: Vec<&str> = s.split('-').collect();
    let widths = [8, 4, 4, 4, 12];
    if groups.len() != 5
        || groups
            .iter()
            .zip(widths)
            .any(|(g, w)| g.len() != w || !g.bytes().all(|c| c.is_ascii_hexdigit()))
    {
        return None;
    }
    let hex = |g: &str| u64::from_str_radix(g, 16).ok();
    let d4 = (hex(groups[3])? << 48 | hex(groups[4])?).to_be_bytes();
    Some(guid(
        hex(groups[0])? as u32,
        hex(groups[1])? as u16,
        hex(groups[2])? as u16,
        d4,
    ))
}
