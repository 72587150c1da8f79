//! NBD exports: fusex's own client against real servers (qemu-nbd, nbdkit) started here on Unix
//! sockets, and against a fake server that breaks the protocol.
//!
//! - raw and qcow2 images served by qemu-nbd read back byte for byte; writes land in the image
//!   (read from the file, or `qemu-img compare` against a raw oracle for qcow2);
//! - `nbdkit memory`: writes, punch-hole and zero-range read back right;
//! - multi-conn: one connection per queue when the server allows it, one queue when it does not;
//! - SEEK_DATA/SEEK_HOLE through BLOCK_STATUS agree with the image file's own;
//! - a server killed mid-I/O: requests fail with EIO, then succeed once it is back;
//! - a server sending malformed replies (bad magic, unknown cookie, oversize or misplaced data):
//!   the request fails with EIO, the daemon lives on and reconnects;
//! - start-up failures (no server, unknown export, TLS refused) are one line, exit 1, no mount;
//! - TLS (`nbds+unix://`, `nbds://`): nbdkit and qemu-nbd requiring TLS, with a CA, server and
//!   client certificates made here by openssl; data written through the export read back and
//!   checked against the server read directly (nbdcopy, or the backing file); a wrong CA, a plain
//!   URI at a TLS-only server and `tls-psk-file=` refused in one line; a TLS server killed and
//!   restarted (the reconnect makes a new TLS session).

use std::fs::{self, File};
use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use fusex_e2e::*;

/// Connected (not listening) Unix sockets named `sock`: the server's side of each connection.
fn connections_to(sock: &Path) -> usize {
    let want = sock.to_string_lossy();
    fs::read_to_string("/proc/net/unix")
        .unwrap()
        .lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // Num RefCount Protocol Flags Type St Inode Path; St 03 = connected.
            f.len() >= 8 && f[5] == "03" && f[7] == want
        })
        .count()
}

fn write_direct(f: &File, data: &[u8], off: u64) {
    let b = AlignedBuf::from_slice(data, 4096);
    f.write_all_at(b.as_slice(), off)
        .expect("write through the export");
}

fn read_direct(f: &File, off: u64, len: usize) -> std::io::Result<Vec<u8>> {
    let mut b = AlignedBuf::new(len, 4096);
    f.read_exact_at(b.as_mut_slice(), off)?;
    Ok(b.as_slice().to_vec())
}

fn open_direct_rw(p: &Path) -> File {
    fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(p)
        .expect("open export O_DIRECT")
}

/// Random 4 KiB-aligned writes through `f` (and into `expected`).
fn random_writes(f: &File, expected: &mut [u8], rng: &mut Rng, n: usize) {
    let size = expected.len() as u64;
    for _ in 0..n {
        let len = ((rng.below(32) + 1) * 4096).min(size) as usize;
        let off = rng.below((size - len as u64) / 4096 + 1) * 4096;
        let data = rng.bytes(len);
        write_direct(f, &data, off);
        expected[off as usize..off as usize + len].copy_from_slice(&data);
    }
}

#[test]
fn qemu_nbd_raw_round_trip() {
    if !require_fuse_and_tools(&["qemu-nbd"]) {
        return;
    }
    let w = WorkDir::new("nbd-raw");
    let img = w.join("img.raw");
    let mut expected = random_image(&img, 16 * MIB, 1);
    let sock = w.join("s.sock");
    let mut server = qemu_nbd(&sock, &["-f", "raw", "-e", "8"], &img);
    let mp = w.join("export");
    let m = Mount::start(
        &w,
        nbd_uri(&sock, ""),
        &mp,
        &["--writable", "--queues", "2"],
    );
    assert!(m.stderr().contains("multi-conn yes"), "{}", m.stderr());
    assert_eq!(fs::metadata(&mp).unwrap().len(), 16 * MIB);
    assert_bytes_eq(&read_all(&mp), &expected, 0, "export before writes");
    let f = open_direct_rw(&mp);
    random_writes(&f, &mut expected, &mut Rng::new(2), 64);
    f.sync_all().expect("fsync through the export");
    assert_bytes_eq(&read_all(&mp), &expected, 0, "export after writes");
    drop(f);
    let st = m.stop();
    st.assert_clean("nbd raw");
    assert!(st.stat(&["ops", "WRITE"]) >= 64);
    server.kill_and_wait();
    assert_bytes_eq(
        &read_all(&img),
        &expected,
        0,
        "image file after the export ended",
    );
}

#[test]
fn qemu_nbd_qcow2_round_trip() {
    if !require_fuse_and_tools(&["qemu-nbd", "qemu-img"]) {
        return;
    }
    let w = WorkDir::new("nbd-qcow2");
    let raw = w.join("oracle.raw");
    let mut expected = random_image(&raw, 8 * MIB, 3);
    let img = w.join("img.qcow2");
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "qcow2"])
            .arg(&raw)
            .arg(&img),
    );
    let sock = w.join("s.sock");
    let mut server = qemu_nbd(&sock, &["-f", "qcow2"], &img);
    let mp = w.join("export");
    let m = Mount::start(
        &w,
        nbd_uri(&sock, ""),
        &mp,
        &["--writable", "--writethrough"],
    );
    assert_bytes_eq(&read_all(&mp), &expected, 0, "qcow2 export");
    let f = open_direct_rw(&mp);
    random_writes(&f, &mut expected, &mut Rng::new(4), 32);
    drop(f);
    let st = m.stop();
    st.assert_clean("nbd qcow2");
    // --writethrough: writes carry FUA (qemu-nbd offers it), so no FLUSH follows each write.
    assert!(st.stat(&["ops", "WRITE"]) >= 32);
    assert_eq!(st.stat(&["backend", "flushes"]), st.requested_flushes());
    server.kill_and_wait();
    fs::write(&raw, &expected).unwrap();
    run_ok(
        Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "qcow2"])
            .arg(&raw)
            .arg(&img),
    );
}

