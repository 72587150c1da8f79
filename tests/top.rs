//! `fusex top` against a real `fusex serve` with one busy and one idle export: `--once --json`
//! and `--once` for scripts, and the live view on a real terminal (tmux's, 80×24), read back
//! from the screen: the busy export's line with its rate, nothing past 80 columns, the keys, and
//! the terminal given back on every way out (q, SIGTERM, the daemon going away).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use fusex_e2e::*;
use serde_json::{json, Value};

/// An id long enough that the table fills exactly 80 columns (the ID column takes what the
/// numbers leave), so the last column's survival is checked too.
const IDLE: &str = "idle-export-with-a-long-name";

/// A daemon with two writable raw exports, `busy` and [`IDLE`], and their mountpoints.
fn two_exports(w: &WorkDir) -> (Serve, PathBuf, PathBuf) {
    let serve = Serve::start(w.path(), &[]);
    let mut q = serve.qmp();
    let mut mounts = Vec::new();
    for id in ["busy", IDLE] {
        let img = w.join(format!("{id}.img"));
        sparse_image(&img, 64 * MIB);
        let mp = w.join(format!("{id}.mnt"));
        std::fs::write(&mp, b"").unwrap();
        q.add_raw_export(id, &img, &mp, json!({}));
        mounts.push(mp);
    }
    let idle = mounts.pop().unwrap();
    (serve, mounts.pop().unwrap(), idle)
}

