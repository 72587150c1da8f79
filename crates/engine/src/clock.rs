//! The monotonic clock as nanoseconds in a `u64`: what request timing subtracts and buckets.
//! `Instant` carries seconds and nanoseconds apart, so each difference normalizes both and
//! builds a `Duration`; on the request path a plain subtraction is what is wanted.

/// Nanoseconds on `CLOCK_MONOTONIC` (the vDSO's clock read, no system call): comparable
/// between threads of the process, never going back. 0 never occurs after boot, so callers may
/// use it for "no reading".
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_clock_moves_forward_with_instant() {
        let a = super::now_ns();
        let i = std::time::Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = super::now_ns();
        assert!(a > 0 && b > a);
        let ours = b - a;
        let std = i.elapsed().as_nanos() as u64;
        assert!(
            ours >= 2_000_000 && ours.abs_diff(std) < 1_000_000,
            "{ours} vs {std}"
        );
    }
}
