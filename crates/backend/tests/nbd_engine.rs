//! The NBD backend on one engine, without FUSE, against an in-test server that answers the way
//! the protocol allows but real servers rarely do: replies out of order, READs split into several
//! data and hole chunks, error chunks, block status extents. Checks the bytes and errnos each
//! request gets, and that the connection survives what is legal. A second server advertises a
//! minimum block size of 512 and fails anything not aligned to it: unaligned reads, concurrent
//! unaligned writes sharing blocks, writes and zeroes with unaligned ends must reach it whole
//! and lose no update; `st_blocks` comes from one BLOCK_STATUS walk whose reply is longer than
//! the client's meta buffer.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::thread;

use backend::{BlockBackend, NbdBackend, NbdOptions, Seek};
use engine::{Engine, EngineConfig};

const SIZE: usize = 1 << 20;
/// READs the server takes before answering any (then answered last first).
const BATCH: usize = 8;
/// A READ at this offset gets an error chunk (ENOSPC).
const BAD_OFFSET: u64 = 0xF0000;
const CTX: u32 = 3;

fn pattern(off: usize) -> u8 {
    (off % 253) as u8 | 1
}

/// fusex's NBD backend, writable, on the server listening at `sock`.
fn open_writable(sock: &std::path::Path) -> Rc<NbdBackend> {
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let opts = NbdOptions {
        writable: true,
        ..NbdOptions::default()
    };
    Rc::new(NbdBackend::open(&uri, opts).unwrap())
}

/// An engine with one 8 KiB buffer: enough for a single request.
fn one_buffer_engine() -> Engine {
    Engine::new(&EngineConfig {
        buffers: 1,
        buffer_size: 8192,
        ..EngineConfig::default()
    })
    .unwrap()
}

/// A `SIZE`-byte image: [`pattern`] in its first `data` bytes, zeroes after.
fn image(data: usize) -> Arc<Mutex<Vec<u8>>> {
    let mut init = vec![0u8; SIZE];
    for (i, b) in init.iter_mut().enumerate().take(data) {
        *b = pattern(i);
    }
    Arc::new(Mutex::new(init))
}

fn opt_reply(s: &mut UnixStream, opt: u32, ty: u32, data: &[u8]) {
    let mut r = 0x0003_e889_0455_65a9u64.to_be_bytes().to_vec();
    r.extend_from_slice(&opt.to_be_bytes());
    r.extend_from_slice(&ty.to_be_bytes());
    r.extend_from_slice(&(data.len() as u32).to_be_bytes());
    r.extend_from_slice(data);
    s.write_all(&r).unwrap();
}

fn handshake(s: &mut UnixStream) -> bool {
    handshake_with(s, None)
}

/// The handshake, advertising `min_block` (with a preferred size of 4096 and 64 KiB at most)
/// when given.
fn handshake_with(s: &mut UnixStream, min_block: Option<u32>) -> bool {
    handshake_flags(s, min_block, true)
}

/// [`handshake_with`], advertising multi-conn or not.
fn handshake_flags(s: &mut UnixStream, min_block: Option<u32>, multi_conn: bool) -> bool {
    let mut g = b"NBDMAGICIHAVEOPT".to_vec();
    g.extend_from_slice(&3u16.to_be_bytes());
    s.write_all(&g).unwrap();
    let mut c = [0u8; 4];
    if s.read_exact(&mut c).is_err() {
        return false;
    }
    loop {
        let mut h = [0u8; 16];
        if s.read_exact(&mut h).is_err() {
            return false;
        }
        let opt = u32::from_be_bytes(h[8..12].try_into().unwrap());
        let mut d = vec![0u8; u32::from_be_bytes(h[12..16].try_into().unwrap()) as usize];
        s.read_exact(&mut d).unwrap();
        match opt {
            8 => opt_reply(s, opt, 1, &[]),
            10 => {
                let mut m = CTX.to_be_bytes().to_vec();
                m.extend_from_slice(b"base:allocation");
                opt_reply(s, opt, 4, &m);
                opt_reply(s, opt, 1, &[]);
            }
            7 => {
                let mut i = 0u16.to_be_bytes().to_vec();
                i.extend_from_slice(&(SIZE as u64).to_be_bytes());
                // HAS_FLAGS | SEND_FLUSH | SEND_WRITE_ZEROES | CAN_MULTI_CONN
                let multi = if multi_conn { 256 } else { 0 };
                i.extend_from_slice(&(1u16 | 4 | 64 | multi).to_be_bytes());
                opt_reply(s, opt, 3, &i);
                if let Some(m) = min_block {
                    let mut b = 3u16.to_be_bytes().to_vec();
                    for v in [m, 4096, 65536] {
                        b.extend_from_slice(&v.to_be_bytes());
                    }
                    opt_reply(s, opt, 3, &b);
                }
                opt_reply(s, opt, 1, &[]);
                return true;
            }
            _ => opt_reply(s, opt, (1 << 31) + 1, &[]),
        }
    }
}

