//! Decoding requests: untrusted kernel bytes to a typed [`Request`].
//!
//! Nothing here panics or reads out of bounds, whatever the input. Structs are
//! copied out by value (`read_from_prefix`), so the buffer may have any
//! alignment. Extensions (`InHeader::total_extlen`) are cut off the end of the
//! request before the arguments are looked at, so they can never be mistaken
//! for a name or for write data.

use zerocopy::{FromBytes, IntoBytes};

use crate::opcode::Opcode;
use crate::structs::{
    AccessIn, BatchForgetIn, CopyFileRangeIn, CreateIn, FallocateIn, FlushIn, ForgetIn, ForgetOne,
    FsyncIn, GetattrIn, GetxattrIn, InHeader, InitIn, InterruptIn, LinkIn, LseekIn, MkdirIn,
    MknodIn, OpenIn, ReadIn, ReleaseIn, Rename2In, RenameIn, SetattrIn, SetxattrIn, StatxIn,
    WriteIn, INIT_IN_COMPAT_SIZE, SETXATTR_IN_COMPAT_SIZE,
};

/// Size of [`InHeader`], the prefix of every request.
pub const IN_HEADER_LEN: usize = 40;
const _: () = assert!(IN_HEADER_LEN == core::mem::size_of::<InHeader>());

const EIO: i32 = 5;
const EINVAL: i32 = 22;

/// A decoded request: the header plus the typed operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request<'a> {
    /// The request header (unique, nodeid, caller credentials, ...).
    pub header: InHeader,
    /// The operation and its arguments.
    pub op: Operation<'a>,
}

