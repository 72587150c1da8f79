//! [`QueueServer`] without a kernel: request bytes in, reply bytes out, over an in-memory backend.
//!
//! Every case runs on both framings (`/dev/fuse` and io_uring) through [`harness::Harness::call`],
//! which frames the same (opcode, arguments, data) either way, serves it, checks that the reply is
//! well formed for its framing, and returns (errno, body): a case states one expectation for both.

use fuse_abi::{
    AttrOut, FallocateIn, FsyncIn, InHeader, LseekIn, LseekOut, OpenIn, OpenOut, ReadIn, ReleaseIn,
    SetattrIn, StatfsOut, WriteIn, WriteOut, FALLOC_FL_COLLAPSE_RANGE, FALLOC_FL_KEEP_SIZE,
    FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE, FATTR_MODE, FATTR_MTIME, FATTR_SIZE,
    FOPEN_DIRECT_IO, FOPEN_KEEP_CACHE, FOPEN_NOFLUSH, FOPEN_PARALLEL_DIRECT_WRITES,
    FOPEN_PASSTHROUGH, SEEK_DATA, SEEK_HOLE,
};
use proptest::prelude::*;
use zerocopy::IntoBytes;

use export::{ExportConfig, Passthrough};

use harness::{image, Answer, Fault, Framing, Harness, BOTH, MAX_WRITE};

/// Opcode numbers, as the kernel sends them.
mod op {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const MKDIR: u32 = 9;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
    pub const LSEEK: u32 = 46;
}

/// The in-memory backend and the request/reply plumbing shared by every test.
mod harness {
    use std::cell::Cell;
    use std::io;
    use std::sync::{Arc, Mutex, MutexGuard};

    use backend::{Attrs, BackendError, BlockBackend, Capabilities, Seek};
    use engine::{Buf, Engine, EngineConfig, Slice};
    use export::{Export, ExportConfig, Snapshot};
    use fuse_abi::{peek_unique, InHeader, OutHeader, UringEntInOut, OUT_HEADER_LEN};
    use transport::{Delivered, Layout, UringLayout};
    use zerocopy::{FromBytes, IntoBytes};

    use crate::QueueServer;

    /// Largest WRITE the test buffers take (one legacy or io_uring slot each).
    pub const MAX_WRITE: usize = 64 * 1024;
    /// Block size of the fake's hole model: a block whose bytes are all zero is a hole.
    pub const BLOCK: u64 = 4096;
    /// Owner the fake reports.
    pub const UID: u32 = 1000;

