//! The transmission phase on the wire: request encoding and reply decoding, without I/O.
//!
//! A reply is read in steps whose sizes these functions dictate: the first 16 bytes (a whole
//! simple reply, or a structured chunk's header up to its cookie), then for a chunk its 4-byte
//! length and payload. Every decoder checks magic, type and length against what the protocol
//! allows before the caller trusts a number, so a hostile server can make a request fail or the
//! connection end, never make fusex read past a buffer.

/// Bytes of a request header (magic, flags, type, cookie, offset, length).
pub const REQUEST_LEN: usize = 28;
/// Bytes every reply starts with: a whole simple reply, or a chunk header up to its cookie.
pub const HEAD_LEN: usize = 16;
/// Bytes of a structured chunk's length field, which follows [`HEAD_LEN`].
pub const CHUNK_LEN_LEN: usize = 4;
/// Largest payload fusex accepts in an error chunk (its message is at most 4096 bytes), and the
/// most of a block status chunk the client holds at once (it reads longer ones in pieces of at
/// most this many bytes, see [`Extents`]).
pub const MAX_META_PAYLOAD: u32 = 8192;
/// Largest block status chunk fusex accepts: a context id and 2 Mi extents (qemu-nbd sends at
/// most 128 Ki per reply; the protocol asks servers to stay below 16 MB of descriptors).
pub const MAX_BLOCK_STATUS_PAYLOAD: u32 = 4 + 8 * (1 << 21);

const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// `NBD_REPLY_FLAG_DONE`: the last chunk of its request.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;

/// What a protocol violation was. Any of them ends the connection.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    /// The reply does not start with a known reply magic.
    #[error("bad reply magic {0:#010x}")]
    BadMagic(u32),
    /// A structured chunk of a type the client did not negotiate or that does not exist.
    #[error("unknown structured reply type {0}")]
    UnknownChunk(u16),
    /// A chunk's length is impossible for its type.
    #[error("structured reply chunk of type {ty} with impossible length {len}")]
    BadLength {
        /// Chunk type.
        ty: u16,
        /// Its length.
        len: u32,
    },
    /// The payload contradicts itself or the request (offsets outside it, a wrong context).
    #[error("malformed reply: {0}")]
    Malformed(&'static str),
}

/// Transmission commands fusex sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Command {
    /// `NBD_CMD_READ`.
    Read = 0,
    /// `NBD_CMD_WRITE`.
    Write = 1,
    /// `NBD_CMD_DISC`: a clean disconnect (no reply).
    Disc = 2,
    /// `NBD_CMD_FLUSH`.
    Flush = 3,
    /// `NBD_CMD_TRIM`.
    Trim = 4,
    /// `NBD_CMD_WRITE_ZEROES`.
    WriteZeroes = 6,
    /// `NBD_CMD_BLOCK_STATUS`.
    BlockStatus = 7,
}

/// Encodes a request header into `out`.
pub fn encode_request(
    out: &mut [u8; REQUEST_LEN],
    flags: u16,
    cmd: Command,
    cookie: u64,
    offset: u64,
    len: u32,
) {
    out[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&flags.to_be_bytes());
    out[6..8].copy_from_slice(&(cmd as u16).to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out[16..24].copy_from_slice(&offset.to_be_bytes());
    out[24..28].copy_from_slice(&len.to_be_bytes());
}

/// Kinds of structured reply chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Chunk {
    /// `NBD_REPLY_TYPE_NONE`: no payload; ends a request.
    None,
    /// `NBD_REPLY_TYPE_OFFSET_DATA`: an 8-byte offset, then data.
    OffsetData,
    /// `NBD_REPLY_TYPE_OFFSET_HOLE`: an offset and a length that read as zeroes.
    OffsetHole,
    /// `NBD_REPLY_TYPE_BLOCK_STATUS`: a context id and extents.
    BlockStatus,
    /// An error chunk (`NBD_REPLY_TYPE_ERROR`, `_ERROR_OFFSET` or an unknown error type): an error
    /// number and a message.
    Error,
}

