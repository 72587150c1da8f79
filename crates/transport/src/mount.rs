//! Mounting a single-file FUSE filesystem over a regular file, and taking it down again.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Once;

use crate::mountinfo::{file_id, fuse_mount_at, MountIdentity, FUSEX_FSTYPE};
use crate::TransportError;

/// What to mount.
#[derive(Clone, Debug)]
pub struct MountConfig {
    /// Where: a regular file (created if missing).
    pub mountpoint: PathBuf,
    /// Shown as the mount's source (e.g. the image path).
    pub source: String,
    /// Mount read-only (the VFS then refuses writes before they reach fusex).
    pub read_only: bool,
    /// Let other users access the export.
    pub allow_other: bool,
    /// Largest read the kernel sends (`max_read=`).
    pub max_read: u32,
    /// The mount's root is a directory (a directory export): the mountpoint must be an existing
    /// directory, never created or removed by fusex.
    pub directory: bool,
}

/// Runs once a new mount exists and before anything can see it (see [`Mount::establish`]).
pub type BeforeVisible<'a> = &'a mut dyn FnMut(&Path, &MountIdentity) -> io::Result<()>;

/// What a process taking over a live mount needs to know of it (see [`Mount::handover`]).
#[derive(Clone, Debug)]
pub struct Handover {
    /// The canonical mountpoint.
    pub mountpoint: PathBuf,
    /// Which mount is the export's.
    pub identity: MountIdentity,
    /// The mountpoint file the first daemon created (device major, minor, inode), removed at
    /// the export's end.
    pub created: Option<(u32, u32, u64)>,
    /// Whether `fusermount3` made the mount (and so unmounts it).
    pub via_fusermount: bool,
    /// The root is a directory (a directory export).
    pub directory: bool,
}

/// How a mount was made, which decides how it is taken down.
enum Via {
    /// mount(2) by fusex itself (it has `CAP_SYS_ADMIN`); umount2 at the end.
    Kernel,
    /// `fusermount3` (fusex has no privilege to mount); `fusermount3 -u` at the end.
    Fusermount,
}

/// A live mount. Dropping it unmounts (lazily, so open files cannot keep it in the namespace) and
/// removes the mountpoint file if fusex created it: no path out of the daemon leaves a mount behind.
///
/// Everything it does at the end acts only on what it made: the mount is taken down only while the
/// mount at the path is still this one ([`MountIdentity`]), the file is removed only while the path
/// still holds the file it created. After `fusex umount` the next export may already sit on the
/// same path by the time this daemon cleans up; it is left alone.
pub struct Mount {
    fd: Option<OwnedFd>,
    mountpoint: PathBuf,
    /// The mountpoint file this mount created: (device major, minor, inode).
    created: Option<(u32, u32, u64)>,
    /// Set while mounted: which mount is ours.
    identity: Option<MountIdentity>,
    via: Via,
    /// The root is a directory ([`MountConfig::directory`]).
    directory: bool,
}