    /// The two framings a request can arrive in.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Framing {
        Legacy,
        Uring,
    }

    pub const BOTH: [Framing; 2] = [Framing::Legacy, Framing::Uring];

    /// How an injected backend failure looks.
    #[derive(Clone, Copy, Debug)]
    pub enum Fault {
        /// An OS error with this errno (any value, even ones a reply cannot carry).
        Errno(i32),
        /// `BackendError::Unsupported`.
        Unsupported,
        /// An I/O error that carries no errno.
        NoErrno,
    }

    impl Fault {
        fn error(self) -> BackendError {
            match self {
                Fault::Errno(e) => BackendError::Io(io::Error::from_raw_os_error(e)),
                Fault::Unsupported => BackendError::Unsupported,
                Fault::NoErrno => BackendError::Io(io::Error::other("injected")),
            }
        }
    }

    /// A timestamp: seconds, nanoseconds.
    pub type Time = (i64, u32);

    /// The fake's state: stored bytes, the image length and the fault knobs.
    #[derive(Default)]
    pub struct State {
        /// Bytes written so far; the image reads as zeroes past them (up to `size`).
        pub data: Vec<u8>,
        /// Image length. Like a real backend's, it moves only through `written_to`, `grow_to` and
        /// `resize`: a write past the end stores bytes, the export records the new end.
        pub size: u64,
        pub fail_read: Option<Fault>,
        pub fail_write: Option<Fault>,
        pub fail_flush: Option<Fault>,
        /// The next read transfers at most this many bytes.
        pub short_read: Option<usize>,
        /// The next write transfers at most this many bytes.
        pub short_write: Option<usize>,
        pub reads: u64,
        pub writes: u64,
        pub flushes: u64,
        /// The last (atime, mtime) set.
        pub times: Option<(Option<Time>, Option<Time>)>,
    }

    /// A `BlockBackend` over a `Vec<u8>`, with fault injection.
    pub struct Mem(Mutex<State>);

    impl Mem {
        pub fn new(image: Vec<u8>) -> Mem {
            Mem(Mutex::new(State {
                size: image.len() as u64,
                data: image,
                ..State::default()
            }))
        }

        pub fn state(&self) -> MutexGuard<'_, State> {
            self.0.lock().unwrap()
        }

        /// The image as the guest sees it: `size` bytes.
        pub fn contents(&self) -> Vec<u8> {
            let s = self.state();
            let mut v = s.data.clone();
            v.resize(s.size as usize, 0);
            v
        }

        fn zero(s: &mut State, off: u64, len: u64) {
            let end = off.saturating_add(len).min(s.data.len() as u64);
            if off < end {
                s.data[off as usize..end as usize].fill(0);
            }
        }
    }

    impl BlockBackend for Mem {
        fn size(&self) -> u64 {
            self.state().size
        }

        fn capabilities(&self) -> Capabilities {
            Capabilities {
                writable: true,
                resize: true,
                ..Capabilities::default()
            }
        }

        async fn attrs(&self, _eng: &Engine) -> backend::Result<Attrs> {
            Ok(Attrs {
                perm: 0o644,
                uid: UID,
                gid: UID,
                allocated: self.state().data.len() as u64,
                atime: (1, 2),
                mtime: (3, 4),
                ctime: (5, 6),
            })
        }

        async fn read_at(
            &self,
            _eng: &Engine,
            mut win: Slice,
            off: u64,
        ) -> (backend::Result<usize>, Slice) {
            let mut s = self.state();
            s.reads += 1;
            if let Some(f) = s.fail_read.take() {
                return (Err(f.error()), win);
            }
            let mut n = s.size.saturating_sub(off).min(win.len() as u64) as usize;
            if let Some(short) = s.short_read.take() {
                n = n.min(short);
            }
            let dst = &mut win.as_mut_slice()[..n];
            dst.fill(0);
            let stored = s.data.get(off as usize..).unwrap_or_default();
            let k = n.min(stored.len());
            dst[..k].copy_from_slice(&stored[..k]);
            (Ok(n), win)
        }

        async fn write_at(
            &self,
            _eng: &Engine,
            win: Slice,
            off: u64,
        ) -> (backend::Result<usize>, Slice) {
            let mut s = self.state();
            s.writes += 1;
            if let Some(f) = s.fail_write.take() {
                return (Err(f.error()), win);
            }
            let mut n = win.len();
            if let Some(short) = s.short_write.take() {
                n = n.min(short);
            }
            let (off, end) = (off as usize, off as usize + n);
            if s.data.len() < end {
                s.data.resize(end, 0);
            }
            s.data[off..end].copy_from_slice(&win.as_slice()[..n]);
            (Ok(n), win)
        }

        async fn flush(&self, _eng: &Engine) -> backend::Result<()> {
            let mut s = self.state();
            if let Some(f) = s.fail_flush.take() {
                return Err(f.error());
            }
            s.flushes += 1;
            Ok(())
        }

        async fn discard(&self, _eng: &Engine, off: u64, len: u64) -> backend::Result<()> {
            Mem::zero(&mut self.state(), off, len);
            Ok(())
        }

        async fn write_zeroes(&self, _eng: &Engine, off: u64, len: u64) -> backend::Result<()> {
            Mem::zero(&mut self.state(), off, len);
            Ok(())
        }

        async fn allocate(&self, _eng: &Engine, _off: u64, _len: u64) -> backend::Result<()> {
            Ok(())
        }

        async fn seek(
            &self,
            _eng: &Engine,
            off: u64,
            whence: Seek,
        ) -> backend::Result<Option<u64>> {
            let s = self.state();
            let is_data = |blk: u64| {
                let lo = (blk * BLOCK).min(s.data.len() as u64) as usize;
                let hi = ((blk + 1) * BLOCK).min(s.data.len() as u64) as usize;
                s.data[lo..hi].iter().any(|&b| b != 0)
            };
            let mut blk = off / BLOCK;
            while blk * BLOCK < s.size {
                if is_data(blk) == (whence == Seek::Data) {
                    return Ok(Some((blk * BLOCK).max(off)));
                }
                blk += 1;
            }
            Ok(match whence {
                Seek::Data => None,
                Seek::Hole => Some(s.size.max(off)),
            })
        }

        async fn resize(&self, _eng: &Engine, new_size: u64) -> backend::Result<()> {
            let mut s = self.state();
            s.size = new_size;
            s.data.truncate(new_size as usize);
            Ok(())
        }

        async fn grow_to(&self, _eng: &Engine, new_size: u64) -> backend::Result<()> {
            let mut s = self.state();
            s.size = s.size.max(new_size);
            Ok(())
        }

        fn written_to(&self, end: u64) {
            let mut s = self.state();
            s.size = s.size.max(end);
        }

        fn set_times(&self, atime: Option<Time>, mtime: Option<Time>) -> backend::Result<()> {
            self.state().times = Some((atime, mtime));
            Ok(())
        }
    }

    /// An image of `len` bytes, none of them zero (so every block is data), distinct per offset.
    pub fn image(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8 + 1).collect()
    }

    /// What came back for a request: the reply's errno (0 on success) and body.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct Answer {
        pub errno: i32,
        pub body: Vec<u8>,
    }

    impl Answer {
        /// The body of a successful reply.
        #[track_caller]
        pub fn ok(&self) -> &[u8] {
            assert_eq!(self.errno, 0, "expected success, got errno {}", self.errno);
            &self.body
        }

        /// The body of a successful reply, decoded as exactly one `T`.
        #[track_caller]
        pub fn parse<T: FromBytes>(&self) -> T {
            T::read_from_bytes(self.ok()).expect("reply body is exactly one reply struct")
        }
    }

    /// A server over a [`Mem`] export, its engine and the two slot layouts.
    pub struct Harness {
        pub eng: Engine,
        pub server: QueueServer<export::Export<Mem>>,
        pub legacy: Layout,
        pub uring: UringLayout,
        unique: Cell<u64>,
    }

    impl Harness {
        pub fn new(cfg: ExportConfig, image: Vec<u8>) -> Harness {
            let legacy = Layout::new(MAX_WRITE);
            let uring = UringLayout::new(MAX_WRITE);
            let eng = Engine::new(&EngineConfig {
                sq_entries: 8,
                buffers: 2,
                buffer_size: legacy.size.max(uring.size),
                ..EngineConfig::default()
            })
            .expect("io_uring available");
            let export = Arc::new(Export::new(Mem::new(image), cfg));
            Harness {
                eng,
                server: QueueServer::new(export),
                legacy,
                uring,
                unique: Cell::new(100),
            }
        }

        pub fn mem(&self) -> &Mem {
            self.server.export().backend()
        }

        pub fn stats(&self) -> Snapshot {
            self.server.counters().snapshot()
        }

        /// A header for a request to `nodeid` with a fresh `unique`.
        pub fn header(&self, nodeid: u64, opcode: u32, args: &[u8], data: &[u8]) -> InHeader {
            self.unique.set(self.unique.get() + 1);
            InHeader {
                len: (40 + args.len() + data.len()) as u32,
                opcode,
                unique: self.unique.get(),
                nodeid,
                uid: UID,
                gid: UID,
                pid: 42,
                total_extlen: 0,
                padding: 0,
            }
        }

        /// Sends a request about the exported file (node 1) that takes a reply.
        #[track_caller]
        pub fn call(&self, f: Framing, opcode: u32, args: &[u8], data: &[u8]) -> Answer {
            self.call_node(f, 1, opcode, args, data)
                .unwrap_or_else(|| panic!("{f:?}: opcode {opcode} got no reply"))
        }

        /// Sends a request about `nodeid`: the fixed argument struct `args`, then `data` (a name,
        /// WRITE data). `None` when no reply was produced.
        pub fn call_node(
            &self,
            f: Framing,
            nodeid: u64,
            opcode: u32,
            args: &[u8],
            data: &[u8],
        ) -> Option<Answer> {
            let hdr = self.header(nodeid, opcode, args, data);
            match f {
                Framing::Legacy => {
                    let mut req = hdr.as_bytes().to_vec();
                    req.extend_from_slice(args);
                    req.extend_from_slice(data);
                    self.legacy_bytes(&req)
                }
                Framing::Uring => Some(self.uring_parts(hdr, args, data, data.len())),
            }
        }

        /// A fresh buffer filled with garbage, so nothing passes on leftover zeroes.
        fn buffer(&self) -> Buf {
            let mut buf = self.eng.take_buffer().expect("a free buffer");
            buf.as_mut_slice().fill(0xA5);
            buf
        }

        /// Legacy framing: `req` is what `read(2)` of `/dev/fuse` returned. Checks the reply's
        /// framing (length, unique, no body on an error) and returns it.
        pub fn legacy_bytes(&self, req: &[u8]) -> Option<Answer> {
            let l = self.legacy;
            let mut buf = self.buffer();
            buf.as_mut_slice()[l.request..l.request + req.len()].copy_from_slice(req);
            let (buf, len) = self
                .eng
                .block_on(
                    self.server
                        .serve_legacy(&self.eng, &l, buf, req.len(), true),
                )
                .unwrap();
            let len = match len {
                crate::LegacyReply::Bytes(n) => n,
                crate::LegacyReply::None => return None,
                s => panic!("{s:?} from a server that does not splice"),
            };
            let out = &buf.as_slice()[l.reply..];
            let (oh, _) = OutHeader::read_from_prefix(out).unwrap();
            assert_eq!(
                oh.len as usize, len,
                "out header length is the reply length"
            );
            assert!(len >= OUT_HEADER_LEN && len - OUT_HEADER_LEN <= l.payload_capacity());
            assert_eq!(Some(oh.unique), peek_unique(req), "reply echoes the unique");
            assert!(
                (-511..=0).contains(&oh.error),
                "error {} out of range",
                oh.error
            );
            assert!(
                oh.error == 0 || len == OUT_HEADER_LEN,
                "error reply with a body"
            );
            Some(Answer {
                errno: -oh.error,
                body: out[OUT_HEADER_LEN..len].to_vec(),
            })
        }

        /// io_uring framing: the kernel put `hdr` in the entry's header area, `op_in` in its
        /// argument area, `payload` in its payload and said `payload_sz`. Checks what the commit
        /// sends (out header, `payload_sz`) and returns the reply.
        pub fn uring_parts(
            &self,
            hdr: InHeader,
            op_in: &[u8],
            payload: &[u8],
            payload_sz: usize,
        ) -> Answer {
            let l = self.uring;
            let ent = l.header + 256;
            let mut buf = self.buffer();
            let b = buf.as_mut_slice();
            // The kernel copies the whole header area: what the opcode does not use is zero.
            b[l.header..l.header + 288].fill(0);
            b[l.header..l.header + 40].copy_from_slice(hdr.as_bytes());
            b[l.op_in()..l.op_in() + op_in.len()].copy_from_slice(op_in);
            let ent_in = UringEntInOut {
                commit_id: hdr.unique,
                payload_sz: payload_sz as u32,
                ..UringEntInOut::default()
            };
            b[ent..ent + 32].copy_from_slice(ent_in.as_bytes());
            b[l.payload..l.payload + payload.len()].copy_from_slice(payload);
            let d = Delivered {
                header: hdr,
                commit_id: hdr.unique,
                payload_sz,
            };
            let buf = self
                .eng
                .block_on(self.server.serve_uring(&self.eng, &l, buf, &d))
                .unwrap();
            Self::uring_reply(&l, &buf, hdr.unique)
        }

        /// Reads and checks the reply an io_uring entry commits.
        pub fn uring_reply(l: &UringLayout, buf: &Buf, unique: u64) -> Answer {
            let b = buf.as_slice();
            let (oh, _) = OutHeader::read_from_prefix(&b[l.header..]).unwrap();
            let at = l.header + 256 + std::mem::offset_of!(UringEntInOut, payload_sz);
            let sz = u32::from_ne_bytes(b[at..at + 4].try_into().unwrap()) as usize;
            assert_eq!(oh.len as usize, OUT_HEADER_LEN + sz, "out header length");
            assert!(
                sz <= l.payload_len,
                "reply of {sz} bytes past the payload area"
            );
            assert_eq!(oh.unique, unique, "reply echoes the unique");
            assert!(
                (-511..=0).contains(&oh.error),
                "error {} out of range",
                oh.error
            );
            assert!(oh.error == 0 || sz == 0, "error reply with a body");
            Answer {
                errno: -oh.error,
                body: b[l.payload..l.payload + sz].to_vec(),
            }
        }

        pub fn read(&self, f: Framing, offset: u64, size: u32) -> Answer {
            let a = fuse_abi::ReadIn {
                offset,
                size,
                ..Default::default()
            };
            self.call(f, super::op::READ, a.as_bytes(), &[])
        }

        pub fn write(&self, f: Framing, offset: u64, data: &[u8]) -> Answer {
            let a = fuse_abi::WriteIn {
                offset,
                size: data.len() as u32,
                ..Default::default()
            };
            self.call(f, super::op::WRITE, a.as_bytes(), data)
        }
    }
}

