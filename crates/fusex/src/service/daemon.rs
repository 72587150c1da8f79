//! The `fusex serve` process: its nodes and exports from the command line, its control sockets,
//! its signals, and an orderly end (every export removed, then the sockets), or its hand-over to
//! a `fusex restart` successor.

use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use qmp::Dispatcher;

use super::cmdline::ControlSocket;
use super::{cmdline, Control, Service};
use crate::cli::ServeArgs;
use crate::daemon::Readiness;
use crate::lifecycle::{signal_name, Stop};
use crate::metrics::http::MetricsServer;

/// One QMP socket being served.
struct QmpThread {
    socket: ControlSocket,
    handle: qmp::ShutdownHandle,
    thread: std::thread::JoinHandle<()>,
}

/// A `fusex serve` daemon that serves, however it started (fresh, or by `fusex restart`).
pub struct Running {
    pub service: Arc<Service>,
    ctl: mpsc::Receiver<Control>,
    servers: Vec<QmpThread>,
    pid_file: Option<crate::files::PidFile>,
    signals: signal_hook::iterator::Handle,
    notifier: crate::notify::Notifier,
    /// The `--metrics-listen` server, closed before a hand-over (the successor binds it).
    metrics: Option<MetricsServer>,
}

/// The pieces every start makes first: the signal handling (as early as possible) and the
/// service, whose `quit` and signals arrive on the returned receiver.
pub struct Base {
    pub service: Arc<Service>,
    ctl: mpsc::Receiver<Control>,
    signals: signal_hook::iterator::Handle,
    events: qmp::EventBus,
}

/// Installs the signal handling and makes an empty service.
pub fn base(reloads: bool, verbose: u8) -> Result<Base> {
    // The data plane's priority, read before any control thread lowers itself.
    crate::priority::settle_base();
    use signal_hook::consts::{SIGALRM, SIGHUP, SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
    let mut signals =
        signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, SIGALRM])
            .context("installing signal handlers")?;
    let events = qmp::EventBus::new();
    let (ctl_tx, ctl) = mpsc::channel();
    let service = Service::new(events.clone(), ctl_tx.clone(), verbose);
    let handle = signals.handle();
    std::thread::Builder::new()
        .name("fusex-signals".into())
        .spawn(move || {
            for s in signals.forever() {
                let c = match s {
                    SIGUSR1 => Control::Dump,
                    SIGUSR2 => {
                        crate::lifecycle::reopen_log();
                        continue;
                    }
                    SIGALRM => {
                        crate::lifecycle::log_ignored(s);
                        continue;
                    }
                    SIGHUP if reloads => Control::Reload,
                    _ => Control::Signal(s),
                };
                if ctl_tx.send(c).is_err() {
                    break;
                }
            }
        })?;
    Ok(Base {
        service,
        ctl,
        signals: handle,
        events,
    })
}

/// The control sockets the command line asks for (`--chardev` with `--monitor`, `--control`),
/// or the default one.
pub fn sockets(args: &ServeArgs) -> Result<Vec<ControlSocket>> {
    let mut sockets =
        cmdline::monitor_sockets(&args.chardev, &args.monitor).map_err(|e| anyhow!(e))?;
    sockets.extend(args.control.iter().cloned().map(ControlSocket::Path));
    if sockets.is_empty() {
        // Nothing asked for a socket: the default one, where `fusex ctl` looks.
        sockets.push(ControlSocket::Path(default_control()?));
    }
    Ok(sockets)
}

impl Base {
    /// Binds the control sockets and serves QMP on them: the daemon runs. On an error the
    /// start is abandoned (nothing stays mounted).
    pub fn serve(
        self,
        sockets: Vec<ControlSocket>,
        pid_file: Option<crate::files::PidFile>,
        notifier: crate::notify::Notifier,
        metrics: Option<MetricsServer>,
    ) -> Result<Running> {
        match self.bind(sockets) {
            Ok(servers) => Ok(Running {
                service: self.service,
                ctl: self.ctl,
                servers,
                pid_file,
                signals: self.signals,
                notifier,
                metrics,
            }),
            Err(e) => {
                self.abandon(pid_file);
                Err(e)
            }
        }
    }

