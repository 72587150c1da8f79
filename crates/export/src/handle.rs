//! FUSE operations on the exported file.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use backend::{BackendError, BlockBackend, Seek};
use engine::{Buf, Engine};
use fuse_abi::{
    Attr, AttrOut, FallocateIn, InHeader, Kstatfs, LseekIn, LseekOut, OpenIn, OpenOut, ReadIn,
    SetattrIn, StatfsOut, WriteIn, WriteOut, FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE,
    FALLOC_FL_ZERO_RANGE, FATTR_ATIME, FATTR_ATIME_NOW, FATTR_GID, FATTR_MODE, FATTR_MTIME,
    FATTR_MTIME_NOW, FATTR_SIZE, FATTR_UID, FOPEN_DIRECT_IO, FOPEN_KEEP_CACHE, FOPEN_NOFLUSH,
    FOPEN_PARALLEL_DIRECT_WRITES, FOPEN_PASSTHROUGH, ROOT_ID, SEEK_DATA, SEEK_HOLE,
};
use zerocopy::{Immutable, IntoBytes};

use crate::{Request, Tally};

/// How the export behaves; fixed for its lifetime.
#[derive(Clone, Copy, Debug)]
pub struct ExportConfig {
    /// Accept writes.
    pub writable: bool,
    /// Writes (and fallocate, truncate) past the end grow the image.
    pub growable: bool,
    /// Let the kernel page-cache the export instead of `FOPEN_DIRECT_IO`.
    pub kernel_cache: bool,
    /// Flush the backend after every write.
    pub writethrough: bool,
    /// How long the kernel may cache attributes. Short enough that a growable export's new size is
    /// seen soon; long enough that I/O does not trigger a GETATTR each time.
    pub attr_valid: Duration,
    /// A growable export never grows past this (bytes): writes stop there, fallocate and truncate
    /// past it fail with EFBIG, as a filesystem does at its largest file size.
    pub max_size: u64,
}

/// How opens are passed through to the image file (kernel 6.9+; see docs/passthrough.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Passthrough {
    /// Backing id of the image file (`FUSE_DEV_IOC_BACKING_OPEN`).
    pub backing_id: i32,
    /// Opens for writing are passed through too. Only where the kernel may extend the file: a
    /// growable export (its size then follows the image file, re-read on GETATTR and the other
    /// size-dependent requests). A fixed-size writable export passes only mmap of such opens through
    /// (`FOPEN_DIRECT_IO | FOPEN_PASSTHROUGH`): their reads and writes come to fusex, which stops
    /// them at the end; opens for reading are passed through entirely.
    pub write_opens: bool,
}

impl Default for ExportConfig {
    fn default() -> Self {
        ExportConfig {
            writable: false,
            growable: false,
            kernel_cache: false,
            writethrough: false,
            attr_valid: Duration::from_secs(1),
            max_size: i64::MAX as u64,
        }
    }
}

/// What to send back for a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    /// Nothing (FORGET, INTERRUPT).
    None,
    /// An error reply with this positive errno.
    Error(i32),
    /// Success with this many body bytes at the start of the payload window.
    Data(usize),
}

/// A single-file export of one backend, shared by every queue.
pub struct Export<B> {
    backend: B,
    cfg: ExportConfig,
    /// Set once INIT negotiated passthrough and the image is registered, before any OPEN.
    passthrough: OnceLock<Passthrough>,
    /// Files the kernel holds open on the export: OPENs answered with success minus RELEASEs.
    /// A stop reads it to tell whether applications (a loop device, a mounted filesystem) still
    /// use the export. Signed, because RELEASEs of files opened before a `fusex restart` may
    /// outnumber the OPENs this process saw if the handed-over count was off.
    open_files: AtomicI64,
}

type R = Result<Reply, i32>;

fn err(e: BackendError) -> i32 {
    e.errno()
}

impl<B: BlockBackend> Export<B> {
    /// An export of `backend`. `--writable` needs a backend opened for writing.
    pub fn new(backend: B, cfg: ExportConfig) -> Export<B> {
        Export {
            backend,
            cfg,
            passthrough: OnceLock::new(),
            open_files: AtomicI64::new(0),
        }
    }

    /// How many files the kernel holds open on the export right now (OPEN minus RELEASE).
    pub fn open_files(&self) -> u64 {
        u64::try_from(self.open_files.load(Ordering::Relaxed)).unwrap_or(0)
    }

    /// Starts the open-file count at `n`: the files a predecessor daemon had open when it
    /// handed the export over (`fusex restart`), whose RELEASEs come here.
    pub fn set_open_files(&self, n: u64) {
        self.open_files
            .store(i64::try_from(n).unwrap_or(i64::MAX), Ordering::Relaxed);
    }

