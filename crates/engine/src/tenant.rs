//! What an engine serving many tenants (exports that come and go while it runs) needs: buffer
//! pools added and removed ([`Engine::add_pool`], [`Engine::remove_pool`]), the fixed-buffer table
//! and provided-buffer groups they use, and registered files added and removed
//! ([`Engine::register_files`], [`Engine::unregister_files`]).
//!
//! Everything here runs when a tenant arrives, leaves, or uses a buffer for the first time; the
//! per-operation checks ([`Engine::fixed`], [`Engine::target`]) are a few loads.

use std::cell::RefCell;
use std::io;
use std::os::fd::RawFd;
use std::rc::Rc;
use std::sync::Arc;

use crate::buf::{Buf, Pool};
use crate::executor::{Engine, PoolWatch};
use crate::multishot::{BufGroup, PbufRing};
use crate::EngineError;

/// A tenant's pool of buffers on one engine (see [`Engine::add_pool`]): the memory its requests
/// use, its buffers' fixed-buffer slots, and its own provided-buffer group.
///
/// Give it back with [`Engine::remove_pool`]. Dropping it does the same on the engine's next
/// loop turn (or pool call). Either way the memory itself is freed when the last [`Buf`] of the
/// pool drops: buffers still in use, in flight or on another thread keep it.
pub struct BufPool {
    pool: Arc<Pool>,
    /// The engine's queue of pools to reclaim.
    returns: Rc<RefCell<Vec<Arc<Pool>>>>,
}

impl BufPool {
    /// Takes a free buffer (lowest index first), `None` if all are in use. It returns to the pool
    /// when dropped.
    pub fn take(&self) -> Option<Buf> {
        self.pool.take()
    }

    /// Buffers not in use.
    pub fn available(&self) -> usize {
        self.pool.available()
    }

    /// Buffers in the pool.
    pub fn len(&self) -> usize {
        self.pool.len()
    }

    /// Whether the pool has no buffers.
    pub fn is_empty(&self) -> bool {
        self.pool.len() == 0
    }

    /// The pool's provided-buffer group (asked for with `provided` in [`Engine::add_pool`]): what
    /// [`Engine::read_multishot`] names to read into this pool's buffers lent with
    /// [`Engine::provide`].
    pub fn group(&self) -> Option<BufGroup> {
        self.pool.group().map(BufGroup)
    }

    /// A handle that says whether the pool's memory is still allocated, for tests.
    #[doc(hidden)]
    pub fn watch(&self) -> PoolWatch {
        PoolWatch::of(&self.pool)
    }
}

impl Drop for BufPool {
    fn drop(&mut self) {
        // Queued, not reclaimed here: that needs the ring, and a pool may drop anywhere.
        self.returns.borrow_mut().push(self.pool.clone());
    }
}

impl std::fmt::Debug for BufPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufPool")
            .field("len", &self.len())
            .field("available", &self.available())
            .field("group", &self.group())
            .finish()
    }
}

impl Engine {
    /// Adds a pool of `count` buffers of `size` bytes (rounded up to a page) for a tenant: the
    /// same lazily resident buffers as the default pool's. When the engine has a fixed-buffer
    /// table, each buffer takes a slot of it at its first fixed operation. With `provided`, the
    /// pool gets a provided-buffer ring of its own ([`BufPool::group`]); an error if the kernel
    /// refuses one (the caller may go on without multishot reads).
    pub fn add_pool(
        &self,
        count: usize,
        size: usize,
        provided: bool,
    ) -> Result<BufPool, EngineError> {
        self.reclaim_returned();
        let pool = Pool::new(count, size, self.id).ok_or(EngineError::Alloc { count, size })?;
        if self.buf_slots.borrow().size() > 0 && pool.len() > 0 {
            pool.set_registered();
        }
        if provided {
            // The pool drops here on failure: nothing of it was registered yet.
            self.add_group(&pool).map_err(EngineError::Register)?;
        }
        Ok(BufPool {
            pool,
            returns: self.returns.clone(),
        })
    }

