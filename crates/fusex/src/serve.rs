//! `fusex mount`: open the image, mount, negotiate, run the queues, and take it all down cleanly.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use backend::{AnyBackend, BlockBackend, IoPath, OpenOptions};
use engine::{Engine, EngineConfig};
use export::{Export, ExportConfig, Snapshot};
use fuse_abi::{FUSE_ASYNC_DIO, FUSE_ASYNC_READ, FUSE_BIG_WRITES};
use transport::{clone_fd, negotiate_init, open_dev_fuse, InitParams, Mount, MountConfig};

use crate::cli::{Affinity, IoPathArg, MountArgs};
use crate::daemon::Readiness;
use crate::queue::{self, Event, QueueSpec};

/// Largest WRITE (and READ) fusex negotiates: 1 MiB, the kernel's default `max_pages_limit`.
const MAX_WRITE: u32 = 1 << 20;

/// Serves until stopped. Errors before the mount is live are reported through `ready` too.
pub fn mount(args: MountArgs, mut ready: Readiness) -> Result<()> {
    let setup = setup(&args);
    let (export, mut mnt, neg_max_write) = match setup {
        Ok(v) => v,
        Err(e) => {
            ready.report(Err(format!("{e:#}")));
            return Err(e);
        }
    };
    if let Some(p) = &args.pid_file {
        if let Err(e) = std::fs::write(p, format!("{}\n", std::process::id())) {
            let e = anyhow::anyhow!("cannot write pid file {}: {e}", p.display());
            ready.report(Err(format!("{e:#}")));
            return Err(e);
        }
    }
    let result = run_queues(&args, &export, &mut mnt, neg_max_write, &mut ready);
    // Flush before the mount goes away, then unmount (Drop also does it on every early return).
    let flushed = final_flush(&export);
    let unmounted = mnt.unmount();
    drop(mnt);
    if let Some(p) = &args.pid_file {
        let _ = std::fs::remove_file(p);
    }
    let mut stats = result?;
    if let (Ok(true), Some(n)) = (&flushed, stats["backend"]["flushes"].as_u64()) {
        stats["backend"]["flushes"] = (n + 1).into();
    }
    if let Some(p) = &args.stats_file {
        std::fs::write(p, serde_json::to_vec_pretty(&stats)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    flushed?;
    unmounted?;
    Ok(())
}

type Setup = (Arc<Export<AnyBackend>>, Mount, u32);

fn setup(args: &MountArgs) -> Result<Setup> {
    if args.growable && !args.writable {
        bail!("--growable needs --writable: add --writable or drop --growable");
    }
    let io_path = match args.io_path {
        IoPathArg::Auto => None,
        IoPathArg::Ring => Some(IoPath::Ring),
        IoPathArg::Inline => Some(IoPath::Inline),
        IoPathArg::Nowait => Some(IoPath::NowaitThenRing),
    };
    let backend = backend::open(
        &args.image,
        OpenOptions {
            writable: args.writable,
            direct: args.direct,
            io_path,
        },
    )?;
    if let AnyBackend::Raw(r) = &backend {
        tracing::debug!(paths = ?r.io_paths(), "raw image data paths");
    }
    let export = Arc::new(Export::new(
        backend,
        ExportConfig {
            writable: args.writable,
            growable: args.growable,
            kernel_cache: args.kernel_cache,
            writethrough: args.writethrough,
            ..ExportConfig::default()
        },
    ));
    let fd = open_dev_fuse()?;
    let mnt = Mount::new(
        &MountConfig {
            mountpoint: args.mountpoint.clone(),
            source: args.image.clone(),
            read_only: !args.writable,
            allow_other: args.allow_other,
            max_read: MAX_WRITE,
        },
        fd,
    )?;
    // The mount exists from here on: any error below drops `mnt`, which unmounts.
    let neg = {
        // SAFETY-free borrow of the fd the mount holds.
        let fd = mnt.fd();
        let owned = borrow_owned(fd);
        negotiate_init(
            &owned,
            &InitParams {
                want: FUSE_ASYNC_READ | FUSE_ASYNC_DIO | FUSE_BIG_WRITES,
                max_write: MAX_WRITE,
                max_pages: (MAX_WRITE / 4096) as u16,
                max_background: 1024,
            },
        )?
    };
    tracing::info!("mounted {} at {}", args.image, mnt.mountpoint().display());
    Ok((export, mnt, neg.max_write))
}

/// A non-owning view of a raw fd as `OwnedFd` for APIs that take `&OwnedFd`.
fn borrow_owned(fd: std::os::fd::RawFd) -> std::mem::ManuallyDrop<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: the fd stays open (owned by the Mount) for as long as the view is used, and
    // ManuallyDrop keeps the view from closing it.
    std::mem::ManuallyDrop::new(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

fn run_queues(
    args: &MountArgs,
    export: &Arc<Export<AnyBackend>>,
    mnt: &mut Mount,
    max_write: u32,
    ready: &mut Readiness,
) -> Result<serde_json::Value> {
    let cpus = crate::affinity::allowed_cpus();
    let nq = args.queues.map_or(cpus.len(), usize::from);
    let pin = match args.cpu_affinity {
        Affinity::On => true,
        Affinity::Off => false,
        Affinity::Auto => nq == cpus.len(),
    };
    tracing::debug!(queues = nq, pinned = pin, "starting queues");
    let mut fds = Vec::with_capacity(nq);
    for _ in 1..nq {
        fds.push(clone_fd(mnt.fd())?);
    }
    fds.insert(0, mnt.take_fd().context("mount fd")?);
    let (tx, rx) = mpsc::channel::<Event>();
    let stop = Arc::new(AtomicBool::new(false));
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
    ])
    .context("installing signal handlers")?;
    let sig_handle = signals.handle();
    {
        let tx = tx.clone();
        std::thread::Builder::new()
            .name("fusex-signals".into())
            .spawn(move || {
                for s in signals.forever() {
                    if tx.send(Event::Signal(s)).is_err() {
                        break;
                    }
                }
            })?;
    }
    let mut threads = Vec::with_capacity(nq);
    for (id, fd) in fds.into_iter().enumerate() {
        let spec = QueueSpec {
            id,
            fd,
            depth: usize::from(args.queue_depth),
            max_write: max_write as usize,
            spin: Duration::from_micros(args.spin_us),
            cpu: pin.then(|| cpus[id % cpus.len()]),
        };
        let (export, stop, tx) = (export.clone(), stop.clone(), tx.clone());
        threads.push(
            std::thread::Builder::new()
                .name(format!("fusex-q{id}"))
                .spawn(move || queue::run(spec, export, stop, tx))?,
        );
    }
    drop(tx);
    let mut remotes = Vec::new();
    let mut running = nq;
    let mut started = 0;
    let mut total = Snapshot::default();
    let mut failure: Option<String> = None;
    let mut polls = 0u64;
    let mut enters = 0u64;
    let mut per_queue = Vec::new();
    let stop_all = |remotes: &Vec<(engine::Remote, engine::TaskId)>| {
        stop.store(true, Ordering::Release);
        for (r, t) in remotes {
            r.wake(*t);
        }
    };
    while running > 0 {
        let Ok(ev) = rx.recv() else { break };
        match ev {
            Event::Started { remote, task, .. } => {
                remotes.push((remote, task));
                if stop.load(Ordering::Acquire) {
                    stop_all(&remotes);
                }
                started += 1;
                if started == nq {
                    ready.report(Ok(()));
                }
            }
            Event::Failed { id, error } => {
                running -= 1;
                let msg = format!("queue {id} failed to start: {error}");
                if started < nq {
                    ready.report(Err(msg.clone()));
                }
                failure.get_or_insert(msg);
                stop_all(&remotes);
            }
            Event::Ended { id, report } => {
                running -= 1;
                total.merge(&report.counters);
                polls += report.engine.polls;
                enters += report.engine.enters;
                per_queue.push(serde_json::json!({
                    "queue": id,
                    "requests": report.counters.requests(),
                    "enters": report.engine.enters,
                    "completions": report.engine.completions,
                    "polls": report.engine.polls,
                }));
                if let Some(e) = report.error {
                    failure.get_or_insert(format!("queue {id}: {e}"));
                }
                // One queue ending (connection gone, or an error) ends the export.
                stop_all(&remotes);
            }
            Event::Signal(s) => {
                tracing::info!("signal {s}: finishing in-flight requests and unmounting");
                stop_all(&remotes);
            }
        }
    }
    sig_handle.close();
    for t in threads {
        let _ = t.join();
    }
    per_queue.sort_by_key(|q| q["queue"].as_u64());
    tracing::info!(
        requests = total.requests(),
        polls,
        enters,
        "served {} requests",
        total.requests()
    );
    let _ = mnt;
    if let Some(f) = failure {
        bail!(f);
    }
    let mut json = total.to_json();
    json["queues"] = serde_json::Value::Array(per_queue);
    Ok(json)
}

/// Flushes a writable export's image once every queue has ended; says whether it flushed.
fn final_flush(export: &Export<AnyBackend>) -> Result<bool> {
    if !export.config().writable {
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

/// `fusex umount`.
pub fn umount(path: PathBuf) -> Result<()> {
    transport::unmount(&path)?;
    Ok(())
}
