//! Request decoding tests. Requests are built byte by byte (not through the
//! crate's structs) so the tests check the layouts independently.

use super::*;
use crate::flags::*;
use proptest::prelude::*;

const UNIQUE: u64 = 0x0102_0304_0506_0708;
const NODE: u64 = 1;

/// Little byte builder for hand-encoded requests.
#[derive(Default, Clone)]
struct B(Vec<u8>);

impl B {
    fn u16(mut self, v: u16) -> Self {
        self.0.extend_from_slice(&v.to_ne_bytes());
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_ne_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_ne_bytes());
        self
    }
    fn bytes(mut self, v: &[u8]) -> Self {
        self.0.extend_from_slice(v);
        self
    }
    fn zeros(mut self, n: usize) -> Self {
        self.0.resize(self.0.len() + n, 0);
        self
    }
}

fn header(len: usize, opcode: u32, extlen: u16) -> B {
    B::default()
        .u32(len as u32)
        .u32(opcode)
        .u64(UNIQUE)
        .u64(NODE)
        .u32(1000) // uid
        .u32(100) // gid
        .u32(4242) // pid
        .u16(extlen)
        .u16(0)
}

/// A complete request: header with correct `len`, then `body`.
fn request(opcode: Opcode, body: &[u8]) -> Vec<u8> {
    request_ext(opcode as u32, body, 0)
}

fn request_ext(opcode: u32, body: &[u8], extlen: u16) -> Vec<u8> {
    header(40 + body.len(), opcode, extlen).bytes(body).0
}

fn op(buf: &[u8]) -> Operation<'_> {
    parse(buf).expect("valid request").op
}

// ------------------------------------------------------------- bodies

fn init_body() -> Vec<u8> {
    B::default()
        .u32(7)
        .u32(45)
        .u32(131072)
        .u32((FUSE_ASYNC_READ | FUSE_INIT_EXT) as u32)
        .u32(1 << 9)
        .zeros(44)
        .0
}

fn read_body() -> Vec<u8> {
    B::default()
        .u64(11) // fh
        .u64(1 << 40) // offset
        .u32(65536) // size
        .u32(FUSE_READ_LOCKOWNER)
        .u64(99) // lock_owner
        .u32(2) // flags (O_RDWR)
        .u32(0)
        .0
}

fn write_body(data: &[u8]) -> Vec<u8> {
    B::default()
        .u64(12)
        .u64(4096)
        .u32(data.len() as u32)
        .u32(FUSE_WRITE_CACHE)
        .u64(98)
        .u32(1)
        .u32(0)
        .bytes(data)
        .0
}

fn setattr_body() -> Vec<u8> {
    B::default()
        .u32(FATTR_SIZE | FATTR_MTIME)
        .u32(0)
        .u64(3) // fh
        .u64(1 << 30) // size
        .u64(4) // lock_owner
        .u64(5) // atime
        .u64(6) // mtime
        .u64(7) // ctime
        .u32(8) // atimensec
        .u32(9) // mtimensec
        .u32(10) // ctimensec
        .u32(0o100644) // mode
        .u32(0)
        .u32(1001) // uid
        .u32(1002) // gid
        .u32(0)
        .0
}

