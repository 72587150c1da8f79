//! COPY_FILE_RANGE and COPY_FILE_RANGE_64: `copy_file_range(2)` between the two handles' source
//! files, so a copy through the mount is one call on the source (a reflink where the source
//! filesystem has them) instead of a READ and a WRITE per chunk.

use engine::Buf;
use fuse_abi::{CopyFileRangeIn, CopyFileRangeOut, WriteOut};

use crate::sys;
use crate::{put, DirFs, R};

/// Most bytes one request copies. A copy runs on the queue thread like every metadata call, so
/// this bounds how long it holds the thread's other requests up; callers of `copy_file_range`
/// go on from a short count as from any short copy.
pub(crate) const COPY_CHUNK: u64 = 64 << 20;

impl DirFs {
    /// Copies `a.len` bytes (at most [`COPY_CHUNK`]) from the header's file (`a.fh_in`) to
    /// `a.fh_out`; answers with the count, in 64 bits (`wide`, COPY_FILE_RANGE_64) or in a
    /// `fuse_write_out`.
    pub(crate) fn copy_file_range(
        &self,
        a: CopyFileRangeIn,
        wide: bool,
        buf: &mut Buf,
        payload: usize,
    ) -> R {
        self.writable()?;
        // copy_file_range(2) takes no flags yet; the kernel checked, an untrusted request may not.
        if a.flags != 0 {
            return Err(libc::EINVAL);
        }
        let from = self.files.get(a.fh_in).ok_or(libc::EBADF)?;
        let to = self.files.get(a.fh_out).ok_or(libc::EBADF)?;
        let len = a.len.min(COPY_CHUNK) as usize;
        let n = sys::copy_range(from, a.off_in, to, a.off_out, len)?;
        if wide {
            put(
                buf,
                payload,
                &CopyFileRangeOut {
                    bytes_copied: n as u64,
                },
            )
        } else {
            // n <= COPY_CHUNK < 2^32.
            put(
                buf,
                payload,
                &WriteOut {
                    size: n as u32,
                    padding: 0,
                },
            )
        }
    }
}
