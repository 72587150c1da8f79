//! `--passthrough`: whether opens of the export are handed to the kernel's FUSE passthrough, which
//! then serves read, write and mmap from the image file itself (docs/passthrough.md).
//!
//! Decided in two steps around INIT: what the command line and the image allow ([`Plan::new`],
//! before mounting, so `--passthrough on` fails early where it can), then what the kernel allows
//! ([`Plan::finish`]: INIT granted `FUSE_PASSTHROUGH`, and registering the image as a backing file
//! was permitted). `auto` logs why it is off and serves normally; `on` fails with that reason.

use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};

use anyhow::{bail, Result};
use backend::{BlockBackend, PassthroughSource};
use export::{Export, Passthrough};
use fuse_abi::FUSE_PASSTHROUGH;
use transport::passthrough::{stack_depth_for, Backing};
use transport::{
    negotiate_init, negotiate_init_passthrough, InitParams, Negotiated, TransportError,
};

use crate::cli::{MountArgs, PassthroughArg};
use crate::restart::HandedBacking;

/// Why passthrough is not used.
#[derive(Debug)]
pub enum NotUsed {
    /// `--passthrough off`.
    Off,
    /// The backend has no file behind it (`null:`).
    NoBackingFile(String),
    /// A block device: the kernel passes through to regular files only.
    BlockDevice(String),
    /// An image format (qcow2): the file's bytes are not the guest's, fusex must translate.
    Formatted(String),
    /// One partition or byte range of the image (`--partition`, `--offset`, `--size`):
    /// passthrough serves whole files only.
    Partition(String),
    /// `--kernel-cache` wants the FUSE page cache, which passthrough bypasses.
    KernelCache,
    /// `--fault` injects faults into the I/O fusex does itself.
    Faults,
    /// INIT did not offer `FUSE_PASSTHROUGH`.
    KernelTooOld,
    /// `FUSE_DEV_IOC_BACKING_OPEN` said EPERM: no `CAP_SYS_ADMIN` in the initial user namespace.
    NotPermitted,
    /// ELOOP: the image's filesystem is stacked deeper than passthrough allows.
    Stacked,
    /// Anything else the kernel said when registering the image.
    Kernel(io::Error),
}

impl fmt::Display for NotUsed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotUsed::Off => write!(f, "--passthrough off"),
            NotUsed::Faults => write!(
                f,
                "--fault is given (faults are injected into the reads and writes fusex serves)"
            ),
            NotUsed::NoBackingFile(img) => {
                write!(
                    f,
                    "{img} has no file behind it (passthrough needs a raw image file)"
                )
            }
            NotUsed::BlockDevice(img) => write!(
                f,
                "{img} is a block device (the kernel passes through to regular files only)"
            ),
            NotUsed::Formatted(img) => write!(
                f,
                "{img} is a formatted image (qcow2, vhd, ...): only raw images can be passed through"
            ),
            NotUsed::Partition(img) => write!(
                f,
                "a partition or byte range of {img} is served: the kernel would pass the whole \
                 image through"
            ),
            NotUsed::KernelCache => write!(
                f,
                "--kernel-cache asks for the FUSE page cache, which passthrough bypasses"
            ),
            NotUsed::KernelTooOld => write!(
                f,
                "the kernel did not offer FUSE_PASSTHROUGH (needs Linux 6.9+ built with \
                 CONFIG_FUSE_PASSTHROUGH)"
            ),
            NotUsed::NotPermitted => write!(
                f,
                "registering the image as a backing file is not permitted (needs CAP_SYS_ADMIN \
                 in the initial user namespace: run fusex as root, outside a user namespace)"
            ),
            NotUsed::Stacked => write!(
                f,
                "the image is on a filesystem stacked too deeply for passthrough (ELOOP)"
            ),
            NotUsed::Kernel(e) => write!(f, "registering the image as a backing file failed: {e}"),
        }
    }
}

