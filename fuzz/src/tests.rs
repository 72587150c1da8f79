//! The harnesses over their seed inputs, on stable: each seed must pass every check, and the
//! seeds must reach the code they are there to reach.

use crate::seeds;
use crate::serve::{run_legacy, run_uring, Summary};
use zerocopy::IntoBytes;

#[test]
fn decode_seeds_pass() {
    let seeds = seeds::decode();
    assert!(seeds.len() > 20);
    for (name, input) in &seeds {
        crate::decode::run(input);
        assert!(fuse_abi::parse(input).is_ok(), "seed {name} decodes");
        // Every prefix too: truncated requests are refused, never misread.
        for n in 0..input.len() {
            crate::decode::run(&input[..n]);
        }
    }
}

/// Every opcode, its 128-byte argument area zeroed and two names as its payload, framed both
/// ways: the two decodes must agree, which they do only if `fixed_arg_len` knows the opcode's
/// fixed struct (a decoder that reads one the table does not list fails here, not after hours of
/// fuzzing).
#[test]
fn fixed_arg_len_covers_every_opcode() {
    for &op in fuse_abi::Opcode::ALL {
        let header = fuse_abi::InHeader {
            len: 0,
            opcode: op as u32,
            unique: 2,
            nodeid: 1,
            uid: 0,
            gid: 0,
            pid: 1,
            total_extlen: 0,
            padding: 0,
        };
        let mut input = header.as_bytes().to_vec();
        input.extend_from_slice(&[0u8; fuse_abi::FUSE_URING_OP_IN_OUT_SZ]);
        input.extend_from_slice(b"a\0b\0");
        let len = input.len() as u32;
        input[..4].copy_from_slice(&len.to_ne_bytes());
        crate::decode::run(&input);
    }
}

fn check_sessions(run: fn(&[u8]) -> Summary, seeds: &[(String, Vec<u8>)]) {
    for (name, input) in seeds {
        let s = run(input);
        // On /dev/fuse these take no reply.
        let silent = ["forget", "batch-forget", "interrupt"].contains(&name.as_str());
        assert!(s.replies > 0 || silent, "seed {name} got replies");
    }
    let session = |n: &str| {
        let (_, input) = seeds.iter().find(|(name, _)| name == n).expect("seed");
        run(input)
    };
    // opcodes: GETATTR 3, SETATTR 4, OPEN 14, READ 15, WRITE 16, STATFS 17, RELEASE 18, FSYNC 20,
    // FLUSH 25, DESTROY 38, FALLOCATE 43, LSEEK 46.
    let rw = session("session-rw");
    for op in [3, 4, 14, 15, 16, 17, 18, 20, 25, 38, 43, 46] {
        assert!(
            rw.ok(op),
            "writable session: opcode {op} succeeded ({rw:?})"
        );
    }
    let ro = session("session-ro");
    for op in [3, 14, 15, 17, 46] {
        assert!(
            ro.ok(op),
            "read-only session: opcode {op} succeeded ({ro:?})"
        );
    }
    assert!(
        !ro.ok(16) && !ro.ok(43),
        "read-only session refused writes ({ro:?})"
    );
    let grow = session("session-grow");
    assert!(
        grow.ok(4) && grow.ok(43),
        "growable session grew ({grow:?})"
    );
    let (_, truncate) = seeds.iter().find(|(n, _)| n == "truncate").expect("seed");
    assert!(
        !run(truncate).ok(4),
        "a fixed-size export refused to truncate"
    );
    assert!(session("session-pt").ok(14), "passthrough open");
}

#[test]
fn serve_legacy_seeds_pass() {
    check_sessions(run_legacy, &seeds::serve_legacy());
}

#[test]
fn serve_uring_seeds_pass() {
    check_sessions(run_uring, &seeds::serve_uring());
}

#[test]
fn serve_survives_mangled_seeds() {
    // A cheap stand-in for the fuzzer on stable: every seed with one byte flipped at a time
    // (header, arguments, lengths), through both framings.
    for (run, seeds) in [
        (run_legacy as fn(&[u8]) -> Summary, seeds::serve_legacy()),
        (run_uring, seeds::serve_uring()),
    ] {
        for (_, input) in seeds.iter().filter(|(n, _)| !n.starts_with("session")) {
            for i in 0..input.len().min(400) {
                for flip in [0x01u8, 0x80, 0xff] {
                    let mut v = input.clone();
                    v[i] ^= flip;
                    run(&v);
                }
            }
        }
    }
}

