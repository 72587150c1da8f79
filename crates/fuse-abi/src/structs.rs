//! `#[repr(C)]` request and reply structs of protocol 7.45.
//!
//! Field names follow the kernel's `include/uapi/linux/fuse.h`. All integers are
//! in native byte order (the kernel and server share a machine). Padding is
//! spelled out as named fields so `IntoBytes` can be derived and replies never
//! leak uninitialised bytes. Every size and every field offset is pinned below
//! each struct with a compile-time assertion.

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Pins a struct's size and each listed field's offset at compile time.
macro_rules! assert_layout {
    ($t:ty, $size:expr, { $($field:ident : $off:expr),* $(,)? }) => {
        const _: () = {
            assert!(core::mem::size_of::<$t>() == $size);
            $(assert!(core::mem::offset_of!($t, $field) == $off);)*
        };
    };
}

/// Header in front of every request the kernel sends (`fuse_in_header`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct InHeader {
    /// Total request length in bytes, this header included.
    pub len: u32,
    /// Raw opcode; see [`Opcode::from_u32`](crate::Opcode::from_u32).
    pub opcode: u32,
    /// Request id; the reply must carry the same value.
    pub unique: u64,
    /// Node the request is about (1 = root = the exported file).
    pub nodeid: u64,
    /// Caller's effective uid.
    pub uid: u32,
    /// Caller's effective gid.
    pub gid: u32,
    /// Caller's thread-group id.
    pub pid: u32,
    /// Length of trailing extensions, in 8-byte units.
    pub total_extlen: u16,
    /// Unused.
    pub padding: u16,
}
assert_layout!(InHeader, 40, {
    len: 0, opcode: 4, unique: 8, nodeid: 16, uid: 24, gid: 28, pid: 32,
    total_extlen: 36, padding: 38,
});

/// Header in front of every reply the server writes (`fuse_out_header`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct OutHeader {
    /// Total reply length in bytes, this header included.
    pub len: u32,
    /// 0 on success, otherwise a negated errno (and no payload).
    pub error: i32,
    /// The `unique` of the request being answered.
    pub unique: u64,
}
assert_layout!(OutHeader, 16, { len: 0, error: 4, unique: 8 });

/// File attributes as the kernel caches them (`fuse_attr`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct Attr {
    /// Inode number shown by `stat`.
    pub ino: u64,
    /// Size in bytes.
    pub size: u64,
    /// Allocated 512-byte blocks.
    pub blocks: u64,
    /// Access time, seconds.
    pub atime: u64,
    /// Modification time, seconds.
    pub mtime: u64,
    /// Change time, seconds.
    pub ctime: u64,
    /// Access time, nanoseconds.
    pub atimensec: u32,
    /// Modification time, nanoseconds.
    pub mtimensec: u32,
    /// Change time, nanoseconds.
    pub ctimensec: u32,
    /// File type and permission bits (`st_mode`).
    pub mode: u32,
    /// Link count.
    pub nlink: u32,
    /// Owner uid.
    pub uid: u32,
    /// Owner gid.
    pub gid: u32,
    /// Device number for device nodes.
    pub rdev: u32,
    /// Preferred I/O size (`st_blksize`).
    pub blksize: u32,
    /// `FUSE_ATTR_*` flags.
    pub flags: u32,
}
assert_layout!(Attr, 88, {
    ino: 0, size: 8, blocks: 16, atime: 24, mtime: 32, ctime: 40,
    atimensec: 48, mtimensec: 52, ctimensec: 56, mode: 60, nlink: 64,
    uid: 68, gid: 72, rdev: 76, blksize: 80, flags: 84,
});

/// Reply to GETATTR and SETATTR (`fuse_attr_out`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct AttrOut {
    /// How long the kernel may cache `attr`, seconds.
    pub attr_valid: u64,
    /// How long the kernel may cache `attr`, nanoseconds.
    pub attr_valid_nsec: u32,
    /// Unused.
    pub dummy: u32,
    /// The attributes.
    pub attr: Attr,
}
assert_layout!(AttrOut, 104, { attr_valid: 0, attr_valid_nsec: 8, dummy: 12, attr: 16 });

