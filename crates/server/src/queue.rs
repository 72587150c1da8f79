//! One queue: the request sources it serves and one slot task per buffer, a tenant of a worker
//! thread's engine (see [`crate::worker`]).
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

use engine::{Buf, BufPool, Engine, EngineError, EngineStats, Remote, TaskId};
use export::{Filesystem, Snapshot};
use thiserror::Error;
use transport::{Layout, LegacyQueue, TransportError, UringLayout, UringQueue};

use crate::watch::{self, Phase, Seen};
use crate::worker::Job;
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
    /// Read `/dev/fuse` with a multishot read where the kernel has it.
    pub multishot: bool,
    /// The image's descriptors to register as the ring's fixed files, with the io_uring
    /// connection's (None: no fixed files).
    pub fixed_files: Option<Vec<std::os::fd::RawFd>>,
    /// Legacy READs of at least this many bytes are spliced from the image (0: none).
    pub splice_min: usize,
    /// Time each request into latency histograms (see [`QueueServer::with_latency`]).
    pub latency: bool,
    /// The export's statistics, which the queue's counters join before it serves anything, so
    /// no request is served uncounted by a reader.
    pub stats: Arc<crate::ExportStats>,
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

/// Messages from a queue thread to whoever runs the export (which wraps them in its own events
/// through `From`).
pub enum QueueEvent {
    /// The queue runs; wake `task` through `remote` to make it stop. (Its counters joined the
    /// export's statistics when it was made: [`QueueSpec::stats`].)
    Started {
        id: usize,
        remote: Remote,
        task: TaskId,
    },
    /// The queue could not start.
    Failed { id: usize, error: String },
    /// After a stop: every request the queue had taken is answered. io_uring queues then wait
    /// for the connection to be aborted.
    Quiesced,
    /// The queue ended (stop requested, connection gone, or an error, logged).
    Ended { id: usize, report: Box<QueueReport> },
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
    /// io_uring entries this queue registered (they follow the load: see
    /// [`crate::slots::INITIAL_ENTRIES`]); 0 on legacy.
    pub entries: usize,
}

/// How a queue reports its [`QueueEvent`]s to whoever runs its export (a closure, so one
/// supervisor of many exports can tell them apart).
pub type Report = Arc<dyn Fn(QueueEvent) + Send + Sync>;

/// A queue to start on a worker thread ([`crate::Workers::submit`]): it becomes a tenant of that
/// thread's engine and reports through `report` until it has ended. `stop` set (and the
/// `Started` task woken) makes it stop taking requests.
pub fn job<F: Filesystem>(
    spec: QueueSpec,
    export: Arc<F>,
    stop: Arc<AtomicBool>,
    report: Report,
) -> Box<dyn Job> {
    Box::new(QueueJob {
        spec,
        export,
        stop,
        report,
    })
}

struct QueueJob<F> {
    spec: QueueSpec,
    export: Arc<F>,
    stop: Arc<AtomicBool>,
    report: Report,
}

impl<F: Filesystem> Job for QueueJob<F> {
    fn run(self: Box<Self>, eng: &Rc<Engine>) {
        let QueueJob {
            spec,
            export,
            stop,
            report,
        } = *self;
        let (id, crew) = (spec.id, crew_of(&spec.source));
        if let Err(e) = start(spec, export, stop, report.clone(), eng) {
            // Nothing of the queue was left on the engine.
            fail(id, crew, &report, e.to_string());
        }
    }

    fn refuse(self: Box<Self>, why: &str) {
        fail(
            self.spec.id,
            crew_of(&self.spec.source),
            &self.report,
            why.into(),
        );
    }
}

fn crew_of(source: &Source) -> Option<Arc<Crew>> {
    match source {
        Source::Uring { crew, .. } => Some(crew.clone()),
        Source::Legacy(_) => None,
    }
}

/// The queue could not start: its crew closes (so the other threads' spare carriers, waiting
/// for entries from this one, do not wait forever) and its owner hears why.
fn fail(id: usize, crew: Option<Arc<Crew>>, report: &Report, error: String) {
    if let Some(crew) = crew {
        crew.close();
    }
    report(QueueEvent::Failed { id, error });
}

/// What the engine holds for a queue, given back when it ends (or fails to start).
struct Held {
    eng: Rc<Engine>,
    pool: Option<BufPool>,
    files: Vec<std::os::fd::RawFd>,
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(p) = self.pool.take() {
            self.eng.remove_pool(p);
        }
        if !self.files.is_empty() {
            self.eng.unregister_files(&self.files);
        }
    }
}

