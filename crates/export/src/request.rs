//! A decoded request in a form that owns its arguments.

use std::ffi::CStr;

use fuse_abi::{
    AccessIn, CopyFileRangeIn, CreateIn, FallocateIn, FlushIn, FsyncIn, GetattrIn, GetxattrIn,
    LinkIn, LseekIn, MkdirIn, MknodIn, OpenIn, Operation, ReadIn, ReleaseIn, SetattrIn, SetxattrIn,
    StatxIn, WriteIn,
};

/// Where a name, a value or other variable bytes of a request sit in its slot buffer: offsets,
/// not a borrow, so the buffer can still be lent to the kernel for I/O. Read it before writing
/// the reply body, which may overwrite it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Span {
    /// Offset in the buffer.
    pub at: usize,
    /// Length in bytes (a name's NUL not included).
    pub len: usize,
}

impl Span {
    /// Where `part`, a slice of `base`, sits in it.
    fn of(part: &[u8], base: &[u8]) -> Span {
        Span {
            at: (part.as_ptr() as usize).wrapping_sub(base.as_ptr() as usize),
            len: part.len(),
        }
    }

    /// The bytes in `buf`; `None` if they are not inside it.
    pub fn bytes<'a>(&self, buf: &'a [u8]) -> Option<&'a [u8]> {
        buf.get(self.at..self.at.checked_add(self.len)?)
    }

    /// The name in `buf` with the NUL that follows it in every request (the decoder checked it):
    /// `None` if it is not there or the name holds a NUL.
    pub fn c_str<'a>(&self, buf: &'a [u8]) -> Option<&'a CStr> {
        let with_nul = buf.get(self.at..self.at.checked_add(self.len)?.checked_add(1)?)?;
        CStr::from_bytes_with_nul(with_nul).ok()
    }
}

/// The operations a filesystem distinguishes. WRITE data is not carried here: the transport places
/// it at the start of the payload window of the slot buffer. Names and values are [`Span`]s of
/// the slot buffer.
#[derive(Clone, Copy, Debug)]
pub enum Request {
    /// Second INIT on a live connection (a protocol error).
    Init,
    /// The connection is going away.
    Destroy,
    /// A name lookup in the header's directory.
    Lookup {
        /// The name.
        name: Span,
    },
    /// FORGET: drop `nlookup` lookup references to the header's node; no reply.
    Forget(u64),
    /// BATCH_FORGET: `entries` holds `fuse_forget_one` entries
    /// ([`fuse_abi::forget_entries`]); no reply.
    BatchForget {
        /// The entries' bytes.
        entries: Span,
    },
    /// INTERRUPT: no reply; backend operations are short and run to completion.
    Interrupt,
    /// GETATTR.
    Getattr(GetattrIn),
    /// SETATTR.
    Setattr(SetattrIn),
    /// OPEN.
    Open(OpenIn),
    /// RELEASE.
    Release(ReleaseIn),
    /// READ.
    Read(ReadIn),
    /// WRITE; `size` bytes of data at the payload window.
    Write(WriteIn),
    /// FLUSH (close of a descriptor).
    Flush(FlushIn),
    /// FSYNC.
    Fsync(FsyncIn),
    /// FALLOCATE.
    Fallocate(FallocateIn),
    /// LSEEK (SEEK_DATA/SEEK_HOLE).
    Lseek(LseekIn),
    /// STATFS.
    Statfs,
    /// READLINK.
    Readlink,
    /// SYMLINK `name` → `target`.
    Symlink {
        /// The new entry.
        name: Span,
        /// The link's content.
        target: Span,
    },
    /// MKNOD.
    Mknod {
        /// Mode, device, umask.
        arg: MknodIn,
        /// The new entry.
        name: Span,
    },
    /// MKDIR.
    Mkdir {
        /// Mode, umask.
        arg: MkdirIn,
        /// The new entry.
        name: Span,
    },
    /// UNLINK.
    Unlink {
        /// The entry.
        name: Span,
    },
    /// RMDIR.
    Rmdir {
        /// The entry.
        name: Span,
    },
    /// RENAME and RENAME2.
    Rename {
        /// Target directory node.
        newdir: u64,
        /// `RENAME_*` flags.
        flags: u32,
        /// The entry in the header's directory.
        old: Span,
        /// Its name in `newdir`.
        new: Span,
    },
    /// LINK.
    Link {
        /// The node linked.
        arg: LinkIn,
        /// The new entry.
        name: Span,
    },
    /// CREATE.
    Create {
        /// Flags, mode, umask.
        arg: CreateIn,
        /// The new entry.
        name: Span,
    },
    /// TMPFILE.
    Tmpfile(CreateIn),
    /// OPENDIR.
    Opendir(OpenIn),
    /// READDIR.
    Readdir(ReadIn),
    /// READDIRPLUS.
    Readdirplus(ReadIn),
    /// RELEASEDIR.
    Releasedir(ReleaseIn),
    /// FSYNCDIR.
    Fsyncdir(FsyncIn),
    /// SETXATTR.
    Setxattr {
        /// Size, flags.
        arg: SetxattrIn,
        /// The attribute.
        name: Span,
        /// Its value.
        value: Span,
    },
    /// GETXATTR.
    Getxattr {
        /// Room for the value.
        arg: GetxattrIn,
        /// The attribute.
        name: Span,
    },
    /// LISTXATTR.
    Listxattr(GetxattrIn),
    /// REMOVEXATTR.
    Removexattr {
        /// The attribute.
        name: Span,
    },
    /// ACCESS.
    Access(AccessIn),
    /// STATX.
    Statx(StatxIn),
    /// COPY_FILE_RANGE (a 32-bit count in the reply).
    CopyFileRange(CopyFileRangeIn),
    /// COPY_FILE_RANGE_64 (a 64-bit count in the reply).
    CopyFileRange64(CopyFileRangeIn),
    /// Anything else: ENOSYS.
    Unsupported(u32),
}