fn ro() -> ExportConfig {
    ExportConfig::default()
}

fn rw() -> ExportConfig {
    ExportConfig {
        writable: true,
        ..ExportConfig::default()
    }
}

fn growable() -> ExportConfig {
    ExportConfig {
        writable: true,
        growable: true,
        ..ExportConfig::default()
    }
}

fn setattr(valid: u32, size: u64, mode: u32) -> SetattrIn {
    SetattrIn {
        valid,
        size,
        mode,
        ..Default::default()
    }
}

fn fallocate(offset: u64, length: u64, mode: u32) -> FallocateIn {
    FallocateIn {
        offset,
        length,
        mode,
        ..Default::default()
    }
}

fn lseek(offset: u64, whence: u32) -> LseekIn {
    LseekIn {
        offset,
        whence,
        ..Default::default()
    }
}

fn open(flags: i32) -> OpenIn {
    OpenIn {
        flags: flags as u32,
        open_flags: 0,
    }
}

fn write_out(a: &Answer) -> u32 {
    a.parse::<WriteOut>().size
}

// ---------------------------------------------------------------------------------------------
// Each opcode the export handles.

/// GETATTR: node 1 is a regular file of the image's size and owner; write bits only when the
/// export is writable; attr_valid from the configuration.
#[test]
fn getattr_describes_the_image() {
    for f in BOTH {
        for (cfg, perm) in [(ro(), 0o444), (rw(), 0o644)] {
            let h = Harness::new(cfg, image(10_000));
            let out: AttrOut = h
                .call(
                    f,
                    op::GETATTR,
                    fuse_abi::GetattrIn::default().as_bytes(),
                    &[],
                )
                .parse();
            let a = out.attr;
            assert_eq!((a.ino, a.size, a.nlink), (1, 10_000, 1), "{f:?}");
            assert_eq!(a.mode, libc::S_IFREG | perm, "{f:?}");
            assert_eq!((a.uid, a.gid, a.blksize), (1000, 1000, 4096), "{f:?}");
            assert_eq!((a.mtime, a.mtimensec), (3, 4), "{f:?}");
            assert_eq!((out.attr_valid, out.attr_valid_nsec), (1, 0), "{f:?}");
            assert_eq!(h.stats().ops[op::GETATTR as usize], 1);
        }
    }
}

/// SETATTR: the size may change only on a growable export (EPERM on a fixed one, EROFS on a
/// read-only one); setting the current size, or the current mode, is fine; times reach the backend.
#[test]
fn setattr_size_follows_the_export_config() {
    for f in BOTH {
        let h = Harness::new(rw(), image(8192));
        let grow = setattr(FATTR_SIZE, 9000, 0);
        assert_eq!(
            h.call(f, op::SETATTR, grow.as_bytes(), &[]).errno,
            libc::EPERM
        );
        let same = setattr(FATTR_SIZE, 8192, 0);
        let a: AttrOut = h.call(f, op::SETATTR, same.as_bytes(), &[]).parse();
        assert_eq!(a.attr.size, 8192, "{f:?}");
        assert_eq!(h.mem().state().size, 8192);

        let chmod = setattr(FATTR_MODE, 0, 0o600);
        assert_eq!(
            h.call(f, op::SETATTR, chmod.as_bytes(), &[]).errno,
            libc::EPERM
        );
        let keep = setattr(FATTR_MODE, 0, 0o644);
        h.call(f, op::SETATTR, keep.as_bytes(), &[]).ok();

        let touch = SetattrIn {
            valid: FATTR_MTIME,
            mtime: 77,
            mtimensec: 8,
            ..Default::default()
        };
        h.call(f, op::SETATTR, touch.as_bytes(), &[]).ok();
        assert_eq!(h.mem().state().times, Some((None, Some((77, 8)))), "{f:?}");

        let h = Harness::new(ro(), image(8192));
        for size in [9000, 100, 0] {
            let a = h.call(f, op::SETATTR, setattr(FATTR_SIZE, size, 0).as_bytes(), &[]);
            assert_eq!(a.errno, libc::EROFS, "{f:?}: truncate to {size}");
        }
        assert_eq!(h.mem().state().size, 8192);
        assert_eq!(h.mem().contents(), image(8192));

        let h = Harness::new(growable(), image(8192));
        for size in [9000, 100] {
            let a: AttrOut = h
                .call(f, op::SETATTR, setattr(FATTR_SIZE, size, 0).as_bytes(), &[])
                .parse();
            assert_eq!(a.attr.size, size, "{f:?}");
            assert_eq!(h.mem().state().size, size, "{f:?}");
        }
    }
}

