//! The `serve_legacy` and `serve_uring` targets: request sequences through the whole protocol
//! server ([`server::QueueServer`] → [`export::Export`] → the [`Mem`] backend) in one framing,
//! without a kernel, checking every reply.
//!
//! Input: one setup byte (export configuration and image size, see [`Setup::from_byte`]), then
//! records of a little-endian `u16` length and that many bytes, at most [`MAX_REQUESTS`] of them.
//! A legacy record is what `read(2)` of `/dev/fuse` returned. An io_uring record is the entry's
//! 288-byte header area (in header, argument area, commit id and payload size as the kernel
//! writes them; a shorter record leaves the rest zero) followed by the bytes of the payload buffer.

use std::sync::Arc;

use engine::{Buf, Engine, EngineConfig};
use export::{Export, ExportConfig, Passthrough};
use fuse_abi::{
    parse, parse_op_split, peek_unique, AttrOut, InHeader, LseekOut, Operation, OutHeader,
    ParseError, UringEntInOut, WriteOut, OUT_HEADER_LEN, ROOT_ID,
};
use server::QueueServer;
use transport::{Delivered, Layout, UringLayout};
use zerocopy::FromBytes;

use crate::mem::Mem;

/// Largest WRITE the slot buffers take (kept small: every request refills its buffer).
pub const MAX_WRITE: usize = 16 * 1024;
/// Most requests one input sends.
pub const MAX_REQUESTS: usize = 64;
/// Bytes of the io_uring entry's header area (`fuse_uring_req_header`).
pub const URING_HEADER_AREA: usize = std::mem::size_of::<fuse_abi::UringReqHeader>();
/// Byte every slot buffer is filled with before a request lands in it, so nothing passes on
/// leftover zeroes (and runs stay deterministic).
const GARBAGE: u8 = 0xA5;

/// The two ways a request reaches the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// `read(2)`/`write(2)` of `/dev/fuse`: request and reply each in one run of bytes.
    Legacy,
    /// FUSE-over-io_uring: header and arguments in the entry's header area, data in its payload.
    Uring,
}

/// The export an input runs against.
#[derive(Clone, Copy, Debug)]
pub struct Setup {
    /// Export configuration.
    pub cfg: ExportConfig,
    /// Passthrough as INIT would have set it up.
    pub passthrough: Option<Passthrough>,
    /// Initial image size.
    pub size: u64,
}

impl Setup {
    /// Bits 0-3: writable, growable, writethrough, kernel cache; bit 4: passthrough, bit 5: for
    /// opens for writing too; bits 6-7: image size (empty, one block, an odd size, larger than
    /// the backend can store).
    pub fn from_byte(b: u8) -> Setup {
        let bit = |n: u8| b & (1 << n) != 0;
        Setup {
            cfg: ExportConfig {
                writable: bit(0),
                growable: bit(1),
                writethrough: bit(2),
                kernel_cache: bit(3),
                ..ExportConfig::default()
            },
            passthrough: bit(4).then_some(Passthrough {
                backing_id: 7,
                write_opens: bit(5),
            }),
            size: [0, 4096, 12345, 3 << 20][usize::from(b >> 6)],
        }
    }
}

/// What an input did, so tests can tell that seed inputs reach deep code.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Requests that got a reply.
    pub replies: usize,
    /// Bit `n` set: a request with opcode `n` (below 64) got a successful reply.
    pub ok_opcodes: u64,
}

impl Summary {
    /// Whether a request with `opcode` succeeded.
    pub fn ok(&self, opcode: u32) -> bool {
        opcode < 64 && self.ok_opcodes & (1 << opcode) != 0
    }
}

/// The engine and slot layouts, made once per fuzzing process.
pub struct Harness {
    eng: Engine,
    legacy: Layout,
    uring: UringLayout,
}

thread_local! {
    static HARNESS: Harness = Harness::new();
}

/// Runs one input in the `/dev/fuse` framing.
pub fn run_legacy(data: &[u8]) -> Summary {
    HARNESS.with(|h| h.run(Framing::Legacy, data))
}

/// Runs one input in the io_uring framing.
pub fn run_uring(data: &[u8]) -> Summary {
    HARNESS.with(|h| h.run(Framing::Uring, data))
}

/// The records of an input after its setup byte.
pub(crate) fn records(mut rest: &[u8]) -> impl Iterator<Item = &[u8]> {
    std::iter::from_fn(move || {
        let (len, tail) = rest.split_first_chunk::<2>()?;
        let n = usize::from(u16::from_le_bytes(*len)).min(tail.len());
        let (rec, tail) = tail.split_at(n);
        rest = tail;
        Some(rec)
    })
    .take(MAX_REQUESTS)
}

