//! One queue thread: an engine, the request sources it serves and one slot task per buffer.
//!
//! A legacy queue reads requests from its own `/dev/fuse` fd (the mount's or a clone). An io_uring
//! queue serves one or more kernel queues (qids) through ring entries, and queue 0 also keeps a
//! small legacy reader on a cloned fd for requests that arrive before the ring is ready.

use std::cell::Cell;
use std::future::poll_fn;
use std::os::fd::OwnedFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use anyhow::{Context, Result};
use backend::AnyBackend;
use engine::{BufHandle, Engine, EngineConfig, EngineStats, Remote, TaskId};
use export::{Counters, Export, Reply, Request, Snapshot};
use fuse_abi::{
    encode_error, parse, parse_op_split, peek_unique, write_header, InHeader, Operation, ParseError,
};
use transport::{Fetched, Layout, LegacyQueue, ReadOutcome, UringLayout, UringQueue};

/// Slots of the legacy reader that an io_uring queue 0 keeps for requests sent before the ring
/// is ready (and anything else the kernel still sends through `/dev/fuse`).
const URING_LEGACY_SLOTS: usize = 2;

/// Where a queue gets its requests.
pub enum Source {
    /// Read `/dev/fuse` (this fd is the mount's or a clone).
    Legacy(OwnedFd),
    /// FUSE-over-io_uring on the connection `fd` for kernel queues `qids`; `legacy` is a cloned
    /// fd for queue 0's fallback reader.
    Uring {
        fd: Arc<OwnedFd>,
        qids: Vec<u16>,
        legacy: Option<OwnedFd>,
    },
}

/// What a queue needs to start.
pub struct QueueSpec {
    /// Queue index (for logs and stats).
    pub id: usize,
    /// Where requests come from.
    pub source: Source,
    /// Slot tasks per request source (requests in flight per kernel queue).
    pub depth: usize,
    /// Largest WRITE payload negotiated.
    pub max_write: usize,
    /// Busy-poll before sleeping.
    pub spin: Duration,
    /// CPU to pin the queue thread to.
    pub cpu: Option<usize>,
    /// Read `/dev/fuse` with a multishot read where the kernel has it.
    pub multishot: bool,
}

/// Messages from queue threads to the main thread.
pub enum Event {
    /// The queue runs; wake `task` through `remote` to make it stop.
    Started { remote: Remote, task: TaskId },
    /// The queue could not start.
    Failed { id: usize, error: String },
    /// After a stop: every request the queue had taken is answered. io_uring queues then wait
    /// for the connection to be aborted.
    Quiesced,
    /// The queue ended (stop requested, connection gone, or an error, logged).
    Ended { id: usize, report: Box<QueueReport> },
    /// SIGINT or SIGTERM arrived.
    Signal(i32),
}

/// What a queue did.
pub struct QueueReport {
    /// Request and backend counters.
    pub counters: Snapshot,
    /// Loop counters.
    pub engine: EngineStats,
    /// The error that ended the queue, if one did.
    pub error: Option<String>,
    /// How the queue read `/dev/fuse`: "multishot", "poll", or "none" (io_uring only).
    pub dev_fuse_read: &'static str,
}

/// Runs a queue to its end on the calling thread, reporting through `events`.
pub fn run(
    spec: QueueSpec,
    export: Arc<Export<AnyBackend>>,
    stop: Arc<AtomicBool>,
    events: Sender<Event>,
) {
    let id = spec.id;
    if let Some(cpu) = spec.cpu {
        crate::affinity::pin_current_thread(cpu);
    }
    match serve(spec, export, stop, &events) {
        Ok(report) => {
            let _ = events.send(Event::Ended {
                id,
                report: Box::new(report),
            });
        }
        Err(e) => {
            let _ = events.send(Event::Failed {
                id,
                error: format!("{e:#}"),
            });
        }
    }
}

/// State the slots of one queue share (single-threaded).
struct Shared {
    eng: Engine,
    export: Arc<Export<AnyBackend>>,
    counters: Counters,
    failure: Cell<Option<String>>,
    stopping: Cell<bool>,
    /// Requests taken and not yet answered.
    busy: Cell<usize>,
    /// Requests taken whose reply is not built yet (the engine's load).
    in_service: Cell<u32>,
    watcher: Cell<Option<TaskId>>,
    legacy: Option<LegacyQueue>,
    /// The connection fd io_uring commands are issued on: open for as long as the engine runs.
    _conn: Option<Arc<OwnedFd>>,
}

