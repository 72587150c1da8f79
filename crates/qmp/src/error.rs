//! The errors a QMP client sees (`{"error": {"class": ..., "desc": ...}}`) and the errors the
//! server's own setup returns to the embedder.

use std::fmt;
use std::io;
use std::path::PathBuf;

use serde_json::{json, Value};

/// QEMU's `QapiErrorClass`: the only part of an error a client may match on (the spec says
/// `desc` is for humans), so fusex uses the class QEMU would use for the same failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Everything without a more specific class (almost every QEMU error).
    GenericError,
    /// The command does not exist, or is not allowed in the current mode.
    CommandNotFound,
    /// A device exists but is not active (QEMU: e.g. a block job that is not running).
    DeviceNotActive,
    /// A named device, node or job does not exist.
    DeviceNotFound,
    /// KVM lacks a capability (kept for completeness: QEMU's schema has it).
    KvmMissingCap,
}

impl ErrorClass {
    /// The class as it is spelled on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::GenericError => "GenericError",
            ErrorClass::CommandNotFound => "CommandNotFound",
            ErrorClass::DeviceNotActive => "DeviceNotActive",
            ErrorClass::DeviceNotFound => "DeviceNotFound",
            ErrorClass::KvmMissingCap => "KVMMissingCap",
        }
    }
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A command's failure as the client sees it: what a [`crate::Dispatcher`] returns and what the
/// protocol layer answers for malformed input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{class}: {desc}")]
pub struct QmpError {
    /// The machine-readable class.
    pub class: ErrorClass,
    /// The human-readable description (QEMU's wording where QEMU has one).
    pub desc: String,
}

impl QmpError {
    /// A `GenericError`, the class of nearly every failure.
    pub fn generic(desc: impl Into<String>) -> Self {
        QmpError {
            class: ErrorClass::GenericError,
            desc: desc.into(),
        }
    }

    /// An error of any class.
    pub fn new(class: ErrorClass, desc: impl Into<String>) -> Self {
        QmpError {
            class,
            desc: desc.into(),
        }
    }

    /// QEMU's answer to a command nobody registered: `The command NAME has not been found`.
    pub fn command_not_found(name: &str) -> Self {
        QmpError::new(
            ErrorClass::CommandNotFound,
            format!("The command {name} has not been found"),
        )
    }

    /// The `error` member of a reply: `{"class": ..., "desc": ...}`.
    pub fn to_json(&self) -> Value {
        json!({ "class": self.class.as_str(), "desc": self.desc })
    }
}

/// Why the server could not start or stopped: for the embedder, never sent to a client.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The socket path has no parent directory or no file name.
    #[error("QMP socket path {0} is not a file path")]
    BadPath(PathBuf),
    /// Another server answers on the path: replacing its socket would cut it off.
    #[error("QMP socket {0} is in use by another server (stop it or choose another path)")]
    InUse(PathBuf),
    /// Something that is not a socket is in the way.
    #[error("QMP socket path {0} exists and is not a socket (remove it or choose another path)")]
    NotASocket(PathBuf),
    /// A descriptor handed over as the listening socket is not one: a unix stream socket that
    /// listens.
    #[error("QMP socket fd={fd}: {why} (pass a listening unix stream socket)")]
    NotAListener {
        /// The descriptor.
        fd: i32,
        /// What it is instead.
        why: String,
    },
    /// A system call failed; the message names the step and the path.
    #[error("QMP socket {path}: {what}: {err}")]
    Io {
        /// The socket path.
        path: PathBuf,
        /// The step that failed.
        what: &'static str,
        /// The OS error (in the message, so not also a `source()`).
        err: io::Error,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_json_shape() {
        let e = QmpError::command_not_found("nope");
        assert_eq!(
            e.to_json(),
            json!({"class": "CommandNotFound", "desc": "The command nope has not been found"})
        );
        assert_eq!(ErrorClass::KvmMissingCap.as_str(), "KVMMissingCap");
        assert_eq!(QmpError::generic("x").to_string(), "GenericError: x");
    }

    #[test]
    fn io_error_is_named_once() {
        let e = ServerError::Io {
            path: "/x".into(),
            what: "bind",
            err: io::Error::from_raw_os_error(libc::EACCES),
        };
        assert!(std::error::Error::source(&e).is_none());
        assert!(e
            .to_string()
            .starts_with("QMP socket /x: bind: Permission denied"));
    }
}
