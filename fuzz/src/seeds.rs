//! Seed inputs: valid requests with realistic headers, so the fuzzer starts deep in the server
//! instead of discovering the header layout by chance.

use fuse_abi::{
    BatchForgetIn, FallocateIn, FlushIn, ForgetIn, ForgetOne, FsyncIn, GetattrIn, InHeader, InitIn,
    InterruptIn, LseekIn, OpenIn, ReadIn, ReleaseIn, SetattrIn, UringEntInOut, WriteIn,
    FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE, FATTR_MTIME, FATTR_SIZE,
    FUSE_ASYNC_READ, FUSE_BIG_WRITES, FUSE_FSYNC_FDATASYNC, FUSE_INIT_EXT, FUSE_MAX_PAGES,
    FUSE_OVER_IO_URING, FUSE_PASSTHROUGH, KERNEL_MINOR_VERSION, KERNEL_VERSION, SEEK_DATA,
    SEEK_HOLE,
};
use zerocopy::IntoBytes;

use crate::serve::URING_HEADER_AREA;

/// One request: opcode, node, the opcode's fixed argument struct, variable data (name, WRITE
/// data, BATCH_FORGET entries).
#[derive(Clone, Debug)]
pub struct Req {
    /// Short name, for file names.
    pub name: &'static str,
    /// Opcode.
    pub opcode: u32,
    /// Node the request is about.
    pub nodeid: u64,
    /// The fixed argument struct.
    pub args: Vec<u8>,
    /// Bytes after it.
    pub data: Vec<u8>,
}

fn req(name: &'static str, opcode: u32, args: &[u8], data: &[u8]) -> Req {
    Req {
        name,
        opcode,
        nodeid: 1,
        args: args.to_vec(),
        data: data.to_vec(),
    }
}

/// Every request the server handles, as a kernel sends them in a session's order.
pub fn session() -> Vec<Req> {
    let init = InitIn {
        major: KERNEL_VERSION,
        minor: KERNEL_MINOR_VERSION,
        max_readahead: 128 << 10,
        flags: (FUSE_ASYNC_READ | FUSE_BIG_WRITES | FUSE_MAX_PAGES | FUSE_INIT_EXT) as u32,
        flags2: ((FUSE_PASSTHROUGH | FUSE_OVER_IO_URING) >> 32) as u32,
        unused: [0; 11],
    };
    let read = |offset, size| ReadIn {
        offset,
        size,
        flags: libc::O_RDWR as u32,
        ..ReadIn::default()
    };
    let write = |offset, size| WriteIn {
        offset,
        size,
        flags: libc::O_RDWR as u32,
        ..WriteIn::default()
    };
    let falloc = |offset, length, mode| FallocateIn {
        offset,
        length,
        mode,
        ..FallocateIn::default()
    };
    let lseek = |offset, whence| LseekIn {
        offset,
        whence,
        ..LseekIn::default()
    };
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    let mut forgets = Vec::new();
    for n in [1u64, 1] {
        forgets.extend_from_slice(
            ForgetOne {
                nodeid: n,
                nlookup: 1,
            }
            .as_bytes(),
        );
    }
    vec![
        req("init", 26, init.as_bytes(), &[]),
        req("lookup", 1, &[], b"disk.raw\0"),
        req("getattr", 3, GetattrIn::default().as_bytes(), &[]),
        req(
            "open",
            14,
            OpenIn {
                flags: libc::O_RDWR as u32,
                open_flags: 0,
            }
            .as_bytes(),
            &[],
        ),
        req(
            "open-ro",
            14,
            OpenIn {
                flags: libc::O_RDONLY as u32,
                open_flags: 0,
            }
            .as_bytes(),
            &[],
        ),
        req("read", 15, read(0, 4096).as_bytes(), &[]),
        req("write", 16, write(4096, 4096).as_bytes(), &data),
        req(
            "write-unaligned",
            16,
            write(100, 333).as_bytes(),
            &data[..333],
        ),
        req("read-tail", 15, read(12000, 8192).as_bytes(), &[]),
        req("fallocate", 43, falloc(0, 65536, 0).as_bytes(), &[]),
        req(
            "punch-hole",
            43,
            falloc(4096, 4096, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE).as_bytes(),
            &[],
        ),
        req(
            "zero-range",
            43,
            falloc(0, 8192, FALLOC_FL_ZERO_RANGE).as_bytes(),
            &[],
        ),
        req("seek-data", 46, lseek(0, SEEK_DATA).as_bytes(), &[]),
        req("seek-hole", 46, lseek(0, SEEK_HOLE).as_bytes(), &[]),
        req(
            "setattr",
            4,
            SetattrIn {
                valid: FATTR_MTIME,
                mtime: 1_700_000_000,
                ..SetattrIn::default()
            }
            .as_bytes(),
            &[],
        ),
        // Fails on a fixed-size export, grows a growable one.
        req(
            "truncate",
            4,
            SetattrIn {
                valid: FATTR_SIZE,
                size: 20000,
                ..SetattrIn::default()
            }
            .as_bytes(),
            &[],
        ),
        req("statfs", 17, &[], &[]),
        req("flush", 25, FlushIn::default().as_bytes(), &[]),
        req(
            "fsync",
            20,
            FsyncIn {
                fsync_flags: FUSE_FSYNC_FDATASYNC,
                ..FsyncIn::default()
            }
            .as_bytes(),
            &[],
        ),
        req(
            "release",
            18,
            ReleaseIn {
                flags: libc::O_RDWR as u32,
                ..ReleaseIn::default()
            }
            .as_bytes(),
            &[],
        ),
        req("interrupt", 36, InterruptIn { unique: 2 }.as_bytes(), &[]),
        req("forget", 2, ForgetIn { nlookup: 1 }.as_bytes(), &[]),
        req(
            "batch-forget",
            42,
            BatchForgetIn { count: 2, dummy: 0 }.as_bytes(),
            &forgets,
        ),
        req("mkdir-unsupported", 9, &[0u8; 8], b"d\0"),
        req("destroy", 38, &[], &[]),
    ]
}

