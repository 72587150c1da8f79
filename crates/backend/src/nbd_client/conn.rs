//! One NBD connection in the transmission phase, driven on its queue's ring.
//!
//! Many requests are in flight at once, told apart by cookies (a slot index in the low 16 bits,
//! a generation above it, so a stale or invented cookie is caught). Sends are serialized (one
//! request's header and data go out whole before the next starts); the headers of requests
//! without payload (READ, FLUSH, WRITE_ZEROES, BLOCK_STATUS) are queued in a per-connection
//! buffer and sent together by whichever of them holds the *header-sender role*: the requests
//! that arrive while one send is in flight all go out in the next one. Replies are read by whichever
//! waiting request holds the *receiver role*: it reads one reply, lends the waiting request's own
//! window to the kernel for READ data (no copy), marks that request done and wakes it; when its
//! own request is done it hands the role to another waiting request. Reply heads are received
//! through a 28-byte stream buffer, together with a data chunk's length and offset when the
//! server sent them (two ring operations per READ reply: head, data). So a connection needs no
//! task of its own, and nothing is allocated per request: slots, header bytes and timeouts are
//! reused.
//!
//! Anything the server does wrong (bad magic, unknown cookie, impossible length, data outside the
//! request), a closed socket or a timeout breaks the connection: every request on it fails with
//! `EIO`, the socket is shut down, and the backend reconnects on a later request.
//!
//! With TLS (`nbds` URIs) the same protocol runs through a rustls session ([`TlsWire`]): the
//! ring moves ciphertext through two per-connection buffers (one for receiving, one for sending),
//! rustls decrypts from the receive buffer into the destination (the reply stream buffer, or a
//! READ's own window: one copy, which decryption needs anyway) and encrypts headers and WRITE
//! data into the send buffer. Only the socket primitives (`send_vec`, the WRITE payload, `fill`,
//! `recv_data`, `recv_vec`) know which kind of connection they run on; without TLS they are the
//! plain ring operations, unchanged.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::Future;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use engine::sync::Semaphore;
use engine::{Engine, Fd, Slice, TaskId, Timeout};
use nbd::wire::{self, Chunk, Command, ReplyHeader, HEAD_LEN, REQUEST_LEN};
use nbd::Export;

use super::connect::{Deadlined, Sock};

/// Size of the receiver's stream buffer: a reply head plus a data chunk's length and offset. A
/// head is read with up to this many bytes, so at most 12 bytes past a simple reply (the next
/// reply's head, or a simple READ reply's first data bytes, then copied) land in it.
const RX_CAP: usize = HEAD_LEN + wire::CHUNK_LEN_LEN + 8;

/// READ data up to this size is first received with a receive that does not wait (it is usually
/// all there with its reply's head); larger transfers rarely are, and wait at once.
const TRY_RECV_MAX: usize = 64 * 1024;

/// Slots made up front (more are added, once, if more requests are ever in flight).
const INITIAL_SLOTS: usize = 64;

/// TLS: the ciphertext receive buffer (a few records of up to 16 KiB plus overhead each; one
/// receive takes what the socket holds, up to this).
const TLS_RX_CAP: usize = 64 * 1024;

/// TLS: plaintext handed to rustls per round before its records are sent (rustls buffers at most
/// 64 KiB of outgoing records by default).
const TLS_TX_CHUNK: usize = 32 * 1024;

/// Why a connection broke (logged once).
#[derive(Debug)]
pub(crate) enum Broken {
    /// The server closed the connection.
    Closed,
    /// A request in flight got no complete reply within the timeout of being sent.
    Timeout,
    /// The server did not take a request's bytes within the timeout (it reads nothing).
    SendTimeout,
    /// The socket failed.
    Io(std::io::Error),
    /// The server broke the protocol.
    Violation(String),
    /// The TLS session failed (bad record, alert from the server).
    Tls(String),
}

impl std::fmt::Display for Broken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Broken::Closed => write!(f, "the server closed the connection"),
            Broken::Timeout => write!(f, "no complete reply within the timeout"),
            Broken::SendTimeout => write!(f, "the server took no request within the timeout"),
            Broken::Io(e) => write!(f, "socket error: {e}"),
            Broken::Violation(w) => write!(f, "protocol violation: {w}"),
            Broken::Tls(w) => write!(f, "TLS error: {w}"),
        }
    }
}

impl From<wire::WireError> for Broken {
    fn from(e: wire::WireError) -> Self {
        Broken::Violation(e.to_string())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Free,
    /// Allocated, waiting to send.
    Queued,
    /// Submitted to the socket (or being): a reply may come.
    Sent,
    /// The final reply arrived, or the connection broke.
    Done,
}

struct Slot {
    cookie: u64,
    phase: Phase,
    task: Option<TaskId>,
    cmd: Command,
    off: u64,
    len: u32,
    /// A READ's destination window (away while `lent`).
    win: Option<Slice>,
    /// A READ's destination when it is not a window: the backend's bounce buffer for reads
    /// and read-modify-writes of blocks that are not aligned (away while `lent`).
    bounce: Option<Vec<u8>>,
    /// The receiver has the window in a ring operation right now.
    lent: bool,
    covered: u64,
    error: Option<i32>,
    /// BLOCK_STATUS: what the reply's extents said, summed as they are read.
    extents: wire::Extents,
    /// Its request's future is gone: the slot is freed when the reply (or the break) comes.
    abandoned: bool,
    /// The request header bytes (reused).
    header: Option<Vec<u8>>,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            cookie: 0,
            phase: Phase::Free,
            task: None,
            cmd: Command::Flush,
            off: 0,
            len: 0,
            win: None,
            bounce: None,
            lent: false,
            covered: 0,
            error: None,
            extents: wire::Extents::default(),
            abandoned: false,
            header: Some(Vec::with_capacity(REQUEST_LEN)),
        }
    }
}

struct State {
    slots: Vec<Slot>,
    free: Vec<u16>,
    generation: u64,
    receiving: bool,
    broken: bool,
    /// The receiver's small stream buffer (away while a receive fills it): reply heads are read
    /// into it together with what follows them (a data chunk's length and offset), so a READ
    /// reply takes two ring operations. `rx_len` bytes at its start are received, not yet used.
    rx: Option<Vec<u8>>,
    rx_len: usize,
    /// Chunk payload bytes (error messages, block status) of the receiver.
    meta: Option<Vec<u8>>,
    timeouts: Vec<Timeout>,
    /// Requests in flight in the order they were sent, with their deadlines (sent + timeout), so
    /// the oldest one's deadline bounds every socket operation: a reply (all of its chunks and
    /// data) must be complete by it, however slowly the bytes come. Entries of requests already
    /// answered are dropped when they reach the front, or all at once when the queue would
    /// outgrow twice the slots (so it never grows in steady state).
    pending: VecDeque<(u16, u64, Instant)>,
    /// Writes since the last successful flush.
    dirty: bool,
    /// Headers of requests without payload (READ, FLUSH, ...) waiting to be sent: appended by
    /// their requests, sent together by the one request that holds the header-sender role.
    out: Vec<u8>,
    /// The header-sender's other buffer (away while its send is in flight).
    out_spare: Option<Vec<u8>>,
    /// A request holds the header-sender role (it sends `out` until it is empty).
    flushing: bool,
}

