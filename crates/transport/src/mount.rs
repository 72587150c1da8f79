//! Mounting a single-file FUSE filesystem over a regular file, and taking it down again.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::mountinfo::fuse_mount_at;
use crate::TransportError;

/// What to mount.
#[derive(Clone, Debug)]
pub struct MountConfig {
    /// Where: a regular file (created if missing).
    pub mountpoint: PathBuf,
    /// Shown as the mount's source (e.g. the image path).
    pub source: String,
    /// Mount read-only (the VFS then refuses writes before they reach fusex).
    pub read_only: bool,
    /// Let other users access the export.
    pub allow_other: bool,
    /// Largest read the kernel sends (`max_read=`).
    pub max_read: u32,
}

/// A live mount. Dropping it unmounts (lazily, so open files cannot keep it in the namespace) and
/// removes the mountpoint file if fusex created it: no path out of the daemon leaves a mount behind.
pub struct Mount {
    fd: Option<OwnedFd>,
    mountpoint: PathBuf,
    created: bool,
    mounted: bool,
}

/// Opens `/dev/fuse` with errors a user can act on.
pub fn open_dev_fuse() -> Result<OwnedFd, TransportError> {
    match File::options().read(true).write(true).open("/dev/fuse") {
        Ok(f) => Ok(f.into()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(TransportError::NoDevFuse),
        Err(e) => Err(TransportError::DevFuse(e)),
    }
}

/// Opens a new `/dev/fuse` fd attached to the same connection as `fd` (`FUSE_DEV_IOC_CLONE`): a
/// separate queue reads requests from it and must reply on it.
pub fn clone_fd(fd: RawFd) -> Result<OwnedFd, TransportError> {
    let new = open_dev_fuse()?;
    let src = fd as u32;
    // SAFETY: FUSE_DEV_IOC_CLONE reads one u32 (the source fd) from the pointer.
    let r = unsafe { libc::ioctl(new.as_raw_fd(), fuse_abi::FUSE_DEV_IOC_CLONE as _, &src) };
    if r < 0 {
        return Err(TransportError::Io(io::Error::last_os_error()));
    }
    Ok(new)
}

/// Canonical form of a path whose last component may not exist yet.
fn canonical(path: &Path) -> Result<PathBuf, TransportError> {
    let shown = path.display().to_string();
    let name = path
        .file_name()
        .ok_or_else(|| TransportError::MountpointNotFile(shown.clone()))?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let parent = parent
        .canonicalize()
        .map_err(|_| TransportError::MountpointParent(shown.clone()))?;
    if !parent.is_dir() {
        return Err(TransportError::MountpointParent(shown));
    }
    Ok(parent.join(name))
}

impl Mount {
    /// Checks the mountpoint, creates it if missing and mounts `fd` there.
    pub fn new(cfg: &MountConfig, fd: OwnedFd) -> Result<Mount, TransportError> {
        let shown = cfg.mountpoint.display().to_string();
        let mountpoint = canonical(&cfg.mountpoint)?;
        if fuse_mount_at(&mountpoint).is_some() {
            // A stat asks the daemon: a dead connection answers ENOTCONN at once (ECONNABORTED
            // when the stat was queued just before the connection ended; a wedged daemon's stat
            // returns when the kernel's request timeout aborts the connection).
            return Err(match std::fs::metadata(&mountpoint) {
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTCONN | libc::ECONNABORTED)) => {
                    TransportError::DeadMount(shown)
                }
                _ => TransportError::AlreadyMounted(shown),
            });
        }
        let created = match std::fs::symlink_metadata(&mountpoint) {
            Ok(m) if m.is_dir() => return Err(TransportError::MountpointIsDir(shown)),
            Ok(m) if !m.is_file() => return Err(TransportError::MountpointNotFile(shown)),
            Ok(_) => false,
            Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
                return Err(TransportError::AlreadyMounted(shown));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                File::options()
                    .write(true)
                    .create_new(true)
                    .open(&mountpoint)
                    .map_err(|source| TransportError::CreateMountpoint {
                        path: shown.clone(),
                        source,
                    })?;
                true
            }
            Err(source) => {
                return Err(TransportError::CreateMountpoint {
                    path: shown,
                    source,
                })
            }
        };
        let mut m = Mount {
            fd: Some(fd),
            mountpoint,
            created,
            mounted: false,
        };
        m.mount(cfg)?;
        Ok(m)
    }

    fn mount(&mut self, cfg: &MountConfig) -> Result<(), TransportError> {
        let shown = cfg.mountpoint.display().to_string();
        let fd = self.fd.as_ref().map(|f| f.as_raw_fd()).unwrap_or(-1);
        // SAFETY: getuid/getgid cannot fail.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        let mut data = format!(
            "fd={fd},rootmode={:o},user_id={uid},group_id={gid},default_permissions,max_read={}",
            libc::S_IFREG | 0o644,
            cfg.max_read
        );
        if cfg.allow_other {
            data.push_str(",allow_other");
        }
        let mut flags = libc::MS_NOSUID | libc::MS_NODEV;
        if cfg.read_only {
            flags |= libc::MS_RDONLY;
        }
        let c = |s: &[u8]| {
            CString::new(s).map_err(|_| TransportError::MountpointNotFile(shown.clone()))
        };
        let source = c(cfg.source.as_bytes())?;
        let target = c(self.mountpoint.as_os_str().as_bytes())?;
        let fstype = c(b"fuse.fusex")?;
        let data = c(data.as_bytes())?;
        // SAFETY: all pointers are valid NUL-terminated strings that live across the call.
        let r = unsafe {
            libc::mount(
                source.as_ptr(),
                target.as_ptr(),
                fstype.as_ptr(),
                flags,
                data.as_ptr().cast(),
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::EPERM | libc::EACCES) => TransportError::NotPermitted(shown),
                _ => TransportError::Mount {
                    path: shown,
                    source: e,
                },
            });
        }
        self.mounted = true;
        Ok(())
    }

    /// The mount's `/dev/fuse` fd (queue 0 reads from it; other queues clone it), until taken.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|f| f.as_fd())
    }

    /// Takes the fd out (a queue owns it from now on); the mount stays.
    pub fn take_fd(&mut self) -> Option<OwnedFd> {
        self.fd.take()
    }

    /// The canonical mountpoint.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Unmounts now (lazily: the namespace forgets the mount at once even if files are open; the
    /// connection dies when fusex closes its fds). Idempotent; a mount already gone is fine.
    pub fn unmount(&mut self) -> Result<(), TransportError> {
        if !self.mounted {
            return Ok(());
        }
        self.mounted = false;
        if fuse_mount_at(&self.mountpoint).is_none() {
            return Ok(());
        }
        unmount_path(&self.mountpoint, libc::MNT_DETACH)
    }
}