/// OPEN: a write open of a read-only export is EROFS; other opens get direct I/O (or the page
/// cache with kernel_cache, or passthrough once set).
#[test]
fn open_flags_and_read_only_refusal() {
    for f in BOTH {
        let h = Harness::new(ro(), image(4096));
        for flags in [libc::O_WRONLY, libc::O_RDWR] {
            assert_eq!(
                h.call(f, op::OPEN, open(flags).as_bytes(), &[]).errno,
                libc::EROFS,
                "{f:?}"
            );
        }
        let o: OpenOut = h
            .call(f, op::OPEN, open(libc::O_RDONLY).as_bytes(), &[])
            .parse();
        assert_eq!(o.open_flags, FOPEN_DIRECT_IO | FOPEN_PARALLEL_DIRECT_WRITES);

        let h = Harness::new(rw(), image(4096));
        h.call(f, op::OPEN, open(libc::O_RDWR).as_bytes(), &[]).ok();

        let cached = ExportConfig {
            kernel_cache: true,
            ..ro()
        };
        let h = Harness::new(cached, image(4096));
        let o: OpenOut = h
            .call(f, op::OPEN, open(libc::O_RDONLY).as_bytes(), &[])
            .parse();
        assert_eq!(o.open_flags, FOPEN_KEEP_CACHE, "{f:?}");

        let h = Harness::new(ro(), image(4096));
        assert!(h.server.export().set_passthrough(Passthrough {
            backing_id: 7,
            write_opens: false,
        }));
        let o: OpenOut = h
            .call(f, op::OPEN, open(libc::O_RDONLY).as_bytes(), &[])
            .parse();
        assert_eq!(
            (o.open_flags, o.backing_id),
            (FOPEN_PASSTHROUGH | FOPEN_NOFLUSH, 7)
        );
    }
}

/// The open-file count a stop waits on: successful OPENs count up, refused ones do not, RELEASEs
/// count down, and it never reads below zero.
#[test]
fn open_files_count_opens_minus_releases() {
    for f in BOTH {
        let h = Harness::new(ro(), image(4096));
        let count = || h.server.export().open_files();
        assert_eq!(count(), 0, "{f:?}");
        h.call(f, op::OPEN, open(libc::O_RDONLY).as_bytes(), &[])
            .ok();
        h.call(f, op::OPEN, open(libc::O_RDONLY).as_bytes(), &[])
            .ok();
        assert_eq!(count(), 2, "{f:?}");
        let refused = h.call(f, op::OPEN, open(libc::O_RDWR).as_bytes(), &[]);
        assert_eq!(refused.errno, libc::EROFS, "{f:?}");
        assert_eq!(count(), 2, "{f:?}: a refused open is not open");
        let rel = ReleaseIn::default();
        h.call(f, op::RELEASE, rel.as_bytes(), &[]).ok();
        assert_eq!(count(), 1, "{f:?}");
        h.call(f, op::RELEASE, rel.as_bytes(), &[]).ok();
        h.call(f, op::RELEASE, rel.as_bytes(), &[]).ok();
        assert_eq!(
            count(),
            0,
            "{f:?}: more releases than opens read as none open"
        );
        h.server.export().set_open_files(3);
        assert_eq!(count(), 3, "{f:?}");
    }
}

/// RELEASE and DESTROY succeed with an empty body.
#[test]
fn release_and_destroy_reply_empty() {
    for f in BOTH {
        let h = Harness::new(rw(), image(4096));
        let rel = ReleaseIn::default();
        assert_eq!(
            h.call(f, op::RELEASE, rel.as_bytes(), &[]).ok(),
            b"",
            "{f:?}"
        );
        assert_eq!(h.call(f, op::DESTROY, &[], &[]).ok(), b"", "{f:?}");
    }
}

/// READ: the reply carries the backend's bytes, short at the end of the image, empty at or past
/// it and for a zero-length read.
#[test]
fn read_returns_the_images_bytes() {
    let img = image(10_000);
    for f in BOTH {
        let h = Harness::new(ro(), img.clone());
        assert_eq!(h.read(f, 0, 4096).ok(), &img[..4096], "{f:?}");
        assert_eq!(h.read(f, 1234, 100).ok(), &img[1234..1334], "{f:?}");
        assert_eq!(
            h.read(f, 8192, 4096).ok(),
            &img[8192..],
            "{f:?} short at EOF"
        );
        assert_eq!(h.read(f, 10_000, 4096).ok(), b"", "{f:?} at EOF");
        assert_eq!(h.read(f, u64::MAX, 4096).ok(), b"", "{f:?} far past EOF");
        assert_eq!(h.read(f, 0, 0).ok(), b"", "{f:?} zero-length");
        let s = h.stats();
        assert_eq!(s.ops[op::READ as usize], 6);
        assert_eq!((s.backend_reads, s.bytes_read), (3, 4096 + 100 + 1808));
    }
}

/// A READ larger than the payload area (the kernel never sends one; max_pages says so) is
/// served up to the framing's payload area, never past it: on io_uring that is `payload_len`,
/// so the reply fits the entry instead of failing with EIO after a backend read.
#[test]
fn read_larger_than_the_payload_area_is_clamped_to_it() {
    let img = image(3 * MAX_WRITE);
    for f in BOTH {
        let h = Harness::new(ro(), img.clone());
        let a = h.read(f, 0, (MAX_WRITE + 4096) as u32);
        let n = a.ok().len();
        assert!(n >= MAX_WRITE, "{f:?}: {n} bytes");
        assert_eq!(a.ok(), &img[..n], "{f:?}");
    }
}

/// READ of a whole slot: MAX_WRITE bytes come back in one reply on both framings.
#[test]
fn read_fills_the_payload_area() {
    let img = image(2 * MAX_WRITE);
    for f in BOTH {
        let h = Harness::new(ro(), img.clone());
        let a = h.read(f, 1, MAX_WRITE as u32);
        assert_eq!(a.ok(), &img[1..1 + MAX_WRITE], "{f:?}");
    }
}

/// WRITE: the data lands in the backend at the offset, WriteOut.size says how much, and it
/// arrived where the backend reads it (no userspace copy on either framing).
#[test]
fn write_lands_in_the_backend() {
    for f in BOTH {
        let h = Harness::new(rw(), vec![0; 2 * MAX_WRITE]);
        let data = image(5000);
        assert_eq!(write_out(&h.write(f, 3000, &data)), 5000, "{f:?}");
        let mut want = vec![0; 2 * MAX_WRITE];
        want[3000..8000].copy_from_slice(&data);
        assert_eq!(h.mem().contents(), want, "{f:?}");
        assert_eq!(h.read(f, 3000, 5000).ok(), &data[..], "{f:?}");
        let s = h.stats();
        assert_eq!((s.backend_writes, s.bytes_written), (1, 5000));
        assert_eq!(
            s.bytes_copied, 0,
            "{f:?}: WRITE data was copied in userspace"
        );
        assert_eq!(s.backend_flushes, 0);

        let full = image(MAX_WRITE);
        assert_eq!(write_out(&h.write(f, 1, &full)), MAX_WRITE as u32, "{f:?}");
        assert_eq!(&h.mem().contents()[1..1 + MAX_WRITE], &full[..], "{f:?}");
    }
}

/// WRITE on a fixed-size export: cut at the end, ENOSPC at or past it, EROFS when read-only,
/// EFBIG when offset + size overflows.
#[test]
fn write_stops_at_the_end_of_a_fixed_image() {
    for f in BOTH {
        let h = Harness::new(rw(), vec![0; 8192]);
        let data = image(100);
        assert_eq!(write_out(&h.write(f, 8192 - 40, &data)), 40, "{f:?}");
        assert_eq!(&h.mem().contents()[8152..], &data[..40]);
        assert_eq!(h.mem().state().size, 8192);
        assert_eq!(h.write(f, 8192, &data).errno, libc::ENOSPC, "{f:?}");
        assert_eq!(h.write(f, 1 << 40, &data).errno, libc::ENOSPC, "{f:?}");
        assert_eq!(h.write(f, u64::MAX - 10, &data).errno, libc::EFBIG, "{f:?}");
        assert_eq!(
            h.mem().state().writes,
            1,
            "{f:?}: refused writes reached the backend"
        );

        let h = Harness::new(ro(), vec![0; 8192]);
        assert_eq!(h.write(f, 0, &data).errno, libc::EROFS, "{f:?}");
        assert_eq!(h.mem().state().writes, 0);
    }
}

