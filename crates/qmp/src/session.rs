//! One client's protocol state machine, without I/O: bytes in, replies out. The server runs one
//! per connection; tests drive it directly.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use serde_json::{json, Value};

use crate::dispatch::{Dispatcher, BUILTIN_COMMANDS};
use crate::error::{ErrorClass, QmpError};
use crate::json::{Frame, Framer};
use crate::protocol::{reply_err, reply_ok, Request, ServerInfo};

/// The longest request (or unfinished run of input) a client may send by default: 1 MiB, far
/// above any real command (a `blockdev-add` is a few hundred bytes) and small enough that many
/// clients cannot exhaust memory.
pub const DEFAULT_MAX_REQUEST: usize = 1 << 20;

/// What feeding bytes to a [`Session`] produced.
#[derive(Debug, Default, PartialEq)]
pub struct Output {
    /// Replies to send, in order.
    pub replies: Vec<Value>,
    /// The connection must close after the replies are sent (input over the size limit).
    pub close: bool,
}

/// A client's state: capabilities negotiation mode until `qmp_capabilities` succeeds, then
/// command mode (events are only sent in command mode).
pub struct Session {
    dispatcher: Arc<dyn Dispatcher>,
    info: Arc<ServerInfo>,
    command_mode: bool,
    framer: Framer,
    pending: VecDeque<Frame>,
    max_request: usize,
}

impl Session {
    /// A session in negotiation mode that refuses requests over `max_request` bytes.
    pub fn new(dispatcher: Arc<dyn Dispatcher>, info: Arc<ServerInfo>, max_request: usize) -> Self {
        Session {
            dispatcher,
            info,
            command_mode: false,
            framer: Framer::new(max_request),
            pending: VecDeque::new(),
            max_request,
        }
    }

    /// The greeting to send first.
    pub fn greeting(&self) -> Value {
        self.info.greeting()
    }

    /// Whether negotiation is done (the client should now get events).
    pub fn command_mode(&self) -> bool {
        self.command_mode
    }

    /// Takes bytes from the client and answers every request they complete.
    pub fn feed(&mut self, bytes: &[u8]) -> Output {
        self.push(bytes);
        let mut out = Output::default();
        while let Some((reply, close)) = self.next_reply() {
            out.replies.push(reply);
            out.close |= close;
        }
        out
    }

    /// Takes bytes from the client without running anything yet: [`Session::next_reply`] runs
    /// the requests one at a time, so the caller can act between them (the server subscribes the
    /// client to events right after the reply that ends negotiation, before the next request
    /// runs and perhaps emits one).
    pub fn push(&mut self, bytes: &[u8]) {
        let frames = self.framer.push(bytes);
        self.pending.extend(frames);
    }

    /// Runs the next complete request and returns its reply, and whether the connection must
    /// close after it (input over the size limit).
    pub fn next_reply(&mut self) -> Option<(Value, bool)> {
        match self.pending.pop_front()? {
            Frame::Value(v) => Some((self.handle_value(v), false)),
            Frame::ParseError(msg) => Some((
                reply_err(&QmpError::generic(format!("JSON parse error, {msg}")), None),
                false,
            )),
            Frame::TooLong => {
                self.pending.clear();
                let e = QmpError::generic(format!(
                    "JSON parse error, input exceeds the limit of {} bytes",
                    self.max_request
                ));
                Some((reply_err(&e, None), true))
            }
        }
    }

    /// Answers one parsed JSON value.
    pub fn handle_value(&mut self, v: Value) -> Value {
        match Request::from_value(v) {
            Ok(req) => {
                let id = req.id.clone();
                match self.execute(req) {
                    Ok(ret) => reply_ok(ret, id),
                    Err(e) => reply_err(&e, id),
                }
            }
            Err(bad) => reply_err(&bad.error, bad.id),
        }
    }

