//! Where the log goes: stderr, a file (`--log-file`), or syslog (`--log syslog`: datagrams to
//! `/dev/log`, which journald and rsyslog read). A daemonized process keeps a destination after
//! it detaches from the terminal: the one given, else syslog where `/dev/log` takes messages, else
//! stderr when it is a file; with none of those `--daemonize` is refused, since every later line,
//! the stop's included, would be lost.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{bail, Context, Result};
use tracing_subscriber::fmt::MakeWriter;

use crate::cli::{LogArg, MountArgs};

/// The syslog socket.
pub const DEV_LOG: &str = "/dev/log";

/// Where log lines go once set: until then (and for stderr) they go to stderr.
static SYSLOG: OnceLock<Syslog> = OnceLock::new();

/// A log destination, opened.
pub enum Dest {
    /// stderr, as it is.
    Stderr,
    /// `--log-file`: stderr is pointed at it.
    File(File),
    /// Syslog over a datagram socket.
    Syslog(Syslog),
}

/// Picks and opens the log destination of `fusex mount` (see the module docs); refuses in one
/// line what cannot be kept.
pub fn choose(args: &MountArgs) -> Result<Dest> {
    choose_for(args.log, args.log_file.as_ref(), args.daemonize)
}

/// [`choose`] for any command with `--log`, `--log-file` and `--daemonize`.
pub fn choose_for(
    log: Option<LogArg>,
    log_file: Option<&PathBuf>,
    daemonize: bool,
) -> Result<Dest> {
    struct Args<'a> {
        log: Option<LogArg>,
        log_file: Option<&'a PathBuf>,
        daemonize: bool,
    }
    let args = Args {
        log,
        log_file,
        daemonize,
    };
    if let Some(p) = args.log_file {
        if args.log == Some(LogArg::Syslog) {
            bail!("--log-file and --log syslog exclude each other: give one of them");
        }
        return open_file(p).map(Dest::File);
    }
    match args.log {
        Some(LogArg::Stderr) if args.daemonize && !stderr_is_a_file() => bail!(
            "--daemonize --log stderr: stderr is not a file, and a daemon keeping a terminal, pipe \
             or socket would lose the log or hold its reader: redirect stderr to a file, or give \
             --log-file PATH"
        ),
        Some(LogArg::Stderr) => Ok(Dest::Stderr),
        Some(LogArg::Syslog) => Syslog::connect(Path::new(DEV_LOG))
            .map(Dest::Syslog)
            .map_err(|e| {
                anyhow::anyhow!(
                    "--log syslog: cannot send to {DEV_LOG} ({e}): give --log-file PATH instead"
                )
            }),
        None if !args.daemonize => Ok(Dest::Stderr),
        None => {
            if let Ok(s) = Syslog::connect(Path::new(DEV_LOG)) {
                return Ok(Dest::Syslog(s));
            }
            if stderr_is_a_file() {
                return Ok(Dest::Stderr);
            }
            bail!(
                "--daemonize would lose the log once it detaches (no syslog at {DEV_LOG}, and \
                 stderr is not a file): give --log-file PATH, or redirect stderr to a file"
            )
        }
    }
}

/// Whether stderr is a regular file (or /dev/null): one a daemon may keep writing to. Not a
/// terminal, which goes away, and not a pipe or socket, whose reader (a shell's `$(...)`, a
/// program collecting the output) would wait for the daemon to exit before it saw end of file.
fn stderr_is_a_file() -> bool {
    // SAFETY: fstat of fd 2 into a zeroed stat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `st` lives across the call.
    if unsafe { libc::fstat(2, &mut st) } != 0 {
        return false;
    }
    match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => true,
        libc::S_IFCHR => st.st_rdev == libc::makedev(1, 3),
        _ => false,
    }
}

/// Opens `--log-file` for appending, created 0640 if missing, never through a symlink and never a
/// FIFO or device (opened non-blocking, then checked).
pub fn open_file(path: &PathBuf) -> Result<File> {
    let shown = path.display();
    crate::files::check_target(path, "--log-file")?;
    let f = File::options()
        .append(true)
        .create(true)
        .mode(0o640)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .with_context(|| format!("--log-file {shown}"))?;
    if !f.metadata()?.file_type().is_file() {
        bail!("--log-file {shown} is not a regular file: give the path of one");
    }
    // SAFETY: fcntl on our own descriptor: back to blocking writes.
    unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETFL, libc::O_APPEND) };
    Ok(f)
}

