//! The request loops of one queue: one task per buffer, each taking a request from its transport,
//! serving it through the [`QueueServer`] and answering, until the queue stops.
//!
//! Stopping: [`QueueState::begin_stop`] makes every loop take nothing new; once
//! [`QueueState::is_quiet`] (every request taken has been answered) the owner may end the
//! connection, which ends the loops still waiting in the kernel.

use std::cell::{Cell, OnceCell, RefCell};
use std::collections::VecDeque;
use std::future::poll_fn;
use std::rc::Rc;
use std::sync::Arc;
use std::task::Poll;

use engine::{Buf, Engine, TaskId};
use export::Filesystem;
use transport::{Fetched, LegacyQueue, ReadOutcome, Spliced, TransportError, UringQueue};

use crate::crew::{Crew, Migrant};
use crate::{LegacyReply, QueueServer};

/// This thread's place in a [`Crew`]: the io_uring queues it may be handed entries of, and the
/// entries handed to it that wait for a carrier.
struct Seat {
    crew: Arc<Crew>,
    me: usize,
    /// Every kernel queue, by qid (an entry of any of them may be handed here).
    queues: Vec<Rc<UringQueue>>,
    /// Entries taken from the inbox, not yet picked up by a carrier.
    arrived: RefCell<VecDeque<Migrant>>,
    /// Carriers waiting for an entry.
    idle: RefCell<Vec<TaskId>>,
    /// The dock's scratch list (sized once, reused).
    scratch: RefCell<Vec<Migrant>>,
    /// Carriers without an entry of their own, spawned as handed entries first needed them.
    spares: Cell<usize>,
    /// Entries this thread registers as its load asks for them.
    growth: Growth,
}

/// Ring entries registered by load: a kernel queue starts with [`INITIAL_ENTRIES`] entries on
/// its thread and doubles them (up to the queue depth) whenever one batch of completions (one
/// loop turn, [`engine::Engine::turns`]) delivers a request into every one of them: the kernel
/// then had requests for all, and may have more queued. An idle export so holds a few entries
/// (and their tasks, and the one page REGISTER touches) and a busy one gets its full depth.
/// Counting the requests in service at once instead missed the load: a raw image's reads
/// finish inline, one after the other, so two entries were never in service together while fio
/// kept 64 requests queued (measured: stuck at 2 entries per queue, 4k randread QD64 at 0.68 of
/// the full depth). Entries cannot be unregistered, so a queue keeps what its busiest moment
/// asked for.
struct Growth {
    depth: usize,
    /// Per kernel queue, by qid.
    qids: Vec<QidEntries>,
    /// Buffers for entries not registered yet (mapped, never touched: not resident).
    reserve: RefCell<Vec<Buf>>,
}

/// One kernel queue's entries on this thread.
#[derive(Default)]
struct QidEntries {
    /// Entries registered from this thread.
    registered: Cell<usize>,
    /// The loop turn of the last delivery into one of them, and deliveries in that turn.
    batch: Cell<(u64, usize)>,
}

/// Entries a kernel queue starts with on its thread.
pub const INITIAL_ENTRIES: usize = 1;

/// What a queue does once its last task has ended (see [`QueueState::set_on_end`]).
pub type OnEnd<F> = Box<dyn FnOnce(&QueueState<F>)>;

/// State the request loops of one queue share (single-threaded).
pub struct QueueState<F> {
    eng: Rc<Engine>,
    server: QueueServer<F>,
    legacy: Option<LegacyQueue>,
    failure: Cell<Option<String>>,
    stopping: Cell<bool>,
    /// Requests taken and not yet answered.
    busy: Cell<usize>,
    /// Legacy slots waiting in their transport for a request. A read the stop cancelled may
    /// still deliver one (the kernel had copied it out before the cancel), which must be
    /// answered before the queue counts as quiet: a flush or a handover to another process
    /// follows quiet, and a request served after it would be lost to both.
    reading: Cell<usize>,
    /// Woken when the queue should stop or has become quiet.
    watcher: Cell<Option<TaskId>>,
    /// Requests handed here from another thread, answered after this queue began to stop: the
    /// crew counts them in transit until the watcher has handed the kernel their replies
    /// ([`QueueState::release_answered`]).
    answered_abroad: Cell<usize>,
    /// Large legacy READs may be spliced (off for good once making a pipe failed).
    splicing: Cell<bool>,
    /// The crew of io_uring queue threads this one hands entries to and takes them from.
    seat: OnceCell<Seat>,
    /// This queue's tasks on the engine (which may run other queues' too).
    tasks: Cell<usize>,
    /// Run once the last of them has ended.
    on_end: Cell<Option<OnEnd<F>>>,
}

