//! FUSE-over-io_uring specifics: fallback when the kernel switch is off, every CPU's queue served,
//! extreme queue depths, the copy-free data path, and unmounting under load.
//!
//! The data-integrity suites run on both transports via `FUSEX_E2E_TRANSPORT` (see the Makefile);
//! this file covers what only the io_uring transport has.

use std::ffi::OsString;
use std::fs;
use std::process::Command;
use std::sync::RwLock;
use std::time::Instant;

use fusex_e2e::*;

const PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

/// Tests that need io_uring hold this shared; the one that switches it off holds it exclusively.
static URING_SWITCH: RwLock<()> = RwLock::new(());

/// Whether this machine can run FUSE-over-io_uring at all; under CI it must.
fn require_uring() -> bool {
    if !require_fuse() {
        return false;
    }
    let on = fs::read_to_string(PARAM)
        .map(|v| v.trim() == "Y")
        .unwrap_or(false);
    if !on {
        if in_ci() {
            panic!("{PARAM} is not Y: `make test` enables it (scripts/deps.sh)");
        }
        eprintln!("skipping: {PARAM} is not Y");
    }
    on
}

/// Restores the kernel switch when dropped, even if the test panics.
struct ParamGuard(String);

impl ParamGuard {
    fn set(v: &str) -> ParamGuard {
        let old = fs::read_to_string(PARAM)
            .expect("read enable_uring")
            .trim()
            .to_string();
        fs::write(PARAM, v).expect("write enable_uring");
        ParamGuard(old)
    }
}

impl Drop for ParamGuard {
    fn drop(&mut self) {
        let _ = fs::write(PARAM, &self.0);
    }
}

#[test]
fn falls_back_to_legacy_when_enable_uring_is_off() {
    // Lock first: the fallback test switches enable_uring off while it holds the lock.
    let _excl = URING_SWITCH.write().unwrap_or_else(|e| e.into_inner());
    if !require_uring() {
        return;
    }
    let _param = ParamGuard::set("N");
    let w = WorkDir::new("uring-fallback");
    let img = w.join("disk.img");
    let model = random_image(&img, 4 * MIB, 50);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &["--transport", "auto"]);
    assert_bytes_eq(
        &read_all(&mp),
        &model,
        0,
        "legacy fallback serves the image",
    );
    let st = m.stop();
    st.assert_clean("auto transport with enable_uring=N");
    assert_eq!(st.stats()["transport"], "legacy", "{}", st.stats());
    assert!(
        st.stderr.contains("transport: legacy") && st.stderr.contains("enable_uring is N"),
        "one log line says legacy and why:\n{}",
        st.stderr
    );
    // Asking for io_uring explicitly fails, with one line, and mounts nothing.
    let r = run_fusex(
        &w,
        &[
            OsString::from("mount"),
            "--transport".into(),
            "uring".into(),
            img.clone().into(),
            w.join("export2").into(),
        ],
        Some(&w.join("export2")),
    );
    r.assert_one_error_line("--transport uring with enable_uring=N");
    assert!(
        r.stderr.contains("enable_uring"),
        "the error names the switch: {}",
        r.stderr
    );
    assert!(!is_fuse_mounted(&w.join("export2")));
}

