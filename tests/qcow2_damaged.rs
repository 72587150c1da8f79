//! Damaged and hostile qcow2 images: fusex never costs their data.
//!
//! - Every image of the corpus (`backend::qcow2::damage`: a `qemu-img` image with one planted
//!   fault: refcounts zeroed or pointing past the end, L1/L2 entries aliasing metadata, a data
//!   cluster mapped twice) is refused writable in one line naming `qemu-img check -r all`, left
//!   byte-identical, with the same `qemu-img check` verdict, and still serves reads read-only.
//! - A chain of eight 2 MiB-cluster images whose L1 tables point into sparse holes keeps the
//!   daemon's memory within the metadata cache budget while reads walk 60 L2 ranges.
//! - Damage that appears while an image is served (a refcount block zeroed, an L2 entry turned to
//!   alias the L1 table, behind the export's back) fails the write with EIO, marks the image
//!   corrupt (its header's bit, which `qemu-img info` shows), changes no other byte, and leaves
//!   reads working.
//! - Files an image names: a FIFO fails start-up at once; control characters in a name never reach
//!   the terminal; root serving another user's image refuses a backing file that user could not
//!   read (unless `--trust-backing`); an external data file is written through.

use std::fs::{self, File};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use backend::qcow2::damage::{Damage, Layout, BASE_RECIPE};
use fusex_e2e::*;

const QEMU: &[&str] = &["qemu-img", "qemu-io"];

/// The corpus's base image at `dir/name`, made as [`BASE_RECIPE`] says.
fn base_image(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    BASE_RECIPE.make(&p, "").unwrap();
    p
}

/// A 1 MiB overlay at `dir/top.qcow2` naming `backing` (a raw file, not checked at creation).
fn overlay_naming(dir: &Path, backing: impl AsRef<std::ffi::OsStr>) -> PathBuf {
    let img = dir.join("top.qcow2");
    run_ok(
        Command::new("qemu-img")
            .current_dir(dir)
            .args(["create", "-q", "-f", "qcow2", "-u", "-F", "raw", "-b"])
            .arg(backing)
            .arg(&img)
            .arg("1M"),
    );
    img
}

/// `fusex mount IMG MP` (read-only), which must be refused in one line; its stderr.
#[track_caller]
fn refused(w: &WorkDir, img: &Path, what: &str) -> String {
    let mp = w.join("refused.raw");
    let r = run_fusex(
        w,
        &["mount".as_ref(), img.as_os_str(), mp.as_os_str()],
        Some(&mp),
    );
    r.assert_one_error_line(what);
    r.stderr
}

/// `qemu-img check`'s report (its exit status says how damaged, and is part of the verdict).
fn qemu_check(img: &Path) -> String {
    let out = run(Command::new("qemu-img")
        .args(["check", "-f", "qcow2"])
        .arg(img));
    format!(
        "exit {:?}\n{}{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn damaged_images_are_refused_writable_left_untouched_and_still_read() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("qcow2-damaged");
    let clean = base_image(w.path(), "clean.qcow2");
    for dmg in Damage::ALL {
        let name = dmg.name();
        let img = w.join(format!("{name}.qcow2"));
        fs::copy(&clean, &img).unwrap();
        dmg.plant(&img).unwrap();
        let layout = Layout::read(&clean).unwrap();
        let bytes = fs::read(&img).unwrap();
        let verdict = qemu_check(&img);
        let mp = w.join(format!("{name}.raw"));

        let r = run_fusex(
            &w,
            &[
                "mount".as_ref(),
                "--writable".as_ref(),
                img.as_os_str(),
                mp.as_os_str(),
            ],
            Some(&mp),
        );
        r.assert_one_error_line(name);
        assert!(
            r.stderr.contains("is damaged") && r.stderr.contains("qemu-img check -r all"),
            "{name}: {}",
            r.stderr
        );
        assert!(!is_fuse_mounted(&mp), "{name}: refused but mounted");

        // Read-only, the image serves what its mapping says; guest cluster 0 is intact in every
        // corpus image, and the damaged range reads (whatever it maps to) or fails, never hangs.
        let m = Mount::start(&w, &img, &mp, &[]);
        let f = m.open_ro();
        let mut head = vec![0u8; 4096];
        f.read_exact_at(&mut head, 0).unwrap();
        assert!(head.iter().all(|&b| b == 0x11), "{name}: guest cluster 0");
        if let Some((off, len)) = dmg.guest_range(&layout) {
            let mut buf = vec![0u8; len as usize];
            let _ = f.read_exact_at(&mut buf, off);
        }
        drop(f);
        m.stop().assert_clean(name);

        assert!(
            fs::read(&img).unwrap() == bytes,
            "{name}: the image changed"
        );
        assert_eq!(qemu_check(&img), verdict, "{name}: qemu-img check changed");
    }
}

#[test]
fn a_healthy_image_still_opens_writable_and_stays_clean() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("qcow2-healthy");
    let img = base_image(w.path(), "a.qcow2");
    let mp = w.join("a.raw");
    let m = Mount::start(&w, &img, &mp, &["--writable"]);
    let f = m.open_rw();
    let data = vec![0x5au8; 192 << 10];
    // Across an allocated and an unallocated cluster, and into the second L2 table's range.
    f.write_all_at(&data, 200 << 10).unwrap();
    f.write_all_at(&data, 700 << 20).unwrap();
    f.sync_all().unwrap();
    drop(f);
    m.stop().assert_clean("healthy");
    let guest = qcow2_guest_bytes(&w, &img);
    assert_bytes_eq(
        &guest[200 << 10..392 << 10],
        &data,
        200 << 10,
        "first write",
    );
    assert_bytes_eq(
        &guest[700 << 20..(700 << 20) + (192 << 10)],
        &data,
        700 << 20,
        "second",
    );
}

