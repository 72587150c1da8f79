//! Partitions of an image served as files of their own: the partition table is read through
//! the image's own backend (so it works on raw, qcow2, NBD and every other format alike), and
//! the chosen partition is served by [`Bounded`], which keeps every request inside it.

mod bounded;
mod crc32;
pub mod table;

use std::io;
use std::sync::Arc;

use engine::{Buf, Engine, EngineConfig};

pub use bounded::Bounded;
pub use table::{Kind, Part, Scheme, Table, TableError};

use crate::BlockBackend;

/// Reads `B`'s bytes for the table reader through its own `read_at`, a buffer at a time.
struct Through<'a, B> {
    backend: &'a B,
    eng: &'a Engine,
    buf: Option<Buf>,
}

impl<B: BlockBackend> table::Source for Through<'_, B> {
    fn size(&self) -> u64 {
        self.backend.size()
    }

    async fn read(&mut self, mut off: u64, out: &mut [u8]) -> io::Result<()> {
        let mut done = 0;
        while done < out.len() {
            let buf = self
                .buf
                .take()
                .ok_or_else(|| io::Error::other("no buffer to read the partition table into"))?;
            let chunk = (out.len() - done).min(buf.len());
            let (r, win) = self
                .backend
                .read_at(self.eng, buf.slice(0..chunk), off)
                .await;
            let n = r.map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
            out[done..done + n].copy_from_slice(&win.as_slice()[..n]);
            self.buf = Some(win.into_inner());
            if n < chunk {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the image ends inside its partition table",
                ));
            }
            done += n;
            off += n as u64;
        }
        Ok(())
    }
}

/// Reads `backend`'s partition table on a short-lived engine of the calling thread (at open,
/// before any queue runs), then lets the backend drop what it kept for this thread.
pub fn read_table<B: BlockBackend>(backend: &B) -> Result<Table, TableError> {
    let eng = Engine::new(&EngineConfig {
        sq_entries: 16,
        buffers: 1,
        buffer_size: 64 << 10,
        ..EngineConfig::default()
    })
    .map_err(|e| TableError::Io(io::Error::other(e.to_string())))?;
    let mut src = Through {
        backend,
        eng: &eng,
        buf: eng.take_buffer(),
    };
    let r = eng
        .block_on(table::read(&mut src))
        .map_err(|e| TableError::Io(io::Error::other(e.to_string())))
        .and_then(|r| r);
    drop(src);
    backend.queue_ended();
    r
}

/// Why partition `number` of an image, or a range of it, cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum PartitionError {
    /// `--offset` and `--size` name bytes the image does not have.
    #[error("{image} has {whole} bytes: it has no {} from byte {offset}; give a range inside it", match .size { Some(s) => format!("{s} bytes"), None => "bytes".to_string() })]
    Outside {
        /// The image.
        image: String,
        /// Where the range starts.
        offset: u64,
        /// Its length (None: to the image's end).
        size: Option<u64>,
        /// The image's size.
        whole: u64,
    },
    /// The table could not be read.
    #[error("cannot export partition {number} of {image}: {error}")]
    Table {
        /// The image.
        image: String,
        /// The partition asked for.
        number: u32,
        /// What is wrong with the table.
        error: TableError,
    },
    /// There is no such partition.
    #[error("{image} has no partition {number}: its {scheme} has partitions {listing}")]
    Missing {
        /// The image.
        image: String,
        /// The partition asked for.
        number: u32,
        /// MBR or GPT.
        scheme: Scheme,
        /// The partitions there are.
        listing: String,
    },
    /// The MBR's extended partition, a container of logical partitions.
    #[error("partition {number} of {image} is the extended partition, which holds the logical partitions: give one of those ({listing})")]
    Extended {
        /// The image.
        image: String,
        /// The partition asked for.
        number: u32,
        /// The partitions there are.
        listing: String,
    },
}

/// Bounds `backend` to `size` bytes from `offset` (to its end without a size), which must lie
/// inside it; `image` names it in errors.
pub fn window<B: BlockBackend>(
    backend: Arc<B>,
    offset: u64,
    size: Option<u64>,
    image: &str,
) -> Result<Bounded<B>, PartitionError> {
    let whole = backend.size();
    let len = match size {
        None if offset <= whole => whole - offset,
        Some(len) if offset.checked_add(len).is_some_and(|end| end <= whole) => len,
        _ => {
            return Err(PartitionError::Outside {
                image: image.to_string(),
                offset,
                size,
                whole,
            })
        }
    };
    tracing::debug!(image, offset, len, "range");
    Ok(Bounded::new(backend, offset, len, None))
}

/// Finds partition `number` of `backend` and bounds it there; `image` names it in errors.
pub fn bound<B: BlockBackend>(
    backend: Arc<B>,
    number: u32,
    image: &str,
) -> Result<Bounded<B>, PartitionError> {
    let table = read_table(&*backend).map_err(|error| PartitionError::Table {
        image: image.to_string(),
        number,
        error,
    })?;
    let Some(p) = table.parts.iter().find(|p| p.number == number) else {
        return Err(PartitionError::Missing {
            image: image.to_string(),
            number,
            scheme: table.scheme,
            listing: table.listing(),
        });
    };
    if p.kind == Kind::Extended {
        return Err(PartitionError::Extended {
            image: image.to_string(),
            number,
            listing: table.listing(),
        });
    }
    tracing::debug!(image, number, start = p.start, len = p.len, scheme = %table.scheme, "partition");
    Ok(Bounded::new(backend, p.start, p.len, Some(number)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partition_is_found_through_the_backend_or_listed() {
        use std::io::Write;
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&table::tests::mbr_disk()).unwrap();
        let raw = Arc::new(crate::RawBackend::open(f.path(), false, false, None).unwrap());
        let b = bound(raw.clone(), 6, "disk").unwrap();
        assert_eq!((b.start(), b.size()), ((10240 + 2048) * 512, 512 << 10));
        let e = bound(raw.clone(), 4, "disk").err().unwrap().to_string();
        assert_eq!(
            e,
            "disk has no partition 4: its MBR has partitions 1 (1 MiB at 1 MiB), \
             2 (1 MiB at 2 MiB), 3 (4 MiB at 3 MiB, extended), 5 (512 KiB at 4 MiB), \
             6 (512 KiB at 6 MiB)"
        );
        let e = bound(raw, 3, "disk").err().unwrap().to_string();
        assert!(e.contains("extended partition"), "{e}");
    }

    #[test]
    fn a_range_must_lie_inside_the_image() {
        let null = Arc::new(crate::NullBackend::new(1 << 20, false));
        let b = window(null.clone(), 4096, Some(8192), "img").unwrap();
        assert_eq!((b.start(), b.size(), b.number()), (4096, 8192, None));
        let b = window(null.clone(), 4096, None, "img").unwrap();
        assert_eq!(b.size(), (1 << 20) - 4096, "to the end");
        assert_eq!(
            window(null.clone(), 1 << 20, None, "img").unwrap().size(),
            0
        );
        assert_eq!(
            window(null.clone(), (1 << 20) + 1, None, "img")
                .err()
                .unwrap()
                .to_string(),
            "img has 1048576 bytes: it has no bytes from byte 1048577; give a range inside it"
        );
        assert_eq!(
            window(null.clone(), 4096, Some(1 << 20), "img")
                .err()
                .unwrap()
                .to_string(),
            "img has 1048576 bytes: it has no 1048576 bytes from byte 4096; give a range \
             inside it"
        );
        assert!(
            window(null, u64::MAX, Some(2), "img").is_err(),
            "no overflow"
        );
    }
}
