//! Dropping privileges once the export runs.
//!
//! fusex starts as root because mount(2), `/dev/fuse` and `FUSE_DEV_IOC_BACKING_OPEN` need it.
//! Once every queue has started, nothing it does for the rest of its life needs more than:
//!
//! - `CAP_SYS_ADMIN`, always: `umount2` at exit (the forced unmount that aborts the connection and
//!   the lazy one after it) and `FUSE_DEV_IOC_BACKING_CLOSE` of the passthrough backing id.
//! - `CAP_DAC_OVERRIDE`, only when the exit path touches a directory or file that root could not
//!   touch as an ordinary owner: removing the mountpoint file fusex created, renaming and removing
//!   the pid file, writing the stats file (and its `SIGUSR1` dumps, by rename), and looking the
//!   mountpoint up to unmount it. [`Plan::decide`] asks the kernel (`faccessat2(AT_EACCESS)` from
//!   a scratch thread whose effective set lacks the DAC capabilities) instead of guessing from mode
//!   bits, so ACLs and the like count.
//! - `CAP_FOWNER`, only on a writable export of an image another user owns: SETATTR with times
//!   (`touch` on the export) sets them on the image with `futimens`, which only the owner may.
//!
//! Everything else goes: nothing opens a file after start-up (the image and a qcow2 image's
//! backing chain are opened before mounting; the final flush and passthrough use the open
//! descriptors), io_uring rings and their registered buffers are set up before the drop (the
//! `RLIMIT_MEMLOCK` exemption of `CAP_IPC_LOCK` is decided when a ring is created), and requests
//! only read and write descriptors that are already open. Passthrough I/O runs with the
//! credentials the kernel recorded at `FUSE_DEV_IOC_BACKING_OPEN`, before the drop.
//!
//! Capabilities are per thread on Linux: `capset(2)` (`caps::set`) changes the calling thread
//! only, and so do `PR_CAPBSET_DROP` and `PR_SET_NO_NEW_PRIVS`; a thread inherits its creator's
//! at creation. So [`Plan::apply`] runs in every long-lived thread: each queue thread once it is
//! set up (before it submits anything, so the io_uring workers the kernel forks from it later
//! inherit the reduced set), the signal thread when it starts, and the main thread once every
//! queue has started. Threads that exist only during start-up (the one that opens the image) end
//! before the drop, taking their io_uring workers with them.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use caps::{
    bit, Cap, Sets, CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER, CAP_FSETID,
    CAP_SETPCAP, CAP_SYS_ADMIN,
};

/// The capabilities fusex may keep, by name, for the log line.
const NAMES: [(Cap, &str); 6] = [
    (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"),
    (CAP_DAC_OVERRIDE, "CAP_DAC_OVERRIDE"),
    (CAP_FOWNER, "CAP_FOWNER"),
    (CAP_CHOWN, "CAP_CHOWN"),
    (CAP_DAC_READ_SEARCH, "CAP_DAC_READ_SEARCH"),
    (CAP_FSETID, "CAP_FSETID"),
];

/// Whether this process may register FUSE passthrough backing files
/// (`FUSE_DEV_IOC_BACKING_OPEN`): the kernel asks for `CAP_SYS_ADMIN` in the initial user
/// namespace. A directory export with `--passthrough auto` asks for passthrough only then: granted
/// but refused at every open, it would serve every file itself and cost the writeback cache,
/// which INIT cannot take beside passthrough.
pub fn may_register_backing_files() -> bool {
    caps::get().is_ok_and(|s| s.effective & bit(CAP_SYS_ADMIN) != 0) && in_initial_user_namespace()
}

/// Whether this process runs in the initial user namespace, the one that maps every id to
/// itself (`/proc/self/uid_map` is `0 0 4294967295`); a namespace of a container maps a range.
fn in_initial_user_namespace() -> bool {
    std::fs::read_to_string("/proc/self/uid_map")
        .is_ok_and(|m| m.split_whitespace().collect::<Vec<_>>() == ["0", "0", "4294967295"])
}

/// `prctl(option, arg2, 0, 0, 0)`.
fn prctl(option: libc::c_int, arg2: libc::c_ulong) -> io::Result<libc::c_int> {
    // SAFETY: the options used here take integer arguments only and touch no memory of ours.
    let r = unsafe { libc::prctl(option, arg2, 0 as libc::c_ulong, 0 as libc::c_ulong, 0) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r)
}

/// Access the exit path needs to a path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Look names up in a directory (unmount, stat the mountpoint).
    Search,
    /// Create, rename and remove entries of a directory.
    Modify,
    /// Read a file (the pid file, to see it is still ours).
    Read,
    /// Rewrite a file (the stats file).
    Write,
}

