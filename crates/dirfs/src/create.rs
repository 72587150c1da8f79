//! The creations: CREATE, TMPFILE, MKDIR, SYMLINK and MKNOD, and giving what they made to its
//! creator.
//!
//! Each entry is made with the caller's umask held as the queue thread's
//! ([`engine::umask::hold`]): the source applies the parent's default ACL if it has one and that
//! umask otherwise, as for a local `open`/`mkdir`, whether the call runs on the queue thread or
//! in one of its ring's io-wq workers, which share the thread's umask. The creating call is a
//! ring operation where io_uring has one: the opens of CREATE and TMPFILE everywhere (submitted
//! with `IOSQE_ASYNC`: a fanotify permission listener can hold an open, as for OPEN), `mkdirat`
//! and `symlinkat` except on a local filesystem, where they are made directly as UNLINK is
//! (`DirFs::inline_metadata`: io_uring hands them to an io-wq worker every time). MKNOD has no
//! ring operation. What follows (the new entry opened `O_PATH` and its attributes read, on the
//! ring likewise) ends with [`DirFs::give_to_caller`]: `fchownat` and `chmod`, which have no ring
//! operation, are plain calls.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use engine::{umask, Buf, Engine};
use fuse_abi::{CreateIn, EntryOut, InHeader, MkdirIn, MknodIn, FUSE_OPEN_KILL_SUIDGID};

use export::Span;

use crate::inodes::Inode;
use crate::ring::errno_of;
use crate::sys::{self, Errno, Name};
use crate::{acl, name_at, put, put2, DirFs, R};

impl DirFs {
    /// CREATE: a regular file made and opened. Always made exclusively, so that only a file
    /// made here is given to the caller; a file that appeared meanwhile is opened as it is
    /// unless the caller asked for `O_EXCL`.
    pub(crate) async fn create(
        &self,
        eng: &Engine,
        hdr: &InHeader,
        a: CreateIn,
        name: Span,
        buf: &mut Buf,
        payload: usize,
    ) -> R {
        self.writable()?;
        self.room()?;
        let dir = self.node(hdr.nodeid)?;
        let n = name_at(buf.as_slice(), name)?;
        if a.mode & libc::S_IFMT != libc::S_IFREG && a.mode & libc::S_IFMT != 0 {
            return Err(libc::EINVAL);
        }
        let asked = self.open_flags(a.flags);
        // As `sys::open_in` opens: a final symlink is never followed.
        let own = libc::O_NOFOLLOW | libc::O_CLOEXEC;
        let exclusive = a.flags as i32 & libc::O_EXCL != 0;
        // (Held until the file is open: a descriptor opened from a handle closes with it.)
        let parent = dir.fd()?;
        let p = parent.as_raw_fd();
        let made = {
            let _umask = umask::hold(eng, a.umask).await.map_err(errno_of)?;
            eng.openat_punted(
                p,
                n.as_c(),
                asked | own | libc::O_CREAT | libc::O_EXCL,
                a.mode & 0o777,
            )
            .await
        };
        let (fd, made, direct) = match made.map_err(errno_of) {
            Ok(fd) => (fd, true, false),
            Err(libc::EEXIST) if !exclusive => {
                let again = eng.openat_punted(p, n.as_c(), asked | own, 0).await;
                match again.map_err(errno_of) {
                    Err(e) if Self::narrowed(a.flags, asked, e) => {
                        let callers = Self::callers_flags(a.flags) | own;
                        let fd = eng
                            .openat_punted(p, n.as_c(), callers, 0)
                            .await
                            .map_err(errno_of)?;
                        (fd, false, true)
                    }
                    r => (r?, false, false),
                }
            }
            Err(e) => return Err(e),
        };
        drop(parent);
        let held = sys::reopen(self.proc_fd.as_fd(), fd.as_raw_fd(), libc::O_PATH)?;
        let st = if made {
            match self
                .give_to_caller(eng, hdr, &dir, &held, libc::S_IFREG, Some(a.mode))
                .await
            {
                Ok(st) => st,
                Err(e) => {
                    self.undo(eng, &dir, n, libc::S_IFREG).await;
                    return Err(e);
                }
            }
        } else {
            let st = self.stat_fd(eng, held.as_fd()).await?;
            if st.st_mode & libc::S_IFMT != libc::S_IFREG {
                return Err(libc::EISDIR);
            }
            // The kernel takes what CREATE opened for a new file and truncates nothing itself:
            // a name that appeared meanwhile is truncated here when the caller asked, with
            // its set-id bits cleared where the caller has no CAP_FSETID.
            if a.flags as i32 & libc::O_TRUNC == 0 {
                st
            } else {
                if st.st_size != 0 {
                    // Through `/proc/self/fd`: the open may be read-only (`O_RDONLY | O_TRUNC`
                    // truncates too).
                    sys::truncate_fd(held.as_raw_fd(), 0)?;
                }
                if a.open_flags & FUSE_OPEN_KILL_SUIDGID != 0 {
                    sys::kill_suidgid(self.proc_fd.as_fd(), fd.as_fd())?;
                }
                self.stat_fd(eng, held.as_fd()).await?
            }
        };
        self.reply_opened(held, &st, fd, direct, buf, payload)
    }

