//! Block backends: where an export's guest-visible bytes live.
//!
//! A backend knows nothing of FUSE. It is shared by every queue thread of an export (`Send + Sync`),
//! while each operation runs on the calling queue's [`Engine`], so backend I/O rides the same ring as
//! the requests that caused it.

use std::future::Future;
use std::io;

use engine::{Engine, Slice};

mod any;
pub mod blocktable;
mod cow;
mod fault;
mod fields;
mod gate;
pub mod lock;
pub mod nbd_client;
mod null;
pub mod partition;
pub mod qcow2;
mod raw;
mod regions;
mod ringfile;
mod stats;
pub mod vdi;
pub mod vhd;
pub mod vhdx;
pub mod vmdk;

pub use any::{
    has_metadata, names_a_path, open, open_partition, AnyBackend, ByteRange, Format, OpenError,
    OpenOptions, Whole,
};
pub use fault::{FaultAction, FaultOp, FaultParseError, FaultRule, Faulty};
pub use lock::{LockError, Locking};
pub use nbd_client::{NbdBackend, NbdOptions};
pub use null::{parse_size, NullBackend};
pub use qcow2::{Qcow2Backend, Qcow2Options};
pub use raw::{IoPath, RawBackend};
pub use ringfile::RingFile;
pub use stats::{BackendStats, NbdStats, Qcow2Stats};

/// Errors of backend operations, typed so the export can map them to errnos.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The operating system reported an error.
    #[error(transparent)]
    Io(#[from] io::Error),
    /// The backend cannot do this at all (e.g. discard on a device without it).
    #[error("operation not supported by this backend")]
    Unsupported,
}

impl BackendError {
    /// The errno to report to the FUSE client.
    pub fn errno(&self) -> i32 {
        match self {
            BackendError::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
            BackendError::Unsupported => libc::EOPNOTSUPP,
        }
    }
}

/// Result of backend operations.
pub type Result<T> = std::result::Result<T, BackendError>;

/// File attributes an export presents (they follow the image).
#[derive(Clone, Copy, Debug, Default)]
pub struct Attrs {
    /// Permission bits of the image (`st_mode & 0o7777`).
    pub perm: u32,
    /// Owner of the image.
    pub uid: u32,
    /// Group of the image.
    pub gid: u32,
    /// Allocated bytes (`st_blocks * 512` for a file).
    pub allocated: u64,
    /// Access time (seconds, nanoseconds).
    pub atime: (i64, u32),
    /// Modification time.
    pub mtime: (i64, u32),
    /// Change time.
    pub ctime: (i64, u32),
}

/// What a backend can do beyond reading and writing.
#[derive(Clone, Copy, Debug, Default)]
pub struct Capabilities {
    /// Writes are possible (the image was opened for writing).
    pub writable: bool,
    /// `resize` works.
    pub resize: bool,
    /// Whether the kernel could serve the guest bytes straight from one file (FUSE
    /// passthrough), and if not, why: the export's passthrough decision asks this, not which
    /// backend it has.
    pub passthrough: PassthroughSource,
    /// Requests cross a network (NBD): the memory plan favours request depth over size.
    pub remote: bool,
    /// The most queues (each with its own connection) that stay consistent with each other, and
    /// why: an NBD server without multi-conn does not promise that a flush on one connection
    /// covers writes made on another. None: any number.
    pub max_queues: Option<(usize, &'static str)>,
    /// Closing the backend's connections flushes what they wrote, so the export's end needs no
    /// flush of its own (NBD: each queue's connection flushes as it closes).
    pub flushes_on_close: bool,
}

/// What FUSE passthrough could serve a backend's guest bytes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PassthroughSource {
    /// This regular file holds them, offset for offset (a raw image).
    File(std::os::fd::RawFd),
    /// No file holds them (null, NBD).
    #[default]
    NoFile,
    /// An image format maps them (qcow2, VHD, VDI, VHDX, VMDK): the file's bytes are not the
    /// guest's.
    Formatted,
    /// They are a window of a larger image (a partition), which the kernel would not keep to.
    Window,
    /// A block device: the kernel passes regular files through only.
    BlockDevice,
}

/// Whence of a block-status query.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seek {
    /// Next offset at or after `off` that holds data.
    Data,
    /// Next offset at or after `off` that is a hole (EOF counts as a hole).
    Hole,
}

