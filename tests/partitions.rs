//! `--partition N`: one partition of a disk image served as a file of its own, on MBR disks
//! (primary and logical partitions) and GPT disks made by `sfdisk`, raw and inside qcow2, by
//! `fusex mount` and several at once by `fusex serve`. Each test runs `mkfs.ext4` and
//! `fsck.ext4 -fn` through the export, then reads the image's bytes back (with `dd` at the
//! partition's offsets, and `qemu-img convert` for qcow2) to check that the filesystem landed
//! inside the partition and that nothing outside it changed.

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use fusex_e2e::*;
use serde_json::json;

const DISK: u64 = 64 * MIB;

/// One partition as `sfdisk --json` lists it: (number, start byte, length in bytes).
type Part = (u32, u64, u64);

/// Makes a sparse disk image of [`DISK`] bytes partitioned by `script` (sfdisk's input) and
/// returns its partitions as sfdisk reads them back.
fn disk(w: &WorkDir, name: &str, script: &str) -> (PathBuf, Vec<Part>) {
    let img = w.join(name);
    sparse_image(&img, DISK);
    let mut c = Command::new("sfdisk");
    c.arg("-q").arg(&img);
    c.stdin(std::process::Stdio::piped());
    let mut child = c.spawn().expect("sfdisk");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success(), "sfdisk {script}");
    let out = run_ok(Command::new("sfdisk").arg("--json").arg(&img));
    let v: Value = serde_json::from_slice(&out.stdout).expect("sfdisk --json");
    let table = &v["partitiontable"];
    let sector = table["sectorsize"].as_u64().unwrap_or(512);
    let parts = table["partitions"]
        .as_array()
        .expect("partitions")
        .iter()
        .map(|p| {
            let node = p["node"].as_str().unwrap();
            let number: u32 = node
                .rsplit(|c: char| !c.is_ascii_digit())
                .next()
                .unwrap()
                .parse()
                .unwrap();
            (
                number,
                p["start"].as_u64().unwrap() * sector,
                p["size"].as_u64().unwrap() * sector,
            )
        })
        .collect();
    (img, parts)
}

/// Two primaries, an extended partition and two logical ones in it (5 and 6).
fn mbr_disk(w: &WorkDir) -> (PathBuf, Vec<Part>) {
    let (img, parts) = disk(
        w,
        "mbr.img",
        "label: dos\n\
         start=2048, size=16M, type=83\n\
         size=12M, type=83\n\
         type=5\n\
         size=10M, type=83\n\
         size=9M, type=83\n",
    );
    let numbers: Vec<u32> = parts.iter().map(|p| p.0).collect();
    assert_eq!(numbers, [1, 2, 3, 5, 6], "sfdisk made {parts:?}");
    (img, parts)
}

/// Three GPT partitions.
fn gpt_disk(w: &WorkDir) -> (PathBuf, Vec<Part>) {
    let (img, parts) = disk(w, "gpt.img", "label: gpt\nsize=16M\nsize=12M\nsize=10M\n");
    assert_eq!(parts.len(), 3, "sfdisk made {parts:?}");
    (img, parts)
}

fn part(parts: &[Part], n: u32) -> Part {
    *parts.iter().find(|p| p.0 == n).unwrap()
}

/// `dd` of `len` bytes at `start` of `img` into a file of its own.
fn dd_out(w: &WorkDir, img: &Path, start: u64, len: u64, name: &str) -> PathBuf {
    let out = w.join(name);
    run_ok(
        Command::new("dd")
            .arg(format!("if={}", img.display()))
            .arg(format!("of={}", out.display()))
            .arg("bs=4096")
            .arg(format!("skip={start}"))
            .arg(format!("count={len}"))
            .arg("iflag=skip_bytes,count_bytes")
            .arg("status=none"),
    );
    out
}

/// Asserts `after` equals `before` everywhere outside `[start, start + len)`.
fn outside_unchanged(before: &[u8], after: &[u8], start: u64, len: u64, what: &str) {
    assert_eq!(before.len(), after.len(), "{what}: the disk changed size");
    let (s, e) = (start as usize, (start + len) as usize);
    assert_bytes_eq(
        &after[..s],
        &before[..s],
        0,
        &format!("{what}: before the partition"),
    );
    assert_bytes_eq(
        &after[e..],
        &before[e..],
        e as u64,
        &format!("{what}: after the partition"),
    );
    assert!(
        after[s..e] != before[s..e],
        "{what}: the partition itself did not change (mkfs wrote nothing?)"
    );
}

