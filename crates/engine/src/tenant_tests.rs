//! Tests of what an engine shared by many tenants needs: task ids reused, buffer pools, fixed
//! tables and provided-buffer rings added and removed at run time.

use std::cell::Cell;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::time::Duration;

use crate::{Buf, BufPool, Engine, EngineConfig, Fd, AT_CURSOR};

fn engine(cfg: EngineConfig) -> Rc<Engine> {
    Rc::new(Engine::new(&cfg).expect("io_uring available"))
}

/// Pending `n` times (waking itself each time), then ready.
async fn yield_times(n: u32) {
    let mut left = n;
    std::future::poll_fn(|cx| {
        if left == 0 {
            std::task::Poll::Ready(())
        } else {
            left -= 1;
            cx.waker().wake_by_ref();
            std::task::Poll::Pending
        }
    })
    .await
}

/// A few loop turns of `eng` (its ready tasks are polled, its ring reaped).
fn turns(eng: &Engine) {
    eng.block_on(yield_times(3)).unwrap();
}

/// 10 000 short tasks, spawned in waves while others run, leave a task table as large as the
/// most tasks alive at once, not one slot per task ever spawned.
#[test]
fn finished_task_ids_are_reused() {
    let eng = engine(EngineConfig::default());
    let ran = Rc::new(Cell::new(0u32));
    for _ in 0..100 {
        for _ in 0..100 {
            let ran = ran.clone();
            eng.spawn(async move { ran.set(ran.get() + 1) });
        }
        assert_eq!(eng.live_tasks(), 100);
        eng.run().unwrap();
        assert_eq!(eng.live_tasks(), 0);
    }
    assert_eq!(ran.get(), 10_000);
    assert_eq!(eng.task_slots(), 100, "one slot per task alive at once");

    // Tasks that spawn tasks from inside the loop reuse ids as they finish.
    let eng2 = eng.clone();
    let ran2 = ran.clone();
    eng.spawn(async move {
        for _ in 0..1000 {
            let ran = ran2.clone();
            eng2.spawn(async move { ran.set(ran.get() + 1) });
            // Let the child run (and finish) before spawning the next.
            yield_times(1).await;
        }
    });
    eng.run().unwrap();
    assert_eq!(ran.get(), 11_000);
    assert!(eng.task_slots() <= 100, "{} slots", eng.task_slots());

    // Dropped tasks free their ids too.
    for _ in 0..50 {
        eng.spawn(std::future::pending());
    }
    turns(&eng);
    assert_eq!(eng.live_tasks(), 50);
    eng.drop_tasks();
    assert_eq!(eng.live_tasks(), 0);
    for _ in 0..100 {
        eng.spawn(async {});
    }
    eng.run().unwrap();
    assert_eq!(eng.task_slots(), 100);
}

/// A wakeup naming an id whose task ended (a stale waker) is at worst a spurious poll of the
/// task that holds the id now.
#[test]
fn a_stale_waker_is_a_spurious_wakeup() {
    let eng = engine(EngineConfig::default());
    let stale = Rc::new(Cell::new(None::<std::task::Waker>));
    let s2 = stale.clone();
    let first = eng.spawn(async move {
        std::future::poll_fn(|cx| {
            s2.set(Some(cx.waker().clone()));
            std::task::Poll::Ready(())
        })
        .await
    });
    eng.run().unwrap();
    let polls = Rc::new(Cell::new(0u32));
    let p2 = polls.clone();
    let second = eng.spawn(async move {
        // Pending until polled three times: once at spawn, once by the stale waker, once more.
        std::future::poll_fn(|_| {
            p2.set(p2.get() + 1);
            if p2.get() >= 3 {
                std::task::Poll::Ready(())
            } else {
                std::task::Poll::Pending
            }
        })
        .await
    });
    assert_eq!(first, second, "the id is reused");
    turns(&eng);
    assert_eq!(polls.get(), 1);
    let w = stale.take().unwrap();
    w.wake_by_ref();
    turns(&eng);
    assert_eq!(polls.get(), 2, "the stale waker polled the new task");
    w.wake();
    eng.run().unwrap();
    assert_eq!(polls.get(), 3);
    assert_eq!(eng.live_tasks(), 0);
}

