//! Directory exports (`fusex mount SRC_DIR MNT`): the tree as the source has it, changes through
//! the mount landing in the source as a local filesystem would make them, and the daemon never
//! reaching outside the source. Oracles: the source itself (lstat, contents, symlink targets,
//! xattrs, hard-link groups), `diff -r`, tar, git.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use fusex_e2e::*;

/// A source tree and a directory mountpoint in a fresh work directory.
struct Tree {
    work: WorkDir,
    src: PathBuf,
    mnt: PathBuf,
}

impl Tree {
    fn new(tag: &str) -> Tree {
        let work = WorkDir::new(tag);
        // The source sits deeper than the mountpoint, so a relative symlink resolves to
        // different places from the source and from the mount.
        let src = work.join("a/b/src");
        let mnt = work.join("mnt");
        fs::create_dir_all(&src).unwrap();
        fs::create_dir(&mnt).unwrap();
        // Searchable by the other users the tests switch to, whatever the umask.
        for d in ["a", "a/b", "a/b/src", "mnt"] {
            fs::set_permissions(work.join(d), fs::Permissions::from_mode(0o755)).unwrap();
        }
        Tree { work, src, mnt }
    }

    fn mount(&self, args: &[&str]) -> Mount {
        Mount::start(&self.work, &self.src, &self.mnt, args)
    }
}

/// Files of several sizes and modes, nested directories, symlinks (absolute, relative, dangling,
/// to a directory), hard links, a fifo, an empty file, and user xattrs where the filesystem has
/// them.
fn populate(root: &Path) {
    let mut rng = Rng::new(27);
    fs::create_dir_all(root.join("d1/d2/d3")).unwrap();
    fs::create_dir(root.join("empty")).unwrap();
    for (i, size) in [0usize, 1, 4095, 4096, 70_000, 1 << 20].iter().enumerate() {
        let p = root.join(format!("d1/f{i}"));
        fs::write(&p, rng.bytes(*size)).unwrap();
    }
    fs::write(root.join("d1/d2/d3/deep"), b"deep\n").unwrap();
    fs::write(root.join("secret"), b"root only\n").unwrap();
    fs::set_permissions(root.join("secret"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::write(root.join("script"), b"#!/bin/sh\necho hi\n").unwrap();
    fs::set_permissions(root.join("script"), fs::Permissions::from_mode(0o4755)).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", root.join("abs")).unwrap();
    std::os::unix::fs::symlink("d1/f2", root.join("rel")).unwrap();
    std::os::unix::fs::symlink("nowhere/at/all", root.join("dangling")).unwrap();
    std::os::unix::fs::symlink("d1", root.join("dirlink")).unwrap();
    fs::hard_link(root.join("d1/f3"), root.join("hard")).unwrap();
    fs::hard_link(root.join("d1/f3"), root.join("d1/d2/hard2")).unwrap();
    let fifo = CString::new(root.join("fifo").as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid path string.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o640) }, 0);
    let _ = set_xattr(&root.join("d1/f1"), "user.colour", b"blue");
    let _ = set_xattr(&root.join("d1"), "user.dir", b"x");
    fs::set_permissions(root.join("d1/d2"), fs::Permissions::from_mode(0o750)).unwrap();
}

fn c(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

fn set_xattr(p: &Path, name: &str, value: &[u8]) -> std::io::Result<()> {
    let (p, n) = (c(p), CString::new(name).unwrap());
    // SAFETY: valid strings; value readable for its length.
    let r = unsafe {
        libc::lsetxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The user xattrs of `p` (not following a symlink), name → value.
fn xattrs(p: &Path) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let cp = c(p);
    let mut list = vec![0u8; 4096];
    // SAFETY: valid string; buffer writable for its length.
    let n = unsafe { libc::llistxattr(cp.as_ptr(), list.as_mut_ptr().cast(), list.len()) };
    let mut out = BTreeMap::new();
    if n <= 0 {
        return out;
    }
    for name in list[..n as usize]
        .split(|&b| b == 0)
        .filter(|n| n.starts_with(b"user."))
    {
        let cn = CString::new(name).unwrap();
        let mut v = vec![0u8; 4096];
        // SAFETY: valid strings; buffer writable for its length.
        let m =
            unsafe { libc::lgetxattr(cp.as_ptr(), cn.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
        assert!(
            m >= 0,
            "lgetxattr {}: {}",
            p.display(),
            std::io::Error::last_os_error()
        );
        v.truncate(m as usize);
        out.insert(name.to_vec(), v);
    }
    out
}

/// What a tree entry is, as lstat and friends show it (times left out: reading changes atime).
#[derive(Debug, PartialEq)]
struct Entry {
    mode: u32,
    uid: u32,
    gid: u32,
    size: u64,
    nlink: u64,
    /// Index of its inode among the tree's inodes (hard links share one).
    inode: usize,
    content: Option<Vec<u8>>,
    target: Option<PathBuf>,
    xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
}

/// Every entry below `root`, by relative path.
fn snapshot(root: &Path) -> BTreeMap<PathBuf, Entry> {
    let mut out = BTreeMap::new();
    let mut inodes: Vec<u64> = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let p = root.join(&rel);
        let m = fs::symlink_metadata(&p).unwrap_or_else(|e| panic!("lstat {}: {e}", p.display()));
        let inode = match inodes.iter().position(|&i| i == m.ino()) {
            Some(i) => i,
            None => {
                inodes.push(m.ino());
                inodes.len() - 1
            }
        };
        let ft = m.file_type();
        let content = ft.is_file().then(|| fs::read(&p).unwrap());
        let target = ft.is_symlink().then(|| fs::read_link(&p).unwrap());
        if ft.is_dir() {
            let mut names: Vec<_> = fs::read_dir(&p)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            names.sort();
            for n in names {
                stack.push(rel.join(n));
            }
        }
        out.insert(
            rel,
            Entry {
                mode: m.mode(),
                uid: m.uid(),
                gid: m.gid(),
                size: if ft.is_dir() { 0 } else { m.len() },
                nlink: m.nlink(),
                inode,
                content,
                target,
                xattrs: if ft.is_symlink() {
                    BTreeMap::new()
                } else {
                    xattrs(&p)
                },
            },
        );
    }
    out
}

#[track_caller]
fn assert_same_tree(a: &Path, b: &Path) {
    let (sa, sb) = (snapshot(a), snapshot(b));
    let names_a: Vec<_> = sa.keys().collect();
    let names_b: Vec<_> = sb.keys().collect();
    assert_eq!(
        names_a,
        names_b,
        "entries of {} and {}",
        a.display(),
        b.display()
    );
    for (k, ea) in &sa {
        assert_eq!(ea, &sb[k], "{}", k.display());
    }
}

#[track_caller]
fn diff_r(a: &Path, b: &Path) {
    // diff compares no special files (it reports every fifo): they are checked by lstat.
    let out = run(Command::new("diff")
        .args(["-r", "--no-dereference", "-x", "fifo"])
        .arg(a)
        .arg(b));
    assert!(
        out.status.success(),
        "diff -r {} {}:\n{}{}",
        a.display(),
        b.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn errno_of(r: std::io::Result<impl Sized>) -> i32 {
    match r {
        Ok(_) => 0,
        Err(e) => e.raw_os_error().unwrap_or(-1),
    }
}

#[test]
fn the_mount_shows_the_source_tree() {
    if !require_fuse_and_tools(&["diff"]) {
        return;
    }
    let t = Tree::new("dirfs-tree");
    populate(&t.src);
    let m = t.mount(&[]);
    assert_same_tree(&t.src, &t.mnt);
    diff_r(&t.src, &t.mnt);
    // Hard links are one inode through the mount too, and inode numbers are the source's.
    let ino = |p: &Path| fs::metadata(p).unwrap().ino();
    assert_eq!(ino(&t.mnt.join("hard")), ino(&t.mnt.join("d1/f3")));
    assert_eq!(ino(&t.mnt.join("hard")), ino(&t.src.join("hard")));
    // Symlinks are returned as they are.
    assert_eq!(
        fs::read_link(t.mnt.join("abs")).unwrap(),
        Path::new("/etc/passwd")
    );
    assert_eq!(
        fs::read(t.mnt.join("rel")).unwrap(),
        fs::read(t.src.join("d1/f2")).unwrap()
    );
    m.stop().assert_clean("directory export");
}

#[test]
fn a_read_only_export_refuses_every_change() {
    if !require_fuse() {
        return;
    }
    let t = Tree::new("dirfs-ro");
    populate(&t.src);
    let m = t.mount(&[]);
    let before = snapshot(&t.src);
    let p = |s: &str| t.mnt.join(s);
    let rofs = libc::EROFS;
    assert_eq!(errno_of(fs::write(p("new"), b"x")), rofs);
    assert_eq!(
        errno_of(fs::OpenOptions::new().write(true).open(p("d1/f1"))),
        rofs
    );
    assert_eq!(errno_of(fs::create_dir(p("newdir"))), rofs);
    assert_eq!(errno_of(fs::remove_file(p("d1/f1"))), rofs);
    assert_eq!(errno_of(fs::remove_dir(p("empty"))), rofs);
    assert_eq!(errno_of(fs::rename(p("d1/f1"), p("moved"))), rofs);
    assert_eq!(errno_of(fs::hard_link(p("d1/f1"), p("link2"))), rofs);
    assert_eq!(errno_of(std::os::unix::fs::symlink("x", p("sym2"))), rofs);
    assert_eq!(
        errno_of(fs::set_permissions(
            p("d1/f1"),
            fs::Permissions::from_mode(0o777)
        )),
        rofs
    );
    assert_eq!(errno_of(set_xattr(&p("d1/f1"), "user.new", b"v")), rofs);
    assert_same_tree(&t.src, &t.mnt);
    assert_eq!(snapshot(&t.src), before, "the source is unchanged");
    m.stop().assert_clean("read-only directory export");
}

#[test]
fn changes_through_the_mount_land_in_the_source() {
    if !require_fuse() {
        return;
    }
    let t = Tree::new("dirfs-rw");
    populate(&t.src);
    let m = t.mount(&["--writable"]);
    let (p, s) = (|x: &str| t.mnt.join(x), |x: &str| t.src.join(x));
    // Create, write, read back, append, truncate.
    let mut rng = Rng::new(5);
    let data = rng.bytes(300_000);
    fs::write(p("new"), &data).unwrap();
    assert_eq!(fs::read(s("new")).unwrap(), data);
    assert_eq!(fs::read(p("new")).unwrap(), data);
    fs::OpenOptions::new()
        .append(true)
        .open(p("new"))
        .unwrap()
        .write_all(b"tail")
        .unwrap();
    assert_eq!(&fs::read(s("new")).unwrap()[300_000..], b"tail");
    fs::OpenOptions::new()
        .write(true)
        .open(p("new"))
        .unwrap()
        .set_len(10)
        .unwrap();
    assert_eq!(fs::read(s("new")).unwrap(), &data[..10]);
    // Directories, renames (across directories, replacing, of directories), links, unlink.
    fs::create_dir(p("nd")).unwrap();
    assert!(s("nd").is_dir());
    fs::rename(p("new"), p("nd/renamed")).unwrap();
    assert!(!s("new").exists() && s("nd/renamed").is_file());
    fs::rename(p("d1/f0"), p("nd/renamed")).unwrap();
    assert_eq!(fs::metadata(s("nd/renamed")).unwrap().len(), 0);
    fs::rename(p("d1/d2"), p("nd/d2")).unwrap();
    assert!(s("nd/d2/d3/deep").is_file());
    fs::hard_link(p("nd/renamed"), p("hl")).unwrap();
    assert_eq!(
        fs::metadata(s("hl")).unwrap().ino(),
        fs::metadata(s("nd/renamed")).unwrap().ino()
    );
    assert_eq!(fs::metadata(p("hl")).unwrap().nlink(), 2);
    std::os::unix::fs::symlink("../elsewhere", p("nd/sl")).unwrap();
    assert_eq!(
        fs::read_link(s("nd/sl")).unwrap(),
        Path::new("../elsewhere")
    );
    let fifo = c(&p("nd/fifo"));
    // SAFETY: a valid path string.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(
        &fs::symlink_metadata(s("nd/fifo")).unwrap().file_type()
    ));
    fs::remove_file(p("hl")).unwrap();
    assert!(!s("hl").exists());
    assert_eq!(errno_of(fs::remove_dir(p("nd"))), libc::ENOTEMPTY);
    fs::remove_dir(p("empty")).unwrap();
    assert!(!s("empty").exists());
    // Modes, times, xattrs.
    fs::set_permissions(p("d1/f1"), fs::Permissions::from_mode(0o604)).unwrap();
    assert_eq!(fs::metadata(s("d1/f1")).unwrap().mode() & 0o7777, 0o604);
    if set_xattr(&s("d1/f2"), "user.probe", b"1").is_ok() {
        set_xattr(&p("d1/f2"), "user.k", b"value").unwrap();
        assert_eq!(
            xattrs(&s("d1/f2")).get(&b"user.k"[..]).map(Vec::as_slice),
            Some(&b"value"[..])
        );
    }
    // Errors as a local filesystem gives them: missing names, wrong types.
    assert_eq!(errno_of(fs::read(p("missing"))), libc::ENOENT);
    assert_eq!(errno_of(fs::remove_dir(p("d1/f1"))), libc::ENOTDIR);
    assert_eq!(errno_of(fs::remove_file(p("d1"))), libc::EISDIR);
    assert_eq!(errno_of(fs::create_dir(p("d1"))), libc::EEXIST);
    assert_eq!(errno_of(fs::read_dir(p("d1/f1"))), libc::ENOTDIR);
    // O_NOFOLLOW opens a file that is not a symlink, for reading and for appending (the daemon
    // reopens the inode it holds, which must not carry the flag), and refuses a symlink.
    let nofollow = || {
        let mut o = fs::OpenOptions::new();
        o.custom_flags(libc::O_NOFOLLOW);
        o
    };
    let mut got = Vec::new();
    std::io::Read::read_to_end(
        &mut nofollow().read(true).open(p("d1/f1")).unwrap(),
        &mut got,
    )
    .unwrap();
    assert_eq!(got, fs::read(s("d1/f1")).unwrap());
    nofollow()
        .append(true)
        .open(p("d1/f1"))
        .unwrap()
        .write_all(b"+nofollow")
        .unwrap();
    assert!(fs::read(s("d1/f1")).unwrap().ends_with(b"+nofollow"));
    assert_eq!(
        errno_of(nofollow().read(true).open(p("nd/sl"))),
        libc::ELOOP
    );
    assert_same_tree(&t.src, &t.mnt);
    m.stop().assert_clean("writable directory export");
}

/// Symlinks are the caller's to follow: the daemon returns them and resolves nothing through
/// them, so a link in the source never lets it reach outside.
#[test]
fn symlinks_are_never_followed_by_the_daemon() {
    if !require_fuse() {
        return;
    }
    let t = Tree::new("dirfs-symlink");
    // Where the daemon would land if it followed `../victim` from the source.
    let victim = t.work.join("a/b/victim");
    fs::create_dir(&victim).unwrap();
    fs::write(victim.join("file"), b"victim\n").unwrap();
    std::os::unix::fs::symlink("../victim", t.src.join("up")).unwrap();
    std::os::unix::fs::symlink("/etc", t.src.join("etc")).unwrap();
    let m = t.mount(&["--writable"]);
    // Through the mount the kernel resolves `../victim` from the mountpoint: there is none.
    assert_eq!(errno_of(fs::read(t.mnt.join("up/file"))), libc::ENOENT);
    assert_eq!(
        errno_of(fs::write(t.mnt.join("up/new"), b"x")),
        libc::ENOENT
    );
    assert!(fs::symlink_metadata(t.mnt.join("up"))
        .unwrap()
        .file_type()
        .is_symlink());
    // An absolute link is the caller's /etc, as on any filesystem.
    assert_eq!(
        fs::read(t.mnt.join("etc/hostname")).ok(),
        fs::read("/etc/hostname").ok()
    );
    // The root's `..` is the mountpoint's parent, never the source's.
    let up: Vec<_> = fs::read_dir(t.mnt.join(".."))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(up.iter().any(|n| n == "mnt") && !up.iter().any(|n| n == "src"));
    // A directory swapped for a symlink while a writer creates files in it: every file lands in
    // the source directory or fails, never in the victim.
    fs::create_dir(t.src.join("dir")).unwrap();
    let (src, stop) = (
        t.src.clone(),
        std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false)),
    );
    let swapper = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let (dir, parked, link) = (src.join("dir"), src.join("parked"), src.join("dir.link"));
            std::os::unix::fs::symlink("../victim", &link).unwrap();
            let mut swaps = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // dir <-> symlink, atomically, back and forth.
                fs::rename(&dir, &parked).unwrap();
                fs::rename(&link, &dir).unwrap();
                fs::rename(&dir, &link).unwrap();
                fs::rename(&parked, &dir).unwrap();
                swaps += 1;
            }
            swaps
        })
    };
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut made = 0;
    let mut i = 0;
    while Instant::now() < deadline {
        if fs::write(t.mnt.join(format!("dir/f{i}")), b"x").is_ok() {
            made += 1;
        }
        let _ = fs::create_dir(t.mnt.join(format!("dir/d{i}")));
        let _ = fs::read_dir(t.mnt.join("dir")).map(|d| d.count());
        i += 1;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let swaps = swapper.join().unwrap();
    assert!(swaps > 0 && i > 0);
    let in_victim: Vec<_> = fs::read_dir(&victim)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        in_victim,
        ["file"],
        "nothing reached the victim ({made} files made)"
    );
    m.stop()
        .assert_clean("directory export under a symlink race");
}

