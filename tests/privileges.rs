//! Privileges (docs/design.md "Privileges"): once the export is up, every thread of the daemon,
//! io_uring workers included, holds only the capabilities its exit path needs (CAP_SYS_ADMIN for
//! the unmount; CAP_DAC_OVERRIDE only when it must clean up in a directory root does not own;
//! CAP_FOWNER only for a writable image another user owns), in its effective, permitted and
//! bounding sets, none inheritable or ambient, with no_new_privs set. The export keeps working and
//! still exits cleanly: unmounted, its mountpoint file and pid file removed.

use std::fs;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use fusex_e2e::*;

const CAP_DAC_OVERRIDE: u64 = 1 << 1;
const CAP_FOWNER: u64 = 1 << 3;
const CAP_SYS_ADMIN: u64 = 1 << 21;

/// A uid/gid no test file belongs to otherwise (nobody).
const OTHER: u32 = 65534;

/// One thread's credentials as `/proc/PID/task/TID/status` shows them.
#[derive(Debug)]
struct ThreadCreds {
    name: String,
    inheritable: u64,
    permitted: u64,
    effective: u64,
    bounding: u64,
    ambient: u64,
    no_new_privs: u64,
}

fn parse_status(text: &str) -> Option<ThreadCreds> {
    let field = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .map(str::trim)
    };
    let hex = |key: &str| u64::from_str_radix(field(key)?, 16).ok();
    Some(ThreadCreds {
        name: field("Name")?.to_string(),
        inheritable: hex("CapInh")?,
        permitted: hex("CapPrm")?,
        effective: hex("CapEff")?,
        bounding: hex("CapBnd")?,
        ambient: hex("CapAmb")?,
        no_new_privs: field("NoNewPrivs")?.parse().ok()?,
    })
}

/// Every thread of `pid` (a thread that ends while being read is skipped).
fn threads(pid: i32) -> Vec<ThreadCreds> {
    let dir = format!("/proc/{pid}/task");
    let mut out = Vec::new();
    for e in fs::read_dir(&dir).unwrap_or_else(|e| panic!("{dir}: {e}")) {
        let Ok(e) = e else { continue };
        let Ok(text) = fs::read_to_string(e.path().join("status")) else {
            continue;
        };
        out.push(
            parse_status(&text)
                .unwrap_or_else(|| panic!("cannot parse {}/status:\n{text}", e.path().display())),
        );
    }
    out
}

/// This test process's permitted set: what the daemon (run by root) starts with.
fn own_permitted() -> u64 {
    let text = fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    parse_status(&text)
        .expect("parse /proc/self/status")
        .permitted
}

