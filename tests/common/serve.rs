//! A `fusex serve` daemon under test ([`Serve`], which stops it and unmounts whatever it left
//! in its work directory when dropped) and a small QMP client ([`Qmp`]) that keeps the events it
//! reads past.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::{
    fuse_mounts_at, fusex_bin, mountinfo, pid_alive, run_fusex, send_signal, wait_timeout,
    wait_until, WorkDir, TIMEOUT,
};

/// A running `fusex serve`, its control socket at `socket`.
pub struct Serve {
    pub child: Option<Child>,
    pub socket: PathBuf,
    /// Its mounts are under here; every one is unmounted when the guard drops.
    dir: PathBuf,
    /// Where its log goes.
    pub log: PathBuf,
}

impl Serve {
    /// Starts `fusex serve --control DIR/qmp.sock EXTRA...` and waits for the socket.
    pub fn start(dir: &Path, extra: &[&str]) -> Serve {
        let socket = dir.join("qmp.sock");
        let log = dir.join("serve.log");
        let child = Command::new(fusex_bin())
            .arg("serve")
            .arg("--control")
            .arg(&socket)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("starting fusex serve");
        let mut s = Serve {
            child: Some(child),
            socket,
            dir: dir.to_path_buf(),
            log,
        };
        let deadline = Instant::now() + TIMEOUT;
        while UnixStream::connect(&s.socket).is_err() {
            if let Some(st) = s.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!("fusex serve exited ({st}) before serving: {}", s.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "no control socket: {}",
                s.log_text()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        s
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A new QMP client in command mode.
    pub fn qmp(&self) -> Qmp {
        Qmp::connect(&self.socket)
    }

    /// Waits for the daemon to exit; its exit code.
    pub fn wait(&mut self) -> Option<i32> {
        let mut c = self.child.take()?;
        let st = wait_timeout(&mut c, TIMEOUT * 3);
        if st.is_none() {
            let _ = c.kill();
            let _ = c.wait();
            panic!("fusex serve did not exit: {}", self.log_text());
        }
        st.and_then(|s| s.code())
    }
}

/// The pid a pid file names (0 when it names none).
pub fn read_pid(pid_file: &Path) -> i32 {
    std::fs::read_to_string(pid_file)
        .unwrap_or_default()
        .trim()
        .parse()
        .unwrap_or(0)
}

/// Stops the daemon its pid file (the first path) names when dropped, then unmounts whatever
/// is left under the second: a `fusex restart` successor is no child of the test, so no
/// [`Serve`] guard stops it.
pub struct PidGuard(pub PathBuf, pub PathBuf);

impl Drop for PidGuard {
    fn drop(&mut self) {
        let pid = read_pid(&self.0);
        if pid > 0 {
            send_signal(pid, libc::SIGINT);
            if !wait_until(Instant::now() + TIMEOUT, || !pid_alive(pid)) {
                send_signal(pid, libc::SIGKILL);
            }
        }
        unmount_under(&self.1);
    }
}

impl Serve {
    /// `fusex restart` through the export at `mp`, which must succeed: this daemon exits 0
    /// once it let go, and the successor, alive, names itself in `pid_file`. Its pid.
    pub fn restart(&mut self, w: &WorkDir, mp: &Path, pid_file: &Path) -> i32 {
        let old = self.pid();
        let r = run_fusex(w, &["restart".as_ref(), mp.as_os_str()], None);
        assert_eq!(r.code, Some(0), "fusex restart failed: {}", r.stderr);
        assert_eq!(self.wait(), Some(0), "the old daemon exits once it let go");
        let new = read_pid(pid_file);
        assert!(
            new > 0 && new != old && pid_alive(new),
            "the successor ({new}, was {old}) names itself in the pid file"
        );
        new
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            send_signal(c.id() as i32, libc::SIGTERM);
            if wait_timeout(&mut c, TIMEOUT).is_none() {
                eprintln!(
                    "harness: fusex serve (pid {}) in {} did not exit within {TIMEOUT:?} of \
                     SIGTERM: killed",
                    c.id(),
                    self.dir.display()
                );
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        unmount_under(&self.dir);
    }
}

/// Lazily unmounts every FUSE mount under `dir`.
pub fn unmount_under(dir: &Path) {
    for m in mountinfo() {
        let p = m.mount_point;
        if p.starts_with(dir) && !fuse_mounts_at(&p).is_empty() {
            let _ = Command::new("umount").arg("-l").arg(&p).output();
        }
    }
}

/// A QMP client: one request at a time, events kept until asked for.
pub struct Qmp {
    out: UnixStream,
    lines: BufReader<UnixStream>,
    events: VecDeque<Value>,
}

impl Qmp {
    /// Connects, reads the greeting and negotiates.
    pub fn connect(path: &Path) -> Qmp {
        let s = UnixStream::connect(path).expect("connecting to the control socket");
        s.set_read_timeout(Some(TIMEOUT * 3)).unwrap();
        let mut q = Qmp {
            out: s.try_clone().unwrap(),
            lines: BufReader::new(s),
            events: VecDeque::new(),
        };
        let greeting = q.read().expect("greeting");
        assert!(greeting.get("QMP").is_some(), "greeting: {greeting}");
        q.ok("qmp_capabilities", json!({}));
        q
    }

    /// The next message; None at EOF.
    pub fn read(&mut self) -> Option<Value> {
        let mut line = String::new();
        match self.lines.read_line(&mut line) {
            Ok(0) => None,
            Ok(_) => Some(serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))),
            Err(e) => panic!("reading QMP: {e}"),
        }
    }

    /// Sends raw bytes (for malformed input).
    pub fn send_raw(&mut self, bytes: &[u8]) {
        self.out.write_all(bytes).expect("writing QMP");
    }

    /// The next reply, keeping the events before it.
    pub fn reply(&mut self) -> Value {
        loop {
            let m = self.read().expect("the daemon closed the connection");
            if m.get("event").is_some() {
                self.events.push_back(m);
            } else {
                return m;
            }
        }
    }

    /// Runs a command: `Ok(return)` or `Err((class, desc))`.
    pub fn execute(&mut self, cmd: &str, args: Value) -> Result<Value, (String, String)> {
        let req = json!({"execute": cmd, "arguments": args});
        self.send_raw(format!("{req}\n").as_bytes());
        let r = self.reply();
        if let Some(v) = r.get("return") {
            return Ok(v.clone());
        }
        let e = &r["error"];
        Err((
            e["class"].as_str().unwrap_or_default().to_string(),
            e["desc"].as_str().unwrap_or_default().to_string(),
        ))
    }

    /// Runs a command that must succeed.
    pub fn ok(&mut self, cmd: &str, args: Value) -> Value {
        self.execute(cmd, args.clone())
            .unwrap_or_else(|e| panic!("{cmd} {args}: {e:?}"))
    }

    /// Runs a command that must fail; its error text.
    pub fn err(&mut self, cmd: &str, args: Value) -> String {
        match self.execute(cmd, args.clone()) {
            Ok(v) => panic!("{cmd} {args} succeeded ({v}) but should fail"),
            Err((_, desc)) => desc,
        }
    }

    /// Waits until a queue of export `id` has taken a request and not answered it yet
    /// (`__org.fusex_query-stats` counts it in flight); whether one did within [`TIMEOUT`].
    /// A request still queued in the kernel is not one a removal waits for or fails.
    pub fn wait_in_flight(&mut self, id: &str) -> bool {
        wait_until(Instant::now() + TIMEOUT, || {
            let s = self.ok("__org.fusex_query-stats", json!({ "id": id }));
            s["exports"][0]["in_flight"].as_u64().unwrap_or(0) >= 1
        })
    }

    /// Waits for event `name` whose data's `id` is `id`; the event.
    pub fn event(&mut self, name: &str, id: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(i) = self
                .events
                .iter()
                .position(|e| e["event"] == name && e["data"]["id"] == id)
            {
                return self.events.remove(i).unwrap_or_default();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no {name} for {id} within {timeout:?}");
            self.out.set_read_timeout(Some(left)).unwrap();
            let m = self.read().expect("the daemon closed the connection");
            self.events.push_back(m);
        }
    }

    /// The events received so far and not yet waited for.
    pub fn pending_events(&self) -> Vec<Value> {
        self.events.iter().cloned().collect()
    }

    /// Adds a null-co node and a read-only fuse export of it at `mountpoint` (created).
    pub fn add_null_export(&mut self, id: &str, mountpoint: &Path, extra: Value) {
        std::fs::write(mountpoint, b"").unwrap();
        self.ok(
            "blockdev-add",
            json!({"driver": "null-co", "node-name": format!("n-{id}"), "size": 64 << 20}),
        );
        let mut args = json!({"type": "fuse", "id": id, "node-name": format!("n-{id}"),
                              "mountpoint": mountpoint});
        if let (Some(a), Value::Object(e)) = (args.as_object_mut(), extra) {
            a.extend(e);
        }
        self.ok("block-export-add", args);
    }

    /// Adds a raw node over the image file `image` (node name `id`) and a writable fuse export
    /// of it at `mountpoint` (which must exist), with `extra` export arguments.
    pub fn add_raw_export(&mut self, id: &str, image: &Path, mountpoint: &Path, extra: Value) {
        self.ok(
            "blockdev-add",
            json!({"driver": "raw", "node-name": id,
                   "file": {"driver": "file", "filename": image}}),
        );
        let mut args = json!({"type": "fuse", "id": id, "node-name": id,
                              "mountpoint": mountpoint, "writable": true});
        if let (Some(a), Value::Object(e)) = (args.as_object_mut(), extra) {
            a.extend(e);
        }
        self.ok("block-export-add", args);
    }

    /// Removes an export (`mode`), waits until it is gone, and removes its null node.
    pub fn remove_null_export(&mut self, id: &str, mode: &str) {
        self.ok("block-export-del", json!({"id": id, "mode": mode}));
        self.event("BLOCK_EXPORT_DELETED", id, TIMEOUT);
        self.ok("blockdev-del", json!({"node-name": format!("n-{id}")}));
    }
}
