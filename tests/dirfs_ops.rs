//! Directory exports: the operations beyond the basic ones. `statx` (birth time included),
//! `copy_file_range`, POSIX ACLs (set, read, enforced for a normal user, inherited on creation)
//! and POSIX and flock locks between two processes. Oracles: the same call made on the source,
//! `getfacl` on the source, a normal user's attempts on the source.

use std::ffi::CString;
use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use fusex_e2e::*;

/// A source tree and a directory mountpoint in a fresh work directory, searchable by the other
/// users the tests switch to.
struct Tree {
    work: WorkDir,
    src: PathBuf,
    mnt: PathBuf,
}

impl Tree {
    fn new(tag: &str) -> Tree {
        let work = WorkDir::new(tag);
        let src = work.join("src");
        let mnt = work.join("mnt");
        fs::create_dir(&src).unwrap();
        fs::create_dir(&mnt).unwrap();
        for d in [work.path(), &src, &mnt] {
            fs::set_permissions(d, fs::Permissions::from_mode(0o755)).unwrap();
        }
        Tree { work, src, mnt }
    }

    fn mount(&self, args: &[&str]) -> Mount {
        Mount::start(&self.work, &self.src, &self.mnt, args)
    }
}

fn c(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

/// `statx(2)` of `p` (not following a final symlink), asking for every basic field and the
/// birth time.
fn statx(p: &Path) -> libc::statx {
    let cp = c(p);
    let mut sx = std::mem::MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: a valid path and a writable statx.
    let r = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            cp.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
            libc::STATX_BASIC_STATS | libc::STATX_BTIME,
            sx.as_mut_ptr(),
        )
    };
    assert_eq!(
        r,
        0,
        "statx {}: {}",
        p.display(),
        std::io::Error::last_os_error()
    );
    // SAFETY: statx succeeded.
    unsafe { sx.assume_init() }
}

/// `statx(fd, "", AT_EMPTY_PATH)`: of an open file.
fn fstatx(f: &fs::File) -> libc::statx {
    let mut sx = std::mem::MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: an open descriptor, an empty NUL-terminated path and a writable statx.
    let r = unsafe {
        libc::statx(
            f.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_BASIC_STATS | libc::STATX_BTIME,
            sx.as_mut_ptr(),
        )
    };
    assert_eq!(r, 0, "fstatx: {}", std::io::Error::last_os_error());
    // SAFETY: statx succeeded.
    unsafe { sx.assume_init() }
}

/// The fields a FUSE `statx` can carry, for comparison (atime left out: reading changes it).
fn carried(sx: &libc::statx) -> [i64; 14] {
    [
        i64::from(sx.stx_mask & (libc::STATX_BASIC_STATS | libc::STATX_BTIME) & !libc::STATX_ATIME),
        i64::from(sx.stx_mode),
        sx.stx_ino as i64,
        sx.stx_size as i64,
        sx.stx_blocks as i64,
        i64::from(sx.stx_nlink),
        i64::from(sx.stx_uid),
        i64::from(sx.stx_gid),
        sx.stx_btime.tv_sec,
        i64::from(sx.stx_btime.tv_nsec),
        sx.stx_mtime.tv_sec,
        i64::from(sx.stx_mtime.tv_nsec),
        sx.stx_ctime.tv_sec,
        i64::from(sx.stx_ctime.tv_nsec),
    ]
}

