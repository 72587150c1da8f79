//! Latency histograms with log-linear buckets (HDR style): eight buckets per power of two from
//! 1 µs up to 2²⁷ µs (134 s), one below and one above. Any value lands in a bucket at most 12.5 %
//! wide relative to its lower edge, so a percentile read from the buckets is within that of the
//! true one, over eight decades, in a fixed 1.7 KiB. The power-of-two edges are what Prometheus
//! `le` labels show (`1e-06`, `2e-06`, ... seconds), each an exact bucket boundary.

use crate::counters::Counter;

/// Buckets per power of two (2³: a bucket is 1/8 of its octave wide).
const SUB_BITS: u32 = 3;
const SUB: usize = 1 << SUB_BITS;
/// Nanoseconds per unit: the first octave, 1–2 µs, is units 8..16.
const UNIT_NS: u64 = 1000 / SUB as u64;
/// Octaves kept: 1 µs · 2^27 = 134 s, past the 100 s the slowest request may take.
const OCTAVES: usize = 27;

/// Buckets in a histogram: one below 1 µs, eight per octave, one at or above 2²⁷ µs.
pub const BUCKETS: usize = 1 + OCTAVES * SUB + 1;

/// The bucket `ns` nanoseconds fall in.
pub fn bucket_of(ns: u64) -> usize {
    let u = ns / UNIT_NS;
    if u < SUB as u64 {
        return 0;
    }
    let e = (63 - u.leading_zeros() - SUB_BITS) as usize;
    if e >= OCTAVES {
        return BUCKETS - 1;
    }
    let m = (u >> e) as usize & (SUB - 1);
    1 + e * SUB + m
}

/// The lowest value (ns) of bucket `i`.
pub fn bucket_lower_ns(i: usize) -> u64 {
    match i {
        0 => 0,
        i if i >= BUCKETS - 1 => (SUB as u64 * UNIT_NS) << OCTAVES,
        i => {
            let (e, m) = ((i - 1) / SUB, (i - 1) % SUB);
            ((SUB + m) as u64 * UNIT_NS) << e
        }
    }
}

/// The value (ns) bucket `i` ends before; `u64::MAX` for the last, open one.
pub fn bucket_upper_ns(i: usize) -> u64 {
    if i >= BUCKETS - 1 {
        u64::MAX
    } else {
        bucket_lower_ns(i + 1)
    }
}

/// Whether bucket `i` ends on a power of two microseconds: the edges shown as Prometheus `le`
/// buckets (1 µs, 2 µs, 4 µs, ...), where a coarser histogram still has exact counts.
pub fn ends_octave(i: usize) -> bool {
    i < BUCKETS - 1 && i.is_multiple_of(SUB)
}

/// A histogram written by one thread (see `Counter`), readable from any.
pub struct Histogram {
    buckets: [Counter; BUCKETS],
    sum_ns: Counter,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: std::array::from_fn(|_| Counter::default()),
            sum_ns: Counter::default(),
        }
    }
}

impl Histogram {
    /// Records one value, in nanoseconds. Only the owning thread calls this.
    pub(crate) fn record(&self, ns: u64) {
        self.buckets[bucket_of(ns)].add(1);
        self.sum_ns.add(ns);
    }

    /// A copy of the histogram.
    pub fn snapshot(&self) -> Latency {
        Latency {
            buckets: std::array::from_fn(|i| self.buckets[i].get()),
            sum_ns: self.sum_ns.get(),
        }
    }
}

/// A histogram's counts, mergeable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Latency {
    /// Values per bucket (see [`bucket_lower_ns`]).
    pub buckets: [u64; BUCKETS],
    /// Sum of the values, in nanoseconds.
    pub sum_ns: u64,
}

impl Default for Latency {
    fn default() -> Self {
        Latency {
            buckets: [0; BUCKETS],
            sum_ns: 0,
        }
    }
}

impl Latency {
    /// Values recorded.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// Adds another histogram's counts.
    pub fn merge(&mut self, o: &Latency) {
        for (a, b) in self.buckets.iter_mut().zip(o.buckets.iter()) {
            *a += b;
        }
        self.sum_ns += o.sum_ns;
    }

    /// The counts recorded since `earlier` (a snapshot of the same histogram); for rates and
    /// percentiles over an interval.
    pub fn since(&self, earlier: &Latency) -> Latency {
        Latency {
            buckets: std::array::from_fn(|i| self.buckets[i].saturating_sub(earlier.buckets[i])),
            sum_ns: self.sum_ns.saturating_sub(earlier.sum_ns),
        }
    }