fn pattern_file(len: usize) -> (std::fs::File, Vec<u8>) {
    use std::io::Write;
    let mut f = tempfile::tempfile().unwrap();
    let data: Vec<u8> = (0..len as u32).map(|i| (i * 31 % 251) as u8).collect();
    f.write_all(&data).unwrap();
    (f, data)
}

fn fixed_engine(buffer_table: u32) -> Rc<Engine> {
    engine(EngineConfig {
        register_buffers: true,
        buffer_table,
        ..Default::default()
    })
}

/// Reads `len` bytes at `off` of `f` into `buf` and checks them against `data`.
fn read_check(eng: &Engine, f: &std::fs::File, data: &[u8], buf: Buf, off: usize) -> Buf {
    let len = 4096;
    let (n, win) = eng
        .block_on(eng.read(
            Fd::Raw(f.as_raw_fd()),
            buf.slice(100..100 + len),
            off as u64,
        ))
        .unwrap();
    assert_eq!(n.unwrap(), len);
    assert_eq!(win.as_slice(), &data[off..off + len]);
    win.into_inner()
}

/// Tenants come and go: each pool's buffers take slots of the shared table at their first fixed
/// read (the bytes land where they belong), and give them back when the pool is removed, so 50
/// tenants in turn fit a table of 8 slots.
#[test]
fn pools_added_and_removed_read_a_file_through_fixed_buffers() {
    let (f, data) = pattern_file(1 << 20);
    let eng = fixed_engine(8);
    assert_eq!(eng.free_buffer_slots(), 8);
    for round in 0..50usize {
        // Two tenants at once, so slots of both are in the table together.
        let a = eng.add_pool(3, 8192, false).unwrap();
        let b = eng.add_pool(4, 8192, false).unwrap();
        assert_eq!((a.len(), a.available(), a.group()), (3, 3, None));
        let mut held = Vec::new();
        for i in 0..7 {
            let pool = if i % 2 == 0 && a.available() > 0 {
                &a
            } else {
                &b
            };
            let buf = pool.take().unwrap();
            let buf = read_check(&eng, &f, &data, buf, (round * 7 + i) * 997);
            assert!(buf.pool().fixed(buf.index()), "registered at its first use");
            held.push(buf);
        }
        assert_eq!(eng.free_buffer_slots(), 1);
        // The same buffers again, by their slots now: still their own bytes.
        for (i, buf) in held.drain(..).enumerate() {
            drop(read_check(&eng, &f, &data, buf, i * 4099));
        }
        let keep = a.take().unwrap();
        let watch = a.watch();
        eng.remove_pool(a);
        eng.remove_pool(b);
        assert_eq!(eng.free_buffer_slots(), 8, "round {round}: slots back");
        // A buffer of a removed pool still works, by address, and keeps the memory.
        assert!(!keep.pool().fixed(keep.index()));
        let keep = read_check(&eng, &f, &data, keep, 12_345);
        assert!(!keep.pool().fixed(keep.index()), "never registered again");
        assert!(watch.alive());
        drop(keep);
        assert!(!watch.alive(), "the last buffer frees the pool");
    }
}

/// A full table is no error: buffers that find no slot go by address (and read the right
/// bytes), and take a slot once a removed pool gave its slots back.
#[test]
fn a_full_table_means_by_address_until_slots_come_back() {
    let (f, data) = pattern_file(1 << 18);
    let eng = fixed_engine(4);
    let a = eng.add_pool(4, 8192, false).unwrap();
    let b = eng.add_pool(2, 8192, false).unwrap();
    let a_bufs: Vec<Buf> = (0..4)
        .map(|i| read_check(&eng, &f, &data, a.take().unwrap(), i * 5000))
        .collect();
    assert_eq!(eng.free_buffer_slots(), 0);
    let b_bufs: Vec<Buf> = (0..2)
        .map(|i| read_check(&eng, &f, &data, b.take().unwrap(), 60_000 + i * 333))
        .collect();
    assert!(
        b_bufs.iter().all(|x| !x.pool().fixed(x.index())),
        "by address"
    );
    // Writes by address too.
    let win = b_bufs[0].as_slice()[100..4196].to_vec();
    drop(a_bufs);
    eng.remove_pool(a);
    assert_eq!(eng.free_buffer_slots(), 4);
    let mut slots = Vec::new();
    for (i, x) in b_bufs.into_iter().enumerate() {
        let x = read_check(&eng, &f, &data, x, 90_000 + i * 71);
        slots.push(x.pool().slot(x.index()).expect("a slot now"));
    }
    slots.sort();
    assert!(slots.iter().all(|s| *s < 4), "reused slots {slots:?}");
    assert_eq!(eng.free_buffer_slots(), 2);
    assert_eq!(&win, &data[60_000..60_000 + 4096]);
}