impl<F: Filesystem> QueueState<F> {
    /// The state of a queue that runs on `eng`, serves through `server`, and (for a legacy
    /// queue, or an io_uring queue's fallback reader) reads `legacy`.
    pub fn new(eng: Rc<Engine>, server: QueueServer<F>, legacy: Option<LegacyQueue>) -> Rc<Self> {
        Rc::new(QueueState {
            eng,
            server,
            legacy,
            failure: Cell::new(None),
            stopping: Cell::new(false),
            busy: Cell::new(0),
            reading: Cell::new(0),
            watcher: Cell::new(None),
            answered_abroad: Cell::new(0),
            splicing: Cell::new(true),
            seat: OnceCell::new(),
            tasks: Cell::new(0),
            on_end: Cell::new(None),
        })
    }

    /// Spawns one of this queue's tasks on its engine. The queue has ended once every task it
    /// spawned has (finished, or dropped with the engine's tasks): then the `on_end` work of
    /// [`QueueState::set_on_end`] runs, on this thread.
    pub fn spawn(self: &Rc<Self>, fut: impl std::future::Future<Output = ()> + 'static) -> TaskId {
        self.tasks.set(self.tasks.get() + 1);
        let member = Member(self.clone());
        self.eng.spawn(async move {
            let _member = member;
            fut.await
        })
    }

    /// What to do once the queue's last task has ended (report, give its resources back).
    pub fn set_on_end(&self, f: OnEnd<F>) {
        self.on_end.set(Some(f));
    }

    fn task_ended(&self) {
        let n = self.tasks.get().saturating_sub(1);
        self.tasks.set(n);
        if n == 0 {
            if let Some(f) = self.on_end.take() {
                f(self);
            }
        }
    }

    /// Makes this queue thread member `me` of `crew`, serving any of `queues` (all kernel
    /// queues, by qid), with up to `depth` entries per kernel queue it registers, whose buffers
    /// are `reserve`. Call before [`QueueState::start_entries`].
    pub fn join_crew(
        &self,
        crew: Arc<Crew>,
        me: usize,
        queues: Vec<Rc<UringQueue>>,
        depth: usize,
        reserve: Vec<Buf>,
    ) {
        // Every entry of the connection may end up here at once.
        let cap = crew.entries();
        let n = queues.len();
        let _ = self.seat.set(Seat {
            crew,
            me,
            queues,
            arrived: RefCell::new(VecDeque::with_capacity(cap)),
            idle: RefCell::new(Vec::with_capacity(cap)),
            scratch: RefCell::new(Vec::with_capacity(cap)),
            spares: Cell::new(0),
            growth: Growth {
                depth,
                qids: (0..n)
                    .map(|_| QidEntries {
                        batch: Cell::new((u64::MAX, 0)),
                        ..QidEntries::default()
                    })
                    .collect(),
                reserve: RefCell::new(reserve),
            },
        });
    }

    /// io_uring entries registered from this thread, of every kernel queue.
    pub fn entries_registered(&self) -> usize {
        self.seat.get().map_or(0, |s| {
            s.growth.qids.iter().map(|q| q.registered.get()).sum()
        })
    }

    /// Registers the first entries of kernel queue `qid` from this thread (see `Growth`).
    pub fn start_entries(self: &Rc<Self>, qid: u16) {
        self.add_entries(qid, INITIAL_ENTRIES);
    }

    /// Registers up to `n` more entries of kernel queue `qid`, within the depth and the
    /// buffers left.
    fn add_entries(self: &Rc<Self>, qid: u16, n: usize) {
        let Some(seat) = self.seat.get() else { return };
        let g = &seat.growth;
        let (Some(q), Some(reg)) = (
            seat.queues.get(usize::from(qid)),
            g.qids.get(usize::from(qid)).map(|e| &e.registered),
        ) else {
            return;
        };
        for _ in 0..n {
            if reg.get() >= g.depth {
                return;
            }
            let Some(buf) = g.reserve.borrow_mut().pop() else {
                return;
            };
            reg.set(reg.get() + 1);
            self.server
                .counters()
                .set_entries(self.entries_registered());
            seat.crew.entry_added();
            self.spawn(self.clone().uring_slot(q.clone(), buf));
        }
    }

