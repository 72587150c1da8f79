//! Making a connection: connect the socket (Unix or TCP) and run the handshake with blocking
//! I/O, all of it within one deadline (the connection timeout); with TLS, `NBD_OPT_STARTTLS`, the
//! TLS handshake, and the rest of the NBD handshake inside TLS. It runs on a connector thread
//! ([`Attempt`]), at start-up and when a queue reconnects (so a reconnect always makes a new TLS
//! session), never on a queue thread.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use nbd::{Export, HandshakeError, NbdUri, Transport};
use rustls::ClientConnection;

use super::tls::{self, TlsClient};

/// A connection in the transmission phase, ready for the ring.
pub(crate) struct Connected {
    /// The socket (blocking).
    pub(crate) sock: Sock,
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
    /// Connecting and the handshake together took longer than the connection timeout (the
    /// server is silent, or sends too slowly); fusex closed the connection.
    #[error("NBD server {server} did not complete the handshake within {} s; fusex gave up and closed the connection", timeout.as_secs_f64())]
    Timeout {
        /// Where.
        server: String,
        /// The bound (`--nbd-timeout`).
        timeout: Duration,
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

/// Connects to `uri`'s server and negotiates its export (with TLS when `tls` is given), all of
/// it (connect, NBD handshake, TLS handshake) done by `timeout` from now: each blocking call gets
/// the time that is left, so a server that sends a byte at a time cannot stretch the whole past
/// it. The returned socket is blocking (ring operations carry their own timeouts).
pub(crate) fn connect(
    uri: &NbdUri,
    tls: Option<&TlsClient>,
    timeout: Duration,
) -> Result<Connected, ConnectError> {
    let deadline = Instant::now() + timeout;
    let server = describe(uri);
    let conn_err = |error| ConnectError::Connect {
        server: server.clone(),
        error,
    };
    let sock = match &uri.transport {
        Transport::Unix(path) => Sock::Unix(UnixStream::connect(path).map_err(conn_err)?),
        Transport::Tcp { host, port } => {
            let addrs = (host.as_str(), *port).to_socket_addrs().map_err(conn_err)?;
            let mut last = io::Error::new(
                io::ErrorKind::NotFound,
                "the host name resolves to no address",
            );
            let mut made = None;
            for a in addrs {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(ConnectError::Timeout { server, timeout });
                }
                match TcpStream::connect_timeout(&a, left) {
                    Ok(s) => {
                        s.set_nodelay(true).map_err(conn_err)?;
                        made = Some(s);
                        break;
                    }
                    Err(e) => last = e,
                }
            }
            Sock::Tcp(made.ok_or_else(|| conn_err(last))?)
        }
    };
    let mut s = Deadlined::until(&sock, deadline);
    let negotiated = negotiate(&mut s, uri, tls, &server);
    if s.expired() {
        return Err(ConnectError::Timeout { server, timeout });
    }
    let (export, tls) = negotiated?;
    Ok(Connected { sock, export, tls })
}

/// A connection being made on a connector thread of its own (short-lived: one per attempt), so
/// that name lookup, connect and the handshakes never block the queue thread that needs the
/// connection. The thread leaves its result here and wakes the tasks waiting for it with their
/// wakers (from another thread, an engine's waker goes through its eventfd, whose read the engine
/// keeps armed on its ring). An attempt nobody waits for any more runs to its own deadline and
/// its connection is dropped (closed) with the last handle.
#[derive(Clone)]
pub(crate) struct Attempt(Arc<AttemptShared>);

struct AttemptShared {
    state: Mutex<AttemptState>,
    done: Condvar,
    /// When the waiters give up: the attempt's own deadline and [`GIVE_UP_GRACE`]. Only what
    /// the deadline cannot bound (a name lookup, a Unix connect to a listener whose backlog is
    /// full) runs that long; the thread then finishes on its own and its result is dropped.
    give_up_at: Instant,
}

/// How much longer than an attempt's deadline its waiters wait: time for the connector thread
/// to report the deadline itself (a more precise message than the waiter's).
const GIVE_UP_GRACE: Duration = Duration::from_millis(500);

/// How often [`Attempt::start_retrying`] connects again.
const RETRY_EVERY: Duration = Duration::from_millis(50);

#[derive(Default)]
struct AttemptState {
    result: Option<Result<Connected, ConnectError>>,
    /// Tasks to wake when the result is in.
    wakers: Vec<Waker>,
}

impl Attempt {
    /// Starts connecting to `uri` (as [`connect`], bounded by `timeout`) on a new thread.
    pub(crate) fn start(
        uri: &NbdUri,
        tls: Option<&TlsClient>,
        timeout: Duration,
    ) -> Result<Attempt, ConnectError> {
        Attempt::start_retrying(uri, tls, timeout, Duration::ZERO)
    }

