//! `--metrics-listen`: what `fusex serve` shows Prometheus. The text passes `promtool check
//! metrics` and its counts agree with what fio did; a real Prometheus server scrapes it and
//! answers a rate query; and a crowd of idle, slow and malformed HTTP clients neither stops a
//! scrape nor an export's verified I/O. Needs root, /dev/fuse, fio, and Debian's `prometheus`
//! package (promtool and prometheus; scripts/deps.sh installs it).

use std::fs;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fusex_e2e::*;
use serde_json::json;

/// One HTTP exchange with a server on 127.0.0.1:`port`: the status and the body.
fn http_get(port: u16, target: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connecting");
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    write!(
        s,
        "GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).expect("reading the reply");
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, body.to_string())
}

/// The status code a reply starts with.
fn status_of(reply: &[u8]) -> String {
    String::from_utf8_lossy(reply)
        .split(' ')
        .nth(1)
        .unwrap_or("")
        .to_string()
}

/// The sum of a family's samples whose labels include all of `labels`.
fn sum(text: &str, family: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{family}{{")))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

/// Asserts that promtool accepts `text` without a lint complaint.
fn promtool_check(text: &str) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics: {said}\n{text}"
    );
}

/// A `fusex serve` with metrics on a free port and one writable raw export, `busy`, whose reads
/// and writes fusex serves itself.
fn serve_with_export(w: &WorkDir) -> (Serve, u16, std::path::PathBuf) {
    let img = w.join("busy.img");
    sparse_image(&img, 64 * MIB);
    let mp = w.join("busy.mnt");
    fs::write(&mp, b"").unwrap();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let serve = Serve::start(w.path(), &["--metrics-listen", &listen]);
    let mut q = serve.qmp();
    // Passthrough off: fusex itself serves every read and write, and counts them.
    q.add_raw_export("busy", &img, &mp, json!({"__org.fusex_passthrough": "off"}));
    (serve, port, mp)
}

/// fio on `mp` (`fio_command`: threads, O_DIRECT), its JSON report written to `out`.
fn fio(w: &WorkDir, mp: &Path, out: &Path, extra: &[&str]) -> Command {
    let output = format!("--output={}", out.display());
    let mut args = vec![
        "--name=busy",
        "--ioengine=libaio",
        "--bs=4k",
        "--iodepth=8",
        "--output-format=json",
        &output,
    ];
    args.extend_from_slice(extra);
    let mut c = fio_command(w, mp, &args);
    c.stdout(Stdio::null()).stderr(Stdio::piped());
    c
}

/// Runs fio to its end; its JSON report's first job.
fn fio_run(w: &WorkDir, mp: &Path, out: &Path, extra: &[&str]) -> Value {
    let o = fio(w, mp, out, extra).output().expect("fio");
    assert!(
        o.status.success(),
        "fio failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let report: Value = serde_json::from_str(&fs::read_to_string(out).unwrap()).unwrap();
    let job = report["jobs"][0].clone();
    assert_eq!(job["error"], 0, "fio: {job}");
    job
}

/// The text passes promtool; READ requests and bytes agree with fio's verified run.
#[test]
fn the_text_passes_promtool_and_counts_what_fio_did() {
    if !require_fuse_and_tools(&["fio", "promtool"]) {
        return;
    }
    let w = WorkDir::new("metrics-text");
    let (serve, port, mp) = serve_with_export(&w);
    // Written and verified first; then reads alone, counted against fusex's counts.
    fio_run(
        &w,
        &mp,
        &w.join("write.json"),
        &[
            "--rw=randwrite",
            "--size=16M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
        ],
    );
    let (status, before) = http_get(port, "/metrics");
    assert_eq!(status, 200, "{before}");
    let job = fio_run(
        &w,
        &mp,
        &w.join("read.json"),
        &["--rw=randread", "--size=16M"],
    );
    let (status, after) = http_get(port, "/metrics");
    assert_eq!(status, 200, "{after}");
    promtool_check(&after);

    let reads = |t: &str| {
        sum(
            t,
            "fusex_requests_total",
            &[("export", "busy"), ("op", "READ")],
        )
    };
    let bytes = |t: &str| sum(t, "fusex_read_bytes_total", &[("export", "busy")]);
    let fio_ios = job["read"]["total_ios"].as_u64().unwrap() as f64;
    let fio_bytes = job["read"]["io_bytes"].as_u64().unwrap() as f64;
    let counted = reads(&after) - reads(&before);
    assert!(fio_ios > 0.0);
    assert!(
        (counted - fio_ios).abs() <= fio_ios * 0.01,
        "fusex counted {counted} READs, fio did {fio_ios}"
    );
    // O_DIRECT: every byte fio read is a byte read from the image, no more.
    assert_eq!(bytes(&after) - bytes(&before), fio_bytes);
    // The verified writes were counted too, and their latencies.
    assert!(
        sum(
            &after,
            "fusex_requests_total",
            &[("export", "busy"), ("op", "WRITE")]
        ) >= 4096.0
    );
    assert!(
        sum(
            &after,
            "fusex_request_duration_seconds_count",
            &[("export", "busy"), ("op", "READ")]
        ) >= counted
    );
    assert!(after.contains("fusex_exports 1\n"), "{after}");
    assert!(after.contains("fusex_build_info{version=\""), "{after}");
    drop(serve);
}

/// Percent-encodes a query string value.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A real Prometheus server scrapes fusex every second and answers a PromQL query for the
/// request rate of a busy export.
#[test]
fn prometheus_scrapes_and_answers_a_rate_query() {
    if !require_fuse_and_tools(&["fio", "prometheus"]) {
        return;
    }
    let w = WorkDir::new("metrics-prometheus");
    let (serve, port, mp) = serve_with_export(&w);
    let config = w.join("prometheus.yml");
    fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: fusex\n    static_configs:\n\
             \x20     - targets: ['127.0.0.1:{port}']\n"
        ),
    )
    .unwrap();
    let web = free_port();
    let _prometheus = ChildGuard(
        Command::new(which("prometheus").unwrap())
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", w.join("tsdb").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{web}"))
            .stdout(Stdio::null())
            .stderr(fs::File::create(w.join("prometheus.log")).unwrap())
            .spawn()
            .expect("starting prometheus"),
    );
    let mut load = ChildGuard(
        fio(
            &w,
            &mp,
            &w.join("load.json"),
            &["--rw=randrw", "--size=16M", "--time_based", "--runtime=60"],
        )
        .spawn()
        .expect("fio"),
    );
    let query = encode("sum(rate(fusex_requests_total{export=\"busy\"}[5s]))");
    let target = format!("/api/v1/query?query={query}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = String::new();
    let rate = loop {
        assert!(load.try_wait().is_none(), "fio ended early");
        if TcpStream::connect(("127.0.0.1", web)).is_ok() {
            let (status, body) = http_get(web, &target);
            if status == 200 {
                let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
                let rate = v["data"]["result"][0]["value"][1]
                    .as_str()
                    .and_then(|r| r.parse::<f64>().ok());
                if let Some(r) = rate.filter(|r| *r > 0.0) {
                    break r;
                }
            }
            last = body;
        }
        assert!(
            Instant::now() < deadline,
            "no positive rate from Prometheus in 30 s; its last answer: {last}\nits log: {}",
            fs::read_to_string(w.join("prometheus.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    eprintln!("Prometheus says the export serves {rate:.0} requests/s");
    // Prometheus saw the target up.
    let (_, up) = http_get(web, &format!("/api/v1/query?query={}", encode("up")));
    assert!(up.contains("\"1\""), "{up}");
    load.kill_and_wait();
    drop(serve);
}

/// Idle, slow-loris, oversized, malformed and misdirected clients all at once: a normal scrape
/// still succeeds, fio's verified I/O completes without an error, and each gets its status.
#[test]
fn hostile_http_clients_leave_the_exports_serving() {
    if !require_fuse_and_tools(&["fio"]) {
        return;
    }
    let w = WorkDir::new("metrics-hostile");
    let (mut serve, port, mp) = serve_with_export(&w);
    let connect = || {
        let s = TcpStream::connect(("127.0.0.1", port)).expect("connecting");
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s
    };
    // A hundred that send nothing (more than the server holds at once).
    let idle: Vec<TcpStream> = (0..100).map(|_| connect()).collect();
    // One that sends a byte of its head every 100 ms: cut off with 408 at its deadline.
    let mut slow = connect();
    let loris = std::thread::spawn(move || {
        slow.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: "
            .iter()
            .chain([b'a'; 1000].iter());
        let started = Instant::now();
        let mut got = Vec::new();
        for b in head {
            if slow.write_all(&[*b]).is_err() {
                break;
            }
            let mut buf = [0u8; 512];
            match slow.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(_) => {}
            }
            if got.ends_with(b"\n") || started.elapsed() > Duration::from_secs(20) {
                break;
            }
        }
        (got, started.elapsed())
    });
    // Sends `req` and reads the reply, on its own thread (a big request and its reply overlap).
    let exchange = |req: Vec<u8>| {
        let mut s = connect();
        std::thread::spawn(move || {
            let mut r = s.try_clone().unwrap();
            let sender = std::thread::spawn(move || {
                let _ = r.write_all(&req);
                let _ = r.shutdown(Shutdown::Write);
            });
            let mut out = Vec::new();
            let _ = s.read_to_end(&mut out);
            let _ = sender.join();
            out
        })
    };
    let mut garbage = vec![0u8; 1 << 20];
    Rng::new(26).fill(&mut garbage);
    // No line end: an oversized head, not a malformed line.
    for b in garbage.iter_mut().filter(|b| **b == b'\n') {
        *b = b'x';
    }
    let oversized = exchange(garbage);
    let malformed = exchange(b"\x16\x03\x01\x00\xa5\x01 NOT HTTP\r\n\r\n".to_vec());
    let post = exchange(b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n".to_vec());
    let other = exchange(b"GET /other HTTP/1.1\r\n\r\n".to_vec());

    // Meanwhile: a normal scrape, and verified I/O on the export.
    let (status, text) = http_get(port, "/metrics");
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("export=\"busy\""), "{text}");
    fio_run(
        &w,
        &mp,
        &w.join("verify.json"),
        &[
            "--rw=randrw",
            "--size=16M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
        ],
    );
    assert_eq!(status_of(&oversized.join().unwrap()), "431");
    assert_eq!(status_of(&malformed.join().unwrap()), "400");
    assert_eq!(status_of(&post.join().unwrap()), "405");
    assert_eq!(status_of(&other.join().unwrap()), "404");
    let (got, took) = loris.join().unwrap();
    assert_eq!(status_of(&got), "408", "{}", String::from_utf8_lossy(&got));
    assert!(
        took < Duration::from_secs(10),
        "the slow client was held {took:?}"
    );
    drop(idle);
    // Still serving, still scraped.
    let (status, _) = http_get(port, "/metrics");
    assert_eq!(status, 200);
    assert!(serve.child.as_mut().unwrap().try_wait().unwrap().is_none());
    let errors = |t: &str| sum(t, "fusex_errors_total", &[("export", "busy")]);
    assert_eq!(errors(&http_get(port, "/metrics").1), 0.0);
    drop(serve);
}

/// A port in use fails the start in one line, before anything is served.
#[test]
fn an_address_in_use_fails_the_start() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("metrics-in-use");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let sock = w.join("qmp.sock");
    let out = run_fusex(
        &w,
        &[
            "serve",
            "--control",
            sock.to_str().unwrap(),
            "--metrics-listen",
            &addr,
        ],
        None,
    );
    out.assert_one_error_line("serve with a taken metrics address");
    assert!(
        out.stderr
            .contains(&format!("metrics-listen {addr}: cannot listen there")),
        "{}",
        out.stderr
    );
    assert!(!w.join("qmp.sock").exists());
}

/// `fusex mount --metrics-listen`: its one export, labelled with its mountpoint; an address in
/// use fails the mount in one line, with nothing mounted.
#[test]
fn a_mount_serves_its_export_and_refuses_a_taken_address() {
    if !require_fuse_and_tools(&["promtool"]) {
        return;
    }
    let w = WorkDir::new("metrics-mount");
    let img = w.join("disk.img");
    random_image(&img, 4 * MIB, 7);
    let mp = w.join("disk.mnt");
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let m = Mount::start(
        &w,
        &img,
        &mp,
        &["--metrics-listen", &listen, "--passthrough", "off"],
    );
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(m.path())
        .unwrap();
    let mut buf = AlignedBuf::new(4096, 4096);
    for i in 0..16 {
        assert_eq!(f.read_at(buf.as_mut_slice(), i * 4096).unwrap(), 4096);
    }
    let (status, text) = http_get(port, "/metrics");
    assert_eq!(status, 200, "{text}");
    promtool_check(&text);
    let id = m.path().display().to_string();
    let reads = sum(
        &text,
        "fusex_requests_total",
        &[("export", &id), ("op", "READ")],
    );
    assert!(reads >= 16.0, "{reads} READs of {id}:\n{text}");
    assert!(text.contains("fusex_exports 1\n"));
    drop(f);

    let taken = w.join("taken.mnt");
    let out = run_fusex(
        &w,
        &[
            "mount",
            "--metrics-listen",
            &listen,
            img.to_str().unwrap(),
            taken.to_str().unwrap(),
        ],
        Some(&taken),
    );
    out.assert_one_error_line("mount with a taken metrics address");
    assert!(
        out.stderr
            .contains(&format!("metrics-listen {listen}: cannot listen there")),
        "{}",
        out.stderr
    );
    assert!(!is_fuse_mounted(&taken));
    m.stop().assert_clean("mount with metrics");
}

/// `fusex mount SRC_DIR --metrics-listen --control`: a directory export is an export like an
/// image's, with the same metrics page (its LOOKUPs and READs counted under its mountpoint,
/// the text passing `promtool`) and control socket (`fusex top` reads it).
#[test]
fn a_directory_mount_serves_metrics_and_its_control_socket() {
    if !require_fuse_and_tools(&["promtool"]) {
        return;
    }
    let w = WorkDir::new("metrics-dir");
    let src = w.join("src");
    fs::create_dir(&src).unwrap();
    for i in 0..8 {
        fs::write(src.join(format!("f{i}")), vec![i as u8; 4096]).unwrap();
    }
    let mp = w.join("mnt");
    fs::create_dir(&mp).unwrap();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let control = w.join("control.sock");
    let m = Mount::start(
        &w,
        &src,
        &mp,
        &[
            "--metrics-listen",
            &listen,
            "--control",
            control.to_str().unwrap(),
            "--passthrough",
            "off",
        ],
    );
    for i in 0..8 {
        assert_eq!(
            fs::read(mp.join(format!("f{i}"))).unwrap(),
            vec![i as u8; 4096]
        );
    }
    let (status, text) = http_get(port, "/metrics");
    assert_eq!(status, 200, "{text}");
    promtool_check(&text);
    let id = m.path().display().to_string();
    for (op, least) in [("LOOKUP", 8.0), ("READ", 8.0)] {
        let n = sum(
            &text,
            "fusex_requests_total",
            &[("export", &id), ("op", op)],
        );
        assert!(n >= least, "{n} {op}s of {id}:\n{text}");
    }
    let top = run(Command::new(fusex_bin())
        .args(["top", "--once", "--json", "--control"])
        .arg(&control));
    assert!(
        top.status.success(),
        "{}",
        String::from_utf8_lossy(&top.stderr)
    );
    let v: Value = serde_json::from_slice(&top.stdout).unwrap();
    let row = &v["exports"][0];
    assert_eq!(row["id"], id.as_str(), "{v}");
    assert!(row["requests_total"].as_u64().unwrap() >= 16, "{v}");
    m.stop()
        .assert_clean("directory export with metrics and a control socket");
}
