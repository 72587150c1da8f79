//! What users of an image export expect (DESIGN.md §4 "Semantics users expect"):
//! read-only exports, fixed size vs growable, holes, durability, the null backend.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;

use fusex_e2e::*;

#[track_caller]
fn assert_errno_in(r: std::io::Result<impl std::fmt::Debug>, allowed: &[i32], what: &str) {
    match r {
        Ok(v) => panic!(
            "{what}: expected failure with one of {:?}, got Ok({v:?})",
            allowed.iter().map(|&e| errno_str(e)).collect::<Vec<_>>()
        ),
        Err(e) => assert!(
            allowed.contains(&errno(&e)),
            "{what}: expected one of {:?}, got {e} ({})",
            allowed.iter().map(|&e| errno_str(e)).collect::<Vec<_>>(),
            errno_str(errno(&e))
        ),
    }
}

fn sizes(mount: &Path, img: &Path) -> (u64, u64) {
    (
        stat(mount).expect("stat mount").0,
        stat(img).expect("stat image").0,
    )
}

#[test]
fn read_only_export_rejects_writes() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("sem-ro");
    let img = w.join("disk.img");
    let size = 4 * MIB;
    let model = random_image(&img, size, 41);
    let m = Mount::start(&w, &img, &w.join("export"), &[]);
    let mp = m.path().to_path_buf();

    assert_errno_in(
        OpenOptions::new().read(true).write(true).open(&mp),
        &[libc::EROFS, libc::EACCES],
        "open(O_RDWR) of a read-only export",
    );
    assert_errno_in(
        OpenOptions::new().write(true).open(&mp),
        &[libc::EROFS, libc::EACCES],
        "open(O_WRONLY) of a read-only export",
    );
    // truncate(2) by path goes through SETATTR.
    let cpath = std::ffi::CString::new(mp.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: valid NUL-terminated path.
    let r = unsafe { libc::truncate(cpath.as_ptr(), MIB as libc::off_t) };
    let e = std::io::Error::last_os_error();
    assert!(r != 0, "truncate() of a read-only export succeeded");
    assert!(
        [libc::EROFS, libc::EACCES, libc::EPERM].contains(&errno(&e)),
        "truncate() of a read-only export: unexpected error {e}"
    );

    let f = m.open_ro();
    assert_eq!(fstat(&f).0, size, "st_size");
    assert_bytes_eq(
        &pread_full(&f, 0, size as usize).unwrap(),
        &model,
        0,
        "read-only export content",
    );
    let mut rng = Rng::new(42);
    for _ in 0..50 {
        let off = rng.below(size);
        let len = 1 + rng.below(200 * KIB) as usize;
        let got = pread_full(&f, off, len).unwrap();
        let end = (off as usize + len).min(size as usize);
        assert_bytes_eq(&got, &model[off as usize..end], off, "random read");
    }
    drop(f);
    let st = m.stop();
    st.assert_clean("read-only export");
    assert_eq!(stat(&img).unwrap().0, size, "backing size changed");
    assert_bytes_eq(&read_all(&img), &model, 0, "backing file must be unchanged");
    assert_eq!(st.stat(&["ops", "WRITE"]), 0, "stats: {}", st.stats());
    assert_eq!(st.stat(&["backend", "writes"]), 0, "stats: {}", st.stats());
    assert_eq!(
        st.stat(&["backend", "bytes_written"]),
        0,
        "stats: {}",
        st.stats()
    );
}

