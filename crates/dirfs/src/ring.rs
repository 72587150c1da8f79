//! The requests served on the queue's ring: every backend call io_uring has an operation for
//! (statx, openat, unlinkat, renameat, linkat; read, write, fsync and fallocate are in
//! `lib.rs`, the creations in `create`). A source directory that is slow to answer (a network
//! filesystem, a fanotify permission listener, a disk under load) then holds up only the
//! requests that wait on it: the queue thread keeps serving the others meanwhile.
//!
//! The calls and their checks are those of [`crate::sys`]: names are single checked
//! components resolved in the parent's descriptor, a final symlink is never followed
//! (`O_NOFOLLOW`, `AT_SYMLINK_NOFOLLOW`), and an inode already held is reached through its
//! `/proc/self/fd` entry, never by a path.
//!
//! On a local filesystem ([`crate::local_filesystem`]: in memory or on a block device) LOOKUP,
//! GETATTR, STATX and UNLINK/RMDIR are plain calls on the queue thread instead
//! ([`crate::DirConfig::metadata_on_ring`]). io_uring always hands `statx` and `unlinkat` to an
//! io-wq worker, and an `openat` whose name is not cached too: two thread switches per request,
//! which made a cold `lstat` of every file of a tree 3 times slower on an ext4 source than the
//! same calls made directly; there these calls wait at most for a metadata block. Opens stay on
//! the ring everywhere (a fanotify permission listener can hold an open indefinitely), and so
//! do every call on a network or FUSE source.
//!
//! The creations (CREATE, TMPFILE, MKDIR, SYMLINK; `mkdirat` and `symlinkat` directly on a local
//! filesystem as UNLINK is) are in `create`.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use engine::{Buf, Engine};
use export::Request;
use fuse_abi::{GetattrIn, InHeader, OpenIn, RENAME_EXCHANGE, RENAME_NOREPLACE, RENAME_WHITEOUT};

use crate::inodes::Inode;
use crate::sys::{self, Errno, Name};
use crate::{name_at, put, DirFs, R};
use fuse_abi::EntryOut;

/// An engine error as the errno for the reply.
pub(crate) fn errno_of(e: std::io::Error) -> Errno {
    e.raw_os_error().unwrap_or(libc::EIO)
}

impl DirFs {
    /// `statx(fd, "", AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW | sync, mask)`: the inode's own
    /// attributes (a symlink's own, for an `O_PATH` descriptor of one). On the ring, where
    /// io_uring always hands it to an io-wq worker; called directly on a local filesystem,
    /// where it waits at most for the device.
    pub(crate) async fn statx_fd(
        &self,
        eng: &Engine,
        fd: BorrowedFd<'_>,
        sync: i32,
        mask: u32,
    ) -> Result<libc::statx, Errno> {
        if self.inline_metadata {
            return sys::statx_fd(fd, sync, mask);
        }
        let flags =
            libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW | (sync & libc::AT_STATX_SYNC_TYPE);
        eng.statx(fd.as_raw_fd(), c"", flags, mask)
            .await
            .map_err(errno_of)
    }

    /// [`sys::stat_fd`], on the ring unless the source is in memory (see [`Self::statx_fd`]).
    pub(crate) async fn stat_fd(
        &self,
        eng: &Engine,
        fd: BorrowedFd<'_>,
    ) -> Result<libc::stat, Errno> {
        if self.inline_metadata {
            return sys::stat_fd(fd);
        }
        let sx = self.statx_fd(eng, fd, 0, libc::STATX_BASIC_STATS).await?;
        Ok(stat_of(&sx))
    }
}

/// The kernel's `new_encode_dev`, as `fstatat` reports device numbers (so node keys made from
/// a `statx` match those made from a `stat`).
fn encode_dev(major: u32, minor: u32) -> u64 {
    u64::from((minor & 0xff) | (major << 8) | ((minor & !0xff) << 12))
}

