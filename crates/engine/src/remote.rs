//! Cross-thread wakeups: another thread (a signal handler thread, a control socket, a backend's
//! helper) schedules a task of an engine by queueing its id and writing the engine's eventfd, whose
//! read the engine keeps in flight on its ring. A waker used on its engine's own thread schedules
//! the task directly, without this.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Wake, Waker};

use crate::executor::TaskId;

pub(crate) struct RemoteShared {
    efd: OwnedFd,
    /// A duplicate of the engine's ring fd, for `IORING_OP_MSG_RING` wakeups.
    ring: OwnedFd,
    queue: Mutex<Vec<TaskId>>,
    wakes: AtomicU64,
}

impl RemoteShared {
    pub(crate) fn new(ring_fd: RawFd) -> std::io::Result<RemoteShared> {
        // SAFETY: plain syscall; the returned fd is checked before use.
        let ring = unsafe { libc::fcntl(ring_fd, libc::F_DUPFD_CLOEXEC, 0) };
        if ring < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `ring` is a fresh, owned descriptor.
        let ring = unsafe { OwnedFd::from_raw_fd(ring) };
        // SAFETY: plain syscall; the returned fd is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh, owned descriptor.
        let efd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(RemoteShared {
            efd,
            ring,
            queue: Mutex::new(Vec::new()),
            wakes: AtomicU64::new(0),
        })
    }

    pub(crate) fn ring_fd(&self) -> RawFd {
        self.ring.as_raw_fd()
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.efd.as_raw_fd()
    }

    pub(crate) fn take(&self) -> Vec<TaskId> {
        std::mem::take(&mut *self.queue.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Interrupts the engine's ring wait without scheduling a task (for [`crate::Engine::block_on`]).
    pub(crate) fn kick(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our own eventfd.
        let _ = unsafe { libc::write(self.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Task wakeups sent through the eventfd so far.
    pub(crate) fn wakes(&self) -> u64 {
        self.wakes.load(Ordering::Relaxed)
    }

    fn wake(&self, task: TaskId) {
        self.wakes.fetch_add(1, Ordering::Relaxed);
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(task);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our own eventfd.
        let _ = unsafe { libc::write(self.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}

/// How a waker used on another engine's thread reaches its task's engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrossWake {
    /// Queue the task id and write the target engine's eventfd (whose read stays armed on its
    /// ring): a lock and a system call per wakeup.
    Eventfd,
    /// Post an `IORING_OP_MSG_RING` completion carrying the task id to the target ring, on the
    /// waking thread's own ring (batched with its next submission). Falls back to the eventfd on
    /// threads without an engine.
    MsgRing,
}

static CROSS_WAKE: AtomicU8 = AtomicU8::new(0);

impl CrossWake {
    /// Chooses the mechanism for the whole process (a measurement switch; eventfd by default).
    pub fn set(self) {
        CROSS_WAKE.store(self as u8, Ordering::Relaxed);
    }

    /// The mechanism in use.
    pub fn current() -> CrossWake {
        match CROSS_WAKE.load(Ordering::Relaxed) {
            1 => CrossWake::MsgRing,
            _ => CrossWake::Eventfd,
        }
    }
}

/// A thread-safe handle that wakes tasks of one engine.
#[derive(Clone)]
pub struct Remote {
    shared: Arc<RemoteShared>,
}

impl Remote {
    pub(crate) fn new(shared: Arc<RemoteShared>) -> Remote {
        Remote { shared }
    }

    /// Schedules `task` on the engine this handle belongs to, from any thread. If the task ended
    /// meanwhile, its id may belong to a newer task, which then sees a spurious wakeup (see
    /// [`TaskId`]).
    pub fn wake(&self, task: TaskId) {
        self.shared.wake(task);
    }

    /// Schedules `task` like [`Remote::wake`], but from a thread that runs an engine of its own
    /// the wakeup goes out as an `IORING_OP_MSG_RING` with that thread's next submission (no
    /// system call, no lock of the target's queue); elsewhere through the eventfd.
    pub fn wake_by_ring(&self, task: TaskId) {
        if crate::executor::wake_local(&self.shared, task) {
            return;
        }
        if crate::executor::wake_by_msg_ring(&self.shared, task) {
            self.shared.wakes.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.wake(task);
    }

    pub(crate) fn waker_for(&self, task: TaskId) -> Waker {
        Waker::from(Arc::new(TaskWaker {
            remote: self.clone(),
            task,
        }))
    }
}

struct TaskWaker {
    remote: Remote,
    task: TaskId,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        // A task woken from its own engine's thread (a lock released by a sibling task) is
        // scheduled directly; only other threads pay for the eventfd.
        if crate::executor::wake_local(&self.remote.shared, self.task) {
            return;
        }
        if CrossWake::current() == CrossWake::MsgRing
            && crate::executor::wake_by_msg_ring(&self.remote.shared, self.task)
        {
            self.remote.shared.wakes.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.remote.wake(self.task);
    }
}
