//! The table of in-flight ring operations and the future that waits for one.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::executor::{Engine, TaskId};
use crate::multishot::{Completion, MultiQueues};

/// State of one slot of the op table; the slot index is the SQE's `user_data`.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Slot {
    Free {
        next: u32,
    },
    /// Submitted; `task` is woken when the CQE arrives.
    Waiting {
        task: Option<TaskId>,
    },
    /// Completed; the result waits for its future to be polled.
    Done {
        res: i32,
    },
    /// A multishot op still armed: completions go to multishot queue `queue`.
    Multi {
        task: Option<TaskId>,
        queue: u32,
    },
    /// A multishot op that posted its final completion (still queued for its owner).
    MultiEnded {
        task: Option<TaskId>,
    },
}

/// Fixed-capacity slab of op slots with an intrusive free list: no allocation once sized.
pub(crate) struct OpTable {
    slots: Vec<Slot>,
    free: u32,
    pub(crate) in_flight: usize,
}

const NONE: u32 = u32::MAX;

impl OpTable {
    pub(crate) fn new(capacity: usize) -> OpTable {
        let mut t = OpTable {
            slots: Vec::with_capacity(capacity),
            free: NONE,
            in_flight: 0,
        };
        t.grow(capacity.max(1));
        t
    }

    fn grow(&mut self, by: usize) {
        let start = self.slots.len();
        for i in start..start + by {
            let next = if i + 1 < start + by {
                (i + 1) as u32
            } else {
                self.free
            };
            self.slots.push(Slot::Free { next });
        }
        self.free = start as u32;
    }

    /// Allocates a slot for a multishot op whose completions go to `queue`.
    pub(crate) fn alloc_multi(&mut self, task: Option<TaskId>, queue: u32) -> u32 {
        let idx = self.alloc(task);
        self.slots[idx as usize] = Slot::Multi { task, queue };
        idx
    }

    pub(crate) fn alloc(&mut self, task: Option<TaskId>) -> u32 {
        if self.free == NONE {
            // Only when more ops are in flight than sized for: grows once, then stays.
            let n = self.slots.len();
            self.grow(n);
        }
        let idx = self.free;
        let Slot::Free { next } = self.slots[idx as usize] else {
            unreachable!("free list points at a used slot")
        };
        self.free = next;
        self.slots[idx as usize] = Slot::Waiting { task };
        self.in_flight += 1;
        idx
    }

    pub(crate) fn release(&mut self, idx: u32) {
        self.slots[idx as usize] = Slot::Free { next: self.free };
        self.free = idx;
    }

    /// Records a completion; returns the task to wake, if any. Completions of multishot ops are
    /// queued in `multi`.
    pub(crate) fn complete(
        &mut self,
        idx: u64,
        res: i32,
        flags: u32,
        multi: &mut MultiQueues,
    ) -> Option<TaskId> {
        let slot = self.slots.get_mut(usize::try_from(idx).ok()?)?;
        match *slot {
            Slot::Waiting { task } => {
                *slot = Slot::Done { res };
                self.in_flight -= 1;
                task
            }
            Slot::Multi { task, queue } => {
                let more = io_uring::cqueue::more(flags);
                multi.push(
                    queue,
                    Completion {
                        res,
                        buffer: io_uring::cqueue::buffer_select(flags),
                        more,
                    },
                );
                if !more {
                    *slot = Slot::MultiEnded { task };
                    self.in_flight -= 1;
                }
                task
            }
            _ => None,
        }
    }

    pub(crate) fn get(&self, idx: u32) -> Slot {
        self.slots[idx as usize]
    }

    pub(crate) fn set_waiter(&mut self, idx: u32, task: Option<TaskId>) {
        match &mut self.slots[idx as usize] {
            Slot::Waiting { task: t }
            | Slot::Multi { task: t, .. }
            | Slot::MultiEnded { task: t } => *t = task,
            _ => {}
        }
    }
}

/// A submitted ring operation; resolves to the CQE's `res` (negative errno on failure).
///
/// Dropping an `Op` that has not completed cancels it and waits for its completion, so the memory it
/// uses is never touched after the owner moved on.
#[must_use = "an Op does nothing unless awaited"]
pub struct Op<'e> {
    pub(crate) engine: &'e Engine,
    pub(crate) idx: u32,
    pub(crate) finished: bool,
}

impl Op<'_> {
    /// The `user_data` of this op, e.g. to target it with `ASYNC_CANCEL`.
    pub fn user_data(&self) -> u64 {
        u64::from(self.idx)
    }
}

impl Future for Op<'_> {
    type Output = i32;

    fn poll(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<i32> {
        let engine = self.engine;
        let mut ops = engine.ops.borrow_mut();
        match ops.get(self.idx) {
            Slot::Done { res, .. } => {
                ops.release(self.idx);
                drop(ops);
                self.finished = true;
                Poll::Ready(res)
            }
            Slot::Waiting { .. } => {
                ops.set_waiter(self.idx, engine.current_task());
                Poll::Pending
            }
            Slot::Free { .. } | Slot::Multi { .. } | Slot::MultiEnded { .. } => {
                unreachable!("single-shot op polled in a wrong state")
            }
        }
    }
}

impl Drop for Op<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.engine.cancel_and_wait(self.idx);
        }
    }
}
