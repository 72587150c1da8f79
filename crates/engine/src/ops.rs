//! The typed catalog of ring operations fusex uses. Every SQE is built here and nowhere else.
//!
//! Each operation that lends memory to the kernel takes it by value (a [`Buf`] or a [`Slice`]) and
//! gives it back with the result, so safe code cannot touch memory the kernel may still write,
//! whatever happens to the future: dropping it early orphans the operation, and the engine keeps
//! the memory until the kernel's completion (see [`crate::op`]). Operations that lend nothing
//! (fsync, fallocate, cancel) take no buffer; the path operations (statx, openat, unlinkat,
//! renameat, linkat) copy their paths into memory the op owns, taken from the engine's free
//! lists ([`crate::scratch`]) and given back at the completion.

use std::ffi::CStr;
use std::io;
use std::ops::Range;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use io_uring::{opcode, squeue, types};

use crate::buf::{Buf, Slice};
use crate::executor::Engine;
use crate::multishot::{BufGroup, MultiOp};
use crate::op::{Op, OpState, Owned};
use crate::scratch::CPath;
use crate::Sqe;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A file an operation targets: a descriptor, or an index into the ring's registered files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fd {
    /// A plain file descriptor (the caller keeps it open while operations on it run).
    Raw(RawFd),
    /// Index `n` in the ring's registered file table.
    Fixed(u32),
}

impl From<RawFd> for Fd {
    fn from(fd: RawFd) -> Fd {
        Fd::Raw(fd)
    }
}

/// Offset meaning "the file's current position" (for pipes, character devices like `/dev/fuse`).
pub const AT_CURSOR: u64 = u64::MAX;

/// Builds an entry for `fd`, whichever kind it is (the opcode builders are generic over it).
macro_rules! with_fd {
    ($fd:expr, |$f:ident| $build:expr) => {
        match $fd {
            Fd::Raw(raw) => {
                let $f = types::Fd(raw);
                $build
            }
            Fd::Fixed(i) => {
                let $f = types::Fixed(i);
                $build
            }
        }
    };
}

pub(crate) use with_fd;

/// A completion's `res` as bytes transferred or an error.
pub(crate) fn bytes(res: i32) -> io::Result<usize> {
    if res < 0 {
        Err(io::Error::from_raw_os_error(-res))
    } else {
        Ok(res as usize)
    }
}

/// A length as an SQE's 32-bit `len` (saturating).
pub(crate) fn len32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// Byte offset of `len` in an `io_uring_sqe` (the io-uring crate's `UringCmd80` has no setter).
const SQE_LEN_OFFSET: usize = 24;

fn sqe_with_len(sqe: Sqe, len: u32) -> Sqe {
    const _: () = assert!(std::mem::size_of::<Sqe>() == 128);
    // SAFETY: `Entry128` is `#[repr(C)]`, exactly 128 bytes of plain integers (an `io_uring_sqe`
    // followed by 64 command bytes), with no padding, pointers or drop glue; any bit pattern is a
    // valid value, so a round trip through a byte array is sound.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute::<Sqe, [u8; 128]>(sqe) };
    raw[SQE_LEN_OFFSET..SQE_LEN_OFFSET + 4].copy_from_slice(&len.to_ne_bytes());
    // SAFETY: as above, in the other direction.
    unsafe { std::mem::transmute::<[u8; 128], Sqe>(raw) }
}

