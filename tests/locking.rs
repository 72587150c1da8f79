//! Image locking: fusex takes QEMU's OFD lock bytes on every image file it opens, so
//!
//! - two writable exports of one image cannot both run, and a reader and a writer cannot either,
//!   while any number of read-only exports share an image;
//! - QEMU's own tools (qemu-io, qemu-img resize, qemu-img commit) refuse to write or resize an
//!   image, or the backing file of a qcow2 image, that fusex exports, and fusex refuses an image
//!   qemu-io holds open for writing, with one line naming the conflict and `--force-share`;
//! - `--force-share` (read-only only) exports an image a writer holds and sees its writes;
//! - the locks go away with the export (foreground or daemonized): QEMU can write afterwards.
//! - `--no-locking` takes none (several writable exports of one image, as the benchmarks run).
//!
//! The refusals are checked against the image's bytes too: a refused writer changed nothing.

use std::ffi::OsString;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Instant;

use fusex_e2e::*;

const QEMU: &[&str] = &["qemu-img", "qemu-io"];

/// The hint every lock refusal carries.
const HINT: &str = "use --force-share for a read-only export";

/// The lock bytes (100..104, 200..204) someone holds on `path`.
fn held_bytes(path: &Path) -> Vec<i64> {
    (100..104)
        .chain(200..204)
        .filter(|&b| lock_held(path, b, 1))
        .collect()
}

/// `fusex mount ARGS IMAGE MP` that must be refused for a lock: exit 1, one line naming the image
/// and the conflict, nothing mounted, no mountpoint left behind. Returns the error line.
#[track_caller]
fn expect_locked_out(w: &WorkDir, args: &[&str], image: &Path, named: &Path, lock: &str) -> String {
    let mp = w.join("refused");
    let mut argv: Vec<OsString> = vec!["mount".into()];
    argv.extend(args.iter().map(OsString::from));
    argv.push(image.into());
    argv.push(mp.clone().into());
    let r = run_fusex(w, &argv, Some(&mp));
    let what = format!("fusex mount {args:?} {}", image.display());
    r.assert_one_error_line(&what);
    let line = r.stderr.trim_end().to_string();
    let expected = format!("is in use by another process ({lock} lock): stop it, or {HINT}");
    assert!(
        line.contains(&expected) && line.contains(&named.display().to_string()),
        "{what}: expected {} and {expected:?} in the error, got {line:?}",
        named.display()
    );
    assert!(
        fuse_mounts_at(&mp).is_empty(),
        "{what}: something is mounted at {}",
        mp.display()
    );
    assert!(!mp.exists(), "{what}: the mountpoint file was left behind");
    line
}

/// Runs a qemu tool that must be refused for a lock on `image`: non-zero exit and QEMU's lock
/// message naming the file.
#[track_caller]
fn expect_qemu_refused(cmd: &mut Command, image: &Path, what: &str) {
    let out = run(cmd);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "{what}: {cmd:?} succeeded on an image fusex holds; stdout:\n{}stderr:\n{err}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        err.contains("lock") && err.contains(image.file_name().unwrap().to_str().unwrap()),
        "{what}: {cmd:?} failed, but not for a lock on {}:\n{err}",
        image.display()
    );
}

fn qemu_io(fmt: &str, cmds: &[&str], image: &Path) -> Command {
    let mut c = Command::new("qemu-io");
    c.args(["-f", fmt]);
    for x in cmds {
        c.args(["-c", x]);
    }
    c.arg(image);
    c
}

/// `qemu-io -f FMT IMAGE` reading commands from a pipe: it holds the image open (and locked)
/// until its stdin closes. Dropping the guard closes stdin and reaps it (killing it if needed).
struct QemuHolder {
    child: Child,
    stdin: Option<ChildStdin>,
    err: PathBuf,
}

impl QemuHolder {
    /// Starts qemu-io on `image` and waits until it holds lock byte `byte` on `locked`.
    #[track_caller]
    fn start(w: &WorkDir, fmt: &str, image: &Path, locked: &Path, byte: i64) -> QemuHolder {
        let err = w.join("qemu-io.stderr");
        let mut child = Command::new("qemu-io")
            .args(["-f", fmt])
            .arg(image)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(File::create(&err).unwrap())
            .spawn()
            .expect("spawn qemu-io");
        let stdin = child.stdin.take();
        let mut h = QemuHolder { child, stdin, err };
        let up = wait_until(Instant::now() + TIMEOUT, || {
            lock_held(locked, byte, 1) || h.child.try_wait().ok().flatten().is_some()
        });
        assert!(
            up && lock_held(locked, byte, 1),
            "qemu-io did not lock byte {byte} of {} within {TIMEOUT:?}; stderr:\n{}",
            locked.display(),
            fs::read_to_string(&h.err).unwrap_or_default()
        );
        h
    }

