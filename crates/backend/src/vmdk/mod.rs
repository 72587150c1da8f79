//! VMDK images: a descriptor (a text file, or embedded in a hosted sparse extent) listing
//! extents that make up the disk in order: SPARSE (hosted sparse extent files, on the
//! block-table core, `sparse`), FLAT and VMFS (a raw file from an offset) and ZERO. The
//! createTypes monolithicSparse, twoGbMaxExtentSparse, monolithicFlat, twoGbMaxExtentFlat and
//! vmfs are served read-write, streamOptimized read-only. Requests are split at extent
//! boundaries and each piece goes to its extent's file on the queue's ring ([`RingFile`]).
//!
//! The files a descriptor names are untrusted names (see [`extent_path`]): they must lie in
//! the descriptor's own directory unless `--trust-backing`, `--no-backing` refuses them all,
//! and they are opened as the qcow2 backend opens files an image names
//! (`crate::qcow2::named`: non-blocking, type-checked, with the image owner's credentials when
//! root serves another user's image, within a time limit), each locked as QEMU locks a
//! VMDK's files.

pub mod descriptor;
pub mod header;
mod sparse;

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use engine::{Engine, Slice};

use crate::blocktable::{fixed, ParseError, TableImage, MAX_ENTRIES};
use crate::lock::{lock_file, Claim, Locking};
use crate::qcow2::named::{self, shown, shown_path, OpenAs};
use crate::ringfile::RingFile;
use crate::{Attrs, BackendError, BlockBackend, Capabilities, OpenError, Result, Seek};

use descriptor::{Access, Descriptor, ExtentKind};
use sparse::Sparse;

/// Whether the file at `path` is a VMDK: a sparse extent (`KDMV`) or a text descriptor
/// ([`descriptor::recognised`]).
pub fn probe(path: &Path) -> io::Result<bool> {
    let f = File::open(path)?;
    let mut head = [0u8; descriptor::PROBE_BYTES];
    let n = read_head(&f, &mut head)?;
    Ok(header::is_sparse(&head[..n]) || descriptor::recognised(&head[..n]))
}

/// Reads the start of `f` into `head` (a short read stops only at the file's end); the bytes
/// read.
fn read_head(f: &File, head: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < head.len() {
        match f.read_at(&mut head[n..], n as u64)? {
            0 => break,
            got => n += got,
        }
    }
    Ok(n)
}

/// How to open a VMDK image.
#[derive(Clone, Copy, Debug)]
pub struct VmdkOptions {
    /// Open for writing.
    pub writable: bool,
    /// How the files are locked.
    pub locking: Locking,
    /// Refuse every file the descriptor names (images whose data is in other files).
    pub no_backing: bool,
    /// Extent files may lie anywhere and open with the daemon's credentials.
    pub trust_backing: bool,
}

/// Where an extent's data is.
enum Data {
    /// A hosted sparse extent.
    Sparse(Box<TableImage<Sparse>>),
    /// A raw file from `offset` bytes on.
    Flat { file: Arc<RingFile>, offset: u64 },
    /// Zeroes.
    Zero,
}

/// One extent, placed in the guest disk.
struct Extent {
    /// Its first guest byte.
    start: u64,
    /// Its length in bytes.
    len: u64,
    access: Access,
    data: Data,
}

/// A VMDK image served as its guest bytes.
pub struct VmdkBackend {
    extents: Vec<Extent>,
    size: u64,
    writable: bool,
    /// The image file named on the command line (descriptor or sparse extent): its attributes
    /// and times are the export's.
    main: File,
    create_type: String,
    /// A write into a ZERO or NOACCESS extent was logged (once).
    refused_logged: AtomicBool,
}

fn eio() -> io::Error {
    io::Error::from_raw_os_error(libc::EIO)
}

