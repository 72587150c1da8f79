//! The QMP server over a unix socket: one thread per client (plus one writing its events, see
//! [`crate::outbox`]), so a client that connects and never speaks, or stops reading, holds only its own
//! threads; a poll loop accepts connections and waits for shutdown.

use std::collections::HashMap;
use std::fs;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::dispatch::Dispatcher;
use crate::error::ServerError;
use crate::events::EventBus;
use crate::protocol::ServerInfo;
use crate::session::{Session, DEFAULT_MAX_REQUEST};

/// How long a shutdown waits for clients to take the replies already queued for them.
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(1);

/// How the server behaves; [`ServerConfig::default`] is what fusex uses.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// What the greeting and `query-version` report.
    pub info: ServerInfo,
    /// Users whose connections are served (checked with `SO_PEERCRED`); others are closed at
    /// once. Default: the server's effective uid and root, as a 0600 socket would allow anyway
    /// (the check also holds when the socket file's mode is later loosened).
    pub allowed_uids: Vec<u32>,
    /// The longest request a client may send; a longer one is answered with an error and the
    /// connection is closed.
    pub max_request: usize,
    /// Connections served at once; more are closed at once (and logged).
    pub max_clients: usize,
    /// Replies and events queued for one client before it counts as not reading: its own
    /// replies then wait (only it is slowed), an event disconnects it.
    pub queue_len: usize,
    /// Where events come from; clone it before building the config to emit into it.
    pub events: EventBus,
}

impl Default for ServerConfig {
    fn default() -> Self {
        // SAFETY: geteuid takes no arguments, touches no memory and cannot fail.
        let me = unsafe { libc::geteuid() };
        let mut allowed_uids = vec![me];
        if me != 0 {
            allowed_uids.push(0);
        }
        ServerConfig {
            info: ServerInfo::default(),
            allowed_uids,
            max_request: DEFAULT_MAX_REQUEST,
            max_clients: 64,
            queue_len: 256,
            events: EventBus::new(),
        }
    }
}

/// A bound QMP socket, not yet serving: [`Server::run`] serves it until
/// [`ShutdownHandle::shutdown`].
pub struct Server {
    listener: UnixListener,
    /// The socket's path, or `fd=N` for one handed over that has none.
    path: PathBuf,
    /// The socket file's (device, inode): at exit it is removed only if it is still this one.
    /// None for a socket handed over that has no file.
    ident: Option<(u64, u64)>,
    dispatcher: Arc<dyn Dispatcher>,
    config: Arc<ServerConfig>,
    wake_rx: UnixStream,
    handle: ShutdownHandle,
}

/// Stops a running [`Server`] from any thread: the accept loop ends, every client connection is
/// shut down (after the replies already queued for it are sent, up to a second), their threads
/// are joined and the socket file is removed.
#[derive(Clone, Debug)]
pub struct ShutdownHandle {
    wake_tx: Arc<UnixStream>,
}

impl ShutdownHandle {
    /// Asks the server to stop; [`Server::run`] returns once it has.
    pub fn shutdown(&self) {
        let _ = (&*self.wake_tx).write(&[1]);
    }
}

