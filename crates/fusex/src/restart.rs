//! `fusex restart`: hands a live export's FUSE connection from the running daemon to a new fusex
//! process, so the daemon can be upgraded or restarted while applications keep the file open.
//!
//! The running daemon listens on a unix socket named after its mount (the FUSE connection's
//! device number and the unique mount id) in its user's runtime directory ([`crate::runtime`]),
//! which only that user can write, so only the daemon can be listening there; it accepts only its
//! own user or root. `fusex restart` finds the directory from the mount's `user_id=` option,
//! checks it the same way and believes only a peer of that user or root.
//! The protocol, one JSON message per frame (a 4-byte little-endian length, then the text):
//!
//! 1. new → old: `{"op":"hello"}`.
//! 2. old → new: the export's state (command line, working directory, what INIT settled, the
//!    mount's identity) with the connection's fd and the `--auto-unmount` watcher's pipe attached
//!    (`SCM_RIGHTS`), or `{"op":"refused","error":…}`. The old daemon keeps serving.
//! 3. The new process opens the image (taking the image locks over, see
//!    [`backend::Locking::Takeover`]) and sets its queues up. If anything fails it just goes
//!    away: the old daemon never stopped.
//! 4. new → old: `{"op":"release"}`. The old daemon takes no new requests, answers the ones it
//!    has, flushes a writable image, and answers `{"op":"released"}`; then it exits without
//!    unmounting. Requests arriving meanwhile wait in the kernel for the new process.
//!
//! A `fusex serve` daemon sends `serve`, then one `export` per export, then `serveend`; after
//! `release` each directory export's tables (`dirtable`, `dirnodes`, `dirfiles`, `dirend`, with
//! their descriptors: `service::dirtable`), then `servereleased`, and waits for `taken`.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use transport::MountIdentity;

/// The paths unix sockets are bound to, from `/proc/net/unix` (bound sockets show their path):
/// whether a daemon listens for restarts on a socket, false once the daemon that bound it died.
/// Read rather than connecting, which would make a live daemon log a restart that never came;
/// read once for every socket a caller asks about.
pub struct Listening(Option<std::collections::HashSet<String>>);

impl Listening {
    /// The table as it is now.
    pub fn read() -> Listening {
        Listening(std::fs::read_to_string("/proc/net/unix").ok().map(|table| {
            table
                .lines()
                .filter_map(|l| l.split_whitespace().nth(7).map(str::to_string))
                .collect()
        }))
    }

    /// Whether a socket is bound at `socket`; true when the table could not be read.
    pub fn has(&self, socket: &Path) -> bool {
        self.0
            .as_ref()
            .is_none_or(|paths| paths.contains(&*socket.to_string_lossy()))
    }

    /// Whether a live daemon serves the fusex mount `m`: its restart socket is listening. True
    /// when it cannot be told (the mount cannot be identified, its user is not shown).
    pub fn daemon_of(&self, m: &transport::MountEntry) -> bool {
        let (Ok(id), Some(uid)) = (MountIdentity::of_path(Path::new(&m.mount_point)), m.user_id)
        else {
            return true;
        };
        socket_of(uid, &id).is_some_and(|s| self.has(&s))
    }
}

/// The restart socket of the mount `id` served by user `uid`, in that user's checked runtime
/// directory (see [`crate::runtime`]): None when the directory cannot be trusted.
pub fn socket_of(uid: u32, id: &MountIdentity) -> Option<PathBuf> {
    let dir = crate::runtime::checked(uid, false).ok()?;
    Some(crate::runtime::socket_for(&dir, id))
}

/// Binds the restart socket at `path`, replacing what a predecessor (`fusex restart`) left there:
/// the directory is this user's alone, so nothing else can be at that name.
pub fn listen(path: &Path) -> io::Result<UnixListener> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    UnixListener::bind(path)
}

