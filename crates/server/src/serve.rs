//! Decode → export → encode, for both framings.

use std::sync::Arc;

use engine::{Buf, Engine};
use export::{Counters, Filesystem, Reply, Request, Tally};
use fuse_abi::{
    parse_laid_out, parse_op_split_laid_out, peek_unique, write_header, InHeader, Operation,
    ParseError,
};
use transport::{Delivered, Layout, UringLayout};
use zerocopy::FromBytes;

use crate::reply::reply_parts;

/// Serves the requests of one queue: the shared filesystem (an image export or a directory
/// tree), per-queue counters (written by this queue's thread only; shared so the main thread can
/// read them live).
pub struct QueueServer<F> {
    export: Arc<F>,
    counters: Arc<Counters>,
    splice_min: usize,
}

/// What a legacy request asks of the transport once served.
#[derive(Debug, PartialEq, Eq)]
pub enum LegacyReply {
    /// Nothing (FORGET, INTERRUPT, or bytes too short to name a request).
    None,
    /// Write the reply of this many bytes (out header included) from the reply offset.
    Bytes(usize),
    /// Answer READ `unique` by splicing `len` bytes of the image descriptor `fd` from `off`
    /// (see [`QueueServer::with_splice_min`]); if that comes up short, serve it again with
    /// splicing off.
    Splice {
        /// The READ's unique id.
        unique: u64,
        /// The image descriptor.
        fd: std::os::fd::RawFd,
        /// Image offset.
        off: u64,
        /// Bytes to send.
        len: usize,
    },
}

impl<F: Filesystem> QueueServer<F> {
    /// A server for one queue of `export`.
    pub fn new(export: Arc<F>) -> QueueServer<F> {
        QueueServer {
            export,
            counters: Arc::new(Counters::default()),
            splice_min: 0,
        }
    }

    /// Whether requests are timed into latency histograms (on by default; off saves two or
    /// three clock reads per request).
    pub fn with_latency(mut self, on: bool) -> Self {
        self.counters = Arc::new(Counters::new(on));
        self
    }

    /// Legacy READs of at least `bytes` (0: none) are answered by splicing from the image when
    /// its backend allows ([`backend::BlockBackend::splice_fd`]): one copy in the kernel instead
    /// of a read into the buffer and a write from it.
    pub fn with_splice_min(mut self, bytes: usize) -> Self {
        self.splice_min = bytes;
        self
    }