impl Chunk {
    fn from_type(ty: u16) -> Result<Chunk, WireError> {
        Ok(match ty {
            0 => Chunk::None,
            1 => Chunk::OffsetData,
            2 => Chunk::OffsetHole,
            5 => Chunk::BlockStatus,
            t if t & 0x8000 != 0 => Chunk::Error,
            t => return Err(WireError::UnknownChunk(t)),
        })
    }

    /// Checks a chunk's length against its type: data chunks may be up to `max_data` bytes of
    /// data (plus their offset), block status at most [`MAX_BLOCK_STATUS_PAYLOAD`], everything
    /// else at most [`MAX_META_PAYLOAD`].
    pub fn check_len(self, ty: u16, len: u32, max_data: u32) -> Result<(), WireError> {
        let ok = match self {
            Chunk::None => len == 0,
            Chunk::OffsetData => len > 8 && len - 8 <= max_data,
            Chunk::OffsetHole => len == 12,
            Chunk::BlockStatus => {
                len >= 12 && (len - 4).is_multiple_of(8) && len <= MAX_BLOCK_STATUS_PAYLOAD
            }
            Chunk::Error => (6..=MAX_META_PAYLOAD).contains(&len),
        };
        if ok {
            Ok(())
        } else {
            Err(WireError::BadLength { ty, len })
        }
    }
}

/// The first [`HEAD_LEN`] bytes of a reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyHeader {
    /// A whole simple reply. For a successful READ, the data follows.
    Simple {
        /// NBD error number (0: success).
        error: u32,
        /// The request's cookie.
        cookie: u64,
    },
    /// A structured chunk; its 4-byte length follows.
    Chunk {
        /// Reply flags ([`REPLY_FLAG_DONE`]).
        flags: u16,
        /// Its kind.
        kind: Chunk,
        /// The raw type (for messages).
        ty: u16,
        /// The request's cookie.
        cookie: u64,
    },
}

impl ReplyHeader {
    /// Decodes the first 16 bytes of a reply.
    pub fn decode(b: &[u8; HEAD_LEN]) -> Result<ReplyHeader, WireError> {
        let magic = be32(&b[0..4]);
        let cookie = be64(&b[8..16]);
        match magic {
            SIMPLE_REPLY_MAGIC => Ok(ReplyHeader::Simple {
                error: be32(&b[4..8]),
                cookie,
            }),
            STRUCTURED_REPLY_MAGIC => {
                let ty = u16::from_be_bytes([b[6], b[7]]);
                Ok(ReplyHeader::Chunk {
                    flags: u16::from_be_bytes([b[4], b[5]]),
                    kind: Chunk::from_type(ty)?,
                    ty,
                    cookie,
                })
            }
            m => Err(WireError::BadMagic(m)),
        }
    }

    /// The cookie of the request this reply answers.
    pub fn cookie(&self) -> u64 {
        match *self {
            ReplyHeader::Simple { cookie, .. } | ReplyHeader::Chunk { cookie, .. } => cookie,
        }
    }
}

/// A chunk's length field.
pub fn chunk_len(b: &[u8; CHUNK_LEN_LEN]) -> u32 {
    u32::from_be_bytes(*b)
}

/// The offset an `OFFSET_DATA` or `OFFSET_HOLE` payload starts with, checked to lie inside the
/// request `[req_off, req_off + req_len)` together with `len` bytes after it. Returns the
/// position relative to the request.
pub fn place(payload_offset: u64, len: u64, req_off: u64, req_len: u64) -> Result<u64, WireError> {
    let rel = payload_offset
        .checked_sub(req_off)
        .ok_or(WireError::Malformed("chunk offset before the request"))?;
    let end = rel
        .checked_add(len)
        .ok_or(WireError::Malformed("chunk offset overflows"))?;
    if len == 0 || end > req_len {
        return Err(WireError::Malformed("chunk outside the request"));
    }
    Ok(rel)
}