    /// TMPFILE: an unnamed regular file in the directory (`O_TMPFILE`), the caller's, opened;
    /// LINK can give it a name later (unless opened with `O_EXCL`).
    pub(crate) async fn tmpfile(
        &self,
        eng: &Engine,
        hdr: &InHeader,
        a: CreateIn,
        buf: &mut Buf,
        payload: usize,
    ) -> R {
        self.writable()?;
        self.room()?;
        let dir = self.node(hdr.nodeid)?;
        if !dir.is_dir() {
            return Err(libc::ENOTDIR);
        }
        let flags = self.open_flags(a.flags) & !libc::O_TMPFILE;
        // O_TMPFILE takes O_WRONLY or O_RDWR; `.` is the directory itself.
        let flags = match flags & libc::O_ACCMODE {
            libc::O_RDONLY => flags | libc::O_RDWR,
            _ => flags,
        };
        let fd = {
            let parent = dir.fd()?;
            let _umask = umask::hold(eng, a.umask).await.map_err(errno_of)?;
            eng.openat_punted(
                parent.as_raw_fd(),
                c".",
                flags | libc::O_TMPFILE | libc::O_CLOEXEC,
                a.mode & 0o777,
            )
            .await
            .map_err(errno_of)?
        };
        let held = sys::reopen(self.proc_fd.as_fd(), fd.as_raw_fd(), libc::O_PATH)?;
        let st = self
            .give_to_caller(eng, hdr, &dir, &held, libc::S_IFREG, Some(a.mode))
            .await?;
        self.reply_opened(held, &st, fd, false, buf, payload)
    }

    /// The reply of CREATE and TMPFILE: the new node (`held`, attributes `st`) remembered and
    /// the file `fd` opened; the node forgotten again if the open cannot be answered.
    fn reply_opened(
        &self,
        held: OwnedFd,
        st: &libc::stat,
        fd: OwnedFd,
        direct: bool,
        buf: &mut Buf,
        payload: usize,
    ) -> R {
        let entry = self.remember(held, st);
        let out = match self.open_out(fd, Some((st.st_dev, st.st_ino)), direct) {
            Ok(out) => out,
            Err(e) => {
                self.inodes.forget(entry.nodeid, 1);
                return Err(e);
            }
        };
        put2(buf, payload, &entry, &out)
    }

