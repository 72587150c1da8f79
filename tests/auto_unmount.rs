//! A daemon that dies (SIGKILL): with `--auto-unmount` its watcher removes the mount; without,
//! the dead mount stays, a new `fusex mount` on it says how to clear it, and `fusex umount` does.
//! The watcher identifies the mount by its unique mount id, so it never removes a mount a newer
//! daemon made at the same path.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::time::Instant;

use fusex_e2e::*;

/// The watcher process of daemon `pid` (named `fusex-watch`), once it is running.
#[track_caller]
fn watcher_of(pid: i32) -> i32 {
    let mut found = Vec::new();
    let ok = wait_until(Instant::now() + TIMEOUT, || {
        found = children_named(pid, "fusex-watch");
        !found.is_empty()
    });
    assert!(ok, "no fusex-watch child of daemon {pid}");
    assert_eq!(found.len(), 1, "one watcher per daemon: {found:?}");
    found[0]
}

#[track_caller]
fn kill_and_expect_unmount(m: Mount, what: &str) {
    let mp = m.path().to_path_buf();
    let watcher = watcher_of(m.pid());
    m.signal(libc::SIGKILL);
    let gone = wait_until(Instant::now() + TIMEOUT, || !is_fuse_mounted(&mp));
    assert!(
        gone,
        "{what}: the dead daemon's mount is still there after {TIMEOUT:?}"
    );
    let watcher_done = wait_until(Instant::now() + TIMEOUT, || !pid_alive(watcher));
    assert!(watcher_done, "{what}: the watcher did not exit");
    let st = m.wait_exit();
    assert!(st.exited && !st.left_mounted, "{what}: {st:?}");
    // What is left is the empty file fusex created as the mountpoint (only a clean exit removes it).
    let left = fs::metadata(&mp).map(|md| md.len());
    assert_eq!(
        left.ok(),
        Some(0),
        "{what}: the unmounted path shows the placeholder file"
    );
}

/// Contract: `--auto-unmount` removes the mount within seconds of the daemon's death, even by
/// SIGKILL (foreground).
#[test]
fn auto_unmount_removes_the_mount_of_a_killed_daemon() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("au-kill");
    let img = w.join("disk.img");
    let model = random_image(&img, MIB, 41);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &["--auto-unmount", "--writable"]);
    assert_bytes_eq(&read_all(&mp), &model, 0, "read before the kill");
    kill_and_expect_unmount(m, "foreground");
}

/// The same with `--daemonize`: the watcher is the daemon's child and outlives it.
#[test]
fn auto_unmount_removes_the_mount_of_a_killed_daemonized_daemon() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("au-kill-daemon");
    let img = w.join("disk.img");
    let model = random_image(&img, MIB, 42);
    let mp = w.join("export");
    let (m, mounted) =
        Mount::start_daemonized(&w, &img, &mp, &w.join("fusex.pid"), &["--auto-unmount"])
            .unwrap_or_else(|f| panic!("--daemonize --auto-unmount failed: {}", f.stderr));
    assert!(mounted, "mount live when the parent returned");
    assert_bytes_eq(&read_all(&mp), &model, 0, "read before the kill");
    kill_and_expect_unmount(m, "daemonized");
}

/// A directory export's mount goes with its killed daemon as an image export's does, and the
/// source is left as it was.
#[test]
fn auto_unmount_removes_the_mount_of_a_killed_directory_export() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("au-kill-dir");
    let src = w.join("src");
    let mp = w.join("mnt");
    fs::create_dir(&src).unwrap();
    fs::create_dir(&mp).unwrap();
    fs::write(src.join("kept"), b"source file\n").unwrap();
    let m = Mount::start(&w, &src, &mp, &["--auto-unmount"]);
    assert_eq!(fs::read(mp.join("kept")).unwrap(), b"source file\n");
    let watcher = watcher_of(m.pid());
    m.signal(libc::SIGKILL);
    let gone = wait_until(Instant::now() + TIMEOUT, || !is_fuse_mounted(&mp));
    assert!(
        gone,
        "the dead daemon's mount is still there after {TIMEOUT:?}"
    );
    assert!(
        wait_until(Instant::now() + TIMEOUT, || !pid_alive(watcher)),
        "the watcher did not exit"
    );
    let st = m.wait_exit();
    assert!(st.exited && !st.left_mounted, "{st:?}");
    assert_eq!(
        fs::read_dir(&mp).unwrap().count(),
        0,
        "the mountpoint is the empty directory again"
    );
    assert_eq!(fs::read(src.join("kept")).unwrap(), b"source file\n");
}

