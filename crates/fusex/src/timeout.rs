//! `--request-timeout`: what the kernel will make of the value fusex sends in INIT.
//!
//! The rules (Linux 6.14+, `FUSE_REQUEST_TIMEOUT`): a value of 0 (or no flag) means the sysctl
//! `fs.fuse.default_request_timeout`; a non-zero `fs.fuse.max_request_timeout` caps the value (and
//! applies even when the server asked for none); whatever results, if non-zero, is raised to at
//! least 15 s, the period of the kernel's check. A request is caught between `timeout` and
//! `timeout + 15` s after it was queued, and then the whole connection is aborted.

/// The kernel's floor and check period, seconds.
pub const KERNEL_TIMEOUT_GRANULARITY: u32 = 15;

/// The timeout the kernel will apply, seconds (`None`: none), from what fusex sent (`None` when
/// the kernel did not offer the flag, which counts as 0) and the two sysctls (0 when unset or
/// unreadable).
pub fn effective(sent: Option<u16>, default_sysctl: u32, max_sysctl: u32) -> Option<u32> {
    let mut t = u32::from(sent.unwrap_or(0));
    if t == 0 {
        t = default_sysctl;
    }
    if max_sysctl != 0 {
        t = if t == 0 {
            max_sysctl
        } else {
            t.min(max_sysctl)
        };
    }
    (t != 0).then(|| t.max(KERNEL_TIMEOUT_GRANULARITY))
}

/// Reads `/proc/sys/fs/fuse/NAME` (0 if missing: older kernels have no such sysctl).
pub fn sysctl(name: &str) -> u32 {
    std::fs::read_to_string(format!("/proc/sys/fs/fuse/{name}"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Logs, once at start, which timeout the connection got and why.
pub fn log(asked: u16, sent: Option<u16>, offered: bool) {
    let (default, max) = (
        sysctl("default_request_timeout"),
        sysctl("max_request_timeout"),
    );
    let eff = effective(sent, default, max);
    if asked > 0 && !offered {
        tracing::warn!(
            "the kernel does not offer FUSE_REQUEST_TIMEOUT (Linux 6.14+): --request-timeout {asked} \
             has no effect, so an application blocked on a wedged daemon waits until the daemon is killed"
        );
    }
    match eff {
        Some(t) => tracing::info!(
            "request timeout: {t} s (asked {asked}; sysctls default {default}, max {max}; the kernel \
             checks every {KERNEL_TIMEOUT_GRANULARITY} s and aborts the connection on expiry)"
        ),
        None => tracing::info!("request timeout: none (asked {asked})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_rules() {
        // Nothing anywhere: no timeout.
        assert_eq!(effective(Some(0), 0, 0), None);
        assert_eq!(effective(None, 0, 0), None);
        // Ours, floored at 15.
        assert_eq!(effective(Some(600), 0, 0), Some(600));
        assert_eq!(effective(Some(1), 0, 0), Some(15));
        // 0 or no flag: the default sysctl.
        assert_eq!(effective(Some(0), 30, 0), Some(30));
        assert_eq!(effective(None, 5, 0), Some(15));
        // The max sysctl caps ours, and applies when nobody asked.
        assert_eq!(effective(Some(600), 0, 120), Some(120));
        assert_eq!(effective(Some(60), 0, 120), Some(60));
        assert_eq!(effective(Some(0), 0, 120), Some(120));
        assert_eq!(effective(Some(0), 300, 120), Some(120));
        assert_eq!(effective(Some(600), 0, 1), Some(15));
    }
}
