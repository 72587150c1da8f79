//! DirFs driven directly with requests, on a real engine and a temporary source tree (no
//! kernel mount: the end-to-end tests in `tests/dirfs.rs` mount it).

use std::os::unix::fs::{MetadataExt, PermissionsExt};

use engine::EngineConfig;
use fuse_abi::FUSE_GETATTR_FH;
use zerocopy::FromBytes;

use super::*;

const PAYLOAD: usize = 4096;

struct H {
    eng: Engine,
    fs: DirFs,
    dir: tempfile::TempDir,
    counters: export::Counters,
}

impl H {
    fn new(writable: bool) -> H {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("file"), b"hello world").unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("link")).unwrap();
        let eng = Engine::new(&EngineConfig {
            sq_entries: 8,
            buffers: 2,
            buffer_size: 2 * PAYLOAD + 65536,
            ..EngineConfig::default()
        })
        .expect("io_uring available");
        let fs = DirFs::open(
            dir.path(),
            DirConfig {
                writable,
                ..DirConfig::default()
            },
        )
        .unwrap();
        H {
            eng,
            fs,
            dir,
            counters: export::Counters::default(),
        }
    }

    /// Serves `req` on node `node`, with `names` (each NUL-terminated) placed before the payload;
    /// `data` at the payload (WRITE). Returns the reply and its body.
    fn call(
        &self,
        node: u64,
        make: impl FnOnce(&[Span]) -> Request,
        names: &[&[u8]],
        data: &[u8],
    ) -> Result<Vec<u8>, i32> {
        let mut buf = self.eng.take_buffer().unwrap();
        buf.as_mut_slice().fill(0xA5);
        let mut at = 64;
        let mut spans = Vec::new();
        for n in names {
            buf.as_mut_slice()[at..at + n.len()].copy_from_slice(n);
            buf.as_mut_slice()[at + n.len()] = 0;
            spans.push(Span { at, len: n.len() });
            at += n.len() + 1;
        }
        buf.as_mut_slice()[PAYLOAD..PAYLOAD + data.len()].copy_from_slice(data);
        let req = make(&spans);
        let hdr = InHeader {
            nodeid: node,
            uid: unsafe_uid(),
            gid: unsafe_gid(),
            ..InHeader::default()
        };
        let tally = Tally::new(&self.counters, 0);
        let len = buf.len();
        let (r, buf) = self
            .eng
            .block_on(
                self.fs
                    .handle(&self.eng, &hdr, req, buf, PAYLOAD..len, &tally),
            )
            .unwrap();
        match r {
            Reply::Data(n) => Ok(buf.as_slice()[PAYLOAD..PAYLOAD + n].to_vec()),
            Reply::None => Ok(Vec::new()),
            Reply::Error(e) => Err(e),
        }
    }

    fn lookup(&self, dir: u64, name: &[u8]) -> Result<EntryOut, i32> {
        let b = self.call(dir, |s| Request::Lookup { name: s[0] }, &[name], &[])?;
        Ok(EntryOut::read_from_bytes(&b).unwrap())
    }

    fn open(&self, node: u64, flags: i32) -> Result<u64, i32> {
        let b = self.call(
            node,
            |_| {
                Request::Open(OpenIn {
                    flags: flags as u32,
                    open_flags: 0,
                })
            },
            &[],
            &[],
        )?;
        Ok(OpenOut::read_from_bytes(&b).unwrap().fh)
    }

    fn read(&self, fh: u64, off: u64, size: u32) -> Result<Vec<u8>, i32> {
        self.call(
            1,
            |_| {
                Request::Read(ReadIn {
                    fh,
                    offset: off,
                    size,
                    ..ReadIn::default()
                })
            },
            &[],
            &[],
        )
    }

    fn path(&self, p: &str) -> std::path::PathBuf {
        self.dir.path().join(p)
    }
}

fn unsafe_uid() -> u32 {
    // SAFETY: getuid cannot fail.
    unsafe { libc::getuid() }
}

