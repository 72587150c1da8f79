//! Engine-owned, page-aligned I/O buffers.
//!
//! Every byte the kernel reads or writes on behalf of a request lives in a buffer allocated here, once,
//! when the queue starts. Handing out the buffers as [`BufHandle`]s (one owner each) and slicing them
//! into [`IoBuf`]/[`IoBufMut`] lets the ring operations be safe functions: the memory outlives every
//! operation because the engine frees it only after draining the ring.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::marker::PhantomData;
use std::ptr::NonNull;

/// Alignment of every buffer: a page, which satisfies O_DIRECT on any device fusex will meet.
pub const BUF_ALIGN: usize = 4096;

/// One page-aligned allocation. Owned by the engine's pool.
pub(crate) struct RawBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl RawBuf {
    pub(crate) fn new(size: usize) -> Option<RawBuf> {
        let size = size.max(BUF_ALIGN).next_multiple_of(BUF_ALIGN);
        let layout = Layout::from_size_align(size, BUF_ALIGN).ok()?;
        // SAFETY: layout has a non-zero size (at least one page).
        let ptr = unsafe { alloc_zeroed(layout) };
        NonNull::new(ptr).map(|ptr| RawBuf { ptr, layout })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.layout.size()
    }
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        // SAFETY: ptr was allocated with exactly this layout and is freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Exclusive access to one engine buffer, handed out once per buffer by [`crate::Engine::take_buffer`].
///
/// A handle is `!Send`: it belongs to the queue thread whose engine owns the memory.
pub struct BufHandle {
    ptr: NonNull<u8>,
    len: usize,
    index: u16,
    _not_send: PhantomData<*mut u8>,
}

impl BufHandle {
    pub(crate) fn new(raw: &RawBuf, index: u16) -> BufHandle {
        BufHandle {
            ptr: raw.ptr,
            len: raw.len(),
            index,
            _not_send: PhantomData,
        }
    }

    /// Length of the whole buffer in bytes (a multiple of [`BUF_ALIGN`]).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never, for a real buffer; here for clippy's sake).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Index of this buffer in the engine's pool (the fixed-buffer index when registered).
    pub fn index(&self) -> u16 {
        self.index
    }

    /// The whole buffer as a byte slice.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the engine keeps the allocation alive while any handle exists (handles borrow
        // nothing, but the engine frees buffers only when it is dropped, after all tasks ended and
        // the ring drained), and this handle is the only way to reach it.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The whole buffer as a mutable byte slice.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// A read-only window `[start, start+len)` for the kernel to read from (a write to a file).
    ///
    /// # Panics
    /// If the range is outside the buffer (a programming error, never input-driven).
    pub fn io(&self, start: usize, len: usize) -> IoBuf<'_> {
        assert!(start <= self.len && len <= self.len - start, "IoBuf range");
        IoBuf {
            // SAFETY: start is within the allocation (checked above).
            ptr: unsafe { self.ptr.as_ptr().add(start) },
            len,
            index: self.index,
            _b: PhantomData,
        }
    }

    /// A writable window `[start, start+len)` for the kernel to fill (a read from a file).
    ///
    /// # Panics
    /// If the range is outside the buffer (a programming error, never input-driven).
    pub fn io_mut(&mut self, start: usize, len: usize) -> IoBufMut<'_> {
        assert!(
            start <= self.len && len <= self.len - start,
            "IoBufMut range"
        );
        IoBufMut {
            // SAFETY: start is within the allocation (checked above).
            ptr: unsafe { self.ptr.as_ptr().add(start) },
            len,
            index: self.index,
            _b: PhantomData,
        }
    }
}

/// Engine-owned memory the kernel may read (source of a write).
#[derive(Clone, Copy)]
pub struct IoBuf<'a> {
    ptr: *const u8,
    len: usize,
    index: u16,
    _b: PhantomData<&'a [u8]>,
}

impl<'a> IoBuf<'a> {
    /// Start address, for building an SQE.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the window is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Pool index of the underlying buffer (fixed-buffer index when registered).
    pub fn buf_index(&self) -> u16 {
        self.index
    }
    /// The bytes.
    pub fn as_slice(&self) -> &'a [u8] {
        // SAFETY: constructed from a live BufHandle window of exactly this range.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    /// A sub-window (clamped to this window).
    pub fn slice(&self, start: usize, len: usize) -> IoBuf<'a> {
        let start = start.min(self.len);
        let len = len.min(self.len - start);
        // SAFETY: start <= self.len, so the pointer stays inside the window.
        IoBuf {
            ptr: unsafe { self.ptr.add(start) },
            len,
            ..*self
        }
    }
}

/// Engine-owned memory the kernel may write (destination of a read).
pub struct IoBufMut<'a> {
    ptr: *mut u8,
    len: usize,
    index: u16,
    _b: PhantomData<&'a mut [u8]>,
}

impl IoBufMut<'_> {
    /// Start address, for building an SQE.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the window is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Pool index of the underlying buffer (fixed-buffer index when registered).
    pub fn buf_index(&self) -> u16 {
        self.index
    }
    /// The bytes, for filling in userspace (e.g. zeroes from the null backend).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: constructed from a live, exclusively borrowed BufHandle window of this range.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    /// A shorter prefix of this window.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
    /// Drops the first `n` bytes (clamped) from the window, e.g. after a short transfer.
    pub fn advance(&mut self, n: usize) {
        let n = n.min(self.len);
        // SAFETY: n <= len keeps the pointer inside the window.
        self.ptr = unsafe { self.ptr.add(n) };
        self.len -= n;
    }
}
