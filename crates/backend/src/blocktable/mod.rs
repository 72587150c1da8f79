//! The shared core of "block allocation table" formats: VHD (`vpc`) and VDI, and built to carry
//! VMDK's grain tables and VHDX's BAT as well.
//!
//! # The model
//!
//! The guest disk is cut into blocks of `1 << block_shift` bytes (a power of two). Block `i`'s
//! [`Entry`] in a [`Table`] says where its bytes are: nowhere (reads zeroes), at a file offset
//! (`host`, where the block's *footprint* starts: VHD puts a sector bitmap before the data), or
//! nowhere because the on-disk entry is invalid (every request touching it fails with EIO,
//! nothing is ever written where it points). The whole table lives in memory, one atomic word
//! per block, bounded by [`MAX_ENTRIES`]: the format reads it once at open, checks every entry
//! (inside the file, clear of metadata and of other blocks) and marks the bad ones
//! [`Entry::Bad`].
//!
//! # What a format supplies: [`BlockFormat`]
//!
//! - [`BlockFormat::footprint`] and [`BlockFormat::data_at`]: the file bytes one block takes
//!   and where its guest data starts in them;
//! - [`BlockFormat::reserve`]: make the file hold a newly reserved footprint at its end (VHD
//!   writes its footer copy after it, VDI extends the file);
//! - [`BlockFormat::prepare`]: per-block metadata before the data (VHD's sector bitmap);
//! - [`BlockFormat::commit`]: write the block's table entry (two levels for VMDK: it may
//!   allocate a grain table first, under its own lock);
//! - for blocks whose entry carries non-zero `flags`, [`BlockFormat::read_flagged`] and
//!   [`BlockFormat::write_flagged`] (VHD: a sector bitmap that is not known to be full; VHDX:
//!   a differencing image's partially present blocks, read only);
//! - for unallocated blocks, [`BlockFormat::read_unallocated`] (zeroes, or a differencing
//!   image's parent) and [`BlockFormat::unallocated_is_data`] for block status.
//!
//! [`TableImage`] does the rest and is the [`BlockBackend`] the export sees: splitting requests
//! by block, merging reads of consecutive blocks that are contiguous in the file into one
//! transfer, zeroes for unallocated blocks, allocation, zeroing, block status, `st_blocks`. All
//! I/O goes through [`RingFile`], so it runs on the calling queue's ring (inline on tmpfs while
//! the queue is otherwise idle) and a read lands in the request's own buffer.
//!
//! # Allocation and crash consistency
//!
//! The first write into an unallocated block:
//!
//! 1. takes the block's allocation lock (`RegionLocks`, exclusive on the block's region) and
//!    looks for an allocation of the block under way, then at the entry again: a write that
//!    raced with it finds the block allocated and just writes into it, so a block is never
//!    allocated twice;
//! 2. under the image-wide allocator lock, reserves [`BlockFormat::footprint`] bytes at the
//!    end of the image (`next_free`) and lets [`BlockFormat::reserve`] make the file hold them
//!    (the lock is held for that one step only, so file-end metadata such as VHD's footer copy is
//!    always written in allocation order); announces the allocation and leaves the block's lock;
//! 3. [`BlockFormat::prepare`] and the guest data at once, both completing before
//! 4. [`BlockFormat::commit`] writes the on-disk entry, and only then is the block published in
//!    the in-memory table and the allocation withdrawn.
//!
//! Other writes into the block meanwhile (a sequential writer keeps several in flight in one
//! block) find the allocation under way and write their data into the reserved space at once,
//! then wait for the entry to be published before they complete, so a read issued after any
//! write completed finds its bytes. They do not wait for the 3-4 steps above to start their own
//! transfer; if the reserved space is not fresh they wait for the entry first (the allocator
//! zeroes it), and if the allocation failed they start again from the entry.
//!
//! A crash therefore never leaves an entry that points at bytes the format did not write: before
//! step 4 the entry still says unallocated (the reserved space is leaked, which `qemu-img check`
//! reports as a leak, never as corruption), and the reserved space is fresh (past the old end of
//! the file, reading as zeroes) unless the format says otherwise, in which case the core zeroes
//! the block before writing into it. A joining write still in flight at the crash was never
//! reported complete, and its bytes read as zeroes.
//!
//! Writes into allocated plain blocks take no lock (one atomic load of the entry); reads of
//! plain and unallocated blocks never lock. A flagged block is read with its lock shared and
//! written with it exclusive, so a read never sees a flagged write half done. A block's entry
//! only ever goes from unallocated to allocated, so a reader that saw the old entry returns
//! zeroes for a write that had not completed yet, which is allowed.

