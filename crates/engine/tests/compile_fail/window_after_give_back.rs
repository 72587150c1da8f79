//! Misuse: using a window after `into_inner()` gave its buffer back.
//!
//! `Slice::into_inner` consumes the window, so it cannot be used again (E0382): one buffer never
//! has two owners, e.g. one lent to the kernel and one still reading through the old window.

use engine::{Engine, EngineConfig};

fn main() {
    let eng = Engine::new(&EngineConfig::default()).unwrap();
    let win = eng.take_buffer().unwrap().slice(0..8);
    let buf = win.into_inner();
    let _ = win.as_slice();
    drop(buf);
}
