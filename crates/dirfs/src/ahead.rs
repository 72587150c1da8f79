//! Metadata read-ahead for tree walks.
//!
//! A reader that stats what it lists (`du`, `ls -lR`, `git status`, a backup tool) walks a tree
//! one directory at a time, and each READDIRPLUS of a directory not in the source's caches waits
//! for its blocks and its entries' inodes to be read, one after the other, while the walker
//! waits for the reply. When a first READDIRPLUS reply looks up files (the readers stat what
//! they list, see `listing`), the directory is handed to one read-ahead thread, which walks the
//! tree below it in the order a walk does (a directory's entries, then each subdirectory in
//! turn), stat'ing each entry, so that when the walker arrives the source's caches hold what it
//! asks for. The thread runs on the CPU that the walker and the queue thread leave idle while
//! each waits for the other, at nice 10, so that a reader busy on every CPU itself (`git
//! status` stats with several threads) keeps them.
//!
//! A reader that looks files up one by one without listing (`stat` of each name of a list, `git
//! status` checking its index) is read ahead the same way, one directory's entries only: the
//! second file looked up in a directory hands that directory over, once per node (a second
//! other than the first: the same name looked up again after the kernel forgot it is no walk).
//!
//! A reader that only lists (`find -type f`, `ls -R`: a first reply that looks up no file) waits
//! the same way for each directory's blocks and its subdirectories' inodes: the tree below a
//! directory it lists with subdirectories in it is walked listing each directory, with no other
//! entry stat'ed ([`Reach::Listing`]). So is the tree below a directory whose second
//! subdirectory is looked up by name (a program opening each directory of a tree by its path),
//! [`WALKERS`] directories at once ([`Reach::Named`]): the one walk on more than one thread,
//! each started for it and ended with it.
//!
//! It only warms caches: nothing it reads is kept or answered, so what the kernel is told is
//! what the source says when the request is served. It stays below the directory handed to it
//! (names from `getdents`, one component each, a symlink never followed, no other filesystem
//! mounted inside entered, `O_NOATIME` where the daemon may) and is bounded: [`BUDGET`]
//! entries and [`DEPTH`] levels per directory handed over, and [`QUEUED`] directories waiting
//! (a hand-over that finds the queue full is dropped), of which only the latest is walked (it
//! is where the walker is now), a tree to stat before any other.
//!
//! The subdirectories a tree walk opens to list are then kept open ([`Parked`], at most
//! [`PARKED`] per export) for the reader's OPENDIR of them: an open can wait inside the kernel
//! (a fanotify permission listener), so a queue thread never opens a directory itself but hands
//! the open to an io-wq worker, a thread switch there and back per directory listed. A
//! directory this thread opened already is taken instead, with no open on the queue thread and
//! none waiting there. It is the same open the reader's would be: the daemon's, of the same
//! inode, with the caller's permission checked by the kernel before OPENDIR is sent.

use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};

use crate::sys::{self, Name};
use crate::DIRENTS_LEN;

/// Directories waiting for the read-ahead thread.
pub const QUEUED: usize = 64;
/// Entries stat'ed per directory handed over. Measured with `du` over a cold 10k-entry tree
/// through a directory export, tree read-ahead only: 74k entries/s with 2048, 80k with 8192,
/// 57k without.
pub const BUDGET: usize = 8192;
/// Directories a [`Reach::Named`] walk lists at once. Measured with the matrix's `readdir` (ten
/// directories of 1000 files opened by path, cold): 13–20% faster with four than with one.
pub const WALKERS: usize = 4;
/// How many levels below a directory handed over the walk goes.
pub const DEPTH: usize = 16;
/// Directories kept open for the reader per export ([`Parked`]). A walk goes in the reader's
/// order, and each later one starts where the reader then is, so what the reader opens next was
/// parked recently; the oldest are dropped first, so that directories the reader skipped do
/// not stay. Descriptors beyond the daemon's reserve are not spent on it.
pub const PARKED: usize = 64;