pub(crate) mod fixed;
mod open;
mod table;

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;

use engine::{Engine, Slice};

pub(crate) use open::{
    at_least, check_block_size, open_image, open_locked, settle_bad, sharing, ParseError,
};
pub use table::{Entry, Table, TooLarge, MAX_ENTRIES, MAX_HOST};

use crate::regions::RegionLocks;
use crate::ringfile::RingFile;
use crate::{Attrs, BackendError, BlockBackend, Capabilities, Result, Seek};

/// What a block-table format supplies to [`TableImage`]; see the module docs for the order in
/// which the core calls it. Offsets are file offsets of the image; `block` is a block index.
pub trait BlockFormat: Send + Sync + 'static {
    /// The format's name in messages ("vhd", "vdi").
    fn name(&self) -> &'static str;

    /// File bytes one allocated block occupies (VHD: sector bitmap plus data).
    fn footprint(&self) -> u64;

    /// Where the guest data of a block whose footprint starts at `host` begins. The default:
    /// at `host` (no per-block metadata before the data).
    fn data_at(&self, host: u64) -> u64 {
        host
    }

    /// Called under the allocator lock after `host..end` was reserved at the end of the image:
    /// makes the file hold it, and returns whether that space is fresh (past the file's old
    /// end, so it reads as zeroes; otherwise the core zeroes the block's data first). Fails
    /// (ENOSPC) where the format cannot address `host`; the reservation is then not taken.
    fn reserve(
        &self,
        file: &RingFile,
        host: u64,
        end: u64,
    ) -> impl Future<Output = io::Result<bool>>;

    /// Writes what a new block needs besides its data, before the data (VHD: its sector
    /// bitmap). The default: nothing.
    fn prepare(
        &self,
        _file: &RingFile,
        _block: u64,
        _host: u64,
    ) -> impl Future<Output = io::Result<()>> {
        std::future::ready(Ok(()))
    }

    /// Writes block `block`'s on-disk entry pointing at `host`, after its data landed; returns
    /// the entry to publish in memory.
    fn commit(
        &self,
        file: &RingFile,
        block: u64,
        host: u64,
    ) -> impl Future<Output = io::Result<Entry>>;

    /// Reads `buf.len()` bytes at `within` of a block whose entry `entry` had non-zero flags
    /// (with the block's lock held shared: no flagged write of it runs meanwhile; `entry` is
    /// read again under the lock, so its flags may be 0 by now). The default reads the data as
    /// for a plain block.
    fn read_flagged(
        &self,
        file: &RingFile,
        _table: &Table,
        _block: u64,
        entry: Entry,
        within: u64,
        buf: &mut [u8],
    ) -> impl Future<Output = io::Result<()>> {
        let at = plain_at(self, entry, within);
        async move { file.read_full(buf, at?).await }
    }

    /// Fills `buf` with the guest bytes at guest offset `off` of a run of blocks whose entries
    /// are [`Entry::Unallocated`]. The default: zeroes. A differencing format reads them from
    /// its parent image instead (VHDX).
    fn read_unallocated(&self, _off: u64, buf: &mut [u8]) -> impl Future<Output = io::Result<()>> {
        buf.fill(0);
        std::future::ready(Ok(()))
    }

    /// Whether an unallocated block may read as something else than zeroes (a parent image's
    /// bytes, see [`BlockFormat::read_unallocated`]): block status then reports it as data,
    /// never as a hole. The default: no.
    fn unallocated_is_data(&self) -> bool {
        false
    }

    /// Writes `data` at `within` of a block whose entry `entry` has non-zero flags, with the
    /// block's allocation lock held; returns the entry to publish afterwards. The default
    /// writes the data as for a plain block and keeps the entry.
    fn write_flagged(
        &self,
        file: &RingFile,
        _table: &Table,
        _block: u64,
        entry: Entry,
        within: u64,
        data: &[u8],
    ) -> impl Future<Output = io::Result<Entry>> {
        let at = plain_at(self, entry, within);
        async move { file.write_full(data, at?).await.map(|()| entry) }
    }
}

