//! Bad invocations: exit code 1, exactly one line "fusex: error: <what>: <what to do>" on
//! stderr (at default verbosity), nothing on stdout, nothing mounted, no mountpoint file
//! left behind.

use std::ffi::{OsStr, OsString};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use fusex_e2e::*;

/// Runs `fusex mount <args> IMAGE MOUNTPOINT`, asserts the rejection contract and returns
/// the result for further checks.
#[track_caller]
fn expect_rejected(w: &WorkDir, what: &str, args: &[&str], image: &OsStr, mp: &Path) -> CmdResult {
    let existed = mp.exists();
    let before = fuse_mounts_at(mp).len();
    let mut argv: Vec<OsString> = vec!["mount".into()];
    argv.extend(args.iter().map(OsString::from));
    argv.push(image.to_os_string());
    argv.push(mp.as_os_str().to_os_string());
    let r = run_fusex(w, &argv, Some(mp));
    eprintln!("{what}: fusex said: {}", r.stderr.trim_end());
    r.assert_one_error_line(what);
    assert_eq!(
        fuse_mounts_at(mp).len(),
        before,
        "{what}: mount count on the mountpoint changed"
    );
    if !existed {
        assert!(
            !mp.exists(),
            "{what}: fusex left a mountpoint file behind at {}",
            mp.display()
        );
    }
    r
}

fn image(w: &WorkDir) -> std::path::PathBuf {
    let img = w.join("disk.img");
    random_image(&img, MIB, 1);
    img
}

#[test]
fn image_missing() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("bad-missing");
    let r = expect_rejected(
        &w,
        "missing image",
        &[],
        w.join("nope.img").as_os_str(),
        &w.join("export"),
    );
    assert!(
        r.stderr.contains("nope.img"),
        "the error should name the image: {}",
        r.stderr
    );
}

#[test]
fn image_is_a_directory() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("bad-imgdir");
    let dir = w.join("imgdir");
    fs::create_dir(&dir).unwrap();
    expect_rejected(
        &w,
        "directory as image",
        &[],
        dir.as_os_str(),
        &w.join("export"),
    );
    expect_rejected(
        &w,
        "directory as writable image",
        &["--writable"],
        dir.as_os_str(),
        &w.join("export"),
    );
}

#[test]
fn image_in_missing_directory() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("bad-imgparent");
    expect_rejected(
        &w,
        "image in a missing dir",
        &[],
        w.join("no/such/dir/disk.img").as_os_str(),
        &w.join("export"),
    );
}

/// --writable on an image that can only be opened read-only (immutable file). The same
/// image mounts fine without --writable, so the failure is about write access.
#[test]
fn writable_on_immutable_image() {
    if !require_fuse_and_tools(&["chattr"]) {
        return;
    }
    let w = WorkDir::new("bad-immutable");
    let img = image(&w);
    let Some(_imm) = Immutable::set(&img) else {
        eprintln!("chattr +i unsupported here; covered by writable_on_read_only_bind_mount");
        return;
    };
    assert!(
        fs::OpenOptions::new().write(true).open(&img).is_err(),
        "chattr +i did not take effect"
    );
    expect_rejected(
        &w,
        "--writable on an immutable image",
        &["--writable"],
        img.as_os_str(),
        &w.join("export"),
    );
    let m = Mount::start(&w, &img, &w.join("export"), &[]);
    m.stop()
        .assert_clean("read-only export of an immutable image");
}

/// --writable on an image on a read-only bind mount.
#[test]
fn writable_on_read_only_bind_mount() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("bad-robind");
    let src = w.join("src");
    let ro = w.join("ro");
    fs::create_dir(&src).unwrap();
    fs::create_dir(&ro).unwrap();
    random_image(&src.join("disk.img"), MIB, 2);
    let bind = ReadOnlyBind::new(&src, &ro);
    let img = bind.target().join("disk.img");
    assert!(
        fs::OpenOptions::new().write(true).open(&img).is_err(),
        "bind mount is not read-only"
    );
    expect_rejected(
        &w,
        "--writable on a read-only filesystem",
        &["--writable"],
        img.as_os_str(),
        &w.join("export"),
    );
    let m = Mount::start(&w, &img, &w.join("export"), &[]);
    m.stop()
        .assert_clean("read-only export from a read-only filesystem");
}

