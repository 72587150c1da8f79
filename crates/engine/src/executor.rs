//! The engine: one io_uring, its op table, the buffer pool and the task executor.

use std::cell::{Cell, OnceCell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Waker};
use std::time::{Duration, Instant};

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use crate::buf::{Buf, Pool};
use crate::multishot::{BufGroup, MultiOp, MultiQueues, Provided};
use crate::op::{Op, OpState, OpTable, Owned, Woken};
use crate::remote::{Remote, RemoteShared};
use crate::table::{FileTable, SlotList};
use crate::{EngineError, Sqe};

/// The most slots a ring's fixed-buffer table may have (`IORING_MAX_REG_BUFFERS`).
pub const MAX_BUFFER_TABLE: u32 = 1 << 14;

/// Ids of engines, so a pool knows whose tables its slots are in (0: nobody's).
static NEXT_ENGINE_ID: AtomicU64 = AtomicU64::new(1);

/// Index of a task spawned on an engine.
///
/// Ids of finished (or dropped) tasks are reused by later [`Engine::spawn`]s, so an engine that
/// spawns a task per tenant or per connection for days keeps its task table as large as its most
/// tasks alive at once. A wakeup that names an id after its task ended (a stale [`Waker`], a late
/// [`crate::Remote::wake`] or `IORING_OP_MSG_RING`) may therefore poll whichever task holds the id
/// now: a spurious wakeup, which every future must tolerate (as `Future::poll`'s contract already
/// asks), never a lost one.
pub type TaskId = u32;

/// `user_data` of the engine's own eventfd read (cross-thread wakeups).
const UD_REMOTE: u64 = u64::MAX;
/// `user_data` of fire-and-forget entries whose completion nobody awaits (they lend no memory).
const UD_IGNORE: u64 = u64::MAX - 1;
/// Tag of a wakeup another engine posted with `IORING_OP_MSG_RING`; the low 32 bits are the task.
const UD_WAKE: u64 = 1 << 62;

thread_local! {
    /// The engine running on this thread (inside [`Engine::run`], [`Engine::block_on`] or while
    /// its `Drop` drops tasks), null otherwise. Lets wakers schedule local tasks without a
    /// system call and lets [`crate::borrowed`] operations find their ring.
    static CURRENT: Cell<*const Engine> = const { Cell::new(std::ptr::null()) };
}

/// The engine running on this thread, or null. Non-null only while that engine is borrowed on
/// this thread by `run`, `block_on` or `drop`, so it is live for as long as it is returned.
pub(crate) fn current_engine() -> *const Engine {
    CURRENT.with(Cell::get)
}

/// Makes an engine current for a scope; restores the previous one on drop.
struct Entered(*const Engine);

impl Drop for Entered {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.0));
    }
}

/// Schedules `task` directly if `shared` belongs to the engine running on this thread; returns
/// whether it did (otherwise the caller goes through the engine's eventfd).
pub(crate) fn wake_local(shared: &Arc<RemoteShared>, task: TaskId) -> bool {
    let cur = current_engine();
    if cur.is_null() {
        return false;
    }
    // SAFETY: non-null `CURRENT` names a live engine borrowed on this thread (see above).
    let eng = unsafe { &*cur };
    if !Arc::ptr_eq(&eng.remote, shared) {
        return false;
    }
    eng.wake(task);
    true
}

/// Posts a wakeup of `task` to the engine `shared` belongs to as an `IORING_OP_MSG_RING` on the
/// ring of the engine running on this thread: no eventfd write, no lock, and the entry goes out
/// with this thread's next submission. Returns false if this thread runs no engine or its ring
/// cannot take the entry (the caller then uses the eventfd).
pub(crate) fn wake_by_msg_ring(shared: &RemoteShared, task: TaskId) -> bool {
    let cur = current_engine();
    if cur.is_null() {
        return false;
    }
    // SAFETY: non-null `CURRENT` names a live engine borrowed on this thread (see above).
    let eng = unsafe { &*cur };
    let sqe: Sqe = opcode::MsgRingData::new(
        types::Fd(shared.ring_fd()),
        0,
        UD_WAKE | u64::from(task),
        None,
    )
    .build()
    .flags(squeue::Flags::SKIP_SUCCESS)
    .into();
    // The target ring's fd is a duplicate `shared` owns, so it names that ring for as long as
    // anyone can wake it; the entry references no memory.
    eng.start_detached(sqe)
}

/// How often [`Engine::push`] hands a full submission queue to the kernel before it gives up.
pub(crate) const PUSH_TRIES: usize = 4;

type Task = Pin<Box<dyn Future<Output = ()>>>;

