//! Opening the files a qcow2 image names (backing files, an external data file).
//!
//! Those names come from the image, not from the operator, so each open is guarded:
//!
//! - **Never hangs.** The open runs on a short-lived thread with `O_NONBLOCK` (a FIFO then opens
//!   at once instead of waiting for a writer), the result is type-checked (a regular file or a
//!   block device) before anything reads it, and the caller waits at most [`OPEN_TIMEOUT`]: a
//!   file on a hung network mount fails start-up in one line instead of blocking it forever.
//! - **Never lends root's reach to an image's owner.** When root serves an image another user
//!   owns, that user chose the names inside it; the open then runs with the owner's credentials
//!   (uid, primary and supplementary groups, set on that thread alone), so a name such as
//!   `/etc/shadow` is refused exactly when the owner could not have read it.
//! - **Names are shown escaped** ([`shown`]): control characters and over-long names from a
//!   hostile header never reach the operator's terminal raw.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

/// The longest a named file's open may take before start-up fails.
pub const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// The most characters of an untrusted name shown in a message.
const SHOWN_MAX: usize = 256;

/// `s` for a message: control characters escaped, at most `SHOWN_MAX` characters.
pub fn shown(s: &str) -> String {
    escape(s, SHOWN_MAX)
}

/// `s` with control characters escaped, whatever its length (for whole messages that may quote a
/// name).
pub fn escaped(s: &str) -> String {
    escape(s, usize::MAX)
}

fn escape(s: &str, max: usize) -> String {
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i == max {
            out.push_str("...");
            break;
        }
        match c {
            c if c.is_control() => out.extend(c.escape_default()),
            c => out.push(c),
        }
    }
    out
}

/// [`shown`] for a path (bytes that are not UTF-8 become U+FFFD first).
pub fn shown_path(p: &Path) -> String {
    shown(&p.to_string_lossy())
}

/// Whose credentials an open runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenAs {
    /// This process's own.
    Daemon,
    /// The given user's (uid, primary gid), with that user's supplementary groups.
    Owner(u32, u32),
}

impl OpenAs {
    /// `Owner` of the file `meta` describes when this process is root and someone else owns it
    /// (and `trust` is off); `Daemon` otherwise.
    pub fn for_image(meta: &std::fs::Metadata, trust: bool) -> OpenAs {
        use std::os::unix::fs::MetadataExt;
        // SAFETY: geteuid has no preconditions and cannot fail.
        let euid = unsafe { libc::geteuid() };
        if trust || euid != 0 || meta.uid() == 0 {
            OpenAs::Daemon
        } else {
            OpenAs::Owner(meta.uid(), primary_gid(meta.uid()).unwrap_or(meta.gid()))
        }
    }
}

/// Opens `path` for reading (and writing if `writable`): non-blocking open, type check, as `who`,
/// within [`OPEN_TIMEOUT`]. Returns the file and its canonical path (resolved on the same thread,
/// since resolving a name on a hung mount blocks as an open does).
pub fn open(
    path: &Path,
    writable: bool,
    direct: bool,
    who: OpenAs,
) -> io::Result<(File, std::path::PathBuf)> {
    open_within(path, writable, direct, who, OPEN_TIMEOUT)
}

fn open_within(
    path: &Path,
    writable: bool,
    direct: bool,
    who: OpenAs,
    timeout: Duration,
) -> io::Result<(File, std::path::PathBuf)> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a name with a NUL byte"))?;
    let (tx, rx) = mpsc::channel();
    let owned = path.to_path_buf();
    std::thread::Builder::new()
        .name("fusex-open".into())
        .spawn(move || {
            let r = become_(who).and_then(|()| {
                let f = open_checked(&c, writable, direct)?;
                Ok((f, std::fs::canonicalize(&owned)?))
            });
            let _ = tx.send(r);
        })?;
    match rx.recv_timeout(timeout) {
        Ok(r) => r,
        // The thread stays blocked in the kernel; start-up fails and the process exits.
        Err(mpsc::RecvTimeoutError::Timeout) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "opening it took longer than {} s (a file on a hung network mount?)",
                timeout.as_secs()
            ),
        )),
        Err(mpsc::RecvTimeoutError::Disconnected) => Err(io::Error::other("the open thread died")),
    }
}