    /// Removes a tenant's pool: its buffers' fixed-buffer slots are cleared and free for other
    /// pools, its provided-buffer group is unregistered and its id reused. Buffers of the pool
    /// still in use keep working, by address.
    ///
    /// Safe while operations of the pool are in flight: an operation submitted with a fixed
    /// buffer holds the kernel's registration of it until its completion (and the op table holds
    /// the `Buf`), and entries not yet submitted are submitted before a slot is cleared. The
    /// provided-buffer group stays registered, and keeps the windows it lent, until every
    /// multishot read of it posted its final completion; end them (drop their [`crate::MultiOp`])
    /// for the group to go. The pool's [`BufGroup`] must not be named after this: its id goes to
    /// the next pool that asks for a group.
    pub fn remove_pool(&self, pool: BufPool) {
        drop(pool);
        self.reclaim_returned();
    }

    /// Provided-buffer groups registered now (including those being removed, which wait for
    /// their multishot reads to end).
    pub fn provided_groups(&self) -> usize {
        self.provided.len()
    }

    /// Slots of the fixed-buffer table free now (0 without a table).
    pub fn free_buffer_slots(&self) -> usize {
        self.buf_slots.borrow().free()
    }

    /// Registers a provided-buffer ring lending `pool`'s buffers under a new group id.
    pub(crate) fn add_group(&self, pool: &Pool) -> io::Result<()> {
        let n = u16::try_from(pool.len())
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        let id = self
            .provided
            .reserve()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOSPC))?;
        let Some(r) = PbufRing::new(n, id) else {
            self.provided.release(id);
            return Err(io::Error::from_raw_os_error(libc::ENOMEM));
        };
        let Some(ring) = self.ring() else {
            self.provided.release(id);
            return Err(io::Error::from_raw_os_error(libc::EBUSY));
        };
        // SAFETY: the ring memory is owned by the engine's provided table, which keeps it until
        // the group is unregistered (`finish_group_removals`) or the ring is gone (it is dropped
        // after the ring, or leaked with the engine).
        let res = unsafe {
            ring.submitter()
                .register_buf_ring_with_flags(r.addr(), r.entries(), id, 0)
        };
        drop(ring);
        match res {
            Ok(()) => {
                self.provided.insert(r, pool.len());
                pool.set_group(id);
                Ok(())
            }
            Err(e) => {
                self.provided.release(id);
                Err(e)
            }
        }
    }

    /// Lends `win` to the kernel under buffer id `win.buf().index()` in the provided-buffer group
    /// of the pool it belongs to (this engine's default pool or a [`BufPool`]), for multishot
    /// reads; it comes back in the [`crate::Completion`] that names it. Visible to the kernel
    /// after [`Engine::publish_buffers`]. Gives the window back if its pool has no group on this
    /// engine (or is being removed) or that buffer id is already lent.
    pub fn provide(&self, win: crate::Slice) -> Result<(), crate::Slice> {
        let pool = win.buf().pool();
        match pool.group() {
            Some(g) if pool.owner() == self.id => self.provided.lend(g, win),
            _ => Err(win),
        }
    }

    /// Makes provided buffers visible to the kernel: one store per group lent into since the
    /// last call (a batch of windows costs one).
    pub fn publish_buffers(&self) {
        self.provided.publish();
    }

    /// Buffer `buf`'s slot in this ring's fixed-buffer table, entering it now if this is its
    /// first fixed use: `None` (go by address) if the buffer is another engine's (buffers travel
    /// between threads), its pool was removed, the table is full, or registering failed.
    /// O(1) and lock-free: two relaxed loads once the buffer has its slot.
    #[inline]
    pub(crate) fn fixed(&self, buf: &Buf) -> Option<u16> {
        let pool = buf.pool();
        if pool.owner() != self.id {
            return None;
        }
        pool.slot(buf.index())
            .or_else(|| self.register_buffer(pool, buf.index()))
    }

    #[cold]
    fn register_buffer(&self, pool: &Pool, index: u16) -> Option<u16> {
        if !pool.registered() {
            return None;
        }
        let iov = pool.iovec(index)?;
        let slot = self.buf_slots.borrow_mut().take()?;
        let r = match self.ring() {
            // SAFETY: the iovec describes a live mapping of `pool`. The kernel pins its pages and
            // reaches them only for fixed operations naming this slot, and the engine issues
            // those only with a `Buf` of this pool, which the op table holds until their
            // completions. The slot is cleared before the pool's memory can be freed: the pool is
            // reclaimed (slot cleared) before the engine drops its last reference from its
            // returns queue, and the default pool is dropped after the ring.
            Some(ring) => unsafe { ring.submitter().register_buffers_update(slot, &[iov], None) },
            None => Err(io::Error::from_raw_os_error(libc::EBUSY)),
        };
        match r {
            Ok(()) => {
                let slot16 = slot as u16; // slots < MAX_BUFFER_TABLE
                pool.set_slot(index, slot16);
                Some(slot16)
            }
            Err(e) => {
                tracing::debug!("fixed buffers unavailable for a pool ({e}); it goes by address");
                self.buf_slots.borrow_mut().give(slot);
                pool.clear_registered();
                None
            }
        }
    }

    /// Reclaims what the engine holds for pools whose [`BufPool`] is gone: their fixed-buffer
    /// slots are cleared (after every queued entry was submitted, see
    /// [`Engine::flush_submissions`]) and freed, their provided-buffer groups removed (at once,
    /// or once their multishot reads ended).
    pub(crate) fn reclaim_returned(&self) {
        if self.returns.borrow().is_empty() || self.ring().is_none() {
            return;
        }
        let pools = std::mem::take(&mut *self.returns.borrow_mut());
        let mut slots = Vec::new();
        for pool in &pools {
            if pool.owner() != self.id {
                continue;
            }
            let (s, group) = pool.disown();
            slots.extend(s);
            if let Some(g) = group {
                self.provided.begin_remove(g);
            }
        }
        if !slots.is_empty() {
            let flushed = self.flush_submissions();
            let empty = libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            };
            for slot in slots {
                let r = match self.ring() {
                    // SAFETY: an empty iovec names no memory: the update only empties the slot.
                    // Operations in flight that use it keep the registration they looked up.
                    Some(ring) => unsafe {
                        ring.submitter()
                            .register_buffers_update(slot, &[empty], None)
                    },
                    None => Err(io::Error::from_raw_os_error(libc::EBUSY)),
                };
                match r {
                    Ok(()) if flushed => self.buf_slots.borrow_mut().give(slot),
                    // An entry may still name the slot: never hand it to another pool.
                    Ok(()) => tracing::warn!("fixed-buffer slot {slot} retired: entries unsent"),
                    Err(e) => tracing::warn!("fixed-buffer slot {slot} not cleared ({e})"),
                }
            }
        }
        if self.provided.removals_due() {
            self.finish_group_removals();
        }
        // Their memory is freed here unless a `Buf` still holds it.
        drop(pools);
    }

    /// Unregisters the provided-buffer groups being removed whose multishot reads all ended, then
    /// drops their windows (back to their pools) and ring memory, and frees their ids.
    pub(crate) fn finish_group_removals(&self) {
        for g in self.provided.take_removed() {
            let id = g.id();
            let r = match self.ring() {
                Some(ring) => ring.submitter().unregister_buf_ring(id),
                None => Err(io::Error::from_raw_os_error(libc::EBUSY)),
            };
            match r {
                Ok(()) => {
                    drop(g);
                    self.provided.release(id);
                }
                Err(e) => {
                    // The kernel may still know the ring and the windows it lists: keep both for
                    // good rather than free memory it could write.
                    tracing::error!(
                        "cannot unregister provided-buffer group {id} ({e}); leaking it"
                    );
                    std::mem::forget(g);
                }
            }
        }
    }

    /// Registers `fds` as fixed files of the ring, for as long as the caller needs them (a
    /// tenant arriving): from then on every operation on one of them names it by its slot, which
    /// spares the kernel a file table lookup and reference count per operation. Callable any
    /// number of times; a descriptor registered twice (two tenants) is counted and keeps its
    /// slot until both [`Engine::unregister_files`] it. A descriptor that finds the table full
    /// goes by number. The caller keeps each descriptor open until it unregisters it.
    ///
    /// Errors (a descriptor the kernel refuses, no file table) undo this call's registrations.
    pub fn register_files(&self, fds: &[RawFd]) -> io::Result<()> {
        if fds.iter().any(|fd| *fd < 0) {
            return Err(io::Error::from_raw_os_error(libc::EBADF));
        }
        if !self.files.borrow().created() {
            let size = match self.file_table {
                0 => {
                    let mut distinct = fds.to_vec();
                    distinct.sort_unstable();
                    distinct.dedup();
                    u32::try_from(distinct.len()).unwrap_or(u32::MAX)
                }
                n => n,
            };
            if size == 0 {
                return Ok(());
            }
            let ring = self
                .ring()
                .ok_or_else(|| io::Error::from_raw_os_error(libc::EBUSY))?;
            ring.submitter().register_files_sparse(size)?;
            drop(ring);
            self.files.borrow_mut().create(size);
        }
        for (i, &fd) in fds.iter().enumerate() {
            if let Err(e) = self.register_file(fd) {
                self.unregister_files(&fds[..i]);
                return Err(e);
            }
        }
        Ok(())
    }

    fn register_file(&self, fd: RawFd) -> io::Result<()> {
        let mut files = self.files.borrow_mut();
        if !files.add_ref(fd) {
            return Ok(());
        }
        let Some(slot) = files.take() else {
            return Ok(());
        };
        let r = match self.ring() {
            Some(ring) => ring.submitter().register_files_update(slot, &[fd]),
            None => Err(io::Error::from_raw_os_error(libc::EBUSY)),
        };
        match r {
            Ok(1) => {
                files.set(fd, slot);
                Ok(())
            }
            other => {
                files.give(slot);
                files.drop_ref(fd);
                Err(other
                    .err()
                    .unwrap_or_else(|| io::Error::from_raw_os_error(libc::EIO)))
            }
        }
    }

    /// Undoes one [`Engine::register_files`] of each of `fds` (a tenant leaving). A descriptor
    /// whose last registration this was leaves the table (its slot is emptied and reused), after
    /// every queued entry was submitted: an entry already submitted holds the file until its
    /// completion, and none still queued can reach the slot's next file. Operations on it go by
    /// number from now on. Descriptors not registered are ignored.
    pub fn unregister_files(&self, fds: &[RawFd]) {
        let slots: Vec<u32> = {
            let mut files = self.files.borrow_mut();
            fds.iter().filter_map(|fd| files.drop_ref(*fd)).collect()
        };
        if slots.is_empty() {
            return;
        }
        let flushed = self.flush_submissions();
        for slot in slots {
            let r = match self.ring() {
                Some(ring) => ring.submitter().register_files_update(slot, &[-1]),
                None => Err(io::Error::from_raw_os_error(libc::EBUSY)),
            };
            match r {
                Ok(_) if flushed => self.files.borrow_mut().give(slot),
                Ok(_) => tracing::warn!("fixed-file slot {slot} retired: entries unsent"),
                Err(e) => tracing::warn!("fixed-file slot {slot} not cleared ({e})"),
            }
        }
    }

    /// Slots of the fixed-file table free now (0 before it exists), for diagnostics: a worker
    /// whose table is full serves new tenants' files by number.
    pub fn free_file_slots(&self) -> usize {
        self.files.borrow().free()
    }

    /// Registrations of `fd` not yet undone (for tests and diagnostics).
    pub fn file_refs(&self, fd: RawFd) -> u32 {
        self.files.borrow().refs(fd)
    }

    /// `fd` as operations should name it: its fixed-file slot if it is registered. O(1).
    #[inline]
    pub(crate) fn target(&self, fd: crate::Fd) -> crate::Fd {
        match fd {
            crate::Fd::Raw(raw) => match self.files.borrow().slot_of(raw) {
                Some(i) => crate::Fd::Fixed(i),
                None => fd,
            },
            fixed => fixed,
        }
    }
}