/// Every lookup is balanced by FORGET: after the kernel drops its caches the daemon holds
/// about as many descriptors as before. Three rounds look up more names in all than the
/// daemon may hold descriptors, which only works if forgotten nodes give theirs back.
#[test]
fn lookups_are_forgotten_and_descriptors_come_back() {
    if !require_fuse() {
        return;
    }
    let t = Tree::new("dirfs-forget");
    // SAFETY: `r` is a valid rlimit to fill.
    let limit = unsafe {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        r.rlim_max.min(1 << 20) as usize
    };
    let per_round = (limit / 2).min(10_000);
    let rounds = limit / per_round + 1;
    let dirs = 10;
    for d in 0..dirs {
        let dir = t.src.join(format!("d{d}"));
        fs::create_dir(&dir).unwrap();
        for i in 0..per_round * rounds / dirs + 1 {
            fs::File::create(dir.join(format!("f{i}"))).unwrap();
        }
    }
    let m = t.mount(&[]);
    let fds = || {
        fs::read_dir(format!("/proc/{}/fd", m.pid()))
            .unwrap()
            .count()
    };
    let drop_caches = || fs::write("/proc/sys/vm/drop_caches", b"2").unwrap();
    drop_caches();
    let before = fds();
    let mut seen = 0;
    for round in 0..rounds {
        for k in 0..per_round {
            let n = round * per_round + k;
            fs::metadata(t.mnt.join(format!("d{}/f{}", n % dirs, n / dirs)))
                .unwrap_or_else(|e| panic!("lookup {n}: {e}"));
            seen += 1;
        }
        let held = fds();
        assert!(
            held >= before + per_round / 2,
            "round {round}: the lookups hold descriptors ({before} -> {held})"
        );
        let ok = wait_until(Instant::now() + Duration::from_secs(10), || {
            drop_caches();
            fds() <= before + 64
        });
        assert!(
            ok,
            "{seen} lookups: {before} descriptors before, {} after dropping the caches",
            fds()
        );
    }
    assert!(seen > limit, "{seen} lookups against a limit of {limit}");
    m.stop().assert_clean("directory export after many lookups");
}

