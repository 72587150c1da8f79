//! FUSE passthrough (`--passthrough`): with it on, bytes through the mount equal the backing file
//! (buffered, O_DIRECT and mmap I/O, msync included) while reads and writes never reach fusex (its
//! READ/WRITE counters stay 0); the export's semantics (size, growth, fixed size, fallocate,
//! SEEK_HOLE/DATA, fsync) are those without it. `auto` falls back, and `on` fails with the reason,
//! where passthrough is impossible: a null backend, --kernel-cache, and a run without
//! CAP_SYS_ADMIN in the initial user namespace (a user namespace, which can still mount FUSE).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::process::Command;

use fusex_e2e::*;

const IMG: u64 = 16 * MIB;

/// The daemon's one "passthrough: ..." log line.
#[track_caller]
fn passthrough_line(stderr: &str) -> String {
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("passthrough: "))
        .collect();
    assert_eq!(
        lines.len(),
        1,
        "expected exactly one passthrough log line; stderr:\n{stderr}"
    );
    lines[0].to_string()
}

/// A shared writable mapping of a whole file; unmapped on drop.
struct Map {
    ptr: *mut u8,
    len: usize,
}

impl Map {
    fn new(f: &File, len: usize) -> Map {
        // SAFETY: maps `len` bytes of an open fd; the result is checked before use.
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
        assert_ne!(
            p,
            libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        Map { ptr: p.cast(), len }
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is live for self's lifetime and len bytes long.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    fn msync(&self) {
        // SAFETY: syncs the live mapping.
        let r = unsafe { libc::msync(self.ptr.cast(), self.len, libc::MS_SYNC) };
        assert_eq!(r, 0, "msync: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: unmaps the mapping created in new().
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// The mount and the backing file hold the same bytes, and those are the model's.
#[track_caller]
fn assert_all_same(mount: &Path, backing: &Path, model: &[u8], what: &str) {
    assert_bytes_eq(
        &read_all(backing),
        model,
        0,
        &format!("{what}: backing file"),
    );
    assert_bytes_eq(
        &read_all(mount),
        model,
        0,
        &format!("{what}: through the mount"),
    );
}

/// Reads through the mount in every way a reader might: whole file, unaligned preads, O_DIRECT,
/// mmap; each compared with the model.
fn read_every_way(mount: &Path, model: &[u8]) {
    assert_bytes_eq(&read_all(mount), model, 0, "sequential read");
    let f = open_ro(mount);
    let mut rng = Rng::new(11);
    for _ in 0..200 {
        let off = rng.below(model.len() as u64);
        let len = 1 + rng.below(300_000) as usize;
        let got = pread_full(&f, off, len).unwrap();
        let end = (off as usize + len).min(model.len());
        assert_bytes_eq(&got, &model[off as usize..end], off, "random pread");
    }
    let d = File::options()
        .read(true)
        .custom_flags_direct()
        .open(mount)
        .unwrap();
    let mut buf = AlignedBuf::new(MIB as usize, 4096);
    for off in [0, 3 * MIB, model.len() as u64 - MIB] {
        d.read_exact_at(buf.as_mut_slice(), off).unwrap();
        assert_bytes_eq(
            buf.as_slice(),
            &model[off as usize..(off + MIB) as usize],
            off,
            "O_DIRECT read",
        );
    }
    // SAFETY: a read-only shared mapping of the whole file, unmapped below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            model.len(),
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED, "mmap read-only");
    // SAFETY: the mapping is model.len() bytes and live until munmap.
    let mapped = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), model.len()) };
    assert_bytes_eq(mapped, model, 0, "mmap read");
    // SAFETY: unmaps what was mapped above.
    unsafe { libc::munmap(p, model.len()) };
}

trait DirectOpen {
    fn custom_flags_direct(&mut self) -> &mut Self;
}

impl DirectOpen for std::fs::OpenOptions {
    fn custom_flags_direct(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.custom_flags(libc::O_DIRECT)
    }
}

