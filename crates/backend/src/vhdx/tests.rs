//! VHDX parsing, the BAT interleave and allocation on images built here byte by byte (the
//! end-to-end tests in `tests/formats.rs` use `qemu-img` as the oracle).

use super::ondisk::*;
use super::*;
use engine::{Engine, EngineConfig};
use std::path::PathBuf;

const LOG_AT: u64 = MIB;
const META_AT: u64 = 2 * MIB;
const BAT_AT: u64 = 3 * MIB;
const DATA_AT: u64 = 4 * MIB;
const H1: usize = 64 << 10;
const H2: usize = 128 << 10;
const RT1: usize = 192 << 10;
const RT2: usize = 256 << 10;

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Recomputes both headers' and both region tables' checksums.
fn reseal(img: &mut [u8]) {
    for at in [H1, H2] {
        seal(&mut img[at..at + HEADER_LEN], 4);
    }
    for at in [RT1, RT2] {
        seal(&mut img[at..at + REGION_LEN], 4);
    }
}

/// A dynamic image of `size` bytes in `bs`-byte blocks with `lss`-byte logical sectors, every
/// block not present: header section, a 1 MiB log at 1 MiB, metadata at 2 MiB, the BAT at
/// 3 MiB (1 MiB: 128 Ki entries), data from 4 MiB. Header 1 is current (sequence 5 over 4).
fn image_with(size: u64, bs: u32, lss: u32) -> Vec<u8> {
    let mut img = vec![0u8; DATA_AT as usize];
    img[..8].copy_from_slice(&FILE_ID);
    for (at, seq) in [(H1, 5u64), (H2, 4)] {
        let h = &mut img[at..at + HEADER_LEN];
        h[..4].copy_from_slice(b"head");
        put64(h, 8, seq);
        h[16] = 1; // file write GUID
        h[32] = 2; // data write GUID
        h[64..66].copy_from_slice(&1u16.to_le_bytes()); // log version
        h[66..68].copy_from_slice(&1u16.to_le_bytes()); // version
        put32(h, 68, MIB as u32);
        put64(h, 72, LOG_AT);
    }
    for at in [RT1, RT2] {
        let r = &mut img[at..at + REGION_LEN];
        r[..4].copy_from_slice(b"regi");
        put32(r, 8, 2);
        for (i, (id, off)) in [(BAT_REGION, BAT_AT), (METADATA_REGION, META_AT)]
            .into_iter()
            .enumerate()
        {
            let e = 16 + 32 * i;
            r[e..e + 16].copy_from_slice(&id);
            put64(r, e + 16, off);
            put32(r, e + 24, MIB as u32);
            put32(r, e + 28, 1);
        }
    }
    let m = META_AT as usize;
    img[m..m + 8].copy_from_slice(b"metadata");
    img[m + 10..m + 12].copy_from_slice(&5u16.to_le_bytes());
    let items: [(Guid, u32, &[u8]); 5] = [
        (FILE_PARAMETERS, 0x10000, &[0; 8]),
        (DISK_SIZE, 0x10008, &size.to_le_bytes()),
        (LOGICAL_SECTOR, 0x10010, &lss.to_le_bytes()),
        (PHYSICAL_SECTOR, 0x10014, &4096u32.to_le_bytes()),
        (PAGE83, 0x10018, &[7; 16]),
    ];
    for (i, (id, off, val)) in items.into_iter().enumerate() {
        let e = m + 32 + 32 * i;
        img[e..e + 16].copy_from_slice(&id);
        put32(&mut img, e + 16, off);
        put32(&mut img, e + 20, val.len() as u32);
        put32(&mut img, e + 24, 4 | 2); // required, virtual disk
        img[m + off as usize..][..val.len()].copy_from_slice(val);
    }
    put32(&mut img, m + 0x10000, bs);
    reseal(&mut img);
    img
}

fn image(size: u64) -> Vec<u8> {
    image_with(size, MIB as u32, 512)
}

fn set_bat(img: &mut [u8], index: u64, v: u64) {
    put64(img, (BAT_AT + 8 * index) as usize, v);
}

fn write_img(dir: &tempfile::TempDir, bytes: &[u8]) -> PathBuf {
    let p = dir.path().join("t.vhdx");
    std::fs::write(&p, bytes).unwrap();
    p
}

fn reason(p: &Path, writable: bool) -> String {
    match open(p, opts(writable)) {
        Err(OpenError::Format { reason, .. }) => reason,
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("opened"),
    }
}

fn opts(writable: bool) -> VhdxOptions {
    VhdxOptions {
        writable,
        locking: Locking::Off,
        ..VhdxOptions::default()
    }
}

fn engine() -> Engine {
    Engine::new(&EngineConfig {
        sq_entries: 16,
        ..EngineConfig::default()
    })
    .unwrap()
}

fn read(img: &VhdxBackend, off: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut v = vec![0xaa; len];
    engine().block_on(img.read(&mut v, off)).unwrap()?;
    Ok(v)
}

fn write(img: &VhdxBackend, off: u64, data: &[u8]) -> io::Result<()> {
    engine().block_on(img.write(data, off)).unwrap()
}

#[test]
fn crc32c_and_guids_are_the_spec_s() {
    // The CRC-32C check value.
    assert_eq!(crc32c(b"123456789"), 0xe306_9283);
    let mut b = *b"ab\xff\xff\xff\xffcd";
    let c = checksum(&b, 2);
    b[2..6].fill(0);
    assert_eq!(c, crc32c(&b));
    assert_eq!(checksum(&[1, 2], 9), crc32c(&[1, 2, 0, 0, 0, 0]));
    assert_eq!(BAT_REGION[..4], [0x66, 0x77, 0xc2, 0x2d]);
    assert_eq!(
        show_guid(&BAT_REGION),
        "2dc27766-f623-4200-9d64-115e9bfd4a08"
    );
    assert_eq!(show_guid(&PAGE83), "beca12ab-b2e6-4523-93ef-c309e000c746");
}

