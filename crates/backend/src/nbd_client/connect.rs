//! Making a connection: connect the socket (Unix or TCP) and run the handshake with blocking
//! I/O, bounded by the connection timeout. Used at start-up and when a queue reconnects.

use std::io;
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use nbd::{Export, HandshakeError, NbdUri, Transport};

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
}

/// The server as a user would name it.
pub fn describe(uri: &NbdUri) -> String {
    match &uri.transport {
        Transport::Unix(p) => format!("{} (export {:?})", p.display(), uri.export),
        Transport::Tcp { host, port } => format!("{host}:{port} (export {:?})", uri.export),
    }
}

/// Connects to `uri`'s server and negotiates its export. The returned socket is blocking, with
/// `timeout` as its read and write timeout (which only blocking calls, such as the goodbye at
/// close, observe; ring operations carry their own).
pub fn connect(uri: &NbdUri, timeout: Duration) -> Result<(OwnedFd, Export), ConnectError> {
    let server = describe(uri);
    let conn_err = |error| ConnectError::Connect {
        server: server.clone(),
        error,
    };
    let hs = |r: Result<Export, HandshakeError>| {
        r.map_err(|error| ConnectError::Handshake {
            server: server.clone(),
            error,
        })
    };
    match &uri.transport {
        Transport::Unix(path) => {
            let mut s = UnixStream::connect(path).map_err(conn_err)?;
            s.set_read_timeout(Some(timeout)).map_err(conn_err)?;
            s.set_write_timeout(Some(timeout)).map_err(conn_err)?;
            let e = hs(nbd::handshake(&mut s, &uri.export, true))?;
            Ok((s.into(), e))
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
                        let e = hs(nbd::handshake(&mut s, &uri.export, true))?;
                        return Ok((s.into(), e));
                    }
                    Err(e) => last = e,
                }
            }
            Err(conn_err(last))
        }
    }
}
