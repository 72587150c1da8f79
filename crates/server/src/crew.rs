//! Handing io_uring entries between queue threads.
//!
//! The kernel delivers a FUSE-over-io_uring request to the queue of the CPU its submitter runs
//! on, so one busy application keeps one queue thread busy on its own CPU while the other queue
//! threads idle. But the kernel does not tie an entry to the ring that registered it: the ring
//! that commits an entry's reply (`COMMIT_AND_FETCH`) gets its next request. So a backlogged
//! thread can hand a delivered request, with its entry, to a sibling on an idle CPU, which
//! serves it, commits it from its own ring and keeps the entry; and an entry abroad goes home
//! once its home thread is idle again, so a lone request at queue depth 1 is served on the
//! submitter's CPU.
//!
//! A [`Crew`] is shared by the queue threads of one export. Each thread has a [`Harbor`] in it:
//! the entries others handed it (a lock-free bounded queue with room for every entry of the
//! connection, so a handoff never takes a lock, allocates or finds it full), the task that takes
//! them in, and the thread's load ([`engine::Gauge`]). An entry in transit is a [`Migrant`]: its
//! buffer as a [`engine::SendBuf`] (the memory stays allocated while any thread holds it), its
//! kernel queue and the request already in it.
//!
//! A stop must not lose a migrant. Each queue thread stops on its own and tells the export's
//! owner once every request it took is answered; the owner then aborts the connection. A
//! migrant is in no thread's count while it travels, and a thread that already reported may
//! still be handed one by a sibling that has not stopped yet. So the crew counts migrants from
//! [`Crew::send`] until the receiver has answered them and handed the kernel the reply
//! ([`Crew::release`]), and a thread reports only when that count is 0 ([`Crew::drained`]).

use std::sync::atomic::{fence, AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use crossbeam_queue::ArrayQueue;

use engine::{Gauge, Remote, SendBuf, TaskId};
use transport::Delivered;

/// When a queue thread hands requests to another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handoff {
    /// Never: each thread serves the entries it registered.
    Off,
    /// When this thread has requests queued behind the current one and a thread with fewer
    /// queued runs on a CPU with far fewer submitters; an entry goes back to its home thread
    /// once that one is idle or the CPU holding it gets submitters of its own.
    Auto,
    /// Every request goes to the next thread (tests: every request crosses threads).
    Always,
}

/// An entry in transit between threads: its buffer, its kernel queue, the request it holds.
#[derive(Debug)]
pub struct Migrant {
    /// The entry's buffer (header area and payload).
    pub buf: SendBuf,
    /// The kernel queue the entry belongs to.
    pub qid: u16,
    /// The request the kernel delivered into it, not yet served.
    pub delivered: Delivered,
}

/// One queue thread's place in the crew.
pub struct Harbor {
    /// Entries handed to this thread and not yet taken in; room for every entry of the
    /// connection, since an entry is in at most one inbox at a time.
    inbox: ArrayQueue<Migrant>,
    /// The thread's load, once it runs.
    gauge: OnceLock<Arc<Gauge>>,
    /// The task that takes entries in, and how to wake it.
    dock: OnceLock<(Remote, TaskId)>,
    /// A wakeup of the dock is on its way (saves sending another).
    woken: AtomicBool,
    /// The task that reports the thread's queue quiet, and how to wake it.
    watcher: OnceLock<(Remote, TaskId)>,
    /// That task waits for the crew's migrants to be answered ([`Crew::drained`]).
    waiting: AtomicBool,
}

/// The queue threads of one export that may hand entries to each other.
pub struct Crew {
    harbors: Vec<Harbor>,
    mode: Handoff,
    /// Kernel queues; queue `qid` was registered by thread `qid % threads`.
    qids: usize,
    /// Entries of the connection (every kernel queue's).
    entries: usize,
    /// Entries registered and not yet ended: when it drops to 0 every dock closes. Threads
    /// register entries as their load asks ([`Crew::entry_added`]).
    alive: AtomicUsize,
    closed: AtomicBool,
    /// Migrants sent and not yet released by their receivers.
    transit: AtomicUsize,
}