    /// Turns passthrough on (once; before the queues start). False if it was already set.
    pub fn set_passthrough(&self, p: Passthrough) -> bool {
        self.passthrough.set(p).is_ok()
    }

    /// Passthrough in effect, if any.
    pub fn passthrough(&self) -> Option<Passthrough> {
        self.passthrough.get().copied()
    }

    /// The backend (for the final flush, passthrough setup, ...).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The configuration.
    pub fn config(&self) -> &ExportConfig {
        &self.cfg
    }

    /// Serves one request. `buf[window]` is the payload window: WRITE data at its start on entry,
    /// the reply body at its start on return; nothing is read or written past its end. The buffer
    /// is taken and given back, since backend I/O lends it to the kernel.
    pub async fn handle(
        &self,
        eng: &Engine,
        hdr: &InHeader,
        req: Request,
        mut buf: Buf,
        window: std::ops::Range<usize>,
        tally: &Tally<'_>,
    ) -> (Reply, Buf) {
        let payload = window.start;
        if hdr.nodeid != ROOT_ID
            && !matches!(
                req,
                Request::Forget(_)
                    | Request::BatchForget { .. }
                    | Request::Interrupt
                    | Request::Destroy
            )
        {
            // Only the root exists; the kernel never names another node (LOOKUP always fails).
            return (Reply::Error(libc::ENOENT), buf);
        }
        if window.start > window.end || window.end > buf.len() {
            return (Reply::Error(libc::EIO), buf);
        }
        let cap = window.end - window.start;
        let r = match req {
            Request::Read(a) => return self.read(eng, a, buf, payload, cap, tally).await,
            Request::Write(a) => return self.write(eng, a, buf, payload, cap, tally).await,
            Request::Getattr(_) => self.getattr(eng, &mut buf, payload).await,
            Request::Setattr(a) => self.setattr(eng, a, &mut buf, payload).await,
            Request::Open(a) => {
                let r = self.open(a, &mut buf, payload);
                if r.is_ok() {
                    self.open_files.fetch_add(1, Ordering::Relaxed);
                }
                r
            }
            Request::Release(_) => {
                self.open_files.fetch_sub(1, Ordering::Relaxed);
                Ok(Reply::Data(0))
            }
            Request::Flush(_) | Request::Fsync(_) => self.flush(eng, hdr.opcode, tally).await,
            Request::Fallocate(a) => self.fallocate(eng, a).await,
            Request::Lseek(a) => self.lseek(eng, a, &mut buf, payload).await,
            Request::Statfs => self.statfs(&mut buf, payload),
            Request::Lookup { .. } => Err(libc::ENOENT),
            Request::Forget(_) | Request::BatchForget { .. } | Request::Interrupt => {
                Ok(Reply::None)
            }
            Request::Destroy => Ok(Reply::Data(0)),
            Request::Init => Err(libc::EPROTO),
            // A single file has no directory operations.
            Request::Unsupported(_)
            | Request::Readlink
            | Request::Symlink { .. }
            | Request::Mknod { .. }
            | Request::Mkdir { .. }
            | Request::Unlink { .. }
            | Request::Rmdir { .. }
            | Request::Rename { .. }
            | Request::Link { .. }
            | Request::Create { .. }
            | Request::Tmpfile(_)
            | Request::Opendir(_)
            | Request::Readdir(_)
            | Request::Readdirplus(_)
            | Request::Releasedir(_)
            | Request::Fsyncdir(_)
            | Request::Setxattr { .. }
            | Request::Getxattr { .. }
            | Request::Listxattr(_)
            | Request::Removexattr { .. }
            | Request::Access(_)
            | Request::Statx(_)
            | Request::CopyFileRange(_)
            | Request::CopyFileRange64(_) => Err(libc::ENOSYS),
        };
        (r.unwrap_or_else(Reply::Error), buf)
    }

    /// Where a READ of the root can be answered by splicing from the image: the descriptor, the
    /// offset and the length, clamped as [`Export::handle`] clamps a READ into a window of `cap`
    /// bytes. `None` when the backend cannot splice or nothing is to be read (the normal path
    /// answers those). The caller counts the bytes with [`crate::Counters::read`] once they are sent.
    pub fn splice_read(
        &self,
        hdr: &InHeader,
        a: &ReadIn,
        cap: usize,
    ) -> Option<(std::os::fd::RawFd, u64, usize)> {
        if hdr.nodeid != ROOT_ID || a.size == 0 {
            return None;
        }
        let fd = self.backend.splice_fd()?;
        let size = self.backend.size();
        if a.offset >= size {
            return None;
        }
        let n = (u64::from(a.size).min(size - a.offset) as usize).min(cap);
        Some((fd, a.offset, n))
    }