/// What to read ahead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// The tree below a directory being listed by a reader that stats what it lists
    /// ([`DEPTH`] levels): every entry stat'ed.
    Tree,
    /// The tree below a directory being listed by a reader that only lists (`find -type f`,
    /// `ls -R`; [`DEPTH`] levels): each directory listed, no other entry stat'ed.
    Listing,
    /// The tree below a directory whose subdirectories are opened one by one by path, as
    /// [`Reach::Listing`] but [`WALKERS`] directories at once. Such a reader lists each
    /// directory as it opens it, so it waits for nothing but each directory's blocks (a
    /// directory of 1000 files is a dozen blocks, read one after the other), which the source's
    /// device serves several at a time; a reader that lists the tree through the export keeps
    /// the CPUs busy itself, and a walk on four threads took their time (`find -type f`: 10%
    /// slower than on one).
    Named,
    /// The entries of a directory whose files are being looked up one by one, not below.
    Entries,
}

impl Reach {
    fn levels(self) -> usize {
        match self {
            Reach::Tree | Reach::Listing | Reach::Named => DEPTH,
            Reach::Entries => 1,
        }
    }

    /// Whether each entry is stat'ed (else only directories are, by opening them).
    fn stats(self) -> bool {
        !matches!(self, Reach::Listing | Reach::Named)
    }

    /// Threads listing directories at once.
    fn threads(self) -> usize {
        match self {
            Reach::Named => WALKERS,
            _ => 1,
        }
    }
}

/// A directory handed over: what to walk, how far, and where to park the subdirectories opened
/// (gone with its export, which also ends the walk).
type Job = (OwnedFd, Reach, Weak<Parked>);

/// The process's read-ahead thread, started by the first hand-over; `None` if it could not be.
static AHEAD: OnceLock<Option<SyncSender<Job>>> = OnceLock::new();

/// Hands `dir` (a descriptor of a directory, `O_PATH` or open) to the read-ahead thread, which
/// parks the subdirectories it lists in `parked`. Costs the caller a `dup` and, when the thread
/// sleeps, a wake-up; never blocks.
pub fn read_ahead(dir: BorrowedFd<'_>, reach: Reach, parked: Weak<Parked>) {
    let Some(tx) = AHEAD.get_or_init(start) else {
        return;
    };
    if let Ok(fd) = dir.try_clone_to_owned() {
        // Full: the thread is behind, and walks the latest of those queued next anyway.
        let _ = tx.try_send((fd, reach, parked));
    }
}

/// Directories a tree walk opened and listed, kept open for the reader's OPENDIR ([`PARKED`]
/// at most, the oldest dropped first), by inode (`st_dev`, `st_ino`). One per export: dropped
/// with it, so none outlives the export.
#[derive(Default)]
pub struct Parked {
    /// How many are parked: an OPENDIR with none parked takes no lock.
    count: AtomicUsize,
    dirs: Mutex<Vec<((u64, u64), OwnedFd)>>,
}

impl Parked {
    /// The directory `key` if a walk parked it, opened `O_RDONLY | O_DIRECTORY`; its offset is
    /// anywhere (READDIR seeks to the one asked for).
    pub fn take(&self, key: (u64, u64)) -> Option<OwnedFd> {
        if self.count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let mut dirs = self.dirs.lock().ok()?;
        let i = dirs.iter().position(|(k, _)| *k == key)?;
        let (_, fd) = dirs.remove(i);
        self.count.store(dirs.len(), Ordering::Relaxed);
        Some(fd)
    }

    /// Parks `fd`, the directory `key`, in place of an older one of it, dropping the oldest when
    /// full.
    fn park(&self, key: (u64, u64), fd: OwnedFd) {
        let Ok(mut dirs) = self.dirs.lock() else {
            return;
        };
        let gone = match dirs.iter().position(|(k, _)| *k == key) {
            Some(i) => Some(dirs.remove(i)),
            None if dirs.len() >= PARKED => Some(dirs.remove(0)),
            None => None,
        };
        dirs.push((key, fd));
        self.count.store(dirs.len(), Ordering::Relaxed);
        drop(dirs);
        drop(gone);
    }