#[test]
fn bat_math_interleaves_sector_bitmap_entries() {
    assert_eq!(chunk_ratio(512, MIB), 4096);
    assert_eq!(chunk_ratio(4096, MIB), 32768);
    assert_eq!(chunk_ratio(512, 256 * MIB), 16);
    assert_eq!(chunk_ratio(512, 32 * MIB), 128);
    let r = 16;
    assert_eq!(payload_index(0, r), 0);
    assert_eq!(payload_index(15, r), 15);
    assert_eq!(
        payload_index(16, r),
        17,
        "index 16 is chunk 0's sector bitmap"
    );
    assert_eq!(payload_index(33, r), 35);
    assert_eq!(bat_entries(0, r), 0);
    assert_eq!(
        bat_entries(16, r),
        16,
        "the last entry is the last payload block's"
    );
    assert_eq!(bat_entries(17, r), 18);
    assert_eq!(bat_entries(4096, 4096), 4096);
    assert_eq!(bat_entries(4097, 4096), 4098);
    for b in 0..200 {
        assert_eq!(block_of_index(payload_index(b, r), r), Some(b));
    }
    for k in 0..10 {
        assert_eq!(block_of_index(k * (r + 1) + r, r), None);
    }
    assert_eq!(decode_entry(0x0000_0123_4560_0006), (6, 0x0123_4560_0000));
    assert_eq!(decode_entry(present_entry(5 * MIB)), (6, 5 * MIB));
    // Reserved bits 3..19 do not leak into the offset.
    assert_eq!(decode_entry(0xf_fff8 | 2), (2, 0));
}

#[test]
fn headers_choose_the_valid_one_with_the_higher_sequence() {
    let img = image(8 * MIB);
    let h1 = parse_header(&img[H1..]).unwrap();
    let h2 = parse_header(&img[H2..]).unwrap();
    assert_eq!((h1.seq, h2.seq), (5, 4));
    assert_eq!(h1.log_offset, LOG_AT);
    assert_eq!(
        current_header([Ok(h1.clone()), Ok(h2.clone())]).unwrap().0,
        0
    );
    let mut newer = h2.clone();
    newer.seq = 6;
    assert_eq!(current_header([Ok(h1.clone()), Ok(newer)]).unwrap().0, 1);
    assert_eq!(
        current_header([Err("x".into()), Ok(h2.clone())]).unwrap(),
        (1, h2)
    );
    let e = current_header([Err("a".into()), Err("b".into())]).unwrap_err();
    assert!(e.contains("neither") && !e.contains('\n'), "{e}");

    let mut bad = img[H1..H1 + HEADER_LEN].to_vec();
    bad[100] ^= 1;
    assert!(parse_header(&bad).unwrap_err().contains("checksum"));
    bad[..4].copy_from_slice(b"hexd");
    assert!(parse_header(&bad).unwrap_err().contains("signature"));
    let mut v2 = img[H1..H1 + HEADER_LEN].to_vec();
    v2[66] = 2;
    seal(&mut v2, 4);
    assert!(parse_header(&v2).unwrap_err().contains("version 2"));
    assert!(parse_header(&v2[..100]).is_err());

    // The next header: the new sequence and GUIDs, a valid checksum, the rest unchanged.
    let next = next_header(&img[H1..], 6, [3; 16], [4; 16]);
    let h = parse_header(&next).unwrap();
    assert_eq!(h.seq, 6);
    assert_eq!(h.log_guid, [0; 16]);
    assert_eq!(next[16..32], [3; 16]);
    assert_eq!(next[32..48], [4; 16]);
    assert_eq!(next[48..], img[H1 + 48..H1 + HEADER_LEN]);
}

#[test]
fn region_tables_are_checked() {
    let img = image(8 * MIB);
    let r = parse_regions(&img[RT1..]).unwrap();
    assert_eq!(
        r,
        Regions {
            bat: Region {
                offset: BAT_AT,
                length: MIB
            },
            metadata: Region {
                offset: META_AT,
                length: MIB
            },
        }
    );
    type Damage = Box<dyn Fn(&mut [u8])>;
    let cases: Vec<(&str, Damage)> = vec![
        ("signature", Box::new(|r| r[0] = b'x')),
        ("checksum", Box::new(|r| r[1000] = 1)),
        ("more than 2047", Box::new(|r| put32(r, 8, 2048))),
        ("no BAT", Box::new(|r| put32(r, 8, 1))),
        (
            "twice",
            Box::new(|r| r[48..64].copy_from_slice(&BAT_REGION)),
        ),
        ("not whole MiB", Box::new(|r| put64(r, 32, BAT_AT + 4096))),
        ("not whole MiB", Box::new(|r| put32(r, 40, 4096))),
        ("not whole MiB", Box::new(|r| put64(r, 32, 0))),
        ("not whole MiB", Box::new(|r| put32(r, 40, 0))),
        (
            "required region",
            Box::new(|r| {
                put32(r, 8, 3);
                r[80] = 9;
                put32(r, 108, 1);
            }),
        ),
    ];
    for (want, damage) in cases {
        let mut t = img[RT1..RT1 + REGION_LEN].to_vec();
        damage(&mut t);
        if want != "checksum" {
            seal(&mut t, 4);
        }
        let e = parse_regions(&t).unwrap_err();
        assert!(e.contains(want), "{want}: {e}");
    }
    // An unknown region that is not required is skipped.
    let mut t = img[RT1..RT1 + REGION_LEN].to_vec();
    put32(&mut t, 8, 3);
    t[80] = 9;
    seal(&mut t, 4);
    assert!(parse_regions(&t).is_ok());
}

