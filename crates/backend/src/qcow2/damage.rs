//! Damage planted into a healthy qcow2 image, one kind at a time: the corpus the integrity pass,
//! the end-to-end tests and the fuzz seeds share.
//!
//! Each [`Damage`] changes a few bytes of an image that `qemu-img` made (through [`Layout`], read
//! from the image itself), so every test exercises a real image with exactly one known fault.
//! The base image is described in [`BASE_RECIPE`]; [`Damage::plant`] needs its two L2 tables.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// How the corpus's base image is made, for callers that run `qemu-img` and `qemu-io`: a 1 GiB
/// image with 64 KiB clusters and data in two L2 tables' ranges (so the image has two L2
/// tables, several data clusters and one refcount block).
pub const BASE_RECIPE: BaseRecipe = BaseRecipe {
    size: 1 << 30,
    cluster_size: 64 << 10,
    writes: &[(0, 256 << 10, 0x11), (600 << 20, 128 << 10, 0x22)],
};

/// A small base image for fuzzing (a few KiB): 512-byte clusters, two L2 tables.
pub const SMALL_RECIPE: BaseRecipe = BaseRecipe {
    size: 1 << 20,
    cluster_size: 512,
    writes: &[(0, 4096, 0x11), (32 << 10, 2048, 0x22)],
};

/// The base image of the corpus.
#[derive(Clone, Copy, Debug)]
pub struct BaseRecipe {
    /// Virtual size in bytes.
    pub size: u64,
    /// Cluster size in bytes.
    pub cluster_size: u64,
    /// `(guest offset, length, byte)` written with `qemu-io -c "write -P byte offset length"`.
    pub writes: &'static [(u64, u64, u8)],
}

impl BaseRecipe {
    /// Makes the image at `path` with `qemu-img create` (cluster size and `extra` `-o` options,
    /// e.g. `,refcount_bits=1`) and the recipe's writes with `qemu-io`. A missing tool is
    /// `ErrorKind::NotFound`; a tool that fails is an error with its output.
    pub fn make(&self, path: &Path, extra: &str) -> io::Result<()> {
        let run = |tool: &str, args: &[&std::ffi::OsStr]| -> io::Result<()> {
            let out = std::process::Command::new(tool).args(args).output()?;
            if out.status.success() {
                Ok(())
            } else {
                Err(io::Error::other(format!(
                    "{tool} {args:?}: {}",
                    String::from_utf8_lossy(&out.stderr)
                )))
            }
        };
        let opts = format!("cluster_size={}{extra}", self.cluster_size);
        let size = self.size.to_string();
        let p = path.as_os_str();
        run(
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "-o", &opts]
                .map(std::ffi::OsStr::new)
                .into_iter()
                .chain([p, size.as_ref()])
                .collect::<Vec<_>>(),
        )?;
        for (off, len, byte) in self.writes {
            let cmd = format!("write -P {byte} {off} {len}");
            run(
                "qemu-io",
                &[
                    "-f".as_ref(),
                    "qcow2".as_ref(),
                    "-c".as_ref(),
                    cmd.as_ref(),
                    p,
                ],
            )?;
        }
        Ok(())
    }
}

/// Where an image's structures are (read from its header and tables).
#[derive(Clone, Debug)]
pub struct Layout {
    /// Cluster size in bytes.
    pub cluster_size: u64,
    /// The L1 table's offset.
    pub l1: u64,
    /// The refcount table's offset.
    pub reftable: u64,
    /// Refcount block 0's offset.
    pub refblock0: u64,
    /// The L2 tables the first two L1 entries name (0 if none).
    pub l2: [u64; 2],
    /// The host offsets of the data clusters the first L2 table maps, in guest order.
    pub data: Vec<u64>,
}

fn be64_at(f: &File, off: u64) -> io::Result<u64> {
    let mut b = [0u8; 8];
    f.read_exact_at(&mut b, off)?;
    Ok(u64::from_be_bytes(b))
}

const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
const COPIED: u64 = 1 << 63;

impl Layout {
    /// Reads the layout of the image at `path`.
    pub fn read(path: &Path) -> io::Result<Layout> {
        let f = File::open(path)?;
        let mut h = [0u8; 72];
        f.read_exact_at(&mut h, 0)?;
        let cluster_bits = u32::from_be_bytes([h[20], h[21], h[22], h[23]]);
        let cs = 1u64 << cluster_bits;
        let l1 = u64::from_be_bytes(h[40..48].try_into().unwrap());
        let reftable = u64::from_be_bytes(h[48..56].try_into().unwrap());
        let refblock0 = be64_at(&f, reftable)? & !0x1ff;
        let l2 = [
            be64_at(&f, l1)? & OFFSET_MASK,
            be64_at(&f, l1 + 8)? & OFFSET_MASK,
        ];
        let mut data = Vec::new();
        if l2[0] != 0 {
            for i in 0..cs / 8 {
                let e = be64_at(&f, l2[0] + i * 8)? & OFFSET_MASK;
                if e != 0 {
                    data.push(e);
                }
            }
        }
        Ok(Layout {
            cluster_size: cs,
            l1,
            reftable,
            refblock0,
            l2,
            data,
        })
    }
}