/// Connects to the daemon serving the mount `id` from `dir` (its user's runtime directory). A
/// daemon of a release before the runtime directory listens on the abstract name
/// `fusex-restart/MAJ:MIN/ID` instead; that name is tried when the socket file is missing, so such
/// a daemon can still be upgraded in place. Anyone may bind an abstract name: the caller believes
/// the peer only if it is root or the mount's user ([`peer`]), so a squatter is refused.
pub fn connect(dir: &Path, id: &MountIdentity) -> io::Result<UnixStream> {
    use std::os::linux::net::SocketAddrExt;
    match UnixStream::connect(crate::runtime::socket_for(dir, id)) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let (maj, min) = id.dev();
            let name = format!("fusex-restart/{maj}:{min}/{}", id.mount_id());
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
            UnixStream::connect_addr(&addr).map_err(|_| e)
        }
        r => r,
    }
}

/// The peer's pid and uid (`SO_PEERCRED`), as the kernel recorded them at connect.
pub fn peer(sock: &UnixStream) -> io::Result<(u32, u32)> {
    // SAFETY: ucred is plain old data; all-zero is valid.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which lives across the call.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((cred.pid as u32, cred.uid))
}

/// Largest message accepted (the state is a few hundred bytes).
const MAX_MESSAGE: usize = 1 << 20;
/// Descriptors a message may carry: a directory export's tables travel with theirs, this many
/// a message (`SCM_MAX_FD` is 253).
pub const MAX_FDS: usize = 250;

/// The newest version of [`State`] (and [`ServeState`]) this binary reads and writes. A successor
/// reads any version up to its own (the unversioned state of earlier fusex releases is version 0,
/// the same fields) and refuses a newer one in one line instead of misreading it. A daemon writes
/// the lowest version that says what its state needs ([`State::version_for`]), so a successor of
/// an earlier release still takes over every export it can.
pub const STATE_VERSION: u32 = 3;

/// The version of a state that carries an NBD export ([`State::nbd`]) or a directory export
/// ([`State::directory`]): a successor before it would connect to the server before this
/// daemon let go, which a server without multi-conn need not accept, or open the directory as
/// an image, so it must refuse; it does, the version being newer than its own.
pub const NBD_STATE_VERSION: u32 = 2;

/// The version of a [`ServeState`] that carries TLS credentials objects
/// ([`ServeState::objects`]): a successor before it would drop them and then refuse the NBD
/// nodes naming them, so it must refuse the state first; it does, the version being newer than
/// its own. (IOThread objects alone do not need it: a successor that drops them serves every
/// export the same.)
pub const OBJECTS_STATE_VERSION: u32 = 3;

/// The version of a state without an NBD export: what release 1 wrote and reads.
const PLAIN_STATE_VERSION: u32 = 1;

/// One message of the conversation. On the wire: a JSON object whose `op` names the variant, the
/// variant's fields beside it (the format earlier releases spoke, so either side may be older).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum Message {
    /// new → old: asks for the export.
    Hello,
    /// old → new: the export's state, with the connection's fd (and the watcher's pipe) attached.
    State(State),
    /// old → new: not handed over, and why (the old daemon serves on).
    Refused {
        /// What to tell the user.
        error: String,
    },
    /// new → old: everything that can fail is done; stop taking requests and let go.
    Release,
    /// old → new: quiet and flushed; the new daemon serves from now on.
    Released {
        /// Files open on the export at the handover (their RELEASE reaches the new daemon).
        #[serde(default)]
        open_files: u64,
    },
    /// old → new, from a `fusex serve` daemon, instead of `state`: the daemon as a whole. Its
    /// exports follow, one `export` message each with its descriptors, then `serveend`.
    Serve(ServeState),
    /// old → new: one export of a `fusex serve` daemon, with its connection's fd (and the
    /// watcher's pipe) attached.
    Export(ExportHanding),
    /// old → new: the last export was sent.
    ServeEnd,
    /// old → new: every export of a `fusex serve` daemon is quiet and flushed; files open on
    /// each, by export id.
    ServeReleased {
        open_files: std::collections::BTreeMap<String, u64>,
    },
    /// new → old, after `servereleased`: every export is adopted and served here; the old
    /// daemon may leave the mounts (without it, it unmounts them: the successor is gone).
    Taken,
    /// old → new, after `release` and before `servereleased`, for each directory export of a
    /// `fusex serve` daemon: its tables without their nodes and handles, which follow in
    /// `dirnodes` and `dirfiles` messages, each with the descriptors of its entries, then
    /// `dirend` (see `service::dirtable`).
    DirTable {
        /// The export's id.
        id: String,
        table: dirfs::DirHandover,
    },
    /// old → new: some of a directory export's nodes.
    DirNodes {
        nodes: Vec<dirfs::inodes::NodeEntry>,
    },
    /// old → new: some of a directory export's open handles.
    DirFiles { files: Vec<dirfs::files::FileEntry> },
    /// old → new: the directory export's tables are whole.
    DirEnd,
}

