//! FUSE-over-io_uring (Linux 6.14+): requests arrive in ring entries the server registered, and
//! one `COMMIT_AND_FETCH` both sends a reply and re-arms the entry for the next request.
//!
//! Each entry uses one engine buffer: the 288-byte `fuse_uring_req_header` in the first page
//! (with the REGISTER iovecs stored right behind it, so they are engine-owned memory too) and the
//! payload from the second page on. The engine registers its buffers as fixed buffers, so a READ
//! reply is read from the image straight into the payload (`READ_FIXED`) and WRITE data goes from
//! the payload straight to the image: no userspace copy.

use std::io;
use std::os::fd::RawFd;

use engine::{Buf, Engine, Fd};
use fuse_abi::{
    InHeader, UringCmdReq, UringEntInOut, FUSE_IO_URING_CMD_COMMIT_AND_FETCH,
    FUSE_IO_URING_CMD_REGISTER,
};
use zerocopy::{FromBytes, IntoBytes};

/// How long to wait before registering again when the kernel is not ready yet (INIT's reply
/// still on its way).
const REGISTER_RETRY: std::time::Duration = std::time::Duration::from_millis(1);

use crate::TransportError;

/// Where the kernel's module parameter lives.
pub const ENABLE_URING_PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

/// Offsets inside an entry buffer.
#[derive(Clone, Copy, Debug)]
pub struct UringLayout {
    /// The `fuse_uring_req_header` (288 bytes).
    pub header: usize,
    /// Two `iovec`s for REGISTER.
    pub iovecs: usize,
    /// Payload (page aligned).
    pub payload: usize,
    /// Payload bytes registered with the kernel.
    pub payload_len: usize,
    /// Total buffer size.
    pub size: usize,
}

impl UringLayout {
    /// Writes the out header (`error` is 0 or a negative errno) and the payload size of a reply
    /// into an entry buffer.
    ///
    /// The header is encoded by [`fuse_abi::write_header`], as on the legacy transport; a reply it
    /// refuses (an error outside `-511..=0`, or an error with a payload) goes out as `EIO`.
    pub fn set_reply(&self, buf: &mut [u8], unique: u64, error: i32, payload_len: usize) {
        let payload_len =
            match fuse_abi::write_header(&mut buf[self.header..], unique, error, payload_len) {
                Ok(_) => payload_len,
                Err(_) => {
                    let _ = fuse_abi::write_header(&mut buf[self.header..], unique, -libc::EIO, 0);
                    0
                }
            };
        // Only payload_sz of the entry's in/out area is read back by the kernel.
        let at = self.header + 256 + std::mem::offset_of!(UringEntInOut, payload_sz);
        buf[at..at + 4].copy_from_slice(&(payload_len as u32).to_ne_bytes());
    }

    /// Offset of the op-specific request arguments (`fuse_uring_req_header.op_in`).
    pub const fn op_in(&self) -> usize {
        self.header + 128
    }

    /// The layout for `max_write` payloads (the kernel wants at least max(8192, max_write,
    /// max_pages × 4096) bytes of payload).
    pub const fn new(max_write: usize) -> UringLayout {
        let payload_len = if max_write > 8192 { max_write } else { 8192 };
        UringLayout {
            header: 0,
            iovecs: 512,
            payload: 4096,
            payload_len,
            size: 4096 + payload_len,
        }
    }
}

/// Why FUSE-over-io_uring cannot be used, phrased for a log line; `None` if it can (as far as
/// can be told before INIT).
pub fn uring_unavailable_reason() -> Option<String> {
    match std::fs::read_to_string(ENABLE_URING_PARAM) {
        Ok(v) if v.trim() == "Y" || v.trim() == "1" => None,
        Ok(v) => Some(format!(
            "{ENABLE_URING_PARAM} is {} (enable it with: echo Y > {ENABLE_URING_PARAM})",
            v.trim()
        )),
        Err(_) => Some(
            "this kernel has no FUSE-over-io_uring (needs Linux 6.14+ with CONFIG_FUSE_IO_URING)"
                .into(),
        ),
    }
}

/// A request delivered into an entry.
#[derive(Clone, Copy, Debug)]
pub struct Delivered {
    /// The request header.
    pub header: InHeader,
    /// The id to commit the reply with.
    pub commit_id: u64,
    /// Payload bytes the kernel wrote (names, WRITE data).
    pub payload_sz: usize,
}

/// Outcome of waiting on an entry.
#[derive(Debug)]
pub enum Fetched {
    /// A request is in the entry.
    Request(Delivered),
    /// The connection is gone (unmount, abort): the entry is finished.
    Gone,
}

/// One kernel queue (qid) served through the engine of the calling thread.
pub struct UringQueue {
    fd: RawFd,
    qid: u16,
    layout: UringLayout,
}

impl UringQueue {
    /// A queue for kernel queue `qid` on the connection `fd` (which must outlive the queue).
    pub fn new(fd: RawFd, qid: u16, layout: UringLayout) -> UringQueue {
        UringQueue { fd, qid, layout }
    }

    /// The entry layout.
    pub fn layout(&self) -> UringLayout {
        self.layout
    }

