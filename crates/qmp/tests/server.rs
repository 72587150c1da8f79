//! The unix socket server: socket mode and replacement, credentials, many and idle clients,
//! oversized input, events, a client that stops reading, shutdown.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use qmp::{Dispatcher, EventBus, QmpError, Server, ServerConfig, ServerError, ShutdownHandle};
use serde_json::{json, Value};

struct Toy;

impl Dispatcher for Toy {
    fn commands(&self) -> Vec<String> {
        vec!["toy-echo".into(), "toy-sleep".into()]
    }
    fn dispatch(&self, name: &str, arguments: Value) -> Result<Value, QmpError> {
        if name == "toy-sleep" {
            std::thread::sleep(Duration::from_millis(1500));
        }
        Ok(arguments)
    }
}

struct Running {
    _dir: tempfile::TempDir,
    path: PathBuf,
    stop: ShutdownHandle,
    thread: Option<JoinHandle<Result<(), ServerError>>>,
    events: EventBus,
}

impl Running {
    fn stop(mut self) -> Result<(), ServerError> {
        self.stop.shutdown();
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.stop.shutdown();
            let _ = t.join();
        }
    }
}

/// Emits `TOY_EVENT` from a command, as a daemon's commands will.
struct Emitter(EventBus);

impl Dispatcher for Emitter {
    fn commands(&self) -> Vec<String> {
        vec!["toy-emit".into()]
    }
    fn dispatch(&self, _: &str, _: Value) -> Result<Value, QmpError> {
        self.0.emit("TOY_EVENT", None);
        Ok(json!({}))
    }
}

fn start(tweak: impl FnOnce(&mut ServerConfig)) -> Running {
    start_with(|_| Arc::new(Toy), tweak)
}

fn start_with(
    dispatcher: impl FnOnce(EventBus) -> Arc<dyn Dispatcher>,
    tweak: impl FnOnce(&mut ServerConfig),
) -> Running {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qmp.sock");
    let events = EventBus::new();
    let mut config = ServerConfig {
        events: events.clone(),
        ..ServerConfig::default()
    };
    tweak(&mut config);
    let server = Server::bind(&path, dispatcher(events.clone()), config).unwrap();
    let stop = server.shutdown_handle();
    let thread = Some(std::thread::spawn(move || server.run()));
    Running {
        _dir: dir,
        path,
        stop,
        thread,
        events,
    }
}

struct Client {
    r: BufReader<UnixStream>,
    w: UnixStream,
}