/// One valid request for every opcode the decoder types, for the sweeps.
fn samples() -> Vec<(Opcode, Vec<u8>)> {
    vec![
        (Opcode::Init, init_body()),
        (Opcode::Destroy, vec![]),
        (Opcode::Lookup, b"disk.img\0".to_vec()),
        (Opcode::Forget, B::default().u64(3).0),
        (
            Opcode::BatchForget,
            B::default().u32(2).u32(0).u64(1).u64(1).u64(2).u64(5).0,
        ),
        (
            Opcode::Getattr,
            B::default().u32(FUSE_GETATTR_FH).u32(0).u64(77).0,
        ),
        (Opcode::Setattr, setattr_body()),
        (
            Opcode::Open,
            B::default().u32(2).u32(FUSE_OPEN_KILL_SUIDGID).0,
        ),
        (
            Opcode::Release,
            B::default().u64(5).u32(2).u32(FUSE_RELEASE_FLUSH).u64(6).0,
        ),
        (Opcode::Read, read_body()),
        (Opcode::Write, write_body(b"hello")),
        (Opcode::Flush, B::default().u64(5).u32(0).u32(0).u64(8).0),
        (
            Opcode::Fsync,
            B::default().u64(5).u32(FUSE_FSYNC_FDATASYNC).u32(0).0,
        ),
        (
            Opcode::Fallocate,
            B::default()
                .u64(5)
                .u64(4096)
                .u64(8192)
                .u32(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)
                .u32(0)
                .0,
        ),
        (
            Opcode::Lseek,
            B::default().u64(5).u64(123).u32(SEEK_HOLE).u32(0).0,
        ),
        (Opcode::Statfs, vec![]),
        (Opcode::Interrupt, B::default().u64(UNIQUE - 2).0),
        (Opcode::Readlink, vec![]),
        (Opcode::Symlink, b"link\0/etc/passwd\0".to_vec()),
        (
            Opcode::Mknod,
            B::default()
                .u32(0o10644)
                .u32(0)
                .u32(0o22)
                .u32(0)
                .bytes(b"fifo\0")
                .0,
        ),
        (
            Opcode::Mkdir,
            B::default().u32(0o755).u32(0o22).bytes(b"dir\0").0,
        ),
        (Opcode::Unlink, b"gone\0".to_vec()),
        (Opcode::Rmdir, b"dir\0".to_vec()),
        (Opcode::Rename, B::default().u64(9).bytes(b"a\0bb\0").0),
        (
            Opcode::Rename2,
            B::default().u64(9).u32(1).u32(0).bytes(b"a\0bb\0").0,
        ),
        (Opcode::Link, B::default().u64(12).bytes(b"hard\0").0),
        (
            Opcode::Create,
            B::default()
                .u32(0o101)
                .u32(0o100600)
                .u32(0o77)
                .u32(0)
                .bytes(b"new\0")
                .0,
        ),
        (Opcode::Opendir, B::default().u32(0).u32(0).0),
        (
            Opcode::Tmpfile,
            B::default()
                .u32(0o2)
                .u32(0o100600)
                .u32(0o22)
                .u32(0)
                .bytes(b"/\0")
                .0,
        ),
        (Opcode::Readdir, read_body()),
        (Opcode::Readdirplus, read_body()),
        (
            Opcode::Releasedir,
            B::default().u64(5).u32(0).u32(0).u64(0).0,
        ),
        (Opcode::Fsyncdir, B::default().u64(5).u32(0).u32(0).0),
        (
            Opcode::Setxattr,
            B::default().u32(3).u32(1).bytes(b"user.x\0abc").0,
        ),
        (
            Opcode::Getxattr,
            B::default().u32(64).u32(0).bytes(b"user.x\0").0,
        ),
        (Opcode::Listxattr, B::default().u32(0).u32(0).0),
        (Opcode::Removexattr, b"user.x\0".to_vec()),
        (Opcode::Access, B::default().u32(4).u32(0).0),
        (
            Opcode::Statx,
            B::default().u32(0).u32(0).u64(0).u32(0).u32(0x800).0,
        ),
        (Opcode::CopyFileRange, B::default().zeros(56).0),
        (Opcode::CopyFileRange64, B::default().zeros(56).0),
    ]
}