/// Waits until the daemon logged its drop (the main thread logs it last, after every other
/// thread dropped), then checks every thread holds exactly `keep`.
#[track_caller]
fn assert_only(m: &Mount, keep: u64, what: &str) {
    let deadline = Instant::now() + TIMEOUT;
    assert!(
        wait_until(deadline, || m.stderr().contains("INFO privileges: ")),
        "{what}: the daemon never logged its privilege drop; stderr:\n{}",
        m.stderr()
    );
    let keep = keep & own_permitted();
    let all = threads(m.pid());
    assert!(
        all.iter().any(|t| t.name.starts_with("fusex-q")),
        "{what}: no queue thread among {all:?}"
    );
    for t in &all {
        // A helper that needs no capability (the runtime directory's sweep) holds none at all.
        let held = if t.name.starts_with("fusex-q") || t.name == "fusex" {
            keep
        } else {
            t.permitted
        };
        assert!(
            (held == keep || held == 0)
                && t.effective == held
                && t.permitted == held
                && t.bounding == held
                && t.inheritable == 0
                && t.ambient == 0
                && t.no_new_privs == 1,
            "{what}: thread {:?} should hold exactly {keep:#x} (or, a helper, \
             nothing) in effective, permitted and bounding, nothing inheritable or ambient, and \
             no_new_privs; has {t:?}\nall threads: {all:#?}",
            t.name
        );
    }
    let names: Vec<&str> = [
        (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"),
        (CAP_DAC_OVERRIDE, "CAP_DAC_OVERRIDE"),
        (CAP_FOWNER, "CAP_FOWNER"),
    ]
    .iter()
    .filter(|(c, _)| keep & c != 0)
    .map(|(_, n)| *n)
    .collect();
    let line = m
        .stderr()
        .lines()
        .find(|l| l.contains("INFO privileges: "))
        .unwrap_or_default()
        .to_string();
    assert!(
        line.contains(&format!("keeps only {} (", names.join(", "))),
        "{what}: the log line should name exactly what is kept ({names:?}): {line}"
    );
}

/// Writes random blocks through the export and reads them back, mirroring them in `model`.
fn exercise(mp: &Path, model: &mut [u8], seed: u64) {
    let f = open_rw(mp);
    let mut rng = Rng::new(seed);
    for _ in 0..32 {
        let len = 1 + rng.below(128 * KIB) as usize;
        let off = rng.below(model.len() as u64 - len as u64);
        let data = rng.bytes(len);
        f.write_all_at(&data, off)
            .expect("write through the export");
        model[off as usize..off as usize + len].copy_from_slice(&data);
    }
    f.sync_all().expect("fsync through the export");
    assert_bytes_eq(&read_all(mp), model, 0, "export after writes");
}

/// A raw image, writable, without passthrough (so requests reach the queues and their io_uring
/// workers): only CAP_SYS_ADMIN is left, the export serves, and the exit removes the mountpoint
/// file fusex created.
#[test]
fn raw_export_keeps_only_sys_admin() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("priv-raw");
    let img = w.join("disk.img");
    let mut model = random_image(&img, 8 * MIB, 301);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &["--writable", "--passthrough", "off"]);
    assert_only(&m, CAP_SYS_ADMIN, "raw, before any request");
    exercise(&mp, &mut model, 302);
    // The requests may have started io-wq workers: they must have the reduced set too.
    assert_only(&m, CAP_SYS_ADMIN, "raw, after requests");
    let st = m.stop();
    st.assert_clean("raw export with privileges dropped");
    assert!(st.flag(&["exit_flush"]), "stats: {}", st.stats());
    assert!(
        !mp.exists(),
        "the mountpoint file fusex created is still there"
    );
    assert_bytes_eq(&read_all(&img), &model, 0, "image after exit");
}

/// The default for a raw image (passthrough where the kernel has it), read-only.
#[test]
fn read_only_passthrough_export_keeps_only_sys_admin() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("priv-ro");
    let img = w.join("disk.img");
    let model = random_image(&img, 4 * MIB, 303);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &[]);
    assert_only(&m, CAP_SYS_ADMIN, "read-only");
    assert_bytes_eq(&read_all(&mp), &model, 0, "read-only export");
    let st = m.stop();
    st.assert_clean("read-only export with privileges dropped");
    assert!(
        !mp.exists(),
        "the mountpoint file fusex created is still there"
    );
    assert_bytes_eq(&read_all(&img), &model, 0, "image after exit");
}

/// --daemonize with a pid file and a qcow2 image: dropped by the time the parent returns, and the
/// exit still removes the pid file and the mountpoint file.
#[test]
fn daemonized_qcow2_export_keeps_only_sys_admin() {
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    let w = WorkDir::new("priv-qcow2");
    let img = w.join("disk.qcow2");
    let size = 8 * MIB;
    run_ok(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&img)
            .arg(size.to_string()),
    );
    let mut model = vec![0u8; size as usize];
    let mp = w.join("export");
    let pid_file = w.join("fusex.pid");
    let (m, live) = Mount::start_daemonized(&w, &img, &mp, &pid_file, &["--writable"])
        .unwrap_or_else(|f| {
            panic!(
                "fusex --daemonize failed (exit {:?}); stderr:\n{}",
                f.code, f.stderr
            )
        });
    assert!(live, "the parent returned before the mount was live");
    assert_only(&m, CAP_SYS_ADMIN, "daemonized qcow2");
    exercise(&mp, &mut model, 304);
    assert_only(&m, CAP_SYS_ADMIN, "daemonized qcow2, after requests");
    let st = m.stop();
    st.assert_clean("daemonized qcow2 export with privileges dropped");
    assert!(
        !mp.exists(),
        "the mountpoint file fusex created is still there"
    );
    assert!(!pid_file.exists(), "the pid file is still there");
    let raw = w.join("back.raw");
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-f", "qcow2", "-O", "raw"])
            .arg(&img)
            .arg(&raw),
    );
    assert_bytes_eq(&read_all(&raw), &model, 0, "qcow2 image after exit");
}