/// The daemon's peak resident memory, in bytes.
fn peak_rss(pid: i32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib << 10
}

#[test]
fn a_long_chain_of_2m_cluster_images_stays_within_its_cache_budget() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    const CS: u64 = 2 << 20;
    // One L2 table maps 2 MiB / 8 clusters of 2 MiB: 512 GiB. 16 L1 entries: 8 TiB (more than
    // a backing image's 4 MiB budget keeps, fewer than the 128 tables an unbounded cache keeps;
    // the top image's 32 MiB L2 cache holds all 16).
    const L2_SPAN: u64 = CS / 8 * CS;
    const TABLES: u64 = 16;
    let w = WorkDir::new("qcow2-chain-budget");
    let mut prev: Option<String> = None;
    let mut top = PathBuf::new();
    for i in 0..8 {
        let name = format!("c{i}.qcow2");
        let mut cmd = Command::new("qemu-img");
        cmd.current_dir(w.path())
            .args(["create", "-q", "-f", "qcow2", "-o", "cluster_size=2M"]);
        if let Some(p) = &prev {
            cmd.args(["-b", p, "-F", "qcow2"]);
        }
        run_ok(cmd.arg(&name).arg((TABLES * L2_SPAN).to_string()));
        // Every L1 entry names an L2 table in a sparse hole past the image's end: each reads as
        // an empty table, so every read walks the whole chain and loads one table per image.
        let p = w.join(&name);
        let l = Layout::read(&p).unwrap();
        let f = fs::OpenOptions::new().write(true).open(&p).unwrap();
        let end = f.metadata().unwrap().len().next_multiple_of(CS);
        for k in 0..TABLES {
            f.write_all_at(&(end + k * CS).to_be_bytes(), l.l1 + k * 8)
                .unwrap();
        }
        f.set_len(end + TABLES * CS).unwrap();
        prev = Some(name);
        top = p;
    }
    let mp = w.join("chain.raw");
    let m = Mount::start(&w, &top, &mp, &[]);
    let f = m.open_ro();
    let mut b = [0u8; 512];
    for k in 0..TABLES {
        f.read_exact_at(&mut b, k * L2_SPAN).unwrap();
        assert!(b.iter().all(|&x| x == 0));
    }
    let peak = peak_rss(m.pid());
    eprintln!("peak RSS: {} MiB", peak >> 20);
    drop(f);
    m.stop().assert_clean("chain");
    // The plan (docs/design.md, "Memory"): request buffers (34 MiB here) and the metadata caches
    // (36 MiB for the top image, 4 MiB for each of 7 backing images), plus the program itself.
    // Unbounded caches held every table they loaded: 16 of 2 MiB per image, 256 MiB for this chain.
    let plan = (34 + 36 + 7 * 4 + 64) << 20;
    assert!(
        peak < plan,
        "peak RSS {} MiB over the plan's {} MiB",
        peak >> 20,
        plan >> 20
    );
}