    /// The value (ns) below which a fraction `q` (0–1) of the values lie, as the upper edge of
    /// the bucket holding it (the lower edge for the last, open bucket); None when empty.
    pub fn percentile_ns(&self, q: f64) -> Option<u64> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        // The rank of the value asked for, 1-based: at least the first, at most the last.
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for (i, n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Some(match bucket_upper_ns(i) {
                    u64::MAX => bucket_lower_ns(i),
                    up => up,
                });
            }
        }
        None
    }

    /// JSON form: count, sum, p50/p99/p99.9 and the non-empty buckets as `[index, count]`.
    pub fn to_json(&self) -> serde_json::Value {
        let buckets: Vec<serde_json::Value> = self
            .buckets
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .map(|(i, n)| serde_json::json!([i, n]))
            .collect();
        serde_json::json!({
            "count": self.count(),
            "sum_ns": self.sum_ns,
            "p50_ns": self.percentile_ns(0.5),
            "p99_ns": self.percentile_ns(0.99),
            "p999_ns": self.percentile_ns(0.999),
            "buckets": buckets,
        })
    }

    /// Reads [`Latency::to_json`]'s form back (the `buckets` and `sum_ns`); None if malformed.
    pub fn from_json(v: &serde_json::Value) -> Option<Latency> {
        let mut l = Latency {
            sum_ns: v.get("sum_ns")?.as_u64()?,
            ..Latency::default()
        };
        for b in v.get("buckets")?.as_array()? {
            let i = usize::try_from(b.get(0)?.as_u64()?).ok()?;
            *l.buckets.get_mut(i)? = b.get(1)?.as_u64()?;
        }
        Some(l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_value_in_order() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(999), 0);
        assert_eq!(bucket_of(1000), 1);
        assert_eq!(bucket_of(1124), 1);
        assert_eq!(bucket_of(1125), 2);
        assert_eq!(bucket_of(1999), 8);
        assert_eq!(bucket_of(2000), 9);
        assert_eq!(bucket_of(u64::MAX), BUCKETS - 1);
        for i in 0..BUCKETS {
            let lo = bucket_lower_ns(i);
            assert_eq!(bucket_of(lo), i, "lower edge of {i}");
            if i + 1 < BUCKETS {
                assert_eq!(bucket_of(bucket_upper_ns(i) - 1), i, "top of {i}");
                assert!(bucket_upper_ns(i) > lo);
            }
            if i > 0 {
                // Never wider than an eighth of where it starts.
                let up = bucket_upper_ns(i).min(lo + lo / 8);
                assert!(up - lo <= lo / 8);
            }
        }
        // 100 s still has a bucket of its own, below the open one.
        assert!(bucket_of(100_000_000_000) < BUCKETS - 1);
    }

    #[test]
    fn octave_ends_are_powers_of_two_microseconds() {
        let edges: Vec<u64> = (0..BUCKETS)
            .filter(|&i| ends_octave(i))
            .map(bucket_upper_ns)
            .collect();
        assert_eq!(edges.len(), OCTAVES + 1);
        for (k, e) in edges.iter().enumerate() {
            assert_eq!(*e, 1000 << k);
        }
    }

    #[test]
    fn percentiles_come_from_the_buckets() {
        let h = Histogram::default();
        for _ in 0..990 {
            h.record(10_000);
        }
        for _ in 0..10 {
            h.record(5_000_000);
        }
        let l = h.snapshot();
        assert_eq!(l.count(), 1000);
        assert_eq!(l.sum_ns, 990 * 10_000 + 10 * 5_000_000);
        let p50 = l.percentile_ns(0.5).unwrap();
        assert!((10_000..=11_250).contains(&p50), "{p50}");
        let p99 = l.percentile_ns(0.99).unwrap();
        assert!((10_000..=11_250).contains(&p99), "{p99}");
        let p999 = l.percentile_ns(0.999).unwrap();
        assert!((5_000_000..=5_625_000).contains(&p999), "{p999}");
        assert_eq!(Latency::default().percentile_ns(0.5), None);
        let back = Latency::from_json(&l.to_json()).unwrap();
        assert_eq!(back, l);
        let mut twice = l.clone();
        twice.merge(&l);
        assert_eq!(twice.since(&l), l);
    }
}
