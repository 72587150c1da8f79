//! Which worker threads serve an export's queues.
//!
//! `fusex mount` starts a set of its own: one thread per queue, sized and configured exactly for
//! its one export (spin, registered buffers, pinning). `fusex serve` runs one shared set, a
//! thread per CPU, whose engines serve the queues of every export that asks for nothing the
//! shared threads cannot give it; an export that does (its own spin, no registered buffers,
//! more queues than the set has threads, `--cpu-affinity off` on a pinned set) gets a set of
//! its own, as under `fusex mount`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use engine::EngineConfig;
use server::{Workers, WorkersConfig};

use crate::cli::{Affinity, MountArgs, OnOff};

/// Submission queue entries of a shared thread's ring: room for many exports' operations in one
/// batch (a fuller queue is submitted and refilled, so this bounds nothing).
const SHARED_SQ_ENTRIES: u32 = 1024;
/// Fixed-buffer table of a shared thread's ring: the kernel's maximum; a buffer without a slot
/// goes by address.
const SHARED_BUFFER_TABLE: u32 = 16384;
/// Fixed-file table of a shared thread's ring.
const SHARED_FILE_TABLE: u32 = 4096;
/// A shared thread's busy-poll before it sleeps (the io_uring default of `fusex mount`).
const SHARED_SPIN: Duration = Duration::from_micros(20);

/// The threads an export's queues run on.
pub struct Placement {
    /// The set.
    pub workers: Arc<Workers>,
    /// The set is this export's own: it ends with the export.
    pub private: bool,
}

/// Turns which shared thread serves the first queue of an export with fewer queues than the
/// set has threads, so such exports spread over the set.
static NEXT: Mutex<usize> = Mutex::new(0);

/// The process's shared set, made on first use.
static SHARED: Mutex<Option<Arc<Workers>>> = Mutex::new(None);

/// The shared set of `fusex serve`, started on first use: one thread per CPU fusex may run on,
/// each pinned to its CPU.
pub fn shared() -> Result<Arc<Workers>> {
    let mut s = SHARED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(w) = s.as_ref() {
        return Ok(w.clone());
    }
    let cpus = crate::affinity::allowed_cpus();
    let cfg = WorkersConfig {
        name: "fusex-w".into(),
        engine: EngineConfig {
            sq_entries: SHARED_SQ_ENTRIES,
            buffers: 0,
            buffer_table: SHARED_BUFFER_TABLE,
            file_table: SHARED_FILE_TABLE,
            register_buffers: true,
            spin: SHARED_SPIN,
            ..EngineConfig::default()
        },
        threads: cpus.len().max(1),
        on_start: Some(Arc::new(move |i| {
            // Started by whichever thread adds the first export, maybe a lowered control thread.
            crate::priority::to_base();
            if let Some(&cpu) = cpus.get(i) {
                crate::affinity::pin_current_thread(cpu);
            }
        })),
    };
    let w = Workers::start(&cfg).context("starting the shared queue threads")?;
    *s = Some(w.clone());
    Ok(w)
}

/// Whether an export of `nq` queues with these options can run on the shared set of `threads`.
fn fits_shared(args: &MountArgs, nq: usize, threads: usize) -> bool {
    nq <= threads
        && args.spin_us.is_none()
        && args.register_buffers == OnOff::On
        && args.cpu_affinity != Affinity::Off
}

/// Places an export's queues, `jobs` (queue `i` is `jobs[i]`), and hands each its thread: on the
/// shared set when `share` and its options allow, else on a set of its own configured as `fusex
/// mount` configures one, which takes them as it starts. `slots` is the most request buffers one
/// queue has; `uring` whether the queues serve io_uring (its default spin).
pub fn place(
    args: &MountArgs,
    jobs: Vec<Box<dyn server::Job>>,
    slots: usize,
    uring: bool,
    share: bool,
) -> Result<Placement> {
    let nq = jobs.len();
    if share {
        let w = shared()?;
        if fits_shared(args, nq, w.len()) {
            // As many queues as threads: queue i on thread i, pinned to the CPU whose
            // io_uring queue it serves.
            let first = if nq >= w.len() {
                0
            } else {
                let mut n = NEXT.lock().unwrap_or_else(|p| p.into_inner());
                *n = n.wrapping_add(1);
                *n % w.len()
            };
            for (i, job) in jobs.into_iter().enumerate() {
                w.submit(first + i, job);
            }
            return Ok(Placement {
                workers: w,
                private: false,
            });
        }
    }
    let cpus = crate::affinity::allowed_cpus();
    let pin = match args.cpu_affinity {
        Affinity::On => true,
        Affinity::Off => false,
        Affinity::Auto => nq == cpus.len(),
    };
    let spin = Duration::from_micros(args.spin_us.unwrap_or(if uring { 20 } else { 0 }));
    let cfg = WorkersConfig {
        name: "fusex-q".into(),
        engine: EngineConfig {
            sq_entries: (slots * 2 + 8) as u32,
            buffers: 0,
            buffer_table: u32::try_from(slots).unwrap_or(u32::MAX),
            register_buffers: args.register_buffers == OnOff::On,
            spin,
            ..EngineConfig::default()
        },
        threads: nq,
        on_start: Some(Arc::new(move |i| {
            // An export's own queue threads may be started by a lowered control thread.
            crate::priority::to_base();
            if pin {
                crate::affinity::pin_current_thread(cpus[i % cpus.len()]);
            }
        })),
    };
    tracing::debug!(queues = nq, pinned = pin, "starting queue threads");
    Ok(Placement {
        workers: Workers::start_with(&cfg, jobs).context("starting the queue threads")?,
        private: true,
    })
}
