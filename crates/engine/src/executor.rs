//! The engine: one io_uring, its op table, the buffer pool and the task executor.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Waker};
use std::time::{Duration, Instant};

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use crate::buf::{BufHandle, IoBufMut, RawBuf};
use crate::multishot::{BufGroup, MultiOp, MultiQueues, PbufRing};
use crate::op::{Op, OpTable, Slot};
use crate::remote::{Remote, RemoteShared};
use crate::{EngineError, Sqe};

/// Index of a task spawned on an engine.
pub type TaskId = u32;

/// `user_data` of the engine's own eventfd read (cross-thread wakeups).
const UD_REMOTE: u64 = u64::MAX;
/// `user_data` of fire-and-forget entries whose completion nobody awaits.
const UD_IGNORE: u64 = u64::MAX - 1;

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
    /// Register the pool as fixed buffers (enables `READ_FIXED`/`WRITE_FIXED`).
    pub register_buffers: bool,
    /// Busy-poll the completion queue this long before sleeping in `io_uring_enter`.
    pub spin: Duration,
    /// Entries of a provided-buffer ring to register (0: none). See [`Engine::buf_group`].
    pub provided_buffers: u16,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            sq_entries: 256,
            buffers: 0,
            buffer_size: 0,
            register_buffers: false,
            spin: Duration::ZERO,
            provided_buffers: 0,
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
}

/// A single-threaded io_uring engine: submit operations, run tasks until they all finish.
pub struct Engine {
    ring: RefCell<IoUring<squeue::Entry128, cqueue::Entry>>,
    pub(crate) ops: RefCell<OpTable>,
    pub(crate) multi: RefCell<MultiQueues>,
    /// Declared after `ring`, so the registration is gone before its memory is freed.
    pbuf: Option<PbufRing>,
    tasks: RefCell<Vec<Option<Task>>>,
    wakers: RefCell<Vec<Waker>>,
    scheduled: RefCell<Vec<bool>>,
    ready: RefCell<VecDeque<TaskId>>,
    current: Cell<Option<TaskId>>,
    live: Cell<usize>,
    remote: Arc<RemoteShared>,
    remote_buf: Box<[u8; 8]>,
    remote_armed: Cell<bool>,
    pool: Vec<RawBuf>,
    pool_taken: RefCell<Vec<bool>>,
    registered: bool,
    spin: Duration,
    stats: Cell<EngineStats>,
    load: Cell<u32>,
}

impl Engine {
    /// Creates the ring and allocates (and optionally registers) the buffer pool.
    pub fn new(cfg: &EngineConfig) -> Result<Engine, EngineError> {
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
        let mut pool = Vec::with_capacity(cfg.buffers);
        for _ in 0..cfg.buffers {
            pool.push(RawBuf::new(cfg.buffer_size).ok_or(EngineError::Alloc {
                count: cfg.buffers,
                size: cfg.buffer_size,
            })?);
        }
        let mut registered = false;
        if cfg.register_buffers && !pool.is_empty() {
            let iovecs: Vec<libc::iovec> = pool
                .iter()
                .map(|b| libc::iovec {
                    iov_base: b.ptr().cast(),
                    iov_len: b.len(),
                })
                .collect();
            // SAFETY: the iovecs describe live allocations owned by `pool`, which the engine keeps
            // until it is dropped; the ring (and with it the registration) is dropped first.
            unsafe { ring.submitter().register_buffers(&iovecs) }.map_err(EngineError::Register)?;
            registered = true;
        }
        let pbuf = match cfg.provided_buffers {
            0 => None,
            n => PbufRing::new(n, 0).and_then(|r| {
                // SAFETY: the ring memory is owned by the engine and dropped after the ring.
                let res = unsafe {
                    ring.submitter()
                        .register_buf_ring_with_flags(r.addr(), r.entries(), r.group, 0)
                };
                match res {
                    Ok(()) => Some(r),
                    Err(e) => {
                        tracing::debug!("no provided-buffer ring: {e}");
                        None
                    }
                }
            }),
        };
        let remote = RemoteShared::new().map_err(EngineError::Setup)?;
        let n = pool.len();
        Ok(Engine {
            ring: RefCell::new(ring),
            ops: RefCell::new(OpTable::new(entries as usize * 2)),
            multi: RefCell::new(MultiQueues::default()),
            pbuf,
            tasks: RefCell::new(Vec::new()),
            wakers: RefCell::new(Vec::new()),
            scheduled: RefCell::new(Vec::new()),
            ready: RefCell::new(VecDeque::with_capacity(n.max(16) * 2)),
            current: Cell::new(None),
            live: Cell::new(0),
            remote: Arc::new(remote),
            remote_buf: Box::new([0; 8]),
            remote_armed: Cell::new(false),
            pool,
            pool_taken: RefCell::new(vec![false; n]),
            registered,
            spin: cfg.spin,
            stats: Cell::new(EngineStats::default()),
            load: Cell::new(0),
        })
    }