impl Crew {
    /// A crew of `threads` threads serving `qids` kernel queues with `depth` entries each.
    pub fn new(threads: usize, qids: usize, depth: usize, mode: Handoff) -> Arc<Crew> {
        let mode = if threads < 2 { Handoff::Off } else { mode };
        let entries = qids * depth;
        Arc::new(Crew {
            harbors: (0..threads)
                .map(|_| Harbor {
                    inbox: ArrayQueue::new(entries.max(1)),
                    gauge: OnceLock::new(),
                    dock: OnceLock::new(),
                    woken: AtomicBool::new(false),
                    watcher: OnceLock::new(),
                    waiting: AtomicBool::new(false),
                })
                .collect(),
            mode,
            qids,
            entries,
            alive: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            transit: AtomicUsize::new(0),
        })
    }

    /// Threads in the crew.
    pub fn threads(&self) -> usize {
        self.harbors.len()
    }

    /// Kernel queues served.
    pub fn qids(&self) -> usize {
        self.qids
    }

    /// Entries the connection may have (every kernel queue at full depth): as many as one
    /// thread may hold.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// The handoff policy.
    pub fn mode(&self) -> Handoff {
        self.mode
    }

    /// The thread that registered the entries of kernel queue `qid`.
    pub fn home(&self, qid: u16) -> usize {
        usize::from(qid) % self.threads().max(1)
    }

    /// Thread `me` is running: its load and dock task become visible to the others.
    pub fn board(&self, me: usize, gauge: Arc<Gauge>, remote: Remote, dock: TaskId) {
        if let Some(h) = self.harbors.get(me) {
            let _ = h.gauge.set(gauge);
            let _ = h.dock.set((remote, dock));
        }
    }

    /// The task of thread `me` that reports its queue quiet: woken by the release that leaves
    /// no migrant in transit, and when the crew closes.
    pub fn watch(&self, me: usize, remote: Remote, watcher: TaskId) {
        if let Some(h) = self.harbors.get(me) {
            let _ = h.watcher.set((remote, watcher));
        }
    }

    /// Load of thread `t`: the work its last loop turn found, plus entries waiting in its inbox.
    fn load(&self, t: usize) -> u32 {
        let h = &self.harbors[t];
        let queued = u32::try_from(h.inbox.len()).unwrap_or(u32::MAX);
        match h.gauge.get() {
            Some(g) => g.get().saturating_add(queued),
            // Not running yet: not a place to send work.
            None => u32::MAX,
        }
    }

    /// Requests thread `t` served from its own kernel queues (submitters on its CPU) in its
    /// last gauge window.
    fn local(&self, t: usize) -> u32 {
        self.harbors[t].gauge.get().map_or(u32::MAX, |g| g.local())
    }

    /// [`Crew::local`] of another thread as seen at `now`: 0 once it has served none for
    /// [`QUIET_US`].
    fn local_other(&self, t: usize, now: u64) -> u32 {
        match self.harbors[t].gauge.get() {
            Some(g) => seen_local(g.local(), g.local_age(now)),
            None => u32::MAX,
        }
    }

    /// Where thread `me`, about to serve a request of kernel queue `qid` with `backlog` more
    /// requests queued behind it, should send it instead: `None` to serve it itself.
    pub fn target(&self, me: usize, qid: u16, backlog: usize) -> Option<usize> {
        let n = self.threads();
        match self.mode {
            Handoff::Off => None,
            Handoff::Always => Some((me + 1) % n),
            Handoff::Auto => {
                // Read only when the policy compares CPUs' submitters (a backlog, or an entry
                // abroad).
                let now = std::cell::OnceCell::new();
                auto_target(
                    me,
                    self.home(qid),
                    u32::try_from(backlog).unwrap_or(u32::MAX),
                    n,
                    |t| self.load(t),
                    |t| {
                        if t == me {
                            self.local(t)
                        } else {
                            self.local_other(t, *now.get_or_init(engine::gauge_clock))
                        }
                    },
                )
            }
        }
    }