/// A directory export mounted below its own source would contain itself: its queue threads
/// would wait on their own requests (a `find` hung the export for good). Refused in one line;
/// mounting over the source itself still works.
#[test]
fn directory_export_inside_its_own_source() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("bad-dir-inside");
    let src = w.join("src");
    fs::create_dir_all(src.join("inner")).unwrap();
    fs::write(src.join("file"), b"source bytes").unwrap();
    let r = expect_rejected(
        &w,
        "mountpoint inside the source",
        &[],
        src.as_os_str(),
        &src.join("inner"),
    );
    assert!(r.stderr.contains("lies inside SRC_DIR"), "{}", r.stderr);
    let m = Mount::start(&w, &src, &src, &[]);
    assert_eq!(fs::read(src.join("file")).unwrap(), b"source bytes");
    assert!(
        fs::read_dir(src.join("inner")).unwrap().next().is_none(),
        "the export over its own source lists the source's empty directory"
    );
    m.stop()
        .assert_clean("a directory export over its own source");
}

#[test]
fn mountpoint_is_a_directory() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("bad-mpdir");
    let img = image(&w);
    let dir = w.join("mnt");
    fs::create_dir(&dir).unwrap();
    expect_rejected(&w, "directory as mountpoint", &[], img.as_os_str(), &dir);
    assert!(dir.is_dir(), "the directory must be left alone");
    assert!(
        mounts_at(&dir).is_empty(),
        "something is mounted on the directory"
    );
}

#[test]
fn mountpoint_parent_missing() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("bad-mpparent");
    let img = image(&w);
    expect_rejected(
        &w,
        "mountpoint in a missing dir",
        &[],
        img.as_os_str(),
        &w.join("no/such/dir/export"),
    );
    assert!(
        !w.join("no").exists(),
        "fusex must not create parent directories"
    );
}

#[test]
fn mountpoint_already_a_fuse_mount() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("bad-stacked");
    let img = image(&w);
    let model = read_all(&img);
    let img2 = w.join("disk2.img");
    random_image(&img2, 2 * MIB, 3);
    let mp = w.join("export");
    let m = Mount::start(&w, &img, &mp, &[]);
    expect_rejected(
        &w,
        "mountpoint already a FUSE mount",
        &[],
        img2.as_os_str(),
        &mp,
    );
    assert_eq!(
        fuse_mounts_at(&mp).len(),
        1,
        "exactly the first mount must remain"
    );
    assert_bytes_eq(
        &read_all(&mp),
        &model,
        0,
        "first export still serves its image",
    );
    let st = m.stop();
    st.assert_clean("first mount after a rejected second one");
    assert!(!mp.exists());
}

#[test]
fn null_bad_sizes() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("bad-null");
    for spec in ["null:", "null:abc", "null:0", "null:12Q", "null:-1"] {
        expect_rejected(
            &w,
            &format!("image {spec:?}"),
            &[],
            OsStr::new(spec),
            &w.join("export"),
        );
    }
}

/// Not permitted to mount: run as nobody, on a world-readable image, with a pre-existing
/// root-owned 0644 mountpoint (so neither mount(2) nor fusermount3 may mount it).
#[test]
fn not_permitted_to_mount() {
    if !require_fuse_and_tools(&["setpriv", "cp"]) {
        return;
    }
    let w = WorkDir::new("bad-nobody");
    let img = image(&w);
    fs::set_permissions(&img, fs::Permissions::from_mode(0o644)).unwrap();
    // A copy of the binary inside our 0755 temp dir, so nobody can surely execute it. `cp` makes
    // it, not this process: a file this process held open for writing (fs::copy does) would leak
    // into every child other test threads fork meanwhile, until that child's exec closes it, and
    // exec of a file some process has open for writing fails with ETXTBSY. A child's fds are its
    // own, so once `cp` has exited nothing has the copy open for writing; chmod needs no fd.
    let bin = w.join("fusex");
    run_ok(Command::new("cp").arg(fusex_bin()).arg(&bin));
    fs::set_permissions(&bin, fs::Permissions::from_mode(0o755)).unwrap();
    let mp = w.join("export");
    fs::write(&mp, b"root's file").unwrap();
    fs::set_permissions(&mp, fs::Permissions::from_mode(0o644)).unwrap();

    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(&bin)
        .arg("mount")
        .arg(&img)
        .arg(&mp);
    let r = run_with_timeout(&w, cmd, Some(&mp));
    eprintln!("as nobody: fusex said: {}", r.stderr.trim_end());
    r.assert_one_error_line("mount as an unprivileged user on a root-owned file");
    assert!(!is_fuse_mounted(&mp));
    assert_eq!(
        fs::read(&mp).unwrap(),
        b"root's file",
        "mountpoint file must be untouched"
    );
}