/// What a successful request answered beyond "done".
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Outcome {
    /// BLOCK_STATUS: the first extent (length, flags).
    pub extent: Option<(u32, u32)>,
    /// BLOCK_STATUS: bytes from the request's offset the extents described (at most its length).
    pub covered: u64,
    /// BLOCK_STATUS: of those, bytes not in a hole.
    pub allocated: u64,
}

/// A connection's TLS session on the ring. The receiver role and the send permit each use their
/// own ciphertext buffer; the rustls session is only borrowed between ring operations, never
/// across one, so the two never conflict. Records rustls queues while receiving (a key update's
/// answer, an alert) go out with the next send.
struct TlsWire {
    session: Box<rustls::ClientConnection>,
    /// Ciphertext received and not yet given to rustls: `rx[rx_at..rx_len]` (away while a
    /// receive fills it).
    rx: Option<Vec<u8>>,
    rx_at: usize,
    rx_len: usize,
    /// Ciphertext to send (away while a send is in flight).
    tx: Option<Vec<u8>>,
}

/// One connection (per queue thread).
pub(crate) struct Conn {
    /// The server as a user would name it (for the log line when the connection breaks).
    server: String,
    /// How long a request may wait for its complete reply (`--nbd-timeout`).
    timeout: Duration,
    sock: Sock,
    fd: Fd,
    export: Export,
    writable: bool,
    st: RefCell<State>,
    sending: Semaphore,
    /// The TLS session (`nbds` URIs); `None`: plain socket operations.
    tls: Option<RefCell<TlsWire>>,
    /// Where the connection says why it broke, for the operator (the backend's
    /// [`crate::BlockBackend::trouble`]): written once, when it breaks.
    trouble: Option<std::sync::Arc<std::sync::Mutex<Option<String>>>>,
}

impl Conn {
    /// Says why the connection broke into `slot` when it does.
    pub(crate) fn reporting_to(
        mut self,
        slot: std::sync::Arc<std::sync::Mutex<Option<String>>>,
    ) -> Conn {
        self.trouble = Some(slot);
        self
    }

    pub(crate) fn new(
        sock: Sock,
        tls: Option<Box<rustls::ClientConnection>>,
        export: Export,
        timeout: Duration,
        writable: bool,
        server: String,
    ) -> Conn {
        let fd = Fd::Raw(sock.as_raw_fd());
        let tls = tls.map(|session| {
            RefCell::new(TlsWire {
                session,
                rx: Some(vec![0; TLS_RX_CAP]),
                rx_at: 0,
                rx_len: 0,
                tx: Some(Vec::with_capacity(TLS_RX_CAP + 1024)),
            })
        });
        Conn {
            server,
            timeout,
            tls,
            sock,
            fd,
            export,
            writable,
            trouble: None,
            st: RefCell::new(State {
                slots: (0..INITIAL_SLOTS).map(|_| Slot::new()).collect(),
                free: (0..INITIAL_SLOTS as u16).rev().collect(),
                generation: 0,
                receiving: false,
                broken: false,
                rx: Some(vec![0; RX_CAP]),
                rx_len: 0,
                meta: Some(Vec::with_capacity(wire::MAX_META_PAYLOAD as usize)),
                timeouts: (0..4).map(|_| Timeout::new(timeout)).collect(),
                pending: VecDeque::with_capacity(2 * INITIAL_SLOTS + 1),
                dirty: false,
                out: Vec::with_capacity(INITIAL_SLOTS * REQUEST_LEN),
                out_spare: Some(Vec::with_capacity(INITIAL_SLOTS * REQUEST_LEN)),
                flushing: false,
            }),
            sending: Semaphore::new(1, INITIAL_SLOTS),
        }
    }

    /// Whether the connection broke (the backend then makes a new one).
    pub(crate) fn broken(&self) -> bool {
        self.st.borrow().broken
    }

    /// The export as this connection negotiated it.
    pub(crate) fn export(&self) -> &Export {
        &self.export
    }

    /// Sends one request and waits for its reply. `data` is a WRITE's payload or a READ's
    /// destination (exactly `len` bytes); it comes back whatever happens. Errors are errnos.
    pub(crate) async fn request(
        &self,
        eng: &Engine,
        cmd: Command,
        flags: u16,
        off: u64,
        len: u32,
        data: Option<Slice>,
    ) -> (Result<Outcome, i32>, Option<Slice>) {
        let Some(idx) = self.alloc(cmd, off, len) else {
            return (Err(libc::EIO), data);
        };
        let mut data = data;
        if cmd == Command::Read {
            self.st.borrow_mut().slots[idx].win = data.take();
        }
        let guard = SlotGuard { conn: self, idx };
        let (sent, write) = match data {
            // No payload: the header goes out with those of other requests issued meanwhile.
            None => (self.send_header(eng, idx, cmd, flags, off, len).await, None),
            Some(_) => self.send(eng, idx, cmd, flags, off, len, data).await,
        };
        if sent.is_err() {
            self.fail_slot(eng, idx);
        }
        self.wait(eng, idx).await;
        std::mem::forget(guard);
        let mut st = self.st.borrow_mut();
        let win = st.slots[idx].win.take().or(write);
        (settle(&mut st, idx), win)
    }

    /// A READ into, or a WRITE from, `bytes` (exactly `len` bytes): the backend's bounce buffer
    /// for requests that are not aligned to the server's minimum block size (a rare path: the
    /// data is received into a temporary buffer and copied, or sent through [`Self::send_vec`]
    /// with its header in front). `bytes` comes back whatever happens (empty if it was lost).
    pub(crate) async fn request_bytes(
        &self,
        eng: &Engine,
        cmd: Command,
        flags: u16,
        off: u64,
        len: u32,
        bytes: Vec<u8>,
    ) -> (Result<Outcome, i32>, Vec<u8>) {
        let Some(idx) = self.alloc(cmd, off, len) else {
            return (Err(libc::EIO), bytes);
        };
        let guard = SlotGuard { conn: self, idx };
        let mut back = None;
        let sent = if cmd == Command::Read {
            self.st.borrow_mut().slots[idx].bounce = Some(bytes);
            self.send_header(eng, idx, cmd, flags, off, len).await
        } else {
            // Header and payload in one buffer, sent whole under the send permit.
            let mut v = Vec::with_capacity(REQUEST_LEN + bytes.len());
            v.resize(REQUEST_LEN, 0);
            v.extend_from_slice(&bytes);
            back = Some(bytes);
            self.send_whole(eng, idx, cmd, flags, off, len, v).await
        };
        if sent.is_err() {
            self.fail_slot(eng, idx);
        }
        self.wait(eng, idx).await;
        std::mem::forget(guard);
        let mut st = self.st.borrow_mut();
        let back = st.slots[idx].bounce.take().or(back).unwrap_or_default();
        (settle(&mut st, idx), back)
    }

