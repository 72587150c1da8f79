//! The in-memory block table: one atomic word per guest block, read without a lock by every
//! queue and changed only by the allocator (and a format's own hooks) under the block's lock.

use std::sync::atomic::{AtomicU64, Ordering};

/// Most entries a table holds: 8 Mi entries, 64 MiB of memory. Every format fusex serves this
/// way fits real images in it (a VHD's 2040 GiB in 2 MiB blocks needs 1 Mi, a VDI of 8 TiB in
/// 1 MiB blocks 8 Mi); a header asking for more is refused rather than believed.
pub const MAX_ENTRIES: u64 = 1 << 23;

/// Host offsets an [`Entry::Data`] can hold: below 2^54 (16 PiB), far beyond any format's own
/// limit; the top bits of the word carry the kind and flags.
pub const MAX_HOST: u64 = 1 << HOST_BITS;

const HOST_BITS: u32 = 54;
const FLAG_SHIFT: u32 = HOST_BITS;
const KIND_SHIFT: u32 = 62;
const KIND_ZERO: u64 = 1;
const KIND_DATA: u64 = 2;
const KIND_BAD: u64 = 3;

/// Where one guest block's bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// Not allocated: reads as zeroes; the first write allocates it.
    Unallocated,
    /// Allocated nowhere but known to read as zeroes (VDI's discarded blocks); the first
    /// write allocates it, as for [`Entry::Unallocated`].
    Zero,
    /// The block's footprint starts at file offset `host` (below [`MAX_HOST`]). `flags` is the
    /// format's own state of the block (VHD: whether its sector bitmap is known to be full);
    /// 0 means "plain": the core reads and writes it directly, anything else goes through the
    /// format's hooks.
    Data {
        /// File offset of the block's footprint (see [`super::BlockFormat::data_at`]).
        host: u64,
        /// The format's state of the block; 0 is plain.
        flags: u8,
    },
    /// The table entry is invalid (points outside the file, into metadata, or at another
    /// block's space): every request touching the block fails with EIO, and nothing is ever
    /// written where it points.
    Bad,
}

impl Entry {
    fn encode(self) -> u64 {
        match self {
            Entry::Unallocated => 0,
            Entry::Zero => KIND_ZERO << KIND_SHIFT,
            Entry::Data { host, flags } if host < MAX_HOST => {
                (KIND_DATA << KIND_SHIFT) | (u64::from(flags) << FLAG_SHIFT) | host
            }
            Entry::Data { .. } | Entry::Bad => KIND_BAD << KIND_SHIFT,
        }
    }

    fn decode(w: u64) -> Entry {
        match w >> KIND_SHIFT {
            0 => Entry::Unallocated,
            KIND_ZERO => Entry::Zero,
            KIND_DATA => Entry::Data {
                host: w & (MAX_HOST - 1),
                flags: (w >> FLAG_SHIFT) as u8,
            },
            _ => Entry::Bad,
        }
    }
}

/// A table asks for more entries than [`MAX_ENTRIES`].
#[derive(Debug, thiserror::Error)]
#[error(
    "its block table would need {entries} entries ({} MiB of memory), more than fusex holds \
     ({MAX_ENTRIES} entries): the header is corrupt, or the image is too large to serve",
    entries.saturating_mul(8) >> 20
)]
pub struct TooLarge {
    /// Entries the header asks for.
    pub entries: u64,
}

/// Every block's [`Entry`], shared by all queues.
pub struct Table {
    words: Box<[AtomicU64]>,
}

impl Table {
    /// A table of `len` unallocated entries, or [`TooLarge`] past [`MAX_ENTRIES`].
    pub fn new(len: u64) -> Result<Table, TooLarge> {
        if len > MAX_ENTRIES {
            return Err(TooLarge { entries: len });
        }
        Ok(Table {
            words: (0..len).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// Number of entries.
    pub fn len(&self) -> u64 {
        self.words.len() as u64
    }

    /// Whether the table has no entries (a zero-sized image).
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// Entry `i`; [`Entry::Bad`] past the end (never a panic).
    pub fn get(&self, i: u64) -> Entry {
        match usize::try_from(i).ok().and_then(|i| self.words.get(i)) {
            Some(w) => Entry::decode(w.load(Ordering::Acquire)),
            None => Entry::Bad,
        }
    }

    /// Sets entry `i` (ignored past the end). Publishing an allocated block happens here, after
    /// its data and its on-disk entry were written.
    pub fn set(&self, i: u64, e: Entry) {
        if let Some(w) = usize::try_from(i).ok().and_then(|i| self.words.get(i)) {
            w.store(e.encode(), Ordering::Release);
        }
    }

    /// Sets entry `i` to `new` if it still is `old`; whether it did.
    pub fn replace(&self, i: u64, old: Entry, new: Entry) -> bool {
        match usize::try_from(i).ok().and_then(|i| self.words.get(i)) {
            Some(w) => w
                .compare_exchange(
                    old.encode(),
                    new.encode(),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok(),
            None => false,
        }
    }

    /// Entries that are [`Entry::Data`].
    pub fn count_data(&self) -> u64 {
        self.words
            .iter()
            .filter(|w| matches!(Entry::decode(w.load(Ordering::Relaxed)), Entry::Data { .. }))
            .count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip() {
        let t = Table::new(4).unwrap();
        assert_eq!(t.get(0), Entry::Unallocated);
        for e in [
            Entry::Zero,
            Entry::Data {
                host: 0x1234_5600,
                flags: 0,
            },
            Entry::Data {
                host: MAX_HOST - 512,
                flags: 0xff,
            },
            Entry::Bad,
            Entry::Unallocated,
        ] {
            t.set(1, e);
            assert_eq!(t.get(1), e);
        }
        // A host offset the word cannot hold is never silently truncated.
        t.set(
            2,
            Entry::Data {
                host: MAX_HOST,
                flags: 0,
            },
        );
        assert_eq!(t.get(2), Entry::Bad);
        assert_eq!(t.get(4), Entry::Bad, "past the end");
        assert_eq!(t.get(u64::MAX), Entry::Bad);
        t.set(99, Entry::Zero); // ignored, no panic
        assert_eq!(t.count_data(), 0);
    }

    #[test]
    fn replace_only_from_the_expected_entry() {
        let t = Table::new(1).unwrap();
        let d = Entry::Data {
            host: 4096,
            flags: 1,
        };
        t.set(0, d);
        assert!(!t.replace(0, Entry::Unallocated, Entry::Zero));
        assert!(t.replace(
            0,
            d,
            Entry::Data {
                host: 4096,
                flags: 0
            }
        ));
        assert_eq!(t.count_data(), 1);
    }

    #[test]
    fn absurd_tables_are_refused() {
        assert!(Table::new(MAX_ENTRIES).is_ok());
        let e = Table::new(MAX_ENTRIES + 1).err().unwrap();
        assert!(e.to_string().contains("more than fusex holds"), "{e}");
        assert!(Table::new(u64::MAX).is_err());
    }
}