/// Every way of changing a file fails on a read-only export, with the errno the kernel gives for
/// a file that cannot be opened for writing, before anything reaches fusex: opening for writing,
/// `truncate` and `utimensat` by path are EROFS (read-only mount); on a read-only descriptor
/// `write`/`pwrite` and `fallocate` (mode 0, punch hole, zero range) are EBADF, `ftruncate` is
/// EINVAL, a writable shared mapping EACCES and `copy_file_range` into it EBADF. After each, the
/// image file's bytes are the same.
fn read_only_refusals(w: &WorkDir, img: &Path, args: &[&str], what: &str) {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let before = read_all(img);
    let mtime = std::fs::metadata(img).unwrap().mtime();
    let m = Mount::start(w, img, &w.join("export"), args);
    let mp = m.path().to_path_buf();
    let size = stat(&mp).unwrap().0;
    let unchanged = |op: &str| {
        assert_bytes_eq(
            &read_all(img),
            &before,
            0,
            &format!("{what}: image after {op}"),
        );
    };
    let last = || std::io::Error::last_os_error();
    let expect = |r: std::io::Result<()>, want: i32, op: &str| {
        match r {
            Ok(()) => panic!("{what}: {op} succeeded on a read-only export"),
            Err(e) => assert_eq!(
                errno(&e),
                want,
                "{what}: {op}: expected {}, got {e}",
                errno_str(want)
            ),
        }
        unchanged(op);
    };
    let ok_or = |r: libc::c_int| if r == 0 { Ok(()) } else { Err(last()) };

    for (flags, op) in [
        (libc::O_RDWR, "open(O_RDWR)"),
        (libc::O_WRONLY | libc::O_TRUNC, "open(O_WRONLY|O_TRUNC)"),
        (libc::O_WRONLY | libc::O_APPEND, "open(O_WRONLY|O_APPEND)"),
    ] {
        use std::os::unix::fs::OpenOptionsExt;
        let r = OpenOptions::new()
            .read(flags & libc::O_ACCMODE == libc::O_RDWR)
            .write(true)
            .custom_flags(flags & !libc::O_ACCMODE)
            .open(&mp)
            .map(drop);
        expect(r, libc::EROFS, op);
    }
    let cpath = std::ffi::CString::new(mp.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: valid NUL-terminated path.
    let r = ok_or(unsafe { libc::truncate(cpath.as_ptr(), 0) });
    expect(r, libc::EROFS, "truncate(path, 0)");
    let times = [libc::timespec {
        tv_sec: 1_000_000_000,
        tv_nsec: 0,
    }; 2];
    // SAFETY: valid NUL-terminated path and two timespecs living across the call.
    let r = ok_or(unsafe { libc::utimensat(libc::AT_FDCWD, cpath.as_ptr(), times.as_ptr(), 0) });
    expect(r, libc::EROFS, "utimensat(path)");

    let f = m.open_ro();
    expect(f.write_at(b"x", 0).map(drop), libc::EBADF, "pwrite");
    expect((&f).write(b"x").map(drop), libc::EBADF, "write");
    expect(f.set_len(0), libc::EINVAL, "ftruncate(0)");
    expect(
        f.set_len(size + 4096),
        libc::EINVAL,
        "ftruncate(size + 4096)",
    );
    for (mode, op) in [
        (0, "fallocate(mode 0)"),
        (libc::FALLOC_FL_KEEP_SIZE, "fallocate(KEEP_SIZE)"),
        (
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            "fallocate(PUNCH_HOLE)",
        ),
        (libc::FALLOC_FL_ZERO_RANGE, "fallocate(ZERO_RANGE)"),
        (
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
            "fallocate(ZERO_RANGE|KEEP_SIZE)",
        ),
    ] {
        expect(fallocate(&f, mode, 4096, 64 * KIB), libc::EBADF, op);
        expect(fallocate(&f, mode, size, 64 * KIB), libc::EBADF, op);
    }
    // SAFETY: mmap of a valid fd; a mapping that succeeds is unmapped right away.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    let r = if p == libc::MAP_FAILED {
        Err(last())
    } else {
        // SAFETY: `p` is the 4096-byte mapping just made.
        unsafe { libc::munmap(p, 4096) };
        Ok(())
    };
    expect(r, libc::EACCES, "mmap(PROT_WRITE, MAP_SHARED)");
    let src_path = w.join("copy-src");
    std::fs::write(&src_path, vec![0x5a; 8192]).unwrap();
    let src = std::fs::File::open(&src_path).unwrap();
    let (mut off_in, mut off_out) = (0i64, 0i64);
    // SAFETY: valid fds and offsets living across the call.
    let n = unsafe {
        libc::copy_file_range(
            src.as_raw_fd(),
            &mut off_in,
            f.as_raw_fd(),
            &mut off_out,
            8192,
            0,
        )
    };
    let r = if n < 0 { Err(last()) } else { Ok(()) };
    expect(r, libc::EBADF, "copy_file_range into the export");
    drop(f);

    let st = m.stop();
    st.assert_clean(what);
    for op in ["WRITE", "FALLOCATE", "SETATTR"] {
        assert_eq!(
            st.stat(&["ops", op]),
            0,
            "{what}: {op} reached fusex: {}",
            st.stats()
        );
    }
    assert_eq!(st.stat(&["backend", "writes"]), 0, "{what}: {}", st.stats());
    unchanged("the export ended");
    assert_eq!(
        std::fs::metadata(img).unwrap().mtime(),
        mtime,
        "{what}: the image's mtime changed"
    );
}

