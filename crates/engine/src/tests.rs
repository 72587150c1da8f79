//! Engine tests against real files, pipes and threads. No test sleeps to synchronize: each waits
//! for the condition it needs (a message, the op table's count, a completion).

use std::cell::RefCell;
use std::future::Future;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crate::sync::Semaphore;
use crate::{Engine, EngineConfig, Fd, AT_CURSOR};

fn engine(buffers: usize, register: bool) -> Rc<Engine> {
    Rc::new(
        Engine::new(&EngineConfig {
            buffers,
            buffer_size: 8192,
            register_buffers: register,
            ..Default::default()
        })
        .expect("io_uring available"),
    )
}

pub(crate) fn nonblocking(fd: &impl AsRawFd) {
    // SAFETY: fcntl on a valid fd with integer arguments.
    unsafe {
        let fl = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK);
    }
}

/// Polls `fut` once with a no-op waker (it stays pending on a ring op).
pub(crate) fn poll_once<F: Future + ?Sized>(fut: Pin<&mut F>) -> Poll<F::Output> {
    fut.poll(&mut Context::from_waker(Waker::noop()))
}

#[test]
fn reads_and_writes_a_file_through_pool_buffers_plain_and_fixed() {
    let mut f = tempfile::tempfile().unwrap();
    let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
    f.write_all(&data).unwrap();
    for register in [false, true] {
        let eng = engine(2, register);
        assert_eq!(eng.buffers_registered(), register);
        let buf = eng.take_buffer().unwrap();
        let fd = Fd::Raw(f.as_raw_fd());
        let (n, win) = eng.block_on(eng.read(fd, buf.slice(100..5100), 3)).unwrap();
        assert_eq!(n.unwrap(), 5000);
        assert_eq!(win.as_slice(), &data[3..5003]);
        // Write the window back elsewhere and read it from the file.
        let (n, win) = eng.block_on(eng.write(fd, win, 20_000)).unwrap();
        assert_eq!(n.unwrap(), 5000);
        let mut back = vec![0u8; 5000];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut back, 20_000).unwrap();
        assert_eq!(back, &data[3..5003]);
        drop(win);
        eng.block_on(eng.fsync(fd, true)).unwrap().unwrap();
    }
}

/// A registered pool is registered buffer by buffer, each at its first fixed operation: the
/// buffers no operation used are neither registered (pinned) nor resident.
#[test]
fn buffers_are_registered_and_resident_only_once_used() {
    let mut f = tempfile::tempfile().unwrap();
    f.write_all(&[7u8; 8192]).unwrap();
    let eng = engine(4, true);
    assert!(eng.buffers_registered());
    let used = eng.take_buffer().unwrap();
    let idle = eng.take_buffer().unwrap();
    assert!(!eng.pool.fixed(used.index()) && !eng.pool.fixed(idle.index()));
    let resident = |b: &crate::Buf| {
        let mut vec = [0u8; 2];
        // SAFETY: mincore reads the residency of the buffer's own (page-aligned) pages into
        // `vec`, one byte per page, and the buffer is 2 pages.
        let r = unsafe {
            libc::mincore(
                b.as_slice().as_ptr() as *mut libc::c_void,
                8192,
                vec.as_mut_ptr(),
            )
        };
        assert_eq!(r, 0);
        vec.iter().filter(|v| **v & 1 != 0).count()
    };
    assert_eq!(resident(&idle), 0, "an unused buffer takes no memory");
    let fd = Fd::Raw(f.as_raw_fd());
    let (n, win) = eng.block_on(eng.read(fd, used.slice(0..8192), 0)).unwrap();
    assert_eq!(n.unwrap(), 8192);
    assert_eq!(win.as_slice(), &[7u8; 8192]);
    assert!(
        eng.pool.fixed(win.buf().index()),
        "registered at its first use"
    );
    assert!(!eng.pool.fixed(idle.index()));
    assert_eq!(resident(&idle), 0);
}

#[test]
fn buffers_are_owned_once_and_return_to_the_pool() {
    let eng = engine(2, false);
    let a = eng.take_buffer().unwrap();
    let b = eng.take_buffer().unwrap();
    assert_ne!(a.index(), b.index());
    assert!(
        eng.take_buffer().is_none(),
        "each buffer is handed out once"
    );
    drop(a);
    assert_eq!(eng.buffers_available(), 1);
    let c = eng.take_buffer().unwrap();
    assert_eq!(c.len(), 8192);
    assert_eq!(c.addr() % crate::BUF_ALIGN, 0, "page aligned");
}

