//! How a stop ends an export: SIGHUP stops like SIGTERM, SIGUSR2 and SIGALRM are ignored, and a
//! stop with files still open on the export (a program's fd, a loop device under a mounted ext4)
//! detaches it and serves them until they are closed; a second signal or `--stop-timeout` aborts.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use fusex_e2e::*;

/// A shell holding the export open on fd 3 (O_RDWR, no truncation). Each line written to its
/// stdin makes it write `text` at its file offset (0 first) and answer `written` or `failed`;
/// end of input closes the fd and ends it.
struct Holder {
    child: ChildGuard,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl Holder {
    fn open(path: &Path, text: &str) -> Holder {
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(
                r#"exec 3<>"$0" || exit 1; echo opened
                   while read -r _; do
                       if printf %s "$1" >&3; then echo written; else echo failed; fi
                   done"#,
            )
            .arg(path)
            .arg(text)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn sh");
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut h = Holder {
            child: ChildGuard(child),
            stdin,
            stdout,
        };
        assert_eq!(
            h.line(),
            "opened",
            "the holder could not open {}",
            path.display()
        );
        h
    }

    fn line(&mut self) -> String {
        let mut s = String::new();
        self.stdout
            .read_line(&mut s)
            .expect("read the holder's stdout");
        s.trim().to_string()
    }

    /// Asks for one write; true if it succeeded.
    fn write(&mut self) -> bool {
        let stdin = self.stdin.as_mut().expect("holder still open");
        stdin.write_all(b"go\n").expect("holder stdin");
        stdin.flush().unwrap();
        match self.line().as_str() {
            "written" => true,
            "failed" => false,
            other => panic!("holder said {other:?}"),
        }
    }

    /// Closes the export's fd and waits for the shell to end.
    fn close(mut self) {
        drop(self.stdin.take());
        let st = self.child.0.wait().expect("wait for the holder");
        assert!(st.success(), "holder: {st}");
    }
}

fn mounted_export(tag: &str, args: &[&str]) -> (WorkDir, std::path::PathBuf, Mount) {
    let w = WorkDir::new(tag);
    let img = w.join("disk.img");
    sparse_image(&img, 4 * MIB);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, args);
    (w, img, m)
}

/// SIGTERM while a file is open on the export: waits until the daemon says it serves the open
/// files on and the export has left its path.
fn stop_and_wait_for_the_detach(m: &Mount, mp: &Path) {
    m.signal(libc::SIGTERM);
    assert!(
        m.wait_for_log(STILL_OPEN, Instant::now() + TIMEOUT),
        "SIGTERM with a file open: the daemon did not say it serves it on; stderr:\n{}",
        m.stderr()
    );
    assert!(
        wait_until(Instant::now() + TIMEOUT, || !is_fuse_mounted(mp)),
        "the export is still attached at its path after the stop signal"
    );
}

/// Closing the terminal of a foreground `fusex mount` sends SIGHUP: the daemon stops as on
/// SIGTERM (unmounts, removes the mountpoint it created, exits 0) instead of dying with the mount
/// left behind.
#[test]
fn sighup_stops_cleanly() {
    if !require_fuse() {
        return;
    }
    let (_w, _img, m) = mounted_export("stop-hup", &["--writable"]);
    let mp = m.path().to_path_buf();
    m.signal(libc::SIGHUP);
    let st = m.wait_exit();
    st.assert_clean("SIGHUP");
    assert!(!is_fuse_mounted(&mp), "mountpoint is still a FUSE mount");
    assert!(!mp.exists(), "the mountpoint fusex created must be removed");
    assert!(st.flag(&["exit_flush"]), "stats: {}", st.stats());
}

/// SIGUSR2 and SIGALRM, whose default action kills, are ignored with a log line: the export keeps
/// serving the image's bytes.
#[test]
fn sigusr2_and_sigalrm_are_ignored() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("stop-usr2");
    let img = w.join("disk.img");
    let data = random_image(&img, MIB, 77);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &[]);
    for (sig, name) in [(libc::SIGUSR2, "SIGUSR2"), (libc::SIGALRM, "SIGALRM")] {
        m.signal(sig);
        let line = format!("{name}: ignored");
        assert!(
            m.wait_for_log(&line, Instant::now() + TIMEOUT),
            "no {line:?} in the log; stderr:\n{}",
            m.stderr()
        );
        assert!(pid_alive(m.pid()), "{name} killed the daemon");
        assert!(m.is_mounted(), "{name}: the export is gone");
        assert_bytes_eq(&read_all(&mp), &data, 0, &format!("after {name}"));
    }
    m.stop().assert_clean("stop after SIGUSR2 and SIGALRM");
}