    /// Sends a request whose header space (the first [`REQUEST_LEN`] bytes of `v`) this fills
    /// in, with whatever payload follows it in `v`.
    #[allow(clippy::too_many_arguments)]
    async fn send_whole(
        &self,
        eng: &Engine,
        idx: usize,
        cmd: Command,
        flags: u16,
        off: u64,
        len: u32,
        mut v: Vec<u8>,
    ) -> Result<(), Broken> {
        self.sending.acquire(eng).await;
        let mut permit = Permit {
            conn: self,
            eng,
            clean: false,
        };
        {
            let mut st = self.st.borrow_mut();
            if st.broken {
                permit.clean = true;
                return Err(Broken::Closed);
            }
            let cookie = st.slots[idx].cookie;
            // Sent from here on: a reply may be read before this task runs again.
            st.slots[idx].phase = Phase::Sent;
            note_sent(&mut st, idx, self.timeout);
            let mut b = [0u8; REQUEST_LEN];
            wire::encode_request(&mut b, flags, cmd, cookie, off, len);
            v[..REQUEST_LEN].copy_from_slice(&b);
        }
        let (r, _) = self.send_vec(eng, v).await;
        permit.clean = true;
        if let Err(b) = r {
            self.break_conn(eng, b);
            return Err(Broken::Closed);
        }
        Ok(())
    }

    fn alloc(&self, cmd: Command, off: u64, len: u32) -> Option<usize> {
        let mut st = self.st.borrow_mut();
        if st.broken {
            return None;
        }
        let idx = match st.free.pop() {
            Some(i) => usize::from(i),
            None => {
                let n = st.slots.len();
                if n >= usize::from(u16::MAX) {
                    return None;
                }
                // More requests in flight than ever before: grow once.
                st.slots.push(Slot::new());
                n
            }
        };
        st.generation = st.generation.wrapping_add(1);
        let cookie = (st.generation << 16) | idx as u64;
        let s = &mut st.slots[idx];
        s.cookie = cookie;
        s.phase = Phase::Queued;
        s.task = None;
        s.cmd = cmd;
        s.off = off;
        s.len = len;
        s.lent = false;
        s.covered = 0;
        s.error = None;
        s.extents = wire::Extents::new(u64::from(len));
        s.abandoned = false;
        Some(idx)
    }

    #[allow(clippy::too_many_arguments)]
    async fn send(
        &self,
        eng: &Engine,
        idx: usize,
        cmd: Command,
        flags: u16,
        off: u64,
        len: u32,
        write: Option<Slice>,
    ) -> (Result<(), Broken>, Option<Slice>) {
        self.sending.acquire(eng).await;
        let mut permit = Permit {
            conn: self,
            eng,
            clean: false,
        };
        let hdr = {
            let mut st = self.st.borrow_mut();
            if st.broken {
                permit.clean = true;
                return (Err(Broken::Closed), write);
            }
            let cookie = st.slots[idx].cookie;
            // Sent from here on: a reply may be read before this task runs again.
            st.slots[idx].phase = Phase::Sent;
            note_sent(&mut st, idx, self.timeout);
            let mut hdr = st.slots[idx].header.take().unwrap_or_default();
            let mut b = [0u8; REQUEST_LEN];
            wire::encode_request(&mut b, flags, cmd, cookie, off, len);
            hdr.clear();
            hdr.extend_from_slice(&b);
            hdr
        };
        if self.tls.is_some() {
            // Header and data encrypted together, sent in as few ring operations as fit.
            let r = match &write {
                Some(w) => self.tls_send(eng, &[&hdr, w.as_slice()]).await,
                None => self.tls_send(eng, &[&hdr]).await,
            };
            self.st.borrow_mut().slots[idx].header = Some(hdr);
            permit.clean = true;
            if let Err(b) = r {
                self.break_conn(eng, b);
                return (Err(Broken::Closed), write);
            }
            return (Ok(()), write);
        }
        let (r, hdr) = self.send_vec(eng, hdr).await;
        self.st.borrow_mut().slots[idx].header = Some(hdr);
        if let Err(b) = r {
            self.break_conn(eng, b);
            permit.clean = true;
            return (Err(Broken::Closed), write);
        }
        let write = match write {
            Some(w) => {
                let want = w.len();
                let (t, deadline) = match self.timed(true) {
                    Ok(t) => t,
                    Err(b) => {
                        self.break_conn(eng, b);
                        permit.clean = true;
                        return (Err(Broken::Closed), Some(w));
                    }
                };
                let (r, w, t) = eng.send(self.fd, w, t).await;
                self.put_timeout(t);
                if let Err(b) = check(r, want, Some(deadline), true) {
                    self.break_conn(eng, b);
                    permit.clean = true;
                    return (Err(Broken::Closed), Some(w));
                }
                Some(w)
            }
            None => None,
        };
        permit.clean = true;
        (Ok(()), write)
    }

    /// Queues the header of a request without payload and makes sure it is sent: if no request
    /// holds the header-sender role, this one takes it and sends every queued header (its own
    /// and those queued while its sends are in flight) in as few ring operations as there are
    /// rounds, under the same send permit as writes (a write's header and data stay together).
    async fn send_header(
        &self,
        eng: &Engine,
        idx: usize,
        cmd: Command,
        flags: u16,
        off: u64,
        len: u32,
    ) -> Result<(), Broken> {
        {
            let mut st = self.st.borrow_mut();
            if st.broken {
                return Err(Broken::Closed);
            }
            let cookie = st.slots[idx].cookie;
            // A reply may be read once the header is out, possibly before this task runs again.
            st.slots[idx].phase = Phase::Sent;
            note_sent(&mut st, idx, self.timeout);
            let mut b = [0u8; REQUEST_LEN];
            wire::encode_request(&mut b, flags, cmd, cookie, off, len);
            // Within capacity unless more requests are in flight than ever before.
            st.out.extend_from_slice(&b);
            if st.flushing {
                return Ok(()); // the header-sender sends it in its next round
            }
            st.flushing = true;
        }
        let mut role = Sender {
            conn: self,
            eng,
            clean: false,
        };
        self.sending.acquire(eng).await;
        let mut permit = Permit {
            conn: self,
            eng,
            clean: false,
        };
        loop {
            let buf = {
                let mut st = self.st.borrow_mut();
                if st.broken || st.out.is_empty() {
                    break;
                }
                let spare = st.out_spare.take().unwrap_or_default();
                std::mem::replace(&mut st.out, spare)
            };
            let (r, mut buf) = self.send_vec(eng, buf).await;
            buf.clear();
            self.st.borrow_mut().out_spare = Some(buf);
            if let Err(b) = r {
                self.break_conn(eng, b);
                break;
            }
        }
        permit.clean = true;
        role.clean = true;
        drop(permit);
        drop(role);
        if self.st.borrow().broken {
            return Err(Broken::Closed);
        }
        Ok(())
    }

