//! qcow2 images: fusex serves their guest-visible bytes, and qemu-img / qemu-io are the oracle.
//!
//! - Images built by `qemu-img convert` (cluster sizes 512 B .. 2 MiB, compressed clusters, v2)
//!   read back byte for byte, with O_DIRECT and buffered reads.
//! - Backing chains (relative backing names, resolved against each image's own directory; a raw
//!   base; a 3-level chain) read right, take writes (copy-on-write of partial clusters, discards
//!   and zeroes that must hide the backing data), and leave the backing files untouched.
//! - Random writes, discards and zero ranges on a writable export end up exactly where a raw oracle
//!   says (`qemu-img compare`), with a clean `qemu-img check`, durable at fsync.
//! - SEEK_DATA / SEEK_HOLE agree with `qemu-img map`.
//! - fio with crc32c verification on two queues over a sparse image (every write allocates).
//! - Growing a `--growable` export; `--format raw|auto|qcow2`.
//! - Corrupt or unsupported images are refused with one line, never a panic, never a mount; a
//!   corrupt L1 entry fails the requests that need it with EIO and nothing else.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

use fusex_e2e::*;

/// What every test here needs besides root and /dev/fuse.
const QEMU: &[&str] = &["qemu-img", "qemu-io"];

// ---------------------------------------------------------------------------------------
// qemu-img / qemu-io
// ---------------------------------------------------------------------------------------

/// `qemu-img` run in `dir` (relative backing names given on its command line are relative to it).
fn qemu_img(dir: &Path) -> Command {
    let mut c = Command::new("qemu-img");
    c.current_dir(dir);
    c
}

