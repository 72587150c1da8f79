//! NBD URIs, as libnbd and QEMU accept them: `nbd://HOST[:PORT]/EXPORT` (TCP, port 10809 by
//! default) and `nbd+unix:///EXPORT?socket=PATH` (a Unix domain socket). The export name is the
//! path without its leading `/`, percent-decoded. `nbds://` and `nbds+unix://` ask for TLS
//! (`NBD_OPT_STARTTLS`), with libnbd's query parameters for it: `tls-certificates=DIR`,
//! `tls-verify-peer=false`, `tls-hostname=NAME`. `tls-psk-file=` is refused: fusex's TLS library
//! (rustls) has no pre-shared-key authentication.
//!
//! [`NbdUri`]'s `Display` writes the URI back, escaped so that it parses to the same value:
//! what a caller that builds a URI from parts (`fusex serve`'s `nbd` nodes) writes.

use std::fmt;
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

/// TLS settings of an `nbds://` or `nbds+unix://` URI (libnbd's query parameters).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tls {
    /// `tls-certificates=DIR`: the CA (`DIR/ca-cert.pem`) and, if present, the client's
    /// certificate and key (`DIR/client-cert.pem`, `DIR/client-key.pem`), the file names libnbd,
    /// qemu and nbdkit use. `None`: the system's CA bundle, no client certificate.
    pub certificates: Option<PathBuf>,
    /// `tls-verify-peer=false` turns off the check of the server's certificate (default on).
    pub verify_peer: bool,
    /// `tls-hostname=NAME`: the name the server's certificate must carry, instead of the URI's
    /// host (a Unix socket has none: without it only the certificate's chain is checked).
    pub hostname: Option<String>,
}

/// A parsed NBD URI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NbdUri {
    /// How to reach the server.
    pub transport: Transport,
    /// The export name (may be empty: the server's default export).
    pub export: String,
    /// TLS (`nbds` schemes): negotiated with `NBD_OPT_STARTTLS` before anything else.
    pub tls: Option<Tls>,
}

/// Why a string is not an NBD URI fusex can use. Each message says what to write instead.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UriError {
    /// `tls-psk-file=`: rustls, fusex's TLS library, has no external pre-shared keys.
    #[error("{0}: tls-psk-file= is not supported: fusex's TLS (rustls) has no pre-shared-key authentication; use X.509 certificates (tls-certificates=DIR)")]
    Psk(String),
    /// A scheme other than `nbd`, `nbd+unix`, `nbds` and `nbds+unix`.
    #[error("{0}: unsupported NBD URI scheme; use nbd[s]://HOST[:PORT]/EXPORT or nbd[s]+unix:///EXPORT?socket=PATH")]
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
        let (unix, tls) = match scheme {
            "nbd" | "nbd+tcp" => (false, false),
            "nbd+unix" => (true, false),
            "nbds" | "nbds+tcp" => (false, true),
            "nbds+unix" => (true, true),
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
        let mut settings = Tls {
            certificates: None,
            verify_peer: true,
            hostname: None,
        };
        for pair in query.into_iter().flat_map(|q| q.split('&')) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let value = || decode(v).ok_or_else(|| bad("bad percent-encoding in a query value"));
            match k {
                "socket" => socket = Some(value()?),
                // TLS parameters are ignored without TLS, as libnbd does.
                "tls-psk-file" if tls => return Err(UriError::Psk(s.to_string())),
                "tls-certificates" => {
                    let dir = value()?;
                    if dir.is_empty() {
                        return Err(bad("tls-certificates= needs a directory"));
                    }
                    settings.certificates = Some(PathBuf::from(dir));
                }
                "tls-verify-peer" => {
                    settings.verify_peer = parse_bool(&value()?)
                        .ok_or_else(|| bad("tls-verify-peer= takes true or false"))?;
                }
                "tls-hostname" => {
                    let h = value()?;
                    if h.is_empty() {
                        return Err(bad("tls-hostname= needs a name"));
                    }
                    settings.hostname = Some(h);
                }
                _ => {}
            }
        }
        let transport = if unix {
            if !authority.is_empty() {
                return Err(bad(
                    "a Unix-socket URI takes no host: write nbd+unix:///EXPORT?socket=PATH",
                ));
            }
            match socket {
                Some(p) if !p.is_empty() => Transport::Unix(PathBuf::from(p)),
                _ => return Err(bad("a Unix-socket URI needs ?socket=PATH")),
            }
        } else {
            if socket.is_some() {
                return Err(bad("socket= is for nbd+unix:// (or nbds+unix://) URIs"));
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
        Ok(NbdUri {
            transport,
            export,
            tls: tls.then_some(settings),
        })
    }
}

