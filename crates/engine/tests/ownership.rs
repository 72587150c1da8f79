//! Buffers are owned values that keep their pool's memory alive. These programs compile and run:
//! they are the sound counterparts of the misuses in `tests/compile_fail/`.
//!
//! `take_buffer` used to return a handle with no lifetime whose memory the engine freed when it
//! was dropped: keeping the handle past the engine read freed memory. Now a `Buf` shares the
//! pool, so keeping it past the engine is sound, and the bytes are still there.

use std::io::Write;
use std::os::fd::AsRawFd;

use engine::{Buf, Engine, EngineConfig, Fd};

fn engine(buffers: usize, register: bool) -> Engine {
    Engine::new(&EngineConfig {
        buffers,
        buffer_size: 8192,
        register_buffers: register,
        ..Default::default()
    })
    .expect("io_uring available")
}

fn file_with(data: &[u8]) -> std::fs::File {
    let mut f = tempfile::tempfile().unwrap();
    f.write_all(data).unwrap();
    f
}

#[test]
fn buf_kept_past_engine_still_reads_its_bytes() {
    let data: Vec<u8> = (0..6000u32).map(|i| (i * 13 % 251) as u8).collect();
    let f = file_with(&data);
    for register in [false, true] {
        let eng = engine(2, register);
        let watch = eng.pool_watch();
        let buf = eng.take_buffer().unwrap();
        let (n, win) = eng
            .block_on(eng.read(Fd::Raw(f.as_raw_fd()), buf.slice(0..6000), 0))
            .unwrap();
        assert_eq!(n.unwrap(), 6000);
        assert_eq!(eng.in_flight(), 0);
        drop(eng);
        // The window keeps the pool's memory alive: the bytes the kernel read are still there.
        assert!(watch.alive(), "a live Buf keeps its pool");
        assert_eq!(win.as_slice(), &data[..]);
        let mut buf: Buf = win.into_inner();
        assert_eq!(&buf.as_slice()[..6000], &data[..]);
        // And it can still be written through (it is the only owner of those bytes).
        buf.as_mut_slice()[..4].copy_from_slice(b"fuse");
        assert_eq!(&buf.as_slice()[..4], b"fuse");
        drop(buf);
        // The last owner of the pool is gone: its memory is freed now, not before.
        assert!(!watch.alive(), "the pool is freed with its last Buf");
    }
}

#[test]
fn buf_taken_but_never_lent_outlives_engine() {
    let eng = engine(1, false);
    let watch = eng.pool_watch();
    let mut buf = eng.take_buffer().unwrap();
    drop(eng);
    assert!(watch.alive());
    assert_eq!(buf.len(), 8192);
    assert!(
        buf.as_slice().iter().all(|&b| b == 0),
        "pool memory starts zeroed"
    );
    buf.as_mut_slice().fill(0xa5);
    assert!(buf.as_slice().iter().all(|&b| b == 0xa5));
    drop(buf);
    assert!(!watch.alive());
}

#[test]
fn lent_buffer_comes_back_with_the_result() {
    // The sound shape of `use_after_lend.rs`: the read gives the window back, then it is read.
    let f = file_with(b"0123456789");
    let eng = engine(1, false);
    let buf = eng.take_buffer().unwrap();
    let fut = eng.read(Fd::Raw(f.as_raw_fd()), buf.slice(0..8), 2);
    assert_eq!(eng.buffers_available(), 0, "the op owns the buffer now");
    let (n, win) = eng.block_on(fut).unwrap();
    assert_eq!(n.unwrap(), 8);
    assert_eq!(win.as_slice(), b"23456789");
    drop(win);
    assert_eq!(
        eng.buffers_available(),
        1,
        "dropping the window returns the buffer"
    );
}