/// Where byte `within` of a block with `entry` is in the file, read as a plain block's data;
/// EIO for an entry mapping no data.
fn plain_at<F: BlockFormat + ?Sized>(fmt: &F, entry: Entry, within: u64) -> io::Result<u64> {
    match entry {
        Entry::Data { host, .. } => Ok(fmt.data_at(host) + within),
        _ => Err(io::Error::from_raw_os_error(libc::EIO)),
    }
}

/// How a format opened its image, for [`TableImage::new`].
pub struct Layout {
    /// log2 of the block size (9..=30).
    pub block_shift: u32,
    /// The guest-visible size in bytes (at most the table's length in blocks).
    pub size: u64,
    /// Where the next allocated block's footprint goes: past every block and all metadata.
    pub next_free: u64,
    /// Opened for writing.
    pub writable: bool,
}

/// A block being allocated, as writes into it see it.
struct Pending {
    /// Where its footprint was reserved.
    host: u64,
    /// The reserved space reads as zeroes: other writes may land in it before the entry is
    /// written (otherwise the allocator zeroes it first, and they wait for the entry).
    fresh: bool,
    /// Held for writing by the allocator until it sets it: true once the entry is published,
    /// false if the allocation failed.
    outcome: Arc<tokio::sync::RwLock<bool>>,
}

/// What the allocator of a block holds between reserving its footprint and publishing it.
struct Allocation {
    host: u64,
    fresh: bool,
    held: tokio::sync::OwnedRwLockWriteGuard<bool>,
}

/// What a write into an unallocated or flagged block does once it has looked under the lock.
enum Step {
    /// Allocate the block: its footprint is reserved.
    Allocate(Allocation),
    /// Another write is allocating the block: write into its reserved space.
    Join(Arc<Pending>),
}

/// Runs two futures at once and gives both outputs once both ended (no allocation: both are
/// pinned on the caller's stack).
pub(crate) async fn join2<A: Future, B: Future>(a: A, b: B) -> (A::Output, B::Output) {
    let (mut a, mut b) = (std::pin::pin!(a), std::pin::pin!(b));
    let (mut ra, mut rb) = (None, None);
    std::future::poll_fn(|cx| {
        if ra.is_none() {
            if let Poll::Ready(r) = a.as_mut().poll(cx) {
                ra = Some(r);
            }
        }
        if rb.is_none() {
            if let Poll::Ready(r) = b.as_mut().poll(cx) {
                rb = Some(r);
            }
        }
        match (ra.take(), rb.take()) {
            (Some(x), Some(y)) => Poll::Ready((x, y)),
            (x, y) => {
                (ra, rb) = (x, y);
                Poll::Pending
            }
        }
    })
    .await
}

/// Runs two fallible futures at once (per-block metadata and data of a new block are
/// independent) and fails with the first error, once both ended.
pub(crate) async fn both<A, B>(
    a: impl Future<Output = io::Result<A>>,
    b: impl Future<Output = io::Result<B>>,
) -> io::Result<(A, B)> {
    let (x, y) = join2(a, b).await;
    x.and_then(|x| y.map(|y| (x, y)))
}

/// Pieces of one write (each in its own block) that run at once when the first of them is not
/// a plain overwrite: allocations of consecutive blocks (a 128 KiB write into 64 KiB VMDK
/// grains) overlap instead of following one another.
const PIECES_AT_ONCE: usize = 4;

/// One block's piece of a write: the block, where in it, and the bytes.
type Piece<'a> = (u64, u64, &'a [u8]);

