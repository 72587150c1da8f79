//! Opening an image from the command line's IMAGE argument, and the enum that dispatches to the
//! concrete backend without dynamic dispatch (async trait methods are not object safe, and a
//! `match` is cheaper than a vtable call anyway).

use std::io;
use std::path::Path;
use std::sync::Arc;

use engine::{Engine, Slice};

use std::os::unix::fs::FileTypeExt;

use crate::lock::Claim;
use crate::qcow2::{Qcow2Backend, Qcow2Options};
use crate::{
    parse_size, Attrs, BlockBackend, Capabilities, IoPath, NbdBackend, NbdOptions, NullBackend,
    RawBackend, Result, Seek,
};

/// Why an image could not be opened. Each message names the problem and what to do.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The path does not exist.
    #[error("image {0} does not exist: check the path")]
    NotFound(String),
    /// The process may not open it.
    #[error("image {0} is not accessible: check its permissions")]
    Permission(String),
    /// `--writable` but the image can only be opened read-only.
    #[error("image {0} cannot be opened for writing (read-only file or filesystem): drop --writable or fix its permissions")]
    ReadOnly(String),
    /// A directory, socket, ...
    #[error("image {0} is not a regular file or block device: give the path of a raw image file or device, or null:SIZE")]
    NotFileOrDevice(String),
    /// `--direct` on a filesystem without O_DIRECT.
    #[error("image {0} is on a filesystem without O_DIRECT support: drop --direct")]
    DirectUnsupported(String),
    /// `null:` with a size that does not parse.
    #[error(
        "bad size {0:?} for null: use a positive size such as null:1G, null:512M or null:4096"
    )]
    BadSize(String),
    /// The image is not a valid or supported image of the format it was opened as.
    #[error("cannot open {path} as {format}: {reason}")]
    Format {
        /// The image path.
        path: String,
        /// The format it was opened as.
        format: &'static str,
        /// What is wrong, and what to do about it where there is something to do.
        reason: String,
    },
    /// `null:SIZE` with a --format other than auto or null, or null with a path.
    #[error("{0}")]
    FormatMismatch(String),
    /// Another process uses the image (or a file it names) in a way the export cannot share.
    #[error(transparent)]
    Lock(#[from] crate::LockError),
    /// An NBD URI that does not parse, a server that cannot be reached or refuses the export.
    #[error("{0}")]
    Nbd(String),
    /// The partition asked for cannot be served.
    #[error(transparent)]
    Partition(#[from] crate::partition::PartitionError),
    /// Anything else the OS reported.
    #[error("cannot open image {path}: {error}")]
    Io {
        /// The image path.
        path: String,
        /// What the OS said (part of the message, deliberately not a `source()`: the binary
        /// prints the whole chain, which would name it twice).
        error: io::Error,
    },
}

impl OpenError {
    pub(crate) fn from_io(path: &str, e: io::Error) -> OpenError {
        match e.kind() {
            io::ErrorKind::NotFound => OpenError::NotFound(path.to_string()),
            io::ErrorKind::PermissionDenied => OpenError::Permission(path.to_string()),
            _ => OpenError::Io {
                path: path.to_string(),
                error: e,
            },
        }
    }
}

/// The format of an image, as given on the command line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Format {
    /// Probe: qcow2, VHD, VDI, VMDK or VHDX if the file's first sector carries that format's
    /// magic, raw otherwise (`null:` specs are null). The choice is logged.
    #[default]
    Auto,
    /// Byte for byte; never probed, so a raw image whose first bytes mimic a header stays raw.
    Raw,
    /// qcow2 (version 2 or 3).
    Qcow2,
    /// VHD (QEMU's `vpc`): fixed or dynamic.
    Vhd,
    /// VMDK: a sparse extent file or a descriptor and its extents.
    Vmdk,
    /// VDI (VirtualBox): static or dynamic.
    Vdi,
    /// VHDX (Hyper-V): fixed or dynamic, or differencing (read-only).
    Vhdx,
    /// `null:SIZE`.
    Null,
}

