//! The core against a toy format: a table of little-endian u64 host offsets at the start of the
//! file (0: unallocated), blocks appended after it.

use super::testing::{engine, read, write};
use super::*;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

const SHIFT: u32 = 12;
const BS: u64 = 1 << SHIFT;
const BLOCKS: u64 = 16;
const HEADER: u64 = 4096;

struct Toy;

impl BlockFormat for Toy {
    fn name(&self) -> &'static str {
        "toy"
    }
    fn footprint(&self) -> u64 {
        BS
    }
    async fn reserve(&self, file: &RingFile, host: u64, end: u64) -> io::Result<bool> {
        let old = file.file().metadata()?.len();
        file.extend_to(end)?;
        Ok(host >= old)
    }
    async fn commit(&self, file: &RingFile, block: u64, host: u64) -> io::Result<Entry> {
        file.write_full(&host.to_le_bytes(), block * 8).await?;
        Ok(Entry::Data { host, flags: 0 })
    }
}

fn create(path: &Path) {
    std::fs::write(path, vec![0u8; HEADER as usize]).unwrap();
}

fn open(path: &Path) -> TableImage<Toy> {
    let file = RingFile::open_path(path, true, false).unwrap();
    let mut raw = vec![0u8; (BLOCKS * 8) as usize];
    file.file().read_exact_at(&mut raw, 0).unwrap();
    let len = file.file().metadata().unwrap().len();
    let table = Table::new(BLOCKS).unwrap();
    for (i, w) in raw.chunks(8).enumerate() {
        let host = u64::from_le_bytes(w.try_into().unwrap());
        let e = match host {
            0 => Entry::Unallocated,
            h if h < HEADER || h + BS > len => Entry::Bad,
            h => Entry::Data { host: h, flags: 0 },
        };
        table.set(i as u64, e);
    }
    TableImage::new(
        file,
        Toy,
        table,
        Layout {
            block_shift: SHIFT,
            size: BLOCKS * BS,
            next_free: len.max(HEADER),
            writable: true,
        },
    )
}

#[test]
fn unallocated_reads_zero_and_writes_allocate_and_persist() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.img");
    create(&p);
    let img = open(&p);
    assert_eq!(
        read(&img, 0, (BLOCKS * BS) as usize).unwrap(),
        vec![0; (BLOCKS * BS) as usize]
    );
    // Straddles blocks 2 and 3.
    let data: Vec<u8> = (0..6000u32).map(|i| (i % 251) as u8).collect();
    write(&img, 2 * BS + 100, &data).unwrap();
    let mut want = vec![0u8; (BLOCKS * BS) as usize];
    want[(2 * BS + 100) as usize..][..data.len()].copy_from_slice(&data);
    assert_eq!(read(&img, 0, want.len()).unwrap(), want);
    assert_eq!(img.table().count_data(), 2);
    assert_eq!(
        std::fs::metadata(&p).unwrap().len(),
        HEADER + 2 * BS,
        "two blocks appended, nothing else"
    );
    drop(img);
    let again = open(&p);
    assert_eq!(
        read(&again, 0, want.len()).unwrap(),
        want,
        "after reopening"
    );
}

