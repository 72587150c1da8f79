//! Misuse: sending a buffer to another thread.
//!
//! A `Buf` shares its pool (free list, memory) with its engine through an `Rc`, and belongs to the
//! queue thread that owns that engine: it is `!Send`, so `thread::spawn` rejects it (E0277).

use engine::{Engine, EngineConfig};

fn main() {
    let eng = Engine::new(&EngineConfig::default()).unwrap();
    let buf = eng.take_buffer().unwrap();
    std::thread::spawn(move || drop(buf));
}
