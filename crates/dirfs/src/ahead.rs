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
//! second file looked up in a directory hands that directory over, once per node.
//!
//! A reader that only lists (`find -type f`, `ls -R`: a first reply that looks up no file) waits
//! the same way for each directory's blocks and its subdirectories' inodes: the tree below a
//! directory it lists with subdirectories in it is walked listing each directory, with no other
//! entry stat'ed ([`Reach::Listing`]). So is the tree below a directory whose second
//! subdirectory is looked up by name (a program opening each directory of a tree by its path).
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

use std::ffi::CStr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Mutex, OnceLock, Weak};

use crate::sys::{self, Name};
use crate::DIRENTS_LEN;

/// Directories waiting for the read-ahead thread.
pub const QUEUED: usize = 64;
/// Entries stat'ed per directory handed over. Measured with `du` over a cold 10k-entry tree
/// through a directory export, tree read-ahead only: 74k entries/s with 2048, 80k with 8192,
/// 57k without.
pub const BUDGET: usize = 8192;
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
    /// `ls -R`), or whose subdirectories are opened one by one ([`DEPTH`] levels): each
    /// directory listed, no other entry stat'ed.
    Listing,
    /// The entries of a directory whose files are being looked up one by one, not below.
    Entries,
}

impl Reach {
    fn levels(self) -> usize {
        match self {
            Reach::Tree | Reach::Listing => DEPTH,
            Reach::Entries => 1,
        }
    }

    /// Whether each entry is stat'ed (else only directories are, by opening them).
    fn stats(self) -> bool {
        self != Reach::Listing
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

/// A directory's counts of files and of subdirectories looked up by name: a reader that looks
/// up a second file of a directory (`stat` of each file of a list, `git status` checking its
/// index) is likely to go on through its entries ([`Reach::Entries`]), and one that looks up a
/// second subdirectory (a program opening each directory of a tree by its path) through its
/// subdirectories ([`Reach::Listing`]).
#[derive(Debug, Default)]
pub struct Lookups(AtomicU8);

impl Lookups {
    /// Counts one entry looked up, a subdirectory (`dir`) or another; true exactly once per
    /// directory node and kind, at the second. Two bits per kind, which stop counting at two.
    pub fn second(&self, dir: bool) -> bool {
        let shift = if dir { 2 } else { 0 };
        let count = |v: u8| (v >> shift) & 3;
        // (The load first: once both are at two, nothing shared is written again.)
        count(self.0.load(Ordering::Relaxed)) < 2
            && self
                .0
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                    (count(v) < 2).then_some(v + (1 << shift))
                })
                .is_ok_and(|v| count(v) == 1)
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
            Reach::Listing => self.listings += 1,
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

/// One walk's `getdents` buffers, one per level, kept from walk to walk.
#[derive(Default)]
pub struct Walker {
    bufs: Vec<Vec<u8>>,
    /// The walk in progress was told to stop.
    stopped: bool,
}

impl Walker {
    /// Walks what `reach` says of `dir` (through an open file of its own: the caller's offset is
    /// left alone) as a tree walk does, listing each directory and stat'ing each entry (or, for
    /// [`Reach::Listing`], only opening the subdirectories) without following symlinks or
    /// entering another filesystem, until `budget` entries are listed; how many it listed.
    /// Parks the subdirectories it listed in `parked` (while it is still there). Asks `stop`
    /// between directories whether to stop early.
    pub fn walk(
        &mut self,
        dir: BorrowedFd<'_>,
        reach: Reach,
        budget: usize,
        parked: &Weak<Parked>,
        stop: &mut dyn FnMut() -> bool,
    ) -> usize {
        let mut left = budget;
        self.stopped = false;
        if let Ok(d) = sys::open_to_list(dir, None) {
            if let Ok(st) = sys::stat_fd(d.as_fd()) {
                let limits = Limits {
                    levels: reach.levels(),
                    stats: reach.stats(),
                    dev: st.st_dev,
                    parked,
                };
                self.level(d.as_fd(), 0, limits, &mut left, stop);
            }
        }
        budget - left
    }

    fn level(
        &mut self,
        d: BorrowedFd<'_>,
        depth: usize,
        limits: Limits<'_>,
        left: &mut usize,
        stop: &mut dyn FnMut() -> bool,
    ) {
        if self.bufs.len() <= depth {
            self.bufs.resize_with(depth + 1, || vec![0u8; DIRENTS_LEN]);
        }
        let mut buf = std::mem::take(&mut self.bufs[depth]);
        while *left > 0 && !self.stopped {
            if stop() {
                self.stopped = true;
                break;
            }
            let Ok(n @ 1..) = sys::getdents(d.as_raw_fd(), &mut buf) else {
                break;
            };
            for (_, name) in dirents(&buf[..n]).take(*left) {
                *left -= 1;
                if let (true, Ok(name)) = (limits.stats, Name::new(name)) {
                    let _ = sys::stat_in(d, name);
                }
            }
            if depth + 1 == limits.levels {
                continue;
            }
            for (typ, name) in dirents(&buf[..n]) {
                if *left == 0 || self.stopped {
                    break;
                }
                if typ != libc::DT_DIR {
                    continue;
                }
                let Ok(name) = Name::new(name) else { continue };
                let Ok(sub) = sys::open_to_list(d, Some(name)) else {
                    continue;
                };
                // A filesystem mounted inside is not read ahead (it may be a network one).
                let Ok(st) = sys::stat_fd(sub.as_fd()) else {
                    continue;
                };
                if st.st_dev == limits.dev {
                    self.level(sub.as_fd(), depth + 1, limits, left, stop);
                    if let Some(parked) = limits.parked.upgrade() {
                        parked.park((st.st_dev, st.st_ino), sub);
                    }
                }
            }
        }
        self.bufs[depth] = buf;
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
        // A second walk parks a again in place of the first one's.
        walk(&mut w, Reach::Tree);
        assert_eq!(parked.len(), 2, "a and a/b, once each");
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
        assert!(!l.second(false));
        assert!(
            !l.second(true),
            "files and subdirectories are counted apart"
        );
        assert!(l.second(false));
        for _ in 0..300 {
            assert!(!l.second(false));
        }
        assert!(l.second(true));
        for _ in 0..300 {
            assert!(!l.second(true));
            assert!(!l.second(false));
        }
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
