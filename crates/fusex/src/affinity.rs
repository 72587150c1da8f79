//! Which CPUs queue threads may run on, and pinning a thread to one.

/// The CPUs this process may run on, in ascending order (at least one): its main thread's set
/// (what `taskset` gave the daemon), asked whichever thread calls, because a queue thread
/// pinned to one CPU would otherwise answer with that one CPU.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity fills it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: getpid has no preconditions; the process id is its main thread's id.
    let main = unsafe { libc::getpid() };
    // SAFETY: passes the size of the set we own.
    let r =
        unsafe { libc::sched_getaffinity(main, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    let cpus: Vec<usize> = if r == 0 {
        // SAFETY: CPU_ISSET reads the set we own, for indices below CPU_SETSIZE.
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
            .collect()
    } else {
        Vec::new()
    };
    if cpus.is_empty() {
        vec![0]
    } else {
        cpus
    }
}

/// Number of possible CPUs (`/sys/devices/system/cpu/possible`): the kernel makes one
/// FUSE-over-io_uring queue per possible CPU, and each must be served. Read once: the set is
/// fixed at boot (hotplug moves CPUs in and out of it, never the set itself), and a daemon
/// adding exports asked twice per export.
pub fn possible_cpus() -> usize {
    static POSSIBLE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *POSSIBLE.get_or_init(|| {
        std::fs::read_to_string("/sys/devices/system/cpu/possible")
            .ok()
            .and_then(|s| parse_cpu_list(s.trim()))
            .unwrap_or_else(|| allowed_cpus().last().map_or(1, |c| c + 1))
    })
}

/// Highest CPU index + 1 in a list such as `0-3,6,8-9`.
fn parse_cpu_list(s: &str) -> Option<usize> {
    let mut max = None;
    for part in s.split(',') {
        let hi = part.rsplit('-').next()?.trim().parse::<usize>().ok()?;
        max = Some(max.map_or(hi, |m: usize| m.max(hi)));
    }
    max.map(|m| m + 1)
}

/// Pins the calling thread to `cpu`; failure is logged and otherwise harmless.
pub fn pin_current_thread(cpu: usize) {
    // SAFETY: cpu_set_t is plain data.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: cpu < CPU_SETSIZE (it came from allowed_cpus).
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: passes the size of the set we own; 0 = the calling thread.
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0 {
        tracing::warn!(
            "cannot pin queue thread to CPU {cpu}: {}",
            std::io::Error::last_os_error()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allowed_cpus_includes_the_current_one() {
        let cpus = allowed_cpus();
        assert!(!cpus.is_empty());
        assert!(cpus.windows(2).all(|w| w[0] < w[1]));
        // SAFETY: sched_getcpu has no preconditions.
        let cur = unsafe { libc::sched_getcpu() };
        assert!(cur < 0 || cpus.contains(&(cur as usize)));
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0-1"), Some(2));
        assert_eq!(parse_cpu_list("0"), Some(1));
        assert_eq!(parse_cpu_list("0-3,6,8-9"), Some(10));
        assert_eq!(parse_cpu_list("x"), None);
        assert!(possible_cpus() >= allowed_cpus().len());
    }

    #[test]
    fn pinning_moves_the_thread() {
        let cpus = allowed_cpus();
        let target = *cpus.last().unwrap();
        std::thread::spawn(move || {
            pin_current_thread(target);
            // SAFETY: no preconditions.
            assert_eq!(unsafe { libc::sched_getcpu() }, target as i32);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_pinned_thread_is_told_the_process_set() {
        let process = allowed_cpus();
        let target = *process.last().unwrap();
        let seen = std::thread::spawn(move || {
            pin_current_thread(target);
            allowed_cpus()
        })
        .join()
        .unwrap();
        assert_eq!(seen, process);
    }
}
