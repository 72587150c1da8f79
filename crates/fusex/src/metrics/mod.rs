//! What an export's statistics look like to the outside: the JSON of fusex's statistics command
//! (`__org.fusex_query-stats`, which `fusex top` reads), qemu-storage-daemon's
//! `query-blockstats` form, and the Prometheus text format (`--metrics-listen`). Every form is
//! made from the same [`ExportMetrics`], read from the queues' counters when asked.

pub mod http;
pub mod prometheus;

use std::time::Duration;

use backend::BackendStats;
use export::Snapshot;
use serde_json::{json, Value};

/// One export's statistics at one moment.
#[derive(Clone, Debug, Default)]
pub struct ExportMetrics {
    /// The export's id (`fusex serve`), or its mountpoint (`fusex mount`).
    pub id: String,
    /// The block node it exports (`fusex serve`; empty for `fusex mount`).
    pub node: String,
    /// Where it is mounted.
    pub mountpoint: String,
    /// How long it has served.
    pub uptime: Duration,
    /// Each queue's counts, by queue id.
    pub queues: Vec<(usize, Snapshot)>,
    /// The backend's own statistics.
    pub backend: BackendStats,
}

impl ExportMetrics {
    /// Every queue's counts merged.
    pub fn total(&self) -> Snapshot {
        let mut t = Snapshot::default();
        for (_, s) in &self.queues {
            t.merge(s);
        }
        t
    }

    /// The statistics command's form: the merged counts (see [`Snapshot::to_json`]), each
    /// queue's, and the backend's.
    pub fn to_json(&self) -> Value {
        let mut v = self.total().to_json();
        v["id"] = self.id.clone().into();
        v["node"] = self.node.clone().into();
        v["mountpoint"] = self.mountpoint.clone().into();
        v["uptime_ns"] = u64::try_from(self.uptime.as_nanos())
            .unwrap_or(u64::MAX)
            .into();
        v["queues"] = self
            .queues
            .iter()
            .map(|(id, s)| {
                let mut q = s.to_json();
                q["queue"] = (*id).into();
                q
            })
            .collect::<Vec<_>>()
            .into();
        if let (Value::Object(m), Value::Object(b)) = (&mut v, self.backend.to_json()) {
            m.extend(b);
        }
        v
    }
}

/// Where one export's statistics are read from: its queues' counters and its backend.
#[derive(Clone)]
pub struct Meter {
    /// The queues' counters.
    pub stats: std::sync::Arc<server::ExportStats>,
    /// The image export, for its backend's statistics (a directory has none). Weak: a meter
    /// kept in a table must not keep the image open once the export has ended.
    pub image: Option<std::sync::Weak<export::Export<crate::lifecycle::Served>>>,
}

impl Meter {
    /// The meter of a prepared export.
    pub fn of(p: &crate::lifecycle::Prepared) -> Meter {
        Meter {
            stats: p.stats.clone(),
            image: p.export.image().map(std::sync::Arc::downgrade),
        }
    }

    /// Reads the statistics now.
    pub fn read(&self, id: &str, node: &str, mountpoint: &str) -> ExportMetrics {
        use backend::BlockBackend;
        ExportMetrics {
            id: id.to_string(),
            node: node.to_string(),
            mountpoint: mountpoint.to_string(),
            uptime: self.stats.since().elapsed(),
            queues: self.stats.queues(),
            backend: self
                .image
                .as_ref()
                .and_then(std::sync::Weak::upgrade)
                .map(|e| e.backend().stats())
                .unwrap_or_default(),
        }
    }
}

/// qemu-storage-daemon's `query-blockstats` entry (`BlockDeviceStats`) for a node: the counts
/// that mean the same in fusex (reads, writes and flushes served, their bytes, failures and
/// total time), zero for what fusex does not count (merges, invalid requests, discards), so a
/// client written for qemu-storage-daemon reads every member it expects.
pub fn blockstats(node: &str, m: Option<&ExportMetrics>) -> Value {
    use fuse_abi::Opcode;
    let t = m.map(ExportMetrics::total).unwrap_or_default();
    let ops = |o: &[Opcode]| -> u64 { o.iter().map(|o| t.ops[*o as usize]).sum() };
    let failed = |o: &[Opcode]| -> u64 {
        t.errors
            .iter()
            .filter(|((op, _), _)| o.iter().any(|x| *x as u32 == *op))
            .map(|(_, n)| n)
            .sum()
    };
    let time = |o: &[Opcode]| -> u64 {
        o.iter()
            .filter_map(|x| t.latency.get(&(*x as u32)))
            .map(|l| l.sum_ns)
            .sum()
    };
    let (rd, wr, fl) = (
        &[Opcode::Read][..],
        &[Opcode::Write][..],
        &[Opcode::Flush, Opcode::Fsync][..],
    );
    json!({
        "node-name": node,
        "stats": {
            "rd_bytes": t.bytes_read,
            "wr_bytes": t.bytes_written,
            "unmap_bytes": 0,
            "rd_operations": ops(rd) - failed(rd),
            "wr_operations": ops(wr) - failed(wr),
            "flush_operations": ops(fl) - failed(fl),
            "unmap_operations": 0,
            "rd_total_time_ns": time(rd),
            "wr_total_time_ns": time(wr),
            "flush_total_time_ns": time(fl),
            "unmap_total_time_ns": 0,
            "wr_highest_offset": 0,
            "rd_merged": 0,
            "wr_merged": 0,
            "unmap_merged": 0,
            "failed_rd_operations": failed(rd),
            "failed_wr_operations": failed(wr),
            "failed_flush_operations": failed(fl),
            "failed_unmap_operations": 0,
            "invalid_rd_operations": 0,
            "invalid_wr_operations": 0,
            "invalid_flush_operations": 0,
            "invalid_unmap_operations": 0,
            "account_invalid": false,
            "account_failed": true,
            "timed_stats": [],
        },
    })
}

/// Where a `fusex mount` process's one export is metered, once it is set up: the metrics server
/// is bound before (a bind error must fail the start before anything is mounted), and shows no
/// export until then.
pub type MountSlot = std::sync::Arc<std::sync::OnceLock<(Meter, String)>>;

/// The page of a `fusex mount` process: its export (its id is its mountpoint), or none yet.
pub fn mount_render(slot: MountSlot) -> http::Render {
    std::sync::Arc::new(move || {
        let exports: Vec<ExportMetrics> = slot
            .get()
            .map(|(m, mnt)| vec![m.read(mnt, "", mnt)])
            .unwrap_or_default();
        prometheus::render(&exports)
    })
}

/// The page of a `fusex serve` process: every export that serves.
pub fn serve_render(service: std::sync::Arc<crate::service::Service>) -> http::Render {
    std::sync::Arc::new(move || prometheus::render(&service.metrics(None)))
}