/// Binds `path` as a unix socket of mode 0600, independent of the umask: the socket is bound
/// inside a fresh 0700 directory next to `path`, made 0600 there (no one else can reach it
/// meanwhile), and renamed into place, so it never exists at `path` with a looser mode. (fchmod
/// on a socket descriptor does not change the file's mode, and changing the umask is
/// process-wide, racing other threads.) A stale socket at `path` (nobody answers) is replaced;
/// a live one, or anything that is not a socket, is an error.
fn bind_0600(path: &Path) -> Result<(UnixListener, (u64, u64)), ServerError> {
    let io_err = |what, err| ServerError::Io {
        path: path.to_owned(),
        what,
        err,
    };
    if path.file_name().is_none() {
        return Err(ServerError::BadPath(path.to_owned()));
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        Some(_) => Path::new("."),
        None => return Err(ServerError::BadPath(path.to_owned())),
    };
    match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => match UnixStream::connect(path) {
            Ok(_) => return Err(ServerError::InUse(path.to_owned())),
            Err(_) => tracing::info!(path = %path.display(), "replacing a stale QMP socket"),
        },
        Ok(_) => return Err(ServerError::NotASocket(path.to_owned())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("stat", e)),
    }
    static SEQ: AtomicU64 = AtomicU64::new(0);
    // A short name: the temporary socket path must fit sun_path (108 bytes) whenever the final
    // one does, or nearly.
    let tmp_dir = parent.join(format!(
        ".qmp{}.{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    fs::DirBuilder::new()
        .mode(0o700)
        .create(&tmp_dir)
        .map_err(|e| io_err("create a private directory beside it", e))?;
    let tmp_sock = tmp_dir.join("s");
    let result = (|| {
        let listener = UnixListener::bind(&tmp_sock).map_err(|e| io_err("bind", e))?;
        fs::set_permissions(&tmp_sock, fs::Permissions::from_mode(0o600))
            .map_err(|e| io_err("chmod 0600", e))?;
        fs::rename(&tmp_sock, path).map_err(|e| io_err("rename into place", e))?;
        let m = fs::symlink_metadata(path).map_err(|e| io_err("stat", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| io_err("set non-blocking", e))?;
        Ok((listener, (m.dev(), m.ino())))
    })();
    let _ = fs::remove_file(&tmp_sock);
    let _ = fs::remove_dir(&tmp_dir);
    result
}

/// The connecting process's uid and pid (`SO_PEERCRED`: taken at connect, cannot be forged).
pub fn peer_credentials(stream: &UnixStream) -> io::Result<(u32, i32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: the descriptor is a live socket owned by `stream`; `cred` and `len` are valid,
    // writable and `len` holds the size of `cred`, which the kernel writes at most.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((cred.uid, cred.pid))
}

/// Waits until one of `fds` is readable, retrying on EINTR. Returns which ones are.
fn wait_readable(fds: &[&dyn AsRawFd]) -> io::Result<Vec<bool>> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|f| libc::pollfd {
            fd: f.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    loop {
        // SAFETY: `pfds` is a valid, writable array of `pfds.len()` pollfd structs that lives
        // across the call; the descriptors belong to the caller's live objects.
        let rc = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, -1) };
        if rc >= 0 {
            return Ok(pfds.iter().map(|p| p.revents != 0).collect());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

impl Server {
    /// Binds the socket at `path` (mode 0600, see the module docs) for `dispatcher`'s
    /// commands. Nothing is served until [`Server::run`].
    pub fn bind(
        path: impl AsRef<Path>,
        dispatcher: Arc<dyn Dispatcher>,
        config: ServerConfig,
    ) -> Result<Server, ServerError> {
        let path = path.as_ref().to_owned();
        let (listener, ident) = bind_0600(&path)?;
        Server::listening(listener, path, Some(ident), dispatcher, config)
    }

    /// A server on `listener` (non-blocking), shown as `path`; `ident`: its file's identity.
    fn listening(
        listener: UnixListener,
        path: PathBuf,
        ident: Option<(u64, u64)>,
        dispatcher: Arc<dyn Dispatcher>,
        config: ServerConfig,
    ) -> Result<Server, ServerError> {
        let (wake_rx, wake_tx) = UnixStream::pair().map_err(|err| ServerError::Io {
            path: path.clone(),
            what: "socketpair",
            err,
        })?;
        tracing::info!(path = %path.display(), "QMP server listening");
        Ok(Server {
            listener,
            path,
            ident,
            dispatcher,
            config: Arc::new(config),
            wake_rx,
            handle: ShutdownHandle {
                wake_tx: Arc::new(wake_tx),
            },
        })
    }

    /// Serves QMP on `fd`, a listening unix socket the process was handed (qemu-storage-daemon's
    /// `--chardev socket,fd=N`: a parent binds the socket first, so that clients can connect as
    /// soon as it exists, with no wait for the daemon to bind). The descriptor is taken over
    /// (closed with the server) only once it is found to be such a socket; its file, if it has
    /// one, is removed at exit as a bound socket's is (qemu-storage-daemon does the same). Who
    /// may connect is still [`ServerConfig::allowed_uids`].
    pub fn from_fd(
        fd: RawFd,
        dispatcher: Arc<dyn Dispatcher>,
        config: ServerConfig,
    ) -> Result<Server, ServerError> {
        let path = PathBuf::from(format!("fd={fd}"));
        let not = |why: String| ServerError::NotAListener { fd, why };
        let int_opt = |opt: libc::c_int| -> Result<libc::c_int, ServerError> {
            let mut v: libc::c_int = 0;
            let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            // SAFETY: `v` and `len` are valid and writable, `len` holds the size of `v`, which
            // the kernel writes at most; a descriptor that is not open or not a socket fails.
            let rc = unsafe {
                libc::getsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    opt,
                    (&mut v as *mut libc::c_int).cast(),
                    &mut len,
                )
            };
            if rc != 0 {
                return Err(not(io::Error::last_os_error().to_string()));
            }
            Ok(v)
        };
        if fd < 0 {
            return Err(not("not a descriptor".into()));
        }
        if int_opt(libc::SO_DOMAIN)? != libc::AF_UNIX {
            return Err(not("not a unix socket".into()));
        }
        if int_opt(libc::SO_TYPE)? != libc::SOCK_STREAM {
            return Err(not("not a stream socket".into()));
        }
        if int_opt(libc::SO_ACCEPTCONN)? == 0 {
            return Err(not("not listening (call listen() on it first)".into()));
        }
        // SAFETY: `fd` is an open unix stream socket that listens (checked above), handed to
        // this process for the server to own; nothing else in the process uses it.
        let listener = unsafe { UnixListener::from_raw_fd(fd) };
        let io_err = |what, err| ServerError::Io {
            path: path.clone(),
            what,
            err,
        };
        listener
            .set_nonblocking(true)
            .map_err(|e| io_err("set non-blocking", e))?;
        // SAFETY: F_SETFD on the descriptor just taken over; the result is checked.
        if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
            return Err(io_err("set close-on-exec", io::Error::last_os_error()));
        }
        // Its file goes at exit as a bound one's does (as qemu-storage-daemon removes it),
        // if it is still that socket then.
        let named = listener
            .local_addr()
            .ok()
            .and_then(|a| a.as_pathname().map(Path::to_path_buf));
        let (path, ident) = match named {
            Some(p) => match fs::symlink_metadata(&p) {
                Ok(m) if m.file_type().is_socket() => {
                    let ident = Some((m.dev(), m.ino()));
                    (p, ident)
                }
                _ => (path, None),
            },
            None => (path, None),
        };
        Server::listening(listener, path, ident, dispatcher, config)
    }

    /// The socket's path (`fd=N` for one handed over that has none).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A handle that stops [`Server::run`] from another thread.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.handle.clone()
    }

    /// Accepts and serves clients until shut down, then closes every connection, joins their
    /// threads and removes the socket file (if it is still this server's).
    pub fn run(self) -> Result<(), ServerError> {
        let clients: Arc<Mutex<HashMap<u64, UnixStream>>> = Arc::default();
        let mut threads: Vec<JoinHandle<()>> = Vec::new();
        let mut next_id = 0u64;
        let result = loop {
            let ready = match wait_readable(&[&self.listener, &self.wake_rx]) {
                Ok(r) => r,
                Err(err) => {
                    break Err(ServerError::Io {
                        path: self.path.clone(),
                        what: "poll",
                        err,
                    })
                }
            };
            if ready[1] {
                break Ok(());
            }
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e)
                    if e.kind() == io::ErrorKind::WouldBlock
                        || e.kind() == io::ErrorKind::Interrupted =>
                {
                    continue
                }
                Err(e) => {
                    // EMFILE and friends: log, and keep serving the clients we have.
                    tracing::warn!(error = %e, "QMP accept failed");
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    continue;
                }
            };
            threads.retain(|t| !t.is_finished());
            match peer_credentials(&stream) {
                Ok((uid, _)) if self.config.allowed_uids.contains(&uid) => {}
                Ok((uid, pid)) => {
                    tracing::warn!(uid, pid, "QMP connection from a user not allowed: closed");
                    continue;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "QMP connection without credentials: closed");
                    continue;
                }
            }
            let live = clients.lock().unwrap_or_else(|p| p.into_inner()).len();
            if live >= self.config.max_clients {
                tracing::warn!(
                    max = self.config.max_clients,
                    "QMP connection over the client limit: closed"
                );
                continue;
            }
            let Ok(registered) = stream.try_clone() else {
                continue;
            };
            let id = next_id;
            next_id += 1;
            clients
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(id, registered);
            let (dispatcher, config, reg) = (
                self.dispatcher.clone(),
                self.config.clone(),
                clients.clone(),
            );
            let spawned = std::thread::Builder::new()
                .name(format!("qmp-client-{id}"))
                .spawn(move || {
                    tracing::debug!(client = id, "QMP client connected");
                    serve_socket(stream, dispatcher, &config);
                    reg.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
                    tracing::debug!(client = id, "QMP client gone");
                });
            match spawned {
                Ok(t) => threads.push(t),
                Err(e) => {
                    tracing::warn!(error = %e, "QMP client thread not started: connection closed");
                    clients
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&id);
                }
            }
        };
        // Stop reading first, so replies already queued (`quit`'s own) still go out; a client
        // that does not read them within a second is cut off.
        for s in clients.lock().unwrap_or_else(|p| p.into_inner()).values() {
            let _ = s.shutdown(Shutdown::Read);
        }
        let deadline = std::time::Instant::now() + DRAIN_TIME;
        while !clients.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        for s in clients.lock().unwrap_or_else(|p| p.into_inner()).values() {
            let _ = s.shutdown(Shutdown::Both);
        }
        for t in threads {
            let _ = t.join();
        }
        tracing::info!(path = %self.path.display(), "QMP server stopped");
        result
    }
}