/// The header a kernel would put in front of request number `i` of a session.
pub fn header(i: usize, r: &Req) -> InHeader {
    InHeader {
        len: (40 + r.args.len() + r.data.len()) as u32,
        opcode: r.opcode,
        // The kernel hands out even ids (the low bit marks interrupts).
        unique: 2 * (i as u64 + 1),
        nodeid: r.nodeid,
        uid: 1000,
        gid: 1000,
        pid: 4242,
        total_extlen: 0,
        padding: 0,
    }
}

/// The request as `read(2)` of `/dev/fuse` returns it.
pub fn legacy_bytes(i: usize, r: &Req) -> Vec<u8> {
    let mut v = header(i, r).as_bytes().to_vec();
    v.extend_from_slice(&r.args);
    v.extend_from_slice(&r.data);
    v
}

/// The request as an io_uring entry holds it: the 288-byte header area, then the payload.
pub fn uring_bytes(i: usize, r: &Req) -> Vec<u8> {
    let mut area = [0u8; URING_HEADER_AREA];
    area[..40].copy_from_slice(header(i, r).as_bytes());
    area[128..128 + r.args.len()].copy_from_slice(&r.args);
    let ent = UringEntInOut {
        commit_id: header(i, r).unique,
        payload_sz: r.data.len() as u32,
        ..UringEntInOut::default()
    };
    area[256..].copy_from_slice(ent.as_bytes());
    let mut v = area.to_vec();
    v.extend_from_slice(&r.data);
    v
}

/// A serve input: the setup byte, then each request as a length-prefixed record.
fn serve_input(setup: u8, recs: impl Iterator<Item = Vec<u8>>) -> Vec<u8> {
    let mut v = vec![setup];
    for r in recs {
        v.extend_from_slice(&(r.len() as u16).to_le_bytes());
        v.extend_from_slice(&r);
    }
    v
}

/// Setup bytes of the seed inputs (see `Setup::from_byte`): read-only, writable, writable and
/// growable with writethrough, writable with passthrough for all opens, on a 12345-byte image.
pub const SETUPS: [(&str, u8); 4] = [
    ("ro", 0b1000_0000),
    ("rw", 0b1000_0001),
    ("grow", 0b1000_0111),
    ("pt", 0b1011_0001),
];

/// Named seed inputs of one target.
pub type Seeds = Vec<(String, Vec<u8>)>;

/// Seeds of the `decode` target: each request of the image and the directory sessions in
/// `/dev/fuse` framing.
pub fn decode() -> Seeds {
    let image = session().into_iter().map(|r| (String::new(), r));
    let dir = dir_session().into_iter().map(|r| ("dir-".to_string(), r));
    image
        .chain(dir)
        .enumerate()
        .map(|(i, (prefix, r))| (format!("{prefix}{}", r.name), legacy_bytes(i, &r)))
        .collect()
}

