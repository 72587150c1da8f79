//! VHD (QEMU's `vpc`), VDI, VHDX and VMDK images: fusex serves their guest-visible bytes, and
//! `qemu-img` is the oracle (VMDK here only through the read and write cases; tests/vmdk.rs
//! has the rest).
//!
//! - Images `qemu-img convert` builds in every subformat (VHD dynamic with CHS or footer size,
//!   VHD fixed, VDI dynamic and static) read back byte for byte as `qemu-img convert -O raw`
//!   gives them, and a read-only export leaves the image file untouched.
//! - A random workload of writes, reads, punched holes and zeroed ranges through a writable
//!   export of an empty image matches an in-memory model; afterwards `qemu-img check` (VDI)
//!   is clean and `qemu-img compare` finds the image equal to a raw file written the same way.
//! - Writers on two queues racing into the same unallocated blocks allocate each block once.
//! - Hostile images (bad checksums, table entries past the end, into the metadata or shared,
//!   absurd sizes, bad block sizes) are refused in one line, or served with EIO for the bad
//!   blocks only; never a panic.
//! - QEMU's image locks, `--format auto`/`vhd`/`vpc`/`vdi`, and `fusex serve`'s `vpc` and
//!   `vdi` block nodes.
//!
//! Every test runs on the transport `FUSEX_E2E_TRANSPORT` names (legacy or uring).

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use fusex_e2e::*;
use serde_json::json;

const QEMU: &[&str] = &["qemu-img"];

/// One subformat: how `qemu-img` makes it and how fusex is told to serve it.
#[derive(Clone, Copy, Debug)]
struct Sub {
    tag: &'static str,
    /// qemu-img's format name.
    fmt: &'static str,
    /// qemu-img's `-o` options.
    opts: &'static str,
    /// fusex's `--format` (None: `--format auto` must find it).
    format: Option<&'static str>,
    /// What fusex's "mounted" line names as the format.
    shown: &'static str,
    /// `qemu-img check` supports the format.
    check: bool,
    /// Allocation is per block in the image (`qemu-img map` reports its blocks); a fixed or
    /// static image is data throughout to fusex, while `qemu-img map` passes the question on
    /// to the image file.
    sparse: bool,
}

const SUBS: &[Sub] = &[
    Sub {
        tag: "vhd-dynamic",
        fmt: "vpc",
        opts: "subformat=dynamic",
        format: None,
        shown: "format vhd (auto",
        check: false,
        sparse: true,
    },
    Sub {
        tag: "vhd-dynamic-footer-size",
        fmt: "vpc",
        opts: "subformat=dynamic,force_size=on",
        format: Some("vpc"),
        shown: "format vhd",
        check: false,
        sparse: true,
    },
    Sub {
        tag: "vhd-fixed",
        fmt: "vpc",
        opts: "subformat=fixed",
        format: Some("vhd"),
        shown: "format vhd",
        check: false,
        sparse: false,
    },
    Sub {
        tag: "vdi-dynamic",
        fmt: "vdi",
        opts: "static=off",
        format: None,
        shown: "format vdi (auto",
        check: true,
        sparse: true,
    },
    Sub {
        tag: "vdi-static",
        fmt: "vdi",
        opts: "static=on",
        format: Some("vdi"),
        shown: "format vdi",
        check: true,
        sparse: false,
    },
    Sub {
        tag: "vmdk-monolithic-sparse",
        fmt: "vmdk",
        opts: "subformat=monolithicSparse",
        format: None,
        shown: "format vmdk (auto",
        check: true,
        sparse: true,
    },
    Sub {
        tag: "vmdk-two-gb-sparse",
        fmt: "vmdk",
        opts: "subformat=twoGbMaxExtentSparse",
        format: Some("vmdk"),
        shown: "format vmdk",
        check: true,
        sparse: true,
    },
    Sub {
        tag: "vmdk-monolithic-flat",
        fmt: "vmdk",
        opts: "subformat=monolithicFlat",
        format: None,
        shown: "format vmdk (auto",
        check: true,
        sparse: false,
    },
    // Read-only: no write case.
    Sub {
        tag: "vmdk-stream-optimized",
        fmt: "vmdk",
        opts: "subformat=streamOptimized",
        format: Some("vmdk"),
        shown: "format vmdk",
        check: true,
        sparse: true,
    },
];

impl Sub {
    fn args(&self, writable: bool) -> Vec<&'static str> {
        let mut a = Vec::new();
        if let Some(f) = self.format {
            a.extend(["--format", f]);
        }
        if writable {
            a.push("--writable");
        }
        a
    }
}

fn qemu_img(args: &[&str], paths: &[&Path]) {
    let mut c = Command::new("qemu-img");
    c.args(args);
    for p in paths {
        c.arg(p);
    }
    run_ok(&mut c);
}

/// The image's bytes as `qemu-img convert -O raw` gives them.
fn oracle(img: &Path, fmt: &str, out: &Path) -> Vec<u8> {
    qemu_img(&["convert", "-f", fmt, "-O", "raw"], &[img, out]);
    fs::read(out).unwrap()
}

/// Random data with runs of zeroes, among them 4..8 MiB whole (so dynamic images get
/// unallocated blocks of any size up to 4 MiB too).
fn mixed(size: u64, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let mut data = rng.bytes(size as usize);
    data[(4 * MIB) as usize..(8 * MIB) as usize].fill(0);
    let mut off = 0u64;
    while off < size {
        let len = (256 * KIB + rng.below(3 * MIB)).min(size - off);
        if rng.below(3) == 0 {
            data[off as usize..(off + len) as usize].fill(0);
        }
        off += len;
    }
    data
}

