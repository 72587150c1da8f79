//! FUSE passthrough (Linux 6.9+): registering the image as the backing file of opened files.
//!
//! With `FUSE_PASSTHROUGH` negotiated, `FUSE_DEV_IOC_BACKING_OPEN` hands the kernel an open file and
//! returns a backing id; an OPEN reply carrying `FOPEN_PASSTHROUGH` and that id makes the kernel
//! serve read, write, splice and mmap of the opened FUSE file from the backing file directly. For
//! each such open the kernel opens the backing file's path again with the *application's* open flags
//! (`O_DIRECT` included) and fusex's credentials, so the flags of the fd registered here (fusex's own
//! `--direct`) do not reach passthrough I/O.
//!
//! The ioctls need `CAP_SYS_ADMIN` in the initial user namespace (`EPERM` otherwise, e.g. in a user
//! namespace that could mount FUSE), and the kernel refuses them (`EPERM`) on a connection whose
//! INIT did not negotiate passthrough.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

use fuse_abi::{BackingMap, FUSE_DEV_IOC_BACKING_CLOSE, FUSE_DEV_IOC_BACKING_OPEN};

use crate::mount::clone_fd;
use crate::TransportError;

const OVERLAYFS_SUPER_MAGIC: i64 = 0x794c_7630;
const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;
const ECRYPTFS_SUPER_MAGIC: i64 = 0xf15f;

/// `fuse_init_out.max_stack_depth` for a backing file on the filesystem of `file`.
///
/// The kernel accepts a backing file only if its filesystem's stacking depth is below the value
/// INIT announced, and gives the FUSE mount itself that depth. A file on a plain filesystem (ext4,
/// xfs, tmpfs: depth 0) needs 1, which keeps the export usable under one more stacking layer; a file
/// on a stacking filesystem (overlayfs in a container, another FUSE mount) needs 2, the maximum.
pub fn stack_depth_for(file: RawFd) -> u32 {
    // SAFETY: fstatfs writes into a zeroed struct of the right type; a bad fd only makes it fail.
    let f_type = unsafe {
        let mut s: libc::statfs = std::mem::zeroed();
        if libc::fstatfs(file, &mut s) != 0 {
            return 1;
        }
        s.f_type as i64
    };
    match f_type {
        OVERLAYFS_SUPER_MAGIC | FUSE_SUPER_MAGIC | ECRYPTFS_SUPER_MAGIC => 2,
        _ => 1,
    }
}

/// Registers the open file `file` as a backing file of the connection `conn` (a `/dev/fuse` fd
/// of it) with `FUSE_DEV_IOC_BACKING_OPEN`: its backing id, for `fuse_open_out.backing_id`.
///
/// The error is the kernel's errno: `EPERM` without `CAP_SYS_ADMIN` (or without passthrough
/// negotiated), `ELOOP` for a file on a filesystem stacked deeper than INIT allowed, `EINVAL` for
/// anything but a regular file. [`Backing`] owns an id and closes it on drop; a server that
/// shares ids between opens (a directory export) counts them itself and calls [`unregister`].
pub fn register(conn: BorrowedFd<'_>, file: RawFd) -> io::Result<i32> {
    let map = BackingMap {
        fd: file,
        flags: 0,
        padding: 0,
    };
    // SAFETY: FUSE_DEV_IOC_BACKING_OPEN reads one `fuse_backing_map` (BackingMap is its repr(C)
    // mirror, layout asserted in fuse-abi) from the pointer, which is live for the call.
    let id = unsafe { libc::ioctl(conn.as_raw_fd(), FUSE_DEV_IOC_BACKING_OPEN as _, &map) };
    match id {
        i if i < 0 => Err(io::Error::last_os_error()),
        // Ids start at 1; 0 would mean "no backing file" in an OPEN reply.
        0 => Err(io::Error::from_raw_os_error(libc::EPROTO)),
        i => Ok(i),
    }
}