impl Access {
    fn mode(self) -> libc::c_int {
        match self {
            Access::Search => libc::X_OK,
            Access::Modify => libc::W_OK | libc::X_OK,
            Access::Read => libc::R_OK,
            Access::Write => libc::W_OK,
        }
    }
}

/// What the rest of the daemon's life does that may need privileges.
#[derive(Debug, Default)]
pub struct Needs {
    /// Paths the exit path (and `SIGUSR1` dumps) act on, with the access each needs.
    pub paths: Vec<(PathBuf, Access)>,
    /// Set when SETATTR may set times on an image whose owner is not fusex's effective uid: the
    /// owner's uid.
    pub foreign_image_owner: Option<u32>,
    /// The mount came from `fusermount3` and goes through `fusermount3 -u`: a set-uid program,
    /// which `PR_SET_NO_NEW_PRIVS` would run without its privilege. So no_new_privs stays off.
    pub exits_through_setuid_helper: bool,
}

impl Needs {
    /// The directory holding `path` (`.` for a bare name).
    pub fn parent(path: &Path) -> PathBuf {
        match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        }
    }
}

/// Which capabilities every thread keeps, decided once on the main thread before any thread that
/// will apply it starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// None: fusex holds no capabilities, there is nothing to drop.
    keep: Option<u64>,
    /// Whether to set `PR_SET_NO_NEW_PRIVS` (not when the exit runs `fusermount3 -u`).
    no_new_privs: bool,
}