#[test]
fn read_only_export_refuses_write_truncate_fallocate() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("sem-ro-refuse");
    let img = w.join("disk.img");
    random_image(&img, 4 * MIB, 45);
    // Passthrough where the kernel has it (the default), and every request through fusex.
    read_only_refusals(&w, &img, &[], "raw");
    read_only_refusals(&w, &img, &["--passthrough", "off"], "raw, passthrough off");
}

#[test]
fn read_only_qcow2_export_refuses_write_truncate_fallocate() {
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    let w = WorkDir::new("sem-ro-refuse-q");
    let raw = w.join("disk.raw");
    random_image(&raw, 4 * MIB, 46);
    let img = w.join("disk.qcow2");
    run_ok(
        std::process::Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "qcow2"])
            .arg(&raw)
            .arg(&img),
    );
    read_only_refusals(&w, &img, &[], "qcow2");
}

#[test]
fn fixed_size_export_stops_at_eof() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("sem-eof");
    let img = w.join("disk.img");
    let size = MIB;
    let mut model = random_image(&img, size, 51);
    let m = Mount::start(&w, &img, &w.join("export"), &["--writable"]);
    let f = m.open_rw();
    let mut buf = vec![0u8; 8192];

    // Reads: 0 at and past EOF, short across it (one syscall each, not a loop).
    assert_eq!(
        f.read_at(&mut buf[..4096], size).expect("read at EOF"),
        0,
        "read at EOF"
    );
    assert_eq!(
        f.read_at(&mut buf[..4096], size + 4096)
            .expect("read past EOF"),
        0,
        "read past EOF"
    );
    let n = f.read_at(&mut buf, size - 100).expect("read across EOF");
    assert_eq!(n, 100, "read across EOF must be short");
    assert_bytes_eq(
        &buf[..100],
        &model[size as usize - 100..],
        size - 100,
        "tail read",
    );

    // Writes: short across EOF, ENOSPC (or EFBIG) when nothing fits.
    let data = Rng::new(52).bytes(8192);
    let n = f.write_at(&data, size - 4096).expect("write across EOF");
    assert_eq!(n, 4096, "write across EOF must write what fits");
    model[size as usize - 4096..].copy_from_slice(&data[..4096]);
    assert_errno_in(
        f.write_at(&data[..4096], size),
        &[libc::ENOSPC, libc::EFBIG],
        "write at EOF",
    );
    assert_errno_in(
        f.write_at(&data[..10], 2 * MIB),
        &[libc::ENOSPC, libc::EFBIG],
        "write past EOF",
    );

    // Size changes are refused, including open(O_TRUNC) (e.g. `dd of=EXPORT` without
    // conv=notrunc) which must not wipe the image.
    assert!(
        OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(m.path())
            .is_err(),
        "open(O_TRUNC) of a fixed-size export succeeded"
    );
    assert_eq!(fstat(&f).0, size, "size after a refused O_TRUNC");
    assert!(
        f.set_len(2 * MIB).is_err(),
        "ftruncate(grow) on a fixed-size export succeeded"
    );
    assert!(
        f.set_len(MIB / 2).is_err(),
        "ftruncate(shrink) on a fixed-size export succeeded"
    );
    assert!(
        fallocate(&f, 0, size, 64 * KIB).is_err(),
        "fallocate(mode 0) past EOF on a fixed-size export succeeded"
    );

    f.sync_all().expect("fsync");
    assert_eq!(fstat(&f).0, size, "fstat size of the export");
    assert_eq!(
        sizes(m.path(), &img),
        (size, size),
        "(mount, backing) sizes"
    );
    assert_bytes_eq(&read_all(&img), &model, 0, "backing after EOF writes");
    drop(f);
    m.stop().assert_clean("fixed size");
    assert_eq!(stat(&img).unwrap().0, size);
}

