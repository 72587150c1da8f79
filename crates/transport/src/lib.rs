//! The FUSE transport: everything between the kernel's `/dev/fuse` and decoded requests.
//!
//! It mounts (and reliably unmounts), negotiates INIT, and moves request and reply bytes through
//! the queue's ring. It knows nothing of images: the export decides what a request means.

pub mod fdpass;
pub mod fusermount;
mod identity;
mod init;
mod legacy;
mod mount;
mod mount_api;
mod mountinfo;
mod notify;
pub mod passthrough;
mod splice;
mod uring;

pub use identity::unmount_if_same;
pub use init::{negotiate_init, negotiate_init_passthrough, InitParams, Negotiated};
pub use legacy::{Layout, LegacyQueue, ReadOutcome};
pub use mount::{
    canonical_mountpoint, clone_fd, open_dev_fuse, unmount, BeforeVisible, Handover, Mount,
    MountConfig,
};
pub use mountinfo::{fuse_mount_at, fusex_mounts, MountEntry, MountIdentity, FUSEX_FSTYPE};
pub use notify::notify_inval_inode;
pub use splice::{SplicePipe, Spliced};
pub use uring::{
    uring_unavailable_reason, Delivered, Fetched, UringLayout, UringQueue, ENABLE_URING_PARAM,
};

use std::io;

/// Errors of the transport, each phrased for the person running fusex.
///
/// A variant that wraps an OS error prints it in its own message and does not also return it as
/// its `source()`: the binary prints the whole chain (`{:#}`), which would name the cause twice.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// `/dev/fuse` does not exist.
    #[error(
        "/dev/fuse is missing: load the fuse module (modprobe fuse) or run where FUSE is available"
    )]
    NoDevFuse,
    /// `/dev/fuse` exists but cannot be opened.
    #[error("cannot open /dev/fuse: {0}")]
    DevFuse(io::Error),
    /// The mountpoint is a directory; fusex exports a single file.
    /// A directory export's mountpoint is not a directory.
    #[error("{0} is not a directory: a directory export is mounted on a directory")]
    MountpointNotDir(String),
    #[error("mountpoint {0} is a directory: give a regular file path (it is created if missing)")]
    MountpointIsDir(String),
    /// The mountpoint's parent directory does not exist.
    #[error("mountpoint {0}: parent directory does not exist: create it first")]
    MountpointParent(String),
    /// The mountpoint is neither a regular file nor missing.
    #[error(
        "mountpoint {0} is not a regular file: give a regular file path (it is created if missing)"
    )]
    MountpointNotFile(String),
    /// The mountpoint changed between fusex's check and the mount (another process replaced the
    /// file, or swapped in a symlink).
    #[error(
        "mountpoint {0} changed while fusex mounted on it (replaced by another file or a \
         symlink): check who else writes its directory, then try again"
    )]
    MountpointChanged(String),
    /// Something is already mounted there.
    #[error("mountpoint {0} is already a FUSE mount: unmount it first (fusex umount {0})")]
    AlreadyMounted(String),
    /// A FUSE mount whose daemon is gone is still there (`ENOTCONN` on the mountpoint).
    #[error(
        "mountpoint {0} is a dead FUSE mount (Transport endpoint is not connected: its daemon is gone): clear it with fusex umount {0} (or umount -l {0}), then mount again"
    )]
    DeadMount(String),
    /// Not allowed to mount.
    #[error("not permitted to mount on {0}: run fusex as root (CAP_SYS_ADMIN)")]
    NotPermitted(String),
    /// Not allowed to mount, and no `fusermount3` to do it instead.
    #[error("not permitted to mount on {0} and fusermount3 is missing: install fuse3 (it provides the set-uid fusermount3), or run fusex as root")]
    NoFusermount(String),
    /// `fusermount3` refused or failed; `what` is its own complaint.
    #[error("fusermount3 could not mount on {path}: {what}; fix that, or run fusex as root")]
    Fusermount {
        /// The mountpoint.
        path: String,
        /// What fusermount3 said (its last line), and why fusex asked it.
        what: String,
    },
    /// `fusermount3 -u` failed (not busy); `what` is its own complaint.
    #[error("fusermount3 could not unmount {path}: {what}; a normal user may unmount only FUSE mounts they made")]
    FusermountUnmount {
        /// The mountpoint.
        path: String,
        /// What fusermount3 said (its last line).
        what: String,
    },
    /// `--allow-other` as a normal user on a system whose /etc/fuse.conf does not permit it.
    #[error("fusermount3 refused --allow-other on {0}: a normal user may use it only when /etc/fuse.conf has a line user_allow_other (add it as root), or drop --allow-other")]
    AllowOtherRefused(String),
    /// mount(2) failed otherwise.
    #[error("mounting on {path} failed: {error}")]
    Mount {
        /// The mountpoint.
        path: String,
        /// What the kernel said.
        error: io::Error,
    },
    /// The mountpoint could not be created.
    #[error("cannot create mountpoint {path}: {error}")]
    CreateMountpoint {
        /// The mountpoint.
        path: String,
        /// What the OS said.
        error: io::Error,
    },
    /// Unmounting failed.
    #[error("unmounting {path} failed: {error}")]
    Unmount {
        /// The mountpoint.
        path: String,
        /// What the kernel said.
        error: io::Error,
    },
    /// `fusex umount` on a path that is not a FUSE mount.
    #[error("{0} is not a FUSE mount: give the file a fusex export is mounted on")]
    NotMounted(String),
    /// `fusex umount` (without `--force`) on a FUSE mount that is not a fusex export.
    #[error("{path} is a FUSE mount of type {fstype} (source {from:?}), not a fusex export: unmount it with its own tool, or add --force to unmount it anyway")]
    NotFusex {
        /// The mountpoint as given.
        path: String,
        /// Its filesystem type from mountinfo (`fuse`, `fuse.sshfs`, ...).
        fstype: String,
        /// Its mount source from mountinfo.
        from: String,
    },
    /// The kernel's INIT was unusable.
    #[error("FUSE INIT failed: {0}")]
    Init(String),
    /// The kernel speaks a protocol we do not.
    #[error("kernel FUSE protocol {major}.{minor} is not supported (need 7.31 or later)")]
    Protocol {
        /// Kernel major version.
        major: u32,
        /// Kernel minor version.
        minor: u32,
    },
    /// I/O on `/dev/fuse` failed.
    #[error("/dev/fuse I/O failed: {0}")]
    Io(io::Error),
}

impl From<io::Error> for TransportError {
    fn from(e: io::Error) -> TransportError {
        TransportError::Io(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The message and its `source()` chain, joined the way the binary prints errors (`{:#}`).
    fn chain(e: &dyn std::error::Error) -> String {
        let mut s = e.to_string();
        let mut cur = e.source();
        while let Some(c) = cur {
            s.push_str(&format!(": {c}"));
            cur = c.source();
        }
        s
    }

    #[test]
    fn os_errors_are_printed_once() {
        let os = || io::Error::from_raw_os_error(libc::EROFS);
        let path = || "/x".to_string();
        for e in [
            TransportError::DevFuse(os()),
            TransportError::Mount {
                path: path(),
                error: os(),
            },
            TransportError::CreateMountpoint {
                path: path(),
                error: os(),
            },
            TransportError::Unmount {
                path: path(),
                error: os(),
            },
            TransportError::Io(os()),
        ] {
            let text = chain(&e);
            assert_eq!(text.matches("(os error 30)").count(), 1, "{text}");
        }
    }
}
