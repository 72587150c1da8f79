//! Starting and stopping: signals, external unmounts, `fusex umount`, `--daemonize`,
//! what happens to the mountpoint file.

use std::fs::{self, File};
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::process::{Command, Stdio};
use std::time::Instant;

use fusex_e2e::*;

#[test]
fn export_is_a_regular_file_with_the_image_attributes() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("lc-attrs");
    let img = w.join("disk.img");
    let size = 3 * MIB + 512;
    random_image(&img, size, 1);
    fs::set_permissions(&img, fs::Permissions::from_mode(0o640)).unwrap();
    let mp = w.join("export");
    assert!(!mp.exists());
    let m = Mount::start(&w, &img, &mp, &["--writable"]);
    let entries = fuse_mounts_at(&mp);
    assert_eq!(
        entries.len(),
        1,
        "one FUSE mount on the mountpoint: {entries:?}"
    );
    let md = fs::metadata(&mp).expect("stat export");
    let imd = fs::metadata(&img).unwrap();
    assert!(
        md.file_type().is_file(),
        "export must be a regular file: mode {:o}",
        md.mode()
    );
    assert_eq!(md.size(), size, "st_size = image length");
    assert_eq!(
        md.mode() & 0o7777,
        imd.mode() & 0o7777,
        "permission bits follow the image (DESIGN §1)"
    );
    assert_eq!(
        (md.uid(), md.gid()),
        (imd.uid(), imd.gid()),
        "owner follows the image (DESIGN §1)"
    );
    let st = m.stop();
    st.assert_clean("attrs");
    assert!(
        !mp.exists(),
        "mountpoint created by fusex must be removed on exit"
    );
}

#[test]
fn sigterm_unmounts_and_removes_created_mountpoint() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("lc-sigterm");
    let img = w.join("disk.img");
    let model = random_image(&img, 2 * MIB, 2);
    let mp = w.join("export");
    // Passthrough off: the READ counter below must see the reads (passthrough keeps them from fusex).
    let m = Mount::start(&w, &img, &mp, &["--passthrough", "off"]);
    assert!(mp.exists());
    assert_bytes_eq(&read_all(&mp), &model, 0, "content before stopping");
    let st = m.stop();
    st.assert_clean("SIGTERM");
    assert!(!is_fuse_mounted(&mp), "still mounted after exit");
    assert!(
        !mp.exists(),
        "mountpoint created by fusex must be removed on exit"
    );
    assert!(st.stat(&["requests"]) >= 1, "stats: {}", st.stats());
    assert!(st.stat(&["ops", "READ"]) >= 1, "stats: {}", st.stats());
}

#[test]
fn sigint_unmounts_and_keeps_preexisting_mountpoint() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("lc-sigint");
    let img = w.join("disk.img");
    random_image(&img, MIB, 3);
    let mp = w.join("export");
    fs::write(&mp, b"keep me").unwrap();
    let m = Mount::start(&w, &img, &mp, &[]);
    assert_eq!(
        fs::metadata(&mp).unwrap().len(),
        MIB,
        "the export hides the file underneath"
    );
    m.signal(libc::SIGINT);
    let st = m.wait_exit();
    st.assert_clean("SIGINT");
    assert_eq!(
        fs::read(&mp).expect("pre-existing mountpoint must be kept"),
        b"keep me"
    );
}

#[test]
fn external_umount_stops_the_daemon() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("lc-umount");
    let img = w.join("disk.img");
    random_image(&img, MIB, 4);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &["--writable"]);
    umount_idle(&mp);
    let st = m.wait_exit();
    st.assert_clean("external umount");
    assert!(
        !mp.exists(),
        "mountpoint created by fusex must be removed after an external umount"
    );
}

