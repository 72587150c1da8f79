//! NBD exports (`nbd://`, `nbd+unix://`) served with fusex's own client on the queues' rings.
//!
//! Each queue thread has its own connection, made on its first request (the connection made at
//! start-up to check the export goes to the first queue that asks), when the server advertises
//! multi-conn; otherwise fusex runs one queue, so there is exactly one connection. A READ's data
//! lands in the FUSE request's own buffer: the socket receive is given that window.
//!
//! A broken connection fails its requests with `EIO` (they are not retried: a request that may
//! have reached the server is not replayed behind the application's back, and the application
//! sees the failure at once instead of hanging). The next request on that queue reconnects; if
//! that fails, requests fail with `EIO` without trying again until `reconnect_delay` passed, and
//! the delay doubles per failure up to 30 s (or `reconnect_delay`, if larger).

mod conn;
mod connect;
mod tls;

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use engine::{Engine, Slice};
use nbd::wire::Command;
use nbd::{Export, NbdUri};

use crate::{Attrs, BackendError, BlockBackend, Capabilities, OpenError, Result, Seek};
use conn::Conn;
pub use connect::ConnectError;
use connect::Connected;
use tls::TlsClient;

/// How to serve an NBD export.
#[derive(Clone, Copy, Debug)]
pub struct NbdOptions {
    /// Open for writing (refused if the server says the export is read-only).
    pub writable: bool,
    /// Writes carry `NBD_CMD_FLAG_FUA` (for `--writethrough`) when the server supports it.
    pub fua: bool,
    /// How long a connection may make no progress on requests in flight (and how long
    /// connecting may take) before it is given up.
    pub timeout: Duration,
    /// Wait after a failed reconnect before the next attempt (doubling per failure).
    pub reconnect_delay: Duration,
}

impl Default for NbdOptions {
    fn default() -> Self {
        NbdOptions {
            writable: false,
            fua: false,
            timeout: Duration::from_secs(30),
            reconnect_delay: Duration::from_secs(1),
        }
    }
}

/// Longest wait between reconnect attempts (unless `reconnect_delay` itself is longer).
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Largest range one TRIM, WRITE_ZEROES or BLOCK_STATUS request covers.
const MAX_RANGE: u64 = 1 << 30;

static NEXT_ID: AtomicUsize = AtomicUsize::new(1);

/// An export of an NBD server.
pub struct NbdBackend {
    id: usize,
    uri: NbdUri,
    export: Export,
    opts: NbdOptions,
    /// TLS settings (`nbds` URIs), made once at open: reconnects reuse them (the certificate
    /// files may not be readable after the privilege drop).
    tls: Option<TlsClient>,
    /// The connection made at open, for the first queue that needs one.
    first: Mutex<Option<Connected>>,
    created: (i64, u32),
}

/// A queue thread's connection to one backend, and its reconnect schedule.
struct PerThread {
    backend: usize,
    conn: Option<Rc<Conn>>,
    retry_at: Option<Instant>,
    delay: Duration,
}

thread_local! {
    /// The connections of this thread, one per backend (in practice one): looked up per request
    /// without a lock.
    static CONNS: RefCell<Vec<PerThread>> = const { RefCell::new(Vec::new()) };
}

