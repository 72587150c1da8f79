//! QMP, the QEMU Machine Protocol, as a server (see `docs/qmp.md` and QEMU's
//! `docs/interop/qmp-spec.rst`), and QEMU's `KEY=VALUE,...` option syntax. The pieces:
//!
//! - [`protocol`]: the messages (greeting, requests and their shape checks, replies, events);
//! - [`json`]: strict JSON input (duplicate keys refused) cut into values;
//! - [`session`]: one client's state machine (negotiation mode, command mode), without I/O;
//! - [`dispatch`]: the [`Dispatcher`] trait the embedder implements for its commands;
//! - [`args`]: typed arguments with QEMU's error texts ([`parse_args`]);
//! - [`events`]: the [`EventBus`] that broadcasts events to clients in command mode;
//! - [`outbox`]: a client's outgoing lines (replies written at once, events queued);
//! - [`server`]: the unix socket server ([`Server`]), synchronous std with a thread per client;
//! - [`keyval`]: `driver=qcow2,file.filename=/a,,b` to a JSON object.
//!
//! Nothing here knows about block devices or exports: the daemon supplies those as commands.

pub mod args;
pub mod dispatch;
pub mod error;
pub mod events;
pub mod json;
pub mod keyval;
pub mod outbox;
pub mod protocol;
pub mod server;
pub mod session;

pub use args::parse_args;
pub use dispatch::{Dispatcher, BUILTIN_COMMANDS};
pub use error::{ErrorClass, QmpError, ServerError};
pub use events::{EventBus, Offered, Queue, SubscriberId};
pub use protocol::{Event, Request, ServerInfo, Timestamp};
pub use server::{peer_credentials, serve_stream, Server, ServerConfig, ShutdownHandle};
pub use session::{Session, DEFAULT_MAX_REQUEST};
