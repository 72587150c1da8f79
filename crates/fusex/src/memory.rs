//! How much request-buffer memory an export pins, decided once at start.
//!
//! Every buffer must hold the largest request (the kernel refuses a `/dev/fuse` read shorter than
//! `max_write` + headers, and an io_uring entry whose payload is shorter than `max_write`), and
//! registered buffers are pinned in full. So memory is `buffers × (max_write + 8 KiB)`, and what
//! there is to choose is how many buffers and how large `max_write` is:
//!
//! ```text
//! budget  = 32 MiB + 1 MiB × possible CPUs
//! size(w) = w + 8 KiB                         (a page of headers, the payload, a page of slack)
//! units   = kernel queues (io_uring: one per possible CPU) or queue threads (legacy)
//! fixed   = 2 on io_uring (queue 0's /dev/fuse reader for early requests), else 0
//! target  = DEPTH_TARGET (32); MAX_DEPTH (64) for a backend whose requests wait on a server (NBD)
//! w       = the largest of 1 MiB, 512, 256, 128 KiB that gives every unit `target` buffers
//!           within budget; failing that, the largest that gives every unit MIN_DEPTH (4);
//!           with --queue-depth, the largest that gives every unit that depth
//! depth   = --queue-depth if given, else clamp((budget / size(w) - fixed) / units, MIN_DEPTH, 64)
//! pinned  = (units × depth + fixed) × size(w)
//! ```
//!
//! Depth before request size: 32 requests in flight per queue with 512 KiB requests measured 1.09×
//! the throughput of 16 with 1 MiB on 4k random I/O from 4 jobs (legacy), while a 1 MiB request
//! split in two costs one more round trip per MiB.
//!
//! An NBD export is latency-bound rather than bandwidth-bound: with 1 ms per request at the server,
//! one fio job at QD64 is served at most `depth` requests per millisecond (FUSE-over-io_uring hands
//! a CPU's requests to that CPU's queue only), so depth comes before request size there: 32 in
//! flight capped 4k QD64 at ~27k IOPS against nbdkit with a 1 ms delay filter.
//!
//! Here (2 CPUs): budget 34 MiB, 512 KiB requests, depth 32 on io_uring (33 legacy), ~33 MiB;
//! for NBD 256 KiB requests, depth 64, ~33 MiB. With
//! 256 possible CPUs: budget 288 MiB, 256 KiB requests, depth 4, ~265 MiB (the kernel needs one
//! entry per possible CPU's queue, each as large as `max_write`, whether that CPU is online or not).

/// Fewest requests in flight per queue the plan accepts before it shrinks `max_write` further.
pub const MIN_DEPTH: usize = 4;
/// Requests in flight per queue the plan shrinks `max_write` for, when the budget allows.
pub const DEPTH_TARGET: usize = 32;
/// Most requests in flight per queue by default (what `--queue-depth` used to default to).
pub const MAX_DEPTH: usize = 64;
/// The largest request fusex negotiates: 1 MiB, the kernel's default `max_pages_limit`.
pub const MAX_WRITE: usize = 1 << 20;
/// The smallest `max_write` the plan shrinks to.
pub const MIN_WRITE: usize = 128 << 10;
/// Buffers of queue 0's `/dev/fuse` reader on the io_uring transport.
pub const URING_LEGACY_SLOTS: usize = 2;

const MIB: usize = 1 << 20;

/// What the plan depends on.
#[derive(Clone, Copy, Debug)]
pub struct Demand {
    /// FUSE-over-io_uring may be negotiated (plan for its per-CPU queues).
    pub uring: bool,
    /// Queue threads.
    pub threads: usize,
    /// Possible CPUs (the kernel's io_uring queue count).
    pub possible_cpus: usize,
    /// `--queue-depth`, if given.
    pub depth: Option<usize>,
    /// The backend's requests wait on a server (NBD): plan for MAX_DEPTH in flight before
    /// request size.
    pub latency_bound: bool,
    /// `--memory-budget`, if given: replaces [`budget`].
    pub budget: Option<usize>,
}

/// The decision: request size, requests in flight per queue, and what it costs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// `max_write` (and `max_read`) to negotiate.
    pub max_write: usize,
    /// Requests in flight per queue (io_uring: entries per kernel queue).
    pub depth: usize,
    /// Bytes of one buffer.
    pub buffer_size: usize,
    /// Buffers across all queues.
    pub buffers: usize,
    /// The budget it was planned against.
    pub budget: usize,
}