/// How to open an image.
#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    /// The image format.
    pub format: Format,
    /// Refuse to open files an image names (qcow2 backing and data files, VMDK extents, a
    /// differencing VHDX image's parent).
    pub no_backing: bool,
    /// Open the files an image names with the daemon's credentials even when root serves
    /// another user's image (see `backend::qcow2::named`).
    pub trust_backing: bool,
    /// Open for writing.
    pub writable: bool,
    /// Writes past the end will grow the image (a raw export then claims QEMU's resize
    /// permission too).
    pub growable: bool,
    /// How the image files are locked against QEMU and other fusex instances.
    pub locking: crate::Locking,
    /// O_DIRECT on the image.
    pub direct: bool,
    /// Force a data path instead of probing.
    pub io_path: Option<IoPath>,
    /// For NBD URIs: timeouts, reconnecting, FUA (its `writable` is replaced by the one above).
    pub nbd: NbdOptions,
    /// A qcow2 image's backing chain, in place of the one its header names (see
    /// [`crate::qcow2::BackingLevel`]); refused for other formats.
    pub backing: Option<Vec<crate::qcow2::BackingLevel>>,
    /// A qcow2 image's metadata cache sizes (see [`crate::qcow2::CacheOptions`]); refused for
    /// other formats.
    pub qcow2_cache: crate::qcow2::CacheOptions,
    /// Serve only this partition of the image (numbered as Linux numbers them).
    pub partition: Option<u32>,
    /// Serve only this range of the image (QEMU raw's `offset` and `size`); never with a
    /// partition.
    pub range: Option<ByteRange>,
}

/// A byte range of an image served as the whole file: `size` bytes from `offset`, or all from
/// `offset` to the image's end (fixed when the image is opened).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ByteRange {
    /// The first byte served.
    pub offset: u64,
    /// How many bytes (None: the rest of the image).
    pub size: Option<u64>,
}

/// Any backend fusex can serve.
pub enum AnyBackend {
    /// A raw file or block device.
    Raw(RawBackend),
    /// `null:SIZE`.
    Null(NullBackend),
    /// A qcow2 image (and its backing chain).
    Qcow2(Qcow2Backend),
    /// A VHD image.
    Vhd(crate::vhd::VhdBackend),
    /// A VMDK image.
    Vmdk(crate::vmdk::VmdkBackend),
    /// A VDI image.
    Vdi(crate::vdi::VdiBackend),
    /// A VHDX image.
    Vhdx(crate::vhdx::VhdxBackend),
    /// An export of an NBD server.
    Nbd(NbdBackend),
    /// One partition of an image opened as any of the above (never of another partition).
    Partition(crate::partition::Bounded<Whole>),
}

/// A whole image under a partition: an [`AnyBackend`] that is not itself a partition. Its own
/// dispatch leaves the partition variant out, so a partition's futures never contain another
/// partition's (an async call cycle would need boxing, an allocation per request).
pub struct Whole(Arc<AnyBackend>);

impl Whole {
    /// The image.
    pub fn image(&self) -> &AnyBackend {
        &self.0
    }
}

/// Serves partition `number` of an opened image (other exports may serve other partitions of
/// the same `Arc`); `shown` names the image in errors. An image that is itself a partition is
/// refused.
pub fn open_partition(
    whole: Arc<AnyBackend>,
    number: u32,
    shown: &str,
) -> std::result::Result<AnyBackend, OpenError> {
    if matches!(*whole, AnyBackend::Partition(_)) {
        return Err(OpenError::FormatMismatch(format!(
            "{shown} is a partition already: a partition has no partitions of its own"
        )));
    }
    let whole = Arc::new(Whole(whole));
    Ok(AnyBackend::Partition(crate::partition::bound(
        whole, number, shown,
    )?))
}

/// Whether IMAGE names a file or device (a path) rather than `null:SIZE` or an NBD URI: only a
/// path means something relative to a working directory, or may be canonicalized.
pub fn names_a_path(spec: &str) -> bool {
    !nbd::uri::is_nbd_uri(spec) && !spec.starts_with("null:")
}

