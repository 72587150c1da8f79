//! `fusex mount` and `fusex restart`: one export served by the whole process. The export's own
//! lifecycle is [`crate::lifecycle`]'s; this is what belongs to the process around it: signals,
//! the pid file, readiness (the `--daemonize` pipe, systemd), and the `fusex restart` socket.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};

use anyhow::{bail, Context, Result};
use backend::BlockBackend;
use fuse_abi::FUSE_OVER_IO_URING;
use transport::Mount;

use crate::cli::MountArgs;
use crate::daemon::Readiness;
use crate::lifecycle::{self, Event, Owner, Prepared, ReleaseTo, Settled, Stop, Supervision};
use crate::memory::{self, Plan as MemoryPlan};
use crate::metrics::http::MetricsServer;
use crate::privileges::Plan;

/// Serves until stopped. Errors before the mount is live are reported through `ready` too.
pub fn mount(args: MountArgs, mut ready: Readiness, verbose: u8) -> Result<()> {
    // Catch SIGINT/SIGTERM from the start: a signal that lands while mounting must still end in
    // a clean unmount, not in the default action killing the process with the mount in place.
    let signals = install_signals()?;
    let notifier = match crate::notify::Notifier::from_env() {
        Ok(n) => n,
        Err(e) => {
            ready.report(Err(format!("{e:#}")));
            return Err(e);
        }
    };
    // Claimed before anything is mounted: a second daemon with the same pid file mounts nothing.
    let claimed = check_files(&args).and_then(|()| {
        args.pid_file
            .as_deref()
            .map(crate::files::PidFile::claim)
            .transpose()
    });
    let pid_file = match claimed {
        Ok(p) => p,
        Err(e) => {
            ready.report(Err(format!("{e:#}")));
            return Err(e);
        }
    };
    if crate::dirmode::is_directory(&args.image) {
        // Entries are created with the caller's umask (the kernel sends it), set per creation
        // on the queue thread (dirfs::acl), which then restores its own; the process's umask
        // is made 0 so that nothing else the daemon creates for the export is cut either.
        // SAFETY: umask cannot fail.
        unsafe { libc::umask(0) };
    }
    // Bound before anything is mounted: an address in use fails the start in one line.
    let slot = crate::metrics::MountSlot::default();
    let metrics = args
        .metrics_listen
        .as_deref()
        .map(|a| MetricsServer::start(a, crate::metrics::mount_render(slot.clone())))
        .transpose()
        .map_err(|e| anyhow::anyhow!("{e}"));
    let prepared = metrics.and_then(|metrics| {
        lifecycle::setup(&args, std::env::args().collect(), verbose).map(|p| (p, metrics))
    });
    let (prepared, metrics) = match prepared {
        Ok(v) => v,
        Err(e) => {
            ready.report(Err(format!("{e:#}")));
            if let Some(p) = pid_file {
                p.remove();
            }
            return Err(e);
        }
    };
    let _ = slot.set(meter_of(&prepared));
    serve_export(prepared, ready, &notifier, (signals, pid_file), metrics)
}

/// What the metrics page of a `fusex mount` process reads: the export, named by its mountpoint.
fn meter_of(p: &Prepared) -> (crate::metrics::Meter, String) {
    (
        crate::metrics::Meter::of(p),
        p.mnt.mountpoint().to_string_lossy().into_owned(),
    )
}

/// The files written at exit or while running, checked before mounting: a missing directory or a
/// FIFO planted at the name is refused now, in one line, rather than found at exit.
fn check_files(args: &MountArgs) -> Result<()> {
    if let Some(p) = &args.stats_file {
        crate::files::check_target(p, "--stats-file")?;
    }
    Ok(())
}