/// A block-table image served as its guest bytes: the [`BlockBackend`] of every format built
/// on [`BlockFormat`].
pub struct TableImage<F: BlockFormat> {
    file: RingFile,
    fmt: F,
    table: Table,
    block_shift: u32,
    size: u64,
    writable: bool,
    /// Allocation locks: a block's region entered exclusive while it is allocated (or its
    /// flagged entry changed).
    locks: RegionLocks,
    /// Next free file offset; held only while a footprint is reserved.
    next_free: tokio::sync::Mutex<u64>,
    /// Blocks being allocated (a handful at a time: one per write in flight at most).
    pending: std::sync::Mutex<HashMap<u64, Arc<Pending>>>,
    /// Blocks mapped to data, for `st_blocks`.
    allocated: AtomicU64,
    /// A bad entry was logged (once per export: a hostile table must not flood the log).
    bad_logged: AtomicBool,
}

impl<F: BlockFormat> TableImage<F> {
    /// Serves `table` over `file` as `fmt` lays it out.
    pub fn new(file: RingFile, fmt: F, table: Table, layout: Layout) -> TableImage<F> {
        let allocated = table.count_data();
        TableImage {
            file,
            fmt,
            block_shift: layout.block_shift,
            size: layout.size,
            writable: layout.writable,
            locks: RegionLocks::new(layout.block_shift),
            next_free: tokio::sync::Mutex::new(layout.next_free),
            pending: std::sync::Mutex::new(HashMap::new()),
            allocated: AtomicU64::new(allocated),
            bad_logged: AtomicBool::new(false),
            table,
        }
    }

    /// The format.
    pub fn format(&self) -> &F {
        &self.fmt
    }

    /// The block table.
    pub fn table(&self) -> &Table {
        &self.table
    }

    /// The uid owning the image file: who may set its times without `CAP_FOWNER`.
    pub fn owner(&self) -> io::Result<u32> {
        Ok(self.file.file().metadata()?.uid())
    }

    fn block_size(&self) -> u64 {
        1 << self.block_shift
    }

    /// The block holding guest byte `off`, where `off` is in it, and how many of the `left`
    /// bytes from `off` on lie in that block.
    fn piece(&self, off: u64, left: u64) -> (u64, u64, u64) {
        let within = off & (self.block_size() - 1);
        let n = (self.block_size() - within).min(left);
        (off >> self.block_shift, within, n)
    }

    /// EIO for a request touching a bad entry (logged once).
    fn bad(&self, block: u64) -> io::Error {
        if !self.bad_logged.swap(true, Ordering::AcqRel) {
            tracing::error!(
                "{} image {}: block {block} has an invalid table entry (outside the file, in \
                 its metadata or shared with another block): requests touching it fail with \
                 EIO (further bad blocks are not logged): the image is damaged",
                self.fmt.name(),
                crate::qcow2::named::shown_path(self.file.path())
            );
        }
        io::Error::from_raw_os_error(libc::EIO)
    }

    /// How many of `len` bytes, from a piece of `first` bytes in allocated `block` (data at
    /// `host`), one transfer covers: later blocks whose data follows in the file join it.
    fn contiguous(&self, block: u64, host: u64, first: usize, len: usize) -> usize {
        let bs = self.block_size();
        let mut run = first;
        let mut expect = self.fmt.data_at(host) + bs;
        let mut next = block + 1;
        while run < len {
            match self.table.get(next) {
                Entry::Data { host, flags: 0 } if self.fmt.data_at(host) == expect => {
                    run += (bs as usize).min(len - run);
                    expect += bs;
                    next += 1;
                }
                _ => break,
            }
        }
        run
    }

    /// How many of `len` bytes, from a piece of `first` bytes in unallocated `block`, lie in it
    /// and the unallocated blocks after it.
    fn unallocated_run(&self, block: u64, first: usize, len: usize) -> usize {
        let bs = self.block_size() as usize;
        let mut run = first;
        let mut next = block + 1;
        while run < len && self.table.get(next) == Entry::Unallocated {
            run += bs.min(len - run);
            next += 1;
        }
        run
    }

