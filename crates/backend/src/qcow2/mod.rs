//! qcow2 images through imago, served as their guest-visible raw bytes.
//!
//! imago does the format (mapping, cluster allocation, compressed clusters, backing chains); its
//! storage is [`RingFile`], so every image and metadata access runs on the calling queue's ring.
//! A read lands in the FUSE request's own buffer: imago splits it by mapping and hands the pieces
//! of that buffer to `RingFile`, which lends them to the kernel.
//!
//! One image is shared by every queue. imago's caches and allocation locks are thread-safe; the
//! one operation that must run alone is a discard that frees clusters (it may invalidate a
//! mapping another request is writing through), so requests pass an `IoGate` shared and a
//! discard passes it exclusive.

mod backing;
pub mod check;
pub mod damage;
pub mod named;

pub use backing::{check_chain, BackingError, BackingLevel};

use std::cell::RefCell;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::cow::{ClusterBuffers, RegionLocks};
use crate::gate::IoGate;
use engine::{Engine, EngineConfig, Slice};
use imago::format::builder::FormatDriverBuilder;
use imago::format::gate::ImplicitOpenGate;
use imago::qcow2::Qcow2;
use imago::{FormatAccess, Mapping, ShallowMapping, StorageOpenOptions};

use crate::lock::{lock_file, Claim, LockError, Locking};
use crate::ringfile::RingFile;
use crate::{Attrs, BackendError, BlockBackend, Capabilities, OpenError, Result, Seek};

/// The first four bytes of every qcow2 image.
pub const QCOW2_MAGIC: [u8; 4] = *b"QFI\xfb";

/// Metadata cache budget of the top image: three quarters L2 tables, one quarter refcount blocks
/// (at least two of each, at most imago's default 128 and 32). Only its refcount share (4 MiB)
/// still sizes a cache: the top image's L2 cache defaults to [`TOP_L2_CACHE_BYTES`]. See
/// "Memory" in docs/design.md.
pub const TOP_CACHE_BYTES: u64 = 16 << 20;
/// The top image's L2 cache where the user gives no size: QEMU's default ceiling (32 MiB, which
/// maps 256 GiB of guest with 64 KiB clusters), as at most
/// [`imago::qcow2::MAX_SPLIT_ENTRIES`] tables. Tables are loaded as requests need them, so a
/// smaller image never holds more than the tables it has; with a ceiling of 128 tables (8 GiB
/// mapped with 4 KiB clusters, 64 GiB with 64 KiB) random reads over a larger image read a
/// table for most requests.
pub const TOP_L2_CACHE_BYTES: u64 = 32 << 20;
/// Metadata cache budget of each qcow2 image of the backing chain (read-only: only its L2 share is
/// ever filled).
pub const BACKING_CACHE_BYTES: u64 = 4 << 20;

/// Longest backing chain fusex opens (a guard against absurd chains; loops are caught exactly);
/// VHDX differencing chains are bounded by it too.
pub(crate) const MAX_CHAIN: usize = 64;

/// Whether the file at `path` starts with the qcow2 magic (for `--format auto`).
pub fn probe(path: &Path) -> io::Result<bool> {
    use std::os::unix::fs::FileExt;
    let f = File::open(path)?;
    let mut magic = [0u8; 4];
    match f.read_exact_at(&mut magic, 0) {
        Ok(()) => Ok(magic == QCOW2_MAGIC),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

/// Checks the header fields fusex relies on before imago sees the image: imago cannot decrypt,
/// and serving ciphertext would be silently wrong; a virtual size the L1 table cannot cover (or
/// one past what a file offset can name) is a corrupt or hostile header.
fn precheck_header(f: &File) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    if f.metadata()?.len() < 104 {
        // Shorter than a version 3 header (every real image is longer): imago names that.
        return Ok(());
    }
    let mut h = [0u8; 48];
    match f.read_exact_at(&mut h, 0) {
        Ok(()) => {}
        // Too short to hold a header: imago names that.
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
        Err(e) => return Err(e),
    }
    let be32 = |o: usize| u32::from_be_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
    let cluster_bits = be32(20);
    let size = u64::from_be_bytes([h[24], h[25], h[26], h[27], h[28], h[29], h[30], h[31]]);
    let crypt_method = be32(32);
    let l1_size = be32(36);
    let be64 = |o: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&h[o..o + 8]);
        u64::from_be_bytes(b)
    };
    let l1_offset = be64(40);
    if crypt_method != 0 {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "the image is encrypted (crypt_method {crypt_method}), which fusex does not \
                 support: decrypt it with `qemu-img convert` first"
            ),
        ));
    }
    if size > i64::MAX as u64 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("its header gives a virtual size of {size} bytes, more than a file can hold"),
        ));
    }
    // Leave cluster sizes imago refuses (outside 512 B..2 MiB) to imago's own message.
    if (9..=21).contains(&cluster_bits) {
        // Each L1 entry maps one L2 table: cluster_size / 8 clusters.
        let per_entry = 1u64 << (2 * cluster_bits - 3);
        let covered = u64::from(l1_size).saturating_mul(per_entry);
        if covered < size {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "its header gives a virtual size of {size} bytes but its L1 table covers only \
                     {covered}: the image is corrupt (see `qemu-img check`)"
                ),
            ));
        }
    }
    check_l1(f, l1_offset, l1_size)
}