/// SIGINT, SIGTERM, SIGHUP (stop), SIGUSR1 (statistics), SIGUSR2 (reopens a `--log-file`, else
/// ignored) and SIGALRM (ignored, with a log line), caught from here on. SIGHUP is a stop
/// because it is what closing the terminal of a foreground `fusex mount` sends; fusex has no
/// configuration to reload. The default action of SIGUSR2 and SIGALRM would kill the daemon
/// and leave a dead mount behind.
fn install_signals() -> Result<signal_hook::iterator::Signals> {
    use signal_hook::consts::{SIGALRM, SIGHUP, SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
    signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, SIGALRM])
        .context("installing signal handlers")
}

/// The process around a `fusex mount` export: readiness, systemd, the pid file and the state
/// file `fusex list` reads.
struct MountOwner<'a> {
    ready: Readiness,
    notifier: &'a crate::notify::Notifier,
    pid_file: Option<&'a crate::files::PidFile>,
    runtime: Option<crate::runtime::Entry>,
    /// What `fusex list` shows, without the state.
    shown: crate::runtime::ExportState,
    /// What systemd's status line says once serving.
    status: String,
    /// The `--metrics-listen` server, closed when a successor takes over (it binds the address
    /// again).
    metrics: Option<MetricsServer>,
}

impl Owner for MountOwner<'_> {
    fn serving(&mut self) {
        self.ready.report(Ok(()));
        self.notifier.ready(&self.status);
        crate::runtime::begin_sweep();
    }

    fn failed(&mut self, why: &str) {
        self.ready.report(Err(why.to_string()));
    }

    fn state(&mut self, state: &str) {
        if let Some(r) = &self.runtime {
            self.shown.state = state.to_string();
            r.write_state(&self.shown);
        }
    }

    fn stopping(&mut self) {
        self.notifier.stopping();
    }

    fn not_serving(&mut self) {
        // A new daemon may take the pid file (and before this one's "released" reaches a `fusex
        // restart` successor, which writes its own).
        if let Some(p) = self.pid_file {
            p.stop_serving();
        }
    }

    fn reloading(&mut self) {
        drop(self.metrics.take());
        self.notifier
            .reloading("handing the export to a new process");
    }

    fn main_process(&mut self, pid: u32) {
        self.notifier.main_pid(pid);
    }

    fn handed_over(&mut self, _pid: u32) {
        if let Some(r) = &mut self.runtime {
            r.leave();
        }
    }
}

/// Serves a mounted, negotiated export until it stops or is handed to a successor; then cleans
/// up what is this process's to clean up.
fn serve_export(
    mut p: Prepared,
    mut ready: Readiness,
    notifier: &crate::notify::Notifier,
    (signals, pid_file): (
        signal_hook::iterator::Signals,
        Option<crate::files::PidFile>,
    ),
    metrics: Option<MetricsServer>,
) -> Result<()> {
    let privileges = match &p.export {
        lifecycle::Fs::Dir(_) => Plan::directory(p.mnt.via_fusermount()),
        lifecycle::Fs::Image(_) => Plan::decide(&lifecycle::exit_needs(&p.args, &p.export, &p.mnt)),
    };
    let (tx, rx) = mpsc::channel::<Event>();
    let started = spawn_signal_thread(signals, privileges, tx.clone()).and_then(|sig| {
        let control = match &p.args.control {
            Some(path) => Some(crate::mount_control::start(
                path,
                &p,
                privileges,
                tx.clone(),
            )?),
            None => None,
        };
        let runtime = spawn_restart_listener(&p, notifier, privileges, tx.clone())?;
        Ok((sig, runtime, control))
    });
    let result = match started {
        Ok((sig_handle, runtime, control)) => {
            // Only now: a `fusex restart` that follows this line finds the listener.
            if let Some(line) = &p.settled.announce {
                tracing::info!("{line}");
            }
            let mut owner = MountOwner {
                ready,
                notifier,
                pid_file: pid_file.as_ref(),
                runtime,
                shown: p.describe(""),
                status: format!(
                    "exporting {} at {}",
                    p.args.image,
                    p.mnt.mountpoint().display()
                ),
                metrics,
            };
            let result =
                lifecycle::supervise(&mut p, Supervision { privileges, tx, rx }, &mut owner);
            drop(control);
            sig_handle.close();
            if let Err(e) = &result {
                // Start-up errors (no-op once readiness was reported).
                owner.ready.report(Err(format!("{e:#}")));
            }
            result
        }
        Err(e) => {
            ready.report(Err(format!("{e:#}")));
            Err(e)
        }
    };
    if let Ok(ended) = &result {
        if let Some(pid) = ended.handed_to {
            // A successor serves the mount now: leave the mount, its mountpoint file, the
            // watcher (the successor holds the pipe too) and the pid file (it holds the
            // successor's pid).
            p.mnt.disown();
            p.settled.disown();
            if let Some(f) = pid_file {
                f.keep();
            }
            tracing::info!("handed the export over to process {pid}; exiting");
            return Ok(());
        }
    }
    let concluded = lifecycle::conclude(p, result);
    if let Some(f) = pid_file {
        f.remove();
    }
    concluded
}