/// Opens `/dev/fuse` with errors a user can act on.
pub fn open_dev_fuse() -> Result<OwnedFd, TransportError> {
    match File::options().read(true).write(true).open("/dev/fuse") {
        Ok(f) => Ok(f.into()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(TransportError::NoDevFuse),
        Err(e) => Err(TransportError::DevFuse(e)),
    }
}

/// Opens a new `/dev/fuse` fd attached to the same connection as `fd` (`FUSE_DEV_IOC_CLONE`): a
/// separate queue reads requests from it and must reply on it.
///
/// A user who may not open `/dev/fuse` (mode 0600 where no udev rule opened it up; the mount then
/// came from `fusermount3`) gets a duplicate of `fd` instead: the same device, so the queues share
/// one request list and each replies on the fd it read from, as the kernel requires. Said once.
pub fn clone_fd(fd: RawFd) -> Result<OwnedFd, TransportError> {
    let new = match open_dev_fuse() {
        Ok(new) => new,
        Err(TransportError::DevFuse(e))
            if matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM)) =>
        {
            static SAID: Once = Once::new();
            SAID.call_once(|| {
                tracing::info!(
                    "cannot open /dev/fuse ({e}): queues share the connection's fd instead of \
                     each cloning its own"
                )
            });
            // SAFETY: F_DUPFD_CLOEXEC on a live fd returns a new fd or -1.
            let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
            if dup < 0 {
                return Err(TransportError::Io(io::Error::last_os_error()));
            }
            // SAFETY: dup is fresh and owned here.
            return Ok(unsafe { OwnedFd::from_raw_fd(dup) });
        }
        Err(e) => return Err(e),
    };
    let src = fd as u32;
    // SAFETY: FUSE_DEV_IOC_CLONE reads one u32 (the source fd) from the pointer.
    let r = unsafe { libc::ioctl(new.as_raw_fd(), fuse_abi::FUSE_DEV_IOC_CLONE as _, &src) };
    if r < 0 {
        return Err(TransportError::Io(io::Error::last_os_error()));
    }
    Ok(new)
}

/// Canonical form of a mountpoint whose last component may not exist yet: its parent resolved
/// and its name as given, so nothing is asked of whatever is mounted there now (a wedged export
/// would not answer).
pub fn canonical_mountpoint(path: &Path) -> Result<PathBuf, TransportError> {
    let shown = path.display().to_string();
    let name = path
        .file_name()
        .ok_or_else(|| TransportError::MountpointNotFile(shown.clone()))?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let parent = parent
        .canonicalize()
        .map_err(|_| TransportError::MountpointParent(shown.clone()))?;
    if !parent.is_dir() {
        return Err(TransportError::MountpointParent(shown));
    }
    Ok(parent.join(name))
}

