//! Shared harness for the fusex end-to-end tests.
//!
//! Every test mounts the real `fusex` binary over a regular file in its own temporary
//! directory and checks what a user of the export sees against the backing file (the
//! oracle). The guards in here ([`Mount`], [`LoopDev`], [`FsMount`], [`Immutable`],
//! [`ReadOnlyBind`]) undo what they set up even when the test panics, so a failing test
//! never leaves a mount, a loop device or an immutable file behind.
//!
//! Environment:
//! - `FUSEX_BIN`: the binary to test (default: `fusex` in the same `target/<profile>` dir
//!   as the test executable).
//! - `FUSEX_E2E_TMPDIR`: where the per-test temp dirs go (default: `target/<profile>/e2e-tmp`,
//!   i.e. on the real disk, where punch-hole and SEEK_HOLE work).
//! - `CI=true`: missing preconditions (root, /dev/fuse, tools) fail instead of skipping.

use std::ffi::{OsStr, OsString};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

pub use serde_json::Value;

mod fake_nbd;
mod nbd;
mod serve;
pub use fake_nbd::{fake_nbd_byte, FakeMode, FakeNbd, FAKE_NBD_SIZE};
pub use nbd::{
    free_port, make_pki, make_pki_for, nbd_server, nbd_server_tcp, nbd_uri, nbdkit, qemu_nbd,
    strict_blocksize_export, tls_uri,
};
pub use serve::{read_pid, unmount_under, PidGuard, Qmp, Serve};

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// How long the daemon may take to mount, to exit after a signal or an unmount, or to
/// reject bad input. Generous on purpose: it is a hang detector, not a performance bound.
pub const TIMEOUT: Duration = Duration::from_secs(10);

static COUNTER: AtomicUsize = AtomicUsize::new(0);

fn unique(tag: &str) -> String {
    format!("{tag}-{}", COUNTER.fetch_add(1, Ordering::Relaxed))
}

// ---------------------------------------------------------------------------------------
// Preconditions
// ---------------------------------------------------------------------------------------

/// Whether FUSE-over-io_uring is on (`/sys/module/fuse/parameters/enable_uring`): an export
/// with the default transport then serves over io_uring. `make test` turns it on; under CI it
/// must be.
pub fn uring_enabled() -> bool {
    let on = fs::read_to_string("/sys/module/fuse/parameters/enable_uring")
        .is_ok_and(|v| v.trim() == "Y");
    assert!(
        on || !in_ci(),
        "enable_uring is not Y: `make test` enables it"
    );
    on
}

/// True when running under CI (`CI=true`): there, a missing precondition is a failure.
pub fn in_ci() -> bool {
    matches!(std::env::var("CI").as_deref(), Ok("true") | Ok("1"))
}

/// `target/<profile>` of the running test executable (strips a trailing `deps`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("test exe has a parent").to_path_buf();
    if dir.file_name() == Some(OsStr::new("deps")) {
        dir.pop();
    }
    dir
}

/// The fusex binary under test.
pub fn fusex_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("FUSEX_BIN") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "FUSEX_BIN={} does not exist: build it first: cargo build -p fusex",
            p.display()
        );
        return p;
    }
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test>-<hash> -> target/<profile>/fusex (a couple of levels
    // up at most, also covering target/<triple>/<profile>).
    for dir in exe.ancestors().skip(1).take(3) {
        let candidate = dir.join("fusex");
        if candidate.is_file() {
            if let Some(newer) = newer_source(&candidate) {
                panic!(
                    "{} is older than {}: `cargo test -p fusex-e2e` does not rebuild it; run \
                     cargo build -p fusex first (make e2e does), or point FUSEX_BIN at a binary",
                    candidate.display(),
                    newer.display()
                );
            }
            return candidate;
        }
        if dir.file_name() == Some(OsStr::new("target")) {
            break;
        }
    }
    panic!(
        "no fusex binary next to {} (target/<profile>/fusex): build it first: cargo build -p fusex \
         (or point FUSEX_BIN at it)",
        exe.display()
    );
}

/// A source of the binary (`crates/`, `vendor/`, `Cargo.lock`) changed after `bin` was built,
/// if any: testing that binary would test old code. Looked at once per test process.
fn newer_source(bin: &Path) -> Option<PathBuf> {
    static NEWER: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    NEWER
        .get_or_init(|| {
            let built = fs::metadata(bin).and_then(|m| m.modified()).ok()?;
            let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent()?;
            let mut todo = vec![root.join("crates"), root.join("vendor")];
            let mut files = vec![root.join("Cargo.lock")];
            while let Some(dir) = todo.pop() {
                let Ok(entries) = fs::read_dir(&dir) else {
                    continue;
                };
                for e in entries.flatten() {
                    let path = e.path();
                    let name = e.file_name();
                    // Unit tests and crates' own test directories are not in the binary: an
                    // edit there does not relink it, so it never makes the binary stale.
                    let test_only = name == "tests"
                        || name == "tests.rs"
                        || name.to_string_lossy().ends_with("_tests.rs");
                    match e.file_type() {
                        _ if test_only => {}
                        Ok(t) if t.is_dir() => todo.push(path),
                        Ok(t)
                            if t.is_file()
                                && (path.extension() == Some(OsStr::new("rs"))
                                    || name == OsStr::new("Cargo.toml")) =>
                        {
                            files.push(path);
                        }
                        _ => {}
                    }
                }
            }
            files.into_iter().find(|f| {
                fs::metadata(f)
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| t > built)
            })
        })
        .clone()
}

/// Whether an open file description other than a fresh one of ours holds a lock on `len` bytes
/// of `path` from `start` (`len` 0: to the end of the file). QEMU's "holds permission" bytes
/// are 100.., its "does not share" bytes 200...
pub fn lock_held(path: &Path, start: i64, len: i64) -> bool {
    let f = File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    // SAFETY: all-zero is a valid flock (OFD requests need l_pid == 0).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = start;
    fl.l_len = len;
    // SAFETY: F_OFD_GETLK reads and writes back `fl`, which lives across the call.
    let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
    assert!(r == 0, "F_OFD_GETLK: {}", std::io::Error::last_os_error());
    fl.l_type != libc::F_UNLCK as libc::c_short
}

/// A precondition that is not met: prints a skip message and returns false, or panics under
/// `CI=true`.
pub fn skip_or_fail(what: &str) -> bool {
    if in_ci() {
        panic!("precondition failed under CI=true: {what}");
    }
    eprintln!("SKIP (precondition not met, would fail under CI=true): {what}");
    false
}

/// Checks the preconditions of a test that mounts: root and /dev/fuse. Returns false
/// (after printing a skip message) when they are missing, or panics under `CI=true`.
/// Also panics when the binary has not been built.
pub fn require_fuse() -> bool {
    let mut missing = Vec::new();
    if !Path::new("/dev/fuse").exists() {
        missing.push("/dev/fuse is missing");
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        missing.push("not running as root");
    }
    if !missing.is_empty() {
        return skip_or_fail(&missing.join(", "));
    }
    let _ = fusex_bin();
    true
}

/// Path of an executable found in PATH (or the sbin dirs, which a non-login PATH may lack).
pub fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let extra = [
        "/usr/local/sbin",
        "/usr/local/bin",
        "/usr/sbin",
        "/usr/bin",
        "/sbin",
        "/bin",
    ];
    std::env::split_paths(&path)
        .chain(extra.iter().map(PathBuf::from))
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// [`require_fuse`] plus the given external tools.
pub fn require_fuse_and_tools(tools: &[&str]) -> bool {
    if !require_fuse() {
        return false;
    }
    let missing: Vec<&str> = tools
        .iter()
        .copied()
        .filter(|t| which(t).is_none())
        .collect();
    if !missing.is_empty() {
        return skip_or_fail(&format!("missing tools: {}", missing.join(", ")));
    }
    true
}

// ---------------------------------------------------------------------------------------
// Temp dirs, commands
// ---------------------------------------------------------------------------------------