fn text(out: &Output) -> String {
    format!(
        "--- stdout ---\n{}--- stderr ---\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A write qemu-io applies to an image before fusex sees it, mirrored in the test's model.
enum Qio {
    /// `write -P pattern off len`: `len` bytes of `pattern`.
    Pattern(u64, u64, u8),
    /// `write -z off len`: zeroes (zero clusters where whole clusters are covered).
    Zero(u64, u64),
}

/// Applies `ops` to `img` with qemu-io (one invocation) and to `model`.
#[track_caller]
fn qemu_io(img: &Path, fmt: &str, model: &mut [u8], ops: &[Qio]) {
    let mut cmd = Command::new("qemu-io");
    cmd.arg("-f").arg(fmt);
    for op in ops {
        let c = match *op {
            Qio::Pattern(off, len, pat) => {
                model[off as usize..(off + len) as usize].fill(pat);
                format!("write -P {pat} {off} {len}")
            }
            Qio::Zero(off, len) => {
                model[off as usize..(off + len) as usize].fill(0);
                format!("write -z {off} {len}")
            }
        };
        cmd.arg("-c").arg(c);
    }
    cmd.arg(img);
    let out = run_ok(&mut cmd);
    let t = text(&out);
    assert!(
        !t.contains("failed") && t.matches("wrote ").count() == ops.len(),
        "qemu-io on {}: a write did not happen:\n{t}",
        img.display()
    );
}

/// `qemu-img convert -f raw -O qcow2 [-c] -o OPTS src dst`.
fn convert_to_qcow2(src: &Path, dst: &Path, opts: &str, compress: bool) {
    let mut cmd = qemu_img(src.parent().unwrap());
    cmd.args(["convert", "-f", "raw", "-O", "qcow2"]);
    if compress {
        cmd.arg("-c");
    }
    if !opts.is_empty() {
        cmd.args(["-o", opts]);
    }
    run_ok(cmd.arg(src).arg(dst));
}

/// `qemu-img create -f qcow2 -o OPTS img SIZE` (sparse: nothing allocated).
fn create_qcow2(img: &Path, opts: &str, size: u64) {
    let mut cmd = qemu_img(img.parent().unwrap());
    cmd.args(["create", "-q", "-f", "qcow2"]);
    if !opts.is_empty() {
        cmd.args(["-o", opts]);
    }
    run_ok(cmd.arg(img).arg(size.to_string()));
}

/// `qemu-img create -f qcow2 -b BACKING -F BFMT NAME`, run in `dir` so a relative backing name is
/// stored as given.
fn create_overlay(dir: &Path, name: &str, backing: &str, backing_fmt: &str, opts: &str) {
    let mut cmd = qemu_img(dir);
    cmd.args([
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        backing,
        "-F",
        backing_fmt,
    ]);
    if !opts.is_empty() {
        cmd.args(["-o", opts]);
    }
    run_ok(cmd.arg(name));
}

/// `qemu-img info --output=json` (with -U: the image may be in use).
fn qemu_info(img: &Path) -> Value {
    let out = run_ok(
        qemu_img(img.parent().unwrap())
            .args(["info", "-U", "--output=json"])
            .arg(img),
    );
    serde_json::from_slice(&out.stdout).expect("qemu-img info prints JSON")
}

fn virtual_size(img: &Path) -> u64 {
    qemu_info(img)["virtual-size"]
        .as_u64()
        .expect("virtual-size in qemu-img info")
}

/// `qemu-img check --output=json -f qcow2 [-U] img`: (exit code, report).
fn qemu_check(img: &Path, in_use: bool) -> (i32, Value, String) {
    let mut cmd = qemu_img(img.parent().unwrap());
    cmd.args(["check", "--output=json", "-f", "qcow2"]);
    if in_use {
        cmd.arg("-U");
    }
    let out = run(cmd.arg(img));
    let report = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.code().unwrap_or(-1), report, text(&out))
}

fn count(report: &Value, key: &str) -> u64 {
    report.get(key).and_then(Value::as_u64).unwrap_or(0)
}

/// `qemu-img check` finds nothing at all: exit 0, no corruptions, no leaks, no check errors.
#[track_caller]
fn assert_check_clean(img: &Path, what: &str) {
    let (code, report, out) = qemu_check(img, false);
    assert!(
        code == 0
            && count(&report, "corruptions") == 0
            && count(&report, "leaks") == 0
            && count(&report, "check-errors") == 0,
        "{what}: qemu-img check {} is not clean (exit {code}; 0 = clean, 2 = corruptions, \
         3 = leaks):\n{out}",
        img.display()
    );
}

/// `qemu-img compare [-U] -f FA -F FB a b` says identical (exit 0).
#[track_caller]
fn assert_qemu_identical(a: &Path, fa: &str, b: &Path, fb: &str, in_use: bool, what: &str) {
    let mut cmd = qemu_img(a.parent().unwrap());
    cmd.arg("compare");
    if in_use {
        cmd.arg("-U");
    }
    cmd.args(["-f", fa, "-F", fb]).arg(a).arg(b);
    let out = run(&mut cmd);
    assert!(
        out.status.code() == Some(0),
        "{what}: qemu-img compare -f {fa} -F {fb} {} {} exited {:?} (0 = identical, 1 = differ, \
         2 = error):\n{}",
        a.display(),
        b.display(),
        out.status.code(),
        text(&out)
    );
}

fn sorted_merged(mut v: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for (a, b) in v {
        match out.last_mut() {
            Some(last) if last.1 >= a => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// The data ranges of `qemu-img map --output=json` (entries with `"data": true`, at any depth of
/// the backing chain), merged: `(start, end)`. Also returns whether any data lies in a backing
/// file (depth > 0).
fn qemu_map_data(img: &Path) -> (Vec<(u64, u64)>, bool) {
    let out = run_ok(
        qemu_img(img.parent().unwrap())
            .args(["map", "-U", "--output=json", "-f", "qcow2"])
            .arg(img),
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("qemu-img map prints JSON");
    let mut ranges = Vec::new();
    let mut from_backing = false;
    for e in v.as_array().expect("qemu-img map: an array") {
        if e["data"].as_bool() == Some(true) {
            let start = e["start"].as_u64().unwrap();
            let len = e["length"].as_u64().unwrap();
            ranges.push((start, start + len));
            from_backing |= e["depth"].as_u64().unwrap_or(0) > 0;
        }
    }
    (sorted_merged(ranges), from_backing)
}

/// The data ranges of an open file found by walking it with SEEK_DATA / SEEK_HOLE, merged.
#[track_caller]
fn seek_data(f: &File, size: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut off = 0;
    while off < size {
        let data = match lseek(f, off, libc::SEEK_DATA) {
            Ok(d) => d,
            Err(e) if e == libc::ENXIO => break,
            Err(e) => panic!("lseek({off}, SEEK_DATA): {}", errno_str(e)),
        };
        assert!(
            data >= off && data < size,
            "lseek({off}, SEEK_DATA) = {data}, outside [{off}, {size})"
        );
        let hole = lseek(f, data, libc::SEEK_HOLE)
            .unwrap_or_else(|e| panic!("lseek({data}, SEEK_HOLE): {}", errno_str(e)));
        assert!(
            hole > data && hole <= size,
            "lseek({data}, SEEK_HOLE) = {hole}: must lie in ({data}, {size}]"
        );
        out.push((data, hole));
        off = hole;
        assert!(
            out.len() < 1_000_000,
            "SEEK_DATA/SEEK_HOLE walk does not end"
        );
    }
    assert_eq!(
        lseek(f, size, libc::SEEK_DATA).map_err(errno_str),
        Err(errno_str(libc::ENXIO)),
        "SEEK_DATA at EOF"
    );
    sorted_merged(out)
}

fn fmt_ranges(v: &[(u64, u64)]) -> String {
    v.iter()
        .map(|(a, b)| format!("[{a:#x}, {b:#x})"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[track_caller]
fn assert_ranges_eq(seek: &[(u64, u64)], map: &[(u64, u64)], what: &str) {
    assert!(
        seek == map,
        "{what}: data ranges differ\n  SEEK_DATA/SEEK_HOLE on the export: {}\n  qemu-img map:                      {}",
        fmt_ranges(seek),
        fmt_ranges(map)
    );
}

// ---------------------------------------------------------------------------------------
// Data and files
// ---------------------------------------------------------------------------------------

/// `size` bytes in 96 KiB pieces (so pieces straddle clusters) that are random, zero (qemu-img
/// convert leaves them unallocated), repetitive (compress well) or mostly zero. The first and the
/// last piece are random.
fn mixed_content(size: u64, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let mut v = vec![0u8; size as usize];
    let piece = 96 * KIB as usize;
    let pieces = v.len().div_ceil(piece);
    for (i, chunk) in v.chunks_mut(piece).enumerate() {
        let kind = if i == 0 || i + 1 == pieces {
            0
        } else {
            rng.below(5)
        };
        match kind {
            0 | 1 => rng.fill(chunk),
            2 => {}
            3 => {
                let pat = rng.bytes(37);
                for (j, b) in chunk.iter_mut().enumerate() {
                    *b = pat[j % pat.len()];
                }
                for _ in 0..16 {
                    let k = rng.below(chunk.len() as u64) as usize;
                    chunk[k] = rng.next_u64() as u8;
                }
            }
            _ => {
                for _ in 0..8 {
                    let k = rng.below(chunk.len() as u64) as usize;
                    chunk[k] = rng.next_u64() as u8 | 1;
                }
            }
        }
    }
    v
}

fn write_file(path: &Path, data: &[u8]) {
    let f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    f.write_all_at(data, 0)
        .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    f.sync_all().expect("fsync");
}

fn file_hash(path: &Path) -> u64 {
    hash_bytes(0, &read_all(path))
}

/// The whole file read with O_DIRECT, 1 MiB at a time into a page-aligned buffer.
fn read_all_direct(path: &Path) -> Vec<u8> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap_or_else(|e| panic!("open {} O_DIRECT: {e}", path.display()));
    let mut buf = AlignedBuf::new(MIB as usize, 4096);
    let mut out = Vec::new();
    loop {
        let n = f
            .read_at(buf.as_mut_slice(), out.len() as u64)
            .unwrap_or_else(|e| panic!("O_DIRECT pread at {}: {e}", out.len()));
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&buf.as_slice()[..n]);
    }
}

fn be32(v: u32) -> Vec<u8> {
    v.to_be_bytes().to_vec()
}

fn be64(v: u64) -> Vec<u8> {
    v.to_be_bytes().to_vec()
}

fn read_be64(path: &Path, off: u64) -> u64 {
    let b = pread_full(&open_ro(path), off, 8).expect("read header");
    u64::from_be_bytes(b.try_into().expect("8 bytes"))
}

fn read_be32(path: &Path, off: u64) -> u32 {
    let b = pread_full(&open_ro(path), off, 4).expect("read header");
    u32::from_be_bytes(b.try_into().expect("4 bytes"))
}

/// Overwrites bytes of a file in place.
fn patch(path: &Path, off: u64, bytes: &[u8]) {
    open_rw(path)
        .write_all_at(bytes, off)
        .unwrap_or_else(|e| panic!("patch {} at {off}: {e}", path.display()));
}

// qcow2 header fields (big-endian), docs/interop/qcow2.txt.
const H_VERSION: u64 = 4;
const H_BACKING_OFFSET: u64 = 8;
const H_BACKING_SIZE: u64 = 16;
const H_CLUSTER_BITS: u64 = 20;
const H_SIZE: u64 = 24;
const H_CRYPT_METHOD: u64 = 32;
const H_L1_SIZE: u64 = 36;
const H_L1_OFFSET: u64 = 40;
const H_REFCOUNT_OFFSET: u64 = 48;
const H_REFCOUNT_CLUSTERS: u64 = 56;
const H_NB_SNAPSHOTS: u64 = 60;
const H_SNAPSHOTS_OFFSET: u64 = 64;
const H_INCOMPATIBLE: u64 = 72;
const H_REFCOUNT_ORDER: u64 = 96;
const H_HEADER_LENGTH: u64 = 100;

/// Asserts `r` is an error whose errno is one of `allowed`.
#[track_caller]
fn assert_errno<T: std::fmt::Debug>(r: std::io::Result<T>, allowed: &[i32], what: &str) {
    match r {
        Ok(v) => panic!(
            "{what}: succeeded ({v:?}), expected one of {:?}",
            allowed.iter().map(|&e| errno_str(e)).collect::<Vec<_>>()
        ),
        Err(e) => assert!(
            allowed.contains(&errno(&e)),
            "{what}: got {} ({e}), expected one of {:?}",
            errno_str(errno(&e)),
            allowed.iter().map(|&e| errno_str(e)).collect::<Vec<_>>()
        ),
    }
}

/// The refusal contract for an image fusex cannot serve: exit code 1, nothing on stdout, no panic,
/// and exactly one error line "fusex: error: <what>: <what to do>", the last one; lines before it
/// may only be INFO log lines (`--format auto` logs its choice before the image is opened).
/// Returns the error line.
#[track_caller]
fn assert_refusal(code: Option<i32>, stdout: &str, stderr: &str, what: &str) -> String {
    assert!(
        !stderr.contains("panicked"),
        "{what}: fusex panicked:\n{stderr}"
    );
    assert_eq!(
        code,
        Some(1),
        "{what}: exit code (contract: 1); stderr:\n{stderr}"
    );
    assert!(
        stdout.is_empty(),
        "{what}: fusex must print nothing to stdout, got {stdout:?}"
    );
    let lines: Vec<&str> = stderr.lines().collect();
    let errors: Vec<&&str> = lines
        .iter()
        .filter(|l| l.starts_with("fusex: error: "))
        .collect();
    assert!(
        errors.len() == 1 && lines.last() == errors.first().copied(),
        "{what}: expected exactly one \"fusex: error: \" line, the last one; stderr:\n{stderr}"
    );
    for l in &lines[..lines.len() - 1] {
        assert!(
            l.contains(" INFO ") && !l.contains("ERROR") && !l.contains("WARN"),
            "{what}: only INFO log lines may precede the error line, got {l:?}; stderr:\n{stderr}"
        );
    }
    let line = errors[0].to_string();
    assert!(
        line["fusex: error: ".len()..].contains(": "),
        "{what}: the error line should read \"fusex: error: <what>: <what to do>\": {line:?}"
    );
    line
}

/// `fusex mount ARGS IMAGE MP` is refused ([`assert_refusal`]), nothing is mounted, no mountpoint
/// is left behind, and the error line names the problem (one of `problem`, case-insensitive).
#[track_caller]
fn expect_refused(w: &WorkDir, what: &str, args: &[&str], image: &Path, problem: &[&str]) {
    static N: AtomicUsize = AtomicUsize::new(0);
    let mp = w.join(format!("export-{}", N.fetch_add(1, Ordering::Relaxed)));
    let before = fuse_mounts_at(&mp).len();
    let mut argv: Vec<OsString> = vec!["mount".into()];
    argv.extend(args.iter().map(OsString::from));
    argv.push(image.as_os_str().to_os_string());
    argv.push(mp.as_os_str().to_os_string());
    let r = run_fusex(w, &argv, Some(&mp));
    eprintln!("{what}: fusex said: {}", r.stderr.trim_end());
    let line = assert_refusal(r.code, &r.stdout, &r.stderr, what).to_lowercase();
    assert_eq!(
        fuse_mounts_at(&mp).len(),
        before,
        "{what}: mount count on the mountpoint changed"
    );
    assert!(
        !mp.exists(),
        "{what}: fusex left a mountpoint file behind at {}",
        mp.display()
    );
    assert!(
        problem.iter().any(|k| line.contains(&k.to_lowercase())),
        "{what}: the error should name the problem (one of {problem:?}): {line}"
    );
}

/// Runs every case to its end even when earlier ones fail (a failing case panics and its guards
/// clean up as it unwinds), then fails listing each case that failed with its message.
fn every_case<T>(items: impl IntoIterator<Item = T>, name: impl Fn(&T) -> String, run: impl Fn(T)) {
    let mut failed = Vec::new();
    let mut total = 0;
    for item in items {
        total += 1;
        let n = name(&item);
        if let Err(e) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(item))) {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            let msg: String = msg.chars().take(1500).collect();
            failed.push(format!("- {n}: {msg}"));
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {total} cases failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

/// Bytes to write at an offset of a file.
type Patch = (u64, Vec<u8>);

/// Builds `dst` as a copy of `src` with each patch's bytes written at its offset.
fn mutated_copy(src: &Path, dst: &Path, patches: &[Patch]) {
    fs::copy(src, dst).unwrap_or_else(|e| panic!("copy to {}: {e}", dst.display()));
    for (off, bytes) in patches {
        patch(dst, *off, bytes);
    }
}

// ---------------------------------------------------------------------------------------
// 1. Read-only: every byte of images qemu-img built
// ---------------------------------------------------------------------------------------

/// Converts mixed content to qcow2 with `opts` (and `-c`), exports it read-only with `args` and
/// compares every byte (O_DIRECT and buffered, whole and random ranges), st_size, SEEK_DATA /
/// SEEK_HOLE against `qemu-img map`, and that a read-only export leaves the image file untouched.
fn read_only_case(tag: &str, size: u64, opts: &str, compress: bool, args: &[&str], seed: u64) {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new(tag);
    let src = w.join("src.raw");
    let data = mixed_content(size, seed);
    write_file(&src, &data);
    let img = w.join("disk.qcow2");
    convert_to_qcow2(&src, &img, opts, compress);
    assert_check_clean(&img, &format!("{tag}: as built"));
    assert_eq!(virtual_size(&img), size, "{tag}: virtual size as built");
    if compress {
        let (_, report, out) = qemu_check(&img, false);
        assert!(
            count(&report, "compressed-clusters") > 0,
            "{tag}: qemu-img convert -c made no compressed cluster (the test would not test \
             them):\n{out}"
        );
    }
    let (map, _) = qemu_map_data(&img);
    assert!(!map.is_empty(), "{tag}: the image holds no data");
    let before = file_hash(&img);

    let m = Mount::start(&w, &img, &w.join("export"), args);
    let f = m.open_ro();
    assert_eq!(fstat(&f).0, size, "{tag}: st_size is the virtual size");
    assert_bytes_eq(
        &read_all_direct(m.path()),
        &data,
        0,
        &format!("{tag}: O_DIRECT read of the whole export"),
    );
    assert_bytes_eq(
        &read_all(m.path()),
        &data,
        0,
        &format!("{tag}: buffered read of the whole export"),
    );
    let mut rng = Rng::new(seed ^ 0x55);
    // Fewer for compressed clusters: each read inflates whole clusters (up to 2 MiB) in a debug
    // build.
    let reads = if compress { 60 } else { 200 };
    for i in 0..reads {
        let off = rng.below(size + 4096);
        let len = 1 + rng.below(if i % 4 == 0 { 2 * MIB } else { 80 * KIB }) as usize;
        let got =
            pread_full(&f, off, len).unwrap_or_else(|e| panic!("{tag}: pread {off}+{len}: {e}"));
        let lo = (off.min(size)) as usize;
        let hi = (off + len as u64).min(size) as usize;
        assert_bytes_eq(
            &got,
            &data[lo..hi],
            off,
            &format!("{tag}: random read #{i} at {off}+{len}"),
        );
    }
    assert_ranges_eq(&seek_data(&f, size), &map, tag);
    drop(f);
    m.stop().assert_clean(tag);
    assert_eq!(
        file_hash(&img),
        before,
        "{tag}: a read-only export changed the image file"
    );
}

#[test]
fn read_only_512_byte_clusters() {
    read_only_case("q-ro-512", 8 * MIB, "cluster_size=512", false, &[], 101);
}

/// The default 64 KiB clusters, a size that ends inside a cluster, `--format qcow2` explicitly.
#[test]
fn read_only_64k_clusters_partial_last_cluster() {
    read_only_case(
        "q-ro-64k",
        16 * MIB + 3 * 512,
        "",
        false,
        &["--format", "qcow2"],
        102,
    );
}

#[test]
fn read_only_2m_clusters() {
    read_only_case(
        "q-ro-2m",
        13 * MIB + 4096,
        "cluster_size=2M",
        false,
        &[],
        103,
    );
}

#[test]
fn read_only_compressed_4k_clusters() {
    read_only_case("q-ro-c4k", 8 * MIB, "cluster_size=4096", true, &[], 104);
}

#[test]
fn read_only_compressed_64k_clusters() {
    read_only_case("q-ro-c64k", 16 * MIB, "", true, &[], 105);
}

#[test]
fn read_only_compressed_2m_clusters() {
    read_only_case("q-ro-c2m", 8 * MIB + 512, "cluster_size=2M", true, &[], 106);
}

/// qcow2 version 2 (compat=0.10: no zero clusters, no feature fields), still common.
#[test]
fn read_only_version_2_image() {
    read_only_case("q-ro-v2", 8 * MIB, "compat=0.10", false, &[], 107);
}

// ---------------------------------------------------------------------------------------
// 2. Backing chains
// ---------------------------------------------------------------------------------------

/// One operation on a writable export, mirrored in the model.
#[derive(Debug, Clone, Copy)]
enum Op {
    /// Buffered pwrite of random bytes.
    Write(u64, u64),
    /// O_DIRECT pwrite (4 KiB aligned) of random bytes.
    DirectWrite(u64, u64),
    /// fallocate(PUNCH_HOLE | KEEP_SIZE): reads back zeroes.
    Punch(u64, u64),
    /// fallocate(ZERO_RANGE): reads back zeroes.
    ZeroRange(u64, u64),
    /// fallocate(0) inside the image: content unchanged.
    Allocate(u64, u64),
}

impl Op {
    fn range(self) -> (u64, u64) {
        match self {
            Op::Write(o, l)
            | Op::DirectWrite(o, l)
            | Op::Punch(o, l)
            | Op::ZeroRange(o, l)
            | Op::Allocate(o, l) => (o, l),
        }
    }
}

/// Applies `op` through the export (`f` buffered, `fd` O_DIRECT) and to `model`, then reads the
/// range back through the export and compares.
#[track_caller]
fn apply(op: Op, f: &File, fd: &File, model: &mut [u8], rng: &mut Rng, what: &str) {
    let (off, len) = op.range();
    let r = off as usize..(off + len) as usize;
    match op {
        Op::Write(..) => {
            let data = rng.bytes(len as usize);
            f.write_all_at(&data, off)
                .unwrap_or_else(|e| panic!("{what}: pwrite {off}+{len}: {e}"));
            model[r.clone()].copy_from_slice(&data);
        }
        Op::DirectWrite(..) => {
            let data = rng.bytes(len as usize);
            let buf = AlignedBuf::from_slice(&data, 4096);
            fd.write_all_at(buf.as_slice(), off)
                .unwrap_or_else(|e| panic!("{what}: O_DIRECT pwrite {off}+{len}: {e}"));
            model[r.clone()].copy_from_slice(&data);
        }
        Op::Punch(..) => {
            fallocate(
                f,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off,
                len,
            )
            .unwrap_or_else(|e| {
                panic!("{what}: fallocate(PUNCH_HOLE|KEEP_SIZE, {off}, {len}): {e}")
            });
            model[r.clone()].fill(0);
        }
        Op::ZeroRange(..) => {
            fallocate(f, libc::FALLOC_FL_ZERO_RANGE, off, len)
                .unwrap_or_else(|e| panic!("{what}: fallocate(ZERO_RANGE, {off}, {len}): {e}"));
            model[r.clone()].fill(0);
        }
        Op::Allocate(..) => {
            fallocate(f, 0, off, len)
                .unwrap_or_else(|e| panic!("{what}: fallocate(0, {off}, {len}): {e}"));
        }
    }
    // Read back a little around the range too: neighbours must be untouched.
    let lo = off.saturating_sub(700);
    let hi = (off + len + 700).min(model.len() as u64);
    let got = pread_full(f, lo, (hi - lo) as usize)
        .unwrap_or_else(|e| panic!("{what}: pread {lo}..{hi} after {op:?}: {e}"));
    assert_bytes_eq(
        &got,
        &model[lo as usize..hi as usize],
        lo,
        &format!("{what}: read back after {op:?}"),
    );
}

/// A qcow2 base with data, an overlay created with a RELATIVE backing name, written first by
/// qemu-io and then through a writable export started from another cwd: copy-on-write of partial
/// clusters keeps the rest of the backing data, discards and zero ranges hide the backing data,
/// fsync and unmount leave an overlay that qemu-img finds identical to the model and clean, and
/// the base is never written.
#[test]
fn backing_chain_relative_name_reads_and_writes() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-backing");
    let dir = w.join("images");
    fs::create_dir(&dir).unwrap();
    let size = 16 * MIB;
    let base_src = w.join("base-src.raw");
    let mut model = mixed_content(size, 201);
    write_file(&base_src, &model);
    let base = dir.join("base.qcow2");
    convert_to_qcow2(&base_src, &base, "", false);
    create_overlay(&dir, "overlay.qcow2", "base.qcow2", "qcow2", "");
    let overlay = dir.join("overlay.qcow2");
    assert_eq!(
        qemu_info(&overlay)["backing-filename"].as_str(),
        Some("base.qcow2"),
        "the overlay must name its backing file relatively"
    );
    qemu_io(
        &overlay,
        "qcow2",
        &mut model,
        &[
            Qio::Pattern(3 * MIB, 100 * KIB, 0x5a),
            Qio::Pattern(7 * MIB + 1001, 333, 0x11),
            Qio::Zero(9 * MIB, 128 * KIB),
        ],
    );
    let base_hash = file_hash(&base);
    let cwd = std::env::current_dir().unwrap().canonicalize().unwrap();
    assert_ne!(
        cwd, dir,
        "fusex must run from another directory than the image's"
    );

    let m = Mount::start(&w, &overlay, &w.join("export"), &["--writable"]);
    let f = m.open_rw();
    let fd = open_rw_direct(m.path());
    assert_eq!(fstat(&f).0, size, "st_size of the overlay export");
    assert_bytes_eq(&read_all(m.path()), &model, 0, "overlay before writes");

    let cl = 64 * KIB;
    let ops = [
        // Inside a cluster whose data is in the base: the rest of it must survive.
        Op::Write(cl + 100, 50),
        // Across a cluster boundary, both clusters from the base.
        Op::Write(2 * MIB - 10, 20),
        Op::DirectWrite(5 * MIB + 4096, 3 * cl),
        // Over the range qemu-io wrote, partly.
        Op::Write(3 * MIB + 50 * KIB, 100 * KIB),
        // Into the zero clusters qemu-io made.
        Op::Write(9 * MIB + 4000, 3000),
        Op::Write(size - 7, 7),
        // Discards and zeroes over base data must read zeroes, not the base.
        Op::Punch(11 * MIB, 4 * cl),
        Op::Punch(12 * MIB + 1000, 70_000),
        Op::ZeroRange(13 * MIB + 3, 200_000),
        Op::Allocate(14 * MIB, 2 * cl),
        // Writing into a discarded cluster again.
        Op::Write(11 * MIB + cl + 10, 10),
    ];
    let mut rng = Rng::new(202);
    for op in ops {
        apply(op, &f, &fd, &mut model, &mut rng, "overlay");
    }
    f.sync_all().expect("fsync of the overlay export");
    assert_bytes_eq(&read_all(m.path()), &model, 0, "overlay after writes");
    drop((f, fd));
    m.stop().assert_clean("overlay export");

    let expected = w.join("expected.raw");
    write_file(&expected, &model);
    assert_eq!(virtual_size(&overlay), size, "overlay virtual size");
    assert_qemu_identical(
        &overlay,
        "qcow2",
        &expected,
        "raw",
        false,
        "overlay vs model",
    );
    assert_check_clean(&overlay, "overlay after the export");
    assert_eq!(file_hash(&base), base_hash, "the base image was written");
    assert_check_clean(&base, "base after the export");
    assert_eq!(
        qemu_info(&overlay)["backing-filename"].as_str(),
        Some("base.qcow2"),
        "the overlay's backing name changed"
    );
}

/// raw base <- qcow2 (32 KiB clusters) <- qcow2 (4 KiB clusters), in different directories,
/// each naming its backing file relative to its OWN directory ("../b/c/mid.qcow2", then
/// "base.raw"). A decoy base.raw next to the top image (different data) catches resolving
/// relative to the top image or the cwd.
#[test]
fn three_level_chain_with_raw_base() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-chain3");
    let a = w.join("a");
    let bc = w.join("b").join("c");
    fs::create_dir_all(&a).unwrap();
    fs::create_dir_all(&bc).unwrap();
    let size = 8 * MIB;
    let base = bc.join("base.raw");
    let mut model = random_image(&base, size, 301);
    let decoy = a.join("base.raw");
    random_image(&decoy, size, 302);
    create_overlay(&bc, "mid.qcow2", "base.raw", "raw", "cluster_size=32768");
    let mid = bc.join("mid.qcow2");
    qemu_io(
        &mid,
        "qcow2",
        &mut model,
        &[
            Qio::Pattern(MIB + 512, 70_000, 0x21),
            Qio::Zero(3 * MIB, 64 * KIB),
        ],
    );
    create_overlay(
        &a,
        "top.qcow2",
        "../b/c/mid.qcow2",
        "qcow2",
        "cluster_size=4096",
    );
    let top = a.join("top.qcow2");
    qemu_io(
        &top,
        "qcow2",
        &mut model,
        &[
            Qio::Pattern(MIB + 30_000, 8192, 0x33),
            Qio::Pattern(6 * MIB, 4096, 0x44),
        ],
    );
    let hashes = [file_hash(&base), file_hash(&mid), file_hash(&decoy)];

    let m = Mount::start(&w, &top, &w.join("export"), &["--writable"]);
    let f = m.open_rw();
    let fd = open_rw_direct(m.path());
    assert_eq!(fstat(&f).0, size, "st_size of the top export");
    assert_bytes_eq(
        &read_all(m.path()),
        &model,
        0,
        "3-level chain before writes (a mismatch everywhere the base shows through: the \
         decoy next to the top image was used)",
    );
    let mut rng = Rng::new(303);
    for op in [
        Op::Write(0, 1),
        // Into mid's zero clusters, which hide the raw base.
        Op::Write(3 * MIB + 100, 5000),
        // Across top's 4 KiB clusters over mid's data.
        Op::Write(MIB + 60_000, 9000),
        Op::DirectWrite(4 * MIB, 64 * KIB),
        Op::Punch(5 * MIB, 64 * KIB),
        Op::ZeroRange(7 * MIB + 1, 4096),
        Op::Write(size - 4101, 4101),
    ] {
        apply(op, &f, &fd, &mut model, &mut rng, "3-level chain");
    }
    f.sync_all().expect("fsync");
    assert_bytes_eq(&read_all(m.path()), &model, 0, "3-level chain after writes");
    drop((f, fd));
    m.stop().assert_clean("3-level chain export");

    let expected = w.join("expected.raw");
    write_file(&expected, &model);
    assert_qemu_identical(&top, "qcow2", &expected, "raw", false, "top vs model");
    assert_check_clean(&top, "top after the export");
    assert_check_clean(&mid, "mid after the export");
    assert_eq!(
        [file_hash(&base), file_hash(&mid), file_hash(&decoy)],
        hashes,
        "[base, mid, decoy] must be unchanged"
    );
}

/// `--backing` replaces the chain the headers name: the top image's header names a file that
/// does not exist, the mid image's header names a decoy, and the chain given on the command line
/// (qcow2 mid, then raw base) is what the export serves, as QEMU serves it with the same chain
/// given as nodes; writes land in the top image only. `--backing none` serves the top image
/// alone. Mistakes in the chain are refused in one line, before anything is mounted.
#[test]
fn a_backing_chain_given_on_the_command_line_replaces_the_headers() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-backing-arg");
    let size = 8 * MIB;
    let base = w.join("base.raw");
    let decoy = w.join("decoy.raw");
    random_image(&base, size, 311);
    let mut decoy_model = random_image(&decoy, size, 312);
    create_overlay(
        w.path(),
        "mid.qcow2",
        "decoy.raw",
        "raw",
        "cluster_size=65536",
    );
    let mid = w.join("mid.qcow2");
    qemu_io(
        &mid,
        "qcow2",
        &mut decoy_model,
        &[Qio::Pattern(MIB, 100_000, 0x5c)],
    );
    create_overlay(
        w.path(),
        "top.qcow2",
        "mid.qcow2",
        "qcow2",
        "cluster_size=4096",
    );
    let top = w.join("top.qcow2");
    qemu_io(
        &top,
        "qcow2",
        &mut decoy_model,
        &[Qio::Pattern(5 * MIB, 8192, 0x6d)],
    );
    run_ok(
        qemu_img(w.path())
            .args(["rebase", "-q", "-u", "-b", "gone.qcow2", "-F", "qcow2"])
            .arg(&top),
    );
    // QEMU with the same chain given explicitly is the oracle.
    let json_of = |backing: &str| {
        format!(
            r#"json:{{"driver":"qcow2","file":{{"driver":"file","filename":"{}"}},"backing":{backing}}}"#,
            top.display()
        )
    };
    let chain = format!(
        r#"{{"driver":"qcow2","file":{{"driver":"file","filename":"{}"}},"backing":{{"driver":"raw","file":{{"driver":"file","filename":"{}"}}}}}}"#,
        mid.display(),
        base.display()
    );
    let expected = w.join("expected.raw");
    run_ok(
        qemu_img(w.path())
            .args(["convert", "-U", "-O", "raw", &json_of(&chain)])
            .arg(&expected),
    );
    let mut model = fs::read(&expected).unwrap();
    let hashes = [file_hash(&base), file_hash(&mid), file_hash(&decoy)];

    let mid_arg = format!("--backing=qcow2:{}", mid.display());
    let base_arg = format!("--backing=raw:{}", base.display());
    let m = Mount::start(
        &w,
        &top,
        &w.join("export"),
        &["--writable", &mid_arg, &base_arg],
    );
    assert_bytes_eq(
        &read_all(m.path()),
        &model,
        0,
        "the chain given by --backing",
    );
    let f = m.open_rw();
    let fd = open_rw_direct(m.path());
    let mut rng = Rng::new(313);
    for op in [
        Op::Write(MIB + 4000, 9000),
        Op::DirectWrite(6 * MIB, 64 * KIB),
        Op::Punch(2 * MIB, 64 * KIB),
        Op::Write(size - 100, 100),
    ] {
        apply(op, &f, &fd, &mut model, &mut rng, "--backing chain");
    }
    f.sync_all().expect("fsync");
    assert_bytes_eq(
        &read_all(m.path()),
        &model,
        0,
        "--backing chain after writes",
    );
    drop((f, fd));
    m.stop().assert_clean("--backing export");
    write_file(&expected, &model);
    let after = w.join("after.raw");
    run_ok(
        qemu_img(w.path())
            .args(["convert", "-U", "-O", "raw", &json_of(&chain)])
            .arg(&after),
    );
    assert_eq!(
        file_hash(&after),
        file_hash(&expected),
        "QEMU reads the writes through the same chain"
    );
    assert_eq!(
        [file_hash(&base), file_hash(&mid), file_hash(&decoy)],
        hashes,
        "[base, mid, decoy] must be unchanged"
    );
    // qemu-img check opens the chain the header names: give it one that exists.
    run_ok(
        qemu_img(w.path())
            .args(["rebase", "-q", "-u", "-b", "mid.qcow2", "-F", "qcow2"])
            .arg(&top),
    );
    assert_check_clean(&top, "top after the export");

    // --backing none: the top image alone, zeroes where it has no data.
    let alone = w.join("alone.raw");
    run_ok(
        qemu_img(w.path())
            .args(["convert", "-U", "-O", "raw", &json_of("null")])
            .arg(&alone),
    );
    let m = Mount::start(&w, &top, &w.join("export"), &["--backing", "none"]);
    assert_bytes_eq(
        &read_all(m.path()),
        &fs::read(&alone).unwrap(),
        0,
        "--backing none",
    );
    m.stop().assert_clean("--backing none export");

    let raw_first = format!("--backing=raw:{}", base.display());
    for (what, args, problem) in [
        (
            "a raw level with one under it",
            vec![raw_first.as_str(), mid_arg.as_str()],
            &["only a qcow2 image has a backing image"][..],
        ),
        (
            "an unknown backing format",
            vec!["--backing=vmdk:/x"],
            &["give qcow2 or raw"][..],
        ),
        (
            "a level without a format",
            vec!["--backing=/x.qcow2"],
            &["names no format"][..],
        ),
        (
            "a missing backing file",
            vec!["--backing=raw:/nonexistent/b.raw"],
            &["/nonexistent/b.raw"][..],
        ),
    ] {
        expect_refused(&w, what, &args, &top, problem);
    }
    expect_refused(
        &w,
        "--backing on a raw image",
        &[&base_arg, "--format=raw"],
        &base,
        &["--backing is for qcow2 images"],
    );
}

/// Backing files are opened read-only: a writable export of an overlay whose base lies on a
/// read-only filesystem works, and the writes land in the overlay.
#[test]
fn backing_file_on_a_read_only_filesystem() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-backing-ro");
    let src = w.join("src");
    let ro = w.join("ro");
    fs::create_dir(&src).unwrap();
    fs::create_dir(&ro).unwrap();
    let size = 4 * MIB;
    let mut model = vec![0u8; size as usize];
    let base_src = src.join("base.qcow2");
    create_qcow2(&base_src, "", size);
    qemu_io(
        &base_src,
        "qcow2",
        &mut model,
        &[Qio::Pattern(0, 2 * MIB, 0x61)],
    );
    let bind = ReadOnlyBind::new(&src, &ro);
    assert!(
        OpenOptions::new()
            .write(true)
            .open(bind.target().join("base.qcow2"))
            .is_err(),
        "setup: the bind mount is not read-only"
    );
    create_overlay(w.path(), "overlay.qcow2", "ro/base.qcow2", "qcow2", "");
    let overlay = w.join("overlay.qcow2");
    let m = Mount::start(&w, &overlay, &w.join("export"), &["--writable"]);
    let f = m.open_rw();
    let fd = open_rw_direct(m.path());
    let mut rng = Rng::new(351);
    for op in [
        Op::Write(MIB + 3, 5000),
        Op::Punch(64 * KIB, 64 * KIB),
        Op::Write(3 * MIB, 4096),
    ] {
        apply(
            op,
            &f,
            &fd,
            &mut model,
            &mut rng,
            "overlay of a read-only base",
        );
    }
    f.sync_all().expect("fsync");
    assert_bytes_eq(
        &read_all(m.path()),
        &model,
        0,
        "overlay of a read-only base",
    );
    drop((f, fd));
    m.stop().assert_clean("overlay of a read-only base");
    let expected = w.join("expected.raw");
    write_file(&expected, &model);
    assert_qemu_identical(
        &overlay,
        "qcow2",
        &expected,
        "raw",
        false,
        "overlay vs model",
    );
    assert_check_clean(&overlay, "overlay of a read-only base");
}

// ---------------------------------------------------------------------------------------
// 3. Writes against a raw oracle
// ---------------------------------------------------------------------------------------

/// Edge cases around clusters, then random writes (buffered and O_DIRECT, 1 byte .. 1 MiB,
/// unaligned, many across cluster boundaries), discards, zero ranges and allocations on a sparse
/// writable qcow2. Checks each range right after the operation, the whole export at the end,
/// holes only where the model is zero; `qemu-img compare` of the export itself against the oracle
/// while mounted, of the image after fsync (still mounted: fsync makes data and metadata durable),
/// and after unmount with a clean `qemu-img check`; finally a read-only remount's SEEK_DATA /
/// SEEK_HOLE against `qemu-img map`.
fn write_workload(tag: &str, cluster: u64, size: u64, seed: u64, args: &[&str]) {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new(tag);
    let img = w.join("disk.qcow2");
    create_qcow2(&img, &format!("cluster_size={cluster}"), size);
    let mut model = vec![0u8; size as usize];
    let mut rng = Rng::new(seed);

    let c = cluster;
    let mut ops = vec![
        Op::Write(0, 1),
        Op::Write(c - 1, 2),
        Op::Write(3 * c, c),
        Op::Write(5 * c + 17, 2 * c),
        Op::Write(size - 1, 1),
        Op::Write(size - c - 3, c + 3),
        Op::DirectWrite(8 * c, 2 * c),
        Op::DirectWrite(12 * c, 4096),
        // Whole cluster, partial cluster, across clusters, never written.
        Op::Punch(3 * c, c),
        Op::Punch(5 * c + 100, c),
        Op::ZeroRange(8 * c + 1, 2 * c - 2),
        Op::Punch(40 * c + 7, 3 * c),
        Op::ZeroRange(50 * c, 2 * c),
        // Back into discarded clusters.
        Op::Write(3 * c + 10, 10),
        Op::Allocate(20 * c, 2 * c),
        Op::Allocate(5 * c, c),
    ];
    for _ in 0..220 {
        let kind = rng.below(100);
        let len = match rng.below(5) {
            0 => 1 + rng.below(512),
            1 => 512 + rng.below(8 * KIB),
            2 => c - 64 + rng.below(128),
            3 => 1 + rng.below(3 * c + 5000),
            _ => 1 + rng.below(MIB),
        }
        .min(size / 2);
        // Often start just before a cluster boundary so the range crosses it.
        let mut off = if rng.below(3) == 0 {
            let k = 1 + rng.below(size / c - 1);
            (k * c).saturating_sub(1 + rng.below(len.min(c)))
        } else {
            rng.below(size - len + 1)
        };
        off = off.min(size - len);
        ops.push(match kind {
            0..=54 => Op::Write(off, len),
            55..=64 => {
                let o = off / 4096 * 4096;
                let l = (len.div_ceil(4096) * 4096).min(size - o);
                Op::DirectWrite(o, l)
            }
            65..=79 => Op::Punch(off, len),
            80..=94 => Op::ZeroRange(off, len),
            _ => Op::Allocate(off, len),
        });
    }

    let m = Mount::start(
        &w,
        &img,
        &w.join("export"),
        &[&["--writable"], args].concat(),
    );
    let f = m.open_rw();
    let fd = open_rw_direct(m.path());
    assert_eq!(fstat(&f).0, size, "{tag}: st_size");
    for (i, op) in ops.iter().enumerate() {
        apply(
            *op,
            &f,
            &fd,
            &mut model,
            &mut rng,
            &format!("{tag} op #{i}"),
        );
        if i % 40 == 39 {
            let off = rng.below(size - MIB);
            assert_bytes_eq(
                &pread_full(&f, off, MIB as usize).unwrap(),
                &model[off as usize..(off + MIB) as usize],
                off,
                &format!("{tag}: random 1 MiB window after op #{i}"),
            );
        }
    }
    f.sync_all().expect("fsync of the export");
    assert_eq!(fstat(&f).0, size, "{tag}: st_size after the workload");
    assert_bytes_eq(
        &read_all(m.path()),
        &model,
        0,
        &format!("{tag}: whole export"),
    );
    // Holes read zeroes, so every hole SEEK_HOLE reports must be zero in the model.
    let data = seek_data(&f, size);
    let mut prev = 0;
    for &(d, h) in data.iter().chain([(size, size)].iter()) {
        if let Some(i) = model[prev as usize..d as usize]
            .iter()
            .position(|&b| b != 0)
        {
            panic!(
                "{tag}: offset {} holds data but lies in a hole [{prev}, {d}) per SEEK_DATA/SEEK_HOLE",
                prev + i as u64
            );
        }
        prev = h;
    }

    let oracle = w.join("oracle.raw");
    write_file(&oracle, &model);
    assert_qemu_identical(
        m.path(),
        "raw",
        &oracle,
        "raw",
        false,
        &format!("{tag}: mounted export vs oracle"),
    );
    assert_qemu_identical(
        &img,
        "qcow2",
        &oracle,
        "raw",
        true,
        &format!("{tag}: image vs oracle after fsync, still mounted"),
    );
    let (code, report, out) = qemu_check(&img, true);
    assert!(
        (code == 0 || code == 3) && count(&report, "corruptions") == 0,
        "{tag}: qemu-img check -U after fsync finds corruptions (exit {code}):\n{out}"
    );
    drop((f, fd));
    m.stop().assert_clean(tag);

    assert_eq!(virtual_size(&img), size, "{tag}: virtual size");
    assert_qemu_identical(
        &img,
        "qcow2",
        &oracle,
        "raw",
        false,
        &format!("{tag}: image vs oracle after unmount"),
    );
    assert_check_clean(&img, &format!("{tag}: after unmount"));

    let (map, _) = qemu_map_data(&img);
    let m = Mount::start(&w, &img, &w.join("export"), &[]);
    let f = m.open_ro();
    assert_ranges_eq(
        &seek_data(&f, size),
        &map,
        &format!("{tag}: read-only remount"),
    );
    assert_bytes_eq(&read_all(m.path()), &model, 0, &format!("{tag}: remount"));
    drop(f);
    m.stop().assert_clean(&format!("{tag}: remount"));
}

#[test]
fn writes_discards_zeroes_match_oracle_64k_clusters() {
    write_workload("q-wr-64k", 64 * KIB, 32 * MIB, 401, &[]);
}

#[test]
fn writes_discards_zeroes_match_oracle_4k_clusters() {
    write_workload("q-wr-4k", 4 * KIB, 16 * MIB, 402, &[]);
}

/// The smallest metadata caches a user can ask for (QEMU's `l2-cache-size` and
/// `refcount-cache-size`, here 0: two tables each) serve the same workload: the image's 8 L2
/// tables and its refcount blocks are evicted and read again throughout. The log says what the
/// caches hold.
#[test]
fn writes_through_two_table_caches_match_oracle() {
    let args = ["--l2-cache-size", "0", "--refcount-cache-size", "0"];
    write_workload("q-wr-small-cache", 4 * KIB, 16 * MIB, 403, &args);
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-small-cache-log");
    let img = w.join("disk.qcow2");
    create_qcow2(&img, "cluster_size=4096", 16 * MIB);
    let m = Mount::start(&w, &img, &w.join("export"), &args);
    assert!(
        m.stderr()
            .contains("qcow2 metadata caches: 2 L2 tables and 2 refcount blocks of 4 KiB"),
        "{}",
        m.stderr()
    );
    m.stop().assert_clean("two-table caches");
    let raw = w.join("disk.raw");
    write_file(&raw, &[0u8; 4096]);
    for (what, image, extra) in [
        ("cache sizes on a raw image", &raw, &[][..]),
        (
            "cache sizes on a qcow2 image served raw",
            &img,
            &["--format=raw"][..],
        ),
    ] {
        expect_refused(
            &w,
            what,
            &[&args[..], extra].concat(),
            image,
            &[
                "--l2-cache-size, --refcount-cache-size and --cache-clean-interval are for qcow2 \
               images",
            ],
        );
    }
}

/// Nothing but the end of the daemon flushes: writes (allocating clusters) without any fsync,
/// then SIGTERM; then more writes and an external `umount`. After each, qemu-img finds the image
/// identical to the model and clean.
#[test]
fn exit_flushes_without_fsync() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-exit-flush");
    let img = w.join("disk.qcow2");
    let size = 16 * MIB;
    create_qcow2(&img, "cluster_size=4096", size);
    let mut model = vec![0u8; size as usize];
    let expected = w.join("expected.raw");
    let mp = w.join("export");
    let mut rng = Rng::new(451);
    for round in ["SIGTERM", "umount"] {
        let m = Mount::start(&w, &img, &mp, &["--writable"]);
        let f = m.open_rw();
        let fd = open_rw_direct(m.path());
        for _ in 0..60 {
            let len = 1 + rng.below(40 * KIB);
            let off = rng.below(size - len);
            let op = match rng.below(6) {
                0 => Op::Punch(off, len),
                1 => Op::ZeroRange(off, len),
                _ => Op::Write(off, len),
            };
            apply(op, &f, &fd, &mut model, &mut rng, round);
        }
        drop((f, fd));
        let st = if round == "SIGTERM" {
            m.stop()
        } else {
            umount_idle(&mp);
            m.wait_exit()
        };
        st.assert_clean(round);
        write_file(&expected, &model);
        assert_qemu_identical(
            &img,
            "qcow2",
            &expected,
            "raw",
            false,
            &format!("image vs model after {round} without fsync"),
        );
        assert_check_clean(&img, &format!("after {round} without fsync"));
    }
}

// ---------------------------------------------------------------------------------------
// 4. SEEK_DATA / SEEK_HOLE vs qemu-img map
// ---------------------------------------------------------------------------------------

/// A sparse image with a few written clusters (and zero clusters, allocated and not): the export's
/// data ranges are qemu-img map's, st_blocks is small but not zero; after writes and discards
/// through a writable export they still agree.
#[test]
fn seek_matches_qemu_map_sparse_image() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-map-sparse");
    let img = w.join("disk.qcow2");
    let size = 32 * MIB;
    create_qcow2(&img, "", size);
    let mut model = vec![0u8; size as usize];
    qemu_io(
        &img,
        "qcow2",
        &mut model,
        &[
            Qio::Pattern(0, 4096, 1),
            Qio::Pattern(MIB + 10, 100, 2),
            Qio::Pattern(5 * MIB, 200 * KIB, 3),
            Qio::Pattern(size - 512, 512, 4),
            // Allocated, then zeroed: a zero cluster (with or without its allocation).
            Qio::Pattern(20 * MIB, 128 * KIB, 5),
            Qio::Zero(20 * MIB, 64 * KIB),
            // Zero clusters where nothing was allocated.
            Qio::Zero(24 * MIB, 256 * KIB),
        ],
    );
    let (map, _) = qemu_map_data(&img);
    assert!(map.len() >= 4, "setup: map {}", fmt_ranges(&map));

    let m = Mount::start(&w, &img, &w.join("export"), &[]);
    let f = m.open_ro();
    assert_ranges_eq(&seek_data(&f, size), &map, "sparse image");
    let (st_size, blocks) = fstat(&f);
    assert_eq!(st_size, size);
    assert!(
        blocks > 0 && blocks * 512 < size / 4,
        "st_blocks {blocks} of a sparse image with ~600 KiB of data (size {size})"
    );
    assert_bytes_eq(&read_all(m.path()), &model, 0, "sparse image content");
    drop(f);
    m.stop().assert_clean("sparse image, read-only");

    let m = Mount::start(&w, &img, &w.join("export"), &["--writable"]);
    let f = m.open_rw();
    let fd = open_rw_direct(m.path());
    let mut rng = Rng::new(501);
    for op in [
        Op::Write(10 * MIB + 5, 10),
        Op::DirectWrite(12 * MIB, 192 * KIB),
        Op::Punch(5 * MIB, 128 * KIB),
        Op::Punch(0, 64 * KIB),
    ] {
        apply(op, &f, &fd, &mut model, &mut rng, "sparse image, writable");
    }
    f.sync_all().expect("fsync");
    let seek = seek_data(&f, size);
    drop((f, fd));
    m.stop().assert_clean("sparse image, writable");
    let (map, _) = qemu_map_data(&img);
    assert_ranges_eq(&seek, &map, "sparse image after writes and discards");
    let expected = w.join("expected.raw");
    write_file(&expected, &model);
    assert_qemu_identical(
        &img,
        "qcow2",
        &expected,
        "raw",
        false,
        "sparse image vs model",
    );
    assert_check_clean(&img, "sparse image after the writable export");
}

/// An overlay whose data lies mostly in its (sparse qcow2) backing file: clusters allocated in
/// the backing file count as data, zero clusters in the overlay hide backing data (holes).
#[test]
fn seek_matches_qemu_map_overlay_with_backing_data() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-map-overlay");
    let size = 16 * MIB;
    let base = w.join("base.qcow2");
    create_qcow2(&base, "", size);
    let mut model = vec![0u8; size as usize];
    qemu_io(
        &base,
        "qcow2",
        &mut model,
        &[
            Qio::Pattern(MIB, 64 * KIB, 0x10),
            Qio::Pattern(4 * MIB, 256 * KIB, 0x20),
            Qio::Pattern(9 * MIB + 100, 10, 0x30),
            Qio::Pattern(size - 64 * KIB, 64 * KIB, 0x40),
        ],
    );
    create_overlay(w.path(), "overlay.qcow2", "base.qcow2", "qcow2", "");
    let overlay = w.join("overlay.qcow2");
    qemu_io(
        &overlay,
        "qcow2",
        &mut model,
        &[
            Qio::Pattern(2 * MIB, 4096, 0x50),
            // A zero cluster over base data.
            Qio::Zero(4 * MIB + 64 * KIB, 64 * KIB),
            // A partial write into a base cluster (copied up into the overlay).
            Qio::Pattern(9 * MIB + 4096, 512, 0x60),
        ],
    );
    let (map, from_backing) = qemu_map_data(&overlay);
    assert!(
        from_backing,
        "setup: no data in the backing file per qemu-img map"
    );

    let m = Mount::start(&w, &overlay, &w.join("export"), &[]);
    let f = m.open_ro();
    assert_ranges_eq(&seek_data(&f, size), &map, "overlay");
    assert_bytes_eq(&read_all(m.path()), &model, 0, "overlay content");
    drop(f);
    m.stop().assert_clean("overlay, read-only");
}