/// A tree with more entries than the daemon may hold descriptors (its open-file limit is 1024
/// here), every one kept by the kernel at once (the test holds an `O_PATH` descriptor of each,
/// so other tests dropping the caches cannot make the kernel forget them): nodes beyond the
/// descriptor budget are held by file handle, so every file is found again (`--cache never`:
/// each stat is a LOOKUP of a node held already), read, renamed and its bytes checked, while
/// the daemon's descriptors stay under its limit.
#[test]
fn a_tree_larger_than_the_descriptor_limit_is_served_whole() {
    if !require_fuse_and_tools(&["prlimit"]) {
        return;
    }
    let t = Tree::new("dirfs-handles");
    let (dirs, per_dir) = (4, 1000);
    let name = |d: usize, i: usize| format!("d{d}/f{i}");
    for d in 0..dirs {
        fs::create_dir(t.src.join(format!("d{d}"))).unwrap();
        for i in 0..per_dir {
            fs::write(t.src.join(name(d, i)), format!("{d}/{i}\n")).unwrap();
        }
    }
    let opts = SpawnOpts {
        wrapper: ["prlimit", "--nofile=1024:1024", "--"]
            .map(Into::into)
            .to_vec(),
        ..SpawnOpts::default()
    };
    let m = Mount::try_start_opts(
        &t.work,
        &t.src,
        &t.mnt,
        &["--writable", "--cache", "never"],
        &opts,
    )
    .unwrap_or_else(|f| panic!("mount failed: {}", f.stderr));
    let fds = || {
        fs::read_dir(format!("/proc/{}/fd", m.pid()))
            .unwrap()
            .count()
    };
    let mut pins = Vec::new();
    for pass in 0..2 {
        for d in 0..dirs {
            for i in 0..per_dir {
                let p = t.mnt.join(name(d, i));
                if pass == 0 {
                    let pin = fs::OpenOptions::new()
                        .read(true)
                        .custom_flags(libc::O_PATH)
                        .open(&p)
                        .unwrap_or_else(|e| panic!("{p:?}: {e}"));
                    pins.push(pin);
                }
                let md = fs::metadata(&p).unwrap_or_else(|e| panic!("pass {pass}: {p:?}: {e}"));
                let src = fs::metadata(t.src.join(name(d, i))).unwrap();
                assert_eq!((md.ino(), md.len()), (src.ino(), src.len()), "{p:?}");
            }
        }
        assert!(fds() < 1024, "pass {pass}: {} descriptors", fds());
    }
    // Every node is still held (the kernel caches them all); reads, renames and writes reach
    // those held by handle.
    for d in 0..dirs {
        for i in 0..per_dir {
            let (from, to) = (t.mnt.join(name(d, i)), t.mnt.join(format!("d{d}/g{i}")));
            assert_eq!(fs::read_to_string(&from).unwrap(), format!("{d}/{i}\n"));
            fs::rename(&from, &to).unwrap();
            fs::OpenOptions::new()
                .append(true)
                .open(&to)
                .unwrap()
                .write_all(b"+")
                .unwrap();
        }
    }
    for d in 0..dirs {
        for i in 0..per_dir {
            let got = fs::read_to_string(t.src.join(format!("d{d}/g{i}"))).unwrap();
            assert_eq!(got, format!("{d}/{i}\n+"));
        }
    }
    assert!(fds() < 1024, "{} descriptors", fds());
    m.signal(libc::SIGUSR1);
    let held = wait_until(Instant::now() + Duration::from_secs(10), || {
        m.stderr().contains("nodes held (")
    });
    assert!(held, "no statistics after SIGUSR1:\n{}", m.stderr());
    let line = m
        .stderr()
        .lines()
        .find(|l| l.contains("nodes held ("))
        .unwrap()
        .to_string();
    let nodes: usize = line
        .split(" nodes held")
        .next()
        .and_then(|h| h.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(
        nodes > dirs * per_dir,
        "the kernel holds every file: {line}"
    );
    drop(pins);
    m.stop()
        .assert_clean("directory export of a tree past its descriptor limit");
}

#[test]
fn tar_unpacked_into_the_mount_matches_the_original() {
    if !require_fuse_and_tools(&["tar", "diff"]) {
        return;
    }
    let t = Tree::new("dirfs-tar");
    let orig = t.work.join("orig");
    fs::create_dir(&orig).unwrap();
    populate(&orig);
    fs::remove_file(orig.join("fifo")).unwrap();
    // Owned by someone else, as a tarball from elsewhere would be.
    std::os::unix::fs::lchown(orig.join("d1/f2"), Some(1234), Some(4321)).unwrap();
    let tarball = t.work.join("t.tar");
    run_ok(
        Command::new("tar")
            .arg("--xattrs")
            .arg("-C")
            .arg(&orig)
            .arg("-cf")
            .arg(&tarball)
            .arg("."),
    );
    let m = t.mount(&["--writable"]);
    run_ok(
        Command::new("tar")
            .arg("--xattrs")
            .arg("--same-owner")
            .arg("-p")
            .arg("-C")
            .arg(&t.mnt)
            .arg("-xf")
            .arg(&tarball),
    );
    diff_r(&orig, &t.mnt);
    diff_r(&orig, &t.src);
    let (so, sm) = (snapshot(&orig), snapshot(&t.mnt));
    for (k, e) in &so {
        if k.as_os_str().is_empty() {
            continue; // the root: tar does not own the mountpoint's mode
        }
        let got = &sm[k];
        assert_eq!(
            (e.mode, e.uid, e.gid, e.nlink, &e.target, &e.content),
            (
                got.mode,
                got.uid,
                got.gid,
                got.nlink,
                &got.target,
                &got.content
            ),
            "{}",
            k.display()
        );
        if !e.xattrs.is_empty() {
            assert_eq!(e.xattrs, got.xattrs, "{}", k.display());
        }
    }
    assert_same_tree(&t.src, &t.mnt);
    m.stop().assert_clean("tar into a directory export");
}

#[test]
fn git_clone_into_the_mount_passes_fsck() {
    if !require_fuse_and_tools(&["git"]) {
        return;
    }
    let t = Tree::new("dirfs-git");
    let repo = t.work.join("repo");
    fs::create_dir(&repo).unwrap();
    let git = |dir: &Path, args: &[&str]| {
        run_ok(
            Command::new("git")
                .arg("-C")
                .arg(dir)
                .args([
                    "-c",
                    "user.name=t",
                    "-c",
                    "user.email=t@e",
                    "-c",
                    "init.defaultBranch=main",
                ])
                .args(args),
        )
    };
    git(&repo, &["init", "-q"]);
    let mut rng = Rng::new(9);
    for c in 0..20 {
        for f in 0..10 {
            let p = repo.join(format!("dir{}/file{f}", c % 4));
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            let len = 1 + rng.below(20_000) as usize;
            fs::write(&p, rng.bytes(len)).unwrap();
        }
        git(&repo, &["add", "-A"]);
        git(&repo, &["commit", "-qm", &format!("commit {c}")]);
    }
    let m = t.mount(&["--writable"]);
    let clone = t.mnt.join("clone");
    run_ok(
        Command::new("git")
            .arg("clone")
            .arg("-q")
            .arg("--no-hardlinks")
            .arg(&repo)
            .arg(&clone),
    );
    git(&clone, &["fsck", "--full", "--strict"]);
    diff_r(&repo.join("dir0"), &clone.join("dir0"));
    let log = git(&clone, &["rev-list", "--count", "HEAD"]);
    assert_eq!(String::from_utf8_lossy(&log.stdout).trim(), "20");
    // And the source holds a repository git accepts too.
    git(&t.src.join("clone"), &["fsck", "--full", "--strict"]);
    m.stop().assert_clean("git in a directory export");
}

/// A normal user through `--allow-other`: what it creates is its own (uid, gid, umask, a setgid
/// directory's group), and what the source's modes deny stays denied.
#[test]
fn a_normal_user_gets_what_a_local_filesystem_gives() {
    if !require_fuse_and_tools(&["setpriv"]) {
        return;
    }
    let t = Tree::new("dirfs-user");
    fs::write(t.src.join("secret"), b"root only\n").unwrap();
    fs::set_permissions(t.src.join("secret"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::create_dir(t.src.join("pub")).unwrap();
    fs::set_permissions(t.src.join("pub"), fs::Permissions::from_mode(0o777)).unwrap();
    fs::create_dir(t.src.join("sg")).unwrap();
    std::os::unix::fs::chown(t.src.join("sg"), Some(0), Some(4242)).unwrap();
    fs::set_permissions(t.src.join("sg"), fs::Permissions::from_mode(0o2777)).unwrap();
    fs::create_dir(t.src.join("closed")).unwrap();
    fs::set_permissions(t.src.join("closed"), fs::Permissions::from_mode(0o755)).unwrap();
    let m = t.mount(&["--writable", "--allow-other"]);
    let as_user = |script: &str| {
        run(Command::new("setpriv").args([
            "--reuid=65534",
            "--regid=65533",
            "--clear-groups",
            "sh",
            "-c",
            script,
        ]))
    };
    let mnt = t.mnt.display().to_string();
    let out = as_user(&format!("cat {mnt}/secret"));
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("Permission denied")
    );
    let out = as_user(&format!("touch {mnt}/closed/x"));
    assert!(
        !out.status.success(),
        "a 0755 root directory refuses the user"
    );
    assert!(!t.src.join("closed/x").exists());
    let out = as_user(&format!(
        "umask 027 && echo hi > {mnt}/pub/mine && mkdir {mnt}/pub/dir && touch {mnt}/sg/ingroup && mkdir {mnt}/sg/sub"
    ));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let md = |p: &str| fs::symlink_metadata(t.src.join(p)).unwrap();
    assert_eq!((md("pub/mine").uid(), md("pub/mine").gid()), (65534, 65533));
    assert_eq!(md("pub/mine").mode() & 0o7777, 0o640, "umask 027 applied");
    assert_eq!(
        (md("pub/dir").uid(), md("pub/dir").mode() & 0o7777),
        (65534, 0o750)
    );
    assert_eq!(
        (md("sg/ingroup").uid(), md("sg/ingroup").gid()),
        (65534, 4242),
        "setgid dir's group"
    );
    assert_eq!(md("sg/sub").gid(), 4242);
    assert!(
        md("sg/sub").mode() & libc::S_ISGID != 0,
        "setgid inherited by a directory"
    );
    // The user cannot take root's file.
    let out = as_user(&format!("chmod 666 {mnt}/secret"));
    assert!(!out.status.success());
    assert_eq!(md("secret").mode() & 0o7777, 0o600);
    m.stop().assert_clean("directory export with a normal user");
}

#[test]
fn a_file_is_not_a_source_and_a_mountpoint_must_be_a_directory() {
    if !require_fuse() {
        return;
    }
    let t = Tree::new("dirfs-bad");
    let file = t.work.join("file");
    fs::write(&file, b"").unwrap();
    let f = Mount::try_start(&t.work, &t.src, &file, &[])
        .err()
        .expect("a file as mountpoint");
    assert!(f.stderr.contains("not a directory"), "{}", f.stderr);
    let f = Mount::try_start(&t.work, &t.src, &t.mnt, &["--growable"])
        .err()
        .expect("--growable");
    assert!(
        f.stderr.contains("--growable is for image exports"),
        "{}",
        f.stderr
    );
}

/// Once serving, every thread of a directory export (io_uring workers included) holds only
/// what acting for its callers needs, and the export still works and exits cleanly.
#[test]
fn a_directory_export_drops_the_privileges_it_does_not_need() {
    if !require_fuse() {
        return;
    }
    let keep: u64 = [0u32, 1, 2, 3, 4, 21].iter().fold(0, |k, &c| k | 1 << c);
    let field = |text: &str, key: &str| -> u64 {
        let v = text
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .unwrap_or_else(|| panic!("no {key} in {text}"));
        u64::from_str_radix(v.trim(), 16).unwrap_or_else(|_| v.trim().parse().unwrap())
    };
    let own = field(&fs::read_to_string("/proc/self/status").unwrap(), "CapPrm");
    let t = Tree::new("dirfs-caps");
    fs::create_dir(t.src.join("pub")).unwrap();
    fs::set_permissions(t.src.join("pub"), fs::Permissions::from_mode(0o777)).unwrap();
    let m = t.mount(&["--writable", "--allow-other"]);
    assert!(
        wait_until(Instant::now() + TIMEOUT, || m
            .stderr()
            .contains("INFO privileges: ")),
        "no privilege drop logged:\n{}",
        m.stderr()
    );
    // Make the ring fork a worker or two, then look at every thread.
    for i in 0..50 {
        fs::write(t.mnt.join(format!("pub/f{i}")), vec![7u8; 100_000]).unwrap();
    }
    let mut seen = 0;
    for e in fs::read_dir(format!("/proc/{}/task", m.pid())).unwrap() {
        let Ok(text) = fs::read_to_string(e.unwrap().path().join("status")) else {
            continue;
        };
        for key in ["CapEff", "CapPrm", "CapBnd"] {
            assert_eq!(field(&text, key), keep & own, "{key} of thread:\n{text}");
        }
        assert_eq!((field(&text, "CapInh"), field(&text, "CapAmb")), (0, 0));
        assert_eq!(field(&text, "NoNewPrivs"), 1);
        seen += 1;
    }
    assert!(seen >= 3, "main, signal and queue threads");
    // Still acting for a normal user.
    let out = run(Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "touch"])
        .arg(t.mnt.join("pub/users")));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(fs::metadata(t.src.join("pub/users")).unwrap().uid(), 65534);
    m.stop().assert_clean("directory export without privileges");
}

/// pjdfstest's verdicts (`name -> ok | FAILED | skipped`) from its output.
fn pjdfstest_verdicts(out: &str) -> BTreeMap<String, String> {
    out.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let (name, verdict) = (w.next()?, w.last()?);
            (name.contains("::") && matches!(verdict, "ok" | "FAILED" | "skipped"))
                .then(|| (name.to_string(), verdict.to_string()))
        })
        .collect()
}

/// Tests that pass on the source filesystem and fail through fusex by design, and why (the
/// same list is in docs/dirfs.md).
fn pjdfstest_expected_to_differ(name: &str) -> Option<&'static str> {
    if name.ends_with("::block") || name.ends_with("::char") {
        return Some(
            "device nodes with a device number are not made through a directory export \
             (MKNOD: EPERM)",
        );
    }
    if name == "link::link_count_max" {
        return Some("glibc's pathconf has no LINK_MAX for FUSE filesystems (skipped)");
    }
    None
}

/// pjdfstest (POSIX conformance, run as root, switching to two other users) on the source's
/// filesystem and through a directory export: every test that passes on the first passes
/// through fusex, but those [`pjdfstest_expected_to_differ`] names.
#[test]
fn pjdfstest_passes_through_fusex_what_passes_on_the_source() {
    pjdfstest_through(&["--writable", "--allow-other"], false);
}

/// [`pjdfstest_passes_through_fusex_what_passes_on_the_source`] with writeback caching on
/// (passthrough off): the kernel keeps sizes and times itself and writes them back.
#[test]
fn pjdfstest_passes_with_writeback_caching() {
    pjdfstest_through(
        &[
            "--writable",
            "--allow-other",
            "--passthrough",
            "off",
            "--cache",
            "always",
        ],
        false,
    );
}

/// pjdfstest as a normal user (uid 65534, which owns the directories; the tests that need root
/// skip themselves) on the source's filesystem, and through a directory export that user's own
/// fusex serves (mounted by fusermount3): every test that passes on the first passes through
/// fusex, but those [`pjdfstest_expected_to_differ`] names.
#[test]
fn pjdfstest_as_a_normal_user_passes_through_fusex_what_passes_on_the_source() {
    if !require_fuse_and_tools(&["setpriv", "fusermount3"]) {
        return;
    }
    pjdfstest_through(&["--writable"], true);
}

/// The uid and gid the normal-user runs use, and the wrapper that switches to them.
const NOBODY: u32 = 65534;
const AS_NOBODY: [&str; 4] = [
    "setpriv",
    "--reuid=65534",
    "--regid=65534",
    "--clear-groups",
];