/// mkfs.ext4 and fsck.ext4 -fn through the export at `mp`, which should be `len` bytes; then
/// writes at and across its end.
fn mkfs_fsck_and_the_end(mp: &Path, len: u64, what: &str) {
    assert_eq!(fs::metadata(mp).unwrap().len(), len, "{what}: export size");
    run_ok(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(mp));
    run_ok(Command::new("fsck.ext4").arg("-fn").arg(mp));
    let f = open_rw(mp);
    // At the end: nothing fits (as on any fixed-size export).
    let e = f.write_at(&[0xab; 4096], len).unwrap_err();
    assert_eq!(errno(&e), libc::ENOSPC, "{what}: a write at the end: {e}");
    // Across the end: only what fits lands.
    let n = f.write_at(&[0xcd; 8192], len - 4096).unwrap();
    assert_eq!(n, 4096, "{what}: a write across the end is cut there");
    let mut back = vec![0u8; 8192];
    let n = f.read_at(&mut back, len - 4096).unwrap();
    assert_eq!(n, 4096, "{what}: a read across the end is cut there");
    assert!(back[..4096].iter().all(|&b| b == 0xcd));
    // Put back what mkfs had there (ext4 leaves the last block alone, zero) and check again.
    f.write_at(&[0; 4096], len - 4096).unwrap();
    f.sync_all().unwrap();
    run_ok(Command::new("fsck.ext4").arg("-fn").arg(mp));
}

fn raw_partition_round_trip(w: &WorkDir, img: &Path, parts: &[Part], n: u32, what: &str) {
    let (_, start, len) = part(parts, n);
    let before = read_all(img);
    let mp = w.join(format!("{what}-{n}.export"));
    let m = Mount::start(w, img, &mp, &["--writable", &format!("--partition={n}")]);
    mkfs_fsck_and_the_end(&mp, len, what);
    m.stop().assert_clean(what);
    let after = read_all(img);
    outside_unchanged(
        &before,
        &after,
        start,
        len,
        &format!("{what} partition {n}"),
    );
    // The filesystem is where the partition table says, in the image itself.
    let out = dd_out(w, img, start, len, &format!("{what}-{n}.dd"));
    run_ok(Command::new("fsck.ext4").arg("-fn").arg(&out));
}

#[test]
fn every_partition_of_an_mbr_disk() {
    if !require_fuse_and_tools(&["sfdisk", "mkfs.ext4", "fsck.ext4", "dd"]) {
        return;
    }
    let w = WorkDir::new("part-mbr");
    let (img, parts) = mbr_disk(&w);
    for n in [1, 2, 5, 6] {
        raw_partition_round_trip(&w, &img, &parts, n, "mbr");
    }
}

#[test]
fn every_partition_of_a_gpt_disk() {
    if !require_fuse_and_tools(&["sfdisk", "mkfs.ext4", "fsck.ext4", "dd"]) {
        return;
    }
    let w = WorkDir::new("part-gpt");
    let (img, parts) = gpt_disk(&w);
    for n in [1, 2, 3] {
        raw_partition_round_trip(&w, &img, &parts, n, "gpt");
    }
}

#[test]
fn a_partition_inside_a_qcow2_image() {
    if !require_fuse_and_tools(&["sfdisk", "mkfs.ext4", "fsck.ext4", "dd", "qemu-img"]) {
        return;
    }
    let w = WorkDir::new("part-qcow2");
    for (img, parts, n) in [
        {
            let (i, p) = mbr_disk(&w);
            (i, p, 5)
        },
        {
            let (i, p) = gpt_disk(&w);
            (i, p, 2)
        },
    ] {
        let q = img.with_extension("qcow2");
        run_ok(
            Command::new("qemu-img")
                .args(["convert", "-f", "raw", "-O", "qcow2"])
                .arg(&img)
                .arg(&q),
        );
        let (_, start, len) = part(&parts, n);
        let before = read_all(&img);
        let mp = w.join(format!("q{n}.export"));
        let m = Mount::start(&w, &q, &mp, &["--writable", &format!("--partition={n}")]);
        mkfs_fsck_and_the_end(&mp, len, "qcow2");
        m.stop().assert_clean("qcow2");
        let after = qcow2_guest_bytes(&w, &q);
        outside_unchanged(&before, &after, start, len, &format!("qcow2 partition {n}"));
        let guest = w.join(format!("q{n}.guest"));
        fs::write(&guest, &after).unwrap();
        let out = dd_out(&w, &guest, start, len, &format!("q{n}.dd"));
        run_ok(Command::new("fsck.ext4").arg("-fn").arg(&out));
    }
}