/// The largest virtual size an image with this header's cluster size can have and still open
/// here: what [`MAX_L1_ENTRIES`] L2 tables map (2 PiB with 64 KiB clusters). Growing past it would
/// make an image fusex (and QEMU) refuse at the next open.
fn guest_size_limit(f: &File) -> u64 {
    let Some(cluster_bits) = cluster_bits(f) else {
        return 0;
    };
    let per_entry = 1u64 << (2 * cluster_bits - 3);
    u64::from(MAX_L1_ENTRIES)
        .saturating_mul(per_entry)
        .min(i64::MAX as u64)
}

/// The header's cluster size as a power of two, if it is one imago opens (512 B to 2 MiB).
fn cluster_bits(f: &File) -> Option<u32> {
    use std::os::unix::fs::FileExt;
    let mut b = [0u8; 4];
    f.read_exact_at(&mut b, 20).ok()?;
    let bits = u32::from_be_bytes(b);
    (9..=21).contains(&bits).then_some(bits)
}

/// Largest L1 table fusex reads (qemu's limit too: 32 MiB, 4 Mi entries).
const MAX_L1_ENTRIES: u32 = 4 << 20;
/// Bits 9..55 of an L1 entry: the L2 table's offset in the image file.
const L1_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;

/// Refuses L1 entries that point past the end of the image file. imago reads storage past its
/// end as zeroes (a freshly allocated cluster at the end of the file is only partly written), so
/// such an L2 table would silently read as "unallocated" instead of failing.
fn check_l1(f: &File, l1_offset: u64, l1_size: u32) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    if l1_size == 0 {
        return Ok(());
    }
    if l1_size > MAX_L1_ENTRIES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("its L1 table has {l1_size} entries, more than the 4 Mi qcow2 allows"),
        ));
    }
    let len = f.metadata()?.len();
    let mut table = vec![0u8; l1_size as usize * 8];
    f.read_exact_at(&mut table, l1_offset).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!(
                "its L1 table at offset {l1_offset} cannot be read ({e}): the file is truncated \
                 or its header corrupt"
            ),
        )
    })?;
    for (i, e) in table.chunks_exact(8).enumerate() {
        let mut b = [0u8; 8];
        b.copy_from_slice(e);
        let l2 = u64::from_be_bytes(b) & L1_OFFSET_MASK;
        if l2 != 0 && l2 >= len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "L1 entry {i} points at offset {l2}, past the end of the file ({len} bytes): \
                     the image is corrupt (see `qemu-img check`)"
                ),
            ));
        }
    }
    Ok(())
}

/// How to open a qcow2 image.
#[derive(Clone, Debug, Default)]
pub struct Qcow2Options {
    /// Open the top image for writing (backing files are always read-only).
    pub writable: bool,
    /// O_DIRECT on every file of the chain.
    pub direct: bool,
    /// Refuse to open files the image names (backing files, external data files): for
    /// untrusted images, whose header could point anywhere.
    pub no_backing: bool,
    /// How the image and the files it names are locked (see [`crate::lock`]).
    pub locking: Locking,
    /// When root serves an image another user owns, open the files it names with root's
    /// credentials rather than the owner's (see [`named`]).
    pub trust_backing: bool,
    /// The backing chain to use instead of the one the header names (checked by
    /// [`check_chain`]); None: the header's.
    pub backing: Option<Vec<BackingLevel>>,
    /// The top image's metadata cache sizes, where the user gave them (QEMU's `l2-cache-size`
    /// and `refcount-cache-size`).
    pub cache: CacheOptions,
}

/// A qcow2 image's metadata caches as the user set them (QEMU's `l2-cache-size`,
/// `refcount-cache-size` and `cache-clean-interval`); what is left out keeps its default.
/// The sizes are bytes, each cache its own where given, else [`TOP_L2_CACHE_BYTES`] (L2) and
/// its share of [`TOP_CACHE_BYTES`] (refcount); each keeps at least two tables and at most
/// [`imago::qcow2::MAX_SPLIT_ENTRIES`] (an eviction scans the cache).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheOptions {
    /// The L2 table cache.
    pub l2: Option<u64>,
    /// The refcount block cache.
    pub refcount: Option<u64>,
    /// Seconds after which tables nobody used are dropped from the caches of the image and
    /// its backing chain, 0 for never; [`DEFAULT_CLEAN_INTERVAL`] where not given.
    pub clean_interval: Option<u32>,
}

/// How long a cached metadata table may go unused before it is dropped, where the user did not
/// say: QEMU's default `cache-clean-interval` (10 minutes), so that an image left idle gives its
/// cache memory back as it would in QEMU.
pub const DEFAULT_CLEAN_INTERVAL: u32 = 600;