fn serve(
    spec: QueueSpec,
    export: Arc<Export<AnyBackend>>,
    stop: Arc<AtomicBool>,
    events: &Sender<Event>,
) -> Result<QueueReport> {
    let legacy_layout = Layout::new(spec.max_write);
    let uring_layout = UringLayout::new(spec.max_write);
    let (legacy_fd, legacy_depth, uring) = match spec.source {
        Source::Legacy(fd) => (Some(fd), spec.depth, None),
        Source::Uring { fd, qids, legacy } => {
            let n = if legacy.is_some() {
                URING_LEGACY_SLOTS
            } else {
                0
            };
            (legacy, n, Some((fd, qids)))
        }
    };
    let uring_slots = uring.as_ref().map_or(0, |(_, q)| q.len() * spec.depth);
    let mut cfg = EngineConfig {
        sq_entries: ((legacy_depth + uring_slots) * 2 + 8) as u32,
        buffers: legacy_depth + uring_slots,
        buffer_size: legacy_layout.size.max(uring_layout.size),
        register_buffers: true,
        spin: spec.spin,
        provided_buffers: u16::try_from(legacy_depth).unwrap_or(0),
    };
    let eng = match Engine::new(&cfg) {
        Ok(e) => e,
        Err(engine::EngineError::Register(e)) => {
            tracing::debug!(
                "queue {}: fixed buffers unavailable ({e}); using plain buffers",
                spec.id
            );
            cfg.register_buffers = false;
            Engine::new(&cfg)?
        }
        Err(e) => return Err(e.into()),
    };
    let legacy = match legacy_fd {
        Some(fd) => {
            let mut q =
                LegacyQueue::new(fd, legacy_layout, legacy_depth.max(1)).context("queue fd")?;
            // Slot buffers are pool buffers 0..legacy_depth (taken first, below).
            if spec.multishot {
                q.use_multishot(&eng, legacy_depth);
            }
            tracing::debug!("queue {}: /dev/fuse read mode {}", spec.id, q.read_mode());
            Some(q)
        }
        None => None,
    };
    let sh = Rc::new(Shared {
        eng,
        export,
        counters: Counters::default(),
        failure: Cell::new(None),
        stopping: Cell::new(false),
        busy: Cell::new(0),
        in_service: Cell::new(0),
        watcher: Cell::new(None),
        legacy,
        _conn: uring.as_ref().map(|(fd, _)| fd.clone()),
    });

    // The watcher turns a stop request (from the main thread, or from a slot that saw the
    // connection end) into a quiet queue, and tells the main thread once it is.
    let w = {
        let (sh2, events) = (sh.clone(), events.clone());
        sh.eng.spawn(async move {
            poll_fn(|_| {
                if stop.load(Ordering::Acquire) || sh2.stopping.get() {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            })
            .await;
            sh2.begin_stop();
            poll_fn(|_| {
                if sh2.busy.get() == 0 {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            })
            .await;
            let _ = events.send(Event::Quiesced);
        })
    };
    sh.watcher.set(Some(w));
    let mut next_buf = 0;
    let mut take = || {
        next_buf += 1;
        sh.eng.take_buffer(next_buf - 1).context("buffer pool")
    };
    if let Some(q) = &sh.legacy {
        for _ in 0..legacy_depth {
            let buf = take()?;
            sh.eng.spawn(sh.clone().legacy_slot(buf));
        }
        if q.is_multishot() {
            let sh2 = sh.clone();
            sh.eng.spawn(async move {
                if let Some(q) = &sh2.legacy {
                    q.serve_reads(&sh2.eng).await;
                }
            });
        }
    }
    if let Some((fd, qids)) = uring {
        use std::os::fd::AsRawFd;
        for qid in qids {
            let q = Rc::new(UringQueue::new(fd.as_raw_fd(), qid, uring_layout));
            for _ in 0..spec.depth {
                let buf = take()?;
                sh.eng.spawn(sh.clone().uring_slot(q.clone(), buf));
            }
        }
    }
    let _ = events.send(Event::Started {
        remote: sh.eng.remote(),
        task: w,
    });
    sh.eng.run()?;
    let error = sh.failure.take();
    let dev_fuse_read = sh.legacy.as_ref().map_or("none", LegacyQueue::read_mode);
    Ok(QueueReport {
        counters: sh.counters.snapshot(),
        engine: sh.eng.stats(),
        error,
        dev_fuse_read,
    })
}

impl Shared {
    fn begin_stop(&self) {
        self.stopping.set(true);
        if let Some(q) = &self.legacy {
            q.stop(&self.eng);
        }
    }

    /// A slot saw the connection end or failed: stop the queue.
    fn end(&self, error: Option<String>) {
        if let Some(e) = error {
            // The first error explains the stop; the others are its echoes.
            let first = self.failure.take();
            if first.is_none() {
                tracing::error!("{e}");
            }
            self.failure.set(first.or(Some(e)));
        }
        self.begin_stop();
        self.wake_watcher();
    }

    fn wake_watcher(&self) {
        if let Some(w) = self.watcher.get() {
            self.eng.wake(w);
        }
    }

    /// A request was taken: it is busy until answered and in service until its reply is built.
    fn enter(&self) {
        self.busy.set(self.busy.get() + 1);
        self.in_service.set(self.in_service.get() + 1);
        self.eng.set_load(self.in_service.get());
    }

    /// The request's reply is built. Only requests still in service count as the engine's load:
    /// a batch of requests read at once would otherwise see each other waiting for their reply
    /// writes and send tmpfs reads to io-wq (measured: 4k randread QD16 202k → 168k IOPS).
    fn served(&self) {
        self.in_service.set(self.in_service.get() - 1);
        self.eng.set_load(self.in_service.get());
    }

    /// The request is answered.
    fn leave(&self) {
        self.busy.set(self.busy.get() - 1);
        if self.stopping.get() && self.busy.get() == 0 {
            self.wake_watcher();
        }
    }

    async fn legacy_slot(self: Rc<Self>, mut buf: BufHandle) {
        let Some(q) = &self.legacy else { return };
        let layout = q.layout();
        loop {
            let n = match q.next_request(&self.eng, &mut buf).await {
                Ok(ReadOutcome::Request(n)) => n,
                Ok(ReadOutcome::Stopped) => return,
                Ok(ReadOutcome::Gone) => return self.end(None),
                Err(e) => return self.end(Some(format!("reading /dev/fuse: {e}"))),
            };
            self.enter();
            let raw = &buf.as_slice()[layout.request..layout.request + n];
            let decoded = match parse(raw) {
                Ok(r) => Ok((r.header, lower(&r.op, buf.as_slice()))),
                Err(e) => Err((peek_unique(raw), e)),
            };
            let reply = match decoded {
                Ok((hdr, op)) => Some((
                    hdr.unique,
                    self.dispatch(&hdr, op, &mut buf, layout.payload).await,
                )),
                Err((unique, e)) => unique.map(|u| (u, self.malformed(&e))),
            };
            self.served();
            let len = match reply {
                None | Some((_, Reply::None)) => None,
                Some((u, Reply::Error(errno))) => {
                    encode_error(&mut buf.as_mut_slice()[layout.reply..], u, errno).ok()
                }
                Some((u, Reply::Data(len))) => {
                    write_header(&mut buf.as_mut_slice()[layout.reply..], u, 0, len).ok()
                }
            };
            let sent = match len {
                Some(len) => q.send_reply(&self.eng, buf.io(layout.reply, len)).await,
                None => Ok(()),
            };
            self.leave();
            if let Err(e) = sent {
                return self.end(Some(format!("replying on /dev/fuse: {e}")));
            }
        }
    }

    async fn uring_slot(self: Rc<Self>, q: Rc<UringQueue>, mut buf: BufHandle) {
        let layout = q.layout();
        let mut fetched = q.register(&self.eng, &mut buf).await;
        loop {
            let d = match fetched {
                Ok(Fetched::Request(d)) => d,
                Ok(Fetched::Gone) => return self.end(None),
                Err(e) => return self.end(Some(format!("io_uring queue {}: {e}", q.qid()))),
            };
            self.enter();
            let hdr = d.header;
            let reply = if self.stopping.get() {
                // Stopping: take nothing new. The application sees the connection go away.
                Reply::Error(libc::ENOTCONN)
            } else {
                let b = buf.as_slice();
                let op_in = &b[layout.header + 128..layout.header + 256];
                let payload = &b[layout.payload..layout.payload + d.payload_sz];
                match parse_op_split(&hdr, op_in, payload) {
                    Ok(op) => {
                        let op = lower(&op, b);
                        self.dispatch(&hdr, op, &mut buf, layout.payload).await
                    }
                    Err(e) => self.malformed(&e),
                }
            };
            let (error, len) = match reply {
                Reply::Data(len) => (0, len),
                Reply::Error(errno) => (-errno.clamp(1, 511), 0),
                // Nothing without a reply travels over the ring; answer so the entry re-arms.
                Reply::None => (-libc::ENOSYS, 0),
            };
            q.set_reply(&mut buf, hdr.unique, error, len);
            self.served();
            self.leave();
            fetched = q.commit_and_fetch(&self.eng, &mut buf, d.commit_id).await;
        }
    }

    fn malformed(&self, e: &ParseError) -> Reply {
        self.counters.malformed();
        tracing::debug!("malformed request: {e}");
        Reply::Error(e.errno())
    }

    /// Serves a decoded request whose reply body goes to `buf[payload..]`.
    async fn dispatch(
        &self,
        hdr: &InHeader,
        (req, write): (Request, Option<(usize, usize)>),
        buf: &mut BufHandle,
        payload: usize,
    ) -> Reply {
        if let Some((at, len)) = write {
            if at != payload {
                // The transport could not land the data where the backend reads it: move it
                // there (counted, so a test can prove the data path never does this).
                buf.as_mut_slice().copy_within(at..at + len, payload);
                self.counters.copied(len);
            }
        }
        self.counters.request(hdr.opcode);
        self.export
            .handle(&self.eng, hdr, req, buf, payload, &self.counters)
            .await
    }
}

/// The owned form of an operation, plus where WRITE data sits in the slot buffer `base`.
fn lower(op: &Operation<'_>, base: &[u8]) -> (Request, Option<(usize, usize)>) {
    let write = match op {
        Operation::Write { data, .. } => {
            Some((data.as_ptr() as usize - base.as_ptr() as usize, data.len()))
        }
        _ => None,
    };
    (Request::from_operation(op), write)
}