/// WRITE on a growable export: past the end it grows the image by exactly what was written (the
/// gap reads as zeroes); a failed write does not grow it, a short one only as far as it got.
#[test]
fn growable_write_grows_by_what_was_written() {
    for f in BOTH {
        let h = Harness::new(growable(), image(8192));
        let data = image(100);
        assert_eq!(write_out(&h.write(f, 10_000, &data)), 100, "{f:?}");
        assert_eq!(h.mem().state().size, 10_100, "{f:?}");
        assert_eq!(h.read(f, 8192, 1808).ok(), &[0; 1808][..], "{f:?}");
        assert_eq!(h.read(f, 10_000, 4096).ok(), &data[..], "{f:?}");

        h.mem().state().fail_write = Some(Fault::Errno(libc::EIO));
        assert_eq!(h.write(f, 20_000, &data).errno, libc::EIO, "{f:?}");
        assert_eq!(
            h.mem().state().size,
            10_100,
            "{f:?}: a failed write grew the image"
        );

        h.mem().state().short_write = Some(30);
        assert_eq!(write_out(&h.write(f, 10_100, &data)), 30, "{f:?}");
        assert_eq!(h.mem().state().size, 10_130, "{f:?}");
    }
}

/// Writethrough: every WRITE is followed by a counted backend flush; a failing flush fails it.
#[test]
fn writethrough_flushes_after_each_write() {
    for f in BOTH {
        let cfg = ExportConfig {
            writethrough: true,
            ..rw()
        };
        let h = Harness::new(cfg, vec![0; 8192]);
        write_out(&h.write(f, 0, b"abc"));
        assert_eq!(h.mem().state().flushes, 1, "{f:?}");
        assert_eq!(h.stats().backend_flushes, 1, "{f:?}");
        h.mem().state().fail_flush = Some(Fault::Errno(libc::EIO));
        assert_eq!(h.write(f, 0, b"abc").errno, libc::EIO, "{f:?}");
        assert_eq!(h.stats().backend_flushes, 1, "{f:?}");
    }
}

/// FLUSH and FSYNC: one counted backend flush each on a writable export, none on a read-only
/// one; a backend flush error is the reply's error.
#[test]
fn flush_and_fsync_flush_the_backend() {
    for f in BOTH {
        let h = Harness::new(rw(), vec![0; 4096]);
        let flush = fuse_abi::FlushIn::default();
        let fsync = FsyncIn::default();
        assert_eq!(h.call(f, op::FLUSH, flush.as_bytes(), &[]).ok(), b"");
        assert_eq!(h.call(f, op::FSYNC, fsync.as_bytes(), &[]).ok(), b"");
        assert_eq!(h.mem().state().flushes, 2, "{f:?}");
        assert_eq!(h.stats().backend_flushes, 2, "{f:?}");
        h.mem().state().fail_flush = Some(Fault::Errno(libc::EIO));
        assert_eq!(h.call(f, op::FSYNC, fsync.as_bytes(), &[]).errno, libc::EIO);
        assert_eq!(h.stats().backend_flushes, 2, "{f:?}");

        let h = Harness::new(ro(), vec![0; 4096]);
        h.call(f, op::FLUSH, flush.as_bytes(), &[]).ok();
        h.call(f, op::FSYNC, fsync.as_bytes(), &[]).ok();
        assert_eq!(h.mem().state().flushes, 0, "{f:?}");
        assert_eq!(h.stats().backend_flushes, 0, "{f:?}");
    }
}

/// FALLOCATE: punching a hole (clamped to the image) and zeroing a range read back as zeroes
/// without changing the size; past the end it is ENOSPC on a fixed image and grows a growable
/// one (unless KEEP_SIZE); other modes are EOPNOTSUPP; EROFS on a read-only export.
#[test]
fn fallocate_punches_zeroes_and_grows() {
    const PUNCH: u32 = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE;
    let img = image(16_384);
    for f in BOTH {
        let h = Harness::new(rw(), img.clone());
        let fa =
            |off, len, mode| h.call(f, op::FALLOCATE, fallocate(off, len, mode).as_bytes(), &[]);
        assert_eq!(fa(4096, 4096, PUNCH).ok(), b"", "{f:?}");
        assert_eq!(
            fa(12_000, 1 << 30, PUNCH).ok(),
            b"",
            "{f:?} clamps to the image"
        );
        assert_eq!(fa(100, 10, FALLOC_FL_ZERO_RANGE).ok(), b"", "{f:?}");
        let mut want = img.clone();
        want[4096..8192].fill(0);
        want[12_000..].fill(0);
        want[100..110].fill(0);
        assert_eq!(h.mem().contents(), want, "{f:?}");
        assert_eq!(h.read(f, 0, 16_384).ok(), &want[..], "{f:?}");
        assert_eq!(h.mem().state().size, 16_384);

        assert_eq!(fa(0, 16_384, 0).ok(), b"", "{f:?}");
        assert_eq!(fa(16_000, 1000, 0).errno, libc::ENOSPC, "{f:?}");
        assert_eq!(fa(16_000, 1000, FALLOC_FL_KEEP_SIZE).ok(), b"", "{f:?}");
        assert_eq!(fa(0, 10, FALLOC_FL_COLLAPSE_RANGE).errno, libc::EOPNOTSUPP);
        assert_eq!(fa(u64::MAX, 2, 0).errno, libc::EFBIG, "{f:?}");
        assert_eq!(h.mem().state().size, 16_384);

        let h = Harness::new(growable(), img.clone());
        let fa =
            |off, len, mode| h.call(f, op::FALLOCATE, fallocate(off, len, mode).as_bytes(), &[]);
        fa(16_000, 1000, FALLOC_FL_KEEP_SIZE).ok();
        assert_eq!(
            h.mem().state().size,
            16_384,
            "{f:?}: KEEP_SIZE grew the image"
        );
        fa(16_000, 1000, 0).ok();
        assert_eq!(h.mem().state().size, 17_000, "{f:?}");
        fa(20_000, 100, FALLOC_FL_ZERO_RANGE).ok();
        assert_eq!(h.mem().state().size, 20_100, "{f:?}");

        let h = Harness::new(ro(), img.clone());
        for mode in [
            0,
            FALLOC_FL_KEEP_SIZE,
            PUNCH,
            FALLOC_FL_ZERO_RANGE,
            FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE,
        ] {
            for (off, len) in [(0, 10), (16_000, 1000)] {
                let a = h.call(f, op::FALLOCATE, fallocate(off, len, mode).as_bytes(), &[]);
                assert_eq!(a.errno, libc::EROFS, "{f:?} mode {mode:#x}");
            }
        }
        assert_eq!(h.mem().contents(), img);
        assert_eq!(h.mem().state().size, 16_384);
    }
}

