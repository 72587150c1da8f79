//! Request opcodes (`enum fuse_opcode`) of protocol 7.45.

/// One past the largest FUSE opcode below `CUSE_INIT`, so per-opcode counters
/// can be a plain array indexed by `opcode as usize` (check the bound first:
/// `CUSE_INIT` = 4096 and unknown numbers fall outside it).
pub const MAX_OPCODE: usize = 54;

/// Generates the enum, its lookup table and its name table from one list so
/// the three can never disagree.
macro_rules! opcodes {
    ($($(#[$doc:meta])* $variant:ident = $value:literal => $name:literal,)*) => {
        /// A request opcode as found in [`InHeader::opcode`](crate::InHeader).
        ///
        /// The numbers are the kernel's; 7 and 19 were never assigned.
        #[repr(u32)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Opcode {
            $($(#[$doc])* $variant = $value,)*
        }

        impl Opcode {
            /// Every opcode, in ascending numeric order, for iterating counters.
            pub const ALL: &'static [Opcode] = &[$(Opcode::$variant,)*];

            /// Maps a raw opcode number to a known opcode; `None` for numbers
            /// this protocol version does not define.
            pub const fn from_u32(value: u32) -> Option<Opcode> {
                match value {
                    $($value => Some(Opcode::$variant),)*
                    _ => None,
                }
            }

            /// The kernel's name without the `FUSE_` prefix (`"READ"`,
            /// `"CUSE_INIT"`), for logs and statistics keys.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Opcode::$variant => $name,)*
                }
            }
        }
    };
}

opcodes! {
    /// Look up a name in a directory.
    Lookup = 1 => "LOOKUP",
    /// Drop lookup references to a node; never answered.
    Forget = 2 => "FORGET",
    /// Read attributes.
    Getattr = 3 => "GETATTR",
    /// Change attributes (truncate, chmod, utimes, ...).
    Setattr = 4 => "SETATTR",
    /// Read a symlink target.
    Readlink = 5 => "READLINK",
    /// Create a symlink.
    Symlink = 6 => "SYMLINK",
    /// Create a device node or FIFO.
    Mknod = 8 => "MKNOD",
    /// Create a directory.
    Mkdir = 9 => "MKDIR",
    /// Remove a name.
    Unlink = 10 => "UNLINK",
    /// Remove a directory.
    Rmdir = 11 => "RMDIR",
    /// Rename.
    Rename = 12 => "RENAME",
    /// Create a hard link.
    Link = 13 => "LINK",
    /// Open a file.
    Open = 14 => "OPEN",
    /// Read file data.
    Read = 15 => "READ",
    /// Write file data.
    Write = 16 => "WRITE",
    /// Filesystem statistics.
    Statfs = 17 => "STATFS",
    /// Last close of an open file.
    Release = 18 => "RELEASE",
    /// Flush file data (and metadata) to stable storage.
    Fsync = 20 => "FSYNC",
    /// Set an extended attribute.
    Setxattr = 21 => "SETXATTR",
    /// Get an extended attribute.
    Getxattr = 22 => "GETXATTR",
    /// List extended attributes.
    Listxattr = 23 => "LISTXATTR",
    /// Remove an extended attribute.
    Removexattr = 24 => "REMOVEXATTR",
    /// `close(2)` of a file descriptor.
    Flush = 25 => "FLUSH",
    /// Protocol handshake.
    Init = 26 => "INIT",
    /// Open a directory.
    Opendir = 27 => "OPENDIR",
    /// Read directory entries.
    Readdir = 28 => "READDIR",
    /// Close a directory.
    Releasedir = 29 => "RELEASEDIR",
    /// fsync a directory.
    Fsyncdir = 30 => "FSYNCDIR",
    /// Test a POSIX lock.
    Getlk = 31 => "GETLK",
    /// Set a POSIX lock.
    Setlk = 32 => "SETLK",
    /// Set a POSIX lock, waiting.
    Setlkw = 33 => "SETLKW",
    /// `access(2)` check.
    Access = 34 => "ACCESS",
    /// Create and open a file.
    Create = 35 => "CREATE",
    /// Interrupt an earlier request.
    Interrupt = 36 => "INTERRUPT",
    /// Map a file block to a device block.
    Bmap = 37 => "BMAP",
    /// Filesystem is being unmounted.
    Destroy = 38 => "DESTROY",
    /// `ioctl(2)` on a file.
    Ioctl = 39 => "IOCTL",
    /// `poll(2)` on a file.
    Poll = 40 => "POLL",
    /// Answer to a retrieve notification.
    NotifyReply = 41 => "NOTIFY_REPLY",
    /// Several FORGETs in one message; never answered.
    BatchForget = 42 => "BATCH_FORGET",
    /// Preallocate, punch holes, zero ranges.
    Fallocate = 43 => "FALLOCATE",
    /// READDIR with attributes.
    Readdirplus = 44 => "READDIRPLUS",
    /// Rename with flags.
    Rename2 = 45 => "RENAME2",
    /// `lseek(2)` with `SEEK_DATA` / `SEEK_HOLE`.
    Lseek = 46 => "LSEEK",
    /// Server-side copy, 32-bit result.
    CopyFileRange = 47 => "COPY_FILE_RANGE",
    /// DAX: map a file range.
    SetupMapping = 48 => "SETUPMAPPING",
    /// DAX: unmap file ranges.
    RemoveMapping = 49 => "REMOVEMAPPING",
    /// `syncfs(2)`.
    Syncfs = 50 => "SYNCFS",
    /// Create an unnamed temporary file.
    Tmpfile = 51 => "TMPFILE",
    /// Extended attributes (`statx(2)`).
    Statx = 52 => "STATX",
    /// Server-side copy, 64-bit result (7.45).
    CopyFileRange64 = 53 => "COPY_FILE_RANGE_64",
    /// CUSE handshake (character devices in userspace).
    CuseInit = 4096 => "CUSE_INIT",
}

impl Opcode {
    /// Whether the kernel waits for a reply; FORGET and BATCH_FORGET must not
    /// be answered.
    pub const fn has_reply(self) -> bool {
        !matches!(self, Opcode::Forget | Opcode::BatchForget)
    }
}

// MAX_OPCODE must cover every FUSE opcode and nothing beyond the largest one.
const _: () = {
    let mut i = 0;
    let mut max = 0;
    while i < Opcode::ALL.len() {
        let v = Opcode::ALL[i] as u32;
        if v < 4096 && v > max {
            max = v;
        }
        i += 1;
    }
    assert!(max as usize + 1 == MAX_OPCODE);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_all() {
        for &op in Opcode::ALL {
            assert_eq!(Opcode::from_u32(op as u32), Some(op));
            assert!(!op.name().is_empty());
        }
        assert_eq!(Opcode::ALL.len(), 52);
    }

    #[test]
    fn ascending_and_unique() {
        for w in Opcode::ALL.windows(2) {
            assert!((w[0] as u32) < (w[1] as u32));
        }
    }

    #[test]
    fn known_values() {
        assert_eq!(Opcode::Lookup as u32, 1);
        assert_eq!(Opcode::Read as u32, 15);
        assert_eq!(Opcode::Write as u32, 16);
        assert_eq!(Opcode::Init as u32, 26);
        assert_eq!(Opcode::Lseek as u32, 46);
        assert_eq!(Opcode::Statx as u32, 52);
        assert_eq!(Opcode::CopyFileRange64 as u32, 53);
        assert_eq!(Opcode::CuseInit as u32, 4096);
        assert_eq!(Opcode::Read.name(), "READ");
        assert_eq!(Opcode::BatchForget.name(), "BATCH_FORGET");
    }

    #[test]
    fn gaps_and_unknown() {
        for v in [0, 7, 19, 54, 4095, 4097, u32::MAX] {
            assert_eq!(Opcode::from_u32(v), None);
        }
    }

    #[test]
    fn counters_fit() {
        for &op in Opcode::ALL {
            if op != Opcode::CuseInit {
                assert!((op as usize) < MAX_OPCODE);
            }
        }
    }

    #[test]
    fn no_reply_ops() {
        assert!(!Opcode::Forget.has_reply());
        assert!(!Opcode::BatchForget.has_reply());
        assert!(Opcode::Read.has_reply());
    }
}
