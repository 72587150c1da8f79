//! VHD parsing and the bitmap rules on images built here byte by byte (the end-to-end tests in
//! `tests/formats.rs` use `qemu-img` as the oracle).

use super::*;
use crate::blocktable::testing::{self, read, write, Damage};
use std::path::PathBuf;

const MIB: u64 = 1 << 20;

/// A footer for a disk of `size` bytes made by `creator`.
fn footer(size: u64, disk_type: u32, creator: &[u8; 4]) -> [u8; FOOTER_LEN] {
    let mut b = [0u8; FOOTER_LEN];
    b[..8].copy_from_slice(&VHD_COOKIE);
    b[12..16].copy_from_slice(&0x0001_0000u32.to_be_bytes());
    let data_offset = if disk_type == DISK_FIXED {
        u64::MAX
    } else {
        512
    };
    b[16..24].copy_from_slice(&data_offset.to_be_bytes());
    b[28..32].copy_from_slice(creator);
    b[40..48].copy_from_slice(&size.to_be_bytes());
    b[48..56].copy_from_slice(&size.to_be_bytes());
    // Geometry 1000 cylinders x 4 heads x 16 sectors: 32 MB by CHS.
    b[56..58].copy_from_slice(&1000u16.to_be_bytes());
    b[58] = 4;
    b[59] = 16;
    b[60..64].copy_from_slice(&disk_type.to_be_bytes());
    let c = checksum(&b, 64);
    b[64..68].copy_from_slice(&c.to_be_bytes());
    b
}

fn header(bat: u64, entries: u32, block_size: u32) -> [u8; HEADER_LEN] {
    let mut b = [0u8; HEADER_LEN];
    b[..8].copy_from_slice(&DYNAMIC_COOKIE);
    b[8..16].copy_from_slice(&u64::MAX.to_be_bytes());
    b[16..24].copy_from_slice(&bat.to_be_bytes());
    b[24..28].copy_from_slice(&0x0001_0000u32.to_be_bytes());
    b[28..32].copy_from_slice(&entries.to_be_bytes());
    b[32..36].copy_from_slice(&block_size.to_be_bytes());
    let c = checksum(&b, 36);
    b[36..40].copy_from_slice(&c.to_be_bytes());
    b
}

/// A dynamic image of `size` bytes (size from the footer) in `bs`-byte blocks, BAT at 1536,
/// every block unallocated: footer copy, header, BAT, footer.
fn dynamic(size: u64, bs: u32) -> Vec<u8> {
    let entries = size.div_ceil(u64::from(bs)) as u32;
    let ft = footer(size, DISK_DYNAMIC, b"qem2");
    let mut img = ft.to_vec();
    img.extend_from_slice(&header(1536, entries, bs));
    let bat_len = (u64::from(entries) * 4).next_multiple_of(512) as usize;
    img.extend(std::iter::repeat_n(0xffu8, bat_len));
    img.extend_from_slice(&ft);
    img
}

fn write_img(dir: &tempfile::TempDir, bytes: &[u8]) -> PathBuf {
    testing::write_img(dir, "t.vhd", bytes)
}

fn reason(p: &Path, writable: bool) -> String {
    testing::reason(open(p, writable, Locking::Off))
}

/// Sets BAT entry `i` of an image made by [`dynamic`].
fn set_bat(img: &mut [u8], i: usize, v: u32) {
    img[1536 + 4 * i..][..4].copy_from_slice(&v.to_be_bytes());
}

#[test]
fn size_follows_the_creator_as_qemu_does() {
    let f = footer(100 * MIB, DISK_DYNAMIC, b"qem2");
    assert_eq!(parse_footer(&f).unwrap().size, 100 * MIB);
    // Virtual PC (and QEMU's default) images: CHS.
    let f = footer(100 * MIB, DISK_DYNAMIC, b"vpc ");
    assert_eq!(parse_footer(&f).unwrap().size, 1000 * 4 * 16 * 512);
}