/// Reply to LOOKUP and the create family (`fuse_entry_out`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct EntryOut {
    /// Node id of the entry (0 = negative entry).
    pub nodeid: u64,
    /// Generation; `(nodeid, generation)` must be unique for the mount's life.
    pub generation: u64,
    /// How long the kernel may cache the name, seconds.
    pub entry_valid: u64,
    /// How long the kernel may cache `attr`, seconds.
    pub attr_valid: u64,
    /// Name cache timeout, nanoseconds.
    pub entry_valid_nsec: u32,
    /// Attribute cache timeout, nanoseconds.
    pub attr_valid_nsec: u32,
    /// The entry's attributes.
    pub attr: Attr,
}
assert_layout!(EntryOut, 128, {
    nodeid: 0, generation: 8, entry_valid: 16, attr_valid: 24,
    entry_valid_nsec: 32, attr_valid_nsec: 36, attr: 40,
});

/// Size of `fuse_init_in` before protocol 7.36 added `flags2` (major, minor,
/// max_readahead, flags); INIT requests this short are still accepted.
pub const INIT_IN_COMPAT_SIZE: usize = 16;

/// INIT request: what the kernel offers (`fuse_init_in`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct InitIn {
    /// Kernel's major protocol version.
    pub major: u32,
    /// Kernel's minor protocol version.
    pub minor: u32,
    /// Kernel's readahead limit, bytes.
    pub max_readahead: u32,
    /// INIT flags the kernel supports, bits 0..31.
    pub flags: u32,
    /// INIT flags the kernel supports, bits 32..63 (valid with `FUSE_INIT_EXT`).
    pub flags2: u32,
    /// Reserved.
    pub unused: [u32; 11],
}
assert_layout!(InitIn, 64, {
    major: 0, minor: 4, max_readahead: 8, flags: 12, flags2: 16, unused: 20,
});

impl InitIn {
    /// The offered INIT flags as one 64-bit set (`flags2` only counts when the
    /// kernel also sets `FUSE_INIT_EXT`).
    pub const fn all_flags(&self) -> u64 {
        let low = self.flags as u64;
        if low & crate::flags::FUSE_INIT_EXT != 0 {
            crate::flags::join_init_flags(self.flags, self.flags2)
        } else {
            low
        }
    }
}

/// INIT reply: what the server accepts (`fuse_init_out`, 7.45 layout).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct InitOut {
    /// Server's major version (must match the kernel's to proceed).
    pub major: u32,
    /// Server's minor version; the connection uses the smaller of the two.
    pub minor: u32,
    /// Readahead limit, bytes (at most the kernel's).
    pub max_readahead: u32,
    /// Accepted INIT flags, bits 0..31.
    pub flags: u32,
    /// Maximum background (async) requests.
    pub max_background: u16,
    /// Background requests at which the kernel reports congestion.
    pub congestion_threshold: u16,
    /// Largest WRITE payload, bytes.
    pub max_write: u32,
    /// Timestamp granularity, nanoseconds.
    pub time_gran: u32,
    /// Largest request in pages (with `FUSE_MAX_PAGES`).
    pub max_pages: u16,
    /// DAX mapping alignment, log2 bytes.
    pub map_alignment: u16,
    /// Accepted INIT flags, bits 32..63 (with `FUSE_INIT_EXT`).
    pub flags2: u32,
    /// Backing-file stack depth for passthrough (1 or 2).
    pub max_stack_depth: u32,
    /// Request timeout, seconds (with `FUSE_REQUEST_TIMEOUT`); 0 asks for none. The kernel
    /// caps it at the `fs.fuse.max_request_timeout` sysctl when that is set, uses
    /// `fs.fuse.default_request_timeout` when it is 0, raises anything below 15 s to 15 s and
    /// checks every 15 s, so a stuck request is noticed between `timeout` and `timeout + 15` s
    /// after it was queued. On expiry the connection is aborted, as by a forced unmount.
    pub request_timeout: u16,
    /// Reserved; must be zero.
    pub unused: [u16; 11],
}
assert_layout!(InitOut, 64, {
    major: 0, minor: 4, max_readahead: 8, flags: 12, max_background: 16,
    congestion_threshold: 18, max_write: 20, time_gran: 24, max_pages: 28,
    map_alignment: 30, flags2: 32, max_stack_depth: 36, request_timeout: 40,
    unused: 42,
});