/// When the metadata caches are next looked over for unused tables (see
/// [`Qcow2Backend::drop_unused`]).
struct Cleaning {
    every: Duration,
    next: Mutex<Instant>,
}

/// A qcow2 image (with its backing chain).
pub struct Qcow2Backend {
    image: FormatAccess<RingFile>,
    /// Requests enter shared; a discard that frees clusters enters exclusive.
    gate: IoGate,
    /// The top image file, for attributes (owner, mode, times).
    meta: File,
    size: AtomicU64,
    /// The largest virtual size fusex lets the image grow to (see [`guest_size_limit`]).
    size_limit: u64,
    writable: bool,
    /// Guest bytes mapped to data (here or in a backing file), as of the last count.
    allocated: AtomicU64,
    /// Something changed the mapping since `allocated` was counted.
    mapping_changed: AtomicBool,
    /// Copy-on-write ahead of imago (see [`crate::cow`]), for writable images with a backing
    /// file.
    cow: Option<Box<CowAhead>>,
    /// The image path, for messages.
    path: PathBuf,
    /// An overlap check has failed and been logged.
    corrupt_logged: AtomicBool,
    /// How many L2 tables and refcount blocks the top image's caches keep.
    cache_entries: (usize, usize),
    /// Dropping unused metadata tables: None when `cache-clean-interval` is 0.
    cleaning: Option<Cleaning>,
    /// The image file's length at open and its cluster size (log2; None if the header could not
    /// be read again), for the clusters allocated since.
    opened_len: u64,
    host_cluster_bits: Option<u32>,
    /// Copy-ahead writes and the bytes they read (see [`crate::cow`]): counted on that slow
    /// path only.
    copy_ahead: AtomicU64,
    copy_ahead_bytes: AtomicU64,
}

/// What copying backed clusters ahead of imago needs.
struct CowAhead {
    cluster_bits: u32,
    locks: RegionLocks,
    buffers: ClusterBuffers,
}

/// Decides which files an image may open implicitly, and catches loops in the chain.
#[derive(Clone)]
struct Gate {
    no_backing: bool,
    direct: bool,
    /// Canonical paths of every file opened for this chain so far.
    opened: Rc<RefCell<Vec<PathBuf>>>,
    image: PathBuf,
    locking: Locking,
    /// Whose credentials named files are opened with.
    who: named::OpenAs,
    /// `--trust-backing`: named files are opened as the daemon whoever owns the image.
    trust_backing: bool,
    /// A lock conflict on a named file, kept typed: imago turns the error `open_storage`
    /// returns into its own.
    lock_error: Rc<RefCell<Option<LockError>>>,
}

impl Gate {
    /// Refuses every named file under `--no-backing`, before anything touches it.
    fn allowed(&self, path: &Path) -> io::Result<()> {
        if self.no_backing {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "it names {} (a backing or data file) and --no-backing refuses to open it: \
                     drop --no-backing if the image is trusted",
                    named::shown_path(path)
                ),
            ));
        }
        Ok(())
    }

    /// Records a file opened for this chain by its canonical path, refusing loops and chains
    /// longer than [`MAX_CHAIN`].
    fn admit(&self, canon: PathBuf) -> io::Result<()> {
        let mut opened = self.opened.borrow_mut();
        if opened.contains(&canon) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "backing loop: {} appears twice in the chain of {}: fix it with `qemu-img rebase`",
                    named::shown_path(&canon),
                    named::shown_path(&self.image)
                ),
            ));
        }
        if opened.len() >= MAX_CHAIN {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("backing chain longer than {MAX_CHAIN} images"),
            ));
        }
        opened.push(canon);
        Ok(())
    }
}

impl ImplicitOpenGate<RingFile> for Gate {
    async fn open_format<F: FormatDriverBuilder<RingFile>>(
        &mut self,
        builder: F,
    ) -> io::Result<FormatAccess<RingFile>> {
        // The file behind it came through `open_storage`, which admitted it; a builder with a
        // path of its own opens that path through `open_storage` too.
        // Backing images are only ever read.
        let inst = Box::pin(builder.write(false).open(self.clone())).await?;
        Ok(FormatAccess::new(inst))
    }

    async fn open_storage(&mut self, opts: StorageOpenOptions) -> io::Result<RingFile> {
        let path = opts
            .get_filename()
            .ok_or_else(|| io::Error::other("an implicit file without a name"))?
            .to_path_buf();
        self.allowed(&path)?;
        // Only the top image's external data file is ever opened writable.
        let direct = self.direct || opts.get_direct();
        let (who, shown) = (self.who, named::shown_path(&path));
        let described = |e: io::Error| {
            let kind = e.kind();
            match (who, e.raw_os_error()) {
                (named::OpenAs::Owner(uid, _), Some(libc::EACCES | libc::EPERM)) => io::Error::new(
                    kind,
                    format!(
                        "it names {shown}, which its owner (uid {uid}) may not open, and \
                             fusex runs as root: pass --trust-backing if the image is trusted"
                    ),
                ),
                _ => io::Error::new(
                    kind,
                    format!("its backing or data file {shown} cannot be opened: {e}"),
                ),
            }
        };
        self.open_chain_file(&path, opts.get_writable(), direct, who, described)
    }
}

