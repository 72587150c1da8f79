//! INIT: the first request on a new connection, answered before any queue starts.

use std::os::fd::{AsRawFd, BorrowedFd};

use fuse_abi::{
    encode, encode_error, parse, InitOut, Operation, FUSE_INIT_EXT, FUSE_MAX_PAGES,
    FUSE_PASSTHROUGH, FUSE_REQUEST_TIMEOUT, KERNEL_MINOR_VERSION, KERNEL_VERSION,
};

use crate::TransportError;

/// What fusex asks of the kernel.
#[derive(Clone, Copy, Debug)]
pub struct InitParams {
    /// INIT flags wanted (granted only where the kernel offers them).
    pub want: u64,
    /// INIT flags wanted only when FUSE passthrough is not granted (asked for and offered):
    /// `FUSE_WRITEBACK_CACHE`, which the kernel does not combine with passthrough (since Linux
    /// 6.10 it drops `FUSE_PASSTHROUGH` from a reply that also holds it), and which would make
    /// no difference to files passed through anyway. Passthrough wins: an export that asked
    /// for it uses it where the kernel offers it.
    pub want_without_passthrough: u64,
    /// Largest WRITE payload.
    pub max_write: u32,
    /// Largest request in pages (with `FUSE_MAX_PAGES`).
    pub max_pages: u16,
    /// Background (async) requests the kernel may have outstanding; bounds async-DIO depth.
    pub max_background: u16,
    /// Seconds a request may go unanswered before the kernel aborts the connection
    /// (`FUSE_REQUEST_TIMEOUT`, Linux 6.14); 0 asks for none. Frees applications from a wedged
    /// daemon.
    pub request_timeout: u16,
}

/// What was agreed.
///
/// Serializable, so that `fusex restart` hands it to the successor as is (INIT is not sent again).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Negotiated {
    /// Protocol minor version in use.
    pub minor: u32,
    /// The kernel's own minor version (newer than `minor` when the kernel knows more than fusex,
    /// e.g. 7.46 brings io_uring zero copy).
    pub kernel_minor: u32,
    /// Every flag the kernel offered.
    pub offered: u64,
    /// Flags in effect (offered and wanted).
    pub flags: u64,
    /// Largest WRITE payload the kernel will send.
    pub max_write: u32,
    /// The kernel's readahead limit.
    pub max_readahead: u32,
    /// The request timeout sent to the kernel, when one was asked for and the kernel offered
    /// `FUSE_REQUEST_TIMEOUT` (the kernel still applies its sysctls and 15 s floor to it).
    pub request_timeout: Option<u16>,
}

/// First protocol minor with the kernel's FUSE-over-io_uring zero copy (buffer pools,
/// `FOPEN_IO_URING_ZERO_COPY`); queued for Linux 7.3.
pub const URING_ZERO_COPY_MINOR: u32 = 46;

impl Negotiated {
    /// Whether the kernel speaks a protocol with io_uring zero copy. fusex does not use it yet
    /// (docs/uring.md says how it will); it only reports it.
    pub fn kernel_has_uring_zero_copy(&self) -> bool {
        self.kernel_minor >= URING_ZERO_COPY_MINOR
    }

    /// Whether `flag` is in effect.
    pub fn has(&self, flag: u64) -> bool {
        self.flags & flag != 0
    }
}

/// Reads the INIT request from a freshly mounted connection and answers it.
///
/// Runs on the starting thread with a blocking read: nothing else can arrive before INIT.
pub fn negotiate_init(fd: BorrowedFd<'_>, p: &InitParams) -> Result<Negotiated, TransportError> {
    negotiate(fd, p, None)
}

/// [`negotiate_init`] that also asks for `FUSE_PASSTHROUGH`, announcing `max_stack_depth` (see
/// [`crate::passthrough::stack_depth_for`]). Whether the kernel granted it: `Negotiated::has`.
pub fn negotiate_init_passthrough(
    fd: BorrowedFd<'_>,
    p: &InitParams,
    max_stack_depth: u32,
) -> Result<Negotiated, TransportError> {
    negotiate(fd, p, Some(max_stack_depth))
}

