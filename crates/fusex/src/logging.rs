//! Where the log goes: stderr, a file (`--log-file`), or syslog (`--log syslog`: datagrams to
//! `/dev/log`, which journald and rsyslog read). A daemonized process keeps a destination after
//! it detaches from the terminal: the one given, else syslog where `/dev/log` takes messages, else
//! stderr when it is a file; with none of those `--daemonize` is refused, since every later line,
//! the stop's included, would be lost.
//!
//! And what a line looks like (`--log-format`): text for people, or one JSON object per line for
//! journald and log collectors, which carries the id of the export a line is about as the field
//! `export` (see [`export_span`] and [`set_process_export`]), so one export's lines can be picked
//! out of a daemon serving many.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};

use anyhow::{bail, Context, Result};
use serde_json::Value;
use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::span;
use tracing::subscriber::Interest;
use tracing::{Event, Metadata, Subscriber};
use tracing_subscriber::fmt::format::{self, DefaultFields, FormatEvent, FormatFields};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, MakeWriter};
use tracing_subscriber::layer::{Context as LayerContext, Filter, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

use crate::cli::{LogArg, MountArgs};

/// The syslog socket.
pub const DEV_LOG: &str = "/dev/log";

/// Where log lines go once set: until then (and for stderr) they go to stderr.
static SYSLOG: OnceLock<Syslog> = OnceLock::new();

/// A log destination, opened.
pub enum Dest {
    /// stderr, as it is.
    Stderr,
    /// `--log-file` (opened, and its path made absolute for [`reopen`]): stderr is pointed at it.
    File(File, PathBuf),
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
        let f = open_file(p)?;
        // Made absolute now: a reopen resolves it again whatever the working directory is.
        let path = std::path::absolute(p).unwrap_or_else(|_| p.clone());
        return Ok(Dest::File(f, path));
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

/// The `--log-file` the log goes to, for [`reopen`]; None when it goes elsewhere.
static LOG_FILE: Mutex<Option<PathBuf>> = Mutex::new(None);

/// Ignores SIGUSR2, first thing in every fusex process: log rotation sends it to every process
/// named fusex (`contrib/fusex.logrotate`), and its default action would end those with no log
/// file to reopen (`fusex top`, `fusex ctl`, a `fusex restart` that does not serve yet). A
/// daemon replaces this with its handler ([`reopen`]).
pub fn ignore_rotation_signal() {
    // SAFETY: sets one signal's disposition to "ignore"; no handler code is involved.
    unsafe { libc::signal(libc::SIGUSR2, libc::SIG_IGN) };
}

/// The `--log-file` the log goes to (absolute), if it goes to one.
pub fn log_file() -> Option<PathBuf> {
    LOG_FILE.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// Opens the `--log-file` `path` ([`log_file`]) again and logs there from now on (SIGUSR2):
/// log rotation (logrotate) renames the file and asks the daemon to start a new one; the daemon
/// keeps writing to the renamed file until then. On an error the log stays where it was.
pub fn reopen(path: &PathBuf) -> Result<()> {
    let f = open_file(path)?;
    // SAFETY: dup2 onto the standard error descriptor; `f` is open for the call and closed
    // after it, fd 2 keeping the new file.
    unsafe { libc::dup2(f.as_raw_fd(), 2) };
    Ok(())
}

/// Whether the log goes to stderr and stderr is a file: a restart successor is handed that
/// descriptor and keeps logging there ([`stderr_to_hand_over`]).
static STDERR_KEPT: AtomicBool = AtomicBool::new(false);

/// The descriptor a `fusex restart` successor should log to, when this process logs to its
/// stderr and that is a file (`--daemonize 2>>FILE`, `--log stderr`, a service manager's file):
/// the successor starts with the restart command's stderr, usually a terminal, and would
/// otherwise log elsewhere or nowhere once detached. None for a `--log-file` (the successor
/// opens it again from the command line) and for syslog.
pub fn stderr_to_hand_over() -> Option<RawFd> {
    STDERR_KEPT.load(Ordering::Relaxed).then_some(2)
}

/// In a restart successor: logs to `fd`, the predecessor's stderr, from now on (it takes
/// stderr's place, so panics land there too).
pub fn adopt_stderr(fd: OwnedFd) {
    // SAFETY: dup2 onto the standard error descriptor; `fd` is open for the call.
    unsafe { libc::dup2(fd.as_raw_fd(), 2) };
    STDERR_KEPT.store(true, Ordering::Relaxed);
}

/// In a restart successor, before it detaches: its log goes to the predecessor's stderr if
/// that was handed over ([`adopt_stderr`]), else where `choose` (the predecessor's command line)
/// says. Returns whether stderr carries the log, or None (with a warning) if it is lost.
pub fn settle_successor(choose: impl FnOnce() -> Result<Dest>) -> Option<bool> {
    if STDERR_KEPT.load(Ordering::Relaxed) {
        return Some(true);
    }
    match choose() {
        Ok(dest) => {
            switch(&dest);
            Some(!matches!(dest, Dest::Syslog(_)))
        }
        Err(e) => {
            tracing::warn!("restart: the log is lost once detached: {e:#}");
            None
        }
    }
}

/// Sends log lines to `dest` from now on: a file takes stderr's place (so that panics land there
/// too), syslog takes every later line.
pub fn switch(dest: &Dest) {
    match dest {
        Dest::Stderr => STDERR_KEPT.store(stderr_is_a_file(), Ordering::Relaxed),
        Dest::File(f, path) => {
            // SAFETY: dup2 onto the standard error descriptor.
            unsafe { libc::dup2(f.as_raw_fd(), 2) };
            *LOG_FILE.lock().unwrap_or_else(|p| p.into_inner()) = Some(path.clone());
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

/// `--log-format`: what a log line looks like.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// For people: timestamp, level and message on one line.
    #[default]
    Text,
    /// For machines: one JSON object per line, with timestamp, level, target, message, the
    /// event's fields and those of the spans it is in (an export's id as "export").
    Json,
}

/// The format lines are written in now ([`LogFormat`] as a number). A process-wide switch
/// rather than a choice made once at [`init`], because `fusex restart` learns its predecessor's
/// format only after its logging started.
static FORMAT: AtomicU8 = AtomicU8::new(0);

/// The export every line of this process is about, for processes that serve one (`fusex
/// mount`, its `--auto-unmount` watcher): JSON lines carry it as `export` unless a span or the
/// event names another.
static PROCESS_EXPORT: OnceLock<String> = OnceLock::new();

/// The environment variable by which a daemon tells its `--auto-unmount` watcher (which takes
/// no logging options) to log in JSON too: it writes to the same stderr.
pub const WATCHER_FORMAT_ENV: &str = "FUSEX_WATCHER_LOG_FORMAT";

/// Lines are written as `f` from now on.
pub fn set_format(f: LogFormat) {
    FORMAT.store(f as u8, Ordering::Relaxed);
}

/// The format lines are written in now.
pub fn format() -> LogFormat {
    match FORMAT.load(Ordering::Relaxed) {
        0 => LogFormat::Text,
        _ => LogFormat::Json,
    }
}

/// Names the export every line of this process is about (the first call wins: a process
/// serves one export for its whole life).
pub fn set_process_export(id: String) {
    let _ = PROCESS_EXPORT.set(id);
}

/// What a `fusex mount` export is called in the log: its mountpoint as `fusex list` shows it
/// (the canonical directory, then the file's name, which may not exist yet), else as given.
pub fn mountpoint_id(path: &Path) -> String {
    let canonical = path.file_name().and_then(|name| {
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        Some(parent.canonicalize().ok()?.join(name))
    });
    canonical
        .as_deref()
        .unwrap_or(path)
        .to_string_lossy()
        .into_owned()
}

/// The span in which work on one export of `fusex serve` is done (its mount, supervision,
/// removal, failure, reload), so that every line logged meanwhile on that thread, whichever
/// module logs it, names the export: JSON lines carry `export`, text lines start with
/// `export ID: ` (`TextLine`), since exports added at once by several clients log at once.
/// Entered only on control-plane threads: the queues' worker threads serve every export's
/// requests and enter nothing per request. A root span: work on one export is never inside
/// another's, even when one export's command starts the next.
pub fn export_span(id: &str) -> tracing::Span {
    tracing::info_span!(parent: None, "export", export = %id)
}

/// Whether `meta` is [`export_span`]'s.
fn is_export_span(meta: &Metadata<'_>) -> bool {
    meta.is_span() && meta.name() == "export" && meta.target() == module_path!()
}

/// Starts logging to [`Sink`]: events `RUST_LOG` (else `default`, a level) lets through, in the
/// format [`set_format`] chose, text with terminal colours if `ansi`.
pub fn init(default: &str, ansi: bool) {
    let env = || EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let text = text_layer(Sink, ansi).with_filter(Only {
        format: LogFormat::Text,
        current: &FORMAT,
        env: env(),
    });
    let json = JsonLayer {
        writer: Sink,
        process_export: &PROCESS_EXPORT,
    }
    .with_filter(Only {
        format: LogFormat::Json,
        current: &FORMAT,
        env: env(),
    });
    tracing_subscriber::registry().with(text).with(json).init();
}

/// The filter of the layer that writes `format`: what `env` (`RUST_LOG`) lets through while
/// that is the format, plus [`export_span`] whatever `RUST_LOG` and the format say (it is
/// context, not a line: a span entered before a format switch still names its export after it).
struct Only {
    format: LogFormat,
    /// [`FORMAT`] (a test's own otherwise).
    current: &'static AtomicU8,
    env: EnvFilter,
}

impl<S> Filter<S> for Only {
    fn enabled(&self, meta: &Metadata<'_>, cx: &LayerContext<'_, S>) -> bool {
        // The span is context for whichever format is current when its lines are written.
        if is_export_span(meta) {
            return true;
        }
        if self.current.load(Ordering::Relaxed) != self.format as u8 {
            return false;
        }
        Filter::<S>::enabled(&self.env, meta, cx)
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        // Never what no format could want; the rest is decided per event ("sometimes"), since
        // the format may change (`fusex restart`).
        let wanted = if is_export_span(meta) {
            true
        } else {
            !Filter::<S>::callsite_enabled(&self.env, meta).is_never()
        };
        if wanted {
            Interest::sometimes()
        } else {
            Interest::never()
        }
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        // The export span is at INFO: a stricter RUST_LOG must not filter it out.
        Filter::<S>::max_level_hint(&self.env).map(|l| l.max(LevelFilter::INFO))
    }

    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, cx: LayerContext<'_, S>) {
        Filter::<S>::on_new_span(&self.env, attrs, id, cx);
    }

    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, cx: LayerContext<'_, S>) {
        Filter::<S>::on_record(&self.env, id, values, cx);
    }

    fn on_enter(&self, id: &span::Id, cx: LayerContext<'_, S>) {
        Filter::<S>::on_enter(&self.env, id, cx);
    }

    fn on_exit(&self, id: &span::Id, cx: LayerContext<'_, S>) {
        Filter::<S>::on_exit(&self.env, id, cx);
    }

    fn on_close(&self, id: span::Id, cx: LayerContext<'_, S>) {
        Filter::<S>::on_close(&self.env, id, cx);
    }
}

/// The layer writing text lines ([`TextLine`]) to `writer`, with terminal colours if `ansi`.
fn text_layer<S, W>(
    writer: W,
    ansi: bool,
) -> tracing_subscriber::fmt::Layer<S, DefaultFields, TextLine, W>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    W: for<'w> MakeWriter<'w> + 'static,
{
    tracing_subscriber::fmt::layer()
        .with_writer(writer)
        .with_ansi(ansi)
        .event_format(TextLine)
}

/// A text line: `TIMESTAMP LEVEL MESSAGE FIELDS`, as tracing's default format writes it, with
/// `export ID: ` before the message of a line logged inside an [`export_span`] (unless the
/// message starts with it already: `export ID removed`, `export ID: mounted ...`).
struct TextLine;

impl<S, N> FormatEvent<S, N> for TextLine
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        cx: &FmtContext<'_, S, N>,
        mut w: format::Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        let ansi = w.has_ansi_escapes();
        let timestamp = timestamp();
        let level = *event.metadata().level();
        if ansi {
            let colour = match level {
                tracing::Level::TRACE => "35",
                tracing::Level::DEBUG => "34",
                tracing::Level::INFO => "32",
                tracing::Level::WARN => "33",
                tracing::Level::ERROR => "31",
            };
            write!(
                w,
                "\x1b[2m{timestamp}\x1b[0m \x1b[{colour}m{level:>5}\x1b[0m "
            )?;
        } else {
            write!(w, "{timestamp} {level:>5} ")?;
        }
        let mut body = String::new();
        cx.format_fields(format::Writer::new(&mut body), event)?;
        if let Some(id) = export_of(cx) {
            let named = body
                .strip_prefix("export ")
                .and_then(|rest| rest.strip_prefix(id.as_str()))
                .is_some_and(|rest| rest.is_empty() || rest.starts_with([':', ' ']));
            if !named {
                write!(w, "export {id}: ")?;
            }
        }
        writeln!(w, "{body}")
    }
}

/// The time of a line as both formats write it: RFC 3339 in UTC, to the microsecond.
fn timestamp() -> String {
    let mut t = String::new();
    // Writing into a String cannot fail.
    let _ = SystemTime.format_time(&mut format::Writer::new(&mut t));
    t
}

/// The export of the innermost [`export_span`] the event being written was logged in.
fn export_of<S, N>(cx: &FmtContext<'_, S, N>) -> Option<String>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    cx.event_scope()?.find_map(|span| {
        if !is_export_span(span.metadata()) {
            return None;
        }
        let ext = span.extensions();
        let SpanFields(fields) = ext.get::<SpanFields>()?;
        fields.iter().find_map(|(k, v)| match (k.as_str(), v) {
            ("export", Value::String(id)) => Some(id.clone()),
            _ => None,
        })
    })
}

