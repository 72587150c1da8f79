//! The legacy transport: requests read from a `/dev/fuse` fd, replies written back to it, both
//! through the queue's ring.
//!
//! Where the kernel has them (Linux 6.7+), requests are read by one multishot `READ` per queue into
//! a ring of provided buffers (each slot's buffer, at `Layout::request`): every queued request is
//! read in one go, with no submission per request, and a queue woken for a request another queue
//! took goes back to sleep inside the kernel. Otherwise (or with `--legacy-read poll`) each read
//! is a `POLL_ADD` linked to a `READ`, as described next.
//!
//! The fd is non-blocking and each read is a `POLL_ADD` linked to a `READ`: a blocking read of
//! `/dev/fuse` issued from io_uring could otherwise lose the race for a request to another queue (all
//! cloned fds share one input queue) and block the whole queue thread inside the kernel. Exactly one
//! read per queue is in flight at a time (a semaphore of one permit), so readers never race each
//! other within a queue. The poll is deliberately not `EPOLLEXCLUSIVE`: waking every idle queue
//! lets the one on the submitter's CPU win, which measured 4× faster at queue depth 1 on a 2-vCPU
//! VM (78.5k vs 20.0k IOPS) and 1.4–1.6× at QD64 with one submitter; exclusive wakeups only won
//! with four submitters (255k vs 159k).

use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::task::Poll;

use engine::sync::Semaphore;
use engine::{Buf, BufGroup, Engine, Fd, TaskId, AT_CURSOR};

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
#[derive(Debug)]
pub enum ReadOutcome {
    /// A request of this many bytes is at `Layout::request` of the buffer.
    Request(Buf, usize),
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
    multishot: Option<Multishot>,
}

/// State of the multishot reader: which slot buffers the kernel holds and which got a request.
struct Multishot {
    group: BufGroup,
    /// Per buffer index (the provided buffer id).
    slots: RefCell<Vec<MsSlot>>,
    /// Buffers the kernel holds (provided, not yet filled).
    provided: Cell<usize>,
    /// The reader task, while it waits for a buffer to be provided.
    reader: Cell<Option<TaskId>>,
    /// Why the reader finished, once it has.
    end: Cell<Option<ReaderEnd>>,
}

/// Why the multishot reader finished.
#[derive(Clone, Copy, Debug)]
enum ReaderEnd {
    /// The queue was stopped.
    Stopped,
    /// The connection is gone (unmounted or aborted).
    Gone,
    /// Reading failed with this errno.
    Failed(i32),
}

#[derive(Default)]
struct MsSlot {
    /// The buffer the kernel filled for this slot, and the request's length.
    filled: Option<(Buf, usize)>,
    /// The slot task waiting for it.
    task: Option<TaskId>,
}

