//! `fusex restart` of a `fusex serve` daemon, in the new process: every export is taken over
//! at once (the nodes added again, each export adopted as `fusex restart` adopts a `fusex mount`
//! export), then the control sockets are bound again, and the daemon serves on with the old
//! one's command line. Any error before the old daemon let go leaves it serving.

use std::os::unix::net::UnixStream;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};

use super::daemon::{self, Running};
use crate::daemon::Readiness;
use crate::restart::{recv, send, unexpected, ExportHanding, Message, ServeState, STATE_VERSION};
use crate::serve::Adoption;

/// Takes the daemon over through `sock` (its `serve` state already read) and serves until
/// stopped, like `fusex serve`.
pub fn run(sock: UnixStream, state: ServeState, mut ready: Readiness, path: &Path) -> Result<()> {
    match take(sock, state, &mut ready, path) {
        Ok(running) => running.serve_until_done(ready),
        Err(e) => {
            ready.report(Err(format!("{e:#}")));
            Err(e)
        }
    }
}

fn take(
    sock: UnixStream,
    state: ServeState,
    ready: &mut Readiness,
    path: &Path,
) -> Result<Running> {
    let shown = path.display().to_string();
    if state.version > STATE_VERSION {
        bail!(
            "the daemon serving {shown} is a newer fusex (restart state version {}, this binary \
             reads up to {STATE_VERSION}): restart it with that fusex",
            state.version
        );
    }
    let mut exports: Vec<(ExportHanding, Vec<std::os::fd::OwnedFd>)> = Vec::new();
    loop {
        match recv(&sock).context("reading the daemon's exports")? {
            (Message::Export(e), fds) => exports.push((e, fds)),
            (Message::ServeEnd, _) => break,
            (other, _) => return Err(unexpected(&other, "export")),
        }
    }
    std::env::set_current_dir(&state.cwd).with_context(|| format!("entering {}", state.cwd))?;
    let cli = <crate::cli::Cli as clap::Parser>::try_parse_from(&state.argv)
        .map_err(|e| anyhow!("the daemon's command line: {}", e.kind()))?;
    let Some(crate::cli::Command::Serve(args)) = cli.command else {
        bail!("the daemon's command line is not fusex serve");
    };
    // The log goes where the old daemon's command line says, in its format, as for a daemon.
    crate::logging::set_format(args.log_format);
    if let Some(keep) = crate::logging::settle_successor(|| {
        crate::logging::choose_for(args.log, args.log_file.as_ref(), true)
    }) {
        ready.keep_stderr(keep);
    }
    crate::priority::configure(args.control_nice);
    let base = daemon::base(args.config.is_some(), 0)?;
    let notifier = match &state.notify_socket {
        Some(v) => crate::notify::Notifier::connect(v)?,
        None => crate::notify::Notifier::from_env()?,
    };
    base.service
        .set_notify_socket(notifier.socket().map(str::to_string));
    if let Some(c) = &args.config {
        base.service.remember_config(c);
    }
    for o in state.objects {
        base.service
            .object_add(o.clone())
            .map_err(|e| anyhow!("restart: adding object {o}: {}", e.desc))?;
    }
    for n in state.nodes {
        base.service
            .add_node_adopted(n.clone(), &state.nbd_sizes)
            .map_err(|e| anyhow!("restart: adding node {n}: {}", e.desc))?;
    }
    let mut adoptions = Vec::with_capacity(exports.len());
    for (e, fds) in exports {
        let _in = crate::logging::export_span(&e.id).entered();
        let shared = base.service.shared_image_for(&e.node);
        let a = Adoption::begin(e.state.clone(), fds, &e.state.mountpoint, shared)
            .with_context(|| format!("export {}", e.id))?;
        adoptions.push((e, a));
    }
    let sockets = daemon::sockets(&args)?;
    // A socket the old daemon was handed by number was its parent's to give: this process
    // did not inherit it, and the number names something else here (or nothing).
    if let Some(s) = sockets
        .iter()
        .find(|s| matches!(s, super::cmdline::ControlSocket::Fd(_)))
    {
        bail!(
            "restart: the daemon's QMP socket came from its parent as {s}, which a new process \
             cannot take over; run it with --chardev socket,path=PATH to restart it"
        );
    }
    // Everything that can fail is done: let the old daemon finish and let go.
    send(&sock, &Message::Release, &[])?;
    // The directory exports' tables, then the files open on every export.
    let (open_files, mut dirs) = crate::dirtable::recv_released(&sock, |m| match m {
        Message::ServeReleased { open_files } => Some(open_files.clone()),
        _ => None,
    })?;
    // Past the point of return: an export that fails now ends as a failed start does.
    for (e, a) in adoptions {
        let _in = crate::logging::export_span(&e.id).entered();
        let Some(&open) = open_files.get(&e.id) else {
            tracing::error!("restart: the old daemon did not let go of export {}", e.id);
            continue;
        };
        let adopted = a
            .complete(open, dirs.remove(&e.id))
            .map_err(|err| format!("{err:#}"))
            .and_then(|p| {
                let node = e
                    .own_node
                    .then(|| super::node::Node::of_image(&e.node, &p.args));
                base.service.adopt(
                    &e.id,
                    node,
                    &e.node,
                    e.config.clone(),
                    e.iothreads.clone(),
                    p,
                )
            });
        if let Err(err) = adopted {
            tracing::error!("restart: export {}: {err}", e.id);
        }
    }
    // The old daemon leaves the mounts to this one only once told (if it is gone already,
    // this one serves them regardless).
    if let Err(e) = send(&sock, &Message::Taken, &[]) {
        tracing::warn!("restart: cannot tell the old daemon the exports are taken: {e}");
    }
    let pid_file = match args.pidfile.as_deref().map(crate::files::PidFile::claim) {
        Some(Ok(p)) => Some(p),
        Some(Err(e)) => {
            tracing::warn!("restart: {e:#}");
            None
        }
        None => None,
    };
    tracing::info!(
        "restart: took over {} export{}",
        base.service.export_count(),
        if base.service.export_count() == 1 {
            ""
        } else {
            "s"
        }
    );
    // The old daemon closed its metrics server before letting go: bind the address again.
    // Past the point of return, so a failure leaves the exports serving without metrics.
    let config = args.config.as_ref().and_then(|c| {
        super::config::read_all(c)
            .map_err(|e| tracing::warn!("restart: {e}"))
            .ok()
    });
    let metrics = daemon::metrics_listen(&args, config.as_ref()).and_then(|a| {
        daemon::start_metrics(&a, &base.service)
            .map_err(|e| tracing::error!("restart: {e:#}; serving without metrics"))
            .ok()
    });
    base.serve(sockets, pid_file, notifier, metrics)
}