/// One kind of damage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Damage {
    /// Refcount table entry 0 zeroed: every cluster it covered (header included) looks free.
    RefTableEntryZeroed,
    /// Refcount table entry 0 points 1 TiB past the end of the file.
    RefTableEntryPastEnd,
    /// Refcount table entry 0 points at the L1 table.
    RefTableEntryOnL1,
    /// Refcount block 0 zeroed: the header, tables and data all look free.
    RefBlockZeroed,
    /// Refcount block 0 keeps only the header's refcount: everything else looks free.
    RefcountsAfterHeaderZeroed,
    /// Guest cluster 1's L2 entry points at the L1 table.
    L2OnL1,
    /// Guest cluster 1's L2 entry points at the refcount table.
    L2OnRefTable,
    /// Guest cluster 1's L2 entry points at refcount block 0.
    L2OnRefBlock,
    /// Guest cluster 1's L2 entry points at the second L2 table.
    L2OnOtherL2,
    /// Guest cluster 1's L2 entry points at guest cluster 0's data cluster (one data cluster
    /// mapped twice, both entries claiming to own it).
    DataMappedTwice,
    /// L1 entry 1 points at refcount block 0.
    L1OnRefBlock,
    /// L1 entry 1 points at the L1 table itself.
    L1OnL1,
    /// L1 entry 1 points at L1 entry 0's L2 table.
    L1OnOtherL2,
}

impl Damage {
    /// Every kind, for tests that go through the whole corpus.
    pub const ALL: [Damage; 13] = [
        Damage::RefTableEntryZeroed,
        Damage::RefTableEntryPastEnd,
        Damage::RefTableEntryOnL1,
        Damage::RefBlockZeroed,
        Damage::RefcountsAfterHeaderZeroed,
        Damage::L2OnL1,
        Damage::L2OnRefTable,
        Damage::L2OnRefBlock,
        Damage::L2OnOtherL2,
        Damage::DataMappedTwice,
        Damage::L1OnRefBlock,
        Damage::L1OnL1,
        Damage::L1OnOtherL2,
    ];

    /// A short name, for file names and messages.
    pub fn name(self) -> &'static str {
        match self {
            Damage::RefTableEntryZeroed => "reftable-entry-zeroed",
            Damage::RefTableEntryPastEnd => "reftable-entry-past-end",
            Damage::RefTableEntryOnL1 => "reftable-entry-on-l1",
            Damage::RefBlockZeroed => "refblock-zeroed",
            Damage::RefcountsAfterHeaderZeroed => "refcounts-after-header-zeroed",
            Damage::L2OnL1 => "l2-on-l1",
            Damage::L2OnRefTable => "l2-on-reftable",
            Damage::L2OnRefBlock => "l2-on-refblock",
            Damage::L2OnOtherL2 => "l2-on-other-l2",
            Damage::DataMappedTwice => "data-mapped-twice",
            Damage::L1OnRefBlock => "l1-on-refblock",
            Damage::L1OnL1 => "l1-on-l1",
            Damage::L1OnOtherL2 => "l1-on-other-l2",
        }
    }

    /// The guest range whose mapping this damage changed (a write there is the one that would
    /// land on the wrong bytes), if it changed one.
    pub fn guest_range(self, layout: &Layout) -> Option<(u64, u64)> {
        let cs = layout.cluster_size;
        match self {
            Damage::L2OnL1
            | Damage::L2OnRefTable
            | Damage::L2OnRefBlock
            | Damage::L2OnOtherL2
            | Damage::DataMappedTwice => Some((cs, cs)),
            // L1 entry 1 maps the second L2 table's range.
            Damage::L1OnRefBlock | Damage::L1OnL1 | Damage::L1OnOtherL2 => Some((cs * cs / 8, cs)),
            _ => None,
        }
    }

    /// Plants this damage into the image at `path` (made by [`BASE_RECIPE`] or
    /// [`SMALL_RECIPE`]).
    pub fn plant(self, path: &Path) -> io::Result<()> {
        let l = Layout::read(path)?;
        if l.l2[1] == 0 || l.data.len() < 2 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the image lacks the base recipe's two L2 tables and data clusters",
            ));
        }
        let f = OpenOptions::new().read(true).write(true).open(path)?;
        let put = |off: u64, v: u64| f.write_all_at(&v.to_be_bytes(), off);
        let len = f.metadata()?.len();
        let cs = l.cluster_size;
        // Guest cluster 1's L2 entry, "copied" so it is written in place.
        let l2_entry1 = l.l2[0] + 8;
        match self {
            Damage::RefTableEntryZeroed => put(l.reftable, 0),
            Damage::RefTableEntryPastEnd => put(l.reftable, (len.next_multiple_of(cs)) + (1 << 40)),
            Damage::RefTableEntryOnL1 => put(l.reftable, l.l1 & !(cs - 1)),
            Damage::RefBlockZeroed => f.write_all_at(&vec![0u8; cs as usize], l.refblock0),
            Damage::RefcountsAfterHeaderZeroed => {
                // 16-bit refcounts: keep entry 0 (the header).
                f.write_all_at(&vec![0u8; cs as usize - 2], l.refblock0 + 2)
            }
            Damage::L2OnL1 => put(l2_entry1, COPIED | (l.l1 & !(cs - 1))),
            Damage::L2OnRefTable => put(l2_entry1, COPIED | l.reftable),
            Damage::L2OnRefBlock => put(l2_entry1, COPIED | l.refblock0),
            Damage::L2OnOtherL2 => put(l2_entry1, COPIED | l.l2[1]),
            Damage::DataMappedTwice => put(l2_entry1, COPIED | l.data[0]),
            Damage::L1OnRefBlock => put(l.l1 + 8, COPIED | l.refblock0),
            Damage::L1OnL1 => put(l.l1 + 8, COPIED | (l.l1 & !(cs - 1))),
            Damage::L1OnOtherL2 => put(l.l1 + 8, COPIED | l.l2[0]),
        }?;
        f.sync_all()
    }
}