/// The signal thread of a one-export process: stops, statistics, and a log line for the signals
/// fusex ignores. It needs no privilege at all and drops them before it handles anything.
fn spawn_signal_thread(
    mut signals: signal_hook::iterator::Signals,
    privileges: Plan,
    tx: mpsc::Sender<Event>,
) -> Result<signal_hook::iterator::Handle> {
    let handle = signals.handle();
    let (dropped_tx, dropped) = mpsc::channel();
    std::thread::Builder::new()
        .name("fusex-signals".into())
        .spawn(move || {
            let outcome = privileges.apply();
            let failed = outcome.is_err();
            let _ = dropped_tx.send(outcome);
            if failed {
                return;
            }
            use signal_hook::consts::{SIGALRM, SIGUSR1, SIGUSR2};
            for s in signals.forever() {
                let ev = match s {
                    SIGUSR1 => Event::Dump,
                    SIGUSR2 => {
                        crate::lifecycle::reopen_log();
                        continue;
                    }
                    SIGALRM => {
                        crate::lifecycle::log_ignored(s);
                        continue;
                    }
                    _ => Event::Stop(Stop::Signal(s)),
                };
                if tx.send(ev).is_err() {
                    break;
                }
            }
        })?;
    dropped
        .recv()
        .context("the signal thread ended at its start")?
        .context("cannot drop privileges")?;
    Ok(handle)
}

/// Listens for `fusex restart` of this export (see [`crate::restart`]) on a thread of its own,
/// which hands the connection to a successor that asks and turns its request to serve into an
/// [`Event::Release`]. Not started for a mount without an identity. Returns the export's files in
/// the runtime directory (the socket, and the state `fusex list` reads).
fn spawn_restart_listener(
    p: &Prepared,
    notifier: &crate::notify::Notifier,
    privileges: Plan,
    tx: mpsc::Sender<Event>,
) -> Result<Option<crate::runtime::Entry>> {
    let Some(handover) = p.mnt.handover() else {
        return Ok(None);
    };
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let entry = match crate::runtime::for_daemon(euid) {
        Ok(dir) => crate::runtime::Entry::new(dir, handover.identity),
        Err(e) => {
            tracing::warn!("restart: not listening for fusex restart: {e}");
            return Ok(None);
        }
    };
    let listener = match crate::restart::listen(&entry.socket()) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(
                "restart: cannot listen for fusex restart on {}: {e}",
                entry.socket().display()
            );
            return Ok(None);
        }
    };
    let Some(handing) = lifecycle::handing(p, notifier.socket().map(str::to_string))? else {
        return Ok(None);
    };
    std::thread::Builder::new()
        .name("fusex-restart".into())
        .spawn(move || {
            if let Err(e) = privileges.apply() {
                tracing::warn!("restart: cannot drop privileges, not listening: {e}");
                return;
            }
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                match hand_over(&stream, euid, &handing) {
                    Ok(pid) => {
                        // The main thread answers `released` once the queues are quiet, or
                        // refuses; after a refusal this export stays restartable.
                        let (atx, arx) = mpsc::channel();
                        let release = Event::Release {
                            to: ReleaseTo::Stream(stream),
                            pid,
                            accepted: atx,
                        };
                        if tx.send(release).is_err() || arx.recv() != Ok(false) {
                            return;
                        }
                    }
                    Err(e) => tracing::info!("restart: not handed over: {e:#}"),
                }
            }
        })
        .context("starting the restart listener")?;
    Ok(Some(entry))
}

