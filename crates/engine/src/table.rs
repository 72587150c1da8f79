//! Bookkeeping of the ring's sparse fixed-resource tables (registered buffers, registered files),
//! which tenants of one engine share and which outlive any one of them.
//!
//! Only the bookkeeping lives here: which slots are free, which descriptor holds which slot and
//! how many tenants registered it. The engine does the registrations themselves
//! (`IORING_REGISTER_BUFFERS_UPDATE`, `IORING_REGISTER_FILES_UPDATE`), since they need its ring.

use std::os::fd::RawFd;

use crate::buf::NONE;

/// The free slots of a sparse table. A slot is taken when a resource is first used, given back
/// when its owner leaves; taking and giving never allocate (the list was sized with the table).
#[derive(Debug, Default)]
pub(crate) struct SlotList {
    free: Vec<u32>,
    size: u32,
}

impl SlotList {
    /// A table of `size` slots, all free (handed out lowest first).
    pub(crate) fn new(size: u32) -> SlotList {
        SlotList {
            free: (0..size).rev().collect(),
            size,
        }
    }

    /// Slots in the table (0: the ring has none).
    pub(crate) fn size(&self) -> u32 {
        self.size
    }

    /// A free slot, `None` if the table is full.
    pub(crate) fn take(&mut self) -> Option<u32> {
        self.free.pop()
    }

    /// `slot` is free again. Never allocates: the list was sized for every slot.
    pub(crate) fn give(&mut self, slot: u32) {
        debug_assert!(slot < self.size && !self.free.contains(&slot));
        self.free.push(slot);
    }

    /// Slots free now.
    pub(crate) fn free(&self) -> usize {
        self.free.len()
    }
}

/// How the engine knows one descriptor number.
#[derive(Clone, Copy, Debug)]
struct FdRef {
    /// Its slot in the ring's file table, [`NONE`] if it goes by number.
    slot: u32,
    /// Registrations not yet undone (tenants sharing one descriptor, e.g. `/dev/fuse` clones).
    refs: u32,
}

const UNKNOWN: FdRef = FdRef {
    slot: NONE,
    refs: 0,
};

/// The registered-files table: a sparse table of the ring, a free list of its slots, and a map
/// from descriptor number to slot that [`FileTable::slot_of`] reads in O(1) per operation.
#[derive(Debug, Default)]
pub(crate) struct FileTable {
    /// `None` until the ring has a table (created at the first registration).
    slots: Option<SlotList>,
    /// Indexed by descriptor number: descriptors are small and dense, so this stays about as
    /// long as the process's descriptor table. Grows only when a registration names a larger one.
    by_fd: Vec<FdRef>,
}

impl FileTable {
    /// Whether the ring has a file table yet.
    pub(crate) fn created(&self) -> bool {
        self.slots.is_some()
    }

    /// The ring now has a sparse table of `size` slots.
    pub(crate) fn create(&mut self, size: u32) {
        self.slots = Some(SlotList::new(size));
    }

    /// `fd`'s slot, if it has one.
    #[inline]
    pub(crate) fn slot_of(&self, fd: RawFd) -> Option<u32> {
        let r = self.by_fd.get(usize::try_from(fd).ok()?)?;
        (r.slot != NONE).then_some(r.slot)
    }

    /// Counts one more registration of `fd` (>= 0); returns whether it is the first one.
    pub(crate) fn add_ref(&mut self, fd: RawFd) -> bool {
        let Ok(i) = usize::try_from(fd) else {
            return false;
        };
        if self.by_fd.len() <= i {
            self.by_fd.resize(i + 1, UNKNOWN);
        }
        let r = &mut self.by_fd[i];
        r.refs += 1;
        r.refs == 1
    }

    /// Undoes one registration of `fd`; when it was the last, returns the slot it held (now
    /// unassigned, not yet free: the caller clears it in the ring, then [`FileTable::give`]s it).
    pub(crate) fn drop_ref(&mut self, fd: RawFd) -> Option<u32> {
        let r = self.by_fd.get_mut(usize::try_from(fd).ok()?)?;
        if r.refs == 0 {
            return None;
        }
        r.refs -= 1;
        if r.refs > 0 || r.slot == NONE {
            return None;
        }
        Some(std::mem::replace(&mut r.slot, NONE))
    }

    /// Registrations of `fd` not yet undone.
    pub(crate) fn refs(&self, fd: RawFd) -> u32 {
        usize::try_from(fd)
            .ok()
            .and_then(|i| self.by_fd.get(i))
            .map_or(0, |r| r.refs)
    }

    /// A free slot of the ring's table, if it has one.
    pub(crate) fn take(&mut self) -> Option<u32> {
        self.slots.as_mut()?.take()
    }

    /// `slot` is free again.
    pub(crate) fn give(&mut self, slot: u32) {
        if let Some(s) = &mut self.slots {
            s.give(slot);
        }
    }

    /// `fd` (registered, see [`FileTable::add_ref`]) now holds `slot`.
    pub(crate) fn set(&mut self, fd: RawFd, slot: u32) {
        if let Some(r) = usize::try_from(fd).ok().and_then(|i| self.by_fd.get_mut(i)) {
            r.slot = slot;
        }
    }

    /// Slots free now (0 without a table).
    pub(crate) fn free(&self) -> usize {
        self.slots.as_ref().map_or(0, SlotList::free)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_reused_and_references_counted() {
        let mut t = FileTable::default();
        assert_eq!(t.take(), None, "no table yet");
        t.create(2);
        assert!(t.add_ref(7));
        assert!(!t.add_ref(7), "a second tenant of the same fd");
        let s = t.take().unwrap();
        t.set(7, s);
        assert_eq!(t.slot_of(7), Some(s));
        assert_eq!(t.slot_of(-1), None);
        assert_eq!(t.slot_of(1000), None);
        assert_eq!(t.drop_ref(7), None, "one registration left");
        assert_eq!(t.slot_of(7), Some(s));
        assert_eq!(t.drop_ref(7), Some(s));
        assert_eq!(t.slot_of(7), None);
        assert_eq!(t.drop_ref(7), None, "no underflow");
        t.give(s);
        assert_eq!(t.free(), 2);
        assert_eq!(t.take(), Some(s), "the freed slot comes back first");
    }
}