/// A clean stop with `--auto-unmount` is as clean as without: the daemon unmounts itself and the
/// watcher, finding nothing of its own, just exits.
#[test]
fn auto_unmount_after_a_clean_stop() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("au-clean");
    let img = w.join("disk.img");
    random_image(&img, MIB, 43);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &["--auto-unmount"]);
    let watcher = watcher_of(m.pid());
    m.stop().assert_clean("SIGTERM with --auto-unmount");
    let done = wait_until(Instant::now() + TIMEOUT, || !pid_alive(watcher));
    assert!(
        done,
        "the watcher did not exit after the daemon's clean exit"
    );
    assert!(!mp.exists(), "mountpoint created by fusex must be removed");
}

/// Without `--auto-unmount` a killed daemon leaves a dead mount (ENOTCONN). A new `fusex mount`
/// on it fails with one line saying how to recover, mounts nothing, and `fusex umount` clears it.
#[test]
fn without_auto_unmount_a_dead_mount_stays_until_fusex_umount() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("au-dead");
    let img = w.join("disk.img");
    let model = random_image(&img, MIB, 44);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &[]);
    let pid = m.pid();
    m.signal(libc::SIGKILL);
    assert!(
        wait_until(Instant::now() + TIMEOUT, || !pid_alive(pid)),
        "daemon {pid} survived SIGKILL"
    );
    assert_eq!(fuse_mounts_at(&mp).len(), 1, "the dead mount stays");
    // The connection ends once the kernel has released the daemon's io_uring (asynchronously,
    // after the process is gone): a stat queued just before that fails with ECONNABORTED (or,
    // caught on a ring entry as the ring is torn down, ECANCELED; or EIO, when the kernel was
    // copying it into a request buffer page the dying daemon had never used: a page fault is
    // refused to a process being killed), every one after it with ENOTCONN.
    let dead = wait_until(Instant::now() + TIMEOUT, || {
        let e = fs::metadata(&mp).expect_err("stat of a dead daemon's mount");
        assert!(
            matches!(
                errno(&e),
                libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED | libc::EIO
            ),
            "stat of a dead daemon's mount: {e}"
        );
        errno(&e) == libc::ENOTCONN
    });
    assert!(dead, "stat of the dead mount never said ENOTCONN");

    let r = run_fusex(
        &w,
        &["mount".as_ref(), img.as_os_str(), mp.as_os_str()],
        Some(&mp),
    );
    r.assert_one_error_line("fusex mount on a dead mount");
    assert!(
        r.stderr.contains("dead FUSE mount")
            && r.stderr.contains("Transport endpoint is not connected")
            && r.stderr.contains(&format!("fusex umount {}", mp.display())),
        "the error should say the mount is dead and how to clear it: {}",
        r.stderr
    );
    assert_eq!(fuse_mounts_at(&mp).len(), 1, "nothing new was mounted");

    let u = run_fusex(&w, &["umount".as_ref(), mp.as_os_str()], None);
    assert_eq!(
        u.code,
        Some(0),
        "fusex umount of a dead mount: {}",
        u.stderr
    );
    assert!(!is_fuse_mounted(&mp), "fusex umount cleared the dead mount");
    let st = m.wait_exit();
    assert!(!st.left_mounted);
    assert_eq!(st.signal, Some(libc::SIGKILL));

    // And the path is usable again.
    let again = Mount::start(&w, &img, &mp, &[]);
    assert_bytes_eq(&read_all(&mp), &model, 0, "read after remounting");
    again
        .stop()
        .assert_clean("remount after clearing a dead mount");
}

/// A killed daemon's mount keeps a writable raw image open and locked (the kernel holds the
/// passthrough file until the mount goes). The next `fusex mount` of that image used to say "in
/// use by another process", sending the user looking for a process that does not exist; now one
/// line names the dead mount and `fusex umount PATH`, which frees the image.
#[test]
fn a_dead_mount_holding_the_image_lock_is_named() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("au-dead-lock");
    let img = w.join("disk.img");
    let model = random_image(&img, MIB, 45);
    let mp = w.join("export");
    let mut m = Mount::start(&w, &img, &mp, &["--writable", "--passthrough", "on"]);
    let pid = m.pid();
    m.signal(libc::SIGKILL);
    // Reaped: every descriptor of the daemon is closed (a killed thread group can show as a
    // zombie while its other threads still close theirs).
    assert!(
        m.wait_gone(Instant::now() + TIMEOUT),
        "daemon {pid} survived SIGKILL"
    );
    assert_eq!(fuse_mounts_at(&mp).len(), 1, "the dead mount stays");

    let other = w.join("other");
    let args = [
        "mount".as_ref(),
        "--writable".as_ref(),
        img.as_os_str(),
        other.as_os_str(),
    ];
    let r = run_fusex(&w, &args, Some(&other));
    r.assert_one_error_line("fusex mount of an image a dead mount holds");
    let dead = fs::canonicalize(w.path()).unwrap().join("export");
    assert!(
        r.stderr
            .contains(&format!("dead fusex mount at {}", dead.display()))
            && r.stderr
                .contains(&format!("fusex umount {}", dead.display())),
        "the error should name the dead mount and how to free it: {}",
        r.stderr
    );
    assert!(!other.exists(), "nothing mounted, no mountpoint left");

    let u = run_fusex(&w, &["umount".as_ref(), mp.as_os_str()], None);
    assert_eq!(
        u.code,
        Some(0),
        "fusex umount of the dead mount: {}",
        u.stderr
    );
    let st = m.wait_exit();
    assert!(!st.left_mounted);
    // The kernel lets go of the image as the unmounted connection is torn down.
    let mut again = None;
    assert!(
        wait_until(Instant::now() + TIMEOUT, || {
            again = Mount::try_start(&w, &img, &other, &["--writable"]).ok();
            again.is_some()
        }),
        "the image stayed locked after fusex umount of the dead mount"
    );
    let again = again.unwrap();
    assert_bytes_eq(&read_all(&other), &model, 0, "read after freeing the image");
    again.stop().assert_clean("mount after freeing the image");
}

