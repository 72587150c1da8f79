//! One export's statistics as its queues keep them: each queue's [`Counters`] are written by the
//! thread serving it alone, and read here only when someone asks (a statistics query, a metrics
//! scrape, `SIGUSR1`, the export's end). The lock is taken when a queue starts or ends and when
//! the statistics are read, never per request.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use export::{Counters, Snapshot};

/// The statistics of one export, shared by its supervisor (which adds each queue as it starts
/// and its final counts as it ends) and whoever reads them.
pub struct ExportStats {
    queues: Mutex<Vec<QueueStats>>,
    since: Instant,
}

/// One queue: its live counters while it runs, its final snapshot once it ended.
struct QueueStats {
    id: usize,
    live: Option<Arc<Counters>>,
    ended: Snapshot,
}

impl Default for ExportStats {
    fn default() -> Self {
        ExportStats {
            queues: Mutex::new(Vec::new()),
            since: Instant::now(),
        }
    }
}

impl ExportStats {
    /// Queue `id` started, counting into `counters`.
    pub fn started(&self, id: usize, counters: Arc<Counters>) {
        let mut q = self.lock();
        match q.iter_mut().find(|q| q.id == id) {
            Some(q) => q.live = Some(counters),
            None => q.push(QueueStats {
                id,
                live: Some(counters),
                ended: Snapshot::default(),
            }),
        }
    }

    /// Queue `id` ended with these counts: they are kept, the live counters let go.
    pub fn ended(&self, id: usize, last: &Snapshot) {
        let mut q = self.lock();
        let at = match q.iter().position(|q| q.id == id) {
            Some(i) => i,
            None => {
                q.push(QueueStats {
                    id,
                    live: None,
                    ended: Snapshot::default(),
                });
                q.len() - 1
            }
        };
        let s = &mut q[at];
        s.live = None;
        s.ended.merge(last);
        // Nothing is in flight on a queue that ended.
        s.ended.in_flight = 0;
        s.ended.entries = 0;
    }

    /// Each queue's counts so far, by queue id.
    pub fn queues(&self) -> Vec<(usize, Snapshot)> {
        let q = self.lock();
        let mut out: Vec<(usize, Snapshot)> = q
            .iter()
            .map(|q| {
                let mut s = q.ended.clone();
                if let Some(c) = &q.live {
                    s.merge(&c.snapshot());
                }
                (q.id, s)
            })
            .collect();
        out.sort_by_key(|(id, _)| *id);
        out
    }

    /// Every queue's counts merged.
    pub fn total(&self) -> Snapshot {
        let mut t = Snapshot::default();
        for (_, s) in self.queues() {
            t.merge(&s);
        }
        t
    }

    /// When the export's statistics began (it started serving).
    pub fn since(&self) -> Instant {
        self.since
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<QueueStats>> {
        self.queues.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_and_ended_queues_add_up() {
        let st = ExportStats::default();
        let a = Arc::new(Counters::default());
        let b = Arc::new(Counters::default());
        st.started(1, b.clone());
        st.started(0, a.clone());
        a.request(fuse_abi::Opcode::Read as u32);
        a.taken();
        b.request(fuse_abi::Opcode::Write as u32);
        b.request(fuse_abi::Opcode::Write as u32);
        let q = st.queues();
        assert_eq!(q.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(q[0].1.in_flight, 1);
        assert_eq!(st.total().requests(), 3);
        st.ended(0, &a.snapshot());
        // The ended queue's counts stay; its live counters are no longer read.
        a.request(fuse_abi::Opcode::Read as u32);
        let t = st.total();
        assert_eq!(t.requests(), 3);
        assert_eq!(t.in_flight, 0);
    }
}
