//! The QMP messages (QEMU's docs/interop/qmp-spec.rst): the greeting, requests and their
//! checks, replies and events. Pure data: no I/O, no state.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};

use crate::error::QmpError;

/// What the greeting and `query-version` report. QMP clients (libvirt among them) gate features
/// on the `qemu` triple, so the embedder chooses it: fusex's own version by default
/// ([`ServerInfo::default`]), or the QEMU release whose behaviour it mirrors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerInfo {
    /// `version.qemu.major`.
    pub major: u64,
    /// `version.qemu.minor`.
    pub minor: u64,
    /// `version.qemu.micro`.
    pub micro: u64,
    /// `version.package`: free text naming the actual program.
    pub package: String,
}

impl Default for ServerInfo {
    /// This crate's version, with `package` saying it is fusex, not QEMU.
    fn default() -> Self {
        let num = |s: &str| s.parse().unwrap_or(0);
        ServerInfo {
            major: num(env!("CARGO_PKG_VERSION_MAJOR")),
            minor: num(env!("CARGO_PKG_VERSION_MINOR")),
            micro: num(env!("CARGO_PKG_VERSION_PATCH")),
            package: format!("fusex {}", env!("CARGO_PKG_VERSION")),
        }
    }
}

impl ServerInfo {
    /// `VersionInfo`: the `version` member of the greeting and `query-version`'s return value.
    pub fn version_json(&self) -> Value {
        json!({
            "qemu": {"micro": self.micro, "minor": self.minor, "major": self.major},
            "package": self.package,
        })
    }

    /// The greeting sent on connect. `capabilities` is empty: fusex implements no optional
    /// capability (no out-of-band execution), and a client must not be told otherwise.
    pub fn greeting(&self) -> Value {
        json!({"QMP": {"version": self.version_json(), "capabilities": []}})
    }
}

/// A well-formed request: `{"execute": NAME, "arguments": {...}, "id": ANY}`.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The command name.
    pub execute: String,
    /// The arguments, `{}` when the client sent none (as QEMU passes them on).
    pub arguments: Value,
    /// The client's id, echoed in the reply; any JSON value.
    pub id: Option<Value>,
}

/// Why a JSON value is not a request, with the id to echo (QEMU echoes it when it could read
/// one, even for a malformed request).
#[derive(Debug, Clone, PartialEq)]
pub struct BadRequest {
    /// The `id` member, if the input was an object that had one.
    pub id: Option<Value>,
    /// The error to answer.
    pub error: QmpError,
}

impl Request {
    /// Checks a JSON value's shape as QEMU's monitor does, with QEMU's texts. `exec-oob` is an
    /// unexpected member: no OOB capability is offered, so none can have been enabled.
    pub fn from_value(v: Value) -> Result<Request, BadRequest> {
        let Value::Object(mut obj) = v else {
            return Err(BadRequest {
                id: None,
                error: QmpError::generic("QMP input must be a JSON object"),
            });
        };
        let id = obj.remove("id");
        let bad = |id: &Option<Value>, desc: String| BadRequest {
            id: id.clone(),
            error: QmpError::generic(desc),
        };
        // Members in a fixed order so the first problem named does not depend on map order.
        let mut keys: Vec<&String> = obj.keys().collect();
        keys.sort();
        for key in keys {
            match key.as_str() {
                "execute" | "arguments" => {}
                other => {
                    return Err(bad(
                        &id,
                        format!("QMP input member '{other}' is unexpected"),
                    ))
                }
            }
        }
        let arguments = match obj.remove("arguments") {
            None => Value::Object(Map::new()),
            Some(a @ Value::Object(_)) => a,
            Some(_) => {
                return Err(bad(
                    &id,
                    "QMP input member 'arguments' must be an object".into(),
                ))
            }
        };
        let execute = match obj.remove("execute") {
            None => return Err(bad(&id, "QMP input lacks member 'execute'".into())),
            Some(Value::String(s)) => s,
            Some(_) => {
                return Err(bad(
                    &id,
                    "QMP input member 'execute' must be a string".into(),
                ))
            }
        };
        Ok(Request {
            execute,
            arguments,
            id,
        })
    }
}

/// A success reply: `{"return": VALUE, "id": ID}` (no `id` member when the request had none).
pub fn reply_ok(ret: Value, id: Option<Value>) -> Value {
    let mut m = Map::new();
    m.insert("return".into(), ret);
    if let Some(id) = id {
        m.insert("id".into(), id);
    }
    Value::Object(m)
}

/// An error reply: `{"error": {"class": ..., "desc": ...}, "id": ID}`.
pub fn reply_err(err: &QmpError, id: Option<Value>) -> Value {
    let mut m = Map::new();
    m.insert("error".into(), err.to_json());
    if let Some(id) = id {
        m.insert("id".into(), id);
    }
    Value::Object(m)
}

/// When an event happened, as QMP reports it: seconds and microseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timestamp {
    /// Whole seconds since the epoch.
    pub seconds: u64,
    /// Microseconds within that second (0..1_000_000).
    pub microseconds: u32,
}

impl Timestamp {
    /// The wall clock now (QEMU uses the realtime clock too). A clock before 1970 gives 0.
    pub fn now() -> Self {
        Self::from_system_time(SystemTime::now())
    }

