//! Mounting without privileges: through `fusermount3`, the set-uid helper of the `fuse3` package.
//!
//! A process without `CAP_SYS_ADMIN` cannot mount(2) a FUSE filesystem, and on many systems cannot
//! open `/dev/fuse` either. `fusermount3` can: it checks that the user may write the mountpoint (a
//! regular file is accepted as well as a directory), opens `/dev/fuse` as the user, mounts with
//! `user_id`/`group_id` of the caller and a `rootmode` taken from the mountpoint's file type, and
//! hands the `/dev/fuse` fd back over the unix socket named by the `_FUSE_COMMFD` environment
//! variable (one byte of data with the fd as `SCM_RIGHTS`). It accepts only a fixed set of `-o`
//! options: `fsname=`, `subtype=`, `allow_other`/`allow_root` (only with `user_allow_other` in
//! `/etc/fuse.conf` for non-root callers), `default_permissions`, `max_read=`, `blksize=`,
//! `auto_unmount`, and the generic flags (`ro`, `rw`, `noexec`, ...; `nosuid,nodev` are forced).
//! Unmounting goes through `fusermount3 -u [-z]`, which unmounts only FUSE mounts whose
//! `user_id` is the caller's.
//!
//! fusex does not use fusermount3's `auto_unmount`: the fusermount3 of Debian 12 (3.14) decides
//! whether the mount is dead by opening it with its own root credentials, which FUSE refuses
//! (`EACCES`) on a mount without `allow_other`, so it never unmounts. fusex's own
//! `--auto-unmount` watcher unmounts through `fusermount3 -u -z` instead.

use std::fs::File;
use std::io::{self, Read, Seek};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::process::{Command, Stdio};

use crate::TransportError;

/// The helper's name, looked up in `PATH`.
pub const FUSERMOUNT: &str = "fusermount3";

/// What `fusermount3` is asked to mount.
pub(crate) struct Request<'a> {
    /// Shown as the mount's source (`fsname=`).
    pub source: &'a str,
    /// `subtype=`: the mount's type becomes `fuse.SUBTYPE`.
    pub subtype: &'a str,
    /// `ro` (else `rw`): the VFS refuses writes before they reach fusex.
    pub read_only: bool,
    /// `allow_other`: fusermount3 permits it to normal users only with `user_allow_other`.
    pub allow_other: bool,
    /// `max_read=`: the largest read the kernel sends.
    pub max_read: u32,
}

/// `fsname=` value with `,` and `\` escaped by a backslash, as fusermount3's option parser
/// expects, so a source with commas cannot add options.
fn escape(value: &str) -> String {
    let mut s = String::with_capacity(value.len());
    for c in value.chars() {
        if c == ',' || c == '\\' {
            s.push('\\');
        }
        s.push(c);
    }
    s
}

/// The `-o` argument for `req`.
pub(crate) fn options(req: &Request<'_>) -> String {
    let mut o = format!(
        "{},default_permissions,max_read={},fsname={},subtype={}",
        if req.read_only { "ro" } else { "rw" },
        req.max_read,
        escape(req.source),
        escape(req.subtype)
    );
    if req.allow_other {
        o.push_str(",allow_other");
    }
    o
}