    /// How many are parked.
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Which files and subdirectories of a directory were looked up by name: a reader that looks
/// up a second file of a directory (`stat` of each file of a list, `git status` checking its
/// index) is likely to go on through its entries ([`Reach::Entries`]), and one that looks up a
/// second subdirectory (a program opening each directory of a tree by its path) through its
/// subdirectories ([`Reach::Listing`]). The same one looked up again (after the kernel forgot
/// it, as a cache drop makes it do) is not a second: a path walked twice is no tree walk.
#[derive(Debug, Default)]
pub struct Lookups(AtomicU64);

/// A kind's state in [`Lookups`]: none looked up yet.
const NONE_YET: u64 = 0;
/// A kind's state in [`Lookups`]: a second one was looked up (the directory was handed over).
const SECOND_SEEN: u64 = u32::MAX as u64;

impl Lookups {
    /// Counts the entry `ino` looked up, a subdirectory (`dir`) or another; true exactly once
    /// per directory node and kind, when one other than the first of its kind is. Each kind
    /// keeps 32 bits: none yet, the first one's inode number (folded into the values between),
    /// or done.
    pub fn second(&self, dir: bool, ino: u64) -> bool {
        let shift = if dir { 32 } else { 0 };
        let state = |v: u64| (v >> shift) & SECOND_SEEN;
        let tag = ino % (SECOND_SEEN - 1) + 1;
        // (The load first: once both are done, or on the first one again, nothing is written.)
        let now = state(self.0.load(Ordering::Relaxed));
        if now == SECOND_SEEN || now == tag {
            return false;
        }
        self.0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                let next = match state(v) {
                    NONE_YET => tag,
                    SECOND_SEEN => return None,
                    first if first == tag => return None,
                    _ => SECOND_SEEN,
                };
                Some(v & !(SECOND_SEEN << shift) | next << shift)
            })
            .is_ok_and(|v| state(v) != NONE_YET)
    }
}

fn start() -> Option<SyncSender<Job>> {
    let (tx, rx) = sync_channel(QUEUED);
    match std::thread::Builder::new()
        .name("fusex-ahead".into())
        .spawn(move || serve(rx))
    {
        Ok(_) => Some(tx),
        Err(e) => {
            tracing::debug!("no metadata read-ahead: cannot start its thread: {e}");
            None
        }
    }
}

fn serve(rx: Receiver<Job>) {
    sys::lower_priority();
    let mut walker = Walker::default();
    let mut queue = Queue::default();
    loop {
        if queue.next.is_none() {
            let Ok((dir, reach, parked)) = rx.recv() else {
                return;
            };
            queue.offer((dir, parked), reach);
        }
        queue.take_in(&rx);
        let Some(((dir, parked), reach)) = queue.next.take() else {
            continue;
        };
        // A removed export's source is left at once (its filesystem may be unmounted next).
        if parked.strong_count() == 0 {
            continue;
        }
        walker.walk(dir.as_fd(), reach, BUDGET, &parked, &mut || {
            queue.take_in(&rx);
            queue.preempts(reach) || parked.strong_count() == 0
        });
    }
}

impl Queue<(OwnedFd, Weak<Parked>)> {
    /// Takes in every hand-over waiting in `rx`.
    fn take_in(&mut self, rx: &Receiver<Job>) {
        while let Ok((dir, reach, parked)) = rx.try_recv() {
            self.offer((dir, parked), reach);
        }
    }
}

/// The directory the thread walks next, chosen among the hand-overs as they come: the latest
/// (it is where the reader is now), but a tree to stat before any other while readers stat
/// what they list (a `du` hands over the odd listing too, when the `listing` policy checks
/// whether it still stats, and opens subdirectories by name). Two listings handed over with
/// no tree to stat between say the readers only list now (a `find` after a `du`): a tree to
/// stat then gives way, also one being walked, whose stats the reader no longer waits for.
#[derive(Debug)]
struct Queue<T> {
    next: Option<(T, Reach)>,
    /// Listings handed over since the last tree to stat.
    listings: u32,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Queue {
            next: None,
            listings: 0,
        }
    }
}

impl<T> Queue<T> {
    /// Takes in a hand-over.
    fn offer(&mut self, job: T, reach: Reach) {
        match reach {
            Reach::Tree => self.listings = 0,
            Reach::Listing | Reach::Named => self.listings += 1,
            Reach::Entries => {}
        }
        let keep = self.next.as_ref().is_some_and(|(_, r)| *r == Reach::Tree)
            && reach != Reach::Tree
            && !self.only_listing();
        if !keep {
            self.next = Some((job, reach));
        }
    }

    fn only_listing(&self) -> bool {
        self.listings >= 2
    }

    /// Whether a walk of `reach` in progress stops for the one waiting.
    fn preempts(&self, reach: Reach) -> bool {
        reach == Reach::Tree && self.only_listing() && self.next.is_some()
    }
}