/// One restart conversation up to the successor's request to serve: checks who asks, sends the
/// state and descriptors, and waits for `release`. Returns the successor's pid.
fn hand_over(
    stream: &std::os::unix::net::UnixStream,
    euid: u32,
    handing: &lifecycle::Handing,
) -> Result<u32> {
    use crate::restart::{greet, recv, refuse, send, unexpected, Message};
    // A peer that stops talking must not keep this thread (and so every later restart) forever.
    let pid = greet(stream, euid, "this export")?;
    if let Some(why) = &handing.refusal {
        return Err(refuse(stream, why));
    }
    tracing::info!("restart: process {pid} asks for the export; it keeps being served meanwhile");
    let mut state = handing.state.clone();
    let mut fds = handing.fds();
    if let Some(fd) = crate::logging::stderr_to_hand_over() {
        state.log_stderr = true;
        fds.push(fd);
    }
    send(stream, &Message::State(state), &fds).context("sending the state")?;
    match recv(stream).context("process went away before taking over")? {
        (Message::Release, _) => Ok(pid),
        (other, _) => Err(unexpected(&other, "release")),
    }
}

/// `fusex umount`.
pub fn umount(path: PathBuf, force: bool) -> Result<()> {
    transport::unmount(&path, force)?;
    Ok(())
}

/// `fusex restart MOUNTPOINT`, in the new daemon: takes the export over from the daemon serving
/// it (see `crate::restart`) and serves it until stopped, like `fusex mount`. Any error before
/// the old daemon let go leaves it serving, and is reported through `ready`.
pub fn restart(path: PathBuf, mut ready: Readiness) -> Result<()> {
    let signals = install_signals()?;
    match take_over(&path) {
        Ok(TakenOver::Serve(sock, state)) => {
            crate::service::takeover::run(sock, state, ready, &path)
        }
        Ok(TakenOver::Mount(prepared, notifier)) => {
            let prepared = *prepared;
            let args = prepared.args.clone();
            // The log goes where the old daemon's command line says, in its format, as for a
            // daemon; every line is about this export.
            crate::logging::set_format(args.log_format);
            crate::logging::set_process_export(
                prepared.mnt.mountpoint().to_string_lossy().into_owned(),
            );
            let daemon = MountArgs {
                daemonize: true,
                ..args.clone()
            };
            if let Some(keep) = crate::logging::settle_successor(|| crate::logging::choose(&daemon))
            {
                ready.keep_stderr(keep);
            }
            // The old daemon let go of the pid file as it released the export.
            let claimed = check_files(&args).and_then(|()| {
                args.pid_file
                    .as_deref()
                    .map(crate::files::PidFile::claim)
                    .transpose()
            });
            match claimed {
                Ok(pid_file) => {
                    // Past the point of return: without its metrics the export still serves.
                    let metrics = args.metrics_listen.as_deref().and_then(|a| {
                        let slot = crate::metrics::MountSlot::default();
                        let _ = slot.set(meter_of(&prepared));
                        MetricsServer::start(a, crate::metrics::mount_render(slot))
                            .map_err(|e| tracing::error!("restart: {e}; serving without metrics"))
                            .ok()
                    });
                    serve_export(prepared, ready, &notifier, (signals, pid_file), metrics)
                }
                Err(e) => {
                    ready.report(Err(format!("{e:#}")));
                    // Unmounts before the --auto-unmount watcher is released.
                    drop(prepared);
                    Err(e)
                }
            }
        }
        Err(e) => {
            ready.report(Err(format!("{e:#}")));
            Err(e)
        }
    }
}

