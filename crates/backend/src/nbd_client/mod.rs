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
//!
//! Connections are made on a short-lived connector thread (`connect::Attempt`), never on the
//! queue thread: a server that accepts and then says nothing must not freeze the queue (with
//! one queue, the whole export and its stop). The request that starts an attempt waits for it on
//! the ring; requests arriving meanwhile fail with `EIO` at once, except before a queue's first
//! connection, when they all wait.
//!
//! A server with a minimum block size above 1 takes only whole blocks: requests that are not
//! aligned to it are made whole here. A READ reads the covering blocks into a bounce buffer and
//! copies the asked part; a WRITE (and a zeroed range) reads, modifies and writes back the block
//! at each unaligned end, and sends the aligned middle as is. A read-modify-write holds its
//! block's region exclusive and every other write holds its regions shared (`RegionLocks`,
//! across queue threads), so no write to a block lands between a read-modify-write's read and
//! its write (which would undo it). With a minimum block size of 1 none of this runs.
//!
//! `st_blocks` counts the bytes `base:allocation` does not call holes, walking the export with
//! BLOCK_STATUS (many extents per reply), cached for `ALLOC_TTL` unless a write, zero or
//! punched hole went through since.
//!
//! `fusex restart` hands an NBD export over without the successor connecting first (a server
//! without multi-conn, such as qemu-nbd's default `--shared=1`, need not accept a second
//! client): the old daemon's connections close as its queues end (each flushes and says
//! `NBD_CMD_DISC`), and the successor is built with [`NbdBackend::adopt`] from the export the
//! old daemon negotiated. Nothing is connected then; each queue connects on its first request
//! through the reconnect path above, and a connection is used only if the server still exports
//! the same size and minimum block size, and writable if the export is.

mod conn;
mod connect;
mod tls;

use std::cell::RefCell;
use std::future::Future;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use engine::{Engine, Slice};
use nbd::wire::Command;
use nbd::{Export, NbdUri};

use crate::regions::RegionLocks;
use crate::{Attrs, BackendError, BlockBackend, Capabilities, OpenError, Result, Seek};
use conn::Conn;
pub use connect::ConnectError;
use connect::{Attempt, Connected};
use tls::TlsClient;

/// How to serve an NBD export.
#[derive(Clone, Copy, Debug)]
pub struct NbdOptions {
    /// Open for writing (refused if the server says the export is read-only).
    pub writable: bool,
    /// Writes carry `NBD_CMD_FLAG_FUA` (for `--writethrough`) when the server supports it.
    pub fua: bool,
    /// How long a request may wait for its whole reply (and connecting, with the NBD and TLS
    /// handshakes, may take) before the connection is given up.
    pub timeout: Duration,
    /// Wait after a failed reconnect before the next attempt (doubling per failure).
    pub reconnect_delay: Duration,
    /// `fusex restart`: the export as the predecessor daemon negotiated it. The backend is then
    /// made without connecting ([`NbdBackend::adopt`]): the predecessor may still hold the only
    /// connection the server accepts.
    pub adopt: Option<Export>,
}

impl Default for NbdOptions {
    fn default() -> Self {
        NbdOptions {
            writable: false,
            fua: false,
            timeout: Duration::from_secs(30),
            reconnect_delay: Duration::from_secs(1),
            adopt: None,
        }
    }
}

/// Longest wait between reconnect attempts (unless `reconnect_delay` itself is longer).
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// How long a `fusex restart` successor's first connection on a queue thread keeps trying
/// (every 50 ms) before its requests fail: the predecessor closed its connections before it let
/// go, but a server that takes one client at a time (nbdkit's limit filter turns a second one
/// away at once) accepts the next only once it has seen that, on its own time.
const HANDOVER_RETRY: Duration = Duration::from_secs(5);
/// Largest range one TRIM, WRITE_ZEROES or BLOCK_STATUS request covers.
const MAX_RANGE: u64 = 1 << 30;

