//! The files the daemon writes beside the export (`--pid-file`, `--stats-file`, `--log-file`),
//! often in directories other users can write and often as root: never through a symlink, never
//! into a FIFO or device, and never by truncating a file someone planted. New contents are
//! written to a fresh file (`O_CREAT | O_EXCL | O_NOFOLLOW`) and renamed into place, which
//! replaces whatever sits at the name without following or opening it.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// How long a new daemon waits for the daemon named in its pid file to stop serving before it
/// refuses: covers the moment between `fusex umount` returning and the old daemon noticing.
const PID_FILE_GRACE: Duration = Duration::from_secs(2);

/// A name next to `path` that only this process uses.
pub fn beside(path: &Path, what: &str) -> PathBuf {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    path.with_file_name(format!(".{name}.{what}.{}", std::process::id()))
}

/// What kind of file sits at `path` (not following a symlink), for messages; None if nothing.
fn kind(path: &Path) -> Option<&'static str> {
    let t = std::fs::symlink_metadata(path).ok()?.file_type();
    Some(if t.is_file() {
        "a regular file"
    } else if t.is_symlink() {
        "a symlink"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else {
        "a device"
    })
}

/// Checks, before anything is mounted, that `path` can be written at exit: its directory exists,
/// and nothing but a regular file sits at the name. `what` is the option (`--stats-file`).
pub fn check_target(path: &Path, what: &str) -> Result<()> {
    let dir = crate::privileges::Needs::parent(path);
    if !dir.is_dir() {
        bail!(
            "{what} {}: directory {} does not exist: create it or give another path",
            path.display(),
            dir.display()
        );
    }
    match kind(path) {
        None | Some("a regular file") => Ok(()),
        Some(k) => bail!(
            "{what} {} is {k}: give the path of a regular file (or of none yet)",
            path.display()
        ),
    }
}

/// Creates a file at a fresh name only this process uses, never following a symlink; a file a
/// previous process with the same pid left there is removed first (unlink does not follow).
fn create_fresh(path: &Path, mode: u32) -> io::Result<File> {
    let open = || {
        File::options()
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
    };
    match open() {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            std::fs::remove_file(path)?;
            open()
        }
        r => r,
    }
}

/// Replaces `path` with `bytes` whole (readers see the old file or the new one, never half),
/// without following a symlink at either name or opening whatever sits there.
pub fn replace(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let tmp = beside(path, "new");
    let written = create_fresh(&tmp, mode)
        .and_then(|mut f| f.write_all(bytes))
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Reads a small regular file without following a symlink and without blocking on a FIFO; None
/// for anything else.
pub fn read_regular(path: &Path) -> Option<String> {
    let mut f = File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .ok()?;
    if !f.metadata().ok()?.file_type().is_file() {
        return None;
    }
    let mut s = String::new();
    Read::take(&mut f, 4096).read_to_string(&mut s).ok()?;
    Some(s)
}

/// Whether another process holds `file`'s lock (`flock`), without taking it.
fn locked_elsewhere(file: &File) -> io::Result<bool> {
    // SAFETY: flock on a descriptor this function borrows.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0 {
        // SAFETY: as above; drops the shared lock just taken.
        unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
        return Ok(false);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(true)
    } else {
        Err(e)
    }
}

/// The pid of the daemon serving with the pid file at `path`, if one does: the file is locked
/// (`flock`) by a daemon for as long as its export serves.
fn serving_holder(path: &Path) -> Result<Option<String>> {
    let f = match File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        // A symlink or something else that is not a pid file: replaced by the rename.
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("--pid-file {}", path.display())),
    };
    if !f.metadata()?.file_type().is_file() || !locked_elsewhere(&f)? {
        return Ok(None);
    }
    Ok(Some(
        read_regular(path)
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
    ))
}

/// `--pid-file`, claimed for the daemon: the file holds this process's pid and is locked
/// (`flock`) while the export serves, so a second daemon given the same pid file refuses to start
/// instead of overwriting it.
pub struct PidFile {
    path: PathBuf,
    file: File,
}