impl Request {
    /// Converts a decoded operation whose borrowed bytes lie in `base` (the slot buffer): names
    /// and values become [`Span`]s of it, WRITE data is dropped (the transport places it).
    pub fn from_operation(op: &Operation<'_>, base: &[u8]) -> Request {
        let s = |part: &[u8]| Span::of(part, base);
        match *op {
            Operation::Init(_) => Request::Init,
            Operation::Destroy => Request::Destroy,
            Operation::Lookup { name } => Request::Lookup { name: s(name) },
            Operation::Forget(a) => Request::Forget(a.nlookup),
            Operation::BatchForget { entries, .. } => Request::BatchForget {
                entries: s(entries),
            },
            Operation::Interrupt(_) => Request::Interrupt,
            Operation::Getattr(a) => Request::Getattr(a),
            Operation::Setattr(a) => Request::Setattr(a),
            Operation::Open(a) => Request::Open(a),
            Operation::Release(a) => Request::Release(a),
            Operation::Read(a) => Request::Read(a),
            Operation::Write { arg, .. } => Request::Write(arg),
            Operation::Flush(a) => Request::Flush(a),
            Operation::Fsync(a) => Request::Fsync(a),
            Operation::Fallocate(a) => Request::Fallocate(a),
            Operation::Lseek(a) => Request::Lseek(a),
            Operation::Statfs => Request::Statfs,
            Operation::Readlink => Request::Readlink,
            Operation::Symlink { name, target } => Request::Symlink {
                name: s(name),
                target: s(target),
            },
            Operation::Mknod { arg, name } => Request::Mknod { arg, name: s(name) },
            Operation::Mkdir { arg, name } => Request::Mkdir { arg, name: s(name) },
            Operation::Unlink { name } => Request::Unlink { name: s(name) },
            Operation::Rmdir { name } => Request::Rmdir { name: s(name) },
            Operation::Rename {
                newdir,
                flags,
                old,
                new,
            } => Request::Rename {
                newdir,
                flags,
                old: s(old),
                new: s(new),
            },
            Operation::Link { arg, name } => Request::Link { arg, name: s(name) },
            Operation::Create { arg, name } => Request::Create { arg, name: s(name) },
            Operation::Tmpfile(a) => Request::Tmpfile(a),
            Operation::Opendir(a) => Request::Opendir(a),
            Operation::Readdir(a) => Request::Readdir(a),
            Operation::Readdirplus(a) => Request::Readdirplus(a),
            Operation::Releasedir(a) => Request::Releasedir(a),
            Operation::Fsyncdir(a) => Request::Fsyncdir(a),
            Operation::Setxattr { arg, name, value } => Request::Setxattr {
                arg,
                name: s(name),
                value: s(value),
            },
            Operation::Getxattr { arg, name } => Request::Getxattr { arg, name: s(name) },
            Operation::Listxattr(a) => Request::Listxattr(a),
            Operation::Removexattr { name } => Request::Removexattr { name: s(name) },
            Operation::Access(a) => Request::Access(a),
            Operation::Statx(a) => Request::Statx(a),
            Operation::CopyFileRange(a) => Request::CopyFileRange(a),
            Operation::CopyFileRange64(a) => Request::CopyFileRange64(a),
            Operation::Unsupported(op) => Request::Unsupported(op as u32),
            Operation::Unknown(n) => Request::Unsupported(n),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_point_into_the_buffer() {
        let buf = b"\x00\x00name\x00value";
        let op = Operation::Setxattr {
            arg: SetxattrIn {
                size: 5,
                ..Default::default()
            },
            name: &buf[2..6],
            value: &buf[7..],
        };
        let Request::Setxattr { name, value, .. } = Request::from_operation(&op, buf) else {
            panic!("not setxattr")
        };
        assert_eq!(name.c_str(buf).unwrap().to_bytes(), b"name");
        assert_eq!(value.bytes(buf).unwrap(), b"value");
        // A value has no NUL after it; a span past the buffer is refused.
        assert!(value.c_str(buf).is_none());
        assert!(Span { at: 10, len: 10 }.bytes(buf).is_none());
        assert!(Span {
            at: usize::MAX,
            len: 2
        }
        .bytes(buf)
        .is_none());
    }
}
