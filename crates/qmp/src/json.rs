//! JSON input as QMP reads it: duplicate keys are errors (QEMU refuses them; serde_json would
//! let the last one win, so `{"execute": "a", "execute": "b"}` would run a command the client
//! may not have meant), and the input is a stream of values with no delimiter ([`Framer`]).

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// A `serde_json::Value` whose objects were checked for duplicate keys while parsing.
#[derive(Debug)]
pub struct StrictValue(pub Value);

impl<'de> Deserialize<'de> for StrictValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(StrictValue)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        StrictValue::deserialize(d).map(|v| v.0)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(StrictValue(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let StrictValue(v) = map.next_value()?;
            if out.insert(key, v).is_some() {
                return Err(de::Error::custom("duplicate key"));
            }
        }
        Ok(Value::Object(out))
    }
}

/// serde_json's message without its " at line L column C" tail: QEMU's messages carry no
/// position, and the tail would make error texts depend on where a request sat in the stream.
pub fn message_of(e: &serde_json::Error) -> String {
    let s = e.to_string();
    match s.rfind(" at line ") {
        Some(i) => s[..i].to_owned(),
        None => s,
    }
}

/// Parses one complete JSON text, refusing duplicate keys.
pub fn parse_strict(text: &str) -> Result<Value, String> {
    serde_json::from_str::<StrictValue>(text)
        .map(|v| v.0)
        .map_err(|e| message_of(&e))
}

/// One thing the input stream produced.
#[derive(Debug, PartialEq)]
pub enum Frame {
    /// A complete JSON value.
    Value(Value),
    /// Input that is not JSON; the rest of its line was dropped so the stream can resync.
    ParseError(String),
    /// More than the limit arrived without completing a value; the connection must close.
    TooLong,
}

/// Cuts a byte stream into JSON values as QEMU's streaming parser does: no delimiter is needed
/// (QEMU's own Python client sends none), values may share a line or span lines. A top-level
/// number that ends where the input ends waits for more bytes, as it may continue.
///
/// After a syntax error the input is skipped to the next `{` or newline, so the requests that
/// follow still get answers (QEMU resyncs at a similar point, token by token).
#[derive(Debug)]
pub struct Framer {
    buf: Vec<u8>,
    limit: usize,
}

/// The byte index in `region` of serde_json's 1-based (line, column) error position.
fn offset_of(region: &[u8], line: usize, column: usize) -> usize {
    let mut line_start = 0;
    if line > 1 {
        let mut seen = 1;
        for (i, &b) in region.iter().enumerate() {
            if b == b'\n' {
                seen += 1;
                if seen == line {
                    line_start = i + 1;
                    break;
                }
            }
        }
    }
    (line_start + column.saturating_sub(1)).min(region.len())
}