/// `sx` as the `struct stat` `fstatat` would have filled.
pub(crate) fn stat_of(sx: &libc::statx) -> libc::stat {
    // SAFETY: a zeroed stat is a valid value (plain integers).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    st.st_dev = encode_dev(sx.stx_dev_major, sx.stx_dev_minor);
    st.st_ino = sx.stx_ino;
    st.st_mode = u32::from(sx.stx_mode);
    st.st_nlink = sx.stx_nlink.into();
    st.st_uid = sx.stx_uid;
    st.st_gid = sx.stx_gid;
    st.st_rdev = encode_dev(sx.stx_rdev_major, sx.stx_rdev_minor);
    st.st_size = sx.stx_size as libc::off_t;
    st.st_blksize = sx.stx_blksize as libc::blksize_t;
    st.st_blocks = sx.stx_blocks as libc::blkcnt_t;
    st.st_atime = sx.stx_atime.tv_sec as libc::time_t;
    st.st_atime_nsec = libc::c_long::from(sx.stx_atime.tv_nsec as i32);
    st.st_mtime = sx.stx_mtime.tv_sec as libc::time_t;
    st.st_mtime_nsec = libc::c_long::from(sx.stx_mtime.tv_nsec as i32);
    st.st_ctime = sx.stx_ctime.tv_sec as libc::time_t;
    st.st_ctime_nsec = libc::c_long::from(sx.stx_ctime.tv_nsec as i32);
    st
}

impl DirFs {
    /// The requests with ring operations; every other one goes to [`DirFs::metadata`].
    pub(crate) async fn on_ring(
        &self,
        eng: &Engine,
        hdr: &InHeader,
        req: Request,
        buf: &mut Buf,
        payload: usize,
        cap: usize,
    ) -> R {
        match req {
            Request::Lookup { name } => {
                let dir = self.node(hdr.nodeid)?;
                let name = name_at(buf.as_slice(), name)?;
                let e = self.lookup_ring(eng, &dir, name).await?;
                let is_dir = e.attr.mode & libc::S_IFMT == libc::S_IFDIR;
                self.listing.looked_up(&dir.listed, is_dir);
                if dir.lookups.second(is_dir, e.attr.ino) {
                    if let Ok(fd) = dir.fd() {
                        use crate::ahead::Reach;
                        let reach = if is_dir { Reach::Named } else { Reach::Entries };
                        self.read_ahead(fd.as_fd(), reach);
                    }
                }
                put(buf, payload, &e)
            }
            Request::Getattr(a) => self.getattr(eng, hdr, a, buf, payload).await,
            Request::Statx(a) => self.statx(eng, hdr, a, buf, payload).await,
            Request::Open(a) => self.open_file(eng, hdr, a, buf, payload).await,
            Request::Opendir(_) => self.opendir(eng, hdr, buf, payload).await,
            Request::Unlink { name } | Request::Rmdir { name } => {
                self.writable()?;
                let dir = self.node(hdr.nodeid)?;
                let n = name_at(buf.as_slice(), name)?;
                let flags = if matches!(req, Request::Rmdir { .. }) {
                    libc::AT_REMOVEDIR
                } else {
                    0
                };
                self.unlink_in(eng, &dir, n, flags).await?;
                Ok(export::Reply::Data(0))
            }
            Request::Rename {
                newdir,
                flags,
                old,
                new,
            } => {
                self.writable()?;
                if flags & !(RENAME_NOREPLACE | RENAME_EXCHANGE | RENAME_WHITEOUT) != 0 {
                    return Err(libc::EINVAL);
                }
                let from = self.node(hdr.nodeid)?;
                let to = self.node(newdir)?;
                let b = buf.as_slice();
                let (o, n) = (name_at(b, old)?, name_at(b, new)?);
                eng.renameat(
                    from.fd()?.as_raw_fd(),
                    o.as_c(),
                    to.fd()?.as_raw_fd(),
                    n.as_c(),
                    flags,
                )
                .await
                .map_err(errno_of)?;
                if flags & RENAME_WHITEOUT != 0 {
                    self.give_whiteout_to_caller(eng, hdr, &from, o).await;
                }
                Ok(export::Reply::Data(0))
            }
            Request::Link { arg, name } => {
                self.writable()?;
                let dir = self.node(hdr.nodeid)?;
                let node = self.node(arg.oldnodeid)?;
                if node.is_dir() {
                    return Err(libc::EPERM);
                }
                let n = name_at(buf.as_slice(), name)?;
                // The inode itself, a symlink included, through its `/proc/self/fd` entry
                // (`AT_EMPTY_PATH` would need `CAP_DAC_READ_SEARCH`): `AT_SYMLINK_FOLLOW`
                // follows only that magic link.
                let mut digits = [0u8; 16];
                // (Held until the link is made: a descriptor opened from a handle closes with
                // it.)
                let held = node.fd()?;
                let old = sys::fd_name(&mut digits, held.as_raw_fd());
                eng.linkat(
                    self.proc_fd.as_raw_fd(),
                    old,
                    dir.fd()?.as_raw_fd(),
                    n.as_c(),
                    libc::AT_SYMLINK_FOLLOW,
                )
                .await
                .map_err(errno_of)?;
                let st = self.stat_fd(eng, node.fd()?.as_fd()).await?;
                let generation = self.inodes.add_lookup(arg.oldnodeid).ok_or(libc::ENOENT)?;
                let e = self.entry_out(arg.oldnodeid, generation, &st);
                put(buf, payload, &e)
            }
            Request::Create { arg, name } => self.create(eng, hdr, arg, name, buf, payload).await,
            Request::Tmpfile(arg) => self.tmpfile(eng, hdr, arg, buf, payload).await,
            Request::Mkdir { arg, name } => self.mkdir(eng, hdr, arg, name, buf, payload).await,
            Request::Mknod { arg, name } => self.mknod(eng, hdr, arg, name, buf, payload).await,
            Request::Symlink { name, target } => {
                self.symlink(eng, hdr, name, target, buf, payload).await
            }
            other => self.metadata(hdr, other, buf, payload, cap),
        }
    }