#[test]
fn directory_operations() {
    let ops: Vec<(Opcode, Vec<u8>)> = samples();
    let get = |code: Opcode| {
        let body = &ops.iter().find(|(o, _)| *o == code).unwrap().1;
        request(code, body)
    };
    assert_eq!(op(&get(Opcode::Readlink)), Operation::Readlink);
    assert_eq!(
        op(&get(Opcode::Symlink)),
        Operation::Symlink {
            name: b"link",
            target: b"/etc/passwd"
        }
    );
    let req = get(Opcode::Mknod);
    let Operation::Mknod { arg, name } = op(&req) else {
        panic!("not mknod")
    };
    assert_eq!((arg.mode, arg.umask, name), (0o10644, 0o22, &b"fifo"[..]));
    let req = get(Opcode::Mkdir);
    let Operation::Mkdir { arg, name } = op(&req) else {
        panic!("not mkdir")
    };
    assert_eq!((arg.mode, arg.umask, name), (0o755, 0o22, &b"dir"[..]));
    assert_eq!(
        op(&get(Opcode::Unlink)),
        Operation::Unlink { name: b"gone" }
    );
    assert_eq!(op(&get(Opcode::Rmdir)), Operation::Rmdir { name: b"dir" });
    assert_eq!(
        op(&get(Opcode::Rename)),
        Operation::Rename {
            newdir: 9,
            flags: 0,
            old: b"a",
            new: b"bb"
        }
    );
    assert_eq!(
        op(&get(Opcode::Rename2)),
        Operation::Rename {
            newdir: 9,
            flags: 1,
            old: b"a",
            new: b"bb"
        }
    );
    assert_eq!(
        op(&get(Opcode::Link)),
        Operation::Link {
            arg: LinkIn { oldnodeid: 12 },
            name: b"hard"
        }
    );
    let req = get(Opcode::Create);
    let Operation::Create { arg, name } = op(&req) else {
        panic!("not create")
    };
    assert_eq!(
        (arg.flags, arg.mode, arg.umask, name),
        (0o101, 0o100600, 0o77, &b"new"[..])
    );
    assert!(matches!(op(&get(Opcode::Opendir)), Operation::Opendir(_)));
    assert!(matches!(op(&get(Opcode::Tmpfile)), Operation::Tmpfile(c) if c.mode == 0o100600));
    assert!(matches!(op(&get(Opcode::Readdir)), Operation::Readdir(r) if r.size == 65536));
    assert!(matches!(
        op(&get(Opcode::Readdirplus)),
        Operation::Readdirplus(_)
    ));
    assert!(matches!(op(&get(Opcode::Releasedir)), Operation::Releasedir(r) if r.fh == 5));
    assert!(matches!(op(&get(Opcode::Fsyncdir)), Operation::Fsyncdir(f) if f.fh == 5));
    assert_eq!(
        op(&get(Opcode::Setxattr)),
        Operation::Setxattr {
            arg: SetxattrIn {
                size: 3,
                flags: 1,
                ..Default::default()
            },
            name: b"user.x",
            value: b"abc"
        }
    );
    assert_eq!(
        op(&get(Opcode::Getxattr)),
        Operation::Getxattr {
            arg: GetxattrIn {
                size: 64,
                padding: 0
            },
            name: b"user.x"
        }
    );
    assert_eq!(
        op(&get(Opcode::Removexattr)),
        Operation::Removexattr { name: b"user.x" }
    );
    assert_eq!(
        op(&get(Opcode::Access)),
        Operation::Access(AccessIn {
            mask: 4,
            padding: 0
        })
    );
}

#[test]
fn names_without_nul_and_short_values_are_refused() {
    for (code, body) in [
        (Opcode::Unlink, b"abc".to_vec()),
        (Opcode::Symlink, b"name\0target".to_vec()),
        (Opcode::Rename, B::default().u64(1).bytes(b"old\0new").0),
        (
            Opcode::Setxattr,
            B::default().u32(4).u32(0).bytes(b"user.x\0abc").0,
        ),
        (
            Opcode::Setxattr,
            B::default().u32(u32::MAX).u32(0).bytes(b"user.x\0").0,
        ),
    ] {
        let e = parse(&request(code, &body)).expect_err(code.name());
        assert_eq!(e.errno(), 22, "{}", code.name());
    }
}

#[test]
fn split_framing_reads_names_from_the_payload() {
    let mut op_in = [0u8; 128];
    op_in[..8].copy_from_slice(&0o755u32.to_ne_bytes().repeat(2));
    let hdr = InHeader {
        len: 80,
        opcode: Opcode::Mkdir as u32,
        unique: 1,
        nodeid: 1,
        ..Default::default()
    };
    assert_eq!(
        parse_op_split(&hdr, &op_in, b"sub\0").unwrap(),
        Operation::Mkdir {
            arg: MkdirIn {
                mode: 0o755,
                umask: 0o755
            },
            name: b"sub"
        }
    );
}

// ---------------------------------------------------- one test per op

#[test]
fn header_fields() {
    let buf = request(Opcode::Getattr, &B::default().zeros(16).0);
    let req = parse(&buf).unwrap();
    assert_eq!(
        req.header,
        InHeader {
            len: 56,
            opcode: 3,
            unique: UNIQUE,
            nodeid: NODE,
            uid: 1000,
            gid: 100,
            pid: 4242,
            total_extlen: 0,
            padding: 0,
        }
    );
}

#[test]
fn init() {
    let buf = request(Opcode::Init, &init_body());
    let Operation::Init(arg) = op(&buf) else {
        panic!("not init")
    };
    assert_eq!((arg.major, arg.minor, arg.max_readahead), (7, 45, 131072));
    assert_eq!(arg.flags, (FUSE_ASYNC_READ | FUSE_INIT_EXT) as u32);
    assert_eq!(arg.flags2, 1 << 9);
    assert_eq!(
        arg.all_flags(),
        FUSE_ASYNC_READ | FUSE_INIT_EXT | FUSE_OVER_IO_URING
    );
}

