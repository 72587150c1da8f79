//! Differencing VHDX images, served read-only.
//!
//! QEMU refuses differencing VHDX images, so `qemu-img` cannot make one: [`craft`] makes one
//! from a dynamic image `qemu-img create -f vhdx` made, as Hyper-V lays them out. It sets the
//! "has parent" flag in the file parameters, adds a parent locator item to the metadata table
//! (neither has a checksum), appends payload blocks (fully or partially present) and sector
//! bitmap blocks at the end of the file and writes their BAT entries (no checksum either);
//! the headers and region tables it leaves alone, so their CRC-32C stays valid (checked).
//!
//! The oracle: the parent's bytes as `qemu-img convert -O raw` gives them, overlaid with the
//! sectors the child holds (and zeroes for its ZERO and UNMAPPED blocks); every byte read
//! through a real fusex mount is compared with it. Also: a chain of two differencing images;
//! a disk past one chunk (4 GiB of 512-byte sectors), whose second sector bitmap entry is
//! interleaved in the BAT; `--writable` refused in one line; a parent written since (its data
//! write GUID changed by QEMU), a loop, bad locators, `--no-backing` and a parent the image's
//! owner may not read refused in one line; bad sector bitmap entries failing only their
//! partially present blocks with EIO.
//!
//! Every test runs on the transport `FUSEX_E2E_TRANSPORT` names (legacy or uring).

use std::fs;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

use fusex_e2e::*;

const TOOLS: &[&str] = &["qemu-img", "qemu-io"];

fn qemu_img(args: &[&str], paths: &[&Path]) {
    let mut c = Command::new("qemu-img");
    c.args(args);
    for p in paths {
        c.arg(p);
    }
    run_ok(&mut c);
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().unwrap())
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// CRC-32C of `b` with its checksum field (at 4) taken as zero.
fn crc32c_sealed(b: &[u8]) -> u32 {
    let mut zeroed = b.to_vec();
    zeroed[4..8].fill(0);
    crc32c(&zeroed)
}

/// The parent locator item's GUID (a8d35f2d-b30b-454d-abf7-d3d84834ab0c) as stored.
const PARENT_LOCATOR: [u8; 16] = [
    0x2d, 0x5f, 0xd3, 0xa8, 0x0b, 0xb3, 0x4d, 0x45, 0xab, 0xf7, 0xd3, 0xd8, 0x48, 0x34, 0xab, 0x0c,
];
/// The VHDX parent locator type (b04aefb7-d19e-4a81-b789-25b8e9445913) as stored.
const VHDX_LOCATOR: [u8; 16] = [
    0xb7, 0xef, 0x4a, 0xb0, 0x9e, 0xd1, 0x81, 0x4a, 0xb7, 0x89, 0x25, 0xb8, 0xe9, 0x44, 0x59, 0x13,
];

/// Where `qemu-img` put a VHDX's structures, and its parameters.
struct Layout {
    header: usize,
    bat: usize,
    metadata: usize,
    params: usize,
    block_size: u64,
    logical_sector: u64,
}

fn layout(b: &[u8]) -> Layout {
    let header = if le64(b, (128 << 10) + 8) > le64(b, (64 << 10) + 8) {
        128 << 10
    } else {
        64 << 10
    };
    let rt = 192 << 10;
    assert_eq!(&b[rt..rt + 4], b"regi", "setup: region table");
    let (mut bat, mut metadata) = (0, 0);
    for i in 0..le32(b, rt + 8) as usize {
        let e = rt + 16 + 32 * i;
        match b[e] {
            0x66 => bat = le64(b, e + 16) as usize,
            0x06 => metadata = le64(b, e + 16) as usize,
            x => panic!("setup: region {x:#x}"),
        }
    }
    assert_eq!(&b[metadata..metadata + 8], b"metadata", "setup: metadata");
    let (mut params, mut lss) = (0, 0);
    for i in 0..le16(b, metadata + 10) as usize {
        let e = metadata + 32 + 32 * i;
        let off = metadata + le32(b, e + 16) as usize;
        match b[e] {
            0x37 => params = off, // caa16737-...: file parameters
            0x1d => lss = off,    // 8141bf1d-...: logical sector size
            _ => {}
        }
    }
    assert!(params > 0 && lss > 0, "setup: metadata items");
    Layout {
        header,
        bat,
        metadata,
        params,
        block_size: u64::from(le32(b, params)),
        logical_sector: u64::from(le32(b, lss)),
    }
}

