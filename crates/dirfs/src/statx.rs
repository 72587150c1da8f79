//! STATX: `statx(2)` of the node (on the ring), for what GETATTR's `fuse_attr` cannot carry (the birth time,
//! the `STATX_ATTR_*` flags). The kernel asks for it when a caller's `statx` wants a field beyond
//! the basic ones; without an answer it falls back to GETATTR and reports no birth time.

use std::os::fd::AsFd;

use engine::{Buf, Engine};
use fuse_abi::{InHeader, Statx, StatxIn, StatxOut, SxTime};

use crate::{put, DirFs, R};

/// The fields `fuse_statx` has room for: the basic ones and the birth time. Newer ones the
/// source may fill (mount id, direct I/O alignment, ...) are not passed on.
const CARRIED: u32 = libc::STATX_BASIC_STATS | libc::STATX_BTIME;

impl DirFs {
    /// STATX: the node's `statx(2)` (of the open file, when the kernel names a handle), with
    /// the fields and the sync behaviour (`AT_STATX_FORCE_SYNC`, `AT_STATX_DONT_SYNC`) the kernel
    /// asked for.
    pub(crate) async fn statx(
        &self,
        eng: &Engine,
        hdr: &InHeader,
        a: StatxIn,
        buf: &mut Buf,
        payload: usize,
    ) -> R {
        let node = self.node(hdr.nodeid)?;
        let sync = (a.sx_flags as i32) & libc::AT_STATX_SYNC_TYPE;
        let sx = match self.named_file(a.getattr_flags, a.fh) {
            Some(fd) => {
                self.statx_fd(eng, crate::borrow(fd), sync, a.sx_mask)
                    .await?
            }
            None => {
                self.statx_fd(eng, node.fd()?.as_fd(), sync, a.sx_mask)
                    .await?
            }
        };
        let out = StatxOut {
            attr_valid: self.cfg.attr_valid.as_secs(),
            attr_valid_nsec: self.cfg.attr_valid.subsec_nanos(),
            stat: fuse_statx(&sx),
            ..StatxOut::default()
        };
        put(buf, payload, &out)
    }
}

/// `struct statx` as `fuse_statx` carries it.
pub(crate) fn fuse_statx(sx: &libc::statx) -> Statx {
    let time = |t: &libc::statx_timestamp| SxTime {
        tv_sec: t.tv_sec,
        tv_nsec: t.tv_nsec,
        reserved: 0,
    };
    Statx {
        mask: sx.stx_mask & CARRIED,
        blksize: sx.stx_blksize,
        attributes: sx.stx_attributes,
        nlink: sx.stx_nlink,
        uid: sx.stx_uid,
        gid: sx.stx_gid,
        mode: sx.stx_mode,
        ino: sx.stx_ino,
        size: sx.stx_size,
        blocks: sx.stx_blocks,
        attributes_mask: sx.stx_attributes_mask,
        atime: time(&sx.stx_atime),
        btime: time(&sx.stx_btime),
        ctime: time(&sx.stx_ctime),
        mtime: time(&sx.stx_mtime),
        rdev_major: sx.stx_rdev_major,
        rdev_minor: sx.stx_rdev_minor,
        dev_major: sx.stx_dev_major,
        dev_minor: sx.stx_dev_minor,
        ..Statx::default()
    }
}