    /// Sends one qemu-io command line (e.g. `write -P 0xcd 0 4k`).
    fn command(&mut self, line: &str) {
        let s = self.stdin.as_mut().expect("stdin open");
        writeln!(s, "{line}").expect("write to qemu-io");
        s.flush().expect("flush qemu-io stdin");
    }

    /// Closes stdin (qemu-io quits) and waits for it to exit.
    #[track_caller]
    fn quit(mut self) {
        self.stdin.take();
        let st = wait_timeout(&mut self.child, TIMEOUT);
        assert!(st.is_some(), "qemu-io did not quit when its stdin closed");
    }
}

impl Drop for QemuHolder {
    fn drop(&mut self) {
        self.stdin.take();
        if wait_timeout(&mut self.child, TIMEOUT).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn create_overlay(dir: &Path, name: &str, backing: &str) {
    run_ok(Command::new("qemu-img").current_dir(dir).args([
        "create", "-q", "-f", "qcow2", "-b", backing, "-F", "raw", name,
    ]));
}

#[test]
fn two_writable_exports_of_one_raw_image() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("lock-two-writers");
    let img = w.join("disk.img");
    let data = random_image(&img, 4 * MIB, 11);
    let m = Mount::start(&w, &img, &w.join("first"), &["--writable"]);
    // The first export holds write (101) and refuses to share write and resize (201, 203).
    assert_eq!(held_bytes(&img), vec![100, 101, 201, 203]);
    // A second writer wants write, which the first does not share.
    expect_locked_out(&w, &["--writable"], &img, &img, "write");
    // A reader refuses to share write, which the first holds.
    expect_locked_out(&w, &[], &img, &img, "shared write");
    // The same with O_DIRECT (two descriptors on the image: only one carries the locks).
    expect_locked_out(&w, &["--writable", "--direct"], &img, &img, "write");
    assert_bytes_eq(
        &read_all(m.path()),
        &data,
        0,
        "the first export after the refusals",
    );
    m.stop().assert_clean("first writable export");
    assert!(
        held_bytes(&img).is_empty(),
        "locks left after the export ended"
    );
    // Once the first is gone the second may write.
    let m = Mount::start(&w, &img, &w.join("second"), &["--writable", "--direct"]);
    assert_eq!(held_bytes(&img), vec![100, 101, 201, 203]);
    m.stop().assert_clean("second writable export");
}

#[test]
fn read_only_exports_share_an_image_and_keep_writers_out() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("lock-readers");
    let img = w.join("disk.img");
    let data = random_image(&img, 4 * MIB, 12);
    let a = Mount::start(&w, &img, &w.join("a"), &[]);
    let b = Mount::start(&w, &img, &w.join("b"), &[]);
    assert_bytes_eq(&read_all(a.path()), &data, 0, "first read-only export");
    assert_bytes_eq(&read_all(b.path()), &data, 0, "second read-only export");
    // Readers are welcome (qemu-io -r reads and shares everything) ...
    run_ok(
        Command::new("qemu-io")
            .args(["-r", "-f", "raw", "-c", "read 0 4k"])
            .arg(&img),
    );
    // ... writers and resizers are not.
    expect_locked_out(&w, &["--writable"], &img, &img, "write");
    expect_qemu_refused(
        &mut qemu_io("raw", &["write -P 0xab 0 4k"], &img),
        &img,
        "qemu-io write under two read-only exports",
    );
    expect_qemu_refused(
        Command::new("qemu-img")
            .args(["resize", "-f", "raw"])
            .arg(&img)
            .arg("8M"),
        &img,
        "qemu-img resize under two read-only exports",
    );
    assert_bytes_eq(&read_all(&img), &data, 0, "image after the refused writers");
    a.stop().assert_clean("first read-only export");
    // One reader left: still no writer.
    expect_locked_out(&w, &["--writable"], &img, &img, "write");
    b.stop().assert_clean("second read-only export");
    assert!(
        held_bytes(&img).is_empty(),
        "locks left after both exports ended"
    );
}