/// The current header's data write GUID, as a parent locator writes it:
/// `{xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx}`, lowercase.
fn data_write_guid(img: &Path) -> String {
    let b = fs::read(img).unwrap();
    let g = &b[layout(&b).header + 32..][..16];
    format!(
        "{{{:08x}-{:04x}-{:04x}-{}-{}}}",
        le32(g, 0),
        le16(g, 4),
        le16(g, 6),
        hex(&g[8..10]),
        hex(&g[10..16])
    )
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A VHDX parent locator item with these keys and values (UTF-16LE).
fn locator(kvs: &[(&str, &str)]) -> Vec<u8> {
    let mut b = vec![0u8; 20 + 12 * kvs.len()];
    b[..16].copy_from_slice(&VHDX_LOCATOR);
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

/// What one payload block of the crafted child is.
#[derive(Clone, Copy)]
enum Kind {
    /// FULLY_PRESENT: random bytes.
    Full,
    /// PARTIALLY_PRESENT: random bytes, of which the sectors `bit(s)` says are the child's.
    Partial(fn(u64) -> bool),
    /// Only a state, no block: ZERO (2) and UNMAPPED (3) read zeroes, UNDEFINED (1) and
    /// NOT_PRESENT (0) the parent's bytes.
    State(u64),
}

/// What the child holds over its parent: guest ranges with its bytes (None: zeroes).
struct Overlay(Vec<(u64, Option<Vec<u8>>, u64)>);

impl Overlay {
    /// Puts the child's bytes over `window`, the parent's bytes at guest offset `at`.
    fn apply(&self, at: u64, window: &mut [u8]) {
        let end = at + window.len() as u64;
        for (off, data, len) in &self.0 {
            let (a, b) = ((*off).max(at), (off + len).min(end));
            if a >= b {
                continue;
            }
            let dst = &mut window[(a - at) as usize..(b - at) as usize];
            match data {
                Some(d) => dst.copy_from_slice(&d[(a - off) as usize..(b - off) as usize]),
                None => dst.fill(0),
            }
        }
    }
}

/// Makes `out` a differencing image from `base` (a dynamic VHDX `qemu-img create` made, of
/// the parent's virtual size): "has parent" set, a parent locator with `kvs`, and the blocks
/// of `plan`. Returns what the child holds over its parent.
fn craft(
    base: &Path,
    out: &Path,
    kvs: &[(&str, &str)],
    plan: &[(u64, Kind)],
    seed: u64,
) -> Overlay {
    let mut b = fs::read(base).unwrap();
    let l = layout(&b);
    let (bs, lss) = (l.block_size, l.logical_sector);
    let ratio = (1u64 << 23) * lss / bs;
    // Has parent.
    b[l.params + 4] |= 2;
    // The parent locator: a new metadata table entry, the item after every other one.
    let m = l.metadata;
    let count = le16(&b, m + 10) as usize;
    let item_end = (0..count)
        .map(|i| {
            let e = m + 32 + 32 * i;
            le32(&b, e + 16) + le32(&b, e + 20)
        })
        .max()
        .unwrap();
    let loc = locator(kvs);
    let at = item_end.next_multiple_of(8);
    assert!(at as usize + loc.len() <= 1 << 20, "setup: locator fits");
    let e = m + 32 + 32 * count;
    b[e..e + 32].fill(0);
    b[e..e + 16].copy_from_slice(&PARENT_LOCATOR);
    put32(&mut b, e + 16, at);
    put32(&mut b, e + 20, loc.len() as u32);
    put32(&mut b, e + 24, 4); // required
    b[m + 10..m + 12].copy_from_slice(&((count + 1) as u16).to_le_bytes());
    b[m + at as usize..][..loc.len()].copy_from_slice(&loc);
    // Blocks, appended at whole MiB past the end.
    let mut rng = Rng::new(seed);
    let mut end = (b.len() as u64).next_multiple_of(MIB);
    let mut bitmaps: Vec<(u64, u64)> = Vec::new(); // (chunk, file offset)
    let mut pieces = Vec::new();
    for &(block, kind) in plan {
        let entry_at = l.bat + 8 * (block + block / ratio) as usize;
        let guest = block * bs;
        let (state, bits) = match kind {
            Kind::State(s) => {
                put64(&mut b, entry_at, s);
                if s == 2 || s == 3 {
                    pieces.push((guest, None, bs));
                }
                continue;
            }
            Kind::Full => (6, None),
            Kind::Partial(f) => (7, Some(f)),
        };
        let host = end;
        end += bs;
        b.resize(end as usize, 0);
        let data = rng.bytes(bs as usize);
        b[host as usize..end as usize].copy_from_slice(&data);
        put64(&mut b, entry_at, host | state);
        let Some(bit) = bits else {
            pieces.push((guest, Some(data), bs));
            continue;
        };
        let chunk = block / ratio;
        let sb = match bitmaps.iter().find(|(c, _)| *c == chunk) {
            Some(&(_, h)) => h,
            None => {
                let h = end;
                end += MIB;
                b.resize(end as usize, 0);
                let sb_entry = l.bat + 8 * ((chunk + 1) * (ratio + 1) - 1) as usize;
                put64(&mut b, sb_entry, h | 6);
                bitmaps.push((chunk, h));
                h
            }
        };
        let per_block = bs / lss;
        let base_bit = (block % ratio) * per_block;
        let mut s = 0;
        while s < per_block {
            if !bit(s) {
                s += 1;
                continue;
            }
            let from = s;
            while s < per_block && bit(s) {
                let k = base_bit + s;
                b[(sb + k / 8) as usize] |= 1 << (k % 8);
                s += 1;
            }
            let (a, z) = ((from * lss) as usize, (s * lss) as usize);
            pieces.push((guest + a as u64, Some(data[a..z].to_vec()), (z - a) as u64));
        }
    }
    // Untouched: the headers and region tables still check.
    for at in [64 << 10, 128 << 10] {
        assert_eq!(
            le32(&b, at + 4),
            crc32c_sealed(&b[at..at + 4096]),
            "header at {at}"
        );
    }
    for at in [192 << 10, 256 << 10] {
        assert_eq!(
            le32(&b, at + 4),
            crc32c_sealed(&b[at..at + (64 << 10)]),
            "region table at {at}"
        );
    }
    fs::write(out, b).unwrap();
    Overlay(pieces)
}

/// An empty dynamic VHDX of `size` bytes in 1 MiB blocks, as `qemu-img create` makes it, its
/// blocks NOT_PRESENT (QEMU's default marks them ZERO, which a differencing image reads as
/// zeroes rather than its parent's bytes).
fn base_image(w: &WorkDir, name: &str, size: u64) -> std::path::PathBuf {
    let p = w.join(name);
    run_ok(
        Command::new("qemu-img")
            .args([
                "create",
                "-q",
                "-f",
                "vhdx",
                "-o",
                "block_size=1M,subformat=dynamic,block_state_zero=off",
            ])
            .arg(&p)
            .arg(size.to_string()),
    );
    p
}

fn every_third(s: u64) -> bool {
    s % 3 == 0
}
fn some_runs(s: u64) -> bool {
    (100..700).contains(&s) || (1500..1501).contains(&s) || s == 2047 || s % 64 == 0
}
fn none(_: u64) -> bool {
    false
}
fn all(_: u64) -> bool {
    true
}
fn first_half(s: u64) -> bool {
    s < 1024
}

const SIZE: u64 = 24 * MIB;

/// The plan of the 24 MiB child over the 24 MiB parent.
fn plan() -> Vec<(u64, Kind)> {
    vec![
        (0, Kind::Full),
        (1, Kind::Partial(every_third)),
        (3, Kind::Partial(none)),
        (4, Kind::Partial(all)),
        (5, Kind::State(2)),
        (6, Kind::State(3)),
        (7, Kind::State(1)),
        (9, Kind::Full),
        (10, Kind::Full),
        (11, Kind::Partial(some_runs)),
        (23, Kind::Partial(first_half)),
    ]
}

/// The parent (random data with zero runs, converted by qemu-img into 2 MiB blocks), its
/// bytes as qemu-img reads them, and the child `child.vhdx` over it with `kvs` (or the right
/// parent locator), with the model of the child's bytes.
struct Pair {
    parent: std::path::PathBuf,
    child: std::path::PathBuf,
    want: Vec<u8>,
}

fn pair(w: &WorkDir, kvs: Option<&[(&str, &str)]>) -> Pair {
    let raw = w.join("parent.raw");
    let mut data = random_image(&raw, SIZE, 0xd1ff);
    data[(12 * MIB) as usize..(14 * MIB) as usize].fill(0);
    fs::write(&raw, &data).unwrap();
    let parent = w.join("parent.vhdx");
    qemu_img(
        &["convert", "-f", "raw", "-O", "vhdx", "-o", "block_size=2M"],
        &[&raw, &parent],
    );
    let oracle = w.join("parent-oracle.raw");
    qemu_img(&["convert", "-f", "vhdx", "-O", "raw"], &[&parent, &oracle]);
    let mut want = fs::read(&oracle).unwrap();
    assert_eq!(want, data, "setup: qemu-img reads the parent back");
    let base = base_image(w, "base.vhdx", SIZE);
    let guid = data_write_guid(&parent);
    let default = [
        ("parent_linkage", guid.as_str()),
        ("relative_path", ".\\parent.vhdx"),
        ("absolute_win32_path", "\\\\?\\C:\\vms\\parent.vhdx"),
    ];
    let child = w.join("child.vhdx");
    let overlay = craft(&base, &child, kvs.unwrap_or(&default), &plan(), 0xc41d);
    overlay.apply(0, &mut want);
    Pair {
        parent,
        child,
        want,
    }
}

/// Reads the whole export and random pieces of it, each compared with `want`.
fn compare(m: &Mount, want: &[u8], seed: u64, what: &str) {
    let f = m.open_ro();
    assert_eq!(fstat(&f).0, want.len() as u64, "{what}: st_size");
    assert_bytes_eq(&read_all(m.path()), want, 0, &format!("{what}: whole"));
    let mut rng = Rng::new(seed);
    for i in 0..200 {
        let off = rng.below(want.len() as u64);
        let len = 1 + rng.below(if i % 4 == 0 { 3 * MIB } else { 9000 }) as usize;
        let got =
            pread_full(&f, off, len).unwrap_or_else(|e| panic!("{what}: pread {off}+{len}: {e}"));
        let hi = (off as usize + len).min(want.len());
        assert_bytes_eq(
            &got,
            &want[off as usize..hi],
            off,
            &format!("{what}: read #{i}"),
        );
    }
}

/// A refused mount: exit 1, one error line naming `problem`, nothing mounted.
fn refused(w: &WorkDir, img: &Path, args: &[&str], problem: &str, what: &str) {
    let mp = w.join(format!("refused-{}", what.replace(' ', "-")));
    match Mount::try_start(w, img, &mp, args) {
        Ok(_) => panic!("{what}: mounted"),
        Err(f) => {
            assert!(!f.stderr.contains("panicked"), "{what}: {}", f.stderr);
            assert_eq!(f.code, Some(1), "{what}: {}", f.stderr);
            let errors: Vec<&str> = f
                .stderr
                .lines()
                .filter(|l| l.starts_with("fusex: error: "))
                .collect();
            assert_eq!(errors.len(), 1, "{what}: one error line:\n{}", f.stderr);
            eprintln!("{what}: refused: {}", errors[0]);
            assert!(
                !errors[0].contains("  "),
                "{what}: a run of spaces: {}",
                errors[0]
            );
            assert!(
                errors[0].contains(problem),
                "{what}: want {problem:?}: {}",
                errors[0]
            );
            assert!(!is_fuse_mounted(&mp), "{what}: left mounted");
        }
    }
}

#[test]
fn differencing_image_reads_parent_overlaid_with_child() {
    if !require_fuse_and_tools(TOOLS) {
        return;
    }
    let w = WorkDir::new("vhdx-diff-read");
    let p = pair(&w, None);
    let before = (fs::read(&p.child).unwrap(), fs::read(&p.parent).unwrap());
    let m = Mount::start(&w, &p.child, &w.join("export"), &[]);
    assert!(m.stderr().contains("format vhdx (auto"), "{}", m.stderr());
    compare(&m, &p.want, 1, "child");
    // Block status: ZERO and UNMAPPED blocks are holes; blocks read from the parent are not.
    let f = m.open_ro();
    assert_eq!(lseek(&f, 0, libc::SEEK_HOLE), Ok(5 * MIB));
    assert_eq!(lseek(&f, 5 * MIB, libc::SEEK_DATA), Ok(7 * MIB));
    drop(f);
    m.stop().assert_clean("child");
    assert!(
        before == (fs::read(&p.child).unwrap(), fs::read(&p.parent).unwrap()),
        "a read-only export changed the child or its parent"
    );
}

#[test]
fn chain_of_two_differencing_images() {
    if !require_fuse_and_tools(TOOLS) {
        return;
    }
    let w = WorkDir::new("vhdx-diff-chain");
    let p = pair(&w, None);
    let sub = w.join("top");
    fs::create_dir(&sub).unwrap();
    let base = base_image(&w, "base2.vhdx", SIZE);
    let guid = data_write_guid(&p.child);
    let top = sub.join("top.vhdx");
    let overlay = craft(
        &base,
        &top,
        &[
            ("parent_linkage", &guid),
            ("relative_path", "..\\child.vhdx"),
        ],
        &[
            (1, Kind::Full),
            (2, Kind::Partial(first_half)),
            (4, Kind::State(2)),
            (11, Kind::Partial(every_third)),
            (20, Kind::State(0)),
        ],
        0x70b,
    );
    let mut want = p.want.clone();
    overlay.apply(0, &mut want);
    let m = Mount::start(&w, &top, &w.join("export"), &["--format", "vhdx"]);
    compare(&m, &want, 2, "grandchild");
    m.stop().assert_clean("grandchild");
}

/// A disk of 4 GiB + 8 MiB in 1 MiB blocks spans two chunks: blocks from 4096 on are in the
/// second, whose BAT entries come after the first chunk's sector bitmap entry, and whose own
/// sector bitmap block is a second one.
#[test]
fn differencing_image_past_one_chunk() {
    if !require_fuse_and_tools(TOOLS) {
        return;
    }
    let w = WorkDir::new("vhdx-diff-chunks");
    let size = 4096 * MIB + 8 * MIB;
    let parent = base_image(&w, "parent.vhdx", size);
    for (pattern, at, len) in [
        (0x11, 0, 2 * MIB),
        (0x22, 4095 * MIB, 3 * MIB),
        (0x33, 4100 * MIB, 4 * MIB),
    ] {
        run_ok(
            Command::new("qemu-io")
                .args([
                    "-f",
                    "vhdx",
                    "-c",
                    &format!("write -P {pattern} {at} {len}"),
                ])
                .arg(&parent),
        );
    }
    let oracle = w.join("parent.raw");
    qemu_img(&["convert", "-f", "vhdx", "-O", "raw"], &[&parent, &oracle]);
    let base = base_image(&w, "base.vhdx", size);
    let guid = data_write_guid(&parent);
    let child = w.join("child.vhdx");
    let overlay = craft(
        &base,
        &child,
        &[("parent_linkage", &guid), ("relative_path", "parent.vhdx")],
        &[
            (0, Kind::Partial(every_third)),
            (4095, Kind::Partial(some_runs)),
            (4096, Kind::Partial(first_half)),
            (4097, Kind::Full),
            (4101, Kind::Partial(every_third)),
            (4103, Kind::State(2)),
        ],
        0xc4c4,
    );
    let m = Mount::start(&w, &child, &w.join("export"), &[]);
    let f = m.open_ro();
    let o = fs::File::open(&oracle).unwrap();
    for (at, len) in [
        (0, 4 * MIB),
        (4090 * MIB, size - 4090 * MIB),
        (2048 * MIB, MIB),
    ] {
        let mut want = vec![0u8; len as usize];
        o.read_exact_at(&mut want, at).unwrap();
        overlay.apply(at, &mut want);
        let got = pread_full(&f, at, len as usize).unwrap();
        assert_bytes_eq(&got, &want, at, &format!("{at}+{len}"));
    }
    drop(f);
    m.stop().assert_clean("two chunks");
}

#[test]
fn differencing_refusals_and_bad_bitmaps() {
    if !require_fuse_and_tools(TOOLS) {
        return;
    }
    let w = WorkDir::new("vhdx-diff-hostile");
    let p = pair(&w, None);
    refused(
        &w,
        &p.child,
        &["--writable"],
        "read-only: drop --writable",
        "writable",
    );
    refused(
        &w,
        &p.child,
        &["--no-backing"],
        "--no-backing",
        "no backing",
    );

    let guid = data_write_guid(&p.parent);
    let base = base_image(&w, "base-h.vhdx", SIZE);
    let bad = w.join("bad.vhdx");
    type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (
            "linkage mismatch",
            vec![
                ("parent_linkage", "{0b0e0f00-1111-2222-3333-444455556666}"),
                ("relative_path", "parent.vhdx"),
            ],
            "data write GUID",
        ),
        (
            "loop",
            vec![("parent_linkage", &guid), ("relative_path", "bad.vhdx")],
            "loop",
        ),
        (
            "no linkage",
            vec![("relative_path", "parent.vhdx")],
            "no parent_linkage",
        ),
        ("no path", vec![("parent_linkage", &guid)], "names no path"),
        (
            "missing parent",
            vec![
                ("parent_linkage", &guid),
                ("relative_path", "..\\nowhere\\parent.vhdx"),
                (
                    "volume_path",
                    "\\\\?\\Volume{26a21bda-a627-11d7-9931-806e6f6e6963}\\p.vhdx",
                ),
            ],
            "not where its parent locator says",
        ),
        (
            "parent not a vhdx",
            vec![("parent_linkage", &guid), ("relative_path", "parent.raw")],
            "not a VHDX image",
        ),
    ];
    for (what, kvs, problem) in &cases {
        craft(&base, &bad, kvs, &plan(), 5);
        refused(&w, &bad, &[], problem, what);
    }
    // Locator bytes no key/value table can hold, and a key that is not UTF-16.
    let kvs = [
        ("parent_linkage", guid.as_str()),
        ("relative_path", "parent.vhdx"),
    ];
    let loc_at = |b: &[u8]| {
        let l = layout(b);
        let m = l.metadata;
        let n = le16(b, m + 10) as usize;
        m + le32(b, m + 32 + 32 * (n - 1) + 16) as usize
    };
    craft(&base, &bad, &kvs, &plan(), 5);
    let mut b = fs::read(&bad).unwrap();
    let at = loc_at(&b);
    b[at + 18..at + 20].copy_from_slice(&[0xff, 0xff]);
    fs::write(&bad, &b).unwrap();
    refused(
        &w,
        &bad,
        &[],
        "parent locator claims 65535 entries",
        "absurd count",
    );
    let mut b = fs::read(&bad).unwrap();
    b[at + 18..at + 20].copy_from_slice(&2u16.to_le_bytes());
    let key = at + le32(&b, at + 20) as usize;
    b[key..key + 2].copy_from_slice(&0xdc00u16.to_le_bytes());
    fs::write(&bad, &b).unwrap();
    refused(&w, &bad, &[], "UTF-16", "bad utf-16");

    // The parent written since (QEMU gives it a new data write GUID): refused.
    let moved = w.join("written");
    fs::create_dir(&moved).unwrap();
    fs::copy(&p.parent, moved.join("parent.vhdx")).unwrap();
    fs::copy(&p.child, moved.join("child.vhdx")).unwrap();
    run_ok(
        Command::new("qemu-io")
            .args(["-f", "vhdx", "-c", "write -P 0x99 0 64k"])
            .arg(moved.join("parent.vhdx")),
    );
    refused(
        &w,
        &moved.join("child.vhdx"),
        &[],
        "data write GUID",
        "parent written since",
    );

    // Sector bitmap entries past the end or into the metadata: the partially present blocks
    // (1, 3, 4, 11, 23: all in chunk 0) fail with EIO, everything else serves.
    let l = layout(&fs::read(&p.child).unwrap());
    let sb_entry = l.bat + 8 * 4096;
    for (what, v) in [
        ("past the end", (1u64 << 40) | 6),
        ("into the metadata", l.metadata as u64 | 6),
    ] {
        let mut b = fs::read(&p.child).unwrap();
        put64(&mut b, sb_entry, v);
        let img = w.join("bad-sb.vhdx");
        fs::write(&img, &b).unwrap();
        let m = Mount::start(&w, &img, &w.join("export-sb"), &[]);
        let f = m.open_ro();
        for block in 0..SIZE / MIB {
            let r = pread_full(&f, block * MIB, MIB as usize);
            if [1, 3, 4, 11, 23].contains(&block) {
                let e = r.expect_err(what);
                assert_eq!(errno(&e), libc::EIO, "{what}: block {block}: {e}");
            } else {
                let got = r.unwrap_or_else(|e| panic!("{what}: block {block}: {e}"));
                let at = (block * MIB) as usize;
                assert_bytes_eq(&got, &p.want[at..at + MIB as usize], block * MIB, what);
            }
        }
        drop(f);
        let st = m.stop();
        assert!(
            st.exited && st.code == Some(0) && !st.left_mounted,
            "{what}: {}",
            st.stderr
        );
        assert!(!st.stderr.contains("panicked"), "{what}: {}", st.stderr);
    }
}

/// Root serving another user's differencing image opens its parent with that user's
/// credentials: a parent only root may read is refused (naming --trust-backing), and served
/// with --trust-backing.
#[test]
fn parent_opened_with_the_image_owner_s_credentials() {
    if !require_fuse_and_tools(TOOLS) {
        return;
    }
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root");
        return;
    }
    let w = WorkDir::new("vhdx-diff-owner");
    let p = pair(&w, None);
    fs::set_permissions(&p.parent, fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(&p.child, Some(65534), Some(65534)).unwrap();
    refused(
        &w,
        &p.child,
        &[],
        "--trust-backing",
        "owner may not read the parent",
    );
    let m = Mount::start(&w, &p.child, &w.join("export"), &["--trust-backing"]);
    compare(&m, &p.want, 3, "trusted");
    m.stop().assert_clean("trusted");
}