fn chunk(out: &mut Vec<u8>, flags: u16, ty: u16, cookie: u64, payload: &[u8]) {
    out.extend_from_slice(&0x668e_33efu32.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&ty.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
}

/// A READ answered in pieces: the first half as data, the rest as data or (where the memory is
/// zero) a hole, the last piece flagged done.
fn read_reply(mem: &[u8], cookie: u64, off: u64, len: u32) -> Vec<u8> {
    let mut out = Vec::new();
    if off == BAD_OFFSET {
        let mut p = 28u32.to_be_bytes().to_vec();
        p.extend_from_slice(&4u16.to_be_bytes());
        p.extend_from_slice(b"full");
        chunk(&mut out, 1, 0x8001, cookie, &p);
        return out;
    }
    let (o, l) = (off as usize, len as usize);
    let pieces = [(o, l / 2), (o + l / 2, l - l / 2)];
    for (i, (at, n)) in pieces.into_iter().enumerate() {
        if n == 0 {
            continue;
        }
        let done = if i == 1 { 1 } else { 0 };
        let data = &mem[at..at + n];
        let mut p = (at as u64).to_be_bytes().to_vec();
        if data.iter().all(|&b| b == 0) {
            p.extend_from_slice(&(n as u32).to_be_bytes());
            chunk(&mut out, done, 2, cookie, &p);
        } else {
            p.extend_from_slice(data);
            chunk(&mut out, done, 1, cookie, &p);
        }
    }
    out
}

fn serve(mut s: UnixStream, mem: Arc<Mutex<Vec<u8>>>) {
    if !handshake(&mut s) {
        return;
    }
    let mut batch: Vec<(u64, u64, u32)> = Vec::new();
    let mut batched = false;
    // The first BATCH writes are answered together, last first, in one send: simple replies
    // back to back in the client's stream buffer.
    let mut write_acks: Vec<u64> = Vec::new();
    loop {
        let mut rq = [0u8; 28];
        if s.read_exact(&mut rq).is_err() {
            return;
        }
        let flags = u16::from_be_bytes([rq[4], rq[5]]);
        let ty = u16::from_be_bytes([rq[6], rq[7]]);
        let cookie = u64::from_be_bytes(rq[8..16].try_into().unwrap());
        let off = u64::from_be_bytes(rq[16..24].try_into().unwrap());
        let len = u32::from_be_bytes(rq[24..28].try_into().unwrap());
        let simple_ok = |out: &mut Vec<u8>| {
            out.extend_from_slice(&0x6744_6698u32.to_be_bytes());
            out.extend_from_slice(&0u32.to_be_bytes());
            out.extend_from_slice(&cookie.to_be_bytes());
        };
        let mut out = Vec::new();
        match ty {
            0 if !batched => {
                batch.push((cookie, off, len));
                if batch.len() == BATCH {
                    batched = true;
                    let m = mem.lock().unwrap();
                    for &(c, o, l) in batch.iter().rev() {
                        out.extend(read_reply(&m, c, o, l));
                    }
                }
            }
            0 => out = read_reply(&mem.lock().unwrap(), cookie, off, len),
            1 => {
                let mut d = vec![0u8; len as usize];
                s.read_exact(&mut d).unwrap();
                mem.lock().unwrap()[off as usize..off as usize + len as usize].copy_from_slice(&d);
                if write_acks.len() < BATCH {
                    write_acks.push(cookie);
                    if write_acks.len() == BATCH {
                        for c in write_acks.iter().rev() {
                            out.extend_from_slice(&0x6744_6698u32.to_be_bytes());
                            out.extend_from_slice(&0u32.to_be_bytes());
                            out.extend_from_slice(&c.to_be_bytes());
                        }
                    }
                } else {
                    simple_ok(&mut out);
                }
            }
            6 => {
                mem.lock().unwrap()[off as usize..off as usize + len as usize].fill(0);
                simple_ok(&mut out);
            }
            7 => {
                assert_ne!(flags & 8, 0, "block status without REQ_ONE");
                let m = mem.lock().unwrap();
                let o = off as usize;
                let zero = m[o] == 0;
                let run = m[o..].iter().take_while(|&&b| (b == 0) == zero).count();
                let mut p = CTX.to_be_bytes().to_vec();
                p.extend_from_slice(&(run.min(len as usize) as u32).to_be_bytes());
                p.extend_from_slice(&(if zero { 3u32 } else { 0 }).to_be_bytes());
                chunk(&mut out, 1, 5, cookie, &p);
            }
            2 => return,
            _ => simple_ok(&mut out),
        }
        if !out.is_empty() && s.write_all(&out).is_err() {
            return;
        }
    }
}

#[test]
fn out_of_order_split_replies_errors_and_block_status() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let mem = image(SIZE / 2);
    {
        let mem = mem.clone();
        thread::spawn(move || {
            for s in listener.incoming() {
                let Ok(s) = s else { return };
                let mem = mem.clone();
                thread::spawn(move || serve(s, mem));
            }
        });
    }
    let b = open_writable(&sock);
    assert_eq!(b.size(), SIZE as u64);
    assert!(b.multi_conn());
    let eng = Rc::new(
        Engine::new(&EngineConfig {
            buffers: BATCH + 2,
            buffer_size: 65536,
            ..EngineConfig::default()
        })
        .unwrap(),
    );
    // BATCH concurrent reads, answered last first, each in a data and a data-or-hole chunk; the
    // ones straddling the middle of the export get half data, half hole.
    let expect = mem.lock().unwrap().clone();
    for t in 0..BATCH {
        let (b, e, expect) = (b.clone(), eng.clone(), expect.clone());
        eng.spawn(async move {
            let off = SIZE / 2 - 4 * 24576 + t * 24576;
            let buf = e.take_buffer().unwrap();
            let (r, win) = b.read_at(&e, buf.slice(100..100 + 24576), off as u64).await;
            assert_eq!(r.unwrap(), 24576, "read {t}");
            assert_eq!(win.start(), 100);
            assert!(
                win.as_slice() == &expect[off..off + 24576],
                "read {t} bytes"
            );
        });
    }
    eng.run().unwrap();
    // BATCH concurrent writes far from everything else, acknowledged together.
    for t in 0..BATCH {
        let (b, e) = (b.clone(), eng.clone());
        eng.spawn(async move {
            let mut buf = e.take_buffer().unwrap();
            buf.as_mut_slice()[..4096].fill(t as u8 + 0x40);
            let off = SIZE as u64 / 2 + 65536 + t as u64 * 4096;
            let (r, _) = b.write_at(&e, buf.slice(0..4096), off).await;
            assert_eq!(r.unwrap(), 4096, "write {t}");
        });
    }
    eng.run().unwrap();
    {
        let mut m = mem.lock().unwrap();
        for t in 0..BATCH {
            let off = SIZE / 2 + 65536 + t * 4096;
            assert!(
                m[off..off + 4096].iter().all(|&x| x == t as u8 + 0x40),
                "write {t}"
            );
            // Back to zero for the block status checks below.
            m[off..off + 4096].fill(0);
        }
    }

    let e = &*eng;
    // An error chunk fails that request only.
    let buf = e.take_buffer().unwrap();
    let (r, win) = e
        .block_on(b.read_at(e, buf.slice(0..4096), BAD_OFFSET))
        .unwrap();
    assert_eq!(r.unwrap_err().errno(), libc::ENOSPC);
    // Writes, zeroes and a flush on the same connection.
    let mut buf = win.into_inner();
    buf.as_mut_slice()[..8192].fill(0xee);
    let (r, win) = e.block_on(b.write_at(e, buf.slice(0..8192), 4096)).unwrap();
    assert_eq!(r.unwrap(), 8192);
    e.block_on(b.write_zeroes(e, 65536, 4096)).unwrap().unwrap();
    e.block_on(b.flush(e)).unwrap().unwrap();
    {
        let m = mem.lock().unwrap();
        assert!(m[4096..12288].iter().all(|&x| x == 0xee));
        assert!(m[65536..69632].iter().all(|&x| x == 0));
    }
    let (r, win) = e
        .block_on(b.read_at(e, win.into_inner().slice(0..16384), 0))
        .unwrap();
    assert_eq!(r.unwrap(), 16384);
    assert!(win.as_slice()[4096..12288].iter().all(|&x| x == 0xee));
    assert_eq!(win.as_slice()[0], pattern(0));
    // Block status: data up to the zeroed range, a hole there, data again, a hole from the middle.
    let seek = |off, w| e.block_on(b.seek(e, off, w)).unwrap().unwrap();
    assert_eq!(seek(0, Seek::Data), Some(0));
    assert_eq!(seek(0, Seek::Hole), Some(65536));
    assert_eq!(seek(65536, Seek::Data), Some(69632));
    assert_eq!(seek(70000, Seek::Hole), Some(SIZE as u64 / 2));
    assert_eq!(seek(SIZE as u64 / 2, Seek::Data), None);
    assert_eq!(seek(SIZE as u64 - 1, Seek::Hole), Some(SIZE as u64 - 1));
    // Reads past the end are empty; the connection is still the first one.
    let (r, _) = e
        .block_on(b.read_at(e, win.into_inner().slice(0..4096), SIZE as u64))
        .unwrap();
    assert_eq!(r.unwrap(), 0);
}

