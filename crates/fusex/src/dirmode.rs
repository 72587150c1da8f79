//! A directory export (`fusex mount SRC_DIR MOUNTPOINT`, and `fusex serve`'s): the source
//! opened as a [`dirfs::DirFs`], mounted and negotiated here; from then on it is an export like
//! an image's ([`crate::lifecycle::Fs::Dir`]): the same supervisor, queues, stop and `fusex
//! restart` (whose successor takes the node and handle tables over, [`take_over`]).

use std::path::Path;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use dirfs::{DirConfig, DirFs};
use fuse_abi::{
    FUSE_ASYNC_READ, FUSE_BIG_WRITES, FUSE_DIRECT_IO_ALLOW_MMAP, FUSE_DONT_MASK,
    FUSE_DO_READDIRPLUS, FUSE_HANDLE_KILLPRIV_V2, FUSE_OVER_IO_URING, FUSE_PARALLEL_DIROPS,
    FUSE_PASSTHROUGH, FUSE_POSIX_ACL, FUSE_READDIRPLUS_AUTO, FUSE_SETXATTR_EXT,
    FUSE_WRITEBACK_CACHE,
};
use transport::{negotiate_init, negotiate_init_passthrough, InitParams, Mount};

use crate::cli::{CacheArg, MountArgs, PassthroughArg, TransportArg};
use crate::memory;

/// Whether `image` names a directory (following a symlink, as the user sees it; the export
/// itself then refuses a symlink there). `null:SIZE` and NBD URIs never do, whatever the
/// working directory holds.
pub fn is_directory(image: &str) -> bool {
    backend::names_a_path(image) && std::fs::metadata(image).is_ok_and(|m| m.is_dir())
}

/// Refuses the image options that mean nothing for a directory, in one line naming the
/// option (`fusex mount` and `fusex serve`'s directory exports alike).
pub fn check_args(args: &MountArgs) -> Result<()> {
    let refuse = |opt: &str| -> Result<()> {
        bail!(
            "{opt} is for image exports; {} is a directory: drop {opt}",
            args.image
        )
    };
    if args.growable {
        refuse("--growable")?;
    }
    if args.format != crate::cli::FormatArg::Auto {
        refuse("--format")?;
    }
    if args.partition.is_some() {
        refuse("--partition")?;
    }
    if args.offset.is_some() {
        refuse("--offset")?;
    }
    if args.size.is_some() {
        refuse("--size")?;
    }
    if args.no_backing {
        refuse("--no-backing")?;
    }
    if args.trust_backing {
        refuse("--trust-backing")?;
    }
    if !args.backing.is_empty() {
        refuse("--backing")?;
    }
    if args.l2_cache_size.is_some() {
        refuse("--l2-cache-size")?;
    }
    if args.refcount_cache_size.is_some() {
        refuse("--refcount-cache-size")?;
    }
    if args.cache_clean_interval.is_some() {
        refuse("--cache-clean-interval")?;
    }
    if args.no_locking {
        refuse("--no-locking")?;
    }
    if args.direct {
        refuse("--direct")?;
    }
    if args.writethrough {
        refuse("--writethrough")?;
    }
    if args.max_size.is_some() {
        refuse("--max-size")?;
    }
    if args.force_share {
        refuse("--force-share")?;
    }
    if !args.fault.is_empty() {
        refuse("--fault")?;
    }
    Ok(())
}