#[test]
fn growable_export_grows_and_truncates() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("sem-grow");
    let img = w.join("disk.img");
    let size = MIB;
    let model = random_image(&img, size, 61);
    let m = Mount::start(&w, &img, &w.join("export"), &["--writable", "--growable"]);
    let f = m.open_rw();

    // A write past EOF grows both the export and the image; the gap reads as zeroes.
    let data = Rng::new(62).bytes(5000);
    f.write_all_at(&data, size + 1000)
        .expect("write past EOF on a growable export");
    let grown = size + 6000;
    assert_eq!(fstat(&f).0, grown, "fstat size after growing write");
    f.sync_all().expect("fsync");
    assert_eq!(
        sizes(m.path(), &img),
        (grown, grown),
        "(mount, backing) sizes after growing write"
    );
    let backing = read_all(&img);
    assert_bytes_eq(&backing[..size as usize], &model, 0, "old content");
    assert!(
        backing[size as usize..size as usize + 1000]
            .iter()
            .all(|&b| b == 0),
        "gap must be zeroes"
    );
    assert_bytes_eq(
        &backing[size as usize + 1000..],
        &data,
        size + 1000,
        "grown data in backing",
    );
    assert_bytes_eq(
        &pread_full(&f, size, 6000).unwrap(),
        &backing[size as usize..],
        size,
        "grown part through the mount",
    );

    // ftruncate grows and shrinks.
    f.set_len(3 * MIB)
        .expect("ftruncate(3 MiB) on a growable export");
    assert_eq!(fstat(&f).0, 3 * MIB, "fstat after ftruncate grow");
    assert_eq!(
        sizes(m.path(), &img),
        (3 * MIB, 3 * MIB),
        "(mount, backing) after ftruncate grow"
    );
    assert!(
        pread_full(&f, grown, (3 * MIB - grown) as usize)
            .unwrap()
            .iter()
            .all(|&b| b == 0),
        "extended part must read zeroes"
    );
    f.set_len(MIB / 2)
        .expect("ftruncate(512 KiB) on a growable export");
    assert_eq!(fstat(&f).0, MIB / 2, "fstat after ftruncate shrink");
    assert_eq!(
        sizes(m.path(), &img),
        (MIB / 2, MIB / 2),
        "(mount, backing) after ftruncate shrink"
    );
    assert_eq!(
        pread_full(&f, 0, MIB as usize).unwrap().len() as u64,
        MIB / 2,
        "reads stop at the new EOF"
    );

    // fallocate mode 0 past EOF grows (DESIGN §4).
    fallocate(&f, 0, MIB / 2, 64 * KIB).expect("fallocate(mode 0) past EOF on a growable export");
    let after = MIB / 2 + 64 * KIB;
    assert_eq!(fstat(&f).0, after, "fstat after fallocate grow");
    assert_eq!(
        sizes(m.path(), &img),
        (after, after),
        "(mount, backing) after fallocate grow"
    );

    assert_bytes_eq(
        &read_all(&img)[..MIB as usize / 2],
        &model[..MIB as usize / 2],
        0,
        "kept prefix",
    );
    drop(f);
    m.stop().assert_clean("growable");
}

/// `--growable` without `--writable`: the contract says growable "needs --writable to
/// write", so either the export is read-only, or the invocation is rejected with the
/// usual one-line error. Never writable.
#[test]
fn growable_without_writable_is_never_writable() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("sem-grow-ro");
    let img = w.join("disk.img");
    let model = random_image(&img, MIB, 63);
    let mp = w.join("export");
    match Mount::try_start(&w, &img, &mp, &["--growable"]) {
        Ok(m) => {
            assert_errno_in(
                OpenOptions::new().read(true).write(true).open(m.path()),
                &[libc::EROFS, libc::EACCES],
                "open(O_RDWR) of --growable without --writable",
            );
            m.stop().assert_clean("growable read-only");
        }
        Err(f) => {
            let r = CmdResult {
                code: f.code,
                stdout: f.stdout,
                stderr: f.stderr,
            };
            r.assert_one_error_line("--growable without --writable rejected");
            assert!(!is_fuse_mounted(&mp));
            assert!(!mp.exists(), "fusex left a mountpoint file behind");
        }
    }
    assert_bytes_eq(&read_all(&img), &model, 0, "backing unchanged");
}

