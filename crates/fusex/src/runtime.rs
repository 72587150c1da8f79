//! The runtime directory: where a daemon keeps what other fusex processes look for while it
//! serves an export (its `fusex restart` socket and the state `fusex list` shows).
//!
//! Whatever is there is trusted by whoever finds it (a root `fusex restart` hands its new daemon
//! to the process answering on the socket), so the directory is one only the daemon's user can
//! write: `/run/fusex` for root (created 0755, as systemd's `RuntimeDirectory=fusex` of
//! `contrib/fusex@.service` makes it, whose exports live there too), `/run/user/UID/fusex` for
//! another user when their runtime directory exists (logind makes it, owned by them, 0700), else
//! `/tmp/fusex-UID` (both created 0700). It is checked every time it is used, by the daemon and
//! by a client alike: a directory (not a symlink), owned by that user, writable by no one else.
//! One that fails the check (another user made `/tmp/fusex-UID` first) is refused with a line
//! naming it. The state files are 0600; a socket needs write permission to connect to, which the
//! daemon's umask keeps to its user, and the daemon answers only its own user or root anyway.
//!
//! An export's files are named after its mount ([`transport::MountIdentity`]: the connection's
//! device number and the never-reused mount id), so a new export never meets an old one's files.
//! A daemon removes its files when it ends, and leaves them to its successor after `fusex restart`
//! (which binds the socket anew and writes its own state). A killed daemon cannot remove its
//! files: each daemon, once it serves, sweeps the directory once in the background ([`sweep`]), so
//! they do not pile up where `/run` outlives the daemons (a disk rather than tmpfs, a long-lived
//! host where test daemons are killed).

use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Result};
use transport::MountIdentity;

/// The runtime directory of the user `uid` (not checked: see [`checked`]).
pub fn dir_for(uid: u32) -> PathBuf {
    if uid == 0 {
        return PathBuf::from("/run/fusex");
    }
    let user = PathBuf::from(format!("/run/user/{uid}"));
    match std::fs::symlink_metadata(&user) {
        Ok(m) if m.is_dir() && m.uid() == uid => user.join("fusex"),
        _ => PathBuf::from(format!("/tmp/fusex-{uid}")),
    }
}

/// The runtime directory of `uid`, checked (see the module doc); `create` makes it first when
/// missing (the daemon's side; a client only looks).
pub fn checked(uid: u32, create: bool) -> Result<PathBuf> {
    let dir = dir_for(uid);
    let shown = dir.display();
    if create {
        let mode = if uid == 0 { 0o755 } else { 0o700 };
        match std::fs::DirBuilder::new().mode(mode).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(anyhow!("runtime directory {shown}: {e}")),
        }
    }
    let meta =
        std::fs::symlink_metadata(&dir).map_err(|e| anyhow!("runtime directory {shown}: {e}"))?;
    let what = if !meta.is_dir() {
        "not a directory".to_string()
    } else if meta.uid() != uid {
        format!("owned by user {}", meta.uid())
    } else if meta.mode() & 0o022 != 0 {
        format!("writable by others (mode {:o})", meta.mode() & 0o777)
    } else {
        return Ok(dir);
    };
    Err(anyhow!(
        "runtime directory {shown} is {what}, not a directory only user {uid} can use: remove it \
         (fusex makes it anew)"
    ))
}

/// The runtime directory of `uid` as the daemon uses it: [`checked`] (made when missing), and
/// swept once per process, in the background, of what killed daemons left there ([`sweep`]),
/// once the daemon says it serves ([`begin_sweep`]).
pub fn for_daemon(uid: u32) -> Result<PathBuf> {
    static STARTED: std::sync::Once = std::sync::Once::new();
    let dir = checked(uid, true)?;
    STARTED.call_once(|| {
        let swept = dir.clone();
        let (dropped, wait_dropped) = std::sync::mpsc::channel::<()>();
        let started = std::thread::Builder::new()
            .name("fusex-sweep".into())
            .spawn(move || {
                // Started before the daemon drops its privileges, and possibly still running
                // after: it needs none (the directory and its files are this uid's own). The
                // spawner waits for the drop, so no thread of the daemon holds more than the
                // daemon keeps once it says it dropped them.
                let outcome = crate::privileges::Plan::nothing().apply();
                drop(dropped);
                if let Err(e) = outcome {
                    tracing::debug!(
                        "not sweeping {}: dropping capabilities: {e}",
                        swept.display()
                    );
                    return;
                }
                wait_for_begin();
                let removed = sweep(&swept, STALE_AFTER);
                if removed > 0 {
                    tracing::info!(
                        "removed {removed} files of daemons that are gone from {}",
                        swept.display()
                    );
                }
            });
        match started {
            // Ends (disconnected) once the thread dropped its capabilities or ended.
            Ok(_) => _ = wait_dropped.recv(),
            Err(e) => tracing::debug!("not sweeping {}: {e}", dir.display()),
        }
    });
    Ok(dir)
}

