//! End-to-end: QEMU's own QMP client library (`qemu.qmp`, from the venv `scripts/deps.sh` makes
//! at `target/qmp-venv`) against the `qmp_demo` example, and the same protocol-level checks
//! against qemu-storage-daemon when it is installed, compared key by key.
//!
//! Without Python and `qemu.qmp` (or without qemu-storage-daemon) these tests skip with a
//! message, except under `CI=true`, where `scripts/deps.sh` installs both and a missing one is a
//! failure.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

fn skip_or_fail(what: &str) {
    if ci() {
        panic!("{what} (CI=true: run scripts/deps.sh, which installs it)");
    }
    eprintln!("SKIPPED: {what} (run scripts/deps.sh)");
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The venv's Python, if it has qemu.qmp (`FUSEX_QMP_PYTHON` overrides the path).
fn python() -> Option<PathBuf> {
    let py = std::env::var_os("FUSEX_QMP_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/qmp-venv/bin/python3"));
    let ok = Command::new(&py)
        .args(["-c", "import qemu.qmp"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    ok.then_some(py)
}

/// `qmp_demo`, which `cargo test` builds beside the test binaries (`target/PROFILE/examples`).
fn demo_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/PROFILE");
    let demo = profile_dir.join("examples/qmp_demo");
    assert!(
        demo.exists(),
        "{} is missing: run `cargo test -p fusex-qmp` (it builds the examples)",
        demo.display()
    );
    demo
}

fn wait_for_socket(path: &Path, child: &mut Child) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !path.exists() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("server exited before creating {}: {status}", path.display());
        }
        assert!(
            Instant::now() < deadline,
            "no socket at {} after 10 s",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs the check script; returns its JSON report (it asserts its own expectations).
fn run_script(py: &Path, args: &[&str]) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/qmp_client.py");
    let mut child = Command::new(py)
        .arg(&script)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python");
    let pipe = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            v
        })
    };
    let stdout = pipe(Box::new(child.stdout.take().unwrap()));
    let stderr = pipe(Box::new(child.stderr.take().unwrap()));
    // A hung script fails the test instead of hanging it.
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = std::process::Output {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    };
    assert!(
        out.status.success(),
        "qmp_client.py {args:?} failed: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the script prints JSON")
}

/// Kills a child on drop, so a failed assertion leaves no daemon behind.
struct Reap(Child);
impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn run_demo(py: &Path) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("demo.sock");
    let mut child = Reap(
        Command::new(demo_binary())
            .arg(&sock)
            .spawn()
            .expect("start qmp_demo"),
    );
    wait_for_socket(&sock, &mut child.0);
    let report = run_script(py, &["--demo", sock.to_str().unwrap()]);
    // The script ends with `quit`: the demo exits by itself and removes its socket.
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(s) = child.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "qmp_demo still runs 5 s after quit"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(status.success(), "qmp_demo: {status}");
    assert!(!sock.exists(), "the socket outlived the server");
    report
}

#[test]
fn qemu_qmp_client_against_demo() {
    let Some(py) = python() else {
        return skip_or_fail("no Python with qemu.qmp at target/qmp-venv");
    };
    let report = run_demo(&py);
    // fusex's own answers, where the QEMU comparison cannot pin them (the greeting's values).
    assert_eq!(
        report["negotiation: success"],
        serde_json::json!({"return": {}, "id": "neg"})
    );
    assert_eq!(report["query-version"]["same as greeting"], true);
}

#[test]
fn same_answers_as_qemu_storage_daemon() {
    let Some(py) = python() else {
        return skip_or_fail("no Python with qemu.qmp at target/qmp-venv");
    };
    let qsd_ok = Command::new("qemu-storage-daemon")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !qsd_ok {
        return skip_or_fail("qemu-storage-daemon is not installed");
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("qsd.sock");
    let chardev = format!("socket,path={},server=on,wait=off,id=qmp0", sock.display());
    let mut qsd = Reap(
        Command::new("qemu-storage-daemon")
            .args(["--chardev", &chardev, "--monitor", "chardev=qmp0"])
            .stdout(Stdio::null())
            .spawn()
            .expect("start qemu-storage-daemon"),
    );
    wait_for_socket(&sock, &mut qsd.0);
    let theirs = run_script(&py, &[sock.to_str().unwrap()]);
    drop(qsd);
    let ours = run_demo(&py);

    let (Value::Object(theirs), Value::Object(ours)) = (theirs, ours) else {
        panic!("reports are objects")
    };
    let mut diffs = Vec::new();
    for (key, want) in &theirs {
        match ours.get(key) {
            Some(got) if got == want => {}
            got => diffs.push(format!(
                "{key}:\n  qemu-storage-daemon: {want}\n  fusex: {}",
                got.unwrap_or(&Value::Null)
            )),
        }
    }
    assert_eq!(
        theirs.len(),
        ours.len(),
        "both reports have the same checks"
    );
    assert!(
        diffs.is_empty(),
        "fusex answers differently from qemu-storage-daemon:\n{}",
        diffs.join("\n")
    );
}