/// Resolves an extent's file name from the descriptor in `dir`: relative names stay below
/// `dir` (no absolute names, no `..`) unless `trust`.
pub fn extent_path(dir: &Path, name: &str, trust: bool) -> std::result::Result<PathBuf, String> {
    let p = Path::new(name);
    if !trust {
        if p.is_absolute() {
            return Err(format!(
                "its descriptor names extent file {} by an absolute path: fusex opens only \
                 extents beside the descriptor (give --trust-backing if you trust this image)",
                shown(name)
            ));
        }
        if p.components().any(|c| matches!(c, Component::ParentDir)) {
            return Err(format!(
                "its descriptor names extent file {} outside its own directory (..): fusex \
                 opens only extents beside the descriptor (give --trust-backing if you trust \
                 this image)",
                shown(name)
            ));
        }
    }
    Ok(dir.join(p))
}

/// Opens the VMDK image at `path`.
pub fn open(path: &Path, opts: VmdkOptions) -> std::result::Result<VmdkBackend, OpenError> {
    let shown_image = path.display().to_string();
    let bad = |reason: String| OpenError::Format {
        path: shown_image.clone(),
        format: "vmdk",
        reason,
    };
    let io_err = |e: io::Error| OpenError::from_io(&shown_image, e);
    let (main, main_len) = crate::blocktable::open_locked(path, opts.writable, opts.locking)?;
    let mut head = [0u8; descriptor::PROBE_BYTES];
    let n = read_head(main.file(), &mut head).map_err(io_err)?;
    if header::is_sparse(&head[..n]) {
        // A sparse extent file is a disk by itself: its own single extent.
        let main_file = main.file().try_clone().map_err(io_err)?;
        let (image, desc) = sparse_extent(main, main_len, opts.writable, None)
            .map_err(|e| e.into_open_error(&shown_image, "vmdk"))?;
        let create_type = match desc {
            Some(d) => {
                let d = descriptor::parse(&d).map_err(bad)?;
                if d.has_parent {
                    return Err(bad(parent_refusal()));
                }
                d.create_type
            }
            None => "monolithicSparse".into(),
        };
        let size = image.size();
        tracing::debug!(path = %shown_image, size, create_type, "opened vmdk sparse image");
        return Ok(VmdkBackend {
            extents: vec![Extent {
                start: 0,
                len: size,
                access: Access::ReadWrite,
                data: Data::Sparse(Box::new(image)),
            }],
            size,
            writable: opts.writable,
            main: main_file,
            create_type,
            refused_logged: AtomicBool::new(false),
        });
    }
    if !descriptor::recognised(&head[..n]) {
        return Err(bad(
            "no VMDK sparse extent header (KDMV) and no descriptor (# Disk DescriptorFile, or \
             comment lines and a version= line) at its start: check the path, or use --format \
             raw"
            .into(),
        ));
    }
    if main_len > descriptor::MAX_DESCRIPTOR {
        return Err(bad(format!(
            "its descriptor is {main_len} bytes, more than fusex reads ({} KiB)",
            descriptor::MAX_DESCRIPTOR >> 10
        )));
    }
    let mut text = vec![0u8; main_len as usize];
    main.file().read_exact_at(&mut text, 0).map_err(io_err)?;
    let d = descriptor::parse(&text).map_err(bad)?;
    if d.has_parent {
        return Err(bad(parent_refusal()));
    }
    let main_file = main.file().try_clone().map_err(io_err)?;
    let who = OpenAs::for_image(&main_file.metadata().map_err(io_err)?, opts.trust_backing);
    let dir = path
        .parent()
        .map(|p| {
            if p.as_os_str().is_empty() {
                Path::new(".")
            } else {
                p
            }
        })
        .unwrap_or(Path::new("."));
    let extents = open_extents(&d, dir, opts, who, main_file.metadata().map_err(io_err)?)
        .map_err(|e| e.into_open_error(&shown_image, "vmdk"))?;
    let size = d.sectors() * 512;
    tracing::debug!(path = %shown_image, size, create_type = d.create_type, extents = extents.len(), "opened vmdk image");
    Ok(VmdkBackend {
        extents,
        size,
        writable: opts.writable,
        main: main_file,
        create_type: d.create_type,
        refused_logged: AtomicBool::new(false),
    })
}

fn parent_refusal() -> String {
    "it is a delta image (its descriptor names a parent), which fusex does not serve: make a \
     standalone copy with qemu-img convert -O vmdk"
        .into()
}