    /// The kernel delivered a request into an entry of `qid`, a kernel queue this thread
    /// registers entries of: if this loop turn brought one into every entry, register more.
    fn entry_delivered(self: &Rc<Self>, qid: u16) {
        let Some(seat) = self.seat.get() else { return };
        let g = &seat.growth;
        let Some(e) = g.qids.get(usize::from(qid)) else {
            return;
        };
        let turn = self.eng.turns();
        let (last, n) = e.batch.get();
        let n = if last == turn { n + 1 } else { 1 };
        e.batch.set((turn, n));
        let reg = e.registered.get();
        if n >= reg && reg < g.depth && !self.stopping.get() {
            self.add_entries(qid, reg);
        }
    }

    /// The task that takes in entries other threads hand this one and wakes idle carriers for
    /// them; ends when the crew closes (every entry has ended). Its id goes to
    /// [`Crew::board`].
    pub async fn dock(self: Rc<Self>) {
        let Some(seat) = self.seat.get() else { return };
        poll_fn(|_| {
            let mut got = seat.scratch.borrow_mut();
            seat.crew.collect(seat.me, &mut got);
            let n = got.len();
            seat.arrived.borrow_mut().extend(got.drain(..));
            let closed = seat.crew.closed();
            let mut idle = seat.idle.borrow_mut();
            let wake = if closed {
                idle.len()
            } else {
                n.min(idle.len())
            };
            // More entries arrived than carriers wait: the thread holds more than ever before,
            // and gets a carrier for each (at most one per entry of the connection).
            let short = if closed { 0 } else { n - wake };
            for t in idle.drain(..wake) {
                self.eng.wake(t);
            }
            drop(idle);
            for _ in 0..short {
                if seat.spares.get() >= seat.crew.entries() {
                    break;
                }
                seat.spares.set(seat.spares.get() + 1);
                self.spawn(self.clone().uring_spare());
            }
            if closed {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await
    }

    /// The next entry handed to this thread; `None` once the crew has closed.
    async fn next_migrant(&self) -> Option<Migrant> {
        let seat = self.seat.get()?;
        poll_fn(|_| {
            if let Some(m) = seat.arrived.borrow_mut().pop_front() {
                return Poll::Ready(Some(m));
            }
            if seat.crew.closed() {
                return Poll::Ready(None);
            }
            if let Some(t) = self.eng.current_task() {
                let mut idle = seat.idle.borrow_mut();
                if !idle.contains(&t) {
                    idle.push(t);
                }
            }
            Poll::Pending
        })
        .await
    }

    /// Hands the request `d` in `buf` (an entry of `qid`) to another queue thread if the crew's
    /// policy says so; gives the buffer back if it stays here.
    fn hand_off(&self, qid: u16, d: &transport::Delivered, buf: Buf) -> Option<Buf> {
        let Some(seat) = self.seat.get() else {
            return Some(buf);
        };
        if self.stopping.get() {
            return Some(buf);
        }
        let Some(to) = seat.crew.target(seat.me, qid, self.eng.backlog()) else {
            return Some(buf);
        };
        let m = Migrant {
            buf: buf.into_send(),
            qid,
            delivered: *d,
        };
        match seat.crew.send(to, m) {
            Ok(()) => {
                self.server.counters().handed_off();
                None
            }
            Err(m) => Some(m.buf.into_buf()),
        }
    }

    /// An entry ended on this thread (no more requests will come through it).
    fn entry_ended(&self) {
        if let Some(seat) = self.seat.get() {
            seat.crew.entry_ended();
        }
    }

    /// The queue's engine.
    pub fn engine(&self) -> &Rc<Engine> {
        &self.eng
    }

    /// The queue's server (for its counters).
    pub fn server(&self) -> &QueueServer<F> {
        &self.server
    }

    /// The legacy reader, if the queue has one.
    pub fn legacy(&self) -> Option<&LegacyQueue> {
        self.legacy.as_ref()
    }

    /// The task woken when a loop asks the queue to stop, and again once it is quiet.
    pub fn set_watcher(&self, task: TaskId) {
        self.watcher.set(Some(task));
    }

    /// Whether the queue is stopping.
    pub fn stopping(&self) -> bool {
        self.stopping.get()
    }

    /// Stopping, every request taken has been answered, and no read can deliver another.
    pub fn is_quiet(&self) -> bool {
        self.stopping.get() && self.busy.get() == 0 && self.reading.get() == 0
    }

    /// Requests handed here and answered while stopping, not yet released to the crew.
    pub fn answered_abroad(&self) -> usize {
        self.answered_abroad.get()
    }

    /// Releases to the crew the requests handed here and answered while stopping. Call it once
    /// the engine has submitted their replies: a sibling may report quiet as soon as none is in
    /// transit, and the owner then aborts the connection.
    pub fn release_answered(&self) {
        let n = self.answered_abroad.replace(0);
        if let Some(seat) = self.seat.get() {
            seat.crew.release(n);
        }
    }

    /// Whether no request handed between the crew's threads waits for an answer (always, for a
    /// queue outside a crew). A watcher that finds one is woken when the last is released.
    pub fn crew_drained(&self) -> bool {
        self.seat
            .get()
            .is_none_or(|seat| seat.crew.closed() || seat.crew.drained(seat.me))
    }

    /// Whether no entry is left that another thread could hand here (always, for a queue
    /// outside a crew): the crew closed, which wakes the watcher.
    pub fn crew_closed(&self) -> bool {
        self.seat.get().is_none_or(|seat| seat.crew.closed())
    }

    /// The error that ended the queue, if one did.
    pub fn take_failure(&self) -> Option<String> {
        self.failure.take()
    }

    /// Takes no new requests from here on.
    pub fn begin_stop(&self) {
        self.stopping.set(true);
        // Requests waiting for something only a live queue needs (an NBD reconnect) give up.
        self.server.export().queue_stopping();
        if let Some(q) = &self.legacy {
            q.stop(&self.eng);
        }
    }

    /// A loop saw the connection end or failed: stop the queue.
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
        self.eng.load_enter();
        self.server.counters().taken();
    }

    /// The request's reply is built. Only requests still in service count as the engine's load:
    /// a batch of requests read at once would otherwise see each other waiting for their reply
    /// writes and send tmpfs reads to io-wq (measured: 4k randread QD16 202k → 168k IOPS).
    fn served(&self) {
        self.eng.load_leave();
    }

    /// The request is answered.
    fn leave(&self) {
        self.busy.set(self.busy.get() - 1);
        self.server.counters().answered();
        self.wake_if_quiet();
    }

    fn wake_if_quiet(&self) {
        if self.is_quiet() {
            self.wake_watcher();
        }
    }

    /// The loop of one legacy slot: read a request into `buf`, serve it, write the reply.
    pub async fn legacy_slot(self: Rc<Self>, buf: Buf) {
        let Some(q) = &self.legacy else { return };
        let layout = q.layout();
        let mut buf = buf;
        // Made on this slot's first spliced READ.
        let mut pipe = None;
        loop {
            self.reading.set(self.reading.get() + 1);
            let read = q.next_request(&self.eng, buf).await;
            self.reading.set(self.reading.get() - 1);
            let (b, n) = match read {
                Ok(ReadOutcome::Request(b, n)) => (b, n),
                Ok(ReadOutcome::Stopped) => return self.wake_if_quiet(),
                Ok(ReadOutcome::Gone) => return self.end(None),
                Err(e) => return self.end(Some(format!("reading /dev/fuse: {e}"))),
            };
            self.enter();
            let splice = self.splicing.get();
            let (mut b, mut reply) = self
                .server
                .serve_legacy(&self.eng, &layout, b, n, splice)
                .await;
            if let LegacyReply::Splice {
                unique,
                fd,
                off,
                len,
            } = reply
            {
                match q.splice_reply(&mut pipe, unique, fd, off, len) {
                    Ok(Spliced::Sent(n)) => {
                        self.server.counters().spliced(n);
                        reply = LegacyReply::None;
                    }
                    // Short: the image shrank, and the ordinary path clamps to its new end.
                    other => {
                        if let Err(e) = other {
                            tracing::debug!("queue stops splicing READ replies: {e}");
                            self.splicing.set(false);
                        }
                        (b, reply) = self
                            .server
                            .serve_legacy(&self.eng, &layout, b, n, false)
                            .await;
                    }
                }
            }
            self.served();
            let (sent, b) = match reply {
                LegacyReply::Bytes(len) => q.send_reply(&self.eng, b, len).await,
                _ => (Ok(()), b),
            };
            self.leave();
            if let Err(e) = sent {
                return self.end(Some(format!("replying on /dev/fuse: {e}")));
            }
            buf = b;
        }
    }

    /// The loop of one io_uring entry: register `buf`, then serve each request delivered into it
    /// and commit the reply, which fetches the next. In a crew the entry may be handed to
    /// another thread; this task then carries entries handed to this thread (see
    /// [`QueueState::uring_spare`]).
    pub async fn uring_slot(self: Rc<Self>, q: Rc<UringQueue>, buf: Buf) {
        let (fetched, buf) = q.register(&self.eng, buf).await;
        self.carry(Some((q, fetched, buf))).await
    }

    /// A carrier without an entry of its own: it serves entries other threads hand this one.
    pub async fn uring_spare(self: Rc<Self>) {
        self.carry(None).await
    }

    async fn carry(
        self: &Rc<Self>,
        first: Option<(Rc<UringQueue>, Result<Fetched, TransportError>, Buf)>,
    ) {
        let mut held = first;
        loop {
            let (q, fetched, buf, handed) = match held.take() {
                Some((q, f, b)) => (q, f, b, false),
                None => {
                    let Some(m) = self.next_migrant().await else {
                        return;
                    };
                    let q = self
                        .seat
                        .get()
                        .and_then(|s| s.queues.get(usize::from(m.qid)).cloned());
                    let Some(q) = q else {
                        // Only a crew built for more kernel queues than this thread knows.
                        if let Some(seat) = self.seat.get() {
                            seat.crew.release(1);
                        }
                        self.entry_ended();
                        return self.end(Some(format!("entry of unknown queue {}", m.qid)));
                    };
                    (q, Ok(Fetched::Request(m.delivered)), m.buf.into_buf(), true)
                }
            };
            if !self.serve_entry(&q, fetched, buf, handed).await {
                return;
            }
        }
    }

    /// Serves the requests of one entry until it is handed to another thread (returns true) or
    /// ends (false). A request that was `handed` here is served here: handing it on again could
    /// bounce it between threads.
    async fn serve_entry(
        self: &Rc<Self>,
        q: &UringQueue,
        mut fetched: Result<Fetched, TransportError>,
        mut buf: Buf,
        mut handed: bool,
    ) -> bool {
        let layout = q.layout();
        loop {
            let d = match fetched {
                Ok(Fetched::Request(d)) => d,
                Ok(Fetched::Gone) => {
                    self.entry_ended();
                    self.end(None);
                    return false;
                }
                Err(e) => {
                    self.entry_ended();
                    self.end(Some(format!("io_uring queue {}: {e}", q.qid())));
                    return false;
                }
            };
            if let Some(seat) = self.seat.get() {
                if seat.crew.home(q.qid()) == seat.me {
                    self.eng.note_local();
                    // A request the kernel delivered here (not one another thread handed over).
                    if !handed {
                        self.entry_delivered(q.qid());
                    }
                }
            }
            let abroad = std::mem::take(&mut handed);
            if !abroad {
                buf = match self.hand_off(q.qid(), &d, buf) {
                    Some(b) => b,
                    None => return true,
                };
            }
            self.enter();
            if self.stopping.get() && !abroad {
                // Stopping: take nothing new. The application sees the connection go away.
                self.server
                    .refuse_uring(&layout, &mut buf, &d, libc::ENOTCONN);
            } else {
                // A request handed here was taken before its first thread stopped: answered.
                buf = self.server.serve_uring(&self.eng, &layout, buf, &d).await;
            }
            self.served();
            if abroad {
                if self.stopping.get() {
                    // This queue may have reported quiet already: the watcher releases it
                    // once the reply is submitted.
                    self.answered_abroad.set(self.answered_abroad.get() + 1);
                } else if let Some(seat) = self.seat.get() {
                    // Not stopping: this queue reports quiet only after a later submission.
                    seat.crew.release(1);
                }
            }
            self.leave();
            (fetched, buf) = q.commit_and_fetch(&self.eng, buf, d.commit_id).await;
        }
    }
}

/// Held by each task of a queue: its drop counts the task as ended.
struct Member<F: Filesystem>(Rc<QueueState<F>>);

impl<F: Filesystem> Drop for Member<F> {
    fn drop(&mut self) {
        self.0.task_ended();
    }
}