    /// `unlinkat(dir, name, flags)`: on the ring, directly on a local filesystem.
    pub(crate) async fn unlink_in(
        &self,
        eng: &Engine,
        dir: &Inode,
        name: Name<'_>,
        flags: i32,
    ) -> Result<(), Errno> {
        let d = dir.fd()?;
        if self.inline_metadata {
            return sys::unlink_in(d.as_fd(), name, flags);
        }
        eng.unlinkat(d.as_raw_fd(), name.as_c(), flags)
            .await
            .map_err(errno_of)
    }

    /// `name` in `dir` opened `O_PATH`, never following it: on the ring, directly on a local
    /// filesystem. `O_PATH` opens are not open events for fanotify (no `FAN_OPEN_PERM` wait):
    /// the kernel may run them inline.
    pub(crate) async fn open_path_in(
        &self,
        eng: &Engine,
        dir: &Inode,
        name: Name<'_>,
    ) -> Result<std::os::fd::OwnedFd, Errno> {
        let d = dir.fd()?;
        if self.inline_metadata {
            return sys::open_in(d.as_fd(), name, libc::O_PATH, 0);
        }
        eng.openat(
            d.as_raw_fd(),
            name.as_c(),
            libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0,
        )
        .await
        .map_err(errno_of)
    }

    /// LOOKUP of `name` in the directory `dir`: an `O_PATH` open of the name (never following
    /// it), then its attributes, both on the ring (both directly on a local filesystem).
    async fn lookup_ring(
        &self,
        eng: &Engine,
        dir: &Inode,
        name: Name<'_>,
    ) -> Result<EntryOut, Errno> {
        if self.inline_metadata {
            return self.lookup_in(dir.fd()?.as_fd(), name);
        }
        self.room()?;
        let fd = self.open_path_in(eng, dir, name).await?;
        let st = self.stat_fd(eng, fd.as_fd()).await?;
        Ok(self.remember(fd, &st))
    }

    async fn getattr(
        &self,
        eng: &Engine,
        hdr: &InHeader,
        a: GetattrIn,
        buf: &mut Buf,
        payload: usize,
    ) -> R {
        let node = self.node(hdr.nodeid)?;
        let st = match self.named_file(a.getattr_flags, a.fh) {
            Some(fd) => self.stat_fd(eng, crate::borrow(fd)).await?,
            None => self.stat_fd(eng, node.fd()?.as_fd()).await?,
        };
        put(buf, payload, &self.attr_out(&st))
    }

