//! The `serve_dir` target: request sequences through the request server to a directory export
//! (`dirfs::DirFs`) of a small scratch tree, in the `/dev/fuse` framing, checking every reply
//! and that nothing outside the source directory changes.
//!
//! Input: one setup byte (see [`Setup::from_byte`]), then records as the `serve_*` targets take
//! them (a little-endian `u16` length and that many bytes of request). The tree: `src/sub/`,
//! `src/file` and `src/up`, a symlink to `../outside`, which holds `victim`.
//!
//! File handles are 64-bit values no mutation finds by chance, so a request that carries one
//! (at the start of its arguments: READ, WRITE, RELEASE, FLUSH, FSYNC, READDIR, LSEEK, ...)
//! and gives a value below 16 is sent the handle of that many-th successful OPEN, OPENDIR or
//! CREATE of the input instead. Node ids need no such help: the export numbers them from 2.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use dirfs::{DirConfig, DirFs};
use engine::{Engine, EngineConfig};
use fuse_abi::{parse, EntryOut, Opcode, OpenOut, Operation, IN_HEADER_LEN};
use server::{LegacyReply, QueueServer};
use transport::Layout;
use zerocopy::FromBytes;

use crate::serve::{legacy_reply, opcode_of, records, Summary};

/// Largest WRITE the slot buffer takes.
pub const MAX_WRITE: usize = 16 * 1024;
/// Byte the slot buffer is filled with before each request.
const GARBAGE: u8 = 0xA5;

/// How the export is set up.
#[derive(Clone, Copy, Debug)]
pub struct Setup {
    /// `--writable`.
    pub writable: bool,
    /// A descriptor budget of 2: every node but the root and one more is held by file handle.
    pub by_handle: bool,
    /// `FUSE_SETXATTR_EXT` granted (the longer SETXATTR head).
    pub setxattr_ext: bool,
    /// Metadata work on the ring instead of inline (the policy for non-local sources).
    pub on_ring: bool,
}

impl Setup {
    /// Bit 0: writable; 1: nodes by file handle; 2: `FUSE_SETXATTR_EXT`; 3: metadata on the ring.
    pub fn from_byte(b: u8) -> Setup {
        let bit = |n: u8| b & (1 << n) != 0;
        Setup {
            writable: bit(0),
            by_handle: bit(1),
            setxattr_ext: bit(2),
            on_ring: bit(3),
        }
    }
}

struct Harness {
    eng: Engine,
    layout: Layout,
}

/// The largest file the export may make (`RLIMIT_FSIZE`): a fuzzed FALLOCATE of gigabytes is a
/// legitimate request the source serves, and would fill the scratch disk for a moment.
pub const MAX_FILE: u64 = 256 << 20;

/// Caps the size of files this process writes at [`MAX_FILE`], so a write or allocation past it
/// fails with `EFBIG` (`SIGXFSZ` ignored) instead of taking the disk. Process-wide, as the limit
/// is; the hard limit stays, so children may raise it again.
fn cap_file_size() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit struct, setrlimit reads one, both live across the
    // calls; ignoring SIGXFSZ installs no handler (no code runs in signal context).
    let r = unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        if libc::getrlimit(libc::RLIMIT_FSIZE, &mut lim) == 0 {
            lim.rlim_cur = lim.rlim_max.min(MAX_FILE);
            libc::setrlimit(libc::RLIMIT_FSIZE, &lim)
        } else {
            -1
        }
    };
    assert_eq!(r, 0, "RLIMIT_FSIZE");
}

thread_local! {
    static HARNESS: Harness = {
        cap_file_size();
        let layout = Layout::new(MAX_WRITE);
        let eng = Engine::new(&EngineConfig {
            sq_entries: 8,
            buffers: 1,
            buffer_size: layout.size,
            ..EngineConfig::default()
        })
        .expect("the fuzz harness needs io_uring");
        Harness { eng, layout }
    };
}

/// Runs one input.
pub fn run(data: &[u8]) -> Summary {
    let Some((&setup, rest)) = data.split_first() else {
        return Summary::default();
    };
    HARNESS.with(|h| h.run(Setup::from_byte(setup), rest))
}