impl NotUsed {
    /// The reason for an errno of `FUSE_DEV_IOC_BACKING_OPEN`.
    fn from_register_error(e: io::Error) -> NotUsed {
        match e.raw_os_error() {
            Some(libc::EPERM) => NotUsed::NotPermitted,
            Some(libc::ELOOP) => NotUsed::Stacked,
            Some(libc::EOPNOTSUPP) => NotUsed::KernelTooOld,
            _ => NotUsed::Kernel(e),
        }
    }
}

/// What the export could pass through, before the kernel had its say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Want {
    /// The image file to register.
    image_fd: RawFd,
    /// Opens for writing are passed through too (see [`Passthrough::write_opens`]).
    write_opens: bool,
    /// `max_stack_depth` for INIT.
    stack_depth: u32,
}

/// The passthrough decision in progress.
pub struct Plan {
    mode: PassthroughArg,
    want: Result<Want, NotUsed>,
    /// `--max-size` holds a growable export below the filesystem's limit.
    bounded: bool,
}

impl Plan {
    /// What the command line and the image allow. Fails only for `--passthrough on`.
    pub fn new(args: &MountArgs, backend: &impl BlockBackend) -> Result<Plan> {
        let image = || args.image.clone();
        let want = match (args.passthrough, backend.capabilities().passthrough) {
            (PassthroughArg::Off, _) => Err(NotUsed::Off),
            (_, PassthroughSource::NoFile) => Err(NotUsed::NoBackingFile(image())),
            (_, PassthroughSource::Formatted) => Err(NotUsed::Formatted(image())),
            (_, PassthroughSource::Window) => Err(NotUsed::Partition(image())),
            (_, PassthroughSource::BlockDevice) => Err(NotUsed::BlockDevice(image())),
            _ if args.kernel_cache => Err(NotUsed::KernelCache),
            _ if !args.fault.is_empty() => Err(NotUsed::Faults),
            (_, PassthroughSource::File(fd)) => Ok(Want {
                image_fd: fd,
                // The kernel extends a passed-through file up to the filesystem's limit only:
                // a lower --max-size needs writes to come to fusex.
                write_opens: !args.writable || (args.growable && args.max_size.is_none()),
                stack_depth: stack_depth_for(fd),
            }),
        };
        let plan = Plan {
            mode: args.passthrough,
            want,
            bounded: args.max_size.is_some(),
        };
        if let (PassthroughArg::On, Err(why)) = (plan.mode, &plan.want) {
            bail!("--passthrough on is not possible: {why}; use --passthrough auto or off");
        }
        Ok(plan)
    }

    /// Answers INIT, asking for `FUSE_PASSTHROUGH` only if it may be used.
    pub fn negotiate_init(
        &self,
        fd: BorrowedFd<'_>,
        p: &InitParams,
    ) -> std::result::Result<Negotiated, TransportError> {
        match &self.want {
            Ok(w) => negotiate_init_passthrough(fd, p, w.stack_depth),
            Err(_) => negotiate_init(fd, p),
        }
    }

