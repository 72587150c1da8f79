//! What a local user could turn against a root daemon: the mountpoint swapped for a symlink while
//! fusex mounts, the `fusex restart` socket taken before the daemon binds it. And `fusex list`,
//! which reads what daemons publish in their runtime directories.

use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use fusex_e2e::*;

/// The system's Python, which another user can run (a `python3` earlier on root's PATH, a pyenv
/// shim say, may not be).
const SYSTEM_PYTHON: &str = "/usr/bin/python3";

/// `renameat2(a, b, RENAME_EXCHANGE)`: swaps the two names atomically.
fn exchange(a: &CString, b: &CString) -> bool {
    // SAFETY: both are valid NUL-terminated paths living across the call.
    unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        ) == 0
    }
}

/// The mountpoint is a file a user owns in a sticky, world-writable directory; the user swaps it
/// with a symlink to a root-owned file over and over while root's fusex mounts. Whatever the
/// timing, the export never lands on the root file: fusex mounts on the user's file, or refuses
/// in one line, and no mount is left anywhere once it is stopped.
#[test]
fn a_mountpoint_swapped_for_a_symlink_never_gets_the_mount() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("swap");
    let img = w.join("disk.img");
    random_image(&img, MIB, 7);
    let victim = w.join("root-only");
    fs::write(&victim, b"root's secret\n").unwrap();
    fs::set_permissions(&victim, fs::Permissions::from_mode(0o600)).unwrap();
    let sticky = w.join("tmp");
    fs::create_dir(&sticky).unwrap();
    fs::set_permissions(&sticky, fs::Permissions::from_mode(0o1777)).unwrap();
    let mp = sticky.join("export");
    let link = sticky.join("link");
    fs::write(&mp, b"").unwrap();
    std::os::unix::fs::chown(&mp, Some(65534), Some(65534)).unwrap();
    std::os::unix::fs::symlink(&victim, &link).unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let swapper = {
        let stop = stop.clone();
        let (a, b) = (
            CString::new(mp.as_os_str().as_bytes()).unwrap(),
            CString::new(link.as_os_str().as_bytes()).unwrap(),
        );
        thread::spawn(move || {
            let mut swaps = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // Fails while the file is mounted on (EBUSY): the kernel pins mounted names.
                if exchange(&a, &b) {
                    swaps += 1;
                }
            }
            swaps
        })
    };
    let (mut mounted, mut refused) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    for _ in 0..40 {
        if Instant::now() >= deadline {
            break;
        }
        let attempt = Mount::try_start(&w, &img, &mp, &[]);
        // The root file is never the one mounted on, whichever name it has now.
        let on_victim = mountinfo()
            .iter()
            .any(|m| m.mount_point == victim || m.mount_point == link);
        match attempt {
            Ok(m) => {
                mounted += 1;
                let st = m.stop();
                assert!(!on_victim, "the export was mounted over the root file");
                assert!(st.exited && !st.left_mounted, "{st:?}");
            }
            Err(f) => {
                refused += 1;
                assert!(!on_victim, "a refused mount left the root file mounted on");
                let lines: Vec<&str> = f.stderr.lines().filter(|l| l.contains("error")).collect();
                assert_eq!(lines.len(), 1, "one error line: {}", f.stderr);
                assert!(
                    lines[0].contains("is not a regular file") || lines[0].contains("changed"),
                    "{}",
                    f.stderr
                );
            }
        }
        assert!(
            mountinfo()
                .iter()
                .all(|m| !m.mount_point.starts_with(w.path())),
            "a mount is left in the work directory"
        );
        assert_eq!(fs::read(&victim).unwrap(), b"root's secret\n");
    }
    stop.store(true, Ordering::Relaxed);
    let swaps = swapper.join().unwrap();
    eprintln!("{mounted} mounted, {refused} refused, {swaps} swaps");
    assert!(swaps > 0, "the swapper never got to swap");
    assert!(mounted + refused > 0);
}

