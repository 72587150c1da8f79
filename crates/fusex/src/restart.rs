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

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use transport::MountIdentity;

/// Whether a daemon listens for restarts on `socket`: false once the daemon that bound it died.
/// Read from `/proc/net/unix` (bound sockets show their path) rather than by connecting, which
/// would make a live daemon log a restart that never came. True when it cannot be told.
pub fn is_listening(socket: &Path) -> bool {
    let Ok(table) = std::fs::read_to_string("/proc/net/unix") else {
        return true;
    };
    let want = socket.to_string_lossy();
    table
        .lines()
        .any(|l| l.split_whitespace().nth(7) == Some(&*want))
}

/// Whether a live daemon serves the fusex mount `m`: its restart socket is listening. True when
/// it cannot be told (the mount cannot be identified, its user is not shown).
pub fn daemon_listens(m: &transport::MountEntry) -> bool {
    let (Ok(id), Some(uid)) = (MountIdentity::of_path(Path::new(&m.mount_point)), m.user_id) else {
        return true;
    };
    socket_of(uid, &id).is_some_and(|s| is_listening(&s))
}

/// The restart socket of the mount `id` served by user `uid`, in that user's checked runtime
/// directory (see [`crate::runtime`]): None when the directory cannot be trusted.
pub fn socket_of(uid: u32, id: &MountIdentity) -> Option<PathBuf> {
    let dir = crate::runtime::checked(uid, false).ok()?;
    Some(crate::runtime::socket_path(&dir, id))
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

/// Connects to the daemon listening on `path`.
pub fn connect(path: &Path) -> io::Result<UnixStream> {
    UnixStream::connect(path)
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
/// Descriptors a message may carry.
const MAX_FDS: usize = 4;

/// Sends `msg` with `fds` attached.
pub fn send(sock: &UnixStream, msg: &serde_json::Value, fds: &[RawFd]) -> io::Result<()> {
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

/// Receives one message and the descriptors attached to it (owned here from now on).
pub fn recv(sock: &UnixStream) -> io::Result<(serde_json::Value, Vec<OwnedFd>)> {
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

/// A message's `op`.
pub fn op(msg: &serde_json::Value) -> &str {
    msg["op"].as_str().unwrap_or("")
}

/// Fails with the peer's `error` when the message is a refusal, or when it is not `want`.
pub fn expect(msg: &serde_json::Value, want: &str) -> Result<()> {
    match op(msg) {
        o if o == want => Ok(()),
        "refused" => bail!("{}", msg["error"].as_str().unwrap_or("refused")),
        o => bail!("unexpected restart message {o:?} (wanted {want:?})"),
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

    #[test]
    fn messages_carry_descriptors() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = tempfile::tempfile().unwrap();
        let (r, w) = std::io::pipe().unwrap();
        let fds = [f.as_raw_fd(), w.as_fd().as_raw_fd()];
        send(&a, &serde_json::json!({"op": "state", "n": 7}), &fds).unwrap();
        send(&a, &serde_json::json!({"op": "released"}), &[]).unwrap();
        let (msg, got) = recv(&b).unwrap();
        assert_eq!(op(&msg), "state");
        assert_eq!(msg["n"], 7);
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
        expect(&msg, "released").unwrap();
        assert!(got.is_empty());
    }

    #[test]
    fn refusals_and_garbage_are_errors() {
        let (a, b) = UnixStream::pair().unwrap();
        send(
            &a,
            &serde_json::json!({"op": "refused", "error": "no: because"}),
            &[],
        )
        .unwrap();
        let (msg, _) = recv(&b).unwrap();
        assert_eq!(
            expect(&msg, "state").unwrap_err().to_string(),
            "no: because"
        );
        (&a).write_all(&[3, 0, 0, 0, b'{', b'x', b'}']).unwrap();
        assert!(recv(&b).is_err());
        (&a).write_all(&u32::MAX.to_le_bytes()).unwrap();
        assert!(recv(&b).is_err());
        drop(a);
        assert!(recv(&b).is_err());
    }
}
