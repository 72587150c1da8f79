//! Raw images: a regular file or a block device, byte for byte.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use engine::{Engine, Fd, Slice};

use crate::{Attrs, BackendError, BlockBackend, Capabilities, OpenError, Result, Seek};

/// How a raw backend issues one direction of data I/O. Which is fastest depends on the file: tmpfs
/// reads submitted to io_uring are punted to worker threads (~15 µs) while a plain `pread` costs ~2 µs;
/// a cached ext4 read completes inline with `RWF_NOWAIT`; an uncached or O_DIRECT one wants the ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoPath {
    /// Synchronous `pread`/`pwrite` on the queue thread: memory-backed files, which never wait on a disk.
    Inline,
    /// `preadv2(RWF_NOWAIT)` on the queue thread, the ring when it would block.
    NowaitThenRing,
    /// Always an io_uring operation.
    Ring,
    /// Memory-backed files: inline while the queue serves a single request (lowest latency), the
    /// ring once several are in flight (io_uring's workers then copy in parallel with the queue).
    Adaptive,
}

const TMPFS_MAGIC: i64 = 0x0102_1994;
const RAMFS_MAGIC: i64 = 0x8584_58f6;
/// Alignment fusex assumes for O_DIRECT (a page covers every logical block size it meets).
const DIRECT_ALIGN: u64 = 4096;

/// A raw image. Shared by every queue; each queue submits on its own ring with the same fd.
pub struct RawBackend {
    file: File,
    /// A second, buffered descriptor for requests that O_DIRECT cannot take (unaligned ones).
    buffered: Option<File>,
    size: AtomicU64,
    resize_lock: Mutex<()>,
    block_device: bool,
    writable: bool,
    direct: bool,
    read_path: IoPath,
    write_path: IoPath,
    /// tmpfs/ramfs: never waits on a device, with or without O_DIRECT.
    memory_fs: bool,
}

impl RawBackend {
    /// Opens `path`; `io_path` forces a data path (measurements), `None` probes the best one.
    pub fn open(
        path: &Path,
        writable: bool,
        direct: bool,
        io_path: Option<IoPath>,
    ) -> std::result::Result<RawBackend, OpenError> {
        let shown = path.display().to_string();
        let meta = std::fs::metadata(path).map_err(|e| OpenError::from_io(&shown, e))?;
        let ft = meta.file_type();
        if !(ft.is_file() || ft.is_block_device()) {
            return Err(OpenError::NotFileOrDevice(shown));
        }
        let open = |direct: bool| open_image_file(path, writable, direct);
        let file = open(direct).map_err(|e| match e.raw_os_error() {
            Some(libc::EROFS | libc::EACCES | libc::EPERM | libc::ETXTBSY) if writable => {
                OpenError::ReadOnly(shown.clone())
            }
            Some(libc::EINVAL) if direct => OpenError::DirectUnsupported(shown.clone()),
            _ => OpenError::from_io(&shown, e),
        })?;
        let buffered = if direct {
            Some(open(false).map_err(|e| OpenError::from_io(&shown, e))?)
        } else {
            None
        };
        let block_device = ft.is_block_device();
        let size = if block_device {
            blkdev_size(file.as_raw_fd()).map_err(|e| OpenError::from_io(&shown, e))?
        } else {
            meta.len()
        };
        let memory_fs = is_memory_fs(&file);
        let (read_path, write_path) = match io_path {
            Some(p) => (
                p,
                if p == IoPath::NowaitThenRing {
                    IoPath::Ring
                } else {
                    p
                },
            ),
            None if memory_fs => (IoPath::Adaptive, IoPath::Adaptive),
            None if direct => (IoPath::Ring, IoPath::Ring),
            None if nowait_read_works(&file) => (IoPath::NowaitThenRing, IoPath::Ring),
            None => (IoPath::Ring, IoPath::Ring),
        };
        tracing::debug!(path = %shown, size, ?read_path, ?write_path, direct, "opened raw image");
        Ok(RawBackend {
            file,
            buffered,
            size: AtomicU64::new(size),
            resize_lock: Mutex::new(()),
            block_device,
            writable,
            direct,
            read_path,
            write_path,
            memory_fs,
        })
    }

    /// The data paths chosen for reads and writes.
    pub fn io_paths(&self) -> (IoPath, IoPath) {
        (self.read_path, self.write_path)
    }