/// A stop while a program holds the export open: the daemon detaches the export (nothing new can
/// open it), says how many files are open and serves them on; a write made after the signal
/// succeeds and is in the image once the program closed the file and the daemon exited 0.
#[test]
fn stop_serves_an_open_file_until_it_is_closed() {
    if !require_fuse() {
        return;
    }
    let (_w, img, m) = mounted_export("stop-held", &["--writable"]);
    let mp = m.path().to_path_buf();
    let mut holder = Holder::open(&mp, "after-the-signal");
    stop_and_wait_for_the_detach(&m, &mp);
    assert!(
        m.stderr().contains("1 file is still open"),
        "the log names how many files are open: {}",
        m.stderr()
    );
    assert!(holder.write(), "a write after the stop signal failed");
    assert!(
        pid_alive(m.pid()),
        "the daemon exited while a file was open; stderr:\n{}",
        m.stderr()
    );
    holder.close();
    let st = m.wait_exit();
    st.assert_clean("SIGTERM, then the last open file closed");
    assert!(st.flag(&["exit_flush"]), "stats: {}", st.stats());
    assert!(!mp.exists(), "the mountpoint fusex created must be removed");
    assert_eq!(&read_all(&img)[..16], b"after-the-signal");
}

/// A program that opens the export's path after a stop detached it (while another file keeps
/// the daemon serving) reaches the mountpoint file fusex created, and may write to it. Those
/// bytes are kept: the daemon removes the file it created only while it is still empty, and
/// says why it kept it.
#[test]
fn stop_keeps_a_created_mountpoint_written_after_the_detach() {
    if !require_fuse() {
        return;
    }
    let (_w, img, m) = mounted_export("stop-written-under", &["--writable"]);
    let mp = m.path().to_path_buf();
    let holder = Holder::open(&mp, "held");
    stop_and_wait_for_the_detach(&m, &mp);
    fs::write(&mp, b"a program's bytes").expect("write to the path after the detach");
    holder.close();
    let st = m.wait_exit();
    st.assert_clean("SIGTERM, a write at the detached path, then the last open file closed");
    assert_eq!(
        fs::read(&mp).expect("the mountpoint file someone wrote to must be kept"),
        b"a program's bytes"
    );
    assert!(
        st.stderr.contains("kept ") && st.stderr.contains("17 bytes were written"),
        "the daemon says why it kept the file: {}",
        st.stderr
    );
    assert!(
        read_all(&img).iter().all(|b| *b == 0),
        "the bytes at the path went to the file, not to the image"
    );
}

/// A second stop signal aborts the files still open: the daemon answers what it took, exits 0 and
/// says what the applications see; their next write fails.
#[test]
fn a_second_signal_aborts_the_open_files() {
    if !require_fuse() {
        return;
    }
    let (_w, img, m) = mounted_export("stop-twice", &["--writable"]);
    let mut holder = Holder::open(m.path(), "before-the-abort");
    assert!(holder.write(), "a write before the stop failed");
    m.stop_signals_twice();
    let st = m.wait_exit();
    st.assert_clean("two SIGTERMs with a file open");
    assert!(
        st.stderr
            .contains("SIGTERM again: aborting the export with 1 file still open")
            && st.stderr.contains("ENOTCONN"),
        "the abort says what the applications see: {}",
        st.stderr
    );
    assert!(st.flag(&["exit_flush"]), "stats: {}", st.stats());
    assert!(!holder.write(), "a write after the abort succeeded");
    holder.close();
    assert_eq!(&read_all(&img)[..16], b"before-the-abort");
}

