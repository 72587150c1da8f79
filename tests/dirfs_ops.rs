//! Directory exports: the operations beyond the basic ones. `statx` (birth time included),
//! `copy_file_range`, POSIX ACLs (set, read, enforced for a normal user, inherited on creation),
//! POSIX and flock locks between two processes, and every operation's errors (a missing name,
//! the wrong type, a permission refusal). Oracles: the same call made on the source,
//! `getfacl` on the source, a normal user's attempts on the source.

use std::ffi::{CStr, CString};
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

/// A fanotify group whose `FAN_OPEN_PERM` mark on one file (or on the entries of one
/// directory) holds every open of it until the test answers.
struct OpenGate {
    fan: std::os::fd::OwnedFd,
}

impl OpenGate {
    /// None where fanotify permission events are not available (kernel without
    /// `CONFIG_FANOTIFY_ACCESS_PERMISSIONS`, or no `CAP_SYS_ADMIN`).
    fn on(file: &Path) -> Option<OpenGate> {
        OpenGate::marking(file, 0)
    }

    /// Holds the opens of the entries of `dir`, those a creation makes included.
    fn on_entries_of(dir: &Path) -> Option<OpenGate> {
        OpenGate::marking(dir, libc::FAN_EVENT_ON_CHILD)
    }

    fn marking(file: &Path, extra: u64) -> Option<OpenGate> {
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
                libc::FAN_OPEN_PERM | extra,
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

/// A creation waits on the ring as an open does: while a fanotify permission listener holds the
/// daemon's `O_CREAT` open of a new file (a CREATE), a lookup, a stat and an open and read of
/// another file, and a MKDIR, complete on the same single-queue mount. Ordering, not timing, as
/// above.
#[test]
fn a_held_creation_does_not_block_other_requests() {
    if !require_fuse() {
        return;
    }
    let t = Tree::new("dirfs-held-create");
    fs::create_dir(t.src.join("gated")).unwrap();
    fs::write(t.src.join("other"), b"other\n").unwrap();
    let _m = t.mount(&["--writable", "--queues", "1", "--passthrough", "off"]);
    let Some(gate) = OpenGate::on_entries_of(&t.src.join("gated")) else {
        skip_or_fail("fanotify FAN_OPEN_PERM (CONFIG_FANOTIFY_ACCESS_PERMISSIONS and root)");
        return;
    };

    let (a_tx, a_rx) = std::sync::mpsc::channel();
    let new = t.mnt.join("gated/new");
    let a = std::thread::spawn(move || {
        let r = fs::write(new, b"made\n");
        a_tx.send(()).unwrap();
        r
    });
    let ev = gate
        .held()
        .expect("the daemon's open of the new file reaches the listener");

    let (b_tx, b_rx) = std::sync::mpsc::channel();
    let mnt = t.mnt.clone();
    let b = std::thread::spawn(move || {
        let len = fs::symlink_metadata(mnt.join("other")).map(|m| m.len());
        let data = fs::read(mnt.join("other"));
        let made = fs::create_dir(mnt.join("dir"));
        b_tx.send((len, data, made)).unwrap();
    });
    let other = b_rx.recv_timeout(TIMEOUT);
    let a_finished_early = a_rx.try_recv().is_ok();
    gate.allow(ev);
    drop(gate);

    let (len, data, made) =
        other.expect("the other requests were served while the creation waited");
    assert_eq!(len.unwrap(), 6);
    assert_eq!(data.unwrap(), b"other\n");
    made.unwrap();
    assert!(t.src.join("dir").is_dir());
    assert!(
        !a_finished_early,
        "the held creation finished before it was allowed"
    );
    a.join().unwrap().unwrap();
    assert_eq!(fs::read(t.src.join("gated/new")).unwrap(), b"made\n");
    b.join().unwrap();
}

/// Set-id bits after a write, a truncate and a chown through the mount are those the same calls
/// leave on the source itself, with and without passthrough: fusex negotiates
/// `FUSE_HANDLE_KILLPRIV_V2` (the kernel no longer asks for `security.capability` before every
/// write) and clears the bits itself where a local call by that caller would. Two differences,
/// documented: under passthrough a write by root clears them too (the kernel writes with the
/// credentials the file was registered with, which lack `CAP_FSETID`), and set-gid on a file
/// its group may not execute (no privilege at exec) stays after a write by someone outside the
/// group (the protocol has the server clear set-gid only where the group may execute).
#[test]
fn set_id_bits_after_writes_truncates_and_chowns_are_the_local_ones() {
    if !require_fuse_and_tools(&["setpriv", "truncate", "chown"]) {
        return;
    }
    // (operation, caller, mode before): the calls a caller without CAP_FSETID makes clear
    // set-uid, and set-gid where the group may execute; root's keep them, but chown's.
    let cases: &[(&str, &str, u32)] = &[
        ("write", "user", 0o6777),
        ("write", "user", 0o2767),
        ("write", "root", 0o6777),
        ("truncate", "user", 0o6777),
        ("truncate", "root", 0o6777),
        ("chown", "root", 0o6755),
        ("chown", "root", 0o2745),
    ];
    for pt in ["on", "off"] {
        let t = Tree::new("dirfs-killpriv");
        let m = t.mount(&["--writable", "--allow-other", "--passthrough", pt]);
        for (i, &(op, who, mode)) in cases.iter().enumerate() {
            let mut modes = Vec::new();
            for (side, dir) in [("local", &t.src), ("mount", &t.mnt)] {
                let name = format!("{side}-{i}");
                fs::write(t.src.join(&name), b"#!/bin/sh\n").unwrap();
                fs::set_permissions(t.src.join(&name), fs::Permissions::from_mode(mode)).unwrap();
                let path = dir.join(&name);
                let p = path.display();
                let call = match op {
                    "write" => format!("echo exit >> {p}"),
                    "truncate" => format!("truncate -s 1 {p}"),
                    _ => format!("chown 65534 {p}"),
                };
                let mut cmd = Command::new("setpriv");
                if who == "user" {
                    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"]);
                }
                let out = run(cmd.args(["sh", "-c", &call]));
                assert!(
                    out.status.success(),
                    "{op} as {who} on {side}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                modes.push(fs::metadata(t.src.join(&name)).unwrap().mode() & 0o7777);
            }
            let (local, mount) = (modes[0], modes[1]);
            let group_exec = mode & 0o2010 == 0o2010;
            let want = if pt == "on" && op == "write" && who == "root" {
                assert_eq!(local, mode, "root's local write keeps the bits");
                mode & !(0o4000 | if group_exec { 0o2000 } else { 0 })
            } else if who == "user" && mode & 0o2000 != 0 && !group_exec {
                // Set-gid without group execute gives nothing at exec: a local write by
                // someone outside the group clears it, the protocol clears it only where the
                // group may execute.
                local | 0o2000
            } else {
                local
            };
            assert_eq!(
                mount, want,
                "{op} as {who} of a {mode:o} file, passthrough {pt}"
            );
        }
        m.stop()
            .assert_clean("set-id bits through a directory export");
    }
}

/// One system call of [`errors_through_the_mount_are_the_sources`] on paths of type `P`
/// (relative in the table, then absolute below a root).
#[derive(Clone, Copy, Debug)]
enum Op<P> {
    /// `open` with these flags (mode 0644 with `O_CREAT`); closed again.
    Open(P, i32),
    Mkdir(P),
    Rmdir(P),
    Unlink(P),
    Rename(P, P),
    /// `renameat2(RENAME_EXCHANGE)`.
    Exchange(P, P),
    /// `link` (not following a final symlink).
    Link(P, P),
    /// A symlink to `target` at the path.
    Symlink(P),
    Mkfifo(P),
    Readlink(P),
    /// `truncate` to 1 byte.
    Truncate(P),
    /// `chmod` to 0600.
    Chmod(P),
    /// `chown` to 65534:65533.
    Chown(P),
    /// `utimensat`: to the current time (true, which needs write permission) or to a given one
    /// (which needs ownership).
    Utimes(P, bool),
    /// `setxattr` of the name to `value` with these flags.
    Setxattr(P, &'static CStr, i32),
    /// `getxattr` of the name into a buffer of this size.
    Getxattr(P, &'static CStr, usize),
    Removexattr(P, &'static CStr),
    Listxattr(P),
    /// `open(O_RDONLY | O_DIRECTORY)`, as `opendir` does.
    Opendir(P),
    Statfs(P),
}

impl Op<&'static str> {
    /// The call on paths below `root`.
    fn below(&self, root: &Path) -> Op<CString> {
        let p = |s: &str| c(&root.join(s));
        match *self {
            Op::Open(a, f) => Op::Open(p(a), f),
            Op::Mkdir(a) => Op::Mkdir(p(a)),
            Op::Rmdir(a) => Op::Rmdir(p(a)),
            Op::Unlink(a) => Op::Unlink(p(a)),
            Op::Rename(a, b) => Op::Rename(p(a), p(b)),
            Op::Exchange(a, b) => Op::Exchange(p(a), p(b)),
            Op::Link(a, b) => Op::Link(p(a), p(b)),
            Op::Symlink(a) => Op::Symlink(p(a)),
            Op::Mkfifo(a) => Op::Mkfifo(p(a)),
            Op::Readlink(a) => Op::Readlink(p(a)),
            Op::Truncate(a) => Op::Truncate(p(a)),
            Op::Chmod(a) => Op::Chmod(p(a)),
            Op::Chown(a) => Op::Chown(p(a)),
            Op::Utimes(a, now) => Op::Utimes(p(a), now),
            Op::Setxattr(a, n, f) => Op::Setxattr(p(a), n, f),
            Op::Getxattr(a, n, size) => Op::Getxattr(p(a), n, size),
            Op::Removexattr(a, n) => Op::Removexattr(p(a), n),
            Op::Listxattr(a) => Op::Listxattr(p(a)),
            Op::Opendir(a) => Op::Opendir(p(a)),
            Op::Statfs(a) => Op::Statfs(p(a)),
        }
    }
}

impl Op<CString> {
    /// Makes the call: 0 or its errno. Only system calls, no allocation: it runs in a forked
    /// child too.
    fn errno(&self) -> i32 {
        let mut buf = [0u8; 256];
        // SAFETY: every path and name is a valid NUL-terminated string, every buffer is writable
        // for the length given, and a descriptor opened is closed again.
        let r: isize = unsafe {
            match self {
                Op::Open(a, f) => {
                    let fd = libc::open(a.as_ptr(), *f | libc::O_CLOEXEC, 0o644);
                    if fd >= 0 {
                        libc::close(fd);
                    }
                    fd as isize
                }
                Op::Mkdir(a) => libc::mkdir(a.as_ptr(), 0o755) as isize,
                Op::Rmdir(a) => libc::rmdir(a.as_ptr()) as isize,
                Op::Unlink(a) => libc::unlink(a.as_ptr()) as isize,
                Op::Rename(a, b) => libc::rename(a.as_ptr(), b.as_ptr()) as isize,
                Op::Exchange(a, b) => libc::renameat2(
                    libc::AT_FDCWD,
                    a.as_ptr(),
                    libc::AT_FDCWD,
                    b.as_ptr(),
                    libc::RENAME_EXCHANGE,
                ) as isize,
                Op::Link(a, b) => {
                    libc::linkat(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), 0) as isize
                }
                Op::Symlink(a) => libc::symlink(c"target".as_ptr(), a.as_ptr()) as isize,
                Op::Mkfifo(a) => libc::mkfifo(a.as_ptr(), 0o644) as isize,
                Op::Readlink(a) => libc::readlink(a.as_ptr(), buf.as_mut_ptr().cast(), buf.len()),
                Op::Truncate(a) => libc::truncate(a.as_ptr(), 1) as isize,
                Op::Chmod(a) => libc::chmod(a.as_ptr(), 0o600) as isize,
                Op::Chown(a) => libc::chown(a.as_ptr(), 65534, 65533) as isize,
                Op::Utimes(a, now) => {
                    let t = libc::timespec {
                        tv_sec: 1000,
                        tv_nsec: 0,
                    };
                    let times = [t, t];
                    let ptr = if *now {
                        std::ptr::null()
                    } else {
                        times.as_ptr()
                    };
                    libc::utimensat(libc::AT_FDCWD, a.as_ptr(), ptr, 0) as isize
                }
                Op::Setxattr(a, n, f) => {
                    libc::setxattr(a.as_ptr(), n.as_ptr(), c"value".as_ptr().cast(), 5, *f) as isize
                }
                Op::Getxattr(a, n, size) => {
                    libc::getxattr(a.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), *size)
                }
                Op::Removexattr(a, n) => libc::removexattr(a.as_ptr(), n.as_ptr()) as isize,
                Op::Listxattr(a) => libc::listxattr(a.as_ptr(), buf.as_mut_ptr().cast(), buf.len()),
                Op::Opendir(a) => {
                    let fd = libc::open(a.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY);
                    if fd >= 0 {
                        libc::close(fd);
                    }
                    fd as isize
                }
                Op::Statfs(a) => {
                    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
                    libc::statvfs(a.as_ptr(), st.as_mut_ptr()) as isize
                }
            }
        };
        if r < 0 {
            std::io::Error::last_os_error().raw_os_error().unwrap_or(-1)
        } else {
            0
        }
    }

    /// [`Op::errno`] in a child process running as uid 65534, gid 65533, no supplementary groups.
    fn errno_as_user(&self) -> i32 {
        errno_as_user(|| self.errno())
    }
}

/// `call`'s errno (0: it succeeded) in a child process running as uid 65534, gid 65533, no
/// supplementary groups. `call` must make only system calls (no allocation, no lock another
/// thread may hold): it runs between `fork` and `_exit`.
fn errno_as_user(call: impl FnOnce() -> i32) -> i32 {
    // SAFETY: the child makes only system calls (`call` included, as its contract says) and
    // leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // SAFETY: plain system calls; `_exit` does not return.
        unsafe {
            let dropped = libc::setgroups(0, std::ptr::null()) == 0
                && libc::setgid(65533) == 0
                && libc::setuid(65534) == 0;
            libc::_exit(if dropped { call() } else { 255 });
        }
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked, with a valid status pointer.
    let r = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(r, pid, "waitpid: {}", std::io::Error::last_os_error());
    assert!(
        libc::WIFEXITED(status),
        "the child ended with status {status:#x}"
    );
    let e = libc::WEXITSTATUS(status);
    assert_ne!(e, 255, "the child could not switch to uid 65534");
    e
}

/// Who makes a call of the table.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Who {
    Root,
    User,
}

/// Every operation with a missing name, the wrong type of file, and (as a normal user through
/// `--allow-other`) a permission refusal: the errno through the mount is the one the same call
/// gives on the source, and nothing changes in the source.
#[test]
fn errors_through_the_mount_are_the_sources() {
    if !require_fuse() {
        return;
    }
    use Op::*;
    use Who::{Root, User};
    let t = Tree::new("dirfs-errno");
    let s = |p: &str| t.src.join(p);
    fs::write(s("file"), b"data").unwrap();
    fs::create_dir(s("dir")).unwrap();
    fs::write(s("dir/inner"), b"x").unwrap();
    fs::create_dir(s("empty")).unwrap();
    std::os::unix::fs::symlink("file", s("link")).unwrap();
    fs::write(s("secret"), b"root only").unwrap();
    fs::set_permissions(s("secret"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::create_dir(s("closed")).unwrap();
    fs::write(s("closed/f"), b"x").unwrap();
    std::os::unix::fs::symlink("f", s("closed/lnk")).unwrap();
    fs::set_permissions(s("closed"), fs::Permissions::from_mode(0o700)).unwrap();
    fs::create_dir_all(s("rodir/sub")).unwrap();
    fs::write(s("rodir/f"), b"x").unwrap();
    fs::create_dir(s("pub")).unwrap();
    fs::set_permissions(s("pub"), fs::Permissions::from_mode(0o777)).unwrap();
    fs::create_dir(s("sticky")).unwrap();
    fs::write(s("sticky/rootfile"), b"x").unwrap();
    fs::set_permissions(s("sticky"), fs::Permissions::from_mode(0o1777)).unwrap();
    let xattrs = [
        Setxattr("file", c"user.k", 0),
        Setxattr("secret", c"user.k", 0),
    ]
    .iter()
    .all(|op| op.below(&t.src).errno() == 0);
    assert!(
        xattrs || !in_ci(),
        "the CI source filesystem has user xattrs"
    );

    let (rd, wr) = (libc::O_RDONLY, libc::O_WRONLY);
    let creat = libc::O_CREAT | libc::O_WRONLY;
    let mut cases: Vec<(Who, &str, Op<&'static str>)> = vec![
        // A missing name (or a missing directory on the way to it).
        (Root, "missing", Open("missing", rd)),
        (Root, "missing", Open("nodir/new", creat)),
        (Root, "missing", Mkdir("nodir/new")),
        (Root, "missing", Rmdir("missing")),
        (Root, "missing", Unlink("missing")),
        (Root, "missing", Rename("missing", "new")),
        (Root, "missing", Rename("file", "nodir/new")),
        (Root, "missing", Link("missing", "new")),
        (Root, "missing", Link("file", "nodir/new")),
        (Root, "missing", Symlink("nodir/new")),
        (Root, "missing", Mkfifo("nodir/new")),
        (Root, "missing", Readlink("missing")),
        (Root, "missing", Truncate("missing")),
        (Root, "missing", Truncate("dangling")),
        (Root, "missing", Chmod("missing")),
        (Root, "missing", Chown("missing")),
        (Root, "missing", Utimes("missing", true)),
        (Root, "missing", Setxattr("missing", c"user.k", 0)),
        (Root, "missing", Getxattr("missing", c"user.k", 256)),
        (Root, "missing", Removexattr("missing", c"user.k")),
        (Root, "missing", Listxattr("missing")),
        (Root, "missing", Opendir("missing")),
        (Root, "missing", Statfs("missing")),
        // The wrong type.
        (Root, "wrong type", Open("dir", wr)),
        (Root, "wrong type", Open("dir", creat)),
        (Root, "wrong type", Open("file", rd | libc::O_DIRECTORY)),
        (Root, "wrong type", Open("link", rd | libc::O_NOFOLLOW)),
        (Root, "wrong type", Open("file/x", rd)),
        (Root, "wrong type", Open("file/new", creat)),
        (Root, "wrong type", Open("file", creat | libc::O_EXCL)),
        (Root, "wrong type", Mkdir("file")),
        (Root, "wrong type", Mkdir("file/new")),
        (Root, "wrong type", Rmdir("file")),
        (Root, "wrong type", Rmdir("link")),
        (Root, "wrong type", Rmdir("dir")),
        (Root, "wrong type", Unlink("dir")),
        (Root, "wrong type", Rename("dir", "file")),
        (Root, "wrong type", Rename("file", "empty")),
        (Root, "wrong type", Rename("empty", "dir")),
        (Root, "wrong type", Rename("dir", "dir/new")),
        (Root, "wrong type", Rename("file", "file/new")),
        (Root, "wrong type", Link("dir", "new")),
        (Root, "wrong type", Link("file", "dir")),
        (Root, "wrong type", Link("file", "file/new")),
        (Root, "wrong type", Symlink("file")),
        (Root, "wrong type", Symlink("file/new")),
        (Root, "wrong type", Mkfifo("file")),
        (Root, "wrong type", Mkfifo("file/new")),
        (Root, "wrong type", Readlink("file")),
        (Root, "wrong type", Readlink("dir")),
        (Root, "wrong type", Truncate("dir")),
        (Root, "wrong type", Truncate("file/x")),
        (Root, "wrong type", Chmod("file/x")),
        (Root, "wrong type", Chown("file/x")),
        (Root, "wrong type", Utimes("file/x", true)),
        (Root, "wrong type", Setxattr("file/x", c"user.k", 0)),
        (Root, "wrong type", Getxattr("file/x", c"user.k", 256)),
        (Root, "wrong type", Removexattr("file/x", c"user.k")),
        (Root, "wrong type", Listxattr("file/x")),
        (Root, "wrong type", Opendir("file")),
        (Root, "wrong type", Opendir("link")),
        (Root, "wrong type", Statfs("file/x")),
        // A permission refusal, for a normal user.
        (User, "refused", Open("secret", rd)),
        (User, "refused", Open("file", wr)),
        (User, "refused", Open("closed/f", rd)),
        (User, "refused", Open("rodir/new", creat)),
        (User, "refused", Mkdir("rodir/new")),
        (User, "refused", Mkdir("closed/new")),
        (User, "refused", Rmdir("rodir/sub")),
        (User, "refused", Unlink("rodir/f")),
        (User, "refused", Unlink("sticky/rootfile")),
        (User, "refused", Rename("rodir/f", "pub/new")),
        (User, "refused", Rename("pub", "rodir/new")),
        (User, "refused", Rename("sticky/rootfile", "pub/new")),
        (User, "refused", Link("file", "rodir/new")),
        (User, "refused", Symlink("rodir/new")),
        (User, "refused", Mkfifo("rodir/new")),
        (User, "refused", Readlink("closed/lnk")),
        (User, "refused", Truncate("file")),
        (User, "refused", Chmod("file")),
        (User, "refused", Chown("file")),
        (User, "refused", Chown("pub")),
        (User, "refused", Utimes("file", true)),
        (User, "refused", Utimes("file", false)),
        (User, "refused", Setxattr("file", c"user.k", 0)),
        (User, "refused", Setxattr("pub", c"trusted.k", 0)),
        (User, "refused", Removexattr("file", c"user.k")),
        (User, "refused", Listxattr("closed/f")),
        (User, "refused", Opendir("closed")),
        (User, "refused", Statfs("closed/f")),
    ];
    if xattrs {
        cases.extend([
            (Root, "missing", Getxattr("file", c"user.none", 256)),
            (Root, "missing", Removexattr("file", c"user.none")),
            (
                Root,
                "missing",
                Setxattr("file", c"user.none", libc::XATTR_REPLACE),
            ),
            (
                Root,
                "wrong type",
                Setxattr("file", c"user.k", libc::XATTR_CREATE),
            ),
            (Root, "too small", Getxattr("file", c"user.k", 2)),
            (User, "refused", Getxattr("secret", c"user.k", 256)),
        ]);
    }
    // A dangling symlink for the missing cases that follow one.
    std::os::unix::fs::symlink("nowhere", s("dangling")).unwrap();

    let before = tree_listing(&t.src);
    let m = t.mount(&["--writable", "--allow-other"]);
    let mut wrong = Vec::new();
    for (who, what, op) in &cases {
        let run = |root: &Path| {
            let call = op.below(root);
            match who {
                Root => call.errno(),
                User => call.errno_as_user(),
            }
        };
        let native = run(&t.src);
        let through = run(&t.mnt);
        assert_ne!(
            native, 0,
            "{what}: {op:?} as {who:?} succeeds on the source"
        );
        if through != native {
            wrong.push(format!(
                "{what}: {op:?} as {who:?}: {} through the mount, {} on the source",
                errno_str(through),
                errno_str(native)
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} calls answer otherwise through the mount:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
    assert_eq!(
        tree_listing(&t.src),
        before,
        "nothing changed in the source"
    );
    m.stop().assert_clean("errors through a directory export");
}

/// Every path below `root` with its mode and size (a directory's size left out), in order.
fn tree_listing(root: &Path) -> Vec<(PathBuf, u32, u64)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let m = fs::symlink_metadata(&p).unwrap();
            if m.is_dir() {
                stack.push(p.clone());
            }
            let size = if m.is_dir() { 0 } else { m.len() };
            out.push((p.strip_prefix(root).unwrap().to_path_buf(), m.mode(), size));
        }
    }
    out.sort();
    out
}

/// Nothing crosses the export's boundary: a rename (plain or exchange) or a link from inside the
/// mount to outside it, or from outside in, fails with EXDEV for root and for a normal user
/// (`..` in the path included), and the mount root's `..` is the mountpoint's parent, never the
/// source's: a file beside the source is not reached through the mount.
#[test]
fn renames_and_links_across_the_exports_boundary_are_refused() {
    if !require_fuse() {
        return;
    }
    use Op::*;
    let t = Tree::new("dirfs-boundary");
    // The source sits deeper than the mountpoint: its parent is not the mountpoint's.
    let src = t.work.join("a/b/src");
    fs::create_dir_all(&src).unwrap();
    for d in ["a", "a/b", "a/b/src"] {
        fs::set_permissions(t.work.join(d), fs::Permissions::from_mode(0o755)).unwrap();
    }
    fs::write(t.work.join("a/b/victim"), b"beside the source\n").unwrap();
    let w = |p: &str| t.work.join(p);
    let user = |p: &Path| std::os::unix::fs::lchown(p, Some(65534), Some(65533)).unwrap();
    for (dir, file, sub) in [
        ("a/b/src/pub", "mine", "mydir"),
        ("out", "theirs", "theirdir"),
    ] {
        fs::create_dir(w(dir)).unwrap();
        fs::set_permissions(w(dir), fs::Permissions::from_mode(0o777)).unwrap();
        fs::write(w(&format!("{dir}/{file}")), file).unwrap();
        fs::create_dir(w(&format!("{dir}/{sub}"))).unwrap();
        user(&w(&format!("{dir}/{file}")));
        user(&w(&format!("{dir}/{sub}")));
    }
    fs::write(src.join("rootfile"), b"root's").unwrap();
    fs::write(w("outside"), b"outside").unwrap();
    let before = (tree_listing(&src), tree_listing(&w("out")));
    let m = Mount::start(&t.work, &src, &t.mnt, &["--writable", "--allow-other"]);
    assert!(t.mnt.join("pub/mine").exists());

    // (paths relative to the work directory; mnt/.. is the work directory again)
    let cases: Vec<(bool, Op<&'static str>)> = vec![
        (false, Rename("mnt/rootfile", "out/new")),
        (false, Rename("mnt/rootfile", "mnt/../out/new")),
        (false, Rename("outside", "mnt/new")),
        (false, Rename("mnt/pub", "out/newdir")),
        (false, Rename("out", "mnt/newdir")),
        (false, Rename("mnt/rootfile", "outside")),
        (false, Exchange("mnt/rootfile", "outside")),
        (false, Exchange("mnt/pub", "out")),
        (false, Link("mnt/rootfile", "out/new")),
        (false, Link("mnt/rootfile", "mnt/../new")),
        (false, Link("outside", "mnt/new")),
        (true, Rename("mnt/pub/mine", "out/new")),
        (true, Rename("mnt/pub/mydir", "out/newdir")),
        (true, Rename("out/theirs", "mnt/pub/new")),
        (true, Rename("out/theirdir", "mnt/pub/newdir")),
        (true, Exchange("mnt/pub/mine", "out/theirs")),
        (true, Link("mnt/pub/mine", "out/new")),
        (true, Link("out/theirs", "mnt/pub/new")),
    ];
    for (as_user, op) in &cases {
        let call = op.below(t.work.path());
        let e = if *as_user {
            call.errno_as_user()
        } else {
            call.errno()
        };
        let who = if *as_user { "a normal user" } else { "root" };
        assert_eq!(
            e,
            libc::EXDEV,
            "{op:?} as {who}: {} (EXDEV expected)",
            errno_str(e)
        );
    }
    // The same renames and links inside the mount work, for the user too: the refusals were
    // the boundary's.
    assert_eq!(
        Rename("mnt/pub/mine", "mnt/pub/moved")
            .below(t.work.path())
            .errno_as_user(),
        0
    );
    assert_eq!(
        Link("mnt/pub/moved", "mnt/pub/mine")
            .below(t.work.path())
            .errno_as_user(),
        0
    );
    assert_eq!(
        Unlink("mnt/pub/moved").below(t.work.path()).errno_as_user(),
        0
    );
    assert_eq!(
        (tree_listing(&src), tree_listing(&w("out"))),
        before,
        "nothing moved across"
    );
    assert_eq!(fs::read(w("outside")).unwrap(), b"outside");

    // The mount root's `..` is the mountpoint's parent (the work directory), as the kernel
    // resolves it: the source's parent, and the file beside the source, are not reached.
    let ino = |p: &Path| fs::metadata(p).unwrap().ino();
    assert_eq!(ino(&t.mnt.join("..")), ino(t.work.path()));
    assert_ne!(ino(&t.mnt.join("..")), ino(&w("a/b")));
    let root = fs::File::open(&t.mnt).unwrap();
    // SAFETY: an open directory descriptor and a NUL-terminated name; the result is checked.
    let up = unsafe {
        libc::openat(
            root.as_raw_fd(),
            c"..".as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    assert!(
        up >= 0,
        "openat(root, ..): {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: just opened, owned here.
    let up = unsafe { <fs::File as std::os::fd::FromRawFd>::from_raw_fd(up) };
    assert_eq!(up.metadata().unwrap().ino(), ino(t.work.path()));
    for p in ["mnt/../victim", "mnt/../../victim", "mnt/pub/../../victim"] {
        let e = Open(p, libc::O_RDONLY).below(t.work.path());
        assert_eq!(e.errno(), libc::ENOENT, "{p} as root");
        assert_eq!(e.errno_as_user(), libc::ENOENT, "{p} as a normal user");
    }
    assert_eq!(
        Open("mnt/../outside", libc::O_RDONLY)
            .below(t.work.path())
            .errno(),
        0
    );
    // The victim is found only as any path finds it: `..` left the mount for the work directory.
    assert_eq!(
        fs::read(t.mnt.join("pub/../../a/b/victim")).unwrap(),
        b"beside the source\n"
    );
    drop((root, up));
    m.stop().assert_clean("the boundary of a directory export");
}

/// `statvfs(2)` of a path.
fn statvfs(p: &Path) -> libc::statvfs {
    let cp = c(p);
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: a valid path and a writable statvfs.
    let r = unsafe { libc::statvfs(cp.as_ptr(), st.as_mut_ptr()) };
    assert_eq!(
        r,
        0,
        "statvfs {}: {}",
        p.display(),
        std::io::Error::last_os_error()
    );
    // SAFETY: statvfs succeeded.
    unsafe { st.assume_init() }
}

/// An offset `lseek` gives, or its errno.
type Seek = Result<u64, i32>;

/// The offsets `SEEK_DATA` and `SEEK_HOLE` give from each of `offsets`.
fn data_and_holes(f: &fs::File, offsets: &[u64]) -> Vec<(u64, Seek, Seek)> {
    offsets
        .iter()
        .map(|&o| {
            (
                o,
                lseek(f, o, libc::SEEK_DATA),
                lseek(f, o, libc::SEEK_HOLE),
            )
        })
        .collect()
}

/// STATFS, LSEEK and FSYNCDIR, with and without passthrough: `statvfs` of the mount (root,
/// subdirectory, file) is the source's (block sizes, total blocks and inodes, name length
/// exactly; free blocks and inodes within what other writers to the filesystem move meanwhile);
/// `SEEK_DATA` and `SEEK_HOLE` on a sparse file made through the mount (written at 0, 1 MiB and
/// 2 MiB, a hole punched in the middle extent) give the source's offsets, ENXIO past the end
/// included; `SEEK_END` is the file's size; and `fsync`/`fdatasync` of a directory through the
/// mount succeed, as FSYNCDIR requests to the daemon.
#[test]
fn statfs_lseek_and_fsyncdir_answer_as_the_source() {
    if !require_fuse() {
        return;
    }
    use std::os::unix::fs::FileExt;
    for passthrough in [None, Some("off")] {
        let t = Tree::new("dirfs-statfs-seek");
        let what = format!("passthrough {}", passthrough.unwrap_or("default"));
        fs::create_dir(t.src.join("dir")).unwrap();
        fs::write(t.src.join("dir/f"), b"x").unwrap();
        let mut args = vec!["--writable"];
        if let Some(mode) = passthrough {
            args.extend(["--passthrough", mode]);
        }
        let m = t.mount(&args);

        // STATFS: of the root, a directory and a file.
        for p in ["", "dir", "dir/f"] {
            let (s, f) = (statvfs(&t.src.join(p)), statvfs(&t.mnt.join(p)));
            assert_eq!(
                (f.f_bsize, f.f_frsize, f.f_blocks, f.f_files, f.f_namemax),
                (s.f_bsize, s.f_frsize, s.f_blocks, s.f_files, s.f_namemax),
                "{what}: statvfs of /{p}"
            );
            // Others write to the filesystem meanwhile: 1% of it may come and go.
            let near = |a: u64, b: u64, total: u64| a.abs_diff(b) <= total / 100 + 1;
            assert!(
                near(f.f_bfree, s.f_bfree, s.f_blocks) && near(f.f_bavail, s.f_bavail, s.f_blocks),
                "{what}: free blocks of /{p}: {} {} through the mount, {} {} on the source",
                f.f_bfree,
                f.f_bavail,
                s.f_bfree,
                s.f_bavail
            );
            assert!(
                near(f.f_ffree, s.f_ffree, s.f_files),
                "{what}: free inodes of /{p}: {} through the mount, {} on the source",
                f.f_ffree,
                s.f_ffree
            );
        }

        // LSEEK: a sparse file made through the mount.
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(t.mnt.join("sparse"))
            .unwrap();
        let chunk = vec![0xA5u8; 256 << 10];
        for off in [0, MIB, 2 * MIB] {
            file.write_all_at(&chunk, off).unwrap();
        }
        let punched = punch_hole_works_in(&t.src);
        if punched {
            fallocate(
                &file,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                MIB,
                256 << 10,
            )
            .unwrap();
        } else {
            assert!(!in_ci(), "the CI source filesystem punches holes");
        }
        file.sync_all().unwrap();
        let size = 2 * MIB + (256 << 10);
        assert_eq!(
            lseek(&file, 0, libc::SEEK_END),
            Ok(size),
            "{what}: SEEK_END"
        );
        assert_eq!(file.metadata().unwrap().len(), size);
        let source = fs::File::open(t.src.join("sparse")).unwrap();
        let offsets: Vec<u64> = [0, 4096, 256 << 10, MIB - 1, MIB, MIB + 4096]
            .into_iter()
            .chain([MIB + (256 << 10), 3 * MIB / 2, 2 * MIB, 2 * MIB + 1])
            .chain([size - 1, size, size + 1, 4 * MIB])
            .collect();
        let (mnt, src) = (
            data_and_holes(&file, &offsets),
            data_and_holes(&source, &offsets),
        );
        assert_eq!(
            mnt, src,
            "{what}: (offset, SEEK_DATA, SEEK_HOLE) through the mount and on the source"
        );
        assert_eq!(lseek(&file, size, libc::SEEK_DATA), Err(libc::ENXIO));
        if punched {
            // The punched extent is a hole the filesystem reports as one.
            assert_eq!(lseek(&file, MIB, libc::SEEK_DATA), Ok(2 * MIB), "{what}");
        }
        assert_eq!(
            lseek(&file, 0, libc::SEEK_END),
            Ok(size),
            "{what}: SEEK_END after the seeks"
        );
        drop((file, source));

        // FSYNCDIR.
        for p in ["", "dir"] {
            let d = fs::File::open(t.mnt.join(p)).unwrap();
            d.sync_all()
                .unwrap_or_else(|e| panic!("{what}: fsync of /{p}: {e}"));
            d.sync_data()
                .unwrap_or_else(|e| panic!("{what}: fdatasync of /{p}: {e}"));
        }
        let stopped = m.stop();
        stopped.assert_clean(&what);
        assert!(
            stopped.stat(&["ops", "STATFS"]) >= 3,
            "{what}: answered by STATFS"
        );
        assert!(
            stopped.stat(&["ops", "FSYNCDIR"]) >= 4,
            "{what}: answered by FSYNCDIR"
        );
        if passthrough == Some("off") {
            assert!(
                stopped.stat(&["ops", "LSEEK"]) > 0,
                "{what}: answered by LSEEK"
            );
        }
    }
}

/// `renameat2(RENAME_WHITEOUT)` of `old` to `new` in a child running as uid 65534, gid 65533
/// (no supplementary groups); its errno (0: done).
fn rename_whiteout_as_user(old: &Path, new: &Path) -> i32 {
    let (old, new) = (c(old), c(new));
    errno_as_user(|| {
        // SAFETY: both are valid NUL-terminated paths.
        let r = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                old.as_ptr(),
                libc::AT_FDCWD,
                new.as_ptr(),
                libc::RENAME_WHITEOUT,
            )
        };
        if r == 0 {
            0
        } else {
            std::io::Error::last_os_error().raw_os_error().unwrap_or(-1)
        }
    })
}

/// RENAME_WHITEOUT (overlayfs's rename, which leaves a whiteout, a 0:0 character device, at the
/// old name): through the mount, by a normal user, as on the source directly: the file moves,
/// and the whiteout is a 0:0 character device belonging to the user who renamed.
#[test]
fn a_rename_with_whiteout_leaves_the_renamers_whiteout() {
    if !require_fuse() {
        return;
    }
    let t = Tree::new("dirfs-whiteout");
    let s = |p: &str| t.src.join(p);
    fs::create_dir(s("pub")).unwrap();
    fs::set_permissions(s("pub"), fs::Permissions::from_mode(0o777)).unwrap();
    for f in ["native", "mounted"] {
        fs::write(s(&format!("pub/{f}")), f).unwrap();
    }
    let m = t.mount(&["--writable", "--allow-other"]);
    let native = rename_whiteout_as_user(&s("pub/native"), &s("pub/native.moved"));
    if native == libc::EINVAL && !in_ci() {
        eprintln!("skipping: the source filesystem makes no whiteouts");
        return;
    }
    assert_eq!(native, 0, "natively");
    let mnt = t.mnt.join("pub");
    assert_eq!(
        rename_whiteout_as_user(&mnt.join("mounted"), &mnt.join("mounted.moved")),
        0,
        "through the mount"
    );
    let shape = |p: &Path| {
        let m = fs::symlink_metadata(p).unwrap();
        (m.mode() & libc::S_IFMT, m.rdev(), m.uid(), m.gid())
    };
    let want = shape(&s("pub/native"));
    assert_eq!(want, (libc::S_IFCHR, 0, 65534, 65533));
    assert_eq!(shape(&s("pub/mounted")), want, "the source under the mount");
    assert_eq!(shape(&mnt.join("mounted")), want, "through the mount");
    assert_eq!(fs::read(mnt.join("mounted.moved")).unwrap(), b"mounted");
    m.stop().assert_clean("whiteout");
}

/// Unmounts (lazily) what is mounted at the path when dropped.
struct Unmounted(PathBuf);

impl Drop for Unmounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).output();
    }
}

/// A directory export as an overlayfs upper layer (what a container runtime stacks on a
/// writable directory): overlayfs makes whiteouts (0:0 character devices, by MKNOD and by
/// RENAME_WHITEOUT), copies lower files up and renames them, all through the export; the
/// merged view is what the operations say, and the upper directory in the source holds the
/// copies and the whiteouts.
#[test]
fn a_directory_export_serves_as_an_overlayfs_upper_layer() {
    if !require_fuse() {
        return;
    }
    let t = Tree::new("dirfs-overlay");
    let lower = t.work.join("lower");
    let merged = t.work.join("merged");
    fs::create_dir(&lower).unwrap();
    fs::create_dir(&merged).unwrap();
    for (f, data) in [("gone", "g"), ("moved", "m"), ("kept", "k")] {
        fs::write(lower.join(f), data).unwrap();
    }
    let m = t.mount(&["--writable"]);
    fs::create_dir(t.mnt.join("upper")).unwrap();
    fs::create_dir(t.mnt.join("work")).unwrap();
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        t.mnt.join("upper").display(),
        t.mnt.join("work").display()
    );
    let out = run(Command::new("mount")
        .args(["-t", "overlay", "overlay", "-o", &opts])
        .arg(&merged));
    if !out.status.success() {
        let why = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!in_ci(), "overlayfs over the export: {why}");
        eprintln!("skipping: no overlayfs here ({why})");
        return;
    }
    let ovl = Unmounted(merged.clone());
    fs::remove_file(merged.join("gone")).unwrap();
    fs::rename(merged.join("moved"), merged.join("renamed")).unwrap();
    fs::write(merged.join("new"), b"n").unwrap();
    let mut names: Vec<String> = fs::read_dir(&merged)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["kept", "new", "renamed"]);
    assert_eq!(fs::read(merged.join("renamed")).unwrap(), b"m");
    drop(ovl);
    let upper = t.src.join("upper");
    for w in ["gone", "moved"] {
        let st = fs::symlink_metadata(upper.join(w)).unwrap();
        assert_eq!(
            (st.mode() & libc::S_IFMT, st.rdev()),
            (libc::S_IFCHR, 0),
            "{w} is a whiteout in the upper layer"
        );
    }
    assert_eq!(fs::read(upper.join("renamed")).unwrap(), b"m");
    assert_eq!(fs::read(upper.join("new")).unwrap(), b"n");
    m.stop().assert_clean("overlayfs upper layer");
}
