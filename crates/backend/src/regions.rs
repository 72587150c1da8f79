//! Shared/exclusive locks over regions of an image's address space, across queue threads.
//!
//! Used where a write must read bytes before it writes them and no other write may land on
//! those bytes in between: qcow2's copy ahead of a backed cluster (see [`crate::cow`]) and the
//! NBD client's read-modify-write of blocks a request covers only partly (the server takes only
//! whole blocks of its minimum size). Every write enters the region(s) it touches shared (one
//! atomic add and one subtract per gate, an [`IoGate`]); a read-modify-write enters its block's
//! region exclusive, so no other write to that region runs between its read and its write.
//! Regions are hashed onto a fixed number of gates; several gates are always entered in
//! ascending order, and an exclusive holder holds only its one gate, so waits never form a cycle.

use crate::gate::{IoGate, Shared};

/// Regions are hashed onto this many gates: enough that 64 writes in flight rarely share one.
const STRIPES: usize = 256;

/// Smallest region: a whole FUSE write (at most 1 MiB) then spans at most two regions.
const MIN_REGION_SHIFT: u32 = 20;

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

/// Proof that a write of any width may run: every gate its regions hash onto, entered shared.
pub struct RangeShared<'a> {
    /// At most two regions (any write of a FUSE request): no allocation.
    _few: Option<RegionsShared<'a>>,
    /// More (a zeroed range).
    _many: Vec<Shared<'a>>,
}

impl RegionLocks {
    /// Enters the regions of `off..off + len` shared, however many: up to two as
    /// [`Self::shared`] does; more (a zeroed range) allocate the list of gates held. Gates are
    /// entered in ascending order.
    pub async fn shared_range(&self, off: u64, len: u64) -> RangeShared<'_> {
        if let Some(few) = self.shared(off, len).await {
            return RangeShared {
                _few: Some(few),
                _many: Vec::new(),
            };
        }
        let (first, last) = self.regions(off, len);
        let n = STRIPES as u64;
        let mut held = Vec::new();
        let (a, b) = ((first % n) as usize, (last % n) as usize);
        let (low, high) = if last - first + 1 >= n {
            (0..STRIPES, 0..0)
        } else if a <= b {
            (a..b + 1, 0..0)
        } else {
            // The range wraps around the stripes: the low ones first.
            (0..b + 1, a..STRIPES)
        };
        for i in low.chain(high) {
            held.push(self.gates[i].shared().await);
        }
        RangeShared {
            _few: None,
            _many: held,
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
    fn a_wide_range_waits_for_an_exclusive_region_inside_it() {
        let locks = RegionLocks::new(9);
        let ex = match poll_once(pin!(locks.region_of(300 << 20).exclusive())) {
            Poll::Ready(e) => e,
            Poll::Pending => panic!("idle"),
        };
        // 1 GiB from 0: every stripe, region 300's too.
        let mut wide = pin!(locks.shared_range(0, 1 << 30));
        assert!(poll_once(wide.as_mut()).is_pending());
        // Regions 250..=260 wrap around the stripes and miss region 300's (stripe 44).
        assert!(poll_once(pin!(locks.shared_range(250 << 20, 11 << 20))).is_ready());
        // Regions 290..=310 do not.
        assert!(poll_once(pin!(locks.shared_range(290 << 20, 21 << 20))).is_pending());
        drop(ex);
        assert!(poll_once(wide.as_mut()).is_ready());
    }
}
