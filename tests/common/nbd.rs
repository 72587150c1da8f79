//! NBD servers (qemu-nbd, nbdkit) the NBD tests start, each killed when its guard drops.

use std::fs;
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use crate::{run_ok, ChildGuard, Mount, WorkDir, TIMEOUT};

/// `nbd+unix:///EXPORT?socket=SOCK`.
pub fn nbd_uri(sock: &Path, export: &str) -> String {
    format!("nbd+unix:///{export}?socket={}", sock.display())
}

/// A loopback port nothing listens on now, for the server started next. Taken below the
/// kernel's ephemeral range (`net.ipv4.ip_local_port_range`): outgoing connections (a test's
/// HTTP client, Prometheus scraping, an NBD client) take their ports from that range, and one
/// could take a port picked there before the server binds it. Each call moves on, so tests
/// running at once are given different ports.
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const BASE: u32 = 10_000;
    let ephemeral = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    let span = ephemeral.saturating_sub(BASE);
    if span < 1000 {
        // No room below the range: any port the kernel gives.
        return TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
    }
    let start = std::process::id();
    for _ in 0..span {
        let port = BASE + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        if TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
            return port as u16;
        }
    }
    panic!("no free loopback port between {BASE} and {ephemeral}");
}

/// Starts `cmd`, an NBD server listening on `sock` (removed first), and waits until it accepts.
pub fn nbd_server(mut cmd: Command, sock: &Path) -> ChildGuard {
    let _ = fs::remove_file(sock);
    let mut g = spawn_quiet(&mut cmd);
    wait_until_listening(&mut g, &sock.display().to_string(), || {
        UnixStream::connect(sock).is_ok()
    });
    g
}

/// Starts `cmd`, an NBD server listening on 127.0.0.1:`port`, and waits until it accepts.
pub fn nbd_server_tcp(mut cmd: Command, port: u16) -> ChildGuard {
    let mut g = spawn_quiet(&mut cmd);
    wait_until_listening(&mut g, &format!("127.0.0.1:{port}"), || {
        TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    g
}

/// `qemu-nbd -t -k SOCK [args] IMAGE`, persistent, ready to accept.
pub fn qemu_nbd(sock: &Path, args: &[&str], image: &Path) -> ChildGuard {
    let mut c = Command::new("qemu-nbd");
    c.arg("-t").arg("-k").arg(sock).args(args).arg(image);
    nbd_server(c, sock)
}

/// `nbdkit -f -U SOCK PLUGIN ARGS...`, ready to accept.
pub fn nbdkit(sock: &Path, args: &[&str]) -> ChildGuard {
    let mut c = Command::new("nbdkit");
    c.arg("-f").arg("-U").arg(sock).args(args);
    nbd_server(c, sock)
}

/// An 8 MiB nbdkit memory export on `sock` that fails (EINVAL) every request not aligned to
/// 4 KiB or above 64 KiB, and fusex mounted writable over it at `mp`, having logged the block
/// sizes it negotiated. The server guard comes first: drop the mount before it.
pub fn strict_blocksize_export(w: &WorkDir, sock: &Path, mp: &Path) -> (ChildGuard, Mount) {
    let server = nbdkit(
        sock,
        &[
            "--filter=blocksize-policy",
            "memory",
            "size=8M",
            "blocksize-minimum=4096",
            "blocksize-preferred=4096",
            "blocksize-maximum=65536",
            "blocksize-error-policy=error",
        ],
    );
    let m = Mount::start(w, nbd_uri(sock, ""), mp, &["--writable"]);
    assert!(
        m.stderr().contains("block sizes 4096/4096/65536"),
        "{}",
        m.stderr()
    );
    (server, m)
}

fn spawn_quiet(cmd: &mut Command) -> ChildGuard {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        // The readiness probes' bare connects make servers complain; nothing to see there.
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {:?}: {e}", cmd.get_program()));
    ChildGuard(child)
}

/// Polls `accepts` until it holds; fails if the server exits first or `TIMEOUT` passes.
fn wait_until_listening(server: &mut ChildGuard, at: &str, mut accepts: impl FnMut() -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !accepts() {
        if let Some(st) = server.try_wait() {
            panic!("the NBD server exited early: {st}");
        }
        assert!(Instant::now() < deadline, "no NBD server on {at}");
        thread::sleep(Duration::from_millis(10));
    }
}

/// A CA, a server certificate for `localhost` and 127.0.0.1 (with its key), and a client
/// certificate (with its key), in `dir`, under the names nbdkit, qemu and libnbd use
/// (`ca-cert.pem`, `server-cert.pem`, `server-key.pem`, `client-cert.pem`, `client-key.pem`).
pub fn make_pki(dir: &Path, ca_name: &str) {
    make_pki_for(dir, ca_name, "localhost");
}

/// [`make_pki`] with a server certificate for `server` only (a DNS name).
pub fn make_pki_for(dir: &Path, ca_name: &str, server: &str) {
    let san = if server == "localhost" {
        "DNS:localhost,IP:127.0.0.1".to_string()
    } else {
        format!("DNS:{server}")
    };
    fs::create_dir_all(dir).unwrap();
    fs::write(
        dir.join("ext.cnf"),
        format!(
            "[srv]\nsubjectAltName={san}\nbasicConstraints=CA:FALSE\n\
             keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n\
             [cli]\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n\
             extendedKeyUsage=clientAuth\n"
        ),
    )
    .unwrap();
    let openssl = |args: &[&str]| {
        run_ok(Command::new("openssl").current_dir(dir).args(args));
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    let subj = format!("/CN={ca_name}");
    let mut a = vec!["req", "-x509"];
    a.extend(ec);
    a.extend([
        "-keyout",
        "ca-key.pem",
        "-out",
        "ca-cert.pem",
        "-days",
        "2",
        "-subj",
        &subj,
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    ]);
    openssl(&a);
    for (who, cn, ext) in [
        ("server", "localhost", "srv"),
        ("client", "fusex-client", "cli"),
    ] {
        let (key, csr, cert) = (
            format!("{who}-key.pem"),
            format!("{who}.csr"),
            format!("{who}-cert.pem"),
        );
        let subj = format!("/CN={cn}");
        let mut a = vec!["req"];
        a.extend(ec);
        a.extend(["-keyout", &key, "-out", &csr, "-subj", &subj]);
        openssl(&a);
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca-cert.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-out",
            &cert,
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
            "-extensions",
            ext,
        ]);
    }
}

/// `nbds+unix:///?socket=SOCK&tls-certificates=PKI`.
pub fn tls_uri(sock: &Path, pki: &Path) -> String {
    format!(
        "nbds+unix:///?socket={}&tls-certificates={}",
        sock.display(),
        pki.display()
    )
}
