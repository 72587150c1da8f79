//! The command line.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

/// Export disk images as regular files through FUSE.
#[derive(Parser, Debug)]
#[command(
    name = "fusex",
    version,
    about,
    disable_version_flag = true,
    arg_required_else_help = true
)]
pub struct Cli {
    /// More logging (-v: debug, -vv: trace). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// Print the version and what this kernel offers (FUSE protocol, io_uring transport,
    /// passthrough); reads a few files, mounts nothing.
    #[arg(short = 'V', long)]
    pub version: bool,
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// Subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Export IMAGE as the regular file MOUNTPOINT (foreground; Ctrl-C, SIGTERM or SIGHUP stops,
    /// serving files still open until they are closed: see --stop-timeout).
    Mount(Box<MountArgs>),
    /// Unmount a fusex export (the daemon then exits), or clear one whose daemon died. Refuses
    /// other FUSE mounts unless --force.
    Umount {
        /// The mounted file.
        mountpoint: PathBuf,
        /// Unmount whatever FUSE filesystem is mounted there, even if it is not a fusex export
        /// (a fusex export is a mount of type fuse.fusex in /proc/self/mountinfo).
        #[arg(long)]
        force: bool,
    },
    /// Restart the daemon serving MOUNTPOINT without unmounting: a new daemon (this fusex binary,
    /// so also the way to upgrade) takes the live FUSE connection over while applications keep
    /// the file open. Returns once the new daemon serves; on failure the old one keeps serving.
    /// Legacy /dev/fuse transport and image files only (io_uring and NBD exports refuse).
    Restart {
        /// The mounted file.
        mountpoint: PathBuf,
    },
    /// Writes the man pages or shell completions, generated from this command line, into DIR
    /// (`make install` runs it).
    #[command(hide = true)]
    Generate {
        #[command(subcommand)]
        what: Generate,
    },
    /// The `--auto-unmount` watcher (started by `fusex mount`, not by hand): waits for EOF on
    /// stdin, which the daemon holds open, then unmounts MOUNTPOINT if the mount there is still
    /// the one with the given unique mount id.
    #[command(name = "auto-unmount-watcher", hide = true)]
    AutoUnmountWatcher {
        /// The daemon's canonical mountpoint.
        mountpoint: PathBuf,
        /// The daemon's mount, as `statx` `stx_mnt_id` (unique since Linux 6.8).
        mount_id: u64,
        /// Whether `mount_id` is the never-reused 64-bit id (`STATX_MNT_ID_UNIQUE`).
        #[arg(long)]
        unique: bool,
        /// The FUSE connection's device number (`st_dev`), checked too.
        #[arg(long)]
        dev: u64,
    },
}

/// What `fusex generate` writes.
#[derive(Subcommand, Debug)]
pub enum Generate {
    /// fusex.1 and a page per subcommand (fusex-mount.1, fusex-umount.1).
    Man {
        /// Directory to write the pages into (created if missing).
        dir: PathBuf,
    },
    /// The completion script for SHELL, under the name that shell looks for (fusex.bash,
    /// _fusex, fusex.fish, ...).
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
        /// Directory to write the script into (created if missing).
        dir: PathBuf,
    },
}

/// How a raw image's data I/O is issued (measurements; `auto` probes the file).
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum IoPathArg {
    /// Probe: adaptive for tmpfs, RWF_NOWAIT then ring for cached reads, ring otherwise.
    Auto,
    /// Inline while one request is in service, the ring when several are.
    Adaptive,
    /// Always io_uring.
    Ring,
    /// Always synchronous pread/pwrite on the queue thread.
    Inline,
    /// preadv2(RWF_NOWAIT) first, io_uring when it would block.
    Nowait,
}

/// How requests travel between the kernel and fusex.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum TransportArg {
    /// io_uring when the kernel offers it in INIT, else legacy (one log line says which and why).
    Auto,
    /// FUSE-over-io_uring (Linux 6.14+, enable_uring=Y); fails if unavailable.
    Uring,
    /// read/write on /dev/fuse (through each queue's ring).
    Legacy,
}

/// How a legacy queue reads requests from `/dev/fuse`.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum LegacyReadArg {
    /// multishot where the kernel has it (Linux 6.7+), else poll.
    Auto,
    /// One multishot read per queue into provided buffers: every queued request in one go.
    Multishot,
    /// One poll-then-read per request.
    Poll,
}

/// Whether opens are handed to the kernel's FUSE passthrough.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum PassthroughArg {
    /// When the image is a raw regular file and the kernel and privileges allow (one log line says
    /// which and why not).
    Auto,
    /// Always; fails with the reason when it cannot.
    On,
    /// Never: every read and write goes through fusex.
    Off,
}