#[test]
fn nbd_reply_seeds_pass() {
    let seeds = seeds::nbd_reply();
    let run = |n: &str| {
        let (_, input) = seeds.iter().find(|(name, _)| name == n).expect("seed");
        crate::nbd::run(input)
    };
    assert!(run("handshake").export, "the handshake seed negotiates");
    let tls = run("starttls");
    assert!(
        tls.tls && tls.export,
        "STARTTLS accepted, then negotiated ({tls:?})"
    );
    let refused = run("starttls-refused");
    assert!(!refused.tls && !refused.export);
    assert!(!run("tls-required").export);
    // Every request answered, every READ byte placed.
    let s = run("structured");
    assert_eq!(s.done, 7, "{s:?}");
    assert_eq!(s.placed, 65536 + 131072, "{s:?}");
    let s = run("simple");
    assert_eq!((s.done, s.placed), (4, 4096 + 65536), "{s:?}");
    // Every seed with one byte flipped (and cut short) at a time: never a panic.
    for (_, input) in &seeds {
        for i in 0..input.len().min(600) {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut v = input.clone();
                v[i] ^= flip;
                crate::nbd::run(&v);
            }
            crate::nbd::run(&input[..i]);
        }
    }
}

#[test]
fn qmp_input_seeds_pass() {
    use crate::qmp::run;
    let seeds = seeds::qmp_input();
    let seed = |n: &str| {
        let (_, input) = seeds.iter().find(|(name, _)| name == n).expect("seed");
        input.clone()
    };
    // A negotiated session: qmp_capabilities, echo, typed, query-commands and query-version
    // return, fail errs; whole, byte by byte or in 7-byte pieces alike.
    for name in ["session", "session-bytewise", "session-in-7s"] {
        let s = run(&seed(name));
        assert!(s.command_mode, "{name}: {s:?}");
        assert_eq!((s.returns, s.errors), (5, 1), "{name}: {s:?}");
    }
    let s = run(&seed("before-negotiation"));
    assert!(!s.command_mode && s.returns == 0 && s.errors == 1, "{s:?}");
    // Each malformed request gets its error (the string and the number each one).
    let s = run(&seed("malformed"));
    assert_eq!((s.returns, s.errors), (0, 12), "{s:?}");
    assert!(run(&seed("too-long")).closed);
    for name in ["blockdev", "export", "object", "chardev", "json"] {
        assert!(run(&seed(name)).keyval_ok, "{name}");
    }
    // Every seed with one byte flipped (and cut short) at a time: never a panic.
    for (_, input) in &seeds {
        for i in 0..input.len().min(400) {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut v = input.clone();
                v[i] ^= flip;
                run(&v);
            }
            run(&input[..i]);
        }
    }
}

#[test]
fn qcow2_check_seeds_pass() {
    use crate::qcow2::{run, Verdict};
    let seeds = seeds::qcow2_check();
    assert_eq!(seeds.len(), 28);
    for (name, input) in &seeds {
        let want = if name.ends_with("-clean") {
            Verdict::Clean
        } else {
            Verdict::Damaged
        };
        assert_eq!(run(input), want, "seed {name}");
    }
    // The small seeds with one header or table byte flipped (and cut short): an answer, the same
    // for every window, never a panic.
    for (_, input) in seeds.iter().filter(|(n, _)| n.starts_with("small-")) {
        for i in (0..input.len().min(2048)).step_by(7) {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut v = input.clone();
                v[i] ^= flip;
                run(&v);
            }
        }
        for n in [0, 72, 104, 512, 1024, input.len() / 2] {
            run(&input[..n.min(input.len())]);
        }
    }
}