#[test]
fn metadata_is_checked() {
    let img = image(8 * MIB);
    let m = META_AT as usize;
    let table = &img[m..m + METADATA_TABLE_LEN];
    let items = parse_metadata_table(table, MIB).unwrap();
    assert_eq!(items.file_parameters, Some((0x10000, 8)));
    assert_eq!(items.page83, Some((0x10018, 16)));
    assert_eq!(items.parent_locator, None);
    type Damage = Box<dyn Fn(&mut [u8])>;
    let cases: Vec<(&str, Damage)> = vec![
        ("signature", Box::new(|t| t[0] = b'x')),
        (
            "more than 2047",
            Box::new(|t| t[10..12].copy_from_slice(&3000u16.to_le_bytes())),
        ),
        (
            "outside the metadata region",
            Box::new(|t| put32(t, 48, 0x100)),
        ),
        (
            "outside the metadata region",
            Box::new(|t| put32(t, 48, MIB as u32 - 4)),
        ),
        (
            "outside the metadata region",
            Box::new(|t| put32(t, 52, 2 << 20)),
        ),
        (
            "twice",
            Box::new(|t| t[64..80].copy_from_slice(&FILE_PARAMETERS)),
        ),
        ("required item", Box::new(|t| t[64] ^= 0x55)),
    ];
    for (want, damage) in cases {
        let mut t = table.to_vec();
        damage(&mut t);
        let e = parse_metadata_table(&t, MIB).unwrap_err();
        assert!(e.contains(want), "{want}: {e}");
    }
    let mut t = table.to_vec();
    t[64] ^= 0x55;
    put32(&mut t, 88, 0); // the unknown item is not required
    assert!(parse_metadata_table(&t, MIB).is_ok());

    let fp = |bs: u32, flags: u32| {
        let mut b = [0u8; 8];
        put32(&mut b, 0, bs);
        put32(&mut b, 4, flags);
        b
    };
    let size = |s: u64| s.to_le_bytes();
    let ss = |s: u32| s.to_le_bytes();
    let p = parse_params(&fp(1 << 25, 1), &size(1 << 40), &ss(4096), &ss(512)).unwrap();
    assert_eq!(
        p,
        Params {
            block_size: 1 << 25,
            has_parent: false,
            size: 1 << 40,
            logical_sector: 4096
        }
    );
    assert!(
        parse_params(&fp(1 << 20, 2), &size(0), &ss(512), &ss(512))
            .unwrap()
            .has_parent
    );
    for (bs, sz, l, ph, want) in [
        (3 << 20, 0, 512, 512, "power of two"),
        (1 << 19, 0, 512, 512, "power of two"),
        (1 << 29, 0, 512, 512, "power of two"),
        (0, 0, 512, 512, "power of two"),
        (1 << 20, 0, 1024, 512, "sector sizes"),
        (1 << 20, 0, 512, 0, "sector sizes"),
        (1 << 20, (64 << 40) + 512, 512, 512, "64 TiB"),
        (1 << 20, u64::MAX, 512, 512, "64 TiB"),
        (1 << 20, 4096 + 512, 4096, 512, "multiple"),
    ] {
        let e = parse_params(&fp(bs, 0), &size(sz), &ss(l), &ss(ph)).unwrap_err();
        assert!(e.contains(want), "{want}: {e}");
    }
}

#[test]
fn bad_images_are_refused_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    type Damage = Box<dyn Fn(&mut Vec<u8>)>;
    let meta = META_AT as usize;
    let cases: Vec<(&str, Damage)> = vec![
        ("file type identifier", Box::new(|i| i[0] = b'x')),
        ("shorter than", Box::new(|i| i.truncate(4096))),
        (
            "neither of its headers",
            Box::new(|i| {
                i[H1 + 200] ^= 1;
                i[H2 + 200] ^= 1;
            }),
        ),
        (
            "qemu-img check -r all",
            Box::new(|i| {
                i[H1 + 48] = 1;
                reseal(i);
            }),
        ),
        (
            "the log",
            Box::new(|i| {
                put64(i, H1 + 72, 1 << 40);
                reseal(i);
            }),
        ),
        (
            "region table is not valid",
            Box::new(|i| {
                i[RT1 + 5000] ^= 1;
                i[RT2 + 5000] ^= 1;
            }),
        ),
        (
            "BAT region",
            Box::new(|i| {
                put64(i, RT1 + 32, 1 << 40);
                reseal(i);
            }),
        ),
        (
            "BAT region",
            Box::new(|i| {
                put64(i, RT1 + 32, LOG_AT);
                reseal(i);
            }),
        ),
        (
            "metadata region",
            Box::new(|i| {
                put64(i, RT1 + 64, BAT_AT);
                reseal(i);
            }),
        ),
        (
            "differencing",
            Box::new(move |i| put32(i, meta + 0x10004, 2)),
        ),
        (
            "power of two",
            Box::new(move |i| put32(i, meta + 0x10000, 3 << 20)),
        ),
        (
            "64 TiB",
            Box::new(move |i| put64(i, meta + 0x10008, 1 << 60)),
        ),
        (
            "too small",
            Box::new(move |i| put64(i, meta + 0x10008, 1 << 40)),
        ),
        (
            "no virtual disk size",
            Box::new(move |i| {
                i[meta + 32 + 32] ^= 0x55;
                put32(i, meta + 32 + 32 + 24, 0);
            }),
        ),
    ];
    for (want, damage) in cases {
        let mut img = image(8 * MIB);
        damage(&mut img);
        let p = write_img(&dir, &img);
        for writable in [false, true] {
            let r = reason(&p, writable);
            assert!(r.contains(want), "{want}: {r}");
            assert!(!r.contains('\n'), "{r}");
        }
    }
}

#[test]
fn a_table_larger_than_fusex_holds_is_refused() {
    // 16 TiB in 1 MiB blocks: 16 Mi entries, with a BAT region large enough for them (a
    // sparse file).
    let dir = tempfile::tempdir().unwrap();
    let mut img = image(16 << 40);
    put32(&mut img, RT1 + 40, 129 << 20);
    reseal(&mut img);
    let p = write_img(&dir, &img);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(BAT_AT + (129 << 20))
        .unwrap();
    let r = reason(&p, false);
    assert!(r.contains("more than fusex holds"), "{r}");
}

#[test]
fn one_damaged_header_or_region_table_is_survived() {
    let dir = tempfile::tempdir().unwrap();
    let mut img = image(8 * MIB);
    img[H1 + 300] ^= 1; // the newer header is bad: header 2 is current
    img[RT1 + 3000] ^= 1; // the copy serves
    let p = write_img(&dir, &img);
    let v = open(&p, opts(true)).unwrap();
    write(&v, 0, &[1; 10]).unwrap();
    drop(v);
    // Header 2 (sequence 4) was current: the new header went into slot 1.
    let b = std::fs::read(&p).unwrap();
    let h = parse_header(&b[H1..]).unwrap();
    assert_eq!(h.seq, 5);
    assert_eq!(parse_header(&b[H2..]).unwrap().seq, 4);
}