/// `--log`: where log lines go.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum LogArg {
    /// Standard error (kept by a daemon, which needs it to be a file).
    Stderr,
    /// The system log, through /dev/log.
    Syslog,
}

/// A plain switch.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum OnOff {
    /// On.
    On,
    /// Off.
    Off,
}

/// Whether queue threads are pinned to CPUs.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum Affinity {
    /// Pin when queues == CPUs.
    Auto,
    /// Always pin.
    On,
    /// Never pin.
    Off,
}

/// `--handoff`: when io_uring queue threads hand requests to each other.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum HandoffArg {
    /// When a queue is backlogged and another is less busy.
    Auto,
    /// Never.
    Off,
    /// Every request (tests).
    Always,
}

impl From<HandoffArg> for server::Handoff {
    fn from(a: HandoffArg) -> server::Handoff {
        match a {
            HandoffArg::Auto => server::Handoff::Auto,
            HandoffArg::Off => server::Handoff::Off,
            HandoffArg::Always => server::Handoff::Always,
        }
    }
}

/// The image format.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum FormatArg {
    /// qcow2 if the image starts with the qcow2 magic, raw otherwise (null for null:SIZE); the
    /// choice is logged.
    Auto,
    /// The file's bytes as they are, never probed.
    Raw,
    /// qcow2 (v2 or v3), with its backing chain.
    Qcow2,
    /// null:SIZE.
    Null,
}

impl From<FormatArg> for backend::Format {
    fn from(f: FormatArg) -> backend::Format {
        match f {
            FormatArg::Auto => backend::Format::Auto,
            FormatArg::Raw => backend::Format::Raw,
            FormatArg::Qcow2 => backend::Format::Qcow2,
            FormatArg::Null => backend::Format::Null,
        }
    }
}

/// `--request-timeout` default, seconds: ten minutes. Long enough that a slow but alive backend
/// (an fsync of an image with gigabytes dirty in the host page cache, a remote backend riding out
/// a network outage) never trips it, since a trip aborts the whole connection; short enough that
/// applications blocked on a wedged daemon get an error in minutes instead of never.
pub const DEFAULT_REQUEST_TIMEOUT: u16 = 600;

/// `--stop-timeout` default, seconds: a minute for the applications still using the export to
/// let go after a stop (time to unmount a filesystem on it, say), and still within systemd's
/// default stop timeout (90 s), after which systemd would kill the daemon outright.
pub const DEFAULT_STOP_TIMEOUT: u32 = 60;

/// A positive number of seconds, at most a day (fractions allowed: 0.2).
fn parse_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 86400.0 => Ok(v),
        _ => Err(format!(
            "{s:?} is not a number of seconds between 0 and 86400"
        )),
    }
}