#[test]
fn statx_through_the_mount_gives_the_sources_birth_time() {
    if !require_fuse() {
        return;
    }
    let t = Tree::new("dirfs-statx");
    fs::write(t.src.join("file"), vec![7u8; 70_000]).unwrap();
    fs::create_dir(t.src.join("dir")).unwrap();
    fs::write(t.src.join("dir/inner"), b"x").unwrap();
    std::os::unix::fs::symlink("file", t.src.join("link")).unwrap();
    let want = statx(&t.src.join("file"));
    if want.stx_mask & libc::STATX_BTIME == 0 {
        // The source filesystem keeps no birth time: nothing to pass on.
        assert!(!in_ci(), "the CI source filesystem records birth times");
        return;
    }
    let m = t.mount(&["--writable"]);
    for p in ["file", "dir", "dir/inner", "link", "."] {
        let (src, mnt) = (statx(&t.src.join(p)), statx(&t.mnt.join(p)));
        assert!(
            mnt.stx_mask & libc::STATX_BTIME != 0,
            "{p}: birth time given"
        );
        assert_eq!(carried(&mnt), carried(&src), "{p}");
    }
    // A file made through the mount: its birth time is the source's, on an open descriptor too.
    fs::write(t.mnt.join("new"), b"new").unwrap();
    let f = fs::File::open(t.mnt.join("new")).unwrap();
    let (src, mnt) = (statx(&t.src.join("new")), fstatx(&f));
    assert_eq!(carried(&mnt), carried(&src), "new, by descriptor");
    assert!(src.stx_btime.tv_sec > 0);
    drop(f);
    let stopped = m.stop();
    stopped.assert_clean("statx through a directory export");
    assert!(stopped.stat(&["ops", "STATX"]) > 0, "answered by STATX");
}

/// `copy_file_range(2)` of `len` bytes; the count copied.
fn copy_range(from: &fs::File, off_in: i64, to: &fs::File, off_out: i64, len: usize) -> usize {
    let (mut i, mut o) = (off_in, off_out);
    // SAFETY: open descriptors and valid offset pointers.
    let n =
        unsafe { libc::copy_file_range(from.as_raw_fd(), &mut i, to.as_raw_fd(), &mut o, len, 0) };
    assert!(
        n >= 0,
        "copy_file_range: {}",
        std::io::Error::last_os_error()
    );
    n as usize
}

#[test]
fn copy_file_range_through_the_mount_copies_on_the_source() {
    if !require_fuse() {
        return;
    }
    let t = Tree::new("dirfs-copy");
    let mut rng = Rng::new(47);
    let data = rng.bytes(3 << 20 | 12_345);
    fs::write(t.src.join("src"), &data).unwrap();
    fs::write(t.src.join("dst"), vec![0xEEu8; 5000]).unwrap();
    let m = t.mount(&["--writable"]);
    let from = fs::File::open(t.mnt.join("src")).unwrap();
    let to = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(t.mnt.join("dst"))
        .unwrap();
    // The model of what the destination holds.
    let mut want = vec![0xEEu8; 5000];
    let mut apply = |off_in: usize, off_out: usize, len: usize| {
        let n = copy_range(&from, off_in as i64, &to, off_out as i64, len);
        let avail = data.len().saturating_sub(off_in).min(len);
        assert_eq!(
            n, avail,
            "copy {off_in}+{len} -> {off_out}: the count copied"
        );
        if n > 0 {
            if want.len() < off_out + n {
                want.resize(off_out + n, 0);
            }
            want[off_out..off_out + n].copy_from_slice(&data[off_in..off_in + n]);
        }
    };
    apply(0, 0, 100); // a head over the old contents
    apply(12_345, 777, 100_000); // unaligned offsets, past the old end
    apply(1 << 20, 4 << 20, 65_536); // past the end: a hole before it
    apply(data.len() - 1000, 9, 4096); // runs past the source's end: short
    apply(data.len() + 10, 0, 10); // at the end: nothing
    let mut done = 0;
    while done < data.len() {
        // The whole file, as a copy loop does it, into a new file.
        let whole = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(t.mnt.join("whole"))
            .unwrap();
        let n = copy_range(&from, done as i64, &whole, done as i64, data.len() - done);
        assert!(n > 0);
        done += n;
    }
    drop((from, to));
    assert_eq!(
        fs::read(t.mnt.join("dst")).unwrap(),
        want,
        "through the mount"
    );
    assert_eq!(fs::read(t.src.join("dst")).unwrap(), want, "in the source");
    assert_eq!(fs::read(t.src.join("whole")).unwrap(), data);
    let stopped = m.stop();
    stopped.assert_clean("copy_file_range through a directory export");
    assert!(
        stopped.stat(&["ops", "COPY_FILE_RANGE_64"]) + stopped.stat(&["ops", "COPY_FILE_RANGE"])
            > 0,
        "copied by fusex, not by the kernel's read-and-write fallback"
    );
}