/// Opens IMAGE: `null:SIZE`, an NBD URI, or a path, in the format `opts.format` names or probes;
/// with `opts.partition`, one partition of it.
pub fn open(spec: &str, opts: OpenOptions) -> std::result::Result<AnyBackend, OpenError> {
    if let Some(range) = opts.range {
        if opts.partition.is_some() {
            return Err(OpenError::FormatMismatch(format!(
                "a partition and a byte range of {spec} were both asked for: give one"
            )));
        }
        if opts.growable {
            return Err(OpenError::FormatMismatch(format!(
                "a byte range of {spec} cannot grow (its size is fixed): drop --growable"
            )));
        }
        let whole = Arc::new(Whole(Arc::new(open_whole(spec, opts)?)));
        return Ok(AnyBackend::Partition(crate::partition::window(
            whole,
            range.offset,
            range.size,
            spec,
        )?));
    }
    let Some(number) = opts.partition else {
        return open_whole(spec, opts);
    };
    if opts.growable {
        return Err(OpenError::FormatMismatch(format!(
            "partition {number} of {spec} cannot grow (the partition table fixes its size): \
             drop --growable"
        )));
    }
    let whole = open_whole(spec, opts)?;
    open_partition(Arc::new(whole), number, spec)
}

/// The options of [`crate::qcow2::CacheOptions`], as refusals name them.
const CACHE_OPTIONS: &str = "--l2-cache-size, --refcount-cache-size and --cache-clean-interval";

/// [`open`] of the whole image.
fn open_whole(spec: &str, opts: OpenOptions) -> std::result::Result<AnyBackend, OpenError> {
    if opts.backing.is_some() && !names_a_path(spec) {
        return Err(OpenError::FormatMismatch(format!(
            "{spec} has no backing image: --backing is for qcow2 images, drop it"
        )));
    }
    if opts.qcow2_cache != crate::qcow2::CacheOptions::default() && !names_a_path(spec) {
        return Err(OpenError::FormatMismatch(format!(
            "{spec} is not a qcow2 image: {CACHE_OPTIONS} are for qcow2 images, drop them"
        )));
    }
    if nbd::uri::is_nbd_uri(spec) {
        if !matches!(opts.format, Format::Auto | Format::Raw) {
            return Err(OpenError::FormatMismatch(format!(
                "{spec} is an NBD export, served as the server presents it: drop --format"
            )));
        }
        if opts.growable {
            return Err(OpenError::Nbd(format!(
                "{spec}: an NBD export cannot grow: drop --growable"
            )));
        }
        if opts.direct {
            return Err(OpenError::Nbd(format!(
                "{spec}: --direct is for image files; the NBD server decides its own caching \
                 (e.g. qemu-nbd --cache=none): drop --direct"
            )));
        }
        let nbd = NbdOptions {
            writable: opts.writable,
            ..opts.nbd
        };
        return Ok(AnyBackend::Nbd(NbdBackend::open(spec, nbd)?));
    }
    if let Some(size) = spec.strip_prefix("null:") {
        if !matches!(opts.format, Format::Auto | Format::Null) {
            return Err(OpenError::FormatMismatch(format!(
                "{spec} is a null image: drop --format or use --format null"
            )));
        }
        return Ok(AnyBackend::Null(NullBackend::new(
            parse_size(size)?,
            opts.writable,
        )));
    }
    let path = Path::new(spec);
    let format = match opts.format {
        Format::Null => {
            return Err(OpenError::FormatMismatch(format!(
                "--format null needs IMAGE null:SIZE (e.g. null:1G), not {spec}"
            )))
        }
        Format::Auto => {
            let qcow2 = match std::fs::metadata(path) {
                Ok(m) if m.is_file() || m.file_type().is_block_device() => {
                    crate::qcow2::probe(path).map_err(|e| OpenError::from_io(spec, e))?
                }
                // Not a file: the raw backend names the problem.
                _ => false,
            };
            if qcow2 {
                Format::Qcow2
            } else {
                probe_table_formats(path).map_err(|e| OpenError::from_io(spec, e))?
            }
        }
        Format::Qcow2 => {
            // Forced: the image must still be one (auto has just seen the magic itself).
            let meta = std::fs::metadata(path).map_err(|e| OpenError::from_io(spec, e))?;
            if !(meta.is_file() || meta.file_type().is_block_device()) {
                return Err(OpenError::NotFileOrDevice(spec.to_string()));
            }
            if !crate::qcow2::probe(path).map_err(|e| OpenError::from_io(spec, e))? {
                return Err(OpenError::Format {
                    path: spec.to_string(),
                    format: "qcow2",
                    reason: "no qcow2 magic at its start: check the path, or use --format raw"
                        .to_string(),
                });
            }
            Format::Qcow2
        }
        Format::Raw => Format::Raw,
        Format::Vhd | Format::Vmdk | Format::Vdi | Format::Vhdx => {
            let meta = std::fs::metadata(path).map_err(|e| OpenError::from_io(spec, e))?;
            if !(meta.is_file() || meta.file_type().is_block_device()) {
                return Err(OpenError::NotFileOrDevice(spec.to_string()));
            }
            opts.format
        }
    };
    open_as(path, format, opts)
}