/// Most grain table entries the sparse extents of one image hold together: 32 Mi (256 MiB
/// of memory), a 2 TiB disk in 64 KiB grains (the largest split disk [`descriptor::MAX_EXTENTS`]
/// has in mind). Each extent's own table is bounded by [`MAX_ENTRIES`] too, but a descriptor
/// lists up to 4096 extents.
pub const MAX_IMAGE_ENTRIES: u64 = 4 * MAX_ENTRIES;

/// The sparse extents of a descriptor need more grain table entries in all than
/// [`MAX_IMAGE_ENTRIES`].
#[derive(Debug, thiserror::Error)]
#[error(
    "its sparse extents need more than {MAX_IMAGE_ENTRIES} grain table entries in all \
     ({} MiB of memory; {entries} by extent {extent}), more than fusex holds for one image: the \
     descriptor or an extent header is corrupt, or the image is too large to serve",
    (MAX_IMAGE_ENTRIES * 8) >> 20
)]
pub struct TooManyGrains {
    /// The running total once extent `extent` is counted.
    pub entries: u64,
    /// The extent (1-based, in descriptor order) that went past the limit.
    pub extent: usize,
}

/// Opens a sparse extent whose file is open: the core's image and the embedded descriptor.
/// `served`: the guest bytes of it the descriptor uses (None: all of its capacity).
fn sparse_extent(
    file: RingFile,
    len: u64,
    writable: bool,
    served: Option<u64>,
) -> std::result::Result<(TableImage<Sparse>, Option<Vec<u8>>), ParseError> {
    let o = sparse::open(file.file(), len, writable, served)?;
    Ok((
        TableImage::new(file, o.fmt, o.table, o.layout),
        o.descriptor,
    ))
}

/// A file extents use: a sparse extent's own, or a flat file with the byte ranges its
/// extents take.
enum Slot {
    Sparse,
    Flat(Arc<RingFile>, Vec<(u64, u64)>),
}

/// A sparse extent whose file is open and whose grains were counted; its table is read once
/// every extent is counted.
struct Pending {
    file: RingFile,
    /// The file's length.
    flen: u64,
    writable: bool,
    /// The name as the descriptor gives it.
    name: String,
}

