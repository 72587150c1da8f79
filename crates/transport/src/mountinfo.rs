//! Which mount is where: `/proc/self/mountinfo` (is something mounted at a path, is it FUSE, is it
//! a fusex export) and [`MountIdentity`] (is the mount at a path the one this process made).

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// The filesystem type every fusex export has: `fuse` with subtype `fusex`, given to mount(2)
/// as is and shown in mountinfo's fstype field. It is how `fusex umount` tells a fusex export
/// from another FUSE filesystem (nbdfuse, sshfs, ... show `fuse` or `fuse.<their name>`).
pub const FUSEX_FSTYPE: &str = "fuse.fusex";

/// One line of mountinfo, the parts fusex needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    /// Mount point, unescaped.
    pub mount_point: String,
    /// Filesystem type (e.g. `fuse.fusex`).
    pub fstype: String,
    /// Mount source, unescaped (for a fusex export: the image as given on the command line).
    pub source: String,
    /// For a FUSE mount, the user whose daemon serves it (the `user_id=` super option: the uid
    /// that mounted it, or the user `fusermount3` mounted it for).
    pub user_id: Option<u32>,
}

impl MountEntry {
    /// Whether this is a fusex export (fstype [`FUSEX_FSTYPE`]).
    pub fn is_fusex(&self) -> bool {
        self.fstype == FUSEX_FSTYPE
    }
}

/// Undoes mountinfo's octal escapes (`\040` for a space, ...).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 4 <= b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = b[i + 1..i + 4]
                .iter()
                .fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0'));
            if let Ok(v) = u8::try_from(v) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses mountinfo text into entries (lines that do not parse are skipped).
pub fn parse(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let (pre, post) = line.split_once(" - ")?;
            let mount_point = pre.split(' ').nth(4)?;
            let mut post = post.split(' ');
            let fstype = post.next()?;
            let source = post.next().unwrap_or("");
            let user_id = post
                .next()
                .unwrap_or("")
                .split(',')
                .find_map(|o| o.strip_prefix("user_id=")?.parse().ok());
            Some(MountEntry {
                mount_point: unescape(mount_point),
                fstype: fstype.to_string(),
                source: unescape(source),
                user_id,
            })
        })
        .collect()
}

/// The FUSE mount at exactly `path` (already canonical), if any; the last one wins when stacked.
pub fn fuse_mount_at(path: &Path) -> Option<MountEntry> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let want = path.to_string_lossy();
    parse(&text)
        .into_iter()
        .rev()
        .find(|m| m.mount_point == want && (m.fstype == "fuse" || m.fstype.starts_with("fuse.")))
}

/// Every fusex export (fstype [`FUSEX_FSTYPE`]) in this process's mount namespace, in mount order:
/// what to look through for the export, perhaps one whose daemon died, that holds an image.
pub fn fusex_mounts() -> Vec<MountEntry> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    parse(&text)
        .into_iter()
        .filter(MountEntry::is_fusex)
        .collect()
}

/// Which mount is this one: names one mount instance, not the path it sits on.
///
/// A path changes hands: once an export is unmounted, the next `fusex mount` may put a new export
/// on the same file while the old daemon is still cleaning up, and anything that acts on "the FUSE
/// mount at PATH" (the old daemon's unmount, an auto-unmount watcher) would act on the newcomer.
/// Code that unmounts a mount it made asks [`MountIdentity::is_at`] first.
///
/// The identity is the kernel's mount id as `statx(2)` reports it for the mount's root: the 64-bit
/// `STATX_MNT_ID_UNIQUE` (Linux 6.8+), which is never reused, plus the superblock's device number
/// (for FUSE, the connection's `st_dev`). Before 6.8 only the 32-bit `STATX_MNT_ID` exists; it and
/// the device number are both handed out again once freed, so on such kernels a new mount can
/// (rarely) look like the old one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MountIdentity {
    mnt_id: u64,
    unique: bool,
    dev: (u32, u32),
}

impl MountIdentity {
    /// The identity of the topmost mount at `path` (canonical; a final symlink is not followed).
    ///
    /// Reads cached attributes only (`AT_STATX_DONT_SYNC`), so it sends no request to a FUSE
    /// daemon: safe on an export whose INIT is not answered yet, whose daemon is busy or gone.
    /// With nothing mounted at `path` it names the mount holding the file itself.
    pub fn of_path(path: &Path) -> io::Result<MountIdentity> {
        let st = statx_nosync(path, libc::STATX_MNT_ID_UNIQUE)?;
        Ok(identity_from(&st))
    }

    /// Whether the mount on top of `path` now is this one. False when it cannot be told (the path
    /// is gone, say): the caller then leaves the path alone.
    pub fn is_at(&self, path: &Path) -> bool {
        MountIdentity::of_path(path).is_ok_and(|now| now == *self)
    }

    /// The mount's device number (major, minor): for FUSE, the connection's, which also names its
    /// directory in `/sys/fs/fuse/connections/`.
    pub fn dev(&self) -> (u32, u32) {
        self.dev
    }

    /// Whether the id is the never-reused 64-bit one (Linux 6.8+).
    pub fn is_unique(&self) -> bool {
        self.unique
    }

    /// The mount id (`stx_mnt_id`): the unique one when [`MountIdentity::is_unique`].
    pub fn mount_id(&self) -> u64 {
        self.mnt_id
    }