/// `--stop-timeout` bounds how long a stop serves files still open: then it aborts them by itself.
#[test]
fn stop_timeout_aborts_the_open_files() {
    if !require_fuse() {
        return;
    }
    let (_w, _img, m) = mounted_export("stop-timeout", &["--writable", "--stop-timeout", "1"]);
    let mut holder = Holder::open(m.path(), "x");
    m.signal(libc::SIGTERM);
    let st = m.wait_exit();
    st.assert_clean("SIGTERM with a file open and --stop-timeout 1");
    assert!(
        st.stderr
            .contains("--stop-timeout (1 s) passed: aborting the export"),
        "{}",
        st.stderr
    );
    assert!(!holder.write(), "a write after the abort succeeded");
    holder.close();
}

/// `--stop-timeout 0`: no grace, the stop aborts the open files at once (the stop as it was
/// before), and says so.
#[test]
fn stop_timeout_0_aborts_at_once() {
    if !require_fuse() {
        return;
    }
    let (_w, _img, m) = mounted_export("stop-timeout-0", &["--writable", "--stop-timeout", "0"]);
    let mut holder = Holder::open(m.path(), "x");
    m.signal(libc::SIGTERM);
    let st = m.wait_exit();
    st.assert_clean("SIGTERM with a file open and --stop-timeout 0");
    assert!(
        st.stderr
            .contains("SIGTERM with --stop-timeout 0: aborting the export with 1 file still open"),
        "{}",
        st.stderr
    );
    assert!(!holder.write(), "a write after the abort succeeded");
    holder.close();
}

/// The case that broke users: ext4 loop-mounted on the export, then Ctrl-C. The filesystem keeps
/// working after the signal (a file written and synced then is in the image), and the daemon
/// exits 0 once the filesystem is unmounted and the loop device detached.
#[test]
fn stop_with_ext4_loop_mounted_on_the_export() {
    if !require_fuse_and_tools(&["mkfs.ext4", "e2fsck", "losetup", "mount", "umount", "sync"]) {
        return;
    }
    let w = WorkDir::new("stop-ext4");
    let img = w.join("disk.img");
    sparse_image(&img, 64 * MIB);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &["--writable"]);
    run_ok(Command::new("mkfs.ext4").arg("-q").arg("-F").arg(&mp));
    let lo = LoopDev::attach(&mp, false);
    let dir = w.join("fs");
    fs::create_dir(&dir).unwrap();
    let fsm = FsMount::mount(&lo.dev, &dir, &[]);
    fs::write(dir.join("before"), b"written before the signal").unwrap();
    run_ok(&mut Command::new("sync"));

    m.signal(libc::SIGINT);
    assert!(
        m.wait_for_log(STILL_OPEN, Instant::now() + TIMEOUT),
        "SIGINT under a mounted ext4: the daemon did not say it serves on; stderr:\n{}",
        m.stderr()
    );
    let after = Rng::new(5).bytes(3 * MIB as usize + 5);
    fs::write(dir.join("after"), &after).expect("write to ext4 after the signal");
    fs::File::open(dir.join("after"))
        .unwrap()
        .sync_all()
        .expect("fsync on ext4 after the signal");
    run_ok(&mut Command::new("sync"));
    assert!(
        pid_alive(m.pid()),
        "the daemon exited under a mounted filesystem; stderr:\n{}",
        m.stderr()
    );
    fsm.unmount();
    lo.detach();
    let st = m.wait_exit();
    st.assert_clean("SIGINT, then ext4 unmounted and the loop device detached");
    assert!(st.flag(&["exit_flush"]), "stats: {}", st.stats());

    let fsck = run(Command::new("e2fsck").arg("-fn").arg(&img));
    assert!(
        fsck.status.success(),
        "e2fsck -fn on the image: {}\n{}",
        fsck.status,
        String::from_utf8_lossy(&fsck.stdout)
    );
    let direct = w.join("direct");
    fs::create_dir(&direct).unwrap();
    let d = FsMount::mount(&img, &direct, &["ro", "loop"]);
    assert_eq!(
        fs::read(direct.join("before")).unwrap(),
        b"written before the signal"
    );
    assert_bytes_eq(
        &fs::read(direct.join("after")).unwrap(),
        &after,
        0,
        "file written after the signal, read from the image",
    );
    d.unmount();
}