/// Minimum block size of the strict server below.
const MIN: usize = 512;

/// What the strict server saw.
#[derive(Default)]
struct Seen {
    /// Requests not aligned to [`MIN`] (answered with EINVAL).
    misaligned: usize,
    /// BLOCK_STATUS requests without REQ_ONE.
    walks: usize,
}

/// A server with a minimum block size of [`MIN`] that fails every request not aligned to it
/// (as nbdkit's blocksize-policy filter does), and answers BLOCK_STATUS without REQ_ONE with one
/// extent per block (thousands per reply: longer than the client's meta buffer).
fn serve_strict(s: UnixStream, mem: Arc<Mutex<Vec<u8>>>, seen: Arc<Mutex<Seen>>) {
    serve_strict_flags(s, mem, seen, true)
}

/// [`serve_strict`], advertising multi-conn or not.
fn serve_strict_flags(
    mut s: UnixStream,
    mem: Arc<Mutex<Vec<u8>>>,
    seen: Arc<Mutex<Seen>>,
    multi_conn: bool,
) {
    if !handshake_flags(&mut s, Some(MIN as u32), multi_conn) {
        return;
    }
    loop {
        let mut rq = [0u8; 28];
        if s.read_exact(&mut rq).is_err() {
            return;
        }
        let flags = u16::from_be_bytes([rq[4], rq[5]]);
        let ty = u16::from_be_bytes([rq[6], rq[7]]);
        let cookie = u64::from_be_bytes(rq[8..16].try_into().unwrap());
        let off = u64::from_be_bytes(rq[16..24].try_into().unwrap()) as usize;
        let len = u32::from_be_bytes(rq[24..28].try_into().unwrap()) as usize;
        let simple = |out: &mut Vec<u8>, err: u32| {
            out.extend_from_slice(&0x6744_6698u32.to_be_bytes());
            out.extend_from_slice(&err.to_be_bytes());
            out.extend_from_slice(&cookie.to_be_bytes());
        };
        let mut out = Vec::new();
        let aligned = off.is_multiple_of(MIN) && len.is_multiple_of(MIN);
        if ty == 1 {
            let mut d = vec![0u8; len];
            s.read_exact(&mut d).unwrap();
            if aligned {
                mem.lock().unwrap()[off..off + len].copy_from_slice(&d);
            }
        }
        if matches!(ty, 0 | 1 | 6 | 7) && !aligned {
            seen.lock().unwrap().misaligned += 1;
            simple(&mut out, 22);
        } else {
            match ty {
                0 => out = read_reply(&mem.lock().unwrap(), cookie, off as u64, len as u32),
                6 => {
                    mem.lock().unwrap()[off..off + len].fill(0);
                    simple(&mut out, 0);
                }
                7 => {
                    let m = mem.lock().unwrap();
                    let mut p = CTX.to_be_bytes().to_vec();
                    let blocks = if flags & 8 != 0 { 1 } else { len / MIN };
                    if flags & 8 == 0 {
                        seen.lock().unwrap().walks += 1;
                    }
                    for b in 0..blocks {
                        let at = off + b * MIN;
                        let zero = m[at..at + MIN].iter().all(|&x| x == 0);
                        p.extend_from_slice(&(MIN as u32).to_be_bytes());
                        p.extend_from_slice(&(if zero { 3u32 } else { 0 }).to_be_bytes());
                    }
                    chunk(&mut out, 1, 5, cookie, &p);
                }
                2 => return,
                _ => simple(&mut out, 0),
            }
        }
        if !out.is_empty() && s.write_all(&out).is_err() {
            return;
        }
    }
}

