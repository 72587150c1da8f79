//! One queue: a thread that owns an engine and a `/dev/fuse` fd and serves requests from it with
//! `depth` slot tasks, each owning one request buffer for the life of the queue.

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
use fuse_abi::{encode_error, parse, peek_unique, write_header, Operation};
use transport::{Layout, LegacyQueue, ReadOutcome};

/// What a queue needs to start.
pub struct QueueSpec {
    /// Queue index (for logs and stats).
    pub id: usize,
    /// The `/dev/fuse` fd it serves.
    pub fd: OwnedFd,
    /// Slot tasks (requests in flight).
    pub depth: usize,
    /// Largest WRITE payload negotiated.
    pub max_write: usize,
    /// Busy-poll before sleeping.
    pub spin: Duration,
    /// CPU to pin the queue thread to.
    pub cpu: Option<usize>,
}

/// Messages from queue threads to the main thread.
pub enum Event {
    /// The queue runs; wake `task` through `remote` to make it stop.
    Started { remote: Remote, task: TaskId },
    /// The queue could not start.
    Failed { id: usize, error: String },
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

fn serve(
    spec: QueueSpec,
    export: Arc<Export<AnyBackend>>,
    stop: Arc<AtomicBool>,
    events: &Sender<Event>,
) -> Result<QueueReport> {
    let layout = Layout::new(spec.max_write);
    let mut cfg = EngineConfig {
        sq_entries: (spec.depth * 2 + 8) as u32,
        buffers: spec.depth,
        buffer_size: layout.size,
        register_buffers: true,
        spin: spec.spin,
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
    let eng = Rc::new(eng);
    let q = Rc::new(LegacyQueue::new(spec.fd, layout, spec.depth).context("queue fd")?);
    let counters = Rc::new(Counters::default());
    let failure: Rc<Cell<Option<String>>> = Rc::new(Cell::new(None));

    // The watcher ends the queue when the main thread asks (stop flag + remote wake) or a slot saw
    // the connection end.
    let w = {
        let (eng, q) = (eng.clone(), q.clone());
        eng.clone().spawn(async move {
            poll_fn(|_| {
                if stop.load(Ordering::Acquire) || q.is_stopping() {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            })
            .await;
            q.stop(&eng);
        })
    };
    for i in 0..spec.depth {
        let buf = eng.take_buffer(i).context("buffer pool")?;
        let ctx = Slot {
            eng: eng.clone(),
            q: q.clone(),
            export: export.clone(),
            counters: counters.clone(),
            failure: failure.clone(),
            watcher: w,
        };
        eng.spawn(ctx.run(buf));
    }
    let _ = events.send(Event::Started {
        remote: eng.remote(),
        task: w,
    });
    eng.run()?;
    let error = failure.take();
    Ok(QueueReport {
        counters: counters.snapshot(),
        engine: eng.stats(),
        error,
    })
}

struct Slot {
    eng: Rc<Engine>,
    q: Rc<LegacyQueue>,
    export: Arc<Export<AnyBackend>>,
    counters: Rc<Counters>,
    failure: Rc<Cell<Option<String>>>,
    watcher: TaskId,
}

impl Slot {
    fn end(&self, error: Option<String>) {
        if let Some(e) = error {
            tracing::error!("{e}");
            self.failure.set(Some(e));
        }
        self.q.stop(&self.eng);
        self.eng.wake(self.watcher);
    }

    async fn run(self, mut buf: BufHandle) {
        let layout = self.q.layout();
        loop {
            let n = match self.q.next_request(&self.eng, &mut buf).await {
                Ok(ReadOutcome::Request(n)) => n,
                Ok(ReadOutcome::Stopped) => return,
                Ok(ReadOutcome::Gone) => return self.end(None),
                Err(e) => return self.end(Some(format!("reading /dev/fuse: {e}"))),
            };
            let Some(len) = self.serve_one(&mut buf, layout, n).await else {
                continue;
            };
            if let Err(e) = self
                .q
                .send_reply(&self.eng, buf.io(layout.reply, len))
                .await
            {
                return self.end(Some(format!("replying on /dev/fuse: {e}")));
            }
        }
    }

    /// Decodes and serves the request at `layout.request`; returns the reply length (header
    /// included) at `layout.reply`, or `None` when no reply is due.
    async fn serve_one(&self, buf: &mut BufHandle, layout: Layout, n: usize) -> Option<usize> {
        let raw = &buf.as_slice()[layout.request..layout.request + n];
        let decoded = match parse(raw) {
            Ok(r) => {
                let misplaced = match &r.op {
                    Operation::Write { data, .. } => {
                        data.as_ptr() != buf.as_slice()[layout.payload..].as_ptr()
                    }
                    _ => false,
                };
                Ok((r.header, Request::from_operation(&r.op), misplaced))
            }
            Err(e) => Err((peek_unique(raw), e)),
        };
        let (hdr, req) = match decoded {
            Ok((hdr, _, true)) => {
                self.counters.malformed();
                return error_reply(buf, layout, hdr.unique, libc::EIO);
            }
            Ok((hdr, req, false)) => (hdr, req),
            Err((unique, e)) => {
                self.counters.malformed();
                tracing::debug!("malformed request: {e}");
                return error_reply(buf, layout, unique?, e.errno());
            }
        };
        self.counters.request(hdr.opcode);
        match self
            .export
            .handle(&self.eng, &hdr, req, buf, layout.payload, &self.counters)
            .await
        {
            Reply::None => None,
            Reply::Error(errno) => error_reply(buf, layout, hdr.unique, errno),
            Reply::Data(len) => {
                let out = &mut buf.as_mut_slice()[layout.reply..];
                write_header(out, hdr.unique, 0, len).ok()
            }
        }
    }
}

fn error_reply(buf: &mut BufHandle, layout: Layout, unique: u64, errno: i32) -> Option<usize> {
    encode_error(&mut buf.as_mut_slice()[layout.reply..], unique, errno).ok()
}
