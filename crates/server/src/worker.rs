//! Worker threads: each runs one engine that serves the queues of any number of exports.
//!
//! A thread per queue per export made a daemon of 100 exports run hundreds of threads, each with
//! its own ring, stack and malloc arena, most of them idle. A [`Workers`] set is a fixed number
//! of threads (one per CPU, say), each with one [`Engine`]; an export's queue is a tenant of one
//! of them: its buffers are a pool of that engine ([`Engine::add_pool`]), its request loops tasks
//! of its executor, its fixed files entries of its table. Exports come and go while the threads
//! run: work reaches a thread as a [`Job`] through its door (a locked list, touched once per
//! queue start, never per request) and a wakeup of the door's task.
//!
//! `fusex mount` runs a set of its own, one thread per queue, so one export on its own is
//! served exactly as before; `fusex serve` shares one set among every export whose engine
//! options match.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::task::Poll;

use engine::{Engine, EngineConfig, EngineError, Remote, TaskId};

/// Work for a worker thread, run on it with its engine.
pub trait Job: Send {
    /// Runs on the worker thread (spawning tasks on `eng`); must not block.
    fn run(self: Box<Self>, eng: &Rc<Engine>);
    /// The worker can no longer run it (its ring failed, or the set is shutting down): tell
    /// whoever waits for it.
    fn refuse(self: Box<Self>, why: &str);
}

/// Runs first on each worker thread, with its index (pinning it to a CPU).
pub type OnStart = Arc<dyn Fn(usize) + Send + Sync>;

/// How to build a set of workers.
#[derive(Clone)]
pub struct WorkersConfig {
    /// Thread names are `{name}{index}`.
    pub name: String,
    /// The engine each thread runs (its pool may be empty: tenants bring their own).
    pub engine: EngineConfig,
    /// Threads in the set.
    pub threads: usize,
    /// Run first on each thread.
    pub on_start: Option<OnStart>,
}

/// What the door of one worker holds.
struct Door {
    jobs: Mutex<Vec<Box<dyn Job>>>,
    /// No job is taken any more.
    closed: AtomicBool,
    /// The door's task on the worker's engine, and how to wake it.
    task: OnceLock<(Remote, TaskId)>,
}

impl Door {
    fn jobs(&self) -> std::sync::MutexGuard<'_, Vec<Box<dyn Job>>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn knock(&self) {
        if let Some((r, t)) = self.task.get() {
            r.wake(*t);
        }
    }
}

