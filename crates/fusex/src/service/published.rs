//! What `fusex list` and `fusex restart` see of `fusex serve`'s exports: each export has its
//! files in the runtime directory, as a `fusex mount` daemon's export has (a state file, and a
//! socket bound while it serves, which is how `fusex list` tells a live export from a dead
//! mount). One thread answers every export's socket: `fusex restart` of any export of a `fusex
//! serve` daemon hands the whole daemon over ([`super::Service::hand_over`]).

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixListener;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::runtime::{Entry, ExportState};

/// The sockets the acceptor thread answers, by the export's runtime key.
#[derive(Default)]
struct Sockets {
    listeners: BTreeMap<String, UnixListener>,
}

/// The acceptor shared by every export of the daemon.
pub struct Publisher {
    sockets: Arc<Mutex<Sockets>>,
}

/// What the acceptor does with a connection (`fusex restart`): the daemon's hand-over.
pub type OnConnect = Box<dyn Fn(std::os::unix::net::UnixStream) + Send>;

/// One export's published files; removed when dropped.
pub struct Published {
    entry: Entry,
    key: String,
    sockets: Arc<Mutex<Sockets>>,
    state: ExportState,
}

/// How often the acceptor looks at sockets added since it last waited.
const RESCAN: Duration = Duration::from_millis(200);

impl Publisher {
    /// Starts the acceptor thread, which passes each connection to `on_connect`.
    pub fn start(on_connect: OnConnect) -> std::io::Result<Publisher> {
        let sockets = Arc::new(Mutex::new(Sockets::default()));
        let weak = Arc::downgrade(&sockets);
        std::thread::Builder::new()
            .name("fusex-restart".into())
            .spawn(move || {
                while let Some(s) = weak.upgrade() {
                    let fds: Vec<RawFd> = s
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .listeners
                        .values()
                        .map(|l| l.as_raw_fd())
                        .collect();
                    drop(s);
                    let ready = wait_readable(&fds, RESCAN);
                    let Some(s) = weak.upgrade() else { return };
                    let accepted: Vec<_> = {
                        let s = s.lock().unwrap_or_else(|p| p.into_inner());
                        s.listeners
                            .values()
                            .filter(|l| ready.contains(&l.as_raw_fd()))
                            .filter_map(|l| l.accept().ok().map(|(stream, _)| stream))
                            .collect()
                    };
                    // Unlocked: a hand-over leaves exports, which takes this lock.
                    for stream in accepted {
                        let _ = stream.set_nonblocking(false);
                        on_connect(stream);
                    }
                }
            })?;
        Ok(Publisher { sockets })
    }

    /// Publishes an export that serves now: its state file, and its socket. None (logged) when
    /// the runtime directory cannot be used: the export serves regardless.
    pub fn publish(&self, mnt: &transport::Mount, state: ExportState) -> Option<Published> {
        let handover = mnt.handover()?;
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        let dir = match crate::runtime::checked(euid, true) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!("fusex list will not show this export: {e}");
                return None;
            }
        };
        let entry = Entry::new(dir, handover.identity);
        let listener = match crate::restart::listen(&entry.socket()) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(
                    "fusex list will not show this export: cannot bind {}: {e}",
                    entry.socket().display()
                );
                return None;
            }
        };
        let _ = listener.set_nonblocking(true);
        let key = crate::runtime::key(&handover.identity);
        entry.write_state(&state);
        self.sockets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .listeners
            .insert(key.clone(), listener);
        Some(Published {
            entry,
            key,
            sockets: self.sockets.clone(),
            state,
        })
    }
}

impl Published {
    /// The export went to a `fusex restart` successor, which owns its files now.
    pub fn leave(mut self) {
        self.entry.leave();
    }

    /// Rewrites the state `fusex list` shows.
    pub fn set_state(&mut self, state: &str) {
        self.state.state = state.to_string();
        self.entry.write_state(&self.state);
    }
}

impl Drop for Published {
    fn drop(&mut self) {
        // The socket closes here; the entry's files go as it drops.
        self.sockets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .listeners
            .remove(&self.key);
    }
}

/// The fds of `fds` that are readable within `timeout`.
fn wait_readable(fds: &[RawFd], timeout: Duration) -> Vec<RawFd> {
    if fds.is_empty() {
        std::thread::sleep(timeout);
        return Vec::new();
    }
    let mut polled: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: `polled` is a valid array of `polled.len()` pollfd structs that lives across the
    // call; poll writes only their `revents`.
    let n = unsafe {
        libc::poll(
            polled.as_mut_ptr(),
            polled.len() as libc::nfds_t,
            timeout.as_millis() as libc::c_int,
        )
    };
    if n <= 0 {
        return Vec::new();
    }
    polled
        .iter()
        .filter(|p| p.revents & libc::POLLIN != 0)
        .map(|p| p.fd)
        .collect()
}