/// pjdfstest on the source's filesystem, then through an export mounted with `args`; as root
/// (switching to two other users), or with `user` all of it, the daemon too, as uid 65534.
fn pjdfstest_through(args: &[&str], user: bool) {
    let local = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/tools/bin/pjdfstest");
    let bin = which("pjdfstest").or_else(|| local.is_file().then_some(local));
    let Some(bin) = bin else {
        skip_or_fail("pjdfstest is not installed (scripts/deps.sh installs it)");
        return;
    };
    if !require_fuse() {
        return;
    }
    let work = WorkDir::new("dirfs-pjdfstest");
    // Short paths: pjdfstest binds unix sockets by path, and sun_path holds 108 bytes.
    let short = tempfile::Builder::new()
        .prefix("fxp")
        .tempdir_in("/tmp")
        .unwrap();
    let (base, src, mnt) = (
        short.path().join("b"),
        short.path().join("s"),
        short.path().join("m"),
    );
    for d in [short.path(), &base, &src, &mnt] {
        fs::create_dir_all(d).unwrap();
        fs::set_permissions(d, fs::Permissions::from_mode(0o755)).unwrap();
    }
    let files = work.join("files");
    fs::create_dir(&files).unwrap();
    if user {
        for d in [&base, &src, &mnt, &files] {
            std::os::unix::fs::lchown(d, Some(NOBODY), Some(NOBODY)).unwrap();
        }
    }
    let cfg = work.join("pjdfstest.toml");
    fs::write(
        &cfg,
        "[features]\nposix_fallocate = {}\nutime_now = {}\nutimensat = {}\nrename_ctime = {}\n\
         [settings]\nnaptime = 0.01\n\
         [dummy_auth]\nentries = [[\"nobody\", \"nogroup\"], [\"daemon\", \"daemon\"]]\n",
    )
    .unwrap();
    let suite = |dir: &Path| {
        let mut cmd = if user {
            // Into the directory as the user: root may not enter another user's mount.
            let mut c = Command::new(AS_NOBODY[0]);
            c.args(&AS_NOBODY[1..])
                .args(["sh", "-c", "cd \"$0\" && exec \"$@\""])
                .arg(dir)
                .arg(&bin);
            c
        } else {
            let mut c = Command::new(&bin);
            c.current_dir(dir);
            c
        };
        let out = run(cmd.arg("-c").arg(&cfg).arg("-p").arg(dir));
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        let v = pjdfstest_verdicts(&text);
        assert!(
            v.len() > 300,
            "pjdfstest ran {} tests in {}:\n{text}",
            v.len(),
            dir.display()
        );
        v
    };
    // The source's own filesystem (the source directory's neighbour), then through fusex.
    let on_source = suite(&base);
    let m = if user {
        let opts = SpawnOpts {
            wrapper: AS_NOBODY.map(Into::into).to_vec(),
            env: Vec::new(),
            files_dir: Some(files),
        };
        Mount::try_start_opts(&work, &src, &mnt, args, &opts)
            .unwrap_or_else(|f| panic!("a normal user's directory export: {}", f.stderr))
    } else {
        Mount::start(&work, &src, &mnt, args)
    };
    if args.contains(&"off") {
        let line = writeback_line(&m);
        if line.contains("did not offer") {
            skip_or_fail("the kernel offers no FUSE writeback cache");
            return;
        }
        assert!(line.contains("writeback cache: on"), "{line}");
    }
    let through = suite(&mnt);
    let mut wrong = Vec::new();
    let mut differ = 0;
    for (name, verdict) in &on_source {
        let got = through.get(name).map_or("missing", String::as_str);
        if verdict != "ok" || got == "ok" {
            continue;
        }
        match pjdfstest_expected_to_differ(name) {
            Some(_) => differ += 1,
            None => wrong.push(format!("{name}: {got} through fusex, ok on the source")),
        }
    }
    assert!(
        wrong.is_empty(),
        "{} tests fail only through fusex:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    eprintln!(
        "pjdfstest: {} tests, {} ok on the source, {} ok through fusex, {differ} differ by design",
        on_source.len(),
        on_source.values().filter(|v| *v == "ok").count(),
        through.values().filter(|v| *v == "ok").count()
    );
    m.stop().assert_clean("pjdfstest on a directory export");
}

/// A small C project built with make inside the mount: the compiler, the linker (mmap of the
/// objects it writes) and make's timestamps all work on a directory export.
#[test]
fn make_builds_a_c_project_inside_the_mount() {
    if !require_fuse_and_tools(&["make", "cc"]) {
        return;
    }
    let t = Tree::new("dirfs-make");
    let m = t.mount(&["--writable"]);
    let p = t.mnt.join("proj");
    fs::create_dir(&p).unwrap();
    fs::write(p.join("sum.h"), "long sum(int n);\n").unwrap();
    fs::write(
        p.join("sum.c"),
        "#include \"sum.h\"\nlong sum(int n) { long s = 0; for (int i = 1; i <= n; i++) s += i; return s; }\n",
    )
    .unwrap();
    fs::write(
        p.join("main.c"),
        "#include <stdio.h>\n#include \"sum.h\"\nint main(void) { printf(\"%ld\\n\", sum(1000)); return 0; }\n",
    )
    .unwrap();
    fs::write(
        p.join("Makefile"),
        "prog: main.o sum.o\n\tcc -o $@ main.o sum.o\n%.o: %.c sum.h\n\tcc -O2 -c -o $@ $<\nclean:\n\trm -f prog *.o\n",
    )
    .unwrap();
    run_ok(Command::new("make").arg("-C").arg(&p).arg("-j2"));
    let out = run_ok(&mut Command::new(p.join("prog")));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "500500\n");
    // Up to date: nothing is rebuilt.
    let again = run_ok(Command::new("make").arg("-C").arg(&p));
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("up to date"),
        "{again:?}"
    );
    // A touched source rebuilds exactly its object and the program.
    std::thread::sleep(Duration::from_millis(20));
    fs::write(p.join("sum.c"), fs::read(p.join("sum.c")).unwrap()).unwrap();
    let re = run_ok(Command::new("make").arg("-C").arg(&p));
    let text = String::from_utf8_lossy(&re.stdout);
    assert!(
        text.contains("sum.o sum.c") && !text.contains("main.o main.c"),
        "{text}"
    );
    // The source holds the same program.
    let out = run_ok(&mut Command::new(t.src.join("proj/prog")));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "500500\n");
    run_ok(Command::new("make").arg("-C").arg(&p).arg("clean"));
    assert!(!t.src.join("proj/prog").exists());
    m.stop().assert_clean("make in a directory export");
}

/// fsx-style: random writes, truncates, extends, punches and reads on a few files through the
/// mount, each checked against a model, and the source against the model at the end.
#[test]
fn random_file_operations_match_a_model() {
    if !require_fuse() {
        return;
    }
    let t = Tree::new("dirfs-fsx");
    let m = t.mount(&["--writable"]);
    random_file_operations(&t, m);
}

/// [`random_file_operations_match_a_model`] with writeback caching (passthrough off): the
/// kernel gathers the writes, reads partial pages back through the handles and keeps the
/// size itself; the model sees no difference.
#[test]
fn random_file_operations_match_a_model_with_writeback_caching() {
    if !require_fuse() {
        return;
    }
    let t = Tree::new("dirfs-fsx-wb");
    let Some(m) = writeback_mount(&t, &[]) else {
        return;
    };
    random_file_operations(&t, m);
}

fn random_file_operations(t: &Tree, m: Mount) {
    use std::os::unix::fs::FileExt;
    let mut rng = Rng::new(0xf5c);
    const FILES: usize = 3;
    const MAX: u64 = 1 << 20;
    let mut model: Vec<Vec<u8>> = vec![Vec::new(); FILES];
    let files: Vec<fs::File> = (0..FILES)
        .map(|i| {
            fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(t.mnt.join(format!("fsx{i}")))
                .unwrap()
        })
        .collect();
    for step in 0..3000 {
        let i = rng.below(FILES as u64) as usize;
        let (f, mdl) = (&files[i], &mut model[i]);
        let what = rng.below(10);
        let off = rng.below(MAX);
        let len = 1 + rng.below(70_000);
        let ctx = format!("step {step}, file {i}, op {what}, off {off}, len {len}");
        match what {
            0..=3 => {
                let data = rng.bytes(len as usize);
                f.write_all_at(&data, off).unwrap();
                let end = (off + len) as usize;
                if mdl.len() < end {
                    mdl.resize(end, 0);
                }
                mdl[off as usize..end].copy_from_slice(&data);
            }
            4 => {
                let size = rng.below(MAX);
                f.set_len(size).unwrap();
                mdl.resize(size as usize, 0);
            }
            5 => {
                // Punch a hole inside the file (zeroes, same size).
                let end = (off + len).min(mdl.len() as u64);
                if off < end {
                    fallocate(
                        f,
                        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                        off,
                        end - off,
                    )
                    .unwrap();
                    mdl[off as usize..end as usize].fill(0);
                }
            }
            6 => {
                f.sync_data().unwrap();
            }
            _ => {
                let got = pread_full(f, off, len as usize).unwrap();
                let want = mdl
                    .get(off as usize..)
                    .map_or(&[][..], |t| &t[..t.len().min(len as usize)]);
                assert_bytes_eq(&got, want, off, &ctx);
            }
        }
        assert_eq!(f.metadata().unwrap().len(), mdl.len() as u64, "{ctx}: size");
    }
    drop(files);
    for (i, mdl) in model.iter().enumerate() {
        assert_bytes_eq(
            &fs::read(t.src.join(format!("fsx{i}"))).unwrap(),
            mdl,
            0,
            "source",
        );
        assert_bytes_eq(
            &fs::read(t.mnt.join(format!("fsx{i}"))).unwrap(),
            mdl,
            0,
            "mount",
        );
    }
    m.stop()
        .assert_clean("random operations on a directory export");
}

/// One operation of [`random_namespace_operations_match_a_model`], on paths relative to a root.
#[derive(Clone)]
enum NsOp {
    Mkdir(String),
    Rmdir(String),
    /// `O_CREAT | O_EXCL`, then the bytes written.
    Create(String, Vec<u8>),
    /// `O_WRONLY | O_NOFOLLOW`, the bytes written at the offset.
    Write(String, u64, Vec<u8>),
    Unlink(String),
    /// `renameat2` with its flags.
    Rename(String, String, u32),
    /// `linkat` without following a final symlink.
    Link(String, String),
    /// A symlink with this target at the path.
    Symlink(String, String),
    /// `truncate(2)` (follows a final symlink).
    Truncate(String, u64),
}

impl std::fmt::Debug for NsOp {
    /// The operation with its paths, and the length of the bytes it writes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NsOp::Mkdir(a) => write!(f, "mkdir {a}"),
            NsOp::Rmdir(a) => write!(f, "rmdir {a}"),
            NsOp::Create(a, d) => write!(f, "create {a} ({} bytes)", d.len()),
            NsOp::Write(a, off, d) => write!(f, "write {a} at {off} ({} bytes)", d.len()),
            NsOp::Unlink(a) => write!(f, "unlink {a}"),
            NsOp::Rename(a, b, flags) => write!(f, "rename {a} {b} (flags {flags})"),
            NsOp::Link(a, b) => write!(f, "link {a} {b}"),
            NsOp::Symlink(t, a) => write!(f, "symlink {t} {a}"),
            NsOp::Truncate(a, len) => write!(f, "truncate {a} {len}"),
        }
    }
}

impl NsOp {
    fn name(&self) -> &'static str {
        match self {
            NsOp::Mkdir(_) => "Mkdir",
            NsOp::Rmdir(_) => "Rmdir",
            NsOp::Create(..) => "Create",
            NsOp::Write(..) => "Write",
            NsOp::Unlink(_) => "Unlink",
            NsOp::Rename(..) => "Rename",
            NsOp::Link(..) => "Link",
            NsOp::Symlink(..) => "Symlink",
            NsOp::Truncate(..) => "Truncate",
        }
    }
}