#[test]
fn a_buffer_kept_past_its_engine_keeps_its_memory() {
    let eng = engine(1, true);
    let watch = eng.pool_watch();
    let mut buf = eng.take_buffer().unwrap();
    buf.as_mut_slice()[..4].copy_from_slice(b"live");
    drop(eng);
    assert!(watch.alive(), "the buffer still owns the pool's memory");
    assert_eq!(&buf.as_slice()[..4], b"live");
    drop(buf);
    assert!(!watch.alive(), "the last owner frees it");
}

#[test]
fn many_tasks_run_concurrently_and_finish() {
    let eng = engine(8, false);
    let got = Rc::new(RefCell::new(Vec::new()));
    let (r, w) = std::io::pipe().unwrap();
    let rfd = Fd::Raw(r.as_raw_fd());
    // 8 tasks each wait for one byte of the pipe; all are in flight before any byte exists.
    for _ in 0..8 {
        let (eng2, got) = (eng.clone(), got.clone());
        eng.spawn(async move {
            let buf = eng2.take_buffer().unwrap();
            let (n, win) = eng2.read(rfd, buf.slice(0..1), AT_CURSOR).await;
            assert_eq!(n.unwrap(), 1);
            got.borrow_mut().push(win.as_slice()[0]);
        });
    }
    // Spawned after the readers, so polled after each has submitted its read.
    let eng2 = eng.clone();
    eng.spawn(async move {
        assert_eq!(
            eng2.in_flight(),
            8,
            "every read is in flight before any byte"
        );
        let mut w = w;
        w.write_all(b"abcdefgh").unwrap();
    });
    eng.run().unwrap();
    let mut got = got.borrow().clone();
    got.sort();
    assert_eq!(got, b"abcdefgh");
    assert_eq!(eng.buffers_available(), 8);
}

#[test]
fn remote_wake_from_another_thread() {
    let eng = engine(0, false);
    let flag = Arc::new(AtomicBool::new(false));
    let f2 = flag.clone();
    let (pending_tx, pending_rx) = mpsc::channel();
    let task = eng.spawn(async move {
        std::future::poll_fn(|_| {
            if f2.load(Ordering::Acquire) {
                Poll::Ready(())
            } else {
                let _ = pending_tx.send(());
                Poll::Pending
            }
        })
        .await
    });
    let remote = eng.remote();
    let t = std::thread::spawn(move || {
        // Only once the task is parked: then only the remote wakeup can finish it.
        pending_rx.recv().unwrap();
        flag.store(true, Ordering::Release);
        remote.wake(task);
    });
    eng.run().unwrap();
    t.join().unwrap();
}

#[test]
fn semaphore_admits_one_at_a_time_in_order() {
    let eng = engine(3, false);
    let sem = Rc::new(Semaphore::new(1, 4));
    let log = Rc::new(RefCell::new(Vec::new()));
    let (r, mut w) = std::io::pipe().unwrap();
    let rfd = Fd::Raw(r.as_raw_fd());
    for i in 0..3 {
        let (eng2, sem, log) = (eng.clone(), sem.clone(), log.clone());
        eng.spawn(async move {
            sem.acquire(&eng2).await;
            log.borrow_mut().push(i);
            let buf = eng2.take_buffer().unwrap();
            let (n, _) = eng2.read(rfd, buf.slice(0..1), AT_CURSOR).await;
            assert_eq!(n.unwrap(), 1);
            log.borrow_mut().push(i + 10);
            sem.release(&eng2);
        });
    }
    w.write_all(b"xyz").unwrap();
    eng.run().unwrap();
    assert_eq!(*log.borrow(), vec![0, 10, 1, 11, 2, 12]);
}

