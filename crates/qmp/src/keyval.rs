//! QEMU's `KEY=VALUE,...` option syntax (what `--blockdev` and `--export` take), parsed to the
//! JSON object the same arguments would be over QMP:
//!
//! - `driver=qcow2,file.driver=file,file.filename=/a.img` → `{"driver": "qcow2", "file":
//!   {"driver": "file", "filename": "/a.img"}}`: dotted keys build nested objects;
//! - `,,` in a value is a literal comma (`filename=/a,,b.img` → `/a,b.img`); a trailing `,` is
//!   allowed;
//! - an object whose keys are all decimal numbers `0..n` becomes an array (`a.0=x,a.1=y`);
//! - with an implied key, the first item may be a bare value (`qcow2,file=...` with implied key
//!   `driver`); it cannot contain `,` or `=`;
//! - every value stays a string (`writable=on` → `"on"`): QEMU converts them by the command's
//!   schema, here [`convert`] does it for the fields the caller names;
//! - a key given twice is an error (QEMU lets the last one win; fusex refuses it as the likely
//!   typo it is);
//! - an argument starting with `{` is JSON instead (`--blockdev '{"driver": ...}'`), which must
//!   be an object without duplicate keys; its values keep their JSON types.
//!
//! Key fragments are QAPI names (a letter, then letters, digits, `-` and `_`, at most 127
//! characters) or, after the first, list indexes; a downstream name (`__org.fusex_transport`,
//! QMP's convention for a vendor's own members) is one fragment, dots and all. QEMU's `help`/`?`
//! is not supported.

use serde_json::{Map, Value};

use crate::json::parse_strict;

/// A keyval argument that cannot be parsed or converted; the message names the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct KeyvalError(pub String);

fn err<T>(msg: String) -> Result<T, KeyvalError> {
    Err(KeyvalError(msg))
}

const MAX_FRAGMENT: usize = 127;

fn is_qapi_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

