//! Several queues (cloned /dev/fuse fds, one thread and ring each): data integrity under parallel
//! verified writers, every queue serving requests, and a clean stop with every queue busy.

use std::time::Instant;

use fusex_e2e::*;

fn integrity_with_queues(queues: &str) {
    integrity_with_queues_reading(queues, "auto");
}

/// `read`: the `--legacy-read` mode. auto must pick multishot on the kernels CI runs on (6.7+).
fn integrity_with_queues_reading(queues: &str, read: &str) {
    if !require_fuse_and_tools(&["fio"]) {
        return;
    }
    // Cloned /dev/fuse fds are the legacy transport's queues (io_uring has one per CPU).
    let st = verified_fio_run(
        &format!("mq-{queues}-{read}"),
        40,
        &[
            "--transport",
            "legacy",
            "--queues",
            queues,
            "--legacy-read",
            read,
        ],
    );
    let expect = if read == "poll" { "poll" } else { "multishot" };
    let n: usize = queues.parse().unwrap();
    let per_queue = st.stats()["queues"]
        .as_array()
        .expect("per-queue stats")
        .clone();
    assert_eq!(
        per_queue.len(),
        n,
        "one stats entry per queue: {}",
        st.stats()
    );
    for q in &per_queue {
        assert!(
            q["requests"].as_u64().unwrap_or(0) > 0,
            "every queue serves requests: {}",
            st.stats()
        );
        assert_eq!(q["dev_fuse_read"], expect, "read mode: {}", st.stats());
    }
    let total: u64 = per_queue
        .iter()
        .map(|q| q["requests"].as_u64().unwrap())
        .sum();
    assert_eq!(
        total,
        st.stat(&["requests"]),
        "per-queue counts add up: {}",
        st.stats()
    );
}

#[test]
fn one_queue_keeps_data_intact_under_parallel_verified_writers() {
    integrity_with_queues("1");
}

#[test]
fn two_queues_keep_data_intact_and_all_serve() {
    integrity_with_queues("2");
}

#[test]
fn four_queues_keep_data_intact_and_all_serve() {
    integrity_with_queues("4");
}

#[test]
fn two_queues_reading_with_poll_keep_data_intact() {
    integrity_with_queues_reading("2", "poll");
}

#[test]
fn sigterm_with_every_queue_busy_stops_cleanly() {
    if !require_fuse_and_tools(&["fio"]) {
        return;
    }
    let w = WorkDir::new("mq-stop");
    let img = w.join("disk.img");
    random_image(&img, 16 * MIB, 41);
    let mp = w.join("export");
    let m = Mount::start(
        &w,
        &img,
        &mp,
        &["--writable", "--transport", "legacy", "--queues", "4"],
    );
    let mut writes = WriteWatch::new(&img);
    let mut fio = spawn_randrw_load(&w, &mp, 32, 4);
    // The signal must land with every queue serving fio's I/O. First the load is on: fio's writes
    // reach the image. Then every queue's live request count (SIGUSR1 dumps) rises past where it
    // stood then. (Thread wake-ups would not do: on the legacy transport every idle clone wakes
    // for each request, and only one of them gets it.)
    let deadline = Instant::now() + TIMEOUT;
    let flowing = writes.wait_for_more_than(0, &mut fio, deadline);
    assert!(
        fio.try_wait().is_none(),
        "fio ended before the signal; fusex stderr:\n{}",
        m.stderr()
    );
    assert!(
        flowing,
        "none of fio's writes reached the image within {TIMEOUT:?}"
    );
    let served = |v: &serde_json::Value| -> Vec<u64> {
        v["queues"]
            .as_array()
            .map(|qs| {
                qs.iter()
                    .map(|q| q["requests"].as_u64().unwrap_or(0))
                    .collect()
            })
            .unwrap_or_default()
    };
    let busy = m.wait_for_stats(deadline, served, |before, now| {
        before.len() == 4 && now.len() == 4 && now.iter().zip(before).all(|(n, b)| n > b)
    });
    assert!(
        busy.moved,
        "not every queue served fio within {TIMEOUT:?} (requests per queue): {busy:?}"
    );
    assert!(fio.try_wait().is_none(), "fio ended before the signal");
    // fio holds the export open: the first SIGTERM detaches it and serves fio on, the second
    // ends it.
    m.stop_signals_twice();
    let st = m.wait_exit();
    fio.kill_and_wait();
    st.assert_clean("SIGTERM with 4 busy queues");
    assert!(!is_fuse_mounted(&mp), "mountpoint is still a FUSE mount");
    let per_queue = st.stats()["queues"]
        .as_array()
        .expect("per-queue stats")
        .clone();
    assert_eq!(per_queue.len(), 4);
    assert!(
        st.stat(&["ops", "READ"]) + st.stat(&["ops", "WRITE"]) > 0,
        "{}",
        st.stats()
    );
    for q in &per_queue {
        assert!(
            q["requests"].as_u64().unwrap_or(0) > 0,
            "every queue served requests: {}",
            st.stats()
        );
    }
}
