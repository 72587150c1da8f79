//! The `qmp_input` target: what a control-socket client sends, through the QMP session state
//! machine (`qmp::Session`: the framer that cuts a byte stream into JSON values, the strict
//! parser that refuses duplicate keys, negotiation, the request's shape, typed arguments with
//! QEMU's error texts), and QEMU's `key=value` option syntax (`qmp::keyval`, which `fusex serve`'s
//! `--blockdev`, `--export` and `--object` are written in). Nothing may panic; every reply is a
//! `return` or an `error` with a class and a text; what keyval accepts is an object that reads
//! back the same from its JSON form.

use std::sync::Arc;

use qmp::keyval::{self, Kind};
use qmp::{parse_args, Dispatcher, QmpError, ServerInfo, Session};
use serde::Deserialize;
use serde_json::{Map, Value};

/// Requests longer than this are refused (and the connection closed): small, so the fuzzer
/// reaches the limit.
pub const MAX_REQUEST: usize = 4096;

/// What one input reached, for the seed tests.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Summary {
    /// Replies with `return`.
    pub returns: usize,
    /// Replies with `error`.
    pub errors: usize,
    /// Negotiation ended (`qmp_capabilities` succeeded).
    pub command_mode: bool,
    /// The session asked for the connection to close (a request over the limit).
    pub closed: bool,
    /// keyval input parsed into an object.
    pub keyval_ok: bool,
}

/// A dispatcher with commands that take typed arguments the way fusex's do.
struct Commands;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
#[allow(dead_code)] // read for their types only
struct Typed {
    id: String,
    node_name: Option<String>,
    writable: Option<bool>,
    size: Option<u64>,
    mode: Option<Mode>,
    file: Option<Child>,
    list: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
enum Mode {
    Safe,
    Hard,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
#[allow(dead_code)]
struct Child {
    driver: String,
    filename: Option<String>,
}

impl Dispatcher for Commands {
    fn commands(&self) -> Vec<String> {
        vec!["echo".into(), "typed".into(), "fail".into()]
    }

    fn dispatch(&self, name: &str, arguments: Value) -> Result<Value, QmpError> {
        assert!(
            arguments.is_object(),
            "arguments reach a command as an object"
        );
        match name {
            "echo" => Ok(arguments),
            "typed" => parse_args::<Typed>(arguments).map(|_| Value::Object(Map::new())),
            "fail" => Err(QmpError::generic("failed as asked")),
            other => panic!("the session dispatched an unlisted command {other:?}"),
        }
    }
}

/// The types keyval input converts to, at paths and wildcards of the shapes fusex uses.
const SCHEMA: &[(&str, Kind)] = &[
    ("writable", Kind::Bool),
    ("size", Kind::Size),
    ("n", Kind::Int),
    ("u", Kind::Uint),
    ("file.size", Kind::Size),
    ("l.*", Kind::Uint),
    ("*.b", Kind::Bool),
];

/// The implied first key of keyval input, by a setup bit pair: none (`--blockdev`), `type`
/// (`--export`), `qom-type` (`--object`), `backend` (`--chardev`).
const IMPLIED: [Option<&str>; 4] = [None, Some("type"), Some("qom-type"), Some("backend")];

/// One input: a setup byte, then the bytes. An even setup byte feeds the bytes to a session
/// (its bits 1-2 choose the chunk size: all at once, 1, 7 or 61 bytes; bit 3 negotiates
/// first); an odd one parses them as keyval (bits 1-2 choose the implied key).
pub fn run(data: &[u8]) -> Summary {
    let Some((&setup, rest)) = data.split_first() else {
        return Summary::default();
    };
    if setup & 1 == 0 {
        session(setup, rest)
    } else {
        options(setup, rest)
    }
}

fn session(setup: u8, bytes: &[u8]) -> Summary {
    let mut s = Session::new(
        Arc::new(Commands),
        Arc::new(ServerInfo::default()),
        MAX_REQUEST,
    );
    let mut sum = Summary::default();
    if setup & 8 != 0 {
        let out = s.feed(br#"{"execute": "qmp_capabilities"}"#);
        assert_eq!(out.replies.len(), 1);
        assert!(out.replies[0].get("return").is_some(), "{:?}", out.replies);
    }
    let chunk = match (setup >> 1) & 3 {
        0 => bytes.len().max(1),
        1 => 1,
        2 => 7,
        _ => 61,
    };
    for piece in bytes.chunks(chunk) {
        let out = s.feed(piece);
        for r in &out.replies {
            check_reply(r, &mut sum);
        }
        if out.close {
            sum.closed = true;
            break;
        }
    }
    sum.command_mode = s.command_mode();
    sum
}

/// A reply is an object with exactly one of `return` and `error` (besides an optional `id`),
/// and an error has a class and a text.
fn check_reply(r: &Value, sum: &mut Summary) {
    let obj = r.as_object().expect("a reply is an object");
    assert!(
        obj.keys()
            .all(|k| k == "return" || k == "error" || k == "id"),
        "unexpected member in {r}"
    );
    match (obj.get("return"), obj.get("error")) {
        (Some(_), None) => sum.returns += 1,
        (None, Some(e)) => {
            assert!(e["class"].is_string() && e["desc"].is_string(), "{r}");
            assert!(!e["desc"].as_str().unwrap_or_default().is_empty(), "{r}");
            sum.errors += 1;
        }
        _ => panic!("a reply with neither or both of return and error: {r}"),
    }
}

fn options(setup: u8, bytes: &[u8]) -> Summary {
    let text = String::from_utf8_lossy(bytes);
    let implied = IMPLIED[usize::from((setup >> 1) & 3)];
    let Ok(mut map) = keyval::parse(&text, implied) else {
        return Summary::default();
    };
    // The JSON form of what was parsed reads back as the same object.
    let json = Value::Object(map.clone()).to_string();
    let again = keyval::parse(&json, implied).expect("the JSON form of parsed keyval parses");
    assert_eq!(
        again, map,
        "keyval {text:?} and its JSON form {json} differ"
    );
    let _ = keyval::convert(&mut map, SCHEMA);
    Summary {
        keyval_ok: true,
        ..Summary::default()
    }
}
