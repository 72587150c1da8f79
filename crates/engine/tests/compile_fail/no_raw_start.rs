//! Misuse: submitting a hand-built entry with `Engine::start`.
//!
//! Even with its own io-uring dependency, code outside the crate cannot submit an entry: `start`
//! is crate-private (E0624), so no entry reaches the ring without the engine owning its memory.

use engine::{Engine, EngineConfig};

fn main() {
    let eng = Engine::new(&EngineConfig::default()).unwrap();
    let sqe: io_uring::squeue::Entry128 = io_uring::opcode::Nop::new().build().into();
    let _ = unsafe { eng.start(sqe, ()) };
}