/// A decoded request as the check sees it: the header and the operation (or why it failed).
type Decoded<'a> = Result<(InHeader, Operation<'a>), ParseError>;

/// Bad arguments of an opcode the image export does not implement are answered as that opcode
/// is with good ones (ENOSYS, or ENOENT for another node): checked as an unknown opcode.
fn unserved_as_unknown<'a>(d: Decoded<'a>, hdr: Option<InHeader>) -> Decoded<'a> {
    match (&d, hdr) {
        (Err(e), Some(hdr))
            if e.arguments_of()
                .is_some_and(|op| !<export::Export<Mem> as export::Filesystem>::serves(op)) =>
        {
            Ok((hdr, Operation::Unknown(hdr.opcode)))
        }
        _ => d,
    }
}

impl Harness {
    fn new() -> Harness {
        let legacy = Layout::new(MAX_WRITE);
        let uring = UringLayout::new(MAX_WRITE);
        let eng = Engine::new(&EngineConfig {
            sq_entries: 8,
            buffers: 1,
            buffer_size: legacy.size.max(uring.size),
            ..EngineConfig::default()
        })
        .expect("the fuzz harness needs io_uring");
        Harness { eng, legacy, uring }
    }

    fn run(&self, framing: Framing, data: &[u8]) -> Summary {
        let Some((&setup, rest)) = data.split_first() else {
            return Summary::default();
        };
        let setup = Setup::from_byte(setup);
        let mem = Mem::new(setup.size, 8192, setup.cfg.growable);
        let initial = mem.contents(0, 8192);
        let export = Arc::new(Export::new(mem, setup.cfg));
        if let Some(p) = setup.passthrough {
            export.set_passthrough(p);
        }
        let server = QueueServer::new(export);
        let mut summary = Summary::default();
        for rec in records(rest) {
            let answered = match framing {
                Framing::Legacy => self.legacy(&server, &setup, rec),
                Framing::Uring => Some(self.uring(&server, &setup, rec)),
            };
            if let Some((opcode, errno)) = answered {
                summary.replies += 1;
                if errno == 0 && opcode < 64 {
                    summary.ok_opcodes |= 1 << opcode;
                }
            }
        }
        let stats = server.counters().snapshot();
        // WRITE data lands where the backend reads it in both framings: never moved.
        assert_eq!(stats.bytes_copied, 0, "the data path copied WRITE data");
        if !setup.cfg.writable {
            let mem = server.export().backend();
            assert_eq!(
                mem.state().size,
                setup.size,
                "a read-only export changed size"
            );
            assert_eq!(
                mem.contents(0, 8192),
                initial,
                "a read-only export changed data"
            );
        }
        summary
    }

    fn buffer(&self) -> Buf {
        let mut buf = self
            .eng
            .take_buffer()
            .expect("the previous request gave its buffer back");
        buf.as_mut_slice().fill(GARBAGE);
        buf
    }

    /// One `/dev/fuse` request; the reply's (opcode, errno), or `None` if it took none.
    fn legacy(
        &self,
        server: &QueueServer<export::Export<Mem>>,
        setup: &Setup,
        rec: &[u8],
    ) -> Option<(u32, i32)> {
        let l = self.legacy;
        let mut buf = self.buffer();
        // The kernel never delivers more than the read asked for.
        let n = rec.len().min(buf.len() - l.request);
        let req = &rec[..n];
        buf.as_mut_slice()[l.request..l.request + n].copy_from_slice(req);
        let decoded: Decoded = unserved_as_unknown(
            parse(req).map(|r| (r.header, r.op)),
            InHeader::read_from_prefix(req).ok().map(|(h, _)| h),
        );
        let (buf, len) = self
            .eng
            .block_on(server.serve_legacy(&self.eng, &l, buf, n, true))
            .expect("engine");
        let len = match len {
            server::LegacyReply::Bytes(n) => Some(n),
            server::LegacyReply::None => None,
            s => panic!("{s:?} from a server that does not splice"),
        };
        let Some(len) = len else {
            assert!(
                n < fuse_abi::IN_HEADER_LEN
                    || matches!(
                        decoded,
                        Ok((
                            _,
                            Operation::Forget(_)
                                | Operation::BatchForget { .. }
                                | Operation::Interrupt(_)
                        ))
                    ),
                "no reply to {decoded:?}"
            );
            return None;
        };
        let (oh, body) = legacy_reply(&l, buf.as_slice(), len, req);
        let cap = l.payload_capacity();
        check_answer(
            Framing::Legacy,
            setup,
            &decoded,
            -oh.error,
            body,
            cap,
            server,
        );
        Some((opcode_of(req), -oh.error))
    }