fn seek_offsets(size: u64) -> Vec<u64> {
    vec![
        0,
        MIB,
        2 * MIB - 1,
        2 * MIB,
        2 * MIB + 4096,
        3 * MIB - 1,
        3 * MIB,
        5 * MIB,
        size - 1,
        size,
        size + 4096,
    ]
}

#[track_caller]
fn assert_seeks_match(mount: &std::fs::File, backing: &std::fs::File, size: u64, when: &str) {
    for off in seek_offsets(size) {
        for (whence, name) in [
            (libc::SEEK_DATA, "SEEK_DATA"),
            (libc::SEEK_HOLE, "SEEK_HOLE"),
        ] {
            let a = lseek(mount, off, whence);
            let b = lseek(backing, off, whence);
            assert_eq!(
                a.map_err(errno_str),
                b.map_err(errno_str),
                "{when}: lseek({off}, {name}) mount vs backing"
            );
        }
    }
}

#[test]
fn punch_hole_zero_range_and_seek() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("sem-holes");
    assert!(
        punch_hole_works_in(w.path()),
        "the test directory {} does not support punching holes; set FUSEX_E2E_TMPDIR to one that does",
        w.path().display()
    );
    let img = w.join("disk.img");
    let size = 8 * MIB;
    let mut model = random_image(&img, size, 71);
    let backing = open_ro(&img);
    let full_blocks = fstat(&backing).1;
    assert!(full_blocks >= size / 512, "image should be fully allocated");

    let m = Mount::start(&w, &img, &w.join("export"), &["--writable"]);
    let f = m.open_rw();
    assert_eq!(
        lseek(&f, 0, libc::SEEK_HOLE),
        Ok(size),
        "fully allocated image: first hole at EOF"
    );
    assert_seeks_match(&f, &backing, size, "before punching");

    // Punch an aligned 1 MiB range.
    fallocate(
        &f,
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
        2 * MIB,
        MIB,
    )
    .expect("PUNCH_HOLE|KEEP_SIZE through the export");
    model[2 * MIB as usize..3 * MIB as usize].fill(0);
    assert!(
        pread_full(&f, 2 * MIB, MIB as usize)
            .unwrap()
            .iter()
            .all(|&b| b == 0),
        "punched range must read zeroes"
    );
    f.sync_all().expect("fsync");
    let (msize, mblocks) = fstat(&f);
    let (bsize, bblocks) = fstat(&backing);
    assert_eq!(msize, size, "KEEP_SIZE: export size");
    assert_eq!(bsize, size, "KEEP_SIZE: backing size");
    assert!(
        bblocks < full_blocks - MIB / 1024,
        "punch did not deallocate in the backing file: {bblocks} blocks, was {full_blocks}"
    );
    assert_eq!(
        mblocks, bblocks,
        "st_blocks of the export vs the backing file (fstat)"
    );
    assert_eq!(
        stat(m.path()).unwrap().1,
        stat(&img).unwrap().1,
        "st_blocks of the export vs the backing file (stat)"
    );
    assert_eq!(
        lseek(&f, 2 * MIB, libc::SEEK_HOLE),
        Ok(2 * MIB),
        "SEEK_HOLE at the hole"
    );
    assert_eq!(
        lseek(&f, 2 * MIB, libc::SEEK_DATA),
        Ok(3 * MIB),
        "SEEK_DATA from the hole"
    );
    assert_eq!(
        lseek(&f, size, libc::SEEK_DATA).map_err(errno_str),
        Err(errno_str(libc::ENXIO)),
        "SEEK_DATA at EOF"
    );
    assert_eq!(
        lseek(&f, size + 4096, libc::SEEK_DATA).map_err(errno_str),
        Err(errno_str(libc::ENXIO)),
        "SEEK_DATA past EOF"
    );
    assert_seeks_match(&f, &backing, size, "after punching");

    // An unaligned punch zeroes exactly the range.
    let (off, len) = (5 * MIB + 100, 10_000u64);
    fallocate(
        &f,
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
        off,
        len,
    )
    .expect("unaligned punch");
    model[off as usize..(off + len) as usize].fill(0);

    // ZERO_RANGE (with and without KEEP_SIZE) zeroes exactly the range.
    let (off, len) = (6 * MIB + 123, 70_000u64);
    fallocate(&f, libc::FALLOC_FL_ZERO_RANGE, off, len).expect("ZERO_RANGE through the export");
    model[off as usize..(off + len) as usize].fill(0);
    let (off2, len2) = (7 * MIB - 5000, 9000u64);
    fallocate(
        &f,
        libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
        off2,
        len2,
    )
    .expect("ZERO_RANGE|KEEP_SIZE through the export");
    model[off2 as usize..(off2 + len2) as usize].fill(0);
    assert!(
        pread_full(&f, off, len as usize)
            .unwrap()
            .iter()
            .all(|&b| b == 0),
        "ZERO_RANGE must read zeroes"
    );

    // Other modes are not supported.
    assert_errno_in(
        fallocate(&f, libc::FALLOC_FL_COLLAPSE_RANGE, 0, MIB),
        &[libc::EOPNOTSUPP],
        "COLLAPSE_RANGE",
    );

    f.sync_all().expect("fsync");
    assert_eq!(fstat(&f).0, size);
    assert_bytes_eq(
        &pread_full(&f, 0, size as usize).unwrap(),
        &model,
        0,
        "export vs model",
    );
    assert_bytes_eq(&read_all(&img), &model, 0, "backing vs model");
    assert_seeks_match(&f, &backing, size, "at the end");
    drop(f);
    m.stop().assert_clean("holes");
}

