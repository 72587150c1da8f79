//! A thread's Linux capability sets, read and written with `capget(2)`/`capset(2)`.
//!
//! Capabilities are per thread on Linux: these calls read and change the calling thread only,
//! and a thread inherits its creator's sets when it is made. The kernel ABI
//! (`_LINUX_CAPABILITY_VERSION_3`) splits each set into two 32-bit words; [`Sets`] joins them
//! into one `u64` per set, bit `n` for capability `n`, so callers test and change capabilities
//! with [`bit`] and plain bit operations. Both the binary's privilege drop and the directory
//! export's `CAP_FSETID` juggling use this one copy of the ABI.

use std::io;

/// A capability number: its bit in a [`Sets`] word.
pub type Cap = u32;

/// `CAP_CHOWN`.
pub const CAP_CHOWN: Cap = 0;
/// `CAP_DAC_OVERRIDE`.
pub const CAP_DAC_OVERRIDE: Cap = 1;
/// `CAP_DAC_READ_SEARCH`.
pub const CAP_DAC_READ_SEARCH: Cap = 2;
/// `CAP_FOWNER`.
pub const CAP_FOWNER: Cap = 3;
/// `CAP_FSETID`.
pub const CAP_FSETID: Cap = 4;
/// `CAP_SETPCAP`.
pub const CAP_SETPCAP: Cap = 8;
/// `CAP_SYS_ADMIN`.
pub const CAP_SYS_ADMIN: Cap = 21;
/// `CAP_SYS_NICE`.
pub const CAP_SYS_NICE: Cap = 23;

/// The bit of `cap` in a set.
pub const fn bit(cap: Cap) -> u64 {
    1 << cap
}

/// `_LINUX_CAPABILITY_VERSION_3`: two 32-bit words per set.
const VERSION_3: u32 = 0x2008_0522;

/// `struct __user_cap_header_struct`.
#[repr(C)]
struct Header {
    version: u32,
    /// 0: the calling thread.
    pid: libc::c_int,
}

/// `struct __user_cap_data_struct`, one per 32 capabilities.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Data {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// A thread's effective, permitted and inheritable sets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sets {
    /// What the kernel checks.
    pub effective: u64,
    /// What the thread may put into `effective`.
    pub permitted: u64,
    /// What survives an `execve`.
    pub inheritable: u64,
}

/// The calling thread's capability sets.
pub fn get() -> io::Result<Sets> {
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget reads the header and writes two data structs (version 3), both valid,
    // writable and of the kernel's layout for the whole call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_capget,
            &mut header as *mut Header,
            data.as_mut_ptr(),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let join = |lo: u32, hi: u32| u64::from(lo) | u64::from(hi) << 32;
    Ok(Sets {
        effective: join(data[0].effective, data[1].effective),
        permitted: join(data[0].permitted, data[1].permitted),
        inheritable: join(data[0].inheritable, data[1].inheritable),
    })
}

/// Sets the calling thread's capability sets (the kernel refuses to raise `permitted` or to put
/// into `effective` what `permitted` lacks).
pub fn set(s: Sets) -> io::Result<()> {
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let split = |v: u64| (v as u32, (v >> 32) as u32);
    let (e, p, i) = (split(s.effective), split(s.permitted), split(s.inheritable));
    let data = [
        Data {
            effective: e.0,
            permitted: p.0,
            inheritable: i.0,
        },
        Data {
            effective: e.1,
            permitted: p.1,
            inheritable: i.1,
        },
    ];
    // SAFETY: capset reads the header and two data structs (version 3), valid and of the
    // kernel's layout for the whole call.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut header as *mut Header, data.as_ptr()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Runs `f` with `cap` out of the calling thread's effective set, then puts it back; `f` runs
/// as the thread is when the thread lacks `cap` or the sets cannot be read or changed. The
/// error, if the capability could not be taken back, is returned beside `f`'s result: the
/// thread then runs on without it.
pub fn without<T>(cap: Cap, f: impl FnOnce() -> T) -> (T, io::Result<()>) {
    let Ok(sets) = get() else {
        return (f(), Ok(()));
    };
    if sets.effective & bit(cap) == 0 {
        return (f(), Ok(()));
    }
    let less = Sets {
        effective: sets.effective & !bit(cap),
        ..sets
    };
    if set(less).is_err() {
        return (f(), Ok(()));
    }
    let r = f();
    (r, set(sets))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_writes_back_what_get_read() {
        let before = get().unwrap();
        set(before).unwrap();
        assert_eq!(get().unwrap(), before);
    }

    /// The capability is out of the effective set inside the closure only, and nothing else
    /// changes; run in a thread of its own so a failure leaves the test harness's sets alone.
    #[test]
    fn without_drops_the_capability_for_the_call_only() {
        std::thread::spawn(|| {
            let before = get().unwrap();
            let (inside, back) = without(CAP_FSETID, || get().unwrap());
            back.unwrap();
            assert_eq!(inside.effective, before.effective & !bit(CAP_FSETID));
            assert_eq!(inside.permitted, before.permitted);
            assert_eq!(inside.inheritable, before.inheritable);
            assert_eq!(get().unwrap(), before);
        })
        .join()
        .unwrap();
    }

    /// A capability above 31 lives in the second word of the kernel's sets: `CAP_SYSLOG` (34),
    /// in the effective set of a root test run, leaves and comes back through it.
    #[test]
    fn a_capability_of_the_second_word_round_trips() {
        std::thread::spawn(|| {
            let syslog: Cap = 34;
            let before = get().unwrap();
            let (inside, back) = without(syslog, || get().unwrap());
            back.unwrap();
            assert_eq!(inside.effective, before.effective & !bit(syslog));
            assert_eq!(get().unwrap(), before);
        })
        .join()
        .unwrap();
    }
}
