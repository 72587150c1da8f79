//! What a backend counts of its own work, beyond the requests it serves: read when an operator
//! asks (a statistics query, a metrics scrape), never per request.

use std::time::Duration;

/// A backend's own statistics; each format fills in its part.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendStats {
    /// An NBD backend's connection.
    pub nbd: Option<NbdStats>,
    /// A qcow2 backend's allocation work.
    pub qcow2: Option<Qcow2Stats>,
}

/// An NBD backend's connection history.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NbdStats {
    /// Connections made again after one was lost.
    pub reconnects: u64,
    /// Time spent without a connection since the export opened, the outage under way included.
    pub disconnected: Duration,
    /// Whether the server can be reached now (no outage under way).
    pub connected: bool,
}

/// A qcow2 backend's allocation work and metadata caches.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Qcow2Stats {
    /// L2 tables and refcount blocks the top image's metadata caches hold now (None when a
    /// cache was busy at that moment).
    pub metadata_tables: Option<u64>,
    /// Host clusters the image file grew by since the export opened: the clusters allocated for
    /// data and for the metadata (L2 and refcount tables) that maps it.
    pub clusters_allocated: u64,
    /// Writes inside a cluster still provided by the backing file that were made whole-cluster
    /// writes (copy-ahead: the cluster's other bytes read first).
    pub copy_ahead: u64,
    /// Bytes those writes read from the backing chain to fill their clusters.
    pub copy_ahead_bytes: u64,
}

impl BackendStats {
    /// JSON form: `{"nbd": {...}}` or `{"qcow2": {...}}`, `{}` for a backend without any.
    pub fn to_json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        if let Some(n) = &self.nbd {
            m.insert(
                "nbd".into(),
                serde_json::json!({
                    "reconnects": n.reconnects,
                    "disconnected_ns": u64::try_from(n.disconnected.as_nanos()).unwrap_or(u64::MAX),
                    "connected": n.connected,
                }),
            );
        }
        if let Some(q) = &self.qcow2 {
            m.insert(
                "qcow2".into(),
                serde_json::json!({
                    "metadata_tables": q.metadata_tables,
                    "clusters_allocated": q.clusters_allocated,
                    "copy_ahead": q.copy_ahead,
                    "copy_ahead_bytes": q.copy_ahead_bytes,
                }),
            );
        }
        m.into()
    }
}