impl InitOut {
    /// Stores a 64-bit INIT flag set into `flags` and `flags2`.
    pub fn set_all_flags(&mut self, all: u64) {
        let (flags, flags2) = crate::flags::split_init_flags(all);
        self.flags = flags;
        self.flags2 = flags2;
    }
}

/// GETATTR request (`fuse_getattr_in`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct GetattrIn {
    /// `FUSE_GETATTR_*` flags.
    pub getattr_flags: u32,
    /// Unused.
    pub dummy: u32,
    /// File handle, valid with `FUSE_GETATTR_FH`.
    pub fh: u64,
}
assert_layout!(GetattrIn, 16, { getattr_flags: 0, dummy: 4, fh: 8 });

/// SETATTR request (`fuse_setattr_in`); `valid` says which fields count.
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct SetattrIn {
    /// `FATTR_*` bits naming the fields to change.
    pub valid: u32,
    /// Unused.
    pub padding: u32,
    /// File handle (with `FATTR_FH`).
    pub fh: u64,
    /// New size (with `FATTR_SIZE`).
    pub size: u64,
    /// Lock owner (with `FATTR_LOCKOWNER`).
    pub lock_owner: u64,
    /// New atime, seconds.
    pub atime: u64,
    /// New mtime, seconds.
    pub mtime: u64,
    /// New ctime, seconds.
    pub ctime: u64,
    /// New atime, nanoseconds.
    pub atimensec: u32,
    /// New mtime, nanoseconds.
    pub mtimensec: u32,
    /// New ctime, nanoseconds.
    pub ctimensec: u32,
    /// New mode.
    pub mode: u32,
    /// Unused.
    pub unused4: u32,
    /// New owner uid.
    pub uid: u32,
    /// New owner gid.
    pub gid: u32,
    /// Unused.
    pub unused5: u32,
}
assert_layout!(SetattrIn, 88, {
    valid: 0, padding: 4, fh: 8, size: 16, lock_owner: 24, atime: 32,
    mtime: 40, ctime: 48, atimensec: 56, mtimensec: 60, ctimensec: 64,
    mode: 68, unused4: 72, uid: 76, gid: 80, unused5: 84,
});

/// OPEN request (`fuse_open_in`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct OpenIn {
    /// `open(2)` flags (`O_RDONLY`, `O_WRONLY`, ...), creation flags removed.
    pub flags: u32,
    /// `FUSE_OPEN_*` flags.
    pub open_flags: u32,
}
assert_layout!(OpenIn, 8, { flags: 0, open_flags: 4 });

/// OPEN reply (`fuse_open_out`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct OpenOut {
    /// Server-chosen file handle, echoed in later requests.
    pub fh: u64,
    /// `FOPEN_*` flags.
    pub open_flags: u32,
    /// Backing file id from `FUSE_DEV_IOC_BACKING_OPEN` (with `FOPEN_PASSTHROUGH`).
    pub backing_id: i32,
}
assert_layout!(OpenOut, 16, { fh: 0, open_flags: 8, backing_id: 12 });

/// RELEASE request (`fuse_release_in`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct ReleaseIn {
    /// File handle from OPEN.
    pub fh: u64,
    /// `open(2)` flags of the file.
    pub flags: u32,
    /// `FUSE_RELEASE_*` flags.
    pub release_flags: u32,
    /// Lock owner.
    pub lock_owner: u64,
}
assert_layout!(ReleaseIn, 24, { fh: 0, flags: 8, release_flags: 12, lock_owner: 16 });