    async fn read(
        &self,
        eng: &Engine,
        a: ReadIn,
        buf: Buf,
        payload: usize,
        cap: usize,
        tally: &Tally<'_>,
    ) -> (Reply, Buf) {
        let size = self.backend.size();
        if a.offset >= size || a.size == 0 {
            return (Reply::Data(0), buf);
        }
        let n = (u64::from(a.size).min(size - a.offset) as usize).min(cap);
        let started = tally.backend_start();
        let (r, win) = self
            .backend
            .read_at(eng, buf.slice(payload..payload + n), a.offset)
            .await;
        tally.backend_done(fuse_abi::Opcode::Read as u32, started);
        let buf = win.into_inner();
        match r {
            Ok(got) => {
                if got < n {
                    // The image ended before the size fusex knew: something shrank it. Learn
                    // the new size now (fixed-size writes stop there).
                    let _ = self.backend.refresh_size();
                }
                tally.read(got);
                (Reply::Data(got), buf)
            }
            Err(e) => (Reply::Error(err(e)), buf),
        }
    }

    async fn write(
        &self,
        eng: &Engine,
        a: WriteIn,
        buf: Buf,
        payload: usize,
        cap: usize,
        tally: &Tally<'_>,
    ) -> (Reply, Buf) {
        if !self.cfg.writable {
            return (Reply::Error(libc::EROFS), buf);
        }
        let mut len = (a.size as usize).min(cap) as u64;
        let Some(end) = a.offset.checked_add(len) else {
            return (Reply::Error(libc::EFBIG), buf);
        };
        // A fixed-size export ends at the image's size (ENOSPC past it, as a full device); a
        // growable one at its size limit (EFBIG past it, as a filesystem's largest file).
        let (limit, past) = if self.cfg.growable {
            (self.cfg.max_size, libc::EFBIG)
        } else {
            (self.backend.size(), libc::ENOSPC)
        };
        if end > limit {
            if a.offset >= limit {
                return (Reply::Error(past), buf);
            }
            len = limit - a.offset;
        }
        // A growable image grows by what the write put there, after it landed: nothing is
        // allocated for a write that fails, and a write cut short grows only as far as it got.
        let started = tally.backend_start();
        let (r, win) = self
            .backend
            .write_at(eng, buf.slice(payload..payload + len as usize), a.offset)
            .await;
        let mut buf = win.into_inner();
        let n = match r {
            Ok(n) => n,
            Err(e) => {
                tally.backend_done(fuse_abi::Opcode::Write as u32, started);
                return (Reply::Error(err(e)), buf);
            }
        };
        if self.cfg.growable && n > 0 {
            self.backend.written_to(a.offset + n as u64);
        }
        tally.write(n);
        if self.cfg.writethrough && !self.backend.durable_writes() {
            let r = self.backend.flush(eng).await;
            tally.backend_done(fuse_abi::Opcode::Write as u32, started);
            if let Err(e) = r {
                return (Reply::Error(err(e)), buf);
            }
            tally.flush();
        } else {
            tally.backend_done(fuse_abi::Opcode::Write as u32, started);
        }
        let out = WriteOut {
            size: n as u32,
            padding: 0,
        };
        (
            put(&mut buf, payload, &out).unwrap_or_else(Reply::Error),
            buf,
        )
    }

    /// The image length for the requests that depend on it (GETATTR, SETATTR, FALLOCATE, LSEEK:
    /// none of them on the data path), re-read from the image: the kernel extends the image file
    /// itself when writes are passed through, and another program may truncate or extend a raw
    /// image behind the export. READ and WRITE use the length last learned, which these
    /// requests, a short read and the daemon's periodic check keep current.
    fn size(&self) -> Result<u64, i32> {
        self.backend.refresh_size().map_err(err)
    }

    async fn attr(&self, eng: &Engine) -> Result<Attr, i32> {
        let size = self.size()?;
        let a = self.backend.attrs(eng).await.map_err(err)?;
        let mut perm = a.perm;
        if !self.cfg.writable {
            perm &= !0o222;
        }
        Ok(Attr {
            ino: ROOT_ID,
            size,
            blocks: a.allocated.div_ceil(512),
            atime: a.atime.0 as u64,
            mtime: a.mtime.0 as u64,
            ctime: a.ctime.0 as u64,
            atimensec: a.atime.1,
            mtimensec: a.mtime.1,
            ctimensec: a.ctime.1,
            mode: libc::S_IFREG | perm,
            nlink: 1,
            uid: a.uid,
            gid: a.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        })
    }