#[test]
fn damaged_footers_and_headers_are_refused() {
    let mut f = footer(MIB, DISK_DYNAMIC, b"qem2");
    f[100] ^= 1;
    assert!(parse_footer(&f).unwrap_err().contains("checksum"));
    let mut h = header(1536, 1, 2 * MIB as u32);
    h[200] ^= 1;
    assert!(parse_header(&h).unwrap_err().contains("checksum"));
    for bs in [0u32, 3000, 256, 512 << 20] {
        let e = parse_header(&header(1536, 1, bs)).unwrap_err();
        assert!(e.contains("power of two"), "{bs}: {e}");
    }
    // 2^60 bytes by the footer's size field.
    let f = footer(1 << 60, DISK_DYNAMIC, b"qem2");
    assert!(parse_footer(&f).unwrap_err().contains("2040 GiB"));
}

#[test]
fn whole_images_with_bad_headers_are_refused_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let good = dynamic(8 * MIB, 2 * MIB as u32);
    let cases: Vec<(&str, Damage)> = vec![
        (
            "no VHD footer",
            Box::new(|i| i.iter_mut().for_each(|b| *b = 0)),
        ),
        ("footer checksum", Box::new(|i| i[300] = 1)),
        (
            "differencing",
            Box::new(|i| i[..512].copy_from_slice(&footer(8 * MIB, DISK_DIFFERENCING, b"qem2"))),
        ),
        (
            "dynamic header at",
            Box::new(|i| {
                let mut f = footer(8 * MIB, DISK_DYNAMIC, b"qem2");
                f[16..24].copy_from_slice(&(1u64 << 40).to_be_bytes());
                let c = checksum(&f, 64);
                f[64..68].copy_from_slice(&c.to_be_bytes());
                i[..512].copy_from_slice(&f);
            }),
        ),
        (
            "less than the disk",
            Box::new(|i| i[512..1536].copy_from_slice(&header(1536, 2, 2 * MIB as u32))),
        ),
        (
            "block table at",
            Box::new(|i| i[512..1536].copy_from_slice(&header(1 << 40, 4, 2 * MIB as u32))),
        ),
        (
            "block table at",
            Box::new(|i| i[512..1536].copy_from_slice(&header(768, 4, 2 * MIB as u32))),
        ),
        (
            "power of two",
            Box::new(|i| i[512..1536].copy_from_slice(&header(1536, 4, 3 << 20))),
        ),
    ];
    testing::refused_in_one_line(&dir, "t.vhd", &good, cases, |p| reason(p, false));
}

#[test]
fn an_absurd_table_is_refused_before_it_is_allocated() {
    // 2000 GiB in 512-byte blocks: 4 Gi entries.
    let dir = tempfile::tempdir().unwrap();
    let mut img = dynamic(8 * MIB, 2 * MIB as u32);
    img[..512].copy_from_slice(&footer(2000 << 30, DISK_DYNAMIC, b"qem2"));
    let last = img.len() - 512;
    img[last..].copy_from_slice(&footer(2000 << 30, DISK_DYNAMIC, b"qem2"));
    img[512..1536].copy_from_slice(&header(1536, u32::MAX, 512));
    let p = write_img(&dir, &img);
    assert!(reason(&p, false).contains("more than fusex holds"));
}

#[test]
fn bad_table_entries_fail_their_blocks_read_only_and_refuse_writing() {
    let dir = tempfile::tempdir().unwrap();
    let bs = 2 * MIB;
    let mut img = dynamic(4 * bs, bs as u32);
    // Block 0: allocated properly right after the BAT (sector 4: bitmap 512 + data).
    let b0 = img.len() as u64 - 512;
    set_bat(&mut img, 0, (b0 / 512) as u32);
    let ft = img.split_off(b0 as usize);
    img.extend_from_slice(&[0xff; 512]);
    img.extend(std::iter::repeat_n(7u8, bs as usize));
    img.extend_from_slice(&ft);
    // Block 1 past the end, block 2 into the header, block 3 on block 0.
    set_bat(&mut img, 1, 1 << 30);
    set_bat(&mut img, 2, 1);
    set_bat(&mut img, 3, (b0 / 512) as u32);
    let p = write_img(&dir, &img);
    testing::bad_blocks_refused(&p, bs, 4, 4096, |p, w| open(p, w, Locking::Off));
    // Only block 1 past the end: the rest serves.
    set_bat(&mut img, 2, UNALLOCATED);
    set_bat(&mut img, 3, UNALLOCATED);
    let p = write_img(&dir, &img);
    let ro = open(&p, false, Locking::Off).unwrap();
    assert_eq!(read(&ro, 0, 4096).unwrap(), vec![7; 4096]);
    assert!(read(&ro, bs, 1).is_err());
    assert_eq!(read(&ro, 2 * bs, 4096).unwrap(), vec![0; 4096]);
}

