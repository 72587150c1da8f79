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
///
/// Bytes are parsed only once a scan of them says a value may have ended (or an error is
/// certain), so a value that arrives a byte at a time costs time linear in its length, not
/// one parse of everything held per byte.
#[derive(Debug)]
pub struct Framer {
    buf: Vec<u8>,
    limit: usize,
    scan: Scan,
    /// Parses run, for the tests that count them.
    #[cfg(test)]
    parses: usize,
}

/// What a byte-by-byte look at the held input knows: how deep in brackets it is, whether in a
/// string (and after a backslash), where a bare top-level token (a number or keyword) began,
/// and whether anything seen since the last parse may have completed a value or must be an
/// error. Not a validator: the parse decides; this only says when a parse is worth it.
#[derive(Debug, Default)]
struct Scan {
    /// Bytes of the buffer looked at.
    seen: usize,
    depth: usize,
    in_string: bool,
    escaped: bool,
    /// Where a bare token at depth 0 began, while in one.
    token: Option<usize>,
    /// A parse may produce something.
    due: bool,
}

/// Bytes that may stand outside strings inside a JSON value besides brackets and quotes:
/// whitespace, separators, number characters and the letters of `true`, `false` and `null`.
/// Any other byte there makes the value an error.
fn may_continue(b: u8) -> bool {
    matches!(
        b,
        b' ' | b'\t' | b'\n' | b'\r' | b',' | b':' | b'0'..=b'9' | b'-' | b'+' | b'.'
    ) || b"truefalsnE".contains(&b)
}

/// Bytes that may be part of a bare token (a number or keyword).
fn in_token(b: u8) -> bool {
    b.is_ascii_digit() || matches!(b, b'-' | b'+' | b'.') || b"truefalsnE".contains(&b)
}

impl Scan {
    /// Looks at `buf[self.seen..]`.
    fn advance(&mut self, buf: &[u8]) {
        let mut i = self.seen;
        while i < buf.len() {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                    i += 1;
                    continue;
                }
                // Most of a request is inside strings: skip to the next quote or backslash.
                let Some(n) = memchr::memchr2(b'"', b'\\', &buf[i..]) else {
                    break;
                };
                if buf[i + n] == b'\\' {
                    self.escaped = true;
                } else {
                    self.in_string = false;
                    self.due |= self.depth == 0;
                }
                i += n + 1;
                continue;
            }
            let b = buf[i];
            match b {
                b'"' => {
                    self.in_string = true;
                    self.token = None;
                }
                b'{' | b'[' => {
                    self.depth += 1;
                    self.token = None;
                }
                b'}' | b']' => {
                    // One too many closes at depth 0 is an error the parse reports.
                    self.depth = self.depth.saturating_sub(1);
                    self.due |= self.depth == 0;
                    self.token = None;
                }
                _ if self.depth > 0 => self.due |= !may_continue(b),
                _ if in_token(b) => {
                    let start = *self.token.get_or_insert(i);
                    // A keyword needs no delimiter to be complete; a number may continue.
                    self.due |= matches!(&buf[start..=i], b"true" | b"false" | b"null");
                }
                _ => {
                    // Whitespace or anything else at depth 0 ends a token, lets the blank
                    // input before it go, or is an error.
                    self.token = None;
                    self.due = true;
                }
            }
            i += 1;
        }
        self.seen = buf.len();
    }
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
            scan: Scan::default(),
            #[cfg(test)]
            parses: 0,
        }
    }

    /// Adds bytes read from the client and returns what they completed.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<Frame> {
        self.buf.extend_from_slice(bytes);
        self.scan.advance(&self.buf);
        let mut out = Vec::new();
        if !self.scan.due {
            if self.buf.len() > self.limit {
                out.push(Frame::TooLong);
            }
            return out;
        }
        #[cfg(test)]
        {
            self.parses += 1;
        }
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
        // What is left is the start of one value: look at it afresh.
        self.scan = Scan::default();
        self.scan.advance(&self.buf);
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

    /// Every way of cutting valid input gives the same values, and feeding a large request a
    /// byte at a time parses it once (counted by how often the scan asked for a parse).
    #[test]
    fn any_cut_gives_the_same_values() {
        let input: &[u8] = b"{\"a\": [1, 2.5e3, {\"b\": \"x\\\"}y\"}], \"c\": null}\n\
            {\"execute\":\"q\"}{\"d\":true}  [false] \"s{\" -7 \n";
        let mut whole = Framer::new(1024);
        let expect = values(whole.push(input));
        assert_eq!(expect.len(), 6, "{expect:?}");
        assert_eq!(
            expect[0],
            json!({"a": [1, 2500.0, {"b": "x\"}y"}], "c": null})
        );
        for size in 1..input.len() {
            let mut f = Framer::new(1024);
            let got: Vec<Value> = input.chunks(size).flat_map(|c| values(f.push(c))).collect();
            assert_eq!(got, expect, "chunks of {size}");
            assert_eq!(f.pending(), 0);
        }
    }

    #[test]
    fn a_value_sent_a_byte_at_a_time_is_parsed_once() {
        let big = format!(
            "{{\"execute\": \"x\", \"arguments\": {{\"s\": \"{}\"}}}}",
            "a".repeat(50_000)
        );
        let mut f = Framer::new(1 << 20);
        let mut got = Vec::new();
        for b in big.as_bytes() {
            got.extend(values(f.push(std::slice::from_ref(b))));
        }
        assert_eq!(got.len(), 1);
        assert_eq!(f.parses, 1, "only the last byte completes the value");
        assert_eq!(f.pending(), 0);
    }

    #[test]
    fn garbage_inside_a_value_is_reported_when_it_arrives() {
        let mut f = Framer::new(1024);
        let out = f.push(b"{\"a\": xyz");
        assert!(matches!(out[..], [Frame::ParseError(_)]), "{out:?}");
        assert_eq!(values(f.push(b"\n{\"b\":1}")), vec![json!({"b": 1})]);
    }

    #[test]
    fn blank_input_is_not_held() {
        let mut f = Framer::new(16);
        for _ in 0..100 {
            assert!(f.push(b"  \n ").is_empty());
        }
        assert_eq!(f.pending(), 0);
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