/// The restart socket of root's daemon `pid` in `/run/fusex`, once its state (written when every
/// queue serves) names that pid.
#[track_caller]
fn root_daemon_socket(pid: i32) -> std::path::PathBuf {
    let find = || bound_runtime_socket(|s| s.contains(&format!("\"pid\":{pid}")));
    assert!(
        wait_until(Instant::now() + TIMEOUT, || find().is_some()),
        "no socket and state of daemon {pid} in /run/fusex"
    );
    find().unwrap()
}

/// A root daemon's restart socket is a file in `/run/fusex`, a directory only root may write:
/// no abstract name another user could bind first, nothing an unprivileged user can create
/// there, and `fusex restart` (on the legacy transport) goes through it.
#[test]
fn the_restart_socket_sits_where_only_root_can_bind() {
    if !require_fuse_and_tools(&["setpriv", SYSTEM_PYTHON]) {
        return;
    }
    let w = WorkDir::new("rsock");
    let img = w.join("disk.img");
    random_image(&img, MIB, 8);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &[]);
    let dir = Path::new("/run/fusex");
    let meta = fs::symlink_metadata(dir).unwrap();
    assert!(meta.is_dir());
    assert_eq!(meta.uid(), 0);
    assert_eq!(
        meta.mode() & 0o022,
        0,
        "no one but root may write /run/fusex"
    );
    let socket = root_daemon_socket(m.pid());
    let unix = fs::read_to_string("/proc/net/unix").unwrap();
    assert!(
        unix.lines()
            .any(|l| l.split_whitespace().nth(7) == Some(&*socket.to_string_lossy())),
        "{} is listening:\n{unix}",
        socket.display()
    );
    // Named after the mount (`MAJ:MIN-ID`), and under no abstract name (which anyone may bind).
    let stem = socket.file_stem().unwrap().to_string_lossy().into_owned();
    let (dev, id) = stem.split_once('-').unwrap();
    let abstract_name = format!("@fusex-restart/{dev}/{id}");
    assert!(!unix.contains(&abstract_name), "{abstract_name} listens");
    // Another user cannot put anything there.
    let squat = dir.join("squat.sock");
    let r = run(Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .args([SYSTEM_PYTHON, "-c"])
        .arg(
            "import socket,sys\n\
             try: socket.socket(socket.AF_UNIX).bind(sys.argv[1])\n\
             except PermissionError: print('EACCES'); sys.exit(3)\n",
        )
        .arg(&squat));
    assert_eq!(
        (r.status.code(), String::from_utf8_lossy(&r.stdout).trim()),
        (Some(3), "EACCES"),
        "nobody's bind of {}: {}",
        squat.display(),
        String::from_utf8_lossy(&r.stderr)
    );
    assert!(!squat.exists());
    let st = m.stop();
    assert!(st.exited && !st.left_mounted, "{st:?}");
    assert!(!socket.exists(), "the socket is removed at exit");
    assert!(!socket.with_extension("json").exists());
}

