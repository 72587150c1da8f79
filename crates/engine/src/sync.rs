//! Single-thread async primitives for tasks of one engine. They wake by task id, so they cost no
//! atomics, no locks and no allocation after construction.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::executor::{Engine, TaskId};

/// A counting semaphore: bounds how many tasks do something at once (e.g. exactly one task keeps a
/// read of `/dev/fuse` in flight, so readers never race each other for the same request).
pub struct Semaphore {
    permits: Cell<usize>,
    waiters: RefCell<VecDeque<TaskId>>,
}

impl Semaphore {
    /// A semaphore with `permits` permits, with room for `max_waiters` waiting tasks up front.
    pub fn new(permits: usize, max_waiters: usize) -> Semaphore {
        Semaphore {
            permits: Cell::new(permits),
            waiters: RefCell::new(VecDeque::with_capacity(max_waiters)),
        }
    }

    /// Waits for a permit; the permit is returned with [`Semaphore::release`].
    pub fn acquire<'a>(&'a self, engine: &'a Engine) -> Acquire<'a> {
        Acquire {
            sem: self,
            engine,
            queued: false,
        }
    }

    /// Returns a permit and wakes the first waiter.
    pub fn release(&self, engine: &Engine) {
        self.permits.set(self.permits.get() + 1);
        if let Some(t) = self.waiters.borrow_mut().pop_front() {
            engine.wake(t);
        }
    }

    /// Wakes every waiter (e.g. at shutdown, so they notice and finish).
    pub fn wake_all(&self, engine: &Engine) {
        while let Some(t) = self.waiters.borrow_mut().pop_front() {
            engine.wake(t);
        }
    }
}

/// Future of [`Semaphore::acquire`].
pub struct Acquire<'a> {
    sem: &'a Semaphore,
    engine: &'a Engine,
    queued: bool,
}

impl Future for Acquire<'_> {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<()> {
        let p = self.sem.permits.get();
        if p > 0 {
            self.sem.permits.set(p - 1);
            return Poll::Ready(());
        }
        // Spurious polls (or a wake_all) re-queue the task once more; a stale entry only costs a
        // spurious wakeup later.
        if let Some(t) = self.engine.current_task() {
            let mut w = self.sem.waiters.borrow_mut();
            if !self.queued || !w.contains(&t) {
                w.push_back(t);
            }
        }
        self.queued = true;
        Poll::Pending
    }
}
