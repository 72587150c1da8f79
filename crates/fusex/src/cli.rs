//! The command line.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

/// Export disk images as regular files through FUSE.
// Help is wrapped to the terminal on stdout, stderr or stdin, else to COLUMNS, else to 100
// columns (clap's wrap_help), and never wider than 100: long lines read badly.
#[derive(Parser, Debug)]
#[command(
    name = "fusex",
    version,
    about,
    disable_version_flag = true,
    arg_required_else_help = true,
    max_term_width = 100
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
    /// Export IMAGE as the regular file MOUNTPOINT
    ///
    /// Runs in the foreground (or in the background with --daemonize) until Ctrl-C, SIGTERM or
    /// SIGHUP stops it; files still open on the export are served until they are closed (see
    /// --stop-timeout).
    Mount(Box<MountArgs>),
    /// Serve any number of exports in one daemon, added and removed over QMP
    ///
    /// Takes qemu-storage-daemon's command line for what fusex supports (--blockdev, --export
    /// type=fuse, --object iothread or tls-creds-x509, --chardev socket with --monitor, --pidfile,
    /// --daemonize), and its QMP commands on the control socket (blockdev-add, block-export-add,
    /// block-export-del, object-add, ...). SIGINT, SIGTERM and SIGHUP stop every export as they
    /// stop fusex mount; QMP's quit removes them.
    Serve(Box<ServeArgs>),
    /// Add, remove and list the exports of a running fusex serve
    ///
    /// Talks QMP to the daemon's control socket (by default control.sock in the runtime
    /// directory, /run/fusex for root). Tables for people, --json for scripts.
    Ctl(CtlArgs),
    /// A live view of a daemon's exports: request rates, throughput, latency, errors
    ///
    /// One line per export, refreshed every --interval from the control socket of a fusex
    /// serve (or of anything answering __org.fusex_query-stats). q or Ctrl-C quits; s changes
    /// the order. --once prints one interval's table (or JSON with --json) for scripts.
    Top(TopArgs),
    /// Unmount a fusex export (the daemon then exits), or clear one whose daemon died
    ///
    /// Refuses other FUSE mounts unless --force.
    Umount {
        /// The mounted file.
        mountpoint: PathBuf,
        /// Unmount whatever FUSE filesystem is mounted there, even if it is not a fusex export
        /// (a fusex export is a mount of type fuse.fusex in /proc/self/mountinfo).
        #[arg(long)]
        force: bool,
    },
    /// Restart the daemon serving MOUNTPOINT without unmounting
    ///
    /// A new daemon (this fusex binary, so also the way to upgrade) takes the live FUSE
    /// connection over while applications keep the file open. Returns once the new daemon
    /// serves; on failure (an image that cannot be reopened, or whose path names another file
    /// now) the old one keeps serving. Legacy /dev/fuse transport only (io_uring exports
    /// refuse). An NBD export's old daemon disconnects before the new one connects, so the
    /// server must outlive its client (qemu-nbd --persistent).
    Restart {
        /// The mounted file.
        mountpoint: PathBuf,
    },
    /// List the fusex exports of this host (root sees every user's): mountpoint, image, format,
    /// transport, daemon pid and state (serving, stopping with files still open, or dead: a mount
    /// whose daemon is gone, which `fusex umount` clears).
    List {
        /// One JSON object per export, in an array, for scripts.
        #[arg(long)]
        json: bool,
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
    /// fusex.1 and a page per subcommand (fusex-mount.1, fusex-umount.1, fusex-restart.1).
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
    /// FUSE-over-io_uring (Linux 6.14+, /sys/module/fuse/parameters/enable_uring = Y); fails if
    /// unavailable.
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

/// How long the kernel caches a directory export's names, attributes, file pages and listings.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum CacheArg {
    /// Nothing: every lookup and stat asks fusex, file I/O is direct (mmap still works).
    Never,
    /// Names and attributes for 1 s; file pages are dropped at each open.
    Auto,
    /// Names and attributes for a day, file pages and directory listings kept across opens: for
    /// sources that only change through the mount.
    Always,
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
    /// The system log: datagrams to /dev/log, facility daemon, as journald and rsyslog read
    /// them.
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
    /// Every request moves to the next thread (tests; hidden from help).
    #[value(hide = true)]
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
    /// qcow2, vhd, vdi, vmdk or vhdx if the image's first sector carries that format's magic,
    /// raw otherwise (null for null:SIZE); the choice is logged.
    Auto,
    /// The file's bytes as they are, never probed.
    Raw,
    /// qcow2 (v2 or v3), with its backing chain.
    Qcow2,
    /// VHD, fixed or dynamic (QEMU's vpc).
    #[value(alias = "vpc")]
    Vhd,
    /// VMDK: monolithic or split, sparse or flat (read-write), streamOptimized (read-only).
    Vmdk,
    /// VDI, static or dynamic (VirtualBox).
    Vdi,
    /// VHDX, fixed or dynamic (Hyper-V).
    Vhdx,
    /// null:SIZE.
    Null,
}

