//! A tiny in-memory [`BlockBackend`] that also checks the export's side of the backend contract.
//!
//! Stored bytes live in a `Vec` that may be shorter than the image (the rest reads as zeroes, a
//! hole), so an image can be grown to any size without memory. Every operation asserts it was
//! asked for something the export promises never to ask for (a read past the end, a write past
//! the end of a fixed-size image, ...): the fuzzer reports those as crashes.

use std::io;
use std::sync::{Mutex, MutexGuard};

use backend::{Attrs, BackendError, BlockBackend, Capabilities, Seek};
use engine::{Engine, Slice};

/// Granularity of the hole model: a block whose stored bytes are all zero is a hole.
pub const BLOCK: u64 = 4096;
/// Most bytes the backend stores; a write ending past this fails with EFBIG, like a file
/// system's file size limit.
pub const MAX_STORED: u64 = 2 << 20;
/// Owner the backend reports.
pub const OWNER: u32 = 1000;

/// The backend's state.
#[derive(Debug, Default)]
pub struct State {
    /// Stored bytes; the image reads as zeroes past them, up to `size`.
    pub data: Vec<u8>,
    /// Image length.
    pub size: u64,
}

/// A [`BlockBackend`] over a `Vec<u8>`.
pub struct Mem {
    state: Mutex<State>,
    growable: bool,
}

fn io_err(errno: i32) -> BackendError {
    BackendError::Io(io::Error::from_raw_os_error(errno))
}

impl Mem {
    /// An image of `size` bytes whose first `stored` bytes hold a pattern with no zero byte, the
    /// rest a hole. `growable` is the export's setting: only then may it grow the image.
    pub fn new(size: u64, stored: usize, growable: bool) -> Mem {
        let stored = stored.min(size as usize);
        Mem {
            state: Mutex::new(State {
                data: (0..stored).map(|i| (i % 251) as u8 + 1).collect(),
                size,
            }),
            growable,
        }
    }

    /// The state, for checks after a request.
    pub fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `len` bytes of the image from `off`, as a reader sees them.
    pub fn contents(&self, off: u64, len: usize) -> Vec<u8> {
        let s = self.state();
        let mut out = vec![0u8; len];
        if let Some(stored) = usize::try_from(off).ok().and_then(|o| s.data.get(o..)) {
            let k = stored.len().min(len);
            out[..k].copy_from_slice(&stored[..k]);
        }
        out
    }

    fn check_inside(s: &State, what: &str, off: u64, len: u64) {
        let end = off.checked_add(len);
        assert!(
            end.is_some_and(|e| e <= s.size),
            "export asked to {what} {len} bytes at {off} of a {}-byte image",
            s.size
        );
    }

    fn zero(s: &mut State, off: u64, len: u64) {
        let end = off.saturating_add(len).min(s.data.len() as u64);
        if off < end {
            s.data[off as usize..end as usize].fill(0);
        }
    }
}

impl BlockBackend for Mem {
    fn size(&self) -> u64 {
        self.state().size
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            writable: true,
            resize: true,
            ..Capabilities::default()
        }
    }

    async fn attrs(&self, _eng: &Engine) -> backend::Result<Attrs> {
        Ok(Attrs {
            perm: 0o644,
            uid: OWNER,
            gid: OWNER,
            allocated: self.state().data.len() as u64,
            atime: (1, 2),
            mtime: (3, 4),
            ctime: (5, 6),
        })
    }

    async fn read_at(
        &self,
        _eng: &Engine,
        mut win: Slice,
        off: u64,
    ) -> (backend::Result<usize>, Slice) {
        let s = self.state();
        Mem::check_inside(&s, "read", off, win.len() as u64);
        let dst = win.as_mut_slice();
        dst.fill(0);
        if let Some(stored) = usize::try_from(off).ok().and_then(|o| s.data.get(o..)) {
            let k = stored.len().min(dst.len());
            dst[..k].copy_from_slice(&stored[..k]);
        }
        let n = win.len();
        (Ok(n), win)
    }

    async fn write_at(
        &self,
        _eng: &Engine,
        win: Slice,
        off: u64,
    ) -> (backend::Result<usize>, Slice) {
        let mut s = self.state();
        let n = win.len() as u64;
        if !self.growable {
            Mem::check_inside(&s, "write", off, n);
        }
        let end = match off.checked_add(n) {
            Some(e) if e <= MAX_STORED => e,
            _ => return (Err(io_err(libc::EFBIG)), win),
        };
        if (s.data.len() as u64) < end {
            s.data.resize(end as usize, 0);
        }
        s.data[off as usize..end as usize].copy_from_slice(win.as_slice());
        (Ok(n as usize), win)
    }

    async fn flush(&self, _eng: &Engine) -> backend::Result<()> {
        Ok(())
    }

    async fn discard(&self, _eng: &Engine, off: u64, len: u64) -> backend::Result<()> {
        let mut s = self.state();
        Mem::check_inside(&s, "discard", off, len);
        Mem::zero(&mut s, off, len);
        Ok(())
    }

    async fn write_zeroes(&self, _eng: &Engine, off: u64, len: u64) -> backend::Result<()> {
        let mut s = self.state();
        Mem::check_inside(&s, "zero", off, len);
        Mem::zero(&mut s, off, len);
        Ok(())
    }

    async fn allocate(&self, _eng: &Engine, off: u64, len: u64) -> backend::Result<()> {
        Mem::check_inside(&self.state(), "allocate", off, len);
        Ok(())
    }

    async fn seek(&self, _eng: &Engine, off: u64, whence: Seek) -> backend::Result<Option<u64>> {
        let s = self.state();
        assert!(off < s.size, "seek at {off} of a {}-byte image", s.size);
        let stored_end = (s.data.len() as u64).min(s.size);
        let is_data = |blk: u64| {
            let lo = (blk * BLOCK).min(stored_end) as usize;
            let hi = ((blk + 1) * BLOCK).min(stored_end) as usize;
            s.data[lo..hi].iter().any(|&b| b != 0)
        };
        let want_data = whence == Seek::Data;
        let mut blk = off / BLOCK;
        while blk * BLOCK < stored_end {
            if is_data(blk) == want_data {
                return Ok(Some((blk * BLOCK).max(off)));
            }
            blk += 1;
        }
        // Past the stored bytes everything is a hole, and the end of the image counts as one.
        Ok((!want_data).then(|| (blk * BLOCK).max(off).min(s.size)))
    }

    async fn resize(&self, _eng: &Engine, new_size: u64) -> backend::Result<()> {
        assert!(self.growable, "resize of a fixed-size export");
        let mut s = self.state();
        s.size = new_size;
        let keep = usize::try_from(new_size).unwrap_or(usize::MAX);
        s.data.truncate(keep);
        Ok(())
    }

    async fn grow_to(&self, _eng: &Engine, new_size: u64) -> backend::Result<()> {
        assert!(self.growable, "grow_to on a fixed-size export");
        let mut s = self.state();
        s.size = s.size.max(new_size);
        Ok(())
    }

    fn written_to(&self, end: u64) {
        assert!(self.growable, "written_to on a fixed-size export");
        let mut s = self.state();
        s.size = s.size.max(end);
    }

    fn set_times(
        &self,
        _atime: Option<(i64, u32)>,
        _mtime: Option<(i64, u32)>,
    ) -> backend::Result<()> {
        Ok(())
    }
}