    /// Puts `m` in thread `to`'s inbox and wakes its dock (from a queue thread: the wakeup goes
    /// out with the caller's next ring submission). Gives `m` back if `to` is not running or the
    /// crew has closed.
    pub fn send(&self, to: usize, m: Migrant) -> Result<(), Migrant> {
        if self.closed() {
            return Err(m);
        }
        let Some(h) = self.harbors.get(to) else {
            return Err(m);
        };
        let Some((remote, dock)) = h.dock.get() else {
            return Err(m);
        };
        // Counted before it can be seen: a sibling checking `drained` never misses it.
        self.transit.fetch_add(1, Ordering::SeqCst);
        // Full only if more entries were handed around than the connection has: then the
        // caller keeps it.
        if let Err(m) = h.inbox.push(m) {
            self.release(1);
            return Err(m);
        }
        // Pairs with the fence in `collect`: either the dock's drain sees this entry, or this
        // swap sees the dock's `false` and wakes it again.
        fence(Ordering::SeqCst);
        if !h.woken.swap(true, Ordering::AcqRel) {
            remote.wake_by_ring(*dock);
        }
        Ok(())
    }

    /// Takes the entries waiting for thread `me` into `into`.
    pub fn collect(&self, me: usize, into: &mut Vec<Migrant>) {
        let Some(h) = self.harbors.get(me) else {
            return;
        };
        // Cleared before the inbox is read: a push after this read wakes the dock again.
        h.woken.store(false, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        while let Some(m) = h.inbox.pop() {
            into.push(m);
        }
    }

    /// `n` migrants this thread received are answered and their replies are with the kernel.
    /// The release that leaves none in transit wakes the watchers waiting in [`Crew::drained`].
    pub fn release(&self, n: usize) {
        if n == 0 || self.transit.fetch_sub(n, Ordering::SeqCst) != n {
            return;
        }
        for h in &self.harbors {
            if h.waiting.load(Ordering::SeqCst) {
                if let Some((remote, task)) = h.watcher.get() {
                    remote.wake(*task);
                }
            }
        }
    }

    /// Whether no migrant is in transit, for thread `me`'s watcher (which a release that
    /// leaves none wakes from here on).
    pub fn drained(&self, me: usize) -> bool {
        if let Some(h) = self.harbors.get(me) {
            // Pairs with `release`: either its decrement is seen here, or it sees `waiting`.
            h.waiting.store(true, Ordering::SeqCst);
        }
        self.transit.load(Ordering::SeqCst) == 0
    }

    /// A thread registers one more entry.
    pub fn entry_added(&self) {
        self.alive.fetch_add(1, Ordering::AcqRel);
    }

    /// An entry ended (its connection is gone, or it failed). The last one closes every dock.
    pub fn entry_ended(&self) {
        if self.alive.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.close();
        }
    }

    /// No entry is left to hand around: every dock and its idle carriers end, and so do the
    /// watchers of stopped queues.
    pub fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        for h in &self.harbors {
            if let Some((remote, dock)) = h.dock.get() {
                remote.wake(*dock);
            }
            // A stopped queue's watcher ends once no entry could be handed to its thread.
            if let Some((remote, watcher)) = h.watcher.get() {
                remote.wake(*watcher);
            }
        }
    }

    /// Whether the crew has closed.
    pub fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

/// How long a CPU must have gone without submitters (no request from its own kernel queues) to
/// count as having none, whatever its last window counted. A submitter that hops between CPUs
/// (one fio job woken on whichever CPU is idle) leaves both CPUs with similar window counts, so
/// without this the CPU it just left looks busy and gets nothing, and a queue depth's worth of
/// requests follows the submitter from CPU to CPU while the other CPU idles (measured, 128k
/// writes QD16, 2 vCPUs: 29-34k IOPS in that state, 40-53k out of it). 500 µs is a few times a
/// request's service time, far below the hop period of that state (a turn of ~1 ms).
const QUIET_US: u64 = 500;

/// A thread's local work as the policy sees it: its last window's count, or 0 once it has been
/// `age` microseconds without any.
fn seen_local(window: u32, age: u64) -> u32 {
    if age > QUIET_US {
        0
    } else {
        window
    }
}

