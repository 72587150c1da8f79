//! Opening an image from the command line's IMAGE argument, and the enum that dispatches to the
//! concrete backend without dynamic dispatch (async trait methods are not object safe, and a
//! `match` is cheaper than a vtable call anyway).

use std::io;
use std::path::Path;

use engine::{Engine, Slice};

use crate::{
    parse_size, Attrs, BlockBackend, Capabilities, IoPath, NullBackend, RawBackend, Result, Seek,
};

/// Why an image could not be opened. Each message names the problem and what to do.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The path does not exist.
    #[error("image {0} does not exist: check the path")]
    NotFound(String),
    /// The process may not open it.
    #[error("image {0} is not accessible: check its permissions")]
    Permission(String),
    /// `--writable` but the image can only be opened read-only.
    #[error("image {0} cannot be opened for writing (read-only file or filesystem): drop --writable or fix its permissions")]
    ReadOnly(String),
    /// A directory, socket, ...
    #[error("image {0} is not a regular file or block device: give the path of a raw image file or device, or null:SIZE")]
    NotFileOrDevice(String),
    /// `--direct` on a filesystem without O_DIRECT.
    #[error("image {0} is on a filesystem without O_DIRECT support: drop --direct")]
    DirectUnsupported(String),
    /// `null:` with a size that does not parse.
    #[error(
        "bad size {0:?} for null: use a positive size such as null:1G, null:512M or null:4096"
    )]
    BadSize(String),
    /// Anything else the OS reported.
    #[error("cannot open image {path}: {source}")]
    Io {
        /// The image path.
        path: String,
        /// What the OS said.
        source: io::Error,
    },
}

impl OpenError {
    pub(crate) fn from_io(path: &str, e: io::Error) -> OpenError {
        match e.kind() {
            io::ErrorKind::NotFound => OpenError::NotFound(path.to_string()),
            io::ErrorKind::PermissionDenied => OpenError::Permission(path.to_string()),
            _ => OpenError::Io {
                path: path.to_string(),
                source: e,
            },
        }
    }
}

/// How to open an image.
#[derive(Clone, Copy, Debug, Default)]
pub struct OpenOptions {
    /// Open for writing.
    pub writable: bool,
    /// O_DIRECT on the image.
    pub direct: bool,
    /// Force a data path instead of probing.
    pub io_path: Option<IoPath>,
}

/// Any backend fusex can serve.
pub enum AnyBackend {
    /// A raw file or block device.
    Raw(RawBackend),
    /// `null:SIZE`.
    Null(NullBackend),
}

/// Opens IMAGE: `null:SIZE` or a path.
pub fn open(spec: &str, opts: OpenOptions) -> std::result::Result<AnyBackend, OpenError> {
    if let Some(size) = spec.strip_prefix("null:") {
        return Ok(AnyBackend::Null(NullBackend::new(
            parse_size(size)?,
            opts.writable,
        )));
    }
    Ok(AnyBackend::Raw(RawBackend::open(
        Path::new(spec),
        opts.writable,
        opts.direct,
        opts.io_path,
    )?))
}

impl AnyBackend {
    /// Every descriptor data I/O goes to (for registering them with a ring as fixed files).
    pub fn io_fds(&self) -> Vec<std::os::fd::RawFd> {
        match self {
            AnyBackend::Raw(r) => r.io_fds(),
            AnyBackend::Null(_) => Vec::new(),
        }
    }
}

macro_rules! each {
    ($self:ident, $b:ident => $e:expr) => {
        match $self {
            AnyBackend::Raw($b) => $e,
            AnyBackend::Null($b) => $e,
        }
    };
}

impl BlockBackend for AnyBackend {
    fn size(&self) -> u64 {
        each!(self, b => b.size())
    }
    fn refresh_size(&self) -> Result<u64> {
        each!(self, b => b.refresh_size())
    }
    fn capabilities(&self) -> Capabilities {
        each!(self, b => b.capabilities())
    }
    fn attrs(&self) -> Result<Attrs> {
        each!(self, b => b.attrs())
    }
    async fn read_at(&self, eng: &Engine, win: Slice, off: u64) -> (Result<usize>, Slice) {
        each!(self, b => b.read_at(eng, win, off).await)
    }
    async fn write_at(&self, eng: &Engine, win: Slice, off: u64) -> (Result<usize>, Slice) {
        each!(self, b => b.write_at(eng, win, off).await)
    }
    async fn flush(&self, eng: &Engine) -> Result<()> {
        each!(self, b => b.flush(eng).await)
    }
    async fn discard(&self, eng: &Engine, off: u64, len: u64) -> Result<()> {
        each!(self, b => b.discard(eng, off, len).await)
    }
    async fn write_zeroes(&self, eng: &Engine, off: u64, len: u64) -> Result<()> {
        each!(self, b => b.write_zeroes(eng, off, len).await)
    }
    async fn allocate(&self, eng: &Engine, off: u64, len: u64) -> Result<()> {
        each!(self, b => b.allocate(eng, off, len).await)
    }
    fn seek(&self, off: u64, whence: Seek) -> Result<Option<u64>> {
        each!(self, b => b.seek(off, whence))
    }
    fn resize(&self, new_size: u64) -> Result<()> {
        each!(self, b => b.resize(new_size))
    }
    fn grow_to(&self, new_size: u64) -> Result<()> {
        each!(self, b => b.grow_to(new_size))
    }
    fn written_to(&self, end: u64) {
        each!(self, b => b.written_to(end))
    }
    fn set_times(&self, atime: Option<(i64, u32)>, mtime: Option<(i64, u32)>) -> Result<()> {
        each!(self, b => b.set_times(atime, mtime))
    }
}