/// Whether IMAGE opened as `format` is served through an image format's metadata (qcow2,
/// VHD, ...) rather than byte for byte: such an image's tables change while a writable export
/// serves it, so a successor must not open it before its predecessor let go.
pub fn has_metadata(spec: &str, format: Format) -> bool {
    let path = Path::new(spec);
    match format {
        Format::Raw | Format::Null => false,
        // `null:` and an NBD export are served byte for byte; only a file is probed.
        Format::Auto => {
            names_a_path(spec)
                && (crate::qcow2::probe(path).unwrap_or(false)
                    || probe_table_formats(path).is_ok_and(|f| f != Format::Raw))
        }
        Format::Qcow2 | Format::Vhd | Format::Vmdk | Format::Vdi | Format::Vhdx => true,
    }
}

/// `--format auto` past qcow2: the block-table formats whose magic is at the start of the
/// file (a fixed VHD has its footer only at the end, and is raw to auto, as to QEMU).
fn probe_table_formats(path: &Path) -> io::Result<Format> {
    if crate::vhd::probe(path)? {
        return Ok(Format::Vhd);
    }
    if crate::vmdk::probe(path)? {
        return Ok(Format::Vmdk);
    }
    if crate::vdi::probe(path)? {
        return Ok(Format::Vdi);
    }
    if crate::vhdx::probe(path)? {
        return Ok(Format::Vhdx);
    }
    Ok(Format::Raw)
}

/// Refuses options a block-table format cannot honour: its metadata writes are a few bytes
/// (no O_DIRECT), and it does not grow.
fn table_format_options(
    path: &Path,
    name: &'static str,
    opts: &OpenOptions,
) -> std::result::Result<(), OpenError> {
    let refuse = |reason: &str| OpenError::Format {
        path: path.display().to_string(),
        format: name,
        reason: reason.to_string(),
    };
    if opts.direct {
        return Err(refuse(
            "fusex serves these images through the page cache: drop --direct",
        ));
    }
    if opts.growable {
        return Err(refuse(
            "fusex does not grow these images: drop --growable (resize with `qemu-img resize`)",
        ));
    }
    Ok(())
}