impl PidFile {
    /// Claims `path`: refuses (one line) while another daemon serves with it; otherwise writes a
    /// fresh locked file with this pid and renames it into place. A daemon that is stopping has
    /// let go of its lock, and removes its file at exit only while it still holds its own pid.
    pub fn claim(path: &Path) -> Result<PidFile> {
        check_target(path, "--pid-file")?;
        let deadline = Instant::now() + PID_FILE_GRACE;
        loop {
            match serving_holder(path)? {
                None => break,
                Some(pid) if Instant::now() >= deadline => {
                    let who = if pid.is_empty() {
                        "another fusex daemon".to_string()
                    } else {
                        format!("fusex process {pid}")
                    };
                    bail!(
                        "--pid-file {} is held by {who}, which is serving: stop it (fusex umount) \
                         or give another --pid-file",
                        path.display()
                    );
                }
                Some(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        let tmp = beside(path, "new");
        let claimed = (|| -> io::Result<File> {
            let mut file = create_fresh(&tmp, 0o644)?;
            // SAFETY: flock on the descriptor just created; nobody else has the file yet.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                return Err(io::Error::last_os_error());
            }
            file.write_all(format!("{}\n", std::process::id()).as_bytes())?;
            std::fs::rename(&tmp, path)?;
            Ok(file)
        })();
        match claimed {
            Ok(file) => Ok(PidFile {
                path: path.to_path_buf(),
                file,
            }),
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e).with_context(|| format!("cannot write pid file {}", path.display()))
            }
        }
    }

    /// The export no longer serves (it is stopping or handed over): a new daemon may claim the
    /// pid file now, without waiting for this one to finish exiting.
    pub fn stop_serving(&self) {
        // SAFETY: flock on our own descriptor.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }

    /// Removes the pid file at exit, but only while it still holds this process's pid: after
    /// `fusex umount` the next daemon on the same mountpoint may already have put its own there,
    /// possibly between our look and our removal. So ours is first moved aside (atomic) and
    /// checked there; a file that turns out to be the next daemon's goes back unless yet another
    /// one replaced it.
    pub fn remove(self) {
        let path = &self.path;
        let ours = std::process::id().to_string();
        let holds_ours = |p: &Path| read_regular(p).is_some_and(|t| t.trim() == ours);
        if !holds_ours(path) {
            tracing::debug!(
                "pid file {} does not name this process; leaving it",
                path.display()
            );
            return;
        }
        let aside = beside(path, "old");
        if let Err(e) = std::fs::rename(path, &aside) {
            tracing::warn!("cannot remove pid file {}: {e}", path.display());
            return;
        }
        if !holds_ours(&aside) {
            // Moved the next daemon's file: put it back without clobbering a newer one.
            let _ = std::fs::hard_link(&aside, path);
        }
        let _ = std::fs::remove_file(&aside);
    }

    /// Leaves the pid file in place (a successor daemon wrote its own pid there).
    pub fn keep(self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_claim_is_refused_while_the_first_serves() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("fusex.pid");
        let first = PidFile::claim(&p).unwrap();
        assert_eq!(
            read_regular(&p).unwrap().trim(),
            std::process::id().to_string()
        );
        // The lock is per open file: a second claim in this process is refused too.
        let e = PidFile::claim(&p).err().expect("second claim refused");
        let msg = format!("{e:#}");
        assert!(msg.contains("is held by fusex process"), "{msg}");
        first.stop_serving();
        let second = PidFile::claim(&p).expect("claim once the first stopped serving");
        first.keep();
        second.remove();
        assert!(!p.exists());
    }

    #[test]
    fn replace_does_not_follow_a_symlink_or_open_a_fifo() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let link = dir.path().join("stats.json");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        replace(&link, b"{}", 0o644).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert_eq!(std::fs::read(&link).unwrap(), b"{}");
        assert!(!std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());

        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(check_target(&fifo, "--stats-file").is_err());
        assert!(read_regular(&fifo).is_none(), "a FIFO is not read");
        replace(&fifo, b"{}", 0o644).unwrap();
        assert_eq!(std::fs::read(&fifo).unwrap(), b"{}");

        // A symlink planted at the temporary name is removed, not followed.
        let tmp = beside(&dir.path().join("s"), "new");
        std::os::unix::fs::symlink(&victim, &tmp).unwrap();
        replace(&dir.path().join("s"), b"x", 0o644).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    }

    #[test]
    fn check_target_wants_an_existing_directory() {
        let dir = tempfile::tempdir().unwrap();
        let e = check_target(&dir.path().join("missing/stats.json"), "--stats-file")
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not exist"), "{e}");
        assert!(check_target(&dir.path().join("stats.json"), "--stats-file").is_ok());
    }
}