/// Dropping a pending op does not wait: the op is orphaned, its buffer stays with the engine
/// until the cancellation's completion, then returns to the pool.
#[test]
fn dropping_a_pending_op_orphans_it_without_blocking() {
    let eng = engine(1, false);
    let (r, mut w) = std::io::pipe().unwrap();
    let buf = eng.take_buffer().unwrap();
    {
        let fut = eng.read(Fd::Raw(r.as_raw_fd()), buf.slice(0..8), AT_CURSOR);
        let mut fut = std::pin::pin!(fut);
        assert!(poll_once(fut.as_mut()).is_pending());
        assert_eq!(eng.in_flight(), 1);
    } // dropped here: returns at once
    assert_eq!(eng.in_flight(), 1, "the kernel still has the read");
    assert_eq!(eng.buffers_available(), 0, "the op table keeps the buffer");
    // Let the ring run until the cancellation completes.
    eng.block_on(async {
        while eng.in_flight() > 0 {
            eng.sleep(Duration::from_millis(1)).await;
        }
    })
    .unwrap();
    assert_eq!(eng.buffers_available(), 1, "back once the kernel let go");
    // The pipe's data was not consumed by the orphaned read.
    w.write_all(b"z").unwrap();
    let buf = eng.take_buffer().unwrap();
    let (n, win) = eng
        .block_on(eng.read(Fd::Raw(r.as_raw_fd()), buf.slice(0..8), AT_CURSOR))
        .unwrap();
    assert_eq!(n.unwrap(), 1);
    assert_eq!(win.as_slice()[0], b'z');
}

/// An engine dropped with operations in flight cancels them and waits (bounded) for the kernel;
/// the pool is freed only once nothing is in flight.
#[test]
fn engine_drop_with_ops_in_flight_frees_only_what_the_kernel_let_go() {
    let (r, _w) = std::io::pipe().unwrap();
    let rfd = Fd::Raw(r.as_raw_fd());
    let eng = Engine::new(&EngineConfig {
        buffers: 2,
        buffer_size: 4096,
        register_buffers: true,
        ..Default::default()
    })
    .unwrap();
    let watch = eng.pool_watch();
    let buf = eng.take_buffer().unwrap();
    let mut fut = Box::pin(eng.read(rfd, buf.slice(0..8), AT_CURSOR));
    assert!(poll_once(fut.as_mut()).is_pending());
    // Forgetting the future (safe code may) leaves the op to the engine: its buffer is in the
    // op table, not in the forgotten future.
    std::mem::forget(fut);
    assert_eq!(eng.in_flight(), 1);
    drop(eng);
    assert!(
        !watch.alive(),
        "the read was cancelled, so the pool could be freed"
    );

    // Same, but the engine may not wait: it must leak the memory rather than free it.
    let eng = Engine::new(&EngineConfig {
        buffers: 1,
        buffer_size: 4096,
        drop_wait: Duration::ZERO,
        ..Default::default()
    })
    .unwrap();
    let watch = eng.pool_watch();
    let buf = eng.take_buffer().unwrap();
    {
        let fut = eng.read(rfd, buf.slice(0..8), AT_CURSOR);
        let mut fut = std::pin::pin!(fut);
        assert!(poll_once(fut.as_mut()).is_pending());
    } // the future goes first, orphaning the read; then the engine
    drop(eng);
    assert!(
        watch.alive(),
        "a read the kernel may still complete keeps its memory"
    );
}

#[test]
fn sleep_runs_on_the_ring() {
    let eng = engine(0, false);
    let t = std::time::Instant::now();
    eng.block_on(eng.sleep(Duration::from_millis(5))).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(5));
}

#[test]
fn uring_cmd_refuses_iovecs_outside_its_buffer() {
    let eng = engine(1, false);
    let buf = eng.take_buffer().unwrap();
    let len = buf.len();
    #[allow(clippy::single_range_in_vec_init)]
    let segs = [0..len + 1];
    let (res, buf) = eng
        .block_on(eng.uring_cmd(Fd::Raw(-1), 0, [0; 80], buf, Some((512, &segs))))
        .unwrap();
    assert_eq!(res.unwrap_err().raw_os_error(), Some(libc::EINVAL));
    assert_eq!(eng.in_flight(), 0, "nothing was submitted");
    #[allow(clippy::single_range_in_vec_init)]
    let segs = [0..16];
    let (res, _) = eng
        .block_on(eng.uring_cmd(Fd::Raw(-1), 0, [0; 80], buf, Some((len - 8, &segs))))
        .unwrap();
    assert_eq!(res.unwrap_err().raw_os_error(), Some(libc::EINVAL));
}