impl Plan {
    /// Decides what to keep from what the calling (main) thread holds and what `needs` asks for.
    pub fn decide(needs: &Needs) -> Plan {
        let cur = match caps::get() {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!("privileges: cannot read capabilities ({e}); nothing dropped");
                return Plan::none();
            }
        };
        if cur.permitted == 0 {
            tracing::debug!("privileges: fusex holds no capabilities; nothing to drop");
            return Plan::none();
        }
        let mut keep = bit(CAP_SYS_ADMIN);
        if let Some(uid) = needs.foreign_image_owner {
            tracing::debug!(
                "privileges: keeping CAP_FOWNER: the image belongs to uid {uid}, and setting its \
                 times (SETATTR) needs that"
            );
            keep |= bit(CAP_FOWNER);
        }
        if needs_dac_override(&needs.paths, cur) {
            keep |= bit(CAP_DAC_OVERRIDE);
        }
        Plan {
            keep: Some(keep & cur.permitted),
            no_new_privs: !needs.exits_through_setuid_helper,
        }
    }

    /// What a directory export keeps: besides `CAP_SYS_ADMIN` (the unmount at exit, `trusted.*`
    /// attributes the kernel allowed the caller), what acting on files for their callers takes
    /// once the kernel checked the caller's permission (`default_permissions`): `CAP_CHOWN` (new
    /// entries given to their creator), `CAP_DAC_OVERRIDE` and `CAP_DAC_READ_SEARCH` (files the
    /// daemon's own uid could not open or search; opening the file handles that hold nodes
    /// beyond the descriptor budget), `CAP_FOWNER` (modes, times and attributes of
    /// files it does not own) and `CAP_FSETID` (set-id bits kept on others' files). Everything
    /// else goes (`CAP_SETUID`, `CAP_MKNOD`, `CAP_SYS_PTRACE`, network, ...).
    pub fn directory(exits_through_setuid_helper: bool) -> Plan {
        let cur = match caps::get() {
            Ok(c) if c.permitted != 0 => c,
            _ => return Plan::none(),
        };
        let keep = [
            CAP_SYS_ADMIN,
            CAP_CHOWN,
            CAP_DAC_OVERRIDE,
            CAP_DAC_READ_SEARCH,
            CAP_FOWNER,
            CAP_FSETID,
        ]
        .iter()
        .fold(0, |k, &c| k | bit(c));
        Plan {
            keep: Some(keep & cur.permitted),
            no_new_privs: !exits_through_setuid_helper,
        }
    }

    /// A plan that keeps no capability at all, for a helper thread that needs none (it acts
    /// only on files of its own uid) and must not hold, even for a moment, what the daemon's
    /// other threads are about to drop.
    pub fn nothing() -> Plan {
        Plan {
            keep: Some(0),
            no_new_privs: true,
        }
    }

    /// A plan that drops nothing.
    pub fn none() -> Plan {
        Plan {
            keep: None,
            no_new_privs: false,
        }
    }

    /// The kept capabilities by name, e.g. `CAP_SYS_ADMIN, CAP_FOWNER`; None when nothing is
    /// dropped at all.
    pub fn kept(&self) -> Option<String> {
        let keep = self.keep?;
        let names: Vec<&str> = NAMES
            .iter()
            .filter(|(c, _)| keep & bit(*c) != 0)
            .map(|(_, n)| *n)
            .collect();
        Some(if names.is_empty() {
            "none".to_string()
        } else {
            names.join(", ")
        })
    }

    /// Drops, in the calling thread, every capability the plan does not keep from the effective,
    /// permitted, inheritable, ambient and bounding sets, and sets `PR_SET_NO_NEW_PRIVS` (so an
    /// `execve` can never gain any back, not even root's). A plan with nothing to drop does
    /// nothing.
    pub fn apply(&self) -> io::Result<()> {
        let Some(keep) = self.keep else {
            return Ok(());
        };
        if self.no_new_privs {
            prctl(libc::PR_SET_NO_NEW_PRIVS, 1)?;
        }
        let cur = caps::get()?;
        // Dropping from the bounding set needs CAP_SETPCAP in effect, so it goes first.
        if cur.effective & bit(CAP_SETPCAP) != 0 {
            for cap in 0..64 {
                // EINVAL past the kernel's last capability.
                let Ok(present) = prctl(libc::PR_CAPBSET_READ, cap) else {
                    break;
                };
                if present == 1 && keep & bit(cap as Cap) == 0 {
                    prctl(libc::PR_CAPBSET_DROP, cap)?;
                }
            }
        } else {
            tracing::debug!("privileges: no CAP_SETPCAP, the bounding set stays as it is");
        }
        // Ambient capabilities would otherwise survive an execve; EINVAL before Linux 4.3.
        if let Err(e) = prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
        ) {
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(e);
            }
        }
        let want = Sets {
            effective: keep & cur.permitted,
            permitted: keep & cur.permitted,
            inheritable: 0,
        };
        caps::set(want)?;
        let now = caps::get()?;
        if now != want {
            return Err(io::Error::other(format!(
                "capabilities are {now:x?} after setting {want:x?}"
            )));
        }
        Ok(())
    }
}