/// How to build an engine; sized once, at queue start.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Submission queue entries (rounded up to a power of two by the kernel).
    pub sq_entries: u32,
    /// Number of buffers in the pool.
    pub buffers: usize,
    /// Size of each buffer in bytes (rounded up to a page).
    pub buffer_size: usize,
    /// Give the ring a fixed-buffer table (enables `READ_FIXED`/`WRITE_FIXED`) that the buffers
    /// of every pool of the engine enter at their first fixed use.
    pub register_buffers: bool,
    /// Slots of that table, shared by the default pool and every [`Engine::add_pool`] pool: a
    /// buffer keeps its slot until its pool is removed, and a buffer that finds the table full
    /// goes by address (never an error). Sized once because the kernel cannot grow a table in
    /// place; an empty slot costs the kernel a pointer. 0: as many as `buffers` (a queue that
    /// serves one export). At most [`MAX_BUFFER_TABLE`].
    pub buffer_table: u32,
    /// Slots of the ring's fixed-file table, which [`Engine::register_files`] fills and
    /// [`Engine::unregister_files`] empties while the engine runs (tenants that come and go).
    /// 0: the first `register_files` sizes it to exactly the descriptors it names; later ones
    /// still count references, and descriptors that find no slot go by number.
    pub file_table: u32,
    /// Poll the completion queue this long before sleeping in `io_uring_enter`, yielding the CPU
    /// between looks (to the application waiting for it, if any).
    pub spin: Duration,
    /// Register a provided-buffer ring (for [`Engine::read_multishot`]) whose buffer ids are the
    /// pool's indexes.
    pub provided_buffers: bool,
    /// How long dropping the engine waits for the kernel to finish operations still in flight
    /// before it leaks their memory instead of freeing it.
    pub drop_wait: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            sq_entries: 256,
            buffers: 0,
            buffer_size: 0,
            register_buffers: false,
            spin: Duration::ZERO,
            provided_buffers: false,
            buffer_table: 0,
            file_table: 0,
            drop_wait: Duration::from_secs(5),
        }
    }
}

/// Counters of the loop, cheap to keep (plain cells, one thread).
#[derive(Clone, Copy, Debug, Default)]
pub struct EngineStats {
    /// `io_uring_enter` calls.
    pub enters: u64,
    /// Completions reaped.
    pub completions: u64,
    /// Task polls.
    pub polls: u64,
    /// Operations the submission queue could not take (they failed with `EBUSY`).
    pub refused: u64,
    /// Wakeups other threads sent through the eventfd (a lock released by another queue).
    pub remote_wakes: u64,
}

/// A single-threaded io_uring engine: submit operations, run tasks until they all finish.
pub struct Engine {
    ring: RefCell<IoUring<squeue::Entry128, cqueue::Entry>>,
    pub(crate) ops: RefCell<OpTable>,
    pub(crate) multi: RefCell<MultiQueues>,
    /// Declared after `ring`, so the registration is gone before its memory is freed.
    pub(crate) provided: Provided,
    /// Memory the path operations own until their completion, reused.
    pub(crate) scratch: crate::scratch::Scratch,
    tasks: RefCell<Vec<Option<Task>>>,
    wakers: RefCell<Vec<Waker>>,
    scheduled: RefCell<Vec<bool>>,
    /// Ids of finished or dropped tasks, for the next spawns (their slot and waker are reused).
    free_tasks: RefCell<Vec<TaskId>>,
    ready: RefCell<VecDeque<TaskId>>,
    current: Cell<Option<TaskId>>,
    live: Cell<usize>,
    remote: Arc<RemoteShared>,
    remote_buf: Box<[u8; 8]>,
    remote_armed: Cell<bool>,
    pub(crate) pool: Arc<Pool>,
    /// This engine's id, which its pools carry (see [`Pool::owner`]).
    pub(crate) id: u64,
    /// Free slots of the ring's fixed-buffer table (size 0: no table).
    pub(crate) buf_slots: RefCell<SlotList>,
    /// The ring's fixed-file table.
    pub(crate) files: RefCell<FileTable>,
    /// [`EngineConfig::file_table`].
    pub(crate) file_table: u32,
    /// Pools whose [`crate::BufPool`] was dropped (or given to [`Engine::remove_pool`]): their
    /// table slots and provided-buffer group are reclaimed on the next occasion.
    pub(crate) returns: Rc<RefCell<Vec<Arc<Pool>>>>,
    spin: Duration,
    drop_wait: Duration,
    stats: Cell<EngineStats>,
    /// Loop turns so far (see [`Engine::turns`]).
    turns: Cell<u64>,
    /// The clock read of this turn's completions ([`crate::clock::now_ns`]), taken at the first
    /// [`Engine::reaped_ns`] after they were reaped (0 until asked).
    reaped_at: Cell<u64>,
    load: Cell<u32>,
    gauge: Arc<Gauge>,
    /// Whether anyone took the gauge: until then the loop does not keep it (no clock read).
    gauge_on: Cell<bool>,
    window: Cell<GaugeWindow>,
    /// The kernel's answer on its opcodes, asked once ([`Engine::supports_opcode`]): a
    /// long-lived engine (a `fusex serve` worker) starts queues for export after export.
    probe: OnceCell<io_uring::Probe>,
}

/// How much work an engine's thread has, for other threads deciding whether to hand it more:
/// the tasks its last loop turn woke (0 while it waits in the ring), and how much local work
/// (see [`Engine::note_local`]) it counted in its last window of a few milliseconds. Relaxed
/// stores once per loop turn, no lock.
#[derive(Debug, Default)]
pub struct Gauge {
    ready: std::sync::atomic::AtomicU32,
    local: std::sync::atomic::AtomicU32,
    /// When the thread last counted local work, in [`gauge_clock`] microseconds.
    local_at: std::sync::atomic::AtomicU64,
}

/// Microseconds on a clock every thread of the process shares, for [`Gauge::local_age`].
pub fn gauge_clock() -> u64 {
    gauge_micros(Instant::now())
}

fn gauge_micros(t: Instant) -> u64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    u64::try_from(t.saturating_duration_since(epoch).as_micros()).unwrap_or(u64::MAX)
}

/// How long [`Gauge::local`] counts over.
const GAUGE_WINDOW: Duration = Duration::from_millis(2);