/// Contract: a read-only export with passthrough serves every read (buffered, O_DIRECT, mmap) from
/// the image without fusex seeing a single READ.
#[test]
fn reads_never_reach_fusex() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("pt-reads");
    let img = w.join("disk.img");
    let model = random_image(&img, IMG, 21);
    let m = Mount::start(&w, &img, &w.join("export"), &["--passthrough", "on"]);
    let line = passthrough_line(&m.stderr());
    assert!(line.contains("passthrough: on"), "{line}");
    assert_eq!(stat(m.path()).unwrap().0, IMG, "st_size");
    read_every_way(m.path(), &model);
    let e = File::options().write(true).open(m.path()).unwrap_err();
    assert_eq!(
        errno(&e),
        libc::EROFS,
        "open for writing a read-only export"
    );
    let st = m.stop();
    st.assert_clean("read-only passthrough export");
    assert_eq!(st.stat(&["ops", "READ"]), 0, "stats: {}", st.stats());
    assert_eq!(st.stat(&["backend", "reads"]), 0, "stats: {}", st.stats());
    assert!(st.stat(&["ops", "OPEN"]) >= 1, "stats: {}", st.stats());
}

/// Contract: the data-integrity suite on a growable export with passthrough. Buffered, O_DIRECT and
/// mmap writes (with msync) land in the image byte for byte; writes past the end grow it and
/// stat follows; fallocate, SEEK_HOLE/DATA, truncate and fsync behave as without passthrough; no
/// READ or WRITE reaches fusex.
#[test]
fn growable_export_integrity_without_reads_or_writes_in_fusex() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("pt-growable");
    let img = w.join("disk.img");
    let mut model = random_image(&img, IMG, 22);
    let m = Mount::start(
        &w,
        &img,
        &w.join("export"),
        &["--writable", "--growable", "--passthrough", "on"],
    );
    let line = passthrough_line(&m.stderr());
    assert!(line.contains("read, write and mmap"), "{line}");
    let mut rng = Rng::new(23);

    // Buffered writes at unaligned offsets, some crossing 4 KiB and 1 MiB boundaries.
    let f = m.open_rw();
    for (off, len) in [
        (7u64, 1usize),
        (1_000_001, 511),
        (2 * MIB + 4097, 4095),
        (4 * MIB - 3, 70_000),
        (IMG - 4097, 4097),
    ] {
        let data = rng.bytes(len);
        f.write_all_at(&data, off).unwrap();
        model[off as usize..off as usize + len].copy_from_slice(&data);
    }
    assert_all_same(m.path(), &img, &model, "after buffered writes");

    // O_DIRECT writes.
    let d = open_rw_direct(m.path());
    for (off, len) in [
        (0u64, 4096usize),
        (5 * MIB, MIB as usize),
        (IMG - 8192, 8192),
    ] {
        let data = rng.bytes(len);
        d.write_all_at(AlignedBuf::from_slice(&data, 4096).as_slice(), off)
            .unwrap();
        model[off as usize..off as usize + len].copy_from_slice(&data);
    }
    assert_all_same(m.path(), &img, &model, "after O_DIRECT writes");

    // mmap writes, then msync: the image has them without munmap or close.
    {
        let mut map = Map::new(&f, IMG as usize);
        for (off, len) in [
            (100usize, 10usize),
            (3 * MIB as usize - 5, 10_000),
            (IMG as usize - 1, 1),
        ] {
            let data = rng.bytes(len);
            map.bytes()[off..off + len].copy_from_slice(&data);
            model[off..off + len].copy_from_slice(&data);
        }
        map.msync();
        assert_bytes_eq(&read_all(&img), &model, 0, "backing file after msync");
    }
    assert_all_same(m.path(), &img, &model, "after mmap writes");

    // Writing past the end grows the image; stat through the mount follows the image file.
    let data = rng.bytes(3000);
    f.write_all_at(&data, IMG + 5000).unwrap();
    model.resize(IMG as usize + 5000, 0);
    model.extend_from_slice(&data);
    let grown = model.len() as u64;
    assert_eq!(stat(m.path()).unwrap().0, grown, "st_size after growing");
    assert_eq!(fstat(&f).0, grown, "fstat after growing");
    assert_eq!(stat(&img).unwrap().0, grown, "image size after growing");
    assert_all_same(m.path(), &img, &model, "after growing");

    // fallocate mode 0 past the end grows too (a request fusex serves, against the grown size).
    fallocate(&f, 0, grown, MIB).unwrap();
    model.resize((grown + MIB) as usize, 0);
    assert_eq!(
        stat(m.path()).unwrap().0,
        grown + MIB,
        "st_size after fallocate"
    );
    assert_eq!(stat(&img).unwrap().0, grown + MIB, "image after fallocate");

    // Punching a hole; SEEK_HOLE/SEEK_DATA through the mount match the image.
    if punch_hole_works_in(w.path()) {
        fallocate(
            &f,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            8 * MIB,
            MIB,
        )
        .unwrap();
        model[8 * MIB as usize..9 * MIB as usize].fill(0);
        let b = open_ro(&img);
        for off in [0, 8 * MIB, 8 * MIB + 4096, 9 * MIB, IMG] {
            assert_eq!(
                lseek(&f, off, libc::SEEK_HOLE),
                lseek(&b, off, libc::SEEK_HOLE),
                "SEEK_HOLE from {off}"
            );
            assert_eq!(
                lseek(&f, off, libc::SEEK_DATA),
                lseek(&b, off, libc::SEEK_DATA),
                "SEEK_DATA from {off}"
            );
        }
    }
    assert_all_same(m.path(), &img, &model, "after fallocate");

    // Truncating through the mount shrinks the image.
    f.set_len(IMG - MIB).unwrap();
    model.truncate((IMG - MIB) as usize);
    assert_eq!(
        stat(m.path()).unwrap().0,
        IMG - MIB,
        "st_size after truncate"
    );
    assert_all_same(m.path(), &img, &model, "after truncate");

    f.sync_all().unwrap();
    drop((f, d));
    let st = m.stop();
    st.assert_clean("growable passthrough export");
    assert_eq!(st.stat(&["ops", "READ"]), 0, "stats: {}", st.stats());
    assert_eq!(st.stat(&["ops", "WRITE"]), 0, "stats: {}", st.stats());
    // fsync reaches fusex, which flushes the backend for it (backend.flushes counts only the
    // flushes requests caused; the one at exit is exit_flush).
    assert!(st.stat(&["ops", "FSYNC"]) >= 1, "stats: {}", st.stats());
    assert_eq!(
        st.stat(&["backend", "flushes"]),
        st.requested_flushes(),
        "every FSYNC/FLUSH flushes the backend: {}",
        st.stats()
    );
    assert!(st.stat(&["ops", "FALLOCATE"]) >= 1, "stats: {}", st.stats());
}