#[test]
fn init_compat_short() {
    let body = B::default().u32(7).u32(35).u32(4096).u32(1).0;
    let buf = request(Opcode::Init, &body);
    let Operation::Init(arg) = op(&buf) else {
        panic!("not init")
    };
    assert_eq!((arg.major, arg.minor, arg.flags, arg.flags2), (7, 35, 1, 0));
    assert_eq!(arg.unused, [0; 11]);
    // 16 < len < 64 is zero-filled too.
    let body = B::default().u32(7).u32(36).u32(0).u32(0).u32(5).0;
    let Operation::Init(arg) = op(&request(Opcode::Init, &body)) else {
        panic!("not init")
    };
    assert_eq!(arg.flags2, 5);
}

#[test]
fn destroy_statfs() {
    assert_eq!(op(&request(Opcode::Destroy, &[])), Operation::Destroy);
    assert_eq!(op(&request(Opcode::Statfs, &[])), Operation::Statfs);
}

#[test]
fn lookup() {
    let buf = request(Opcode::Lookup, b"disk.img\0");
    assert_eq!(op(&buf), Operation::Lookup { name: b"disk.img" });
    assert_eq!(
        op(&request(Opcode::Lookup, b"\0")),
        Operation::Lookup { name: b"" }
    );
}

#[test]
fn lookup_without_nul() {
    let buf = request(Opcode::Lookup, b"disk.img");
    assert_eq!(
        parse(&buf),
        Err(ParseError::Inconsistent {
            opcode: 1,
            what: "name is not NUL-terminated"
        })
    );
    assert_eq!(parse(&buf).unwrap_err().errno(), 22);
}

#[test]
fn forget() {
    let buf = request(Opcode::Forget, &B::default().u64(3).0);
    assert_eq!(op(&buf), Operation::Forget(ForgetIn { nlookup: 3 }));
}

#[test]
fn batch_forget() {
    let body = B::default().u32(2).u32(0).u64(1).u64(1).u64(2).u64(5).0;
    assert_eq!(
        op(&request(Opcode::BatchForget, &body)),
        Operation::BatchForget {
            count: 2,
            entries: &body[8..]
        }
    );
    let req = request(Opcode::BatchForget, &body);
    let Operation::BatchForget { entries, .. } = op(&req) else {
        panic!("not batch forget")
    };
    let got: Vec<_> = forget_entries(entries)
        .map(|e| (e.nodeid, e.nlookup))
        .collect();
    assert_eq!(got, [(1, 1), (2, 5)]);
    // Count larger than the entries present.
    let body = B::default().u32(3).u32(0).u64(1).u64(1).0;
    assert_eq!(
        parse(&request(Opcode::BatchForget, &body)),
        Err(ParseError::Truncated {
            opcode: 42,
            need: 8 + 48,
            have: 24
        })
    );
    let body = B::default().u32(u32::MAX).u32(0).0;
    assert!(parse(&request(Opcode::BatchForget, &body)).is_err());
}

#[test]
fn getattr() {
    let body = B::default().u32(FUSE_GETATTR_FH).u32(0).u64(77).0;
    assert_eq!(
        op(&request(Opcode::Getattr, &body)),
        Operation::Getattr(GetattrIn {
            getattr_flags: FUSE_GETATTR_FH,
            dummy: 0,
            fh: 77
        })
    );
}

