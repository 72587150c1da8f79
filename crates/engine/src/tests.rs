//! Engine tests against real files, pipes and threads.

use std::cell::Cell;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use io_uring::{opcode, types};

use crate::sync::Semaphore;
use crate::{Engine, EngineConfig, Sqe};

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

#[test]
fn reads_a_file_into_pool_buffers_plain_and_fixed() {
    let mut f = tempfile::tempfile().unwrap();
    let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
    f.write_all(&data).unwrap();
    for register in [false, true] {
        let eng = engine(2, register);
        let mut buf = eng.take_buffer(1).unwrap();
        assert!(eng.take_buffer(1).is_none(), "a buffer is handed out once");
        let fd = f.as_raw_fd();
        let n = eng
            .block_on(async {
                let mut w = buf.io_mut(100, 5000);
                let sqe: Sqe = if eng.buffers_registered() {
                    opcode::ReadFixed::new(types::Fd(fd), w.as_mut_ptr(), 5000, w.buf_index())
                        .offset(3)
                        .build()
                        .into()
                } else {
                    opcode::Read::new(types::Fd(fd), w.as_mut_ptr(), 5000)
                        .offset(3)
                        .build()
                        .into()
                };
                // SAFETY: engine-owned buffer.
                unsafe { eng.submit(sqe) }.await
            })
            .unwrap();
        assert_eq!(n, 5000);
        assert_eq!(&buf.as_slice()[100..5100], &data[3..5003]);
        assert_eq!(eng.buffers_registered(), register);
    }
}

#[test]
fn many_tasks_run_concurrently_and_finish() {
    let eng = engine(0, false);
    let done = Rc::new(Cell::new(0));
    let (r, w) = std::io::pipe().unwrap();
    let rfd = r.as_raw_fd();
    // 8 tasks each wait for one byte of the pipe; they are all in flight before any byte exists.
    let bufs: Rc<Vec<Cell<u8>>> = Rc::new((0..8).map(|_| Cell::new(0)).collect());
    for i in 0..8 {
        let (eng2, done, bufs) = (eng.clone(), done.clone(), bufs.clone());
        eng.spawn(async move {
            let p = bufs[i].as_ptr();
            let sqe: Sqe = opcode::Read::new(types::Fd(rfd), p, 1).build().into();
            // SAFETY: the Rc'd cells outlive the op (the task holds the Rc until completion).
            let res = unsafe { eng2.submit(sqe) }.await;
            assert_eq!(res, 1);
            done.set(done.get() + 1);
        });
    }
    let writer = std::thread::spawn(move || {
        let mut w = w;
        std::thread::sleep(std::time::Duration::from_millis(50));
        w.write_all(b"abcdefgh").unwrap();
    });
    eng.run().unwrap();
    writer.join().unwrap();
    assert_eq!(done.get(), 8);
    let mut got: Vec<u8> = bufs.iter().map(|c| c.get()).collect();
    got.sort();
    assert_eq!(got, b"abcdefgh");
}

#[test]
fn remote_wake_from_another_thread() {
    let eng = engine(0, false);
    let flag = Arc::new(AtomicBool::new(false));
    let f2 = flag.clone();
    let task = eng.spawn(async move {
        std::future::poll_fn(|_| {
            if f2.load(Ordering::Acquire) {
                std::task::Poll::Ready(())
            } else {
                std::task::Poll::Pending
            }
        })
        .await
    });
    let remote = eng.remote();
    let t = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(30));
        flag.store(true, Ordering::Release);
        remote.wake(task);
    });
    eng.run().unwrap();
    t.join().unwrap();
}

#[test]
fn semaphore_admits_one_at_a_time_in_order() {
    let eng = engine(0, false);
    let sem = Rc::new(Semaphore::new(1, 4));
    let log = Rc::new(std::cell::RefCell::new(Vec::new()));
    let (r, mut w) = std::io::pipe().unwrap();
    let rfd = r.as_raw_fd();
    let cells: Rc<Vec<Cell<u8>>> = Rc::new((0..3).map(|_| Cell::new(0)).collect());
    for i in 0..3 {
        let (eng2, sem, log, cells) = (eng.clone(), sem.clone(), log.clone(), cells.clone());
        eng.spawn(async move {
            sem.acquire(&eng2).await;
            log.borrow_mut().push(i);
            let sqe: Sqe = opcode::Read::new(types::Fd(rfd), cells[i].as_ptr(), 1)
                .build()
                .into();
            // SAFETY: the cells outlive the op.
            unsafe { eng2.submit(sqe) }.await;
            log.borrow_mut().push(i + 10);
            sem.release(&eng2);
        });
    }
    w.write_all(b"xyz").unwrap();
    eng.run().unwrap();
    assert_eq!(*log.borrow(), vec![0, 10, 1, 11, 2, 12]);
}