/// Contract: a fixed-size writable export keeps its size with passthrough on. Opens for reading
/// are passed through (no READ in fusex); reads and writes of files opened for writing come to
/// fusex, which stops them at the end (short write, then ENOSPC); mmap writes pass through.
#[test]
fn fixed_size_writable_export_keeps_its_size() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("pt-fixed");
    let img = w.join("disk.img");
    let mut model = random_image(&img, IMG, 24);
    let m = Mount::start(
        &w,
        &img,
        &w.join("export"),
        &["--writable", "--passthrough", "on"],
    );
    let line = passthrough_line(&m.stderr());
    assert!(line.contains("fixed size"), "{line}");
    let f = m.open_rw();
    let mut rng = Rng::new(25);
    let data = rng.bytes(10_000);
    f.write_all_at(&data, 6 * MIB + 3).unwrap();
    model[(6 * MIB + 3) as usize..(6 * MIB + 3) as usize + data.len()].copy_from_slice(&data);
    // Straddling the end: short; at the end: ENOSPC.
    let n = f.write_at(&[0xAB; 8192], IMG - 4096).unwrap();
    assert_eq!(n, 4096, "write straddling the end of a fixed-size export");
    model[(IMG - 4096) as usize..].fill(0xAB);
    let e = f.write_at(&[1; 512], IMG).unwrap_err();
    assert_eq!(
        errno(&e),
        libc::ENOSPC,
        "write at the end: {}",
        errno_str(errno(&e))
    );
    {
        let mut map = Map::new(&f, IMG as usize);
        let data = rng.bytes(5000);
        map.bytes()[MIB as usize..MIB as usize + 5000].copy_from_slice(&data);
        model[MIB as usize..MIB as usize + 5000].copy_from_slice(&data);
        map.msync();
    }
    assert_eq!(stat(&img).unwrap().0, IMG, "image size");
    assert_eq!(stat(m.path()).unwrap().0, IMG, "st_size");
    // Only opens for reading below: none of these reads reach fusex.
    read_every_way(m.path(), &model);
    assert_bytes_eq(&read_all(&img), &model, 0, "backing file");
    drop(f);
    let st = m.stop();
    st.assert_clean("fixed-size writable passthrough export");
    assert_eq!(st.stat(&["ops", "READ"]), 0, "stats: {}", st.stats());
    assert!(st.stat(&["ops", "WRITE"]) >= 2, "stats: {}", st.stats());
}