/// The default memory budget for a machine with `possible_cpus`.
pub fn budget(possible_cpus: usize) -> usize {
    32 * MIB + possible_cpus * MIB
}

/// Bytes of one buffer for requests of up to `max_write` bytes.
pub fn buffer_size(max_write: usize) -> usize {
    max_write + 8192
}

/// Plans the buffers for `d` (see the module docs for the formula).
pub fn plan(d: Demand) -> Plan {
    let budget = d.budget.unwrap_or_else(|| budget(d.possible_cpus));
    let (units, fixed) = if d.uring {
        (d.possible_cpus.max(d.threads).max(1), URING_LEGACY_SLOTS)
    } else {
        (d.threads.max(1), 0)
    };
    let fits = |w: usize, depth: usize| (units * depth + fixed) * buffer_size(w) <= budget;
    let largest = |depth: usize| {
        let mut w = MAX_WRITE;
        while w > MIN_WRITE && !fits(w, depth) {
            w /= 2;
        }
        fits(w, depth).then_some(w)
    };
    let w = match d.depth {
        Some(depth) => largest(depth).unwrap_or(MIN_WRITE),
        None => largest(if d.latency_bound {
            MAX_DEPTH
        } else {
            DEPTH_TARGET
        })
        .or_else(|| largest(MIN_DEPTH))
        .unwrap_or(MIN_WRITE),
    };
    let depth = d.depth.unwrap_or_else(|| {
        let n = budget / buffer_size(w);
        (n.saturating_sub(fixed) / units).clamp(MIN_DEPTH, MAX_DEPTH)
    });
    Plan {
        max_write: w,
        depth,
        buffer_size: buffer_size(w),
        buffers: units * depth + fixed,
        budget,
    }
}

/// How far over its budget a plan may go before it is refused: the default plans stay within it
/// (or, on machines with hundreds of CPUs, at most at the smallest requests and depth), so only an
/// explicit `--queues`/`--queue-depth` gets this far, and there it is a mistake, not a tuning.
pub const OVER_BUDGET: usize = 4;