/// Decodes an `OFFSET_HOLE` payload: (offset, length).
pub fn hole(p: &[u8]) -> Result<(u64, u32), WireError> {
    if p.len() != 12 {
        return Err(WireError::Malformed("hole chunk of the wrong size"));
    }
    Ok((be64(&p[0..8]), be32(&p[8..12])))
}

/// Decodes an error chunk's payload: the NBD error number (never 0: a zero error is itself a
/// violation, reported as `EIO` by the caller) and its message (lossy UTF-8, bounded).
pub fn error(p: &[u8]) -> Result<(u32, String), WireError> {
    if p.len() < 6 {
        return Err(WireError::Malformed("error chunk too short"));
    }
    let err = be32(&p[0..4]);
    let mlen = usize::from(u16::from_be_bytes([p[4], p[5]]));
    let msg = p
        .get(6..6 + mlen)
        .ok_or(WireError::Malformed("error message longer than its chunk"))?;
    if err == 0 {
        return Err(WireError::Malformed("error chunk with error 0"));
    }
    Ok((err, String::from_utf8_lossy(msg).into_owned()))
}

/// Decodes the first extent of a `BLOCK_STATUS` payload for context `ctx`: (length, flags).
pub fn first_extent(p: &[u8], ctx: u32) -> Result<(u32, u32), WireError> {
    if p.len() < 12 || !(p.len() - 4).is_multiple_of(8) {
        return Err(WireError::Malformed("block status chunk of the wrong size"));
    }
    if be32(&p[0..4]) != ctx {
        return Err(WireError::Malformed(
            "block status for a context not asked for",
        ));
    }
    let len = be32(&p[4..8]);
    if len == 0 {
        return Err(WireError::Malformed("block status extent of length 0"));
    }
    Ok((len, be32(&p[8..12])))
}

/// Bytes of one block status descriptor (an extent's length and flags).
pub const EXTENT_LEN: usize = 8;

/// What a block status reply said about the range asked for, summed while its descriptors are
/// read (in pieces, without holding the whole reply): the first extent (for `REQ_ONE` walks),
/// how much of the range the extents cover and how much of that is not a hole (for counting
/// allocated bytes without a request per extent). Extents beyond the range asked for are
/// ignored (a server may describe a longer first extent).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Extents {
    /// Length asked for: extents are counted up to it.
    pub limit: u64,
    /// The first extent (length, flags).
    pub first: Option<(u32, u32)>,
    /// Bytes from the start of the range the extents describe (at most `limit`).
    pub covered: u64,
    /// Of those, bytes in extents without `NBD_STATE_HOLE`.
    pub allocated: u64,
}

impl Extents {
    /// Nothing seen yet, for a request of `limit` bytes.
    pub fn new(limit: u64) -> Extents {
        Extents {
            limit,
            ..Extents::default()
        }
    }

    /// Adds the descriptors in `p` (a whole number of [`EXTENT_LEN`]-byte descriptors, the part
    /// of a block status chunk after its context id).
    pub fn add(&mut self, p: &[u8]) -> Result<(), WireError> {
        if !p.len().is_multiple_of(EXTENT_LEN) {
            return Err(WireError::Malformed("block status chunk of the wrong size"));
        }
        for d in p.chunks_exact(EXTENT_LEN) {
            let (len, flags) = (be32(&d[0..4]), be32(&d[4..8]));
            if len == 0 {
                return Err(WireError::Malformed("block status extent of length 0"));
            }
            self.first.get_or_insert((len, flags));
            let n = u64::from(len).min(self.limit - self.covered);
            self.covered += n;
            if flags & crate::STATE_HOLE == 0 {
                self.allocated += n;
            }
        }
        Ok(())
    }
}

