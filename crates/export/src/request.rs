//! A decoded request in a form that owns its arguments.

use fuse_abi::{FallocateIn, FsyncIn, LseekIn, OpenIn, Operation, ReadIn, SetattrIn, WriteIn};

/// The operations an export distinguishes. WRITE data is not carried here: the transport places it
/// at the start of the payload window of the slot buffer.
#[derive(Clone, Copy, Debug)]
pub enum Request {
    /// Second INIT on a live connection (a protocol error).
    Init,
    /// The connection is going away.
    Destroy,
    /// A name lookup: the export has no names below its root.
    Lookup,
    /// FORGET/BATCH_FORGET: no reply.
    Forget,
    /// INTERRUPT: no reply; backend operations are short and run to completion.
    Interrupt,
    /// GETATTR.
    Getattr,
    /// SETATTR.
    Setattr(SetattrIn),
    /// OPEN.
    Open(OpenIn),
    /// RELEASE.
    Release,
    /// READ.
    Read(ReadIn),
    /// WRITE; `size` bytes of data at the payload window.
    Write(WriteIn),
    /// FLUSH (close of a descriptor).
    Flush,
    /// FSYNC.
    Fsync(FsyncIn),
    /// FALLOCATE.
    Fallocate(FallocateIn),
    /// LSEEK (SEEK_DATA/SEEK_HOLE).
    Lseek(LseekIn),
    /// STATFS.
    Statfs,
    /// Anything else: ENOSYS.
    Unsupported(u32),
}

impl Request {
    /// Converts a decoded operation, dropping borrowed bytes (WRITE data, LOOKUP names).
    pub fn from_operation(op: &Operation<'_>) -> Request {
        match op {
            Operation::Init(_) => Request::Init,
            Operation::Destroy => Request::Destroy,
            Operation::Lookup { .. } => Request::Lookup,
            Operation::Forget(_) | Operation::BatchForget { .. } => Request::Forget,
            Operation::Interrupt(_) => Request::Interrupt,
            Operation::Getattr(_) => Request::Getattr,
            Operation::Setattr(a) => Request::Setattr(*a),
            Operation::Open(a) => Request::Open(*a),
            Operation::Release(_) => Request::Release,
            Operation::Read(a) => Request::Read(*a),
            Operation::Write { arg, .. } => Request::Write(*arg),
            Operation::Flush(_) => Request::Flush,
            Operation::Fsync(a) => Request::Fsync(*a),
            Operation::Fallocate(a) => Request::Fallocate(*a),
            Operation::Lseek(a) => Request::Lseek(*a),
            Operation::Statfs => Request::Statfs,
            Operation::Unsupported(op) => Request::Unsupported(*op as u32),
            Operation::Unknown(n) => Request::Unsupported(*n),
        }
    }
}