/// Contract: `auto` on a null backend serves normally and says why passthrough is off.
#[test]
fn auto_falls_back_for_null() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("pt-null");
    let m = Mount::start(&w, "null:16M", &w.join("export"), &[]);
    let line = passthrough_line(&m.stderr());
    assert!(
        line.contains("passthrough: off") && line.contains("null:16M"),
        "{line}"
    );
    let got = pread_full(&m.open_ro(), MIB, 65536).unwrap();
    assert!(got.iter().all(|&b| b == 0), "null reads zeroes");
    let st = m.stop();
    st.assert_clean("null export, passthrough auto");
    assert!(st.stat(&["ops", "READ"]) >= 1, "stats: {}", st.stats());
}

/// Contract: `--passthrough on` fails with the reason (one line, exit 1, nothing mounted) where
/// passthrough is impossible before the kernel is even asked: null, --kernel-cache.
#[test]
fn on_fails_with_the_reason() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("pt-on-fails");
    let img = w.join("disk.img");
    random_image(&img, MIB, 26);
    let mp = w.join("export");
    let mps = mp.to_str().unwrap();
    let imgs = img.to_str().unwrap();
    for (args, needle) in [
        (
            vec!["mount", "--passthrough", "on", "null:1G", mps],
            "null:1G",
        ),
        (
            vec!["mount", "--passthrough", "on", "--kernel-cache", imgs, mps],
            "--kernel-cache",
        ),
    ] {
        let r = run_fusex(&w, &args, Some(&mp));
        r.assert_one_error_line(&format!("{args:?}"));
        assert!(
            r.stderr.contains("passthrough") && r.stderr.contains(needle),
            "{args:?}: {}",
            r.stderr
        );
        assert!(!is_fuse_mounted(&mp), "{args:?} left a mount");
    }
    // auto with --kernel-cache serves, without passthrough.
    let m = Mount::start(&w, &img, &mp, &["--kernel-cache"]);
    let line = passthrough_line(&m.stderr());
    assert!(
        line.contains("passthrough: off") && line.contains("--kernel-cache"),
        "{line}"
    );
    m.stop().assert_clean("--kernel-cache, passthrough auto");
}

/// Whether `unshare --user --map-root-user --mount` works here; panics under CI if not.
fn userns_available() -> bool {
    if !require_fuse_and_tools(&["unshare"]) {
        return false;
    }
    let ok = run(Command::new("unshare").args(["--user", "--map-root-user", "--mount", "true"]))
        .status
        .success();
    if !ok {
        let msg = "user namespaces are not available (unshare --user failed)";
        if in_ci() {
            panic!("{msg}");
        }
        eprintln!("skipping: {msg}");
    }
    ok
}

