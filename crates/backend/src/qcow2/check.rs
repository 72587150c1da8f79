//! The integrity pass a qcow2 image goes through before it is opened for writing.
//!
//! imago's allocator hands out any cluster whose refcount is zero, and a guest write goes wherever
//! an L2 entry points. So a damaged image (a zeroed refcount block, an L2 entry aliasing the L1
//! table, one data cluster mapped twice) turns ordinary writes into the destruction of its
//! metadata or of other guest data. This pass reads every structure allocation and mapping trust,
//! once, and refuses the image if any of them is wrong:
//!
//! - the header, L1 table, refcount table, refcount blocks, L2 tables, snapshot table and the
//!   snapshots' L1 tables lie inside the file, cluster-aligned, and overlap nothing else;
//! - every data cluster an L2 table maps lies inside the file and overlaps no metadata;
//! - every cluster is used no more often than its refcount says (a refcount too low is what makes
//!   the allocator hand out a cluster in use; too high is a leak, which costs space, never data);
//! - an L1 or L2 entry marked "copied" (written in place) points at a cluster whose refcount is 1
//!   (else a write in place would change a snapshot too).
//!
//! The walk is iterative and reads each structure once per window of [`WINDOW_CLUSTERS`] host
//! clusters (one window for files up to 256 GiB with 64 KiB clusters): its reads are the image's
//! metadata, about 1/8192 of the allocated data with 64 KiB clusters, and its memory is 5 bytes
//! per host cluster of the window plus one entry per distinct L2 table. Nothing is written.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// Host clusters one pass over the metadata counts references for (20 MiB of counters).
pub const WINDOW_CLUSTERS: u64 = 4 << 20;

/// The longest snapshot table read (QEMU's limit too).
const MAX_SNAPSHOT_TABLE: u64 = 64 << 20;
/// The most snapshots an image may have (QEMU's limit too).
const MAX_SNAPSHOTS: u32 = 65536;
/// The largest L1 table (QEMU's limit: 32 MiB).
const MAX_L1_ENTRIES: u32 = 4 << 20;
/// The largest refcount table read (QEMU's limit: 8 MiB).
const MAX_REFTABLE_BYTES: u64 = 8 << 20;
/// Bits 9..55 of an L1 or L2 entry: a cluster's offset in the image file.
const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// Bit 63 of an L1 or L2 entry: the cluster's refcount is 1, it may be written in place.
const COPIED: u64 = 1 << 63;
/// Bit 62 of an L2 entry: the cluster is compressed.
const COMPRESSED: u64 = 1 << 62;
/// Incompatible feature bit 2: data clusters live in an external data file.
const EXTERNAL_DATA: u64 = 1 << 2;
/// Incompatible feature bit 4: L2 entries are 16 bytes (entry and subcluster bitmap).
const EXTENDED_L2: u64 = 1 << 4;

/// Where bytes come from: the image file, or memory (the fuzz target and unit tests).
pub trait Source {
    /// Bytes in the image file.
    fn size(&self) -> io::Result<u64>;
    /// Fills `buf` from `off`; fails on a short read.
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> io::Result<()>;
}

impl Source for File {
    fn size(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        FileExt::read_exact_at(self, buf, off)
    }
}

impl Source for [u8] {
    fn size(&self) -> io::Result<u64> {
        Ok(self.len() as u64)
    }
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        let start = usize::try_from(off).ok().filter(|&s| s <= self.len());
        let end = start.and_then(|s| s.checked_add(buf.len()));
        match (start, end) {
            (Some(s), Some(e)) if e <= self.len() => {
                buf.copy_from_slice(&self[s..e]);
                Ok(())
            }
            _ => Err(io::ErrorKind::UnexpectedEof.into()),
        }
    }
}

/// Why the pass refused an image.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// Reading the image failed.
    #[error("reading its metadata failed: {0}")]
    Io(#[from] io::Error),
    /// A structure is damaged: the first problem found, and how many there were in all.
    #[error("{first}{}", more(*.count))]
    Damaged {
        /// The first problem, in words.
        first: String,
        /// Problems found in all (the pass stops counting at the end of the window).
        count: u64,
    },
}

fn more(count: u64) -> String {
    match count {
        0 | 1 => String::new(),
        n => format!(" (and {} more problems)", n - 1),
    }
}

