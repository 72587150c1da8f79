//! The seam between the request server and what a mount serves: a single-file image
//! ([`crate::Export`]) or a directory tree (`fusex-dirfs`).

use std::future::Future;
use std::ops::Range;

use engine::{Buf, Engine};
use fuse_abi::{InHeader, ReadIn};

use crate::{Reply, Request, Tally};

/// What a queue serves. The server decodes a request, lowers it to a [`Request`] and calls
/// [`Filesystem::handle`]; it is generic over the filesystem (static dispatch: nothing boxed or
/// allocated per request).
pub trait Filesystem: Send + Sync + 'static {
    /// Whether this filesystem implements `opcode`. A request with bad arguments for an opcode it
    /// does not implement is answered ENOSYS, as a well-formed one would be, rather than with the
    /// decoder's EINVAL.
    fn serves(opcode: u32) -> bool;

    /// Serves one request. `buf[window]` is the payload window: WRITE data at its start on entry,
    /// the reply body at its start on return; nothing is read or written past its end. The
    /// request's [`crate::Span`]s point into `buf` and may overlap the window: read them before
    /// writing the reply. The buffer is taken and given back, since I/O lends it to the kernel.
    fn handle(
        &self,
        eng: &Engine,
        hdr: &InHeader,
        req: Request,
        buf: Buf,
        window: Range<usize>,
        tally: &Tally<'_>,
    ) -> impl Future<Output = (Reply, Buf)>;

    /// Where a READ could be answered by splicing from a file: the descriptor, offset and length
    /// (see [`crate::Export::splice_read`]). `None`: serve it normally.
    fn splice_read(
        &self,
        _hdr: &InHeader,
        _a: &ReadIn,
        _cap: usize,
    ) -> Option<(std::os::fd::RawFd, u64, usize)> {
        None
    }

    /// How INIT's answer lays out the requests the kernel sends (`FUSE_SETXATTR_EXT`): read
    /// for every request, so it must be cheap.
    fn layouts(&self) -> fuse_abi::Layouts {
        fuse_abi::Layouts::default()
    }

    /// The calling queue thread stops taking requests (per-thread state may wind down).
    fn queue_stopping(&self) {}

    /// The calling queue thread has ended (per-thread state goes with it).
    fn queue_ended(&self) {}
}