fn serve(bytes: fn(usize, &Req) -> Vec<u8>) -> Seeds {
    let s = session();
    let mut out = Vec::new();
    for (setup_name, setup) in SETUPS {
        // The whole session, after INIT (which the transport handles before the server).
        let recs = s.iter().enumerate().skip(1).map(|(i, r)| bytes(i, r));
        out.push((format!("session-{setup_name}"), serve_input(setup, recs)));
    }
    for (i, r) in s.iter().enumerate() {
        out.push((
            r.name.to_string(),
            serve_input(SETUPS[1].1, [bytes(i, r)].into_iter()),
        ));
    }
    out
}

/// Seeds of the `serve_legacy` target.
pub fn serve_legacy() -> Seeds {
    serve(legacy_bytes)
}

/// Seeds of the `serve_uring` target.
pub fn serve_uring() -> Seeds {
    serve(uring_bytes)
}

/// Seeds per target name.
pub fn all() -> Vec<(&'static str, Seeds)> {
    vec![
        ("decode", decode()),
        ("serve_legacy", serve_legacy()),
        ("serve_uring", serve_uring()),
        ("nbd_reply", nbd_reply()),
        ("qcow2_check", qcow2_check()),
        ("image", image()),
        ("serve_dir", serve_dir()),
        ("qmp_input", qmp_input()),
    ]
}

