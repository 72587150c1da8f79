//! DirFs driven directly with requests, on a real engine and a temporary source tree (no
//! kernel mount: the end-to-end tests in `tests/dirfs.rs` mount it).

use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};

use engine::EngineConfig;
use fuse_abi::{CreateIn, GetattrIn, MkdirIn, OpenIn, FUSE_GETATTR_FH, RENAME_NOREPLACE};
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
        H::new_in(writable, None)
    }

    /// A fresh source tree in `base` (default: the system's temporary directory).
    fn new_in(writable: bool, base: Option<&str>) -> H {
        H::with_config(
            DirConfig {
                writable,
                ..DirConfig::default()
            },
            base,
        )
    }

    /// A writable export whose lookups, attributes, unlinks and creations are ring operations
    /// wherever the source is (a network source's way).
    fn on_the_ring() -> H {
        let cfg = DirConfig {
            writable: true,
            metadata_on_ring: Some(true),
            ..DirConfig::default()
        };
        let h = H::with_config(cfg, None);
        assert!(!h.fs.inline_metadata);
        h
    }

    /// A fresh source tree in `base`, served with `cfg`.
    fn with_config(cfg: DirConfig, base: Option<&str>) -> H {
        let dir = match base {
            Some(b) => tempfile::tempdir_in(b).unwrap(),
            None => tempfile::tempdir().unwrap(),
        };
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
        let fs = DirFs::open(dir.path(), cfg).unwrap();
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
        self.open_out(node, flags).map(|o| o.fh)
    }

    /// OPENDIR of `node`: the handle.
    fn opendir(&self, node: u64) -> Result<u64, i32> {
        self.opendir_out(node).map(|o| o.fh)
    }

    /// OPENDIR of `node`: the whole reply.
    fn opendir_out(&self, node: u64) -> Result<OpenOut, i32> {
        let b = self.call(node, |_| Request::Opendir(OpenIn::default()), &[], &[])?;
        Ok(OpenOut::read_from_bytes(&b).unwrap())
    }

    /// RELEASE (RELEASEDIR with `dir`) of `fh`.
    fn release(&self, fh: u64, dir: bool) {
        let a = fuse_abi::ReleaseIn {
            fh,
            ..Default::default()
        };
        let req = if dir {
            Request::Releasedir(a)
        } else {
            Request::Release(a)
        };
        self.call(1, |_| req, &[], &[]).unwrap();
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

    fn getattr(&self, node: u64, fh: Option<u64>) -> Result<AttrOut, i32> {
        let b = self.call(
            node,
            |_| {
                Request::Getattr(GetattrIn {
                    getattr_flags: if fh.is_some() { FUSE_GETATTR_FH } else { 0 },
                    dummy: 0,
                    fh: fh.unwrap_or(0),
                })
            },
            &[],
            &[],
        )?;
        Ok(AttrOut::read_from_bytes(&b).unwrap())
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
    // Nothing to do at close: the kernel is told once, and stops sending FLUSH.
    let flush = fuse_abi::FlushIn {
        fh,
        ..Default::default()
    };
    assert_eq!(
        h.call(e.nodeid, |_| Request::Flush(flush), &[], &[]),
        Err(libc::ENOSYS)
    );
    h.release(fh, false);
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

/// `open(path, O_NOFOLLOW)` of a regular file through the mount: the kernel passes the flag on
/// in OPEN, and the file opens (the kernel refused a symlink itself already).
#[test]
fn an_open_with_o_nofollow_opens_the_file() {
    let h = H::new(true);
    let e = h.lookup(ROOT_ID, b"file").unwrap();
    for flags in [libc::O_RDONLY, libc::O_RDWR, libc::O_WRONLY] {
        let fh = h.open(e.nodeid, flags | libc::O_NOFOLLOW).unwrap();
        h.release(fh, false);
    }
    let fh = h.open(e.nodeid, libc::O_RDONLY | libc::O_NOFOLLOW).unwrap();
    assert_eq!(h.read(fh, 0, 5).unwrap(), b"hello");
    h.release(fh, false);
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
    assert_eq!(h.opendir(e.nodeid).unwrap_err(), libc::ENOTDIR);
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

/// Lookups, attributes and unlinks as ring operations (a network source's way).
#[test]
fn create_write_rename_unlink_on_the_ring() {
    create_write_rename_unlink_on(H::on_the_ring());
}

/// The same calls on a tmpfs source, where stat, lookup and unlink are made directly.
#[test]
fn create_write_rename_unlink_on_tmpfs() {
    let h = H::new_in(true, Some("/dev/shm"));
    assert!(
        h.fs.inline_metadata,
        "/dev/shm is tmpfs, a local filesystem"
    );
    create_write_rename_unlink_on(h);
}

fn create_write_rename_unlink_on(h: H) {
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
    assert_eq!(r(1 << 3, b"x").unwrap_err(), libc::EINVAL);
    // RENAME_WHITEOUT: the file moves, a whiteout (0:0 character device) takes its old name.
    r(fuse_abi::RENAME_WHITEOUT, b"moved").unwrap();
    let wo = std::fs::symlink_metadata(h.path("sub/new")).unwrap();
    assert!(std::os::unix::fs::FileTypeExt::is_char_device(
        &wo.file_type()
    ));
    assert_eq!(std::os::unix::fs::MetadataExt::rdev(&wo), 0);
    std::fs::remove_file(h.path("sub/new")).unwrap();
    std::fs::rename(h.path("moved"), h.path("sub/new")).unwrap();
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

/// With `cache_listings` (`--cache always`) a directory's OPENDIR lets the kernel keep its
/// listing across opens (`FOPEN_CACHE_DIR` with `FOPEN_KEEP_CACHE`, without which the kernel
/// drops it at each open); without it nothing is kept. A file's OPEN never asks for it.
#[test]
fn listings_are_kept_by_the_kernel_only_when_configured() {
    let both = FOPEN_CACHE_DIR | FOPEN_KEEP_CACHE;
    for cache_listings in [false, true] {
        let h = H::with_config(
            DirConfig {
                cache_listings,
                ..DirConfig::default()
            },
            None,
        );
        let sub = h.lookup(ROOT_ID, b"sub").unwrap().nodeid;
        let dir = h.opendir_out(sub).unwrap();
        let want = if cache_listings { both } else { 0 };
        assert_eq!(
            dir.open_flags & both,
            want,
            "cache_listings {cache_listings}"
        );
        h.release(dir.fh, true);
        let file = h.lookup(ROOT_ID, b"file").unwrap().nodeid;
        let f = h.open_out(file, libc::O_RDONLY).unwrap();
        assert_eq!(f.open_flags & FOPEN_CACHE_DIR, 0, "a file is no listing");
        h.release(f.fh, false);
    }
}

#[test]
fn readdir_and_readdirplus_list_every_entry() {
    let h = H::new(true);
    for i in 0..300 {
        std::fs::write(h.path(&format!("sub/f{i:03}")), b"").unwrap();
    }
    std::fs::create_dir(h.path("sub/dir")).unwrap();
    let sub = h.lookup(ROOT_ID, b"sub").unwrap().nodeid;
    // Plain; plus for a reader that only lists; plus once a file the last first reply left out
    // was looked up (a reader that stats what it lists).
    for (plus, statting) in [(false, false), (true, false), (true, true)] {
        if statting {
            h.lookup(sub, b"f000").unwrap();
        }
        let fh = h.opendir(sub).unwrap();
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
            let first = off == 0;
            let b = h.call(sub, |_| req, &[], &[]).unwrap();
            if b.is_empty() {
                break;
            }
            let mut p = 0;
            while p < b.len() {
                let mut head = p;
                let mut node = None;
                if plus {
                    let e = EntryOut::read_from_bytes(&b[p..p + 128]).unwrap();
                    if e.nodeid != 0 {
                        linked += 1;
                    }
                    node = Some(e.nodeid);
                    head += 128;
                }
                let d = Dirent::read_from_bytes(&b[head..head + 24]).unwrap();
                let name = &b[head + 24..head + 24 + d.namelen as usize];
                if let Some(node) = node {
                    // The first reply looks up subdirectories, and files only for a reader
                    // that stats them; later ones (the kernel asks for them only for a reader
                    // that looks entries up) every entry.
                    let dot = name == b"." || name == b"..";
                    let want = !dot && (!first || statting || d.typ == u32::from(libc::DT_DIR));
                    assert_eq!(node != 0, want, "{:?}, first reply: {first}", name);
                }
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
        assert_eq!(names.len(), 303, "plus={plus}");
        assert_eq!(&names[..2], [".", ".."]);
        if statting {
            assert_eq!(linked, 301);
        } else if plus {
            assert!(linked > 100 && linked < 301, "{linked} linked");
            assert_eq!(h.fs.nodes(), 2 + linked, "root, sub and every entry linked");
        }
        h.release(fh, true);
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
            arg: SetxattrIn {
                size: 3,
                ..Default::default()
            },
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

// ------------------------------------------------------ STATX, COPY_FILE_RANGE, ACLs

/// `statx(2)` of a path on the source, the oracle.
fn statx_path(p: &std::path::Path) -> libc::statx {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    let mut sx = std::mem::MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: a valid path and a writable statx.
    let r = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
            libc::STATX_BASIC_STATS | libc::STATX_BTIME,
            sx.as_mut_ptr(),
        )
    };
    assert_eq!(r, 0, "statx {}", p.display());
    // SAFETY: statx succeeded.
    unsafe { sx.assume_init() }
}

impl H {
    fn statx(&self, node: u64, fh: Option<u64>, mask: u32) -> Result<fuse_abi::Statx, i32> {
        let b = self.call(
            node,
            |_| {
                Request::Statx(fuse_abi::StatxIn {
                    getattr_flags: if fh.is_some() { FUSE_GETATTR_FH } else { 0 },
                    fh: fh.unwrap_or(0),
                    sx_flags: libc::AT_STATX_FORCE_SYNC as u32,
                    sx_mask: mask,
                    ..Default::default()
                })
            },
            &[],
            &[],
        )?;
        let out = fuse_abi::StatxOut::read_from_bytes(&b).unwrap();
        assert_eq!(out.attr_valid, 1);
        Ok(out.stat)
    }

    fn create(&self, dir: u64, name: &[u8], mode: u32, umask: u32) -> Result<(EntryOut, u64), i32> {
        let b = self.call(
            dir,
            |s| Request::Create {
                arg: CreateIn {
                    flags: (libc::O_CREAT | libc::O_RDWR) as u32,
                    mode: libc::S_IFREG | mode,
                    umask,
                    open_flags: 0,
                },
                name: s[0],
            },
            &[name],
            &[],
        )?;
        let e = EntryOut::read_from_bytes(&b[..128]).unwrap();
        Ok((e, OpenOut::read_from_bytes(&b[128..]).unwrap().fh))
    }

    fn setxattr(
        &self,
        node: u64,
        name: &[u8],
        value: &[u8],
        setxattr_flags: u32,
    ) -> Result<(), i32> {
        self.call(
            node,
            |s| Request::Setxattr {
                arg: SetxattrIn {
                    size: value.len() as u32,
                    flags: 0,
                    setxattr_flags,
                    padding: 0,
                },
                name: s[0],
                value: Span {
                    at: s[1].at,
                    len: value.len(),
                },
            },
            &[name, value],
            &[],
        )
        .map(drop)
    }
}

#[test]
fn statx_answers_what_the_source_says_birth_time_included() {
    let h = H::new(false);
    for (name, path) in [(&b"file"[..], "file"), (b"sub", "sub"), (b"link", "link")] {
        let e = h.lookup(ROOT_ID, name).unwrap();
        let want = statx_path(&h.path(path));
        let got = h
            .statx(e.nodeid, None, libc::STATX_BASIC_STATS | libc::STATX_BTIME)
            .unwrap();
        let carried = libc::STATX_BASIC_STATS | libc::STATX_BTIME;
        assert_eq!(got.mask, want.stx_mask & carried, "{path}");
        assert_eq!(
            (got.mode, got.ino, got.size, got.nlink, got.uid, got.gid),
            (
                want.stx_mode,
                want.stx_ino,
                want.stx_size,
                want.stx_nlink,
                want.stx_uid,
                want.stx_gid
            ),
            "{path}"
        );
        assert_eq!(
            (got.btime.tv_sec, got.btime.tv_nsec),
            (want.stx_btime.tv_sec, want.stx_btime.tv_nsec),
            "{path} birth time"
        );
        assert_eq!(
            (got.mtime.tv_sec, got.mtime.tv_nsec, got.ctime.tv_sec),
            (
                want.stx_mtime.tv_sec,
                want.stx_mtime.tv_nsec,
                want.stx_ctime.tv_sec
            ),
            "{path}"
        );
        assert_eq!(
            (got.dev_major, got.dev_minor, got.blocks, got.attributes),
            (
                want.stx_dev_major,
                want.stx_dev_minor,
                want.stx_blocks,
                want.stx_attributes
            ),
            "{path}"
        );
    }
    // Through an open handle: the same file.
    let e = h.lookup(ROOT_ID, b"file").unwrap();
    let fh = h.open(e.nodeid, libc::O_RDONLY).unwrap();
    let got = h.statx(e.nodeid, Some(fh), libc::STATX_BTIME).unwrap();
    let want = statx_path(&h.path("file"));
    assert_eq!(got.ino, want.stx_ino);
    assert_eq!(got.btime.tv_sec, want.stx_btime.tv_sec);
    // A node the kernel does not hold.
    assert_eq!(
        h.statx(999, None, libc::STATX_BASIC_STATS).unwrap_err(),
        libc::ENOENT
    );
}

#[test]
fn copy_file_range_copies_between_handles() {
    let h = H::new(true);
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
    std::fs::write(h.path("src"), &data).unwrap();
    std::fs::write(h.path("dst"), vec![0xEEu8; 1000]).unwrap();
    let src = h.lookup(ROOT_ID, b"src").unwrap();
    let dst = h.lookup(ROOT_ID, b"dst").unwrap();
    let fin = h.open(src.nodeid, libc::O_RDONLY).unwrap();
    let fout = h.open(dst.nodeid, libc::O_RDWR).unwrap();
    let copy = |wide: bool, off_in: u64, off_out: u64, len: u64| -> Result<u64, i32> {
        let arg = fuse_abi::CopyFileRangeIn {
            fh_in: fin,
            off_in,
            nodeid_out: dst.nodeid,
            fh_out: fout,
            off_out,
            len,
            flags: 0,
        };
        let b = h.call(
            src.nodeid,
            |_| {
                if wide {
                    Request::CopyFileRange64(arg)
                } else {
                    Request::CopyFileRange(arg)
                }
            },
            &[],
            &[],
        )?;
        Ok(if wide {
            fuse_abi::CopyFileRangeOut::read_from_bytes(&b)
                .unwrap()
                .bytes_copied
        } else {
            u64::from(WriteOut::read_from_bytes(&b).unwrap().size)
        })
    };
    // A middle range to an offset inside the destination, then one past its end (a hole
    // between), then one that runs past the source's end (short).
    assert_eq!(copy(true, 1000, 10, 5000), Ok(5000));
    assert_eq!(copy(false, 7, 200_000, 12_345), Ok(12_345));
    assert_eq!(copy(true, 290_000, 0, 50_000), Ok(10_000));
    assert_eq!(copy(true, 400_000, 0, 10), Ok(0), "past the end: nothing");
    let mut want = vec![0xEEu8; 1000];
    want.resize(5010, 0);
    want[10..5010].copy_from_slice(&data[1000..6000]);
    want.resize(200_000 + 12_345, 0);
    want[200_000..].copy_from_slice(&data[7..7 + 12_345]);
    want[..10_000].copy_from_slice(&data[290_000..]);
    assert_eq!(std::fs::read(h.path("dst")).unwrap(), want);
    // Stale handles and flags are refused.
    let bad = fuse_abi::CopyFileRangeIn {
        fh_in: 12345,
        fh_out: fout,
        len: 1,
        ..Default::default()
    };
    assert_eq!(
        h.call(1, |_| Request::CopyFileRange64(bad), &[], &[]),
        Err(libc::EBADF)
    );
    let flagged = fuse_abi::CopyFileRangeIn {
        fh_in: fin,
        fh_out: fout,
        len: 1,
        flags: 1,
        ..Default::default()
    };
    assert_eq!(
        h.call(1, |_| Request::CopyFileRange64(flagged), &[], &[]),
        Err(libc::EINVAL)
    );
    // Read-only exports copy nothing.
    let ro = H::new(false);
    let f = ro.lookup(ROOT_ID, b"file").unwrap();
    let fh = ro.open(f.nodeid, libc::O_RDONLY).unwrap();
    let arg = fuse_abi::CopyFileRangeIn {
        fh_in: fh,
        fh_out: fh,
        off_out: 100,
        len: 5,
        ..Default::default()
    };
    assert_eq!(
        ro.call(1, |_| Request::CopyFileRange(arg), &[], &[]),
        Err(libc::EROFS)
    );
    assert_eq!(std::fs::read(ro.path("file")).unwrap(), b"hello world");
}

/// An ACL as its xattr value: version 2, then (tag, perm, id) entries.
fn acl_value(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut v = 2u32.to_le_bytes().to_vec();
    for &(tag, perm, id) in entries {
        v.extend_from_slice(&tag.to_le_bytes());
        v.extend_from_slice(&perm.to_le_bytes());
        v.extend_from_slice(&id.to_le_bytes());
    }
    v
}

const ACL_USER_OBJ: u16 = 1;
const ACL_USER: u16 = 2;
const ACL_GROUP_OBJ: u16 = 4;
const ACL_MASK: u16 = 0x10;
const ACL_OTHER: u16 = 0x20;
const NO_ID: u32 = u32::MAX;

fn xattr_of(p: &std::path::Path, name: &str) -> Option<Vec<u8>> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    let n = std::ffi::CString::new(name).unwrap();
    let mut buf = vec![0u8; 4096];
    // SAFETY: valid strings and a writable buffer of its length.
    let r = unsafe { libc::lgetxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    (r >= 0).then(|| buf[..r as usize].to_vec())
}

#[test]
fn the_callers_umask_or_the_parents_default_acl_decides_a_new_entrys_mode() {
    umask_or_default_acl(H::new(true));
}

/// The same with every creation on the ring (MKDIR's `mkdirat` in an io-wq worker, which
/// applies the umask the queue thread holds for it).
#[test]
fn the_callers_umask_or_the_parents_default_acl_decides_on_the_ring_too() {
    umask_or_default_acl(H::on_the_ring());
}

fn umask_or_default_acl(h: H) {
    // No default ACL: the caller's umask applies (the kernel sends it beside the mode).
    let (_, _) = h.create(ROOT_ID, b"masked", 0o666, 0o022).unwrap();
    let mode = |p: &str| std::fs::symlink_metadata(h.path(p)).unwrap().mode() & 0o7777;
    assert_eq!(mode("masked"), 0o644);
    let b = h
        .call(
            ROOT_ID,
            |s| Request::Mkdir {
                arg: MkdirIn {
                    mode: 0o1777,
                    umask: 0o027,
                },
                name: s[0],
            },
            &[b"d"],
            &[],
        )
        .unwrap();
    let d = EntryOut::read_from_bytes(&b).unwrap();
    assert_eq!(mode("d"), 0o1750, "umask applied, sticky bit kept");

    // A default ACL on the directory: the umask is ignored, the ACL decides, as locally.
    let default = acl_value(&[
        (ACL_USER_OBJ, 7, NO_ID),
        (ACL_USER, 7, 65534),
        (ACL_GROUP_OBJ, 5, NO_ID),
        (ACL_MASK, 7, NO_ID),
        (ACL_OTHER, 0, NO_ID),
    ]);
    let set = h.setxattr(d.nodeid, b"system.posix_acl_default", &default, 0);
    if set == Err(libc::EOPNOTSUPP) {
        return; // the temporary directory's filesystem has no ACLs
    }
    set.unwrap();
    assert!(h.fs.source_has_acls());
    // The oracle: the same creations made on the source directly (any umask: the default ACL
    // overrides it).
    std::fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o666)
        .open(h.path("d/local"))
        .unwrap();
    std::fs::DirBuilder::new()
        .mode(0o775)
        .create(h.path("d/localdir"))
        .unwrap();
    h.create(d.nodeid, b"remote", 0o666, 0o077).unwrap();
    h.call(
        d.nodeid,
        |s| Request::Mkdir {
            arg: MkdirIn {
                mode: 0o775,
                umask: 0o077,
            },
            name: s[0],
        },
        &[b"remotedir"],
        &[],
    )
    .unwrap();
    for (local, remote) in [("d/local", "d/remote"), ("d/localdir", "d/remotedir")] {
        assert_eq!(mode(remote), mode(local), "{remote}");
        for attr in ["system.posix_acl_access", "system.posix_acl_default"] {
            assert_eq!(
                xattr_of(&h.path(remote), attr),
                xattr_of(&h.path(local), attr),
                "{remote} {attr}"
            );
        }
    }
    assert!(xattr_of(&h.path("d/remote"), "system.posix_acl_access").is_some());
    assert_eq!(
        mode("d/remote"),
        0o660,
        "mask rw- from the mode, other from the ACL"
    );
}

#[test]
fn setting_an_access_acl_clears_setgid_when_the_kernel_says_so() {
    let h = H::new(true);
    std::fs::set_permissions(h.path("file"), std::fs::Permissions::from_mode(0o2775)).unwrap();
    let e = h.lookup(ROOT_ID, b"file").unwrap();
    let acl = acl_value(&[
        (ACL_USER_OBJ, 7, NO_ID),
        (ACL_USER, 5, 65534),
        (ACL_GROUP_OBJ, 5, NO_ID),
        (ACL_MASK, 5, NO_ID),
        (ACL_OTHER, 5, NO_ID),
    ]);
    let mode = || std::fs::metadata(h.path("file")).unwrap().mode() & 0o7777;
    let set = h.setxattr(e.nodeid, b"system.posix_acl_access", &acl, 0);
    if set == Err(libc::EOPNOTSUPP) {
        return;
    }
    set.unwrap();
    assert_eq!(mode(), 0o2755, "no flag: the setgid bit stays");
    h.setxattr(
        e.nodeid,
        b"system.posix_acl_access",
        &acl,
        fuse_abi::FUSE_SETXATTR_ACL_KILL_SGID,
    )
    .unwrap();
    assert_eq!(mode(), 0o755, "FUSE_SETXATTR_ACL_KILL_SGID: cleared");
    assert_eq!(
        xattr_of(&h.path("file"), "system.posix_acl_access"),
        Some(acl),
        "the ACL is untouched by the chmod"
    );
    // Other attributes with the flag change nothing.
    std::fs::set_permissions(h.path("file"), std::fs::Permissions::from_mode(0o2775)).unwrap();
    let _ = h.setxattr(
        e.nodeid,
        b"user.x",
        b"1",
        fuse_abi::FUSE_SETXATTR_ACL_KILL_SGID,
    );
    assert_eq!(mode() & libc::S_ISGID, libc::S_ISGID);
}

/// Beyond the descriptor budget nodes are held by file handle: a tree larger than the budget is
/// served whole (lookups, attributes, opens, links of such nodes), the nodes holding a
/// descriptor stay within the budget, an open file unlinked meanwhile still answers GETATTR by
/// its handle, and a node whose inode is gone answers ESTALE. Without handles the budget bounds
/// the nodes.
#[test]
fn nodes_beyond_the_descriptor_budget_are_held_by_file_handle() {
    let cfg = DirConfig {
        writable: true,
        max_node_fds: 8,
        ..DirConfig::default()
    };
    let h = H::with_config(cfg, None);
    assert!(
        h.fs.file_handles(),
        "the tests run as root on a filesystem with file handles"
    );
    let names: Vec<String> = (0..100).map(|i| format!("f{i}")).collect();
    for (i, n) in names.iter().enumerate() {
        std::fs::write(h.path(n), i.to_string()).unwrap();
    }
    let ids: Vec<u64> = names
        .iter()
        .map(|n| h.lookup(ROOT_ID, n.as_bytes()).unwrap().nodeid)
        .collect();
    assert_eq!(h.fs.nodes(), 101);
    assert!(h.fs.pinned_nodes() <= 8, "{} pinned", h.fs.pinned_nodes());
    // A second lookup of a handle node is the same node.
    assert_eq!(h.lookup(ROOT_ID, b"f99").unwrap().nodeid, ids[99]);
    for (i, (n, &id)) in names.iter().zip(&ids).enumerate() {
        let a = h.getattr(id, None).unwrap().attr;
        let md = std::fs::metadata(h.path(n)).unwrap();
        assert_eq!((a.ino, a.size), (md.ino(), md.len()), "{n}");
        assert_eq!(a.size, i.to_string().len() as u64);
    }
    // Every attribute of one SETATTR set through its handle (one open serves all the steps).
    let sa = SetattrIn {
        valid: FATTR_MODE | FATTR_UID | FATTR_GID | FATTR_SIZE | FATTR_MTIME,
        mode: 0o640,
        uid: 1234,
        gid: 5678,
        size: 1,
        mtime: 1_000_000,
        mtimensec: 5,
        ..SetattrIn::default()
    };
    let out = h.call(ids[50], |_| Request::Setattr(sa), &[], &[]).unwrap();
    let a = AttrOut::read_from_bytes(&out).unwrap().attr;
    let md = std::fs::metadata(h.path("f50")).unwrap();
    assert_eq!(
        (md.mode() & 0o7777, md.uid(), md.gid(), md.len()),
        (0o640, 1234, 5678, 1)
    );
    assert_eq!((md.mtime(), md.mtime_nsec()), (1_000_000, 5));
    assert_eq!(
        (a.mode & 0o7777, a.uid, a.gid, a.size),
        (0o640, 1234, 5678, 1)
    );
    assert_eq!((a.mtime, a.mtimensec), (1_000_000, 5));
    // Opened, linked and renamed through its handle.
    let last = ids[99];
    let ino99 = std::fs::metadata(h.path("f99")).unwrap().ino();
    let fh = h.open(last, libc::O_RDWR).unwrap();
    assert_eq!(h.read(fh, 0, 10).unwrap(), b"99");
    let l = h
        .call(
            ROOT_ID,
            |s| Request::Link {
                arg: fuse_abi::LinkIn { oldnodeid: last },
                name: s[0],
            },
            &[b"hard"],
            &[],
        )
        .unwrap();
    assert_eq!(EntryOut::read_from_bytes(&l).unwrap().nodeid, last);
    assert_eq!(std::fs::metadata(h.path("hard")).unwrap().nlink(), 2);
    // Gone from the source under both names, still open: fstat answers by the open file.
    std::fs::remove_file(h.path("hard")).unwrap();
    std::fs::remove_file(h.path("f99")).unwrap();
    assert_eq!(h.getattr(last, Some(fh)).unwrap().attr.nlink, 0);
    h.release(fh, false);
    // Closed too: the inode is gone, and its handle says so (or, while the kernel has not
    // evicted it yet, still answers for that unlinked inode, never for another).
    match h.getattr(last, None) {
        Err(e) => assert_eq!(e, libc::ESTALE),
        Ok(a) => assert_eq!((a.attr.ino, a.attr.nlink), (ino99, 0)),
    }
    // A new file under the name is a new node.
    std::fs::write(h.path("f99"), b"new").unwrap();
    let again = h.lookup(ROOT_ID, b"f99").unwrap();
    assert_eq!(again.attr.size, 3);
    assert_eq!(h.getattr(again.nodeid, None).unwrap().attr.size, 3);
    for id in ids.iter().chain([&last, &last, &again.nodeid]) {
        h.call(*id, |_| Request::Forget(1), &[], &[]).unwrap();
    }
    assert_eq!((h.fs.nodes(), h.fs.pinned_nodes()), (1, 1), "all forgotten");

    // Without handles the budget bounds the nodes: the root and 7 more.
    let h = H::with_config(
        DirConfig {
            file_handles: false,
            ..cfg
        },
        None,
    );
    assert!(!h.fs.file_handles());
    for n in &names[..7] {
        std::fs::write(h.path(n), b"x").unwrap();
        h.lookup(ROOT_ID, n.as_bytes()).unwrap();
    }
    std::fs::write(h.path("f7"), b"x").unwrap();
    assert_eq!(h.lookup(ROOT_ID, b"f7").unwrap_err(), libc::ENFILE);
}

/// The read-ahead's tree walk parks the subdirectories it listed in the export's own
/// [`ahead::Parked`], and OPENDIR of one takes that descriptor: the handle lists the directory
/// from its start although the walk read it to the end; the next OPENDIR opens it anew.
#[test]
fn opendir_takes_the_directory_the_read_ahead_parked() {
    let tree = |h: &H| {
        for f in ["sub/deep/a", "sub/deep/b"] {
            let p = h.path(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, b"x").unwrap();
        }
        let sub = h.lookup(ROOT_ID, b"sub").unwrap().nodeid;
        let fd =
            h.fs.node(sub)
                .unwrap()
                .fd()
                .unwrap()
                .as_fd()
                .try_clone_to_owned();
        (sub, fd.unwrap())
    };
    // Handed over, the tree below is walked on the process's read-ahead thread.
    let h = H::new_in(false, Some("/dev/shm"));
    let (_, sub_fd) = tree(&h);
    until_parked(&h, |_| h.fs.read_ahead(sub_fd.as_fd(), ahead::Reach::Tree));
    // Taken by OPENDIR (a walk made here: no other walk parks into this export meanwhile).
    let h = H::new_in(false, Some("/dev/shm"));
    let (sub, sub_fd) = tree(&h);
    let walked = ahead::Walker::default().walk(
        sub_fd.as_fd(),
        ahead::Reach::Tree,
        ahead::BUDGET,
        &std::sync::Arc::downgrade(&h.fs.parked),
        &mut || false,
    );
    assert_eq!(
        (walked, h.fs.parked.len()),
        (3, 1),
        "deep, a, b; deep parked"
    );
    let deep = h.lookup(sub, b"deep").unwrap().nodeid;
    let list = |fh: u64| {
        let a = ReadIn {
            fh,
            size: 4096,
            ..ReadIn::default()
        };
        let b = h.call(deep, |_| Request::Readdir(a), &[], &[]).unwrap();
        let (mut names, mut p) = (Vec::new(), 0);
        while p < b.len() {
            let d = Dirent::read_from_bytes(&b[p..p + 24]).unwrap();
            names.push(b[p + 24..p + 24 + d.namelen as usize].to_vec());
            p += fuse_abi::dirent_size(d.namelen as usize);
        }
        names.sort();
        names
    };
    for _ in 0..2 {
        let fh = h.opendir(deep).unwrap();
        assert!(h.fs.parked.is_empty(), "taken");
        // Opened as the reader's own open would be: access times kept, blocking.
        let fd = h.fs.files.get(fh).unwrap();
        // SAFETY: F_GETFL on a descriptor the handle table holds open.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        assert_eq!(flags & (libc::O_NOATIME | libc::O_NONBLOCK), 0);
        let want: [&[u8]; 4] = [b".", b"..", b"a", b"b"];
        assert_eq!(list(fh), want);
        h.release(fh, true);
    }
    assert_eq!(h.fs.open_files(), 0);
}

/// Hands over until `parked` holds something: the read-ahead thread is the process's, shared
/// with other tests' exports, and walks only the latest directory handed to it. `hand_over`
/// makes a fresh hand-over each time.
fn until_parked(h: &H, mut hand_over: impl FnMut(usize)) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut i = 0;
    while h.fs.parked.is_empty() {
        assert!(std::time::Instant::now() < deadline, "nothing parked");
        hand_over(i);
        i += 1;
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// A reader that only lists (a first READDIR, or READDIRPLUS leaving files out, of a directory
/// with subdirectories), or opens a second subdirectory of a directory by name, hands the tree
/// below to the read-ahead, which lists it (and parks the subdirectories it opened).
#[test]
fn a_listing_or_a_second_subdirectory_hands_the_tree_below_over() {
    let h = H::new_in(false, Some("/dev/shm"));
    std::fs::create_dir_all(h.path("sub/deep")).unwrap();
    let sub = h.lookup(ROOT_ID, b"sub").unwrap().nodeid;
    until_parked(&h, |_| {
        let fh = h.opendir(sub).unwrap();
        let a = ReadIn {
            fh,
            size: 4096,
            ..ReadIn::default()
        };
        h.call(sub, |_| Request::Readdir(a), &[], &[]).unwrap();
        h.release(fh, true);
    });
    let h = H::new_in(false, Some("/dev/shm"));
    until_parked(&h, |i| {
        let top = format!("t{i}");
        for d in ["a/x", "b/x"] {
            std::fs::create_dir_all(h.path(&format!("{top}/{d}"))).unwrap();
        }
        let t = h.lookup(ROOT_ID, top.as_bytes()).unwrap().nodeid;
        h.lookup(t, b"a").unwrap();
        h.lookup(t, b"b").unwrap();
    });
}

/// The open descriptors and resident memory of this process.
fn descriptors_and_rss() -> (usize, u64) {
    let fds = std::fs::read_dir("/proc/self/fd").unwrap().count();
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no VmRSS in {status}"));
    (fds, kib << 10)
}

/// Runs the test `name` of this crate alone in a child process (its process-wide readings,
/// descriptors and resident memory, are then its own, not those of tests running beside it);
/// true in that child, where the caller goes on with the test.
fn alone(name: &str) -> bool {
    const VAR: &str = "FUSEX_DIRFS_TEST_ALONE";
    if std::env::var_os(VAR).is_some() {
        return true;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(VAR, "1")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{name} alone: {}\n{text}",
        out.status
    );
    false
}

/// Sends a request for a node with bytes placed in the buffer first (offset, bytes): a LOOKUP's
/// node id, 0 for a reply without an entry, or the errno.
type Sender<'a> = dyn FnMut(u64, Request, &[(usize, &[u8])]) -> Result<u64, i32> + 'a;

/// A million LOOKUP and FORGET cycles (single FORGETs, BATCH_FORGETs, several lookups of one
/// name forgotten at once, lookups of a missing name; nodes beyond a small descriptor budget
/// held by file handle): after a warm-up, the node table holds only the root at every
/// checkpoint, and the process's descriptors and resident memory stay where they were. Bounds
/// are on counts and bytes, not time.
#[test]
fn a_million_lookups_and_forgets_leave_memory_and_descriptors_flat() {
    if !alone("tests::a_million_lookups_and_forgets_leave_memory_and_descriptors_flat") {
        return;
    }
    let cfg = DirConfig {
        max_node_fds: 16,
        ..DirConfig::default()
    };
    let h = H::with_config(cfg, None);
    const NAMES: usize = 500;
    const TOTAL: usize = 1_000_000;
    const WARM_UP: usize = 100_000;
    const CHECK_EVERY: usize = 100_000;
    for i in 0..NAMES {
        std::fs::write(h.path(&format!("n{i:04}")), b"").unwrap();
    }
    // Past the descriptor budget only with file handles (as root); else within it.
    let window = if h.fs.file_handles() { 64 } else { 12 };
    let names: Vec<Vec<u8>> = (0..NAMES)
        .map(|i| format!("n{i:04}").into_bytes())
        .collect();
    let (uid, gid) = (unsafe_uid(), unsafe_gid());
    let hdr = |nodeid| InHeader {
        nodeid,
        uid,
        gid,
        ..InHeader::default()
    };
    let tally = Tally::new(&h.counters, 0);
    // One buffer for every request: a name at 64, forget entries at 1024, replies at PAYLOAD.
    let mut buf = Some(h.eng.take_buffer().unwrap());
    let len = buf.as_ref().unwrap().len();
    let (name_at, entries_at) = (64, 1024);
    let mut send = |nodeid: u64, req: Request, bytes: &[(usize, &[u8])]| -> Result<u64, i32> {
        let mut b = buf.take().unwrap();
        for (at, v) in bytes {
            b.as_mut_slice()[*at..*at + v.len()].copy_from_slice(v);
        }
        let (r, b) = h
            .eng
            .block_on(h.fs.handle(&h.eng, &hdr(nodeid), req, b, PAYLOAD..len, &tally))
            .unwrap();
        let node = match r {
            Reply::Data(n) => EntryOut::read_from_bytes(&b.as_slice()[PAYLOAD..PAYLOAD + n])
                .map_or(0, |e| e.nodeid),
            Reply::None => 0,
            Reply::Error(e) => {
                buf = Some(b);
                return Err(e);
            }
        };
        buf = Some(b);
        Ok(node)
    };
    let lookup = |send: &mut Sender<'_>, name: &[u8]| {
        let mut with_nul = name.to_vec();
        with_nul.push(0);
        let span = Span {
            at: name_at,
            len: name.len(),
        };
        send(
            ROOT_ID,
            Request::Lookup { name: span },
            &[(name_at, &with_nul)],
        )
    };
    let (mut done, mut batch) = (0usize, 0usize);
    let mut base: Option<(usize, u64)> = None;
    let mut next_check = WARM_UP;
    let mut ids = Vec::with_capacity(window);
    while done < TOTAL {
        ids.clear();
        for k in 0..window {
            let name = &names[(batch * window + k) % NAMES];
            let id = lookup(&mut send, name).unwrap_or_else(|e| panic!("lookup {done}: {e}"));
            ids.push((id, 1u64));
            done += 1;
        }
        // The first name again: the same node, one lookup more.
        let again = lookup(&mut send, &names[batch * window % NAMES]).unwrap();
        assert_eq!(again, ids[0].0, "lookup {done}: the same node");
        ids[0].1 = 2;
        done += 1;
        assert_eq!(lookup(&mut send, b"missing"), Err(libc::ENOENT));
        assert_eq!(h.fs.nodes(), 1 + window, "lookup {done}: one node per name");
        if batch % 2 == 0 {
            for &(id, n) in &ids {
                send(id, Request::Forget(n), &[]).unwrap();
            }
        } else {
            let raw: Vec<u8> = ids
                .iter()
                .flat_map(|&(nodeid, nlookup)| {
                    fuse_abi::ForgetOne { nodeid, nlookup }.as_bytes().to_vec()
                })
                .collect();
            let entries = Span {
                at: entries_at,
                len: raw.len(),
            };
            send(0, Request::BatchForget { entries }, &[(entries_at, &raw)]).unwrap();
        }
        assert_eq!(h.fs.nodes(), 1, "lookup {done}: every node forgotten");
        batch += 1;
        if done >= next_check {
            next_check += CHECK_EVERY;
            assert_eq!(
                h.fs.pinned_nodes(),
                1,
                "lookup {done}: only the root pinned"
            );
            let (fds, rss) = descriptors_and_rss();
            match base {
                None => base = Some((fds, rss)),
                Some((fds0, rss0)) => {
                    assert!(
                        fds <= fds0 + 8,
                        "{done} lookups: {fds0} descriptors after the warm-up, {fds} now"
                    );
                    assert!(
                        rss <= rss0 + (8 << 20),
                        "{done} lookups: resident memory {rss0} after the warm-up, {rss} now"
                    );
                }
            }
        }
    }
    assert!(done >= TOTAL && base.is_some());
}

impl H {
    /// OPEN of `node` with the caller's `flags`: the whole answer.
    fn open_out(&self, node: u64, flags: i32) -> Result<OpenOut, i32> {
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
        Ok(OpenOut::read_from_bytes(&b).unwrap())
    }

    /// WRITE of `data` at `off` through `fh`: the count written.
    fn write(&self, fh: u64, off: u64, data: &[u8]) -> Result<u32, i32> {
        let w = self.call(
            1,
            |_| {
                Request::Write(WriteIn {
                    fh,
                    offset: off,
                    size: data.len() as u32,
                    ..WriteIn::default()
                })
            },
            &[],
            data,
        )?;
        Ok(WriteOut::read_from_bytes(&w).unwrap().size)
    }
}

/// With writeback caching an open for writing can be read from (the kernel fills partial pages
/// through it) and writes at the offsets the kernel sends, even for an `O_APPEND` open: the
/// kernel computes appends itself. Without it the caller's flags are the source's.
#[test]
fn writeback_opens_for_writing_are_readable_and_not_appending() {
    for writeback in [false, true] {
        let h = H::new(true);
        if writeback {
            h.fs.set_granted(FUSE_WRITEBACK_CACHE);
        }
        assert_eq!(h.fs.writeback(), writeback);
        let e = h.lookup(1, b"file").unwrap();
        let out = h
            .open_out(e.nodeid, libc::O_WRONLY | libc::O_APPEND)
            .unwrap();
        assert_eq!(out.open_flags & FOPEN_DIRECT_IO, 0);
        let read = h.read(out.fh, 0, 5);
        assert_eq!(h.write(out.fh, 0, b"HELLO").unwrap(), 5);
        let now = std::fs::read(h.path("file")).unwrap();
        if writeback {
            assert_eq!(read.unwrap(), b"hello");
            assert_eq!(now, b"HELLO world", "written where the kernel said");
        } else {
            assert_eq!(read.unwrap_err(), libc::EBADF);
            assert_eq!(now, b"hello worldHELLO", "the source appends");
        }
        h.release(out.fh, false);
    }
}

/// Where the source refuses the read access writeback caching adds (a daemon without
/// `CAP_DAC_OVERRIDE` and a write-only file), the open is made with the caller's flags and
/// answered for direct I/O, so the kernel neither reads through it nor caches its writes.
#[test]
fn a_write_only_file_the_daemon_cannot_read_is_opened_for_direct_io() {
    // SAFETY: plain syscall.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root (to give the file away and drop to its owner's fsuid)");
        return;
    }
    let h = H::new(true);
    h.fs.set_granted(FUSE_WRITEBACK_CACHE);
    let p = h.path("file");
    std::os::unix::fs::chown(&p, Some(65534), Some(65534)).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o200)).unwrap();
    let e = h.lookup(1, b"file").unwrap();
    // As the daemon of a user that owns the file and has no capabilities: this thread's fsuid
    // (io_uring runs the open with the submitter's credentials).
    struct Fsuid;
    impl Drop for Fsuid {
        fn drop(&mut self) {
            // SAFETY: plain syscall, back to root on this thread.
            unsafe { libc::setfsuid(0) };
        }
    }
    // SAFETY: plain syscall; changes this thread's filesystem uid only.
    unsafe { libc::setfsuid(65534) };
    let _back = Fsuid;
    let out = h.open_out(e.nodeid, libc::O_WRONLY).unwrap();
    assert_ne!(out.open_flags & FOPEN_DIRECT_IO, 0, "{:#x}", out.open_flags);
    assert_eq!(h.read(out.fh, 0, 5).unwrap_err(), libc::EBADF);
    assert_eq!(h.write(out.fh, 6, b"WORLD").unwrap(), 5);
    h.release(out.fh, false);
    drop(_back);
    assert_eq!(std::fs::read(&p).unwrap(), b"hello WORLD");
}

/// A directory export's tables go to a successor (`fusex restart`): the node ids and open
/// handles the kernel holds answer there as they did here, the lookup counts carry on, and a
/// table that does not fit (another source directory, missing descriptors) is refused.
#[test]
fn a_successor_answers_the_node_ids_and_handles_of_its_predecessor() {
    let h = H::new(true);
    let file = h.lookup(1, b"file").unwrap();
    let sub = h.lookup(1, b"sub").unwrap();
    h.lookup(1, b"file").unwrap();
    let fh = h.open(file.nodeid, libc::O_RDWR).unwrap();
    let dh = h.opendir(sub.nodeid).unwrap();
    let (made, made_fh) = h.create(sub.nodeid, b"new", 0o644, 0).unwrap();
    let (table, raw) = h.fs.handover();
    assert_eq!(table.descriptors(), raw.len());
    assert_eq!(table.nodes.len(), 3, "file, sub, new: {table:?}");
    assert_eq!(table.files.len(), 3);
    // As SCM_RIGHTS would: the successor gets descriptors of its own.
    let dup = |fds: &[std::os::fd::RawFd]| -> Vec<OwnedFd> {
        fds.iter()
            .map(|&fd| {
                // SAFETY: a descriptor the export holds open while this runs.
                unsafe { BorrowedFd::borrow_raw(fd) }
                    .try_clone_to_owned()
                    .unwrap()
            })
            .collect()
    };
    let cfg = DirConfig {
        writable: true,
        ..DirConfig::default()
    };
    // Not without every descriptor, nor over another directory.
    let short = dup(&raw[1..]);
    let e = DirFs::take_over(h.dir.path(), cfg, table.clone(), short)
        .err()
        .unwrap();
    assert!(e.to_string().contains("descriptors came"), "{e}");
    let other = tempfile::tempdir().unwrap();
    let e = DirFs::take_over(other.path(), cfg, table.clone(), dup(&raw))
        .err()
        .unwrap();
    assert!(e.to_string().contains("not the directory"), "{e}");
    let mut swapped = dup(&raw);
    swapped.swap(0, 1);
    let e = DirFs::take_over(h.dir.path(), cfg, table.clone(), swapped)
        .err()
        .unwrap();
    assert!(e.to_string().contains("of another inode"), "{e}");
    let fs = DirFs::take_over(h.dir.path(), cfg, table, dup(&raw)).unwrap();
    let H {
        eng, dir, fs: old, ..
    } = h;
    drop(old);
    let h = H {
        eng,
        fs,
        dir,
        counters: export::Counters::default(),
    };
    assert_eq!(h.fs.open_files(), 3);
    assert_eq!(h.read(fh, 0, 64).unwrap(), b"hello world");
    assert_eq!(h.getattr(file.nodeid, None).unwrap().attr.size, 11);
    assert_eq!(h.getattr(made.nodeid, Some(made_fh)).unwrap().attr.size, 0);
    // A new lookup of a name finds the node it had, with its generation.
    let again = h.lookup(1, b"file").unwrap();
    assert_eq!(
        (again.nodeid, again.generation),
        (file.nodeid, file.generation)
    );
    assert_eq!(h.lookup(sub.nodeid, b"new").unwrap().nodeid, made.nodeid);
    h.release(fh, false);
    h.release(dh, true);
    h.release(made_fh, false);
    assert_eq!(h.fs.open_files(), 0);
    assert!(h.read(fh, 0, 1).is_err(), "a released handle is gone");
    // Two lookups here, one there: the node stays until all three are forgotten.
    h.call(file.nodeid, |_| Request::Forget(2), &[], &[])
        .unwrap();
    assert!(h.getattr(file.nodeid, None).is_ok());
    h.call(file.nodeid, |_| Request::Forget(1), &[], &[])
        .unwrap();
    assert_eq!(h.getattr(file.nodeid, None).err(), Some(libc::ENOENT));
    // New nodes and handles do not collide with the adopted ones.
    let n = h.lookup(1, b"link").unwrap();
    assert!(![sub.nodeid, made.nodeid].contains(&n.nodeid));
    let fh2 = h.open(made.nodeid, libc::O_RDONLY).unwrap();
    assert_ne!(fh2, fh);
    h.release(fh2, false);
}

/// CREATE of a name that exists (it appeared after the kernel's lookup) opens the file as it
/// is, and truncates it when the caller asked for `O_TRUNC` (the kernel truncates nothing after
/// a CREATE), clearing its set-id bits where the kernel says the caller has no `CAP_FSETID`
/// (`FUSE_OPEN_KILL_SUIDGID`).
#[test]
fn create_of_a_name_that_appeared_truncates_only_when_asked() {
    let h = H::new(true);
    let mode = |p: &str| std::fs::metadata(h.path(p)).unwrap().mode() & 0o7777;
    for (name, flags, open_flags, size, bits) in [
        ("kept", libc::O_WRONLY, 0, 5, 0o6777),
        ("trunc", libc::O_WRONLY | libc::O_TRUNC, 0, 0, 0o6777),
        (
            "killed",
            libc::O_RDONLY | libc::O_TRUNC,
            fuse_abi::FUSE_OPEN_KILL_SUIDGID,
            0,
            0o0777,
        ),
    ] {
        std::fs::write(h.path(name), b"hello").unwrap();
        std::fs::set_permissions(h.path(name), std::fs::Permissions::from_mode(0o6777)).unwrap();
        h.call(
            ROOT_ID,
            |s| Request::Create {
                arg: CreateIn {
                    flags: (libc::O_CREAT | flags) as u32,
                    mode: libc::S_IFREG | 0o644,
                    umask: 0o022,
                    open_flags,
                },
                name: s[0],
            },
            &[name.as_bytes()],
            &[],
        )
        .unwrap();
        assert_eq!(
            std::fs::metadata(h.path(name)).unwrap().len(),
            size,
            "{name}"
        );
        assert_eq!(mode(name), bits, "{name}");
    }
}
