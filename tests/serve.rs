//! `fusex serve`: many exports in one daemon, driven over QMP. QEMU's own client (`qemu.qmp`)
//! runs one script against qemu-storage-daemon and against fusex and both must answer the same;
//! the rest adds and removes exports while another serves verified I/O, removes exports with
//! I/O in flight, sends what a hostile or broken client would, and checks the command line's
//! refusals. Every daemon is a [`Serve`] guard, which stops it and unmounts what it left.

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fusex_e2e::*;
use serde_json::json;

/// The venv's Python with `qemu.qmp` (made by scripts/deps.sh).
fn qmp_python() -> Option<PathBuf> {
    let py = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/qmp-venv/bin/python3");
    let ok = Command::new(&py)
        .args(["-c", "import qemu.qmp"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    ok.then_some(py)
}

/// Runs tests/qmp_service.py against PROGRAM; its transcript.
fn transcript(py: &Path, program: &str, dir: &Path) -> Value {
    fs::create_dir_all(dir).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("qmp_service.py");
    let out = Command::new(py)
        .arg(&script)
        .arg(program)
        .arg(dir)
        .output()
        .expect("running qmp_service.py");
    unmount_under(dir);
    assert!(
        out.status.success(),
        "qmp_service.py against {program} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the transcript is JSON")
}

/// The same script, through QEMU's Python client, gets the same answers from
/// qemu-storage-daemon and from fusex: exports on the command line and added live (raw, qcow2,
/// null), the bytes through them, the queries, every error for the same mistakes, the events,
/// safe and hard removal, quit.
#[test]
fn qemu_qmp_gets_the_same_answers_as_from_qemu_storage_daemon() {
    if !require_fuse_and_tools(&["qemu-storage-daemon", "qemu-img", "qemu-io"]) {
        return;
    }
    let Some(py) = qmp_python() else {
        skip_or_fail("target/qmp-venv with qemu.qmp (run scripts/deps.sh)");
        return;
    };
    let w = WorkDir::new("serve-compat");
    let qsd = transcript(&py, "qemu-storage-daemon", &w.join("qsd"));
    let fusex = format!("{} serve", fusex_bin().display());
    let ours = transcript(&py, &fusex, &w.join("fusex"));
    let (a, b) = (qsd.as_array().unwrap(), ours.as_array().unwrap());
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x, y, "qemu-storage-daemon and fusex differ at this step");
    }
    assert_eq!(a.len(), b.len(), "the transcripts differ in length");
    // The transcript kept in the tree (for reading) is this one.
    let kept: Value = serde_json::from_slice(
        &fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("qmp_service_qsd.json")).unwrap(),
    )
    .unwrap();
    assert!(
        kept == qsd,
        "tests/qmp_service_qsd.json is stale: regenerate it (see tests/qmp_service.py)"
    );
}

/// A busy export under fio with verification keeps serving while other exports are added and
/// removed around it, in both modes; afterwards its image holds what fio wrote.
#[test]
fn exports_come_and_go_while_a_busy_export_serves_verified_io() {
    if !require_fuse_and_tools(&["fio"]) {
        return;
    }
    let w = WorkDir::new("serve-churn");
    let img = w.join("busy.img");
    sparse_image(&img, 64 * MIB);
    let mp = w.join("busy.mnt");
    fs::write(&mp, b"").unwrap();
    let serve = Serve::start(w.path(), &[]);
    let mut q = serve.qmp();
    q.add_raw_export("busy", &img, &mp, json!({}));
    let output = format!("--output={}", w.join("fio.out").display());
    let mut fio = ChildGuard(
        fio_command(
            &w,
            &mp,
            &[
                "--name=busy",
                "--ioengine=libaio",
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=16",
                "--size=32M",
                "--verify=crc32c",
                "--do_verify=1",
                "--verify_fatal=1",
                &output,
            ],
        )
        .stdout(Stdio::null())
        .stderr(fs::File::create(w.join("fio.err")).unwrap())
        .spawn()
        .expect("fio"),
    );
    let mut rounds = 0;
    while fio.try_wait().is_none() || rounds < 4 {
        let id = format!("e{rounds}");
        let m = w.join(format!("{id}.mnt"));
        q.add_null_export(&id, &m, json!({}));
        let f = fs::File::open(&m).unwrap();
        let mut buf = vec![1u8; 4096];
        f.read_exact_at(&mut buf, 4096).unwrap();
        assert!(buf.iter().all(|&b| b == 0), "a null export reads zeroes");
        drop(f);
        q.remove_null_export(&id, if rounds % 2 == 0 { "safe" } else { "hard" });
        assert!(!is_fuse_mounted(&m), "{id} is unmounted once deleted");
        rounds += 1;
    }
    let status = fio.try_wait().expect("fio ended");
    assert!(
        status.success(),
        "fio on the busy export failed while {rounds} exports came and went: {}{}",
        fs::read_to_string(w.join("fio.out")).unwrap_or_default(),
        fs::read_to_string(w.join("fio.err")).unwrap_or_default()
    );
    let exports = q.ok("query-block-exports", json!({}));
    assert_eq!(exports.as_array().unwrap().len(), 1, "{exports}");
    // The oracle: the image file and the export agree byte for byte.
    assert_eq!(
        chunk_hashes(&open_ro(&mp), 32 * MIB, 1 << 20),
        chunk_hashes(&open_ro(&img), 32 * MIB, 1 << 20),
        "the export and its image differ"
    );
    assert!(q.pending_events().is_empty(), "{:?}", q.pending_events());
}

/// One export's end, however long its storage takes, holds up no other export: while a writable
/// export's final flush waits (an injected 4 s delay), another export is added, serves and is
/// removed, and its `BLOCK_EXPORT_DELETED` comes first.
#[test]
fn a_slow_end_holds_up_no_other_export() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("serve-slow-end");
    let img = w.join("slow.img");
    random_image(&img, MIB, 17);
    let slow = w.join("slow.raw");
    fs::write(&slow, b"").unwrap();
    let serve = Serve::start(w.path(), &[]);
    let mut q = serve.qmp();
    q.add_raw_export(
        "slow",
        &img,
        &slow,
        json!({"__org.fusex_fault": ["flush:*:delay=4000ms"]}),
    );
    // (Only a stat: a close would send FLUSH, delayed too.)
    assert_eq!(fs::metadata(&slow).unwrap().len(), MIB);
    q.ok("block-export-del", json!({"id": "slow"}));
    let quick = w.join("quick.raw");
    q.add_null_export("quick", &quick, json!({}));
    assert_eq!(fs::metadata(&quick).unwrap().len(), 64 << 20);
    q.remove_null_export("quick", "safe");
    assert!(
        !q.pending_events()
            .iter()
            .any(|e| e["event"] == "BLOCK_EXPORT_DELETED"),
        "the slow export ended first: {:?}",
        q.pending_events()
    );
    q.event("BLOCK_EXPORT_DELETED", "slow", TIMEOUT);
    assert_eq!(q.ok("query-block-exports", json!({})), json!([]));
    let log = serve.log_text();
    assert!(
        log.contains("export slow removed") && !log.contains("did not end"),
        "{log}"
    );
}

/// An export whose image fails every read and write (injected EIO) gives its applications the
/// error and disturbs no other export: the one beside it reads and writes its bytes meanwhile,
/// both stay listed, and removing the failing one leaves the other serving.
#[test]
fn an_export_whose_image_fails_disturbs_no_other() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("serve-failing");
    let (bad_img, good_img) = (w.join("bad.img"), w.join("good.img"));
    random_image(&bad_img, MIB, 3);
    let data = random_image(&good_img, 4 * MIB, 4);
    let (bad, good) = (w.join("bad.raw"), w.join("good.raw"));
    fs::write(&bad, b"").unwrap();
    fs::write(&good, b"").unwrap();
    let serve = Serve::start(w.path(), &[]);
    let mut q = serve.qmp();
    q.add_raw_export(
        "bad",
        &bad_img,
        &bad,
        json!({"__org.fusex_fault": ["read:*:eio", "write:*:eio"]}),
    );
    q.add_raw_export("good", &good_img, &good, json!({}));
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&bad)
        .unwrap();
    let g = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&good)
        .unwrap();
    for i in 0..64u64 {
        let mut buf = vec![0u8; 4096];
        let e = f
            .read_exact_at(&mut buf, i * 4096)
            .expect_err("the bad export's read");
        assert_eq!(errno(&e), libc::EIO);
        g.read_exact_at(&mut buf, i * 4096).unwrap();
        assert_eq!(buf, data[(i * 4096) as usize..][..4096]);
        g.write_all_at(&[i as u8; 512], 2 * MIB + i * 512).unwrap();
    }
    g.sync_all().unwrap();
    let ids: Vec<Value> = q
        .ok("query-block-exports", json!({}))
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].clone())
        .collect();
    assert_eq!(ids.len(), 2, "{ids:?}");
    drop(f);
    q.ok("block-export-del", json!({"id": "bad"}));
    q.event("BLOCK_EXPORT_DELETED", "bad", TIMEOUT);
    let mut want = data.clone();
    for i in 0..64usize {
        want[2 * MIB as usize + i * 512..][..512].fill(i as u8);
    }
    assert_bytes_eq(
        &read_all(&good),
        &want,
        0,
        "the good export after the bad one went",
    );
    drop(g);
    assert_bytes_eq(&fs::read(&good_img).unwrap(), &want, 0, "the good image");
}

