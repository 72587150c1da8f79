//! I/O on memory the caller only borrows, on the engine running on this thread.
//!
//! Image-format libraries (imago) hand their storage layer `&mut [u8]`/`&[u8]` windows and call it
//! through a trait that carries no engine: a request's data window, a metadata table of the
//! library's own. Copying every window into an engine buffer would cost a copy per request, so
//! these operations lend the borrowed memory to the kernel directly and keep the borrow sound the
//! other way round: a future that still has an operation in flight **waits for its completion when
//! dropped** (it turns this thread's ring until the kernel is done), so the memory is never
//! released while the kernel may write it.
//!
//! That makes leaking such a future (`mem::forget`, an `Rc` cycle) the one thing that could break
//! it, hence the `unsafe` constructors: their callers promise to await or drop what they get.
//! fusex's tasks are always dropped, never forgotten (see `Engine`'s `Drop`).
//!
//! The engine is found through a thread-local set while it runs tasks ([`Engine::run`],
//! [`Engine::block_on`]) or drops them; [`in_engine`] says whether there is one, so a caller can
//! fall back to plain system calls elsewhere (opening an image before any queue runs).

use std::future::Future;
use std::io;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll};

use io_uring::{opcode, types};

use crate::executor::{current_engine, Engine};
use crate::op::{OpState, Owned};
use crate::ops::{bytes, len32, with_fd};
use crate::{Fd, Sqe};

/// Whether this thread is running an engine right now (so the functions here have a ring).
pub fn in_engine() -> bool {
    !current_engine().is_null()
}

/// Requests in service on this thread's engine (see [`Engine::load_enter`]); 0 outside an engine.
pub fn current_load() -> u32 {
    let eng = current_engine();
    if eng.is_null() {
        return 0;
    }
    // SAFETY: non-null `current_engine` names a live engine borrowed on this thread.
    unsafe { &*eng }.load()
}

/// A ring operation on memory borrowed for `'a`; resolves to bytes transferred or the error.
///
/// It is submitted when first polled, on the engine running on the polling thread (so it can be
/// built anywhere, e.g. before `block_on`). Dropping it while the operation is in flight cancels
/// the operation and waits for its completion on that ring (other completions that arrive
/// meanwhile are recorded as usual). For regular files and block devices that wait is bounded by
/// the device.
#[must_use = "a borrowed-memory operation does nothing unless awaited"]
pub struct BorrowedIo<'a> {
    engine: *const Engine,
    spec: Option<Spec>,
    state: OpState,
    _mem: PhantomData<&'a mut [u8]>,
}

/// What to submit on first poll. Pointers stay valid for the future's `'a`.
enum Spec {
    Read {
        fd: Fd,
        ptr: *mut u8,
        len: u32,
        off: u64,
    },
    Write {
        fd: Fd,
        ptr: *const u8,
        len: u32,
        off: u64,
    },
    Fsync {
        fd: Fd,
        datasync: bool,
    },
    Fallocate {
        fd: Fd,
        mode: i32,
        off: u64,
        len: u64,
    },
}

impl Spec {
    fn sqe(&self, e: &Engine) -> Sqe {
        match *self {
            Spec::Read { fd, ptr, len, off } => {
                with_fd!(e.target(fd), |f| opcode::Read::new(f, ptr, len)
                    .offset(off)
                    .build()
                    .into())
            }
            Spec::Write { fd, ptr, len, off } => {
                with_fd!(e.target(fd), |f| opcode::Write::new(f, ptr, len)
                    .offset(off)
                    .build()
                    .into())
            }
            Spec::Fsync { fd, datasync } => {
                let flags = if datasync {
                    types::FsyncFlags::DATASYNC
                } else {
                    types::FsyncFlags::empty()
                };
                with_fd!(e.target(fd), |f| opcode::Fsync::new(f)
                    .flags(flags)
                    .build()
                    .into())
            }
            Spec::Fallocate { fd, mode, off, len } => {
                with_fd!(e.target(fd), |f| opcode::Fallocate::new(f, len)
                    .offset(off)
                    .mode(mode)
                    .build()
                    .into())
            }
        }
    }
}

