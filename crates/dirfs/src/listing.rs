//! Which entries a directory's first READDIRPLUS reply looks up.
//!
//! The kernel (`FUSE_READDIRPLUS_AUTO`) asks for READDIRPLUS on the first read of every
//! directory, whoever reads it, and on later reads only when entries were looked up meanwhile.
//! Looking up an entry reads its inode; a reader that only lists (`ls`, `find -type f`, a
//! `getdents` loop) pays for that and uses nothing of it, while a reader that stats what it lists
//! (`du`, `ls -l`, `git status`) saves one LOOKUP round trip per entry. Subdirectories are
//! always looked up (a tree walk enters each). Files are looked up while the export's recent
//! readers stat what they list: a first reply that left files out marks its directory, and a
//! file of a marked directory looked up afterwards gives [`Listing`] credit for the next
//! [`CREDIT`] first replies. When the credit runs out one reply leaves files out again, to see
//! whether the readers still stat them.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

/// First replies that look up files after one file of a marked directory was looked up.
pub const CREDIT: u32 = 16;

/// The export-wide half of the policy: the credit left.
#[derive(Debug, Default)]
pub struct Listing {
    credit: AtomicU32,
}

/// The per-directory half: whether its last first reply left files out and none of them has
/// been looked up since.
#[derive(Debug, Default)]
pub struct Mark(AtomicBool);

impl Listing {
    /// Whether the first reply of a directory looks up its files too; if not, the directory is
    /// marked so a later lookup of one of its files is noticed.
    pub fn files_in_first_reply(&self, dir: &Mark) -> bool {
        let credited = self
            .credit
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| c.checked_sub(1))
            .is_ok();
        if !credited {
            dir.0.store(true, Ordering::Relaxed);
        }
        credited
    }

    /// A LOOKUP in `dir` found an entry that is not a directory: if a first reply left it out,
    /// the readers stat what they list.
    pub fn looked_up(&self, dir: &Mark, is_dir: bool) {
        // (The load first: the common unmarked case writes nothing shared.)
        if !is_dir && dir.0.load(Ordering::Relaxed) && dir.0.swap(false, Ordering::Relaxed) {
            self.credit.store(CREDIT, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listing_alone_leaves_files_out() {
        let l = Listing::default();
        let dirs: Vec<Mark> = (0..100).map(|_| Mark::default()).collect();
        for d in &dirs {
            assert!(!l.files_in_first_reply(d));
            // Only subdirectories are looked up by a tree walk.
            l.looked_up(d, true);
        }
    }

    #[test]
    fn statting_what_is_listed_looks_files_up_with_a_probe_every_credit() {
        let l = Listing::default();
        let mut with_files = 0;
        let n = 10 * (CREDIT as usize + 1);
        for _ in 0..n {
            let d = Mark::default();
            if l.files_in_first_reply(&d) {
                with_files += 1;
            } else {
                // The reader stats a file the reply left out.
                l.looked_up(&d, false);
                // Only the first lookup in the directory counts.
                l.looked_up(&d, false);
            }
        }
        assert_eq!(with_files, n - 10);
        // The credit is spent: the readers stop statting, and files stay left out.
        for _ in 0..2 * CREDIT {
            let d = Mark::default();
            assert!(!l.files_in_first_reply(&d));
            l.looked_up(&d, true);
        }
    }

    #[test]
    fn a_lookup_in_a_directory_listed_with_files_gives_no_credit() {
        let l = Listing::default();
        let a = Mark::default();
        assert!(!l.files_in_first_reply(&a));
        l.looked_up(&a, false);
        let b = Mark::default();
        assert!(l.files_in_first_reply(&b));
        l.looked_up(&b, false);
        for _ in 1..CREDIT {
            assert!(l.files_in_first_reply(&Mark::default()));
        }
        assert!(!l.files_in_first_reply(&Mark::default()));
    }
}