/// A session against the directory export's scratch tree (see `crate::dir`): nodes 2 (`sub`)
/// and 3 (`file`) looked up, a file opened (handle 0), read, written, synced and released, a
/// directory (node 4) and a file in it created (node 5, handle 1), a symlink (6), a link, two
/// renames, xattrs, a fifo (7), the root listed (handle 2), attributes set, entries removed,
/// `up` looked up and looked through, forgets.
pub fn dir_session() -> Vec<Req> {
    use fuse_abi::{
        CreateIn, GetxattrIn, LinkIn, MkdirIn, MknodIn, Opcode as O, Rename2In, RenameIn,
        SetxattrIn, FATTR_MODE,
    };
    let at = |mut r: Req, nodeid: u64| {
        r.nodeid = nodeid;
        r
    };
    let op = |o: O| o as u32;
    let fh_read = |fh, size| ReadIn {
        fh,
        offset: 0,
        size,
        flags: libc::O_RDWR as u32,
        ..ReadIn::default()
    };
    let write = |fh, offset, size| WriteIn {
        fh,
        offset,
        size,
        ..WriteIn::default()
    };
    let open = |flags: i32| OpenIn {
        flags: flags as u32,
        open_flags: 0,
    };
    let mut forgets = BatchForgetIn {
        count: 1,
        ..BatchForgetIn::default()
    }
    .as_bytes()
    .to_vec();
    forgets.extend_from_slice(
        ForgetOne {
            nodeid: 2,
            nlookup: 1,
        }
        .as_bytes(),
    );
    let setattr = SetattrIn {
        valid: FATTR_SIZE | FATTR_MODE,
        size: 2,
        mode: 0o600,
        ..SetattrIn::default()
    };
    let setxattr = SetxattrIn {
        size: 3,
        ..SetxattrIn::default()
    };
    vec![
        req("lookup-sub", op(O::Lookup), &[], b"sub\0"),
        req("lookup-file", op(O::Lookup), &[], b"file\0"),
        at(
            req(
                "getattr",
                op(O::Getattr),
                GetattrIn::default().as_bytes(),
                &[],
            ),
            3,
        ),
        at(
            req("open", op(O::Open), open(libc::O_RDWR).as_bytes(), &[]),
            3,
        ),
        at(
            req("read", op(O::Read), fh_read(0, 4096).as_bytes(), &[]),
            3,
        ),
        at(
            req("write", op(O::Write), write(0, 2, 5).as_bytes(), b"hello"),
            3,
        ),
        at(
            req("fsync", op(O::Fsync), FsyncIn::default().as_bytes(), &[]),
            3,
        ),
        at(
            req("flush", op(O::Flush), FlushIn::default().as_bytes(), &[]),
            3,
        ),
        at(
            req(
                "lseek",
                op(O::Lseek),
                LseekIn {
                    whence: SEEK_DATA,
                    ..LseekIn::default()
                }
                .as_bytes(),
                &[],
            ),
            3,
        ),
        at(
            req(
                "fallocate",
                op(O::Fallocate),
                FallocateIn {
                    length: 8192,
                    ..FallocateIn::default()
                }
                .as_bytes(),
                &[],
            ),
            3,
        ),
        at(
            req(
                "release",
                op(O::Release),
                ReleaseIn::default().as_bytes(),
                &[],
            ),
            3,
        ),
        req(
            "mkdir",
            op(O::Mkdir),
            MkdirIn {
                mode: 0o755,
                umask: 0o022,
            }
            .as_bytes(),
            b"d\0",
        ),
        at(
            req(
                "create",
                op(O::Create),
                CreateIn {
                    flags: (libc::O_RDWR | libc::O_CREAT) as u32,
                    mode: libc::S_IFREG | 0o644,
                    umask: 0o022,
                    open_flags: 0,
                }
                .as_bytes(),
                b"f\0",
            ),
            4,
        ),
        at(
            req(
                "write-new",
                op(O::Write),
                write(1, 0, 8).as_bytes(),
                b"new data",
            ),
            5,
        ),
        at(
            req(
                "release-new",
                op(O::Release),
                ReleaseIn {
                    fh: 1,
                    ..ReleaseIn::default()
                }
                .as_bytes(),
                &[],
            ),
            5,
        ),
        req("symlink", op(O::Symlink), &[], b"s\0file\0"),
        at(req("readlink", op(O::Readlink), &[], &[]), 6),
        at(
            req(
                "link",
                op(O::Link),
                LinkIn { oldnodeid: 3 }.as_bytes(),
                b"h\0",
            ),
            4,
        ),
        req(
            "rename",
            op(O::Rename),
            RenameIn { newdir: 4 }.as_bytes(),
            b"file\0g\0",
        ),
        at(
            req(
                "rename2",
                op(O::Rename2),
                Rename2In {
                    newdir: 1,
                    flags: fuse_abi::RENAME_NOREPLACE,
                    padding: 0,
                }
                .as_bytes(),
                b"g\0file\0",
            ),
            4,
        ),
        // Without FUSE_SETXATTR_EXT the head is its first 8 bytes.
        at(
            req(
                "setxattr",
                op(O::Setxattr),
                &setxattr.as_bytes()[..8],
                b"user.x\0abc",
            ),
            3,
        ),
        at(
            req(
                "getxattr",
                op(O::Getxattr),
                GetxattrIn {
                    size: 64,
                    padding: 0,
                }
                .as_bytes(),
                b"user.x\0",
            ),
            3,
        ),
        at(
            req(
                "listxattr",
                op(O::Listxattr),
                GetxattrIn {
                    size: 256,
                    padding: 0,
                }
                .as_bytes(),
                &[],
            ),
            3,
        ),
        at(req("removexattr", op(O::Removexattr), &[], b"user.x\0"), 3),
        req(
            "mknod",
            op(O::Mknod),
            MknodIn {
                mode: libc::S_IFIFO | 0o644,
                rdev: 0,
                umask: 0o022,
                padding: 0,
            }
            .as_bytes(),
            b"p\0",
        ),
        req(
            "opendir",
            op(O::Opendir),
            open(libc::O_RDONLY | libc::O_DIRECTORY).as_bytes(),
            &[],
        ),
        req(
            "readdirplus",
            op(O::Readdirplus),
            fh_read(2, 4096).as_bytes(),
            &[],
        ),
        req("readdir", op(O::Readdir), fh_read(2, 4096).as_bytes(), &[]),
        req(
            "fsyncdir",
            op(O::Fsyncdir),
            FsyncIn {
                fh: 2,
                ..FsyncIn::default()
            }
            .as_bytes(),
            &[],
        ),
        req(
            "releasedir",
            op(O::Releasedir),
            ReleaseIn {
                fh: 2,
                ..ReleaseIn::default()
            }
            .as_bytes(),
            &[],
        ),
        req("statfs", op(O::Statfs), &[], &[]),
        at(
            req("access", op(O::Access), &[4, 0, 0, 0, 0, 0, 0, 0], &[]),
            3,
        ),
        at(req("setattr", op(O::Setattr), setattr.as_bytes(), &[]), 3),
        at(req("unlink", op(O::Unlink), &[], b"h\0"), 4),
        req("unlink-symlink", op(O::Unlink), &[], b"s\0"),
        req("rmdir", op(O::Rmdir), &[], b"sub\0"),
        req("lookup-up", op(O::Lookup), &[], b"up\0"),
        at(req("lookup-through-up", op(O::Lookup), &[], b"victim\0"), 8),
        at(
            req(
                "forget",
                op(O::Forget),
                ForgetIn { nlookup: 1 }.as_bytes(),
                &[],
            ),
            3,
        ),
        at(req("batch-forget", op(O::BatchForget), &forgets, &[]), 0),
    ]
}

