//! CPU priority of `fusex serve`'s control plane against its data plane.
//!
//! Adding and removing an export (QMP commands, the mount and unmount, the final flush) costs
//! the daemon about a millisecond of CPU each, most of it in the kernel. On a machine whose CPUs
//! the applications and the queue threads keep busy, that CPU is taken from the busy exports'
//! I/O (`bench/serve_scale.py --busy`). So the threads that do control work (the QMP server and
//! its clients, the exports' supervisor and what it starts, the reaper) run [`CONTROL_NICE`] nice
//! levels below the queue threads (`fusex serve --control-nice`): when the CPUs are contended
//! the scheduler gives the data plane the larger share, and when they are not nothing changes.
//!
//! Nice values are per thread on Linux and a new thread starts with its creator's. Control
//! threads lower themselves at their start ([`lower_this_thread`]), so whatever they spawn is
//! lowered too; a queue thread may be started by a control thread (an export's first queue
//! starts the shared queue threads), so each queue thread sets itself back to the daemon's
//! priority ([`to_base`]). Going back up needs `CAP_SYS_NICE` (or an `RLIMIT_NICE` that allows
//! it): a daemon that cannot do that leaves every thread where it is ([`control_may_yield`]).

use std::io;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::OnceLock;

/// Nice levels the control threads run below the data plane. At 10 a control thread competing
/// with a queue thread for a CPU gets about a tenth of it: enough for dozens of adds and
/// removals a second under full load, while the data plane keeps the rest.
pub const CONTROL_NICE: i32 = 10;

/// The daemon's own nice value, read once by [`settle_base`] before any thread is lowered.
static BASE: OnceLock<i32> = OnceLock::new();

/// How far [`lower_this_thread`] lowers: [`CONTROL_NICE`] unless `--control-nice` said otherwise.
static STEP: AtomicI32 = AtomicI32::new(CONTROL_NICE);

/// Sets how many nice levels below the queue threads the control threads run (`--control-nice`;
/// 0: at the same priority). Called before the control threads start.
pub fn configure(step: i32) {
    STEP.store(step.clamp(0, 39), Ordering::Relaxed);
}

/// The calling thread's nice value.
pub fn this_thread_nice() -> io::Result<i32> {
    // getpriority may return -1 as a value: errno, cleared first, tells.
    // SAFETY: __errno_location points at the calling thread's errno, valid for its lifetime.
    unsafe { *libc::__errno_location() = 0 };
    // SAFETY: getpriority takes no pointers; who = 0 is the calling thread (nice values are per
    // thread on Linux).
    let v = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
    let err = io::Error::last_os_error();
    if v == -1 && err.raw_os_error() != Some(0) {
        return Err(err);
    }
    Ok(v)
}

/// Sets the calling thread's nice value (not the other threads': `who` 0 is the caller).
fn set_this_thread_nice(v: i32) -> io::Result<()> {
    // SAFETY: setpriority takes no pointers and changes only the calling thread.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, v) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Records the calling thread's nice value as the daemon's (the data plane's). Called by the
/// main thread before it starts any other; later calls change nothing.
pub fn settle_base() -> i32 {
    *BASE.get_or_init(|| this_thread_nice().unwrap_or(0))
}

/// Whether a thread of this daemon may go back from the control priority to the base one:
/// `CAP_SYS_NICE` in effect, or `RLIMIT_NICE` reaching the base value (a limit of `r` allows
/// nice values down to `20 - r`).
pub fn control_may_yield() -> bool {
    let base = settle_base();
    let cap = caps::get().is_ok_and(|s| s.effective & caps::bit(caps::CAP_SYS_NICE) != 0);
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct, valid for the call.
    let limit_ok = unsafe { libc::getrlimit(libc::RLIMIT_NICE, &mut lim) } == 0
        && i64::try_from(lim.rlim_cur).map_or(true, |r| 20 - r <= i64::from(base));
    cap || limit_ok
}

/// Lowers the calling thread, and so every thread it starts from now on, to the control
/// priority (see [`configure`]).
pub fn lower_this_thread() {
    lower_by(STEP.load(Ordering::Relaxed));
}

/// Lowers the calling thread `step` levels below the base (to at most 19). Does nothing when
/// `step` is 0 or the daemon could not bring its queue threads back up ([`control_may_yield`]).
fn lower_by(step: i32) {
    if step <= 0 || !control_may_yield() {
        return;
    }
    let to = (settle_base() + step).min(19);
    if let Err(e) = set_this_thread_nice(to) {
        tracing::debug!("priority: this control thread stays at its priority: {e}");
    }
}

/// Sets the calling thread (a queue thread) to the daemon's base priority, whichever thread
/// started it. A failure leaves it where it is and is logged once.
pub fn to_base() {
    let base = settle_base();
    match this_thread_nice() {
        Ok(v) if v == base => {}
        _ => {
            if let Err(e) = set_this_thread_nice(base) {
                static ONCE: std::sync::Once = std::sync::Once::new();
                ONCE.call_once(|| {
                    tracing::warn!(
                        "priority: a queue thread could not go back to the daemon's priority \
                         ({base}): {e}; it runs at its creator's"
                    )
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lowered thread is `step` below the base, a thread it starts inherits that, and
    /// `to_base` brings a thread back when the process may.
    #[test]
    fn control_threads_are_lowered_and_queue_threads_come_back() {
        let base = settle_base();
        let may = control_may_yield();
        let (lowered, child, restored) = std::thread::spawn(move || {
            lower_by(3);
            let lowered = this_thread_nice().unwrap();
            let (child, restored) = std::thread::spawn(|| {
                let child = this_thread_nice().unwrap();
                to_base();
                (child, this_thread_nice().unwrap())
            })
            .join()
            .unwrap();
            (lowered, child, restored)
        })
        .join()
        .unwrap();
        if may {
            assert_eq!(lowered, (base + 3).min(19));
            assert_eq!(
                child, lowered,
                "a new thread starts at its creator's priority"
            );
            assert_eq!(restored, base, "a queue thread goes back to the base");
        } else {
            assert_eq!(
                lowered, base,
                "not lowered when the queue threads could not come back"
            );
        }
        assert_eq!(this_thread_nice().unwrap(), base, "other threads untouched");
    }

    #[test]
    fn no_step_changes_nothing() {
        let before = std::thread::spawn(|| {
            let before = this_thread_nice().unwrap();
            lower_by(0);
            (before, this_thread_nice().unwrap())
        })
        .join()
        .unwrap();
        assert_eq!(before.0, before.1);
    }
}