#[test]
fn writing_updates_the_header_and_appends_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let mut img = image(8 * MIB);
    // Block 1 is zero, block 2 present at 4 MiB, block 3 unmapped.
    set_bat(&mut img, 1, u64::from(state::ZERO));
    set_bat(&mut img, 2, present_entry(DATA_AT));
    set_bat(&mut img, 3, u64::from(state::UNMAPPED));
    img.extend(std::iter::repeat_n(7u8, MIB as usize));
    // The file does not end on a MiB: the next block goes to the next whole MiB.
    img.extend([9u8; 100]);
    let p = write_img(&dir, &img);
    let before = std::fs::read(&p).unwrap();
    let v = open(&p, opts(false)).unwrap();
    assert_eq!(crate::BlockBackend::size(&v), 8 * MIB);
    let got = read(&v, 0, (4 * MIB) as usize).unwrap();
    assert!(got[..(2 * MIB) as usize].iter().all(|&b| b == 0));
    assert!(got[(2 * MIB) as usize..(3 * MIB) as usize]
        .iter()
        .all(|&b| b == 7));
    assert!(got[(3 * MIB) as usize..].iter().all(|&b| b == 0));
    drop(v);
    assert_eq!(
        std::fs::read(&p).unwrap(),
        before,
        "read-only changes nothing"
    );

    let v = open(&p, opts(true)).unwrap();
    // The header went into slot 2 with the next sequence number, new GUIDs, no log.
    let b = std::fs::read(&p).unwrap();
    let h2 = parse_header(&b[H2..]).unwrap();
    assert_eq!(h2.seq, 6);
    assert_eq!(h2.log_guid, [0; 16]);
    assert_ne!(b[H2 + 16..H2 + 48], before[H1 + 16..H1 + 48]);
    assert_eq!(b[H2 + 16 + 7] >> 4, 4, "a version 4 GUID");
    assert_eq!(b[H1..H1 + HEADER_LEN], before[H1..H1 + HEADER_LEN]);
    write(&v, MIB + 5, &[1; 100]).unwrap(); // the zero block
    write(&v, 7 * MIB - 50, &[2; 100]).unwrap(); // blocks 6 and 7
    write(&v, 2 * MIB, &[3; 10]).unwrap(); // in place
    drop(v);
    let b = std::fs::read(&p).unwrap();
    let end = (DATA_AT + MIB).next_multiple_of(MIB) + MIB; // past the 100 stray bytes
    assert_eq!(b.len() as u64, end + 3 * MIB);
    let entry = |i: u64| decode_entry(le64(&b, (BAT_AT + 8 * i) as usize));
    assert_eq!(entry(1), (state::FULLY_PRESENT, end));
    assert_eq!(entry(6), (state::FULLY_PRESENT, end + MIB));
    assert_eq!(entry(7), (state::FULLY_PRESENT, end + 2 * MIB));
    assert_eq!(entry(0), (0, 0));
    let v = open(&p, opts(false)).unwrap();
    let got = read(&v, 0, (8 * MIB) as usize).unwrap();
    let mut want = vec![0u8; (8 * MIB) as usize];
    want[(MIB + 5) as usize..][..100].fill(1);
    want[(2 * MIB) as usize..(3 * MIB) as usize].fill(7);
    want[(2 * MIB) as usize..][..10].fill(3);
    want[(7 * MIB - 50) as usize..][..100].fill(2);
    assert_eq!(got, want);
}

#[test]
fn blocks_past_a_chunk_use_the_interleaved_entries() {
    // 512-byte sectors in 1 MiB blocks: 4096 payload entries per chunk, then a sector bitmap
    // entry. A disk of 4100 blocks (sparse file) has its block 4096 at BAT index 4097.
    let dir = tempfile::tempdir().unwrap();
    let blocks = 4100u64;
    let mut img = image(blocks * MIB);
    set_bat(&mut img, 4097, present_entry(DATA_AT));
    img.extend(std::iter::repeat_n(5u8, MIB as usize));
    let p = write_img(&dir, &img);
    let v = open(&p, opts(true)).unwrap();
    assert_eq!(read(&v, 4096 * MIB, 4).unwrap(), vec![5; 4]);
    assert_eq!(read(&v, 4095 * MIB, 4).unwrap(), vec![0; 4]);
    write(&v, 4099 * MIB + 1, &[8]).unwrap();
    write(&v, 4095 * MIB, &[9]).unwrap();
    drop(v);
    let b = std::fs::read(&p).unwrap();
    let entry = |i: u64| decode_entry(le64(&b, (BAT_AT + 8 * i) as usize));
    assert_eq!(entry(4100), (state::FULLY_PRESENT, DATA_AT + MIB));
    assert_eq!(entry(4095), (state::FULLY_PRESENT, DATA_AT + 2 * MIB));
    assert_eq!(entry(4096), (0, 0), "the sector bitmap entry is left alone");
    let v = open(&p, opts(false)).unwrap();
    assert_eq!(read(&v, 4099 * MIB, 2).unwrap(), vec![0, 8]);
    assert_eq!(read(&v, 4095 * MIB, 2).unwrap(), vec![9, 0]);
}

