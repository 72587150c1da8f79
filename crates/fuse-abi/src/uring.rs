//! FUSE-over-io_uring structs (protocol 7.42+), passthrough structs (7.40+)
//! and the `/dev/fuse` ioctl numbers.
//!
//! With `FUSE_OVER_IO_URING` negotiated, each ring entry owns a 288-byte
//! [`UringReqHeader`] and a payload buffer. The kernel writes the
//! `fuse_in_header` into `in_out`, the opcode's fixed argument struct into
//! `op_in` and everything else (names, write data, extensions) into the
//! payload; see [`crate::parse_op_split`]. The server answers by writing its
//! `fuse_out_header` into `in_out`, the reply body into the payload and the
//! body length into `ring_ent_in_out.payload_sz`.

use zerocopy::{FromBytes, FromZeros, Immutable, IntoBytes, KnownLayout};

/// Bytes reserved for the in/out header inside [`UringReqHeader`].
pub const FUSE_URING_IN_OUT_HEADER_SZ: usize = 128;
/// Bytes reserved for the per-opcode argument inside [`UringReqHeader`].
pub const FUSE_URING_OP_IN_OUT_SZ: usize = 128;

/// `cmd_op` of the SQE that registers an entry and waits for a request.
pub const FUSE_IO_URING_CMD_REGISTER: u32 = 1;
/// `cmd_op` of the SQE that commits a reply and waits for the next request.
pub const FUSE_IO_URING_CMD_COMMIT_AND_FETCH: u32 = 2;

/// Per-entry control block inside [`UringReqHeader`] (`fuse_uring_ent_in_out`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct UringEntInOut {
    /// Reserved; zero.
    pub flags: u64,
    /// Id to pass back in [`UringCmdReq::commit_id`] (the request's `unique`).
    pub commit_id: u64,
    /// Bytes used in the payload buffer (request from kernel, reply from server).
    pub payload_sz: u32,
    /// Unused.
    pub padding: u32,
    /// Reserved; zero.
    pub reserved: u64,
}
const _: () = {
    assert!(core::mem::size_of::<UringEntInOut>() == 32);
    assert!(core::mem::offset_of!(UringEntInOut, flags) == 0);
    assert!(core::mem::offset_of!(UringEntInOut, commit_id) == 8);
    assert!(core::mem::offset_of!(UringEntInOut, payload_sz) == 16);
    assert!(core::mem::offset_of!(UringEntInOut, padding) == 20);
    assert!(core::mem::offset_of!(UringEntInOut, reserved) == 24);
};

/// The header buffer of one ring entry (`fuse_uring_req_header`), iovec 0 of
/// a REGISTER command.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct UringReqHeader {
    /// Kernel writes an `InHeader` here; the server its `OutHeader`.
    pub in_out: [u8; FUSE_URING_IN_OUT_HEADER_SZ],
    /// The opcode's fixed argument struct (e.g. `ReadIn`).
    pub op_in: [u8; FUSE_URING_OP_IN_OUT_SZ],
    /// Commit id and payload size.
    pub ring_ent_in_out: UringEntInOut,
}
const _: () = {
    assert!(core::mem::size_of::<UringReqHeader>() == 288);
    assert!(core::mem::offset_of!(UringReqHeader, in_out) == 0);
    assert!(core::mem::offset_of!(UringReqHeader, op_in) == 128);
    assert!(core::mem::offset_of!(UringReqHeader, ring_ent_in_out) == 256);
};

impl Default for UringReqHeader {
    fn default() -> Self {
        Self::new_zeroed()
    }
}

/// The 80-byte SQE command area of a FUSE uring command (`fuse_uring_cmd_req`).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct UringCmdReq {
    /// Reserved; zero.
    pub flags: u64,
    /// Request being answered (0 for REGISTER).
    pub commit_id: u64,
    /// Queue index (= CPU number).
    pub qid: u16,
    /// Unused.
    pub padding: [u8; 6],
}
const _: () = {
    assert!(core::mem::size_of::<UringCmdReq>() == 24);
    assert!(core::mem::offset_of!(UringCmdReq, flags) == 0);
    assert!(core::mem::offset_of!(UringCmdReq, commit_id) == 8);
    assert!(core::mem::offset_of!(UringCmdReq, qid) == 16);
    assert!(core::mem::offset_of!(UringCmdReq, padding) == 18);
};

/// Argument of `FUSE_DEV_IOC_BACKING_OPEN` (`fuse_backing_map`): registers an
/// open file as a passthrough backing file.
#[repr(C)]
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct BackingMap {
    /// File descriptor of the backing file.
    pub fd: i32,
    /// Reserved; zero.
    pub flags: u32,
    /// Reserved; zero.
    pub padding: u64,
}
const _: () = {
    assert!(core::mem::size_of::<BackingMap>() == 16);
    assert!(core::mem::offset_of!(BackingMap, fd) == 0);
    assert!(core::mem::offset_of!(BackingMap, flags) == 4);
    assert!(core::mem::offset_of!(BackingMap, padding) == 8);
};