/// Opens the image at `path` as `format` (raw or qcow2).
fn open_as(
    path: &Path,
    format: Format,
    opts: OpenOptions,
) -> std::result::Result<AnyBackend, OpenError> {
    if opts.backing.is_some() && format != Format::Qcow2 {
        return Err(OpenError::FormatMismatch(format!(
            "{} is not a qcow2 image: --backing is for qcow2 images, drop it",
            path.display()
        )));
    }
    if opts.qcow2_cache != crate::qcow2::CacheOptions::default() && format != Format::Qcow2 {
        return Err(OpenError::FormatMismatch(format!(
            "{} is served as {}: {CACHE_OPTIONS} are for qcow2 images, drop them",
            path.display(),
            format!("{format:?}").to_lowercase()
        )));
    }
    match format {
        Format::Qcow2 => Ok(AnyBackend::Qcow2(Qcow2Backend::open(
            path,
            Qcow2Options {
                writable: opts.writable,
                direct: opts.direct,
                no_backing: opts.no_backing,
                locking: opts.locking,
                trust_backing: opts.trust_backing,
                backing: opts.backing.clone(),
                cache: opts.qcow2_cache,
            },
        )?)),
        Format::Vhd => {
            table_format_options(path, "vhd", &opts)?;
            Ok(AnyBackend::Vhd(crate::vhd::open(
                path,
                opts.writable,
                opts.locking,
            )?))
        }
        Format::Vmdk => {
            table_format_options(path, "vmdk", &opts)?;
            Ok(AnyBackend::Vmdk(crate::vmdk::open(
                path,
                crate::vmdk::VmdkOptions {
                    writable: opts.writable,
                    locking: opts.locking,
                    no_backing: opts.no_backing,
                    trust_backing: opts.trust_backing,
                },
            )?))
        }
        Format::Vdi => {
            table_format_options(path, "vdi", &opts)?;
            Ok(AnyBackend::Vdi(crate::vdi::open(
                path,
                opts.writable,
                opts.locking,
            )?))
        }
        Format::Vhdx => {
            table_format_options(path, "vhdx", &opts)?;
            Ok(AnyBackend::Vhdx(crate::vhdx::open(
                path,
                crate::vhdx::VhdxOptions {
                    writable: opts.writable,
                    locking: opts.locking,
                    no_backing: opts.no_backing,
                    trust_backing: opts.trust_backing,
                },
            )?))
        }
        _ => {
            let raw = RawBackend::open(path, opts.writable, opts.direct, opts.io_path)?;
            // The O_DIRECT backend's buffered twin stays unlocked: one description per file
            // carries the locks (see `lock`).
            crate::lock::lock_file(
                raw.file(),
                Claim::raw(opts.locking, opts.writable, opts.growable),
                &format!("image {}", path.display()),
            )?;
            Ok(AnyBackend::Raw(raw))
        }
    }
}

impl AnyBackend {
    /// The NBD export served (that of the whole image under a partition) as it was negotiated:
    /// what a `fusex restart` successor is built from ([`crate::NbdBackend::adopt`]) without
    /// connecting while this process still holds the server's connection. None: not NBD.
    pub fn nbd_export(&self) -> Option<nbd::Export> {
        match self {
            AnyBackend::Nbd(n) => Some(*n.export()),
            AnyBackend::Partition(p) => p.inner().image().nbd_export(),
            _ => None,
        }
    }

    /// What was found at open that an operator may want to see (an NBD server's export: size,
    /// multi-conn, block sizes, block status, structured replies; a qcow2 image's metadata
    /// caches); None when there is nothing beyond the format.
    pub fn details(&self) -> Option<String> {
        if let AnyBackend::Partition(p) = self {
            let whole = p.inner().image().details();
            let what = match p.number() {
                Some(n) => format!("partition {n}"),
                None => "byte range".to_string(),
            };
            return Some(format!(
                "{what} ({} bytes at byte {}){}",
                p.size(),
                p.start(),
                whole.map(|w| format!(" of {w}")).unwrap_or_default()
            ));
        }
        if let AnyBackend::Qcow2(q) = self {
            return Some(q.metadata_cache_description());
        }
        let AnyBackend::Nbd(n) = self else {
            return None;
        };
        let e = n.export();
        let yes = |b: bool| if b { "yes" } else { "no" };
        Some(format!(
            "NBD export {}: {} bytes, multi-conn {}, block sizes {}/{}/{}, block status {}, \
             structured replies {}",
            n.server(),
            e.size,
            yes(n.multi_conn()),
            e.min_block,
            e.preferred_block,
            e.max_payload,
            yes(e.allocation_context.is_some()),
            yes(e.structured)
        ))
    }

