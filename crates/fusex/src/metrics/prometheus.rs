//! The Prometheus text exposition format (version 0.0.4) of every export's statistics, which
//! `--metrics-listen` serves: one family per kind of count, its `HELP` and `TYPE` once, and all
//! its samples under it (Prometheus refuses a family split in two). Counters stay per queue,
//! so a skewed queue shows; histograms are merged over the queues, since a per-queue latency
//! would multiply the series by the queue count for little insight. docs/metrics.md lists the
//! families.

use std::fmt::Write as _;

use export::latency::{bucket_upper_ns, ends_octave};
use export::{errno_name, op_name, Latency, Snapshot};

use super::ExportMetrics;

/// The kind of a family, its `TYPE` line.
#[derive(Clone, Copy)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// The text being made.
struct Out(String);

impl Out {
    /// Starts a family: its `HELP` and `TYPE` lines.
    fn family(&mut self, name: &str, kind: Kind, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}");
        let _ = writeln!(self.0, "# TYPE {name} {}", kind.name());
    }

    /// One sample of the family just started.
    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        self.0.push_str(name);
        if !labels.is_empty() {
            self.0.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.0.push(',');
                }
                let _ = write!(self.0, "{k}=\"{}\"", escape(v));
            }
            self.0.push('}');
        }
        let _ = writeln!(self.0, " {value}");
    }

    /// The samples of a histogram (`_bucket` per power-of-two microseconds and `+Inf`, `_sum`
    /// in seconds, `_count`).
    fn histogram(&mut self, name: &str, labels: &[(&str, &str)], l: &Latency) {
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0;
        for (i, n) in l.buckets.iter().enumerate() {
            cumulative += n;
            if ends_octave(i) {
                let le = seconds(bucket_upper_ns(i)).to_string();
                let mut with = labels.to_vec();
                with.push(("le", &le));
                self.sample(&bucket, &with, cumulative);
            }
        }
        let mut with = labels.to_vec();
        with.push(("le", "+Inf"));
        self.sample(&bucket, &with, l.count());
        self.sample(&format!("{name}_sum"), labels, seconds(l.sum_ns));
        self.sample(&format!("{name}_count"), labels, l.count());
    }
}