/// Opcodes whose arguments start with a file handle.
fn carries_handle(op: u32) -> bool {
    use Opcode::*;
    [
        Read,
        Write,
        Release,
        Releasedir,
        Flush,
        Fsync,
        Fsyncdir,
        Readdir,
        Readdirplus,
        Fallocate,
        Lseek,
    ]
    .iter()
    .any(|&o| o as u32 == op)
}

impl Harness {
    fn run(&self, setup: Setup, rest: &[u8]) -> Summary {
        let top = tempfile::tempdir().expect("a scratch directory");
        let (src, outside) = (top.path().join("src"), top.path().join("outside"));
        std::fs::create_dir_all(src.join("sub")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(src.join("file"), b"data").unwrap();
        std::fs::write(outside.join("victim"), b"victim").unwrap();
        std::os::unix::fs::symlink("../outside", src.join("up")).unwrap();
        let before = listing(&outside);
        let cfg = DirConfig {
            writable: setup.writable,
            max_node_fds: if setup.by_handle {
                2
            } else {
                DirConfig::default().max_node_fds
            },
            metadata_on_ring: Some(setup.on_ring),
            // The metadata read-ahead thread outlives inputs and would race the next one's tree.
            read_ahead: false,
            ..DirConfig::default()
        };
        let fs = Arc::new(DirFs::open(&src, cfg).expect("the scratch source opens"));
        fs.set_granted(if setup.setxattr_ext {
            fuse_abi::FUSE_SETXATTR_EXT
        } else {
            0
        });
        let server = QueueServer::new(fs);
        let l = &self.layout;
        let mut handles: Vec<u64> = Vec::new();
        let mut summary = Summary::default();
        for rec in records(rest) {
            let mut buf = self.eng.take_buffer().expect("the slot buffer");
            // The kernel never delivers more than the read asked for.
            let mut req = rec[..rec.len().min(buf.len() - l.request)].to_vec();
            let op = opcode_of(&req);
            if carries_handle(op) {
                if let Some(fh) = req.get_mut(40..48) {
                    let k = u64::from_ne_bytes((&*fh).try_into().unwrap());
                    if let Some(&h) = usize::try_from(k).ok().and_then(|k| handles.get(k)) {
                        fh.copy_from_slice(&h.to_ne_bytes());
                    }
                }
            }
            let n = req.len();
            let area = buf.as_mut_slice();
            area.fill(GARBAGE);
            area[l.request..l.request + n].copy_from_slice(&req);
            let (buf, reply) = self
                .eng
                .block_on(server.serve_legacy(&self.eng, l, buf, n, false))
                .expect("the engine runs");
            match reply {
                LegacyReply::None => {
                    let quiet = n < IN_HEADER_LEN
                        || parse(&req).is_ok_and(|r| {
                            matches!(
                                r.op,
                                Operation::Forget(_)
                                    | Operation::BatchForget { .. }
                                    | Operation::Interrupt(_)
                            )
                        });
                    assert!(quiet, "opcode {op} went unanswered");
                }
                LegacyReply::Bytes(len) => {
                    let (h, body) = legacy_reply(l, buf.as_slice(), len, &req);
                    summary.replies += 1;
                    if h.error == 0 {
                        if op < 64 {
                            summary.ok_opcodes |= 1 << op;
                        }
                        let open = match Opcode::from_u32(op) {
                            Some(Opcode::Open | Opcode::Opendir) => Some(body),
                            Some(Opcode::Create) => body.get(std::mem::size_of::<EntryOut>()..),
                            _ => None,
                        };
                        if let Some(Ok((o, _))) = open.map(OpenOut::read_from_prefix) {
                            handles.push(o.fh);
                        }
                    }
                }
                LegacyReply::Splice { .. } => panic!("a directory export never splices"),
            }
        }
        assert_eq!(
            listing(&outside),
            before,
            "something outside the source changed"
        );
        summary
    }
}

/// Everything below `dir`: (relative path, inode, mode, size).
fn listing(dir: &Path) -> Vec<(String, u64, u32, u64)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            if m.is_dir() {
                stack.push(p.clone());
            }
            let rel = p.strip_prefix(dir).unwrap().display().to_string();
            out.push((rel, m.ino(), m.mode(), m.len()));
        }
    }
    out.sort();
    out
}