/// LSEEK: SEEK_DATA/SEEK_HOLE answer from the backend's block status (EOF is a hole); an offset
/// at or past the end, or no data after it, is ENXIO; another whence is EINVAL.
#[test]
fn lseek_finds_data_and_holes() {
    for f in BOTH {
        let h = Harness::new(rw(), image(16_384));
        let punch = fallocate(4096, 4096, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE);
        h.call(f, op::FALLOCATE, punch.as_bytes(), &[]).ok();
        let seek = |off, whence| h.call(f, op::LSEEK, lseek(off, whence).as_bytes(), &[]);
        let at = |off, whence| seek(off, whence).parse::<LseekOut>().offset;
        assert_eq!(at(0, SEEK_DATA), 0, "{f:?}");
        assert_eq!(at(10, SEEK_HOLE), 4096, "{f:?}");
        assert_eq!(at(5000, SEEK_HOLE), 5000, "{f:?}");
        assert_eq!(at(5000, SEEK_DATA), 8192, "{f:?}");
        assert_eq!(at(9000, SEEK_HOLE), 16_384, "{f:?} EOF is a hole");
        assert_eq!(seek(16_384, SEEK_DATA).errno, libc::ENXIO, "{f:?}");
        assert_eq!(seek(u64::MAX, SEEK_HOLE).errno, libc::ENXIO, "{f:?}");
        assert_eq!(seek(0, 0).errno, libc::EINVAL, "{f:?} SEEK_SET");

        let tail = fallocate(12_288, 4096, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE);
        h.call(f, op::FALLOCATE, tail.as_bytes(), &[]).ok();
        assert_eq!(
            seek(12_300, SEEK_DATA).errno,
            libc::ENXIO,
            "{f:?} no data after"
        );
    }
}

/// STATFS: one file, 4 KiB blocks, as many blocks as the image needs.
#[test]
fn statfs_counts_the_images_blocks() {
    for f in BOTH {
        let h = Harness::new(ro(), image(10_000));
        let st = h.call(f, op::STATFS, &[], &[]).parse::<StatfsOut>().st;
        assert_eq!((st.blocks, st.bsize, st.frsize), (3, 4096, 4096), "{f:?}");
        assert_eq!((st.files, st.namelen), (1, 255), "{f:?}");
    }
}

/// LOOKUP is ENOENT (the file is the mount's root; nothing lies below it).
#[test]
fn lookup_is_enoent() {
    for f in BOTH {
        let h = Harness::new(ro(), image(4096));
        assert_eq!(h.call(f, op::LOOKUP, &[], b"name\0").errno, libc::ENOENT);
        assert_eq!(h.stats().ops[op::LOOKUP as usize], 1);
    }
}

/// Opcodes fusex does not implement, known or not, are ENOSYS; a second INIT is EPROTO.
#[test]
fn unsupported_opcodes_are_enosys() {
    for f in BOTH {
        let h = Harness::new(rw(), image(4096));
        for opcode in [op::MKDIR, 53, 99, 4096, u32::MAX] {
            assert_eq!(
                h.call(f, opcode, &[], &[]).errno,
                libc::ENOSYS,
                "{f:?} {opcode}"
            );
        }
        let init = fuse_abi::InitIn {
            major: 7,
            minor: 45,
            ..Default::default()
        };
        assert_eq!(
            h.call(f, op::INIT, init.as_bytes(), &[]).errno,
            libc::EPROTO
        );
        let s = h.mem().state();
        assert_eq!((s.reads, s.writes), (0, 0), "{f:?}");
    }
}

/// A node other than 1 is ENOENT for every opcode that names one, before the backend is touched.
#[test]
fn other_nodes_are_enoent() {
    for f in BOTH {
        let h = Harness::new(rw(), image(4096));
        let read = ReadIn {
            size: 100,
            ..Default::default()
        };
        let write = WriteIn {
            size: 3,
            ..Default::default()
        };
        let (getattr, fsync) = (fuse_abi::GetattrIn::default(), FsyncIn::default());
        let cases: [(u32, &[u8], &[u8]); 5] = [
            (op::GETATTR, getattr.as_bytes(), &[]),
            (op::READ, read.as_bytes(), &[]),
            (op::WRITE, write.as_bytes(), b"xyz"),
            (op::FSYNC, fsync.as_bytes(), &[]),
            (op::STATFS, &[], &[]),
        ];
        for node in [0, 2, u64::MAX] {
            for (opcode, args, data) in cases {
                let a = h.call_node(f, node, opcode, args, data).expect("a reply");
                assert_eq!(a.errno, libc::ENOENT, "{f:?} node {node} opcode {opcode}");
            }
        }
        let s = h.mem().state();
        assert_eq!((s.reads, s.writes, s.flushes), (0, 0, 0), "{f:?}");
        assert_eq!(&s.data[..], &image(4096)[..]);
    }
}

// ---------------------------------------------------------------------------------------------
// Requests that take no reply.

/// Legacy: FORGET, BATCH_FORGET and INTERRUPT get no reply (whatever node they name); they are
/// counted as requests, not as malformed ones.
#[test]
fn legacy_forget_and_interrupt_take_no_reply() {
    let h = Harness::new(rw(), image(4096));
    let forget = fuse_abi::ForgetIn { nlookup: 1 };
    let batch = fuse_abi::BatchForgetIn { count: 0, dummy: 0 };
    let interrupt = fuse_abi::InterruptIn { unique: 5 };
    for node in [1, 7] {
        let l = Framing::Legacy;
        assert_eq!(
            h.call_node(l, node, op::FORGET, forget.as_bytes(), &[]),
            None
        );
        assert_eq!(
            h.call_node(l, node, op::BATCH_FORGET, batch.as_bytes(), &[]),
            None
        );
        assert_eq!(
            h.call_node(l, node, op::INTERRUPT, interrupt.as_bytes(), &[]),
            None
        );
    }
    let s = h.stats();
    assert_eq!(
        s.ops[op::FORGET as usize] + s.ops[op::INTERRUPT as usize],
        4
    );
    assert_eq!(s.malformed, 0);
}

/// io_uring: a request that takes no reply never travels over the ring, but if one did the entry
/// must still be answered (ENOSYS) so it re-arms.
#[test]
fn uring_answers_even_forget() {
    let h = Harness::new(rw(), image(4096));
    let forget = fuse_abi::ForgetIn { nlookup: 1 };
    let a = h.call(Framing::Uring, op::FORGET, forget.as_bytes(), &[]);
    assert_eq!(a.errno, libc::ENOSYS);
    let interrupt = fuse_abi::InterruptIn { unique: 5 };
    let a = h.call(Framing::Uring, op::INTERRUPT, interrupt.as_bytes(), &[]);
    assert_eq!(a.errno, libc::ENOSYS);
}

/// io_uring: a refused request (queue stopping) is answered with the errno, an empty payload and
/// its unique, and never reaches the backend.
#[test]
fn uring_refusal_answers_with_the_errno() {
    let h = Harness::new(rw(), image(4096));
    let l = h.uring;
    let args = ReadIn {
        size: 100,
        ..Default::default()
    };
    let hdr = h.header(1, op::READ, args.as_bytes(), &[]);
    let mut buf = h.eng.take_buffer().unwrap();
    buf.as_mut_slice().fill(0xA5);
    let d = transport::Delivered {
        header: hdr,
        commit_id: hdr.unique,
        payload_sz: 0,
    };
    h.server.refuse_uring(&l, &mut buf, &d, libc::ENOTCONN);
    let a = Harness::uring_reply(&l, &buf, hdr.unique);
    assert_eq!(a.errno, libc::ENOTCONN);
    assert_eq!(h.mem().state().reads, 0);
}

// ---------------------------------------------------------------------------------------------
// Malformed requests.