#[test]
fn setxattr_in_both_layouts() {
    // Without FUSE_SETXATTR_EXT: 8 bytes, then the name.
    let short = request(
        Opcode::Setxattr,
        &B::default().u32(2).u32(1).bytes(b"user.a\0xy").0,
    );
    // With it: 16 bytes (setxattr_flags, padding), then the name.
    let long = request(
        Opcode::Setxattr,
        &B::default()
            .u32(2)
            .u32(1)
            .u32(FUSE_SETXATTR_ACL_KILL_SGID)
            .u32(0)
            .bytes(b"system.posix_acl_access\0xy")
            .0,
    );
    let ext = Layouts { setxattr_ext: true };
    let Operation::Setxattr { arg, name, value } = parse(&short).unwrap().op else {
        panic!("not setxattr")
    };
    assert_eq!((arg.size, arg.flags, arg.setxattr_flags), (2, 1, 0));
    assert_eq!((name, value), (&b"user.a"[..], &b"xy"[..]));
    let Operation::Setxattr { arg, name, value } = parse_laid_out(&long, true, ext).unwrap().op
    else {
        panic!("not setxattr")
    };
    assert_eq!(
        (arg.size, arg.flags, arg.setxattr_flags),
        (2, 1, FUSE_SETXATTR_ACL_KILL_SGID)
    );
    assert_eq!((name, value), (&b"system.posix_acl_access"[..], &b"xy"[..]));
    // Read as the short form, the long one names another attribute: the layout must be known.
    assert!(matches!(
        parse(&long).map(|r| r.op),
        Ok(Operation::Setxattr { name: b"\x01", .. })
    ));

    // io_uring: the struct is in op_in (stale bytes after the short form), names in the payload.
    let mut op_in = [0xaau8; 128];
    op_in[..8].copy_from_slice(&B::default().u32(2).u32(0).0);
    let hdr = InHeader {
        opcode: Opcode::Setxattr as u32,
        ..Default::default()
    };
    let Operation::Setxattr { arg, .. } =
        parse_op_split_laid_out(&hdr, &op_in, b"user.a\0xy", Layouts::default()).unwrap()
    else {
        panic!("not setxattr")
    };
    assert_eq!(
        (arg.setxattr_flags, arg.padding),
        (0, 0),
        "stale bytes ignored"
    );
    op_in[8..16].copy_from_slice(&B::default().u32(1).u32(0).0);
    let Operation::Setxattr { arg, .. } =
        parse_op_split_laid_out(&hdr, &op_in, b"user.a\0xy", ext).unwrap()
    else {
        panic!("not setxattr")
    };
    assert_eq!(arg.setxattr_flags, 1);
}

#[test]
fn statx_and_copy_file_range() {
    let body = B::default()
        .u32(FUSE_GETATTR_FH)
        .u32(0)
        .u64(9)
        .u32(0x2000)
        .u32(0xfff)
        .0;
    assert_eq!(
        op(&request(Opcode::Statx, &body)),
        Operation::Statx(StatxIn {
            getattr_flags: FUSE_GETATTR_FH,
            reserved: 0,
            fh: 9,
            sx_flags: 0x2000,
            sx_mask: 0xfff
        })
    );
    assert!(parse(&request(Opcode::Statx, &body[..20])).is_err());
    let body = (1..=7u64).fold(B::default(), |b, v| b.u64(v)).0;
    let want = CopyFileRangeIn {
        fh_in: 1,
        off_in: 2,
        nodeid_out: 3,
        fh_out: 4,
        off_out: 5,
        len: 6,
        flags: 7,
    };
    assert_eq!(
        op(&request(Opcode::CopyFileRange, &body)),
        Operation::CopyFileRange(want)
    );
    assert_eq!(
        op(&request(Opcode::CopyFileRange64, &body)),
        Operation::CopyFileRange64(want)
    );
    assert!(parse(&request(Opcode::CopyFileRange64, &body[..55])).is_err());
}

#[test]
fn setattr() {
    let Operation::Setattr(a) = op(&request(Opcode::Setattr, &setattr_body())) else {
        panic!("not setattr")
    };
    assert_eq!(a.valid, FATTR_SIZE | FATTR_MTIME);
    assert_eq!((a.fh, a.size, a.lock_owner), (3, 1 << 30, 4));
    assert_eq!((a.atime, a.mtime, a.ctime), (5, 6, 7));
    assert_eq!((a.atimensec, a.mtimensec, a.ctimensec), (8, 9, 10));
    assert_eq!((a.mode, a.uid, a.gid), (0o100644, 1001, 1002));
}

#[test]
fn open() {
    let body = B::default().u32(2).u32(FUSE_OPEN_KILL_SUIDGID).0;
    assert_eq!(
        op(&request(Opcode::Open, &body)),
        Operation::Open(OpenIn {
            flags: 2,
            open_flags: 1
        })
    );
}

#[test]
fn release() {
    let body = B::default().u64(5).u32(2).u32(FUSE_RELEASE_FLUSH).u64(6).0;
    assert_eq!(
        op(&request(Opcode::Release, &body)),
        Operation::Release(ReleaseIn {
            fh: 5,
            flags: 2,
            release_flags: FUSE_RELEASE_FLUSH,
            lock_owner: 6
        })
    );
}

#[test]
fn read() {
    assert_eq!(
        op(&request(Opcode::Read, &read_body())),
        Operation::Read(ReadIn {
            fh: 11,
            offset: 1 << 40,
            size: 65536,
            read_flags: FUSE_READ_LOCKOWNER,
            lock_owner: 99,
            flags: 2,
            padding: 0
        })
    );
}

