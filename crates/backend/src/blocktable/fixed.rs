//! What the [`BlockBackend`](crate::BlockBackend) of an image in a format fusex cannot resize
//! answers the same way whatever the format (the block-table core's and VMDK's): its
//! capabilities, its attributes from the image file, its refusal to resize.

use std::fs::Metadata;
use std::os::unix::fs::MetadataExt;

use crate::{Attrs, BackendError, Capabilities, Result};

/// Writable or not; never resized; not a raw file (its bytes are not the guest's).
pub(crate) fn capabilities(writable: bool) -> Capabilities {
    Capabilities {
        writable,
        resize: false,
        passthrough: crate::PassthroughSource::Formatted,
        ..Capabilities::default()
    }
}

/// The export's attributes: the image file's `m`, with `allocated` guest bytes.
pub(crate) fn attrs(m: &Metadata, allocated: u64) -> Attrs {
    Attrs {
        perm: m.mode() & 0o7777,
        uid: m.uid(),
        gid: m.gid(),
        allocated,
        atime: (m.atime(), m.atime_nsec() as u32),
        mtime: (m.mtime(), m.mtime_nsec() as u32),
        ctime: (m.ctime(), m.ctime_nsec() as u32),
    }
}

/// A resize of a `format` image of `size` bytes to `new_size`: nothing to do, or refused.
pub(crate) fn resize(format: &str, size: u64, new_size: u64) -> Result<()> {
    if new_size == size {
        return Ok(());
    }
    tracing::warn!("resizing a {format} image is not supported: use `qemu-img resize`");
    Err(BackendError::Unsupported)
}

/// Growing an image of `size` bytes to `new_size`: fine while it is no larger.
pub(crate) fn grow_to(size: u64, new_size: u64) -> Result<()> {
    if new_size <= size {
        Ok(())
    } else {
        Err(BackendError::Unsupported)
    }
}