/// How far one walk goes (levels, and the filesystem it started on), whether it stats each
/// entry, and where it parks what it opened.
#[derive(Clone, Copy)]
struct Limits<'a> {
    levels: usize,
    stats: bool,
    dev: u64,
    parked: &'a Weak<Parked>,
}

/// Walks trees: [`Walker::walk`]. Keeps its `getdents` buffers from walk to walk.
#[derive(Default)]
pub struct Walker {
    /// One `getdents` buffer per thread.
    bufs: Vec<Vec<u8>>,
}

impl Walker {
    /// Walks what `reach` says of `dir` (through an open file of its own: the caller's offset is
    /// left alone) as a tree walk does, listing each directory and stat'ing each entry (or, for
    /// [`Reach::Listing`], only opening the subdirectories) without following symlinks or
    /// entering another filesystem, until `budget` entries are listed; how many it listed.
    /// Parks the subdirectories it listed in `parked` (while it is still there). Asks `stop`
    /// (on the caller's thread) between directories whether to stop early.
    ///
    /// The walk goes depth first, in the order of the listings, a subdirectory once its parent
    /// is listed. A [`Reach::Named`] walk lists the next directories in that order on several
    /// threads at once (started for the walk).
    pub fn walk(
        &mut self,
        dir: BorrowedFd<'_>,
        reach: Reach,
        budget: usize,
        parked: &Weak<Parked>,
        stop: &mut dyn FnMut() -> bool,
    ) -> usize {
        let Ok(d) = sys::open_to_list(dir, None) else {
            return 0;
        };
        let Ok(st) = sys::stat_fd(d.as_fd()) else {
            return 0;
        };
        let limits = Limits {
            levels: reach.levels(),
            stats: reach.stats(),
            dev: st.st_dev,
            parked,
        };
        let walk = Walk {
            limits,
            left: AtomicUsize::new(budget),
            stopped: AtomicBool::new(false),
            todo: Mutex::new(Todo {
                dirs: vec![Pending {
                    parent: Arc::new(Listed {
                        fd: Some(d),
                        key: None,
                        parked: Weak::new(),
                    }),
                    name: None,
                    depth: 0,
                }],
                listing: 0,
            }),
            ready: Condvar::new(),
        };
        let threads = reach.threads();
        if self.bufs.len() < threads {
            self.bufs.resize_with(threads, || vec![0u8; DIRENTS_LEN]);
        }
        let (mine, others) = self.bufs.split_at_mut(1);
        std::thread::scope(|s| {
            for buf in others.iter_mut().take(threads - 1) {
                let walk = &walk;
                let started = std::thread::Builder::new()
                    .name("fusex-ahead".into())
                    .spawn_scoped(s, move || {
                        sys::lower_priority();
                        walk.work(buf, None);
                    });
                if started.is_err() {
                    break; // fewer threads, the same walk
                }
            }
            walk.work(&mut mine[0], Some(stop));
        });
        budget - walk.left.load(Ordering::Relaxed)
    }
}

/// One walk, shared by the threads that list its directories.
struct Walk<'a> {
    limits: Limits<'a>,
    /// Entries it may still list.
    left: AtomicUsize,
    /// Told to stop.
    stopped: AtomicBool,
    todo: Mutex<Todo>,
    /// Signalled when directories are added to `todo`, when the last one being listed is
    /// done, and when the walk stops.
    ready: Condvar,
}

/// The directories of a walk waiting to be listed.
struct Todo {
    /// The next to list last (a stack: the walk goes depth first, in listing order).
    dirs: Vec<Pending>,
    /// Being listed now; the walk is over when none is and none waits.
    listing: usize,
}

/// A directory to list: `name` in `parent` (or `parent` itself, the top, when `None`).
struct Pending {
    parent: Arc<Listed>,
    name: Option<CString>,
    depth: usize,
}

/// A directory of the walk, open for listing: parked once it is listed and each of its
/// subdirectories was opened (when the last of them lets go of it), except the top.
struct Listed {
    fd: Option<OwnedFd>,
    key: Option<(u64, u64)>,
    parked: Weak<Parked>,
}

impl Drop for Listed {
    fn drop(&mut self) {
        if let (Some(key), Some(fd), Some(parked)) =
            (self.key, self.fd.take(), self.parked.upgrade())
        {
            parked.park(key, fd);
        }
    }
}

