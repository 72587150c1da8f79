//! The directory export: a source directory tree served through FUSE.
//!
//! [`DirFs`] implements [`export::Filesystem`], so the queue server drives it exactly as it
//! drives an image export (static dispatch, the same buffers and framings). Nodes are inodes of
//! the source held by `O_PATH` descriptors ([`inodes`]); open files and directories are
//! descriptors behind checked handles ([`files`]).
//!
//! What keeps the daemon inside the source ([`sys`] holds every call that takes a path):
//! every name the kernel sends is one component, checked (never empty, `.`, `..` or holding `/`),
//! and resolved with `*at()` calls in the parent's descriptor without following a final symlink;
//! an inode already held is reached through its descriptor (re-opened through
//! `/proc/self/fd`), never by a path; symlinks are created, read and returned, never followed.
//! Permission checks are the kernel's (`default_permissions`) against the attributes returned;
//! what the caller creates is given the caller's uid and gid (a setgid directory's gid instead).

mod acl;
pub mod ahead;
mod attr;
mod copy;
mod create;
pub mod files;
mod handover;
pub mod inodes;
mod listing;
mod ring;
mod statx;
pub mod sys;

pub use handover::DirHandover;

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::CStr;
use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use engine::{Buf, Engine, Fd};
use export::{Filesystem, Reply, Request, Span, Tally};
use fuse_abi::{
    AttrOut, Dirent, EntryOut, FallocateIn, FsyncIn, GetxattrIn, GetxattrOut, InHeader, Kstatfs,
    LseekIn, LseekOut, Opcode, OpenOut, ReadIn, SetattrIn, SetxattrIn, StatfsOut, WriteIn,
    WriteOut, FATTR_ATIME, FATTR_ATIME_NOW, FATTR_FH, FATTR_GID, FATTR_KILL_SUIDGID, FATTR_MODE,
    FATTR_MTIME, FATTR_MTIME_NOW, FATTR_SIZE, FATTR_UID, FOPEN_CACHE_DIR, FOPEN_DIRECT_IO,
    FOPEN_KEEP_CACHE, FOPEN_PARALLEL_DIRECT_WRITES, FOPEN_PASSTHROUGH, FUSE_FSYNC_FDATASYNC,
    FUSE_WRITEBACK_CACHE, FUSE_WRITE_KILL_SUIDGID, ROOT_ID,
};
use transport::passthrough;
use zerocopy::{Immutable, IntoBytes};

use crate::inodes::{Held, Inode, Inodes, Peek};
use crate::listing::Listing;
use crate::sys::{Errno, Name};

/// How the directory export behaves; fixed for its lifetime.
#[derive(Clone, Copy, Debug)]
pub struct DirConfig {
    /// Accept changes (otherwise every one is `EROFS`).
    pub writable: bool,
    /// How long the kernel may cache a name's lookup.
    pub entry_valid: Duration,
    /// How long the kernel may cache attributes.
    pub attr_valid: Duration,
    /// Keep a file's cached pages across opens (`FOPEN_KEEP_CACHE`): for sources nothing else
    /// changes.
    pub keep_cache: bool,
    /// Directories are opened with `FOPEN_CACHE_DIR` and `FOPEN_KEEP_CACHE`: the kernel keeps a
    /// listing across opens and serves it again without READDIR, until a change made through
    /// the mount (which the kernel sees) resets it. A change made in the source directly is not
    /// seen, so only for sources nothing else changes.
    pub cache_listings: bool,
    /// Files are opened for direct I/O (`FOPEN_DIRECT_IO`): no kernel page cache (mmap still
    /// works where INIT granted `FUSE_DIRECT_IO_ALLOW_MMAP`).
    pub direct_io: bool,
    /// Most files and directories open through the mount at once.
    pub max_open: usize,
    /// Most nodes held at once: beyond it a lookup fails with `ENFILE` until the kernel forgets
    /// some.
    pub max_nodes: usize,
    /// Most nodes holding a descriptor of their inode; beyond it nodes hold file handles
    /// instead (when [`DirConfig::file_handles`] and the source allow), or else a lookup fails
    /// with `ENFILE` until the kernel forgets some: the daemon keeps descriptors for its own
    /// needs.
    pub max_node_fds: usize,
    /// Whether LOOKUP, GETATTR, STATX and UNLINK/RMDIR are io_uring operations (true) or plain
    /// calls on the queue thread (false); `None`: plain calls on a local filesystem
    /// ([`local_filesystem`]), ring operations on any other (a network or FUSE filesystem,
    /// where a call can wait on a server). See `ring` for why.
    pub metadata_on_ring: Option<bool>,
    /// Hold nodes beyond [`DirConfig::max_node_fds`] by file handle. Taken only where the
    /// source filesystem gives handles and the daemon may open them (`CAP_DAC_READ_SEARCH`).
    pub file_handles: bool,
    /// While readers stat what they list, warm the source's caches with the tree below a
    /// directory being listed ([`ahead`]); only where metadata calls are plain calls (a local
    /// source), so a network source is never sent speculative requests.
    pub read_ahead: bool,
}

impl Default for DirConfig {
    fn default() -> Self {
        DirConfig {
            writable: false,
            entry_valid: Duration::from_secs(1),
            attr_valid: Duration::from_secs(1),
            keep_cache: false,
            cache_listings: false,
            direct_io: false,
            max_open: 1 << 16,
            max_nodes: 1 << 20,
            max_node_fds: 1 << 16,
            metadata_on_ring: None,
            file_handles: true,
            read_ahead: true,
        }
    }
}

/// Why a directory export could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum DirError {
    /// The source path holds a NUL byte.
    #[error("{0}: the path holds a NUL byte")]
    Nul(String),
    /// The source could not be opened as a directory (not one, a symlink, missing, ...).
    #[error("cannot open the source directory {path}: {error}")]
    Open {
        /// The path.
        path: String,
        /// What open(2) said.
        error: std::io::Error,
    },
    /// `/proc/self/fd` is not there (fusex re-opens held inodes through it).
    #[error("cannot open /proc/self/fd: {0} (mount /proc)")]
    Proc(std::io::Error),
    /// What a predecessor handed over cannot be taken over ([`DirFs::take_over`]).
    #[error("cannot take the directory export over: {0}")]
    Handover(String),
}