    /// The descriptor that carries the image's locks (the O_DIRECT one when there are two).
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// The image's descriptor (for passthrough registration later).
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// The uid owning the image file (or device node): who may set its times without
    /// `CAP_FOWNER`.
    pub fn owner(&self) -> std::io::Result<u32> {
        Ok(self.file.metadata()?.uid())
    }

    /// Every descriptor data I/O goes to (for registering them with a ring as fixed files).
    pub fn io_fds(&self) -> Vec<RawFd> {
        std::iter::once(&self.file)
            .chain(self.buffered.as_ref())
            .map(AsRawFd::as_raw_fd)
            .collect()
    }

    /// The data path for one transfer: O_DIRECT on a device always goes through the ring (it
    /// waits for the device); `Adaptive` resolves by how busy the calling queue is.
    fn pick(&self, eng: &Engine, configured: IoPath, direct_fd: bool) -> IoPath {
        let p = if direct_fd && !self.memory_fs {
            IoPath::Ring
        } else {
            configured
        };
        match p {
            IoPath::Adaptive if eng.load() > 1 => IoPath::Ring,
            IoPath::Adaptive => IoPath::Inline,
            p => p,
        }
    }

    /// Picks the file for a transfer: O_DIRECT needs aligned offset, length and memory.
    fn file_for(&self, win: &Slice, off: u64) -> (&File, bool) {
        let bits = win.addr() as u64 | win.len() as u64 | off;
        match &self.buffered {
            Some(b) if !bits.is_multiple_of(DIRECT_ALIGN) => (b, false),
            _ => (&self.file, self.direct),
        }
    }

    fn ring_fd(&self) -> Fd {
        Fd::Raw(self.file.as_raw_fd())
    }

    /// One read attempt on the data path chosen for it.
    async fn read_once(
        &self,
        eng: &Engine,
        mut win: Slice,
        pos: u64,
    ) -> (io::Result<usize>, Slice) {
        let (file, direct) = self.file_for(&win, pos);
        let ring = Fd::Raw(file.as_raw_fd());
        match self.pick(eng, self.read_path, direct) {
            IoPath::Inline => (file.read_at(win.as_mut_slice(), pos), win),
            IoPath::NowaitThenRing => match read_nowait(file, win.as_mut_slice(), pos) {
                Ok(n) if n > 0 => (Ok(n), win),
                // 0 may mean EOF or "nothing cached", EAGAIN "would block": ask the ring.
                Ok(_) => eng.read(ring, win, pos).await,
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => eng.read(ring, win, pos).await,
                Err(e) => (Err(e), win),
            },
            IoPath::Ring | IoPath::Adaptive => eng.read(ring, win, pos).await,
        }
    }
}

/// Opens an image file for reading (and writing), close-on-exec, with O_DIRECT if `direct`.
pub(crate) fn open_image_file(path: &Path, writable: bool, direct: bool) -> io::Result<File> {
    let mut o = std::fs::OpenOptions::new();
    o.read(true).write(writable);
    let mut flags = libc::O_CLOEXEC;
    if direct {
        flags |= libc::O_DIRECT;
    }
    o.custom_flags(flags);
    o.open(path)
}

/// The largest size `f`'s filesystem lets this file reach (the kernel's `s_maxbytes`, per inode on
/// ext4). No syscall reports it, but `lseek(SEEK_SET)` refuses an offset past it with EINVAL, so
/// a binary search over the 63 bits of `off_t` finds it in 63 calls, once, at open.
pub(crate) fn file_size_limit(f: &File) -> u64 {
    let fd = f.as_raw_fd();
    // SAFETY: lseek on a valid fd moves only this open file description's position, which fusex
    // never uses (all I/O is positional).
    let accepts = |off: u64| unsafe { libc::lseek(fd, off as libc::off_t, libc::SEEK_SET) >= 0 };
    let (mut ok, mut bad) = (0u64, i64::MAX as u64 + 1);
    if accepts(bad - 1) {
        return bad - 1;
    }
    while bad - ok > 1 {
        let mid = ok + (bad - ok) / 2;
        if accepts(mid) {
            ok = mid;
        } else {
            bad = mid;
        }
    }
    ok
}