/// Runs `op` below `root`: Ok or the errno.
fn ns_apply(root: &Path, op: &NsOp) -> Result<(), i32> {
    use std::os::unix::fs::FileExt;
    let p = |s: &str| root.join(s);
    let ret = |r: libc::c_int| {
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(-1))
        }
    };
    let io = |r: std::io::Result<()>| r.map_err(|e| e.raw_os_error().unwrap_or(-1));
    match op {
        NsOp::Mkdir(a) => io(fs::create_dir(p(a))),
        NsOp::Rmdir(a) => io(fs::remove_dir(p(a))),
        NsOp::Create(a, data) => io(fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(p(a))
            .and_then(|f| f.write_all_at(data, 0))),
        NsOp::Write(a, off, data) => io(fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(p(a))
            .and_then(|f| f.write_all_at(data, *off))),
        NsOp::Unlink(a) => io(fs::remove_file(p(a))),
        NsOp::Rename(a, b, flags) => {
            let (ca, cb) = (c(&p(a)), c(&p(b)));
            // SAFETY: valid path strings.
            ret(unsafe {
                libc::renameat2(
                    libc::AT_FDCWD,
                    ca.as_ptr(),
                    libc::AT_FDCWD,
                    cb.as_ptr(),
                    *flags,
                )
            })
        }
        NsOp::Link(a, b) => {
            let (ca, cb) = (c(&p(a)), c(&p(b)));
            // SAFETY: valid path strings.
            ret(unsafe {
                libc::linkat(libc::AT_FDCWD, ca.as_ptr(), libc::AT_FDCWD, cb.as_ptr(), 0)
            })
        }
        NsOp::Symlink(target, a) => io(std::os::unix::fs::symlink(target, p(a))),
        NsOp::Truncate(a, len) => {
            let ca = c(&p(a));
            // SAFETY: a valid path string.
            ret(unsafe { libc::truncate(ca.as_ptr(), *len as libc::off_t) })
        }
    }
}

/// An entry of the namespace model: a directory, or an inode (file or symlink) that hard links
/// share.
#[derive(Clone, Copy, Debug, PartialEq)]
enum NsNode {
    Dir,
    Ino(usize),
}

/// What an inode of the model holds.
#[derive(Clone, Debug)]
enum NsData {
    File(Vec<u8>),
    Symlink(String),
}

/// The tree a local filesystem would have after the operations so far, and what each operation
/// should answer. Symlink targets never name an entry of the tree, so every symlink dangles: a
/// path through one ends in ENOENT.
#[derive(Default)]
struct NsModel {
    tree: BTreeMap<String, NsNode>,
    inodes: Vec<NsData>,
}

/// `p` is strictly below `dir`.
fn ns_below(p: &str, dir: &str) -> bool {
    p.len() > dir.len() && p.starts_with(dir) && p.as_bytes()[dir.len()] == b'/'
}

impl NsModel {
    fn kind(&self, p: &str) -> Option<NsNode> {
        self.tree.get(p).copied()
    }

    fn is_symlink(&self, n: NsNode) -> bool {
        matches!(n, NsNode::Ino(i) if matches!(self.inodes[i], NsData::Symlink(_)))
    }

    /// The errno resolving the directories leading to `p` gives, if any.
    fn parent_err(&self, p: &str) -> Option<i32> {
        let mut at = 0;
        while let Some(i) = p[at..].find('/') {
            let prefix = &p[..at + i];
            match self.kind(prefix) {
                None => return Some(libc::ENOENT),
                Some(NsNode::Dir) => {}
                Some(n) if self.is_symlink(n) => return Some(libc::ENOENT),
                Some(_) => return Some(libc::ENOTDIR),
            }
            at += i + 1;
        }
        None
    }

    fn has_children(&self, dir: &str) -> bool {
        self.tree.keys().any(|k| ns_below(k, dir))
    }

    /// `p` and everything below it.
    fn subtree(&self, p: &str) -> Vec<(String, NsNode)> {
        self.tree
            .iter()
            .filter(|(k, _)| *k == p || ns_below(k, p))
            .map(|(k, v)| (k.clone(), *v))
            .collect()
    }

    fn file(&mut self, n: NsNode) -> &mut Vec<u8> {
        match n {
            NsNode::Ino(i) => match &mut self.inodes[i] {
                NsData::File(d) => d,
                NsData::Symlink(_) => unreachable!("a symlink"),
            },
            NsNode::Dir => unreachable!("a directory"),
        }
    }

    /// What `op` answers on a local filesystem; the model is changed as it would be.
    fn apply(&mut self, op: &NsOp) -> Result<(), i32> {
        use libc::{EEXIST, EINVAL, EISDIR, ELOOP, ENOENT, ENOTDIR, ENOTEMPTY, EPERM};
        let parent = |m: &NsModel, p: &str| m.parent_err(p).map_or(Ok(()), Err);
        match op {
            NsOp::Mkdir(a) | NsOp::Symlink(_, a) | NsOp::Create(a, _) => {
                parent(self, a)?;
                if self.kind(a).is_some() {
                    return Err(EEXIST);
                }
                let node = match op {
                    NsOp::Mkdir(_) => NsNode::Dir,
                    NsOp::Symlink(t, _) => {
                        self.inodes.push(NsData::Symlink(t.clone()));
                        NsNode::Ino(self.inodes.len() - 1)
                    }
                    NsOp::Create(_, data) => {
                        self.inodes.push(NsData::File(data.clone()));
                        NsNode::Ino(self.inodes.len() - 1)
                    }
                    _ => unreachable!(),
                };
                self.tree.insert(a.clone(), node);
            }
            NsOp::Rmdir(a) => {
                parent(self, a)?;
                match self.kind(a) {
                    None => return Err(ENOENT),
                    Some(NsNode::Ino(_)) => return Err(ENOTDIR),
                    Some(NsNode::Dir) if self.has_children(a) => return Err(ENOTEMPTY),
                    Some(NsNode::Dir) => {
                        self.tree.remove(a);
                    }
                }
            }
            NsOp::Unlink(a) => {
                parent(self, a)?;
                match self.kind(a) {
                    None => return Err(ENOENT),
                    Some(NsNode::Dir) => return Err(EISDIR),
                    Some(_) => {
                        self.tree.remove(a);
                    }
                }
            }
            NsOp::Write(a, off, data) => {
                parent(self, a)?;
                let n = self.kind(a).ok_or(ENOENT)?;
                if n == NsNode::Dir {
                    return Err(EISDIR);
                }
                if self.is_symlink(n) {
                    return Err(ELOOP);
                }
                let f = self.file(n);
                let end = *off as usize + data.len();
                if f.len() < end {
                    f.resize(end, 0);
                }
                f[*off as usize..end].copy_from_slice(data);
            }
            NsOp::Truncate(a, len) => {
                parent(self, a)?;
                let n = self.kind(a).ok_or(ENOENT)?;
                if n == NsNode::Dir {
                    return Err(EISDIR);
                }
                if self.is_symlink(n) {
                    return Err(ENOENT); // followed: it dangles
                }
                self.file(n).resize(*len as usize, 0);
            }
            NsOp::Link(a, b) => {
                parent(self, a)?;
                let n = self.kind(a).ok_or(ENOENT)?;
                parent(self, b)?;
                if self.kind(b).is_some() {
                    return Err(EEXIST);
                }
                if n == NsNode::Dir {
                    return Err(EPERM);
                }
                self.tree.insert(b.clone(), n);
            }
            NsOp::Rename(a, b, flags) => {
                let exchange = flags & libc::RENAME_EXCHANGE != 0;
                parent(self, a)?;
                parent(self, b)?;
                let na = self.kind(a).ok_or(ENOENT)?;
                let nb = self.kind(b);
                if flags & libc::RENAME_NOREPLACE != 0 && nb.is_some() {
                    return Err(EEXIST);
                }
                if exchange && nb.is_none() {
                    return Err(ENOENT);
                }
                if ns_below(b, a) {
                    return Err(EINVAL);
                }
                if ns_below(a, b) {
                    return Err(if exchange { EINVAL } else { ENOTEMPTY });
                }
                if Some(na) == nb && (a == b || na != NsNode::Dir) {
                    return Ok(()); // one inode: nothing to do
                }
                let (from, to) = (self.subtree(a), self.subtree(b));
                if !exchange {
                    if let Some(nb) = nb {
                        match (na == NsNode::Dir, nb == NsNode::Dir) {
                            (true, false) => return Err(ENOTDIR),
                            (false, true) => return Err(EISDIR),
                            (true, true) if to.len() > 1 => return Err(ENOTEMPTY),
                            _ => {}
                        }
                    }
                }
                for (k, _) in from.iter().chain(&to) {
                    self.tree.remove(k);
                }
                let moved = |list: &[(String, NsNode)], old: &str, new: &str| {
                    list.iter()
                        .map(|(k, v)| (format!("{new}{}", &k[old.len()..]), *v))
                        .collect::<Vec<_>>()
                };
                self.tree.extend(moved(&from, a, b));
                if exchange {
                    self.tree.extend(moved(&to, b, a));
                }
            }
        }
        Ok(())
    }

    /// The model as [`ns_snapshot`] shows a tree.
    fn snapshot(&self) -> BTreeMap<String, NsSeen> {
        let mut group: BTreeMap<usize, (&str, u64)> = BTreeMap::new();
        for (k, v) in &self.tree {
            if let NsNode::Ino(i) = v {
                group.entry(*i).or_insert((k, 0)).1 += 1;
            }
        }
        self.tree
            .iter()
            .map(|(k, v)| {
                let seen = match *v {
                    NsNode::Dir => NsSeen::default(),
                    NsNode::Ino(i) => {
                        let (first, nlink) = group[&i];
                        let (kind, data) = match &self.inodes[i] {
                            NsData::File(d) => ('f', d.clone()),
                            NsData::Symlink(t) => ('l', t.clone().into_bytes()),
                        };
                        NsSeen {
                            kind,
                            data,
                            first: first.to_string(),
                            nlink,
                        }
                    }
                };
                (k.clone(), seen)
            })
            .collect()
    }
}

/// An entry of a tree as [`ns_snapshot`] records it: its kind (`d`, `f`, `l`), a file's bytes or
/// a symlink's target, and for files and symlinks the first path (in order) of its inode and
/// its link count.
#[derive(Clone, Debug, PartialEq)]
struct NsSeen {
    kind: char,
    data: Vec<u8>,
    first: String,
    nlink: u64,
}

impl Default for NsSeen {
    fn default() -> Self {
        NsSeen {
            kind: 'd',
            data: Vec::new(),
            first: String::new(),
            nlink: 0,
        }
    }
}

/// Every entry below `root` by relative path, and each one's inode number.
fn ns_snapshot(root: &Path) -> (BTreeMap<String, NsSeen>, BTreeMap<String, u64>) {
    let mut out = BTreeMap::new();
    let mut inos = BTreeMap::new();
    let mut stack = vec![String::new()];
    while let Some(dir) = stack.pop() {
        for e in fs::read_dir(root.join(&dir)).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            let rel = if dir.is_empty() {
                name
            } else {
                format!("{dir}/{name}")
            };
            let p = root.join(&rel);
            let m =
                fs::symlink_metadata(&p).unwrap_or_else(|e| panic!("lstat {}: {e}", p.display()));
            let ft = m.file_type();
            let seen = if ft.is_dir() {
                stack.push(rel.clone());
                NsSeen::default()
            } else if ft.is_symlink() {
                NsSeen {
                    kind: 'l',
                    data: fs::read_link(&p).unwrap().as_os_str().as_bytes().to_vec(),
                    first: String::new(),
                    nlink: m.nlink(),
                }
            } else {
                NsSeen {
                    kind: 'f',
                    data: fs::read(&p).unwrap(),
                    first: String::new(),
                    nlink: m.nlink(),
                }
            };
            inos.insert(rel.clone(), m.ino());
            out.insert(rel, seen);
        }
    }
    let mut first: BTreeMap<u64, String> = BTreeMap::new();
    for (k, s) in out.iter_mut() {
        if s.kind != 'd' {
            s.first = first.entry(inos[k]).or_insert_with(|| k.clone()).clone();
        }
    }
    (out, inos)
}