#[test]
fn allocation_appends_the_block_and_keeps_a_footer_at_the_end() {
    let dir = tempfile::tempdir().unwrap();
    let bs = 2 * MIB;
    let p = write_img(&dir, &dynamic(4 * bs, bs as u32));
    let before = std::fs::metadata(&p).unwrap().len();
    let img = open(&p, true, Locking::Off).unwrap();
    write(&img, 2 * bs + 1000, &[5; 3000]).unwrap();
    write(&img, 2 * bs + 9000, &[6; 10]).unwrap();
    drop(img);
    let bytes = std::fs::read(&p).unwrap();
    assert_eq!(
        bytes.len() as u64,
        before + 512 + bs,
        "bitmap and block appended"
    );
    let tail: [u8; 512] = bytes[bytes.len() - 512..].try_into().unwrap();
    assert_eq!(
        tail,
        <[u8; 512]>::try_from(&bytes[..512]).unwrap(),
        "footer at the end"
    );
    let host = u64::from(be32(&bytes, 1536 + 8)) * 512;
    assert_eq!(host, before - 512, "where the old footer was");
    assert!(
        bytes[host as usize..][..512].iter().all(|&b| b == 0xff),
        "bitmap"
    );
    let img = open(&p, false, Locking::Off).unwrap();
    let got = read(&img, 2 * bs, 10_000).unwrap();
    assert!(got[..1000].iter().all(|&b| b == 0));
    assert!(got[1000..4000].iter().all(|&b| b == 5));
    assert!(got[4000..9000].iter().all(|&b| b == 0));
    assert!(got[9000..9010].iter().all(|&b| b == 6));
}

#[test]
fn clear_bitmap_bits_read_as_zeroes_and_writes_set_them() {
    let dir = tempfile::tempdir().unwrap();
    let bs = 64 * 1024u64; // 128 sectors: a 16-byte bitmap in one 512-byte sector
    let mut img = dynamic(4 * bs, bs as u32);
    let b0 = img.len() as u64 - 512;
    set_bat(&mut img, 0, (b0 / 512) as u32);
    let ft = img.split_off(b0 as usize);
    let mut bitmap = [0u8; 512];
    bitmap[..16].fill(0xff);
    bitmap[0] = 0b1011_1111; // sector 1 clear
    bitmap[15] = 0xfe; // sector 127 clear
    img.extend_from_slice(&bitmap);
    img.extend(std::iter::repeat_n(9u8, bs as usize));
    img.extend_from_slice(&ft);
    let p = write_img(&dir, &img);
    let vhd = open(&p, true, Locking::Off).unwrap();
    let got = read(&vhd, 0, bs as usize).unwrap();
    assert!(got[..512].iter().all(|&b| b == 9));
    assert!(got[512..1024].iter().all(|&b| b == 0), "sector 1 is clear");
    assert!(got[1024..bs as usize - 512].iter().all(|&b| b == 9));
    assert!(
        got[bs as usize - 512..].iter().all(|&b| b == 0),
        "sector 127"
    );
    // Half of sector 1: the other half must read zeroes afterwards, not the 9s on disk.
    write(&vhd, 512 + 100, &[4; 200]).unwrap();
    let got = read(&vhd, 512, 512).unwrap();
    assert!(got[..100].iter().all(|&b| b == 0));
    assert!(got[100..300].iter().all(|&b| b == 4));
    assert!(got[300..].iter().all(|&b| b == 0));
    assert!(matches!(
        vhd.table().get(0),
        Entry::Data {
            flags: BITMAP_PARTIAL,
            ..
        }
    ));
    write(&vhd, bs - 512, &[3; 512]).unwrap();
    assert!(
        matches!(vhd.table().get(0), Entry::Data { flags: 0, .. }),
        "full now"
    );
    drop(vhd);
    let bytes = std::fs::read(&p).unwrap();
    assert!(bytes[b0 as usize..][..16].iter().all(|&b| b == 0xff));
    let vhd = open(&p, false, Locking::Off).unwrap();
    let got = read(&vhd, 0, bs as usize).unwrap();
    assert!(got[512..612].iter().all(|&b| b == 0));
    assert!(got[bs as usize - 512..].iter().all(|&b| b == 3));
}

