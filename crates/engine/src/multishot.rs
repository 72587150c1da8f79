//! Multishot operations and the provided-buffer ring they read into.
//!
//! A multishot read (`IORING_OP_READ_MULTISHOT`, Linux 6.7) stays armed on a pollable file and posts
//! one completion per read, each into a buffer the kernel picks from a ring of buffers the
//! application provides. On `/dev/fuse` that drains every queued request in one go without a
//! submission per request: one `io_uring_enter` can then carry many requests in and many replies out.

use std::cell::Cell;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU16, Ordering};
use std::task::{Context, Poll};

use io_uring::types::BufRingEntry;

use crate::buf::RawBuf;
use crate::executor::Engine;

/// One completion of a multishot operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The CQE's `res` (bytes read, or a negative errno).
    pub res: i32,
    /// The provided buffer the kernel filled, if any.
    pub buffer: Option<u16>,
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

    fn release(&mut self, q: u32) {
        self.free.push(q);
    }
}

/// A submitted multishot operation: yields its completions in order, then `None` once the kernel
/// posted the last one (a completion without `more`).
///
/// Dropping it before the end cancels the operation and waits for its final completion.
#[must_use = "a MultiOp does nothing unless its completions are awaited"]
pub struct MultiOp<'e> {
    pub(crate) engine: &'e Engine,
    pub(crate) idx: u32,
    pub(crate) queue: u32,
    pub(crate) finished: bool,
}

impl<'e> MultiOp<'e> {
    /// The `user_data` of this op, e.g. to target it with `ASYNC_CANCEL`.
    pub fn user_data(&self) -> u64 {
        u64::from(self.idx)
    }

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
                op.finish();
            }
            return Poll::Ready(Some(c));
        }
        let mut ops = engine.ops.borrow_mut();
        ops.set_waiter(op.idx, engine.current_task());
        Poll::Pending
    }
}

impl MultiOp<'_> {
    fn finish(&mut self) {
        self.finished = true;
        self.engine.ops.borrow_mut().release(self.idx);
        self.engine.multi.borrow_mut().release(self.queue);
    }
}

impl Drop for MultiOp<'_> {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        // Cancel, then wait for the final completion (earlier ones are discarded with the queue).
        self.engine.cancel_multi_and_wait(self.idx);
        self.engine.multi.borrow_mut().release(self.queue);
        self.finished = true;
    }
}

/// A ring of provided buffers (`IORING_REGISTER_PBUF_RING`), owned by the engine so its memory
/// outlives the registration.
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
    pub(crate) unsafe fn push(&self, bid: u16, addr: u64, len: u32) {
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
    pub(crate) fn publish(&self) {
        // SAFETY: the tail field lives in the first entry of the ring (`mem`), is 2-byte aligned,
        // and is shared with the kernel, which reads it; an atomic release store orders the entry
        // writes before it.
        let tail = unsafe { &*BufRingEntry::tail(self.base().as_ptr()).cast::<AtomicU16>() };
        tail.store(self.tail.get(), Ordering::Release);
    }
}

/// Handle to the engine's provided-buffer ring: which group id to name in a buffer-select SQE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufGroup(pub u16);