/// Opens every extent the descriptor lists: first every file (checked, locked, and for a
/// sparse extent its header read to count the grain table entries it will need, against
/// [`MAX_IMAGE_ENTRIES`]), then the sparse extents' tables, so an image needing too many is
/// refused before any table is made.
fn open_extents(
    d: &Descriptor,
    dir: &Path,
    opts: VmdkOptions,
    who: OpenAs,
    descriptor_meta: std::fs::Metadata,
) -> std::result::Result<Vec<Extent>, ParseError> {
    let canon_dir = std::fs::canonicalize(dir)?;
    // Files by their identity: flat extents may share one file (at different offsets); a
    // sparse extent's file is its own.
    let mut files: BTreeMap<(u64, u64), Slot> = BTreeMap::new();
    let descriptor_id = (descriptor_meta.dev(), descriptor_meta.ino());
    let mut planned: Vec<(Extent, Option<Pending>)> = Vec::with_capacity(d.extents.len());
    let mut entries = 0u64;
    let mut start = 0u64;
    for (i, e) in d.extents.iter().enumerate() {
        let len = e.sectors * 512;
        let n = i + 1;
        let mut pending = None;
        let data = match (e.kind, &e.file) {
            (ExtentKind::Zero, _) | (_, None) => Data::Zero,
            (kind, Some(name)) => {
                if opts.no_backing {
                    return Err(format!(
                        "--no-backing: its data is in extent file {} the descriptor names",
                        shown(name)
                    )
                    .into());
                }
                let path = extent_path(dir, name, opts.trust_backing)?;
                let writable = opts.writable && e.access == Access::ReadWrite;
                let (file, canon) = named::open(&path, writable, false, who).map_err(|err| {
                    format!("cannot open its extent file {}: {err}", shown_path(&path))
                })?;
                if !opts.trust_backing && !canon.starts_with(&canon_dir) {
                    return Err(format!(
                        "its extent file {} resolves to {}, outside the descriptor's directory \
                         (a symlink?): give --trust-backing if you trust this image",
                        shown(name),
                        shown_path(&canon)
                    )
                    .into());
                }
                let meta = file.metadata()?;
                let id = (meta.dev(), meta.ino());
                if id == descriptor_id {
                    return Err(format!(
                        "extent {n} names the descriptor file itself ({})",
                        shown(name)
                    )
                    .into());
                }
                let flen = if meta.is_file() {
                    meta.len()
                } else {
                    use std::os::fd::AsRawFd;
                    crate::raw::blkdev_size(file.as_raw_fd())?
                };
                match kind {
                    ExtentKind::Sparse => {
                        if files.contains_key(&id) {
                            return Err(format!(
                                "extent {n} names {} again: a sparse extent's file is its own",
                                shown(name)
                            )
                            .into());
                        }
                        lock_file(
                            &file,
                            Claim::qcow2(opts.locking, writable),
                            &format!("extent file {}", shown_path(&path)),
                        )
                        .map_err(|l| l.to_string())?;
                        entries += sparse::entries(&file, flen, Some(len))
                            .map_err(|f| in_extent_file(f, name))?;
                        if entries > MAX_IMAGE_ENTRIES {
                            return Err(TooManyGrains { entries, extent: n }.to_string().into());
                        }
                        let rf = RingFile::from_file(file, &path, false)?;
                        // Taken by a sparse extent: no other extent may use it.
                        files.insert(id, Slot::Sparse);
                        pending = Some(Pending {
                            file: rf,
                            flen,
                            writable,
                            name: name.clone(),
                        });
                        Data::Zero
                    }
                    _ => {
                        let offset = e
                            .offset
                            .checked_mul(512)
                            .filter(|o| o.checked_add(len).is_some())
                            .ok_or_else(|| format!("extent {n}'s offset is too large"))?;
                        let range = (offset, offset + len);
                        let slot = match files.get_mut(&id) {
                            Some(Slot::Sparse) => {
                                return Err(format!(
                                    "extent {n} names {}, a sparse extent's file",
                                    shown(name)
                                )
                                .into())
                            }
                            Some(slot) => slot,
                            None => {
                                lock_file(
                                    &file,
                                    Claim::qcow2(opts.locking, writable),
                                    &format!("extent file {}", shown_path(&path)),
                                )
                                .map_err(|l| l.to_string())?;
                                let rf = Arc::new(RingFile::from_file(file, &path, false)?);
                                files.entry(id).or_insert(Slot::Flat(rf, Vec::new()))
                            }
                        };
                        let Slot::Flat(rf, ranges) = slot else {
                            return Err(eio().into());
                        };
                        if ranges.iter().any(|r| r.0 < range.1 && range.0 < r.1) {
                            return Err(format!(
                                "extent {n} overlaps another extent in {}",
                                shown(name)
                            )
                            .into());
                        }
                        ranges.push(range);
                        Data::Flat {
                            file: rf.clone(),
                            offset,
                        }
                    }
                }
            }
        };
        planned.push((
            Extent {
                start,
                len,
                access: e.access,
                data,
            },
            pending,
        ));
        start += len;
    }
    let mut extents = Vec::with_capacity(planned.len());
    for (mut extent, pending) in planned {
        if let Some(p) = pending {
            let (image, _) = sparse_extent(p.file, p.flen, p.writable, Some(extent.len))
                .map_err(|f| in_extent_file(f, &p.name))?;
            if image.size() < extent.len {
                return Err(format!(
                    "its extent file {} holds {} bytes, less than the {} its descriptor gives it",
                    shown(&p.name),
                    image.size(),
                    extent.len
                )
                .into());
            }
            extent.data = Data::Sparse(Box::new(image));
        }
        extents.push(extent);
    }
    Ok(extents)
}

/// A sparse extent file's refusal, naming the file.
fn in_extent_file(e: ParseError, name: &str) -> ParseError {
    match e {
        ParseError::Bad(r) => format!("its extent file {}: {r}", shown(name)).into(),
        io => io,
    }
}