fn top(socket: &Path, args: &[&str]) -> Output {
    let out = Command::new(fusex_bin())
        .arg("top")
        .arg("--control")
        .arg(socket)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("running fusex top");
    assert!(
        out.status.success(),
        "fusex top {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn export<'a>(doc: &'a Value, id: &str) -> &'a Value {
    doc["exports"]
        .as_array()
        .and_then(|l| l.iter().find(|e| e["id"] == id))
        .unwrap_or_else(|| panic!("no {id} in {doc}"))
}

/// `--once --json` over an interval of verified fio writes: the busy export has requests and a
/// rate, the idle one none; every figure is a non-negative number, the interval's counts within
/// the totals, the percentiles in order. `--once` prints the same as a table in 80 columns.
#[test]
fn once_json_shows_the_busy_export_and_not_the_idle_one() {
    if !require_fuse_and_tools(&["fio"]) {
        return;
    }
    let w = WorkDir::new("top-once");
    let (serve, busy, _idle) = two_exports(&w);
    let mut fio = spawn_fio(
        &w,
        &busy,
        &[
            "--name=busy",
            "--rw=randwrite",
            "--bs=4k",
            "--ioengine=libaio",
            "--iodepth=8",
            "--size=16M",
            "--time_based",
            "--runtime=4",
            "--verify=crc32c",
            "--verify_backlog=64",
            "--verify_fatal=1",
        ],
        1,
    );
    let out = top(&serve.socket, &["--once", "--json"]);
    let doc: Value = serde_json::from_slice(&out.stdout).expect("--once --json prints JSON");
    let table = top(&serve.socket, &["--once", "--sort", "id"]);
    let status = wait_timeout(&mut fio.0, TIMEOUT * 3).expect("fio ended");
    assert!(status.success(), "fio with verification failed ({status})");

    assert!(doc["interval_s"].as_f64().unwrap() > 0.0, "{doc}");
    assert_eq!(doc["exports"].as_array().unwrap().len(), 2, "{doc}");
    for e in doc["exports"].as_array().unwrap() {
        for k in [
            "iops",
            "read_iops",
            "write_iops",
            "read_mbps",
            "write_mbps",
            "in_flight",
            "errors",
            "errors_total",
            "requests",
            "requests_total",
        ] {
            let v = e[k].as_f64().unwrap_or_else(|| panic!("{k} of {e}"));
            assert!(v >= 0.0, "{k} of {e}");
        }
        assert!(
            e["requests"].as_u64() <= e["requests_total"].as_u64(),
            "{e}"
        );
        assert!(e["errors"].as_u64() <= e["errors_total"].as_u64(), "{e}");
        if let (Some(p50), Some(p99), Some(p999)) = (
            e["p50_us"].as_f64(),
            e["p99_us"].as_f64(),
            e["p999_us"].as_f64(),
        ) {
            assert!(p50 > 0.0 && p50 <= p99 && p99 <= p999, "{e}");
        }
    }
    let (b, i) = (export(&doc, "busy"), export(&doc, IDLE));
    assert!(b["iops"].as_f64().unwrap() > 0.0, "{b}");
    assert!(b["write_iops"].as_f64().unwrap() > 0.0, "{b}");
    assert!(b["write_mbps"].as_f64().unwrap() > 0.0, "{b}");
    assert!(!b["p99_us"].is_null(), "requests were timed: {b}");
    assert_eq!(i["iops"].as_f64(), Some(0.0), "{i}");
    assert_eq!(i["errors"].as_u64(), Some(0), "{i}");
    assert!(i["p50_us"].is_null(), "{i}");
    assert!(b["requests"].as_u64() > i["requests"].as_u64(), "{b} {i}");

    let text = String::from_utf8(table.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(
        lines[0].starts_with("ID ") && lines[0].ends_with("ERR"),
        "{text}"
    );
    assert!(lines[1].starts_with("busy "), "sorted by id: {text}");
    assert!(lines[2].starts_with(&IDLE[..19]), "{text}");
    assert!(!text.contains('\x1b'), "no escape sequences: {text:?}");
    for l in &lines {
        assert!(l.chars().count() <= 80, "wider than 80 columns: {l}");
    }
}

/// A tmux server of its own (not the user's), killed on drop with everything in it.
struct Tmux {
    socket: String,
}

impl Tmux {
    /// Runs `script` (sh) in a detached 80×24 session `s`.
    fn start(tag: &str, script: &str) -> Tmux {
        let t = Tmux {
            socket: format!("fusex-top-{tag}-{}", std::process::id()),
        };
        let out = t.cmd(&[
            "new-session",
            "-d",
            "-x",
            "80",
            "-y",
            "24",
            "-s",
            "s",
            script,
        ]);
        assert!(
            out.status.success(),
            "tmux new-session: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        t
    }

    fn cmd(&self, args: &[&str]) -> Output {
        Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("running tmux")
    }

    /// The screen, wrapped lines joined (so a line printed past 80 columns shows as longer).
    fn screen(&self) -> String {
        let out = self.cmd(&["capture-pane", "-p", "-J", "-t", "s"]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn keys(&self, keys: &str) {
        let out = self.cmd(&["send-keys", "-t", "s", keys]);
        assert!(out.status.success(), "tmux send-keys {keys}");
    }

    /// The pid of the pane's shell.
    fn pane_pid(&self) -> i32 {
        let out = self.cmd(&["display-message", "-p", "-t", "s", "#{pane_pid}"]);
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("pane pid")
    }

    /// Waits (20 s at most) for a screen `cond` accepts; every screen seen must fit 80 columns.
    #[track_caller]
    fn wait_for(&self, what: &str, mut cond: impl FnMut(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut last = String::new();
        let found = wait_until(deadline, || {
            last = self.screen();
            // top's screens; after it, the shell's lines (an error, stty) are not its to fit.
            let lines = if last.contains("top exited") {
                ""
            } else {
                &last
            };
            // top's own error line (it names the socket's path) ends its screen; the shell's
            // "top exited" may not be on the screen yet.
            for l in lines.lines().filter(|l| !l.starts_with("fusex: error:")) {
                assert!(
                    l.trim_end().chars().count() <= 80,
                    "a line wider than 80 columns:\n{l}\n{last}"
                );
            }
            if cond(&last) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
            false
        });
        assert!(found, "{what} never showed; last screen:\n{last}");
        last
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd(&["kill-server"]);
    }
}

fn require_tmux() -> bool {
    require_fuse_and_tools(&["fio", "tmux"])
}

/// The shell script a session runs: fusex top, then its exit code and the terminal's mode.
fn script(socket: &Path) -> String {
    format!(
        "'{}' top --control '{}'; echo \"top exited $?\"; stty -a; sleep 600",
        fusex_bin().display(),
        socket.display()
    )
}

/// Whether `stty -a`'s output on the screen shows the terminal back in canonical mode with
/// echo (what the shell left it in).
fn restored(screen: &str) -> bool {
    let words: Vec<&str> = screen
        .split(|c: char| c.is_whitespace() || c == ';')
        .collect();
    words.contains(&"icanon") && words.contains(&"echo") && !words.contains(&"-icanon")
}

/// The IOPS figure of `id`'s line, if the screen has one.
fn iops_of(screen: &str, id: &str) -> Option<f64> {
    let line = screen.lines().find(|l| l.starts_with(&format!("{id} ")))?;
    let f = line.split_whitespace().nth(1)?;
    let (num, scale) = match f.strip_suffix('M') {
        Some(n) => (n, 1e6),
        None => (f, 1.0),
    };
    num.parse::<f64>().ok().map(|n| n * scale)
}

/// The live view on an 80×24 terminal: the busy export's line shows a non-zero rate, the idle
/// one zero; nothing passes 80 columns and a line that fills them keeps its last column; `p`
/// sorts by p99; `q` quits with exit status 0 and the terminal back as it was.
#[test]
fn live_view_on_a_terminal_shows_the_busy_export() {
    if !require_tmux() {
        return;
    }
    let w = WorkDir::new("top-live");
    let (serve, busy, _idle) = two_exports(&w);
    let _fio = spawn_randrw_load(&w, &busy, 4, 1);
    let tmux = Tmux::start("live", &script(&serve.socket));
    let screen = tmux.wait_for("the busy export with a non-zero IOPS figure", |s| {
        iops_of(s, "busy").is_some_and(|n| n > 0.0)
    });
    // The id cut to the 20 columns left for it.
    let cut = format!("{}…", &IDLE[..19]);
    assert_eq!(iops_of(&screen, &cut), Some(0.0), "{screen}");
    let lines: Vec<&str> = screen.lines().collect();
    assert!(
        lines[0].contains("qmp.sock"),
        "the header names the daemon:\n{screen}"
    );
    assert!(lines[0].contains("2 exports"), "{screen}");
    assert!(lines[0].contains("sort iops"), "{screen}");
    let header = lines[1].trim_end();
    assert!(
        header.starts_with("ID ") && header.ends_with("ERR"),
        "{screen}"
    );
    assert_eq!(
        header.chars().count(),
        80,
        "the table fills the width:\n{screen}"
    );
    assert!(lines[2].starts_with("busy "), "busiest first:\n{screen}");
    println!("{screen}");

    tmux.keys("p");
    tmux.wait_for("the p99 order", |s| {
        s.lines().next().is_some_and(|l| l.contains("sort p99"))
    });
    tmux.keys("q");
    let screen = tmux.wait_for("top's exit and the terminal's mode", |s| {
        s.contains("top exited") && restored(s)
    });
    assert!(screen.contains("top exited 0"), "{screen}");
    // The main screen is back: none of top's lines remain.
    assert!(!screen.contains("R MB/s"), "{screen}");
}

/// SIGTERM ends the live view with the terminal restored; a daemon that goes away ends it with
/// one error line, exit status 1, and the terminal restored too.
#[test]
fn signals_and_a_lost_daemon_restore_the_terminal() {
    if !require_tmux() {
        return;
    }
    let w = WorkDir::new("top-lost");
    let (serve, _busy, _idle) = two_exports(&w);

    let tmux = Tmux::start("term", &script(&serve.socket));
    tmux.wait_for("the table", |s| s.contains("R MB/s"));
    let shell = tmux.pane_pid();
    let pids = children_named(shell, "fusex");
    assert_eq!(
        pids.len(),
        1,
        "one fusex top under the pane's shell: {pids:?}"
    );
    send_signal(pids[0], libc::SIGTERM);
    let screen = tmux.wait_for("top's exit after SIGTERM", |s| {
        s.contains("top exited") && restored(s)
    });
    assert!(screen.contains("top exited 0"), "{screen}");
    drop(tmux);

    let tmux = Tmux::start("lost", &script(&serve.socket));
    tmux.wait_for("the table", |s| s.contains("R MB/s"));
    drop(serve);
    let screen = tmux.wait_for("top's exit after the daemon went away", |s| {
        s.contains("top exited") && restored(s)
    });
    assert!(screen.contains("top exited 1"), "{screen}");
    let errors: Vec<&str> = screen
        .lines()
        .filter(|l| l.starts_with("fusex: error:"))
        .collect();
    assert_eq!(errors.len(), 1, "{screen}");
    assert!(errors[0].contains("lost the daemon"), "{screen}");
}