#[test]
fn bad_bat_entries_fail_their_blocks_read_only_and_refuse_writing() {
    let dir = tempfile::tempdir().unwrap();
    let mut img = image(8 * MIB);
    img.extend(std::iter::repeat_n(7u8, MIB as usize));
    set_bat(&mut img, 0, present_entry(DATA_AT));
    set_bat(&mut img, 1, present_entry(DATA_AT)); // shares block 0's space
    set_bat(&mut img, 2, present_entry(DATA_AT + MIB)); // past the end
    set_bat(&mut img, 3, present_entry(BAT_AT)); // over the BAT
    set_bat(&mut img, 4, present_entry(0)); // over the headers
    set_bat(&mut img, 5, u64::from(state::PARTIALLY_PRESENT) | DATA_AT);
    set_bat(&mut img, 6, 4); // reserved state
    let p = write_img(&dir, &img);
    let r = reason(&p, true);
    assert!(r.contains("block 0") && r.contains("6 more"), "{r}");
    let before = std::fs::read(&p).unwrap();
    let v = open(&p, opts(false)).unwrap();
    for b in 0..7 {
        let e = read(&v, b * MIB, 10).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "block {b}");
    }
    assert_eq!(read(&v, 7 * MIB, 10).unwrap(), vec![0; 10]);
    drop(v);
    assert_eq!(std::fs::read(&p).unwrap(), before);
    set_bat(&mut img, 1, 0);
    let p = write_img(&dir, &img);
    let v = open(&p, opts(false)).unwrap();
    assert_eq!(read(&v, 0, 10).unwrap(), vec![7; 10]);
    assert_eq!(read(&v, MIB, 10).unwrap(), vec![0; 10]);
}

#[test]
fn a_fixed_image_is_written_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let mut img = image(3 * MIB);
    put32(&mut img, META_AT as usize + 0x10004, 1); // leave blocks allocated
    for b in 0..3 {
        set_bat(&mut img, b, present_entry(DATA_AT + b * MIB));
    }
    img.extend(std::iter::repeat_n(1u8, 3 * MIB as usize));
    let p = write_img(&dir, &img);
    let len = img.len() as u64;
    let v = open(&p, opts(true)).unwrap();
    write(&v, MIB - 2, &[4; 4]).unwrap();
    engine().block_on(v.zero(2 * MIB, 10)).unwrap().unwrap();
    let got = read(&v, MIB - 4, 8).unwrap();
    assert_eq!(got, [1, 1, 4, 4, 4, 4, 1, 1]);
    assert_eq!(read(&v, 2 * MIB, 12).unwrap()[9..], [0, 1, 1]);
    drop(v);
    assert_eq!(std::fs::metadata(&p).unwrap().len(), len);
}

#[test]
fn probing_needs_the_identifier() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_img(&dir, &image(MIB));
    assert!(probe(&p).unwrap());
    let p = write_img(&dir, b"vhdxfil");
    assert!(!probe(&p).unwrap());
}

/// Any bytes of the headers, region tables, metadata or BAT overwritten, checksums fixed up
/// or not: opening either refuses in one line or serves; reads and writes then fail or
/// succeed, never panic, and writes grow the file by at most a block each.
fn damaged_image_is_handled(patches: &[(usize, u8)], ops: &[(u64, u16)], fix: bool) {
    let mut img = image(8 * MIB);
    set_bat(&mut img, 0, present_entry(DATA_AT));
    set_bat(&mut img, 5, present_entry(DATA_AT + MIB));
    set_bat(&mut img, 6, u64::from(state::ZERO));
    img.extend(std::iter::repeat_n(7u8, 2 * MIB as usize));
    // Where the structures are: header fields, region entries, metadata table and items, BAT.
    let spots = [
        H1,
        H2,
        RT1,
        RT2,
        META_AT as usize,
        META_AT as usize + 0x10000,
        BAT_AT as usize,
    ];
    for &(at, v) in patches {
        let base = spots[at % spots.len()];
        img[base + (at / spots.len()) % 128] = v;
    }
    if fix {
        reseal(&mut img);
    }
    let dir = tempfile::tempdir().unwrap();
    let p = write_img(&dir, &img);
    let eng = engine();
    for writable in [false, true] {
        let v = match open(&p, opts(writable)) {
            Ok(v) => v,
            Err(e) => {
                assert!(!e.to_string().contains('\n'), "{e}");
                continue;
            }
        };
        let size = crate::BlockBackend::size(&v);
        let before = std::fs::metadata(&p).unwrap().len();
        let bs = crate::blocktable::BlockFormat::footprint(v.format());
        for &(off, len) in ops {
            let off = off % size.max(1);
            let len = u64::from(len).min(size - off) as usize;
            let mut buf = vec![0u8; len];
            let _ = eng.block_on(v.read(&mut buf, off)).unwrap();
            if writable {
                let _ = eng.block_on(v.write(&vec![9u8; len], off)).unwrap();
            }
        }
        let grown = std::fs::metadata(&p).unwrap().len().saturating_sub(before);
        assert!(grown <= 2 * ops.len() as u64 * bs + MIB, "grew {grown}");
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    #[test]
    fn damaged_images_never_panic(
        patches in proptest::collection::vec((0usize..4096, proptest::num::u8::ANY), 1..8),
        ops in proptest::collection::vec((proptest::num::u64::ANY, 1u16..20000), 1..6),
        fix: bool,
    ) {
        damaged_image_is_handled(&patches, &ops, fix);
    }
}

// Differencing images.

/// A parent locator item of VHDX type with the given keys and values.
fn locator(kvs: &[(&str, &str)]) -> Vec<u8> {
    let mut b = vec![0u8; 20 + 12 * kvs.len()];
    b[..16].copy_from_slice(&VHDX_LOCATOR_TYPE);
    b[18..20].copy_from_slice(&(kvs.len() as u16).to_le_bytes());
    for (i, (k, v)) in kvs.iter().enumerate() {
        let mut put = |s: &str| {
            let at = b.len() as u32;
            let units: Vec<u8> = s.encode_utf16().flat_map(u16::to_le_bytes).collect();
            b.extend(&units);
            (at, units.len() as u16)
        };
        let (ko, kl) = put(k);
        let (vo, vl) = put(v);
        let e = 20 + 12 * i;
        put32(&mut b, e, ko);
        put32(&mut b, e + 4, vo);
        b[e + 8..e + 10].copy_from_slice(&kl.to_le_bytes());
        b[e + 10..e + 12].copy_from_slice(&vl.to_le_bytes());
    }
    b
}

/// Where the differencing test image keeps its parent locator (in the metadata region).
const LOCATOR_AT: usize = META_AT as usize + 0x10100;

/// [`image`] as a differencing image whose parent locator item is `loc`.
fn diff_image(size: u64, loc: &[u8]) -> Vec<u8> {
    let mut img = image(size);
    let m = META_AT as usize;
    put32(&mut img, m + 0x10004, 2); // has parent
    img[m + 10..m + 12].copy_from_slice(&6u16.to_le_bytes());
    let e = m + 32 + 32 * 5;
    img[e..e + 16].copy_from_slice(&PARENT_LOCATOR);
    put32(&mut img, e + 16, 0x10100);
    put32(&mut img, e + 20, loc.len() as u32);
    put32(&mut img, e + 24, 4);
    img[LOCATOR_AT..LOCATOR_AT + loc.len()].copy_from_slice(loc);
    img
}

/// The data write GUID [`image`] gives its headers, as a parent locator writes it.
const PARENT_GUID: &str = "{00000002-0000-0000-0000-000000000000}";

/// Whether sector `s` of the test's partially present block is the child's.
fn child_sector(s: u64) -> bool {
    s.is_multiple_of(7) || (500..900).contains(&s) || s == 2047
}

/// The parent's 8 MiB and the child's 2 MiB of data in [`diff_pair`]: the same bytes every time,
/// made once (made a byte at a time for each pair, they took most of a proptest case's time).
fn pair_data() -> &'static (Vec<u8>, Vec<u8>) {
    static DATA: std::sync::OnceLock<(Vec<u8>, Vec<u8>)> = std::sync::OnceLock::new();
    DATA.get_or_init(|| {
        let mut rng = 0x1234_5678_9abc_def1u64;
        let mut random = |n: usize| -> Vec<u8> {
            (0..n)
                .map(|_| {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng as u8
                })
                .collect()
        };
        let parent = random(8 * MIB as usize);
        let child = random(2 * MIB as usize);
        (parent, child)
    })
}

