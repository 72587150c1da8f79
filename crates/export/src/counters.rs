//! Per-queue counters: written by one queue thread only, readable from any thread (a live
//! `SIGUSR1` dump), merged into a [`Snapshot`] when the queue ends.

use std::sync::atomic::{AtomicU64, Ordering};

use fuse_abi::{Opcode, MAX_OPCODE};

/// One counter with a single writer. The writer bumps it with a relaxed load and store (plain
/// `mov`/`add` on x86, no locked instruction), so counting costs what a `Cell` did, and other
/// threads may still read a recent value.
#[derive(Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// The current value (possibly a little behind the writer, when read from another thread).
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
    /// Adds `by`. Only the owning queue thread calls this: two writers would lose counts.
    fn add(&self, by: u64) {
        self.0.store(self.get().wrapping_add(by), Ordering::Relaxed);
    }
}

impl std::fmt::Debug for Counter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.get().fmt(f)
    }
}

/// Counters of one queue: written by that queue's thread alone.
pub struct Counters {
    ops: [Counter; MAX_OPCODE],
    /// Requests that failed to decode.
    pub malformed: Counter,
    /// Backend reads issued.
    pub backend_reads: Counter,
    /// Backend writes issued.
    pub backend_writes: Counter,
    /// Backend flushes issued.
    pub backend_flushes: Counter,
    /// Bytes read from the backend.
    pub bytes_read: Counter,
    /// Bytes written to the backend.
    pub bytes_written: Counter,
    /// Data bytes copied in userspace (a WRITE whose data the transport could not place where the
    /// backend reads it). Stays 0 on the zero-copy data path.
    pub bytes_copied: Counter,
    /// READ bytes the kernel spliced from the image into the reply (never in fusex's memory).
    pub bytes_spliced: Counter,
    /// io_uring requests this queue handed, with their entry, to another queue thread.
    pub handed_off: Counter,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            ops: std::array::from_fn(|_| Counter::default()),
            malformed: Counter::default(),
            backend_reads: Counter::default(),
            backend_writes: Counter::default(),
            backend_flushes: Counter::default(),
            bytes_read: Counter::default(),
            bytes_written: Counter::default(),
            bytes_copied: Counter::default(),
            bytes_spliced: Counter::default(),
            handed_off: Counter::default(),
        }
    }
}

fn bump(c: &Counter, by: u64) {
    c.add(by);
}

impl Counters {
    /// Counts a request with this opcode number.
    pub fn request(&self, opcode: u32) {
        if let Some(c) = self.ops.get(opcode as usize) {
            bump(c, 1);
        }
    }
    /// Counts an undecodable request.
    pub fn malformed(&self) {
        bump(&self.malformed, 1);
    }
    pub(crate) fn read(&self, bytes: usize) {
        bump(&self.backend_reads, 1);
        bump(&self.bytes_read, bytes as u64);
    }
    pub(crate) fn write(&self, bytes: usize) {
        bump(&self.backend_writes, 1);
        bump(&self.bytes_written, bytes as u64);
    }
    /// Counts a READ answered by splicing `bytes` from the image: a backend read that never
    /// passed through fusex's memory.
    pub fn spliced(&self, bytes: usize) {
        self.read(bytes);
        bump(&self.bytes_spliced, bytes as u64);
    }
    /// Counts data bytes copied in userspace.
    pub fn copied(&self, bytes: usize) {
        bump(&self.bytes_copied, bytes as u64);
    }
    /// Counts a request handed to another queue thread with its entry.
    pub fn handed_off(&self) {
        bump(&self.handed_off, 1);
    }
    pub(crate) fn flush(&self) {
        bump(&self.backend_flushes, 1);
    }

    /// A copy of the counters (from the owning thread exact; from another thread each value is
    /// one the writer stored recently).
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            ops: std::array::from_fn(|i| self.ops[i].get()),
            malformed: self.malformed.get(),
            backend_reads: self.backend_reads.get(),
            backend_writes: self.backend_writes.get(),
            backend_flushes: self.backend_flushes.get(),
            bytes_read: self.bytes_read.get(),
            bytes_written: self.bytes_written.get(),
            bytes_copied: self.bytes_copied.get(),
            bytes_spliced: self.bytes_spliced.get(),
            handed_off: self.handed_off.get(),
        }
    }
}

/// Counters of one or more queues, mergeable and printable.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// Requests per opcode number.
    pub ops: [u64; MAX_OPCODE],
    /// Undecodable requests.
    pub malformed: u64,
    /// Backend reads.
    pub backend_reads: u64,
    /// Backend writes.
    pub backend_writes: u64,
    /// Backend flushes.
    pub backend_flushes: u64,
    /// Bytes read from the backend.
    pub bytes_read: u64,
    /// Bytes written to the backend.
    pub bytes_written: u64,
    /// Data bytes copied in userspace.
    pub bytes_copied: u64,
    /// READ bytes spliced from the image.
    pub bytes_spliced: u64,
    /// Requests handed to another queue thread.
    pub handed_off: u64,
}

impl Default for Snapshot {
    fn default() -> Self {
        Counters::default().snapshot()
    }
}

impl Snapshot {
    /// Total requests.
    pub fn requests(&self) -> u64 {
        self.ops.iter().sum::<u64>() + self.malformed
    }

    /// Adds another snapshot into this one.
    pub fn merge(&mut self, o: &Snapshot) {
        for (a, b) in self.ops.iter_mut().zip(o.ops.iter()) {
            *a += b;
        }
        self.malformed += o.malformed;
        self.backend_reads += o.backend_reads;
        self.backend_writes += o.backend_writes;
        self.backend_flushes += o.backend_flushes;
        self.bytes_read += o.bytes_read;
        self.bytes_written += o.bytes_written;
        self.bytes_copied += o.bytes_copied;
        self.bytes_spliced += o.bytes_spliced;
        self.handed_off += o.handed_off;
    }

    /// JSON form: `{"requests": n, "ops": {"READ": n, ...}, "backend": {...}}` (zero ops omitted).
    pub fn to_json(&self) -> serde_json::Value {
        let mut ops = serde_json::Map::new();
        for op in Opcode::ALL {
            let n = self.ops.get(*op as usize).copied().unwrap_or(0);
            if n > 0 {
                ops.insert(op.name().to_string(), n.into());
            }
        }
        serde_json::json!({
            "requests": self.requests(),
            "malformed": self.malformed,
            "ops": ops,
            "backend": {
                "reads": self.backend_reads,
                "writes": self.backend_writes,
                "flushes": self.backend_flushes,
                "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written,
            },
            "copied_bytes": self.bytes_copied,
            "spliced_bytes": self.bytes_spliced,
            "handed_off": self.handed_off,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_merges() {
        let c = Counters::default();
        c.request(Opcode::Read as u32);
        c.request(Opcode::Read as u32);
        c.request(Opcode::CuseInit as u32); // out of range: ignored, never panics
        c.read(4096);
        c.spliced(4096);
        c.flush();
        let mut s = c.snapshot();
        assert_eq!(s.requests(), 2);
        s.merge(&c.snapshot());
        assert_eq!(s.ops[Opcode::Read as usize], 4);
        let j = s.to_json();
        assert_eq!(j["ops"]["READ"], 4);
        assert_eq!(j["backend"]["bytes_read"], 16384);
        assert_eq!(j["spliced_bytes"], 8192);
        assert_eq!(j["backend"]["flushes"], 2);
    }
}