/// Regression: a watcher that only gets to run after its daemon died, the dead mount was cleared
/// and a new daemon mounted the same path must leave the new mount alone (the kernel usually gives
/// the new mount the old one's st_dev, so only the unique mount id tells them apart).
#[test]
fn the_watcher_leaves_a_newer_mount_at_the_same_path_alone() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("au-newer");
    let img_a = w.join("a.img");
    let img_b = w.join("b.img");
    random_image(&img_a, MIB, 45);
    let model_b = random_image(&img_b, MIB, 46);
    let mp = w.join("export");
    fs::write(&mp, b"").unwrap();
    let a = Mount::start(&w, &img_a, &mp, &["--auto-unmount"]);
    let dev_a = fs::metadata(&mp).unwrap().dev();
    let watcher = watcher_of(a.pid());
    let held = Resume::stop(watcher);
    let pid_a = a.pid();
    a.signal(libc::SIGKILL);
    assert!(wait_until(Instant::now() + TIMEOUT, || !pid_alive(pid_a)));
    assert!(
        is_fuse_mounted(&mp),
        "the stopped watcher cannot have unmounted"
    );
    let u = run_fusex(&w, &["umount".as_ref(), mp.as_os_str()], None);
    assert_eq!(
        u.code,
        Some(0),
        "fusex umount of the dead mount: {}",
        u.stderr
    );
    let st = a.wait_exit();
    assert!(!st.left_mounted);

    let b = Mount::start(&w, &img_b, &mp, &[]);
    let dev_b = fs::metadata(&mp).unwrap().dev();
    eprintln!(
        "st_dev of the old mount {dev_a:#x}, of the new one {dev_b:#x}{}",
        if dev_a == dev_b {
            " (reused: st_dev alone would not tell them apart)"
        } else {
            ""
        }
    );
    held.resume();
    drop(held);
    let done = wait_until(Instant::now() + TIMEOUT, || !pid_alive(watcher));
    assert!(done, "the resumed watcher did not exit");
    assert!(
        b.is_mounted(),
        "the old daemon's watcher unmounted the new mount"
    );
    assert_bytes_eq(&read_all(&mp), &model_b, 0, "the new export still serves");
    b.stop().assert_clean("the newer daemon");
}

/// The watcher runs before the mount can be seen: a daemon killed the moment its mount shows up
/// in mountinfo (before INIT, before it logged anything) still has its mount removed. Before,
/// the watcher started after INIT and such a kill left a dead mount.
#[test]
fn a_daemon_killed_as_its_mount_appears_leaves_no_mount() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("au-early");
    let img = w.join("disk.img");
    random_image(&img, MIB, 43);
    let mp = w.join("export");
    let _guard = UnmountOnDrop(mp.clone());
    for round in 0..10 {
        let log = fs::File::create(w.join(format!("fusex-{round}.log"))).unwrap();
        let child = std::process::Command::new(fusex_bin())
            .args(["mount", "--auto-unmount"])
            .arg(&img)
            .arg(&mp)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut child = ChildGuard(child);
        // Spin on mountinfo (no sleep): the kill lands as close to the mount as a reader can see.
        let deadline = Instant::now() + TIMEOUT;
        while !is_fuse_mounted(&mp) {
            assert!(child.try_wait().is_none(), "round {round}: fusex exited");
            assert!(Instant::now() < deadline, "round {round}: no mount");
        }
        child.kill_and_wait();
        let gone = wait_until(Instant::now() + TIMEOUT, || !is_fuse_mounted(&mp));
        assert!(
            gone,
            "round {round}: the mount of a daemon killed as it appeared is still there"
        );
    }
}
