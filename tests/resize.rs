//! The image changing size behind the export, and the upper bound of a growable export.
//!
//! - A raw image truncated or extended by another program: `stat` through the export follows it
//!   (the daemon checks every second and tells the kernel), reads end at the new end, and a
//!   fixed-size export's write past the new end fails with ENOSPC instead of growing the image.
//! - A resized block device (a loop device after `losetup -c`): the same.
//! - `--growable --max-size`: writes stop at the bound (EFBIG past it, a short write across
//!   it), truncate and fallocate past it fail with EFBIG, the image never grows past it.
//! - Bad `--max-size` invocations: one error line, nothing mounted.

use std::ffi::OsString;
use std::fs::{self, File};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use fusex_e2e::*;

/// Waits until `stat` through the export shows `size`.
#[track_caller]
fn wait_for_size(mp: &Path, size: u64, m: &Mount) {
    let deadline = Instant::now() + TIMEOUT;
    let mut seen = 0;
    let ok = wait_until(deadline, || {
        seen = fs::metadata(mp).map(|md| md.len()).unwrap_or(0);
        seen == size
    });
    assert!(
        ok,
        "the export's size stayed {seen}, not the image's {size}, for {TIMEOUT:?}; fusex stderr:\n{}",
        m.stderr()
    );
}

fn pwrite(f: &File, data: &[u8], off: u64) -> Result<usize, i32> {
    f.write_at(data, off).map_err(|e| errno(&e))
}

#[test]
fn fixed_size_export_follows_an_image_shrunk_behind_it() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("resize-shrink");
    let img = w.join("disk.img");
    let data = random_image(&img, 8 * MIB, 61);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &["--writable"]);
    assert_eq!(fs::metadata(&mp).unwrap().len(), 8 * MIB);

    // Another program cuts the image to 4 MiB.
    File::options()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(4 * MIB)
        .unwrap();
    wait_for_size(&mp, 4 * MIB, &m);

    let f = m.open_rw();
    // Reads end at the new end, and what is left reads as the image holds it.
    let tail = pread_full(&f, 4 * MIB - 4096, 16384).unwrap();
    assert_bytes_eq(
        &tail,
        &data[(4 * MIB - 4096) as usize..(4 * MIB) as usize],
        4 * MIB - 4096,
        "last 4 KiB of the shrunk image, read across the new end",
    );
    assert!(pread_full(&f, 6 * MIB, 4096).unwrap().is_empty());
    // A write past the new end does not grow a fixed-size export's image.
    assert_eq!(
        pwrite(&f, &[7u8; 4096], 6 * MIB),
        Err(libc::ENOSPC),
        "write past the new end"
    );
    assert_eq!(
        pwrite(&f, &[9u8; 8192], 4 * MIB - 4096),
        Ok(4096),
        "a write across the new end stops there"
    );
    assert_eq!(fs::metadata(&img).unwrap().len(), 4 * MIB, "image size");
    let mut want = data[..(4 * MIB) as usize].to_vec();
    want[(4 * MIB - 4096) as usize..].fill(9);
    assert_bytes_eq(&read_all(&img), &want, 0, "the image after the writes");
    drop(f);
    m.stop().assert_clean("export of an image shrunk behind it");
}

#[test]
fn export_follows_an_image_extended_behind_it() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("resize-grow");
    let img = w.join("disk.img");
    random_image(&img, 4 * MIB, 62);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &["--writable"]);
    // Another program appends 2 MiB of its own bytes.
    let extra = Rng::new(63).bytes(2 * MIB as usize);
    File::options()
        .write(true)
        .open(&img)
        .unwrap()
        .write_all_at(&extra, 4 * MIB)
        .unwrap();
    wait_for_size(&mp, 6 * MIB, &m);
    let f = m.open_rw();
    let got = pread_full(&f, 4 * MIB, 2 * MIB as usize).unwrap();
    assert_bytes_eq(
        &got,
        &extra,
        4 * MIB,
        "the bytes appended behind the export",
    );
    // The new end is the fixed size now: writes fit up to it and stop there.
    assert_eq!(pwrite(&f, &[1u8; 4096], 6 * MIB - 4096), Ok(4096));
    assert_eq!(pwrite(&f, &[1u8; 4096], 6 * MIB), Err(libc::ENOSPC));
    assert_eq!(fs::metadata(&img).unwrap().len(), 6 * MIB);
    drop(f);
    m.stop()
        .assert_clean("export of an image extended behind it");
}

