//! Finding and opening a differencing VHDX image's parent.
//!
//! The parent locator's paths come from the image, not from the operator, so they get the
//! policy qcow2 backing file names get ([`crate::qcow2::named`]): `--no-backing` refuses
//! them before anything is opened; each open is non-blocking, type-checked (a regular file or
//! block device) and bounded in time; when root serves an image another user owns, the parent
//! is opened with that user's credentials (unless `--trust-backing`), so a locator naming
//! `/etc/shadow` or another user's disk opens exactly what the image's owner could have read;
//! names are escaped in messages. A chain is at most [`MAX_CHAIN`] images, and an image that
//! appears twice in it (by device and inode: a hard link or symlink is caught too) is a loop.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use super::ondisk::{ParentLocator, FILE_ID};
use super::VhdxOptions;
use crate::lock::{lock_file, Claim, Locking};
use crate::qcow2::named::{self, shown, shown_path, OpenAs};
use crate::qcow2::MAX_CHAIN;
use crate::ringfile::RingFile;
use crate::OpenError;

/// Block table entries the images of one chain may hold together: 32 Mi (256 MiB of memory),
/// four times one image's bound, so a hostile chain of 64 sparse files each claiming the
/// largest table cannot make the daemon hold 64 of them.
pub(super) const CHAIN_ENTRIES: u64 = 4 * crate::blocktable::MAX_ENTRIES;

/// The images of one chain opened so far, and how to open the next.
pub(super) struct Chain {
    no_backing: bool,
    locking: Locking,
    /// Whose credentials parents are opened with (decided once, from the top image).
    who: OpenAs,
    /// Device and inode of every image of the chain, top first.
    opened: Vec<(u64, u64)>,
    /// Block table entries the chain's images hold so far.
    entries: u64,
}

impl Chain {
    /// A chain whose top image is open as `top`.
    pub(super) fn new(top: &File, opts: &VhdxOptions) -> io::Result<Chain> {
        let meta = top.metadata()?;
        Ok(Chain {
            no_backing: opts.no_backing,
            locking: opts.locking,
            who: OpenAs::for_image(&meta, opts.trust_backing),
            opened: vec![(meta.dev(), meta.ino())],
            entries: 0,
        })
    }

    /// How many block table entries the next image of the chain may hold.
    pub(super) fn entries_left(&self) -> u64 {
        CHAIN_ENTRIES.saturating_sub(self.entries)
    }

    /// Counts an image's block table against the chain's bound.
    pub(super) fn hold_entries(&mut self, n: u64) {
        self.entries = self.entries.saturating_add(n);
    }

    /// Finds the parent `loc` names for the image at `child` (trying its paths in the order
    /// [`candidates`] gives), opens it read-only, checks that it is a VHDX file and new to the
    /// chain, and locks it as a backing file. Returns its file, length and path.
    pub(super) fn open_parent(
        &mut self,
        child: &Path,
        loc: &ParentLocator,
    ) -> Result<(RingFile, u64, PathBuf), OpenError> {
        let child_shown = child.display().to_string();
        let refuse = |reason: String| OpenError::Format {
            path: child_shown.clone(),
            format: "vhdx",
            reason,
        };
        let dir = match child.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let tried = candidates(dir, loc);
        if self.no_backing {
            let name = tried
                .first()
                .map(|(_, p)| shown_path(p))
                .unwrap_or_else(|| "a parent fusex cannot locate".into());
            return Err(refuse(format!(
                "it is a differencing image whose data depends on its parent {name}, and \
                 --no-backing refuses to open it: drop --no-backing if the image is trusted"
            )));
        }
        let mut opened = None;
        for (key, path) in &tried {
            match named::open(path, false, false, self.who) {
                Ok((file, _canon)) => {
                    opened = Some((file, path.clone()));
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    tracing::debug!(key, path = %shown_path(path), "vhdx parent not there");
                }
                Err(e) => {
                    let p = shown_path(path);
                    return Err(refuse(match (self.who, e.raw_os_error()) {
                        (OpenAs::Owner(uid, _), Some(libc::EACCES | libc::EPERM)) => format!(
                            "its parent locator names {p} ({key}), which its owner (uid {uid}) \
                             may not open, and fusex runs as root: pass --trust-backing if \
                             the image is trusted"
                        ),
                        _ => format!("its parent {p} ({key}) cannot be opened: {e}"),
                    }));
                }
            }
        }
        let Some((file, path)) = opened else {
            return Err(refuse(not_found(loc, &tried)));
        };
        let p = shown_path(&path);
        let meta = file.metadata().map_err(|e| OpenError::from_io(&p, e))?;
        let id = (meta.dev(), meta.ino());
        if self.opened.contains(&id) {
            return Err(refuse(format!(
                "its parent {p} is an image of its own chain (a parent loop): the image is \
                 damaged"
            )));
        }
        if self.opened.len() >= MAX_CHAIN {
            return Err(refuse(format!(
                "its chain of parents is longer than {MAX_CHAIN} images"
            )));
        }
        let mut magic = [0u8; 8];
        if file.read_exact_at(&mut magic, 0).is_err() || magic != FILE_ID {
            return Err(refuse(format!(
                "its parent {p} is not a VHDX image (no 'vhdxfile' identifier at its start): \
                 a differencing VHDX image's parent is a VHDX image"
            )));
        }
        lock_file(
            &file,
            Claim::backing(self.locking),
            &format!("parent image {p} of image {}", shown_path(child)),
        )?;
        let len = if meta.is_file() {
            meta.len()
        } else {
            use std::os::fd::AsRawFd;
            crate::raw::blkdev_size(file.as_raw_fd()).map_err(|e| OpenError::from_io(&p, e))?
        };
        self.opened.push(id);
        let file =
            RingFile::from_file(file, &path, false).map_err(|e| OpenError::from_io(&p, e))?;
        Ok((file, len, path))
    }
}

