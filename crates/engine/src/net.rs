//! Socket operations of the catalog: `SEND`/`RECV` on a connected stream socket, from and into an
//! engine buffer window (a request's own data, no copy) or a small byte vector the caller owns
//! and reuses (protocol headers), each optionally bounded by a linked timeout.
//!
//! As everywhere in the engine, the memory is taken by value and held by the op table until the
//! kernel's completion, so a dropped future cannot expose memory the kernel still writes. Sends
//! carry `MSG_NOSIGNAL` (a closed peer is `EPIPE`, never `SIGPIPE`) and `MSG_WAITALL`, as do
//! receives: the kernel keeps going until the whole window moved, the peer closed, or the timeout
//! fired; callers still handle short transfers.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use io_uring::{opcode, types};

use crate::buf::Slice;
use crate::executor::Engine;
use crate::op::{Op, Owned};
use crate::ops::{bytes, len32, with_fd};
use crate::{Fd, Sqe};

/// A deadline for one socket operation, allocated once by its owner and handed back with each
/// result, so bounding every operation costs no allocation.
#[derive(Debug)]
pub struct Timeout(Box<types::Timespec>);

impl Timeout {
    /// A timeout of `d` (relative to when the operation is submitted).
    pub fn new(d: Duration) -> Timeout {
        Timeout(Box::new(
            types::Timespec::new()
                .sec(d.as_secs())
                .nsec(d.subsec_nanos()),
        ))
    }

    /// Makes it `d` for the next operation it bounds: an owner that keeps one deadline across
    /// several operations (a reply received in pieces) gives each the time that is left.
    pub fn set(&mut self, d: Duration) {
        *self.0 = types::Timespec::new()
            .sec(d.as_secs())
            .nsec(d.subsec_nanos());
    }

    fn ptr(&self) -> *const types::Timespec {
        &*self.0
    }
}

const SEND_FLAGS: i32 = libc::MSG_NOSIGNAL | libc::MSG_WAITALL;
const RECV_FLAGS: i32 = libc::MSG_WAITALL;
/// The "try" variants: move what the socket takes or holds right now, `EAGAIN` if nothing; no
/// waiting, so no timeout to link.
const TRY_SEND_FLAGS: i32 = libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT;
const TRY_RECV_FLAGS: i32 = libc::MSG_DONTWAIT;

impl Engine {
    fn net_sqe(&self, fd: Fd, send: bool, ptr: *mut u8, len: u32, flags: i32) -> Sqe {
        if send {
            with_fd!(self.target(fd), |f| opcode::Send::new(
                f,
                ptr.cast_const(),
                len
            )
            .flags(flags)
            .build()
            .into())
        } else {
            with_fd!(self.target(fd), |f| opcode::Recv::new(f, ptr, len)
                .flags(flags)
                .build()
                .into())
        }
    }