/// Bytes of `mem` in blocks of [`MIN`] that are not all zero.
fn allocated(mem: &[u8]) -> u64 {
    mem.chunks(MIN)
        .filter(|c| c.iter().any(|&x| x != 0))
        .count() as u64
        * MIN as u64
}

#[test]
fn unaligned_requests_are_made_whole_and_st_blocks_counts_extents() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("strict.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    // Data in the first quarter, zeroes after.
    let mem = image(SIZE / 4);
    let seen = Arc::new(Mutex::new(Seen::default()));
    {
        let (mem, seen) = (mem.clone(), seen.clone());
        thread::spawn(move || {
            for s in listener.incoming() {
                let Ok(s) = s else { return };
                let (mem, seen) = (mem.clone(), seen.clone());
                thread::spawn(move || serve_strict(s, mem, seen));
            }
        });
    }
    let b = open_writable(&sock);
    assert_eq!(b.export().min_block, MIN as u32);
    let eng = Rc::new(
        Engine::new(&EngineConfig {
            buffers: 40,
            buffer_size: 65536,
            ..EngineConfig::default()
        })
        .unwrap(),
    );
    let mut model = mem.lock().unwrap().clone();

    // Unaligned reads, within one block, across blocks, across data and holes.
    for (off, len) in [
        (100usize, 1000usize),
        (511, 2),
        (7, 512),
        (SIZE / 4 - 300, 5000),
    ] {
        let buf = eng.take_buffer().unwrap();
        let (r, win) = eng
            .block_on(b.read_at(&eng, buf.slice(3..3 + len), off as u64))
            .unwrap();
        assert_eq!(r.unwrap(), len, "read {len} at {off}");
        assert!(
            win.as_slice() == &model[off..off + len],
            "read {len} at {off}"
        );
    }
    // The end of the export, unaligned.
    let buf = eng.take_buffer().unwrap();
    let (r, _) = eng
        .block_on(b.read_at(&eng, buf.slice(0..1000), SIZE as u64 - 300))
        .unwrap();
    assert_eq!(r.unwrap(), 300);

    // 32 writes of 37 bytes each, all at once, on disjoint bytes of the same few blocks (and 8
    // more spanning a block boundary): without the region lock, read-modify-writes interleave and
    // undo each other.
    let mut writes: Vec<(usize, usize)> = (0..32).map(|t| (1000 + t * 37, 37)).collect();
    writes.extend((0..8).map(|t| (SIZE / 2 + t * 4096 + 500, 700)));
    for (t, &(off, len)) in writes.iter().enumerate() {
        model[off..off + len].fill(t as u8 + 1);
        let (b, e) = (b.clone(), eng.clone());
        eng.spawn(async move {
            let mut buf = e.take_buffer().unwrap();
            buf.as_mut_slice()[..len].fill(t as u8 + 1);
            let (r, _) = b.write_at(&e, buf.slice(0..len), off as u64).await;
            assert_eq!(r.unwrap(), len, "write {t}");
        });
    }
    eng.run().unwrap();
    assert!(*mem.lock().unwrap() == model, "concurrent unaligned writes");

    // One write with an unaligned head, whole blocks and an unaligned tail.
    let (off, len) = (SIZE / 4 + 700, 5000);
    let mut buf = eng.take_buffer().unwrap();
    for (i, x) in buf.as_mut_slice()[..len].iter_mut().enumerate() {
        *x = (i % 251) as u8 | 0x80;
    }
    model[off..off + len].copy_from_slice(&buf.as_slice()[..len]);
    let (r, _) = eng
        .block_on(b.write_at(&eng, buf.slice(0..len), off as u64))
        .unwrap();
    assert_eq!(r.unwrap(), len);
    // Zeroes (kept allocated, and punched) with unaligned ends.
    eng.block_on(b.write_zeroes(&eng, 300, 2000))
        .unwrap()
        .unwrap();
    model[300..2300].fill(0);
    eng.block_on(b.discard(&eng, SIZE as u64 / 4 + 1000, 100))
        .unwrap()
        .unwrap();
    model[SIZE / 4 + 1000..SIZE / 4 + 1100].fill(0);
    eng.block_on(b.discard(&eng, 5000, 9000)).unwrap().unwrap();
    model[5000..14000].fill(0);
    assert!(*mem.lock().unwrap() == model, "write and zeroes");
    assert_eq!(
        seen.lock().unwrap().misaligned,
        0,
        "misaligned requests sent"
    );

    // st_blocks: the blocks that are not holes, from one walk (2048 extents in one reply).
    let alloc = |b: &NbdBackend| eng.block_on(b.attrs(&eng)).unwrap().unwrap().allocated;
    let t = std::time::Instant::now();
    assert_eq!(alloc(&b), allocated(&model));
    let walks = seen.lock().unwrap().walks;
    assert_eq!(walks, 1);
    let again = alloc(&b);
    if t.elapsed() < std::time::Duration::from_secs(1) {
        // Both within the count's second (it is cached for 1 s): no second walk.
        assert_eq!(seen.lock().unwrap().walks, walks);
        assert_eq!(again, allocated(&model));
    }
    // A write invalidates the count at once.
    let mut buf = eng.take_buffer().unwrap();
    buf.as_mut_slice()[..4096].fill(0x11);
    let (r, _) = eng
        .block_on(b.write_at(&eng, buf.slice(0..4096), SIZE as u64 - 8192))
        .unwrap();
    assert_eq!(r.unwrap(), 4096);
    model[SIZE - 8192..SIZE - 4096].fill(0x11);
    assert_eq!(alloc(&b), allocated(&model));
    assert_eq!(
        seen.lock().unwrap().misaligned,
        0,
        "misaligned requests sent"
    );
}