impl Mount {
    /// Aborts the connection (a forced unmount: every request the kernel still holds fails, every
    /// io_uring entry completes) and then unmounts, lazily if files are still open. The way to end
    /// io_uring queues, whose pending commands keep `/dev/fuse` open.
    pub fn abort(&mut self) -> Result<(), TransportError> {
        if !self.mounted {
            return Ok(());
        }
        if fuse_mount_at(&self.mountpoint).is_none() {
            self.mounted = false;
            return Ok(());
        }
        match unmount_path(&self.mountpoint, libc::MNT_FORCE) {
            Ok(()) => {
                self.mounted = false;
                Ok(())
            }
            Err(_) => self.unmount(),
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Err(e) = self.unmount() {
            tracing::error!("{e}");
        }
        if self.created {
            if let Err(e) = std::fs::remove_file(&self.mountpoint) {
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::warn!(
                        "cannot remove mountpoint {}: {e}",
                        self.mountpoint.display()
                    );
                }
            }
        }
    }
}

fn unmount_path(path: &Path, flags: i32) -> Result<(), TransportError> {
    let shown = path.display().to_string();
    let target = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| TransportError::NotMounted(shown.clone()))?;
    // SAFETY: target is a valid NUL-terminated path.
    if unsafe { libc::umount2(target.as_ptr(), flags | libc::UMOUNT_NOFOLLOW) } < 0 {
        return Err(TransportError::Unmount {
            path: shown,
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// `fusex umount`: unmounts the FUSE mount at `path` (refusing anything that is not FUSE). A busy
/// mount is detached lazily, so the daemon sees the device go away and exits.
pub fn unmount(path: &Path) -> Result<(), TransportError> {
    let shown = path.display().to_string();
    let canon = canonical(path)?;
    if fuse_mount_at(&canon).is_none() {
        return Err(TransportError::NotMounted(shown));
    }
    match unmount_path(&canon, 0) {
        Err(TransportError::Unmount { source, .. })
            if source.raw_os_error() == Some(libc::EBUSY) =>
        {
            tracing::info!("{shown} is busy; detaching it lazily");
            unmount_path(&canon, libc::MNT_DETACH)
        }
        r => r,
    }
}