#[test]
fn fusex_umount_stops_the_daemon_and_keeps_preexisting_mountpoint() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("lc-fusex-umount");
    let img = w.join("disk.img");
    random_image(&img, MIB, 5);
    let mp = w.join("export");
    fs::write(&mp, b"pre-existing").unwrap();
    let m = Mount::start(&w, &img, &mp, &["--writable"]);
    let r = run_fusex(&w, &[std::ffi::OsStr::new("umount"), mp.as_os_str()], None);
    assert_eq!(
        r.code,
        Some(0),
        "fusex umount failed; stderr:\n{}",
        r.stderr
    );
    assert!(
        r.stdout.is_empty(),
        "fusex umount printed to stdout: {:?}",
        r.stdout
    );
    let st = m.wait_exit();
    st.assert_clean("fusex umount");
    assert_eq!(
        fs::read(&mp).expect("pre-existing mountpoint must be kept"),
        b"pre-existing"
    );
}

#[test]
fn fusex_umount_of_something_not_mounted_fails_cleanly() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("lc-umount-none");
    let mp = w.join("not-mounted");
    fs::write(&mp, b"x").unwrap();
    let r = run_fusex(&w, &[std::ffi::OsStr::new("umount"), mp.as_os_str()], None);
    r.assert_one_error_line("fusex umount of a file that is not a FUSE mount");
    assert_eq!(fs::read(&mp).unwrap(), b"x");
}

/// SIGTERM while fio hammers the export: the daemon detaches the export and serves fio on; a
/// second SIGTERM aborts it: the daemon answers what it took, unmounts and exits 0 within the
/// timeout although fio still holds the file open.
#[test]
fn sigterm_under_fio_load() {
    /// fio's queue depth: at most this many of its requests are in flight at any time.
    const IODEPTH: u64 = 16;
    if !require_fuse_and_tools(&["fio"]) {
        return;
    }
    let w = WorkDir::new("lc-fio");
    let img = w.join("disk.img");
    random_image(&img, 16 * MIB, 6);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &["--writable"]);
    let mut writes = WriteWatch::new(&img);
    let fio_log = w.join("fio.log");
    let mut fio = ChildGuard(
        fio_command(
            &w,
            &mp,
            &[
                "--name=t",
                "--rw=randrw",
                "--bs=4k",
                &format!("--iodepth={IODEPTH}"),
                "--ioengine=libaio",
                "--time_based",
                "--runtime=30",
                "--size=16M",
            ],
        )
        .stdout(File::create(&fio_log).unwrap())
        .stderr(File::create(w.join("fio.stderr")).unwrap())
        .spawn()
        .expect("spawn fio"),
    );
    // The signal must land while fio hammers the export: wait until more of its writes reached
    // the image than it keeps in flight, so it is refilling its queue (fio may take a while to
    // start on a loaded machine), or until fio gives up.
    let flowing = writes.wait_for_more_than(IODEPTH, &mut fio, Instant::now() + TIMEOUT);
    let fio_output = || {
        format!(
            "{}\n{}\n--- fusex stderr ---\n{}",
            String::from_utf8_lossy(&fs::read(&fio_log).unwrap_or_default()),
            String::from_utf8_lossy(&fs::read(w.join("fio.stderr")).unwrap_or_default()),
            m.stderr()
        )
    };
    if let Some(st) = fio.try_wait() {
        panic!("fio ended before the signal ({st}):\n{}", fio_output());
    }
    assert!(
        flowing,
        "fewer than {} of fio's writes reached the image within {TIMEOUT:?}:\n{}",
        IODEPTH + 1,
        fio_output()
    );
    // fio holds the export open: the first SIGTERM detaches it and serves fio on, the second
    // ends it.
    m.stop_signals_twice();
    let st = m.wait_exit();
    let fio_status = fio.kill_and_wait();
    eprintln!("fio ended with {fio_status} (errors from fio are expected here)");
    st.assert_clean("SIGTERM under fio load");
    assert!(!is_fuse_mounted(&mp), "mountpoint is still a FUSE mount");
    assert!(
        !mp.exists(),
        "mountpoint created by fusex must be removed on exit"
    );
    let io = st.stat(&["ops", "READ"]) + st.stat(&["ops", "WRITE"]);
    assert!(
        io >= 1,
        "fio did no I/O before the signal? stats: {}",
        st.stats()
    );
    assert!(
        st.flag(&["exit_flush"]),
        "writable export: flush at exit: {}",
        st.stats()
    );
}

