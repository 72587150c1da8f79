//! The kernel's input is untrusted: arbitrary request bytes, framed as `/dev/fuse` delivers them,
//! through the request server to a writable directory export never panic, always get a
//! well-formed reply (or none, for FORGET and friends), and never change anything outside the
//! source directory.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use dirfs::{DirConfig, DirFs};
use engine::{Engine, EngineConfig};
use fuse_abi::{Opcode, OutHeader};
use proptest::prelude::*;
use server::{LegacyReply, QueueServer};
use transport::Layout;
use zerocopy::FromBytes;

const MAX_WRITE: usize = 64 << 10;

/// Opcodes a directory export serves, weighted toward the ones that take names.
fn opcode() -> impl Strategy<Value = u32> {
    prop_oneof![
        4 => prop::sample::select(vec![
            Opcode::Lookup, Opcode::Mkdir, Opcode::Mknod, Opcode::Symlink, Opcode::Unlink,
            Opcode::Rmdir, Opcode::Rename, Opcode::Rename2, Opcode::Link, Opcode::Create,
            Opcode::Setxattr, Opcode::Getxattr, Opcode::Removexattr,
        ]).prop_map(|o| o as u32),
        2 => prop::sample::select(fuse_abi::Opcode::ALL.to_vec()).prop_map(|o| o as u32),
        1 => any::<u32>(),
    ]
}

/// Bodies: random bytes, or a fixed-size head then names made of dangerous pieces.
fn body() -> impl Strategy<Value = Vec<u8>> {
    let piece = prop::sample::select(vec![
        &b".."[..],
        b".",
        b"/",
        b"../..",
        b"etc",
        b"passwd",
        b"x",
        b"\0",
        b"a/b",
        b"",
    ]);
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..300),
        (
            prop::collection::vec(any::<u8>(), 0..24),
            prop::collection::vec(piece, 0..8),
        )
            .prop_map(|(head, pieces)| {
                let mut b = head;
                for p in pieces {
                    b.extend_from_slice(p);
                }
                b.push(0);
                b
            }),
    ]
}

fn request(opcode: u32, nodeid: u64, body: &[u8]) -> Vec<u8> {
    let mut r = Vec::with_capacity(40 + body.len());
    r.extend_from_slice(&((40 + body.len()) as u32).to_ne_bytes());
    r.extend_from_slice(&opcode.to_ne_bytes());
    r.extend_from_slice(&7u64.to_ne_bytes());
    r.extend_from_slice(&nodeid.to_ne_bytes());
    r.extend_from_slice(&0u32.to_ne_bytes()); // uid
    r.extend_from_slice(&0u32.to_ne_bytes()); // gid
    r.extend_from_slice(&1u32.to_ne_bytes()); // pid
    r.extend_from_slice(&0u32.to_ne_bytes()); // extlen, padding
    r.extend_from_slice(body);
    r
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn arbitrary_requests_are_answered_and_stay_inside(
        reqs in prop::collection::vec((opcode(), prop_oneof![Just(1u64), 0u64..6, any::<u64>()], body()), 1..24),
        setxattr_ext in any::<bool>(),
        by_handle in any::<bool>(),
    ) {
        let top = tempfile::tempdir().unwrap();
        let (src, outside) = (top.path().join("src"), top.path().join("outside"));
        std::fs::create_dir_all(src.join("sub")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(src.join("file"), b"data").unwrap();
        std::fs::write(outside.join("victim"), b"victim").unwrap();
        std::os::unix::fs::symlink("../outside", src.join("up")).unwrap();
        let before = listing(&outside);
        // With a descriptor budget of 2, every node but the root and one more is held by file handle.
        let max_node_fds = if by_handle { 2 } else { DirConfig::default().max_node_fds };
        let fs = Arc::new(DirFs::open(&src, DirConfig { writable: true, max_node_fds, ..DirConfig::default() }).unwrap());
        // SETXATTR in either layout (FUSE_SETXATTR_EXT granted or not).
        fs.set_granted(if setxattr_ext { fuse_abi::FUSE_SETXATTR_EXT } else { 0 });
        let l = Layout::new(MAX_WRITE);
        let eng = Engine::new(&EngineConfig {
            sq_entries: 8,
            buffers: 2,
            buffer_size: l.size,
            ..EngineConfig::default()
        })
        .expect("io_uring available");
        let server = QueueServer::new(fs.clone());
        // Look the names up first, so later requests name real nodes (2, 3, 4).
        let mut all: Vec<(u32, u64, Vec<u8>)> = [&b"sub\0"[..], b"file\0", b"up\0"]
            .iter()
            .map(|n| (Opcode::Lookup as u32, 1, n.to_vec()))
            .collect();
        all.extend(reqs);
        for (op, node, body) in &all {
            let req = request(*op, *node, body);
            let mut buf = eng.take_buffer().unwrap();
            buf.as_mut_slice().fill(0xA5);
            buf.as_mut_slice()[l.request..l.request + req.len()].copy_from_slice(&req);
            let (buf, reply) = eng
                .block_on(server.serve_legacy(&eng, &l, buf, req.len(), false))
                .unwrap();
            match reply {
                LegacyReply::None => {
                    let known = Opcode::from_u32(*op);
                    prop_assert!(
                        matches!(known, Some(Opcode::Forget | Opcode::BatchForget | Opcode::Interrupt)),
                        "opcode {op} went unanswered"
                    );
                }
                LegacyReply::Bytes(n) => {
                    let (h, _) = OutHeader::read_from_prefix(&buf.as_slice()[l.reply..]).unwrap();
                    prop_assert_eq!(h.len as usize, n);
                    prop_assert_eq!(h.unique, 7);
                    prop_assert!((-511..=0).contains(&h.error));
                    prop_assert!(h.error == 0 || n == 16);
                }
                LegacyReply::Splice { .. } => prop_assert!(false, "a directory export never splices"),
            }
        }
        prop_assert_eq!(listing(&outside), before, "nothing outside the source changed");
    }
}