#[test]
fn write() {
    let buf = request(Opcode::Write, &write_body(b"hello"));
    let Operation::Write { arg, data } = op(&buf) else {
        panic!("not write")
    };
    assert_eq!(data, b"hello");
    assert_eq!(
        arg,
        WriteIn {
            fh: 12,
            offset: 4096,
            size: 5,
            write_flags: FUSE_WRITE_CACHE,
            lock_owner: 98,
            flags: 1,
            padding: 0
        }
    );
    // Zero-length write.
    let buf = request(Opcode::Write, &write_body(b""));
    let Operation::Write { data, .. } = op(&buf) else {
        panic!("not write")
    };
    assert!(data.is_empty());
}

#[test]
fn write_size_mismatch() {
    let mut body = write_body(b"hello");
    body.push(b'!'); // one byte more than size
    let err = parse(&request(Opcode::Write, &body)).unwrap_err();
    assert_eq!(
        err,
        ParseError::Inconsistent {
            opcode: 16,
            what: "write data length differs from size"
        }
    );
    body.truncate(body.len() - 2); // one byte fewer
    assert!(matches!(
        parse(&request(Opcode::Write, &body)),
        Err(ParseError::Inconsistent { .. })
    ));
    // size claims 4 GiB - 1.
    let mut body = write_body(b"x");
    body[16..20].copy_from_slice(&u32::MAX.to_ne_bytes());
    assert!(parse(&request(Opcode::Write, &body)).is_err());
}

#[test]
fn flush() {
    let body = B::default().u64(5).u32(0).u32(0).u64(8).0;
    assert_eq!(
        op(&request(Opcode::Flush, &body)),
        Operation::Flush(FlushIn {
            fh: 5,
            unused: 0,
            padding: 0,
            lock_owner: 8
        })
    );
}

#[test]
fn fsync() {
    let body = B::default().u64(5).u32(FUSE_FSYNC_FDATASYNC).u32(0).0;
    assert_eq!(
        op(&request(Opcode::Fsync, &body)),
        Operation::Fsync(FsyncIn {
            fh: 5,
            fsync_flags: 1,
            padding: 0
        })
    );
}

#[test]
fn fallocate() {
    let body = B::default().u64(5).u64(4096).u64(8192).u32(0x10).u32(0).0;
    assert_eq!(
        op(&request(Opcode::Fallocate, &body)),
        Operation::Fallocate(FallocateIn {
            fh: 5,
            offset: 4096,
            length: 8192,
            mode: FALLOC_FL_ZERO_RANGE,
            padding: 0
        })
    );
}

#[test]
fn lseek() {
    let body = B::default().u64(5).u64(123).u32(SEEK_DATA).u32(0).0;
    assert_eq!(
        op(&request(Opcode::Lseek, &body)),
        Operation::Lseek(LseekIn {
            fh: 5,
            offset: 123,
            whence: 3,
            padding: 0
        })
    );
}

#[test]
fn interrupt() {
    let body = B::default().u64(UNIQUE - 2).0;
    assert_eq!(
        op(&request(Opcode::Interrupt, &body)),
        Operation::Interrupt(InterruptIn { unique: UNIQUE - 2 })
    );
}

#[test]
fn unsupported_and_unknown() {
    for &code in Opcode::ALL {
        if samples().iter().any(|(o, _)| *o == code) {
            continue;
        }
        let buf = request(code, &[0u8; 24]);
        assert_eq!(op(&buf), Operation::Unsupported(code), "{}", code.name());
    }
    assert_eq!(op(&request_ext(999, b"junk", 0)), Operation::Unknown(999));
    assert_eq!(op(&request_ext(0, b"", 0)), Operation::Unknown(0));
}

#[test]
fn larger_structs_are_tolerated() {
    // A future kernel may append fields; extra bytes after a fixed struct are ignored.
    let mut body = read_body();
    body.extend_from_slice(&[0xFF; 8]);
    assert!(matches!(
        op(&request(Opcode::Read, &body)),
        Operation::Read(_)
    ));
}

// ------------------------------------------------------- extensions