/// What a clean pass saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Host clusters in the image file.
    pub clusters: u64,
    /// Clusters with a refcount but no user (space lost, harmless; `qemu-img check -r leaks`).
    pub leaked: u64,
    /// Passes over the metadata (one per window of [`WINDOW_CLUSTERS`]).
    pub windows: u64,
    /// Metadata imago does not read itself, as `(offset, length)` in the file: the snapshot
    /// table, the snapshots' L1 tables and the L2 tables only snapshots use (for imago's overlap
    /// checks, which protect the header, L1, L2 and refcount structures on their own).
    pub protect: Vec<(u64, u64)>,
}

/// What a host cluster holds, for the overlap rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    Free = 0,
    Header,
    L1,
    RefTable,
    RefBlock,
    L2,
    Data,
    Compressed,
    Snapshots,
    SnapshotL1,
}

impl Kind {
    fn from_u8(v: u8) -> Kind {
        match v {
            1 => Kind::Header,
            2 => Kind::L1,
            3 => Kind::RefTable,
            4 => Kind::RefBlock,
            5 => Kind::L2,
            6 => Kind::Data,
            7 => Kind::Compressed,
            8 => Kind::Snapshots,
            9 => Kind::SnapshotL1,
            _ => Kind::Free,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Free => "nothing",
            Kind::Header => "the image header",
            Kind::L1 => "the L1 table",
            Kind::RefTable => "the refcount table",
            Kind::RefBlock => "a refcount block",
            Kind::L2 => "an L2 table",
            Kind::Data => "a data cluster",
            Kind::Compressed => "a compressed cluster",
            Kind::Snapshots => "the snapshot table",
            Kind::SnapshotL1 => "a snapshot's L1 table",
        }
    }

    /// Whether two users of this kind may share a cluster (the refcount then says how many).
    fn shareable(self) -> bool {
        matches!(self, Kind::L2 | Kind::Data | Kind::Compressed)
    }
}

/// The header fields the pass needs.
#[derive(Clone, Copy, Debug)]
struct Header {
    cluster_bits: u32,
    l1_size: u32,
    l1_offset: u64,
    reftable_offset: u64,
    reftable_clusters: u32,
    snapshots: u32,
    snapshots_offset: u64,
    incompatible: u64,
    refcount_order: u32,
    backing_end: u64,
}

fn be32(b: &[u8], o: usize) -> u32 {
    u32::from_be_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

fn be64(b: &[u8], o: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[o..o + 8]);
    u64::from_be_bytes(x)
}

fn be16(b: &[u8], o: usize) -> u16 {
    u16::from_be_bytes([b[o], b[o + 1]])
}

impl Header {
    fn read(src: &(impl Source + ?Sized)) -> Result<Header, CheckError> {
        let mut h = [0u8; 104];
        let len = src.size()?;
        let n = if len >= 104 { 104 } else { 72 };
        src.read_exact_at(&mut h[..n], 0)
            .map_err(|_| damaged("the file is shorter than a qcow2 header"))?;
        let version = be32(&h, 4);
        let cluster_bits = be32(&h, 20);
        if !(9..=21).contains(&cluster_bits) {
            return Err(damaged(format!(
                "its cluster size 2^{cluster_bits} is outside 512 B..2 MiB"
            )));
        }
        let (incompatible, refcount_order) = if version >= 3 && n == 104 {
            (be64(&h, 72), be32(&h, 96))
        } else {
            (0, 4)
        };
        if refcount_order > 6 {
            return Err(damaged(format!(
                "its refcount order {refcount_order} is above 6"
            )));
        }
        Ok(Header {
            cluster_bits,
            l1_size: be32(&h, 36),
            l1_offset: be64(&h, 40),
            reftable_offset: be64(&h, 48),
            reftable_clusters: be32(&h, 56),
            snapshots: be32(&h, 60),
            snapshots_offset: be64(&h, 64),
            incompatible,
            refcount_order,
            backing_end: be64(&h, 8).saturating_add(u64::from(be32(&h, 16))),
        })
    }

    fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }
}

fn damaged(first: impl Into<String>) -> CheckError {
    CheckError::Damaged {
        first: first.into(),
        count: 1,
    }
}

/// One structure the image's header and tables name, with a length in bytes.
#[derive(Clone, Copy, Debug)]
struct Extent {
    kind: Kind,
    offset: u64,
    len: u64,
}