/// Merges touching or overlapping ranges.
fn merged(mut v: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (a, b) in v {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// The ranges `qemu-img map` reports as data.
fn qemu_map(img: &Path, fmt: &str) -> Vec<(u64, u64)> {
    let out = run_ok(
        Command::new("qemu-img")
            .args(["map", "-U", "--output=json", "-f", fmt])
            .arg(img),
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("qemu-img map prints JSON");
    let ranges = v
        .as_array()
        .expect("an array")
        .iter()
        .filter(|e| e["data"].as_bool() == Some(true))
        .map(|e| {
            let start = e["start"].as_u64().unwrap();
            (start, start + e["length"].as_u64().unwrap())
        })
        .collect();
    merged(ranges)
}

/// The data ranges of the export, walked with SEEK_DATA and SEEK_HOLE.
fn seek_map(f: &fs::File, size: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut off = 0;
    while off < size {
        let data = match lseek(f, off, libc::SEEK_DATA) {
            Ok(d) => d,
            Err(e) if e == libc::ENXIO => break,
            Err(e) => panic!("lseek({off}, SEEK_DATA): {}", errno_str(e)),
        };
        let hole = lseek(f, data, libc::SEEK_HOLE)
            .unwrap_or_else(|e| panic!("lseek({data}, SEEK_HOLE): {}", errno_str(e)));
        assert!(
            data >= off && hole > data && hole <= size,
            "{off}: {data}..{hole}"
        );
        out.push((data, hole));
        off = hole;
    }
    merged(out)
}

fn file_hash(p: &Path) -> u64 {
    hash_bytes(0, &fs::read(p).unwrap())
}

/// The refusal contract: exit 1, nothing on stdout, no panic, one "fusex: error: " line, the
/// last, naming `problem`.
#[track_caller]
fn assert_refused(f: &MountFailed, what: &str, problem: &str) {
    assert!(
        !f.stderr.contains("panicked"),
        "{what}: panicked:\n{}",
        f.stderr
    );
    assert_eq!(f.code, Some(1), "{what}: exit code; stderr:\n{}", f.stderr);
    assert!(f.stdout.is_empty(), "{what}: stdout {:?}", f.stdout);
    let lines: Vec<&str> = f.stderr.lines().collect();
    let errors: Vec<&&str> = lines
        .iter()
        .filter(|l| l.starts_with("fusex: error: "))
        .collect();
    assert!(
        errors.len() == 1 && lines.last() == errors.first().copied(),
        "{what}: exactly one error line, the last; stderr:\n{}",
        f.stderr
    );
    assert!(
        errors[0].contains(problem),
        "{what}: the error should name {problem:?}: {}",
        errors[0]
    );
}

// ---------------------------------------------------------------------------------------
// Reading what qemu-img wrote
// ---------------------------------------------------------------------------------------

fn read_case(sub: Sub, seed: u64) {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new(&format!("fmt-ro-{}", sub.tag));
    let src = w.join("src.raw");
    // Not a multiple of any block size: the last block is partial.
    let size = 21 * MIB + 3 * 512;
    fs::write(&src, mixed(size, seed)).unwrap();
    let img = w.join("disk.img");
    qemu_img(
        &["convert", "-f", "raw", "-O", sub.fmt, "-o", sub.opts],
        &[&src, &img],
    );
    let want = oracle(&img, sub.fmt, &w.join("oracle.raw"));
    assert!(want.len() as u64 >= size, "{}: qemu-img's size", sub.tag);
    let before = file_hash(&img);
    let m = Mount::start(&w, &img, &w.join("export"), &sub.args(false));
    assert!(
        m.stderr().contains(sub.shown),
        "{}: the mounted line names {:?}:\n{}",
        sub.tag,
        sub.shown,
        m.stderr()
    );
    let f = m.open_ro();
    assert_eq!(fstat(&f).0, want.len() as u64, "{}: st_size", sub.tag);
    assert_bytes_eq(
        &read_all(m.path()),
        &want,
        0,
        &format!("{}: whole", sub.tag),
    );
    let mut rng = Rng::new(seed ^ 0x77);
    for i in 0..150 {
        let off = rng.below(want.len() as u64 + 4096);
        let len = 1 + rng.below(if i % 5 == 0 { 3 * MIB } else { 70 * KIB }) as usize;
        let got = pread_full(&f, off, len).unwrap_or_else(|e| panic!("pread {off}+{len}: {e}"));
        let lo = off.min(want.len() as u64) as usize;
        let hi = (off + len as u64).min(want.len() as u64) as usize;
        assert_bytes_eq(&got, &want[lo..hi], off, &format!("{}: read #{i}", sub.tag));
    }
    let seek = seek_map(&f, want.len() as u64);
    if sub.sparse {
        let map = qemu_map(&img, sub.fmt);
        assert!(
            seek.len() > 1,
            "{}: the image has no hole: {map:?}",
            sub.tag
        );
        assert_eq!(
            seek, map,
            "{}: SEEK_DATA/SEEK_HOLE against qemu-img map",
            sub.tag
        );
    } else {
        assert_eq!(
            seek,
            vec![(0, want.len() as u64)],
            "{}: data throughout",
            sub.tag
        );
    }
    drop(f);
    m.stop().assert_clean(sub.tag);
    assert_eq!(
        file_hash(&img),
        before,
        "{}: read-only export changed the image",
        sub.tag
    );
}

#[test]
fn reads_vhd_dynamic() {
    read_case(SUBS[0], 11);
}

#[test]
fn reads_vhd_dynamic_with_footer_size() {
    read_case(SUBS[1], 12);
}

#[test]
fn reads_vhd_fixed() {
    read_case(SUBS[2], 13);
}

#[test]
fn reads_vdi_dynamic() {
    read_case(SUBS[3], 14);
}

#[test]
fn reads_vdi_static() {
    read_case(SUBS[4], 15);
}

// ---------------------------------------------------------------------------------------
// Writing, against a model and qemu-img
// ---------------------------------------------------------------------------------------

fn write_case(sub: Sub, seed: u64) {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new(&format!("fmt-rw-{}", sub.tag));
    let img = w.join("disk.img");
    qemu_img(
        &["create", "-q", "-f", sub.fmt, "-o", sub.opts],
        &[&img, Path::new(&(40 * MIB).to_string())],
    );
    let raw = w.join("model.raw");
    let mut model = oracle(&img, sub.fmt, &raw);
    let size = model.len() as u64;
    let m = Mount::start(&w, &img, &w.join("export"), &sub.args(true));
    let f = m.open_rw();
    let mut rng = Rng::new(seed);
    for i in 0..250 {
        let off = match i % 4 {
            // Across a 1 MiB or 2 MiB block boundary.
            0 => (1 + rng.below(size / MIB - 1)) * MIB - rng.below(8 * KIB),
            _ => rng.below(size),
        };
        let len = (1 + rng.below(if i % 7 == 0 { 1200 * KIB } else { 64 * KIB })).min(size - off);
        match rng.below(10) {
            0 => {
                // A punched hole reads back as zeroes.
                let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
                fallocate(&f, mode, off, len).unwrap_or_else(|e| panic!("punch {off}+{len}: {e}"));
                model[off as usize..(off + len) as usize].fill(0);
            }
            1 => {
                let mode = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;
                fallocate(&f, mode, off, len).unwrap_or_else(|e| panic!("zero {off}+{len}: {e}"));
                model[off as usize..(off + len) as usize].fill(0);
            }
            2 | 3 => {
                let got = pread_full(&f, off, len as usize).unwrap();
                assert_bytes_eq(
                    &got,
                    &model[off as usize..(off + len) as usize],
                    off,
                    &format!("{}: read #{i}", sub.tag),
                );
            }
            _ => {
                let data = rng.bytes(len as usize);
                f.write_all_at(&data, off)
                    .unwrap_or_else(|e| panic!("write {off}+{len}: {e}"));
                model[off as usize..(off + len) as usize].copy_from_slice(&data);
            }
        }
    }
    f.sync_all().unwrap();
    assert_bytes_eq(
        &read_all(m.path()),
        &model,
        0,
        &format!("{}: whole", sub.tag),
    );
    drop(f);
    m.stop().assert_clean(sub.tag);
    fs::write(&raw, &model).unwrap();
    if sub.check {
        qemu_img(&["check", "-q", "-f", sub.fmt], &[&img]);
    }
    qemu_img(
        &["compare", "-q", "-f", sub.fmt, "-F", "raw"],
        &[&img, &raw],
    );
}

#[test]
fn writes_vhd_dynamic() {
    write_case(SUBS[0], 21);
}

#[test]
fn writes_vhd_dynamic_with_footer_size() {
    write_case(SUBS[1], 22);
}

#[test]
fn writes_vhd_fixed() {
    write_case(SUBS[2], 23);
}

#[test]
fn writes_vdi_dynamic() {
    write_case(SUBS[3], 24);
}

#[test]
fn writes_vdi_static() {
    write_case(SUBS[4], 25);
}

/// 8 writers on two queues write interleaved 4 KiB pieces of every block of an empty image at
/// once: each block is allocated exactly once (the file grows by one footprint per block) and
/// nothing written is lost.
fn racing_case(sub: Sub, footprint: u64, block: u64) {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new(&format!("fmt-race-{}", sub.tag));
    let img = w.join("disk.img");
    let size = 16 * MIB;
    qemu_img(
        &["create", "-q", "-f", sub.fmt, "-o", sub.opts],
        &[&img, Path::new(&size.to_string())],
    );
    let len0 = fs::metadata(&img).unwrap().len();
    let mut args = sub.args(true);
    args.extend(["--queues", "2"]);
    let m = Mount::start(&w, &img, &w.join("export"), &args);
    let size = fstat(&m.open_ro()).0;
    let path = Arc::new(m.path().to_path_buf());
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let path = path.clone();
            std::thread::spawn(move || {
                let f = open_rw(&path);
                let mut off = t * 4096;
                while off + 4096 <= size {
                    f.write_all_at(&[(t + 1) as u8; 4096], off).unwrap();
                    off += 8 * 4096;
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let got = read_all(m.path());
    for (i, c) in got.chunks(4096).enumerate() {
        let want = if c.len() == 4096 {
            (i % 8 + 1) as u8
        } else {
            0
        };
        assert!(c.iter().all(|&b| b == want), "{}: chunk {i}", sub.tag);
    }
    m.stop().assert_clean(sub.tag);
    let blocks = size.div_ceil(block);
    assert_eq!(
        fs::metadata(&img).unwrap().len(),
        len0 + blocks * footprint,
        "{}: {blocks} blocks allocated once each",
        sub.tag
    );
    let raw = w.join("model.raw");
    fs::write(&raw, &got).unwrap();
    if sub.check {
        qemu_img(&["check", "-q", "-f", sub.fmt], &[&img]);
    }
    qemu_img(
        &["compare", "-q", "-f", sub.fmt, "-F", "raw"],
        &[&img, &raw],
    );
}

#[test]
fn racing_writers_allocate_vhd_blocks_once() {
    // 2 MiB blocks, each with a 512-byte sector bitmap.
    racing_case(SUBS[0], 2 * MIB + 512, 2 * MIB);
}

#[test]
fn racing_writers_allocate_vdi_blocks_once() {
    racing_case(SUBS[3], MIB, MIB);
}

// ---------------------------------------------------------------------------------------
// Hostile images
// ---------------------------------------------------------------------------------------

/// The one's complement of the byte sum of `b` without its checksum at `at`, stored there.
fn fix_checksum(b: &mut [u8], at: usize) {
    b[at..at + 4].fill(0);
    let sum = b.iter().fold(0u32, |s, &x| s.wrapping_add(u32::from(x)));
    b[at..at + 4].copy_from_slice(&(!sum).to_be_bytes());
}

/// A copy of `good` with `damage` applied to its bytes.
fn damaged(good: &Path, dst: &Path, damage: &dyn Fn(&mut Vec<u8>)) {
    let mut b = fs::read(good).unwrap();
    damage(&mut b);
    fs::write(dst, b).unwrap();
}

/// What a hostile image must do: be refused (naming `problem`) or, for `eio`, be served with
/// EIO for exactly the guest ranges in `eio` and the oracle's bytes everywhere else.
enum Expect {
    Refused(&'static str),
    Eio(Vec<(u64, u64)>),
}

fn hostile_case(w: &WorkDir, what: &str, img: &Path, args: &[&str], want: &[u8], expect: &Expect) {
    let mp = w.join(format!("export-{}", what.replace(' ', "-")));
    match (Mount::try_start(w, img, &mp, args), expect) {
        (Err(f), Expect::Refused(problem)) => {
            eprintln!("{what}: refused: {}", f.stderr.trim_end());
            assert_refused(&f, what, problem);
            assert!(!is_fuse_mounted(&mp), "{what}: left mounted");
        }
        (Ok(m), Expect::Eio(bad)) => {
            let f = m.open_ro();
            let mut off = 0u64;
            while off < want.len() as u64 {
                let len = (256 * KIB).min(want.len() as u64 - off);
                let inside = bad.iter().any(|&(a, l)| off < a + l && a < off + len);
                match pread_full(&f, off, len as usize) {
                    Ok(got) => {
                        assert!(!inside, "{what}: read at {off} over a bad block succeeded");
                        assert_bytes_eq(&got, &want[off as usize..(off + len) as usize], off, what);
                    }
                    Err(e) => {
                        assert!(inside, "{what}: read at {off} failed: {e}");
                        assert_eq!(errno(&e), libc::EIO, "{what}: at {off}: {e}");
                    }
                }
                off += len;
            }
            drop(f);
            let st = m.stop();
            assert!(!st.stderr.contains("panicked"), "{what}:\n{}", st.stderr);
            assert!(
                st.exited && st.code == Some(0) && !st.left_mounted,
                "{what}: did not stop cleanly: {st:?}"
            );
        }
        (Err(f), Expect::Eio(_)) => panic!("{what}: refused, expected to be served:\n{}", f.stderr),
        (Ok(_), Expect::Refused(p)) => panic!("{what}: served, expected a refusal naming {p:?}"),
    }
}

type Damage = Box<dyn Fn(&mut Vec<u8>)>;

/// Runs each case read-only (as `expect` says) and writable (refused whenever the image has a
/// fault), every case to its end.
fn hostile_cases(
    w: &WorkDir,
    good: &Path,
    format: &str,
    want: &[u8],
    cases: Vec<(&str, Damage, Expect)>,
) {
    let mut failed = Vec::new();
    for (i, (what, damage, expect)) in cases.into_iter().enumerate() {
        let img = w.join(format!("bad{i}.img"));
        damaged(good, &img, &*damage);
        for writable in [false, true] {
            let what = format!("{what}{}", if writable { " rw" } else { "" });
            let mut args = vec!["--format", format];
            let expect = match (&expect, writable) {
                (Expect::Eio(_), true) => {
                    args.push("--writable");
                    &Expect::Refused("damaged")
                }
                (e, true) => {
                    args.push("--writable");
                    e
                }
                (e, false) => e,
            };
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                hostile_case(w, &what, &img, &args, want, expect)
            }));
            if let Err(e) = r {
                let msg = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                failed.push(format!(
                    "- {what}: {}",
                    msg.chars().take(1200).collect::<String>()
                ));
            }
        }
    }
    assert!(
        failed.is_empty(),
        "{} cases failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

fn be32_at(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
}

fn set_be32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

fn set_le32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

#[test]
fn hostile_vhd_images() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("fmt-hostile-vhd");
    let src = w.join("src.raw");
    let size = 8 * MIB;
    random_image(&src, size, 31);
    let good = w.join("good.vhd");
    qemu_img(
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "vpc",
            "-o",
            "subformat=dynamic,force_size=on",
        ],
        &[&src, &good],
    );
    let want = oracle(&good, "vpc", &w.join("oracle.raw"));
    let bytes = fs::read(&good).unwrap();
    // qemu-img's layout: footer copy, dynamic header at 512, BAT at 1536, 2 MiB blocks.
    assert_eq!(
        &bytes[512..520],
        b"cxsparse",
        "setup: dynamic header at 512"
    );
    assert_eq!(
        u64::from_be_bytes(bytes[528..536].try_into().unwrap()),
        1536
    );
    let bat = 1536usize;
    let b0 = be32_at(&bytes, bat);
    let block = 2 * MIB;
    let header = |f: fn(&mut [u8])| -> Damage {
        Box::new(move |b: &mut Vec<u8>| {
            f(&mut b[512..1536]);
            fix_checksum(&mut b[512..1536], 36);
        })
    };
    let footer = |f: fn(&mut [u8])| -> Damage {
        Box::new(move |b: &mut Vec<u8>| {
            f(&mut b[..512]);
            fix_checksum(&mut b[..512], 64);
        })
    };
    let cases: Vec<(&str, Damage, Expect)> = vec![
        (
            "footer checksum",
            Box::new(|b| b[100] ^= 1),
            Expect::Refused("checksum"),
        ),
        (
            "header checksum",
            Box::new(|b| b[700] ^= 1),
            Expect::Refused("checksum"),
        ),
        (
            "absurd disk size",
            footer(|f| f[48..56].copy_from_slice(&(1u64 << 62).to_be_bytes())),
            Expect::Refused("2040 GiB"),
        ),
        (
            "header past the end",
            footer(|f| f[16..24].copy_from_slice(&(1u64 << 40).to_be_bytes())),
            Expect::Refused("outside the file"),
        ),
        (
            "block size 0",
            header(|h| set_be32(h, 32, 0)),
            Expect::Refused("power of two"),
        ),
        (
            "block size 3 MiB",
            header(|h| set_be32(h, 32, 3 << 20)),
            Expect::Refused("power of two"),
        ),
        (
            "table too small",
            header(|h| set_be32(h, 28, 1)),
            Expect::Refused("less than"),
        ),
        (
            "table past the end",
            header(|h| h[16..24].copy_from_slice(&(1u64 << 40).to_be_bytes())),
            Expect::Refused("block table"),
        ),
        (
            "differencing",
            footer(|f| set_be32(f, 60, 4)),
            Expect::Refused("differencing"),
        ),
        (
            "BAT entry past the end",
            Box::new(move |b| set_be32(b, bat + 4, 0x7fff_0000)),
            Expect::Eio(vec![(block, block)]),
        ),
        (
            "BAT entry into the header",
            Box::new(move |b| set_be32(b, bat + 4, 1)),
            Expect::Eio(vec![(block, block)]),
        ),
        (
            "BAT entry into the BAT",
            Box::new(move |b| set_be32(b, bat + 4, (bat / 512) as u32)),
            Expect::Eio(vec![(block, block)]),
        ),
        (
            "BAT entries sharing a block",
            Box::new(move |b| set_be32(b, bat + 8, b0)),
            Expect::Eio(vec![(0, block), (2 * block, block)]),
        ),
    ];
    hostile_cases(&w, &good, "vhd", &want, cases);

    // A fixed image whose footer promises more than the file holds.
    let fixed = w.join("fixed.vhd");
    qemu_img(
        &["convert", "-f", "raw", "-O", "vpc", "-o", "subformat=fixed"],
        &[&src, &fixed],
    );
    let mut b = fs::read(&fixed).unwrap();
    b.drain(..MIB as usize);
    assert_eq!(
        &b[b.len() - 512..][..8],
        b"conectix",
        "setup: the footer stays"
    );
    let short = w.join("short.vhd");
    fs::write(&short, b).unwrap();
    hostile_case(
        &w,
        "truncated fixed",
        &short,
        &["--format", "vhd"],
        &want,
        &Expect::Refused("truncated"),
    );
}

#[test]
fn hostile_vdi_images() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("fmt-hostile-vdi");
    let src = w.join("src.raw");
    let size = 8 * MIB;
    random_image(&src, size, 41);
    let good = w.join("good.vdi");
    qemu_img(&["convert", "-f", "raw", "-O", "vdi"], &[&src, &good]);
    let want = oracle(&good, "vdi", &w.join("oracle.raw"));
    let bytes = fs::read(&good).unwrap();
    let map = u32::from_le_bytes(bytes[340..344].try_into().unwrap()) as usize;
    let first = u32::from_le_bytes(bytes[map..map + 4].try_into().unwrap());
    let block = MIB;
    let cases: Vec<(&str, Damage, Expect)> = vec![
        (
            "signature",
            Box::new(|b| b[64] ^= 1),
            Expect::Refused("no VDI signature"),
        ),
        (
            "absurd disk size",
            Box::new(|b| b[368..376].copy_from_slice(&(1u64 << 60).to_le_bytes())),
            Expect::Refused("disk size"),
        ),
        (
            "block size 0",
            Box::new(|b| set_le32(b, 376, 0)),
            Expect::Refused("power of two"),
        ),
        (
            "block size 3000",
            Box::new(|b| set_le32(b, 376, 3000)),
            Expect::Refused("power of two"),
        ),
        (
            "absurd block count",
            Box::new(|b| set_le32(b, 384, u32::MAX)),
            Expect::Refused("more than fusex holds"),
        ),
        (
            "map past the end",
            Box::new(|b| set_le32(b, 340, 1 << 30)),
            Expect::Refused("block map"),
        ),
        (
            "map over the header",
            Box::new(|b| set_le32(b, 340, 0)),
            Expect::Refused("block map"),
        ),
        (
            "differencing",
            Box::new(|b| b[440] = 1),
            Expect::Refused("differencing"),
        ),
        (
            "map entry past the blocks",
            Box::new(move |b| set_le32(b, map + 4, 0x7fff_0000)),
            Expect::Eio(vec![(block, block)]),
        ),
        (
            "map entries sharing a block",
            Box::new(move |b| set_le32(b, map + 12, first)),
            Expect::Eio(vec![(0, block), (3 * block, block)]),
        ),
    ];
    hostile_cases(&w, &good, "vdi", &want, cases);
}

// ---------------------------------------------------------------------------------------
// Formats, locks, fusex serve
// ---------------------------------------------------------------------------------------

/// `--format auto` probes dynamic VHD and VDI images; a fixed VHD (footer only at the end) is
/// raw to auto, as to QEMU, and served as VHD with `--format vhd`; `--format vhd` on a raw
/// file is refused.
#[test]
fn format_choice() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("fmt-choice");
    let src = w.join("src.raw");
    let data = random_image(&src, 4 * MIB, 51);
    let fixed = w.join("fixed.vhd");
    qemu_img(
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "vpc",
            "-o",
            "subformat=fixed,force_size=on",
        ],
        &[&src, &fixed],
    );
    let m = Mount::start(&w, &fixed, &w.join("auto"), &[]);
    assert!(m.stderr().contains("format raw (auto"), "{}", m.stderr());
    assert_eq!(
        fstat(&m.open_ro()).0,
        4 * MIB + 512,
        "raw: the footer shows"
    );
    m.stop().assert_clean("fixed vhd as auto");
    let m = Mount::start(&w, &fixed, &w.join("vhd"), &["--format", "vhd"]);
    assert_bytes_eq(&read_all(m.path()), &data, 0, "fixed vhd as vhd");
    m.stop().assert_clean("fixed vhd as vhd");
    for format in ["vhd", "vdi"] {
        match Mount::try_start(
            &w,
            &src,
            &w.join(format!("raw-{format}")),
            &["--format", format],
        ) {
            Err(f) => assert_refused(&f, &format!("raw as {format}"), format),
            Ok(_) => panic!("a raw file was served as {format}"),
        }
    }
    let vdi = w.join("d.vdi");
    qemu_img(&["convert", "-f", "raw", "-O", "vdi"], &[&src, &vdi]);
    let args = ["--format", "vdi", "--growable", "--writable"];
    match Mount::try_start(&w, &vdi, &w.join("grow"), &args) {
        Err(f) => assert_refused(&f, "--growable", "--growable"),
        Ok(_) => panic!("--growable was accepted"),
    }
}

/// A writable export holds QEMU's locks: `qemu-img info` without `-U` is refused while it runs.
#[test]
fn writable_exports_lock_the_image_as_qemu_does() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("fmt-lock");
    for (fmt, name) in [("vpc", "d.vhd"), ("vdi", "d.vdi")] {
        let img = w.join(name);
        qemu_img(&["create", "-q", "-f", fmt], &[&img, Path::new("8M")]);
        let m = Mount::start(&w, &img, &w.join(format!("export-{fmt}")), &["--writable"]);
        let out = Command::new("qemu-img")
            .args(["info", "-f", fmt])
            .arg(&img)
            .output()
            .unwrap();
        assert!(
            !out.status.success(),
            "{fmt}: qemu-img info ran beside a writable export"
        );
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("lock"),
            "{fmt}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        m.stop().assert_clean(fmt);
        run_ok(Command::new("qemu-img").args(["info", "-f", fmt]).arg(&img));
    }
}