#[test]
fn qemu_tools_are_refused_while_a_writable_export_lives() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("lock-qemu-refused");
    let img = w.join("disk.img");
    let mut data = random_image(&img, 4 * MIB, 13);
    let m = Mount::start(&w, &img, &w.join("export"), &["--writable", "--growable"]);
    // Growable: resize (103) is held too.
    assert_eq!(held_bytes(&img), vec![100, 101, 103, 201, 203]);
    expect_qemu_refused(
        &mut qemu_io("raw", &["write -P 0xab 0 4k"], &img),
        &img,
        "qemu-io write under a writable export",
    );
    expect_qemu_refused(
        Command::new("qemu-img")
            .args(["resize", "-f", "raw", "--shrink"])
            .arg(&img)
            .arg("1M"),
        &img,
        "qemu-img resize (shrink) under a writable export",
    );
    assert_eq!(fs::metadata(&img).unwrap().len(), 4 * MIB, "image size");
    assert_bytes_eq(&read_all(m.path()), &data, 0, "export after the refusals");
    m.stop().assert_clean("writable export");
    // Released with the export: qemu-io writes now.
    run_ok(&mut qemu_io("raw", &["write -P 0xab 0 4k"], &img));
    data[..4096].fill(0xab);
    assert_bytes_eq(&read_all(&img), &data, 0, "image after qemu-io wrote it");
}

#[test]
fn a_daemonized_export_keeps_its_locks() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("lock-daemon");
    let img = w.join("disk.img");
    let data = random_image(&img, MIB, 14);
    let (m, _) = Mount::start_daemonized(
        &w,
        &img,
        &w.join("export"),
        &w.join("fusex.pid"),
        &["--writable"],
    )
    .unwrap_or_else(|f| panic!("daemonized mount failed: {}", f.stderr));
    // The parent that opened the image is gone; the daemon's descriptor keeps the locks.
    assert_eq!(held_bytes(&img), vec![100, 101, 201, 203]);
    expect_qemu_refused(
        &mut qemu_io("raw", &["write -P 0xab 0 4k"], &img),
        &img,
        "qemu-io write under a daemonized export",
    );
    expect_locked_out(&w, &["--writable"], &img, &img, "write");
    assert_bytes_eq(&read_all(&img), &data, 0, "image after the refusals");
    let st = m.stop();
    assert!(st.exited && !st.left_mounted, "daemon did not stop cleanly");
    assert!(
        wait_until(Instant::now() + TIMEOUT, || held_bytes(&img).is_empty()),
        "locks left after the daemon exited: {:?}",
        held_bytes(&img)
    );
}

#[test]
fn an_image_qemu_writes_is_refused_unless_force_share() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("lock-qemu-holds");
    let img = w.join("disk.img");
    let mut data = random_image(&img, 4 * MIB, 15);
    // qemu-io with the image open read-write: holds consistent read and write (100, 101),
    // shares everything.
    let mut q = QemuHolder::start(&w, "raw", &img, &img, 101);
    expect_locked_out(&w, &["--writable"], &img, &img, "shared write");
    expect_locked_out(&w, &[], &img, &img, "shared write");
    // --force-share is for readers only: one line, before anything is opened.
    let mp = w.join("bad");
    let r = run_fusex(
        &w,
        &[
            OsString::from("mount"),
            "--force-share".into(),
            "--writable".into(),
            img.clone().into(),
            mp.clone().into(),
        ],
        Some(&mp),
    );
    r.assert_one_error_line("--force-share --writable");
    assert!(r.stderr.contains("--force-share is for read-only exports"));
    assert!(!mp.exists() && fuse_mounts_at(&mp).is_empty());
    // A forced read-only export works and sees what the writer writes.
    let m = Mount::start(&w, &img, &w.join("export"), &["--force-share"]);
    assert_bytes_eq(&read_all(m.path()), &data, 0, "forced export");
    q.command("write -P 0xcd 8192 4096");
    data[8192..12288].fill(0xcd);
    let f = m.open_ro();
    let seen = wait_until(Instant::now() + TIMEOUT, || {
        pread_full(&f, 8192, 4096).is_ok_and(|b| b.iter().all(|&x| x == 0xcd))
    });
    assert!(seen, "the forced export never showed qemu-io's write");
    drop(f);
    q.quit();
    assert_bytes_eq(
        &read_all(m.path()),
        &data,
        0,
        "forced export after qemu-io quit",
    );
    m.stop().assert_clean("forced read-only export");
    // With qemu-io gone a writable export is welcome again.
    let m = Mount::start(&w, &img, &w.join("export"), &["--writable"]);
    m.stop().assert_clean("writable export after qemu-io quit");
}

