//! `RingFile`: imago's [`Storage`] over fusex's engine, so image-format I/O (qcow2 data and
//! metadata, backing files) runs on the calling queue's own io_uring instead of blocking it in
//! `preadv` like imago's built-in file storage would.
//!
//! imago's storage trait carries no engine and passes borrowed buffers, so the operations use
//! [`engine::borrowed`]: they find this thread's engine and lend the borrowed memory directly. A
//! guest read therefore lands in the FUSE request's own buffer with no copy. Where no engine runs
//! (opening the image at start-up, before any queue exists) plain system calls do the same work.
//!
//! A file on tmpfs is read and written inline while the queue serves one request (io_uring would
//! punt the copy to a worker thread, ~15 µs), through the ring once several are in flight: the
//! same adaptive choice [`crate::RawBackend`] makes.

use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use engine::{borrowed, Fd};
use imago::io_buffers::{IoVector, IoVectorMut};
use imago::storage::drivers::CommonStorageHelper;
use imago::storage::PreallocateMode;
use imago::{Storage, StorageOpenOptions};

/// Alignment for O_DIRECT files (a page covers every logical block size fusex meets).
const DIRECT_ALIGN: usize = 4096;

/// One image file (the top image, a backing file, an external data file) as imago storage.
pub struct RingFile {
    file: File,
    path: PathBuf,
    direct: bool,
    /// tmpfs/ramfs: inline transfers while the queue is otherwise idle, and inline fallocate.
    memory_fs: bool,
    /// `FALLOC_FL_ZERO_RANGE` failed with EOPNOTSUPP once (tmpfs): go straight to punching.
    no_zero_range: AtomicBool,
    /// The file's length as this process last made it (only a memory file system reads it):
    /// fusex's image locks keep other writers out.
    end: AtomicU64,
    helper: CommonStorageHelper,
}

impl RingFile {
    /// Opens `path` for reading (and writing with `writable`), with O_DIRECT if `direct`.
    pub fn open_path(path: &Path, writable: bool, direct: bool) -> io::Result<RingFile> {
        let file = crate::raw::open_image_file(path, writable, direct)?;
        RingFile::from_file(file, path, direct)
    }

    /// Wraps a file already open (as `direct` says) that lives at `path`.
    pub fn from_file(file: File, path: &Path, direct: bool) -> io::Result<RingFile> {
        let meta = file.metadata()?;
        if !meta.is_file() && !std::os::unix::fs::FileTypeExt::is_block_device(&meta.file_type()) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a regular file or block device", path.display()),
            ));
        }
        Ok(RingFile {
            end: AtomicU64::new(meta.len()),
            memory_fs: crate::raw::is_memory_fs(&file),
            file,
            path: path.to_path_buf(),
            direct,
            no_zero_range: AtomicBool::new(false),
            helper: CommonStorageHelper::default(),
        })
    }

    /// The open file (its description carries the file's locks).
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// The path the file was opened at.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    fn fd(&self) -> Fd {
        Fd::Raw(self.file.as_raw_fd())
    }

    /// Whether a transfer runs inline on this thread rather than through its ring.
    fn inline(&self) -> bool {
        !borrowed::in_engine() || (self.memory_fs && borrowed::current_load() <= 1)
    }

    /// Fills `buf` from `off` (zeroes past the end of the file), on this thread's ring where an
    /// engine runs: also the I/O of the block-table formats (`crate::blocktable`).
    pub(crate) async fn read_full(&self, mut buf: &mut [u8], mut off: u64) -> io::Result<()> {
        while !buf.is_empty() {
            let n = if self.inline() {
                self.file.read_at(buf, off)?
            } else {
                // SAFETY: awaited right here; fusex never leaks a request's future (tasks are
                // dropped, not forgotten), and dropping this one waits for the read to end.
                unsafe { borrowed::read(self.fd(), buf, off) }.await?
            };
            if n == 0 {
                // Past the end of the file: reads as zeroes (imago's contract).
                buf.fill(0);
                return Ok(());
            }
            buf = &mut buf[n..];
            off += n as u64;
        }
        Ok(())
    }

    /// Whether a write of `len` bytes at `off` runs inline. Besides [`Self::inline`]'s cases, a
    /// write that extends a file on tmpfs (a cluster qcow2 just allocated at the end of the
    /// image) allocates pages, which io_uring cannot do without blocking: it would hand the
    /// write to a worker thread, a wake-up and two context switches, all while imago holds the
    /// L2 table the new cluster is entered in. Done here it is a page allocation and a copy.
    fn write_inline(&self, off: u64, len: usize) -> bool {
        self.inline()
            || (self.memory_fs && off.saturating_add(len as u64) > self.end.load(Ordering::Relaxed))
    }

    /// Writes all of `buf` at `off`, on this thread's ring where an engine runs.
    pub(crate) async fn write_full(&self, mut buf: &[u8], mut off: u64) -> io::Result<()> {
        while !buf.is_empty() {
            let n = if self.write_inline(off, buf.len()) {
                self.file.write_at(buf, off)?
            } else {
                // SAFETY: as in `read_full`.
                unsafe { borrowed::write(self.fd(), buf, off) }.await?
            };
            if n == 0 {
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
            buf = &buf[n..];
            off += n as u64;
            self.end.fetch_max(off, Ordering::Relaxed);
        }
        Ok(())
    }

    async fn fallocate(&self, mode: i32, off: u64, len: u64) -> io::Result<()> {
        // io_uring always hands fallocate to a worker thread; on tmpfs it is a memory operation,
        // cheaper done here than the hand-off.
        if borrowed::in_engine() && !self.memory_fs {
            borrowed::fallocate(self.fd(), mode, off, len)
                .await
                .map(drop)
        } else {
            // SAFETY: plain syscall on our own descriptor.
            let r = unsafe { libc::fallocate(self.file.as_raw_fd(), mode, off as i64, len as i64) };
            if r < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(())
            }
        }
    }
}