/// The `auto` policy, given each thread's load (queued work) and local work (requests from its
/// own CPU's submitters) in its last window.
fn auto_target(
    me: usize,
    home: usize,
    backlog: u32,
    n: usize,
    load: impl Fn(usize) -> u32,
    local: impl Fn(usize) -> u32,
) -> Option<usize> {
    if home != me {
        // An entry abroad goes home once home is idle, or once this thread's CPU has comparable
        // submitters of its own: served away from its submitter's CPU it costs cross-CPU
        // wakeups, worth paying only for an otherwise idle CPU.
        let back = (backlog == 0 && load(home) == 0) || local(me).saturating_mul(4) > local(home);
        return back.then_some(home);
    }
    if backlog < 2 {
        return None;
    }
    // To the least loaded thread if it has less queued than this one, and only if its CPU has
    // far fewer submitters than this one's: between busy CPUs a handoff adds no CPU and costs a
    // wakeup and the request's cache lines (measured: 4 jobs on 2 queues lost 10-20 % without
    // this condition).
    let mine = local(me);
    let (t, l) = (0..n)
        .filter(|&t| t != me && local(t).saturating_mul(4) <= mine)
        .map(|t| (t, load(t)))
        .min_by_key(|&(_, l)| l)?;
    (l.saturating_add(1) < backlog).then_some(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::{Engine, EngineConfig};
    use std::cell::Cell;
    use std::rc::Rc;
    use std::time::Duration;

    /// Two engines with two 4 KiB buffers each, one per thread of a crew of two.
    fn two_engines() -> Vec<Engine> {
        (0..2)
            .map(|_| {
                Engine::new(&EngineConfig {
                    buffers: 2,
                    buffer_size: 4096,
                    ..EngineConfig::default()
                })
                .unwrap()
            })
            .collect()
    }

    fn delivered() -> Delivered {
        Delivered {
            header: fuse_abi::InHeader::default(),
            commit_id: 7,
            payload_sz: 0,
        }
    }

    #[test]
    fn auto_hands_off_a_backlog_to_an_idle_cpu_only() {
        let auto = |me, home, backlog, loads: [u32; 2], locals: [u32; 2]| {
            auto_target(me, home, backlog, 2, |t| loads[t], |t| locals[t])
        };
        // One submitter on CPU 0, thread 1 idle: a backlog of 1 stays, of 2 or more moves.
        assert_eq!(auto(0, 0, 1, [5, 0], [100, 0]), None);
        assert_eq!(auto(0, 0, 2, [5, 0], [100, 0]), Some(1));
        // Not to a thread with as much queued.
        assert_eq!(auto(0, 0, 3, [5, 2], [100, 0]), None);
        assert_eq!(auto(0, 0, 4, [5, 2], [100, 0]), Some(1));
        // Not to a CPU with submitters of its own (4 jobs on 2 CPUs), however queued.
        assert_eq!(auto(0, 0, 30, [5, 0], [100, 30]), None);
        // Abroad: stays while home is busy and this CPU has no submitters of its own...
        assert_eq!(auto(1, 0, 0, [5, 0], [100, 0]), None);
        // ...goes home once home is idle (queue depth 1 after a burst)...
        assert_eq!(auto(1, 0, 0, [0, 0], [3, 0]), Some(0));
        // ...or once this CPU has comparable submitters.
        assert_eq!(auto(1, 0, 3, [5, 1], [100, 30]), Some(0));
    }

    #[test]
    fn inbox_counts_as_load_and_buffers_come_through_whole() {
        let crew = Crew::new(2, 2, 4, Handoff::Auto);
        let engines = two_engines();
        let migrant = |e: &Engine| Migrant {
            buf: e.take_buffer().unwrap().into_send(),
            qid: 0,
            delivered: delivered(),
        };
        // Not running yet: nothing is handed to a thread that has not boarded.
        assert!(crew.send(1, migrant(&engines[0])).is_err());
        assert_eq!(crew.load(1), u32::MAX);
        for (t, e) in engines.iter().enumerate() {
            crew.board(t, e.gauge(), e.remote(), 0);
        }
        crew.send(1, migrant(&engines[0])).unwrap();
        crew.send(1, migrant(&engines[0])).unwrap();
        assert_eq!(crew.load(1), 2);
        assert_eq!(engines[0].buffers_available(), 0);
        let mut got = Vec::new();
        crew.collect(1, &mut got);
        assert_eq!(got.len(), 2);
        assert_eq!(crew.load(1), 0);
        // Dropped on the receiving side, the buffers go back to their own pool.
        drop(got);
        assert_eq!(engines[0].buffers_available(), 2);
        // A closed crew takes nothing more.
        crew.close();
        assert!(crew.send(1, migrant(&engines[0])).is_err());
    }

    #[test]
    fn migrants_count_until_released_and_the_last_release_wakes_waiting_watchers() {
        let crew = Crew::new(2, 2, 4, Handoff::Always);
        let engines = two_engines();
        // Thread 0's dock (which sends wake) and watcher, which waits for the crew's migrants as
        // a stopped queue's does.
        let dock = engines[0].spawn(std::future::pending());
        let woken = Rc::new(Cell::new(0));
        let watcher = {
            let (crew, woken) = (crew.clone(), woken.clone());
            engines[0].spawn(async move {
                std::future::poll_fn(|_| {
                    woken.set(woken.get() + 1);
                    if crew.drained(0) {
                        std::task::Poll::Ready(())
                    } else {
                        std::task::Poll::Pending
                    }
                })
                .await;
            })
        };
        crew.board(0, engines[0].gauge(), engines[0].remote(), dock);
        crew.board(1, engines[1].gauge(), engines[1].remote(), 0);
        crew.watch(0, engines[0].remote(), watcher);
        assert!(crew.drained(1));
        let migrant = || Migrant {
            buf: engines[1].take_buffer().unwrap().into_send(),
            qid: 0,
            delivered: delivered(),
        };
        crew.send(0, migrant()).unwrap();
        crew.send(0, migrant()).unwrap();
        // Taken in by the receiver, they still count: not answered yet.
        let mut got = Vec::new();
        crew.collect(0, &mut got);
        assert_eq!(got.len(), 2);
        assert!(!crew.drained(1));
        // A few loop turns of thread 0: its ready tasks run and wakeups sent to it arrive.
        let turns = |e: &Engine| {
            for _ in 0..3 {
                e.block_on(e.sleep(Duration::from_millis(2))).unwrap();
            }
        };
        // The watcher polls once and waits.
        turns(&engines[0]);
        assert_eq!(woken.get(), 1);
        crew.release(1);
        assert!(!crew.drained(1));
        // The release that leaves none wakes it, and it finds the crew drained.
        crew.release(1);
        assert!(crew.drained(1));
        turns(&engines[0]);
        assert_eq!(woken.get(), 2);
        // A send that finds the inbox full counts nothing.
        drop(got);
        let crew1 = Crew::new(2, 1, 1, Handoff::Always);
        crew1.board(1, engines[1].gauge(), engines[1].remote(), 0);
        crew1.send(1, migrant()).unwrap();
        assert!(crew1.send(1, migrant()).is_err());
        assert!(!crew1.drained(0));
        crew1.release(1);
        assert!(crew1.drained(0));
    }

    #[test]
    fn a_cpu_quiet_for_a_while_takes_a_backlog_whatever_its_last_window_counted() {
        let crew = Crew::new(2, 2, 4, Handoff::Auto);
        let engines: Vec<Engine> = (0..2)
            .map(|_| Engine::new(&EngineConfig::default()).unwrap())
            .collect();
        for (t, e) in engines.iter().enumerate() {
            crew.board(t, e.gauge(), e.remote(), 0);
        }
        // Both threads serve requests of their own queues for a whole gauge window.
        let busy = |e: &Engine| {
            for _ in 0..10 {
                e.note_local();
            }
            e.block_on(e.sleep(Duration::from_millis(3))).unwrap();
        };
        busy(&engines[1]);
        busy(&engines[0]);
        // Thread 1 then serves nothing of its own for longer than QUIET_US: it counts as a CPU
        // without submitters, though its last window still says as many as thread 0's.
        std::thread::sleep(Duration::from_micros(QUIET_US * 2));
        assert_eq!((crew.local(0), crew.local(1)), (10, 10));
        assert_eq!(crew.target(0, 0, 5), Some(1));
        // The rule itself: a window's count holds until the CPU has been quiet for QUIET_US.
        assert_eq!(seen_local(10, 0), 10);
        assert_eq!(seen_local(10, QUIET_US), 10);
        assert_eq!(seen_local(10, QUIET_US + 1), 0);
    }

    #[test]
    fn entries_handed_from_another_thread_all_arrive_and_wake_the_dock() {
        // Thread 0 hands bursts of entries to thread 1, and after each burst waits until the
        // dock took them all in, with nothing more pushed to wake it: an entry pushed just as the
        // dock drained its inbox, and no wakeup for it, would stay there and stop the count.
        const BURSTS: usize = 5_000;
        let crew = Crew::new(2, 2, 4, Handoff::Always);
        let got = Arc::new(AtomicUsize::new(0));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let receiver = {
            let (crew, got) = (crew.clone(), got.clone());
            std::thread::spawn(move || {
                let eng = Engine::new(&EngineConfig::default()).unwrap();
                let dock = eng.spawn(async move {
                    let mut taken = Vec::with_capacity(8);
                    std::future::poll_fn(|_| {
                        crew.collect(1, &mut taken);
                        got.fetch_add(taken.len(), Ordering::Release);
                        // Dropped here, the buffers go back to the sender's pool.
                        taken.clear();
                        if crew.closed() {
                            std::task::Poll::Ready(())
                        } else {
                            std::task::Poll::Pending
                        }
                    })
                    .await;
                });
                ready_tx.send((eng.gauge(), eng.remote(), dock)).unwrap();
                eng.run().unwrap();
            })
        };
        let (gauge, remote, dock) = ready_rx.recv().unwrap();
        crew.board(1, gauge, remote, dock);
        let eng = Engine::new(&EngineConfig {
            buffers: 4,
            buffer_size: 4096,
            ..EngineConfig::default()
        })
        .unwrap();
        let mut sent = 0;
        let mut stuck = None;
        for burst in 0..BURSTS {
            for i in 0..=burst % 3 {
                if i > 0 {
                    // Spread the later pushes of a burst over the time the dock takes to wake
                    // and drain, so some land while it drains.
                    let pause = Duration::from_nanos((burst as u64 * 7919 + i as u64 * 131) % 4000);
                    let t = std::time::Instant::now();
                    while t.elapsed() < pause {
                        std::hint::spin_loop();
                    }
                }
                let Some(b) = eng.take_buffer() else { break };
                let m = Migrant {
                    buf: b.into_send(),
                    qid: 0,
                    delivered: delivered(),
                };
                crew.send(1, m).unwrap();
                sent += 1;
            }
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while got.load(Ordering::Acquire) < sent && std::time::Instant::now() < deadline {
                std::thread::yield_now();
            }
            if got.load(Ordering::Acquire) < sent {
                stuck = Some(burst);
                break;
            }
        }
        crew.close();
        receiver.join().unwrap();
        assert_eq!(stuck, None, "entries stayed in the inbox without a wakeup");
        assert_eq!(got.load(Ordering::Acquire), sent);
    }

    #[test]
    fn one_thread_never_hands_off_and_the_last_entry_closes_the_crew() {
        let crew = Crew::new(1, 1, 2, Handoff::Always);
        assert_eq!(crew.mode(), Handoff::Off);
        assert_eq!(crew.target(0, 0, 100), None);
        crew.entry_added();
        crew.entry_added();
        assert!(!crew.closed());
        crew.entry_ended();
        assert!(!crew.closed());
        crew.entry_ended();
        assert!(crew.closed());
    }

    #[test]
    fn always_sends_every_request_to_the_next_thread() {
        let crew = Crew::new(3, 3, 1, Handoff::Always);
        assert_eq!(crew.target(0, 0, 0), Some(1));
        assert_eq!(crew.target(2, 1, 0), Some(0));
        assert_eq!(crew.home(4), 1);
    }
}