    fn execute(&mut self, req: Request) -> Result<Value, QmpError> {
        let name = req.execute.as_str();
        if !self.command_mode {
            if name != "qmp_capabilities" {
                return Err(QmpError::new(
                    ErrorClass::CommandNotFound,
                    "Expecting capabilities negotiation with 'qmp_capabilities'",
                ));
            }
            check_capabilities(&req.arguments)?;
            self.command_mode = true;
            tracing::debug!("QMP client finished capabilities negotiation");
            return Ok(json!({}));
        }
        match name {
            "qmp_capabilities" => Err(QmpError::new(
                ErrorClass::CommandNotFound,
                "Capabilities negotiation is already complete, command ignored",
            )),
            "query-version" => {
                no_arguments(&req.arguments)?;
                Ok(self.info.version_json())
            }
            "query-commands" => {
                no_arguments(&req.arguments)?;
                let mut names: Vec<String> =
                    BUILTIN_COMMANDS.iter().map(|s| s.to_string()).collect();
                for c in self.dispatcher.commands() {
                    if !names.contains(&c) {
                        names.push(c);
                    }
                }
                Ok(Value::Array(
                    names.into_iter().map(|n| json!({ "name": n })).collect(),
                ))
            }
            _ if self.dispatcher.commands().iter().any(|c| c == name) => {
                tracing::debug!(command = name, "QMP command");
                let d = &self.dispatcher;
                match catch_unwind(AssertUnwindSafe(|| d.dispatch(name, req.arguments))) {
                    Ok(r) => r,
                    Err(_) => {
                        tracing::error!(command = name, "QMP command panicked");
                        Err(QmpError::generic(format!(
                            "Internal error in command {name}"
                        )))
                    }
                }
            }
            _ => Err(QmpError::command_not_found(name)),
        }
    }
}

/// `query-version` and `query-commands` take no arguments.
fn no_arguments(args: &Value) -> Result<(), QmpError> {
    match args.as_object().and_then(|m| m.keys().min()) {
        Some(k) => Err(QmpError::generic(format!("Parameter '{k}' is unexpected"))),
        None => Ok(()),
    }
}

