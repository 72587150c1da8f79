//! Engine-owned, page-aligned I/O buffers, handed out as owned values.
//!
//! Every byte the kernel reads or writes on behalf of a request lives in a buffer of a `Pool`,
//! allocated once when the queue starts. A [`Buf`] owns one buffer: it keeps the pool's memory
//! alive (shared ownership), so no safe code can reach freed memory, not even after the engine is
//! gone. Ring operations that touch a buffer take the `Buf` (or a [`Slice`] of it) by value and
//! give it back with their result: while the kernel may write into it, no task can reach it.
//! Dropping a `Buf` returns it to its pool's free list (no allocation: the list is sized once).
//!
//! A `Buf` belongs to one thread. To hand a buffer to another queue thread (an io_uring entry
//! moving to a less busy queue, see `server::slots`) it becomes a [`SendBuf`] for the trip: the
//! pool's memory is shared through an `Arc`, so it stays allocated for as long as any thread holds
//! one of its buffers, and an engine uses a buffer as a fixed buffer only if it is its own pool's.

use std::marker::PhantomData;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Alignment of every buffer: a page, which satisfies O_DIRECT on any device fusex will meet.
pub const BUF_ALIGN: usize = 4096;

/// One page-aligned allocation: an anonymous private mapping of its own. The kernel gives its
/// pages zeroed on first touch, so a buffer costs no resident memory until a request fills it
/// (unless the ring registers it, which pins it); an allocator's zeroed allocation would write
/// every page at start (an aligned `alloc_zeroed` clears the memory itself), making every
/// export's buffers resident whether it is busy or idle.
pub(crate) struct RawBuf {
    ptr: NonNull<u8>,
    len: usize,
}

impl RawBuf {
    pub(crate) fn new(size: usize) -> Option<RawBuf> {
        let len = size.max(BUF_ALIGN).next_multiple_of(BUF_ALIGN);
        // SAFETY: a fresh anonymous private mapping; no existing memory is named or changed.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return None;
        }
        NonNull::new(ptr.cast()).map(|ptr| RawBuf { ptr, len })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        // SAFETY: ptr and len are exactly the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

// SAFETY: a `RawBuf` is an owned mapping of plain bytes with no thread affinity; moving
// the owner to another thread moves nothing but the address.
unsafe impl Send for RawBuf {}
// SAFETY: `&RawBuf` exposes only the address and length, never the bytes.
unsafe impl Sync for RawBuf {}

/// No fixed-buffer table slot, no provided-buffer group.
pub(crate) const NONE: u32 = u32::MAX;

/// The buffers of one pool of an engine (its default pool, or a tenant's from
/// [`crate::Engine::add_pool`]): their memory, the free list, and where the owning engine's
/// tables know them. Shared (`Arc`) so a buffer on its way to, or in use by, another thread keeps
/// the memory alive; the free list is touched when a slot takes or gives back its buffer (at
/// queue start and end), not per request.
///
/// The table fields are atomics because `Buf`s of the pool travel to other threads, whose engines
/// read `owner` to learn that the slots are not theirs; only the owning engine's thread writes
/// them, so `Relaxed` suffices (a reader on another thread compares `owner` with its own id, which
/// never matches whatever value it sees).
pub(crate) struct Pool {
    /// One mapping for every buffer, each `stride` bytes from the last: a pool costs one mmap
    /// and one munmap. A mapping per buffer cost a daemon that adds and removes exports 34
    /// munmaps per queue each time, each splitting the merged area and shooting down the TLB
    /// of every CPU (9 % of the CPU samples of unpaced add and delete rounds, its mmap lock
    /// contended with the busy exports' threads).
    mem: Option<RawBuf>,
    /// Bytes per buffer (a multiple of [`BUF_ALIGN`]).
    stride: usize,
    count: usize,
    free: Mutex<Vec<u16>>,
    /// Id of the engine whose tables `slots` and `group` refer to; 0 once the pool was removed
    /// from it (then its buffers go by address everywhere).
    owner: AtomicU64,
    /// Whether its buffers may take fixed-buffer table slots (the engine has a table and
    /// registering this pool's buffers has not failed).
    registered: AtomicBool,
    /// Each buffer's slot in the owner's fixed-buffer table, [`NONE`] until its first fixed use.
    slots: Box<[AtomicU32]>,
    /// The owner's provided-buffer group lending this pool's buffers, [`NONE`] if none.
    group: AtomicU32,
}

impl Pool {
    /// `count` buffers of `size` bytes, for the tables of engine `owner`. Buffers take a slot of
    /// the owner's fixed-buffer table one by one, each the first time an operation uses it
    /// ([`crate::Engine::fixed`]): a buffer registered is pinned, so resident, and a tenant that
    /// stays idle should not pay for buffers it never uses.
    pub(crate) fn new(count: usize, size: usize, owner: u64) -> Option<Arc<Pool>> {
        if count > usize::from(u16::MAX) {
            return None;
        }
        let stride = size.max(BUF_ALIGN).next_multiple_of(BUF_ALIGN);
        let mem = match count {
            0 => None,
            n => Some(RawBuf::new(stride.checked_mul(n)?)?),
        };
        if let Some(m) = &mem {
            // With transparent huge pages set to `always`, the first touch of a buffer (one page
            // per io_uring entry at REGISTER) could make 2 MiB of the pool resident: an idle
            // export would cost megabytes. Best effort: without it, memory is only larger.
            // SAFETY: advice on exactly the mapping just made; it changes no contents.
            unsafe {
                libc::madvise(m.ptr().cast(), stride * count, libc::MADV_NOHUGEPAGE);
            }
        }
        // Handed out lowest index first.
        let free = (0..count as u16).rev().collect();
        Some(Arc::new(Pool {
            mem,
            stride,
            count,
            free: Mutex::new(free),
            owner: AtomicU64::new(owner),
            registered: AtomicBool::new(false),
            slots: (0..count).map(|_| AtomicU32::new(NONE)).collect(),
            group: AtomicU32::new(NONE),
        }))
    }

