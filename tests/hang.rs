//! A daemon that stops answering (SIGSTOP): what an application reading the export sees, on
//! each transport, with and without `--request-timeout`. What these tests pin down is written up
//! in docs/design.md (section 6, "A wedged or dead daemon").
//!
//! Every test stops the daemon through a [`Resume`] guard declared after the readers, so even a
//! failing test resumes the daemon (and with it every reader stuck on it) before anything else is
//! torn down, and the [`Mount`] guard then leaves no mount behind.

use std::fs;
use std::time::{Duration, Instant};

use fusex_e2e::*;

/// The kernel's floor for the request timeout, and the period of its check: an unanswered
/// request is caught between 15 and 30 s after it was queued.
const KERNEL_MIN_TIMEOUT: &str = "15";

/// Hang detector for the abort: 15 s timeout + 15 s check period, with room for a loaded machine.
const ABORT_DEADLINE: Duration = Duration::from_secs(90);

const ECONNABORTED_TEXT: &str = "Software caused connection abort";
const ENOTCONN_TEXT: &str = "Transport endpoint is not connected";

fn on_uring(m: &Mount) -> bool {
    m.stderr().contains("transport: io_uring")
}

/// Mounts a 1 MiB random image with `args` and reads it once through the export (checked against
/// the image), so the queues are serving before the daemon stops. Then waits until the daemon
/// holds no request: the read's RELEASE is sent in the background, and on io_uring a queue
/// registers entries as its load asks (one at first), so a RELEASE still held when the daemon
/// stops would keep the next request from an entry (it would wait in the kernel, where SIGKILL
/// can still take it back).
fn mounted(tag: &str, seed: u64, args: &[&str]) -> (WorkDir, Mount) {
    let w = WorkDir::new(tag);
    let img = w.join("disk.img");
    let model = random_image(&img, MIB, seed);
    let mp = w.join("export");
    let sock = w.join("control.sock");
    let sock_arg = sock.to_str().unwrap().to_string();
    let mut all = args.to_vec();
    all.extend(["--control", &sock_arg]);
    let m = Mount::start(&w, &img, &mp, &all);
    assert_bytes_eq(&read_all(&mp), &model, 0, "read before the daemon stops");
    let mut qmp = Qmp::connect(&sock);
    let idle = wait_until(Instant::now() + TIMEOUT, || {
        let s = qmp.ok("__org.fusex_query-stats", serde_json::json!({}));
        let e = &s["exports"][0];
        e["ops"]["RELEASE"].as_u64().unwrap_or(0) >= 1 && e["in_flight"] == 0
    });
    assert!(idle, "the daemon still holds requests after the read");
    (w, m)
}

/// Contract: with `--request-timeout` at the kernel's minimum, a daemon that stops answering
/// loses its connection within 30 s: new requests fail at once with ENOTCONN. On the legacy
/// transport the reader that was waiting gets ECONNABORTED right then. On io_uring its request
/// already sits in a ring entry the stopped daemon owns, which the abort does not end: that
/// reader gets ECONNABORTED only once the daemon runs again (or dies). Either way, after SIGCONT
/// the daemon sees its connection gone, exits 0 and unmounts.
#[test]
fn request_timeout_aborts_the_connection_of_a_stopped_daemon() {
    if !require_fuse_and_tools(&["dd"]) {
        return;
    }
    let (w, m) = mounted(
        "hang-timeout",
        31,
        &["--request-timeout", KERNEL_MIN_TIMEOUT],
    );
    let mp = m.path().to_path_buf();
    assert!(
        m.stderr().contains("request timeout: 15 s"),
        "the daemon should log the timeout the kernel applies; stderr:\n{}",
        m.stderr()
    );
    let uring = on_uring(&m);
    // Declared before `resume`, so they are dropped (killed and reaped) after the daemon resumed.
    let mut probes: Vec<Reader> = Vec::new();
    let mut reader: Option<Reader> = None;
    let resume = Resume::stop(m.pid());
    let r = reader.insert(Reader::spawn(&w, &mp));
    r.wait_blocked_in_fuse();

    // Wait for the abort. A probe (another reader: OPEN always goes to the daemon, where a stat
    // may be answered from the attribute cache) fails at once with ENOTCONN once the connection
    // is aborted, or with ECONNABORTED if it was waiting in the kernel's queue when the abort
    // came; otherwise it blocks like the reader and is left to end after SIGCONT.
    let deadline = Instant::now() + ABORT_DEADLINE;
    let mut aborted = false;
    while !aborted && Instant::now() < deadline {
        let mut p = Reader::spawn(&w, &mp);
        if let Some(st) = wait_timeout(&mut p.child.0, Duration::from_secs(3)) {
            assert!(
                !st.success()
                    && (p.stderr().contains(ENOTCONN_TEXT)
                        || p.stderr().contains(ECONNABORTED_TEXT)),
                "a reader that returned while the daemon is stopped must fail with ENOTCONN or \
                 ECONNABORTED ({st}): {}",
                p.stderr()
            );
            aborted = true;
        } else {
            probes.push(p);
        }
    }
    assert!(
        aborted,
        "the kernel did not abort the connection within {ABORT_DEADLINE:?} of a 15 s request timeout"
    );
    // Once aborted, asking in-process is safe: the kernel refuses before queueing anything.
    let e = fs::File::open(&mp).expect_err("open of an aborted connection must fail");
    assert_eq!(errno(&e), libc::ENOTCONN, "open after the abort: {e}");

    let r = reader.as_mut().unwrap();
    if !uring {
        let ended = wait_until(Instant::now() + TIMEOUT, || r.child.try_wait().is_some());
        assert!(
            ended,
            "legacy: the reader should fail with the abort, while the daemon is still stopped"
        );
    }
    resume.resume();
    let ended = wait_until(Instant::now() + TIMEOUT, || r.child.try_wait().is_some());
    assert!(ended, "the reader did not end after the daemon resumed");
    assert!(
        r.stderr().contains(ECONNABORTED_TEXT),
        "the reader should see ECONNABORTED; dd said: {}",
        r.stderr()
    );
    let st = m.wait_exit();
    st.assert_clean("daemon resumed after its connection was aborted");
    assert!(!is_fuse_mounted(&mp));
    assert!(!mp.exists(), "mountpoint created by fusex must be removed");
}