impl Gauge {
    /// Tasks the thread had to run after its last completion reap (0: waiting for work).
    pub fn get(&self) -> u32 {
        self.ready.load(Ordering::Relaxed)
    }

    /// Work items the thread counted as local (see [`Engine::note_local`]) in its last window.
    pub fn local(&self) -> u32 {
        self.local.load(Ordering::Relaxed)
    }

    /// Microseconds between the thread's last loop turn that counted local work and `now` (a
    /// [`gauge_clock`] reading): how long its CPU has gone without submitters. The window count
    /// of [`Gauge::local`] cannot tell that, since a thread asleep in its ring publishes nothing.
    pub fn local_age(&self, now: u64) -> u64 {
        now.saturating_sub(self.local_at.load(Ordering::Relaxed))
    }

    fn set(&self, v: u32) {
        self.ready.store(v, Ordering::Relaxed);
    }
}

/// The engine's side of its [`Gauge`]: local work counted in the current window.
#[derive(Clone, Copy)]
struct GaugeWindow {
    start: Instant,
    local: u32,
    /// `local` as of the last [`Gauge::local_at`] stamp.
    stamped: u32,
}

impl Engine {
    /// Creates the ring and allocates (and optionally registers) the buffer pool. The first
    /// engine of a thread gives the thread a filesystem context of its own ([`crate::umask`]).
    pub fn new(cfg: &EngineConfig) -> Result<Engine, EngineError> {
        // Before the ring: its io-wq workers share the context the thread has when they start.
        crate::umask::own_context().map_err(EngineError::Context)?;
        let entries = cfg.sq_entries.max(8).next_power_of_two();
        let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
            .setup_cqsize(entries * 4)
            .setup_single_issuer()
            .setup_coop_taskrun()
            .setup_taskrun_flag()
            .setup_submit_all()
            .build(entries)
            .or_else(|_| {
                // Older kernels lack some flags: fall back to a plain 128-byte-SQE ring.
                IoUring::<squeue::Entry128, cqueue::Entry>::builder()
                    .setup_cqsize(entries * 4)
                    .build(entries)
            })
            .map_err(EngineError::Setup)?;
        let alloc = EngineError::Alloc {
            count: cfg.buffers,
            size: cfg.buffer_size,
        };
        let id = NEXT_ENGINE_ID.fetch_add(1, Ordering::Relaxed);
        // A sparse table: buffers enter it one by one as they are first used, so an idle
        // tenant's buffers are neither pinned nor resident. Without one (kernels before 5.19, or
        // no table asked for) every buffer goes by address.
        let table = match cfg.buffer_table {
            0 => u32::try_from(cfg.buffers).unwrap_or(u32::MAX),
            n => n,
        }
        .min(MAX_BUFFER_TABLE);
        let table = if cfg.register_buffers && table > 0 {
            match ring.submitter().register_buffers_sparse(table) {
                Ok(()) => table,
                Err(e) => {
                    tracing::debug!("no fixed-buffer table ({e}); buffers go by address");
                    0
                }
            }
        } else {
            0
        };
        let pool = Pool::new(cfg.buffers, cfg.buffer_size, id).ok_or(alloc)?;
        if table > 0 && pool.len() > 0 {
            pool.set_registered();
        }
        let remote = {
            use std::os::fd::AsRawFd;
            RemoteShared::new(ring.as_raw_fd()).map_err(EngineError::Setup)?
        };
        let n = pool.len();
        let eng = Engine {
            ring: RefCell::new(ring),
            ops: RefCell::new(OpTable::new(entries as usize * 2)),
            multi: RefCell::new(MultiQueues::default()),
            provided: Provided::default(),
            scratch: Default::default(),
            tasks: RefCell::new(Vec::new()),
            wakers: RefCell::new(Vec::new()),
            scheduled: RefCell::new(Vec::new()),
            free_tasks: RefCell::new(Vec::new()),
            ready: RefCell::new(VecDeque::with_capacity(n.max(16) * 2)),
            current: Cell::new(None),
            live: Cell::new(0),
            remote: Arc::new(remote),
            remote_buf: Box::new([0; 8]),
            remote_armed: Cell::new(false),
            pool,
            id,
            buf_slots: RefCell::new(SlotList::new(table)),
            files: RefCell::new(FileTable::default()),
            file_table: cfg.file_table,
            returns: Rc::new(RefCell::new(Vec::new())),
            spin: cfg.spin,
            drop_wait: cfg.drop_wait,
            stats: Cell::new(EngineStats::default()),
            turns: Cell::new(0),
            reaped_at: Cell::new(0),
            load: Cell::new(0),
            gauge: Arc::new(Gauge::default()),
            gauge_on: Cell::new(false),
            window: Cell::new(GaugeWindow {
                start: Instant::now(),
                local: 0,
                stamped: 0,
            }),
            probe: OnceCell::new(),
        };
        if cfg.provided_buffers && eng.pool.len() > 0 {
            // Group 0, the first one: what `buf_group` has always named.
            if let Err(e) = eng.add_group(&eng.pool) {
                tracing::debug!("no provided-buffer ring: {e}");
            }
        }
        Ok(eng)
    }

    /// Takes a free buffer of the pool (lowest index first), `None` if all are in use. It returns
    /// to the pool when dropped.
    pub fn take_buffer(&self) -> Option<Buf> {
        self.pool.take()
    }

    /// Buffers of the pool not in use.
    pub fn buffers_available(&self) -> usize {
        self.pool.available()
    }

