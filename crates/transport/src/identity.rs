//! Which FUSE mount is at a path, for the `--auto-unmount` watcher: it records the mount's
//! [`MountIdentity`] at mount time and unmounts only that mount, never one some later daemon
//! made at the same path.
//!
//! A path alone says nothing about *which* mount it is, and neither does `st_dev`: the kernel hands
//! out anonymous device numbers (and the mountinfo mount ids) lowest-free first, so a new FUSE mount
//! made right after an old one was cleared usually gets the old one's `st_dev`. The 64-bit mount
//! id `statx` reports with `STATX_MNT_ID_UNIQUE` (Linux 6.8) is never reused; older kernels only
//! have the reusable `STATX_MNT_ID`, which is then checked together with `st_dev`.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::mountinfo::MountIdentity;

/// `statx` of an open fd for `mask`, answered from the cache (no request to a FUSE daemon).
fn statx_fd(fd: BorrowedFd<'_>, mask: u32) -> io::Result<libc::statx> {
    // SAFETY: an all-zero statx is a valid value of this plain C struct.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: statx on a live fd with an empty path writes into stx, which outlives the call.
    let r = unsafe {
        libc::statx(
            fd.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_STATX_DONT_SYNC,
            mask,
            &mut stx,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(stx)
}

/// The identity of the mount `fd` is on (for a mount's root: that mount), without a path.
pub(crate) fn identity_of_fd(fd: BorrowedFd<'_>) -> io::Result<MountIdentity> {
    Ok(crate::mountinfo::identity_from(&statx_fd(
        fd,
        libc::STATX_MNT_ID_UNIQUE,
    )?))
}

/// Device and inode of the file `fd` names, and its file type bits (`S_IFMT`).
pub(crate) fn fd_file(fd: BorrowedFd<'_>) -> io::Result<((u32, u32, u64), u32)> {
    let st = statx_fd(fd, libc::STATX_INO | libc::STATX_TYPE)?;
    Ok((
        (st.stx_dev_major, st.stx_dev_minor, st.stx_ino),
        u32::from(st.stx_mode) & libc::S_IFMT,
    ))
}

/// `path` opened `O_PATH | O_NOFOLLOW`: what is there now (the top mount's root on a mountpoint),
/// never what a final symlink names, and without opening the file (no request to a FUSE daemon).
pub(crate) fn open_path(path: &Path) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: c is a valid NUL-terminated path; the returned fd is owned below.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by open and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// umount2 with `flags` of exactly the mount whose root `fd` holds, through its `/proc/self/fd`
/// link (followed: no `UMOUNT_NOFOLLOW`), whatever the path shows meanwhile.
pub(crate) fn umount_through(fd: BorrowedFd<'_>, flags: i32) -> io::Result<()> {
    let link = CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: link is a valid NUL-terminated path.
    if unsafe { libc::umount2(link.as_ptr(), flags) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether the mountinfo line with mount id `id` (the reusable one, first field) is FUSE.
fn mountinfo_is_fuse(text: &str, id: u64) -> bool {
    text.lines().any(|line| {
        let first = line.split(' ').next().and_then(|f| f.parse::<u64>().ok());
        let fstype = line
            .split_once(" - ")
            .and_then(|(_, post)| post.split(' ').next());
        first == Some(id) && fstype.is_some_and(|t| t == "fuse" || t.starts_with("fuse."))
    })
}

/// The top mount at `path`, opened `O_PATH`, and whether it is the root of the mount `expected`,
/// whose id is the never-reused 64-bit one: equal ids (and devices) then name the very mount
/// `expected` was taken from, a FUSE mount, so mountinfo need not say whether it is FUSE. Reading
/// mountinfo costs the kernel a formatted line per mount in the namespace, and a daemon of many
/// exports unmounting one of them paid that for every other (measured: 9 % of the CPU time of
/// unpaced `fusex serve` add and delete rounds with 100 exports mounted).
fn open_unique(path: &Path, expected: &MountIdentity) -> io::Result<(OwnedFd, bool)> {
    let fd = open_path(path)?;
    let st = statx_fd(fd.as_fd(), libc::STATX_MNT_ID_UNIQUE)?;
    let root = libc::STATX_ATTR_MOUNT_ROOT as u64;
    let is_root = st.stx_attributes_mask & root != 0 && st.stx_attributes & root != 0;
    let same = is_root
        && st.stx_mask & libc::STATX_MNT_ID_UNIQUE != 0
        && crate::mountinfo::identity_from(&st) == *expected;
    Ok((fd, same))
}

/// The top mount at `path`, opened `O_PATH`, with its identity; `None` for the identity when
/// `path` is not the root of a FUSE mount.
///
/// Never sends a request to the FUSE daemon (which may be this very process, not serving yet, or
/// wedged): `O_PATH` does not open the file, `statx` asks only for mount ids, which FUSE answers
/// from its cache, and whether the mount is FUSE comes from mountinfo, not from `statfs`.
fn open_mount(path: &Path) -> io::Result<(OwnedFd, Option<MountIdentity>)> {
    let fd = open_path(path)?;
    let old = statx_fd(fd.as_fd(), libc::STATX_MNT_ID)?;
    let root = libc::STATX_ATTR_MOUNT_ROOT as u64;
    let is_root = old.stx_attributes_mask & root != 0 && old.stx_attributes & root != 0;
    if !is_root || old.stx_mask & libc::STATX_MNT_ID == 0 {
        return Ok((fd, None));
    }
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    if !mountinfo_is_fuse(&info, old.stx_mnt_id) {
        return Ok((fd, None));
    }
    let new = statx_fd(fd.as_fd(), libc::STATX_MNT_ID_UNIQUE)?;
    let unique = new.stx_mask & libc::STATX_MNT_ID_UNIQUE != 0;
    Ok((
        fd,
        Some(MountIdentity::from_parts(
            if unique {
                new.stx_mnt_id
            } else {
                old.stx_mnt_id
            },
            unique,
            (old.stx_dev_major, old.stx_dev_minor),
        )),
    ))
}

/// Unmounts (lazily) the mount at `path` if it is still the FUSE mount `expected`; says whether it
/// did. See `unmount_exact`.
pub fn unmount_if_same(path: &Path, expected: &MountIdentity) -> io::Result<bool> {
    unmount_exact(path, expected, libc::MNT_DETACH)
}

/// Unmounts the mount at `path` with umount2 `flags` if it is still the FUSE mount `expected`;
/// says whether it did (false: nothing there, or another mount). The check and the unmount act
/// on the same opened mount (the unmount goes through the `/proc/self/fd` link of the fd that was
/// checked), so a mount stacked or swapped in at `path` meanwhile is never the one removed. The
/// fd itself keeps the mount busy: a plain unmount fails with `EBUSY` (a forced one still aborts
/// the connection first), a lazy one succeeds.
pub(crate) fn unmount_exact(path: &Path, expected: &MountIdentity, flags: i32) -> io::Result<bool> {
    let found = if expected.is_unique() {
        open_unique(path, expected)
    } else {
        open_mount(path).map(|(fd, id)| (fd, id.as_ref() == Some(expected)))
    };
    let fd = match found {
        Ok((fd, true)) => fd,
        Ok((_, false)) => return Ok(false),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(false),
        Err(e) => return Err(e),
    };
    if let Err(e) = umount_through(fd.as_fd(), flags) {
        // SAFETY: geteuid has no preconditions.
        if e.raw_os_error() != Some(libc::EPERM) || unsafe { libc::geteuid() } == 0 {
            return Err(e);
        }
        // A normal user's mount, made by fusermount3: only fusermount3 may take it down, and
        // only by path. It refuses mounts that are not this user's; a mount swapped in at the
        // path between the check above and this call would be hit (see docs/design.md).
        drop(fd);
        return crate::fusermount::unmount(path, true)
            .map(|()| true)
            .map_err(|e| io::Error::other(e.to_string()));
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_fuse_by_id() {
        let t = "36 35 98:0 / /mnt1 rw master:1 - ext3 /dev/root rw\n\
                 40 22 0:45 / /tmp/x rw,nosuid - fuse.fusex /img rw,user_id=0\n\
                 41 22 0:46 / /tmp/y rw - fusectl fusectl rw\n";
        assert!(mountinfo_is_fuse(t, 40));
        assert!(!mountinfo_is_fuse(t, 36));
        assert!(!mountinfo_is_fuse(t, 41));
        assert!(!mountinfo_is_fuse(t, 4));
    }
}
