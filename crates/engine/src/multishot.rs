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

/// A ring of provided buffers (`IORING_REGISTER_PBUF_RING`) and the windows it lends the kernel.
/// Owned by the engine; its ring memory is dropped after the io_uring itself.
pub(crate) struct Provided {
    ring: Option<PbufRing>,
    /// The window provided under each buffer id, until a completion names it.
    lent: RefCell<Vec<Option<Slice>>>,
}

impl Provided {
    pub(crate) fn none() -> Provided {
        Provided {
            ring: None,
            lent: RefCell::new(Vec::new()),
        }
    }

    pub(crate) fn new(ring: PbufRing, ids: usize) -> Provided {
        Provided {
            ring: Some(ring),
            lent: RefCell::new((0..ids).map(|_| None).collect()),
        }
    }

    pub(crate) fn group(&self) -> Option<u16> {
        self.ring.as_ref().map(|r| r.group)
    }

    /// Lends `win` under its buffer's pool index; gives it back if there is no ring or the id is
    /// out of range or already lent.
    pub(crate) fn lend(&self, win: Slice) -> Result<(), Slice> {
        let Some(r) = &self.ring else { return Err(win) };
        let bid = win.buf().index();
        let mut lent = self.lent.borrow_mut();
        match lent.get_mut(usize::from(bid)) {
            Some(e @ None) => {
                let len = u32::try_from(win.len()).unwrap_or(u32::MAX);
                // SAFETY: the window is engine-owned memory that stays in `lent` (so no task can
                // reach it) until a completion names `bid`; the memory itself outlives the ring.
                unsafe { r.push(bid, win.ptr() as u64, len) };
                *e = Some(win);
                Ok(())
            }
            _ => Err(win),
        }
    }

    pub(crate) fn publish(&self) {
        if let Some(r) = &self.ring {
            r.publish();
        }
    }

    /// The window lent under `bid`, now handed back by the kernel.
    pub(crate) fn take(&self, bid: u16) -> Option<Slice> {
        self.lent.borrow_mut().get_mut(usize::from(bid))?.take()
    }

    /// Windows still lent (dropped with the engine, after the ring).
    pub(crate) fn clear(&self) {
        for e in self.lent.borrow_mut().iter_mut() {
            drop(e.take());
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

/// Handle to the engine's provided-buffer ring: which group id to name in a buffer-select SQE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufGroup(pub(crate) u16);