/// Seeds of the `serve_dir` target: the whole directory session on a writable export, with
/// nodes held by descriptor and by file handle, with metadata inline and on the ring, and on a
/// read-only export; and each request alone.
pub fn serve_dir() -> Seeds {
    let s = dir_session();
    let mut out = Vec::new();
    for (name, setup) in [
        ("rw", 0b0001u8),
        ("rw-handles", 0b0011),
        ("rw-ring", 0b1001),
        ("ro", 0),
    ] {
        let recs = s.iter().enumerate().map(|(i, r)| legacy_bytes(i, r));
        out.push((format!("session-{name}"), serve_input(setup, recs)));
    }
    for (i, r) in s.iter().enumerate() {
        out.push((
            r.name.to_string(),
            serve_input(1, [legacy_bytes(i, r)].into_iter()),
        ));
    }
    out
}

/// Seeds of the `image` target: 2 MiB of data with a few written ranges, converted by
/// `qemu-img` into each format's subformats the harness can open from one file (and qcow2,
/// probed), and MBR and GPT disks (made by `sfdisk`) of two partitions; each behind the setup
/// byte that opens it (writable unless the subformat is read-only, under its format's name, or
/// probed).
pub fn image() -> Seeds {
    let dir = tempfile::tempdir().expect("tempdir");
    let raw = dir.path().join("data.raw");
    let mut data = vec![0u8; 2 << 20];
    for (at, len) in [
        (0usize, 4096usize),
        (65536 + 100, 5000),
        ((1 << 20) + 4096, 512),
    ] {
        for (i, b) in data[at..at + len].iter_mut().enumerate() {
            *b = (i % 251) as u8 + 1;
        }
    }
    std::fs::write(&raw, &data).unwrap();
    let convert = |fmt: &str, opts: &str, out: &std::path::Path| {
        let mut c = std::process::Command::new("qemu-img");
        c.args(["convert", "-q", "-f", "raw", "-O", fmt]);
        if !opts.is_empty() {
            c.args(["-o", opts]);
        }
        let st = c
            .arg(&raw)
            .arg(out)
            .status()
            .unwrap_or_else(|e| panic!("qemu-img: {e} (run `make deps`)"));
        assert!(st.success(), "qemu-img convert -O {fmt} -o {opts:?}");
    };
    // The setup byte: format in the low 3 bits (0 VHD, 1 VDI, 2 VHDX, 3 VMDK, 4 probed), 8
    // writable, 16 a partition (number from the top 3 bits, plus one). Then where the eight
    // requests go (see `image::place`): the start, the end, sector boundaries and sector middles.
    const PICKS: [u8; 8] = [
        0x00,
        0x40,
        0x80 | 17,
        0xc0 | 40,
        0x80 | 63,
        0xc0 | 1,
        0x80,
        0xc0 | 31,
    ];
    let mut seeds = Vec::new();
    for (name, fmt, opts, setup) in [
        ("vhd-dynamic", "vpc", "subformat=dynamic", 8u8),
        ("vhd-fixed", "vpc", "subformat=fixed", 8),
        ("vdi-dynamic", "vdi", "", 1 | 8),
        ("vdi-static", "vdi", "static=on", 1 | 8),
        ("vhdx-dynamic", "vhdx", "subformat=dynamic", 2 | 8),
        ("vhdx-fixed", "vhdx", "subformat=fixed", 2 | 8),
        ("vmdk-sparse", "vmdk", "subformat=monolithicSparse", 3 | 8),
        ("vmdk-stream", "vmdk", "subformat=streamOptimized", 3),
        // Probed: qcow2's magic makes it a qcow2 export (imago over the ring).
        ("qcow2", "qcow2", "cluster_size=4096", 4 | 8),
    ] {
        let p = dir.path().join(name);
        convert(fmt, opts, &p);
        let mut input = vec![setup];
        input.extend(PICKS);
        input.extend(std::fs::read(&p).unwrap());
        seeds.push((name.to_string(), input));
    }
    // MBR and GPT disks of two partitions, probed (raw) and served as partition 1 and 2.
    for (label, number) in [("dos", 1u8), ("gpt", 2)] {
        let disk = dir.path().join(format!("{label}.raw"));
        std::fs::write(&disk, vec![0u8; 2 << 20]).unwrap();
        let mut sfdisk = std::process::Command::new("sfdisk")
            .args(["-q", "--label", label])
            .arg(&disk)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("sfdisk: {e} (run `make deps`)"));
        use std::io::Write;
        sfdisk
            .stdin
            .take()
            .unwrap()
            .write_all(b"start=2048, size=1024\nstart=3072, size=512\n")
            .unwrap();
        assert!(sfdisk.wait().unwrap().success(), "sfdisk --label {label}");
        let mut input = vec![4 | 8 | 16 | ((number - 1) << 5)];
        input.extend(PICKS);
        input.extend(std::fs::read(&disk).unwrap());
        seeds.push((format!("{label}-partition-{number}"), input));
    }
    seeds
}

