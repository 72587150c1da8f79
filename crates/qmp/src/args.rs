//! Typed command arguments: a command declares a serde struct (with
//! `#[serde(deny_unknown_fields, rename_all = "kebab-case")]`) and [`parse_args`] turns serde's
//! complaints into the texts QEMU's QAPI input visitor gives, naming nested members by their
//! dotted path (`file.driver`) as QEMU does:
//!
//! | problem | text |
//! |---|---|
//! | a member the struct lacks | `Parameter 'x' is unexpected` |
//! | a required member absent | `Parameter 'y' is missing` |
//! | wrong JSON type | `Invalid parameter type for 'z', expected: string` (`integer`, `boolean`, `number`, `array`, `object`) |
//! | unknown enum value | `Parameter 'mode' does not accept value 'bogus'` |
//! | number out of the type's range | `Parameter 'n' expects uint8` |
//!
//! Everything becomes a `GenericError`, QEMU's class for all of these.

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::QmpError;

/// Deserializes a command's `arguments` into `T`, with QEMU's error texts.
pub fn parse_args<T: DeserializeOwned>(arguments: Value) -> Result<T, QmpError> {
    serde_path_to_error::deserialize(arguments).map_err(|e| {
        let path = dotted(e.path());
        QmpError::generic(describe(&path, &e.inner().to_string()))
    })
}

/// QEMU's spelling of a member's path: `a.b`, list elements as `a[0]`.
fn dotted(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    for seg in path.iter() {
        match seg {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key } => join(&mut out, key),
            Segment::Enum { variant } => join(&mut out, variant),
            Segment::Unknown => join(&mut out, "?"),
        }
    }
    out
}

fn join(out: &mut String, name: &str) {
    if !out.is_empty() {
        out.push('.');
    }
    out.push_str(name);
}

fn child(path: &str, name: &str) -> String {
    let mut p = path.to_owned();
    join(&mut p, name);
    p
}

/// The name between the first pair of backquotes in a serde message.
fn quoted(msg: &str) -> Option<&str> {
    let start = msg.find('`')? + 1;
    let len = msg[start..].find('`')?;
    Some(&msg[start..start + len])
}

/// Maps serde's description of an expected type to QAPI's type names.
fn qapi_type(expected: &str) -> String {
    let e = expected.trim();
    let int = |s: &str| {
        s.len() > 1
            && (s.starts_with('u') || s.starts_with('i'))
            && s[1..].chars().all(|c| c.is_ascii_digit())
    };
    if int(e) {
        "integer".into()
    } else if e == "f32" || e == "f64" {
        "number".into()
    } else if e.contains("string")
        || e.contains("char")
        || e.starts_with("enum")
        || e.contains("variant")
    {
        "string".into()
    } else if e.contains("bool") {
        "boolean".into()
    } else if e.contains("sequence") || e.starts_with("tuple") || e.contains("array") {
        "array".into()
    } else if e.starts_with("struct") || e.contains("map") {
        "object".into()
    } else {
        e.into()
    }
}

/// QAPI's name for an integer type in a range error (`u8` → `uint8`).
fn qapi_int_name(expected: &str) -> String {
    let e = expected.trim();
    match e.strip_prefix('u') {
        Some(bits) if bits.chars().all(|c| c.is_ascii_digit()) => format!("uint{bits}"),
        _ => match e.strip_prefix('i') {
            Some(bits) if bits.chars().all(|c| c.is_ascii_digit()) => format!("int{bits}"),
            _ => qapi_type(e),
        },
    }
}