/// A multishot read on a pipe fills provided windows one completion each, hands each window back,
/// ends with ENOBUFS when none is left, and a dropped op is orphaned.
#[test]
fn multishot_read_fills_provided_buffers() {
    let eng = Rc::new(
        Engine::new(&EngineConfig {
            buffers: 2,
            buffer_size: 4096,
            provided_buffers: true,
            ..Default::default()
        })
        .expect("io_uring available"),
    );
    assert!(
        eng.can_read_multishot(),
        "Linux 6.7+ has READ_MULTISHOT and provided-buffer rings"
    );
    let group = eng.buf_group().unwrap();
    let (r, mut w) = std::io::pipe().unwrap();
    nonblocking(&r);
    let rfd = Fd::Raw(r.as_raw_fd());
    let b0 = eng.take_buffer().unwrap();
    let b1 = eng.take_buffer().unwrap();
    eng.provide(b0.slice(0..4096)).unwrap();
    eng.provide(b1.slice(0..4096)).unwrap();
    eng.publish_buffers();
    let got = eng
        .block_on(async {
            let mut op = eng.read_multishot(rfd, group, 3).unwrap();
            let mut got = Vec::new();
            w.write_all(b"first").unwrap();
            got.push(op.completion().await.unwrap());
            w.write_all(b"second").unwrap();
            got.push(op.completion().await.unwrap());
            // Both buffers are used: the next read ends the op with ENOBUFS.
            w.write_all(b"third").unwrap();
            got.push(op.completion().await.unwrap());
            assert!(op.completion().await.is_none());
            got
        })
        .unwrap();
    assert_eq!((got[0].res, got[0].named, got[0].more), (5, Some(0), true));
    assert_eq!(&got[0].buf.as_ref().unwrap().as_slice()[..5], b"first");
    assert_eq!((got[1].res, got[1].named, got[1].more), (6, Some(1), true));
    assert_eq!(&got[1].buf.as_ref().unwrap().as_slice()[..6], b"second");
    assert_eq!((got[2].res, got[2].more), (-libc::ENOBUFS, false));
    assert!(got[2].buf.is_none());

    // Give one window back; a new op reads what is waiting; dropping it orphans it.
    let mut got = got;
    let w0 = got.remove(0).buf.unwrap();
    assert!(
        eng.provide(got[0].buf.take().unwrap()).is_ok(),
        "buffer 1 is free to lend again"
    );
    drop(w0);
    eng.publish_buffers();
    let c = eng
        .block_on(async {
            let mut op = eng.read_multishot(rfd, group, 2).unwrap();
            op.completion().await.unwrap()
        })
        .unwrap();
    assert_eq!((c.res, c.named, c.more), (5, Some(1), true));
    assert_eq!(&c.buf.unwrap().as_slice()[..5], b"third");
    // The orphaned op ends (cancelled) without anyone waiting for it.
    eng.block_on(async {
        while eng.in_flight() > 0 {
            eng.sleep(Duration::from_millis(1)).await;
        }
    })
    .unwrap();
}

/// A registered file is named by index, transparently: the same ops, the same bytes.
#[test]
fn registered_files_are_used_transparently() {
    let mut f = tempfile::tempfile().unwrap();
    f.write_all(b"fixed files work").unwrap();
    let eng = engine(1, true);
    eng.register_files(&[f.as_raw_fd()]).unwrap();
    assert_eq!(eng.target(Fd::Raw(f.as_raw_fd())), Fd::Fixed(0));
    assert_eq!(eng.target(Fd::Raw(0)), Fd::Raw(0), "others stay plain");
    let buf = eng.take_buffer().unwrap();
    let (n, win) = eng
        .block_on(eng.read(Fd::Raw(f.as_raw_fd()), buf.slice(0..16), 0))
        .unwrap();
    assert_eq!(n.unwrap(), 16);
    assert_eq!(win.as_slice(), b"fixed files work");
    // A second registration (another tenant of the same file) is counted, not refused.
    eng.register_files(&[f.as_raw_fd()]).unwrap();
    assert_eq!(eng.file_refs(f.as_raw_fd()), 2);
    assert_eq!(eng.target(Fd::Raw(f.as_raw_fd())), Fd::Fixed(0));
}

#[test]
fn engine_errors_print_the_os_error_once() {
    for e in [
        crate::EngineError::Setup(std::io::Error::from_raw_os_error(libc::EPERM)),
        crate::EngineError::Register(std::io::Error::from_raw_os_error(libc::EPERM)),
        crate::EngineError::Enter(std::io::Error::from_raw_os_error(libc::EPERM)),
    ] {
        // The binary prints the message and then every source().
        assert!(std::error::Error::source(&e).is_none(), "{e}");
        assert_eq!(e.to_string().matches("(os error 1)").count(), 1, "{e}");
    }
}