#[test]
fn a_partition_that_is_not_there_is_refused_with_the_list() {
    if !require_fuse_and_tools(&["sfdisk"]) {
        return;
    }
    let w = WorkDir::new("part-bad");
    let (img, _) = mbr_disk(&w);
    for (n, want) in [
        ("4", "has no partition 4: its MBR has partitions 1 (16 MiB at 1 MiB), 2 (12 MiB at 17 MiB), 3 ("),
        ("3", "is the extended partition"),
    ] {
        let f = Mount::try_start(&w, &img, &w.join("x"), &[&format!("--partition={n}")])
            .err()
            .expect("refused");
        assert_eq!(f.code, Some(1));
        let line = f.stderr.lines().find(|l| l.contains("error")).unwrap_or("");
        assert!(line.contains(want), "partition {n}: {}", f.stderr);
        assert_eq!(f.stderr.trim().lines().count(), 1, "{}", f.stderr);
    }
    // No table at all.
    let blank = w.join("blank.img");
    sparse_image(&blank, MIB);
    let f = Mount::try_start(&w, &blank, &w.join("x"), &["--partition=1"])
        .err()
        .expect("refused");
    assert!(f.stderr.contains("has no partition table"), "{}", f.stderr);
    let f = Mount::try_start(
        &w,
        &img,
        &w.join("x"),
        &["--partition=1", "--writable", "--growable"],
    )
    .err()
    .expect("refused");
    assert!(f.stderr.contains("drop --growable"), "{}", f.stderr);
}

/// `--offset` and `--size` (QEMU raw's `offset` and `size`) bound an export to any byte range:
/// a partition given by its bytes holds a filesystem as `--partition` does, nothing outside it
/// changes, `--offset` alone runs to the image's end, and ranges the image does not hold are
/// refused in one line.
#[test]
fn a_byte_range_given_by_offset_and_size() {
    if !require_fuse_and_tools(&["sfdisk", "mkfs.ext4", "fsck.ext4", "dd"]) {
        return;
    }
    let w = WorkDir::new("part-range");
    let (img, parts) = mbr_disk(&w);
    let (_, start, len) = part(&parts, 2);
    let before = read_all(&img);
    let mp = w.join("range.export");
    let m = Mount::start(
        &w,
        &img,
        &mp,
        &[
            "--writable",
            &format!("--offset={start}"),
            &format!("--size={len}"),
        ],
    );
    mkfs_fsck_and_the_end(&mp, len, "range");
    m.stop().assert_clean("range");
    outside_unchanged(&before, &read_all(&img), start, len, "range");
    let out = dd_out(&w, &img, start, len, "range.dd");
    run_ok(Command::new("fsck.ext4").arg("-fn").arg(&out));

    // From an offset to the end, read-only: the image's own bytes.
    let all = read_all(&img);
    let tail = w.join("tail.export");
    let m = Mount::start(&w, &img, &tail, &["--offset=60M"]);
    assert_bytes_eq(
        &read_all(&tail),
        &all[60 << 20..],
        60 << 20,
        "--offset alone",
    );
    m.stop().assert_clean("tail");

    for (words, want) in [
        (
            vec!["--offset=65M".to_string()],
            "has 67108864 bytes: it has no bytes from byte 68157440",
        ),
        (
            vec!["--offset=60M".to_string(), "--size=8M".to_string()],
            "it has no 8388608 bytes from byte 62914560",
        ),
        (
            vec!["--offset=1M".to_string(), "--partition=1".to_string()],
            "cannot be used with",
        ),
        (
            vec![
                "--size=1M".to_string(),
                "--writable".to_string(),
                "--growable".to_string(),
            ],
            "drop --growable",
        ),
    ] {
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        let f = Mount::try_start(&w, &img, &w.join("x"), &words)
            .err()
            .expect("refused");
        assert_eq!(f.code, Some(1), "{words:?}: {}", f.stderr);
        assert!(f.stderr.contains(want), "{words:?}: {}", f.stderr);
        assert_eq!(f.stderr.trim().lines().count(), 1, "{}", f.stderr);
    }
}