/// A pair of connected unix stream sockets: (ours, close-on-exec; theirs, inherited by the
/// helper). Another thread forking meanwhile would inherit `theirs` too, which only delays the
/// EOF seen after a failed mount; fusex mounts before it starts any thread.
fn socketpair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: socketpair writes two fds into the array.
    if unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    } < 0
    {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds are fresh and owned here.
    let (ours, theirs) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: F_SETFD on a live fd: clears close-on-exec so the helper inherits it.
    if unsafe { libc::fcntl(theirs.as_raw_fd(), libc::F_SETFD, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((ours, theirs))
}

/// An anonymous file for the helper's stderr: read back after a failure, and never a pipe the
/// helper could block on or die writing to.
fn memfd() -> io::Result<File> {
    // SAFETY: memfd_create with a NUL-terminated name returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(c"fusermount3-stderr".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is fresh and owned here.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Receives one fd passed with `SCM_RIGHTS` (close-on-exec); None on EOF without one.
fn receive_fd(sock: &OwnedFd) -> io::Result<Option<OwnedFd>> {
    let (n, fds) = crate::fdpass::recv_with_fds(sock.as_raw_fd(), &mut [0u8; 1], 1)?;
    if n == 0 {
        return Ok(None);
    }
    Ok(fds.into_iter().next())
}

/// The helper's complaint: its last non-empty stderr line without the `fusermount3: ` prefix.
fn complaint(text: &str) -> String {
    let line = text
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty())
        .unwrap_or("it exited without saying why");
    line.strip_prefix(&format!("{FUSERMOUNT}: "))
        .unwrap_or(line)
        .to_string()
}

/// Mounts `mountpoint` (canonical, existing) through `fusermount3`; returns the connection's fd.
pub(crate) fn mount(mountpoint: &Path, req: &Request<'_>) -> Result<OwnedFd, TransportError> {
    let shown = mountpoint.display().to_string();
    let (ours, theirs) = socketpair()?;
    let mut stderr = memfd()?;
    let mut cmd = Command::new(FUSERMOUNT);
    cmd.arg("-o")
        .arg(options(req))
        .arg("--")
        .arg(mountpoint)
        .env("_FUSE_COMMFD", theirs.as_raw_fd().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(stderr.try_clone()?));
    tracing::debug!("mounting through {FUSERMOUNT}: {cmd:?}");
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(TransportError::NoFusermount(shown))
        }
        Err(error) => {
            return Err(TransportError::Fusermount {
                path: shown,
                what: format!("cannot run {FUSERMOUNT}: {error}"),
            })
        }
    };
    drop(cmd);
    drop(theirs);
    let received = receive_fd(&ours);
    let fd = match received {
        Ok(Some(fd)) => fd,
        failed => {
            let status = child.wait();
            let mut text = String::new();
            let _ = stderr.rewind();
            let _ = stderr.read_to_string(&mut text);
            let what = match failed {
                Err(e) => format!("receiving the /dev/fuse fd failed: {e}"),
                _ => complaint(&text),
            };
            tracing::debug!(?status, "{FUSERMOUNT} said: {text}");
            if what.contains("user_allow_other") {
                return Err(TransportError::AllowOtherRefused(shown));
            }
            if what.contains("/dev/fuse") && what.contains("Permission denied") {
                return Err(TransportError::Fusermount {
                    path: shown,
                    what: format!(
                        "{what}: /dev/fuse must be readable and writable by everyone (mode 0666, \
                         as udev sets it up on most distributions)"
                    ),
                });
            }
            return Err(TransportError::Fusermount { path: shown, what });
        }
    };
    // It exits right after handing the fd over.
    let _ = child.wait();
    Ok(fd)
}

/// `fusermount3 -u [-z] PATH`: unmounts a FUSE mount this user made through fusermount3.
pub(crate) fn unmount(path: &Path, lazy: bool) -> Result<(), TransportError> {
    let shown = path.display().to_string();
    let mut cmd = Command::new(FUSERMOUNT);
    cmd.arg("-u");
    if lazy {
        cmd.arg("-z");
    }
    cmd.arg("--").arg(path).stdin(Stdio::null());
    let out = cmd.output().map_err(|error| TransportError::Unmount {
        path: shown.clone(),
        error,
    })?;
    if out.status.success() {
        return Ok(());
    }
    let what = complaint(&String::from_utf8_lossy(&out.stderr));
    tracing::debug!("{FUSERMOUNT} -u {shown}: {what}");
    // A busy mount stays recognisable, so callers can retry lazily.
    if what.contains("busy") {
        return Err(TransportError::Unmount {
            path: shown,
            error: io::Error::from_raw_os_error(libc::EBUSY),
        });
    }
    Err(TransportError::FusermountUnmount { path: shown, what })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_escape_the_source_and_name_every_setting() {
        let req = Request {
            source: "/img/a,b\\c",
            subtype: "fusex",
            read_only: true,
            allow_other: true,
            max_read: 131072,
        };
        assert_eq!(
            options(&req),
            "ro,default_permissions,max_read=131072,fsname=/img/a\\,b\\\\c,subtype=fusex,\
             allow_other"
        );
        let req = Request {
            read_only: false,
            allow_other: false,
            source: "x",
            ..req
        };
        assert_eq!(
            options(&req),
            "rw,default_permissions,max_read=131072,fsname=x,subtype=fusex"
        );
    }

    #[test]
    fn complaint_is_the_last_line_without_the_program_name() {
        assert_eq!(
            complaint("fusermount3: option allow_other only allowed if 'user_allow_other' is set in /etc/fuse.conf\n"),
            "option allow_other only allowed if 'user_allow_other' is set in /etc/fuse.conf"
        );
        assert_eq!(complaint("\n\n"), "it exited without saying why");
    }

    #[test]
    fn a_passed_fd_arrives_and_eof_without_one_is_none() {
        let (a, b) = socketpair().unwrap();
        let file = File::open("/dev/null").unwrap();
        let fd = file.as_raw_fd();
        assert_eq!(
            crate::fdpass::send_with_fds(b.as_raw_fd(), &[0], &[fd]).unwrap(),
            1
        );
        let got = receive_fd(&a).unwrap().expect("an fd");
        assert_ne!(got.as_raw_fd(), fd);
        drop(b);
        assert!(receive_fd(&a).unwrap().is_none());
    }
}