fn is_index(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

/// Parses `input` (keyval, or JSON when it starts with `{`) into a JSON object. `implied_key`
/// names the key a bare first value belongs to (QEMU's `--blockdev` has none; `-drive`-style
/// options have `driver` or `file`).
pub fn parse(input: &str, implied_key: Option<&str>) -> Result<Map<String, Value>, KeyvalError> {
    if input.starts_with('{') {
        return match parse_strict(input) {
            Ok(Value::Object(m)) => Ok(m),
            Ok(_) => err("JSON argument must be an object".into()),
            Err(e) => err(format!("JSON parse error, {e}")),
        };
    }
    let mut root = Map::new();
    let mut rest = input;
    let mut first = true;
    while !rest.is_empty() {
        let stop = rest.find(['=', ',']).unwrap_or(rest.len());
        let (key, value);
        if first && stop > 0 && !rest[stop..].starts_with('=') && implied_key.is_some() {
            key = implied_key.unwrap_or_default().to_owned();
            value = rest[..stop].to_owned();
            rest = rest[stop..].strip_prefix(',').unwrap_or(&rest[stop..]);
        } else {
            if !rest[stop..].starts_with('=') {
                return err(format!("Expected '=' after parameter '{}'", &rest[..stop]));
            }
            key = rest[..stop].to_owned();
            let mut v = String::new();
            let mut tail = &rest[stop + 1..];
            loop {
                let end = tail.find(',').unwrap_or(tail.len());
                v.push_str(&tail[..end]);
                tail = &tail[end..];
                if let Some(t) = tail.strip_prefix(",,") {
                    v.push(',');
                    tail = t;
                } else {
                    tail = tail.strip_prefix(',').unwrap_or(tail);
                    break;
                }
            }
            value = v;
            rest = tail;
        }
        first = false;
        put(&mut root, &key, value)?;
    }
    let mut root = Value::Object(root);
    listify(&mut root, "")?;
    match root {
        Value::Object(m) => Ok(m),
        _ => unreachable!("the root's keys are QAPI names, never indexes"),
    }
}

/// A key's fragments: split at dots, except inside a downstream name (`__RFQDN_name`, QMP's
/// convention for a vendor's extensions: `__org.fusex_transport` is one fragment), whose dots
/// belong to the domain up to the `_` that ends it.
fn fragments(key: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = key;
    loop {
        let end = match rest.strip_prefix("__") {
            // The name ends at the first dot after the `_` that ends the domain.
            Some(tail) => tail
                .find('_')
                .and_then(|u| tail[u..].find('.').map(|d| 2 + u + d)),
            None => rest.find('.'),
        };
        match end {
            Some(e) => {
                out.push(&rest[..e]);
                rest = &rest[e + 1..];
            }
            None => {
                out.push(rest);
                return out;
            }
        }
    }
}

/// A downstream name: `__`, a reverse domain name, `_`, a QAPI name.
fn is_downstream_name(s: &str) -> bool {
    let Some(tail) = s.strip_prefix("__") else {
        return false;
    };
    let Some((domain, name)) = tail.split_once('_') else {
        return false;
    };
    !domain.is_empty()
        && domain
            .split('.')
            .all(|l| !l.is_empty() && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'))
        && (is_qapi_name(name) || name.chars().next().is_some_and(|c| c.is_ascii_digit()))
}

/// Stores `value` at the dotted `key`, creating the objects on the way.
fn put(root: &mut Map<String, Value>, key: &str, value: String) -> Result<(), KeyvalError> {
    let frags = fragments(key);
    for (i, f) in frags.iter().enumerate() {
        let ok = is_qapi_name(f) || is_downstream_name(f) || (i > 0 && is_index(f));
        if !ok {
            return err(format!("Invalid parameter '{key}'"));
        }
        if f.len() > MAX_FRAGMENT {
            return err(format!("Parameter '{f}' is too long"));
        }
    }
    let mut cur = root;
    for (i, f) in frags[..frags.len() - 1].iter().enumerate() {
        let node = cur
            .entry(f.to_string())
            .or_insert_with(|| Value::Object(Map::new()));
        match node {
            Value::Object(m) => cur = m,
            _ => {
                return err(format!(
                    "Parameters '{}.*' used inconsistently",
                    frags[..=i].join(".")
                ))
            }
        }
    }
    let leaf = frags[frags.len() - 1];
    match cur.get(leaf) {
        None => {
            cur.insert(leaf.to_owned(), Value::String(value));
            Ok(())
        }
        Some(Value::String(_)) => err(format!("Parameter '{key}' is given more than once")),
        Some(_) => err(format!("Parameters '{key}.*' used inconsistently")),
    }
}

/// Turns every object below `v` whose keys are all indexes into an array. `path` is `v`'s
/// dotted path with a trailing dot (empty at the root).
fn listify(v: &mut Value, path: &str) -> Result<(), KeyvalError> {
    let Value::Object(m) = v else { return Ok(()) };
    for (k, child) in m.iter_mut() {
        listify(child, &format!("{path}{k}."))?;
    }
    if path.is_empty() || m.is_empty() {
        return Ok(());
    }
    let indexes = m.keys().filter(|k| is_index(k)).count();
    if indexes == 0 {
        return Ok(());
    }
    if indexes != m.len() {
        return err(format!("Parameters '{path}*' used inconsistently"));
    }
    let mut slots: Vec<Option<Value>> = vec![None; m.len()];
    for (k, child) in std::mem::take(m) {
        let n: usize = k.parse().unwrap_or(usize::MAX);
        match slots.get_mut(n) {
            Some(slot @ None) => *slot = Some(child),
            Some(Some(_)) => return err(format!("Parameter '{path}{n}' is given more than once")),
            None => {
                let missing = (0..)
                    .find(|&i| !matches!(slots.get(i), Some(Some(_))))
                    .unwrap_or(0);
                return err(format!("Parameter '{path}{missing}' missing"));
            }
        }
    }
    *v = Value::Array(
        slots
            .into_iter()
            .map(|s| s.unwrap_or(Value::Null))
            .collect(),
    );
    Ok(())
}

/// The type a keyval string converts to (QEMU's keyval input visitor's rules).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `on`/`yes`/`true` or `off`/`no`/`false`.
    Bool,
    /// A signed integer: decimal, or hex with `0x`.
    Int,
    /// An unsigned integer: decimal, or hex with `0x`.
    Uint,
    /// A byte count with an optional binary suffix: `512`, `4k`, `1.5G` (`B`, `k`/`K`, `M`,
    /// `G`, `T`, `P`, `E`).
    Size,
}

/// Converts the string values at the dotted paths in `schema` to their kinds, in place.
/// A `*` fragment matches every element of an array (or member of an object). Values that are
/// absent, or not strings (a JSON argument already has types), are left alone: type errors in
/// those come from [`crate::parse_args`].
pub fn convert(args: &mut Map<String, Value>, schema: &[(&str, Kind)]) -> Result<(), KeyvalError> {
    for (path, kind) in schema {
        let frags: Vec<&str> = path.split('.').collect();
        for (key, v) in args.iter_mut() {
            if frags[0] == "*" || frags[0] == key {
                convert_at(v, &frags[1..], key, *kind)?;
            }
        }
    }
    Ok(())
}

fn convert_at(v: &mut Value, frags: &[&str], name: &str, kind: Kind) -> Result<(), KeyvalError> {
    let Some((first, rest)) = frags.split_first() else {
        if let Value::String(s) = v {
            *v = convert_one(s, name, kind)?;
        }
        return Ok(());
    };
    match v {
        Value::Object(m) => {
            for (k, child) in m.iter_mut() {
                if *first == "*" || first == k {
                    convert_at(child, rest, &format!("{name}.{k}"), kind)?;
                }
            }
        }
        Value::Array(a) => {
            for (i, child) in a.iter_mut().enumerate() {
                if *first == "*" || *first == i.to_string() {
                    convert_at(child, rest, &format!("{name}.{i}"), kind)?;
                }
            }
        }
        _ => {}
    }
    Ok(())
}

fn parse_u64(s: &str) -> Option<u64> {
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

fn convert_one(s: &str, name: &str, kind: Kind) -> Result<Value, KeyvalError> {
    match kind {
        Kind::Bool => match s {
            "on" | "yes" | "true" => Ok(Value::Bool(true)),
            "off" | "no" | "false" => Ok(Value::Bool(false)),
            _ => err(format!("Parameter '{name}' expects 'on' or 'off'")),
        },
        Kind::Int => {
            let n = match s.strip_prefix('-') {
                Some(abs) => parse_u64(abs).and_then(|n| 0i64.checked_sub_unsigned(n)),
                None => parse_u64(s).and_then(|n| i64::try_from(n).ok()),
            };
            n.map(Value::from).ok_or_else(|| KeyvalError(format!("Parameter '{name}' expects integer")))
        }
        Kind::Uint => parse_u64(s).map(Value::from).ok_or_else(|| KeyvalError(format!("Parameter '{name}' expects integer"))),
        Kind::Size => parse_size(s).map(Value::from).ok_or_else(|| {
            KeyvalError(format!(
                "Parameter '{name}' expects a size: a non-negative number below 2^64 with an optional B, k, M, G, T, P or E suffix"
            ))
        }),
    }
}

fn parse_size(s: &str) -> Option<u64> {
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, suffix) = s.split_at(split);
    let shift = match suffix {
        "" | "B" | "b" => 0,
        "k" | "K" => 10,
        "m" | "M" => 20,
        "g" | "G" => 30,
        "t" | "T" => 40,
        "p" | "P" => 50,
        "e" | "E" => 60,
        _ => return None,
    };
    if num.is_empty() || num.starts_with('.') {
        return None;
    }
    if let Some((int, frac)) = num.split_once('.') {
        // A fraction only makes sense with a suffix (1.5G); QEMU refuses 1.5 bytes too.
        if shift == 0 || frac.is_empty() || frac.contains('.') {
            return None;
        }
        let int: u64 = int.parse().ok()?;
        let whole = int.checked_shl(shift).filter(|v| v >> shift == int)?;
        let frac_val: f64 = format!("0.{frac}").parse().ok()?;
        let extra = (frac_val * (1u64 << shift) as f64) as u64;
        return whole.checked_add(extra);
    }
    let n: u64 = num.parse().ok()?;
    n.checked_shl(shift).filter(|v| v >> shift == n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn p(s: &str) -> Value {
        Value::Object(parse(s, None).unwrap())
    }

    fn e(s: &str) -> String {
        parse(s, None).unwrap_err().0
    }

    #[test]
    fn downstream_names_keep_their_dots() {
        assert_eq!(
            p("type=fuse,__org.fusex_transport=legacy,a.__org.fusex_q=1"),
            json!({"type": "fuse", "__org.fusex_transport": "legacy",
                   "a": {"__org.fusex_q": "1"}})
        );
        assert_eq!(p("__org.fusex_x.y=1"), json!({"__org.fusex_x": {"y": "1"}}));
        assert_eq!(e("__org.fusex=1"), "Invalid parameter '__org.fusex'");
    }

    #[test]
    fn qsd_command_lines() {
        assert_eq!(
            p("driver=qcow2,node-name=disk,file.driver=file,file.filename=/a,,b.img"),
            json!({"driver": "qcow2", "node-name": "disk", "file": {"driver": "file", "filename": "/a,b.img"}})
        );
        assert_eq!(
            p("type=fuse,id=e,node-name=disk,mountpoint=/x,writable=on"),
            json!({"type": "fuse", "id": "e", "node-name": "disk", "mountpoint": "/x", "writable": "on"})
        );
    }

    #[test]
    fn escapes_empty_values_and_trailing_comma() {
        assert_eq!(p("a=,,"), json!({"a": ","}));
        assert_eq!(p("a=x,,,,y,b=1,"), json!({"a": "x,,y", "b": "1"}));
        assert_eq!(p("a=,b=2"), json!({"a": "", "b": "2"}));
        assert_eq!(p("a=x=y"), json!({"a": "x=y"}));
        assert_eq!(p(""), json!({}));
    }

    #[test]
    fn nesting_and_lists() {
        assert_eq!(
            p("a.b.c=1,a.b.d=2,a.e=3"),
            json!({"a": {"b": {"c": "1", "d": "2"}, "e": "3"}})
        );
        assert_eq!(p("l.1=y,l.0=x"), json!({"l": ["x", "y"]}));
        assert_eq!(p("l.0.a=1,l.1.a=2"), json!({"l": [{"a": "1"}, {"a": "2"}]}));
        assert_eq!(e("l.0=x,l.2=z"), "Parameter 'l.1' missing");
        assert_eq!(e("l.0=x,l.a=z"), "Parameters 'l.*' used inconsistently");
        assert_eq!(e("l.1=x,l.01=z"), "Parameter 'l.1' is given more than once");
    }

    #[test]
    fn implied_key() {
        let m = parse("qcow2,file=x", Some("driver")).unwrap();
        assert_eq!(Value::Object(m), json!({"driver": "qcow2", "file": "x"}));
        let m = parse("driver=raw", Some("driver")).unwrap();
        assert_eq!(Value::Object(m), json!({"driver": "raw"}));
        assert_eq!(
            parse("qcow2", None).unwrap_err().0,
            "Expected '=' after parameter 'qcow2'"
        );
        assert_eq!(
            parse("a=1,b", Some("driver")).unwrap_err().0,
            "Expected '=' after parameter 'b'"
        );
    }

    #[test]
    fn errors_name_the_key() {
        assert_eq!(e("a=1,a=2"), "Parameter 'a' is given more than once");
        assert_eq!(e("a.b=1,a.b=2"), "Parameter 'a.b' is given more than once");
        assert_eq!(e("a=1,a.b=2"), "Parameters 'a.*' used inconsistently");
        assert_eq!(e("a.b=1,a=2"), "Parameters 'a.*' used inconsistently");
        assert_eq!(e("=1"), "Invalid parameter ''");
        assert_eq!(e("a..b=1"), "Invalid parameter 'a..b'");
        assert_eq!(e("1a=1"), "Invalid parameter '1a'");
        assert_eq!(e("0=1"), "Invalid parameter '0'");
        assert_eq!(e("a b=1"), "Invalid parameter 'a b'");
        assert_eq!(e("a,b=1"), "Expected '=' after parameter 'a'");
        let long = "k".repeat(128);
        assert_eq!(
            e(&format!("{long}=1")),
            format!("Parameter '{long}' is too long")
        );
        assert!(parse(&format!("{}=1", "k".repeat(127)), None).is_ok());
    }

    #[test]
    fn json_form() {
        assert_eq!(
            p(r#"{"driver": "qcow2", "file": {"filename": "/a,b"}, "ro": true}"#),
            json!({"driver": "qcow2", "file": {"filename": "/a,b"}, "ro": true})
        );
        assert_eq!(e(r#"{"a": 1, "a": 2}"#), "JSON parse error, duplicate key");
        assert!(e(r#"{"a": "#).starts_with("JSON parse error, "));
        assert_eq!(e("{}x").split(',').next().unwrap(), "JSON parse error");
    }

    #[test]
    fn conversion_by_schema() {
        let mut m = parse(
            "writable=on,ro=no,n=-5,h=0x10,size=1.5k,l.0.x=1,l.1.x=2,f.s=4M,keep=on",
            None,
        )
        .unwrap();
        convert(
            &mut m,
            &[
                ("writable", Kind::Bool),
                ("ro", Kind::Bool),
                ("n", Kind::Int),
                ("h", Kind::Uint),
                ("size", Kind::Size),
                ("l.*.x", Kind::Uint),
                ("f.s", Kind::Size),
                ("absent", Kind::Bool),
            ],
        )
        .unwrap();
        assert_eq!(
            Value::Object(m),
            json!({"writable": true, "ro": false, "n": -5, "h": 16, "size": 1536, "l": [{"x": 1}, {"x": 2}],
                   "f": {"s": 4u64 << 20}, "keep": "on"})
        );
        let mut m = parse("w=maybe,n=1x,s=1.5,z=-1,big=16E", None).unwrap();
        let one = |m: &mut Map<String, Value>, f: &str, k| convert(m, &[(f, k)]).unwrap_err().0;
        assert_eq!(
            one(&mut m, "w", Kind::Bool),
            "Parameter 'w' expects 'on' or 'off'"
        );
        assert_eq!(one(&mut m, "n", Kind::Int), "Parameter 'n' expects integer");
        assert_eq!(
            one(&mut m, "z", Kind::Uint),
            "Parameter 'z' expects integer"
        );
        assert!(one(&mut m, "s", Kind::Size).starts_with("Parameter 's' expects a size"));
        assert!(one(&mut m, "big", Kind::Size).starts_with("Parameter 'big' expects a size"));
        let mut m = parse(r#"{"w": true}"#, None).unwrap();
        convert(&mut m, &[("w", Kind::Bool)]).unwrap();
        assert_eq!(m["w"], json!(true), "JSON values keep their types");
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("0"), Some(0));
        assert_eq!(parse_size("512B"), Some(512));
        assert_eq!(parse_size("1G"), Some(1 << 30));
        assert_eq!(parse_size("15E"), Some(15 << 60));
        assert_eq!(parse_size("1.5"), None);
        assert_eq!(parse_size("k"), None);
        assert_eq!(parse_size("1Q"), None);
        assert_eq!(parse_size(&u64::MAX.to_string()), Some(u64::MAX));
    }
}