impl Mount {
    /// Mounts with whatever fusex may use: mount(2) when it can open `/dev/fuse` and mount (root,
    /// `CAP_SYS_ADMIN`); otherwise through `fusermount3` (see [`crate::fusermount`]), which a
    /// normal user may run. The way chosen is logged at debug level and decides the unmount.
    ///
    /// `before_visible` runs once the mount exists and before anything else can see it (with
    /// mount(2) and `fusermount3`: right after it appeared), given the canonical mountpoint and
    /// the mount's identity; its error undoes the mount.
    pub fn establish(
        cfg: &MountConfig,
        before_visible: BeforeVisible<'_>,
    ) -> Result<Mount, TransportError> {
        let shown = cfg.mountpoint.display().to_string();
        let why = match open_dev_fuse() {
            Ok(fd) => match Mount::new(cfg, fd, before_visible) {
                Err(TransportError::NotPermitted(_)) => "mount(2) is not permitted".to_string(),
                r => return r,
            },
            Err(TransportError::DevFuse(e))
                if matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM)) =>
            {
                format!("cannot open /dev/fuse: {e}")
            }
            Err(e) => return Err(e),
        };
        tracing::debug!("{why}; mounting through {}", crate::fusermount::FUSERMOUNT);
        let mut m = Mount::unmounted(cfg)?;
        let mut attempts = 3;
        loop {
            m.created = m.prepare_mountpoint(&shown)?;
            match m.mount_fusermount(cfg) {
                // As in `new`: the mountpoint a leaving daemon removed between check and mount.
                Err(TransportError::Fusermount { what, .. })
                    if what.contains("No such file") && attempts > 1 =>
                {
                    attempts -= 1;
                }
                Err(e) => {
                    m.remove_created();
                    return Err(e);
                }
                Ok(()) => {
                    if let Some(id) = m.identity {
                        before_visible(&m.mountpoint, &id).map_err(|error| {
                            TransportError::Mount {
                                path: shown.clone(),
                                error,
                            }
                        })?;
                    }
                    return Ok(m);
                }
            }
        }
    }

    /// Checks the mountpoint: canonical, and not already a FUSE mount.
    fn unmounted(cfg: &MountConfig) -> Result<Mount, TransportError> {
        let shown = cfg.mountpoint.display().to_string();
        let mountpoint = canonical_mountpoint(&cfg.mountpoint)?;
        // Only a mount root can be a FUSE mount; a fresh mountpoint is not one, and needs no
        // read of mountinfo (a line per mount of the namespace).
        if crate::mountinfo::is_mount_root(&mountpoint) && fuse_mount_at(&mountpoint).is_some() {
            // A stat asks the daemon: a dead connection answers ENOTCONN at once (ECONNABORTED
            // when the stat was queued just before the connection ended; a wedged daemon's stat
            // returns when the kernel's request timeout aborts the connection).
            return Err(match std::fs::metadata(&mountpoint) {
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTCONN | libc::ECONNABORTED)) => {
                    TransportError::DeadMount(shown)
                }
                _ => TransportError::AlreadyMounted(shown),
            });
        }
        Ok(Mount {
            fd: None,
            mountpoint,
            created: None,
            identity: None,
            via: Via::Kernel,
            directory: cfg.directory,
        })
    }

    /// Checks the mountpoint, creates it if missing and mounts `fd` on exactly the file checked
    /// (see `crate::mount_api`); `before_visible` as for [`Mount::establish`].
    pub fn new(
        cfg: &MountConfig,
        fd: OwnedFd,
        before_visible: BeforeVisible<'_>,
    ) -> Result<Mount, TransportError> {
        let mut m = Mount::unmounted(cfg)?;
        m.fd = Some(fd);
        m.mount(cfg, before_visible)?;
        Ok(m)
    }

    /// Checks what is at the mountpoint; creates the file if missing and says so by its identity.
    fn prepare_mountpoint(&self, shown: &str) -> Result<Option<(u32, u32, u64)>, TransportError> {
        let create_err = |error| TransportError::CreateMountpoint {
            path: shown.to_string(),
            error,
        };
        match std::fs::symlink_metadata(&self.mountpoint) {
            Ok(m) if self.directory => {
                if m.is_dir() {
                    Ok(None)
                } else {
                    Err(TransportError::MountpointNotDir(shown.to_string()))
                }
            }
            Err(e) if self.directory => Err(create_err(e)),
            Ok(m) if m.is_dir() => Err(TransportError::MountpointIsDir(shown.to_string())),
            Ok(m) if !m.is_file() => Err(TransportError::MountpointNotFile(shown.to_string())),
            Ok(_) => Ok(None),
            Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
                Err(TransportError::AlreadyMounted(shown.to_string()))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let f = File::options()
                    .write(true)
                    .create_new(true)
                    .open(&self.mountpoint)
                    .map_err(create_err)?;
                let meta = f.metadata().map_err(create_err)?;
                let (maj, min) = (libc::major(meta.dev()), libc::minor(meta.dev()));
                Ok(Some((maj, min, meta.ino())))
            }
            Err(e) => Err(create_err(e)),
        }
    }

    /// Mounts through `fusermount3`; records the identity as [`Mount::mount`] does.
    fn mount_fusermount(&mut self, cfg: &MountConfig) -> Result<(), TransportError> {
        let shown = cfg.mountpoint.display().to_string();
        let subtype = FUSEX_FSTYPE.strip_prefix("fuse.").unwrap_or(FUSEX_FSTYPE);
        let mounted = crate::fusermount::mount(
            &self.mountpoint,
            &crate::fusermount::Request {
                source: &cfg.source,
                subtype,
                read_only: cfg.read_only,
                allow_other: cfg.allow_other,
                max_read: cfg.max_read,
            },
        )?;
        self.fd = Some(mounted);
        self.via = Via::Fusermount;
        self.record_identity(&shown)
    }

    /// Reads the mount's identity right away, while nothing else can have been mounted over it (a
    /// mount on top of a live FUSE mount is refused before mounting). No request reaches the
    /// daemon: INIT is unanswered yet. Unmounts again if that fails.
    fn record_identity(&mut self, shown: &str) -> Result<(), TransportError> {
        match MountIdentity::of_path(&self.mountpoint) {
            Ok(id) => {
                self.identity = Some(id);
                Ok(())
            }
            Err(error) => {
                let _ = unmount_path(&self.mountpoint, libc::MNT_DETACH);
                Err(TransportError::Mount {
                    path: shown.to_string(),
                    error,
                })
            }
        }
    }

    /// What a successor daemon needs to take this mount over (`fusex restart`): the canonical
    /// mountpoint, which mount it is, the mountpoint file this mount created, and how it was made.
    pub fn handover(&self) -> Option<Handover> {
        Some(Handover {
            mountpoint: self.mountpoint.clone(),
            identity: self.identity?,
            created: self.created,
            via_fusermount: self.via_fusermount(),
            directory: self.directory,
        })
    }

    /// Takes over a mount another fusex process made and hands over (`fusex restart`), with `fd`
    /// on its connection. From here on this process cleans it up at its end exactly as the
    /// predecessor would have: only while the mount at the path is still that one.
    pub fn adopt(h: Handover, fd: OwnedFd) -> Mount {
        Mount {
            fd: Some(fd),
            mountpoint: h.mountpoint,
            created: h.created,
            identity: Some(h.identity),
            via: if h.via_fusermount {
                Via::Fusermount
            } else {
                Via::Kernel
            },
            directory: h.directory,
        }
    }

    /// Lets go of the mount without unmounting it or removing the mountpoint file: a successor
    /// process serves it now (`fusex restart`).
    pub fn disown(mut self) {
        self.identity = None;
        self.created = None;
        self.fd = None;
    }

    /// Whether `fusermount3` made this mount (fusex has no privilege to mount or unmount).
    pub fn via_fusermount(&self) -> bool {
        matches!(self.via, Via::Fusermount)
    }

    /// umount2 with `flags` (mount(2) mounts), or `fusermount3 -u` (lazy for `MNT_DETACH`; a
    /// forced unmount is root's, so it becomes a plain one).
    fn unmount_path(&self, id: &MountIdentity, flags: i32) -> Result<(), TransportError> {
        match self.via {
            // Through a descriptor of the mount checked to be `id`, never by path alone.
            Via::Kernel => crate::identity::unmount_exact(&self.mountpoint, id, flags)
                .map(drop)
                .map_err(|error| TransportError::Unmount {
                    path: self.mountpoint.display().to_string(),
                    error,
                }),
            Via::Fusermount => {
                crate::fusermount::unmount(&self.mountpoint, flags & libc::MNT_DETACH != 0)
            }
        }
    }

    /// Opens the mountpoint without following a symlink and checks it is the regular file that
    /// [`Mount::prepare_mountpoint`] found or made: what gets mounted on is this descriptor.
    fn open_target(&self, shown: &str) -> Result<OwnedFd, TransportError> {
        let mount_err = |error| TransportError::Mount {
            path: shown.to_string(),
            error,
        };
        let fd = crate::identity::open_path(&self.mountpoint).map_err(mount_err)?;
        let (id, kind) = crate::identity::fd_file(fd.as_fd()).map_err(mount_err)?;
        let want = if self.directory {
            libc::S_IFDIR
        } else {
            libc::S_IFREG
        };
        if kind != want || self.created.is_some_and(|made| made != id) {
            return Err(TransportError::MountpointChanged(shown.to_string()));
        }
        Ok(fd)
    }

    /// The root's file type and mode before INIT (`rootmode=`).
    fn root_mode(&self) -> u32 {
        if self.directory {
            libc::S_IFDIR | 0o755
        } else {
            libc::S_IFREG | 0o644
        }
    }

    /// The mount options, as mount(2) and `fsconfig` both take them.
    fn options(&self, cfg: &MountConfig) -> Vec<(&'static str, Option<String>)> {
        let fd = self.fd.as_ref().map(|f| f.as_raw_fd()).unwrap_or(-1);
        // SAFETY: getuid/getgid cannot fail.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        let mut opts = vec![
            ("fd", Some(fd.to_string())),
            ("rootmode", Some(format!("{:o}", self.root_mode()))),
            ("user_id", Some(uid.to_string())),
            ("group_id", Some(gid.to_string())),
            ("default_permissions", None),
            ("max_read", Some(cfg.max_read.to_string())),
        ];
        if cfg.allow_other {
            opts.push(("allow_other", None));
        }
        opts
    }

    fn mount(
        &mut self,
        cfg: &MountConfig,
        before_visible: BeforeVisible<'_>,
    ) -> Result<(), TransportError> {
        let shown = cfg.mountpoint.display().to_string();
        let mount_err = |error: io::Error| match error.raw_os_error() {
            Some(libc::EPERM | libc::EACCES) => TransportError::NotPermitted(shown.clone()),
            _ => TransportError::Mount {
                path: shown.clone(),
                error,
            },
        };
        self.created = self.prepare_mountpoint(&shown)?;
        let detached = match self.mount_detached(cfg) {
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                let target = self.open_target(&shown)?;
                return self.mount_legacy(cfg, &target, before_visible);
            }
            r => r.map_err(mount_err)?,
        };
        let id = crate::identity::identity_of_fd(detached.as_fd()).map_err(mount_err)?;
        before_visible(&self.mountpoint, &id).map_err(mount_err)?;
        // A daemon that just left this mountpoint removes the file if it had created it; when
        // that lands between the check and the attach, the file is gone (ENOENT): make it again
        // and attach the same mount (the connection is bound to it already).
        let mut attempts = 3;
        loop {
            let attached = self.open_target(&shown).and_then(|target| {
                crate::mount_api::attach(detached.as_fd(), target.as_fd()).map_err(mount_err)
            });
            match attached {
                Err(TransportError::Mount { error, .. })
                    if error.raw_os_error() == Some(libc::ENOENT) && attempts > 1 =>
                {
                    attempts -= 1;
                    tracing::debug!("mountpoint {shown} vanished before the mount; again");
                    self.created = self.prepare_mountpoint(&shown)?;
                }
                r => break r?,
            }
        }
        if !id.is_at(&self.mountpoint) {
            // The file was renamed away between the open and the attach (a mounted file can no
            // longer be): the mount sits on it under another name. Take down exactly that mount.
            let _ = crate::identity::umount_through(detached.as_fd(), libc::MNT_DETACH);
            return Err(TransportError::MountpointChanged(shown));
        }
        self.identity = Some(id);
        Ok(())
    }

    /// A detached mount of this export's connection (`fsopen("fuse")` .. `fsmount`).
    fn mount_detached(&self, cfg: &MountConfig) -> io::Result<OwnedFd> {
        let subtype = FUSEX_FSTYPE.strip_prefix("fuse.").unwrap_or(FUSEX_FSTYPE);
        let ctx = crate::mount_api::Context::open("fuse")?;
        ctx.set("source", &cfg.source)?;
        ctx.set("subtype", subtype)?;
        for (key, value) in self.options(cfg) {
            match value {
                Some(v) => ctx.set(key, &v)?,
                None => ctx.flag(key)?,
            }
        }
        let mut attrs = crate::mount_api::ATTR_NOSUID | crate::mount_api::ATTR_NODEV;
        if cfg.read_only {
            ctx.flag("ro")?;
            attrs |= crate::mount_api::ATTR_RDONLY;
        }
        ctx.mount(attrs)
    }

    /// mount(2), for kernels without the descriptor mount API: still onto the checked file
    /// (through its `/proc/self/fd` link), identified by path once it is visible. Not retried:
    /// mount(2) binds the connection to a superblock before it looks at the target's state.
    fn mount_legacy(
        &mut self,
        cfg: &MountConfig,
        target: &OwnedFd,
        before_visible: BeforeVisible<'_>,
    ) -> Result<(), TransportError> {
        let shown = cfg.mountpoint.display().to_string();
        let data = self
            .options(cfg)
            .into_iter()
            .map(|(k, v)| match v {
                Some(v) => format!("{k}={v}"),
                None => k.to_string(),
            })
            .collect::<Vec<_>>()
            .join(",");
        let mut flags = libc::MS_NOSUID | libc::MS_NODEV;
        if cfg.read_only {
            flags |= libc::MS_RDONLY;
        }
        let c = |s: &[u8]| {
            CString::new(s).map_err(|_| TransportError::MountpointNotFile(shown.clone()))
        };
        let source = c(cfg.source.as_bytes())?;
        let link = c(format!("/proc/self/fd/{}", target.as_raw_fd()).as_bytes())?;
        let fstype = c(FUSEX_FSTYPE.as_bytes())?;
        let data = c(data.as_bytes())?;
        // SAFETY: all pointers are valid NUL-terminated strings that live across the call.
        let r = unsafe {
            libc::mount(
                source.as_ptr(),
                link.as_ptr(),
                fstype.as_ptr(),
                flags,
                data.as_ptr().cast(),
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::EPERM | libc::EACCES) => TransportError::NotPermitted(shown),
                // The file went away after the open: mount(2) may have bound the connection to
                // a superblock already, so it cannot simply be tried again.
                Some(libc::ENOENT) => TransportError::MountpointChanged(shown),
                _ => TransportError::Mount {
                    path: shown,
                    error: e,
                },
            });
        }
        self.record_identity(&shown)?;
        if let Some(id) = self.identity {
            if let Err(error) = before_visible(&self.mountpoint, &id) {
                let _ = self.unmount();
                return Err(TransportError::Mount { path: shown, error });
            }
        }
        Ok(())
    }

    /// The mount's `/dev/fuse` fd (queue 0 reads from it; other queues clone it), until taken.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|f| f.as_fd())
    }

    /// Takes the fd out (a queue owns it from now on); the mount stays.
    pub fn take_fd(&mut self) -> Option<OwnedFd> {
        self.fd.take()
    }

    /// The canonical mountpoint.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Whether this mount created the mountpoint file (and so removes it at the end, which needs
    /// write access to its directory).
    pub fn created_mountpoint(&self) -> bool {
        self.created.is_some()
    }

    /// Which mount is ours (None once unmounted): what anything deciding whether the mount at the
    /// mountpoint is this export's should compare with.
    pub fn identity(&self) -> Option<MountIdentity> {
        self.identity
    }

    /// Our identity, if the mount at the mountpoint is still ours; forgets it otherwise (someone
    /// else unmounted it, and the path may hold another mount by now: that one is left alone).
    fn still_ours(&mut self) -> Option<MountIdentity> {
        let id = self.identity?;
        if id.is_at(&self.mountpoint) {
            return Some(id);
        }
        tracing::debug!(
            "{} no longer holds this export's mount; leaving the path alone",
            self.mountpoint.display()
        );
        self.identity = None;
        None
    }

    /// Unmounts now (lazily: the namespace forgets the mount at once even if files are open; the
    /// connection dies when fusex closes its fds). Idempotent; a mount already gone is fine, and a
    /// mount that is not ours is never touched.
    pub fn unmount(&mut self) -> Result<(), TransportError> {
        let Some(id) = self.still_ours() else {
            return Ok(());
        };
        self.identity = None;
        self.unmount_path(&id, libc::MNT_DETACH)
    }

    /// Aborts the connection (a forced unmount: every request the kernel still holds fails, every
    /// io_uring entry completes) and then unmounts, lazily if files are still open. The way to end
    /// io_uring queues, whose pending commands keep `/dev/fuse` open. Only ever on our own mount.
    pub fn abort(&mut self) -> Result<(), TransportError> {
        let Some(id) = self.still_ours() else {
            return Ok(());
        };
        match self.unmount_path(&id, libc::MNT_FORCE) {
            Ok(()) => {
                self.identity = None;
                Ok(())
            }
            Err(_) => self.unmount(),
        }
    }

    /// Removes the mountpoint file if this mount created it, the path still shows that very
    /// file (not a mount on top of it, not a file someone made anew) and it is still empty.
    ///
    /// fusex created it empty, and nothing could write to it while the export covered it; but a
    /// stop with files still open detaches the export from the path first, and a program that
    /// opens the path meanwhile writes to this file. Those bytes are the program's: the file is
    /// kept, with a warning naming it.
    fn remove_created(&self) {
        let Some(made) = self.created else {
            return;
        };
        match file_id(&self.mountpoint) {
            Ok(now) if now == made => {}
            Ok(_) => {
                tracing::debug!(
                    "{} is covered or replaced; not removing it",
                    self.mountpoint.display()
                );
                return;
            }
            Err(_) => return,
        }
        match std::fs::symlink_metadata(&self.mountpoint) {
            Ok(m) if m.len() == 0 => {}
            Ok(m) => {
                tracing::warn!(
                    "kept {}, the mountpoint file fusex created: {} bytes were written to it \
                     after the export left the path (they are not in the image)",
                    self.mountpoint.display(),
                    m.len()
                );
                return;
            }
            Err(_) => return,
        }
        if let Err(e) = std::fs::remove_file(&self.mountpoint) {
            // EBUSY: the next export mounted on it after the check above; it is theirs now.
            if e.kind() != io::ErrorKind::NotFound && e.raw_os_error() != Some(libc::EBUSY) {
                tracing::warn!(
                    "cannot remove mountpoint {}: {e}",
                    self.mountpoint.display()
                );
            }
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Err(e) = self.unmount() {
            tracing::error!("{e}");
        }
        self.remove_created();
    }
}