#[test]
fn a_fifo_backing_file_fails_start_up_in_one_line() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("qcow2-fifo");
    let fifo = w.join("fifo");
    run_ok(Command::new("mkfifo").arg(&fifo));
    // run_with_timeout fails the test if fusex hangs waiting for a writer.
    let err = refused(&w, &overlay_naming(w.path(), "fifo"), "fifo backing");
    assert!(err.contains("not a regular file or block device"), "{err}");
}

#[test]
fn control_characters_in_a_backing_name_never_reach_the_terminal() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("qcow2-escape");
    let err = refused(
        &w,
        &overlay_naming(w.path(), "evil\x1b[2J\x07name"),
        "escaped name",
    );
    assert!(
        !err.bytes().any(|b| b < 0x20 && b != b'\n'),
        "raw control characters: {err:?}"
    );
    assert!(err.contains("evil"), "{err}");
}

#[test]
fn root_never_serves_a_backing_file_the_image_owner_could_not_read() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        assert!(!in_ci(), "the e2e suite runs as root in CI");
        return;
    }
    let w = WorkDir::new("qcow2-foreign");
    // A file only root may read, as /etc/shadow is.
    let secret = w.join("secret.raw");
    fs::write(&secret, vec![0x77u8; 1 << 20]).unwrap();
    fs::set_permissions(&secret, fs::Permissions::from_mode(0o600)).unwrap();
    let img = overlay_naming(w.path(), &secret);
    // The image belongs to nobody: nobody chose the names in it.
    run_ok(Command::new("chown").arg("65534:65534").arg(&img));
    let err = refused(&w, &img, "foreign backing");
    assert!(
        err.contains("uid 65534") && err.contains("--trust-backing"),
        "{err}"
    );
    // Asked for explicitly, root serves it.
    let m = Mount::start(&w, &img, &w.join("user.raw"), &["--trust-backing"]);
    let mut b = vec![0u8; 4096];
    m.open_ro().read_exact_at(&mut b, 0).unwrap();
    assert!(b.iter().all(|&x| x == 0x77));
    m.stop().assert_clean("trusted");
}

#[test]
fn an_external_data_file_is_written_through() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("qcow2-data-file");
    let img = w.join("ext.qcow2");
    let data = w.join("ext.data");
    run_ok(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-o"])
            .arg(format!("data_file={}", data.display()))
            .arg(&img)
            .arg("4M"),
    );
    let mp = w.join("ext.raw");
    let m = Mount::start(&w, &img, &mp, &["--writable"]);
    let f = m.open_rw();
    let payload: Vec<u8> = (0..(128u32 << 10)).map(|i| (i % 251) as u8).collect();
    f.write_all_at(&payload, 1 << 20).unwrap();
    f.sync_all().unwrap();
    drop(f);
    m.stop().assert_clean("data file");
    let guest = qcow2_guest_bytes(&w, &img);
    assert_bytes_eq(
        &guest[1 << 20..(1 << 20) + payload.len()],
        &payload,
        1 << 20,
        "guest",
    );
    // The data lives in the data file, at its guest offset.
    let mut raw = vec![0u8; payload.len()];
    File::open(&data)
        .unwrap()
        .read_exact_at(&mut raw, 1 << 20)
        .unwrap();
    assert_bytes_eq(&raw, &payload, 1 << 20, "data file");
}

/// The whole image file.
fn image_bytes(p: &Path) -> Vec<u8> {
    fs::read(p).unwrap()
}

/// Asserts `after` is `before` with only the header's corrupt bit (incompatible feature bit 1,
/// byte 79) added.
#[track_caller]
fn only_the_corrupt_bit_changed(before: &[u8], after: &[u8]) {
    assert_eq!(before.len(), after.len(), "the image changed size");
    let changed: Vec<usize> = (0..before.len())
        .filter(|&i| before[i] != after[i])
        .collect();
    assert_eq!(changed, [79], "bytes other than the corrupt bit changed");
    assert_eq!(after[79], before[79] | 2);
}