/// Legacy: every truncation of a WRITE request. Fewer than 40 bytes: no reply (no unique to
/// answer). A header whose length disagrees with the bytes: EIO. A header that agrees but
/// arguments too short or data shorter than WriteIn.size: EINVAL. Each is counted as malformed
/// and nothing reaches the backend.
#[test]
fn legacy_truncated_write_never_reaches_the_backend() {
    let h = Harness::new(rw(), vec![0; 8192]);
    let data = image(100);
    let args = WriteIn {
        offset: 10,
        size: 100,
        ..Default::default()
    };
    let hdr = h.header(1, op::WRITE, args.as_bytes(), &data);
    let mut full = hdr.as_bytes().to_vec();
    full.extend_from_slice(args.as_bytes());
    full.extend_from_slice(&data);
    let mut malformed = 0;
    for k in 0..full.len() {
        // As received: the header still says the full length.
        let a = h.legacy_bytes(&full[..k]);
        malformed += 1;
        match k {
            0..40 => assert_eq!(a, None, "{k} bytes"),
            _ => assert_eq!(a.map(|a| a.errno), Some(libc::EIO), "{k} bytes"),
        }
        // A header that agrees with the truncated length.
        if k >= 40 {
            let mut req = full[..k].to_vec();
            req[..4].copy_from_slice(&(k as u32).to_ne_bytes());
            let a = h.legacy_bytes(&req).expect("a reply");
            malformed += 1;
            assert_eq!(a.errno, libc::EINVAL, "{k} bytes, header agrees");
        }
        assert_eq!(h.stats().malformed, malformed, "{k} bytes");
    }
    assert_eq!(h.mem().state().writes, 0);
    assert_eq!(h.mem().contents(), vec![0; 8192]);
    assert_eq!(h.stats().ops[op::WRITE as usize], 0);
    // The untruncated request goes through.
    assert_eq!(write_out(&h.legacy_bytes(&full).unwrap()), 100);
}

/// Legacy: an argument struct one byte short is EINVAL for every opcode that has one (even
/// FORGET and INTERRUPT, which would take no reply), counted as malformed.
#[test]
fn legacy_short_arguments_are_einval() {
    let h = Harness::new(rw(), image(4096));
    use std::mem::size_of;
    let sizes = [
        (op::FORGET, size_of::<fuse_abi::ForgetIn>()),
        (op::GETATTR, size_of::<fuse_abi::GetattrIn>()),
        (op::SETATTR, size_of::<SetattrIn>()),
        (op::OPEN, size_of::<OpenIn>()),
        (op::READ, size_of::<ReadIn>()),
        (op::WRITE, size_of::<WriteIn>()),
        (op::RELEASE, size_of::<ReleaseIn>()),
        (op::FSYNC, size_of::<FsyncIn>()),
        (op::FLUSH, size_of::<fuse_abi::FlushIn>()),
        (op::INIT, fuse_abi::INIT_IN_COMPAT_SIZE),
        (op::INTERRUPT, size_of::<fuse_abi::InterruptIn>()),
        (op::BATCH_FORGET, size_of::<fuse_abi::BatchForgetIn>()),
        (op::FALLOCATE, size_of::<FallocateIn>()),
        (op::LSEEK, size_of::<LseekIn>()),
    ];
    for (i, (opcode, size)) in sizes.into_iter().enumerate() {
        let args = vec![0u8; size - 1];
        let a = h.call(Framing::Legacy, opcode, &args, &[]);
        assert_eq!(a.errno, libc::EINVAL, "opcode {opcode}");
        assert_eq!(h.stats().malformed, i as u64 + 1);
    }
    assert_eq!(h.stats().ops.iter().sum::<u64>(), 0);
}

/// Legacy: a header claiming more (or fewer) bytes than were read is EIO, malformed.
#[test]
fn legacy_length_mismatch_is_eio() {
    let h = Harness::new(ro(), image(4096));
    let args = ReadIn {
        size: 10,
        ..Default::default()
    };
    for len in [0u32, 39, 40, 79, 81, 4096, u32::MAX] {
        let mut hdr = h.header(1, op::READ, args.as_bytes(), &[]);
        hdr.len = len;
        let mut req = hdr.as_bytes().to_vec();
        req.extend_from_slice(args.as_bytes());
        let a = h.legacy_bytes(&req).expect("a reply");
        assert_eq!(a.errno, libc::EIO, "header len {len}");
    }
    assert_eq!(h.stats().malformed, 7);
    assert_eq!(h.mem().state().reads, 0);
}

/// Both framings: WRITE data that disagrees with WriteIn.size, a LOOKUP name without its NUL and
/// extensions longer than the request are EINVAL, counted as malformed.
#[test]
fn inconsistent_arguments_are_einval() {
    for f in BOTH {
        let h = Harness::new(rw(), vec![0; 8192]);
        let args = WriteIn {
            size: 10,
            ..Default::default()
        };
        assert_eq!(
            h.call(f, op::WRITE, args.as_bytes(), &[7; 9]).errno,
            libc::EINVAL
        );
        assert_eq!(
            h.call(f, op::WRITE, args.as_bytes(), &[7; 11]).errno,
            libc::EINVAL
        );
        assert_eq!(
            h.call(f, op::LOOKUP, &[], b"name").errno,
            libc::EINVAL,
            "{f:?}"
        );
        assert_eq!(h.stats().malformed, 3, "{f:?}");

        let mut hdr = h.header(1, op::GETATTR, &[0; 16], &[]);
        hdr.total_extlen = 3;
        let a = match f {
            Framing::Legacy => {
                let mut req = hdr.as_bytes().to_vec();
                req.extend_from_slice(&[0; 16]);
                h.legacy_bytes(&req).unwrap()
            }
            Framing::Uring => h.uring_parts(hdr, &[0; 16], &[], 0),
        };
        assert_eq!(a.errno, libc::EINVAL, "{f:?}");
        assert_eq!(h.stats().malformed, 4, "{f:?}");
        assert_eq!(h.mem().state().writes, 0, "{f:?}");
    }
}

/// io_uring: a payload size beyond the entry's payload area is cut to it, so a WRITE claiming
/// more data than fits is EINVAL rather than a read past the area.
#[test]
fn uring_payload_size_is_bounded_by_the_entry() {
    let h = Harness::new(rw(), vec![0; 2 * MAX_WRITE]);
    let len = h.uring.payload_len;
    let args = WriteIn {
        size: len as u32 + 1,
        ..Default::default()
    };
    let hdr = h.header(1, op::WRITE, args.as_bytes(), &[]);
    let a = h.uring_parts(hdr, args.as_bytes(), &[], len + 1);
    assert_eq!(a.errno, libc::EINVAL);
    assert_eq!(h.stats().malformed, 1);
    assert_eq!(h.mem().state().writes, 0);
}

// ---------------------------------------------------------------------------------------------
// Backend failures and short transfers.

/// A backend EIO on read or write is an EIO reply; ENOSPC from the backend is ENOSPC; the
/// backend is left as it was.
#[test]
fn backend_errors_become_the_replys_errno() {
    for f in BOTH {
        let h = Harness::new(rw(), image(8192));
        h.mem().state().fail_read = Some(Fault::Errno(libc::EIO));
        assert_eq!(h.read(f, 0, 4096).errno, libc::EIO, "{f:?}");
        assert_eq!(
            h.read(f, 0, 10).ok(),
            &image(10)[..],
            "{f:?}: only the next read fails"
        );

        for errno in [libc::EIO, libc::ENOSPC] {
            h.mem().state().fail_write = Some(Fault::Errno(errno));
            assert_eq!(h.write(f, 0, b"abc").errno, errno, "{f:?}");
        }
        assert_eq!(h.mem().contents(), image(8192), "{f:?}");
        let s = h.stats();
        // Failed transfers are not counted as transfers.
        assert_eq!((s.backend_reads, s.backend_writes), (1, 0), "{f:?}");
    }
}