    /// MKDIR.
    pub(crate) async fn mkdir(
        &self,
        eng: &Engine,
        hdr: &InHeader,
        a: MkdirIn,
        name: Span,
        buf: &mut Buf,
        payload: usize,
    ) -> R {
        self.writable()?;
        self.room()?;
        let dir = self.node(hdr.nodeid)?;
        let n = name_at(buf.as_slice(), name)?;
        {
            let parent = dir.fd()?;
            let _umask = umask::hold(eng, a.umask).await.map_err(errno_of)?;
            if self.inline_metadata {
                sys::mkdir_in(parent.as_fd(), n, a.mode & 0o777)?;
            } else {
                eng.mkdirat(parent.as_raw_fd(), n.as_c(), a.mode & 0o777)
                    .await
                    .map_err(errno_of)?;
            }
        }
        let e = self
            .finish_new(eng, hdr, &dir, n, libc::S_IFDIR, Some(a.mode & 0o1777))
            .await?;
        put(buf, payload, &e)
    }

    /// MKNOD: fifos, sockets and plain files, and whiteouts (a 0:0 character device, which
    /// reaches no device: overlayfs's mark of a deleted lower entry, which the kernel lets
    /// anyone make); device nodes are not made through this export. A plain call: io_uring has
    /// no `mknodat`.
    pub(crate) async fn mknod(
        &self,
        eng: &Engine,
        hdr: &InHeader,
        a: MknodIn,
        name: Span,
        buf: &mut Buf,
        payload: usize,
    ) -> R {
        self.writable()?;
        self.room()?;
        let dir = self.node(hdr.nodeid)?;
        let n = name_at(buf.as_slice(), name)?;
        let kind = a.mode & libc::S_IFMT;
        let whiteout = kind == libc::S_IFCHR && a.rdev == 0;
        if !matches!(kind, libc::S_IFIFO | libc::S_IFSOCK | libc::S_IFREG) && !whiteout {
            return Err(libc::EPERM);
        }
        {
            let parent = dir.fd()?;
            let _umask = umask::hold(eng, a.umask).await.map_err(errno_of)?;
            sys::mknod_in(parent.as_fd(), n, kind | (a.mode & 0o777), 0)?;
        }
        let e = self
            .finish_new(eng, hdr, &dir, n, kind, Some(a.mode & 0o7777))
            .await?;
        put(buf, payload, &e)
    }

    /// SYMLINK: the target is stored, never resolved. No umask applies (a symlink's mode is
    /// always 0777).
    pub(crate) async fn symlink(
        &self,
        eng: &Engine,
        hdr: &InHeader,
        name: Span,
        target: Span,
        buf: &mut Buf,
        payload: usize,
    ) -> R {
        self.writable()?;
        self.room()?;
        let dir = self.node(hdr.nodeid)?;
        let b = buf.as_slice();
        let n = name_at(b, name)?;
        let t = target.c_str(b).ok_or(libc::EINVAL)?;
        if t.is_empty() {
            return Err(libc::ENOENT);
        }
        {
            let parent = dir.fd()?;
            if self.inline_metadata {
                sys::symlink_in(t, parent.as_fd(), n)?;
            } else {
                eng.symlinkat(t, parent.as_raw_fd(), n.as_c())
                    .await
                    .map_err(errno_of)?;
            }
        }
        let e = self
            .finish_new(eng, hdr, &dir, n, libc::S_IFLNK, None)
            .await?;
        put(buf, payload, &e)
    }