    /// An identity handed over from another process (the `--auto-unmount` watcher gets it on its
    /// command line).
    pub fn from_parts(mount_id: u64, unique: bool, dev: (u32, u32)) -> MountIdentity {
        MountIdentity {
            mnt_id: mount_id,
            unique,
            dev,
        }
    }
}

/// The (device, inode) of the file at `path` as the topmost mount shows it, without asking a FUSE
/// daemon (see [`MountIdentity::of_path`]): tells "the file fusex created" from whatever replaced
/// or covers it since.
pub(crate) fn file_id(path: &Path) -> io::Result<(u32, u32, u64)> {
    let st = statx_nosync(path, libc::STATX_INO)?;
    Ok((st.stx_dev_major, st.stx_dev_minor, st.stx_ino))
}

fn statx_nosync(path: &Path, mask: u32) -> io::Result<libc::statx> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let mut st = std::mem::MaybeUninit::<libc::statx>::zeroed();
    let flags = libc::AT_STATX_DONT_SYNC | libc::AT_SYMLINK_NOFOLLOW | libc::AT_NO_AUTOMOUNT;
    // SAFETY: `c` is a NUL-terminated path living across the call; `st` is a writable statx buffer.
    let r = unsafe { libc::statx(libc::AT_FDCWD, c.as_ptr(), flags, mask, st.as_mut_ptr()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: statx succeeded and filled the buffer (which was zeroed to begin with).
    Ok(unsafe { st.assume_init() })
}

/// Whether something is mounted on `path` (it is the root of a mount), from cached attributes
/// (no request to a FUSE daemon); true when that cannot be told, so callers then look further.
/// Cheaper than [`fuse_mount_at`], whose mountinfo read costs a formatted line per mount.
pub fn is_mount_root(path: &Path) -> bool {
    let root = libc::STATX_ATTR_MOUNT_ROOT as u64;
    match statx_nosync(path, 0) {
        Ok(st) => st.stx_attributes_mask & root == 0 || st.stx_attributes & root != 0,
        Err(_) => true,
    }
}

/// The identity a `statx` for `STATX_MNT_ID_UNIQUE` reports.
pub(crate) fn identity_from(st: &libc::statx) -> MountIdentity {
    MountIdentity {
        mnt_id: st.stx_mnt_id,
        unique: st.stx_mask & libc::STATX_MNT_ID_UNIQUE != 0,
        dev: (st.stx_dev_major, st.stx_dev_minor),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mount_root_is_told_from_a_plain_file() {
        assert!(is_mount_root(Path::new("/")), "/ is a mount's root");
        assert!(is_mount_root(Path::new("/proc")), "/proc is a mount's root");
        let dir = std::env::temp_dir().join(format!("fusex-root-{}", std::process::id()));
        std::fs::write(&dir, b"").unwrap();
        let plain = is_mount_root(&dir);
        std::fs::remove_file(&dir).unwrap();
        assert!(!plain, "a fresh file is no mount's root");
    }

    #[test]
    fn parses_fuse_lines_and_escapes() {
        let t = "36 35 98:0 / /mnt1 rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n\
                 40 22 0:45 / /tmp/a\\040b/disk.raw rw,nosuid,nodev - fuse.fusex /img rw,user_id=0\n\
                 garbage\n";
        let e = parse(t);
        assert_eq!(e.len(), 2);
        assert_eq!(e[1].mount_point, "/tmp/a b/disk.raw");
        assert_eq!(e[1].fstype, "fuse.fusex");
        assert_eq!(e[1].source, "/img");
        assert_eq!(e[1].user_id, Some(0));
        assert_eq!(e[0].user_id, None);
        assert!(e[1].is_fusex());
        assert_eq!(e[0].fstype, "ext3");
        assert!(!e[0].is_fusex());
    }

    #[test]
    fn only_the_fusex_subtype_is_fusex() {
        let t = "42 27 0:39 / /tmp/nbd rw,nosuid,nodev - fuse /dev/fuse rw,user_id=0\n\
                 43 27 0:40 / /tmp/x rw - fuse.sshfs host: rw\n\
                 44 27 0:41 / /tmp/y rw - fuse.fusexx /i rw\n";
        assert!(parse(t).iter().all(|e| !e.is_fusex()));
    }

    #[test]
    fn identity_follows_the_mount_not_the_path() {
        let dir = std::env::temp_dir().join(format!("fusex-ident-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = dir.join("a");
        std::fs::write(&a, b"x").unwrap();
        let id = MountIdentity::of_path(&a).unwrap();
        // Same mount for every file on it; a missing path is never "mine".
        assert_eq!(MountIdentity::of_path(&dir).unwrap(), id);
        assert!(id.is_at(&a));
        assert!(!id.is_at(&dir.join("missing")));
        // Another mount (procfs) is not this one.
        assert!(!id.is_at(Path::new("/proc")));
        let f = file_id(&a).unwrap();
        std::fs::remove_file(&a).unwrap();
        std::fs::write(&a, b"y").unwrap();
        let g = file_id(&a).unwrap();
        assert_eq!((f.0, f.1), (g.0, g.1));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unescape_edge_cases() {
        assert_eq!(unescape("a\\040"), "a ");
        assert_eq!(unescape("a\\04"), "a\\04");
        assert_eq!(unescape("\\"), "\\");
        assert_eq!(unescape("x\\134y"), "x\\y");
    }
}
