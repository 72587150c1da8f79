//! Operations on borrowed memory (`engine::borrowed`): they run on the engine current on the
//! thread, wake the waker that polled them, and a dropped one waits for its completion before
//! the memory it borrowed can go away.

use std::future::{poll_fn, Future};
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::pin::pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use engine::{borrowed, Engine, EngineConfig, Fd};

fn engine() -> Engine {
    Engine::new(&EngineConfig::default()).unwrap()
}

#[test]
fn read_and_write_borrowed_memory() {
    let mut f = tempfile::tempfile().unwrap();
    f.write_all(&[7u8; 8192]).unwrap();
    let fd = Fd::Raw(f.as_raw_fd());
    let eng = engine();
    let mut buf = vec![0u8; 4096];
    // SAFETY: awaited to completion by block_on.
    let n = eng
        .block_on(unsafe { borrowed::read(fd, &mut buf, 100) })
        .unwrap()
        .unwrap();
    assert_eq!(n, 4096);
    assert!(buf.iter().all(|&b| b == 7));
    let data = vec![9u8; 1000];
    // SAFETY: as above.
    let n = eng
        .block_on(unsafe { borrowed::write(fd, &data, 8000) })
        .unwrap()
        .unwrap();
    assert_eq!(n, 1000);
    eng.block_on(borrowed::fsync(fd, true)).unwrap().unwrap();
    let mut back = vec![0u8; 1000];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut back, 8000).unwrap();
    assert_eq!(back, data);
    assert_eq!(f.metadata().unwrap().len(), 9000);
}

#[test]
fn without_an_engine_they_fail_with_enxio() {
    assert!(!borrowed::in_engine());
    let mut fut = pin!(borrowed::fsync(Fd::Raw(0), false));
    match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(Err(e)) => assert_eq!(e.raw_os_error(), Some(libc::ENXIO)),
        other => panic!("expected ENXIO, got {other:?}"),
    }
}

fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: fresh descriptors we own.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// A read that cannot complete (an empty pipe), dropped while pending: the drop cancels it and
/// returns only once the kernel is done, so nothing is in flight afterwards.
#[test]
fn dropping_a_pending_op_waits_for_its_completion() {
    let (r, _w) = pipe();
    let eng = Rc::new(engine());
    let e = eng.clone();
    eng.spawn(async move {
        let mut buf = vec![0u8; 64];
        {
            let rfd = Fd::Raw(r.as_raw_fd());
            // SAFETY: polled once, then dropped (never leaked); the drop waits.
            let op = unsafe { borrowed::read(rfd, &mut buf, u64::MAX) };
            let mut op = pin!(op);
            let pending = poll_fn(|cx| Poll::Ready(op.as_mut().poll(cx).is_pending())).await;
            assert!(pending, "an empty pipe has nothing to read");
            assert_eq!(e.in_flight(), 1);
        }
        assert_eq!(e.in_flight(), 0, "the drop waited for the cancelled read");
        buf.fill(1);
    });
    eng.run().unwrap();
}

/// Counts its wakeups and forwards them to the task that waits for one.
struct CountingWaker {
    count: AtomicUsize,
    parent: std::sync::Mutex<Option<Waker>>,
}

impl Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.count.fetch_add(1, Ordering::SeqCst);
        if let Some(w) = self.parent.lock().unwrap().take() {
            w.wake();
        }
    }
}

/// The completion wakes the waker that last polled the op (a combinator's per-future waker), not
/// only the task: `FuturesUnordered` re-polls just the futures whose own waker fired. The task
/// here is woken only through that waker.
#[test]
fn completion_wakes_the_polling_waker() {
    let (r, w) = pipe();
    let eng = engine();
    eng.spawn(async move {
        let sub = Arc::new(CountingWaker {
            count: AtomicUsize::new(0),
            parent: std::sync::Mutex::new(None),
        });
        let sub_waker = Waker::from(sub.clone());
        let mut buf = [0u8; 4];
        let res = {
            let rfd = Fd::Raw(r.as_raw_fd());
            // SAFETY: polled to completion below, never leaked.
            let op = unsafe { borrowed::read(rfd, &mut buf, u64::MAX) };
            let mut op = pin!(op);
            assert!(op
                .as_mut()
                .poll(&mut Context::from_waker(&sub_waker))
                .is_pending());
            // SAFETY: writes 4 bytes from a live array to the pipe.
            let wrote = unsafe { libc::write(w.as_raw_fd(), b"ping".as_ptr().cast(), 4) };
            assert_eq!(wrote, 4);
            poll_fn(|cx| {
                if sub.count.load(Ordering::SeqCst) > 0 {
                    return Poll::Ready(());
                }
                *sub.parent.lock().unwrap() = Some(cx.waker().clone());
                if sub.count.load(Ordering::SeqCst) > 0 {
                    return Poll::Ready(());
                }
                Poll::Pending
            })
            .await;
            op.as_mut().poll(&mut Context::from_waker(&sub_waker))
        };
        match res {
            Poll::Ready(Ok(4)) => {}
            other => panic!("expected 4 bytes, got {other:?}"),
        }
        assert_eq!(&buf, b"ping");
    });
    eng.run().unwrap();
}

/// Why these ops wait on drop instead of being orphaned as owned ops are: the kernel holds a
/// pointer into memory the future only borrows (a library's `&mut [u8]`), which its owner may free
/// or reuse the moment the future is gone. A file read the kernel has taken, dropped before its
/// completion was reaped, still lands in that memory, and it does so before the drop returns;
/// returning at once would let that write hit memory no longer lent to the kernel.
#[test]
fn a_dropped_read_the_kernel_took_fills_the_memory_before_the_drop_returns() {
    let mut f = tempfile::tempfile().unwrap();
    let data: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8 + 1).collect();
    f.write_all(&data).unwrap();
    let eng = Rc::new(engine());
    let e = eng.clone();
    eng.spawn(async move {
        let mut buf = vec![0u8; 4096];
        {
            // SAFETY: polled once, then dropped (never leaked); the drop waits.
            let op = unsafe { borrowed::read(Fd::Raw(f.as_raw_fd()), &mut buf, 0) };
            let mut op = pin!(op);
            let pending = poll_fn(|cx| Poll::Ready(op.as_mut().poll(cx).is_pending())).await;
            assert!(pending, "submitted, not yet reaped");
            assert_eq!(e.in_flight(), 1);
        }
        assert_eq!(e.in_flight(), 0, "the drop waited for the read");
        assert_eq!(
            buf, data,
            "the kernel wrote the borrowed memory during the drop"
        );
    });
    eng.run().unwrap();
}