impl From<FormatArg> for backend::Format {
    fn from(f: FormatArg) -> backend::Format {
        match f {
            FormatArg::Auto => backend::Format::Auto,
            FormatArg::Raw => backend::Format::Raw,
            FormatArg::Qcow2 => backend::Format::Qcow2,
            FormatArg::Vhd => backend::Format::Vhd,
            FormatArg::Vmdk => backend::Format::Vmdk,
            FormatArg::Vdi => backend::Format::Vdi,
            FormatArg::Vhdx => backend::Format::Vhdx,
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

/// The headings `fusex mount --help` and fusex-mount(1) group the options under, in this order.
/// Each group answers one question an operator has (what is exported, who may write it, how fast,
/// what happens at a stop), so the 30-odd options read as eight short lists.
pub mod heading {
    pub const IMAGE: &str = "Image";
    pub const ACCESS: &str = "Access";
    pub const CACHING: &str = "Caching and durability";
    pub const PERFORMANCE: &str = "Queues and performance";
    pub const TRANSPORT: &str = "Transport";
    pub const NBD: &str = "NBD";
    pub const STOPPING: &str = "Stopping and failures";
    pub const DAEMON: &str = "Daemon, logging and statistics";
}

/// `fusex mount`.
// Each option's first paragraph is its line in `-h`; `--help` and the man page show all of it.
// Measurements behind a default belong in docs/, not here. Switches that exist only for tests
// and benchmarks are hidden (`hide`): docs/design.md lists them.
#[derive(clap::Args, Clone, Debug)]
pub struct MountArgs {
    /// Image file or block device (raw or qcow2), null:SIZE, an NBD URI, or a directory
    ///
    /// null:SIZE reads zeroes and drops writes (null:1G). An NBD export is
    /// nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH, over TLS nbds://HOST[:PORT]/EXPORT
    /// or nbds+unix:///EXPORT?socket=PATH&tls-certificates=DIR. A directory's tree is served
    /// below MOUNTPOINT, which must then be a directory.
    // The text is `--help`'s, where `[:PORT]` is the usual optional part, not a link.
    #[allow(rustdoc::broken_intra_doc_links)]
    pub image: String,
    /// Regular file to mount over (created if missing, removed again at exit if fusex created it
    /// and it is still empty);
    /// a directory for a directory
    pub mountpoint: PathBuf,

    /// Image format
    ///
    /// Give raw for raw images from untrusted sources: auto would read a raw image whose first
    /// bytes mimic a qcow2, VHD, VDI, VMDK or VHDX header as that format.
    #[arg(long, value_enum, default_value_t = FormatArg::Auto, help_heading = heading::IMAGE)]
    pub format: FormatArg,
    /// Export only partition N of the image (MBR or GPT), bounded to it
    ///
    /// Numbered as Linux numbers them: MBR primaries 1-4, logical partitions from 5, GPT
    /// entries from 1. Reads and writes cannot leave the partition, and its size is fixed.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..), help_heading = heading::IMAGE)]
    pub partition: Option<u32>,
    /// Export only the image's bytes from OFFSET on (to its end, or --size bytes)
    ///
    /// QEMU raw's `offset`: bytes, or with a K/M/G/T suffix. Reads and writes cannot leave the
    /// range, and its size is fixed. Not with --partition.
    #[arg(long, value_name = "OFFSET", value_parser = parse_size_or_zero, conflicts_with = "partition", help_heading = heading::IMAGE)]
    pub offset: Option<u64>,
    /// Export only SIZE bytes of the image (from --offset, or from its start)
    ///
    /// QEMU raw's `size`. The range must lie inside the image.
    #[arg(long, value_name = "SIZE", value_parser = parse_size_or_zero, conflicts_with = "partition", help_heading = heading::IMAGE)]
    pub size: Option<u64>,
    /// `fusex serve`: where the whole image of `--partition` comes from when other exports
    /// serve other partitions of it (one opened image for all of them); never on a command line.
    #[arg(skip)]
    pub shared_image: Option<crate::lifecycle::SharedImage>,
    /// Refuse to open the backing or data files a qcow2 image names
    ///
    /// Also a VMDK descriptor's extent files and a differencing VHDX image's parent. For
    /// untrusted images, whose header may name any file.
    #[arg(long, help_heading = heading::IMAGE)]
    pub no_backing: bool,
    /// Open the files another user's qcow2 image names as root, not as its owner
    ///
    /// When root serves a qcow2 image another user owns, open the backing and data files it names
    /// (a VMDK's extents, a differencing VHDX image's parent) as root. Without it they are
    /// opened with the owner's credentials, so the image cannot make root serve a file its owner
    /// could not read.
    #[arg(long, conflicts_with = "no_backing", help_heading = heading::IMAGE)]
    pub trust_backing: bool,
    /// Use this backing image instead of the one a qcow2 image's header names
    ///
    /// FORMAT:PATH with FORMAT qcow2 or raw (given, never probed), or none for no backing
    /// image. Repeat it for a chain, the top image's backing first: --backing qcow2:mid.qcow2
    /// --backing raw:base.img. A qcow2 level given last keeps the backing its header names.
    /// These files are the operator's choice: they are opened as fusex runs, read-only.
    #[arg(long, value_name = "FORMAT:PATH", help_heading = heading::IMAGE)]
    pub backing: Vec<backend::qcow2::BackingLevel>,
    /// Keep up to SIZE bytes of a qcow2 image's L2 tables in memory (QEMU's l2-cache-size)
    ///
    /// Each cached table maps one cluster's worth of entries: SIZE = 1 MiB covers 8 GiB of
    /// guest with 64 KiB clusters. At least two tables, at most 1024 (finding the table to
    /// evict scans them all). Default: 32 MiB (QEMU's default ceiling), loaded as reads need
    /// them; the top image only.
    #[arg(long, value_name = "SIZE", value_parser = parse_size_or_zero, help_heading = heading::IMAGE)]
    pub l2_cache_size: Option<u64>,
    /// Keep up to SIZE bytes of a qcow2 image's refcount blocks in memory (QEMU's
    /// refcount-cache-size)
    ///
    /// Refcount blocks are read when clusters are allocated or freed. At least two blocks, at
    /// most 1024. Default: 4 MiB, at most 32 blocks; the top image only.
    #[arg(long, value_name = "SIZE", value_parser = parse_size_or_zero, help_heading = heading::IMAGE)]
    pub refcount_cache_size: Option<u64>,
    /// Drop a qcow2 image's cached metadata tables nobody used for SECONDS (QEMU's
    /// cache-clean-interval), so that an idle export gives their memory back; 0 keeps them
    ///
    /// A table goes between SECONDS and twice that after its last use; tables with changes not
    /// yet written stay. The backing chain's caches too. Default: 600 (QEMU's default).
    #[arg(long, value_name = "SECONDS", help_heading = heading::IMAGE)]
    pub cache_clean_interval: Option<u32>,
    /// Export even while another process writes the image (read-only exports only)
    ///
    /// As qemu-img -U does. Without it fusex takes QEMU's image locks: it refuses an image
    /// another process writes (a writable export also one that a reader keeps writers off, such
    /// as another fusex export), and QEMU's tools refuse to write or resize an image fusex
    /// exports.
    #[arg(long, short = 'U', help_heading = heading::IMAGE)]
    pub force_share: bool,
    /// Take no image locks at all (QEMU's locking=off)
    ///
    /// Nothing then keeps other writers off the image. For measurements that export one image
    /// several times at once.
    #[arg(long, help_heading = heading::IMAGE)]
    pub no_locking: bool,

    /// Allow writes (default: read-only)
    ///
    /// Backing files of a qcow2 image are never written.
    #[arg(long, help_heading = heading::ACCESS)]
    pub writable: bool,
    /// Writes past the end grow the image (needs --writable)
    #[arg(long, help_heading = heading::ACCESS)]
    pub growable: bool,
    /// With --growable: the largest size the image may grow to
    ///
    /// Bytes, or with a K/M/G/T suffix (powers of 1024). Default: the largest file the image's
    /// filesystem holds.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, help_heading = heading::ACCESS)]
    pub max_size: Option<u64>,
    /// Let other users access the export
    ///
    /// A normal user needs a line user_allow_other in /etc/fuse.conf for it.
    #[arg(long, help_heading = heading::ACCESS)]
    pub allow_other: bool,

    /// Open the image with O_DIRECT (bypass the host page cache)
    #[arg(long, help_heading = heading::CACHING)]
    pub direct: bool,
    /// Let the kernel page-cache the export (default: direct I/O on the FUSE file)
    #[arg(long, help_heading = heading::CACHING)]
    pub kernel_cache: bool,
    /// Flush the image after every write
    ///
    /// Without it FLUSH and FSYNC are the durability points. On an NBD export whose server
    /// supports it, every write is sent with FUA instead of being followed by a flush.
    #[arg(long, help_heading = heading::CACHING)]
    pub writethrough: bool,
    /// FUSE passthrough: the kernel serves the image file's I/O itself
    ///
    /// Linux 6.9+ and CAP_SYS_ADMIN: the kernel reads, writes and mmaps the image file itself;
    /// fusex sees only open, getattr, fallocate, lseek and fsync. A fixed-size writable export
    /// passes only opens for reading (and mmap) through.
    #[arg(long, value_enum, value_name = "MODE", default_value_t = PassthroughArg::Auto, help_heading = heading::CACHING)]
    pub passthrough: PassthroughArg,
    /// What the kernel caches of a directory export [default: auto]
    ///
    /// never: every lookup and stat asks fusex and file I/O is direct; auto: names and
    /// attributes for 1 s, file pages dropped at each open; always: names and attributes for a
    /// day, file pages and directory listings kept across opens, for sources that change only
    /// through the mount.
    /// Only for a directory as IMAGE.
    #[arg(long, value_enum, value_name = "MODE", help_heading = heading::CACHING)]
    pub cache: Option<CacheArg>,
    /// Do not read a directory export's source ahead of a tree walk
    ///
    /// By default a reader walking a tree through a directory export (du, find, ls -R, a
    /// backup) has the directories below the one it lists read from a local source ahead of
    /// it, by threads at nice 10; with this the source is read only as requests ask. Only for
    /// a directory as IMAGE.
    #[arg(long, help_heading = heading::CACHING)]
    pub no_read_ahead: bool,

    /// Number of queues [default: one per online CPU]
    ///
    /// Each queue is a thread with its own io_uring, sharing nothing with the others: on the
    /// legacy transport it reads its own clone of /dev/fuse; on io_uring it serves the kernel's
    /// per-CPU queues (qid i goes to queue i mod N).
    ///
    /// More queues help when several processes or threads submit I/O at once (fio numjobs > 1, a
    /// VM with several vCPUs) and when the backend costs CPU per request. On small VMs they also
    /// help a single synchronous submitter: a queue on the submitter's CPU answers without waking
    /// another (halted) vCPU. Where one queue already keeps up they cost CPU instead: on the
    /// legacy transport every idle queue is woken for each request. With io_uring a job's
    /// requests all go to its CPU's queue.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=256), help_heading = heading::PERFORMANCE)]
    pub queues: Option<u16>,
    /// Requests in flight per queue [default: planned within --memory-budget]
    ///
    /// On io_uring: ring entries per kernel queue. The default aims at 32 (64 for NBD exports), at
    /// most 64, within the memory budget. Every request buffer holds the largest request
    /// (max_write, up to 1 MiB, chosen with the depth), so memory is about depth x queues x
    /// max_write.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024), help_heading = heading::PERFORMANCE)]
    pub queue_depth: Option<u16>,
    /// Memory for request buffers [default: 32 MiB + 1 MiB per possible CPU]
    ///
    /// Bytes, or with a K/M/G/T suffix. The default queue depth and request size are planned
    /// within it, and a plan from --queues and --queue-depth that needs more than 4 times as much
    /// is refused.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, help_heading = heading::PERFORMANCE)]
    pub memory_budget: Option<u64>,
    /// Pin queue i to CPU i (mod the CPUs fusex may run on)
    #[arg(long, value_enum, value_name = "MODE", default_value_t = Affinity::Auto, help_heading = heading::PERFORMANCE)]
    pub cpu_affinity: Affinity,
    /// Poll the ring this many microseconds before sleeping [default: 20 with io_uring, 0 with
    /// legacy]
    ///
    /// On small VMs waking a halted vCPU costs more than a request; a short poll (yielding the
    /// CPU to any other runnable thread between looks) keeps a queue responsive at queue
    /// depth 1. With fewer legacy queues than CPUs a poll pays too; with as many queues as CPUs
    /// it takes CPU from the submitters, hence the legacy default.
    #[arg(long, value_name = "MICROSECONDS", help_heading = heading::PERFORMANCE)]
    pub spin_us: Option<u64>,
    /// How raw-image I/O is issued (for measurements: auto is the one to use)
    ///
    /// auto probes the image file; the others force one path for every request.
    // Not in -h, which is for operators; in --help, where the benchmark harness looks for the
    // options its targets need (bench/fusexbench/targets.py: fusex-io-ring, -inline, -nowait).
    #[arg(long, value_enum, value_name = "PATH", default_value_t = IoPathArg::Auto, hide_short_help = true, help_heading = heading::PERFORMANCE)]
    pub io_path: IoPathArg,
    /// Register the image descriptors and the io_uring connection fd with each queue's ring as
    /// fixed files (a measurement switch: off by default, since on this machine it measured no
    /// faster, see docs/design.md).
    #[arg(long, value_enum, default_value_t = OnOff::Off, hide = true)]
    pub fixed_files: OnOff,
    /// Register each queue's request buffers with its ring as fixed buffers (a measurement
    /// switch, on by default). Registered buffers are pinned, so resident from the start;
    /// unregistered ones become resident only as requests fill them.
    #[arg(long, value_enum, default_value_t = OnOff::On, hide = true)]
    pub register_buffers: OnOff,
    /// Legacy transport, image in memory: READs of at least this many bytes are answered by
    /// splicing from the image (0: never). A measurement switch, off by default: measured here
    /// it saved no server CPU (docs/design.md).
    #[arg(long, value_name = "SIZE", value_parser = parse_size_or_zero, default_value = "0", hide = true)]
    pub splice_min: u64,

    /// Request transport
    #[arg(long, value_enum, default_value_t = TransportArg::Auto, help_heading = heading::TRANSPORT)]
    pub transport: TransportArg,
    /// How legacy queues read /dev/fuse
    ///
    /// multishot drains every queued request per wakeup with no submission per request.
    #[arg(long, value_enum, value_name = "MODE", default_value_t = LegacyReadArg::Auto, help_heading = heading::TRANSPORT)]
    pub legacy_read: LegacyReadArg,
    /// io_uring: a backlogged queue thread hands requests to a less busy one
    ///
    /// With several queues a queue thread with requests queued up hands some, with their ring
    /// entries, to a less busy queue thread, and entries go home when their own thread is idle.
    #[arg(long, value_enum, value_name = "MODE", default_value_t = HandoffArg::Auto, help_heading = heading::TRANSPORT)]
    pub handoff: HandoffArg,

    /// NBD: seconds a request may wait for its whole reply before the connection is dropped
    ///
    /// Also bounds connecting, with the NBD and TLS handshakes, as a whole. On expiry the
    /// connection is dropped and its requests fail with EIO.
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0, value_parser = parse_seconds, help_heading = heading::NBD)]
    pub nbd_timeout: f64,
    /// NBD: seconds to wait after a failed reconnect before trying again
    ///
    /// The wait doubles per failure, up to 30 s. A lost connection is retried at once on the next
    /// request, off the queue thread; other requests fail with EIO meanwhile.
    #[arg(long, value_name = "SECONDS", default_value_t = 1.0, value_parser = parse_seconds, help_heading = heading::NBD)]
    pub reconnect_delay: f64,

    /// Seconds to serve files still open after a stop before aborting them (0: at once)
    ///
    /// A stop (SIGTERM, SIGINT, SIGHUP) with files still open on the export (a loop device, a
    /// filesystem mounted on it, a program) detaches the export and serves those files until
    /// they are closed; after this many seconds (or at a second signal) it aborts them instead:
    /// their reads and writes then fail with ENOTCONN.
    #[arg(long, value_name = "SECONDS", default_value_t = DEFAULT_STOP_TIMEOUT, help_heading = heading::STOPPING)]
    pub stop_timeout: u32,
    /// Unmount the export when the daemon dies, even by SIGKILL
    ///
    /// A small watcher process (holding nothing of the connection) removes the mount if it is
    /// still this daemon's.
    #[arg(long, help_heading = heading::STOPPING)]
    pub auto_unmount: bool,
    /// Seconds a request may go unanswered before the kernel aborts the connection (0: none)
    ///
    /// So that no application hangs forever on a wedged daemon (Linux 6.14+). The kernel raises
    /// values below 15 to 15, checks every 15 s, and caps the value at
    /// fs.fuse.max_request_timeout if set. The default leaves a slow but alive backend (a flush
    /// of a big image) room.
    #[arg(long, value_name = "SECONDS", default_value_t = DEFAULT_REQUEST_TIMEOUT, help_heading = heading::STOPPING)]
    pub request_timeout: u16,
    /// For testing: make the Nth backend read, write or flush fail or wait, as OP:N:ACTION
    /// (e.g. write:3:eio, read:10:delay=200ms, flush:1:enospc, read:*:delay=2ms for every read;
    /// repeatable). Turns passthrough off.
    #[arg(long, value_name = "OP:N:ACTION", hide = true)]
    pub fault: Vec<backend::FaultRule>,

    /// Fork into the background; return only once the mount is live
    ///
    /// The log then goes to --log-file or --log if given, else to syslog (/dev/log), else to
    /// stderr if that is a file; with none of these it is refused.
    #[arg(long, help_heading = heading::DAEMON)]
    pub daemonize: bool,
    /// Write the daemon's pid here
    ///
    /// Locked while the daemon serves: a second daemon given the same file refuses to start.
    /// Removed at exit.
    #[arg(long, value_name = "PATH", help_heading = heading::DAEMON)]
    pub pid_file: Option<PathBuf>,
    /// Where the log goes [default: stderr; see --daemonize]
    #[arg(long, value_enum, value_name = "DEST", help_heading = heading::DAEMON)]
    pub log: Option<LogArg>,
    /// Append the log to this file (created 0640; never through a symlink)
    #[arg(long, value_name = "PATH", help_heading = heading::DAEMON)]
    pub log_file: Option<PathBuf>,
    /// What a log line looks like: text, or json (one object per line, with the export's id)
    ///
    /// json: timestamp (RFC 3339, UTC), level, target, message and the event's fields; every
    /// line carries the mountpoint as export. With --log syslog the object is the message.
    #[arg(long, value_enum, value_name = "FORMAT", default_value_t, help_heading = heading::DAEMON)]
    pub log_format: crate::logging::LogFormat,
    /// Write request and backend counters here as JSON, at exit and on SIGUSR1
    #[arg(long, value_name = "PATH", help_heading = heading::DAEMON)]
    pub stats_file: Option<PathBuf>,
    /// Serve QMP on this unix socket (created 0600), for fusex top and fusex ctl list
    #[arg(long, value_name = "PATH", help_heading = heading::DAEMON)]
    pub control: Option<PathBuf>,
    /// Time every request into per-operation latency histograms
    ///
    /// Off saves two or three clock reads per request; the counters are kept either way.
    #[arg(long, value_enum, value_name = "MODE", default_value_t = OnOff::On, help_heading = heading::DAEMON)]
    pub latency: OnOff,
    /// Serve Prometheus metrics at http://ADDR:PORT/metrics (off by default)
    ///
    /// The export's counters and latency histograms in Prometheus' text format, over plain
    /// HTTP to whoever can connect: give 127.0.0.1 or a private address.
    #[arg(long, value_name = "ADDR:PORT", help_heading = heading::DAEMON)]
    pub metrics_listen: Option<String>,
}

impl MountArgs {
    /// The byte range `--offset` and `--size` ask for (None: the whole image).
    pub fn byte_range(&self) -> Option<backend::ByteRange> {
        (self.offset.is_some() || self.size.is_some()).then(|| backend::ByteRange {
            offset: self.offset.unwrap_or(0),
            size: self.size,
        })
    }
}

/// A command-line error as the one line every other refusal is (`fusex: error: what: what to
/// do`, exit 1), instead of clap's error, tip and usage over several lines with exit 2.
/// `command` names the command whose `--help` to point at when the error has no usage line
/// ("": the subcommand given on this process's command line).
pub fn one_line(e: &clap::Error, command: &str) -> String {
    let text = e.render().to_string();
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    // The message runs until the tip, the usage or the pointer to --help; a list it introduces
    // (missing arguments, possible values) is on the lines after its first.
    let end = |l: &&str| {
        l.starts_with("tip: ") || l.starts_with("Usage: ") || l.starts_with("For more information")
    };
    let what = lines
        .iter()
        .take_while(|l| !end(l))
        .map(|l| l.trim_start_matches("error: "))
        .collect::<Vec<_>>()
        .join(" ");
    let tip = lines
        .iter()
        .find_map(|l| l.strip_prefix("tip: "))
        .map(|t| format!(" ({t})"))
        .unwrap_or_default();
    // "Usage: fusex mount [OPTIONS] <IMAGE> <MOUNTPOINT>": the command whose --help to point at;
    // without a usage line, the subcommand given, if it is one.
    let command = lines
        .iter()
        .find_map(|l| l.strip_prefix("Usage: "))
        .map(|u| {
            u.split(' ')
                .take_while(|w| !w.starts_with(['[', '<']))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .or_else(|| (!command.is_empty()).then(|| command.to_string()))
        .or_else(|| {
            let sub = std::env::args().nth(1)?;
            ["mount", "umount", "restart"]
                .contains(&sub.as_str())
                .then(|| format!("fusex {sub}"))
        })
        .unwrap_or_else(|| "fusex".to_string());
    let what = what.trim_end_matches(':');
    format!("{what}{tip}: run {command} --help")
}

/// `fusex ctl`.
#[derive(clap::Args, Clone, Debug)]
pub struct CtlArgs {
    /// The daemon's control socket [default: control.sock in the runtime directory]
    #[arg(long, value_name = "PATH", global = true)]
    pub control: Option<PathBuf>,
    /// Print JSON instead of a table
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: CtlCommand,
}

/// What `fusex ctl` does.
#[derive(Subcommand, Clone, Debug)]
pub enum CtlCommand {
    /// Export IMAGE at MOUNTPOINT as export ID; fusex mount options follow after --
    Add {
        /// The export's name.
        id: String,
        /// Image file, null:SIZE or NBD URI, as fusex mount takes it.
        image: String,
        /// Regular file to mount over.
        mountpoint: PathBuf,
        /// fusex mount options for this export (after --), e.g. -- --writable --queues 2.
        #[arg(last = true, allow_hyphen_values = true)]
        options: Vec<String>,
    },
    /// Remove export ID: in-flight requests are answered and the image flushed; files still
    /// open on it get ENOTCONN. Returns once it is gone.
    Remove {
        id: String,
        /// Abort the connection at once (in-flight requests fail).
        #[arg(long)]
        force: bool,
    },
    /// List the exports: id, mountpoint, image, format, transport, state.
    List,
    /// Everything about export ID.
    Show { id: String },
    /// Apply the daemon's config file again; prints what happened to each export.
    Reload,
}

/// `fusex top`.
#[derive(clap::Args, Clone, Debug)]
pub struct TopArgs {
    /// The daemon's control socket [default: control.sock in the runtime directory]
    #[arg(long, value_name = "PATH")]
    pub control: Option<PathBuf>,
    /// Seconds between samples: rates and percentiles are over this interval
    #[arg(long, value_name = "SECONDS", default_value = "1",
          value_parser = crate::top::parse_interval)]
    pub interval: std::time::Duration,
    /// Order of the lines (while running: keys i, r, w, p, e, n; s cycles)
    #[arg(long, value_name = "KEY", value_enum, default_value_t = crate::top::SortKey::Iops)]
    pub sort: crate::top::SortKey,
    /// Take two samples one interval apart, print one table and exit
    #[arg(long)]
    pub once: bool,
    /// With --once: print one JSON document instead of the table
    #[arg(long, requires = "once")]
    pub json: bool,
}

/// `fusex serve`.
#[derive(clap::Args, Clone, Debug)]
pub struct ServeArgs {
    /// Listen for QMP on this unix socket (created 0600; only its owner and root may connect)
    ///
    /// Without it, and without --monitor: control.sock in the user's runtime directory
    /// (/run/fusex/control.sock for root), where fusex ctl looks.
    #[arg(long, value_name = "PATH")]
    pub control: Option<PathBuf>,
    /// Start the exports in this TOML file; SIGHUP or fusex ctl reload applies its changes
    ///
    /// One [[export]] table per export: id, image and mountpoint, and any fusex mount option by
    /// its name (writable = true, transport = "legacy"). Relative paths are from the file's
    /// directory. An image that is a directory is served as a directory tree.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// A block node, as qemu-storage-daemon takes it (repeatable)
    ///
    /// key=value,... or JSON, the arguments of QMP's blockdev-add: drivers file, host_device,
    /// raw, qcow2, vpc, vdi, vhdx, nbd and null-co. For example a qcow2 image: driver=qcow2,
    /// node-name=disk, file.driver=file, file.filename=disk.qcow2 (joined by commas).
    #[arg(long, value_name = "OPTIONS")]
    pub blockdev: Vec<String>,
    /// An object, as qemu-storage-daemon takes it: iothread,id=ID or
    /// tls-creds-x509,id=ID,dir=DIR (repeatable)
    ///
    /// An IOThread is the name an export's iothread=ID member refers to: fusex's exports always
    /// run on queue threads, never on the thread that takes commands, so it changes nothing
    /// else. TLS credentials are the certificates (DIR/ca-cert.pem, client-cert.pem,
    /// client-key.pem) an nbd node's tls-creds=ID reaches its server with. Other object types
    /// are refused.
    #[arg(long, value_name = "OPTIONS")]
    pub object: Vec<String>,
    /// An export, as qemu-storage-daemon takes it (repeatable)
    ///
    /// The arguments of QMP's block-export-add, comma-separated: type=fuse, id=ID,
    /// node-name=NODE, mountpoint=PATH, and optionally writable=on, growable=on,
    /// writethrough=on, allow-other=on|off|auto, iothread=ID. Any fusex mount option goes as
    /// __org.fusex_OPTION=VALUE, e.g. __org.fusex_transport=legacy. A directory tree:
    /// type=__org.fusex_dir with source=DIR instead of node-name.
    #[arg(long, value_name = "OPTIONS")]
    pub export: Vec<String>,
    /// A character device for --monitor: socket,id=ID,path=PATH,server=on,wait=off (repeatable)
    #[arg(long, value_name = "OPTIONS")]
    pub chardev: Vec<String>,
    /// A QMP monitor on a --chardev: chardev=ID (repeatable)
    #[arg(long, value_name = "OPTIONS")]
    pub monitor: Vec<String>,
    /// Write the daemon's pid here (locked while it serves, removed at exit)
    #[arg(long, value_name = "PATH", alias = "pid-file")]
    pub pidfile: Option<PathBuf>,
    /// Fork into the background; return once every export given serves
    #[arg(long)]
    pub daemonize: bool,
    /// Where the log goes [default: stderr; with --daemonize syslog, else stderr if a file]
    #[arg(long, value_enum, value_name = "DEST")]
    pub log: Option<LogArg>,
    /// Append the log to this file (created 0640; never through a symlink)
    #[arg(long, value_name = "PATH")]
    pub log_file: Option<PathBuf>,
    /// What a log line looks like: text, or json (one object per line, with the export's id)
    ///
    /// json: timestamp (RFC 3339, UTC), level, target, message and the event's fields; a line
    /// about one export (its mount, removal, failure, reload) carries its id as export.
    #[arg(long, value_enum, value_name = "FORMAT", default_value_t)]
    pub log_format: crate::logging::LogFormat,
    /// Serve Prometheus metrics at http://ADDR:PORT/metrics (off by default)
    ///
    /// Every export's counters and latency histograms in Prometheus' text format, over plain
    /// HTTP to whoever can connect: give 127.0.0.1 or a private address. Also the config file's
    /// metrics-listen key (this option wins).
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics_listen: Option<String>,
    /// Nice levels the control threads run below the queue threads (default 10; 0: the same)
    ///
    /// Adding and removing exports (QMP, the mounts and unmounts, final flushes) then takes its
    /// CPU from the exports' I/O only when a CPU is idle. Needs CAP_SYS_NICE (root) to bring
    /// queue threads started by a control thread back up; without it every thread stays at the
    /// daemon's priority.
    #[arg(long, value_name = "LEVELS", default_value_t = crate::priority::CONTROL_NICE,
          value_parser = clap::value_parser!(i32).range(0..=39))]
    pub control_nice: i32,
}

/// `--max-size`, `--offset`, `--size`: the same size syntax as `null:SIZE` images.
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