fn unmount_path(path: &Path, flags: i32) -> Result<(), TransportError> {
    let shown = path.display().to_string();
    let target = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| TransportError::NotMounted(shown.clone()))?;
    // SAFETY: target is a valid NUL-terminated path.
    if unsafe { libc::umount2(target.as_ptr(), flags | libc::UMOUNT_NOFOLLOW) } < 0 {
        return Err(TransportError::Unmount {
            path: shown,
            error: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// `fusex umount`: unmounts the fusex export at `path`. Anything else is refused: a path with no
/// FUSE mount always, another FUSE filesystem (fstype not [`FUSEX_FSTYPE`]) unless `force`. A busy
/// mount is detached lazily, so the daemon sees the device go away once the last file closes.
pub fn unmount(path: &Path, force: bool) -> Result<(), TransportError> {
    let shown = path.display().to_string();
    let canon = canonical_mountpoint(path)?;
    let Some(entry) = fuse_mount_at(&canon) else {
        return Err(TransportError::NotMounted(shown));
    };
    if !entry.is_fusex() && !force {
        return Err(TransportError::NotFusex {
            path: shown,
            fstype: entry.fstype,
            from: entry.source,
        });
    }
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let unmount = |lazy: bool| match unmount_path(&canon, if lazy { libc::MNT_DETACH } else { 0 }) {
        // A normal user: the mount came from fusermount3, and so does the unmount.
        Err(TransportError::Unmount { error, .. })
            if error.raw_os_error() == Some(libc::EPERM) && !root =>
        {
            crate::fusermount::unmount(&canon, lazy)
        }
        r => r,
    };
    match unmount(false) {
        Err(TransportError::Unmount { error, .. }) if error.raw_os_error() == Some(libc::EBUSY) => {
            tracing::info!("{shown} is busy; detaching it lazily");
            unmount(true)
        }
        r => r,
    }
}