    /// [`Attempt::start`], connecting again every [`RETRY_EVERY`] while it fails, for up to
    /// `retry_for`: a `fusex restart` successor's first connections, which a server that takes
    /// one client at a time refuses until it has seen the predecessor's connection end (the
    /// predecessor closed it before letting go, but the server notices on its own time).
    pub(crate) fn start_retrying(
        uri: &NbdUri,
        tls: Option<&TlsClient>,
        timeout: Duration,
        retry_for: Duration,
    ) -> Result<Attempt, ConnectError> {
        let shared = Arc::new(AttemptShared {
            state: Mutex::new(AttemptState::default()),
            done: Condvar::new(),
            give_up_at: Instant::now() + retry_for + timeout + GIVE_UP_GRACE,
        });
        let (u, t, sh) = (uri.clone(), tls.cloned(), shared.clone());
        std::thread::Builder::new()
            .name("nbd-connect".into())
            .spawn(move || {
                let until = Instant::now() + retry_for;
                let r = loop {
                    let r = connect(&u, t.as_ref(), timeout);
                    if r.is_ok() || Instant::now() + RETRY_EVERY > until {
                        break r;
                    }
                    std::thread::sleep(RETRY_EVERY);
                };
                let wakers = {
                    let mut st = sh.lock();
                    st.result = Some(r);
                    std::mem::take(&mut st.wakers)
                };
                sh.done.notify_all();
                for w in wakers {
                    w.wake();
                }
            })
            .map_err(|error| ConnectError::Connect {
                server: describe(uri),
                error,
            })?;
        Ok(Attempt(shared))
    }

    /// The result, once (later calls: `None`).
    pub(crate) fn take(&self) -> Option<Result<Connected, ConnectError>> {
        self.0.lock().result.take()
    }

    /// When waiting for the result stops (see [`AttemptShared::give_up_at`]).
    pub(crate) fn give_up_at(&self) -> Instant {
        self.0.give_up_at
    }

    /// Whether `other` is this attempt.
    pub(crate) fn is(&self, other: &Attempt) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Waits (on the ring: the queue thread serves other requests meanwhile) until the result
    /// is in, or until [`Attempt::wake_waiters`] wakes the waiting task.
    pub(crate) async fn wait(&self) {
        let mut woken = false;
        std::future::poll_fn(|cx| {
            let mut st = self.0.lock();
            if st.result.is_some() || woken {
                return Poll::Ready(());
            }
            if !st.wakers.iter().any(|w| w.will_wake(cx.waker())) {
                st.wakers.push(cx.waker().clone());
            }
            woken = true;
            Poll::Pending
        })
        .await
    }

    /// Wakes every task waiting for the result now (the queue stops: they give up).
    pub(crate) fn wake_waiters(&self) {
        let wakers = std::mem::take(&mut self.0.lock().wakers);
        for w in wakers {
            w.wake();
        }
    }

    /// Blocks until the result is in or the waiters give up (start-up, before the queues
    /// exist); returns whether it is in.
    pub(crate) fn wait_blocking(&self) -> bool {
        let mut st = self.0.lock();
        while st.result.is_none() {
            let left = self.0.give_up_at.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = self
                .0
                .done
                .wait_timeout(st, left)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        true
    }
}

impl AttemptShared {
    fn lock(&self) -> std::sync::MutexGuard<'_, AttemptState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A connected socket of either family: blocking I/O in the handshake and the goodbye (through
/// [`Deadlined`]), ring operations on its descriptor in between.
pub(crate) enum Sock {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl AsRawFd for Sock {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Sock::Unix(s) => s.as_raw_fd(),
            Sock::Tcp(s) => s.as_raw_fd(),
        }
    }
}

impl Sock {
    fn set_read_timeout(&self, d: Duration) -> io::Result<()> {
        match self {
            Sock::Unix(s) => s.set_read_timeout(Some(d)),
            Sock::Tcp(s) => s.set_read_timeout(Some(d)),
        }
    }