/// Contract: without CAP_SYS_ADMIN in the initial user namespace, `auto` mounts, logs why
/// passthrough is off, and serves every byte itself.
///
/// The run is a user namespace (`unshare --user --map-root-user --mount`): root there may mount
/// FUSE, but registering a backing file checks CAP_SYS_ADMIN against the initial namespace and
/// gets EPERM. (Dropping CAP_SYS_ADMIN with capsh/setpriv instead makes mount(2) itself fail; see
/// `without_cap_sys_admin_mount_fails_in_one_line`.) The mount lives in the private namespace and
/// ends with it.
#[test]
fn auto_falls_back_without_cap_sys_admin() {
    if !require_fuse() || !userns_available() {
        return;
    }
    let w = WorkDir::new("pt-userns");
    let img = w.join("disk.img");
    random_image(&img, 4 * MIB, 27);
    let mp = w.join("export");
    let log = w.join("daemon.log");
    let stats = w.join("stats.json");
    let script = r#"
        "$FUSEX" mount --passthrough auto --stats-file "$STATS" "$IMG" "$MNT" 2>"$LOG" &
        pid=$!
        i=0
        until grep -q " $MNT " /proc/self/mountinfo; do
            i=$((i + 1))
            if [ $i -gt 100 ] || ! kill -0 $pid 2>/dev/null; then
                echo "not mounted" >&2; kill $pid 2>/dev/null; wait $pid; exit 3
            fi
            sleep 0.1
        done
        cmp "$IMG" "$MNT" || { "$FUSEX" umount "$MNT"; wait $pid; exit 4; }
        "$FUSEX" umount "$MNT"
        wait $pid
    "#;
    let mut cmd = Command::new("unshare");
    cmd.args(["--user", "--map-root-user", "--mount", "sh", "-c", script])
        .env("FUSEX", fusex_bin())
        .env("IMG", &img)
        .env("MNT", &mp)
        .env("LOG", &log)
        .env("STATS", &stats);
    let r = run_with_timeout(&w, cmd, None);
    let daemon_log = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(
        r.code,
        Some(0),
        "script in a user namespace: {}\ndaemon log:\n{daemon_log}",
        r.stderr
    );
    let line = passthrough_line(&daemon_log);
    assert!(
        line.contains("passthrough: off") && line.contains("CAP_SYS_ADMIN"),
        "{line}"
    );
    let st: Value = serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    assert!(
        st["ops"]["READ"].as_u64().unwrap_or(0) >= 1,
        "fusex served the reads itself: {st}"
    );
    assert!(!is_fuse_mounted(&mp));
}

/// Contract: `--passthrough on` without CAP_SYS_ADMIN (user namespace, as above) fails in one line
/// naming the capability.
#[test]
fn on_fails_without_cap_sys_admin() {
    if !require_fuse() || !userns_available() {
        return;
    }
    let w = WorkDir::new("pt-userns-on");
    let img = w.join("disk.img");
    random_image(&img, MIB, 28);
    let mp = w.join("export");
    let mut cmd = Command::new("unshare");
    cmd.args(["--user", "--map-root-user", "--mount"])
        .arg(fusex_bin())
        .args(["mount", "--passthrough", "on"])
        .arg(&img)
        .arg(&mp);
    let r = run_with_timeout(&w, cmd, None);
    r.assert_one_error_line("--passthrough on in a user namespace");
    assert!(r.stderr.contains("CAP_SYS_ADMIN"), "{}", r.stderr);
}

/// Contract: with CAP_SYS_ADMIN dropped entirely (capsh), mount(2) itself is refused, so
/// `--passthrough auto` gets the normal one-line "not permitted" error and leaves nothing mounted.
#[test]
fn without_cap_sys_admin_mount_fails_in_one_line() {
    if !require_fuse_and_tools(&["capsh"]) {
        return;
    }
    let w = WorkDir::new("pt-capsh");
    let img = w.join("disk.img");
    random_image(&img, MIB, 29);
    let mp = w.join("export");
    let line = format!(
        "exec '{}' mount --passthrough auto '{}' '{}'",
        fusex_bin().display(),
        img.display(),
        mp.display()
    );
    let mut cmd = Command::new(which("capsh").unwrap());
    cmd.args(["--drop=cap_sys_admin", "--", "-c", &line]);
    let r = run_with_timeout(&w, cmd, Some(&mp));
    r.assert_one_error_line("fusex without CAP_SYS_ADMIN");
    assert!(r.stderr.contains("not permitted"), "{}", r.stderr);
    assert!(!is_fuse_mounted(&mp));
}