impl VmdkBackend {
    /// The uid owning the image file.
    pub fn owner(&self) -> io::Result<u32> {
        Ok(self.main.metadata()?.uid())
    }

    /// The createType the descriptor gives.
    pub fn create_type(&self) -> &str {
        &self.create_type
    }

    /// The extent holding guest byte `off` (which the caller keeps below the size).
    fn extent_at(&self, off: u64) -> Option<&Extent> {
        let i = self.extents.partition_point(|e| e.start + e.len <= off);
        self.extents.get(i)
    }

    /// The extent holding guest byte `at`, where `at` is in it, and how many of the `left`
    /// bytes from `at` on lie in that extent.
    fn piece(&self, at: u64, left: u64) -> io::Result<(&Extent, u64, u64)> {
        let e = self.extent_at(at).ok_or_else(eio)?;
        let within = at - e.start;
        Ok((e, within, (e.len - within).min(left)))
    }

    fn refused(&self, what: &str) -> io::Error {
        if !self.refused_logged.swap(true, Ordering::AcqRel) {
            tracing::warn!("a write into a {what} extent of the VMDK image failed with EIO");
        }
        eio()
    }

    async fn read(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        let mut done = 0usize;
        while done < buf.len() {
            let (e, within, n) = self.piece(off + done as u64, (buf.len() - done) as u64)?;
            let n = n as usize;
            let piece = &mut buf[done..done + n];
            match (&e.data, e.access) {
                (_, Access::NoAccess) => return Err(eio()),
                (Data::Zero, _) => piece.fill(0),
                (Data::Flat { file, offset }, _) => file.read_full(piece, offset + within).await?,
                (Data::Sparse(t), _) => t.read(piece, within).await?,
            }
            done += n;
        }
        Ok(())
    }

    async fn write(&self, data: &[u8], off: u64) -> io::Result<()> {
        let mut done = 0usize;
        while done < data.len() {
            let (e, within, n) = self.piece(off + done as u64, (data.len() - done) as u64)?;
            let n = n as usize;
            let piece = &data[done..done + n];
            match (&e.data, e.access) {
                (_, Access::ReadOnly) => return Err(io::Error::from_raw_os_error(libc::EROFS)),
                (_, Access::NoAccess) => return Err(self.refused("NOACCESS")),
                (Data::Zero, _) => return Err(self.refused("ZERO")),
                (Data::Flat { file, offset }, _) => file.write_full(piece, offset + within).await?,
                (Data::Sparse(t), _) => t.write(piece, within).await?,
            }
            done += n;
        }
        Ok(())
    }

    async fn zero(&self, off: u64, len: u64) -> io::Result<()> {
        let end = off.saturating_add(len).min(self.size);
        let mut at = off;
        while at < end {
            let (e, within, n) = self.piece(at, end - at)?;
            match (&e.data, e.access) {
                (_, Access::ReadOnly) => return Err(io::Error::from_raw_os_error(libc::EROFS)),
                (_, Access::NoAccess) => return Err(eio()),
                (Data::Zero, _) => {}
                (Data::Flat { file, offset }, _) => file.zero_range(offset + within, n).await?,
                (Data::Sparse(t), _) => t.zero(within, n).await?,
            }
            at += n;
        }
        Ok(())
    }
}

impl BlockBackend for VmdkBackend {
    fn size(&self) -> u64 {
        self.size
    }

    fn size_limit(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        fixed::capabilities(self.writable)
    }

    async fn attrs(&self, eng: &Engine) -> Result<Attrs> {
        let m = self.main.metadata()?;
        let mut allocated = 0u64;
        for e in &self.extents {
            allocated += match &e.data {
                Data::Sparse(t) => t.attrs(eng).await?.allocated.min(e.len),
                Data::Flat { .. } => e.len,
                Data::Zero => 0,
            };
        }
        Ok(fixed::attrs(&m, allocated))
    }

    async fn read_at(&self, _eng: &Engine, mut win: Slice, off: u64) -> (Result<usize>, Slice) {
        if off >= self.size {
            return (Ok(0), win);
        }
        let n = (win.len() as u64).min(self.size - off) as usize;
        let r = self.read(&mut win.as_mut_slice()[..n], off).await;
        (r.map(|()| n).map_err(BackendError::Io), win)
    }