    /// Sends all of `b` (through the TLS session, if any).
    async fn send_vec(&self, eng: &Engine, b: Vec<u8>) -> (Result<(), Broken>, Vec<u8>) {
        if self.tls.is_some() {
            let r = self.tls_send(eng, &[&b]).await;
            return (r, b);
        }
        self.send_raw(eng, b).await
    }

    /// Sends all of `b` on the socket: first what it takes right away (no timeout to link: the
    /// common case costs one ring operation), then the rest, if any, waiting with the timeout.
    async fn send_raw(&self, eng: &Engine, b: Vec<u8>) -> (Result<(), Broken>, Vec<u8>) {
        let want = b.len();
        let (r, b, _) = eng.try_send_bytes_at(self.fd, b, 0).await;
        let done = match r {
            Ok(n) => n,
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => 0,
            Err(e) => return (check(Err(e), want, None, true), b),
        };
        if done >= want {
            return (Ok(()), b);
        }
        let (t, deadline) = match self.timed(true) {
            Ok(t) => t,
            Err(e) => return (Err(e), b),
        };
        let (r, b, t) = eng.send_bytes_at(self.fd, b, done, t).await;
        self.put_timeout(t);
        (check(r, want - done, Some(deadline), true), b)
    }

    /// TLS: encrypts `parts` (in order) and sends the records, a chunk at a time; records rustls
    /// queued meanwhile (answers to what the receiver processed) go out with them. Called only
    /// under the send permit, so records leave in the order rustls made them.
    async fn tls_send(&self, eng: &Engine, parts: &[&[u8]]) -> Result<(), Broken> {
        let Some(tls) = &self.tls else {
            return Err(Broken::Violation("TLS send on a plain connection".into()));
        };
        let (mut part, mut at) = (0, 0);
        loop {
            let tx = {
                let mut w = tls.borrow_mut();
                let w = &mut *w;
                let Some(mut tx) = w.tx.take() else {
                    return Err(Broken::Violation("TLS send buffer missing".into()));
                };
                tx.clear();
                let mut budget = TLS_TX_CHUNK;
                while part < parts.len() && budget > 0 {
                    let p = parts[part];
                    let end = p.len().min(at + budget);
                    let n = match w.session.writer().write(&p[at..end]) {
                        Ok(n) => n,
                        Err(e) => {
                            w.tx = Some(tx);
                            return Err(Broken::Tls(e.to_string()));
                        }
                    };
                    if n == 0 && end > at {
                        break; // rustls's outgoing buffer is full: send, then go on
                    }
                    at += n;
                    budget = budget.saturating_sub(n);
                    if at >= p.len() {
                        part += 1;
                        at = 0;
                    }
                }
                while w.session.wants_write() {
                    if let Err(e) = w.session.write_tls(&mut tx) {
                        w.tx = Some(tx);
                        return Err(Broken::Tls(e.to_string()));
                    }
                }
                tx
            };
            let done = part >= parts.len();
            if tx.is_empty() {
                if let Some(tls) = &self.tls {
                    tls.borrow_mut().tx = Some(tx);
                }
                if done {
                    return Ok(());
                }
                return Err(Broken::Tls("rustls accepted no data to send".into()));
            }
            let (r, tx) = self.send_raw(eng, tx).await;
            tls.borrow_mut().tx = Some(tx);
            r?;
            if done {
                return Ok(());
            }
        }
    }