#[test]
fn racing_writers_allocate_a_block_once() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.img");
    create(&p);
    let img = Arc::new(open(&p));
    // 8 threads, each on its own engine, write their own 512 bytes of block 5 at once.
    let threads: Vec<_> = (0..8u8)
        .map(|t| {
            let img = img.clone();
            std::thread::spawn(move || {
                write(&img, 5 * BS + u64::from(t) * 512, &[t + 1; 512]).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(img.table().count_data(), 1);
    assert_eq!(std::fs::metadata(&p).unwrap().len(), HEADER + BS);
    let got = read(&img, 5 * BS, BS as usize).unwrap();
    for t in 0..8u8 {
        assert!(
            got[t as usize * 512..][..512].iter().all(|&b| b == t + 1),
            "writer {t}"
        );
    }
}

#[test]
fn writes_joining_a_failed_allocation_allocate_again() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.img");
    let img = Arc::new(scripted(
        &p,
        Scripted {
            fail_first: Some(AtomicBool::new(false)),
            ..Scripted::default()
        },
    ));
    let threads: Vec<_> = (0..8u8)
        .map(|t| {
            let img = img.clone();
            std::thread::spawn(move || write(&img, 5 * BS + u64::from(t) * 512, &[t + 1; 512]))
        })
        .collect();
    let outcomes: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    // The first allocator's commit failed: that write fails, every other one lands in a block
    // allocated again (whether it had joined the failed allocation or came after it).
    let failed: Vec<_> = (0..8).filter(|&t| outcomes[t].is_err()).collect();
    assert_eq!(failed.len(), 1, "{outcomes:?}");
    assert_eq!(
        outcomes[failed[0]].as_ref().unwrap_err().raw_os_error(),
        Some(libc::EIO)
    );
    assert_eq!(img.table().count_data(), 1);
    let got = read(&img, 5 * BS, BS as usize).unwrap();
    for t in (0..8u8).filter(|&t| usize::from(t) != failed[0]) {
        assert!(
            got[t as usize * 512..][..512].iter().all(|&b| b == t + 1),
            "writer {t}"
        );
    }
    // The failed allocation's space is leaked, never reused or pointed at.
    let entry = img.table().get(5);
    assert_eq!(
        entry,
        Entry::Data {
            host: HEADER + BS,
            flags: 0
        }
    );
}

#[test]
fn bad_entries_fail_only_their_block() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.img");
    create(&p);
    // Block 1 points past the end of the file, block 2 into the table.
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.write_all_at(&(1u64 << 40).to_le_bytes(), 8).unwrap();
    f.write_all_at(&8u64.to_le_bytes(), 16).unwrap();
    drop(f);
    let img = open(&p);
    assert_eq!(img.table().get(1), Entry::Bad);
    assert_eq!(img.table().get(2), Entry::Bad);
    let before = std::fs::read(&p).unwrap();
    for b in [1, 2] {
        let e = read(&img, b * BS, 10).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
        let e = write(&img, b * BS, &[1; 10]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
        let e = engine()
            .block_on(img.zero(b * BS, 10))
            .unwrap()
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
    }
    assert_eq!(std::fs::read(&p).unwrap(), before, "nothing written");
    assert_eq!(read(&img, 0, BS as usize).unwrap(), vec![0; BS as usize]);
    write(&img, 3 * BS, &[7; 100]).unwrap();
    assert_eq!(read(&img, 3 * BS, 100).unwrap(), vec![7; 100]);
}

#[test]
fn reads_join_contiguous_blocks_and_follow_scattered_ones() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.img");
    create(&p);
    let img = open(&p);
    // Allocated in reverse: blocks 7, 6 land in the file in that order (not contiguous in
    // guest order); 8, 9 in order (contiguous).
    for b in [7u64, 6, 8, 9] {
        write(&img, b * BS, &vec![b as u8; BS as usize]).unwrap();
    }
    let got = read(&img, 5 * BS + 7, (5 * BS) as usize).unwrap();
    for (i, &v) in got.iter().enumerate() {
        let b = (5 * BS + 7 + i as u64) / BS;
        let want = if (6..=9).contains(&b) { b as u8 } else { 0 };
        assert_eq!(v, want, "byte {i} (block {b})");
    }
}

#[test]
fn zeroing_and_block_status() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.img");
    create(&p);
    let img = open(&p);
    write(&img, 3 * BS, &vec![9; (2 * BS) as usize]).unwrap();
    engine()
        .block_on(img.zero(3 * BS + 10, BS))
        .unwrap()
        .unwrap();
    let got = read(&img, 3 * BS, (2 * BS) as usize).unwrap();
    assert!(got[..10].iter().all(|&b| b == 9));
    assert!(got[10..][..BS as usize].iter().all(|&b| b == 0));
    assert!(got[(BS + 10) as usize..].iter().all(|&b| b == 9));
    assert_eq!(img.next_of(0, true), Some(3 * BS));
    assert_eq!(img.next_of(3 * BS + 5, false), Some(5 * BS));
    assert_eq!(img.next_of(6 * BS, true), None);
}

#[test]
fn a_random_workload_matches_a_model_and_survives_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.img");
    create(&p);
    let img = open(&p);
    let size = (BLOCKS * BS) as usize;
    let mut model = vec![0u8; size];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut rnd = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    for step in 0..400 {
        let off = rnd(size as u64) as usize;
        let len = (1 + rnd(3 * BS)).min((size - off) as u64) as usize;
        match rnd(3) {
            0 => {
                let data: Vec<u8> = (0..len).map(|i| (step + i) as u8 | 1).collect();
                write(&img, off as u64, &data).unwrap();
                model[off..off + len].copy_from_slice(&data);
            }
            1 => {
                engine()
                    .block_on(img.zero(off as u64, len as u64))
                    .unwrap()
                    .unwrap();
                model[off..off + len].fill(0);
            }
            _ => assert_eq!(read(&img, off as u64, len).unwrap(), &model[off..off + len]),
        }
    }
    assert_eq!(read(&img, 0, size).unwrap(), model);
    drop(img);
    assert_eq!(read(&open(&p), 0, size).unwrap(), model);
}