impl Walk<'_> {
    fn halted(&self) -> bool {
        self.stopped.load(Ordering::Relaxed) || self.left.load(Ordering::Relaxed) == 0
    }

    fn halt(&self) {
        self.stopped.store(true, Ordering::Relaxed);
        let _todo = self.todo.lock();
        self.ready.notify_all();
    }

    /// Asks `stop` (the caller's thread only) whether to stop, and stops the walk if so.
    fn asked_to_stop(&self, stop: &mut Option<&mut dyn FnMut() -> bool>) -> bool {
        if let Some(stop) = stop {
            if stop() {
                self.halt();
                return true;
            }
        }
        self.halted()
    }

    /// Takes up to `n` entries of the budget; how many it got.
    fn claim(&self, n: usize) -> usize {
        match self
            .left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| {
                (l > 0).then(|| l - l.min(n))
            }) {
            Ok(l) => l.min(n),
            Err(_) => 0,
        }
    }

    /// One thread's part: lists the next directory waiting until none is left.
    fn work(&self, buf: &mut [u8], mut stop: Option<&mut dyn FnMut() -> bool>) {
        // A thread that panicked mid-listing would leave `listing` counting it, and the others
        // waiting for its subdirectories for ever (and the scope that joins them with them).
        let _halt = HaltOnPanic(self);
        while let Some(next) = self.next(&mut stop) {
            let subs = self.list(next, buf, &mut stop);
            let Ok(mut todo) = self.todo.lock() else {
                return;
            };
            todo.listing -= 1;
            let woken = !subs.is_empty() || todo.listing == 0;
            todo.dirs.extend(subs.into_iter().rev());
            drop(todo);
            if woken {
                self.ready.notify_all();
            }
        }
    }

    /// The next directory to list, `None` once the walk is over or halted.
    fn next(&self, stop: &mut Option<&mut dyn FnMut() -> bool>) -> Option<Pending> {
        if self.asked_to_stop(stop) {
            return None;
        }
        let mut todo = self.todo.lock().ok()?;
        loop {
            if self.halted() {
                return None;
            }
            if let Some(next) = todo.dirs.pop() {
                todo.listing += 1;
                return Some(next);
            }
            if todo.listing == 0 {
                return None;
            }
            todo = self.ready.wait(todo).ok()?;
        }
    }

    /// Opens and lists `p`, stat'ing its entries if the walk does; the subdirectories to list
    /// next, in listing order.
    fn list(
        &self,
        p: Pending,
        buf: &mut [u8],
        stop: &mut Option<&mut dyn FnMut() -> bool>,
    ) -> Vec<Pending> {
        let mut subs = Vec::new();
        let dir = match &p.name {
            None => p.parent,
            Some(name) => {
                let Some(parent) = p.parent.fd.as_ref() else {
                    return subs;
                };
                let Ok(name) = Name::new(name) else {
                    return subs;
                };
                let Ok(fd) = sys::open_to_list(parent.as_fd(), Some(name)) else {
                    return subs;
                };
                // A filesystem mounted inside is not read ahead (it may be a network one).
                match sys::stat_fd(fd.as_fd()) {
                    Ok(st) if st.st_dev == self.limits.dev => Arc::new(Listed {
                        fd: Some(fd),
                        key: Some((st.st_dev, st.st_ino)),
                        parked: self.limits.parked.clone(),
                    }),
                    _ => return subs,
                }
            }
        };
        let Some(d) = dir.fd.as_ref() else {
            return subs;
        };
        let below = p.depth + 1 < self.limits.levels;
        let mut first = true;
        loop {
            // Between directories, and between the batches of a large one.
            if !first && self.asked_to_stop(stop) {
                break;
            }
            first = false;
            let Ok(n @ 1..) = sys::getdents(d.as_raw_fd(), buf) else {
                break;
            };
            let taken = self.claim(dirents(&buf[..n]).count());
            for (typ, name) in dirents(&buf[..n]).take(taken) {
                if self.limits.stats {
                    if let Ok(name) = Name::new(name) {
                        let _ = sys::stat_in(d.as_fd(), name);
                    }
                }
                if below && typ == libc::DT_DIR {
                    subs.push(Pending {
                        parent: dir.clone(),
                        name: Some(name.to_owned()),
                        depth: p.depth + 1,
                    });
                }
            }
            if taken == 0 {
                break;
            }
        }
        subs
    }
}

/// Halts its walk when dropped by a panicking thread, so the other threads end.
struct HaltOnPanic<'w, 'a>(&'w Walk<'a>);