/// What `fusex restart` found serving the mountpoint.
enum TakenOver {
    /// A `fusex mount` daemon's export, taken over.
    Mount(Box<Prepared>, crate::notify::Notifier),
    /// A `fusex serve` daemon, which hands over every export: the conversation goes on in
    /// [`crate::service::takeover`].
    Serve(std::os::unix::net::UnixStream, crate::restart::ServeState),
}

/// In a restart successor: logs to the predecessor's stderr when it was handed over (it comes
/// last among `fds`).
fn adopt_log(handed: bool, fds: &mut Vec<std::os::fd::OwnedFd>) {
    if handed {
        if let Some(fd) = fds.pop() {
            crate::logging::adopt_stderr(fd);
        }
    }
}

fn take_over(path: &Path) -> Result<TakenOver> {
    use crate::restart::{connect, identify, recv, send, unexpected, Message};
    let shown = path.display();
    let (id, user) = identify(path)?;
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 && euid != user {
        bail!("{shown} is served by user {user}: run fusex restart as root or as user {user}");
    }
    // The socket sits in a directory only the serving user can write (checked here too), so only
    // that user's processes (or root's) can be listening on it.
    let dir = crate::runtime::checked(user, false)
        .map_err(|e| anyhow::anyhow!("cannot restart {shown}: {e}"))?;
    let sock = connect(&dir, &id).map_err(|e| {
        anyhow::anyhow!(
            "no fusex daemon takes restarts of {shown} ({e}): it may predate fusex restart"
        )
    })?;
    let (_, peer) = crate::restart::peer(&sock).context("restart socket peer")?;
    if peer != 0 && peer != user {
        bail!(
            "the restart socket of {shown} belongs to user {peer}, not to root or to user {user} \
             who serves it: stop whatever listens there"
        );
    }
    send(&sock, &Message::Hello, &[])?;
    let (state, mut fds) =
        match recv(&sock).context("reading the export's state from its daemon")? {
            (Message::State(state), fds) => (state, fds),
            (Message::Serve(serve), mut fds) => {
                adopt_log(serve.log_stderr, &mut fds);
                return Ok(TakenOver::Serve(sock, serve));
            }
            (other, _) => return Err(unexpected(&other, "state")),
        };
    // From here on this process's lines go to the old daemon's log, if that is its stderr.
    adopt_log(state.log_stderr, &mut fds);
    let notifier = match &state.notify_socket {
        Some(v) => crate::notify::Notifier::connect(v)?,
        None => crate::notify::Notifier::from_env()?,
    };
    if state.directory {
        // As `fusex mount SRC_DIR` (see `mount`).
        // SAFETY: umask cannot fail.
        unsafe { libc::umask(0) };
    }
    let adoption = Adoption::begin(state, fds, &shown.to_string(), None)?;
    // Everything that can fail is done: let the old daemon finish and let go.
    send(&sock, &Message::Release, &[])?;
    // A directory export's tables, then the files open on it.
    let (open_files, mut dirs) = crate::dirtable::recv_released(&sock, |m| match m {
        Message::Released { open_files } => Some(*open_files),
        _ => None,
    })?;
    // A `fusex mount` daemon's one export is sent without an id.
    let dir = dirs.remove("");
    Ok(TakenOver::Mount(
        Box::new(adoption.complete(open_files, dir)?),
        notifier,
    ))
}

/// One export being taken over from its daemon: checked and opened as far as it may be while
/// the old daemon still serves it; [`Adoption::complete`] finishes once it let go.
pub struct Adoption {
    args: MountArgs,
    state: crate::restart::State,
    opened: Option<Arc<export::Export<lifecycle::Served>>>,
    conn: std::os::fd::OwnedFd,
    watcher: Option<crate::watcher::Watcher>,
    backing: Option<transport::passthrough::Backing>,
    plan: MemoryPlan,
    queues: usize,
}