    /// The default pool's provided-buffer group, if [`EngineConfig::provided_buffers`] asked for
    /// one and the kernel took it (pools of [`Engine::add_pool`] have their own:
    /// [`crate::BufPool::group`]).
    pub fn buf_group(&self) -> Option<BufGroup> {
        self.pool.group().map(BufGroup)
    }

    /// Whether the running kernel knows io_uring opcode `code` (the kernel is asked on the first
    /// call only; a failed probe answers no for every opcode).
    pub(crate) fn supports_opcode(&self, code: u8) -> bool {
        self.probe
            .get_or_init(|| {
                let mut probe = io_uring::Probe::new();
                // On failure the probe stays empty: no opcode is known.
                let _ = self.ring.borrow().submitter().register_probe(&mut probe);
                probe
            })
            .is_supported(code)
    }

    /// Whether the default pool's buffers use the fixed-buffer table (so `*_FIXED` opcodes are
    /// used for each once it has a slot).
    pub fn buffers_registered(&self) -> bool {
        self.pool.registered()
    }

    /// A handle other threads use to wake tasks of this engine.
    pub fn remote(&self) -> Remote {
        Remote::new(self.remote.clone())
    }

    /// Loop turns so far: tasks woken by completions reaped in the same turn see the same
    /// number, so a task can tell how many of its kind one batch of completions brought.
    pub fn turns(&self) -> u64 {
        self.turns.get()
    }

    /// When the completions of the current loop turn were reaped ([`crate::clock::now_ns`]):
    /// the arrival time of what they delivered (a request that waits behind others of its batch
    /// waits from then). One clock read per turn, taken only if some task asks.
    pub fn reaped_ns(&self) -> u64 {
        match self.reaped_at.get() {
            0 => {
                let t = crate::clock::now_ns();
                self.reaped_at.set(t);
                t
            }
            t => t,
        }
    }

    /// Loop counters so far.
    pub fn stats(&self) -> EngineStats {
        let mut st = self.stats.get();
        st.remote_wakes = self.remote.wakes();
        st
    }

    /// One more request is in service on this thread (any tenant's). Backends read the count
    /// ([`Engine::load`]) to choose between finishing a transfer inline and handing it to the
    /// ring.
    pub fn load_enter(&self) {
        self.load.set(self.load.get().saturating_add(1));
    }

    /// A request counted by [`Engine::load_enter`] is out of service.
    pub fn load_leave(&self) {
        self.load.set(self.load.get().saturating_sub(1));
    }

    /// Requests in service on this thread (see [`Engine::load_enter`]). Tasks woken but not yet
    /// polled are deliberately not counted: doing so sent tmpfs I/O to io-wq under load and cost
    /// 2–3× on 4k randrw QD64 (measured).
    pub fn load(&self) -> u32 {
        self.load.get()
    }

    /// This engine's [`Gauge`], for other threads.
    pub fn gauge(&self) -> Arc<Gauge> {
        // Kept from now on: a store and a clock read per loop turn, paid only by engines whose
        // load another thread reads.
        self.gauge_on.set(true);
        self.gauge.clone()
    }

    /// Counts one item of local work for the [`Gauge`] (a queue thread: a request whose
    /// submitter runs on this thread's CPU).
    pub fn note_local(&self) {
        let mut w = self.window.get();
        w.local = w.local.saturating_add(1);
        self.window.set(w);
    }

    /// Tasks woken and waiting for their turn behind the one running now: work this thread has
    /// queued up.
    pub fn backlog(&self) -> usize {
        self.ready.borrow().len()
    }

    /// The task being polled right now, if any.
    pub fn current_task(&self) -> Option<TaskId> {
        self.current.get()
    }

    /// Adds a task; it is polled on the next loop turn. Allocates the task's box (once per task,
    /// not per request); its slot and waker are those of a finished task when there is one, so
    /// tenants that come and go do not grow the task table (see [`TaskId`] on what a reused id
    /// means for stale wakeups).
    pub fn spawn(&self, fut: impl Future<Output = ()> + 'static) -> TaskId {
        let fut: Task = Box::pin(fut);
        let reused = self.free_tasks.borrow_mut().pop();
        let id = match reused {
            Some(id) => {
                self.tasks.borrow_mut()[id as usize] = Some(fut);
                id
            }
            None => {
                let mut tasks = self.tasks.borrow_mut();
                let id = tasks.len() as TaskId;
                tasks.push(Some(fut));
                self.wakers.borrow_mut().push(self.remote().waker_for(id));
                self.scheduled.borrow_mut().push(false);
                id
            }
        };
        self.live.set(self.live.get() + 1);
        self.wake(id);
        id
    }

    /// Tasks spawned and not finished (nor dropped): what a worker serving many tenants reports
    /// as its load, and what tests check for leaks.
    pub fn live_tasks(&self) -> usize {
        self.live.get()
    }

    /// Slots of the task table (live and free), for tests checking that ids are reused.
    #[cfg(test)]
    pub(crate) fn task_slots(&self) -> usize {
        self.tasks.borrow().len()
    }

    /// Schedules a task of this engine (from this thread).
    pub fn wake(&self, task: TaskId) {
        let mut scheduled = self.scheduled.borrow_mut();
        if let Some(s) = scheduled.get_mut(task as usize) {
            if !*s {
                *s = true;
                self.ready.borrow_mut().push_back(task);
            }
        }
    }