    /// TLS: decrypts at least `min` bytes (at most `dst.len()`) into `dst`, receiving ciphertext
    /// on the ring as needed (with the timeout). Returns how many bytes it wrote.
    async fn tls_read(&self, eng: &Engine, dst: &mut [u8], min: usize) -> Result<usize, Broken> {
        let Some(tls) = &self.tls else {
            return Err(Broken::Violation(
                "TLS receive on a plain connection".into(),
            ));
        };
        let min = min.min(dst.len());
        let mut got = 0;
        loop {
            {
                let mut w = tls.borrow_mut();
                let w = &mut *w;
                // Plaintext rustls already holds.
                while got < dst.len() {
                    match w.session.reader().read(&mut dst[got..]) {
                        Ok(0) => {
                            // close_notify: the server ended the session.
                            if got >= min {
                                return Ok(got);
                            }
                            return Err(Broken::Closed);
                        }
                        Ok(n) => got += n,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) => return Err(Broken::Tls(e.to_string())),
                    }
                }
                if got >= min {
                    return Ok(got);
                }
                // Ciphertext received earlier and not yet processed.
                if w.rx_at < w.rx_len {
                    let Some(rx) = w.rx.as_ref() else {
                        return Err(Broken::Violation("TLS receive buffer missing".into()));
                    };
                    let mut pending = &rx[w.rx_at..w.rx_len];
                    let n = w
                        .session
                        .read_tls(&mut pending)
                        .map_err(|e| Broken::Tls(e.to_string()))?;
                    if n == 0 {
                        return Err(Broken::Tls("rustls accepted no received bytes".into()));
                    }
                    w.rx_at += n;
                    w.session
                        .process_new_packets()
                        .map_err(|e| Broken::Tls(e.to_string()))?;
                    continue;
                }
            }
            // More ciphertext from the socket: whatever it holds, up to the buffer.
            let buf = {
                let mut w = tls.borrow_mut();
                w.rx_at = 0;
                w.rx_len = 0;
                w.rx.take()
            };
            let Some(mut buf) = buf else {
                return Err(Broken::Violation("TLS receive buffer missing".into()));
            };
            buf.resize(TLS_RX_CAP, 0);
            let (t, deadline) = match self.timed(false) {
                Ok(t) => t,
                Err(b) => {
                    tls.borrow_mut().rx = Some(buf);
                    return Err(b);
                }
            };
            let (r, buf, t) = eng.recv_bytes_at(self.fd, buf, 0, false, t).await;
            self.put_timeout(t);
            let mut w = tls.borrow_mut();
            w.rx = Some(buf);
            match r {
                Ok(0) => return Err(Broken::Closed),
                Ok(n) => w.rx_len = n.min(TLS_RX_CAP),
                Err(e) => {
                    return Err(check(Err(e), 1, Some(deadline), false)
                        .err()
                        .unwrap_or(Broken::Closed))
                }
            }
        }
    }

    /// The deadline of the oldest request in flight (its reply, and every send before it, must
    /// be done by then); a fresh one if none is (unreachable: operations run for requests).
    fn deadline(&self) -> Instant {
        let mut st = self.st.borrow_mut();
        while let Some(&(i, cookie, d)) = st.pending.front() {
            let s = &st.slots[usize::from(i)];
            if s.cookie == cookie && s.phase == Phase::Sent {
                return d;
            }
            st.pending.pop_front();
        }
        Instant::now() + self.timeout
    }

    /// A timeout for the next socket operation that waits: the time left until the oldest
    /// request's deadline (with that deadline), or, once it has passed, why the connection
    /// breaks (`send`: the operation is a send).
    fn timed(&self, send: bool) -> Result<(Option<Timeout>, Instant), Broken> {
        let deadline = self.deadline();
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(if send {
                Broken::SendTimeout
            } else {
                Broken::Timeout
            });
        }
        let mut t = self.st.borrow_mut().timeouts.pop();
        if let Some(t) = t.as_mut() {
            t.set(left);
        }
        Ok((t, deadline))
    }

    fn put_timeout(&self, t: Option<Timeout>) {
        if let Some(t) = t {
            self.st.borrow_mut().timeouts.push(t);
        }
    }

    fn fail_slot(&self, eng: &Engine, idx: usize) {
        let mut st = self.st.borrow_mut();
        let s = &mut st.slots[idx];
        if s.phase != Phase::Done {
            s.phase = Phase::Done;
            s.error.get_or_insert(libc::EIO);
            if let Some(t) = s.task {
                eng.wake(t);
            }
        }
    }

    /// Waits until the slot is done and its window is back, reading replies meanwhile if no
    /// other request is.
    async fn wait(&self, eng: &Engine, idx: usize) {
        loop {
            let receive = {
                let mut st = self.st.borrow_mut();
                let receiving = st.receiving;
                let s = &mut st.slots[idx];
                if s.phase == Phase::Done && !s.lent {
                    return;
                }
                if s.phase != Phase::Done && !receiving {
                    st.receiving = true;
                    true
                } else {
                    s.task = eng.current_task();
                    false
                }
            };
            if receive {
                let mut role = Role {
                    conn: self,
                    eng,
                    clean: false,
                };
                let r = self.receive_one(eng).await;
                role.clean = true;
                drop(role);
                if let Err(b) = r {
                    self.break_conn(eng, b);
                }
                if self.st.borrow().slots[idx].phase == Phase::Done {
                    self.hand_off(eng);
                }
            } else {
                YieldOnce(false).await;
            }
        }
    }

    /// Wakes one request still waiting for its reply, to take the receiver role.
    fn hand_off(&self, eng: &Engine) {
        let st = self.st.borrow();
        if st.receiving {
            return;
        }
        if let Some(t) = st
            .slots
            .iter()
            .find(|s| s.phase == Phase::Sent && !s.abandoned && s.task.is_some())
            .and_then(|s| s.task)
        {
            eng.wake(t);
        }
    }

    /// Marks the connection broken: fails every request on it, shuts the socket down (so
    /// operations in flight on it end), and logs why, once.
    pub(crate) fn break_conn(&self, eng: &Engine, why: Broken) {
        let mut st = self.st.borrow_mut();
        if st.broken {
            return;
        }
        st.broken = true;
        let secs = self.timeout.as_secs_f64();
        match why {
            Broken::Timeout => tracing::warn!(
                "NBD server {} sent no complete reply within {secs} s; closing the connection \
                 (its requests fail with EIO)",
                self.server
            ),
            Broken::SendTimeout => tracing::warn!(
                "NBD server {} took no request within {secs} s; closing the connection (its \
                 requests fail with EIO)",
                self.server
            ),
            why => {
                tracing::warn!(
                    "NBD connection to {} lost: {why}; its requests fail with EIO",
                    self.server
                );
                if let Some(slot) = &self.trouble {
                    *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(format!(
                        "NBD connection to {} lost ({why}): requests fail with EIO until it \
                         is made again",
                        self.server
                    ));
                }
            }
        }
        // SAFETY: shutdown(2) on the socket this connection owns; it references no memory.
        unsafe { libc::shutdown(self.sock.as_raw_fd(), libc::SHUT_RDWR) };
        for i in 0..st.slots.len() {
            let s = &mut st.slots[i];
            if matches!(s.phase, Phase::Queued | Phase::Sent) {
                s.phase = Phase::Done;
                s.error.get_or_insert(libc::EIO);
                if let Some(t) = s.task {
                    eng.wake(t);
                }
                if s.abandoned && !s.lent {
                    free(&mut st, i);
                }
            }
        }
        drop(st);
        self.sending.wake_all(eng);
    }

    /// Reads one reply (or chunk) and applies it to its request.
    async fn receive_one(&self, eng: &Engine) -> Result<(), Broken> {
        let Some(meta) = self.st.borrow_mut().meta.take() else {
            return Err(Broken::Violation("receiver buffers missing".into()));
        };
        let (r, meta) = self.receive_with(eng, meta).await;
        self.st.borrow_mut().meta = Some(meta);
        r
    }

    /// Makes the stream buffer hold at least `want` bytes, receiving at most up to `upto`.
    async fn fill(&self, eng: &Engine, want: usize, upto: usize) -> Result<(), Broken> {
        loop {
            let (buf, have) = {
                let mut st = self.st.borrow_mut();
                if st.rx_len >= want {
                    return Ok(());
                }
                let Some(buf) = st.rx.take() else {
                    return Err(Broken::Violation("receiver buffers missing".into()));
                };
                (buf, st.rx_len)
            };
            let mut buf = buf;
            if self.tls.is_some() {
                buf.resize(RX_CAP, 0);
                let upto = upto.min(RX_CAP);
                let r = self
                    .tls_read(
                        eng,
                        &mut buf[have.min(upto)..upto],
                        want.saturating_sub(have),
                    )
                    .await;
                let mut st = self.st.borrow_mut();
                st.rx = Some(buf);
                st.rx_len = (have + r?).min(RX_CAP);
                continue;
            }
            let (t, deadline) = match self.timed(false) {
                Ok(t) => t,
                Err(b) => {
                    self.st.borrow_mut().rx = Some(buf);
                    return Err(b);
                }
            };
            buf.truncate(upto);
            buf.resize(upto, 0);
            let (r, mut buf, t) = eng.recv_bytes_at(self.fd, buf, have, false, t).await;
            self.put_timeout(t);
            buf.resize(RX_CAP, 0);
            let mut st = self.st.borrow_mut();
            st.rx = Some(buf);
            match r {
                Ok(0) => return Err(Broken::Closed),
                Ok(n) => st.rx_len = (st.rx_len + n).min(RX_CAP),
                Err(e) => {
                    return Err(check(Err(e), 1, Some(deadline), false)
                        .err()
                        .unwrap_or(Broken::Closed))
                }
            }
        }
    }

    /// Moves up to `out.len()` received-but-unused bytes of the stream buffer into `out`;
    /// returns how many.
    fn take_rx(&self, out: &mut [u8]) -> usize {
        let mut st = self.st.borrow_mut();
        let st = &mut *st;
        let Some(buf) = st.rx.as_mut() else {
            return 0;
        };
        let have = st.rx_len.min(buf.len());
        let n = have.min(out.len());
        out[..n].copy_from_slice(&buf[..n]);
        buf.copy_within(n..have, 0);
        st.rx_len = have - n;
        n
    }

    /// Exactly `n` bytes into `v` (resized to `n`): first what the stream buffer holds, then from
    /// the socket.
    async fn recv_vec(
        &self,
        eng: &Engine,
        mut v: Vec<u8>,
        n: usize,
    ) -> (Result<(), Broken>, Vec<u8>) {
        v.clear();
        v.resize(n, 0);
        let k = self.take_rx(&mut v);
        if k == n {
            return (Ok(()), v);
        }
        if self.tls.is_some() {
            let r = self.tls_read(eng, &mut v[k..n], n - k).await.map(drop);
            return (r, v);
        }
        let (t, deadline) = match self.timed(false) {
            Ok(t) => t,
            Err(b) => return (Err(b), v),
        };
        let (r, v, t) = eng.recv_bytes_at(self.fd, v, k, true, t).await;
        self.put_timeout(t);
        (check(r, n - k, Some(deadline), false), v)
    }

    async fn receive_with(&self, eng: &Engine, mut meta: Vec<u8>) -> (Result<(), Broken>, Vec<u8>) {
        if let Err(b) = self.fill(eng, HEAD_LEN, RX_CAP).await {
            return (Err(b), meta);
        }
        let mut h = [0u8; HEAD_LEN];
        self.take_rx(&mut h);
        let hdr = match ReplyHeader::decode(&h) {
            Ok(x) => x,
            Err(e) => return (Err(e.into()), meta),
        };
        let idx = match self.slot_of(hdr.cookie()) {
            Ok(i) => i,
            Err(b) => return (Err(b), meta),
        };
        let (cmd, req_off, req_len) = {
            let st = self.st.borrow();
            let s = &st.slots[idx];
            (s.cmd, s.off, s.len)
        };
        let r = match hdr {
            ReplyHeader::Simple { error, .. } => if error != 0 {
                self.set_error(idx, nbd::errno_of(error));
                Ok(())
            } else if cmd == Command::Read {
                self.recv_data(eng, idx, 0, req_len).await
            } else {
                Ok(())
            }
            .map(|()| true),
            ReplyHeader::Chunk {
                flags, kind, ty, ..
            } => {
                let r;
                (r, meta) = self
                    .chunk(eng, idx, kind, ty, cmd, req_off, req_len, meta)
                    .await;
                r.map(|()| flags & wire::REPLY_FLAG_DONE != 0)
            }
        };
        match r {
            Ok(true) => {
                self.complete(eng, idx);
                (Ok(()), meta)
            }
            Ok(false) => (Ok(()), meta),
            Err(b) => (Err(b), meta),
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn chunk(
        &self,
        eng: &Engine,
        idx: usize,
        kind: Chunk,
        ty: u16,
        cmd: Command,
        req_off: u64,
        req_len: u32,
        meta: Vec<u8>,
    ) -> (Result<(), Broken>, Vec<u8>) {
        // A data chunk's length and offset come with its head when the server sent them
        // together; any valid data chunk has both. An invalid one breaks the connection anyway.
        let first = if kind == Chunk::OffsetData {
            wire::CHUNK_LEN_LEN + 8
        } else {
            wire::CHUNK_LEN_LEN
        };
        if let Err(b) = self.fill(eng, first, first).await {
            return (Err(b), meta);
        }
        let mut meta = meta;
        meta.clear();
        meta.resize(first, 0);
        self.take_rx(&mut meta);
        let len = wire::chunk_len(&[meta[0], meta[1], meta[2], meta[3]]);
        let max_data = if cmd == Command::Read { req_len } else { 0 };
        if let Err(e) = kind.check_len(ty, len, max_data) {
            return (Err(e.into()), meta);
        }
        let allowed = match kind {
            Chunk::OffsetData | Chunk::OffsetHole => cmd == Command::Read,
            Chunk::BlockStatus => cmd == Command::BlockStatus,
            Chunk::None | Chunk::Error => true,
        };
        if !allowed {
            return (
                Err(Broken::Violation(format!(
                    "reply chunk type {ty} to a {cmd:?} request"
                ))),
                meta,
            );
        }
        match kind {
            Chunk::None => (Ok(()), meta),
            Chunk::OffsetData => {
                let mut o = [0u8; 8];
                o.copy_from_slice(&meta[wire::CHUNK_LEN_LEN..wire::CHUNK_LEN_LEN + 8]);
                let n = len - 8;
                match wire::place(
                    u64::from_be_bytes(o),
                    u64::from(n),
                    req_off,
                    u64::from(req_len),
                ) {
                    Ok(rel) => (self.recv_data(eng, idx, rel as u32, n).await, meta),
                    Err(e) => (Err(e.into()), meta),
                }
            }
            Chunk::OffsetHole => {
                let r;
                (r, meta) = self.recv_vec(eng, meta, 12).await;
                if let Err(b) = r {
                    return (Err(b), meta);
                }
                let placed = wire::hole(&meta).and_then(|(o, n)| {
                    wire::place(o, u64::from(n), req_off, u64::from(req_len)).map(|rel| (rel, n))
                });
                match placed {
                    Ok((rel, n)) => {
                        let mut st = self.st.borrow_mut();
                        let s = &mut st.slots[idx];
                        let (a, b) = (rel as usize, rel as usize + n as usize);
                        if let Some(w) = s.win.as_mut() {
                            if let Some(z) = w.as_mut_slice().get_mut(a..b) {
                                z.fill(0);
                            }
                        }
                        if let Some(z) = s.bounce.as_mut().and_then(|v| v.get_mut(a..b)) {
                            z.fill(0);
                        }
                        s.covered += u64::from(n);
                        (Ok(()), meta)
                    }
                    Err(e) => (Err(e.into()), meta),
                }
            }
            Chunk::BlockStatus => {
                let Some(ctx) = self.export.allocation_context else {
                    return (
                        Err(Broken::Violation(
                            "block status without a negotiated context".into(),
                        )),
                        meta,
                    );
                };
                let r;
                (r, meta) = self.recv_vec(eng, meta, 4).await;
                if let Err(b) = r {
                    return (Err(b), meta);
                }
                if let Err(e) = wire::check_context(&meta, ctx) {
                    return (Err(e.into()), meta);
                }
                // The descriptors, in pieces the meta buffer holds (a reply without REQ_ONE may
                // carry many), summed as they come.
                let piece = wire::MAX_META_PAYLOAD as usize / wire::EXTENT_LEN * wire::EXTENT_LEN;
                let mut left = len as usize - 4;
                let mut sum = self.st.borrow().slots[idx].extents;
                while left > 0 {
                    let n = left.min(piece);
                    let r;
                    (r, meta) = self.recv_vec(eng, meta, n).await;
                    if let Err(b) = r {
                        return (Err(b), meta);
                    }
                    if let Err(e) = sum.add(&meta) {
                        return (Err(e.into()), meta);
                    }
                    left -= n;
                }
                self.st.borrow_mut().slots[idx].extents = sum;
                (Ok(()), meta)
            }
            Chunk::Error => {
                let r;
                (r, meta) = self.recv_vec(eng, meta, len as usize).await;
                if let Err(b) = r {
                    return (Err(b), meta);
                }
                match wire::error(&meta) {
                    Ok((e, msg)) => {
                        tracing::debug!("NBD server error {e} for {cmd:?} at {req_off}: {msg}");
                        self.set_error(idx, nbd::errno_of(e));
                        (Ok(()), meta)
                    }
                    Err(e) => (Err(e.into()), meta),
                }
            }
        }
    }

    /// Receives `n` bytes of READ data into the request's window at `rel`.
    async fn recv_data(&self, eng: &Engine, idx: usize, rel: u32, n: u32) -> Result<(), Broken> {
        let win = {
            let mut st = self.st.borrow_mut();
            let s = &mut st.slots[idx];
            let w = s.win.take();
            s.lent = w.is_some();
            w
        };
        let Some(win) = win else {
            return self.recv_bounce(eng, idx, rel, n).await;
        };
        let (start, end) = (win.start(), win.end());
        let (a, b) = (start + rel as usize, start + rel as usize + n as usize);
        if b > end {
            self.restore(eng, idx, win);
            return Err(Broken::Violation("READ data beyond the request".into()));
        }
        // Bytes the stream buffer already holds (at most 12, after a simple reply) are copied.
        let mut win = win;
        let k = self.take_rx(&mut win.as_mut_slice()[a - start..b - start]);
        if self.tls.is_some() {
            // Decrypted straight into the request's window.
            let (from, to) = (a - start + k, b - start);
            let r = if from < to {
                self.tls_read(eng, &mut win.as_mut_slice()[from..to], to - from)
                    .await
                    .map(drop)
            } else {
                Ok(())
            };
            self.restore(eng, idx, win);
            r?;
            self.st.borrow_mut().slots[idx].covered += u64::from(n);
            return Ok(());
        }
        let mut buf = win.into_inner();
        let mut r = Ok(());
        let mut have = a + k;
        if have < b && b - have <= TRY_RECV_MAX {
            // Usually all there already (sent with the reply's head): one ring operation and no
            // timeout to link; whatever is missing is waited for below.
            let (got, sub, _) = eng.try_recv(self.fd, buf.slice(have..b)).await;
            buf = sub.into_inner();
            match got {
                Ok(0) => r = Err(Broken::Closed),
                Ok(n) => have += n,
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {}
                Err(e) => r = check(Err(e), b - have, None, false),
            }
        }
        if r.is_ok() && have < b {
            match self.timed(false) {
                Ok((t, deadline)) => {
                    let (got, sub, t) = eng.recv(self.fd, buf.slice(have..b), t).await;
                    self.put_timeout(t);
                    buf = sub.into_inner();
                    r = check(got, b - have, Some(deadline), false);
                }
                Err(e) => r = Err(e),
            }
        }
        self.restore(eng, idx, buf.slice(start..end));
        r?;
        self.st.borrow_mut().slots[idx].covered += u64::from(n);
        Ok(())
    }

    /// Receives `n` bytes of READ data into the request's bounce buffer at `rel` (through a
    /// temporary buffer: a rare path, see [`Self::request_bytes`]).
    async fn recv_bounce(&self, eng: &Engine, idx: usize, rel: u32, n: u32) -> Result<(), Broken> {
        let bounce = {
            let mut st = self.st.borrow_mut();
            let s = &mut st.slots[idx];
            let b = s.bounce.take();
            s.lent = b.is_some();
            b
        };
        let Some(mut bounce) = bounce else {
            return Err(Broken::Violation(
                "READ data for a request without a window".into(),
            ));
        };
        let (a, b) = (rel as usize, rel as usize + n as usize);
        let r = if b > bounce.len() {
            Err(Broken::Violation("READ data beyond the request".into()))
        } else {
            let (r, tmp) = self.recv_vec(eng, Vec::new(), n as usize).await;
            if r.is_ok() {
                bounce[a..b].copy_from_slice(&tmp);
            }
            r
        };
        let mut st = self.st.borrow_mut();
        let s = &mut st.slots[idx];
        s.bounce = Some(bounce);
        s.lent = false;
        if r.is_ok() {
            s.covered += u64::from(n);
        }
        if s.phase == Phase::Done {
            if s.abandoned {
                free(&mut st, idx);
            } else if let Some(t) = s.task {
                eng.wake(t);
            }
        }
        r
    }

    /// Puts a lent window back; if the request was finished meanwhile (the connection broke), its
    /// owner may now take it (or, abandoned, the slot is freed).
    fn restore(&self, eng: &Engine, idx: usize, win: Slice) {
        let mut st = self.st.borrow_mut();
        let s = &mut st.slots[idx];
        s.win = Some(win);
        s.lent = false;
        if s.phase == Phase::Done {
            if s.abandoned {
                free(&mut st, idx);
            } else if let Some(t) = s.task {
                eng.wake(t);
            }
        }
    }

    fn set_error(&self, idx: usize, errno: i32) {
        self.st.borrow_mut().slots[idx].error.get_or_insert(errno);
    }

    fn complete(&self, eng: &Engine, idx: usize) {
        let mut st = self.st.borrow_mut();
        let s = &mut st.slots[idx];
        s.phase = Phase::Done;
        if s.abandoned {
            free(&mut st, idx);
        } else if let Some(t) = s.task {
            eng.wake(t);
        }
    }

    fn slot_of(&self, cookie: u64) -> Result<usize, Broken> {
        let st = self.st.borrow();
        let idx = (cookie & 0xffff) as usize;
        match st.slots.get(idx) {
            Some(s) if s.cookie == cookie && s.phase == Phase::Sent => Ok(idx),
            _ => Err(Broken::Violation(format!(
                "reply with unknown cookie {cookie:#x}"
            ))),
        }
    }

    /// A clean goodbye, with blocking I/O (the queue's ring is gone by now): a flush if writes
    /// are not yet flushed, then `NBD_CMD_DISC`; all of it by one deadline, the timeout.
    fn goodbye(&mut self) {
        let st = self.st.get_mut();
        if st.broken {
            return;
        }
        let flush = self.writable && st.dirty && self.export.has(nbd::FLAG_SEND_FLUSH);
        let mut sock = Deadlined::until(&self.sock, Instant::now() + self.timeout);
        match self.tls.as_mut() {
            Some(tls) => {
                let w = tls.get_mut();
                // Ciphertext received but not yet processed belongs to the session first.
                if let Some(rx) = w.rx.as_ref() {
                    let mut pending = rx.get(w.rx_at..w.rx_len).unwrap_or_default();
                    while !pending.is_empty() {
                        match w.session.read_tls(&mut pending) {
                            Ok(n) if n > 0 => {
                                if w.session.process_new_packets().is_err() {
                                    return;
                                }
                            }
                            _ => break,
                        }
                    }
                }
                let mut s = rustls::Stream::new(&mut *w.session, &mut sock);
                goodbye_on(&mut s, flush);
                w.session.send_close_notify();
                let _ = w.session.complete_io(&mut sock);
            }
            None => goodbye_on(&mut sock, flush),
        }
    }
}

/// The goodbye's requests on a blocking stream (the socket, or its TLS session).
fn goodbye_on<S: Read + Write>(sock: &mut S, flush: bool) {
    {
        let mut b = [0u8; REQUEST_LEN];
        if flush {
            wire::encode_request(&mut b, 0, Command::Flush, 1, 0, 0);
            let mut head = [0u8; HEAD_LEN];
            let ok = sock.write_all(&b).is_ok() && sock.read_exact(&mut head).is_ok();
            let flushed = ok
                && match ReplyHeader::decode(&head) {
                    Ok(ReplyHeader::Simple { error: 0, .. }) => true,
                    Ok(ReplyHeader::Chunk {
                        kind: Chunk::None, ..
                    }) => {
                        let mut l = [0u8; 4];
                        sock.read_exact(&mut l).is_ok() && l == [0; 4]
                    }
                    _ => false,
                };
            if !flushed {
                tracing::warn!("NBD: the flush at disconnect failed");
            }
        }
        wire::encode_request(&mut b, 0, Command::Disc, 2, 0, 0);
        let _ = sock.write_all(&b);
        let _ = sock.flush();
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.goodbye();
    }
}

/// The result of the request in slot `idx`, whose reply is complete: its error, `EIO` for a
/// READ the server answered only in part, else what BLOCK_STATUS found. A successful change
/// marks the connection dirty, a FLUSH clean. Frees the slot.
fn settle(st: &mut State, idx: usize) -> Result<Outcome, i32> {
    let slot = &st.slots[idx];
    let res = match (slot.error, slot.cmd) {
        (Some(e), _) => Err(e),
        (None, Command::Read) if slot.covered != u64::from(slot.len) => {
            tracing::warn!(
                "NBD read of {} bytes at {} answered only {} bytes",
                slot.len,
                slot.off,
                slot.covered
            );
            Err(libc::EIO)
        }
        _ => Ok(Outcome {
            extent: slot.extents.first,
            covered: slot.extents.covered,
            allocated: slot.extents.allocated,
        }),
    };
    if res.is_ok() {
        match slot.cmd {
            Command::Write | Command::Trim | Command::WriteZeroes => st.dirty = true,
            Command::Flush => st.dirty = false,
            _ => {}
        }
    }
    free(st, idx);
    res
}

fn free(st: &mut State, idx: usize) {
    let s = &mut st.slots[idx];
    if s.phase == Phase::Free {
        return;
    }
    s.phase = Phase::Free;
    s.win = None;
    s.bounce = None;
    s.task = None;
    st.free.push(idx as u16);
}

/// Records that the request in slot `idx` (just marked sent) must be answered within `timeout`.
fn note_sent(st: &mut State, idx: usize, timeout: Duration) {
    if st.pending.len() >= 2 * st.slots.len() {
        // Mostly entries of requests answered while an older one waits: keep the live ones.
        let slots = &st.slots;
        st.pending.retain(|&(i, cookie, _)| {
            let s = &slots[usize::from(i)];
            s.cookie == cookie && s.phase == Phase::Sent
        });
    }
    let cookie = st.slots[idx].cookie;
    st.pending
        .push_back((idx as u16, cookie, Instant::now() + timeout));
}

/// A transfer's result as "all of it moved", or why the connection is broken. A waiting
/// operation cut short once its `deadline` passed (its linked timeout fired: `MSG_WAITALL`
/// returns what it moved, or `ECANCELED` if nothing) is the deadline, not the server closing
/// the connection; `send` tells a send from a receive.
fn check(
    r: std::io::Result<usize>,
    want: usize,
    deadline: Option<Instant>,
    send: bool,
) -> Result<(), Broken> {
    let late = || {
        if send {
            Broken::SendTimeout
        } else {
            Broken::Timeout
        }
    };
    match r {
        Ok(n) if n == want => Ok(()),
        Ok(_) if deadline.is_some_and(|d| Instant::now() >= d) => Err(late()),
        Ok(_) => Err(Broken::Closed),
        Err(e) if e.raw_os_error() == Some(libc::ECANCELED) => Err(late()),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EPIPE | libc::ECONNRESET)) => {
            Err(Broken::Closed)
        }
        Err(e) => Err(Broken::Io(e)),
    }
}