/// `fusex serve`: `vpc` and `vdi` nodes over inline and named file nodes serve the images.
#[test]
fn serve_vpc_and_vdi_nodes() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("fmt-serve");
    let src = w.join("src.raw");
    let data = random_image(&src, 6 * MIB, 61);
    let vhd = w.join("d.vhd");
    qemu_img(
        &["convert", "-f", "raw", "-O", "vpc", "-o", "force_size=on"],
        &[&src, &vhd],
    );
    let vdi = w.join("d.vdi");
    qemu_img(&["convert", "-f", "raw", "-O", "vdi"], &[&src, &vdi]);
    let serve = Serve::start(w.path(), &[]);
    let mut q = serve.qmp();
    q.ok(
        "blockdev-add",
        json!({"driver": "vpc", "node-name": "v",
               "file": {"driver": "file", "filename": vhd}}),
    );
    q.ok(
        "blockdev-add",
        json!({"driver": "file", "node-name": "f", "filename": vdi}),
    );
    q.ok(
        "blockdev-add",
        json!({"driver": "vdi", "node-name": "d", "file": "f"}),
    );
    for (node, id) in [("v", "ev"), ("d", "ed")] {
        let mp = w.join(format!("mnt-{id}"));
        fs::write(&mp, b"").unwrap();
        q.ok(
            "block-export-add",
            json!({"type": "fuse", "id": id, "node-name": node, "mountpoint": mp,
                   "writable": true}),
        );
        assert_bytes_eq(&read_all(&mp), &data, 0, id);
        let f = open_rw(&mp);
        f.write_all_at(&[0x5a; 5000], MIB - 100).unwrap();
        f.sync_all().unwrap();
        drop(f);
        q.ok("block-export-del", json!({"id": id}));
        q.event("BLOCK_EXPORT_DELETED", id, TIMEOUT);
    }
    drop(q);
    drop(serve);
    let mut want = data.clone();
    want[(MIB - 100) as usize..][..5000].fill(0x5a);
    let raw = w.join("want.raw");
    fs::write(&raw, &want).unwrap();
    qemu_img(&["compare", "-q", "-f", "vpc", "-F", "raw"], &[&vhd, &raw]);
    qemu_img(&["compare", "-q", "-f", "vdi", "-F", "raw"], &[&vdi, &raw]);
    qemu_img(&["check", "-q", "-f", "vdi"], &[&vdi]);
}