fn io_err(errno: i32) -> TransportError {
    TransportError::Io(std::io::Error::from_raw_os_error(errno))
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
            multishot: None,
        })
    }

    /// Switches to multishot reads into provided buffers if the slots' pool has a
    /// provided-buffer ring (`group`) and the kernel knows `IORING_OP_READ_MULTISHOT`. Then
    /// [`LegacyQueue::serve_reads`] must run as a task of `eng`. Returns whether it switched.
    pub fn use_multishot(&mut self, eng: &Engine, group: Option<BufGroup>, buffers: usize) -> bool {
        let Some(group) = group else {
            return false;
        };
        if !eng.can_read_multishot() {
            return false;
        }
        self.multishot = Some(Multishot {
            group,
            slots: RefCell::new((0..buffers).map(|_| MsSlot::default()).collect()),
            provided: Cell::new(0),
            reader: Cell::new(None),
            end: Cell::new(None),
        });
        true
    }

    /// Whether requests are read by a multishot read (see [`LegacyQueue::use_multishot`]).
    pub fn is_multishot(&self) -> bool {
        self.multishot.is_some()
    }

    /// How this queue reads `/dev/fuse`: "multishot" or "poll" (for logs and stats).
    pub fn read_mode(&self) -> &'static str {
        if self.is_multishot() {
            "multishot"
        } else {
            "poll"
        }
    }

    /// The multishot reader: keeps one multishot `READ` armed while any buffer is provided and
    /// hands each request to the slot whose buffer it landed in. Ends when the queue stops, the
    /// connection is gone or reading fails; the slots then see that in
    /// [`LegacyQueue::next_request`]. Does nothing in poll mode.
    pub async fn serve_reads(&self, eng: &Engine) {
        let Some(ms) = &self.multishot else { return };
        let fd = Fd::Raw(self.fd.as_raw_fd());
        let end = 'arm: loop {
            poll_fn(|_| {
                if ms.provided.get() > 0 || self.stopping.get() {
                    Poll::Ready(())
                } else {
                    ms.reader.set(eng.current_task());
                    Poll::Pending
                }
            })
            .await;
            if self.stopping.get() {
                break ReaderEnd::Stopped;
            }
            let cap = ms.slots.borrow().len() + 1;
            let Some(mut op) = eng.read_multishot(fd, ms.group, cap) else {
                break ReaderEnd::Failed(libc::EBUSY);
            };
            while let Some(c) = op.completion().await {
                if c.res > 0 {
                    let n = c.res as usize;
                    // The kernel must name a buffer it was given, and fill no more than it offered;
                    // otherwise nothing it says can be trusted any more.
                    let Some(win) = c.buf.filter(|w| n <= w.len()) else {
                        break 'arm ReaderEnd::Failed(libc::EPROTO);
                    };
                    let buf = win.into_inner();
                    let mut slots = ms.slots.borrow_mut();
                    let Some(s) = slots.get_mut(usize::from(buf.index())) else {
                        break 'arm ReaderEnd::Failed(libc::EPROTO);
                    };
                    s.filled = Some((buf, n));
                    ms.provided.set(ms.provided.get().saturating_sub(1));
                    if let Some(t) = s.task.take() {
                        eng.wake(t);
                    }
                    continue;
                }
                if c.named.is_some() && c.buf.is_none() {
                    break 'arm ReaderEnd::Failed(libc::EPROTO);
                }
                match -c.res {
                    // ECONNABORTED: the connection ended while a request was being read.
                    0 | libc::ENODEV | libc::ECONNABORTED => break 'arm ReaderEnd::Gone,
                    // Out of buffers (all requests in service), interrupted or cancelled: re-arm
                    // once a buffer is back (the loop checks for a stop first).
                    libc::ENOBUFS | libc::EAGAIN | libc::EINTR | libc::ECANCELED => {}
                    e => break 'arm ReaderEnd::Failed(e),
                }
            }
        };
        ms.end.set(Some(end));
        for s in ms.slots.borrow_mut().iter_mut() {
            if let Some(t) = s.task.take() {
                eng.wake(t);
            }
        }
    }

    async fn next_multishot(
        &self,
        eng: &Engine,
        ms: &Multishot,
        buf: Buf,
    ) -> Result<ReadOutcome, TransportError> {
        let i = usize::from(buf.index());
        if i >= ms.slots.borrow().len() {
            return Err(TransportError::Io(std::io::Error::other(
                "slot buffer outside the provided-buffer ring",
            )));
        }
        if ms.end.get().is_none() {
            let win = buf.slice(self.layout.request..usize::MAX);
            if eng.provide(win).is_err() {
                return Err(TransportError::Io(std::io::Error::other(
                    "slot buffer already provided",
                )));
            }
            eng.publish_buffers();
            ms.provided.set(ms.provided.get() + 1);
            if let Some(r) = ms.reader.take() {
                eng.wake(r);
            }
        }
        poll_fn(|_| {
            let mut slots = ms.slots.borrow_mut();
            let s = &mut slots[i];
            if let Some((buf, n)) = s.filled.take() {
                return Poll::Ready(Ok(ReadOutcome::Request(buf, n)));
            }
            if let Some(end) = ms.end.get() {
                return Poll::Ready(match end {
                    ReaderEnd::Stopped => Ok(ReadOutcome::Stopped),
                    ReaderEnd::Gone => Ok(ReadOutcome::Gone),
                    ReaderEnd::Failed(e) => Err(io_err(e)),
                });
            }
            s.task = eng.current_task();
            Poll::Pending
        })
        .await
    }

    /// The buffer layout requests use.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The fd this queue serves.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Waits for the next request and reads it into `buf` at `layout.request`. The buffer comes
    /// back with the request; when the queue stops or the connection is gone it may stay with
    /// the engine (lent to the kernel), which returns it to the pool.
    pub async fn next_request(
        &self,
        eng: &Engine,
        buf: Buf,
    ) -> Result<ReadOutcome, TransportError> {
        if let Some(ms) = &self.multishot {
            return self.next_multishot(eng, ms, buf).await;
        }
        let fd = Fd::Raw(self.fd.as_raw_fd());
        let mut buf = buf;
        loop {
            self.permit.acquire(eng).await;
            if self.stopping.get() {
                self.permit.release(eng);
                return Ok(ReadOutcome::Stopped);
            }
            let win = buf.slice(self.layout.request..usize::MAX);
            let (res, win) = eng.poll_read(fd, win).await;
            self.permit.release(eng);
            buf = win.into_inner();
            match res {
                Ok(0) => return Ok(ReadOutcome::Gone),
                Ok(n) => return Ok(ReadOutcome::Request(buf, n)),
                Err(e) => match e.raw_os_error().unwrap_or(libc::EIO) {
                    libc::ENODEV | libc::ECONNABORTED => return Ok(ReadOutcome::Gone),
                    libc::EAGAIN | libc::EINTR | libc::ECANCELED | libc::ENOENT | libc::EBUSY => {
                        continue
                    }
                    _ => return Err(TransportError::Io(e)),
                },
            }
        }
    }

    /// Writes a reply of `len` bytes (out header included) from `buf[layout.reply..]` to the fd.
    /// A reply the kernel no longer waits for (the request was interrupted, or the connection
    /// aborted) is not an error.
    pub async fn send_reply(
        &self,
        eng: &Engine,
        buf: Buf,
        len: usize,
    ) -> (Result<(), TransportError>, Buf) {
        let start = self.layout.reply;
        let fd = Fd::Raw(self.fd.as_raw_fd());
        // /dev/fuse takes only user memory: a plain WRITE, never WRITE_FIXED.
        let (res, win) = eng
            .write_plain(fd, buf.slice(start..start + len), AT_CURSOR)
            .await;
        let r = match res {
            Ok(_) => Ok(()),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ENOENT | libc::ENODEV | libc::ECONNABORTED | libc::ECANCELED)
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(TransportError::Io(e)),
        };
        (r, win.into_inner())
    }

    /// Stops taking requests: cancels the pending read and lets waiting readers see the flag.
    pub fn stop(&self, eng: &Engine) {
        self.stopping.set(true);
        eng.cancel_all_on(Fd::Raw(self.fd.as_raw_fd()));
        self.permit.wake_all(eng);
        if let Some(r) = self.multishot.as_ref().and_then(|m| m.reader.take()) {
            eng.wake(r);
        }
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