pub(crate) fn is_memory_fs(f: &File) -> bool {
    // SAFETY: statfs writes into a zeroed, properly sized struct; fd is valid.
    unsafe {
        let mut s: libc::statfs = std::mem::zeroed();
        libc::fstatfs(f.as_raw_fd(), &mut s) == 0
            && matches!(s.f_type as i64, TMPFS_MAGIC | RAMFS_MAGIC)
    }
}

fn nowait_read_works(f: &File) -> bool {
    let mut byte = [0u8; 1];
    let iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: one iovec over a live local byte.
    let r = unsafe { libc::preadv2(f.as_raw_fd(), &iov, 1, 0, libc::RWF_NOWAIT) };
    r >= 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EAGAIN)
}

pub(crate) fn blkdev_size(fd: RawFd) -> io::Result<u64> {
    let mut size: u64 = 0;
    // BLKGETSIZE64 = _IOR(0x12, 114, size_t)
    const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
    // SAFETY: the ioctl writes one u64 into `size`.
    if unsafe { libc::ioctl(fd, BLKGETSIZE64, &mut size) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

fn cvt(r: isize) -> io::Result<usize> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

impl BlockBackend for RawBackend {
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    fn splice_fd(&self) -> Option<RawFd> {
        // The buffered descriptor: a splice from an O_DIRECT one would copy into fresh pages.
        self.memory_fs
            .then(|| self.buffered.as_ref().unwrap_or(&self.file).as_raw_fd())
    }

    fn refresh_size(&self) -> Result<u64> {
        let _g = self.resize_lock.lock().unwrap_or_else(|e| e.into_inner());
        let len = if self.block_device {
            blkdev_size(self.file.as_raw_fd())?
        } else {
            self.file.metadata()?.len()
        };
        self.size.store(len, Ordering::Release);
        Ok(len)
    }

    fn size_limit(&self) -> u64 {
        if self.block_device {
            return self.size();
        }
        file_size_limit(&self.file)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            writable: self.writable,
            resize: !self.block_device,
            passthrough: if self.block_device {
                crate::PassthroughSource::BlockDevice
            } else {
                crate::PassthroughSource::File(self.fd())
            },
            ..Capabilities::default()
        }
    }

    async fn attrs(&self, _eng: &Engine) -> Result<Attrs> {
        let m = self.file.metadata()?;
        Ok(Attrs {
            perm: m.mode() & 0o7777,
            uid: m.uid(),
            gid: m.gid(),
            allocated: if self.block_device {
                self.size()
            } else {
                m.blocks() * 512
            },
            atime: (m.atime(), m.atime_nsec() as u32),
            mtime: (m.mtime(), m.mtime_nsec() as u32),
            ctime: (m.ctime(), m.ctime_nsec() as u32),
        })
    }

    async fn read_at(&self, eng: &Engine, mut win: Slice, off: u64) -> (Result<usize>, Slice) {
        let whole = (win.start(), win.end());
        let mut done = 0usize;
        while !win.is_empty() {
            let (r, back) = self.read_once(eng, win, off + done as u64).await;
            win = back;
            match r {
                Ok(0) => break,
                Ok(n) => {
                    done += n;
                    win.advance(n);
                }
                Err(e) => return (Err(e.into()), restore(win, whole)),
            }
        }
        (Ok(done), restore(win, whole))
    }

    async fn write_at(&self, eng: &Engine, mut win: Slice, off: u64) -> (Result<usize>, Slice) {
        let whole = (win.start(), win.end());
        let mut done = 0usize;
        while !win.is_empty() {
            let pos = off + done as u64;
            let (file, direct) = self.file_for(&win, pos);
            let (r, back) = match self.pick(eng, self.write_path, direct) {
                IoPath::Inline => (file.write_at(win.as_slice(), pos), win),
                _ => eng.write(Fd::Raw(file.as_raw_fd()), win, pos).await,
            };
            win = back;
            match r {
                Ok(0) => {
                    let e = io::Error::from_raw_os_error(libc::EIO);
                    return (partial(done, e), restore(win, whole));
                }
                Ok(n) => {
                    done += n;
                    win.advance(n);
                }
                Err(e) => return (partial(done, e), restore(win, whole)),
            }
        }
        (Ok(done), restore(win, whole))
    }

    async fn flush(&self, eng: &Engine) -> Result<()> {
        Ok(eng.fsync(self.ring_fd(), true).await?)
    }

    async fn discard(&self, eng: &Engine, off: u64, len: u64) -> Result<()> {
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        Ok(eng.fallocate(self.ring_fd(), mode, off, len).await?)
    }

    async fn write_zeroes(&self, eng: &Engine, off: u64, len: u64) -> Result<()> {
        let fd = self.ring_fd();
        let zero = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;
        match eng.fallocate(fd, zero, off, len).await {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                // tmpfs and some devices lack ZERO_RANGE: punching a hole reads back zeroes too.
                let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
                Ok(eng.fallocate(fd, punch, off, len).await?)
            }
            r => Ok(r?),
        }
    }

    async fn allocate(&self, eng: &Engine, off: u64, len: u64) -> Result<()> {
        if self.block_device {
            return Ok(());
        }
        Ok(eng
            .fallocate(self.ring_fd(), libc::FALLOC_FL_KEEP_SIZE, off, len)
            .await?)
    }

    async fn seek(&self, _eng: &Engine, off: u64, whence: Seek) -> Result<Option<u64>> {
        let size = self.size();
        if self.block_device {
            return Ok(match whence {
                Seek::Data if off < size => Some(off),
                Seek::Data => None,
                Seek::Hole => Some(size.max(off)),
            });
        }
        let w = match whence {
            Seek::Data => libc::SEEK_DATA,
            Seek::Hole => libc::SEEK_HOLE,
        };
        // SAFETY: lseek on our own fd; SEEK_DATA/HOLE do not move anything the queues depend on
        // (all data I/O is positional).
        let r = unsafe { libc::lseek(self.file.as_raw_fd(), off as i64, w) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                return Ok(None);
            }
            return Err(e.into());
        }
        Ok(Some(r as u64))
    }

    async fn resize(&self, _eng: &Engine, new_size: u64) -> Result<()> {
        if self.block_device {
            return Err(BackendError::Unsupported);
        }
        let _g = self.resize_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.file.set_len(new_size)?;
        self.size.store(new_size, Ordering::Release);
        Ok(())
    }

    async fn grow_to(&self, _eng: &Engine, new_size: u64) -> Result<()> {
        if self.block_device {
            return Err(BackendError::Unsupported);
        }
        let _g = self.resize_lock.lock().unwrap_or_else(|e| e.into_inner());
        if new_size > self.size.load(Ordering::Acquire) {
            // The file may be longer than we know (passthrough writes extend it behind our back):
            // growing must never cut it.
            let len = self.file.metadata()?.len();
            if new_size > len {
                self.file.set_len(new_size)?;
            }
            self.size.store(new_size.max(len), Ordering::Release);
        }
        Ok(())
    }

    fn written_to(&self, end: u64) {
        self.size.fetch_max(end, Ordering::AcqRel);
    }

    fn set_times(&self, atime: Option<(i64, u32)>, mtime: Option<(i64, u32)>) -> Result<()> {
        set_file_times(self.file.as_raw_fd(), atime, mtime)
    }
}