    /// One io_uring request; the reply's (opcode, errno).
    fn uring(
        &self,
        server: &QueueServer<export::Export<Mem>>,
        setup: &Setup,
        rec: &[u8],
    ) -> (u32, i32) {
        let l = self.uring;
        let mut buf = self.buffer();
        let b = buf.as_mut_slice();
        let h = rec.len().min(URING_HEADER_AREA);
        b[l.header..l.header + URING_HEADER_AREA].fill(0);
        b[l.header..l.header + h].copy_from_slice(&rec[..h]);
        let p = (rec.len() - h).min(l.payload_len);
        b[l.payload..l.payload + p].copy_from_slice(&rec[h..h + p]);
        let d = Delivered::from_entry(&l, buf.as_slice()).expect("entry holds its header area");
        assert!(
            d.payload_sz <= l.payload_len,
            "payload size clamped to the entry"
        );
        // What the server will decode, copied out (the buffer moves into the server).
        let b = buf.as_slice();
        let op_in = b[l.op_in()..l.op_in() + 128].to_vec();
        let payload = b[l.payload..l.payload + d.payload_sz].to_vec();
        let decoded: Decoded = unserved_as_unknown(
            parse_op_split(&d.header, &op_in, &payload).map(|op| (d.header, op)),
            Some(d.header),
        );
        let buf = self
            .eng
            .block_on(server.serve_uring(&self.eng, &l, buf, &d))
            .expect("engine");
        let b = buf.as_slice();
        let (oh, _) = OutHeader::read_from_prefix(&b[l.header..]).expect("out header");
        let at = l.header + 256 + std::mem::offset_of!(UringEntInOut, payload_sz);
        let sz = u32::from_ne_bytes(b[at..at + 4].try_into().expect("4 bytes")) as usize;
        assert!(
            sz <= l.payload_len,
            "reply of {sz} bytes past the payload buffer"
        );
        assert_eq!(
            oh.len as usize,
            OUT_HEADER_LEN + sz,
            "out header length is the bytes written"
        );
        assert_eq!(oh.unique, d.header.unique, "reply echoes the unique");
        check_error_field(&oh, sz);
        let body = &b[l.payload..l.payload + sz];
        check_answer(
            Framing::Uring,
            setup,
            &decoded,
            -oh.error,
            body,
            l.payload_len,
            server,
        );
        (d.header.opcode, -oh.error)
    }
}

pub(crate) fn opcode_of(req: &[u8]) -> u32 {
    InHeader::read_from_prefix(req).map_or(0, |(h, _)| h.opcode)
}

/// Checks the `len`-byte reply a legacy slot buffer `b` (of layout `l`) holds to request `req`:
/// inside the buffer, its header's length the bytes written, its payload within the slot's
/// capacity, `unique` echoed, the error field as the kernel takes it. Its header and body.
pub(crate) fn legacy_reply<'a>(
    l: &Layout,
    b: &'a [u8],
    len: usize,
    req: &[u8],
) -> (OutHeader, &'a [u8]) {
    assert!(
        l.reply + len <= b.len(),
        "reply of {len} bytes past the buffer"
    );
    let (oh, _) = OutHeader::read_from_prefix(&b[l.reply..]).expect("out header");
    assert_eq!(
        oh.len as usize, len,
        "out header length is the bytes written"
    );
    assert!(len >= OUT_HEADER_LEN && len - OUT_HEADER_LEN <= l.payload_capacity());
    assert_eq!(Some(oh.unique), peek_unique(req), "reply echoes the unique");
    check_error_field(&oh, len - OUT_HEADER_LEN);
    (oh, &b[l.reply + OUT_HEADER_LEN..l.reply + len])
}

/// The kernel takes errors in `-511..=0`, and an error reply carries no body.
fn check_error_field(oh: &OutHeader, body_len: usize) {
    assert!(
        (-511..=0).contains(&oh.error),
        "error {} out of range",
        oh.error
    );
    assert!(
        oh.error == 0 || body_len == 0,
        "error reply with a {body_len}-byte body"
    );
}