    /// Takes exclusive ownership of pool buffer `index` (each buffer can be taken once).
    pub fn take_buffer(&self, index: usize) -> Option<BufHandle> {
        let mut taken = self.pool_taken.borrow_mut();
        if *taken.get(index)? {
            return None;
        }
        taken[index] = true;
        Some(BufHandle::new(
            &self.pool[index],
            u16::try_from(index).ok()?,
        ))
    }

    /// The provided-buffer ring's group, if [`EngineConfig::provided_buffers`] asked for one and the
    /// kernel took it.
    pub fn buf_group(&self) -> Option<BufGroup> {
        self.pbuf.as_ref().map(|r| BufGroup(r.group))
    }

    /// Offers `win` to the kernel as provided buffer `bid`; visible to it after
    /// [`Engine::publish_buffers`]. Does nothing without a provided-buffer ring.
    ///
    /// # Safety
    /// Nobody but the kernel may touch the window's memory until a completion names `bid`.
    pub unsafe fn provide_buffer(&self, mut win: IoBufMut<'_>, bid: u16) {
        if let Some(r) = &self.pbuf {
            let len = u32::try_from(win.len()).unwrap_or(u32::MAX);
            // SAFETY: engine-owned memory (valid until the ring is gone); exclusivity is the
            // caller's promise.
            unsafe { r.push(bid, win.as_mut_ptr() as u64, len) };
        }
    }

    /// Makes provided buffers visible to the kernel (one store for a batch of them).
    pub fn publish_buffers(&self) {
        if let Some(r) = &self.pbuf {
            r.publish();
        }
    }

    /// Whether the running kernel knows io_uring opcode `code` (asked once per call; cold path).
    pub fn supports_opcode(&self, code: u8) -> bool {
        let mut probe = io_uring::Probe::new();
        let ring = self.ring.borrow();
        ring.submitter().register_probe(&mut probe).is_ok() && probe.is_supported(code)
    }

    /// Whether the pool is registered as fixed buffers (so `*_FIXED` opcodes may be used).
    pub fn buffers_registered(&self) -> bool {
        self.registered
    }

    /// A handle other threads use to wake tasks of this engine.
    pub fn remote(&self) -> Remote {
        Remote::new(self.remote.clone())
    }

    /// Loop counters so far.
    pub fn stats(&self) -> EngineStats {
        self.stats.get()
    }

    /// Records how many requests the thread is serving right now. Backends read it to choose
    /// between finishing a transfer inline and handing it to the ring.
    pub fn set_load(&self, requests: u32) {
        self.load.set(requests);
    }

    /// Requests in service on this thread (see [`Engine::set_load`]). Tasks woken but not yet
    /// polled are deliberately not counted: doing so sent tmpfs I/O to io-wq under load and cost
    /// 2–3× on 4k randrw QD64 (measured).
    pub fn load(&self) -> u32 {
        self.load.get()
    }

    /// The task being polled right now, if any.
    pub fn current_task(&self) -> Option<TaskId> {
        self.current.get()
    }

    /// Adds a task; it is polled on the next loop turn. Allocates (once per task, not per request).
    pub fn spawn(&self, fut: impl Future<Output = ()> + 'static) -> TaskId {
        let mut tasks = self.tasks.borrow_mut();
        let id = tasks.len() as TaskId;
        tasks.push(Some(Box::pin(fut)));
        self.wakers.borrow_mut().push(self.remote().waker_for(id));
        self.scheduled.borrow_mut().push(false);
        self.live.set(self.live.get() + 1);
        drop(tasks);
        self.wake(id);
        id
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

    /// Submits one entry and returns the future of its completion.
    ///
    /// # Safety
    /// Every pointer in `sqe` must stay valid (and, for buffers the kernel writes, unaliased) until
    /// the operation completes. Engine-owned memory ([`BufHandle`] windows) satisfies this.
    pub unsafe fn submit(&self, sqe: Sqe) -> Op<'_> {
        let idx = self.ops.borrow_mut().alloc(self.current_task());
        self.push(sqe.user_data(u64::from(idx)));
        Op {
            engine: self,
            idx,
            finished: false,
        }
    }