    /// Fills `buf` with the guest bytes at `off` (the caller keeps it inside the image).
    pub async fn read(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        let mut buf = buf;
        let mut off = off;
        while !buf.is_empty() {
            let (block, within, first) = self.piece(off, buf.len() as u64);
            let first = first as usize;
            let entry = self.table.get(block);
            let run = match entry {
                Entry::Zero => {
                    buf[..first].fill(0);
                    first
                }
                Entry::Unallocated => {
                    // Later unallocated blocks join it: one call (one parent read) for the run.
                    let run = self.unallocated_run(block, first, buf.len());
                    self.fmt.read_unallocated(off, &mut buf[..run]).await?;
                    run
                }
                Entry::Data { host, flags: 0 } => {
                    let run = self.contiguous(block, host, first, buf.len());
                    self.file
                        .read_full(&mut buf[..run], self.fmt.data_at(host) + within)
                        .await?;
                    run
                }
                Entry::Data { .. } => {
                    // Shared with other reads, exclusive of a flagged write: a write of such
                    // a block changes data and per-block metadata (VHD: data, then bitmap
                    // bits), and a read between the two could see bytes never written.
                    let _g = self
                        .locks
                        .region_of(block << self.block_shift)
                        .shared()
                        .await;
                    self.fmt
                        .read_flagged(
                            &self.file,
                            &self.table,
                            block,
                            self.table.get(block),
                            within,
                            &mut buf[..first],
                        )
                        .await?;
                    first
                }
                Entry::Bad => return Err(self.bad(block)),
            };
            buf = &mut buf[run..];
            off += run as u64;
        }
        Ok(())
    }

    /// Writes `data` at guest offset `off` (the caller keeps it inside the image), allocating
    /// blocks as needed.
    pub async fn write(&self, data: &[u8], off: u64) -> io::Result<()> {
        self.write_counted(data, off, &mut 0).await
    }

    /// [`Self::write`], adding to `done` the bytes of each block piece as it lands (what a
    /// write stopped by an error still wrote).
    async fn write_counted(&self, data: &[u8], off: u64, done: &mut usize) -> io::Result<()> {
        if !self.writable {
            return Err(io::Error::from_raw_os_error(libc::EROFS));
        }
        let mut data = data;
        let mut off = off;
        while !data.is_empty() {
            let (block, within, first) = self.piece(off, data.len() as u64);
            if let Entry::Data { host, flags: 0 } = self.table.get(block) {
                // An overwrite: later blocks whose data follows in the file join it.
                let run = self.contiguous(block, host, first as usize, data.len());
                self.file
                    .write_full(&data[..run], self.fmt.data_at(host) + within)
                    .await?;
                *done += run;
                data = &data[run..];
                off += run as u64;
                continue;
            }
            // Up to PIECES_AT_ONCE pieces from here, each into its own block, at once (the
            // pieces are made in a block of their own: kept across the await, they would grow
            // the future).
            let (taken, one, group) = {
                let mut pieces: [Piece<'_>; PIECES_AT_ONCE] = [(0, 0, &[]); PIECES_AT_ONCE];
                let mut taken = 0;
                for p in pieces.iter_mut() {
                    if taken == data.len() {
                        break;
                    }
                    let (block, within, n) =
                        self.piece(off + taken as u64, (data.len() - taken) as u64);
                    *p = (block, within, &data[taken..taken + n as usize]);
                    taken += n as usize;
                }
                if taken == pieces[0].2.len() {
                    // One piece: no group (and no allocation for one).
                    (taken, Some(pieces[0]), None)
                } else {
                    (taken, None, Some(self.write_group(pieces)))
                }
            };
            if let Some((block, within, piece)) = one {
                // Not a plain overwrite (checked above); decided under the block's lock.
                self.write_locked(block, within, piece).await?;
                *done += taken;
            }
            if let Some(g) = group {
                let (landed, r) = g.await;
                *done += landed;
                r?;
            }
            data = &data[taken..];
            off += taken as u64;
        }
        Ok(())
    }

    /// Writes `pieces` (consecutive, each in its own block; empty ones do nothing) at once: how
    /// many bytes landed before the first that failed (those count as a short write), and that
    /// failure. Boxed: four allocations' state inline would make the write future, and with it
    /// every request slot's task of every export whatever its format, 15 times larger; one
    /// allocation per write that allocates blocks is nothing beside the allocations themselves.
    fn write_group<'a>(
        &'a self,
        pieces: [Piece<'a>; PIECES_AT_ONCE],
    ) -> Pin<Box<dyn Future<Output = (usize, io::Result<()>)> + 'a>> {
        Box::pin(async move {
            let [p0, p1, p2, p3] = pieces;
            let ((r0, r1), (r2, r3)) = join2(
                join2(self.write_piece(p0), self.write_piece(p1)),
                join2(self.write_piece(p2), self.write_piece(p3)),
            )
            .await;
            let mut landed = 0;
            for (r, p) in [r0, r1, r2, r3].into_iter().zip(pieces) {
                if let Err(e) = r {
                    return (landed, Err(e));
                }
                landed += p.2.len();
            }
            (landed, Ok(()))
        })
    }