impl NbdBackend {
    /// Connects to the server `spec` (an NBD URI) names and negotiates its export.
    pub fn open(spec: &str, opts: NbdOptions) -> std::result::Result<NbdBackend, OpenError> {
        let uri = NbdUri::parse(spec).map_err(|e| OpenError::Nbd(e.to_string()))?;
        let tls = tls::client(&uri)
            .map_err(|e| OpenError::Nbd(format!("{}: {e}", connect::describe(&uri))))?;
        let first = connect::connect(&uri, tls.as_ref(), opts.timeout)
            .map_err(|e| OpenError::Nbd(e.to_string()))?;
        let export = first.export;
        if opts.writable && export.has(nbd::FLAG_READ_ONLY) {
            return Err(OpenError::Nbd(format!(
                "{}: the server exports it read-only: drop --writable",
                connect::describe(&uri)
            )));
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Ok(NbdBackend {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            uri,
            export,
            opts,
            tls,
            first: Mutex::new(Some(first)),
            created: (now.as_secs() as i64, now.subsec_nanos()),
        })
    }

    /// Whether the server allows several connections to the export (`NBD_FLAG_CAN_MULTI_CONN`):
    /// only then may several queues each have their own.
    pub fn multi_conn(&self) -> bool {
        self.export.has(nbd::FLAG_CAN_MULTI_CONN)
    }

    /// The export as negotiated (size, flags, block sizes), for logs.
    pub fn export(&self) -> &Export {
        &self.export
    }

    /// Whether the connection is TLS (`nbds` URIs), for logs.
    pub fn tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The server, as a user would name it.
    pub fn server(&self) -> String {
        connect::describe(&self.uri)
    }

    fn fua(&self) -> bool {
        self.opts.fua && self.export.has(nbd::FLAG_SEND_FUA)
    }

    /// This thread's connection, made (or remade) if needed.
    fn conn(&self) -> Result<Rc<Conn>> {
        CONNS.with(|c| {
            let mut all = c.borrow_mut();
            let i = match all.iter().position(|p| p.backend == self.id) {
                Some(i) => i,
                None => {
                    all.push(PerThread {
                        backend: self.id,
                        conn: None,
                        retry_at: None,
                        delay: self.opts.reconnect_delay,
                    });
                    all.len() - 1
                }
            };
            let pt = &mut all[i];
            match &pt.conn {
                Some(c) if !c.broken() => return Ok(c.clone()),
                Some(_) => {
                    // Just broke: try again at once (the server may be back already).
                    pt.conn = None;
                    pt.retry_at = None;
                }
                None => {}
            }
            let now = Instant::now();
            if pt.retry_at.is_some_and(|t| now < t) {
                return Err(BackendError::Io(std::io::Error::from_raw_os_error(
                    libc::EIO,
                )));
            }
            let first = self.first.lock().map(|mut f| f.take()).unwrap_or(None);
            let made = match first {
                Some(c) => Ok(c),
                None => self.reconnect(),
            };
            match made {
                Ok(Connected { sock, export, tls }) => {
                    if pt.retry_at.take().is_some() {
                        tracing::info!("NBD: reconnected to {}", self.server());
                    }
                    pt.delay = self.opts.reconnect_delay;
                    let c = Rc::new(Conn::new(
                        sock,
                        tls,
                        export,
                        self.opts.timeout,
                        self.opts.writable,
                    ));
                    pt.conn = Some(c.clone());
                    Ok(c)
                }
                Err(e) => {
                    tracing::warn!(
                        "NBD: reconnecting failed: {e}; next attempt in {:?}",
                        pt.delay
                    );
                    pt.retry_at = Some(now + pt.delay);
                    pt.delay = (pt.delay * 2).min(MAX_BACKOFF.max(self.opts.reconnect_delay));
                    Err(BackendError::Io(std::io::Error::from_raw_os_error(
                        libc::EIO,
                    )))
                }
            }
        })
    }

    /// A new connection to the same export, checked to still be the same size and as writable.
    fn reconnect(&self) -> std::result::Result<Connected, String> {
        let c = connect::connect(&self.uri, self.tls.as_ref(), self.opts.timeout)
            .map_err(|e| e.to_string())?;
        let e = c.export;
        if e.size != self.export.size {
            return Err(format!(
                "the export changed size ({} -> {} bytes)",
                self.export.size, e.size
            ));
        }
        if self.opts.writable && e.has(nbd::FLAG_READ_ONLY) {
            return Err("the export became read-only".into());
        }
        Ok(c)
    }

    fn aligned(&self, conn: &Conn, off: u64, len: u64) -> Result<()> {
        let m = u64::from(conn.export().min_block.max(1));
        if !off.is_multiple_of(m) || !len.is_multiple_of(m) {
            return Err(errno(libc::EINVAL));
        }
        Ok(())
    }

    /// READ or WRITE of `win` at `off`, split at the server's maximum payload.
    async fn transfer(
        &self,
        eng: &Engine,
        cmd: Command,
        win: Slice,
        off: u64,
    ) -> (Result<usize>, Slice) {
        let n = (self.export.size.saturating_sub(off)).min(win.len() as u64) as usize;
        if n == 0 {
            return (Ok(0), win);
        }
        let conn = match self.conn() {
            Ok(c) => c,
            Err(e) => return (Err(e), win),
        };
        if let Err(e) = self.aligned(&conn, off, n as u64) {
            return (Err(e), win);
        }
        let flags = if cmd == Command::Write && self.fua() {
            nbd::CMD_FLAG_FUA
        } else {
            0
        };
        let max = conn.export().max_payload.max(conn.export().min_block) as usize;
        let (start, end) = (win.start(), win.end());
        let mut buf = win.into_inner();
        let mut done = 0;
        while done < n {
            let len = (n - done).min(max);
            let piece = buf.slice(start + done..start + done + len);
            let (r, back) = conn
                .request(eng, cmd, flags, off + done as u64, len as u32, Some(piece))
                .await;
            let Some(back) = back else {
                // Unreachable in fusex (see conn.rs): a window is only lost if the receiver's
                // future is dropped while its task lives on. Nothing can be answered then.
                tracing::error!("NBD: a request's window was lost");
                return std::future::pending().await;
            };
            buf = back.into_inner();
            if let Err(e) = r {
                let out = buf.slice(start..end);
                return if done > 0 && cmd == Command::Write {
                    (Ok(done), out)
                } else {
                    (Err(errno(e)), out)
                };
            }
            done += len;
        }
        (Ok(n), buf.slice(start..end))
    }

    /// A request without data (FLUSH, TRIM, WRITE_ZEROES, BLOCK_STATUS).
    async fn command(
        &self,
        eng: &Engine,
        cmd: Command,
        flags: u16,
        off: u64,
        len: u32,
    ) -> Result<conn::Outcome> {
        let conn = self.conn()?;
        let (r, _) = conn.request(eng, cmd, flags, off, len, None).await;
        r.map_err(errno)
    }

    async fn zero(&self, eng: &Engine, off: u64, len: u64, flags: u16) -> Result<()> {
        if !self.opts.writable {
            return Err(errno(libc::EROFS));
        }
        if !self.export.has(nbd::FLAG_SEND_WRITE_ZEROES) {
            return Err(BackendError::Unsupported);
        }
        let conn = self.conn()?;
        self.aligned(&conn, off, len)?;
        let fua = if self.fua() { nbd::CMD_FLAG_FUA } else { 0 };
        self.ranged(eng, Command::WriteZeroes, flags | fua, off, len)
            .await
    }

    async fn ranged(
        &self,
        eng: &Engine,
        cmd: Command,
        flags: u16,
        off: u64,
        len: u64,
    ) -> Result<()> {
        let end = off.saturating_add(len).min(self.export.size);
        let mut at = off;
        while at < end {
            let n = (end - at).min(MAX_RANGE);
            self.command(eng, cmd, flags, at, n as u32).await?;
            at += n;
        }
        Ok(())
    }
}

fn errno(e: i32) -> BackendError {
    BackendError::Io(std::io::Error::from_raw_os_error(e))
}

impl BlockBackend for NbdBackend {
    fn size(&self) -> u64 {
        self.export.size
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            writable: self.opts.writable,
            resize: false,
            raw_file: false,
        }
    }

