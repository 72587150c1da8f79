//! The one error-reply path: what the out header says for a reply, on either framing.

use export::Reply;

/// Largest errno the kernel takes in a reply (`-511..=0`); anything else becomes `EIO`.
pub const MAX_ERRNO: i32 = 511;

/// The out header's `error` (0 or a negative errno) and payload length for `reply` when
/// `capacity` payload bytes fit, or `None` for a request that takes no reply.
///
/// Both framings go through here, so they agree: errno 0 or outside `1..=511` is `EIO`, and a
/// reply body longer than the buffer (a bug, never input-driven) is `EIO` with a log line, not a
/// clamped or dropped reply.
pub fn reply_parts(reply: Reply, capacity: usize) -> Option<(i32, usize)> {
    match reply {
        Reply::None => None,
        Reply::Data(len) if len <= capacity => Some((0, len)),
        Reply::Data(len) => {
            tracing::error!("reply of {len} bytes does not fit the {capacity}-byte payload area");
            Some((-libc::EIO, 0))
        }
        Reply::Error(e) if (1..=MAX_ERRNO).contains(&e) => Some((-e, 0)),
        Reply::Error(e) => {
            tracing::debug!("errno {e} cannot travel in a reply; sending EIO");
            Some((-libc::EIO, 0))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reply_maps_to_what_the_kernel_takes() {
        assert_eq!(reply_parts(Reply::None, 10), None);
        assert_eq!(reply_parts(Reply::Data(10), 10), Some((0, 10)));
        assert_eq!(reply_parts(Reply::Data(11), 10), Some((-libc::EIO, 0)));
        assert_eq!(
            reply_parts(Reply::Error(libc::ENOSPC), 0),
            Some((-libc::ENOSPC, 0))
        );
        assert_eq!(reply_parts(Reply::Error(0), 0), Some((-libc::EIO, 0)));
        assert_eq!(reply_parts(Reply::Error(-3), 0), Some((-libc::EIO, 0)));
        assert_eq!(reply_parts(Reply::Error(512), 0), Some((-libc::EIO, 0)));
        assert_eq!(reply_parts(Reply::Error(511), 0), Some((-511, 0)));
    }
}