/// A mountpoint and pid file in a directory another user owns: root without CAP_DAC_OVERRIDE
/// could not remove them, so that is kept too, and the exit does remove them.
#[test]
fn foreign_directory_keeps_dac_override() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("priv-dir");
    let img = w.join("disk.img");
    let model = random_image(&img, 4 * MIB, 305);
    let dir = w.join("theirs");
    fs::create_dir(&dir).unwrap();
    std::os::unix::fs::chown(&dir, Some(OTHER), Some(OTHER)).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
    let mp = dir.join("export");
    let pid_file = dir.join("fusex.pid");
    let pid_arg = pid_file.to_str().unwrap();
    let m = Mount::start(&w, &img, &mp, &["--pid-file", pid_arg]);
    assert_only(
        &m,
        CAP_SYS_ADMIN | CAP_DAC_OVERRIDE,
        "mountpoint in another user's directory",
    );
    assert_bytes_eq(&read_all(&mp), &model, 0, "export");
    let st = m.stop();
    st.assert_clean("export in another user's directory");
    assert!(
        !mp.exists(),
        "the mountpoint file fusex created is still there"
    );
    assert!(!pid_file.exists(), "the pid file is still there");
}

/// A writable export of an image another user owns: `touch` on the export sets the image's
/// times, which needs CAP_FOWNER, so that is kept, and it works.
#[test]
fn foreign_image_keeps_fowner_and_times_still_work() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("priv-owner");
    let img = w.join("disk.img");
    let mut model = random_image(&img, 4 * MIB, 306);
    std::os::unix::fs::chown(&img, Some(OTHER), Some(OTHER)).unwrap();
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &["--writable"]);
    assert_only(
        &m,
        CAP_SYS_ADMIN | CAP_FOWNER,
        "writable image of another user",
    );
    exercise(&mp, &mut model, 307);
    let when = 1_500_000_000;
    let f = open_rw(&mp);
    let times = [
        libc::timespec {
            tv_sec: when,
            tv_nsec: 0,
        },
        libc::timespec {
            tv_sec: when,
            tv_nsec: 0,
        },
    ];
    // SAFETY: a valid fd and two timespecs that live across the call.
    let r = unsafe { libc::futimens(std::os::fd::AsRawFd::as_raw_fd(&f), times.as_ptr()) };
    assert_eq!(
        r,
        0,
        "futimens on the export: {}",
        std::io::Error::last_os_error()
    );
    drop(f);
    // SETATTR is answered once the daemon has set the times on the image.
    assert_eq!(
        fs::metadata(&img).unwrap().mtime(),
        when,
        "the image's mtime after futimens on the export"
    );
    // Setting times is the only thing that needed the capability; a read-only export of the same
    // image keeps only CAP_SYS_ADMIN.
    let st = m.stop();
    st.assert_clean("writable export of another user's image");
    assert_eq!(
        fs::metadata(&img).unwrap().uid(),
        OTHER,
        "image owner changed"
    );
    assert_bytes_eq(&read_all(&img), &model, 0, "image after exit");
    let m = Mount::start(&w, &img, &mp, &[]);
    assert_only(&m, CAP_SYS_ADMIN, "read-only image of another user");
    m.stop()
        .assert_clean("read-only export of another user's image");
}