impl Drop for Server {
    /// Removes the socket file, if it is still this server's (a later server may have replaced
    /// it), whether or not [`Server::run`] ever ran.
    fn drop(&mut self) {
        let Some(ident) = self.ident else { return };
        if let Ok(m) = fs::symlink_metadata(&self.path) {
            if (m.dev(), m.ino()) == ident {
                let _ = fs::remove_file(&self.path);
            }
        }
    }
}

/// Serves one socket connection; an event overflow shuts the socket down.
fn serve_socket(stream: UnixStream, dispatcher: Arc<dyn Dispatcher>, config: &ServerConfig) {
    let (Ok(reader), Ok(kick)) = (stream.try_clone(), stream.try_clone()) else {
        return;
    };
    serve_stream(
        reader,
        stream,
        dispatcher,
        config,
        Box::new(move || {
            let _ = kick.shutdown(Shutdown::Both);
        }),
    );
}

/// Serves one QMP client over any byte stream (a socket, or stdin/stdout as qemu-storage-daemon's
/// `--chardev stdio` does): sends the greeting, answers requests in order, and once the client
/// is in command mode sends it events. Returns when the client closes its side, sends too much,
/// or the writer fails. `kick` must make `reader` return (it is called when the client's queue
/// overflows with events).
pub fn serve_stream<R, W>(
    mut reader: R,
    writer: W,
    dispatcher: Arc<dyn Dispatcher>,
    config: &ServerConfig,
    kick: Box<dyn Fn() + Send>,
) where
    R: Read,
    W: Write + Send + 'static,
{
    let mut session = Session::new(
        dispatcher,
        Arc::new(config.info.clone()),
        config.max_request,
    );
    let (outbox, drain) = crate::outbox::outbox(writer, config.queue_len);
    let writer_thread = std::thread::Builder::new()
        .name("qmp-writer".into())
        .spawn(move || drain.run());
    let Ok(writer_thread) = writer_thread else {
        return;
    };
    let line = |v: &serde_json::Value| -> Arc<str> { Arc::from(format!("{v}\n")) };
    let mut subscription = None;
    let mut kick = Some(kick);
    let mut buf = vec![0u8; 64 * 1024];
    let mut open = outbox.reply(line(&session.greeting()));
    while open {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        session.push(&buf[..n]);
        while let Some((reply, close)) = session.next_reply() {
            match kick.take() {
                // The reply that ended negotiation: queued together with the subscription, so
                // events start right after it, before the client's next request runs.
                Some(k) if session.command_mode() => {
                    subscription = config
                        .events
                        .subscribe_after(outbox.clone(), k, line(&reply));
                    open = subscription.is_some();
                }
                k => {
                    kick = k;
                    open = outbox.reply(line(&reply));
                }
            }
            if close {
                tracing::warn!("QMP client sent an oversized request: closing the connection");
                open = false;
            }
            if !open {
                break;
            }
        }
    }
    if let Some(id) = subscription {
        config.events.unsubscribe(id);
    }
    drop(outbox);
    let _ = writer_thread.join();
}