/// Removing a pool while one of its fixed reads is in flight: the slot is cleared and given to
/// another pool at once, and the read still lands in its own buffer (the kernel keeps what it
/// looked up), not in the buffer that took the slot.
#[test]
fn removing_a_pool_with_a_fixed_read_in_flight() {
    let (f, data) = pattern_file(1 << 16);
    let eng = fixed_engine(1);
    let (r, mut w) = std::io::pipe().unwrap();
    let a = eng.add_pool(1, 4096, false).unwrap();
    let watch = a.watch();
    let buf = a.take().unwrap();
    let mut fut = Box::pin(eng.read(Fd::Raw(r.as_raw_fd()), buf.slice(0..16), AT_CURSOR));
    assert!(
        crate::tests::poll_once(fut.as_mut()).is_pending(),
        "waits for the pipe"
    );
    assert_eq!(eng.free_buffer_slots(), 0, "the pipe read took the slot");
    eng.remove_pool(a);
    assert_eq!(eng.free_buffer_slots(), 1);
    assert!(watch.alive(), "the op table holds the in-flight buffer");
    // Another tenant takes the slot and reads a file through it.
    let c = eng.add_pool(1, 4096, false).unwrap();
    let mut cb = c.take().unwrap();
    cb.as_mut_slice().fill(0xee);
    let (n, cw) = eng
        .block_on(eng.read(Fd::Raw(f.as_raw_fd()), cb.slice(0..4096), 0))
        .unwrap();
    assert_eq!(n.unwrap(), 4096);
    assert_eq!(cw.as_slice(), &data[..4096]);
    assert_eq!(eng.free_buffer_slots(), 0, "slot 0 is the new pool's");
    // Now the pipe read completes: into the removed pool's buffer.
    w.write_all(b"old tenant bytes").unwrap();
    let (n, win) = eng.block_on(fut).unwrap();
    assert_eq!(n.unwrap(), 16);
    assert_eq!(win.as_slice(), b"old tenant bytes");
    assert_eq!(
        &cw.as_slice()[..16],
        &data[..16],
        "the new tenant's untouched"
    );
    assert_eq!(cw.as_slice().len(), 4096);
    drop(win);
    assert!(!watch.alive());
}