/// What a successor of a `fusex serve` daemon needs besides its exports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServeState {
    /// [`STATE_VERSION`] of the sender.
    pub version: u32,
    /// The `fusex serve` command line (the successor parses it: sockets, config file, pid
    /// file).
    pub argv: Vec<String>,
    /// Its working directory.
    pub cwd: String,
    /// systemd's notification socket, if the daemon is a service.
    pub notify_socket: Option<String>,
    /// The block nodes added with `blockdev-add` (or `--blockdev`), in order: their arguments.
    pub nodes: Vec<serde_json::Value>,
    /// The size of each NBD node's export, by URI: the successor adds those nodes again without
    /// connecting (this daemon still holds the server's connections), and takes the size from
    /// here. Empty (and absent on the wire) without NBD nodes.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub nbd_sizes: std::collections::BTreeMap<String, u64>,
    /// The objects (`--object`, `object-add`: IOThreads, TLS credentials), in order: their
    /// arguments, which the successor adds before the nodes. Empty (and absent on the wire)
    /// without any. With TLS credentials the state is [`OBJECTS_STATE_VERSION`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub objects: Vec<serde_json::Value>,
    /// As [`State::log_stderr`]: the daemon's stderr comes with this message.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub log_stderr: bool,
}

/// One export of a `fusex serve` daemon.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportHanding {
    /// Its QMP id.
    pub id: String,
    /// Its node; an export that named its image itself (`fusex ctl add`, the config file) has
    /// a node of its own, which the successor makes again.
    pub node: String,
    pub own_node: bool,
    /// The config file's table it came from.
    pub config: Option<serde_json::Value>,
    /// The IOThread objects it names (none: absent on the wire).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub iothreads: Vec<String>,
    /// The export as `fusex mount` hands it over.
    pub state: State,
}

