//! The `nbd_reply` target: untrusted NBD server bytes through fusex's client-side parsers
//! (`crates/nbd`), the way the client meets them: the fixed-newstyle handshake's option replies
//! (with and without `NBD_OPT_STARTTLS`), and a transmission-phase stream of simple and
//! structured replies walked exactly as `nbd_client/conn.rs` walks it (head, cookie, chunk
//! length, then the chunk's payload). Nothing may panic, and whatever the parsers accept must
//! keep their promises (data and holes inside the request, error numbers from the known set,
//! block sizes consistent).

use std::io::{self, Read, Write};

use nbd::wire::{self, Chunk, Command, ReplyHeader, CHUNK_LEN_LEN, HEAD_LEN};
use nbd::Export;

/// What one input reached, for the seed tests.
#[derive(Clone, Copy, Debug, Default)]
pub struct Summary {
    /// The handshake negotiated an export.
    pub export: bool,
    /// The server accepted `NBD_OPT_STARTTLS`.
    pub tls: bool,
    /// Replies and chunks walked in the transmission phase.
    pub replies: usize,
    /// Requests that got their final reply.
    pub done: usize,
    /// READ bytes placed (data and holes).
    pub placed: u64,
}

/// The server's bytes as a blocking stream; what the client writes is dropped.
struct Server<'a>(&'a [u8]);

impl Read for Server<'_> {
    fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
        self.0.read(b)
    }
}

impl Write for Server<'_> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The requests in flight while the transmission-phase replies arrive: cookie, command,
/// offset, length (cookies built as the client builds them: generation above slot index).
pub const REQUESTS: [(u64, Command, u64, u32); 7] = [
    ((1 << 16), Command::Read, 0, 65536),
    ((2 << 16) | 1, Command::Read, 1 << 20, 4096),
    ((3 << 16) | 2, Command::Read, 12345 * 512, 131072),
    ((4 << 16) | 3, Command::Write, 8192, 4096),
    ((5 << 16) | 4, Command::Flush, 0, 0),
    ((6 << 16) | 5, Command::BlockStatus, 1 << 30, 1 << 20),
    ((7 << 16) | 6, Command::WriteZeroes, 0, 1 << 20),
];

/// The `base:allocation` context id the transmission phase pretends was negotiated.
pub const CONTEXT: u32 = 1;

/// Errnos [`nbd::errno_of`] may answer.
const ERRNOS: [i32; 7] = [1, 5, 12, 22, 28, 75, 95];

/// One fuzz input: its first byte picks the phase (handshake; handshake with STARTTLS;
/// transmission), the rest is what the server sends.
pub fn run(data: &[u8]) -> Summary {
    let Some((&mode, rest)) = data.split_first() else {
        return Summary::default();
    };
    match mode % 3 {
        0 => handshake(rest, false),
        1 => handshake(rest, true),
        _ => replies(rest),
    }
}

fn handshake(data: &[u8], tls: bool) -> Summary {
    let mut s = Server(data);
    let mut sum = Summary::default();
    if nbd::greet(&mut s).is_err() {
        return sum;
    }
    if tls {
        if nbd::start_tls(&mut s).is_err() {
            return sum;
        }
        // The rest stands for what the TLS session decrypts.
        sum.tls = true;
    }
    if let Ok(e) = nbd::negotiate(&mut s, "exp", true) {
        check_export(&e);
        sum.export = true;
    }
    sum
}

fn check_export(e: &Export) {
    assert!(e.size <= i64::MAX as u64, "size beyond 2^63 accepted");
    assert!(e.min_block.is_power_of_two(), "min block {}", e.min_block);
    assert!(e.preferred_block >= e.min_block);
    assert!(e.max_payload >= e.min_block);
    assert!(e.max_payload <= 32 << 20, "max payload {}", e.max_payload);
    assert!(e.allocation_context.is_none() || e.structured);
}

/// Takes `n` bytes off the front of `p`.
fn take<'a>(p: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if p.len() < n {
        return None;
    }
    let (a, b) = p.split_at(n);
    *p = b;
    Some(a)
}

