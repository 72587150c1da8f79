//! The inode table: every node the kernel knows, keyed by the source's (device, inode) so one
//! file reached by several names (hard links) is one node, holding the inode and the kernel's
//! lookup count. A node lives while the kernel holds lookups on it: every successful LOOKUP,
//! CREATE, MKNOD, MKDIR, SYMLINK, LINK and READDIRPLUS entry adds one, FORGET and BATCH_FORGET
//! take them back, and at zero the node and what it held are gone. Memory and descriptors so
//! follow what the kernel caches, not how many lookups were ever made.
//!
//! A node holds its inode by an `O_PATH` descriptor while the export's descriptor budget
//! allows, and beyond it by a file handle ([`Held`]), so a tree larger than the process's
//! descriptor limit is served whole: the kernel may cache millions of entries, the limit here
//! is 20000.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};

use fuse_abi::ROOT_ID;

use crate::listing::Mark;
use crate::sys::{self, Errno, Handle};

/// How a node holds its inode.
#[derive(Debug)]
pub enum Held {
    /// An `O_PATH` descriptor: the inode itself, pinned while held.
    Fd(OwnedFd),
    /// A file handle, opened (`O_PATH`) for each request that needs a descriptor; `mount` is a
    /// descriptor of the filesystem it came from. `ESTALE` once the inode is gone.
    Handle {
        /// The filesystem's descriptor ([`sys::open_handle`]).
        mount: Arc<OwnedFd>,
        /// The handle.
        handle: Handle,
    },
}

/// One inode of the source tree.
#[derive(Debug)]
pub struct Inode {
    held: Held,
    /// `st_dev`, `st_ino`: the key.
    pub key: (u64, u64),
    /// `S_IFMT` bits: the type never changes.
    pub kind: u32,
    /// A directory's `crate::listing` mark.
    pub listed: Mark,
    /// A directory's files looked up by name, for the read-ahead ([`crate::ahead`]).
    pub lookups: crate::ahead::Lookups,
}

/// A descriptor of a node's inode for one request: the node's own, or one opened from its
/// handle and closed when this is dropped (after the request's calls, ring ones included).
pub enum NodeFd<'a> {
    /// The node's held descriptor.
    Held(BorrowedFd<'a>),
    /// Opened from the node's handle for this request.
    Opened(OwnedFd),
}

impl AsFd for NodeFd<'_> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            NodeFd::Held(fd) => *fd,
            NodeFd::Opened(fd) => fd.as_fd(),
        }
    }
}

impl AsRawFd for NodeFd<'_> {
    fn as_raw_fd(&self) -> RawFd {
        self.as_fd().as_raw_fd()
    }
}

impl Inode {
    /// An `O_PATH` descriptor of the inode, for as long as the result lives.
    pub fn fd(&self) -> Result<NodeFd<'_>, Errno> {
        match &self.held {
            Held::Fd(fd) => Ok(NodeFd::Held(fd.as_fd())),
            Held::Handle { mount, handle } => {
                sys::open_handle(mount.as_fd(), handle, libc::O_PATH).map(NodeFd::Opened)
            }
        }
    }

    /// Whether it is held by a descriptor (not a handle).
    pub fn pinned(&self) -> bool {
        matches!(self.held, Held::Fd(_))
    }

    /// Whether it is a directory.
    pub fn is_dir(&self) -> bool {
        self.kind == libc::S_IFDIR
    }
}

/// One node as a `fusex restart` successor takes it over ([`Inodes::entries`]): everything
/// the table holds of it but its descriptor, which travels beside (a node held by handle has
/// none).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NodeEntry {
    /// The node id the kernel knows it by.
    pub id: u64,
    /// `st_dev`, `st_ino`.
    pub key: (u64, u64),
    /// `S_IFMT` bits.
    pub kind: u32,
    /// Lookups the kernel holds.
    pub nlookup: u64,
    /// The generation it was answered with.
    pub generation: u64,
    /// Whether lookups of its key find it (a node of a reused inode number does not).
    pub keyed: bool,
    /// Its file handle (type, bytes), when it is held by one; else its descriptor is the next
    /// one sent.
    pub handle: Option<(i32, Vec<u8>)>,
}

