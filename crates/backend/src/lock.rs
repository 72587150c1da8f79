//! Image locking that QEMU understands, so fusex and QEMU's tools (qemu-img, qemu-io, qemu-nbd,
//! qemu-storage-daemon, a VM) keep each other off an image the other one owns.
//!
//! QEMU's file driver (QEMU 6.2 and later, including 7.2) expresses block-layer permissions as
//! open-file-description (OFD) byte-range locks on the image file itself: for permission bit `i`
//! it read-locks byte `100 + i` while it *holds* the permission and byte `200 + i` while it
//! *refuses to share* it. Before settling, it tests (`F_OFD_GETLK` for a write lock) the "not
//! shared" byte of every permission it wants and the "held" byte of every permission it refuses to
//! share; any lock there belongs to another open file description, i.e. another user, and the
//! open fails. Every lock is a read lock, so users never block each other by locking: only the
//! tests decide, and they run after the locks are in place (two users starting at once both see
//! each other and both fail, never both succeed).
//!
//! fusex takes the same locks on one descriptor per image file. OFD locks belong to the open
//! file description, not the process: a test from the same description ignores its own locks,
//! other descriptions fusex opens on the same file (the buffered twin of an O_DIRECT raw image,
//! the qcow2 attribute descriptor) take no locks and so never conflict, and the locks last until
//! the locked descriptor closes, which is when the export ends.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// Byte whose read lock says "holds permission 0"; permission `i` uses `PERM_BASE + i`.
const PERM_BASE: i64 = 100;
/// Byte whose read lock says "does not share permission 0"; permission `i` uses `SHARED_BASE + i`.
const SHARED_BASE: i64 = 200;
/// Permission bits QEMU 6.2+ defines (bit 4, "graph-mod", was dropped in 6.2; its bytes stay
/// untouched).
const PERM_BITS: u32 = 4;

/// A set of QEMU block-layer permissions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Perms(u8);

impl Perms {
    /// No permission.
    pub const NONE: Perms = Perms(0);
    /// Reading returns what was last written (nobody changes the data underneath).
    pub const CONSISTENT_READ: Perms = Perms(0x01);
    /// Changing the guest-visible data.
    pub const WRITE: Perms = Perms(0x02);
    /// Writing data that does not change what a read returns.
    pub const WRITE_UNCHANGED: Perms = Perms(0x04);
    /// Changing the image file's size.
    pub const RESIZE: Perms = Perms(0x08);
    /// Every permission.
    pub const ALL: Perms = Perms(0x0f);

    /// Both sets.
    pub const fn union(self, other: Perms) -> Perms {
        Perms(self.0 | other.0)
    }

    /// `other` when `cond`, else nothing (for building sets from options).
    pub const fn when(cond: bool, other: Perms) -> Perms {
        if cond {
            other
        } else {
            Perms::NONE
        }
    }

    /// Whether every permission of `other` is in this set.
    pub const fn contains(self, other: Perms) -> bool {
        self.0 & other.0 == other.0
    }

    fn has_bit(self, i: u32) -> bool {
        self.0 & (1 << i) != 0
    }
}

/// QEMU's name of permission bit `i`, as its own lock errors print it.
fn perm_name(i: u32) -> &'static str {
    match i {
        0 => "consistent read",
        1 => "write",
        2 => "write unchanged",
        _ => "resize",
    }
}

/// What one user of an image file claims and what it lets others claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claim {
    /// Permissions this user holds.
    pub perm: Perms,
    /// Permissions others may hold at the same time.
    pub shared: Perms,
    /// Take the locks without testing for other users ([`Locking::Takeover`]).
    pub untested: bool,
}

/// How an export locks its image files.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Locking {
    /// Claim what the export needs and share only reading (and unchanged writes): no other
    /// writer or resizer while the export lives, as QEMU's tools and VMs do by default.
    #[default]
    Exclusive,
    /// `--force-share` (qemu-img `-U`): claim consistent read but share everything, so the
    /// image may be written under a read-only export. Only for read-only exports.
    ForceShare,
    /// `--no-locking` (QEMU's `locking=off`): no locks at all, for measurements that export one
    /// image several times at once. Nothing keeps other writers off the image.
    Off,
    /// `fusex restart`: the [`Locking::Exclusive`] claim, taken without the conflict test. The
    /// daemon handing over holds the very same locks on its own open file description until the
    /// new one holds them, so nobody else can have taken a conflicting permission in between; the
    /// test would only find the predecessor. No window opens in which another writer could
    /// claim the image.
    Takeover,
}