// ---------------------------------------------------------------------------------------
// 5. Concurrent verified writers
// ---------------------------------------------------------------------------------------

/// Two queues, a sparse 32 MiB image (every first write to a cluster allocates it, from several
/// requests at once): 2 fio jobs of 4 KiB random writes, then 4 jobs with mixed block sizes
/// (half of them overwriting, half allocating), io_uring at depth 16, crc32c verified. Afterwards
/// the export, the image converted to raw by qemu-img, and `qemu-img check` agree.
#[test]
fn fio_verify_two_queues_on_sparse_image() {
    fio_verify_two_queues("q-fio", "", &[]);
}

/// The same with 4 KiB clusters and two-table metadata caches: table loads (which run without
/// the cache's lock) race evictions that write back tables other requests just changed, and
/// allocations that change both caches, from two queues at depth 16.
#[test]
fn fio_verify_two_queues_through_two_table_caches() {
    fio_verify_two_queues(
        "q-fio-small-cache",
        "cluster_size=4096",
        &["--l2-cache-size", "0", "--refcount-cache-size", "0"],
    );
}

fn fio_verify_two_queues(tag: &str, opts: &str, args: &[&str]) {
    if !require_fuse_and_tools(&["qemu-img", "qemu-io", "fio"]) {
        return;
    }
    let w = WorkDir::new(tag);
    let img = w.join("disk.qcow2");
    let size = 32 * MIB;
    create_qcow2(&img, opts, size);
    let mp = w.join("export");
    let m = Mount::start(
        &w,
        &img,
        &mp,
        &[&["--writable", "--queues", "2"], args].concat(),
    );
    let common = [
        "--rw=randwrite",
        "--ioengine=io_uring",
        "--iodepth=16",
        "--size=8M",
        "--offset_increment=8M",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
    ];
    let mut a = vec!["--name=rand4k", "--bs=4k", "--numjobs=2"];
    a.extend_from_slice(&common);
    run_fio(&w, &mp, &a);
    let mut b = vec![
        "--name=mixed",
        "--bssplit=512/10:4k/30:12k/20:64k/25:192k/15",
        "--numjobs=4",
    ];
    b.extend_from_slice(&common);
    run_fio(&w, &mp, &b);
    let mount_hashes = chunk_hashes(&File::open(&mp).unwrap(), size, MIB as usize);
    let st = m.stop();
    st.assert_clean(tag);
    assert_check_clean(&img, &format!("{tag}: after fio"));
    let raw = w.join("converted.raw");
    run_ok(
        qemu_img(w.path())
            .args(["convert", "-f", "qcow2", "-O", "raw"])
            .arg(&img)
            .arg(&raw),
    );
    assert_eq!(
        chunk_hashes(&File::open(&raw).unwrap(), size, MIB as usize),
        mount_hashes,
        "1 MiB chunk hashes: qemu-img's view of the image vs the export's"
    );
}