    async fn attr_out(&self, eng: &Engine, buf: &mut Buf, payload: usize) -> R {
        let v = self.cfg.attr_valid;
        let out = AttrOut {
            attr_valid: v.as_secs(),
            attr_valid_nsec: v.subsec_nanos(),
            dummy: 0,
            attr: self.attr(eng).await?,
        };
        put(buf, payload, &out)
    }

    async fn getattr(&self, eng: &Engine, buf: &mut Buf, payload: usize) -> R {
        self.attr_out(eng, buf, payload).await
    }

    async fn setattr(&self, eng: &Engine, a: SetattrIn, buf: &mut Buf, payload: usize) -> R {
        let cur = self.backend.attrs(eng).await.map_err(err)?;
        if a.valid & FATTR_MODE != 0 && a.mode & 0o7777 != cur.perm {
            return Err(libc::EPERM);
        }
        if (a.valid & FATTR_UID != 0 && a.uid != cur.uid)
            || (a.valid & FATTR_GID != 0 && a.gid != cur.gid)
        {
            return Err(libc::EPERM);
        }
        if a.valid & FATTR_SIZE != 0 && a.size != self.size()? {
            if !self.cfg.writable {
                return Err(libc::EROFS);
            }
            if !self.cfg.growable || !self.backend.capabilities().resize {
                return Err(libc::EPERM);
            }
            if a.size > self.cfg.max_size {
                return Err(libc::EFBIG);
            }
            self.backend.resize(eng, a.size).await.map_err(err)?;
        }
        let now = || {
            let d = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            (d.as_secs() as i64, d.subsec_nanos())
        };
        let atime = match a.valid {
            v if v & FATTR_ATIME_NOW != 0 => Some(now()),
            v if v & FATTR_ATIME != 0 => Some((a.atime as i64, a.atimensec)),
            _ => None,
        };
        let mtime = match a.valid {
            v if v & FATTR_MTIME_NOW != 0 => Some(now()),
            v if v & FATTR_MTIME != 0 => Some((a.mtime as i64, a.mtimensec)),
            _ => None,
        };
        if atime.is_some() || mtime.is_some() {
            self.backend.set_times(atime, mtime).map_err(err)?;
        }
        self.attr_out(eng, buf, payload).await
    }

    fn open(&self, a: OpenIn, buf: &mut Buf, payload: usize) -> R {
        let for_writing = a.flags as i32 & libc::O_ACCMODE != libc::O_RDONLY;
        if for_writing && !self.cfg.writable {
            return Err(libc::EROFS);
        }
        let (open_flags, backing_id) = match self.passthrough.get() {
            // Passthrough allows only DIRECT_IO, PARALLEL_DIRECT_WRITES and NOFLUSH beside it (any
            // other flag, KEEP_CACHE say, fails the application's open with EIO). A read-only open
            // has nothing to flush: NOFLUSH saves a round trip (and a backend flush) per close.
            Some(p) if !for_writing => (FOPEN_PASSTHROUGH | FOPEN_NOFLUSH, p.backing_id),
            Some(p) if p.write_opens => (FOPEN_PASSTHROUGH, p.backing_id),
            // Fixed size: read and write come here (DIRECT_IO wins over PASSTHROUGH for them, so
            // the end of the image holds); mmap, which cannot extend a file, still passes through.
            Some(p) => (
                FOPEN_PASSTHROUGH | FOPEN_DIRECT_IO | FOPEN_PARALLEL_DIRECT_WRITES,
                p.backing_id,
            ),
            None if self.cfg.kernel_cache => (FOPEN_KEEP_CACHE, 0),
            None => (FOPEN_DIRECT_IO | FOPEN_PARALLEL_DIRECT_WRITES, 0),
        };
        put(
            buf,
            payload,
            &OpenOut {
                fh: 0,
                open_flags,
                backing_id,
            },
        )
    }

    async fn flush(&self, eng: &Engine, opcode: u32, tally: &Tally<'_>) -> R {
        if self.cfg.writable {
            let started = tally.backend_start();
            let r = self.backend.flush(eng).await;
            tally.backend_done(opcode, started);
            r.map_err(err)?;
            tally.flush();
        }
        Ok(Reply::Data(0))
    }