    /// Writes one block's piece (nothing for an empty one), allocating the block if needed.
    async fn write_piece(&self, (block, within, piece): Piece<'_>) -> io::Result<()> {
        if piece.is_empty() {
            return Ok(());
        }
        match self.table.get(block) {
            Entry::Data { host, flags: 0 } => {
                self.file
                    .write_full(piece, self.fmt.data_at(host) + within)
                    .await
            }
            Entry::Bad => Err(self.bad(block)),
            _ => self.write_locked(block, within, piece).await,
        }
    }

    /// A write into a block that is unallocated or flagged: decided under the block's lock.
    async fn write_locked(&self, block: u64, within: u64, piece: &[u8]) -> io::Result<()> {
        loop {
            let step = {
                let _x = self
                    .locks
                    .region_of(block << self.block_shift)
                    .exclusive()
                    .await;
                // The allocation under way first: its allocator publishes the entry before it
                // withdraws the allocation, so a block seen in neither is really unallocated.
                if let Some(p) = self.under_way(block) {
                    Step::Join(p)
                } else {
                    match self.table.get(block) {
                        Entry::Data { host, flags: 0 } => {
                            return self
                                .file
                                .write_full(piece, self.fmt.data_at(host) + within)
                                .await
                        }
                        e @ Entry::Data { .. } => {
                            let new = self
                                .fmt
                                .write_flagged(&self.file, &self.table, block, e, within, piece)
                                .await?;
                            self.table.set(block, new);
                            return Ok(());
                        }
                        Entry::Unallocated | Entry::Zero => {
                            Step::Allocate(self.begin_allocation(block).await?)
                        }
                        Entry::Bad => return Err(self.bad(block)),
                    }
                }
            };
            match step {
                Step::Allocate(a) => return self.allocate(block, within, piece, a).await,
                Step::Join(p) => {
                    // Into the reserved space while the allocator writes its own piece and
                    // the entry; complete only once the entry is published, so a read after
                    // this write returns finds it.
                    if p.fresh {
                        self.file
                            .write_full(piece, self.fmt.data_at(p.host) + within)
                            .await?;
                    }
                    let published = *p.outcome.read().await;
                    if published
                        && p.fresh
                        && self.table.get(block)
                            == (Entry::Data {
                                host: p.host,
                                flags: 0,
                            })
                    {
                        return Ok(());
                    }
                    // Space that is not fresh is zeroed by the allocator, so this piece goes in
                    // after it; a failed allocation leaves the block unallocated. Either way:
                    // again, from the entry.
                }
            }
        }
    }