#[test]
fn nbdkit_memory_write_trim_zero() {
    if !require_fuse_and_tools(&["nbdkit"]) {
        return;
    }
    let w = WorkDir::new("nbd-mem");
    let sock = w.join("s.sock");
    let _server = nbdkit(&sock, &["memory", "size=8M"]);
    let mp = w.join("export");
    let m = Mount::start(&w, nbd_uri(&sock, ""), &mp, &["--writable"]);
    let mut expected = vec![0u8; 8 * MIB as usize];
    let f = open_direct_rw(&mp);
    assert_bytes_eq(
        &read_direct(&f, 0, expected.len()).unwrap(),
        &expected,
        0,
        "fresh memory",
    );
    let mut rng = Rng::new(5);
    let data = rng.bytes(expected.len());
    write_direct(&f, &data, 0);
    expected.copy_from_slice(&data);
    // Punch a hole and zero a range: both read back as zeroes.
    fallocate(
        &f,
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
        MIB,
        256 * KIB,
    )
    .unwrap();
    expected[MIB as usize..(MIB + 256 * KIB) as usize].fill(0);
    fallocate(&f, libc::FALLOC_FL_ZERO_RANGE, 3 * MIB, 64 * KIB).unwrap();
    expected[3 * MIB as usize..(3 * MIB + 64 * KIB) as usize].fill(0);
    f.sync_all().unwrap();
    assert_bytes_eq(
        &read_direct(&f, 0, expected.len()).unwrap(),
        &expected,
        0,
        "after trim and zero",
    );
    // No growing, no truncating: the export's size is the server's.
    assert!(f.set_len(16 * MIB).is_err());
    drop(f);
    let st = m.stop();
    st.assert_clean("nbdkit memory");
    assert_eq!(st.stat(&["ops", "FALLOCATE"]), 2);
}

#[test]
fn multi_conn_one_connection_per_queue() {
    if !require_fuse_and_tools(&["nbdkit", "qemu-nbd", "fio"]) {
        return;
    }
    let w = WorkDir::new("nbd-multi");
    let sock = w.join("s.sock");
    let _server = nbdkit(&sock, &["memory", "size=32M"]);
    let mp = w.join("export");
    let m = Mount::start(
        &w,
        nbd_uri(&sock, ""),
        &mp,
        &["--writable", "--queues", "2"],
    );
    // One fio job per CPU, verified: on io_uring each CPU's requests go to its own queue.
    let out = run_fio(
        &w,
        &mp,
        &[
            "--name=v",
            "--rw=randwrite",
            "--bs=4k",
            "--size=8M",
            "--numjobs=2",
            "--offset_increment=8M",
            "--ioengine=psync",
            "--direct=1",
            "--verify=crc32c",
            "--cpus_allowed=0-1",
            "--cpus_allowed_policy=split",
        ],
    );
    assert!(out.contains("err= 0"), "{out}");
    let conns = connections_to(&sock);
    let uring = std::env::var("FUSEX_E2E_TRANSPORT").is_ok_and(|t| t == "uring");
    assert!((1..=2).contains(&conns), "connections: {conns}");
    if uring && std::thread::available_parallelism().map_or(1, |n| n.get()) >= 2 {
        assert_eq!(conns, 2, "one connection per queue");
    }
    let st = m.stop();
    st.assert_clean("multi-conn");
    assert_eq!(st.stats()["queues"].as_array().unwrap().len(), 2);
    // The server closes its side once it reads the disconnect (or end of stream).
    let closed = wait_until(Instant::now() + TIMEOUT, || connections_to(&sock) == 0);
    assert!(
        closed,
        "connections left open after exit: {}",
        connections_to(&sock)
    );

    // qemu-nbd with one client allowed advertises no multi-conn for a writable export: one queue.
    let img = w.join("img.raw");
    random_image(&img, 4 * MIB, 6);
    let sock2 = w.join("q.sock");
    let _q = qemu_nbd(&sock2, &["-f", "raw"], &img);
    let mp2 = w.join("export2");
    let m = Mount::start(
        &w,
        nbd_uri(&sock2, ""),
        &mp2,
        &["--writable", "--queues", "2"],
    );
    assert!(
        m.stderr()
            .contains("does not advertise multi-conn: serving with 1 queue"),
        "{}",
        m.stderr()
    );
    assert_bytes_eq(
        &read_all(&mp2),
        &read_all(&img),
        0,
        "single-connection export",
    );
    let st = m.stop();
    st.assert_clean("no multi-conn");
    assert_eq!(st.stats()["queues"].as_array().unwrap().len(), 1);
}

#[test]
fn block_status_matches_seek_hole() {
    if !require_fuse_and_tools(&["qemu-nbd"]) {
        return;
    }
    let w = WorkDir::new("nbd-seek");
    let img = w.join("sparse.raw");
    sparse_image(&img, 16 * MIB);
    {
        let f = open_rw(&img);
        for (off, len) in [(MIB, 64 * KIB), (5 * MIB, MIB), (15 * MIB, 4 * KIB)] {
            f.write_all_at(&vec![0xa5; len as usize], off).unwrap();
        }
        f.sync_all().unwrap();
    }
    let sock = w.join("s.sock");
    let _server = qemu_nbd(&sock, &["-f", "raw", "-r"], &img);
    let mp = w.join("export");
    let m = Mount::start(&w, nbd_uri(&sock, ""), &mp, &[]);
    assert!(m.stderr().contains("block status yes"), "{}", m.stderr());
    let exp = m.open_ro();
    let file = open_ro(&img);
    let mut checked = 0;
    for off in (0..16 * MIB)
        .step_by(64 * KIB as usize)
        .chain([MIB + 100, 16 * MIB - 1])
    {
        for whence in [libc::SEEK_DATA, libc::SEEK_HOLE] {
            assert_eq!(
                lseek(&exp, off, whence),
                lseek(&file, off, whence),
                "lseek({off}, {whence})"
            );
            checked += 1;
        }
    }
    assert!(checked > 500);
    assert_eq!(lseek(&exp, 16 * MIB, libc::SEEK_DATA), Err(libc::ENXIO));
    // qemu-nbd answers reads of unallocated ranges with hole chunks: they read as zeroes.
    assert_bytes_eq(&read_all(&mp), &read_all(&img), 0, "sparse export");
    drop(exp);
    m.stop().assert_clean("seek");
}

