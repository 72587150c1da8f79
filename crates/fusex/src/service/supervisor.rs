//! The one thread that supervises every export of `fusex serve` (`fusex-exports`), so that the
//! daemon's threads do not grow with its exports: each export is a [`lifecycle::Supervisor`]
//! kept here with its [`lifecycle::Prepared`] and owner, fed the events sent to it (tagged with
//! its serial, through an [`ExportTx`]) and ticked when its wake-up is due. An export that is done
//! is ended here too, then handed to the reaper as `Finished`.
//!
//! What an export does on this thread is short, except ending it: the final flush, the abort and
//! the unmount (`lifecycle::conclude`) take as long as the image and the kernel take (an NBD
//! server's flush is bounded by `--nbd-timeout`, a slow disk's by nothing). So an export that is
//! done is ended on an `Enders` thread instead, and the other exports' events, additions and
//! ticks go on meanwhile. Mounting (`lifecycle::setup`) stays on the thread that adds the
//! export.

use std::collections::{BTreeMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::{Finished, ServiceOwner};
use crate::lifecycle::{self, Event, Owner, Prepared, Supervisor};
use crate::privileges::Plan;

/// What the exports' thread is sent.
enum Msg {
    /// An event for the export `serial` (dropped if it already ended, as an event left in an
    /// ended export's channel was).
    Event(u64, Event),
    /// A mounted export to start serving.
    Add(Box<Adding>),
}

/// A mounted export on its way to the exports' thread.
struct Adding {
    serial: u64,
    id: String,
    prepared: Prepared,
    owner: ServiceOwner,
    /// What its queues report through.
    report: server::Report,
    /// Cleared once the export ended (see [`ExportTx`]).
    open: Arc<AtomicBool>,
    /// Entered for its work here, so that its lines carry its id.
    span: tracing::Span,
}

/// An export being supervised.
struct Slot {
    id: String,
    /// Entered for each of its events and ticks, and its end ([`crate::logging::export_span`]).
    span: tracing::Span,
    sup: Supervisor,
    prepared: Prepared,
    owner: ServiceOwner,
    open: Arc<AtomicBool>,
    /// When its next tick is due: its [`Supervisor::next_wakeup`] after its last event or tick,
    /// as a thread of its own waiting for its events would time out.
    due: Instant,
}

/// The export's supervisor is gone: the export ended.
#[derive(Debug)]
pub struct Gone;

/// How the commands reach one export's supervisor: its events, tagged with its serial, on the
/// exports' thread's channel.
#[derive(Clone)]
pub struct ExportTx {
    serial: u64,
    tx: mpsc::Sender<Msg>,
    /// Whether the export is still supervised: sending to one that ended fails, as it did on a
    /// channel of its own.
    open: Arc<AtomicBool>,
}

impl ExportTx {
    /// Sends `ev` to the export; [`Gone`] once it ended.
    pub fn send(&self, ev: Event) -> Result<(), Gone> {
        if !self.open.load(Ordering::Acquire) {
            return Err(Gone);
        }
        self.tx.send(Msg::Event(self.serial, ev)).map_err(|_| Gone)
    }
}

/// The sending side of the exports' thread, which [`super::Service`] keeps.
pub struct Supervisors {
    tx: mpsc::Sender<Msg>,
}

impl Supervisors {
    /// Starts the exports' thread; each export that ends is sent to `finished`. The thread ends
    /// once nothing can send to it any more.
    pub(super) fn start(finished: mpsc::Sender<Finished>) -> std::io::Result<Supervisors> {
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("fusex-exports".into())
            .spawn(move || {
                // Unmounts, final flushes and the `fusex-end` threads it starts: control work.
                crate::priority::lower_this_thread();
                run(rx, finished)
            })?;
        Ok(Supervisors { tx })
    }

    /// Hands the mounted export `serial` to the exports' thread, which starts its queues;
    /// `owner` hears when it serves. Returns how to reach it.
    pub(super) fn add(
        &self,
        serial: u64,
        id: &str,
        prepared: Prepared,
        owner: ServiceOwner,
    ) -> Result<ExportTx, String> {
        let tx = self.tx.clone();
        let report: server::Report = Arc::new(move |e| {
            let _ = tx.send(Msg::Event(serial, Event::Queue(e)));
        });
        let open = Arc::new(AtomicBool::new(true));
        let adding = Adding {
            serial,
            id: id.to_string(),
            prepared,
            owner,
            report,
            open: open.clone(),
            span: crate::logging::export_span(id),
        };
        self.tx
            .send(Msg::Add(Box::new(adding)))
            .map_err(|_| "the exports' thread ended".to_string())?;
        Ok(ExportTx {
            serial,
            tx: self.tx.clone(),
            open,
        })
    }
}

/// The exports' thread: events and additions as they come, ticks as they fall due, and each
/// export ended once it is done.
fn run(rx: mpsc::Receiver<Msg>, finished: mpsc::Sender<Finished>) {
    let mut slots: BTreeMap<u64, Slot> = BTreeMap::new();
    let enders = Enders::new(finished.clone());
    loop {
        let due = slots.values().map(|s| s.due).min();
        let msg = match due {
            None => match rx.recv() {
                Ok(m) => Some(m),
                Err(_) => break,
            },
            Some(due) => match rx.recv_timeout(due.saturating_duration_since(Instant::now())) {
                Ok(m) => Some(m),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            },
        };
        let mut touched = Vec::new();
        match msg {
            Some(Msg::Event(serial, ev)) if slots.contains_key(&serial) => {
                guarded(&mut slots, serial, |s| {
                    s.sup.handle(&mut s.prepared, ev, &mut s.owner);
                    // Its tick is due counted from now: what the event started (an abort, and
                    // the queues' time to end after it) is not cut short by a tick that fell
                    // due while it was handled.
                    s.due = Instant::now() + s.sup.next_wakeup();
                });
                touched.push(serial);
            }
            // An export that ended: dropped, with what it carries (a Release's answer channels).
            Some(Msg::Event(..)) => {}
            Some(Msg::Add(a)) => {
                let span = a.span.clone();
                let _in = span.enter();
                let started = std::panic::catch_unwind(AssertUnwindSafe(|| start(*a, &finished)));
                match started {
                    Ok(Some((serial, slot))) => {
                        touched.push(serial);
                        slots.insert(serial, slot);
                    }
                    Ok(None) => {}
                    Err(_) => tracing::error!("an export's supervisor panicked as it started"),
                }
            }
            None => {}
        }
        let now = Instant::now();
        let ticks: Vec<u64> = slots
            .iter()
            .filter(|(_, s)| s.due <= now)
            .map(|(k, _)| *k)
            .collect();
        for serial in ticks {
            guarded(&mut slots, serial, |s| {
                s.sup.tick(&mut s.prepared, &mut s.owner)
            });
            touched.push(serial);
        }
        for serial in touched {
            let Some(s) = slots.get_mut(&serial) else {
                continue;
            };
            if s.sup.done() {
                if let Some(s) = slots.remove(&serial) {
                    enders.end(serial, s);
                }
            } else {
                s.due = Instant::now() + s.sup.next_wakeup();
            }
        }
    }
    // Nothing can reach the exports any more (the daemon is going away): each ends as a
    // supervisor whose channel closed did.
    for (serial, mut s) in std::mem::take(&mut slots) {
        let span = s.span.clone();
        let _in = span.enter();
        s.sup.closed(&s.prepared);
        drop(_in);
        enders.end(serial, s);
    }
}

/// Enders at most: the exports ending at once beyond this wait for one of them (a daemon told
/// to quit with many exports keeps a bounded number of threads).
const ENDERS: usize = 4;

/// How long an ender waits for another export to end before its thread exits: a daemon whose
/// exports come and go keeps one, an idle daemon none.
const ENDER_IDLE: Duration = Duration::from_millis(500);

/// The threads (`fusex-end`) that end exports, so that one export's final flush and unmount,
/// however long its storage takes, never holds up the others' events on the exports' thread.
/// Started as exports end and gone once idle; each export is ended by one of them, its
/// `BLOCK_EXPORT_DELETED` sent when its own end is done.
struct Enders {
    shared: Arc<EndersShared>,
    finished: mpsc::Sender<Finished>,
}

struct EndersShared {
    state: Mutex<EndersState>,
    work: Condvar,
}

#[derive(Default)]
struct EndersState {
    waiting: VecDeque<(u64, Slot)>,
    /// Threads running, and how many of them wait for work.
    threads: usize,
    idle: usize,
}

impl Enders {
    fn new(finished: mpsc::Sender<Finished>) -> Enders {
        Enders {
            shared: Arc::new(EndersShared {
                state: Mutex::new(EndersState::default()),
                work: Condvar::new(),
            }),
            finished,
        }
    }

    /// Ends export `serial` on an ender thread: an idle one, a new one while there are fewer
    /// than [`ENDERS`], else the next one free. Here instead, if no thread can be started.
    fn end(&self, serial: u64, s: Slot) {
        let mut st = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        st.waiting.push_back((serial, s));
        if st.idle > 0 {
            drop(st);
            self.shared.work.notify_one();
            return;
        }
        if st.threads >= ENDERS {
            return;
        }
        st.threads += 1;
        drop(st);
        let shared = self.shared.clone();
        let finished = self.finished.clone();
        let spawned = std::thread::Builder::new()
            .name("fusex-end".into())
            .spawn(move || ender(&shared, &finished));
        if let Err(e) = spawned {
            tracing::warn!("cannot start a thread to end exports ({e}); ending them here");
            let mut st = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
            st.threads -= 1;
            let mine = if st.threads == 0 {
                std::mem::take(&mut st.waiting)
            } else {
                VecDeque::new()
            };
            drop(st);
            for (serial, s) in mine {
                end(serial, s, &self.finished);
            }
        }
    }
}

/// An ender thread: ends waiting exports until none came for [`ENDER_IDLE`].
fn ender(shared: &EndersShared, finished: &mpsc::Sender<Finished>) {
    let mut st = shared.state.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        if let Some((serial, s)) = st.waiting.pop_front() {
            drop(st);
            end(serial, s, finished);
            st = shared.state.lock().unwrap_or_else(|p| p.into_inner());
            continue;
        }
        st.idle += 1;
        let (next, timeout) = shared
            .work
            .wait_timeout(st, ENDER_IDLE)
            .unwrap_or_else(|p| p.into_inner());
        st = next;
        st.idle -= 1;
        if timeout.timed_out() && st.waiting.is_empty() {
            st.threads -= 1;
            return;
        }
    }
}