/// `fusex mount`.
#[derive(clap::Args, Clone, Debug)]
pub struct MountArgs {
    /// Image file or block device (raw or qcow2), null:SIZE (zeroes; drops writes), or an NBD URI
    /// (nbd://HOST[:PORT]/EXPORT, nbd+unix:///EXPORT?socket=PATH; see docs/nbd.md).
    pub image: String,
    /// Regular file to mount over (created if missing, removed again at exit if fusex created it).
    pub mountpoint: PathBuf,
    /// Image format. Give raw for raw images from untrusted sources: auto would read a raw
    /// image whose first bytes mimic a qcow2 header as qcow2.
    #[arg(long, value_enum, default_value_t = FormatArg::Auto)]
    pub format: FormatArg,
    /// Refuse to open the backing or data files a qcow2 image names (for untrusted images, whose
    /// header may name any file).
    #[arg(long)]
    pub no_backing: bool,
    /// When root serves a qcow2 image another user owns, open the backing and data files it names
    /// as root. Without it they are opened with the owner's credentials, so the image cannot
    /// make root serve a file its owner could not read.
    #[arg(long, conflicts_with = "no_backing")]
    pub trust_backing: bool,
    /// Allow writes (default: read-only). Backing files of a qcow2 image are never written.
    #[arg(long)]
    pub writable: bool,
    /// Writes past the end grow the image (needs --writable).
    #[arg(long)]
    pub growable: bool,
    /// With --growable: the largest size the image may grow to (bytes, or with a K/M/G/T
    /// suffix, powers of 1024). Default: the largest file the image's filesystem holds.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub max_size: Option<u64>,
    /// Export even while another process writes the image, as `qemu-img -U` does (read-only
    /// exports only). Without it fusex takes QEMU's image locks: it refuses an image another
    /// process writes (a writable export also one that a reader keeps writers off, such as
    /// another fusex export), and QEMU's tools refuse to write or resize an image fusex exports.
    /// See docs/design.md.
    #[arg(long, short = 'U')]
    pub force_share: bool,
    /// Take no image locks at all (QEMU's locking=off): nothing then keeps other writers off
    /// the image. For measurements that export one image several times at once.
    #[arg(long)]
    pub no_locking: bool,
    /// Let other users access the export (needs user_allow_other in /etc/fuse.conf for non-root).
    #[arg(long)]
    pub allow_other: bool,
    /// Open the image with O_DIRECT (bypass the host page cache).
    #[arg(long)]
    pub direct: bool,
    /// Let the kernel page-cache the export (default: direct I/O on the FUSE file).
    #[arg(long)]
    pub kernel_cache: bool,
    /// FUSE passthrough (Linux 6.9+, CAP_SYS_ADMIN): the kernel reads, writes and mmaps the image
    /// file itself; fusex sees only open, getattr, fallocate, lseek and fsync. A fixed-size
    /// writable export passes only opens for reading (and mmap) through. See docs/passthrough.md.
    #[arg(long, value_enum, default_value_t = PassthroughArg::Auto)]
    pub passthrough: PassthroughArg,
    /// Flush the image after every write.
    #[arg(long)]
    pub writethrough: bool,
    /// Requests in flight per queue (io_uring: ring entries per kernel queue) [default: from a
    /// memory budget of 32 MiB + 1 MiB per possible CPU, at most 64, aiming at 32 (64 for NBD
    /// exports); see docs/design.md]. Every
    /// request buffer holds the largest request (max_write, up to 1 MiB, chosen with the depth),
    /// so memory is about depth x queues x max_write.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub queue_depth: Option<u16>,
    /// Memory for request buffers (bytes, or with a K/M/G/T suffix) [default: 32 MiB + 1 MiB per
    /// possible CPU]. The default queue depth and request size are planned within it, and a plan
    /// from --queues and --queue-depth that needs more than 4 times as much is refused.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub memory_budget: Option<u64>,
    /// Number of queues [default: one per online CPU]. Each queue is a thread with its own
    /// io_uring, sharing nothing with the others: on the legacy transport it reads its own clone
    /// of /dev/fuse; on io_uring it serves the kernel's per-CPU queues (qid i goes to queue i mod N).
    ///
    /// More queues help when several processes or threads submit I/O at once (fio numjobs > 1,
    /// a VM with several vCPUs) and when the backend costs CPU per request. On small VMs they
    /// also help a single synchronous submitter: a queue on the submitter's CPU answers without
    /// waking another (halted) vCPU (measured here, 4k psync QD1: 1 legacy queue 16k IOPS, 2 queues
    /// 74-100k). Where one queue already keeps up they cost CPU instead: on the legacy transport
    /// every idle queue is woken for each request (2 vCPUs, null image, 4 psync jobs: 2 queues
    /// 0.83-0.91x of one). With io_uring a job's requests all go to its CPU's queue.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=256), verbatim_doc_comment)]
    pub queues: Option<u16>,
    /// Pin queue i to CPU i (mod the CPUs fusex may run on). auto: on when there are exactly as
    /// many queues as CPUs.
    #[arg(long, value_enum, default_value_t = Affinity::Auto)]
    pub cpu_affinity: Affinity,
    /// Request transport.
    #[arg(long, value_enum, default_value_t = TransportArg::Auto)]
    pub transport: TransportArg,
    /// How raw-image I/O is issued.
    #[arg(long, value_enum, default_value_t = IoPathArg::Auto)]
    pub io_path: IoPathArg,
    /// How legacy queues read /dev/fuse. multishot drains every queued request per wakeup with
    /// no submission per request (4k randread, 4 jobs x QD16: 1.45x poll on one queue, 1.6x on two).
    #[arg(long, value_enum, default_value_t = LegacyReadArg::Auto)]
    pub legacy_read: LegacyReadArg,
    /// Busy-poll the ring this many microseconds before sleeping [default: 20 with io_uring, 0
    /// with legacy]. On small VMs waking a halted vCPU costs more than a request; a short spin
    /// keeps a queue responsive at queue depth 1. With fewer legacy queues than CPUs a spin pays
    /// too (1 queue on 2 vCPUs, 4k psync QD1: 14k -> 40k IOPS); with as many queues as CPUs it
    /// takes CPU from the submitters, hence the legacy default.
    #[arg(long)]
    pub spin_us: Option<u64>,
    /// Register the image descriptors and the io_uring connection fd with each queue's ring as
    /// fixed files (a measurement switch: off by default, since on this machine it measured no
    /// faster, see docs/design.md).
    #[arg(long, value_enum, default_value_t = OnOff::Off, hide = true)]
    pub fixed_files: OnOff,
    /// Legacy transport, image in memory: READs of at least this many bytes are answered by
    /// splicing from the image (0: never). A measurement switch, off by default: measured here
    /// it saved no server CPU (docs/design.md).
    #[arg(long, value_name = "SIZE", value_parser = parse_size_or_zero, default_value = "0", hide = true)]
    pub splice_min: u64,
    /// io_uring with several queues: a queue thread with requests queued up hands some, with
    /// their ring entries, to a less busy queue thread, and entries go home when their own
    /// thread is idle (`auto`); `off`: each thread serves the entries it registered; `always`:
    /// every request moves to the next thread (tests). See docs/uring.md.
    #[arg(long, value_enum, default_value_t = HandoffArg::Auto)]
    pub handoff: HandoffArg,
    /// Seconds a request may go unanswered before the kernel aborts the connection, so that no
    /// application hangs forever on a wedged daemon (Linux 6.14+; 0: none). The kernel raises
    /// values below 15 to 15, checks every 15 s, and caps the value at fs.fuse.max_request_timeout
    /// if set. The default leaves a slow but alive backend (a flush of a big image) room; see
    /// docs/design.md.
    #[arg(long, value_name = "SECONDS", default_value_t = DEFAULT_REQUEST_TIMEOUT)]
    pub request_timeout: u16,
    /// NBD: seconds a request may wait for its whole reply (and connecting, with the NBD and TLS
    /// handshakes, may take) before the connection is dropped and its requests fail with EIO.
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0, value_parser = parse_seconds)]
    pub nbd_timeout: f64,
    /// NBD: seconds to wait after a failed reconnect before trying again (doubling per failure,
    /// up to 30 s). A lost connection is retried at once on the next request, off the queue
    /// thread; other requests fail with EIO meanwhile.
    #[arg(long, value_name = "SECONDS", default_value_t = 1.0, value_parser = parse_seconds)]
    pub reconnect_delay: f64,
    /// Unmount the export when the daemon dies, even by SIGKILL: a small watcher process (holding
    /// nothing of the connection) removes the mount if it is still this daemon's.
    #[arg(long)]
    pub auto_unmount: bool,
    /// A stop (SIGTERM, SIGINT, SIGHUP) with files still open on the export (a loop device, a
    /// filesystem mounted on it, a program) detaches the export and serves those files until
    /// they are closed; after this many seconds (or at a second signal) it aborts them instead:
    /// their reads and writes then fail with ENOTCONN. 0: abort at once.
    #[arg(long, value_name = "SECONDS", default_value_t = DEFAULT_STOP_TIMEOUT)]
    pub stop_timeout: u32,
    /// Fork into the background; return only once the mount is live. The log then goes to
    /// --log-file or --log if given, else to syslog (/dev/log), else to stderr if that is a file;
    /// with none of these it is refused.
    #[arg(long)]
    pub daemonize: bool,
    /// Where the log goes: stderr, or syslog (datagrams to /dev/log, facility daemon, as
    /// journald and rsyslog read them) [default: stderr; see --daemonize].
    #[arg(long, value_enum, value_name = "DEST")]
    pub log: Option<LogArg>,
    /// Append the log to this file (created 0640; never through a symlink).
    #[arg(long, value_name = "PATH")]
    pub log_file: Option<PathBuf>,
    /// Write the daemon's pid here. Locked while the daemon serves: a second daemon given the same
    /// file refuses to start. Removed at exit.
    #[arg(long)]
    pub pid_file: Option<PathBuf>,
    /// For testing: make the Nth backend read, write or flush fail or wait, as OP:N:ACTION
    /// (e.g. write:3:eio, read:10:delay=200ms, flush:1:enospc; repeatable). Turns passthrough off.
    #[arg(long, value_name = "OP:N:ACTION")]
    pub fault: Vec<backend::FaultRule>,
    /// At exit, write request and backend counters here as JSON (also on SIGUSR1, while running).
    #[arg(long)]
    pub stats_file: Option<PathBuf>,
}

/// `--max-size`: the same size syntax as `null:SIZE` images.
fn parse_size_or_zero(s: &str) -> Result<u64, String> {
    if s == "0" {
        return Ok(0);
    }
    parse_size(s)
}

fn parse_size(s: &str) -> Result<u64, String> {
    backend::parse_size(s)
        .map_err(|_| format!("{s:?} is not a size: give bytes or K, M, G, T (powers of 1024)"))
}