/// A namespace fsx: a few thousand seeded random mkdir, rmdir, create, write, unlink, rename
/// (plain over files and directories, `RENAME_NOREPLACE`, `RENAME_EXCHANGE`), link, symlink and
/// truncate through the mount, the same on a plain directory of the source's filesystem, each
/// answering as a model of a local filesystem says (success, or ENOENT, EEXIST, ENOTEMPTY,
/// EISDIR, ENOTDIR, EINVAL, ELOOP, EPERM); every 100 operations the mount and the source
/// show exactly the model's tree (names, kinds, contents, symlink targets, which names share
/// an inode and its link count), with the source's inode numbers through the mount.
#[test]
fn random_namespace_operations_match_a_model() {
    if !require_fuse() {
        return;
    }
    let t = Tree::new("dirfs-nsfsx");
    let native = t.work.join("native");
    fs::create_dir(&native).unwrap();
    let m = t.mount(&["--writable"]);
    let mut rng = Rng::new(0x5eed);
    let mut model = NsModel::default();
    const NAMES: [&str; 4] = ["a", "b", "c", "d"];
    const OPS: usize = 5000;
    let mut counts: BTreeMap<(&str, i32), usize> = BTreeMap::new();
    let mut history = Vec::new();
    let errno_name = |r: &Result<(), i32>| match r {
        Ok(()) => "ok".to_string(),
        Err(e) => errno_str(*e),
    };
    // A path: below an existing directory most of the time, else below any entry (a file:
    // ENOTDIR) or a made-up path (ENOENT); at most 4 deep.
    let fresh = |rng: &mut Rng, model: &NsModel| -> String {
        let entries: Vec<(&String, &NsNode)> = model.tree.iter().collect();
        let dirs: Vec<&String> = entries
            .iter()
            .filter(|(k, v)| **v == NsNode::Dir && k.matches('/').count() < 3)
            .map(|(k, _)| *k)
            .collect();
        let name = NAMES[rng.below(NAMES.len() as u64) as usize];
        let parent = match rng.below(10) {
            0..=5 if !dirs.is_empty() => dirs[rng.below(dirs.len() as u64) as usize].clone(),
            6 if !entries.is_empty() => entries[rng.below(entries.len() as u64) as usize].0.clone(),
            7 => NAMES[rng.below(4) as usize].to_string(),
            _ => String::new(),
        };
        if parent.is_empty() || parent.matches('/').count() >= 3 {
            name.to_string()
        } else {
            format!("{parent}/{name}")
        }
    };
    // An existing entry most of the time, else a fresh path.
    let existing = |rng: &mut Rng, model: &NsModel| -> String {
        if model.tree.is_empty() || rng.below(10) >= 7 {
            return fresh(rng, model);
        }
        let i = rng.below(model.tree.len() as u64) as usize;
        model.tree.keys().nth(i).unwrap().clone()
    };
    for step in 0..OPS {
        let op = match rng.below(20) {
            0..=2 => NsOp::Mkdir(fresh(&mut rng, &model)),
            3 => NsOp::Rmdir(existing(&mut rng, &model)),
            4..=5 => {
                let len = rng.below(3000) as usize;
                NsOp::Create(fresh(&mut rng, &model), rng.bytes(len))
            }
            6..=7 => {
                let (off, len) = (rng.below(8000), 1 + rng.below(3000) as usize);
                NsOp::Write(existing(&mut rng, &model), off, rng.bytes(len))
            }
            8..=9 => NsOp::Unlink(existing(&mut rng, &model)),
            10..=14 => {
                let a = existing(&mut rng, &model);
                let b = if rng.below(2) == 0 {
                    existing(&mut rng, &model)
                } else {
                    fresh(&mut rng, &model)
                };
                let flags = match rng.below(4) {
                    0 => libc::RENAME_NOREPLACE,
                    1 => libc::RENAME_EXCHANGE,
                    _ => 0,
                };
                NsOp::Rename(a, b, flags)
            }
            15..=16 => NsOp::Link(existing(&mut rng, &model), fresh(&mut rng, &model)),
            17 => NsOp::Symlink(format!("zz{}", rng.below(1000)), fresh(&mut rng, &model)),
            _ => NsOp::Truncate(existing(&mut rng, &model), rng.below(10_000)),
        };
        let want = model.apply(&op);
        let on_native = ns_apply(&native, &op);
        let through = ns_apply(&t.mnt, &op);
        history.push(format!("{step}: {op:?}: {}", errno_name(&want)));
        let recent = || history[history.len().saturating_sub(30)..].join("\n");
        assert_eq!(
            on_native,
            want,
            "step {step}: {op:?} natively: {} (the model says {}); the last operations:\n{}",
            errno_name(&on_native),
            errno_name(&want),
            recent()
        );
        assert_eq!(
            through,
            want,
            "step {step}: {op:?} through the mount: {}, as the model and natively: {}; the last \
             operations:\n{}",
            errno_name(&through),
            errno_name(&want),
            recent()
        );
        *counts
            .entry((op.name(), want.err().unwrap_or(0)))
            .or_default() += 1;
        if step % 100 == 99 || step == OPS - 1 {
            let want = model.snapshot();
            let (mnt, mnt_inos) = ns_snapshot(&t.mnt);
            let (src, src_inos) = ns_snapshot(&t.src);
            for (what, got) in [("mount", &mnt), ("source", &src)] {
                let names: Vec<_> = got.keys().collect();
                assert_eq!(
                    names,
                    want.keys().collect::<Vec<_>>(),
                    "step {step}: names in the {what}"
                );
                for (k, w) in &want {
                    assert_eq!(&got[k], w, "step {step}: {k} in the {what}");
                }
            }
            assert_eq!(
                mnt_inos, src_inos,
                "step {step}: inode numbers through the mount"
            );
        }
    }
    eprintln!("namespace fsx: (operation, errno) -> count: {counts:?}");
    // The seed reaches every kind of answer the model knows.
    for e in [
        0,
        libc::ENOENT,
        libc::EEXIST,
        libc::ENOTEMPTY,
        libc::EISDIR,
        libc::ENOTDIR,
        libc::EINVAL,
    ] {
        assert!(
            counts.keys().any(|&(_, got)| got == e),
            "no operation answered {}",
            errno_str(e)
        );
    }
    for op in [
        "Mkdir", "Rmdir", "Create", "Write", "Unlink", "Rename", "Link", "Symlink", "Truncate",
    ] {
        assert!(
            counts.get(&(op, 0)).is_some_and(|&n| n > 10),
            "{op} succeeded at most 10 times: {counts:?}"
        );
    }
    m.stop()
        .assert_clean("random namespace operations on a directory export");
}

/// Renames from several threads at once (plain, no-replace, exchange, across directories): no
/// file is lost or duplicated, and the mount and the source agree at the end.
#[test]
fn renames_from_several_threads_lose_nothing() {
    if !require_fuse() {
        return;
    }
    let t = Tree::new("dirfs-renames");
    const FILES: usize = 40;
    for d in 0..4 {
        fs::create_dir(t.src.join(format!("d{d}"))).unwrap();
    }
    for i in 0..FILES {
        fs::write(
            t.src.join(format!("d{}/n{i}", i % 4)),
            format!("file {i}\n"),
        )
        .unwrap();
    }
    let m = t.mount(&["--writable"]);
    let threads: Vec<_> = (0..4u64)
        .map(|th| {
            let mnt = t.mnt.clone();
            std::thread::spawn(move || {
                let mut rng = Rng::new(100 + th);
                let mut done = 0;
                for _ in 0..1500 {
                    let a = mnt.join(format!("d{}/n{}", rng.below(4), rng.below(FILES as u64)));
                    let b = mnt.join(format!("d{}/n{}", rng.below(4), rng.below(FILES as u64)));
                    let (ca, cb) = (c(&a), c(&b));
                    let flags = match rng.below(3) {
                        0 => 0,
                        1 => libc::RENAME_NOREPLACE,
                        _ => libc::RENAME_EXCHANGE,
                    };
                    // SAFETY: valid path strings.
                    let r = unsafe {
                        libc::renameat2(
                            libc::AT_FDCWD,
                            ca.as_ptr(),
                            libc::AT_FDCWD,
                            cb.as_ptr(),
                            flags,
                        )
                    };
                    if r == 0 {
                        done += 1;
                    } else {
                        let e = std::io::Error::last_os_error().raw_os_error().unwrap();
                        assert!(
                            matches!(e, libc::ENOENT | libc::EEXIST),
                            "rename: errno {e}"
                        );
                    }
                }
                done
            })
        })
        .collect();
    let done: u64 = threads.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(done > 0);
    // Plain renames over an existing name drop that file; so count what is left by content and
    // check no content appears twice and the mount matches the source.
    let mut seen = BTreeMap::new();
    for d in 0..4 {
        for e in fs::read_dir(t.mnt.join(format!("d{d}"))).unwrap() {
            let content = fs::read(e.unwrap().path()).unwrap();
            *seen.entry(content).or_insert(0) += 1;
        }
    }
    assert!(
        seen.values().all(|&n| n == 1),
        "a file appears twice: {seen:?}"
    );
    assert!(!seen.is_empty());
    assert_same_tree(&t.src, &t.mnt);
    m.stop().assert_clean("renames from several threads");
}

/// With passthrough the kernel serves open files' data from the source itself: the bytes are
/// right both ways, mmap works, and no READ or WRITE reaches fusex; with it off they all do.
#[test]
fn passthrough_hands_file_data_to_the_kernel() {
    if !require_fuse() {
        return;
    }
    for on in [true, false] {
        let t = Tree::new("dirfs-passthrough");
        let mut rng = Rng::new(77);
        let orig = rng.bytes(3 << 20);
        fs::write(t.src.join("big"), &orig).unwrap();
        let mode = if on { "on" } else { "off" };
        let m = match Mount::try_start(
            &t.work,
            &t.src,
            &t.mnt,
            &["--writable", "--passthrough", mode],
        ) {
            Ok(m) => m,
            Err(f) if on && f.stderr.contains("did not offer FUSE_PASSTHROUGH") => {
                skip_or_fail("the kernel has no FUSE passthrough");
                return;
            }
            Err(f) => panic!("mount --passthrough {mode}: {}", f.stderr),
        };
        assert_eq!(fs::read(t.mnt.join("big")).unwrap(), orig);
        let data = rng.bytes(1 << 20);
        fs::write(t.mnt.join("new"), &data).unwrap();
        assert_eq!(fs::read(t.src.join("new")).unwrap(), data);
        {
            use std::os::unix::fs::FileExt;
            let f = fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(t.mnt.join("big"))
                .unwrap();
            f.write_all_at(b"patched", 4096).unwrap();
            let mut got = vec![0u8; 7];
            f.read_exact_at(&mut got, 4096).unwrap();
            assert_eq!(got, b"patched");
        }
        assert_eq!(
            &fs::read(t.src.join("big")).unwrap()[4096..4103],
            b"patched"
        );
        {
            // Several opens of one file at once (the kernel takes one backing file per inode).
            use std::os::unix::fs::FileExt;
            let r = fs::File::open(t.mnt.join("big")).unwrap();
            let w = fs::OpenOptions::new()
                .write(true)
                .open(t.mnt.join("big"))
                .unwrap();
            let r2 = fs::File::open(t.mnt.join("hard-to-miss")).err();
            assert!(r2.is_some());
            w.write_all_at(b"again", 0).unwrap();
            let mut got = vec![0u8; 5];
            r.read_exact_at(&mut got, 0).unwrap();
            assert_eq!(got, b"again");
        }
        let stopped = m.stop();
        stopped.assert_clean("passthrough directory export");
        let (reads, writes) = (
            stopped.stat(&["ops", "READ"]),
            stopped.stat(&["ops", "WRITE"]),
        );
        if on {
            assert_eq!(
                (reads, writes),
                (0, 0),
                "passthrough: no data through fusex"
            );
        } else {
            assert!(
                reads > 0 && writes > 0,
                "without passthrough fusex serves the data"
            );
        }
    }
}