fn unsafe_gid() -> u32 {
    // SAFETY: getgid cannot fail.
    unsafe { libc::getgid() }
}

#[test]
fn lookup_read_and_forget() {
    let h = H::new(false);
    let e = h.lookup(ROOT_ID, b"file").unwrap();
    assert_eq!(e.attr.size, 11);
    assert_eq!(e.attr.mode & libc::S_IFMT, libc::S_IFREG);
    assert_eq!(e.attr.ino, std::fs::metadata(h.path("file")).unwrap().ino());
    // A second lookup is the same node; two forgets drop it.
    assert_eq!(h.lookup(ROOT_ID, b"file").unwrap().nodeid, e.nodeid);
    assert_eq!(h.fs.nodes(), 2);
    let fh = h.open(e.nodeid, libc::O_RDONLY).unwrap();
    assert_eq!(h.read(fh, 6, 100).unwrap(), b"world");
    h.call(
        1,
        |_| {
            Request::Release(fuse_abi::ReleaseIn {
                fh,
                ..Default::default()
            })
        },
        &[],
        &[],
    )
    .unwrap();
    assert_eq!(h.read(fh, 0, 5), Err(libc::EBADF), "released");
    h.call(e.nodeid, |_| Request::Forget(2), &[], &[]).unwrap();
    assert_eq!(h.fs.nodes(), 1);
    assert_eq!(h.lookup(ROOT_ID, b"missing").unwrap_err(), libc::ENOENT);
    assert_eq!(
        h.lookup(e.nodeid, b"x").unwrap_err(),
        libc::ENOENT,
        "forgotten"
    );
}

#[test]
fn names_that_leave_the_directory_are_refused() {
    let h = H::new(true);
    for bad in [&b".."[..], b".", b"", b"a/b", b"../etc"] {
        assert_eq!(h.lookup(ROOT_ID, bad).unwrap_err(), libc::EINVAL, "{bad:?}");
        let r = h.call(
            ROOT_ID,
            |s| Request::Mkdir {
                arg: MkdirIn {
                    mode: 0o755,
                    umask: 0,
                },
                name: s[0],
            },
            &[bad],
            &[],
        );
        assert_eq!(r.unwrap_err(), libc::EINVAL);
    }
}

#[test]
fn symlinks_are_returned_never_followed() {
    let h = H::new(true);
    let e = h.lookup(ROOT_ID, b"link").unwrap();
    assert_eq!(e.attr.mode & libc::S_IFMT, libc::S_IFLNK);
    let target = h.call(e.nodeid, |_| Request::Readlink, &[], &[]).unwrap();
    assert_eq!(target, b"/etc/passwd");
    // Opening, listing or changing the link's mode never reaches /etc/passwd.
    assert_eq!(h.open(e.nodeid, libc::O_RDONLY).unwrap_err(), libc::EINVAL);
    assert_eq!(
        h.call(e.nodeid, |_| Request::Opendir(OpenIn::default()), &[], &[])
            .unwrap_err(),
        libc::ENOTDIR
    );
    let sa = SetattrIn {
        valid: FATTR_MODE,
        mode: 0o777,
        ..SetattrIn::default()
    };
    assert_eq!(
        h.call(e.nodeid, |_| Request::Setattr(sa), &[], &[])
            .unwrap_err(),
        libc::EOPNOTSUPP
    );
    // A lookup below a symlink node finds nothing (it is not a directory).
    assert_eq!(h.lookup(e.nodeid, b"passwd").unwrap_err(), libc::ENOTDIR);
    // A new symlink holds its target as given.
    let n = h
        .call(
            ROOT_ID,
            |s| Request::Symlink {
                name: s[0],
                target: s[1],
            },
            &[b"out", b"../../../../etc/shadow"],
            &[],
        )
        .unwrap();
    let n = EntryOut::read_from_bytes(&n).unwrap();
    assert_eq!(n.attr.mode & libc::S_IFMT, libc::S_IFLNK);
    assert_eq!(
        std::fs::read_link(h.path("out")).unwrap().to_str(),
        Some("../../../../etc/shadow")
    );
}

