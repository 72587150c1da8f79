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

use engine::io_uring::{opcode, types};
use engine::{sqe_with_len, BufHandle, Engine, Sqe};
use fuse_abi::{
    InHeader, UringCmdReq, UringEntInOut, FUSE_IO_URING_CMD_COMMIT_AND_FETCH,
    FUSE_IO_URING_CMD_REGISTER,
};
use zerocopy::{FromBytes, IntoBytes};

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

    /// Registers `buf` as an entry and waits for its first request.
    pub async fn register(
        &self,
        eng: &Engine,
        buf: &mut BufHandle,
    ) -> Result<Fetched, TransportError> {
        let l = self.layout;
        let base = buf.as_mut_slice().as_mut_ptr();
        let iov = [
            libc::iovec {
                iov_base: base.cast(),
                iov_len: std::mem::size_of::<fuse_abi::UringReqHeader>(),
            },
            // SAFETY: payload + payload_len is inside the buffer (UringLayout::size).
            libc::iovec {
                iov_base: unsafe { base.add(l.payload) }.cast(),
                iov_len: l.payload_len,
            },
        ];
        let iov_bytes: &[u8] = {
            // SAFETY: iovec is plain data; viewing it as bytes to store it in the buffer.
            unsafe {
                std::slice::from_raw_parts(iov.as_ptr().cast::<u8>(), std::mem::size_of_val(&iov))
            }
        };
        buf.as_mut_slice()[l.iovecs..l.iovecs + iov_bytes.len()].copy_from_slice(iov_bytes);
        let iov_ptr = buf.as_slice()[l.iovecs..].as_ptr() as u64;
        loop {
            let sqe: Sqe = opcode::UringCmd80::new(types::Fd(self.fd), FUSE_IO_URING_CMD_REGISTER)
                .addr(Some(iov_ptr))
                .cmd(self.cmd(0))
                .build();
            let sqe = sqe_with_len(sqe, 2);
            // SAFETY: the iovecs and the memory they describe are engine-owned.
            let res = unsafe { eng.submit(sqe) }.await;
            if res == -libc::EAGAIN {
                // INIT's reply has not landed in the kernel yet; it will in a moment.
                std::thread::sleep(std::time::Duration::from_millis(1));
                continue;
            }
            return self.fetched(res, buf);
        }
    }

    /// Commits the reply already placed in `buf` (out header and payload size) and waits for the
    /// entry's next request.
    pub async fn commit_and_fetch(
        &self,
        eng: &Engine,
        buf: &mut BufHandle,
        commit_id: u64,
    ) -> Result<Fetched, TransportError> {
        let sqe: Sqe =
            opcode::UringCmd80::new(types::Fd(self.fd), FUSE_IO_URING_CMD_COMMIT_AND_FETCH)
                .cmd(self.cmd(commit_id))
                .build();
        // SAFETY: the entry's memory is engine-owned.
        let res = unsafe { eng.submit(sqe) }.await;
        self.fetched(res, buf)
    }

    fn fetched(&self, res: i32, buf: &BufHandle) -> Result<Fetched, TransportError> {
        match res {
            0 => {}
            n if [
                libc::ENOTCONN,
                libc::ENODEV,
                libc::ECANCELED,
                libc::ECONNABORTED,
            ]
            .contains(&-n) =>
            {
                return Ok(Fetched::Gone)
            }
            n => return Err(TransportError::Io(io::Error::from_raw_os_error(-n))),
        }
        let b = buf.as_slice();
        let header = InHeader::read_from_prefix(&b[self.layout.header..])
            .map(|(h, _)| h)
            .map_err(|_| TransportError::Io(io::Error::from_raw_os_error(libc::EIO)))?;
        let ent = UringEntInOut::read_from_prefix(&b[self.layout.header + 256..])
            .map(|(e, _)| e)
            .map_err(|_| TransportError::Io(io::Error::from_raw_os_error(libc::EIO)))?;
        Ok(Fetched::Request(Delivered {
            header,
            commit_id: ent.commit_id,
            payload_sz: (ent.payload_sz as usize).min(self.layout.payload_len),
        }))
    }

    /// Writes the out header (`error` is 0 or a negative errno) and the payload size of a reply.
    pub fn set_reply(&self, buf: &mut BufHandle, unique: u64, error: i32, payload_len: usize) {
        let l = self.layout;
        let b = buf.as_mut_slice();
        let len = (fuse_abi::OUT_HEADER_LEN + payload_len) as u32;
        let oh = fuse_abi::OutHeader { len, error, unique };
        b[l.header..l.header + 16].copy_from_slice(oh.as_bytes());
        // Only payload_sz of the entry's in/out area is read back by the kernel.
        let at = l.header + 256 + std::mem::offset_of!(UringEntInOut, payload_sz);
        b[at..at + 4].copy_from_slice(&(payload_len as u32).to_ne_bytes());
    }
}
