//! Data written through the export lands in the image byte for byte, and reads through
//! the export return what the image holds (the backing file is the oracle).

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::{Arc, Barrier};
use std::thread;

use fusex_e2e::*;

const IMG: u64 = 16 * MIB;

/// (offset, len) pairs: sizes from 1 byte to 4 MiB at unaligned offsets, some crossing
/// 4 KiB / 1 MiB boundaries, one ending exactly at EOF.
fn unaligned_cases() -> Vec<(u64, usize)> {
    vec![
        (7, 1),
        (1_000_001, 511),
        (2 * MIB + 4097, 4095),
        (3 * MIB + 1, 4096),
        (4 * MIB - 3, 4097),
        (5 * MIB + 511, 65537),
        (6 * MIB + 333, (MIB + 3) as usize),
        (IMG - 4 * MIB - 777, (4 * MIB) as usize),
        (IMG - 4097, 4097),
        // Overlaps an earlier write: the later one must win.
        (3 * MIB - 100, 8192),
    ]
}

/// 4 KiB-aligned (offset, len) pairs for O_DIRECT.
fn aligned_cases() -> Vec<(u64, usize)> {
    vec![
        (0, 4096),
        (4096 * 3, 8192),
        (MIB + 8192, 65536),
        (3 * MIB + 3 * 4096, MIB as usize),
        (5 * MIB - 4096, (MIB + 4096) as usize),
        (8 * MIB - 4096, (4 * MIB) as usize),
        (IMG - 4096, 4096),
    ]
}

/// Writes `cases` through `mount_path` with buffered or O_DIRECT I/O, reads each back
/// through the mount, then checks the backing file against the model and random reads of
/// mount vs backing.
fn roundtrip(tag: &str, args: &[&str], direct: bool, cases: &[(u64, usize)]) {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new(tag);
    let img = w.join("disk.img");
    let mut model = random_image(&img, IMG, 1);
    let m = Mount::start(&w, &img, &w.join("export"), args);
    let f = if direct {
        open_rw_direct(m.path())
    } else {
        m.open_rw()
    };
    assert_eq!(fstat(&f).0, IMG, "st_size of the export");

    let mut rng = Rng::new(2);
    let mut written = 0u64;
    for &(off, len) in cases {
        let data = rng.bytes(len);
        if direct {
            let buf = AlignedBuf::from_slice(&data, 4096);
            f.write_all_at(buf.as_slice(), off)
                .unwrap_or_else(|e| panic!("O_DIRECT pwrite {off}+{len}: {e}"));
            let mut back = AlignedBuf::new(len, 4096);
            let mut done = 0;
            while done < len {
                let n = f
                    .read_at(&mut back.as_mut_slice()[done..], off + done as u64)
                    .unwrap_or_else(|e| panic!("O_DIRECT pread {off}+{len}: {e}"));
                assert!(n > 0, "O_DIRECT pread {off}+{len}: EOF after {done} bytes");
                done += n;
            }
            assert_bytes_eq(
                back.as_slice(),
                &data,
                off,
                &format!("read back through mount {off}+{len}"),
            );
        } else {
            f.write_all_at(&data, off)
                .unwrap_or_else(|e| panic!("pwrite {off}+{len}: {e}"));
            let back =
                pread_full(&f, off, len).unwrap_or_else(|e| panic!("pread {off}+{len}: {e}"));
            assert_bytes_eq(
                &back,
                &data,
                off,
                &format!("read back through mount {off}+{len}"),
            );
        }
        model[off as usize..off as usize + len].copy_from_slice(&data);
        written += len as u64;
    }
    f.sync_all().expect("fsync of the export");

    let backing = open_ro(&img);
    assert_eq!(fstat(&backing).0, IMG, "backing file size changed");
    for &(off, len) in cases {
        let b = pread_full(&backing, off, len).unwrap();
        assert_bytes_eq(
            &b,
            &model[off as usize..off as usize + len],
            off,
            &format!("backing file after write {off}+{len}"),
        );
    }
    assert_bytes_eq(&read_all(&img), &model, 0, "whole backing file vs model");

    // Random reads (some straddling EOF: both sides must be equally short).
    let ro = if direct {
        m.open_ro()
    } else {
        f.try_clone().unwrap()
    };
    for i in 0..200 {
        let off = rng.below(IMG + 8192);
        let len = 1 + rng.below(256 * KIB) as usize;
        assert_same_range(&ro, &backing, off, len, &format!("random read #{i}"));
    }
    drop(ro);
    drop(f);

    let st = m.stop();
    st.assert_clean(tag);
    assert!(
        st.stat(&["ops", "WRITE"]) >= cases.len() as u64,
        "stats: {}",
        st.stats()
    );
    assert!(
        st.stat(&["backend", "bytes_written"]) >= written,
        "stats: {}",
        st.stats()
    );
    assert!(st.stat(&["ops", "READ"]) >= 1, "stats: {}", st.stats());
    assert!(
        st.stat(&["backend", "bytes_read"]) >= 1,
        "stats: {}",
        st.stats()
    );
    assert!(
        st.stat(&["requests"]) >= st.stat(&["ops", "WRITE"]),
        "stats: {}",
        st.stats()
    );
}