/// What a successor needs of a live export besides its descriptors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct State {
    /// [`STATE_VERSION`] of the sender (0: a release before the state had one).
    #[serde(default)]
    pub version: u32,
    /// The `fusex mount` command line the export was started with (the successor parses it).
    pub argv: Vec<String>,
    /// The old daemon's working directory: relative paths on `argv` are resolved from it.
    pub cwd: String,
    /// What INIT settled (it is not sent again), its fields beside the others on the wire.
    #[serde(flatten)]
    pub init: transport::Negotiated,
    /// Requests in flight per queue.
    pub depth: usize,
    /// Queue threads.
    pub queues: usize,
    /// The canonical mountpoint.
    pub mountpoint: String,
    /// The mount's id (see [`MountIdentity`]).
    pub mount_id: u64,
    /// Whether `mount_id` is the never-reused one.
    pub unique: bool,
    /// The FUSE connection's device number.
    pub dev: (u32, u32),
    /// The mountpoint file the first daemon created (device major, minor, inode).
    pub created: Option<(u32, u32, u64)>,
    /// Whether fusermount3 made the mount.
    pub via_fusermount: bool,
    /// systemd's notification socket, if the export is a service.
    pub notify_socket: Option<String>,
    /// Whether the `--auto-unmount` watcher's pipe is attached.
    pub watcher: bool,
    /// The image as given on the command line.
    pub image: String,
    /// An NBD export as this daemon negotiated it: the successor serves it from this without
    /// connecting first, and its queues connect once this daemon has disconnected
    /// (`backend::NbdBackend::adopt`). Absent for other images.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd: Option<NbdExport>,
    /// A directory export (`fusex serve`): its tables follow the release (`dirtable`), and the
    /// successor takes them over instead of opening an image.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub directory: bool,
    /// The passthrough backing id the export's opens are answered with. It belongs to the
    /// connection, which the successor shares: the successor answers with the same id (the
    /// kernel fails an open with EIO when the file is open under another registration of the
    /// image), and this daemon leaves it registered. Absent when passthrough is off, and from
    /// daemons before it was handed over (their successors register the image again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backing: Option<HandedBacking>,
    /// This daemon logs to its stderr, a file, whose descriptor comes last with the state: the
    /// successor logs there too ([`crate::logging::stderr_to_hand_over`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub log_stderr: bool,
    /// The file the image path named when the export was opened (device, inode): a successor
    /// refuses a path that names another file now (one moved into its place), which would
    /// serve other bytes than the ones applications wrote. Absent for what is not a file (an
    /// NBD export, `null:`) and from daemons before it was sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_file: Option<(u64, u64)>,
}

/// The file `image` names (device, inode), following symlinks as opening it does; None for
/// what names no file (an NBD URI, `null:SIZE`, a missing path) and for a directory (whose
/// export hands its own tables over).
pub fn image_file(image: &str) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(image)
        .ok()
        .filter(|m| !m.is_dir())
        .map(|m| (m.dev(), m.ino()))
}

/// A passthrough backing id as the restart state carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandedBacking {
    /// The id, for `fuse_open_out.backing_id`.
    pub id: i32,
    /// The file registered under it (device, inode): the successor checks that the image it
    /// opened is that file.
    pub file: (u64, u64),
}

/// An NBD export's negotiated parameters (`nbd::Export`) as the restart state carries them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NbdExport {
    /// Size in bytes.
    pub size: u64,
    /// Transmission flags (read-only, multi-conn, flush, FUA, ...).
    pub flags: u16,
    /// Minimum, preferred and largest request size.
    pub min_block: u32,
    pub preferred_block: u32,
    pub max_payload: u32,
    /// Structured replies were negotiated.
    pub structured: bool,
    /// The `base:allocation` context id, if negotiated.
    pub allocation_context: Option<u32>,
}

impl From<nbd::Export> for NbdExport {
    fn from(e: nbd::Export) -> NbdExport {
        NbdExport {
            size: e.size,
            flags: e.flags,
            min_block: e.min_block,
            preferred_block: e.preferred_block,
            max_payload: e.max_payload,
            structured: e.structured,
            allocation_context: e.allocation_context,
        }
    }
}

impl From<NbdExport> for nbd::Export {
    fn from(e: NbdExport) -> nbd::Export {
        nbd::Export {
            size: e.size,
            flags: e.flags,
            min_block: e.min_block,
            preferred_block: e.preferred_block,
            max_payload: e.max_payload,
            structured: e.structured,
            allocation_context: e.allocation_context,
        }
    }
}

impl State {
    /// The version a state is written with: [`NBD_STATE_VERSION`] when it carries an NBD
    /// export or is a directory export's (a successor that cannot adopt one then refuses),
    /// else what release 1 wrote.
    pub fn version_for(newer: bool) -> u32 {
        if newer {
            NBD_STATE_VERSION
        } else {
            PLAIN_STATE_VERSION
        }
    }

    /// The mount as [`transport::Mount::adopt`] takes it over.
    pub fn handover(&self) -> transport::Handover {
        transport::Handover {
            mountpoint: PathBuf::from(&self.mountpoint),
            identity: MountIdentity::from_parts(self.mount_id, self.unique, self.dev),
            created: self.created,
            via_fusermount: self.via_fusermount,
            directory: self.directory,
        }
    }
}