/// Writers on two queues racing into the same clusters of an overlay: every cluster is first
/// written by several threads at once, each its own 4 KiB blocks of it, while the cluster's data
/// is still in the base. Copying a cluster from the base (fusex copies it ahead of imago, outside
/// imago's lock) must never bring back base bytes over a block another thread wrote: the export,
/// `qemu-img convert` of the overlay and the model agree on every byte, and `qemu-img check` is
/// clean.
#[test]
fn racing_writes_into_backed_clusters_lose_nothing() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-cow-race");
    let size = 8 * MIB;
    let base_src = w.join("base-src.raw");
    let mut model = mixed_content(size, 77);
    write_file(&base_src, &model);
    let base = w.join("base.qcow2");
    convert_to_qcow2(&base_src, &base, "", false);
    create_overlay(w.path(), "overlay.qcow2", "base.qcow2", "qcow2", "");
    let overlay = w.join("overlay.qcow2");
    let base_hash = file_hash(&base);

    let m = Mount::start(
        &w,
        &overlay,
        &w.join("export"),
        &["--writable", "--queues", "2"],
    );
    const THREADS: u64 = 8;
    let block = 4 * KIB;
    let cluster = 64 * KIB;
    // Each thread writes block t, t + 8 of every cluster, all threads cluster by cluster in the
    // same order, so they meet in each cluster while it is still backed.
    let mut plans = Vec::new();
    for t in 0..THREADS {
        let mut rng = Rng::new(1000 + t);
        let mut writes = Vec::new();
        for c in 0..size / cluster {
            for b in [t, t + THREADS] {
                let off = c * cluster + b * block;
                let data = rng.bytes(block as usize);
                model[off as usize..(off + block) as usize].copy_from_slice(&data);
                writes.push((off, data));
            }
        }
        plans.push(writes);
    }
    std::thread::scope(|s| {
        for writes in plans {
            let path = m.path().to_path_buf();
            s.spawn(move || {
                let f = open_rw_direct(&path);
                let mut buf = AlignedBuf::new(block as usize, 4096);
                for (off, data) in writes {
                    buf.as_mut_slice().copy_from_slice(&data);
                    f.write_all_at(buf.as_slice(), off)
                        .unwrap_or_else(|e| panic!("O_DIRECT write at {off}: {e}"));
                }
            });
        }
    });
    assert_bytes_eq(
        &read_all_direct(m.path()),
        &model,
        0,
        "export after racing writes",
    );
    let st = m.stop();
    st.assert_clean("racing writes into backed clusters");
    assert_check_clean(&overlay, "after racing writes");
    assert_bytes_eq(
        &qcow2_guest_bytes(&w, &overlay),
        &model,
        0,
        "qemu-img's view of the overlay",
    );
    assert_eq!(file_hash(&base), base_hash, "the base must stay untouched");
}