/// Writes each event as one JSON object on one line (see [`json_line`]).
struct JsonLayer<W> {
    writer: W,
    /// [`PROCESS_EXPORT`] (a test's own otherwise).
    process_export: &'static OnceLock<String>,
}

/// A span's fields, kept in its extensions for the lines logged inside it.
struct SpanFields(Vec<(String, Value)>);

/// An event's or a span's fields as JSON values; the message apart.
#[derive(Default)]
struct Fields {
    fields: Vec<(String, Value)>,
    message: Option<String>,
}

impl Fields {
    fn put(&mut self, name: &str, v: Value) {
        if name == "message" {
            self.message = Some(match v {
                Value::String(s) => s,
                other => other.to_string(),
            });
            return;
        }
        put(&mut self.fields, name, v);
    }
}

/// Sets field `name` in `fields`: a later value (an inner span's, the event's) replaces an
/// earlier one.
fn put(fields: &mut Vec<(String, Value)>, name: &str, v: Value) {
    match fields.iter_mut().find(|(n, _)| n == name) {
        Some(slot) => slot.1 = v,
        None => fields.push((name.to_string(), v)),
    }
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.put(field.name(), Value::String(format!("{value:?}")));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field.name(), Value::String(value.to_string()));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field.name(), value.into());
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field.name(), value.into());
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        // NaN and infinities are no JSON numbers: as text.
        let v = serde_json::Number::from_f64(value)
            .map_or_else(|| Value::String(value.to_string()), Value::Number);
        self.put(field.name(), v);
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field.name(), value.into());
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.put(field.name(), Value::String(value.to_string()));
    }
}