// ---------------------------------------------------------------------------------------
// VHDX
// ---------------------------------------------------------------------------------------

const VHDX_DYNAMIC: Sub = Sub {
    tag: "vhdx-dynamic",
    fmt: "vhdx",
    opts: "subformat=dynamic,block_size=1M",
    format: None,
    shown: "format vhdx (auto",
    check: true,
    // qemu-img map reports a VHDX as data throughout: its driver has no block status.
    sparse: false,
};

const VHDX_FIXED: Sub = Sub {
    tag: "vhdx-fixed",
    fmt: "vhdx",
    opts: "subformat=fixed",
    format: Some("vhdx"),
    shown: "format vhdx",
    check: true,
    sparse: false,
};

/// A VHDX made by `qemu-img convert` reads back as `qemu-img convert -O raw` gives it, whole
/// and in random pieces; every hole SEEK_HOLE reports reads as zeroes in the oracle (qemu-img
/// map has no block status for VHDX to compare with), a dynamic image has holes where its
/// zero blocks are, and a read-only export leaves the file untouched.
fn vhdx_read_case(sub: Sub, seed: u64) {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new(&format!("fmt-ro-{}", sub.tag));
    let src = w.join("src.raw");
    let size = 21 * MIB + 3 * 512;
    fs::write(&src, mixed(size, seed)).unwrap();
    let img = w.join("disk.img");
    qemu_img(
        &["convert", "-f", "raw", "-O", sub.fmt, "-o", sub.opts],
        &[&src, &img],
    );
    let want = oracle(&img, sub.fmt, &w.join("oracle.raw"));
    let before = file_hash(&img);
    let m = Mount::start(&w, &img, &w.join("export"), &sub.args(false));
    assert!(
        m.stderr().contains(sub.shown),
        "{}: {}",
        sub.tag,
        m.stderr()
    );
    let f = m.open_ro();
    assert_eq!(fstat(&f).0, want.len() as u64, "{}: st_size", sub.tag);
    assert_bytes_eq(
        &read_all(m.path()),
        &want,
        0,
        &format!("{}: whole", sub.tag),
    );
    let mut rng = Rng::new(seed ^ 0x77);
    for i in 0..150 {
        let off = rng.below(want.len() as u64 + 4096);
        let len = 1 + rng.below(if i % 5 == 0 { 3 * MIB } else { 70 * KIB }) as usize;
        let got = pread_full(&f, off, len).unwrap_or_else(|e| panic!("pread {off}+{len}: {e}"));
        let lo = off.min(want.len() as u64) as usize;
        let hi = (off + len as u64).min(want.len() as u64) as usize;
        assert_bytes_eq(&got, &want[lo..hi], off, &format!("{}: read #{i}", sub.tag));
    }
    let seek = seek_map(&f, want.len() as u64);
    let mut at = 0u64;
    let mut holes = 0;
    for &(a, b) in seek
        .iter()
        .chain([(want.len() as u64, want.len() as u64)].iter())
    {
        if a > at {
            holes += 1;
            assert!(
                want[at as usize..a as usize].iter().all(|&x| x == 0),
                "{}: the hole {at}..{a} is not zeroes",
                sub.tag
            );
        }
        at = b;
    }
    if sub.format.is_none() {
        assert!(
            holes > 0,
            "{}: no hole in a dynamic image: {seek:?}",
            sub.tag
        );
    } else {
        assert_eq!(
            seek,
            vec![(0, want.len() as u64)],
            "{}: data throughout",
            sub.tag
        );
    }
    drop(f);
    m.stop().assert_clean(sub.tag);
    assert_eq!(
        file_hash(&img),
        before,
        "{}: read-only export changed the image",
        sub.tag
    );
}