    async fn write_at(&self, _eng: &Engine, win: Slice, off: u64) -> (Result<usize>, Slice) {
        if !self.writable {
            return (Err(io::Error::from_raw_os_error(libc::EROFS).into()), win);
        }
        let n = win.len();
        match off.checked_add(n as u64) {
            Some(end) if end <= self.size => {}
            _ => return (Err(io::Error::from_raw_os_error(libc::EFBIG).into()), win),
        }
        let r = self.write(win.as_slice(), off).await;
        (r.map(|()| n).map_err(BackendError::Io), win)
    }

    async fn flush(&self, eng: &Engine) -> Result<()> {
        for (i, e) in self.extents.iter().enumerate() {
            match &e.data {
                Data::Sparse(t) => t.flush(eng).await?,
                Data::Flat { file, .. } => {
                    // A file several extents share is synced once.
                    let earlier = self.extents[..i].iter().any(
                        |x| matches!(&x.data, Data::Flat { file: f, .. } if Arc::ptr_eq(f, file)),
                    );
                    if !earlier {
                        file.sync_data().await?;
                    }
                }
                Data::Zero => {}
            }
        }
        Ok(())
    }

    async fn discard(&self, _eng: &Engine, off: u64, len: u64) -> Result<()> {
        if !self.writable {
            return Err(io::Error::from_raw_os_error(libc::EROFS).into());
        }
        Ok(self.zero(off, len).await?)
    }

    async fn write_zeroes(&self, _eng: &Engine, off: u64, len: u64) -> Result<()> {
        if !self.writable {
            return Err(io::Error::from_raw_os_error(libc::EROFS).into());
        }
        Ok(self.zero(off, len).await?)
    }

    async fn allocate(&self, _eng: &Engine, _off: u64, _len: u64) -> Result<()> {
        // Grains are allocated on write; flat extents are allocated already.
        Ok(())
    }

    async fn seek(&self, eng: &Engine, off: u64, whence: Seek) -> Result<Option<u64>> {
        let mut at = off;
        while at < self.size {
            let Some(e) = self.extent_at(at) else { break };
            let within = at - e.start;
            let found = match &e.data {
                Data::Sparse(t) => t
                    .seek(eng, within, whence)
                    .await?
                    .filter(|&f| f < e.len)
                    .map(|f| e.start + f),
                Data::Flat { .. } => (whence == Seek::Data).then_some(at),
                Data::Zero => (whence == Seek::Hole).then_some(at),
            };
            if let Some(f) = found {
                return Ok(Some(f));
            }
            at = e.start + e.len;
        }
        Ok(match whence {
            Seek::Data => None,
            Seek::Hole => Some(self.size.max(off)),
        })
    }

    async fn resize(&self, _eng: &Engine, new_size: u64) -> Result<()> {
        fixed::resize("vmdk", self.size, new_size)
    }

    async fn grow_to(&self, _eng: &Engine, new_size: u64) -> Result<()> {
        fixed::grow_to(self.size, new_size)
    }

    fn written_to(&self, _end: u64) {}