/// A parent (8 MiB, every block present with random bytes) as `p.vhdx` and a child as
/// `c.vhdx` over it: block 0 fully present, block 1 partially present (sectors
/// [`child_sector`] from the child), block 2 ZERO, block 3 UNMAPPED, the rest NOT_PRESENT.
/// `damage` changes the child's bytes before they are written. Returns the model of the
/// child's guest bytes and the child's path.
fn diff_pair(
    dir: &tempfile::TempDir,
    kvs: &[(&str, &str)],
    damage: impl FnOnce(&mut Vec<u8>),
) -> (Vec<u8>, PathBuf) {
    let size = 8 * MIB;
    let mut parent = image(size);
    let (pdata, cdata) = pair_data();
    for b in 0..8 {
        set_bat(&mut parent, b + b / 4096, present_entry(DATA_AT + b * MIB));
    }
    parent.extend(pdata);
    std::fs::write(dir.path().join("p.vhdx"), &parent).unwrap();

    let mut child = diff_image(size, &locator(kvs));
    set_bat(&mut child, 0, present_entry(DATA_AT));
    set_bat(
        &mut child,
        1,
        present_entry(DATA_AT + MIB) & !7 | u64::from(state::PARTIALLY_PRESENT),
    );
    set_bat(&mut child, 2, u64::from(state::ZERO));
    set_bat(&mut child, 3, u64::from(state::UNMAPPED));
    let sb = DATA_AT + 2 * MIB;
    set_bat(
        &mut child,
        bitmap_index(0, 4096),
        (sb & !(MIB - 1)) | u64::from(state::SB_PRESENT),
    );
    child.extend(cdata);
    child.resize((sb + MIB) as usize, 0);
    // Block 1's bits start at bit 2048 of the chunk's bitmap (1 MiB of 512-byte sectors).
    for s in 0..2048u64 {
        if child_sector(s) {
            let bit = 2048 + s;
            child[(sb + bit / 8) as usize] |= 1 << (bit % 8);
        }
    }
    let mut model = pdata.clone();
    model[..MIB as usize].copy_from_slice(&cdata[..MIB as usize]);
    for s in 0..2048usize {
        if child_sector(s as u64) {
            let at = MIB as usize + s * 512;
            model[at..at + 512].copy_from_slice(&cdata[at..at + 512]);
        }
    }
    model[2 * MIB as usize..4 * MIB as usize].fill(0);
    damage(&mut child);
    let p = dir.path().join("c.vhdx");
    std::fs::write(&p, &child).unwrap();
    (model, p)
}

fn good_kvs() -> Vec<(&'static str, &'static str)> {
    vec![
        ("parent_linkage", PARENT_GUID),
        ("relative_path", ".\\p.vhdx"),
        ("absolute_win32_path", "\\\\?\\d:\\vms\\p.vhdx"),
    ]
}