/// Sends `msg` with `fds` attached.
pub fn send(sock: &UnixStream, msg: &Message, fds: &[RawFd]) -> io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(io::Error::other)?;
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&body);
    if fds.is_empty() {
        return (&*sock).write_all(&frame);
    }
    if fds.len() > MAX_FDS {
        return Err(io::Error::other("too many descriptors"));
    }
    let sent = transport::fdpass::send_with_fds(sock.as_raw_fd(), &frame, fds)?;
    if sent < frame.len() {
        (&*sock).write_all(&frame[sent..])?;
    }
    Ok(())
}

/// Receives one message and the descriptors attached to it (owned here from now on). A message
/// that is not one of [`Message`]'s is an error naming what it lacks.
pub fn recv(sock: &UnixStream) -> io::Result<(Message, Vec<OwnedFd>)> {
    let mut head = [0u8; 4];
    let (got, fds) = transport::fdpass::recv_with_fds(sock.as_raw_fd(), &mut head, MAX_FDS)?;
    if got == 0 {
        return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
    }
    if got < head.len() {
        (&*sock).read_exact(&mut head[got..])?;
    }
    let len = u32::from_le_bytes(head) as usize;
    if len > MAX_MESSAGE {
        return Err(io::Error::other("message too large"));
    }
    let mut body = vec![0u8; len];
    (&*sock).read_exact(&mut body)?;
    let msg = serde_json::from_slice(&body).map_err(io::Error::other)?;
    Ok((msg, fds))
}

/// Fails with the peer's `error` when the message is a refusal, or names what came instead of
/// `want` (the variant's name as on the wire).
/// Sends `refused` with `why` (best effort: the peer may be gone) and returns it as the error.
pub fn refuse(sock: &UnixStream, why: &str) -> anyhow::Error {
    let _ = send(
        sock,
        &Message::Refused {
            error: why.to_string(),
        },
        &[],
    );
    anyhow::anyhow!("{why}")
}

/// The old daemon's side of every restart conversation's start: a peer that stops talking holds
/// the listener at most a while (generous: the new process opens images in between); only root
/// or `euid` may ask for `what` ("this export", "this daemon"), others are refused; then the
/// peer's `hello`. Returns the successor's pid.
pub fn greet(sock: &UnixStream, euid: u32, what: &str) -> Result<u32> {
    sock.set_read_timeout(Some(std::time::Duration::from_secs(300)))?;
    let (pid, uid) = peer(sock).context("peer credentials")?;
    if uid != 0 && uid != euid {
        return Err(refuse(
            sock,
            &format!(
                "user {uid} may not restart {what}: run fusex restart as root or as user {euid}"
            ),
        ));
    }
    match recv(sock).context("reading the request")? {
        (Message::Hello, _) => Ok(pid),
        (other, _) => Err(unexpected(&other, "hello")),
    }
}

pub fn unexpected(msg: &Message, want: &str) -> anyhow::Error {
    match msg {
        Message::Refused { error } => anyhow::anyhow!("{error}"),
        other => {
            let op = serde_json::to_value(other)
                .ok()
                .and_then(|v| v["op"].as_str().map(str::to_string))
                .unwrap_or_default();
            anyhow::anyhow!("unexpected restart message {op:?} (wanted {want:?})")
        }
    }
}

