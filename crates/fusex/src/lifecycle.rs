//! One export's lifecycle, whoever drives it (`fusex mount`, `fusex restart`, `fusex serve`):
//! open the image ([`open_export`]), mount and negotiate ([`setup`]), serve until stopped
//! ([`supervise`]), then flush and unmount, or hand the connection to a successor. What belongs to
//! the process (signals, pid files, readiness, the restart socket) is the driver's: it reaches the
//! export through [`Event`]s and hears back through its [`Owner`].

use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use backend::{AnyBackend, BlockBackend, Faulty, IoPath, Locking, OpenOptions};
use engine::{Engine, EngineConfig};
use export::{Export, ExportConfig, Snapshot};
use fuse_abi::{
    FUSE_ASYNC_DIO, FUSE_ASYNC_READ, FUSE_BIG_WRITES, FUSE_DIRECT_IO_ALLOW_MMAP,
    FUSE_OVER_IO_URING, FUSE_REQUEST_TIMEOUT,
};
use server::queue::{QueueEvent, QueueSpec, Report, Source};
use transport::{clone_fd, InitParams, Mount, MountConfig};

use crate::cli::{IoPathArg, MountArgs, OnOff, TransportArg};
use crate::memory::{self, Demand, Plan as MemoryPlan};
use crate::privileges::{Access, Needs, Plan};

/// The backend the queues serve: the opened image, with `--fault` rules (none: a plain
/// pass-through).
pub type Served = Faulty<AnyBackend>;

/// What an export serves: an image, or a directory tree (`fusex mount SRC_DIR`, or a
/// directory export of `fusex serve`). The queues are generic over [`export::Filesystem`];
/// the supervisor reaches what differs (the image's size, its flush) through this.
#[derive(Clone)]
pub enum Fs {
    /// An image file (or NBD server, or `null:`).
    Image(Arc<Export<Served>>),
    /// A directory tree ([`dirfs::DirFs`]).
    Dir(Arc<dirfs::DirFs>),
}

impl Fs {
    /// The image export, None for a directory.
    pub fn image(&self) -> Option<&Arc<Export<Served>>> {
        match self {
            Fs::Image(e) => Some(e),
            Fs::Dir(_) => None,
        }
    }

    /// Files open through the export now.
    pub fn open_files(&self) -> u64 {
        match self {
            Fs::Image(e) => e.open_files(),
            Fs::Dir(d) => d.open_files(),
        }
    }

    /// Whether it accepts changes.
    pub fn writable(&self) -> bool {
        match self {
            Fs::Image(e) => e.config().writable,
            Fs::Dir(d) => d.config().writable,
        }
    }
}

/// An image several exports share, opened by the first of them: `fusex serve` exports
/// partitions of one image from one opened image (a qcow2 image opened twice for writing would
/// be two allocators over one file). Called with the image and how the export would open it.
#[derive(Clone)]
#[allow(clippy::type_complexity)]
pub struct SharedImage(
    pub  Arc<
        dyn Fn(&str, OpenOptions) -> std::result::Result<Arc<AnyBackend>, backend::OpenError>
            + Send
            + Sync,
    >,
);

impl std::fmt::Debug for SharedImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedImage")
    }
}

/// What an export's supervisor waits for.
pub enum Event {
    /// From a queue thread.
    Queue(QueueEvent),
    /// Stop the export (a signal, or a removal over the control socket).
    Stop(Stop),
    /// SIGUSR1 arrived: write the statistics as they stand.
    Dump,
    /// `fusex restart`: process `pid`, reached through `stream`, is ready to serve the export;
    /// stop taking requests, answer the ones taken, flush, and tell it on `stream`. The
    /// supervisor answers `accepted` with whether it took the request: a refused one leaves the
    /// restart listener listening.
    Release {
        to: ReleaseTo,
        pid: u32,
        accepted: mpsc::Sender<bool>,
    },
    /// `fusex serve`'s answer to an export that let go through [`ReleaseTo::Channel`]: whether
    /// the successor took the exports (if it did not, the export is unmounted, as after a stop).
    /// An answer rather than a channel the export waits on, so that one thread can supervise
    /// every export while they all let go.
    Taken(bool),
}

/// Where an export that let go says so, with the files open on it then (their RELEASEs reach
/// the successor, which counts them down).
pub enum ReleaseTo {
    /// `fusex mount`: the successor itself, as `Message::Released`.
    Stream(std::os::unix::net::UnixStream),
    /// `fusex serve`: the daemon, which gets the count here, tells the successor once every
    /// export let go, and answers with an [`Event::Taken`].
    Channel(mpsc::SyncSender<Released>),
}

/// What an export of `fusex serve` that let go tells the daemon ([`ReleaseTo::Channel`]).
pub struct Released {
    /// Files open on it.
    pub open_files: u64,
    /// A directory export: its tables, which the daemon sends the successor (they hold still:
    /// the queues let go).
    pub dir: Option<Arc<dirfs::DirFs>>,
}

impl From<QueueEvent> for Event {
    fn from(e: QueueEvent) -> Event {
        Event::Queue(e)
    }
}

/// How to stop an export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// SIGINT, SIGTERM or SIGHUP (`fusex mount`): detach the export lazily, so nothing new can
    /// open it, and serve the files still open until they are closed or `--stop-timeout` passes.
    /// A second one aborts them.
    Signal(i32),
    /// A removal in `safe` mode (QMP's `block-export-del`, as qemu-storage-daemon does it):
    /// answer the requests the queues took, flush, and end the connection; files still open
    /// then get ENOTCONN.
    Safe,
    /// A removal in `hard` mode: abort the connection at once (requests in flight fail with
    /// ENOTCONN), then flush.
    Hard,
}

impl Stop {
    /// What asked for the stop, for log lines.
    fn name(self) -> String {
        match self {
            Stop::Signal(s) => signal_name(s),
            Stop::Safe => "removal".into(),
            Stop::Hard => "forced removal".into(),
        }
    }
}