    /// The format being served, and for `--format auto` why it was chosen (logged once the
    /// mount is live, so a refusal stays a single line).
    pub fn format_description(&self, probed: bool) -> &'static str {
        match (self, probed) {
            (AnyBackend::Raw(_), false) => "raw",
            (AnyBackend::Raw(_), true) => "raw (auto: no qcow2 magic at its start)",
            (AnyBackend::Qcow2(_), false) => "qcow2",
            (AnyBackend::Qcow2(_), true) => "qcow2 (auto: the image starts with the qcow2 magic)",
            (AnyBackend::Vhd(_), false) => "vhd",
            (AnyBackend::Vhd(_), true) => "vhd (auto: the image starts with a VHD footer)",
            (AnyBackend::Vmdk(_), false) => "vmdk",
            (AnyBackend::Vmdk(_), true) => {
                "vmdk (auto: the image starts with a VMDK sparse header or descriptor)"
            }
            (AnyBackend::Vdi(_), false) => "vdi",
            (AnyBackend::Vdi(_), true) => "vdi (auto: the image carries the VDI signature)",
            (AnyBackend::Vhdx(_), false) => "vhdx",
            (AnyBackend::Vhdx(_), true) => {
                "vhdx (auto: the image starts with the VHDX file type identifier)"
            }
            (AnyBackend::Null(_), _) => "null",
            (AnyBackend::Nbd(_), _) => "nbd",
            (AnyBackend::Partition(p), probed) => p.inner().image().format_description(probed),
        }
    }

    /// The uid owning the image file (a qcow2 image's top file); None for `null:` or when it
    /// cannot be read. SETATTR sets the image's times, which only its owner may without
    /// `CAP_FOWNER`.
    pub fn owner(&self) -> Option<u32> {
        match self {
            AnyBackend::Raw(r) => r.owner().ok(),
            AnyBackend::Qcow2(q) => q.owner().ok(),
            AnyBackend::Vhd(v) => v.owner().ok(),
            AnyBackend::Vmdk(v) => v.owner().ok(),
            AnyBackend::Vdi(v) => v.owner().ok(),
            AnyBackend::Vhdx(v) => v.owner().ok(),
            AnyBackend::Null(_) | AnyBackend::Nbd(_) => None,
            AnyBackend::Partition(p) => p.inner().image().owner(),
        }
    }

    /// Every descriptor data I/O goes to (for registering them with a ring as fixed files).
    pub fn io_fds(&self) -> Vec<std::os::fd::RawFd> {
        match self {
            AnyBackend::Raw(r) => r.io_fds(),
            AnyBackend::Null(_) | AnyBackend::Qcow2(_) | AnyBackend::Nbd(_) => Vec::new(),
            AnyBackend::Partition(p) => p.inner().image().io_fds(),
            AnyBackend::Vhd(_) | AnyBackend::Vmdk(_) | AnyBackend::Vdi(_) | AnyBackend::Vhdx(_) => {
                Vec::new()
            }
        }
    }
}

macro_rules! each {
    ($self:ident, $b:ident => $e:expr) => {
        match $self {
            AnyBackend::Raw($b) => $e,
            AnyBackend::Null($b) => $e,
            AnyBackend::Qcow2($b) => $e,
            AnyBackend::Vhd($b) => $e,
            AnyBackend::Vmdk($b) => $e,
            AnyBackend::Vdi($b) => $e,
            AnyBackend::Vhdx($b) => $e,
            AnyBackend::Nbd($b) => $e,
            AnyBackend::Partition($b) => $e,
        }
    };
}

/// [`each`] for [`Whole`]: the partition variant, which [`open_partition`] never puts under a
/// partition, answers `$none`.
macro_rules! each_whole {
    ($self:ident, $b:ident => $e:expr, $none:expr) => {
        match &*$self.0 {
            AnyBackend::Raw($b) => $e,
            AnyBackend::Null($b) => $e,
            AnyBackend::Qcow2($b) => $e,
            AnyBackend::Vhd($b) => $e,
            AnyBackend::Vmdk($b) => $e,
            AnyBackend::Vdi($b) => $e,
            AnyBackend::Vhdx($b) => $e,
            AnyBackend::Nbd($b) => $e,
            AnyBackend::Partition(_) => $none,
        }
    };
}

fn nested() -> crate::BackendError {
    crate::BackendError::Io(io::Error::from_raw_os_error(libc::EIO))
}

