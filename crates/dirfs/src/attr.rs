//! Source attributes as the kernel's `fuse_attr`.

use fuse_abi::Attr;

/// `st` as FUSE attributes: the source's own inode numbers, modes, owners and times.
pub fn attr(st: &libc::stat) -> Attr {
    let rdev = st.st_rdev;
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    Attr {
        ino: st.st_ino,
        size: st.st_size as u64,
        blocks: st.st_blocks as u64,
        atime: st.st_atime as u64,
        mtime: st.st_mtime as u64,
        ctime: st.st_ctime as u64,
        atimensec: st.st_atime_nsec as u32,
        mtimensec: st.st_mtime_nsec as u32,
        ctimensec: st.st_ctime_nsec as u32,
        mode: st.st_mode,
        nlink: st.st_nlink as u32,
        uid: st.st_uid,
        gid: st.st_gid,
        // The kernel decodes this with new_decode_dev.
        rdev: (minor & 0xff) | (major << 8) | ((minor & !0xff) << 12),
        blksize: st.st_blksize as u32,
        flags: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_numbers_use_the_kernel_encoding() {
        // SAFETY: a zeroed stat is a valid value (plain integers).
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        st.st_rdev = libc::makedev(8, 0x123);
        st.st_mode = libc::S_IFCHR | 0o600;
        let a = attr(&st);
        assert_eq!(a.rdev, 0x23 | (8 << 8) | (0x100 << 12));
        assert_eq!(a.mode, libc::S_IFCHR | 0o600);
    }
}
