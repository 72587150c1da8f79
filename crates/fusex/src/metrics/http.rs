//! `--metrics-listen`: the smallest HTTP/1.x server that lets Prometheus scrape fusex, on one
//! thread of its own, with std alone. It answers `GET /metrics` (and `HEAD`), nothing else, and
//! closes each connection after its response, so there is no keep-alive state to get wrong.
//!
//! Whoever can connect may be hostile or merely slow, and must never stall an export or the
//! other scrapers: every socket is nonblocking and one `poll(2)` waits on all of them; a client
//! has [`HEAD_TIMEOUT`] to send its request head and [`WRITE_TIMEOUT`] to take the response; a
//! head over [`MAX_HEAD`] bytes is refused; at most [`MAX_CONNECTIONS`] are held, the oldest
//! dropped for a new one. The exports never wait on this thread: the render closure reads
//! their counters, which the queues write without locks.

use std::io::{self, ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The largest request head (request line and headers) read; a longer one is answered 431.
pub const MAX_HEAD: usize = 8 * 1024;
/// How long a client has to send its whole request head after connecting (a slow-loris client
/// is answered 408 and dropped then).
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a client has to take the response.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long what a client still sends after its response is read and dropped before closing
/// (closing on unread data would reset the connection and could lose the response).
const DRAIN_TIMEOUT: Duration = Duration::from_secs(1);
/// Reads or writes one connection gets per wake-up.
const ROUNDS: usize = 64;
/// Connections held at once; a new one drops the oldest, so idle clients cannot lock
/// scrapers out.
pub const MAX_CONNECTIONS: usize = 64;

/// What renders the metrics page (called on the server's thread, once per scrape).
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// Why the metrics server could not start.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The address does not name a socket address.
    #[error(
        "metrics-listen {addr}: not an address ({source}): give HOST:PORT, e.g. 127.0.0.1:9100"
    )]
    Address {
        addr: String,
        #[source]
        source: io::Error,
    },
    /// Nothing could be bound at the address.
    #[error(
        "metrics-listen {addr}: cannot listen there: {source}: pick a free port (or stop what \
         listens on it), and an address of this machine"
    )]
    Bind {
        addr: String,
        #[source]
        source: io::Error,
    },
    /// The listener or the server thread could not be set up.
    #[error("metrics-listen {addr}: {source}")]
    Setup {
        addr: String,
        #[source]
        source: io::Error,
    },
}