/// Reads a whole file through a read-only shared mapping.
fn read_through_shared_mapping(f: &File, len: usize) -> Vec<u8> {
    // SAFETY: a read-only shared mapping of `len` bytes of an open fd, checked, unmapped below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(
        p,
        libc::MAP_FAILED,
        "read-only MAP_SHARED: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: the mapping is `len` bytes and live until munmap.
    let v = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) }.to_vec();
    // SAFETY: unmaps what was mapped above.
    unsafe { libc::munmap(p, len) };
    v
}

/// Shared mappings of an export whose opens fusex serves itself (`FOPEN_DIRECT_IO`): reading
/// through one equals the image, and writes through a writable one reach the image by msync.
fn shared_mapping_round_trip(m: &Mount, backing: &Path, model: &mut [u8], what: &str) {
    let f = m.open_rw();
    let len = model.len();
    assert_bytes_eq(
        &read_through_shared_mapping(&f, len),
        model,
        0,
        &format!("{what}: read through MAP_SHARED"),
    );
    let mut rng = Rng::new(61);
    {
        let mut map = Map::new(&f, len);
        assert_bytes_eq(map.bytes(), model, 0, &format!("{what}: writable mapping"));
        for (off, n) in [
            (0usize, 4096usize),
            (100, 10),
            (MIB as usize - 3, 7000),
            (len - 1, 1),
        ] {
            let data = rng.bytes(n);
            map.bytes()[off..off + n].copy_from_slice(&data);
            model[off..off + n].copy_from_slice(&data);
        }
        map.msync();
        assert_bytes_eq(
            &read_all(backing),
            model,
            0,
            &format!("{what}: backing file after msync"),
        );
    }
    drop(f);
    assert_all_same(m.path(), backing, model, &format!("{what}: after munmap"));
}

/// Contract: MAP_SHARED works without passthrough. Opens fusex serves itself carry
/// `FOPEN_DIRECT_IO`, on which the kernel refuses shared mappings (ENODEV) unless INIT negotiated
/// `FUSE_DIRECT_IO_ALLOW_MMAP`; fusex does, so mappings read and write the image through fusex's
/// READ and WRITE (the counters show they came to fusex). Covers `--passthrough off` on a raw
/// file, a block device (never passed through) and null (reads zeroes).
#[test]
fn shared_mmap_without_passthrough() {
    if !require_fuse_and_tools(&["losetup"]) {
        return;
    }
    let w = WorkDir::new("pt-off-mmap");
    let img = w.join("disk.img");
    let mut model = random_image(&img, IMG, 60);
    let m = Mount::start(
        &w,
        &img,
        &w.join("export"),
        &["--writable", "--passthrough", "off"],
    );
    shared_mapping_round_trip(&m, &img, &mut model, "--passthrough off");
    let st = m.stop();
    st.assert_clean("raw image, --passthrough off, MAP_SHARED");
    assert!(st.stat(&["ops", "READ"]) >= 1, "stats: {}", st.stats());
    assert!(st.stat(&["ops", "WRITE"]) >= 1, "stats: {}", st.stats());

    let lo = LoopDev::attach(&img, false);
    let m = Mount::start(&w, &lo.dev, &w.join("export-blk"), &["--writable"]);
    let line = passthrough_line(&m.stderr());
    assert!(line.contains("passthrough: off"), "{line}");
    shared_mapping_round_trip(&m, &lo.dev, &mut model, "block device");
    let st = m.stop();
    st.assert_clean("block device, MAP_SHARED");
    assert!(st.stat(&["ops", "WRITE"]) >= 1, "stats: {}", st.stats());
    lo.detach();
    assert_bytes_eq(&read_all(&img), &model, 0, "image behind the loop device");

    let m = Mount::start(&w, "null:16M", &w.join("export-null"), &[]);
    let got = read_through_shared_mapping(&m.open_ro(), IMG as usize);
    assert!(
        got.iter().all(|&b| b == 0),
        "null reads zeroes through MAP_SHARED"
    );
    m.stop().assert_clean("null, MAP_SHARED");
}