/// Holes of a sparse image show through the export.
#[test]
fn sparse_image_blocks_and_seek() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("sem-sparse");
    let img = w.join("disk.img");
    let size = 8 * MIB;
    sparse_image(&img, size);
    {
        let f = open_rw(&img);
        f.write_all_at(&Rng::new(81).bytes(MIB as usize), 3 * MIB)
            .unwrap();
        f.sync_all().unwrap();
    }
    let backing = open_ro(&img);
    let m = Mount::start(&w, &img, &w.join("export"), &[]);
    let f = m.open_ro();
    assert_eq!(
        fstat(&f),
        fstat(&backing),
        "(st_size, st_blocks) of export vs sparse backing file"
    );
    assert_seeks_match(&f, &backing, size, "sparse image");
    assert_eq!(lseek(&f, 0, libc::SEEK_DATA), Ok(3 * MIB), "first data");
    drop(f);
    m.stop().assert_clean("sparse");
}

#[test]
fn fsync_reaches_the_backend() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("sem-fsync");
    let img = w.join("disk.img");
    sparse_image(&img, 4 * MIB);
    let m = Mount::start(&w, &img, &w.join("export"), &["--writable"]);
    let f = m.open_rw();
    let data = Rng::new(91).bytes(64 * KIB as usize);
    f.write_all_at(&data, MIB + 17).expect("write");
    f.sync_all().expect("fsync of the export");
    drop(f);
    let st = m.stop();
    st.assert_clean("fsync");
    assert!(
        st.stat(&["ops", "FSYNC"]) >= 1,
        "FSYNC op not counted: {}",
        st.stats()
    );
    // backend.flushes counts the flushes requests caused and nothing else (not the one at exit),
    // so this fails if an FSYNC (or a FLUSH: the close, or another thread's child inheriting the
    // fd until its exec) does not flush the backend.
    assert_eq!(
        st.stat(&["backend", "flushes"]),
        st.requested_flushes(),
        "contract: every FSYNC and FLUSH on a writable export flushes the backend once: {}",
        st.stats()
    );
    assert!(st.stat(&["ops", "WRITE"]) >= 1, "stats: {}", st.stats());
    assert!(
        st.stat(&["backend", "writes"]) >= 1,
        "stats: {}",
        st.stats()
    );
    assert!(
        st.stat(&["backend", "bytes_written"]) >= data.len() as u64,
        "stats: {}",
        st.stats()
    );
    assert!(st.stat(&["requests"]) >= 2, "stats: {}", st.stats());
    let back = pread_full(&open_ro(&img), MIB + 17, data.len()).unwrap();
    assert_bytes_eq(&back, &data, MIB + 17, "backing after fsync + stop");
}