#[test]
fn roundtrip_buffered_unaligned() {
    roundtrip("rt-buffered", &["--writable"], false, &unaligned_cases());
}

#[test]
fn roundtrip_o_direct_aligned() {
    roundtrip("rt-odirect", &["--writable"], true, &aligned_cases());
}

#[test]
fn roundtrip_kernel_cache_unaligned() {
    roundtrip(
        "rt-kcache",
        &["--writable", "--kernel-cache"],
        false,
        &unaligned_cases(),
    );
}

/// `--direct` opens the image with O_DIRECT: unaligned requests from the application
/// must still land exactly (the daemon has to bounce / read-modify-write).
#[test]
fn roundtrip_backend_o_direct_unaligned() {
    roundtrip(
        "rt-backend-direct",
        &["--writable", "--direct"],
        false,
        &unaligned_cases(),
    );
}

/// Each raw-image I/O path of the binary (`--io-path`, DESIGN §5: "probe and measure")
/// must give the same bytes.
#[test]
fn roundtrip_each_io_path() {
    for path in ["ring", "inline", "nowait"] {
        roundtrip(
            &format!("rt-io-path-{path}"),
            &["--writable", "--io-path", path],
            false,
            &unaligned_cases(),
        );
        random_ops(
            &format!("rt-random-ops-{path}"),
            &["--writable", "--io-path", path],
        );
    }
}

/// A random mix of writes, reads, punches and zeroings against an in-memory model.
#[test]
fn random_ops_match_model() {
    random_ops("rt-random-ops", &["--writable"]);
}

#[test]
fn random_ops_backend_o_direct() {
    random_ops("rt-random-ops-direct", &["--writable", "--direct"]);
}

/// With the kernel page cache in play, punches and zeroings must not leave stale pages.
#[test]
fn random_ops_kernel_cache() {
    random_ops("rt-random-ops-kcache", &["--writable", "--kernel-cache"]);
}

fn random_ops(tag: &str, args: &[&str]) {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new(tag);
    let img = w.join("disk.img");
    let size = 4 * MIB;
    let mut model = random_image(&img, size, 11);
    let m = Mount::start(&w, &img, &w.join("export"), args);
    let f = m.open_rw();
    let mut rng = Rng::new(12);
    for i in 0..400 {
        let off = rng.below(size);
        let len = (1 + rng.below(192 * KIB)).min(size - off);
        let (o, l) = (off as usize, len as usize);
        match rng.below(10) {
            0..=4 => {
                let data = rng.bytes(l);
                f.write_all_at(&data, off)
                    .unwrap_or_else(|e| panic!("op #{i}: pwrite {off}+{len}: {e}"));
                model[o..o + l].copy_from_slice(&data);
            }
            5..=7 => {
                let got = pread_full(&f, off, l).unwrap_or_else(|e| panic!("op #{i}: pread: {e}"));
                assert_bytes_eq(
                    &got,
                    &model[o..o + l],
                    off,
                    &format!("op #{i}: read {off}+{len}"),
                );
            }
            8 => {
                fallocate(
                    &f,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    off,
                    len,
                )
                .unwrap_or_else(|e| panic!("op #{i}: punch {off}+{len}: {e}"));
                model[o..o + l].fill(0);
            }
            _ => {
                fallocate(&f, libc::FALLOC_FL_ZERO_RANGE, off, len)
                    .unwrap_or_else(|e| panic!("op #{i}: zero range {off}+{len}: {e}"));
                model[o..o + l].fill(0);
            }
        }
    }
    f.sync_all().expect("fsync");
    assert_bytes_eq(
        &pread_full(&f, 0, size as usize).unwrap(),
        &model,
        0,
        "export vs model",
    );
    assert_bytes_eq(&read_all(&img), &model, 0, "backing file vs model");
    drop(f);
    m.stop().assert_clean(tag);
}