    /// Id of the engine whose tables know this pool (0: none).
    pub(crate) fn owner(&self) -> u64 {
        self.owner.load(Ordering::Relaxed)
    }

    /// The pool leaves its engine: its buffers go by address from now on. Returns the table
    /// slots its buffers held (for the engine to clear) and its provided-buffer group.
    pub(crate) fn disown(&self) -> (Vec<u32>, Option<u16>) {
        self.owner.store(0, Ordering::Relaxed);
        self.clear_registered();
        let slots = self
            .slots
            .iter()
            .map(|s| s.swap(NONE, Ordering::Relaxed))
            .filter(|s| *s != NONE)
            .collect();
        let group = self.group.swap(NONE, Ordering::Relaxed);
        (slots, u16::try_from(group).ok())
    }

    pub(crate) fn set_registered(&self) {
        self.registered.store(true, Ordering::Relaxed);
    }

    pub(crate) fn registered(&self) -> bool {
        self.registered.load(Ordering::Relaxed)
    }

    /// Buffer `index`'s slot in the owner's fixed-buffer table, if it has one.
    #[inline]
    pub(crate) fn slot(&self, index: u16) -> Option<u16> {
        let s = self.slots.get(usize::from(index))?.load(Ordering::Relaxed);
        u16::try_from(s).ok()
    }

    /// Whether buffer `index` is in the owner's fixed-buffer table now.
    #[cfg(test)]
    pub(crate) fn fixed(&self, index: u16) -> bool {
        self.slot(index).is_some()
    }

    /// Buffer `index` was just registered in table slot `slot`.
    pub(crate) fn set_slot(&self, index: u16, slot: u16) {
        if let Some(s) = self.slots.get(usize::from(index)) {
            s.store(u32::from(slot), Ordering::Relaxed);
        }
    }

    /// The owner's provided-buffer group for this pool, if it has one.
    pub(crate) fn group(&self) -> Option<u16> {
        u16::try_from(self.group.load(Ordering::Relaxed)).ok()
    }

    pub(crate) fn set_group(&self, group: u16) {
        self.group.store(u32::from(group), Ordering::Relaxed);
    }

    /// Buffer `index` as an iovec, for registering it alone.
    pub(crate) fn iovec(&self, index: u16) -> Option<libc::iovec> {
        (usize::from(index) < self.count).then(|| libc::iovec {
            iov_base: self.buf_ptr(index).cast(),
            iov_len: self.stride,
        })
    }

    /// Registration failed: every buffer goes by address from now on.
    pub(crate) fn clear_registered(&self) {
        self.registered.store(false, Ordering::Relaxed);
    }

    fn free_list(&self) -> std::sync::MutexGuard<'_, Vec<u16>> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn len(&self) -> usize {
        self.count
    }

    /// Start of buffer `index` (below [`Pool::len`], which every `Buf`'s index is).
    fn buf_ptr(&self, index: u16) -> *mut u8 {
        match &self.mem {
            // SAFETY: `index < count` for every buffer handed out, so the offset stays inside the
            // mapping of `count * stride` bytes.
            Some(m) => unsafe { m.ptr().add(usize::from(index) * self.stride) },
            None => std::ptr::NonNull::dangling().as_ptr(),
        }
    }

    pub(crate) fn take(self: &Arc<Self>) -> Option<Buf> {
        let index = self.free_list().pop()?;
        Some(Buf {
            lease: Lease {
                pool: self.clone(),
                index,
            },
            _thread: PhantomData,
        })
    }

    pub(crate) fn available(&self) -> usize {
        self.free_list().len()
    }
}

/// One buffer of an engine's pool, owned: it cannot be used by two owners at once, it keeps the
/// pool's memory alive, and it goes back to the pool when dropped.
///
/// A `Buf` is `!Send`: it belongs to the thread that holds it; [`Buf::into_send`] is the one way
/// across threads.
pub struct Buf {
    lease: Lease,
    _thread: PhantomData<*const ()>,
}