/// `fusex list` shows every export with its image, format, transport, pid and state; a stop with
/// a file open shows as stopping; a killed daemon's mount shows as dead with the command that
/// clears it.
#[test]
fn fusex_list_shows_serving_stopping_and_dead_exports() {
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    let w = WorkDir::new("list");
    let raw = w.join("disk.img");
    random_image(&raw, MIB, 9);
    let qcow = w.join("disk.qcow2");
    run_ok(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&qcow)
            .arg("4M"),
    );
    let (mp_raw, mp_qcow) = (w.join("raw.export"), w.join("qcow.export"));
    let a = Mount::start(&w, &raw, &mp_raw, &["--writable"]);
    let b = Mount::start(&w, &qcow, &mp_qcow, &[]);
    let transport = match std::env::var("FUSEX_E2E_TRANSPORT").as_deref() {
        Ok("legacy") => "legacy",
        _ => "io_uring",
    };
    // Listed once every queue serves.
    let serving = |mp: &Path| listed(mp).filter(|r| r["state"] == "serving");
    assert!(wait_until(Instant::now() + TIMEOUT, || serving(&mp_raw)
        .is_some()
        && serving(&mp_qcow).is_some()));
    let ra = listed(&mp_raw).expect("the raw export is listed");
    assert_eq!(ra["image"], raw.to_string_lossy().as_ref());
    assert_eq!(ra["format"], "raw");
    assert_eq!(ra["pid"], a.pid());
    assert_eq!(ra["state"], "serving");
    assert_eq!(ra["writable"], true);
    let rb = listed(&mp_qcow).expect("the qcow2 export is listed");
    assert_eq!(rb["format"], "qcow2");
    assert_eq!(rb["pid"], b.pid());
    assert_eq!(rb["writable"], false);
    // With FUSEX_E2E_TRANSPORT unset, auto picks io_uring where the kernel offers it.
    if std::env::var("FUSEX_E2E_TRANSPORT").is_ok() {
        assert_eq!(ra["transport"], transport);
        assert_eq!(rb["transport"], transport);
    }
    // The table has a header and one line per export.
    let table = run_ok(Command::new(fusex_bin()).arg("list"));
    let text = String::from_utf8(table.stdout).unwrap();
    assert!(text.starts_with("MOUNTPOINT"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with(&*mp_qcow.to_string_lossy()) && l.contains("qcow2")),
        "{text}"
    );

    // A file held open across the stop: the export is detached and listed as stopping.
    let held = fs::File::open(&mp_raw).unwrap();
    a.signal(libc::SIGTERM);
    assert!(
        a.wait_for_log(STILL_OPEN, Instant::now() + TIMEOUT),
        "{}",
        a.stderr()
    );
    let mut row = None;
    let seen = wait_until(Instant::now() + TIMEOUT, || {
        row = listed(&mp_raw);
        row.as_ref().is_some_and(|r| {
            r["state"]
                .as_str()
                .is_some_and(|s| s.starts_with("stopping (1 open"))
        })
    });
    assert!(seen, "stopping export listed as such: {row:?}");
    drop(held);
    let st = a.wait_exit();
    assert!(st.exited && !st.left_mounted, "{st:?}");
    assert!(listed(&mp_raw).is_none(), "an ended export is not listed");

    // A killed daemon: the mount stays, dead.
    let mut b = b;
    b.signal(libc::SIGKILL);
    assert!(b.wait_gone(Instant::now() + TIMEOUT));
    let dead = listed(&mp_qcow).expect("the dead mount is listed");
    let state = dead["state"].as_str().unwrap();
    assert!(
        state.starts_with("dead") && state.contains(&format!("fusex umount {}", mp_qcow.display())),
        "{dead}"
    );
    assert!(dead["pid"].is_null());
    run_ok(Command::new(fusex_bin()).arg("umount").arg(&mp_qcow));
    assert!(listed(&mp_qcow).is_none());
}

/// Sets a file's modification time `secs` into the past (a socket too: `touch` does not open it).
fn backdate(path: &Path, secs: u64) {
    let then = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        - secs;
    run_ok(Command::new("touch").arg(format!("-d@{then}")).arg(path));
}