/// Set by [`begin_sweep`]; the sweep thread waits for it.
static SWEEP_BEGUN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// The sweep thread, once it waits for [`begin_sweep`].
static SWEEPER: std::sync::OnceLock<std::thread::Thread> = std::sync::OnceLock::new();

/// Lets the sweep [`for_daemon`] started run: called when the daemon says it serves, so a
/// command line that is refused touches nothing and prints its one error line alone. Does
/// nothing when no sweep was started.
pub fn begin_sweep() {
    use std::sync::atomic::Ordering;
    SWEEP_BEGUN.store(true, Ordering::Release);
    // A sweeper not registered yet checks the flag after registering.
    if let Some(t) = SWEEPER.get() {
        t.unpark();
    }
}

/// The sweep thread's wait for [`begin_sweep`].
fn wait_for_begin() {
    use std::sync::atomic::Ordering;
    _ = SWEEPER.set(std::thread::current());
    while !SWEEP_BEGUN.load(Ordering::Acquire) {
        std::thread::park();
    }
}

/// How old a file of the runtime directory must be before a sweep may take it for a dead
/// daemon's: far longer than any daemon takes between binding its socket and listening on it,
/// or between creating a state file's temporary copy and renaming it into place.
pub const STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(60);

/// Removes from the runtime directory `dir` the files of daemons that are gone, each at least
/// `min_age` old: a socket no one listens on (connecting is refused), a state file whose
/// answering socket is such a socket or missing, and the temporary copy of a state file a daemon
/// was killed while writing. A socket counts as answered when this network namespace's socket
/// table lists it, or else when a connection to it is accepted (a daemon in another network
/// namespace sharing the directory; it sees the connection end at once, and hands nothing
/// over). Anything that cannot be told stays. Returns how many files it removed.
pub fn sweep(dir: &Path, min_age: std::time::Duration) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let listening = crate::restart::Listening::read();
    let answered = |socket: &Path| {
        listening.has(socket)
            || match std::os::unix::net::UnixStream::connect(socket) {
                Ok(_) => true,
                Err(e) => !matches!(e.raw_os_error(), Some(libc::ECONNREFUSED | libc::ENOENT)),
            }
    };
    let old_enough = |meta: &std::fs::Metadata| {
        meta.modified()
            .ok()
            .and_then(|m| m.elapsed().ok())
            .is_some_and(|age| age >= min_age)
    };
    // Removed only if the name still holds the file looked at (a `fusex restart` successor binds
    // its socket anew at the same name).
    let remove = |(path, ino): &(PathBuf, u64)| {
        std::fs::symlink_metadata(path).is_ok_and(|m| m.ino() == *ino)
            && std::fs::remove_file(path).is_ok()
    };
    let mut states = Vec::new();
    let mut sockets = Vec::new();
    let mut removed = 0;
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if !old_enough(&meta) {
            continue;
        }
        let kind = meta.file_type();
        let found = (path, meta.ino());
        if kind.is_file() && name.starts_with('.') && name.contains(".json.new.") {
            removed += usize::from(remove(&found));
        } else if kind.is_file() && name.ends_with(".json") {
            states.push(found);
        } else if std::os::unix::fs::FileTypeExt::is_socket(&kind) && name.ends_with(".sock") {
            sockets.push(found);
        }
    }
    // State files first: their answering sockets are still there to be asked.
    for found in states {
        let state = crate::files::read_regular(&found.0)
            .and_then(|t| serde_json::from_str::<ExportState>(&t).ok());
        if !answered(&answering_socket(dir, &found.0, state.as_ref())) {
            removed += usize::from(remove(&found));
        }
    }
    for found in sockets {
        if !answered(&found.0) {
            removed += usize::from(remove(&found));
        }
    }
    removed
}