/// A signal's name for log lines.
pub fn signal_name(s: i32) -> String {
    use signal_hook::consts::{SIGALRM, SIGHUP, SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
    match s {
        SIGINT => "SIGINT".into(),
        SIGTERM => "SIGTERM".into(),
        SIGHUP => "SIGHUP".into(),
        SIGUSR1 => "SIGUSR1".into(),
        SIGUSR2 => "SIGUSR2".into(),
        SIGALRM => "SIGALRM".into(),
        _ => format!("signal {s}"),
    }
}

/// Logs a signal fusex catches only so that its default action (ending the process, leaving a
/// dead mount) does not happen.
pub fn log_ignored(s: i32) {
    tracing::info!(
        "{}: ignored (SIGTERM, SIGINT or SIGHUP stop fusex; SIGUSR1 writes statistics; SIGUSR2 \
         reopens a --log-file)",
        signal_name(s)
    );
}

/// SIGUSR2: the `--log-file` is opened again at its path, for log rotation (see
/// [`crate::logging::reopen`]); without one the signal is only logged. One line goes to the
/// old file before the switch, one to the new file after it, so either file says where the
/// log went.
pub fn reopen_log() {
    let Some(path) = crate::logging::log_file() else {
        log_ignored(signal_hook::consts::SIGUSR2);
        return;
    };
    tracing::info!("SIGUSR2: reopening the log file");
    match crate::logging::reopen(&path) {
        Ok(()) => tracing::info!("SIGUSR2: log file {} reopened", path.display()),
        Err(e) => tracing::warn!("SIGUSR2: cannot reopen the log file ({e:#}); logging on here"),
    }
}

/// Whoever drives an export hears from its supervisor through this: readiness, the state `fusex
/// list` shows, and the steps of a stop or a hand-over. `fusex mount` answers with the process's
/// readiness pipe, systemd and pid file; `fusex serve` with its export table.
pub trait Owner {
    /// Every queue serves.
    fn serving(&mut self);
    /// The export could not start (ignored once `serving` was said).
    fn failed(&mut self, why: &str);
    /// The state as `fusex list` shows it changed ("serving", "stopping (2 open)").
    fn state(&mut self, state: &str);
    /// A stop was asked for (once).
    fn stopping(&mut self);
    /// The export no longer takes new work: a stop or a failure (once).
    fn not_serving(&mut self);
    /// `fusex restart`: a successor takes the export over.
    fn reloading(&mut self);
    /// `pid` is to be the service's main process (a successor about to serve, or this process
    /// again when it did not take the export). Default: no service manager to tell.
    fn main_process(&mut self, _pid: u32) {}
    /// The successor `pid` serves the export now.
    fn handed_over(&mut self, pid: u32);
    /// The backend cannot serve for now (`Some(why)`: its NBD server is unreachable), or can
    /// again (`None`); said on each change.
    fn trouble(&mut self, why: Option<&str>) {
        match why {
            Some(w) => tracing::error!("{w}"),
            None => tracing::info!("the image serves again"),
        }
    }
}

/// What INIT settled that the queues need.
pub struct Settled {
    /// The "mounted" line, logged once the export can be found by `fusex restart` (a successor
    /// that took an export over has none).
    pub announce: Option<String>,
    /// What INIT settled (handed to a successor by `fusex restart`).
    pub negotiated: transport::Negotiated,
    /// The `fusex mount` command line this export was started with (a successor parses it).
    pub argv: Vec<String>,
    /// Request buffers per queue and their size.
    pub plan: MemoryPlan,
    /// Queue threads (the count the plan was made for; on io_uring at most one per possible CPU).
    pub queues: usize,
    /// The passthrough backing id; dropping it (at the end of `mount`) closes the id, which
    /// [`Settled::disown`] leaves registered for a restart successor.
    passthrough: Option<transport::passthrough::Backing>,
    /// The file the image path named when the export was opened (`restart::image_file`).
    pub image_file: Option<(u64, u64)>,
    /// The `--auto-unmount` watcher's pipe; it must outlive the unmount at the end of `mount`
    /// (closing it early would make the watcher unmount a live export).
    pub watcher: Option<crate::watcher::Watcher>,
}

impl Settled {
    /// Whether the queues serve FUSE-over-io_uring (INIT negotiated it).
    pub fn uring(&self) -> bool {
        self.negotiated.has(FUSE_OVER_IO_URING)
    }

    /// Lets go after a hand-over: the passthrough backing id stays registered for the
    /// successor, which answers opens with it; the rest is dropped.
    pub fn disown(mut self) {
        if let Some(b) = self.passthrough.take() {
            b.leave();
        }
    }

    /// What a `fusex restart` successor settles from the state its predecessor sent (the legacy
    /// transport: an io_uring export is never handed over).
    pub fn adopted(
        negotiated: transport::Negotiated,
        argv: Vec<String>,
        plan: MemoryPlan,
        queues: usize,
        passthrough: Option<transport::passthrough::Backing>,
        image_file: Option<(u64, u64)>,
        watcher: Option<crate::watcher::Watcher>,
    ) -> Settled {
        Settled {
            announce: None,
            negotiated,
            argv,
            plan,
            queues,
            passthrough,
            image_file,
            watcher,
        }
    }
}

/// What `fusex restart` hands a successor of one export: its state, its connection (a clone)
/// and `--auto-unmount` watcher pipe, or why it cannot be handed over.
pub struct Handing {
    pub state: crate::restart::State,
    pub conn: std::os::fd::OwnedFd,
    pub watcher: Option<std::os::fd::OwnedFd>,
    /// Why this export cannot be handed over (it serves on).
    pub refusal: Option<String>,
}

impl Handing {
    /// The descriptors sent with the state: the connection, then the watcher's pipe.
    pub fn fds(&self) -> Vec<std::os::fd::RawFd> {
        let mut v = vec![self.conn.as_raw_fd()];
        v.extend(self.watcher.as_ref().map(|w| w.as_raw_fd()));
        v
    }
}

/// What a successor would need of `p` (None: a mount without an identity, which cannot be
/// found again).
pub fn handing(p: &Prepared, notify_socket: Option<String>) -> Result<Option<Handing>> {
    let (args, export, mnt, neg) = (&p.args, &p.export, &p.mnt, &p.settled);
    let Some(handover) = mnt.handover() else {
        return Ok(None);
    };
    // A directory export's tables follow the release (`dirtable`).
    let directory = matches!(export, Fs::Dir(_));
    // Every export but one over io_uring can be handed over.
    let refusal = neg.uring().then(|| {
        format!(
            "{} is served over the io_uring transport, whose requests cannot be handed to a new \
             process without failing some (docs/design.md, Restart): stop and mount it again, or \
             mount it with --transport legacy to restart it without unmounting",
            handover.mountpoint.display()
        )
    });
    let conn = clone_fd(mnt.fd().context("mount fd")?.as_raw_fd())?;
    let watcher = neg.watcher.as_ref().map(|w| w.dup()).transpose()?;
    let id = handover.identity;
    let nbd = export
        .image()
        .and_then(|e| e.backend().inner().nbd_export())
        .map(crate::restart::NbdExport::from);
    let state = crate::restart::State {
        version: crate::restart::State::version_for(nbd.is_some() || directory),
        argv: neg.argv.clone(),
        cwd: std::env::current_dir()?.to_string_lossy().into_owned(),
        init: neg.negotiated,
        depth: neg.plan.depth,
        queues: neg.queues,
        mountpoint: handover.mountpoint.to_string_lossy().into_owned(),
        mount_id: id.mount_id(),
        unique: id.is_unique(),
        dev: id.dev(),
        created: handover.created,
        via_fusermount: handover.via_fusermount,
        notify_socket,
        watcher: watcher.is_some(),
        image: args.image.clone(),
        nbd,
        directory,
        backing: neg
            .passthrough
            .as_ref()
            .map(|b| crate::restart::HandedBacking {
                id: b.id(),
                file: b.file(),
            }),
        // Set by `fusex mount`'s side of the restart (`serve::hand_over`): a `fusex serve`
        // daemon hands its stderr over once, with its own state.
        log_stderr: false,
        image_file: neg.image_file,
    };
    Ok(Some(Handing {
        state,
        conn,
        watcher,
        refusal,
    }))
}

/// An export opened, mounted and negotiated: what [`supervise`] serves. Dropping it unmounts.
pub struct Prepared {
    /// Its options (`fusex mount`'s command line, or what `fusex serve` made of a request).
    pub args: MountArgs,
    /// What it serves.
    pub export: Fs,
    pub mnt: Mount,
    pub settled: Settled,
    /// Its queues' statistics, which the supervisor keeps and anyone may read.
    pub stats: Arc<server::ExportStats>,
}

impl Prepared {
    /// What `fusex list` and `query-block-exports` show of it.
    pub fn describe(&self, state: &str) -> crate::runtime::ExportState {
        crate::runtime::ExportState {
            pid: std::process::id(),
            mountpoint: self.mnt.mountpoint().to_string_lossy().into_owned(),
            // The image as a path that means the same from anywhere (an NBD URI or `null:`
            // as given, even if a file of that name happens to be in the working directory).
            image: if backend::names_a_path(&self.args.image) {
                std::fs::canonicalize(&self.args.image).map_or_else(
                    |_| self.args.image.clone(),
                    |p| p.to_string_lossy().into_owned(),
                )
            } else {
                self.args.image.clone()
            },
            format: match &self.export {
                Fs::Image(e) => e.backend().inner().format_description(false).into(),
                Fs::Dir(_) => "directory".into(),
            },
            transport: if self.settled.uring() {
                "io_uring"
            } else {
                "legacy"
            }
            .into(),
            queues: self.settled.queues,
            writable: self.args.writable,
            state: state.into(),
            socket: None,
        }
    }
}

/// Opens the image, mounts it and negotiates INIT: the export is mounted but not yet served.
pub fn setup(args: &MountArgs, argv: Vec<String>, verbose: u8) -> Result<Prepared> {
    if crate::dirmode::is_directory(&args.image) {
        return crate::dirmode::setup(args, argv, verbose);
    }
    if args.growable && !args.writable {
        bail!("--growable needs --writable: add --writable or drop --growable");
    }
    if args.max_size.is_some() && !args.growable {
        bail!("--max-size needs --growable: add --growable or drop --max-size");
    }
    if args.force_share && args.writable {
        bail!(
            "--force-share is for read-only exports (a writer must own the image): drop \
             --force-share, or drop --writable"
        );
    }
    if args.force_share && args.no_locking {
        bail!("--force-share and --no-locking exclude each other: give one of them");
    }
    if args.no_read_ahead {
        bail!(
            "--no-read-ahead is for directory exports ({} is not a directory): drop --no-read-ahead",
            args.image
        );
    }
    if args.cache.is_some() {
        bail!(
            "--cache is for directory exports ({} is not a directory): drop --cache",
            args.image
        );
    }
    let uring_blocked = transport::uring_unavailable_reason();
    if let (TransportArg::Uring, Some(why)) = (args.transport, &uring_blocked) {
        bail!("--transport uring is unavailable: {why}; or use --transport auto");
    }
    let (export, pt) = open_export(args, false)?;
    // Right after the open, for a successor to check that the path still names this file.
    let image_file = crate::restart::image_file(&args.image);
    let may_uring = args.transport != TransportArg::Legacy && uring_blocked.is_none();
    let mut threads = args
        .queues
        .map_or(crate::affinity::allowed_cpus().len(), usize::from);
    let caps = export.backend().capabilities();
    if let Some(details) = export.backend().inner().details() {
        tracing::info!("{details}");
    }
    if let Some((max, why)) = caps.max_queues.filter(|(max, _)| threads > *max) {
        // Queues whose connections need not see each other's writes would break flushes.
        tracing::info!(
            "{why}: serving with {max} queue{}",
            if max == 1 { "" } else { "s" }
        );
        threads = max;
    }
    let Staged {
        demand,
        planned,
        max_write,
        mnt,
        watcher,
    } = plan_and_mount(args, verbose, may_uring, threads, caps.remote, false)?;
    // The mount exists from here on: any error below drops `mnt`, which unmounts.
    // DIRECT_IO_ALLOW_MMAP: without it the kernel refuses MAP_SHARED (ENODEV) on every open
    // answered with FOPEN_DIRECT_IO, i.e. every open that is not passed through.
    let mut want = FUSE_ASYNC_READ | FUSE_ASYNC_DIO | FUSE_BIG_WRITES | FUSE_DIRECT_IO_ALLOW_MMAP;
    if may_uring {
        want |= FUSE_OVER_IO_URING;
    }
    let neg = pt.negotiate_init(
        mnt.fd().context("mount fd")?,
        &InitParams {
            want,
            // No writeback caching for an image: each write reaches the backend before it is
            // answered (with --kernel-cache too).
            want_without_passthrough: 0,
            max_write,
            max_pages: (max_write / 4096) as u16,
            max_background: 1024,
            request_timeout: args.request_timeout,
        },
    )?;
    let backing = pt.finish(
        &neg,
        mnt.fd().context("mount fd")?,
        &export,
        args.direct,
        None,
    )?;
    let uring = neg.has(FUSE_OVER_IO_URING);
    if uring && neg.kernel_has_uring_zero_copy() {
        tracing::info!(
            "kernel FUSE protocol 7.{} offers io_uring zero copy; fusex 7.{} does not use it yet (docs/uring.md)",
            neg.kernel_minor,
            neg.minor
        );
    }
    let why = match (&args.transport, &uring_blocked) {
        _ if uring => "FUSE_OVER_IO_URING negotiated".to_string(),
        (TransportArg::Legacy, _) => "--transport legacy".to_string(),
        (_, Some(why)) => why.clone(),
        (TransportArg::Uring, None) => {
            bail!("--transport uring is unavailable: the kernel did not offer FUSE_OVER_IO_URING in INIT; or use --transport auto")
        }
        (TransportArg::Auto, None) => {
            "the kernel did not offer FUSE_OVER_IO_URING in INIT".to_string()
        }
    };
    // Logged once nothing can refuse the mount any more: a refusal stays one stderr line.
    crate::timeout::log(
        args.request_timeout,
        neg.request_timeout,
        neg.offered & FUSE_REQUEST_TIMEOUT != 0,
    );
    if mnt.via_fusermount() {
        tracing::info!(
            "mounted through {} (fusex may not mount itself)",
            transport::fusermount::FUSERMOUNT
        );
    }
    tracing::info!(
        "transport: {} ({why})",
        if uring {
            "io_uring"
        } else {
            "legacy /dev/fuse"
        }
    );
    let plan = plan_for_transport(planned, demand, uring);
    let buffer_size = memory::buffer_size(neg.max_write as usize);
    tracing::info!(
        "request buffers: {} requests in flight per queue, {} KiB each, {} MiB in all (budget {} MiB)",
        plan.depth,
        buffer_size >> 10,
        (plan.buffers * buffer_size) >> 20,
        plan.budget >> 20
    );
    let announce = format!(
        "mounted {} at {}, format {}",
        args.image,
        mnt.mountpoint().display(),
        export
            .backend()
            .inner()
            .format_description(args.format == crate::cli::FormatArg::Auto)
    );
    let settled = Settled {
        announce: Some(announce),
        negotiated: neg,
        argv,
        plan,
        queues: if uring {
            threads.min(demand.possible_cpus)
        } else {
            threads
        },
        passthrough: backing,
        image_file,
        watcher,
    };
    Ok(Prepared {
        args: args.clone(),
        export: Fs::Image(export),
        mnt,
        settled,
        stats: Default::default(),
    })
}

/// What an image export and a directory export do alike before INIT: the memory plan, and the
/// mount with its `--auto-unmount` watcher.
pub(crate) struct Staged {
    /// What the plan was made for.
    pub demand: Demand,
    /// Planned for io_uring's per-CPU queues if the transport may be io_uring.
    pub planned: MemoryPlan,
    /// The largest request the plan has room for (INIT's `max_write`, the mount's `max_read`).
    pub max_write: u32,
    /// The mount; dropping it unmounts.
    pub mnt: Mount,
    /// The `--auto-unmount` watcher, if asked for.
    pub watcher: Option<crate::watcher::Watcher>,
}

/// Plans the request buffers for `threads` queues (refusing a plan over `--memory-budget` before
/// anything is mounted) and mounts. The `--auto-unmount` watcher starts once the mount exists and
/// before anything can see it (through fusermount3: right after it appeared), so no daemon death
/// leaves the mount behind.
pub(crate) fn plan_and_mount(
    args: &MountArgs,
    verbose: u8,
    may_uring: bool,
    threads: usize,
    latency_bound: bool,
    directory: bool,
) -> Result<Staged> {
    let demand = Demand {
        uring: may_uring,
        threads,
        possible_cpus: crate::affinity::possible_cpus(),
        depth: args.queue_depth.map(usize::from),
        latency_bound,
        budget: args
            .memory_budget
            .map(|b| usize::try_from(b).unwrap_or(usize::MAX)),
    };
    let planned = memory::plan(demand);
    if let Err(why) = memory::check(&planned, &demand) {
        bail!("{why}");
    }
    let max_write = u32::try_from(planned.max_write).unwrap_or(u32::MAX);
    let mut watcher = None;
    let mnt = Mount::establish(
        &MountConfig {
            mountpoint: args.mountpoint.clone(),
            source: args.image.clone(),
            read_only: !args.writable,
            allow_other: args.allow_other,
            max_read: max_write,
            directory,
        },
        &mut |mountpoint, id| {
            watcher = crate::watcher::for_mount(args, mountpoint, id, verbose)?;
            Ok(())
        },
    )?;
    Ok(Staged {
        demand,
        planned,
        max_write,
        mnt,
        watcher,
    })
}

/// The plan for the transport INIT settled on: `planned` was made for io_uring's per-CPU queues
/// where io_uring was possible; the legacy transport needs buffers per thread only.
pub(crate) fn plan_for_transport(planned: MemoryPlan, demand: Demand, uring: bool) -> MemoryPlan {
    if uring || !demand.uring {
        planned
    } else {
        memory::plan(Demand {
            uring: false,
            ..demand
        })
    }
}

/// Opens the image (`takeover`: taking the image locks over from the daemon `fusex restart`
/// replaces) and wraps it in the export; also decides what passthrough to ask for.
pub fn open_export(
    args: &MountArgs,
    takeover: bool,
) -> Result<(Arc<Export<Served>>, crate::passthrough::Plan)> {
    open_export_adopting(args, takeover, None)
}

/// [`open_export`]; with `nbd`, the NBD export a `fusex restart` predecessor negotiated, served
/// without connecting now ([`backend::NbdBackend::adopt`]).
pub fn open_export_adopting(
    args: &MountArgs,
    takeover: bool,
    nbd: Option<nbd::Export>,
) -> Result<(Arc<Export<Served>>, crate::passthrough::Plan)> {
    let io_path = match args.io_path {
        IoPathArg::Auto => None,
        IoPathArg::Ring => Some(IoPath::Ring),
        IoPathArg::Inline => Some(IoPath::Inline),
        IoPathArg::Nowait => Some(IoPath::NowaitThenRing),
        IoPathArg::Adaptive => Some(IoPath::Adaptive),
    };
    backend::qcow2::check_chain(&args.backing)?;
    let options = OpenOptions {
        format: args.format.into(),
        backing: (!args.backing.is_empty()).then(|| args.backing.clone()),
        qcow2_cache: backend::qcow2::CacheOptions {
            l2: args.l2_cache_size,
            refcount: args.refcount_cache_size,
            clean_interval: args.cache_clean_interval,
        },
        no_backing: args.no_backing,
        trust_backing: args.trust_backing,
        writable: args.writable,
        growable: args.growable,
        locking: if args.no_locking {
            Locking::Off
        } else if takeover && !args.force_share {
            Locking::Takeover
        } else if args.force_share {
            Locking::ForceShare
        } else {
            Locking::Exclusive
        },
        direct: args.direct,
        io_path,
        nbd: backend::NbdOptions {
            writable: args.writable,
            fua: args.writethrough,
            timeout: Duration::from_secs_f64(args.nbd_timeout),
            reconnect_delay: Duration::from_secs_f64(args.reconnect_delay),
            adopt: nbd,
        },
        partition: args.partition,
        range: args.byte_range(),
    };
    if args.partition.is_some() && args.growable {
        bail!(
            "a partition of {} cannot grow (the partition table fixes its size): drop --growable",
            args.image
        );
    }
    if options.range.is_some() && args.growable {
        bail!(
            "a byte range of {} cannot grow (--offset and --size fix its size): drop --growable",
            args.image
        );
    }
    let explain = |e| match e {
        backend::OpenError::Lock(l @ backend::LockError::InUse { .. }) => {
            in_use_by_a_dead_mount(&args.image, l)
        }
        e => anyhow::Error::from(e),
    };
    let open = || match (&args.shared_image, args.partition) {
        (Some(shared), Some(n)) => {
            let whole = (shared.0)(&args.image, options)?;
            backend::open_partition(whole, n, &args.image)
        }
        _ => backend::open(&args.image, options),
    };
    let backend = if args.image.starts_with("null:") && args.shared_image.is_none() {
        // Nothing to read: no ring, no thread (a daemon adding and removing null exports paid
        // a thread per open).
        open().map_err(explain)?
    } else {
        // On a thread of its own: opening a qcow2 image reads it through an io_uring of the
        // opening thread, and reads the kernel punts to io-wq fork workers with that thread's
        // full capabilities, which live as long as the thread. This one ends here, so no such
        // worker outlives the privilege drop.
        std::thread::scope(|s| {
            std::thread::Builder::new()
                .name("fusex-open".into())
                .spawn_scoped(s, open)
                .context("starting the thread that opens the image")?
                .join()
                .map_err(|_| anyhow::anyhow!("opening {} panicked", args.image))?
                .map_err(explain)
        })?
    };
    if let AnyBackend::Raw(r) = &backend {
        tracing::debug!(paths = ?r.io_paths(), "raw image data paths");
    }
    let max_size = max_size(args, &backend)?;
    let pt = crate::passthrough::Plan::new(args, &backend)?;
    if !args.fault.is_empty() {
        tracing::info!("fault injection: {:?}", args.fault);
    }
    let export = Arc::new(Export::new(
        Faulty::new(backend, args.fault.clone()),
        ExportConfig {
            writable: args.writable,
            growable: args.growable,
            kernel_cache: args.kernel_cache,
            writethrough: args.writethrough,
            max_size,
            ..ExportConfig::default()
        },
    ));
    Ok((export, pt))
}

/// An image lock conflict, explained when the holder may be a fusex export whose daemon died: its
/// dead mount keeps the image open (the kernel's passthrough file, with its lock bytes) until it is
/// unmounted, and "another process" would send the user looking for a process that does not
/// exist. The dead mounts are those no daemon listens on (the `fusex restart` socket is gone).
fn in_use_by_a_dead_mount(image: &str, e: backend::LockError) -> anyhow::Error {
    use std::os::unix::fs::MetadataExt;
    let file_id = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    let image_id = file_id(Path::new(image));
    let listening = crate::restart::Listening::read();
    let dead: Vec<(String, bool)> = transport::fusex_mounts()
        .into_iter()
        .filter(|m| !listening.daemon_of(m))
        .map(|m| {
            // The source is the image as its daemon was given it (perhaps relative to its
            // directory then): the same file, or at least the same name.
            let source = Path::new(&m.source);
            let same = image_id.is_some() && file_id(source) == image_id
                || !source.is_absolute() && source.file_name() == Path::new(image).file_name();
            (m.mount_point, same)
        })
        .collect();
    let holders: Vec<&str> = dead
        .iter()
        .filter(|(_, same)| *same)
        .map(|(p, _)| p.as_str())
        .collect();
    let umount = |paths: &[&str]| {
        paths
            .iter()
            .map(|p| format!("fusex umount {p}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    match holders.as_slice() {
        [] if dead.is_empty() => anyhow::Error::from(e),
        [] => {
            let all: Vec<&str> = dead.iter().map(|(p, _)| p.as_str()).collect();
            anyhow::anyhow!(
                "{e}; fusex exports whose daemon is gone may hold it: {} frees them",
                umount(&all)
            )
        }
        [one] => anyhow::anyhow!(
            "{image} is held by the dead fusex mount at {one} (its daemon is gone; the mount \
             keeps the image open and locked): {} frees it",
            umount(&[one])
        ),
        many => anyhow::anyhow!(
            "{image} is held by dead fusex mounts at {} (their daemons are gone; the mounts \
             keep the image open and locked): {} frees them",
            many.join(", "),
            umount(many)
        ),
    }
}

/// How large a growable export may grow: `--max-size`, checked against what the image's
/// filesystem (or format) can hold and against the image's current size.
fn max_size(args: &MountArgs, backend: &AnyBackend) -> Result<u64> {
    let limit = backend.size_limit();
    let Some(want) = args.max_size else {
        return Ok(limit);
    };
    if want > limit {
        bail!(
            "--max-size {want} is more than {} can grow to ({limit} bytes): give at most that",
            args.image
        );
    }
    if want < backend.size() {
        bail!(
            "--max-size {want} is less than {}'s current size ({} bytes): give at least that",
            args.image,
            backend.size()
        );
    }
    Ok(want)
}

/// What the rest of the daemon's life needs privileges for (see `crate::privileges`): the
/// paths its exit path acts on, and whether SETATTR sets times on an image another user owns.
pub fn exit_needs(args: &MountArgs, export: &Fs, mnt: &Mount) -> Needs {
    let mut paths = Vec::new();
    let mountpoint_dir = Needs::parent(mnt.mountpoint());
    if mnt.created_mountpoint() {
        paths.push((mountpoint_dir, Access::Modify));
    } else {
        paths.push((mountpoint_dir, Access::Search));
    }
    if let Some(p) = &args.pid_file {
        paths.push((Needs::parent(p), Access::Modify));
        paths.push((p.clone(), Access::Read));
    }
    if let Some(p) = &args.stats_file {
        paths.push((Needs::parent(p), Access::Modify));
        if p.exists() {
            paths.push((p.clone(), Access::Write));
        }
    }
    let foreign_image_owner = match export.image().filter(|e| e.config().writable) {
        Some(export) => export.backend().inner().owner().filter(|&uid| {
            // SAFETY: geteuid has no preconditions.
            uid != unsafe { libc::geteuid() }
        }),
        None => None,
    };
    Needs {
        paths,
        foreign_image_owner,
        exits_through_setuid_helper: mnt.via_fusermount(),
    }
}

/// Request sources for each queue thread.
pub(crate) fn sources(
    mnt: &mut Mount,
    threads: usize,
    uring: bool,
    depth: usize,
    handoff: server::Handoff,
) -> Result<Vec<Source>> {
    let fd = mnt.take_fd().context("mount fd")?;
    if !uring {
        let mut v = Vec::with_capacity(threads);
        for _ in 1..threads {
            v.push(Source::Legacy(clone_fd(fd.as_raw_fd())?));
        }
        v.insert(0, Source::Legacy(fd));
        return Ok(v);
    }
    // One kernel queue per possible CPU; thread t serves qids t, t+threads, ...
    let legacy = clone_fd(fd.as_raw_fd())?;
    let qids = crate::affinity::possible_cpus();
    let fd = Arc::new(fd);
    let mut legacy = Some(legacy);
    let crew = server::Crew::new(threads, qids, depth, handoff);
    Ok((0..threads)
        .map(|t| Source::Uring {
            fd: fd.clone(),
            qids: (t..qids).step_by(threads).map(|q| q as u16).collect(),
            legacy: legacy.take(),
            crew: crew.clone(),
        })
        .collect())
}

/// What a supervised export ended with.
pub struct Ended {
    /// The counters (`--stats-file`'s content).
    pub stats: serde_json::Value,
    /// The process a `fusex restart` handed the export to.
    pub handed_to: Option<u32>,
}

/// How [`supervise`]'s driver sets it up.
pub struct Supervision {
    /// What every thread of the export keeps of the process's privileges (applied by each queue
    /// thread before it serves, and by the supervisor once they all do).
    pub privileges: Plan,
    /// The sending side of the supervisor's events, which the driver hands out (signals, the
    /// restart listener, a control socket); the queues report through a clone.
    pub tx: mpsc::Sender<Event>,
    pub rx: mpsc::Receiver<Event>,
}

/// Where `start_queues` started an export's queues. Kept so that an export that ended
/// normally on threads of its own waits for them to be gone before it says so.
pub struct Queues(crate::workers::Placement);

impl Queues {
    /// Every queue has reported `Ended` or `Failed` as its last act: threads of the export's
    /// own end now (shared ones serve on).
    fn join(self) {
        if self.0.private {
            self.0.workers.shut_down();
        }
    }

    /// The export ends while a queue may still wait for a connection that ends only as the
    /// process exits: its own threads are left to that.
    fn abandon(self) {
        if self.0.private {
            std::mem::forget(self.0.workers);
        }
    }
}

/// Starts `p`'s queues, which report through `report`; `stop` set (and their `Started` tasks
/// woken) makes them stop taking requests. The one place that decides which threads serve an
/// export's requests: threads of its own, or the process's shared ones where `shared` and the
/// export's options allow ([`crate::workers`]).
fn start_queues(
    p: &mut Prepared,
    stop: &Arc<AtomicBool>,
    privileges: Plan,
    report: Report,
    shared: bool,
) -> Result<Queues> {
    let (args, export, mnt, neg) = (&p.args, &p.export, &mut p.mnt, &p.settled);
    let nq = neg.queues;
    let handoff = args.handoff.into();
    let sources = sources(mnt, nq, neg.uring(), neg.plan.depth, handoff)?;
    // The most request buffers one queue has (queue 0 of io_uring also reads /dev/fuse).
    let slots = sources
        .iter()
        .map(|s| match s {
            Source::Uring { qids, legacy, .. } => {
                qids.len() * neg.plan.depth
                    + legacy.as_ref().map_or(0, |_| memory::URING_LEGACY_SLOTS)
            }
            Source::Legacy(_) => neg.plan.depth,
        })
        .max()
        .unwrap_or(0);
    let mut jobs = Vec::with_capacity(nq);
    for (id, source) in sources.into_iter().enumerate() {
        let spec = QueueSpec {
            id,
            source,
            depth: neg.plan.depth,
            max_write: neg.negotiated.max_write as usize,
            multishot: args.legacy_read != crate::cli::LegacyReadArg::Poll,
            fixed_files: export
                .image()
                .filter(|_| args.fixed_files == crate::cli::OnOff::On)
                .map(|e| e.backend().inner().io_fds()),
            splice_min: args.splice_min as usize,
            latency: args.latency == OnOff::On,
            stats: p.stats.clone(),
            fallback_slots: memory::URING_LEGACY_SLOTS,
            before_serving: Box::new(move || privileges.apply()),
        };
        jobs.push(match export {
            Fs::Image(e) => server::queue::job(spec, e.clone(), stop.clone(), report.clone()),
            Fs::Dir(d) => server::queue::job(spec, d.clone(), stop.clone(), report.clone()),
        });
    }
    let placement = crate::workers::place(args, jobs, slots, neg.uring(), shared)?;
    Ok(Queues(placement))
}

/// How long a supervisor whose export is flushed and whose connection is aborted waits for its
/// queues to end before it gives up on them.
const QUEUES_END_TIMEOUT: Duration = Duration::from_secs(10);

/// What [`Supervisor::next_wakeup`] says while the supervisor waits for [`Event::Taken`]: it
/// has nothing to do on its own meanwhile.
const AWAITING_ANSWER: Duration = Duration::from_secs(3600);

/// One export's supervisor, as a state machine its driver feeds: [`supervise`] drives one on the
/// calling thread (`fusex mount`), `fusex serve` drives all of its exports' from one thread. It
/// reacts to [`Event`]s ([`Supervisor::handle`]) and to time passing without one
/// ([`Supervisor::tick`], due [`Supervisor::next_wakeup`] after the last call); once
/// [`Supervisor::done`], [`Supervisor::finish`] ends the export. Every method takes the export's
/// [`Prepared`], the one [`Supervisor::start`] started, which the driver keeps.
///
/// No method blocks for long: the ones that flush the image or unmount (a stop's end, a
/// hand-over) take as long as that takes, and a hand-over to a `fusex serve` successor waits for
/// the daemon's answer as an [`Event::Taken`] rather than on a channel of its own.
pub struct Supervisor {
    /// Applied to the supervising thread once every queue serves.
    privileges: Plan,
    /// Set to make the queues stop taking requests (see `stop_all`).
    stop: Arc<AtomicBool>,
    /// The supervisor's own fd of the connection, to tell the kernel when the image changes size
    /// behind the export.
    notify_fd: Option<std::os::fd::OwnedFd>,
    /// The image's size as last seen.
    known_size: u64,
    /// The backend's trouble as last said to the owner.
    trouble: Option<String>,
    queues: Queues,
    /// How to wake each queue's watcher task.
    remotes: Vec<(engine::Remote, engine::TaskId)>,
    /// SIGUSR1 dumps written so far.
    dumps: u64,
    /// Queues not yet ended, queues that reported `Started`, queues quiet after a stop.
    running: usize,
    started: usize,
    quiet: usize,
    /// Each ended queue's line of loop counters.
    per_queue: Vec<serde_json::Value>,
    /// The first reason the export failed.
    failure: Option<String>,
    /// The final flush's outcome, once it ran (or, with `flush_at_end`, once the connection was
    /// aborted: the flush itself comes in [`Supervisor::finish`]).
    flushed: Option<Result<bool>>,
    /// `fusex serve`: the final flush runs in [`Supervisor::finish`], which the service calls
    /// on a thread of its own, not where this supervisor handles its events (the exports'
    /// thread, shared by every export, which a slow disk's flush would hold up). The queues are
    /// quiet when it is due, so flushing after the abort leaves nothing unflushed.
    flush_at_end: bool,
    /// `fusex restart`: the successor waiting for this export to let go, and its pid.
    successor: Option<(ReleaseTo, u32)>,
    /// The successor that serves the export now.
    handed_to: Option<u32>,
    /// After a signal with the export detached: when its grace period ends (`--stop-timeout`).
    draining: Option<Instant>,
    /// A detached export is aborted while applications hold it: once the queues are quiet and
    /// the image is flushed, the supervisor is done and the process exits, which ends the
    /// connection (the detached mount can no longer be force-unmounted by path).
    abandon: bool,
    /// A stop that came while queues were starting, acted on once they all serve (so that the
    /// files already open on the export are counted and served, not aborted).
    deferred: Option<Stop>,
    /// A `fusex restart` that asked while queues were starting, answered once they all serve.
    early_release: Option<Event>,
    /// Whether the owner heard `stopping` and `not_serving`.
    stopping_sent: bool,
    not_serving_sent: bool,
    /// The successor (its pid) this export let go for, until the daemon answers whether it took
    /// the exports ([`Event::Taken`]).
    answer: Option<u32>,
    /// Events that came meanwhile, handled once the answer came, in their order.
    held: VecDeque<Event>,
    /// Done before every queue ended (they did not end in time, or nothing can reach the
    /// supervisor any more).
    broke: bool,
}

impl Supervisor {
    /// Starts the queues of `p`, which report through `report` (each of their events to be
    /// handed to [`Supervisor::handle`] as an [`Event::Queue`]), on the process's shared
    /// threads where `shared` and the export's options allow.
    pub fn start(
        p: &mut Prepared,
        privileges: Plan,
        report: Report,
        shared: bool,
    ) -> Result<Supervisor> {
        let stop = Arc::new(AtomicBool::new(false));
        let notify_fd = match p.mnt.fd() {
            Some(fd) => Some(clone_fd(fd.as_raw_fd())?),
            None => None,
        };
        let known_size = p.export.image().map_or(0, |e| e.backend().size());
        let queues = start_queues(p, &stop, privileges, report, shared)?;
        Ok(Supervisor {
            privileges,
            stop,
            notify_fd,
            known_size,
            trouble: None,
            queues,
            remotes: Vec::new(),
            dumps: 0,
            running: p.settled.queues,
            started: 0,
            quiet: 0,
            per_queue: Vec::new(),
            failure: None,
            flushed: None,
            flush_at_end: shared,
            successor: None,
            handed_to: None,
            draining: None,
            abandon: false,
            deferred: None,
            early_release: None,
            stopping_sent: false,
            not_serving_sent: false,
            answer: None,
            held: VecDeque::new(),
            broke: false,
        })
    }

    /// Whether the export is over: every queue ended, or the supervisor gave up on them. Events
    /// handed in after that are dropped.
    pub fn done(&self) -> bool {
        self.broke || (self.running == 0 && self.answer.is_none())
    }

    /// How long after the last [`Supervisor::handle`] or [`Supervisor::tick`] the next tick is
    /// due if no event comes: a second while serving (the image size check), the time the
    /// queues have to end once the export is flushed and aborted.
    pub fn next_wakeup(&self) -> Duration {
        if self.answer.is_some() {
            AWAITING_ANSWER
        } else if self.flushed.is_some() {
            QUEUES_END_TIMEOUT
        } else {
            SIZE_CHECK_INTERVAL
        }
    }

    /// Handles one event, then whatever it made due (a deferred stop or restart, a passed
    /// `--stop-timeout`).
    pub fn handle(&mut self, p: &mut Prepared, ev: Event, owner: &mut dyn Owner) {
        if self.done() {
            return;
        }
        if let Some(pid) = self.answer {
            match ev {
                Event::Taken(taken) => {
                    self.answer = None;
                    let told = if taken {
                        Ok(())
                    } else {
                        Err(std::io::Error::other(
                            "the successor did not take the exports",
                        ))
                    };
                    self.told(p, pid, told, owner);
                    self.settle(p, owner);
                    for ev in std::mem::take(&mut self.held) {
                        self.handle(p, ev, owner);
                    }
                }
                ev => self.held.push_back(ev),
            }
            return;
        }
        if matches!(ev, Event::Taken(_)) {
            // Nothing asked: not for this export.
            return;
        }
        self.step(p, ev, owner);
        self.settle(p, owner);
    }

    /// No event came for [`Supervisor::next_wakeup`]: follow the image's size and the backend's
    /// trouble, or, once flushed, give up on queues that did not end.
    pub fn tick(&mut self, p: &mut Prepared, owner: &mut dyn Owner) {
        if self.done() || self.answer.is_some() {
            return;
        }
        if self.flushed.is_some() {
            self.closed(p);
            return;
        }
        let Some(export) = p.export.image() else {
            // A directory has no size to follow and no connection to lose.
            self.settle(p, owner);
            return;
        };
        follow_image_size(export, self.notify_fd.as_ref(), &mut self.known_size);
        export.backend().drop_unused();
        // Said when it starts and when it ends, not at each new reason between.
        let now = export.backend().trouble();
        if now.is_some() != self.trouble.is_some() {
            owner.trouble(now.as_deref());
        }
        self.trouble = now;
        self.settle(p, owner);
    }

    /// Nothing can send the supervisor events any more (or, once flushed, the queues had their
    /// time to end): it is done, and queues that did not end by now after the final flush are a
    /// failure.
    pub fn closed(&mut self, p: &Prepared) {
        if self.flushed.is_some() {
            self.failure.get_or_insert(if p.mnt.via_fusermount() {
                // fusermount3 -u could only detach a mount applications hold open.
                "queues did not end after the unmount: applications still hold the export \
                 open, and without CAP_SYS_ADMIN fusex cannot abort the connection (it ends as \
                 fusex exits now)"
                    .into()
            } else {
                "queues did not end after the connection was aborted".into()
            });
        }
        self.broke = true;
    }

    /// What is due before the supervisor waits again: the `--stop-timeout` deadline, and a
    /// deferred stop or restart once every queue serves.
    fn settle(&mut self, p: &mut Prepared, owner: &mut dyn Owner) {
        while !self.done() && self.answer.is_none() {
            // Checked at least once a second (a tick is due that often).
            if !self.abandon && self.draining.is_some_and(|d| Instant::now() >= d) {
                self.abandon = true;
                log_abort(
                    &format!("--stop-timeout ({} s) passed", p.args.stop_timeout),
                    &p.export,
                );
                // The queues report Quiesced, and the check after that event ends the export.
                self.stop_all();
            }
            let all_started = self.started == p.settled.queues;
            let ev = if let Some(s) = self.deferred.filter(|_| all_started) {
                self.deferred = None;
                Event::Stop(s)
            } else if let Some(r) = self.early_release.take_if(|_| all_started) {
                r
            } else {
                return;
            };
            self.step(p, ev, owner);
        }
    }

    /// Every queue is quiet: the image is flushed (now, or with `flush_at_end` in
    /// [`Supervisor::finish`]) and the connection aborted, which ends the queues.
    fn end_connection(&mut self, p: &mut Prepared) {
        finish(&mut self.flushed, &p.export, &mut p.mnt, !self.flush_at_end);
    }

    /// Tells every queue to stop taking requests.
    fn stop_all(&self) {
        self.stop.store(true, Ordering::Release);
        for (r, t) in &self.remotes {
            r.wake(*t);
        }
    }

    /// One event, and what follows it: the owner hears the export no longer serves, and once
    /// every queue is quiet after a stop the export is flushed and ended, or let go.
    fn step(&mut self, p: &mut Prepared, ev: Event, owner: &mut dyn Owner) {
        let nq = p.settled.queues;
        match ev {
            Event::Queue(QueueEvent::Started { remote, task, .. }) => {
                self.remotes.push((remote, task));
                if self.stop.load(Ordering::Acquire) {
                    self.stop_all();
                }
                self.started += 1;
                if self.started == nq {
                    // Every queue thread has dropped its privileges before it reported; the
                    // driver's threads did at their start. This thread is the last one.
                    match self.privileges.apply() {
                        Ok(()) => {
                            if let Some(kept) = self.privileges.kept() {
                                tracing::info!(
                                    "privileges: every thread keeps only {kept} (the rest is \
                                     dropped, no_new_privs is set)"
                                );
                            }
                            // Published before readiness: `fusex list` after a `--daemonize`
                            // parent returns (or systemd's READY) shows the export serving.
                            owner.state("serving");
                            owner.serving();
                        }
                        Err(e) => {
                            let msg = format!("cannot drop privileges: {e}");
                            owner.failed(&msg);
                            self.failure.get_or_insert(msg);
                            self.stop_all();
                        }
                    }
                }
            }
            Event::Queue(QueueEvent::Failed { id, error }) => {
                self.running -= 1;
                self.quiet += 1;
                let msg = format!("queue {id} failed to start: {error}");
                if self.started < nq {
                    owner.failed(&msg);
                }
                self.failure.get_or_insert(msg);
                self.stop_all();
            }
            Event::Queue(QueueEvent::Quiesced) => self.quiet += 1,
            Event::Queue(QueueEvent::Ended { id, report }) => {
                self.running -= 1;
                p.stats.ended(id, &report.counters);
                self.per_queue.push(serde_json::json!({
                    "queue": id,
                    "requests": report.counters.requests(),
                    "enters": report.engine.enters,
                    "completions": report.engine.completions,
                    "polls": report.engine.polls,
                    "remote_wakes": report.engine.remote_wakes,
                    "dev_fuse_read": report.dev_fuse_read,
                    "entries": report.entries,
                }));
                if let Some(e) = report.error {
                    self.failure.get_or_insert(format!("queue {id}: {e}"));
                }
                // One queue ending (connection gone, or an error) ends the export.
                self.stop_all();
            }
            Event::Stop(how) => self.stop_event(p, how, owner),
            Event::Dump => {
                self.dumps += 1;
                dump_live(p, self.dumps);
            }
            Event::Release { to, pid, accepted } => {
                if self.stop.load(Ordering::Acquire)
                    || self.draining.is_some()
                    || self.failure.is_some()
                {
                    if let ReleaseTo::Stream(stream) = &to {
                        let _ = crate::restart::send(
                            stream,
                            &crate::restart::Message::Refused {
                                error: "the daemon is stopping".into(),
                            },
                            &[],
                        );
                    }
                    let _ = accepted.send(false);
                } else if self.started < nq {
                    // Too early to let go: the queues are still starting. Answered once they
                    // all serve (or refused then if a stop came first).
                    tracing::info!(
                        "restart: process {pid} asked while the queues start; handing over once \
                         they serve"
                    );
                    self.early_release = Some(Event::Release { to, pid, accepted });
                } else {
                    let _ = accepted.send(true);
                    tracing::info!(
                        "restart: process {pid} takes the export over; finishing in-flight \
                         requests"
                    );
                    owner.reloading();
                    // The successor reports ready and stopping from here on.
                    self.stopping_sent = true;
                    self.successor = Some((to, pid));
                    self.stop_all();
                }
            }
            // Handled by `handle` (only while an answer is awaited).
            Event::Taken(_) => {}
        }
        if (self.stop.load(Ordering::Acquire) || self.draining.is_some())
            && !std::mem::replace(&mut self.not_serving_sent, true)
        {
            owner.not_serving();
        }
        // A backend whose connections flush as they close (NBD) lets go only once every queue
        // ended: its connections are closed then, so a server that takes one client at a time
        // accepts the successor's.
        let let_go = self.running == 0
            || !p
                .export
                .image()
                .is_some_and(|e| e.backend().capabilities().flushes_on_close);
        if self.stop.load(Ordering::Acquire)
            && self.quiet >= nq
            && (let_go || self.successor.is_none())
        {
            if let Some((to, pid)) = self.successor.take() {
                // Named the main process before it is told it may serve: a service manager must
                // hear that before the successor's own READY=1.
                owner.main_process(pid);
                self.release(p, to, pid, owner);
            } else {
                self.end_connection(p);
                if self.abandon {
                    // Every request taken is answered and the image flushed; the connection
                    // ends as this process exits.
                    self.broke = true;
                }
            }
        }
    }

    /// [`Event::Stop`].
    fn stop_event(&mut self, p: &mut Prepared, how: Stop, owner: &mut dyn Owner) {
        let (args, export, mnt) = (&p.args, &p.export, &mut p.mnt);
        let name = how.name();
        if !std::mem::replace(&mut self.stopping_sent, true) {
            owner.stopping();
            // With the writeback cache, pages of files still open would go with the connection
            // when it is aborted: have the kernel write them back first (a signal's stop).
            if let (Fs::Dir(fs), Stop::Signal(_)) = (export, how) {
                if fs.writeback() {
                    crate::dirmode::write_back_before_stop(mnt.mountpoint());
                }
            }
        }
        let stopped = self.stop.load(Ordering::Acquire);
        if self.draining.is_some() {
            // A second signal, or a removal: abort the files still open.
            if !self.abandon {
                self.abandon = true;
                let why = match how {
                    Stop::Signal(_) => format!("{name} again"),
                    _ => name,
                };
                log_abort(&why, export);
                self.stop_all();
            }
        } else if self.started < p.settled.queues && !stopped {
            self.deferred = Some(how);
        } else if how == Stop::Hard {
            // Abort the connection first: what the queues have taken is answered into a
            // connection that is gone, and waits for nothing.
            if export.open_files() > 0 {
                log_abort(&name, export);
            } else {
                tracing::info!("{name}: aborting the connection and unmounting");
            }
            if let Err(e) = mnt.abort() {
                tracing::error!("{e}");
            }
            self.stop_all();
        } else if stopped || how == Stop::Safe || args.stop_timeout == 0 {
            // Already ending (a queue failed or ended), a removal, or no grace: end it now,
            // aborting the connection (a forced unmount) once the queues answered what they
            // took.
            if export.open_files() > 0 && !stopped {
                let why = match how {
                    Stop::Signal(_) => format!("{name} with --stop-timeout 0"),
                    _ => name,
                };
                log_abort(&why, export);
            } else {
                tracing::info!("{name}: finishing in-flight requests and unmounting");
            }
            self.stop_all();
        } else {
            self.draining = Some(detach(&name, export, mnt, args.stop_timeout));
            let open = export.open_files();
            if open > 0 {
                owner.state(&format!("stopping ({open} open)"));
            }
        }
    }

    /// `fusex restart`, the old daemon's side once every queue is quiet: flush a writable image,
    /// then tell the successor it may serve (`fusex mount`), or tell the daemon how many files
    /// are open and hear back through [`Event::Taken`] whether its successor took the exports
    /// (`fusex serve`). The connection is left alone (the successor holds it).
    fn release(&mut self, p: &mut Prepared, to: ReleaseTo, pid: u32, owner: &mut dyn Owner) {
        let f = final_flush(&p.export);
        if let Err(e) = &f {
            // The successor serves the same file through the same page cache; durability is
            // what its own FLUSH and FSYNC requests decide. Said, not fatal.
            tracing::error!("restart: {e:#}");
        }
        self.flushed = Some(f);
        // The files open now are the successor's to count down as their RELEASEs reach it.
        let open_files = p.export.open_files();
        let told = match to {
            // A directory export's tables go first (they hold still: the queues let go).
            ReleaseTo::Stream(stream) => match &p.export {
                Fs::Dir(d) => crate::dirtable::send_dir(&stream, "", d),
                Fs::Image(_) => Ok(()),
            }
            .and_then(|()| {
                crate::restart::send(
                    &stream,
                    &crate::restart::Message::Released { open_files },
                    &[],
                )
            }),
            ReleaseTo::Channel(tx) => match tx.send(Released {
                open_files,
                dir: match &p.export {
                    Fs::Dir(d) => Some(d.clone()),
                    Fs::Image(_) => None,
                },
            }) {
                Ok(()) => {
                    self.answer = Some(pid);
                    return;
                }
                Err(e) => Err(std::io::Error::other(e)),
            },
        };
        self.told(p, pid, told, owner);
    }

    /// Whether the successor `pid` could be told it may serve: it does now, or (it is gone) the
    /// export ends as a stop would.
    fn told(
        &mut self,
        p: &mut Prepared,
        pid: u32,
        told: std::io::Result<()>,
        owner: &mut dyn Owner,
    ) {
        match told {
            Ok(()) => {
                self.handed_to = Some(pid);
                owner.handed_over(pid);
            }
            Err(e) => {
                tracing::error!(
                    "restart: cannot tell process {pid} it may serve ({e}); unmounting"
                );
                // Nobody took the export: end it as a stop would.
                owner.main_process(std::process::id());
                self.end_connection(p);
            }
        }
    }

    /// Ends the export (flushed and aborted unless handed over) and says how it went: its
    /// statistics, or why it failed. Waits for the queue threads of an export that ended
    /// normally (they have reported their end already).
    pub fn finish(self, p: &mut Prepared, owner: &mut dyn Owner) -> Result<Ended> {
        let Supervisor {
            queues,
            failure,
            mut per_queue,
            mut flushed,
            flush_at_end,
            handed_to,
            abandon,
            stopping_sent,
            not_serving_sent,
            ..
        } = self;
        if !stopping_sent {
            owner.stopping();
        }
        if !not_serving_sent {
            owner.not_serving();
        }
        if handed_to.is_none() {
            // With `flush_at_end`, a connection already ended left its flush to now.
            let deferred = flush_at_end && flushed.is_some();
            finish(&mut flushed, &p.export, &mut p.mnt, true);
            if deferred {
                flushed = Some(final_flush(&p.export));
            }
        }
        if failure.is_none() && !abandon {
            queues.join();
        } else {
            queues.abandon();
        }
        // Queues that ended gave their final counts; an abandoned export's others are read
        // from their live counters.
        let total = p.stats.total();
        if abandon {
            per_queue = p
                .stats
                .queues()
                .iter()
                .map(|(id, s)| serde_json::json!({ "queue": id, "requests": s.requests() }))
                .collect();
        }
        per_queue.sort_by_key(|q| q["queue"].as_u64());
        tracing::info!("served {} requests", total.requests());
        let flushed = flushed.unwrap_or(Ok(false));
        if let Some(pid) = handed_to {
            // The successor serves the mount: an error now must not make this process take it
            // down.
            if let Some(f) = failure {
                tracing::error!("after handing over to process {pid}: {f}");
            }
            return Ok(Ended {
                stats: total.to_json(),
                handed_to,
            });
        }
        if let Some(f) = failure {
            bail!(f);
        }
        let mut json = total.to_json();
        // The exit flush is reported on its own, so `backend.flushes` counts exactly the flushes
        // that requests (FLUSH, FSYNC, --writethrough) caused.
        json["exit_flush"] = (*flushed.as_ref().unwrap_or(&false)).into();
        flushed?;
        json["queues"] = serde_json::Value::Array(per_queue);
        json["transport"] = if p.settled.uring() {
            "io_uring"
        } else {
            "legacy"
        }
        .into();
        if let Fs::Dir(_) = &p.export {
            json["directory"] = true.into();
        }
        Ok(Ended {
            stats: json,
            handed_to,
        })
    }
}

/// Serves `p` until it stops (asked to, by an [`Event::Stop`], or because its connection or a
/// queue ended) or is handed to a successor; on the way out the image is flushed and the
/// connection aborted (unless handed over). Returns once every queue has ended. A [`Supervisor`]
/// driven on the calling thread.
pub fn supervise(p: &mut Prepared, sup: Supervision, owner: &mut dyn Owner) -> Result<Ended> {
    let Supervision { privileges, tx, rx } = sup;
    // The queues hold the only senders the supervisor made; once they all ended, and the
    // driver's are gone, nothing can reach it any more.
    let report: Report = Arc::new(move |e| {
        let _ = tx.send(Event::Queue(e));
    });
    let mut s = Supervisor::start(p, privileges, report, false)?;
    while !s.done() {
        match rx.recv_timeout(s.next_wakeup()) {
            Ok(ev) => s.handle(p, ev, owner),
            Err(mpsc::RecvTimeoutError::Timeout) => s.tick(p, owner),
            Err(mpsc::RecvTimeoutError::Disconnected) => s.closed(p),
        }
    }
    s.finish(p, owner)
}

/// Ends a supervised export that was not handed over: unmounts (again, for the early-return
/// paths), releases the `--auto-unmount` watcher only then, and writes `--stats-file`.
pub fn conclude(p: Prepared, result: Result<Ended>) -> Result<()> {
    let Prepared {
        args,
        export,
        mut mnt,
        settled,
        ..
    } = p;
    let unmounted = mnt.unmount();
    drop(mnt);
    // Only now: releasing the --auto-unmount watcher while the mount is up would let it unmount.
    drop(settled);
    if result.is_ok() {
        release(export);
    }
    let ended = result?;
    if let Some(p) = &args.stats_file {
        crate::files::replace(p, &serde_json::to_vec_pretty(&ended.stats)?, 0o644)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    unmounted?;
    Ok(())
}

/// How long [`release`] waits for the queues to let go of an export.
const RELEASE_WAIT: Duration = Duration::from_secs(2);

/// Drops `export` once nothing else holds it, so that its image is closed (and its locks
/// released) when the export is reported gone: a queue on a shared thread reports its end just
/// before that thread drops the queue's state, and whoever hears of the end next (a QMP client
/// told `BLOCK_EXPORT_DELETED`, then `qemu-img` opening the image) must find it closed. Waits at
/// most [`RELEASE_WAIT`] (an export whose queues ended normally; a failed one's may be left
/// holding it until the process exits).
fn release(export: Fs) {
    let held = || match &export {
        Fs::Image(e) => Arc::strong_count(e),
        Fs::Dir(d) => Arc::strong_count(d),
    };
    let since = Instant::now();
    let mut pause = Duration::from_micros(20);
    while held() > 1 {
        if since.elapsed() >= RELEASE_WAIT {
            tracing::warn!(
                "the export's queues still hold it {} ms after they ended: its image closes \
                 when they let go",
                RELEASE_WAIT.as_millis()
            );
            break;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(5));
    }
    drop(export);
}

/// How often the supervisor looks at the image's size (the kernel's attribute timeout, so
/// `stat` through the export is never staler than it would be anyway).
const SIZE_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// Re-reads the image's size; when another program changed it, logs that and tells the kernel
/// to drop its cached attributes and pages, so applications see the new size at once. A
/// fixed-size export's writes then stop at the new end (ENOSPC past it).
fn follow_image_size(
    export: &Export<Served>,
    notify_fd: Option<&std::os::fd::OwnedFd>,
    known: &mut u64,
) {
    use std::os::fd::AsFd;
    let Ok(now) = export.backend().refresh_size() else {
        return;
    };
    if now == *known {
        return;
    }
    if !export.config().growable || now < *known {
        tracing::info!("the image changed size: {} -> {now} bytes", *known);
    }
    *known = now;
    if let Some(fd) = notify_fd {
        if let Err(e) = transport::notify_inval_inode(fd.as_fd(), fuse_abi::ROOT_ID) {
            tracing::debug!("cannot tell the kernel the new size: {e}");
        }
    }
}

/// SIGUSR1: the counters as they stand, written to `--stats-file` (replaced whole, so a reader
/// never sees half a file) or, without one, logged. `dump` numbers the dumps so a reader can tell
/// a fresh one from the last.
fn dump_live(p: &Prepared, dump: u64) {
    let (args, uring) = (&p.args, p.settled.uring());
    let mut total = Snapshot::default();
    let mut queues = Vec::new();
    for (id, s) in p.stats.queues() {
        total.merge(&s);
        queues.push(serde_json::json!({ "queue": id, "requests": s.requests() }));
    }
    // A directory export says what it holds whether or not the figures go to a file.
    if let Fs::Dir(fs) = &p.export {
        tracing::info!(
            "statistics: {} requests so far, {} nodes held ({} by descriptor), {} files open",
            total.requests(),
            fs.nodes(),
            fs.pinned_nodes(),
            fs.open_files()
        );
    }
    let Some(path) = &args.stats_file else {
        if let Fs::Image(_) = &p.export {
            tracing::info!("statistics: {} requests so far", total.requests());
        }
        return;
    };
    let mut json = total.to_json();
    json["live"] = true.into();
    json["dump"] = dump.into();
    json["queues"] = serde_json::Value::Array(queues);
    json["transport"] = if uring { "io_uring" } else { "legacy" }.into();
    let written = serde_json::to_vec_pretty(&json)
        .map_err(std::io::Error::other)
        .and_then(|bytes| crate::files::replace(path, &bytes, 0o644));
    if let Err(e) = written {
        tracing::warn!("cannot write statistics to {}: {e}", path.display());
    }
}

/// The first stop signal: detaches the export lazily, as `fusex umount` does on a busy export, so
/// that nothing new can open it while the files open on it are served until they are closed (the
/// kernel ends the connection after the last one, and the queues with it). Returns when the grace
/// period ends.
fn detach(name: &str, export: &Fs, mnt: &mut Mount, grace: u32) -> Instant {
    if let Err(e) = mnt.unmount() {
        tracing::warn!("{name}: cannot detach the export: {e}");
    }
    match export.open_files() {
        0 => tracing::info!("{name}: unmounted; finishing in-flight requests"),
        n if grace > 0 => tracing::info!(
            "{name}: {n} file{} still open on the export (a loop device, a filesystem mounted on \
             it, a program): unmounted it and serving {} until closed; a second signal, or \
             --stop-timeout in {grace} s, aborts {}",
            if n == 1 { " is" } else { "s are" },
            if n == 1 { "it" } else { "them" },
            if n == 1 { "it" } else { "them" },
        ),
        _ => {}
    }
    Instant::now() + Duration::from_secs(grace.into())
}

/// Says what aborting the export means for the applications that still hold it open.
fn log_abort(why: &str, export: &Fs) {
    let n = export.open_files();
    if n == 0 {
        // Nothing open, yet the connection did not end: the export is mounted elsewhere too (a
        // bind mount), or a file is being opened right now.
        tracing::warn!(
            "{why}: aborting the export: no file is open on it, but its connection has not ended \
             (is it bind-mounted elsewhere?); what still uses it now gets ENOTCONN"
        );
        return;
    }
    tracing::warn!(
        "{why}: aborting the export with {n} file{} still open: finishing the requests already \
         taken, flushing the image and exiting; from then on reads and writes on {} fail with \
         ENOTCONN (Transport endpoint is not connected), and what the applications had not yet \
         written is lost (a filesystem mounted on the export sees I/O failures)",
        if n == 1 { "" } else { "s" },
        if n == 1 { "it" } else { "them" },
    );
}

/// Ends the export once every queue answered what it had taken: flush (unless not
/// `flush_now`: then `flushed` says `Ok(false)` until [`Supervisor::finish`] flushes), then
/// abort the connection and unmount (which also ends io_uring queues, whose entries then
/// complete).
fn finish(flushed: &mut Option<Result<bool>>, export: &Fs, mnt: &mut Mount, flush_now: bool) {
    if flushed.is_none() {
        *flushed = Some(if flush_now {
            final_flush(export)
        } else {
            Ok(false)
        });
        if let Err(e) = mnt.abort() {
            tracing::error!("{e}");
        }
    }
}

/// Flushes a writable export's image once every queue has ended; says whether it flushed. A
/// directory export has nothing of its own to flush: every WRITE reached the source files
/// before it was answered, and FSYNC requests synced them (syncing the source's whole
/// filesystem would hold every other export of `fusex serve` back meanwhile). With the
/// writeback cache, pages the kernel still held for files open at the abort go with the
/// connection (closed files were written back at their close).
fn final_flush(export: &Fs) -> Result<bool> {
    let Some(export) = export.image().filter(|e| e.config().writable) else {
        return Ok(false);
    };
    if export.backend().capabilities().flushes_on_close {
        // Each queue's connection flushes what it wrote as it closes (a new connection might
        // not even be accepted while they are open, and without multi-conn would not cover them).
        return Ok(false);
    }
    let eng = Engine::new(&EngineConfig {
        sq_entries: 8,
        ..EngineConfig::default()
    })?;
    eng.block_on(export.backend().flush(&eng))?
        .context("flushing the image")?;
    Ok(true)
}
