//! A scripted NBD server on a Unix socket, for servers no real one imitates: one that sends every
//! byte a second apart (the handshake, or its replies) and one that accepts a connection and then
//! says nothing. Each connection runs on a thread of its own; dropping the [`FakeNbd`] shuts every
//! connection down and ends the accept loop, so a test that fails leaves no thread writing.

use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

/// Size of a fake export.
pub const FAKE_NBD_SIZE: u64 = 1 << 20;

/// The byte at `off` of a fake export.
pub fn fake_nbd_byte(off: u64) -> u8 {
    (off % 251) as u8
}

/// How one connection of a [`FakeNbd`] behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FakeMode {
    /// A fixed-newstyle handshake (structured replies, no metadata context) and READs answered
    /// at once with [`fake_nbd_byte`] data; other commands acknowledged.
    Good,
    /// As `Good`, but every byte the server sends in the handshake comes a second after the last.
    DripHandshake,
    /// A handshake at full speed, then every byte of every reply a second after the last.
    DripReplies,
    /// Accepts the connection and sends nothing, ever (it stays open).
    Silent,
}

/// A fake NBD server listening on a Unix socket.
pub struct FakeNbd {
    sock: PathBuf,
    shared: Arc<Shared>,
}

struct Shared {
    stop: AtomicBool,
    accepted: AtomicUsize,
    /// A clone of every connection accepted, to shut them down.
    conns: Mutex<Vec<UnixStream>>,
}

impl FakeNbd {
    /// Listens on `sock`; connection `i` (from 0) behaves as `mode(i)` says.
    pub fn start(sock: &Path, mode: impl Fn(usize) -> FakeMode + Send + 'static) -> FakeNbd {
        let _ = std::fs::remove_file(sock);
        let listener = UnixListener::bind(sock).expect("bind the fake NBD server's socket");
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            accepted: AtomicUsize::new(0),
            conns: Mutex::new(Vec::new()),
        });
        let sh = shared.clone();
        thread::spawn(move || {
            for (i, s) in listener.incoming().enumerate() {
                if sh.stop.load(Ordering::Acquire) {
                    return;
                }
                let Ok(s) = s else { return };
                if let Ok(c) = s.try_clone() {
                    sh.conns.lock().unwrap().push(c);
                }
                sh.accepted.fetch_add(1, Ordering::AcqRel);
                let m = mode(i);
                if m != FakeMode::Silent {
                    let sh = sh.clone();
                    thread::spawn(move || {
                        let _ = serve(s, m, &sh.stop);
                    });
                } // Silent: the clone in `conns` keeps it open.
            }
        });
        FakeNbd {
            sock: sock.to_path_buf(),
            shared,
        }
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::Acquire)
    }

    /// Shuts down every connection accepted so far, as a server that drops its clients does.
    pub fn drop_connections(&self) {
        for c in self.shared.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for FakeNbd {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.drop_connections();
        // Wakes the accept loop, which then sees the stop.
        let _ = UnixStream::connect(&self.sock);
    }
}

/// Sends `b`: at once, or (`drip`) one byte a second, ending early if the server stops.
fn send(s: &mut UnixStream, b: &[u8], drip: bool, stop: &AtomicBool) -> io::Result<()> {
    if !drip {
        return s.write_all(b);
    }
    for &x in b {
        if stop.load(Ordering::Acquire) {
            return Err(io::ErrorKind::Interrupted.into());
        }
        s.write_all(&[x])?;
        thread::sleep(Duration::from_secs(1));
    }
    Ok(())
}

/// One connection: the handshake, then requests until the client leaves.
fn serve(mut s: UnixStream, mode: FakeMode, stop: &AtomicBool) -> io::Result<()> {
    let drip_hs = mode == FakeMode::DripHandshake;
    let mut greeting = b"NBDMAGICIHAVEOPT".to_vec();
    greeting.extend_from_slice(&3u16.to_be_bytes()); // fixed newstyle, no zeroes
    send(&mut s, &greeting, drip_hs, stop)?;
    let mut cflags = [0u8; 4];
    s.read_exact(&mut cflags)?;
    let reply = |opt: u32, ty: u32, data: &[u8]| {
        let mut r = 0x0003_e889_0455_65a9u64.to_be_bytes().to_vec();
        r.extend_from_slice(&opt.to_be_bytes());
        r.extend_from_slice(&ty.to_be_bytes());
        r.extend_from_slice(&(data.len() as u32).to_be_bytes());
        r.extend_from_slice(data);
        r
    };
    loop {
        let mut h = [0u8; 16];
        s.read_exact(&mut h)?;
        let opt = u32::from_be_bytes(h[8..12].try_into().unwrap());
        let len = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let mut data = vec![0u8; len.min(1 << 16) as usize];
        s.read_exact(&mut data)?;
        let out = match opt {
            8 => reply(opt, 1, &[]), // STRUCTURED_REPLY: ack
            7 => {
                // GO: the export's size and flags (HAS_FLAGS | SEND_FLUSH), then ack.
                let mut info = 0u16.to_be_bytes().to_vec();
                info.extend_from_slice(&FAKE_NBD_SIZE.to_be_bytes());
                info.extend_from_slice(&(1u16 | 4).to_be_bytes());
                let mut r = reply(opt, 3, &info);
                r.extend_from_slice(&reply(opt, 1, &[]));
                send(&mut s, &r, drip_hs, stop)?;
                break;
            }
            _ => reply(opt, (1 << 31) + 1, &[]), // unsupported
        };
        send(&mut s, &out, drip_hs, stop)?;
    }
    let drip = mode == FakeMode::DripReplies;
    loop {
        let mut rq = [0u8; 28];
        s.read_exact(&mut rq)?;
        let ty = u16::from_be_bytes([rq[6], rq[7]]);
        let cookie = &rq[8..16];
        let off = u64::from_be_bytes(rq[16..24].try_into().unwrap());
        let len = u32::from_be_bytes(rq[24..28].try_into().unwrap());
        let mut out = Vec::new();
        match ty {
            2 => return Ok(()), // DISC
            0 => {
                // One OFFSET_DATA chunk with the DONE flag.
                out.extend_from_slice(&0x668e_33efu32.to_be_bytes());
                out.extend_from_slice(&1u16.to_be_bytes());
                out.extend_from_slice(&1u16.to_be_bytes());
                out.extend_from_slice(cookie);
                out.extend_from_slice(&(len + 8).to_be_bytes());
                out.extend_from_slice(&off.to_be_bytes());
                out.extend((off..off + u64::from(len)).map(fake_nbd_byte));
            }
            _ => {
                out.extend_from_slice(&0x6744_6698u32.to_be_bytes());
                out.extend_from_slice(&0u32.to_be_bytes());
                out.extend_from_slice(cookie);
            }
        }
        send(&mut s, &out, drip, stop)?;
    }
}