#[test]
fn daemonize_returns_once_mounted() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("lc-daemonize");
    let img = w.join("disk.img");
    let model = random_image(&img, 2 * MIB, 7);
    let mp = w.join("export");
    let pid_file = w.join("fusex.pid");
    let (m, mounted_at_return) = Mount::start_daemonized(&w, &img, &mp, &pid_file, &["--writable"])
        .unwrap_or_else(|f| {
            panic!(
                "fusex --daemonize failed (exit {:?}); stderr:\n{}",
                f.code, f.stderr
            )
        });
    assert!(
        mounted_at_return,
        "fusex --daemonize exited 0 before the mount was live; stderr:\n{}",
        m.stderr()
    );
    let pid = m.pid();
    assert!(pid_alive(pid), "pid file names {pid}, which is not running");
    let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    assert!(comm.contains("fusex"), "pid {pid} is {comm:?}, not fusex");
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    assert_ne!(
        ppid_of(pid),
        Some(me),
        "the daemon must not be our direct child (it should have forked)"
    );
    // Published before the parent returned: `fusex list` shows it serving at once.
    assert_listed_serving(&mp, pid);

    assert_bytes_eq(
        &read_all(&mp),
        &model,
        0,
        "read through the daemonized export",
    );
    let f = open_rw(&mp);
    f.write_all_at(b"daemon", 100)
        .expect("write through the daemonized export");
    f.sync_all().unwrap();
    drop(f);

    let st = m.stop();
    st.assert_clean("daemonized");
    assert!(!pid_alive(pid));
    assert!(
        !mp.exists(),
        "mountpoint created by fusex must be removed on exit"
    );
    assert!(st.stat(&["ops", "WRITE"]) >= 1, "stats: {}", st.stats());
    assert_eq!(&read_all(&img)[100..106], b"daemon");
}

/// --daemonize with an image that cannot be opened: the parent prints the error and
/// exits 1; nothing stays mounted or running.
#[test]
fn daemonize_reports_errors() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("lc-daemonize-err");
    let mp = w.join("export");
    let pid_file = w.join("fusex.pid");
    match Mount::start_daemonized(&w, w.join("missing.img"), &mp, &pid_file, &[]) {
        Ok((m, _)) => {
            drop(m);
            panic!("fusex --daemonize with a missing image exited 0");
        }
        Err(f) => {
            let r = CmdResult {
                code: f.code,
                stdout: f.stdout,
                stderr: f.stderr,
            };
            r.assert_one_error_line("--daemonize with a missing image");
        }
    }
    assert!(!is_fuse_mounted(&mp));
    assert!(
        !mp.exists(),
        "mountpoint created by fusex must be removed after a failure"
    );
    if let Ok(p) = fs::read_to_string(&pid_file) {
        if let Ok(pid) = p.trim().parse::<i32>() {
            assert!(
                !pid_alive(pid),
                "daemon {pid} still running after a failed start"
            );
        }
    }
}

/// With -v the daemon logs "mounted IMAGE at MOUNTPOINT" (contract: info level).
#[test]
fn verbose_logs_the_mount() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("lc-verbose");
    let img = w.join("disk.img");
    random_image(&img, MIB, 8);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &["-v"]);
    let st = m.stop();
    assert!(
        st.exited && st.code == Some(0),
        "exit {:?}; stderr:\n{}",
        st.code,
        st.stderr
    );
    assert!(!st.left_mounted);
    assert!(st.stdout.is_empty(), "stdout: {:?}", st.stdout);
    let line = st.stderr.lines().find(|l| l.contains("mounted"));
    let line =
        line.unwrap_or_else(|| panic!("no \"mounted\" line with -v; stderr:\n{}", st.stderr));
    assert!(
        line.contains(img.to_str().unwrap()) && line.contains(mp.to_str().unwrap()),
        "the mounted line should name image and mountpoint: {line:?}"
    );
    assert!(
        !st.stderr.to_ascii_lowercase().contains("panic"),
        "stderr:\n{}",
        st.stderr
    );
}