/// A buffer of one engine's registered pool, sent to another thread, is read into and written
/// from by that thread's engine by address (its fixed-buffer index means nothing on that ring),
/// and its memory outlives the engine that made it.
#[test]
fn a_buffer_sent_to_another_thread_works_on_that_threads_ring() {
    let mut f = tempfile::tempfile().unwrap();
    let data: Vec<u8> = (0..10_000u32).map(|i| (i * 13 % 251) as u8).collect();
    f.write_all(&data).unwrap();
    let raw = f.as_raw_fd();
    let home = engine(2, true);
    assert!(home.buffers_registered());
    let watch = home.pool_watch();
    // The other thread's pool is registered too, at the same indexes: a fixed READ by index
    // would land in the wrong memory there.
    let (tx, rx) = mpsc::channel();
    let sent = home.take_buffer().unwrap().into_send();
    drop(home);
    let t = std::thread::spawn(move || {
        let other = engine(2, true);
        let buf = sent.into_buf();
        let fd = Fd::Raw(raw);
        let (n, win) = other
            .block_on(other.read(fd, buf.slice(0..4000), 10))
            .unwrap();
        assert_eq!(n.unwrap(), 4000);
        let (n, win) = other.block_on(other.write(fd, win, 30_000)).unwrap();
        assert_eq!(n.unwrap(), 4000);
        tx.send(win.into_inner().into_send()).unwrap();
    });
    t.join().unwrap();
    let back = rx.recv().unwrap().into_buf();
    assert_eq!(&back.as_slice()[..4000], &data[10..4010]);
    let mut on_disk = vec![0u8; 4000];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut on_disk, 30_000).unwrap();
    assert_eq!(on_disk, &data[10..4010]);
    // The engine that made it is gone; the buffer kept the memory alive until now.
    assert!(watch.alive());
    drop(back);
    assert!(!watch.alive());
}

#[test]
fn the_gauge_dates_the_last_turn_that_counted_local_work() {
    let eng = engine(0, false);
    let gauge = eng.gauge();
    let now = crate::gauge_clock();
    // Never counted any: as old as the clock.
    assert_eq!(gauge.local_age(now), now);
    eng.note_local();
    eng.block_on(eng.sleep(Duration::from_millis(1))).unwrap();
    let now = crate::gauge_clock();
    let stamped = now - gauge.local_age(now);
    assert!(stamped > 0);
    // Turns without local work leave the date where it was.
    eng.block_on(eng.sleep(Duration::from_millis(2))).unwrap();
    let now = crate::gauge_clock();
    assert!(gauge.local_age(now) >= 2_000);
    assert_eq!(now - gauge.local_age(now), stamped);
}

/// A state that owns the engine, held by the engine's own tasks, is a cycle: after a failed
/// `run` nothing would ever free the ring, its fds or its buffers. `drop_tasks` breaks it, and the
/// engine stays usable for its drop (a later `run` has nothing to do).
#[test]
fn drop_tasks_breaks_a_cycle_through_the_engine() {
    struct Owner {
        eng: Engine,
        dropped: Arc<AtomicBool>,
    }
    impl Drop for Owner {
        fn drop(&mut self) {
            self.dropped.store(true, Ordering::SeqCst);
        }
    }
    let dropped = Arc::new(AtomicBool::new(false));
    let owner = Rc::new(Owner {
        eng: Engine::new(&EngineConfig {
            buffers: 1,
            buffer_size: 4096,
            ..Default::default()
        })
        .unwrap(),
        dropped: dropped.clone(),
    });
    let (r, _w) = std::io::pipe().unwrap();
    let buf = owner.eng.take_buffer().unwrap();
    let held = owner.clone();
    // Never finishes: waits on an empty pipe, holding the owner.
    owner.eng.spawn(async move {
        let _ = held
            .eng
            .read(Fd::Raw(r.as_raw_fd()), buf.slice(0..8), AT_CURSOR)
            .await;
        drop(held);
    });
    // One turn submits the read; then the task waits for good.
    owner.eng.block_on(async {}).unwrap();
    owner.eng.drop_tasks();
    assert!(!dropped.load(Ordering::SeqCst), "our own Rc still holds it");
    owner.eng.run().unwrap();
    drop(owner);
    assert!(dropped.load(Ordering::SeqCst), "the cycle is broken");
}

/// A directory descriptor of `dir` for the `*at` ops.
fn dir_fd(dir: &std::path::Path) -> std::fs::File {
    std::fs::File::open(dir).unwrap()
}

