//! Misuse: touching a buffer after lending it to a read, before the read gives it back.
//!
//! `Engine::read` takes the window by value, so the kernel is the only writer while the op is in
//! flight; using `buf` afterwards is a use of a moved value (E0382). With the old API a window was
//! borrowed from a buffer handle, and this read raced with the kernel's write.

use engine::{Engine, EngineConfig, Fd};

fn main() {
    let eng = Engine::new(&EngineConfig::default()).unwrap();
    let buf = eng.take_buffer().unwrap();
    let fut = eng.read(Fd::Raw(0), buf.slice(0..8), 0);
    let _ = buf.as_slice();
    let _ = eng.block_on(fut);
}