// ---------------------------------------------------------------------------------------
// 6. Growable
// ---------------------------------------------------------------------------------------

/// `--writable --growable`: ftruncate to a larger size and a write past EOF grow the export; the
/// new parts read zeroes and the written data; after unmount qemu-img reports the new virtual size
/// and the same bytes.
fn growable_case(tag: &str, opts: &str) {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new(tag);
    let img = w.join("disk.qcow2");
    let size = 8 * MIB;
    create_qcow2(&img, opts, size);
    let mut model = vec![0u8; size as usize];
    qemu_io(
        &img,
        "qcow2",
        &mut model,
        &[
            Qio::Pattern(0, 64 * KIB, 0x71),
            Qio::Pattern(size - 4096, 4096, 0x72),
        ],
    );
    let m = Mount::start(&w, &img, &w.join("export"), &["--writable", "--growable"]);
    let f = m.open_rw();

    let grown = 12 * MIB;
    f.set_len(grown)
        .expect("ftruncate to a larger size on a growable qcow2 export");
    assert_eq!(fstat(&f).0, grown, "st_size after ftruncate");
    model.resize(grown as usize, 0);
    assert_bytes_eq(
        &pread_full(&f, size - 4096, (grown - size + 8192) as usize).unwrap(),
        &model[(size - 4096) as usize..],
        size - 4096,
        "old tail and the grown part (zeroes)",
    );

    // A write that starts past EOF (leaving a gap) and ends on a 512-byte boundary.
    let off = 13 * MIB + 512;
    let data = Rng::new(601).bytes(64 * 1024 + 1024);
    f.write_all_at(&data, off)
        .expect("write past EOF on a growable qcow2 export");
    let end = off + data.len() as u64;
    assert_eq!(fstat(&f).0, end, "st_size after the growing write");
    model.resize(end as usize, 0);
    model[off as usize..].copy_from_slice(&data);
    // And one more write inside the grown area.
    let inner = Rng::new(602).bytes(3000);
    f.write_all_at(&inner, 10 * MIB - 1000).expect("pwrite");
    model[(10 * MIB - 1000) as usize..(10 * MIB + 2000) as usize].copy_from_slice(&inner);
    f.sync_all().expect("fsync");
    assert_bytes_eq(&read_all(m.path()), &model, 0, "grown export");
    // Shrinking a qcow2 is refused (EOPNOTSUPP) and changes nothing.
    assert_errno(
        f.set_len(size / 2),
        &[libc::EOPNOTSUPP],
        "ftruncate to a smaller size on a growable qcow2 export",
    );
    assert_eq!(fstat(&f).0, end, "st_size after the refused shrink");
    drop(f);
    m.stop().assert_clean("growable qcow2");

    assert_eq!(
        virtual_size(&img),
        end,
        "qemu-img info virtual-size after growing"
    );
    let expected = w.join("expected.raw");
    write_file(&expected, &model);
    assert_qemu_identical(
        &img,
        "qcow2",
        &expected,
        "raw",
        false,
        "grown image vs model",
    );
    assert_check_clean(&img, "after growing");
}