    /// Submits one entry that lends the kernel `owned`; the returned future resolves to the
    /// completion's `res` and gives `owned` back. If the submission queue cannot take the entry
    /// the future resolves at once with `-EBUSY`.
    ///
    /// # Safety
    /// Every pointer in `sqe` must point into `owned` (or into memory the engine itself keeps
    /// until the op's completion), and the ranges the kernel writes must be unaliased.
    pub(crate) unsafe fn start(&self, sqe: Sqe, owned: Owned) -> Op<'_> {
        // SAFETY: forwarded to the caller.
        unsafe { self.start_after(None, sqe, owned) }
    }

    /// Submits `first` (whose completion is ignored; it must lend no memory) linked before
    /// `sqe`: `sqe` runs only once `first` succeeded. Both go in one batch.
    ///
    /// # Safety
    /// As for [`Engine::start`], for `sqe`.
    pub(crate) unsafe fn start_linked(&self, first: Sqe, sqe: Sqe, owned: Owned) -> Op<'_> {
        // SAFETY: forwarded to the caller.
        unsafe { self.start_after(Some(first), sqe, owned) }
    }

    /// Submits `sqe` linked to an `IORING_OP_LINK_TIMEOUT` reading `ts`: if `sqe` has not
    /// completed when the timeout expires, the kernel cancels it (it completes with `-ECANCELED`,
    /// or with the bytes it moved so far). The timeout's own completion is ignored.
    ///
    /// # Safety
    /// As for [`Engine::start`]; `ts` must point into `owned` too (the kernel reads it when the
    /// pair is submitted, which is before `sqe` can complete).
    pub(crate) unsafe fn start_timed(
        &self,
        sqe: Sqe,
        ts: *const types::Timespec,
        owned: Owned,
    ) -> Op<'_> {
        let idx = self.ops.borrow_mut().alloc(self.current_task(), owned);
        let first = sqe.user_data(u64::from(idx)).flags(squeue::Flags::IO_LINK);
        let timeout: Sqe = opcode::LinkTimeout::new(ts)
            .build()
            .user_data(UD_IGNORE)
            .into();
        self.pushed_op(idx, &[first, timeout])
    }

    /// # Safety
    /// As for [`Engine::start`].
    unsafe fn start_after(&self, first: Option<Sqe>, sqe: Sqe, owned: Owned) -> Op<'_> {
        let idx = self.ops.borrow_mut().alloc(self.current_task(), owned);
        let sqe = sqe.user_data(u64::from(idx));
        match first {
            Some(f) => self.pushed_op(
                idx,
                &[f.flags(squeue::Flags::IO_LINK).user_data(UD_IGNORE), sqe],
            ),
            None => self.pushed_op(idx, &[sqe]),
        }
    }

    /// The op of slot `idx` once `entries` (which complete into it) are pushed as one batch, or
    /// failed with `EBUSY` and its slot freed if the submission queue cannot take them.
    fn pushed_op(&self, idx: u32, entries: &[Sqe]) -> Op<'_> {
        let state = if self.push(entries) {
            OpState::Pending(idx)
        } else {
            OpState::Failed(-libc::EBUSY, self.ops.borrow_mut().unpush(idx))
        };
        Op {
            engine: self,
            state,
        }
    }

    /// Submits a multishot entry reading from provided-buffer group `group`; its completions are
    /// queued (room for `capacity` reserved up front) until the returned [`MultiOp`] takes them.
    /// `None` if the submission queue cannot take it.
    ///
    /// # Safety
    /// The entry may only write into provided buffers (buffer select) or engine-owned memory.
    pub(crate) unsafe fn start_multishot(
        &self,
        sqe: Sqe,
        capacity: usize,
        group: u16,
    ) -> Option<MultiOp<'_>> {
        let queue = self.multi.borrow_mut().alloc(capacity);
        let idx = self
            .ops
            .borrow_mut()
            .alloc_multi(self.current_task(), queue, group);
        if self.push(&[sqe.user_data(u64::from(idx))]) {
            // The group stays registered until this op's final completion.
            self.provided.arm(group);
            Some(MultiOp {
                engine: self,
                idx,
                queue,
                finished: false,
            })
        } else {
            self.ops.borrow_mut().unpush(idx);
            self.multi.borrow_mut().release(queue);
            None
        }
    }

    /// Submits an entry whose completion nobody awaits. It must reference no memory.
    pub(crate) fn start_detached(&self, sqe: Sqe) -> bool {
        self.push(&[sqe.user_data(UD_IGNORE)])
    }

    /// Puts `sqes` in the submission queue, all or none. A full queue is handed to the kernel
    /// (reaping completions if the kernel says it has too many pending) a bounded number of times;
    /// then the caller is told no, and fails its operation rather than spinning.
    pub(crate) fn push(&self, sqes: &[Sqe]) -> bool {
        for _ in 0..PUSH_TRIES {
            {
                let mut ring = self.ring.borrow_mut();
                let mut sq = ring.submission();
                if sq.capacity() - sq.len() >= sqes.len() {
                    for sqe in sqes {
                        // SAFETY: the callers of `start*` guarantee each entry's memory; room
                        // for every entry was checked just above.
                        if unsafe { sq.push(sqe) }.is_err() {
                            return false;
                        }
                    }
                    return true;
                }
            }
            let r = self.ring.borrow().submit();
            if !self.submitted(r) {
                break;
            }
        }
        let mut st = self.stats.get();
        st.refused += 1;
        self.stats.set(st);
        false
    }

    /// Counts a submission and handles its result: too many completions pending (`EBUSY`,
    /// `EAGAIN`) reaps them so the caller can try again; false on an error no retry mends.
    fn submitted(&self, r: std::io::Result<usize>) -> bool {
        let mut st = self.stats.get();
        st.enters += 1;
        self.stats.set(st);
        match r {
            Ok(_) => true,
            Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EAGAIN)) => {
                self.reap_now();
                true
            }
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => true,
            Err(e) => {
                tracing::error!("io_uring submit failed: {e}");
                false
            }
        }
    }

    /// Hands every entry of the submission queue to the kernel (reaping completions if it has
    /// too many pending), a bounded number of times; returns whether the queue is empty.
    ///
    /// Called before a fixed-table slot is cleared for reuse: the kernel looks a fixed buffer or
    /// file up when it first issues an entry, which for an entry still in this queue is later, so
    /// an entry queued before the slot went to another tenant would reach that tenant's buffer or
    /// file. Once submitted, an entry holds what it looked up until its completion.
    pub(crate) fn flush_submissions(&self) -> bool {
        for _ in 0..PUSH_TRIES {
            let r = {
                let Ok(mut ring) = self.ring.try_borrow_mut() else {
                    return false;
                };
                if ring.submission().is_empty() {
                    return true;
                }
                ring.submit()
            };
            if !self.submitted(r) {
                return false;
            }
        }
        self.ring
            .try_borrow_mut()
            .is_ok_and(|mut r| r.submission().is_empty())
    }

    /// The ring, for registrations (cold paths); `None` while a loop turn holds it, which no
    /// task or waker ever sees.
    pub(crate) fn ring(
        &self,
    ) -> Option<std::cell::Ref<'_, IoUring<squeue::Entry128, cqueue::Entry>>> {
        self.ring.try_borrow().ok()
    }

    /// Cancels the op with this `user_data` without waiting (best effort: the op still
    /// completes, with `-ECANCELED` or its result).
    pub(crate) fn cancel(&self, user_data: u64) {
        let sqe: Sqe = opcode::AsyncCancel::new(user_data).build().into();
        self.start_detached(sqe);
    }

    fn enter(&self) -> Entered {
        Entered(CURRENT.with(|c| c.replace(self as *const Engine)))
    }

    /// Runs until every task finished. Returns early only on a fatal ring error.
    pub fn run(&self) -> Result<(), EngineError> {
        let _current = self.enter();
        loop {
            self.poll_ready();
            if self.live.get() == 0 {
                return Ok(());
            }
            self.turn()?;
        }
    }

    /// Drives `fut` to completion on this thread, turning the ring as needed. For cold paths (a
    /// final flush at shutdown): the future is polled again after every loop turn.
    pub fn block_on<F: Future>(&self, fut: F) -> Result<F::Output, EngineError> {
        // Declared before the future, so it is still current when the future is dropped.
        let _current = self.enter();
        let mut fut = std::pin::pin!(fut);
        // A real waker: the future may wait on something other than this ring (a lock another
        // thread releases), and the loop must not sleep in the ring once it was woken.
        let wake = Arc::new(BlockOnWake {
            woken: AtomicBool::new(false),
            remote: self.remote.clone(),
        });
        let waker = Waker::from(wake.clone());
        let mut cx = Context::from_waker(&waker);
        loop {
            wake.woken.store(false, Ordering::Release);
            if let std::task::Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
                return Ok(v);
            }
            self.poll_ready();
            let block = !wake.woken.load(Ordering::Acquire);
            self.turn_with(block)?;
        }
    }

    fn poll_ready(&self) {
        loop {
            let next = self.ready.borrow_mut().pop_front();
            let Some(id) = next else { break };
            self.scheduled.borrow_mut()[id as usize] = false;
            let task = self.tasks.borrow_mut()[id as usize].take();
            let Some(mut task) = task else { continue };
            let waker = self.wakers.borrow()[id as usize].clone();
            let mut cx = Context::from_waker(&waker);
            self.current.set(Some(id));
            let mut st = self.stats.get();
            st.polls += 1;
            self.stats.set(st);
            let done = task.as_mut().poll(&mut cx).is_ready();
            self.current.set(None);
            if done {
                self.live.set(self.live.get() - 1);
                // Dropped before its id is free, so whatever its drop spawns gets another one.
                drop(task);
                self.free_tasks.borrow_mut().push(id);
            } else {
                self.tasks.borrow_mut()[id as usize] = Some(task);
            }
        }
    }

    /// One loop turn: submit, wait for at least one completion (after an optional spin), reap.
    fn turn(&self) -> Result<(), EngineError> {
        self.turn_with(true)
    }

    /// A loop turn that waits for a completion only if `block`.
    fn turn_with(&self, block: bool) -> Result<(), EngineError> {
        self.turns.set(self.turns.get().wrapping_add(1));
        if !self.returns.borrow().is_empty() {
            self.reclaim_returned();
        }
        self.arm_remote();
        let mut ring = self.ring.borrow_mut();
        let mut st = self.stats.get();
        if block && !self.spin.is_zero() && ring.completion().is_empty() {
            if !ring.submission().is_empty() {
                st.enters += 1;
                submit_retry(&ring, 0)?;
            }
            // Completions of polls and FUSE commands are delivered as task work, which (with
            // COOP_TASKRUN) runs only when this thread enters the kernel: the TASKRUN flag says
            // some is waiting, and a zero-wait enter runs it.
            //
            // Between looks the thread yields its CPU rather than spinning on it: FUSE-over-
            // io_uring hands a request to the queue of the CPU its application runs on, so the
            // application that is to send the next request (just woken by this reply) often
            // waits for this very CPU. Yielding lets it run and send, and costs nothing when
            // nothing else is runnable (the CPU stays busy, so it never halts, which is what the
            // spin is for). du over a directory export went 10-15 % faster and find 9-28 %;
            // image exports at queue depth 1 and 64 did not change (docs/uring.md).
            let until = Instant::now() + self.spin;
            while ring.completion().is_empty() && Instant::now() < until {
                if ring.submission().taskrun() {
                    st.enters += 1;
                    submit_retry(&ring, 0)?;
                } else {
                    std::thread::yield_now();
                }
            }
        }
        let want = usize::from(block && ring.completion().is_empty());
        if want > 0 && self.gauge_on.get() {
            self.gauge.set(0);
        }
        if want > 0 || !ring.submission().is_empty() {
            st.enters += 1;
            submit_retry(&ring, want)?;
        }
        let mut woken = 0u64;
        for cqe in ring.completion() {
            woken += 1;
            self.dispatch(cqe.user_data(), cqe.result(), cqe.flags());
        }
        st.completions += woken;
        self.stats.set(st);
        if woken > 0 {
            self.reaped_at.set(0);
        }
        drop(ring);
        if self.provided.removals_due() {
            self.finish_group_removals();
        }
        if self.gauge_on.get() {
            self.gauge
                .set(u32::try_from(self.ready.borrow().len()).unwrap_or(u32::MAX));
            self.close_window();
        }
        Ok(())
    }

    fn dispatch(&self, ud: u64, res: i32, flags: u32) {
        match ud {
            UD_IGNORE => {}
            ud if ud & UD_WAKE != 0 && ud < UD_IGNORE => self.wake(ud as u32 as TaskId),
            UD_REMOTE => {
                self.remote_armed.set(false);
                for id in self.remote.take() {
                    self.wake(id);
                }
            }
            _ => {
                let task = self.ops.borrow_mut().complete(
                    ud,
                    res,
                    flags,
                    &mut self.multi.borrow_mut(),
                    &self.provided,
                );
                match task {
                    Some(Woken::Task(t)) => self.wake(t),
                    Some(Woken::Waker(w)) => w.wake(),
                    None => {}
                }
            }
        }
    }

    /// Stamps the time if this turn counted local work, and publishes the window's count once
    /// the window is over.
    fn close_window(&self) {
        let mut w = self.window.get();
        let now = Instant::now();
        if w.local != w.stamped {
            // At least 1: 0 stands for never.
            self.gauge
                .local_at
                .store(gauge_micros(now).max(1), Ordering::Relaxed);
            w.stamped = w.local;
        }
        if now.saturating_duration_since(w.start) >= GAUGE_WINDOW {
            self.gauge.local.store(w.local, Ordering::Relaxed);
            w = GaugeWindow {
                start: now,
                local: 0,
                stamped: 0,
            };
        }
        self.window.set(w);
    }

    /// Keeps one read of the wakeup eventfd in flight so other threads can interrupt the wait.
    fn arm_remote(&self) {
        if self.remote_armed.get() {
            return;
        }
        // Pick up wakeups that raced with the previous read's completion.
        for id in self.remote.take() {
            self.wake(id);
        }
        let sqe: Sqe = opcode::Read::new(
            types::Fd(self.remote.fd()),
            self.remote_buf.as_ptr().cast_mut(),
            8,
        )
        .build()
        .into();
        // `remote_buf` is the engine's own and is leaked, not freed, if the read is still in
        // flight when the engine is dropped.
        if self.push(&[sqe.user_data(UD_REMOTE)]) {
            self.remote_armed.set(true);
        }
    }

    pub(crate) fn reap_now(&self) {
        loop {
            let next = {
                let mut ring = self.ring.borrow_mut();
                let mut cq = ring.completion();
                cq.next().map(|c| (c.user_data(), c.result(), c.flags()))
            };
            let Some((ud, res, flags)) = next else { break };
            self.dispatch(ud, res, flags);
        }
    }

    /// Cancels op `idx` and turns the ring until its terminal completion has arrived, then frees
    /// its slot: for futures on borrowed memory, which must not return before the kernel is done.
    /// Other completions that arrive meanwhile are recorded and their tasks woken as usual.
    pub(crate) fn wait_terminal(&self, idx: u32) {
        self.cancel(u64::from(idx));
        loop {
            if self.ops.borrow_mut().take_done(idx).is_some() {
                return;
            }
            let r = match self.ring.try_borrow() {
                Ok(ring) => ring.submit_and_wait(1),
                Err(_) => {
                    // Only reachable if a future were dropped inside a ring turn, which the
                    // executor never does; waiting is impossible, returning would be unsound.
                    tracing::error!("borrowed-memory operation dropped during a ring turn");
                    std::process::abort();
                }
            };
            let mut st = self.stats.get();
            st.enters += 1;
            self.stats.set(st);
            match r {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR | libc::EBUSY | libc::EAGAIN)
                    ) => {}
                Err(e) => {
                    tracing::error!("io_uring_enter failed while waiting for an operation on borrowed memory: {e}");
                    std::process::abort();
                }
            }
            self.reap_now();
        }
    }

    /// Drops every task not finished yet, as dropping the engine would. Futures of unfinished
    /// tasks may own ops: dropping them orphans those ops (their memory stays in the op table
    /// until their completions), and cancels them; futures on borrowed memory wait on this ring.
    ///
    /// Why it is public: tasks often hold an `Rc` of a state that owns the engine (a queue's
    /// request loops and their `QueueState`). After [`Engine::run`] fails, those tasks are still
    /// here and the cycle would keep the ring, its fds and its buffers alive for good; the owner
    /// calls this to break it. Must not be called from inside a task.
    pub fn drop_tasks(&self) {
        // The slots stay (task ids index them), empty and free for later spawns; a later `run`
        // finds nothing to do.
        let mut ids = Vec::new();
        let tasks: Vec<Task> = self
            .tasks
            .borrow_mut()
            .iter_mut()
            .enumerate()
            .filter_map(|(i, t)| {
                let t = t.take()?;
                ids.push(i as TaskId);
                Some(t)
            })
            .collect();
        self.free_tasks.borrow_mut().extend(ids);
        self.ready.borrow_mut().clear();
        // Nothing is queued any more: an id reused later must be schedulable again.
        self.scheduled.borrow_mut().fill(false);
        self.live.set(0);
        // Current while the tasks drop.
        let _current = self.enter();
        drop(tasks);
    }

    /// Hands every entry queued so far to the kernel now, instead of at the next loop turn;
    /// returns whether the submission queue is empty. For a task whose next step depends on the
    /// kernel having seen what other tasks queued: a queue that reports quiet once its last reply
    /// is queued (an io_uring FUSE reply is a COMMIT entry, which the kernel handles as it is
    /// submitted), before its owner aborts the connection. Must not be called from inside a loop
    /// turn's reaping (it is not: tasks run between turns).
    pub fn submit_queued(&self) -> bool {
        self.flush_submissions()
    }

    /// The raw fd of the ring (for diagnostics).
    pub fn ring_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.ring.borrow().as_raw_fd()
    }

    /// Operations whose terminal completion has not arrived.
    pub fn in_flight(&self) -> usize {
        self.ops.borrow().in_flight
    }

    /// A handle that says whether the pool's memory is still allocated, for tests that check
    /// what dropping an engine with operations in flight frees.
    #[doc(hidden)]
    pub fn pool_watch(&self) -> PoolWatch {
        PoolWatch(Arc::downgrade(&self.pool))
    }
}