/// Whether any exit-path access fails without the DAC capabilities (EACCES from
/// `faccessat2(AT_EACCESS)` in a scratch thread whose effective set lacks them). Other errors
/// (a path that is missing, on a read-only filesystem) would not go away with the capability.
fn needs_dac_override(paths: &[(PathBuf, Access)], cur: Sets) -> bool {
    if paths.is_empty() {
        return false;
    }
    let dac = bit(CAP_DAC_OVERRIDE) | bit(CAP_DAC_READ_SEARCH) | bit(CAP_FOWNER);
    let probe = || -> io::Result<Option<String>> {
        // Only this thread's effective set: the thread ends right after, nobody else is affected.
        caps::set(Sets {
            effective: cur.effective & !dac,
            ..cur
        })?;
        for (path, access) in paths {
            if let Err(e) = eaccess(path, access.mode()) {
                if e.raw_os_error() == Some(libc::EACCES) {
                    return Ok(Some(format!("{access:?} {}: {e}", path.display())));
                }
            }
        }
        Ok(None)
    };
    let outcome = std::thread::scope(|s| {
        std::thread::Builder::new()
            .name("fusex-probe".into())
            .spawn_scoped(s, probe)
            .map(|t| t.join())
    });
    match outcome {
        Ok(Ok(Ok(None))) => false,
        Ok(Ok(Ok(Some(why)))) => {
            tracing::debug!("privileges: keeping CAP_DAC_OVERRIDE for the exit path: {why}");
            true
        }
        Ok(Ok(Err(e))) => {
            tracing::debug!(
                "privileges: cannot probe the exit path ({e}); keeping CAP_DAC_OVERRIDE"
            );
            true
        }
        Ok(Err(_)) | Err(_) => {
            tracing::debug!("privileges: the exit-path probe failed; keeping CAP_DAC_OVERRIDE");
            true
        }
    }
}

