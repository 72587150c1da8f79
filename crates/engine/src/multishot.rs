//! Multishot operations and the provided-buffer ring they read into.
//!
//! A multishot read (`IORING_OP_READ_MULTISHOT`, Linux 6.7) stays armed on a pollable file and posts
//! one completion per read, each into a buffer the kernel picks from a ring of buffers the
//! application provides. On `/dev/fuse` that drains every queued request in one go without a
//! submission per request: one `io_uring_enter` can then carry many requests in and many replies out.
//!
//! Ownership: [`crate::Engine::provide`] takes a [`Slice`] by value and keeps it in the engine's
//! provided table until a completion names its buffer id, which hands it to the completion's
//! owner. Nobody else can reach a buffer while the kernel may fill it.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU16, Ordering};
use std::task::{Context, Poll};

use io_uring::types::BufRingEntry;

use crate::buf::{RawBuf, Slice};
use crate::executor::Engine;

/// One completion of a multishot operation.
#[derive(Debug)]
pub struct Completion {
    /// The CQE's `res` (bytes read, or a negative errno).
    pub res: i32,
    /// The provided window the kernel filled (from its start), if the completion named one that
    /// was provided.
    pub buf: Option<Slice>,
    /// The buffer id the completion named, if any. `named.is_some() && buf.is_none()` means the
    /// kernel named a buffer it was not given: nothing it says can be trusted any more.
    pub named: Option<u16>,
    /// Whether more completions follow (the operation is still armed).
    pub more: bool,
}

/// Queued completions of the engine's multishot operations, one queue per operation, sized when the
/// operation starts (a multishot read posts at most one completion per provided buffer before the
/// owner takes them, so its queue never grows past that).
#[derive(Default)]
pub(crate) struct MultiQueues {
    queues: Vec<VecDeque<Completion>>,
    free: Vec<u32>,
}

impl MultiQueues {
    pub(crate) fn alloc(&mut self, capacity: usize) -> u32 {
        if let Some(q) = self.free.pop() {
            let dq = &mut self.queues[q as usize];
            dq.clear();
            dq.reserve(capacity);
            return q;
        }
        self.queues.push(VecDeque::with_capacity(capacity));
        (self.queues.len() - 1) as u32
    }

    pub(crate) fn push(&mut self, q: u32, c: Completion) {
        if let Some(dq) = self.queues.get_mut(q as usize) {
            dq.push_back(c);
        }
    }

    fn pop(&mut self, q: u32) -> Option<Completion> {
        self.queues.get_mut(q as usize)?.pop_front()
    }

    /// Drops what is queued (buffers go back to the pool) and frees the queue.
    pub(crate) fn release(&mut self, q: u32) {
        if let Some(dq) = self.queues.get_mut(q as usize) {
            dq.clear();
            self.free.push(q);
        }
    }
}

/// A submitted multishot operation: yields its completions in order, then `None` once the kernel
/// posted the last one (a completion without `more`).
///
/// Dropping it before the end orphans it: the engine cancels it (best effort) and drops whatever
/// it still posts, up to its final completion. Nothing blocks.
#[must_use = "a MultiOp does nothing unless its completions are awaited"]
pub struct MultiOp<'e> {
    pub(crate) engine: &'e Engine,
    pub(crate) idx: u32,
    pub(crate) queue: u32,
    pub(crate) finished: bool,
}

impl<'e> MultiOp<'e> {
    /// The next completion, or `None` after the last one.
    pub fn completion(&mut self) -> Next<'_, 'e> {
        Next { op: self }
    }
}

/// Future of [`MultiOp::completion`].
pub struct Next<'a, 'e> {
    op: &'a mut MultiOp<'e>,
}

impl Future for Next<'_, '_> {
    type Output = Option<Completion>;

    fn poll(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Completion>> {
        let op = &mut *self.op;
        if op.finished {
            return Poll::Ready(None);
        }
        let engine = op.engine;
        let popped = engine.multi.borrow_mut().pop(op.queue);
        if let Some(c) = popped {
            if !c.more {
                op.finished = true;
                engine.ops.borrow_mut().release_ended(op.idx);
                engine.multi.borrow_mut().release(op.queue);
            }
            return Poll::Ready(Some(c));
        }
        engine
            .ops
            .borrow_mut()
            .set_waiter(op.idx, engine.current_task());
        Poll::Pending
    }
}

impl Drop for MultiOp<'_> {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let armed = self.engine.ops.borrow_mut().orphan_multi(self.idx);
        if armed {
            self.engine.cancel(u64::from(self.idx));
        } else {
            self.engine.multi.borrow_mut().release(self.queue);
        }
    }
}