/// Checks a block status chunk's context id (its first 4 bytes) against the one negotiated.
pub fn check_context(p: &[u8], ctx: u32) -> Result<(), WireError> {
    if p.len() < 4 {
        return Err(WireError::Malformed("block status chunk of the wrong size"));
    }
    if be32(&p[0..4]) != ctx {
        return Err(WireError::Malformed(
            "block status for a context not asked for",
        ));
    }
    Ok(())
}

fn be32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_be_bytes(a)
}

fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_layout() {
        let mut b = [0u8; REQUEST_LEN];
        encode_request(&mut b, 1, Command::Write, 0x0102, 4096, 512);
        assert_eq!(&b[0..4], &[0x25, 0x60, 0x95, 0x13]);
        assert_eq!(&b[4..8], &[0, 1, 0, 1]);
        assert_eq!(&b[8..16], &0x0102u64.to_be_bytes());
        assert_eq!(&b[16..24], &4096u64.to_be_bytes());
        assert_eq!(&b[24..28], &512u32.to_be_bytes());
    }

    #[test]
    fn reply_headers() {
        let mut b = [0u8; HEAD_LEN];
        b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        b[4..8].copy_from_slice(&5u32.to_be_bytes());
        b[8..16].copy_from_slice(&7u64.to_be_bytes());
        assert_eq!(
            ReplyHeader::decode(&b),
            Ok(ReplyHeader::Simple {
                error: 5,
                cookie: 7
            })
        );
        b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
        b[4..8].copy_from_slice(&[0, 1, 0, 1]);
        let h = ReplyHeader::decode(&b).unwrap();
        assert_eq!(
            h,
            ReplyHeader::Chunk {
                flags: REPLY_FLAG_DONE,
                kind: Chunk::OffsetData,
                ty: 1,
                cookie: 7
            }
        );
        b[6..8].copy_from_slice(&3u16.to_be_bytes());
        assert_eq!(ReplyHeader::decode(&b), Err(WireError::UnknownChunk(3)));
        b[6..8].copy_from_slice(&0x8001u16.to_be_bytes());
        assert!(matches!(
            ReplyHeader::decode(&b),
            Ok(ReplyHeader::Chunk {
                kind: Chunk::Error,
                ..
            })
        ));
        b[0] = 0;
        assert!(matches!(
            ReplyHeader::decode(&b),
            Err(WireError::BadMagic(_))
        ));
    }

    #[test]
    fn lengths() {
        assert!(Chunk::None.check_len(0, 0, 1 << 20).is_ok());
        assert!(Chunk::None.check_len(0, 1, 1 << 20).is_err());
        assert!(Chunk::OffsetData.check_len(1, 8, 1 << 20).is_err());
        assert!(Chunk::OffsetData
            .check_len(1, 8 + (1 << 20), 1 << 20)
            .is_ok());
        assert!(Chunk::OffsetData
            .check_len(1, 9 + (1 << 20), 1 << 20)
            .is_err());
        assert!(Chunk::OffsetHole.check_len(2, 12, 0).is_ok());
        assert!(Chunk::OffsetHole.check_len(2, 13, 0).is_err());
        assert!(Chunk::BlockStatus.check_len(5, 12, 0).is_ok());
        assert!(Chunk::BlockStatus.check_len(5, 16, 0).is_err());
        assert!(Chunk::BlockStatus.check_len(5, u32::MAX, 0).is_err());
        assert!(Chunk::Error.check_len(0x8001, 5, 0).is_err());
        assert!(Chunk::Error.check_len(0x8001, u32::MAX, 0).is_err());
    }

    #[test]
    fn placing_chunks() {
        assert_eq!(place(4096, 512, 4096, 4096), Ok(0));
        assert_eq!(place(8000, 192, 4096, 4096), Ok(3904));
        assert!(place(4095, 1, 4096, 4096).is_err());
        assert!(place(8000, 193, 4096, 4096).is_err());
        assert!(place(u64::MAX, 2, 4096, 1 << 30).is_err());
        assert!(place(4096, u64::MAX, 4096, 1 << 30).is_err());
        assert!(place(4096, 0, 4096, 4096).is_err());
    }

    #[test]
    fn payloads() {
        let mut p = Vec::new();
        p.extend_from_slice(&22u32.to_be_bytes());
        p.extend_from_slice(&3u16.to_be_bytes());
        p.extend_from_slice(b"bad");
        assert_eq!(error(&p), Ok((22, "bad".to_string())));
        p[5] = 200;
        assert!(error(&p).is_err());
        assert!(error(&[0, 0, 0, 0, 0, 0]).is_err());
        let mut bs = Vec::new();
        bs.extend_from_slice(&9u32.to_be_bytes());
        bs.extend_from_slice(&65536u32.to_be_bytes());
        bs.extend_from_slice(&3u32.to_be_bytes());
        assert_eq!(first_extent(&bs, 9), Ok((65536, 3)));
        assert!(first_extent(&bs, 8).is_err());
        assert!(first_extent(&bs[..11], 9).is_err());
        let mut h = 4096u64.to_be_bytes().to_vec();
        h.extend_from_slice(&512u32.to_be_bytes());
        assert_eq!(hole(&h), Ok((4096, 512)));
        assert!(hole(&h[..11]).is_err());
    }

    fn descriptors(ext: &[(u32, u32)]) -> Vec<u8> {
        let mut p = Vec::new();
        for (len, flags) in ext {
            p.extend_from_slice(&len.to_be_bytes());
            p.extend_from_slice(&flags.to_be_bytes());
        }
        p
    }

    #[test]
    fn extents_sum_allocated_bytes_within_the_range() {
        // data 4096, hole 8192, zero-but-allocated 4096, then data running past the range.
        let p = descriptors(&[(4096, 0), (8192, 3), (4096, 2), (65536, 0)]);
        let mut e = Extents::new(20480);
        // Read in two pieces, as the client does with long chunks.
        e.add(&p[..16]).unwrap();
        e.add(&p[16..]).unwrap();
        assert_eq!(e.first, Some((4096, 0)));
        assert_eq!(e.covered, 20480);
        assert_eq!(e.allocated, 4096 + 4096 + 4096);
        assert!(Extents::new(10).add(&p[..7]).is_err());
        assert!(Extents::new(10).add(&descriptors(&[(0, 0)])).is_err());
        let mut ctx = 9u32.to_be_bytes().to_vec();
        assert_eq!(check_context(&ctx, 9), Ok(()));
        assert!(check_context(&ctx, 8).is_err());
        ctx.pop();
        assert!(check_context(&ctx, 9).is_err());
        assert!(Chunk::BlockStatus.check_len(5, 4 + 8 * 4096, 0).is_ok());
        assert!(Chunk::BlockStatus
            .check_len(5, MAX_BLOCK_STATUS_PAYLOAD + 8, 0)
            .is_err());
    }

    proptest::proptest! {
        #[test]
        fn decoders_never_panic(b in proptest::collection::vec(proptest::num::u8::ANY, 0..64), ctx: u32) {
            let mut head = [0u8; HEAD_LEN];
            let n = b.len().min(HEAD_LEN);
            head[..n].copy_from_slice(&b[..n]);
            let _ = ReplyHeader::decode(&head);
            let _ = error(&b);
            let _ = hole(&b);
            let _ = first_extent(&b, ctx);
            let _ = check_context(&b, ctx);
            let mut e = Extents::new(u64::from(ctx));
            if e.add(&b).is_ok() {
                proptest::prop_assert!(e.allocated <= e.covered && e.covered <= e.limit);
            }
        }

        #[test]
        fn placed_chunks_stay_inside(off: u64, len: u64, req_off: u64, req_len in 0u64..(1 << 30)) {
            if let Ok(rel) = place(off, len, req_off, req_len) {
                proptest::prop_assert!(rel + len <= req_len);
            }
        }
    }
}