/// Reference counts and owners of the host clusters of one window.
struct Window {
    start: u64,
    refs: Vec<u16>,
    kind: Vec<u8>,
    stored: Vec<u16>,
    problems: u64,
    first: Option<String>,
}

impl Window {
    fn new(start: u64, len: u64) -> Window {
        let n = len as usize;
        Window {
            start,
            refs: vec![0; n],
            kind: vec![0; n],
            stored: vec![0; n],
            problems: 0,
            first: None,
        }
    }

    fn problem(&mut self, what: impl FnOnce() -> String) {
        self.problems += 1;
        if self.first.is_none() {
            self.first = Some(what());
        }
    }

    fn slot(&self, cluster: u64) -> Option<usize> {
        cluster
            .checked_sub(self.start)
            .map(|i| i as usize)
            .filter(|&i| i < self.refs.len())
    }

    /// Counts `times` uses of the clusters `[offset, offset + len)` by `kind`, and records any
    /// overlap with another kind. `what` names the user in a message.
    fn add(&mut self, e: Extent, cb: u32, times: u32, what: &dyn Fn() -> String) {
        if e.len == 0 {
            return;
        }
        let first = e.offset >> cb;
        let last = (e.offset + e.len - 1) >> cb;
        // Only the clusters inside this window.
        let lo = first.max(self.start);
        let hi = last.min(self.start + self.refs.len() as u64 - 1);
        let mut c = lo;
        while c <= hi {
            let i = (c - self.start) as usize;
            let had = Kind::from_u8(self.kind[i]);
            if had != Kind::Free && (had != e.kind || !e.kind.shareable()) {
                self.problem(|| {
                    format!(
                        "{} at offset {} overlaps {} there",
                        what(),
                        c << cb,
                        had.name()
                    )
                });
            } else {
                self.kind[i] = e.kind as u8;
            }
            self.refs[i] = self.refs[i].saturating_add(times.min(u16::MAX as u32) as u16);
            c += 1;
        }
    }

    /// An entry marked "copied" promises the cluster's refcount is exactly 1.
    fn copied(&mut self, cluster: u64, what: &dyn Fn() -> String) {
        if let Some(i) = self.slot(cluster) {
            let s = self.stored[i];
            if s != 1 {
                self.problem(|| {
                    format!(
                        "{} is marked as written in place but its refcount is {s}",
                        what()
                    )
                });
            }
        }
    }
}

/// Reads a table of big-endian u64 entries.
fn read_table(src: &(impl Source + ?Sized), offset: u64, entries: u64) -> io::Result<Vec<u64>> {
    let mut raw = vec![0u8; (entries * 8) as usize];
    src.read_exact_at(&mut raw, offset)?;
    Ok(raw.chunks_exact(8).map(|c| be64(c, 0)).collect())
}

/// Checks everything allocation and mapping trust (see the module doc); `Ok` with what it saw, or
/// the first problem.
pub fn check(src: &(impl Source + ?Sized)) -> Result<Summary, CheckError> {
    check_windowed(src, WINDOW_CLUSTERS)
}