/// Closes the backing id `id` of the connection `conn` (`FUSE_DEV_IOC_BACKING_CLOSE`); files
/// opened with it keep their own reference to the backing file.
pub fn unregister(conn: BorrowedFd<'_>, id: i32) -> io::Result<()> {
    let id = id as u32;
    // SAFETY: FUSE_DEV_IOC_BACKING_CLOSE reads one u32 (the id) from the pointer, which is live
    // for the call.
    let r = unsafe { libc::ioctl(conn.as_raw_fd(), FUSE_DEV_IOC_BACKING_CLOSE as _, &id) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The file an open descriptor refers to: its device and inode numbers.
pub fn file_of(file: RawFd) -> io::Result<(u64, u64)> {
    // SAFETY: fstat writes into a zeroed struct of the right type; a bad fd only makes it fail.
    let st = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(file, &mut st) != 0 {
            return Err(io::Error::last_os_error());
        }
        st
    };
    Ok((st.st_dev, st.st_ino))
}

/// A registered backing file: its id, the file behind it, and a `/dev/fuse` fd of the connection
/// to close it on.
///
/// Dropping it closes the id (`FUSE_DEV_IOC_BACKING_CLOSE`); files already opened with it keep their
/// own reference to the backing file, so this is safe at any time. The connection frees leftover
/// ids when it ends anyway; closing is tidiness that makes the image's last reference fusex's own.
#[derive(Debug)]
pub struct Backing {
    /// A clone of the connection's fd, held only for the ioctls (it never reads requests).
    conn: OwnedFd,
    id: i32,
    /// The registered file's device and inode.
    file: (u64, u64),
}

impl Backing {
    /// Registers `file` as a backing file of the connection `conn_fd` belongs to (errors as for
    /// [`register`]).
    pub fn open(conn_fd: RawFd, file: RawFd) -> Result<Backing, TransportError> {
        let identity = file_of(file).map_err(TransportError::Io)?;
        let conn = clone_fd(conn_fd)?;
        let id = register(conn.as_fd(), file).map_err(TransportError::Io)?;
        Ok(Backing {
            conn,
            id,
            file: identity,
        })
    }

    /// Takes over the id `id`, which another process registered for the file `file` (device,
    /// inode) on the connection `conn_fd` belongs to: a restart successor shares its
    /// predecessor's connection, and must answer opens with the id files still open use. The
    /// kernel gives an inode one backing file at a time: an open with a second registration of
    /// the same image fails with EIO while files opened with the first are open.
    pub fn adopt(conn_fd: RawFd, id: i32, file: (u64, u64)) -> Result<Backing, TransportError> {
        if id <= 0 {
            return Err(TransportError::Io(io::Error::from_raw_os_error(
                libc::EINVAL,
            )));
        }
        Ok(Backing {
            conn: clone_fd(conn_fd)?,
            id,
            file,
        })
    }

    /// The backing id to put into `fuse_open_out.backing_id`.
    pub fn id(&self) -> i32 {
        self.id
    }

    /// The registered file's device and inode.
    pub fn file(&self) -> (u64, u64) {
        self.file
    }

    /// Lets go of the id without closing it: a restart successor answers opens with it now.
    pub fn leave(mut self) -> i32 {
        std::mem::replace(&mut self.id, 0)
    }

    /// Closes the id now, reporting what the kernel said (Drop does it silently).
    pub fn close(mut self) -> io::Result<()> {
        self.close_id()
    }

    fn close_id(&mut self) -> io::Result<()> {
        if self.id <= 0 {
            return Ok(());
        }
        let id = std::mem::replace(&mut self.id, 0);
        unregister(self.conn.as_fd(), id)
    }
}

impl Drop for Backing {
    fn drop(&mut self) {
        let id = self.id;
        if let Err(e) = self.close_id() {
            // ENOTCONN/ENOENT once the connection is gone: nothing is left to release.
            tracing::debug!("closing passthrough backing id {id}: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stack_depth_of_plain_and_stacked_filesystems() {
        let f = tempfile::tempfile().unwrap();
        // The test's temp dir is on a plain filesystem in CI; if it is on overlayfs the answer is 2.
        let d = stack_depth_for(f.as_raw_fd());
        assert!(d == 1 || d == 2);
        assert_eq!(stack_depth_for(-1), 1);
    }

    #[test]
    fn open_on_a_non_fuse_fd_fails_cleanly() {
        let f = tempfile::tempfile().unwrap();
        // Not a /dev/fuse fd: the clone ioctl fails (or /dev/fuse is missing); no panic, no leak.
        assert!(Backing::open(f.as_raw_fd(), f.as_raw_fd()).is_err());
    }
}