/// The provided-buffer rings (`IORING_REGISTER_PBUF_RING`) of an engine, one group per pool that
/// asked for one, and the windows each lends the kernel. Owned by the engine; ring memory is
/// dropped after the io_uring itself, or after the group's unregistration.
///
/// Group ids are the table index, reused after a group is removed. A group is removed in two
/// steps: [`Provided::begin_remove`] stops lending into it; once no multishot operation that
/// reads from it is armed ([`Provided::arm`], [`Provided::disarm`]), [`Provided::take_removed`]
/// hands it to the engine, which unregisters it and only then drops it (its windows go back to
/// their pool): until then the kernel may still fill a window it lent.
#[derive(Default)]
pub(crate) struct Provided {
    groups: RefCell<Vec<Option<Group>>>,
    /// Ids of removed groups, for the next [`Provided::reserve`].
    free: RefCell<Vec<u16>>,
    /// Groups with windows pushed but not yet published.
    dirty: RefCell<Vec<u16>>,
    /// Whether some group being removed has no armed operation left.
    removals: Cell<bool>,
}

/// One provided-buffer ring and what it lends.
pub(crate) struct Group {
    ring: PbufRing,
    /// The window provided under each buffer id, until a completion names it.
    lent: Vec<Option<Slice>>,
    /// Pushed since the last publish (listed in `Provided::dirty`).
    dirty: bool,
    /// Multishot operations reading from this group whose final completion has not arrived.
    armed: u32,
    /// Being removed: lends nothing more, unregistered once `armed` is 0.
    removing: bool,
}

impl Group {
    /// Its group id.
    pub(crate) fn id(&self) -> u16 {
        self.ring.group
    }
}

impl Provided {
    /// A free group id (not yet in use: the caller registers a ring under it, then
    /// [`Provided::insert`]s it, or gives it back with [`Provided::release`]).
    pub(crate) fn reserve(&self) -> Option<u16> {
        if let Some(id) = self.free.borrow_mut().pop() {
            return Some(id);
        }
        let mut groups = self.groups.borrow_mut();
        let id = u16::try_from(groups.len()).ok()?;
        groups.push(None);
        Some(id)
    }

    /// Gives back a reserved id that got no ring.
    pub(crate) fn release(&self, id: u16) {
        self.free.borrow_mut().push(id);
    }

    /// Adds `ring` (registered under its group id, reserved with [`Provided::reserve`]) lending
    /// buffer ids `0..ids`.
    pub(crate) fn insert(&self, ring: PbufRing, ids: usize) {
        let id = usize::from(ring.group);
        let mut groups = self.groups.borrow_mut();
        if let Some(g) = groups.get_mut(id) {
            *g = Some(Group {
                ring,
                lent: (0..ids).map(|_| None).collect(),
                dirty: false,
                armed: 0,
                removing: false,
            });
        }
    }

    /// Lends `win` under its buffer's pool index in `group`; gives it back if there is no such
    /// group (or it is being removed), or the id is out of range or already lent.
    pub(crate) fn lend(&self, group: u16, win: Slice) -> Result<(), Slice> {
        let mut groups = self.groups.borrow_mut();
        let Some(Some(g)) = groups.get_mut(usize::from(group)) else {
            return Err(win);
        };
        if g.removing {
            return Err(win);
        }
        let bid = win.buf().index();
        match g.lent.get_mut(usize::from(bid)) {
            Some(e @ None) => {
                let len = u32::try_from(win.len()).unwrap_or(u32::MAX);
                // SAFETY: the window is engine-owned memory that stays in `lent` (so no task can
                // reach it) until a completion names `bid`, or until the group is unregistered
                // after its last armed operation ended; the memory itself outlives the ring.
                unsafe { g.ring.push(bid, win.ptr() as u64, len) };
                *e = Some(win);
                if !g.dirty {
                    g.dirty = true;
                    self.dirty.borrow_mut().push(group);
                }
                Ok(())
            }
            _ => Err(win),
        }
    }

    /// Publishes every group with windows pushed since its last publish.
    pub(crate) fn publish(&self) {
        let mut dirty = self.dirty.borrow_mut();
        if dirty.is_empty() {
            return;
        }
        let mut groups = self.groups.borrow_mut();
        for id in dirty.drain(..) {
            if let Some(Some(g)) = groups.get_mut(usize::from(id)) {
                g.dirty = false;
                g.ring.publish();
            }
        }
    }

    /// The window lent under `bid` in `group`, now handed back by the kernel.
    pub(crate) fn take(&self, group: u16, bid: u16) -> Option<Slice> {
        let mut groups = self.groups.borrow_mut();
        let g = groups.get_mut(usize::from(group))?.as_mut()?;
        g.lent.get_mut(usize::from(bid))?.take()
    }