#[test]
fn growable_export_grows_the_virtual_size() {
    growable_case("q-grow-64k", "");
}

/// 512-byte clusters: an L2 table maps 32 KiB and an L1 cluster 2 MiB, so growing an 8 MiB image
/// to 13+ MiB needs a larger L1 table than the one the image has.
#[test]
fn growable_export_grows_the_l1_table() {
    growable_case("q-grow-512", "cluster_size=512");
}

/// Without `--growable` the qcow2 export's size is fixed: ftruncate is refused and the image's
/// virtual size stays.
#[test]
fn fixed_size_qcow2_export_refuses_resize() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-fixed");
    let img = w.join("disk.qcow2");
    let size = 4 * MIB;
    create_qcow2(&img, "", size);
    let m = Mount::start(&w, &img, &w.join("export"), &["--writable"]);
    let f = m.open_rw();
    assert_errno(
        f.set_len(2 * size),
        &[libc::EPERM, libc::EOPNOTSUPP, libc::EFBIG],
        "ftruncate up on a fixed-size qcow2 export",
    );
    assert_eq!(fstat(&f).0, size);
    drop(f);
    m.stop().assert_clean("fixed-size qcow2");
    assert_eq!(virtual_size(&img), size);
    assert_check_clean(&img, "fixed-size qcow2");
}

/// A 64 TiB sparse image: it mounts quickly, and data written at 0, past 4 TiB (L1 index past
/// 2^13, offsets past 2^42) and in the last cluster reads back through the export, lands where
/// qemu-io finds it, and shows in SEEK_DATA; nothing else is data.
#[test]
fn large_sparse_image_far_offsets() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-large");
    let img = w.join("disk.qcow2");
    let size = 64 << 40;
    create_qcow2(&img, "", size);
    let m = Mount::start(&w, &img, &w.join("export"), &["--writable"]);
    let f = m.open_rw();
    assert_eq!(fstat(&f).0, size, "st_size of a 64 TiB image");
    assert_eq!(
        lseek(&f, 0, libc::SEEK_DATA).map_err(errno_str),
        Err(errno_str(libc::ENXIO)),
        "an empty image holds no data"
    );
    let writes = [
        (0u64, 4096usize, 0xa1u8),
        ((5u64 << 40) + 123, 70_000, 0xa2),
        (size - 4096, 4096, 0xa3),
    ];
    for &(off, len, pat) in &writes {
        f.write_all_at(&vec![pat; len], off)
            .unwrap_or_else(|e| panic!("pwrite {off}+{len}: {e}"));
    }
    f.sync_all().expect("fsync");
    for &(off, len, pat) in &writes {
        let back = pread_full(&f, off.saturating_sub(10), len + 20).unwrap();
        let lead = (off - off.saturating_sub(10)) as usize;
        assert!(
            back[lead..lead + len].iter().all(|&b| b == pat),
            "read back at {off}+{len}"
        );
        assert!(
            back[..lead]
                .iter()
                .chain(&back[lead + len..])
                .all(|&b| b == 0),
            "around {off}+{len} must stay zero"
        );
    }
    let cl = 64 * KIB;
    assert_eq!(
        seek_data(&f, size),
        vec![
            (0, cl),
            (
                ((5 << 40) + 123) / cl * cl,
                ((5 << 40) + 123 + 70_000u64).div_ceil(cl) * cl
            ),
            (size - cl, size),
        ],
        "data ranges"
    );
    drop(f);
    m.stop().assert_clean("64 TiB image");
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "qcow2"]);
    for &(off, len, pat) in &writes {
        cmd.arg("-c").arg(format!("read -P {pat} {off} {len}"));
    }
    let out = run_ok(cmd.arg(&img));
    let t = text(&out);
    assert!(
        !t.contains("Pattern verification failed") && t.matches("read ").count() >= writes.len(),
        "qemu-io does not find the data where it was written:\n{t}"
    );
    assert_check_clean(&img, "64 TiB image");
}