impl BlockBackend for Whole {
    fn size(&self) -> u64 {
        each_whole!(self, b => b.size(), 0)
    }
    fn refresh_size(&self) -> Result<u64> {
        each_whole!(self, b => b.refresh_size(), Err(nested()))
    }
    fn size_limit(&self) -> u64 {
        each_whole!(self, b => b.size_limit(), 0)
    }
    fn capabilities(&self) -> Capabilities {
        each_whole!(self, b => b.capabilities(), Capabilities::default())
    }
    fn durable_writes(&self) -> bool {
        each_whole!(self, b => b.durable_writes(), false)
    }
    async fn attrs(&self, eng: &Engine) -> Result<Attrs> {
        each_whole!(self, b => b.attrs(eng).await, Err(nested()))
    }
    async fn read_at(&self, eng: &Engine, win: Slice, off: u64) -> (Result<usize>, Slice) {
        each_whole!(self, b => b.read_at(eng, win, off).await, (Err(nested()), win))
    }
    async fn write_at(&self, eng: &Engine, win: Slice, off: u64) -> (Result<usize>, Slice) {
        each_whole!(self, b => b.write_at(eng, win, off).await, (Err(nested()), win))
    }
    async fn flush(&self, eng: &Engine) -> Result<()> {
        each_whole!(self, b => b.flush(eng).await, Err(nested()))
    }
    async fn discard(&self, eng: &Engine, off: u64, len: u64) -> Result<()> {
        each_whole!(self, b => b.discard(eng, off, len).await, Err(nested()))
    }
    async fn write_zeroes(&self, eng: &Engine, off: u64, len: u64) -> Result<()> {
        each_whole!(self, b => b.write_zeroes(eng, off, len).await, Err(nested()))
    }
    async fn allocate(&self, eng: &Engine, off: u64, len: u64) -> Result<()> {
        each_whole!(self, b => b.allocate(eng, off, len).await, Err(nested()))
    }
    async fn seek(&self, eng: &Engine, off: u64, whence: Seek) -> Result<Option<u64>> {
        each_whole!(self, b => b.seek(eng, off, whence).await, Err(nested()))
    }
    async fn resize(&self, eng: &Engine, new_size: u64) -> Result<()> {
        each_whole!(self, b => b.resize(eng, new_size).await, Err(nested()))
    }
    async fn grow_to(&self, eng: &Engine, new_size: u64) -> Result<()> {
        each_whole!(self, b => b.grow_to(eng, new_size).await, Err(nested()))
    }
    fn written_to(&self, end: u64) {
        each_whole!(self, b => b.written_to(end), ())
    }
    fn set_times(&self, atime: Option<(i64, u32)>, mtime: Option<(i64, u32)>) -> Result<()> {
        each_whole!(self, b => b.set_times(atime, mtime), Err(nested()))
    }
    fn queue_stopping(&self) {
        each_whole!(self, b => b.queue_stopping(), ())
    }
    fn queue_ended(&self) {
        each_whole!(self, b => b.queue_ended(), ())
    }
    fn trouble(&self) -> Option<String> {
        each_whole!(self, b => b.trouble(), None)
    }
    fn drop_unused(&self) {
        each_whole!(self, b => b.drop_unused(), ())
    }
    fn stats(&self) -> crate::BackendStats {
        each_whole!(self, b => b.stats(), crate::BackendStats::default())
    }
}

