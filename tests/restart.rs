//! `fusex restart MOUNTPOINT`: the live connection goes to a new daemon while applications keep
//! the export open and busy; a restart that cannot happen leaves the old daemon serving.
//!
//! On the legacy transport the export is handed over; on io_uring (`FUSEX_E2E_TRANSPORT=uring`)
//! the running daemon refuses (docs/design.md, Restart), which these tests check instead.

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use fusex_e2e::*;

/// Whether this run's mounts use the io_uring transport.
fn uring() -> bool {
    std::env::var("FUSEX_E2E_TRANSPORT").is_ok_and(|t| t == "uring")
}

/// How long a condition may take before the test gives up: a hang detector, not a bound.
const PATIENCE: Duration = Duration::from_secs(60);

/// The FUSE connection's device number of the mount at `mp` (it must not change).
fn conn_dev(mp: &Path) -> (u32, u32) {
    let m = fuse_mounts_at(mp);
    assert_eq!(m.len(), 1, "one FUSE mount at {}", mp.display());
    m[0].dev
}

/// `fusex restart MP`, expected to succeed; returns the new daemon's pid once the old one
/// has exited, with the mount still in place.
#[track_caller]
fn restart_ok(w: &WorkDir, m: &mut Mount, pid_file: &Path) -> i32 {
    let old = m.pid();
    let dev = conn_dev(m.path());
    let r = run_fusex(
        w,
        &[Path::new("restart").as_os_str(), m.path().as_os_str()],
        None,
    );
    assert_eq!(
        r.code,
        Some(0),
        "fusex restart failed; stderr:\n{}",
        r.stderr
    );
    assert!(
        r.stdout.is_empty(),
        "restart printed to stdout: {:?}",
        r.stdout
    );
    let new = read_pid(pid_file);
    assert!(
        new > 0 && new != old,
        "pid file names the new daemon ({new}, old {old})"
    );
    assert!(pid_alive(new), "the new daemon runs");
    m.adopt_pid(new);
    assert!(
        wait_until(Instant::now() + PATIENCE, || !pid_alive(old)),
        "the old daemon {old} exits after handing over"
    );
    assert_eq!(conn_dev(m.path()), dev, "the same mount and connection");
    new
}

/// Writers over O_DIRECT, each in its own region of the export, checking every write by reading
/// it back and, every few operations, an older range against the model.
struct Writers {
    stop: Arc<AtomicBool>,
    ops: Arc<AtomicU64>,
    errors: Arc<Mutex<Vec<String>>>,
    handles: Vec<thread::JoinHandle<()>>,
    model: Arc<Mutex<Vec<u8>>>,
}