    /// Opens the inode behind `node` again with `flags`, through its `/proc/self/fd` entry
    /// ([`sys::reopen`] on the ring). Submitted straight to an io-wq worker: an open can wait
    /// inside the kernel (a fanotify `FAN_OPEN_PERM` listener answering), and an inline attempt
    /// waiting there would stall the queue thread.
    async fn reopen(
        &self,
        eng: &Engine,
        node: &Inode,
        flags: i32,
    ) -> Result<std::os::fd::OwnedFd, Errno> {
        let mut digits = [0u8; 16];
        // (Held until the open is made: a descriptor opened from a handle closes with it.)
        let held = node.fd()?;
        let name = sys::fd_name(&mut digits, held.as_raw_fd());
        eng.openat_punted(self.proc_fd.as_raw_fd(), name, flags | libc::O_CLOEXEC, 0)
            .await
            .map_err(errno_of)
    }

    async fn open_file(
        &self,
        eng: &Engine,
        hdr: &InHeader,
        a: OpenIn,
        buf: &mut Buf,
        payload: usize,
    ) -> R {
        let node = self.node(hdr.nodeid)?;
        if node.kind != libc::S_IFREG {
            return Err(if node.is_dir() {
                libc::EISDIR
            } else {
                libc::EINVAL
            });
        }
        let flags = self.open_flags(a.flags);
        if flags & libc::O_ACCMODE != libc::O_RDONLY {
            self.writable()?;
        }
        let (fd, direct) = match self.reopen(eng, &node, flags).await {
            Err(e) if Self::narrowed(a.flags, flags, e) => {
                let fd = self
                    .reopen(eng, &node, Self::callers_flags(a.flags))
                    .await?;
                (fd, true)
            }
            r => (r?, false),
        };
        self.open_reply(fd, Some(node.key), direct, buf, payload)
    }

    async fn opendir(&self, eng: &Engine, hdr: &InHeader, buf: &mut Buf, payload: usize) -> R {
        let node = self.node(hdr.nodeid)?;
        if !node.is_dir() {
            return Err(libc::ENOTDIR);
        }
        if let Some(fd) = self.parked.take(node.key) {
            // As the reader's own open would be: atime kept, blocking.
            if sys::set_status_flags(fd.as_fd(), 0).is_ok() {
                return self.open_reply(fd, None, false, buf, payload);
            }
        }
        let fd = self
            .reopen(eng, &node, libc::O_RDONLY | libc::O_DIRECTORY)
            .await?;
        self.open_reply(fd, None, false, buf, payload)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `statx` converted matches what `fstatat` says of the same inode, device numbers
    /// included (the node table's key).
    #[test]
    fn stat_of_statx_matches_fstatat() {
        for p in [c"/", c"/dev/null", c"/proc/self"] {
            // SAFETY: a valid NUL-terminated path; the result is checked.
            let raw = unsafe { libc::open(p.as_ptr(), libc::O_PATH | libc::O_NOFOLLOW) };
            assert!(raw >= 0);
            // SAFETY: just opened; owned here.
            let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
            let st = sys::stat_fd(fd.as_fd()).unwrap();
            let sx = sys::statx_fd(fd.as_fd(), 0, libc::STATX_BASIC_STATS).unwrap();
            let got = stat_of(&sx);
            assert_eq!((got.st_dev, got.st_ino), (st.st_dev, st.st_ino), "{p:?}");
            assert_eq!(
                (got.st_mode, got.st_rdev),
                (st.st_mode, st.st_rdev),
                "{p:?}"
            );
            assert_eq!(
                (got.st_nlink, got.st_uid, got.st_gid),
                (st.st_nlink, st.st_uid, st.st_gid)
            );
            assert_eq!((got.st_size, got.st_blocks), (st.st_size, st.st_blocks));
            assert_eq!(
                (got.st_mtime, got.st_mtime_nsec),
                (st.st_mtime, st.st_mtime_nsec)
            );
        }
    }
}