/// A server that negotiates, reads one request, sends `reply` and hangs up.
fn one_shot_server(reply: Vec<u8>) -> (tempfile::TempDir, String) {
    scripted_server(move |s, _| {
        let _ = s.write_all(&reply);
    })
}

/// A server that negotiates, reads one request and hands the stream and the request to `answer`.
fn scripted_server(
    answer: impl FnOnce(&mut UnixStream, [u8; 28]) + Send + 'static,
) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    thread::spawn(move || {
        let Ok((mut s, _)) = listener.accept() else {
            return;
        };
        if !handshake(&mut s) {
            return;
        }
        let mut rq = [0u8; 28];
        if s.read_exact(&mut rq).is_ok() {
            answer(&mut s, rq);
        }
    });
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    (dir, uri)
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

    /// Any corruption of a valid READ reply (flipped bytes, a cut, trailing garbage) gives the
    /// read a result, an error or 4096 bytes, and never a panic or a read past the window.
    #[test]
    fn corrupted_read_replies_are_survived(
        flips in proptest::collection::vec((0usize..4150, 1u8..=255), 0..4),
        cut in 0usize..4200,
        extra in proptest::collection::vec(proptest::num::u8::ANY, 0..48),
    ) {
        // The first request on a connection has cookie (1 << 16) | slot 0.
        let mut p = 0u64.to_be_bytes().to_vec();
        p.extend((0..4096).map(pattern));
        let mut reply = Vec::new();
        chunk(&mut reply, 1, 1, 1 << 16, &p);
        for (at, x) in &flips {
            if let Some(b) = reply.get_mut(*at) {
                *b ^= x;
            }
        }
        reply.truncate(cut.max(1));
        reply.extend_from_slice(&extra);
        let (_dir, uri) = one_shot_server(reply);
        let b = NbdBackend::open(&uri, NbdOptions {
            timeout: std::time::Duration::from_secs(5),
            ..NbdOptions::default()
        }).unwrap();
        let eng = one_buffer_engine();
        let buf = eng.take_buffer().unwrap();
        let (r, win) = eng.block_on(b.read_at(&eng, buf.slice(1000..5096), 0)).unwrap();
        proptest::prop_assert_eq!((win.start(), win.end()), (1000, 5096));
        match r {
            Ok(n) => proptest::prop_assert_eq!(n, 4096),
            Err(e) => proptest::prop_assert!(e.errno() > 0),
        }
    }
}

