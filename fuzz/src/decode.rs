//! The `decode` target: untrusted bytes through the request decoder of `fuse-abi`, in both
//! framings, checking what the decoder promises and that the framings agree.

use fuse_abi::{
    parse, parse_op_split, parse_with_len_check, peek_unique, InHeader, Opcode, Operation,
    ParseError, FUSE_URING_OP_IN_OUT_SZ, IN_HEADER_LEN,
};
use zerocopy::{FromBytes, IntoBytes};

/// Size of the fixed argument struct the kernel sends for `opcode`, for the opcodes the decoder
/// reads one for (`None`: the arguments are only variable data, or not looked at). A decoder
/// that starts reading one for another opcode must be added here too:
/// `tests::fixed_arg_len_covers_every_opcode` fails until it is.
pub fn fixed_arg_len(opcode: u32) -> Option<usize> {
    use std::mem::size_of;
    let n = match Opcode::from_u32(opcode)? {
        Opcode::Init => size_of::<fuse_abi::InitIn>(),
        Opcode::Forget => size_of::<fuse_abi::ForgetIn>(),
        Opcode::BatchForget => size_of::<fuse_abi::BatchForgetIn>(),
        Opcode::Getattr => size_of::<fuse_abi::GetattrIn>(),
        Opcode::Setattr => size_of::<fuse_abi::SetattrIn>(),
        Opcode::Open => size_of::<fuse_abi::OpenIn>(),
        Opcode::Release => size_of::<fuse_abi::ReleaseIn>(),
        Opcode::Read => size_of::<fuse_abi::ReadIn>(),
        Opcode::Write => size_of::<fuse_abi::WriteIn>(),
        Opcode::Flush => size_of::<fuse_abi::FlushIn>(),
        Opcode::Fsync => size_of::<fuse_abi::FsyncIn>(),
        Opcode::Fallocate => size_of::<fuse_abi::FallocateIn>(),
        Opcode::Lseek => size_of::<fuse_abi::LseekIn>(),
        Opcode::Interrupt => size_of::<fuse_abi::InterruptIn>(),
        Opcode::Mknod => size_of::<fuse_abi::MknodIn>(),
        Opcode::Mkdir => size_of::<fuse_abi::MkdirIn>(),
        Opcode::Rename => size_of::<fuse_abi::RenameIn>(),
        Opcode::Rename2 => size_of::<fuse_abi::Rename2In>(),
        Opcode::Link => size_of::<fuse_abi::LinkIn>(),
        Opcode::Create | Opcode::Tmpfile => size_of::<fuse_abi::CreateIn>(),
        Opcode::Opendir => size_of::<fuse_abi::OpenIn>(),
        Opcode::Readdir | Opcode::Readdirplus => size_of::<fuse_abi::ReadIn>(),
        Opcode::Releasedir => size_of::<fuse_abi::ReleaseIn>(),
        Opcode::Fsyncdir => size_of::<fuse_abi::FsyncIn>(),
        // Without SETXATTR_EXT (the decoder's default layout) the kernel sends the short form.
        Opcode::Setxattr => fuse_abi::SETXATTR_IN_COMPAT_SIZE,
        Opcode::Getxattr | Opcode::Listxattr => size_of::<fuse_abi::GetxattrIn>(),
        Opcode::Access => size_of::<fuse_abi::AccessIn>(),
        Opcode::Statx => size_of::<fuse_abi::StatxIn>(),
        Opcode::CopyFileRange | Opcode::CopyFileRange64 => size_of::<fuse_abi::CopyFileRangeIn>(),
        _ => return None,
    };
    Some(n)
}

/// True if `inner` lies entirely inside `outer` (borrowed bytes never come from elsewhere).
fn within(inner: &[u8], outer: &[u8]) -> bool {
    let (o, i) = (outer.as_ptr() as usize, inner.as_ptr() as usize);
    inner.is_empty() || (i >= o && i + inner.len() <= o + outer.len())
}