impl Client {
    fn connect(path: &Path) -> Client {
        let s = UnixStream::connect(path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        Client {
            w: s.try_clone().unwrap(),
            r: BufReader::new(s),
        }
    }
    fn recv(&mut self) -> Value {
        let mut line = String::new();
        let n = self.r.read_line(&mut line).expect("a reply within 5 s");
        assert!(n > 0, "connection closed");
        serde_json::from_str(&line).unwrap()
    }
    fn ask(&mut self, text: &str) -> Value {
        self.w.write_all(text.as_bytes()).unwrap();
        self.recv()
    }
    /// Connects, reads the greeting, negotiates.
    fn ready(path: &Path) -> Client {
        let mut c = Client::connect(path);
        assert!(c.recv().get("QMP").is_some());
        assert_eq!(
            c.ask(r#"{"execute": "qmp_capabilities"}"#),
            json!({"return": {}})
        );
        c
    }
    fn at_eof(&mut self) -> bool {
        let mut buf = [0u8; 1];
        matches!(self.r.read(&mut buf), Ok(0) | Err(_))
    }
}

#[test]
fn socket_is_0600_whatever_the_umask() {
    // SAFETY: umask only swaps the process's file mode mask; no memory is involved.
    let old = unsafe { libc::umask(0) };
    let s = start(|_| {});
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    let meta = std::fs::symlink_metadata(&s.path).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let leftovers: Vec<_> = std::fs::read_dir(s.path.parent().unwrap())
        .unwrap()
        .collect();
    assert_eq!(leftovers.len(), 1, "the private bind directory is gone");
}

#[test]
fn stale_socket_is_replaced_live_one_and_other_files_refused() {
    let s = start(|_| {});
    let err = Server::bind(&s.path, Arc::new(Toy), ServerConfig::default())
        .err()
        .unwrap();
    assert!(matches!(err, ServerError::InUse(_)), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let server = Server::bind(&stale, Arc::new(Toy), ServerConfig::default()).unwrap();
    assert_eq!(
        std::fs::metadata(&stale).unwrap().permissions().mode() & 0o777,
        0o600
    );
    drop(server);
    assert!(
        !stale.exists(),
        "a server dropped without running removes its socket"
    );
    let file = dir.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let err = Server::bind(&file, Arc::new(Toy), ServerConfig::default())
        .err()
        .unwrap();
    assert!(matches!(err, ServerError::NotASocket(_)), "{err}");
    assert!(err.to_string().contains("is not a socket"));
    s.stop().unwrap();
}

#[test]
fn idle_and_slow_clients_do_not_stall_others() {
    let s = start(|_| {});
    let _silent = UnixStream::connect(&s.path).unwrap(); // connects, never speaks, never reads
    let mut slow = Client::ready(&s.path);
    slow.w.write_all(br#"{"execute": "toy-sleep"}"#).unwrap();
    let t = Instant::now();
    let mut c = Client::ready(&s.path);
    assert_eq!(
        c.ask(r#"{"execute": "toy-echo", "arguments": {"a": 1}, "id": 1}"#),
        json!({"return": {"a": 1}, "id": 1})
    );
    assert!(
        t.elapsed() < Duration::from_millis(1000),
        "waited for another client's command"
    );
    assert_eq!(slow.recv(), json!({"return": {}}));
}

#[test]
fn many_clients_at_once() {
    let s = start(|_| {});
    let threads: Vec<_> = (0..24)
        .map(|i| {
            let path = s.path.clone();
            std::thread::spawn(move || {
                let mut c = Client::ready(&path);
                for j in 0..20 {
                    let r = c.ask(&format!(
                        r#"{{"execute": "toy-echo", "arguments": {{"i": {i}}}, "id": {j}}}"#
                    ));
                    assert_eq!(r, json!({"return": {"i": i}, "id": j}));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn client_limit() {
    let s = start(|c| c.max_clients = 2);
    let _a = Client::ready(&s.path);
    let _b = Client::ready(&s.path);
    let mut c = Client::connect(&s.path);
    assert!(c.at_eof(), "a third client is closed");
}

#[test]
fn oversized_request_is_answered_then_closed() {
    let s = start(|c| c.max_request = 64 * 1024);
    let mut c = Client::ready(&s.path);
    let mut big = br#"{"execute": "toy-echo", "arguments": {"s": ""#.to_vec();
    big.resize(200 * 1024, b'a');
    let _ = c.w.write_all(&big);
    let r = c.recv();
    assert_eq!(
        r["error"]["desc"],
        "JSON parse error, input exceeds the limit of 65536 bytes"
    );
    assert!(c.at_eof());
    let mut other = Client::ready(&s.path);
    assert!(other
        .ask(r#"{"execute": "query-version"}"#)
        .get("return")
        .is_some());
}

#[test]
fn users_not_allowed_are_closed_without_a_greeting() {
    let s = start(|c| c.allowed_uids = vec![12345]);
    let mut c = Client::connect(&s.path);
    assert!(c.at_eof());
}

#[test]
fn events_reach_only_negotiated_clients() {
    let s = start(|_| {});
    let mut a = Client::ready(&s.path);
    let mut b = Client::connect(&s.path);
    b.recv();
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.events.subscribers() < 1 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(s.events.emit("TOY_EVENT", Some(json!({"n": 1}))), 1);
    let ev = a.recv();
    assert_eq!(ev["event"], "TOY_EVENT");
    assert_eq!(ev["data"], json!({"n": 1}));
    assert!(ev["timestamp"]["microseconds"].as_u64().unwrap() < 1_000_000);
    assert_eq!(
        b.ask(r#"{"execute": "qmp_capabilities"}"#),
        json!({"return": {}}),
        "no event before negotiation"
    );
}

#[test]
fn a_client_that_stops_reading_is_cut_off_by_events() {
    let s = start(|c| c.queue_len = 4);
    let mut deaf = Client::ready(&s.path);
    let mut ok = Client::ready(&s.path);
    let data = json!({"pad": "x".repeat(16 * 1024)});
    let deadline = Instant::now() + Duration::from_secs(10);
    // The deaf client's socket buffer and queue fill up; the emitter never blocks.
    while s.events.emit("BIG", Some(data.clone())) == 2 {
        assert!(Instant::now() < deadline, "never cut off");
        assert_eq!(ok.recv()["event"], "BIG");
    }
    assert_eq!(ok.recv()["event"], "BIG");
    assert_eq!(s.events.subscribers(), 1);
    deaf.r
        .get_mut()
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut sink = Vec::new();
    let _ = deaf.r.read_to_end(&mut sink); // ends: the server shut the connection down
    assert!(ok
        .ask(r#"{"execute": "query-version"}"#)
        .get("return")
        .is_some());
}

#[test]
fn shutdown_closes_clients_and_removes_the_socket() {
    let s = start(|_| {});
    let mut a = Client::ready(&s.path);
    let mut b = Client::connect(&s.path);
    b.recv();
    let path = s.path.clone();
    s.stop().unwrap();
    assert!(a.at_eof());
    assert!(b.at_eof());
    assert!(!path.exists());
}

#[test]
fn serve_stream_over_pipes() {
    // What `--chardev stdio` would be: any reader and writer.
    let (client, server_side) = UnixStream::pair().unwrap();
    let reader = server_side.try_clone().unwrap();
    let config = ServerConfig::default();
    let t = std::thread::spawn(move || {
        qmp::serve_stream(reader, server_side, Arc::new(Toy), &config, Box::new(|| {}));
    });
    client
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut c = Client {
        w: client.try_clone().unwrap(),
        r: BufReader::new(client),
    };
    assert!(c.recv().get("QMP").is_some());
    assert_eq!(
        c.ask(r#"{"execute": "qmp_capabilities"}"#),
        json!({"return": {}})
    );
    c.w.shutdown(std::net::Shutdown::Write).unwrap();
    t.join().unwrap();
}

#[test]
fn pipelined_negotiation_then_event_command() {
    // Both requests in one write: the event the second one emits must reach this client, after
    // the first one's reply (the subscription happens between the two).
    for _ in 0..20 {
        let s = start_with(|bus| Arc::new(Emitter(bus)), |_| {});
        let mut c = Client::connect(&s.path);
        c.recv();
        c.w.write_all(
            br#"{"execute": "qmp_capabilities", "id": 1}{"execute": "toy-emit", "id": 2}"#,
        )
        .unwrap();
        assert_eq!(c.recv(), json!({"return": {}, "id": 1}));
        assert_eq!(c.recv()["event"], "TOY_EVENT");
        assert_eq!(c.recv(), json!({"return": {}, "id": 2}));
    }
}

/// A listening socket handed over by descriptor (`--chardev socket,fd=N`) is served, and its file
/// is removed when the server stops, as a bound one's is; anything else is refused by name,
/// and the descriptor is left open then.
#[test]
fn a_handed_over_listener_is_served_and_others_refused() {
    use std::os::fd::{AsRawFd, IntoRawFd};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("handed.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let fd = listener.into_raw_fd();
    let server = Server::from_fd(fd, Arc::new(Toy), ServerConfig::default()).unwrap();
    assert_eq!(server.path(), path);
    let stop = server.shutdown_handle();
    let thread = std::thread::spawn(move || server.run());
    let mut c = Client::ready(&path);
    assert_eq!(
        c.ask(r#"{"execute": "toy-echo", "arguments": {"a": 1}}"#),
        json!({"return": {"a": 1}})
    );
    stop.shutdown();
    thread.join().unwrap().unwrap();
    assert!(!path.exists(), "the handed-over socket's file is left");
    // One without a file: an abstract socket.
    use std::os::linux::net::SocketAddrExt;
    let unnamed = std::os::unix::net::UnixListener::bind_addr(
        &std::os::unix::net::SocketAddr::from_abstract_name(b"fusex-qmp-test-abstract").unwrap(),
    )
    .unwrap();
    let server = Server::from_fd(
        unnamed.into_raw_fd(),
        Arc::new(Toy),
        ServerConfig::default(),
    )
    .unwrap();
    assert!(server.path().to_str().unwrap().starts_with("fd="));

    let refused = |fd: i32, want: &str| {
        let e = Server::from_fd(fd, Arc::new(Toy), ServerConfig::default())
            .err()
            .expect("refused");
        assert!(e.to_string().contains(want), "{e}");
    };
    // A connected socket, not a listening one.
    let (a, _b) = UnixStream::pair().unwrap();
    refused(a.as_raw_fd(), "not listening");
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    refused(udp.as_raw_fd(), "not a unix socket");
    let file = std::fs::File::open("/dev/null").unwrap();
    refused(file.as_raw_fd(), "fd=");
    // Still open (not taken over): usable after the refusal.
    assert!(udp.local_addr().is_ok());
    refused(-1, "not a descriptor");
}