#[test]
fn export_follows_a_resized_block_device() {
    if !require_fuse_and_tools(&["losetup"]) {
        return;
    }
    let w = WorkDir::new("resize-blk");
    let backing = w.join("backing.img");
    let data = random_image(&backing, 8 * MIB, 64);
    let dev = LoopDev::attach(&backing, false);
    let mp = w.join("export");
    let m = Mount::start(&w, dev.dev.as_os_str(), &mp, &["--writable"]);
    assert_eq!(fs::metadata(&mp).unwrap().len(), 8 * MIB);
    File::options()
        .write(true)
        .open(&backing)
        .unwrap()
        .set_len(4 * MIB)
        .unwrap();
    run_ok(Command::new("losetup").arg("-c").arg(&dev.dev));
    wait_for_size(&mp, 4 * MIB, &m);
    let f = m.open_rw();
    assert_eq!(pwrite(&f, &[5u8; 4096], 4 * MIB), Err(libc::ENOSPC));
    let got = pread_full(&f, 0, 8 * MIB as usize).unwrap();
    assert_bytes_eq(&got, &data[..(4 * MIB) as usize], 0, "the shrunk device");
    drop(f);
    m.stop().assert_clean("export of a resized block device");
    dev.detach();
}

#[test]
fn growable_export_stops_at_max_size() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("resize-max");
    let img = w.join("disk.img");
    random_image(&img, 4 * MIB, 65);
    let mp = w.join("export");
    let m = Mount::start(
        &w,
        &img,
        &mp,
        &["--writable", "--growable", "--max-size", "8M"],
    );
    let f = m.open_rw();
    assert_eq!(pwrite(&f, &[2u8; 4096], 8 * MIB - 4096), Ok(4096));
    assert_eq!(fs::metadata(&img).unwrap().len(), 8 * MIB);
    assert_eq!(pwrite(&f, &[2u8; 4096], 8 * MIB), Err(libc::EFBIG));
    // Across the bound: what fits is written, as a filesystem does at its largest file.
    assert_eq!(pwrite(&f, &[3u8; 8192], 8 * MIB - 4096), Ok(4096));
    assert_eq!(
        f.set_len(8 * MIB + 1).map_err(|e| errno(&e)),
        Err(libc::EFBIG),
        "truncate past --max-size"
    );
    assert_eq!(
        fallocate(&f, 0, 8 * MIB, 4096).map_err(|e| errno(&e)),
        Err(libc::EFBIG),
        "fallocate past --max-size"
    );
    assert_eq!(fs::metadata(&img).unwrap().len(), 8 * MIB, "image size");
    // Shrinking and growing again below the bound still work.
    f.set_len(6 * MIB).unwrap();
    assert_eq!(pwrite(&f, &[4u8; 4096], 7 * MIB), Ok(4096));
    assert_eq!(fs::metadata(&img).unwrap().len(), 7 * MIB + 4096);
    drop(f);
    m.stop().assert_clean("growable export with --max-size");
}

/// Runs `fusex mount ARGS IMAGE MP` expecting the one-line rejection; returns its stderr.
fn rejected(w: &WorkDir, what: &str, args: &[&str], img: &Path, mp: &Path) -> String {
    let mut argv: Vec<OsString> = vec!["mount".into()];
    argv.extend(args.iter().map(OsString::from));
    argv.push(img.into());
    argv.push(mp.into());
    let r = run_fusex(w, &argv, Some(mp));
    r.assert_one_error_line(what);
    assert!(!is_fuse_mounted(mp), "{what}: something is mounted");
    r.stderr
}

#[test]
fn bad_max_size_is_refused() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("resize-bad");
    let img = w.join("disk.img");
    random_image(&img, 4 * MIB, 66);
    let mp = w.join("export");
    let e = rejected(
        &w,
        "--max-size without --growable",
        &["--writable", "--max-size", "8M"],
        &img,
        &mp,
    );
    assert!(e.contains("--growable"), "{e}");
    let e = rejected(
        &w,
        "--max-size below the image size",
        &["--writable", "--growable", "--max-size", "1M"],
        &img,
        &mp,
    );
    assert!(e.contains("current size"), "{e}");
    // Past what the image's filesystem holds. The oracle: lseek refuses offsets past the
    // filesystem's largest file (ext4, where the tests run: 16 TiB; tmpfs, xfs: 8 EiB).
    let probe = File::open(&img).unwrap();
    // SAFETY: lseek on an fd this test owns.
    let fits = |off: u64| unsafe {
        libc::lseek(probe.as_raw_fd(), off as libc::off_t, libc::SEEK_SET) >= 0
    };
    let huge = 1u64 << 62;
    let args = ["--writable", "--growable", "--max-size", "4194304T"];
    assert_eq!(4194304u64 << 40, huge);
    if fits(huge) {
        let m = Mount::start(&w, &img, &mp, &args);
        m.stop()
            .assert_clean("--max-size within the filesystem's limit");
    } else {
        let e = rejected(
            &w,
            "--max-size past the filesystem's limit",
            &args,
            &img,
            &mp,
        );
        assert!(e.contains("can grow to"), "{e}");
    }
}
