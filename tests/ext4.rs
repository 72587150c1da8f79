//! A real client: mkfs.ext4 on the export, loop-mount it, write a tree, fsck it, and find
//! the same filesystem in the backing image afterwards.

use std::fs;
use std::path::Path;
use std::process::Command;

use fusex_e2e::*;

const SIZE: u64 = 128 * MIB;

/// (relative path, size) of the files written into the filesystem.
const TREE: &[(&str, usize)] = &[
    ("top.bin", 300_000),
    ("empty", 0),
    ("a/one-byte", 1),
    ("a/b/page", 4096),
    ("a/b/odd", 4095),
    ("a/b/c/big", 5 * MIB as usize + 7),
    ("d/mid", 65537),
    ("d/one-mib", MIB as usize),
    ("d/e/f/g/deep.txt", 1234),
];

fn content(i: usize, len: usize) -> Vec<u8> {
    Rng::new(1000 + i as u64).bytes(len)
}

fn write_tree(root: &Path) {
    for (i, (rel, len)) in TREE.iter().enumerate() {
        let p = root.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, content(i, *len)).unwrap_or_else(|e| panic!("write {}: {e}", p.display()));
        fs::File::open(&p).unwrap().sync_all().unwrap();
    }
}

fn check_tree(root: &Path, when: &str) {
    for (i, (rel, len)) in TREE.iter().enumerate() {
        let p = root.join(rel);
        let got = fs::read(&p).unwrap_or_else(|e| panic!("{when}: read {}: {e}", p.display()));
        assert_bytes_eq(&got, &content(i, *len), 0, &format!("{when}: {rel}"));
    }
}

#[test]
fn ext4_on_the_export() {
    if !require_fuse_and_tools(&["mkfs.ext4", "e2fsck", "losetup", "mount", "umount", "sync"]) {
        return;
    }
    let w = WorkDir::new("ext4");
    let img = w.join("disk.img");
    sparse_image(&img, SIZE);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &["--writable"]);

    run_ok(Command::new("mkfs.ext4").arg("-q").arg("-F").arg(&mp));
    {
        let lo = LoopDev::attach(&mp, false);
        let dir = w.join("fs");
        fs::create_dir(&dir).unwrap();
        let fsm = FsMount::mount(&lo.dev, &dir, &[]);
        write_tree(&dir);
        run_ok(&mut Command::new("sync"));
        check_tree(&dir, "through ext4 on the export");
        fsm.unmount();
        lo.detach();
    }
    let fsck = run(Command::new("e2fsck").arg("-fn").arg(&mp));
    assert!(
        fsck.status.success(),
        "e2fsck -fn on the export: {}\n{}\n{}",
        fsck.status,
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );

    let through_mount = chunk_hashes(&open_ro(&mp), SIZE, MIB as usize);
    let st = m.stop();
    st.assert_clean("ext4");
    // mkfs.ext4's fsync, and ext4's cache flushes through the loop device (sync, the files'
    // fsyncs, journal commits), reach the export as FSYNC; each FSYNC and FLUSH flushes the
    // backend once (backend.flushes counts exactly those; the flush at exit is exit_flush).
    assert!(st.stat(&["ops", "FSYNC"]) >= 1, "stats: {}", st.stats());
    assert_eq!(
        st.stat(&["backend", "flushes"]),
        st.requested_flushes(),
        "every FSYNC/FLUSH flushes the backend: {}",
        st.stats()
    );
    assert!(st.flag(&["exit_flush"]), "stats: {}", st.stats());
    assert_eq!(stat(&img).unwrap().0, SIZE, "backing image size");
    let backing = chunk_hashes(&open_ro(&img), SIZE, MIB as usize);
    let differing: Vec<usize> = (0..backing.len())
        .filter(|&i| through_mount[i] != backing[i])
        .collect();
    assert!(
        differing.is_empty(),
        "export (read before stopping) and backing image differ in MiB chunks {differing:?}"
    );

    // The backing image itself is the same filesystem with the same files.
    let fsck = run(Command::new("e2fsck").arg("-fn").arg(&img));
    assert!(
        fsck.status.success(),
        "e2fsck -fn on the backing image: {}\n{}",
        fsck.status,
        String::from_utf8_lossy(&fsck.stdout)
    );
    let dir = w.join("direct");
    fs::create_dir(&dir).unwrap();
    let direct = FsMount::mount(&img, &dir, &["ro", "loop"]);
    check_tree(&dir, "backing image loop-mounted directly");
    direct.unmount();
}