fn negotiate(
    fd: BorrowedFd<'_>,
    p: &InitParams,
    passthrough_depth: Option<u32>,
) -> Result<Negotiated, TransportError> {
    // INIT is small, but the kernel insists the read buffer could hold any request. Not zeroed:
    // only what the kernel wrote is read, and clearing a megabyte per export added was 1.4 % of
    // a `fusex serve` daemon's CPU in rounds of adding and removing exports.
    let mut buf: Vec<u8> = Vec::with_capacity(p.max_write as usize + 8192);
    let n = loop {
        // SAFETY: the kernel writes at most `capacity` bytes into the vector's own allocation,
        // which lives across the call; nothing reads it before `set_len` below.
        let r = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.capacity()) };
        if r >= 0 {
            break (r as usize).min(buf.capacity());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(TransportError::Io(e));
        }
    };
    // SAFETY: the read initialized the first `n` bytes (at most the capacity).
    unsafe { buf.set_len(n) };
    let req = parse(&buf[..n]).map_err(|e| TransportError::Init(e.to_string()))?;
    let unique = req.header.unique;
    let Operation::Init(init) = req.op else {
        return Err(TransportError::Init(format!(
            "first request is opcode {}, not INIT",
            req.header.opcode
        )));
    };
    let mut out = vec![0u8; 256];
    if init.major != KERNEL_VERSION || init.minor < 31 {
        let len = encode_error(&mut out, unique, libc::EPROTO)
            .map_err(|e| TransportError::Init(e.to_string()))?;
        write_all(fd, &out[..len])?;
        return Err(TransportError::Protocol {
            major: init.major,
            minor: init.minor,
        });
    }
    let offered = init.all_flags();
    let mut want = p.want;
    if p.max_pages > 32 {
        want |= FUSE_MAX_PAGES;
    }
    want |= FUSE_INIT_EXT;
    if passthrough_depth.is_some() {
        want |= FUSE_PASSTHROUGH;
    }
    if passthrough_depth.is_none() || offered & FUSE_PASSTHROUGH == 0 {
        want |= p.want_without_passthrough;
    }
    if p.request_timeout > 0 {
        want |= FUSE_REQUEST_TIMEOUT;
    }
    let flags = offered & want;
    let request_timeout = (flags & FUSE_REQUEST_TIMEOUT != 0).then_some(p.request_timeout);
    let mut reply = InitOut {
        major: KERNEL_VERSION,
        minor: KERNEL_MINOR_VERSION.min(init.minor),
        max_readahead: init.max_readahead,
        max_background: p.max_background,
        congestion_threshold: p.max_background / 4 * 3,
        max_write: p.max_write,
        time_gran: 1,
        max_pages: p.max_pages,
        // Ignored by the kernel unless FUSE_PASSTHROUGH is granted.
        max_stack_depth: passthrough_depth.unwrap_or(0),
        request_timeout: request_timeout.unwrap_or(0),
        ..InitOut::default()
    };
    reply.set_all_flags(flags);
    let len = encode(&mut out, unique, &reply).map_err(|e| TransportError::Init(e.to_string()))?;
    write_all(fd, &out[..len])?;
    tracing::debug!(
        kernel = format!("{}.{}", init.major, init.minor),
        offered = format_args!("{offered:#x}"),
        granted = format_args!("{flags:#x}"),
        "INIT negotiated"
    );
    Ok(Negotiated {
        minor: reply.minor,
        kernel_minor: init.minor,
        offered,
        flags,
        max_write: p.max_write,
        max_readahead: init.max_readahead,
        request_timeout,
    })
}

fn write_all(fd: BorrowedFd<'_>, b: &[u8]) -> Result<(), TransportError> {
    // SAFETY: writes from a live slice; /dev/fuse takes a reply in one write.
    let r = unsafe { libc::write(fd.as_raw_fd(), b.as_ptr().cast(), b.len()) };
    if r < 0 {
        return Err(TransportError::Io(std::io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};

    use fuse_abi::{
        split_init_flags, InHeader, InitIn, Opcode, FUSE_ASYNC_READ, FUSE_WRITEBACK_CACHE,
    };
    use zerocopy::IntoBytes;

    use super::*;

    /// The flags granted when a kernel offering `offered` is answered as `p` asks, with
    /// passthrough asked for (a stack depth) or not. The "kernel" is the other end of a
    /// socket pair, which takes the reply as `/dev/fuse` would.
    fn granted(offered: u64, p: &InitParams, passthrough: Option<u32>) -> u64 {
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors; the result is checked.
        let r = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
                0,
                fds.as_mut_ptr(),
            )
        };
        assert_eq!(r, 0);
        // SAFETY: both were just opened and are owned here only.
        let (kernel, daemon) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let (flags, flags2) = split_init_flags(offered | FUSE_INIT_EXT);
        let init = InitIn {
            major: KERNEL_VERSION,
            minor: 40,
            max_readahead: 128 << 10,
            flags,
            flags2,
            ..InitIn::default()
        };
        let hdr = InHeader {
            len: (std::mem::size_of::<InHeader>() + std::mem::size_of::<InitIn>()) as u32,
            opcode: Opcode::Init as u32,
            unique: 2,
            ..InHeader::default()
        };
        let mut req = hdr.as_bytes().to_vec();
        req.extend_from_slice(init.as_bytes());
        write_all(kernel.as_fd(), &req).unwrap();
        negotiate(daemon.as_fd(), p, passthrough).unwrap().flags
    }

    fn params(want_without_passthrough: u64) -> InitParams {
        InitParams {
            want: FUSE_ASYNC_READ,
            want_without_passthrough,
            max_write: 1 << 20,
            max_pages: 256,
            max_background: 16,
            request_timeout: 0,
        }
    }

    #[test]
    fn writeback_is_asked_for_only_where_passthrough_is_not_granted() {
        let all = FUSE_ASYNC_READ | FUSE_WRITEBACK_CACHE | FUSE_PASSTHROUGH;
        let p = params(FUSE_WRITEBACK_CACHE);
        // Passthrough asked for and offered: it wins.
        let g = granted(all, &p, Some(1));
        assert_ne!(g & FUSE_PASSTHROUGH, 0);
        assert_eq!(g & FUSE_WRITEBACK_CACHE, 0);
        // Not asked for, or not offered: writeback.
        let g = granted(all, &p, None);
        assert_eq!(
            g & (FUSE_PASSTHROUGH | FUSE_WRITEBACK_CACHE),
            FUSE_WRITEBACK_CACHE
        );
        let g = granted(all & !FUSE_PASSTHROUGH, &p, Some(1));
        assert_eq!(
            g & (FUSE_PASSTHROUGH | FUSE_WRITEBACK_CACHE),
            FUSE_WRITEBACK_CACHE
        );
        // Never beyond what the kernel offers, nor what was wanted.
        assert_eq!(granted(FUSE_ASYNC_READ, &p, None) & FUSE_WRITEBACK_CACHE, 0);
        assert_eq!(granted(all, &params(0), None) & FUSE_WRITEBACK_CACHE, 0);
    }
}