/// A READ whose reply comes a byte every 400 ms fails once the request is 1 s old: the
/// timeout bounds the whole reply, not each receive (each of which gets its byte in time; the
/// 4 KiB reply would take half an hour).
#[test]
fn a_dripping_reply_fails_by_the_timeout() {
    let (_dir, uri) = scripted_server(|s, rq| {
        let cookie = u64::from_be_bytes(rq[8..16].try_into().unwrap());
        let mut p = 0u64.to_be_bytes().to_vec();
        p.extend((0..4096).map(pattern));
        let mut reply = Vec::new();
        chunk(&mut reply, 1, 1, cookie, &p);
        for b in reply {
            if s.write_all(&[b]).is_err() {
                return;
            }
            thread::sleep(std::time::Duration::from_millis(400));
        }
    });
    let b = NbdBackend::open(
        &uri,
        NbdOptions {
            timeout: std::time::Duration::from_secs(1),
            ..NbdOptions::default()
        },
    )
    .unwrap();
    let eng = one_buffer_engine();
    let buf = eng.take_buffer().unwrap();
    let started = std::time::Instant::now();
    let (r, _) = eng
        .block_on(b.read_at(&eng, buf.slice(0..4096), 0))
        .unwrap();
    let took = started.elapsed();
    assert_eq!(r.map_err(|e| e.errno()).err(), Some(libc::EIO));
    // Bounded by the 1 s timeout (generously); a timeout per receive took 12 s here.
    assert!(took < std::time::Duration::from_secs(6), "{took:?}");
}