fn seconds(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// A label value as the format quotes it: backslash, double quote and line feed escaped.
fn escape(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

/// A per-queue family: name, kind, help, and its value in a queue's counts.
type PerQueue = (&'static str, Kind, &'static str, fn(&Snapshot) -> u64);
/// A qcow2 family: name, help, and its value in the backend's statistics.
type Qcow2Family = (&'static str, &'static str, fn(&backend::Qcow2Stats) -> u64);

/// A per-queue counter or gauge family: one sample per export and queue.
fn per_queue(
    out: &mut Out,
    exports: &[ExportMetrics],
    (name, kind, help): (&str, Kind, &str),
    value: impl Fn(&Snapshot) -> u64,
) {
    out.family(name, kind, help);
    for e in exports {
        for (q, s) in &e.queues {
            let q = q.to_string();
            out.sample(name, &[("export", &e.id), ("queue", &q)], value(s));
        }
    }
}

/// A latency family: per export and opcode, merged over the queues.
fn latency(
    out: &mut Out,
    exports: &[ExportMetrics],
    (name, help): (&str, &str),
    set: impl Fn(&Snapshot) -> &std::collections::BTreeMap<u32, Latency>,
) {
    out.family(name, Kind::Histogram, help);
    for e in exports {
        let total = e.total();
        for (op, l) in set(&total).iter().filter(|(_, l)| l.count() > 0) {
            out.histogram(name, &[("export", &e.id), ("op", &op_name(*op))], l);
        }
    }
}

/// Every export's statistics in the text exposition format 0.0.4.
pub fn render(exports: &[ExportMetrics]) -> String {
    let mut out = Out(String::with_capacity(4096 + exports.len() * 8192));
    out.family(
        "fusex_build_info",
        Kind::Gauge,
        "Always 1; the version label says which fusex serves.",
    );
    out.sample(
        "fusex_build_info",
        &[("version", env!("CARGO_PKG_VERSION"))],
        1,
    );
    out.family("fusex_exports", Kind::Gauge, "Exports this process serves.");
    out.sample("fusex_exports", &[], exports.len());

    let name = "fusex_requests_total";
    out.family(name, Kind::Counter, "FUSE requests received, by opcode.");
    for e in exports {
        for (q, s) in &e.queues {
            let q = q.to_string();
            for (op, n) in s.ops.iter().enumerate().filter(|(_, n)| **n > 0) {
                let op = op_name(op as u32);
                out.sample(name, &[("export", &e.id), ("queue", &q), ("op", &op)], n);
            }
        }
    }
    let name = "fusex_errors_total";
    out.family(
        name,
        Kind::Counter,
        "FUSE requests answered with an error, by opcode and errno.",
    );
    for e in exports {
        for (q, s) in &e.queues {
            let q = q.to_string();
            for ((op, errno), n) in &s.errors {
                let (op, errno) = (op_name(*op), errno_name(*errno));
                let labels = [
                    ("export", e.id.as_str()),
                    ("queue", &q),
                    ("op", &op),
                    ("errno", &errno),
                ];
                out.sample(name, &labels, n);
            }
        }
    }
    let families: [PerQueue; 6] = [
        (
            "fusex_malformed_requests_total",
            Kind::Counter,
            "FUSE requests that could not be decoded.",
            |s| s.malformed,
        ),
        (
            "fusex_handoffs_total",
            Kind::Counter,
            "io_uring requests handed with their entry to another queue thread.",
            |s| s.handed_off,
        ),
        (
            "fusex_read_bytes_total",
            Kind::Counter,
            "Bytes read from the backend.",
            |s| s.bytes_read,
        ),
        (
            "fusex_written_bytes_total",
            Kind::Counter,
            "Bytes written to the backend.",
            |s| s.bytes_written,
        ),
        (
            "fusex_requests_in_flight",
            Kind::Gauge,
            "FUSE requests taken and not yet answered.",
            |s| s.in_flight,
        ),
        (
            "fusex_queue_entries",
            Kind::Gauge,
            "io_uring entries the queue has registered with the kernel (0 on the legacy \
             transport).",
            |s| s.entries,
        ),
    ];
    for (name, kind, help, value) in families {
        per_queue(&mut out, exports, (name, kind, help), value);
    }
    let name = "fusex_backend_operations_total";
    out.family(
        name,
        Kind::Counter,
        "Operations issued to the backend, by kind (read, write, flush).",
    );
    for e in exports {
        for (q, s) in &e.queues {
            let q = q.to_string();
            for (kind, n) in [
                ("read", s.backend_reads),
                ("write", s.backend_writes),
                ("flush", s.backend_flushes),
            ] {
                out.sample(name, &[("export", &e.id), ("queue", &q), ("kind", kind)], n);
            }
        }
    }
    latency(
        &mut out,
        exports,
        (
            "fusex_request_duration_seconds",
            "Time from a FUSE request's arrival to its reply, by opcode.",
        ),
        |s| &s.latency,
    );
    latency(
        &mut out,
        exports,
        (
            "fusex_backend_duration_seconds",
            "Time the backend took for a request's read, write or flush, by opcode.",
        ),
        |s| &s.backend_latency,
    );

    let nbd: Vec<_> = exports
        .iter()
        .filter_map(|e| Some((e.id.as_str(), e.backend.nbd.as_ref()?)))
        .collect();
    if !nbd.is_empty() {
        let name = "fusex_nbd_reconnects_total";
        out.family(
            name,
            Kind::Counter,
            "NBD connections made again after one was lost.",
        );
        for (id, n) in &nbd {
            out.sample(name, &[("export", id)], n.reconnects);
        }
        let name = "fusex_nbd_disconnected_seconds_total";
        out.family(
            name,
            Kind::Counter,
            "Time without a connection to the NBD server, an outage under way included.",
        );
        for (id, n) in &nbd {
            out.sample(name, &[("export", id)], n.disconnected.as_secs_f64());
        }
        let name = "fusex_nbd_connected";
        out.family(
            name,
            Kind::Gauge,
            "1 while the NBD server can be reached, 0 during an outage.",
        );
        for (id, n) in &nbd {
            out.sample(name, &[("export", id)], u8::from(n.connected));
        }
    }

    let qcow2: Vec<_> = exports
        .iter()
        .filter_map(|e| Some((e.id.as_str(), e.backend.qcow2.as_ref()?)))
        .collect();
    if !qcow2.is_empty() {
        let families: [Qcow2Family; 3] = [
            (
                "fusex_qcow2_clusters_allocated_total",
                "Host clusters the qcow2 image grew by (data and metadata).",
                |q| q.clusters_allocated,
            ),
            (
                "fusex_qcow2_copy_ahead_total",
                "Writes into a cluster of the backing file made whole-cluster writes.",
                |q| q.copy_ahead,
            ),
            (
                "fusex_qcow2_copy_ahead_bytes_total",
                "Bytes those copy-ahead writes read from the backing chain.",
                |q| q.copy_ahead_bytes,
            ),
        ];
        for (name, help, value) in families {
            out.family(name, Kind::Counter, help);
            for (id, q) in &qcow2 {
                out.sample(name, &[("export", id)], value(q));
            }
        }
        let name = "fusex_qcow2_metadata_tables";
        out.family(
            name,
            Kind::Gauge,
            "L2 tables and refcount blocks the qcow2 image's metadata caches hold.",
        );
        for (id, q) in &qcow2 {
            if let Some(n) = q.metadata_tables {
                out.sample(name, &[("export", id)], n);
            }
        }
    }
    out.0
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::process::{Command, Stdio};
    use std::time::Duration;

    use backend::{BackendStats, NbdStats, Qcow2Stats};
    use export::latency::bucket_of;
    use fuse_abi::Opcode;

    use super::*;

    fn latency(values_us: &[u64]) -> Latency {
        let mut l = Latency::default();
        for us in values_us {
            l.buckets[bucket_of(us * 1000)] += 1;
            l.sum_ns += us * 1000;
        }
        l
    }

    fn queue(reads: u64) -> Snapshot {
        let mut s = Snapshot::default();
        s.ops[Opcode::Read as usize] = reads;
        s.ops[Opcode::Write as usize] = 3;
        s.errors.insert((Opcode::Read as u32, libc::EIO), 2);
        s.errors.insert((Opcode::Write as u32, 0), 1);
        s.bytes_read = reads * 4096;
        s.backend_reads = reads;
        s.in_flight = 1;
        s.entries = 16;
        s.latency
            .insert(Opcode::Read as u32, latency(&[1, 3, 3, 900, 5_000_000]));
        s.backend_latency
            .insert(Opcode::Read as u32, latency(&[2, 700]));
        s
    }

    /// Two exports, one over NBD and one qcow2 (with an id that needs every escape).
    fn sample() -> Vec<ExportMetrics> {
        vec![
            ExportMetrics {
                id: "vm1".into(),
                queues: vec![(0, queue(10)), (1, queue(5))],
                backend: BackendStats {
                    nbd: Some(NbdStats {
                        reconnects: 2,
                        disconnected: Duration::from_millis(1500),
                        connected: true,
                    }),
                    qcow2: None,
                },
                ..ExportMetrics::default()
            },
            ExportMetrics {
                id: "odd \"id\" \\ with\nline".into(),
                queues: vec![(0, queue(1))],
                backend: BackendStats {
                    nbd: None,
                    qcow2: Some(Qcow2Stats {
                        metadata_tables: Some(3),
                        clusters_allocated: 7,
                        copy_ahead: 1,
                        copy_ahead_bytes: 65536,
                    }),
                },
                ..ExportMetrics::default()
            },
        ]
    }

    #[test]
    fn families_samples_and_escapes() {
        let text = render(&sample());
        for line in [
            "# TYPE fusex_requests_total counter",
            "fusex_requests_total{export=\"vm1\",queue=\"1\",op=\"READ\"} 5",
            "fusex_errors_total{export=\"vm1\",queue=\"0\",op=\"READ\",errno=\"EIO\"} 2",
            "fusex_exports 2",
            "fusex_read_bytes_total{export=\"vm1\",queue=\"0\"} 40960",
            "fusex_backend_operations_total{export=\"vm1\",queue=\"0\",kind=\"read\"} 10",
            "fusex_queue_entries{export=\"vm1\",queue=\"1\"} 16",
            "fusex_request_duration_seconds_bucket{export=\"vm1\",op=\"READ\",le=\"0.000001\"} 0",
            "fusex_request_duration_seconds_bucket{export=\"vm1\",op=\"READ\",le=\"0.000002\"} 2",
            "fusex_request_duration_seconds_bucket{export=\"vm1\",op=\"READ\",le=\"0.000004\"} 6",
            "fusex_request_duration_seconds_bucket{export=\"vm1\",op=\"READ\",le=\"0.001024\"} 8",
            "fusex_request_duration_seconds_bucket{export=\"vm1\",op=\"READ\",le=\"134.217728\"} 10",
            "fusex_request_duration_seconds_bucket{export=\"vm1\",op=\"READ\",le=\"+Inf\"} 10",
            "fusex_request_duration_seconds_count{export=\"vm1\",op=\"READ\"} 10",
            "fusex_request_duration_seconds_sum{export=\"vm1\",op=\"READ\"} 10.001814",
            "fusex_nbd_disconnected_seconds_total{export=\"vm1\"} 1.5",
            "fusex_nbd_connected{export=\"vm1\"} 1",
            "fusex_qcow2_clusters_allocated_total{export=\"odd \\\"id\\\" \\\\ with\\nline\"} 7",
            "# TYPE fusex_qcow2_metadata_tables gauge",
            "fusex_qcow2_metadata_tables{export=\"odd \\\"id\\\" \\\\ with\\nline\"} 3",
        ] {
            assert!(text.lines().any(|l| l == line), "no line {line} in:\n{text}");
        }
        // Each family's HELP and TYPE once, all its samples together after them.
        let mut seen = std::collections::BTreeSet::new();
        let mut current = String::new();
        for l in text.lines() {
            if let Some(rest) = l.strip_prefix("# TYPE ") {
                current = rest.split(' ').next().unwrap().to_string();
                assert!(seen.insert(current.clone()), "{current} twice");
            } else if !l.starts_with('#') {
                assert!(l.starts_with(&current), "{l} outside its family {current}");
            }
        }
        // Export-level families are only there for backends that have them.
        let plain = render(&[ExportMetrics {
            id: "raw".into(),
            queues: vec![(0, Snapshot::default())],
            ..ExportMetrics::default()
        }]);
        assert!(!plain.contains("fusex_nbd_") && !plain.contains("fusex_qcow2_"));
        assert!(plain.contains("fusex_build_info{version=\""));
    }

    /// promtool (Debian's `prometheus` package) accepts the text and finds nothing to lint.
    /// Without it the test is skipped, except under CI=true, where it fails.
    #[test]
    fn promtool_accepts_the_text() {
        let text = render(&sample());
        let child = Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match child {
            Ok(c) => c,
            Err(e) => {
                assert!(
                    std::env::var("CI").as_deref() != Ok("true"),
                    "promtool missing under CI=true ({e}): run scripts/deps.sh"
                );
                eprintln!("SKIP: promtool missing ({e}): run scripts/deps.sh");
                return;
            }
        };
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "promtool: {said}\n{text}");
        assert!(said.trim().is_empty(), "promtool lint: {said}\n{text}");
    }
}