/// A running metrics server; dropping it stops the thread and closes the listener (so a
/// `fusex restart` successor may bind the same address).
pub struct MetricsServer {
    addr: SocketAddr,
    /// Dropped to wake the thread and stop it.
    stop: Option<UnixStream>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `addr` (`HOST:PORT`; port 0 picks one, see [`MetricsServer::local_addr`]) and
    /// serves `render`'s text on its own thread. A bind error is returned here, before the
    /// caller reports itself ready.
    pub fn start(addr: &str, render: Render) -> Result<MetricsServer, MetricsError> {
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|source| MetricsError::Address {
                addr: addr.to_string(),
                source,
            })?
            .collect();
        let listener = TcpListener::bind(&addrs[..]).map_err(|source| MetricsError::Bind {
            addr: addr.to_string(),
            source,
        })?;
        let setup = |source| MetricsError::Setup {
            addr: addr.to_string(),
            source,
        };
        listener.set_nonblocking(true).map_err(setup)?;
        let local = listener.local_addr().map_err(setup)?;
        let (stop, wake) = UnixStream::pair().map_err(setup)?;
        wake.set_nonblocking(true).map_err(setup)?;
        let thread = std::thread::Builder::new()
            .name("fusex-metrics".into())
            .spawn(move || serve(listener, wake, render))
            .map_err(setup)?;
        tracing::info!("metrics: http://{local}/metrics");
        Ok(MetricsServer {
            addr: local,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The address bound (with the port chosen when 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        // The other end reads end-of-file: the thread's poll wakes and it returns.
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a request head asks for, once enough of it is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Asked {
    /// The metrics page (`head_only`: a HEAD request, headers without the body).
    Metrics { head_only: bool },
    /// An error status to answer.
    Error(u16),
}

/// Reads a request head as far as it has arrived: None while more is needed. A bad request
/// line is refused as soon as it is complete, without waiting for the rest.
fn parse(buf: &[u8]) -> Option<Asked> {
    let too_long = buf.len() > MAX_HEAD;
    let Some(line_end) = buf.iter().position(|&b| b == b'\n') else {
        return too_long.then_some(Asked::Error(431));
    };
    let line = strip_cr(&buf[..line_end]);
    let Some((method, target)) = request_line(line) else {
        return Some(Asked::Error(400));
    };
    let head_end = find(buf, b"\r\n\r\n")
        .map(|i| i + 4)
        .or_else(|| find(buf, b"\n\n").map(|i| i + 2));
    let Some(end) = head_end else {
        return too_long.then_some(Asked::Error(431));
    };
    if end > MAX_HEAD {
        return Some(Asked::Error(431));
    }
    let headers = &buf[line_end + 1..end];
    for h in headers.split(|&b| b == b'\n').map(strip_cr) {
        if !h.is_empty() && !header_line(h) {
            return Some(Asked::Error(400));
        }
    }
    let path = target.split(|&b| b == b'?').next().unwrap_or_default();
    Some(if path != b"/metrics" {
        Asked::Error(404)
    } else if method == b"GET" {
        Asked::Metrics { head_only: false }
    } else if method == b"HEAD" {
        Asked::Metrics { head_only: true }
    } else {
        Asked::Error(405)
    })
}

fn strip_cr(l: &[u8]) -> &[u8] {
    l.strip_suffix(b"\r").unwrap_or(l)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A token character (RFC 9110): what a method or a header name is made of.
fn tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// `METHOD SP TARGET SP HTTP/1.x`: the method and the target (origin form, `/...`).
fn request_line(l: &[u8]) -> Option<(&[u8], &[u8])> {
    let mut parts = l.split(|&b| b == b' ');
    let (method, target, version) = (parts.next()?, parts.next()?, parts.next()?);
    let ok = parts.next().is_none()
        && !method.is_empty()
        && method.iter().all(|&b| tchar(b))
        && target.first() == Some(&b'/')
        && target.iter().all(|&b| b.is_ascii_graphic())
        && (version == b"HTTP/1.1" || version == b"HTTP/1.0");
    ok.then_some((method, target))
}

/// `Name: value`, with a token name and no control characters but tab in the value.
fn header_line(h: &[u8]) -> bool {
    let Some(colon) = h.iter().position(|&b| b == b':') else {
        return false;
    };
    let (name, value) = (&h[..colon], &h[colon + 1..]);
    !name.is_empty()
        && name.iter().all(|&b| tchar(b))
        && value.iter().all(|&b| b == b'\t' || !b.is_ascii_control())
}

/// The whole response to `asked`.
fn response(asked: Asked, render: &Render) -> Vec<u8> {
    let (status, reason, kind, body, head_only) = match asked {
        Asked::Metrics { head_only } => (
            200,
            "OK",
            "text/plain; version=0.0.4; charset=utf-8",
            render(),
            head_only,
        ),
        Asked::Error(code) => {
            let reason = match code {
                400 => "Bad Request",
                404 => "Not Found",
                405 => "Method Not Allowed",
                408 => "Request Timeout",
                431 => "Request Header Fields Too Large",
                _ => "Error",
            };
            let body = match code {
                404 => "fusex serves its metrics at /metrics only\n".to_string(),
                405 => "only GET and HEAD are answered\n".to_string(),
                _ => format!("{reason}\n"),
            };
            (code, reason, "text/plain; charset=utf-8", body, false)
        }
    };
    let allow = if status == 405 {
        "Allow: GET, HEAD\r\n"
    } else {
        ""
    };
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\n{allow}\
         Connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body.as_bytes());
    }
    out
}

/// Where a connection is.
enum Phase {
    /// Reading the request head.
    Reading(Vec<u8>),
    /// Sending the response, `.1` bytes of it sent.
    Writing(Vec<u8>, usize),
    /// Response sent, our side shut down: dropping what the client still sends until it
    /// closes.
    Draining,
}

struct Conn {
    stream: TcpStream,
    phase: Phase,
    /// When the current phase must be over.
    deadline: Instant,
}

/// What a connection wants to wait for next.
enum Next {
    Read,
    Write,
    Close,
}

impl Conn {
    fn new(stream: TcpStream, now: Instant) -> Conn {
        Conn {
            stream,
            phase: Phase::Reading(Vec::new()),
            deadline: now + HEAD_TIMEOUT,
        }
    }

    /// Does what the socket allows now, without blocking, and at most [`ROUNDS`] reads or
    /// writes: a client that sends without pause cannot keep the thread from the others.
    fn advance(&mut self, render: &Render, now: Instant) -> Next {
        for _ in 0..ROUNDS {
            match &mut self.phase {
                Phase::Reading(buf) => {
                    let mut chunk = [0u8; 4096];
                    match self.stream.read(&mut chunk) {
                        Ok(0) => return Next::Close,
                        Ok(n) => {
                            buf.extend_from_slice(&chunk[..n]);
                            if let Some(asked) = parse(buf) {
                                self.respond(asked, render, now);
                            }
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => return Next::Read,
                        Err(e) if e.kind() == ErrorKind::Interrupted => {}
                        Err(_) => return Next::Close,
                    }
                }
                Phase::Writing(out, sent) => match self.stream.write(&out[*sent..]) {
                    Ok(n) => {
                        *sent += n;
                        if *sent == out.len() {
                            let _ = self.stream.shutdown(Shutdown::Write);
                            self.phase = Phase::Draining;
                            self.deadline = now + DRAIN_TIMEOUT;
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return Next::Write,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(_) => return Next::Close,
                },
                Phase::Draining => {
                    let mut chunk = [0u8; 16384];
                    match self.stream.read(&mut chunk) {
                        Ok(0) => return Next::Close,
                        Ok(_) => {}
                        Err(e) if e.kind() == ErrorKind::WouldBlock => return Next::Read,
                        Err(e) if e.kind() == ErrorKind::Interrupted => {}
                        Err(_) => return Next::Close,
                    }
                }
            }
        }
        match self.phase {
            Phase::Writing(..) => Next::Write,
            _ => Next::Read,
        }
    }

    fn respond(&mut self, asked: Asked, render: &Render, now: Instant) {
        self.phase = Phase::Writing(response(asked, render), 0);
        self.deadline = now + WRITE_TIMEOUT;
    }

    /// The deadline passed: a client still sending its head hears 408, others are dropped.
    fn expired(&mut self, render: &Render, now: Instant) -> Next {
        match self.phase {
            Phase::Reading(_) => {
                self.respond(Asked::Error(408), render, now);
                self.advance(render, now)
            }
            _ => Next::Close,
        }
    }

    fn events(&self) -> libc::c_short {
        match self.phase {
            Phase::Writing(..) => libc::POLLOUT,
            _ => libc::POLLIN,
        }
    }
}

/// Waits for `fds`' events, at most `timeout`.
fn poll(fds: &mut [libc::pollfd], timeout: Option<Duration>) -> io::Result<()> {
    let ms = timeout.map_or(-1, |t| {
        // Rounded up: waking before the deadline would spin.
        i32::try_from(t.as_millis() + 1).unwrap_or(i32::MAX)
    });
    // SAFETY: `fds` is a valid, exclusively borrowed array of `fds.len()` pollfd structs for
    // the duration of the call.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(())
}

fn pollfd(fd: RawFd, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

/// The server thread: until `wake` reads end-of-file.
fn serve(listener: TcpListener, mut wake: UnixStream, render: Render) {
    let mut conns: Vec<Conn> = Vec::new();
    let mut fds: Vec<libc::pollfd> = Vec::new();
    loop {
        fds.clear();
        fds.push(pollfd(wake.as_raw_fd(), libc::POLLIN));
        fds.push(pollfd(listener.as_raw_fd(), libc::POLLIN));
        fds.extend(
            conns
                .iter()
                .map(|c| pollfd(c.stream.as_raw_fd(), c.events())),
        );
        let now = Instant::now();
        let timeout = conns
            .iter()
            .map(|c| c.deadline.saturating_duration_since(now))
            .min();
        if let Err(e) = poll(&mut fds, timeout) {
            tracing::error!("metrics: poll: {e}; the metrics server stops");
            return;
        }
        if fds[0].revents != 0 {
            let mut b = [0u8; 1];
            match wake.read(&mut b) {
                Ok(0) => return,
                Err(e) if e.kind() != ErrorKind::WouldBlock => return,
                _ => {}
            }
        }
        let now = Instant::now();
        // The connections polled, by their place in `fds` (new ones are added after).
        let mut keep = Vec::with_capacity(conns.len());
        for (mut c, p) in conns.drain(..).zip(&fds[2..]) {
            let next = if p.revents != 0 {
                c.advance(&render, now)
            } else {
                Next::Read
            };
            if matches!(next, Next::Close) {
                continue;
            }
            if now >= c.deadline && matches!(c.expired(&render, now), Next::Close) {
                continue;
            }
            keep.push(c);
        }
        conns = keep;
        if fds[1].revents != 0 {
            loop {
                match listener.accept() {
                    Ok((stream, _)) => {
                        if stream.set_nonblocking(true).is_err() {
                            continue;
                        }
                        if conns.len() >= MAX_CONNECTIONS {
                            // The oldest goes: a crowd of idle clients cannot lock a scraper out.
                            conns.remove(0);
                        }
                        conns.push(Conn::new(stream, now));
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => {
                        // Out of descriptors, say: try again at the next wake-up, and do not
                        // spin meanwhile.
                        tracing::warn!("metrics: accept: {e}");
                        std::thread::sleep(Duration::from_millis(100));
                        break;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render() -> Render {
        Arc::new(|| "fusex_exports 0\n".to_string())
    }

    #[test]
    fn parse_routes_and_refuses() {
        assert_eq!(parse(b"GET /metrics HTTP/1.1\r\n"), None);
        assert_eq!(
            parse(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
            Some(Asked::Metrics { head_only: false })
        );
        assert_eq!(
            parse(b"GET /metrics?x=1 HTTP/1.0\n\n"),
            Some(Asked::Metrics { head_only: false })
        );
        assert_eq!(
            parse(b"HEAD /metrics HTTP/1.1\r\n\r\n"),
            Some(Asked::Metrics { head_only: true })
        );
        assert_eq!(
            parse(b"POST /metrics HTTP/1.1\r\n\r\n"),
            Some(Asked::Error(405))
        );
        assert_eq!(
            parse(b"GET /other HTTP/1.1\r\n\r\n"),
            Some(Asked::Error(404))
        );
        assert_eq!(parse(b"GET / HTTP/1.1\r\n\r\n"), Some(Asked::Error(404)));
        // A bad request line is refused before the head is complete.
        for bad in [
            &b"garbage\n"[..],
            b"GET /metrics\r\n",
            b"GET metrics HTTP/1.1\r\n",
            b"GET /metrics HTTP/2\r\n",
            b"GET  /metrics HTTP/1.1\r\n",
            b"G(T /metrics HTTP/1.1\r\n",
            b"\r\n",
            b"GET /metrics HTTP/1.1 x\r\n",
        ] {
            assert_eq!(parse(bad), Some(Asked::Error(400)), "{bad:?}");
        }
        for bad in [
            &b"GET /metrics HTTP/1.1\r\nno colon\r\n\r\n"[..],
            b"GET /metrics HTTP/1.1\r\nBad Name: x\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nX: a\x01b\r\n\r\n",
        ] {
            assert_eq!(parse(bad), Some(Asked::Error(400)), "{bad:?}");
        }
        // Too long, with or without a request line.
        assert_eq!(parse(&[b'x'; MAX_HEAD + 1]), Some(Asked::Error(431)));
        assert_eq!(parse(&[b'x'; MAX_HEAD]), None);
        let mut long = b"GET /metrics HTTP/1.1\r\n".to_vec();
        while long.len() <= MAX_HEAD {
            long.extend_from_slice(b"X-Pad: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
        }
        assert_eq!(parse(&long), Some(Asked::Error(431)));
        long.extend_from_slice(b"\r\n");
        assert_eq!(parse(&long), Some(Asked::Error(431)));
    }

    #[test]
    fn responses_are_complete_and_close() {
        let ok =
            String::from_utf8(response(Asked::Metrics { head_only: false }, &render())).unwrap();
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains("Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"));
        assert!(ok.contains("Content-Length: 16\r\n"));
        assert!(ok.contains("Connection: close\r\n"));
        assert!(ok.ends_with("\r\n\r\nfusex_exports 0\n"));
        let head =
            String::from_utf8(response(Asked::Metrics { head_only: true }, &render())).unwrap();
        assert!(head.contains("Content-Length: 16\r\n") && head.ends_with("\r\n\r\n"));
        let not_allowed = String::from_utf8(response(Asked::Error(405), &render())).unwrap();
        assert!(not_allowed.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"));
        assert!(not_allowed.contains("Allow: GET, HEAD\r\n"));
    }

    /// Sends `req` on a new connection (shutting the sending side) and reads the reply.
    fn exchange(addr: SocketAddr, req: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s.write_all(req).unwrap();
        let _ = s.shutdown(Shutdown::Write);
        let mut out = Vec::new();
        s.read_to_end(&mut out).unwrap();
        String::from_utf8_lossy(&out).into_owned()
    }

    fn status(reply: &str) -> &str {
        reply.split(' ').nth(1).unwrap_or("")
    }

    #[test]
    fn serves_scrapes_among_idle_and_hostile_clients() {
        let server = MetricsServer::start("127.0.0.1:0", render()).unwrap();
        let addr = server.local_addr();
        // More idle clients than are held: the oldest are dropped, scrapes still get through.
        let idle: Vec<TcpStream> = (0..MAX_CONNECTIONS + 10)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        let reply = exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(status(&reply), "200", "{reply}");
        assert!(reply.ends_with("fusex_exports 0\n"));
        assert_eq!(
            status(&exchange(addr, b"PUT /metrics HTTP/1.1\r\n\r\n")),
            "405"
        );
        assert_eq!(status(&exchange(addr, b"GET /x HTTP/1.1\r\n\r\n")), "404");
        assert_eq!(status(&exchange(addr, b"\x16\x03\x01\x02\x00\n")), "400");
        assert_eq!(status(&exchange(addr, &vec![b'a'; 1 << 20])), "431");
        // A client that stops before its head is complete gets no answer, the server goes on.
        assert_eq!(exchange(addr, b"GET /metrics HTTP/1.1\r\n"), "");
        drop(idle);
        // Stopping closes the listener.
        drop(server);
        assert!(TcpStream::connect(addr).is_err());
    }

    #[test]
    fn a_slow_client_hears_408_at_its_deadline() {
        let server = MetricsServer::start("127.0.0.1:0", render()).unwrap();
        let mut s = TcpStream::connect(server.local_addr()).unwrap();
        s.set_read_timeout(Some(HEAD_TIMEOUT * 3)).unwrap();
        let started = Instant::now();
        s.write_all(b"GET /metr").unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        assert!(out.starts_with("HTTP/1.1 408 "), "{out:?}");
        assert!(started.elapsed() >= HEAD_TIMEOUT - Duration::from_millis(100));
        // Meanwhile and after, others are served.
        let reply = exchange(server.local_addr(), b"GET /metrics HTTP/1.0\r\n\r\n");
        assert_eq!(status(&reply), "200");
    }

    #[test]
    fn bind_errors_name_the_address() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap().to_string();
        let e = MetricsServer::start(&addr, render())
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.starts_with(&format!("metrics-listen {addr}: cannot listen")),
            "{e}"
        );
        assert!(e.contains("pick a free port"), "{e}");
        let e = MetricsServer::start("no port", render())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("give HOST:PORT"), "{e}");
    }
}