/// The name an export's files share in the runtime directory.
pub fn key(id: &MountIdentity) -> String {
    let (maj, min) = id.dev();
    format!("{maj}:{min}-{}", id.mount_id())
}

/// The `fusex restart` socket of the mount `id` in `dir` that a `fusex mount` daemon binds
/// (a `fusex serve` daemon answers for all its exports on one socket, which their state files
/// name: see [`answering_socket`]).
pub fn socket_path(dir: &Path, id: &MountIdentity) -> PathBuf {
    dir.join(format!("{}.sock", key(id)))
}

/// The socket of the daemon that answers for the export whose state file is `state` in `dir`:
/// the one the state names (a `fusex serve` daemon's, shared by its exports), else the file
/// beside it. A name with a `/` or `..` in it leaves the directory, so it is not believed.
pub fn answering_socket(dir: &Path, state_file: &Path, state: Option<&ExportState>) -> PathBuf {
    match state.and_then(|s| s.socket.as_deref()) {
        Some(name) if is_plain_name(name) => dir.join(name),
        _ => state_file.with_extension("sock"),
    }
}

/// The socket answering for the mount `id` of `dir`'s user, read from its state file (see
/// [`answering_socket`]).
pub fn socket_for(dir: &Path, id: &MountIdentity) -> PathBuf {
    let state_file = state_path(dir, id);
    let state = crate::files::read_regular(&state_file)
        .and_then(|t| serde_json::from_str::<ExportState>(&t).ok());
    answering_socket(dir, &state_file, state.as_ref())
}

/// A file name of the directory itself: not empty, no `/`, not `.` or `..`.
fn is_plain_name(name: &str) -> bool {
    !name.is_empty() && !name.contains('/') && name != "." && name != ".."
}

/// The one restart socket of the `fusex serve` daemon `pid`, in the checked directory `dir`.
pub fn serve_socket(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("serve-{pid}.sock"))
}

/// The control socket `fusex serve` listens on when given none, in the checked directory `dir`
/// (where `fusex ctl` looks by default).
pub fn control_socket(dir: &Path) -> PathBuf {
    dir.join("control.sock")
}

/// The state file of the mount `id` in `dir` (what `fusex list` shows).
pub fn state_path(dir: &Path, id: &MountIdentity) -> PathBuf {
    dir.join(format!("{}.json", key(id)))
}

/// What a serving daemon publishes of an export in its state file, for `fusex list`.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct ExportState {
    /// The daemon serving it.
    pub pid: u32,
    pub mountpoint: String,
    /// The image as a path that means the same from anywhere (an NBD URI or `null:` as given).
    pub image: String,
    pub format: String,
    /// `io_uring` or `legacy`.
    pub transport: String,
    pub queues: usize,
    pub writable: bool,
    /// `serving`, or `stopping (N open)`.
    pub state: String,
    /// The file name (in the same directory) of the socket that answers for this export, when
    /// it is not the one beside the state file: a `fusex serve` daemon answers for every export
    /// on one socket rather than binding one per export.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<String>,
}

/// A serving daemon's files in its runtime directory: removed when dropped, unless the export was
/// handed to a successor ([`Entry::leave`]).
pub struct Entry {
    dir: PathBuf,
    id: MountIdentity,
    leave: bool,
    /// The socket beside the state file is this entry's (a `fusex mount` daemon's); a `fusex
    /// serve` export's state names its daemon's shared socket instead.
    own_socket: bool,
}

impl Entry {
    /// The files of the mount `id` in the checked directory `dir`: its state file and the
    /// restart socket beside it.
    pub fn new(dir: PathBuf, id: MountIdentity) -> Entry {
        Entry {
            dir,
            id,
            leave: false,
            own_socket: true,
        }
    }

    /// The state file alone of the mount `id` (its state names the socket answering for it).
    pub fn state_only(dir: PathBuf, id: MountIdentity) -> Entry {
        Entry {
            dir,
            id,
            leave: false,
            own_socket: false,
        }
    }

    /// The restart socket's path.
    pub fn socket(&self) -> PathBuf {
        socket_path(&self.dir, &self.id)
    }

    /// Writes the state file whole (readers see the old state or the new one).
    pub fn write_state(&self, state: &ExportState) {
        let path = state_path(&self.dir, &self.id);
        let bytes = serde_json::to_vec(state).unwrap_or_default();
        if let Err(e) = crate::files::replace(&path, &bytes, 0o600) {
            tracing::debug!("cannot write {}: {e}", path.display());
        }
    }