/// The names every line has; a field of the same name is written as `field.NAME`.
const RESERVED: [&str; 4] = ["timestamp", "level", "target", "message"];

/// One event as a JSON object on one line (ending in a newline): `timestamp` (RFC 3339, UTC),
/// `level`, `target` (the module that logged it) and `message`, then `fields` in order.
fn json_line(
    timestamp: &str,
    level: &tracing::Level,
    target: &str,
    message: &str,
    fields: &[(String, Value)],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(128 + message.len());
    out.push(b'{');
    pair(&mut out, "timestamp", timestamp);
    pair(&mut out, "level", level.as_str());
    pair(&mut out, "target", target);
    pair(&mut out, "message", message);
    for (k, v) in fields {
        if RESERVED.contains(&k.as_str()) {
            pair(&mut out, &format!("field.{k}"), v);
        } else {
            pair(&mut out, k, v);
        }
    }
    out.extend_from_slice(b"}\n");
    out
}

/// Appends `"key":value` to the object being written in `out` (a comma first unless it is the
/// first member).
fn pair<T: serde::Serialize + ?Sized>(out: &mut Vec<u8>, key: &str, value: &T) {
    if out.len() > 1 {
        out.push(b',');
    }
    // Strings and Values serialize into a Vec without fail (a Value's keys are strings).
    let _ = serde_json::to_writer(&mut *out, key);
    out.push(b':');
    let _ = serde_json::to_writer(&mut *out, value);
}