/// Each pool with a provided-buffer ring has its own group; two multishot reads of two pipes,
/// one per pool, get windows of their own pool although buffer ids (pool indexes) coincide. A
/// group removed while its read is armed stays registered until the read ends; then its id is
/// reused.
#[test]
fn two_pools_with_provided_rings_read_multishot_each() {
    let eng = engine(EngineConfig::default());
    assert!(eng.supports_opcode(io_uring::opcode::ReadMulti::CODE));
    let a = eng.add_pool(2, 4096, true).unwrap();
    let b = eng.add_pool(2, 4096, true).unwrap();
    let (ga, gb) = (a.group().unwrap(), b.group().unwrap());
    assert_ne!(ga, gb);
    assert_eq!(eng.provided_groups(), 2);
    let addrs = |p: &BufPool| {
        let bufs: Vec<Buf> = (0..2).map(|_| p.take().unwrap()).collect();
        let addrs: Vec<usize> = bufs.iter().map(Buf::addr).collect();
        for x in bufs {
            eng.provide(x.slice(0..4096)).unwrap();
        }
        addrs
    };
    let (aa, ba) = (addrs(&a), addrs(&b));
    eng.publish_buffers();
    assert_eq!(a.available(), 0, "lent");
    let (ra, mut wa) = std::io::pipe().unwrap();
    let (rb, mut wb) = std::io::pipe().unwrap();
    crate::tests::nonblocking(&ra);
    crate::tests::nonblocking(&rb);
    let (ca, cb) = eng
        .block_on(async {
            let mut oa = eng.read_multishot(Fd::Raw(ra.as_raw_fd()), ga, 2).unwrap();
            let mut ob = eng.read_multishot(Fd::Raw(rb.as_raw_fd()), gb, 2).unwrap();
            wb.write_all(b"to b").unwrap();
            wa.write_all(b"to a").unwrap();
            let cb = ob.completion().await.unwrap();
            let ca = oa.completion().await.unwrap();
            (ca, cb)
        })
        .unwrap();
    for (c, addrs, text) in [(&ca, &aa, b"to a"), (&cb, &ba, b"to b")] {
        assert_eq!((c.res, c.named, c.more), (4, Some(0), true));
        let w = c.buf.as_ref().unwrap();
        assert_eq!(&w.as_slice()[..4], text);
        assert_eq!(w.buf().addr(), addrs[0], "a window of the op's own pool");
    }
    drop((ca, cb));

    // Remove pool a while a read of its group is armed: the group stays until the read ends.
    let (ra2, _wa2) = std::io::pipe().unwrap();
    crate::tests::nonblocking(&ra2);
    let watch = a.watch();
    let armed = eng.read_multishot(Fd::Raw(ra2.as_raw_fd()), ga, 2).unwrap();
    eng.block_on(yield_times(2)).unwrap();
    eng.remove_pool(a);
    assert_eq!(eng.provided_groups(), 2, "its read is armed");
    assert!(watch.alive(), "the group still lends a window");
    let removed_win = eng.provide(b.take().unwrap().slice(0..4096));
    assert!(removed_win.is_ok(), "b still lends");
    // Ending the read (cancelled) lets the group go.
    drop(armed);
    eng.block_on(async {
        while eng.in_flight() > 0 {
            eng.sleep(Duration::from_millis(1)).await;
        }
    })
    .unwrap();
    turns(&eng);
    assert_eq!(eng.provided_groups(), 1);
    assert!(
        !watch.alive(),
        "its lent windows went back, the memory with them"
    );
    let c = eng.add_pool(1, 4096, true).unwrap();
    assert_eq!(c.group(), Some(ga), "the group id is reused");
    // b's group still works, resolving ids in b although c's group lends nothing.
    eng.publish_buffers();
    let cb = eng
        .block_on(async {
            let mut ob = eng.read_multishot(Fd::Raw(rb.as_raw_fd()), gb, 2).unwrap();
            wb.write_all(b"b again").unwrap();
            ob.completion().await.unwrap()
        })
        .unwrap();
    assert_eq!(&cb.buf.as_ref().unwrap().as_slice()[..7], b"b again");
    assert!(ba.contains(&cb.buf.as_ref().unwrap().buf().addr()));
    // A window of a removed pool is refused.
    let cw = c.take().unwrap();
    eng.remove_pool(c);
    assert!(eng.provide(cw.slice(0..4096)).is_err());
}

