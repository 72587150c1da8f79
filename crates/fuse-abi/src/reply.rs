//! Encoding replies: an [`OutHeader`] followed by at most one reply body.
//!
//! The kernel rejects (and then never completes) a reply whose error is
//! positive or below -511, or an error reply that carries a payload, so these
//! functions refuse to produce such bytes.

use zerocopy::{Immutable, IntoBytes};

use crate::structs::OutHeader;

/// Size of [`OutHeader`], the prefix of every reply.
pub const OUT_HEADER_LEN: usize = 16;
const _: () = assert!(OUT_HEADER_LEN == core::mem::size_of::<OutHeader>());

/// errno used when a caller asks for an error the kernel would refuse.
const EIO: i32 = 5;
/// The kernel accepts reply errors in `-511..=0`.
const MAX_ERRNO: i32 = 511;

/// Why a reply could not be encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// The output buffer is shorter than the bytes to write.
    #[error("reply needs {need} bytes but the buffer holds {have}")]
    BufferTooSmall {
        /// Bytes required.
        need: usize,
        /// Bytes available.
        have: usize,
    },
    /// Header plus payload would not fit the 32-bit length field.
    #[error("reply payload of {len} bytes is too large")]
    PayloadTooLarge {
        /// The payload length asked for.
        len: usize,
    },
    /// The error field is outside `-511..=0`, or an error reply has a payload.
    #[error("invalid reply error {error} with {payload_len} payload bytes")]
    InvalidError {
        /// The error field asked for.
        error: i32,
        /// The payload length asked for.
        payload_len: usize,
    },
}

/// Writes an OutHeader for a reply of `payload_len` bytes after it; returns the total length.
///
/// Only the first [`OUT_HEADER_LEN`] bytes of `buf` are written: the caller
/// places the payload (directly after the header for `/dev/fuse`, or in the
/// ring payload buffer for io_uring). `error` is 0 or a negated errno; a
/// nonzero `error` requires `payload_len == 0`.
pub fn write_header(
    buf: &mut [u8],
    unique: u64,
    error: i32,
    payload_len: usize,
) -> Result<usize, EncodeError> {
    if !(-MAX_ERRNO..=0).contains(&error) || (error != 0 && payload_len != 0) {
        return Err(EncodeError::InvalidError { error, payload_len });
    }
    let too_large = EncodeError::PayloadTooLarge { len: payload_len };
    let total = payload_len.checked_add(OUT_HEADER_LEN).ok_or(too_large)?;
    let len = u32::try_from(total).map_err(|_| too_large)?;
    let header = OutHeader { len, error, unique };
    header
        .write_to_prefix(buf)
        .map_err(|_| EncodeError::BufferTooSmall {
            need: OUT_HEADER_LEN,
            have: buf.len(),
        })?;
    Ok(total)
}

/// Error reply (error is a positive errno; encoded as -errno). Returns 16.
///
/// An `errno` outside `1..=511` (which the kernel would reject, leaving the
/// request hanging) is replaced by EIO.
pub fn encode_error(buf: &mut [u8], unique: u64, errno: i32) -> Result<usize, EncodeError> {
    let errno = if (1..=MAX_ERRNO).contains(&errno) {
        errno
    } else {
        EIO
    };
    write_header(buf, unique, -errno, 0)
}

/// Header + one struct. Returns total length.
///
/// `T` may also be a byte slice, which makes this the encoder for READ data.
pub fn encode<T: IntoBytes + Immutable + ?Sized>(
    buf: &mut [u8],
    unique: u64,
    value: &T,
) -> Result<usize, EncodeError> {
    encode_bytes(buf, unique, value.as_bytes())
}