impl Adoption {
    /// Reads the export's state and descriptors and opens its image (`shown`: the mountpoint as
    /// the user named it, for messages; `shared`: under `fusex serve`, the image a partition
    /// export shares with the daemon's other partitions of it). Changes the working directory
    /// to the old daemon's.
    pub fn begin(
        state: crate::restart::State,
        fds: Vec<std::os::fd::OwnedFd>,
        shown: &str,
        shared: Option<lifecycle::SharedImage>,
    ) -> Result<Adoption> {
        use crate::restart::STATE_VERSION;
        if state.version > STATE_VERSION {
            bail!(
                "the daemon serving {shown} is a newer fusex (restart state version {}, this \
                 binary reads up to {STATE_VERSION}): restart it with that fusex",
                state.version
            );
        }
        let mut fds = fds.into_iter();
        let conn = fds.next().context("the daemon sent no connection fd")?;
        let watcher = if state.watcher {
            Some(crate::watcher::Watcher::from_fd(
                fds.next().context("the daemon sent no watcher pipe")?,
            ))
        } else {
            None
        };
        // Relative paths on the command line are the old daemon's: resolve them as it did.
        std::env::set_current_dir(&state.cwd).with_context(|| format!("entering {}", state.cwd))?;
        let cli = <crate::cli::Cli as clap::Parser>::try_parse_from(&state.argv)
            .map_err(|e| anyhow::anyhow!("the daemon's command line: {}", e.kind()))?;
        let Some(crate::cli::Command::Mount(args)) = cli.command else {
            bail!("the daemon's command line is not fusex mount");
        };
        let mut args = *args;
        args.shared_image = shared;
        if state.directory != crate::dirmode::is_directory(&args.image) {
            bail!(
                "{} is {} now, and was {} when the daemon serving {shown} started",
                args.image,
                if state.directory {
                    "no directory"
                } else {
                    "a directory"
                },
                if state.directory { "one" } else { "an image" }
            );
        }
        if let (Some(was), Some(now)) = (state.image_file, crate::restart::image_file(&args.image))
        {
            if now != was {
                bail!(
                    "{} is another file now than the one the daemon serving {shown} opened \
                     (device {}, inode {}; it was replaced or moved since): stop the export and \
                     mount it again",
                    args.image,
                    was.0,
                    was.1
                );
            }
        }
        // A writable formatted image's tables (qcow2, VHD, ...) change while the old daemon
        // serves it: opened now, this process would cache stale ones. So it is only tried now
        // (read-only, no locks: can it be opened at all?) and opened for real once the old
        // daemon has flushed it and let go.
        let reopen = args.writable && backend::has_metadata(&args.image, args.format.into());
        // An NBD export is not connected to now: the old daemon may hold the only connection
        // the server takes. What can be checked without the server is (the URI, the TLS
        // files); the backend is made from the export the old daemon negotiated once it let go
        // (its connections closed), and its queues connect on their first requests.
        let nbd = nbd::uri::is_nbd_uri(&args.image);
        if nbd && state.nbd.is_none() {
            bail!(
                "the daemon serving {shown} did not say what its NBD server negotiated (an \
                 earlier fusex refuses to hand NBD exports over): stop and mount it again"
            );
        }
        let opened = if state.directory {
            // Its tables come once the old daemon let go (`service::dirtable`).
            crate::dirmode::check_args(&args)?;
            None
        } else if nbd {
            backend::NbdBackend::validate(&args.image)?;
            None
        } else if reopen {
            let mut trial = args.clone();
            (trial.writable, trial.growable, trial.max_size) = (false, false, None);
            (trial.no_locking, trial.force_share) = (true, false);
            // Not through the shared image, which opens for writing.
            trial.shared_image = None;
            drop(lifecycle::open_export(&trial, false)?);
            None
        } else {
            Some(lifecycle::open_export(&args, true)?)
        };
        let negotiated = state.init;
        let max_write = negotiated.max_write;
        if negotiated.has(FUSE_OVER_IO_URING) {
            bail!("the export uses the io_uring transport, which cannot be handed over");
        }
        let mut backing = None;
        let opened = match opened {
            Some((export, pt)) => {
                backing = pt.finish(
                    &negotiated,
                    conn.as_fd(),
                    &export,
                    args.direct,
                    state.backing,
                )?;
                Some(export)
            }
            None => None,
        };
        let queues = state.queues.max(1);
        let depth = state.depth.max(1);
        let possible = crate::affinity::possible_cpus();
        let plan = MemoryPlan {
            max_write: max_write as usize,
            depth,
            buffer_size: memory::buffer_size(max_write as usize),
            buffers: depth * queues,
            budget: args
                .memory_budget
                .map_or_else(|| memory::budget(possible), |b| b as usize),
        };
        Ok(Adoption {
            args,
            state,
            opened,
            conn,
            watcher,
            backing,
            plan,
            queues,
        })
    }