/// Runs `f` on export `serial`'s slot; a panic in it ends that export alone (its mount goes
/// with its `Prepared`), as a panic on a supervisor thread of its own did, and the other exports
/// are served on.
fn guarded(slots: &mut BTreeMap<u64, Slot>, serial: u64, f: impl FnOnce(&mut Slot)) {
    let Some(s) = slots.get_mut(&serial) else {
        return;
    };
    let span = s.span.clone();
    let _in = span.enter();
    if std::panic::catch_unwind(AssertUnwindSafe(|| f(s))).is_err() {
        if let Some(s) = slots.remove(&serial) {
            s.open.store(false, Ordering::Release);
            tracing::error!("export {}: its supervisor panicked", s.id);
        }
    }
}

/// Starts a mounted export's queues; None when they could not start (the export ended, and the
/// command that added it hears why).
fn start(a: Adding, finished: &mpsc::Sender<Finished>) -> Option<(u64, Slot)> {
    let Adding {
        serial,
        id,
        mut prepared,
        owner,
        report,
        open,
        span,
    } = a;
    match Supervisor::start(&mut prepared, Plan::none(), report, true) {
        Ok(sup) => {
            let due = Instant::now() + sup.next_wakeup();
            Some((
                serial,
                Slot {
                    id,
                    span,
                    sup,
                    prepared,
                    owner,
                    open,
                    due,
                },
            ))
        }
        Err(e) => {
            open.store(false, Ordering::Release);
            conclude(serial, id, prepared, owner, Err(e), finished);
            None
        }
    }
}