/// Without a timeout, can the application be killed? On legacy, yes: the stopped daemon never
/// read the request, the kernel still holds it and drops it on SIGKILL. On io_uring, no: the
/// request was handed to a ring entry at once, so the killed reader waits uninterruptibly (state
/// D) until the daemon answers; after SIGCONT it is gone and the export still works.
#[test]
fn sigkill_of_a_reader_of_a_stopped_daemon_without_timeout() {
    if !require_fuse_and_tools(&["dd"]) {
        return;
    }
    let (w, m) = mounted("hang-kill", 32, &["--request-timeout", "0"]);
    let mp = m.path().to_path_buf();
    let uring = on_uring(&m);
    let mut reader: Option<Reader> = None;
    let resume = Resume::stop(m.pid());
    let r = reader.insert(Reader::spawn(&w, &mp));
    r.wait_blocked_in_fuse();
    let pid = r.pid();
    send_signal(pid, libc::SIGKILL);
    let settled = wait_until(Instant::now() + TIMEOUT, || {
        matches!(proc_state(pid), None | Some('Z') | Some('D'))
    });
    assert!(
        settled,
        "reader {pid} after SIGKILL: state {:?}",
        proc_state(pid)
    );
    let state = proc_state(pid);
    if uring {
        assert_eq!(
            state,
            Some('D'),
            "io_uring: the killed reader waits uninterruptibly for the stopped daemon (wchan {:?})",
            wchan(pid)
        );
        resume.resume();
    } else {
        assert!(
            matches!(state, None | Some('Z')),
            "legacy: SIGKILL ends a reader of a stopped daemon; state {state:?}, wchan {:?}",
            wchan(pid)
        );
    }
    let ended = wait_until(Instant::now() + TIMEOUT, || r.child.try_wait().is_some());
    assert!(ended, "the killed reader did not end");
    drop(resume);
    // The export still serves after the daemon resumed.
    assert_bytes_eq(
        &read_all(&mp),
        &read_all(&w.join("disk.img")),
        0,
        "read after the daemon resumed",
    );
    m.stop().assert_clean("daemon stopped and resumed");
}

/// The way out on io_uring: killing the wedged daemon ends the requests in its ring, so the
/// reader stuck in D goes, and `--auto-unmount` removes the dead mount.
#[test]
fn killing_a_stopped_daemon_frees_its_readers() {
    if !require_fuse_and_tools(&["dd"]) {
        return;
    }
    let (w, m) = mounted(
        "hang-kill-daemon",
        33,
        &["--request-timeout", "0", "--auto-unmount"],
    );
    let mp = m.path().to_path_buf();
    let mut reader: Option<Reader> = None;
    let _resume = Resume::stop(m.pid());
    let r = reader.insert(Reader::spawn(&w, &mp));
    r.wait_blocked_in_fuse();
    send_signal(r.pid(), libc::SIGKILL);
    m.signal(libc::SIGKILL);
    let ended = wait_until(Instant::now() + TIMEOUT, || r.child.try_wait().is_some());
    assert!(
        ended,
        "the reader did not end after the daemon was killed (state {:?}, wchan {:?})",
        proc_state(r.pid()),
        wchan(r.pid())
    );
    let gone = wait_until(Instant::now() + TIMEOUT, || !is_fuse_mounted(&mp));
    assert!(
        gone,
        "--auto-unmount did not remove the dead daemon's mount"
    );
    let st = m.wait_exit();
    assert_eq!(st.signal, Some(libc::SIGKILL), "stderr:\n{}", st.stderr);
    assert!(!st.left_mounted);
}