/// Contract: on SIGTERM a writable export flushes the backend before exiting, which the stats
/// report as `exit_flush`. The fd stays open across the signal, so the application asks for no
/// flush. A FLUSH can still arrive: a process another test thread spawns inherits this fd for a
/// moment and closes it at exec (close-on-exec sends FLUSH); `backend.flushes` counts such
/// request flushes, never the exit flush.
#[test]
fn sigterm_flushes_a_writable_export() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("lc-exit-flush");
    let img = w.join("disk.img");
    sparse_image(&img, MIB);
    let m = Mount::start(&w, &img, &w.join("export"), &["--writable"]);
    let f = m.open_rw();
    f.write_all_at(b"unflushed", 4096).expect("write");
    let st = m.stop();
    drop(f); // ENOTCONN on close is expected: the daemon is gone.
    st.assert_clean("SIGTERM with an open fd");
    assert!(
        st.flag(&["exit_flush"]),
        "contract: SIGTERM on a writable export flushes the backend; stats: {}",
        st.stats()
    );
    assert_eq!(
        st.stat(&["backend", "flushes"]),
        st.requested_flushes(),
        "backend.flushes counts request flushes only, not the exit flush; stats: {}",
        st.stats()
    );
    assert_eq!(&read_all(&img)[4096..4105], b"unflushed");
}

/// `fusex umount X` and at once `fusex mount … X`, 20 times in a row: the old daemon's cleanup
/// acts only on its own mount and its own pid file, so every new export stays mounted, serves its
/// own image and keeps the pid file it wrote. (The old daemon used to unmount whatever FUSE mount
/// it found at X and delete the pid file unconditionally: the new daemon said "mounted", then
/// exited 0 about every other time.) The two images differ, so the bytes say which export serves.
fn umount_then_mount_at_once(tag: &str, daemonize: bool) {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new(tag);
    let imgs = [w.join("a.img"), w.join("b.img")];
    let models = [
        random_image(&imgs[0], MIB, 31),
        random_image(&imgs[1], MIB, 32),
    ];
    // Created by the first daemon, so "remove the mountpoint I created" is exercised too.
    let mp = w.join("export");
    let pid_file = w.join("fusex.pid");
    let pid_arg = pid_file.to_str().unwrap().to_string();
    let start = |round: usize| -> Mount {
        let img = &imgs[round % 2];
        if daemonize {
            let (m, live) = Mount::start_daemonized(&w, img, &mp, &pid_file, &["--writable"])
                .unwrap_or_else(|f| {
                    panic!(
                        "round {round}: fusex --daemonize failed (exit {:?}); stderr:\n{}",
                        f.code, f.stderr
                    )
                });
            assert!(
                live,
                "round {round}: parent returned before the mount was live"
            );
            m
        } else {
            Mount::start(&w, img, &mp, &["--writable", "--pid-file", &pid_arg])
        }
    };
    let mut cur = start(0);
    for round in 1..=20 {
        let r = run_fusex(&w, &[std::ffi::OsStr::new("umount"), mp.as_os_str()], None);
        assert_eq!(
            r.code,
            Some(0),
            "round {round}: fusex umount failed; stderr:\n{}",
            r.stderr
        );
        let next = start(round);
        let old = cur.wait_exit_handed_over();
        assert!(
            old.exited,
            "round {round}: the unmounted daemon did not exit; stderr:\n{}",
            old.stderr
        );
        if !daemonize {
            assert_eq!(
                old.code,
                Some(0),
                "round {round}: old daemon's exit; stderr:\n{}",
                old.stderr
            );
        }
        old.assert_no_errors_logged(&format!("round {round}: old daemon"));
        // The old daemon is gone and has cleaned up: the new export must have survived that.
        assert!(
            pid_alive(next.pid()),
            "round {round}: the new daemon exited after the old one cleaned up; stderr:\n{}",
            next.stderr()
        );
        assert_eq!(
            fuse_mounts_at(&mp).len(),
            1,
            "round {round}: exactly the new export must be mounted; new daemon's stderr:\n{}",
            next.stderr()
        );
        assert_bytes_eq(
            &read_all(&mp),
            &models[round % 2],
            0,
            &format!("round {round}: the new export serves its own image"),
        );
        assert_eq!(
            fs::read_to_string(&pid_file).unwrap_or_default().trim(),
            next.pid().to_string(),
            "round {round}: the pid file must name the new daemon"
        );
        cur = next;
    }
    cur.stop().assert_clean("last export after 20 hand-overs");
    assert!(!pid_file.exists(), "the last daemon removes its pid file");
}