impl Claim {
    /// Others may read, and write what does not change the data; nobody else may write or resize.
    const SHARE_READS: Perms = Perms::CONSISTENT_READ.union(Perms::WRITE_UNCHANGED);

    /// The image file a raw export serves: write while writable, resize while growable.
    /// `None` with [`Locking::Off`] (likewise below).
    pub fn raw(locking: Locking, writable: bool, growable: bool) -> Option<Claim> {
        Claim::with(locking, || Claim {
            perm: Perms::CONSISTENT_READ
                .union(Perms::when(writable, Perms::WRITE))
                .union(Perms::when(writable && growable, Perms::RESIZE)),
            shared: Claim::SHARE_READS,
            untested: false,
        })
    }

    /// The file of a qcow2 image: as QEMU's qcow2 driver claims its file, write and resize while
    /// writable (allocating clusters grows the file), never sharing write or resize (its
    /// metadata must not change underneath, even for a read-only user).
    pub fn qcow2(locking: Locking, writable: bool) -> Option<Claim> {
        Claim::with(locking, || Claim {
            perm: Perms::CONSISTENT_READ
                .union(Perms::when(writable, Perms::WRITE.union(Perms::RESIZE))),
            shared: Claim::SHARE_READS,
            untested: false,
        })
    }

    /// A backing (or external data) file a qcow2 image names: read only, and, as QEMU derives
    /// for the backing of an image whose users do not share write, nobody else may write or
    /// resize it (that would change the guest view of every image above it).
    pub fn backing(locking: Locking) -> Option<Claim> {
        Claim::with(locking, || Claim {
            perm: Perms::CONSISTENT_READ,
            shared: Claim::SHARE_READS,
            untested: false,
        })
    }

    /// `exclusive()` for [`Locking::Exclusive`]; for `ForceShare` what qemu-img `-U` leaves on a
    /// file (consistent read, everything shared); nothing for `Off`.
    fn with(locking: Locking, exclusive: impl FnOnce() -> Claim) -> Option<Claim> {
        match locking {
            Locking::Exclusive => Some(exclusive()),
            Locking::Takeover => Some(Claim {
                untested: true,
                ..exclusive()
            }),
            Locking::ForceShare => Some(Claim {
                perm: Perms::CONSISTENT_READ,
                shared: Perms::ALL,
                untested: false,
            }),
            Locking::Off => None,
        }
    }
}

/// Why an image file could not be locked. Each message names the file and what to do.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process holds a permission this export refuses to share, or refuses to share one
    /// this export needs.
    #[error("{subject} is in use by another process ({lock} lock): {hint}")]
    InUse {
        /// The file, described for the user ("image X", "backing file Y of image X").
        subject: String,
        /// QEMU's name for the conflict: "write" (another user refuses to share write, which
        /// this export needs) or "shared write" (another user holds write, which this export
        /// refuses to share).
        lock: String,
        /// What to do.
        hint: &'static str,
    },
    /// The filesystem refused the lock for another reason.
    #[error("cannot lock {subject} (byte {byte}): {source}: put the image on a filesystem with OFD lock support")]
    Os {
        /// The file, described for the user.
        subject: String,
        /// The lock byte that failed.
        byte: i64,
        /// What the OS said.
        source: io::Error,
    },
}

/// Takes `claim`'s locks on `file`'s open file description, then checks that no other user
/// conflicts with them; on a conflict the locks taken are dropped again. The locks last while
/// the description is open. `subject` names the file in errors; no claim, no locks.
pub fn lock_file(file: &File, claim: Option<Claim>, subject: &str) -> Result<(), LockError> {
    let Some(claim) = claim else {
        return Ok(());
    };
    let hint = if claim.shared == Perms::ALL {
        "stop it"
    } else {
        "stop it, or use --force-share for a read-only export"
    };
    let r = apply(file, claim).and_then(|()| {
        if claim.untested {
            Ok(())
        } else {
            check(file, claim)
        }
    });
    match r {
        Ok(()) => Ok(()),
        Err(e) => {
            unlock_all(file);
            Err(match e {
                Failure::Conflict(lock) => LockError::InUse {
                    subject: subject.to_string(),
                    lock,
                    hint,
                },
                Failure::Os(byte, source) => LockError::Os {
                    subject: subject.to_string(),
                    byte,
                    source,
                },
            })
        }
    }
}