/// /dev/fuse missing: inside a private mount namespace with an empty tmpfs over /dev.
#[test]
fn dev_fuse_missing() {
    if !require_fuse_and_tools(&["unshare"]) {
        return;
    }
    let w = WorkDir::new("bad-nodevfuse");
    let img = image(&w);
    let mp = w.join("export");
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(r#"mount -t tmpfs none /dev && exec "$0" mount "$1" "$2""#)
        .arg(fusex_bin())
        .arg(&img)
        .arg(&mp);
    let r = run_with_timeout(&w, cmd, Some(&mp));
    eprintln!("without /dev/fuse: fusex said: {}", r.stderr.trim_end());
    r.assert_one_error_line("/dev/fuse missing");
    assert!(
        r.stderr.contains("/dev/fuse"),
        "the error should mention /dev/fuse: {}",
        r.stderr
    );
    assert!(!is_fuse_mounted(&mp));
    assert!(!mp.exists(), "fusex left a mountpoint file behind");
}

/// An error caused by the OS names the OS error once: the message carries it, and it is not also
/// chained as a cause (which printed `…: Read-only file system (os error 30): Read-only file
/// system (os error 30)`). Here: the mountpoint would have to be created on a read-only
/// filesystem.
#[test]
fn os_error_is_printed_once() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("bad-oserr-once");
    let img = image(&w);
    let src = w.join("src");
    let ro = w.join("ro");
    fs::create_dir(&src).unwrap();
    fs::create_dir(&ro).unwrap();
    let bind = ReadOnlyBind::new(&src, &ro);
    let mp = bind.target().join("export");
    let r = expect_rejected(
        &w,
        "mountpoint on a read-only filesystem",
        &[],
        img.as_os_str(),
        &mp,
    );
    // "Read-only file system (os error 30)", as Rust prints an io::Error.
    let text = std::io::Error::from_raw_os_error(libc::EROFS).to_string();
    let (words, _) = text.split_once(" (os error").unwrap();
    assert_eq!(
        r.stderr.matches(text.as_str()).count(),
        1,
        "the OS error {text:?} must appear exactly once: {}",
        r.stderr
    );
    assert_eq!(
        r.stderr.matches(words).count(),
        1,
        "{words:?} must appear exactly once: {}",
        r.stderr
    );
    assert!(
        r.stderr.contains("export"),
        "names the mountpoint: {}",
        r.stderr
    );
}

/// `--pid-file` is the daemon's while it serves: a second daemon given the same pid file refuses
/// in one line naming the holder, mounts nothing, and the file keeps the first daemon's pid. (It
/// used to overwrite the file and start.)
#[test]
fn pid_file_held_by_a_running_daemon() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("bad-pidfile");
    let img = image(&w);
    let pid_file = w.join("fusex.pid");
    let pf = pid_file.to_str().unwrap();
    let m = Mount::start(&w, &img, &w.join("first"), &["--pid-file", pf]);
    let first = fs::read_to_string(&pid_file).unwrap();
    assert_eq!(first.trim(), m.pid().to_string());
    let r = expect_rejected(
        &w,
        "a pid file a running daemon holds",
        &["--pid-file", pf],
        img.as_os_str(),
        &w.join("second"),
    );
    assert!(
        r.stderr
            .contains(&format!("is held by fusex process {}", m.pid())),
        "the error names the daemon holding the pid file: {}",
        r.stderr
    );
    assert_eq!(fs::read_to_string(&pid_file).unwrap(), first);
    m.stop().assert_clean("the first daemon");
    assert!(!pid_file.exists(), "the first daemon removes its pid file");
}

/// Files fusex writes at exit are checked before mounting: a missing directory, or a FIFO (whose
/// open would block the daemon's exit forever) or a symlink at the name, is refused in one line
/// with nothing mounted.
#[test]
fn stats_and_pid_files_that_cannot_be_written_safely() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("bad-statsfile");
    let img = image(&w);
    let victim = w.join("victim");
    fs::write(&victim, b"precious").unwrap();
    fs::set_permissions(&victim, fs::Permissions::from_mode(0o600)).unwrap();
    let fifo = w.join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);
    let link = w.join("link");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let missing = w.join("no-such-dir/stats.json");
    for (opt, path, says) in [
        ("--stats-file", &missing, "does not exist"),
        ("--stats-file", &fifo, "is a FIFO"),
        ("--stats-file", &link, "is a symlink"),
        ("--pid-file", &missing, "does not exist"),
        ("--pid-file", &fifo, "is a FIFO"),
        ("--pid-file", &link, "is a symlink"),
    ] {
        let what = format!("{opt} {}", path.display());
        let r = expect_rejected(
            &w,
            &what,
            &[opt, path.to_str().unwrap()],
            img.as_os_str(),
            &w.join("export"),
        );
        assert!(r.stderr.contains(says), "{what}: {}", r.stderr);
    }
    assert_eq!(fs::read(&victim).unwrap(), b"precious");
}