/// Two tenants register the same file: it keeps its slot until both unregistered it; a slot
/// freed is reused; a full table means by number. Every read reads the right file.
#[test]
fn files_registered_by_two_tenants_then_unregistered() {
    let (f1, d1) = pattern_file(8192);
    let f2 = tempfile::tempfile().unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f2, &[2u8; 8192], 0).unwrap();
    let f3 = tempfile::tempfile().unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f3, &[3u8; 8192], 0).unwrap();
    let (r1, r2, r3) = (f1.as_raw_fd(), f2.as_raw_fd(), f3.as_raw_fd());
    let eng = engine(EngineConfig {
        buffers: 1,
        buffer_size: 8192,
        file_table: 2,
        ..Default::default()
    });
    let read = |fd: i32| {
        let buf = eng.take_buffer().unwrap();
        let (n, win) = eng
            .block_on(eng.read(Fd::Raw(fd), buf.slice(0..4096), 0))
            .unwrap();
        assert_eq!(n.unwrap(), 4096);
        win.as_slice().to_vec()
    };
    eng.register_files(&[r1, r2]).unwrap(); // tenant A
    eng.register_files(&[r1]).unwrap(); // tenant B
    assert_eq!(eng.file_refs(r1), 2);
    assert_eq!(eng.free_file_slots(), 0);
    let Fd::Fixed(s1) = eng.target(Fd::Raw(r1)) else {
        panic!("r1 is registered")
    };
    assert!(matches!(eng.target(Fd::Raw(r2)), Fd::Fixed(s) if s != s1));
    // Table full: a third file goes by number.
    eng.register_files(&[r3]).unwrap();
    assert_eq!(eng.target(Fd::Raw(r3)), Fd::Raw(r3));
    assert_eq!(read(r3), [3u8; 4096]);
    assert_eq!(read(r1), &d1[..4096]);
    assert_eq!(read(r2), [2u8; 4096]);
    eng.unregister_files(&[r3]);
    // A leaves: r1 stays (B), r2 goes.
    eng.unregister_files(&[r1, r2]);
    assert_eq!(eng.target(Fd::Raw(r1)), Fd::Fixed(s1));
    assert_eq!(eng.target(Fd::Raw(r2)), Fd::Raw(r2));
    assert_eq!(eng.free_file_slots(), 1);
    assert_eq!(read(r1), &d1[..4096]);
    assert_eq!(read(r2), [2u8; 4096]);
    // The freed slot goes to the next file.
    eng.register_files(&[r3]).unwrap();
    assert!(matches!(eng.target(Fd::Raw(r3)), Fd::Fixed(s) if s != s1));
    assert_eq!(read(r3), [3u8; 4096]);
    eng.unregister_files(&[r1, r3]);
    assert_eq!(eng.target(Fd::Raw(r1)), Fd::Raw(r1));
    assert_eq!((eng.file_refs(r1), eng.free_file_slots()), (0, 2));
    eng.unregister_files(&[r1]);
    assert_eq!(eng.file_refs(r1), 0, "no underflow");
    assert!(eng.register_files(&[-1]).is_err());
    // A failing registration undoes the call's earlier ones: the closed descriptor is refused.
    let closed = {
        let t = tempfile::tempfile().unwrap();
        t.as_raw_fd()
    };
    let err = eng.register_files(&[r1, closed]).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EBADF));
    assert_eq!(eng.file_refs(r1), 0, "rolled back");
    assert_eq!(eng.target(Fd::Raw(r1)), Fd::Raw(r1));
    assert_eq!(eng.free_file_slots(), 2);
    assert_eq!(read(r1), &d1[..4096]);
}

/// A fixed file unregistered while a read on it is in flight: its slot goes to another file at
/// once, and the read still reads its own file.
#[test]
fn unregistering_a_file_with_a_read_in_flight() {
    let (f, _) = pattern_file(4096);
    let eng = engine(EngineConfig {
        buffers: 2,
        buffer_size: 4096,
        file_table: 1,
        ..Default::default()
    });
    let (r, mut w) = std::io::pipe().unwrap();
    eng.register_files(&[r.as_raw_fd()]).unwrap();
    assert_eq!(eng.target(Fd::Raw(r.as_raw_fd())), Fd::Fixed(0));
    let buf = eng.take_buffer().unwrap();
    let mut fut = Box::pin(eng.read(Fd::Raw(r.as_raw_fd()), buf.slice(0..5), AT_CURSOR));
    assert!(crate::tests::poll_once(fut.as_mut()).is_pending());
    eng.unregister_files(&[r.as_raw_fd()]);
    eng.register_files(&[f.as_raw_fd()]).unwrap();
    assert_eq!(
        eng.target(Fd::Raw(f.as_raw_fd())),
        Fd::Fixed(0),
        "slot reused"
    );
    w.write_all(b"piped").unwrap();
    let (n, win) = eng.block_on(fut).unwrap();
    assert_eq!(n.unwrap(), 5);
    assert_eq!(win.as_slice(), b"piped");
}