/// How long a count of allocated bytes answers GETATTR (the export's attribute timeout) unless
/// a write went through since: a burst of `stat`s costs one walk, not one each.
const ALLOC_TTL: Duration = Duration::from_secs(1);
/// Most BLOCK_STATUS requests one count makes; past that (a huge export fragmented into more
/// extents than the server sends per reply) the export reports itself fully allocated, so a
/// GETATTR cannot stall a queue for long.
const MAX_COUNT_REQUESTS: u32 = 4096;

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
    /// Made by [`NbdBackend::adopt`]: the first connection is logged (the previous daemon let go
    /// of the server).
    adopted: bool,
    /// That line was logged: once per export, not once per queue.
    announced: AtomicBool,
    /// Threads using this backend now (an entry in their `CONNS`, until `queue_ended`): with
    /// more than one, every connection must be to a server that allows several
    /// ([`NbdBackend::check`]).
    threads: AtomicUsize,
    created: (i64, u32),
    /// Region locks for read-modify-writes; only with a minimum block size above 1.
    rmw: Option<RegionLocks>,
    /// The last count of allocated bytes, for `st_blocks`.
    alloc: AllocCache,
    /// Why the last connection attempt of any queue failed, until one succeeds again
    /// ([`BlockBackend::trouble`]). Written only when a reconnect settles, never per request.
    trouble: std::sync::Arc<Mutex<Option<String>>>,
    /// Connections made again after one was lost, and the time spent without one: written
    /// when a connection breaks or an attempt settles, never per request.
    reconnects: AtomicU64,
    outage: Mutex<Outage>,
}

/// Time without a connection to the server.
#[derive(Default)]
struct Outage {
    /// When the outage under way began.
    since: Option<Instant>,
    /// Outages that ended.
    past: Duration,
}

/// The last count of allocated bytes and whether it still holds.
#[derive(Default)]
struct AllocCache {
    /// A write, zero or punched hole went through since the last count began.
    stale: AtomicBool,
    /// A queue is counting right now: others answer with the last count meanwhile.
    counting: AtomicBool,
    /// When the last count ended, and what it found.
    last: Mutex<Option<(Instant, u64)>>,
}

/// Clears [`AllocCache::counting`] however the count ends (its future may be dropped).
struct Counting<'a>(&'a AtomicBool);

impl Drop for Counting<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// A queue thread's connection to one backend, and its reconnect schedule.
struct PerThread {
    backend: usize,
    conn: Option<Rc<Conn>>,
    /// A connection being made on a connector thread.
    connecting: Option<Attempt>,
    /// The thread had a connection once: while it makes a new one, requests fail with `EIO` at
    /// once (only the request that started the attempt waits for it). Before its first one,
    /// every request waits, so a fresh queue's first burst is not failed.
    had_one: bool,
    /// The queue stops: no new attempt, and nothing waits for one.
    stopping: bool,
    retry_at: Option<Instant>,
    delay: Duration,
}

/// What a request does about its thread's connection.
enum Step {
    Use(Rc<Conn>),
    Fail,
    /// Wait for this attempt, then look again; `mine`: the request started it, and waits at
    /// most until its waiters give up (the others are woken then).
    Wait(Attempt, bool),
}

thread_local! {
    /// The connections of this thread, one per backend (in practice one): looked up per request
    /// without a lock.
    static CONNS: RefCell<Vec<PerThread>> = const { RefCell::new(Vec::new()) };
}

impl NbdBackend {
    /// Connects to the server `spec` (an NBD URI) names and negotiates its export; with
    /// `opts.adopt`, [`NbdBackend::adopt`] instead.
    pub fn open(spec: &str, opts: NbdOptions) -> std::result::Result<NbdBackend, OpenError> {
        if let Some(export) = opts.adopt {
            return NbdBackend::adopt(spec, opts, export);
        }
        let (uri, tls) = Self::prepare(spec)?;
        // On a connector thread like a reconnect, so even a name lookup that hangs ends the
        // start-up by the deadline.
        let attempt = Attempt::start(&uri, tls.as_ref(), opts.timeout)
            .map_err(|e| OpenError::Nbd(e.to_string()))?;
        let first = match attempt.wait_blocking().then(|| attempt.take()).flatten() {
            Some(r) => r.map_err(|e| OpenError::Nbd(e.to_string()))?,
            None => {
                return Err(OpenError::Nbd(
                    ConnectError::Timeout {
                        server: connect::describe(&uri),
                        timeout: opts.timeout,
                    }
                    .to_string(),
                ))
            }
        };
        let export = first.export;
        Self::with(uri, tls, opts, export, Some(first))
    }