/// Releases the send permit; a send cut short (its future dropped) leaves half a request on the
/// stream, so it breaks the connection.
struct Permit<'a> {
    conn: &'a Conn,
    eng: &'a Engine,
    clean: bool,
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if !self.clean {
            self.conn.break_conn(
                self.eng,
                Broken::Violation("a request's send was cancelled".into()),
            );
        }
        self.conn.sending.release(self.eng);
    }
}

/// The header-sender role; dropped before every queued header went out (its future dropped),
/// requests would wait for replies to headers never sent, so the connection breaks.
struct Sender<'a> {
    conn: &'a Conn,
    eng: &'a Engine,
    clean: bool,
}

impl Drop for Sender<'_> {
    fn drop(&mut self) {
        if !self.clean {
            self.conn.break_conn(
                self.eng,
                Broken::Violation("a request's send was cancelled".into()),
            );
        }
        let mut st = self.conn.st.borrow_mut();
        st.flushing = false;
        st.out.clear();
    }
}

/// The receiver role; dropped mid-reply (its future dropped), the stream position is lost, so
/// the connection breaks.
struct Role<'a> {
    conn: &'a Conn,
    eng: &'a Engine,
    clean: bool,
}

impl Drop for Role<'_> {
    fn drop(&mut self) {
        if !self.clean {
            self.conn.break_conn(
                self.eng,
                Broken::Violation("a reply's receipt was cancelled".into()),
            );
        }
        self.conn.st.borrow_mut().receiving = false;
        if !self.clean {
            self.conn.hand_off(self.eng);
        }
    }
}

/// A request whose future is dropped before it finished: the slot is freed now if nothing can
/// arrive for it any more, else when its reply (or the break) comes.
struct SlotGuard<'a> {
    conn: &'a Conn,
    idx: usize,
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        let mut st = self.conn.st.borrow_mut();
        let s = &mut st.slots[self.idx];
        match s.phase {
            Phase::Queued => free(&mut st, self.idx),
            Phase::Done if !s.lent => free(&mut st, self.idx),
            _ => {
                s.abandoned = true;
                s.task = None;
            }
        }
    }
}

/// Returns `Pending` once (the task is woken by whoever finishes its request), then `Ready`.
struct YieldOnce(bool);

impl Future for YieldOnce {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            Poll::Ready(())
        } else {
            self.0 = true;
            Poll::Pending
        }
    }
}
