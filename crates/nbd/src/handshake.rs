//! The fixed-newstyle handshake, over any blocking byte stream: structured replies, the
//! `base:allocation` metadata context, then `NBD_OPT_GO` with the block-size constraints.
//!
//! It runs when a connection is made (at start-up, and on a queue thread when it reconnects),
//! before the socket goes to the ring. Every server message is length-checked before it is read.
//!
//! With TLS it runs in three steps, because the stream changes in the middle: [`greet`] on the
//! socket, [`start_tls`] (`NBD_OPT_STARTTLS`) on the socket, then the caller's TLS handshake, then
//! [`negotiate`] inside the TLS session. Without TLS, [`handshake`] is [`greet`] then
//! [`negotiate`] on the socket.

use std::io::{self, Read, Write};

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OLDSTYLE_MAGIC: u64 = 0x0000_4202_8186_1253;
const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
const FLAG_NO_ZEROES: u16 = 1 << 1;

const OPT_ABORT: u32 = 2;
const OPT_STARTTLS: u32 = 5;
const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;
const OPT_SET_META_CONTEXT: u32 = 10;

const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_META_CONTEXT: u32 = 4;
const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;

const INFO_EXPORT: u16 = 0;
const INFO_BLOCK_SIZE: u16 = 3;

/// Largest option reply fusex reads (the protocol bounds strings to 4096 bytes).
const MAX_OPTION_REPLY: u32 = 64 * 1024;
/// Replies fusex reads for one option before it calls the server broken.
const MAX_REPLIES: usize = 64;

/// The metadata context fusex asks for: allocation, for SEEK_DATA/SEEK_HOLE.
pub const BASE_ALLOCATION: &str = "base:allocation";

/// What the handshake settled about the export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Export {
    /// Size in bytes.
    pub size: u64,
    /// Transmission flags (`crate::FLAG_*`).
    pub flags: u16,
    /// Smallest block the server accepts (requests must be aligned to it).
    pub min_block: u32,
    /// The block size the server prefers.
    pub preferred_block: u32,
    /// Largest payload of one READ or WRITE.
    pub max_payload: u32,
    /// Structured replies were negotiated.
    pub structured: bool,
    /// The id of the `base:allocation` context, if negotiated.
    pub allocation_context: Option<u32>,
}

impl Export {
    /// Whether a transmission flag is set.
    pub fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }
}

/// Why the handshake failed. The messages are what the user sees in fusex's one-line error.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The stream failed (or closed early).
    #[error("connection failed during the NBD handshake: {0}")]
    Io(io::Error),
    /// The peer is not an NBD server.
    #[error("the peer is not an NBD server (bad greeting)")]
    NotNbd,
    /// An oldstyle or plain newstyle server.
    #[error("the server does not speak the fixed-newstyle handshake (oldstyle or non-fixed newstyle servers are not supported)")]
    NotFixedNewstyle,
    /// The export does not exist.
    #[error("the server has no export named {0:?}")]
    UnknownExport(String),
    /// The server requires TLS and the URI did not ask for it.
    #[error("the server requires TLS: use nbds:// (or nbds+unix://)")]
    TlsRequired,
    /// The server refused `NBD_OPT_STARTTLS`.
    #[error("the server does not offer TLS (it refused NBD_OPT_STARTTLS: error {code:#x}{message}): enable TLS on the server (nbdkit --tls=on, qemu-nbd --tls-creds) or use nbd:// (nbd+unix://)")]
    TlsRefused {
        /// The NBD_REP_ERR_* code.
        code: u32,
        /// The server's message (with a leading ": "), if any.
        message: String,
    },
    /// The server refused an option fusex needs.
    #[error("the server refused {option}: error {code:#x}{message}")]
    Refused {
        /// The option.
        option: &'static str,
        /// The NBD_REP_ERR_* code.
        code: u32,
        /// The server's message (with a leading ": "), if any.
        message: String,
    },
    /// The server broke the protocol.
    #[error("protocol violation in the NBD handshake: {0}")]
    Violation(&'static str),
}

impl From<io::Error> for HandshakeError {
    fn from(e: io::Error) -> Self {
        HandshakeError::Io(e)
    }
}

/// Runs the whole handshake for export `name` on `s`, without TLS: [`greet`], then
/// [`negotiate`].
pub fn handshake<S: Read + Write>(
    s: &mut S,
    name: &str,
    want_allocation: bool,
) -> Result<Export, HandshakeError> {
    greet(s)?;
    negotiate(s, name, want_allocation)
}