/// `futimens(2)` with `None` meaning "leave as is".
pub(crate) fn set_file_times(
    fd: RawFd,
    atime: Option<(i64, u32)>,
    mtime: Option<(i64, u32)>,
) -> Result<()> {
    let ts = |t: Option<(i64, u32)>| match t {
        Some((s, ns)) => libc::timespec {
            tv_sec: s,
            tv_nsec: i64::from(ns),
        },
        None => libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
    };
    let times = [ts(atime), ts(mtime)];
    // SAFETY: futimens reads two timespecs from a live array.
    if unsafe { libc::futimens(fd, times.as_ptr()) } < 0 {
        return Err(io::Error::last_os_error().into());
    }
    Ok(())
}

/// `preadv2(RWF_NOWAIT)`: completes from the page cache or says `EAGAIN`, never waits.
fn read_nowait(file: &File, dst: &mut [u8], pos: u64) -> io::Result<usize> {
    let iov = libc::iovec {
        iov_base: dst.as_mut_ptr().cast(),
        iov_len: dst.len(),
    };
    // SAFETY: one iovec over a live, exclusively borrowed slice of exactly its length.
    cvt(unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, pos as i64, libc::RWF_NOWAIT) })
}

/// The window as the caller gave it, `(start, end)`, however far the transfer advanced it.
fn restore(win: Slice, (start, end): (usize, usize)) -> Slice {
    win.into_inner().slice(start..end)
}

