//! Flag bits carried in requests and replies, under their kernel names.
//!
//! INIT flags are `u64`: bits 0..31 travel in `flags`, bits 32..63 in `flags2`
//! (only when [`FUSE_INIT_EXT`] is negotiated). Use [`split_init_flags`] and
//! [`join_init_flags`] to move between the two forms.

// ---------------------------------------------------------------- INIT flags

/// Kernel may issue several READs of one file at once.
pub const FUSE_ASYNC_READ: u64 = 1 << 0;
/// Server implements POSIX locks (GETLK/SETLK).
pub const FUSE_POSIX_LOCKS: u64 = 1 << 1;
/// Reserved by the kernel; never set.
pub const FUSE_FILE_OPS: u64 = 1 << 2;
/// Server handles `O_TRUNC` inside OPEN.
pub const FUSE_ATOMIC_O_TRUNC: u64 = 1 << 3;
/// Server answers LOOKUP of "." and "..".
pub const FUSE_EXPORT_SUPPORT: u64 = 1 << 4;
/// Server accepts WRITEs larger than one page.
pub const FUSE_BIG_WRITES: u64 = 1 << 5;
/// Kernel does not apply the umask on create.
pub const FUSE_DONT_MASK: u64 = 1 << 6;
/// Kernel may splice write data to the device.
pub const FUSE_SPLICE_WRITE: u64 = 1 << 7;
/// Kernel may move pages when splicing.
pub const FUSE_SPLICE_MOVE: u64 = 1 << 8;
/// Kernel may splice read data from the device.
pub const FUSE_SPLICE_READ: u64 = 1 << 9;
/// Server implements BSD `flock` locks.
pub const FUSE_FLOCK_LOCKS: u64 = 1 << 10;
/// Kernel supports ioctl on directories.
pub const FUSE_HAS_IOCTL_DIR: u64 = 1 << 11;
/// Kernel invalidates cached pages when attributes change.
pub const FUSE_AUTO_INVAL_DATA: u64 = 1 << 12;
/// Server implements READDIRPLUS.
pub const FUSE_DO_READDIRPLUS: u64 = 1 << 13;
/// Kernel chooses between READDIR and READDIRPLUS adaptively.
pub const FUSE_READDIRPLUS_AUTO: u64 = 1 << 14;
/// Kernel submits direct I/O asynchronously (several requests in flight).
pub const FUSE_ASYNC_DIO: u64 = 1 << 15;
/// Kernel caches writes and writes them back later.
pub const FUSE_WRITEBACK_CACHE: u64 = 1 << 16;
/// Server may answer OPEN with ENOSYS to mean "no open needed".
pub const FUSE_NO_OPEN_SUPPORT: u64 = 1 << 17;
/// Kernel may run LOOKUP/READDIR of one directory in parallel.
pub const FUSE_PARALLEL_DIROPS: u64 = 1 << 18;
/// Server clears suid/sgid/caps itself (v1 semantics).
pub const FUSE_HANDLE_KILLPRIV: u64 = 1 << 19;
/// Server supports POSIX ACLs.
pub const FUSE_POSIX_ACL: u64 = 1 << 20;
/// Reading the device after an abort yields ECONNABORTED.
pub const FUSE_ABORT_ERROR: u64 = 1 << 21;
/// `InitOut::max_pages` is valid.
pub const FUSE_MAX_PAGES: u64 = 1 << 22;
/// Kernel caches READLINK results.
pub const FUSE_CACHE_SYMLINKS: u64 = 1 << 23;
/// Server may answer OPENDIR with ENOSYS to mean "no opendir needed".
pub const FUSE_NO_OPENDIR_SUPPORT: u64 = 1 << 24;
/// Kernel invalidates cached pages only when told to.
pub const FUSE_EXPLICIT_INVAL_DATA: u64 = 1 << 25;
/// `InitOut::map_alignment` is valid (DAX).
pub const FUSE_MAP_ALIGNMENT: u64 = 1 << 26;
/// Kernel supports submounts.
pub const FUSE_SUBMOUNTS: u64 = 1 << 27;
/// Server clears suid/sgid itself (v2 semantics).
pub const FUSE_HANDLE_KILLPRIV_V2: u64 = 1 << 28;
/// Server accepts the extended SETXATTR argument.
pub const FUSE_SETXATTR_EXT: u64 = 1 << 29;
/// `flags2` is valid in INIT request and reply; required for bits 32..63.
pub const FUSE_INIT_EXT: u64 = 1 << 30;
/// Reserved; never set.
pub const FUSE_INIT_RESERVED: u64 = 1 << 31;
/// Kernel sends security contexts with create-type requests.
pub const FUSE_SECURITY_CTX: u64 = 1 << 32;
/// Per-inode DAX.
pub const FUSE_HAS_INODE_DAX: u64 = 1 << 33;
/// Kernel sends supplementary groups with create-type requests.
pub const FUSE_CREATE_SUPP_GROUP: u64 = 1 << 34;
/// Kernel supports expire-only entry invalidation.
pub const FUSE_HAS_EXPIRE_ONLY: u64 = 1 << 35;
/// Shared mmap allowed on `FOPEN_DIRECT_IO` files.
pub const FUSE_DIRECT_IO_ALLOW_MMAP: u64 = 1 << 36;
/// Server may hand the kernel a backing file (see `FOPEN_PASSTHROUGH`).
pub const FUSE_PASSTHROUGH: u64 = 1 << 37;
/// Explicitly disable NFS export support.
pub const FUSE_NO_EXPORT_SUPPORT: u64 = 1 << 38;
/// Kernel may resend pending requests (high bit of `unique` marks them).
pub const FUSE_HAS_RESEND: u64 = 1 << 39;
/// Idmapped mounts allowed.
pub const FUSE_ALLOW_IDMAP: u64 = 1 << 40;
/// Requests are delivered through io_uring (see [`crate::uring`]).
pub const FUSE_OVER_IO_URING: u64 = 1 << 41;
/// `InitOut::request_timeout` is valid (Linux 6.14, protocol 7.43): the kernel aborts the whole
/// connection when a request goes unanswered that long. Offered by every kernel that knows it.
pub const FUSE_REQUEST_TIMEOUT: u64 = 1 << 42;