    /// Grows the image for a fallocate range past the end, or says how much of the range fits.
    async fn fit(&self, eng: &Engine, size: u64, end: u64, keep: bool) -> Result<u64, i32> {
        if end <= size || keep {
            return Ok(end.min(size));
        }
        if !self.cfg.growable {
            return Err(libc::ENOSPC);
        }
        if end > self.cfg.max_size {
            return Err(libc::EFBIG);
        }
        self.backend.grow_to(eng, end).await.map_err(err)?;
        Ok(end)
    }

    async fn fallocate(&self, eng: &Engine, a: FallocateIn) -> R {
        if !self.cfg.writable {
            return Err(libc::EROFS);
        }
        let size = self.size()?;
        let end = a.offset.checked_add(a.length).ok_or(libc::EFBIG)?;
        let keep = a.mode & FALLOC_FL_KEEP_SIZE != 0;
        match a.mode {
            m if m == FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE => {
                let end = end.min(size);
                if a.offset < end {
                    self.backend
                        .discard(eng, a.offset, end - a.offset)
                        .await
                        .map_err(err)?;
                }
            }
            m if m & !FALLOC_FL_KEEP_SIZE == FALLOC_FL_ZERO_RANGE => {
                let end = self.fit(eng, size, end, keep).await?;
                if a.offset < end {
                    self.backend
                        .write_zeroes(eng, a.offset, end - a.offset)
                        .await
                        .map_err(err)?;
                }
            }
            m if m & !FALLOC_FL_KEEP_SIZE == 0 => {
                let end = self.fit(eng, size, end, keep).await?;
                if a.offset < end {
                    self.backend
                        .allocate(eng, a.offset, end - a.offset)
                        .await
                        .map_err(err)?;
                }
            }
            _ => return Err(libc::EOPNOTSUPP),
        }
        Ok(Reply::Data(0))
    }

    async fn lseek(&self, eng: &Engine, a: LseekIn, buf: &mut Buf, payload: usize) -> R {
        let whence = match a.whence {
            w if w == SEEK_DATA => Seek::Data,
            w if w == SEEK_HOLE => Seek::Hole,
            _ => return Err(libc::EINVAL),
        };
        let size = self.size()?;
        if a.offset >= size {
            return Err(libc::ENXIO);
        }
        match self
            .backend
            .seek(eng, a.offset, whence)
            .await
            .map_err(err)?
        {
            Some(off) => put(
                buf,
                payload,
                &LseekOut {
                    offset: off.min(size),
                },
            ),
            None => Err(libc::ENXIO),
        }
    }

    fn statfs(&self, buf: &mut Buf, payload: usize) -> R {
        let bsize = 4096u64;
        let st = Kstatfs {
            blocks: self.size()?.div_ceil(bsize),
            bsize: bsize as u32,
            frsize: bsize as u32,
            namelen: 255,
            files: 1,
            ..Kstatfs::default()
        };
        put(buf, payload, &StatfsOut { st })
    }
}

impl<B: BlockBackend + 'static> crate::Filesystem for Export<B> {
    fn serves(opcode: u32) -> bool {
        use fuse_abi::Opcode as O;
        matches!(
            fuse_abi::Opcode::from_u32(opcode),
            Some(
                O::Init
                    | O::Destroy
                    | O::Lookup
                    | O::Forget
                    | O::BatchForget
                    | O::Interrupt
                    | O::Getattr
                    | O::Setattr
                    | O::Open
                    | O::Release
                    | O::Read
                    | O::Write
                    | O::Flush
                    | O::Fsync
                    | O::Fallocate
                    | O::Lseek
                    | O::Statfs
            )
        )
    }

    async fn handle(
        &self,
        eng: &Engine,
        hdr: &InHeader,
        req: Request,
        buf: Buf,
        window: std::ops::Range<usize>,
        tally: &Tally<'_>,
    ) -> (Reply, Buf) {
        Export::handle(self, eng, hdr, req, buf, window, tally).await
    }

    fn splice_read(
        &self,
        hdr: &InHeader,
        a: &ReadIn,
        cap: usize,
    ) -> Option<(std::os::fd::RawFd, u64, usize)> {
        Export::splice_read(self, hdr, a, cap)
    }

    fn queue_stopping(&self) {
        self.backend.queue_stopping();
    }

    fn queue_ended(&self) {
        self.backend.queue_ended();
    }
}

/// Writes a reply struct at the payload window.
fn put<T: IntoBytes + Immutable>(buf: &mut Buf, payload: usize, v: &T) -> R {
    let b = v.as_bytes();
    let dst = buf
        .as_mut_slice()
        .get_mut(payload..payload + b.len())
        .ok_or(libc::EIO)?;
    dst.copy_from_slice(b);
    Ok(Reply::Data(b.len()))
}