#[test]
fn statx_matches_std_metadata() {
    use std::os::unix::fs::MetadataExt;
    let eng = engine(1, false);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("f"), b"12345").unwrap();
    std::os::unix::fs::symlink("f", dir.path().join("l")).unwrap();
    let d = dir_fd(dir.path());
    let (fd, mask) = (d.as_raw_fd(), libc::STATX_BASIC_STATS);
    let sx = eng
        .block_on(eng.statx(fd, c"f", libc::AT_SYMLINK_NOFOLLOW, mask))
        .unwrap()
        .unwrap();
    let m = std::fs::symlink_metadata(dir.path().join("f")).unwrap();
    assert_eq!((sx.stx_ino, sx.stx_size), (m.ino(), m.len()));
    assert_eq!(u32::from(sx.stx_mode), m.mode());
    // Not following the final symlink: the link's own inode.
    let sx = eng
        .block_on(eng.statx(fd, c"l", libc::AT_SYMLINK_NOFOLLOW, mask))
        .unwrap()
        .unwrap();
    let m = std::fs::symlink_metadata(dir.path().join("l")).unwrap();
    assert_eq!(sx.stx_ino, m.ino());
    assert_eq!(u32::from(sx.stx_mode) & libc::S_IFMT, libc::S_IFLNK);
    // The descriptor's own inode with an empty path.
    let sx = eng
        .block_on(eng.statx(fd, c"", libc::AT_EMPTY_PATH, mask))
        .unwrap()
        .unwrap();
    assert_eq!(sx.stx_ino, std::fs::metadata(dir.path()).unwrap().ino());
    let e = eng
        .block_on(eng.statx(fd, c"missing", 0, mask))
        .unwrap()
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
}

#[test]
fn openat_opens_like_std() {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let eng = engine(1, false);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("f"), b"hello").unwrap();
    let d = dir_fd(dir.path());
    for punted in [false, true] {
        let flags = libc::O_RDONLY | libc::O_CLOEXEC;
        let fd = if punted {
            eng.block_on(eng.openat_punted(d.as_raw_fd(), c"f", flags, 0))
        } else {
            eng.block_on(eng.openat(d.as_raw_fd(), c"f", flags, 0))
        }
        .unwrap()
        .unwrap();
        let mut f = std::fs::File::from(fd);
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        assert_eq!(s, "hello");
        let m = std::fs::metadata(dir.path().join("f")).unwrap();
        assert_eq!(f.metadata().unwrap().ino(), m.ino());
    }
    // Creation with a mode, and errors as errnos.
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC;
    let fd = eng
        .block_on(eng.openat(d.as_raw_fd(), c"new", flags, 0o600))
        .unwrap()
        .unwrap();
    drop(fd);
    assert!(dir.path().join("new").is_file());
    let e = eng
        .block_on(eng.openat(d.as_raw_fd(), c"new", flags, 0o600))
        .unwrap()
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EEXIST));
}

/// An open whose future is dropped once the kernel opened the file, but before the future took
/// the descriptor, leaks nothing: the table closes it. (Dropped earlier, the open is cancelled
/// or its completion closed the same way.)
#[test]
fn an_abandoned_openat_closes_its_descriptor() {
    let eng = engine(1, false);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("f"), b"x").unwrap();
    let d = dir_fd(dir.path());
    // Descriptors of this test's file (other tests run in this process meanwhile).
    let file = dir.path().join("f");
    let count = || {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|p| *p == file)
            .count()
    };
    let before = count();
    for punted in [false, true] {
        let mut fut = if punted {
            Box::pin(eng.openat_punted(d.as_raw_fd(), c"f", libc::O_RDONLY, 0))
                as Pin<Box<dyn Future<Output = std::io::Result<std::os::fd::OwnedFd>>>>
        } else {
            Box::pin(eng.openat(d.as_raw_fd(), c"f", libc::O_RDONLY, 0))
        };
        assert!(poll_once(fut.as_mut()).is_pending());
        // Drive the ring (not the future) until the open completed.
        while eng.in_flight() > 0 {
            eng.block_on(eng.sleep(Duration::from_millis(1))).unwrap();
        }
        assert_eq!(count(), before + 1);
        drop(fut);
        assert_eq!(count(), before);
    }
}