/// Splits a 64-bit INIT flag set into the `(flags, flags2)` wire fields.
pub const fn split_init_flags(all: u64) -> (u32, u32) {
    (all as u32, (all >> 32) as u32)
}

/// Joins the `(flags, flags2)` wire fields into one 64-bit flag set.
pub const fn join_init_flags(flags: u32, flags2: u32) -> u64 {
    (flags as u64) | ((flags2 as u64) << 32)
}

// ------------------------------------------------------- OPEN reply flags

/// Bypass the page cache: every read/write reaches the server.
pub const FOPEN_DIRECT_IO: u32 = 1 << 0;
/// Keep the page cache across opens.
pub const FOPEN_KEEP_CACHE: u32 = 1 << 1;
/// The file cannot seek.
pub const FOPEN_NONSEEKABLE: u32 = 1 << 2;
/// Allow caching a directory's entries.
pub const FOPEN_CACHE_DIR: u32 = 1 << 3;
/// The file is a stream (no position).
pub const FOPEN_STREAM: u32 = 1 << 4;
/// Do not send FLUSH on close.
pub const FOPEN_NOFLUSH: u32 = 1 << 5;
/// Allow concurrent direct writes to one inode.
pub const FOPEN_PARALLEL_DIRECT_WRITES: u32 = 1 << 6;
/// Reads and writes go straight to the backing file in `OpenOut::backing_id`.
pub const FOPEN_PASSTHROUGH: u32 = 1 << 7;

// ------------------------------------------------------- OPEN request flags

/// `OpenIn::open_flags`: clear suid/sgid if the file is executable.
pub const FUSE_OPEN_KILL_SUIDGID: u32 = 1 << 0;

// --------------------------------------------------- SETATTR valid bits

/// `SetattrIn::mode` is set.
pub const FATTR_MODE: u32 = 1 << 0;
/// `SetattrIn::uid` is set.
pub const FATTR_UID: u32 = 1 << 1;
/// `SetattrIn::gid` is set.
pub const FATTR_GID: u32 = 1 << 2;
/// `SetattrIn::size` is set (truncate).
pub const FATTR_SIZE: u32 = 1 << 3;
/// `SetattrIn::atime` is set.
pub const FATTR_ATIME: u32 = 1 << 4;
/// `SetattrIn::mtime` is set.
pub const FATTR_MTIME: u32 = 1 << 5;
/// `SetattrIn::fh` is set.
pub const FATTR_FH: u32 = 1 << 6;
/// Set atime to the current time.
pub const FATTR_ATIME_NOW: u32 = 1 << 7;
/// Set mtime to the current time.
pub const FATTR_MTIME_NOW: u32 = 1 << 8;
/// `SetattrIn::lock_owner` is set.
pub const FATTR_LOCKOWNER: u32 = 1 << 9;
/// `SetattrIn::ctime` is set.
pub const FATTR_CTIME: u32 = 1 << 10;
/// Clear suid/sgid as part of this change.
pub const FATTR_KILL_SUIDGID: u32 = 1 << 11;