impl BorrowedIo<'_> {
    fn new<'a>(spec: Spec) -> BorrowedIo<'a> {
        BorrowedIo {
            engine: std::ptr::null(),
            spec: Some(spec),
            state: OpState::Finished,
            _mem: PhantomData,
        }
    }

    /// The engine this op was submitted on, checked to be the one running on this thread.
    fn engine(&self) -> &Engine {
        let cur = current_engine();
        if cur != self.engine {
            // The op can be neither awaited nor waited for from here, and its memory cannot be
            // released while the kernel may use it: stopping is the only sound choice.
            tracing::error!("a borrowed-memory operation was used outside its engine; aborting");
            std::process::abort();
        }
        // SAFETY: equal to `current_engine`, which is live while set (see `current_engine`).
        unsafe { &*cur }
    }
}

impl Future for BorrowedIo<'_> {
    type Output = io::Result<usize>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if let Some(spec) = self.spec.take() {
            let cur = current_engine();
            if cur.is_null() {
                return Poll::Ready(Err(io::Error::from_raw_os_error(libc::ENXIO)));
            }
            // SAFETY: non-null `current_engine` is live while set, on this thread.
            let e = unsafe { &*cur };
            let sqe = spec.sqe(e);
            // SAFETY: the entry's pointers are the borrowed memory, valid for 'a; the future is
            // not leaked (the constructors' contract) and its drop waits for the completion.
            let op = unsafe { e.start(sqe, Owned::None) };
            self.engine = cur;
            self.state = op.into_state();
        }
        match std::mem::replace(&mut self.state, OpState::Finished) {
            OpState::Pending(idx) => {
                let eng = self.engine();
                let mut ops = eng.ops.borrow_mut();
                if let Some((res, _)) = ops.take_done(idx) {
                    return Poll::Ready(bytes(res));
                }
                // Libraries poll these under combinators that re-poll only what its own waker
                // woke: register the waker, not just the task.
                ops.set_waker(idx, cx.waker());
                drop(ops);
                self.state = OpState::Pending(idx);
                Poll::Pending
            }
            OpState::Failed(res, _) => Poll::Ready(bytes(res)),
            OpState::Finished => Poll::Ready(Err(io::Error::from_raw_os_error(libc::EINVAL))),
        }
    }
}

impl Drop for BorrowedIo<'_> {
    fn drop(&mut self) {
        if let OpState::Pending(idx) = self.state {
            self.engine().wait_terminal(idx);
        }
    }
}

/// Reads into `buf` from `fd` at `off` on the polling thread's engine (short at end of file).
/// Fails with `ENXIO` when polled where no engine runs.
///
/// # Safety
/// The returned future must be awaited or dropped, never leaked while pending: its drop is what
/// keeps `buf` from being released while the kernel writes into it.
pub unsafe fn read(fd: Fd, buf: &mut [u8], off: u64) -> BorrowedIo<'_> {
    BorrowedIo::new(Spec::Read {
        fd,
        ptr: buf.as_mut_ptr(),
        len: len32(buf.len()),
        off,
    })
}

/// Writes `buf` to `fd` at `off` on the polling thread's engine (possibly short). Fails with
/// `ENXIO` when polled where no engine runs.
///
/// # Safety
/// As for [`read`]: the returned future must be awaited or dropped, never leaked while pending.
pub unsafe fn write(fd: Fd, buf: &[u8], off: u64) -> BorrowedIo<'_> {
    BorrowedIo::new(Spec::Write {
        fd,
        ptr: buf.as_ptr(),
        len: len32(buf.len()),
        off,
    })
}

/// `fsync(2)`/`fdatasync(2)` of `fd` on the polling thread's engine. Lends no memory.
pub fn fsync(fd: Fd, datasync: bool) -> BorrowedIo<'static> {
    BorrowedIo::new(Spec::Fsync { fd, datasync })
}

/// `fallocate(2)` with `mode` over `[off, off+len)` on the polling thread's engine. Lends no
/// memory.
pub fn fallocate(fd: Fd, mode: i32, off: u64, len: u64) -> BorrowedIo<'static> {
    BorrowedIo::new(Spec::Fallocate { fd, mode, off, len })
}