    fn bind(&self, sockets: Vec<ControlSocket>) -> Result<Vec<QmpThread>> {
        let mut servers: Vec<QmpThread> = Vec::new();
        for socket in sockets {
            let config = qmp::ServerConfig {
                info: qmp::ServerInfo::default(),
                events: self.events.clone(),
                ..Default::default()
            };
            let server = match &socket {
                ControlSocket::Path(path) => qmp::Server::bind(path, self.service.clone(), config),
                ControlSocket::Fd(fd) => qmp::Server::from_fd(*fd, self.service.clone(), config),
            };
            let server = match server {
                Ok(s) => s,
                Err(e) => {
                    for s in servers {
                        s.handle.shutdown();
                        let _ = s.thread.join();
                    }
                    return Err(match &socket {
                        ControlSocket::Path(path) => {
                            anyhow!("QMP socket {}: {e}", path.display())
                        }
                        ControlSocket::Fd(_) => anyhow!("{e}"),
                    });
                }
            };
            let handle = server.shutdown_handle();
            let shown = socket.to_string();
            let thread = std::thread::Builder::new()
                .name("fusex-qmp".into())
                .spawn(move || {
                    // Its client threads (which add and remove exports) start from here.
                    crate::priority::lower_this_thread();
                    if let Err(e) = server.run() {
                        tracing::error!("QMP on {shown}: {e}");
                    }
                })?;
            servers.push(QmpThread {
                socket,
                handle,
                thread,
            });
        }
        Ok(servers)
    }