    /// Submits `first` (whose completion is ignored) linked before `sqe`: `sqe` runs only once
    /// `first` succeeded. Used for "poll, then read" on non-blocking files.
    ///
    /// # Safety
    /// As for [`Engine::submit`], for both entries.
    pub unsafe fn submit_linked(&self, first: Sqe, sqe: Sqe) -> Op<'_> {
        let idx = self.ops.borrow_mut().alloc(self.current_task());
        self.reserve(2);
        let first = first.flags(squeue::Flags::IO_LINK).user_data(UD_IGNORE);
        self.push(first);
        self.push(sqe.user_data(u64::from(idx)));
        Op {
            engine: self,
            idx,
            finished: false,
        }
    }

    /// Submits a multishot entry; its completions are queued (room for `capacity` reserved up
    /// front) until the returned [`MultiOp`] takes them.
    ///
    /// # Safety
    /// As for [`Engine::submit`], for as long as the operation stays armed.
    pub unsafe fn submit_multishot(&self, sqe: Sqe, capacity: usize) -> MultiOp<'_> {
        let queue = self.multi.borrow_mut().alloc(capacity);
        let idx = self
            .ops
            .borrow_mut()
            .alloc_multi(self.current_task(), queue);
        self.push(sqe.user_data(u64::from(idx)));
        MultiOp {
            engine: self,
            idx,
            queue,
            finished: false,
        }
    }

    /// Submits an entry whose completion nobody awaits (e.g. a cancel).
    ///
    /// # Safety
    /// As for [`Engine::submit`].
    pub unsafe fn submit_detached(&self, sqe: Sqe) {
        self.push(sqe.user_data(UD_IGNORE));
    }

    /// Makes room for `n` entries in the submission queue.
    fn reserve(&self, n: usize) {
        let mut ring = self.ring.borrow_mut();
        while {
            let sq = ring.submission();
            sq.capacity() - sq.len() < n
        } {
            if let Err(e) = ring.submit() {
                if e.raw_os_error() != Some(libc::EINTR) && e.raw_os_error() != Some(libc::EBUSY) {
                    tracing::error!("io_uring submit failed: {e}");
                    break;
                }
            }
        }
    }

    fn push(&self, sqe: Sqe) {
        let mut ring = self.ring.borrow_mut();
        loop {
            // SAFETY: the caller of the public submit functions guarantees the entry's memory.
            if unsafe { ring.submission().push(&sqe) }.is_ok() {
                return;
            }
            // Queue full: hand what we have to the kernel, then retry.
            let _ = ring.submit();
        }
    }

    /// Runs until every task finished. Returns early only on a fatal ring error.
    pub fn run(&self) -> Result<(), EngineError> {
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
        let mut fut = std::pin::pin!(fut);
        let mut cx = Context::from_waker(Waker::noop());
        loop {
            if let std::task::Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
                return Ok(v);
            }
            self.poll_ready();
            self.turn()?;
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
            } else {
                self.tasks.borrow_mut()[id as usize] = Some(task);
            }
        }
    }

    /// One loop turn: submit, wait for at least one completion (after an optional spin), reap.
    fn turn(&self) -> Result<(), EngineError> {
        self.arm_remote();
        let mut ring = self.ring.borrow_mut();
        let mut st = self.stats.get();
        if !self.spin.is_zero() && ring.completion().is_empty() {
            if !ring.submission().is_empty() {
                st.enters += 1;
                submit_retry(&ring, 0)?;
            }
            // Completions of polls and FUSE commands are delivered as task work, which (with
            // COOP_TASKRUN) runs only when this thread enters the kernel: the TASKRUN flag says
            // some is waiting, and a zero-wait enter runs it.
            let until = Instant::now() + self.spin;
            while ring.completion().is_empty() && Instant::now() < until {
                if ring.submission().taskrun() {
                    st.enters += 1;
                    submit_retry(&ring, 0)?;
                } else {
                    std::hint::spin_loop();
                }
            }
        }
        let want = usize::from(ring.completion().is_empty());
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
        Ok(())
    }

    fn dispatch(&self, ud: u64, res: i32, flags: u32) {
        match ud {
            UD_IGNORE => {}
            UD_REMOTE => {
                self.remote_armed.set(false);
                for id in self.remote.take() {
                    self.wake(id);
                }
            }
            _ => {
                let task =
                    self.ops
                        .borrow_mut()
                        .complete(ud, res, flags, &mut self.multi.borrow_mut());
                if let Some(t) = task {
                    self.wake(t);
                }
            }
        }
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
        // SAFETY: remote_buf is owned by the engine and outlives the ring (drained in Drop).
        self.push(sqe.user_data(UD_REMOTE));
        self.remote_armed.set(true);
    }

    /// Cancels op `idx` and waits (driving the ring) until it completed, then frees the slot.
    pub(crate) fn cancel_and_wait(&self, idx: u32) {
        self.cancel_until(idx, |s| matches!(s, Slot::Done { .. }));
    }

    /// Cancels multishot op `idx` and waits (driving the ring) for its final completion, then
    /// frees the slot.
    pub(crate) fn cancel_multi_and_wait(&self, idx: u32) {
        self.cancel_until(idx, |s| matches!(s, Slot::MultiEnded { .. }));
    }

    fn cancel_until(&self, idx: u32, ended: impl Fn(Slot) -> bool) {
        let sqe: Sqe = opcode::AsyncCancel::new(u64::from(idx)).build().into();
        self.push(sqe.user_data(UD_IGNORE));
        while !ended(self.ops.borrow().get(idx)) {
            let ring = self.ring.borrow_mut();
            if submit_retry(&ring, 1).is_err() {
                break;
            }
            drop(ring);
            self.reap_now();
        }
        self.ops.borrow_mut().release(idx);
    }

    fn reap_now(&self) {
        let mut ring = self.ring.borrow_mut();
        let cqes: Vec<(u64, i32, u32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result(), c.flags()))
            .collect();
        drop(ring);
        for (ud, res, flags) in cqes {
            self.dispatch(ud, res, flags);
        }
    }

    /// Cancels the op with this `user_data` without waiting (its future sees `-ECANCELED`).
    pub fn cancel(&self, user_data: u64) {
        let sqe: Sqe = opcode::AsyncCancel::new(user_data).build().into();
        self.push(sqe.user_data(UD_IGNORE));
    }

    /// Cancels every op in flight on `fd` without waiting (each future sees `-ECANCELED`).
    pub fn cancel_fd(&self, fd: RawFd) {
        let sqe: Sqe = opcode::AsyncCancel2::new(types::CancelBuilder::fd(types::Fd(fd)).all())
            .build()
            .into();
        self.push(sqe.user_data(UD_IGNORE));
    }

    /// The raw fd of the ring (for diagnostics).
    pub fn ring_fd(&self) -> RawFd {
        use std::os::fd::AsRawFd;
        self.ring.borrow().as_raw_fd()
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
        // Futures of unfinished tasks may own ops: drop them first (each cancels and waits).
        let tasks: Vec<Option<Task>> = std::mem::take(&mut *self.tasks.borrow_mut());
        drop(tasks);
        // Then make sure nothing the kernel still holds points into memory about to be freed.
        if self.remote_armed.get() {
            let sqe: Sqe = opcode::AsyncCancel::new(UD_REMOTE).build().into();
            self.push(sqe.user_data(UD_IGNORE));
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while (self.ops.borrow().in_flight > 0 || self.remote_armed.get())
            && Instant::now() < deadline
        {
            let ring = self.ring.borrow_mut();
            let _ = ring.submitter().submit_with_args(
                1,
                &types::SubmitArgs::new().timespec(&types::Timespec::new().nsec(100_000_000)),
            );
            drop(ring);
            self.reap_now();
        }
        if self.ops.borrow().in_flight > 0 {
            // Leak the pool rather than free memory the kernel may still write.
            tracing::error!(
                "engine dropped with {} ops in flight; leaking its buffers",
                self.ops.borrow().in_flight
            );
            std::mem::forget(std::mem::take(&mut self.pool));
        }
    }
}