#[test]
fn dropping_a_pending_op_cancels_it() {
    let eng = engine(0, false);
    let (r, _w) = std::io::pipe().unwrap();
    let mut byte = Box::new(0u8);
    let sqe: Sqe = opcode::Read::new(types::Fd(r.as_raw_fd()), &mut *byte, 1)
        .build()
        .into();
    // SAFETY: `byte` outlives the op: dropping the op waits for its cancellation.
    let op = unsafe { eng.submit(sqe) };
    drop(op); // must not hang, must not leave the op in flight
    drop(eng);
    assert_eq!(*byte, 0);
}

#[test]
fn sqe_len_is_set_without_touching_other_fields() {
    let sqe: Sqe = opcode::UringCmd80::new(types::Fd(7), 1)
        .addr(Some(0xdead_beef))
        .cmd([0xab; 80])
        .build();
    let before: [u8; 128] = unsafe { std::mem::transmute(sqe.clone()) };
    let after: [u8; 128] = unsafe { std::mem::transmute(crate::sqe_with_len(sqe, 2)) };
    assert_eq!(&after[24..28], &2u32.to_ne_bytes());
    assert_eq!(&before[..24], &after[..24]);
    assert_eq!(&before[28..], &after[28..]);
    assert_eq!(after[0], io_uring::opcode::UringCmd80::CODE);
}

/// A multishot read on a pipe fills provided buffers one completion each, keeps going after a
/// buffer comes back, ends with ENOBUFS when none is left, and a dropped op is cancelled.
#[test]
fn multishot_read_fills_provided_buffers() {
    let eng = Rc::new(
        Engine::new(&EngineConfig {
            buffers: 2,
            buffer_size: 4096,
            provided_buffers: 2,
            ..Default::default()
        })
        .expect("io_uring available"),
    );
    let Some(group) = eng.buf_group() else {
        eprintln!("kernel without provided-buffer rings: nothing to test");
        return;
    };
    if !eng.supports_opcode(opcode::ReadMulti::CODE) {
        eprintln!("kernel without READ_MULTISHOT: nothing to test");
        return;
    }
    let (r, mut w) = std::io::pipe().unwrap();
    // SAFETY: fcntl on a valid fd.
    unsafe {
        let fl = libc::fcntl(r.as_raw_fd(), libc::F_GETFL);
        libc::fcntl(r.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK);
    }
    let mut b0 = eng.take_buffer(0).unwrap();
    let mut b1 = eng.take_buffer(1).unwrap();
    // SAFETY: nobody touches the buffers until a completion names them.
    unsafe {
        eng.provide_buffer(b0.io_mut(0, 4096), 0);
        eng.provide_buffer(b1.io_mut(0, 4096), 1);
    }
    eng.publish_buffers();
    let read_multi = || -> Sqe {
        opcode::ReadMulti::new(types::Fd(r.as_raw_fd()), 0, group.0)
            .build()
            .into()
    };
    let got = eng
        .block_on(async {
            // SAFETY: reads only into provided engine buffers.
            let mut op = unsafe { eng.submit_multishot(read_multi(), 3) };
            let mut got = Vec::new();
            w.write_all(b"first").unwrap();
            let c = op.completion().await.unwrap();
            got.push((c.res, c.buffer, c.more));
            w.write_all(b"second").unwrap();
            let c = op.completion().await.unwrap();
            got.push((c.res, c.buffer, c.more));
            // Both buffers are used: the next read ends the op with ENOBUFS.
            w.write_all(b"third").unwrap();
            let c = op.completion().await.unwrap();
            got.push((c.res, c.buffer, c.more));
            assert!(op.completion().await.is_none());
            got
        })
        .unwrap();
    assert_eq!(got[0], (5, Some(0), true));
    assert_eq!(got[1], (6, Some(1), true));
    assert_eq!(got[2], (-libc::ENOBUFS, None, false));
    assert_eq!(&b0.as_slice()[..5], b"first");
    assert_eq!(&b1.as_slice()[..6], b"second");

    // Give one buffer back; a new op reads what is waiting, and dropping it cancels it.
    // SAFETY: as above.
    unsafe { eng.provide_buffer(b0.io_mut(0, 4096), 0) };
    eng.publish_buffers();
    let c = eng
        .block_on(async {
            // SAFETY: as above.
            let mut op = unsafe { eng.submit_multishot(read_multi(), 2) };
            op.completion().await.unwrap()
        })
        .unwrap();
    assert_eq!(
        c,
        crate::Completion {
            res: 5,
            buffer: Some(0),
            more: true
        }
    );
    assert_eq!(&b0.as_slice()[..5], b"third");
}