impl Engine {
    /// Reads into `win` from `fd` at `off` (`READ_FIXED` when the buffer has a slot in this
    /// ring's fixed-buffer table, see [`Engine::add_pool`]). Returns the bytes read (short at end
    /// of file) and the window.
    pub fn read(&self, fd: Fd, win: Slice, off: u64) -> SliceOp<'_> {
        let (ptr, len) = (win.ptr(), len32(win.len()));
        let sqe: Sqe = if let Some(index) = self.fixed(win.buf()) {
            with_fd!(self.target(fd), |f| opcode::ReadFixed::new(
                f, ptr, len, index
            )
            .offset(off)
            .build()
            .into())
        } else {
            with_fd!(self.target(fd), |f| opcode::Read::new(f, ptr, len)
                .offset(off)
                .build()
                .into())
        };
        // SAFETY: the entry points into `win`, which the op owns until its completion.
        SliceOp(unsafe { self.start(sqe, Owned::Slice(win)) })
    }

    /// Writes `win` to `fd` at `off` (`WRITE_FIXED` when the buffer has a slot in this ring's
    /// fixed-buffer table). Returns the bytes written (possibly short) and the window.
    pub fn write(&self, fd: Fd, win: Slice, off: u64) -> SliceOp<'_> {
        let fixed = self.fixed(win.buf());
        self.write_as(fd, win, off, fixed)
    }

    /// Like [`Engine::write`], but always a plain `WRITE` from the buffer's address: for files
    /// that take only user memory, not registered buffers (`/dev/fuse` refuses those with
    /// `EINVAL`).
    pub fn write_plain(&self, fd: Fd, win: Slice, off: u64) -> SliceOp<'_> {
        self.write_as(fd, win, off, None)
    }

    /// A write from `win`, `WRITE_FIXED` with table slot `fixed` if given.
    fn write_as(&self, fd: Fd, win: Slice, off: u64, fixed: Option<u16>) -> SliceOp<'_> {
        let (ptr, len) = (win.ptr().cast_const(), len32(win.len()));
        let sqe: Sqe = if let Some(index) = fixed {
            with_fd!(self.target(fd), |f| opcode::WriteFixed::new(
                f, ptr, len, index
            )
            .offset(off)
            .build()
            .into())
        } else {
            with_fd!(self.target(fd), |f| opcode::Write::new(f, ptr, len)
                .offset(off)
                .build()
                .into())
        };
        // SAFETY: the entry points into `win`, which the op owns until its completion.
        SliceOp(unsafe { self.start(sqe, Owned::Slice(win)) })
    }

    /// Waits until `fd` is readable, then reads into `win` at the file position: a `POLL_ADD`
    /// linked to a `READ`, for non-blocking files where a plain read could fail with `EAGAIN`.
    pub fn poll_read(&self, fd: Fd, win: Slice) -> SliceOp<'_> {
        let (ptr, len) = (win.ptr(), len32(win.len()));
        let poll: Sqe = with_fd!(self.target(fd), |f| opcode::PollAdd::new(
            f,
            libc::POLLIN as u32
        )
        .build()
        .into());
        // The read names `fd` as the caller did, not by a slot of the file table: the kernel
        // looks a linked entry's file up only when it issues it (after the poll), by which time
        // the slot may have gone to another tenant's file.
        let read: Sqe = with_fd!(fd, |f| opcode::Read::new(f, ptr, len)
            .offset(AT_CURSOR)
            .build()
            .into());
        // SAFETY: the poll lends nothing; the read points into `win`, which the op owns.
        SliceOp(unsafe { self.start_linked(poll, read, Owned::Slice(win)) })
    }

    /// `fsync(2)` (or `fdatasync(2)` with `datasync`).
    pub async fn fsync(&self, fd: Fd, datasync: bool) -> io::Result<()> {
        let flags = if datasync {
            types::FsyncFlags::DATASYNC
        } else {
            types::FsyncFlags::empty()
        };
        let sqe: Sqe = with_fd!(self.target(fd), |f| opcode::Fsync::new(f)
            .flags(flags)
            .build()
            .into());
        // SAFETY: an fsync references no memory.
        let (res, _) = unsafe { self.start(sqe, Owned::None) }.await;
        bytes(res).map(drop)
    }

    /// `fallocate(2)` with `mode` over `[off, off+len)`.
    pub async fn fallocate(&self, fd: Fd, mode: i32, off: u64, len: u64) -> io::Result<()> {
        let sqe: Sqe = with_fd!(self.target(fd), |f| opcode::Fallocate::new(f, len)
            .offset(off)
            .mode(mode)
            .build()
            .into());
        // SAFETY: a fallocate references no memory.
        let (res, _) = unsafe { self.start(sqe, Owned::None) }.await;
        bytes(res).map(drop)
    }

    /// `statx(2)` of `path` in `dirfd` (`AT_FDCWD` or a directory; with `AT_EMPTY_PATH` and an
    /// empty path, the descriptor's own inode) with `flags` and the fields of `mask`. The path
    /// is copied: the op owns it, and the buffer the kernel fills, until the completion (both
    /// reused from the engine's free lists).
    pub async fn statx(
        &self,
        dirfd: RawFd,
        path: &CStr,
        flags: i32,
        mask: u32,
    ) -> io::Result<libc::statx> {
        let path = self.scratch.path(path);
        let mut sx = self.scratch.statx_buf();
        let sqe: Sqe = opcode::Statx::new(
            types::Fd(dirfd),
            path.as_ptr(),
            sx.as_mut_ptr().cast::<types::statx>(),
        )
        .flags(flags)
        .mask(mask)
        .build()
        .into();
        // SAFETY: the path and the statx buffer are heap memory the op owns (moving the
        // `CPath` and the `Box` into the table does not move what they point to) until the
        // completion; nothing else reaches the buffer meanwhile.
        let (res, owned) = unsafe { self.start(sqe, Owned::Statx { path, buf: sx }) }.await;
        let Owned::Statx { buf, .. } = &owned else {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        };
        // SAFETY: the buffer was zeroed before the kernel (maybe) filled it, so every field is
        // initialized either way; it is read only if statx succeeded.
        let sx = unsafe { buf.assume_init_read() };
        self.scratch.give_back(owned);
        bytes(res).map(|_| sx)
    }

    /// `openat(2)` of `path` in `dirfd` with `flags` and `mode` (the caller adds `O_CLOEXEC`,
    /// `O_NOFOLLOW` as it needs). The kernel may first try it on the submitting thread, without
    /// blocking where it can tell; see [`Engine::openat_punted`] for opens that can block where
    /// it cannot. If the future is dropped before the completion, the descriptor the kernel
    /// opens is closed then.
    pub async fn openat(
        &self,
        dirfd: RawFd,
        path: &CStr,
        flags: i32,
        mode: u32,
    ) -> io::Result<OwnedFd> {
        self.openat_as(dirfd, path, flags, mode, false).await
    }

    /// [`Engine::openat`] submitted with `IOSQE_ASYNC`: straight to an io-wq worker, never tried
    /// on the submitting thread. For opens that can wait inside the open itself where a
    /// non-blocking attempt does not see it coming (a fanotify `FAN_OPEN_PERM` listener holds
    /// the open until it answers: inline, that stalls the whole ring's thread).
    pub async fn openat_punted(
        &self,
        dirfd: RawFd,
        path: &CStr,
        flags: i32,
        mode: u32,
    ) -> io::Result<OwnedFd> {
        self.openat_as(dirfd, path, flags, mode, true).await
    }

    async fn openat_as(
        &self,
        dirfd: RawFd,
        path: &CStr,
        flags: i32,
        mode: u32,
        punt: bool,
    ) -> io::Result<OwnedFd> {
        let path = self.scratch.path(path);
        let sqe = opcode::OpenAt::new(types::Fd(dirfd), path.as_ptr())
            .flags(flags)
            .mode(mode)
            .build();
        let sqe: Sqe = if punt {
            sqe.flags(squeue::Flags::ASYNC).into()
        } else {
            sqe.into()
        };
        // SAFETY: the path is heap memory the op owns until the completion (and a descriptor
        // an orphaned open returns is closed by the table, see `Owned::Open`).
        let (res, owned) = unsafe { self.start(sqe, Owned::Open { path }) }.await;
        self.scratch.give_back(owned);
        let fd = bytes(res)? as RawFd;
        // SAFETY: the kernel just opened this descriptor for us; nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Runs `sqe`, a path operation (unlinkat, renameat, linkat, mkdirat, symlinkat) whose paths
    /// are `path` and `second`, which the op owns until its completion (a `CPath`'s bytes stay
    /// where they are when it moves); 0 or the error.
    ///
    /// # Safety
    ///
    /// `sqe` points at no memory but the bytes of `path` and `second`.
    async unsafe fn paths_op(
        &self,
        sqe: Sqe,
        path: CPath,
        second: Option<CPath>,
    ) -> io::Result<()> {
        // SAFETY: (the caller's) the paths are heap memory the op owns until the completion.
        let (res, owned) = unsafe { self.start(sqe, Owned::Paths { path, second }) }.await;
        self.scratch.give_back(owned);
        bytes(res).map(drop)
    }

    /// `unlinkat(2)` of `path` in `dirfd` (`flags`: 0 or `AT_REMOVEDIR`).
    pub async fn unlinkat(&self, dirfd: RawFd, path: &CStr, flags: i32) -> io::Result<()> {
        let path = self.scratch.path(path);
        let sqe: Sqe = opcode::UnlinkAt::new(types::Fd(dirfd), path.as_ptr())
            .flags(flags)
            .build()
            .into();
        // SAFETY: the entry points only at `path`'s bytes.
        unsafe { self.paths_op(sqe, path, None) }.await
    }

    /// `renameat2(2)` of `old` in `olddirfd` to `new` in `newdirfd` with `flags`
    /// (`RENAME_NOREPLACE`, `RENAME_EXCHANGE`, ...).
    pub async fn renameat(
        &self,
        olddirfd: RawFd,
        old: &CStr,
        newdirfd: RawFd,
        new: &CStr,
        flags: u32,
    ) -> io::Result<()> {
        let (old, new) = (self.scratch.path(old), self.scratch.path(new));
        let sqe: Sqe = opcode::RenameAt::new(
            types::Fd(olddirfd),
            old.as_ptr(),
            types::Fd(newdirfd),
            new.as_ptr(),
        )
        .flags(flags)
        .build()
        .into();
        // SAFETY: the entry points only at `old`'s and `new`'s bytes.
        unsafe { self.paths_op(sqe, old, Some(new)) }.await
    }

    /// `linkat(2)`: `old` in `olddirfd` linked as `new` in `newdirfd` (`flags`:
    /// `AT_SYMLINK_FOLLOW`, `AT_EMPTY_PATH`).
    pub async fn linkat(
        &self,
        olddirfd: RawFd,
        old: &CStr,
        newdirfd: RawFd,
        new: &CStr,
        flags: i32,
    ) -> io::Result<()> {
        let (old, new) = (self.scratch.path(old), self.scratch.path(new));
        let sqe: Sqe = opcode::LinkAt::new(
            types::Fd(olddirfd),
            old.as_ptr(),
            types::Fd(newdirfd),
            new.as_ptr(),
        )
        .flags(flags)
        .build()
        .into();
        // SAFETY: the entry points only at `old`'s and `new`'s bytes.
        unsafe { self.paths_op(sqe, old, Some(new)) }.await
    }

    /// `mkdirat(2)` of `path` in `dirfd` with `mode`. io_uring always runs it in an io-wq
    /// worker, which applies the umask of this thread's filesystem context (see [`crate::umask`]).
    pub async fn mkdirat(&self, dirfd: RawFd, path: &CStr, mode: u32) -> io::Result<()> {
        let path = self.scratch.path(path);
        let sqe: Sqe = opcode::MkDirAt::new(types::Fd(dirfd), path.as_ptr())
            .mode(mode)
            .build()
            .into();
        // SAFETY: the entry points only at `path`'s bytes.
        unsafe { self.paths_op(sqe, path, None) }.await
    }

    /// `symlinkat(2)`: a symlink `path` in `dirfd` whose content is `target` (stored, never
    /// resolved).
    pub async fn symlinkat(&self, target: &CStr, dirfd: RawFd, path: &CStr) -> io::Result<()> {
        let (target, path) = (self.scratch.path(target), self.scratch.path(path));
        let sqe: Sqe = opcode::SymlinkAt::new(types::Fd(dirfd), target.as_ptr(), path.as_ptr())
            .build()
            .into();
        // SAFETY: the entry points only at `target`'s and `path`'s bytes.
        unsafe { self.paths_op(sqe, target, Some(path)) }.await
    }

    /// Waits `d` on the ring (an `IORING_OP_TIMEOUT`): the thread keeps serving other tasks.
    pub async fn sleep(&self, d: Duration) {
        let ts = Box::new(
            types::Timespec::new()
                .sec(d.as_secs())
                .nsec(d.subsec_nanos()),
        );
        let sqe: Sqe = opcode::Timeout::new(&*ts as *const types::Timespec)
            .build()
            .into();
        // SAFETY: the timespec is boxed (it does not move) and owned by the op until completion.
        let _ = unsafe { self.start(sqe, Owned::Time { _ts: ts }) }.await;
    }

    /// Whether the kernel has `IORING_OP_READ_MULTISHOT` (Linux 6.7); a read also needs a pool
    /// with a provided-buffer ring ([`Engine::add_pool`]).
    pub fn can_read_multishot(&self) -> bool {
        self.supports_opcode(opcode::ReadMulti::CODE)
    }

    /// Arms a multishot read of `fd` into buffers of `group` (see [`Engine::provide`]); each
    /// completion hands back the window it filled, resolved in `group`. Room for `capacity`
    /// queued completions is reserved up front. `None` if the submission queue cannot take it.
    pub fn read_multishot(&self, fd: Fd, group: BufGroup, capacity: usize) -> Option<MultiOp<'_>> {
        let sqe: Sqe = with_fd!(self.target(fd), |f| opcode::ReadMulti::new(f, 0, group.0)
            .build()
            .into());
        // SAFETY: the read writes only into provided windows, which the engine holds until a
        // completion names them, or until the group is unregistered after this op's final
        // completion.
        unsafe { self.start_multishot(sqe, capacity, group.0) }
    }

    /// An 80-byte `URING_CMD` with command `cmd_op` on `fd` that lends the kernel all of `buf`
    /// until its completion (a FUSE ring entry: the kernel writes the next request into it).
    ///
    /// With `iov = Some((at, segments))`, the engine writes one `iovec` per segment (each a range
    /// of `buf`) at `buf[at..]`, and passes their address and count as the command's `addr` and
    /// `len`. Returns the completion's `res` and the buffer.
    pub fn uring_cmd(
        &self,
        fd: Fd,
        cmd_op: u32,
        cmd: [u8; 80],
        mut buf: Buf,
        iov: Option<(usize, &[Range<usize>])>,
    ) -> BufOp<'_> {
        let mut addr = None;
        let mut count = 0u32;
        if let Some((at, segments)) = iov {
            match write_iovecs(&mut buf, at, segments) {
                Some(a) => addr = Some(a),
                None => {
                    return BufOp(Op {
                        engine: self,
                        state: OpState::Failed(-libc::EINVAL, Owned::Buf(buf)),
                    })
                }
            }
            count = segments.len() as u32;
        }
        let sqe: Sqe = with_fd!(self.target(fd), |f| opcode::UringCmd80::new(f, cmd_op)
            .addr(addr)
            .cmd(cmd)
            .build());
        let sqe = if count > 0 {
            sqe_with_len(sqe, count)
        } else {
            sqe
        };
        // SAFETY: `addr` and every iovec point into `buf`, which the op owns until completion.
        BufOp(unsafe { self.start(sqe, Owned::Buf(buf)) })
    }

    /// Cancels every operation in flight on `fd` (best effort; they complete with `ECANCELED`).
    pub fn cancel_all_on(&self, fd: Fd) {
        let matching = with_fd!(self.target(fd), |f| types::CancelBuilder::fd(f).all());
        let sqe: Sqe = opcode::AsyncCancel2::new(matching).build().into();
        self.start_detached(sqe);
    }
}

