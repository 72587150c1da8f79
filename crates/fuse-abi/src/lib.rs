//! The Linux FUSE kernel ABI (protocol 7.45, Linux 6.18) as plain Rust data.
//!
//! This crate is the only place in fusex that knows the byte layout of the
//! `/dev/fuse` protocol. It holds:
//!
//! * [`structs`]: `#[repr(C)]` request and reply structs whose sizes and field
//!   offsets are pinned by compile-time assertions;
//! * [`opcode`]: the request opcodes;
//! * [`flags`]: INIT, OPEN, SETATTR, READ/WRITE, FSYNC and fallocate flag bits;
//! * [`uring`]: FUSE-over-io_uring structs, passthrough structs and the device
//!   ioctl numbers;
//! * [`request`]: a panic-free decoder for the untrusted bytes the kernel sends;
//! * [`reply`]: encoders for the replies the server writes back.
//!
//! It performs no I/O and contains no `unsafe`: all byte conversions go through
//! `zerocopy`, and every struct is read by value so buffer alignment never
//! matters.
//!
//! ```
//! use fuse_abi::{encode, encode_error, parse, peek_unique, LseekOut, Operation};
//!
//! fn answer(request: &[u8], reply: &mut [u8]) -> usize {
//!     let req = match parse(request) {
//!         Ok(req) => req,
//!         Err(e) => match peek_unique(request) {
//!             Some(unique) => return encode_error(reply, unique, e.errno()).unwrap_or(0),
//!             None => return 0, // not even a header: nothing to answer
//!         },
//!     };
//!     let unique = req.header.unique;
//!     match req.op {
//!         Operation::Lseek(arg) => {
//!             encode(reply, unique, &LseekOut { offset: arg.offset }).unwrap_or(0)
//!         }
//!         _ => encode_error(reply, unique, 38 /* ENOSYS */).unwrap_or(0),
//!     }
//! }
//! # let mut out = [0u8; 64];
//! # assert_eq!(answer(&[0u8; 8], &mut out), 0);
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod flags;
pub mod opcode;
pub mod reply;
pub mod request;
pub mod structs;
pub mod uring;

pub use flags::*;
pub use opcode::{Opcode, MAX_OPCODE};
pub use reply::{encode, encode_bytes, encode_error, write_header, EncodeError, OUT_HEADER_LEN};
pub use request::{
    forget_entries, parse, parse_laid_out, parse_op, parse_op_split, parse_op_split_laid_out,
    parse_with_len_check, peek_unique, Layouts, Operation, ParseError, Request, IN_HEADER_LEN,
};
pub use structs::*;
pub use uring::*;

/// Major protocol version this crate speaks; a kernel with another major is refused.
pub const KERNEL_VERSION: u32 = 7;

/// Highest minor protocol version whose layouts this crate knows (Linux 6.18).
pub const KERNEL_MINOR_VERSION: u32 = 45;

/// Node id of the filesystem root; for fusex this is the exported file itself.
pub const ROOT_ID: u64 = 1;

/// Smallest buffer the kernel accepts for a `read(2)` of `/dev/fuse`.
pub const FUSE_MIN_READ_BUFFER: usize = 8192;