/// Walks replies until the stream ends or the client would break the connection.
fn replies(data: &[u8]) -> Summary {
    let mut p = data;
    let mut sum = Summary::default();
    let mut done = [false; REQUESTS.len()];
    let mut covered = [0u64; REQUESTS.len()];
    while let Some(h) = take(&mut p, HEAD_LEN) {
        let mut head = [0u8; HEAD_LEN];
        head.copy_from_slice(h);
        let Ok(hdr) = ReplyHeader::decode(&head) else {
            break;
        };
        let Some(idx) = REQUESTS
            .iter()
            .position(|r| r.0 == hdr.cookie())
            .filter(|&i| !done[i])
        else {
            break; // an unknown or finished cookie breaks the connection
        };
        let (_, cmd, req_off, req_len) = REQUESTS[idx];
        sum.replies += 1;
        let finished = match hdr {
            ReplyHeader::Simple { error, .. } => {
                if error != 0 {
                    assert!(ERRNOS.contains(&nbd::errno_of(error)));
                } else if cmd == Command::Read {
                    if take(&mut p, req_len as usize).is_none() {
                        break;
                    }
                    covered[idx] = u64::from(req_len);
                    sum.placed += u64::from(req_len);
                }
                true
            }
            ReplyHeader::Chunk {
                flags, kind, ty, ..
            } => {
                let Some(l) = take(&mut p, CHUNK_LEN_LEN) else {
                    break;
                };
                let len = wire::chunk_len(&[l[0], l[1], l[2], l[3]]);
                let max_data = if cmd == Command::Read { req_len } else { 0 };
                if kind.check_len(ty, len, max_data).is_err() {
                    break;
                }
                let allowed = match kind {
                    Chunk::OffsetData | Chunk::OffsetHole => cmd == Command::Read,
                    Chunk::BlockStatus => cmd == Command::BlockStatus,
                    Chunk::None | Chunk::Error => true,
                };
                if !allowed {
                    break;
                }
                if !chunk(
                    &mut p,
                    kind,
                    len,
                    req_off,
                    req_len,
                    &mut covered[idx],
                    &mut sum,
                ) {
                    break;
                }
                flags & wire::REPLY_FLAG_DONE != 0
            }
        };
        if finished {
            done[idx] = true;
            sum.done += 1;
        }
    }
    sum
}

/// One structured chunk's payload (its length already checked for its type); false when the
/// client would break the connection.
fn chunk(
    p: &mut &[u8],
    kind: Chunk,
    len: u32,
    req_off: u64,
    req_len: u32,
    covered: &mut u64,
    sum: &mut Summary,
) -> bool {
    match kind {
        Chunk::None => true,
        Chunk::OffsetData => {
            let Some(o) = take(p, 8) else {
                return false;
            };
            let mut b = [0u8; 8];
            b.copy_from_slice(o);
            let n = u64::from(len - 8);
            let Ok(rel) = wire::place(u64::from_be_bytes(b), n, req_off, u64::from(req_len)) else {
                return false;
            };
            assert!(
                rel + n <= u64::from(req_len),
                "data placed outside the request"
            );
            if take(p, n as usize).is_none() {
                return false;
            }
            *covered += n;
            sum.placed += n;
            true
        }
        Chunk::OffsetHole => {
            let Some(h) = take(p, 12) else {
                return false;
            };
            let Ok((o, n)) = wire::hole(h) else {
                return false;
            };
            let Ok(rel) = wire::place(o, u64::from(n), req_off, u64::from(req_len)) else {
                return false;
            };
            assert!(
                rel + u64::from(n) <= u64::from(req_len),
                "hole outside the request"
            );
            *covered += u64::from(n);
            sum.placed += u64::from(n);
            true
        }
        Chunk::BlockStatus => {
            let Some(m) = take(p, len as usize) else {
                return false;
            };
            wire::first_extent(m, CONTEXT).is_ok()
        }
        Chunk::Error => {
            let Some(m) = take(p, len as usize) else {
                return false;
            };
            match wire::error(m) {
                Ok((e, msg)) => {
                    assert_ne!(e, 0, "error chunk with error 0 accepted");
                    assert!(msg.len() <= 3 * m.len(), "message longer than its chunk");
                    assert!(ERRNOS.contains(&nbd::errno_of(e)));
                    true
                }
                Err(_) => false,
            }
        }
    }
}
