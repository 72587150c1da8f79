//! Thin wrappers over the `*at()` system calls the directory export uses. Every path handed to
//! the kernel here is either empty (the call acts on the descriptor itself, `AT_EMPTY_PATH`), a
//! single checked name component ([`Name`]) resolved in a directory descriptor without following
//! a final symlink, or a `/proc/self/fd` entry that re-opens an inode fusex already holds.
//! The calls io_uring has an operation for are made on the queue's ring instead, with the same
//! arguments (`ring.rs`); what is here runs on the queue thread.

use std::ffi::CStr;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// An errno, positive.
pub type Errno = i32;

/// The errno of the last failed call.
pub fn errno() -> Errno {
    io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

fn check(r: libc::c_int) -> Result<libc::c_int, Errno> {
    if r < 0 {
        Err(errno())
    } else {
        Ok(r)
    }
}

fn check_fd(r: libc::c_int) -> Result<OwnedFd, Errno> {
    let fd = check(r)?;
    // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A name the kernel sent for an entry of a directory: one path component, never empty, `.`,
/// `..`, nor holding a `/` (the kernel never sends those for an entry; an untrusted request that
/// did is refused with `EINVAL` instead of reaching a path outside the directory).
#[derive(Clone, Copy)]
pub struct Name<'a>(&'a CStr);

impl<'a> Name<'a> {
    /// Checks `c` is a single component.
    pub fn new(c: &'a CStr) -> Result<Name<'a>, Errno> {
        let b = c.to_bytes();
        if b.is_empty() || b == b"." || b == b".." || b.contains(&b'/') {
            return Err(libc::EINVAL);
        }
        if b.len() > 255 {
            return Err(libc::ENAMETOOLONG);
        }
        Ok(Name(c))
    }

    /// The name as a C string.
    pub fn as_c(&self) -> &'a CStr {
        self.0
    }

    /// The name's bytes.
    pub fn bytes(&self) -> &'a [u8] {
        self.0.to_bytes()
    }
}

const EMPTY: &CStr = c"";

/// `openat(dir, name, flags | O_NOFOLLOW | O_CLOEXEC, mode)`.
pub fn open_in(
    dir: BorrowedFd<'_>,
    name: Name<'_>,
    flags: i32,
    mode: u32,
) -> Result<OwnedFd, Errno> {
    // SAFETY: `name` is a valid NUL-terminated string; the result is checked.
    check_fd(unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_c().as_ptr(),
            flags | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            mode as libc::c_uint,
        )
    })
}