/// A killed daemon leaves its socket and state file in `/run/fusex`; the next daemon to start
/// removes them once they are old enough, and leaves alone those of a daemon that still serves,
/// however old. A daemon sweeps once it serves: a refused command line prints its error alone.
#[test]
fn a_new_daemon_removes_the_files_a_killed_one_left() {
    if !require_fuse_and_tools(&["touch"]) {
        return;
    }
    let w = WorkDir::new("sweep");
    let img = w.join("disk.img");
    let data = random_image(&img, MIB, 11);
    let (mp_dead, mp_live, mp_new) = (w.join("dead"), w.join("live"), w.join("new"));
    let mut dead = Mount::start(&w, &img, &mp_dead, &[]);
    let live = Mount::start(&w, &img, &mp_live, &[]);
    let dead_files = {
        let s = root_daemon_socket(dead.pid());
        [s.with_extension("json"), s]
    };
    let live_files = {
        let s = root_daemon_socket(live.pid());
        [s.with_extension("json"), s]
    };
    dead.signal(libc::SIGKILL);
    assert!(dead.wait_gone(Instant::now() + TIMEOUT));
    run_ok(Command::new(fusex_bin()).arg("umount").arg(&mp_dead));
    for f in dead_files.iter().chain(&live_files) {
        assert!(f.exists(), "{} is there", f.display());
        // Older than a sweep's threshold (a minute).
        backdate(f, 600);
    }
    // A command line that is refused sweeps nothing: its error is the one line it prints.
    let refused = run_fusex(
        &w,
        &[
            "serve".to_string(),
            "--blockdev".to_string(),
            format!("driver=file,node-name=a,filename={}", img.display()),
            "--export".to_string(),
            format!(
                "type=fuse,id=a,node-name=nope,mountpoint={}",
                mp_new.display()
            ),
        ],
        Some(&mp_new),
    );
    refused.assert_one_error_line("a refused serve command line");
    assert!(refused.stderr.contains("nope"), "{}", refused.stderr);
    // Any daemon that starts now sweeps the directory; this one at least.
    let new = Mount::start(&w, &img, &mp_new, &[]);
    root_daemon_socket(new.pid());
    assert!(
        wait_until(Instant::now() + TIMEOUT, || dead_files
            .iter()
            .all(|f| !f.exists())),
        "the killed daemon's files were removed: {dead_files:?}"
    );
    for f in &live_files {
        assert!(f.exists(), "{} of the serving daemon stays", f.display());
    }
    assert_eq!(
        fs::read(&mp_live).unwrap(),
        data,
        "the other export serves on"
    );
    for m in [live, new] {
        let st = m.stop();
        assert!(st.exited && !st.left_mounted, "{st:?}");
    }
    for f in &live_files {
        assert!(!f.exists(), "{} is removed at exit", f.display());
    }
}

/// A daemon of a release before the runtime directory listens on the abstract name
/// `fusex-restart/MAJ:MIN/ID`, which `fusex restart` still tries when the export has no socket
/// file, so such a daemon can be upgraded in place. Anyone may bind that name: a squatter (here
/// `nobody`, answering on it while the real socket file is gone) is refused in one line, and the
/// export serves on.
#[test]
fn a_squatter_on_the_earlier_abstract_name_is_refused() {
    if !require_fuse_and_tools(&["setpriv", SYSTEM_PYTHON]) {
        return;
    }
    let w = WorkDir::new("squat");
    let img = w.join("disk.img");
    let model = random_image(&img, MIB, 10);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &["--transport", "legacy"]);
    let socket = root_daemon_socket(m.pid());
    let stem = socket.file_stem().unwrap().to_string_lossy().into_owned();
    let (dev, id) = stem.split_once('-').unwrap();
    fs::remove_file(&socket).unwrap();
    // nobody listens on the earlier name and answers whatever comes.
    let squatter = std::process::Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            SYSTEM_PYTHON,
            "-c",
        ])
        .arg(
            "import socket,sys\n\
             s=socket.socket(socket.AF_UNIX); s.bind('\\0'+sys.argv[1]); s.listen(1)\n\
             print('ready', flush=True)\n\
             c,_=s.accept(); c.recv(64)\n\
             b=b'{\"op\":\"refused\",\"error\":\"squatted\"}'\n\
             c.sendall(len(b).to_bytes(4,'little')+b)\n",
        )
        .arg(format!("fusex-restart/{dev}/{id}"))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut squatter = ChildGuard(squatter);
    let mut ready = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(squatter.0.stdout.as_mut().unwrap()),
        &mut ready,
    )
    .unwrap();
    assert_eq!(ready.trim(), "ready");
    let r = run_fusex(
        &w,
        &[Path::new("restart").as_os_str(), mp.as_os_str()],
        None,
    );
    r.assert_one_error_line("a squatter on the abstract name");
    assert!(r.stderr.contains("belongs to user 65534"), "{}", r.stderr);
    assert_bytes_eq(&read_all(&mp), &model, 0, "the export serves on");
    drop(squatter);
    let st = m.stop();
    assert!(st.exited && !st.left_mounted, "{st:?}");
}