#[test]
fn umount_then_mount_at_once_keeps_the_new_export() {
    umount_then_mount_at_once("lc-handover", false);
}

#[test]
fn umount_then_mount_at_once_keeps_the_new_export_daemonized() {
    umount_then_mount_at_once("lc-handover-d", true);
}

/// An nbdfuse mount (a foreign FUSE filesystem: fstype `fuse`) on `dir`, over qemu-nbd serving
/// `image` read-only. Dropping it unmounts (lazily) and ends nbdfuse.
struct NbdFuse {
    child: ChildGuard,
    dir: std::path::PathBuf,
}

impl NbdFuse {
    fn start(w: &WorkDir, image: &std::path::Path, dir: &std::path::Path) -> NbdFuse {
        let mut cmd = Command::new("nbdfuse");
        cmd.arg("-r")
            .arg(dir)
            .args(["[", "qemu-nbd", "-f", "raw", "-r"])
            .arg(image)
            .arg("]")
            .stdin(Stdio::null())
            .stdout(File::create(w.join("nbdfuse.out")).unwrap())
            .stderr(File::create(w.join("nbdfuse.err")).unwrap());
        let child = ChildGuard(cmd.spawn().expect("spawn nbdfuse"));
        let mut m = NbdFuse {
            child,
            dir: dir.to_path_buf(),
        };
        let deadline = Instant::now() + TIMEOUT;
        let up = wait_until(deadline, || {
            is_fuse_mounted(dir) || m.child.try_wait().is_some()
        });
        assert!(
            up && is_fuse_mounted(dir),
            "nbdfuse did not mount {}; stderr:\n{}",
            dir.display(),
            fs::read_to_string(w.join("nbdfuse.err")).unwrap_or_default()
        );
        m
    }
}

impl Drop for NbdFuse {
    fn drop(&mut self) {
        if is_fuse_mounted(&self.dir) {
            let _ = run(Command::new("umount").arg("-l").arg(&self.dir));
        }
    }
}

/// `fusex umount` refuses a FUSE mount that is not a fusex export (here nbdfuse's) in one line
/// naming what it is and that --force overrides; the mount stays and still serves. With --force
/// it is unmounted, and nbdfuse exits.
#[test]
fn fusex_umount_refuses_other_fuse_filesystems_without_force() {
    if !require_fuse_and_tools(&["nbdfuse", "qemu-nbd"]) {
        return;
    }
    let w = WorkDir::new("lc-umount-foreign");
    let img = w.join("disk.img");
    let model = random_image(&img, MIB, 41);
    let dir = w.join("nbd");
    fs::create_dir(&dir).unwrap();
    let mut nbd = NbdFuse::start(&w, &img, &dir);
    let fstype = fuse_mounts_at(&dir)[0].fstype.clone();
    assert_ne!(fstype, "fuse.fusex", "nbdfuse must not look like fusex");
    let umount = |extra: &[&str]| {
        let mut argv: Vec<std::ffi::OsString> = vec!["umount".into()];
        argv.extend(extra.iter().map(std::ffi::OsString::from));
        argv.push(dir.clone().into_os_string());
        run_fusex(&w, &argv, None)
    };

    let r = umount(&[]);
    eprintln!("fusex said: {}", r.stderr.trim_end());
    r.assert_one_error_line("fusex umount of an nbdfuse mount");
    assert!(
        r.stderr.contains(&fstype) && r.stderr.contains("not a fusex export"),
        "the error should say what is mounted there: {}",
        r.stderr
    );
    assert!(
        r.stderr.contains("--force"),
        "the error should say --force overrides: {}",
        r.stderr
    );
    assert!(is_fuse_mounted(&dir), "the foreign mount must stay");
    assert_bytes_eq(
        &read_all(&dir.join("nbd")),
        &model,
        0,
        "nbdfuse still serves after the refusal",
    );

    let r = umount(&["--force"]);
    assert_eq!(
        r.code,
        Some(0),
        "fusex umount --force failed; stderr:\n{}",
        r.stderr
    );
    assert!(!is_fuse_mounted(&dir), "--force must unmount it");
    let deadline = Instant::now() + TIMEOUT;
    assert!(
        wait_until(deadline, || nbd.child.try_wait().is_some()),
        "nbdfuse did not exit after its mount went away"
    );
}

