//! The inode table: every node the kernel knows, keyed by the source's (device, inode) so one
//! file reached by several names (hard links) is one node, holding an `O_PATH` descriptor of the
//! inode and the kernel's lookup count. A node lives while the kernel holds lookups on it: every
//! successful LOOKUP, CREATE, MKNOD, MKDIR, SYMLINK, LINK and READDIRPLUS entry adds one, FORGET
//! and BATCH_FORGET take them back, and at zero the node and its descriptor are gone. Memory and
//! descriptors so follow what the kernel caches, not how many lookups were ever made.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};

use fuse_abi::ROOT_ID;

/// One inode of the source tree.
#[derive(Debug)]
pub struct Inode {
    fd: OwnedFd,
    /// `st_dev`, `st_ino`: the key.
    pub key: (u64, u64),
    /// `S_IFMT` bits: the type never changes.
    pub kind: u32,
}

impl Inode {
    /// The `O_PATH` descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Whether it is a directory.
    pub fn is_dir(&self) -> bool {
        self.kind == libc::S_IFDIR
    }
}

struct Slot {
    inode: Arc<Inode>,
    nlookup: u64,
    generation: u64,
}

#[derive(Default)]
struct Table {
    /// Node id = index; 0 is never used, 1 is the root.
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    by_key: HashMap<(u64, u64), usize>,
    generation: u64,
}

/// The table, shared by every queue thread (a mutex held for a few instructions per metadata
/// request; the data path, READ and WRITE, never takes it).
pub struct Inodes {
    table: Mutex<Table>,
}

impl Inodes {
    /// A table holding the root (node 1), which is never forgotten.
    pub fn new(root: OwnedFd, key: (u64, u64)) -> Inodes {
        let mut t = Table::default();
        t.slots.push(None);
        t.slots.push(Some(Slot {
            inode: Arc::new(Inode {
                fd: root,
                key,
                kind: libc::S_IFDIR,
            }),
            nlookup: 1,
            generation: 0,
        }));
        t.by_key.insert(key, ROOT_ID as usize);
        Inodes {
            table: Mutex::new(t),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        // A panic while holding the lock leaves the table consistent (no step spans a panic
        // point), so a poisoned lock is still usable.
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The inode of node `id`, if the kernel holds it.
    pub fn get(&self, id: u64) -> Option<Arc<Inode>> {
        let t = self.lock();
        let i = usize::try_from(id).ok()?;
        t.slots.get(i)?.as_ref().map(|s| s.inode.clone())
    }

    /// Adds one lookup of the inode `fd` (of `key` and type `kind`): the node already holding
    /// that inode (and `fd` is closed), or a new one. Returns (node id, generation).
    pub fn insert(&self, fd: OwnedFd, key: (u64, u64), kind: u32) -> (u64, u64) {
        let mut t = self.lock();
        if let Some(&i) = t.by_key.get(&key) {
            if let Some(s) = t.slots[i].as_mut() {
                s.nlookup = s.nlookup.saturating_add(1);
                return (i as u64, s.generation);
            }
        }
        t.generation += 1;
        let slot = Slot {
            inode: Arc::new(Inode { fd, key, kind }),
            nlookup: 1,
            generation: t.generation,
        };
        let generation = slot.generation;
        let i = match t.free.pop() {
            Some(i) => {
                t.slots[i] = Some(slot);
                i
            }
            None => {
                t.slots.push(Some(slot));
                t.slots.len() - 1
            }
        };
        t.by_key.insert(key, i);
        (i as u64, generation)
    }

    /// Adds one lookup of a node the kernel holds already (LINK answers with the linked node).
    pub fn add_lookup(&self, id: u64) -> Option<u64> {
        let mut t = self.lock();
        let s = t.slots.get_mut(usize::try_from(id).ok()?)?.as_mut()?;
        s.nlookup = s.nlookup.saturating_add(1);
        Some(s.generation)
    }

    /// Drops `n` lookups of node `id` (FORGET); at zero the node goes. The root stays, and a
    /// node the kernel does not hold (a stale or made-up id) is ignored.
    pub fn forget(&self, id: u64, n: u64) {
        if id == ROOT_ID {
            return;
        }
        let mut t = self.lock();
        let Ok(i) = usize::try_from(id) else { return };
        let Some(Some(s)) = t.slots.get_mut(i) else {
            return;
        };
        s.nlookup = s.nlookup.saturating_sub(n);
        if s.nlookup > 0 {
            return;
        }
        let key = s.inode.key;
        t.slots[i] = None;
        if t.by_key.get(&key) == Some(&i) {
            t.by_key.remove(&key);
        }
        t.free.push(i);
    }

    /// Nodes held (the root included), for tests and statistics.
    pub fn len(&self) -> usize {
        self.lock().by_key.len()
    }

    /// Whether only the root is held.
    pub fn is_empty(&self) -> bool {
        self.len() <= 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fd() -> OwnedFd {
        std::fs::File::open("/").unwrap().into()
    }

    #[test]
    fn lookups_balance_with_forgets() {
        let t = Inodes::new(fd(), (1, 2));
        let (a, ga) = t.insert(fd(), (1, 10), libc::S_IFREG);
        assert_ne!(a, ROOT_ID);
        // The same inode by another name is the same node.
        assert_eq!(t.insert(fd(), (1, 10), libc::S_IFREG), (a, ga));
        let (b, gb) = t.insert(fd(), (1, 11), libc::S_IFDIR);
        assert_ne!(a, b);
        assert_eq!(t.len(), 3);
        t.forget(a, 1);
        assert!(t.get(a).is_some(), "one lookup left");
        t.forget(a, 1);
        assert!(t.get(a).is_none());
        // The slot is reused with a new generation.
        let (c, gc) = t.insert(fd(), (1, 12), libc::S_IFREG);
        assert_eq!(c, a);
        assert!(gc > gb && gc > ga);
        t.forget(b, 5);
        t.forget(c, 1);
        assert!(t.is_empty());
        // The root and unknown ids are left alone.
        t.forget(ROOT_ID, 100);
        t.forget(0, 1);
        t.forget(u64::MAX, 1);
        assert!(t.get(ROOT_ID).is_some());
        assert!(t.get(u64::MAX).is_none());
    }

    #[test]
    fn many_lookups_keep_the_table_bounded() {
        let t = Inodes::new(fd(), (1, 2));
        for round in 0..50u64 {
            let ids: Vec<u64> = (0..100)
                .map(|i| t.insert(fd(), (2, round * 1000 + i), libc::S_IFREG).0)
                .collect();
            for id in ids {
                t.forget(id, 1);
            }
        }
        assert!(t.is_empty());
        assert!(t.lock().slots.len() <= 102, "slots are reused");
    }
}