/// Reads the server's greeting and answers with the client flags: the first step of every
/// handshake, before any option (and before TLS, which is itself an option).
pub fn greet<S: Read + Write>(s: &mut S) -> Result<(), HandshakeError> {
    if read_u64(s)? != NBDMAGIC {
        return Err(HandshakeError::NotNbd);
    }
    match read_u64(s)? {
        IHAVEOPT => {}
        OLDSTYLE_MAGIC => return Err(HandshakeError::NotFixedNewstyle),
        _ => return Err(HandshakeError::NotNbd),
    }
    let sflags = read_u16(s)?;
    if sflags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(HandshakeError::NotFixedNewstyle);
    }
    let cflags = u32::from(FLAG_FIXED_NEWSTYLE | (sflags & FLAG_NO_ZEROES));
    s.write_all(&cflags.to_be_bytes())?;
    Ok(())
}

/// Asks the server for TLS (`NBD_OPT_STARTTLS`) right after [`greet`]. On success the next bytes
/// on the stream are the TLS handshake, which the caller runs; option haggling ([`negotiate`])
/// then continues inside the TLS session.
pub fn start_tls<S: Read + Write>(s: &mut S) -> Result<(), HandshakeError> {
    send_option(s, OPT_STARTTLS, &[])?;
    for _ in 0..MAX_REPLIES {
        let (ty, data) = read_reply(s, OPT_STARTTLS)?;
        match ty {
            REP_ACK => return Ok(()),
            t if t & (1 << 31) != 0 => {
                return Err(HandshakeError::TlsRefused {
                    code: t,
                    message: server_message(&data),
                })
            }
            _ => {} // an informational reply: the protocol allows none here, but it is harmless
        }
    }
    Err(HandshakeError::Violation(
        "endless replies to NBD_OPT_STARTTLS",
    ))
}

/// Option haggling after [`greet`] (and, with TLS, [`start_tls`] and the TLS handshake): asks
/// for the `base:allocation` context with `want_allocation` (only if structured replies were
/// agreed: it needs them), then `NBD_OPT_GO` for export `name`.
pub fn negotiate<S: Read + Write>(
    s: &mut S,
    name: &str,
    want_allocation: bool,
) -> Result<Export, HandshakeError> {
    // Structured replies: required for block status; READ works with simple replies too.
    send_option(s, OPT_STRUCTURED_REPLY, &[])?;
    let mut structured = false;
    for _ in 0..MAX_REPLIES {
        let (ty, _) = read_reply(s, OPT_STRUCTURED_REPLY)?;
        match ty {
            REP_ACK => {
                structured = true;
                break;
            }
            // A server that requires TLS refuses every option before STARTTLS.
            REP_ERR_TLS_REQD => return Err(HandshakeError::TlsRequired),
            t if t & (1 << 31) != 0 => break,
            _ => {} // an informational reply we have no use for
        }
    }

    let mut allocation_context = None;
    if structured && want_allocation {
        let mut d = Vec::with_capacity(name.len() + 32);
        d.extend_from_slice(&len32(name.len())?.to_be_bytes());
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&1u32.to_be_bytes());
        d.extend_from_slice(&len32(BASE_ALLOCATION.len())?.to_be_bytes());
        d.extend_from_slice(BASE_ALLOCATION.as_bytes());
        send_option(s, OPT_SET_META_CONTEXT, &d)?;
        let mut done = false;
        for _ in 0..MAX_REPLIES {
            let (ty, data) = read_reply(s, OPT_SET_META_CONTEXT)?;
            match ty {
                REP_META_CONTEXT => {
                    if data.len() < 4 {
                        return Err(HandshakeError::Violation("short NBD_REP_META_CONTEXT"));
                    }
                    if &data[4..] == BASE_ALLOCATION.as_bytes() {
                        allocation_context =
                            Some(u32::from_be_bytes([data[0], data[1], data[2], data[3]]));
                    }
                }
                REP_ACK => {
                    done = true;
                    break;
                }
                t if t & (1 << 31) != 0 => {
                    // Not supported: SEEK_DATA/SEEK_HOLE fall back to "all data".
                    done = true;
                    break;
                }
                _ => {}
            }
        }
        if !done {
            return Err(HandshakeError::Violation(
                "endless replies to NBD_OPT_SET_META_CONTEXT",
            ));
        }
    }

    let mut d = Vec::with_capacity(name.len() + 8);
    d.extend_from_slice(&len32(name.len())?.to_be_bytes());
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&1u16.to_be_bytes());
    d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    send_option(s, OPT_GO, &d)?;
    let mut export: Option<(u64, u16)> = None;
    let mut blocks: Option<(u32, u32, u32)> = None;
    for _ in 0..MAX_REPLIES {
        let (ty, data) = read_reply(s, OPT_GO)?;
        match ty {
            REP_INFO => {
                if data.len() < 2 {
                    return Err(HandshakeError::Violation("short NBD_REP_INFO"));
                }
                let info = u16::from_be_bytes([data[0], data[1]]);
                let b = &data[2..];
                match info {
                    INFO_EXPORT => {
                        if b.len() != 10 {
                            return Err(HandshakeError::Violation(
                                "NBD_INFO_EXPORT of the wrong size",
                            ));
                        }
                        let mut sz = [0u8; 8];
                        sz.copy_from_slice(&b[..8]);
                        export = Some((u64::from_be_bytes(sz), u16::from_be_bytes([b[8], b[9]])));
                    }
                    INFO_BLOCK_SIZE => {
                        if b.len() != 12 {
                            return Err(HandshakeError::Violation(
                                "NBD_INFO_BLOCK_SIZE of the wrong size",
                            ));
                        }
                        let u = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
                        blocks = Some((u(0), u(4), u(8)));
                    }
                    _ => {}
                }
            }
            REP_ACK => {
                let (size, flags) = export.ok_or(HandshakeError::Violation(
                    "NBD_OPT_GO acknowledged without NBD_INFO_EXPORT",
                ))?;
                if size > i64::MAX as u64 {
                    return Err(HandshakeError::Violation("export size beyond 2^63"));
                }
                let (min_block, preferred_block, max_payload) = check_blocks(blocks)?;
                return Ok(Export {
                    size,
                    flags,
                    min_block,
                    preferred_block,
                    max_payload,
                    structured,
                    allocation_context,
                });
            }
            REP_ERR_UNKNOWN => return Err(HandshakeError::UnknownExport(name.to_string())),
            REP_ERR_TLS_REQD => return Err(HandshakeError::TlsRequired),
            t if t & (1 << 31) != 0 => {
                return Err(HandshakeError::Refused {
                    option: "NBD_OPT_GO",
                    code: t,
                    message: server_message(&data),
                });
            }
            _ => {}
        }
    }
    Err(HandshakeError::Violation("endless replies to NBD_OPT_GO"))
}