#[test]
fn fixed_images_map_the_data_before_the_footer() {
    let dir = tempfile::tempdir().unwrap();
    let size = 3 * MIB;
    let mut img: Vec<u8> = (0..size).map(|i| (i % 253) as u8).collect();
    img.extend_from_slice(&footer(size, DISK_FIXED, b"win "));
    let p = write_img(&dir, &img);
    let vhd = open(&p, true, Locking::Off).unwrap();
    assert_eq!(crate::BlockBackend::size(&vhd), size);
    assert_eq!(read(&vhd, 0, size as usize).unwrap(), &img[..size as usize]);
    write(&vhd, size - 10, &[1; 10]).unwrap();
    drop(vhd);
    let bytes = std::fs::read(&p).unwrap();
    assert_eq!(bytes.len() as u64, size + 512);
    assert_eq!(&bytes[(size - 10) as usize..size as usize], &[1; 10]);
    // Truncated: the footer promises more than the file holds.
    let mut short = img[(MIB as usize)..].to_vec();
    short.truncate(short.len());
    let p = write_img(&dir, &short);
    assert!(reason(&p, false).contains("truncated"));
}

/// Any bytes of the metadata overwritten: opening either refuses in one line or serves; reads
/// and writes then fail or succeed, never panic, and writes grow the file by at most one block
/// footprint and a footer per write.
fn damaged_image_is_handled(patches: &[(usize, u8)], ops: &[(u64, u16)], fix: bool) {
    let bs = 64 * 1024u64;
    let mut img = dynamic(8 * bs, bs as u32);
    let b0 = img.len() as u64 - 512;
    set_bat(&mut img, 0, (b0 / 512) as u32);
    set_bat(&mut img, 3, (b0 / 512 + 1 + bs / 512) as u32);
    let ft = img.split_off(b0 as usize);
    for fill in [1u8, 2] {
        img.extend_from_slice(&[0xff; 512]);
        img.extend(std::iter::repeat_n(fill, bs as usize));
    }
    img.extend_from_slice(&ft);
    for &(at, v) in patches {
        let at = at % 2048; // footer copy, dynamic header, BAT
        img[at] = v;
    }
    if fix {
        // Past the checksums, to the fields behind them.
        let c = checksum(&img[..512], 64);
        img[64..68].copy_from_slice(&c.to_be_bytes());
        let c = checksum(&img[512..1536], 36);
        img[548..552].copy_from_slice(&c.to_be_bytes());
    }
    let dir = tempfile::tempdir().unwrap();
    let p = write_img(&dir, &img);
    let opened = |p: &Path, writable| open(p, writable, Locking::Off);
    if let Some((grown, footprint)) = testing::exercise(&p, ops, opened) {
        assert!(
            grown <= ops.len() as u64 * 2 * (footprint + 512),
            "grew {grown}"
        );
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(96))]
    #[test]
    fn damaged_images_never_panic(
        patches in proptest::collection::vec((0usize..2048, proptest::num::u8::ANY), 1..8),
        ops in testing::ops(),
        fix: bool,
    ) {
        damaged_image_is_handled(&patches, &ops, fix);
    }
}