impl Gate {
    /// Opens a file of this chain as `who` (never hangs, type-checked; an open error goes
    /// through `described`), records it against loops and locks it as a data file
    /// (`writable`) or a backing file.
    fn open_chain_file(
        &self,
        path: &Path,
        writable: bool,
        direct: bool,
        who: named::OpenAs,
        described: impl FnOnce(io::Error) -> io::Error,
    ) -> io::Result<RingFile> {
        let shown = named::shown_path(path);
        let (file, canon) = named::open(path, writable, direct, who).map_err(described)?;
        self.admit(canon)?;
        let file = RingFile::from_file(file, path, direct)?;
        let subject = format!(
            "{} file {} of image {}",
            if writable { "data" } else { "backing" },
            shown,
            named::shown_path(&self.image)
        );
        let claim = if writable {
            Claim::qcow2(self.locking, true)
        } else {
            Claim::backing(self.locking)
        };
        // Held until imago drops the file, i.e. for the export's lifetime.
        if let Err(e) = lock_file(file.file(), claim, &subject) {
            let msg = e.to_string();
            *self.lock_error.borrow_mut() = Some(e);
            return Err(io::Error::new(io::ErrorKind::ResourceBusy, msg));
        }
        Ok(file)
    }

    /// This gate for the files the image at `path` names: opened with the credentials of the
    /// one who owns that image (see [`named::OpenAs::for_image`]).
    fn for_named_by(&self, image: &std::fs::Metadata) -> Gate {
        Gate {
            who: named::OpenAs::for_image(image, self.trust_backing),
            ..self.clone()
        }
    }
}

/// Runs the integrity pass ([`check`]) on an image about to be opened for writing: allocation
/// and mapping trust its refcounts and tables, so a damaged image is refused, untouched.
fn integrity(meta: &File, shown: &str) -> std::result::Result<check::Summary, OpenError> {
    let started = std::time::Instant::now();
    match check::check(meta) {
        Ok(s) => {
            tracing::debug!(
                path = %shown,
                clusters = s.clusters,
                windows = s.windows,
                ms = started.elapsed().as_millis() as u64,
                "qcow2 integrity pass"
            );
            if s.leaked > 0 {
                tracing::info!(
                    "{shown}: {} leaked clusters (space only; `qemu-img check -r leaks` reclaims it)",
                    s.leaked
                );
            }
            Ok(s)
        }
        Err(check::CheckError::Io(e)) => Err(OpenError::from_io(shown, e)),
        Err(e @ check::CheckError::Damaged { .. }) => Err(OpenError::Format {
            path: shown.to_string(),
            format: "qcow2",
            reason: format!(
                "its metadata is damaged, so writing could destroy data: {e}: repair it with \
                 `qemu-img check -r all {shown}` (on a copy first), or export it read-only"
            ),
        }),
    }
}

fn format_error(path: &str, e: io::Error) -> OpenError {
    OpenError::Format {
        path: path.to_string(),
        format: "qcow2",
        reason: one_line(&e.to_string()),
    }
}

/// imago's messages can span lines (context chains) and quote names from the image; the CLI
/// promises one line, with nothing raw from the image in it.
fn one_line(s: &str) -> String {
    named::escaped(&s.split_whitespace().collect::<Vec<_>>().join(" "))
}

impl Qcow2Backend {
    /// The uid owning the top image file: who may set its times without `CAP_FOWNER`.
    pub fn owner(&self) -> io::Result<u32> {
        use std::os::unix::fs::MetadataExt;
        Ok(self.meta.metadata()?.uid())
    }

    /// How many L2 tables and refcount blocks the top image's metadata caches keep, as the
    /// cluster size and [`Qcow2Options::cache`] made them.
    pub fn metadata_cache_entries(&self) -> (usize, usize) {
        self.cache_entries
    }

    /// One pass of [`BlockBackend::drop_unused`] now, whatever the interval: for tests that race
    /// passes against requests. How many tables it dropped.
    #[doc(hidden)]
    pub fn drop_unused_now(&self) -> usize {
        self.image.drop_unused_metadata()
    }

    /// How many L2 tables and refcount blocks the top image's caches hold right now (`None` for
    /// a cache locked at this moment).
    pub fn metadata_cached(&self) -> (Option<usize>, Option<usize>) {
        (self.image.inner() as &dyn std::any::Any)
            .downcast_ref::<Qcow2<RingFile>>()
            .map_or((None, None), |q| q.metadata_cached())
    }