/// [`check`] with windows of `window` host clusters (for tests and the fuzz target: the verdict
/// must not depend on the window).
pub fn check_windowed(src: &(impl Source + ?Sized), window: u64) -> Result<Summary, CheckError> {
    let h = Header::read(src)?;
    let file_len = src.size()?;
    let cb = h.cluster_bits;
    let cs = h.cluster_size();
    let clusters = file_len.div_ceil(cs);

    // The fixed structures, checked for bounds before anything they name is read.
    // The header, its extensions and the backing file name fill the first cluster.
    let mut fixed = vec![Extent {
        kind: Kind::Header,
        offset: 0,
        len: cs.min(file_len),
    }];
    if h.backing_end > cs {
        return Err(damaged(format!(
            "its backing file name ends at offset {}, past the header's cluster",
            h.backing_end
        )));
    }
    if h.l1_size > MAX_L1_ENTRIES {
        return Err(damaged(format!(
            "its L1 table has {} entries, more than the 4 Mi qcow2 allows",
            h.l1_size
        )));
    }
    if h.l1_size > 0 {
        fixed.push(Extent {
            kind: Kind::L1,
            offset: h.l1_offset,
            len: u64::from(h.l1_size) * 8,
        });
    }
    let rt_bytes = u64::from(h.reftable_clusters) << cb;
    if rt_bytes == 0 || rt_bytes > MAX_REFTABLE_BYTES {
        return Err(damaged(format!(
            "its refcount table is {rt_bytes} bytes long (it must be 1 cluster to 8 MiB)"
        )));
    }
    fixed.push(Extent {
        kind: Kind::RefTable,
        offset: h.reftable_offset,
        len: rt_bytes,
    });
    for e in &fixed {
        in_file(e, cs, file_len)?;
    }

    let reftable = read_table(src, h.reftable_offset, rt_bytes / 8)?;
    let mut refblocks = Vec::new();
    for (i, &e) in reftable.iter().enumerate() {
        let off = e & !0x1ff;
        if off == 0 {
            continue;
        }
        let x = Extent {
            kind: Kind::RefBlock,
            offset: off,
            len: cs,
        };
        in_file(&x, cs, file_len).map_err(|_| {
            damaged(format!(
                "refcount table entry {i} points at offset {off}, outside the file or not \
                 cluster-aligned"
            ))
        })?;
        refblocks.push((i as u64, off));
    }

    let snapshot_l1s = snapshot_l1_tables(src, &h, file_len, &mut fixed)?;

    let l1 = read_table(src, h.l1_offset, u64::from(h.l1_size))?;
    // Each distinct L2 table once, with how many L1 entries name it and whether the active L1
    // does (its "copied" flags are checked only there: a snapshot's are not used for writing).
    let mut l2s: HashMap<u64, (u32, bool)> = HashMap::new();
    let mut note_l2 = |e: u64, active: bool, l1_index: usize| -> Result<(), CheckError> {
        let off = e & OFFSET_MASK;
        if off == 0 {
            return Ok(());
        }
        let x = Extent {
            kind: Kind::L2,
            offset: off,
            len: cs,
        };
        in_file(&x, cs, file_len).map_err(|_| {
            damaged(format!(
                "L1 entry {l1_index} points at offset {off}, outside the file or not \
                 cluster-aligned"
            ))
        })?;
        let s = l2s.entry(off).or_insert((0, false));
        s.0 = s.0.saturating_add(1);
        s.1 |= active;
        Ok(())
    };
    for (i, &e) in l1.iter().enumerate() {
        note_l2(e, true, i)?;
    }
    for (off, n) in &snapshot_l1s {
        for (i, &e) in read_table(src, *off, u64::from(*n))?.iter().enumerate() {
            note_l2(e, false, i)?;
        }
    }
    let mut l2_list: Vec<(u64, u32, bool)> = l2s.into_iter().map(|(o, (n, a))| (o, n, a)).collect();
    l2_list.sort_unstable();

    let entry_bytes: u64 = if h.incompatible & EXTENDED_L2 != 0 {
        16
    } else {
        8
    };
    let external = h.incompatible & EXTERNAL_DATA != 0;
    let rb_bits = cb + 3 - h.refcount_order;
    let mut summary = Summary {
        clusters,
        protect: fixed
            .iter()
            .filter(|e| matches!(e.kind, Kind::Snapshots | Kind::SnapshotL1))
            .map(|e| (e.offset, e.len))
            .chain(
                l2_list
                    .iter()
                    .filter(|&&(_, _, active)| !active)
                    .map(|&(off, _, _)| (off, cs)),
            )
            .collect(),
        ..Summary::default()
    };
    let mut l2_buf = vec![0u8; cs as usize];
    let mut rb_buf = vec![0u8; cs as usize];
    let mut start = 0u64;
    while start < clusters.max(1) {
        let len = (clusters.max(1) - start).min(window);
        let mut w = Window::new(start, len);
        summary.windows += 1;

        // What the refcount blocks say about this window's clusters.
        for &(rt_index, off) in &refblocks {
            let first = rt_index << rb_bits;
            let count = 1u64 << rb_bits;
            if first >= start + len || first + count <= start {
                continue;
            }
            src.read_exact_at(&mut rb_buf, off)?;
            for j in 0..count {
                if let Some(i) = w.slot(first + j) {
                    w.stored[i] = refcount(&rb_buf, j as usize, h.refcount_order);
                }
            }
        }

        for e in &fixed {
            w.add(*e, cb, 1, &|| e.kind.name().to_string());
        }
        for &(rt_index, off) in &refblocks {
            let x = Extent {
                kind: Kind::RefBlock,
                offset: off,
                len: cs,
            };
            w.add(x, cb, 1, &|| format!("refcount block {rt_index}"));
        }
        for &(off, times, _) in &l2_list {
            let x = Extent {
                kind: Kind::L2,
                offset: off,
                len: cs,
            };
            w.add(x, cb, times, &|| "an L2 table".to_string());
        }
        for (i, &e) in l1.iter().enumerate() {
            let off = e & OFFSET_MASK;
            if off != 0 && e & COPIED != 0 {
                w.copied(off >> cb, &|| format!("the L2 table of L1 entry {i}"));
            }
        }
        if !external {
            for &(off, times, active) in &l2_list {
                src.read_exact_at(&mut l2_buf, off)?;
                for (k, ent) in l2_buf.chunks_exact(entry_bytes as usize).enumerate() {
                    let e = be64(ent, 0);
                    data_reference(&mut w, &h, file_len, e, off, k, times, active);
                }
            }
        }

        for i in 0..len as usize {
            let (refs, stored) = (w.refs[i], w.stored[i]);
            if stored < refs {
                let c = start + i as u64;
                let k = Kind::from_u8(w.kind[i]);
                w.problem(|| {
                    format!(
                        "the cluster at offset {} holds {} used {refs} time(s) but its refcount \
                         is {stored}",
                        c << cb,
                        k.name()
                    )
                });
            } else if refs == 0 && stored > 0 {
                summary.leaked += 1;
            }
        }
        if let Some(first) = w.first {
            return Err(CheckError::Damaged {
                first,
                count: w.problems,
            });
        }
        start += len;
    }
    Ok(summary)
}

