//! The NBD protocol, as fusex's client speaks it (see `docs/nbd.md` and the protocol's
//! `doc/proto.md`): URIs ([`uri`]), the fixed-newstyle handshake over any blocking stream
//! ([`mod@handshake`]) and the transmission phase's request and reply encoding ([`wire`]).
//!
//! No I/O happens in [`wire`]: the backend moves the bytes on its queue's io_uring and uses these
//! functions to build requests and check replies. Everything that reads server bytes is
//! panic-free and bounds-checked: a server is untrusted input.

pub mod handshake;
pub mod uri;
pub mod wire;

pub use handshake::{greet, handshake, negotiate, start_tls, Export, HandshakeError};
pub use uri::{NbdUri, Tls, Transport, UriError};
pub use wire::{Chunk, Command, ReplyHeader, WireError, REQUEST_LEN};

/// `NBD_FLAG_HAS_FLAGS`: transmission flags are valid.
pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
/// `NBD_FLAG_READ_ONLY`.
pub const FLAG_READ_ONLY: u16 = 1 << 1;
/// `NBD_FLAG_SEND_FLUSH`.
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
/// `NBD_FLAG_SEND_FUA`.
pub const FLAG_SEND_FUA: u16 = 1 << 3;
/// `NBD_FLAG_SEND_TRIM` (fusex does not send TRIM: it leaves contents unspecified, and a
/// punched hole must read as zeroes).
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
/// `NBD_FLAG_SEND_WRITE_ZEROES`.
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// `NBD_FLAG_CAN_MULTI_CONN`: writes flushed on one connection are visible on all of them.
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;

/// `NBD_CMD_FLAG_FUA`: the write is durable when answered.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// `NBD_CMD_FLAG_NO_HOLE`: WRITE_ZEROES must leave the range allocated.
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// `NBD_CMD_FLAG_REQ_ONE`: BLOCK_STATUS answers with one extent only.
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;

/// `NBD_STATE_HOLE` in a `base:allocation` extent: the range is not allocated.
pub const STATE_HOLE: u32 = 1 << 0;
/// `NBD_STATE_ZERO` in a `base:allocation` extent: the range reads as zeroes.
pub const STATE_ZERO: u32 = 1 << 1;

/// The default TCP port of `nbd://` URIs.
pub const DEFAULT_PORT: u16 = 10809;

/// Maps an NBD error number (the protocol's own set, Linux values) to the errno fusex reports.
/// Unknown values become `EIO`: a server's numbers are not trusted to be meaningful locally.
pub fn errno_of(nbd_error: u32) -> i32 {
    match nbd_error {
        1 => 1,   // EPERM
        5 => 5,   // EIO
        12 => 12, // ENOMEM
        22 => 22, // EINVAL
        28 => 28, // ENOSPC
        75 => 75, // EOVERFLOW
        95 => 95, // ENOTSUP
        108 => 5, // ESHUTDOWN: the server is going away; the request failed
        _ => 5,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_known_errnos() {
        assert_eq!(errno_of(28), 28);
        assert_eq!(errno_of(108), 5);
        assert_eq!(errno_of(0xdead_beef), 5);
    }
}