// ---------------------------------------------------------------------------------------
// 7. --format
// ---------------------------------------------------------------------------------------

/// `--format raw` never probes: a raw file that starts with the qcow2 magic followed by garbage is
/// served as itself, and so is a real qcow2 file. `--format auto` (the default) serves a qcow2 as
/// its guest bytes and says so in its log; on the magic-plus-garbage file it either serves the raw
/// bytes or refuses with one line, never panics. `null:SIZE` is unaffected.
#[test]
fn format_raw_never_probes_and_auto_detects_qcow2() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-format");
    let fake = w.join("fake.img");
    let mut fake_data = Rng::new(701).bytes(4 * MIB as usize);
    fake_data[..4].copy_from_slice(b"QFI\xfb");
    write_file(&fake, &fake_data);
    let mp = w.join("export");

    let m = Mount::start(&w, &fake, &mp, &["--format", "raw"]);
    assert_eq!(fstat(&m.open_ro()).0, 4 * MIB);
    assert_bytes_eq(
        &read_all(m.path()),
        &fake_data,
        0,
        "--format raw on a file starting with QFI\\xfb",
    );
    m.stop().assert_clean("--format raw, fake magic");

    let m = Mount::start(&w, &fake, &mp, &["--format", "raw", "--writable"]);
    let f = m.open_rw();
    f.write_all_at(b"raw!", 0).expect("write over the magic");
    fake_data[..4].copy_from_slice(b"raw!");
    assert_bytes_eq(
        &read_all(m.path()),
        &fake_data,
        0,
        "after writing over the magic",
    );
    drop(f);
    m.stop().assert_clean("--format raw --writable, fake magic");
    assert_bytes_eq(
        &read_all(&fake),
        &fake_data,
        0,
        "raw file after the writable export",
    );
    fake_data[..4].copy_from_slice(b"QFI\xfb");
    write_file(&fake, &fake_data);

    match Mount::try_start(&w, &fake, &mp, &[]) {
        Ok(m) => {
            assert_bytes_eq(
                &read_all(m.path()),
                &fake_data,
                0,
                "--format auto served the fake-magic file, so as raw",
            );
            let st = m.stop();
            assert!(!st.stderr.contains("panicked"), "{}", st.stderr);
            st.assert_clean("--format auto on fake magic");
        }
        Err(f) => {
            assert_refusal(
                f.code,
                &f.stdout,
                &f.stderr,
                "--format auto on a raw file with the qcow2 magic and garbage",
            );
            assert!(!is_fuse_mounted(&mp));
            assert!(!mp.exists(), "mountpoint left behind");
        }
    }

    let src = w.join("src.raw");
    let data = mixed_content(4 * MIB, 702);
    write_file(&src, &data);
    // No "qcow2" in the name: the log must say it, not just echo the path.
    let img = w.join("guest.img");
    convert_to_qcow2(&src, &img, "", false);
    let m = Mount::start(&w, &img, &mp, &[]);
    assert_eq!(
        fstat(&m.open_ro()).0,
        4 * MIB,
        "auto: st_size is the virtual size"
    );
    assert_bytes_eq(&read_all(m.path()), &data, 0, "--format auto on a qcow2");
    let st = m.stop();
    st.assert_clean("--format auto on a qcow2");
    assert!(
        st.stderr.to_lowercase().contains("qcow2"),
        "--format auto should log the format it chose:\n{}",
        st.stderr
    );

    let qcow2_bytes = read_all(&img);
    let m = Mount::start(&w, &img, &mp, &["--format", "raw"]);
    assert_bytes_eq(
        &read_all(m.path()),
        &qcow2_bytes,
        0,
        "--format raw on a qcow2 file: the file's own bytes",
    );
    m.stop().assert_clean("--format raw on a qcow2");

    let m = Mount::start(&w, "null:8M", &mp, &[]);
    let back = read_all(m.path());
    assert_eq!(back.len() as u64, 8 * MIB, "null:8M size");
    assert!(back.iter().all(|&b| b == 0), "null:8M reads zeroes");
    m.stop().assert_clean("null:8M with --format auto");
}

// ---------------------------------------------------------------------------------------
// 8. Corrupt and unsupported images
// ---------------------------------------------------------------------------------------

fn small_qcow2(w: &WorkDir, name: &str) -> PathBuf {
    let img = w.join(name);
    create_qcow2(&img, "", 4 * MIB);
    let mut model = vec![0u8; 4 * MIB as usize];
    qemu_io(
        &img,
        "qcow2",
        &mut model,
        &[Qio::Pattern(MIB, 64 * KIB, 0x42)],
    );
    img
}

#[test]
fn refuses_format_qcow2_on_a_raw_file() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-bad-magic");
    let raw = w.join("plain.img");
    random_image(&raw, MIB, 801);
    expect_refused(
        &w,
        "--format qcow2 on a raw file",
        &["--format", "qcow2"],
        &raw,
        &["magic", "qcow2"],
    );
    let zero = w.join("zero.img");
    sparse_image(&zero, MIB);
    expect_refused(
        &w,
        "--format qcow2 on an all-zero file",
        &["--format", "qcow2"],
        &zero,
        &["magic", "qcow2"],
    );
}

#[test]
fn refuses_unknown_incompatible_feature() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-bad-feature");
    let img = small_qcow2(&w, "feature.qcow2");
    patch(&img, H_INCOMPATIBLE, &be64(1 << 40));
    for args in [&[][..], &["--format", "qcow2"][..], &["--writable"][..]] {
        expect_refused(
            &w,
            &format!("incompatible feature bit 40, args {args:?}"),
            args,
            &img,
            &["incompatible", "feature", "unsupported", "unknown"],
        );
    }
}

#[test]
fn refuses_encrypted_images() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-bad-crypt");
    let plain = small_qcow2(&w, "plain.qcow2");
    let mut cases = Vec::new();
    for method in [1u32, 2] {
        let img = w.join(format!("crypt{method}.qcow2"));
        mutated_copy(&plain, &img, &[(H_CRYPT_METHOD, be32(method))]);
        cases.push((
            format!("crypt_method {method} patched into a plain image"),
            img,
            &[][..],
        ));
    }
    let luks = w.join("luks.qcow2");
    // qemu-img times its key derivation in CPU time and gives up ("Unable to get accurate CPU
    // usage") when a loaded machine ran it too little to measure: try again then.
    let mut tries = 0;
    loop {
        let out = run(qemu_img(w.path())
            .args([
                "create",
                "-q",
                "-f",
                "qcow2",
                "--object",
                "secret,id=sec0,data=fusex-test",
                "-o",
                "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10",
            ])
            .arg(&luks)
            .arg("1M"));
        if out.status.success() {
            break;
        }
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        tries += 1;
        assert!(
            err.contains("accurate CPU usage") && tries < 10,
            "qemu-img create (LUKS), try {tries}: {err}"
        );
    }
    cases.push((
        "LUKS-encrypted qcow2 (qemu-img create)".to_string(),
        luks,
        &["--format", "qcow2"][..],
    ));
    every_case(
        cases,
        |c| c.0.clone(),
        |(what, img, args)| expect_refused(&w, &what, args, &img, &["encrypt", "crypt", "luks"]),
    );
}

#[test]
fn refuses_truncated_header() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-bad-trunc");
    let full = small_qcow2(&w, "full.qcow2");
    let bytes = read_all(&full);
    let problem = &[
        "truncat",
        "short",
        "header",
        "end of file",
        "eof",
        "too small",
        "unexpected end",
    ][..];
    for n in [50usize, 71, 103] {
        let img = w.join(format!("trunc{n}.qcow2"));
        write_file(&img, &bytes[..n]);
        expect_refused(
            &w,
            &format!("first {n} bytes of a qcow2"),
            &[],
            &img,
            problem,
        );
        expect_refused(
            &w,
            &format!("first {n} bytes of a qcow2, --format qcow2"),
            &["--format", "qcow2"],
            &img,
            problem,
        );
    }
}

#[test]
fn refuses_backing_loops() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-bad-loop");
    let problem = &[
        "loop", "cycle", "circular", "recurs", "depth", "deep", "chain", "twice",
    ][..];
    // a -> b -> a
    create_qcow2(&w.join("b.qcow2"), "", MIB);
    create_overlay(w.path(), "a.qcow2", "b.qcow2", "qcow2", "");
    run_ok(qemu_img(w.path()).args([
        "rebase", "-u", "-f", "qcow2", "-b", "a.qcow2", "-F", "qcow2", "b.qcow2",
    ]));
    assert_eq!(
        qemu_info(&w.join("b.qcow2"))["backing-filename"].as_str(),
        Some("a.qcow2"),
        "setup: b.qcow2 must name a.qcow2"
    );
    expect_refused(
        &w,
        "backing loop a -> b -> a",
        &[],
        &w.join("a.qcow2"),
        problem,
    );
    expect_refused(
        &w,
        "backing loop a -> b -> a, writable",
        &["--writable"],
        &w.join("a.qcow2"),
        problem,
    );
    // self -> self, named through another spelling of the same path
    create_qcow2(&w.join("self.qcow2"), "", MIB);
    run_ok(qemu_img(w.path()).args([
        "rebase",
        "-u",
        "-f",
        "qcow2",
        "-b",
        "./self.qcow2",
        "-F",
        "qcow2",
        "self.qcow2",
    ]));
    expect_refused(
        &w,
        "image backed by itself",
        &[],
        &w.join("self.qcow2"),
        problem,
    );
}

#[test]
fn no_backing_refuses_images_with_a_backing_file() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-no-backing");
    let _base = small_qcow2(&w, "base.qcow2");
    create_overlay(w.path(), "overlay.qcow2", "base.qcow2", "qcow2", "");
    expect_refused(
        &w,
        "--no-backing on an overlay",
        &["--no-backing"],
        &w.join("overlay.qcow2"),
        &["backing"],
    );
    // The same image mounts without the flag, and a standalone image mounts with it.
    let m = Mount::start(&w, w.join("overlay.qcow2"), &w.join("export"), &[]);
    m.stop().assert_clean("overlay without --no-backing");
    let m = Mount::start(
        &w,
        w.join("base.qcow2"),
        &w.join("export"),
        &["--no-backing"],
    );
    assert_eq!(
        pread_full(&m.open_ro(), MIB, 4).unwrap(),
        vec![0x42; 4],
        "--no-backing on an image without a backing file"
    );
    m.stop().assert_clean("standalone image with --no-backing");
}

