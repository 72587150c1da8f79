//! The integrity pass against images `qemu-img` made, healthy and with one planted fault each.

use super::*;
use crate::qcow2::damage::{Damage, BASE_RECIPE};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs a qemu tool; `None` (the test then does nothing) only outside CI when it is missing.
fn run(tool: &str, args: &[&str]) -> Option<()> {
    match Command::new(tool).args(args).output() {
        Ok(o) => {
            assert!(
                o.status.success(),
                "{tool} {args:?}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            Some(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            assert!(std::env::var_os("CI").is_none(), "{tool} missing in CI");
            None
        }
        Err(e) => panic!("{tool}: {e}"),
    }
}

/// The corpus's base image in `dir`, made as [`BASE_RECIPE`] says, with extra `-o` options;
/// `None` (the test then does nothing) only outside CI when qemu-img is missing.
fn base(dir: &Path, name: &str, opts: &str) -> Option<PathBuf> {
    let p = dir.join(name);
    match BASE_RECIPE.make(&p, opts) {
        Ok(()) => Some(p),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            assert!(std::env::var_os("CI").is_none(), "qemu-img missing in CI");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

fn check_path(p: &Path) -> Result<Summary, CheckError> {
    check(&File::open(p).unwrap())
}

#[test]
fn a_healthy_image_passes_with_nothing_leaked() {
    let d = tempfile::tempdir().unwrap();
    let Some(p) = base(d.path(), "a.qcow2", "") else {
        return;
    };
    let s = check_path(&p).unwrap();
    assert_eq!(s.leaked, 0);
    assert_eq!(s.windows, 1);
    assert!(s.clusters > 4);
}

#[test]
fn every_planted_fault_is_refused_naming_what_is_wrong() {
    let d = tempfile::tempdir().unwrap();
    let Some(clean) = base(d.path(), "clean.qcow2", "") else {
        return;
    };
    for dmg in Damage::ALL {
        let p = d.path().join(format!("{}.qcow2", dmg.name()));
        std::fs::copy(&clean, &p).unwrap();
        dmg.plant(&p).unwrap();
        match check_path(&p) {
            Err(CheckError::Damaged { first, count }) => {
                assert!(count >= 1);
                assert!(
                    !first.is_empty() && !first.contains('\n'),
                    "{dmg:?}: {first}"
                );
            }
            other => panic!("{dmg:?} passed the check: {other:?}"),
        }
    }
}

#[test]
fn overlaps_name_both_structures() {
    let d = tempfile::tempdir().unwrap();
    let Some(p) = base(d.path(), "a.qcow2", "") else {
        return;
    };
    Damage::L2OnL1.plant(&p).unwrap();
    let e = check_path(&p).unwrap_err().to_string();
    assert!(e.contains("overlaps the L1 table"), "{e}");
    let Some(p) = base(d.path(), "b.qcow2", "") else {
        return;
    };
    Damage::DataMappedTwice.plant(&p).unwrap();
    let e = check_path(&p).unwrap_err().to_string();
    assert!(e.contains("used 2 time(s) but its refcount is 1"), "{e}");
}

#[test]
fn snapshots_compression_refcount_widths_and_data_files_pass() {
    let d = tempfile::tempdir().unwrap();
    // Internal snapshots share L2 tables and data clusters (refcount 2), then diverge.
    let Some(s) = base(d.path(), "snap.qcow2", "") else {
        return;
    };
    let sp = s.to_str().unwrap();
    run("qemu-img", &["snapshot", "-c", "one", sp]).unwrap();
    run("qemu-io", &["-f", "qcow2", "-c", "write -P 0x33 0 64k", sp]).unwrap();
    run("qemu-img", &["snapshot", "-c", "two", sp]).unwrap();
    assert_eq!(check_path(&s).unwrap().leaked, 0);

    let c = d.path().join("compressed.qcow2");
    run(
        "qemu-img",
        &["convert", "-c", "-O", "qcow2", sp, c.to_str().unwrap()],
    )
    .unwrap();
    check_path(&c).unwrap();

    for bits in [1, 8, 64] {
        let Some(p) = base(
            d.path(),
            &format!("rc{bits}.qcow2"),
            &format!(",refcount_bits={bits}"),
        ) else {
            return;
        };
        assert_eq!(check_path(&p).unwrap().leaked, 0, "refcount_bits={bits}");
    }

    let data = d.path().join("ext.data");
    let o = format!(",data_file={}", data.display());
    let Some(p) = base(d.path(), "ext.qcow2", &o) else {
        return;
    };
    check_path(&p).unwrap();
}

#[test]
fn a_leak_passes_and_is_counted() {
    let d = tempfile::tempdir().unwrap();
    let Some(p) = base(d.path(), "a.qcow2", "") else {
        return;
    };
    // Unmapping guest cluster 1 by hand leaves its data cluster with a refcount and no user.
    let l = crate::qcow2::damage::Layout::read(&p).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.write_all_at(&0u64.to_be_bytes(), l.l2[0] + 8).unwrap();
    assert_eq!(check_path(&p).unwrap().leaked, 1);
}

#[test]
fn small_windows_find_what_one_window_finds() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("small.qcow2");
    let ps = p.to_str().unwrap();
    let Some(()) = run(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "cluster_size=512",
            ps,
            "8M",
        ],
    ) else {
        return;
    };
    run(
        "qemu-io",
        &[
            "-f",
            "qcow2",
            "-c",
            "write -P 7 0 300k",
            "-c",
            "write -P 8 4M 100k",
            ps,
        ],
    )
    .unwrap();
    let f = File::open(&p).unwrap();
    let whole = check_windowed(&f, WINDOW_CLUSTERS).unwrap();
    let split = check_windowed(&f, 7).unwrap();
    assert!(split.windows > 100, "{split:?}");
    assert_eq!(
        (whole.leaked, whole.clusters),
        (split.leaked, split.clusters)
    );

    // A data cluster mapped twice deep inside the file is found in its own window.
    let l = crate::qcow2::damage::Layout::read(&p).unwrap();
    let last = *l.data.last().unwrap();
    let w = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    w.write_all_at(&((1u64 << 63) | last).to_be_bytes(), l.l2[0])
        .unwrap();
    drop(w);
    assert!(matches!(
        check_windowed(&f, 7),
        Err(CheckError::Damaged { .. })
    ));
    assert!(matches!(
        check_windowed(&f, WINDOW_CLUSTERS),
        Err(CheckError::Damaged { .. })
    ));
}

proptest::proptest! {
    /// Any bytes: an answer, never a panic (the fuzz target runs the same on a corpus).
    #[test]
    fn arbitrary_bytes_never_panic(mut bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..4096), bits in 9u32..13) {
        if bytes.len() >= 104 {
            bytes[0..4].copy_from_slice(b"QFI\xfb");
            bytes[20..24].copy_from_slice(&bits.to_be_bytes());
        }
        let _ = check(&bytes[..]);
    }
}