impl<S, W> Layer<S> for JsonLayer<W>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    W: for<'w> MakeWriter<'w> + 'static,
{
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, cx: LayerContext<'_, S>) {
        let Some(span) = cx.span(id) else { return };
        let mut f = Fields::default();
        attrs.record(&mut f);
        span.extensions_mut().insert(SpanFields(f.fields));
    }

    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, cx: LayerContext<'_, S>) {
        let Some(span) = cx.span(id) else { return };
        let mut ext = span.extensions_mut();
        if let Some(SpanFields(kept)) = ext.get_mut::<SpanFields>() {
            let mut f = Fields {
                fields: std::mem::take(kept),
                message: None,
            };
            values.record(&mut f);
            *kept = f.fields;
        }
    }

    fn on_event(&self, event: &Event<'_>, cx: LayerContext<'_, S>) {
        let meta = event.metadata();
        let mut fields = Vec::new();
        if let Some(id) = self.process_export.get() {
            fields.push(("export".to_string(), Value::String(id.clone())));
        }
        if let Some(scope) = cx.event_scope(event) {
            for span in scope.from_root() {
                if let Some(SpanFields(f)) = span.extensions().get::<SpanFields>() {
                    for (k, v) in f {
                        put(&mut fields, k, v.clone());
                    }
                }
            }
        }
        let mut ev = Fields {
            fields,
            message: None,
        };
        event.record(&mut ev);
        // A `log` record (rustls's) names its module in a field, as the fmt layer shows it.
        let mut target = meta.target().to_string();
        ev.fields.retain(|(k, v)| match (k.as_str(), v) {
            ("log.target", Value::String(t)) => {
                target = t.clone();
                false
            }
            (k, _) => !k.starts_with("log."),
        });
        let line = json_line(
            &timestamp(),
            meta.level(),
            &target,
            ev.message.as_deref().unwrap_or(""),
            &ev.fields,
        );
        // A line that cannot be written is dropped: logging must never fail the daemon.
        let _ = self.writer.make_writer_for(meta).write_all(&line);
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

    /// A writer into a shared buffer, as the log's [`Sink`] is one into stderr.
    #[derive(Clone, Default)]
    struct Capture(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl Write for Capture {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Capture {
        type Writer = Capture;

        fn make_writer(&'a self) -> Capture {
            self.clone()
        }
    }

    impl Capture {
        fn lines(&self) -> Vec<String> {
            let text = String::from_utf8(self.0.lock().unwrap().clone()).unwrap();
            text.lines().map(str::to_string).collect()
        }

        fn json(&self) -> Vec<serde_json::Map<String, Value>> {
            self.lines()
                .iter()
                .map(|l| match serde_json::from_str(l) {
                    Ok(Value::Object(m)) => m,
                    other => panic!("not a JSON object: {l:?} ({other:?})"),
                })
                .collect()
        }
    }

    /// Runs `f` with the subscriber [`init`] makes, writing to `text` and `json`, in the
    /// format `current` says and with `process` as [`PROCESS_EXPORT`].
    fn logged(
        current: &'static AtomicU8,
        process: &'static OnceLock<String>,
        f: impl FnOnce(),
    ) -> (Capture, Capture) {
        let (text, json) = (Capture::default(), Capture::default());
        let subscriber = tracing_subscriber::registry()
            .with(text_layer(text.clone(), false).with_filter(Only {
                format: LogFormat::Text,
                current,
                env: EnvFilter::new("info"),
            }))
            .with(
                JsonLayer {
                    writer: json.clone(),
                    process_export: process,
                }
                .with_filter(Only {
                    format: LogFormat::Json,
                    current,
                    env: EnvFilter::new("info"),
                }),
            );
        tracing::subscriber::with_default(subscriber, f);
        (text, json)
    }

    #[test]
    fn json_lines_carry_the_event_its_fields_and_its_export() {
        static CURRENT: AtomicU8 = AtomicU8::new(LogFormat::Json as u8);
        static NONE: OnceLock<String> = OnceLock::new();
        let (text, json) = logged(&CURRENT, &NONE, || {
            tracing::info!("daemon line");
            let _a = export_span("a").entered();
            tracing::warn!(queue = 3, ok = true, "mounted \"{}\"\nat {}", "x", "/m");
            {
                // Another export's work started from this one's is that export's alone.
                let _b = export_span("b").entered();
                tracing::error!(export = "c", level = 5, "the event names its own");
                tracing::info!("b's line");
            }
            tracing::debug!("filtered out");
            tracing::info!("a's line");
        });
        assert!(text.lines().is_empty(), "{:?}", text.lines());
        let lines = json.json();
        assert_eq!(json.lines().len(), 5, "{:?}", json.lines());
        for l in &lines {
            let ts = l["timestamp"].as_str().unwrap();
            // RFC 3339 in UTC: 2025-01-02T03:04:05.678901Z
            assert_eq!(ts.as_bytes()[10], b'T', "{ts}");
            assert!(ts.ends_with('Z'), "{ts}");
            assert_eq!(l["target"], "fusex::logging::tests");
        }
        let keys: Vec<&str> = lines[1].keys().map(String::as_str).collect();
        assert_eq!(lines[0]["level"], "INFO");
        assert_eq!(lines[0]["message"], "daemon line");
        assert!(!lines[0].contains_key("export"));
        assert_eq!(lines[1]["level"], "WARN");
        assert_eq!(lines[1]["message"], "mounted \"x\"\nat /m");
        assert_eq!(lines[1]["export"], "a");
        assert_eq!(lines[1]["queue"], 3);
        assert_eq!(lines[1]["ok"], true);
        for k in [
            "timestamp",
            "level",
            "target",
            "message",
            "export",
            "queue",
            "ok",
        ] {
            assert!(keys.contains(&k), "{k} in {keys:?}");
        }
        assert_eq!(lines[2]["export"], "c");
        assert_eq!(lines[2]["level"], "ERROR");
        assert_eq!(lines[2]["field.level"], 5);
        assert_eq!(lines[3]["export"], "b");
        assert_eq!(lines[4]["export"], "a");
        assert_eq!(lines[4]["message"], "a's line");
    }

    #[test]
    fn a_process_of_one_export_names_it_on_every_json_line() {
        static CURRENT: AtomicU8 = AtomicU8::new(LogFormat::Json as u8);
        static PROCESS: OnceLock<String> = OnceLock::new();
        PROCESS.set("/srv/disk.raw".into()).unwrap();
        let (_, json) = logged(&CURRENT, &PROCESS, || {
            tracing::info!("mounted");
            let _a = export_span("other").entered();
            tracing::info!("in a span");
        });
        let lines = json.json();
        assert_eq!(lines[0]["export"], "/srv/disk.raw");
        assert_eq!(lines[1]["export"], "other");
    }

    #[test]
    fn text_lines_name_their_export_once_and_follow_the_format_switch() {
        static CURRENT: AtomicU8 = AtomicU8::new(LogFormat::Text as u8);
        static NONE: OnceLock<String> = OnceLock::new();
        let (text, json) = logged(&CURRENT, &NONE, || {
            tracing::info!("daemon line");
            let _a = export_span("a").entered();
            tracing::info!(n = 1, "export a: mounted");
            tracing::warn!("passthrough: off");
            tracing::info!("export a removed");
            tracing::info!("export ab: another's name in the message");
            {
                let _b = export_span("b").entered();
                tracing::error!("b's line");
            }
            CURRENT.store(LogFormat::Json as u8, Ordering::Relaxed);
            tracing::info!("now json");
        });
        // `2025-01-02T03:04:05.678901Z  INFO export a: mounted n=1`
        let rest: Vec<String> = text
            .lines()
            .iter()
            .map(|l| {
                let (ts, rest) = l.split_once(' ').unwrap();
                assert!(ts.ends_with('Z') && ts.as_bytes()[10] == b'T', "{l}");
                rest.to_string()
            })
            .collect();
        assert_eq!(
            rest,
            [
                " INFO daemon line",
                " INFO export a: mounted n=1",
                " WARN export a: passthrough: off",
                " INFO export a removed",
                " INFO export a: export ab: another's name in the message",
                "ERROR export b: b's line",
            ]
        );
        let json = json.json();
        assert_eq!(json.len(), 1);
        assert_eq!(json[0]["message"], "now json");
        // The span was entered while the format was text; it names the export all the same.
        assert_eq!(json[0]["export"], "a");
    }

    #[test]
    fn a_json_line_is_a_syslog_message_body() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let server = UnixDatagram::bind(&path).unwrap();
        let s = Syslog::connect(&path).unwrap();
        let line = json_line(
            "2025-01-02T03:04:05.000000Z",
            &tracing::Level::ERROR,
            "fusex",
            "export a: gone",
            &[("export".into(), Value::String("a".into()))],
        );
        s.send(tracing::Level::ERROR, &line);
        let mut buf = [0u8; 512];
        let n = server.recv(&mut buf).unwrap();
        let got = std::str::from_utf8(&buf[..n]).unwrap();
        let prefix = format!("<27>fusex[{}]: ", std::process::id());
        let body = got.strip_prefix(&prefix).unwrap();
        let v: Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["export"], "a");
        assert_eq!(v["message"], "export a: gone");
    }

    #[test]
    fn a_mount_is_named_as_fusex_list_shows_it() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        std::os::unix::fs::symlink(&real, dir.path().join("link")).unwrap();
        let via_link = dir.path().join("link").join("disk.raw");
        assert_eq!(
            mountpoint_id(&via_link),
            real.join("disk.raw").to_string_lossy()
        );
        assert_eq!(mountpoint_id(Path::new("/nonexistent/x")), "/nonexistent/x");
    }
}
