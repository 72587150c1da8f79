//! The single-file export: what each FUSE operation means for an image; and the [`Filesystem`]
//! seam through which the server serves it or a directory tree.
//!
//! The export is transport-neutral: a transport decodes a request, turns it into a [`Request`]
//! (no borrowed bytes; WRITE data already sits in the slot's payload window) and calls
//! [`Export::handle`], which leaves any reply body at the start of the payload window. Replies to
//! READ carry the image's bytes read there directly by the backend.

mod counters;
mod filesystem;
mod handle;
pub mod latency;
mod request;

pub use counters::{errno_name, op_name, Counters, Snapshot, Tally, MAX_ERRNO};
pub use filesystem::Filesystem;
pub use handle::{Export, ExportConfig, Passthrough, Reply};
pub use latency::Latency;
pub use request::{Request, Span};