/// The operations fusex handles, with their decoded arguments; everything
/// else is [`Operation::Unsupported`] or [`Operation::Unknown`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation<'a> {
    /// Protocol handshake. A pre-7.36 16-byte argument is accepted, with
    /// `flags2` and the reserved words zero-filled.
    Init(InitIn),
    /// The filesystem is going away.
    Destroy,
    /// Name lookup; `name` excludes the terminating NUL.
    Lookup {
        /// The name looked up, without its NUL.
        name: &'a [u8],
    },
    /// Drop lookup references to `header.nodeid`; never answered.
    Forget(ForgetIn),
    /// Drop lookup references to several nodes; never answered. `count`
    /// entries are known to be present.
    BatchForget {
        /// Number of [`ForgetOne`] entries in the request.
        count: u32,
        /// Exactly `count` [`ForgetOne`] entries, as bytes (read them with
        /// [`forget_entries`]).
        entries: &'a [u8],
    },
    /// Read attributes.
    Getattr(GetattrIn),
    /// Change attributes.
    Setattr(SetattrIn),
    /// Open the file.
    Open(OpenIn),
    /// Last close.
    Release(ReleaseIn),
    /// Read data.
    Read(ReadIn),
    /// Write data; `data.len() == arg.size` is guaranteed.
    Write {
        /// The WRITE argument struct.
        arg: WriteIn,
        /// Exactly `arg.size` bytes of data.
        data: &'a [u8],
    },
    /// `close(2)` of a descriptor.
    Flush(FlushIn),
    /// Make data durable.
    Fsync(FsyncIn),
    /// Preallocate / punch / zero.
    Fallocate(FallocateIn),
    /// `SEEK_DATA` / `SEEK_HOLE`.
    Lseek(LseekIn),
    /// Filesystem statistics.
    Statfs,
    /// Interrupt an earlier request.
    Interrupt(InterruptIn),
    /// Read the target of a symlink.
    Readlink,
    /// Create a symlink `name` pointing to `target` (both without their NUL).
    Symlink {
        /// The new entry's name.
        name: &'a [u8],
        /// What the link holds.
        target: &'a [u8],
    },
    /// Create a special file (or a regular one) named `name`.
    Mknod {
        /// Mode, device and umask.
        arg: MknodIn,
        /// The new entry's name.
        name: &'a [u8],
    },
    /// Create a directory named `name`.
    Mkdir {
        /// Mode and umask.
        arg: MkdirIn,
        /// The new entry's name.
        name: &'a [u8],
    },
    /// Remove the non-directory `name`.
    Unlink {
        /// The entry's name.
        name: &'a [u8],
    },
    /// Remove the empty directory `name`.
    Rmdir {
        /// The entry's name.
        name: &'a [u8],
    },
    /// RENAME (flags 0) and RENAME2: move `old` of the header's directory to `new` of `newdir`.
    Rename {
        /// Node of the target directory.
        newdir: u64,
        /// `RENAME_*` flags (0 for RENAME).
        flags: u32,
        /// The entry's name.
        old: &'a [u8],
        /// Its new name.
        new: &'a [u8],
    },
    /// Hard-link `arg.oldnodeid` as `name` in the header's directory.
    Link {
        /// The node linked.
        arg: LinkIn,
        /// The new name.
        name: &'a [u8],
    },
    /// Create and open the regular file `name`.
    Create {
        /// Flags, mode and umask.
        arg: CreateIn,
        /// The new entry's name.
        name: &'a [u8],
    },
    /// Create an unnamed temporary file in the header's directory (`O_TMPFILE`) and open it.
    Tmpfile(CreateIn),
    /// Open a directory.
    Opendir(OpenIn),
    /// Read directory entries.
    Readdir(ReadIn),
    /// Read directory entries with their attributes (each one a lookup).
    Readdirplus(ReadIn),
    /// Last close of a directory.
    Releasedir(ReleaseIn),
    /// fsync of a directory.
    Fsyncdir(FsyncIn),
    /// Set the extended attribute `name` to `value`.
    Setxattr {
        /// Size and flags.
        arg: SetxattrIn,
        /// The attribute's name.
        name: &'a [u8],
        /// Exactly `arg.size` bytes.
        value: &'a [u8],
    },
    /// Read the extended attribute `name`.
    Getxattr {
        /// Room for the value.
        arg: GetxattrIn,
        /// The attribute's name.
        name: &'a [u8],
    },
    /// List extended attribute names.
    Listxattr(GetxattrIn),
    /// Remove the extended attribute `name`.
    Removexattr {
        /// The attribute's name.
        name: &'a [u8],
    },
    /// `access(2)` check.
    Access(AccessIn),
    /// `statx(2)` attributes (birth time among them).
    Statx(StatxIn),
    /// Server-side copy between two open files, answered with a 32-bit count ([`crate::WriteOut`]).
    CopyFileRange(CopyFileRangeIn),
    /// The same, answered with a 64-bit count ([`crate::CopyFileRangeOut`]).
    CopyFileRange64(CopyFileRangeIn),
    /// A known opcode fusex does not implement (the server answers ENOSYS).
    Unsupported(Opcode),
    /// An opcode number this crate does not know.
    Unknown(u32),
}

/// Why a request could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Fewer bytes than a request header.
    #[error("request of {len} bytes is shorter than the 40-byte header")]
    TooShort {
        /// Bytes received.
        len: usize,
    },
    /// The header's `len` disagrees with the bytes actually received.
    #[error("request header says {header} bytes but {actual} were received")]
    LengthMismatch {
        /// `InHeader::len`.
        header: u32,
        /// Bytes received.
        actual: usize,
    },
    /// The arguments of the opcode are shorter than their struct.
    #[error("opcode {opcode}: arguments need {need} bytes, request has {have}")]
    Truncated {
        /// Raw opcode.
        opcode: u32,
        /// Bytes required.
        need: usize,
        /// Bytes present.
        have: usize,
    },
    /// The arguments contradict each other or the header.
    #[error("opcode {opcode}: {what}")]
    Inconsistent {
        /// Raw opcode.
        opcode: u32,
        /// What is wrong.
        what: &'static str,
    },
}