/// Seeds of the `qmp_input` target (see `crate::qmp::run` for the setup byte): a negotiated
/// session running every command with and without an id, a request before negotiation,
/// malformed requests of every kind, a session cut into one-byte and 7-byte pieces, a request
/// over the limit (in 61-byte pieces, as a socket delivers a long one), and the `key=value`
/// options of each implied key (`--blockdev`, `--export`, `--object`, `--chardev`) and of JSON.
pub fn qmp_input() -> Seeds {
    let session = concat!(
        r#"{"execute": "qmp_capabilities"}"#,
        r#"{"execute": "echo", "arguments": {"a": 1, "b": [true, null]}, "id": 7}"#,
        r#"{"execute": "typed", "arguments": {"id": "x", "mode": "safe", "size": 4096,"#,
        r#" "file": {"driver": "file", "filename": "/a"}, "list": ["a", "b"]}}"#,
        r#"{"execute": "query-commands"}{"execute": "query-version", "id": "v"}"#,
        r#"{"execute": "fail"}"#,
    );
    let malformed = concat!(
        r#"{"execute": "echo", "execute": "fail"}"#,
        r#"[1, 2]"#,
        r#"{"execute": 3}"#,
        r#"{"arguments": {}}"#,
        r#"{"execute": "echo", "arguments": [1]}"#,
        r#"{"execute": "typed", "arguments": {"id": 1}}"#,
        r#"{"execute": "typed", "arguments": {"id": "x", "mode": "bogus"}}"#,
        r#"{"execute": "typed", "arguments": {"id": "x", "file": {"driver": "f", "x": 1}}}"#,
        r#"{"execute": "nope"}"#,
        r#"{"execute": "echo", "bogus": 1}"#,
        r#""text" 12 }"#,
    );
    let too_long = format!(
        r#"{{"execute": "echo", "arguments": {{"s": "{}"}}}}"#,
        "a".repeat(crate::qmp::MAX_REQUEST + 10)
    );
    let with = |setup: u8, text: &str| {
        let mut v = vec![setup];
        v.extend_from_slice(text.as_bytes());
        v
    };
    vec![
        ("session".into(), with(0, session)),
        (
            "before-negotiation".into(),
            with(0, r#"{"execute": "echo", "arguments": {}}"#),
        ),
        ("malformed".into(), with(8, malformed)),
        ("session-bytewise".into(), with(2, session)),
        ("session-in-7s".into(), with(4, session)),
        ("too-long".into(), with(14, &too_long)),
        (
            "blockdev".into(),
            with(
                1,
                "driver=qcow2,node-name=disk,file.driver=file,file.filename=a,,b.qcow2,\
                 size=1G,writable=on,n=-0x10,u=7,l.0=1,l.1=0x10,x.b=off",
            ),
        ),
        (
            "export".into(),
            with(
                3,
                "fuse,id=e,node-name=n,mountpoint=/m,writable=on,iothread.0=io0,iothread.1=io1",
            ),
        ),
        (
            "object".into(),
            with(5, "iothread,id=io0,poll-max-ns=32768"),
        ),
        (
            "chardev".into(),
            with(7, "socket,id=m,path=/run/q.sock,server=on,wait=off"),
        ),
        (
            "json".into(),
            with(
                1,
                r#"{"driver": "file", "filename": "x", "cache": {"direct": true}, "size": 1.5}"#,
            ),
        ),
    ]
}

/// Seeds of the `qcow2_check` target: the damaged-image corpus (`backend::qcow2::damage`), each
/// kind of damage planted into the 64 KiB-cluster base image and into a small 512-byte-cluster
/// one, and both healthy bases.
pub fn qcow2_check() -> Seeds {
    use backend::qcow2::damage::{BaseRecipe, Damage, BASE_RECIPE, SMALL_RECIPE};
    let dir = tempfile::tempdir().expect("tempdir");
    let mut seeds = Vec::new();
    let recipes: [(&str, BaseRecipe); 2] = [("small", SMALL_RECIPE), ("base", BASE_RECIPE)];
    for (tag, r) in recipes {
        let clean = dir.path().join(format!("{tag}.qcow2"));
        r.make(&clean, "")
            .unwrap_or_else(|e| panic!("{e} (qemu-img and qemu-io: run `make deps`)"));
        seeds.push((format!("{tag}-clean"), std::fs::read(&clean).unwrap()));
        for d in Damage::ALL {
            let p = dir.path().join(format!("{tag}-{}.qcow2", d.name()));
            std::fs::copy(&clean, &p).unwrap();
            d.plant(&p).unwrap();
            seeds.push((format!("{tag}-{}", d.name()), std::fs::read(&p).unwrap()));
        }
    }
    seeds
}

/// NBD protocol constants for the seeds (the protocol's `doc/proto.md`).
mod nbdp {
    pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
    pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
    pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
    pub const SIMPLE_MAGIC: u32 = 0x6744_6698;
    pub const STRUCTURED_MAGIC: u32 = 0x668e_33ef;
    pub const OPT_STARTTLS: u32 = 5;
    pub const OPT_GO: u32 = 7;
    pub const OPT_STRUCTURED_REPLY: u32 = 8;
    pub const OPT_SET_META_CONTEXT: u32 = 10;
    pub const REP_ACK: u32 = 1;
    pub const REP_INFO: u32 = 3;
    pub const REP_META_CONTEXT: u32 = 4;
    pub const REP_ERR_POLICY: u32 = (1 << 31) + 2;
    pub const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;
}

fn opt_reply(out: &mut Vec<u8>, opt: u32, ty: u32, data: &[u8]) {
    out.extend_from_slice(&nbdp::OPT_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&opt.to_be_bytes());
    out.extend_from_slice(&ty.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// The phase byte of [`crate::nbd::run`], then the server's greeting (fixed newstyle, no zeroes).
fn greeting(mode: u8) -> Vec<u8> {
    let mut v = vec![mode];
    v.extend_from_slice(&nbdp::NBDMAGIC.to_be_bytes());
    v.extend_from_slice(&nbdp::IHAVEOPT.to_be_bytes());
    v.extend_from_slice(&3u16.to_be_bytes());
    v
}

/// A server's answers to fusex's options: structured replies, `base:allocation`, then GO with
/// the export's size and flags and its block sizes.
fn negotiation(out: &mut Vec<u8>) {
    opt_reply(out, nbdp::OPT_STRUCTURED_REPLY, nbdp::REP_ACK, &[]);
    let mut ctx = crate::nbd::CONTEXT.to_be_bytes().to_vec();
    ctx.extend_from_slice(b"base:allocation");
    opt_reply(
        out,
        nbdp::OPT_SET_META_CONTEXT,
        nbdp::REP_META_CONTEXT,
        &ctx,
    );
    opt_reply(out, nbdp::OPT_SET_META_CONTEXT, nbdp::REP_ACK, &[]);
    let mut info = 0u16.to_be_bytes().to_vec();
    info.extend_from_slice(&(64u64 << 20).to_be_bytes());
    info.extend_from_slice(&0x1edu16.to_be_bytes());
    opt_reply(out, nbdp::OPT_GO, nbdp::REP_INFO, &info);
    let mut bs = 3u16.to_be_bytes().to_vec();
    for v in [512u32, 4096, 1 << 20] {
        bs.extend_from_slice(&v.to_be_bytes());
    }
    opt_reply(out, nbdp::OPT_GO, nbdp::REP_INFO, &bs);
    opt_reply(out, nbdp::OPT_GO, nbdp::REP_ACK, &[]);
}

fn simple(out: &mut Vec<u8>, error: u32, cookie: u64) {
    out.extend_from_slice(&nbdp::SIMPLE_MAGIC.to_be_bytes());
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
}

fn structured(out: &mut Vec<u8>, flags: u16, ty: u16, cookie: u64, payload: &[u8]) {
    out.extend_from_slice(&nbdp::STRUCTURED_MAGIC.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&ty.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
}

/// Seeds of the `nbd_reply` target: handshakes (plain, with STARTTLS accepted and refused, a
/// server requiring TLS) and transmission-phase streams answering every request of
/// [`crate::nbd::REQUESTS`] with simple replies and every chunk type.
pub fn nbd_reply() -> Seeds {
    let mut seeds = Vec::new();
    let mut hs = greeting(0);
    negotiation(&mut hs);
    seeds.push(("handshake".to_string(), hs));

    let mut tls = greeting(1);
    opt_reply(&mut tls, nbdp::OPT_STARTTLS, nbdp::REP_ACK, &[]);
    negotiation(&mut tls);
    seeds.push(("starttls".to_string(), tls));

    let mut refused = greeting(1);
    opt_reply(
        &mut refused,
        nbdp::OPT_STARTTLS,
        nbdp::REP_ERR_POLICY,
        b"no TLS here",
    );
    seeds.push(("starttls-refused".to_string(), refused));

    let mut reqd = greeting(0);
    opt_reply(
        &mut reqd,
        nbdp::OPT_STRUCTURED_REPLY,
        nbdp::REP_ERR_TLS_REQD,
        &[],
    );
    seeds.push(("tls-required".to_string(), reqd));

    // Structured replies to every request.
    let r = crate::nbd::REQUESTS;
    let mut t = vec![2u8];
    // READ 0: data, hole, data (out of order), then NONE with DONE.
    let mut d = r[0].2.to_be_bytes().to_vec();
    d.extend_from_slice(&[0xab; 16384]);
    structured(&mut t, 0, 1, r[0].0, &d);
    let mut h = (r[0].2 + 49152).to_be_bytes().to_vec();
    h.extend_from_slice(&16384u32.to_be_bytes());
    structured(&mut t, 0, 2, r[0].0, &h);
    let mut d = (r[0].2 + 16384).to_be_bytes().to_vec();
    d.extend_from_slice(&[0xcd; 32768]);
    structured(&mut t, 0, 1, r[0].0, &d);
    structured(&mut t, 1, 0, r[0].0, &[]);
    // READ 1: an error chunk, then NONE with DONE.
    let mut e = 5u32.to_be_bytes().to_vec();
    e.extend_from_slice(&(3u16).to_be_bytes());
    e.extend_from_slice(b"bad");
    structured(&mut t, 0, 0x8001, r[1].0, &e);
    structured(&mut t, 1, 0, r[1].0, &[]);
    // WRITE, FLUSH, WRITE_ZEROES: NONE with DONE.
    for i in [3, 4, 6] {
        structured(&mut t, 1, 0, r[i].0, &[]);
    }
    // BLOCK_STATUS: two extents of the context, DONE.
    let mut b = crate::nbd::CONTEXT.to_be_bytes().to_vec();
    for (len, fl) in [(65536u32, 3u32), (1 << 19, 0)] {
        b.extend_from_slice(&len.to_be_bytes());
        b.extend_from_slice(&fl.to_be_bytes());
    }
    structured(&mut t, 1, 5, r[5].0, &b);
    // READ 2: data covering it all in one chunk, DONE.
    let mut d = r[2].2.to_be_bytes().to_vec();
    d.extend_from_slice(&[0x5a; 131072]);
    structured(&mut t, 1, 1, r[2].0, &d);
    seeds.push(("structured".to_string(), t));

    // Simple replies (a server without structured replies): READ data follows the head.
    let mut t = vec![2u8];
    simple(&mut t, 0, r[1].0);
    t.extend_from_slice(&[0x11; 4096]);
    simple(&mut t, 0, r[3].0);
    simple(&mut t, 28, r[4].0);
    simple(&mut t, 0, r[0].0);
    t.extend_from_slice(&[0x22; 65536]);
    seeds.push(("simple".to_string(), t));
    seeds
}
