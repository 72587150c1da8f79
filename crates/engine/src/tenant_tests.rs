//! Tests of what an engine shared by many tenants needs: task ids reused, buffer pools, fixed
//! tables and provided-buffer rings added and removed at run time.

use std::cell::Cell;
use std::rc::Rc;

use crate::{Engine, EngineConfig};

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