#[test]
fn extensions_are_cut_off() {
    let ext = B::default().u32(16).u32(32).u32(1).u32(100).0; // 16 bytes = 2 units
    let body = B::default().bytes(&write_body(b"data")).bytes(&ext).0;
    let buf = request_ext(Opcode::Write as u32, &body, 2);
    let Operation::Write { data, .. } = op(&buf) else {
        panic!("not write")
    };
    assert_eq!(data, b"data");

    let body = B::default().bytes(b"name\0\0\0\0").bytes(&ext).0;
    let buf = request_ext(Opcode::Lookup as u32, &body, 2);
    assert_eq!(op(&buf), Operation::Lookup { name: b"name" });

    // Extension bytes must not complete a truncated struct.
    let body = B::default().bytes(&read_body()[..32]).zeros(8).0;
    let buf = request_ext(Opcode::Read as u32, &body, 1);
    assert!(matches!(parse(&buf), Err(ParseError::Truncated { .. })));
}

#[test]
fn extensions_longer_than_request() {
    for extlen in [1u16, 100, u16::MAX] {
        let buf = request_ext(Opcode::Statfs as u32, b"", extlen);
        assert_eq!(
            parse(&buf),
            Err(ParseError::Inconsistent {
                opcode: 17,
                what: "extensions are longer than the request"
            })
        );
    }
}

// ---------------------------------------------------- header problems

#[test]
fn too_short() {
    for len in 0..40 {
        let buf = vec![0u8; len];
        assert_eq!(parse(&buf), Err(ParseError::TooShort { len }));
        assert_eq!(
            parse_with_len_check(&buf, false),
            Err(ParseError::TooShort { len })
        );
        assert_eq!(ParseError::TooShort { len }.errno(), 5);
    }
}

#[test]
fn header_len_mismatch() {
    let mut buf = request(Opcode::Read, &read_body());
    buf[0..4].copy_from_slice(&81u32.to_ne_bytes());
    let err = parse(&buf).unwrap_err();
    assert_eq!(
        err,
        ParseError::LengthMismatch {
            header: 81,
            actual: 80
        }
    );
    assert_eq!(err.errno(), 5);
    // Without the check, the request decodes.
    assert!(matches!(
        parse_with_len_check(&buf, false).unwrap().op,
        Operation::Read(_)
    ));
    buf[0..4].copy_from_slice(&0u32.to_ne_bytes());
    assert!(matches!(
        parse(&buf),
        Err(ParseError::LengthMismatch { .. })
    ));
}

#[test]
fn peek_unique_needs_full_header() {
    let buf = request(Opcode::Write, &[1, 2, 3]);
    assert_eq!(peek_unique(&buf), Some(UNIQUE));
    assert!(parse(&buf).is_err());
    assert_eq!(peek_unique(&buf[..40]), Some(UNIQUE));
    assert_eq!(peek_unique(&buf[..39]), None);
    assert_eq!(peek_unique(&[]), None);
}

#[test]
fn unaligned_buffer() {
    let req = request(Opcode::Read, &read_body());
    let mut storage = vec![0u8; req.len() + 1];
    storage[1..].copy_from_slice(&req);
    assert_eq!(parse(&storage[1..]).unwrap().op, op(&req));
}

// ------------------------------------------------------ truncation sweep

#[test]
fn every_truncation_fails() {
    for (code, body) in samples() {
        let full = request(code, &body);
        for cut in 0..full.len() {
            let mut buf = full[..cut].to_vec();
            if cut >= 4 {
                buf[0..4].copy_from_slice(&(cut as u32).to_ne_bytes());
            }
            let res = parse(&buf);
            let compat_init = code == Opcode::Init && cut >= 40 + INIT_IN_COMPAT_SIZE;
            if compat_init {
                assert!(res.is_ok(), "INIT cut to {cut}");
                continue;
            }
            let err = res.expect_err(&format!("{} cut to {cut} must fail", code.name()));
            let want = if cut < 40 { 5 } else { 22 };
            assert_eq!(err.errno(), want, "{} cut to {cut}: {err}", code.name());
            // Header intact: the server can still answer.
            assert_eq!(peek_unique(&buf).is_some(), cut >= 40);
            // Unpatched length: the header disagrees.
            if cut >= 40 {
                assert!(matches!(
                    parse(&full[..cut]),
                    Err(ParseError::LengthMismatch { .. })
                ));
            }
        }
        assert!(parse(&full).is_ok(), "{} full", code.name());
    }
}

// ---------------------------------------------------------- io_uring split

