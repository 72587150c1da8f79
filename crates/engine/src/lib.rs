//! The per-thread engine of fusex.
//!
//! One queue thread owns one [`Engine`]: an io_uring (128-byte SQEs, so FUSE `URING_CMD`s can share
//! the ring with backend I/O), a table of in-flight operations, a pool of page-aligned buffers the
//! engine owns (and may register as fixed buffers), and a tiny single-threaded executor whose only
//! reactor is the ring. Requests are Rust futures: stackless, polled in place, no thread per request
//! and no allocation per request once the queue has started.
//!
//! Soundness rests on one rule: memory handed to the kernel is owned by the engine (its buffer pool
//! or its own fields) and the engine does not free it before every submitted operation has completed.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod buf;
mod executor;
pub mod multishot;
mod op;
pub mod remote;
pub mod sync;

pub use buf::{BufHandle, IoBuf, IoBufMut};
pub use executor::{Engine, EngineConfig, EngineStats, TaskId};
pub use io_uring;
pub use multishot::{BufGroup, Completion, MultiOp};
pub use op::Op;
pub use remote::Remote;

/// The submission entry type every fusex ring uses (128 bytes, so `URING_CMD` with an 80-byte
/// command area fits next to plain reads and writes).
pub type Sqe = io_uring::squeue::Entry128;

/// Errors that setting up or driving an engine can produce.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// `io_uring_setup` failed (kernel without io_uring, or io_uring disabled by sysctl).
    #[error("cannot create io_uring: {0} (is io_uring disabled via /proc/sys/kernel/io_uring_disabled?)")]
    Setup(#[source] std::io::Error),
    /// Allocating the buffer pool failed.
    #[error("cannot allocate {count} I/O buffers of {size} bytes")]
    Alloc { count: usize, size: usize },
    /// Registering buffers with the ring failed.
    #[error("cannot register I/O buffers with io_uring: {0}")]
    Register(#[source] std::io::Error),
    /// `io_uring_enter` failed in a way the loop cannot recover from.
    #[error("io_uring_enter failed: {0}")]
    Enter(#[source] std::io::Error),
}

#[cfg(test)]
mod tests;

/// Returns `sqe` with its `len` field (the u32 at byte offset 24 of `io_uring_sqe`) set.
///
/// The io-uring crate's `UringCmd80` builder has no setter for `len`, but FUSE's REGISTER command
/// passes its iovec count there. This is the one place fusex edits an SQE's bytes directly.
pub fn sqe_with_len(sqe: Sqe, len: u32) -> Sqe {
    const _: () = assert!(std::mem::size_of::<Sqe>() == 128);
    const LEN_OFFSET: usize = 24;
    // SAFETY: `Entry128` is `#[repr(C)]`, exactly 128 bytes of plain integers (an `io_uring_sqe`
    // followed by 64 command bytes), with no padding, pointers or drop glue; any bit pattern is a
    // valid value, so a round trip through a byte array is sound.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute::<Sqe, [u8; 128]>(sqe) };
    raw[LEN_OFFSET..LEN_OFFSET + 4].copy_from_slice(&len.to_ne_bytes());
    // SAFETY: as above, in the other direction.
    unsafe { std::mem::transmute::<[u8; 128], Sqe>(raw) }
}