/// A locator path as a POSIX path: `\` separators become `/`.
fn posix(s: &str) -> PathBuf {
    PathBuf::from(s.replace('\\', "/"))
}

/// The paths to try for the parent, in the format's order, each with the key it came from:
/// `relative_path` against the child's directory `dir`, then `volume_path` and
/// `absolute_win32_path` where they are absolute POSIX paths (as a tool on Linux may write
/// them); Windows paths (`\\?\d:\...`, `\\?\Volume{...}\...`, UNC shares) name nothing here.
pub(super) fn candidates(dir: &Path, loc: &ParentLocator) -> Vec<(&'static str, PathBuf)> {
    let mut out = Vec::new();
    if let Some(r) = &loc.relative_path {
        // `components` drops `.` (a locator's `.\parent.vhdx`), never `..`.
        out.push(("relative_path", dir.join(posix(r)).components().collect()));
    }
    for (key, v) in [
        ("volume_path", &loc.volume_path),
        ("absolute_win32_path", &loc.absolute_win32_path),
    ] {
        if let Some(v) = v {
            if v.starts_with('/') && !v.starts_with("//") {
                out.push((key, posix(v)));
            }
        }
    }
    out
}

/// The one line for a parent found at none of the locator's paths.
fn not_found(loc: &ParentLocator, tried: &[(&'static str, PathBuf)]) -> String {
    let mut said: Vec<String> = tried
        .iter()
        .map(|(key, p)| format!("{key} {}", shown_path(p)))
        .collect();
    for (key, v) in [
        ("volume_path", &loc.volume_path),
        ("absolute_win32_path", &loc.absolute_win32_path),
    ] {
        if let Some(v) = v {
            if !tried.iter().any(|(k, _)| *k == key) {
                said.push(format!("{key} {} (a Windows path)", shown(v)));
            }
        }
    }
    format!(
        "it is a differencing image and its parent is not where its parent locator says \
         ({}): put the parent there (relative_path is resolved against the image's directory)",
        said.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(rel: Option<&str>, vol: Option<&str>, abs: Option<&str>) -> ParentLocator {
        ParentLocator {
            relative_path: rel.map(String::from),
            volume_path: vol.map(String::from),
            absolute_win32_path: abs.map(String::from),
            ..ParentLocator::default()
        }
    }

    #[test]
    fn relative_first_then_posix_absolute_paths() {
        let l = loc(
            Some("..\\base\\p.vhdx"),
            Some("\\\\?\\Volume{26a21bda-a627-11d7-9931-806e6f6e6963}\\p.vhdx"),
            Some("/srv/p.vhdx"),
        );
        let c = candidates(Path::new("/img/child"), &l);
        assert_eq!(
            c,
            vec![
                ("relative_path", PathBuf::from("/img/child/../base/p.vhdx")),
                ("absolute_win32_path", PathBuf::from("/srv/p.vhdx")),
            ]
        );
        let msg = not_found(&l, &c);
        assert!(msg.contains("volume_path \\\\?\\Volume"), "{msg}");
        assert!(!msg.contains('\n'));
        let l = loc(None, None, Some("\\\\?\\d:\\p.vhdx"));
        assert!(candidates(Path::new("."), &l).is_empty());
    }
}