/// Bytes that landed before an error count as a short write; with none, the error.
fn partial(done: usize, e: io::Error) -> Result<usize> {
    if done > 0 {
        Ok(done)
    } else {
        Err(e.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::EngineConfig;
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    /// The probe finds the exact boundary lseek enforces: tmpfs holds what `off_t` addresses;
    /// ext4 (where the temporary directory is here) 16 TiB less one block.
    #[test]
    fn size_limit_is_the_largest_offset_lseek_accepts() {
        let shm = tempfile::NamedTempFile::new_in("/dev/shm").unwrap();
        assert_eq!(file_size_limit(shm.as_file()), i64::MAX as u64);
        let f = tempfile::NamedTempFile::new().unwrap();
        let limit = file_size_limit(f.as_file());
        let fd = f.as_file().as_raw_fd();
        // SAFETY: lseek on a file this test owns.
        let seek = |off: u64| unsafe { libc::lseek(fd, off as libc::off_t, libc::SEEK_SET) };
        assert_eq!(seek(limit), limit as libc::off_t);
        if limit < i64::MAX as u64 {
            assert_eq!(seek(limit + 1), -1, "past the limit {limit}");
        }
        assert!(
            limit >= 1 << 40,
            "a limit of {limit} bytes is implausibly small"
        );
    }

    fn image(len: usize) -> (tempfile::NamedTempFile, Vec<u8>) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let data: Vec<u8> = (0..len).map(|i| (i * 31 % 253) as u8).collect();
        f.write_all(&data).unwrap();
        (f, data)
    }

    #[test]
    fn every_io_path_reads_and_writes_the_same_bytes() {
        for path in [
            IoPath::Inline,
            IoPath::Ring,
            IoPath::NowaitThenRing,
            IoPath::Adaptive,
        ] {
            for register in [false, true] {
                let (f, mut data) = image(3 * 4096 + 100);
                let b = RawBackend::open(f.path(), true, false, Some(path)).unwrap();
                let eng = Engine::new(&EngineConfig {
                    buffers: 1,
                    buffer_size: 16384,
                    register_buffers: register,
                    ..Default::default()
                })
                .unwrap();
                let buf = eng.take_buffer().unwrap();
                // A read crossing EOF is short.
                let (n, win) = eng
                    .block_on(b.read_at(&eng, buf.slice(4096..4096 + 8192), 2 * 4096))
                    .unwrap();
                let n = n.unwrap();
                assert_eq!(n, 4096 + 100, "{path:?}");
                assert_eq!(&win.as_slice()[..n], &data[2 * 4096..], "{path:?}");
                assert_eq!(
                    (win.start(), win.len()),
                    (4096, 8192),
                    "window given back whole"
                );
                // A write at an odd offset lands byte-exact.
                let mut buf = win.into_inner();
                buf.as_mut_slice()[..777].fill(0xee);
                let (n, _) = eng
                    .block_on(b.write_at(&eng, buf.slice(0..777), 5))
                    .unwrap();
                assert_eq!(n.unwrap(), 777);
                data[5..782].fill(0xee);
                let mut back = vec![0u8; data.len()];
                f.as_file().read_exact_at(&mut back, 0).unwrap();
                assert_eq!(back, data, "{path:?}");
                eng.block_on(b.flush(&eng)).unwrap().unwrap();
            }
        }
    }

    #[test]
    fn grow_resize_and_block_status() {
        let (f, _) = image(8192);
        let b = RawBackend::open(f.path(), true, false, None).unwrap();
        let eng = Engine::new(&EngineConfig::default()).unwrap();
        let on = |fut| eng.block_on(fut).unwrap();
        assert_eq!(b.size(), 8192);
        on(b.grow_to(&eng, 4096)).unwrap();
        assert_eq!(b.size(), 8192, "grow_to never shrinks");
        on(b.grow_to(&eng, 1 << 20)).unwrap();
        assert_eq!(b.size(), 1 << 20);
        assert_eq!(f.as_file().metadata().unwrap().len(), 1 << 20);
        // The grown tail is a hole (on filesystems with holes), and the data is data.
        assert_eq!(
            eng.block_on(b.seek(&eng, 0, Seek::Data)).unwrap().unwrap(),
            Some(0)
        );
        let hole = eng
            .block_on(b.seek(&eng, 0, Seek::Hole))
            .unwrap()
            .unwrap()
            .unwrap();
        assert!((8192..=1 << 20).contains(&hole));
        eng.block_on(b.resize(&eng, 4096)).unwrap().unwrap();
        assert_eq!(b.size(), 4096);
        assert_eq!(
            eng.block_on(b.seek(&eng, 4096, Seek::Data))
                .unwrap()
                .unwrap(),
            None,
            "no data at EOF"
        );
    }

    /// A write past the end extends the file by exactly what was written, and `written_to`
    /// makes the size follow without a syscall.
    #[test]
    fn appends_grow_by_what_was_written() {
        let (f, _) = image(4096);
        let b = RawBackend::open(f.path(), true, false, Some(IoPath::Ring)).unwrap();
        let eng = Engine::new(&EngineConfig {
            buffers: 1,
            buffer_size: 8192,
            ..Default::default()
        })
        .unwrap();
        let mut buf = eng.take_buffer().unwrap();
        buf.as_mut_slice().fill(0x5a);
        let (n, _) = eng
            .block_on(b.write_at(&eng, buf.slice(0..6000), 4096))
            .unwrap();
        let n = n.unwrap();
        assert_eq!(n, 6000);
        b.written_to(4096 + n as u64);
        assert_eq!(b.size(), 10096);
        assert_eq!(f.as_file().metadata().unwrap().len(), 10096);
        b.written_to(100);
        assert_eq!(b.size(), 10096, "never shrinks");
    }

    /// A write that fails after some bytes landed reports those bytes: here a full filesystem
    /// (a 64 KiB tmpfs) stops a 128 KiB write part way.
    #[test]
    fn a_write_cut_short_reports_what_landed() {
        let dir = tempfile::tempdir().unwrap();
        let Some(_mnt) = TinyTmpfs::mount(dir.path()) else {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI runs as root and must be able to mount a tmpfs"
            );
            eprintln!("not root: cannot mount a small tmpfs; skipped outside CI");
            return;
        };
        let p = dir.path().join("img");
        std::fs::write(&p, b"").unwrap();
        let b = RawBackend::open(&p, true, false, Some(IoPath::Ring)).unwrap();
        let eng = Engine::new(&EngineConfig {
            buffers: 1,
            buffer_size: 128 << 10,
            ..Default::default()
        })
        .unwrap();
        let buf = eng.take_buffer().unwrap();
        let (n, win) = eng
            .block_on(b.write_at(&eng, buf.slice(0..128 << 10), 0))
            .unwrap();
        let n = n.expect("bytes landed before ENOSPC: a short write, not an error");
        assert!(n > 0 && n < 128 << 10, "short write: {n}");
        assert_eq!(std::fs::metadata(&p).unwrap().len(), n as u64);
        assert_eq!(win.len(), 128 << 10, "window given back whole");
        // Nothing fits any more: now it is an error.
        let (r, _) = eng.block_on(b.write_at(&eng, win, 1 << 20)).unwrap();
        assert_eq!(r.unwrap_err().errno(), libc::ENOSPC);
    }

    /// A 64 KiB tmpfs mounted for one test, unmounted on drop.
    struct TinyTmpfs(std::ffi::CString);

    impl TinyTmpfs {
        fn mount(at: &Path) -> Option<TinyTmpfs> {
            use std::os::unix::ffi::OsStrExt;
            let target = std::ffi::CString::new(at.as_os_str().as_bytes()).ok()?;
            // SAFETY: mount(2) with NUL-terminated strings that outlive the call.
            let r = unsafe {
                libc::mount(
                    c"tmpfs".as_ptr(),
                    target.as_ptr(),
                    c"tmpfs".as_ptr(),
                    0,
                    c"size=64k".as_ptr().cast(),
                )
            };
            (r == 0).then_some(TinyTmpfs(target))
        }
    }

    impl Drop for TinyTmpfs {
        fn drop(&mut self) {
            // SAFETY: umount2 of the path this guard mounted.
            unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
        }
    }

    #[test]
    fn open_errors_name_the_problem() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("img");
        std::fs::write(&p, [0u8; 4096]).unwrap();
        assert!(RawBackend::open(&p, false, false, None).is_ok());
        assert!(matches!(
            RawBackend::open(&dir.path().join("missing"), false, false, None),
            Err(OpenError::NotFound(_))
        ));
        assert!(matches!(
            RawBackend::open(dir.path(), false, false, None),
            Err(OpenError::NotFileOrDevice(_))
        ));
    }
}