/// `--queues` and `--queue-depth` far beyond the memory budget (here 34 GiB of request buffers,
/// which the daemon used to allocate and touch) are refused before mounting, saying how far over
/// it is and what to pass instead; what it says to pass mounts.
#[test]
fn queues_and_depth_far_over_the_memory_budget() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("bad-budget");
    let mp = w.join("export");
    let args = [
        "--transport",
        "legacy",
        "--queues",
        "256",
        "--queue-depth",
        "1024",
    ];
    let r = expect_rejected(
        &w,
        "256 queues x depth 1024",
        &args,
        OsStr::new("null:1G"),
        &mp,
    );
    assert!(
        r.stderr.contains("need 34816 MiB of request buffers")
            && r.stderr.contains("the memory budget of")
            && r.stderr.contains("--memory-budget 34816M"),
        "says how far over and what to pass: {}",
        r.stderr
    );
    // The smaller depth it suggests fits.
    let depth = r
        .stderr
        .split("--queue-depth ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .expect("a --queue-depth to pass")
        .to_string();
    let m = Mount::start(
        &w,
        "null:1G",
        &mp,
        &[
            "--transport",
            "legacy",
            "--queues",
            "256",
            "--queue-depth",
            &depth,
        ],
    );
    m.stop().assert_clean("the suggested queue depth");
}

/// Command-line errors are refusals like any other: one line `fusex: error: what: run ... --help`,
/// exit 1, nothing mounted (clap printed the error, a tip and the usage over several lines and
/// exited 2). `--help` and `--version` still print to stdout and exit 0.
#[test]
fn argument_errors_are_one_line() {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new("bad-args");
    let img = image(&w);
    let mp = w.join("export");
    let (i, m) = (img.to_str().unwrap(), mp.to_str().unwrap());
    for (argv, says) in [
        (
            vec!["mount", "--no-such-option", i, m],
            "unexpected argument '--no-such-option'",
        ),
        (
            vec!["mount", i],
            "required arguments were not provided: <MOUNTPOINT>",
        ),
        (
            vec!["mount", "--queues", "300", i, m],
            "invalid value '300' for '--queues",
        ),
        (
            // A name no format will take (the list of possible values grows with the formats).
            vec!["mount", "--format", "qcow3", i, m],
            "invalid value 'qcow3' for '--format <FORMAT>' [possible values: auto, raw, qcow2",
        ),
        (vec!["mount", i, m, "extra"], "unexpected argument 'extra'"),
        (
            vec!["no-such-command"],
            "unrecognized subcommand 'no-such-command'",
        ),
        (vec!["-v"], "no command given"),
    ] {
        let what = format!("fusex {}", argv.join(" "));
        let r = run_fusex(&w, &argv, Some(&mp));
        r.assert_one_error_line(&what);
        assert!(r.stderr.contains(says), "{what}: {}", r.stderr);
        assert!(
            r.stderr.trim_end().ends_with("--help"),
            "{what}: {}",
            r.stderr
        );
        assert!(!mp.exists(), "{what}: a mountpoint file was left behind");
    }
    for argv in [vec!["--help"], vec!["mount", "--help"], vec!["--version"]] {
        let r = run_fusex(&w, &argv, None);
        assert_eq!(r.code, Some(0), "fusex {argv:?}: {}", r.stderr);
        assert!(
            r.stdout.contains("fusex") || r.stdout.contains("Usage"),
            "{argv:?}"
        );
        assert!(r.stderr.is_empty(), "fusex {argv:?}: {}", r.stderr);
    }
}

/// `--daemonize` with nowhere to keep the log (no `--log-file`, no syslog at /dev/log, stderr a
/// pipe, as under `$(...)` or a program collecting the output) is refused in one line with nothing
/// mounted: every line after the start, the stop's included, used to be thrown away. (Where
/// /dev/log exists the log goes to syslog instead, and this case cannot be refused.)
#[test]
fn daemonize_without_a_kept_log_destination() {
    if !require_fuse() {
        return;
    }
    if Path::new("/dev/log").exists() {
        eprintln!("/dev/log exists: a daemon logs to syslog there; nothing to refuse");
        return;
    }
    let w = WorkDir::new("bad-daemon-log");
    let img = image(&w);
    let mp = w.join("export");
    let out = Command::new(fusex_bin())
        .arg("mount")
        .arg("--daemonize")
        .arg(&img)
        .arg(&mp)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run fusex");
    let mounted = is_fuse_mounted(&mp);
    if mounted {
        run(Command::new(fusex_bin()).arg("umount").arg(&mp));
    }
    let r = CmdResult {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    r.assert_one_error_line("--daemonize with stderr a pipe and no syslog");
    assert!(!mounted, "it mounted");
    assert!(
        r.stderr.contains("--log-file PATH"),
        "says what to give: {}",
        r.stderr
    );
    assert!(!mp.exists(), "a mountpoint file was left behind");
}