impl Writers {
    fn start(path: &Path, model: Vec<u8>, threads: u64) -> Writers {
        let size = model.len() as u64;
        let model = Arc::new(Mutex::new(model));
        let stop = Arc::new(AtomicBool::new(false));
        let ops = Arc::new(AtomicU64::new(0));
        let errors = Arc::new(Mutex::new(Vec::new()));
        let region = size / threads;
        let handles = (0..threads)
            .map(|t| {
                let (stop, ops, errors, model) =
                    (stop.clone(), ops.clone(), errors.clone(), model.clone());
                let f = open_rw_direct(path);
                thread::spawn(move || {
                    let mut rng = Rng::new(0x5eed + t);
                    let base = t * region;
                    let blocks = region / 4096;
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let len_blocks = 1 + rng.below(32.min(blocks));
                        let off = base + rng.below(blocks - len_blocks + 1) * 4096;
                        let len = (len_blocks * 4096) as usize;
                        let data = AlignedBuf::from_slice(&rng.bytes(len), 4096);
                        let fail = |what: String| errors.lock().unwrap().push(what);
                        if let Err(e) = f.write_all_at(data.as_slice(), off) {
                            fail(format!("write {len} at {off}: {e}"));
                            break;
                        }
                        model.lock().unwrap()[off as usize..off as usize + len]
                            .copy_from_slice(data.as_slice());
                        let mut back = AlignedBuf::new(len, 4096);
                        if let Err(e) = f.read_exact_at(back.as_mut_slice(), off) {
                            fail(format!("read back {len} at {off}: {e}"));
                            break;
                        }
                        if back.as_slice() != data.as_slice() {
                            fail(format!("read back {len} at {off}: different bytes"));
                            break;
                        }
                        n += 1;
                        if n % 4 == 0 {
                            let off = base + rng.below(blocks - 32.min(blocks) + 1) * 4096;
                            let len = (32.min(blocks) * 4096) as usize;
                            let mut got = AlignedBuf::new(len, 4096);
                            if let Err(e) = f.read_exact_at(got.as_mut_slice(), off) {
                                fail(format!("read {len} at {off}: {e}"));
                                break;
                            }
                            let want =
                                model.lock().unwrap()[off as usize..off as usize + len].to_vec();
                            if got.as_slice() != want.as_slice() {
                                fail(format!("read {len} at {off}: not what was written"));
                                break;
                            }
                        }
                        ops.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        Writers {
            stop,
            ops,
            errors,
            handles,
            model,
        }
    }

    /// Waits until the writers have done `more` operations beyond what they had done, or failed.
    #[track_caller]
    fn wait_for_progress(&self, more: u64) {
        let target = self.ops.load(Ordering::Relaxed) + more;
        let ok = wait_until(Instant::now() + PATIENCE, || {
            self.ops.load(Ordering::Relaxed) >= target || !self.errors.lock().unwrap().is_empty()
        });
        assert!(ok, "the writers made no progress");
        let errors = self.errors.lock().unwrap();
        assert!(errors.is_empty(), "writer errors: {errors:?}");
    }

    /// Stops the writers; returns the model of what the export must hold.
    #[track_caller]
    fn finish(self) -> Vec<u8> {
        self.stop.store(true, Ordering::Relaxed);
        for h in self.handles {
            h.join().expect("writer thread panicked");
        }
        let errors = self.errors.lock().unwrap();
        assert!(errors.is_empty(), "writer errors: {errors:?}");
        let model = self.model.lock().unwrap().clone();
        model
    }
}

fn setup(tag: &str, size: u64) -> (WorkDir, PathBuf, PathBuf, PathBuf, Vec<u8>) {
    let w = WorkDir::new(tag);
    let img = w.join("disk.img");
    let model = random_image(&img, size, 7);
    let mp = w.join("disk.raw");
    let pid_file = w.join("fusex.pid");
    (w, img, mp, pid_file, model)
}

#[test]
fn ten_restarts_under_verified_writes() {
    if !require_fuse() {
        return;
    }
    let (w, img, mp, pid_file, model) = setup("restart-ten", 16 * MIB);
    let (mut m, _) = Mount::start_daemonized(&w, &img, &mp, &pid_file, &["--writable"])
        .unwrap_or_else(|f| panic!("mount failed: {}", f.stderr));
    let writers = Writers::start(&mp, model, 2);
    writers.wait_for_progress(20);
    if uring() {
        let old = m.pid();
        let r = run_fusex(
            &w,
            &[Path::new("restart").as_os_str(), mp.as_os_str()],
            None,
        );
        r.assert_one_error_line("fusex restart of an io_uring export");
        assert!(r.stderr.contains("io_uring"), "{}", r.stderr);
        assert_eq!(
            read_pid(&pid_file),
            old,
            "the old daemon keeps its pid file"
        );
        writers.wait_for_progress(20);
    } else {
        for _ in 0..10 {
            restart_ok(&w, &mut m, &pid_file);
            writers.wait_for_progress(20);
        }
    }
    let model = writers.finish();
    assert_bytes_eq(&read_all(&mp), &model, 0, "export after the restarts");
    let st = m.stop();
    assert!(
        st.exited && !st.left_mounted,
        "the last daemon unmounts at SIGTERM"
    );
    assert_bytes_eq(&read_all(&img), &model, 0, "image after the restarts");
    assert!(!pid_file.exists(), "the last daemon removes the pid file");
    assert!(
        !mp.exists(),
        "the mountpoint fusex created is removed at the end"
    );
}

/// Files opened before a restart and kept open through it do not shut others out: the kernel
/// gives an inode one passthrough backing file at a time, so the new daemon answers opens with
/// the backing id the files already open use (the old one leaves it registered). Registering
/// the image again made every new open fail with EIO until the old files were closed. Both
/// read-only opens (passed through) and read-write ones (mmap passed through) are kept.
#[test]
fn files_kept_open_through_restarts_leave_the_export_open_to_others() {
    if !require_fuse() {
        return;
    }
    let (w, img, mp, pid_file, mut model) = setup("restart-open", 4 * MIB);
    // Handing over is for the legacy transport (io_uring exports refuse, tested above).
    let (mut m, _) = Mount::start_daemonized(
        &w,
        &img,
        &mp,
        &pid_file,
        &["--writable", "--transport", "legacy", "--passthrough", "on"],
    )
    .unwrap_or_else(|f| panic!("mount failed: {}", f.stderr));
    let kept_ro = open_ro(&mp);
    let kept_rw = open_rw(&mp);
    for round in 0..3u64 {
        restart_ok(&w, &mut m, &pid_file);
        // New opens of both kinds, beside the kept ones.
        assert_bytes_eq(&read_all(&mp), &model, 0, "a new read-only open");
        let rw = open_rw(&mp);
        let off = 65536 * (1 + round);
        let text = format!("round {round} through a new open");
        rw.write_all_at(text.as_bytes(), off).unwrap();
        model[off as usize..off as usize + text.len()].copy_from_slice(text.as_bytes());
        drop(rw);
        let text = format!("round {round} through the kept open");
        let off = off + 4096;
        kept_rw.write_all_at(text.as_bytes(), off).unwrap();
        model[off as usize..off as usize + text.len()].copy_from_slice(text.as_bytes());
        let mut seen = vec![0u8; model.len()];
        kept_ro.read_exact_at(&mut seen, 0).unwrap();
        assert_bytes_eq(&seen, &model, 0, "the kept read-only open");
    }
    drop((kept_ro, kept_rw));
    // Nothing open from before: a restart and a new open still work.
    restart_ok(&w, &mut m, &pid_file);
    assert_bytes_eq(
        &read_all(&mp),
        &model,
        0,
        "export after the kept files closed",
    );
    let st = m.stop();
    assert!(st.exited && !st.left_mounted);
    assert_bytes_eq(&read_all(&img), &model, 0, "image after the restarts");
}

/// A daemon logging to its stderr, a file, hands that file to its successor, which logs there
/// too: the log of a chain of restarts is one file. (The restart command's own stderr is a
/// pipe here, and there is no syslog to fall back on in CI: the successors' lines were lost.)
#[test]
fn successors_log_where_the_first_daemon_logged() {
    if !require_fuse() {
        return;
    }
    let (w, img, mp, pid_file, model) = setup("restart-log", MIB);
    let (mut m, _) = Mount::start_daemonized(
        &w,
        &img,
        &mp,
        &pid_file,
        &["--log", "stderr", "--transport", "legacy"],
    )
    .unwrap_or_else(|f| panic!("mount failed: {}", f.stderr));
    let mut pids = vec![m.pid()];
    for _ in 0..2 {
        pids.push(restart_ok(&w, &mut m, &pid_file));
    }
    assert_bytes_eq(&read_all(&mp), &model, 0, "export after the restarts");
    let st = m.stop();
    assert!(st.exited && !st.left_mounted);
    let log = st.stderr;
    for pid in &pids[1..] {
        assert!(
            log.contains(&format!("handed the export over to process {pid}")),
            "{log}"
        );
    }
    assert_eq!(
        log.matches("restart: took over").count(),
        2,
        "each successor's lines: {log}"
    );
    // The last one's stop and end. Its stop line depends on whether the kernel had sent the
    // RELEASE of the read just before (an open file is served until closed, then it ends).
    assert!(log.contains("SIGTERM: "), "the last one's stop: {log}");
    assert!(
        log.lines()
            .last()
            .is_some_and(|l| l.contains("INFO served ")),
        "the last one's end: {log}"
    );
}

/// A restart does not serve an image from a file moved into its path since the mount: the old
/// daemon's writes went to the first file, so the new one would serve other bytes than the
/// applications wrote (and a passed-through export would mix both files, the kernel passing
/// I/O through to the old one). The restart is refused in one line, the old daemon serves on,
/// and after the stop the first file holds what was written. A raw image with and without
/// passthrough, and a writable qcow2 image (opened by the new daemon only once the old one let
/// go, so checked before).
#[test]
fn a_restart_refuses_an_image_replaced_since_the_mount() {
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    for (case, format, passthrough) in [
        ("raw-pt", "raw", "on"),
        ("raw-nopt", "raw", "off"),
        ("qcow2", "qcow2", "auto"),
    ] {
        let w = WorkDir::new(&format!("restart-replaced-{case}"));
        let raw = w.join("data.raw");
        let mut model = random_image(&raw, 4 * MIB, 8);
        let img = w.join(format!("disk.{format}"));
        run_ok(
            std::process::Command::new("qemu-img")
                .args(["convert", "-q", "-O", format])
                .arg(&raw)
                .arg(&img),
        );
        let (mp, pid_file) = (w.join("disk.mnt"), w.join("fusex.pid"));
        let (m, _) = Mount::start_daemonized(
            &w,
            &img,
            &mp,
            &pid_file,
            &[
                "--writable",
                "--transport",
                "legacy",
                "--passthrough",
                passthrough,
            ],
        )
        .unwrap_or_else(|f| panic!("{case}: mount failed: {}", f.stderr));
        let old = m.pid();
        // Moved aside (the daemon keeps it open), and a copy put in its place.
        let moved = w.join(format!("moved.{format}"));
        fs::rename(&img, &moved).unwrap();
        fs::copy(&moved, &img).unwrap();
        let f = open_rw(&mp);
        f.write_all_at(b"after the swap", 8192).unwrap();
        f.sync_all().unwrap();
        drop(f);
        model[8192..8206].copy_from_slice(b"after the swap");
        let r = restart(&w, &mp);
        r.assert_one_error_line(&format!("{case}: fusex restart with the image replaced"));
        assert!(r.stderr.contains("another file"), "{case}: {}", r.stderr);
        assert!(pid_alive(old), "{case}: the old daemon still runs");
        assert_eq!(read_pid(&pid_file), old, "{case}: and keeps its pid file");
        assert_bytes_eq(&read_all(&mp), &model, 0, &format!("{case}: the export"));
        let st = m.stop();
        assert!(st.exited && !st.left_mounted, "{case}");
        let out = w.join("out.raw");
        run_ok(
            std::process::Command::new("qemu-img")
                .args(["convert", "-q", "-O", "raw"])
                .arg(&moved)
                .arg(&out),
        );
        assert_bytes_eq(
            &fs::read(&out).unwrap(),
            &model,
            0,
            &format!("{case}: the file served"),
        );
    }
}

/// An upgrade: `fusex restart` run by another fusex binary makes that binary the daemon, with
/// the same mount and the same bytes.
#[test]
fn restart_from_another_binary_swaps_the_daemon() {
    if !require_fuse() {
        return;
    }
    let (w, img, mp, pid_file, model) = setup("restart-swap", 4 * MIB);
    let (mut m, _) = Mount::start_daemonized(&w, &img, &mp, &pid_file, &["--writable"])
        .unwrap_or_else(|f| panic!("mount failed: {}", f.stderr));
    // Copied by a child, so this process never holds the new binary open for writing (a fork
    // elsewhere in the test binary would make executing it fail with ETXTBSY).
    let upgraded = w.join("fusex-upgraded");
    run_ok(
        std::process::Command::new("cp")
            .arg(fusex_bin())
            .arg(&upgraded),
    );
    let old = m.pid();
    let dev = conn_dev(&mp);
    let mut cmd = std::process::Command::new(&upgraded);
    cmd.arg("restart").arg(&mp);
    let r = run_with_timeout(&w, cmd, None);
    if uring() {
        r.assert_one_error_line("fusex restart of an io_uring export by another binary");
        assert_eq!(read_pid(&pid_file), old, "the old daemon keeps serving");
    } else {
        assert_eq!(
            r.code,
            Some(0),
            "restart by another binary; stderr:\n{}",
            r.stderr
        );
        let new = read_pid(&pid_file);
        assert!(new > 0 && new != old, "pid file names the new daemon");
        m.adopt_pid(new);
        assert!(
            wait_until(Instant::now() + PATIENCE, || !pid_alive(old)),
            "the old daemon {old} exits after handing over"
        );
        assert_eq!(
            fs::read_link(format!("/proc/{new}/exe")).expect("the new daemon's executable"),
            upgraded.canonicalize().unwrap(),
            "the new daemon runs the upgraded binary"
        );
        assert_eq!(conn_dev(&mp), dev, "the same mount and connection");
    }
    assert_bytes_eq(&read_all(&mp), &model, 0, "export after the swap");
    let st = m.stop();
    assert!(
        st.exited && !st.left_mounted,
        "the daemon unmounts at SIGTERM"
    );
}

#[test]
fn a_failed_restart_leaves_the_old_daemon_serving() {
    if !require_fuse() {
        return;
    }
    let (w, img, mp, pid_file, model) = setup("restart-fail", 4 * MIB);
    let (m, _) = Mount::start_daemonized(&w, &img, &mp, &pid_file, &["--writable"])
        .unwrap_or_else(|f| panic!("mount failed: {}", f.stderr));
    let old = m.pid();
    // The new daemon cannot reopen the image: it is not at its path any more.
    let moved = w.join("moved.img");
    fs::rename(&img, &moved).unwrap();
    let r = restart(&w, &mp);
    r.assert_one_error_line("fusex restart with the image gone");
    if uring() {
        assert!(r.stderr.contains("io_uring"), "{}", r.stderr);
    } else {
        assert!(
            r.stderr.contains("disk.img"),
            "names the image: {}",
            r.stderr
        );
    }
    fs::rename(&moved, &img).unwrap();
    assert!(pid_alive(old), "the old daemon still runs");
    assert_eq!(read_pid(&pid_file), old, "and keeps its pid file");
    // And still serves, reads and writes.
    let f = open_rw(&mp);
    f.write_all_at(b"still here", 4096).unwrap();
    let mut want = model;
    want[4096..4106].copy_from_slice(b"still here");
    assert_bytes_eq(&read_all(&mp), &want, 0, "export after the failed restart");
    drop(f);
    // Not mounted with the io_uring transport, a restart with the image back works.
    if !uring() {
        let mut m = m;
        restart_ok(&w, &mut m, &pid_file);
        assert_bytes_eq(&read_all(&mp), &want, 0, "export after the restart");
        let st = m.stop();
        assert!(st.exited && !st.left_mounted);
    } else {
        let st = m.stop();
        assert!(st.exited && !st.left_mounted);
    }
}

#[test]
fn the_auto_unmount_watcher_follows_the_restart() {
    if !require_fuse() {
        return;
    }
    let (w, img, mp, pid_file, model) = setup("restart-watch", 4 * MIB);
    // Handing over is for the legacy transport (io_uring exports refuse, tested above).
    let (mut m, _) = Mount::start_daemonized(
        &w,
        &img,
        &mp,
        &pid_file,
        &["--writable", "--auto-unmount", "--transport", "legacy"],
    )
    .unwrap_or_else(|f| panic!("mount failed: {}", f.stderr));
    let new = restart_ok(&w, &mut m, &pid_file);
    // The old daemon's exit released its end of the watcher's pipe; the new one holds it.
    assert_bytes_eq(&read_all(&mp), &model, 0, "export served by the new daemon");
    assert!(m.is_mounted(), "the mount outlived the old daemon");
    send_signal(new, libc::SIGKILL);
    assert!(
        wait_until(Instant::now() + PATIENCE, || !m.is_mounted()),
        "the watcher unmounts once the new daemon dies"
    );
    let _ = m.wait_exit();
}

/// Waits for one datagram on `sock` (its read timeout is set by the caller).
fn datagram(sock: &std::os::unix::net::UnixDatagram) -> String {
    recv_datagram(sock)
}

#[test]
fn systemd_hears_reloading_the_new_main_pid_and_ready() {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    if !require_fuse() {
        return;
    }
    let (w, img, mp, pid_file, model) = setup("restart-notify", 4 * MIB);
    let name = format!("fusex-e2e-restart-notify-{}", std::process::id());
    let sock =
        UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    sock.set_read_timeout(Some(TIMEOUT)).unwrap();
    let opts = SpawnOpts {
        env: vec![("NOTIFY_SOCKET".into(), format!("@{name}").into())],
        ..SpawnOpts::default()
    };
    // Handing over is for the legacy transport (io_uring exports refuse, tested above).
    let (mut m, _) = Mount::start_daemonized_opts(
        &w,
        &img,
        &mp,
        &pid_file,
        &["--writable", "--transport", "legacy"],
        &opts,
    )
    .unwrap_or_else(|f| panic!("mount failed: {}", f.stderr));
    let old = m.pid();
    let ready = datagram(&sock);
    assert!(ready.lines().any(|l| l == "READY=1"), "{ready:?}");
    assert!(
        ready.lines().any(|l| l == format!("MAINPID={old}")),
        "{ready:?}"
    );
    // `fusex restart` runs without NOTIFY_SOCKET: the new daemon uses the old one's.
    let new = restart_ok(&w, &mut m, &pid_file);
    let reloading = datagram(&sock);
    assert!(
        reloading.lines().any(|l| l == "RELOADING=1"),
        "{reloading:?}"
    );
    assert!(
        reloading.lines().any(|l| l.starts_with("MONOTONIC_USEC=")),
        "{reloading:?}"
    );
    let main = datagram(&sock);
    assert_eq!(
        main,
        format!("MAINPID={new}"),
        "the old daemon names its successor"
    );
    let ready = datagram(&sock);
    assert!(ready.lines().any(|l| l == "READY=1"), "{ready:?}");
    assert!(
        ready.lines().any(|l| l == format!("MAINPID={new}")),
        "{ready:?}"
    );
    assert_bytes_eq(&read_all(&mp), &model, 0, "export served by the new daemon");
    let st = m.stop();
    assert!(st.exited && !st.left_mounted);
    let stopping = datagram(&sock);
    assert!(stopping.lines().any(|l| l == "STOPPING=1"), "{stopping:?}");
}

#[test]
fn restarts_of_a_writable_qcow2_export_keep_its_metadata_whole() {
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    let w = WorkDir::new("restart-qcow2");
    let img = w.join("disk.qcow2");
    run_ok(
        std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&img)
            .arg("16M"),
    );
    let mp = w.join("disk.raw");
    let pid_file = w.join("fusex.pid");
    // Handing over is for the legacy transport (io_uring exports refuse, tested above): this
    // test is about the qcow2 metadata, so it runs there in both passes of the suite.
    let (mut m, _) = Mount::start_daemonized(
        &w,
        &img,
        &mp,
        &pid_file,
        &["--writable", "--transport", "legacy"],
    )
    .unwrap_or_else(|f| panic!("mount failed: {}", f.stderr));
    // Every write allocates clusters while the daemons change hands.
    let writers = Writers::start(&mp, vec![0u8; 16 * MIB as usize], 2);
    writers.wait_for_progress(20);
    for _ in 0..5 {
        restart_ok(&w, &mut m, &pid_file);
        writers.wait_for_progress(20);
    }
    let model = writers.finish();
    assert_bytes_eq(&read_all(&mp), &model, 0, "export after the restarts");
    let st = m.stop();
    assert!(st.exited && !st.left_mounted);
    run_ok(
        std::process::Command::new("qemu-img")
            .args(["check", "-q"])
            .arg(&img),
    );
    let want = w.join("model.raw");
    fs::write(&want, &model).unwrap();
    run_ok(
        std::process::Command::new("qemu-img")
            .args(["compare", "-q", "-f", "qcow2", "-F", "raw"])
            .arg(&img)
            .arg(&want),
    );
}

/// VHD and VDI keep their block tables in memory: a successor must read them only once its
/// predecessor let go, or it would allocate over blocks allocated meanwhile. Writers keep
/// allocating blocks of a sparse image across restarts; the image then equals the model.
#[test]
fn restarts_of_writable_vhd_and_vdi_exports_keep_their_tables_whole() {
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    for (fmt, opts, check) in [("vpc", "force_size=on", false), ("vdi", "static=off", true)] {
        let w = WorkDir::new(&format!("restart-{fmt}"));
        let img = w.join(format!("disk.{fmt}"));
        run_ok(
            std::process::Command::new("qemu-img")
                .args(["create", "-q", "-f", fmt, "-o", opts])
                .arg(&img)
                .arg("256M"),
        );
        let mp = w.join("disk.raw");
        let pid_file = w.join("fusex.pid");
        // Handed over on the legacy transport only (see the qcow2 test above).
        let (mut m, _) = Mount::start_daemonized(
            &w,
            &img,
            &mp,
            &pid_file,
            &["--writable", "--transport", "legacy"],
        )
        .unwrap_or_else(|f| panic!("{fmt}: mount failed: {}", f.stderr));
        let writers = Writers::start(&mp, vec![0u8; 256 * MIB as usize], 2);
        writers.wait_for_progress(20);
        for _ in 0..4 {
            restart_ok(&w, &mut m, &pid_file);
            writers.wait_for_progress(20);
        }
        let model = writers.finish();
        assert_bytes_eq(
            &read_all(&mp),
            &model,
            0,
            &format!("{fmt}: after the restarts"),
        );
        let st = m.stop();
        assert!(st.exited && !st.left_mounted, "{fmt}: {st:?}");
        if check {
            run_ok(
                std::process::Command::new("qemu-img")
                    .args(["check", "-q", "-f", fmt])
                    .arg(&img),
            );
        }
        let want = w.join("model.raw");
        fs::write(&want, &model).unwrap();
        run_ok(
            std::process::Command::new("qemu-img")
                .args(["compare", "-q", "-f", fmt, "-F", "raw"])
                .arg(&img)
                .arg(&want),
        );
    }
}

/// VHDX, as VHD and VDI above: each successor also writes the next header (new write GUIDs, the
/// next sequence number) once its predecessor let go; the image then equals the model and
/// `qemu-img check` finds it clean.
#[test]
fn restarts_of_a_writable_vhdx_export_keep_its_table_whole() {
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    let w = WorkDir::new("restart-vhdx");
    let img = w.join("disk.vhdx");
    run_ok(
        std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", "vhdx", "-o", "block_size=1M"])
            .arg(&img)
            .arg("256M"),
    );
    let mp = w.join("disk.raw");
    let pid_file = w.join("fusex.pid");
    let (mut m, _) = Mount::start_daemonized(
        &w,
        &img,
        &mp,
        &pid_file,
        &["--writable", "--transport", "legacy"],
    )
    .unwrap_or_else(|f| panic!("vhdx: mount failed: {}", f.stderr));
    let writers = Writers::start(&mp, vec![0u8; 256 * MIB as usize], 2);
    writers.wait_for_progress(20);
    for _ in 0..4 {
        restart_ok(&w, &mut m, &pid_file);
        writers.wait_for_progress(20);
    }
    let model = writers.finish();
    assert_bytes_eq(&read_all(&mp), &model, 0, "vhdx: after the restarts");
    let st = m.stop();
    assert!(st.exited && !st.left_mounted, "vhdx: {st:?}");
    run_ok(
        std::process::Command::new("qemu-img")
            .args(["check", "-q", "-f", "vhdx"])
            .arg(&img),
    );
    let want = w.join("model.raw");
    fs::write(&want, &model).unwrap();
    run_ok(
        std::process::Command::new("qemu-img")
            .args(["compare", "-q", "-f", "vhdx", "-F", "raw"])
            .arg(&img)
            .arg(&want),
    );
}

#[test]
fn fio_verify_runs_through_ten_restarts() {
    if !require_fuse_and_tools(&["fio"]) {
        return;
    }
    let (w, img, mp, pid_file, _) = setup("restart-fio", 16 * MIB);
    let (mut m, _) = Mount::start_daemonized(&w, &img, &mp, &pid_file, &["--writable"])
        .unwrap_or_else(|f| panic!("mount failed: {}", f.stderr));
    fio_verify_through_restarts(&w, &mut m, &img, &pid_file, 10);
    let st = m.stop();
    assert!(st.exited && !st.left_mounted);
}

/// fio writing 4k blocks with a crc32c each through the writable export `m` (whose writes land
/// in `img`), verifying them as it goes, while the export is restarted `restarts` times (once,
/// refused, over io_uring): fio reports no error and no verify failure.
#[track_caller]
fn fio_verify_through_restarts(
    w: &WorkDir,
    m: &mut Mount,
    img: &Path,
    pid_file: &Path,
    restarts: usize,
) {
    /// fio's queue depth: at most this many of its requests are in flight at any time.
    const IODEPTH: u64 = 16;
    let mp = m.path().to_path_buf();
    let mut writes = WriteWatch::new(img);
    let fio_log = w.join("fio.json");
    // Writes with a crc32c in every block, each verified by reading it back soon after
    // (verify_backlog), pass after pass until stopped.
    let mut fio = ChildGuard(
        fio_command(
            w,
            &mp,
            &[
                "--name=v",
                "--rw=randwrite",
                "--bs=4k",
                &format!("--iodepth={IODEPTH}"),
                "--ioengine=libaio",
                "--size=8M",
                "--loops=1000000",
                "--verify=crc32c",
                "--verify_backlog=64",
                "--verify_fatal=1",
                "--output-format=json",
            ],
        )
        .stdout(fs::File::create(&fio_log).unwrap())
        .stderr(fs::File::create(w.join("fio.stderr")).unwrap())
        .spawn()
        .expect("spawn fio"),
    );
    let fio_output = || {
        format!(
            "{}\n{}",
            String::from_utf8_lossy(&fs::read(&fio_log).unwrap_or_default()),
            String::from_utf8_lossy(&fs::read(w.join("fio.stderr")).unwrap_or_default()),
        )
    };
    let restarts = if uring() { 1 } else { restarts };
    for _ in 0..restarts {
        let n = writes.seen();
        let flowing = writes.wait_for_more_than(n + IODEPTH, &mut fio, Instant::now() + PATIENCE);
        if let Some(st) = fio.try_wait() {
            panic!("fio ended during the restarts ({st}):\n{}", fio_output());
        }
        assert!(
            flowing,
            "fio's writes stopped reaching the image:\n{}",
            fio_output()
        );
        if uring() {
            let r = run_fusex(w, &[Path::new("restart").as_os_str(), mp.as_os_str()], None);
            r.assert_one_error_line("fusex restart of an io_uring export");
        } else {
            restart_ok(w, m, pid_file);
        }
    }
    let n = writes.seen();
    assert!(
        writes.wait_for_more_than(n + IODEPTH, &mut fio, Instant::now() + PATIENCE),
        "fio's writes reach the image after the last restart"
    );
    // SIGINT: fio finishes what it has in flight and writes its report.
    send_signal(fio.pid(), libc::SIGINT);
    let done = wait_until(Instant::now() + PATIENCE, || fio.try_wait().is_some());
    assert!(done, "fio ends at SIGINT");
    // fio says "terminating on signal 2" ahead of its report.
    let out = fs::read(&fio_log).unwrap();
    let start = out.iter().position(|&b| b == b'{').unwrap_or(0);
    let report: serde_json::Value = serde_json::from_slice(&out[start..])
        .unwrap_or_else(|e| panic!("fio's report: {e}\n{}", fio_output()));
    let job = &report["jobs"][0];
    assert_eq!(job["error"], 0, "fio saw an error:\n{}", fio_output());
    assert!(
        job["write"]["io_bytes"].as_u64().unwrap_or(0) > 0,
        "fio wrote:\n{}",
        fio_output()
    );
    // The verify reads (verify_backlog) are counted as reads.
    assert!(
        job["read"]["io_bytes"].as_u64().unwrap_or(0) > 0,
        "fio verified:\n{}",
        fio_output()
    );
    let stderr = String::from_utf8_lossy(&fs::read(w.join("fio.stderr")).unwrap()).to_string();
    assert!(
        !stderr.contains("verify") && !stderr.to_lowercase().contains("error"),
        "fio complained:\n{stderr}"
    );
}

/// fio's verified writes through an NBD export of qemu-nbd (default sharing: one client) go on
/// through three restarts without an error; what the export shows at the end is what the image
/// holds once unmounted.
#[test]
fn fio_verify_runs_through_restarts_of_an_nbd_export() {
    if !require_fuse_and_tools(&["fio", "qemu-nbd"]) {
        return;
    }
    let (w, img, mp, pid_file, _) = setup("restart-nbd-fio", 16 * MIB);
    let sock = w.join("s.sock");
    let mut server = qemu_nbd(&sock, &["-f", "raw"], &img);
    let (mut m, _) =
        Mount::start_daemonized(&w, nbd_uri(&sock, ""), &mp, &pid_file, &["--writable"])
            .unwrap_or_else(|f| panic!("mount failed: {}", f.stderr));
    fio_verify_through_restarts(&w, &mut m, &img, &pid_file, 3);
    let through = read_all(&mp);
    let st = m.stop();
    assert!(st.exited && !st.left_mounted);
    server.kill_and_wait();
    assert_bytes_eq(&read_all(&img), &through, 0, "the image after the restarts");
}

/// Restarts of the NBD export at `mp` (mounted writable from `image`'s server with `pid_file`)
/// under verified writers (`model`: the export's bytes now): each hands the server's only
/// connection over (qemu-nbd's default `--shared=1` takes one client at a time), and no write or
/// read fails. Returns what the export must hold. Over io_uring the restart is refused for that
/// transport's reason and the daemon serves on.
#[track_caller]
fn nbd_restarts_under_writers(
    w: &WorkDir,
    m: &mut Mount,
    pid_file: &Path,
    model: Vec<u8>,
    restarts: usize,
) -> Vec<u8> {
    let mp = m.path().to_path_buf();
    let writers = Writers::start(&mp, model, 2);
    writers.wait_for_progress(20);
    if uring() {
        let old = m.pid();
        restart(w, &mp).assert_one_error_line("fusex restart of an io_uring NBD export");
        assert_eq!(read_pid(pid_file), old, "the old daemon serves on");
        writers.wait_for_progress(20);
    } else {
        for _ in 0..restarts {
            restart_ok(w, m, pid_file);
            writers.wait_for_progress(20);
        }
    }
    let model = writers.finish();
    assert_bytes_eq(&read_all(&mp), &model, 0, "the export after the restarts");
    model
}

/// qemu-nbd with its default sharing: one client at a time, so the new daemon can connect only
/// once the old one has let go of its connection. `-t`: it serves on when that client leaves.
#[test]
fn restarts_of_an_nbd_export_hand_the_servers_one_connection_over() {
    if !require_fuse_and_tools(&["qemu-nbd"]) {
        return;
    }
    let (w, img, mp, pid_file, model) = setup("restart-nbd", 8 * MIB);
    let sock = w.join("s.sock");
    let mut server = qemu_nbd(&sock, &["-f", "raw"], &img);
    let (mut m, _) =
        Mount::start_daemonized(&w, nbd_uri(&sock, ""), &mp, &pid_file, &["--writable"])
            .unwrap_or_else(|f| panic!("mount failed: {}", f.stderr));
    let model = nbd_restarts_under_writers(&w, &mut m, &pid_file, model, 3);
    end_over_a_server(m, &mut server, &img, &model);
}

/// Stops the last daemon of an export of `server` (which must serve on: the daemons left it, it
/// was not stopped), then stops the server and compares `img` with `model`.
#[track_caller]
fn end_over_a_server(m: Mount, server: &mut ChildGuard, img: &Path, model: &[u8]) {
    let st = m.stop();
    assert!(st.exited && !st.left_mounted, "the last daemon unmounts");
    assert!(server.try_wait().is_none(), "the NBD server serves on");
    server.kill_and_wait();
    assert_bytes_eq(&read_all(img), model, 0, "the image after the restarts");
}

/// A server that turns a second client away at once (nbdkit's limit filter), where qemu-nbd
/// would keep it waiting: the new daemon connects only after the old one disconnected, or its
/// first requests would fail.
#[test]
fn restarts_of_an_nbd_export_of_a_server_that_refuses_a_second_client() {
    if !require_fuse_and_tools(&["nbdkit"]) {
        return;
    }
    let (w, img, mp, pid_file, model) = setup("restart-nbd-limit", 8 * MIB);
    let sock = w.join("s.sock");
    let image = format!("file={}", img.display());
    let mut server = nbdkit(&sock, &["--filter=limit", "file", &image, "limit=1"]);
    // The file plugin offers multi-conn; one queue, so one connection at a time.
    let (mut m, _) = Mount::start_daemonized(
        &w,
        nbd_uri(&sock, ""),
        &mp,
        &pid_file,
        &["--writable", "--queues", "1"],
    )
    .unwrap_or_else(|f| panic!("mount failed: {}", f.stderr));
    let model = nbd_restarts_under_writers(&w, &mut m, &pid_file, model, 3);
    end_over_a_server(m, &mut server, &img, &model);
}

/// A partition of an NBD export: the new daemon reads the partition table on its first
/// connection, made once the old daemon disconnected; nothing outside the partition changes.
#[test]
fn restarts_of_a_partition_of_an_nbd_export_keep_its_data() {
    if !require_fuse_and_tools(&["qemu-nbd", "sfdisk"]) {
        return;
    }
    let (w, img, mp, pid_file, _) = setup("restart-nbd-part", 16 * MIB);
    let mut c = std::process::Command::new("sfdisk");
    c.arg("-q").arg(&img).stdin(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    {
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(b"label: dos\nstart=2048, size=8M, type=83\n")
            .unwrap();
    }
    assert!(child.wait().unwrap().success());
    let before = read_all(&img);
    restarts_of_a_window_of_an_nbd_export(
        &w,
        (&img, &mp, &pid_file),
        before,
        MIB as usize..9 * MIB as usize,
        &["--partition", "1"],
    );
}

/// A byte range of an NBD export (`--offset`, `--size`, QEMU raw's `offset` and `size`) goes
/// to each new daemon as it is, adopted with the server's connection: writes land inside it.
#[test]
fn restarts_of_a_byte_range_of_an_nbd_export_keep_its_data() {
    if !require_fuse_and_tools(&["qemu-nbd"]) {
        return;
    }
    let (w, img, mp, pid_file, before) = setup("restart-nbd-range", 16 * MIB);
    restarts_of_a_window_of_an_nbd_export(
        &w,
        (&img, &mp, &pid_file),
        before,
        3 * MIB as usize..11 * MIB as usize,
        &["--offset", "3M", "--size", "8M"],
    );
}

/// Exports `window` of `img` (which holds `before`) from qemu-nbd with `args` (a partition or a
/// byte range), restarts it three times under verified writers, and checks that the image
/// changed inside the window only, as the writers left it.
#[track_caller]
fn restarts_of_a_window_of_an_nbd_export(
    w: &WorkDir,
    (img, mp, pid_file): (&Path, &Path, &Path),
    before: Vec<u8>,
    window: std::ops::Range<usize>,
    args: &[&str],
) {
    let sock = w.join("s.sock");
    let mut server = qemu_nbd(&sock, &["-f", "raw"], img);
    let args = [&["--writable"], args].concat();
    let (mut m, _) = Mount::start_daemonized(w, nbd_uri(&sock, ""), mp, pid_file, &args)
        .unwrap_or_else(|f| panic!("mount failed: {}", f.stderr));
    let model = nbd_restarts_under_writers(w, &mut m, pid_file, before[window.clone()].to_vec(), 3);
    let st = m.stop();
    assert!(st.exited && !st.left_mounted, "the last daemon unmounts");
    server.kill_and_wait();
    let mut want = before;
    want[window].copy_from_slice(&model);
    assert_bytes_eq(&read_all(img), &want, 0, "the image after the restarts");
}

/// The same over TLS on TCP (`nbds://`): a TLS session cannot move to another process, so the
/// new daemon makes its own once the old one said goodbye.
#[test]
fn restarts_of_a_tls_nbd_export_make_a_new_session() {
    if !require_fuse_and_tools(&["qemu-nbd", "openssl"]) {
        return;
    }
    let (w, img, mp, pid_file, model) = setup("restart-nbds", 8 * MIB);
    let pki = w.join("pki");
    make_pki(&pki, "fusex-restart-ca");
    let port = free_port();
    let creds = format!(
        "tls-creds-x509,id=tls0,dir={},endpoint=server,verify-peer=on",
        pki.display()
    );
    let mut server = nbd_server_tcp(
        {
            let mut c = std::process::Command::new("qemu-nbd");
            c.args(["-t", "-f", "raw", "-b", "127.0.0.1", "-p"])
                .arg(port.to_string())
                .args(["--object", &creds, "--tls-creds", "tls0"])
                .arg(&img);
            c
        },
        port,
    );
    let uri = format!(
        "nbds://localhost:{port}/?tls-certificates={}",
        pki.display()
    );
    let (mut m, _) = Mount::start_daemonized(&w, &uri, &mp, &pid_file, &["--writable"])
        .unwrap_or_else(|f| panic!("mount failed: {}", f.stderr));
    let model = nbd_restarts_under_writers(&w, &mut m, &pid_file, model, 3);
    end_over_a_server(m, &mut server, &img, &model);
}

/// `fusex serve` hands an NBD export (a node of qemu-nbd with its default sharing) to the new
/// daemon the same way, under verified writers; the successor adds the node again without
/// connecting, and the node keeps its size.
#[test]
fn a_serve_daemon_hands_an_nbd_export_over() {
    if !require_fuse_and_tools(&["qemu-nbd"]) {
        return;
    }
    let (w, img, mp, pid_file, model) = setup("restart-serve-nbd", 8 * MIB);
    let sock = w.join("s.sock");
    let mut server = qemu_nbd(&sock, &["-f", "raw"], &img);
    fs::write(&mp, b"").unwrap();
    let mut serve = Serve::start(w.path(), &["--pidfile", pid_file.to_str().unwrap()]);
    let _guard = PidGuard(pid_file.clone(), w.path().to_path_buf());
    let mut q = serve.qmp();
    q.ok(
        "blockdev-add",
        serde_json::json!({"driver": "nbd", "node-name": "n", "export": "",
                           "server": {"type": "unix", "path": sock}}),
    );
    q.ok(
        "block-export-add",
        serde_json::json!({"type": "fuse", "id": "e", "node-name": "n", "mountpoint": mp,
                           "writable": true, "__org.fusex_transport": "legacy"}),
    );
    let writers = Writers::start(&mp, model, 2);
    writers.wait_for_progress(20);
    drop(q);
    let new = serve.restart(&w, &mp, &pid_file);
    writers.wait_for_progress(20);
    let model = writers.finish();
    assert_bytes_eq(&read_all(&mp), &model, 0, "the export after the restart");
    let mut q = Qmp::connect(&serve.socket);
    let nodes = q.ok("query-named-block-nodes", serde_json::json!({}));
    let n = nodes
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node-name"] == "n")
        .unwrap_or_else(|| panic!("node n is gone: {nodes}"));
    assert_eq!(n["image"]["virtual-size"], 8 * MIB, "{n}");
    q.ok("quit", serde_json::json!({}));
    assert!(
        wait_until(Instant::now() + PATIENCE, || !pid_alive(new)),
        "quit ends the new daemon"
    );
    assert!(server.try_wait().is_none(), "qemu-nbd serves on");
    server.kill_and_wait();
    assert_bytes_eq(&read_all(&img), &model, 0, "the image after the restart");
}

/// `fusex restart MP`; the one-line result.
fn restart(w: &WorkDir, mp: &Path) -> CmdResult {
    run_fusex(w, &[Path::new("restart").as_os_str(), mp.as_os_str()], None)
}

#[test]
fn a_restart_right_after_the_mount_appears_waits_or_leaves_the_export_restartable() {
    if !require_fuse() {
        return;
    }
    let (w, img, mp, pid_file, model) = setup("restart-early", 4 * MIB);
    let pf = pid_file.to_str().unwrap();
    for round in 0..3 {
        let _cleanup = UnmountOnDrop(mp.clone());
        // `Mount::start` returns as soon as the "mounted" line is logged: queues may still be
        // starting, and the restart listener may not listen yet.
        let m = Mount::start(&w, &img, &mp, &["--writable", "--pid-file", pf]);
        let first = m.pid();
        let early = restart(&w, &mp);
        if uring() {
            early.assert_one_error_line("restart of an io_uring export");
            assert!(early.stderr.contains("io_uring"), "{}", early.stderr);
            m.stop().assert_clean("uring export");
            continue;
        }
        // The foreground daemon still serving, if the early restart did not take over.
        let still = if early.code == Some(0) {
            // Handed over once the queues served.
            let st = m.wait_exit_handed_over();
            assert!(st.exited && st.code == Some(0), "round {round}: {st:?}");
            None
        } else {
            early.assert_one_error_line("an early restart");
            assert!(
                !early.stderr.contains("stopping"),
                "round {round}: a starting daemon is not stopping: {}",
                early.stderr
            );
            Some(m)
        };
        // Either way the export is still restartable, and serves the image.
        let serving = read_pid(&pid_file);
        let again = restart(&w, &mp);
        assert_eq!(again.code, Some(0), "round {round}: {}", again.stderr);
        if let Some(m) = still {
            let st = m.wait_exit_handed_over();
            assert!(st.exited && st.code == Some(0), "round {round}: {st:?}");
        }
        let next = read_pid(&pid_file);
        assert!(
            next != serving && next != first,
            "round {round}: a new daemon serves"
        );
        assert!(wait_until(Instant::now() + PATIENCE, || !pid_alive(
            serving
        )));
        assert_bytes_eq(&read_all(&mp), &model, 0, "export after the restarts");
        let r = run_fusex(&w, &[Path::new("umount").as_os_str(), mp.as_os_str()], None);
        assert_eq!(r.code, Some(0), "{}", r.stderr);
        assert!(wait_until(Instant::now() + PATIENCE, || !pid_alive(next)));
    }
}

/// A writable VMDK export (its grains allocated while the daemons change hands) and a
/// writable partition of a qcow2 image survive five restarts each: the guest bytes are the
/// writers' model, `qemu-img check` passes, and nothing outside the partition changed.
#[test]
fn restarts_of_a_vmdk_export_and_of_a_partition_keep_their_data() {
    if !require_fuse_and_tools(&["qemu-img", "sfdisk"]) {
        return;
    }
    let w = WorkDir::new("restart-formats");
    let qemu = |args: &[&str], paths: &[&Path]| {
        run_ok(
            std::process::Command::new("qemu-img")
                .args(args)
                .args(paths),
        );
    };
    // The VMDK: a split sparse image (descriptor and one extent file).
    let vmdk = w.join("disk.vmdk");
    qemu(
        &[
            "create",
            "-q",
            "-f",
            "vmdk",
            "-o",
            "subformat=twoGbMaxExtentSparse",
        ],
        &[&vmdk, Path::new("16M")],
    );
    // The partition: partition 1 of an MBR disk inside a qcow2 image.
    let raw = w.join("disk.raw");
    sparse_image(&raw, 32 * MIB);
    let mut c = std::process::Command::new("sfdisk");
    c.arg("-q").arg(&raw).stdin(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    {
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(b"label: dos\nstart=2048, size=16M, type=83\n")
            .unwrap();
    }
    assert!(child.wait().unwrap().success());
    let qcow2 = w.join("disk.qcow2");
    qemu(&["convert", "-f", "raw", "-O", "qcow2"], &[&raw, &qcow2]);
    for (img, extra, what) in [
        (&vmdk, None, "vmdk"),
        (&qcow2, Some("--partition=1"), "partition"),
    ] {
        let mp = w.join(format!("{what}.export"));
        let pid_file = w.join(format!("{what}.pid"));
        let mut args = vec!["--writable", "--transport", "legacy"];
        args.extend(extra);
        let (mut m, _) = Mount::start_daemonized(&w, img, &mp, &pid_file, &args)
            .unwrap_or_else(|f| panic!("{what}: mount failed: {}", f.stderr));
        let writers = Writers::start(&mp, vec![0u8; 16 * MIB as usize], 2);
        writers.wait_for_progress(20);
        for _ in 0..5 {
            restart_ok(&w, &mut m, &pid_file);
            writers.wait_for_progress(20);
        }
        let model = writers.finish();
        assert_bytes_eq(
            &read_all(&mp),
            &model,
            0,
            &format!("{what} after the restarts"),
        );
        let st = m.stop();
        assert!(st.exited && !st.left_mounted, "{what}");
        run_ok(
            std::process::Command::new("qemu-img")
                .args(["check", "-q"])
                .arg(img),
        );
        let guest = w.join(format!("{what}.guest"));
        qemu(&["convert", "-O", "raw"], &[img, &guest]);
        let guest = read_all(&guest);
        if extra.is_some() {
            let before = read_all(&raw);
            let (s, e) = (MIB as usize, 17 * MIB as usize);
            assert_bytes_eq(&guest[..s], &before[..s], 0, "before the partition");
            assert_bytes_eq(&guest[e..], &before[e..], e as u64, "after the partition");
            assert_bytes_eq(&guest[s..e], &model, s as u64, "the partition");
        } else {
            assert_bytes_eq(&guest, &model, 0, "the vmdk image");
        }
    }
}