// ------------------------------------------------------ READ/WRITE flags

/// `ReadIn::lock_owner` is valid.
pub const FUSE_READ_LOCKOWNER: u32 = 1 << 1;
/// Write comes from the page cache (writeback); the file handle is a guess.
pub const FUSE_WRITE_CACHE: u32 = 1 << 0;
/// `WriteIn::lock_owner` is valid.
pub const FUSE_WRITE_LOCKOWNER: u32 = 1 << 1;
/// Clear suid/sgid as part of this write.
pub const FUSE_WRITE_KILL_SUIDGID: u32 = 1 << 2;

// ------------------------------------------------------ misc request flags

/// `FsyncIn::fsync_flags`: data only (`fdatasync`).
pub const FUSE_FSYNC_FDATASYNC: u32 = 1 << 0;
/// `GetattrIn::getattr_flags`: `GetattrIn::fh` is valid.
pub const FUSE_GETATTR_FH: u32 = 1 << 0;
/// `ReleaseIn::release_flags`: flush before release.
pub const FUSE_RELEASE_FLUSH: u32 = 1 << 0;
/// `ReleaseIn::release_flags`: drop flock locks.
pub const FUSE_RELEASE_FLOCK_UNLOCK: u32 = 1 << 1;

/// `SetxattrIn::setxattr_flags`: setting `system.posix_acl_access` clears the file's setgid bit
/// (the caller is neither in the file's group nor has `CAP_FSETID`).
pub const FUSE_SETXATTR_ACL_KILL_SGID: u32 = 1 << 0;

// ------------------------------------------------ fallocate(2) mode bits

/// Do not change the file size.
pub const FALLOC_FL_KEEP_SIZE: u32 = 0x01;
/// Deallocate the range (needs `KEEP_SIZE`).
pub const FALLOC_FL_PUNCH_HOLE: u32 = 0x02;
/// Reserved by the kernel.
pub const FALLOC_FL_NO_HIDE_STALE: u32 = 0x04;
/// Remove the range and shift the rest down.
pub const FALLOC_FL_COLLAPSE_RANGE: u32 = 0x08;
/// Make the range read as zeroes.
pub const FALLOC_FL_ZERO_RANGE: u32 = 0x10;
/// Insert a hole and shift the rest up.
pub const FALLOC_FL_INSERT_RANGE: u32 = 0x20;
/// Unshare shared blocks in the range.
pub const FALLOC_FL_UNSHARE_RANGE: u32 = 0x40;

// ----------------------------------------------------- lseek(2) whence

/// `LseekIn::whence`: absolute offset.
pub const SEEK_SET: u32 = 0;
/// `LseekIn::whence`: relative to the current position.
pub const SEEK_CUR: u32 = 1;
/// `LseekIn::whence`: relative to the end.
pub const SEEK_END: u32 = 2;
/// `LseekIn::whence`: next data at or after the offset.
pub const SEEK_DATA: u32 = 3;
/// `LseekIn::whence`: next hole at or after the offset.
pub const SEEK_HOLE: u32 = 4;

// RENAME2 flags (`renameat2(2)`).
/// Fail with EEXIST rather than replace the target.
pub const RENAME_NOREPLACE: u32 = 1 << 0;
/// Swap the two entries atomically.
pub const RENAME_EXCHANGE: u32 = 1 << 1;
/// Leave an overlayfs whiteout at the source.
pub const RENAME_WHITEOUT: u32 = 1 << 2;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags2_bits() {
        // flags2 bit n is INIT bit 32 + n.
        assert_eq!(split_init_flags(FUSE_PASSTHROUGH), (0, 1 << 5));
        assert_eq!(split_init_flags(FUSE_OVER_IO_URING), (0, 1 << 9));
        assert_eq!(
            split_init_flags(FUSE_INIT_EXT | FUSE_MAX_PAGES),
            ((1 << 30) | (1 << 22), 0)
        );
        let all = FUSE_ASYNC_READ | FUSE_INIT_EXT | FUSE_PASSTHROUGH | FUSE_REQUEST_TIMEOUT;
        let (lo, hi) = split_init_flags(all);
        assert_eq!(join_init_flags(lo, hi), all);
    }
}
