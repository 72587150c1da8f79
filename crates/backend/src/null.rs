//! `null:SIZE`: reads zeroes, drops writes. It measures the transport alone.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use engine::{Engine, Slice};

use crate::{Attrs, BlockBackend, Capabilities, OpenError, Result, Seek};

/// A backend with no storage behind it.
pub struct NullBackend {
    size: AtomicU64,
    writable: bool,
    created: (i64, u32),
}

/// Parses a size such as `4096`, `512K`, `64M`, `1G`, `2T` (binary units; `KiB`/`MiB`/... accepted).
pub fn parse_size(s: &str) -> std::result::Result<u64, OpenError> {
    let bad = || OpenError::BadSize(s.to_string());
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: u64 = num.parse().map_err(|_| bad())?;
    let shift = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KIB" => 10,
        "M" | "MIB" => 20,
        "G" | "GIB" => 30,
        "T" | "TIB" => 40,
        _ => return Err(bad()),
    };
    let v = n.checked_mul(1u64 << shift).ok_or_else(bad)?;
    if v == 0 || v > i64::MAX as u64 {
        return Err(bad());
    }
    Ok(v)
}

impl NullBackend {
    /// A null image of `size` bytes.
    pub fn new(size: u64, writable: bool) -> NullBackend {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        NullBackend {
            size: AtomicU64::new(size),
            writable,
            created: (now.as_secs() as i64, now.subsec_nanos()),
        }
    }
}

impl BlockBackend for NullBackend {
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            writable: self.writable,
            resize: true,
            ..Capabilities::default()
        }
    }

    async fn attrs(&self, _eng: &Engine) -> Result<Attrs> {
        // SAFETY: getuid/getgid cannot fail.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        Ok(Attrs {
            perm: 0o644,
            uid,
            gid,
            allocated: 0,
            atime: self.created,
            mtime: self.created,
            ctime: self.created,
        })
    }

    async fn read_at(&self, _eng: &Engine, mut win: Slice, off: u64) -> (Result<usize>, Slice) {
        let n = (self.size().saturating_sub(off)).min(win.len() as u64) as usize;
        win.as_mut_slice()[..n].fill(0);
        (Ok(n), win)
    }

    async fn write_at(&self, _eng: &Engine, win: Slice, _off: u64) -> (Result<usize>, Slice) {
        (Ok(win.len()), win)
    }

    async fn flush(&self, _eng: &Engine) -> Result<()> {
        Ok(())
    }

    async fn discard(&self, _eng: &Engine, _off: u64, _len: u64) -> Result<()> {
        Ok(())
    }

    async fn write_zeroes(&self, _eng: &Engine, _off: u64, _len: u64) -> Result<()> {
        Ok(())
    }

    async fn allocate(&self, _eng: &Engine, _off: u64, _len: u64) -> Result<()> {
        Ok(())
    }

    async fn seek(&self, _eng: &Engine, off: u64, whence: Seek) -> Result<Option<u64>> {
        let size = self.size();
        Ok(match whence {
            Seek::Data if off < size => Some(off),
            Seek::Data => None,
            Seek::Hole => Some(size.max(off)),
        })
    }

    async fn resize(&self, _eng: &Engine, new_size: u64) -> Result<()> {
        self.size.store(new_size, Ordering::Release);
        Ok(())
    }

    async fn grow_to(&self, _eng: &Engine, new_size: u64) -> Result<()> {
        self.size.fetch_max(new_size, Ordering::AcqRel);
        Ok(())
    }

    fn written_to(&self, end: u64) {
        self.size.fetch_max(end, Ordering::AcqRel);
    }

    fn set_times(&self, _atime: Option<(i64, u32)>, _mtime: Option<(i64, u32)>) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("512K").unwrap(), 512 << 10);
        assert_eq!(parse_size("64m").unwrap(), 64 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("2TiB").unwrap(), 2 << 40);
        for bad in [
            "",
            "abc",
            "0",
            "12Q",
            "G",
            "1.5G",
            "99999999999999999999",
            "9999999999T",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?} should be rejected");
        }
    }
}