#[test]
fn qcow2_image_and_its_backing_file_are_locked() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("lock-qcow2");
    let base = w.join("base.raw");
    let base_data = random_image(&base, 4 * MIB, 16);
    create_overlay(w.path(), "top.qcow2", "base.raw");
    create_overlay(w.path(), "other.qcow2", "base.raw");
    let top = w.join("top.qcow2");
    let other = w.join("other.qcow2");
    // Something in `other` to commit later.
    run_ok(&mut qemu_io("qcow2", &["write -P 0x5a 0 64k"], &other));

    let m = Mount::start(&w, &top, &w.join("export"), &[]);
    // Read-only qcow2: consistent read, write and resize not shared, on the image and on its
    // backing file alike.
    assert_eq!(held_bytes(&top), vec![100, 201, 203]);
    assert_eq!(held_bytes(&base), vec![100, 201, 203]);
    assert_bytes_eq(&read_all(m.path()), &base_data, 0, "qcow2 export");
    expect_qemu_refused(
        &mut qemu_io("qcow2", &["write -P 0xab 0 4k"], &top),
        &top,
        "qemu-io write to the exported qcow2 image",
    );
    expect_qemu_refused(
        &mut qemu_io("raw", &["write -P 0xab 0 4k"], &base),
        &base,
        "qemu-io write to the backing file",
    );
    // Committing another overlay writes into the shared backing file: refused.
    expect_qemu_refused(
        Command::new("qemu-img").arg("commit").arg(&other),
        &base,
        "qemu-img commit into the backing file",
    );
    expect_locked_out(&w, &["--writable"], &top, &top, "write");
    let line = expect_locked_out(&w, &["--writable"], &base, &base, "write");
    assert!(line.contains("image "), "{line}");
    // Another writable qcow2 on the same backing only reads the backing file: allowed.
    let o = Mount::start(&w, &other, &w.join("other-export"), &["--writable"]);
    assert_eq!(held_bytes(&other), vec![100, 101, 103, 201, 203]);
    o.stop().assert_clean("writable overlay export");
    assert_bytes_eq(
        &read_all(&base),
        &base_data,
        0,
        "backing file after the refusals",
    );
    m.stop().assert_clean("qcow2 export");
    assert!(held_bytes(&top).is_empty() && held_bytes(&base).is_empty());
    // Released: the commit goes through now.
    run_ok(Command::new("qemu-img").arg("commit").arg(&other));
    let mut expected = base_data.clone();
    expected[..65536].fill(0x5a);
    assert_bytes_eq(
        &read_all(&base),
        &expected,
        0,
        "backing file after the commit",
    );
}

#[test]
fn a_backing_file_qemu_writes_is_refused_with_its_name() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("lock-qcow2-backing");
    let base = w.join("base.raw");
    random_image(&base, 4 * MIB, 17);
    create_overlay(w.path(), "top.qcow2", "base.raw");
    let top = w.join("top.qcow2");
    // qemu-io writing the backing file directly.
    let q = QemuHolder::start(&w, "raw", &base, &base, 101);
    let line = expect_locked_out(&w, &[], &top, &base, "shared write");
    assert!(
        line.contains(&format!("backing file {} of image", base.display())),
        "the error should say which backing file: {line}"
    );
    assert!(
        held_bytes(&top).is_empty(),
        "a refused export left locks on the image"
    );
    // --force-share opens the chain anyway.
    let m = Mount::start(&w, &top, &w.join("export"), &["--force-share"]);
    assert_bytes_eq(
        &read_all(m.path()),
        &read_all(&base),
        0,
        "forced qcow2 export",
    );
    m.stop().assert_clean("forced qcow2 export");
    q.quit();
    // qemu-io holding the qcow2 image writable keeps a writable fusex off it too.
    let q = QemuHolder::start(&w, "qcow2", &top, &top, 101);
    expect_locked_out(&w, &["--writable"], &top, &top, "write");
    q.quit();
}

#[test]
fn no_locking_exports_share_an_image_writable() {
    if !require_fuse_and_tools(QEMU) {
        return;
    }
    let w = WorkDir::new("lock-off");
    let img = w.join("disk.img");
    let data = random_image(&img, MIB, 18);
    // What the benchmarks do: several writable exports of one image, as qsd with locking=off.
    let a = Mount::start(&w, &img, &w.join("a"), &["--writable", "--no-locking"]);
    let b = Mount::start(&w, &img, &w.join("b"), &["--writable", "--no-locking"]);
    assert!(held_bytes(&img).is_empty(), "--no-locking took locks");
    assert_bytes_eq(&read_all(b.path()), &data, 0, "second unlocked export");
    a.stop().assert_clean("first unlocked export");
    b.stop().assert_clean("second unlocked export");
    let mp = w.join("bad");
    let r = run_fusex(
        &w,
        &[
            OsString::from("mount"),
            "--no-locking".into(),
            "--force-share".into(),
            img.clone().into(),
            mp.clone().into(),
        ],
        Some(&mp),
    );
    r.assert_one_error_line("--no-locking --force-share");
    assert!(!mp.exists() && fuse_mounts_at(&mp).is_empty());
}