    /// Gives a new entry its creator: the caller's uid, and gid unless the parent is setgid
    /// (then the parent's, which the source filesystem gave it already); then the mode asked for
    /// (chown may clear set-id bits). Checks the entry is of the type just made, so a name
    /// swapped meanwhile by someone with access to the source is not given away.
    pub(crate) async fn give_to_caller(
        &self,
        eng: &Engine,
        hdr: &InHeader,
        parent: &Inode,
        fd: &OwnedFd,
        kind: u32,
        mode: Option<u32>,
    ) -> Result<libc::stat, Errno> {
        let st = self.stat_fd(eng, fd.as_fd()).await?;
        if st.st_mode & libc::S_IFMT != kind {
            return Err(libc::EIO);
        }
        // The parent's setgid bit matters only when the group is not the caller's already.
        let gid = if st.st_gid == hdr.gid {
            hdr.gid
        } else {
            let pst = self.stat_fd(eng, parent.fd()?.as_fd()).await?;
            if pst.st_mode & libc::S_ISGID != 0 {
                u32::MAX
            } else {
                hdr.gid
            }
        };
        let mut st = st;
        if st.st_uid != hdr.uid || (gid != u32::MAX && st.st_gid != gid) {
            sys::chown_fd(fd.as_fd(), hdr.uid, gid)?;
            st = self.stat_fd(eng, fd.as_fd()).await?;
        }
        if let Some(mode) = mode {
            // Permission bits as the source made them (umask or default ACL), set-id bits asked.
            let mut want = acl::created_mode(st.st_mode, mode);
            if kind == libc::S_IFDIR {
                // The source filesystem sets a setgid parent's bit on new directories.
                want |= st.st_mode & libc::S_ISGID;
            }
            if st.st_mode & 0o7777 != want {
                sys::chmod_fd(self.proc_fd.as_fd(), fd.as_raw_fd(), want)?;
                st = self.stat_fd(eng, fd.as_fd()).await?;
            }
        }
        Ok(st)
    }

    /// A RENAME with `RENAME_WHITEOUT` left a whiteout (a 0:0 character device: overlayfs's
    /// mark of a deleted lower entry, which the kernel lets anyone make) at `name` in `dir`,
    /// made by the daemon: it is given to the caller, whose rename made it, as a local
    /// filesystem gives it. Only a 0:0 character device is given away, so a name swapped
    /// meanwhile by someone with access to the source gives nothing of value; a failure leaves
    /// the daemon's (the rename is done, and is answered as done).
    pub(crate) async fn give_whiteout_to_caller(
        &self,
        eng: &Engine,
        hdr: &InHeader,
        dir: &Inode,
        name: Name<'_>,
    ) {
        let given = async {
            let fd = sys::open_in(dir.fd()?.as_fd(), name, libc::O_PATH, 0)?;
            let st = self.stat_fd(eng, fd.as_fd()).await?;
            if st.st_mode & libc::S_IFMT != libc::S_IFCHR || st.st_rdev != 0 {
                return Err(libc::EIO);
            }
            self.give_to_caller(eng, hdr, dir, &fd, libc::S_IFCHR, None)
                .await
                .map(drop)
        }
        .await;
        if let Err(e) = given {
            tracing::warn!(
                "the whiteout a rename left is the daemon's, not the caller's: {}",
                std::io::Error::from_raw_os_error(e)
            );
        }
    }

    /// The common end of MKDIR, MKNOD, SYMLINK: open what was made (`O_PATH`, as LOOKUP does),
    /// give it to the caller, remember it; undo the creation if any of that fails.
    async fn finish_new(
        &self,
        eng: &Engine,
        hdr: &InHeader,
        parent: &Inode,
        name: Name<'_>,
        kind: u32,
        mode: Option<u32>,
    ) -> Result<EntryOut, Errno> {
        let r = async {
            let fd = self.open_path_in(eng, parent, name).await?;
            let st = self
                .give_to_caller(eng, hdr, parent, &fd, kind, mode)
                .await?;
            Ok((fd, st))
        }
        .await;
        match r {
            Ok((fd, st)) => Ok(self.remember(fd, &st)),
            Err(e) => {
                self.undo(eng, parent, name, kind).await;
                Err(e)
            }
        }
    }

    /// Removes an entry just made that could not be given to its caller (best effort: the
    /// caller gets the error either way).
    async fn undo(&self, eng: &Engine, parent: &Inode, name: Name<'_>, kind: u32) {
        let flags = if kind == libc::S_IFDIR {
            libc::AT_REMOVEDIR
        } else {
            0
        };
        let _ = self.unlink_in(eng, parent, name, flags).await;
    }
}