#[test]
fn every_cpu_queue_is_served() {
    // Lock first: the fallback test switches enable_uring off while it holds the lock.
    let _shared = URING_SWITCH.read().unwrap_or_else(|e| e.into_inner());
    if !require_uring() || !require_fuse_and_tools(&["taskset", "dd"]) {
        return;
    }
    let w = WorkDir::new("uring-cpus");
    let img = w.join("disk.img");
    random_image(&img, 4 * MIB, 51);
    let mp = w.join("export");
    let cpus: Vec<usize> = (0..256)
        .filter(|c| {
            Command::new("taskset")
                .args(["-c", &c.to_string(), "true"])
                .status()
                .is_ok_and(|s| s.success())
        })
        .collect();
    assert!(!cpus.is_empty());
    // One queue thread per CPU, so thread i serves kernel queue i exactly.
    let queues = cpus.len().to_string();
    let m = Mount::start(
        &w,
        &img,
        &mp,
        &[
            "--transport",
            "uring",
            "--passthrough",
            "off",
            "--queues",
            &queues,
        ],
    );
    for c in &cpus {
        let mut inf = OsString::from("if=");
        inf.push(&mp);
        let out = Command::new("taskset")
            .args([
                "-c",
                &c.to_string(),
                "dd",
                "of=/dev/null",
                "bs=4k",
                "count=256",
                "iflag=direct",
                "status=none",
            ])
            .arg(&inf)
            .output()
            .expect("dd");
        assert!(
            out.status.success(),
            "dd pinned to CPU {c}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let st = m.stop();
    st.assert_clean("reader pinned to each CPU");
    assert_eq!(st.stats()["transport"], "io_uring", "{}", st.stats());
    let per_queue = st.stats()["queues"].as_array().unwrap().clone();
    assert_eq!(per_queue.len(), cpus.len(), "{}", st.stats());
    for (i, q) in per_queue.iter().enumerate() {
        assert!(
            q["requests"].as_u64().unwrap_or(0) >= 256,
            "queue {i} (CPU {}) served the reader pinned to it: {}",
            cpus[i],
            st.stats()
        );
    }
}

fn verify_at_depth(depth: &str) {
    // Lock first: the fallback test switches enable_uring off while it holds the lock.
    let _shared = URING_SWITCH.read().unwrap_or_else(|e| e.into_inner());
    if !require_uring() || !require_fuse_and_tools(&["fio"]) {
        return;
    }
    let st = verified_fio_run(
        &format!("uring-qd{depth}"),
        52,
        &["--transport", "uring", "--queue-depth", depth],
    );
    assert_eq!(st.stats()["transport"], "io_uring");
}

#[test]
fn queue_depth_1_keeps_data_intact() {
    verify_at_depth("1");
}

#[test]
fn queue_depth_128_keeps_data_intact() {
    verify_at_depth("128");
}

/// Two io_uring queue threads that hand every request on; passthrough off, so reads and writes
/// both come to fusex.
const HANDED_ALWAYS: [&str; 8] = [
    "--transport",
    "uring",
    "--passthrough",
    "off",
    "--queues",
    "2",
    "--handoff",
    "always",
];

/// `--handoff always`: every request is handed, with its ring entry, to the next queue thread,
/// which serves it and commits it from its own ring (so the entry's next request arrives there,
/// and is handed on again). Four fio verify jobs over both threads read back what they wrote,
/// the image equals the export, every request but the ones the fallback reader took crossed
/// threads, and nothing was copied in userspace on the way.
#[test]
fn requests_handed_between_queue_threads_keep_data_intact() {
    // Lock first: the fallback test switches enable_uring off while it holds the lock.
    let _shared = URING_SWITCH.read().unwrap_or_else(|e| e.into_inner());
    if !require_uring() || !require_fuse_and_tools(&["fio"]) {
        return;
    }
    for extra in [None, Some("--direct")] {
        let mut args = HANDED_ALWAYS.to_vec();
        args.extend(extra);
        let st = verified_fio_run("uring-handoff", 54, &args);
        let stats = st.stats();
        assert_eq!(stats["transport"], "io_uring", "{stats}");
        let handed = st.stat(&["handed_off"]);
        let requests = st.stat(&["requests"]);
        assert!(
            handed > 0 && handed + 64 >= requests,
            "{extra:?}: every request delivered to a ring entry was handed off ({handed} of \
             {requests}): {stats}"
        );
        assert!(st.stat(&["backend", "bytes_written"]) > 0, "{stats}");
        assert_eq!(st.stat(&["copied_bytes"]), 0, "{stats}");
    }
}

/// SIGTERM while every request is being handed between the two queue threads: entries are in
/// inboxes and on foreign rings when the queues stop, yet the daemon answers or refuses each,
/// flushes, unmounts and exits cleanly (no thread waits forever for an entry).
#[test]
fn sigterm_while_requests_are_handed_between_threads_stops_cleanly() {
    // Lock first: the fallback test switches enable_uring off while it holds the lock.
    let _shared = URING_SWITCH.read().unwrap_or_else(|e| e.into_inner());
    if !require_uring() || !require_fuse_and_tools(&["fio"]) {
        return;
    }
    let w = WorkDir::new("uring-handoff-stop");
    let img = w.join("disk.img");
    random_image(&img, 16 * MIB, 55);
    let mp = w.join("export");
    let mut args = vec!["--writable"];
    args.extend(HANDED_ALWAYS);
    let m = Mount::start(&w, &img, &mp, &args);
    let mut writes = WriteWatch::new(&img);
    let mut fio = spawn_randrw_load(&w, &mp, 32, 2);
    let deadline = Instant::now() + TIMEOUT;
    let flowing = writes.wait_for_more_than(0, &mut fio, deadline);
    assert!(
        flowing && fio.try_wait().is_none(),
        "fio's writes did not flow within {TIMEOUT:?}; fusex stderr:\n{}",
        m.stderr()
    );
    let handed = m.wait_for_stats(
        deadline,
        |v| v["handed_off"].as_u64().unwrap_or(0),
        |before, now| now > before,
    );
    assert!(
        handed.moved,
        "no request was handed between threads within {TIMEOUT:?}: {handed:?}"
    );
    assert!(fio.try_wait().is_none(), "fio ended before the signal");
    // fio holds the export open: the first SIGTERM detaches it and serves fio on, the second
    // ends it.
    m.stop_signals_twice();
    let st = m.wait_exit();
    fio.kill_and_wait();
    st.assert_clean("SIGTERM while requests are handed between threads");
    assert!(!is_fuse_mounted(&mp), "mountpoint is still a FUSE mount");
    assert!(st.stat(&["handed_off"]) > 0, "{}", st.stats());
}

/// READ data is read from the image straight into the ring entry's payload and WRITE data goes
/// from the payload straight to the image: the userspace copy counter stays 0, on both
/// transports, with and without O_DIRECT on the image.
#[test]
fn data_path_copies_nothing_in_userspace() {
    // Lock first: the fallback test switches enable_uring off while it holds the lock.
    let _shared = URING_SWITCH.read().unwrap_or_else(|e| e.into_inner());
    if !require_uring() || !require_fuse_and_tools(&["fio"]) {
        return;
    }
    for (transport, extra) in [
        ("uring", None),
        ("uring", Some("--direct")),
        ("legacy", None),
        ("legacy", Some("--direct")),
    ] {
        let w = WorkDir::new(&format!("uring-zc-{transport}"));
        let img = w.join("disk.img");
        random_image(&img, 16 * MIB, 53);
        let mp = w.join("export");
        let mut args = vec!["--writable", "--transport", transport];
        args.extend(extra);
        let m = Mount::start(&w, &img, &mp, &args);
        for bs in ["4k", "128k", "1m"] {
            run_fio(
                &w,
                &mp,
                &[
                    "--name=zc",
                    "--rw=randrw",
                    &format!("--bs={bs}"),
                    "--ioengine=libaio",
                    "--iodepth=8",
                    "--size=16M",
                    "--io_size=8M",
                ],
            );
        }
        let st = m.stop();
        st.assert_clean("zero-copy run");
        assert_eq!(
            st.stats()["transport"],
            if transport == "uring" {
                "io_uring"
            } else {
                "legacy"
            }
        );
        assert!(
            st.stat(&["backend", "bytes_read"]) > 0 && st.stat(&["backend", "bytes_written"]) > 0,
            "{}",
            st.stats()
        );
        assert_eq!(
            st.stat(&["copied_bytes"]),
            0,
            "{transport} {extra:?}: no userspace data copy: {}",
            st.stats()
        );
    }
}

/// `fusex umount` while fio has the export open: the mount leaves the namespace at once, the
/// daemon keeps serving the open file, and exits cleanly once fio is gone.
#[test]
fn unmount_while_fio_runs() {
    /// fio's queue depth: at most this many of its requests are in flight at any time.
    const IODEPTH: u64 = 16;
    // Lock first: the fallback test switches enable_uring off while it holds the lock.
    let _shared = URING_SWITCH.read().unwrap_or_else(|e| e.into_inner());
    if !require_uring() || !require_fuse_and_tools(&["fio"]) {
        return;
    }
    let w = WorkDir::new("uring-umount");
    let img = w.join("disk.img");
    random_image(&img, 16 * MIB, 54);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &["--writable", "--transport", "uring"]);
    let mut writes = WriteWatch::new(&img);
    let mut fio = spawn_randrw_load(&w, &mp, IODEPTH as u32, 1);
    // Under load: more of fio's writes reached the image than it keeps in flight, so it is
    // refilling its queue.
    let flowing = writes.wait_for_more_than(IODEPTH, &mut fio, Instant::now() + TIMEOUT);
    assert!(fio.try_wait().is_none(), "fio ended before the unmount");
    assert!(
        flowing,
        "fewer than {} of fio's writes reached the image within {TIMEOUT:?}",
        IODEPTH + 1
    );
    let r = run_fusex(&w, &[OsString::from("umount"), mp.clone().into()], None);
    assert_eq!(r.code, Some(0), "fusex umount under load: {}", r.stderr);
    assert!(!is_fuse_mounted(&mp), "the mount left the namespace");
    // The daemon keeps serving fio's open file: more writes land in the image after the unmount
    // than fio can have had in flight at it, so fio submitted some of them afterwards and fusex
    // served them.
    let mut writes = WriteWatch::new(&img);
    let served = writes.wait_for_more_than(IODEPTH, &mut fio, Instant::now() + TIMEOUT);
    assert!(
        fio.try_wait().is_none(),
        "fio failed after the unmount: the daemon must keep serving open files; fusex stderr:\n{}",
        m.stderr()
    );
    assert!(
        served,
        "fewer than {} of fio's writes reached the image within {TIMEOUT:?} after the unmount",
        IODEPTH + 1
    );
    fio.kill_and_wait();
    let st = m.wait_exit();
    st.assert_clean("unmount while fio runs");
    assert!(
        st.stat(&["ops", "READ"]) + st.stat(&["ops", "WRITE"]) > 0,
        "{}",
        st.stats()
    );
}

/// The kernel queues of this machine (`/sys/devices/system/cpu/possible`, e.g. `0-1`).
fn possible_cpus() -> usize {
    let s = fs::read_to_string("/sys/devices/system/cpu/possible").expect("possible CPUs");
    s.trim()
        .split(',')
        .map(|r| match r.split_once('-') {
            Some((a, b)) => b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap() + 1,
            None => 1,
        })
        .sum()
}

/// Ring entries are registered by load: an export that served one reader holds at most four
/// entries per kernel queue (a queue starts with one and doubles when one loop turn fills all
/// of its entries); under fio at QD 32 its entries grow further, never past the depth; and the
/// data stays intact meanwhile (fio's verify).
#[test]
fn ring_entries_follow_the_load() {
    // Lock first: the fallback test switches enable_uring off while it holds the lock.
    let _shared = URING_SWITCH.read().unwrap_or_else(|e| e.into_inner());
    if !require_uring() || !require_fuse_and_tools(&["fio"]) {
        return;
    }
    let qids = possible_cpus() as u64;
    let entries = |st: &Stopped| -> Vec<u64> {
        st.stats()["queues"]
            .as_array()
            .expect("per-queue stats")
            .iter()
            .map(|q| q["entries"].as_u64().expect("entries per queue"))
            .collect()
    };
    let args = [
        "--writable",
        "--transport",
        "uring",
        "--passthrough",
        "off",
        "--queue-depth",
        "32",
    ];

    // One request at a time: no entry is ever asked for beyond the first of each queue.
    let w = WorkDir::new("uring-entries-idle");
    let img = w.join("disk.img");
    let data = random_image(&img, 4 * MIB, 53);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &args);
    // Reads of 64 KiB, each one request (a larger one may be split into requests sent at once).
    let mut got = Vec::with_capacity(data.len());
    let mut f = fs::File::open(&mp).expect("open the export");
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        use std::io::Read;
        let n = f.read(&mut chunk).expect("read the export");
        if n == 0 {
            break;
        }
        got.extend_from_slice(&chunk[..n]);
    }
    drop(f);
    assert!(got == data, "the export reads the image");
    let st = m.stop();
    st.assert_clean("idle entries");
    // A queue doubles its entries when one loop turn brings a request into each. One reader
    // keeps one READ in flight, but the kernel sends FLUSH, RELEASE and GETATTR beside it, and
    // on a busy machine the queue thread may reap two requests in one turn: 1 -> 2 -> 4 (seen
    // in a clean-clone CI run). Never more than that for one reader, far below the depth.
    let per_queue = entries(&st);
    assert!(
        per_queue.iter().sum::<u64>() >= qids && per_queue.iter().all(|&e| e <= 4),
        "one to four entries per kernel queue: {}",
        st.stats()
    );

    // fio at QD 32 with O_DIRECT: the entries grow, within the depth.
    let w = WorkDir::new("uring-entries-busy");
    let img = w.join("disk.img");
    random_image(&img, 16 * MIB, 54);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &args);
    run_fio(
        &w,
        &mp,
        &[
            "--name=deep",
            "--rw=randwrite",
            "--bs=4k",
            "--ioengine=libaio",
            "--direct=1",
            "--iodepth=32",
            "--size=16M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
        ],
    );
    let st = m.stop();
    st.assert_clean("busy entries");
    let got = entries(&st);
    let sum: u64 = got.iter().sum();
    assert!(
        sum > 2 * qids,
        "QD 32 registered more entries than two per queue: {}",
        st.stats()
    );
    assert!(
        sum <= qids * 32,
        "never more than the depth per kernel queue: {}",
        st.stats()
    );
}