/// A server's error message for a one-line error: `": message"` (control characters dropped,
/// at most 200 characters), or nothing.
fn server_message(data: &[u8]) -> String {
    if data.is_empty() {
        return String::new();
    }
    let m: String = String::from_utf8_lossy(data)
        .chars()
        .filter(|c| !c.is_control())
        .take(200)
        .collect();
    format!(": {m}")
}

/// Ends a handshake without using the export (polite; errors ignored).
pub fn abort<S: Write>(s: &mut S) {
    let _ = send_option(s, OPT_ABORT, &[]);
}

/// Block-size constraints, checked the way the protocol states them; defaults when absent
/// (minimum 1, preferred 4096, maximum payload 32 MiB).
fn check_blocks(b: Option<(u32, u32, u32)>) -> Result<(u32, u32, u32), HandshakeError> {
    let Some((min, pref, max)) = b else {
        return Ok((1, 4096, 32 << 20));
    };
    let ok = min.is_power_of_two()
        && min <= 64 * 1024
        && pref.is_power_of_two()
        && pref >= min
        && max >= min
        && max % min == 0;
    if !ok {
        return Err(HandshakeError::Violation(
            "inconsistent NBD_INFO_BLOCK_SIZE",
        ));
    }
    Ok((min, pref, max.min(32 << 20).max(min)))
}

fn len32(n: usize) -> Result<u32, HandshakeError> {
    if n > 4096 {
        return Err(HandshakeError::Violation("string longer than 4096 bytes"));
    }
    Ok(n as u32)
}

