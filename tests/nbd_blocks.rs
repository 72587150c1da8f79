//! NBD exports whose server takes whole blocks only, and `st_blocks` from block status.
//!
//! - nbdkit's `blocksize-policy` filter with `blocksize-error-policy=error` fails every request
//!   not aligned to its minimum block size: unaligned `pwrite`/`pread` from many threads at once
//!   (disjoint byte ranges sharing blocks) and unaligned punch-hole/zero-range through the
//!   mounted export must read back as an in-memory model says, and the server's own content
//!   (copied out with `nbdcopy` after the export ends) must match it too;
//! - `st_blocks` of an export of a sparse raw image served by qemu-nbd matches what
//!   `qemu-img map` says is data in the image, and grows after a write; a server without
//!   structured replies (so without `base:allocation`) reports the export fully allocated.

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::thread;

use fusex_e2e::*;

const SIZE: usize = 8 << 20;
const THREADS: usize = 8;

#[test]
fn unaligned_io_from_many_threads_against_a_strict_server() {
    if !require_fuse_and_tools(&["nbdkit", "nbdcopy"]) {
        return;
    }
    let w = WorkDir::new("nbd-rmw");
    let sock = w.join("s.sock");
    let mp = w.join("export");
    // Anything not aligned to 4 KiB (or above 64 KiB) fails with EINVAL at the server.
    let (_server, m) = strict_blocksize_export(&w, &sock, &mp);
    // Plain descriptors: the export uses direct I/O, so every pwrite/pread reaches the backend
    // with its own offset and length.
    let f = Arc::new(OpenOptions::new().read(true).write(true).open(&mp).unwrap());
    let mut rng = Rng::new(13);
    let mut model = rng.bytes(SIZE);
    // Filled with unaligned writes of odd sizes too.
    let mut at = 0;
    while at < SIZE {
        let n = (rng.below(200_000) as usize + 1).min(SIZE - at);
        f.write_all_at(&model[at..at + n], at as u64).unwrap();
        at += n;
    }

    // The first 2 MiB cut into ranges of 1..=3000 bytes, dealt to the threads in turn: every
    // block is shared by ranges of several threads.
    let mut ranges: Vec<Vec<(usize, usize)>> = vec![Vec::new(); THREADS];
    let (mut at, mut i) = (0, 0);
    while at < 2 << 20 {
        let n = rng.below(3000) as usize + 1;
        ranges[i % THREADS].push((at, n));
        at += n;
        i += 1;
    }
    let workers: Vec<_> = ranges
        .into_iter()
        .enumerate()
        .map(|(t, mine)| {
            let f = f.clone();
            let start = model.clone();
            thread::spawn(move || {
                let mut rng = Rng::new(100 + t as u64);
                let mut own = start;
                for round in 0..400 {
                    let (off, n) = mine[rng.below(mine.len() as u64) as usize];
                    let data = rng.bytes(n);
                    f.write_all_at(&data, off as u64).unwrap();
                    own[off..off + n].copy_from_slice(&data);
                    if round % 3 == 0 {
                        // Another of its ranges read back: nobody else writes there.
                        let (off, n) = mine[rng.below(mine.len() as u64) as usize];
                        let mut got = vec![0u8; n];
                        f.read_exact_at(&mut got, off as u64).unwrap();
                        assert_bytes_eq(&got, &own[off..off + n], off as u64, "own range");
                    }
                }
                (mine, own)
            })
        })
        .collect();
    for h in workers {
        let (mine, own) = h.join().expect("a writer thread failed");
        for (off, n) in mine {
            model[off..off + n].copy_from_slice(&own[off..off + n]);
        }
    }
    // Unaligned punch-hole and zero-range read back as zeroes, neighbours intact.
    for (mode, off, len) in [
        (
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            3 << 20 | 100,
            10_000,
        ),
        (libc::FALLOC_FL_ZERO_RANGE, 4 << 20 | 4000, 200),
        (
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            5 << 20,
            3000,
        ),
        (libc::FALLOC_FL_ZERO_RANGE, 6 << 20 | 1, 300_001),
    ] {
        fallocate(&f, mode, off, len).expect("fallocate through the export");
        model[off as usize..(off + len) as usize].fill(0);
    }
    // Reads of odd sizes at odd offsets.
    for _ in 0..200 {
        let n = rng.below(20_000) as usize + 1;
        let off = rng.below((SIZE - n) as u64) as usize;
        let mut got = vec![0u8; n];
        f.read_exact_at(&mut got, off as u64).unwrap();
        assert_bytes_eq(&got, &model[off..off + n], off as u64, "unaligned read");
    }
    let mut all = vec![0u8; SIZE];
    f.read_exact_at(&mut all, 0).unwrap();
    assert_bytes_eq(
        &all,
        &model,
        0,
        "the export after concurrent unaligned writes",
    );
    drop(f);
    m.stop().assert_clean("unaligned I/O");
    // The server's own content.
    let out = w.join("copy.raw");
    // In requests the server takes (nbdcopy's default of 256 KiB is above its maximum).
    run_ok(
        Command::new("nbdcopy")
            .arg("--request-size=65536")
            .arg(nbd_uri(&sock, ""))
            .arg(&out),
    );
    assert_bytes_eq(&fs::read(&out).unwrap(), &model, 0, "the server's content");
}