/// With the writeback cache, has the kernel write back what it holds of the export's files
/// (`syncfs` of the mount) before a signal's stop detaches it: pages of files still open at the
/// stop would otherwise be lost when the connection is aborted 2 s later (closed files were
/// written back at their close). On a thread of its own, while the queue threads serve the
/// WRITEs, and waited for at most 2 s, so a source that stopped answering does not hold the stop
/// up (the abort then ends the call).
pub(crate) fn write_back_before_stop(mountpoint: &std::path::Path) {
    use std::os::fd::AsRawFd;
    let (tx, rx) = mpsc::channel();
    let path = mountpoint.to_path_buf();
    let spawned = std::thread::Builder::new()
        .name("fusex-syncfs".into())
        .spawn(move || {
            let r = std::fs::File::open(&path).and_then(|d| {
                // SAFETY: syncfs of a descriptor this closure owns.
                if unsafe { libc::syncfs(d.as_raw_fd()) } == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
            let _ = tx.send(r);
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start writing back before unmounting: {e}");
        return;
    }
    match rx.recv_timeout(Duration::from_secs(2)) {
        Ok(Ok(())) => tracing::debug!("the kernel wrote the export's files back"),
        Ok(Err(e)) => tracing::warn!("writing the export's files back before unmounting: {e}"),
        Err(_) => tracing::warn!("writing the export's files back took over 2 s; unmounting"),
    }
}

type Prepared = (
    Arc<DirFs>,
    Mount,
    memory::Plan,
    bool,
    usize,
    usize,
    transport::Negotiated,
    Option<crate::watcher::Watcher>,
);

/// A directory export (an export whose image is a directory): the source opened, mounted and
/// negotiated, to be supervised like any export. Every entry made through the export is
/// created with its caller's umask, set for the creation on the queue thread (`dirfs::acl`);
/// `fusex mount` makes the process's own umask 0 first, `fusex serve` leaves it alone (the
/// daemon creates other files).
pub fn setup(
    args: &MountArgs,
    argv: Vec<String>,
    verbose: u8,
) -> Result<crate::lifecycle::Prepared> {
    let (fs, mnt, plan, uring, queues, _max_write, negotiated, watcher) = prepare(args, verbose)?;
    let mut settled =
        crate::lifecycle::Settled::adopted(negotiated, argv, plan, queues, None, None, watcher);
    settled.announce = Some(format!(
        "mounted directory {} at {} ({}, {} queue{}, {}{})",
        args.image,
        mnt.mountpoint().display(),
        access(args.writable),
        queues,
        if queues == 1 { "" } else { "s" },
        if uring {
            "io_uring"
        } else {
            "legacy /dev/fuse"
        },
        if args.no_read_ahead {
            ", no read-ahead"
        } else {
            ""
        }
    ));
    Ok(crate::lifecycle::Prepared {
        args: args.clone(),
        export: crate::lifecycle::Fs::Dir(fs),
        mnt,
        settled,
        stats: Default::default(),
    })
}

/// How a directory export is mounted, in its start-up lines.
fn access(writable: bool) -> &'static str {
    if writable {
        "writable"
    } else {
        "read-only"
    }
}

/// Refuses a mountpoint below the source directory. The export would contain itself: a lookup
/// of the mountpoint's name reaches the export's own root, and a queue thread listing it waits
/// for a reply only it can give (seen: `find` on such an export hung its queue for good, and
/// the stop with it). A mountpoint that is the source itself is fine (the daemon holds the
/// directory under the mount), as is a source below the mountpoint.
fn check_mountpoint_outside(source: &Path, mountpoint: &Path) -> Result<()> {
    let Ok(src) = source.canonicalize() else {
        return Ok(()); // The source's own open says what is wrong with it.
    };
    let Ok(mp) = transport::canonical_mountpoint(mountpoint) else {
        return Ok(()); // The mount says what is wrong with it.
    };
    if below(&mp, &src) {
        bail!(
            "MOUNTPOINT {} lies inside SRC_DIR {}: the export would contain itself and wait on \
             its own requests; mount it outside the source tree (or over SRC_DIR itself)",
            mp.display(),
            src.display()
        );
    }
    Ok(())
}

/// Whether `path` lies strictly below the directory `dir` (both canonical).
pub(crate) fn below(path: &Path, dir: &Path) -> bool {
    path != dir && path.starts_with(dir)
}

/// Opens the source, mounts and negotiates INIT.
fn prepare(args: &MountArgs, verbose: u8) -> Result<Prepared> {
    check_args(args)?;
    check_mountpoint_outside(Path::new(&args.image), &args.mountpoint)?;
    let cfg = config(args);
    let cache = args.cache.unwrap_or(CacheArg::Auto);
    let fs = Arc::new(
        DirFs::open(std::path::Path::new(&args.image), cfg).map_err(|e| anyhow::anyhow!("{e}"))?,
    );
    if !fs.file_handles() {
        tracing::info!(
            "nodes: the source gives no file handles (or CAP_DAC_READ_SEARCH is missing): at most \
             {} files and directories are known to the kernel at once, one descriptor each; \
             raise the open-file limit (ulimit -n) for larger trees",
            cfg.max_node_fds
        );
    }
    let uring_blocked = transport::uring_unavailable_reason();
    if let (TransportArg::Uring, Some(why)) = (args.transport, &uring_blocked) {
        bail!("--transport uring is unavailable: {why}; or use --transport auto");
    }
    let may_uring = args.transport != TransportArg::Legacy && uring_blocked.is_none();
    let threads = args
        .queues
        .map_or(crate::affinity::allowed_cpus().len(), usize::from);
    let crate::lifecycle::Staged {
        demand,
        planned,
        max_write,
        mnt,
        watcher,
    } = crate::lifecycle::plan_and_mount(args, verbose, may_uring, threads, false, true)?;
    // DIRECT_IO_ALLOW_MMAP: with --cache never, mmap of a file opened for direct I/O.
    // DONT_MASK: new entries' modes come without the caller's umask, which the source applies
    // unless the parent has a default ACL (POSIX_ACL: the kernel checks ACLs; SETXATTR_EXT:
    // it says when setting an ACL clears the setgid bit). No ACLs if the source keeps none.
    // HANDLE_KILLPRIV_V2: set-id bits cleared by fusex at a write, truncate or chown that would
    // clear them locally, instead of the kernel asking for `security.capability` before every
    // write (a GETXATTR round trip per write(2), passthrough writes included).
    let mut want = FUSE_ASYNC_READ
        | FUSE_DIRECT_IO_ALLOW_MMAP
        | FUSE_BIG_WRITES
        | FUSE_PARALLEL_DIROPS
        | FUSE_DO_READDIRPLUS
        | FUSE_READDIRPLUS_AUTO
        | FUSE_DONT_MASK
        | FUSE_SETXATTR_EXT
        | FUSE_HANDLE_KILLPRIV_V2;
    if fs.source_has_acls() {
        want |= FUSE_POSIX_ACL;
    }
    if may_uring {
        want |= FUSE_OVER_IO_URING;
    }
    let conn = mnt.fd().context("mount fd")?;
    let params = InitParams {
        want,
        want_without_passthrough: writeback_wanted(args.writable, cache),
        max_write,
        max_pages: (max_write / 4096) as u16,
        max_background: 1024,
        request_timeout: args.request_timeout,
    };
    // `auto` asks for passthrough only where opens can use it (registering backing files needs
    // CAP_SYS_ADMIN in the initial user namespace): passthrough granted but refused at every
    // open would leave every file to fusex without the writeback cache.
    let ask_passthrough = match args.passthrough {
        PassthroughArg::Off => false,
        PassthroughArg::On => true,
        PassthroughArg::Auto => crate::privileges::may_register_backing_files(),
    };
    let neg = if !ask_passthrough {
        negotiate_init(conn, &params)?
    } else {
        use std::os::fd::AsRawFd;
        let depth = fs.root().map_or(1, |r| {
            r.fd().map_or(1, |fd| {
                transport::passthrough::stack_depth_for(fd.as_raw_fd())
            })
        });
        negotiate_init_passthrough(conn, &params, depth)?
    };
    match (args.passthrough, neg.has(FUSE_PASSTHROUGH)) {
        (PassthroughArg::Off, _) => {}
        (_, true) => {
            use std::os::fd::AsRawFd;
            let clone = transport::clone_fd(conn.as_raw_fd())?;
            fs.set_passthrough(clone);
            tracing::info!("passthrough: the kernel serves open files' data from the source");
        }
        (PassthroughArg::On, false) => bail!(
            "--passthrough on: the kernel did not offer FUSE_PASSTHROUGH (needs Linux 6.9+ built \
             with CONFIG_FUSE_PASSTHROUGH); or use --passthrough auto"
        ),
        (PassthroughArg::Auto, false) if !ask_passthrough => tracing::info!(
            "passthrough: off (registering backing files needs CAP_SYS_ADMIN in the initial user \
             namespace)"
        ),
        (PassthroughArg::Auto, false) => {
            tracing::info!("passthrough: off (the kernel did not offer FUSE_PASSTHROUGH)")
        }
    }
    tracing::info!(
        "{}",
        writeback_line(args.writable, cache, args.passthrough, &neg)
    );
    fs.set_granted(neg.flags);
    let uring = neg.has(FUSE_OVER_IO_URING);
    if args.transport == TransportArg::Uring && !uring {
        bail!("--transport uring is unavailable: the kernel did not offer FUSE_OVER_IO_URING in INIT; or use --transport auto");
    }
    let plan = crate::lifecycle::plan_for_transport(planned, demand, uring);
    let queues = if uring {
        threads.min(demand.possible_cpus)
    } else {
        threads
    };
    let max_write = neg.max_write as usize;
    Ok((fs, mnt, plan, uring, queues, max_write, neg, watcher))
}

/// The export's configuration from its options and the descriptors this process may open
/// (raised to the hard limit first).
fn config(args: &MountArgs) -> DirConfig {
    raise_nofile_limit();
    let fds = nofile_limit();
    let cache = args.cache.unwrap_or(CacheArg::Auto);
    let valid = match cache {
        CacheArg::Never => Duration::ZERO,
        CacheArg::Auto => Duration::from_secs(1),
        CacheArg::Always => Duration::from_secs(86_400),
    };
    DirConfig {
        writable: args.writable,
        entry_valid: valid,
        attr_valid: valid,
        keep_cache: args.kernel_cache || cache == CacheArg::Always,
        cache_listings: cache == CacheArg::Always,
        direct_io: cache == CacheArg::Never,
        // A quarter of the descriptors for open files, 256 for the daemon, the rest for nodes;
        // nodes beyond them are held by file handle where the source allows.
        max_open: (fds / 4).max(16),
        max_node_fds: fds.saturating_sub(fds / 4 + 256).max(64),
        read_ahead: !args.no_read_ahead,
        ..DirConfig::default()
    }
}

/// `fusex restart`, in the successor: the directory export its predecessor handed over
/// (`table` and its descriptors `fds`, see [`DirFs::handover`]), on the connection `conn` whose
/// INIT settled `negotiated`, with options `args` (checked with [`check_args`] before the
/// predecessor let go). Nothing is mounted or negotiated again; passthrough backing ids
/// registered by the predecessor belong to the connection and stay valid.
pub fn take_over(
    args: &MountArgs,
    negotiated: &transport::Negotiated,
    conn: std::os::fd::BorrowedFd<'_>,
    table: dirfs::DirHandover,
    fds: Vec<std::os::fd::OwnedFd>,
) -> Result<Arc<DirFs>> {
    let fs = DirFs::take_over(std::path::Path::new(&args.image), config(args), table, fds)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    if negotiated.has(FUSE_PASSTHROUGH) {
        use std::os::fd::AsRawFd;
        fs.set_passthrough(transport::clone_fd(conn.as_raw_fd())?);
    }
    fs.set_granted(negotiated.flags);
    Ok(Arc::new(fs))
}

/// `FUSE_WRITEBACK_CACHE` when a directory export may use it: writable (a read-only export has
/// nothing to write back) and `--cache always`, the promise that the source changes only
/// through the mount. Under writeback the kernel keeps a held file's size and times itself and
/// places appends at the size it knows, so a change made to the source directly would be
/// hidden, and an append through the mount would land over what was appended outside:
/// `--cache auto` promises that such changes show within a second, and `never` at once. Asked
/// for only where passthrough is not granted too ([`InitParams::want_without_passthrough`]).
///
/// With it the kernel gathers writes in its page cache and sends them later in large WRITEs
/// (from its writeback threads, at close, fsync and memory pressure), and keeps regular files'
/// size and times itself; what that asks of the export is in `dirfs` (opens for writing may be
/// read from, `O_APPEND` is the kernel's) and docs/dirfs.md.
fn writeback_wanted(writable: bool, cache: CacheArg) -> u64 {
    if writable && cache == CacheArg::Always {
        FUSE_WRITEBACK_CACHE
    } else {
        0
    }
}

/// The start-up line saying whether writeback caching is on, and if not, why.
fn writeback_line(
    writable: bool,
    cache: CacheArg,
    passthrough: PassthroughArg,
    neg: &transport::Negotiated,
) -> &'static str {
    if neg.has(FUSE_WRITEBACK_CACHE) {
        "writeback cache: on (writes are gathered in the kernel's page cache and reach the \
         source at writeback, close or fsync)"
    } else if !writable {
        "writeback cache: off (a read-only export)"
    } else if cache == CacheArg::Never {
        "writeback cache: off (--cache never)"
    } else if passthrough != PassthroughArg::Off && neg.has(FUSE_PASSTHROUGH) {
        "writeback cache: off (passthrough serves file data; --passthrough off for writeback \
         caching)"
    } else if cache == CacheArg::Auto {
        "writeback cache: off (--cache auto shows changes made to the source directly, which \
         writeback caching would hide; --cache always for it)"
    } else {
        "writeback cache: off (the kernel did not offer FUSE_WRITEBACK_CACHE)"
    }
}

/// Every node the kernel holds is an open descriptor: raise the limit as far as allowed (with
/// `CAP_SYS_RESOURCE` up to `fs.nr_open`, at most 2^20; else the soft limit to the hard one).
fn raise_nofile_limit() {
    let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<libc::rlim_t>().ok())
        .unwrap_or(1 << 20)
        .min(1 << 20);
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a valid rlimit to fill and then pass back.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return;
        }
        if r.rlim_max < nr_open {
            let up = libc::rlimit {
                rlim_cur: nr_open,
                rlim_max: nr_open,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &up) == 0 {
                return;
            }
        }
        if r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