/// A directory tree served through FUSE, shared by every queue thread.
pub struct DirFs {
    cfg: DirConfig,
    inodes: Inodes,
    files: Files,
    proc_fd: OwnedFd,
    /// Open handles answered minus released, as the image export counts them.
    open_files: AtomicU64,
    /// With passthrough: a clone of the connection's `/dev/fuse` descriptor, for the backing
    /// ioctls. Set once before the queues start.
    passthrough: OnceLock<OwnedFd>,
    /// Passthrough was refused once (no privilege): later opens do not try again.
    passthrough_refused: AtomicBool,
    /// The backing ids registered, one per source inode with files open through passthrough
    /// (the kernel refuses two backing files for one inode): id -> (inode, opens using it).
    backings: Mutex<Backings>,
    /// The INIT flags the kernel granted ([`DirFs::set_granted`]).
    granted: AtomicU64,
    /// LOOKUP, GETATTR, STATX and UNLINK/RMDIR are plain calls on the queue thread, not ring
    /// operations ([`DirConfig::metadata_on_ring`]; see `ring`).
    inline_metadata: bool,
    /// Whether first READDIRPLUS replies look up files ([`listing`]).
    listing: Listing,
    /// A descriptor (not `O_PATH`) of the source's filesystem, to open the file handles of
    /// nodes beyond the descriptor budget; `None` where handles cannot be used.
    handles: Option<Arc<OwnedFd>>,
    /// The source root's device: nodes on other filesystems (mounts inside the source) always
    /// hold descriptors.
    root_dev: u64,
    /// Directories the read-ahead opened for the reader's OPENDIR ([`ahead::Parked`]).
    parked: Arc<ahead::Parked>,
}

/// Backing ids shared by the opens of one inode.
#[derive(Default)]
struct Backings {
    by_inode: HashMap<(u64, u64), i32>,
    by_id: HashMap<i32, ((u64, u64), u64)>,
}

use crate::files::Files;

type R = Result<Reply, Errno>;

fn errno_of(e: Errno) -> std::io::Error {
    std::io::Error::from_raw_os_error(e)
}

impl DirFs {
    /// Opens `path` (a directory; a symlink there is refused) as the export's root.
    pub fn open(path: &Path, cfg: DirConfig) -> Result<DirFs, DirError> {
        use std::os::unix::ffi::OsStrExt;
        let shown = path.display().to_string();
        let c = std::ffi::CString::new(path.as_os_str().as_bytes())
            .map_err(|_| DirError::Nul(shown.clone()))?;
        let open_err = |e: Errno| DirError::Open {
            path: shown.clone(),
            error: errno_of(e),
        };
        let root = sys::open_root(&c).map_err(open_err)?;
        let st = sys::stat_fd(root.as_fd()).map_err(open_err)?;
        let proc_fd = sys::open_root(c"/proc/self/fd").map_err(|e| DirError::Proc(errno_of(e)))?;
        sys::reserve_descriptors(
            proc_fd.as_fd(),
            (cfg.max_node_fds + cfg.max_open).min(RESERVED_DESCRIPTORS),
        );
        let inline_metadata = match cfg.metadata_on_ring {
            Some(ring) => !ring,
            None => sys::statfs_fd(root.as_fd()).is_ok_and(|f| local_filesystem(f.f_type)),
        };
        let handles = if cfg.file_handles {
            handle_mount(&root, &proc_fd, &st)
        } else {
            None
        };
        Ok(DirFs {
            cfg,
            handles,
            root_dev: st.st_dev,
            parked: Arc::default(),
            inodes: Inodes::new(root, (st.st_dev, st.st_ino)),
            files: Files::new(cfg.max_open),
            proc_fd,
            open_files: AtomicU64::new(0),
            passthrough: OnceLock::new(),
            passthrough_refused: AtomicBool::new(false),
            backings: Mutex::new(Backings::default()),
            granted: AtomicU64::new(0),
            inline_metadata,
            listing: Listing::default(),
        })
    }

    /// Hands regular files' data to the kernel's FUSE passthrough (INIT granted
    /// `FUSE_PASSTHROUGH`): each open file is registered as a backing file on `conn`, a
    /// descriptor of the connection, and the kernel serves its reads, writes and mmap from the
    /// source file. Once, before the queues start; false if it was set already.
    pub fn set_passthrough(&self, conn: OwnedFd) -> bool {
        self.passthrough.set(conn).is_ok()
    }

    /// The source directory's node (its descriptor tells the passthrough stack depth).
    pub fn root(&self) -> Option<Arc<Inode>> {
        self.inodes.get(ROOT_ID)
    }

    /// The configuration.
    pub fn config(&self) -> &DirConfig {
        &self.cfg
    }

    /// Nodes the kernel holds (the root included).
    pub fn nodes(&self) -> usize {
        self.inodes.len()
    }

    /// Files and directories open through the mount now.
    pub fn open_files(&self) -> u64 {
        self.open_files.load(Ordering::Relaxed)
    }

    fn node(&self, id: u64) -> Result<Arc<Inode>, Errno> {
        self.inodes.get(id).ok_or(libc::ENOENT)
    }

    /// The descriptor of the open file a GETATTR or STATX names (`FUSE_GETATTR_FH` in
    /// `getattr_flags`, as fstat sends): it answers for an unlinked file too, which a node held
    /// by file handle no longer reaches. The handle table keeps it open until RELEASE, which
    /// the kernel sends only once no request on the handle is in flight.
    fn named_file(&self, getattr_flags: u32, fh: u64) -> Option<std::os::fd::RawFd> {
        (getattr_flags & fuse_abi::FUSE_GETATTR_FH != 0)
            .then(|| self.files.get(fh))
            .flatten()
    }

    /// Whether nodes beyond the descriptor budget are held by file handle.
    pub fn file_handles(&self) -> bool {
        self.handles.is_some()
    }