/// 100 tenants × 32 long-lived operations (like FUSE ring entries) in flight at once, each in a
/// buffer of its tenant's pool: the op table grows to hold them, counts them, completes them all,
/// and an engine dropped with them in flight cancels them all.
#[test]
fn thousands_of_operations_of_100_tenants_in_flight() {
    const TENANTS: usize = 100;
    const DEPTH: usize = 32;
    for drop_in_flight in [false, true] {
        let eng = engine(EngineConfig {
            register_buffers: true,
            buffer_table: crate::MAX_BUFFER_TABLE,
            ..Default::default()
        });
        let pools: Vec<BufPool> = (0..TENANTS)
            .map(|_| eng.add_pool(DEPTH, 4096, false).unwrap())
            .collect();
        let watches: Vec<_> = pools.iter().map(BufPool::watch).collect();
        let pipes: Vec<_> = (0..TENANTS).map(|_| std::io::pipe().unwrap()).collect();
        let mut futs = Vec::new();
        for (p, (r, _)) in pools.iter().zip(&pipes) {
            for _ in 0..DEPTH {
                let buf = p.take().unwrap();
                let mut fut =
                    Box::pin(eng.read(Fd::Raw(r.as_raw_fd()), buf.slice(0..1), AT_CURSOR));
                assert!(crate::tests::poll_once(fut.as_mut()).is_pending());
                futs.push(fut);
            }
        }
        eng.block_on(yield_times(1)).unwrap();
        assert_eq!(eng.in_flight(), TENANTS * DEPTH);
        assert_eq!(eng.ops.borrow().pending().count(), TENANTS * DEPTH);
        assert_eq!(
            eng.free_buffer_slots(),
            crate::MAX_BUFFER_TABLE as usize - TENANTS * DEPTH
        );
        if drop_in_flight {
            // Futures forgotten: the op table alone owns the buffers; the engine's drop cancels.
            futs.into_iter().for_each(std::mem::forget);
            drop(pools);
            drop(Rc::try_unwrap(eng).ok().unwrap());
            assert!(
                watches.iter().all(|w| !w.alive()),
                "all cancelled and freed"
            );
            continue;
        }
        for (t, (_, w)) in pipes.iter().enumerate() {
            let mut w = w;
            w.write_all(&[t as u8; DEPTH]).unwrap();
        }
        let mut got = vec![0usize; TENANTS];
        for (i, fut) in futs.into_iter().enumerate() {
            let (n, win) = eng.block_on(fut).unwrap();
            assert_eq!(n.unwrap(), 1);
            assert_eq!(
                usize::from(win.as_slice()[0]),
                i / DEPTH,
                "its tenant's pipe"
            );
            got[i / DEPTH] += 1;
        }
        assert!(got.iter().all(|n| *n == DEPTH));
        assert_eq!(eng.in_flight(), 0);
        assert_eq!(eng.ops.borrow().pending().count(), 0);
        for p in pools {
            eng.remove_pool(p);
        }
        assert_eq!(
            eng.free_buffer_slots(),
            crate::MAX_BUFFER_TABLE as usize,
            "every slot back"
        );
        assert!(watches.iter().all(|w| !w.alive()));
    }
}

/// Pools dropped without `remove_pool` are reclaimed on the next loop turn; 100 tenants added
/// and removed in a loop leave the engine as it was.
#[test]
fn tenants_added_and_removed_in_a_loop_leave_nothing_behind() {
    let (f, data) = pattern_file(1 << 16);
    let eng = fixed_engine(64);
    for round in 0..100 {
        let p = eng.add_pool(4, 8192, true).unwrap();
        assert_eq!(p.group().map(|g| g.0), Some(0), "round {round}: id reused");
        let x = read_check(&eng, &f, &data, p.take().unwrap(), round * 10);
        eng.register_files(&[f.as_raw_fd()]).unwrap();
        drop(x);
        if round % 2 == 0 {
            eng.remove_pool(p);
        } else {
            drop(p);
            turns(&eng);
        }
        eng.unregister_files(&[f.as_raw_fd()]);
        assert_eq!(eng.free_buffer_slots(), 64);
        assert_eq!(eng.provided_groups(), 0);
        assert_eq!(eng.file_refs(f.as_raw_fd()), 0);
    }
}
