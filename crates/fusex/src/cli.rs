//! The command line.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

/// Export disk images as regular files through FUSE.
#[derive(Parser, Debug)]
#[command(name = "fusex", version, about, propagate_version = true)]
pub struct Cli {
    /// More logging (-v: debug, -vv: trace). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Export IMAGE as the regular file MOUNTPOINT (foreground; Ctrl-C or SIGTERM unmounts).
    Mount(MountArgs),
    /// Unmount a fusex export (the daemon then exits).
    Umount {
        /// The mounted file.
        mountpoint: PathBuf,
    },
}

/// How a raw image's data I/O is issued (measurements; `auto` probes the file).
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum IoPathArg {
    /// Probe: inline for tmpfs, RWF_NOWAIT then ring for cached reads, ring otherwise.
    Auto,
    /// Always io_uring.
    Ring,
    /// Always synchronous pread/pwrite on the queue thread.
    Inline,
    /// preadv2(RWF_NOWAIT) first, io_uring when it would block.
    Nowait,
}

/// `fusex mount`.
#[derive(clap::Args, Debug)]
pub struct MountArgs {
    /// Raw file or block device, or null:SIZE (zeroes; drops writes).
    pub image: String,
    /// Regular file to mount over (created if missing, removed again at exit if fusex created it).
    pub mountpoint: PathBuf,
    /// Allow writes (default: read-only).
    #[arg(long)]
    pub writable: bool,
    /// Writes past the end grow the image (needs --writable).
    #[arg(long)]
    pub growable: bool,
    /// Let other users access the export (needs user_allow_other in /etc/fuse.conf for non-root).
    #[arg(long)]
    pub allow_other: bool,
    /// Open the image with O_DIRECT (bypass the host page cache).
    #[arg(long)]
    pub direct: bool,
    /// Let the kernel page-cache the export (default: direct I/O on the FUSE file).
    #[arg(long)]
    pub kernel_cache: bool,
    /// Flush the image after every write.
    #[arg(long)]
    pub writethrough: bool,
    /// Requests in flight per queue.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub queue_depth: u16,
    /// Number of queues (each a thread with its own /dev/fuse fd and io_uring).
    ///
    /// More queues help when several processes or threads submit I/O at once, or when the backend
    /// is CPU-bound; a single synchronous submitter gains nothing and may lose a little.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub queues: u16,
    /// How raw-image I/O is issued.
    #[arg(long, value_enum, default_value_t = IoPathArg::Auto)]
    pub io_path: IoPathArg,
    /// Busy-poll the ring this many microseconds before sleeping.
    #[arg(long, default_value_t = 0)]
    pub spin_us: u64,
    /// Fork into the background; return only once the mount is live.
    #[arg(long)]
    pub daemonize: bool,
    /// Write the daemon's pid here (removed at exit).
    #[arg(long)]
    pub pid_file: Option<PathBuf>,
    /// At exit, write request and backend counters here as JSON.
    #[arg(long)]
    pub stats_file: Option<PathBuf>,
}
