//! Open files and directories: the descriptors behind the `fh` the kernel echoes in READ, WRITE,
//! READDIR, FSYNC and RELEASE. A handle is a slot index and the slot's generation, so a stale or
//! made-up `fh` finds nothing rather than another file. Finding a handle's descriptor is one
//! atomic load: the data path takes no lock. Opening and releasing take a mutex for the free list.

use std::os::fd::{IntoRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::Mutex;

/// One open handle as a `fusex restart` successor takes it over ([`Files::entries`]); its
/// descriptor travels beside.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileEntry {
    /// Its slot: the low half of the handle.
    pub slot: u32,
    /// Its generation: the high half.
    pub generation: u32,
    /// The passthrough backing id its opens use (0: none).
    pub backing: i32,
}

/// The table. Its slots are allocated zeroed up front, so untouched ones cost no resident memory.
pub struct Files {
    /// (generation << 32) | (fd + 1); low half 0: free.
    slots: Box<[AtomicU64]>,
    /// The passthrough backing id registered for the slot's file (0: none), closed at release.
    backing: Box<[AtomicI32]>,
    free: Mutex<Free>,
}

struct Free {
    /// Released slots, reused first.
    list: Vec<u32>,
    /// Slots below this were handed out at least once.
    next: u32,
}

impl Files {
    /// A table for at most `capacity` open handles (at least 1, at most 2^31).
    pub fn new(capacity: usize) -> Files {
        let capacity = capacity.clamp(1, 1 << 31);
        Files {
            slots: (0..capacity).map(|_| AtomicU64::new(0)).collect(),
            backing: (0..capacity).map(|_| AtomicI32::new(0)).collect(),
            free: Mutex::new(Free {
                list: Vec::new(),
                next: 0,
            }),
        }
    }

    /// Keeps `fd` and returns its handle; `EMFILE` when the table is full.
    pub fn insert(&self, fd: OwnedFd) -> Result<u64, i32> {
        self.insert_backed(fd, 0)
    }

    /// Keeps `fd`, registered under passthrough backing id `backing` (0: none), and returns its
    /// handle; `EMFILE` when the table is full.
    pub fn insert_backed(&self, fd: OwnedFd, backing: i32) -> Result<u64, i32> {
        let mut f = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let i = match f.list.pop() {
            Some(i) => i,
            None if (f.next as usize) < self.slots.len() => {
                f.next += 1;
                f.next - 1
            }
            None => return Err(libc::EMFILE),
        };
        drop(f);
        let slot = &self.slots[i as usize];
        let generation = (slot.load(Ordering::Relaxed) >> 32).wrapping_add(1) & 0xffff_ffff;
        let raw = fd.into_raw_fd();
        self.backing[i as usize].store(backing, Ordering::Relaxed);
        slot.store((generation << 32) | (raw as u64 + 1), Ordering::Release);
        Ok((generation << 32) | u64::from(i))
    }

    /// The descriptor of handle `fh`, while it is open.
    pub fn get(&self, fh: u64) -> Option<RawFd> {
        let v = self.slots.get(fh as u32 as usize)?.load(Ordering::Acquire);
        let fd = v as u32;
        (fd != 0 && v >> 32 == fh >> 32).then(|| (fd - 1) as RawFd)
    }

    /// Takes handle `fh` out (RELEASE, RELEASEDIR): its descriptor, now owned by the caller,
    /// and its backing id (0: none).
    pub fn remove(&self, fh: u64) -> Option<(OwnedFd, i32)> {
        let i = fh as u32;
        let slot = self.slots.get(i as usize)?;
        let v = slot.load(Ordering::Acquire);
        let fd = v as u32;
        if fd == 0 || v >> 32 != fh >> 32 {
            return None;
        }
        // Keep the generation, so the next holder of the slot gets a new one.
        if slot
            .compare_exchange(v, v & !0xffff_ffff, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return None;
        }
        let backing = self.backing[i as usize].swap(0, Ordering::Relaxed);
        self.free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .list
            .push(i);
        use std::os::fd::FromRawFd;
        // SAFETY: the slot owned this descriptor (put there by `insert` from an OwnedFd) and the
        // exchange above took it out, so no one else can close or reuse it.
        Some((unsafe { OwnedFd::from_raw_fd((fd - 1) as RawFd) }, backing))
    }