    /// The old daemon let go with `open_files` files open on the export (and, for a directory
    /// export, handed its tables over: `dir`): the export, ready to be supervised.
    pub fn complete(
        self,
        open_files: u64,
        dir: Option<crate::dirtable::Tables>,
    ) -> Result<Prepared> {
        let Adoption {
            args,
            state,
            opened,
            conn,
            watcher,
            mut backing,
            plan,
            queues,
        } = self;
        let negotiated = state.init;
        if state.directory {
            let Some((table, fds)) = dir else {
                bail!(
                    "the old daemon let go of directory export {} without its tables",
                    args.image
                );
            };
            let fs = crate::dirmode::take_over(&args, &negotiated, conn.as_fd(), table, fds)?;
            let mnt = Mount::adopt(state.handover(), conn);
            tracing::info!(
                "restart: took over directory {} at {} ({} nodes, {} open, {queues} legacy queues)",
                args.image,
                mnt.mountpoint().display(),
                fs.nodes(),
                fs.open_files()
            );
            let settled =
                Settled::adopted(negotiated, state.argv, plan, queues, None, None, watcher);
            return Ok(Prepared {
                args,
                export: lifecycle::Fs::Dir(fs),
                mnt,
                settled,
                stats: Default::default(),
            });
        }
        let export = match opened {
            // The old daemon may have grown the image since it was opened here.
            Some(export) => {
                let _ = export.backend().refresh_size();
                export
            }
            None => {
                // Past the point of return: the old daemon no longer serves. Failing here ends
                // the export as a failed start does (the --auto-unmount watcher then unmounts
                // it).
                let nbd = state.nbd.map(nbd::Export::from);
                let (export, pt) = lifecycle::open_export_adopting(&args, true, nbd)?;
                backing = pt.finish(
                    &negotiated,
                    conn.as_fd(),
                    &export,
                    args.direct,
                    state.backing,
                )?;
                export
            }
        };
        if let Some(h) = state.backing {
            // The old daemon let go of the id its opens use: it is this process's to close.
            backing = Some(transport::passthrough::Backing::adopt(
                std::os::fd::AsRawFd::as_raw_fd(&conn),
                h.id,
                h.file,
            )?);
        }
        export.set_open_files(open_files);
        let mnt = Mount::adopt(state.handover(), conn);
        tracing::info!(
            "restart: took over {} at {} (FUSE 7.{}, max_write {} KiB, {queues} legacy queues)",
            args.image,
            mnt.mountpoint().display(),
            negotiated.minor,
            negotiated.max_write >> 10
        );
        let settled = Settled::adopted(
            negotiated,
            state.argv,
            plan,
            queues,
            backing,
            state.image_file,
            watcher,
        );
        Ok(Prepared {
            args,
            export: lifecycle::Fs::Image(export),
            mnt,
            settled,
            stats: Default::default(),
        })
    }
}