#[test]
fn server_killed_mid_io_then_back() {
    if !require_fuse_and_tools(&["qemu-nbd"]) {
        return;
    }
    let w = WorkDir::new("nbd-kill");
    let img = w.join("img.raw");
    let expected = random_image(&img, 8 * MIB, 7);
    let sock = w.join("s.sock");
    let mut server = qemu_nbd(&sock, &["-f", "raw", "-e", "4"], &img);
    let mp = w.join("export");
    let m = Mount::start(
        &w,
        nbd_uri(&sock, ""),
        &mp,
        &["--reconnect-delay", "0.05", "--queues", "1"],
    );
    // Readers keep I/O in flight while the server dies.
    let stop = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(AtomicUsize::new(0));
    let readers: Vec<_> = (0..4)
        .map(|i| {
            let (mp, stop, errors) = (mp.clone(), stop.clone(), errors.clone());
            let expected = expected.clone();
            thread::spawn(move || {
                let f = File::open(&mp).unwrap();
                let mut rng = Rng::new(100 + i);
                while stop.load(Ordering::Relaxed) == 0 {
                    let off = rng.below(8 * MIB / 65536) * 65536;
                    match read_direct(&f, off, 65536) {
                        Ok(b) => assert_bytes_eq(
                            &b,
                            &expected[off as usize..off as usize + 65536],
                            off,
                            "reader",
                        ),
                        Err(e) => {
                            assert_eq!(errno(&e), libc::EIO, "{e}");
                            errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(200));
    server.kill_and_wait();
    let f = File::open(&mp).unwrap();
    let e = read_direct(&f, 0, 4096).expect_err("a read with the server gone");
    assert_eq!(errno(&e), libc::EIO);
    assert!(m.is_mounted() && pid_alive(m.pid()), "the daemon lives on");
    // Back on the same socket: reads recover.
    let _server = qemu_nbd(&sock, &["-f", "raw", "-e", "4"], &img);
    let deadline = Instant::now() + TIMEOUT;
    let ok = wait_until(deadline, || read_direct(&f, 0, 4096).is_ok());
    assert!(ok, "reads did not recover; stderr:\n{}", m.stderr());
    assert_bytes_eq(
        &read_direct(&f, 0, expected.len()).unwrap(),
        &expected,
        0,
        "after reconnect",
    );
    stop.store(1, Ordering::Relaxed);
    for r in readers {
        r.join().expect("reader thread");
    }
    // Readers may or may not have had a request in flight at the kill; whatever failed was EIO
    // (asserted in the readers) and everything read was the image's.
    eprintln!("reader errors: {}", errors.load(Ordering::Relaxed));
    let st = m.stop();
    assert_eq!(st.code, Some(0), "{}", st.stderr);
    assert!(
        st.stderr.contains("NBD connection to ") && st.stderr.contains(" lost: "),
        "{}",
        st.stderr
    );
    assert!(st.stderr.contains("reconnected"), "{}", st.stderr);
    assert!(!st.stderr.to_lowercase().contains("panic"), "{}", st.stderr);
}

/// How the fake server answers READs on its Nth connection.
#[derive(Clone, Copy, Debug)]
enum Misbehave {
    BadMagic,
    UnknownCookie,
    OversizeChunk,
    DataOutsideRequest,
    ChunkForWrongCommand,
    Good,
}

const FAKE_SIZE: u64 = 1 << 20;

fn fake_byte(off: u64) -> u8 {
    (off % 251) as u8
}

/// One fake connection: a fixed-newstyle handshake (structured replies, no metadata context),
/// then READs answered the way `mode` says; flushes are acknowledged.
fn fake_conn(mut s: UnixStream, mode: Misbehave) {
    let _ = s.set_read_timeout(Some(Duration::from_secs(20)));
    let mut w = Vec::new();
    w.extend_from_slice(b"NBDMAGIC");
    w.extend_from_slice(b"IHAVEOPT");
    w.extend_from_slice(&3u16.to_be_bytes());
    if s.write_all(&w).is_err() {
        return;
    }
    let mut cflags = [0u8; 4];
    if s.read_exact(&mut cflags).is_err() {
        return;
    }
    let reply = |s: &mut UnixStream, opt: u32, ty: u32, data: &[u8]| {
        let mut r = 0x0003_e889_0455_65a9u64.to_be_bytes().to_vec();
        r.extend_from_slice(&opt.to_be_bytes());
        r.extend_from_slice(&ty.to_be_bytes());
        r.extend_from_slice(&(data.len() as u32).to_be_bytes());
        r.extend_from_slice(data);
        s.write_all(&r)
    };
    loop {
        let mut h = [0u8; 16];
        if s.read_exact(&mut h).is_err() {
            return;
        }
        let opt = u32::from_be_bytes(h[8..12].try_into().unwrap());
        let len = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let mut data = vec![0u8; len as usize];
        if s.read_exact(&mut data).is_err() {
            return;
        }
        let r = match opt {
            8 => reply(&mut s, opt, 1, &[]),
            10 => reply(&mut s, opt, (1 << 31) + 1, &[]),
            7 => {
                let mut info = 0u16.to_be_bytes().to_vec();
                info.extend_from_slice(&FAKE_SIZE.to_be_bytes());
                info.extend_from_slice(&(1u16 | 4).to_be_bytes());
                let _ = reply(&mut s, opt, 3, &info);
                let _ = reply(&mut s, opt, 1, &[]);
                break;
            }
            _ => reply(&mut s, opt, (1 << 31) + 1, &[]),
        };
        if r.is_err() {
            return;
        }
    }
    loop {
        let mut rq = [0u8; 28];
        if s.read_exact(&mut rq).is_err() {
            return;
        }
        let ty = u16::from_be_bytes([rq[6], rq[7]]);
        let cookie = u64::from_be_bytes(rq[8..16].try_into().unwrap());
        let off = u64::from_be_bytes(rq[16..24].try_into().unwrap());
        let len = u32::from_be_bytes(rq[24..28].try_into().unwrap());
        let mut out = Vec::new();
        match ty {
            2 => return,
            0 => {
                let chunk =
                    |out: &mut Vec<u8>, magic: u32, cookie: u64, ty: u16, at: u64, n: u32| {
                        out.extend_from_slice(&magic.to_be_bytes());
                        out.extend_from_slice(&1u16.to_be_bytes());
                        out.extend_from_slice(&ty.to_be_bytes());
                        out.extend_from_slice(&cookie.to_be_bytes());
                        out.extend_from_slice(&(n + 8).to_be_bytes());
                        out.extend_from_slice(&at.to_be_bytes());
                        out.extend((at..at + u64::from(n)).map(fake_byte));
                    };
                const M: u32 = 0x668e_33ef;
                match mode {
                    Misbehave::BadMagic => chunk(&mut out, 0xdead_beef, cookie, 1, off, len),
                    Misbehave::UnknownCookie => {
                        chunk(&mut out, M, cookie ^ 0x5a5a_0000, 1, off, len)
                    }
                    Misbehave::OversizeChunk => chunk(&mut out, M, cookie, 1, off, len + 4096),
                    Misbehave::DataOutsideRequest => chunk(&mut out, M, cookie, 1, off + 512, len),
                    Misbehave::ChunkForWrongCommand => {
                        // A block-status chunk answering a READ.
                        out.extend_from_slice(&M.to_be_bytes());
                        out.extend_from_slice(&1u16.to_be_bytes());
                        out.extend_from_slice(&5u16.to_be_bytes());
                        out.extend_from_slice(&cookie.to_be_bytes());
                        out.extend_from_slice(&12u32.to_be_bytes());
                        out.extend_from_slice(&[0; 12]);
                    }
                    Misbehave::Good => chunk(&mut out, M, cookie, 1, off, len),
                }
            }
            _ => {
                out.extend_from_slice(&0x6744_6698u32.to_be_bytes());
                out.extend_from_slice(&0u32.to_be_bytes());
                out.extend_from_slice(&cookie.to_be_bytes());
            }
        }
        if s.write_all(&out).is_err() {
            return;
        }
    }
}

#[test]
fn malformed_replies_fail_the_request_not_the_daemon() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("nbd-fake");
    let sock = w.join("fake.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let modes = [
        Misbehave::BadMagic,
        Misbehave::UnknownCookie,
        Misbehave::OversizeChunk,
        Misbehave::DataOutsideRequest,
        Misbehave::ChunkForWrongCommand,
    ];
    let served = Arc::new(AtomicUsize::new(0));
    {
        let served = served.clone();
        thread::spawn(move || {
            for (i, s) in listener.incoming().enumerate() {
                let Ok(s) = s else { return };
                let mode = modes.get(i).copied().unwrap_or(Misbehave::Good);
                served.fetch_add(1, Ordering::Relaxed);
                thread::spawn(move || fake_conn(s, mode));
            }
        });
    }
    let mp = w.join("export");
    let m = Mount::start(
        &w,
        nbd_uri(&sock, ""),
        &mp,
        &["--reconnect-delay", "0.01", "--queues", "1"],
    );
    let f = File::open(&mp).unwrap();
    assert_eq!(fs::metadata(&mp).unwrap().len(), FAKE_SIZE);
    for mode in modes {
        let e = read_direct(&f, 8192, 4096).expect_err("a malformed reply must fail the read");
        assert_eq!(errno(&e), libc::EIO, "{mode:?}: {e}");
        assert!(
            m.is_mounted() && pid_alive(m.pid()),
            "{mode:?}: the daemon must survive"
        );
    }
    // The next connection behaves: reads succeed with the right bytes.
    let deadline = Instant::now() + TIMEOUT;
    assert!(
        wait_until(deadline, || read_direct(&f, 0, 4096).is_ok()),
        "{}",
        m.stderr()
    );
    let b = read_direct(&f, 12288, 65536).unwrap();
    let want: Vec<u8> = (12288..12288 + 65536).map(fake_byte).collect();
    assert_bytes_eq(&b, &want, 12288, "good connection");
    assert!(served.load(Ordering::Relaxed) > modes.len());
    drop(f);
    let st = m.stop();
    assert_eq!(st.code, Some(0), "{}", st.stderr);
    for what in [
        "bad reply magic",
        "unknown cookie",
        "impossible length",
        "chunk outside the request",
        "reply chunk type 5",
    ] {
        assert!(
            st.stderr.contains(what),
            "{what} not logged:\n{}",
            st.stderr
        );
    }
    assert!(!st.stderr.to_lowercase().contains("panic"), "{}", st.stderr);
}

#[test]
fn startup_failures_are_one_line() {
    if !require_fuse_and_tools(&["qemu-nbd"]) {
        return;
    }
    let w = WorkDir::new("nbd-fail");
    let mp = w.join("export");
    let missing = w.join("nobody.sock");
    let img = w.join("img.raw");
    random_image(&img, MIB, 8);
    let sock = w.join("s.sock");
    let _server = qemu_nbd(&sock, &["-f", "raw", "-x", "disk"], &img);
    let cases: Vec<(String, &str)> = vec![
        (nbd_uri(&missing, ""), "cannot connect to NBD server"),
        (nbd_uri(&sock, "other"), "no export named \"other\""),
        (
            format!("nbds+unix:///disk?socket={}", sock.display()),
            "the server does not offer TLS",
        ),
        ("nbd+unix:///disk".to_string(), "needs ?socket=PATH"),
    ];
    for (image, what) in cases {
        let r = run_fusex(
            &w,
            &["mount", image.as_str(), mp.to_str().unwrap()],
            Some(&mp),
        );
        assert_eq!(r.code, Some(1), "{image}: {}", r.stderr);
        r.assert_one_error_line(&image);
        assert!(r.stderr.contains(what), "{image}: {}", r.stderr);
        assert!(!is_fuse_mounted(&mp), "{image}: nothing may be mounted");
    }
    // Writable on a read-only export is refused the same way.
    let ro = w.join("ro.sock");
    let _ro = qemu_nbd(&ro, &["-f", "raw", "-r"], &img);
    let u = nbd_uri(&ro, "");
    let r = run_fusex(
        &w,
        &["mount", "--writable", u.as_str(), mp.to_str().unwrap()],
        Some(&mp),
    );
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(
        r.stderr.contains("read-only: drop --writable"),
        "{}",
        r.stderr
    );
    // The right export works.
    let m = Mount::start(&w, nbd_uri(&sock, "disk"), &mp, &[]);
    assert_bytes_eq(&read_all(&mp), &read_all(&img), 0, "named export");
    m.stop().assert_clean("named export");
}

#[test]
fn server_that_stops_answering_times_out() {
    if !require_fuse_and_tools(&["nbdkit"]) {
        return;
    }
    let w = WorkDir::new("nbd-delay");
    let sock = w.join("s.sock");
    // Reads take 30 s; writes are answered at once.
    let _server = nbdkit(&sock, &["--filter=delay", "memory", "size=1M", "rdelay=30"]);
    let mp = w.join("export");
    let m = Mount::start(
        &w,
        nbd_uri(&sock, ""),
        &mp,
        &["--writable", "--nbd-timeout", "1", "--queues", "1"],
    );
    let f = open_direct_rw(&mp);
    let e = read_direct(&f, 0, 4096).expect_err("a read the server never answers in time");
    assert_eq!(errno(&e), libc::EIO);
    // The connection is replaced: requests the server answers work again. A request that
    // arrives while the new connection is being made fails with EIO at once (the backend's
    // contract: nothing waits on a reconnect but the request that started it), so the write
    // may take a second try; it never takes more than a few.
    let data = AlignedBuf::from_slice(&[7u8; 4096], 4096);
    let deadline = Instant::now() + TIMEOUT;
    let mut tries = 0;
    loop {
        tries += 1;
        match f.write_all_at(data.as_slice(), 4096) {
            Ok(()) => break,
            Err(e) if errno(&e) == libc::EIO && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("write through the export after the reconnect: {e}"),
        }
    }
    assert!(tries <= 5, "{tries} writes before one went through");
    assert!(m.is_mounted() && pid_alive(m.pid()));
    drop(f);
    let st = m.stop();
    assert_eq!(st.code, Some(0), "{}", st.stderr);
    assert!(
        st.stderr
            .contains("sent no complete reply within 1 s; closing the connection"),
        "{}",
        st.stderr
    );
}

#[test]
fn qemu_nbd_over_tcp() {
    if !require_fuse_and_tools(&["qemu-nbd"]) {
        return;
    }
    let w = WorkDir::new("nbd-tcp");
    let img = w.join("img.raw");
    let expected = random_image(&img, 4 * MIB, 9);
    let port = free_port();
    let mut c = Command::new("qemu-nbd");
    c.args([
        "-t",
        "-f",
        "raw",
        "-b",
        "127.0.0.1",
        "-p",
        &port.to_string(),
        "-x",
        "disk",
    ])
    .arg(&img);
    let _server = nbd_server_tcp(c, port);
    let mp = w.join("export");
    let m = Mount::start(&w, format!("nbd://127.0.0.1:{port}/disk"), &mp, &[]);
    assert_bytes_eq(&read_all(&mp), &expected, 0, "export over TCP");
    m.stop().assert_clean("nbd over TCP");
}

#[test]
fn block_size_constraints_split_and_align() {
    if !require_fuse_and_tools(&["nbdkit"]) {
        return;
    }
    let w = WorkDir::new("nbd-bs");
    let sock = w.join("s.sock");
    let mp = w.join("export");
    // Anything not aligned to 4 KiB (or above 64 KiB) fails with EINVAL at the server.
    let (_server, m) = strict_blocksize_export(&w, &sock, &mp);
    let f = open_direct_rw(&mp);
    let data = Rng::new(10).bytes(512 * KIB as usize);
    // Larger than the server's maximum: fusex splits it.
    write_direct(&f, &data, MIB);
    assert_bytes_eq(
        &read_direct(&f, MIB, data.len()).unwrap(),
        &data,
        MIB,
        "split transfers",
    );
    // Not aligned to the server's minimum: made whole by fusex (tests/nbd_blocks.rs has more).
    let got = read_direct(&f, MIB + 512, 512).expect("a read below the minimum block size");
    assert_bytes_eq(&got, &data[512..1024], MIB + 512, "unaligned read");
    drop(f);
    m.stop().assert_clean("block sizes");
}

// ---------------------------------------------------------------------------------------
// TLS
// ---------------------------------------------------------------------------------------

/// nbdkit requiring TLS with the certificates in `pki`, on `sock`.
fn nbdkit_tls(sock: &Path, pki: &Path, args: &[&str]) -> ChildGuard {
    let tls = format!("--tls-certificates={}", pki.display());
    let mut a = vec!["--tls=require", tls.as_str()];
    a.extend_from_slice(args);
    nbdkit(sock, &a)
}

/// The export as the server itself serves it, through a second client (nbdcopy, libnbd's).
fn read_server(uri: &str, w: &WorkDir) -> Vec<u8> {
    let out = w.join("oracle.raw");
    let _ = fs::remove_file(&out);
    run_ok(Command::new("nbdcopy").arg(uri).arg(&out));
    fs::read(&out).unwrap()
}

#[test]
fn tls_nbdkit_unix_and_tcp_round_trip() {
    if !require_fuse_and_tools(&["nbdkit", "openssl", "nbdcopy"]) {
        return;
    }
    let w = WorkDir::new("nbd-tls");
    let pki = w.join("pki");
    make_pki(&pki, "fusex-test-ca");
    let sock = w.join("s.sock");
    let _server = nbdkit_tls(&sock, &pki, &["memory", "size=16M"]);
    let u = tls_uri(&sock, &pki);
    let mp = w.join("export");
    let m = Mount::start(&w, &u, &mp, &["--writable", "--queues", "2"]);
    assert!(m.stderr().contains(", TLS)"), "{}", m.stderr());
    let mut expected = vec![0u8; 16 * MIB as usize];
    let f = open_direct_rw(&mp);
    let mut rng = Rng::new(21);
    // Large transfers (many TLS records per request) and many small ones.
    let data = rng.bytes(expected.len());
    write_direct(&f, &data, 0);
    expected.copy_from_slice(&data);
    random_writes(&f, &mut expected, &mut rng, 64);
    f.sync_all().expect("fsync through the export");
    assert_bytes_eq(
        &read_direct(&f, 0, expected.len()).unwrap(),
        &expected,
        0,
        "export over TLS",
    );
    // Reads in flight at once on both queues.
    let readers: Vec<_> = (0..4)
        .map(|i| {
            let (mp, expected) = (mp.clone(), expected.clone());
            thread::spawn(move || {
                let f = File::open(&mp).unwrap();
                let mut rng = Rng::new(200 + i);
                for _ in 0..200 {
                    let len = ((rng.below(16) + 1) * 4096) as usize;
                    let off = rng.below((expected.len() - len) as u64 / 4096 + 1) * 4096;
                    let got = read_direct(&f, off, len).expect("read over TLS");
                    assert_bytes_eq(&got, &expected[off as usize..][..len], off, "reader");
                }
            })
        })
        .collect();
    for r in readers {
        r.join().expect("reader thread");
    }
    drop(f);
    // A second client, straight to the server, sees what was written.
    assert_bytes_eq(
        &read_server(&u, &w),
        &expected,
        0,
        "the server read by nbdcopy",
    );
    let st = m.stop();
    st.assert_clean("nbds+unix");
    assert!(st.stat(&["ops", "WRITE"]) >= 64);

    // TCP: nbds://localhost:PORT/ against the same data (nbdkit's memory plugin is per
    // server, so a second server gets the data through the first export's file).
    let port = free_port();
    let img = w.join("img.raw");
    fs::write(&img, &expected).unwrap();
    let mut c = Command::new("nbdkit");
    c.args([
        "-f",
        "-i",
        "127.0.0.1",
        "-p",
        &port.to_string(),
        "--tls=require",
    ])
    .arg(format!("--tls-certificates={}", pki.display()))
    .arg("file")
    .arg(&img);
    let mut tcp = nbd_server_tcp(c, port);
    let u = format!(
        "nbds://localhost:{port}/?tls-certificates={}",
        pki.display()
    );
    let m = Mount::start(&w, &u, &mp, &["--writable"]);
    let f = open_direct_rw(&mp);
    assert_bytes_eq(
        &read_direct(&f, 0, expected.len()).unwrap(),
        &expected,
        0,
        "export over TLS on TCP",
    );
    random_writes(&f, &mut expected, &mut Rng::new(22), 32);
    f.sync_all().expect("fsync through the export");
    drop(f);
    m.stop().assert_clean("nbds over TCP");
    tcp.kill_and_wait();
    assert_bytes_eq(&fs::read(&img).unwrap(), &expected, 0, "file behind nbdkit");
}

#[test]
fn tls_qemu_nbd_client_certificate_round_trip() {
    if !require_fuse_and_tools(&["qemu-nbd", "openssl"]) {
        return;
    }
    let w = WorkDir::new("nbd-tls-qemu");
    let pki = w.join("pki");
    make_pki(&pki, "fusex-test-ca");
    let img = w.join("img.raw");
    let mut expected = random_image(&img, 8 * MIB, 23);
    let sock = w.join("s.sock");
    // verify-peer (qemu's default for a server): fusex must present its client certificate.
    let creds = format!(
        "tls-creds-x509,id=tls0,dir={},endpoint=server,verify-peer=on",
        pki.display()
    );
    let mut server = qemu_nbd(
        &sock,
        &["-f", "raw", "--object", &creds, "--tls-creds", "tls0"],
        &img,
    );
    let mp = w.join("export");
    let m = Mount::start(&w, tls_uri(&sock, &pki), &mp, &["--writable"]);
    assert_bytes_eq(&read_all(&mp), &expected, 0, "qemu-nbd export over TLS");
    let f = open_direct_rw(&mp);
    random_writes(&f, &mut expected, &mut Rng::new(24), 48);
    f.sync_all().expect("fsync through the export");
    drop(f);
    m.stop().assert_clean("qemu-nbd over TLS");
    server.kill_and_wait();
    assert_bytes_eq(
        &read_all(&img),
        &expected,
        0,
        "the image file behind qemu-nbd",
    );

    // Without the client certificate qemu-nbd ends the handshake: one line saying what to do.
    let bare = w.join("bare");
    fs::create_dir_all(&bare).unwrap();
    fs::copy(pki.join("ca-cert.pem"), bare.join("ca-cert.pem")).unwrap();
    let _server = qemu_nbd(
        &sock,
        &["-f", "raw", "--object", &creds, "--tls-creds", "tls0"],
        &img,
    );
    let u = tls_uri(&sock, &bare);
    let r = run_fusex(&w, &["mount", u.as_str(), mp.to_str().unwrap()], Some(&mp));
    r.assert_one_error_line("TLS without a client certificate");
    assert!(r.stderr.contains("client-cert.pem"), "{}", r.stderr);
    assert!(!is_fuse_mounted(&mp));
}

#[test]
fn tls_refusals_are_one_line() {
    if !require_fuse_and_tools(&["nbdkit", "openssl"]) {
        return;
    }
    let w = WorkDir::new("nbd-tls-fail");
    let pki = w.join("pki");
    make_pki(&pki, "fusex-test-ca");
    let other = w.join("other");
    make_pki(&other, "some-other-ca");
    let sock = w.join("s.sock");
    let _server = nbdkit_tls(&sock, &pki, &["memory", "size=1M"]);
    let mp = w.join("export");
    let cases: Vec<(String, &str)> = vec![
        // The server's certificate is signed by a CA fusex was not given.
        (tls_uri(&sock, &other), "certificate was rejected"),
        // A plain URI at a server that requires TLS.
        (nbd_uri(&sock, ""), "the server requires TLS: use nbds://"),
        (
            format!("{}&tls-psk-file=/nonexistent", tls_uri(&sock, &pki)),
            "tls-psk-file= is not supported",
        ),
        (
            tls_uri(&sock, &w.join("missing")),
            "ca-cert.pem: No such file",
        ),
        (
            format!("{}&tls-verify-peer=perhaps", tls_uri(&sock, &pki)),
            "tls-verify-peer= takes true or false",
        ),
    ];
    for (image, what) in cases {
        let r = run_fusex(
            &w,
            &["mount", image.as_str(), mp.to_str().unwrap()],
            Some(&mp),
        );
        r.assert_one_error_line(&image);
        assert!(r.stderr.contains(what), "{image}: {}", r.stderr);
        assert!(!is_fuse_mounted(&mp), "{image}: nothing may be mounted");
    }
    // A certificate for another name: on a Unix socket (no host name) only its chain is checked,
    // as libnbd does; with tls-hostname= its names are.
    let named = w.join("named");
    make_pki_for(&named, "fusex-test-ca", "nbd.example");
    let nsock = w.join("n.sock");
    let _named_server = nbdkit_tls(&nsock, &named, &["memory", "size=1M"]);
    let m = Mount::start(&w, tls_uri(&nsock, &named), &mp, &[]);
    assert_eq!(read_all(&mp).len(), MIB as usize);
    m.stop()
        .assert_clean("certificate for another name on a Unix socket");
    let u = format!("{}&tls-hostname=localhost", tls_uri(&nsock, &named));
    let r = run_fusex(&w, &["mount", u.as_str(), mp.to_str().unwrap()], Some(&mp));
    r.assert_one_error_line(&u);
    assert!(r.stderr.contains("not for this host name"), "{}", r.stderr);
    assert!(!is_fuse_mounted(&mp));
    let u = format!("{}&tls-hostname=nbd.example", tls_uri(&nsock, &named));
    let m = Mount::start(&w, &u, &mp, &[]);
    m.stop()
        .assert_clean("tls-hostname= naming the certificate");
    // tls-verify-peer=false accepts the unknown CA (with a warning).
    let u = format!("{}&tls-verify-peer=false", tls_uri(&sock, &other));
    let m = Mount::start(&w, &u, &mp, &[]);
    assert_eq!(read_all(&mp).len(), MIB as usize);
    let st = m.stop();
    assert_eq!(st.code, Some(0), "{}", st.stderr);
    assert!(st.stderr.contains("tls-verify-peer=false"), "{}", st.stderr);
}

#[test]
fn tls_server_killed_then_back() {
    if !require_fuse_and_tools(&["nbdkit", "openssl"]) {
        return;
    }
    let w = WorkDir::new("nbd-tls-kill");
    let pki = w.join("pki");
    make_pki(&pki, "fusex-test-ca");
    let img = w.join("img.raw");
    let expected = random_image(&img, 8 * MIB, 25);
    let sock = w.join("s.sock");
    let file = img.to_str().unwrap();
    let mut server = nbdkit_tls(&sock, &pki, &["file", file]);
    let mp = w.join("export");
    let m = Mount::start(
        &w,
        tls_uri(&sock, &pki),
        &mp,
        &["--reconnect-delay", "0.05", "--queues", "1"],
    );
    let f = File::open(&mp).unwrap();
    assert_bytes_eq(
        &read_direct(&f, 0, expected.len()).unwrap(),
        &expected,
        0,
        "before the kill",
    );
    server.kill_and_wait();
    let e = read_direct(&f, 0, 4096).expect_err("a read with the server gone");
    assert_eq!(errno(&e), libc::EIO);
    // The next read tries to reconnect, which fails while the server is away.
    let e = read_direct(&f, 0, 4096).expect_err("a read with the server still gone");
    assert_eq!(errno(&e), libc::EIO);
    assert!(m.is_mounted() && pid_alive(m.pid()), "the daemon lives on");
    // Back on the same socket: the reconnect makes a new TLS session, reads recover.
    let _server = nbdkit_tls(&sock, &pki, &["file", file]);
    let deadline = Instant::now() + TIMEOUT;
    let ok = wait_until(deadline, || read_direct(&f, 0, 4096).is_ok());
    assert!(ok, "reads did not recover; stderr:\n{}", m.stderr());
    assert_bytes_eq(
        &read_direct(&f, 0, expected.len()).unwrap(),
        &expected,
        0,
        "after reconnect",
    );
    drop(f);
    let st = m.stop();
    assert_eq!(st.code, Some(0), "{}", st.stderr);
    assert!(
        st.stderr.contains("NBD connection to ") && st.stderr.contains(" lost: "),
        "{}",
        st.stderr
    );
    assert!(st.stderr.contains("reconnected"), "{}", st.stderr);
    assert!(!st.stderr.to_lowercase().contains("panic"), "{}", st.stderr);
}

/// Seconds of `--nbd-timeout` in the dripping-server tests; their bounds are multiples of it.
const DRIP_TIMEOUT: u64 = 3;

#[test]
fn dripping_handshake_fails_by_the_timeout() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("nbd-drip-hs");
    let sock = w.join("drip.sock");
    // Every byte of the handshake a second apart: no single read waits the timeout, so only a
    // deadline for the whole handshake ends it (it would take minutes).
    let _server = FakeNbd::start(&sock, |_| FakeMode::DripHandshake);
    let mp = w.join("export");
    let t = DRIP_TIMEOUT.to_string();
    let started = Instant::now();
    let r = Mount::try_start(&w, nbd_uri(&sock, ""), &mp, &["--nbd-timeout", &t]);
    let took = started.elapsed();
    let Err(failed) = r else {
        panic!("a handshake dripping one byte a second mounted with --nbd-timeout {t}");
    };
    assert_eq!(failed.code, Some(1), "{}", failed.stderr);
    assert!(
        took < Duration::from_secs(3 * DRIP_TIMEOUT + 5),
        "the handshake took {took:?} to fail with --nbd-timeout {t}: {}",
        failed.stderr
    );
    assert!(
        failed
            .stderr
            .contains(&format!("did not complete the handshake within {t} s")),
        "{}",
        failed.stderr
    );
    assert!(!is_fuse_mounted(&mp), "nothing may be mounted");
}

#[test]
fn dripping_reply_fails_the_read_by_the_timeout() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("nbd-drip-reply");
    let sock = w.join("drip.sock");
    // A handshake at full speed, then replies a byte a second (a 4 KiB READ's reply would take
    // over an hour; each byte comes well within the timeout).
    let server = FakeNbd::start(&sock, |_| FakeMode::DripReplies);
    let mp = w.join("export");
    let t = DRIP_TIMEOUT.to_string();
    let m = Mount::start(
        &w,
        nbd_uri(&sock, ""),
        &mp,
        &["--nbd-timeout", &t, "--queues", "1"],
    );
    let f = File::open(&mp).unwrap();
    let started = Instant::now();
    let e = read_direct(&f, 0, 4096).expect_err("a reply dripping one byte a second");
    let took = started.elapsed();
    assert_eq!(errno(&e), libc::EIO, "{e}");
    assert!(
        took < Duration::from_secs(3 * DRIP_TIMEOUT + 5),
        "the read took {took:?} to fail with --nbd-timeout {t}; stderr:\n{}",
        m.stderr()
    );
    assert!(m.is_mounted() && pid_alive(m.pid()), "the daemon lives on");
    drop(f);
    drop(server);
    let st = m.stop();
    assert_eq!(st.code, Some(0), "{}", st.stderr);
    // What happened, not "the server closed the connection": fusex closed it.
    assert!(
        st.stderr.contains(&format!(
            "sent no complete reply within {t} s; closing the connection"
        )),
        "{}",
        st.stderr
    );
    assert!(
        !st.stderr.contains("the server closed the connection"),
        "{}",
        st.stderr
    );
}

#[test]
fn hung_reconnect_leaves_the_queue_serving_and_the_stop_prompt() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("nbd-hung-reconnect");
    let sock = w.join("fake.sock");
    // The first connection serves; every later one is accepted and then hears nothing, so a
    // reconnect waits for a handshake until --nbd-timeout.
    let server = FakeNbd::start(&sock, |i| {
        if i == 0 {
            FakeMode::Good
        } else {
            FakeMode::Silent
        }
    });
    let mp = w.join("export");
    // One queue (no multi-conn): before connections were made off the queue thread, that
    // thread, the whole export with it, waited in the handshake for the full 60 s.
    let m = Mount::start(
        &w,
        nbd_uri(&sock, ""),
        &mp,
        &["--nbd-timeout", "60", "--reconnect-delay", "0.05"],
    );
    let f = Arc::new(File::open(&mp).unwrap());
    let want: Vec<u8> = (0..4096).map(fake_nbd_byte).collect();
    assert_bytes_eq(
        &read_direct(&f, 0, 4096).unwrap(),
        &want,
        0,
        "first connection",
    );
    server.drop_connections();
    let e = read_direct(&f, 0, 4096).expect_err("a read on the dropped connection");
    assert_eq!(errno(&e), libc::EIO, "{e}");
    // The next read starts the reconnect and waits for it.
    let trigger = {
        let f = f.clone();
        thread::spawn(move || read_direct(&f, 4096, 4096).map(drop))
    };
    assert!(
        wait_until(Instant::now() + TIMEOUT, || server.accepted() >= 2),
        "no reconnect came; stderr:\n{}",
        m.stderr()
    );
    // Meanwhile the queue answers: another read fails with EIO at once, a stat is answered.
    let started = Instant::now();
    let e = read_direct(&f, 8192, 4096).expect_err("a read while the reconnect hangs");
    assert_eq!(errno(&e), libc::EIO, "{e}");
    assert_eq!(fs::metadata(&mp).unwrap().len(), FAKE_NBD_SIZE);
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(20),
        "the queue was frozen for {took:?} during the reconnect; stderr:\n{}",
        m.stderr()
    );
    // A stop (the read waiting for the reconnect keeps the file open: SIGTERM twice) ends the
    // export without waiting for the handshake's 60 s.
    let started = Instant::now();
    m.stop_signals_twice();
    let st = m.wait_exit();
    let took = started.elapsed();
    assert!(st.exited, "the daemon did not exit; stderr:\n{}", st.stderr);
    assert!(
        took < Duration::from_secs(20),
        "the stop took {took:?} during a hung reconnect; stderr:\n{}",
        st.stderr
    );
    let r = trigger.join().expect("trigger thread");
    assert!(
        r.is_err(),
        "the read waiting for the reconnect cannot succeed"
    );
    assert!(!st.stderr.to_lowercase().contains("panic"), "{}", st.stderr);
}
