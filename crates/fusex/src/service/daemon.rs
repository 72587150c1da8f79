//! The `fusex serve` process: its nodes and exports from the command line, its control sockets,
//! its signals, and an orderly end (every export removed, then the sockets).

use std::sync::{mpsc, Arc};
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use qmp::Dispatcher;

use super::{cmdline, Control, Service};
use crate::cli::ServeArgs;
use crate::daemon::Readiness;
use crate::lifecycle::{signal_name, Stop};

/// Runs `fusex serve` until `quit` or a stop signal. Errors before it serves are reported
/// through `ready` too.
pub fn run(args: ServeArgs, mut ready: Readiness, verbose: u8) -> Result<()> {
    let result = start(&args, verbose);
    let (service, ctl, servers, pid_file, signals, notifier) = match result {
        Ok(v) => v,
        Err(e) => {
            ready.report(Err(format!("{e:#}")));
            return Err(e);
        }
    };
    let count = service.export_count();
    ready.report(Ok(()));
    notifier.ready(&format!(
        "serving {count} export{}",
        if count == 1 { "" } else { "s" }
    ));
    tracing::info!(
        "serving {count} export{}{}",
        if count == 1 { "" } else { "s" },
        match servers.len() {
            0 => String::new(),
            _ => format!(
                "; QMP on {}",
                servers
                    .iter()
                    .map(|(p, _, _)| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    );
    loop {
        match ctl.recv() {
            Ok(Control::Dump) => service.dump_all(),
            Ok(Control::Reload) => {
                tracing::info!("SIGHUP: reloading the config file");
                notifier.reloading();
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
            Err(_) => break,
        }
    }
    notifier.stopping();
    // A second signal aborts what still waits for open files (`fusex mount`'s rule).
    let mut second = false;
    while service.export_count() > 0 {
        match ctl.recv_timeout(Duration::from_millis(20)) {
            Ok(Control::Signal(s)) if !second => {
                second = true;
                tracing::info!("{}: aborting the exports still stopping", signal_name(s));
                service.stop_all(Stop::Hard);
            }
            _ => {}
        }
    }
    signals.close();
    for (_, handle, thread) in servers {
        handle.shutdown();
        let _ = thread.join();
    }
    if let Some(p) = pid_file {
        p.remove();
    }
    tracing::info!("every export removed; exiting");
    Ok(())
}

type QmpThread = (
    std::path::PathBuf,
    qmp::ShutdownHandle,
    std::thread::JoinHandle<()>,
);

type Started = (
    Arc<Service>,
    mpsc::Receiver<Control>,
    Vec<QmpThread>,
    Option<crate::files::PidFile>,
    signal_hook::iterator::Handle,
    crate::notify::Notifier,
);

/// The control socket of a `fusex serve` given none: `control.sock` in the user's runtime
/// directory (`/run/fusex` for root), which `fusex ctl` uses by default.
pub fn default_control() -> Result<std::path::PathBuf> {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let dir = crate::runtime::checked(uid, true)?;
    Ok(dir.join("control.sock"))
}

fn start(args: &ServeArgs, verbose: u8) -> Result<Started> {
    use signal_hook::consts::{SIGALRM, SIGHUP, SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
    let mut signals =
        signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, SIGALRM])
            .context("installing signal handlers")?;
    let notifier = crate::notify::Notifier::from_env()?;
    // Every argument is checked before anything is mounted.
    let mut sockets =
        cmdline::monitor_sockets(&args.chardev, &args.monitor).map_err(|e| anyhow!(e))?;
    sockets.extend(args.control.iter().cloned());
    if sockets.is_empty() {
        // Nothing asked for a socket: the default one, where `fusex ctl` looks.
        sockets.push(default_control()?);
    }
    if let Some(c) = &args.config {
        // Read now, so a mistake in it is refused before anything is mounted.
        super::config::read(c).map_err(|e| anyhow!(e))?;
    }
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
    let events = qmp::EventBus::new();
    let (ctl_tx, ctl) = mpsc::channel();
    let service = Service::new(events.clone(), ctl_tx.clone(), verbose);
    let handle = signals.handle();
    let reloads = args.config.is_some();
    std::thread::Builder::new()
        .name("fusex-signals".into())
        .spawn(move || {
            for s in signals.forever() {
                let c = match s {
                    SIGUSR1 => Control::Dump,
                    SIGUSR2 | SIGALRM => {
                        tracing::info!(
                            "{}: ignored (SIGTERM, SIGINT or SIGHUP stop fusex; SIGUSR1 writes \
                             statistics)",
                            signal_name(s)
                        );
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
    let added = (|| -> Result<Vec<QmpThread>> {
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
        if let Some(c) = &args.config {
            service.load_config(c).map_err(|e| anyhow!(e))?;
        }
        let mut servers = Vec::new();
        for path in sockets {
            let config = qmp::ServerConfig {
                info: qmp::ServerInfo::default(),
                events: events.clone(),
                ..Default::default()
            };
            let server = qmp::Server::bind(&path, service.clone(), config)
                .with_context(|| format!("QMP socket {}", path.display()))?;
            let handle = server.shutdown_handle();
            let shown = path.clone();
            let thread = std::thread::Builder::new()
                .name("fusex-qmp".into())
                .spawn(move || {
                    if let Err(e) = server.run() {
                        tracing::error!("QMP on {}: {e}", shown.display());
                    }
                })?;
            servers.push((path, handle, thread));
        }
        Ok(servers)
    })();
    match added {
        Ok(servers) => Ok((service, ctl, servers, pid_file, handle, notifier)),
        Err(e) => {
            // Nothing half-started stays: the exports already added are removed.
            service.stop_all(Stop::Safe);
            while service.export_count() > 0 {
                std::thread::sleep(Duration::from_millis(10));
            }
            handle.close();
            if let Some(p) = pid_file {
                p.remove();
            }
            Err(e)
        }
    }
}
