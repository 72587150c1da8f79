//! READ replies spliced from the image on the legacy transport: out header and data go into a
//! pipe, the pipe into `/dev/fuse`. The data is never in fusex's memory: the pipe holds
//! references to the image's pages and the kernel copies them once, into the reader's buffer
//! (a read into fusex's buffer and a write from it copy twice).
//!
//! The splices are plain syscalls on the queue thread, so only an image whose pages never wait
//! for a device (in memory, see `BlockBackend::splice_fd`) is spliced. `IORING_OP_SPLICE` would
//! always go through an io-wq worker.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::legacy::LegacyQueue;
use crate::TransportError;

/// A pipe one legacy slot splices its READ replies through. It holds one reply at a time and is
/// empty between replies; a reply that went wrong half way drops it (a new one is made).
pub struct SplicePipe {
    read: OwnedFd,
    write: OwnedFd,
}

impl SplicePipe {
    /// A non-blocking pipe that holds `capacity` bytes (an out header and the largest READ).
    pub fn new(capacity: usize) -> io::Result<SplicePipe> {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: pipe2 writes two descriptors into the array we pass.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded, so both are open descriptors that nothing else owns.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let want = libc::c_int::try_from(capacity).unwrap_or(libc::c_int::MAX);
        // SAFETY: fcntl with an integer argument on a descriptor we own.
        let got = unsafe { libc::fcntl(write.as_raw_fd(), libc::F_SETPIPE_SZ, want) };
        if got < 0 {
            return Err(io::Error::last_os_error());
        }
        if (got as usize) < capacity {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        Ok(SplicePipe { read, write })
    }
}

/// What became of a spliced READ reply.
#[derive(Debug, PartialEq, Eq)]
pub enum Spliced {
    /// The reply went out (or the kernel no longer waited for it): `n` data bytes.
    Sent(usize),
    /// The image ended before the length asked for (something shrank it): nothing was sent,
    /// the caller answers the READ the ordinary way.
    Short,
}

/// Out header length (`fuse_out_header`: len u32, error i32, unique u64).
const OUT_HEADER_LEN: usize = 16;

impl LegacyQueue {
    /// Answers READ `unique` with `len` bytes of `src` from `off`, spliced through `pipe` (made
    /// on first use; dropped when a reply fails half way). An error making the pipe is returned
    /// as is: the caller stops splicing on this queue.
    pub fn splice_reply(
        &self,
        pipe: &mut Option<SplicePipe>,
        unique: u64,
        src: RawFd,
        off: u64,
        len: usize,
    ) -> Result<Spliced, TransportError> {
        let p = match pipe {
            Some(p) => p,
            None => pipe.insert(
                SplicePipe::new(OUT_HEADER_LEN + self.layout().size).map_err(TransportError::Io)?,
            ),
        };
        let total = OUT_HEADER_LEN + len;
        let mut hdr = [0u8; OUT_HEADER_LEN];
        hdr[0..4].copy_from_slice(&(total as u32).to_ne_bytes());
        hdr[8..16].copy_from_slice(&unique.to_ne_bytes());
        let r = fill(p, &hdr, src, off, len).and_then(|filled| {
            if filled < len {
                return Ok(Spliced::Short);
            }
            // SAFETY: splice between two descriptors we hold open; no user memory involved.
            let n = unsafe {
                libc::splice(
                    p.read.as_raw_fd(),
                    std::ptr::null_mut(),
                    self.fd(),
                    std::ptr::null_mut(),
                    total,
                    0,
                )
            };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            if n as usize != total {
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
            Ok(Spliced::Sent(len))
        });
        match r {
            Ok(Spliced::Sent(n)) => Ok(Spliced::Sent(n)),
            Ok(Spliced::Short) => {
                *pipe = None;
                Ok(Spliced::Short)
            }
            Err(e) => {
                // Whatever is left in the pipe belongs to no reply.
                *pipe = None;
                match e.raw_os_error() {
                    // The request was interrupted, or the connection is going away: as for a
                    // written reply, not an error.
                    Some(libc::ENOENT | libc::ENODEV | libc::ECONNABORTED) => Ok(Spliced::Sent(0)),
                    _ => Err(TransportError::Io(e)),
                }
            }
        }
    }
}

/// Puts the out header and up to `len` bytes of `src` from `off` into the pipe; returns the
/// data bytes it holds (fewer than `len` only at the end of the file).
fn fill(p: &SplicePipe, hdr: &[u8], src: RawFd, off: u64, len: usize) -> io::Result<usize> {
    // SAFETY: writes `hdr.len()` bytes from a live slice to a descriptor we own.
    let n = unsafe { libc::write(p.write.as_raw_fd(), hdr.as_ptr().cast(), hdr.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != hdr.len() {
        return Err(io::Error::from_raw_os_error(libc::EIO));
    }
    let mut pos = off as libc::loff_t;
    let mut filled = 0;
    while filled < len {
        // SAFETY: splice from `src` at `pos` (a local the call advances) into our pipe.
        let n = unsafe {
            libc::splice(
                src,
                &mut pos,
                p.write.as_raw_fd(),
                std::ptr::null_mut(),
                len - filled,
                0,
            )
        };
        match n {
            0 => break,
            n if n > 0 => filled += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return Err(e);
            }
        }
    }
    Ok(filled)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn drain(p: &SplicePipe, n: usize) -> Vec<u8> {
        // SAFETY: dup of a descriptor we own, handed to a File that owns the copy.
        let fd = unsafe { libc::dup(p.read.as_raw_fd()) };
        assert!(fd >= 0);
        // SAFETY: `fd` was just returned by dup and nothing else owns it.
        let mut f = unsafe { std::fs::File::from_raw_fd(fd) };
        let mut v = vec![0; n];
        f.read_exact(&mut v).unwrap();
        v
    }

    #[test]
    fn fill_puts_header_then_file_bytes() {
        let mut img = tempfile::tempfile().unwrap();
        let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7) as u8).collect();
        img.write_all(&data).unwrap();
        let p = SplicePipe::new(256 << 10).unwrap();
        let got = fill(&p, &[9u8; 16], img.as_raw_fd(), 1000, 150_000).unwrap();
        assert_eq!(got, 150_000);
        let out = drain(&p, 16 + got);
        assert_eq!(&out[..16], &[9u8; 16]);
        assert_eq!(&out[16..], &data[1000..151_000]);
    }

    #[test]
    fn fill_stops_short_at_end_of_file() {
        let mut img = tempfile::tempfile().unwrap();
        img.write_all(&[5u8; 10_000]).unwrap();
        let p = SplicePipe::new(64 << 10).unwrap();
        assert_eq!(
            fill(&p, &[0u8; 16], img.as_raw_fd(), 8_000, 4096).unwrap(),
            2_000
        );
    }
}
