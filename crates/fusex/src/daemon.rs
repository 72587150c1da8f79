//! `--daemonize`: the parent returns only once the child reports that the mount is live.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};

use anyhow::{bail, Context, Result};

/// The child's end of the readiness pipe.
pub struct Readiness {
    pipe: Option<File>,
    /// stderr is where the log goes (a `--log-file`, or stderr kept): not sent to /dev/null.
    keep_stderr: bool,
}

impl Readiness {
    /// No daemon: reporting readiness does nothing.
    pub fn foreground() -> Readiness {
        Readiness {
            pipe: None,
            keep_stderr: true,
        }
    }

    /// Whether stderr stays as it is once the daemon detaches (it carries the log).
    pub fn keep_stderr(&mut self, keep: bool) {
        self.keep_stderr = keep;
    }

    /// Tells the waiting parent how start-up ended; detaches from the terminal on success.
    pub fn report(&mut self, outcome: Result<(), String>) {
        let Some(mut p) = self.pipe.take() else {
            return;
        };
        let msg = match &outcome {
            Ok(()) => "ok\n".to_string(),
            Err(e) => format!("{e}\n"),
        };
        let _ = p.write_all(msg.as_bytes());
        if outcome.is_ok() {
            redirect_stdio(self.keep_stderr);
        }
    }
}

/// Closes every descriptor above stderr that the process inherited, before it opens any of its
/// own: a daemon outliving its launcher must not keep what the launcher had open. A shell's
/// descriptor on the very export `fusex restart` is run on kept the export busy forever (its
/// files never all closed), and an inherited pipe keeps its reader waiting for EOF.
pub fn close_inherited() {
    // SAFETY: close_range takes plain integers and only closes descriptors; nothing of this
    // process is open above 2 yet (the caller runs it first thing).
    let r = unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    if r == 0 {
        return;
    }
    // Before Linux 5.9: one by one.
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<i32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|&fd| fd > 2)
        .collect();
    for fd in fds {
        // SAFETY: closing an inherited descriptor nothing in this process uses (the directory
        // read's own descriptor is closed already, or fails harmlessly with EBADF).
        unsafe { libc::close(fd) };
    }
}

/// Forks. In the parent this never returns: it waits for the child's report and exits with it.
/// Must run before any thread is started.
pub fn daemonize() -> Result<Readiness> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two fds into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error()).context("pipe2");
    }
    // SAFETY: both fds are fresh and owned here.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: no other threads exist yet (checked by the caller's ordering), so fork is safe.
    match unsafe { libc::fork() } {
        -1 => Err(std::io::Error::last_os_error()).context("fork"),
        0 => {
            drop(rd);
            // SAFETY: setsid in the child; failure is harmless (already a leader).
            unsafe { libc::setsid() };
            Ok(Readiness {
                pipe: Some(File::from(wr)),
                keep_stderr: false,
            })
        }
        _ => {
            drop(wr);
            let mut s = String::new();
            let _ = File::from(rd).read_to_string(&mut s);
            let line = s.lines().next().unwrap_or("");
            if line == "ok" {
                std::process::exit(0);
            }
            if line.is_empty() {
                bail!("the daemon exited before the mount was live (run without --daemonize to see why)");
            }
            // The child already phrased the error; print it as ours.
            eprintln!("fusex: error: {line}");
            std::process::exit(1);
        }
    }
}

fn redirect_stdio(keep_stderr: bool) {
    if let Ok(null) = File::options().read(true).write(true).open("/dev/null") {
        use std::os::fd::AsRawFd;
        for fd in 0..if keep_stderr { 2 } else { 3 } {
            // SAFETY: dup2 onto the standard descriptors.
            unsafe { libc::dup2(null.as_raw_fd(), fd) };
        }
    }
}