impl NbdUri {
    /// The same server and export without TLS: what QEMU shows for a node with `tls-creds`.
    pub fn without_tls(&self) -> NbdUri {
        NbdUri {
            tls: None,
            ..self.clone()
        }
    }

    /// Whether [`NbdUri::parse`] can read this URI back from its `Display` form: a host that
    /// is a name or address (none of `/?#@[]`, whitespace or control characters, and a `:`
    /// only in an IPv6 address), a socket path and export name without NUL, an export name of
    /// at most 4096 bytes, non-empty TLS names.
    pub fn check(&self) -> Result<(), &'static str> {
        match &self.transport {
            Transport::Tcp { host, .. } => {
                if host.is_empty()
                    || host
                        .chars()
                        .any(|c| "/?#@[]".contains(c) || c.is_whitespace() || c.is_control())
                {
                    return Err("the host is not a host name or address");
                }
            }
            Transport::Unix(p) => {
                let p = p.to_string_lossy();
                if p.is_empty() || p.contains('\0') {
                    return Err("the socket path is empty or holds NUL");
                }
            }
        }
        if self.export.len() > 4096 || self.export.contains('\0') {
            return Err("export name longer than 4096 bytes or containing NUL");
        }
        if let Some(t) = &self.tls {
            if t.certificates
                .as_ref()
                .is_some_and(|d| d.as_os_str().is_empty())
                || t.hostname.as_ref().is_some_and(|h| h.is_empty())
            {
                return Err("an empty TLS directory or host name");
            }
        }
        Ok(())
    }
}

/// Writes `v` with `%XX` for `%` and each byte of `special`, and for spaces and control
/// characters; everything else (other ASCII, UTF-8) as it is.
fn escaped(f: &mut fmt::Formatter<'_>, v: &str, special: &[u8]) -> fmt::Result {
    for c in v.chars() {
        let b = c as u32;
        if b < 0x80 && (special.contains(&(b as u8)) || c == '%' || c == ' ' || c.is_control()) {
            write!(f, "%{b:02X}")?;
        } else {
            write!(f, "{c}")?;
        }
    }
    Ok(())
}

/// Bytes escaped in the export name (the path): those that end it.
const IN_PATH: &[u8] = b"?#";
/// Bytes escaped in a query value: those that end it, and `+` and `=` for readers that give
/// them a meaning.
const IN_QUERY: &[u8] = b"&#+?=";

impl fmt::Display for NbdUri {
    /// `nbd[s]://HOST:PORT/EXPORT` or `nbd[s]+unix:///EXPORT?socket=PATH`, then the TLS
    /// parameters, each value escaped so [`NbdUri::parse`] reads back the same (for a URI that
    /// passes [`NbdUri::check`]).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = if self.tls.is_some() { "s" } else { "" };
        let mut query: Vec<(&str, String)> = Vec::new();
        match &self.transport {
            Transport::Unix(path) => {
                write!(f, "nbd{s}+unix:///")?;
                query.push(("socket", path.to_string_lossy().into_owned()));
            }
            Transport::Tcp { host, port } if host.contains(':') => {
                write!(f, "nbd{s}://[{host}]:{port}/")?
            }
            Transport::Tcp { host, port } => write!(f, "nbd{s}://{host}:{port}/")?,
        }
        escaped(f, &self.export, IN_PATH)?;
        if let Some(t) = &self.tls {
            if let Some(dir) = &t.certificates {
                query.push(("tls-certificates", dir.to_string_lossy().into_owned()));
            }
            if !t.verify_peer {
                query.push(("tls-verify-peer", "false".into()));
            }
            if let Some(h) = &t.hostname {
                query.push(("tls-hostname", h.clone()));
            }
        }
        for (i, (k, v)) in query.iter().enumerate() {
            write!(f, "{}{k}=", if i == 0 { '?' } else { '&' })?;
            escaped(f, v, IN_QUERY)?;
        }
        Ok(())
    }
}

