//! A backing chain the operator names in place of the one a qcow2 image's header names:
//! `fusex mount --backing`, and a qcow2 node's `backing` member in `blockdev-add` (how QEMU's
//! management tools build chains: every image its own node, each overlay naming its backing
//! node). The operator chose these files, so they are opened with the daemon's own credentials,
//! like the top image, and their formats are given, never probed (a raw image whose guest wrote
//! a qcow2 header into it stays raw). A qcow2 level without a level under it has the backing its
//! own header names, opened as any header-named file is (see [`super::named`]).

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use imago::format::builder::FormatDriverBuilder;
use imago::qcow2::Qcow2;
use imago::raw::Raw;
use imago::FormatAccess;

use super::{named, Gate, BACKING_CACHE_BYTES};
use crate::ringfile::RingFile;

/// One level of a backing chain, outermost (the top image's backing) first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackingLevel {
    /// A qcow2 image; its own backing is the next level, or else the one its header names.
    Qcow2(PathBuf),
    /// A raw image (the end of the chain).
    Raw(PathBuf),
    /// No backing image: the level above reads zeroes where it has no data.
    None,
}

/// Why a `--backing` chain cannot be used, in one line.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct BackingError(String);

impl FromStr for BackingLevel {
    type Err = BackingError;

    /// `qcow2:PATH`, `raw:PATH` or `none`.
    fn from_str(s: &str) -> Result<Self, BackingError> {
        if s == "none" {
            return Ok(BackingLevel::None);
        }
        let (format, path) = s.split_once(':').ok_or_else(|| {
            BackingError(format!(
                "backing '{}' names no format: give qcow2:PATH, raw:PATH or none",
                named::shown(s)
            ))
        })?;
        if path.is_empty() {
            return Err(BackingError(format!(
                "backing '{}' names no file: give {format}:PATH",
                named::shown(s)
            )));
        }
        match format {
            "qcow2" => Ok(BackingLevel::Qcow2(path.into())),
            "raw" => Ok(BackingLevel::Raw(path.into())),
            _ => Err(BackingError(format!(
                "backing format '{}' is not one fusex opens as a backing image: give qcow2 or raw",
                named::shown(format)
            ))),
        }
    }
}

impl fmt::Display for BackingLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackingLevel::Qcow2(p) => write!(f, "qcow2:{}", p.display()),
            BackingLevel::Raw(p) => write!(f, "raw:{}", p.display()),
            BackingLevel::None => f.write_str("none"),
        }
    }
}

/// Checks that `levels` make a chain: only a qcow2 level has one under it, so a raw level or
/// `none` comes last.
pub fn check_chain(levels: &[BackingLevel]) -> Result<(), BackingError> {
    if let Some(i) = levels[..levels.len().saturating_sub(1)]
        .iter()
        .position(|l| !matches!(l, BackingLevel::Qcow2(_)))
    {
        return Err(BackingError(format!(
            "backing {} is followed by another level, but only a qcow2 image has a backing \
             image: put it last",
            levels[i]
        )));
    }
    if levels.len() > super::MAX_CHAIN {
        return Err(BackingError(format!(
            "a backing chain of {} images is longer than the {} fusex opens",
            levels.len(),
            super::MAX_CHAIN
        )));
    }
    Ok(())
}

/// Opens `levels` (checked by [`check_chain`]) from the bottom up, every file read-only and
/// locked as a backing file, for the top image's builder: `None` for a chain that is `none`.
pub(super) async fn open_chain(
    levels: &[BackingLevel],
    gate: &Gate,
) -> io::Result<Option<FormatAccess<RingFile>>> {
    // What the level being opened stands on, as imago's builder takes it: None while there is
    // no level below (its header's backing file is used), Some(None) below a `none`.
    let mut under: Option<Option<FormatAccess<RingFile>>> = None;
    for level in levels.iter().rev() {
        let opened = match level {
            BackingLevel::None => None,
            BackingLevel::Raw(path) => {
                let file = open_level(path, gate)?;
                let raw = Raw::builder(file).write(false).open(gate.clone()).await?;
                Some(FormatAccess::new(raw))
            }
            BackingLevel::Qcow2(path) => {
                let file = open_level(path, gate)?;
                let owner = file.file().metadata()?;
                let mut builder = Qcow2::<RingFile>::builder(file)
                    .metadata_cache_bytes(BACKING_CACHE_BYTES, BACKING_CACHE_BYTES)
                    .write(false);
                if let Some(u) = under.take() {
                    builder = builder.backing(u);
                }
                // The backing its own header names is that image's choice, opened with the
                // credentials of the one who owns it.
                let q = builder.open(gate.for_named_by(&owner)).await.map_err(|e| {
                    io::Error::new(
                        e.kind(),
                        format!("backing image {}: {e}", named::shown_path(path)),
                    )
                })?;
                Some(FormatAccess::new(q))
            }
        };
        under = Some(opened);
    }
    Ok(under.flatten())
}

/// One operator-named file of the chain: opened as the daemon (never hangs, type-checked),
/// recorded against loops, locked as a backing file.
fn open_level(path: &Path, gate: &Gate) -> io::Result<RingFile> {
    let described = |e: io::Error| {
        io::Error::new(
            e.kind(),
            format!(
                "backing image {} cannot be opened: {e}",
                named::shown_path(path)
            ),
        )
    };
    gate.open_chain_file(path, false, gate.direct, named::OpenAs::Daemon, described)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_and_print_back() {
        for s in ["qcow2:/a/b.qcow2", "raw:/x:y", "none"] {
            let l: BackingLevel = s.parse().unwrap();
            assert_eq!(l.to_string(), s);
        }
        assert_eq!(
            "raw:/x:y".parse::<BackingLevel>().unwrap(),
            BackingLevel::Raw("/x:y".into())
        );
    }

    #[test]
    fn bad_levels_are_one_line_errors() {
        for (s, says) in [
            ("/a.qcow2", "names no format"),
            ("qcow2:", "names no file"),
            ("vmdk:/a", "give qcow2 or raw"),
        ] {
            let e = s.parse::<BackingLevel>().unwrap_err().to_string();
            assert!(e.contains(says), "{s}: {e}");
            assert!(!e.contains('\n'));
        }
    }

    #[test]
    fn only_qcow2_levels_have_levels_under_them() {
        let q = BackingLevel::Qcow2("/q".into());
        let r = BackingLevel::Raw("/r".into());
        assert!(check_chain(&[q.clone(), q.clone(), r.clone()]).is_ok());
        assert!(check_chain(&[q.clone(), BackingLevel::None]).is_ok());
        assert!(check_chain(&[]).is_ok());
        let e = check_chain(&[r.clone(), q.clone()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("raw:/r is followed"), "{e}");
        assert!(check_chain(&[BackingLevel::None, q]).is_err());
    }
}
