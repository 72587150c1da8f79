//! The kernel's file-descriptor mount API (`fsopen`, `fsconfig`, `fsmount`, `move_mount`; Linux
//! 5.2+), which mounts without naming the target by path.
//!
//! Why fusex uses it: a path can change between the check and the mount. A local user who owns
//! the mountpoint file in a sticky directory can swap it for a symlink to a root-owned file while
//! root's daemon starts, and mount(2) with the path would put the export over that root file. Here
//! the target is a descriptor opened `O_PATH | O_NOFOLLOW` and checked, and the new mount is first
//! built detached: its identity is known (and an `--auto-unmount` watcher armed with it) before
//! [`attach`] makes it visible on exactly the checked file.
//!
//! The constants are the kernel's UAPI (`include/uapi/linux/mount.h`).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

const FSOPEN_CLOEXEC: libc::c_uint = 0x1;
const FSCONFIG_SET_FLAG: libc::c_uint = 0;
const FSCONFIG_SET_STRING: libc::c_uint = 1;
const FSCONFIG_CMD_CREATE: libc::c_uint = 6;
const FSMOUNT_CLOEXEC: libc::c_uint = 0x1;
/// `MOUNT_ATTR_RDONLY`.
pub const ATTR_RDONLY: libc::c_uint = 0x1;
/// `MOUNT_ATTR_NOSUID`.
pub const ATTR_NOSUID: libc::c_uint = 0x2;
/// `MOUNT_ATTR_NODEV`.
pub const ATTR_NODEV: libc::c_uint = 0x4;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
const MOVE_MOUNT_T_EMPTY_PATH: libc::c_uint = 0x40;

fn fd_result(r: libc::c_long) -> io::Result<OwnedFd> {
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(r).map_err(|_| io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: the kernel just returned this descriptor to this process; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn unit_result(r: libc::c_long) -> io::Result<()> {
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn cstr(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// A filesystem context being configured (`fsopen`): parameters go in one by one, then
/// [`Context::mount`] creates the superblock and a detached mount of it.
pub struct Context {
    fd: OwnedFd,
}

impl Context {
    /// A context for the filesystem type `fstype` (`fuse`). `ENOSYS` on kernels before 5.2.
    pub fn open(fstype: &str) -> io::Result<Context> {
        let name = cstr(fstype)?;
        // SAFETY: fsopen reads a NUL-terminated name that lives across the call.
        let r = unsafe { libc::syscall(libc::SYS_fsopen, name.as_ptr(), FSOPEN_CLOEXEC) };
        Ok(Context { fd: fd_result(r)? })
    }

    /// Sets the string parameter `key` to `value`.
    pub fn set(&self, key: &str, value: &str) -> io::Result<()> {
        let (k, v) = (cstr(key)?, cstr(value)?);
        // SAFETY: both strings are NUL-terminated and live across the call; aux is unused.
        let r = unsafe {
            libc::syscall(
                libc::SYS_fsconfig,
                self.fd.as_raw_fd(),
                FSCONFIG_SET_STRING,
                k.as_ptr(),
                v.as_ptr(),
                0,
            )
        };
        unit_result(r)
    }

    /// Sets the flag parameter `key`.
    pub fn flag(&self, key: &str) -> io::Result<()> {
        let k = cstr(key)?;
        // SAFETY: the key is NUL-terminated and lives across the call; value and aux are unused.
        let r = unsafe {
            libc::syscall(
                libc::SYS_fsconfig,
                self.fd.as_raw_fd(),
                FSCONFIG_SET_FLAG,
                k.as_ptr(),
                std::ptr::null::<libc::c_char>(),
                0,
            )
        };
        unit_result(r)
    }

    /// Creates the superblock and returns a mount of it that is attached nowhere yet, with the
    /// mount attributes `attrs` (`ATTR_*`). Its descriptor names the mount's root.
    pub fn mount(self, attrs: libc::c_uint) -> io::Result<OwnedFd> {
        // SAFETY: no pointers; the context fd is open.
        let r = unsafe {
            libc::syscall(
                libc::SYS_fsconfig,
                self.fd.as_raw_fd(),
                FSCONFIG_CMD_CREATE,
                std::ptr::null::<libc::c_char>(),
                std::ptr::null::<libc::c_void>(),
                0,
            )
        };
        unit_result(r)?;
        // SAFETY: no pointers; the context fd is open.
        let r = unsafe {
            libc::syscall(
                libc::SYS_fsmount,
                self.fd.as_raw_fd(),
                FSMOUNT_CLOEXEC,
                attrs,
            )
        };
        fd_result(r)
    }
}

/// Attaches the detached mount `mount` on the file `target` names (both descriptors, no path).
pub fn attach(mount: BorrowedFd<'_>, target: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: both paths are empty NUL-terminated strings; the descriptors are open.
    let r = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            mount.as_raw_fd(),
            c"".as_ptr(),
            target.as_raw_fd(),
            c"".as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH,
        )
    };
    unit_result(r)
}