/// A boolean query value, spelled as libnbd accepts it.
fn parse_bool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
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
    fn tls_uris() {
        let u = NbdUri::parse("nbd://h/e").unwrap();
        assert_eq!(u.tls, None);
        let u = NbdUri::parse("nbds://h:99/e").unwrap();
        assert_eq!(
            u.transport,
            Transport::Tcp {
                host: "h".into(),
                port: 99
            }
        );
        assert_eq!(
            u.tls,
            Some(Tls {
                certificates: None,
                verify_peer: true,
                hostname: None
            })
        );
        let u = NbdUri::parse(
            "nbds+unix:///e?socket=/s&tls-certificates=/etc/pki/a%20b&tls-verify-peer=false&tls-hostname=srv.example",
        )
        .unwrap();
        assert_eq!(u.transport, Transport::Unix("/s".into()));
        assert_eq!(u.export, "e");
        let t = u.tls.unwrap();
        assert_eq!(t.certificates, Some(PathBuf::from("/etc/pki/a b")));
        assert!(!t.verify_peer);
        assert_eq!(t.hostname.as_deref(), Some("srv.example"));
        for v in ["1", "TRUE", "yes", "on"] {
            let u = NbdUri::parse(&format!("nbds://h/?tls-verify-peer={v}")).unwrap();
            assert!(u.tls.unwrap().verify_peer, "{v}");
        }
        // Without TLS the TLS parameters are ignored, as libnbd does.
        let u = NbdUri::parse("nbd://h/?tls-psk-file=/k&tls-certificates=/c").unwrap();
        assert_eq!(u.tls, None);
    }

    #[test]
    fn tls_refusals() {
        assert!(matches!(
            NbdUri::parse("nbds://h/e?tls-psk-file=/keys.psk"),
            Err(UriError::Psk(_))
        ));
        let e = NbdUri::parse("nbds+unix:///?socket=/s&tls-psk-file=/k").unwrap_err();
        assert!(
            e.to_string().contains("tls-psk-file= is not supported"),
            "{e}"
        );
        for bad in [
            "nbds://h/e?tls-verify-peer=maybe",
            "nbds://h/e?tls-certificates=",
            "nbds://h/e?tls-hostname=",
            "nbds://h/e?tls-certificates=%zz",
            "nbds+unix:///e",
            "nbds+unix://h/e?socket=/s",
            "nbds:///e",
            "nbds://h/e?socket=/s",
        ] {
            assert!(NbdUri::parse(bad).is_err(), "{bad}");
        }
        assert!(matches!(
            NbdUri::parse("nbds+vsock://1/e"),
            Err(UriError::Scheme(_))
        ));
    }

    #[test]
    fn refusals() {
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

    #[test]
    fn uris_are_written_back_escaped() {
        let u = NbdUri {
            transport: Transport::Unix("/run/a b/nbd&1.sock".into()),
            export: "disk?1#%".into(),
            tls: Some(Tls {
                certificates: Some("/etc/pki/a b".into()),
                verify_peer: false,
                hostname: Some("srv.example".into()),
            }),
        };
        let s = u.to_string();
        assert_eq!(
            s,
            "nbds+unix:///disk%3F1%23%25?socket=/run/a%20b/nbd%261.sock\
             &tls-certificates=/etc/pki/a%20b&tls-verify-peer=false&tls-hostname=srv.example"
        );
        assert_eq!(NbdUri::parse(&s).unwrap(), u);
        assert_eq!(
            u.without_tls().to_string(),
            "nbd+unix:///disk%3F1%23%25?socket=/run/a%20b/nbd%261.sock"
        );
        let v6 = NbdUri::parse("nbd://[::1]:10809/").unwrap();
        assert_eq!(v6.to_string(), "nbd://[::1]:10809/");
        let bad = NbdUri {
            transport: Transport::Tcp {
                host: "h/x".into(),
                port: 1,
            },
            export: String::new(),
            tls: None,
        };
        assert!(bad.check().is_err());
    }

    proptest::proptest! {
        /// Every URI that passes `check` reads back as itself from its `Display` form.
        #[test]
        fn written_uris_parse_back(
            unix in proptest::bool::ANY,
            host in "([a-z0-9.-]{1,20}|[0-9a-f:]{2,20})",
            port in proptest::num::u16::ANY,
            path in "/[^\u{0}]{0,40}",
            export in "[^\u{0}]{0,40}",
            tls in proptest::option::of((
                proptest::option::of("/[^\u{0}]{1,30}"),
                proptest::bool::ANY,
                proptest::option::of("[^\u{0}]{1,20}"),
            )),
        ) {
            let u = NbdUri {
                transport: if unix {
                    Transport::Unix(path.into())
                } else {
                    Transport::Tcp { host, port }
                },
                export,
                tls: tls.map(|(dir, verify_peer, hostname)| Tls {
                    certificates: dir.map(PathBuf::from),
                    verify_peer,
                    hostname,
                }),
            };
            if u.check().is_ok() {
                let s = u.to_string();
                proptest::prop_assert_eq!(NbdUri::parse(&s), Ok(u), "{}", s);
            }
        }

        #[test]
        fn never_panics(s in ".{0,64}") {
            let _ = NbdUri::parse(&s);
            let _ = NbdUri::parse(&format!("nbd://{s}"));
            let _ = NbdUri::parse(&format!("nbd+unix://{s}"));
            let _ = NbdUri::parse(&format!("nbds://h/?{s}"));
            let _ = NbdUri::parse(&format!("nbds+unix:///?socket=/s&{s}"));
        }
    }
}