impl ParseError {
    /// errno to answer with: EIO when the header itself is bad, EINVAL when
    /// only the arguments are.
    pub fn errno(&self) -> i32 {
        match self {
            ParseError::TooShort { .. } | ParseError::LengthMismatch { .. } => EIO,
            ParseError::Truncated { .. } | ParseError::Inconsistent { .. } => EINVAL,
        }
    }

    /// The opcode whose own arguments are bad (the header and its extensions being sound), if
    /// that is the problem: a server that does not implement that opcode may answer ENOSYS, as
    /// it would for well-formed arguments.
    pub fn arguments_of(&self) -> Option<u32> {
        match *self {
            ParseError::Truncated { opcode, .. } => Some(opcode),
            ParseError::Inconsistent { opcode, what } if what != EXTENSIONS_TOO_LONG => {
                Some(opcode)
            }
            _ => None,
        }
    }
}

/// What INIT negotiated that changes how the kernel lays requests out; the default is what a
/// connection without those flags gets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Layouts {
    /// `FUSE_SETXATTR_EXT` was granted: SETXATTR carries the whole 16-byte [`SetxattrIn`]
    /// (otherwise its first 8 bytes).
    pub setxattr_ext: bool,
}

/// The `unique` of a request whose header is present (at least 40 bytes),
/// even if the rest is malformed, so the server can still send an error reply.
pub fn peek_unique(buf: &[u8]) -> Option<u64> {
    InHeader::read_from_prefix(buf)
        .ok()
        .map(|(header, _)| header.unique)
}

/// Decodes one request exactly as `read(2)` of `/dev/fuse` returned it.
///
/// Requires at least a full header and `header.len == buf.len()`.
pub fn parse(buf: &[u8]) -> Result<Request<'_>, ParseError> {
    parse_with_len_check(buf, true)
}

/// Like [`parse`], but with `check_len == false` the header's `len` is not
/// compared with `buf.len()`; the arguments are then everything after the
/// header.
pub fn parse_with_len_check(buf: &[u8], check_len: bool) -> Result<Request<'_>, ParseError> {
    parse_laid_out(buf, check_len, Layouts::default())
}

/// Like [`parse_with_len_check`], for a connection whose INIT negotiated `layouts`.
pub fn parse_laid_out(
    buf: &[u8],
    check_len: bool,
    layouts: Layouts,
) -> Result<Request<'_>, ParseError> {
    let (header, body) =
        InHeader::read_from_prefix(buf).map_err(|_| ParseError::TooShort { len: buf.len() })?;
    if check_len && usize::try_from(header.len).ok() != Some(buf.len()) {
        return Err(ParseError::LengthMismatch {
            header: header.len,
            actual: buf.len(),
        });
    }
    let body = strip_extensions(&header, body)?;
    let op = decode(header.opcode, Args::Joined(body), layouts)?;
    Ok(Request { header, op })
}

/// Decodes the arguments of a request whose header was read separately;
/// `body` is everything that followed the 40-byte header (extensions
/// included).
pub fn parse_op<'a>(header: &InHeader, body: &'a [u8]) -> Result<Operation<'a>, ParseError> {
    let body = strip_extensions(header, body)?;
    decode(header.opcode, Args::Joined(body), Layouts::default())
}

/// Decodes the arguments of an io_uring request: the opcode's fixed struct
/// is read from `op_in` (the ring header's 128-byte `op_in` area) and names,
/// write data and extensions from `payload` (the first `payload_sz` bytes of
/// the entry's payload buffer).
pub fn parse_op_split<'a>(
    header: &InHeader,
    op_in: &[u8],
    payload: &'a [u8],
) -> Result<Operation<'a>, ParseError> {
    parse_op_split_laid_out(header, op_in, payload, Layouts::default())
}