impl Framer {
    /// A framer that gives up on a value longer than `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Framer {
            buf: Vec::new(),
            limit,
        }
    }

    /// Adds bytes read from the client and returns what they completed.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<Frame> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut start = 0;
        while start < self.buf.len() {
            let region = &self.buf[start..];
            let mut stream =
                serde_json::Deserializer::from_slice(region).into_iter::<StrictValue>();
            match stream.next() {
                None => {
                    start = self.buf.len();
                }
                Some(Ok(StrictValue(v))) => {
                    let end = stream.byte_offset();
                    if v.is_number() && region[end..].is_empty() {
                        break;
                    }
                    start += end;
                    out.push(Frame::Value(v));
                }
                Some(Err(e)) if e.is_eof() => break,
                Some(Err(e)) => {
                    out.push(Frame::ParseError(message_of(&e)));
                    let at = offset_of(region, e.line(), e.column());
                    let resume = region
                        .iter()
                        .skip(at + 1)
                        .position(|&b| b == b'{' || b == b'\n')
                        .map_or(region.len(), |i| at + 1 + i);
                    start += resume;
                }
            }
        }
        self.buf.drain(..start);
        if self.buf.len() > self.limit {
            out.push(Frame::TooLong);
        }
        out
    }

    /// Bytes held for a value not yet complete.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn values(frames: Vec<Frame>) -> Vec<Value> {
        frames
            .into_iter()
            .map(|f| match f {
                Frame::Value(v) => v,
                other => panic!("unexpected {other:?}"),
            })
            .collect()
    }

    #[test]
    fn duplicate_keys_are_refused_at_any_depth() {
        assert_eq!(
            parse_strict(r#"{"a":1,"a":2}"#).unwrap_err(),
            "duplicate key"
        );
        assert_eq!(
            parse_strict(r#"{"a":{"b":1,"b":1}}"#).unwrap_err(),
            "duplicate key"
        );
        assert_eq!(
            parse_strict(r#"[{"a":1},{"a":2}]"#).unwrap(),
            json!([{"a":1},{"a":2}])
        );
    }

    #[test]
    fn messages_carry_no_position() {
        let e = parse_strict("xyz").unwrap_err();
        assert!(!e.contains("line"), "{e}");
    }

    #[test]
    fn no_delimiter_needed_and_split_reads() {
        let mut f = Framer::new(1024);
        assert!(f.push(br#"{"execute":"#).is_empty());
        assert_eq!(
            values(f.push(br#""a"}"#)),
            vec![json!({"execute": "a"})],
            "complete without a newline"
        );
        assert_eq!(f.pending(), 0);
        assert!(
            f.push(b"12").is_empty(),
            "a number at the end of the input may continue"
        );
        assert_eq!(values(f.push(b"3 ")), vec![json!(123)]);
        assert_eq!(values(f.push(b"true")), vec![json!(true)]);
    }

    #[test]
    fn values_may_share_a_line_or_span_lines() {
        let mut f = Framer::new(1024);
        assert_eq!(
            values(f.push(b"{\"a\":1} {\"b\":2}\n")),
            vec![json!({"a":1}), json!({"b":2})]
        );
        assert_eq!(
            values(f.push(b"{\"a\":1}{\"b\":2}")),
            vec![json!({"a":1}), json!({"b":2})]
        );
        assert!(f.push(b"{\"a\":\n").is_empty());
        assert_eq!(values(f.push(b"3}\n")), vec![json!({"a":3})]);
        assert!(f.push(b"\n   \n").is_empty(), "blank lines produce nothing");
    }

    #[test]
    fn after_bad_input_the_next_request_is_found() {
        let mut f = Framer::new(1024);
        let out = f.push(b"{\"a\":1} xyz {\"b\":2}\n{\"c\":3}\n");
        assert_eq!(out.len(), 4, "{out:?}");
        assert_eq!(out[0], Frame::Value(json!({"a":1})));
        assert!(matches!(out[1], Frame::ParseError(_)));
        assert_eq!(out[2], Frame::Value(json!({"b":2})));
        assert_eq!(out[3], Frame::Value(json!({"c":3})));
        assert_eq!(f.pending(), 0);
        let out = f.push(b"{\"a\":1,\"a\":2}\n{\"c\":3}");
        assert_eq!(
            out,
            vec![
                Frame::ParseError("duplicate key".into()),
                Frame::Value(json!({"c":3}))
            ]
        );
        let out = f.push(b"xyz");
        assert!(matches!(out[..], [Frame::ParseError(_)]));
        assert_eq!(f.pending(), 0, "garbage without a delimiter is dropped");
        assert_eq!(offset_of(b"ab\ncd", 2, 2), 4);
    }

    #[test]
    fn unfinished_values_over_the_limit() {
        let mut f = Framer::new(16);
        assert_eq!(f.push(b"\"an unfinished string"), vec![Frame::TooLong]);
        let mut f = Framer::new(16);
        let out = f.push(b"{\"a\":\n\"0123456789abcdef\"\n");
        assert_eq!(
            out,
            vec![Frame::TooLong],
            "an unfinished value longer than the limit"
        );
    }
}
