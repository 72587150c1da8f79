//! One queue thread: an engine, the request sources it serves and one slot task per buffer.
//!
//! A legacy queue reads requests from its own `/dev/fuse` fd (the mount's or a clone). An io_uring
//! queue serves one or more kernel queues (qids) through ring entries, and queue 0 also keeps a
//! small legacy reader on a cloned fd for requests that arrive before the ring is ready.

use std::future::poll_fn;
use std::os::fd::OwnedFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use backend::BlockBackend;
use engine::{Engine, EngineConfig, EngineError, EngineStats, Remote, TaskId};
use export::{Counters, Export, Snapshot};
use thiserror::Error;
use transport::{Layout, LegacyQueue, TransportError, UringLayout, UringQueue};

use crate::{Crew, Handoff, QueueServer, QueueState};

/// Where a queue gets its requests.
pub enum Source {
    /// Read `/dev/fuse` (this fd is the mount's or a clone).
    Legacy(OwnedFd),
    /// FUSE-over-io_uring on the connection `fd` for kernel queues `qids`; `legacy` is a cloned
    /// fd for queue 0's fallback reader. The queue threads of one connection form `crew`.
    Uring {
        fd: Arc<OwnedFd>,
        qids: Vec<u16>,
        legacy: Option<OwnedFd>,
        crew: Arc<Crew>,
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
    /// Read `/dev/fuse` with a multishot read where the kernel has it.
    pub multishot: bool,
    /// The image's descriptors to register as the ring's fixed files, with the io_uring
    /// connection's (None: no fixed files).
    pub fixed_files: Option<Vec<std::os::fd::RawFd>>,
    /// Register the request buffers with the ring as fixed buffers (pinned: resident from the
    /// start, and no per-operation page pinning).
    pub register_buffers: bool,
    /// Legacy READs of at least this many bytes are spliced from the image (0: none).
    pub splice_min: usize,
    /// Slots of the legacy reader an io_uring queue keeps (on its `legacy` fd) for requests sent
    /// before the ring is ready, and anything else the kernel still sends through `/dev/fuse`.
    pub fallback_slots: usize,
    /// Run once the queue is set up, before it submits anything (dropping privileges: every
    /// io-wq worker the kernel forks from the thread later inherits what this leaves).
    pub before_serving: Box<dyn FnOnce() -> std::io::Result<()> + Send>,
}

/// Why a queue could not start or ended early.
#[derive(Debug, Error)]
pub enum QueueError {
    /// The queue's ring failed.
    #[error("{0}")]
    Engine(#[from] EngineError),
    /// The queue's `/dev/fuse` fd could not be set up.
    #[error("queue fd: {0}")]
    Transport(#[from] TransportError),
    /// The pool had fewer buffers than slots (a sizing bug).
    #[error("buffer pool: fewer buffers than slots")]
    NoBuffer,
    /// A kernel queue id the crew does not have.
    #[error("kernel queue {0} outside the crew")]
    Qid(u16),
    /// `before_serving` failed.
    #[error("cannot drop privileges: {0}")]
    Privileges(std::io::Error),
}

/// Messages from a queue thread to whoever runs the export (through its [`Report`]).
pub enum QueueEvent {
    /// The queue runs; wake `task` through `remote` to make it stop. `counters` are the
    /// queue's, readable live.
    Started {
        id: usize,
        remote: Remote,
        task: TaskId,
        counters: Arc<Counters>,
    },
    /// The queue could not start.
    Failed { id: usize, error: String },
    /// After a stop: every request the queue had taken is answered. io_uring queues then wait
    /// for the connection to be aborted.
    Quiesced,
    /// The queue ended (stop requested, connection gone, or an error, logged).
    Ended { id: usize, report: Box<QueueReport> },
}

/// How a queue tells whoever runs its export what happens to it. A callback rather than a typed
/// channel: the receiver decides what to make of each event (a supervisor shared by many exports
/// tags it with the export it is about, a one-export process wraps it in its own events).
pub type Report = Arc<dyn Fn(QueueEvent) + Send + Sync>;

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

/// Runs a queue to its end on the calling thread, reporting through `report`. `stop` set (and
/// the `Started` task woken) makes it stop taking requests.
pub fn run<B: BlockBackend>(
    spec: QueueSpec,
    export: Arc<Export<B>>,
    stop: Arc<AtomicBool>,
    report: Report,
) {
    let id = spec.id;
    let crew = match &spec.source {
        Source::Uring { crew, .. } => Some(crew.clone()),
        Source::Legacy(_) => None,
    };
    let outcome = serve(spec, export, stop, &report);
    if let Some(crew) = crew {
        // Normally every entry has ended and the crew closed already. A thread that failed
        // early (or whose ring failed) closes it so the others' spare carriers, waiting for
        // entries from it, do not wait forever.
        crew.close();
    }
    match outcome {
        Ok(ended) => {
            report(QueueEvent::Ended {
                id,
                report: Box::new(ended),
            });
        }
        Err(e) => {
            report(QueueEvent::Failed {
                id,
                error: e.to_string(),
            });
        }
    }
}

fn serve<B: BlockBackend>(
    spec: QueueSpec,
    export: Arc<Export<B>>,
    stop: Arc<AtomicBool>,
    report: &Report,
) -> Result<QueueReport, QueueError> {
    let legacy_layout = Layout::new(spec.max_write);
    let uring_layout = UringLayout::new(spec.max_write);
    let (legacy_fd, legacy_depth, uring) = match spec.source {
        Source::Legacy(fd) => (Some(fd), spec.depth, None),
        Source::Uring {
            fd,
            qids,
            legacy,
            crew,
        } => {
            let n = if legacy.is_some() {
                spec.fallback_slots
            } else {
                0
            };
            (legacy, n, Some((fd, qids, crew)))
        }
    };
    let uring_slots = uring.as_ref().map_or(0, |(_, q, _)| q.len() * spec.depth);
    let mut cfg = EngineConfig {
        sq_entries: ((legacy_depth + uring_slots) * 2 + 8) as u32,
        buffers: legacy_depth + uring_slots,
        buffer_size: legacy_layout.size.max(uring_layout.size),
        register_buffers: spec.register_buffers,
        spin: spec.spin,
        provided_buffers: legacy_depth > 0,
        ..EngineConfig::default()
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
            let mut q = LegacyQueue::new(fd, legacy_layout, legacy_depth.max(1))?;
            if spec.multishot {
                q.use_multishot(&eng, cfg.buffers);
            }
            tracing::debug!("queue {}: /dev/fuse read mode {}", spec.id, q.read_mode());
            Some(q)
        }
        None => None,
    };
    // The connection fd io_uring commands are issued on stays open for as long as the engine runs.
    let conn = uring.as_ref().map(|(fd, _, _)| fd.clone());
    if let Some(mut fds) = spec.fixed_files {
        use std::os::fd::AsRawFd;
        // Not the legacy /dev/fuse fd: a multishot READ of it as a fixed file fails with EBADFD.
        fds.extend(conn.as_ref().map(|fd| fd.as_raw_fd()));
        if let Err(e) = eng.register_files(&fds) {
            tracing::debug!("queue {}: no fixed files ({e})", spec.id);
        }
    }
    let server = QueueServer::new(export).with_splice_min(spec.splice_min);
    let st = QueueState::new(eng, server, legacy);
    let eng = st.engine();
    // The request loops hold `st`, which owns the engine that holds them: on any way out before
    // they all ended (a fatal ring error, a failed start) nothing would ever free the ring, its
    // fds or its buffers. Dropped first, this drops what tasks are left.
    let _tasks = TasksOf(eng);

    // The watcher turns a stop request (from the main thread, or from a loop that saw the
    // connection end) into a quiet queue, and tells the main thread once it is.
    let w = {
        let (st2, report) = (st.clone(), report.clone());
        eng.spawn(async move {
            poll_fn(|_| {
                if stop.load(Ordering::Acquire) || st2.stopping() {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            })
            .await;
            st2.begin_stop();
            poll_fn(|_| {
                if st2.is_quiet() {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            })
            .await;
            report(QueueEvent::Quiesced);
        })
    };
    st.set_watcher(w);
    let take = || eng.take_buffer().ok_or(QueueError::NoBuffer);
    if let Some(q) = st.legacy() {
        for _ in 0..legacy_depth {
            eng.spawn(st.clone().legacy_slot(take()?));
        }
        if q.is_multishot() {
            let st2 = st.clone();
            eng.spawn(async move {
                if let Some(q) = st2.legacy() {
                    q.serve_reads(st2.engine()).await;
                }
            });
        }
    }
    if let Some((fd, qids, crew)) = uring {
        use std::os::fd::AsRawFd;
        // Every kernel queue, since an entry of any of them may be handed to this thread.
        let queues: Vec<Rc<UringQueue>> = (0..crew.qids())
            .map(|q| Rc::new(UringQueue::new(fd.as_raw_fd(), q as u16, uring_layout)))
            .collect();
        st.join_crew(crew.clone(), spec.id, queues.clone());
        for &qid in &qids {
            let q = queues.get(usize::from(qid)).ok_or(QueueError::Qid(qid))?;
            for _ in 0..spec.depth {
                eng.spawn(st.clone().uring_slot(q.clone(), take()?));
            }
        }
        if crew.mode() != Handoff::Off {
            // One carrier per entry of the connection, so this thread can hold them all.
            let spares = crew.entries() - qids.len() * spec.depth;
            for _ in 0..spares {
                eng.spawn(st.clone().uring_spare());
            }
            let dock = eng.spawn(st.clone().dock());
            crew.board(spec.id, eng.gauge(), eng.remote(), dock);
        }
    }
    // Everything that needed privileges is done (ring, registered buffers, fixed files); nothing
    // is submitted yet, so every io-wq worker the kernel forks from this thread from here on gets
    // the reduced set too.
    (spec.before_serving)().map_err(QueueError::Privileges)?;
    report(QueueEvent::Started {
        id: spec.id,
        remote: eng.remote(),
        task: w,
        counters: st.server().shared_counters(),
    });
    eng.run()?;
    let error = st.take_failure();
    let dev_fuse_read = st.legacy().map_or("none", LegacyQueue::read_mode);
    Ok(QueueReport {
        counters: st.server().counters().snapshot(),
        engine: eng.stats(),
        error,
        dev_fuse_read,
    })
}

/// Drops the engine's unfinished tasks when dropped (see [`Engine::drop_tasks`]).
struct TasksOf<'a>(&'a Engine);

impl Drop for TasksOf<'_> {
    fn drop(&mut self) {
        self.0.drop_tasks();
    }
}