/// Like [`parse_op_split`], for a connection whose INIT negotiated `layouts`.
pub fn parse_op_split_laid_out<'a>(
    header: &InHeader,
    op_in: &[u8],
    payload: &'a [u8],
    layouts: Layouts,
) -> Result<Operation<'a>, ParseError> {
    let payload = strip_extensions(header, payload)?;
    decode(header.opcode, Args::Split { op: op_in, payload }, layouts)
}

/// Removes the `total_extlen * 8` extension bytes at the end of `body`.
fn strip_extensions<'a>(header: &InHeader, body: &'a [u8]) -> Result<&'a [u8], ParseError> {
    let ext = usize::from(header.total_extlen) * 8;
    body.len()
        .checked_sub(ext)
        .and_then(|keep| body.get(..keep))
        .ok_or(ParseError::Inconsistent {
            opcode: header.opcode,
            what: EXTENSIONS_TOO_LONG,
        })
}

const EXTENSIONS_TOO_LONG: &str = "extensions are longer than the request";

/// Where an opcode's arguments live.
#[derive(Clone, Copy)]
enum Args<'a, 'b> {
    /// `/dev/fuse`: the fixed struct, then variable data, in one slice.
    Joined(&'a [u8]),
    /// io_uring: the fixed struct in `op`, variable data in `payload`.
    Split { op: &'b [u8], payload: &'a [u8] },
}

impl<'a> Args<'a, '_> {
    /// The opcode's fixed struct, by value, and the variable data after it.
    fn fixed<T: FromBytes>(self, opcode: u32) -> Result<(T, &'a [u8]), ParseError> {
        let truncated = |have: usize| ParseError::Truncated {
            opcode,
            need: core::mem::size_of::<T>(),
            have,
        };
        match self {
            Args::Joined(body) => T::read_from_prefix(body).map_err(|_| truncated(body.len())),
            Args::Split { op, payload } => T::read_from_prefix(op)
                .map(|(value, _)| (value, payload))
                .map_err(|_| truncated(op.len())),
        }
    }

    /// The first `len` bytes of the opcode's fixed struct (an older, shorter form of it), the
    /// rest zero-filled, and the variable data after them.
    fn fixed_prefix<T: FromBytes + IntoBytes>(
        self,
        opcode: u32,
        len: usize,
    ) -> Result<(T, &'a [u8]), ParseError> {
        let len = len.min(core::mem::size_of::<T>());
        let src = match self {
            Args::Joined(body) => body,
            Args::Split { op, .. } => op,
        };
        let head = src.get(..len).ok_or(ParseError::Truncated {
            opcode,
            need: len,
            have: src.len(),
        })?;
        let mut value = T::new_zeroed();
        value.as_mut_bytes()[..len].copy_from_slice(head);
        let rest = match self {
            Args::Joined(body) => &body[len..],
            Args::Split { payload, .. } => payload,
        };
        Ok((value, rest))
    }

    /// Variable data of an opcode that has no fixed struct.
    fn variable(self) -> &'a [u8] {
        match self {
            Args::Joined(body) => body,
            Args::Split { payload, .. } => payload,
        }
    }

    /// The INIT argument, zero-filling what a pre-7.36 kernel does not send.
    fn init(self, opcode: u32) -> Result<InitIn, ParseError> {
        let src = match self {
            Args::Joined(body) => body,
            Args::Split { op, .. } => op,
        };
        if src.len() < INIT_IN_COMPAT_SIZE {
            return Err(ParseError::Truncated {
                opcode,
                need: INIT_IN_COMPAT_SIZE,
                have: src.len(),
            });
        }
        let mut raw = [0u8; core::mem::size_of::<InitIn>()];
        let n = src.len().min(raw.len());
        raw[..n].copy_from_slice(&src[..n]);
        InitIn::read_from_bytes(&raw).map_err(|_| ParseError::Truncated {
            opcode,
            need: raw.len(),
            have: n,
        })
    }
}