/// Counts the data cluster L2 entry `e` (entry `k` of the table at `l2_off`, named by `times` L1
/// entries) maps.
#[allow(clippy::too_many_arguments)]
fn data_reference(
    w: &mut Window,
    h: &Header,
    file_len: u64,
    e: u64,
    l2_off: u64,
    k: usize,
    times: u32,
    active: bool,
) {
    let cb = h.cluster_bits;
    let cs = h.cluster_size();
    let what = || format!("entry {k} of the L2 table at offset {l2_off}");
    if e & COMPRESSED != 0 {
        // Offset in the low (62 - (cb - 8)) bits, then the count of further 512-byte sectors.
        let x = 62 - (cb - 8);
        let off = e & ((1u64 << x) - 1);
        let sectors = ((e >> x) & ((1u64 << (cb - 8)) - 1)) + 1;
        let end = (off & !511) + sectors * 512;
        if off >= file_len {
            w.problem(|| format!("{} maps compressed data past the end of the file", what()));
            return;
        }
        let x = Extent {
            kind: Kind::Compressed,
            offset: off,
            len: end - off,
        };
        w.add(x, cb, times, &what);
        return;
    }
    let off = e & OFFSET_MASK;
    if off == 0 {
        return;
    }
    if off & (cs - 1) != 0 || off >= file_len {
        w.problem(|| {
            format!(
                "{} maps data at offset {off}, outside the file or not cluster-aligned",
                what()
            )
        });
        return;
    }
    let x = Extent {
        kind: Kind::Data,
        offset: off,
        len: cs,
    };
    w.add(x, cb, times, &what);
    if active && e & COPIED != 0 {
        w.copied(off >> cb, &what);
    }
}

/// Refcount `j` of a refcount block with entries of 2^`order` bits, saturated to u16.
fn refcount(rb: &[u8], j: usize, order: u32) -> u16 {
    let bits = 1usize << order;
    let v: u64 = if bits < 8 {
        let byte = rb[j * bits / 8];
        let shift = (j * bits) % 8;
        u64::from((byte >> shift) & ((1u16 << bits) - 1) as u8)
    } else {
        let n = bits / 8;
        let mut x = 0u64;
        for &b in &rb[j * n..j * n + n] {
            x = (x << 8) | u64::from(b);
        }
        x
    };
    v.min(u64::from(u16::MAX)) as u16
}

/// Fails unless `e` is cluster-aligned and inside the file.
fn in_file(e: &Extent, cs: u64, file_len: u64) -> Result<(), CheckError> {
    let end = e.offset.checked_add(e.len);
    if e.offset & (cs - 1) != 0 || end.is_none_or(|end| end > file_len) {
        return Err(damaged(format!(
            "{} at offset {} ({} bytes) lies outside the file or is not cluster-aligned",
            e.kind.name(),
            e.offset,
            e.len
        )));
    }
    Ok(())
}