    /// A multishot operation reading from `group` was submitted.
    pub(crate) fn arm(&self, group: u16) {
        if let Some(Some(g)) = self.groups.borrow_mut().get_mut(usize::from(group)) {
            g.armed += 1;
        }
    }

    /// A multishot operation reading from `group` posted its final completion.
    pub(crate) fn disarm(&self, group: u16) {
        if let Some(Some(g)) = self.groups.borrow_mut().get_mut(usize::from(group)) {
            g.armed = g.armed.saturating_sub(1);
            if g.removing && g.armed == 0 {
                self.removals.set(true);
            }
        }
    }

    /// Stops lending into `group`, whose pool is leaving; [`Provided::take_removed`] hands it
    /// over once no operation reads from it.
    pub(crate) fn begin_remove(&self, group: u16) {
        if let Some(Some(g)) = self.groups.borrow_mut().get_mut(usize::from(group)) {
            g.removing = true;
            if g.armed == 0 {
                self.removals.set(true);
            }
        }
    }

    /// Whether [`Provided::take_removed`] has something to hand over (one load: the loop asks
    /// after every turn).
    #[inline]
    pub(crate) fn removals_due(&self) -> bool {
        self.removals.get()
    }

    /// The groups being removed that no operation reads from any more, out of the table. The
    /// caller unregisters each, drops it, then [`Provided::release`]s its id.
    pub(crate) fn take_removed(&self) -> Vec<Group> {
        self.removals.set(false);
        let mut groups = self.groups.borrow_mut();
        groups
            .iter_mut()
            .filter(|g| g.as_ref().is_some_and(|g| g.removing && g.armed == 0))
            .filter_map(Option::take)
            .collect()
    }

    /// Groups registered now (including those being removed).
    pub(crate) fn len(&self) -> usize {
        self.groups.borrow().iter().flatten().count()
    }

    /// Windows still lent (dropped with the engine, after the ring).
    pub(crate) fn clear(&self) {
        for g in self.groups.borrow_mut().iter_mut().flatten() {
            for e in g.lent.iter_mut() {
                drop(e.take());
            }
        }
    }
}

/// The memory of a provided-buffer ring.
pub(crate) struct PbufRing {
    mem: RawBuf,
    entries: u16,
    tail: Cell<u16>,
    pub(crate) group: u16,
}

impl PbufRing {
    pub(crate) fn new(entries: u16, group: u16) -> Option<PbufRing> {
        let entries = entries.max(1).checked_next_power_of_two()?;
        let mem = RawBuf::new(usize::from(entries) * std::mem::size_of::<BufRingEntry>())?;
        Some(PbufRing {
            mem,
            entries,
            tail: Cell::new(0),
            group,
        })
    }

    pub(crate) fn addr(&self) -> u64 {
        self.mem.ptr() as u64
    }

    pub(crate) fn entries(&self) -> u16 {
        self.entries
    }

    fn base(&self) -> NonNull<BufRingEntry> {
        // RawBuf pointers are non-null and page aligned, which BufRingEntry's alignment divides.
        NonNull::new(self.mem.ptr().cast::<BufRingEntry>()).expect("non-null allocation")
    }

    /// Adds one buffer at the tail; the kernel sees it after [`PbufRing::publish`].
    ///
    /// # Safety
    /// `addr..addr+len` must stay valid, and untouched by anyone but the kernel, until a completion
    /// names `bid` (or the ring is gone).
    unsafe fn push(&self, bid: u16, addr: u64, len: u32) {
        let t = self.tail.get();
        let i = usize::from(t & (self.entries - 1));
        // SAFETY: i < entries, so the entry lies within `mem`; the kernel only reads entries
        // between its head and the published tail, and this one is past the published tail.
        let e = unsafe { &mut *self.base().as_ptr().add(i) };
        e.set_addr(addr);
        e.set_len(len);
        e.set_bid(bid);
        self.tail.set(t.wrapping_add(1));
    }

    /// Makes every pushed buffer visible to the kernel.
    fn publish(&self) {
        // SAFETY: the tail field lives in the first entry of the ring (`mem`), is 2-byte aligned,
        // and is shared with the kernel, which reads it; an atomic release store orders the entry
        // writes before it.
        let tail = unsafe { &*BufRingEntry::tail(self.base().as_ptr()).cast::<AtomicU16>() };
        tail.store(self.tail.get(), Ordering::Release);
    }
}

/// Handle to one of the engine's provided-buffer rings (the default pool's, or a
/// [`crate::BufPool`]'s): which group a multishot read takes its buffers from, and which group
/// resolves the buffer ids its completions name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufGroup(pub(crate) u16);