/// `qmp_capabilities`' one argument, `enable`: a list of capabilities to turn on. QEMU's only
/// capability is `oob`, which fusex does not offer, so any non-empty list fails. The texts are
/// QEMU 7.2's (which names a list element 'null').
fn check_capabilities(args: &Value) -> Result<(), QmpError> {
    let Some(obj) = args.as_object() else {
        return Ok(());
    };
    if let Some(k) = obj.keys().filter(|k| *k != "enable").min() {
        return Err(QmpError::generic(format!("Parameter '{k}' is unexpected")));
    }
    let list = match obj.get("enable") {
        None => return Ok(()),
        Some(Value::Array(list)) => list,
        Some(_) => {
            return Err(QmpError::generic(
                "Invalid parameter type for 'enable', expected: array",
            ))
        }
    };
    for cap in list {
        match cap.as_str() {
            None => {
                return Err(QmpError::generic(
                    "Invalid parameter type for 'null', expected: string",
                ))
            }
            Some("oob") => {}
            Some(other) => {
                return Err(QmpError::generic(format!(
                    "Parameter 'null' does not accept value '{other}'"
                )));
            }
        }
    }
    if !list.is_empty() {
        return Err(QmpError::generic("Capability oob not available"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Toy;
    impl Dispatcher for Toy {
        fn commands(&self) -> Vec<String> {
            vec![
                "toy-echo".into(),
                "toy-panic".into(),
                "query-version".into(),
            ]
        }
        fn dispatch(&self, name: &str, arguments: Value) -> Result<Value, QmpError> {
            match name {
                "toy-echo" => Ok(arguments),
                "toy-panic" => panic!("toy"),
                _ => unreachable!("the session only dispatches listed, non-built-in commands"),
            }
        }
    }

    fn session() -> Session {
        let info = ServerInfo {
            major: 1,
            minor: 2,
            micro: 3,
            package: "t".into(),
        };
        Session::new(Arc::new(Toy), Arc::new(info), 4096)
    }

    fn one(s: &mut Session, line: &str) -> Value {
        let out = s.feed(format!("{line}\n").as_bytes());
        assert_eq!(out.replies.len(), 1, "{line}: {out:?}");
        out.replies.into_iter().next().unwrap()
    }

    fn desc(v: &Value) -> (&str, &str) {
        (
            v["error"]["class"].as_str().unwrap(),
            v["error"]["desc"].as_str().unwrap(),
        )
    }

    #[test]
    fn negotiation_mode_allows_only_qmp_capabilities() {
        let mut s = session();
        assert_eq!(s.greeting()["QMP"]["capabilities"], json!([]));
        let r = one(&mut s, r#"{"execute": "query-version", "id": 1}"#);
        assert_eq!(
            desc(&r),
            (
                "CommandNotFound",
                "Expecting capabilities negotiation with 'qmp_capabilities'"
            )
        );
        assert_eq!(r["id"], 1);
        let r = one(&mut s, r#"{"execute": "nope"}"#);
        assert_eq!(desc(&r).0, "CommandNotFound");
        assert!(!s.command_mode());
        assert_eq!(
            one(&mut s, r#"{"execute": "qmp_capabilities", "id": "c"}"#),
            json!({"return": {}, "id": "c"})
        );
        assert!(s.command_mode());
        let r = one(&mut s, r#"{"execute": "qmp_capabilities"}"#);
        assert_eq!(
            desc(&r),
            (
                "CommandNotFound",
                "Capabilities negotiation is already complete, command ignored"
            )
        );
    }

    #[test]
    fn capability_arguments() {
        let mut s = session();
        let r = one(
            &mut s,
            r#"{"execute": "qmp_capabilities", "arguments": {"enable": ["oob"]}}"#,
        );
        assert_eq!(desc(&r), ("GenericError", "Capability oob not available"));
        let r = one(
            &mut s,
            r#"{"execute": "qmp_capabilities", "arguments": {"enable": ["nope"]}}"#,
        );
        assert_eq!(desc(&r).1, "Parameter 'null' does not accept value 'nope'");
        let r = one(
            &mut s,
            r#"{"execute": "qmp_capabilities", "arguments": {"enable": "oob"}}"#,
        );
        assert_eq!(
            desc(&r).1,
            "Invalid parameter type for 'enable', expected: array"
        );
        let r = one(
            &mut s,
            r#"{"execute": "qmp_capabilities", "arguments": {"foo": 1}}"#,
        );
        assert_eq!(desc(&r).1, "Parameter 'foo' is unexpected");
        assert!(
            !s.command_mode(),
            "a failed negotiation stays in negotiation mode"
        );
        assert_eq!(
            one(
                &mut s,
                r#"{"execute": "qmp_capabilities", "arguments": {"enable": []}}"#
            ),
            json!({"return": {}})
        );
    }

    #[test]
    fn command_mode_builtins_and_dispatch() {
        let mut s = session();
        one(&mut s, r#"{"execute": "qmp_capabilities"}"#);
        let r = one(&mut s, r#"{"execute": "query-version"}"#);
        assert_eq!(
            r["return"],
            json!({"qemu": {"major": 1, "minor": 2, "micro": 3}, "package": "t"})
        );
        let r = one(
            &mut s,
            r#"{"execute": "query-version", "arguments": {"x": 1}}"#,
        );
        assert_eq!(desc(&r).1, "Parameter 'x' is unexpected");
        let r = one(&mut s, r#"{"execute": "query-commands"}"#);
        assert_eq!(
            r["return"],
            json!([{"name": "qmp_capabilities"}, {"name": "query-version"}, {"name": "query-commands"},
                   {"name": "toy-echo"}, {"name": "toy-panic"}])
        );
        let r = one(
            &mut s,
            r#"{"execute": "toy-echo", "arguments": {"a": [1]}, "id": 9}"#,
        );
        assert_eq!(r, json!({"return": {"a": [1]}, "id": 9}));
        let r = one(&mut s, r#"{"execute": "toy-echo"}"#);
        assert_eq!(r, json!({"return": {}}));
        let r = one(&mut s, r#"{"execute": "nope", "id": 3}"#);
        assert_eq!(
            desc(&r),
            ("CommandNotFound", "The command nope has not been found")
        );
        let r = one(&mut s, r#"{"execute": "toy-panic"}"#);
        assert_eq!(
            desc(&r),
            ("GenericError", "Internal error in command toy-panic")
        );
        let r = one(&mut s, r#"{"execute": "query-version"}"#);
        assert!(
            r.get("return").is_some(),
            "the session survives a panicking command"
        );
    }

    #[test]
    fn bad_json_and_shapes() {
        let mut s = session();
        let r = one(&mut s, "xyz");
        assert_eq!(desc(&r).0, "GenericError");
        assert!(desc(&r).1.starts_with("JSON parse error, "), "{r}");
        assert!(r.get("id").is_none());
        let r = one(&mut s, r#"{"execute": "a", "execute": "b"}"#);
        assert_eq!(desc(&r).1, "JSON parse error, duplicate key");
        let r = one(&mut s, r#"{"arguments": {}, "id": 4}"#);
        assert_eq!(desc(&r).1, "QMP input lacks member 'execute'");
        assert_eq!(r["id"], 4);
        let r = one(&mut s, "[]");
        assert_eq!(desc(&r).1, "QMP input must be a JSON object");
        let out = s.feed(b"{\"execute\": \"qmp_capabilities\", \"id\": 1} {\"execute\": \"query-version\", \"id\": 2}\n");
        assert_eq!(out.replies.len(), 2);
        assert_eq!(out.replies[1]["id"], 2);
    }

    #[test]
    fn oversized_input_is_answered_then_closed() {
        let mut s = session();
        let big = format!("{{\"execute\": \"{}\"", "x".repeat(5000));
        let out = s.feed(big.as_bytes());
        assert!(out.close);
        assert_eq!(out.replies.len(), 1);
        assert_eq!(
            desc(&out.replies[0]).1,
            "JSON parse error, input exceeds the limit of 4096 bytes"
        );
    }
}