// ------------------------------------------------------------------ ioctls

const IOC_NRBITS: u32 = 8;
const IOC_TYPEBITS: u32 = 8;
const IOC_SIZEBITS: u32 = 14;
const IOC_NRSHIFT: u32 = 0;
const IOC_TYPESHIFT: u32 = IOC_NRSHIFT + IOC_NRBITS;
const IOC_SIZESHIFT: u32 = IOC_TYPESHIFT + IOC_TYPEBITS;
const IOC_DIRSHIFT: u32 = IOC_SIZESHIFT + IOC_SIZEBITS;

/// `_IOC` direction: no data.
pub const IOC_NONE: u32 = 0;
/// `_IOC` direction: userspace writes, kernel reads.
pub const IOC_WRITE: u32 = 1;
/// `_IOC` direction: kernel writes, userspace reads.
pub const IOC_READ: u32 = 2;

/// Encodes an ioctl number the way Linux's generic `_IOC` macro does (the
/// layout used by x86, arm and most other architectures: 8-bit nr, 8-bit type,
/// 14-bit size, 2-bit direction).
pub const fn ioc(dir: u32, ty: u32, nr: u32, size: usize) -> u32 {
    (dir << IOC_DIRSHIFT)
        | (ty << IOC_TYPESHIFT)
        | (nr << IOC_NRSHIFT)
        | ((size as u32) << IOC_SIZESHIFT)
}

/// ioctl "type" byte of all `/dev/fuse` ioctls.
pub const FUSE_DEV_IOC_MAGIC: u32 = 229;

/// `_IOR(229, 0, uint32_t)`: attach a freshly opened `/dev/fuse` to an
/// existing connection (argument: pointer to the old fd as `u32`).
pub const FUSE_DEV_IOC_CLONE: u32 =
    ioc(IOC_READ, FUSE_DEV_IOC_MAGIC, 0, core::mem::size_of::<u32>());
/// `_IOW(229, 1, struct fuse_backing_map)`: register a passthrough backing
/// file; returns its backing id.
pub const FUSE_DEV_IOC_BACKING_OPEN: u32 = ioc(
    IOC_WRITE,
    FUSE_DEV_IOC_MAGIC,
    1,
    core::mem::size_of::<BackingMap>(),
);
/// `_IOW(229, 2, uint32_t)`: drop a backing id (argument: pointer to it).
pub const FUSE_DEV_IOC_BACKING_CLOSE: u32 = ioc(
    IOC_WRITE,
    FUSE_DEV_IOC_MAGIC,
    2,
    core::mem::size_of::<u32>(),
);
/// `_IO(229, 3)`: ask for INIT to be delivered during `mount(2)` (6.18+;
/// older kernels fail with ENOTTY).
pub const FUSE_DEV_IOC_SYNC_INIT: u32 = ioc(IOC_NONE, FUSE_DEV_IOC_MAGIC, 3, 0);

const _: () = {
    assert!(FUSE_DEV_IOC_CLONE == 0x8004_E500);
    assert!(FUSE_DEV_IOC_BACKING_OPEN == 0x4010_E501);
    assert!(FUSE_DEV_IOC_BACKING_CLOSE == 0x4004_E502);
    assert!(FUSE_DEV_IOC_SYNC_INIT == 0xE503);
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{InHeader, ReadIn};

    #[test]
    fn ioctl_numbers() {
        assert_eq!(FUSE_DEV_IOC_CLONE, 0x8004E500);
        assert_eq!(FUSE_DEV_IOC_BACKING_OPEN, 0x4010E501);
        assert_eq!(FUSE_DEV_IOC_BACKING_CLOSE, 0x4004E502);
        assert_eq!(FUSE_DEV_IOC_SYNC_INIT, 0xE503);
        // Field placement of the generic encoding.
        assert_eq!(ioc(IOC_READ | IOC_WRITE, 0xAB, 0xCD, 0x3FFF), 0xFFFF_ABCD);
        assert_eq!(ioc(IOC_NONE, 0, 0, 0), 0);
    }

    #[test]
    fn header_slots_hold_structs() {
        const { assert!(core::mem::size_of::<InHeader>() <= FUSE_URING_IN_OUT_HEADER_SZ) };
        const { assert!(core::mem::size_of::<ReadIn>() <= FUSE_URING_OP_IN_OUT_SZ) };
        let mut h = UringReqHeader::default();
        h.ring_ent_in_out.commit_id = 9;
        let bytes = h.as_bytes();
        assert_eq!(bytes.len(), 288);
        assert_eq!(&bytes[264..272], &9u64.to_ne_bytes());
    }
}