/// A removal with a read in flight, on each transport: `safe` lets the read finish with its
/// bytes, `hard` fails it at once; either way the event follows and the other export serves on.
#[test]
fn removal_with_io_in_flight_safe_waits_hard_aborts() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("serve-inflight");
    let img = w.join("other.img");
    let data = random_image(&img, 4 * MIB, 7);
    let other = w.join("other.mnt");
    fs::write(&other, b"").unwrap();
    let serve = Serve::start(w.path(), &[]);
    let mut q = serve.qmp();
    q.ok(
        "blockdev-add",
        json!({"driver": "file", "node-name": "other", "filename": img}),
    );
    q.ok(
        "block-export-add",
        json!({"type": "fuse", "id": "other", "node-name": "other", "mountpoint": other}),
    );
    for (transport, mode) in [
        ("legacy", "safe"),
        ("legacy", "hard"),
        ("uring", "safe"),
        ("uring", "hard"),
    ] {
        if transport == "uring" && !uring_enabled() {
            continue;
        }
        let m = w.join(format!("{mode}-{transport}.mnt"));
        // Every backend read waits 1.5 s: the read below is in flight when the removal comes.
        q.add_null_export(
            mode,
            &m,
            json!({"__org.fusex_fault": ["read:1:delay=1500ms"], "__org.fusex_transport": transport}),
        );
        let f = open_ro(&m);
        let reader = std::thread::spawn(move || {
            let mut buf = vec![0u8; 4096];
            let t = Instant::now();
            let r = f.read_exact_at(&mut buf, 0).map(|()| buf);
            (r, t.elapsed())
        });
        // The read reaches the daemon (and waits there) before the removal: a queue took it.
        assert!(
            q.wait_in_flight(mode),
            "{mode} {transport}: the read never reached the daemon"
        );
        let t = Instant::now();
        q.ok("block-export-del", json!({"id": mode, "mode": mode}));
        q.event("BLOCK_EXPORT_DELETED", mode, TIMEOUT);
        let gone = t.elapsed();
        let (read, took) = reader.join().unwrap();
        match mode {
            "safe" => {
                let buf = read.unwrap_or_else(|e| panic!("safe removal failed the read: {e}"));
                assert!(buf.iter().all(|&b| b == 0));
                assert!(
                    took >= Duration::from_millis(1400),
                    "the read was answered: {took:?}"
                );
            }
            _ => {
                let e = read.expect_err("hard removal must fail the read in flight");
                // ECONNABORTED for the request the abort caught, ENOTCONN for one after it.
                assert!(
                    [libc::ECONNABORTED, libc::ENOTCONN].contains(&errno(&e)),
                    "{e}"
                );
                assert!(gone < TIMEOUT, "hard removal never hangs");
            }
        }
        assert!(!is_fuse_mounted(&m));
        q.ok("blockdev-del", json!({"node-name": format!("n-{mode}")}));
        assert_bytes_eq(&read_all(&other), &data, 0, "the other export");
    }
}

/// What a broken or hostile client sends gets an error or is refused, and the export serving
/// meanwhile never notices: malformed JSON, unknown commands and arguments, wrong types, a line
/// of megabytes, a client that never speaks, many clients at once, a client of another user.
#[test]
fn bad_clients_get_errors_and_no_export_notices() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("serve-clients");
    let img = w.join("a.img");
    let data = random_image(&img, 2 * MIB, 3);
    let mp = w.join("a.mnt");
    fs::write(&mp, b"").unwrap();
    let serve = Serve::start(
        w.path(),
        &[
            "--blockdev",
            &format!("driver=file,node-name=a,filename={}", img.display()),
            "--export",
            &format!("type=fuse,id=a,node-name=a,mountpoint={}", mp.display()),
        ],
    );
    let silent = std::os::unix::net::UnixStream::connect(&serve.socket).unwrap();
    let mut q = serve.qmp();
    q.send_raw(b"{\"execute\": \"query-block-exports\",,}\n");
    let r = q.reply();
    assert!(
        r["error"]["desc"]
            .as_str()
            .unwrap()
            .starts_with("JSON parse error"),
        "{r}"
    );
    assert_eq!(
        q.execute("no-such-command", json!({})).unwrap_err(),
        (
            "CommandNotFound".to_string(),
            "The command no-such-command has not been found".to_string()
        )
    );
    assert_eq!(
        q.err("block-export-add", json!({"type": "fuse", "id": 1})),
        "Invalid parameter type for 'id', expected: string"
    );
    assert_eq!(
        q.err("blockdev-del", json!({"node-name": "a", "force": true})),
        "Parameter 'force' is unexpected"
    );
    assert!(q
        .err(
            "block-export-add",
            json!({"type": "fuse", "id": "x", "node-name": "a",
                                         "mountpoint": mp, "__org.fusex_pid-file": "/x"})
        )
        .contains("whole daemon"));
    assert!(q
        .err(
            "block-export-add",
            json!({"type": "fuse", "id": "x", "node-name": "a",
                                         "mountpoint": mp, "__org.fusex_queues": 0})
        )
        .contains("--queues"));
    // A line of 4 MiB: an error, and this client is disconnected.
    let mut big = std::os::unix::net::UnixStream::connect(&serve.socket).unwrap();
    let huge = format!("{{\"execute\": \"{}\"}}\n", "x".repeat(4 << 20));
    {
        use std::io::{BufRead, Write};
        big.set_read_timeout(Some(TIMEOUT)).unwrap();
        let _ = big.write_all(huge.as_bytes());
        // The greeting, then one error that names the limit, then the end of the connection.
        let mut lines = std::io::BufReader::new(&big);
        let mut line = String::new();
        lines.read_line(&mut line).unwrap();
        assert!(line.contains("\"QMP\""), "{line}");
        line.clear();
        lines.read_line(&mut line).unwrap();
        let reply: Value = serde_json::from_str(&line).unwrap();
        assert!(
            reply["error"]["desc"]
                .as_str()
                .is_some_and(|d| d.contains("exceeds the limit")),
            "{reply}"
        );
        line.clear();
        assert!(
            matches!(lines.read_line(&mut line), Ok(0) | Err(_)),
            "{line}"
        );
    }
    // Many clients at once.
    let clients: Vec<_> = (0..16)
        .map(|_| {
            let path = serve.socket.clone();
            std::thread::spawn(move || {
                let mut c = Qmp::connect(&path);
                for _ in 0..20 {
                    let v = c.ok("query-block-exports", json!({}));
                    assert_eq!(v[0]["id"], "a");
                }
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    // A client of another user is closed without a greeting.
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c"])
        .arg(
            "import socket,sys\ns=socket.socket(socket.AF_UNIX)\n\
             try:\n s.connect(sys.argv[1])\nexcept OSError as e:\n print('refused', e.errno); sys.exit(0)\n\
             print('got', repr(s.recv(100)))",
        )
        .arg(&serve.socket)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.starts_with("refused") || said.trim() == "got b''",
        "another user reached the control socket: {said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(silent);
    assert_bytes_eq(
        &read_all(&mp),
        &data,
        0,
        "the export, after the bad clients",
    );
    let v = q.ok("query-block-exports", json!({}));
    assert_eq!(v[0]["shutting-down"], false);
    assert!(q.pending_events().is_empty());
}

/// An export unmounted from outside ends on its own: the daemon says so (the failure event,
/// then BLOCK_EXPORT_DELETED) and the others serve on.
#[test]
fn an_export_that_ends_on_its_own_is_reported() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("serve-ends");
    let serve = Serve::start(w.path(), &[]);
    let mut q = serve.qmp();
    let (a, b) = (w.join("a.mnt"), w.join("b.mnt"));
    q.add_null_export("a", &a, json!({}));
    q.add_null_export("b", &b, json!({}));
    run_ok(Command::new("umount").arg(&a));
    let failed = q.event("__org.fusex_BLOCK_EXPORT_FAILED", "a", TIMEOUT);
    assert!(
        failed["data"]["error"]
            .as_str()
            .unwrap()
            .contains("unmounted"),
        "{failed}"
    );
    q.event("BLOCK_EXPORT_DELETED", "a", TIMEOUT);
    let v = q.ok("query-block-exports", json!({}));
    assert_eq!(v.as_array().unwrap().len(), 1, "{v}");
    assert_eq!(read_all(&b)[..4096], [0u8; 4096]);
    // Its node is free again: a new export of it works.
    q.ok(
        "block-export-add",
        json!({"type": "fuse", "id": "a2", "node-name": "n-a", "mountpoint": a}),
    );
    assert_eq!(fs::metadata(&a).unwrap().len(), 64 * MIB);
}

/// The command line: a node or export that cannot be set up is one line and exit 1, and the
/// exports set up before it are removed (nothing stays mounted); `--daemonize --pidfile` returns
/// once the exports serve, and `quit` ends the daemon and its pid file.
#[test]
fn command_line_refusals_mount_nothing_and_daemonize_returns_serving() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("serve-cmdline");
    let img = w.join("a.img");
    let data = random_image(&img, MIB, 5);
    let mp = w.join("a.mnt");
    fs::write(&mp, b"").unwrap();
    let node = format!("driver=file,node-name=a,filename={}", img.display());
    let export = format!("type=fuse,id=a,node-name=a,mountpoint={}", mp.display());
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "--blockdev".into(),
                "driver=file,node-name=x,filename=/nonexistent".into(),
            ],
            "Could not open '/nonexistent'",
        ),
        (
            vec![
                "--blockdev".into(),
                node.clone(),
                "--export".into(),
                export.clone(),
                "--export".into(),
                format!("type=fuse,id=b,node-name=nope,mountpoint={}", mp.display()),
            ],
            "node-name='nope'",
        ),
        (vec!["--chardev".into(), "stdio,id=c".into()], "only socket"),
        (
            vec!["--nbd-server".into(), "addr.type=unix".into()],
            "--nbd-server",
        ),
        (
            vec!["--export".into(), "type=fuse,writable=maybe".into()],
            "'writable' expects 'on' or 'off'",
        ),
        (
            vec!["--object".into(), "secret,id=s0,data=x".into()],
            "objects of type 'secret'",
        ),
        (
            vec![
                "--object".into(),
                "iothread,id=io0".into(),
                "--blockdev".into(),
                node.clone(),
                "--export".into(),
                format!("{export},iothread=io1"),
            ],
            "iothread \"io1\" not found",
        ),
    ];
    for (args, want) in cases {
        let mut cmd = Command::new(fusex_bin());
        cmd.arg("serve").args(&args);
        let r = run_with_timeout(&w, cmd, Some(&mp));
        assert_eq!(r.code, Some(1), "{args:?}: {}", r.stderr);
        r.assert_one_error_line(&format!("{args:?}"));
        assert!(r.stderr.contains(want), "{args:?}: {}", r.stderr);
        assert!(!is_fuse_mounted(&mp), "{args:?} left a mount");
    }
    let pid_file = w.join("serve.pid");
    let sock = w.join("qmp.sock");
    let mut cmd = Command::new(fusex_bin());
    // An export on a list of IOThreads (QEMU 10.1's multi-threaded exports).
    let on_iothreads = format!("{export},iothread.0=io0,iothread.1=io1");
    cmd.args(["serve", "--daemonize", "--log-file"])
        .arg(w.join("serve.log"))
        .arg("--pidfile")
        .arg(&pid_file)
        .args(["--object", "iothread,id=io0", "--object", "iothread,id=io1"])
        .args(["--blockdev", &node, "--export", &on_iothreads])
        .arg("--chardev")
        .arg(format!(
            "socket,id=m,path={},server=on,wait=off",
            sock.display()
        ))
        .args(["--monitor", "chardev=m"]);
    let _unmount = UnmountOnDrop(mp.clone());
    let r = run_with_timeout(&w, cmd, Some(&mp));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    // Serving as the command returns.
    assert_bytes_eq(
        &read_all(&mp),
        &data,
        0,
        "the export of a daemonized fusex serve",
    );
    let pid: i32 = fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(pid_alive(pid));
    let mut q = Qmp::connect(&sock);
    let e = q.err("object-del", json!({"id": "io1"}));
    assert!(e.contains("in use") && e.contains("export 'a'"), "{e}");
    q.ok("quit", json!({}));
    assert!(
        wait_until(Instant::now() + TIMEOUT, || !pid_alive(pid)),
        "quit did not end it"
    );
    assert!(!is_fuse_mounted(&mp));
    assert!(!pid_file.exists(), "the pid file is removed at exit");
    assert!(!sock.exists(), "the control socket is removed at exit");
}