/// What the table holds for a key already ([`Inodes::peek`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peek {
    /// No node.
    Absent,
    /// A node holding a descriptor: the same inode for sure.
    Pinned,
    /// A node holding a handle: the same inode only if the handles match (the inode number may
    /// have been reused since).
    Named,
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
    /// Nodes holding a descriptor (the root included).
    pinned: usize,
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
                held: Held::Fd(root),
                key,
                kind: libc::S_IFDIR,
                listed: Mark::default(),
                lookups: Default::default(),
            }),
            nlookup: 1,
            generation: 0,
        }));
        t.by_key.insert(key, ROOT_ID as usize);
        t.pinned = 1;
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

    /// What the table holds for `key` now, and how many nodes hold a descriptor.
    pub fn peek(&self, key: (u64, u64)) -> (Peek, usize) {
        let t = self.lock();
        let p = match t.by_key.get(&key).and_then(|&i| t.slots[i].as_ref()) {
            None => Peek::Absent,
            Some(s) if s.inode.pinned() => Peek::Pinned,
            Some(_) => Peek::Named,
        };
        (p, t.pinned)
    }

    /// Nodes holding a descriptor.
    pub fn pinned(&self) -> usize {
        self.lock().pinned
    }

    /// Adds one lookup of the inode `held` (of `key` and type `kind`): the node already holding
    /// that inode (and `held` is dropped), or a new one. A node of the same key holding another
    /// handle is of an inode gone since, whose number the source reused: the key then names
    /// the new node, and the old one lives on, unreachable by lookups, until forgotten.
    /// Returns (node id, generation).
    pub fn insert(&self, held: Held, key: (u64, u64), kind: u32) -> (u64, u64) {
        let mut t = self.lock();
        if let Some(&i) = t.by_key.get(&key) {
            if let Some(s) = t.slots[i].as_mut() {
                let same = match (&s.inode.held, &held) {
                    (Held::Handle { handle: a, .. }, Held::Handle { handle: b, .. }) => a == b,
                    // A descriptor pins the inode, so its number is not reused meanwhile; a
                    // descriptor racing a handle node (the budget changed) is taken as the same.
                    _ => true,
                };
                if same {
                    s.nlookup = s.nlookup.saturating_add(1);
                    return (i as u64, s.generation);
                }
            }
        }
        t.generation += 1;
        if matches!(held, Held::Fd(_)) {
            t.pinned += 1;
        }
        let slot = Slot {
            inode: Arc::new(Inode {
                held,
                key,
                kind,
                listed: Mark::default(),
                lookups: Default::default(),
            }),
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
        if s.inode.pinned() {
            t.pinned -= 1;
        }
        let gone = t.slots[i].take();
        if t.by_key.get(&key) == Some(&i) {
            t.by_key.remove(&key);
        }
        t.free.push(i);
        // The descriptor is closed after the table is free again: the last close of an unlinked
        // file evicts its inode, which can wait for the device (ext4 with `discard` issues the
        // discard then and waits for it), and every queue's lookups need the table.
        drop(t);
        drop(gone);
    }

    /// Every node but the root, and the descriptors of those held by one (in the order of the
    /// entries), and the generation counter: what a `fusex restart` successor needs to go on
    /// answering the node ids the kernel holds. Only once no request is served any more.
    pub fn entries(&self) -> (Vec<NodeEntry>, Vec<RawFd>, u64) {
        let t = self.lock();
        let mut nodes = Vec::with_capacity(t.slots.len());
        let mut fds = Vec::new();
        for (i, s) in t.slots.iter().enumerate().skip(ROOT_ID as usize + 1) {
            let Some(s) = s else { continue };
            let handle = match &s.inode.held {
                Held::Fd(fd) => {
                    fds.push(fd.as_raw_fd());
                    None
                }
                Held::Handle { handle, .. } => {
                    let (kind, bytes) = handle.parts();
                    Some((kind, bytes.to_vec()))
                }
            };
            nodes.push(NodeEntry {
                id: i as u64,
                key: s.inode.key,
                kind: s.inode.kind,
                nlookup: s.nlookup,
                generation: s.generation,
                keyed: t.by_key.get(&s.inode.key) == Some(&i),
                handle,
            });
        }
        (nodes, fds, t.generation)
    }

    /// Takes over the nodes a predecessor held ([`Inodes::entries`]) into this table, which
    /// holds only the root: `fds` are the descriptors of the entries without a handle, in
    /// order; `mount` opens the handles. Each descriptor must be of its entry's inode, and no
    /// id above `max_id` (the table stays the size its configuration bounds).
    pub fn adopt(
        &self,
        entries: Vec<NodeEntry>,
        fds: &mut impl Iterator<Item = OwnedFd>,
        generation: u64,
        mount: Option<&Arc<OwnedFd>>,
        max_id: usize,
    ) -> Result<(), String> {
        let mut t = self.lock();
        if t.slots.len() != ROOT_ID as usize + 1 {
            return Err("the table holds more than the root".into());
        }
        for e in entries {
            let i = usize::try_from(e.id)
                .ok()
                .filter(|&i| i > ROOT_ID as usize && i <= max_id)
                .ok_or_else(|| format!("node id {} is not one fusex gives", e.id))?;
            if t.slots.get(i).is_some_and(|s| s.is_some()) {
                return Err(format!("node {} twice", e.id));
            }
            let held = match e.handle {
                Some((kind, bytes)) => Held::Handle {
                    mount: mount
                        .ok_or("nodes held by file handle, which this process cannot open")?
                        .clone(),
                    handle: sys::Handle::from_parts(kind, &bytes)
                        .ok_or("a file handle longer than any")?,
                },
                None => {
                    let fd = fds.next().ok_or("fewer descriptors than nodes")?;
                    let st = sys::stat_fd(fd.as_fd())
                        .map_err(|e| std::io::Error::from_raw_os_error(e).to_string())?;
                    if (st.st_dev, st.st_ino) != e.key {
                        return Err(format!(
                            "the descriptor of node {} is of another inode",
                            e.id
                        ));
                    }
                    t.pinned += 1;
                    Held::Fd(fd)
                }
            };
            if t.slots.len() <= i {
                t.slots.resize_with(i + 1, || None);
            }
            t.slots[i] = Some(Slot {
                inode: Arc::new(Inode {
                    held,
                    key: e.key,
                    kind: e.kind,
                    listed: Mark::default(),
                    lookups: Default::default(),
                }),
                nlookup: e.nlookup.max(1),
                generation: e.generation,
            });
            if e.keyed {
                t.by_key.insert(e.key, i);
            }
        }
        let t = &mut *t;
        t.free = (ROOT_ID as usize + 1..t.slots.len())
            .filter(|&i| t.slots[i].is_none())
            .collect();
        t.generation = t.generation.max(generation);
        Ok(())
    }

    /// Nodes held (the root included), for tests and statistics.
    pub fn len(&self) -> usize {
        let t = self.lock();
        t.slots.len() - 1 - t.free.len()
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
        let (a, ga) = t.insert(Held::Fd(fd()), (1, 10), libc::S_IFREG);
        assert_ne!(a, ROOT_ID);
        // The same inode by another name is the same node.
        assert_eq!(t.insert(Held::Fd(fd()), (1, 10), libc::S_IFREG), (a, ga));
        let (b, gb) = t.insert(Held::Fd(fd()), (1, 11), libc::S_IFDIR);
        assert_ne!(a, b);
        assert_eq!(t.len(), 3);
        t.forget(a, 1);
        assert!(t.get(a).is_some(), "one lookup left");
        t.forget(a, 1);
        assert!(t.get(a).is_none());
        // The slot is reused with a new generation.
        let (c, gc) = t.insert(Held::Fd(fd()), (1, 12), libc::S_IFREG);
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

    /// A handle node is the same node only for the same handle: an inode number reused by a new
    /// inode gets a new node, and the old one is forgotten without disturbing it.
    #[test]
    fn handle_nodes_are_matched_by_handle() {
        let dir = tempfile::tempdir().unwrap();
        let path = |n: &str| {
            std::fs::write(dir.path().join(n), n).unwrap();
            let f: OwnedFd = std::fs::File::open(dir.path().join(n)).unwrap().into();
            sys::handle_of(f.as_fd()).unwrap()
        };
        let mount = Arc::new(fd());
        let held = |h| Held::Handle {
            mount: mount.clone(),
            handle: h,
        };
        let t = Inodes::new(fd(), (1, 2));
        let (a, _) = t.insert(held(path("a")), (9, 1), libc::S_IFREG);
        assert_eq!(t.peek((9, 1)).0, Peek::Named);
        assert_eq!(t.insert(held(path("a")), (9, 1), libc::S_IFREG).0, a);
        let (b, _) = t.insert(held(path("b")), (9, 1), libc::S_IFREG);
        assert_ne!(a, b, "another inode under a reused number is another node");
        assert_eq!(t.len(), 3);
        assert_eq!(t.pinned(), 1, "only the root holds a descriptor");
        t.forget(a, 2);
        assert!(t.get(b).is_some());
        assert_eq!(t.insert(held(path("b")), (9, 1), libc::S_IFREG).0, b);
        t.forget(b, 2);
        assert!(t.is_empty());
        assert_eq!(t.peek((9, 1)).0, Peek::Absent);
        t.insert(Held::Fd(fd()), (9, 1), libc::S_IFREG);
        assert_eq!(t.peek((9, 1)), (Peek::Pinned, 2));
    }

    #[test]
    fn many_lookups_keep_the_table_bounded() {
        let t = Inodes::new(fd(), (1, 2));
        for round in 0..50u64 {
            let ids: Vec<u64> = (0..100)
                .map(|i| {
                    t.insert(Held::Fd(fd()), (2, round * 1000 + i), libc::S_IFREG)
                        .0
                })
                .collect();
            for id in ids {
                t.forget(id, 1);
            }
        }
        assert!(t.is_empty());
        assert!(t.lock().slots.len() <= 102, "slots are reused");
    }
}