/// A per-test temporary directory (canonical path) on the real disk.
pub struct WorkDir {
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl WorkDir {
    pub fn new(tag: &str) -> WorkDir {
        let base = std::env::var_os("FUSEX_E2E_TMPDIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| profile_dir().join("e2e-tmp"));
        fs::create_dir_all(&base).unwrap_or_else(|e| panic!("mkdir {}: {e}", base.display()));
        let dir = tempfile::Builder::new()
            .prefix(&format!("{tag}-"))
            .tempdir_in(&base)
            .unwrap_or_else(|e| panic!("tempdir in {}: {e}", base.display()));
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod tempdir");
        let path = dir.path().canonicalize().expect("canonicalize tempdir");
        WorkDir { path, _dir: dir }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn join(&self, name: impl AsRef<Path>) -> PathBuf {
        self.path.join(name)
    }
}

/// Runs a command to completion, capturing its output. Panics only if it cannot be started.
pub fn run(cmd: &mut Command) -> Output {
    cmd.stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// The `fusex list --json` row of the export at `mountpoint`, if it is listed.
pub fn listed(mountpoint: &Path) -> Option<serde_json::Value> {
    let out = run_ok(Command::new(fusex_bin()).args(["list", "--json"]));
    let rows: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("fusex list --json is JSON");
    rows.as_array()
        .expect("an array")
        .iter()
        .find(|r| r["mountpoint"].as_str() == Some(&*mountpoint.to_string_lossy()))
        .cloned()
}

/// Asserts `fusex list --json` shows the export at `mountpoint` serving from process `pid`: what
/// a user sees once `fusex mount` says it serves.
#[track_caller]
pub fn assert_listed_serving(mountpoint: &Path, pid: i32) {
    let row =
        listed(mountpoint).unwrap_or_else(|| panic!("fusex list lacks {}", mountpoint.display()));
    assert_eq!(row["state"], "serving", "{row}");
    assert_eq!(row["pid"], pid, "{row}");
}

/// Like [`run`], asserting a zero exit status.
pub fn run_ok(cmd: &mut Command) -> Output {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn read_lossy(path: &Path) -> String {
    fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------
// Data helpers
// ---------------------------------------------------------------------------------------

/// xorshift64*: deterministic pseudo-random data from a seed.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform-ish in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0);
        self.next_u64() % n
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        let mut chunks = buf.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next_u64().to_le_bytes();
        let n = rest.len();
        rest.copy_from_slice(&last[..n]);
    }

    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.fill(&mut v);
        v
    }
}

/// CRC-32C (Castagnoli, reflected), as VHDX checksums its headers and region tables: tests
/// that craft or damage an image seal what they change with it.
pub fn crc32c(b: &[u8]) -> u32 {
    let mut c = !0u32;
    for &x in b {
        c ^= u32::from(x);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0x82f6_3b78
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// Creates a fully allocated raw image of `size` bytes of seeded pseudo-random data and
/// returns its content (the test's model of the image).
pub fn random_image(path: &Path, size: u64, seed: u64) -> Vec<u8> {
    let data = Rng::new(seed).bytes(size as usize);
    let f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    f.write_all_at(&data, 0).expect("write image");
    f.sync_all().expect("fsync image");
    data
}

/// Creates a sparse (all zeroes, nothing allocated) raw image of `size` bytes.
pub fn sparse_image(path: &Path, size: u64) {
    let f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    f.set_len(size).expect("set_len image");
}

/// Reads up to `len` bytes at `off`, looping over short reads; stops early only at EOF.
pub fn pread_full(f: &File, off: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let mut done = 0;
    while done < len {
        match f.read_at(&mut buf[done..], off + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf.truncate(done);
    Ok(buf)
}

/// Opens a file read-only.
pub fn open_ro(path: &Path) -> File {
    File::open(path).unwrap_or_else(|e| panic!("open {} read-only: {e}", path.display()))
}

/// Opens a file read-write.
pub fn open_rw(path: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {} read-write: {e}", path.display()))
}

/// Opens a file read-write with O_DIRECT.
pub fn open_rw_direct(path: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap_or_else(|e| panic!("open {} read-write O_DIRECT: {e}", path.display()))
}

/// The whole content of a file.
pub fn read_all(path: &Path) -> Vec<u8> {
    let mut v = Vec::new();
    open_ro(path).read_to_end(&mut v).expect("read_to_end");
    v
}

/// Asserts two byte strings are equal; on mismatch reports lengths and the first
/// differing offset (relative to `base`) instead of dumping megabytes.
#[track_caller]
pub fn assert_bytes_eq(actual: &[u8], expected: &[u8], base: u64, what: &str) {
    if actual == expected {
        return;
    }
    let common = actual.len().min(expected.len());
    let first = (0..common).find(|&i| actual[i] != expected[i]);
    let differing = (0..common).filter(|&i| actual[i] != expected[i]).count();
    let snippet = |b: &[u8], at: usize| -> String {
        let end = (at + 16).min(b.len());
        b[at.min(b.len())..end]
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    match first {
        Some(i) => panic!(
            "{what}: content differs: {differing} of {common} compared bytes differ, first at offset {} \
             (range base {base}); lengths actual {} expected {}\n  actual:   {}\n  expected: {}\n  \
             actual all zero: {}",
            base + i as u64,
            actual.len(),
            expected.len(),
            snippet(actual, i),
            snippet(expected, i),
            actual[i..].iter().all(|&b| b == 0),
        ),
        None => panic!(
            "{what}: lengths differ (range base {base}): actual {} expected {} (common prefix equal)",
            actual.len(),
            expected.len()
        ),
    }
}

/// Compares `len` bytes at `off` of two files (short reads at EOF compared as they come).
#[track_caller]
pub fn assert_same_range(mount: &File, backing: &File, off: u64, len: usize, what: &str) {
    let a = pread_full(mount, off, len)
        .unwrap_or_else(|e| panic!("{what}: pread mount at {off}+{len}: {e}"));
    let b = pread_full(backing, off, len)
        .unwrap_or_else(|e| panic!("{what}: pread backing at {off}+{len}: {e}"));
    assert_bytes_eq(
        &a,
        &b,
        off,
        &format!("{what} (mount vs backing at {off}+{len})"),
    );
}

/// A heap buffer with the given alignment, for O_DIRECT.
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
    layout: std::alloc::Layout,
}

// SAFETY: AlignedBuf uniquely owns its allocation, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    pub fn new(len: usize, align: usize) -> AlignedBuf {
        assert!(len > 0);
        let layout = std::alloc::Layout::from_size_align(len, align).expect("layout");
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "allocation of {len} bytes failed");
        AlignedBuf { ptr, len, layout }
    }

    pub fn from_slice(data: &[u8], align: usize) -> AlignedBuf {
        let mut b = AlignedBuf::new(data.len(), align);
        b.as_mut_slice().copy_from_slice(data);
        b
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes for the lifetime of self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for len bytes and uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in new() with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

/// A 64-bit hash (not cryptographic; for equality checks of large files).
pub fn hash_bytes(mut h: u64, data: &[u8]) -> u64 {
    let mut chunks = data.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes(c.try_into().unwrap());
        h = (h.rotate_left(23) ^ w).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    for &b in chunks.remainder() {
        h = (h.rotate_left(23) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    h ^ data.len() as u64
}

/// Hashes of consecutive `chunk`-byte pieces of `len` bytes of `f` (read through
/// pread), so a mismatch can be located.
pub fn chunk_hashes(f: &File, len: u64, chunk: usize) -> Vec<u64> {
    let mut out = Vec::new();
    let mut off = 0;
    while off < len {
        let n = chunk.min((len - off) as usize);
        let data = pread_full(f, off, n).unwrap_or_else(|e| panic!("pread at {off}: {e}"));
        assert_eq!(
            data.len(),
            n,
            "short read at {off} (file shorter than {len}?)"
        );
        out.push(hash_bytes(0, &data));
        off += n as u64;
    }
    out
}

/// The errno of an I/O error (0 if it has none).
pub fn errno(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

/// Name-ish text for an errno, e.g. "ENOSPC (No space left on device)".
pub fn errno_str(code: i32) -> String {
    let name = match code {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EIO => "EIO",
        libc::EBADF => "EBADF",
        libc::EACCES => "EACCES",
        libc::EBUSY => "EBUSY",
        libc::EINVAL => "EINVAL",
        libc::EFBIG => "EFBIG",
        libc::ENOSPC => "ENOSPC",
        libc::EROFS => "EROFS",
        libc::ENOSYS => "ENOSYS",
        libc::ENXIO => "ENXIO",
        libc::ENOTCONN => "ENOTCONN",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::EEXIST => "EEXIST",
        libc::ENOTDIR => "ENOTDIR",
        libc::EISDIR => "EISDIR",
        libc::ENOTEMPTY => "ENOTEMPTY",
        libc::ELOOP => "ELOOP",
        libc::EXDEV => "EXDEV",
        libc::ENODATA => "ENODATA",
        libc::ERANGE => "ERANGE",
        libc::ENAMETOOLONG => "ENAMETOOLONG",
        libc::EMLINK => "EMLINK",
        libc::ESTALE => "ESTALE",
        _ => "E?",
    };
    format!("{name} ({})", io::Error::from_raw_os_error(code))
}

/// lseek(2) returning the offset or the errno.
pub fn lseek(f: &File, off: u64, whence: libc::c_int) -> Result<u64, i32> {
    // SAFETY: plain syscall on a valid fd.
    let r = unsafe { libc::lseek(f.as_raw_fd(), off as libc::off_t, whence) };
    if r < 0 {
        Err(io::Error::last_os_error().raw_os_error().unwrap_or(0))
    } else {
        Ok(r as u64)
    }
}

/// fallocate(2).
pub fn fallocate(f: &File, mode: libc::c_int, off: u64, len: u64) -> io::Result<()> {
    // SAFETY: plain syscall on a valid fd.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), mode, off as libc::off_t, len as libc::off_t) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// stat(2) fields that matter here: (st_size, st_blocks, st_mode).
pub fn stat(path: &Path) -> io::Result<(u64, u64, u32)> {
    use std::os::unix::fs::MetadataExt;
    let m = fs::metadata(path)?;
    Ok((m.size(), m.blocks(), m.mode()))
}

/// fstat(2) fields: (st_size, st_blocks).
pub fn fstat(f: &File) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let m = f.metadata().expect("fstat");
    (m.size(), m.blocks())
}

/// Whether punching a hole in a file in `dir` really deallocates blocks there.
pub fn punch_hole_works_in(dir: &Path) -> bool {
    let p = dir.join(unique("punch-probe"));
    let f = File::create(&p).expect("create probe");
    f.write_all_at(&vec![0xA5u8; 4 * MIB as usize], 0)
        .expect("write probe");
    f.sync_all().expect("fsync probe");
    let before = fstat(&f).1;
    let ok = fallocate(
        &f,
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
        MIB,
        2 * MIB,
    )
    .is_ok();
    f.sync_all().expect("fsync probe");
    let after = fstat(&f).1;
    drop(f);
    let _ = fs::remove_file(&p);
    ok && after < before
}

// ---------------------------------------------------------------------------------------
// /proc/self/mountinfo
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
pub struct MountEntry {
    pub mount_point: PathBuf,
    pub fstype: String,
    pub dev: (u32, u32),
    pub source: String,
    pub line: String,
}

fn unescape_mountinfo(s: &str) -> OsString {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    OsStr::from_bytes(&out).to_os_string()
}

/// All entries of /proc/self/mountinfo.
pub fn mountinfo() -> Vec<MountEntry> {
    let text = fs::read_to_string("/proc/self/mountinfo").expect("read /proc/self/mountinfo");
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let fields: Vec<&str> = left.split(' ').collect();
            let mut right = right.split(' ');
            let fstype = right.next()?.to_string();
            let source = right.next().unwrap_or("").to_string();
            let (maj, min) = fields.get(2)?.split_once(':')?;
            Some(MountEntry {
                mount_point: PathBuf::from(unescape_mountinfo(fields.get(4)?)),
                fstype,
                dev: (maj.parse().ok()?, min.parse().ok()?),
                source,
                line: line.to_string(),
            })
        })
        .collect()
}

/// A FUSE mount shows up with fstype `fuse` or `fuse.<subtype>`.
pub fn is_fuse_fstype(t: &str) -> bool {
    t == "fuse" || t.starts_with("fuse.")
}

/// The FUSE mounts stacked on `path`.
pub fn fuse_mounts_at(path: &Path) -> Vec<MountEntry> {
    mountinfo()
        .into_iter()
        .filter(|m| m.mount_point == path && is_fuse_fstype(&m.fstype))
        .collect()
}

pub fn is_fuse_mounted(path: &Path) -> bool {
    !fuse_mounts_at(path).is_empty()
}

/// Any mount (of any type) stacked on `path`.
pub fn mounts_at(path: &Path) -> Vec<MountEntry> {
    mountinfo()
        .into_iter()
        .filter(|m| m.mount_point == path)
        .collect()
}

/// `umount PATH` (not lazy), as an administrator would run it on an idle export. A process that
/// another test thread forks inherits this test's open files of the export until it execs (they
/// are close-on-exec, not closed at fork), which keeps the mount busy for that moment: "target is
/// busy" is retried until [`TIMEOUT`].
#[track_caller]
pub fn umount_idle(path: &Path) {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let out = run(Command::new("umount").arg(path));
        if out.status.success() {
            return;
        }
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(
            err.contains("busy") && Instant::now() < deadline,
            "umount {}: {err}",
            path.display()
        );
        thread::sleep(Duration::from_millis(20));
    }
}

/// Unmounts whatever export is left at a mountpoint when dropped (`fusex umount`, then a lazy
/// unmount): for exports of daemons a test did not start through [`Mount`] (handed over, or
/// started and killed by hand).
pub struct UnmountOnDrop(pub PathBuf);

impl Drop for UnmountOnDrop {
    fn drop(&mut self) {
        if is_fuse_mounted(&self.0) {
            let _ = std::process::Command::new(fusex_bin())
                .arg("umount")
                .arg(&self.0)
                .output();
        }
        if is_fuse_mounted(&self.0) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .output();
        }
    }
}

/// `umount -l` until no FUSE mount beyond `keep` remains on `path`.
fn lazy_umount_fuse(path: &Path, keep: usize) {
    for _ in 0..8 {
        if fuse_mounts_at(path).len() <= keep {
            return;
        }
        let out = run(Command::new("umount").arg("-l").arg(path));
        if !out.status.success() {
            eprintln!(
                "harness: umount -l {} failed: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Processes
// ---------------------------------------------------------------------------------------

/// Whether a process exists and is not a zombie.
pub fn pid_alive(pid: i32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    match stat.rsplit_once(") ") {
        Some((_, rest)) => !matches!(rest.chars().next(), Some('Z') | Some('X')),
        None => false,
    }
}

pub fn send_signal(pid: i32, sig: libc::c_int) {
    // SAFETY: kill has no memory-safety preconditions.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// The restart socket answering for the export whose state file in root's runtime directory
/// (`/run/fusex`) `names` accepts, if one is bound now. Files a killed daemon left behind stay
/// there (and may name a pid in use again, or an old path), so only a socket bound now counts.
pub fn bound_runtime_socket(names: impl Fn(&str) -> bool) -> Option<PathBuf> {
    let bound = fs::read_to_string("/proc/net/unix").ok()?;
    fs::read_dir("/run/fusex")
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .filter_map(|p| {
            let state = fs::read_to_string(&p).ok().filter(|s| names(s))?;
            // A `fusex serve` daemon's exports name its one socket; a `fusex mount` daemon's
            // socket is beside its state file.
            let socket = serde_json::from_str::<serde_json::Value>(&state)
                .ok()
                .and_then(|v| {
                    v["socket"]
                        .as_str()
                        .map(|n| Path::new("/run/fusex").join(n))
                })
                .unwrap_or_else(|| p.with_extension("sock"));
            Some(socket)
        })
        .find(|s| bound.lines().any(|l| l.ends_with(&*s.to_string_lossy())))
}

/// Polls `cond` until it holds or `deadline` passes; returns whether it held. `cond` is checked
/// once more at the deadline, so a condition that became true just in time is not missed.
///
/// This is how a test waits for something to happen: on the observable condition itself (a file
/// changed, a process ended, a counter moved), never for a guessed time.
pub fn wait_until(deadline: Instant, mut cond: impl FnMut() -> bool) -> bool {
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(1));
    }
}

/// Counts the writes that land in a file (the backing image of a busy export, say) by watching
/// its st_mtime: a write sets st_mtime to the current time, so while nothing but writes touches
/// the file, every change [`WriteWatch::seen`] observes means at least one write completed since
/// the previous look. (Since Linux 6.13, a write after a stat gets a fine-grained time, so
/// back-to-back writes are told apart; otherwise writes within one clock tick count once: an
/// undercount, which only makes a wait on this counter conservative.)
pub struct WriteWatch {
    path: PathBuf,
    last: (i64, i64),
    seen: u64,
}

impl WriteWatch {
    /// Starts watching `path` from its current st_mtime.
    pub fn new(path: &Path) -> WriteWatch {
        WriteWatch {
            path: path.to_path_buf(),
            last: mtime(path),
            seen: 0,
        }
    }

    /// A lower bound of the writes that landed since [`WriteWatch::new`]: the st_mtime changes
    /// observed so far, this look included.
    pub fn seen(&mut self) -> u64 {
        let now = mtime(&self.path);
        if now != self.last {
            self.last = now;
            self.seen += 1;
        }
        self.seen
    }

    /// Waits until more than `n` writes landed or `fio` ended, at most until `deadline`. True if
    /// either happened: callers check `fio` first, with their own message, then this.
    pub fn wait_for_more_than(&mut self, n: u64, fio: &mut ChildGuard, deadline: Instant) -> bool {
        wait_until(deadline, || fio.try_wait().is_some() || self.seen() > n)
    }
}

/// st_mtime as (seconds, nanoseconds).
fn mtime(path: &Path) -> (i64, i64) {
    use std::os::unix::fs::MetadataExt;
    let m = fs::metadata(path).unwrap_or_else(|e| panic!("stat {}: {e}", path.display()));
    (m.mtime(), m.mtime_nsec())
}

/// Waits for a child with a timeout; None if it is still running.
pub fn wait_timeout(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(st)) => return Some(st),
            Ok(None) => {}
            Err(e) => panic!("try_wait: {e}"),
        }
        if Instant::now() >= deadline {
            return None;
        }
        thread::sleep(Duration::from_millis(10));
    }
}

/// Outcome of a command run through [`run_with_timeout`].
#[derive(Debug)]
pub struct CmdResult {
    /// Exit code; None if killed by a signal.
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl CmdResult {
    /// stderr lines, ignoring a trailing empty line.
    pub fn stderr_lines(&self) -> Vec<&str> {
        self.stderr.lines().collect()
    }

    /// The contract for a rejected invocation: exit code 1, exactly one line on stderr of
    /// the form `fusex: error: <what>: <what to do>`, nothing on stdout.
    #[track_caller]
    pub fn assert_one_error_line(&self, what: &str) {
        let lines = self.stderr_lines();
        assert!(
            self.code.is_some() && self.code != Some(0),
            "{what}: expected a non-zero exit, got {:?}; stderr:\n{}",
            self.code,
            self.stderr
        );
        assert_eq!(
            self.code,
            Some(1),
            "{what}: contract says exit code 1; stderr:\n{}",
            self.stderr
        );
        assert_eq!(
            lines.len(),
            1,
            "{what}: expected exactly one line on stderr, got {}:\n{}",
            lines.len(),
            self.stderr
        );
        let line = lines[0];
        let rest = line.strip_prefix("fusex: error: ").unwrap_or_else(|| {
            panic!("{what}: stderr line does not start with \"fusex: error: \": {line:?}")
        });
        assert!(
            rest.contains(": "),
            "{what}: error line should read \"fusex: error: <what>: <what to do>\": {line:?}"
        );
        assert!(
            self.stdout.is_empty(),
            "{what}: fusex must print nothing to stdout, got {:?}",
            self.stdout
        );
    }
}

/// Runs `cmd` (stdin null, stdout/stderr to files in `work`) and waits up to [`TIMEOUT`].
/// If it is still running then — a bad invocation that mounted and stayed in the
/// foreground — it is terminated, any FUSE mount it added on `mountpoint` is removed,
/// and the test panics.
pub fn run_with_timeout(work: &WorkDir, mut cmd: Command, mountpoint: Option<&Path>) -> CmdResult {
    let tag = unique("cmd");
    let out_path = work.join(format!("{tag}.stdout"));
    let err_path = work.join(format!("{tag}.stderr"));
    let baseline = mountpoint.map(|p| fuse_mounts_at(p).len()).unwrap_or(0);
    cmd.stdin(Stdio::null())
        .stdout(File::create(&out_path).expect("create stdout file"))
        .stderr(File::create(&err_path).expect("create stderr file"))
        .env_remove("RUST_LOG");
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let status = wait_timeout(&mut child, TIMEOUT);
    if status.is_none() {
        let pid = child.id() as i32;
        send_signal(pid, libc::SIGTERM);
        let gone = wait_timeout(&mut child, TIMEOUT).is_some();
        if let Some(mp) = mountpoint {
            lazy_umount_fuse(mp, baseline);
        }
        if !gone {
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!(
            "{cmd:?} was still running after {TIMEOUT:?} (did it accept bad input and mount?); \
             stderr:\n{}",
            read_lossy(&err_path)
        );
    }
    CmdResult {
        code: status.unwrap().code(),
        stdout: read_lossy(&out_path),
        stderr: read_lossy(&err_path),
    }
}

/// `fusex <args>` through [`run_with_timeout`].
pub fn run_fusex<S: AsRef<OsStr>>(
    work: &WorkDir,
    args: &[S],
    mountpoint: Option<&Path>,
) -> CmdResult {
    let mut cmd = Command::new(fusex_bin());
    cmd.args(args);
    run_with_timeout(work, cmd, mountpoint)
}

// ---------------------------------------------------------------------------------------
// The Mount guard
// ---------------------------------------------------------------------------------------

/// How [`Mount`] starts fusex beyond its arguments: a command that runs it (e.g. `setpriv` as
/// another user), extra environment, and a directory for the files the daemon itself writes
/// (`--stats-file`), which must be one the daemon's user may write.
#[derive(Clone, Debug, Default)]
pub struct SpawnOpts {
    /// Program and arguments put before the fusex binary (which `exec`s it: the pid stays).
    pub wrapper: Vec<OsString>,
    /// Extra environment variables.
    pub env: Vec<(OsString, OsString)>,
    /// Where the stats file goes (default: the WorkDir).
    pub files_dir: Option<PathBuf>,
}

/// A fusex invocation that did not produce a mount.
#[derive(Debug)]
pub struct MountFailed {
    pub code: Option<i32>,
    pub stderr: String,
    pub stdout: String,
}

/// How long [`Mount::stop`] lets a daemon that reported files still open end by itself before it
/// signals again: time for the RELEASE of a file just closed, not a bound on anything measured.
const RELEASE_GRACE: Duration = Duration::from_secs(2);

/// What the daemon logs when a stop finds files still open on the export, which it then serves
/// until they are closed.
pub const STILL_OPEN: &str = "still open on the export";

/// A live fusex export. Dropping it stops the daemon (SIGTERM, then `umount -l` and
/// SIGKILL if needed) and never leaves the mount behind.
pub struct Mount {
    /// The foreground daemon, or the `--daemonize` parent (already reaped).
    child: Option<Child>,
    daemonized: bool,
    pid: i32,
    mountpoint: PathBuf,
    baseline: usize,
    stdout_path: PathBuf,
    stderr_path: PathBuf,
    stats_path: PathBuf,
    done: bool,
    watchdog: Option<mpsc::Sender<()>>,
    /// The mountpoint belongs to another mount now: cleanup must not touch it.
    handed_over: bool,
}

/// What [`Mount::stop`] observed.
#[derive(Debug)]
pub struct Stopped {
    /// The daemon exited by itself within [`TIMEOUT`] (no SIGKILL needed).
    pub exited: bool,
    /// Exit code (None: killed by a signal, or a daemonized process we cannot reap).
    pub code: Option<i32>,
    /// Killed by this signal (foreground daemon only).
    pub signal: Option<i32>,
    pub daemonized: bool,
    /// The FUSE mount was still there after the daemon had exited.
    pub left_mounted: bool,
    pub stdout: String,
    pub stderr: String,
    /// The parsed `--stats-file`, if it was written and parses.
    pub stats: Option<Value>,
    pub stats_raw: Option<String>,
}

impl Stopped {
    /// Exit 0 within the timeout, nothing left mounted, nothing on stdout, no error or
    /// panic in the log.
    #[track_caller]
    pub fn assert_clean(&self, what: &str) {
        assert!(
            self.exited,
            "{what}: daemon did not exit within {TIMEOUT:?} (killed); stderr:\n{}",
            self.stderr
        );
        if !self.daemonized {
            assert_eq!(
                self.code,
                Some(0),
                "{what}: daemon exit status (signal {:?}); stderr:\n{}",
                self.signal,
                self.stderr
            );
        }
        assert!(
            !self.left_mounted,
            "{what}: the FUSE mount was still there after the daemon exited; stderr:\n{}",
            self.stderr
        );
        assert!(
            self.stdout.is_empty(),
            "{what}: fusex must print nothing to stdout, got {:?}",
            self.stdout
        );
        self.assert_no_errors_logged(what);
    }

    /// No line of the daemon's stderr mentions "error" or "panic" (case-insensitive).
    #[track_caller]
    pub fn assert_no_errors_logged(&self, what: &str) {
        let bad: Vec<&str> = self
            .stderr
            .lines()
            .filter(|l| {
                let l = l.to_ascii_lowercase();
                l.contains("error") || l.contains("panic")
            })
            .collect();
        assert!(
            bad.is_empty(),
            "{what}: daemon logged errors:\n{}\n--- full stderr ---\n{}",
            bad.join("\n"),
            self.stderr
        );
    }

    /// The stats JSON; panics if it is missing.
    #[track_caller]
    pub fn stats(&self) -> &Value {
        self.stats.as_ref().unwrap_or_else(|| {
            panic!(
                "no parseable --stats-file after exit (raw: {:?}); stderr:\n{}",
                self.stats_raw, self.stderr
            )
        })
    }

    /// A counter from the stats, e.g. `stat(&["backend", "flushes"])`. A missing op
    /// counter under "ops" counts as 0; any other missing key panics.
    #[track_caller]
    pub fn stat(&self, path: &[&str]) -> u64 {
        let mut v = self.stats();
        for (i, k) in path.iter().enumerate() {
            match v.get(k) {
                Some(x) => v = x,
                None if i == 1 && path[0] == "ops" && v.is_object() => return 0,
                None => panic!("stats have no {path:?}: {}", self.stats()),
            }
        }
        v.as_u64()
            .unwrap_or_else(|| panic!("stats {path:?} is not a u64: {v} in {}", self.stats()))
    }

    /// A boolean from the stats, e.g. `flag(&["exit_flush"])`; a missing key panics.
    #[track_caller]
    pub fn flag(&self, path: &[&str]) -> bool {
        let mut v = self.stats();
        for k in path {
            v = v
                .get(k)
                .unwrap_or_else(|| panic!("stats have no {path:?}: {}", self.stats()));
        }
        v.as_bool()
            .unwrap_or_else(|| panic!("stats {path:?} is not a bool: {v} in {}", self.stats()))
    }

    /// FLUSH + FSYNC requests. On a writable export each of them flushes the backend once, and
    /// `backend.flushes` counts only the flushes requests caused (the one at exit is
    /// `exit_flush`), so without `--writethrough` the two are equal.
    #[track_caller]
    pub fn requested_flushes(&self) -> u64 {
        self.stat(&["ops", "FLUSH"]) + self.stat(&["ops", "FSYNC"])
    }
}

impl Mount {
    /// `fusex mount [args] --stats-file S IMAGE MOUNTPOINT` in the foreground; returns once
    /// the mountpoint shows up as a FUSE mount. Panics (with the daemon's stderr) if it
    /// exits early or does not mount within [`TIMEOUT`].
    #[track_caller]
    pub fn start(
        work: &WorkDir,
        image: impl AsRef<OsStr>,
        mountpoint: &Path,
        args: &[&str],
    ) -> Mount {
        let image = image.as_ref().to_os_string();
        match Mount::try_start(work, &image, mountpoint, args) {
            Ok(m) => m,
            Err(f) => panic!(
                "fusex mount {args:?} {image:?} {} failed (exit {:?}); stderr:\n{}",
                mountpoint.display(),
                f.code,
                f.stderr
            ),
        }
    }

    /// Like [`Mount::start`], returning the failure instead of panicking.
    pub fn try_start(
        work: &WorkDir,
        image: impl AsRef<OsStr>,
        mountpoint: &Path,
        args: &[&str],
    ) -> Result<Mount, MountFailed> {
        Mount::try_start_opts(work, image, mountpoint, args, &SpawnOpts::default())
    }

    /// Like [`Mount::try_start`], started as `opts` says.
    pub fn try_start_opts(
        work: &WorkDir,
        image: impl AsRef<OsStr>,
        mountpoint: &Path,
        args: &[&str],
        opts: &SpawnOpts,
    ) -> Result<Mount, MountFailed> {
        let mut m = Mount::spawn(work, image.as_ref(), mountpoint, args, false, None, opts);
        let deadline = Instant::now() + TIMEOUT;
        loop {
            // The mount exists from mount(2) on; the export is ready once INIT is answered,
            // which the daemon logs as "mounted ... at ...".
            if fuse_mounts_at(&m.mountpoint).len() > m.baseline
                && read_lossy(&m.stderr_path).contains("INFO mounted ")
            {
                m.arm_watchdog();
                return Ok(m);
            }
            let child = m.child.as_mut().unwrap();
            if let Some(st) = child.try_wait().expect("try_wait") {
                m.done = true;
                return Err(MountFailed {
                    code: st.code(),
                    stderr: read_lossy(&m.stderr_path),
                    stdout: read_lossy(&m.stdout_path),
                });
            }
            if Instant::now() >= deadline {
                let stderr = read_lossy(&m.stderr_path);
                m.finish(true);
                panic!(
                    "fusex did not mount {} within {TIMEOUT:?} and did not exit; stderr:\n{stderr}",
                    m.mountpoint.display()
                );
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// `fusex mount --daemonize --pid-file P [args] ...`: waits for the parent to exit.
    /// Ok((mount, mounted_when_parent_returned)) when the parent exited 0.
    pub fn start_daemonized(
        work: &WorkDir,
        image: impl AsRef<OsStr>,
        mountpoint: &Path,
        pid_file: &Path,
        args: &[&str],
    ) -> Result<(Mount, bool), MountFailed> {
        Mount::start_daemonized_opts(
            work,
            image,
            mountpoint,
            pid_file,
            args,
            &SpawnOpts::default(),
        )
    }

    /// Like [`Mount::start_daemonized`], started as `opts` says.
    pub fn start_daemonized_opts(
        work: &WorkDir,
        image: impl AsRef<OsStr>,
        mountpoint: &Path,
        pid_file: &Path,
        args: &[&str],
        opts: &SpawnOpts,
    ) -> Result<(Mount, bool), MountFailed> {
        let mut m = Mount::spawn(
            work,
            image.as_ref(),
            mountpoint,
            args,
            true,
            Some(pid_file),
            opts,
        );
        let child = m.child.as_mut().unwrap();
        let status = wait_timeout(child, TIMEOUT);
        // Checked before anything else: the contract is that the mount is live when the
        // parent returns.
        let mounted_at_return = fuse_mounts_at(&m.mountpoint).len() > m.baseline;
        let Some(status) = status else {
            let stderr = read_lossy(&m.stderr_path);
            m.finish(true);
            panic!("fusex --daemonize parent did not return within {TIMEOUT:?}; stderr:\n{stderr}");
        };
        if !status.success() {
            m.done = true;
            if mounted_at_return {
                // Should not happen; clean up whatever is there.
                lazy_umount_fuse(&m.mountpoint, m.baseline);
            }
            return Err(MountFailed {
                code: status.code(),
                stderr: read_lossy(&m.stderr_path),
                stdout: read_lossy(&m.stdout_path),
            });
        }
        let pid_text = fs::read_to_string(pid_file).unwrap_or_default();
        match pid_text.trim().parse::<i32>() {
            Ok(pid) if pid > 0 => m.pid = pid,
            _ => {
                // Without a pid we can only unmount.
                m.pid = 0;
                lazy_umount_fuse(&m.mountpoint, m.baseline);
                m.done = true;
                panic!(
                    "fusex --daemonize exited 0 but pid file {} holds {pid_text:?}; stderr:\n{}",
                    pid_file.display(),
                    read_lossy(&m.stderr_path)
                );
            }
        }
        if !mounted_at_return {
            // Let the guard find the mount if it shows up late, so cleanup is complete.
            let deadline = Instant::now() + TIMEOUT;
            while Instant::now() < deadline
                && pid_alive(m.pid)
                && fuse_mounts_at(&m.mountpoint).len() <= m.baseline
            {
                thread::sleep(Duration::from_millis(10));
            }
        }
        m.arm_watchdog();
        Ok((m, mounted_at_return))
    }

    fn spawn(
        work: &WorkDir,
        image: &OsStr,
        mountpoint: &Path,
        args: &[&str],
        daemonize: bool,
        pid_file: Option<&Path>,
        opts: &SpawnOpts,
    ) -> Mount {
        let tag = unique("fusex");
        let stdout_path = work.join(format!("{tag}.stdout"));
        let stderr_path = work.join(format!("{tag}.stderr"));
        let stats_path = opts
            .files_dir
            .as_deref()
            .unwrap_or(work.path())
            .join(format!("{tag}.stats.json"));
        let baseline = fuse_mounts_at(mountpoint).len();
        let mut cmd = match opts.wrapper.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(fusex_bin());
                c
            }
            None => Command::new(fusex_bin()),
        };
        cmd.envs(opts.env.iter().map(|(k, v)| (k, v)));
        cmd.arg("mount");
        if daemonize {
            cmd.arg("--daemonize");
        }
        if let Some(p) = pid_file {
            cmd.arg("--pid-file").arg(p);
        }
        cmd.args(args);
        // The whole suite runs once per transport: FUSEX_E2E_TRANSPORT=legacy|uring picks it
        // for every mount that does not choose one itself.
        if let Ok(t) = std::env::var("FUSEX_E2E_TRANSPORT") {
            if !t.is_empty() && !args.contains(&"--transport") {
                cmd.arg("--transport").arg(t);
            }
        }
        cmd.arg("--stats-file")
            .arg(&stats_path)
            .arg(image)
            .arg(mountpoint)
            .stdin(Stdio::null())
            .stdout(File::create(&stdout_path).expect("create stdout file"))
            .stderr(File::create(&stderr_path).expect("create stderr file"))
            .env_remove("RUST_LOG");
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot spawn {cmd:?}: {e}"));
        Mount {
            pid: child.id() as i32,
            child: Some(child),
            daemonized: daemonize,
            mountpoint: mountpoint.to_path_buf(),
            baseline,
            stdout_path,
            stderr_path,
            stats_path,
            done: false,
            watchdog: None,
            handed_over: false,
        }
    }

    /// Kills the daemon if the test is still running after a long time, so that a hung
    /// request fails the test (ENOTCONN) instead of hanging the whole run.
    fn arm_watchdog(&mut self) {
        let secs = std::env::var("FUSEX_E2E_WATCHDOG_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(150u64);
        let (tx, rx) = mpsc::channel::<()>();
        let pid = self.pid;
        let mp = self.mountpoint.clone();
        thread::spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(Duration::from_secs(secs))
            {
                eprintln!(
                    "harness watchdog: mount {} still up after {secs}s, killing fusex pid {pid}",
                    mp.display()
                );
                if pid > 0 && pid_alive(pid) {
                    send_signal(pid, libc::SIGKILL);
                }
            }
        });
        self.watchdog = Some(tx);
    }

    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    /// The daemon's pid.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// `fusex restart`: a new daemon, `pid`, serves this mount now (and is the one stopped,
    /// watched and cleaned up after). Only for daemonized mounts, whose pid is all there is.
    pub fn adopt_pid(&mut self, pid: i32) {
        assert!(
            self.daemonized,
            "adopt_pid: only a daemonized mount changes its daemon"
        );
        self.pid = pid;
        if let Some(w) = self.watchdog.take() {
            let _ = w.send(());
        }
        self.arm_watchdog();
    }

    /// The daemon's stderr so far.
    pub fn stderr(&self) -> String {
        read_lossy(&self.stderr_path)
    }

    pub fn stats_path(&self) -> &Path {
        &self.stats_path
    }

    pub fn is_mounted(&self) -> bool {
        fuse_mounts_at(&self.mountpoint).len() > self.baseline
    }

    /// Sends a signal to the daemon.
    pub fn signal(&self, sig: libc::c_int) {
        if self.pid > 0 {
            send_signal(self.pid, sig);
        }
    }

    /// The daemon's counters as they stand: sends SIGUSR1 and waits, until `deadline`, for the
    /// fresh dump the daemon writes to its `--stats-file` (numbered by its "dump" field). None if
    /// none came.
    pub fn live_stats(&self, deadline: Instant) -> Option<Value> {
        let read = || {
            fs::read(&self.stats_path)
                .ok()
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        };
        let dump = |v: &Value| v.get("dump").and_then(Value::as_u64);
        let before = read().as_ref().and_then(dump).unwrap_or(0);
        self.signal(libc::SIGUSR1);
        loop {
            if let Some(v) = read() {
                if dump(&v).is_some_and(|n| n > before) {
                    return Some(v);
                }
            }
            if Instant::now() >= deadline {
                return None;
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits, until `deadline`, for the daemon to make progress that `measure` reads from its
    /// live stats: takes a first reading, then reads again until `moved(first, latest)`. For tests
    /// that must see the daemon busy in some way (every queue serving, requests handed between
    /// threads) before they act. Returns both readings and whether it moved.
    pub fn wait_for_stats<T: Clone>(
        &self,
        deadline: Instant,
        measure: impl Fn(&Value) -> T,
        moved: impl Fn(&T, &T) -> bool,
    ) -> StatsProgress<T> {
        let Some(first) = self.live_stats(deadline).map(|v| measure(&v)) else {
            return StatsProgress {
                readings: None,
                moved: false,
            };
        };
        let mut latest = first.clone();
        let ok = wait_until(deadline, || {
            if let Some(v) = self.live_stats(deadline) {
                latest = measure(&v);
            }
            moved(&first, &latest)
        });
        StatsProgress {
            readings: Some((first, latest)),
            moved: ok,
        }
    }

    pub fn open_ro(&self) -> File {
        open_ro(&self.mountpoint)
    }

    pub fn open_rw(&self) -> File {
        open_rw(&self.mountpoint)
    }

    /// SIGTERM, wait for the exit, collect status, stderr and stats.
    pub fn stop(mut self) -> Stopped {
        self.finish(true)
    }

    /// Wait (without signalling) for the daemon to exit, e.g. after an external unmount
    /// or a signal sent with [`Mount::signal`].
    pub fn wait_exit(mut self) -> Stopped {
        self.finish(false)
    }

    /// Wait (without signalling) for the daemon to exit after its mount was unmounted and the
    /// mountpoint may already carry the next export: unlike [`Mount::wait_exit`] nothing at the
    /// mountpoint is touched (no `umount -l`) and `left_mounted` stays false; the caller checks
    /// the mountpoint itself.
    pub fn wait_exit_handed_over(mut self) -> Stopped {
        self.handed_over = true;
        self.finish(false)
    }

    /// Waits until `deadline` for the daemon to be gone (a foreground daemon: reaped, so every
    /// thread has exited and every descriptor it held is closed), touching nothing at the
    /// mountpoint: the guard still cleans up when dropped. For tests that kill the daemon and
    /// then look at what it left behind.
    pub fn wait_gone(&mut self, deadline: Instant) -> bool {
        wait_until(deadline, || self.try_reap().is_some())
    }

    /// Polls for the daemon's end; Some((code, signal)) once it is gone.
    fn try_reap(&mut self) -> Option<(Option<i32>, Option<i32>)> {
        use std::os::unix::process::ExitStatusExt;
        if self.daemonized {
            if self.pid <= 0 || !pid_alive(self.pid) {
                return Some((None, None));
            }
            return None;
        }
        let child = self.child.as_mut()?;
        match child.try_wait() {
            Ok(Some(st)) => Some((st.code(), st.signal())),
            Ok(None) => None,
            Err(e) => panic!("try_wait: {e}"),
        }
    }

    /// Whether the daemon, after a stop signal, detached its export and serves files still open
    /// on it: it logged so (foreground), or its mount left the path while it lives (daemonized,
    /// whose log is gone).
    fn serving_open_files(&self) -> bool {
        if self.daemonized {
            !self.is_mounted()
        } else {
            self.stderr().contains(STILL_OPEN)
        }
    }

    /// Waits until `deadline` for the daemon's stderr to contain `needle`.
    pub fn wait_for_log(&self, needle: &str, deadline: Instant) -> bool {
        wait_until(deadline, || self.stderr().contains(needle))
    }

    /// A stop that aborts whatever still uses the export, as two Ctrl-C do: SIGTERM, and once
    /// the daemon says files are still open (and it serves them on), SIGTERM again. Panics if
    /// the daemon does not say so within [`TIMEOUT`].
    #[track_caller]
    pub fn stop_signals_twice(&self) {
        self.signal(libc::SIGTERM);
        assert!(
            self.wait_for_log(STILL_OPEN, Instant::now() + TIMEOUT),
            "after SIGTERM the daemon did not say files are still open; stderr:\n{}",
            self.stderr()
        );
        self.signal(libc::SIGTERM);
    }

    fn finish(&mut self, sigterm: bool) -> Stopped {
        self.done = true;
        if sigterm {
            self.signal(libc::SIGTERM);
        }
        // A stop used to end the export whatever still had it open; now the daemon serves open
        // files on until they close, and a second signal aborts them. Cleanup (and the tests
        // that stop an export they still hold open) want the old stop: signal again, but only
        // once the files stayed open for a while. A file a test has just closed can still count
        // as open when the first signal lands (the kernel sends RELEASE after close returns),
        // and its RELEASE then ends the export by itself, with the full final statistics that
        // an abort would not write.
        let mut escalated = !sigterm;
        let mut open_since: Option<Instant> = None;
        let deadline = Instant::now() + TIMEOUT;
        let mut reaped = None;
        loop {
            if let Some(r) = self.try_reap() {
                reaped = Some(r);
                break;
            }
            if !escalated && self.serving_open_files() {
                let since = *open_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= RELEASE_GRACE {
                    escalated = true;
                    self.signal(libc::SIGTERM);
                }
            }
            if Instant::now() >= deadline {
                break;
            }
            thread::sleep(Duration::from_millis(10));
        }
        let exited = reaped.is_some();
        let left_mounted = exited && !self.handed_over && self.is_mounted();
        if !exited {
            eprintln!(
                "harness: fusex pid {} did not exit within {TIMEOUT:?}; umount -l + SIGKILL",
                self.pid
            );
        }
        if !self.handed_over {
            lazy_umount_fuse(&self.mountpoint, self.baseline);
        }
        let (code, signal) = match reaped {
            Some(r) => r,
            None => {
                if self.pid > 0 {
                    send_signal(self.pid, libc::SIGKILL);
                }
                if let Some(c) = self.child.as_mut() {
                    let _ = c.wait();
                }
                let deadline = Instant::now() + TIMEOUT;
                while self.pid > 0 && pid_alive(self.pid) && Instant::now() < deadline {
                    thread::sleep(Duration::from_millis(10));
                }
                if !self.handed_over {
                    lazy_umount_fuse(&self.mountpoint, self.baseline);
                }
                (None, Some(libc::SIGKILL))
            }
        };
        if let Some(w) = self.watchdog.take() {
            let _ = w.send(());
        }
        // Non-blocking: a test may have planted a FIFO there.
        let stats_raw = File::options()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&self.stats_path)
            .and_then(|mut f| {
                let mut s = String::new();
                f.read_to_string(&mut s).map(|_| s)
            })
            .ok();
        let stats = stats_raw
            .as_deref()
            .and_then(|s| serde_json::from_str(s).ok());
        Stopped {
            exited,
            code,
            signal,
            daemonized: self.daemonized,
            left_mounted,
            stdout: read_lossy(&self.stdout_path),
            stderr: read_lossy(&self.stderr_path),
            stats,
            stats_raw,
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if thread::panicking() {
            eprintln!(
                "--- fusex (pid {}) stderr for {} ---\n{}--- end of fusex stderr ---",
                self.pid,
                self.mountpoint.display(),
                self.stderr()
            );
        }
        let st = self.finish(true);
        if !st.exited || st.left_mounted {
            eprintln!(
                "harness: cleanup of {} needed force (exited: {}, left mounted: {})",
                self.mountpoint.display(),
                st.exited,
                st.left_mounted
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Other guards
// ---------------------------------------------------------------------------------------

/// A loop device attached to a file; detached on drop.
pub struct LoopDev {
    pub dev: PathBuf,
    attached: bool,
}

impl LoopDev {
    pub fn attach(file: &Path, read_only: bool) -> LoopDev {
        let mut cmd = Command::new("losetup");
        cmd.arg("--find").arg("--show");
        if read_only {
            cmd.arg("--read-only");
        }
        cmd.arg(file);
        let out = run_ok(&mut cmd);
        let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert!(dev.starts_with("/dev/loop"), "losetup printed {dev:?}");
        LoopDev {
            dev: PathBuf::from(dev),
            attached: true,
        }
    }

    /// Detaches now, asserting success.
    pub fn detach(mut self) {
        self.attached = false;
        run_ok(Command::new("losetup").arg("-d").arg(&self.dev));
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        if !self.attached {
            return;
        }
        for _ in 0..20 {
            if run(Command::new("losetup").arg("-d").arg(&self.dev))
                .status
                .success()
            {
                return;
            }
            thread::sleep(Duration::from_millis(100));
        }
        eprintln!("harness: could not detach {}", self.dev.display());
    }
}

/// A mounted filesystem (`mount [-o opts] SRC TARGET`); unmounted on drop.
pub struct FsMount {
    pub target: PathBuf,
    active: bool,
}

impl FsMount {
    pub fn mount(src: &Path, target: &Path, opts: &[&str]) -> FsMount {
        let mut cmd = Command::new("mount");
        if !opts.is_empty() {
            cmd.arg("-o").arg(opts.join(","));
        }
        cmd.arg(src).arg(target);
        run_ok(&mut cmd);
        FsMount {
            target: target.to_path_buf(),
            active: true,
        }
    }

    /// Unmounts now, asserting success.
    pub fn unmount(mut self) {
        self.active = false;
        run_ok(Command::new("umount").arg(&self.target));
    }
}

impl Drop for FsMount {
    fn drop(&mut self) {
        if !self.active {
            return;
        }
        if !run(Command::new("umount").arg(&self.target))
            .status
            .success()
        {
            let _ = run(Command::new("umount").arg("-l").arg(&self.target));
        }
    }
}

/// `chattr +i` on a file; `chattr -i` on drop.
pub struct Immutable(PathBuf);

impl Immutable {
    /// None if the filesystem does not support the flag.
    pub fn set(path: &Path) -> Option<Immutable> {
        let out = run(Command::new("chattr").arg("+i").arg(path));
        if out.status.success() {
            Some(Immutable(path.to_path_buf()))
        } else {
            eprintln!(
                "chattr +i {} unsupported: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
            None
        }
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        let _ = run(Command::new("chattr").arg("-i").arg(&self.0));
    }
}

/// A read-only bind mount of `src` on `target`; unmounted on drop.
pub struct ReadOnlyBind(FsMount);

impl ReadOnlyBind {
    pub fn new(src: &Path, target: &Path) -> ReadOnlyBind {
        let m = FsMount::mount(src, target, &["bind"]);
        run_ok(
            Command::new("mount")
                .arg("-o")
                .arg("remount,ro,bind")
                .arg(target),
        );
        ReadOnlyBind(m)
    }

    pub fn target(&self) -> &Path {
        &self.0.target
    }
}

/// A child process killed (SIGKILL) and reaped on drop, e.g. a load generator.
pub struct ChildGuard(pub Child);

impl ChildGuard {
    pub fn pid(&self) -> i32 {
        self.0.id() as i32
    }

    /// The exit status if the process has ended (reaping it), None while it runs.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.0.try_wait().expect("try_wait")
    }

    /// Kills (if still running) and reaps; returns the exit status.
    pub fn kill_and_wait(&mut self) -> ExitStatus {
        let _ = self.0.kill();
        self.0.wait().expect("wait")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The parent pid of a process (from /proc/PID/stat), if it exists.
pub fn ppid_of(pid: i32) -> Option<i32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(") ")?;
    rest.split(' ').nth(1)?.parse().ok()
}

/// Pids of the processes (other than this one) that have `path` open.
pub fn pids_with_open(path: &Path) -> Vec<i32> {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    let mut out = Vec::new();
    let Ok(procs) = fs::read_dir("/proc") else {
        return out;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(fds) = fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        if fds
            .flatten()
            .any(|fd| fs::read_link(fd.path()).map(|t| t == path).unwrap_or(false))
        {
            out.push(pid);
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// fio
// ---------------------------------------------------------------------------------------

/// fio against `target` with what every test's fio needs beside `args`: jobs as threads
/// (killing fio then stops its I/O), O_DIRECT, no preallocation, a new random sequence each
/// run, no verify state file left behind; run in `work` with stdin closed.
pub fn fio_command(work: &WorkDir, target: &Path, args: &[&str]) -> Command {
    let mut filename = OsString::from("--filename=");
    filename.push(target);
    let mut cmd = Command::new("fio");
    // --thread: jobs are threads of one process, so killing fio really stops its I/O (forked job
    // processes outlive a killed parent and keep the export busy).
    cmd.args([
        "--thread",
        "--direct=1",
        "--fallocate=none",
        "--randrepeat=0",
        "--verify_state_save=0",
    ])
    .args(args)
    .arg(&filename)
    .current_dir(work.path())
    .stdin(Stdio::null());
    cmd
}

/// Runs fio against `target` (direct I/O, no state files left behind) and returns its output;
/// panics with the output if fio fails (a failed verify included).
#[track_caller]
pub fn run_fio(work: &WorkDir, target: &Path, args: &[&str]) -> String {
    let out = fio_command(work, target, args).output().expect("run fio");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "fio {args:?} failed ({}):\n{text}",
        out.status
    );
    assert!(
        !text.contains("verify: bad"),
        "fio reported corruption:\n{text}"
    );
    text
}

/// A 30-second 4k random read/write load on `target` with libaio at `iodepth` per job and
/// `numjobs` jobs, started as [`spawn_fio`] does: the load a test stops, unmounts or signals the
/// daemon under.
pub fn spawn_randrw_load(work: &WorkDir, target: &Path, iodepth: u32, numjobs: u32) -> ChildGuard {
    let iodepth = format!("--iodepth={iodepth}");
    let numjobs = format!("--numjobs={numjobs}");
    spawn_fio(
        work,
        target,
        &[
            "--name=load",
            "--rw=randrw",
            "--bs=4k",
            "--ioengine=libaio",
            &iodepth,
            &numjobs,
            "--time_based",
            "--runtime=30",
            "--size=16M",
        ],
        1,
    )
}

/// Starts fio against `target` in the background and returns once `jobs` processes have the file
/// open (fio runs its jobs as threads: one process) (so a test can act while I/O is in flight). The guard kills fio when dropped.
pub fn spawn_fio(work: &WorkDir, target: &Path, args: &[&str], jobs: usize) -> ChildGuard {
    let fio = ChildGuard(
        fio_command(work, target, args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn fio"),
    );
    let deadline = Instant::now() + TIMEOUT;
    while pids_with_open(target).len() < jobs && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
    }
    fio
}

/// 4 fio jobs, each writing its own 4 MiB region of a 16 MiB export with crc32c verification
/// headers and reading it back.
pub const FIO_VERIFY_4_JOBS: &[&str] = &[
    "--name=verify",
    "--rw=randwrite",
    "--bs=4k",
    "--ioengine=libaio",
    "--iodepth=16",
    "--numjobs=4",
    "--size=4M",
    "--offset_increment=4M",
    "--verify=crc32c",
    "--do_verify=1",
    "--verify_fatal=1",
];

/// Exports a 16 MiB random image writable with `args`, runs [`FIO_VERIFY_4_JOBS`] on it, checks
/// the export against the backing file chunk by chunk (the oracle), stops the daemon cleanly and
/// returns how it ended, for the caller's own assertions on the stats.
#[track_caller]
pub fn verified_fio_run(tag: &str, seed: u64, args: &[&str]) -> Stopped {
    let w = WorkDir::new(tag);
    let img = w.join("disk.img");
    random_image(&img, 16 * MIB, seed);
    let mp = w.join("export");
    let mut all = vec!["--writable"];
    all.extend_from_slice(args);
    let m = Mount::start(&w, &img, &mp, &all);
    // Spread the jobs over every CPU, so that every queue has submitters near it: a legacy queue
    // only wins requests when it is the first to read them.
    let ncpu = thread::available_parallelism().map_or(1, |n| n.get());
    let cpus = format!("--cpus_allowed=0-{}", ncpu - 1);
    let mut fio_args = FIO_VERIFY_4_JOBS.to_vec();
    fio_args.extend_from_slice(&[&cpus, "--cpus_allowed_policy=split"]);
    run_fio(&w, &mp, &fio_args);
    let mount_hashes = chunk_hashes(&File::open(&mp).unwrap(), 16 * MIB, 1 << 20);
    let st = m.stop();
    st.assert_clean(tag);
    let backing_hashes = chunk_hashes(&File::open(&img).unwrap(), 16 * MIB, 1 << 20);
    assert_eq!(
        mount_hashes, backing_hashes,
        "{tag}: export and backing file differ after verify"
    );
    st
}

/// A qcow2 image's guest bytes as QEMU sees them, after `qemu-img check` found it clean:
/// `qemu-img convert -O raw` into `work`, read back.
#[track_caller]
pub fn qcow2_guest_bytes(work: &WorkDir, img: &Path) -> Vec<u8> {
    let check = run(Command::new("qemu-img")
        .args(["check", "-f", "qcow2"])
        .arg(img));
    assert!(
        check.status.success(),
        "qemu-img check {}: {}{}",
        img.display(),
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    let out = work.join(unique("guest.raw"));
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-f", "qcow2", "-O", "raw"])
            .arg(img)
            .arg(&out),
    );
    read_all(&out)
}

// ---------------------------------------------------------------------------------------
// Stopped and dead daemons
// ---------------------------------------------------------------------------------------

/// The state letter of a process (`R`, `S`, `D`, `T`, `Z`, ...), None once it is gone.
pub fn proc_state(pid: i32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

/// The kernel function a sleeping process waits in (`/proc/PID/wchan`), empty if unknown.
pub fn wchan(pid: i32) -> String {
    fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default()
}

/// Pids of the live children of `ppid` whose name (comm) is `comm`.
pub fn children_named(ppid: i32, comm: &str) -> Vec<i32> {
    let Ok(procs) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .flatten()
        .filter_map(|p| p.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| {
            ppid_of(pid) == Some(ppid)
                && pid_alive(pid)
                && fs::read_to_string(format!("/proc/{pid}/comm"))
                    .is_ok_and(|c| c.trim_end() == comm)
        })
        .collect()
}

/// Stops a process (SIGSTOP) and resumes it (SIGCONT) when dropped, so a test that fails while
/// a daemon is stopped never leaves it, or the applications waiting on it, stuck:
/// `let resume = Resume::stop(pid);`.
pub struct Resume {
    pid: i32,
}

impl Resume {
    /// SIGSTOPs `pid` and waits until every one of its threads is stopped (state `T`): the
    /// group leader shows `T` before the other threads have all taken the stop.
    pub fn stop(pid: i32) -> Resume {
        send_signal(pid, libc::SIGSTOP);
        let stopped = wait_until(Instant::now() + TIMEOUT, || {
            let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
                return true;
            };
            tasks.flatten().all(|t| {
                fs::read_to_string(t.path().join("stat")).is_ok_and(|st| {
                    st.rsplit_once(") ")
                        .is_some_and(|(_, rest)| rest.starts_with('T'))
                })
            })
        });
        assert!(stopped, "pid {pid} did not stop after SIGSTOP");
        Resume { pid }
    }

    /// SIGCONT now (again on drop, harmlessly).
    pub fn resume(&self) {
        send_signal(self.pid, libc::SIGCONT);
    }
}

impl Drop for Resume {
    fn drop(&mut self) {
        send_signal(self.pid, libc::SIGCONT);
    }
}

/// A process that opens `path` and reads its first 4 KiB (`dd`), with its stderr in `work`:
/// the application a test watches when the daemon stops answering. Killed on drop.
pub struct Reader {
    pub child: ChildGuard,
    stderr: PathBuf,
}

impl Reader {
    pub fn spawn(work: &WorkDir, path: &Path) -> Reader {
        let stderr = work.join(unique("reader.stderr"));
        let mut input = OsString::from("if=");
        input.push(path);
        let child = Command::new("dd")
            .arg(input)
            .args(["of=/dev/null", "bs=4096", "count=1"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&stderr).expect("create reader stderr"))
            .spawn()
            .expect("spawn dd");
        Reader {
            child: ChildGuard(child),
            stderr,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.pid()
    }

    /// Waits until the reader sleeps in a FUSE request (`request_wait_answer`), or ended.
    #[track_caller]
    pub fn wait_blocked_in_fuse(&mut self) {
        let pid = self.pid();
        let ok = wait_until(Instant::now() + TIMEOUT, || {
            wchan(pid) == "request_wait_answer" || matches!(proc_state(pid), None | Some('Z'))
        });
        assert!(
            ok,
            "reader {pid} neither blocked in FUSE nor ended: state {:?}, wchan {:?}",
            proc_state(pid),
            wchan(pid)
        );
    }

    /// What the reader printed.
    pub fn stderr(&self) -> String {
        read_lossy(&self.stderr)
    }
}

/// One datagram from `sock` as text (its read timeout set by the caller), the wait retried when
/// a signal interrupts it: the test process gets SIGCHLD from the daemons and tools its threads
/// run, and `recv` then fails with EINTR (seen in CI).
#[track_caller]
pub fn recv_datagram(sock: &std::os::unix::net::UnixDatagram) -> String {
    let mut buf = [0u8; 4096];
    loop {
        match sock.recv(&mut buf) {
            Ok(n) => return String::from_utf8_lossy(&buf[..n]).into_owned(),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => panic!("no datagram within the socket's read timeout: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_unescape() {
        assert_eq!(
            unescape_mountinfo(r"/a\040b\011c\134d"),
            OsString::from("/a b\tc\\d")
        );
        assert_eq!(unescape_mountinfo(r"/plain"), OsString::from("/plain"));
        assert_eq!(unescape_mountinfo(r"/end\04"), OsString::from(r"/end\04"));
    }

    #[test]
    fn fuse_fstypes() {
        assert!(is_fuse_fstype("fuse"));
        assert!(is_fuse_fstype("fuse.fusex"));
        assert!(!is_fuse_fstype("fuseblk"));
        assert!(!is_fuse_fstype("fusectl"));
    }

    #[test]
    fn rng_is_deterministic_and_fills_tails() {
        let a = Rng::new(5).bytes(13);
        let b = Rng::new(5).bytes(13);
        assert_eq!(a, b);
        assert_ne!(a, Rng::new(6).bytes(13));
        assert!(a[8..].iter().any(|&x| x != 0));
    }

    #[test]
    fn hash_differs_on_change() {
        let mut d = Rng::new(1).bytes(1000);
        let h = hash_bytes(0, &d);
        d[999] ^= 1;
        assert_ne!(h, hash_bytes(0, &d));
    }
}

/// What [`Mount::wait_for_stats`] saw: the first and latest readings (None if no live stats dump
/// came at all) and whether the latest moved past the first in time.
#[derive(Debug)]
pub struct StatsProgress<T> {
    pub readings: Option<(T, T)>,
    pub moved: bool,
}