fn describe(path: &str, msg: &str) -> String {
    let expected = msg.rsplit_once(", expected ").map(|(_, e)| e);
    if msg.starts_with("unknown field") {
        // serde_path_to_error already put the unknown member on the path.
        let name = quoted(msg).unwrap_or("?");
        let full = if path == name || path.ends_with(&format!(".{name}")) {
            path.to_owned()
        } else {
            child(path, name)
        };
        format!("Parameter '{full}' is unexpected")
    } else if msg.starts_with("missing field") {
        let name = quoted(msg).unwrap_or("?");
        format!("Parameter '{}' is missing", child(path, name))
    } else if msg.starts_with("unknown variant") {
        let value = quoted(msg).unwrap_or("?");
        format!("Parameter '{path}' does not accept value '{value}'")
    } else if msg.starts_with("invalid type") {
        let t = expected.map_or_else(|| "?".to_owned(), qapi_type);
        format!("Invalid parameter type for '{path}', expected: {t}")
    } else if msg.starts_with("invalid value") || msg.starts_with("invalid length") {
        let t = expected.map_or_else(|| "?".to_owned(), qapi_int_name);
        format!("Parameter '{path}' expects {t}")
    } else if path.is_empty() {
        msg.to_owned()
    } else {
        format!("Parameter '{path}' is invalid: {msg}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use serde_json::json;

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields, rename_all = "kebab-case")]
    struct File {
        driver: String,
        filename: String,
    }

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(rename_all = "kebab-case")]
    enum Mode {
        Safe,
        Hard,
    }

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields, rename_all = "kebab-case")]
    struct Add {
        node_name: String,
        #[serde(default)]
        read_only: Option<bool>,
        #[serde(default)]
        size: Option<u64>,
        #[serde(default)]
        small: Option<u8>,
        #[serde(default)]
        ratio: Option<f64>,
        #[serde(default)]
        mode: Option<Mode>,
        #[serde(default)]
        list: Option<Vec<String>>,
        #[serde(default)]
        file: Option<File>,
    }

    fn err(v: Value) -> String {
        parse_args::<Add>(v).unwrap_err().desc
    }

    #[test]
    fn good_arguments_parse() {
        let a: Add = parse_args(json!({"node-name": "n", "read-only": true, "mode": "hard",
            "file": {"driver": "file", "filename": "/a"}}))
        .unwrap();
        assert_eq!(a.node_name, "n");
        assert_eq!(a.mode, Some(Mode::Hard));
        assert_eq!(a.file.unwrap().filename, "/a");
    }

    #[test]
    fn unexpected_and_missing() {
        assert_eq!(
            err(json!({"node-name": "n", "x": 1})),
            "Parameter 'x' is unexpected"
        );
        assert_eq!(err(json!({})), "Parameter 'node-name' is missing");
        assert_eq!(
            err(json!({"node-name": "n", "file": {"driver": "file"}})),
            "Parameter 'file.filename' is missing"
        );
        assert_eq!(
            err(json!({"node-name": "n", "file": {"driver": "f", "filename": "/a", "bogus": 1}})),
            "Parameter 'file.bogus' is unexpected"
        );
    }

    #[test]
    fn wrong_types() {
        assert_eq!(
            err(json!({"node-name": 1})),
            "Invalid parameter type for 'node-name', expected: string"
        );
        assert_eq!(
            err(json!({"node-name": "n", "read-only": "yes"})),
            "Invalid parameter type for 'read-only', expected: boolean"
        );
        assert_eq!(
            err(json!({"node-name": "n", "size": "x"})),
            "Invalid parameter type for 'size', expected: integer"
        );
        assert_eq!(
            err(json!({"node-name": "n", "size": 1.5})),
            "Invalid parameter type for 'size', expected: integer"
        );
        assert_eq!(
            err(json!({"node-name": "n", "ratio": "x"})),
            "Invalid parameter type for 'ratio', expected: number"
        );
        assert_eq!(
            err(json!({"node-name": "n", "list": "x"})),
            "Invalid parameter type for 'list', expected: array"
        );
        assert_eq!(
            err(json!({"node-name": "n", "list": [1]})),
            "Invalid parameter type for 'list[0]', expected: string"
        );
        assert_eq!(
            err(json!({"node-name": "n", "file": 1})),
            "Invalid parameter type for 'file', expected: object"
        );
        assert_eq!(
            err(json!({"node-name": "n", "mode": 1})),
            "Invalid parameter type for 'mode', expected: string"
        );
        assert_eq!(
            err(json!({"node-name": "n", "file": {"driver": "f", "filename": 1}})),
            "Invalid parameter type for 'file.filename', expected: string"
        );
    }

    #[test]
    fn values_out_of_range_or_set() {
        assert_eq!(
            err(json!({"node-name": "n", "mode": "bogus"})),
            "Parameter 'mode' does not accept value 'bogus'"
        );
        assert_eq!(
            err(json!({"node-name": "n", "small": 300})),
            "Parameter 'small' expects uint8"
        );
        assert_eq!(
            err(json!({"node-name": "n", "size": -1})),
            "Parameter 'size' expects uint64"
        );
    }

    #[test]
    fn no_arguments_type() {
        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Empty {}
        parse_args::<Empty>(json!({})).unwrap();
        assert_eq!(
            parse_args::<Empty>(json!({"a": 1})).unwrap_err().desc,
            "Parameter 'a' is unexpected"
        );
    }
}
