//! What every block-table format's `open` does the same way: open and lock the file, turn the
//! parser's verdict into an [`OpenError`], settle the table entries the parser found bad.
//! Each format keeps only its parser (what its headers and tables look like).

use std::fs::File;
use std::io;
use std::path::Path;

use super::{BlockFormat, Entry, Layout, Table, TableImage, TooLarge};
use crate::lock::{lock_file, Claim, Locking};
use crate::ringfile::RingFile;
use crate::OpenError;

/// Why a format's parser refused an image: a line for the user, or the OS's error.
#[derive(Debug)]
pub(crate) enum ParseError {
    /// The image is damaged or unsupported (one line saying what and what to do).
    Bad(String),
    /// Reading it failed.
    Io(io::Error),
}

impl From<io::Error> for ParseError {
    fn from(e: io::Error) -> ParseError {
        ParseError::Io(e)
    }
}

impl From<String> for ParseError {
    fn from(s: String) -> ParseError {
        ParseError::Bad(s)
    }
}

impl From<TooLarge> for ParseError {
    fn from(e: TooLarge) -> ParseError {
        ParseError::Bad(e.to_string())
    }
}

impl ParseError {
    /// The error opening the `format` image shown as `shown` reports.
    pub(crate) fn into_open_error(self, shown: &str, format: &'static str) -> OpenError {
        match self {
            ParseError::Bad(reason) => OpenError::Format {
                path: shown.to_string(),
                format,
                reason,
            },
            ParseError::Io(e) => OpenError::from_io(shown, e),
        }
    }
}

/// Opens the image file at `path` ([`super::open_file`]) and locks it as QEMU locks a qcow2,
/// vpc, vdi or vmdk image. Returns the file and its length.
pub(crate) fn open_locked(
    path: &Path,
    writable: bool,
    locking: Locking,
) -> Result<(RingFile, u64), OpenError> {
    let (file, len) = super::open_file(path, writable)?;
    lock_file(
        file.file(),
        Claim::qcow2(locking, writable),
        &format!("image {}", path.display()),
    )?;
    Ok((file, len))
}

/// The whole `open` of a format whose image is one file: [`open_locked`], then `parse` over
/// the file and its length (`writable` passed on), then the image served.
pub(crate) fn open_image<F: BlockFormat>(
    path: &Path,
    writable: bool,
    locking: Locking,
    format: &'static str,
    parse: impl FnOnce(&File, u64, bool) -> Result<(F, Table, Layout), ParseError>,
) -> Result<TableImage<F>, OpenError> {
    let shown = path.display().to_string();
    let (file, len) = open_locked(path, writable, locking)?;
    let (fmt, table, layout) =
        parse(file.file(), len, writable).map_err(|e| e.into_open_error(&shown, format))?;
    tracing::debug!(path = %shown, size = layout.size, "opened {format} image");
    Ok(TableImage::new(file, fmt, table, layout))
}

/// Refuses a file of `len` bytes, shorter than the format's first structure (`what`, of `need`
/// bytes): most likely not an image of the format at all.
pub(crate) fn at_least(len: u64, need: u64, what: &str) -> Result<(), ParseError> {
    if len < need {
        return Err(format!("it is shorter than {what} ({need} bytes): check the path").into());
    }
    Ok(())
}

/// The largest block size fusex accepts from a header (the formats allow more; real images
/// use 1 or 2 MiB): a block is zeroed and copied whole.
pub(crate) const MAX_BLOCK: u64 = 256 << 20;

/// Checks a block size a header gives: a power of two from a sector to [`MAX_BLOCK`].
pub(crate) fn check_block_size(block_size: u64) -> Result<(), String> {
    if !block_size.is_power_of_two() || !(512..=MAX_BLOCK).contains(&block_size) {
        return Err(format!(
            "its block size {block_size} is not a power of two between 512 bytes and 256 MiB"
        ));
    }
    Ok(())
}

/// The blocks of `placed` (pairs of where a block's footprint starts, in units of `unit`
/// bytes, and the block) whose `footprint` bytes overlap another block's: a write to one would
/// change the other. Sorts `placed`.
pub(crate) fn sharing(placed: &mut [(u32, u32)], unit: u64, footprint: u64) -> Vec<u64> {
    placed.sort_unstable();
    let mut both = Vec::new();
    for pair in placed.windows(2) {
        if u64::from(pair[0].0) * unit + footprint > u64::from(pair[1].0) * unit {
            both.extend([u64::from(pair[0].1), u64::from(pair[1].1)]);
        }
    }
    both
}

/// Marks the blocks in `bad` (in any order, repeats allowed) [`Entry::Bad`] and decides what
/// they mean: a writable open is refused (a write could land on metadata or on another
/// block), a read-only one goes on with a warning, those blocks failing with EIO. `what(first)`
/// says what is wrong with the first bad block's entry; `repair` is the command that repairs
/// the image.
pub(crate) fn settle_bad(
    table: &Table,
    mut bad: Vec<u64>,
    writable: bool,
    format: &str,
    what: impl FnOnce(u64) -> String,
    repair: &str,
) -> Result<(), ParseError> {
    bad.sort_unstable();
    bad.dedup();
    for &i in &bad {
        table.set(i, Entry::Bad);
    }
    let Some(&first) = bad.first() else {
        return Ok(());
    };
    let what = format!(
        "{}{}",
        what(first),
        match bad.len() - 1 {
            0 => String::new(),
            n => format!(" (and {n} more)"),
        }
    );
    if writable {
        return Err(format!(
            "{what}: the image is damaged; export it read-only (those blocks fail with EIO) or \
             repair it with `{repair}`"
        )
        .into());
    }
    tracing::warn!("{format} image: {what}: reading those blocks fails with EIO");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_sharing_space_are_found_in_pairs() {
        // Footprints of 2 units: 0..2 and 1..3 overlap, 4..6 is clear, 7 twice.
        let mut placed = [(4, 2), (1, 1), (0, 0), (7, 3), (7, 4)];
        assert_eq!(sharing(&mut placed, 512, 1024), [0, 1, 3, 4]);
        // Footprints of one unit: only equal starts.
        let mut placed = [(1, 0), (2, 1), (1, 2)];
        assert_eq!(sharing(&mut placed, 4096, 4096), [0, 2]);
    }

    #[test]
    fn bad_blocks_refuse_writing_and_serve_reading() {
        let table = Table::new(8).unwrap();
        let what = |first| format!("entry {first} is wrong");
        assert!(settle_bad(&table, vec![], true, "toy", what, "fix").is_ok());
        match settle_bad(&table, vec![5, 2, 5, 7], true, "toy", what, "fix") {
            Err(ParseError::Bad(r)) => assert_eq!(
                r,
                "entry 2 is wrong (and 2 more): the image is damaged; export it read-only \
                 (those blocks fail with EIO) or repair it with `fix`"
            ),
            e => panic!("{e:?}"),
        }
        let table = Table::new(8).unwrap();
        assert!(settle_bad(&table, vec![3], false, "toy", what, "fix").is_ok());
        let bad: Vec<u64> = (0..8).filter(|&b| table.get(b) == Entry::Bad).collect();
        assert_eq!(bad, [3]);
    }
}