/// Root writes the stats file into a directory others may write: a symlink planted at its name
/// or at a temporary name after the start is replaced, never followed (the root-owned file it
/// points to stays as it was), and a FIFO planted at its name does not block the exit.
#[test]
fn planted_symlinks_and_fifos_at_the_stats_file() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("lc-planted");
    let img = w.join("disk.img");
    sparse_image(&img, MIB);
    let victim = w.join("victim");
    fs::write(&victim, b"precious").unwrap();
    fs::set_permissions(&victim, fs::Permissions::from_mode(0o600)).unwrap();
    let plant_link = |p: &std::path::Path| {
        let _ = fs::remove_file(p);
        std::os::unix::fs::symlink(&victim, p).unwrap();
    };

    let m = Mount::start(&w, &img, &w.join("export"), &["--writable"]);
    let stats = m.stats_path().to_path_buf();
    plant_link(&stats);
    let mut tmp = stats.clone().into_os_string();
    tmp.push(".tmp");
    plant_link(std::path::Path::new(&tmp));
    let live = m.live_stats(Instant::now() + TIMEOUT);
    assert!(live.is_some(), "no live statistics after SIGUSR1");
    assert_eq!(
        fs::read_to_string(&victim).unwrap(),
        "precious",
        "SIGUSR1 dump"
    );
    plant_link(&stats);
    let st = m.stop();
    st.assert_clean("stop with a symlink at the stats file");
    assert!(st.stats.is_some(), "the stats are written at exit");
    assert_eq!(
        fs::read_to_string(&victim).unwrap(),
        "precious",
        "exit dump"
    );
    assert!(!fs::symlink_metadata(&stats)
        .unwrap()
        .file_type()
        .is_symlink());

    let m = Mount::start(&w, &img, &w.join("export"), &["--writable"]);
    let stats = m.stats_path().to_path_buf();
    let c = std::ffi::CString::new(stats.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);
    let st = m.stop();
    st.assert_clean("stop with a FIFO at the stats file");
    assert!(st.stats.is_some(), "the stats replace the FIFO");
}

/// `--daemonize --log-file PATH`: the daemon's log, from the start to the stop, is appended to the
/// file (it used to go to /dev/null once the daemon detached, the stop's lines with it).
#[test]
fn daemonized_log_goes_to_the_log_file() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("lc-logfile");
    let img = w.join("disk.img");
    sparse_image(&img, MIB);
    let mp = w.join("export");
    let log = w.join("fusex.log");
    let (m, _) = Mount::start_daemonized(
        &w,
        &img,
        &mp,
        &w.join("fusex.pid"),
        &["--writable", "--log-file", log.to_str().unwrap()],
    )
    .unwrap_or_else(|f| panic!("daemonized mount failed: {}", f.stderr));
    let pid = m.pid();
    let st = m.stop();
    st.assert_clean("daemonized with --log-file");
    let text = fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("INFO mounted "),
        "the start is logged: {text}"
    );
    assert!(
        text.contains("SIGTERM: unmounted"),
        "the stop, after the daemon detached, is logged: {text}"
    );
    assert!(text.contains("served "), "the end is logged: {text}");
    assert!(!pid_alive(pid));
    let mode = fs::metadata(&log).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode & !0o640, 0, "created at most 0640: {mode:o}");
}