/// The claim on one index of a pool; giving it up returns the index to the free list.
struct Lease {
    pool: Arc<Pool>,
    index: u16,
}

impl Drop for Lease {
    fn drop(&mut self) {
        // The free list was sized for every buffer of the pool: this never allocates.
        self.pool.free_list().push(self.index);
    }
}

impl Buf {
    /// Length of the whole buffer in bytes (a multiple of [`BUF_ALIGN`]).
    pub fn len(&self) -> usize {
        self.lease.pool.stride
    }

    /// Whether the buffer is empty (never, for a real buffer; here for clippy's sake).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Index of this buffer in its pool (the buffer id when provided to the kernel; the
    /// fixed-buffer table slot is another number, given at its first fixed use).
    pub fn index(&self) -> u16 {
        self.lease.index
    }

    /// Whether the pool's buffers may be fixed buffers of the ring of the engine that made it
    /// (each takes a table slot at its first fixed use; another engine, or its own after the pool
    /// was removed, uses it through its address).
    pub fn registered(&self) -> bool {
        self.lease.pool.registered()
    }

    /// The pool this buffer belongs to (its owner decides whether the engine at hand may name
    /// it by a fixed-buffer slot or a provided-buffer group).
    pub(crate) fn pool(&self) -> &Pool {
        &self.lease.pool
    }

    /// Readies the buffer to move to another thread (see [`SendBuf`]).
    pub fn into_send(self) -> SendBuf {
        SendBuf { lease: self.lease }
    }

    /// Start address, for diagnostics and alignment checks (never dereferenced by callers).
    pub fn addr(&self) -> usize {
        self.ptr() as usize
    }

    /// The whole buffer as a byte slice.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the buffer's `len()` bytes from `ptr()` lie inside the pool's mapping, which
        // lives as long as the pool, which this `Buf` keeps alive; the free list hands each index
        // to one `Buf` at a time, and ring operations take the `Buf` by value, so while this
        // shared borrow exists nobody (not the kernel) writes to it.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len()) }
    }

    /// The whole buffer as a mutable byte slice.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len()) }
    }

    /// A window of this buffer, owned. Out-of-range bounds are clamped to the buffer.
    pub fn slice(self, range: Range<usize>) -> Slice {
        let end = range.end.min(self.len());
        let start = range.start.min(end);
        Slice {
            buf: self,
            start,
            end,
        }
    }

    /// Pointer for the kernel. Only the engine hands it out, inside an operation that owns `self`.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.lease.pool.buf_ptr(self.lease.index)
    }
}

/// A [`Buf`] on its way to another thread: it owns the buffer (no one else can reach it) and keeps
/// the pool's memory alive, but gives no access to the bytes until [`SendBuf::into_buf`] on the
/// receiving thread. Dropped on the way, it returns the buffer to its pool.
pub struct SendBuf {
    lease: Lease,
}

impl SendBuf {
    /// The buffer, now belonging to the calling thread.
    pub fn into_buf(self) -> Buf {
        Buf {
            lease: self.lease,
            _thread: PhantomData,
        }
    }
}

impl std::fmt::Debug for SendBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendBuf")
            .field("index", &self.lease.index)
            .finish()
    }
}

impl std::fmt::Debug for Buf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buf")
            .field("index", &self.index())
            .field("len", &self.len())
            .finish()
    }
}

/// An owned window `[start, end)` of a [`Buf`]: what a read fills or a write sends. Operations
/// take it by value and return it, so a partial transfer can [`Slice::advance`] and go again.
#[derive(Debug)]
pub struct Slice {
    buf: Buf,
    start: usize,
    end: usize,
}

impl Slice {
    /// Bytes in the window.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// Whether the window is empty.
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// Where the window starts in its buffer.
    pub fn start(&self) -> usize {
        self.start
    }

    /// Where the window ends in its buffer.
    pub fn end(&self) -> usize {
        self.end
    }

    /// Start address of the window (for alignment decisions; never dereferenced by callers).
    pub fn addr(&self) -> usize {
        self.buf.addr() + self.start
    }

    /// The window's bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.buf.as_slice()[self.start..self.end]
    }

    /// The window's bytes, mutable (e.g. zeroes from the null backend, a synchronous `pread`).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let (s, e) = (self.start, self.end);
        &mut self.buf.as_mut_slice()[s..e]
    }

    /// Drops the first `n` bytes (clamped) from the window, e.g. after a short transfer.
    pub fn advance(&mut self, n: usize) {
        self.start += n.min(self.len());
    }

    /// Shortens the window to at most `len` bytes.
    pub fn truncate(&mut self, len: usize) {
        self.end = self.start + len.min(self.len());
    }

    /// The underlying buffer.
    pub fn buf(&self) -> &Buf {
        &self.buf
    }

    /// Gives the buffer back.
    pub fn into_inner(self) -> Buf {
        self.buf
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        // The window lies inside the allocation (constructor clamps, advance/truncate shrink).
        self.buf.ptr().wrapping_add(self.start)
    }
}
