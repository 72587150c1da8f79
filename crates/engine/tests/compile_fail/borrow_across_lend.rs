//! Misuse: holding a view of a window's bytes while lending the window to a read.
//!
//! The read takes the window by value, which needs it unborrowed: moving it while `bytes` still
//! points into it is E0505. Otherwise `bytes` could be read while the kernel writes the memory.

use engine::{Engine, EngineConfig, Fd};

fn main() {
    let eng = Engine::new(&EngineConfig::default()).unwrap();
    let win = eng.take_buffer().unwrap().slice(0..8);
    let bytes: &[u8] = win.as_slice();
    let fut = eng.read(Fd::Raw(0), win, 0);
    let _ = eng.block_on(fut);
    println!("{bytes:?}");
}
