//! Messages the server sends the kernel unasked (`unique` 0 on `/dev/fuse`).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use fuse_abi::{NotifyInvalInodeOut, OutHeader, FUSE_NOTIFY_INVAL_INODE};
use zerocopy::IntoBytes;

/// Tells the kernel that node `ino` changed behind its back (the image was resized by another
/// program, say): it drops the node's cached attributes, so the next `stat` asks fusex, and its
/// cached pages, so no stale data is read past a new end. Works on any fd of the connection,
/// whichever transport serves requests.
pub fn notify_inval_inode(fd: BorrowedFd<'_>, ino: u64) -> io::Result<()> {
    let body = NotifyInvalInodeOut {
        ino,
        off: 0,
        len: 0,
    };
    let header = OutHeader {
        len: (size_of::<OutHeader>() + size_of::<NotifyInvalInodeOut>()) as u32,
        error: FUSE_NOTIFY_INVAL_INODE,
        unique: 0,
    };
    let iov = [
        libc::iovec {
            iov_base: header.as_bytes().as_ptr() as *mut libc::c_void,
            iov_len: size_of::<OutHeader>(),
        },
        libc::iovec {
            iov_base: body.as_bytes().as_ptr() as *mut libc::c_void,
            iov_len: size_of::<NotifyInvalInodeOut>(),
        },
    ];
    // SAFETY: both iovecs point at live structs of the stated lengths, which the kernel only
    // reads; the fd is borrowed for the call.
    let n = unsafe { libc::writev(fd.as_raw_fd(), iov.as_ptr(), 2) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