/// Ends an export whose supervisor is done (or can no longer be reached).
fn end(serial: u64, s: Slot, finished: &mpsc::Sender<Finished>) {
    let name = s.id.clone();
    let span = s.span.clone();
    let _in = span.enter();
    let ended = std::panic::catch_unwind(AssertUnwindSafe(|| end_unguarded(serial, s, finished)));
    if ended.is_err() {
        tracing::error!("export {name}: its supervisor panicked as it ended");
    }
}

/// [`end`], which catches its panics.
fn end_unguarded(serial: u64, s: Slot, finished: &mpsc::Sender<Finished>) {
    let Slot {
        id,
        sup,
        mut prepared,
        mut owner,
        open,
        ..
    } = s;
    let result = sup.finish(&mut prepared, &mut owner);
    open.store(false, Ordering::Release);
    conclude(serial, id, prepared, owner, result, finished);
}

/// What follows an export's supervision: it is left to a successor that took it, or unmounted;
/// either way the reaper hears of it.
fn conclude(
    serial: u64,
    id: String,
    prepared: Prepared,
    mut owner: ServiceOwner,
    result: anyhow::Result<lifecycle::Ended>,
    finished: &mpsc::Sender<Finished>,
) {
    if let Err(e) = &result {
        owner.failed(&format!("{e:#}"));
    }
    owner.failed("the export ended before it served");
    if result.as_ref().is_ok_and(|e| e.handed_to.is_some()) {
        // A successor serves the mount: leave it, its mountpoint file, the watcher (the
        // successor holds the pipe too) and the runtime files (it took them).
        prepared.mnt.disown();
        prepared.settled.disown();
        if let Some(p) = owner.published.take() {
            p.leave();
        }
        let _ = finished.send(Finished {
            id,
            serial,
            error: None,
            handed: true,
        });
        return;
    }
    let error = lifecycle::conclude(prepared, result)
        .err()
        .map(|e| format!("{e:#}"));
    // Its files in the runtime directory go once it is unmounted.
    drop(owner);
    let _ = finished.send(Finished {
        id,
        serial,
        error,
        handed: false,
    });
}