    /// The top image's metadata caches in a line for the log: how many tables, how much
    /// memory, and how much of the guest the L2 tables map at once.
    pub fn metadata_cache_description(&self) -> String {
        let (l2, rb) = self.cache_entries;
        let tables = format!("qcow2 metadata caches: {l2} L2 tables and {rb} refcount blocks");
        let Some(bits) = self.host_cluster_bits else {
            return tables;
        };
        let cluster = 1u64 << bits;
        // An L2 table is a cluster of 8-byte entries, each mapping a cluster.
        let mapped = l2 as u64 * (cluster / 8) * cluster;
        format!(
            "{tables} of {} KiB, {} KiB in all; the L2 tables map {} MiB of guest at once",
            cluster >> 10,
            ((l2 + rb) as u64 * cluster) >> 10,
            mapped >> 20
        )
    }

    /// Opens the image at `path` and its backing chain, on a short-lived engine of this thread.
    pub fn open(path: &Path, opts: Qcow2Options) -> std::result::Result<Qcow2Backend, OpenError> {
        let shown = path.display().to_string();
        let top = RingFile::open_path(path, opts.writable, opts.direct).map_err(|e| {
            match e.raw_os_error() {
                Some(libc::EROFS | libc::EACCES | libc::EPERM | libc::ETXTBSY) if opts.writable => {
                    OpenError::ReadOnly(shown.clone())
                }
                Some(libc::EINVAL) if opts.direct => OpenError::DirectUnsupported(shown.clone()),
                _ => OpenError::from_io(&shown, e),
            }
        })?;
        // The top file's own description carries its locks, held while imago keeps it open.
        lock_file(
            top.file(),
            Claim::qcow2(opts.locking, opts.writable),
            &format!("image {shown}"),
        )?;
        let meta = File::open(path).map_err(|e| OpenError::from_io(&shown, e))?;
        precheck_header(&meta).map_err(|e| format_error(&shown, e))?;
        let protect = if opts.writable {
            integrity(&meta, &shown)?.protect
        } else {
            Vec::new()
        };
        let size_limit = guest_size_limit(&meta);
        let canon = std::fs::canonicalize(path).map_err(|e| OpenError::from_io(&shown, e))?;
        let gate = Gate {
            no_backing: opts.no_backing,
            direct: opts.direct,
            opened: Rc::new(RefCell::new(vec![canon])),
            image: path.to_path_buf(),
            locking: opts.locking,
            who: named::OpenAs::for_image(
                &meta.metadata().map_err(|e| OpenError::from_io(&shown, e))?,
                opts.trust_backing,
            ),
            trust_backing: opts.trust_backing,
            lock_error: Rc::default(),
        };
        let lock_error = gate.lock_error.clone();
        let eng = Engine::new(&EngineConfig {
            sq_entries: 16,
            ..EngineConfig::default()
        })
        .map_err(|e| OpenError::Io {
            path: shown.clone(),
            error: io::Error::other(e.to_string()),
        })?;
        let explicit = opts.backing.as_deref().filter(|l| !l.is_empty());
        let opened = eng.block_on(async {
            let mut builder = Qcow2::<RingFile>::builder(top)
                .metadata_cache_bytes(TOP_CACHE_BYTES, BACKING_CACHE_BYTES)
                .protect_metadata(protect)
                .write(opts.writable);
            builder = builder.metadata_cache_split(
                Some(opts.cache.l2.unwrap_or(TOP_L2_CACHE_BYTES)),
                opts.cache.refcount,
            );
            if let Some(levels) = explicit {
                builder = builder.backing(backing::open_chain(levels, &gate).await?);
            }
            let q = builder.open(gate).await?;
            let backed = match explicit {
                Some(levels) => !matches!(levels.first(), None | Some(BackingLevel::None)),
                None => q.implicit_backing_file().is_some(),
            };
            let entries = q.metadata_cache_entries();
            Ok::<_, io::Error>((FormatAccess::new(q), backed, entries))
        });
        if let Some(e) = lock_error.borrow_mut().take() {
            return Err(e.into());
        }
        let (access, backed, cache_entries) = match opened {
            Ok(r) => r.map_err(|e| format_error(&shown, e))?,
            Err(e) => {
                return Err(OpenError::Io {
                    path: shown,
                    error: io::Error::other(e.to_string()),
                })
            }
        };
        let size = access.size();
        tracing::debug!(path = %shown, size, backed, "opened qcow2 image");
        let host_cluster_bits = cluster_bits(&meta);
        let opened_len = meta.metadata().map_or(0, |m| m.len());
        let cow = match host_cluster_bits {
            Some(bits) if backed && opts.writable => Some(Box::new(CowAhead {
                cluster_bits: bits,
                locks: RegionLocks::new(bits),
                buffers: ClusterBuffers::new(1 << bits, access.mem_align()),
            })),
            _ => None,
        };
        Ok(Qcow2Backend {
            image: access,
            gate: IoGate::default(),
            meta,
            size: AtomicU64::new(size),
            size_limit,
            writable: opts.writable,
            allocated: AtomicU64::new(0),
            // Counted on the first GETATTR, not here: a hostile header can make the walk long.
            mapping_changed: AtomicBool::new(true),
            cow,
            path: path.to_path_buf(),
            corrupt_logged: AtomicBool::new(false),
            cache_entries,
            cleaning: match opts.cache.clean_interval.unwrap_or(DEFAULT_CLEAN_INTERVAL) {
                0 => None,
                secs => {
                    let every = Duration::from_secs(secs.into());
                    Some(Cleaning {
                        every,
                        next: Mutex::new(Instant::now() + every),
                    })
                }
            },
            opened_len,
            host_cluster_bits,
            copy_ahead: AtomicU64::new(0),
            copy_ahead_bytes: AtomicU64::new(0),
        })
    }