/// `--config`: its exports serve at launch; a changed file applied by SIGHUP and by `fusex ctl
/// reload` adds, removes and re-creates exports and says what it did to each; `fusex ctl` adds,
/// lists, shows and removes exports, as tables and as JSON.
#[test]
fn config_file_reload_and_ctl() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("serve-config");
    let a = random_image(&w.join("a.img"), MIB, 11);
    sparse_image(&w.join("b.img"), 2 * MIB);
    for m in ["a.raw", "b.raw", "c.raw", "n.raw"] {
        fs::write(w.join(m), b"").unwrap();
    }
    let config = w.join("exports.toml");
    let write_config = |text: &str| fs::write(&config, text).unwrap();
    write_config(
        "[[export]]\nid = \"a\"\nimage = \"a.img\"\nmountpoint = \"a.raw\"\n\
         [[export]]\nid = \"b\"\nimage = \"b.img\"\nmountpoint = \"b.raw\"\nwritable = true\n",
    );
    let serve = Serve::start(w.path(), &["--config", config.to_str().unwrap()]);
    let ctl = |args: &[&str]| {
        let mut cmd = Command::new(fusex_bin());
        cmd.arg("ctl")
            .arg("--control")
            .arg(&serve.socket)
            .args(args);
        run(&mut cmd)
    };
    assert_bytes_eq(&read_all(&w.join("a.raw")), &a, 0, "config export a");
    let list = ctl(&["list", "--json"]);
    assert!(
        list.status.success(),
        "{}",
        String::from_utf8_lossy(&list.stderr)
    );
    let v: Value = serde_json::from_slice(&list.stdout).unwrap();
    let ids: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["a", "b"]);
    assert_eq!(v[1]["writable"], true);
    // `fusex list` sees the daemon's exports as serving (not as dead mounts to clear).
    let all = run(Command::new(fusex_bin()).args(["list", "--json"]));
    let all: Value = serde_json::from_slice(&all.stdout).unwrap();
    for m in ["a.raw", "b.raw"] {
        let path = w.join(m);
        let row = all
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["mountpoint"] == path.to_str().unwrap())
            .unwrap_or_else(|| panic!("fusex list lacks {m}: {all}"));
        assert_eq!(row["state"], "serving", "{row}");
        assert_eq!(row["pid"], serve.pid(), "{row}");
    }
    // b becomes read-only, a goes, c comes: SIGHUP.
    write_config(
        "[[export]]\nid = \"b\"\nimage = \"b.img\"\nmountpoint = \"b.raw\"\n\
         [[export]]\nid = \"c\"\nimage = \"null:4M\"\nmountpoint = \"c.raw\"\n",
    );
    let mut q = serve.qmp();
    send_signal(serve.pid(), libc::SIGHUP);
    q.event("BLOCK_EXPORT_DELETED", "a", TIMEOUT);
    assert!(wait_until(Instant::now() + TIMEOUT, || is_fuse_mounted(
        &w.join("c.raw")
    )));
    assert!(!is_fuse_mounted(&w.join("a.raw")));
    assert!(
        wait_until(Instant::now() + TIMEOUT, || serve
            .log_text()
            .contains("export b: reload: recreated")),
        "{}",
        serve.log_text()
    );
    let err = fs::OpenOptions::new()
        .write(true)
        .open(w.join("b.raw"))
        .unwrap_err();
    assert_eq!(errno(&err), libc::EROFS, "b is read-only after the reload");
    // An unchanged file: `fusex ctl reload` reports every export unchanged.
    let r = ctl(&["reload", "--json"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let report: Value = serde_json::from_slice(&r.stdout).unwrap();
    assert!(
        report
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["action"] == "unchanged"),
        "{report}"
    );
    // A broken file is refused whole and changes nothing.
    write_config("[[export]]\nid = \"x\"\n");
    let r = ctl(&["reload"]);
    assert!(!r.status.success());
    assert!(String::from_utf8_lossy(&r.stderr).contains("'x' has no image"));
    // ctl add / show / remove.
    let n = w.join("n.raw");
    let r = ctl(&[
        "add",
        "n",
        "null:8M",
        n.to_str().unwrap(),
        "--",
        "--transport",
        "legacy",
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(fs::metadata(&n).unwrap().len(), 8 * MIB);
    let show = ctl(&["show", "n"]);
    let text = String::from_utf8_lossy(&show.stdout);
    assert!(text.contains("transport: legacy"), "{text}");
    let r = ctl(&[
        "add",
        "n2",
        "null:8M",
        n.to_str().unwrap(),
        "--",
        "--pid-file",
        "/x",
    ]);
    assert!(String::from_utf8_lossy(&r.stderr).contains("whole daemon"));
    let r = ctl(&["remove", "n"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(!is_fuse_mounted(&n));
    // `remove --force` with a read in flight (its backend read waits 3 s): the read fails at
    // once instead of being answered, and the export is gone.
    let r = ctl(&[
        "add",
        "f",
        "null:8M",
        n.to_str().unwrap(),
        "--",
        "--fault",
        "read:1:delay=3000ms",
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let f = open_ro(&n);
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 4096];
        f.read_exact_at(&mut buf, 0)
    });
    // The read reaches the daemon (and waits there) before the removal: a queue took it.
    assert!(
        serve.qmp().wait_in_flight("f"),
        "the read never reached the daemon"
    );
    let r = ctl(&["remove", "--force", "f"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let e = reader
        .join()
        .unwrap()
        .expect_err("a forced removal fails the read in flight");
    assert!(
        [libc::ECONNABORTED, libc::ENOTCONN].contains(&errno(&e)),
        "{e}"
    );
    assert!(!is_fuse_mounted(&n));
    let table = String::from_utf8_lossy(&ctl(&["list"]).stdout).into_owned();
    assert!(table.starts_with("ID "), "{table}");
    assert_eq!(table.lines().count(), 3, "b and c remain: {table}");
}

/// `fusex restart` of any export of a `fusex serve` daemon hands every export to a new process:
/// files held open across it keep working, the control socket, node names, config file and pid
/// file carry on, and the qcow2 image stays consistent. With one export the kernel cannot hand
/// over (io_uring), the restart is refused and the old daemon serves on.
#[test]
fn restart_hands_every_export_to_a_new_daemon() {
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    let w = WorkDir::new("serve-restart");
    let a = random_image(&w.join("a.img"), 4 * MIB, 21);
    run_ok(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(w.join("b.qcow2"))
            .arg("8M"),
    );
    for m in ["a.raw", "b.raw", "n.raw", "u.raw"] {
        fs::write(w.join(m), b"").unwrap();
    }
    let config = w.join("exports.toml");
    fs::write(
        &config,
        "[[export]]\nid = \"a\"\nimage = \"a.img\"\nmountpoint = \"a.raw\"\nwritable = true\n\
         transport = \"legacy\"\n\
         [[export]]\nid = \"b\"\nimage = \"b.qcow2\"\nmountpoint = \"b.raw\"\nwritable = true\n\
         transport = \"legacy\"\n",
    )
    .unwrap();
    let pid_file = w.join("serve.pid");
    let mut serve = Serve::start(
        w.path(),
        &[
            "--config",
            config.to_str().unwrap(),
            "--pidfile",
            pid_file.to_str().unwrap(),
        ],
    );
    let _guard = PidGuard(pid_file.clone(), w.path().to_path_buf());
    let old = serve.pid();
    let mut q = serve.qmp();
    q.add_null_export(
        "n",
        &w.join("n.raw"),
        json!({"__org.fusex_transport": "legacy"}),
    );
    // Held open across the restart, with a write before and after it.
    let held = open_rw(&w.join("b.raw"));
    held.write_all_at(b"before", 0).unwrap();
    // And a passed-through open of the raw export, beside which new opens must still work.
    let held_a = open_ro(&w.join("a.raw"));
    // An io_uring export cannot be handed over: the restart is refused, nothing changes.
    q.add_null_export(
        "u",
        &w.join("u.raw"),
        json!({"__org.fusex_transport": "uring"}),
    );
    let restart = |mp: &Path| {
        let mut cmd = Command::new(fusex_bin());
        cmd.arg("restart").arg(mp);
        run_with_timeout(&w, cmd, None)
    };
    if uring_enabled() {
        let r = restart(&w.join("a.raw"));
        assert_eq!(r.code, Some(1), "{}", r.stderr);
        r.assert_one_error_line("restart with an io_uring export");
        assert!(r.stderr.contains("io_uring"), "{}", r.stderr);
        assert!(pid_alive(old));
        assert_eq!(
            q.ok("query-block-exports", json!({}))
                .as_array()
                .unwrap()
                .len(),
            4
        );
    }
    q.remove_null_export("u", "safe");
    drop(q);
    let new = serve.restart(&w, &w.join("a.raw"), &pid_file);
    // Everything still serves, through the same mounts.
    held.write_all_at(b"after!", 6).unwrap();
    held.sync_all().unwrap();
    assert_bytes_eq(
        &read_all(&w.join("a.raw")),
        &a,
        0,
        "export a after the restart",
    );
    let mut seen = vec![0u8; a.len()];
    held_a.read_exact_at(&mut seen, 0).unwrap();
    assert_bytes_eq(&seen, &a, 0, "export a through the open kept across");
    drop(held_a);
    // The old daemon logged to its stderr, a file: the successor logs there too (the restart
    // command's own stderr, a pipe here, is gone once it returns).
    let log = serve.log_text();
    assert!(log.contains("handed every export over"), "{log}");
    assert!(log.contains("restart: took over 3 exports"), "{log}");
    let list = run(Command::new(fusex_bin()).args(["list", "--json"]));
    let list: Value = serde_json::from_slice(&list.stdout).unwrap();
    for m in ["a.raw", "b.raw", "n.raw"] {
        let p = w.join(m);
        let row = list
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["mountpoint"] == p.to_str().unwrap())
            .unwrap_or_else(|| panic!("{m} missing: {list}"));
        assert_eq!(row["pid"], new, "{row}");
    }
    // The control socket and the table came along.
    let mut q = Qmp::connect(&serve.socket);
    let ids: Vec<String> = q
        .ok("query-block-exports", json!({}))
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, ["a", "b", "n"]);
    q.ok("block-export-del", json!({"id": "n"}));
    q.event("BLOCK_EXPORT_DELETED", "n", TIMEOUT);
    q.ok("blockdev-del", json!({"node-name": "n-n"}));
    let r = run(Command::new(fusex_bin())
        .arg("ctl")
        .arg("--control")
        .arg(&serve.socket)
        .args(["reload", "--json"]));
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    drop(held);
    q.ok("quit", json!({}));
    assert!(
        wait_until(Instant::now() + TIMEOUT * 3, || !pid_alive(new)),
        "quit ends the new daemon"
    );
    for m in ["a.raw", "b.raw", "n.raw"] {
        assert!(!is_fuse_mounted(&w.join(m)), "{m} left mounted");
    }
    let check = run(Command::new("qemu-img").arg("check").arg(w.join("b.qcow2")));
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );
    let out = run(Command::new("qemu-img")
        .args(["convert", "-O", "raw"])
        .arg(w.join("b.qcow2"))
        .arg(w.join("b.out")));
    assert!(out.status.success());
    assert_eq!(&read_all(&w.join("b.out"))[..12], b"beforeafter!");
}

/// QEMU's interactive client, `qmp-shell`, drives qemu-storage-daemon and fusex alike: the same
/// typed commands (its `name key=value` syntax) get the same answers from both.
#[test]
fn qmp_shell_gets_the_same_answers_from_both() {
    if !require_fuse_and_tools(&["qemu-storage-daemon"]) {
        return;
    }
    let Some(py) = qmp_python() else {
        skip_or_fail("target/qmp-venv with qemu.qmp (run scripts/deps.sh)");
        return;
    };
    let shell = py.with_file_name("qmp-shell");
    let w = WorkDir::new("serve-qmp-shell");
    let mut answers = Vec::new();
    for program in [
        "qemu-storage-daemon".to_string(),
        fusex_bin().display().to_string(),
    ] {
        let dir = w.join(if answers.is_empty() { "qsd" } else { "fusex" });
        fs::create_dir(&dir).unwrap();
        sparse_image(&dir.join("a.img"), MIB);
        fs::write(dir.join("a.mnt"), b"").unwrap();
        let sock = dir.join("qmp.sock");
        let mut cmd = Command::new(&program);
        if !program.starts_with("qemu") {
            cmd.arg("serve");
        }
        let mut daemon = ChildGuard(
            cmd.arg("--chardev")
                .arg(format!(
                    "socket,id=m,path={},server=on,wait=off",
                    sock.display()
                ))
                .args(["--monitor", "chardev=m"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let _unmount = UnmountOnDrop(dir.join("a.mnt"));
        // No probe connection: a QEMU monitor serves one client at a time, so the shell's
        // connection would wait on the server's handling of the probe's close. The shell is run
        // again only while it could not connect (the socket bound but not yet listening).
        let deadline = Instant::now() + TIMEOUT;
        assert!(
            wait_until(deadline, || sock.exists()),
            "{program} has no socket"
        );
        let d = dir.display();
        let input = format!(
            "blockdev-add driver=file node-name=f0 filename={d}/a.img\n\
             block-export-add type=fuse id=e0 node-name=f0 mountpoint={d}/a.mnt writable=true\n\
             query-block-exports\n\
             blockdev-add driver=vmdkx node-name=x\n\
             block-export-add type=fuse id=e0 node-name=f0 mountpoint={d}/a.mnt\n\
             block-export-del id=nope\n\
             blockdev-del node-name=f0\n\
             block-export-del id=e0 mode=hard\n\
             quit\n"
        );
        let out = loop {
            let mut sh = Command::new(&shell)
                .arg(&sock)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            {
                use std::io::Write;
                sh.stdin
                    .take()
                    .unwrap()
                    .write_all(input.as_bytes())
                    .unwrap();
            }
            let out = sh.wait_with_output().unwrap();
            let refused = String::from_utf8_lossy(&out.stderr).contains("Couldn't connect");
            if !(refused && out.stdout.is_empty() && Instant::now() < deadline) {
                break out;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let text = String::from_utf8_lossy(&out.stdout).replace(&d.to_string(), "$W");
        // The greeting names the server's version: the replies after it are compared, as JSON
        // (members in any order).
        let replies: Vec<Value> = text
            .lines()
            .filter_map(|l| l.strip_prefix("(QEMU) "))
            .filter(|l| l.starts_with('{'))
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect();
        assert_eq!(
            replies.len(),
            9,
            "{program}: qmp-shell ({}) printed {text}, and on stderr {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            wait_timeout(&mut daemon.0, TIMEOUT).is_some(),
            "{program} did not quit"
        );
        answers.push(replies);
    }
    assert_eq!(answers[0], answers[1], "qemu-storage-daemon, then fusex");
}

/// The restart socket of the export at `mp`: beside the state file that names it in root's
/// runtime directory.
fn restart_socket(mp: &Path) -> PathBuf {
    bound_runtime_socket(|s| s.contains(&format!("\"{}\"", mp.display())))
        .unwrap_or_else(|| panic!("no runtime state names {}", mp.display()))
}

/// One restart message: a little-endian length, then JSON.
fn restart_message(s: &mut std::os::unix::net::UnixStream, v: Value) {
    use std::io::Write;
    let body = v.to_string();
    s.write_all(&(body.len() as u32).to_le_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
}

/// A successor that asks for every export and vanishes once they let go: the old daemon cannot
/// tell it, so it unmounts every export (nothing is left as a dead mount) and exits, the image
/// written through it whole.
#[test]
fn a_successor_that_vanishes_mid_restart_leaves_no_dead_mount() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("serve-restart-gone");
    let a = random_image(&w.join("a.img"), MIB, 5);
    let mp = w.join("a.raw");
    fs::write(&mp, b"").unwrap();
    let mut serve = Serve::start(
        w.path(),
        &[
            "--blockdev",
            &format!(
                "driver=file,node-name=a,filename={}",
                w.join("a.img").display()
            ),
            "--export",
            &format!(
                "type=fuse,id=a,node-name=a,mountpoint={},writable=on,__org.fusex_transport=legacy",
                mp.display()
            ),
        ],
    );
    open_rw(&mp).write_all_at(&a[..4096], 8192).unwrap();
    let mut s = std::os::unix::net::UnixStream::connect(restart_socket(&mp)).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    restart_message(&mut s, json!({"op": "hello"}));
    // Read the state (the descriptors passed with it are dropped unread) up to `serveend`.
    let mut seen = Vec::new();
    loop {
        use std::io::Read;
        let mut len = [0u8; 4];
        s.read_exact(&mut len).unwrap();
        let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
        s.read_exact(&mut body).unwrap();
        let m: Value = serde_json::from_slice(&body).unwrap();
        let op = m["op"].as_str().unwrap().to_string();
        seen.push(op.clone());
        if op == "serveend" || op == "refused" {
            break;
        }
    }
    assert_eq!(seen, ["serve", "export", "serveend"]);
    restart_message(&mut s, json!({"op": "release"}));
    drop(s);
    assert_eq!(serve.wait(), Some(0), "{}", serve.log_text());
    assert!(
        !is_fuse_mounted(&mp),
        "a dead mount was left: {}",
        serve.log_text()
    );
    assert!(
        serve.log_text().contains("unmounting every export"),
        "{}",
        serve.log_text()
    );
    let mut want = a.clone();
    want[8192..8192 + 4096].copy_from_slice(&a[..4096]);
    assert_bytes_eq(
        &read_all(&w.join("a.img")),
        &want,
        0,
        "the image after the failed restart",
    );
}

/// systemd's readiness protocol: READY=1 only once every export of the config file serves,
/// RELOADING=1 then READY=1 around a SIGHUP reload, STOPPING=1 when `quit` begins.
#[test]
fn readiness_waits_for_every_configured_export() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("serve-notify");
    let mut config = String::new();
    for i in 0..6 {
        fs::write(w.join(format!("m{i}.raw")), b"").unwrap();
        config += &format!(
            "[[export]]\nid = \"e{i}\"\nimage = \"null:{}M\"\nmountpoint = \"m{i}.raw\"\n",
            i + 1
        );
    }
    fs::write(w.join("exports.toml"), &config).unwrap();
    let path = w.join("notify.sock");
    let sock = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
    sock.set_read_timeout(Some(TIMEOUT)).unwrap();
    let recv = || {
        let mut buf = vec![0u8; 4096];
        let n = sock.recv(&mut buf).expect("a notification");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let socket = w.join("qmp.sock");
    let mut daemon = ChildGuard(
        Command::new(fusex_bin())
            .args(["serve", "--config"])
            .arg(w.join("exports.toml"))
            .arg("--control")
            .arg(&socket)
            .env("NOTIFY_SOCKET", &path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let _unmount = (0..6)
        .map(|i| UnmountOnDrop(w.join(format!("m{i}.raw"))))
        .collect::<Vec<_>>();
    let ready = recv();
    assert!(ready.lines().any(|l| l == "READY=1"), "{ready:?}");
    assert!(ready.contains("serving 6 exports"), "{ready:?}");
    for i in 0..6 {
        let m = w.join(format!("m{i}.raw"));
        assert!(
            is_fuse_mounted(&m),
            "READY=1 came before {} served",
            m.display()
        );
        assert_eq!(fs::metadata(&m).unwrap().len(), (i + 1) * MIB);
    }
    send_signal(daemon.pid(), libc::SIGHUP);
    let reloading = recv();
    assert!(
        reloading.lines().any(|l| l == "RELOADING=1"),
        "{reloading:?}"
    );
    assert!(reloading.lines().any(|l| l.starts_with("MONOTONIC_USEC=")));
    let again = recv();
    assert!(again.lines().any(|l| l == "READY=1"), "{again:?}");
    Qmp::connect(&socket).ok("quit", json!({}));
    let stopping = recv();
    assert!(stopping.lines().any(|l| l == "STOPPING=1"), "{stopping:?}");
    assert!(wait_timeout(&mut daemon.0, TIMEOUT).is_some_and(|s| s.success()));
    for i in 0..6 {
        assert!(!is_fuse_mounted(&w.join(format!("m{i}.raw"))));
    }
}

/// A daemon closes what its launcher had open: `fusex restart` run from a shell that holds the
/// export open must not leave the new daemon holding it too (a stop would then wait for that
/// file forever).
#[test]
fn a_restarted_daemon_does_not_keep_its_launchers_descriptors() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("serve-inherited");
    let img = w.join("a.img");
    random_image(&img, MIB, 9);
    let mp = w.join("a.raw");
    let pid_file = w.join("a.pid");
    let _guard = PidGuard(pid_file.clone(), w.path().to_path_buf());
    let mut cmd = Command::new(fusex_bin());
    cmd.args([
        "mount",
        "--transport",
        "legacy",
        "--daemonize",
        "--log-file",
    ])
    .arg(w.join("log"))
    .arg("--pid-file")
    .arg(&pid_file)
    .arg(&img)
    .arg(&mp);
    let r = run_with_timeout(&w, cmd, Some(&mp));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    // The shell's descriptor 7 on the export is not close-on-exec: fusex restart inherits it.
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg("exec 7<\"$1\"; \"$2\" restart \"$1\"")
        .arg("bash")
        .arg(&mp)
        .arg(fusex_bin());
    let r = run_with_timeout(&w, cmd, None);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let new: i32 = fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    send_signal(new, libc::SIGTERM);
    assert!(
        wait_until(Instant::now() + TIMEOUT, || !pid_alive(new)),
        "the restarted daemon waited for a file only it held: {}",
        fs::read_to_string(w.join("log")).unwrap_or_default()
    );
    assert!(!is_fuse_mounted(&mp));
}

/// An export whose NBD server goes away serves on (requests fail with EIO meanwhile) and says
/// so to QMP clients (`__org.fusex_BLOCK_EXPORT_FAILING`); once the server is back, requests
/// succeed again and `__org.fusex_BLOCK_EXPORT_RECOVERED` says so. The export never ends, and
/// the exports beside it serve, come and go meanwhile.
#[test]
fn an_unreachable_nbd_server_is_reported_and_so_is_its_return() {
    if !require_fuse_and_tools(&["qemu-nbd"]) {
        return;
    }
    let w = WorkDir::new("serve-nbd-gone");
    let img = w.join("disk.img");
    let data = random_image(&img, 4 * MIB, 31);
    let sock = w.join("nbd.sock");
    let mp = w.join("disk.raw");
    fs::write(&mp, b"").unwrap();
    let server = qemu_nbd(&sock, &["-f", "raw"], &img);
    let serve = Serve::start(w.path(), &[]);
    let mut q = serve.qmp();
    q.ok(
        "blockdev-add",
        json!({"driver": "nbd", "node-name": "n", "export": "",
               "server": {"type": "unix", "path": sock}}),
    );
    q.ok(
        "block-export-add",
        json!({"type": "fuse", "id": "n", "node-name": "n", "mountpoint": mp,
               "__org.fusex_reconnect-delay": 0.2, "__org.fusex_nbd-timeout": 3}),
    );
    assert_bytes_eq(&read_all(&mp), &data, 0, "through the NBD export");
    // An export beside it, which the NBD server's absence must not disturb.
    let other = w.join("other.raw");
    q.add_null_export("other", &other, json!({}));
    drop(server);
    // The next reads find the server gone: EIO, and the failed reconnect is reported.
    let f = open_ro(&mp);
    let failed = wait_until(Instant::now() + TIMEOUT, || {
        let mut buf = vec![0u8; 4096];
        f.read_exact_at(&mut buf, 0).is_err()
    });
    assert!(failed, "reads kept succeeding with the server gone");
    let ev = q.event("__org.fusex_BLOCK_EXPORT_FAILING", "n", TIMEOUT);
    assert!(
        ev["data"]["error"].as_str().unwrap().contains("EIO"),
        "{ev}"
    );
    // Meanwhile the other export serves, and another comes and goes.
    assert_eq!(read_all(&other), vec![0u8; 64 << 20]);
    let third = w.join("third.raw");
    q.add_null_export("third", &third, json!({}));
    assert_eq!(fs::metadata(&third).unwrap().len(), 64 << 20);
    q.remove_null_export("third", "safe");
    let _server = qemu_nbd(&sock, &["-f", "raw"], &img);
    let back = wait_until(Instant::now() + TIMEOUT, || {
        let mut buf = vec![0u8; 4096];
        f.read_exact_at(&mut buf, 4096)
            .is_ok_and(|()| buf == data[4096..8192])
    });
    assert!(back, "reads did not succeed again once the server was back");
    q.event("__org.fusex_BLOCK_EXPORT_RECOVERED", "n", TIMEOUT);
    assert!(
        !q.pending_events()
            .iter()
            .any(|e| e["event"] == "BLOCK_EXPORT_DELETED"),
        "the export ended: {:?}",
        q.pending_events()
    );
    let listed = q.ok("query-block-exports", json!({}));
    let mut ids: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap())
        .collect();
    ids.sort();
    assert_eq!(ids, ["n", "other"]);
}

/// One thread of the daemon, from `/proc/PID/task/TID`.
struct DaemonThread {
    /// Its name; the main thread (whose id is the process's) is named `main`.
    name: String,
    /// Its nice value (`stat`, field 19).
    nice: i32,
}

/// The daemon's threads now. A thread that ended since the listing is left out.
fn daemon_tasks(pid: i32) -> Vec<DaemonThread> {
    let mut v = Vec::new();
    for t in fs::read_dir(format!("/proc/{pid}/task")).expect("the daemon's threads") {
        let t = t.expect("a thread entry");
        let (Ok(comm), Ok(stat)) = (
            fs::read_to_string(t.path().join("comm")),
            fs::read_to_string(t.path().join("stat")),
        ) else {
            continue;
        };
        // After the name's closing parenthesis come the fields from the third (state) on.
        let rest = &stat[stat.rfind(')').expect("stat has the name") + 2..];
        let nice = rest.split(' ').nth(19 - 3).expect("field 19");
        let name = if t.file_name().to_str() == Some(pid.to_string().as_str()) {
            "main".to_string()
        } else {
            comm.trim_end().to_string()
        };
        v.push(DaemonThread {
            name,
            nice: nice.parse().expect("a nice value"),
        });
    }
    v
}

/// The daemon's threads by name, without the kernel's io_uring workers (`iou-*`, which come
/// and go with blocking I/O).
fn daemon_threads(pid: i32) -> Vec<String> {
    let mut names: Vec<String> = daemon_tasks(pid)
        .into_iter()
        .map(|t| t.name)
        .filter(|n| !n.starts_with("iou-"))
        .collect();
    names.sort();
    names
}

/// Exports cost no threads: every export's queues run on the shared worker threads (one per
/// CPU) and one thread supervises them all, so the daemon has as many threads with twenty
/// exports (of one queue and of one per CPU) as with one.
#[test]
fn the_thread_count_does_not_grow_with_exports() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("serve-threads");
    let serve = Serve::start(w.path(), &[]);
    let pid = serve.pid();
    let mut q = serve.qmp();
    q.add_null_export("t0", &w.join("t0.mnt"), json!({}));
    let one = daemon_threads(pid);
    for i in 1..20 {
        let id = format!("t{i}");
        // Half with one queue, half with the default (one per CPU).
        let opts = if i % 2 == 0 {
            json!({"__org.fusex_queues": 1})
        } else {
            json!({})
        };
        q.add_null_export(&id, &w.join(format!("{id}.mnt")), opts);
    }
    let v = q.ok("query-block-exports", json!({}));
    assert_eq!(v.as_array().unwrap().len(), 20, "{v}");
    let twenty = daemon_threads(pid);
    // A few threads that come and go (a client's, say) do not fail it.
    assert!(
        twenty.len() <= one.len() + 2,
        "nineteen more exports added {} threads (one export: {one:?}; twenty: {twenty:?})",
        twenty.len() as isize - one.len() as isize
    );
    assert!(
        !twenty.iter().any(|t| t
            .strip_prefix("fusex-q")
            .is_some_and(|n| n.starts_with(|c: char| c.is_ascii_digit()))),
        "no export has queue threads of its own: {twenty:?}"
    );
    assert_eq!(
        twenty
            .iter()
            .filter(|t| t.as_str() == "fusex-exports")
            .count(),
        1,
        "one thread supervises every export: {twenty:?}"
    );
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let workers = twenty.iter().filter(|t| t.starts_with("fusex-w")).count();
    assert_eq!(workers, cpus, "a worker thread per CPU: {twenty:?}");
    // Every export serves from the shared threads.
    for i in 0..20 {
        let mut data = vec![1u8; 1 << 20];
        use std::io::Read;
        fs::File::open(w.join(format!("t{i}.mnt")))
            .and_then(|mut f| f.read_exact(&mut data))
            .expect("read an export");
        assert!(data.iter().all(|&b| b == 0), "t{i} reads zeroes");
    }
}

/// Nice values of the daemon's threads by name (see [`daemon_tasks`]).
fn thread_nice(pid: i32) -> Vec<(String, i32)> {
    daemon_tasks(pid)
        .into_iter()
        .map(|t| (t.name, t.nice))
        .collect()
}

/// The control threads (the QMP server and its clients, the exports' supervisor, the reaper) run
/// ten nice levels below the queue threads, which run at the daemon's own priority even when a
/// lowered QMP client thread started them (the shared workers with the first export, an
/// export's own queue threads with it); `--control-nice 0` leaves every thread at the daemon's.
#[test]
fn control_threads_run_below_the_queue_threads() {
    if !require_fuse() {
        return;
    }
    for (extra, step) in [(&[][..], 10), (&["--control-nice", "0"][..], 0)] {
        let w = WorkDir::new("serve-priority");
        let serve = Serve::start(w.path(), extra);
        let pid = serve.pid();
        let mut q = serve.qmp();
        q.add_null_export("shared", &w.join("shared.mnt"), json!({}));
        // A spin of its own keeps it off the shared threads: it gets queue threads of its own.
        q.add_null_export("own", &w.join("own.mnt"), json!({"__org.fusex_spin-us": 5}));
        let threads = thread_nice(pid);
        let base = threads
            .iter()
            .find(|(n, _)| n == "main")
            .map(|(_, v)| *v)
            .unwrap_or_else(|| panic!("the main thread: {threads:?}"));
        // Threads named `prefix` and a number (`fusex-q0`, not `fusex-qmp`), or `prefix` alone.
        let nice = |prefix: &str| -> Vec<i32> {
            threads
                .iter()
                .filter(|(n, _)| {
                    n.strip_prefix(prefix)
                        .is_some_and(|rest| rest.chars().all(|c| c.is_ascii_digit()))
                })
                .map(|(_, v)| *v)
                .collect()
        };
        let control = (base + step).min(19);
        for name in ["fusex-qmp", "qmp-client-", "fusex-exports", "fusex-reaper"] {
            let got = nice(name);
            assert!(!got.is_empty(), "no {name} thread: {threads:?}");
            assert!(got.iter().all(|&v| v == control), "{name}: {threads:?}");
        }
        for name in ["fusex-w", "fusex-q"] {
            let got = nice(name);
            assert!(!got.is_empty(), "no {name} thread: {threads:?}");
            assert!(got.iter().all(|&v| v == base), "{name}: {threads:?}");
        }
        // Both serve.
        for m in ["shared.mnt", "own.mnt"] {
            let mut data = vec![1u8; 4096];
            use std::io::Read;
            fs::File::open(w.join(m))
                .and_then(|mut f| f.read_exact(&mut data))
                .expect("read an export");
            assert!(data.iter().all(|&b| b == 0), "{m} reads zeroes");
        }
    }
}

/// When `BLOCK_EXPORT_DELETED` arrives the export's image is closed: no lock of the daemon is
/// left on it, so a tool run right after the event (`qemu-img check`, a backup) can open it.
/// The queues on the shared threads report their end just before those threads let go of the
/// export; the removal waits for that. Many rounds: the window was microseconds wide.
#[test]
fn an_export_reported_deleted_has_closed_its_image() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("serve-closed-at-event");
    let img = w.join("disk.raw");
    fs::write(&img, vec![7u8; 1 << 20]).unwrap();
    let mp = w.join("disk.mnt");
    let mut serve = Serve::start(w.path(), &[]);
    let mut q = serve.qmp();
    q.ok(
        "blockdev-add",
        json!({"driver": "file", "node-name": "disk", "filename": img}),
    );
    // Whether anyone else holds a lock on any byte of the file.
    let locked = || lock_held(&img, 0, 0);
    for round in 0..100 {
        fs::write(&mp, b"").unwrap();
        q.ok(
            "block-export-add",
            json!({"type": "fuse", "id": "e", "node-name": "disk", "mountpoint": mp,
                   "writable": true}),
        );
        assert!(locked(), "round {round}: the export locks its image");
        q.ok("block-export-del", json!({"id": "e"}));
        q.event("BLOCK_EXPORT_DELETED", "e", TIMEOUT);
        assert!(
            !locked(),
            "round {round}: a lock is left after BLOCK_EXPORT_DELETED"
        );
    }
    q.ok("blockdev-del", json!({"node-name": "disk"}));
    q.ok("quit", json!({}));
    assert_eq!(serve.wait(), Some(0));
}

/// Text log lines (the default) of work on one export start with `export ID: ` (once: a
/// message naming its export already is not prefixed again), so the lines of exports added at
/// once by several clients can be told apart; the daemon's own lines name none.
#[test]
fn text_log_lines_name_the_export_they_are_about() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("serve-text-log");
    let log = w.join("fusex.log");
    let mut serve = Serve::start(w.path(), &["--log-file", log.to_str().unwrap()]);
    let mut q = serve.qmp();
    let (a, b) = (w.join("alpha.mnt"), w.join("beta.mnt"));
    q.add_null_export("alpha", &a, json!({}));
    q.add_null_export("beta", &b, json!({}));
    q.remove_null_export("alpha", "safe");
    q.ok("quit", json!({}));
    let status = serve.wait();
    let text = fs::read_to_string(&log).unwrap();
    assert_eq!(status, Some(0), "{text}");
    // `TIMESTAMP  INFO MESSAGE`
    let messages: Vec<&str> = text
        .lines()
        .map(|l| {
            let mut words = l.splitn(2, ' ');
            let (_timestamp, rest) = (words.next(), words.next().unwrap_or(""));
            rest.trim_start()
                .split_once(' ')
                .map_or("", |(_level, m)| m)
        })
        .collect();
    for id in ["alpha", "beta"] {
        let mine = format!("export {id}: ");
        for what in [
            "passthrough: ",
            "request buffers: ",
            "mounted ",
            "removal: ",
            "served ",
        ] {
            assert!(
                messages
                    .iter()
                    .any(|m| m.starts_with(&mine) && m[mine.len()..].starts_with(what)),
                "no `{mine}{what}...` line:\n{text}"
            );
        }
        assert!(
            messages.contains(&format!("export {id} removed").as_str()),
            "{text}"
        );
        assert!(
            !messages
                .iter()
                .any(|m| m.starts_with(&format!("{mine}export "))),
            "a line names {id} twice:\n{text}"
        );
    }
    let quit = messages
        .iter()
        .find(|m| m.starts_with("quit: "))
        .unwrap_or_else(|| panic!("no quit line:\n{text}"));
    assert!(!quit.contains("export alpha"), "{quit}");
}

/// Log rotation of a `fusex serve` daemon: after the `--log-file` was renamed, SIGUSR2 makes the
/// daemon log to a new file at the path; its exports serve on, and what happens to them next is
/// in the new file.
#[test]
fn sigusr2_reopens_the_daemons_log_file() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("serve-logrotate");
    let log = w.join("fusex.log");
    let rotated = w.join("fusex.log.1");
    let mut serve = Serve::start(w.path(), &["--log-file", log.to_str().unwrap()]);
    let mut q = serve.qmp();
    let a = w.join("alpha.mnt");
    q.add_null_export("alpha", &a, json!({}));
    fs::rename(&log, &rotated).unwrap();
    // SAFETY: kill(2) on the daemon this test started.
    assert_eq!(unsafe { libc::kill(serve.pid(), libc::SIGUSR2) }, 0);
    assert!(
        wait_until(Instant::now() + TIMEOUT, || fs::read_to_string(&log)
            .is_ok_and(|t| t.contains("reopened"))),
        "no new log file after SIGUSR2; the old one says: {}",
        fs::read_to_string(&rotated).unwrap_or_default()
    );
    assert_eq!(fs::metadata(&a).unwrap().len(), 64 << 20, "alpha serves on");
    q.remove_null_export("alpha", "safe");
    q.ok("quit", json!({}));
    assert_eq!(serve.wait(), Some(0));
    let old = fs::read_to_string(&rotated).unwrap();
    let new = fs::read_to_string(&log).unwrap();
    assert!(old.contains("export alpha: mounted "), "{old}");
    assert!(
        old.trim_end().ends_with("SIGUSR2: reopening the log file"),
        "the rotated file's last line says the log moved on: {old}"
    );
    assert!(new.contains("export alpha removed"), "{new}");
    assert!(!new.contains("export alpha: mounted "), "{new}");
}

/// Log rotation signals every process named fusex (`pkill -USR2 -x fusex`): one that has no log
/// file to reopen, here a `fusex ctl` waiting for its daemon's greeting, ignores it and goes on.
#[test]
fn the_log_rotation_signal_spares_a_fusex_ctl() {
    let w = WorkDir::new("serve-usr2-ctl");
    let sock = w.join("quiet.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let ctl = Command::new(fusex_bin())
        .args(["ctl", "--control", sock.to_str().unwrap(), "list"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut ctl = ChildGuard(ctl);
    // Connected, and waiting for a greeting that does not come yet.
    let (conn, _) = listener.accept().unwrap();
    let pid = ctl.0.id() as i32;
    // SAFETY: kill(2) on the child this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGUSR2) }, 0);
    std::thread::sleep(Duration::from_millis(200));
    assert!(pid_alive(pid), "SIGUSR2 ended fusex ctl");
    drop(conn);
    let out = ctl.0.wait().unwrap();
    assert_eq!(
        out.code(),
        Some(1),
        "fusex ctl ends with its own error once the daemon hangs up, not by the signal: {out:?}"
    );
}

/// `--log-format json`: every line of the log is one JSON object, and the lines about one
/// export (its mount, its removal, its end at quit) carry its id as `export`, never another's.
#[test]
fn json_log_lines_name_the_export_they_are_about() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("serve-json-log");
    let log = w.join("fusex.json");
    let log_arg = log.to_str().unwrap();
    let mut serve = Serve::start(w.path(), &["--log-format", "json", "--log-file", log_arg]);
    let mut q = serve.qmp();
    let (a, b) = (w.join("alpha.mnt"), w.join("beta.mnt"));
    q.add_null_export("alpha", &a, json!({}));
    q.add_null_export("beta", &b, json!({}));
    assert_eq!(read_all(&a)[..4096], [0u8; 4096]);
    q.remove_null_export("alpha", "safe");
    assert_eq!(read_all(&b)[..4096], [0u8; 4096]);
    q.ok("quit", json!({}));
    assert_eq!(
        serve.wait(),
        Some(0),
        "{}",
        fs::read_to_string(&log).unwrap()
    );
    let text = fs::read_to_string(&log).unwrap();
    let mut lines = Vec::new();
    for l in text.lines() {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}\n{text}"));
        let o = v
            .as_object()
            .unwrap_or_else(|| panic!("not an object: {l}"));
        for k in ["timestamp", "level", "target", "message"] {
            assert!(o.get(k).is_some_and(|v| v.is_string()), "no {k}: {l}");
        }
        lines.push(v);
    }
    let about = |id: &str| -> Vec<&serde_json::Value> {
        lines.iter().filter(|v| v["export"] == id).collect()
    };
    let message = |v: &serde_json::Value| v["message"].as_str().unwrap().to_string();
    for (id, other) in [("alpha", "beta"), ("beta", "alpha")] {
        let mine = about(id);
        let shown: Vec<String> = mine.iter().map(|v| message(v)).collect();
        // Its mount, its removal (by block-export-del, or by quit) and its end.
        assert!(
            shown
                .iter()
                .any(|m| m.starts_with(&format!("export {id}: ")) && m.contains("mounted")),
            "{id}'s mount line: {shown:?}\n{text}"
        );
        assert!(
            shown.iter().any(|m| m.starts_with("removal: ")),
            "{id}'s removal line: {shown:?}\n{text}"
        );
        assert!(
            shown.iter().any(|m| m.starts_with("served ")),
            "{id}'s served line: {shown:?}\n{text}"
        );
        assert!(
            shown.contains(&format!("export {id} removed")),
            "{id}'s removed line: {shown:?}\n{text}"
        );
        assert!(
            shown.iter().all(|m| !m.contains(other)),
            "{id}'s lines mention {other}: {shown:?}"
        );
        // Every line that names the export in its message carries its id.
        for v in &lines {
            if message(v).contains(&format!("export {id}")) {
                assert_eq!(v["export"], id, "{v}");
            }
        }
    }
    // The daemon's own lines are about no export.
    let quit = lines
        .iter()
        .find(|v| message(v).starts_with("quit: "))
        .unwrap_or_else(|| panic!("no quit line: {text}"));
    assert!(quit.get("export").is_none(), "{quit}");
}

/// A daemon and the mounts under a directory, killed and unmounted when dropped.
struct Daemon(std::process::Child, PathBuf);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        unmount_under(&self.1);
    }
}

/// qemu-storage-daemon's man page launches it with a QMP socket its parent bound and hands over
/// by descriptor (`--chardev socket,fd=N,server=on,id=char1 --monitor chardev=char1`), so that
/// clients need not wait for the daemon to bind: the same command line starts fusex, which
/// serves QMP there with the same answers, removes the socket's file at exit as qsd does, and
/// refuses a descriptor that is not a listening socket in one line.
#[test]
fn a_monitor_socket_handed_over_by_descriptor_serves_qmp() {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    if !require_fuse_and_tools(&["qemu-storage-daemon"]) {
        return;
    }
    let w = WorkDir::new("serve-chardev-fd");
    let fusex = fusex_bin().display().to_string();
    let programs = [
        ("qsd", vec!["qemu-storage-daemon"]),
        ("fusex", vec![fusex.as_str(), "serve"]),
    ];
    // Runs PROGRAM with `fd` inherited and named by the chardev.
    let launch = |program: &[&str], fd: i32, log: &Path| {
        let mut cmd = Command::new(program[0]);
        cmd.args(&program[1..])
            .args([
                "--chardev",
                &format!("socket,fd={fd},server=on,id=char1"),
                "--monitor",
                "chardev=char1",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(log).unwrap());
        // SAFETY: only fcntl, async-signal-safe, between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd.spawn().expect("starting the daemon")
    };
    let mut answers = Vec::new();
    for (name, program) in &programs {
        let sock = w.join(format!("{name}.sock"));
        let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let log = w.join(format!("{name}.log"));
        let mut d = Daemon(launch(program, listener.as_raw_fd(), &log), w.join(name));
        drop(listener);
        fs::create_dir_all(&d.1).unwrap();
        // Connected at once: the socket listens before the daemon runs.
        let mut q = Qmp::connect(&sock);
        let mp = d.1.join("n.mnt");
        q.add_null_export("e", &mp, json!({}));
        let size = fs::metadata(&mp).unwrap().len();
        let listed = q.ok("query-block-exports", json!({}));
        q.remove_null_export("e", "safe");
        q.ok("quit", json!({}));
        let status = wait_timeout(&mut d.0, TIMEOUT).expect("the daemon exits after quit");
        assert!(
            status.success(),
            "{name}: {status}: {}",
            fs::read_to_string(&log).unwrap_or_default()
        );
        answers.push((size, listed, sock.exists()));
    }
    assert_eq!(
        answers[0], answers[1],
        "qemu-storage-daemon and fusex differ"
    );
    // A descriptor that is not a listening socket: refused in one line, nothing served.
    let file = fs::File::open("/dev/null").unwrap();
    let log = w.join("bad.log");
    let mut child = launch(
        &["fusex", "serve"].map(|a| if a == "fusex" { fusex.as_str() } else { a }),
        file.as_raw_fd(),
        &log,
    );
    let status = wait_timeout(&mut child, TIMEOUT).expect("refused at once");
    let text = fs::read_to_string(&log).unwrap();
    assert!(!status.success());
    assert!(
        text.contains(&format!("fd={}", file.as_raw_fd())) && text.contains("listening"),
        "{text}"
    );
}

/// qemu-storage-daemon's man page example, word for word with only the program name changed:
/// a qcow2 image exported through FUSE on itself, so that the file appears raw while the export
/// is active. Its guest bytes read as `qemu-img` reads them, a write lands in the image, and once
/// the daemon is stopped the file is the qcow2 image again, consistent (`qemu-img check`) and
/// holding the write; qemu-storage-daemon gives the same answers.
#[test]
fn the_man_page_export_of_an_image_on_itself() {
    use std::os::unix::fs::FileExt;
    if !require_fuse_and_tools(&["qemu-storage-daemon", "qemu-img", "qemu-io"]) {
        return;
    }
    let w = WorkDir::new("serve-on-itself");
    let fusex = fusex_bin().display().to_string();
    let mut seen = Vec::new();
    for (name, program) in [
        ("qsd", vec!["qemu-storage-daemon"]),
        ("fusex", vec![fusex.as_str(), "serve"]),
    ] {
        let dir = w.join(name);
        fs::create_dir_all(&dir).unwrap();
        let img = dir.join("disk.qcow2");
        run_ok(
            Command::new("qemu-img")
                .args(["create", "-q", "-f", "qcow2"])
                .arg(&img)
                .arg("8M"),
        );
        run_ok(
            Command::new("qemu-io")
                .args(["-f", "qcow2", "-c", "write -P 0x5a 1M 64k"])
                .arg(&img),
        );
        let log = dir.join("daemon.log");
        let child = Command::new(program[0])
            .args(&program[1..])
            .args([
                "--blockdev",
                "driver=file,node-name=file,filename=disk.qcow2",
                "--blockdev",
                "driver=qcow2,node-name=qcow2,file=file",
                "--export",
                "type=fuse,id=export,node-name=qcow2,mountpoint=disk.qcow2,writable=on",
            ])
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .expect("starting the daemon");
        let mut d = Daemon(child, dir.clone());
        let up = wait_until(Instant::now() + TIMEOUT, || {
            !fuse_mounts_at(&img).is_empty()
        });
        assert!(
            up,
            "{name}: not mounted: {}",
            fs::read_to_string(&log).unwrap()
        );
        let size = fs::metadata(&img).unwrap().len();
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&img)
            .unwrap();
        let mut buf = vec![0u8; 128 << 10];
        f.read_exact_at(&mut buf, 1 << 20).unwrap();
        let read = (
            buf[..64 << 10].iter().all(|&b| b == 0x5a),
            buf[64 << 10..].iter().all(|&b| b == 0),
        );
        f.write_all_at(&[0xc3; 4096], 4 << 20).unwrap();
        f.sync_all().unwrap();
        drop(f);
        send_signal(d.0.id() as i32, libc::SIGTERM);
        let status = wait_timeout(&mut d.0, TIMEOUT).expect("the daemon exits on SIGTERM");
        assert!(fuse_mounts_at(&img).is_empty(), "{name}: still mounted");
        run_ok(
            Command::new("qemu-img")
                .args(["check", "-q", "-f", "qcow2"])
                .arg(&img),
        );
        let back = run_ok(
            Command::new("qemu-io")
                .args([
                    "-f",
                    "qcow2",
                    "-c",
                    "read -P 0xc3 4M 4k",
                    "-c",
                    "read -P 0x5a 1M 64k",
                ])
                .arg(&img),
        );
        let back = String::from_utf8_lossy(&back.stdout).contains("Pattern verification failed");
        seen.push((size, read, status.code(), back));
    }
    assert_eq!(seen[0], seen[1], "qemu-storage-daemon and fusex differ");
    assert_eq!(seen[1], (8 << 20, (true, true), Some(0), false));
}

/// A backing chain given as nodes, inline (how libvirt builds one): a writable qcow2 export
/// whose header names a file that does not exist serves the chain its nodes name (a qcow2 mid
/// image whose own header names a decoy, over a raw base), as QEMU reads the same chain; a
/// `fusex restart` keeps serving it; removing the top node removes the nodes it made inline;
/// and the writes are in the top image alone.
#[test]
fn a_backing_chain_of_inline_nodes_serves_and_survives_a_restart() {
    if !require_fuse_and_tools(&["qemu-img", "qemu-io"]) {
        return;
    }
    let w = WorkDir::new("serve-backing");
    let (top, mid, base) = (w.join("top.qcow2"), w.join("mid.qcow2"), w.join("base.raw"));
    random_image(&base, 4 * MIB, 41);
    random_image(&w.join("decoy.raw"), 4 * MIB, 42);
    let qemu = |args: &[&str]| {
        run_ok(Command::new(args[0]).current_dir(w.path()).args(&args[1..]));
    };
    qemu(&[
        "qemu-img",
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "decoy.raw",
        "-F",
        "raw",
        "mid.qcow2",
    ]);
    qemu(&[
        "qemu-io",
        "-f",
        "qcow2",
        "-c",
        "write -P 0x5c 1M 100k",
        "mid.qcow2",
    ]);
    qemu(&[
        "qemu-img",
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "mid.qcow2",
        "-F",
        "qcow2",
        "top.qcow2",
    ]);
    qemu(&[
        "qemu-io",
        "-f",
        "qcow2",
        "-c",
        "write -P 0x6d 3M 8k",
        "top.qcow2",
    ]);
    qemu(&[
        "qemu-img",
        "rebase",
        "-q",
        "-u",
        "-b",
        "gone.qcow2",
        "-F",
        "qcow2",
        "top.qcow2",
    ]);
    let file = |p: &Path| json!({"driver": "file", "filename": p.to_str().unwrap()});
    let chain = json!({"driver": "qcow2", "node-name": "top", "file": file(&top),
        "backing": {"driver": "qcow2", "file": file(&mid),
                    "backing": {"driver": "raw", "file": file(&base)}}});
    // QEMU reads the same chain: the oracle.
    let oracle = |out: &str| {
        let mut spec = chain.clone();
        spec.as_object_mut().unwrap().remove("node-name");
        qemu(&[
            "qemu-img",
            "convert",
            "-U",
            "-O",
            "raw",
            &format!("json:{spec}"),
            out,
        ]);
        fs::read(w.join(out)).unwrap()
    };
    let mut model = oracle("before.raw");
    let backing_files = [fs::read(&mid).unwrap(), fs::read(&base).unwrap()];
    let mp = w.join("top.raw");
    fs::write(&mp, b"").unwrap();
    let pid_file = w.join("serve.pid");
    let mut serve = Serve::start(w.path(), &["--pidfile", pid_file.to_str().unwrap()]);
    let _guard = PidGuard(pid_file.clone(), w.path().to_path_buf());
    let mut q = serve.qmp();
    q.ok("blockdev-add", chain.clone());
    let e = q.err(
        "block-export-add",
        json!({"type": "fuse", "id": "t", "node-name": "top", "mountpoint": mp.to_str().unwrap(),
               "__org.fusex_backing": "raw:/etc/passwd"}),
    );
    assert!(e.contains("not an export member"), "{e}");
    // IOThread objects go across a restart, and so does the one the export names.
    for io in ["io1", "io2"] {
        q.ok("object-add", json!({"qom-type": "iothread", "id": io}));
    }
    q.ok(
        "block-export-add",
        json!({"type": "fuse", "id": "t", "node-name": "top", "writable": true,
               "mountpoint": mp.to_str().unwrap(), "__org.fusex_transport": "legacy",
               "iothread": "io1"}),
    );
    let in_use = |q: &mut Qmp| {
        let e = q.err("object-del", json!({"id": "io1"}));
        assert!(e.contains("in use") && e.contains("export 't'"), "{e}");
    };
    in_use(&mut q);
    assert_bytes_eq(&read_all(&mp), &model, 0, "the chain of nodes");
    let f = open_rw(&mp);
    for (off, byte) in [(MIB - 100, 0x71u8), (2 * MIB, 0x72), (4 * MIB - 512, 0x73)] {
        let data = vec![byte; 4096.min((4 * MIB - off) as usize)];
        f.write_all_at(&data, off).unwrap();
        model[off as usize..off as usize + data.len()].copy_from_slice(&data);
    }
    f.sync_all().unwrap();
    drop(q);
    let new = serve.restart(&w, &mp, &pid_file);
    f.write_all_at(&[0x74; 4096], 0).unwrap();
    model[..4096].fill(0x74);
    f.sync_all().unwrap();
    drop(f);
    assert_bytes_eq(&read_all(&mp), &model, 0, "the chain after the restart");
    let mut q = Qmp::connect(&serve.socket);
    let nodes = q.ok("query-named-block-nodes", json!({}));
    let depth = nodes
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node-name"] == "top")
        .map(|n| n["backing_file_depth"].clone());
    assert_eq!(depth, Some(json!(2)), "{nodes}");
    in_use(&mut q);
    q.ok("object-del", json!({"id": "io2"}));
    q.ok("block-export-del", json!({"id": "t"}));
    q.event("BLOCK_EXPORT_DELETED", "t", TIMEOUT);
    q.ok("object-del", json!({"id": "io1"}));
    q.ok("blockdev-del", json!({"node-name": "top"}));
    assert_eq!(
        q.ok("query-named-block-nodes", json!({})),
        json!([]),
        "the nodes made inline go with the top node"
    );
    q.ok("quit", json!({}));
    assert!(wait_until(Instant::now() + TIMEOUT * 3, || !pid_alive(new)));
    assert_bytes_eq(
        &oracle("after.raw"),
        &model,
        0,
        "QEMU reads the writes through the chain",
    );
    assert_eq!(
        [fs::read(&mid).unwrap(), fs::read(&base).unwrap()],
        backing_files,
        "[mid, base] must be unchanged"
    );
}

/// qemu-storage-daemon's way to an NBD server over TLS runs unchanged: the same command line
/// (`--object tls-creds-x509` and an `nbd` node's `tls-creds`) serves the same bytes from a
/// qemu-nbd that asks for a client certificate, in qemu-storage-daemon and in fusex, and the
/// same mistakes over QMP get the same answers from both. fusex's daemon then hands its export
/// to a `fusex restart` successor, which adds the node again with the credentials it names.
#[test]
fn tls_credentials_objects_reach_an_nbd_server_as_in_qemu_storage_daemon() {
    if !require_fuse_and_tools(&["qemu-storage-daemon", "qemu-nbd", "openssl"]) {
        return;
    }
    let w = WorkDir::new("serve-tls-creds");
    let pki = w.join("pki");
    make_pki(&pki, "fusex-serve-ca");
    let mut answers = Vec::new();
    for program in [
        "qemu-storage-daemon".to_string(),
        fusex_bin().display().to_string(),
    ] {
        let who = if answers.is_empty() { "qsd" } else { "fusex" };
        let dir = w.join(who);
        fs::create_dir(&dir).unwrap();
        let img = dir.join("img.raw");
        let mut expected = random_image(&img, 4 * MIB, 61);
        let sock = dir.join("nbd.sock");
        let server_creds = format!(
            "tls-creds-x509,id=tls0,dir={},endpoint=server,verify-peer=on",
            pki.display()
        );
        let mut server = qemu_nbd(
            &sock,
            &[
                "-f",
                "raw",
                "--object",
                &server_creds,
                "--tls-creds",
                "tls0",
            ],
            &img,
        );
        let mp = dir.join("e.mnt");
        fs::write(&mp, b"").unwrap();
        let qmp = dir.join("qmp.sock");
        let pid_file = dir.join("daemon.pid");
        let mut cmd = Command::new(&program);
        if who == "fusex" {
            cmd.arg("serve");
        }
        cmd.arg("--object")
            .arg(format!(
                "tls-creds-x509,id=t0,dir={},endpoint=client",
                pki.display()
            ))
            .arg("--blockdev")
            .arg(format!(
                "driver=nbd,node-name=n0,server.type=unix,server.path={},tls-creds=t0,\
                 tls-hostname=localhost",
                sock.display()
            ))
            .args(["--blockdev", "driver=raw,node-name=r0,file=n0"])
            .arg("--export")
            .arg(format!(
                "type=fuse,id=e0,node-name=r0,mountpoint={},writable=on",
                mp.display()
            ))
            .arg("--chardev")
            .arg(format!(
                "socket,id=m,path={},server=on,wait=off",
                qmp.display()
            ))
            .args(["--monitor", "chardev=m"])
            .arg("--pidfile")
            .arg(&pid_file)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut daemon = ChildGuard(cmd.spawn().unwrap());
        let _unmount = UnmountOnDrop(mp.clone());
        // Stops a `fusex restart` successor, which is no child of this test.
        let _successor = PidGuard(pid_file.clone(), dir.clone());
        assert!(
            wait_until(Instant::now() + TIMEOUT * 3, || is_fuse_mounted(&mp)
                && qmp.exists()),
            "{who}: the export over TLS never served"
        );
        assert_bytes_eq(&read_all(&mp), &expected, 0, &format!("{who}: over TLS"));
        let f = fs::OpenOptions::new().write(true).open(&mp).unwrap();
        f.write_all_at(&[0x5e; 8192], MIB).unwrap();
        f.sync_all().unwrap();
        drop(f);
        expected[MIB as usize..MIB as usize + 8192].fill(0x5e);
        let mut q = Qmp::connect(&qmp);
        let pki_s = pki.to_str().unwrap();
        let addr = json!({"type": "unix", "path": sock.to_str().unwrap()});
        let mut got = Vec::new();
        for (cmd, args) in [
            (
                "object-add",
                json!({"qom-type": "tls-creds-x509", "id": "t9", "dir": "/nonexistent"}),
            ),
            (
                "object-add",
                json!({"qom-type": "tls-creds-x509", "id": "t9", "dir": pki_s,
                       "endpoint": "sideways"}),
            ),
            (
                "object-add",
                json!({"qom-type": "tls-creds-x509", "id": "t9"}),
            ),
            (
                "object-add",
                json!({"qom-type": "tls-creds-x509", "id": "ts", "dir": pki_s,
                       "endpoint": "server"}),
            ),
            ("object-add", json!({"qom-type": "iothread", "id": "io0"})),
            (
                "blockdev-add",
                json!({"driver": "nbd", "node-name": "n9", "server": addr,
                       "tls-creds": "nope"}),
            ),
            (
                "blockdev-add",
                json!({"driver": "nbd", "node-name": "n9", "server": addr,
                       "tls-creds": "io0"}),
            ),
            (
                "blockdev-add",
                json!({"driver": "nbd", "node-name": "n9", "server": addr,
                       "tls-creds": "ts"}),
            ),
        ] {
            got.push(json!({"cmd": cmd, "answer": match q.execute(cmd, args) {
                Ok(v) => json!({"return": v}),
                Err((class, desc)) => json!({"class": class, "desc": desc}),
            }}));
        }
        let mut last = daemon.pid();
        if who == "fusex" {
            // A `fusex restart` successor adds the node again with the credentials it names
            // (an io_uring export cannot be handed over: the export goes over to legacy first).
            q.ok("block-export-del", json!({"id": "e0"}));
            q.event("BLOCK_EXPORT_DELETED", "e0", TIMEOUT);
            q.ok(
                "block-export-add",
                json!({"type": "fuse", "id": "e1", "node-name": "r0", "writable": true,
                       "mountpoint": mp.to_str().unwrap(),
                       "__org.fusex_transport": "legacy"}),
            );
            drop(q);
            let r = run_fusex(&w, &["restart".as_ref(), mp.as_os_str()], None);
            assert_eq!(r.code, Some(0), "fusex restart: {}", r.stderr);
            assert!(
                wait_until(Instant::now() + TIMEOUT * 3, || daemon
                    .0
                    .try_wait()
                    .unwrap()
                    .is_some()),
                "the old daemon lets go and exits"
            );
            last = read_pid(&pid_file);
            assert!(last > 0 && pid_alive(last), "the successor serves");
            q = Qmp::connect(&qmp);
            assert_bytes_eq(&read_all(&mp), &expected, 0, "over TLS after the restart");
            let e = q.err("object-del", json!({"id": "t0"}));
            assert!(e.contains("in use") && e.contains("node 'n0'"), "{e}");
        }
        q.ok("quit", json!({}));
        assert!(
            wait_until(Instant::now() + TIMEOUT * 3, || !pid_alive(last)
                && daemon.0.try_wait().unwrap().is_some()),
            "{who}: quit did not end it"
        );
        assert!(!is_fuse_mounted(&mp), "{who} left the export mounted");
        server.kill_and_wait();
        assert_bytes_eq(
            &read_all(&img),
            &expected,
            0,
            &format!("{who}: the image behind qemu-nbd"),
        );
        answers.push(got);
    }
    assert_eq!(
        answers[0], answers[1],
        "qemu-storage-daemon (left) and fusex (right) answer differently"
    );
}