impl RingFile {
    /// Grows the file to at least `len` bytes (never shrinks it). Only for a caller that
    /// serializes every change of the file's length (the block-table allocator's lock).
    pub(crate) fn extend_to(&self, len: u64) -> io::Result<()> {
        if self.file.metadata()?.len() < len {
            self.file.set_len(len)?;
        }
        self.end.fetch_max(len, Ordering::Relaxed);
        Ok(())
    }

    /// `fdatasync(2)` of the file, on this thread's ring where an engine runs.
    pub(crate) async fn sync_data(&self) -> io::Result<()> {
        if borrowed::in_engine() {
            borrowed::fsync(self.fd(), true).await.map(drop)
        } else {
            self.file.sync_data()
        }
    }

    /// Makes `offset..offset + length` read as zeroes without writing them (zero range, or a
    /// punched hole where that is unsupported); what lies past the end of the file is skipped.
    pub(crate) async fn zero_range(&self, offset: u64, length: u64) -> io::Result<()> {
        // What lies past the end of the file reads as zeroes already: a cluster qcow2 just
        // allocated at the end of the image needs no zeroing (most allocating writes).
        let end = match self.file.metadata() {
            Ok(m) if m.is_file() => offset.saturating_add(length).min(m.len()),
            _ => offset.saturating_add(length),
        };
        if end <= offset {
            return Ok(());
        }
        let length = end - offset;
        let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        if self.no_zero_range.load(Ordering::Relaxed) {
            return self.fallocate(punch, offset, length).await;
        }
        let zero = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;
        match self.fallocate(zero, offset, length).await {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                // tmpfs lacks ZERO_RANGE: a punched hole reads back as zeroes too.
                self.no_zero_range.store(true, Ordering::Relaxed);
                self.fallocate(punch, offset, length).await
            }
            r => r,
        }
    }
}

impl fmt::Debug for RingFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingFile")
            .field("path", &self.path)
            .field("direct", &self.direct)
            .finish()
    }
}

impl fmt::Display for RingFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.path.display())
    }
}

impl Storage for RingFile {
    async fn open(opts: StorageOpenOptions) -> io::Result<Self> {
        let path = opts.get_filename().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "storage to open has no file name",
            )
        })?;
        RingFile::open_path(path, opts.get_writable(), opts.get_direct())
    }

    fn mem_align(&self) -> usize {
        if self.direct {
            DIRECT_ALIGN
        } else {
            1
        }
    }

    fn req_align(&self) -> usize {
        self.mem_align()
    }

    fn size(&self) -> io::Result<u64> {
        let m = self.file.metadata()?;
        if m.is_file() {
            Ok(m.len())
        } else {
            crate::raw::blkdev_size(self.file.as_raw_fd())
        }
    }

    fn resolve_relative_path<P: AsRef<Path>>(&self, relative: P) -> io::Result<PathBuf> {
        let relative = relative.as_ref();
        if relative.is_absolute() {
            return Ok(relative.to_path_buf());
        }
        // Relative backing names are relative to the directory of the image naming them, not
        // to fusex's working directory.
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let dir = if dir.as_os_str().is_empty() {
            std::env::current_dir()?
        } else {
            std::fs::canonicalize(dir)?
        };
        Ok(dir.join(relative))
    }

    fn get_filename(&self) -> Option<PathBuf> {
        Some(self.path.clone())
    }

    async unsafe fn pure_readv(&self, bufv: IoVectorMut<'_>, offset: u64) -> io::Result<()> {
        let mut off = offset;
        for mut s in bufv.into_inner() {
            let buf: &mut [u8] = &mut s;
            self.read_full(buf, off).await?;
            off += buf.len() as u64;
        }
        Ok(())
    }

    async unsafe fn pure_writev(&self, bufv: IoVector<'_>, offset: u64) -> io::Result<()> {
        let mut off = offset;
        for s in bufv.into_inner() {
            let buf: &[u8] = &s;
            self.write_full(buf, off).await?;
            off += buf.len() as u64;
        }
        Ok(())
    }

    async unsafe fn pure_write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        self.zero_range(offset, length).await
    }

    async unsafe fn pure_discard(&self, offset: u64, length: u64) -> io::Result<()> {
        let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        match self.fallocate(punch, offset, length).await {
            // Discard is advisory: a file system without hole punching just keeps the blocks.
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(()),
            r => r,
        }
    }

    async fn flush(&self) -> io::Result<()> {
        // No buffers of its own: everything written is already in the kernel.
        Ok(())
    }

    async fn sync(&self) -> io::Result<()> {
        self.sync_data().await
    }

    async unsafe fn invalidate_cache(&self) -> io::Result<()> {
        Ok(())
    }

    fn get_storage_helper(&self) -> &CommonStorageHelper {
        &self.helper
    }

    async fn resize(&self, new_size: u64, prealloc_mode: PreallocateMode) -> io::Result<()> {
        let old = self.size()?;
        self.file.set_len(new_size)?;
        self.end.store(new_size, Ordering::Relaxed);
        if new_size > old {
            match prealloc_mode {
                PreallocateMode::None | PreallocateMode::Zero => {}
                _ => self.fallocate(0, old, new_size - old).await?,
            }
        }
        Ok(())
    }
}