#[test]
fn reads_vhdx_dynamic() {
    vhdx_read_case(VHDX_DYNAMIC, 71);
}

#[test]
fn reads_vhdx_fixed() {
    vhdx_read_case(VHDX_FIXED, 72);
}

#[test]
fn writes_vhdx_dynamic() {
    write_case(VHDX_DYNAMIC, 73);
}

#[test]
fn writes_vhdx_fixed() {
    write_case(VHDX_FIXED, 74);
}

#[test]
fn racing_writers_allocate_vhdx_blocks_once() {
    racing_case(VHDX_DYNAMIC, MIB, MIB);
}

/// Stores the CRC-32C of `b` (its checksum field at 4 taken as zero) at 4.
fn fix_crc32c(b: &mut [u8]) {
    b[4..8].fill(0);
    let c = crc32c(b);
    b[4..8].copy_from_slice(&c.to_le_bytes());
}

fn le64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// Where qemu-img put a VHDX's structures: the current header, the BAT, and the file
/// parameters and virtual disk size items.
struct VhdxLayout {
    header: usize,
    bat: usize,
    metadata: usize,
    params: usize,
    disk_size: usize,
}

fn vhdx_layout(b: &[u8]) -> VhdxLayout {
    let seq = |at: usize| le64_at(b, at + 8);
    let header = if seq(128 << 10) > seq(64 << 10) {
        128 << 10
    } else {
        64 << 10
    };
    let rt = 192 << 10;
    assert_eq!(&b[rt..rt + 4], b"regi", "setup: region table");
    let (mut bat, mut metadata) = (0, 0);
    for i in 0..u32::from_le_bytes(b[rt + 8..rt + 12].try_into().unwrap()) as usize {
        let e = rt + 16 + 32 * i;
        let off = le64_at(b, e + 16) as usize;
        match b[e] {
            0x66 => bat = off,      // 2dc27766-...
            0x06 => metadata = off, // 8b7ca206-...
            x => panic!("setup: region {x:#x}"),
        }
    }
    assert_eq!(
        &b[metadata..metadata + 8],
        b"metadata",
        "setup: metadata table"
    );
    let (mut params, mut disk_size) = (0, 0);
    for i in 0..u16::from_le_bytes(b[metadata + 10..metadata + 12].try_into().unwrap()) as usize {
        let e = metadata + 32 + 32 * i;
        let off = metadata + u32::from_le_bytes(b[e + 16..e + 20].try_into().unwrap()) as usize;
        match b[e] {
            0x37 => params = off,    // caa16737-...
            0x24 => disk_size = off, // 2fa54224-...
            _ => {}
        }
    }
    assert!(params > 0 && disk_size > 0, "setup: metadata items");
    VhdxLayout {
        header,
        bat,
        metadata,
        params,
        disk_size,
    }
}

