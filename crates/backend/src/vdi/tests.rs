//! VDI parsing and allocation on images built here byte by byte (the end-to-end tests in
//! `tests/formats.rs` use `qemu-img` as the oracle).

use super::*;
use crate::blocktable::testing::{self, read, write, Damage};
use std::path::PathBuf;

const BS: u64 = 64 * 1024;

/// A dynamic image of `blocks` blocks of [`BS`], map at 512, data after it, nothing allocated.
fn image(blocks: u32) -> Vec<u8> {
    let mut h = [0u8; HEADER_LEN];
    h[..40].copy_from_slice(b"<<< Oracle VM VirtualBox Disk Image >>>\n");
    h[64..68].copy_from_slice(&VDI_SIGNATURE.to_le_bytes());
    h[68..72].copy_from_slice(&VERSION_1_1.to_le_bytes());
    h[72..76].copy_from_slice(&0x180u32.to_le_bytes());
    h[76..80].copy_from_slice(&TYPE_DYNAMIC.to_le_bytes());
    let map_len = (u64::from(blocks) * 4).next_multiple_of(512);
    h[340..344].copy_from_slice(&512u32.to_le_bytes());
    h[344..348].copy_from_slice(&((512 + map_len) as u32).to_le_bytes());
    h[360..364].copy_from_slice(&512u32.to_le_bytes());
    h[368..376].copy_from_slice(&(u64::from(blocks) * BS).to_le_bytes());
    h[376..380].copy_from_slice(&(BS as u32).to_le_bytes());
    h[384..388].copy_from_slice(&blocks.to_le_bytes());
    h[392] = 1; // an image UUID
    let mut img = h.to_vec();
    img.extend(std::iter::repeat_n(0xffu8, map_len as usize));
    img
}