#[test]
fn image_seeds_open_and_serve() {
    use crate::image::{run, PREFIX};
    let seeds = seeds::image();
    assert_eq!(seeds.len(), 11);
    for (name, input) in &seeds {
        let o = run(input);
        assert!(o.opened, "seed {name} did not open");
        // Eight requests; each write of a writable export is read back.
        let writable = input[0] & 8 != 0;
        let want = if writable { 12 } else { 8 };
        assert_eq!((o.done, o.failed), (want, 0), "seed {name}");
    }
    // The headers and first tables of the seeds up to 3 MiB with a byte flipped, and every seed
    // cut short: refused in one line or served, never a panic or a write that reads back
    // otherwise.
    for (_, input) in &seeds {
        if input.len() <= 3 << 20 {
            for i in (PREFIX..input.len().min(4096)).step_by(13) {
                let mut v = input.clone();
                v[i] ^= 0xff;
                run(&v);
            }
        }
        for n in [1, PREFIX, 513, 4097, input.len() / 2, input.len() - 1] {
            run(&input[..n]);
        }
    }
}

#[test]
fn dir_session_seeds_reach_every_operation() {
    use crate::dir::run;
    use fuse_abi::Opcode as O;
    let seeds = seeds::serve_dir();
    // (FLUSH and ACCESS are answered ENOSYS by design: the kernel stops sending them.)
    let served = [
        O::Lookup,
        O::Getattr,
        O::Open,
        O::Read,
        O::Write,
        O::Fsync,
        O::Lseek,
        O::Fallocate,
        O::Release,
        O::Mkdir,
        O::Create,
        O::Symlink,
        O::Readlink,
        O::Link,
        O::Rename,
        O::Rename2,
        O::Setxattr,
        O::Getxattr,
        O::Listxattr,
        O::Removexattr,
        O::Mknod,
        O::Opendir,
        O::Readdirplus,
        O::Readdir,
        O::Fsyncdir,
        O::Releasedir,
        O::Statfs,
        O::Setattr,
        O::Unlink,
        O::Rmdir,
    ];
    for (name, input) in seeds.iter().filter(|(n, _)| n.starts_with("session-rw")) {
        let s = run(input);
        let missing: Vec<_> = served.iter().filter(|&&o| !s.ok(o as u32)).collect();
        assert!(missing.is_empty(), "{name}: no success for {missing:?}");
    }
    // Read-only: lookups, attributes and listings succeed, nothing that writes does (the
    // session's open for writing included).
    let (_, ro) = seeds.iter().find(|(n, _)| n == "session-ro").unwrap();
    let s = run(ro);
    let reads = [O::Lookup, O::Getattr, O::Opendir, O::Statfs];
    for o in reads {
        assert!(s.ok(o as u32), "read-only: no success for {o:?}");
    }
    let writes = [
        O::Open,
        O::Write,
        O::Mkdir,
        O::Create,
        O::Unlink,
        O::Rename,
        O::Setattr,
    ];
    for o in writes {
        assert!(!s.ok(o as u32), "read-only: {o:?} succeeded");
    }
    // Every seed alone, and the writable session with single bytes flipped: answered, never a
    // panic, nothing outside the source changed.
    for (_, input) in &seeds {
        run(input);
    }
    // A FALLOCATE of a gigabyte fails (the harness caps file sizes at 256 MiB), so no input
    // fills the disk.
    let big = seeds::dir_session()
        .into_iter()
        .take_while(|r| r.name != "fallocate")
        .chain([seeds::Req {
            name: "fallocate-1g",
            opcode: O::Fallocate as u32,
            nodeid: 3,
            args: fuse_abi::FallocateIn {
                length: 1 << 30,
                ..Default::default()
            }
            .as_bytes()
            .to_vec(),
            data: Vec::new(),
        }]);
    let mut input = vec![1u8];
    for (i, r) in big.enumerate() {
        let b = seeds::legacy_bytes(i, &r);
        input.extend_from_slice(&(b.len() as u16).to_le_bytes());
        input.extend_from_slice(&b);
    }
    let s = run(&input);
    assert!(s.ok(O::Open as u32) && !s.ok(O::Fallocate as u32), "{s:?}");
    let (_, rw) = seeds.iter().find(|(n, _)| n == "session-rw").unwrap();
    for i in (1..rw.len()).step_by(11) {
        for flip in [0x01u8, 0x80, 0xff] {
            let mut v = rw.clone();
            v[i] ^= flip;
            run(&v);
        }
    }
}