/// A set of worker threads.
pub struct Workers {
    doors: Vec<Arc<Door>>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

thread_local! {
    /// Why this worker's ring failed, for the tenants that end with it.
    static FAULT: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// The error that ended the worker running on this thread, if its ring failed.
pub fn worker_fault() -> Option<String> {
    FAULT.with(|f| f.borrow().clone())
}

impl Workers {
    /// Starts `cfg.threads` threads, each with an engine built from `cfg.engine`; returns once
    /// every one runs (or the first error: the threads already started end).
    pub fn start(cfg: &WorkersConfig) -> Result<Arc<Workers>, EngineError> {
        Workers::start_inner(cfg, Vec::new(), false)
    }

    /// A set for `jobs` alone (the queues of one `fusex mount`): job `i` waits on thread
    /// `i % threads` already and runs in the thread's first loop turn; the set takes no other
    /// job, and each thread ends once its jobs' tasks have ended. So the set needs nothing from
    /// the starting thread once it runs, neither to start its work nor to end. Under valgrind,
    /// whose threads take turns and which holds a thread's turn across `io_uring_enter`, a worker
    /// asleep on its ring waiting for a job, or for the word to end, would wait forever. On an
    /// error, the jobs not yet run are refused.
    pub fn start_with(
        cfg: &WorkersConfig,
        jobs: Vec<Box<dyn Job>>,
    ) -> Result<Arc<Workers>, EngineError> {
        Workers::start_inner(cfg, jobs, true)
    }

    fn start_inner(
        cfg: &WorkersConfig,
        jobs: Vec<Box<dyn Job>>,
        closed: bool,
    ) -> Result<Arc<Workers>, EngineError> {
        let n = cfg.threads.max(1);
        let me = Arc::new(Workers {
            doors: (0..n)
                .map(|_| {
                    Arc::new(Door {
                        jobs: Mutex::new(Vec::new()),
                        closed: AtomicBool::new(closed),
                        task: OnceLock::new(),
                    })
                })
                .collect(),
            threads: Mutex::new(Vec::with_capacity(n)),
        });
        for (i, job) in jobs.into_iter().enumerate() {
            me.doors[i % n].jobs().push(job);
        }
        if let Err(e) = me.spawn_threads(cfg) {
            for d in &me.doors {
                d.closed.store(true, Ordering::Release);
                let left = std::mem::take(&mut *d.jobs());
                for j in left {
                    j.refuse(&format!("the worker threads did not start: {e}"));
                }
            }
            return Err(e);
        }
        Ok(me)
    }

    fn spawn_threads(&self, cfg: &WorkersConfig) -> Result<(), EngineError> {
        for (i, door) in self.doors.iter().enumerate() {
            let (ready_tx, ready) = mpsc::sync_channel(1);
            let door = door.clone();
            let ecfg = cfg.engine.clone();
            let on_start = cfg.on_start.clone();
            let t = std::thread::Builder::new()
                .name(format!("{}{i}", cfg.name))
                .spawn(move || {
                    if let Some(f) = on_start {
                        f(i);
                    }
                    work(door, ecfg, ready_tx)
                })
                .map_err(EngineError::Setup)?;
            self.threads
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(t);
            ready.recv().unwrap_or_else(|_| {
                Err(EngineError::Setup(std::io::Error::other(
                    "worker thread ended while starting",
                )))
            })?;
        }
        Ok(())
    }

    /// Threads in the set.
    pub fn len(&self) -> usize {
        self.doors.len()
    }

    /// Whether the set has no threads (never: `start` makes at least one).
    pub fn is_empty(&self) -> bool {
        self.doors.is_empty()
    }

    /// Runs `job` on thread `index % len()`. A thread that can take no more work refuses it
    /// (through [`Job::refuse`]).
    pub fn submit(&self, index: usize, job: Box<dyn Job>) {
        let door = &self.doors[index % self.doors.len()];
        {
            let mut jobs = door.jobs();
            if !door.closed.load(Ordering::Acquire) {
                jobs.push(job);
                drop(jobs);
                door.knock();
                return;
            }
        }
        job.refuse("the worker thread has ended");
    }

    /// Ends every thread once the tenants it serves have ended; waits for them.
    pub fn shut_down(&self) {
        for d in &self.doors {
            d.closed.store(true, Ordering::Release);
            d.knock();
        }
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
        for t in threads {
            if t.thread().id() == std::thread::current().id() {
                continue;
            }
            let _ = t.join();
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// A worker thread: its engine, the door's task, and the loop until the door closes and every
/// tenant has ended.
fn work(door: Arc<Door>, cfg: EngineConfig, ready: mpsc::SyncSender<Result<(), EngineError>>) {
    // Without a fixed-buffer table the engine still starts (its buffers go by address).
    let eng = match Engine::new(&cfg) {
        Ok(e) => e,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let eng = Rc::new(eng);
    let task = eng.spawn(doorkeeper(door.clone(), eng.clone()));
    let _ = door.task.set((eng.remote(), task));
    let _ = ready.send(Ok(()));
    drop(ready);
    if let Err(e) = eng.run() {
        tracing::error!("worker thread: {e}; its exports end");
        FAULT.with(|f| *f.borrow_mut() = Some(e.to_string()));
    }
    door.closed.store(true, Ordering::Release);
    // Tenants still here end now (their tasks dropped, which reports them ended); jobs that
    // never ran are refused.
    eng.drop_tasks();
    let left = std::mem::take(&mut *door.jobs());
    for j in left {
        j.refuse("the worker thread has ended");
    }
}

/// The door's task: runs the jobs handed in; ends once the door is closed.
async fn doorkeeper(door: Arc<Door>, eng: Rc<Engine>) {
    std::future::poll_fn(|_| {
        let jobs = std::mem::take(&mut *door.jobs());
        for j in jobs {
            j.run(&eng);
        }
        if door.closed.load(Ordering::Acquire) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    // Closed: the tenants serve on until they end; the engine's `run` returns then.
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sends the name of the thread it runs on, from a task of that thread's engine.
    struct Probe(mpsc::Sender<Result<String, String>>);

    impl Job for Probe {
        fn run(self: Box<Self>, eng: &Rc<Engine>) {
            let tx = self.0;
            eng.spawn(async move {
                let name = std::thread::current().name().unwrap_or("").to_string();
                let _ = tx.send(Ok(name));
            });
        }
        fn refuse(self: Box<Self>, why: &str) {
            let _ = self.0.send(Err(why.to_string()));
        }
    }

    fn config(threads: usize) -> WorkersConfig {
        WorkersConfig {
            name: "test-w".into(),
            engine: EngineConfig::default(),
            threads,
            on_start: None,
        }
    }

    #[test]
    fn jobs_run_on_the_thread_they_name_and_are_refused_after_shut_down() {
        let w = Workers::start(&config(2)).unwrap();
        assert_eq!(w.len(), 2);
        let (tx, rx) = mpsc::channel();
        for i in 0..6 {
            w.submit(i, Box::new(Probe(tx.clone())));
        }
        let mut names: Vec<String> = (0..6)
            .map(|_| {
                rx.recv_timeout(std::time::Duration::from_secs(10))
                    .unwrap()
                    .unwrap()
            })
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["test-w0", "test-w0", "test-w0", "test-w1", "test-w1", "test-w1"]
        );
        w.shut_down();
        w.submit(0, Box::new(Probe(tx)));
        assert_eq!(
            rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap(),
            Err("the worker thread has ended".into())
        );
    }

    #[test]
    fn jobs_given_at_start_run_on_their_threads() {
        let (tx, rx) = mpsc::channel();
        let jobs: Vec<Box<dyn Job>> = (0..3).map(|_| Box::new(Probe(tx.clone())) as _).collect();
        let w = Workers::start_with(&config(2), jobs).unwrap();
        let mut names: Vec<String> = (0..3)
            .map(|_| {
                rx.recv_timeout(std::time::Duration::from_secs(10))
                    .unwrap()
                    .unwrap()
            })
            .collect();
        names.sort();
        assert_eq!(names, ["test-w0", "test-w0", "test-w1"]);
        drop(w);
    }

    #[test]
    fn jobs_given_to_a_set_that_cannot_start_are_refused() {
        let (tx, rx) = mpsc::channel();
        let cfg = WorkersConfig {
            // More submission entries than the kernel allows: the ring cannot be made.
            engine: EngineConfig {
                sq_entries: u32::MAX,
                ..EngineConfig::default()
            },
            ..config(1)
        };
        let jobs: Vec<Box<dyn Job>> = vec![Box::new(Probe(tx))];
        assert!(Workers::start_with(&cfg, jobs).is_err());
        let got = rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
        assert!(got.is_err_and(|e| e.starts_with("the worker threads did not start")));
    }

    #[test]
    fn on_start_runs_on_each_thread_with_its_index() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = seen.clone();
        let cfg = WorkersConfig {
            on_start: Some(Arc::new(move |i| s2.lock().unwrap().push(i))),
            ..config(3)
        };
        let w = Workers::start(&cfg).unwrap();
        drop(w);
        let mut got = seen.lock().unwrap().clone();
        got.sort();
        assert_eq!(got, [0, 1, 2]);
    }
}
