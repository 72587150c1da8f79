//! systemd readiness (`Type=notify`): `READY=1` once the export is live, `STOPPING=1` when it
//! starts to shut down, as datagrams to the socket `NOTIFY_SOCKET` names.
//!
//! The protocol is one datagram of newline-separated `KEY=VALUE` lines on a unix datagram
//! socket; `NOTIFY_SOCKET` is a path, or an abstract address written with a leading `@` (the
//! address then starts with a NUL byte instead). The socket is connected when fusex starts, while
//! it still has every privilege it was given: connecting is where the kernel checks write access
//! to a socket file, and fusex may have dropped `CAP_DAC_OVERRIDE` by the time it is ready.

use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

use anyhow::{Context, Result};

/// A connected notification socket, or nothing when fusex was not started by a service manager.
pub struct Notifier {
    sock: Option<UnixDatagram>,
    /// The socket's address as `NOTIFY_SOCKET` gave it (handed to a restarted daemon).
    value: Option<String>,
}

/// The address `NOTIFY_SOCKET` names: a path, or `@name` for the abstract `\0name`.
fn address(value: &str) -> io::Result<SocketAddr> {
    match value.strip_prefix('@') {
        Some(name) => SocketAddr::from_abstract_name(name.as_bytes()),
        None if value.starts_with('/') => SocketAddr::from_pathname(value),
        None => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "neither an absolute path nor an @abstract name",
        )),
    }
}

impl Notifier {
    /// Connects to `NOTIFY_SOCKET` if it is set (an empty value counts as unset).
    pub fn from_env() -> Result<Notifier> {
        let Some(value) = std::env::var_os("NOTIFY_SOCKET").filter(|v| !v.is_empty()) else {
            return Ok(Notifier {
                sock: None,
                value: None,
            });
        };
        Notifier::connect(&value.to_string_lossy())
    }

    /// Connects to the service manager's socket `value` (a `NOTIFY_SOCKET` value): how a daemon
    /// started by `fusex restart` reaches the manager of the daemon it replaces.
    pub fn connect(value: &str) -> Result<Notifier> {
        let value = value.to_string();
        let connect = || -> io::Result<UnixDatagram> {
            let sock = UnixDatagram::unbound()?;
            sock.connect_addr(&address(&value)?)?;
            Ok(sock)
        };
        let sock = connect().with_context(|| {
            format!(
                "NOTIFY_SOCKET={value}: cannot connect to the service manager's socket; unset \
                 NOTIFY_SOCKET when fusex is not run by systemd"
            )
        })?;
        tracing::debug!("readiness goes to NOTIFY_SOCKET={value}");
        Ok(Notifier {
            sock: Some(sock),
            value: Some(value),
        })
    }

    /// Sends `state` (newline-separated `KEY=VALUE` lines). A lost notification must not take the
    /// export down, so a failure is logged, not returned.
    fn send(&self, state: &str) {
        let Some(sock) = &self.sock else {
            return;
        };
        if let Err(e) = sock.send(state.as_bytes()) {
            tracing::warn!("cannot notify the service manager ({state:?}): {e}");
        }
    }

    /// The export is live: every queue serves and privileges are dropped.
    pub fn ready(&self, status: &str) {
        self.send(&format!(
            "READY=1\nSTATUS={status}\nMAINPID={}",
            std::process::id()
        ));
    }

    /// The `NOTIFY_SOCKET` value this notifier is connected to, if any.
    pub fn socket(&self) -> Option<&str> {
        self.value.as_deref()
    }

    /// A reload began (`fusex restart` handing the export to a new process, or `fusex serve`
    /// applying its config file); `status` says which.
    pub fn reloading(&self, status: &str) {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes into `ts`, which lives across the call.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        let usec = ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1000;
        self.send(&format!(
            "RELOADING=1\nSTATUS={status}\nMONOTONIC_USEC={usec}"
        ));
    }

    /// The export is handed over: `pid` is the service's main process from now on (sent by the
    /// old main process, which the manager still listens to).
    pub fn main_pid(&self, pid: u32) {
        self.send(&format!("MAINPID={pid}"));
    }

    /// Shutdown has begun (in-flight requests finish, then the unmount).
    pub fn stopping(&self) {
        self.send("STOPPING=1\nSTATUS=unmounting");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abstract_and_path_addresses() {
        let a = address("@fusex/test").unwrap();
        assert_eq!(a.as_abstract_name(), Some(&b"fusex/test"[..]));
        let p = address("/run/systemd/notify").unwrap();
        assert_eq!(
            p.as_pathname(),
            Some(std::path::Path::new("/run/systemd/notify"))
        );
        assert!(address("relative").is_err());
    }

    #[test]
    fn datagrams_reach_an_abstract_socket() {
        let name = format!("fusex-notify-test-{}", std::process::id());
        let server =
            UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap())
                .unwrap();
        let sock = UnixDatagram::unbound().unwrap();
        sock.connect_addr(&address(&format!("@{name}")).unwrap())
            .unwrap();
        let n = Notifier {
            sock: Some(sock),
            value: None,
        };
        n.ready("x");
        n.stopping();
        let mut buf = [0u8; 256];
        let len = server.recv(&mut buf).unwrap();
        let first = std::str::from_utf8(&buf[..len]).unwrap();
        assert!(first.starts_with("READY=1\n"), "{first}");
        let len = server.recv(&mut buf).unwrap();
        assert!(buf[..len].starts_with(b"STOPPING=1"));
    }
}
