//! POSIX ACLs. With `FUSE_POSIX_ACL` the kernel checks access against the ACLs itself (under
//! `default_permissions`) and reads and writes them as the `system.posix_acl_access` and
//! `system.posix_acl_default` attributes, which reach the source as plain xattr calls: the source
//! filesystem keeps the mode and the ACL in step as it does for a local caller. What is left to
//! fusex:
//!
//! - **The umask.** With `FUSE_DONT_MASK` the kernel sends a new entry's mode without the
//!   caller's umask and the umask beside it, since a parent with a default ACL means the umask
//!   must not apply. fusex creates the entry with the caller's umask as its own
//!   ([`engine::umask::hold`], see `create`), so the source filesystem decides, exactly as for
//!   a local `open`/`mkdir`: the default ACL if the parent has one, else the umask. Nothing
//!   after the creation changes those permission bits ([`created_mode`]).
//! - **The setgid bit.** Setting an access ACL clears a file's setgid bit when the caller is
//!   neither in the file's group nor has `CAP_FSETID`; the source filesystem judges the daemon,
//!   so the kernel says so instead (`FUSE_SETXATTR_ACL_KILL_SGID`, with `FUSE_SETXATTR_EXT`)
//!   and fusex clears it ([`DirFs::acl_set`]).

use std::ffi::CStr;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::Ordering;

use fuse_abi::{Layouts, FUSE_SETXATTR_ACL_KILL_SGID, FUSE_SETXATTR_EXT};

use crate::inodes::Inode;
use crate::sys::{self, Errno};
use crate::DirFs;

/// The access ACL's attribute name.
const ACCESS: &CStr = c"system.posix_acl_access";

/// The mode a new entry ends with: the permission bits the source filesystem gave it (the
/// caller's umask or the parent's default ACL applied) and the set-id and sticky bits the caller
/// asked for (`made` and `asked` are `st_mode`-style).
pub(crate) fn created_mode(made: u32, asked: u32) -> u32 {
    (made & 0o777) | (asked & 0o7000)
}

/// How requests are laid out with the INIT flags `granted`.
pub(crate) fn layouts(granted: u64) -> Layouts {
    Layouts {
        setxattr_ext: granted & FUSE_SETXATTR_EXT != 0,
    }
}

impl DirFs {
    /// Records the INIT flags the kernel granted (`FUSE_SETXATTR_EXT` changes how SETXATTR is
    /// laid out). Once, before the queues start.
    pub fn set_granted(&self, flags: u64) {
        self.granted.store(flags, Ordering::Relaxed);
    }

    /// Whether the source keeps POSIX ACLs (its root answers for `system.posix_acl_access`),
    /// so INIT may ask for `FUSE_POSIX_ACL`. Without them the kernel would fail every access
    /// check that asks for one with the source's `EOPNOTSUPP`.
    pub fn source_has_acls(&self) -> bool {
        let Some(root) = self.root() else {
            return false;
        };
        let Ok(fd) = root.fd() else { return false };
        matches!(
            sys::xattr::get(fd.as_raw_fd(), ACCESS, &mut []),
            Ok(_) | Err(libc::ENODATA)
        )
    }

    /// After a SETXATTR of `name` on `node`: an access ACL set with
    /// `FUSE_SETXATTR_ACL_KILL_SGID` clears the setgid bit, as the caller's own filesystem would.
    pub(crate) fn acl_set(
        &self,
        node: &Inode,
        name: &CStr,
        setxattr_flags: u32,
    ) -> Result<(), Errno> {
        if setxattr_flags & FUSE_SETXATTR_ACL_KILL_SGID == 0 || name != ACCESS {
            return Ok(());
        }
        let st = sys::stat_fd(node.fd()?.as_fd())?;
        if st.st_mode & libc::S_ISGID == 0 {
            return Ok(());
        }
        sys::chmod_fd(
            self.proc_fd.as_fd(),
            node.fd()?.as_raw_fd(),
            st.st_mode & 0o7777 & !libc::S_ISGID,
        )
    }
}