enum Failure {
    Conflict(String),
    Os(i64, io::Error),
}

/// The bytes `claim` read-locks: held permissions, then permissions not shared.
fn claimed_bytes(claim: Claim) -> impl Iterator<Item = i64> {
    let held = (0..PERM_BITS)
        .filter(move |&i| claim.perm.has_bit(i))
        .map(|i| PERM_BASE + i64::from(i));
    let unshared = (0..PERM_BITS)
        .filter(move |&i| !claim.shared.has_bit(i))
        .map(|i| SHARED_BASE + i64::from(i));
    held.chain(unshared)
}

fn apply(file: &File, claim: Claim) -> Result<(), Failure> {
    for byte in claimed_bytes(claim) {
        match set_lock(file, libc::F_RDLCK, byte) {
            Ok(()) => {}
            // Someone write-locked a QEMU byte: not a QEMU user, but a conflict all the same.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EACCES)) => {
                return Err(Failure::Conflict(describe(byte)))
            }
            Err(e) => return Err(Failure::Os(byte, e)),
        }
    }
    Ok(())
}

/// The conflict a lock on `byte` held by someone else means to a user that cannot accept it.
fn describe(byte: i64) -> String {
    if byte >= SHARED_BASE {
        perm_name((byte - SHARED_BASE) as u32).to_string()
    } else {
        format!("shared {}", perm_name((byte - PERM_BASE) as u32))
    }
}

fn check(file: &File, claim: Claim) -> Result<(), Failure> {
    // Permissions wanted: nobody may refuse to share them.
    for i in (0..PERM_BITS).filter(|&i| claim.perm.has_bit(i)) {
        let byte = SHARED_BASE + i64::from(i);
        if locked_elsewhere(file, byte).map_err(|e| Failure::Os(byte, e))? {
            return Err(Failure::Conflict(describe(byte)));
        }
    }
    // Permissions not shared: nobody may hold them.
    for i in (0..PERM_BITS).filter(|&i| !claim.shared.has_bit(i)) {
        let byte = PERM_BASE + i64::from(i);
        if locked_elsewhere(file, byte).map_err(|e| Failure::Os(byte, e))? {
            return Err(Failure::Conflict(describe(byte)));
        }
    }
    Ok(())
}

fn unlock_all(file: &File) {
    for base in [PERM_BASE, SHARED_BASE] {
        for i in 0..PERM_BITS {
            // Unlocking a byte this description does not hold is a no-op; failure cannot leave
            // more locked than before.
            let _ = set_lock(file, libc::F_UNLCK, base + i64::from(i));
        }
    }
}

fn flock_for(ty: libc::c_int, byte: i64) -> libc::flock {
    // SAFETY: `flock` is plain old data; all-zero is a valid value (and OFD locks require
    // l_pid == 0).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = ty as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = byte;
    fl.l_len = 1;
    fl
}