/// Header + raw payload bytes (e.g. READ data). Returns total length.
pub fn encode_bytes(buf: &mut [u8], unique: u64, payload: &[u8]) -> Result<usize, EncodeError> {
    let need = OUT_HEADER_LEN
        .checked_add(payload.len())
        .ok_or(EncodeError::PayloadTooLarge { len: payload.len() })?;
    let Some(dst) = buf.get_mut(..need) else {
        return Err(EncodeError::BufferTooSmall {
            need,
            have: buf.len(),
        });
    };
    let total = write_header(dst, unique, 0, payload.len())?;
    dst[OUT_HEADER_LEN..].copy_from_slice(payload);
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::structs::{AttrOut, InitOut, OpenOut, WriteOut};
    use zerocopy::FromBytes;

    fn read_header(buf: &[u8]) -> OutHeader {
        OutHeader::read_from_prefix(buf).expect("header").0
    }

    #[test]
    fn error_reply() {
        let mut buf = [0xAAu8; 64];
        assert_eq!(encode_error(&mut buf, 77, 2), Ok(16));
        // Hand-decode the wire bytes.
        assert_eq!(&buf[0..4], &16u32.to_ne_bytes());
        assert_eq!(&buf[4..8], &(-2i32).to_ne_bytes());
        assert_eq!(&buf[8..16], &77u64.to_ne_bytes());
        assert_eq!(buf[16], 0xAA, "nothing written past the header");
    }

    #[test]
    fn error_reply_sanitises_errno() {
        let mut buf = [0u8; 16];
        for bad in [0, -1, 512, i32::MIN, i32::MAX] {
            encode_error(&mut buf, 1, bad).unwrap();
            assert_eq!(read_header(&buf).error, -EIO);
        }
        encode_error(&mut buf, 1, 511).unwrap();
        assert_eq!(read_header(&buf).error, -511);
    }

    #[test]
    fn struct_round_trip() {
        let out = OpenOut {
            fh: 5,
            open_flags: 1,
            backing_id: 3,
        };
        let mut buf = [0u8; 64];
        let n = encode(&mut buf, 0xDEAD_BEEF, &out).unwrap();
        assert_eq!(n, 32);
        let h = read_header(&buf);
        assert_eq!(
            h,
            OutHeader {
                len: 32,
                error: 0,
                unique: 0xDEAD_BEEF
            }
        );
        assert_eq!(OpenOut::read_from_bytes(&buf[16..32]).unwrap(), out);

        let n = encode(
            &mut buf,
            1,
            &WriteOut {
                size: 9,
                padding: 0,
            },
        )
        .unwrap();
        assert_eq!(n, 24);
        assert_eq!(read_header(&buf).len, 24);

        let mut big = [0u8; 256];
        assert_eq!(encode(&mut big, 1, &InitOut::default()), Ok(80));
        assert_eq!(encode(&mut big, 1, &AttrOut::default()), Ok(120));
    }

    #[test]
    fn bytes_payload() {
        let mut buf = [0u8; 32];
        let n = encode_bytes(&mut buf, 4, b"hello").unwrap();
        assert_eq!(n, 21);
        assert_eq!(&buf[16..21], b"hello");
        assert_eq!(encode(&mut buf, 4, &b"hi"[..]), Ok(18));
        assert_eq!(read_header(&buf).len, 18);
    }

    #[test]
    fn too_small() {
        let mut buf = [0u8; 20];
        assert_eq!(
            encode(&mut buf, 1, &OpenOut::default()),
            Err(EncodeError::BufferTooSmall { need: 32, have: 20 })
        );
        let mut tiny = [0u8; 15];
        assert_eq!(
            encode_error(&mut tiny, 1, 5),
            Err(EncodeError::BufferTooSmall { need: 16, have: 15 })
        );
        assert!(write_header(&mut tiny, 1, 0, 0).is_err());
    }

    #[test]
    fn header_for_separate_payload() {
        let mut buf = [0u8; 16];
        assert_eq!(write_header(&mut buf, 3, 0, 4096), Ok(4112));
        assert_eq!(read_header(&buf).len, 4112);
        assert_eq!(
            write_header(&mut buf, 3, 0, usize::MAX),
            Err(EncodeError::PayloadTooLarge { len: usize::MAX })
        );
        assert!(write_header(&mut buf, 3, 0, u32::MAX as usize - 16).is_ok());
        assert!(write_header(&mut buf, 3, 0, u32::MAX as usize - 15).is_err());
    }

    #[test]
    fn invalid_errors_rejected() {
        let mut buf = [0u8; 16];
        assert!(write_header(&mut buf, 1, -5, 8).is_err());
        assert!(write_header(&mut buf, 1, 5, 0).is_err());
        assert!(write_header(&mut buf, 1, -512, 0).is_err());
        assert_eq!(write_header(&mut buf, 1, -511, 0), Ok(16));
    }
}