    /// The allocation of `block` under way, if any.
    fn under_way(&self, block: u64) -> Option<Arc<Pending>> {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&block)
            .cloned()
    }

    /// Reserves a footprint for `block` (its lock held, no allocation of it under way) and
    /// announces the allocation, so writes into the block join it instead of waiting for it.
    async fn begin_allocation(&self, block: u64) -> io::Result<Allocation> {
        let footprint = self.fmt.footprint();
        let (host, fresh) = {
            let mut next = self.next_free.lock().await;
            let host = *next;
            let end = host
                .checked_add(footprint)
                .filter(|&e| e <= MAX_HOST)
                .ok_or_else(|| io::Error::from_raw_os_error(libc::EFBIG))?;
            let fresh = self.fmt.reserve(&self.file, host, end).await?;
            *next = end;
            (host, fresh)
        };
        let outcome = Arc::new(tokio::sync::RwLock::new(false));
        // Uncontended: nobody has seen this lock yet.
        let held = outcome.clone().write_owned().await;
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                block,
                Arc::new(Pending {
                    host,
                    fresh,
                    outcome,
                }),
            );
        Ok(Allocation { host, fresh, held })
    }

    /// Completes the allocation of `block` reserved as `a`, writing `piece` at `within` of
    /// it: the format's per-block metadata and the data at once, then the entry; then publishes
    /// the block and withdraws the allocation (in that order, see [`Self::write_locked`]).
    async fn allocate(
        &self,
        block: u64,
        within: u64,
        piece: &[u8],
        a: Allocation,
    ) -> io::Result<()> {
        let Allocation {
            host,
            fresh,
            mut held,
        } = a;
        let done = async {
            let data = self.fmt.data_at(host);
            let write = async {
                if !fresh {
                    self.file.zero_range(data, self.block_size()).await?;
                }
                self.file.write_full(piece, data + within).await
            };
            both(self.fmt.prepare(&self.file, block, host), write).await?;
            let entry = self.fmt.commit(&self.file, block, host).await?;
            self.table.set(block, entry);
            self.allocated.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        .await;
        *held = done.is_ok();
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&block);
        drop(held);
        done
    }

    /// Makes `off..off + len` read as zeroes: allocated blocks get the range zeroed in the file
    /// (a hole where the file system can), unallocated ones read as zeroes already.
    pub async fn zero(&self, off: u64, len: u64) -> io::Result<()> {
        if !self.writable {
            return Err(io::Error::from_raw_os_error(libc::EROFS));
        }
        let end = off.saturating_add(len).min(self.size);
        let mut off = off;
        while off < end {
            let (block, within, n) = self.piece(off, end - off);
            match self.table.get(block) {
                Entry::Unallocated | Entry::Zero => {}
                // A flagged block too: sectors its format shows as zeroes stay so, the others
                // now hold zeroes.
                Entry::Data { host, .. } => {
                    self.file
                        .zero_range(self.fmt.data_at(host) + within, n)
                        .await?
                }
                Entry::Bad => return Err(self.bad(block)),
            }
            off += n;
        }
        Ok(())
    }

    /// Block status from the table: data (or a bad entry, which is not known to be a hole) vs
    /// unallocated.
    fn next_of(&self, off: u64, data: bool) -> Option<u64> {
        let mut block = off >> self.block_shift;
        while block << self.block_shift < self.size {
            let is_data = match self.table.get(block) {
                Entry::Data { .. } | Entry::Bad => true,
                Entry::Unallocated => self.fmt.unallocated_is_data(),
                Entry::Zero => false,
            };
            if is_data == data {
                return Some((block << self.block_shift).max(off));
            }
            block += 1;
        }
        None
    }
}

/// Opens a block-table image's file for a format's `open`: read-only or read-write, never
/// O_DIRECT (the formats' metadata writes are a few bytes), with the errors `--writable` and
/// permissions produce named as for raw images. Returns the file and its length.
pub(crate) fn open_file(
    path: &std::path::Path,
    writable: bool,
) -> std::result::Result<(RingFile, u64), crate::OpenError> {
    use crate::OpenError;
    let shown = path.display().to_string();
    let file = RingFile::open_path(path, writable, false).map_err(|e| match e.raw_os_error() {
        Some(libc::EROFS | libc::EACCES | libc::EPERM | libc::ETXTBSY) if writable => {
            OpenError::ReadOnly(shown.clone())
        }
        _ if e.kind() == io::ErrorKind::InvalidInput => OpenError::NotFileOrDevice(shown.clone()),
        _ => OpenError::from_io(&shown, e),
    })?;
    let meta = file
        .file()
        .metadata()
        .map_err(|e| OpenError::from_io(&shown, e))?;
    let len = if meta.is_file() {
        meta.len()
    } else {
        use std::os::fd::AsRawFd;
        crate::raw::blkdev_size(file.file().as_raw_fd())
            .map_err(|e| OpenError::from_io(&shown, e))?
    };
    Ok((file, len))
}