/// `--cache never`: a change made in the source directly shows through the mount at once;
/// `--cache always`: attributes the kernel has seen are kept (the source is meant to change only
/// through the mount). `--cache` with an image is refused.
#[test]
fn cache_modes_decide_what_the_kernel_remembers() {
    if !require_fuse() {
        return;
    }
    for mode in ["never", "always"] {
        let t = Tree::new("dirfs-cache");
        fs::write(t.src.join("f"), b"1234").unwrap();
        let m = t.mount(&["--cache", mode, "--passthrough", "off"]);
        assert_eq!(fs::metadata(t.mnt.join("f")).unwrap().len(), 4);
        assert_eq!(fs::read(t.mnt.join("f")).unwrap(), b"1234");
        fs::write(t.src.join("f"), b"123456789").unwrap();
        fs::write(t.src.join("g"), b"new").unwrap();
        let len = fs::metadata(t.mnt.join("f")).unwrap().len();
        match mode {
            "never" => {
                assert_eq!(len, 9, "--cache never: the new size at once");
                assert_eq!(fs::read(t.mnt.join("f")).unwrap(), b"123456789");
            }
            _ => assert_eq!(len, 4, "--cache always: the size the kernel saw"),
        }
        // A new name is found either way (nothing negative is cached).
        assert_eq!(fs::read(t.mnt.join("g")).unwrap(), b"new");
        m.stop().assert_clean("directory export with --cache");
    }
    let t = Tree::new("dirfs-cache-image");
    let image = t.work.join("img");
    fs::write(&image, vec![0u8; 1 << 20]).unwrap();
    let f = Mount::try_start(&t.work, &image, &t.work.join("mp"), &["--cache", "never"])
        .err()
        .expect("--cache with an image");
    assert!(
        f.stderr.contains("--cache is for directory exports"),
        "{}",
        f.stderr
    );
}

/// `--cache always`: the kernel keeps a directory's listing and lists it again without a READDIR
/// to fusex, and a name made or removed through the mount shows in the next listing; under
/// `--cache auto` every listing asks fusex again.
#[test]
fn cache_always_keeps_listings_until_the_mount_changes_them() {
    if !require_fuse() {
        return;
    }
    let names = |p: &Path| -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(p)
            .unwrap_or_else(|e| panic!("listing {}: {e}", p.display()))
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    // A fresh tree of 300 names (more than one reply holds), listed `times` times through a
    // fresh mount; `then` runs on it before the stop. The READDIR and READDIRPLUS fusex served.
    let listings = |mode: &str, times: usize, then: &dyn Fn(&Path, &Path)| -> u64 {
        let t = Tree::new("dirfs-listings");
        fs::create_dir(t.src.join("d")).unwrap();
        for i in 0..300 {
            fs::write(t.src.join(format!("d/file-{i:04}")), b"").unwrap();
        }
        let m = t.mount(&["--writable", "--cache", mode]);
        let (d, src) = (t.mnt.join("d"), t.src.join("d"));
        for round in 0..times {
            assert_eq!(names(&d), names(&src), "{mode}: listing {round}");
        }
        then(&d, &src);
        let st = m.stop();
        st.assert_clean("directory export listed again and again");
        st.stat(&["ops", "READDIR"]) + st.stat(&["ops", "READDIRPLUS"])
    };
    let nothing = |_: &Path, _: &Path| {};
    let once = listings("always", 1, &nothing);
    assert!(once > 0, "the first listing reached fusex");
    assert_eq!(
        listings("always", 5, &nothing),
        once,
        "--cache always: four more listings of the same directory asked fusex nothing more"
    );
    let auto = listings("auto", 5, &nothing);
    assert!(
        auto >= 5 * once,
        "--cache auto: each listing asks ({auto} requests for 5, {once} for 1)"
    );
    listings("always", 2, &|d, src| {
        fs::write(d.join("made-through-the-mount"), b"x").unwrap();
        let after = names(d);
        assert!(
            after.contains(&"made-through-the-mount".to_string()),
            "a new name is listed"
        );
        assert_eq!(after, names(src));
        fs::remove_file(d.join("file-0000")).unwrap();
        fs::rename(d.join("file-0001"), d.join("renamed")).unwrap();
        let after = names(d);
        assert!(
            !after.contains(&"file-0000".to_string()),
            "a removed name is not listed"
        );
        assert!(
            after.contains(&"renamed".to_string()),
            "a renamed one is, by its new name"
        );
        assert_eq!(after, names(src));
    });
}

/// The names of a process's threads.
fn thread_names(pid: i32) -> Vec<String> {
    fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .collect()
}

/// A tree walk through the export reads the source ahead on a `fusex-ahead` thread, unless
/// `--no-read-ahead`; `du` gives the same answer either way. `--no-read-ahead` with an image is
/// refused.
#[test]
fn no_read_ahead_walks_only_as_asked() {
    if !require_fuse() {
        return;
    }
    let du = |p: &Path| {
        let out = run(Command::new("du")
            .args(["-s", "--apparent-size", "-B1"])
            .arg(p));
        assert!(out.status.success(), "du {}: {out:?}", p.display());
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string()
    };
    for ahead in [false, true] {
        let t = Tree::new("dirfs-ahead");
        for d in 0..4 {
            for s in 0..3 {
                let dir = t.src.join(format!("d{d}/s{s}"));
                fs::create_dir_all(&dir).unwrap();
                for f in 0..20 {
                    fs::write(dir.join(format!("f{f}")), vec![b'x'; 100 * (f + 1)]).unwrap();
                }
            }
        }
        let args: &[&str] = if ahead { &[] } else { &["--no-read-ahead"] };
        let m = t.mount(args);
        assert_eq!(
            du(&t.mnt),
            du(&t.src),
            "du through the mount, read-ahead {ahead}"
        );
        let walkers = |pid| {
            thread_names(pid)
                .iter()
                .filter(|n| n.as_str() == "fusex-ahead")
                .count()
        };
        if ahead {
            // The thread starts at the first hand-over and stays; the walk may still be going.
            let deadline = Instant::now() + Duration::from_secs(10);
            while walkers(m.pid()) == 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            assert!(walkers(m.pid()) > 0, "no read-ahead thread after a du");
        } else {
            assert_eq!(
                walkers(m.pid()),
                0,
                "--no-read-ahead started a read-ahead thread"
            );
        }
        m.stop()
            .assert_clean(&format!("directory export, read-ahead {ahead}"));
    }
    let t = Tree::new("dirfs-ahead-image");
    let image = t.work.join("img");
    fs::write(&image, vec![0u8; 1 << 20]).unwrap();
    let f = Mount::try_start(&t.work, &image, &t.work.join("mp"), &["--no-read-ahead"])
        .err()
        .expect("--no-read-ahead with an image");
    assert!(
        f.stderr
            .contains("--no-read-ahead is for directory exports"),
        "{}",
        f.stderr
    );
}

/// A normal user's own fusex (mounting through fusermount3) serves a directory of its own:
/// files made through the mount are the user's, and passthrough, which it may not register, is
/// not asked for: fusex serves the data, with the writeback cache.
#[test]
fn a_normal_user_serves_a_directory_of_its_own() {
    if !require_fuse_and_tools(&["setpriv", "fusermount3"]) {
        return;
    }
    let t = Tree::new("dirfs-own");
    let files = t.work.join("files");
    fs::create_dir(&files).unwrap();
    fs::write(t.src.join("f"), b"mine\n").unwrap();
    for p in [&t.src, &t.src.join("f"), &t.mnt, &files] {
        std::os::unix::fs::lchown(p, Some(65534), Some(65534)).unwrap();
    }
    let opts = SpawnOpts {
        wrapper: [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
        ]
        .map(Into::into)
        .to_vec(),
        env: Vec::new(),
        files_dir: Some(files),
    };
    let m = Mount::try_start_opts(&t.work, &t.src, &t.mnt, &["--writable"], &opts)
        .unwrap_or_else(|f| panic!("a normal user's directory export: {}", f.stderr));
    let user = |script: &str| {
        run(Command::new("setpriv").args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "sh",
            "-c",
            script,
        ]))
    };
    let mnt = t.mnt.display();
    let out = user(&format!(
        "cat {mnt}/f && echo new > {mnt}/g && mkdir {mnt}/d && cat {mnt}/g"
    ));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "mine\nnew\n");
    for p in ["g", "d"] {
        let md = fs::metadata(t.src.join(p)).unwrap();
        assert_eq!((md.uid(), md.gid()), (65534, 65534), "{p}");
    }
    // Root is not let in without --allow-other.
    assert_eq!(errno_of(fs::read(t.mnt.join("f"))), libc::EACCES);
    let stopped = m.stop();
    stopped.assert_clean("a normal user's directory export");
    // It may not register backing files, so `--passthrough auto` does not ask for passthrough,
    // and fusex serves the data (without the writeback cache: `--cache auto`).
    assert!(
        stopped
            .stderr
            .contains("passthrough: off (registering backing files needs CAP_SYS_ADMIN"),
        "{}",
        stopped.stderr
    );
    assert!(
        stopped
            .stderr
            .contains("writeback cache: off (--cache auto"),
        "{}",
        stopped.stderr
    );
    assert!(stopped.stat(&["ops", "READ"]) > 0, "fusex served the data");
}

/// `O_TMPFILE`: an unnamed file, the caller's, that a link then names (as an atomic file
/// creation would use it).
#[test]
fn tmpfile_makes_an_unnamed_file_that_link_names() {
    if !require_fuse() {
        return;
    }
    use std::io::{Read, Seek};
    use std::os::fd::FromRawFd;
    let t = Tree::new("dirfs-tmpfile");
    let m = t.mount(&["--writable"]);
    let dir = c(&t.mnt);
    // SAFETY: a valid path string; the result is checked.
    let fd = unsafe { libc::open(dir.as_ptr(), libc::O_TMPFILE | libc::O_RDWR, 0o640) };
    assert!(fd >= 0, "O_TMPFILE: {}", std::io::Error::last_os_error());
    // SAFETY: a descriptor just opened, owned here.
    let mut f = unsafe { fs::File::from_raw_fd(fd) };
    f.write_all(b"unnamed").unwrap();
    assert_eq!(fs::read_dir(&t.src).unwrap().count(), 0, "no name yet");
    let proc_path = c(Path::new(&format!("/proc/self/fd/{fd}")));
    let named = c(&t.mnt.join("named"));
    // SAFETY: valid path strings.
    let r = unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            proc_path.as_ptr(),
            libc::AT_FDCWD,
            named.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    };
    assert_eq!(r, 0, "linkat: {}", std::io::Error::last_os_error());
    f.rewind().unwrap();
    let mut back = String::new();
    f.read_to_string(&mut back).unwrap();
    assert_eq!(back, "unnamed");
    drop(f);
    assert_eq!(fs::read(t.src.join("named")).unwrap(), b"unnamed");
    assert_eq!(
        fs::metadata(t.src.join("named")).unwrap().mode() & 0o7777,
        0o640
    );
    m.stop().assert_clean("O_TMPFILE on a directory export");
}

/// `--daemonize --pid-file`: the parent returns once the directory is served, the pid file names
/// the daemon, and a stop removes both the mount and the pid file.
#[test]
fn a_daemonized_directory_export_keeps_its_pid_file() {
    if !require_fuse() {
        return;
    }
    let t = Tree::new("dirfs-daemon");
    fs::write(t.src.join("f"), b"x").unwrap();
    let pid_file = t.work.join("pid");
    let (m, mounted) = Mount::start_daemonized(&t.work, &t.src, &t.mnt, &pid_file, &[])
        .unwrap_or_else(|f| panic!("--daemonize: {}", f.stderr));
    assert!(mounted, "mounted when the parent returned");
    let pid: i32 = fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(pid, m.pid());
    // Published before the parent returned: `fusex list` shows it serving at once.
    assert_listed_serving(&t.mnt, pid);
    assert_eq!(fs::read(t.mnt.join("f")).unwrap(), b"x");
    m.stop().assert_clean("daemonized directory export");
    assert!(!pid_file.exists(), "pid file removed at exit");
}

/// The line the daemon logs at start about writeback caching.
fn writeback_line(m: &Mount) -> String {
    m.stderr()
        .lines()
        .find(|l| l.contains("writeback cache: "))
        .unwrap_or_default()
        .to_string()
}

/// A writable export with passthrough off and writeback caching on, or None (skipped) where the
/// kernel does not offer writeback caching.
fn writeback_mount(t: &Tree, extra: &[&str]) -> Option<Mount> {
    let mut args = vec!["--writable", "--passthrough", "off", "--cache", "always"];
    args.extend_from_slice(extra);
    let m = t.mount(&args);
    let line = writeback_line(&m);
    if line.contains("did not offer") {
        skip_or_fail("the kernel offers no FUSE writeback cache");
        return None;
    }
    assert!(
        line.contains("writeback cache: on"),
        "{line}\n{}",
        m.stderr()
    );
    Some(m)
}

