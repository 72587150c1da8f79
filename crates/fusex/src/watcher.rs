//! `--auto-unmount`: a watcher process that removes the mount once the daemon is gone, however it
//! died (SIGKILL, a crash, the OOM killer).
//!
//! The daemon starts `fusex auto-unmount-watcher` (its own binary, `/proc/self/exe`) right after
//! mounting, with the read end of a pipe as stdin and nothing else: no `/dev/fuse` fd, no image,
//! so the watcher never keeps the connection alive. The daemon holds the write end (close-on-exec,
//! never handed to anyone) until it exits; the kernel closes it on any death, the watcher reads EOF
//! and unmounts the mountpoint, but only if the mount there is still the one this daemon made, by
//! the unique mount id recorded at mount time (see `transport::unmount_if_same`). After a clean
//! exit the daemon has already unmounted, so the watcher finds nothing of its own and just exits.

use std::fs::File;
use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result};
use transport::MountIdentity;

/// The daemon's side: the pipe's write end. Dropping it (or the daemon dying) releases the watcher.
pub struct Watcher {
    _alive: OwnedFd,
}

impl Watcher {
    /// A watcher's pipe handed over by the daemon this process replaces (`fusex restart`): the
    /// watcher stays asleep as long as either process holds it.
    pub fn from_fd(fd: OwnedFd) -> Watcher {
        Watcher { _alive: fd }
    }

    /// Another descriptor of the pipe, to hand to a successor daemon.
    pub fn dup(&self) -> std::io::Result<OwnedFd> {
        self._alive.try_clone()
    }
}

/// The watcher `args` ask for (`--auto-unmount`), started for the mount `id` at `mountpoint`:
/// what image and directory exports call from `Mount::establish`'s callback, which reports an
/// `io::Error`.
pub fn for_mount(
    args: &crate::cli::MountArgs,
    mountpoint: &Path,
    id: &MountIdentity,
    verbose: u8,
) -> std::io::Result<Option<Watcher>> {
    if !args.auto_unmount {
        return Ok(None);
    }
    spawn(mountpoint, id, verbose, args.daemonize)
        .map(Some)
        .map_err(|e| std::io::Error::other(format!("{e:#}")))
}

/// Starts the watcher for the mount `id` at `mountpoint`. `quiet` sends its log to /dev/null
/// (a daemonized fusex must not keep the caller's stderr open through it).
pub fn spawn(mountpoint: &Path, id: &MountIdentity, verbose: u8, quiet: bool) -> Result<Watcher> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two fds into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error()).context("auto-unmount watcher: pipe2");
    }
    // SAFETY: both fds are fresh and owned here.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let mut cmd = Command::new("/proc/self/exe");
    for _ in 0..verbose.min(2) {
        cmd.arg("-v");
    }
    cmd.arg("auto-unmount-watcher")
        .arg(mountpoint)
        .arg(id.mount_id().to_string())
        .arg("--dev")
        .arg(libc::makedev(id.dev().0, id.dev().1).to_string());
    if id.is_unique() {
        cmd.arg("--unique");
    }
    if crate::logging::format() == crate::logging::LogFormat::Json {
        cmd.env(crate::logging::WATCHER_FORMAT_ENV, "json");
    }
    // stdin becomes the read end (dup2 clears close-on-exec on the copy); the original closes
    // with `cmd` in this process.
    cmd.stdin(Stdio::from(rd)).stdout(Stdio::null());
    if quiet {
        cmd.stderr(Stdio::null());
    }
    let child = cmd.spawn().context("starting the --auto-unmount watcher")?;
    drop(cmd);
    tracing::debug!(pid = child.id(), "auto-unmount watcher started");
    Ok(Watcher { _alive: wr })
}

/// The watcher process: waits for the daemon to go, then unmounts its mount if it is still there.
pub fn run(mountpoint: &Path, expected: MountIdentity) -> Result<()> {
    // Its own session: Ctrl-C or a hangup aimed at the daemon's terminal must not take the
    // watcher down with the daemon. A name tools (and tests) can tell apart from the daemon.
    // SAFETY: setsid and prctl(PR_SET_NAME) with a NUL-terminated name of at most 16 bytes.
    unsafe {
        libc::setsid();
        libc::prctl(libc::PR_SET_NAME, c"fusex-watch".as_ptr());
    }
    // SAFETY: fd 0 is the pipe the daemon set up; nobody else in this process uses it.
    let mut pipe = File::from(unsafe { OwnedFd::from_raw_fd(0) });
    let mut buf = [0u8; 64];
    loop {
        match pipe.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e).context("auto-unmount watcher: reading the daemon's pipe"),
        }
    }
    match transport::unmount_if_same(mountpoint, &expected) {
        Ok(true) => tracing::info!(
            "auto-unmount: the daemon is gone; unmounted {}",
            mountpoint.display()
        ),
        Ok(false) => tracing::debug!(
            "auto-unmount: {} is not the daemon's mount any more; nothing to do",
            mountpoint.display()
        ),
        Err(e) => {
            return Err(e).with_context(|| format!("auto-unmount of {}", mountpoint.display()))
        }
    }
    Ok(())
}