#[test]
fn hostile_vhdx_images() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("fmt-hostile-vhdx");
    let src = w.join("src.raw");
    random_image(&src, 8 * MIB, 81);
    let good = w.join("good.vhdx");
    qemu_img(
        &["convert", "-f", "raw", "-O", "vhdx", "-o", "block_size=1M"],
        &[&src, &good],
    );
    let want = oracle(&good, "vhdx", &w.join("oracle.raw"));
    let bytes = fs::read(&good).unwrap();
    let l = vhdx_layout(&bytes);
    let (hdr, bat, meta, params, dsize) = (l.header, l.bat, l.metadata, l.params, l.disk_size);
    let e0 = le64_at(&bytes, bat);
    assert_eq!(e0 & 7, 6, "setup: block 0 is present");
    let block = MIB;
    let entry = move |i: usize, v: u64| -> Damage {
        Box::new(move |b: &mut Vec<u8>| b[bat + 8 * i..][..8].copy_from_slice(&v.to_le_bytes()))
    };
    let cases: Vec<(&str, Damage, Expect)> = vec![
        (
            "bad CRC in both headers",
            Box::new(|b| {
                b[(64 << 10) + 200] ^= 1;
                b[(128 << 10) + 200] ^= 1;
            }),
            Expect::Refused("neither of its headers"),
        ),
        (
            "bad CRC in both region tables",
            Box::new(|b| {
                b[(192 << 10) + 2000] ^= 1;
                b[(256 << 10) + 2000] ^= 1;
            }),
            Expect::Refused("region table"),
        ),
        (
            "dirty log",
            Box::new(move |b| {
                b[hdr + 48..hdr + 64].copy_from_slice(&[0x11; 16]);
                fix_crc32c(&mut b[hdr..hdr + 4096]);
            }),
            Expect::Refused("qemu-img check -r all"),
        ),
        (
            "absurd virtual size",
            Box::new(move |b| b[dsize..dsize + 8].copy_from_slice(&(1u64 << 60).to_le_bytes())),
            Expect::Refused("64 TiB"),
        ),
        (
            "block size 3 MiB",
            Box::new(move |b| set_le32(b, params, 3 << 20)),
            Expect::Refused("power of two"),
        ),
        (
            "block size 512 KiB",
            Box::new(move |b| set_le32(b, params, 512 << 10)),
            Expect::Refused("power of two"),
        ),
        (
            "block size 512 MiB",
            Box::new(move |b| set_le32(b, params, 512 << 20)),
            Expect::Refused("power of two"),
        ),
        (
            // Has parent without a parent locator (a real differencing image: vhdx_diff.rs).
            "differencing without a parent locator",
            Box::new(move |b| set_le32(b, params + 4, 2)),
            Expect::Refused("differencing"),
        ),
        (
            "BAT entry past the end",
            entry(1, (1 << 40) | 6),
            Expect::Eio(vec![(block, block)]),
        ),
        (
            "BAT entry into the metadata",
            entry(1, meta as u64 | 6),
            Expect::Eio(vec![(block, block)]),
        ),
        (
            "BAT entry into the BAT",
            entry(1, bat as u64 | 6),
            Expect::Eio(vec![(block, block)]),
        ),
        (
            "BAT entry into the headers",
            entry(1, 6),
            Expect::Eio(vec![(block, block)]),
        ),
        (
            "BAT entries sharing a block",
            entry(2, e0),
            Expect::Eio(vec![(0, block), (2 * block, block)]),
        ),
        (
            "BAT entry partially present",
            entry(3, (e0 & !7) | 7),
            Expect::Eio(vec![(3 * block, block)]),
        ),
    ];
    hostile_cases(&w, &good, "vhdx", &want, cases);

    // The advice for a dirty log: QEMU opens this one (its log has no valid entries) and
    // `qemu-img convert` makes a clean copy that fusex serves.
    let dirty = w.join("dirty.vhdx");
    damaged(&good, &dirty, &move |b| {
        b[hdr + 48..hdr + 64].copy_from_slice(&[0x11; 16]);
        fix_crc32c(&mut b[hdr..hdr + 4096]);
    });
    let copy = w.join("copy.vhdx");
    qemu_img(&["convert", "-f", "vhdx", "-O", "vhdx"], &[&dirty, &copy]);
    let m = Mount::start(&w, &copy, &w.join("copy"), &[]);
    assert_bytes_eq(
        &read_all(m.path()),
        &want,
        0,
        "the dirty image's clean copy",
    );
    m.stop().assert_clean("the dirty image's clean copy");

    // One damaged header (the current one): the other serves, and a writable export writes
    // the next header over the damaged one; qemu-img then finds the image clean.
    let one = w.join("one-header.vhdx");
    damaged(&good, &one, &move |b| b[hdr + 300] ^= 1);
    let m = Mount::start(&w, &one, &w.join("one"), &["--writable"]);
    assert_bytes_eq(&read_all(m.path()), &want, 0, "one header damaged");
    m.stop().assert_clean("one header damaged");
    qemu_img(&["check", "-q", "-f", "vhdx"], &[&one]);
    qemu_img(
        &["compare", "-q", "-f", "vhdx", "-F", "vhdx"],
        &[&one, &good],
    );
}