/// Reads the snapshot table, adds it and every snapshot's L1 table to `fixed` (after checking
/// none overlaps another, so no table is read twice), and returns the L1 tables.
fn snapshot_l1_tables(
    src: &(impl Source + ?Sized),
    h: &Header,
    file_len: u64,
    fixed: &mut Vec<Extent>,
) -> Result<Vec<(u64, u32)>, CheckError> {
    if h.snapshots == 0 {
        return Ok(Vec::new());
    }
    if h.snapshots > MAX_SNAPSHOTS {
        return Err(damaged(format!(
            "it has {} snapshots, more than the 65536 qcow2 allows",
            h.snapshots
        )));
    }
    let cs = h.cluster_size();
    let avail = file_len
        .saturating_sub(h.snapshots_offset)
        .min(MAX_SNAPSHOT_TABLE) as usize;
    // Read as far as the entries go: from one cluster, doubling up to the 64 MiB limit.
    let mut table = Vec::new();
    let mut pos = 0usize;
    let mut table_end = 0usize;
    let mut l1s = Vec::new();
    for i in 0..h.snapshots {
        let bad = || {
            damaged(format!(
                "snapshot {i} lies past the end of the snapshot table"
            ))
        };
        let need = pos + 40;
        if need > table.len() && table.len() < avail {
            grow(
                src,
                &mut table,
                need,
                cs as usize,
                avail,
                h.snapshots_offset,
            )?;
        }
        let fixed_part = table.get(pos..pos + 40).ok_or_else(bad)?;
        let l1_offset = be64(fixed_part, 0);
        let l1_size = be32(fixed_part, 8);
        let id = be16(fixed_part, 12) as usize;
        let name = be16(fixed_part, 14) as usize;
        let extra = be32(fixed_part, 36) as usize;
        // Entries are padded to 8 bytes, but the last one's padding need not be in the file.
        let end = pos + 40 + extra + id + name;
        if end > table.len() && table.len() < avail {
            grow(src, &mut table, end, cs as usize, avail, h.snapshots_offset)?;
        }
        if end > table.len() {
            return Err(bad());
        }
        table_end = end;
        pos = end.next_multiple_of(8);
        if l1_size > MAX_L1_ENTRIES {
            return Err(damaged(format!(
                "snapshot {i}'s L1 table has {l1_size} entries, more than the 4 Mi qcow2 allows"
            )));
        }
        if l1_size > 0 {
            let x = Extent {
                kind: Kind::SnapshotL1,
                offset: l1_offset,
                len: u64::from(l1_size) * 8,
            };
            in_file(&x, cs, file_len)?;
            l1s.push((l1_offset, l1_size));
        }
    }
    let x = Extent {
        kind: Kind::Snapshots,
        offset: h.snapshots_offset,
        len: table_end as u64,
    };
    in_file(&x, cs, file_len)?;
    fixed.push(x);
    // Disjoint before any is read: a hostile table naming one huge L1 table 65536 times must
    // not cost 65536 reads of it.
    let mut sorted = l1s.clone();
    sorted.sort_unstable();
    for pair in sorted.windows(2) {
        if pair[0].0 + u64::from(pair[0].1) * 8 > pair[1].0 {
            return Err(damaged(format!(
                "two snapshots' L1 tables overlap at offset {}",
                pair[1].0
            )));
        }
    }
    for &(offset, n) in &l1s {
        fixed.push(Extent {
            kind: Kind::SnapshotL1,
            offset,
            len: u64::from(n) * 8,
        });
    }
    Ok(l1s)
}

/// Rereads `table` from `offset` at the first of (cluster, doubling) that holds `need` bytes, at
/// most `avail`.
fn grow(
    src: &(impl Source + ?Sized),
    table: &mut Vec<u8>,
    need: usize,
    cluster: usize,
    avail: usize,
    offset: u64,
) -> io::Result<()> {
    let mut len = table.len().max(cluster);
    while len < need {
        len = len.saturating_mul(2);
    }
    table.resize(len.min(avail), 0);
    src.read_exact_at(table, offset)
}

#[cfg(test)]
mod tests;
