//! The table of in-flight ring operations and the future that waits for one.
//!
//! The table, not the future, owns what an operation lends the kernel (its buffer, its timespec):
//! an entry keeps it from submission until the operation's terminal completion. Dropping the
//! future early only marks the entry orphaned and asks the kernel to cancel (best effort); the
//! memory goes back when the completion arrives, whenever that is. Nothing waits, and a slot is
//! never reused before its completion came in, so a late completion cannot reach the next owner.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use crate::buf::{Buf, Slice};
use crate::executor::{Engine, TaskId};
use crate::multishot::{Completion, MultiQueues, Provided};

/// What an operation lends the kernel until its terminal completion.
#[derive(Debug, Default)]
pub(crate) enum Owned {
    /// Nothing (fsync, fallocate, cancel).
    #[default]
    None,
    /// A whole buffer (FUSE ring entries: the kernel writes the next request into it).
    Buf(Buf),
    /// A window of a buffer (reads and writes).
    Slice(Slice),
    /// A timeout's duration (the kernel reads it at submission; kept for simplicity).
    Time { _ts: Box<io_uring::types::Timespec> },
    /// A window and the deadline of the `LINK_TIMEOUT` linked to its socket operation.
    SliceTimed(Slice, crate::net::Timeout),
    /// Bytes of the caller's own (protocol headers on a socket).
    Bytes(Vec<u8>),
    /// Bytes and the deadline of the linked timeout.
    BytesTimed(Vec<u8>, crate::net::Timeout),
    /// The path (or two: rename, link) of a `*at` call (the kernel reads them, at submission or
    /// in an io-wq worker).
    Paths {
        path: crate::scratch::CPath,
        second: Option<crate::scratch::CPath>,
    },
    /// An `openat`'s path: a completion no future takes any more carries a descriptor that is
    /// closed then (see [`Owned::orphan_done`]).
    Open { path: crate::scratch::CPath },
    /// A `statx`'s path and the buffer the kernel fills.
    Statx {
        path: crate::scratch::CPath,
        buf: Box<std::mem::MaybeUninit<libc::statx>>,
    },
}

impl Owned {
    /// The completion `res` of an op whose future is gone: what it made is undone (an opened
    /// descriptor closed), so an abandoned op leaks nothing.
    fn orphan_done(&self, res: i32) {
        if let Owned::Open { .. } = self {
            if res >= 0 {
                // SAFETY: the kernel just opened this descriptor for the op, whose owner is
                // gone: nothing else knows or owns it.
                unsafe { libc::close(res) };
            }
        }
    }
}

/// State of one slot of the op table; the slot index is the SQE's `user_data`.
#[derive(Debug)]
pub(crate) enum Slot {
    Free {
        next: u32,
    },
    /// Submitted; `waker` (if set) or else `task` is woken when the CQE arrives.
    Waiting {
        task: Option<TaskId>,
        owned: Owned,
        waker: Option<Waker>,
    },
    /// Completed; the result waits for its future to be polled.
    Done {
        res: i32,
        owned: Owned,
    },
    /// Its future was dropped before the completion: the slot holds `owned` until it arrives.
    Orphan {
        owned: Owned,
    },
    /// A multishot op still armed: completions go to multishot queue `queue`, with the buffer
    /// their id names in provided-buffer group `group` (each pool has its own group, and ids
    /// are pool indexes, so only the op's own group resolves them).
    Multi {
        task: Option<TaskId>,
        queue: u32,
        group: u16,
    },
    /// A multishot op whose owner is gone: completions are discarded until the final one.
    MultiOrphan {
        queue: u32,
        group: u16,
    },
    /// A multishot op that posted its final completion (still queued for its owner).
    MultiEnded {
        task: Option<TaskId>,
    },
}

/// Whom a completion wakes.
pub(crate) enum Woken {
    /// A task of the engine, by id (no waker needed: the executor knows its tasks).
    Task(TaskId),
    /// A waker registered by the future (see [`OpTable::set_waker`]).
    Waker(Waker),
}

/// Fixed-capacity slab of op slots with an intrusive free list: no allocation once sized.
pub(crate) struct OpTable {
    slots: Vec<Slot>,
    free: u32,
    /// Operations whose terminal completion has not arrived.
    pub(crate) in_flight: usize,
}

const NONE: u32 = u32::MAX;

