//! NBD URIs, as libnbd and QEMU accept them: `nbd://HOST[:PORT]/EXPORT` (TCP, port 10809 by
//! default) and `nbd+unix:///EXPORT?socket=PATH` (a Unix domain socket). The export name is the
//! path without its leading `/`, percent-decoded. TLS (`nbds://`, `nbds+unix://`) is refused with
//! an error that says so: fusex has no TLS client.

use std::path::PathBuf;

/// Where the server listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transport {
    /// TCP to `host:port` (`host` as written, brackets of an IPv6 literal removed).
    Tcp {
        /// Host name or address.
        host: String,
        /// Port.
        port: u16,
    },
    /// A Unix domain socket.
    Unix(PathBuf),
}

/// A parsed NBD URI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NbdUri {
    /// How to reach the server.
    pub transport: Transport,
    /// The export name (may be empty: the server's default export).
    pub export: String,
}

/// Why a string is not an NBD URI fusex can use. Each message says what to write instead.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UriError {
    /// `nbds://` and friends.
    #[error("{0}: NBD over TLS is not supported by fusex; use an nbd:// or nbd+unix:// URI (e.g. through an stunnel or on a trusted network)")]
    Tls(String),
    /// A scheme other than `nbd` and `nbd+unix`.
    #[error("{0}: unsupported NBD URI scheme; use nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH")]
    Scheme(String),
    /// Something inside the URI does not parse.
    #[error("{uri}: {what}")]
    Malformed {
        /// The URI as given.
        uri: String,
        /// What is wrong.
        what: &'static str,
    },
}

/// Whether `s` looks like an NBD URI at all (so IMAGE is parsed as one, not as a path).
pub fn is_nbd_uri(s: &str) -> bool {
    s.split_once("://")
        .is_some_and(|(scheme, _)| scheme.starts_with("nbd"))
}

impl NbdUri {
    /// Parses `s`.
    pub fn parse(s: &str) -> Result<NbdUri, UriError> {
        let bad = |what| UriError::Malformed {
            uri: s.to_string(),
            what,
        };
        let (scheme, rest) = s.split_once("://").ok_or_else(|| bad("not a URI"))?;
        let unix = match scheme {
            "nbd" | "nbd+tcp" => false,
            "nbd+unix" => true,
            sc if sc.starts_with("nbds") => return Err(UriError::Tls(s.to_string())),
            _ => return Err(UriError::Scheme(s.to_string())),
        };
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let rest = rest.split_once('#').map_or(rest, |(r, _)| r);
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, ""),
        };
        let export = decode(path).ok_or_else(|| bad("bad percent-encoding in the export name"))?;
        let mut socket = None;
        for pair in query.into_iter().flat_map(|q| q.split('&')) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            if k == "socket" {
                socket = Some(decode(v).ok_or_else(|| bad("bad percent-encoding in socket="))?);
            }
        }
        let transport = if unix {
            if !authority.is_empty() {
                return Err(bad(
                    "nbd+unix:// takes no host: write nbd+unix:///EXPORT?socket=PATH",
                ));
            }
            match socket {
                Some(p) if !p.is_empty() => Transport::Unix(PathBuf::from(p)),
                _ => return Err(bad("nbd+unix:// needs ?socket=PATH")),
            }
        } else {
            if socket.is_some() {
                return Err(bad("socket= is for nbd+unix:// URIs"));
            }
            let (host, port) = split_host_port(authority).ok_or_else(|| bad("bad host or port"))?;
            if host.is_empty() {
                return Err(bad("nbd:// needs a host, e.g. nbd://127.0.0.1/EXPORT"));
            }
            Transport::Tcp { host, port }
        };
        if export.len() > 4096 || export.contains('\0') {
            return Err(bad("export name longer than 4096 bytes or containing NUL"));
        }
        Ok(NbdUri { transport, export })
    }
}

/// `host`, `host:port`, `[v6]`, `[v6]:port`.
fn split_host_port(a: &str) -> Option<(String, u16)> {
    let a = a.rsplit_once('@').map_or(a, |(_, h)| h);
    let (host, port) = if let Some(r) = a.strip_prefix('[') {
        let (h, after) = r.split_once(']')?;
        match after {
            "" => (h, None),
            p => (h, Some(p.strip_prefix(':')?)),
        }
    } else {
        match a.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (a, None),
        }
    };
    let port = match port {
        None | Some("") => crate::DEFAULT_PORT,
        Some(p) => p.parse().ok()?,
    };
    Some((host.to_string(), port))
}

/// Percent-decoding; `None` on a malformed escape or bytes that are not UTF-8.
fn decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_uris() {
        let u = NbdUri::parse("nbd://127.0.0.1/disk").unwrap();
        assert_eq!(
            u.transport,
            Transport::Tcp {
                host: "127.0.0.1".into(),
                port: 10809
            }
        );
        assert_eq!(u.export, "disk");
        let u = NbdUri::parse("nbd://[::1]:1234/a%20b").unwrap();
        assert_eq!(
            u.transport,
            Transport::Tcp {
                host: "::1".into(),
                port: 1234
            }
        );
        assert_eq!(u.export, "a b");
        let u = NbdUri::parse("nbd://example.com:99").unwrap();
        assert_eq!(u.export, "");
    }

    #[test]
    fn unix_uris() {
        let u = NbdUri::parse("nbd+unix:///exp?socket=/tmp/s%2Dx.sock").unwrap();
        assert_eq!(u.transport, Transport::Unix("/tmp/s-x.sock".into()));
        assert_eq!(u.export, "exp");
        let u = NbdUri::parse("nbd+unix://?socket=/s").unwrap();
        assert_eq!(u.export, "");
        assert!(NbdUri::parse("nbd+unix:///exp").is_err());
        assert!(NbdUri::parse("nbd+unix://host/exp?socket=/s").is_err());
    }

    #[test]
    fn refusals() {
        assert!(matches!(NbdUri::parse("nbds://h/e"), Err(UriError::Tls(_))));
        assert!(matches!(
            NbdUri::parse("nbds+unix:///e?socket=/s"),
            Err(UriError::Tls(_))
        ));
        assert!(matches!(
            NbdUri::parse("nbd+vsock://1/e"),
            Err(UriError::Scheme(_))
        ));
        for bad in [
            "nbd://h:99999/e",
            "nbd:///e",
            "nbd://h/%zz",
            "nbd://h/%4",
            "nbd://h/e?socket=/s",
        ] {
            assert!(NbdUri::parse(bad).is_err(), "{bad}");
        }
        assert!(is_nbd_uri("nbd://h/e"));
        assert!(!is_nbd_uri("/tmp/disk.img"));
    }

    proptest::proptest! {
        #[test]
        fn never_panics(s in ".{0,64}") {
            let _ = NbdUri::parse(&s);
            let _ = NbdUri::parse(&format!("nbd://{s}"));
            let _ = NbdUri::parse(&format!("nbd+unix://{s}"));
        }
    }
}