fn send_option<S: Write>(s: &mut S, opt: u32, data: &[u8]) -> io::Result<()> {
    let mut m = Vec::with_capacity(16 + data.len());
    m.extend_from_slice(&IHAVEOPT.to_be_bytes());
    m.extend_from_slice(&opt.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
    s.write_all(&m)?;
    s.flush()
}

/// Reads one option reply to `opt`: (reply type, data).
fn read_reply<S: Read>(s: &mut S, opt: u32) -> Result<(u32, Vec<u8>), HandshakeError> {
    let mut h = [0u8; 20];
    s.read_exact(&mut h)?;
    let mut m = [0u8; 8];
    m.copy_from_slice(&h[..8]);
    if u64::from_be_bytes(m) != REPLY_MAGIC {
        return Err(HandshakeError::Violation("bad option reply magic"));
    }
    let u = |i: usize| u32::from_be_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    if u(8) != opt {
        return Err(HandshakeError::Violation(
            "option reply to an option not sent",
        ));
    }
    let (ty, len) = (u(12), u(16));
    if len > MAX_OPTION_REPLY {
        return Err(HandshakeError::Violation("option reply too large"));
    }
    let mut data = vec![0u8; len as usize];
    s.read_exact(&mut data)?;
    Ok((ty, data))
}

fn read_u64<S: Read>(s: &mut S) -> io::Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

fn read_u16<S: Read>(s: &mut S) -> io::Result<u16> {
    let mut b = [0u8; 2];
    s.read_exact(&mut b)?;
    Ok(u16::from_be_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scripted server: what it says, and what the client wrote.
    struct Script {
        input: io::Cursor<Vec<u8>>,
        output: Vec<u8>,
    }

    impl Read for Script {
        fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
            self.input.read(b)
        }
    }
    impl Write for Script {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.output.extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn reply(out: &mut Vec<u8>, opt: u32, ty: u32, data: &[u8]) {
        out.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
        out.extend_from_slice(&opt.to_be_bytes());
        out.extend_from_slice(&ty.to_be_bytes());
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        out.extend_from_slice(data);
    }

    fn greeting() -> Vec<u8> {
        let mut v = NBDMAGIC.to_be_bytes().to_vec();
        v.extend_from_slice(&IHAVEOPT.to_be_bytes());
        v.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        v
    }

    fn info_export(size: u64, flags: u16) -> Vec<u8> {
        let mut d = INFO_EXPORT.to_be_bytes().to_vec();
        d.extend_from_slice(&size.to_be_bytes());
        d.extend_from_slice(&flags.to_be_bytes());
        d
    }

    fn run(server: Vec<u8>) -> (Result<Export, HandshakeError>, Vec<u8>) {
        let mut s = Script {
            input: io::Cursor::new(server),
            output: Vec::new(),
        };
        let r = handshake(&mut s, "exp", true);
        (r, s.output)
    }

    #[test]
    fn full_negotiation() {
        let mut srv = greeting();
        reply(&mut srv, OPT_STRUCTURED_REPLY, REP_ACK, &[]);
        let mut ctx = 7u32.to_be_bytes().to_vec();
        ctx.extend_from_slice(BASE_ALLOCATION.as_bytes());
        reply(&mut srv, OPT_SET_META_CONTEXT, REP_META_CONTEXT, &ctx);
        reply(&mut srv, OPT_SET_META_CONTEXT, REP_ACK, &[]);
        reply(&mut srv, OPT_GO, REP_INFO, &info_export(1 << 20, 0x1ed));
        let mut bs = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
        for v in [512u32, 4096, 1 << 20] {
            bs.extend_from_slice(&v.to_be_bytes());
        }
        reply(&mut srv, OPT_GO, REP_INFO, &bs);
        reply(&mut srv, OPT_GO, REP_ACK, &[]);
        let (r, out) = run(srv);
        let e = r.unwrap();
        assert_eq!(e.size, 1 << 20);
        assert_eq!(e.flags, 0x1ed);
        assert_eq!(
            (e.min_block, e.preferred_block, e.max_payload),
            (512, 4096, 1 << 20)
        );
        assert!(e.structured);
        assert_eq!(e.allocation_context, Some(7));
        // Client flags: fixed newstyle and no zeroes.
        assert_eq!(&out[0..4], &3u32.to_be_bytes());
        // The GO option names the export and asks for block sizes.
        let mut pat = IHAVEOPT.to_be_bytes().to_vec();
        pat.extend_from_slice(&OPT_GO.to_be_bytes());
        let go = out.windows(12).position(|w| w == pat.as_slice()).unwrap();
        assert_eq!(&out[go + 20..go + 23], b"exp");
        assert_eq!(&out[out.len() - 4..], &[0, 1, 0, 3]);
    }

    #[test]
    fn without_structured_replies() {
        let mut srv = greeting();
        reply(&mut srv, OPT_STRUCTURED_REPLY, (1 << 31) + 1, &[]);
        reply(&mut srv, OPT_GO, REP_INFO, &info_export(4096, 1));
        reply(&mut srv, OPT_GO, REP_ACK, &[]);
        let e = run(srv).0.unwrap();
        assert!(!e.structured);
        assert_eq!(e.allocation_context, None);
        assert_eq!(e.max_payload, 32 << 20);
    }

    #[test]
    fn refusals() {
        let mut srv = greeting();
        reply(&mut srv, OPT_STRUCTURED_REPLY, REP_ACK, &[]);
        reply(&mut srv, OPT_SET_META_CONTEXT, REP_ACK, &[]);
        reply(&mut srv, OPT_GO, REP_ERR_UNKNOWN, b"no such export");
        assert!(matches!(run(srv).0, Err(HandshakeError::UnknownExport(n)) if n == "exp"));

        assert!(matches!(
            run(b"HTTP/1.1 200 OK\r\n".to_vec()).0,
            Err(HandshakeError::NotNbd)
        ));
        assert!(matches!(run(Vec::new()).0, Err(HandshakeError::Io(_))));
        let mut old = NBDMAGIC.to_be_bytes().to_vec();
        old.extend_from_slice(&OLDSTYLE_MAGIC.to_be_bytes());
        assert!(matches!(run(old).0, Err(HandshakeError::NotFixedNewstyle)));

        let mut srv = greeting();
        reply(&mut srv, OPT_STRUCTURED_REPLY, REP_ACK, &[]);
        reply(&mut srv, OPT_SET_META_CONTEXT, REP_ACK, &[]);
        reply(&mut srv, OPT_GO, REP_ACK, &[]);
        assert!(matches!(run(srv).0, Err(HandshakeError::Violation(_))));

        let mut srv = greeting();
        srv.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
        srv.extend_from_slice(&OPT_STRUCTURED_REPLY.to_be_bytes());
        srv.extend_from_slice(&REP_ACK.to_be_bytes());
        srv.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(run(srv).0, Err(HandshakeError::Violation(_))));
    }

    #[test]
    fn tls_options() {
        // STARTTLS acknowledged: the caller may start its TLS handshake.
        let mut srv = greeting();
        reply(&mut srv, OPT_STARTTLS, REP_ACK, &[]);
        let mut s = Script {
            input: io::Cursor::new(srv),
            output: Vec::new(),
        };
        greet(&mut s).unwrap();
        start_tls(&mut s).unwrap();
        let mut opt = IHAVEOPT.to_be_bytes().to_vec();
        opt.extend_from_slice(&OPT_STARTTLS.to_be_bytes());
        opt.extend_from_slice(&0u32.to_be_bytes());
        assert_eq!(&s.output[4..], opt.as_slice());

        // Refused (a server without TLS).
        let mut srv = greeting();
        reply(
            &mut srv,
            OPT_STARTTLS,
            (1 << 31) + 2,
            b"TLS not configured\n",
        );
        let mut s = Script {
            input: io::Cursor::new(srv),
            output: Vec::new(),
        };
        greet(&mut s).unwrap();
        let e = start_tls(&mut s).unwrap_err();
        assert!(matches!(e, HandshakeError::TlsRefused { .. }));
        assert!(e.to_string().contains("TLS not configured"), "{e}");
        assert!(!e.to_string().contains('\n'));

        // A plain client at a server that requires TLS.
        let mut srv = greeting();
        reply(&mut srv, OPT_STRUCTURED_REPLY, REP_ERR_TLS_REQD, &[]);
        let e = run(srv).0.unwrap_err();
        assert!(matches!(e, HandshakeError::TlsRequired));
        assert!(e.to_string().contains("use nbds://"));
    }

    #[test]
    fn block_sizes() {
        assert_eq!(check_blocks(None).unwrap(), (1, 4096, 32 << 20));
        assert!(check_blocks(Some((3, 4096, 8192))).is_err());
        assert!(check_blocks(Some((4096, 512, 8192))).is_err());
        assert!(check_blocks(Some((512, 4096, 1000))).is_err());
        assert_eq!(check_blocks(Some((1, 4096, u32::MAX))).unwrap().2, 32 << 20);
    }

    proptest::proptest! {
        #[test]
        fn hostile_servers_never_panic(tail in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            let mut srv = greeting();
            srv.extend_from_slice(&tail);
            let _ = run(srv);
        }
    }
}