/// The waker of [`Engine::block_on`]: records the wakeup, and interrupts the ring wait when it
/// comes from another thread.
struct BlockOnWake {
    woken: AtomicBool,
    remote: Arc<RemoteShared>,
}

impl std::task::Wake for BlockOnWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        if !std::ptr::eq(Arc::as_ptr(&self.remote), current_remote()) {
            self.remote.kick();
        }
    }
}

/// The wakeup channel of the engine current on this thread, null if none.
fn current_remote() -> *const RemoteShared {
    let cur = current_engine();
    if cur.is_null() {
        return std::ptr::null();
    }
    // SAFETY: non-null `CURRENT` names a live engine borrowed on this thread.
    Arc::as_ptr(&unsafe { &*cur }.remote)
}

/// Whether an engine's buffer memory is still allocated (see [`Engine::pool_watch`]).
#[doc(hidden)]
pub struct PoolWatch(std::sync::Weak<Pool>);

impl PoolWatch {
    pub(crate) fn of(pool: &Arc<Pool>) -> PoolWatch {
        PoolWatch(Arc::downgrade(pool))
    }

    /// True while anything (a [`Buf`], the engine, a deliberate leak) keeps the pool alive.
    pub fn alive(&self) -> bool {
        self.0.strong_count() > 0
    }
}