/// Opens the directory `name` in `dir` (`dir` itself for `None`, as a new open file) to be
/// listed: `O_NOFOLLOW`, and `O_NOATIME` where the daemon may (it owns the directory or has
/// `CAP_FOWNER`), so that listing it for no reader leaves its access time alone.
pub fn open_to_list(dir: BorrowedFd<'_>, name: Option<Name<'_>>) -> Result<OwnedFd, Errno> {
    let name = name.map_or(c".", |n| n.as_c());
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NONBLOCK | libc::O_NOFOLLOW;
    let open = |flags: i32| {
        // SAFETY: `name` is a valid NUL-terminated string; the result is checked.
        check_fd(unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags | libc::O_CLOEXEC) })
    };
    match open(flags | libc::O_NOATIME) {
        Err(libc::EPERM) => open(flags),
        r => r,
    }
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW | AT_NO_AUTOMOUNT)`: the entry's own attributes.
pub fn stat_in(dir: BorrowedFd<'_>, name: Name<'_>) -> Result<libc::stat, Errno> {
    let mut st = MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: `st` is writable memory of the right type; `name` is NUL-terminated.
    check(unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            name.as_c().as_ptr(),
            st.as_mut_ptr(),
            libc::AT_SYMLINK_NOFOLLOW | libc::AT_NO_AUTOMOUNT,
        )
    })?;
    // SAFETY: fstatat succeeded and filled it (and it was zeroed before).
    Ok(unsafe { st.assume_init() })
}

/// Lowers the calling thread's scheduling priority 10 nice levels below the one it has (at
/// most to 19): it runs behind the threads serving requests and the programs waiting for them
/// when the CPUs are busy. Relative, so a daemon started niced keeps its helpers below itself
/// (an absolute 10 would raise those of a daemon at nice 15 above its own queue threads).
pub fn lower_priority() {
    // getpriority may return -1 as a value: errno, cleared first, tells.
    // SAFETY: __errno_location points at the calling thread's errno, valid for its lifetime.
    unsafe { *libc::__errno_location() = 0 };
    // SAFETY: getpriority takes no pointers; who = 0 is the calling thread (nice values are per
    // thread on Linux).
    let now = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
    if now == -1 && errno() != 0 {
        return;
    }
    // SAFETY: setpriority takes no pointers and changes only the calling thread; a failure
    // leaves the priority as it was.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, (now + 10).min(19)) };
}

/// Opens the root directory itself, `O_PATH`, refusing a symlink at its last component.
pub fn open_root(path: &CStr) -> Result<OwnedFd, Errno> {
    // SAFETY: `path` is a valid NUL-terminated string; the result is checked.
    check_fd(unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    })
}

/// Opens the inode behind `fd` (an `O_PATH` descriptor fusex holds) again with `flags`, through
/// its `/proc/self/fd` entry in `proc_fd`: the inode itself, whatever its names are now.
pub fn reopen(proc_fd: BorrowedFd<'_>, fd: RawFd, flags: i32) -> Result<OwnedFd, Errno> {
    let mut name = [0u8; 16];
    let c = fd_name(&mut name, fd);
    // SAFETY: `c` is a valid NUL-terminated string; the result is checked.
    check_fd(unsafe { libc::openat(proc_fd.as_raw_fd(), c.as_ptr(), flags | libc::O_CLOEXEC, 0) })
}

/// The decimal name of `fd` in `/proc/self/fd`, NUL-terminated in `buf`.
pub(crate) fn fd_name(buf: &mut [u8; 16], fd: RawFd) -> &CStr {
    let mut n = fd.max(0) as u32;
    let mut digits = [0u8; 10];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let len = digits.len() - i;
    buf[..len].copy_from_slice(&digits[i..]);
    buf[len] = 0;
    // The digits hold no NUL and one ends them.
    CStr::from_bytes_with_nul(&buf[..=len]).unwrap_or(c"0")
}

/// `/proc/self/fd/N` of `fd` as a path, for the calls that have no descriptor form.
fn proc_path(buf: &mut [u8; 32], fd: RawFd) -> &CStr {
    const PREFIX: &[u8] = b"/proc/self/fd/";
    let mut tail = [0u8; 16];
    let n = fd_name(&mut tail, fd).to_bytes_with_nul().len();
    buf[..PREFIX.len()].copy_from_slice(PREFIX);
    buf[PREFIX.len()..PREFIX.len() + n].copy_from_slice(&tail[..n]);
    CStr::from_bytes_with_nul(&buf[..PREFIX.len() + n]).unwrap_or(c"/proc/self/fd/0")
}

/// `fstatat(fd, "", AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW)`: the inode's own attributes.
pub fn stat_fd(fd: BorrowedFd<'_>) -> Result<libc::stat, Errno> {
    let mut st = MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: `st` is writable memory of the right type; the empty path is NUL-terminated.
    check(unsafe {
        libc::fstatat(
            fd.as_raw_fd(),
            EMPTY.as_ptr(),
            st.as_mut_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
        )
    })?;
    // SAFETY: fstatat succeeded and filled it (and it was zeroed before).
    Ok(unsafe { st.assume_init() })
}

/// `fchownat(fd, "", uid, gid, AT_EMPTY_PATH)` (`u32::MAX`: leave as is); works on `O_PATH`
/// descriptors and on symlinks themselves.
pub fn chown_fd(fd: BorrowedFd<'_>, uid: u32, gid: u32) -> Result<(), Errno> {
    // SAFETY: the empty path is NUL-terminated.
    check(unsafe {
        libc::fchownat(
            fd.as_raw_fd(),
            EMPTY.as_ptr(),
            uid,
            gid,
            libc::AT_EMPTY_PATH,
        )
    })
    .map(drop)
}

/// chmod of the inode behind `fd` (never a symlink: Linux has no modes on those), through
/// `/proc/self/fd`.
pub fn chmod_fd(proc_fd: BorrowedFd<'_>, fd: RawFd, mode: u32) -> Result<(), Errno> {
    let mut name = [0u8; 16];
    let c = fd_name(&mut name, fd);
    // SAFETY: `c` is a valid NUL-terminated string.
    check(unsafe { libc::fchmodat(proc_fd.as_raw_fd(), c.as_ptr(), mode, 0) }).map(drop)
}

/// Clears the set-user-ID bit of the regular file behind `fd` (any descriptor, `O_PATH`
/// included), and its set-group-ID bit where its group may execute it: what a write, truncate
/// or chown by a caller without `CAP_FSETID` does on a local filesystem, and what
/// `FUSE_HANDLE_KILLPRIV_V2` leaves to the server (the daemon's own calls keep the bits: it has
/// `CAP_FSETID`).
pub fn kill_suidgid(proc_fd: BorrowedFd<'_>, fd: BorrowedFd<'_>) -> Result<(), Errno> {
    let st = stat_fd(fd)?;
    let mut kill = st.st_mode & libc::S_ISUID;
    if st.st_mode & (libc::S_ISGID | libc::S_IXGRP) == libc::S_ISGID | libc::S_IXGRP {
        kill |= libc::S_ISGID;
    }
    if kill == 0 || st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Ok(());
    }
    chmod_fd(proc_fd, fd.as_raw_fd(), st.st_mode & 0o7777 & !kill)
}

/// Sets access and modification times of the inode behind `fd` (`UTIME_OMIT` leaves one).
pub fn utimes_fd(fd: BorrowedFd<'_>, times: &[libc::timespec; 2]) -> Result<(), Errno> {
    // SAFETY: `times` points to two timespecs; the empty path is NUL-terminated.
    check(unsafe {
        libc::utimensat(
            fd.as_raw_fd(),
            EMPTY.as_ptr(),
            times.as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
        )
    })
    .map(drop)
}

/// `truncate(2)` of the regular file behind `fd`, through `/proc/self/fd`.
pub fn truncate_fd(fd: RawFd, size: u64) -> Result<(), Errno> {
    let size = libc::off_t::try_from(size).map_err(|_| libc::EFBIG)?;
    let mut buf = [0u8; 32];
    let p = proc_path(&mut buf, fd);
    // SAFETY: `p` is a valid NUL-terminated string.
    check(unsafe { libc::truncate(p.as_ptr(), size) }).map(drop)
}

/// `ftruncate(2)` of an open file.
pub fn ftruncate(fd: RawFd, size: u64) -> Result<(), Errno> {
    let size = libc::off_t::try_from(size).map_err(|_| libc::EFBIG)?;
    // SAFETY: plain syscall on a descriptor.
    check(unsafe { libc::ftruncate(fd, size) }).map(drop)
}

/// `mkdirat(dir, name, mode)`.
pub fn mkdir_in(dir: BorrowedFd<'_>, name: Name<'_>, mode: u32) -> Result<(), Errno> {
    // SAFETY: `name` is a valid NUL-terminated string.
    check(unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_c().as_ptr(), mode) }).map(drop)
}

/// `mknodat(dir, name, mode, rdev)`.
pub fn mknod_in(dir: BorrowedFd<'_>, name: Name<'_>, mode: u32, rdev: u64) -> Result<(), Errno> {
    // SAFETY: `name` is a valid NUL-terminated string.
    check(unsafe { libc::mknodat(dir.as_raw_fd(), name.as_c().as_ptr(), mode, rdev) }).map(drop)
}

/// `symlinkat(target, dir, name)`: the link's content is stored, never resolved.
pub fn symlink_in(target: &CStr, dir: BorrowedFd<'_>, name: Name<'_>) -> Result<(), Errno> {
    // SAFETY: both are valid NUL-terminated strings.
    check(unsafe { libc::symlinkat(target.as_ptr(), dir.as_raw_fd(), name.as_c().as_ptr()) })
        .map(drop)
}

/// `unlinkat(dir, name, flags)`.
pub fn unlink_in(dir: BorrowedFd<'_>, name: Name<'_>, flags: i32) -> Result<(), Errno> {
    // SAFETY: `name` is a valid NUL-terminated string.
    check(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_c().as_ptr(), flags) }).map(drop)
}

/// `readlinkat(fd, "")` into `out`: the bytes read.
pub fn readlink_fd(fd: BorrowedFd<'_>, out: &mut [u8]) -> Result<usize, Errno> {
    // SAFETY: `out` is writable for its length; the empty path is NUL-terminated.
    let n = unsafe {
        libc::readlinkat(
            fd.as_raw_fd(),
            EMPTY.as_ptr(),
            out.as_mut_ptr().cast(),
            out.len(),
        )
    };
    if n < 0 {
        Err(errno())
    } else {
        Ok(n as usize)
    }
}

/// `fstatfs(2)`.
pub fn statfs_fd(fd: BorrowedFd<'_>) -> Result<libc::statfs, Errno> {
    let mut st = MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: `st` is writable memory of the right type.
    check(unsafe { libc::fstatfs(fd.as_raw_fd(), st.as_mut_ptr()) })?;
    // SAFETY: fstatfs succeeded and filled it.
    Ok(unsafe { st.assume_init() })
}

/// `fcntl(F_SETFL)`: sets a descriptor's status flags (`O_NONBLOCK`, `O_NOATIME`, ...), the
/// others of its open flags unchanged.
pub fn set_status_flags(fd: BorrowedFd<'_>, flags: i32) -> Result<(), Errno> {
    // SAFETY: plain syscall on a descriptor; the result is checked.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags) }).map(drop)
}

/// Grows the process's descriptor table to hold `count` descriptors now (a `dup` to the last
/// one, closed again; the table never shrinks), when the limit allows. The kernel grows it by
/// doubling as descriptors are opened, and each time, in a process with several threads, waits
/// for an RCU grace period: a first walk of a 10k-entry tree grew it eight times and took
/// 70-90 ms longer than the next one.
pub fn reserve_descriptors(fd: BorrowedFd<'_>, count: usize) {
    let Ok(last) = libc::c_int::try_from(count.saturating_sub(1)) else {
        return;
    };
    // SAFETY: F_DUPFD makes a new descriptor (the lowest free one at or above `last`); the
    // result is checked and closed at once.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, last) };
    if r >= 0 {
        // SAFETY: just made above, owned here.
        drop(unsafe { OwnedFd::from_raw_fd(r) });
    }
}

/// `lseek(2)`.
pub fn lseek(fd: RawFd, off: u64, whence: i32) -> Result<u64, Errno> {
    let off = libc::off_t::try_from(off).map_err(|_| libc::ENXIO)?;
    // SAFETY: plain syscall on a descriptor.
    let r = unsafe { libc::lseek(fd, off, whence) };
    if r < 0 {
        Err(errno())
    } else {
        Ok(r as u64)
    }
}

/// `getdents64(2)` into `out`: the bytes of `linux_dirent64` records read (0 at the end).
pub fn getdents(fd: RawFd, out: &mut [u8]) -> Result<usize, Errno> {
    // SAFETY: `out` is writable for its length.
    let n = unsafe { libc::syscall(libc::SYS_getdents64, fd, out.as_mut_ptr(), out.len()) };
    if n < 0 {
        Err(errno())
    } else {
        Ok(n as usize)
    }
}

/// One `linux_dirent64` record as `getdents64` wrote it.
pub struct DirRecord<'a> {
    pub ino: u64,
    /// The source's cookie for the position after this entry.
    pub off: u64,
    /// `DT_*`.
    pub typ: u8,
    pub name: &'a CStr,
    /// The record's length: where the next one starts.
    pub reclen: usize,
}

/// The record at the start of `buf` (a `getdents64` result from a record boundary on); `None`
/// when it is malformed: shorter than its header, longer than `buf`, or a name without its NUL.
pub fn dir_record(buf: &[u8]) -> Option<DirRecord<'_>> {
    let head = buf.get(..19)?;
    let reclen = usize::from(u16::from_ne_bytes([head[16], head[17]]));
    if reclen < 20 || reclen > buf.len() {
        return None;
    }
    Some(DirRecord {
        ino: u64::from_ne_bytes(head[0..8].try_into().ok()?),
        off: u64::from_ne_bytes(head[8..16].try_into().ok()?),
        typ: head[18],
        name: CStr::from_bytes_until_nul(&buf[19..reclen]).ok()?,
        reclen,
    })
}

/// Runs `f` with `CAP_FSETID` out of the calling thread's effective set (capabilities are
/// per thread), then puts it back. The credentials a passthrough backing file is registered
/// with are those the kernel writes with (`FUSE_DEV_IOC_BACKING_OPEN` records the caller's):
/// without `CAP_FSETID` there, a write through the mount clears set-id bits in the source as a
/// local write without it does, which `FUSE_HANDLE_KILLPRIV_V2` leaves to the server and no
/// request brings it for passthrough writes. A thread without the capability runs `f` as it
/// is.
pub fn without_fsetid<T>(f: impl FnOnce() -> T) -> T {
    let (r, back) = caps::without(caps::CAP_FSETID, f);
    if let Err(e) = back {
        tracing::warn!("could not take CAP_FSETID back: {e}");
    }
    r
}

/// `statx(fd, "", AT_EMPTY_PATH | sync, mask)`: the inode's own extended attributes (a
/// symlink's own, for an `O_PATH` descriptor of one). `sync` is `AT_STATX_FORCE_SYNC`,
/// `AT_STATX_DONT_SYNC` or 0.
pub fn statx_fd(fd: BorrowedFd<'_>, sync: i32, mask: u32) -> Result<libc::statx, Errno> {
    let mut sx = MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: `sx` is writable memory of the right type; the empty path is NUL-terminated.
    check(unsafe {
        libc::statx(
            fd.as_raw_fd(),
            EMPTY.as_ptr(),
            libc::AT_EMPTY_PATH | (sync & libc::AT_STATX_SYNC_TYPE),
            mask,
            sx.as_mut_ptr(),
        )
    })?;
    // SAFETY: statx succeeded and filled it (and it was zeroed before).
    Ok(unsafe { sx.assume_init() })
}

/// `copy_file_range(2)` of `len` bytes from `from` at `off_in` to `to` at `off_out`: the bytes
/// copied, fewer only at the source's end or when an error follows some bytes (those bytes are
/// answered, as the kernel does). A call that stops short of what is left (without reflinks the
/// kernel copies through a pipe of 16 pages per round and may return after one) is followed by
/// another from where the kernel left both offsets.
pub fn copy_range(
    from: RawFd,
    off_in: u64,
    to: RawFd,
    off_out: u64,
    len: usize,
) -> Result<usize, Errno> {
    let mut off_in = i64::try_from(off_in).map_err(|_| libc::EINVAL)?;
    let mut off_out = i64::try_from(off_out).map_err(|_| libc::EINVAL)?;
    let mut done = 0;
    while done < len {
        // SAFETY: the offsets are valid, writable i64s; no buffer is involved.
        let n =
            unsafe { libc::copy_file_range(from, &mut off_in, to, &mut off_out, len - done, 0) };
        match n {
            0 => break,
            n if n > 0 => done += n as usize,
            _ if done == 0 => return Err(errno()),
            _ => break,
        }
    }
    Ok(done)
}

/// Extended attribute calls on the inode behind `fd`, through `/proc/self/fd` (an `O_PATH`
/// descriptor has no `f*xattr`).
pub mod xattr {
    use super::*;

    /// `getxattr(2)`: the value's length (with an empty `out`: its size).
    pub fn get(fd: RawFd, name: &CStr, out: &mut [u8]) -> Result<usize, Errno> {
        let mut buf = [0u8; 32];
        let p = proc_path(&mut buf, fd);
        // SAFETY: valid strings; `out` is writable for its length.
        let n = unsafe {
            libc::getxattr(
                p.as_ptr(),
                name.as_ptr(),
                out.as_mut_ptr().cast(),
                out.len(),
            )
        };
        if n < 0 {
            Err(errno())
        } else {
            Ok(n as usize)
        }
    }

    /// `listxattr(2)`: the list's length (with an empty `out`: its size).
    pub fn list(fd: RawFd, out: &mut [u8]) -> Result<usize, Errno> {
        let mut buf = [0u8; 32];
        let p = proc_path(&mut buf, fd);
        // SAFETY: valid string; `out` is writable for its length.
        let n = unsafe { libc::listxattr(p.as_ptr(), out.as_mut_ptr().cast(), out.len()) };
        if n < 0 {
            Err(errno())
        } else {
            Ok(n as usize)
        }
    }

    /// `setxattr(2)`.
    pub fn set(fd: RawFd, name: &CStr, value: &[u8], flags: i32) -> Result<(), Errno> {
        let mut buf = [0u8; 32];
        let p = proc_path(&mut buf, fd);
        // SAFETY: valid strings; `value` is readable for its length.
        check(unsafe {
            libc::setxattr(
                p.as_ptr(),
                name.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                flags,
            )
        })
        .map(drop)
    }

    /// `removexattr(2)`.
    pub fn remove(fd: RawFd, name: &CStr) -> Result<(), Errno> {
        let mut buf = [0u8; 32];
        let p = proc_path(&mut buf, fd);
        // SAFETY: valid strings.
        check(unsafe { libc::removexattr(p.as_ptr(), name.as_ptr()) }).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calling thread's nice value, from `/proc/thread-self/stat` (field 19).
    fn nice_now() -> i32 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        let after_name = &stat[stat.rfind(')').unwrap() + 2..];
        after_name.split(' ').nth(16).unwrap().parse().unwrap()
    }

    #[test]
    fn lower_priority_is_relative_and_stops_at_19() {
        std::thread::spawn(|| {
            let start = nice_now();
            lower_priority();
            assert_eq!(nice_now(), (start + 10).min(19));
            lower_priority();
            assert_eq!(nice_now(), 19, "twice lowered, at most 19");
        })
        .join()
        .unwrap();
    }

    /// The descriptor table holds the descriptors reserved at once (`FDSize` in
    /// `/proc/self/status` is its size), as far as the limit allows.
    #[test]
    fn descriptors_reserved_grow_the_table_now() {
        use std::os::fd::AsFd;
        let fd_size = || {
            let status = std::fs::read_to_string("/proc/self/status").unwrap();
            let line = status.lines().find(|l| l.starts_with("FDSize:")).unwrap();
            line[7..].trim().parse::<usize>().unwrap()
        };
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `r` is a valid rlimit to fill.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) }, 0);
        let want = (r.rlim_cur as usize).min(1 << 16);
        let dir: OwnedFd = std::fs::File::open("/").unwrap().into();
        reserve_descriptors(dir.as_fd(), want);
        assert!(fd_size() >= want, "{} < {want}", fd_size());
        // More than the limit allows is left alone.
        reserve_descriptors(dir.as_fd(), r.rlim_cur as usize + 1);
    }

    #[test]
    fn names_are_single_components() {
        assert!(Name::new(c"file").is_ok());
        assert!(Name::new(c"..file").is_ok());
        for bad in [c"", c".", c"..", c"a/b", c"/", c"../x"] {
            assert_eq!(Name::new(bad).err(), Some(libc::EINVAL), "{bad:?}");
        }
        let long = std::ffi::CString::new(vec![b'x'; 256]).unwrap();
        assert_eq!(Name::new(&long).err(), Some(libc::ENAMETOOLONG));
    }

    /// The handle of a deleted file never opens another file, also while another thread creates
    /// files that take its inode number (mid-creation the kernel refuses the number with
    /// `ENOMEM`): it answers `ESTALE`, or, while something still holds the deleted inode (a
    /// process that another test forked at that moment inherits the open file until its exec
    /// closes it), opens that same deleted inode.
    #[test]
    fn a_deleted_files_handle_is_stale_while_its_number_is_reused() {
        use std::os::fd::AsFd;
        use std::sync::atomic::{AtomicBool, Ordering};
        let dir = tempfile::tempdir().unwrap();
        let mount = std::fs::File::open(dir.path()).unwrap();
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    for i in 0..16 {
                        std::fs::File::create(dir.path().join(format!("c{i}"))).unwrap();
                    }
                    for i in 0..16 {
                        std::fs::remove_file(dir.path().join(format!("c{i}"))).unwrap();
                    }
                }
            });
            let checked = std::panic::catch_unwind(|| {
                for i in 0..3000 {
                    let p = dir.path().join(format!("v{i}"));
                    let f = std::fs::File::create(&p).unwrap();
                    let h = handle_of(f.as_fd()).unwrap();
                    let ino = stat_fd(f.as_fd()).unwrap().st_ino;
                    drop(f);
                    std::fs::remove_file(&p).unwrap();
                    match open_handle(mount.as_fd(), &h, libc::O_PATH) {
                        Err(e) => assert_eq!(e, libc::ESTALE, "file {i}"),
                        Ok(fd) => {
                            let st = stat_fd(fd.as_fd()).unwrap();
                            assert_eq!((st.st_ino, st.st_nlink), (ino, 0), "file {i}");
                        }
                    }
                }
            });
            stop.store(true, Ordering::Relaxed);
            checked.unwrap();
        });
    }

    #[test]
    fn proc_names() {
        let mut b = [0u8; 16];
        assert_eq!(fd_name(&mut b, 0).to_bytes(), b"0");
        assert_eq!(fd_name(&mut b, 1234567).to_bytes(), b"1234567");
        assert_eq!(fd_name(&mut b, i32::MAX).to_bytes(), b"2147483647");
        let mut p = [0u8; 32];
        assert_eq!(
            proc_path(&mut p, i32::MAX).to_bytes(),
            b"/proc/self/fd/2147483647"
        );
    }

    /// Set-user-ID always goes, set-group-ID only where the group may execute; the other bits
    /// stay; directories and files without the bits are left alone.
    #[test]
    fn kill_suidgid_clears_what_a_local_write_clears() {
        use std::os::fd::AsFd;
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let proc_fd: OwnedFd = std::fs::File::open("/proc/self/fd").unwrap().into();
        for (before, after) in [
            (0o6777, 0o0777),
            (0o6767, 0o2767),
            (0o4755, 0o0755),
            (0o2750, 0o0750),
            (0o1777, 0o1777),
            (0o0644, 0o0644),
        ] {
            let p = dir.path().join(format!("f{before:o}"));
            std::fs::write(&p, b"x").unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(before)).unwrap();
            let f = std::fs::File::open(&p).unwrap();
            kill_suidgid(proc_fd.as_fd(), f.as_fd()).unwrap();
            let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o7777;
            assert_eq!(mode, after, "{before:o}");
        }
        let d = dir.path().join("d");
        std::fs::create_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o2775)).unwrap();
        let f = std::fs::File::open(&d).unwrap();
        kill_suidgid(proc_fd.as_fd(), f.as_fd()).unwrap();
        let mode = std::fs::metadata(&d).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o2775, "a directory keeps its set-gid bit");
    }

    /// `CAP_FSETID` is out of the effective set only inside the closure, and back after it; the
    /// rest of the sets does not change.
    #[test]
    fn without_fsetid_drops_the_capability_for_the_call_only() {
        let before = caps::get().unwrap();
        let inside = without_fsetid(|| caps::get().unwrap());
        assert_eq!(
            inside.effective,
            before.effective & !caps::bit(caps::CAP_FSETID)
        );
        assert_eq!(inside.permitted, before.permitted);
        assert_eq!(caps::get().unwrap(), before);
    }
}

/// The kernel's `MAX_HANDLE_SZ`: the largest `f_handle` any filesystem returns.
const MAX_HANDLE_SZ: usize = 128;

/// `struct file_handle` (`include/linux/fcntl.h`'s `name_to_handle_at` argument) with room for
/// the largest handle: `handle_bytes`, `handle_type`, then the opaque bytes.
#[repr(C)]
struct RawHandle {
    handle_bytes: u32,
    handle_type: i32,
    f_handle: [u8; MAX_HANDLE_SZ],
}

/// A file handle: names an inode of one filesystem for as long as the inode exists, without
/// holding a descriptor (`name_to_handle_at(2)`). Handles of two different inodes differ, even
/// when the second reuses the first's inode number.
#[derive(Debug, PartialEq, Eq)]
pub struct Handle {
    kind: i32,
    bytes: Box<[u8]>,
}

impl Handle {
    /// Its type and opaque bytes, as another process needs them (`fusex restart`).
    pub fn parts(&self) -> (i32, &[u8]) {
        (self.kind, &self.bytes)
    }

    /// The handle of `parts` (at most `MAX_HANDLE_SZ` bytes: a longer one is no handle).
    pub fn from_parts(kind: i32, bytes: &[u8]) -> Option<Handle> {
        (bytes.len() <= MAX_HANDLE_SZ).then(|| Handle {
            kind,
            bytes: bytes.into(),
        })
    }
}

/// The handle of the inode `fd` refers to (an `O_PATH` descriptor works).
pub fn handle_of(fd: BorrowedFd<'_>) -> Result<Handle, Errno> {
    let mut raw = RawHandle {
        handle_bytes: MAX_HANDLE_SZ as u32,
        handle_type: 0,
        f_handle: [0; MAX_HANDLE_SZ],
    };
    let mut mount_id: libc::c_int = 0;
    // SAFETY: `raw` is a file_handle with `handle_bytes` of room after its header; the empty
    // path is NUL-terminated; the result is checked.
    check(unsafe {
        libc::syscall(
            libc::SYS_name_to_handle_at,
            fd.as_raw_fd(),
            EMPTY.as_ptr(),
            &mut raw as *mut RawHandle,
            &mut mount_id as *mut libc::c_int,
            libc::AT_EMPTY_PATH,
        ) as libc::c_int
    })?;
    let n = (raw.handle_bytes as usize).min(MAX_HANDLE_SZ);
    Ok(Handle {
        kind: raw.handle_type,
        bytes: raw.f_handle[..n].into(),
    })
}

/// Opens the inode `h` names with `flags`, `mount` being a descriptor (not `O_PATH`) of the
/// filesystem the handle came from. Needs `CAP_DAC_READ_SEARCH`; `ESTALE` once the inode is gone.
///
/// `ENOMEM` is retried for a while: while a new file is being created under the inode number of
/// a deleted one, the kernel's inode cache refuses that number and ext4 reports the refusal as
/// `ENOMEM`. Once the creation completes the same call answers `ESTALE` (the generation differs),
/// which is the truth for the old handle.
pub fn open_handle(mount: BorrowedFd<'_>, h: &Handle, flags: i32) -> Result<OwnedFd, Errno> {
    /// Retries of an `ENOMEM`, 1 ms apart: a creation that outlasts them is reported as the
    /// kernel's `ENOMEM`.
    const ENOMEM_RETRIES: u32 = 100;
    let mut raw = RawHandle {
        handle_bytes: h.bytes.len() as u32,
        handle_type: h.kind,
        f_handle: [0; MAX_HANDLE_SZ],
    };
    raw.f_handle[..h.bytes.len()].copy_from_slice(&h.bytes);
    let mut tries = 0;
    loop {
        // SAFETY: `raw` is a valid file_handle of `handle_bytes` bytes; the result is checked.
        let r = check_fd(unsafe {
            libc::syscall(
                libc::SYS_open_by_handle_at,
                mount.as_raw_fd(),
                &mut raw as *mut RawHandle,
                flags | libc::O_CLOEXEC,
            ) as libc::c_int
        });
        match r {
            Err(libc::ENOMEM) if tries < ENOMEM_RETRIES => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            r => return r,
        }
    }
}