/// What a reply must be for the request, given the export and the backend's state afterwards.
fn check_answer(
    framing: Framing,
    setup: &Setup,
    decoded: &Decoded<'_>,
    errno: i32,
    body: &[u8],
    cap: usize,
    server: &QueueServer<export::Export<Mem>>,
) {
    let (hdr, op) = match decoded {
        Ok(d) => d,
        Err(e) => {
            assert_eq!(
                errno,
                e.errno(),
                "malformed request ({e}) answered with its errno"
            );
            return;
        }
    };
    let mem = server.export().backend();
    let size = mem.state().size;
    let ok = errno == 0;
    let ctx = || {
        format!(
            "{framing:?} {op:?} -> errno {errno}, {} body bytes",
            body.len()
        )
    };
    let exempt = matches!(
        op,
        Operation::Forget(_)
            | Operation::BatchForget { .. }
            | Operation::Interrupt(_)
            | Operation::Destroy
    );
    if hdr.nodeid != ROOT_ID && !exempt {
        assert_eq!(errno, libc::ENOENT, "{}", ctx());
        return;
    }
    let writable = setup.cfg.writable;
    match op {
        Operation::Init(_) => assert_eq!(errno, libc::EPROTO, "{}", ctx()),
        Operation::Lookup { .. } => assert_eq!(errno, libc::ENOENT, "{}", ctx()),
        // A single file has no directory operations.
        Operation::Unsupported(_)
        | Operation::Unknown(_)
        | Operation::Readlink
        | Operation::Symlink { .. }
        | Operation::Mknod { .. }
        | Operation::Mkdir { .. }
        | Operation::Unlink { .. }
        | Operation::Rmdir { .. }
        | Operation::Rename { .. }
        | Operation::Link { .. }
        | Operation::Create { .. }
        | Operation::Tmpfile(_)
        | Operation::Opendir(_)
        | Operation::Readdir(_)
        | Operation::Readdirplus(_)
        | Operation::Releasedir(_)
        | Operation::Fsyncdir(_)
        | Operation::Setxattr { .. }
        | Operation::Getxattr { .. }
        | Operation::Listxattr(_)
        | Operation::Removexattr { .. }
        | Operation::Access(_)
        | Operation::Statx(_)
        | Operation::CopyFileRange(_)
        | Operation::CopyFileRange64(_) => assert_eq!(errno, libc::ENOSYS, "{}", ctx()),
        // Only an io_uring entry answers these (so that it re-arms).
        Operation::Forget(_) | Operation::BatchForget { .. } | Operation::Interrupt(_) => {
            assert_eq!(framing, Framing::Uring, "{}", ctx());
            assert_eq!(errno, libc::ENOSYS, "{}", ctx());
        }
        Operation::Destroy | Operation::Release(_) => {
            assert!(ok && body.is_empty(), "{}", ctx())
        }
        Operation::Getattr(_) | Operation::Setattr(_) => {
            if ok {
                let out = AttrOut::read_from_bytes(body).unwrap_or_else(|_| panic!("{}", ctx()));
                assert_eq!(out.attr.ino, ROOT_ID, "{}", ctx());
                assert_eq!(out.attr.size, size, "{}", ctx());
            }
        }
        Operation::Open(a) => {
            let for_writing = a.flags as i32 & libc::O_ACCMODE != libc::O_RDONLY;
            if for_writing && !writable {
                assert_eq!(errno, libc::EROFS, "{}", ctx());
            } else {
                assert!(ok && body.len() == 16, "{}", ctx());
            }
        }
        Operation::Read(a) => {
            assert!(ok, "{}", ctx());
            let want = if a.offset >= size {
                0
            } else {
                (u64::from(a.size).min(size - a.offset) as usize).min(cap)
            };
            assert_eq!(body.len(), want, "{}", ctx());
            assert!(
                body == mem.contents(a.offset, want),
                "{}: wrong bytes",
                ctx()
            );
        }
        Operation::Write { arg, data } => {
            if !writable {
                assert_eq!(errno, libc::EROFS, "{}", ctx());
            } else if ok {
                let out = WriteOut::read_from_bytes(body).unwrap_or_else(|_| panic!("{}", ctx()));
                let n = out.size as usize;
                assert!(n <= data.len(), "{}: wrote {n} of {}", ctx(), data.len());
                assert!(
                    mem.contents(arg.offset, n) == data[..n],
                    "{}: the image does not hold the written bytes",
                    ctx()
                );
            }
        }
        Operation::Flush(_) | Operation::Fsync(_) => assert!(ok && body.is_empty(), "{}", ctx()),
        Operation::Fallocate(_) => {
            if !writable {
                assert_eq!(errno, libc::EROFS, "{}", ctx());
            }
            assert!(body.is_empty(), "{}", ctx());
        }
        Operation::Lseek(a) => {
            if ok {
                let out = LseekOut::read_from_bytes(body).unwrap_or_else(|_| panic!("{}", ctx()));
                assert!(
                    (a.offset..=size).contains(&out.offset),
                    "{}: seek to {}",
                    ctx(),
                    out.offset
                );
            }
        }
        Operation::Statfs => assert!(ok && body.len() == 80, "{}", ctx()),
    }
}