/// The toy format with scripted commits: with `fail_first` the first commit fails (its table
/// write refused); each commit waits, yielding, until `want` commits are under way at once (or
/// fails with `ETIMEDOUT` after 10 s, far longer than the others take to arrive: a write whose
/// allocations run one after another cannot get through); a commit of block `fail` fails with
/// EIO once the others arrived.
#[derive(Default)]
struct Scripted {
    fail_first: Option<AtomicBool>,
    arrived: std::sync::atomic::AtomicUsize,
    want: usize,
    fail: Option<u64>,
}

/// Gives the executor one turn (the other futures of the task run meanwhile).
async fn yield_once() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    })
    .await
}

impl BlockFormat for Scripted {
    fn name(&self) -> &'static str {
        "scripted"
    }
    fn footprint(&self) -> u64 {
        BS
    }
    async fn reserve(&self, file: &RingFile, host: u64, end: u64) -> io::Result<bool> {
        Toy.reserve(file, host, end).await
    }
    async fn commit(&self, file: &RingFile, block: u64, host: u64) -> io::Result<Entry> {
        if let Some(f) = &self.fail_first {
            if !f.swap(true, Ordering::AcqRel) {
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
        }
        self.arrived.fetch_add(1, Ordering::AcqRel);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while self.arrived.load(Ordering::Acquire) < self.want {
            if std::time::Instant::now() > deadline {
                return Err(io::Error::from_raw_os_error(libc::ETIMEDOUT));
            }
            yield_once().await;
        }
        if self.fail == Some(block) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Toy.commit(file, block, host).await
    }
}

/// A new empty toy image at `p`, served with `fmt`'s commits.
fn scripted(p: &Path, fmt: Scripted) -> TableImage<Scripted> {
    create(p);
    let toy = open(p);
    TableImage::new(
        toy.file,
        fmt,
        toy.table,
        Layout {
            block_shift: SHIFT,
            size: BLOCKS * BS,
            next_free: HEADER,
            writable: true,
        },
    )
}

#[test]
fn a_write_allocates_the_blocks_it_spans_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.img");
    // Four blocks (from the middle of block 2 to the middle of block 6): the four
    // allocations of the first group meet, then block 6's alone.
    let img = scripted(
        &p,
        Scripted {
            want: 4,
            ..Scripted::default()
        },
    );
    let data: Vec<u8> = (0..4 * BS).map(|i| (i % 251) as u8 + 1).collect();
    let off = 2 * BS + BS / 2;
    write(&img, off, &data).unwrap();
    assert_eq!(img.table().count_data(), 5);
    assert_eq!(read(&img, off, data.len()).unwrap(), data);
    assert_eq!(read(&img, 0, off as usize).unwrap(), vec![0; off as usize]);
}

#[test]
fn a_write_whose_later_block_fails_reports_the_pieces_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.img");
    let img = scripted(
        &p,
        Scripted {
            want: 3,
            fail: Some(4),
            ..Scripted::default()
        },
    );
    let eng = engine::Engine::new(&engine::EngineConfig {
        buffers: 1,
        buffer_size: (3 * BS) as usize,
        ..engine::EngineConfig::default()
    })
    .unwrap();
    let mut buf = eng.take_buffer().unwrap();
    buf.as_mut_slice().fill(5);
    let (r, _) = eng
        .block_on(crate::BlockBackend::write_at(
            &img,
            &eng,
            buf.slice(0..(3 * BS) as usize),
            3 * BS,
        ))
        .unwrap();
    // Block 3 landed; block 4 failed; block 5 may have landed but is not counted.
    assert_eq!(r.unwrap(), BS as usize, "a short write of the first block");
    assert_eq!(
        read(&img, 3 * BS, BS as usize).unwrap(),
        vec![5; BS as usize]
    );
    assert_eq!(img.table().get(4), Entry::Unallocated);
}
