//! Making a connection: connect the socket (Unix or TCP) and run the handshake with blocking
//! I/O, bounded by the connection timeout; with TLS, `NBD_OPT_STARTTLS`, the TLS handshake, and
//! the rest of the NBD handshake inside TLS. Used at start-up and when a queue reconnects (so a
//! reconnect always makes a new TLS session).

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use nbd::{Export, HandshakeError, NbdUri, Transport};
use rustls::ClientConnection;

use super::tls::{self, TlsClient};

/// A connection in the transmission phase, ready for the ring.
pub(crate) struct Connected {
    /// The socket (blocking, with the timeout as its read and write timeouts).
    pub(crate) sock: OwnedFd,
    /// What the handshake settled.
    pub(crate) export: Export,
    /// The TLS session, for `nbds` URIs (boxed: it is large, and moves between threads).
    pub(crate) tls: Option<Box<ClientConnection>>,
}

/// Why a connection could not be made. The messages name the server.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The socket could not be connected.
    #[error("cannot connect to NBD server {server}: {error}")]
    Connect {
        /// Where.
        server: String,
        /// What the OS said (part of the message, not a `source()`).
        error: io::Error,
    },
    /// The handshake failed.
    #[error("NBD server {server}: {error}")]
    Handshake {
        /// Where.
        server: String,
        /// What went wrong.
        error: HandshakeError,
    },
    /// The TLS handshake failed (after the server accepted `NBD_OPT_STARTTLS`).
    #[error("NBD server {server}: {error}")]
    Tls {
        /// Where.
        server: String,
        /// What went wrong and what to do (one line).
        error: String,
    },
}

/// The server as a user would name it (with ", TLS" for `nbds` URIs).
pub fn describe(uri: &NbdUri) -> String {
    let tls = if uri.tls.is_some() { ", TLS" } else { "" };
    match &uri.transport {
        Transport::Unix(p) => format!("{} (export {:?}{tls})", p.display(), uri.export),
        Transport::Tcp { host, port } => format!("{host}:{port} (export {:?}{tls})", uri.export),
    }
}

/// Connects to `uri`'s server and negotiates its export (with TLS when `tls` is given). The
/// returned socket is blocking, with `timeout` as its read and write timeout (which only blocking
/// calls, such as the goodbye at close, observe; ring operations carry their own).
pub(crate) fn connect(
    uri: &NbdUri,
    tls: Option<&TlsClient>,
    timeout: Duration,
) -> Result<Connected, ConnectError> {
    let server = describe(uri);
    let conn_err = |error| ConnectError::Connect {
        server: server.clone(),
        error,
    };
    match &uri.transport {
        Transport::Unix(path) => {
            let mut s = UnixStream::connect(path).map_err(conn_err)?;
            s.set_read_timeout(Some(timeout)).map_err(conn_err)?;
            s.set_write_timeout(Some(timeout)).map_err(conn_err)?;
            let (export, tls) = negotiate(&mut s, uri, tls, &server)?;
            Ok(Connected {
                sock: s.into(),
                export,
                tls,
            })
        }
        Transport::Tcp { host, port } => {
            let addrs = (host.as_str(), *port).to_socket_addrs().map_err(conn_err)?;
            let mut last = io::Error::new(
                io::ErrorKind::NotFound,
                "the host name resolves to no address",
            );
            for a in addrs {
                match TcpStream::connect_timeout(&a, timeout) {
                    Ok(mut s) => {
                        s.set_nodelay(true).map_err(conn_err)?;
                        s.set_read_timeout(Some(timeout)).map_err(conn_err)?;
                        s.set_write_timeout(Some(timeout)).map_err(conn_err)?;
                        let (export, tls) = negotiate(&mut s, uri, tls, &server)?;
                        return Ok(Connected {
                            sock: s.into(),
                            export,
                            tls,
                        });
                    }
                    Err(e) => last = e,
                }
            }
            Err(conn_err(last))
        }
    }
}

/// The NBD handshake on a connected socket; with TLS, the TLS handshake after
/// `NBD_OPT_STARTTLS`, and the options inside the session.
fn negotiate<S: Read + Write>(
    s: &mut S,
    uri: &NbdUri,
    tls: Option<&TlsClient>,
    server: &str,
) -> Result<(Export, Option<Box<ClientConnection>>), ConnectError> {
    let hs = |error| ConnectError::Handshake {
        server: server.to_string(),
        error,
    };
    let tls_err = |error| ConnectError::Tls {
        server: server.to_string(),
        error,
    };
    nbd::greet(s).map_err(hs)?;
    let Some(tls) = tls else {
        let e = nbd::negotiate(s, &uri.export, true).map_err(hs)?;
        return Ok((e, None));
    };
    nbd::start_tls(s).map_err(hs)?;
    let mut session = Box::new(
        ClientConnection::new(tls.config.clone(), tls.name.clone())
            .map_err(|e| tls_err(format!("TLS setup failed: {e}")))?,
    );
    while session.is_handshaking() {
        session
            .complete_io(s)
            .map_err(|e| tls_err(tls::explain(&e)))?;
    }
    let mut stream = rustls::Stream::new(&mut *session, s);
    let e = nbd::negotiate(&mut stream, &uri.export, true).map_err(|e| match &e {
        HandshakeError::Io(io) => match tls::explain_after_handshake(io) {
            Some(why) => tls_err(why),
            None => hs(e),
        },
        _ => hs(e),
    })?;
    Ok((e, Some(session)))
}
