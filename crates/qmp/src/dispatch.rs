//! What the embedder implements: the commands beyond QMP's built-in ones.

use serde_json::Value;

use crate::error::QmpError;

/// The embedder's commands. The server handles `qmp_capabilities`, `query-version` and
/// `query-commands` itself (a dispatcher command with one of those names is never called) and
/// answers `CommandNotFound` for names [`Dispatcher::commands`] does not list, so `dispatch`
/// sees only its own commands.
///
/// Each client has its own thread and calls `dispatch` from it, so calls from different clients
/// may run at the same time: a dispatcher whose commands must not overlap (QEMU runs every
/// command under one big lock) takes its own lock. A client's next command waits for its
/// previous one, as in QEMU.
pub trait Dispatcher: Send + Sync {
    /// The command names, in the order `query-commands` lists them (after the built-in ones).
    fn commands(&self) -> Vec<String>;

    /// Runs `name` with `arguments` (always a JSON object: `{}` when the client sent none).
    /// The `Ok` value is the reply's `return` member; QEMU's commands without a result return
    /// `{}`. Parse typed arguments with [`crate::parse_args`] for QEMU's error texts.
    fn dispatch(&self, name: &str, arguments: Value) -> Result<Value, QmpError>;
}

/// The built-in commands, which every QMP server has and `query-commands` lists first.
pub const BUILTIN_COMMANDS: [&str; 3] = ["qmp_capabilities", "query-version", "query-commands"];
