//! The umask the ring's creations are made with.
//!
//! `mkdirat`, `symlinkat`, and `openat` with `O_CREAT` or `O_TMPFILE` apply the umask of the
//! filesystem context (`struct fs_struct`) of the task that runs them. An io-wq worker, where
//! io_uring runs every `mkdirat` and many opens, is a thread of the ring's thread created with
//! `CLONE_FS`: it shares that thread's context, and reads its umask when the operation runs, not
//! when it was submitted. So a creation made for someone else (a FUSE caller's umask) on the
//! ring needs that umask to be its thread's from submission to completion, and no other
//! creation with another umask in flight meanwhile.
//!
//! Every engine's thread therefore gets a filesystem context of its own before its first ring
//! exists (`own_context`, from [`crate::Engine::new`]): the umask it sets is seen by it and its
//! io-wq workers only, never by the rest of the process. [`hold`] then makes a umask the
//! thread's while its holders' creations run: creations with the same umask run together, one
//! with another umask waits until they are done (on the ring: the thread serves the rest
//! meanwhile).

use std::cell::Cell;
use std::marker::PhantomData;
use std::time::Duration;

use crate::Engine;

/// How long a creation waiting for another umask sleeps between looks.
const RECHECK: Duration = Duration::from_micros(50);

thread_local! {
    /// This thread's umask, once the thread has a filesystem context of its own.
    static OWN: Cell<Option<u32>> = const { Cell::new(None) };
    /// Holders of the current umask ([`UmaskHold`]s alive on this thread).
    static HOLDERS: Cell<u32> = const { Cell::new(0) };
}

/// Gives the calling thread a filesystem context (root, working directory, umask) of its own,
/// unless it has one already: `unshare(CLONE_FS)`, which copies the process's. Must run before
/// the thread's first ring, so that every io-wq worker of the thread shares the new context.
pub(crate) fn own_context() -> std::io::Result<()> {
    if OWN.with(Cell::get).is_some() {
        return Ok(());
    }
    // SAFETY: unshare takes no pointers; CLONE_FS alone is allowed in a multithreaded process
    // and only gives this thread a copy of its root, working directory and umask.
    if unsafe { libc::unshare(libc::CLONE_FS) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: umask cannot fail; the value read is put back at once.
    let own = unsafe {
        let m = libc::umask(0);
        libc::umask(m);
        m
    };
    OWN.with(|o| o.set(Some(own)));
    Ok(())
}

/// Waits until `umask` (permission bits) is the calling thread's umask and holds it there until
/// the returned hold is dropped: creations made meanwhile on this thread, on its engine's ring
/// or directly, apply `umask`. Awaited in a task of an engine of this thread, whose thread has
/// its own context already; an error only if a thread without one cannot get one.
pub async fn hold(eng: &Engine, umask: u32) -> std::io::Result<UmaskHold> {
    let umask = umask & 0o777;
    own_context()?;
    loop {
        let current = OWN.with(Cell::get);
        if current == Some(umask) {
            break;
        }
        if HOLDERS.with(Cell::get) == 0 {
            // SAFETY: umask cannot fail; this thread's umask is its own (`own_context`).
            unsafe { libc::umask(umask) };
            OWN.with(|o| o.set(Some(umask)));
            break;
        }
        eng.sleep(RECHECK).await;
    }
    HOLDERS.with(|h| h.set(h.get() + 1));
    Ok(UmaskHold {
        _thread: PhantomData,
    })
}

/// A held umask (see [`hold`]); dropping it lets a creation with another umask go.
#[must_use = "the umask is held only while the hold lives"]
#[derive(Debug)]
pub struct UmaskHold {
    /// Bound to the thread whose umask it holds.
    _thread: PhantomData<*const ()>,
}

impl Drop for UmaskHold {
    fn drop(&mut self) {
        HOLDERS.with(|h| h.set(h.get().saturating_sub(1)));
    }
}