/// Refuses a plan more than [`OVER_BUDGET`] times its budget, saying by how much and what to pass
/// instead: the deepest `--queue-depth` that fits the budget with these queues, or a
/// `--memory-budget` that covers the plan. `units` and `fixed` as in [`plan`].
pub fn check(p: &Plan, d: &Demand) -> Result<(), String> {
    let bytes = p.buffers * p.buffer_size;
    if bytes <= OVER_BUDGET * p.budget {
        return Ok(());
    }
    let (units, fixed) = if d.uring {
        (d.possible_cpus.max(d.threads).max(1), URING_LEGACY_SLOTS)
    } else {
        (d.threads.max(1), 0)
    };
    let small = buffer_size(MIN_WRITE);
    let fits = (p.budget / small).saturating_sub(fixed) / units;
    let instead = if fits >= 1 {
        format!("--queue-depth {} or less", fits.min(usize::from(u16::MAX)))
    } else {
        "fewer --queues".to_string()
    };
    Err(format!(
        "{} queue{} x {} requests in flight x {} KiB buffers need {} MiB of request buffers, {}x \
         the memory budget of {} MiB: pass {instead}, or raise the budget with --memory-budget \
         {}M",
        units,
        if units == 1 { "" } else { "s" },
        p.depth,
        p.buffer_size >> 10,
        bytes.div_ceil(MIB),
        bytes.div_ceil(p.budget),
        p.budget / MIB,
        bytes.div_ceil(MIB),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Plan {
        /// Bytes allocated (and pinned, when registered) across all queues.
        fn bytes(&self) -> usize {
            self.buffers * self.buffer_size
        }
    }

    fn defaults(uring: bool, cpus: usize) -> Plan {
        plan(Demand {
            uring,
            threads: cpus,
            possible_cpus: cpus,
            depth: None,
            latency_bound: false,
            budget: None,
        })
    }

    #[test]
    fn nbd_gets_64_requests_per_queue_within_the_same_budget() {
        for uring in [true, false] {
            let p = plan(Demand {
                uring,
                threads: 2,
                possible_cpus: 2,
                depth: None,
                latency_bound: true,
                budget: None,
            });
            assert_eq!((p.depth, p.max_write), (MAX_DEPTH, 256 << 10), "{p:?}");
            assert!(p.bytes() <= p.budget, "{p:?}");
        }
        // Where 64 cannot fit even at the smallest requests, the usual fallback applies.
        let p = plan(Demand {
            uring: true,
            threads: 256,
            possible_cpus: 256,
            depth: None,
            latency_bound: true,
            budget: None,
        });
        assert!(p.bytes() <= 512 * MIB && p.depth >= MIN_DEPTH, "{p:?}");
    }

    #[test]
    fn this_machine_stays_under_48_mib_with_32_requests_per_queue() {
        for uring in [true, false] {
            let p = defaults(uring, 2);
            assert_eq!(p.max_write, 512 << 10);
            assert!(p.depth >= DEPTH_TARGET, "{p:?}");
            assert!(p.bytes() <= 40 * MIB, "{p:?}: {} MiB", p.bytes() / MIB);
        }
    }

    #[test]
    fn a_256_cpu_machine_stays_under_512_mib() {
        for uring in [true, false] {
            let p = defaults(uring, 256);
            assert!(p.bytes() <= 512 * MIB, "{p:?}: {} MiB", p.bytes() / MIB);
            assert!(p.depth >= MIN_DEPTH);
            assert!(p.max_write >= MIN_WRITE);
        }
        let p = defaults(true, 256);
        assert_eq!(
            p.max_write,
            256 << 10,
            "shrunk requests rather than starved queues"
        );
    }

    #[test]
    fn every_machine_size_keeps_the_formula() {
        for cpus in 1..=1024 {
            for uring in [true, false] {
                let p = defaults(uring, cpus);
                let units = cpus;
                let fixed = if uring { URING_LEGACY_SLOTS } else { 0 };
                assert_eq!(p.buffers, units * p.depth + fixed);
                assert!((MIN_DEPTH..=MAX_DEPTH).contains(&p.depth));
                // Within budget unless already at the smallest requests and fewest entries.
                assert!(
                    p.bytes() <= p.budget || (p.max_write == MIN_WRITE && p.depth == MIN_DEPTH),
                    "{cpus} cpus: {p:?}"
                );
            }
        }
    }

    #[test]
    fn an_explicit_depth_is_honoured() {
        let p = plan(Demand {
            uring: false,
            threads: 2,
            possible_cpus: 2,
            depth: Some(64),
            latency_bound: false,
            budget: None,
        });
        assert_eq!((p.depth, p.buffers), (64, 128));
        assert_eq!(
            p.max_write,
            256 << 10,
            "the largest requests that fit the budget"
        );
        let p = plan(Demand {
            uring: false,
            threads: 1,
            possible_cpus: 2,
            depth: Some(8),
            latency_bound: false,
            budget: None,
        });
        assert_eq!((p.depth, p.max_write), (8, MAX_WRITE));
    }

    #[test]
    fn a_plan_far_over_the_budget_is_refused_with_what_to_pass() {
        // The report: --transport legacy --queues 256 --queue-depth 1024 on this machine.
        let d = Demand {
            uring: false,
            threads: 256,
            possible_cpus: 2,
            depth: Some(1024),
            latency_bound: false,
            budget: None,
        };
        let p = plan(d);
        assert_eq!(p.buffers * p.buffer_size, 34816 * MIB, "{p:?}");
        let e = check(&p, &d).unwrap_err();
        assert!(e.contains("34816 MiB"), "{e}");
        assert!(e.contains("1024x the memory budget of 34 MiB"), "{e}");
        assert!(e.contains("--queue-depth 1 or less"), "{e}");
        assert!(e.contains("--memory-budget 34816M"), "{e}");
        // What it says to pass is accepted.
        let raised = Demand {
            budget: Some(34816 * MIB),
            ..d
        };
        assert!(check(&plan(raised), &raised).is_ok());
        let shallow = Demand {
            depth: Some(1),
            ..d
        };
        assert!(
            check(&plan(shallow), &shallow).is_ok(),
            "{:?}",
            plan(shallow)
        );
        // Up to 4x the budget is a tuning, and is let through.
        let d = Demand {
            uring: false,
            threads: 2,
            possible_cpus: 2,
            depth: Some(400),
            latency_bound: false,
            budget: None,
        };
        let p = plan(d);
        assert!(p.buffers * p.buffer_size > p.budget, "{p:?}");
        assert!(check(&p, &d).is_ok(), "{p:?}");
    }

    #[test]
    fn default_plans_are_never_refused() {
        for cpus in 1..=1024 {
            for uring in [true, false] {
                for latency_bound in [true, false] {
                    let d = Demand {
                        uring,
                        threads: cpus,
                        possible_cpus: cpus,
                        depth: None,
                        latency_bound,
                        budget: None,
                    };
                    assert!(check(&plan(d), &d).is_ok(), "{d:?}");
                }
            }
        }
    }
}