fn decode<'a>(
    opcode: u32,
    args: Args<'a, '_>,
    layouts: Layouts,
) -> Result<Operation<'a>, ParseError> {
    let Some(known) = Opcode::from_u32(opcode) else {
        return Ok(Operation::Unknown(opcode));
    };
    let inconsistent = |what| ParseError::Inconsistent { opcode, what };
    let op = match known {
        Opcode::Init => Operation::Init(args.init(opcode)?),
        Opcode::Destroy => Operation::Destroy,
        Opcode::Statfs => Operation::Statfs,
        Opcode::Lookup => {
            let raw = args.variable();
            let end = raw
                .iter()
                .position(|&b| b == 0)
                .ok_or_else(|| inconsistent("name is not NUL-terminated"))?;
            Operation::Lookup { name: &raw[..end] }
        }
        Opcode::Forget => Operation::Forget(args.fixed(opcode)?.0),
        Opcode::BatchForget => {
            let (arg, rest): (BatchForgetIn, _) = args.fixed(opcode)?;
            let entries = usize::try_from(arg.count)
                .ok()
                .and_then(|n| n.checked_mul(core::mem::size_of::<ForgetOne>()))
                .ok_or_else(|| inconsistent("forget count overflows"))?;
            if rest.len() < entries {
                return Err(ParseError::Truncated {
                    opcode,
                    need: core::mem::size_of::<BatchForgetIn>().saturating_add(entries),
                    have: core::mem::size_of::<BatchForgetIn>() + rest.len(),
                });
            }
            Operation::BatchForget {
                count: arg.count,
                entries: &rest[..entries],
            }
        }
        Opcode::Getattr => Operation::Getattr(args.fixed(opcode)?.0),
        Opcode::Setattr => Operation::Setattr(args.fixed(opcode)?.0),
        Opcode::Open => Operation::Open(args.fixed(opcode)?.0),
        Opcode::Release => Operation::Release(args.fixed(opcode)?.0),
        Opcode::Read => Operation::Read(args.fixed::<ReadIn>(opcode)?.0),
        Opcode::Write => {
            let (arg, data): (WriteIn, _) = args.fixed(opcode)?;
            if usize::try_from(arg.size).ok() != Some(data.len()) {
                return Err(inconsistent("write data length differs from size"));
            }
            Operation::Write { arg, data }
        }
        Opcode::Flush => Operation::Flush(args.fixed::<FlushIn>(opcode)?.0),
        Opcode::Fsync => Operation::Fsync(args.fixed::<FsyncIn>(opcode)?.0),
        Opcode::Fallocate => Operation::Fallocate(args.fixed::<FallocateIn>(opcode)?.0),
        Opcode::Lseek => Operation::Lseek(args.fixed::<LseekIn>(opcode)?.0),
        Opcode::Interrupt => Operation::Interrupt(args.fixed::<InterruptIn>(opcode)?.0),
        Opcode::Readlink => Operation::Readlink,
        Opcode::Symlink => {
            let (name, rest) = c_str(args.variable(), opcode)?;
            let (target, _) = c_str(rest, opcode)?;
            Operation::Symlink { name, target }
        }
        Opcode::Mknod => {
            let (arg, rest): (MknodIn, _) = args.fixed(opcode)?;
            let name = c_str(rest, opcode)?.0;
            Operation::Mknod { arg, name }
        }
        Opcode::Mkdir => {
            let (arg, rest): (MkdirIn, _) = args.fixed(opcode)?;
            let name = c_str(rest, opcode)?.0;
            Operation::Mkdir { arg, name }
        }
        Opcode::Unlink => Operation::Unlink {
            name: c_str(args.variable(), opcode)?.0,
        },
        Opcode::Rmdir => Operation::Rmdir {
            name: c_str(args.variable(), opcode)?.0,
        },
        Opcode::Rename => {
            let (arg, rest): (RenameIn, _) = args.fixed(opcode)?;
            let (old, rest) = c_str(rest, opcode)?;
            let (new, _) = c_str(rest, opcode)?;
            Operation::Rename {
                newdir: arg.newdir,
                flags: 0,
                old,
                new,
            }
        }
        Opcode::Rename2 => {
            let (arg, rest): (Rename2In, _) = args.fixed(opcode)?;
            let (old, rest) = c_str(rest, opcode)?;
            let (new, _) = c_str(rest, opcode)?;
            Operation::Rename {
                newdir: arg.newdir,
                flags: arg.flags,
                old,
                new,
            }
        }
        Opcode::Link => {
            let (arg, rest): (LinkIn, _) = args.fixed(opcode)?;
            let name = c_str(rest, opcode)?.0;
            Operation::Link { arg, name }
        }
        Opcode::Create => {
            let (arg, rest): (CreateIn, _) = args.fixed(opcode)?;
            let name = c_str(rest, opcode)?.0;
            Operation::Create { arg, name }
        }
        // The kernel sends a placeholder name after the struct, as for CREATE; the file has none.
        Opcode::Tmpfile => {
            let (arg, rest): (CreateIn, _) = args.fixed(opcode)?;
            c_str(rest, opcode)?;
            Operation::Tmpfile(arg)
        }
        Opcode::Opendir => Operation::Opendir(args.fixed(opcode)?.0),
        Opcode::Readdir => Operation::Readdir(args.fixed(opcode)?.0),
        Opcode::Readdirplus => Operation::Readdirplus(args.fixed(opcode)?.0),
        Opcode::Releasedir => Operation::Releasedir(args.fixed(opcode)?.0),
        Opcode::Fsyncdir => Operation::Fsyncdir(args.fixed(opcode)?.0),
        Opcode::Setxattr => {
            let (arg, rest): (SetxattrIn, _) = if layouts.setxattr_ext {
                args.fixed(opcode)?
            } else {
                args.fixed_prefix(opcode, SETXATTR_IN_COMPAT_SIZE)?
            };
            let (name, rest) = c_str(rest, opcode)?;
            let value = usize::try_from(arg.size)
                .ok()
                .and_then(|n| rest.get(..n))
                .ok_or_else(|| inconsistent("xattr value is shorter than its size"))?;
            Operation::Setxattr { arg, name, value }
        }
        Opcode::Getxattr => {
            let (arg, rest): (GetxattrIn, _) = args.fixed(opcode)?;
            let name = c_str(rest, opcode)?.0;
            Operation::Getxattr { arg, name }
        }
        Opcode::Listxattr => Operation::Listxattr(args.fixed(opcode)?.0),
        Opcode::Removexattr => Operation::Removexattr {
            name: c_str(args.variable(), opcode)?.0,
        },
        Opcode::Access => Operation::Access(args.fixed(opcode)?.0),
        Opcode::Statx => Operation::Statx(args.fixed(opcode)?.0),
        Opcode::CopyFileRange => Operation::CopyFileRange(args.fixed(opcode)?.0),
        Opcode::CopyFileRange64 => Operation::CopyFileRange64(args.fixed(opcode)?.0),
        other => Operation::Unsupported(other),
    };
    Ok(op)
}

/// Splits a NUL-terminated string off the front of `raw`: the bytes before the NUL, and what
/// follows it.
fn c_str(raw: &[u8], opcode: u32) -> Result<(&[u8], &[u8]), ParseError> {
    let end = raw
        .iter()
        .position(|&b| b == 0)
        .ok_or(ParseError::Inconsistent {
            opcode,
            what: "name is not NUL-terminated",
        })?;
    Ok((&raw[..end], &raw[end + 1..]))
}

/// The entries of a BATCH_FORGET, as `Operation::BatchForget::entries` holds them.
pub fn forget_entries(entries: &[u8]) -> impl Iterator<Item = ForgetOne> + '_ {
    entries
        .chunks_exact(core::mem::size_of::<ForgetOne>())
        .filter_map(|c| ForgetOne::read_from_bytes(c).ok())
}

#[cfg(test)]
mod tests;
