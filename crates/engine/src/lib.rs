//! The per-thread engine of fusex.
//!
//! One thread owns one [`Engine`]: an io_uring (128-byte SQEs, so FUSE `URING_CMD`s can share
//! the ring with backend I/O), a table of in-flight operations, pools of page-aligned buffers (which
//! take slots of the ring's fixed-buffer table as they are first used), and a tiny single-threaded
//! executor whose only reactor is the ring. An engine may serve many tenants (exports) that come and
//! go while it runs: each adds its own buffer pool ([`Engine::add_pool`]) and fixed files
//! ([`Engine::register_files`]) and gives them back when it leaves, and finished tasks' ids are
//! reused, so nothing grows with the number of tenants ever served. Requests are Rust futures: stackless, polled in place, no thread per request and no
//! allocation per request once the queue has started.
//!
//! Soundness rests on ownership, not on promises:
//! * a [`Buf`] owns one pool buffer and keeps the pool's memory alive, so no safe code reaches
//!   freed memory, even after the engine is gone;
//! * every operation that lends memory to the kernel takes it by value ([`Buf`], [`Slice`]) and
//!   the op table holds it until the operation's terminal completion; the future only gets it
//!   back. Dropping (or forgetting) the future orphans the operation: nothing waits, nothing can
//!   touch the memory, and the slot is not reused before the kernel is done;
//! * SQEs are built only here, in a typed catalog ([`Engine::read`], [`Engine::write`],
//!   [`Engine::uring_cmd`], [`Engine::send`], [`Engine::recv`], ...); no other crate sees
//!   io_uring;
//! * dropping the engine with operations in flight cancels them and waits a bounded time; what
//!   the kernel still holds after that is leaked, never freed.

pub mod borrowed;
pub mod buf;
pub mod clock;
mod executor;
pub mod multishot;
mod net;
mod op;
mod ops;
pub mod remote;
mod scratch;
pub mod sync;
mod table;
mod tenant;
pub mod umask;

pub use buf::{Buf, SendBuf, Slice, BUF_ALIGN};
pub use executor::{
    gauge_clock, Engine, EngineConfig, EngineStats, Gauge, PoolWatch, TaskId, MAX_BUFFER_TABLE,
};
pub use multishot::{BufGroup, Completion, MultiOp};
pub use net::{BytesOp, NetSliceOp, Timeout};
pub use ops::{BufOp, Fd, SliceOp, AT_CURSOR};
pub use remote::{CrossWake, Remote};
pub use tenant::BufPool;

/// The submission entry type every fusex ring uses (128 bytes, so `URING_CMD` with an 80-byte
/// command area fits next to plain reads and writes). Built only inside this crate.
pub(crate) type Sqe = io_uring::squeue::Entry128;

/// Errors that setting up or driving an engine can produce. The OS error is part of each message
/// and not also a `source()`, so a printed error chain names it once.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// `io_uring_setup` failed (kernel without io_uring, or io_uring disabled by sysctl).
    #[error("cannot create io_uring: {0} (is io_uring disabled via /proc/sys/kernel/io_uring_disabled?)")]
    Setup(std::io::Error),
    /// The thread could not get a filesystem context of its own (`unshare(CLONE_FS)`, see
    /// [`umask`]).
    #[error("cannot give the ring's thread a umask of its own (unshare(CLONE_FS)): {0}")]
    Context(std::io::Error),
    /// Allocating the buffer pool failed.
    #[error("cannot allocate {count} I/O buffers of {size} bytes")]
    Alloc {
        /// Buffers asked for.
        count: usize,
        /// Bytes each.
        size: usize,
    },
    /// Registering buffers with the ring failed (fixed buffers, or a pool's provided-buffer
    /// ring).
    #[error("cannot register I/O buffers with io_uring: {0}")]
    Register(std::io::Error),
    /// `io_uring_enter` failed in a way the loop cannot recover from.
    #[error("io_uring_enter failed: {0}")]
    Enter(std::io::Error),
}

#[cfg(test)]
mod tenant_tests;
#[cfg(test)]
mod tests;
