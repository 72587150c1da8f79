//! The FUSE protocol server of fusex, as a library.
//!
//! A request comes in as bytes in an engine buffer, framed one of two ways: the legacy framing
//! (`read(2)` of `/dev/fuse`: header, arguments and WRITE data in one run) or the io_uring framing
//! (a ring entry: header and arguments in the entry's header area, names and WRITE data in its
//! payload). [`QueueServer`] decodes it, hands it to the [`export::Export`], and encodes the reply
//! in the same buffer; [`reply::reply_parts`] is the one place either framing turns a reply into
//! what the kernel reads. None of this needs a kernel: tests feed bytes in and read bytes out over
//! a fake backend. [`slots`] runs the per-buffer request loops over the real transports, and
//! [`queue`] a whole queue thread (its engine, transports and loops, from start to report).

pub mod crew;
pub mod queue;
pub mod reply;
mod serve;
pub mod slots;

pub use crew::{Crew, Handoff};
pub use queue::{QueueError, QueueEvent, QueueReport, QueueSpec, Report, Source};
pub use serve::{LegacyReply, QueueServer};
pub use slots::QueueState;