/// Sends log lines to `dest` from now on: a file takes stderr's place (so that panics land there
/// too), syslog takes every later line.
pub fn switch(dest: &Dest) {
    match dest {
        Dest::Stderr => {}
        Dest::File(f) => {
            // SAFETY: dup2 onto the standard error descriptor.
            unsafe { libc::dup2(f.as_raw_fd(), 2) };
        }
        Dest::Syslog(s) => {
            if let Ok(s) = s.try_clone() {
                let _ = SYSLOG.set(s);
            }
        }
    }
}

/// A connected syslog datagram socket. Each event is one datagram: `<PRI>fusex[PID]: line`,
/// facility daemon, severity from the event's level.
pub struct Syslog(UnixDatagram);

impl Syslog {
    /// Connects to the syslog socket at `path`.
    pub fn connect(path: &Path) -> io::Result<Syslog> {
        let s = UnixDatagram::unbound()?;
        s.connect(path)?;
        Ok(Syslog(s))
    }

    fn try_clone(&self) -> io::Result<Syslog> {
        self.0.try_clone().map(Syslog)
    }

    /// Sends one formatted line at `level`.
    fn send(&self, level: tracing::Level, line: &[u8]) {
        const LOG_DAEMON: u8 = 3 << 3;
        let severity = match level {
            tracing::Level::ERROR => 3,
            tracing::Level::WARN => 4,
            tracing::Level::INFO => 6,
            _ => 7,
        };
        let text = strip_colours(&String::from_utf8_lossy(line));
        let msg = format!(
            "<{}>fusex[{}]: {}",
            LOG_DAEMON | severity,
            std::process::id(),
            text.trim()
        );
        // A full or gone syslog drops the line: logging must never block or fail the daemon.
        let _ = self.0.send(msg.as_bytes());
    }
}

/// The text without terminal colour sequences (`ESC [ ... m`), which a logger started on a
/// terminal writes before it is switched to syslog.
fn strip_colours(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The log's writer: stderr until [`switch`] names syslog.
pub struct Sink;

/// One event's text, sent as one syslog datagram when done.
pub enum SinkWriter {
    /// Straight to stderr.
    Stderr(io::Stderr),
    /// Collected, then sent.
    Syslog(tracing::Level, Vec<u8>),
}

impl Write for SinkWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            SinkWriter::Stderr(e) => e.write(buf),
            SinkWriter::Syslog(_, v) => {
                v.extend_from_slice(buf);
                Ok(buf.len())
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            SinkWriter::Stderr(e) => e.flush(),
            SinkWriter::Syslog(..) => Ok(()),
        }
    }
}

impl Drop for SinkWriter {
    fn drop(&mut self) {
        if let (SinkWriter::Syslog(level, v), Some(s)) = (self, SYSLOG.get()) {
            if !v.is_empty() {
                s.send(*level, v);
            }
        }
    }
}

impl<'a> MakeWriter<'a> for Sink {
    type Writer = SinkWriter;

    fn make_writer(&'a self) -> SinkWriter {
        SinkWriter::Stderr(io::stderr())
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> SinkWriter {
        if SYSLOG.get().is_some() {
            SinkWriter::Syslog(*meta.level(), Vec::new())
        } else {
            SinkWriter::Stderr(io::stderr())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syslog_lines_carry_priority_and_tag() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let server = UnixDatagram::bind(&path).unwrap();
        let s = Syslog::connect(&path).unwrap();
        s.send(tracing::Level::WARN, b" WARN stopping\n");
        s.send(tracing::Level::INFO, b"\x1b[32mINFO\x1b[0m mounted\n");
        let mut buf = [0u8; 256];
        let n = server.recv(&mut buf).unwrap();
        let pid = std::process::id();
        assert_eq!(
            std::str::from_utf8(&buf[..n]).unwrap(),
            format!("<28>fusex[{pid}]: WARN stopping")
        );
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(
            std::str::from_utf8(&buf[..n]).unwrap(),
            format!("<30>fusex[{pid}]: INFO mounted")
        );
    }

    #[test]
    fn the_log_file_is_never_opened_through_a_symlink_or_as_a_fifo() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        assert!(open_file(&link).is_err());
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(open_file(&fifo).is_err());
        let log = dir.path().join("fusex.log");
        let mut f = open_file(&log).unwrap();
        f.write_all(b"one\n").unwrap();
        let mut f = open_file(&log).unwrap();
        f.write_all(b"two\n").unwrap();
        assert_eq!(std::fs::read(&log).unwrap(), b"one\ntwo\n", "appended");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&log).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode & !0o640, 0, "created at most 0640: {mode:o}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    }
}