    /// This queue's request and backend counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// The same counters, for a reader on another thread (live statistics).
    pub fn shared_counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }

    /// The export served.
    pub fn export(&self) -> &F {
        &self.export
    }

    /// Legacy framing: the request `read(2)` returned is `buf[l.request..l.request + n]`. Serves it
    /// and encodes the reply at `buf[l.reply..]`; returns the buffer and what to send. `splice`
    /// allows a [`LegacyReply::Splice`] answer.
    pub async fn serve_legacy(
        &self,
        eng: &Engine,
        l: &Layout,
        buf: Buf,
        n: usize,
        splice: bool,
    ) -> (Buf, LegacyReply) {
        let Some(raw) = buf.as_slice().get(l.request..l.request.saturating_add(n)) else {
            return (buf, LegacyReply::None);
        };
        let decoded = match parse_laid_out(raw, true, self.export.layouts()) {
            Ok(r) => Ok((r.header, lower(&r.op, buf.as_slice()))),
            Err(e) => match InHeader::read_from_prefix(raw) {
                Ok((hdr, _)) if unserved::<F>(&e) => Ok((hdr, (unsupported(&hdr), None))),
                _ => Err((peek_unique(raw), e)),
            },
        };
        let window = l.payload..buf.len();
        let capacity = window.len();
        if let Ok((hdr, (Request::Read(a), _))) = &decoded {
            if splice && self.splice_min > 0 && a.size as usize >= self.splice_min {
                if let Some((fd, off, len)) = self.export.splice_read(hdr, a, capacity) {
                    self.counters.request(hdr.opcode);
                    // Timed to the splice's start: the kernel copies the data as it sends.
                    Tally::new(&self.counters, self.arrival(eng)).replied(hdr.opcode, 0);
                    let unique = hdr.unique;
                    return (
                        buf,
                        LegacyReply::Splice {
                            unique,
                            fd,
                            off,
                            len,
                        },
                    );
                }
            }
        }
        let (unique, reply, mut buf) = match decoded {
            Ok((hdr, op)) => {
                let (reply, buf) = self.dispatch(eng, &hdr, op, buf, window).await;
                (hdr.unique, reply, buf)
            }
            Err((Some(unique), e)) => (unique, self.malformed(&e), buf),
            Err((None, e)) => {
                self.malformed(&e);
                return (buf, LegacyReply::None);
            }
        };
        let Some((error, len)) = reply_parts(reply, capacity) else {
            return (buf, LegacyReply::None);
        };
        let out = &mut buf.as_mut_slice()[l.reply..];
        match write_header(out, unique, error, len) {
            Ok(total) => (buf, LegacyReply::Bytes(total)),
            Err(_) => (buf, LegacyReply::None),
        }
    }

    /// io_uring framing: the kernel delivered `d` into the entry buffer `buf` (header and
    /// arguments in the header area, `d.payload_sz` bytes of names or WRITE data in the payload).
    /// Serves it and writes the out header and payload size the commit sends.
    pub async fn serve_uring(&self, eng: &Engine, l: &UringLayout, buf: Buf, d: &Delivered) -> Buf {
        let hdr = d.header;
        let b = buf.as_slice();
        let op_in = &b[l.op_in()..l.op_in() + 128];
        let payload = &b[l.payload..l.payload + d.payload_sz.min(l.payload_len)];
        let (reply, mut buf) =
            match parse_op_split_laid_out(&hdr, op_in, payload, self.export.layouts()) {
                Ok(op) => {
                    let op = lower(&op, b);
                    let window = l.payload..l.payload + l.payload_len;
                    self.dispatch(eng, &hdr, op, buf, window).await
                }
                Err(e) if unserved::<F>(&e) => {
                    let window = l.payload..l.payload + l.payload_len;
                    let op = (unsupported(&hdr), None);
                    self.dispatch(eng, &hdr, op, buf, window).await
                }
                Err(e) => (self.malformed(&e), buf),
            };
        // Nothing without a reply travels over the ring (FORGET and INTERRUPT come through
        // /dev/fuse); should one arrive, answer so the entry re-arms.
        let (error, len) = reply_parts(reply, l.payload_len).unwrap_or((-libc::ENOSYS, 0));
        l.set_reply(buf.as_mut_slice(), hdr.unique, error, len);
        buf
    }

    /// io_uring framing: answers the request in `buf` with `errno` without serving it (a queue
    /// that is stopping takes nothing new).
    pub fn refuse_uring(&self, l: &UringLayout, buf: &mut Buf, d: &Delivered, errno: i32) {
        Tally::new(&self.counters, 0).replied(d.header.opcode, errno);
        let (error, len) = reply_parts(Reply::Error(errno), 0).unwrap_or((-libc::EIO, 0));
        l.set_reply(buf.as_mut_slice(), d.header.unique, error, len);
    }

    fn malformed(&self, e: &ParseError) -> Reply {
        self.counters.malformed();
        tracing::debug!("malformed request: {e}");
        Reply::Error(e.errno())
    }

    /// Serves a decoded request whose reply body goes to `buf[payload..]`.
    async fn dispatch(
        &self,
        eng: &Engine,
        hdr: &InHeader,
        (req, write): (Request, Option<(usize, usize)>),
        mut buf: Buf,
        window: std::ops::Range<usize>,
    ) -> (Reply, Buf) {
        let payload = window.start;
        if let Some((at, len)) = write {
            if at != payload {
                // The transport could not land the data where the backend reads it: move it
                // there (counted, so a test can prove the data path never does this).
                if payload.checked_add(len).is_none_or(|e| e > window.end) {
                    return (Reply::Error(libc::EIO), buf);
                }
                buf.as_mut_slice().copy_within(at..at + len, payload);
                self.counters.copied(len);
            }
        }
        self.counters.request(hdr.opcode);
        let tally = Tally::new(&self.counters, self.arrival(eng));
        let (reply, buf) = self.export.handle(eng, hdr, req, buf, window, &tally).await;
        let errno = match reply {
            Reply::Error(e) => e,
            _ => 0,
        };
        tally.replied(hdr.opcode, errno);
        (reply, buf)
    }

    /// When the request being served arrived (0: untimed, no clock read).
    fn arrival(&self, eng: &Engine) -> u64 {
        if self.counters.timed() {
            eng.reaped_ns()
        } else {
            0
        }
    }
}

/// Whether a decoding error is in the arguments of an opcode `F` does not implement: such a
/// request is answered as unsupported, whatever its arguments.
fn unserved<F: Filesystem>(e: &ParseError) -> bool {
    e.arguments_of().is_some_and(|op| !F::serves(op))
}

fn unsupported(hdr: &InHeader) -> Request {
    Request::Unsupported(hdr.opcode)
}

/// The owned form of an operation, plus where WRITE data sits in the buffer `base`.
fn lower(op: &Operation<'_>, base: &[u8]) -> (Request, Option<(usize, usize)>) {
    let write = match op {
        Operation::Write { data, .. } => {
            Some((data.as_ptr() as usize - base.as_ptr() as usize, data.len()))
        }
        _ => None,
    };
    (Request::from_operation(op, base), write)
}

#[cfg(test)]
mod tests;