fn submit_retry(
    ring: &IoUring<squeue::Entry128, cqueue::Entry>,
    want: usize,
) -> Result<(), EngineError> {
    match ring.submit_and_wait(want) {
        Ok(_) => Ok(()),
        // Interrupted by a signal, or the completion queue is overflowing: either way the caller
        // reaps what is there and comes back.
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EINTR | libc::EBUSY | libc::EAGAIN)
            ) =>
        {
            Ok(())
        }
        Err(e) => Err(EngineError::Enter(e)),
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.drop_tasks();
        // Ask the kernel to end everything else still in flight, then wait (bounded) for it.
        let pending: Vec<u64> = self.ops.borrow().pending().collect();
        for ud in pending {
            self.cancel(ud);
        }
        if self.remote_armed.get() {
            self.cancel(UD_REMOTE);
        }
        let deadline = Instant::now() + self.drop_wait;
        while (self.ops.borrow().in_flight > 0 || self.remote_armed.get())
            && Instant::now() < deadline
        {
            {
                let ring = self.ring.borrow();
                let _ = ring.submitter().submit_with_args(
                    1,
                    &types::SubmitArgs::new().timespec(&types::Timespec::new().nsec(10_000_000)),
                );
            }
            self.reap_now();
        }
        let in_flight = self.ops.borrow().in_flight;
        if in_flight > 0 || self.remote_armed.get() {
            // The kernel may still write into what those operations hold: leak it rather than
            // free it. The op table keeps the buffers, which keep the pool; the provided windows
            // and the ring memory stay too.
            tracing::error!(
                "engine dropped with {in_flight} operations in flight; leaking their memory"
            );
            std::mem::forget(self.pool.clone());
            std::mem::forget(std::mem::take(&mut *self.ops.borrow_mut()));
            std::mem::forget(std::mem::replace(&mut self.remote_buf, Box::new([0; 8])));
            std::mem::forget(std::mem::take(&mut self.provided));
        } else {
            self.provided.clear();
        }
    }
}