impl Default for OpTable {
    fn default() -> Self {
        OpTable {
            slots: Vec::new(),
            free: NONE,
            in_flight: 0,
        }
    }
}

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

    /// Takes a free slot for an op about to be pushed.
    pub(crate) fn alloc(&mut self, task: Option<TaskId>, owned: Owned) -> u32 {
        self.alloc_as(Slot::Waiting {
            task,
            owned,
            waker: None,
        })
    }

    /// Takes a free slot for a multishot op whose completions go to `queue` and name buffers
    /// of provided-buffer group `group`.
    pub(crate) fn alloc_multi(&mut self, task: Option<TaskId>, queue: u32, group: u16) -> u32 {
        self.alloc_as(Slot::Multi { task, queue, group })
    }

    fn alloc_as(&mut self, slot: Slot) -> u32 {
        if self.free == NONE {
            // Only when more ops are in flight than sized for: grows once, then stays.
            let n = self.slots.len();
            self.grow(n);
        }
        let idx = self.free;
        let next = match self.slots[idx as usize] {
            Slot::Free { next } => next,
            _ => unreachable!("free list points at a used slot"),
        };
        self.free = next;
        self.slots[idx as usize] = slot;
        self.in_flight += 1;
        idx
    }

    /// Frees a slot whose op was never pushed (the submission queue refused it) and gives back
    /// what it held.
    pub(crate) fn unpush(&mut self, idx: u32) -> Owned {
        self.in_flight -= 1;
        match self.release(idx) {
            Slot::Waiting { owned, .. } => owned,
            _ => Owned::None,
        }
    }

    fn release(&mut self, idx: u32) -> Slot {
        let old = std::mem::replace(
            &mut self.slots[idx as usize],
            Slot::Free { next: self.free },
        );
        self.free = idx;
        old
    }

    /// Records a completion; returns the task to wake, if any. Completions of multishot ops are
    /// queued in `multi` with the provided buffer they name in the op's group, and their final
    /// one disarms the group in `provided` (a group being removed waits for that). Memory of
    /// orphaned ops is dropped here (back to the pool), since the kernel is done with it.
    pub(crate) fn complete(
        &mut self,
        idx: u64,
        res: i32,
        flags: u32,
        multi: &mut MultiQueues,
        provided: &Provided,
    ) -> Option<Woken> {
        let i = usize::try_from(idx).ok()?;
        let slot = self.slots.get_mut(i)?;
        match slot {
            Slot::Waiting { task, owned, waker } => {
                let woken = match waker.take() {
                    Some(w) => Some(Woken::Waker(w)),
                    None => task.map(Woken::Task),
                };
                let owned = std::mem::take(owned);
                *slot = Slot::Done { res, owned };
                self.in_flight -= 1;
                woken
            }
            Slot::Orphan { owned } => {
                owned.orphan_done(res);
                self.in_flight -= 1;
                drop(self.release(i as u32));
                None
            }
            Slot::Multi { task, queue, group } => {
                let (task, queue, group) = (*task, *queue, *group);
                let more = io_uring::cqueue::more(flags);
                let named = io_uring::cqueue::buffer_select(flags);
                let buf = named.and_then(|bid| provided.take(group, bid));
                multi.push(
                    queue,
                    Completion {
                        res,
                        buf,
                        named,
                        more,
                    },
                );
                if !more {
                    *slot = Slot::MultiEnded { task };
                    self.in_flight -= 1;
                    provided.disarm(group);
                }
                task.map(Woken::Task)
            }
            Slot::MultiOrphan { queue, group } => {
                let (queue, group) = (*queue, *group);
                // Whatever buffer the kernel filled goes straight back to the pool.
                if let Some(bid) = io_uring::cqueue::buffer_select(flags) {
                    drop(provided.take(group, bid));
                }
                if !io_uring::cqueue::more(flags) {
                    self.in_flight -= 1;
                    drop(self.release(i as u32));
                    multi.release(queue);
                    provided.disarm(group);
                }
                None
            }
            Slot::Free { .. } | Slot::Done { .. } | Slot::MultiEnded { .. } => None,
        }
    }

    /// Takes the result of a completed single-shot op and frees its slot.
    pub(crate) fn take_done(&mut self, idx: u32) -> Option<(i32, Owned)> {
        if !matches!(self.slots[idx as usize], Slot::Done { .. }) {
            return None;
        }
        match self.release(idx) {
            Slot::Done { res, owned } => Some((res, owned)),
            _ => None,
        }
    }

    /// The owner of single-shot op `idx` is gone: free the slot now if it completed, else keep
    /// its memory until the completion. Returns whether the op is still in flight.
    pub(crate) fn orphan(&mut self, idx: u32) -> bool {
        let slot = &mut self.slots[idx as usize];
        match slot {
            Slot::Waiting { owned, .. } => {
                let owned = std::mem::take(owned);
                *slot = Slot::Orphan { owned };
                true
            }
            _ => {
                if let Slot::Done { res, owned } = self.release(idx) {
                    owned.orphan_done(res);
                }
                false
            }
        }
    }

    /// The owner of multishot op `idx` is gone. Returns whether the op is still armed (its queue
    /// is then released with its final completion); otherwise the caller releases the queue.
    pub(crate) fn orphan_multi(&mut self, idx: u32) -> bool {
        let slot = &mut self.slots[idx as usize];
        match *slot {
            Slot::Multi { queue, group, .. } => {
                *slot = Slot::MultiOrphan { queue, group };
                true
            }
            _ => {
                drop(self.release(idx));
                false
            }
        }
    }

    /// Frees the slot of a multishot op whose final completion its owner has taken.
    pub(crate) fn release_ended(&mut self, idx: u32) {
        drop(self.release(idx));
    }

    /// Makes the completion of op `idx` wake `w` rather than a task: for futures polled by a
    /// combinator (`FuturesUnordered`, `join_all`) that polls only the sub-futures whose own
    /// waker fired.
    pub(crate) fn set_waker(&mut self, idx: u32, w: &Waker) {
        if let Slot::Waiting { waker, .. } = &mut self.slots[idx as usize] {
            match waker {
                Some(old) if old.will_wake(w) => {}
                _ => *waker = Some(w.clone()),
            }
        }
    }

    pub(crate) fn set_waiter(&mut self, idx: u32, t: Option<TaskId>) {
        match &mut self.slots[idx as usize] {
            Slot::Waiting { task, .. } | Slot::Multi { task, .. } | Slot::MultiEnded { task } => {
                *task = t
            }
            _ => {}
        }
    }

    /// `user_data` of every op still in flight (for cancelling them all at engine drop).
    pub(crate) fn pending(&self) -> impl Iterator<Item = u64> + '_ {
        self.slots.iter().enumerate().filter_map(|(i, s)| {
            matches!(
                s,
                Slot::Waiting { .. }
                    | Slot::Orphan { .. }
                    | Slot::Multi { .. }
                    | Slot::MultiOrphan { .. }
            )
            .then_some(i as u64)
        })
    }
}