    fn set_times(&self, atime: Option<(i64, u32)>, mtime: Option<(i64, u32)>) -> Result<()> {
        use std::os::fd::AsRawFd;
        crate::raw::set_file_times(self.main.as_raw_fd(), atime, mtime)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocktable::testing;

    /// A sparse extent of `capacity` sectors in 64 KiB grains, 512 entries a grain table, its
    /// grain directory (all 0: nothing allocated) at sector 1, `gdes` entries long.
    fn extent_file(capacity: u64, gdes: u64) -> Vec<u8> {
        let gd_sectors = (gdes * 4).div_ceil(512);
        let mut b = vec![0u8; 512 * (1 + gd_sectors as usize)];
        b[0..4].copy_from_slice(&header::MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&1u32.to_le_bytes());
        b[8..12].copy_from_slice(&1u32.to_le_bytes());
        b[12..20].copy_from_slice(&capacity.to_le_bytes());
        b[20..28].copy_from_slice(&128u64.to_le_bytes());
        b[44..48].copy_from_slice(&512u32.to_le_bytes());
        b[56..64].copy_from_slice(&1u64.to_le_bytes());
        b[64..72].copy_from_slice(&(1 + gd_sectors).to_le_bytes());
        b
    }

    /// A twoGbMaxExtentSparse descriptor in `dir` over `n` extent files made by `file`, each
    /// given `sectors` by its extent line.
    fn split_image(
        dir: &tempfile::TempDir,
        n: usize,
        sectors: u64,
        file: impl Fn() -> Vec<u8>,
    ) -> PathBuf {
        let mut text = "# Disk DescriptorFile\nversion=1\nCID=fffffffe\nparentCID=ffffffff\n\
                        createType=\"twoGbMaxExtentSparse\"\n"
            .to_string();
        for i in 0..n {
            testing::write_img(dir, &format!("d-s{i:04}.vmdk"), &file());
            text += &format!("RW {sectors} SPARSE \"d-s{i:04}.vmdk\"\n");
        }
        testing::write_img(dir, "d.vmdk", text.as_bytes())
    }

    fn opts() -> VmdkOptions {
        VmdkOptions {
            writable: false,
            locking: Locking::Off,
            no_backing: false,
            trust_backing: false,
        }
    }

    /// Tiny extent files whose headers claim 8 Mi grains (512 GiB) each: the tables hold
    /// what the descriptor serves (one grain each), not what the headers claim.
    #[test]
    fn tables_are_sized_by_the_descriptor() {
        let dir = tempfile::tempdir().unwrap();
        let d = split_image(&dir, 256, 128, || extent_file(1 << 30, 1));
        let b = open(&d, opts()).ok().unwrap();
        assert_eq!(b.size(), 256 * 65536);
        assert_eq!(b.extents.len(), 256);
        for e in &b.extents {
            let Data::Sparse(t) = &e.data else {
                panic!("a sparse extent")
            };
            assert_eq!(t.table().len(), 1);
        }
        let got = testing::engine()
            .block_on(async {
                let mut v = vec![0xaau8; 100_000];
                b.read(&mut v, 65536 - 1000).await.map(|()| v)
            })
            .unwrap()
            .unwrap();
        assert!(got.iter().all(|&x| x == 0));
    }

    /// Many extents each of 1 Mi grains (64 GiB): past 32 Mi grains in all the image is
    /// refused in one line naming the limit, once their headers are read and before any
    /// table is made.
    #[test]
    fn grains_are_bounded_across_extents() {
        let dir = tempfile::tempdir().unwrap();
        let d = split_image(&dir, 64, 1 << 27, || extent_file(1 << 27, 2048));
        let t = std::time::Instant::now();
        let why = testing::reason(open(&d, opts()));
        assert!(
            why.contains("more than 33554432 grain table entries in all")
                && why.contains("34603008 by extent 33"),
            "{why}"
        );
        assert!(!why.contains('\n'), "{why}");
        assert!(t.elapsed() < std::time::Duration::from_secs(5));
        // Fewer of them open.
        let dir = tempfile::tempdir().unwrap();
        let d = split_image(&dir, 2, 1 << 27, || extent_file(1 << 27, 2048));
        assert_eq!(open(&d, opts()).ok().unwrap().size(), 2 << 36);
    }

    #[test]
    fn extent_names_stay_beside_the_descriptor() {
        let dir = Path::new("/images");
        assert_eq!(
            extent_path(dir, "d-flat.vmdk", false).unwrap(),
            Path::new("/images/d-flat.vmdk")
        );
        assert_eq!(
            extent_path(dir, "sub/d.vmdk", false).unwrap(),
            Path::new("/images/sub/d.vmdk")
        );
        assert!(extent_path(dir, "/etc/passwd", false)
            .unwrap_err()
            .contains("absolute path"));
        assert!(extent_path(dir, "../x", false)
            .unwrap_err()
            .contains("outside its own directory"));
        assert!(extent_path(dir, "a/../../x", false).is_err());
        assert_eq!(
            extent_path(dir, "/etc/passwd", true).unwrap(),
            Path::new("/etc/passwd")
        );
    }
}