fn set(img: &mut [u8], at: usize, v: u32) {
    img[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn set_map(img: &mut [u8], block: usize, v: u32) {
    set(img, 512 + 4 * block, v);
}

fn write_img(dir: &tempfile::TempDir, bytes: &[u8]) -> PathBuf {
    testing::write_img(dir, "t.vdi", bytes)
}

fn reason(p: &Path, writable: bool) -> String {
    testing::reason(open(p, writable, Locking::Off))
}

#[test]
fn bad_headers_are_refused_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(&str, Damage)> = vec![
        ("no VDI signature", Box::new(|i| i[64] = 0)),
        ("version 1.0", Box::new(|i| set(i, 68, 0x0001_0000))),
        ("differencing", Box::new(|i| i[440] = 1)),
        ("differencing", Box::new(|i| set(i, 76, 4))),
        ("image type 3", Box::new(|i| set(i, 76, 3))),
        ("multiple of 512", Box::new(|i| set(i, 340, 513))),
        ("sector size", Box::new(|i| set(i, 360, 4096))),
        ("block size 0", Box::new(|i| set(i, 376, 0))),
        ("block size 3000", Box::new(|i| set(i, 376, 3000))),
        ("extra bytes", Box::new(|i| set(i, 380, 512))),
        (
            "disk size",
            Box::new(|i| i[368..376].copy_from_slice(&(1u64 << 60).to_le_bytes())),
        ),
        (
            "more than fusex holds",
            Box::new(|i| {
                set(i, 384, u32::MAX);
                i[368..376].copy_from_slice(&0u64.to_le_bytes());
            }),
        ),
        ("block map at", Box::new(|i| set(i, 340, 0))),
        ("block map at", Box::new(|i| set(i, 340, 1 << 30))),
        ("block map at", Box::new(|i| set(i, 344, 512))),
    ];
    testing::refused_in_one_line(&dir, "t.vdi", &image(4), cases, |p| reason(p, false));
}

#[test]
fn allocation_appends_blocks_and_counts_them() {
    let dir = tempfile::tempdir().unwrap();
    let mut img = image(8);
    set_map(&mut img, 6, DISCARDED);
    let p = write_img(&dir, &img);
    let data_at = img.len() as u64;
    let vdi = open(&p, true, Locking::Off).unwrap();
    assert_eq!(crate::BlockBackend::size(&vdi), 8 * BS);
    assert_eq!(
        read(&vdi, 0, (8 * BS) as usize).unwrap(),
        vec![0; (8 * BS) as usize]
    );
    write(&vdi, 5 * BS + 7, &[1; 100]).unwrap();
    write(&vdi, 2 * BS + BS - 50, &[2; 100]).unwrap(); // blocks 2 and 3
    write(&vdi, 6 * BS, &[3; 10]).unwrap(); // the discarded block
    drop(vdi);
    let bytes = std::fs::read(&p).unwrap();
    assert_eq!(bytes.len() as u64, data_at + 4 * BS);
    let map = |b: usize| le32(&bytes, 512 + 4 * b);
    assert_eq!([map(5), map(2), map(3), map(6)], [0, 1, 2, 3]);
    assert_eq!(le32(&bytes, ALLOCATED_AT as usize), 4);
    let vdi = open(&p, false, Locking::Off).unwrap();
    let got = read(&vdi, 0, (8 * BS) as usize).unwrap();
    let mut want = vec![0u8; (8 * BS) as usize];
    want[(5 * BS + 7) as usize..][..100].fill(1);
    want[(3 * BS - 50) as usize..][..100].fill(2);
    want[(6 * BS) as usize..][..10].fill(3);
    assert_eq!(got, want);
}

#[test]
fn a_reused_data_block_is_zeroed_before_it_is_written() {
    // Block 0 uses data block 0; data block 1 exists in the file (a leak) full of 0x55.
    let dir = tempfile::tempdir().unwrap();
    let mut img = image(4);
    set_map(&mut img, 0, 0);
    img.extend(std::iter::repeat_n(7u8, BS as usize));
    img.extend(std::iter::repeat_n(0x55u8, BS as usize));
    let p = write_img(&dir, &img);
    let vdi = open(&p, true, Locking::Off).unwrap();
    write(&vdi, 3 * BS + 10, &[9; 10]).unwrap();
    let got = read(&vdi, 3 * BS, BS as usize).unwrap();
    let mut want = vec![0u8; BS as usize];
    want[10..20].fill(9);
    assert_eq!(got, want);
    assert_eq!(read(&vdi, 0, 4).unwrap(), vec![7; 4]);
}

#[test]
fn bad_map_entries_fail_their_blocks_read_only_and_refuse_writing() {
    let dir = tempfile::tempdir().unwrap();
    let mut img = image(4);
    img.extend(std::iter::repeat_n(7u8, BS as usize));
    set_map(&mut img, 0, 0);
    set_map(&mut img, 1, 0); // the same data block as block 0
    set_map(&mut img, 2, 3); // past the end of the file
    set_map(&mut img, 3, 1000); // past the image's blocks
    let p = write_img(&dir, &img);
    testing::bad_blocks_refused(&p, BS, 4, 10, |p, w| open(p, w, Locking::Off));
    set_map(&mut img, 1, UNALLOCATED);
    let p = write_img(&dir, &img);
    let vdi = open(&p, false, Locking::Off).unwrap();
    assert_eq!(read(&vdi, 0, 10).unwrap(), vec![7; 10]);
    assert_eq!(read(&vdi, BS, 10).unwrap(), vec![0; 10]);
}

#[test]
fn probing_needs_the_signature() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_img(&dir, &image(1));
    assert!(probe(&p).unwrap());
    let p = write_img(&dir, &[0u8; 100]);
    assert!(!probe(&p).unwrap());
}

/// Any bytes of the header or block map overwritten: opening either refuses in one line or
/// serves; reads and writes then fail or succeed, never panic, and writes grow the file by at
/// most a block each.
fn damaged_image_is_handled(patches: &[(usize, u8)], ops: &[(u64, u16)]) {
    let mut img = image(8);
    set_map(&mut img, 0, 0);
    set_map(&mut img, 5, 1);
    img.extend(std::iter::repeat_n(7u8, 2 * BS as usize));
    for &(at, v) in patches {
        let at = at % 1024; // header, block map
        img[at] = v;
    }
    let dir = tempfile::tempdir().unwrap();
    let p = write_img(&dir, &img);
    let opened = |p: &Path, writable| open(p, writable, Locking::Off);
    if let Some((grown, bs)) = testing::exercise(&p, ops, opened) {
        // A block reused past the map's last index may lie beyond the old end by the blocks
        // the header leaves unused, but never more than the image's blocks.
        assert!(grown <= 2 * ops.len() as u64 * bs + 8 * bs, "grew {grown}");
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(96))]
    #[test]
    fn damaged_images_never_panic(
        patches in proptest::collection::vec((0usize..1024, proptest::num::u8::ANY), 1..8),
        ops in testing::ops(),
    ) {
        damaged_image_is_handled(&patches, &ops);
    }
}