    fn changed(&self) {
        self.mapping_changed.store(true, Ordering::Release);
    }

    /// Grows the image to `new_size` rounded up to a multiple of 512 if it is smaller (callers
    /// hold the gate shared: imago serializes growing itself). QEMU counts a qcow2 image's size
    /// in 512-byte sectors and would not see the bytes of a partial last sector: an image fusex
    /// grew must read the same in every tool.
    async fn grow(&self, new_size: u64) -> Result<()> {
        let new_size = new_size
            .checked_next_multiple_of(SECTOR)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EFBIG))?;
        if new_size > self.image.size() {
            self.image
                .resize_grow(new_size, imago::format::PreallocateMode::None)
                .await?;
            self.changed();
        }
        self.size.fetch_max(self.image.size(), Ordering::AcqRel);
        Ok(())
    }
}

impl Qcow2Backend {
    /// Writes `data` at `off` on an image with a backing file (the caller holds the gate
    /// shared, and the range is not [`RegionLocks::too_wide`]). A write inside one cluster that the backing file still provides becomes a write
    /// of the whole cluster, its other bytes read first, outside imago's L2 lock (see
    /// [`crate::cow`]); every other write enters its regions shared and goes to imago as is.
    async fn write_backed(&self, cow: &CowAhead, data: &[u8], off: u64) -> io::Result<()> {
        let cs = 1u64 << cow.cluster_bits;
        let len = data.len() as u64;
        let cstart = off & !(cs - 1);
        let within_one = len > 0 && len < cs && off + len <= cstart + cs;
        if within_one && cstart + cs <= self.image.size() && self.backed(cstart, cs).await? {
            let _x = cow.locks.region_of(cstart).exclusive().await;
            // Another write may have copied the cluster while this one waited.
            if self.backed(cstart, cs).await? {
                let mut buf = cow.buffers.take()?;
                let r = self.copy_ahead(&mut buf, data, off, cstart).await;
                cow.buffers.put(buf);
                self.copy_ahead.fetch_add(1, Ordering::Relaxed);
                self.copy_ahead_bytes.fetch_add(cs - len, Ordering::Relaxed);
                return r;
            }
            return self.image.write(data, off).await;
        }
        let _regions = cow.locks.shared(off, len).await;
        self.image.write(data, off).await
    }

    /// Reads cluster `cstart` whole, lays `data` over it at `off` and writes the whole cluster.
    async fn copy_ahead(
        &self,
        buf: &mut imago::io_buffers::IoBuffer,
        data: &[u8],
        off: u64,
        cstart: u64,
    ) -> io::Result<()> {
        let whole = buf.as_mut().into_slice();
        self.image.read(&mut *whole, cstart).await?;
        let at = (off - cstart) as usize;
        whole[at..at + data.len()].copy_from_slice(data);
        self.image.write(&*whole, cstart).await
    }

    /// Whether the top image takes cluster `cstart` (of `cs` bytes) from a backing file, or
    /// otherwise needs a copy before it can be written (a compressed or shared cluster).
    async fn backed(&self, cstart: u64, cs: u64) -> io::Result<bool> {
        let (m, _) = self.image.get_shallow_mapping(cstart, cs).await?;
        Ok(matches!(
            m,
            ShallowMapping::Indirect { .. }
                | ShallowMapping::Raw {
                    writable: false,
                    ..
                }
                | ShallowMapping::Special { .. }
        ))
    }
}

/// A qcow2 image's size is a whole number of these (QEMU's sector).
const SECTOR: u64 = 512;

/// Most mapping runs one `st_blocks` count walks (a fragmented, fully allocated 16 GiB image with
/// 64 KiB clusters has 262,144); past that the count falls back to the image file's own
/// allocation, so a huge or hostile image cannot stall a queue in GETATTR.
const MAX_COUNT_RUNS: u32 = 1 << 18;

