//! Reused memory for the path operations (statx, openat, unlinkat, renameat, linkat).
//!
//! The kernel reads such an operation's path, and statx writes its result, in memory the
//! operation owns until its completion (see [`crate::op`]), possibly in an io-wq worker long
//! after the submission. Taking that memory from a free list kept per engine, instead of from
//! the allocator, keeps a queue that serves metadata requests free of allocation per request
//! once it is warm. The memory of an operation whose future was dropped is freed with it, not
//! kept: such operations are rare, and the list refills on demand.

use std::cell::{Cell, RefCell};
use std::ffi::{CStr, CString};
use std::mem::MaybeUninit;

use crate::op::Owned;

/// Bytes of a pooled path: a name (`NAME_MAX`, 255) and its NUL, or a short path such as
/// `/proc/self/fd/N`. A longer path gets an allocation of its own.
pub(crate) const PATH_ROOM: usize = 256;

/// Free entries of each kind an engine keeps: what a burst of concurrent operations leaves
/// behind beyond this is freed.
const KEEP: usize = 64;

/// A NUL-terminated path an operation owns.
#[derive(Debug)]
pub(crate) enum CPath {
    /// Copied into a buffer of the free list.
    Pooled(Box<[u8; PATH_ROOM]>),
    /// Too long for one: its own allocation.
    Own(CString),
}

impl CPath {
    /// The path for the kernel; stays valid while `self` lives, wherever it moves (the bytes
    /// are on the heap).
    pub(crate) fn as_ptr(&self) -> *const libc::c_char {
        match self {
            CPath::Pooled(b) => b.as_ptr().cast(),
            CPath::Own(c) => c.as_ptr(),
        }
    }
}

/// The free lists of one engine (single-threaded, like the engine). They hold boxes, not
/// values: a box is lent to an operation whole, and what the kernel reads or writes must not
/// move while the list grows.
#[derive(Default)]
#[allow(clippy::vec_box)]
pub(crate) struct Scratch {
    paths: RefCell<Vec<Box<[u8; PATH_ROOM]>>>,
    statx: RefCell<Vec<Box<MaybeUninit<libc::statx>>>>,
    /// Buffers taken from the allocator, of both kinds (tests check the lists are reused).
    made: Cell<usize>,
}

impl Scratch {
    /// `p` copied into memory an operation can own.
    pub(crate) fn path(&self, p: &CStr) -> CPath {
        let bytes = p.to_bytes_with_nul();
        if bytes.len() > PATH_ROOM {
            return CPath::Own(CString::from(p));
        }
        let mut b = self.paths.borrow_mut().pop().unwrap_or_else(|| {
            self.made.set(self.made.get() + 1);
            Box::new([0; PATH_ROOM])
        });
        b[..bytes.len()].copy_from_slice(bytes);
        CPath::Pooled(b)
    }

    /// A zeroed buffer for statx to fill (zeroed, so it is initialized whatever the kernel
    /// writes).
    pub(crate) fn statx_buf(&self) -> Box<MaybeUninit<libc::statx>> {
        match self.statx.borrow_mut().pop() {
            Some(mut b) => {
                *b = MaybeUninit::zeroed();
                b
            }
            None => {
                self.made.set(self.made.get() + 1);
                Box::new(MaybeUninit::zeroed())
            }
        }
    }

    /// Takes back the paths and statx buffer of a completed operation's `owned`.
    pub(crate) fn give_back(&self, owned: Owned) {
        match owned {
            Owned::Paths { path, second } => {
                self.give_back_path(path);
                if let Some(s) = second {
                    self.give_back_path(s);
                }
            }
            Owned::Open { path } => self.give_back_path(path),
            Owned::Statx { path, buf } => {
                self.give_back_path(path);
                self.give_back_statx(buf);
            }
            _ => {}
        }
    }

    fn give_back_path(&self, p: CPath) {
        if let CPath::Pooled(b) = p {
            let mut free = self.paths.borrow_mut();
            if free.len() < KEEP {
                free.push(b);
            }
        }
    }

    /// Takes back a statx buffer whose contents were read.
    fn give_back_statx(&self, b: Box<MaybeUninit<libc::statx>>) {
        let mut free = self.statx.borrow_mut();
        if free.len() < KEEP {
            free.push(b);
        }
    }

    /// Buffers taken from the allocator so far.
    #[cfg(test)]
    pub(crate) fn made(&self) -> usize {
        self.made.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_copied_with_their_nul_and_reused() {
        let s = Scratch::default();
        let p = s.path(c"name");
        // SAFETY: as_ptr points at a NUL-terminated copy that lives as long as `p`.
        assert_eq!(unsafe { CStr::from_ptr(p.as_ptr()) }, c"name");
        s.give_back(Owned::Open { path: p });
        let q = s.path(c"a");
        // SAFETY: as above.
        assert_eq!(unsafe { CStr::from_ptr(q.as_ptr()) }, c"a");
        assert_eq!(s.made(), 1, "the second path reused the first one's buffer");
        s.give_back(Owned::Open { path: q });
    }

    #[test]
    fn a_path_longer_than_a_name_gets_its_own_allocation() {
        let s = Scratch::default();
        let long = CString::new(vec![b'x'; PATH_ROOM]).unwrap();
        let p = s.path(&long);
        assert!(matches!(p, CPath::Own(_)));
        // SAFETY: as above.
        assert_eq!(unsafe { CStr::from_ptr(p.as_ptr()) }, long.as_c_str());
        let fits = CString::new(vec![b'y'; PATH_ROOM - 1]).unwrap();
        let q = s.path(&fits);
        assert!(matches!(q, CPath::Pooled(_)));
        // SAFETY: as above.
        assert_eq!(unsafe { CStr::from_ptr(q.as_ptr()) }, fits.as_c_str());
    }

    #[test]
    fn a_reused_statx_buffer_is_zeroed() {
        let s = Scratch::default();
        let mut b = s.statx_buf();
        // SAFETY: zeroed plain data; writing one field.
        unsafe { (*b.as_mut_ptr()).stx_ino = 42 };
        s.give_back_statx(b);
        let b = s.statx_buf();
        // SAFETY: the buffer is zeroed, every field initialized.
        assert_eq!(unsafe { b.assume_init_ref() }.stx_ino, 0);
        assert_eq!(s.made(), 1);
    }

    #[test]
    fn the_free_lists_are_bounded() {
        let s = Scratch::default();
        let taken: Vec<_> = (0..KEEP + 10).map(|_| s.path(c"n")).collect();
        for p in taken {
            s.give_back(Owned::Open { path: p });
        }
        assert_eq!(s.paths.borrow().len(), KEEP);
    }
}