/// `F_OFD_SETLK` of one byte (read lock or unlock), never waiting.
fn set_lock(file: &File, ty: libc::c_int, byte: i64) -> io::Result<()> {
    let fl = flock_for(ty, byte);
    // SAFETY: `fl` is a valid, initialized flock that outlives the call; `file` owns its fd.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &fl) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether another open file description holds any lock on `byte`: `F_OFD_GETLK` asks whether a
/// write lock would be granted, which any other lock there prevents (locks of `file`'s own
/// description never conflict with it).
fn locked_elsewhere(file: &File, byte: i64) -> io::Result<bool> {
    let mut fl = flock_for(libc::F_WRLCK, byte);
    // SAFETY: as in `set_lock`; the kernel writes the answer back into `fl`.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fl.l_type != libc::F_UNLCK as libc::c_short)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_descriptions() -> (tempfile::NamedTempFile, File, File) {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(1 << 20).unwrap();
        let a = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(f.path())
            .unwrap();
        let b = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(f.path())
            .unwrap();
        (f, a, b)
    }

    fn in_use(r: Result<(), LockError>) -> String {
        match r {
            Err(LockError::InUse { lock, .. }) => lock,
            other => panic!("expected a conflict, got {other:?}"),
        }
    }

    #[test]
    fn two_writers_exclude_each_other_until_the_first_closes() {
        let (_f, a, b) = two_descriptions();
        let rw = Claim::raw(Locking::Exclusive, true, false);
        lock_file(&a, rw, "image A").unwrap();
        // A refuses to share write, which B wants.
        assert_eq!(in_use(lock_file(&b, rw, "image B")), "write");
        // A failed attempt leaves nothing behind on B: a reader that shares everything fits.
        lock_file(&b, Claim::raw(Locking::ForceShare, false, false), "image B").unwrap();
        drop(b);
        drop(a);
        let (_f, a, b) = two_descriptions();
        lock_file(&a, rw, "image A").unwrap();
        drop(a);
        lock_file(&b, rw, "image B").unwrap();
    }

    #[test]
    fn readers_coexist_and_keep_writers_and_resizers_out() {
        let (f, a, b) = two_descriptions();
        let ro = Claim::raw(Locking::Exclusive, false, false);
        lock_file(&a, ro, "image A").unwrap();
        lock_file(&b, ro, "image B").unwrap();
        // A third description of the same file that wants write is refused by either reader.
        let c = File::options()
            .read(true)
            .write(true)
            .open(f.path())
            .unwrap();
        assert_eq!(
            in_use(lock_file(
                &c,
                Claim::raw(Locking::Exclusive, true, false),
                "C"
            )),
            "write"
        );
        let grow = Claim {
            perm: Perms::RESIZE,
            shared: Perms::ALL,
            untested: false,
        };
        assert_eq!(in_use(lock_file(&c, Some(grow), "C")), "resize");
    }

    #[test]
    fn a_reader_is_refused_while_someone_holds_write() {
        let (_f, a, b) = two_descriptions();
        // What qemu-io does on a raw image it opened read-write: holds write, shares everything.
        let qemu_io = Claim {
            perm: Perms::CONSISTENT_READ.union(Perms::WRITE),
            shared: Perms::ALL,
            untested: false,
        };
        lock_file(&a, Some(qemu_io), "qemu-io").unwrap();
        let e = lock_file(&b, Claim::raw(Locking::Exclusive, false, false), "image B").unwrap_err();
        assert_eq!(
            e.to_string(),
            "image B is in use by another process (shared write lock): stop it, or use \
             --force-share for a read-only export"
        );
        lock_file(&b, Claim::raw(Locking::ForceShare, false, false), "image B").unwrap();
    }

    #[test]
    fn locks_sit_on_qemu_bytes() {
        let (_f, a, b) = two_descriptions();
        lock_file(&a, Claim::qcow2(Locking::Exclusive, true), "A").unwrap();
        let held: Vec<i64> = (100..104)
            .chain(200..204)
            .filter(|&byte| locked_elsewhere(&b, byte).unwrap())
            .collect();
        // qemu-io on a qcow2 image opened read-write locks exactly these.
        assert_eq!(held, vec![100, 101, 103, 201, 203]);
        // The locking description does not see its own locks.
        assert!(!locked_elsewhere(&a, 101).unwrap());
    }

    #[test]
    fn a_takeover_holds_the_locks_before_the_predecessor_lets_go() {
        let (f, old, new) = two_descriptions();
        lock_file(&old, Claim::raw(Locking::Exclusive, true, true), "old").unwrap();
        // The exclusive claim would find the predecessor; the takeover takes the same bytes.
        assert_eq!(
            in_use(lock_file(
                &new,
                Claim::raw(Locking::Exclusive, true, true),
                "new"
            )),
            "write"
        );
        lock_file(&new, Claim::raw(Locking::Takeover, true, true), "new").unwrap();
        drop(old);
        // A third user is refused throughout: first by both, now by the successor alone.
        let third = File::options()
            .read(true)
            .write(true)
            .open(f.path())
            .unwrap();
        assert_eq!(
            in_use(lock_file(
                &third,
                Claim::raw(Locking::Exclusive, true, false),
                "third"
            )),
            "write"
        );
    }
}