#[test]
fn create_write_rename_unlink() {
    let h = H::new(true);
    let sub = h.lookup(ROOT_ID, b"sub").unwrap().nodeid;
    let b = h
        .call(
            sub,
            |s| Request::Create {
                arg: CreateIn {
                    flags: (libc::O_CREAT | libc::O_RDWR) as u32,
                    mode: libc::S_IFREG | 0o640,
                    umask: 0,
                    open_flags: 0,
                },
                name: s[0],
            },
            &[b"new"],
            &[],
        )
        .unwrap();
    let e = EntryOut::read_from_bytes(&b[..128]).unwrap();
    let fh = OpenOut::read_from_bytes(&b[128..]).unwrap().fh;
    let meta = std::fs::metadata(h.path("sub/new")).unwrap();
    assert_eq!(meta.permissions().mode() & 0o7777, 0o640, "exact mode");
    assert_eq!((meta.uid(), meta.gid()), (unsafe_uid(), unsafe_gid()));
    let w = h
        .call(
            1,
            |_| {
                Request::Write(WriteIn {
                    fh,
                    offset: 3,
                    size: 4,
                    ..WriteIn::default()
                })
            },
            &[],
            b"data",
        )
        .unwrap();
    assert_eq!(WriteOut::read_from_bytes(&w).unwrap().size, 4);
    assert_eq!(std::fs::read(h.path("sub/new")).unwrap(), b"\0\0\0data");
    // GETATTR sees it.
    let a = h
        .call(
            e.nodeid,
            |_| {
                Request::Getattr(GetattrIn {
                    getattr_flags: FUSE_GETATTR_FH,
                    dummy: 0,
                    fh,
                })
            },
            &[],
            &[],
        )
        .unwrap();
    assert_eq!(AttrOut::read_from_bytes(&a).unwrap().attr.size, 7);
    // Rename into the root, without replacing an existing file.
    let r = |flags, new: &[u8]| {
        h.call(
            sub,
            |s| Request::Rename {
                newdir: ROOT_ID,
                flags,
                old: s[0],
                new: s[1],
            },
            &[b"new", new],
            &[],
        )
    };
    assert_eq!(r(RENAME_NOREPLACE, b"file").unwrap_err(), libc::EEXIST);
    assert_eq!(
        r(fuse_abi::RENAME_WHITEOUT, b"x").unwrap_err(),
        libc::EINVAL
    );
    r(0, b"moved").unwrap();
    assert_eq!(std::fs::read(h.path("moved")).unwrap(), b"\0\0\0data");
    // The open handle follows the inode.
    assert_eq!(h.read(fh, 3, 10).unwrap(), b"data");
    h.call(
        ROOT_ID,
        |s| Request::Unlink { name: s[0] },
        &[b"moved"],
        &[],
    )
    .unwrap();
    assert!(!h.path("moved").exists());
    assert_eq!(
        h.call(ROOT_ID, |s| Request::Rmdir { name: s[0] }, &[b"file"], &[])
            .unwrap_err(),
        libc::ENOTDIR
    );
}

#[test]
fn read_only_refuses_changes() {
    let h = H::new(false);
    let e = h.lookup(ROOT_ID, b"file").unwrap();
    assert_eq!(h.open(e.nodeid, libc::O_RDWR).unwrap_err(), libc::EROFS);
    let mk = h.call(
        ROOT_ID,
        |s| Request::Mkdir {
            arg: MkdirIn {
                mode: 0o755,
                umask: 0,
            },
            name: s[0],
        },
        &[b"d"],
        &[],
    );
    assert_eq!(mk.unwrap_err(), libc::EROFS);
    assert_eq!(
        h.call(ROOT_ID, |s| Request::Unlink { name: s[0] }, &[b"file"], &[])
            .unwrap_err(),
        libc::EROFS
    );
    assert!(h.path("file").exists());
}

