//! A backend bounded to one byte range of another: a partition, or a range given by offset and
//! size (QEMU raw's `offset` and `size`), served as a file of its own.
//! Every offset is shifted by the range's start and every request is cut at its end, so no
//! read, write, discard or zeroing can reach outside it, whatever the caller asks; the size
//! is fixed (a partition cannot grow) and nothing hands the whole image's descriptor out
//! (no splice, no passthrough).

use std::io;
use std::sync::Arc;

use engine::{Engine, Slice};

use crate::{Attrs, BackendError, BackendStats, BlockBackend, Capabilities, Result, Seek};

/// `inner`'s bytes `[start, start + len)`, as a backend of `len` bytes.
pub struct Bounded<B> {
    inner: Arc<B>,
    start: u64,
    len: u64,
    number: Option<u32>,
}

fn enospc() -> BackendError {
    BackendError::Io(io::Error::from_raw_os_error(libc::ENOSPC))
}

impl<B: BlockBackend> Bounded<B> {
    /// Bounds `inner` to `[start, start + len)`, which the caller checked lies inside it:
    /// partition `number`, or (None) a range given by its offset and size.
    pub fn new(inner: Arc<B>, start: u64, len: u64, number: Option<u32>) -> Bounded<B> {
        debug_assert!(start.checked_add(len).is_some_and(|e| e <= inner.size()));
        Bounded {
            inner,
            start,
            len,
            number,
        }
    }

    /// The whole image.
    pub fn inner(&self) -> &Arc<B> {
        &self.inner
    }

    /// The partition's number; None for a range given by offset and size.
    pub fn number(&self) -> Option<u32> {
        self.number
    }

    /// Where the partition starts in the image.
    pub fn start(&self) -> u64 {
        self.start
    }

    /// `[off, off + len)` cut at the partition's end and shifted into the image; None when it
    /// starts at or past the end (or is empty).
    fn clip(&self, off: u64, len: u64) -> Option<(u64, u64)> {
        if off >= self.len || len == 0 {
            return None;
        }
        Some((self.start + off, len.min(self.len - off)))
    }
}

impl<B: BlockBackend> BlockBackend for Bounded<B> {
    fn size(&self) -> u64 {
        self.len
    }

    fn size_limit(&self) -> u64 {
        self.len
    }

    fn capabilities(&self) -> Capabilities {
        let inner = self.inner.capabilities();
        Capabilities {
            resize: false,
            passthrough: crate::PassthroughSource::Window,
            ..inner
        }
    }

    async fn attrs(&self, eng: &Engine) -> Result<Attrs> {
        let mut a = self.inner.attrs(eng).await?;
        // What the whole image holds, at most the partition: counting only the range would
        // mean walking its mapping on every GETATTR.
        a.allocated = a.allocated.min(self.len);
        Ok(a)
    }

    async fn read_at(&self, eng: &Engine, mut win: Slice, off: u64) -> (Result<usize>, Slice) {
        let Some((at, n)) = self.clip(off, win.len() as u64) else {
            return (Ok(0), win);
        };
        win.truncate(n as usize);
        self.inner.read_at(eng, win, at).await
    }

    async fn write_at(&self, eng: &Engine, mut win: Slice, off: u64) -> (Result<usize>, Slice) {
        if win.is_empty() {
            return (Ok(0), win);
        }
        let Some((at, n)) = self.clip(off, win.len() as u64) else {
            return (Err(enospc()), win);
        };
        win.truncate(n as usize);
        self.inner.write_at(eng, win, at).await
    }

    async fn flush(&self, eng: &Engine) -> Result<()> {
        self.inner.flush(eng).await
    }

    async fn discard(&self, eng: &Engine, off: u64, len: u64) -> Result<()> {
        match self.clip(off, len) {
            Some((at, n)) => self.inner.discard(eng, at, n).await,
            None if len == 0 => Ok(()),
            None => Err(enospc()),
        }
    }

    async fn write_zeroes(&self, eng: &Engine, off: u64, len: u64) -> Result<()> {
        match self.clip(off, len) {
            Some((at, n)) => self.inner.write_zeroes(eng, at, n).await,
            None if len == 0 => Ok(()),
            None => Err(enospc()),
        }
    }

    async fn allocate(&self, eng: &Engine, off: u64, len: u64) -> Result<()> {
        match self.clip(off, len) {
            Some((at, n)) => self.inner.allocate(eng, at, n).await,
            None if len == 0 => Ok(()),
            None => Err(enospc()),
        }
    }

    async fn seek(&self, eng: &Engine, off: u64, whence: Seek) -> Result<Option<u64>> {
        if off >= self.len {
            return Ok(None);
        }
        let end = self.start + self.len;
        let found = self.inner.seek(eng, self.start + off, whence).await?;
        Ok(match (found, whence) {
            (Some(at), _) if at < end => Some(at.max(self.start + off) - self.start),
            // The next data lies past the partition (or nowhere): none inside it.
            (_, Seek::Data) => None,
            // The partition's end counts as a hole.
            (_, Seek::Hole) => Some(self.len),
        })
    }