/// A submitted single-shot operation; resolves to the CQE's `res` (negative errno on failure)
/// and what the operation held.
///
/// Dropping it before the completion orphans the operation: the engine asks the kernel to cancel
/// it and keeps its memory until the completion arrives. Nothing blocks.
#[must_use = "an Op does nothing unless awaited"]
pub(crate) struct Op<'e> {
    pub(crate) engine: &'e Engine,
    pub(crate) state: OpState,
}

pub(crate) enum OpState {
    /// In the table under this index.
    Pending(u32),
    /// Never reached the kernel (the submission queue refused it): resolves at once.
    Failed(i32, Owned),
    /// Resolved.
    Finished,
}

impl Op<'_> {
    /// Takes the op's state out, leaving nothing for `Drop` to orphan (for wrappers that manage
    /// the slot themselves).
    pub(crate) fn into_state(mut self) -> OpState {
        std::mem::replace(&mut self.state, OpState::Finished)
    }
}

impl Future for Op<'_> {
    type Output = (i32, Owned);

    fn poll(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<(i32, Owned)> {
        let engine = self.engine;
        match std::mem::replace(&mut self.state, OpState::Finished) {
            OpState::Pending(idx) => {
                let mut ops = engine.ops.borrow_mut();
                if let Some(done) = ops.take_done(idx) {
                    return Poll::Ready(done);
                }
                ops.set_waiter(idx, engine.current_task());
                self.state = OpState::Pending(idx);
                Poll::Pending
            }
            OpState::Failed(res, owned) => Poll::Ready((res, owned)),
            OpState::Finished => Poll::Ready((-libc::EINVAL, Owned::None)),
        }
    }
}

impl Drop for Op<'_> {
    fn drop(&mut self) {
        if let OpState::Pending(idx) = self.state {
            let in_flight = self.engine.ops.borrow_mut().orphan(idx);
            if in_flight {
                self.engine.cancel(u64::from(idx));
            }
        }
    }
}
