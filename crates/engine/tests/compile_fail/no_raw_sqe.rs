//! Misuse: building raw submission entries through the engine's io_uring.
//!
//! The engine does not re-export `io_uring` (E0432): every entry that points at memory is built
//! inside the crate, next to the ownership of that memory.

use engine::io_uring::opcode;

fn main() {
    let _ = opcode::Nop::new();
}