/// What every successful decode promises about the borrowed parts of an operation.
fn check_op(op: &Operation<'_>, source: &[u8]) {
    match op {
        Operation::Write { arg, data } => {
            assert_eq!(
                data.len() as u64,
                u64::from(arg.size),
                "WRITE data is arg.size"
            );
            assert!(within(data, source), "WRITE data outside the request");
        }
        Operation::Lookup { name } => {
            assert!(!name.contains(&0), "LOOKUP name holds its NUL");
            assert!(within(name, source), "LOOKUP name outside the request");
        }
        Operation::BatchForget { count, .. } => {
            let need = u64::from(*count) * 16;
            assert!(need <= source.len() as u64, "BATCH_FORGET entries missing");
        }
        _ => {}
    }
}

fn check_error(e: &ParseError, len: usize) {
    let errno = e.errno();
    assert!(errno == libc::EIO || errno == libc::EINVAL, "errno {errno}");
    assert_eq!(
        matches!(e, ParseError::TooShort { .. }),
        len < IN_HEADER_LEN,
        "too short exactly when the header is incomplete"
    );
}

/// One fuzz input: `data` as a `/dev/fuse` request, as a request with its length unchecked, and
/// split the io_uring way (header, 128-byte argument area, payload); then the same logical request
/// framed both ways must decode to the same operation.
pub fn run(data: &[u8]) {
    let joined = parse(data);
    match &joined {
        Ok(req) => {
            assert_eq!(req.header.len as usize, data.len(), "length checked");
            check_op(&req.op, data);
            assert_eq!(peek_unique(data), Some(req.header.unique));
        }
        Err(e) => check_error(e, data.len()),
    }
    let unchecked = parse_with_len_check(data, false);
    match (&joined, &unchecked) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "length check changes nothing else"),
        (Ok(_), Err(e)) => panic!("accepted with the length check, refused without: {e}"),
        (Err(_), Ok(req)) => check_op(&req.op, data),
        (Err(_), Err(e)) => check_error(e, data.len()),
    }

    let Ok((header, rest)) = InHeader::read_from_prefix(data) else {
        assert!(data.len() < IN_HEADER_LEN);
        return;
    };
    // The ring entry's argument area is 128 bytes; what the input does not fill stays zero.
    let mut op_in = [0u8; FUSE_URING_OP_IN_OUT_SZ];
    let n = rest.len().min(op_in.len());
    op_in[..n].copy_from_slice(&rest[..n]);
    let payload = &rest[n..];
    let split = parse_op_split(&header, &op_in, payload);
    match &split {
        Ok(op) => check_op(op, payload),
        Err(e) => check_error(e, data.len()),
    }

    // The same request in the /dev/fuse framing: header, the opcode's fixed struct from the
    // argument area, the payload.
    let fixed = fixed_arg_len(header.opcode).unwrap_or(0);
    let mut legacy = Vec::with_capacity(IN_HEADER_LEN + fixed + payload.len());
    legacy.extend_from_slice(header.as_bytes());
    legacy.extend_from_slice(&op_in[..fixed]);
    legacy.extend_from_slice(payload);
    let total = legacy.len() as u32;
    legacy[..4].copy_from_slice(&total.to_ne_bytes());
    let framed = parse(&legacy);
    if usize::from(header.total_extlen) * 8 > payload.len() {
        // Extensions longer than the payload: on /dev/fuse they would eat into the fixed struct
        // (which an INIT may survive, being allowed short); no kernel frames a request so.
        return;
    }
    match (&split, &framed) {
        (Ok(a), Ok(b)) => assert_eq!(*a, b.op, "framings decode the same request alike"),
        (Err(_), Err(_)) => {}
        (a, b) => panic!("framings disagree: io_uring {a:?}, /dev/fuse {b:?}"),
    }
}