    /// The export went to a successor, which owns these files now.
    pub fn leave(&mut self) {
        self.leave = true;
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        if self.leave {
            return;
        }
        if self.own_socket {
            let _ = std::fs::remove_file(self.socket());
        }
        let _ = std::fs::remove_file(state_path(&self.dir, &self.id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_and_users_have_separate_directories() {
        assert_eq!(dir_for(0), Path::new("/run/fusex"));
        // A uid with no runtime directory of its own falls back to /tmp.
        assert_eq!(dir_for(4_000_000_123), Path::new("/tmp/fusex-4000000123"));
        let id = MountIdentity::from_parts(77, true, (0, 52));
        assert_eq!(
            socket_path(Path::new("/d"), &id),
            Path::new("/d/0:52-77.sock")
        );
        assert_eq!(
            state_path(Path::new("/d"), &id),
            Path::new("/d/0:52-77.json")
        );
    }

    /// A socket file with no one listening on it, as a killed daemon leaves it.
    fn dead_socket(path: &Path) {
        drop(std::os::unix::net::UnixListener::bind(path).unwrap());
    }

    #[test]
    fn a_sweep_removes_what_dead_daemons_left_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let state = |name: &str, socket: Option<&str>| {
            let s = ExportState {
                socket: socket.map(str::to_string),
                ..ExportState::default()
            };
            std::fs::write(d.join(name), serde_json::to_vec(&s).unwrap()).unwrap();
        };
        // A `fusex mount` daemon that was killed: its state and its socket.
        state("0:50-1.json", None);
        dead_socket(&d.join("0:50-1.sock"));
        // One that serves: its socket listens.
        state("0:50-2.json", None);
        let live = std::os::unix::net::UnixListener::bind(d.join("0:50-2.sock")).unwrap();
        // A `fusex serve` daemon's export, answered on the daemon's socket, which listens...
        state("0:50-3.json", Some("serve-7.sock"));
        let serve = std::os::unix::net::UnixListener::bind(d.join("serve-7.sock")).unwrap();
        // ... and one of a killed `fusex serve` daemon, whose socket is gone too.
        state("0:50-4.json", Some("serve-8.sock"));
        dead_socket(&d.join("serve-8.sock"));
        // A state file whose daemon was killed while writing it.
        std::fs::write(d.join(".0:50-5.json.new.99"), b"{").unwrap();
        // Something fusex does not make.
        std::fs::write(d.join("notes.txt"), b"x").unwrap();

        // Nothing is old enough yet: a daemon between bind and listen is never taken for dead.
        assert_eq!(sweep(d, STALE_AFTER), 0);
        assert_eq!(sweep(d, std::time::Duration::ZERO), 5);
        let mut left: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                "0:50-2.json",
                "0:50-2.sock",
                "0:50-3.json",
                "notes.txt",
                "serve-7.sock"
            ]
        );
        // The live daemons still answer on the sockets they bound.
        for s in ["0:50-2.sock", "serve-7.sock"] {
            std::os::unix::net::UnixStream::connect(d.join(s)).unwrap();
        }
        drop((live, serve));
    }

    #[test]
    fn a_directory_someone_else_made_first_is_refused() {
        // Run as root (the test suite is): a /tmp/fusex-UID made by root for another uid, open to
        // everyone, is what a squatter would leave.
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return;
        }
        let uid = 4_000_000_000 + std::process::id() % 1_000_000;
        let dir = dir_for(uid);
        let _ = std::fs::remove_dir(&dir);
        std::fs::DirBuilder::new().mode(0o777).create(&dir).unwrap();
        let err = checked(uid, true).unwrap_err().to_string();
        assert!(err.contains("owned by user 0"), "{err}");
        // Once its owner is right but others may write it, still refused.
        std::os::unix::fs::chown(&dir, Some(uid), None).unwrap();
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .unwrap();
        let err = checked(uid, true).unwrap_err().to_string();
        assert!(err.contains("writable by others (mode 777)"), "{err}");
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        assert_eq!(checked(uid, false).unwrap(), dir);
        std::fs::remove_dir(&dir).unwrap();
        // A symlink is never taken for the directory.
        std::os::unix::fs::symlink("/", &dir).unwrap();
        let err = checked(uid, true).unwrap_err().to_string();
        assert!(err.contains("not a directory"), "{err}");
        std::fs::remove_file(&dir).unwrap();
    }
}