/// The operations every image format provides. Offsets and lengths are in bytes of the guest view.
///
/// Reads and writes take an owned window of an engine buffer and give it back with the result, so a
/// backend can hand it to the ring (`READ`/`WRITE`, or `READ_FIXED`/`WRITE_FIXED` when the engine
/// registered its pool) with no copy, and no caller can touch it while the kernel may.
pub trait BlockBackend: Send + Sync + 'static {
    /// Current length of the image.
    fn size(&self) -> u64;

    /// Re-reads the length from the image itself and returns it, for when something other than
    /// this backend may have changed it: with FUSE passthrough the kernel writes (and extends) the
    /// image file directly, and another program may truncate or extend a raw image (or a block
    /// device be resized) behind the export. The default keeps the backend's own idea of the size.
    fn refresh_size(&self) -> Result<u64> {
        Ok(self.size())
    }

    /// The largest size the image may grow to: where the filesystem holding it stops a file
    /// (its `s_maxbytes`), so a growable export refuses an offset near 2^63 with EFBIG up
    /// front rather than half way through. The default: what `off_t` can address.
    fn size_limit(&self) -> u64 {
        i64::MAX as u64
    }

    /// What this backend supports.
    fn capabilities(&self) -> Capabilities;

    /// Attributes for GETATTR. Async: a format may have to walk its mapping to count allocated
    /// bytes.
    fn attrs(&self, eng: &Engine) -> impl Future<Output = Result<Attrs>>;

    /// Fills `win` from `off`; returns the bytes read (short only at the end of the image) and the
    /// window.
    fn read_at(
        &self,
        eng: &Engine,
        win: Slice,
        off: u64,
    ) -> impl Future<Output = (Result<usize>, Slice)>;

    /// Writes `win` at `off`; returns the bytes written and the window. A write past the end of a
    /// growable image extends it by what was written: the caller then records the new end with
    /// [`BlockBackend::written_to`]. If an error stops the write after some bytes landed, those
    /// bytes are reported (`Ok(n)` with `n` short), not the error.
    fn write_at(
        &self,
        eng: &Engine,
        win: Slice,
        off: u64,
    ) -> impl Future<Output = (Result<usize>, Slice)>;

    /// Makes completed writes durable.
    fn flush(&self, eng: &Engine) -> impl Future<Output = Result<()>>;

    /// Deallocates a range; it reads back as zeroes afterwards.
    fn discard(&self, eng: &Engine, off: u64, len: u64) -> impl Future<Output = Result<()>>;

    /// Makes a range read back as zeroes (allocated or not).
    fn write_zeroes(&self, eng: &Engine, off: u64, len: u64) -> impl Future<Output = Result<()>>;

    /// Preallocates a range (fallocate mode 0) inside the image.
    fn allocate(&self, eng: &Engine, off: u64, len: u64) -> impl Future<Output = Result<()>>;

    /// Block status: the next data or hole offset at or after `off`, `None` if there is none
    /// (SEEK_DATA past the last data).
    /// Async: a format may have to read mapping tables from the image.
    fn seek(
        &self,
        eng: &Engine,
        off: u64,
        whence: Seek,
    ) -> impl Future<Output = Result<Option<u64>>>;

    /// A descriptor READ data can be spliced from at guest offsets, for a transport that moves
    /// page references rather than bytes (legacy `/dev/fuse`: image → pipe → reply, one copy
    /// in the kernel instead of two). Only where a splice never waits for a device (the image
    /// is in memory) and a guest offset is the file offset (raw). The default: none.
    fn splice_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }

    /// Whether a completed write is already durable (NBD writes sent with FUA for
    /// `--writethrough`), so the export need not follow each write with a flush.
    fn durable_writes(&self) -> bool {
        false
    }

    /// Changes the length of the image; consistent for every queue at once.
    fn resize(&self, eng: &Engine, new_size: u64) -> impl Future<Output = Result<()>>;

    /// Grows the image to at least `new_size` (never shrinks; concurrent callers race safely).
    /// For fallocate and truncate, which extend without writing data.
    fn grow_to(&self, eng: &Engine, new_size: u64) -> impl Future<Output = Result<()>>;

    /// Records that a write put bytes up to `end`, so the image is at least that long now (the
    /// write itself extended it). No syscall, no lock: appends pay nothing for growing.
    fn written_to(&self, end: u64);

    /// Sets access/modification times of the image where that means something.
    fn set_times(&self, atime: Option<(i64, u32)>, mtime: Option<(i64, u32)>) -> Result<()>;

    /// The queue on the calling thread stops taking requests and waits for the ones it took: a
    /// backend ends the waits that would only delay that (NBD: a request waiting for a
    /// connection being made fails with `EIO` now). Default: nothing to end.
    fn queue_stopping(&self) {}

    /// The queue on the calling thread has ended; the thread may go on serving other exports,
    /// so what the backend keeps per thread for it goes now (NBD: its connection). Default:
    /// nothing kept.
    fn queue_ended(&self) {}

    /// What keeps the backend from serving right now, for the operator (an NBD server that
    /// cannot be reached: requests fail with EIO until it is back); None when nothing does.
    /// Read once a second off the queue threads, so it must be cheap. Default: never.
    fn trouble(&self) -> Option<String> {
        None
    }

    /// Drops what the backend keeps in memory that went unused for its interval (qcow2: the
    /// metadata tables, after QEMU's `cache-clean-interval`), so that an idle export gives that
    /// memory back. Called about once a second off the queue threads; never waits for a lock
    /// (what is busy now is left for a later call). Default: nothing kept.
    fn drop_unused(&self) {}

    /// The backend's own statistics (see [`BackendStats`]): read off the queue threads when an
    /// operator asks, so it may take a lock or a system call. Default: none.
    fn stats(&self) -> BackendStats {
        BackendStats::default()
    }
}