impl BlockBackend for AnyBackend {
    fn size(&self) -> u64 {
        each!(self, b => b.size())
    }
    fn refresh_size(&self) -> Result<u64> {
        each!(self, b => b.refresh_size())
    }
    fn size_limit(&self) -> u64 {
        each!(self, b => b.size_limit())
    }
    fn capabilities(&self) -> Capabilities {
        each!(self, b => b.capabilities())
    }
    fn splice_fd(&self) -> Option<std::os::fd::RawFd> {
        match self {
            AnyBackend::Raw(r) => r.splice_fd(),
            AnyBackend::Null(_)
            | AnyBackend::Qcow2(_)
            | AnyBackend::Nbd(_)
            | AnyBackend::Vhd(_)
            | AnyBackend::Vmdk(_)
            | AnyBackend::Vdi(_)
            | AnyBackend::Vhdx(_)
            | AnyBackend::Partition(_) => None,
        }
    }
    fn durable_writes(&self) -> bool {
        each!(self, b => b.durable_writes())
    }
    async fn attrs(&self, eng: &Engine) -> Result<Attrs> {
        each!(self, b => b.attrs(eng).await)
    }
    async fn read_at(&self, eng: &Engine, win: Slice, off: u64) -> (Result<usize>, Slice) {
        each!(self, b => b.read_at(eng, win, off).await)
    }
    async fn write_at(&self, eng: &Engine, win: Slice, off: u64) -> (Result<usize>, Slice) {
        each!(self, b => b.write_at(eng, win, off).await)
    }
    async fn flush(&self, eng: &Engine) -> Result<()> {
        each!(self, b => b.flush(eng).await)
    }
    async fn discard(&self, eng: &Engine, off: u64, len: u64) -> Result<()> {
        each!(self, b => b.discard(eng, off, len).await)
    }
    async fn write_zeroes(&self, eng: &Engine, off: u64, len: u64) -> Result<()> {
        each!(self, b => b.write_zeroes(eng, off, len).await)
    }
    async fn allocate(&self, eng: &Engine, off: u64, len: u64) -> Result<()> {
        each!(self, b => b.allocate(eng, off, len).await)
    }
    async fn seek(&self, eng: &Engine, off: u64, whence: Seek) -> Result<Option<u64>> {
        each!(self, b => b.seek(eng, off, whence).await)
    }
    async fn resize(&self, eng: &Engine, new_size: u64) -> Result<()> {
        each!(self, b => b.resize(eng, new_size).await)
    }
    async fn grow_to(&self, eng: &Engine, new_size: u64) -> Result<()> {
        each!(self, b => b.grow_to(eng, new_size).await)
    }
    fn written_to(&self, end: u64) {
        each!(self, b => b.written_to(end))
    }
    fn set_times(&self, atime: Option<(i64, u32)>, mtime: Option<(i64, u32)>) -> Result<()> {
        each!(self, b => b.set_times(atime, mtime))
    }
    fn queue_stopping(&self) {
        each!(self, b => b.queue_stopping())
    }
    fn queue_ended(&self) {
        each!(self, b => b.queue_ended())
    }
    fn trouble(&self) -> Option<String> {
        each!(self, b => b.trouble())
    }
    fn drop_unused(&self) {
        each!(self, b => b.drop_unused())
    }
    fn stats(&self) -> crate::BackendStats {
        each!(self, b => b.stats())
    }
}

#[cfg(test)]
mod error_tests {
    use super::*;

    #[test]
    fn os_error_is_printed_once() {
        let e = OpenError::Io {
            path: "/img".into(),
            error: io::Error::from_raw_os_error(libc::EROFS),
        };
        // What the binary prints: the message, then every source.
        let mut text = e.to_string();
        let mut cur = std::error::Error::source(&e);
        while let Some(c) = cur {
            text.push_str(&format!(": {c}"));
            cur = c.source();
        }
        assert_eq!(text.matches("(os error 30)").count(), 1, "{text}");
    }
}

#[cfg(test)]
mod future_size_tests {
    use super::*;

    /// Every request slot's task of every export holds a backend operation's future, sized for
    /// the largest format's: a format that keeps much state inline (several block allocations
    /// at once, say) grows the memory of all exports. 4 KiB bounds it (about 2.5 KiB today;
    /// 33 KiB once, with four allocations' state inline, which took 100 idle exports of
    /// `fusex serve` from 22 to 52 MiB).
    #[test]
    fn backend_operation_futures_stay_small() {
        let eng = Engine::new(&engine::EngineConfig {
            buffers: 2,
            buffer_size: 4096,
            ..Default::default()
        })
        .unwrap();
        let b = AnyBackend::Null(crate::null::NullBackend::new(4096, true));
        let w = b.write_at(&eng, eng.take_buffer().unwrap().slice(0..10), 0);
        let r = b.read_at(&eng, eng.take_buffer().unwrap().slice(0..10), 0);
        for (what, size) in [
            ("write_at", std::mem::size_of_val(&w)),
            ("read_at", std::mem::size_of_val(&r)),
        ] {
            assert!(size <= 4096, "{what}'s future takes {size} bytes");
        }
    }
}

#[cfg(test)]
mod spec_tests {
    use super::*;

    #[test]
    fn only_paths_name_a_path() {
        for spec in [
            "null:1073741824",
            "null:1G",
            "nbd://host/export",
            "nbd+unix:///e?socket=/s",
        ] {
            assert!(!names_a_path(spec), "{spec}");
        }
        // A path that merely contains the prefixes is a path.
        for spec in ["disk.img", "/images/null:1G", "./nbd://x", "dir/null:5"] {
            assert!(names_a_path(spec), "{spec}");
        }
    }
}