/// Path operations reuse their memory: once the first of each kind ran, a thousand more (one
/// at a time, failed ones included) take nothing more from the allocator, and a path longer
/// than a name still works.
#[test]
fn path_ops_reuse_their_memory() {
    let eng = engine(1, false);
    let dir = tempfile::tempdir().unwrap();
    let d = dir_fd(dir.path());
    let fd = d.as_raw_fd();
    let round = |i: usize| {
        let name = std::ffi::CString::new(format!("f{i}")).unwrap();
        let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_CLOEXEC;
        drop(
            eng.block_on(eng.openat(fd, &name, flags, 0o600))
                .unwrap()
                .unwrap(),
        );
        let sx = eng
            .block_on(eng.statx(fd, &name, 0, libc::STATX_BASIC_STATS))
            .unwrap()
            .unwrap();
        assert_eq!(u32::from(sx.stx_mode) & libc::S_IFMT, libc::S_IFREG);
        eng.block_on(eng.renameat(fd, &name, fd, c"g", 0))
            .unwrap()
            .unwrap();
        eng.block_on(eng.linkat(fd, c"g", fd, c"h", 0))
            .unwrap()
            .unwrap();
        for n in [c"g", c"h"] {
            eng.block_on(eng.unlinkat(fd, n, 0)).unwrap().unwrap();
        }
        let e = eng
            .block_on(eng.statx(fd, c"missing", 0, libc::STATX_BASIC_STATS))
            .unwrap()
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
    };
    round(0);
    let warm = eng.scratch.made();
    assert!(warm > 0);
    for i in 1..1000 {
        round(i);
    }
    assert_eq!(
        eng.scratch.made(),
        warm,
        "a warm engine allocates no path memory"
    );
    // A path of more than 255 bytes: its own allocation, same answer.
    let sub = std::ffi::CString::new(format!("{}/{}", "x".repeat(250), "y".repeat(10))).unwrap();
    std::fs::create_dir(dir.path().join("x".repeat(250))).unwrap();
    std::fs::write(dir.path().join("x".repeat(250)).join("y".repeat(10)), b"12").unwrap();
    let sx = eng
        .block_on(eng.statx(fd, &sub, 0, libc::STATX_BASIC_STATS))
        .unwrap()
        .unwrap();
    assert_eq!(sx.stx_size, 2);
}

#[test]
fn unlinkat_removes_files_and_directories() {
    let eng = engine(1, false);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("f"), b"x").unwrap();
    std::fs::create_dir(dir.path().join("d")).unwrap();
    let d = dir_fd(dir.path());
    eng.block_on(eng.unlinkat(d.as_raw_fd(), c"f", 0))
        .unwrap()
        .unwrap();
    assert!(!dir.path().join("f").exists());
    let e = eng
        .block_on(eng.unlinkat(d.as_raw_fd(), c"d", 0))
        .unwrap()
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EISDIR));
    eng.block_on(eng.unlinkat(d.as_raw_fd(), c"d", libc::AT_REMOVEDIR))
        .unwrap()
        .unwrap();
    assert!(!dir.path().join("d").exists());
}

#[test]
fn renameat_renames_and_honours_flags() {
    let eng = engine(1, false);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a"), b"A").unwrap();
    std::fs::write(dir.path().join("b"), b"B").unwrap();
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    let d = dir_fd(dir.path());
    let sub = dir_fd(&dir.path().join("sub"));
    let e = eng
        .block_on(eng.renameat(
            d.as_raw_fd(),
            c"a",
            d.as_raw_fd(),
            c"b",
            libc::RENAME_NOREPLACE,
        ))
        .unwrap()
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EEXIST));
    eng.block_on(eng.renameat(
        d.as_raw_fd(),
        c"a",
        d.as_raw_fd(),
        c"b",
        libc::RENAME_EXCHANGE,
    ))
    .unwrap()
    .unwrap();
    assert_eq!(std::fs::read(dir.path().join("a")).unwrap(), b"B");
    assert_eq!(std::fs::read(dir.path().join("b")).unwrap(), b"A");
    eng.block_on(eng.renameat(d.as_raw_fd(), c"a", sub.as_raw_fd(), c"moved", 0))
        .unwrap()
        .unwrap();
    assert!(!dir.path().join("a").exists());
    assert_eq!(std::fs::read(dir.path().join("sub/moved")).unwrap(), b"B");
}

#[test]
fn linkat_links_the_same_inode() {
    use std::os::unix::fs::MetadataExt;
    let eng = engine(1, false);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("f"), b"x").unwrap();
    let d = dir_fd(dir.path());
    eng.block_on(eng.linkat(d.as_raw_fd(), c"f", d.as_raw_fd(), c"g", 0))
        .unwrap()
        .unwrap();
    let (f, g) = (
        std::fs::metadata(dir.path().join("f")).unwrap(),
        std::fs::metadata(dir.path().join("g")).unwrap(),
    );
    assert_eq!(f.ino(), g.ino());
    assert_eq!(g.nlink(), 2);
    let e = eng
        .block_on(eng.linkat(d.as_raw_fd(), c"f", d.as_raw_fd(), c"g", 0))
        .unwrap()
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EEXIST));
}

