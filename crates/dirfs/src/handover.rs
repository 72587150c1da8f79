//! A directory export handed to a `fusex restart` successor. The kernel names what it holds of
//! the export by node ids and open handles, which stand for descriptors only this process has;
//! so the successor gets the tables themselves: every node (its id, inode, lookup count,
//! generation, and its descriptor or file handle) and every open handle (its slot, generation,
//! passthrough backing id and descriptor), the descriptors travelling beside the table
//! (`SCM_RIGHTS`). Passthrough backing ids belong to the connection, which the successor shares,
//! so they stay valid. What is only a cache (listing marks, the read-ahead's lookups and parked
//! directories) starts afresh.

use std::os::fd::{OwnedFd, RawFd};
use std::path::Path;
use std::sync::atomic::Ordering;

use fuse_abi::ROOT_ID;

use crate::files::FileEntry;
use crate::inodes::NodeEntry;
use crate::{DirConfig, DirError, DirFs};

/// What a successor needs besides the descriptors ([`DirFs::handover`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DirHandover {
    /// The source root's (`st_dev`, `st_ino`): the successor must open the same directory.
    pub root: (u64, u64),
    /// The node table's generation counter.
    pub generation: u64,
    /// Every node but the root; those without a handle take the first descriptors, in order.
    pub nodes: Vec<NodeEntry>,
    /// Every open handle; each takes the next descriptor, after the nodes'.
    pub files: Vec<FileEntry>,
    /// The first handle slot never handed out.
    pub file_slots: u32,
    /// Passthrough backing ids in use: (id, inode, opens using it).
    pub backings: Vec<(i32, (u64, u64), u64)>,
    /// Open handles answered minus released.
    pub open_files: u64,
}

impl DirHandover {
    /// How many descriptors travel with it.
    pub fn descriptors(&self) -> usize {
        self.nodes.iter().filter(|n| n.handle.is_none()).count() + self.files.len()
    }
}

impl DirFs {
    /// The tables a successor takes over, and the descriptors that go with them (borrowed:
    /// they stay this export's, open until it is dropped). Only once no request is served any
    /// more (the queues have let go), or the tables change under the copy.
    pub fn handover(&self) -> (DirHandover, Vec<RawFd>) {
        let root = self.root().map_or((0, 0), |r| r.key);
        let (nodes, mut fds, generation) = self.inodes.entries();
        let (files, file_fds, file_slots) = self.files.entries();
        fds.extend(file_fds);
        let backings = {
            let b = self.backings.lock().unwrap_or_else(|p| p.into_inner());
            b.by_id
                .iter()
                .map(|(&id, &(key, n))| (id, key, n))
                .collect()
        };
        let h = DirHandover {
            root,
            generation,
            nodes,
            files,
            file_slots,
            backings,
            open_files: self.open_files.load(Ordering::Relaxed),
        };
        (h, fds)
    }

    /// Opens `path` as the export's root, as [`DirFs::open`] does, and takes over the tables a
    /// predecessor handed over with their descriptors `fds` (in the order of
    /// [`DirFs::handover`]). Refused when the source is another directory, the descriptors do
    /// not match, or the tables do not fit this configuration.
    pub fn take_over(
        path: &Path,
        cfg: DirConfig,
        h: DirHandover,
        fds: Vec<OwnedFd>,
    ) -> Result<DirFs, DirError> {
        let fs = DirFs::open(path, cfg)?;
        let refuse = |why: String| DirError::Handover(why);
        let root = fs.root().map_or((0, 0), |r| r.key);
        if root != h.root {
            return Err(refuse(format!(
                "{} is not the directory the old daemon served (another inode)",
                path.display()
            )));
        }
        if fds.len() != h.descriptors() {
            return Err(refuse(format!(
                "{} descriptors came for {} nodes and handles",
                fds.len(),
                h.descriptors()
            )));
        }
        let mut fds = fds.into_iter();
        let max_id = fs
            .cfg
            .max_nodes
            .saturating_mul(2)
            .saturating_add(ROOT_ID as usize + 1);
        fs.inodes
            .adopt(h.nodes, &mut fds, h.generation, fs.handles.as_ref(), max_id)
            .map_err(refuse)?;
        fs.files
            .adopt(h.files, &mut fds, h.file_slots)
            .map_err(refuse)?;
        {
            let mut b = fs.backings.lock().unwrap_or_else(|p| p.into_inner());
            for (id, key, n) in h.backings {
                b.by_inode.entry(key).or_insert(id);
                b.by_id.insert(id, (key, n));
            }
        }
        fs.open_files.store(h.open_files, Ordering::Relaxed);
        Ok(fs)
    }
}