/// `--format vhdx` on a raw file is refused, `--growable` too; a writable export holds
/// QEMU's locks; `fusex serve` serves a `vhdx` node, and what it wrote passes `qemu-img check`
/// and `compare`.
#[test]
fn vhdx_format_locks_and_serve() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("fmt-vhdx-misc");
    let src = w.join("src.raw");
    let data = random_image(&src, 6 * MIB, 91);
    match Mount::try_start(&w, &src, &w.join("raw"), &["--format", "vhdx"]) {
        Err(f) => assert_refused(&f, "raw as vhdx", "vhdxfile"),
        Ok(_) => panic!("a raw file was served as vhdx"),
    }
    let img = w.join("d.vhdx");
    qemu_img(&["convert", "-f", "raw", "-O", "vhdx"], &[&src, &img]);
    match Mount::try_start(&w, &img, &w.join("grow"), &["--growable", "--writable"]) {
        Err(f) => assert_refused(&f, "--growable", "--growable"),
        Ok(_) => panic!("--growable was accepted"),
    }
    let m = Mount::start(&w, &img, &w.join("locked"), &["--writable"]);
    let out = Command::new("qemu-img")
        .args(["info", "-f", "vhdx"])
        .arg(&img)
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "qemu-img info ran beside a writable export"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("lock"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    m.stop().assert_clean("locked");

    let serve = Serve::start(w.path(), &[]);
    let mut q = serve.qmp();
    q.ok(
        "blockdev-add",
        json!({"driver": "vhdx", "node-name": "x",
               "file": {"driver": "file", "filename": img}}),
    );
    let mp = w.join("mnt-x");
    fs::write(&mp, b"").unwrap();
    q.ok(
        "block-export-add",
        json!({"type": "fuse", "id": "ex", "node-name": "x", "mountpoint": mp,
               "writable": true}),
    );
    assert_bytes_eq(&read_all(&mp), &data, 0, "vhdx node");
    let f = open_rw(&mp);
    f.write_all_at(&[0x5a; 5000], MIB - 100).unwrap();
    f.sync_all().unwrap();
    drop(f);
    q.ok("block-export-del", json!({"id": "ex"}));
    q.event("BLOCK_EXPORT_DELETED", "ex", TIMEOUT);
    drop(q);
    drop(serve);
    let mut want = data.clone();
    want[(MIB - 100) as usize..][..5000].fill(0x5a);
    let raw = w.join("want.raw");
    fs::write(&raw, &want).unwrap();
    qemu_img(&["check", "-q", "-f", "vhdx"], &[&img]);
    qemu_img(&["compare", "-q", "-f", "vhdx", "-F", "raw"], &[&img, &raw]);
}

// ---------------------------------------------------------------------------------------
// VMDK through the same read and write cases (tests/vmdk.rs has the rest)
// ---------------------------------------------------------------------------------------

#[test]
fn reads_vmdk_monolithic_sparse() {
    read_case(SUBS[5], 81);
}

#[test]
fn reads_vmdk_two_gb_max_extent_sparse() {
    read_case(SUBS[6], 82);
}

#[test]
fn reads_vmdk_monolithic_flat() {
    read_case(SUBS[7], 83);
}

#[test]
fn reads_vmdk_stream_optimized() {
    read_case(SUBS[8], 84);
}

#[test]
fn writes_vmdk_monolithic_sparse() {
    write_case(SUBS[5], 91);
}

#[test]
fn writes_vmdk_two_gb_max_extent_sparse() {
    write_case(SUBS[6], 92);
}

#[test]
fn writes_vmdk_monolithic_flat() {
    write_case(SUBS[7], 93);
}