    /// The backend of an export a predecessor daemon served (`fusex restart`), from the export
    /// it negotiated (`export`), without connecting: the predecessor's connections may still be
    /// open, and a server without multi-conn need not accept another until they close. Each
    /// queue connects on its first request (which waits for it) and checks the server still
    /// exports the same (see [`NbdBackend::open`]'s reconnects); the URI and the TLS files are
    /// checked here.
    pub fn adopt(
        spec: &str,
        opts: NbdOptions,
        export: Export,
    ) -> std::result::Result<NbdBackend, OpenError> {
        let (uri, tls) = Self::prepare(spec)?;
        Self::with(uri, tls, opts, export, None)
    }

    /// Checks what opening `spec` needs before connecting (the URI, the TLS certificates and
    /// keys, read now: they may not be readable once privileges are dropped), without
    /// connecting: a `fusex restart` successor's check while its predecessor still serves.
    pub fn validate(spec: &str) -> std::result::Result<(), OpenError> {
        Self::prepare(spec).map(drop)
    }

    /// The URI and TLS settings of `spec`.
    fn prepare(spec: &str) -> std::result::Result<(NbdUri, Option<TlsClient>), OpenError> {
        let uri = NbdUri::parse(spec).map_err(|e| OpenError::Nbd(e.to_string()))?;
        let tls = tls::client(&uri)
            .map_err(|e| OpenError::Nbd(format!("{}: {e}", connect::describe(&uri))))?;
        Ok((uri, tls))
    }