/// Takes on `who`'s credentials, on this thread only: the raw system calls, not libc's wrappers,
/// which would apply them to every thread of the process.
fn become_(who: OpenAs) -> io::Result<()> {
    let OpenAs::Owner(uid, gid) = who else {
        return Ok(());
    };
    let groups = supplementary_groups(uid, gid);
    let ok = |r: libc::c_long| {
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    };
    // SAFETY: setgroups reads `groups.len()` gids from a live Vec; it changes only this thread's
    // credentials (the raw call, see above), on a thread that exits after one open.
    ok(unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) })?;
    // SAFETY: as above; plain integer arguments.
    ok(unsafe { libc::syscall(libc::SYS_setresgid, gid, gid, gid) })?;
    // SAFETY: as above; plain integer arguments.
    ok(unsafe { libc::syscall(libc::SYS_setresuid, uid, uid, uid) })
}

fn open_checked(path: &CString, writable: bool, direct: bool) -> io::Result<File> {
    let mut flags = libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_NOCTTY;
    flags |= if writable {
        libc::O_RDWR
    } else {
        libc::O_RDONLY
    };
    if direct {
        flags |= libc::O_DIRECT;
    }
    // SAFETY: a NUL-terminated path that outlives the call; the returned fd is owned below.
    let fd = unsafe { libc::open(path.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    let file = unsafe { File::from_raw_fd(fd) };
    let ft = file.metadata()?.file_type();
    if !ft.is_file() && !std::os::unix::fs::FileTypeExt::is_block_device(&ft) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "it is not a regular file or block device",
        ));
    }
    // Blocking again for the reads and writes that follow.
    // SAFETY: F_SETFL with plain flags on an fd this function owns.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

/// A user's primary group from the passwd database.
fn primary_gid(uid: u32) -> Option<u32> {
    let mut buf = vec![0u8; 16 << 10];
    // SAFETY: an all-zero passwd is a valid out-parameter (pointers null, integers 0).
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call and `buf.len()` bytes are writable at `buf`.
    let r =
        unsafe { libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr().cast(), buf.len(), &mut found) };
    (r == 0 && !found.is_null()).then_some(pw.pw_gid)
}

/// A user's supplementary groups (with `gid`), or just `gid` if the user has no passwd entry.
fn supplementary_groups(uid: u32, gid: u32) -> Vec<libc::gid_t> {
    let mut buf = vec![0u8; 16 << 10];
    // SAFETY: as in `primary_gid`.
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: as in `primary_gid`.
    let r =
        unsafe { libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr().cast(), buf.len(), &mut found) };
    if r != 0 || found.is_null() {
        return vec![gid];
    }
    let mut n: libc::c_int = 64;
    loop {
        let mut groups = vec![0 as libc::gid_t; n as usize];
        let want = n;
        // SAFETY: pw_name is the NUL-terminated name getpwuid_r stored in `buf` (alive here);
        // `groups` has room for `n` entries, and getgrouplist writes at most that many.
        let r = unsafe { libc::getgrouplist(pw.pw_name, gid, groups.as_mut_ptr(), &mut n) };
        if r >= 0 {
            groups.truncate(n as usize);
            return groups;
        }
        if n <= want {
            n = want * 2;
        }
        if n > 65536 {
            return vec![gid];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_long_names_cut() {
        assert_eq!(shown("a\x1b[2Jb\0c\nd"), "a\\u{1b}[2Jb\\u{0}c\\nd");
        let long = "x".repeat(1000);
        let s = shown(&long);
        assert_eq!(s.len(), SHOWN_MAX + 3);
        assert!(s.ends_with("..."));
    }

    #[test]
    fn a_fifo_is_refused_at_once_instead_of_blocking() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("fifo");
        let c = CString::new(p.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = open_within(&p, false, false, OpenAs::Daemon, Duration::from_secs(60)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
    }

    #[test]
    fn a_regular_file_opens_blocking() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        std::fs::write(&p, b"abc").unwrap();
        let (f, canon) = open(&p, false, false, OpenAs::Daemon).unwrap();
        assert_eq!(canon, p.canonicalize().unwrap());
        // SAFETY: F_GETFL on an open fd.
        let fl = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFL) };
        assert_eq!(fl & libc::O_NONBLOCK, 0);
    }

    #[test]
    fn an_owner_who_cannot_read_a_file_cannot_open_it_through_the_daemon() {
        // SAFETY: geteuid cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("secret");
        std::fs::write(&p, b"root only").unwrap();
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        // The tempdir itself is 0700 root: make it traversable so only the file's mode decides.
        std::fs::set_permissions(
            d.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let e = open(&p, false, false, OpenAs::Owner(65534, 65534)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
        // The daemon's own credentials are untouched by that thread.
        open(&p, false, false, OpenAs::Daemon).unwrap();
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
        open(&p, false, false, OpenAs::Owner(65534, 65534)).unwrap();
    }
}