/// FLUSH request (`fuse_flush_in`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct FlushIn {
    /// File handle from OPEN.
    pub fh: u64,
    /// Unused.
    pub unused: u32,
    /// Unused.
    pub padding: u32,
    /// Lock owner.
    pub lock_owner: u64,
}
assert_layout!(FlushIn, 24, { fh: 0, unused: 8, padding: 12, lock_owner: 16 });

/// READ request (`fuse_read_in`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct ReadIn {
    /// File handle from OPEN.
    pub fh: u64,
    /// Byte offset.
    pub offset: u64,
    /// Bytes wanted.
    pub size: u32,
    /// `FUSE_READ_*` flags.
    pub read_flags: u32,
    /// Lock owner (with `FUSE_READ_LOCKOWNER`).
    pub lock_owner: u64,
    /// `open(2)` flags of the file.
    pub flags: u32,
    /// Unused.
    pub padding: u32,
}
assert_layout!(ReadIn, 40, {
    fh: 0, offset: 8, size: 16, read_flags: 20, lock_owner: 24, flags: 32, padding: 36,
});

/// WRITE request (`fuse_write_in`); `size` bytes of data follow it.
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct WriteIn {
    /// File handle from OPEN.
    pub fh: u64,
    /// Byte offset.
    pub offset: u64,
    /// Bytes of data that follow.
    pub size: u32,
    /// `FUSE_WRITE_*` flags.
    pub write_flags: u32,
    /// Lock owner (with `FUSE_WRITE_LOCKOWNER`).
    pub lock_owner: u64,
    /// `open(2)` flags of the file.
    pub flags: u32,
    /// Unused.
    pub padding: u32,
}
assert_layout!(WriteIn, 40, {
    fh: 0, offset: 8, size: 16, write_flags: 20, lock_owner: 24, flags: 32, padding: 36,
});

/// WRITE reply (`fuse_write_out`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct WriteOut {
    /// Bytes written.
    pub size: u32,
    /// Unused.
    pub padding: u32,
}
assert_layout!(WriteOut, 8, { size: 0, padding: 4 });

/// FSYNC request (`fuse_fsync_in`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct FsyncIn {
    /// File handle from OPEN.
    pub fh: u64,
    /// `FUSE_FSYNC_*` flags.
    pub fsync_flags: u32,
    /// Unused.
    pub padding: u32,
}
assert_layout!(FsyncIn, 16, { fh: 0, fsync_flags: 8, padding: 12 });

/// FALLOCATE request (`fuse_fallocate_in`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct FallocateIn {
    /// File handle from OPEN.
    pub fh: u64,
    /// Start of the range.
    pub offset: u64,
    /// Length of the range.
    pub length: u64,
    /// `FALLOC_FL_*` mode bits.
    pub mode: u32,
    /// Unused.
    pub padding: u32,
}
assert_layout!(FallocateIn, 32, { fh: 0, offset: 8, length: 16, mode: 24, padding: 28 });

/// LSEEK request (`fuse_lseek_in`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct LseekIn {
    /// File handle from OPEN.
    pub fh: u64,
    /// Starting offset.
    pub offset: u64,
    /// `SEEK_*` value (the kernel only forwards `SEEK_DATA` and `SEEK_HOLE`).
    pub whence: u32,
    /// Unused.
    pub padding: u32,
}
assert_layout!(LseekIn, 24, { fh: 0, offset: 8, whence: 16, padding: 20 });

/// LSEEK reply (`fuse_lseek_out`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct LseekOut {
    /// Resulting offset.
    pub offset: u64,
}
assert_layout!(LseekOut, 8, { offset: 0 });