    fn net_slice(
        &self,
        fd: Fd,
        send: bool,
        win: Slice,
        flags: i32,
        timeout: Option<Timeout>,
    ) -> NetSliceOp<'_> {
        let sqe = self.net_sqe(fd, send, win.ptr(), len32(win.len()), flags);
        let op = match timeout {
            // SAFETY: the entry points into `win`, the timespec into `t`; the op owns both
            // until its completion.
            Some(t) => unsafe { self.start_timed(sqe, t.ptr(), Owned::SliceTimed(win, t)) },
            // SAFETY: the entry points into `win`, which the op owns until its completion.
            None => unsafe { self.start(sqe, Owned::Slice(win)) },
        };
        NetSliceOp(op)
    }

    fn net_bytes(
        &self,
        fd: Fd,
        send: bool,
        mut b: Vec<u8>,
        from: usize,
        flags: i32,
        timeout: Option<Timeout>,
    ) -> BytesOp<'_> {
        let from = from.min(b.len());
        let ptr = b.as_mut_ptr().wrapping_add(from);
        let sqe = self.net_sqe(fd, send, ptr, len32(b.len() - from), flags);
        let op = match timeout {
            // SAFETY: the entry points into `b`'s heap memory (`b[from..]`, which does not move
            // with the vector), the timespec into `t`; the op owns both until its completion.
            Some(t) => unsafe { self.start_timed(sqe, t.ptr(), Owned::BytesTimed(b, t)) },
            // SAFETY: as above, without a timeout.
            None => unsafe { self.start(sqe, Owned::Bytes(b)) },
        };
        BytesOp(op)
    }

    /// Sends all of `win` on the connected socket `fd` (short only if the peer went away or the
    /// timeout fired). Returns the bytes sent, the window and the timeout.
    pub fn send(&self, fd: Fd, win: Slice, timeout: Option<Timeout>) -> NetSliceOp<'_> {
        self.net_slice(fd, true, win, SEND_FLAGS, timeout)
    }

    /// Receives exactly `win.len()` bytes into `win` from `fd` (short at end of stream or when
    /// the timeout fired).
    pub fn recv(&self, fd: Fd, win: Slice, timeout: Option<Timeout>) -> NetSliceOp<'_> {
        self.net_slice(fd, false, win, RECV_FLAGS, timeout)
    }

    /// Receives into `win` what `fd` holds right now (`MSG_DONTWAIT`: short, or `EAGAIN` when
    /// nothing is there, never waiting), so it needs no timeout.
    pub fn try_recv(&self, fd: Fd, win: Slice) -> NetSliceOp<'_> {
        self.net_slice(fd, false, win, TRY_RECV_FLAGS, None)
    }

    /// Sends what the socket takes right now of `b[from..]` (`MSG_DONTWAIT`: short, or `EAGAIN`
    /// when its buffer is full, never waiting), so it needs no timeout.
    pub fn try_send_bytes_at(&self, fd: Fd, b: Vec<u8>, from: usize) -> BytesOp<'_> {
        self.net_bytes(fd, true, b, from, TRY_SEND_FLAGS, None)
    }

    /// Sends all of `b[from..]` (`from` clamped to the length) on `fd`.
    pub fn send_bytes_at(
        &self,
        fd: Fd,
        b: Vec<u8>,
        from: usize,
        timeout: Option<Timeout>,
    ) -> BytesOp<'_> {
        self.net_bytes(fd, true, b, from, SEND_FLAGS, timeout)
    }

    /// Sends all of `b` (its length, not its capacity) on `fd`.
    pub fn send_bytes(&self, fd: Fd, b: Vec<u8>, timeout: Option<Timeout>) -> BytesOp<'_> {
        self.net_bytes(fd, true, b, 0, SEND_FLAGS, timeout)
    }

    /// Receives exactly `b.len()` bytes into `b` from `fd`.
    pub fn recv_bytes(&self, fd: Fd, b: Vec<u8>, timeout: Option<Timeout>) -> BytesOp<'_> {
        self.net_bytes(fd, false, b, 0, RECV_FLAGS, timeout)
    }

    /// Receives into `b[from..]` (`from` clamped to the length): all of it with `all`, else
    /// whatever the socket holds, at least one byte (0 at end of stream). For reading small
    /// protocol headers together with what follows them, in one operation, without waiting for
    /// bytes that may never come.
    pub fn recv_bytes_at(
        &self,
        fd: Fd,
        b: Vec<u8>,
        from: usize,
        all: bool,
        timeout: Option<Timeout>,
    ) -> BytesOp<'_> {
        let flags = if all { RECV_FLAGS } else { 0 };
        self.net_bytes(fd, false, b, from, flags, timeout)
    }
}

/// Result of a socket operation: bytes moved (or the error; `ECANCELED` when the timeout fired
/// before anything moved), the memory, and the timeout for reuse.
pub type NetResult<M> = (io::Result<usize>, M, Option<Timeout>);

/// Future of [`Engine::send`] and [`Engine::recv`].
#[must_use = "an operation's result and its window come back only when awaited"]
pub struct NetSliceOp<'e>(Op<'e>);

impl Future for NetSliceOp<'_> {
    type Output = NetResult<Slice>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match Pin::new(&mut self.0).poll(cx) {
            Poll::Ready((res, Owned::Slice(w))) => Poll::Ready((bytes(res), w, None)),
            Poll::Ready((res, Owned::SliceTimed(w, t))) => Poll::Ready((bytes(res), w, Some(t))),
            Poll::Ready(_) => panic!("NetSliceOp polled after it completed"),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Future of [`Engine::send_bytes`] and [`Engine::recv_bytes`].
#[must_use = "an operation's result and its bytes come back only when awaited"]
pub struct BytesOp<'e>(Op<'e>);