fn eio_to_backend(e: io::Error) -> BackendError {
    BackendError::Io(e)
}

impl<F: BlockFormat> BlockBackend for TableImage<F> {
    fn size(&self) -> u64 {
        self.size
    }

    fn size_limit(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        fixed::capabilities(self.writable)
    }

    async fn attrs(&self, _eng: &Engine) -> Result<Attrs> {
        let m = self.file.file().metadata()?;
        let allocated = self
            .allocated
            .load(Ordering::Relaxed)
            .saturating_mul(self.block_size())
            .min(self.size);
        Ok(fixed::attrs(&m, allocated))
    }

    async fn read_at(&self, _eng: &Engine, mut win: Slice, off: u64) -> (Result<usize>, Slice) {
        if off >= self.size {
            return (Ok(0), win);
        }
        let n = (win.len() as u64).min(self.size - off) as usize;
        let r = self.read(&mut win.as_mut_slice()[..n], off).await;
        (r.map(|()| n).map_err(eio_to_backend), win)
    }

    async fn write_at(&self, _eng: &Engine, win: Slice, off: u64) -> (Result<usize>, Slice) {
        let n = win.len();
        match off.checked_add(n as u64) {
            Some(end) if end <= self.size => {}
            // These images do not grow: the export lets writes past the end through only
            // for growable images, which opening refuses.
            _ => return (Err(io::Error::from_raw_os_error(libc::EFBIG).into()), win),
        }
        let mut done = 0;
        let r = match self.write_counted(win.as_slice(), off, &mut done).await {
            Ok(()) => Ok(n),
            // Whole block pieces that landed before the error count as a short write.
            Err(_) if done > 0 => Ok(done),
            Err(e) => Err(eio_to_backend(e)),
        };
        (r, win)
    }

    async fn flush(&self, _eng: &Engine) -> Result<()> {
        Ok(self.file.sync_data().await?)
    }

    async fn discard(&self, _eng: &Engine, off: u64, len: u64) -> Result<()> {
        // Blocks stay allocated (neither format frees a block in place); the range reads back
        // zeroes and its file space is punched where the file system can.
        Ok(self.zero(off, len).await?)
    }

    async fn write_zeroes(&self, _eng: &Engine, off: u64, len: u64) -> Result<()> {
        Ok(self.zero(off, len).await?)
    }

    async fn allocate(&self, _eng: &Engine, _off: u64, _len: u64) -> Result<()> {
        // Blocks are allocated on write; every range inside the image is writable already.
        Ok(())
    }

    async fn seek(&self, _eng: &Engine, off: u64, whence: Seek) -> Result<Option<u64>> {
        Ok(match whence {
            Seek::Data => self.next_of(off, true),
            Seek::Hole => Some(self.next_of(off, false).unwrap_or(self.size).max(off)),
        })
    }

    async fn resize(&self, _eng: &Engine, new_size: u64) -> Result<()> {
        fixed::resize(self.fmt.name(), self.size, new_size)
    }

    async fn grow_to(&self, _eng: &Engine, new_size: u64) -> Result<()> {
        fixed::grow_to(self.size, new_size)
    }

    fn written_to(&self, _end: u64) {}

    fn set_times(&self, atime: Option<(i64, u32)>, mtime: Option<(i64, u32)>) -> Result<()> {
        use std::os::fd::AsRawFd;
        crate::raw::set_file_times(self.file.file().as_raw_fd(), atime, mtime)
    }
}

#[cfg(test)]
pub(crate) mod testing;
#[cfg(test)]
mod tests;
