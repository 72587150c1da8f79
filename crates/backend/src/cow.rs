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
//! write. Entering shared costs one atomic add and one subtract (an [`IoGate`]).

use std::sync::Mutex;

use imago::io_buffers::IoBuffer;

use crate::gate::{IoGate, Shared};

/// Regions are hashed onto this many gates: enough that 64 writes in flight rarely share one.
const STRIPES: usize = 256;

/// Smallest region: a whole FUSE write (at most 1 MiB) then spans at most two regions.
const MIN_REGION_SHIFT: u32 = 20;

/// Whole-cluster buffers kept for reuse (copies ahead in flight at once beyond this allocate).
const POOLED_BUFFERS: usize = 16;

/// Shared/exclusive gates over regions of the guest address space (see the module docs).
pub struct RegionLocks {
    gates: Box<[IoGate]>,
    /// log2 of the region size: at least 1 MiB and at least one cluster, so a cluster never
    /// straddles two regions.
    shift: u32,
}

/// Proof that a write may run: the regions it touches, entered shared.
pub struct RegionsShared<'a> {
    _first: Shared<'a>,
    _second: Option<Shared<'a>>,
}

impl RegionLocks {
    /// Gates for an image with clusters of `1 << cluster_bits` bytes.
    pub fn new(cluster_bits: u32) -> RegionLocks {
        RegionLocks {
            gates: (0..STRIPES).map(|_| IoGate::default()).collect(),
            shift: cluster_bits.max(MIN_REGION_SHIFT),
        }
    }

    fn gate(&self, region: u64) -> (usize, &IoGate) {
        let i = (region % STRIPES as u64) as usize;
        (i, &self.gates[i])
    }

    fn regions(&self, off: u64, len: u64) -> (u64, u64) {
        let first = off >> self.shift;
        (first, off.saturating_add(len.max(1) - 1) >> self.shift)
    }

    /// Whether `off..off + len` spans more than two regions: more than [`Self::shared`] enters,
    /// so such a request must keep every other request out of the image instead.
    pub fn too_wide(&self, off: u64, len: u64) -> bool {
        let (first, last) = self.regions(off, len);
        last - first > 1
    }

    /// Enters the regions of `off..off + len` shared; `None` if the range is
    /// [`Self::too_wide`].
    pub async fn shared(&self, off: u64, len: u64) -> Option<RegionsShared<'_>> {
        let (first, last) = self.regions(off, len);
        if last - first > 1 {
            return None;
        }
        let (a, ga) = self.gate(first);
        if first == last {
            return Some(RegionsShared {
                _first: ga.shared().await,
                _second: None,
            });
        }
        let (b, gb) = self.gate(last);
        if a == b {
            // Only possible with fewer stripes than regions in the range: one gate covers both.
            return Some(RegionsShared {
                _first: ga.shared().await,
                _second: None,
            });
        }
        // Always in ascending gate order, so two such writes never wait on each other crosswise.
        let (lo, hi) = if a < b { (ga, gb) } else { (gb, ga) };
        let lo = lo.shared().await;
        let hi = hi.shared().await;
        Some(RegionsShared {
            _first: lo,
            _second: Some(hi),
        })
    }

    /// The gate of the region holding guest offset `off`, for a copy ahead to enter exclusive.
    pub fn region_of(&self, off: u64) -> &IoGate {
        self.gate(off >> self.shift).1
    }
}

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
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    fn poll_once<F: Future>(f: std::pin::Pin<&mut F>) -> Poll<F::Output> {
        f.poll(&mut Context::from_waker(Waker::noop()))
    }

    #[test]
    fn a_copy_ahead_excludes_writes_to_its_region_only() {
        // 64 KiB clusters: 1 MiB regions.
        let locks = RegionLocks::new(16);
        let mut ex = pin!(locks.region_of(5 << 20).exclusive());
        let ex = match poll_once(ex.as_mut()) {
            Poll::Ready(e) => e,
            Poll::Pending => panic!("an idle region must be entered"),
        };
        let mut same = pin!(locks.shared((5 << 20) + 4096, 4096));
        assert!(poll_once(same.as_mut()).is_pending(), "same region waits");
        // A write straddling regions 4 and 5 waits too; one in region 6 does not.
        assert!(poll_once(pin!(locks.shared((5 << 20) - 512, 1024))).is_pending());
        assert!(poll_once(pin!(locks.shared(6 << 20, 4096))).is_ready());
        drop(ex);
        assert!(poll_once(same.as_mut()).is_ready());
    }

    #[test]
    fn a_range_over_more_than_two_regions_is_refused() {
        let locks = RegionLocks::new(16);
        match poll_once(pin!(locks.shared(1 << 20, 2 << 20))) {
            Poll::Ready(r) => assert!(r.is_some(), "two regions"),
            Poll::Pending => panic!("idle"),
        }
        match poll_once(pin!(locks.shared((1 << 20) - 1, (2 << 20) + 2))) {
            Poll::Ready(r) => assert!(r.is_none(), "three regions"),
            Poll::Pending => panic!("idle"),
        };
    }

    #[test]
    fn regions_are_at_least_one_cluster() {
        // 2 MiB clusters: a cluster never straddles two regions.
        let locks = RegionLocks::new(21);
        assert!(std::ptr::eq(
            locks.region_of(2 << 20),
            locks.region_of((4 << 20) - 1)
        ));
        assert!(!std::ptr::eq(
            locks.region_of((2 << 20) - 1),
            locks.region_of(2 << 20)
        ));
    }

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