    /// After INIT: registers the image and turns passthrough on in `export`, or says why not (one
    /// info line either way). The returned backing id must outlive the queues; dropping it closes
    /// the id. Fails only for `--passthrough on`.
    ///
    /// A restart successor passes the id its predecessor `handed` over instead: that id is used
    /// and nothing is registered (None is returned; the successor owns the id once the
    /// predecessor let go). Fails if the image opened here is not the file registered under it.
    pub fn finish<B: BlockBackend>(
        self,
        neg: &Negotiated,
        conn: BorrowedFd<'_>,
        export: &Export<B>,
        direct: bool,
        handed: Option<HandedBacking>,
    ) -> Result<Option<Backing>> {
        let bounded = self.bounded;
        if let (Some(h), Ok(w)) = (handed, &self.want) {
            let file = transport::passthrough::file_of(w.image_fd)?;
            if file != h.file {
                bail!(
                    "the image is another file now than the one the daemon passes through to \
                     (device {}, inode {}; it was replaced since): stop the export and mount it \
                     again",
                    h.file.0,
                    h.file.1
                );
            }
        }
        let decided = decide(self.want, neg.has(FUSE_PASSTHROUGH), |w| match handed {
            Some(h) => Ok((h.id, None)),
            None => Backing::open(conn.as_raw_fd(), w.image_fd)
                .map(|b| (b.id(), Some(b)))
                .map_err(|e| match e {
                    TransportError::Io(e) => e,
                    other => io::Error::other(other.to_string()),
                }),
        });
        match decided {
            Ok((want, (id, backing))) => {
                export.set_passthrough(Passthrough {
                    backing_id: id,
                    write_opens: want.write_opens,
                });
                let what = if want.write_opens {
                    "read, write and mmap go from the kernel to the image file"
                } else if bounded {
                    "opens for reading and mmap go from the kernel to the image file; reads and \
                     writes of files opened for writing come to fusex, which holds the image to \
                     --max-size"
                } else {
                    "opens for reading and mmap go from the kernel to the image file; reads and \
                     writes of files opened for writing come to fusex, which keeps the image's \
                     fixed size (add --growable to pass them through too)"
                };
                let cache = if direct {
                    "; --direct covers only I/O fusex does itself: passed-through I/O uses the \
                     image's page cache unless the application opens with O_DIRECT"
                } else {
                    ""
                };
                let whose = if handed.is_some() {
                    ", the previous process's"
                } else {
                    ""
                };
                tracing::info!("passthrough: on, backing id {id}{whose} ({what}{cache})");
                Ok(backing)
            }
            Err(why) if self.mode == PassthroughArg::On => {
                bail!("--passthrough on is not possible: {why}; use --passthrough auto or off")
            }
            Err(why) => {
                tracing::info!("passthrough: off ({why})");
                Ok(None)
            }
        }
    }
}

/// The kernel's part of the decision: INIT must have granted passthrough and registering the image
/// must succeed. `register` is injected so the fallback can be tested without privileges.
fn decide<T>(
    want: Result<Want, NotUsed>,
    granted: bool,
    register: impl FnOnce(&Want) -> io::Result<T>,
) -> std::result::Result<(Want, T), NotUsed> {
    let want = want?;
    if !granted {
        return Err(NotUsed::KernelTooOld);
    }
    match register(&want) {
        Ok(t) => Ok((want, t)),
        Err(e) => Err(NotUsed::from_register_error(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn want() -> Want {
        Want {
            image_fd: 3,
            write_opens: true,
            stack_depth: 1,
        }
    }

    #[test]
    fn eperm_falls_back_with_the_capability_reason() {
        let r = decide(Ok(want()), true, |_| -> io::Result<()> {
            Err(io::Error::from_raw_os_error(libc::EPERM))
        });
        let why = r.unwrap_err();
        assert!(matches!(why, NotUsed::NotPermitted));
        assert!(why.to_string().contains("CAP_SYS_ADMIN"), "{why}");
    }

    #[test]
    fn not_granted_means_kernel_too_old_and_nothing_is_registered() {
        let r = decide(Ok(want()), false, |_| -> io::Result<()> {
            panic!("must not register without FUSE_PASSTHROUGH")
        });
        assert!(matches!(r.unwrap_err(), NotUsed::KernelTooOld));
    }

    #[test]
    fn static_reasons_win_before_the_kernel_is_asked() {
        let r = decide(
            Err(NotUsed::NoBackingFile("null:1G".into())),
            true,
            |_| -> io::Result<()> { panic!("must not register") },
        );
        assert!(r.unwrap_err().to_string().contains("null:1G"));
    }

    #[test]
    fn other_errnos_map_to_their_reasons() {
        let e = |n| NotUsed::from_register_error(io::Error::from_raw_os_error(n));
        assert!(matches!(e(libc::ELOOP), NotUsed::Stacked));
        assert!(matches!(e(libc::EOPNOTSUPP), NotUsed::KernelTooOld));
        assert!(matches!(e(libc::EINVAL), NotUsed::Kernel(_)));
    }

    #[test]
    fn success_passes_the_registration_through() {
        let (w, id) = decide(Ok(want()), true, |w| Ok(w.image_fd + 4)).unwrap();
        assert_eq!((w, id), (want(), 7));
    }
}