    fn set_write_timeout(&self, d: Duration) -> io::Result<()> {
        match self {
            Sock::Unix(s) => s.set_write_timeout(Some(d)),
            Sock::Tcp(s) => s.set_write_timeout(Some(d)),
        }
    }
}

/// Blocking I/O on a socket that must all end by one deadline (the handshake, the goodbye). Each
/// call gets the time left as the socket's timeout (a system call more per call; these are a few
/// dozen small messages), so a server that sends a byte at a time cannot stretch the whole; once
/// the time is gone the calls fail with `TimedOut` and [`Deadlined::expired`] says so, so the
/// caller reports the deadline rather than whatever the protocol code made of the error.
pub(crate) struct Deadlined<'a> {
    sock: &'a Sock,
    deadline: Instant,
    expired: bool,
}

impl<'a> Deadlined<'a> {
    /// I/O on `sock` until `deadline`.
    pub(crate) fn until(sock: &'a Sock, deadline: Instant) -> Deadlined<'a> {
        Deadlined {
            sock,
            deadline,
            expired: false,
        }
    }

    /// Whether a call failed because the deadline passed.
    pub(crate) fn expired(&self) -> bool {
        self.expired
    }

    /// The time left, or the error that ends the handshake.
    fn left(&mut self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.timed_out());
        }
        Ok(left)
    }

    fn timed_out(&mut self) -> io::Error {
        self.expired = true;
        io::Error::new(io::ErrorKind::TimedOut, "the handshake's deadline passed")
    }

    /// A blocking call's result, with its socket timeout (`EAGAIN`) told as the deadline.
    fn checked<T>(&mut self, r: io::Result<T>) -> io::Result<T> {
        match r {
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Err(self.timed_out())
            }
            r => r,
        }
    }
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.sock.set_read_timeout(left)?;
        let r = match self.sock {
            Sock::Unix(s) => {
                let mut s = s;
                s.read(buf)
            }
            Sock::Tcp(s) => {
                let mut s = s;
                s.read(buf)
            }
        };
        self.checked(r)
    }
}

impl Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.sock.set_write_timeout(left)?;
        let r = match self.sock {
            Sock::Unix(s) => {
                let mut s = s;
                s.write(buf)
            }
            Sock::Tcp(s) => {
                let mut s = s;
                s.write(buf)
            }
        };
        self.checked(r)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A server on a fresh Unix socket: `serve` runs on each accepted connection, on its own
    /// thread. The directory lives as long as the returned guard.
    fn server(serve: fn(UnixStream)) -> (tempfile::TempDir, NbdUri) {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s.sock");
        let l = UnixListener::bind(&sock).unwrap();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                std::thread::spawn(move || serve(s));
            }
        });
        let uri = NbdUri::parse(&format!("nbd+unix:///?socket={}", sock.display())).unwrap();
        (dir, uri)
    }

    #[test]
    fn a_dripping_handshake_ends_at_the_deadline() {
        // The greeting a byte every 50 ms, then the connection closes: no read ever waits
        // 300 ms, so only a deadline for the whole handshake (18 bytes: 900 ms) ends it first.
        let (_dir, uri) = server(|mut s| {
            let mut g = b"NBDMAGICIHAVEOPT".to_vec();
            g.extend_from_slice(&3u16.to_be_bytes());
            for b in g {
                if s.write_all(&[b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let e = connect(&uri, None, Duration::from_millis(300))
            .err()
            .unwrap();
        assert!(matches!(e, ConnectError::Timeout { .. }), "{e}");
        assert!(e.to_string().contains("within 0.3 s"), "{e}");
    }

    #[test]
    fn an_attempt_reports_a_silent_server_on_its_thread() {
        // Accepts, says nothing, keeps the connection open until the client leaves.
        let (_dir, uri) = server(|mut s| {
            let _ = s.read(&mut [0u8; 1]);
        });
        let a = Attempt::start(&uri, None, Duration::from_millis(200)).unwrap();
        assert!(a.wait_blocking(), "the attempt outlived its give-up time");
        let r = a.take().expect("a result");
        assert!(matches!(r, Err(ConnectError::Timeout { .. })));
        assert!(a.take().is_none(), "the result is taken once");
    }
}