#[test]
fn readdir_and_readdirplus_list_every_entry() {
    let h = H::new(true);
    for i in 0..300 {
        std::fs::write(h.path(&format!("sub/f{i:03}")), b"").unwrap();
    }
    let sub = h.lookup(ROOT_ID, b"sub").unwrap().nodeid;
    for plus in [false, true] {
        let fh = {
            let b = h
                .call(sub, |_| Request::Opendir(OpenIn::default()), &[], &[])
                .unwrap();
            OpenOut::read_from_bytes(&b).unwrap().fh
        };
        let (mut names, mut off, mut linked) = (Vec::new(), 0u64, 0);
        loop {
            let a = ReadIn {
                fh,
                offset: off,
                size: 4096,
                ..ReadIn::default()
            };
            let req = if plus {
                Request::Readdirplus(a)
            } else {
                Request::Readdir(a)
            };
            let b = h.call(sub, |_| req, &[], &[]).unwrap();
            if b.is_empty() {
                break;
            }
            let mut p = 0;
            while p < b.len() {
                let mut head = p;
                if plus {
                    let e = EntryOut::read_from_bytes(&b[p..p + 128]).unwrap();
                    if e.nodeid != 0 {
                        linked += 1;
                    }
                    head += 128;
                }
                let d = Dirent::read_from_bytes(&b[head..head + 24]).unwrap();
                let name = &b[head + 24..head + 24 + d.namelen as usize];
                names.push(String::from_utf8(name.to_vec()).unwrap());
                off = d.off;
                p += if plus {
                    fuse_abi::direntplus_size(name.len())
                } else {
                    fuse_abi::dirent_size(name.len())
                };
            }
        }
        names.sort();
        assert_eq!(names.len(), 302, "plus={plus}");
        assert_eq!(&names[..2], [".", ".."]);
        if plus {
            assert_eq!(linked, 300);
            assert_eq!(h.fs.nodes(), 302, "root, sub and every file");
        }
        h.call(
            sub,
            |_| {
                Request::Releasedir(fuse_abi::ReleaseIn {
                    fh,
                    ..Default::default()
                })
            },
            &[],
            &[],
        )
        .unwrap();
    }
    assert_eq!(h.fs.open_files(), 0);
}

#[test]
fn xattrs_round_trip() {
    let h = H::new(true);
    let e = h.lookup(ROOT_ID, b"file").unwrap();
    let set = h.call(
        e.nodeid,
        |s| Request::Setxattr {
            arg: SetxattrIn { size: 3, flags: 0 },
            name: s[0],
            value: Span {
                at: s[1].at,
                len: 3,
            },
        },
        &[b"user.k", b"val"],
        &[],
    );
    if set == Err(libc::EOPNOTSUPP) {
        return; // the temporary directory's filesystem has no user xattrs
    }
    set.unwrap();
    let get = |size| {
        h.call(
            e.nodeid,
            |s| Request::Getxattr {
                arg: GetxattrIn { size, padding: 0 },
                name: s[0],
            },
            &[b"user.k"],
            &[],
        )
    };
    assert_eq!(
        GetxattrOut::read_from_bytes(&get(0).unwrap()).unwrap().size,
        3
    );
    assert_eq!(get(64).unwrap(), b"val");
    assert_eq!(get(2).unwrap_err(), libc::ERANGE);
    let list = h
        .call(
            e.nodeid,
            |_| {
                Request::Listxattr(GetxattrIn {
                    size: 256,
                    padding: 0,
                })
            },
            &[],
            &[],
        )
        .unwrap();
    assert!(list.split(|&b| b == 0).any(|n| n == b"user.k"));
    h.call(
        e.nodeid,
        |s| Request::Removexattr { name: s[0] },
        &[b"user.k"],
        &[],
    )
    .unwrap();
    assert_eq!(get(64).unwrap_err(), libc::ENODATA);
}
