//! Per-queue counters: written by one queue thread only, readable from any thread (a live
//! `SIGUSR1` dump, a statistics query, a metrics scrape), merged into a [`Snapshot`] when read.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use engine::clock::now_ns;

use fuse_abi::{Opcode, MAX_OPCODE};

use crate::latency::{Histogram, Latency};

/// One past the largest errno counted by number (`EHWPOISON` is 133); larger ones count as 0.
pub const MAX_ERRNO: usize = 134;

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
    pub(crate) fn add(&self, by: u64) {
        self.0.store(self.get().wrapping_add(by), Ordering::Relaxed);
    }
    /// Takes `by` away (a gauge going down). Only the owning queue thread calls this.
    fn sub(&self, by: u64) {
        self.0.store(self.get().wrapping_sub(by), Ordering::Relaxed);
    }
    /// Sets the value (a gauge). Only the owning queue thread calls this.
    fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
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
    /// Requests taken and not yet answered (a gauge).
    pub in_flight: Counter,
    /// io_uring entries the queue has registered with the kernel: the depth it serves at now,
    /// which grows with the load (a gauge; 0 on the legacy transport).
    pub entries: Counter,
    /// Whether requests are timed into the latency histograms (`--latency off` saves the clock
    /// reads).
    timed: bool,
    /// Per opcode: arrival to reply, made at the opcode's first request (never in steady state).
    latency: [OnceLock<Box<Histogram>>; MAX_OPCODE],
    /// Per opcode: the backend's part (its read, write or flush, from issue to completion).
    backend_latency: [OnceLock<Box<Histogram>>; MAX_OPCODE],
    /// Per opcode, error replies by errno, made at the opcode's first error.
    errors: [OnceLock<Box<[Counter; MAX_ERRNO]>>; MAX_OPCODE],
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
            in_flight: Counter::default(),
            entries: Counter::default(),
            timed: true,
            latency: std::array::from_fn(|_| OnceLock::new()),
            backend_latency: std::array::from_fn(|_| OnceLock::new()),
            errors: std::array::from_fn(|_| OnceLock::new()),
        }
    }
}

/// The histogram of `opcode` in `set`, made at its first use.
fn histogram(set: &[OnceLock<Box<Histogram>>; MAX_OPCODE], opcode: u32) -> Option<&Histogram> {
    Some(set.get(opcode as usize)?.get_or_init(Box::default))
}

fn bump(c: &Counter, by: u64) {
    c.add(by);
}

impl Counters {
    /// Counters that time requests (`timed`) or only count them.
    pub fn new(timed: bool) -> Counters {
        Counters {
            timed,
            ..Counters::default()
        }
    }

    /// Whether requests are timed.
    pub fn timed(&self) -> bool {
        self.timed
    }

    /// A request is taken (counted in flight until [`Counters::answered`]).
    pub fn taken(&self) {
        bump(&self.in_flight, 1);
    }

    /// A request taken is answered.
    pub fn answered(&self) {
        self.in_flight.sub(1);
    }

    /// The queue serves with `n` io_uring entries now.
    pub fn set_entries(&self, n: usize) {
        self.entries.set(n as u64);
    }

    /// Counts an error reply.
    fn error(&self, opcode: u32, errno: i32) {
        let Some(cell) = self.errors.get(opcode as usize) else {
            return;
        };
        let by_errno = cell.get_or_init(|| Box::new(std::array::from_fn(|_| Counter::default())));
        let i = usize::try_from(errno)
            .ok()
            .filter(|&e| e < MAX_ERRNO)
            .unwrap_or(0);
        bump(&by_errno[i], 1);
    }

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
    /// Counts `bytes` read for the client.
    pub fn read(&self, bytes: usize) {
        bump(&self.backend_reads, 1);
        bump(&self.bytes_read, bytes as u64);
    }
    /// Counts `bytes` written for the client.
    pub fn write(&self, bytes: usize) {
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
            in_flight: self.in_flight.get(),
            entries: self.entries.get(),
            latency: histograms(&self.latency),
            backend_latency: histograms(&self.backend_latency),
            errors: self
                .errors
                .iter()
                .enumerate()
                .filter_map(|(op, c)| Some((op, c.get()?)))
                .flat_map(|(op, by)| {
                    by.iter()
                        .enumerate()
                        .map(move |(e, n)| ((op as u32, e as i32), n.get()))
                })
                .filter(|(_, n)| *n > 0)
                .collect(),
        }
    }
}

/// The counting of one request: its queue's counters and its timing. Made when the request
/// arrives and handed down to where its backend work happens, so the clock read that ends the
/// backend's part also ends the request's (the reply follows at once): two clock reads for a
/// request that reaches the backend, one for one that does not, none untimed.
pub struct Tally<'a> {
    counters: &'a Counters,
    /// When the request arrived ([`now_ns`]; 0: untimed).
    arrived: u64,
    /// The request's last clock read, when its backend work ended (0: none yet).
    last: Cell<u64>,
}