impl Future for BytesOp<'_> {
    type Output = NetResult<Vec<u8>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match Pin::new(&mut self.0).poll(cx) {
            Poll::Ready((res, Owned::Bytes(b))) => Poll::Ready((bytes(res), b, None)),
            Poll::Ready((res, Owned::BytesTimed(b, t))) => Poll::Ready((bytes(res), b, Some(t))),
            Poll::Ready(_) => panic!("BytesOp polled after it completed"),
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EngineConfig;
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    fn engine() -> Engine {
        Engine::new(&EngineConfig {
            sq_entries: 16,
            buffers: 2,
            buffer_size: 8192,
            ..EngineConfig::default()
        })
        .unwrap()
    }

    #[test]
    fn send_and_recv_whole_windows() {
        let eng = engine();
        let (a, mut b) = UnixStream::pair().unwrap();
        let fd = Fd::Raw(a.as_raw_fd());
        let mut buf = eng.take_buffer().unwrap();
        buf.as_mut_slice()[..5000].fill(7);
        let (r, win, t) = eng
            .block_on(eng.send(
                fd,
                buf.slice(0..5000),
                Some(Timeout::new(Duration::from_secs(5))),
            ))
            .unwrap();
        assert_eq!(r.unwrap(), 5000);
        assert!(t.is_some());
        let mut got = vec![0u8; 5000];
        b.read_exact(&mut got).unwrap();
        assert!(got.iter().all(|&x| x == 7));
        // The peer writes in two pieces; MSG_WAITALL gathers them.
        let writer = std::thread::spawn(move || {
            b.write_all(&[1u8; 3000]).unwrap();
            std::thread::sleep(Duration::from_millis(20));
            b.write_all(&[2u8; 1000]).unwrap();
            b
        });
        let (r, win, _) = eng
            .block_on(eng.recv(fd, win.into_inner().slice(100..4100), None))
            .unwrap();
        assert_eq!(r.unwrap(), 4000);
        assert!(win.as_slice()[..3000].iter().all(|&x| x == 1));
        assert!(win.as_slice()[3000..].iter().all(|&x| x == 2));
        let mut b = writer.join().unwrap();
        b.write_all(b"hdr!").unwrap();
        let (r, v, _) = eng.block_on(eng.recv_bytes(fd, vec![0; 4], None)).unwrap();
        assert_eq!((r.unwrap(), v.as_slice()), (4, &b"hdr!"[..]));
        let (r, _, _) = eng
            .block_on(eng.send_bytes(fd, b"back".to_vec(), None))
            .unwrap();
        assert_eq!(r.unwrap(), 4);
        let mut back = [0u8; 4];
        b.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"back");
    }

    #[test]
    fn try_ops_never_wait() {
        let eng = engine();
        let (a, mut b) = UnixStream::pair().unwrap();
        let fd = Fd::Raw(a.as_raw_fd());
        let buf = eng.take_buffer().unwrap();
        // Nothing there: EAGAIN at once, the window comes back.
        let (r, win, t) = eng.block_on(eng.try_recv(fd, buf.slice(0..100))).unwrap();
        assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::EAGAIN));
        assert!(t.is_none());
        // Some there: that much, not waiting for the rest.
        b.write_all(&[9u8; 40]).unwrap();
        let (r, win, _) = eng.block_on(eng.try_recv(fd, win)).unwrap();
        assert_eq!(r.unwrap(), 40);
        assert!(win.as_slice()[..40].iter().all(|&x| x == 9));
        // Sends from an offset; a full socket buffer takes part of it, then EAGAIN.
        let (r, v, _) = eng
            .block_on(eng.try_send_bytes_at(fd, b"xxhello".to_vec(), 2))
            .unwrap();
        assert_eq!(r.unwrap(), 5);
        let mut got = [0u8; 5];
        b.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hello");
        let big = vec![3u8; 64 << 20];
        let (r, big, _) = eng.block_on(eng.try_send_bytes_at(fd, big, 0)).unwrap();
        let n = r.unwrap();
        assert!(n > 0 && n < big.len(), "{n}");
        let (r, _, _) = eng.block_on(eng.try_send_bytes_at(fd, big, n)).unwrap();
        assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::EAGAIN));
        // The waiting variant sends the rest once the peer reads.
        let reader = std::thread::spawn(move || {
            let mut sink = vec![0u8; 64 << 20];
            b.read_exact(&mut sink).unwrap();
            sink.iter().all(|&x| x == 3)
        });
        let (r, _, _) = eng
            .block_on(eng.send_bytes_at(fd, vec![3u8; 64 << 20], n, None))
            .unwrap();
        assert_eq!(r.unwrap(), (64 << 20) - n);
        assert!(reader.join().unwrap());
        drop(v);
    }

    #[test]
    fn timeout_and_peer_close() {
        let eng = engine();
        let (a, b) = UnixStream::pair().unwrap();
        let fd = Fd::Raw(a.as_raw_fd());
        let t = Timeout::new(Duration::from_millis(50));
        let (r, v, t) = eng
            .block_on(eng.recv_bytes(fd, vec![0; 16], Some(t)))
            .unwrap();
        assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::ECANCELED));
        assert!(t.is_some());
        drop(b);
        let (r, _, _) = eng.block_on(eng.recv_bytes(fd, v, t)).unwrap();
        assert_eq!(r.unwrap(), 0);
        let (r, _, _) = eng.block_on(eng.send_bytes(fd, vec![1; 8], None)).unwrap();
        assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::EPIPE));
    }
}