/// 4 threads, separate fds, disjoint interleaved stripes of an odd size.
#[test]
fn concurrent_interleaved_writers() {
    interleaved_writers("rt-concurrent-stripes", &["--writable"]);
}

/// The same with one request in flight per queue: must not deadlock or lose writes.
#[test]
fn concurrent_interleaved_writers_queue_depth_1() {
    interleaved_writers("rt-concurrent-qd1", &["--writable", "--queue-depth", "1"]);
}

fn interleaved_writers(tag: &str, args: &[&str]) {
    if !require_fuse() {
        return;
    }
    const THREADS: usize = 4;
    const STRIPE: usize = 3 * 4096 + 1;
    let w = WorkDir::new(tag);
    let img = w.join("disk.img");
    let mut model = random_image(&img, IMG, 21);
    let m = Mount::start(&w, &img, &w.join("export"), args);
    let stripes = (IMG as usize).div_ceil(STRIPE);
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let path = m.path().to_path_buf();
            let barrier = barrier.clone();
            thread::spawn(move || {
                let f = open_rw(&path);
                let mut rng = Rng::new(100 + t as u64);
                barrier.wait();
                for k in (t..stripes).step_by(THREADS) {
                    let off = k * STRIPE;
                    let len = STRIPE.min(IMG as usize - off);
                    let data = rng.bytes(len);
                    f.write_all_at(&data, off as u64)
                        .unwrap_or_else(|e| panic!("thread {t}: pwrite stripe {k}: {e}"));
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("writer thread panicked");
    }
    // Same data, same order: the model.
    for t in 0..THREADS {
        let mut rng = Rng::new(100 + t as u64);
        for k in (t..stripes).step_by(THREADS) {
            let off = k * STRIPE;
            let len = STRIPE.min(IMG as usize - off);
            rng.fill(&mut model[off..off + len]);
        }
    }
    let f = m.open_rw();
    f.sync_all().expect("fsync");
    assert_bytes_eq(
        &read_all(&img),
        &model,
        0,
        "backing file after concurrent stripes",
    );
    assert_bytes_eq(
        &pread_full(&f, 0, IMG as usize).unwrap(),
        &model,
        0,
        "export after concurrent stripes",
    );
    drop(f);
    m.stop().assert_clean(tag);
}

const TAG_MAGIC: u32 = 0xF05E_7A66;

fn tag_block(thread: u32, block: u32, seq: u32) -> Vec<u8> {
    let mut rec = [0u8; 16];
    rec[0..4].copy_from_slice(&thread.to_le_bytes());
    rec[4..8].copy_from_slice(&block.to_le_bytes());
    rec[8..12].copy_from_slice(&seq.to_le_bytes());
    rec[12..16].copy_from_slice(&TAG_MAGIC.to_le_bytes());
    rec.repeat(4096 / 16)
}

/// 4 threads write random 4 KiB blocks (overlapping between threads) with their own tag.
/// Every block must end up either untouched, or exactly one whole write: the last one
/// its writer made to it (no torn or mixed blocks, nothing lost).
#[test]
fn concurrent_random_tagged_blocks() {
    tagged_blocks("rt-concurrent-tags", &["--writable"]);
}

/// The same over two queues (threads with cloned /dev/fuse fds, DESIGN §1 `--queues`).
#[test]
fn concurrent_random_tagged_blocks_two_queues() {
    tagged_blocks("rt-concurrent-tags-q2", &["--writable", "--queues", "2"]);
}

fn tagged_blocks(tag: &str, args: &[&str]) {
    if !require_fuse() {
        return;
    }
    const THREADS: u32 = 4;
    const WRITES: u32 = 1500;
    let size = 8 * MIB;
    let blocks = (size / 4096) as u32;
    let w = WorkDir::new(tag);
    let img = w.join("disk.img");
    let original = random_image(&img, size, 31);
    let m = Mount::start(&w, &img, &w.join("export"), args);
    let barrier = Arc::new(Barrier::new(THREADS as usize));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let path = m.path().to_path_buf();
            let barrier = barrier.clone();
            thread::spawn(move || {
                let f = open_rw(&path);
                let mut rng = Rng::new(200 + t as u64);
                // last[b] = seq of this thread's last write to block b.
                let mut last: Vec<Option<u32>> = vec![None; blocks as usize];
                barrier.wait();
                for seq in 0..WRITES {
                    let b = rng.below(blocks as u64) as u32;
                    f.write_all_at(&tag_block(t, b, seq), b as u64 * 4096)
                        .unwrap_or_else(|e| panic!("thread {t}: pwrite block {b}: {e}"));
                    last[b as usize] = Some(seq);
                }
                last
            })
        })
        .collect();
    let lasts: Vec<Vec<Option<u32>>> = handles
        .into_iter()
        .map(|h| h.join().expect("writer thread panicked"))
        .collect();
    let f = m.open_rw();
    f.sync_all().expect("fsync");
    let backing = read_all(&img);
    assert_eq!(backing.len() as u64, size);
    let mut touched = 0;
    for b in 0..blocks {
        let range = b as usize * 4096..(b as usize + 1) * 4096;
        let got = &backing[range.clone()];
        let writers: Vec<u32> = (0..THREADS)
            .filter(|&t| lasts[t as usize][b as usize].is_some())
            .collect();
        if writers.is_empty() {
            assert_bytes_eq(
                got,
                &original[range],
                b as u64 * 4096,
                &format!("untouched block {b}"),
            );
            continue;
        }
        touched += 1;
        let t = u32::from_le_bytes(got[0..4].try_into().unwrap());
        let seq = u32::from_le_bytes(got[8..12].try_into().unwrap());
        assert!(
            writers.contains(&t),
            "block {b}: content claims thread {t}, but only {writers:?} wrote it (torn or lost write?)"
        );
        let expected_seq = lasts[t as usize][b as usize].unwrap();
        assert_eq!(
            seq, expected_seq,
            "block {b} by thread {t}: not its last write"
        );
        assert_bytes_eq(
            got,
            &tag_block(t, b, seq),
            b as u64 * 4096,
            &format!("block {b} (torn write?)"),
        );
    }
    assert!(touched > 0);
    assert_bytes_eq(
        &pread_full(&f, 0, size as usize).unwrap(),
        &backing,
        0,
        "export vs backing",
    );
    drop(f);
    let st = m.stop();
    st.assert_clean(tag);
    assert!(
        st.stat(&["ops", "WRITE"]) >= (THREADS * WRITES) as u64,
        "every 4 KiB write is one WRITE request: {}",
        st.stats()
    );
}