    /// The timestamp of a given instant.
    pub fn from_system_time(t: SystemTime) -> Self {
        let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
        Timestamp {
            seconds: d.as_secs(),
            microseconds: d.subsec_micros(),
        }
    }
}

/// An asynchronous notification: `{"event": NAME, "data": {...}, "timestamp": {...}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// The event name, upper case by QEMU's convention (`BLOCK_EXPORT_DELETED`).
    pub name: String,
    /// The event's data; `None` leaves the member out, as QEMU does for events without data.
    pub data: Option<Value>,
    /// When it happened.
    pub timestamp: Timestamp,
}

impl Event {
    /// An event stamped now.
    pub fn new(name: impl Into<String>, data: Option<Value>) -> Self {
        Event {
            name: name.into(),
            data,
            timestamp: Timestamp::now(),
        }
    }

    /// The event as sent.
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("event".into(), Value::String(self.name.clone()));
        if let Some(d) = &self.data {
            m.insert("data".into(), d.clone());
        }
        m.insert(
            "timestamp".into(),
            json!({"seconds": self.timestamp.seconds, "microseconds": self.timestamp.microseconds}),
        );
        Value::Object(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn bad(v: Value) -> (Option<Value>, String) {
        let e = Request::from_value(v).unwrap_err();
        (e.id, e.error.desc)
    }

    #[test]
    fn greeting_shape() {
        let info = ServerInfo {
            major: 7,
            minor: 2,
            micro: 22,
            package: "p".into(),
        };
        assert_eq!(
            info.greeting(),
            json!({"QMP": {"version": {"qemu": {"micro": 22, "minor": 2, "major": 7}, "package": "p"}, "capabilities": []}})
        );
        assert!(ServerInfo::default().package.starts_with("fusex "));
    }

    #[test]
    fn requests_parse_with_defaults() {
        let r = Request::from_value(json!({"execute": "x"})).unwrap();
        assert_eq!(
            r,
            Request {
                execute: "x".into(),
                arguments: json!({}),
                id: None
            }
        );
        let r =
            Request::from_value(json!({"execute": "x", "arguments": {"a": 1}, "id": {"k": [1]}}))
                .unwrap();
        assert_eq!(r.arguments, json!({"a": 1}));
        assert_eq!(r.id, Some(json!({"k": [1]})));
    }

    #[test]
    fn malformed_requests_get_qemus_texts() {
        assert_eq!(
            bad(json!([1])),
            (None, "QMP input must be a JSON object".into())
        );
        assert_eq!(
            bad(json!(null)),
            (None, "QMP input must be a JSON object".into())
        );
        assert_eq!(
            bad(json!({"id": 5})),
            (Some(json!(5)), "QMP input lacks member 'execute'".into())
        );
        assert_eq!(
            bad(json!({"execute": 1})).1,
            "QMP input member 'execute' must be a string"
        );
        assert_eq!(
            bad(json!({"execute": "x", "arguments": [], "id": "a"})),
            (
                Some(json!("a")),
                "QMP input member 'arguments' must be an object".into()
            )
        );
        assert_eq!(
            bad(json!({"execute": "x", "arguments": null})).1,
            "QMP input member 'arguments' must be an object"
        );
        assert_eq!(
            bad(json!({"execute": "x", "foo": 1})).1,
            "QMP input member 'foo' is unexpected"
        );
        assert_eq!(
            bad(json!({"execute": "x", "control": {}})).1,
            "QMP input member 'control' is unexpected"
        );
        assert_eq!(
            bad(json!({"exec-oob": "x"})).1,
            "QMP input member 'exec-oob' is unexpected"
        );
    }

    #[test]
    fn replies_echo_the_id_only_when_given() {
        assert_eq!(reply_ok(json!({}), None), json!({"return": {}}));
        assert_eq!(
            reply_ok(json!(1), Some(json!(null))),
            json!({"return": 1, "id": null})
        );
        let e = QmpError::generic("bad");
        assert_eq!(
            reply_err(&e, Some(json!(7))),
            json!({"error": {"class": "GenericError", "desc": "bad"}, "id": 7})
        );
    }

    #[test]
    fn event_timestamps() {
        let t = UNIX_EPOCH + Duration::new(1_700_000_000, 123_456_789);
        let ts = Timestamp::from_system_time(t);
        assert_eq!(
            ts,
            Timestamp {
                seconds: 1_700_000_000,
                microseconds: 123_456
            }
        );
        assert_eq!(
            Timestamp::from_system_time(UNIX_EPOCH - Duration::from_secs(1)).seconds,
            0
        );
        let ev = Event {
            name: "E".into(),
            data: Some(json!({"a": 1})),
            timestamp: ts,
        };
        assert_eq!(
            ev.to_json(),
            json!({"event": "E", "data": {"a": 1}, "timestamp": {"seconds": 1_700_000_000u64, "microseconds": 123_456}})
        );
        let ev = Event {
            name: "E".into(),
            data: None,
            timestamp: ts,
        };
        assert!(ev.to_json().get("data").is_none());
        let now = Timestamp::now();
        assert!(now.seconds > 1_600_000_000 && now.microseconds < 1_000_000);
    }
}