/// `faccessat2(AT_FDCWD, path, mode, AT_EACCESS)`: the check with the calling thread's effective
/// credentials. Called directly: glibc emulates `AT_EACCESS` from mode bits when the syscall is
/// missing, and that emulation takes uid 0 for all-powerful.
fn eaccess(path: &Path, mode: libc::c_int) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `c` is a NUL-terminated path living across the call; faccessat2 only reads it.
    let r = unsafe {
        libc::syscall(
            libc::SYS_faccessat2,
            libc::AT_FDCWD,
            c.as_ptr(),
            mode,
            libc::AT_EACCESS,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn is_root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    /// `apply` on a scratch thread: only that thread loses its capabilities, the test's own
    /// threads keep theirs.
    #[test]
    fn apply_drops_in_the_calling_thread_only() {
        let before = caps::get().unwrap();
        if before.permitted & bit(CAP_SYS_ADMIN) == 0 || before.effective & bit(CAP_SETPCAP) == 0 {
            eprintln!("SKIP: needs CAP_SYS_ADMIN and CAP_SETPCAP");
            return;
        }
        let plan = Plan {
            keep: Some(bit(CAP_SYS_ADMIN)),
            no_new_privs: true,
        };
        let (sets, nnp, bounding) = std::thread::spawn(move || {
            plan.apply().unwrap();
            let nnp = prctl(libc::PR_GET_NO_NEW_PRIVS, 0).unwrap();
            let bounding: Vec<Cap> = (0..64)
                .map_while(|c| prctl(libc::PR_CAPBSET_READ, c).ok().map(|r| (c, r)))
                .filter(|(_, r)| *r == 1)
                .map(|(c, _)| c as Cap)
                .collect();
            (caps::get().unwrap(), nnp, bounding)
        })
        .join()
        .unwrap();
        assert_eq!(
            sets,
            Sets {
                effective: bit(CAP_SYS_ADMIN),
                permitted: bit(CAP_SYS_ADMIN),
                inheritable: 0
            }
        );
        assert_eq!(nnp, 1);
        assert_eq!(bounding, vec![CAP_SYS_ADMIN]);
        assert_eq!(
            caps::get().unwrap(),
            before,
            "another thread's drop reached this one"
        );
        assert_eq!(plan.kept().unwrap(), "CAP_SYS_ADMIN");
    }

    /// `Plan::nothing` (the runtime directory's sweep thread) leaves its thread no capability
    /// in any set, bounding included when it may drop from it, and no way to gain one back.
    #[test]
    fn backing_files_need_cap_sys_admin_in_the_initial_namespace() {
        let admin = caps::get().unwrap().effective & bit(CAP_SYS_ADMIN) != 0;
        let initial = in_initial_user_namespace();
        assert_eq!(may_register_backing_files(), admin && initial);
        // This thread without CAP_SYS_ADMIN in its effective set: never.
        let t = std::thread::spawn(|| {
            let mut s = caps::get().unwrap();
            s.effective &= !bit(CAP_SYS_ADMIN);
            caps::set(s).unwrap();
            may_register_backing_files()
        });
        assert!(!t.join().unwrap());
    }

    #[test]
    fn nothing_leaves_no_capability() {
        let before = caps::get().unwrap();
        let (sets, nnp, bounding) = std::thread::spawn(|| {
            Plan::nothing().apply().unwrap();
            let nnp = prctl(libc::PR_GET_NO_NEW_PRIVS, 0).unwrap();
            let bounding = (0..64)
                .map_while(|c| prctl(libc::PR_CAPBSET_READ, c).ok())
                .filter(|r| *r == 1)
                .count();
            (caps::get().unwrap(), nnp, bounding)
        })
        .join()
        .unwrap();
        assert_eq!(sets, Sets::default());
        assert_eq!(nnp, 1);
        if before.effective & bit(CAP_SETPCAP) != 0 {
            assert_eq!(bounding, 0, "capabilities left in the bounding set");
        }
        assert_eq!(Plan::nothing().kept().unwrap(), "none");
    }

    /// A thread without capabilities (as a process not run by root) decides to drop nothing.
    #[test]
    fn without_capabilities_nothing_is_dropped() {
        let plan = std::thread::spawn(|| {
            caps::set(Sets::default()).unwrap();
            Plan::decide(&Needs {
                paths: vec![(PathBuf::from("/"), Access::Search)],
                foreign_image_owner: Some(65534),
                exits_through_setuid_helper: false,
            })
        })
        .join()
        .unwrap();
        assert_eq!(plan, Plan::none());
    }

    #[test]
    fn nothing_to_drop_does_nothing() {
        let before = caps::get().unwrap();
        std::thread::spawn(|| {
            Plan::none().apply().unwrap();
            assert_eq!(prctl(libc::PR_GET_NO_NEW_PRIVS, 0).unwrap(), 0);
        })
        .join()
        .unwrap();
        assert_eq!(caps::get().unwrap(), before);
        assert_eq!(Plan::none().kept(), None);
    }

    /// The probe keeps CAP_DAC_OVERRIDE exactly when root without it could not modify a
    /// directory: one owned by another user, not one of its own.
    #[test]
    fn dac_override_only_for_foreign_directories() {
        let cur = caps::get().unwrap();
        if !is_root() || cur.effective & bit(CAP_DAC_OVERRIDE) == 0 {
            eprintln!("SKIP: needs root with CAP_DAC_OVERRIDE");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let own = dir.path().join("own");
        let foreign = dir.path().join("foreign");
        std::fs::create_dir(&own).unwrap();
        std::fs::create_dir(&foreign).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&foreign, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::chown(&foreign, Some(65534), Some(65534)).unwrap();
        assert!(!needs_dac_override(&[(own.clone(), Access::Modify)], cur));
        assert!(!needs_dac_override(
            &[(foreign.clone(), Access::Search)],
            cur
        ));
        assert!(needs_dac_override(
            &[(own, Access::Modify), (foreign.clone(), Access::Modify)],
            cur
        ));
        // A missing path is not a reason to keep anything.
        assert!(!needs_dac_override(
            &[(foreign.join("missing"), Access::Read)],
            cur
        ));
        assert_eq!(caps::get().unwrap(), cur, "the probe changed this thread");
    }
}