/// Bytes `qemu-img map` calls data in the raw image at `img`.
fn mapped_data(img: &Path) -> u64 {
    let out = run_ok(
        Command::new("qemu-img")
            .args(["map", "-U", "--output=json", "-f", "raw"])
            .arg(img),
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("qemu-img map JSON");
    v.as_array()
        .expect("a list of extents")
        .iter()
        .filter(|e| e["data"].as_bool() == Some(true))
        .map(|e| e["length"].as_u64().unwrap())
        .sum()
}

#[test]
fn st_blocks_counts_what_block_status_calls_data() {
    if !require_fuse_and_tools(&["qemu-nbd", "qemu-img", "nbdkit"]) {
        return;
    }
    let w = WorkDir::new("nbd-blocks");
    let img = w.join("sparse.raw");
    {
        let f = File::create(&img).unwrap();
        f.set_len(16 * MIB).unwrap();
        let mut rng = Rng::new(5);
        f.write_all_at(&rng.bytes(MIB as usize), MIB).unwrap();
        f.write_all_at(&rng.bytes(8192), 8 * MIB + 4096).unwrap();
        f.sync_all().unwrap();
    }
    let before = mapped_data(&img);
    assert!((MIB..2 * MIB).contains(&before), "{before} bytes of data");
    let sock = w.join("q.sock");
    let mut c = Command::new("qemu-nbd");
    c.args(["-t", "-f", "raw", "-k"]).arg(&sock).arg(&img);
    let _server = nbd_server(c, &sock);
    let mp = w.join("export");
    let m = Mount::start(&w, nbd_uri(&sock, ""), &mp, &["--writable"]);
    let (size, blocks, _) = stat(&mp).unwrap();
    assert_eq!(size, 16 * MIB);
    assert_eq!(blocks * 512, before, "st_blocks against qemu-img map");
    // A write (and its flush) allocates; the next stat counts it.
    let f = OpenOptions::new().write(true).open(&mp).unwrap();
    f.write_all_at(&Rng::new(6).bytes(MIB as usize), 12 * MIB)
        .unwrap();
    f.sync_all().unwrap();
    let after = mapped_data(&img);
    assert!(
        after >= before + MIB,
        "{after} bytes of data after the write"
    );
    let (_, blocks, _) = stat(&mp).unwrap();
    assert_eq!(blocks * 512, after, "st_blocks after a write");
    drop(f);
    m.stop().assert_clean("st_blocks");

    // Without structured replies there is no base:allocation: fully allocated, as before.
    let sock = w.join("k.sock");
    let _plain = nbdkit(&sock, &["--no-sr", "memory", "size=4M"]);
    let mp = w.join("plain");
    let m = Mount::start(&w, nbd_uri(&sock, ""), &mp, &[]);
    let (size, blocks, _) = stat(&mp).unwrap();
    assert_eq!((size, blocks * 512), (4 * MIB, 4 * MIB));
    m.stop().assert_clean("st_blocks without block status");
}