/// Writes one `iovec` per segment (each a range of `buf`) at `buf[at..]`; returns their address,
/// or `None` if a segment or the iovecs themselves do not lie inside `buf`.
fn write_iovecs(buf: &mut Buf, at: usize, segments: &[Range<usize>]) -> Option<u64> {
    let size = std::mem::size_of::<libc::iovec>();
    let inside = |r: &Range<usize>| r.start <= r.end && r.end <= buf.len();
    let end = at.checked_add(segments.len().checked_mul(size)?)?;
    if !segments.iter().all(inside) || end > buf.len() {
        return None;
    }
    let base = buf.ptr();
    for (i, r) in segments.iter().enumerate() {
        let o = at + i * size;
        let p = (base.wrapping_add(r.start) as usize).to_ne_bytes();
        buf.as_mut_slice()[o..o + 8].copy_from_slice(&p);
        buf.as_mut_slice()[o + 8..o + 16].copy_from_slice(&r.len().to_ne_bytes());
    }
    Some(base.wrapping_add(at) as u64)
}

/// Future of a read or write: the bytes transferred (or the error) and the window back.
#[must_use = "an operation's result and its window come back only when awaited"]
pub struct SliceOp<'e>(Op<'e>);

impl Future for SliceOp<'_> {
    type Output = (io::Result<usize>, Slice);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match Pin::new(&mut self.0).poll(cx) {
            Poll::Ready((res, Owned::Slice(win))) => Poll::Ready((bytes(res), win)),
            Poll::Ready(_) => panic!("SliceOp polled after it completed"),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Future of [`Engine::uring_cmd`]: the command's result and the buffer back.
#[must_use = "an operation's result and its buffer come back only when awaited"]
pub struct BufOp<'e>(Op<'e>);

impl Future for BufOp<'_> {
    type Output = (io::Result<i32>, Buf);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match Pin::new(&mut self.0).poll(cx) {
            Poll::Ready((res, Owned::Buf(buf))) if res < 0 => {
                Poll::Ready((Err(io::Error::from_raw_os_error(-res)), buf))
            }
            Poll::Ready((res, Owned::Buf(buf))) => Poll::Ready((Ok(res), buf)),
            Poll::Ready(_) => panic!("BufOp polled after it completed"),
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqe_len_lands_at_offset_24() {
        let sqe: Sqe = opcode::UringCmd80::new(types::Fd(3), 7).build();
        let sqe = sqe_with_len(sqe, 0x0102_0304);
        // SAFETY: plain 128-byte POD, as in sqe_with_len.
        let raw: [u8; 128] = unsafe { std::mem::transmute::<Sqe, [u8; 128]>(sqe) };
        assert_eq!(&raw[24..28], &0x0102_0304u32.to_ne_bytes());
    }
}