/// Legacy READs spliced from an image in memory (`--splice-min`): what the reader gets is the
/// image, byte for byte, also across its end and after the image shrank behind the export
/// (the splice comes up short and the READ is served the ordinary way).
#[test]
fn legacy_spliced_reads_are_the_image() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("rt-splice");
    // Splicing is for images in memory: the image goes on tmpfs.
    let shm = tempfile::Builder::new()
        .prefix("fusex-splice-")
        .tempdir_in("/dev/shm")
        .expect("tempdir on /dev/shm");
    let img = shm.path().join("disk.img");
    random_image(&img, IMG, 7);
    let args = [
        "--transport",
        "legacy",
        "--passthrough",
        "off",
        "--splice-min",
        "64K",
    ];
    let m = Mount::start(&w, &img, &w.join("export"), &args);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(m.path())
        .expect("O_DIRECT open of the export");
    let backing = open_ro(&img);
    let mut rng = Rng::new(11);
    for i in 0..300 {
        let len = 64 * KIB as usize + 4096 * rng.below(240) as usize;
        let off = 4096 * rng.below((IMG + MIB) / 4096);
        let mut got = AlignedBuf::new(len, 4096);
        let n = f.read_at(got.as_mut_slice(), off).unwrap();
        let want = pread_full(&backing, off, len).unwrap();
        assert_bytes_eq(
            &got.as_slice()[..n],
            &want,
            off,
            &format!("spliced read #{i}"),
        );
    }
    // Shrink the image behind the export: reads across the new end come back short.
    let shrunk = IMG - 3 * MIB - 4096;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(shrunk)
        .unwrap();
    let mut got = AlignedBuf::new(MIB as usize, 4096);
    let off = shrunk - 256 * KIB;
    let n = f.read_at(got.as_mut_slice(), off).unwrap();
    assert_eq!(n as u64, shrunk - off, "read across the shrunk end");
    assert_bytes_eq(
        &got.as_slice()[..n],
        &pread_full(&backing, off, n).unwrap(),
        off,
        "read across the shrunk end",
    );
    drop(f);
    let st = m.stop();
    st.assert_clean("rt-splice");
    assert!(
        st.stat(&["spliced_bytes"]) >= 100 * 64 * KIB,
        "READs were spliced: {}",
        st.stats()
    );
    assert_eq!(st.stat(&["copied_bytes"]), 0, "{}", st.stats());
}