/// Errors a reply cannot carry (errno 0, negative, above 511, none at all) become EIO;
/// "unsupported" becomes EOPNOTSUPP: the same on both framings.
#[test]
fn unsendable_errnos_become_eio() {
    let faults = [
        (Fault::Errno(0), libc::EIO),
        (Fault::Errno(-5), libc::EIO),
        (Fault::Errno(512), libc::EIO),
        (Fault::Errno(511), 511),
        (Fault::NoErrno, libc::EIO),
        (Fault::Unsupported, libc::EOPNOTSUPP),
    ];
    for f in BOTH {
        let h = Harness::new(rw(), image(8192));
        for (fault, errno) in faults {
            h.mem().state().fail_read = Some(fault);
            assert_eq!(h.read(f, 0, 10).errno, errno, "{f:?} read {fault:?}");
            h.mem().state().fail_write = Some(fault);
            assert_eq!(h.write(f, 0, b"x").errno, errno, "{f:?} write {fault:?}");
            h.mem().state().fail_flush = Some(fault);
            let fsync = FsyncIn::default();
            let a = h.call(f, op::FSYNC, fsync.as_bytes(), &[]);
            assert_eq!(a.errno, errno, "{f:?} fsync {fault:?}");
        }
    }
}

/// A short backend read: the reply carries exactly the bytes read, no more.
#[test]
fn short_read_replies_with_the_short_length() {
    let img = image(8192);
    for f in BOTH {
        let h = Harness::new(ro(), img.clone());
        for short in [0, 1, 100, 4095] {
            h.mem().state().short_read = Some(short);
            assert_eq!(
                h.read(f, 10, 4096).ok(),
                &img[10..10 + short],
                "{f:?} {short}"
            );
        }
        assert_eq!(h.stats().bytes_read, 4196, "{f:?}");
    }
}

/// A short backend write: WriteOut.size is the count written, and only that much landed.
#[test]
fn short_write_reports_the_short_count() {
    for f in BOTH {
        let h = Harness::new(rw(), vec![0; 8192]);
        let data = image(4096);
        h.mem().state().short_write = Some(1000);
        assert_eq!(write_out(&h.write(f, 0, &data)), 1000, "{f:?}");
        let c = h.mem().contents();
        assert_eq!(&c[..1000], &data[..1000], "{f:?}");
        assert!(c[1000..].iter().all(|&b| b == 0), "{f:?}");
        assert_eq!(h.stats().bytes_written, 1000, "{f:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// One reply path.

/// Both framings turn the same request into the same reply (errno and body), success or error,
/// because both go through `reply::reply_parts`.
#[test]
fn framings_agree_on_every_reply() {
    let read = ReadIn {
        offset: 8000,
        size: 4096,
        ..Default::default()
    };
    let write = WriteIn {
        offset: 8100,
        size: 200,
        ..Default::default()
    };
    let getattr = fuse_abi::GetattrIn::default();
    let cases: Vec<(u32, Vec<u8>, Vec<u8>)> = vec![
        (op::GETATTR, getattr.as_bytes().to_vec(), vec![]),
        (
            op::SETATTR,
            setattr(FATTR_SIZE, 1, 0).as_bytes().to_vec(),
            vec![],
        ),
        (op::OPEN, open(libc::O_RDWR).as_bytes().to_vec(), vec![]),
        (op::READ, read.as_bytes().to_vec(), vec![]),
        (op::WRITE, write.as_bytes().to_vec(), image(200)),
        (op::WRITE, write.as_bytes().to_vec(), image(199)),
        (op::STATFS, vec![], vec![]),
        (op::LSEEK, lseek(1, SEEK_HOLE).as_bytes().to_vec(), vec![]),
        (
            op::LSEEK,
            lseek(1 << 20, SEEK_DATA).as_bytes().to_vec(),
            vec![],
        ),
        (
            op::FALLOCATE,
            fallocate(0, 1 << 20, 0).as_bytes().to_vec(),
            vec![],
        ),
        (op::LOOKUP, vec![], b"x\0".to_vec()),
        (op::MKDIR, vec![], vec![]),
        (op::INIT, vec![0; 64], vec![]),
    ];
    for cfg in [ro(), rw(), growable()] {
        let hs = BOTH.map(|_| Harness::new(cfg, image(8192)));
        for (opcode, args, data) in &cases {
            let [l, u] = [0, 1].map(|i| hs[i].call(BOTH[i], *opcode, args, data));
            assert_eq!(l, u, "opcode {opcode} with {cfg:?}");
        }
        assert_eq!(hs[0].mem().contents(), hs[1].mem().contents());
        let [a, b] = [0, 1].map(|i| hs[i].stats());
        assert_eq!((a.ops, a.malformed), (b.ops, b.malformed), "{cfg:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Arbitrary input.

/// A request-shaped input: header fields drawn to reach every decoder branch, arguments and data
/// arbitrary.
fn arb_request() -> impl Strategy<Value = (InHeader, Vec<u8>, Vec<u8>)> {
    (
        prop_oneof![0u32..60, any::<u32>()],
        prop_oneof![Just(1u64), any::<u64>()],
        any::<u64>(),
        prop_oneof![Just(0u16), any::<u16>()],
        proptest::collection::vec(any::<u8>(), 0..128),
        proptest::collection::vec(any::<u8>(), 0..300),
    )
        .prop_map(|(opcode, nodeid, unique, total_extlen, args, data)| {
            let hdr = InHeader {
                len: (40 + args.len() + data.len()) as u32,
                opcode,
                unique,
                nodeid,
                total_extlen,
                ..InHeader::default()
            };
            (hdr, args, data)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Legacy: any bytes, request-shaped or not, yield no reply or a well-formed one (checked by
    /// the harness), never a panic.
    #[test]
    fn legacy_any_input_is_answered_or_dropped(
        (hdr, args, data) in arb_request(),
        raw in proptest::collection::vec(any::<u8>(), 0..200),
        cut in any::<proptest::sample::Index>(),
        bad_len in any::<Option<u32>>(),
    ) {
        let h = Harness::new(rw(), image(16_384));
        let mut hdr = hdr;
        if let Some(len) = bad_len {
            hdr.len = len;
        }
        let mut req = hdr.as_bytes().to_vec();
        req.extend_from_slice(&args);
        req.extend_from_slice(&data);
        let cut = cut.index(req.len() + 1);
        let _ = h.legacy_bytes(&req[..cut]);
        let _ = h.legacy_bytes(&raw);
        prop_assert_eq!(h.mem().state().size, 16_384);
    }

    /// io_uring: any header, argument area and payload (of any claimed size) yield a
    /// well-formed reply that fits the entry, never a panic.
    #[test]
    fn uring_any_input_is_answered(
        (hdr, args, data) in arb_request(),
        payload_sz in prop_oneof![Just(None), Just(Some(MAX_WRITE + 1)), any::<u16>().prop_map(|n| Some(n as usize))],
    ) {
        let h = Harness::new(rw(), image(16_384));
        let sz = payload_sz.unwrap_or(data.len());
        let _ = h.uring_parts(hdr, &args, &data, sz);
        prop_assert_eq!(h.mem().state().size, 16_384);
    }
}