impl<'a> Tally<'a> {
    /// A request counted into `counters` that arrived at `arrived_ns` (when the loop reaped
    /// it); the time is ignored when the counters are untimed.
    pub fn new(counters: &'a Counters, arrived_ns: u64) -> Tally<'a> {
        Tally {
            counters,
            arrived: if counters.timed { arrived_ns } else { 0 },
            last: Cell::new(0),
        }
    }

    /// The clock read that starts the backend's part (0 when untimed).
    pub fn backend_start(&self) -> u64 {
        if self.arrived == 0 {
            0
        } else {
            now_ns()
        }
    }

    /// The backend's part of a request of `opcode`, begun at `started`, has ended.
    pub fn backend_done(&self, opcode: u32, started: u64) {
        if started == 0 {
            return;
        }
        let now = now_ns();
        if let Some(h) = histogram(&self.counters.backend_latency, opcode) {
            h.record(now.saturating_sub(started));
        }
        self.last.set(now);
    }

    /// The request, of `opcode`, is answered with `errno` (0: success): counts an error, and
    /// times the whole request.
    pub fn replied(&self, opcode: u32, errno: i32) {
        if errno != 0 {
            self.counters.error(opcode, errno);
        }
        if self.arrived == 0 {
            return;
        }
        let now = match self.last.get() {
            0 => now_ns(),
            t => t,
        };
        if let Some(h) = histogram(&self.counters.latency, opcode) {
            h.record(now.saturating_sub(self.arrived));
        }
    }

    /// Counts `bytes` read for the client.
    pub fn read(&self, bytes: usize) {
        self.counters.read(bytes);
    }

    /// Counts `bytes` written for the client.
    pub fn write(&self, bytes: usize) {
        self.counters.write(bytes);
    }

    pub(crate) fn flush(&self) {
        self.counters.flush();
    }
}

/// The histograms made so far, by opcode.
fn histograms(set: &[OnceLock<Box<Histogram>>; MAX_OPCODE]) -> BTreeMap<u32, Latency> {
    set.iter()
        .enumerate()
        .filter_map(|(op, h)| Some((op as u32, h.get()?.snapshot())))
        .collect()
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
    /// Requests in flight (for a merged snapshot, the sum over its queues).
    pub in_flight: u64,
    /// io_uring entries registered.
    pub entries: u64,
    /// Arrival-to-reply histograms by opcode number.
    pub latency: BTreeMap<u32, Latency>,
    /// The backend's part, by opcode number.
    pub backend_latency: BTreeMap<u32, Latency>,
    /// Error replies by opcode number and errno (0: an errno past [`MAX_ERRNO`]).
    pub errors: BTreeMap<(u32, i32), u64>,
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
        self.in_flight += o.in_flight;
        self.entries += o.entries;
        for (op, l) in &o.latency {
            self.latency.entry(*op).or_default().merge(l);
        }
        for (op, l) in &o.backend_latency {
            self.backend_latency.entry(*op).or_default().merge(l);
        }
        for (k, n) in &o.errors {
            *self.errors.entry(*k).or_default() += n;
        }
    }

    /// Error replies in all.
    pub fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }

    /// Every opcode's arrival-to-reply histogram merged into one.
    pub fn all_latency(&self) -> Latency {
        let mut all = Latency::default();
        for l in self.latency.values() {
            all.merge(l);
        }
        all
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
            "in_flight": self.in_flight,
            "entries": self.entries,
            "errors": self.errors.iter().map(|((op, errno), n)| serde_json::json!({
                "op": op_name(*op),
                "errno": errno,
                "name": errno_name(*errno),
                "count": n,
            })).collect::<Vec<_>>(),
            "latency": latency_json(&self.latency),
            "backend_latency": latency_json(&self.backend_latency),
        })
    }
}

fn latency_json(set: &BTreeMap<u32, Latency>) -> serde_json::Value {
    set.iter()
        .filter(|(_, l)| l.count() > 0)
        .map(|(op, l)| (op_name(*op), l.to_json()))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// An opcode's name (`"READ"`), or its number for one this protocol does not define.
pub fn op_name(op: u32) -> String {
    match Opcode::from_u32(op) {
        Some(o) => o.name().to_string(),
        None => op.to_string(),
    }
}

/// An errno's symbolic name (`"EIO"`), or its number (0: one past those counted by number).
pub fn errno_name(errno: i32) -> String {
    let name = match errno {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EINTR => "EINTR",
        libc::EIO => "EIO",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EBUSY => "EBUSY",
        libc::EEXIST => "EEXIST",
        libc::ENOTDIR => "ENOTDIR",
        libc::EISDIR => "EISDIR",
        libc::EINVAL => "EINVAL",
        libc::EFBIG => "EFBIG",
        libc::ENOSPC => "ENOSPC",
        libc::ESPIPE => "ESPIPE",
        libc::EROFS => "EROFS",
        libc::ERANGE => "ERANGE",
        libc::ENOSYS => "ENOSYS",
        libc::ENODATA => "ENODATA",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::ENOTCONN => "ENOTCONN",
        libc::ETIMEDOUT => "ETIMEDOUT",
        libc::ESHUTDOWN => "ESHUTDOWN",
        libc::ECONNRESET => "ECONNRESET",
        libc::ENXIO => "ENXIO",
        _ => return errno.to_string(),
    };
    name.to_string()
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
