//! Copy-on-write ahead of imago for writes into clusters a qcow2 image still takes from its
//! backing file.
//!
//! imago copies a backed cluster into the image while it holds the cluster's L2 table locked for
//! writing: it reads the cluster from the backing file, writes it into the new cluster, then
//! writes the guest data, three ring round trips during which no other allocating write under
//! that L2 table (512 MiB of guest space with 64 KiB clusters) can run. A partial write into
//! such a cluster is therefore turned into a whole-cluster write here: the cluster's current
//! bytes are read *before* imago is called (reads take no lock), the guest data is laid over
//! them, and imago gets a write of the full cluster, which needs no copy at all. Only the
//! allocation and one write remain inside imago's lock.
//!
//! Reading the old bytes outside imago's lock opens a window in which another write to the same
//! cluster could land and then be overwritten by the stale copy. [`RegionLocks`] closes it: every
//! write enters the region(s) it touches shared, and a write that copies ahead enters its
//! cluster's region exclusive, so no other write of that cluster runs between its read and its
//! write. Entering shared costs one atomic add and one subtract (an `IoGate`).

use std::sync::Mutex;

use imago::io_buffers::IoBuffer;

pub use crate::regions::RegionLocks;

/// Whole-cluster buffers kept for reuse (copies ahead in flight at once beyond this allocate).
const POOLED_BUFFERS: usize = 16;

/// Whole-cluster buffers for copies ahead, reused so that filling an overlay does not allocate
/// per write. The lock is taken twice per copy ahead (never per ordinary write), never across
/// an await.
pub struct ClusterBuffers {
    size: usize,
    align: usize,
    free: Mutex<Vec<IoBuffer>>,
}

impl ClusterBuffers {
    /// Buffers of `size` bytes aligned to `align` (the image's memory alignment, for O_DIRECT).
    pub fn new(size: usize, align: usize) -> ClusterBuffers {
        ClusterBuffers {
            size,
            align: align.max(1),
            free: Mutex::new(Vec::new()),
        }
    }

    /// A buffer from the pool, or a new one.
    pub fn take(&self) -> std::io::Result<IoBuffer> {
        let pooled = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop();
        match pooled {
            Some(b) => Ok(b),
            None => IoBuffer::new(self.size, self.align),
        }
    }

    /// Returns a buffer to the pool (dropped if the pool is full).
    pub fn put(&self, buf: IoBuffer) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < POOLED_BUFFERS {
            free.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused() {
        let pool = ClusterBuffers::new(65536, 4096);
        let a = pool.take().unwrap();
        assert_eq!(a.len(), 65536);
        let p = a.as_ref().into_slice().as_ptr();
        pool.put(a);
        let b = pool.take().unwrap();
        assert_eq!(b.as_ref().into_slice().as_ptr(), p);
    }
}
