//! fusex's NBD client without FUSE: random (or sequential) reads of BS bytes at queue depth QD
//! on one engine and one connection, for SECONDS; prints IOPS and MiB/s. The counterpart of
//! `bench/nbd/libnbd_qd.c`, so the two clients compare on equal terms (docs/nbd.md).
//!
//! `cargo run --release -p fusex-backend --example nbd_qd -- URI BS QD SECONDS [seq]`

use std::cell::Cell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use backend::{BlockBackend, NbdBackend, NbdOptions};
use engine::{Engine, EngineConfig};

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 5 {
        eprintln!("usage: nbd_qd URI BS QD SECONDS [seq]");
        std::process::exit(2);
    }
    let bs: usize = a[2].parse().expect("BS");
    let qd: usize = a[3].parse().expect("QD");
    let secs: f64 = a[4].parse().expect("SECONDS");
    let seq = a.get(5).is_some_and(|s| s == "seq");
    let b = Rc::new(
        NbdBackend::open(&a[1], NbdOptions::default()).unwrap_or_else(|e| {
            eprintln!("{e}");
            std::process::exit(1)
        }),
    );
    let eng = Rc::new(
        Engine::new(&EngineConfig {
            sq_entries: (qd * 4) as u32,
            buffers: qd,
            buffer_size: bs,
            register_buffers: true,
            ..EngineConfig::default()
        })
        .expect("engine"),
    );
    let blocks = b.size() / bs as u64;
    let done = Rc::new(Cell::new(0u64));
    let next = Rc::new(Cell::new(0u64));
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let start = Instant::now();
    for t in 0..qd {
        let (b, e, done, next) = (b.clone(), eng.clone(), done.clone(), next.clone());
        eng.spawn(async move {
            let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (t as u64 + 1);
            let mut buf = e.take_buffer().expect("buffer");
            while Instant::now() < end {
                let blk = if seq {
                    let n = next.get();
                    next.set(n + 1);
                    n % blocks
                } else {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng % blocks
                };
                let (r, win) = b.read_at(&e, buf.slice(0..bs), blk * bs as u64).await;
                r.expect("read");
                buf = win.into_inner();
                done.set(done.get() + 1);
            }
        });
    }
    eng.run().expect("engine");
    let el = start.elapsed().as_secs_f64();
    let n = done.get() as f64;
    println!(
        "bs={bs} qd={qd} {}: {:.0} IOPS, {:.1} MiB/s",
        if seq { "seq" } else { "rand" },
        n / el,
        n * bs as f64 / el / 1048576.0
    );
}