/// Serves [`serve_strict`] on `sock` from now on (it answers each request at once), a thread
/// per connection.
fn listen(sock: &std::path::Path, mem: Arc<Mutex<Vec<u8>>>) {
    let listener = UnixListener::bind(sock).unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(s) = s else { return };
            let (mem, seen) = (mem.clone(), seen.clone());
            thread::spawn(move || serve_strict(s, mem, seen));
        }
    });
}

/// `fusex restart`'s successor: [`NbdBackend::adopt`] makes the backend from the export its
/// predecessor negotiated without connecting (nothing even listens yet); the first request
/// connects and is served. A server that now exports another size is not used: the request
/// fails with EIO.
#[test]
fn an_adopted_export_connects_on_its_first_request_and_checks_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let first = dir.path().join("first.sock");
    let mem = image(SIZE);
    listen(&first, mem.clone());
    let negotiated = *open_writable(&first).export();
    let sock = dir.path().join("s.sock");
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let opts = NbdOptions {
        writable: true,
        adopt: Some(negotiated),
        ..NbdOptions::default()
    };
    let b = NbdBackend::open(&uri, opts).expect("adopted without a server");
    assert_eq!(b.size(), SIZE as u64);
    listen(&sock, mem);
    let eng = one_buffer_engine();
    let buf = eng.take_buffer().unwrap();
    let (r, win) = eng
        .block_on(b.read_at(&eng, buf.slice(0..4096), 8192))
        .unwrap();
    assert_eq!(r.unwrap(), 4096);
    assert!(win
        .as_slice()
        .iter()
        .enumerate()
        .all(|(i, &x)| x == pattern(8192 + i)));
    b.queue_ended();

    let grown = nbd::Export {
        size: negotiated.size * 2,
        ..negotiated
    };
    let other = NbdBackend::adopt(&uri, opts, grown).unwrap();
    let (r, _) = eng
        .block_on(other.read_at(&eng, win.into_inner().slice(0..4096), 0))
        .unwrap();
    assert_eq!(r.unwrap_err().errno(), libc::EIO);
    other.queue_ended();
    // A writable adoption of a read-only export is refused at once, as at open.
    let ro = nbd::Export {
        flags: negotiated.flags | nbd::FLAG_READ_ONLY,
        ..negotiated
    };
    assert!(NbdBackend::adopt(&uri, opts, ro).is_err());
}