    /// The kernel queue index.
    pub fn qid(&self) -> u16 {
        self.qid
    }

    fn cmd(&self, commit_id: u64) -> [u8; 80] {
        let req = UringCmdReq {
            flags: 0,
            commit_id,
            qid: self.qid,
            padding: [0; 6],
        };
        let mut cmd = [0u8; 80];
        cmd[..std::mem::size_of::<UringCmdReq>()].copy_from_slice(req.as_bytes());
        cmd
    }

    /// Registers `buf` as an entry and waits for its first request. The kernel holds the buffer
    /// until the returned result; the buffer comes back with it.
    pub async fn register(&self, eng: &Engine, buf: Buf) -> (Result<Fetched, TransportError>, Buf) {
        let l = self.layout;
        let segments = [
            l.header..l.header + std::mem::size_of::<fuse_abi::UringReqHeader>(),
            l.payload..l.payload + l.payload_len,
        ];
        let mut buf = buf;
        loop {
            let (res, back) = eng
                .uring_cmd(
                    Fd::Raw(self.fd),
                    FUSE_IO_URING_CMD_REGISTER,
                    self.cmd(0),
                    buf,
                    Some((l.iovecs, &segments)),
                )
                .await;
            buf = back;
            if matches!(&res, Err(e) if e.raw_os_error() == Some(libc::EAGAIN)) {
                // INIT's reply has not landed in the kernel yet; it will in a moment. The ring
                // keeps serving meanwhile.
                eng.sleep(REGISTER_RETRY).await;
                continue;
            }
            let r = self.fetched(res, &buf);
            return (r, buf);
        }
    }

    /// Commits the reply already placed in `buf` (out header and payload size) and waits for the
    /// entry's next request.
    pub async fn commit_and_fetch(
        &self,
        eng: &Engine,
        buf: Buf,
        commit_id: u64,
    ) -> (Result<Fetched, TransportError>, Buf) {
        let (res, buf) = eng
            .uring_cmd(
                Fd::Raw(self.fd),
                FUSE_IO_URING_CMD_COMMIT_AND_FETCH,
                self.cmd(commit_id),
                buf,
                None,
            )
            .await;
        let r = self.fetched(res, &buf);
        (r, buf)
    }

    fn fetched(&self, res: io::Result<i32>, buf: &Buf) -> Result<Fetched, TransportError> {
        match res {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ENOTCONN | libc::ENODEV | libc::ECANCELED | libc::ECONNABORTED)
                ) =>
            {
                return Ok(Fetched::Gone)
            }
            Err(e) => return Err(TransportError::Io(e)),
        }
        Delivered::from_entry(&self.layout, buf.as_slice())
            .map(Fetched::Request)
            .ok_or_else(|| TransportError::Io(io::Error::from_raw_os_error(libc::EIO)))
    }
}

impl Delivered {
    /// Decodes what the kernel wrote into the header area of an entry buffer laid out by `l`:
    /// the request header, the commit id and the payload size, clamped to the payload the entry
    /// registered (kernel input is untrusted). `None` if `entry` ends inside the header area.
    ///
    /// The queue reads every fetched request through this; tests and fuzzers use it to deliver a
    /// request without a kernel (fill an entry buffer the way the kernel does, then decode it here).
    pub fn from_entry(l: &UringLayout, entry: &[u8]) -> Option<Delivered> {
        let area = entry.get(l.header..)?;
        let (header, _) = InHeader::read_from_prefix(area).ok()?;
        let (ent, _) = UringEntInOut::read_from_prefix(area.get(256..)?).ok()?;
        Some(Delivered {
            header,
            commit_id: ent.commit_id,
            payload_sz: (ent.payload_sz as usize).min(l.payload_len),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_header_area_decodes_with_the_payload_size_clamped() {
        let l = UringLayout::new(8192);
        let mut buf = vec![0xA5u8; l.size];
        let hdr = InHeader {
            len: 80,
            opcode: 15,
            unique: 42,
            nodeid: 1,
            ..InHeader::default()
        };
        buf[l.header..l.header + 40].copy_from_slice(hdr.as_bytes());
        let ent = UringEntInOut {
            commit_id: 42,
            payload_sz: 100,
            ..UringEntInOut::default()
        };
        let at = l.header + 256;
        buf[at..at + 32].copy_from_slice(ent.as_bytes());
        let d = Delivered::from_entry(&l, &buf).unwrap();
        assert_eq!((d.header, d.commit_id, d.payload_sz), (hdr, 42, 100));

        // A kernel claiming more payload than the entry registered is held to the entry.
        let ent = UringEntInOut {
            payload_sz: u32::MAX,
            ..ent
        };
        buf[at..at + 32].copy_from_slice(ent.as_bytes());
        let d = Delivered::from_entry(&l, &buf).unwrap();
        assert_eq!(d.payload_sz, l.payload_len);

        // A buffer that ends inside the header area holds no request.
        assert!(Delivered::from_entry(&l, &buf[..287]).is_none());
        assert!(Delivered::from_entry(&l, &buf[..288]).is_some());
    }
}