/// `getfacl` of `p`, without the header that names the path (so two paths compare).
fn getfacl(p: &Path) -> String {
    let out = run_ok(
        Command::new("getfacl")
            .args(["--omit-header", "--numeric"])
            .arg(p),
    );
    String::from_utf8(out.stdout).unwrap()
}

fn setfacl(args: &[&str], p: &Path) {
    run_ok(Command::new("setfacl").args(args).arg(p));
}

/// Runs `script` as uid 65534, gid 65533, no supplementary groups; whether it succeeded.
fn as_user(script: &str) -> bool {
    run(Command::new("setpriv").args([
        "--reuid=65534",
        "--regid=65533",
        "--clear-groups",
        "sh",
        "-c",
        script,
    ]))
    .status
    .success()
}

#[test]
fn posix_acls_are_set_read_enforced_and_inherited_as_on_the_source() {
    if !require_fuse_and_tools(&["setfacl", "getfacl", "setpriv"]) {
        return;
    }
    let t = Tree::new("dirfs-acl");
    // A source without ACL support cannot show any of this.
    fs::write(t.work.join("probe"), b"").unwrap();
    let probe = run(Command::new("setfacl")
        .args(["-m", "u:65534:r"])
        .arg(t.work.join("probe")));
    if !probe.status.success() {
        assert!(!in_ci(), "the CI source filesystem has ACLs");
        return;
    }
    for name in ["readable", "denied", "viagroup"] {
        fs::write(t.src.join(name), format!("{name}\n")).unwrap();
    }
    fs::set_permissions(t.src.join("readable"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::set_permissions(t.src.join("denied"), fs::Permissions::from_mode(0o644)).unwrap();
    fs::set_permissions(t.src.join("viagroup"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::create_dir(t.src.join("drop")).unwrap();
    fs::set_permissions(t.src.join("drop"), fs::Permissions::from_mode(0o755)).unwrap();
    fs::create_dir(t.src.join("inherit")).unwrap();
    // One ACL set on the source before the mount: read through it.
    setfacl(&["-m", "u:65534:r"], &t.src.join("readable"));
    let m = t.mount(&["--writable", "--allow-other"]);
    let (src, mnt) = (&t.src, &t.mnt);

    // Set through the mount: the source has exactly that ACL; read both ways.
    setfacl(&["-m", "u:65534:---"], &mnt.join("denied"));
    setfacl(&["-m", "g:65533:r,m::r"], &mnt.join("viagroup"));
    setfacl(&["-m", "u:65534:rwx"], &mnt.join("drop"));
    for p in ["readable", "denied", "viagroup", "drop"] {
        let (s, f) = (getfacl(&src.join(p)), getfacl(&mnt.join(p)));
        assert_eq!(f, s, "{p}: getfacl through the mount and on the source");
        assert!(
            s.contains("user:65534:") || s.contains("group:65533:"),
            "{p}: {s}"
        );
        assert_eq!(
            fs::metadata(mnt.join(p)).unwrap().mode(),
            fs::metadata(src.join(p)).unwrap().mode(),
            "{p}: the mode follows the ACL's mask"
        );
    }

    // The normal user gets what the ACL gives it, as on the source.
    for (what, script) in [
        ("named user may read", "cat {}/readable"),
        ("named user entry denies", "cat {}/denied"),
        ("named group may read", "cat {}/viagroup"),
        ("named user may create", "touch {}/drop/by-user-{}"),
        ("named user may not write", "echo x >> {}/readable"),
    ] {
        let on_src = as_user(
            &script
                .replacen("{}", &src.display().to_string(), 1)
                .replace("{}", "src"),
        );
        let on_mnt = as_user(
            &script
                .replacen("{}", &mnt.display().to_string(), 1)
                .replace("{}", "mnt"),
        );
        assert_eq!(
            on_mnt, on_src,
            "{what}: the mount allows what the source allows"
        );
    }
    assert!(as_user(&format!("cat {}/readable", mnt.display())));
    assert!(!as_user(&format!("cat {}/denied", mnt.display())));
    assert!(src.join("drop/by-user-mnt").exists());

    // Default ACLs: what is created through the mount inherits them as on the source, whatever
    // the creator's umask.
    setfacl(
        &["-d", "-m", "u:65534:rwx,g::rx,o::-"],
        &mnt.join("inherit"),
    );
    assert_eq!(getfacl(&mnt.join("inherit")), getfacl(&src.join("inherit")));
    let made = |base: &Path, tag: &str| {
        let b = base.display();
        let out = run(Command::new("sh").args([
            "-c",
            &format!(
                "umask 077 && echo f > {b}/inherit/f-{tag} && mkdir {b}/inherit/d-{tag} && \
                 mkdir -m 0751 {b}/inherit/m-{tag} && touch {b}/inherit/d-{tag}/inner"
            ),
        ]));
        assert!(
            out.status.success(),
            "{tag}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    made(src, "src");
    made(mnt, "mnt");
    for p in ["f-{}", "d-{}", "m-{}", "d-{}/inner"] {
        let on_src = t.src.join("inherit").join(p.replace("{}", "src"));
        let on_mnt = t.src.join("inherit").join(p.replace("{}", "mnt"));
        assert_eq!(
            getfacl(&on_mnt),
            getfacl(&on_src),
            "{p}: the ACL a creation through the mount gets"
        );
        assert_eq!(
            fs::metadata(&on_mnt).unwrap().mode(),
            fs::metadata(&on_src).unwrap().mode(),
            "{p}: its mode"
        );
    }
    assert!(
        getfacl(&t.src.join("inherit/d-mnt")).contains("default:user:65534:rwx"),
        "a new directory inherits the default ACL as its own default"
    );
    // And the normal user reaches the inherited file, as the ACL says.
    assert!(as_user(&format!("cat {}/inherit/f-mnt", mnt.display())));
    m.stop()
        .assert_clean("POSIX ACLs through a directory export");
}

/// Tries to take a lock on `p` from another process without waiting: `"ok"`, or the errno's
/// name. `kind`: `posix` (fcntl `F_SETLK`) or `flock`.
fn try_lock_elsewhere(kind: &str, p: &Path) -> String {
    let script = r#"
import errno, fcntl, sys
f = open(sys.argv[2], "r+")
try:
    if sys.argv[1] == "posix":
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    else:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("ok")
except OSError as e:
    print(errno.errorcode[e.errno])
"#;
    let out = run_ok(Command::new("python3").args(["-c", script, kind]).arg(p));
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// `flock(2)` on an open file: 0 or -1.
fn flock(f: &fs::File, op: libc::c_int) -> libc::c_int {
    // SAFETY: an open descriptor; no pointers.
    unsafe { libc::flock(f.as_raw_fd(), op) }
}

/// `fcntl(2)` with a lock command (`F_SETLK`, `F_GETLK`) on an open file: 0 or -1.
fn fcntl_lock(f: &fs::File, cmd: libc::c_int, fl: &mut libc::flock) -> libc::c_int {
    // SAFETY: an open descriptor and a valid, writable flock struct.
    unsafe { libc::fcntl(f.as_raw_fd(), cmd, fl as *mut libc::flock) }
}

#[test]
fn posix_and_flock_locks_hold_between_processes_through_the_mount() {
    if !require_fuse_and_tools(&["python3"]) {
        return;
    }
    let t = Tree::new("dirfs-locks");
    fs::write(t.src.join("f"), b"locked\n").unwrap();
    let m = t.mount(&["--writable"]);
    let p = t.mnt.join("f");
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();

    // A POSIX write lock held here: another process's non-blocking attempt fails, then
    // succeeds once it is released.
    let whole = |l_type: libc::c_int| libc::flock {
        l_type: l_type as i16,
        l_whence: libc::SEEK_SET as i16,
        l_start: 0,
        l_len: 0,
        l_pid: 0,
    };
    assert_eq!(fcntl_lock(&f, libc::F_SETLK, &mut whole(libc::F_WRLCK)), 0);
    let refused = try_lock_elsewhere("posix", &p);
    assert!(
        refused == "EAGAIN" || refused == "EACCES",
        "a held POSIX lock refuses another process: {refused}"
    );
    // This process's own F_GETLK sees no conflict with itself.
    let mut probe = whole(libc::F_WRLCK);
    assert_eq!(fcntl_lock(&f, libc::F_GETLK, &mut probe), 0);
    assert_eq!(i32::from(probe.l_type), libc::F_UNLCK);
    assert_eq!(fcntl_lock(&f, libc::F_SETLK, &mut whole(libc::F_UNLCK)), 0);
    assert_eq!(try_lock_elsewhere("posix", &p), "ok", "released");

    // The same with flock.
    assert_eq!(flock(&f, libc::LOCK_EX | libc::LOCK_NB), 0);
    assert_eq!(
        try_lock_elsewhere("flock", &p),
        "EAGAIN",
        "a held flock lock refuses another process (EWOULDBLOCK)"
    );
    assert_eq!(flock(&f, libc::LOCK_UN), 0);
    assert_eq!(try_lock_elsewhere("flock", &p), "ok", "released");

    // The locks are the mount's own (the kernel's local locks): the source's file is not
    // locked by them.
    assert_eq!(flock(&f, libc::LOCK_EX | libc::LOCK_NB), 0);
    assert_eq!(try_lock_elsewhere("flock", &t.src.join("f")), "ok");
    drop(f);
    assert_eq!(try_lock_elsewhere("flock", &p), "ok", "closing releases");
    m.stop().assert_clean("locks through a directory export");
}

/// A fanotify group whose `FAN_OPEN_PERM` mark on one file holds every open of it until the
/// test answers.
struct OpenGate {
    fan: std::os::fd::OwnedFd,
}

impl OpenGate {
    /// None where fanotify permission events are not available (kernel without
    /// `CONFIG_FANOTIFY_ACCESS_PERMISSIONS`, or no `CAP_SYS_ADMIN`).
    fn on(file: &Path) -> Option<OpenGate> {
        use std::os::fd::FromRawFd;
        // SAFETY: plain syscall with integer arguments; the result is checked.
        let fd = unsafe {
            libc::fanotify_init(
                libc::FAN_CLASS_CONTENT | libc::FAN_CLOEXEC,
                libc::O_RDONLY as libc::c_uint,
            )
        };
        if fd < 0 {
            return None;
        }
        // SAFETY: just returned by the kernel, owned here.
        let fan = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        let p = c(file);
        // SAFETY: a valid path; the result is checked.
        let r = unsafe {
            libc::fanotify_mark(
                fan.as_raw_fd(),
                libc::FAN_MARK_ADD,
                libc::FAN_OPEN_PERM,
                libc::AT_FDCWD,
                p.as_ptr(),
            )
        };
        (r == 0).then_some(OpenGate { fan })
    }

    /// Waits (at most `TIMEOUT`) for an open of the file to be held; returns the event's
    /// descriptor, to answer with [`OpenGate::allow`].
    fn held(&self) -> Option<i32> {
        let mut pfd = libc::pollfd {
            fd: self.fan.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, TIMEOUT.as_millis() as libc::c_int) };
        if n != 1 {
            return None;
        }
        let mut ev = std::mem::MaybeUninit::<libc::fanotify_event_metadata>::zeroed();
        let size = std::mem::size_of::<libc::fanotify_event_metadata>();
        // SAFETY: reads at most one event's metadata into writable memory of that size.
        let got = unsafe { libc::read(self.fan.as_raw_fd(), ev.as_mut_ptr().cast(), size) };
        assert_eq!(got, size as isize, "one fanotify event");
        // SAFETY: filled by the read (and zeroed before).
        let ev = unsafe { ev.assume_init() };
        assert!(ev.mask & libc::FAN_OPEN_PERM != 0, "mask {:#x}", ev.mask);
        Some(ev.fd)
    }

    /// Lets the held open (event descriptor `fd`) go on.
    fn allow(&self, fd: i32) {
        let answer = libc::fanotify_response {
            fd,
            response: libc::FAN_ALLOW,
        };
        let size = std::mem::size_of::<libc::fanotify_response>();
        // SAFETY: writes one response from a live value of that size; then closes the event's
        // descriptor, which the kernel opened for this listener.
        unsafe {
            let w = libc::write(
                self.fan.as_raw_fd(),
                (&answer as *const libc::fanotify_response).cast(),
                size,
            );
            assert_eq!(w, size as isize, "fanotify answer");
            libc::close(fd);
        }
    }
}

/// A slow source file holds up only the requests that wait on it: while a fanotify permission
/// listener holds the daemon's open of one file, a lookup, a stat and an open and read of
/// another file complete on the same single-queue mount. Ordering, not timing: the other file's
/// operations finish before the test lets the held open go on.
#[test]
fn a_held_open_does_not_block_other_requests() {
    if !require_fuse() {
        return;
    }
    let t = Tree::new("dirfs-held-open");
    fs::write(t.src.join("held"), b"held\n").unwrap();
    fs::write(t.src.join("other"), b"other\n").unwrap();
    // Without passthrough, so the only open of the held file is the daemon's (with it, the
    // kernel opens the backing file again in the caller's open).
    let _m = t.mount(&["--queues", "1", "--passthrough", "off"]);
    // After the mount, so it is dropped first: closing the group lets a held open go on, which
    // the unmount in the mount's drop waits for.
    let Some(gate) = OpenGate::on(&t.src.join("held")) else {
        skip_or_fail("fanotify FAN_OPEN_PERM (CONFIG_FANOTIFY_ACCESS_PERMISSIONS and root)");
        return;
    };

    let (a_tx, a_rx) = std::sync::mpsc::channel();
    let held = t.mnt.join("held");
    let a = std::thread::spawn(move || {
        let r = fs::read(held);
        a_tx.send(()).unwrap();
        r
    });
    let ev = gate
        .held()
        .expect("the daemon's open of the held file reaches the listener");

    // The held open waits in the kernel; the same queue serves another file meanwhile.
    let (b_tx, b_rx) = std::sync::mpsc::channel();
    let mnt = t.mnt.clone();
    let b = std::thread::spawn(move || {
        let len = fs::symlink_metadata(mnt.join("other")).map(|m| m.len());
        let data = fs::read(mnt.join("other"));
        b_tx.send((len, data)).unwrap();
    });
    // (TIMEOUT only detects a hang: the test answers the listener either way.)
    let other = b_rx.recv_timeout(TIMEOUT);
    let a_finished_early = a_rx.try_recv().is_ok();
    gate.allow(ev);
    // Closing the group lets any other open of the file go on, and stops holding new ones.
    drop(gate);

    let (len, data) = other.expect("the other file was served while the held open waited");
    assert_eq!(len.unwrap(), 6);
    assert_eq!(data.unwrap(), b"other\n");
    assert!(
        !a_finished_early,
        "the held open finished before it was allowed"
    );
    assert_eq!(a.join().unwrap().unwrap(), b"held\n");
    b.join().unwrap();
}
