//! Metadata overlap checks (fusex patch).
//!
//! A writable image keeps the set of host clusters that hold its metadata.  No cluster in it may
//! be handed out by the allocator, and no guest data write may land in it: a damaged refcount or
//! L2 entry would otherwise turn an ordinary write into the destruction of the image's own
//! tables.  On a violation the image is marked corrupt (the header's incompatible feature bit 1,
//! so other tools see it too), the request fails, and every later write is refused; the header is
//! not written again.

use super::*;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use tracing::error;

/// The start of the message of every error an overlap check raises, so callers can tell it from
/// other I/O errors.
pub const CORRUPTION_PREFIX: &str = "Preventing invalid write on metadata";

/// What a metadata cluster holds (for messages).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum MetaKind {
    /// The image header (and its extensions).
    Header,
    /// The active L1 table.
    L1,
    /// The refcount table.
    RefTable,
    /// A refcount block.
    RefBlock,
    /// An L2 table.
    L2,
    /// Metadata allocated while the image is open, or named by the caller.
    Other,
}

/// The metadata clusters of one image, and whether it has been found corrupt.
#[derive(Default)]
pub(super) struct Overlap {
    /// First cluster of each metadata range, with its cluster count and kind.
    ranges: parking_lot::RwLock<BTreeMap<u64, (u64, MetaKind)>>,
    /// Set once a violation was found; writes are refused from then on.
    corrupt: AtomicBool,
}

impl Overlap {
    /// Records `count` clusters from `first` as metadata of `kind`.
    pub fn insert(&self, first: HostCluster, count: ClusterCount, kind: MetaKind) {
        if count.0 > 0 {
            self.ranges.write().insert(first.0, (count.0, kind));
        }
    }

    /// Forgets every range (before the image's metadata is reloaded).
    pub fn clear(&self) {
        self.ranges.write().clear();
    }

    /// Forgets the metadata range starting at `first` (it has been freed).
    pub fn remove(&self, first: HostCluster) {
        self.ranges.write().remove(&first.0);
    }

    /// The metadata range overlapping clusters `[first, first + count)`, if any.
    pub fn find(&self, first: u64, count: u64) -> Option<(u64, MetaKind)> {
        let end = first.saturating_add(count);
        let ranges = self.ranges.read();
        // The last range starting before `end` is the only one that can reach into it from the
        // left; ranges are disjoint.
        let (&start, &(len, kind)) = ranges.range(..end).next_back()?;
        (start.saturating_add(len) > first).then_some((start, kind))
    }

    /// Whether a violation was found.
    pub fn is_corrupt(&self) -> bool {
        self.corrupt.load(Ordering::Acquire)
    }

    /// Checks that clusters `[first, first + count)` hold no metadata; on a violation marks the
    /// image corrupt and returns the error to fail the request with.  `what` names the write.
    pub async fn check<S: Storage>(
        &self,
        file: &S,
        cluster_bits: u32,
        first: u64,
        count: u64,
        what: &str,
    ) -> io::Result<()> {
        match self.find(first, count) {
            None => Ok(()),
            Some((start, kind)) => {
                let msg = format!(
                    "{what} at host offset {} overlaps {kind:?} metadata at offset {}",
                    first << cluster_bits,
                    start << cluster_bits
                );
                Err(self.signal(file, msg).await)
            }
        }
    }

    /// Marks the image corrupt (once: the header is written at most one time) and returns the
    /// error for the request that found it.
    pub async fn signal<S: Storage>(&self, file: &S, msg: String) -> io::Error {
        // The caller reports the error (once); this only marks the image.
        if !self.corrupt.swap(true, Ordering::AcqRel) {
            if let Err(err) = set_corrupt_bit(file).await {
                error!("Cannot set the corrupt bit in the image header: {err}");
            }
        }
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{CORRUPTION_PREFIX}: {msg}; the image is marked corrupt"),
        )
    }

    /// Fails once the image has been found corrupt.
    pub fn need_intact(&self) -> io::Result<()> {
        if self.is_corrupt() {
            Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{CORRUPTION_PREFIX}: the image is marked corrupt; no more writes"),
            ))
        } else {
            Ok(())
        }
    }
}

/// Sets incompatible feature bit 1 ("corrupt") in a version 3 header; version 2 headers have no
/// such bit, and the image is then only refused for writing in memory.
async fn set_corrupt_bit<S: Storage>(file: &S) -> io::Result<()> {
    let mut version = [0u8; 8];
    file.read(&mut version[..], 0).await?;
    if u32::from_be_bytes([version[4], version[5], version[6], version[7]]) < 3 {
        return Ok(());
    }
    let mut features = [0u8; 8];
    file.read(&mut features[..], 72).await?;
    let v = u64::from_be_bytes(features) | (1 << 1);
    file.write(&v.to_be_bytes()[..], 72).await?;
    file.sync().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn find_reports_any_overlap_and_nothing_else() {
        let o = Overlap::default();
        o.insert(HostCluster(0), ClusterCount(1), MetaKind::Header);
        o.insert(HostCluster(3), ClusterCount(2), MetaKind::L1);
        o.insert(HostCluster(10), ClusterCount(1), MetaKind::L2);
        assert_eq!(o.find(0, 1), Some((0, MetaKind::Header)));
        assert_eq!(o.find(1, 2), None);
        assert_eq!(o.find(2, 2), Some((3, MetaKind::L1)));
        assert_eq!(o.find(4, 1), Some((3, MetaKind::L1)));
        assert_eq!(o.find(5, 5), None);
        assert_eq!(o.find(5, 6), Some((10, MetaKind::L2)));
        o.remove(HostCluster(10));
        assert_eq!(o.find(5, 6), None);
    }
}
