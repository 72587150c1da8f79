//! Running fusex as a service: as a normal user (through fusermount3), with `--auto-unmount` and
//! `--daemonize` as that user, and systemd's readiness protocol (`NOTIFY_SOCKET`).
//!
//! The unprivileged tests run fusex through `setpriv` as a system user made for them
//! (`fusex-e2e`, created if missing), on an image and in a directory that user owns. A user's
//! FUSE mount without `--allow-other` is closed even to root, so every read and write of the
//! export goes through a command run as that user too. Every mount is held by the harness's
//! `Mount` guard (root can signal the daemon and `umount -l` the mount), so a failing test leaves
//! nothing mounted.

use std::ffi::OsString;
use std::fs;
use std::io::Write;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::Instant;

use fusex_e2e::*;

/// The user the unprivileged tests run fusex as.
const USER: &str = "fusex-e2e";

#[derive(Clone, Copy)]
struct User {
    uid: u32,
    gid: u32,
}

/// Serializes `useradd` between the tests of this binary.
static USER_LOCK: Mutex<()> = Mutex::new(());

fn id_of(flag: &str) -> Option<u32> {
    let out = run(Command::new("id").arg(flag).arg(USER));
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

/// The test user, created (a system user with its own group, no home) if missing.
fn test_user() -> User {
    let _guard = USER_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if id_of("-u").is_none() {
        run_ok(Command::new("useradd").args([
            "--system",
            "--user-group",
            "--no-create-home",
            "--shell",
            "/usr/sbin/nologin",
            USER,
        ]));
    }
    User {
        uid: id_of("-u").expect("uid of the test user"),
        gid: id_of("-g").expect("gid of the test user"),
    }
}

/// Preconditions of the unprivileged tests: root (to make the user and clean up), /dev/fuse open
/// to everyone (fusermount3 opens it as the user; `make deps` sets that up), the tools.
fn unprivileged() -> Option<User> {
    if !require_fuse_and_tools(&["setpriv", "fusermount3", "useradd", "id", "cat", "dd"]) {
        return None;
    }
    let mode = fs::metadata("/dev/fuse").map_or(0, |m| m.permissions().mode() & 0o777);
    if mode & 0o006 != 0o006 {
        skip_or_fail(&format!(
            "/dev/fuse is not readable and writable by everyone (mode {mode:o}): run make deps"
        ));
        return None;
    }
    Some(test_user())
}

/// `setpriv` as the test user, to put before a command.
fn wrapper(u: User) -> Vec<OsString> {
    [
        "setpriv".to_string(),
        format!("--reuid={}", u.uid),
        format!("--regid={}", u.gid),
        "--clear-groups".to_string(),
    ]
    .into_iter()
    .map(OsString::from)
    .collect()
}

fn opts(u: User, dir: &Path) -> SpawnOpts {
    SpawnOpts {
        wrapper: wrapper(u),
        env: Vec::new(),
        files_dir: Some(dir.to_path_buf()),
    }
}

/// Runs `args` as the test user, feeding `stdin`.
fn as_user(u: User, args: &[&std::ffi::OsStr], stdin: &[u8]) -> Output {
    let w = wrapper(u);
    let mut cmd = Command::new(&w[0]);
    cmd.args(&w[1..])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin).expect("feeding stdin");
    drop(input);
    child.wait_with_output().expect("waiting for the command")
}

/// A directory in the WorkDir owned by the test user, holding a random image it owns; returns
/// (dir, image, its bytes). Panics with the fix when the user cannot reach the WorkDir.
fn user_files(w: &WorkDir, u: User, size: u64, seed: u64) -> (PathBuf, PathBuf, Vec<u8>) {
    let dir = w.join("home");
    fs::create_dir(&dir).unwrap();
    std::os::unix::fs::chown(&dir, Some(u.uid), Some(u.gid)).unwrap();
    let reach = as_user(u, &["test".as_ref(), "-w".as_ref(), dir.as_os_str()], b"");
    assert!(
        reach.status.success(),
        "{USER} cannot write {}: every directory above it must be searchable by all users \
         (set FUSEX_E2E_TMPDIR to such a directory)",
        dir.display()
    );
    let img = dir.join("disk.img");
    let model = random_image(&img, size, seed);
    std::os::unix::fs::chown(&img, Some(u.uid), Some(u.gid)).unwrap();
    (dir, img, model)
}