    /// A start that failed: the exports already added are removed, nothing stays mounted.
    pub fn abandon(self, pid_file: Option<crate::files::PidFile>) {
        self.service.stop_all(Stop::Safe);
        while self.service.export_count() > 0 {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.signals.close();
        if let Some(p) = pid_file {
            p.remove();
        }
    }
}

/// Runs `fusex serve` until `quit` or a stop signal. Errors before it serves are reported
/// through `ready` too.
pub fn run(args: ServeArgs, mut ready: Readiness, verbose: u8) -> Result<()> {
    match start(&args, verbose) {
        Ok(running) => running.serve_until_done(ready),
        Err(e) => {
            ready.report(Err(format!("{e:#}")));
            Err(e)
        }
    }
}

impl Running {
    /// Says the daemon is ready, then handles `quit`, signals, reloads and a hand-over until
    /// the last export is gone.
    pub fn serve_until_done(self, mut ready: Readiness) -> Result<()> {
        let Running {
            service,
            ctl,
            servers,
            pid_file,
            signals,
            notifier,
            mut metrics,
        } = self;
        let count = service.export_count();
        ready.report(Ok(()));
        crate::runtime::begin_sweep();
        notifier.ready(&format!(
            "serving {count} export{}",
            if count == 1 { "" } else { "s" }
        ));
        tracing::info!(
            "serving {count} export{}; QMP on {}{}",
            if count == 1 { "" } else { "s" },
            servers
                .iter()
                .map(|s| s.socket.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            metrics
                .as_ref()
                .map(|m| format!("; metrics at http://{}/metrics", m.local_addr()))
                .unwrap_or_default()
        );
        let shut_down = |servers: Vec<QmpThread>| {
            for s in servers {
                s.handle.shutdown();
                let _ = s.thread.join();
            }
        };
        let mut handed = false;
        let mut servers = Some(servers);
        loop {
            match ctl.recv() {
                Ok(Control::Dump) => service.dump_all(),
                Ok(Control::Reload) => {
                    tracing::info!("SIGHUP: reloading the config file");
                    notifier.reloading("applying the config file");
                    if let Err(e) = service.reload() {
                        tracing::error!("reload: {}", e.desc);
                    }
                    notifier.ready(&format!("serving {} exports", service.export_count()));
                }
                Ok(Control::Quit) => {
                    tracing::info!("quit: removing every export");
                    service.stop_all(Stop::Safe);
                    break;
                }
                Ok(Control::Signal(s)) => {
                    tracing::info!("{}: stopping every export", signal_name(s));
                    service.stop_all(Stop::Signal(s));
                    break;
                }
                Ok(Control::HandOver { stream, pid }) => {
                    tracing::info!(
                        "restart: process {pid} takes every export over; finishing in-flight \
                         requests"
                    );
                    notifier.reloading("handing every export to a new process");
                    // The successor binds the same sockets and metrics address; and may claim
                    // the pid file.
                    shut_down(servers.take().unwrap_or_default());
                    drop(metrics.take());
                    if let Some(p) = &pid_file {
                        p.stop_serving();
                    }
                    let let_go = service.release_all(pid);
                    let releasing = let_go.releasing;
                    let released = crate::restart::Message::ServeReleased {
                        open_files: let_go.open_files,
                    };
                    // Named the main process before the successor may serve: a service manager
                    // must hear that before the successor's own READY=1.
                    notifier.main_pid(pid);
                    // The successor says it serves them; until then nothing is left behind:
                    // without its word (it died), they end as a stop would, unmounted.
                    let taken = let_go
                        .dirs
                        .iter()
                        .try_for_each(|(id, fs)| crate::dirtable::send_dir(&stream, id, fs))
                        .and_then(|()| crate::restart::send(&stream, &released, &[]))
                        .map_err(|e| e.to_string())
                        .and_then(|()| match crate::restart::recv(&stream) {
                            Ok((crate::restart::Message::Taken, _)) => Ok(()),
                            Ok((other, _)) => {
                                Err(crate::restart::unexpected(&other, "taken").to_string())
                            }
                            Err(e) => Err(e.to_string()),
                        });
                    match taken {
                        Ok(()) => {
                            releasing.taken(true);
                            handed = true;
                        }
                        Err(e) => {
                            tracing::error!(
                                "restart: process {pid} did not take the exports over ({e}); \
                                 unmounting every export"
                            );
                            releasing.taken(false);
                            notifier.main_pid(std::process::id());
                        }
                    }
                    break;
                }
                Err(_) => break,
            }
        }
        if !handed {
            notifier.stopping();
        }
        // A second signal aborts what still waits for open files (`fusex mount`'s rule).
        let mut second = false;
        while service.export_count() > 0 {
            match ctl.recv_timeout(Duration::from_millis(20)) {
                Ok(Control::Signal(s)) if !second && !handed => {
                    second = true;
                    tracing::info!("{}: aborting the exports still stopping", signal_name(s));
                    service.stop_all(Stop::Hard);
                }
                _ => {}
            }
        }
        signals.close();
        shut_down(servers.take().unwrap_or_default());
        if handed {
            if let Some(p) = pid_file {
                p.keep();
            }
            tracing::info!("handed every export over; exiting");
            return Ok(());
        }
        if let Some(p) = pid_file {
            p.remove();
        }
        tracing::info!("every export removed; exiting");
        Ok(())
    }
}

/// The control socket of a `fusex serve` given none: `control.sock` in the user's runtime
/// directory (`/run/fusex` for root), which `fusex ctl` uses by default.
pub fn default_control() -> Result<PathBuf> {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    Ok(crate::runtime::control_socket(&crate::runtime::checked(
        uid, true,
    )?))
}

fn start(args: &ServeArgs, verbose: u8) -> Result<Running> {
    crate::priority::configure(args.control_nice);
    let base = base(args.config.is_some(), verbose)?;
    let notifier = crate::notify::Notifier::from_env()?;
    // Every argument is checked before anything is mounted.
    let sockets = sockets(args)?;
    // Read once, before anything is mounted: a mistake in it is refused first.
    let config = match &args.config {
        Some(c) => Some((c, super::config::read_all(c).map_err(|e| anyhow!(e))?)),
        None => None,
    };
    // Bound before anything is mounted: an address in use fails the start in one line.
    let listen = metrics_listen(args, config.as_ref().map(|(_, c)| c));
    let metrics = listen
        .map(|a| start_metrics(&a, &base.service))
        .transpose()?;
    let objects = args
        .object
        .iter()
        .map(|o| cmdline::object(o).map(|v| (o, v)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow!(e))?;
    let blockdevs = args
        .blockdev
        .iter()
        .map(|b| cmdline::blockdev(b).map(|v| (b, v)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow!(e))?;
    let exports = args
        .export
        .iter()
        .map(|e| cmdline::export(e).map(|v| (e, v)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow!(e))?;
    let pid_file = args
        .pidfile
        .as_deref()
        .map(crate::files::PidFile::claim)
        .transpose()?;
    base.service
        .set_notify_socket(notifier.socket().map(str::to_string));
    let service = base.service.clone();
    let added = (|| -> Result<()> {
        for (text, v) in objects {
            service
                .dispatch("object-add", v)
                .map_err(|e| anyhow!("--object {text}: {}", e.desc))?;
        }
        for (text, v) in blockdevs {
            service
                .dispatch("blockdev-add", v)
                .map_err(|e| anyhow!("--blockdev {text}: {}", e.desc))?;
        }
        // Every export is checked before the first is mounted: a mistake in the last one
        // mounts nothing.
        let requests: Vec<_> = exports.iter().map(|(_, v)| v.clone()).collect();
        if let Err((i, e)) = service.check_exports(&requests) {
            return Err(anyhow!("--export {}: {}", exports[i].0, e.desc));
        }
        for (text, v) in exports {
            service
                .dispatch("block-export-add", v)
                .map_err(|e| anyhow!("--export {text}: {}", e.desc))?;
        }
        if let Some((path, exports)) = &config {
            service
                .load_config(path, &exports.exports)
                .map_err(|e| anyhow!(e))?;
        }
        Ok(())
    })();
    if let Err(e) = added {
        base.abandon(pid_file);
        return Err(e);
    }
    base.serve(sockets, pid_file, notifier, metrics)
}

/// Where the metrics are served: `--metrics-listen`, else the config file's `metrics-listen`.
pub fn metrics_listen(args: &ServeArgs, config: Option<&super::config::Config>) -> Option<String> {
    args.metrics_listen
        .clone()
        .or_else(|| config.and_then(|c| c.metrics_listen.clone()))
}

/// Serves every export's metrics at `addr` (see `crate::metrics::http`).
pub fn start_metrics(addr: &str, service: &Arc<Service>) -> Result<MetricsServer> {
    MetricsServer::start(addr, crate::metrics::serve_render(service.clone()))
        .map_err(|e| anyhow!("{e}"))
}