/// Log rotation: logrotate renames the `--log-file` and sends SIGUSR2; the daemon opens a new
/// file at the path and logs there, the renamed file keeping everything before (its last line
/// says the log moves on). The export serves on throughout.
#[test]
fn sigusr2_reopens_the_log_file_after_rotation() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("lc-logrotate");
    let img = w.join("disk.img");
    let data = random_image(&img, MIB, 41);
    let mp = w.join("export");
    let log = w.join("fusex.log");
    let rotated = w.join("fusex.log.1");
    let (m, _) = Mount::start_daemonized(
        &w,
        &img,
        &mp,
        &w.join("fusex.pid"),
        &["--log-file", log.to_str().unwrap()],
    )
    .unwrap_or_else(|f| panic!("daemonized mount failed: {}", f.stderr));
    fs::rename(&log, &rotated).unwrap();
    m.signal(libc::SIGUSR2);
    assert!(
        wait_until(Instant::now() + TIMEOUT, || fs::read_to_string(&log)
            .is_ok_and(|t| t.contains("reopened"))),
        "no new log file after SIGUSR2; the old one says: {}",
        fs::read_to_string(&rotated).unwrap_or_default()
    );
    assert_bytes_eq(&read_all(&mp), &data, 0, "after the log was reopened");
    let st = m.stop();
    st.assert_clean("daemonized, log rotated");
    let old = fs::read_to_string(&rotated).unwrap();
    let new = fs::read_to_string(&log).unwrap();
    assert!(
        old.contains("INFO mounted "),
        "the start stays in the rotated file: {old}"
    );
    assert!(
        old.trim_end().ends_with("SIGUSR2: reopening the log file"),
        "the rotated file's last line says the log moved on: {old}"
    );
    assert!(
        !new.contains("INFO mounted "),
        "the new file starts at the reopen: {new}"
    );
    // (Either stop line: the RELEASE of the read above may still be on its way at SIGTERM.)
    assert!(
        new.contains("SIGTERM: ") && new.contains("served "),
        "the stop is logged in the new file: {new}"
    );
    let mode = fs::metadata(&log).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode & !0o640, 0, "created at most 0640: {mode:o}");
}

/// `fusex mount --log-format json`: every line is one JSON object, and every one names the
/// export by its mountpoint (as `fusex list` shows it).
#[test]
fn json_log_lines_name_the_mount() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("lc-jsonlog");
    let img = w.join("disk.img");
    sparse_image(&img, MIB);
    let mp = w.join("export");
    let log = w.join("fusex.json");
    let (m, _) = Mount::start_daemonized(
        &w,
        &img,
        &mp,
        &w.join("fusex.pid"),
        &["--log-format", "json", "--log-file", log.to_str().unwrap()],
    )
    .unwrap_or_else(|f| panic!("daemonized mount failed: {}", f.stderr));
    m.stop().assert_clean("daemonized with --log-format json");
    let text = fs::read_to_string(&log).unwrap();
    let mut messages = Vec::new();
    for l in text.lines() {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}\n{text}"));
        for k in ["timestamp", "level", "target", "message"] {
            assert!(v[k].is_string(), "no {k}: {l}");
        }
        assert_eq!(v["export"], mp.to_str().unwrap(), "{l}");
        messages.push(v["message"].as_str().unwrap().to_string());
    }
    assert!(
        messages.iter().any(|m| m.starts_with("mounted ")),
        "{messages:?}"
    );
    assert!(
        messages.iter().any(|m| m.starts_with("SIGTERM: unmounted")),
        "{messages:?}"
    );
}