impl Drop for HaltOnPanic<'_, '_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.halt();
        }
    }
}

/// The `(d_type, name)` of each `linux_dirent64` record in `buf` but `.` and `..`; stops at the
/// first malformed one.
fn dirents(buf: &[u8]) -> impl Iterator<Item = (u8, &CStr)> {
    let mut pos = 0;
    std::iter::from_fn(move || loop {
        let rec = sys::dir_record(buf.get(pos..)?)?;
        pos += rec.reclen;
        if rec.name != c"." && rec.name != c".." {
            return Some((rec.typ, rec.name));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::symlink;

    #[test]
    fn a_walk_stats_the_tree_below_and_never_leaves_it() {
        let t = tempfile::tempdir().unwrap();
        let (root, outside) = (t.path().join("root"), t.path().join("outside"));
        for d in ["a", "b/deep"] {
            fs::create_dir_all(root.join(d)).unwrap();
        }
        fs::create_dir(&outside).unwrap();
        for i in 0..5 {
            fs::write(outside.join(format!("o{i}")), b"x").unwrap();
        }
        for f in ["a/f1", "a/f2", "b/f3", "b/deep/f4", "top"] {
            fs::write(root.join(f), b"x").unwrap();
        }
        // Symlinks to a directory outside are stat'ed themselves, never followed.
        symlink(&outside, root.join("out")).unwrap();
        symlink(&outside, root.join("a/out")).unwrap();
        let dir: OwnedFd = fs::File::open(&root).unwrap().into();
        let mut w = Walker::default();
        // root: a, b, top, out; a: f1, f2, out; b: f3, deep; deep: f4.
        assert_eq!(
            w.walk(dir.as_fd(), Reach::Tree, BUDGET, &Weak::new(), &mut || {
                false
            }),
            10
        );
        // A listing lists the same entries (stat'ing none but the subdirectories it opens).
        assert_eq!(
            w.walk(
                dir.as_fd(),
                Reach::Listing,
                BUDGET,
                &Weak::new(),
                &mut || false
            ),
            10
        );
        // So does one listing several directories at once, within the same budget.
        for budget in [BUDGET, 6, 1] {
            assert_eq!(
                w.walk(dir.as_fd(), Reach::Named, budget, &Weak::new(), &mut || {
                    false
                }),
                budget.min(10)
            );
        }
        // The budget bounds it, and Entries stays in the directory.
        assert_eq!(
            w.walk(dir.as_fd(), Reach::Tree, 6, &Weak::new(), &mut || false),
            6
        );
        assert_eq!(
            w.walk(
                dir.as_fd(),
                Reach::Entries,
                BUDGET,
                &Weak::new(),
                &mut || false
            ),
            4
        );
        // An O_PATH descriptor of the directory will do.
        let opath =
            sys::open_root(&std::ffi::CString::new(root.as_os_str().as_encoded_bytes()).unwrap())
                .unwrap();
        assert_eq!(
            w.walk(
                opath.as_fd(),
                Reach::Entries,
                BUDGET,
                &Weak::new(),
                &mut || false
            ),
            4
        );
        // The caller's own listing is left where it was.
        let mut buf = vec![0u8; DIRENTS_LEN];
        let n = sys::getdents(dir.as_raw_fd(), &mut buf).unwrap();
        assert_eq!(dirents(&buf[..n]).count(), 4, "a, b, top, out");
    }

    fn key(p: &std::path::Path) -> (u64, u64) {
        use std::os::unix::fs::MetadataExt;
        let m = fs::symlink_metadata(p).unwrap();
        (m.dev(), m.ino())
    }

    /// A tree walk parks each subdirectory it listed, open for listing; an export's OPENDIR
    /// takes it once. A list of entries parks none, and no more than [`PARKED`] are kept.
    #[test]
    fn a_tree_walk_parks_the_directories_it_listed() {
        use std::sync::Arc;
        let t = tempfile::tempdir().unwrap();
        fs::create_dir_all(t.path().join("a/b")).unwrap();
        fs::write(t.path().join("a/b/f"), b"x").unwrap();
        fs::write(t.path().join("a/g"), b"x").unwrap();
        let dir: OwnedFd = fs::File::open(t.path()).unwrap().into();
        let parked = Arc::new(Parked::default());
        let mut w = Walker::default();
        let walk = |w: &mut Walker, reach| {
            w.walk(
                dir.as_fd(),
                reach,
                BUDGET,
                &Arc::downgrade(&parked),
                &mut || false,
            )
        };
        walk(&mut w, Reach::Entries);
        assert!(parked.is_empty(), "a list of entries opens no subdirectory");
        walk(&mut w, Reach::Tree);
        assert_eq!(parked.len(), 2, "a and a/b");
        let b = parked.take(key(&t.path().join("a/b"))).expect("a/b parked");
        assert_eq!(parked.take(key(&t.path().join("a/b"))).map(drop), None);
        let st = sys::stat_fd(b.as_fd()).unwrap();
        assert_eq!((st.st_dev, st.st_ino), key(&t.path().join("a/b")));
        // Open for listing, from wherever the walk left it.
        sys::lseek(b.as_raw_fd(), 0, libc::SEEK_SET).unwrap();
        let mut buf = vec![0u8; DIRENTS_LEN];
        let n = sys::getdents(b.as_raw_fd(), &mut buf).unwrap();
        assert_eq!(
            dirents(&buf[..n])
                .map(|(_, n)| n.to_owned())
                .collect::<Vec<_>>(),
            [c"f"]
        );
        // A second walk parks a again in place of the first one's; so does one on several
        // threads.
        walk(&mut w, Reach::Tree);
        assert_eq!(parked.len(), 2, "a and a/b, once each");
        walk(&mut w, Reach::Named);
        assert_eq!(parked.len(), 2, "a and a/b, once each");
        assert!(parked.take(key(&t.path().join("a/b"))).is_some());
        // Bounded (at most PARKED).
        for i in 0..PARKED + 5 {
            fs::create_dir(t.path().join(format!("d{i:03}"))).unwrap();
        }
        walk(&mut w, Reach::Tree);
        assert_eq!(parked.len(), PARKED);
        // Nothing is parked for an export that is gone.
        let gone = Arc::downgrade(&parked);
        drop(parked);
        w.walk(dir.as_fd(), Reach::Tree, BUDGET, &gone, &mut || false);
        // The oldest parked goes first.
        let p = Parked::default();
        for i in 0..=PARKED as u64 {
            p.park((0, i), fs::File::open("/").unwrap().into());
        }
        assert_eq!((p.take((0, 0)).map(drop), p.len()), (None, PARKED));
        assert!(p.take((0, 1)).is_some() && p.take((0, PARKED as u64)).is_some());
    }

    /// Unmounts (lazily) on drop, also when the test fails.
    struct Mounted(std::path::PathBuf);

    impl Drop for Mounted {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }

    #[test]
    fn a_walk_does_not_enter_a_filesystem_mounted_inside() {
        if !is_root() {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI runs the tests as root: this one mounts a tmpfs"
            );
            eprintln!("skipped: mounting a tmpfs needs root");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let m = t.path().join("m");
        fs::create_dir(&m).unwrap();
        fs::write(t.path().join("f"), b"x").unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1m", "fusex-ahead-test"])
            .arg(&m)
            .status()
            .unwrap()
            .success();
        assert!(ok, "mount -t tmpfs on {}", m.display());
        let _guard = Mounted(m.clone());
        for i in 0..3 {
            fs::write(m.join(format!("in{i}")), b"x").unwrap();
        }
        let dir: OwnedFd = fs::File::open(t.path()).unwrap().into();
        // f and m are stat'ed; nothing inside the tmpfs is.
        let parked = std::sync::Arc::new(Parked::default());
        let walked = Walker::default().walk(
            dir.as_fd(),
            Reach::Tree,
            BUDGET,
            &std::sync::Arc::downgrade(&parked),
            &mut || false,
        );
        assert_eq!(walked, 2);
        assert!(parked.is_empty(), "the tmpfs is neither listed nor parked");
    }

    fn is_root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    #[test]
    fn the_second_file_or_subdirectory_looked_up_hands_the_directory_over_once() {
        let l = Lookups::default();
        assert!(!l.second(false, 10));
        assert!(
            !l.second(true, 11),
            "files and subdirectories are counted apart"
        );
        assert!(!l.second(false, 10), "the same file again is not a second");
        assert!(!l.second(true, 11), "nor the same subdirectory");
        assert!(l.second(false, 12));
        for i in 0..300 {
            assert!(!l.second(false, 100 + i));
        }
        assert!(l.second(true, 13));
        for i in 0..300 {
            assert!(!l.second(true, 100 + i));
            assert!(!l.second(false, 1000 + i));
        }
        // Any inode number, the largest included, counts as one.
        let l = Lookups::default();
        assert!(!l.second(true, u64::MAX));
        assert!(!l.second(true, u64::MAX));
        assert!(l.second(true, 0));
    }

    /// The latest hand-over is walked, but a tree to stat before any other until two listings
    /// come with no tree between (the readers only list now), which also stops such a walk.
    #[test]
    fn the_queue_keeps_a_tree_to_stat_until_readers_only_list() {
        use Reach::*;
        // A `du`: trees, and now and then a listing (the policy's probe) or a lookup's entries.
        let mut q = Queue::default();
        for (i, reach) in [Tree, Listing, Entries, Tree, Tree, Listing, Entries]
            .into_iter()
            .enumerate()
        {
            q.offer(i, reach);
            assert!(!q.preempts(Tree), "a du's walk is never stopped");
        }
        assert_eq!(q.next.take(), Some((4, Tree)), "the latest tree");
        // A `find` after it: a tree left over, then listings.
        q.offer(7, Tree);
        q.offer(8, Listing);
        assert_eq!(q.next.as_ref().map(|j| j.0), Some(7));
        assert!(!q.preempts(Tree));
        q.offer(9, Listing);
        assert_eq!(
            q.next.as_ref().map(|j| j.0),
            Some(9),
            "the readers only list now"
        );
        assert!(q.preempts(Tree), "a tree being walked stops for it");
        assert!(!q.preempts(Listing), "a listing being walked does not");
        q.next.take();
        assert!(!q.preempts(Tree), "nothing waits");
        // Stopped walks end early.
        let t = tempfile::tempdir().unwrap();
        for d in ["a", "b", "c"] {
            fs::create_dir(t.path().join(d)).unwrap();
        }
        let dir: OwnedFd = fs::File::open(t.path()).unwrap().into();
        let mut asked = 0;
        let mut stop = || {
            asked += 1;
            asked > 1
        };
        let n = Walker::default().walk(dir.as_fd(), Tree, BUDGET, &Weak::new(), &mut stop);
        assert_eq!(n, 3, "the top directory's entries, none below");
    }

    #[test]
    fn a_walk_thread_that_panics_mid_listing_ends_the_others() {
        let parked = Weak::new();
        let walk = Walk {
            limits: Limits {
                levels: 1,
                stats: false,
                dev: 0,
                parked: &parked,
            },
            left: AtomicUsize::new(BUDGET),
            stopped: AtomicBool::new(false),
            // One directory being listed, by the thread that is about to panic.
            todo: Mutex::new(Todo {
                dirs: Vec::new(),
                listing: 1,
            }),
            ready: Condvar::new(),
        };
        std::thread::scope(|s| {
            let waiter = s.spawn(|| walk.work(&mut [0u8; 64], None));
            let panicked = s.spawn(|| {
                let _halt = HaltOnPanic(&walk);
                // Give the waiter time to wait for this listing.
                std::thread::sleep(std::time::Duration::from_millis(50));
                panic!("a listing panics");
            });
            assert!(panicked.join().is_err());
            // Without the halt this join would never return.
            waiter.join().unwrap();
        });
        assert!(walk.stopped.load(Ordering::Relaxed));
    }

    #[test]
    fn malformed_records_end_the_listing() {
        let mut rec = vec![0u8; 24];
        rec[16..18].copy_from_slice(&24u16.to_ne_bytes());
        rec[18] = libc::DT_REG;
        rec[19..21].copy_from_slice(b"f\0");
        assert_eq!(dirents(&rec).count(), 1);
        // A record length past the buffer, or too short to hold a name, stops the listing.
        rec[16..18].copy_from_slice(&25u16.to_ne_bytes());
        assert_eq!(dirents(&rec).count(), 0);
        rec[16..18].copy_from_slice(&19u16.to_ne_bytes());
        assert_eq!(dirents(&rec).count(), 0);
        // A name without its NUL stops it too.
        rec[16..18].copy_from_slice(&24u16.to_ne_bytes());
        rec[19..24].copy_from_slice(b"fffff");
        assert_eq!(dirents(&rec).count(), 0);
        assert_eq!(dirents(&[]).count(), 0);
    }
}