/// `fusex serve` exports two partitions of one qcow2 image at once from one opened image,
/// each with its own filesystem; a third partition node names a partition that is not there.
/// `fusex restart` hands both to a new daemon, which opens the image once for them again (two
/// writers of one qcow2 image must share it), and the filesystems are made through it; over
/// io_uring (`FUSEX_E2E_TRANSPORT=uring`) the restart is refused and the exports serve on.
#[test]
fn serve_exports_several_partitions_of_one_image() {
    if !require_fuse_and_tools(&["sfdisk", "mkfs.ext4", "fsck.ext4", "dd", "qemu-img"]) {
        return;
    }
    let w = WorkDir::new("part-serve");
    let (img, parts) = mbr_disk(&w);
    let q = w.join("disk.qcow2");
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "qcow2"])
            .arg(&img)
            .arg(&q),
    );
    let before = read_all(&img);
    let pid_file = w.join("serve.pid");
    let mut serve = Serve::start(w.path(), &["--pidfile", pid_file.to_str().unwrap()]);
    let _guard = PidGuard(pid_file.clone(), w.path().to_path_buf());
    let mut qmp = serve.qmp();
    qmp.ok(
        "blockdev-add",
        json!({"driver": "qcow2", "node-name": "disk",
               "file": {"driver": "file", "filename": q}}),
    );
    let e = qmp.err(
        "blockdev-add",
        json!({"driver": "__org.fusex_partition", "node-name": "p4", "file": "disk",
               "partition": 4}),
    );
    assert!(
        e.contains("has no partition 4") && e.contains("5 (10 MiB"),
        "{e}"
    );
    let legacy = std::env::var("FUSEX_E2E_TRANSPORT").is_ok_and(|t| t == "legacy");
    let transport = if legacy { "legacy" } else { "auto" };
    let mut mps = Vec::new();
    for n in [2u32, 5] {
        let node = format!("p{n}");
        qmp.ok(
            "blockdev-add",
            json!({"driver": "__org.fusex_partition", "node-name": node, "file": "disk",
                   "partition": n}),
        );
        let mp = w.join(format!("p{n}.export"));
        fs::write(&mp, b"").unwrap();
        qmp.ok(
            "block-export-add",
            json!({"type": "fuse", "id": node, "node-name": node, "mountpoint": mp,
                   "writable": true, "__org.fusex_transport": transport}),
        );
        mps.push((n, mp));
    }
    drop(qmp);
    // `auto` serves over io_uring where the kernel has it on.
    let uring = !legacy && uring_enabled();
    let new = if uring {
        let r = run_fusex(&w, &["restart".as_ref(), mps[0].1.as_os_str()], None);
        r.assert_one_error_line("fusex restart of io_uring partition exports");
        serve.pid()
    } else {
        serve.restart(&w, &mps[0].1, &pid_file)
    };
    let mut qmp = Qmp::connect(&serve.socket);
    // Both at once: mkfs on each while the other is exported.
    for (n, mp) in &mps {
        let (_, _, len) = part(&parts, *n);
        mkfs_fsck_and_the_end(mp, len, &format!("serve p{n}"));
    }
    let nodes = qmp.ok("query-named-block-nodes", json!({}));
    assert!(
        nodes.to_string().contains("__org.fusex_partition"),
        "{nodes}"
    );
    for (n, _) in &mps {
        qmp.ok("block-export-del", json!({"id": format!("p{n}")}));
        qmp.event("BLOCK_EXPORT_DELETED", &format!("p{n}"), TIMEOUT);
    }
    // The shared image is closed with its last export: qemu-img check (which keeps writers
    // off) opens it while the daemon still runs.
    let after = qcow2_guest_bytes(&w, &q);
    qmp.ok("quit", json!({}));
    assert!(wait_until(Instant::now() + TIMEOUT * 3, || !pid_alive(new)));
    drop(serve);
    // Outside both partitions nothing changed; inside each, a clean ext4.
    let (_, s2, l2) = part(&parts, 2);
    let (_, s5, l5) = part(&parts, 5);
    let mut expect = after.clone();
    expect[s2 as usize..(s2 + l2) as usize]
        .copy_from_slice(&before[s2 as usize..(s2 + l2) as usize]);
    expect[s5 as usize..(s5 + l5) as usize]
        .copy_from_slice(&before[s5 as usize..(s5 + l5) as usize]);
    assert_bytes_eq(&expect, &before, 0, "outside partitions 2 and 5");
    let guest = w.join("guest.raw");
    fs::write(&guest, &after).unwrap();
    for (n, s, l) in [(2, s2, l2), (5, s5, l5)] {
        let out = dd_out(&w, &guest, s, l, &format!("serve{n}.dd"));
        run_ok(Command::new("fsck.ext4").arg("-fn").arg(&out));
    }
}

/// The table is read through the backend, so a partition of an NBD export (qemu-nbd serving
/// the raw disk) is found and served like one of a file.
#[test]
fn a_partition_of_an_nbd_export() {
    if !require_fuse_and_tools(&["sfdisk", "mkfs.ext4", "fsck.ext4", "dd", "qemu-nbd"]) {
        return;
    }
    let w = WorkDir::new("part-nbd");
    let (img, parts) = gpt_disk(&w);
    let (_, start, len) = part(&parts, 3);
    let before = read_all(&img);
    let sock = w.join("nbd.sock");
    let server = qemu_nbd(&sock, &["-f", "raw", "-x", "disk"], &img);
    let mp = w.join("nbd3.export");
    let m = Mount::start(
        &w,
        nbd_uri(&sock, "disk"),
        &mp,
        &["--writable", "--partition=3"],
    );
    mkfs_fsck_and_the_end(&mp, len, "nbd");
    m.stop().assert_clean("nbd");
    drop(server);
    let after = read_all(&img);
    outside_unchanged(&before, &after, start, len, "nbd partition 3");
    let out = dd_out(&w, &img, start, len, "nbd3.dd");
    run_ok(Command::new("fsck.ext4").arg("-fn").arg(&out));
}