/// Sets a queue up on `eng` and spawns its tasks. On an error nothing of it stays behind.
fn start<F: Filesystem>(
    spec: QueueSpec,
    export: Arc<F>,
    stop: Arc<AtomicBool>,
    report: Report,
    eng: &Rc<Engine>,
) -> Result<(), QueueError> {
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
    if let Some((_, qids, crew)) = &uring {
        if let Some(&q) = qids.iter().find(|&&q| usize::from(q) >= crew.qids()) {
            return Err(QueueError::Qid(q));
        }
    }
    let uring_slots = uring.as_ref().map_or(0, |(_, q, _)| q.len() * spec.depth);
    let count = legacy_depth + uring_slots;
    let multishot = spec.multishot && legacy_depth > 0;
    let pool = eng.add_pool(count, legacy_layout.size.max(uring_layout.size), multishot)?;
    let group = pool.group();
    // Every buffer now, so the tasks below cannot fail for want of one.
    let mut bufs: Vec<Buf> = Vec::with_capacity(count);
    for _ in 0..count {
        bufs.push(pool.take().ok_or(QueueError::NoBuffer)?);
    }
    let mut held = Held {
        eng: eng.clone(),
        pool: Some(pool),
        files: Vec::new(),
    };
    let legacy = match legacy_fd {
        Some(fd) => {
            let mut q = LegacyQueue::new(fd, legacy_layout, legacy_depth.max(1))?;
            if multishot {
                q.use_multishot(eng, group, count);
            }
            tracing::debug!("queue {}: /dev/fuse read mode {}", spec.id, q.read_mode());
            Some(q)
        }
        None => None,
    };
    if let Some(mut fds) = spec.fixed_files {
        use std::os::fd::AsRawFd;
        // Not the legacy /dev/fuse fd: a multishot READ of it as a fixed file fails with EBADFD.
        fds.extend(uring.as_ref().map(|(fd, _, _)| fd.as_raw_fd()));
        match eng.register_files(&fds) {
            Ok(()) => held.files = fds,
            Err(e) => tracing::debug!("queue {}: no fixed files ({e})", spec.id),
        }
    }
    // Everything that needed privileges is done (ring, fixed files); nothing of this queue is
    // submitted yet, so every io-wq worker the kernel forks for it from here on gets the
    // reduced set too.
    (spec.before_serving)().map_err(QueueError::Privileges)?;

    let server = QueueServer::new(export)
        .with_splice_min(spec.splice_min)
        .with_latency(spec.latency);
    spec.stats.started(spec.id, server.shared_counters());
    let st = QueueState::new(eng.clone(), server, legacy);
    {
        let (id, report, crew) = (spec.id, report.clone(), uring.as_ref().map(|u| u.2.clone()));
        // The connection fd io_uring commands are issued on stays open until the queue ends.
        let conn = uring.as_ref().map(|(fd, _, _)| fd.clone());
        st.set_on_end(Box::new(move |st| {
            let eng = st.engine().clone();
            let report_of = QueueReport {
                counters: st.server().counters().snapshot(),
                engine: eng.stats(),
                error: st.take_failure().or_else(crate::worker::worker_fault),
                dev_fuse_read: st.legacy().map_or("none", LegacyQueue::read_mode),
                entries: st.entries_registered(),
            };
            // Per-thread backend state (an NBD connection) goes with the queue.
            st.server().export().queue_ended();
            drop(held);
            drop(conn);
            if let Some(crew) = crew {
                // Normally every entry has ended and the crew closed already.
                crew.close();
            }
            report(QueueEvent::Ended {
                id,
                report: Box::new(report_of),
            });
        }));
    }
    // Exactly as many buffers as slots were taken above.
    let mut bufs = bufs.into_iter();

    // The watcher turns a stop request (from the owner, or from a loop that saw the connection
    // end) into a quiet queue, and tells the owner once it is.
    let w = {
        let (st2, report) = (st.clone(), report.clone());
        st.spawn(async move {
            poll_fn(|_| {
                if stop.load(Ordering::Acquire) || st2.stopping() {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            })
            .await;
            st2.begin_stop();
            // The stop protocol (see `crate::watch`): this task observes and acts; each wake
            // (a request answered, a migrant released anywhere in the crew, the crew closing)
            // takes a turn.
            let mut phase = Phase::Quieting;
            poll_fn(|_| loop {
                let seen = Seen {
                    quiet: st2.is_quiet(),
                    drained: st2.crew_drained(),
                    answered_abroad: st2.answered_abroad(),
                    closed: st2.crew_closed(),
                };
                let t = watch::turn(phase, seen);
                // An io_uring queue counts a request answered once its reply is built and its
                // COMMIT entry queued; the owner may abort the connection as soon as it hears
                // quiet, so the kernel must have that entry first, or the reply is lost and the
                // application gets ECONNABORTED from a `safe` removal.
                if t.submit && !st2.engine().submit_queued() {
                    tracing::warn!("queue quiet with entries the kernel has not taken yet");
                }
                if t.release {
                    st2.release_answered();
                }
                if t.report {
                    report(QueueEvent::Quiesced);
                }
                let moved = t.next != phase;
                phase = t.next;
                if phase == Phase::Done {
                    return Poll::Ready(());
                }
                if !(t.release || moved) {
                    return Poll::Pending;
                }
            })
            .await;
        })
    };
    st.set_watcher(w);
    if let Some(q) = st.legacy() {
        for b in bufs.by_ref().take(legacy_depth) {
            st.spawn(st.clone().legacy_slot(b));
        }
        if q.is_multishot() {
            let st2 = st.clone();
            st.spawn(async move {
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
        // The entries' buffers: registered as the load asks for them.
        st.join_crew(crew.clone(), spec.id, queues, spec.depth, bufs.collect());
        crew.watch(spec.id, eng.remote(), w);
        for &qid in &qids {
            st.start_entries(qid);
        }
        if crew.mode() != Handoff::Off {
            // Carriers for entries handed here are spawned as they are first needed.
            let dock = st.spawn(st.clone().dock());
            crew.board(spec.id, eng.gauge(), eng.remote(), dock);
        }
    }
    report(QueueEvent::Started {
        id: spec.id,
        remote: eng.remote(),
        task: w,
    });
    Ok(())
}