/// Lets the kernel's (coarse) clock move on before a file's last write: the kernel writes a
/// file's times back only when a write changed them, and writes within the tick of the file's
/// last time change (its creation, a truncate) leave them as they were, while the source
/// stamps its own mtime on the WRITE (docs/dirfs.md, writeback caching).
fn next_tick() {
    std::thread::sleep(Duration::from_millis(20));
}

/// `(size, mtime s, mtime ns)` of `p`.
fn size_and_mtime(p: &Path) -> (u64, i64, i64) {
    let md = fs::metadata(p).unwrap();
    (md.len(), md.mtime(), md.mtime_nsec())
}

/// With writeback caching (writable, passthrough off, `--cache auto` and `always`) every kind of
/// write lands in the source: small sequential writes, appends from two descriptors, partial-page
/// overwrites through a write-only descriptor (the kernel reads the rest of each page through
/// it), writes after a truncate, and writes through a shared mapping, checked against the source
/// after fsync, msync or close; after close the mount shows the size and mtime the source has. A
/// normal user writes into a file it may only write (mode 0200) and still cannot read it, and its
/// write into a set-uid file clears the bit. The kernel gathers the small writes: far fewer WRITE
/// requests reach fusex than writes were made.
#[test]
fn writeback_caching_lands_every_write_in_the_source() {
    if !require_fuse_and_tools(&["setpriv"]) {
        return;
    }
    use std::os::unix::fs::FileExt;
    {
        let t = Tree::new("dirfs-writeback");
        let mut rng = Rng::new(0x3b);
        let pp = rng.bytes(3 * 4096 + 100);
        fs::write(t.src.join("pp"), &pp).unwrap();
        fs::write(t.src.join("log"), b"start\n").unwrap();
        fs::write(t.src.join("tr"), rng.bytes(10_000)).unwrap();
        fs::write(t.src.join("mm"), rng.bytes(3 * 4096)).unwrap();
        fs::write(t.src.join("wo"), b"0123456789").unwrap();
        std::os::unix::fs::chown(t.src.join("wo"), Some(65534), Some(65534)).unwrap();
        fs::set_permissions(t.src.join("wo"), fs::Permissions::from_mode(0o200)).unwrap();
        fs::write(t.src.join("suid"), b"#!/bin/sh\n").unwrap();
        fs::set_permissions(t.src.join("suid"), fs::Permissions::from_mode(0o4777)).unwrap();
        let Some(m) = writeback_mount(&t, &["--allow-other"]) else {
            return;
        };
        let mut writes = 0u64;

        // Small sequential writes, visible in the source after fsync (file still open).
        let mut small = Vec::new();
        {
            let mut f = fs::File::create(t.mnt.join("small")).unwrap();
            for i in 0..2000u32 {
                if i == 1999 {
                    next_tick();
                }
                let rec = format!("{i:09}\n");
                f.write_all(rec.as_bytes()).unwrap();
                small.extend_from_slice(rec.as_bytes());
                writes += 1;
            }
            f.sync_all().unwrap();
            assert_bytes_eq(
                &fs::read(t.src.join("small")).unwrap(),
                &small,
                0,
                "small after fsync",
            );
        }
        assert_bytes_eq(
            &fs::read(t.src.join("small")).unwrap(),
            &small,
            0,
            "small after close",
        );

        // Appends from two descriptors (O_WRONLY | O_APPEND): the kernel puts each at its end.
        let mut log = b"start\n".to_vec();
        {
            let open = || {
                fs::OpenOptions::new()
                    .append(true)
                    .open(t.mnt.join("log"))
                    .unwrap()
            };
            let (mut a, mut b) = (open(), open());
            for i in 0..200 {
                if i == 199 {
                    next_tick();
                }
                let (f, line) = if i % 2 == 0 {
                    (&mut a, format!("a{i}\n"))
                } else {
                    (&mut b, format!("b{i}\n"))
                };
                f.write_all(line.as_bytes()).unwrap();
                log.extend_from_slice(line.as_bytes());
                writes += 1;
            }
        }
        assert_bytes_eq(&fs::read(t.src.join("log")).unwrap(), &log, 0, "appends");

        // Partial-page overwrites through a write-only descriptor, one extending the file.
        let mut model = pp.clone();
        {
            let f = fs::OpenOptions::new()
                .write(true)
                .open(t.mnt.join("pp"))
                .unwrap();
            for off in [5u64, 4090, 8192 + 17, pp.len() as u64 - 50] {
                next_tick();
                let data = rng.bytes(100);
                f.write_all_at(&data, off).unwrap();
                let end = off as usize + data.len();
                if model.len() < end {
                    model.resize(end, 0);
                }
                model[off as usize..end].copy_from_slice(&data);
                writes += 1;
            }
        }
        assert_bytes_eq(
            &fs::read(t.src.join("pp")).unwrap(),
            &model,
            0,
            "partial pages",
        );

        // Truncate, then write past the new end (a hole between) and inside it.
        let mut tr = fs::read(t.src.join("tr")).unwrap();
        {
            let f = fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(t.mnt.join("tr"))
                .unwrap();
            f.set_len(3000).unwrap();
            tr.truncate(3000);
            f.write_all_at(b"after the hole", 5000).unwrap();
            tr.resize(5000, 0);
            tr.extend_from_slice(b"after the hole");
            next_tick();
            f.write_all_at(b"inside", 100).unwrap();
            tr[100..106].copy_from_slice(b"inside");
            writes += 2;
            assert_eq!(f.metadata().unwrap().len(), tr.len() as u64);
        }
        assert_bytes_eq(
            &fs::read(t.src.join("tr")).unwrap(),
            &tr,
            0,
            "truncate then write",
        );

        // A shared mapping: msync'd bytes are in the source before close, the rest after.
        let mut mm = fs::read(t.src.join("mm")).unwrap();
        {
            let f = fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(t.mnt.join("mm"))
                .unwrap();
            let len = mm.len();
            // SAFETY: a fresh shared mapping of the whole file, unmapped below.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    f.as_raw_fd(),
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            // SAFETY: the mapping is `len` bytes long and lives until munmap.
            let map = unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), len) };
            map[10..20].copy_from_slice(b"mmap-msync");
            mm[10..20].copy_from_slice(b"mmap-msync");
            // SAFETY: the mapping above.
            assert_eq!(unsafe { libc::msync(p, len, libc::MS_SYNC) }, 0);
            assert_bytes_eq(
                &fs::read(t.src.join("mm")).unwrap(),
                &mm,
                0,
                "mmap after msync",
            );
            next_tick();
            map[5000..5011].copy_from_slice(b"mmap-unsync");
            mm[5000..5011].copy_from_slice(b"mmap-unsync");
            // SAFETY: the mapping above, not used afterwards.
            assert_eq!(unsafe { libc::munmap(p, len) }, 0);
        }
        assert_bytes_eq(
            &fs::read(t.src.join("mm")).unwrap(),
            &mm,
            0,
            "mmap after close",
        );

        // A normal user writes part of a page of a file it may write but not read.
        let mnt = t.mnt.display().to_string();
        let out = run(Command::new("setpriv").args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "sh",
            "-c",
            &format!("printf abc | dd of={mnt}/wo bs=1 seek=3 conv=notrunc status=none"),
        ]));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        writes += 1;
        let out = run(Command::new("setpriv").args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "cat",
            &format!("{mnt}/wo"),
        ]));
        assert!(
            !out.status.success(),
            "a 0200 file is not readable by its owner"
        );
        assert_eq!(fs::read(t.src.join("wo")).unwrap(), b"012abc6789");
        // Its write into root's set-uid file clears the bit (the kernel's SETATTR, at write).
        let out = run(Command::new("setpriv").args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "sh",
            "-c",
            &format!("echo exit >> {mnt}/suid"),
        ]));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        writes += 1;
        assert_eq!(
            fs::metadata(t.src.join("suid")).unwrap().mode() & 0o7777,
            0o777,
            "set-uid cleared by a write of a user without CAP_FSETID"
        );
        assert_eq!(fs::read(t.src.join("suid")).unwrap(), b"#!/bin/sh\nexit\n");

        // After close the mount shows what the source has.
        for name in ["small", "log", "pp", "tr", "mm", "wo", "suid"] {
            assert_eq!(
                size_and_mtime(&t.mnt.join(name)),
                size_and_mtime(&t.src.join(name)),
                "{name}: size and mtime through the mount and in the source"
            );
        }
        let stopped = m.stop();
        stopped.assert_clean("writeback caching");
        let requests = stopped.stat(&["ops", "WRITE"]);
        assert!(
            requests > 0 && requests * 4 < writes,
            "{requests} WRITE requests for {writes} writes: the kernel gathers them"
        );
    }
}

/// Writeback caching is asked for only where it can serve: not with `--cache never` (direct
/// I/O, the source's state at once), not on a read-only export, and not where passthrough is
/// granted (the kernel serves file data from the source itself, and refuses both together).
#[test]
fn writeback_caching_is_off_where_it_cannot_serve() {
    if !require_fuse() {
        return;
    }
    for (args, why) in [
        (
            &["--writable", "--passthrough", "off", "--cache", "never"][..],
            "writeback cache: off (--cache never)",
        ),
        (
            &["--writable", "--passthrough", "off"][..],
            "writeback cache: off (--cache auto shows changes made to the source directly",
        ),
        (
            &["--passthrough", "off"][..],
            "writeback cache: off (a read-only export)",
        ),
    ] {
        let t = Tree::new("dirfs-writeback-off");
        let m = t.mount(args);
        assert!(writeback_line(&m).contains(why), "{args:?}: {}", m.stderr());
        m.stop().assert_clean("writeback off");
    }
    let t = Tree::new("dirfs-writeback-pt");
    match Mount::try_start(
        &t.work,
        &t.src,
        &t.mnt,
        &["--writable", "--passthrough", "on"],
    ) {
        Ok(m) => {
            assert!(
                writeback_line(&m).contains("writeback cache: off (passthrough serves file data"),
                "{}",
                m.stderr()
            );
            // Data goes through the kernel's passthrough: nothing to write back.
            fs::write(t.mnt.join("f"), b"passed through").unwrap();
            assert_eq!(fs::read(t.src.join("f")).unwrap(), b"passed through");
            let stopped = m.stop();
            stopped.assert_clean("passthrough without writeback");
            assert_eq!(stopped.stat(&["ops", "WRITE"]), 0);
        }
        Err(f) if f.stderr.contains("did not offer FUSE_PASSTHROUGH") => {
            skip_or_fail("the kernel has no FUSE passthrough");
        }
        Err(f) => panic!("mount --passthrough on: {}", f.stderr),
    }
}

/// With the writeback cache, a stop by signal while a file is still open and holds pages the
/// kernel has not written back: the daemon has them written back (`syncfs` of the mount) before
/// it detaches the mount, so they reach the source while the file is still open (the kernel
/// would otherwise keep them for its 30 s dirty expiry, and lose them when the connection is
/// aborted).
#[test]
fn a_stop_writes_back_what_files_still_open_hold() {
    if !require_fuse() {
        return;
    }
    let t = Tree::new("dirfs-writeback-stop");
    let Some(m) = writeback_mount(&t, &[]) else {
        return;
    };
    let mut rng = Rng::new(0x5709);
    let data = rng.bytes(300 << 10);
    let mut f = fs::File::create(t.mnt.join("open")).unwrap();
    for chunk in data.chunks(4096) {
        f.write_all(chunk).unwrap();
    }
    m.signal(libc::SIGTERM);
    let src = t.src.join("open");
    let landed = wait_until(Instant::now() + Duration::from_secs(5), || {
        fs::read(&src).is_ok_and(|b| b == data)
    });
    drop(f);
    let stopped = m.wait_exit();
    assert!(
        landed,
        "the open file's pages did not reach the source: {}",
        stopped.stderr
    );
    assert!(stopped.exited, "{}", stopped.stderr);
    assert!(!stopped.left_mounted, "{}", stopped.stderr);
}