/// `fusex restart`'s first step: the identity of the fusex export at `path`, and the user whose
/// daemon serves it.
pub fn identify(path: &Path) -> Result<(MountIdentity, u32)> {
    let shown = path.display();
    let canon = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .canonicalize()
        .with_context(|| format!("{shown}: parent directory not found"))?
        .join(path.file_name().context("no file name")?);
    let owner = match transport::fuse_mount_at(&canon) {
        Some(e) if e.is_fusex() => e
            .user_id
            .with_context(|| format!("{shown}: the mount does not say which user serves it"))?,
        Some(e) => bail!(
            "{shown} is a FUSE mount of type {}, not a fusex export",
            e.fstype
        ),
        None => bail!("{shown} is not a FUSE mount: give the file a fusex export is mounted on"),
    };
    let id = MountIdentity::of_path(&canon)
        .with_context(|| format!("identifying the mount at {shown}"))?;
    Ok((id, owner))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn state() -> State {
        State {
            version: STATE_VERSION,
            argv: vec![
                "fusex".into(),
                "mount".into(),
                "a.img".into(),
                "a.raw".into(),
            ],
            cwd: "/srv".into(),
            init: transport::Negotiated {
                minor: 45,
                kernel_minor: 45,
                offered: 1 << 40 | 3,
                flags: 3,
                max_write: 1 << 19,
                max_readahead: 1 << 17,
                request_timeout: Some(600),
            },
            depth: 33,
            queues: 2,
            mountpoint: "/srv/a.raw".into(),
            mount_id: 1 << 33,
            unique: true,
            dev: (0, 52),
            created: Some((8, 1, 77)),
            via_fusermount: false,
            notify_socket: None,
            watcher: true,
            image: "a.img".into(),
            nbd: None,
            directory: false,
            backing: None,
            log_stderr: false,
            image_file: None,
        }
    }

    /// An NBD export's parameters go across, and a state carrying them has a version a
    /// successor of release 1 refuses; one without them is written as release 1 wrote it (no
    /// `nbd` member), so such a successor still takes it.
    #[test]
    fn an_nbd_export_goes_across_and_only_to_a_successor_that_can_adopt_it() {
        let plain = State {
            version: State::version_for(false),
            ..state()
        };
        let wire = serde_json::to_value(Message::State(plain)).unwrap();
        assert_eq!(wire["version"], 1);
        assert!(wire.get("nbd").is_none());
        let e = nbd::Export {
            size: 1 << 30,
            flags: nbd::FLAG_READ_ONLY | nbd::FLAG_CAN_MULTI_CONN,
            min_block: 512,
            preferred_block: 4096,
            max_payload: 1 << 25,
            structured: true,
            allocation_context: Some(7),
        };
        let with = State {
            version: State::version_for(true),
            nbd: Some(e.into()),
            ..state()
        };
        assert!(with.version > PLAIN_STATE_VERSION);
        let (a, b) = UnixStream::pair().unwrap();
        send(&a, &Message::State(with.clone()), &[]).unwrap();
        let (Message::State(got), _) = recv(&b).unwrap() else {
            panic!("not a state");
        };
        assert_eq!(got, with);
        assert_eq!(nbd::Export::from(got.nbd.unwrap()), e);
    }

    /// The passthrough backing id goes across; a state from a daemon that did not send it
    /// reads as none (its successor registers the image itself).
    #[test]
    fn the_backing_id_goes_across_and_is_optional() {
        let with = State {
            backing: Some(HandedBacking {
                id: 3,
                file: (2049, 131_077),
            }),
            ..state()
        };
        let (a, b) = UnixStream::pair().unwrap();
        send(&a, &Message::State(with.clone()), &[]).unwrap();
        let (Message::State(got), _) = recv(&b).unwrap() else {
            panic!("not a state");
        };
        assert_eq!(got, with);
        let mut older = serde_json::to_value(Message::State(state())).unwrap();
        assert!(older.get("backing").is_none(), "{older}");
        assert!(older.get("log_stderr").is_none(), "{older}");
        assert!(older.get("image_file").is_none(), "{older}");
        older["version"] = PLAIN_STATE_VERSION.into();
        let Message::State(read) = serde_json::from_value(older).unwrap() else {
            panic!("not a state");
        };
        assert_eq!(read.backing, None);
    }

    /// A file names its device and inode (a new file in its place, others); a directory, a
    /// missing path, an NBD URI and `null:` name none.
    #[test]
    fn image_file_names_the_file_a_path_opens() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.img");
        std::fs::write(&a, b"a").unwrap();
        let path = a.to_str().unwrap();
        let first = image_file(path).expect("a file");
        assert_eq!(image_file(path), Some(first));
        let b = dir.path().join("b.img");
        std::fs::write(&b, b"b").unwrap();
        std::fs::rename(&b, &a).unwrap();
        assert_ne!(image_file(path), Some(first), "another file in its place");
        for none in [
            dir.path().to_str().unwrap(),
            dir.path().join("missing").to_str().unwrap(),
            "nbd://localhost/export",
            "null:1G",
        ] {
            assert_eq!(image_file(none), None, "{none}");
        }
    }

    #[test]
    fn messages_carry_descriptors() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = tempfile::tempfile().unwrap();
        let (r, w) = std::io::pipe().unwrap();
        let fds = [f.as_raw_fd(), w.as_fd().as_raw_fd()];
        send(&a, &Message::State(state()), &fds).unwrap();
        send(&a, &Message::Released { open_files: 2 }, &[]).unwrap();
        let (msg, got) = recv(&b).unwrap();
        assert_eq!(msg, Message::State(state()));
        assert_eq!(got.len(), 2);
        // The received pipe end is the same pipe.
        drop(w);
        let mut wr = std::fs::File::from(got.into_iter().nth(1).unwrap());
        wr.write_all(b"x").unwrap();
        drop(wr);
        let mut s = String::new();
        (&r).read_to_string(&mut s).unwrap();
        assert_eq!(s, "x");
        let (msg, got) = recv(&b).unwrap();
        assert_eq!(msg, Message::Released { open_files: 2 });
        assert!(got.is_empty());
    }

    /// The wire format is the one earlier releases spoke (flat fields beside `op`), so a daemon
    /// of an earlier release can hand over to this one: its state, without `version`, reads as
    /// version 0.
    #[test]
    fn the_state_of_an_earlier_release_still_reads() {
        let wire = serde_json::to_value(Message::State(state())).unwrap();
        assert_eq!(wire["op"], "state");
        assert_eq!(wire["dev"], serde_json::json!([0, 52]));
        assert_eq!(wire["created"], serde_json::json!([8, 1, 77]));
        let mut old = wire.clone();
        old.as_object_mut().unwrap().remove("version");
        // A field this release does not know is ignored, as earlier releases ignored ours.
        old["later"] = 1.into();
        let Message::State(st) = serde_json::from_value(old).unwrap() else {
            panic!("not a state");
        };
        assert_eq!(st.version, 0);
        assert_eq!(st.handover().identity.mount_id(), 1 << 33);
        for (op, msg) in [
            ("hello", Message::Hello),
            ("release", Message::Release),
            ("released", Message::Released { open_files: 0 }),
        ] {
            let v = serde_json::json!({ "op": op });
            assert_eq!(serde_json::from_value::<Message>(v).unwrap(), msg);
        }
    }

    #[test]
    fn refusals_and_garbage_are_errors() {
        let (a, b) = UnixStream::pair().unwrap();
        send(
            &a,
            &Message::Refused {
                error: "no: because".into(),
            },
            &[],
        )
        .unwrap();
        let (msg, _) = recv(&b).unwrap();
        assert_eq!(unexpected(&msg, "state").to_string(), "no: because");
        assert_eq!(
            unexpected(&Message::Hello, "state").to_string(),
            "unexpected restart message \"hello\" (wanted \"state\")"
        );
        (&a).write_all(&[3, 0, 0, 0, b'{', b'x', b'}']).unwrap();
        assert!(recv(&b).is_err());
        // Well-formed JSON that is no message: an error, not a default.
        let body = br#"{"op":"state","argv":[]}"#;
        (&a).write_all(&(body.len() as u32).to_le_bytes()).unwrap();
        (&a).write_all(body).unwrap();
        assert!(recv(&b).is_err());
        (&a).write_all(&u32::MAX.to_le_bytes()).unwrap();
        assert!(recv(&b).is_err());
        drop(a);
        assert!(recv(&b).is_err());
    }
}
