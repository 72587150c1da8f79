//! qcow2 through the engine, without FUSE: many concurrent tasks on one engine writing and reading
//! a fresh image, checked against an in-memory oracle, then `qemu-img check` when it exists.

use std::process::Command;
use std::rc::Rc;

use backend::qcow2::CacheOptions;
use backend::{BlockBackend, Qcow2Backend, Qcow2Options};
use engine::{Engine, EngineConfig};

fn qemu_img() -> Option<std::path::PathBuf> {
    let out = Command::new("sh")
        .args(["-c", "command -v qemu-img"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().into())
}

/// `qemu-img create` of a qcow2 image of `size` (bytes, or with a suffix) with clusters of
/// `cluster` bytes.
fn create(qemu_img: &std::path::Path, path: &std::path::Path, cluster: u64, size: &str) {
    let st = Command::new(qemu_img)
        .args(["create", "-q", "-f", "qcow2", "-o"])
        .arg(format!("cluster_size={cluster}"))
        .arg(path)
        .arg(size)
        .status()
        .unwrap();
    assert!(st.success());
}

/// qemu-img's path, a directory of the test's own and a fresh image `name` in it (see
/// [`create`]); None where qemu-img is missing (never in CI, where that fails the test).
fn fresh_image(
    name: &str,
    cluster: u64,
    size: &str,
) -> Option<(std::path::PathBuf, tempfile::TempDir, std::path::PathBuf)> {
    let Some(qemu_img) = qemu_img() else {
        assert!(std::env::var_os("CI").is_none(), "qemu-img missing in CI");
        return None;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    create(&qemu_img, &path, cluster, size);
    Some((qemu_img, dir, path))
}

/// An engine with `buffers` request buffers of 64 KiB.
fn engine(buffers: usize) -> Engine {
    Engine::new(&EngineConfig {
        buffers,
        buffer_size: 65536,
        ..EngineConfig::default()
    })
    .unwrap()
}

/// Writes `len` bytes of `fill` at `off`, reads them back into a zeroed buffer and says whether
/// every byte read is `fill` (each I/O must be whole).
async fn write_and_read_back(b: &Qcow2Backend, e: &Engine, off: u64, len: usize, fill: u8) -> bool {
    let mut buf = e.take_buffer().unwrap();
    buf.as_mut_slice()[..len].fill(fill);
    let (r, win) = b.write_at(e, buf.slice(0..len), off).await;
    assert_eq!(r.unwrap(), len);
    let mut buf = win.into_inner();
    buf.as_mut_slice().fill(0);
    let (r, win) = b.read_at(e, buf.slice(0..len), off).await;
    assert_eq!(r.unwrap(), len);
    win.as_slice().iter().all(|&x| x == fill)
}

/// `qemu-img check` finds nothing wrong with the image.
fn assert_check_clean(qemu_img: &std::path::Path, path: &std::path::Path) {
    let out = Command::new(qemu_img)
        .arg("check")
        .arg(path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn concurrent_allocating_writes_read_back() {
    allocating_writes_read_back(CacheOptions::default());
}

/// The smallest caches (two tables each) serve the same writes: every table is evicted and
/// read again many times over, with tasks holding tables in use while others need room.
#[test]
fn concurrent_allocating_writes_read_back_through_two_table_caches() {
    allocating_writes_read_back(CacheOptions {
        l2: Some(0),
        refcount: Some(0),
        clean_interval: None,
    });
}

fn allocating_writes_read_back(cache: CacheOptions) {
    let Some((qemu_img, _dir, path)) = fresh_image("t.qcow2", 4096, "8M") else {
        return;
    };
    let b = Rc::new(
        Qcow2Backend::open(
            &path,
            Qcow2Options {
                writable: true,
                cache,
                ..Qcow2Options::default()
            },
        )
        .unwrap(),
    );
    if cache != CacheOptions::default() {
        assert_eq!(b.metadata_cache_entries(), (2, 2));
    }
    let eng = Rc::new(engine(32));
    let tasks = 16u64;
    for t in 0..tasks {
        let (b, e) = (b.clone(), eng.clone());
        eng.spawn(async move {
            for i in 0..8u64 {
                let off = (i * tasks + t) * 12288 + 100;
                let fill = (t * 8 + i) as u8 | 1;
                assert!(
                    write_and_read_back(&b, &e, off, 10000, fill).await,
                    "task {t} round {i}"
                );
            }
        });
    }
    eng.run().unwrap();
    eng.block_on(b.flush(&eng)).unwrap().unwrap();
    drop(b);
    assert_check_clean(&qemu_img, &path);
}

/// The cache sizes a user gives (QEMU's `l2-cache-size` and `refcount-cache-size`) set how many
/// tables each cache keeps, in clusters of the image, from two up to imago's ceiling; without
/// them the top image keeps QEMU's default L2 ceiling and its share of fusex's refcount budget.
#[test]
fn cache_sizes_set_how_many_tables_each_cache_keeps() {
    let Some((_, _dir, path)) = fresh_image("c.qcow2", 65536, "1G") else {
        return;
    };
    let entries = |l2: Option<u64>, refcount: Option<u64>, writable: bool| {
        Qcow2Backend::open(
            &path,
            Qcow2Options {
                writable,
                cache: CacheOptions {
                    l2,
                    refcount,
                    clean_interval: None,
                },
                ..Qcow2Options::default()
            },
        )
        .unwrap()
        .metadata_cache_entries()
    };
    // By default 32 MiB of L2 tables (QEMU's ceiling) and 4 MiB of refcount blocks, at most
    // imago's default 32.
    assert_eq!(entries(None, None, true), (512, 32));
    assert_eq!(entries(None, None, false), (512, 32));
    assert_eq!(entries(Some(1 << 20), Some(256 << 10), true), (16, 4));
    assert_eq!(entries(Some(1 << 20), Some(256 << 10), false), (16, 4));
    // One given, the other keeps its share.
    assert_eq!(entries(Some(32 << 20), None, true), (512, 32));
    assert_eq!(entries(None, Some(1 << 20), true), (512, 16));
    // Part of a cluster rounds down, and never below two tables.
    assert_eq!(entries(Some(100_000), Some(1), true), (2, 2));
    let max = imago::qcow2::MAX_SPLIT_ENTRIES;
    assert_eq!(entries(Some(u64::MAX), Some(1 << 30), true), (max, max));
}

/// `cache-clean-interval`: a table nobody used for an interval is dropped at the next pass, one
/// in use since stays, and dropping never costs data (a table with changes not yet written
/// stays until they are); 0 keeps every table.
#[test]
fn unused_metadata_tables_are_dropped_after_the_clean_interval() {
    // 4 KiB clusters: an L2 table maps 2 MiB, so 8 MiB of guest take four tables.
    let Some((qemu_img, _dir, path)) = fresh_image("clean.qcow2", 4096, "8M") else {
        return;
    };
    let open = |secs: u32| {
        Qcow2Backend::open(
            &path,
            Qcow2Options {
                writable: true,
                cache: CacheOptions {
                    clean_interval: Some(secs),
                    ..CacheOptions::default()
                },
                ..Qcow2Options::default()
            },
        )
        .unwrap()
    };
    let eng = engine(4);
    const MIB2: u64 = 2 << 20;
    let write = |b: &Qcow2Backend, off: u64, fill: u8| {
        eng.block_on(async {
            let mut buf = eng.take_buffer().unwrap();
            buf.as_mut_slice()[..4096].fill(fill);
            let (r, _) = b.write_at(&eng, buf.slice(0..4096), off).await;
            assert_eq!(r.unwrap(), 4096);
        })
        .unwrap();
    };
    let read = |b: &Qcow2Backend, off: u64| -> u8 {
        eng.block_on(async {
            let buf = eng.take_buffer().unwrap();
            let (r, win) = b.read_at(&eng, buf.slice(0..4096), off).await;
            assert_eq!(r.unwrap(), 4096);
            let first = win.as_slice()[0];
            assert!(
                win.as_slice().iter().all(|&x| x == first),
                "torn read at {off}"
            );
            first
        })
        .unwrap()
    };
    let l2_cached = |b: &Qcow2Backend| b.metadata_cached().0.expect("the L2 cache is idle");
    // A pass is due an interval after the previous one.
    let pass = |b: &Qcow2Backend| {
        std::thread::sleep(std::time::Duration::from_millis(1100));
        b.drop_unused();
    };

    let b = open(1);
    for t in 0..4u8 {
        write(&b, u64::from(t) * MIB2, t + 1);
    }
    eng.block_on(b.flush(&eng)).unwrap().unwrap();
    assert_eq!(l2_cached(&b), 4);
    // The first pass only marks: everything was used since the daemon started.
    pass(&b);
    assert_eq!(l2_cached(&b), 4);
    assert_eq!(read(&b, 0), 1);
    pass(&b);
    assert_eq!(l2_cached(&b), 1, "tables 1-3 went unused for an interval");
    // Table 2 gets a change that is not written back yet, then both go unused for intervals.
    write(&b, 2 * MIB2 + 8192, 9);
    pass(&b);
    pass(&b);
    assert_eq!(
        l2_cached(&b),
        1,
        "table 0 went, table 2 stays until it is written"
    );
    eng.block_on(b.flush(&eng)).unwrap().unwrap();
    pass(&b);
    assert_eq!(l2_cached(&b), 0);
    assert_eq!(b.stats().qcow2.unwrap().metadata_tables, Some(0));
    // Every table dropped is read again as needed, with what was written.
    for t in 0..4u8 {
        assert_eq!(read(&b, u64::from(t) * MIB2), t + 1);
    }
    assert_eq!(read(&b, 2 * MIB2 + 8192), 9);
    drop(b);

    // 0: never.
    let b = open(0);
    for t in 0..4u8 {
        assert_eq!(read(&b, u64::from(t) * MIB2), t + 1);
    }
    pass(&b);
    pass(&b);
    assert_eq!(l2_cached(&b), 4);
    drop(b);
    assert_check_clean(&qemu_img, &path);
}

/// Passes that drop unused tables, run over and over from another thread (as an export's
/// supervisor runs them) while 16 tasks allocate, write and read back across 16 L2 tables: a pass
/// only tries the caches' locks, never drops a table a request holds or one with changes not
/// written back, and a table dropped while a request was loading it is read again; every byte
/// reads back as written, and `qemu-img check` finds the image clean.
#[test]
fn allocating_writes_read_back_while_passes_drop_unused_tables() {
    const MIB2: u64 = 2 << 20;
    let Some((qemu_img, _dir, path)) = fresh_image("race.qcow2", 4096, &(16 * MIB2).to_string())
    else {
        return;
    };
    let b = std::sync::Arc::new(
        Qcow2Backend::open(
            &path,
            Qcow2Options {
                writable: true,
                cache: CacheOptions {
                    // Two refcount blocks: allocations also evict and write back.
                    refcount: Some(0),
                    clean_interval: Some(0),
                    ..CacheOptions::default()
                },
                ..Qcow2Options::default()
            },
        )
        .unwrap(),
    );
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let cleaner = {
        let (b, stop) = (b.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut passes = 0u64;
            let mut dropped = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                dropped += b.drop_unused_now();
                passes += 1;
                std::thread::yield_now();
            }
            (passes, dropped)
        })
    };
    let eng = Rc::new(engine(32));
    let tasks = 16u64;
    // Task t writes 8 KiB blocks in table (t + i) % 16, so the tasks keep moving between tables.
    let off = |t: u64, i: u64| ((t + i) % 16) * MIB2 + (t * 32 + i) * 8192 + 512;
    for round in 0..4u64 {
        for t in 0..tasks {
            let (b, e) = (b.clone(), eng.clone());
            eng.spawn(async move {
                for i in 0..8u64 {
                    let fill = ((round * 64 + t * 4 + i) % 251) as u8 | 1;
                    assert!(
                        write_and_read_back(&b, &e, off(t, i), 8192, fill).await,
                        "round {round} task {t} block {i}"
                    );
                }
            });
        }
        eng.run().unwrap();
        if round == 1 {
            eng.block_on(b.flush(&eng)).unwrap().unwrap();
        }
    }
    // Everything reads back once more, after the last round's writes.
    for t in 0..tasks {
        for i in 0..8u64 {
            let fill = ((3 * 64 + t * 4 + i) % 251) as u8 | 1;
            let got = eng
                .block_on(async {
                    let buf = eng.take_buffer().unwrap();
                    let (r, win) = b.read_at(&eng, buf.slice(0..8192), off(t, i)).await;
                    assert_eq!(r.unwrap(), 8192);
                    win.as_slice().iter().all(|&x| x == fill)
                })
                .unwrap();
            assert!(got, "task {t} block {i} after the last round");
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (passes, dropped) = cleaner.join().unwrap();
    eprintln!("{passes} passes dropped {dropped} tables");
    assert!(dropped > 0, "{passes} passes dropped nothing");
    eng.block_on(b.flush(&eng)).unwrap().unwrap();
    drop(b);
    assert_check_clean(&qemu_img, &path);
}
