//! Fault injection (`--fault OP:N:ACTION`): the image's storage failing or stalling one request.
//! The application sees the error on that request only, the daemon keeps serving, and nothing
//! else in the image changes (checked byte for byte against the image; for qcow2 through
//! `qemu-img convert` and `qemu-img check`).

use std::ffi::OsString;
use std::os::unix::fs::FileExt;
use std::process::Command;
use std::time::Instant;

use fusex_e2e::*;

const BLOCK: usize = 4096;

/// The tests here run one at a time. Closing a descriptor of a FUSE file sends a FLUSH, and a
/// child another test thread forks (a daemon, qemu-img) closes its inherited copies of this
/// process's descriptors at exec: a FLUSH from nowhere that takes the fault meant for the test's
/// own first flush (seen once in CI).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Writes five blocks with O_DIRECT (one FUSE WRITE each), fsyncs twice, reads three blocks;
/// the mount fails the 3rd write (EIO), the 1st flush (ENOSPC) and the 2nd read (EIO).
/// Returns the guest bytes the image must hold afterwards.
fn run_faulty_requests(m: &Mount, mut want: Vec<u8>) -> Vec<u8> {
    let f = open_rw_direct(m.path());
    let mut rng = Rng::new(71);
    for k in 1..=5u64 {
        let block = AlignedBuf::from_slice(&rng.bytes(BLOCK), BLOCK);
        let off = k * 64 * 1024;
        let r = f.write_at(block.as_slice(), off).map_err(|e| errno(&e));
        if k == 3 {
            assert_eq!(r, Err(libc::EIO), "the 3rd write is the injected fault");
        } else {
            assert_eq!(r, Ok(BLOCK), "write {k} is not affected");
            want[off as usize..off as usize + BLOCK].copy_from_slice(block.as_slice());
        }
    }
    assert_eq!(
        f.sync_all().map_err(|e| errno(&e)),
        Err(libc::ENOSPC),
        "the 1st flush is the injected fault"
    );
    f.sync_all().expect("the 2nd fsync is not affected");
    for k in 1..=3u64 {
        let off = k * 64 * 1024;
        let mut buf = AlignedBuf::new(BLOCK, BLOCK);
        let r = f.read_at(buf.as_mut_slice(), off).map_err(|e| errno(&e));
        if k == 2 {
            assert_eq!(r, Err(libc::EIO), "the 2nd read is the injected fault");
        } else {
            assert_eq!(r, Ok(BLOCK), "read {k}");
            assert_bytes_eq(
                buf.as_slice(),
                &want[off as usize..off as usize + BLOCK],
                off,
                "a read after the faults",
            );
        }
    }
    want
}

const FAULTS: &[&str] = &[
    "--writable",
    "--fault",
    "write:3:eio",
    "--fault",
    "flush:1:enospc",
    "--fault",
    "read:2:eio",
];

#[test]
fn raw_image_one_failed_request_fails_only_that_request() {
    let _serial = serial();
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("fault-raw");
    let img = w.join("disk.img");
    let data = random_image(&img, 4 * MIB, 72);
    let m = Mount::start(&w, &img, &w.join("export"), FAULTS);
    assert!(
        m.stderr().contains("passthrough: off"),
        "--fault turns passthrough off: {}",
        m.stderr()
    );
    let want = run_faulty_requests(&m, data);
    m.stop().assert_clean("export with injected faults");
    assert_bytes_eq(&read_all(&img), &want, 0, "the image after the faults");
}

#[test]
fn qcow2_image_one_failed_request_fails_only_that_request() {
    let _serial = serial();
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    let w = WorkDir::new("fault-qcow2");
    let raw = w.join("disk.raw");
    let data = random_image(&raw, 4 * MIB, 73);
    let img = w.join("disk.qcow2");
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "qcow2"])
            .arg(&raw)
            .arg(&img),
    );
    let m = Mount::start(&w, &img, &w.join("export"), FAULTS);
    let want = run_faulty_requests(&m, data);
    m.stop().assert_clean("qcow2 export with injected faults");
    assert_bytes_eq(
        &qcow2_guest_bytes(&w, &img),
        &want,
        0,
        "the qcow2 image after the faults",
    );
}

/// A read held up in the backend (delay=) does not hold up the queue: a write and another read
/// issued after it complete while it still waits, and it then returns the right bytes.
#[test]
fn a_delayed_request_does_not_hold_up_the_others() {
    let _serial = serial();
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("fault-delay");
    let img = w.join("disk.img");
    let data = random_image(&img, 4 * MIB, 74);
    let m = Mount::start(
        &w,
        &img,
        &w.join("export"),
        &["--writable", "--fault", "read:1:delay=5000ms"],
    );
    let path = m.path().to_path_buf();
    let slow = std::thread::spawn(move || {
        let f = open_rw_direct(&path);
        let mut buf = AlignedBuf::new(BLOCK, BLOCK);
        let n = f.read_at(buf.as_mut_slice(), 0).expect("the delayed read");
        (n, buf.as_slice().to_vec(), Instant::now())
    });
    // Wait until the slow read has reached fusex (its READ is counted), then go around it.
    let deadline = Instant::now() + TIMEOUT;
    let arrived = wait_until(deadline, || {
        m.live_stats(deadline)
            .is_some_and(|v| v["ops"]["READ"].as_u64().unwrap_or(0) >= 1)
    });
    assert!(
        arrived,
        "the first READ never reached fusex: {}",
        m.stderr()
    );
    let f = open_rw_direct(m.path());
    let block = AlignedBuf::from_slice(&[0x5a; BLOCK], BLOCK);
    assert_eq!(
        f.write_at(block.as_slice(), 8 * BLOCK as u64).unwrap(),
        BLOCK
    );
    let mut buf = AlignedBuf::new(BLOCK, BLOCK);
    assert_eq!(
        f.read_at(buf.as_mut_slice(), 8 * BLOCK as u64).unwrap(),
        BLOCK
    );
    assert_eq!(buf.as_slice(), block.as_slice());
    let others_done = Instant::now();
    assert!(
        !slow.is_finished(),
        "the delayed read finished before the requests issued after it"
    );
    let (n, got, slow_done) = slow.join().expect("reader thread");
    assert!(slow_done > others_done);
    assert_eq!(n, BLOCK);
    assert_bytes_eq(&got, &data[..BLOCK], 0, "the delayed read");
    drop(f);
    m.stop().assert_clean("export with a delayed read");
    let mut want = data;
    want[8 * BLOCK..9 * BLOCK].fill(0x5a);
    assert_bytes_eq(&read_all(&img), &want, 0, "the image");
}

/// `--fault` rules that do not parse: one error line naming the rule, nothing mounted.
#[test]
fn bad_fault_rule_is_refused() {
    let _serial = serial();
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("fault-bad");
    let img = w.join("disk.img");
    random_image(&img, MIB, 75);
    let mp = w.join("export");
    let argv: Vec<OsString> = vec![
        "mount".into(),
        "--fault".into(),
        "trim:1:eio".into(),
        img.clone().into(),
        mp.clone().into(),
    ];
    let r = run_fusex(&w, &argv, Some(&mp));
    r.assert_one_error_line("a --fault rule that does not parse");
    assert!(r.stderr.contains("bad fault rule"), "{}", r.stderr);
    assert!(!is_fuse_mounted(&mp));
    assert!(!mp.exists(), "a mountpoint file was left behind");
}