/// Filesystem statistics (`fuse_kstatfs`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct Kstatfs {
    /// Total blocks of `frsize` bytes.
    pub blocks: u64,
    /// Free blocks.
    pub bfree: u64,
    /// Free blocks available to unprivileged users.
    pub bavail: u64,
    /// Total inodes.
    pub files: u64,
    /// Free inodes.
    pub ffree: u64,
    /// Preferred block size.
    pub bsize: u32,
    /// Maximum name length.
    pub namelen: u32,
    /// Fragment size (unit of `blocks`).
    pub frsize: u32,
    /// Unused.
    pub padding: u32,
    /// Reserved.
    pub spare: [u32; 6],
}
assert_layout!(Kstatfs, 80, {
    blocks: 0, bfree: 8, bavail: 16, files: 24, ffree: 32, bsize: 40,
    namelen: 44, frsize: 48, padding: 52, spare: 56,
});

/// STATFS reply (`fuse_statfs_out`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct StatfsOut {
    /// The statistics.
    pub st: Kstatfs,
}
assert_layout!(StatfsOut, 80, { st: 0 });

/// INTERRUPT request (`fuse_interrupt_in`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct InterruptIn {
    /// `unique` of the request to interrupt.
    pub unique: u64,
}
assert_layout!(InterruptIn, 8, { unique: 0 });

/// FORGET request (`fuse_forget_in`); the node is `InHeader::nodeid`.
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct ForgetIn {
    /// Lookup references dropped.
    pub nlookup: u64,
}
assert_layout!(ForgetIn, 8, { nlookup: 0 });

/// BATCH_FORGET request head (`fuse_batch_forget_in`); `count` [`ForgetOne`]
/// entries follow.
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct BatchForgetIn {
    /// Number of entries that follow.
    pub count: u32,
    /// Unused.
    pub dummy: u32,
}
assert_layout!(BatchForgetIn, 8, { count: 0, dummy: 4 });

/// One BATCH_FORGET entry (`fuse_forget_one`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct ForgetOne {
    /// Node whose references are dropped.
    pub nodeid: u64,
    /// Lookup references dropped.
    pub nlookup: u64,
}
assert_layout!(ForgetOne, 16, { nodeid: 0, nlookup: 8 });

/// Header of one request extension (`fuse_ext_header`); extensions occupy the
/// last `InHeader::total_extlen * 8` bytes of a request.
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct ExtHeader {
    /// Size of this extension, header included.
    pub size: u32,
    /// Extension type (`FUSE_EXT_*`).
    pub ext_type: u32,
}
assert_layout!(ExtHeader, 8, { size: 0, ext_type: 4 });