#[test]
fn refuses_missing_backing_file() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-missing-backing");
    let _gone = small_qcow2(&w, "gone.qcow2");
    create_overlay(w.path(), "overlay.qcow2", "gone.qcow2", "qcow2", "");
    fs::remove_file(w.join("gone.qcow2")).unwrap();
    // A missing backing file two levels down.
    let _gone2 = small_qcow2(&w, "gone2.qcow2");
    create_overlay(w.path(), "mid.qcow2", "gone2.qcow2", "qcow2", "");
    create_overlay(w.path(), "top.qcow2", "mid.qcow2", "qcow2", "");
    fs::remove_file(w.join("gone2.qcow2")).unwrap();
    every_case(
        [
            (
                "overlay whose backing file is missing",
                "overlay.qcow2",
                &[][..],
                "gone.qcow2",
            ),
            (
                "chain whose bottom file is missing",
                "top.qcow2",
                &["--writable"][..],
                "gone2.qcow2",
            ),
        ],
        |c| c.0.to_string(),
        |(what, img, args, missing)| expect_refused(&w, what, args, &w.join(img), &[missing]),
    );
}

/// Header fields with out-of-range or inconsistent values, one at a time: fusex refuses the image
/// with one line, or serves it; it never panics, never hangs, and when it serves it survives
/// reads at the start, the middle and the end (errors allowed) and stops cleanly.
#[test]
fn mutated_headers_never_panic() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-mutate");
    let good = small_qcow2(&w, "good.qcow2");
    let l1 = read_be64(&good, H_L1_OFFSET);
    let hlen = read_be32(&good, H_HEADER_LENGTH) as u64;
    let cases: Vec<(&str, Vec<Patch>)> = vec![
        ("version 1", vec![(H_VERSION, be32(1))]),
        ("version 4", vec![(H_VERSION, be32(4))]),
        ("cluster_bits 0", vec![(H_CLUSTER_BITS, be32(0))]),
        ("cluster_bits 8", vec![(H_CLUSTER_BITS, be32(8))]),
        ("cluster_bits 22", vec![(H_CLUSTER_BITS, be32(22))]),
        ("cluster_bits 63", vec![(H_CLUSTER_BITS, be32(63))]),
        (
            "cluster_bits 2^32-1",
            vec![(H_CLUSTER_BITS, be32(u32::MAX))],
        ),
        ("size 2^64-1", vec![(H_SIZE, be64(u64::MAX))]),
        ("size 2^62", vec![(H_SIZE, be64(1 << 62))]),
        ("size 1 TiB, L1 unchanged", vec![(H_SIZE, be64(1 << 40))]),
        ("size 0", vec![(H_SIZE, be64(0))]),
        ("size 1000", vec![(H_SIZE, be64(1000))]),
        ("l1_size 2^32-1", vec![(H_L1_SIZE, be32(u32::MAX))]),
        ("l1_size 0", vec![(H_L1_SIZE, be32(0))]),
        (
            "l1_table_offset past EOF",
            vec![(H_L1_OFFSET, be64(1 << 50))],
        ),
        (
            "l1_table_offset misaligned",
            vec![(H_L1_OFFSET, be64(l1 + 8))],
        ),
        (
            "l1_table_offset 2^64-512",
            vec![(H_L1_OFFSET, be64(u64::MAX - 511))],
        ),
        (
            "l1_table_offset 0 (the header)",
            vec![(H_L1_OFFSET, be64(0))],
        ),
        (
            "refcount_table_offset past EOF",
            vec![(H_REFCOUNT_OFFSET, be64(1 << 50))],
        ),
        (
            "refcount_table_clusters 2^32-1",
            vec![(H_REFCOUNT_CLUSTERS, be32(u32::MAX))],
        ),
        (
            "nb_snapshots 2^32-1 at a bogus offset",
            vec![
                (H_NB_SNAPSHOTS, be32(u32::MAX)),
                (H_SNAPSHOTS_OFFSET, be64(1 << 50)),
            ],
        ),
        ("refcount_order 7", vec![(H_REFCOUNT_ORDER, be32(7))]),
        (
            "refcount_order 2^32-1",
            vec![(H_REFCOUNT_ORDER, be32(u32::MAX))],
        ),
        ("header_length 0", vec![(H_HEADER_LENGTH, be32(0))]),
        (
            "header_length 2^32-1",
            vec![(H_HEADER_LENGTH, be32(u32::MAX))],
        ),
        (
            "backing name past EOF",
            vec![
                (H_BACKING_OFFSET, be64(1 << 40)),
                (H_BACKING_SIZE, be32(16)),
            ],
        ),
        (
            "backing name 2^32-1 bytes long",
            vec![
                (H_BACKING_OFFSET, be64(512)),
                (H_BACKING_SIZE, be32(u32::MAX)),
            ],
        ),
        (
            "backing name of zero bytes at offset 0",
            vec![(H_BACKING_OFFSET, be64(0)), (H_BACKING_SIZE, be32(0))],
        ),
        (
            "header extension of length 2^32-16",
            vec![(hlen, be32(0x6803_f857)), (hlen + 4, be32(0xffff_fff0))],
        ),
        ("dirty bit", vec![(H_INCOMPATIBLE, be64(1))]),
        ("corrupt bit", vec![(H_INCOMPATIBLE, be64(2))]),
    ];
    let mut items = Vec::new();
    for (i, (what, patches)) in cases.iter().enumerate() {
        let img = w.join(format!("mut{i}.qcow2"));
        mutated_copy(&good, &img, patches);
        for (j, args) in [&["--format", "qcow2"][..], &["--writable"][..]]
            .into_iter()
            .enumerate()
        {
            items.push((
                format!("{what} {args:?}"),
                img.clone(),
                args,
                w.join(format!("export-{i}-{j}")),
            ));
        }
    }
    every_case(
        items,
        |c| c.0.clone(),
        |(what, img, args, mp)| match Mount::try_start(&w, &img, &mp, args) {
            Err(f) => {
                eprintln!("{what}: refused: {}", f.stderr.trim_end());
                assert_refusal(f.code, &f.stdout, &f.stderr, &what);
                assert!(!is_fuse_mounted(&mp), "{what}: left mounted");
                assert!(!mp.exists(), "{what}: mountpoint left behind");
            }
            Ok(m) => {
                eprintln!("{what}: served");
                let f = m.open_ro();
                let size = fstat(&f).0;
                for off in [0, MIB, size / 2, size.saturating_sub(4096)] {
                    if let Err(e) = pread_full(&f, off.min(i64::MAX as u64 - 8192), 4096) {
                        assert!(
                            ![libc::ENOTCONN, libc::ECONNABORTED, libc::ECANCELED]
                                .contains(&errno(&e)),
                            "{what}: the daemon died reading at {off}: {e}"
                        );
                    }
                }
                let _ = lseek(&f, 0, libc::SEEK_DATA);
                drop(f);
                let st = m.stop();
                assert!(
                    !st.stderr.contains("panicked"),
                    "{what}: panicked:\n{}",
                    st.stderr
                );
                assert!(
                    st.exited && st.code == Some(0) && !st.left_mounted,
                    "{what}: did not stop cleanly: {st:?}"
                );
            }
        },
    );
}

// ---------------------------------------------------------------------------------------
// 9. A corrupt L1 entry: EIO for that range only
// ---------------------------------------------------------------------------------------

/// An 8 MiB image with 4 KiB clusters has 4 L2 tables (2 MiB each). L1[1] is pointed past the end
/// of the file, or 512 bytes off a cluster boundary. fusex either refuses the image at start
/// (one line, no panic) or serves it: reads in 2..4 MiB fail with EIO, the other ranges read
/// right before and after, a write there fails too without growing the file to the bogus
/// offset, and the daemon stops normally.
#[test]
fn corrupt_l1_entry_fails_only_its_range() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("q-bad-l1");
    let src = w.join("src.raw");
    let size = 8 * MIB;
    let data = random_image(&src, size, 901);
    let good = w.join("good.qcow2");
    convert_to_qcow2(&src, &good, "cluster_size=4096", false);
    let l1 = read_be64(&good, H_L1_OFFSET);
    let entry = read_be64(&good, l1 + 8);
    let flags = entry & !0x00ff_ffff_ffff_fe00;
    let offset = entry & 0x00ff_ffff_ffff_fe00;
    assert!(offset != 0, "setup: L1[1] is not allocated");
    let file_len = fs::metadata(&good).unwrap().len();
    let bogus_past_eof = (file_len + GIB).next_multiple_of(4096);
    let mut items = Vec::new();
    for (name, value) in [
        ("past EOF", flags | bogus_past_eof),
        ("misaligned", flags | (offset + 512)),
    ] {
        for writable in [false, true] {
            let tag = format!(
                "{}-{}",
                name.replace(' ', "-"),
                if writable { "rw" } else { "ro" }
            );
            let img = w.join(format!("bad-l1-{tag}.qcow2"));
            mutated_copy(&good, &img, &[(l1 + 8, be64(value))]);
            items.push((
                format!("L1[1] {name}, writable {writable}"),
                img,
                writable,
                w.join(format!("export-{tag}")),
            ));
        }
    }
    every_case(
        items,
        |c| c.0.clone(),
        |(what, img, writable, mp)| {
            let args: &[&str] = if writable { &["--writable"] } else { &[] };
            let m = match Mount::try_start(&w, &img, &mp, args) {
                Err(f) => {
                    eprintln!("{what}: refused at start: {}", f.stderr.trim_end());
                    assert_refusal(f.code, &f.stdout, &f.stderr, &what);
                    assert!(!is_fuse_mounted(&mp));
                    return;
                }
                Ok(m) => m,
            };
            let f = if writable { m.open_rw() } else { m.open_ro() };
            let good_range = |f: &File, off: u64, len: u64, when: &str| {
                let got = pread_full(f, off, len as usize)
                    .unwrap_or_else(|e| panic!("{what}: pread {off}+{len} {when}: {e}"));
                assert_bytes_eq(
                    &got,
                    &data[off as usize..(off + len) as usize],
                    off,
                    &format!("{what}: intact range {when}"),
                );
            };
            good_range(&f, 0, 2 * MIB, "before");
            for off in [2 * MIB, 2 * MIB + 4096 + 100, 4 * MIB - 4096] {
                let mut buf = vec![0u8; 4096];
                match f.read_at(&mut buf, off) {
                    Err(e) => assert_eq!(
                        errno(&e),
                        libc::EIO,
                        "{what}: read at {off}, under the corrupt L1 entry: {e}, expected EIO"
                    ),
                    Ok(n) => panic!(
                    "{what}: read at {off}, under the corrupt L1 entry, succeeded ({n} bytes, all \
                     zero: {}), expected EIO",
                    buf[..n].iter().all(|&b| b == 0)
                ),
                }
            }
            if writable {
                assert_errno(
                    f.write_at(&[0xee; 4096], 3 * MIB),
                    &[libc::EIO],
                    &format!("{what}: write at 3 MiB, under the corrupt L1 entry"),
                );
            }
            good_range(&f, 4 * MIB, 4 * MIB, "after the failed requests");
            good_range(&f, 0, 2 * MIB, "after the failed requests");
            assert!(m.is_mounted(), "{what}: the export went away");
            drop(f);
            let st = m.stop();
            assert!(
                !st.stderr.contains("panicked"),
                "{what}: panicked:\n{}",
                st.stderr
            );
            assert!(
                st.exited && st.code == Some(0) && !st.left_mounted,
                "{what}: did not stop cleanly: {st:?}"
            );
            let len = fs::metadata(&img).unwrap().len();
            assert!(
            len < bogus_past_eof,
            "{what}: the image file grew to {len}: something was written at the bogus L2 offset"
        );
        },
    );
}