#[test]
fn guid_text_and_parent_locators_parse() {
    assert_eq!(parse_guid_text(PARENT_GUID), Some(DATA_WRITE_GUID_SAMPLE));
    assert_eq!(
        parse_guid_text("B04AEFB7-D19E-4A81-B789-25B8E9445913"),
        Some(VHDX_LOCATOR_TYPE)
    );
    for bad in [
        "",
        "{}",
        "{b04aefb7-d19e-4a81-b789-25b8e944591}",
        "b04aefb7d19e4a81b78925b8e9445913",
        "{g04aefb7-d19e-4a81-b789-25b8e9445913}",
    ] {
        assert_eq!(parse_guid_text(bad), None, "{bad}");
    }
    let l = parse_parent_locator(&locator(&[
        ("parent_linkage", PARENT_GUID),
        ("parent_linkage2", "{b04aefb7-d19e-4a81-b789-25b8e9445913}"),
        ("relative_path", "..\\x.vhdx"),
        ("volume_path", "\\\\?\\Volume{1}\\x.vhdx"),
        ("vendor_key", "ignored"),
    ]))
    .unwrap();
    assert_eq!(l.linkage, DATA_WRITE_GUID_SAMPLE);
    assert_eq!(l.linkage2, Some(VHDX_LOCATOR_TYPE));
    assert_eq!(l.relative_path.as_deref(), Some("..\\x.vhdx"));
    assert_eq!(l.absolute_win32_path, None);

    let good = locator(&good_kvs());
    type Damage = Box<dyn Fn(&mut Vec<u8>)>;
    let cases: Vec<(&str, Damage)> = vec![
        ("shorter than its header", Box::new(|b| b.truncate(10))),
        ("not VHDX's", Box::new(|b| b[0] ^= 1)),
        (
            "claims 65535 entries",
            Box::new(|b| b[18..20].copy_from_slice(&[0xff, 0xff])),
        ),
        ("outside it", Box::new(|b| put32(b, 20, 0x7fff_fff0))),
        (
            "outside it",
            Box::new(|b| b[28..30].copy_from_slice(&[0xff, 0xff])),
        ),
        (
            "odd length",
            Box::new(|b| b[30..32].copy_from_slice(&[3, 0])),
        ),
        ("outside it", Box::new(|b| put32(b, 24, 0))),
        (
            "not valid UTF-16",
            Box::new(|b| {
                // A lone high surrogate as the first key's first unit.
                let k = le32(b, 20) as usize;
                b[k..k + 2].copy_from_slice(&0xd800u16.to_le_bytes());
            }),
        ),
        (
            "NUL",
            Box::new(|b| {
                let k = le32(b, 20) as usize;
                b[k..k + 2].fill(0);
            }),
        ),
        (
            "not a GUID",
            Box::new(|b| {
                let v = le32(b, 24) as usize;
                b[v + 2] = b'x';
            }),
        ),
    ];
    for (want, damage) in cases {
        let mut b = good.clone();
        damage(&mut b);
        let e = parse_parent_locator(&b).unwrap_err();
        assert!(e.contains(want), "{want}: {e}");
        assert!(!e.contains('\n'), "{e}");
    }
    let e = parse_parent_locator(&locator(&[("relative_path", "p.vhdx")])).unwrap_err();
    assert!(e.contains("no parent_linkage"), "{e}");
    let e = parse_parent_locator(&locator(&[("parent_linkage", PARENT_GUID)])).unwrap_err();
    assert!(e.contains("names no path"), "{e}");
    let e = parse_parent_locator(&locator(&[
        ("parent_linkage", PARENT_GUID),
        ("relative_path", "a"),
        ("relative_path", "b"),
    ]))
    .unwrap_err();
    assert!(e.contains("twice"), "{e}");
}

/// [`image`]'s data write GUID bytes.
const DATA_WRITE_GUID_SAMPLE: Guid = [2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];

#[test]
fn a_differencing_image_reads_through_its_parent() {
    let dir = tempfile::tempdir().unwrap();
    let (model, p) = diff_pair(&dir, &good_kvs(), |_| {});
    let v = open(&p, opts(false)).unwrap();
    assert_eq!(read(&v, 0, model.len()).unwrap(), model);
    // Pieces at odd offsets across every kind of block, partial sectors included.
    let mut at = 0u64;
    let mut len = 1usize;
    while at < model.len() as u64 {
        let n = len.min(model.len() - at as usize);
        assert_eq!(
            read(&v, at, n).unwrap(),
            model[at as usize..at as usize + n],
            "{at}+{n}"
        );
        at += n as u64 + 77;
        len = (len * 3 + 511) % (300 << 10) + 1;
    }
    // Not present blocks are the parent's data, not holes; ZERO and UNMAPPED ones are holes.
    assert_eq!(v.table().get(4), Entry::Unallocated);
    let eng = engine();
    let hole = eng
        .block_on(crate::BlockBackend::seek(&v, &eng, 0, crate::Seek::Hole))
        .unwrap()
        .unwrap();
    assert_eq!(hole, Some(2 * MIB));
    let data = eng
        .block_on(crate::BlockBackend::seek(
            &v,
            &eng,
            2 * MIB,
            crate::Seek::Data,
        ))
        .unwrap()
        .unwrap();
    assert_eq!(data, Some(4 * MIB));
}

#[test]
fn a_chain_of_differencing_images_reads_through() {
    let dir = tempfile::tempdir().unwrap();
    let (model, c) = diff_pair(&dir, &good_kvs(), |_| {});
    // A grandchild over the child: its own block 5 fully present, the rest from the child.
    let child_guid = "{00000002-0000-0000-0000-000000000000}";
    let mut g = diff_image(
        8 * MIB,
        &locator(&[("parent_linkage", child_guid), ("relative_path", "c.vhdx")]),
    );
    set_bat(&mut g, 5, present_entry(DATA_AT));
    g.extend(std::iter::repeat_n(0x5a, MIB as usize));
    let gp = dir.path().join("g.vhdx");
    std::fs::write(&gp, &g).unwrap();
    let v = open(&gp, opts(false)).unwrap();
    let mut want = model;
    want[5 * MIB as usize..6 * MIB as usize].fill(0x5a);
    assert_eq!(read(&v, 0, want.len()).unwrap(), want);
    drop(c);
}

#[test]
fn differencing_refusals_are_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let check = |p: &Path, writable: bool, want: &str| {
        let r = reason(p, writable);
        assert!(r.contains(want), "{want}: {r}");
        assert!(!r.contains('\n'), "{r}");
    };
    let (_, p) = diff_pair(&dir, &good_kvs(), |_| {});
    check(&p, true, "read-only: drop --writable");
    // The parent was written since: its data write GUID changed.
    let mut kvs = good_kvs();
    kvs[0].1 = "{00000003-0000-0000-0000-000000000000}";
    let (_, p) = diff_pair(&dir, &kvs, |_| {});
    check(&p, false, "data write GUID");
    // ... unless parent_linkage2 names it.
    kvs.push(("parent_linkage2", PARENT_GUID));
    let (_, p) = diff_pair(&dir, &kvs, |_| {});
    open(&p, opts(false)).unwrap();
    // The child names itself: a loop.
    let mut kvs = good_kvs();
    kvs[1].1 = "c.vhdx";
    let (_, p) = diff_pair(&dir, &kvs, |_| {});
    check(&p, false, "loop");
    // Nowhere to be found.
    let mut kvs = good_kvs();
    kvs[1].1 = "..\\elsewhere\\p.vhdx";
    let (_, p) = diff_pair(&dir, &kvs, |_| {});
    check(&p, false, "not where its parent locator says");
    // A parent that is not a VHDX.
    std::fs::write(dir.path().join("raw.img"), vec![0u8; 4 * MIB as usize]).unwrap();
    let mut kvs = good_kvs();
    kvs[1].1 = "raw.img";
    let (_, p) = diff_pair(&dir, &kvs, |_| {});
    check(&p, false, "not a VHDX image");
    // Has parent, no locator.
    let (_, p) = diff_pair(&dir, &good_kvs(), |i| {
        i[META_AT as usize + 10..META_AT as usize + 12].copy_from_slice(&5u16.to_le_bytes())
    });
    check(&p, false, "no parent locator");
    // A locator with absurd lengths.
    let (_, p) = diff_pair(&dir, &good_kvs(), |i| {
        i[LOCATOR_AT + 18..LOCATOR_AT + 20].copy_from_slice(&[0xff, 0xff])
    });
    check(&p, false, "parent locator claims");
    // --no-backing refuses before opening anything.
    let (_, p) = diff_pair(&dir, &good_kvs(), |_| {});
    match open(
        &p,
        VhdxOptions {
            no_backing: true,
            ..opts(false)
        },
    ) {
        Err(OpenError::Format { reason, .. }) => {
            assert!(reason.contains("--no-backing"), "{reason}")
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("opened"),
    }
}