    fn durable_writes(&self) -> bool {
        self.inner.durable_writes()
    }

    async fn resize(&self, _eng: &Engine, _new_size: u64) -> Result<()> {
        Err(BackendError::Io(io::Error::from_raw_os_error(libc::EPERM)))
    }

    async fn grow_to(&self, _eng: &Engine, new_size: u64) -> Result<()> {
        if new_size <= self.len {
            return Ok(());
        }
        Err(enospc())
    }

    fn written_to(&self, _end: u64) {}

    fn set_times(&self, atime: Option<(i64, u32)>, mtime: Option<(i64, u32)>) -> Result<()> {
        self.inner.set_times(atime, mtime)
    }

    fn queue_stopping(&self) {
        self.inner.queue_stopping()
    }

    fn queue_ended(&self) {
        self.inner.queue_ended()
    }

    fn trouble(&self) -> Option<String> {
        self.inner.trouble()
    }

    fn drop_unused(&self) {
        self.inner.drop_unused()
    }

    fn stats(&self) -> BackendStats {
        self.inner.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::NullBackend;
    use engine::EngineConfig;

    /// A raw image of known bytes, partition `[4096, 4096 + 8192)`.
    fn setup() -> (tempfile::NamedTempFile, Bounded<crate::RawBackend>, Engine) {
        use std::io::Write;
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let data: Vec<u8> = (0..16384u32).map(|i| (i % 251) as u8).collect();
        f.write_all(&data).unwrap();
        let raw = crate::RawBackend::open(f.path(), true, false, None).unwrap();
        let b = Bounded::new(Arc::new(raw), 4096, 8192, Some(1));
        let eng = Engine::new(&EngineConfig {
            buffers: 1,
            buffer_size: 16384,
            ..Default::default()
        })
        .unwrap();
        (f, b, eng)
    }

    #[test]
    fn requests_stay_inside_the_range() {
        use std::os::unix::fs::FileExt;
        let (f, b, eng) = setup();
        fn on<F: std::future::Future>(eng: &Engine, fut: F) -> F::Output {
            eng.block_on(fut).unwrap()
        }
        assert_eq!(b.size(), 8192);
        let buf = eng.take_buffer().unwrap();
        // A read crossing the end is cut there.
        let (n, win) = on(&eng, b.read_at(&eng, buf.slice(0..16384), 4096));
        assert_eq!(n.unwrap(), 4096);
        let want: Vec<u8> = (8192..12288u32).map(|i| (i % 251) as u8).collect();
        assert_eq!(&win.as_slice()[..4096], &want[..]);
        // A write crossing the end lands only inside.
        let mut buf = win.into_inner();
        buf.as_mut_slice().fill(0xee);
        let (n, win) = on(&eng, b.write_at(&eng, buf.slice(0..16384), 8000));
        assert_eq!(n.unwrap(), 192);
        let (n, win) = on(&eng, b.write_at(&eng, win.into_inner().slice(0..10), 8192));
        assert_eq!(n.unwrap_err().errno(), libc::ENOSPC);
        drop(win);
        on(&eng, b.write_zeroes(&eng, 0, 1 << 30)).unwrap();
        assert_eq!(
            on(&eng, b.discard(&eng, 8192, 1)).unwrap_err().errno(),
            libc::ENOSPC
        );
        let mut all = vec![0u8; 16384];
        f.as_file().read_exact_at(&mut all, 0).unwrap();
        for (i, &x) in all.iter().enumerate() {
            let outside = !(4096..12288).contains(&i);
            if outside {
                assert_eq!(x, (i % 251) as u8, "byte {i} outside the partition changed");
            } else {
                assert_eq!(x, 0, "byte {i} inside was zeroed");
            }
        }
        assert_eq!(
            on(&eng, b.grow_to(&eng, 8193)).unwrap_err().errno(),
            libc::ENOSPC
        );
        assert!(!b.capabilities().resize);
        assert_eq!(
            b.capabilities().passthrough,
            crate::PassthroughSource::Window
        );
    }

    #[test]
    fn block_status_is_clipped() {
        let eng = Engine::new(&EngineConfig::default()).unwrap();
        let b = Bounded::new(
            Arc::new(NullBackend::new(1 << 20, false)),
            4096,
            8192,
            Some(1),
        );
        let on = |off, whence| eng.block_on(b.seek(&eng, off, whence)).unwrap().unwrap();
        assert_eq!(on(0, Seek::Data), Some(0));
        assert_eq!(on(100, Seek::Hole), Some(8192));
        assert_eq!(on(8192, Seek::Data), None);
    }
}
