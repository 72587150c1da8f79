//! The FUSE protocol server of fusex, as a library.
//!
//! A request comes in as bytes in an engine buffer, framed one of two ways: the legacy framing
//! (`read(2)` of `/dev/fuse`: header, arguments and WRITE data in one run) or the io_uring framing
//! (a ring entry: header and arguments in the entry's header area, names and WRITE data in its
//! payload). [`QueueServer`] decodes it, hands it to the [`export::Export`], and encodes the reply
//! in the same buffer; [`reply::reply_parts`] is the one place either framing turns a reply into
//! what the kernel reads. None of this needs a kernel: tests feed bytes in and read bytes out over
//! a fake backend. [`slots`] runs the per-buffer request loops over the real transports,
//! [`queue`] a whole queue (its transports and loops, from start to report) and [`worker`] the
//! threads whose engines serve the queues of any number of exports.

pub mod crew;
pub mod queue;
pub mod reply;
mod serve;
pub mod slots;
pub mod stats;
pub mod watch;
pub mod worker;

pub use crew::{Crew, Handoff};
pub use queue::{QueueError, QueueEvent, QueueReport, QueueSpec, Report, Source};
pub use serve::{LegacyReply, QueueServer};
pub use slots::QueueState;
pub use stats::ExportStats;
pub use worker::{Job, Workers, WorkersConfig};