/// The descriptor limit in force.
fn nofile_limit() -> usize {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a valid rlimit to fill.
    let cur = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0 {
        r.rlim_cur
    } else {
        1024
    };
    usize::try_from(cur).unwrap_or(1 << 20).min(1 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The options of `fusex mount SRC MNT WORDS...`.
    fn args(words: &[&str]) -> MountArgs {
        let words: Vec<String> = words.iter().map(|w| w.to_string()).collect();
        crate::service::options::mount_args("/src", std::path::Path::new("/m"), &words)
            .unwrap()
            .0
    }

    #[test]
    fn image_options_are_refused_in_one_line_naming_them() {
        for opt in [
            "--growable",
            "--format=qcow2",
            "--partition=1",
            "--offset=4096",
            "--size=1M",
            "--no-backing",
            "--trust-backing",
            "--no-locking",
            "--direct",
            "--writethrough",
            "--force-share",
            "--max-size=1G",
            "--fault=read:1:eio",
        ] {
            let e = check_args(&args(&[opt])).unwrap_err().to_string();
            let name = opt.split('=').next().unwrap();
            assert_eq!(
                e,
                format!("{name} is for image exports; /src is a directory: drop {name}")
            );
        }
        // What a directory export takes passes.
        check_args(&args(&[
            "--writable",
            "--allow-other",
            "--queues=2",
            "--transport=legacy",
            "--passthrough=off",
            "--cache=never",
            "--format=auto",
        ]))
        .unwrap();
    }

    #[test]
    fn a_mountpoint_inside_the_source_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        std::fs::create_dir_all(src.join("sub/deeper")).unwrap();
        std::fs::create_dir(d.path().join("src2")).unwrap();
        for inside in ["src/sub", "src/sub/deeper", "src/not-yet"] {
            let e = check_mountpoint_outside(&src, &d.path().join(inside))
                .unwrap_err()
                .to_string();
            assert!(e.contains("lies inside SRC_DIR"), "{inside}: {e}");
            assert!(!e.contains('\n'), "{e}");
        }
        // Through a relative path with `..` in it, too.
        let twisted = src.join("sub/../sub/deeper");
        assert!(check_mountpoint_outside(&src, &twisted).is_err());
        // The source itself, a sibling sharing its name's start, and a parent are fine.
        for fine in ["src", "src2", "."] {
            check_mountpoint_outside(&src, &d.path().join(fine)).unwrap();
        }
        check_mountpoint_outside(&src.join("sub"), &src).unwrap();
    }
}