#[test]
fn writethrough_flushes_every_write() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("sem-writethrough");
    let img = w.join("disk.img");
    sparse_image(&img, 4 * MIB);
    let m = Mount::start(
        &w,
        &img,
        &w.join("export"),
        &["--writable", "--writethrough"],
    );
    let f = m.open_rw();
    let data = Rng::new(92).bytes(4096);
    for i in 0..10u64 {
        f.write_all_at(&data, i * 8192).expect("write");
    }
    drop(f);
    let st = m.stop();
    st.assert_clean("writethrough");
    let writes = st.stat(&["ops", "WRITE"]);
    assert!(writes >= 10, "stats: {}", st.stats());
    // The exit flush is not in backend.flushes: exactly one per WRITE, plus one per FLUSH/FSYNC.
    assert_eq!(
        st.stat(&["backend", "flushes"]),
        writes + st.requested_flushes(),
        "--writethrough: expected a backend flush per write (and per FLUSH/FSYNC): {}",
        st.stats()
    );
    let backing = open_ro(&img);
    for i in 0..10u64 {
        assert_bytes_eq(
            &pread_full(&backing, i * 8192, 4096).unwrap(),
            &data,
            i * 8192,
            "written block",
        );
    }
}

#[test]
fn null_backend_reads_zeroes_and_drops_writes() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("sem-null");
    let size = 64 * MIB;
    let m = Mount::start(&w, "null:64M", &w.join("export"), &["--writable"]);
    let f = m.open_rw();
    assert_eq!(fstat(&f).0, size, "st_size of null:64M");
    assert_eq!(stat(m.path()).unwrap().0, size, "stat size of null:64M");
    let mut rng = Rng::new(101);
    for _ in 0..20 {
        let off = rng.below(size);
        let len = (1 + rng.below(MIB)).min(size - off) as usize;
        let got = pread_full(&f, off, len).unwrap();
        assert_eq!(got.len(), len);
        assert!(
            got.iter().all(|&b| b == 0),
            "null: read {off}+{len} not zero"
        );
    }
    let mut buf = [0u8; 16];
    assert_eq!(f.read_at(&mut buf, size).unwrap(), 0, "null: read at EOF");
    let data = rng.bytes(128 * KIB as usize);
    f.write_all_at(&data, 10 * MIB + 3).expect("null: write");
    f.sync_all().expect("null: fsync");
    assert!(
        pread_full(&f, 10 * MIB + 3, data.len())
            .unwrap()
            .iter()
            .all(|&b| b == 0),
        "null: written data must read back as zeroes"
    );
    drop(f);
    m.stop().assert_clean("null:64M");

    let m = Mount::start(&w, "null:1G", &w.join("export-1g"), &[]);
    assert_eq!(stat(m.path()).unwrap().0, GIB, "stat size of null:1G");
    m.stop().assert_clean("null:1G");
    let m = Mount::start(&w, "null:4096", &w.join("export-4k"), &[]);
    assert_eq!(stat(m.path()).unwrap().0, 4096, "stat size of null:4096");
    m.stop().assert_clean("null:4096");
}