/// Guest bytes that map to data anywhere in the chain (for `st_blocks`); `None` if the mapping
/// has more runs than [`MAX_COUNT_RUNS`].
async fn count_allocated(img: &FormatAccess<RingFile>) -> io::Result<Option<u64>> {
    let size = img.size();
    let mut off = 0u64;
    let mut total = 0u64;
    let mut runs = 0u32;
    while off < size {
        runs += 1;
        if runs > MAX_COUNT_RUNS {
            return Ok(None);
        }
        let (m, len) = img.get_mapping(off, size - off).await?;
        if len == 0 {
            break;
        }
        if matches!(m, Mapping::Raw { .. } | Mapping::Special { .. }) {
            total += len;
        }
        off += len;
    }
    Ok(Some(total))
}

impl Qcow2Backend {
    /// An error of one request: imago's own errors (corrupt metadata, out-of-range cluster
    /// offsets) carry no errno and become EIO. An overlap check's error (a write that would have
    /// landed on metadata) is logged once: imago has marked the image corrupt and refuses every
    /// later write, so the export is read-only from then on.
    fn io_err(&self, e: io::Error) -> BackendError {
        if e.raw_os_error().is_some() {
            return BackendError::Io(e);
        }
        let msg = one_line(&e.to_string());
        if msg.contains(imago::qcow2::CORRUPTION_PREFIX) {
            if !self.corrupt_logged.swap(true, Ordering::AcqRel) {
                tracing::error!(
                    "{}: {msg}: the export is read-only from now on (writes fail with EIO, \
                     reads go on): stop it and repair the image with `qemu-img check -r all`",
                    named::shown_path(&self.path)
                );
            }
        } else {
            tracing::warn!("qcow2 request failed: {msg}");
        }
        BackendError::Io(io::Error::from_raw_os_error(libc::EIO))
    }
}

impl BlockBackend for Qcow2Backend {
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    fn drop_unused(&self) {
        let Some(c) = &self.cleaning else {
            return;
        };
        let now = Instant::now();
        {
            let mut next = c.next.lock().unwrap_or_else(|p| p.into_inner());
            if now < *next {
                return;
            }
            *next = now + c.every;
        }
        // Tables used since the previous pass stay; a cache busy right now is looked over at
        // the next pass.
        let dropped = self.image.drop_unused_metadata();
        if dropped > 0 {
            tracing::debug!(
                path = %self.path.display(),
                dropped,
                "dropped qcow2 metadata tables unused for {} s",
                c.every.as_secs()
            );
        }
    }

    fn stats(&self) -> crate::BackendStats {
        let grown = self
            .meta
            .metadata()
            .map_or(0, |m| m.len().saturating_sub(self.opened_len));
        let (l2, rb) = self.metadata_cached();
        crate::BackendStats {
            qcow2: Some(crate::Qcow2Stats {
                metadata_tables: l2.zip(rb).map(|(l2, rb)| (l2 + rb) as u64),
                clusters_allocated: self.host_cluster_bits.map_or(0, |b| grown >> b),
                copy_ahead: self.copy_ahead.load(Ordering::Relaxed),
                copy_ahead_bytes: self.copy_ahead_bytes.load(Ordering::Relaxed),
            }),
            ..Default::default()
        }
    }

