//! Test support for the core and its formats: one engine per call, reads and writes of a
//! [`TableImage`] run to completion, image files in a temporary directory, the reason an open
//! was refused, and the damaged-image workload every format's property test runs.

use std::io;
use std::path::{Path, PathBuf};

use engine::{Engine, EngineConfig};

use super::{BlockFormat, TableImage};
use crate::OpenError;

/// A small engine for running one future.
pub(crate) fn engine() -> Engine {
    Engine::new(&EngineConfig {
        sq_entries: 16,
        ..EngineConfig::default()
    })
    .unwrap()
}

/// `len` guest bytes of `img` at `off` (the buffer starts as 0xaa, so unread bytes show).
pub(crate) fn read<F: BlockFormat>(
    img: &TableImage<F>,
    off: u64,
    len: usize,
) -> io::Result<Vec<u8>> {
    let mut v = vec![0xaa; len];
    engine().block_on(img.read(&mut v, off)).unwrap()?;
    Ok(v)
}

/// Writes `data` at guest offset `off` of `img`.
pub(crate) fn write<F: BlockFormat>(img: &TableImage<F>, off: u64, data: &[u8]) -> io::Result<()> {
    engine().block_on(img.write(data, off)).unwrap()
}

/// Writes `bytes` as the file `name` in `dir` (replacing it), and returns its path.
pub(crate) fn write_img(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.path().join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// The reason of an open refused as a bad image (any other outcome fails the test).
pub(crate) fn reason<T>(opened: Result<T, OpenError>) -> String {
    match opened {
        Err(OpenError::Format { reason, .. }) => reason,
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("opened"),
    }
}

/// Runs `ops` (offset, length: both brought inside the image) on the image at `path` opened
/// by `open`: as reads on a read-only open, then as writes on a writable one, each allowed to
/// fail but not to panic. Returns how many bytes the writes grew the file by and the format's
/// block footprint, when the writable open succeeded.
pub(crate) fn exercise<F: BlockFormat>(
    path: &Path,
    ops: &[(u64, u16)],
    open: impl Fn(&Path, bool) -> Result<TableImage<F>, OpenError>,
) -> Option<(u64, u64)> {
    let eng = engine();
    let inside = |size: u64, off: u64, len: u16| {
        let off = off % size.max(1);
        (off, u64::from(len).min(size - off) as usize)
    };
    if let Ok(img) = open(path, false) {
        let size = crate::BlockBackend::size(&img);
        for &(off, len) in ops {
            let (off, len) = inside(size, off, len);
            let mut buf = vec![0u8; len];
            let _ = eng.block_on(img.read(&mut buf, off)).unwrap();
        }
    }
    let img = open(path, true).ok()?;
    let size = crate::BlockBackend::size(&img);
    let before = std::fs::metadata(path).unwrap().len();
    for &(off, len) in ops {
        let (off, len) = inside(size, off, len);
        let _ = eng.block_on(img.write(&vec![9u8; len], off)).unwrap();
    }
    let grown = std::fs::metadata(path)
        .unwrap()
        .len()
        .saturating_sub(before);
    Some((grown, img.format().footprint()))
}

/// A change made to a copy of a good image.
pub(crate) type Damage = Box<dyn Fn(&mut Vec<u8>)>;

/// Each case's damage done to a copy of `good`, written as `name` in `dir`: `reason_of` (the
/// reason a read-only open refuses it) must contain the case's text, on one line.
pub(crate) fn refused_in_one_line(
    dir: &tempfile::TempDir,
    name: &str,
    good: &[u8],
    cases: Vec<(&str, Damage)>,
    reason_of: impl Fn(&Path) -> String,
) {
    for (want, damage) in cases {
        let mut img = good.to_vec();
        damage(&mut img);
        let r = reason_of(&write_img(dir, name, &img));
        assert!(r.contains(want), "{want}: {r}");
        assert!(!r.contains('\n'), "{r}");
    }
}

/// For an image at `path` whose first `blocks` blocks (of `bs` bytes) all have bad entries: a
/// writable open is refused naming block 0 and the others' count, and a read-only one serves
/// but fails reading `len` bytes of each of them with EIO.
pub(crate) fn bad_blocks_refused<F: BlockFormat>(
    path: &Path,
    bs: u64,
    blocks: u64,
    len: usize,
    open: impl Fn(&Path, bool) -> Result<TableImage<F>, OpenError>,
) {
    let r = reason(open(path, true));
    let more = format!("{} more", blocks - 1);
    assert!(r.contains("block 0") && r.contains(&more), "{r}");
    let img = open(path, false).unwrap();
    for b in 0..blocks {
        let e = read(&img, b * bs, len).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "block {b}");
    }
}

/// The requests [`exercise`] runs: up to five (offset, length) pairs, any offset.
pub(crate) fn ops() -> impl proptest::strategy::Strategy<Value = Vec<(u64, u16)>> {
    proptest::collection::vec((proptest::num::u64::ANY, 1u16..20000), 1..6)
}