    /// Nodes holding a descriptor (the rest hold file handles).
    pub fn pinned_nodes(&self) -> usize {
        self.inodes.pinned()
    }

    /// Whether one more node may be held ([`DirConfig::max_nodes`], and
    /// [`DirConfig::max_node_fds`] without file handles).
    fn room(&self) -> Result<(), Errno> {
        let bound = if self.handles.is_some() {
            self.cfg.max_nodes
        } else {
            self.cfg.max_nodes.min(self.cfg.max_node_fds)
        };
        if self.inodes.len() >= bound {
            Err(libc::ENFILE)
        } else {
            Ok(())
        }
    }

    fn writable(&self) -> Result<(), Errno> {
        if self.cfg.writable {
            Ok(())
        } else {
            Err(libc::EROFS)
        }
    }

    fn attr_out(&self, st: &libc::stat) -> AttrOut {
        AttrOut {
            attr_valid: self.cfg.attr_valid.as_secs(),
            attr_valid_nsec: self.cfg.attr_valid.subsec_nanos(),
            dummy: 0,
            attr: attr::attr(st),
        }
    }

    fn entry_out(&self, nodeid: u64, generation: u64, st: &libc::stat) -> EntryOut {
        EntryOut {
            nodeid,
            generation,
            entry_valid: self.cfg.entry_valid.as_secs(),
            attr_valid: self.cfg.attr_valid.as_secs(),
            entry_valid_nsec: self.cfg.entry_valid.subsec_nanos(),
            attr_valid_nsec: self.cfg.attr_valid.subsec_nanos(),
            attr: attr::attr(st),
        }
    }

    /// Takes `fd` (an `O_PATH` descriptor of an inode) into the table: one lookup more.
    fn remember(&self, fd: OwnedFd, st: &libc::stat) -> EntryOut {
        // (`room` was checked before the descriptor was opened; a race of a few lookups past
        // the bound is harmless.)
        let key = (st.st_dev, st.st_ino);
        let kind = st.st_mode & libc::S_IFMT;
        let held = self.hold(fd, key, kind);
        let (id, generation) = self.inodes.insert(held, key, kind);
        self.entry_out(id, generation, st)
    }

    /// How a lookup of the inode `fd` (of `key`, `kind`) holds it: by the descriptor while the
    /// budget allows, else by file handle. Directories, the parents of every lookup and
    /// creation, may use the whole budget, other nodes three quarters of it, so that in a tree
    /// of many files the directories keep descriptors.
    fn hold(&self, fd: OwnedFd, key: (u64, u64), kind: u32) -> Held {
        let Some(mount) = self.handles.as_ref().filter(|_| key.0 == self.root_dev) else {
            return Held::Fd(fd);
        };
        let by_handle = match self.inodes.peek(key) {
            (Peek::Pinned, _) => false,
            // The handle tells whether it is that node's inode or a new one under its number.
            (Peek::Named, _) => true,
            (Peek::Absent, pinned) => {
                let budget = self.cfg.max_node_fds;
                pinned
                    >= if kind == libc::S_IFDIR {
                        budget
                    } else {
                        budget / 4 * 3
                    }
            }
        };
        if by_handle {
            if let Ok(handle) = sys::handle_of(fd.as_fd()) {
                return Held::Handle {
                    mount: mount.clone(),
                    handle,
                };
            }
        }
        Held::Fd(fd)
    }

    /// Hands `dir` to the metadata read-ahead ([`ahead`]) where it is on: configured, and a
    /// local source (a network one is never sent speculative requests).
    fn read_ahead(&self, dir: BorrowedFd<'_>, reach: ahead::Reach) {
        if self.cfg.read_ahead && self.inline_metadata {
            ahead::read_ahead(dir, reach, Arc::downgrade(&self.parked));
        }
    }

    /// LOOKUP of `name` in the directory `dir`.
    fn lookup_in(&self, dir: BorrowedFd<'_>, name: Name<'_>) -> Result<EntryOut, Errno> {
        self.room()?;
        let fd = sys::open_in(dir, name, libc::O_PATH, 0)?;
        let st = sys::stat_fd(fd.as_fd())?;
        Ok(self.remember(fd, &st))
    }
}

/// Whether a filesystem of `statfs` type `f_type` is local: in memory (tmpfs, ramfs) or on a
/// block device (ext2/3/4, xfs, btrfs, f2fs). There a lookup, an attribute read or an unlink
/// waits at most for a metadata block of the device, never for a server or a listener.
pub fn local_filesystem(f_type: libc::__fsword_t) -> bool {
    // The magics of include/uapi/linux/magic.h, as `statfs` reports them.
    const LOCAL: [u32; 6] = [
        0x0102_1994, // tmpfs
        0x8584_58f6, // ramfs
        0xef53,      // ext2, ext3, ext4
        0x5846_5342, // xfs
        0x9123_683e, // btrfs
        0xf2f5_2010, // f2fs
    ];
    LOCAL.contains(&(f_type as u32))
}

/// A descriptor of the source's filesystem to open file handles with, if handles work there:
/// the root's handle is taken and opened again, and must be the root.
fn handle_mount(root: &OwnedFd, proc_fd: &OwnedFd, st: &libc::stat) -> Option<Arc<OwnedFd>> {
    let mount = sys::reopen(
        proc_fd.as_fd(),
        root.as_raw_fd(),
        libc::O_RDONLY | libc::O_DIRECTORY,
    )
    .ok()?;
    let handle = sys::handle_of(root.as_fd()).ok()?;
    let again = sys::open_handle(mount.as_fd(), &handle, libc::O_PATH).ok()?;
    let st2 = sys::stat_fd(again.as_fd()).ok()?;
    ((st2.st_dev, st2.st_ino) == (st.st_dev, st.st_ino)).then(|| Arc::new(mount))
}

/// The checked name a span holds.
fn name_at(buf: &[u8], span: Span) -> Result<Name<'_>, Errno> {
    Name::new(span.c_str(buf).ok_or(libc::EINVAL)?)
}

