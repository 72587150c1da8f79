//! The legacy transport: requests read from a `/dev/fuse` fd, replies written back to it, both
//! through the queue's ring.
//!
//! The fd is non-blocking and each read is a `POLL_ADD` linked to a `READ`: a blocking read of
//! `/dev/fuse` issued from io_uring could otherwise lose the race for a request to another queue (all
//! cloned fds share one input queue) and block the whole queue thread inside the kernel. Exactly one
//! read per queue is in flight at a time (a semaphore of one permit), so readers never race each
//! other within a queue. The poll is deliberately not `EPOLLEXCLUSIVE`: waking every idle queue
//! lets the one on the submitter's CPU win, which measured 4× faster at queue depth 1 on a 2-vCPU
//! VM (78.5k vs 20.0k IOPS) and 1.4–1.6× at QD64 with one submitter; exclusive wakeups only won
//! with four submitters (255k vs 159k).

use std::cell::Cell;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use engine::io_uring::{opcode, types};
use engine::sync::Semaphore;
use engine::{BufHandle, Engine, IoBuf, Sqe};

use crate::TransportError;

/// Where a request and its reply sit in a slot buffer. WRITE data arrives page aligned at
/// `payload` (so O_DIRECT can take it as is) because the request is read in at
/// `payload - sizeof(in_header + write_in)`; READ data is read from the image straight to
/// `payload`, right behind the 16-byte reply header: no userspace copy either way.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    /// Offset the request is read into.
    pub request: usize,
    /// Offset of the reply header (16 bytes before `payload`).
    pub reply: usize,
    /// Offset of payload data (page aligned).
    pub payload: usize,
    /// Total buffer size.
    pub size: usize,
}

impl Layout {
    /// The layout for buffers that take requests of up to `max_write` payload bytes.
    pub const fn new(max_write: usize) -> Layout {
        let payload = 4096;
        Layout {
            request: payload - 80,
            reply: payload - 16,
            payload,
            size: payload + max_write + 4096,
        }
    }

    /// How many payload bytes fit.
    pub const fn payload_capacity(&self) -> usize {
        self.size - self.payload
    }
}

/// Outcome of waiting for a request.
#[derive(Debug, PartialEq, Eq)]
pub enum ReadOutcome {
    /// A request of this many bytes is at `Layout::request`.
    Request(usize),
    /// The queue is stopping: take no more requests.
    Stopped,
    /// The connection is gone (unmounted or aborted).
    Gone,
}

/// One legacy queue: an fd (the mount's or a clone) served by one engine.
pub struct LegacyQueue {
    fd: OwnedFd,
    layout: Layout,
    permit: Semaphore,
    stopping: Cell<bool>,
}

impl LegacyQueue {
    /// Wraps a `/dev/fuse` fd; makes it non-blocking. `depth` is the number of slot tasks.
    pub fn new(fd: OwnedFd, layout: Layout, depth: usize) -> Result<LegacyQueue, TransportError> {
        set_nonblocking(fd.as_raw_fd())?;
        Ok(LegacyQueue {
            fd,
            layout,
            permit: Semaphore::new(1, depth),
            stopping: Cell::new(false),
        })
    }

    /// The buffer layout requests use.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The fd this queue serves.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Waits for the next request and reads it into `buf` at `layout.request`.
    pub async fn next_request(
        &self,
        eng: &Engine,
        buf: &mut BufHandle,
    ) -> Result<ReadOutcome, TransportError> {
        loop {
            self.permit.acquire(eng).await;
            if self.stopping.get() {
                self.permit.release(eng);
                return Ok(ReadOutcome::Stopped);
            }
            let start = self.layout.request;
            let len = (buf.len() - start) as u32;
            let fd = types::Fd(self.fd.as_raw_fd());
            let poll: Sqe = opcode::PollAdd::new(fd, libc::POLLIN as u32).build().into();
            let mut win = buf.io_mut(start, len as usize);
            let read: Sqe = opcode::Read::new(fd, win.as_mut_ptr(), len)
                .offset(u64::MAX)
                .build()
                .into();
            // SAFETY: the window is engine-owned memory, valid until the engine drains.
            let res = unsafe { eng.submit_linked(poll, read) }.await;
            self.permit.release(eng);
            match res {
                n if n > 0 => return Ok(ReadOutcome::Request(n as usize)),
                0 => return Ok(ReadOutcome::Gone),
                n if n == -libc::ENODEV => return Ok(ReadOutcome::Gone),
                n if n == -libc::EAGAIN
                    || n == -libc::EINTR
                    || n == -libc::ECANCELED
                    || n == -libc::ENOENT =>
                {
                    continue
                }
                n => return Err(TransportError::Io(std::io::Error::from_raw_os_error(-n))),
            }
        }
    }

    /// Writes a reply (out header included) from `reply` to the fd. A reply the kernel no longer
    /// waits for (the request was interrupted, or the connection aborted) is not an error.
    pub async fn send_reply(&self, eng: &Engine, reply: IoBuf<'_>) -> Result<(), TransportError> {
        let sqe: Sqe = opcode::Write::new(
            types::Fd(self.fd.as_raw_fd()),
            reply.as_ptr(),
            reply.len() as u32,
        )
        .offset(u64::MAX)
        .build()
        .into();
        // SAFETY: the window is engine-owned memory, valid until the engine drains.
        let res = unsafe { eng.submit(sqe) }.await;
        match res {
            n if n >= 0 => Ok(()),
            n if [
                libc::ENOENT,
                libc::ENODEV,
                libc::ECONNABORTED,
                libc::ECANCELED,
            ]
            .contains(&-n) =>
            {
                Ok(())
            }
            n => Err(TransportError::Io(std::io::Error::from_raw_os_error(-n))),
        }
    }

    /// Stops taking requests: cancels the pending read and lets waiting readers see the flag.
    pub fn stop(&self, eng: &Engine) {
        self.stopping.set(true);
        eng.cancel_fd(self.fd.as_raw_fd());
        self.permit.wake_all(eng);
    }

    /// Whether [`LegacyQueue::stop`] was called.
    pub fn is_stopping(&self) -> bool {
        self.stopping.get()
    }
}

fn set_nonblocking(fd: RawFd) -> Result<(), TransportError> {
    // SAFETY: fcntl on a valid fd with integer arguments.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl < 0 || libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) < 0 {
            return Err(TransportError::Io(std::io::Error::last_os_error()));
        }
    }
    Ok(())
}