    /// Every open handle (as [`FileEntry`]) and its descriptor (in the same order), and the
    /// first slot never handed out: what a `fusex restart` successor needs to go on answering
    /// the handles the kernel holds. Only once no request is served any more.
    pub fn entries(&self) -> (Vec<FileEntry>, Vec<RawFd>, u32) {
        let next = self.free.lock().unwrap_or_else(|p| p.into_inner()).next;
        let mut files = Vec::new();
        let mut fds = Vec::new();
        for (i, s) in self.slots.iter().enumerate().take(next as usize) {
            let v = s.load(Ordering::Acquire);
            if v as u32 == 0 {
                continue;
            }
            files.push(FileEntry {
                slot: i as u32,
                generation: (v >> 32) as u32,
                backing: self.backing[i].load(Ordering::Relaxed),
            });
            fds.push((v as u32 - 1) as RawFd);
        }
        (files, fds, next)
    }

    /// Takes over the handles a predecessor had open ([`Files::entries`]) into this table, which
    /// has none: `fds` are their descriptors, in order.
    pub fn adopt(
        &self,
        entries: Vec<FileEntry>,
        fds: &mut impl Iterator<Item = OwnedFd>,
        next: u32,
    ) -> Result<(), String> {
        let mut f = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if f.next != 0 {
            return Err("the handle table is in use".into());
        }
        if next as usize > self.slots.len() {
            return Err(format!(
                "{next} handle slots, more than the {} this export keeps",
                self.slots.len()
            ));
        }
        let mut used = vec![false; next as usize];
        for e in entries {
            let i = e.slot as usize;
            if i >= used.len() || used[i] {
                return Err(format!("handle slot {} out of place", e.slot));
            }
            used[i] = true;
            let fd = fds.next().ok_or("fewer descriptors than handles")?;
            self.backing[i].store(e.backing, Ordering::Relaxed);
            self.slots[i].store(
                (u64::from(e.generation) << 32) | (fd.into_raw_fd() as u64 + 1),
                Ordering::Release,
            );
        }
        f.next = next;
        f.list = (0..next).filter(|&i| !used[i as usize]).collect();
        Ok(())
    }

    /// Handles open now.
    pub fn open_count(&self) -> usize {
        let f = self.free.lock().unwrap_or_else(|p| p.into_inner());
        f.next as usize - f.list.len()
    }
}

impl Drop for Files {
    fn drop(&mut self) {
        for s in self.slots.iter() {
            let v = s.load(Ordering::Acquire);
            if v as u32 != 0 {
                // SAFETY: the slot still owns the descriptor; the table is going away.
                drop(unsafe {
                    <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd((v as u32 - 1) as RawFd)
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fd() -> OwnedFd {
        std::fs::File::open("/").unwrap().into()
    }

    #[test]
    fn handles_are_checked_and_reused() {
        let t = Files::new(2);
        let a = t.insert(fd()).unwrap();
        let b = t.insert(fd()).unwrap();
        assert_eq!(t.insert(fd()), Err(libc::EMFILE));
        assert!(t.get(a).is_some() && t.get(b).is_some());
        assert_eq!(t.open_count(), 2);
        assert!(t.remove(a).is_some());
        assert!(t.get(a).is_none(), "released");
        assert!(t.remove(a).is_none(), "twice");
        let c = t.insert(fd()).unwrap();
        assert_eq!(c as u32, a as u32, "slot reused");
        assert_ne!(c, a, "with another generation");
        assert!(t.get(a).is_none());
        for bogus in [u64::MAX, 7, (5 << 32) | 1] {
            assert!(t.get(bogus).is_none());
            assert!(t.remove(bogus).is_none());
        }
    }
}
