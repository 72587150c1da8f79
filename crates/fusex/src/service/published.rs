//! What `fusex list` and `fusex restart` see of `fusex serve`'s exports: each export has a state
//! file in the runtime directory, as a `fusex mount` daemon's export has, and the daemon binds one
//! socket for all of them (`serve-PID.sock`), which each state file names. A socket per export
//! cost two inodes made and removed per export added and removed. `fusex list` tells a live
//! export from a dead mount by that socket listening; `fusex restart` of any export of a `fusex
//! serve` daemon connects to it and hands the whole daemon over (`Service::hand_over`).

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;

use crate::runtime::{Entry, ExportState};

/// The daemon's restart socket and the thread that answers it.
pub struct Publisher {
    listener: Arc<UnixListener>,
    /// Its path, removed with it.
    path: PathBuf,
    /// Its file name in the runtime directory, which the state files carry.
    name: String,
}

/// What the acceptor does with a connection (`fusex restart`): the daemon's hand-over.
pub type OnConnect = Box<dyn Fn(std::os::unix::net::UnixStream) + Send>;

/// One export's published state file; removed when dropped. Written first when the export
/// serves ([`Published::set_state`]), so an export that never serves leaves nothing.
pub struct Published {
    entry: Entry,
    state: ExportState,
}

impl Publisher {
    /// Binds the daemon's restart socket in the runtime directory and starts the thread that
    /// passes each connection to `on_connect`. An error when the directory cannot be used (the
    /// exports then serve unlisted).
    pub fn start(on_connect: OnConnect) -> anyhow::Result<Publisher> {
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        let dir = crate::runtime::for_daemon(euid)?;
        let path = crate::runtime::serve_socket(&dir, std::process::id());
        let listener = crate::restart::listen(&path)
            .map_err(|e| anyhow::anyhow!("cannot bind {}: {e}", path.display()))?;
        let listener = Arc::new(listener);
        let accepting = listener.clone();
        std::thread::Builder::new()
            .name("fusex-restart".into())
            .spawn(move || {
                // Ends when the socket is shut down (the publisher dropped) or fails.
                while let Ok((stream, _)) = accepting.accept() {
                    on_connect(stream);
                }
            })?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(Publisher {
            listener,
            path,
            name,
        })
    }

    /// The state file of an export that serves from now on, written by its first
    /// [`Published::set_state`]. None (logged) when the runtime directory cannot be used: the
    /// export serves regardless.
    pub fn publish(&self, mnt: &transport::Mount, state: ExportState) -> Option<Published> {
        let handover = mnt.handover()?;
        let dir = self.path.parent()?.to_path_buf();
        Some(Published {
            entry: Entry::state_only(dir, handover.identity),
            state: ExportState {
                socket: Some(self.name.clone()),
                ..state
            },
        })
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        // SAFETY: shutdown on a socket this value owns (through the Arc); it makes a blocked
        // accept return, and changes nothing else.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        let _ = std::fs::remove_file(&self.path);
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