/// Derives the traits every plain ABI struct has.
macro_rules! abi_struct {
    ($(#[$doc:meta])* pub struct $name:ident { $($(#[$fdoc:meta])* pub $field:ident : $ty:ty,)* }) => {
        $(#[$doc])*
        #[repr(C)]
        #[derive(
            Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
        )]
        pub struct $name { $($(#[$fdoc])* pub $field: $ty,)* }
    };
}

abi_struct! {
    /// MKNOD request head (`fuse_mknod_in`); the new name follows, NUL-terminated.
    pub struct MknodIn {
        /// File type and permission bits.
        pub mode: u32,
        /// Device number (character and block devices).
        pub rdev: u32,
        /// The caller's umask (applied by the server with `FUSE_DONT_MASK`).
        pub umask: u32,
        /// Unused.
        pub padding: u32,
    }
}
assert_layout!(MknodIn, 16, { mode: 0, rdev: 4, umask: 8, padding: 12 });

abi_struct! {
    /// MKDIR request head (`fuse_mkdir_in`); the new name follows, NUL-terminated.
    pub struct MkdirIn {
        /// Permission bits (the kernel adds nothing else).
        pub mode: u32,
        /// The caller's umask (applied by the server with `FUSE_DONT_MASK`).
        pub umask: u32,
    }
}
assert_layout!(MkdirIn, 8, { mode: 0, umask: 4 });

abi_struct! {
    /// RENAME request head (`fuse_rename_in`); old and new names follow, each NUL-terminated.
    pub struct RenameIn {
        /// Node of the directory the entry moves into.
        pub newdir: u64,
    }
}
assert_layout!(RenameIn, 8, { newdir: 0 });

abi_struct! {
    /// RENAME2 request head (`fuse_rename2_in`); old and new names follow.
    pub struct Rename2In {
        /// Node of the directory the entry moves into.
        pub newdir: u64,
        /// `RENAME_NOREPLACE`, `RENAME_EXCHANGE`, `RENAME_WHITEOUT`.
        pub flags: u32,
        /// Unused.
        pub padding: u32,
    }
}
assert_layout!(Rename2In, 16, { newdir: 0, flags: 8, padding: 12 });

abi_struct! {
    /// LINK request head (`fuse_link_in`); the new name follows. The header's node is the
    /// directory the link goes into.
    pub struct LinkIn {
        /// Node being linked.
        pub oldnodeid: u64,
    }
}
assert_layout!(LinkIn, 8, { oldnodeid: 0 });

abi_struct! {
    /// CREATE (and TMPFILE) request head (`fuse_create_in`); the new name follows.
    pub struct CreateIn {
        /// `open(2)` flags.
        pub flags: u32,
        /// File type and permission bits.
        pub mode: u32,
        /// The caller's umask (applied by the server with `FUSE_DONT_MASK`).
        pub umask: u32,
        /// `FUSE_OPEN_*` flags.
        pub open_flags: u32,
    }
}
assert_layout!(CreateIn, 16, { flags: 0, mode: 4, umask: 8, open_flags: 12 });

abi_struct! {
    /// SETXATTR request head (`fuse_setxattr_in`); the name (NUL-terminated) and `size` bytes of
    /// value follow. Without `FUSE_SETXATTR_EXT` the kernel sends only the first
    /// [`SETXATTR_IN_COMPAT_SIZE`] bytes (the decoder zero-fills the rest).
    pub struct SetxattrIn {
        /// Bytes of value.
        pub size: u32,
        /// `XATTR_CREATE` / `XATTR_REPLACE`.
        pub flags: u32,
        /// `FUSE_SETXATTR_ACL_KILL_SGID` (with `FUSE_SETXATTR_EXT` only).
        pub setxattr_flags: u32,
        /// Unused.
        pub padding: u32,
    }
}
assert_layout!(SetxattrIn, 16, { size: 0, flags: 4, setxattr_flags: 8, padding: 12 });

/// Bytes of [`SetxattrIn`] a kernel sends without `FUSE_SETXATTR_EXT`
/// (`FUSE_COMPAT_SETXATTR_IN_SIZE`).
pub const SETXATTR_IN_COMPAT_SIZE: usize = 8;

abi_struct! {
    /// COPY_FILE_RANGE and COPY_FILE_RANGE_64 request (`fuse_copy_file_range_in`); the header's
    /// node is the source file.
    pub struct CopyFileRangeIn {
        /// Handle of the source file.
        pub fh_in: u64,
        /// Offset in the source.
        pub off_in: u64,
        /// Node of the destination file.
        pub nodeid_out: u64,
        /// Handle of the destination file.
        pub fh_out: u64,
        /// Offset in the destination.
        pub off_out: u64,
        /// Bytes to copy.
        pub len: u64,
        /// `copy_file_range(2)` flags (0).
        pub flags: u64,
    }
}
assert_layout!(CopyFileRangeIn, 56, {
    fh_in: 0, off_in: 8, nodeid_out: 16, fh_out: 24, off_out: 32, len: 40, flags: 48,
});

abi_struct! {
    /// COPY_FILE_RANGE_64 reply (`fuse_copy_file_range_out`); COPY_FILE_RANGE answers with a
    /// [`WriteOut`] instead, whose 32-bit count cannot say more than 4 GiB.
    pub struct CopyFileRangeOut {
        /// Bytes copied.
        pub bytes_copied: u64,
    }
}
assert_layout!(CopyFileRangeOut, 8, { bytes_copied: 0 });

abi_struct! {
    /// STATX request (`fuse_statx_in`).
    pub struct StatxIn {
        /// `FUSE_GETATTR_FH`: `fh` is an open handle of the node.
        pub getattr_flags: u32,
        /// Unused.
        pub reserved: u32,
        /// The handle, with `FUSE_GETATTR_FH`.
        pub fh: u64,
        /// `statx(2)` flags: `AT_STATX_FORCE_SYNC` / `AT_STATX_DONT_SYNC`.
        pub sx_flags: u32,
        /// `STATX_*` fields asked for.
        pub sx_mask: u32,
    }
}
assert_layout!(StatxIn, 24, { getattr_flags: 0, reserved: 4, fh: 8, sx_flags: 16, sx_mask: 20 });

abi_struct! {
    /// A `statx(2)` timestamp (`fuse_sx_time`, laid out as `struct statx_timestamp`).
    pub struct SxTime {
        /// Seconds since the epoch.
        pub tv_sec: i64,
        /// Nanoseconds.
        pub tv_nsec: u32,
        /// Unused.
        pub reserved: i32,
    }
}
assert_layout!(SxTime, 16, { tv_sec: 0, tv_nsec: 8, reserved: 12 });

abi_struct! {
    /// Extended attributes (`fuse_statx`): `struct statx` up to `stx_dev_minor`, the rest
    /// spare.
    pub struct Statx {
        /// `STATX_*` fields filled in.
        pub mask: u32,
        /// Preferred I/O size.
        pub blksize: u32,
        /// `STATX_ATTR_*` flags.
        pub attributes: u64,
        /// Hard links.
        pub nlink: u32,
        /// Owner.
        pub uid: u32,
        /// Group.
        pub gid: u32,
        /// Type and permission bits.
        pub mode: u16,
        /// Unused.
        pub spare0: u16,
        /// Inode number.
        pub ino: u64,
        /// Size in bytes.
        pub size: u64,
        /// 512-byte blocks allocated.
        pub blocks: u64,
        /// Which `attributes` bits the filesystem supports.
        pub attributes_mask: u64,
        /// Last access.
        pub atime: SxTime,
        /// Creation (birth).
        pub btime: SxTime,
        /// Last status change.
        pub ctime: SxTime,
        /// Last modification.
        pub mtime: SxTime,
        /// Device number, major (device nodes).
        pub rdev_major: u32,
        /// Device number, minor.
        pub rdev_minor: u32,
        /// Containing device, major.
        pub dev_major: u32,
        /// Containing device, minor.
        pub dev_minor: u32,
        /// Unused.
        pub spare2: [u64; 14],
    }
}
assert_layout!(Statx, 256, {
    mask: 0, blksize: 4, attributes: 8, nlink: 16, uid: 20, gid: 24, mode: 28, spare0: 30,
    ino: 32, size: 40, blocks: 48, attributes_mask: 56, atime: 64, btime: 80, ctime: 96,
    mtime: 112, rdev_major: 128, rdev_minor: 132, dev_major: 136, dev_minor: 140, spare2: 144,
});

abi_struct! {
    /// STATX reply (`fuse_statx_out`).
    pub struct StatxOut {
        /// How long the kernel may cache the attributes, seconds.
        pub attr_valid: u64,
        /// Nanoseconds of the same.
        pub attr_valid_nsec: u32,
        /// Unused (no flags are defined).
        pub flags: u32,
        /// Unused.
        pub spare: [u64; 2],
        /// The attributes.
        pub stat: Statx,
    }
}
assert_layout!(StatxOut, 288, { attr_valid: 0, attr_valid_nsec: 8, flags: 12, spare: 16, stat: 32 });

abi_struct! {
    /// GETXATTR and LISTXATTR request head (`fuse_getxattr_in`); GETXATTR's name follows.
    pub struct GetxattrIn {
        /// Room the caller has for the value (0: asks for its size).
        pub size: u32,
        /// Unused.
        pub padding: u32,
    }
}
assert_layout!(GetxattrIn, 8, { size: 0, padding: 4 });

abi_struct! {
    /// GETXATTR / LISTXATTR reply when the request's size was 0 (`fuse_getxattr_out`).
    pub struct GetxattrOut {
        /// Bytes the value (or the name list) takes.
        pub size: u32,
        /// Unused.
        pub padding: u32,
    }
}
assert_layout!(GetxattrOut, 8, { size: 0, padding: 4 });

abi_struct! {
    /// ACCESS request (`fuse_access_in`).
    pub struct AccessIn {
        /// `R_OK`, `W_OK`, `X_OK` bits (`F_OK` is 0).
        pub mask: u32,
        /// Unused.
        pub padding: u32,
    }
}
assert_layout!(AccessIn, 8, { mask: 0, padding: 4 });

abi_struct! {
    /// Head of one READDIR entry (`fuse_dirent`); `namelen` name bytes follow, then zero
    /// padding to a multiple of 8 ([`dirent_size`]).
    pub struct Dirent {
        /// Inode number.
        pub ino: u64,
        /// Offset to resume reading after this entry.
        pub off: u64,
        /// Bytes of name.
        pub namelen: u32,
        /// File type (`DT_*`, i.e. `st_mode >> 12`).
        pub typ: u32,
    }
}
assert_layout!(Dirent, 24, { ino: 0, off: 8, namelen: 16, typ: 20 });

/// Bytes one READDIR entry with a name of `namelen` bytes takes (`FUSE_DIRENT_SIZE`).
pub const fn dirent_size(namelen: usize) -> usize {
    (core::mem::size_of::<Dirent>() + namelen + 7) & !7
}

/// Bytes one READDIRPLUS entry with a name of `namelen` bytes takes (`FUSE_DIRENTPLUS_SIZE`):
/// an [`EntryOut`], then a [`Dirent`] with its name, padded to 8.
pub const fn direntplus_size(namelen: usize) -> usize {
    (core::mem::size_of::<EntryOut>() + core::mem::size_of::<Dirent>() + namelen + 7) & !7
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flags::*;

    #[test]
    fn init_flags_helpers() {
        let mut out = InitOut::default();
        out.set_all_flags(FUSE_ASYNC_READ | FUSE_INIT_EXT | FUSE_OVER_IO_URING);
        assert_eq!(out.flags, (FUSE_ASYNC_READ | FUSE_INIT_EXT) as u32);
        assert_eq!(out.flags2, 1 << 9);

        let mut inp = InitIn {
            flags: FUSE_INIT_EXT as u32,
            flags2: 1 << 5,
            ..Default::default()
        };
        assert_eq!(inp.all_flags(), FUSE_INIT_EXT | FUSE_PASSTHROUGH);
        inp.flags = 0;
        assert_eq!(inp.all_flags(), 0, "flags2 ignored without INIT_EXT");
    }

    #[test]
    fn reply_bytes_are_exact() {
        let out = OpenOut {
            fh: 7,
            open_flags: FOPEN_DIRECT_IO,
            backing_id: -2,
        };
        let b = out.as_bytes();
        assert_eq!(&b[0..8], &7u64.to_ne_bytes());
        assert_eq!(&b[8..12], &1u32.to_ne_bytes());
        assert_eq!(&b[12..16], &(-2i32).to_ne_bytes());
    }
}

/// `fuse_notify_code` value of an inode invalidation: the server tells the kernel to drop the
/// attributes (and, from `off`, the cached pages) of a node it has cached.
pub const FUSE_NOTIFY_INVAL_INODE: i32 = 2;

/// Body of a `FUSE_NOTIFY_INVAL_INODE` message (`fuse_notify_inval_inode_out`), written to
/// `/dev/fuse` after an [`OutHeader`] whose `unique` is 0 and whose `error` is the notify code.
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct NotifyInvalInodeOut {
    /// The node (1: the exported file).
    pub ino: u64,
    /// First byte of cached data to drop; negative: drop only the attributes.
    pub off: i64,
    /// Bytes of cached data to drop from `off`; 0 or less: to the end.
    pub len: i64,
}
assert_layout!(NotifyInvalInodeOut, 24, { ino: 0, off: 8, len: 16 });
