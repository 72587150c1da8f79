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