    fn durable_writes(&self) -> bool {
        self.fua()
    }

    async fn attrs(&self, _eng: &Engine) -> Result<Attrs> {
        // SAFETY: getuid/getgid cannot fail.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        Ok(Attrs {
            perm: if self.opts.writable { 0o644 } else { 0o444 },
            uid,
            gid,
            // Counting allocated bytes would walk the whole export with BLOCK_STATUS on every
            // stat: the export reports itself fully allocated (docs/nbd.md).
            allocated: self.export.size,
            atime: self.created,
            mtime: self.created,
            ctime: self.created,
        })
    }

    async fn read_at(&self, eng: &Engine, win: Slice, off: u64) -> (Result<usize>, Slice) {
        self.transfer(eng, Command::Read, win, off).await
    }

    async fn write_at(&self, eng: &Engine, win: Slice, off: u64) -> (Result<usize>, Slice) {
        if !self.opts.writable {
            return (Err(errno(libc::EROFS)), win);
        }
        self.transfer(eng, Command::Write, win, off).await
    }

    async fn flush(&self, eng: &Engine) -> Result<()> {
        if !self.opts.writable || !self.export.has(nbd::FLAG_SEND_FLUSH) {
            return Ok(());
        }
        self.command(eng, Command::Flush, 0, 0, 0).await.map(drop)
    }

    async fn discard(&self, eng: &Engine, off: u64, len: u64) -> Result<()> {
        // NBD_CMD_TRIM leaves the range's contents unspecified, but a punched hole must read as
        // zeroes: WRITE_ZEROES without NO_HOLE zeroes the range and lets the server deallocate it.
        self.zero(eng, off, len, 0).await
    }

    async fn write_zeroes(&self, eng: &Engine, off: u64, len: u64) -> Result<()> {
        // fallocate's ZERO_RANGE keeps the range allocated.
        self.zero(eng, off, len, nbd::CMD_FLAG_NO_HOLE).await
    }

    async fn allocate(&self, _eng: &Engine, _off: u64, _len: u64) -> Result<()> {
        // NBD has no "allocate, keep the bytes": the range is readable and writable already.
        Ok(())
    }

    async fn seek(&self, eng: &Engine, off: u64, whence: Seek) -> Result<Option<u64>> {
        let size = self.export.size;
        if off >= size {
            return Ok(match whence {
                Seek::Data => None,
                Seek::Hole => Some(off),
            });
        }
        let conn = self.conn()?;
        if conn.export().allocation_context.is_none() {
            // No block status: everything is data, the only hole is the end.
            return Ok(Some(match whence {
                Seek::Data => off,
                Seek::Hole => size,
            }));
        }
        let m = u64::from(conn.export().min_block.max(1));
        let mut at = off - off % m;
        while at < size {
            let want = (size - at).min(MAX_RANGE);
            let out = self
                .command(
                    eng,
                    Command::BlockStatus,
                    nbd::CMD_FLAG_REQ_ONE,
                    at,
                    want as u32,
                )
                .await?;
            let Some((len, flags)) = out.extent else {
                return Err(errno(libc::EIO));
            };
            let hole = flags & nbd::STATE_HOLE != 0;
            if hole == (whence == Seek::Hole) {
                return Ok(Some(at.max(off)));
            }
            at += u64::from(len).min(want);
        }
        Ok(match whence {
            Seek::Data => None,
            Seek::Hole => Some(size),
        })
    }

    async fn resize(&self, _eng: &Engine, _new_size: u64) -> Result<()> {
        Err(BackendError::Unsupported)
    }

    async fn grow_to(&self, _eng: &Engine, _new_size: u64) -> Result<()> {
        Err(BackendError::Unsupported)
    }

    fn written_to(&self, _end: u64) {}

    fn set_times(&self, _atime: Option<(i64, u32)>, _mtime: Option<(i64, u32)>) -> Result<()> {
        Ok(())
    }
}