#[test]
fn bad_sector_bitmaps_fail_only_their_partial_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let sb_entry = (BAT_AT + 8 * bitmap_index(0, 4096)) as usize;
    type Damage = Box<dyn Fn(&mut Vec<u8>)>;
    let cases: Vec<(&str, Damage)> = vec![
        (
            "past the end",
            Box::new(move |i| put64(i, sb_entry, (1 << 40) | 6)),
        ),
        (
            "into the metadata",
            Box::new(move |i| put64(i, sb_entry, META_AT | 6)),
        ),
        (
            "into the BAT",
            Box::new(move |i| put64(i, sb_entry, BAT_AT | 6)),
        ),
        (
            "over block 0",
            Box::new(move |i| put64(i, sb_entry, DATA_AT | 6)),
        ),
        ("not present", Box::new(move |i| put64(i, sb_entry, 0))),
        (
            "reserved state",
            Box::new(move |i| put64(i, sb_entry, (DATA_AT + 2 * MIB) | 3)),
        ),
    ];
    for (what, damage) in cases {
        let (model, p) = diff_pair(&dir, &good_kvs(), damage);
        let v = open(&p, opts(false)).unwrap_or_else(|e| panic!("{what}: {e}"));
        let e = read(&v, MIB + 4096, 512).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{what}");
        assert_eq!(v.table().get(1), Entry::Bad, "{what}");
        // Everything else serves (block 0 too unless the bitmap lies over it).
        let from = if what == "over block 0" { 2 * MIB } else { 0 };
        if from == 0 {
            assert_eq!(
                read(&v, 0, MIB as usize).unwrap(),
                model[..MIB as usize],
                "{what}"
            );
        }
        assert_eq!(
            read(&v, 2 * MIB, 6 * MIB as usize).unwrap(),
            model[2 * MIB as usize..],
            "{what}"
        );
        assert!(open(&p, opts(true)).is_err());
    }
}

/// Any bytes of a differencing image's parent locator, its sector bitmap entry or block 1's
/// entry overwritten: opening refuses in one line or serves, reads fail or succeed, never a
/// panic.
fn damaged_diff_is_handled(patches: &[(usize, u8)], ops: &[(u64, u16)]) {
    let dir = tempfile::tempdir().unwrap();
    let sb_entry = (BAT_AT + 8 * bitmap_index(0, 4096)) as usize;
    let spots = [LOCATOR_AT, sb_entry, BAT_AT as usize + 8];
    let (_, p) = diff_pair(&dir, &good_kvs(), |img| {
        for &(at, v) in patches {
            let base = spots[at % spots.len()];
            let span = if base == LOCATOR_AT { 160 } else { 8 };
            img[base + (at / spots.len()) % span] = v;
        }
    });
    let v = match open(&p, opts(false)) {
        Ok(v) => v,
        Err(e) => {
            assert!(!e.to_string().contains('\n'), "{e}");
            return;
        }
    };
    let eng = engine();
    for &(off, len) in ops {
        let off = off % (8 * MIB);
        let len = u64::from(len).min(8 * MIB - off) as usize;
        let mut buf = vec![0u8; len];
        let _ = eng.block_on(v.read(&mut buf, off)).unwrap();
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    #[test]
    fn damaged_differencing_images_never_panic(
        patches in proptest::collection::vec((0usize..4096, proptest::num::u8::ANY), 1..8),
        ops in proptest::collection::vec((proptest::num::u64::ANY, 1u16..20000), 1..6),
    ) {
        damaged_diff_is_handled(&patches, &ops);
    }
}

#[test]
fn a_chain_of_huge_tables_is_refused_before_it_holds_them_all() {
    // Five images of 8 Mi blocks each (8 TiB in 1 MiB blocks), sparse files: each alone is
    // within one table's bound, the chain is not.
    let dir = tempfile::tempdir().unwrap();
    let size = crate::blocktable::MAX_ENTRIES * MIB;
    let names = ["i0.vhdx", "i1.vhdx", "i2.vhdx", "i3.vhdx", "i4.vhdx"];
    for (i, name) in names.iter().enumerate() {
        let mut img = match names.get(i + 1) {
            Some(parent) => diff_image(
                size,
                &locator(&[("parent_linkage", PARENT_GUID), ("relative_path", parent)]),
            ),
            None => image(size),
        };
        put64(&mut img, META_AT as usize + 0x10008, size);
        for rt in [RT1, RT2] {
            put32(&mut img, rt + 16 + 24, 72 * MIB as u32);
        }
        reseal(&mut img);
        let p = dir.path().join(name);
        std::fs::write(&p, &img).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(BAT_AT + 72 * MIB)
            .unwrap();
    }
    let r = reason(&dir.path().join(names[0]), false);
    assert!(r.contains("more than fusex holds for a chain"), "{r}");
    assert!(!r.contains('\n'), "{r}");
    // Four of them are within the bound.
    open(&dir.path().join(names[1]), opts(false)).unwrap();
}