/// Without --allow-other only the mounting user (root) may access the export; with it,
/// other users get the image's permissions (here 0644: read yes, write no).
#[test]
fn allow_other_controls_access_by_other_users() {
    if !require_fuse_and_tools(&["setpriv", "head"]) {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let w = WorkDir::new("sem-allow-other");
    let img = w.join("disk.img");
    let model = random_image(&img, MIB, 111);
    std::fs::set_permissions(&img, std::fs::Permissions::from_mode(0o644)).unwrap();
    let as_nobody = |args: &[&str], path: &Path| {
        run(std::process::Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .args(args)
            .arg(path))
    };
    for (flags, allowed) in [
        (&["--writable"][..], false),
        (&["--writable", "--allow-other"][..], true),
    ] {
        let m = Mount::start(&w, &img, &w.join("export"), flags);
        let out = as_nobody(&["head", "-c", "4096"], m.path());
        if allowed {
            assert!(
                out.status.success(),
                "{flags:?}: nobody cannot read: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert_bytes_eq(&out.stdout, &model[..4096], 0, "read by nobody");
            let out = as_nobody(&["sh", "-c", "echo x >> \"$0\""], m.path());
            assert!(
                !out.status.success(),
                "{flags:?}: nobody could write a 0644 root-owned export"
            );
        } else {
            assert!(
                !out.status.success(),
                "{flags:?}: nobody could read without --allow-other"
            );
        }
        m.stop().assert_clean(&format!("{flags:?}"));
    }
    assert_bytes_eq(&read_all(&img), &model, 0, "image unchanged");
}

/// 64-bit offsets: a sparse 6 GiB image written and read beyond 4 GiB.
#[test]
fn offsets_beyond_4_gib() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("sem-big");
    let img = w.join("disk.img");
    let size = 6 * GIB;
    sparse_image(&img, size);
    let m = Mount::start(&w, &img, &w.join("export"), &["--writable"]);
    let f = m.open_rw();
    assert_eq!(fstat(&f).0, size, "st_size of a 6 GiB image");
    let data = Rng::new(121).bytes(300_001);
    for off in [4 * GIB - 100_000, 5 * GIB + 12345, size - data.len() as u64] {
        f.write_all_at(&data, off)
            .unwrap_or_else(|e| panic!("pwrite at {off}: {e}"));
        assert_bytes_eq(
            &pread_full(&f, off, data.len()).unwrap(),
            &data,
            off,
            "read back",
        );
    }
    let mut buf = [0u8; 64];
    assert_eq!(f.read_at(&mut buf, size).unwrap(), 0, "read at EOF");
    f.sync_all().unwrap();
    let backing = open_ro(&img);
    for off in [4 * GIB - 100_000, 5 * GIB + 12345, size - data.len() as u64] {
        assert_bytes_eq(
            &pread_full(&backing, off, data.len()).unwrap(),
            &data,
            off,
            "backing",
        );
    }
    assert_eq!(
        lseek(&f, 4 * GIB + GIB / 2, libc::SEEK_DATA),
        lseek(&backing, 4 * GIB + GIB / 2, libc::SEEK_DATA),
        "SEEK_DATA beyond 4 GiB"
    );
    drop(f);
    m.stop().assert_clean("6 GiB image");
}

/// IMAGE may be a block device: its size is the device size (st_size of the device node
/// is 0), and data lands on the device.
#[test]
fn block_device_image() {
    if !require_fuse_and_tools(&["losetup"]) {
        return;
    }
    let w = WorkDir::new("sem-blockdev");
    let file = w.join("disk.img");
    let size = 16 * MIB;
    let mut model = random_image(&file, size, 131);
    let lo = LoopDev::attach(&file, false);
    let m = Mount::start(&w, &lo.dev, &w.join("export"), &["--writable"]);
    let f = m.open_rw();
    assert_eq!(
        fstat(&f).0,
        size,
        "st_size of a block-device export = device size"
    );
    assert_bytes_eq(
        &pread_full(&f, 0, size as usize).unwrap(),
        &model,
        0,
        "device content",
    );
    let data = Rng::new(132).bytes(70_001);
    f.write_all_at(&data, 3 * MIB + 7)
        .expect("write to the device export");
    model[3 * MIB as usize + 7..3 * MIB as usize + 7 + data.len()].copy_from_slice(&data);
    f.sync_all().expect("fsync");
    let mut buf = [0u8; 16];
    assert_eq!(
        f.read_at(&mut buf, size).unwrap(),
        0,
        "read at EOF of the device"
    );
    drop(f);
    m.stop().assert_clean("block device export");
    lo.detach();
    assert_bytes_eq(&read_all(&file), &model, 0, "file behind the loop device");
}