/// A server restarted without multi-conn under an export that had it: a thread's connection is
/// refused (its requests fail with EIO) while another thread uses the backend, so no two
/// connections reach a server that promises nothing across them; one at a time is served.
#[test]
fn a_server_that_lost_multi_conn_serves_one_queue_only() {
    let dir = tempfile::tempdir().unwrap();
    let mem = image(SIZE);
    let listen_flags = |sock: &std::path::Path, multi_conn: bool| {
        let listener = UnixListener::bind(sock).unwrap();
        let mem = mem.clone();
        thread::spawn(move || {
            let seen = Arc::new(Mutex::new(Seen::default()));
            for s in listener.incoming() {
                let Ok(s) = s else { return };
                let (mem, seen) = (mem.clone(), seen.clone());
                thread::spawn(move || serve_strict_flags(s, mem, seen, multi_conn));
            }
        });
    };
    let first = dir.path().join("first.sock");
    listen_flags(&first, true);
    let negotiated = *open_writable(&first).export();
    assert!(negotiated.has(nbd::FLAG_CAN_MULTI_CONN));
    let sock = dir.path().join("s.sock");
    listen_flags(&sock, false);
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let opts = NbdOptions {
        writable: true,
        adopt: Some(negotiated),
        ..NbdOptions::default()
    };
    let b = Arc::new(NbdBackend::open(&uri, opts).unwrap());
    // Each queue thread reads 4 KiB at 8192 on an engine of its own.
    let read_on_a_thread = |b: Arc<NbdBackend>| {
        thread::spawn(move || {
            let eng = one_buffer_engine();
            let buf = eng.take_buffer().unwrap();
            let (r, win) = eng
                .block_on(b.read_at(&eng, buf.slice(0..4096), 8192))
                .unwrap();
            let ok = r.map(|n| n == 4096 && win.as_slice()[0] == pattern(8192));
            b.queue_ended();
            ok.map_err(|e| e.errno())
        })
        .join()
        .unwrap()
    };
    // A thread that used the backend and ended (as the one reading a partition table at open
    // does) is not counted: the next one is served.
    assert_eq!(
        read_on_a_thread(b.clone()),
        Ok(true),
        "the first thread is served"
    );
    assert_eq!(
        read_on_a_thread(b.clone()),
        Ok(true),
        "so is one after it ended"
    );
    // Two queue threads at once: the second one's connection is refused.
    let (hold_tx, hold_rx) = std::sync::mpsc::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let first = {
        let b = b.clone();
        thread::spawn(move || {
            let eng = one_buffer_engine();
            let buf = eng.take_buffer().unwrap();
            let (r, _) = eng
                .block_on(b.read_at(&eng, buf.slice(0..4096), 8192))
                .unwrap();
            ready_tx.send(r.is_ok()).unwrap();
            hold_rx.recv().unwrap();
            b.queue_ended();
        })
    };
    assert!(ready_rx.recv().unwrap(), "the first queue is served");
    assert_eq!(
        read_on_a_thread(b.clone()),
        Err(libc::EIO),
        "a second queue's connection is refused while the first one's is open"
    );
    hold_tx.send(()).unwrap();
    first.join().unwrap();
}