#[test]
fn a_refcount_block_zeroed_while_serving_fails_the_allocating_write_and_marks_the_image_corrupt() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("qcow2-live-refblock");
    let img = base_image(w.path(), "a.qcow2");
    let mp = w.join("a.raw");
    let m = Mount::start(&w, &img, &mp, &["--writable"]);
    // Refcount blocks are read at the first allocation: zero refcount block 0 behind the
    // export's back, as a damaged disk or another writer ignoring the locks would.
    let l = Layout::read(&img).unwrap();
    let raw = fs::OpenOptions::new().write(true).open(&img).unwrap();
    raw.write_all_at(&vec![0u8; l.cluster_size as usize], l.refblock0)
        .unwrap();
    raw.sync_all().unwrap();
    let before = image_bytes(&img);

    let f = m.open_rw();
    let block = vec![0xabu8; 65536];
    // Unallocated clusters: the allocator would hand out cluster 0, the header.
    for off in [100u64 << 20, 300 << 20] {
        let e = f.write_all_at(&block, off).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "write at {off}: {e}");
    }
    // An allocated cluster: still refused, the image is corrupt now.
    let e = f.write_all_at(&block, 0).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    // Reads go on.
    let mut head = vec![0u8; 65536];
    f.read_exact_at(&mut head, 0).unwrap();
    assert!(head.iter().all(|&b| b == 0x11));
    drop(f);
    let stopped = m.stop();
    assert!(stopped.exited && !stopped.left_mounted, "{stopped:?}");
    let log = stopped.stderr;
    assert_eq!(
        log.matches("Preventing invalid write on metadata").count(),
        1,
        "one log line: {log}"
    );
    assert!(log.contains("qemu-img check -r all"), "{log}");
    only_the_corrupt_bit_changed(&before, &image_bytes(&img));
    let info = run(Command::new("qemu-img").args(["info", "-U"]).arg(&img));
    assert!(
        String::from_utf8_lossy(&info.stdout).contains("corrupt: true"),
        "{}",
        String::from_utf8_lossy(&info.stdout)
    );
}

#[test]
fn an_l2_entry_aliasing_the_l1_table_while_serving_never_lets_guest_data_land_there() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    const CS: u64 = 2 << 20;
    const L2_SPAN: u64 = CS / 8 * CS;
    let w = WorkDir::new("qcow2-live-alias");
    let img = w.join("big.qcow2");
    run_ok(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-o", "cluster_size=2M"])
            .arg(&img)
            .arg((8 * L2_SPAN).to_string()),
    );
    // Data under eight L2 tables: more than a 12 MiB L2 cache keeps (six with 2 MiB clusters),
    // so the first table is read from the file again once the others were used.
    let mut io = Command::new("qemu-io");
    io.args(["-f", "qcow2"]);
    for k in 0..8u64 {
        io.arg("-c")
            .arg(format!("write -P {} {} 2M", k + 1, k * L2_SPAN));
    }
    run_ok(io.arg(&img));
    let mp = w.join("big.raw");
    let m = Mount::start(&w, &img, &mp, &["--writable", "--l2-cache-size", "12M"]);
    let f = m.open_rw();
    let mut b = vec![0u8; 4096];
    for k in 1..8u64 {
        f.read_exact_at(&mut b, k * L2_SPAN).unwrap();
        assert!(b.iter().all(|&x| x == (k + 1) as u8));
    }
    // Guest cluster 0's L2 entry now points at the L1 table ("copied": written in place).
    let l = Layout::read(&img).unwrap();
    let raw = fs::OpenOptions::new().write(true).open(&img).unwrap();
    raw.write_all_at(&((1u64 << 63) | (l.l1 & !(CS - 1))).to_be_bytes(), l.l2[0])
        .unwrap();
    raw.sync_all().unwrap();
    let before = image_bytes(&img);

    let e = f.write_all_at(&vec![0xeeu8; 65536], 0).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    drop(f);
    let stopped = m.stop();
    assert!(stopped.exited && !stopped.left_mounted, "{stopped:?}");
    assert!(
        stopped.stderr.contains("overlaps L1 metadata"),
        "{}",
        stopped.stderr
    );
    // The L1 table (and everything else) is as it was: no guest byte landed in it.
    only_the_corrupt_bit_changed(&before, &image_bytes(&img));
}
