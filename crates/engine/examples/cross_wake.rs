//! Measures a cross-thread wakeup between two engines: a task on each thread hands a turn back and
//! forth, each hand-over waking the other thread's task through its `Waker`. Run with
//! `cargo run --release -p fusex-engine --example cross_wake -- [eventfd|msg-ring] [ROUND_TRIPS]`.
//!
//! This is the path a request takes when it waits for a lock (an image's metadata cache) that a
//! request on another queue releases.

use std::future::poll_fn;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::time::Instant;

use engine::{CrossWake, Engine, EngineConfig};

struct Turns {
    turn: AtomicU64,
    waiters: Mutex<[Option<Waker>; 2]>,
}

fn side(turns: Arc<Turns>, me: u64, round_trips: u64) -> std::time::Duration {
    let eng = Engine::new(&EngineConfig::default()).expect("engine");
    let start = Instant::now();
    eng.spawn(async move {
        let until = round_trips * 2;
        loop {
            let t = poll_fn(|cx| {
                let t = turns.turn.load(Ordering::Acquire);
                if t % 2 == me || t >= until {
                    return Poll::Ready(t);
                }
                turns.waiters.lock().unwrap()[me as usize] = Some(cx.waker().clone());
                let t = turns.turn.load(Ordering::Acquire);
                if t % 2 == me || t >= until {
                    return Poll::Ready(t);
                }
                Poll::Pending
            })
            .await;
            if t >= until {
                break;
            }
            turns.turn.store(t + 1, Ordering::Release);
            let other = turns.waiters.lock().unwrap()[1 - me as usize].take();
            if let Some(w) = other {
                w.wake();
            }
        }
    });
    eng.run().expect("run");
    start.elapsed()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "eventfd".into());
    let round_trips: u64 = args
        .next()
        .map_or(200_000, |n| n.parse().expect("a number"));
    match mode.as_str() {
        "eventfd" => CrossWake::Eventfd.set(),
        "msg-ring" => CrossWake::MsgRing.set(),
        m => panic!("unknown mode {m}: eventfd or msg-ring"),
    }
    let turns = Arc::new(Turns {
        turn: AtomicU64::new(0),
        waiters: Mutex::new([None, None]),
    });
    let t1 = turns.clone();
    let other = std::thread::spawn(move || side(t1, 1, round_trips));
    let d = side(turns, 0, round_trips);
    other.join().expect("thread");
    let per = d.as_nanos() as f64 / (round_trips * 2) as f64;
    println!("{mode}: {round_trips} round trips in {d:?}: {per:.0} ns per wakeup");
}