#[test]
fn split_read_write_lookup() {
    let mut op_in = [0u8; 128];
    let body = read_body();
    op_in[..40].copy_from_slice(&body);
    let hdr = InHeader {
        len: 80,
        opcode: Opcode::Read as u32,
        unique: 1,
        nodeid: 1,
        ..Default::default()
    };
    assert_eq!(
        parse_op_split(&hdr, &op_in, &[]).unwrap(),
        op(&request(Opcode::Read, &body))
    );

    let wb = write_body(b"payload!");
    op_in = [0u8; 128];
    op_in[..40].copy_from_slice(&wb[..40]);
    let hdr = InHeader {
        opcode: Opcode::Write as u32,
        ..hdr
    };
    let Operation::Write { arg, data } = parse_op_split(&hdr, &op_in, b"payload!").unwrap() else {
        panic!("not write")
    };
    assert_eq!((arg.size, data), (8, &b"payload!"[..]));
    assert!(parse_op_split(&hdr, &op_in, b"payload").is_err());
    assert!(parse_op_split(&hdr, &op_in[..39], b"payload!").is_err());

    let hdr = InHeader {
        opcode: Opcode::Lookup as u32,
        total_extlen: 1,
        ..hdr
    };
    assert_eq!(
        parse_op_split(&hdr, &[0u8; 128], b"img\0\0\0\0\0\0\0\0\0\0\0\0\0").unwrap(),
        Operation::Lookup { name: b"img" }
    );
}

// --------------------------------------------------------------- proptest

fn any_opcode() -> impl Strategy<Value = u32> {
    prop_oneof![
        3 => prop::sample::select(Opcode::ALL.to_vec()).prop_map(|o| o as u32),
        1 => any::<u32>(),
    ]
}

/// Checks the guarantees the decoder makes about a successful result.
fn check_invariants(res: &Result<Operation<'_>, ParseError>) {
    match res {
        Ok(Operation::Write { arg, data }) => assert_eq!(arg.size as usize, data.len()),
        Ok(Operation::Lookup { name })
        | Ok(Operation::Unlink { name })
        | Ok(Operation::Rmdir { name })
        | Ok(Operation::Mkdir { name, .. })
        | Ok(Operation::Create { name, .. }) => assert!(!name.contains(&0)),
        Ok(Operation::Rename { old, new, .. }) => {
            assert!(!old.contains(&0) && !new.contains(&0))
        }
        Ok(Operation::Setxattr { arg, value, .. }) => assert_eq!(arg.size as usize, value.len()),
        Ok(Operation::BatchForget { count, entries }) => {
            assert_eq!(*count as usize * 16, entries.len())
        }
        _ => {}
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_bytes_never_panic(buf in prop::collection::vec(any::<u8>(), 0..4096)) {
        let _ = parse(&buf);
        let _ = parse_with_len_check(&buf, false);
        let _ = peek_unique(&buf);
        if let Ok((hdr, body)) = InHeader::read_from_prefix(&buf[..]) {
            check_invariants(&parse_op(&hdr, body));
            let split = body.len().min(128);
            check_invariants(&parse_op_split(&hdr, &body[..split], &body[split..]));
        }
    }

    #[test]
    fn valid_header_random_body(
        opcode in any_opcode(),
        extlen in prop_oneof![Just(0u16), 0u16..8, any::<u16>()],
        body in prop::collection::vec(any::<u8>(), 0..600),
    ) {
        let buf = request_ext(opcode, &body, extlen);
        match parse(&buf) {
            Ok(req) => {
                prop_assert_eq!(req.header.opcode, opcode);
                prop_assert_eq!(req.header.unique, UNIQUE);
                check_invariants(&Ok(req.op));
            }
            Err(e) => prop_assert_eq!(e.errno(), 22, "header is valid: {}", e),
        }
        let hdr = InHeader::read_from_prefix(&buf[..]).unwrap().0;
        let split = body.len().min(128);
        check_invariants(&parse_op_split(&hdr, &body[..split], &body[split..]));
    }

    #[test]
    fn write_data_round_trip(
        data in prop::collection::vec(any::<u8>(), 0..2048),
        ext_units in 0u16..4,
    ) {
        let body = B::default()
            .bytes(&write_body(&data))
            .zeros(usize::from(ext_units) * 8)
            .0;
        let buf = request_ext(Opcode::Write as u32, &body, ext_units);
        match parse(&buf).unwrap().op {
            Operation::Write { arg, data: got } => {
                prop_assert_eq!(arg.size as usize, data.len());
                prop_assert_eq!(got, &data[..]);
            }
            other => prop_assert!(false, "unexpected {:?}", other),
        }
    }
}
