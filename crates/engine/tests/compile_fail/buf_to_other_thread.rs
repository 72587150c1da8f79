//! Misuse: sending a buffer to another thread.
//!
//! A `Buf` belongs to the thread that holds it: it is `!Send`, so `thread::spawn` rejects it
//! (E0277). The one way across is `Buf::into_send`, which gives no access to the bytes on the way.

use engine::{Engine, EngineConfig};

fn main() {
    let eng = Engine::new(&EngineConfig::default()).unwrap();
    let buf = eng.take_buffer().unwrap();
    std::thread::spawn(move || drop(buf));
}