/// The bytes of `path` as the test user reads them.
fn read_as(u: User, path: &Path) -> Vec<u8> {
    let out = as_user(u, &["cat".as_ref(), path.as_os_str()], b"");
    assert!(
        out.status.success(),
        "cat {} as {USER}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Whether /etc/fuse.conf lets normal users ask for allow_other.
fn user_allow_other() -> bool {
    fs::read_to_string("/etc/fuse.conf").is_ok_and(|t| {
        t.lines()
            .any(|l| l.split('#').next().unwrap_or("").trim() == "user_allow_other")
    })
}

#[test]
fn unprivileged_mount_round_trip_and_unmount() {
    let Some(u) = unprivileged() else { return };
    let w = WorkDir::new("svc-user");
    let (dir, img, mut model) = user_files(&w, u, 4 * MIB, 1201);
    let mp = dir.join("disk.raw");
    let m = Mount::try_start_opts(&w, &img, &mp, &["--writable"], &opts(u, &dir))
        .unwrap_or_else(|f| panic!("mount as {USER} failed: {}", f.stderr));
    let log = m.stderr();
    assert!(log.contains("mounted through fusermount3"), "{log}");
    // Passthrough needs CAP_SYS_ADMIN: its absence is said once.
    let said: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("passthrough: off"))
        .collect();
    assert_eq!(said.len(), 1, "{log}");
    assert!(said[0].contains("CAP_SYS_ADMIN"), "{log}");
    // The export as the user sees it is the image.
    assert_bytes_eq(&read_as(u, m.path()), &model, 0, "export read as the user");
    // A write through the export lands in the image.
    let data = Rng::new(7).bytes(8192);
    let out = as_user(
        u,
        &[
            "dd".as_ref(),
            format!("of={}", m.path().display()).as_ref(),
            "bs=4096".as_ref(),
            "seek=3".as_ref(),
            "conv=notrunc,fsync".as_ref(),
            "status=none".as_ref(),
        ],
        &data,
    );
    assert!(
        out.status.success(),
        "dd as {USER}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    model[3 * 4096..5 * 4096].copy_from_slice(&data);
    assert_bytes_eq(&read_as(u, m.path()), &model, 0, "export after the write");
    let st = m.stop();
    st.assert_clean("unprivileged export stopped with SIGTERM");
    assert_bytes_eq(
        &fs::read(&img).unwrap(),
        &model,
        0,
        "image after the export",
    );
    assert!(!mp.exists(), "the mountpoint file fusex created is removed");
}

#[test]
fn unprivileged_fusex_umount_ends_the_daemon() {
    let Some(u) = unprivileged() else { return };
    let w = WorkDir::new("svc-umount");
    let (dir, img, model) = user_files(&w, u, MIB, 1202);
    let mp = dir.join("disk.raw");
    let m = Mount::try_start_opts(&w, &img, &mp, &[], &opts(u, &dir))
        .unwrap_or_else(|f| panic!("mount as {USER} failed: {}", f.stderr));
    assert_bytes_eq(&read_as(u, m.path()), &model, 0, "export read as the user");
    let out = as_user(
        u,
        &[fusex_bin().as_os_str(), "umount".as_ref(), mp.as_os_str()],
        b"",
    );
    assert!(
        out.status.success(),
        "fusex umount as {USER}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    m.wait_exit()
        .assert_clean("daemon after fusex umount by its user");
}

#[test]
fn unprivileged_refusals_are_one_line_and_mount_nothing() {
    let Some(u) = unprivileged() else { return };
    let w = WorkDir::new("svc-refuse");
    let (dir, img, _) = user_files(&w, u, MIB, 1203);

    // A mountpoint the user may not write (root's, 0644): fusermount3 refuses it.
    let foreign = dir.join("roots.raw");
    fs::write(&foreign, b"root's file").unwrap();
    fs::set_permissions(&foreign, fs::Permissions::from_mode(0o644)).unwrap();
    let mut cmd = Command::new("setpriv");
    cmd.args(&wrapper(u)[1..])
        .arg(fusex_bin())
        .arg("mount")
        .arg(&img)
        .arg(&foreign);
    let r = run_with_timeout(&w, cmd, Some(&foreign));
    eprintln!("foreign mountpoint: {}", r.stderr.trim_end());
    r.assert_one_error_line("a mountpoint the user may not write");
    assert!(
        r.stderr.contains("fusermount3") && r.stderr.contains("Permission denied"),
        "{}",
        r.stderr
    );
    assert!(!is_fuse_mounted(&foreign));
    assert_eq!(fs::read(&foreign).unwrap(), b"root's file");

    // --passthrough on: a normal user cannot register the image (CAP_SYS_ADMIN).
    let mp = dir.join("disk.raw");
    let mut cmd = Command::new("setpriv");
    cmd.args(&wrapper(u)[1..])
        .arg(fusex_bin())
        .args(["mount", "--passthrough", "on"])
        .arg(&img)
        .arg(&mp);
    let r = run_with_timeout(&w, cmd, Some(&mp));
    eprintln!("--passthrough on: {}", r.stderr.trim_end());
    r.assert_one_error_line("--passthrough on as a normal user");
    assert!(r.stderr.contains("CAP_SYS_ADMIN"), "{}", r.stderr);
    assert!(!is_fuse_mounted(&mp));
    assert!(
        !mp.exists(),
        "the mountpoint file fusex created is removed again"
    );

    // No fusermount3 to be found (PATH without it): one line naming the package.
    let mp = dir.join("disk.raw");
    let mut cmd = Command::new(which("setpriv").unwrap());
    cmd.args(&wrapper(u)[1..])
        .arg(fusex_bin())
        .arg("mount")
        .arg(&img)
        .arg(&mp)
        .env("PATH", "/nonexistent");
    let r = run_with_timeout(&w, cmd, Some(&mp));
    eprintln!("no fusermount3: {}", r.stderr.trim_end());
    r.assert_one_error_line("no fusermount3 in PATH");
    assert!(r.stderr.contains("fuse3"), "{}", r.stderr);
    assert!(!is_fuse_mounted(&mp));
    assert!(
        !mp.exists(),
        "the mountpoint file fusex created is removed again"
    );

    // --allow-other without user_allow_other in /etc/fuse.conf.
    if user_allow_other() {
        eprintln!("/etc/fuse.conf has user_allow_other: --allow-other is not refused here");
        return;
    }
    let mp = dir.join("disk.raw");
    let mut cmd = Command::new("setpriv");
    cmd.args(&wrapper(u)[1..])
        .arg(fusex_bin())
        .args(["mount", "--allow-other"])
        .arg(&img)
        .arg(&mp);
    let r = run_with_timeout(&w, cmd, Some(&mp));
    eprintln!("--allow-other: {}", r.stderr.trim_end());
    r.assert_one_error_line("--allow-other without user_allow_other");
    assert!(r.stderr.contains("user_allow_other"), "{}", r.stderr);
    assert!(r.stderr.contains("/etc/fuse.conf"), "{}", r.stderr);
    assert!(!is_fuse_mounted(&mp));
    assert!(
        !mp.exists(),
        "the mountpoint file fusex created is removed again"
    );
}

#[test]
fn unprivileged_auto_unmount_after_kill_9() {
    let Some(u) = unprivileged() else { return };
    let w = WorkDir::new("svc-autounmount");
    let (dir, img, model) = user_files(&w, u, MIB, 1204);
    let mp = dir.join("disk.raw");
    let m = Mount::try_start_opts(&w, &img, &mp, &["--auto-unmount"], &opts(u, &dir))
        .unwrap_or_else(|f| panic!("mount as {USER} failed: {}", f.stderr));
    assert_bytes_eq(&read_as(u, m.path()), &model, 0, "export read as the user");
    m.signal(libc::SIGKILL);
    let gone = wait_until(Instant::now() + TIMEOUT, || !m.is_mounted());
    assert!(
        gone,
        "the mount of a SIGKILLed unprivileged daemon is still there after {TIMEOUT:?}; stderr:\n{}",
        m.stderr()
    );
    let st = m.wait_exit();
    assert_eq!(st.signal, Some(libc::SIGKILL));
    assert!(!st.left_mounted);
}

#[test]
fn unprivileged_daemonize_success_and_failure() {
    let Some(u) = unprivileged() else { return };
    let w = WorkDir::new("svc-daemon");
    let (dir, img, model) = user_files(&w, u, MIB, 1205);
    let mp = dir.join("disk.raw");
    let pid_file = dir.join("fusex.pid");
    let (m, mounted) = Mount::start_daemonized_opts(&w, &img, &mp, &pid_file, &[], &opts(u, &dir))
        .unwrap_or_else(|f| panic!("--daemonize as {USER} failed: {}", f.stderr));
    assert!(mounted, "the mount is live when the parent returns");
    assert_bytes_eq(&read_as(u, m.path()), &model, 0, "daemonized export");
    let st = m.stop();
    st.assert_clean("daemonized unprivileged export");
    assert!(!pid_file.exists(), "pid file removed at exit");

    // Failure: a mountpoint the user may not write; the parent reports it and exits 1.
    let foreign = dir.join("roots.raw");
    fs::write(&foreign, b"root's file").unwrap();
    fs::set_permissions(&foreign, fs::Permissions::from_mode(0o644)).unwrap();
    let f = match Mount::start_daemonized_opts(&w, &img, &foreign, &pid_file, &[], &opts(u, &dir)) {
        Ok((m, _)) => {
            drop(m);
            panic!("--daemonize on a mountpoint root owns succeeded");
        }
        Err(f) => f,
    };
    assert_eq!(f.code, Some(1), "{}", f.stderr);
    let lines: Vec<&str> = f.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line: {}", f.stderr);
    assert!(
        lines[0].starts_with("fusex: error: ") && lines[0].contains("Permission denied"),
        "{}",
        f.stderr
    );
    assert!(!is_fuse_mounted(&foreign));
    assert_eq!(fs::read(&foreign).unwrap(), b"root's file");
}

/// Waits for one datagram on `sock` (read timeout set by the caller).
fn datagram(sock: &UnixDatagram) -> String {
    recv_datagram(sock)
}

/// READY=1 once the export serves, STOPPING=1 at SIGTERM, on a socket at `NOTIFY_SOCKET`.
fn notify_round(
    w: &WorkDir,
    sock: &UnixDatagram,
    value: &str,
    spawn: SpawnOpts,
    check: &dyn Fn(&Mount),
) {
    sock.set_read_timeout(Some(TIMEOUT)).unwrap();
    let img = spawn
        .files_dir
        .clone()
        .unwrap_or_else(|| w.path().to_path_buf())
        .join("disk.img");
    let mp = img.with_file_name("disk.raw");
    let mut spawn = spawn;
    spawn.env.push(("NOTIFY_SOCKET".into(), value.into()));
    let m = Mount::try_start_opts(w, &img, &mp, &[], &spawn)
        .unwrap_or_else(|f| panic!("mount failed: {}", f.stderr));
    let ready = datagram(sock);
    assert!(
        ready.lines().any(|l| l == "READY=1"),
        "first notification: {ready:?}"
    );
    assert!(
        ready.lines().any(|l| l == format!("MAINPID={}", m.pid())),
        "{ready:?}"
    );
    assert!(m.is_mounted(), "READY=1 came before the mount was live");
    check(&m);
    let st = m.stop();
    st.assert_clean("export with NOTIFY_SOCKET");
    let stopping = datagram(sock);
    assert!(
        stopping.lines().any(|l| l == "STOPPING=1"),
        "second notification: {stopping:?}"
    );
}

#[test]
fn sd_notify_ready_and_stopping_on_a_path_socket() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("svc-notify");
    let model = random_image(&w.join("disk.img"), MIB, 1206);
    let path = w.join("notify.sock");
    let sock = UnixDatagram::bind(&path).unwrap();
    notify_round(
        &w,
        &sock,
        path.to_str().unwrap(),
        SpawnOpts::default(),
        &|m| assert_bytes_eq(&read_all(m.path()), &model, 0, "export at READY=1"),
    );
}

#[test]
fn sd_notify_abstract_socket_as_a_normal_user() {
    let Some(u) = unprivileged() else { return };
    let w = WorkDir::new("svc-notify-user");
    let (dir, _img, model) = user_files(&w, u, MIB, 1207);
    let name = format!("fusex-e2e-notify-{}", std::process::id());
    let sock =
        UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    notify_round(&w, &sock, &format!("@{name}"), opts(u, &dir), &|m| {
        assert_bytes_eq(&read_as(u, m.path()), &model, 0, "export at READY=1")
    });
}

#[test]
fn sd_notify_socket_that_does_not_exist_is_one_line() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("svc-notify-bad");
    random_image(&w.join("disk.img"), MIB, 1208);
    let mp = w.join("disk.raw");
    let mut cmd = Command::new(fusex_bin());
    cmd.arg("mount")
        .arg(w.join("disk.img"))
        .arg(&mp)
        .env("NOTIFY_SOCKET", w.join("missing.sock"));
    let r = run_with_timeout(&w, cmd, Some(&mp));
    r.assert_one_error_line("NOTIFY_SOCKET naming no socket");
    assert!(r.stderr.contains("NOTIFY_SOCKET"), "{}", r.stderr);
    assert!(!is_fuse_mounted(&mp));
}

/// `fusex restart` as the user who made the export through fusermount3: the new daemon serves
/// it, and at its end unmounts it through fusermount3 as the old one would have.
#[test]
fn unprivileged_restart_keeps_the_export() {
    let Some(u) = unprivileged() else { return };
    if std::env::var("FUSEX_E2E_TRANSPORT").is_ok_and(|t| t == "uring") {
        // io_uring exports refuse restarts (tests/restart.rs); nothing more to see here.
        return;
    }
    let w = WorkDir::new("svc-restart");
    let (dir, img, model) = user_files(&w, u, MIB, 1207);
    let mp = dir.join("disk.raw");
    let pid_file = dir.join("fusex.pid");
    let (mut m, _) =
        Mount::start_daemonized_opts(&w, &img, &mp, &pid_file, &["--writable"], &opts(u, &dir))
            .unwrap_or_else(|f| panic!("--daemonize as {USER} failed: {}", f.stderr));
    let old = m.pid();
    let out = as_user(
        u,
        &[fusex_bin().as_os_str(), "restart".as_ref(), mp.as_os_str()],
        b"",
    );
    assert!(
        out.status.success(),
        "fusex restart as {USER}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let new: i32 = fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_ne!(new, old, "the pid file names the new daemon");
    m.adopt_pid(new);
    assert!(
        wait_until(Instant::now() + TIMEOUT, || !pid_alive(old)),
        "the old daemon exits"
    );
    assert_bytes_eq(&read_as(u, m.path()), &model, 0, "export after the restart");
    let st = m.stop();
    assert!(st.exited && !st.left_mounted, "{}", st.stderr);
    assert!(!pid_file.exists(), "pid file removed at exit");
}

/// A normal user's daemon keeps its restart socket and state in its own runtime directory
/// (`/run/user/UID/fusex`, else `/tmp/fusex-UID`), trusted only while that user owns it and no one
/// else may write it. One another user made first (here: root, open to all) is refused: the daemon
/// serves without restart support and says why, `fusex restart` refuses in one line naming it.
/// Runs as `nobody`, whose runtime directory no other test touches.
#[test]
fn a_runtime_directory_someone_else_made_is_never_trusted() {
    if unprivileged().is_none() {
        return;
    }
    let u = User {
        uid: 65534,
        gid: 65534,
    };
    if Path::new("/run/user/65534").is_dir() {
        skip_or_fail("nobody has a logind runtime directory here: the /tmp fallback is not used");
        return;
    }
    let runtime = PathBuf::from("/tmp/fusex-65534");
    let _ = fs::remove_dir_all(&runtime);
    fs::create_dir(&runtime).unwrap();
    fs::set_permissions(&runtime, fs::Permissions::from_mode(0o777)).unwrap();
    struct Cleanup(PathBuf);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }
    let _cleanup = Cleanup(runtime.clone());

    let w = WorkDir::new("svc-runtime");
    let (dir, img, model) = user_files(&w, u, MIB, 1207);
    let mp = dir.join("disk.raw");
    let m = Mount::try_start_opts(&w, &img, &mp, &[], &opts(u, &dir))
        .unwrap_or_else(|f| panic!("mount as nobody failed: {}", f.stderr));
    assert!(
        m.wait_for_log(
            "runtime directory /tmp/fusex-65534 is owned by user 0",
            Instant::now() + TIMEOUT
        ),
        "{}",
        m.stderr()
    );
    let out = as_user(
        u,
        &[fusex_bin().as_os_str(), "restart".as_ref(), mp.as_os_str()],
        b"",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("/tmp/fusex-65534"), "{err}");
    assert_bytes_eq(&read_as(u, m.path()), &model, 0, "export after the refusal");
    m.stop()
        .assert_clean("nobody's export without restart support");

    // Gone, the directory is made anew by the next daemon, the user's alone.
    fs::remove_dir_all(&runtime).unwrap();
    let m = Mount::try_start_opts(&w, &img, &mp, &[], &opts(u, &dir))
        .unwrap_or_else(|f| panic!("mount as nobody failed: {}", f.stderr));
    let made = wait_until(Instant::now() + TIMEOUT, || {
        fs::read_dir(&runtime).is_ok_and(|d| {
            d.flatten()
                .any(|e| e.path().extension().is_some_and(|x| x == "json"))
        })
    });
    assert!(made, "{}", m.stderr());
    let meta = fs::symlink_metadata(&runtime).unwrap();
    assert_eq!((meta.uid(), meta.mode() & 0o777), (65534, 0o700));
    let listed = as_user(u, &[fusex_bin().as_os_str(), "list".as_ref()], b"");
    let table = String::from_utf8_lossy(&listed.stdout);
    assert!(
        table
            .lines()
            .any(|l| l.starts_with(&*mp.to_string_lossy()) && l.contains("serving")),
        "{table}"
    );
    m.stop().assert_clean("nobody's export");
}

/// The point of `--partition`: a normal user runs mkfs and fsck on a partition of a VMDK
/// image, without loop devices or root.
#[test]
fn unprivileged_filesystem_on_a_partition_of_a_vmdk() {
    let Some(u) = unprivileged() else { return };
    if !require_fuse_and_tools(&["sfdisk", "qemu-img", "mkfs.ext4", "fsck.ext4"]) {
        return;
    }
    let w = WorkDir::new("svc-user-part");
    let dir = w.join("home");
    fs::create_dir(&dir).unwrap();
    std::os::unix::fs::chown(&dir, Some(u.uid), Some(u.gid)).unwrap();
    let raw = w.join("disk.raw");
    sparse_image(&raw, 64 * MIB);
    let mut c = Command::new("sfdisk");
    c.arg("-q").arg(&raw).stdin(Stdio::piped());
    let mut child = c.spawn().unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"label: dos\nstart=2048, size=20M, type=83\nsize=20M, type=83\n")
        .unwrap();
    assert!(child.wait().unwrap().success());
    let img = dir.join("disk.vmdk");
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "vmdk"])
            .arg(&raw)
            .arg(&img),
    );
    std::os::unix::fs::chown(&img, Some(u.uid), Some(u.gid)).unwrap();
    let mp = dir.join("p2.raw");
    let m = Mount::try_start_opts(
        &w,
        &img,
        &mp,
        &["--writable", "--partition=2"],
        &opts(u, &dir),
    )
    .unwrap_or_else(|f| panic!("mount as {USER} failed: {}", f.stderr));
    for tool in [vec!["mkfs.ext4", "-q", "-F"], vec!["fsck.ext4", "-fn"]] {
        let bin = which(tool[0]).unwrap();
        let mut args: Vec<&std::ffi::OsStr> = vec![bin.as_os_str()];
        args.extend(tool[1..].iter().map(std::ffi::OsStr::new));
        args.push(mp.as_os_str());
        let out = as_user(u, &args, b"");
        assert!(
            out.status.success(),
            "{} as {USER}: {}{}",
            tool[0],
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    m.stop().assert_clean("a normal user's partition export");
    let check = run(Command::new("qemu-img")
        .args(["check", "-f", "vmdk"])
        .arg(&img));
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );
}