/// The opcode answers are the kernel's, for every opcode, from the first call and from the
/// cached probe after it.
#[test]
fn opcode_support_is_the_kernels_first_and_cached() {
    let eng = engine(1, false);
    let ring = io_uring::IoUring::new(2).unwrap();
    let mut probe = io_uring::Probe::new();
    ring.submitter().register_probe(&mut probe).unwrap();
    for _ in 0..2 {
        for op in 0..=u8::MAX {
            assert_eq!(
                eng.supports_opcode(op),
                probe.is_supported(op),
                "opcode {op}"
            );
        }
    }
    assert!(eng.supports_opcode(io_uring::opcode::Read::CODE));
    assert!(!eng.supports_opcode(u8::MAX));
}

#[test]
fn mkdirat_and_symlinkat_make_entries() {
    use std::os::unix::fs::PermissionsExt;
    let eng = engine(1, false);
    let dir = tempfile::tempdir().unwrap();
    let d = dir_fd(dir.path());
    let _held = eng.block_on(crate::umask::hold(&eng, 0)).unwrap().unwrap();
    eng.block_on(eng.mkdirat(d.as_raw_fd(), c"sub", 0o751))
        .unwrap()
        .unwrap();
    let m = std::fs::metadata(dir.path().join("sub")).unwrap();
    assert!(m.is_dir());
    assert_eq!(m.permissions().mode() & 0o7777, 0o751);
    let e = eng
        .block_on(eng.mkdirat(d.as_raw_fd(), c"sub", 0o755))
        .unwrap()
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EEXIST));
    // A long target (more than a pooled path holds) is stored whole, never resolved.
    let long = format!("../{}", "x/".repeat(300));
    let target = std::ffi::CString::new(long.clone()).unwrap();
    eng.block_on(eng.symlinkat(&target, d.as_raw_fd(), c"ln"))
        .unwrap()
        .unwrap();
    assert_eq!(
        std::fs::read_link(dir.path().join("ln")).unwrap(),
        std::path::PathBuf::from(long)
    );
}

/// Creations on the ring (in io-wq workers) apply the umask held for them, the thread's own:
/// two held at once with different umasks each get theirs, and the rest of the process keeps
/// its umask.
#[test]
fn creations_on_the_ring_apply_the_umask_held_for_them() {
    use std::os::unix::fs::PermissionsExt;
    fn process_umask() -> String {
        let s = std::fs::read_to_string("/proc/self/status").unwrap();
        s.lines()
            .find(|l| l.starts_with("Umask:"))
            .unwrap()
            .to_string()
    }
    let before = process_umask();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    std::thread::spawn(move || {
        let eng = engine(1, false);
        let d = dir_fd(&path);
        let fd = d.as_raw_fd();
        let made = Rc::new(RefCell::new(Vec::new()));
        for (i, umask) in [0o077u32, 0o022, 0o077, 0o002, 0].into_iter().enumerate() {
            let (e, made) = (eng.clone(), made.clone());
            eng.spawn(async move {
                let name = std::ffi::CString::new(format!("d{i}")).unwrap();
                let held = crate::umask::hold(&e, umask).await.unwrap();
                e.mkdirat(fd, &name, 0o777).await.unwrap();
                let name = std::ffi::CString::new(format!("f{i}")).unwrap();
                let f = e
                    .openat_punted(
                        fd,
                        &name,
                        libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                        0o666,
                    )
                    .await
                    .unwrap();
                drop((f, held));
                made.borrow_mut().push((i, umask));
            });
        }
        eng.run().unwrap();
        assert_eq!(made.borrow().len(), 5);
        for (i, umask) in made.borrow().iter() {
            let m = std::fs::metadata(path.join(format!("d{i}"))).unwrap();
            assert_eq!(m.permissions().mode() & 0o777, 0o777 & !umask, "d{i}");
            let m = std::fs::metadata(path.join(format!("f{i}"))).unwrap();
            assert_eq!(m.permissions().mode() & 0o777, 0o666 & !umask, "f{i}");
        }
    })
    .join()
    .unwrap();
    assert_eq!(process_umask(), before);
}