    fn size_limit(&self) -> u64 {
        self.size_limit
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            writable: self.writable,
            resize: self.writable,
            passthrough: crate::PassthroughSource::Formatted,
            ..Capabilities::default()
        }
    }

    async fn attrs(&self, _eng: &Engine) -> Result<Attrs> {
        if self.mapping_changed.swap(false, Ordering::AcqRel) {
            let _g = self.gate.shared().await;
            match count_allocated(&self.image).await {
                Ok(Some(n)) => self.allocated.store(n, Ordering::Release),
                Ok(None) => {
                    let host = self.meta.metadata()?.blocks() * 512;
                    self.allocated.store(host, Ordering::Release);
                }
                Err(e) => {
                    // A corrupt table in some range fails the requests for that range, not
                    // every stat: report the file's own allocation instead.
                    tracing::warn!(
                        "counting allocated clusters failed ({}); st_blocks shows the image file's allocation",
                        one_line(&e.to_string())
                    );
                    let host = self.meta.metadata()?.blocks() * 512;
                    self.allocated.store(host, Ordering::Release);
                }
            }
        }
        let m = self.meta.metadata()?;
        Ok(Attrs {
            perm: m.mode() & 0o7777,
            uid: m.uid(),
            gid: m.gid(),
            allocated: self.allocated.load(Ordering::Acquire),
            atime: (m.atime(), m.atime_nsec() as u32),
            mtime: (m.mtime(), m.mtime_nsec() as u32),
            ctime: (m.ctime(), m.ctime_nsec() as u32),
        })
    }

    async fn read_at(&self, _eng: &Engine, mut win: Slice, off: u64) -> (Result<usize>, Slice) {
        let size = self.size();
        if off >= size {
            return (Ok(0), win);
        }
        let n = (win.len() as u64).min(size - off) as usize;
        let g = self.gate.shared().await;
        let r = self.image.read(&mut win.as_mut_slice()[..n], off).await;
        drop(g);
        (r.map(|()| n).map_err(|e| self.io_err(e)), win)
    }

    async fn write_at(&self, _eng: &Engine, win: Slice, off: u64) -> (Result<usize>, Slice) {
        let n = win.len();
        let Some(end) = off.checked_add(n as u64) else {
            return (Err(io::Error::from_raw_os_error(libc::EFBIG).into()), win);
        };
        // A write wider than the region gates (never a FUSE write: those are at most 1 MiB)
        // runs alone on an image whose clusters may be copied ahead.
        let wide = self
            .cow
            .as_ref()
            .is_some_and(|c| c.locks.too_wide(off, n as u64));
        let (shared, alone) = if wide {
            (None, Some(self.gate.exclusive().await))
        } else {
            (Some(self.gate.shared().await), None)
        };
        if end > self.image.size() {
            // The export lets writes past the end through only for growable images.
            if let Err(e) = self.grow(end).await {
                return (Err(e), win);
            }
        }
        let r = match &self.cow {
            Some(cow) if !wide => self.write_backed(cow, win.as_slice(), off).await,
            _ => self.image.write(win.as_slice(), off).await,
        };
        drop((shared, alone));
        self.changed();
        (r.map(|()| n).map_err(|e| self.io_err(e)), win)
    }

    async fn flush(&self, _eng: &Engine) -> Result<()> {
        let _g = self.gate.shared().await;
        self.image.flush().await.map_err(|e| self.io_err(e))?;
        self.image.sync().await.map_err(|e| self.io_err(e))
    }

    async fn discard(&self, _eng: &Engine, off: u64, len: u64) -> Result<()> {
        // Freeing clusters may break mappings other requests hold: run alone.
        let g = self.gate.exclusive().await;
        // SAFETY: not a memory-safety contract but imago's "no concurrent data mappings": the
        // exclusive gate waits until no request is inside the image and keeps new ones out.
        let r = unsafe { self.image.discard_to_zero_unsafe(off, len) }.await;
        drop(g);
        self.changed();
        r.map_err(|e| self.io_err(e))
    }

    async fn write_zeroes(&self, _eng: &Engine, off: u64, len: u64) -> Result<()> {
        let r = match self.cow.as_ref() {
            Some(cow) if !cow.locks.too_wide(off, len) => {
                let _g = self.gate.shared().await;
                let _regions = cow.locks.shared(off, len).await;
                self.image.write_zeroes(off, len).await
            }
            Some(_) => {
                // Too wide for the region gates: no copy ahead may run meanwhile.
                let _x = self.gate.exclusive().await;
                self.image.write_zeroes(off, len).await
            }
            None => {
                let _g = self.gate.shared().await;
                self.image.write_zeroes(off, len).await
            }
        };
        self.changed();
        r.map_err(|e| self.io_err(e))
    }

    async fn allocate(&self, _eng: &Engine, _off: u64, _len: u64) -> Result<()> {
        // Inside the image every range is writable already; qcow2 allocates clusters on write.
        Ok(())
    }

    async fn seek(&self, _eng: &Engine, off: u64, whence: Seek) -> Result<Option<u64>> {
        let _g = self.gate.shared().await;
        let size = self.image.size();
        let mut pos = off;
        let mut runs = 0u32;
        while pos < size {
            runs += 1;
            if runs > MAX_COUNT_RUNS {
                // Too long a walk for one request: report data here and no hole before the end,
                // which is always allowed (holes may be reported as data).
                return Ok(Some(match whence {
                    Seek::Data => pos,
                    Seek::Hole => size,
                }));
            }
            let (m, len) = self
                .image
                .get_mapping(pos, size - pos)
                .await
                .map_err(|e| self.io_err(e))?;
            if len == 0 {
                break;
            }
            let data = matches!(m, Mapping::Raw { .. } | Mapping::Special { .. });
            match (whence, data) {
                (Seek::Data, true) | (Seek::Hole, false) => return Ok(Some(pos)),
                _ => pos += len,
            }
        }
        Ok(match whence {
            Seek::Data => None,
            Seek::Hole => Some(size),
        })
    }

    async fn resize(&self, _eng: &Engine, new_size: u64) -> Result<()> {
        if new_size < self.size() {
            // imago shrinks only through `&mut` access, which a shared image never has.
            tracing::warn!("shrinking a qcow2 image is not supported: use `qemu-img resize`");
            return Err(BackendError::Unsupported);
        }
        if !new_size.is_multiple_of(SECTOR) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL).into());
        }
        let _g = self.gate.shared().await;
        self.grow(new_size).await
    }

    async fn grow_to(&self, _eng: &Engine, new_size: u64) -> Result<()> {
        let _g = self.gate.shared().await;
        self.grow(new_size).await
    }

    fn written_to(&self, end: u64) {
        self.size.fetch_max(end, Ordering::AcqRel);
    }

    fn set_times(&self, atime: Option<(i64, u32)>, mtime: Option<(i64, u32)>) -> Result<()> {
        crate::raw::set_file_times(self.meta.as_raw_fd(), atime, mtime)
    }
}