/// Writes a reply struct at the payload window.
fn put<T: IntoBytes + Immutable>(buf: &mut Buf, payload: usize, v: &T) -> R {
    let b = v.as_bytes();
    let dst = buf
        .as_mut_slice()
        .get_mut(payload..payload + b.len())
        .ok_or(libc::EIO)?;
    dst.copy_from_slice(b);
    Ok(Reply::Data(b.len()))
}

/// Writes two reply structs back to back (CREATE: entry, then open).
fn put2<A: IntoBytes + Immutable, B: IntoBytes + Immutable>(
    buf: &mut Buf,
    payload: usize,
    a: &A,
    b: &B,
) -> R {
    let (x, y) = (a.as_bytes(), b.as_bytes());
    let dst = buf
        .as_mut_slice()
        .get_mut(payload..payload + x.len() + y.len())
        .ok_or(libc::EIO)?;
    dst[..x.len()].copy_from_slice(x);
    dst[x.len()..].copy_from_slice(y);
    Ok(Reply::Data(x.len() + y.len()))
}

thread_local! {
    /// Where READDIR reads `linux_dirent64` records before encoding them: one per queue thread,
    /// allocated on its first READDIR.
    static DIRENTS: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Most descriptors the descriptor table is grown to hold at start ([`sys::reserve_descriptors`]):
/// 512 KiB of kernel memory.
const RESERVED_DESCRIPTORS: usize = 1 << 16;

/// A `getdents64` buffer: READDIR's, per queue thread, and the read-ahead's, per level.
pub(crate) const DIRENTS_LEN: usize = 32 << 10;

impl Filesystem for DirFs {
    fn serves(opcode: u32) -> bool {
        use Opcode as O;
        matches!(
            Opcode::from_u32(opcode),
            Some(
                O::Init
                    | O::Destroy
                    | O::Lookup
                    | O::Forget
                    | O::BatchForget
                    | O::Interrupt
                    | O::Getattr
                    | O::Setattr
                    | O::Open
                    | O::Release
                    | O::Read
                    | O::Write
                    | O::Fsync
                    | O::Fallocate
                    | O::Lseek
                    | O::Statfs
                    | O::Readlink
                    | O::Symlink
                    | O::Mknod
                    | O::Mkdir
                    | O::Unlink
                    | O::Rmdir
                    | O::Rename
                    | O::Rename2
                    | O::Link
                    | O::Create
                    | O::Tmpfile
                    | O::Opendir
                    | O::Readdir
                    | O::Readdirplus
                    | O::Releasedir
                    | O::Fsyncdir
                    | O::Setxattr
                    | O::Getxattr
                    | O::Listxattr
                    | O::Removexattr
                    | O::Statx
                    | O::CopyFileRange
                    | O::CopyFileRange64
            )
        )
    }

    fn layouts(&self) -> fuse_abi::Layouts {
        acl::layouts(self.granted.load(Ordering::Relaxed))
    }

    async fn handle(
        &self,
        eng: &Engine,
        hdr: &InHeader,
        req: Request,
        mut buf: Buf,
        window: Range<usize>,
        tally: &Tally<'_>,
    ) -> (Reply, Buf) {
        if window.start > window.end || window.end > buf.len() {
            return (Reply::Error(libc::EIO), buf);
        }
        let (payload, cap) = (window.start, window.end - window.start);
        let r = match req {
            Request::Read(a) => return self.read(eng, a, buf, payload, cap, tally).await,
            Request::Write(a) => return self.write(eng, a, buf, payload, cap, tally).await,
            Request::Fsync(a) | Request::Fsyncdir(a) => self.fsync(eng, a).await,
            Request::Fallocate(a) => self.fallocate(eng, a).await,
            other => self.on_ring(eng, hdr, other, &mut buf, payload, cap).await,
        };
        (r.unwrap_or_else(Reply::Error), buf)
    }
}

impl DirFs {
    /// The requests io_uring has no operation for: plain system calls on the queue thread.
    pub(crate) fn metadata(
        &self,
        hdr: &InHeader,
        req: Request,
        buf: &mut Buf,
        payload: usize,
        cap: usize,
    ) -> R {
        match req {
            Request::Forget(n) => {
                self.inodes.forget(hdr.nodeid, n);
                Ok(Reply::None)
            }
            Request::BatchForget { entries } => {
                let raw = entries.bytes(buf.as_slice()).ok_or(libc::EINVAL)?;
                for e in fuse_abi::forget_entries(raw) {
                    self.inodes.forget(e.nodeid, e.nlookup);
                }
                Ok(Reply::None)
            }
            Request::Interrupt => Ok(Reply::None),
            Request::Destroy => Ok(Reply::Data(0)),
            Request::Init => Err(libc::EPROTO),
            Request::Setattr(a) => self.setattr(hdr, a, buf, payload),
            Request::Release(a) | Request::Releasedir(a) => {
                if let Some((fd, backing)) = self.files.remove(a.fh) {
                    self.release_backing(backing);
                    drop(fd);
                    self.open_files.fetch_sub(1, Ordering::Relaxed);
                }
                Ok(Reply::Data(0))
            }
            // Nothing to do at close: writes reach the source as they come, and locks are the
            // kernel's. ENOSYS tells the kernel so once, and it sends no FLUSH from then on
            // (one round trip less per close; dirty pages of writeback caching are still written
            // back at close, before the FLUSH it no longer sends).
            Request::Flush(_) => Err(libc::ENOSYS),
            Request::Lseek(a) => self.lseek(a, buf, payload),
            Request::Statfs => self.statfs(hdr, buf, payload),
            Request::Readdir(a) => self.readdir(hdr, a, false, buf, payload, cap),
            Request::Readdirplus(a) => self.readdir(hdr, a, true, buf, payload, cap),
            Request::Readlink => {
                let node = self.node(hdr.nodeid)?;
                if node.kind != libc::S_IFLNK {
                    return Err(libc::EINVAL);
                }
                let out = buf
                    .as_mut_slice()
                    .get_mut(payload..payload + cap)
                    .ok_or(libc::EIO)?;
                let n = sys::readlink_fd(node.fd()?.as_fd(), out)?;
                Ok(Reply::Data(n))
            }
            Request::Setxattr { arg, name, value } => {
                self.writable()?;
                let node = self.node(hdr.nodeid)?;
                let b = buf.as_slice();
                let n = name.c_str(b).ok_or(libc::EINVAL)?;
                let v = value.bytes(b).ok_or(libc::EINVAL)?;
                let SetxattrIn { flags, .. } = arg;
                self.xattr_target(&node)?;
                sys::xattr::set(node.fd()?.as_raw_fd(), n, v, flags as i32)?;
                self.acl_set(&node, n, arg.setxattr_flags)?;
                Ok(Reply::Data(0))
            }
            Request::Getxattr { arg, name } => {
                let node = self.node(hdr.nodeid)?;
                self.xattr_target(&node)?;
                let n = name.c_str(buf.as_slice()).ok_or(libc::EINVAL)?;
                // The name may overlap the window the value goes to: copy it out first.
                let mut copy = [0u8; 256];
                let len = n.to_bytes_with_nul().len();
                if len > copy.len() {
                    return Err(libc::ERANGE);
                }
                copy[..len].copy_from_slice(n.to_bytes_with_nul());
                let n = CStr::from_bytes_with_nul(&copy[..len]).map_err(|_| libc::EINVAL)?;
                self.xattr_reply(arg, buf, payload, cap, |out| {
                    sys::xattr::get(node.fd()?.as_raw_fd(), n, out)
                })
            }
            Request::Listxattr(arg) => {
                let node = self.node(hdr.nodeid)?;
                self.xattr_target(&node)?;
                self.xattr_reply(arg, buf, payload, cap, |out| {
                    sys::xattr::list(node.fd()?.as_raw_fd(), out)
                })
            }
            Request::Removexattr { name } => {
                self.writable()?;
                let node = self.node(hdr.nodeid)?;
                self.xattr_target(&node)?;
                let n = name.c_str(buf.as_slice()).ok_or(libc::EINVAL)?;
                sys::xattr::remove(node.fd()?.as_raw_fd(), n)?;
                Ok(Reply::Data(0))
            }
            // With default_permissions the kernel checks access itself and never asks; a
            // daemon running as root could not answer for the caller anyway.
            Request::Access(_) => Err(libc::ENOSYS),
            Request::CopyFileRange(a) => self.copy_file_range(a, false, buf, payload),
            Request::CopyFileRange64(a) => self.copy_file_range(a, true, buf, payload),
            // Served on the ring (`handle`, `on_ring`), never passed here.
            Request::Read(_)
            | Request::Write(_)
            | Request::Fsync(_)
            | Request::Fsyncdir(_)
            | Request::Fallocate(_)
            | Request::Lookup { .. }
            | Request::Getattr(_)
            | Request::Statx(_)
            | Request::Open(_)
            | Request::Opendir(_)
            | Request::Unlink { .. }
            | Request::Rmdir { .. }
            | Request::Rename { .. }
            | Request::Link { .. }
            | Request::Create { .. }
            | Request::Tmpfile(_)
            | Request::Mkdir { .. }
            | Request::Mknod { .. }
            | Request::Symlink { .. }
            | Request::Unsupported(_) => Err(libc::ENOSYS),
        }
    }

    /// Extended attributes are reached through `/proc/self/fd`, which follows a symlink: a
    /// symlink's own attributes are not offered.
    fn xattr_target(&self, node: &Inode) -> Result<(), Errno> {
        if node.kind == libc::S_IFLNK {
            return Err(libc::EOPNOTSUPP);
        }
        Ok(())
    }

    /// GETXATTR / LISTXATTR: size 0 asks for the size, else the bytes (ERANGE if they do not fit
    /// the caller's size).
    fn xattr_reply(
        &self,
        arg: GetxattrIn,
        buf: &mut Buf,
        payload: usize,
        cap: usize,
        call: impl FnOnce(&mut [u8]) -> Result<usize, Errno>,
    ) -> R {
        if arg.size == 0 {
            let n = call(&mut [])?;
            let out = GetxattrOut {
                size: u32::try_from(n).map_err(|_| libc::E2BIG)?,
                padding: 0,
            };
            return put(buf, payload, &out);
        }
        let room = (arg.size as usize).min(cap);
        let out = buf
            .as_mut_slice()
            .get_mut(payload..payload + room)
            .ok_or(libc::EIO)?;
        let n = call(out)?;
        Ok(Reply::Data(n))
    }

    fn setattr(&self, hdr: &InHeader, a: SetattrIn, buf: &mut Buf, payload: usize) -> R {
        let node = self.node(hdr.nodeid)?;
        let changes = FATTR_MODE
            | FATTR_UID
            | FATTR_GID
            | FATTR_SIZE
            | FATTR_ATIME
            | FATTR_MTIME
            | FATTR_ATIME_NOW
            | FATTR_MTIME_NOW;
        if a.valid & changes != 0 {
            self.writable()?;
        }
        let fh = (a.valid & FATTR_FH != 0)
            .then(|| self.files.get(a.fh))
            .flatten();
        // The node's descriptor, opened at most once for all the steps below (a node held by
        // file handle is opened by it), and only by a step that needs it.
        let mut opened = None;
        if a.valid & FATTR_MODE != 0 {
            if node.kind == libc::S_IFLNK {
                return Err(libc::EOPNOTSUPP);
            }
            sys::chmod_fd(
                self.proc_fd.as_fd(),
                node_fd(&mut opened, &node)?.as_raw_fd(),
                a.mode & 0o7777,
            )?;
        }
        if a.valid & (FATTR_UID | FATTR_GID) != 0 {
            let uid = if a.valid & FATTR_UID != 0 {
                a.uid
            } else {
                u32::MAX
            };
            let gid = if a.valid & FATTR_GID != 0 {
                a.gid
            } else {
                u32::MAX
            };
            sys::chown_fd(node_fd(&mut opened, &node)?, uid, gid)?;
        }
        if a.valid & FATTR_SIZE != 0 {
            if node.kind != libc::S_IFREG {
                return Err(if node.is_dir() {
                    libc::EISDIR
                } else {
                    libc::EINVAL
                });
            }
            match fh {
                Some(fd) => sys::ftruncate(fd, a.size)?,
                None => sys::truncate_fd(node_fd(&mut opened, &node)?.as_raw_fd(), a.size)?,
            }
        }
        let time = |now: u32, set: u32, s: u64, ns: u32| {
            if a.valid & now != 0 {
                libc::timespec {
                    tv_sec: 0,
                    tv_nsec: libc::UTIME_NOW,
                }
            } else if a.valid & set != 0 {
                libc::timespec {
                    tv_sec: s as libc::time_t,
                    tv_nsec: libc::c_long::from(ns as i32),
                }
            } else {
                libc::timespec {
                    tv_sec: 0,
                    tv_nsec: libc::UTIME_OMIT,
                }
            }
        };
        // (FATTR_CTIME, which the kernel sends beside FATTR_MTIME when it keeps the times itself
        // under writeback caching, has nothing to set it: the source sets a change's ctime.)
        if a.valid & (FATTR_ATIME | FATTR_MTIME | FATTR_ATIME_NOW | FATTR_MTIME_NOW) != 0 {
            let times = [
                time(FATTR_ATIME_NOW, FATTR_ATIME, a.atime, a.atimensec),
                time(FATTR_MTIME_NOW, FATTR_MTIME, a.mtime, a.mtimensec),
            ];
            // Through the open file the kernel names (it writes back a file's times with its
            // handle, also once the file is unlinked and a node held by file handle no longer
            // reaches it), else through the node.
            match fh {
                Some(fd) => sys::utimes_fd(borrow(fd), &times)?,
                None => sys::utimes_fd(node_fd(&mut opened, &node)?, &times)?,
            }
        }
        // A truncate by a caller without CAP_FSETID, or a chown (`FUSE_HANDLE_KILLPRIV_V2`):
        // set-id bits go, as on a local filesystem (the daemon's own calls keep them).
        if a.valid & FATTR_KILL_SUIDGID != 0 && node.kind == libc::S_IFREG {
            match fh {
                Some(fd) => sys::kill_suidgid(self.proc_fd.as_fd(), borrow(fd))?,
                None => sys::kill_suidgid(self.proc_fd.as_fd(), node_fd(&mut opened, &node)?)?,
            }
        }
        let st = match fh {
            Some(fd) => sys::stat_fd(borrow(fd))?,
            None => sys::stat_fd(node_fd(&mut opened, &node)?)?,
        };
        put(buf, payload, &self.attr_out(&st))
    }

    /// Open flags for the source file: what the caller asked, less what fusex decides itself.
    /// `O_NOFOLLOW` was the kernel's to apply to the caller's path; the daemon reopens the inode
    /// it holds through `/proc/self/fd`, a symlink the flag would refuse (`ELOOP`), and names in
    /// the source are opened with it always (`sys::open_in`).
    fn callers_flags(flags: u32) -> i32 {
        (flags as i32)
            & !(libc::O_CREAT
                | libc::O_EXCL
                | libc::O_NOCTTY
                | libc::O_DIRECT
                | libc::O_TRUNC
                | libc::O_NOFOLLOW)
    }

    /// Whether INIT granted `FUSE_WRITEBACK_CACHE`: the kernel gathers writes in its page cache
    /// and writes them back later, keeping regular files' size and times itself.
    pub fn writeback(&self) -> bool {
        self.granted.load(Ordering::Relaxed) & FUSE_WRITEBACK_CACHE != 0
    }

    /// The flags a regular file of the source is opened with for the caller's `flags`
    /// ([`DirFs::callers_flags`]). With writeback caching an open for writing is made
    /// `O_RDWR` and without `O_APPEND`:
    /// - the kernel reads through any open for writing, to fill the rest of a page a write
    ///   covers in part before the page is written back; a write-only source descriptor would
    ///   fail those reads (`EBADF`) and the caller's write with them. The caller gets no read
    ///   access from it: the kernel checked its permission for what it asked
    ///   (`default_permissions`), and its own descriptor stays write-only; only the kernel's
    ///   page cache reads through the handle;
    /// - the kernel computes an append's offset itself (from the size it keeps) and writes the
    ///   pages back with explicit offsets, possibly through another open's handle; a source
    ///   descriptor with `O_APPEND` would put every WRITE at the source's end instead.
    ///
    /// Where the source refuses that open ([`DirFs::narrowed`]) the caller's own flags are used,
    /// for direct I/O.
    fn open_flags(&self, flags: u32) -> i32 {
        let f = Self::callers_flags(flags);
        if !self.writeback() || f & libc::O_ACCMODE == libc::O_RDONLY {
            return f;
        }
        (f & !(libc::O_ACCMODE | libc::O_APPEND)) | libc::O_RDWR
    }

    /// Whether an open with [`DirFs::open_flags`] that failed with `e` is made again with the
    /// caller's own flags, and answered with `FOPEN_DIRECT_IO`: the source refused the read
    /// access or the dropped `O_APPEND` that writeback caching adds (`EACCES`: a daemon
    /// without `CAP_DAC_OVERRIDE`, or a root-squashing NFS server, and a write-only file;
    /// `EPERM`: an append-only file). The kernel neither reads through a direct-I/O open nor
    /// caches its writes, and appends through it are the source's, as without writeback.
    fn narrowed(flags: u32, asked: i32, e: Errno) -> bool {
        matches!(e, libc::EACCES | libc::EPERM) && asked != Self::callers_flags(flags)
    }

    /// The passthrough backing id for an open of the inode `key` (a regular file, just opened
    /// as `fd`): the one its other opens use, else `fd` registered now. 0 when passthrough is off
    /// or refused (then fusex serves the file's I/O itself).
    fn backing_for(&self, key: (u64, u64), fd: &OwnedFd) -> i32 {
        let Some(conn) = self.passthrough.get() else {
            return 0;
        };
        if self.passthrough_refused.load(Ordering::Relaxed) {
            return 0;
        }
        let mut b = self.backings.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&id) = b.by_inode.get(&key) {
            if let Some(e) = b.by_id.get_mut(&id) {
                e.1 += 1;
                return id;
            }
        }
        // Registered without CAP_FSETID: the kernel writes through it with these credentials,
        // so a passthrough write clears set-id bits in the source (`FUSE_HANDLE_KILLPRIV_V2`).
        match sys::without_fsetid(|| passthrough::register(conn.as_fd(), fd.as_raw_fd())) {
            Ok(id) => {
                b.by_inode.insert(key, id);
                b.by_id.insert(id, (key, 1));
                id
            }
            Err(e) => {
                if e.raw_os_error() == Some(libc::EPERM)
                    && !self.passthrough_refused.swap(true, Ordering::Relaxed)
                {
                    tracing::info!(
                        "passthrough: registering a file was not permitted (needs CAP_SYS_ADMIN \
                         in the initial user namespace); fusex serves file data itself"
                    );
                }
                tracing::debug!("passthrough refused for an open file ({e}); served by fusex");
                0
            }
        }
    }

    /// One open using backing id `id` is released; the last one closes the id.
    fn release_backing(&self, id: i32) {
        let Some(conn) = self.passthrough.get() else {
            return;
        };
        if id <= 0 {
            return;
        }
        let mut b = self.backings.lock().unwrap_or_else(|p| p.into_inner());
        let Some(e) = b.by_id.get_mut(&id) else {
            return;
        };
        e.1 -= 1;
        if e.1 > 0 {
            return;
        }
        let key = e.0;
        b.by_id.remove(&id);
        if b.by_inode.get(&key) == Some(&id) {
            b.by_inode.remove(&key);
        }
        // Closed under the lock, so no open picks the id up meanwhile.
        if let Err(e) = passthrough::unregister(conn.as_fd(), id) {
            tracing::debug!("closing passthrough backing id {id}: {e}");
        }
    }

    /// Keeps an opened file and answers with its handle and open flags.
    /// `key`: the source inode of a regular file (None: a directory); `direct`: a regular file
    /// opened for direct I/O whatever the cache mode ([`DirFs::narrowed`]).
    fn open_out(
        &self,
        fd: OwnedFd,
        key: Option<(u64, u64)>,
        direct: bool,
    ) -> Result<OpenOut, Errno> {
        let backing = key.map_or(0, |k| self.backing_for(k, &fd));
        let fh = match self.files.insert_backed(fd, backing) {
            Ok(fh) => fh,
            Err(e) => {
                self.release_backing(backing);
                return Err(e);
            }
        };
        self.open_files.fetch_add(1, Ordering::Relaxed);
        let open_flags = if backing > 0 {
            FOPEN_PASSTHROUGH
        } else if key.is_none() {
            if self.cfg.cache_listings {
                FOPEN_CACHE_DIR | FOPEN_KEEP_CACHE
            } else {
                0
            }
        } else if self.cfg.direct_io || direct {
            FOPEN_DIRECT_IO | FOPEN_PARALLEL_DIRECT_WRITES
        } else if self.cfg.keep_cache {
            FOPEN_KEEP_CACHE
        } else {
            0
        };
        Ok(OpenOut {
            fh,
            open_flags,
            backing_id: backing,
        })
    }

    fn open_reply(
        &self,
        fd: OwnedFd,
        key: Option<(u64, u64)>,
        direct: bool,
        buf: &mut Buf,
        payload: usize,
    ) -> R {
        let out = self.open_out(fd, key, direct)?;
        put(buf, payload, &out)
    }

    fn lseek(&self, a: LseekIn, buf: &mut Buf, payload: usize) -> R {
        let fd = self.files.get(a.fh).ok_or(libc::EBADF)?;
        let off = sys::lseek(fd, a.offset, a.whence as i32)?;
        put(buf, payload, &LseekOut { offset: off })
    }

    fn statfs(&self, hdr: &InHeader, buf: &mut Buf, payload: usize) -> R {
        let node = self.node(hdr.nodeid).or_else(|_| self.node(ROOT_ID))?;
        let s = sys::statfs_fd(node.fd()?.as_fd())?;
        let st = Kstatfs {
            blocks: s.f_blocks,
            bfree: s.f_bfree,
            bavail: s.f_bavail,
            files: s.f_files,
            ffree: s.f_ffree,
            bsize: s.f_bsize as u32,
            namelen: s.f_namelen as u32,
            frsize: s.f_frsize as u32,
            ..Kstatfs::default()
        };
        put(buf, payload, &StatfsOut { st })
    }

    /// READDIR and READDIRPLUS from the handle's offset (a `d_off` cookie of the source, or 0).
    /// A READDIRPLUS entry is a lookup, made only once the entry is known to fit the reply, of
    /// every entry but `.` and `..` in a later reply of the directory (the kernel asks for one
    /// only when entries were looked up meanwhile), and in its first reply of subdirectories,
    /// and of files while readers stat what they list ([`listing`]).
    fn readdir(
        &self,
        hdr: &InHeader,
        a: ReadIn,
        plus: bool,
        buf: &mut Buf,
        payload: usize,
        cap: usize,
    ) -> R {
        let fd = self.files.get(a.fh).ok_or(libc::EBADF)?;
        let first_with_files = plus
            && a.offset == 0
            && self
                .node(hdr.nodeid)
                .is_ok_and(|dir| self.listing.files_in_first_reply(&dir.listed));
        if first_with_files {
            self.read_ahead(borrow(fd), ahead::Reach::Tree);
        }
        let files_too = a.offset != 0 || !plus || first_with_files;
        let size = (a.size as usize).min(cap);
        let out = buf
            .as_mut_slice()
            .get_mut(payload..payload + size)
            .ok_or(libc::EIO)?;
        sys::lseek(fd, a.offset, libc::SEEK_SET)?;
        // SAFETY of the borrow: the scratch buffer is this thread's; nothing here awaits.
        let (used, subdirs) = DIRENTS.with(|cell| {
            let mut scratch = cell.borrow_mut();
            if scratch.len() < DIRENTS_LEN {
                scratch.resize(DIRENTS_LEN, 0);
            }
            let (mut used, mut subdirs) = (0, false);
            'fill: loop {
                let n = sys::getdents(fd, &mut scratch)?;
                if n == 0 {
                    break;
                }
                let mut pos = 0;
                while pos + 19 < n {
                    let rec = sys::dir_record(&scratch[pos..n]).ok_or(libc::EIO)?;
                    let (name, typ) = (rec.name.to_bytes(), rec.typ);
                    let len = name.len();
                    let need = if plus {
                        fuse_abi::direntplus_size(len)
                    } else {
                        fuse_abi::dirent_size(len)
                    };
                    if used + need > out.len() {
                        break 'fill;
                    }
                    let dirent = Dirent {
                        ino: rec.ino,
                        off: rec.off,
                        namelen: len as u32,
                        typ: u32::from(typ),
                    };
                    let mut at = used;
                    let dot = name == b"." || name == b"..";
                    subdirs |= typ == libc::DT_DIR && !dot;
                    if plus {
                        let skip = !files_too && typ != libc::DT_DIR && typ != libc::DT_UNKNOWN;
                        let entry = if dot || skip {
                            EntryOut::default()
                        } else {
                            // An entry that vanished since getdents, or cannot be held, is
                            // listed without attributes (node 0: the kernel links nothing).
                            Name::new(rec.name)
                                .and_then(|nm| self.lookup_in(borrow(fd), nm))
                                .unwrap_or_default()
                        };
                        let e = entry.as_bytes();
                        out[at..at + e.len()].copy_from_slice(e);
                        at += e.len();
                    }
                    let d = dirent.as_bytes();
                    out[at..at + d.len()].copy_from_slice(d);
                    at += d.len();
                    out[at..at + len].copy_from_slice(name);
                    at += len;
                    let end = used + need;
                    out[at..end].fill(0);
                    used = end;
                    pos += rec.reclen;
                }
            }
            Ok::<_, Errno>((used, subdirs))
        })?;
        // A first reply for a reader that only lists: the tree below is read ahead without
        // stats, when there is one.
        if a.offset == 0 && !first_with_files && subdirs {
            self.read_ahead(borrow(fd), ahead::Reach::Listing);
        }
        Ok(Reply::Data(used))
    }

    async fn read(
        &self,
        eng: &Engine,
        a: ReadIn,
        buf: Buf,
        payload: usize,
        cap: usize,
        tally: &Tally<'_>,
    ) -> (Reply, Buf) {
        let Some(fd) = self.files.get(a.fh) else {
            return (Reply::Error(libc::EBADF), buf);
        };
        let n = (a.size as usize).min(cap);
        if n == 0 {
            return (Reply::Data(0), buf);
        }
        let started = tally.backend_start();
        let (r, win) = eng
            .read(Fd::Raw(fd), buf.slice(payload..payload + n), a.offset)
            .await;
        tally.backend_done(Opcode::Read as u32, started);
        let buf = win.into_inner();
        match r {
            Ok(got) => {
                tally.read(got);
                (Reply::Data(got), buf)
            }
            Err(e) => (Reply::Error(e.raw_os_error().unwrap_or(libc::EIO)), buf),
        }
    }

    async fn write(
        &self,
        eng: &Engine,
        a: WriteIn,
        mut buf: Buf,
        payload: usize,
        cap: usize,
        tally: &Tally<'_>,
    ) -> (Reply, Buf) {
        if !self.cfg.writable {
            return (Reply::Error(libc::EROFS), buf);
        }
        let Some(fd) = self.files.get(a.fh) else {
            return (Reply::Error(libc::EBADF), buf);
        };
        // A caller without CAP_FSETID (`FUSE_HANDLE_KILLPRIV_V2`): set-id bits go first, as a
        // local write clears them.
        if a.write_flags & FUSE_WRITE_KILL_SUIDGID != 0 {
            if let Err(e) = sys::kill_suidgid(self.proc_fd.as_fd(), borrow(fd)) {
                return (Reply::Error(e), buf);
            }
        }
        let n = (a.size as usize).min(cap);
        let started = tally.backend_start();
        let (r, win) = eng
            .write(Fd::Raw(fd), buf.slice(payload..payload + n), a.offset)
            .await;
        tally.backend_done(Opcode::Write as u32, started);
        buf = win.into_inner();
        match r {
            Ok(done) => {
                tally.write(done);
                let out = WriteOut {
                    size: done as u32,
                    padding: 0,
                };
                (
                    put(&mut buf, payload, &out).unwrap_or_else(Reply::Error),
                    buf,
                )
            }
            Err(e) => (Reply::Error(e.raw_os_error().unwrap_or(libc::EIO)), buf),
        }
    }

    async fn fsync(&self, eng: &Engine, a: FsyncIn) -> R {
        let fd = self.files.get(a.fh).ok_or(libc::EBADF)?;
        let datasync = a.fsync_flags & FUSE_FSYNC_FDATASYNC != 0;
        eng.fsync(Fd::Raw(fd), datasync)
            .await
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
        Ok(Reply::Data(0))
    }

    async fn fallocate(&self, eng: &Engine, a: FallocateIn) -> R {
        self.writable()?;
        let fd = self.files.get(a.fh).ok_or(libc::EBADF)?;
        eng.fallocate(Fd::Raw(fd), a.mode as i32, a.offset, a.length)
            .await
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
        Ok(Reply::Data(0))
    }
}

/// The descriptor of `node` kept in `slot`, opened into it on first use.
fn node_fd<'a, 'n>(
    slot: &'a mut Option<inodes::NodeFd<'n>>,
    node: &'n Inode,
) -> Result<BorrowedFd<'a>, Errno> {
    let fd: &'a inodes::NodeFd<'n> = match slot {
        Some(fd) => fd,
        None => slot.insert(node.fd()?),
    };
    Ok(fd.as_fd())
}

/// A descriptor the handle table holds, borrowed for one call.
fn borrow<'a>(fd: std::os::fd::RawFd) -> BorrowedFd<'a> {
    // SAFETY: the handle table keeps the descriptor open until RELEASEDIR, which the kernel
    // sends only once no READDIR on the handle is in flight.
    unsafe { BorrowedFd::borrow_raw(fd) }
}

#[cfg(test)]
mod tests;