    /// The backend of `export` at `uri`, with the connection made at open if there is one.
    fn with(
        uri: NbdUri,
        tls: Option<TlsClient>,
        opts: NbdOptions,
        export: Export,
        first: Option<Connected>,
    ) -> std::result::Result<NbdBackend, OpenError> {
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
            opts,
            tls,
            adopted: first.is_none(),
            announced: AtomicBool::new(false),
            first: Mutex::new(first),
            threads: AtomicUsize::new(0),
            created: (now.as_secs() as i64, now.subsec_nanos()),
            rmw: (export.min_block > 1).then(|| RegionLocks::new(export.min_block.ilog2())),
            alloc: AllocCache::default(),
            trouble: std::sync::Arc::new(Mutex::new(None)),
            reconnects: AtomicU64::new(0),
            outage: Mutex::new(Outage::default()),
            export,
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

    /// Where a data request `cmd` goes: this thread's connection, the command flags (FUA on a
    /// write when asked for and offered) and the largest piece one request may carry.
    async fn route(&self, eng: &Engine, cmd: Command) -> Result<(Rc<Conn>, u16, usize)> {
        let conn = self.conn(eng).await?;
        let flags = if cmd == Command::Write && self.fua() {
            nbd::CMD_FLAG_FUA
        } else {
            0
        };
        let max = conn.export().max_payload.max(conn.export().min_block) as usize;
        Ok((conn, flags, max))
    }

    /// This thread's connection, made (or remade) if needed. Connections are made on a
    /// connector thread ([`Attempt`]); the request that starts one waits for it on the ring (so
    /// do all requests of a thread that never had a connection), others fail with `EIO` at once.
    async fn conn(&self, eng: &Engine) -> Result<Rc<Conn>> {
        let mut mine: Option<Attempt> = None;
        loop {
            match CONNS.with(|c| self.step(&mut c.borrow_mut(), mine.as_ref())) {
                Step::Use(c) => return Ok(c),
                Step::Fail => return Err(errno(libc::EIO)),
                Step::Wait(a, false) => a.wait().await,
                Step::Wait(a, true) => {
                    // Until the result is in, the queue stops, or the waiters give up.
                    let left = a.give_up_at().saturating_duration_since(Instant::now());
                    {
                        let mut wait = std::pin::pin!(a.wait());
                        let mut sleep = std::pin::pin!(eng.sleep(left + Duration::from_millis(1)));
                        std::future::poll_fn(|cx| {
                            if wait.as_mut().poll(cx).is_ready()
                                || sleep.as_mut().poll(cx).is_ready()
                            {
                                std::task::Poll::Ready(())
                            } else {
                                std::task::Poll::Pending
                            }
                        })
                        .await;
                    }
                    mine = Some(a);
                }
            }
        }
    }

    /// This thread's entry for this backend.
    fn per_thread<'a>(&self, all: &'a mut Vec<PerThread>) -> &'a mut PerThread {
        let i = match all.iter().position(|p| p.backend == self.id) {
            Some(i) => i,
            None => {
                self.threads.fetch_add(1, Ordering::Relaxed);
                all.push(PerThread {
                    backend: self.id,
                    conn: None,
                    connecting: None,
                    had_one: false,
                    stopping: false,
                    retry_at: None,
                    delay: self.opts.reconnect_delay,
                });
                all.len() - 1
            }
        };
        &mut all[i]
    }

    /// Decides what a request does about the connection; `mine` is the attempt it waits for.
    fn step(&self, all: &mut Vec<PerThread>, mine: Option<&Attempt>) -> Step {
        let pt = self.per_thread(all);
        match &pt.conn {
            Some(c) if !c.broken() => return Step::Use(c.clone()),
            Some(_) => {
                // Just broke: try again at once (the server may be back already).
                pt.conn = None;
                pt.retry_at = None;
                self.outage_begins();
            }
            None => {}
        }
        if let Some(a) = pt.connecting.clone() {
            if let Some(r) = a.take() {
                pt.connecting = None;
                let r = r.map_err(|e| e.to_string()).and_then(|c| self.check(c));
                return self.settle(pt, r);
            }
            if Instant::now() >= a.give_up_at() {
                // The connector thread is stuck where its deadline does not reach: leave it.
                pt.connecting = None;
                a.wake_waiters();
                let e = ConnectError::Timeout {
                    server: self.server(),
                    timeout: self.opts.timeout,
                };
                return self.settle(pt, Err(e.to_string()));
            }
            let is_mine = mine.is_some_and(|m| m.is(&a));
            return if pt.stopping || (pt.had_one && !is_mine) {
                Step::Fail
            } else {
                Step::Wait(a, is_mine)
            };
        }
        if pt.stopping || pt.retry_at.is_some_and(|t| Instant::now() < t) {
            return Step::Fail;
        }
        let first = self.first.lock().map(|mut f| f.take()).unwrap_or(None);
        if let Some(c) = first {
            return self.settle(pt, Ok(c));
        }
        // A `fusex restart` successor's first connection on this thread: the server may not
        // have seen the predecessor's connection end yet.
        let retry_for = if self.adopted && !pt.had_one {
            HANDOVER_RETRY
        } else {
            Duration::ZERO
        };
        match Attempt::start_retrying(&self.uri, self.tls.as_ref(), self.opts.timeout, retry_for) {
            Ok(a) => {
                pt.connecting = Some(a.clone());
                Step::Wait(a, true)
            }
            Err(e) => self.settle(pt, Err(e.to_string())),
        }
    }

    /// A connection broke or an attempt failed: an outage begins unless one is under way.
    fn outage_begins(&self) {
        let mut o = self.outage.lock().unwrap_or_else(|p| p.into_inner());
        o.since.get_or_insert_with(Instant::now);
    }

    /// A connection was made: the outage under way, if any, ends.
    fn outage_ends(&self) {
        let mut o = self.outage.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = o.since.take() {
            o.past += t.elapsed();
        }
    }

    /// Takes a finished attempt: the connection, or the failure and the next attempt's time.
    fn settle(&self, pt: &mut PerThread, made: std::result::Result<Connected, String>) -> Step {
        match made {
            Ok(Connected { sock, export, tls }) => {
                if pt.retry_at.take().is_some() || pt.had_one {
                    tracing::info!("NBD: reconnected to {}", self.server());
                    self.reconnects.fetch_add(1, Ordering::Relaxed);
                } else if self.adopted && !self.announced.swap(true, Ordering::Relaxed) {
                    tracing::info!(
                        "NBD: connected to {}, as the previous daemon's successor",
                        self.server()
                    );
                }
                self.outage_ends();
                *self.trouble.lock().unwrap_or_else(|p| p.into_inner()) = None;
                pt.had_one = true;
                pt.delay = self.opts.reconnect_delay;
                let c = Rc::new(
                    Conn::new(
                        sock,
                        tls,
                        export,
                        self.opts.timeout,
                        self.opts.writable,
                        self.server(),
                    )
                    .reporting_to(self.trouble.clone()),
                );
                pt.conn = Some(c.clone());
                Step::Use(c)
            }
            Err(e) => {
                tracing::warn!(
                    "NBD: reconnecting failed: {e}; next attempt in {:?}",
                    pt.delay
                );
                *self.trouble.lock().unwrap_or_else(|p| p.into_inner()) = Some(format!(
                    "NBD server {} unreachable ({e}): requests fail with EIO until it is back",
                    self.server()
                ));
                self.outage_begins();
                pt.retry_at = Some(Instant::now() + pt.delay);
                pt.delay = (pt.delay * 2).min(MAX_BACKOFF.max(self.opts.reconnect_delay));
                Step::Fail
            }
        }
    }

    /// The queue thread this runs on stops: it starts no connection any more, and requests
    /// waiting for one being made fail with `EIO` now instead of holding the stop up.
    fn stop_connecting(&self) {
        CONNS.with(|c| {
            let mut all = c.borrow_mut();
            let pt = self.per_thread(&mut all);
            pt.stopping = true;
            if let Some(a) = &pt.connecting {
                a.wake_waiters();
            }
        });
    }

    /// A new connection to the same export, checked to still be the same size and as writable,
    /// and, where the export had multi-conn and several threads use it, to have it still:
    /// without multi-conn a server promises nothing across connections (a FLUSH on one need not
    /// cover writes made on another), so a server restarted without it serves one queue at
    /// most.
    fn check(&self, c: Connected) -> std::result::Result<Connected, String> {
        let e = c.export;
        // (Without multi-conn at open fusex runs one queue, and the server never had it.)
        if self.multi_conn()
            && !e.has(nbd::FLAG_CAN_MULTI_CONN)
            && self.threads.load(Ordering::Relaxed) > 1
        {
            return Err(
                "the export no longer allows several connections (multi-conn), which this \
                 export's queues each use: serve it with multi-conn again, or restart fusex"
                    .into(),
            );
        }
        if e.size != self.export.size {
            return Err(format!(
                "the export changed size ({} -> {} bytes)",
                self.export.size, e.size
            ));
        }
        if self.opts.writable && e.has(nbd::FLAG_READ_ONLY) {
            return Err("the export became read-only".into());
        }
        if e.min_block != self.export.min_block {
            // Alignment and the read-modify-write locks are laid out for the first one.
            return Err(format!(
                "the export changed its minimum block size ({} -> {} bytes)",
                self.export.min_block, e.min_block
            ));
        }
        Ok(c)
    }

    /// The server's minimum block size: requests are multiples of it, at multiples of it.
    fn min_block(&self) -> u64 {
        u64::from(self.export.min_block.max(1))
    }

    /// Whether `off..off + len` is made of whole blocks of the server's minimum size.
    fn is_aligned(&self, off: u64, len: u64) -> bool {
        let m = self.min_block();
        off.is_multiple_of(m) && len.is_multiple_of(m)
    }

    /// Bytes of a transfer of `len` at `off` inside the export.
    fn clamp(&self, off: u64, len: usize) -> usize {
        (self.export.size.saturating_sub(off)).min(len as u64) as usize
    }

    /// Marks the allocation count stale: called after every write, zero or punched hole (after,
    /// so a count that began while it ran is not trusted).
    fn changed(&self) {
        if !self.alloc.stale.load(Ordering::Relaxed) {
            self.alloc.stale.store(true, Ordering::Release);
        }
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
        let (conn, flags, max) = match self.route(eng, cmd).await {
            Ok(r) => r,
            Err(e) => return (Err(e), win),
        };
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
        let conn = self.conn(eng).await?;
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
        let fua = if self.fua() { nbd::CMD_FLAG_FUA } else { 0 };
        let end = off.saturating_add(len).min(self.export.size);
        if off >= end {
            return Ok(());
        }
        let r = self.zero_in(eng, off, end, flags | fua).await;
        self.changed();
        r
    }

    /// Zeroes `off..end` (inside the export): partly covered blocks at either end by
    /// read-modify-write, the whole blocks between with WRITE_ZEROES (`flags`).
    async fn zero_in(&self, eng: &Engine, off: u64, end: u64, flags: u16) -> Result<()> {
        let m = self.min_block();
        let mut at = off;
        if !at.is_multiple_of(m) {
            let block = at - at % m;
            let k = (end.min(block + m) - at) as usize;
            self.rmw_block(eng, block, (at - block) as usize, k, None)
                .await?;
            at += k as u64;
        }
        let mid_end = end - end % m;
        if mid_end > at {
            let _shared = match &self.rmw {
                Some(l) => Some(l.shared_range(at, mid_end - at).await),
                None => None,
            };
            self.ranged(eng, Command::WriteZeroes, flags, at, mid_end - at)
                .await?;
            at = mid_end;
        }
        if at < end {
            self.rmw_block(eng, at, 0, (end - at) as usize, None)
                .await?;
        }
        Ok(())
    }

    /// Read-modify-write of the block at `block` (of the minimum block size, or what is left of
    /// the export): `len` bytes at `at` inside it become `data` (zeroes if `None`). Holds the
    /// block's region exclusive from the read to the write.
    async fn rmw_block(
        &self,
        eng: &Engine,
        block: u64,
        at: usize,
        len: usize,
        data: Option<&[u8]>,
    ) -> Result<()> {
        let Some(locks) = &self.rmw else {
            return Err(errno(libc::EINVAL)); // unreachable: blocks of 1 byte are never partial
        };
        let size = self.min_block().min(self.export.size - block) as usize;
        let _x = locks.region_of(block).exclusive().await;
        let (r, mut buf) = self.bytes(eng, Command::Read, block, vec![0; size]).await;
        r?;
        let dst = buf.get_mut(at..at + len).ok_or_else(|| errno(libc::EIO))?;
        match data {
            Some(d) => dst.copy_from_slice(d),
            None => dst.fill(0),
        }
        self.bytes(eng, Command::Write, block, buf).await.0
    }

    /// READ into, or WRITE from, `buf` at `off` through a bounce buffer (the unaligned paths),
    /// split at the server's maximum payload.
    async fn bytes(
        &self,
        eng: &Engine,
        cmd: Command,
        off: u64,
        mut buf: Vec<u8>,
    ) -> (Result<()>, Vec<u8>) {
        let (conn, flags, max) = match self.route(eng, cmd).await {
            Ok(r) => r,
            Err(e) => return (Err(e), buf),
        };
        let mut done = 0;
        while done < buf.len() {
            let len = (buf.len() - done).min(max);
            let piece = if cmd == Command::Write {
                buf[done..done + len].to_vec()
            } else {
                vec![0; len]
            };
            let (r, piece) = conn
                .request_bytes(eng, cmd, flags, off + done as u64, len as u32, piece)
                .await;
            if let Err(e) = r {
                return (Err(errno(e)), buf);
            }
            if cmd == Command::Read {
                match buf.get_mut(done..done + len) {
                    Some(d) if piece.len() == len => d.copy_from_slice(&piece),
                    _ => return (Err(errno(libc::EIO)), buf),
                }
            }
            done += len;
        }
        (Ok(()), buf)
    }

    /// A READ not aligned to the minimum block size: the covering blocks into a bounce buffer,
    /// the asked part copied into the window.
    async fn read_unaligned(
        &self,
        eng: &Engine,
        mut win: Slice,
        off: u64,
        n: usize,
    ) -> (Result<usize>, Slice) {
        let m = self.min_block();
        let first = off - off % m;
        let end = (off + n as u64).next_multiple_of(m).min(self.export.size);
        let (r, buf) = self
            .bytes(eng, Command::Read, first, vec![0; (end - first) as usize])
            .await;
        if let Err(e) = r {
            return (Err(e), win);
        }
        let at = (off - first) as usize;
        win.as_mut_slice()[..n].copy_from_slice(&buf[at..at + n]);
        (Ok(n), win)
    }

    /// A WRITE not aligned to the minimum block size: read-modify-write of the partly covered
    /// block at either end, the whole blocks between sent from the window. Bytes are written in
    /// order, so a failure part-way reports how many were.
    async fn write_unaligned(
        &self,
        eng: &Engine,
        win: Slice,
        off: u64,
        n: usize,
    ) -> (Result<usize>, Slice) {
        let m = self.min_block();
        let end = off + n as u64;
        let mut done = 0usize;
        let partial = |done: usize, e: BackendError| if done > 0 { Ok(done) } else { Err(e) };
        if !off.is_multiple_of(m) {
            let block = off - off % m;
            let k = (end.min(block + m) - off) as usize;
            let r = self
                .rmw_block(
                    eng,
                    block,
                    (off - block) as usize,
                    k,
                    Some(&win.as_slice()[..k]),
                )
                .await;
            if let Err(e) = r {
                return (partial(done, e), win);
            }
            done = k;
        }
        let mid_end = end - end % m;
        let at = off + done as u64;
        let mut win = win;
        if mid_end > at {
            let len = (mid_end - at) as usize;
            let (start, stop) = (win.start(), win.end());
            let sub = win.into_inner().slice(start + done..start + done + len);
            let r;
            let sub = {
                let _shared = match &self.rmw {
                    Some(l) => Some(l.shared_range(at, len as u64).await),
                    None => None,
                };
                let back;
                (r, back) = self.transfer(eng, Command::Write, sub, at).await;
                back
            };
            win = sub.into_inner().slice(start..stop);
            match r {
                Ok(k) if k == len => done += len,
                Ok(k) => return (Ok(done + k), win),
                Err(e) => return (partial(done, e), win),
            }
        }
        if done < n {
            let at = off + done as u64;
            let r = self
                .rmw_block(eng, at, 0, n - done, Some(&win.as_slice()[done..n]))
                .await;
            if let Err(e) = r {
                return (partial(done, e), win);
            }
        }
        (Ok(n), win)
    }

    /// Allocated bytes of the export (for `st_blocks`): the last count while it holds, else a
    /// new one. Without `base:allocation`, or when counting fails, the whole export.
    async fn allocated(&self, eng: &Engine) -> u64 {
        let size = self.export.size;
        if self.export.allocation_context.is_none() {
            return size;
        }
        let last = *self.alloc.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, n)) = last {
            let fresh = at.elapsed() < ALLOC_TTL && !self.alloc.stale.load(Ordering::Acquire);
            if fresh || self.alloc.counting.load(Ordering::Acquire) {
                return n;
            }
        }
        if self.alloc.counting.swap(true, Ordering::AcqRel) {
            // Another queue is counting (and there is no count yet to answer with).
            return last.map_or(size, |(_, n)| n);
        }
        let _counting = Counting(&self.alloc.counting);
        self.alloc.stale.store(false, Ordering::Release);
        match self.count_allocated(eng).await {
            Ok(n) => {
                *self.alloc.last.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some((Instant::now(), n));
                n
            }
            Err(e) => {
                tracing::debug!("NBD: counting allocated bytes failed: {e}");
                self.alloc.stale.store(true, Ordering::Release);
                last.map_or(size, |(_, n)| n)
            }
        }
    }

    /// Walks the export with BLOCK_STATUS (without `REQ_ONE`: a reply describes many extents)
    /// and sums what is not a hole.
    async fn count_allocated(&self, eng: &Engine) -> Result<u64> {
        let size = self.export.size;
        let (mut at, mut total) = (0u64, 0u64);
        for _ in 0..MAX_COUNT_REQUESTS {
            if at >= size {
                return Ok(total);
            }
            let want = (size - at).min(MAX_RANGE);
            let out = self
                .command(eng, Command::BlockStatus, 0, at, want as u32)
                .await?;
            if out.covered == 0 {
                return Err(errno(libc::EIO));
            }
            total += out.allocated;
            at += out.covered;
        }
        Ok(if at >= size { total } else { size })
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

    fn stats(&self) -> crate::BackendStats {
        let o = self.outage.lock().unwrap_or_else(|p| p.into_inner());
        let now = o.since.map_or(Duration::ZERO, |t| t.elapsed());
        crate::BackendStats {
            nbd: Some(crate::NbdStats {
                reconnects: self.reconnects.load(Ordering::Relaxed),
                disconnected: o.past + now,
                connected: o.since.is_none(),
            }),
            ..Default::default()
        }
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            passthrough: crate::PassthroughSource::NoFile,
            writable: self.opts.writable,
            resize: false,
            remote: true,
            max_queues: (!self.multi_conn())
                .then_some((1, "the NBD server does not advertise multi-conn")),
            // Also how it is handed over: each queue's connection flushes and disconnects as
            // the queue ends, before the successor (made with `adopt`) connects.
            flushes_on_close: true,
        }
    }

    fn durable_writes(&self) -> bool {
        self.fua()
    }

    async fn attrs(&self, eng: &Engine) -> Result<Attrs> {
        // SAFETY: getuid/getgid cannot fail.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        Ok(Attrs {
            perm: if self.opts.writable { 0o644 } else { 0o444 },
            uid,
            gid,
            allocated: self.allocated(eng).await,
            atime: self.created,
            mtime: self.created,
            ctime: self.created,
        })
    }

    async fn read_at(&self, eng: &Engine, win: Slice, off: u64) -> (Result<usize>, Slice) {
        let n = self.clamp(off, win.len());
        if n > 0 && !self.is_aligned(off, n as u64) {
            return self.read_unaligned(eng, win, off, n).await;
        }
        self.transfer(eng, Command::Read, win, off).await
    }

    async fn write_at(&self, eng: &Engine, win: Slice, off: u64) -> (Result<usize>, Slice) {
        if !self.opts.writable {
            return (Err(errno(libc::EROFS)), win);
        }
        let n = self.clamp(off, win.len());
        if n == 0 {
            return (Ok(0), win);
        }
        let r = if !self.is_aligned(off, n as u64) {
            self.write_unaligned(eng, win, off, n).await
        } else {
            // Whole blocks: only a read-modify-write of one of them must wait (and keep out).
            let _shared = match &self.rmw {
                Some(l) => Some(l.shared_range(off, n as u64).await),
                None => None,
            };
            self.transfer(eng, Command::Write, win, off).await
        };
        self.changed();
        r
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
        let conn = self.conn(eng).await?;
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

    fn trouble(&self) -> Option<String> {
        self.trouble
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn queue_stopping(&self) {
        self.stop_connecting();
    }

    fn queue_ended(&self) {
        // Taken out first: dropping a connection must not happen inside the borrow.
        let gone = CONNS.with(|c| {
            let mut all = c.borrow_mut();
            all.iter()
                .position(|p| p.backend == self.id)
                .map(|i| all.swap_remove(i))
        });
        if gone.is_some() {
            self.threads.fetch_sub(1, Ordering::Relaxed);
        }
        drop(gone);
        // The connection made at open, if no queue ever needed it: closed with the queues, not
        // when the process exits, so a `fusex restart` successor finds the server free.
        let unused = self.first.lock().map(|mut f| f.take()).unwrap_or(None);
        drop(unused);
    }
}
