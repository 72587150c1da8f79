//! Directory exports in `fusex serve`: one from the config file and one added over QMP
//! (`block-export-add` of type `__org.fusex_dir`) beside an image export; files written through
//! each land in its source (the oracle: the source's own bytes), removal (safe and hard)
//! unmounts and leaves the source as it was, `query-block-exports`, `fusex ctl list`, `fusex
//! list` and the statistics show them, image-only options are refused in one line, and `fusex
//! restart` hands a directory export of `fusex mount` and of `fusex serve` (node ids, open
//! handles and all) to a new daemon. Run once per transport (`FUSEX_E2E_TRANSPORT=legacy|uring`).

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use fusex_e2e::*;
use serde_json::{json, Value};

/// The transport every export of these tests asks for.
fn transport() -> String {
    std::env::var("FUSEX_E2E_TRANSPORT")
        .ok()
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| "auto".into())
}

/// A directory at `path`, searchable by anyone whatever the umask.
fn dir(path: &Path) -> PathBuf {
    fs::create_dir_all(path).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
    path.to_path_buf()
}

/// Every entry under `root`: its relative path, and its bytes (files), target (symlinks) or
/// nothing (directories).
fn tree(root: &Path) -> BTreeMap<PathBuf, (char, Vec<u8>)> {
    let mut out = BTreeMap::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().to_path_buf();
            let m = fs::symlink_metadata(&p).unwrap();
            let v = if m.is_symlink() {
                (
                    'l',
                    fs::read_link(&p)
                        .unwrap()
                        .into_os_string()
                        .into_encoded_bytes(),
                )
            } else if m.is_dir() {
                todo.push(p.clone());
                ('d', Vec::new())
            } else {
                ('f', fs::read(&p).unwrap())
            };
            out.insert(rel, v);
        }
    }
    out
}

/// Writes files of several sizes (and a directory, a symlink, a rename) through the mount
/// `mnt`, then checks each against the source `src`, byte for byte; returns what was written.
fn write_through(mnt: &Path, src: &Path, seed: u64) -> Vec<(PathBuf, Vec<u8>)> {
    let mut rng = Rng::new(seed);
    fs::create_dir(mnt.join("sub")).unwrap();
    let mut written = Vec::new();
    for (i, size) in [0usize, 1, 4096, 70_001, 1 << 20].iter().enumerate() {
        let rel = PathBuf::from(format!("sub/f{i}"));
        let data = rng.bytes(*size);
        fs::write(mnt.join(&rel), &data).unwrap();
        written.push((rel, data));
    }
    fs::rename(mnt.join("sub/f1"), mnt.join("sub/renamed")).unwrap();
    written[1].0 = PathBuf::from("sub/renamed");
    std::os::unix::fs::symlink("f0", mnt.join("sub/link")).unwrap();
    for (rel, data) in &written {
        assert_bytes_eq(
            &read_all(&src.join(rel)),
            data,
            0,
            &rel.display().to_string(),
        );
        assert_bytes_eq(
            &read_all(&mnt.join(rel)),
            data,
            0,
            "read back through the mount",
        );
    }
    assert!(!src.join("sub/f1").exists());
    assert_eq!(
        fs::read_link(src.join("sub/link")).unwrap(),
        Path::new("f0")
    );
    written
}

/// The row of `rows` (a JSON array) whose `key` is `value`.
fn row<'a>(rows: &'a Value, key: &str, value: &str) -> &'a Value {
    rows.as_array()
        .unwrap()
        .iter()
        .find(|r| r[key] == value)
        .unwrap_or_else(|| panic!("no row with {key} = {value}: {rows}"))
}

fn canonical(p: &Path) -> String {
    fs::canonicalize(p).unwrap().to_string_lossy().into_owned()
}

/// A config export and a QMP one of directories, beside an image export: bytes land in the
/// sources, every listing shows them, and removing them (safe, hard) unmounts them and leaves
/// the sources as they were, while the image export serves on.
#[test]
fn directory_exports_beside_an_image_export() {
    if !require_fuse() {
        return;
    }
    let t = transport();
    let w = WorkDir::new("serve-dirs");
    let (src1, src2) = (dir(&w.join("src1")), dir(&w.join("src2")));
    let (m1, m2) = (dir(&w.join("m1")), dir(&w.join("m2")));
    let old = Rng::new(5).bytes(123_457);
    fs::write(src1.join("old"), &old).unwrap();
    let image = random_image(&w.join("a.img"), MIB, 7);
    fs::write(w.join("a.raw"), b"").unwrap();
    let config = w.join("exports.toml");
    fs::write(
        &config,
        format!(
            "[[export]]\nid = \"cfg\"\nimage = \"src1\"\nmountpoint = \"m1\"\nwritable = true\n\
             transport = \"{t}\"\nqueues = 2\ncache = \"never\"\n"
        ),
    )
    .unwrap();
    let serve = Serve::start(w.path(), &["--config", config.to_str().unwrap()]);
    let mut q = serve.qmp();
    q.add_raw_export(
        "img",
        &w.join("a.img"),
        &w.join("a.raw"),
        json!({"__org.fusex_transport": t}),
    );
    q.ok(
        "block-export-add",
        json!({"type": "__org.fusex_dir", "id": "q", "source": src2, "mountpoint": m2,
               "writable": true, "__org.fusex_transport": t,
               "__org.fusex_passthrough": "off"}),
    );
    assert!(is_fuse_mounted(&m1) && is_fuse_mounted(&m2));
    // What was there shows through; what is written lands in the source.
    assert_bytes_eq(&read_all(&m1.join("old")), &old, 0, "a file of the source");
    write_through(&m1, &src1, 1);
    write_through(&m2, &src2, 2);
    let data = Rng::new(3).bytes(65_536);
    {
        use std::os::unix::fs::FileExt;
        open_rw(&w.join("a.raw")).write_all_at(&data, 4096).unwrap();
    }
    let mut want = image.clone();
    want[4096..4096 + data.len()].copy_from_slice(&data);
    assert_bytes_eq(&read_all(&w.join("a.raw")), &want, 0, "the image export");

    // query-block-exports: the directory exports with their type and source.
    let exports = q.ok("query-block-exports", json!({}));
    let e = row(&exports, "id", "q");
    assert_eq!(e["type"], "__org.fusex_dir", "{e}");
    assert_eq!(e["__org.fusex_source"], src2.to_str().unwrap(), "{e}");
    assert_eq!(e["shutting-down"], false, "{e}");
    assert_eq!(row(&exports, "id", "cfg")["type"], "__org.fusex_dir");
    assert_eq!(row(&exports, "id", "img")["type"], "fuse");
    // fusex ctl list: each with its source, as a directory.
    let ctl = |args: &[&str]| {
        let mut cmd = Command::new(fusex_bin());
        cmd.arg("ctl")
            .arg("--control")
            .arg(&serve.socket)
            .args(args);
        run(&mut cmd)
    };
    let out = ctl(&["list", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    for (id, src, m) in [("cfg", &src1, &m1), ("q", &src2, &m2)] {
        let r = row(&list, "id", id);
        assert_eq!(r["format"], "directory", "{r}");
        assert_eq!(r["image"], canonical(src), "{r}");
        assert_eq!(r["mountpoint"], m.to_str().unwrap(), "{r}");
        assert_eq!(r["writable"], true, "{r}");
        assert_eq!(r["state"], "serving", "{r}");
    }
    assert_eq!(row(&list, "id", "cfg")["queues"], 2);
    let shown = String::from_utf8_lossy(&ctl(&["show", "q"]).stdout).into_owned();
    assert!(shown.contains("directory"), "{shown}");
    // fusex list: live, with the source directory, served by this daemon.
    let all = run(Command::new(fusex_bin()).args(["list", "--json"]));
    let all: Value = serde_json::from_slice(&all.stdout).unwrap();
    for (src, m) in [(&src1, &m1), (&src2, &m2)] {
        let r = row(&all, "mountpoint", m.to_str().unwrap());
        assert_eq!(r["state"], "serving", "{r}");
        assert_eq!(r["image"], canonical(src), "{r}");
        assert_eq!(r["format"], "directory", "{r}");
        assert_eq!(r["pid"], serve.pid(), "{r}");
    }
    // The statistics count the requests each directory export served.
    let stats = q.ok("__org.fusex_query-stats", json!({"id": "q"}));
    let s = &stats["exports"][0];
    assert_eq!(s["id"], "q");
    assert!(s["requests"].as_u64().unwrap() > 0, "{s}");

    // Removal: safe for q, hard for cfg; each unmounts, its source unchanged.
    for (id, mode, src, m) in [("q", "safe", &src2, &m2), ("cfg", "hard", &src1, &m1)] {
        let before = tree(src);
        q.ok("block-export-del", json!({"id": id, "mode": mode}));
        q.event("BLOCK_EXPORT_DELETED", id, TIMEOUT);
        assert!(!is_fuse_mounted(m), "{id} still mounted");
        assert_eq!(tree(src), before, "{id}'s source changed on removal");
        let gone = q.ok("query-block-exports", json!({}));
        assert!(
            gone.as_array().unwrap().iter().all(|e| e["id"] != id),
            "{gone}"
        );
    }
    assert!(
        !q.pending_events()
            .iter()
            .any(|e| e["event"] == "__org.fusex_BLOCK_EXPORT_FAILED"),
        "{:?}",
        q.pending_events()
    );
    // The image export served on throughout.
    assert_bytes_eq(&read_all(&w.join("a.raw")), &want, 0, "the image after");
    q.ok("block-export-del", json!({"id": "img"}));
    q.event("BLOCK_EXPORT_DELETED", "img", TIMEOUT);
}

/// Image-only options on a directory export are refused in one line (over QMP, in the config
/// file, and by `fusex mount`), and nothing is mounted.
/// Every export of a daemon runs on the same worker threads, so a directory export that reaches
/// another export's mount through its source would wait on its own threads (`ls -l` hung them
/// for good). Refused either way round, in one error naming the other export; the daemon and
/// the export already there serve on, and an export mounted beside the source is fine.
#[test]
fn exports_nested_in_a_directory_exports_source_are_refused() {
    if !require_fuse() {
        return;
    }
    let t = transport();
    let w = WorkDir::new("serve-dir-nested");
    let src = w.join("src");
    fs::create_dir(&src).unwrap();
    fs::write(src.join("old"), b"old bytes").unwrap();
    let view = w.join("view");
    fs::create_dir(&view).unwrap();
    let serve = Serve::start(w.path(), &[]);
    let mut q = serve.qmp();
    let dir_export = |id: &str| {
        json!({"type": "__org.fusex_dir", "id": id, "source": src, "mountpoint": view,
               "__org.fusex_transport": t})
    };
    // An image export inside the source first, then the directory export.
    q.add_null_export(
        "img",
        &src.join("img.mnt"),
        json!({"__org.fusex_transport": t}),
    );
    let e = q.err("block-export-add", dir_export("d"));
    assert!(
        e.contains("holds the mountpoint") && e.contains("export 'img'"),
        "{e}"
    );
    assert!(
        !is_fuse_mounted(&view),
        "nothing mounted for the refused export"
    );
    q.remove_null_export("img", "safe");
    // The directory export first, then an image export inside its source.
    q.ok("block-export-add", dir_export("d"));
    q.ok(
        "blockdev-add",
        json!({"driver": "null-co", "node-name": "n-late", "size": 1 << 20}),
    );
    fs::write(src.join("late.mnt"), b"").unwrap();
    let e = q.err(
        "block-export-add",
        json!({"type": "fuse", "id": "late", "node-name": "n-late",
               "mountpoint": src.join("late.mnt"), "__org.fusex_transport": t}),
    );
    assert!(
        e.contains("lies inside") && e.contains("directory export 'd'"),
        "{e}"
    );
    // Beside the source is fine, and the directory export serves on.
    fs::write(w.join("beside.mnt"), b"").unwrap();
    q.ok(
        "block-export-add",
        json!({"type": "fuse", "id": "late", "node-name": "n-late",
               "mountpoint": w.join("beside.mnt"), "__org.fusex_transport": t}),
    );
    assert_eq!(fs::read(view.join("old")).unwrap(), b"old bytes");
    assert!(fs::read_dir(&view).unwrap().count() >= 2);
    q.ok("quit", json!({}));
}

#[test]
fn image_options_on_directories_are_refused() {
    if !require_fuse() {
        return;
    }
    let t = transport();
    let w = WorkDir::new("serve-dirs-refuse");
    let src = dir(&w.join("src"));
    let m = dir(&w.join("m"));
    fs::write(w.join("file"), b"x").unwrap();
    let serve = Serve::start(w.path(), &[]);
    let mut q = serve.qmp();
    let base = json!({"type": "__org.fusex_dir", "id": "d", "source": src, "mountpoint": m,
                      "__org.fusex_transport": t});
    let with = |k: &str, v: Value| {
        let mut a = base.clone();
        a[k] = v;
        a
    };
    for (args, want) in [
        (
            with("growable", json!(true)),
            "growable is for image exports",
        ),
        (
            with("writethrough", json!(true)),
            "writethrough is for image exports",
        ),
        (with("node-name", json!("n")), "has no block node"),
        (
            with("__org.fusex_format", json!("qcow2")),
            "--format is for image exports",
        ),
        (
            with("__org.fusex_partition", json!(1)),
            "--partition is for image exports",
        ),
        (
            with("__org.fusex_direct", json!(true)),
            "--direct is for image exports",
        ),
        (with("source", json!(w.join("file"))), "is not a directory"),
    ] {
        let e = q.err("block-export-add", args.clone());
        assert!(e.contains(want), "{args}: {e}");
        assert!(!e.contains('\n'), "{e}");
        assert!(!is_fuse_mounted(&m), "{args} mounted");
    }
    assert_eq!(q.ok("query-block-exports", json!({})), json!([]));
    drop(q);
    drop(serve);
    // The config file: the daemon refuses to start, in one line.
    let config = w.join("bad.toml");
    fs::write(
        &config,
        "[[export]]\nid = \"d\"\nimage = \"src\"\nmountpoint = \"m\"\ngrowable = true\n\
         writable = true\n",
    )
    .unwrap();
    let sock = w.join("other.sock");
    let r = run_fusex(
        &w,
        &[
            "serve".as_ref(),
            "--control".as_ref(),
            sock.as_os_str(),
            "--config".as_ref(),
            config.as_os_str(),
        ],
        Some(&m),
    );
    r.assert_one_error_line("a config directory export with growable");
    assert!(
        r.stderr.contains("--growable is for image exports"),
        "{}",
        r.stderr
    );
    // fusex mount, for the options it newly refuses.
    for opt in ["--writethrough", "--no-locking", "--direct"] {
        let r = run_fusex(
            &w,
            &[
                "mount".as_ref(),
                opt.as_ref(),
                src.as_os_str(),
                m.as_os_str(),
            ],
            Some(&m),
        );
        r.assert_one_error_line(opt);
        assert!(
            r.stderr.contains(&format!("{opt} is for image exports")),
            "{}",
            r.stderr
        );
    }
    assert!(!is_fuse_mounted(&m));
}

/// `fusex mount SRC_DIR` is listed live with its source; `fusex restart` hands it to a new
/// daemon (the node and handle tables with every descriptor they hold), which a file held open
/// across it keeps being served by, and `fusex list` shows; over io_uring the restart is
/// refused in one line and the export serves on.
#[test]
fn restart_hands_a_directory_export_over_and_list_shows_it_live() {
    if !require_fuse() {
        return;
    }
    use std::os::unix::fs::FileExt;
    let w = WorkDir::new("serve-dirs-restart");
    let src = dir(&w.join("src"));
    let m = dir(&w.join("m"));
    let data = Rng::new(9).bytes(10_000);
    fs::write(src.join("f"), &data).unwrap();
    let pid_file = w.join("dir.pid");
    let (mut mount, _) =
        Mount::start_daemonized(&w, &src, &m, &pid_file, &["--writable"]).expect("mounted");
    let all = run(Command::new(fusex_bin()).args(["list", "--json"]));
    let all: Value = serde_json::from_slice(&all.stdout).unwrap();
    let r = row(&all, "mountpoint", m.to_str().unwrap());
    assert_eq!(r["state"], "serving", "{r}");
    assert_eq!(r["image"], canonical(&src), "{r}");
    assert_eq!(r["format"], "directory", "{r}");
    assert_eq!(r["pid"], mount.pid(), "{r}");
    let uring = r["transport"] == "io_uring";
    let table =
        String::from_utf8_lossy(&run(Command::new(fusex_bin()).arg("list")).stdout).into_owned();
    let line = table
        .lines()
        .find(|l| l.starts_with(m.to_str().unwrap()))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(!line.contains("dead"), "{table}");
    assert!(line.contains(&canonical(&src)), "{table}");
    let held = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.join("f"))
        .unwrap();
    held.write_all_at(b"before", 0).unwrap();
    let old = mount.pid();
    let r = run_fusex(&w, &["restart".as_ref(), m.as_os_str()], None);
    if uring {
        r.assert_one_error_line("fusex restart of an io_uring directory export");
        assert!(r.stderr.contains("io_uring"), "{}", r.stderr);
    } else {
        assert_eq!(r.code, Some(0), "fusex restart failed: {}", r.stderr);
        let new = read_pid(&pid_file);
        assert!(new > 0 && new != old && pid_alive(new), "{new} (was {old})");
        mount.adopt_pid(new);
        assert!(
            wait_until(std::time::Instant::now() + TIMEOUT, || !pid_alive(old)),
            "the old daemon exits once it let go"
        );
        let all = run(Command::new(fusex_bin()).args(["list", "--json"]));
        let all: Value = serde_json::from_slice(&all.stdout).unwrap();
        let r = row(&all, "mountpoint", m.to_str().unwrap());
        assert_eq!(
            (&r["pid"], &r["format"]),
            (&new.into(), &"directory".into()),
            "{r}"
        );
    }
    held.write_all_at(b"after!", 6).unwrap();
    held.sync_all().unwrap();
    let mut back = [0u8; 12];
    held.read_exact_at(&mut back, 0).unwrap();
    assert_eq!(&back, b"beforeafter!");
    let mut want = data.clone();
    want[..12].copy_from_slice(b"beforeafter!");
    // A new open beside the one kept across (passthrough: the same backing file).
    assert_bytes_eq(
        &read_all(&m.join("f")),
        &want,
        0,
        "a new open, the old one kept",
    );
    drop(held);
    assert_bytes_eq(&read_all(&m.join("f")), &want, 0, "through the export");
    assert_bytes_eq(&fs::read(src.join("f")).unwrap(), &want, 0, "in the source");
    drop(mount);
    assert!(!is_fuse_mounted(&m));
    // Its files in the runtime directory went with it: no row for it any more.
    let all = run(Command::new(fusex_bin()).args(["list", "--json"]));
    let all: Value = serde_json::from_slice(&all.stdout).unwrap();
    assert!(
        all.as_array()
            .unwrap()
            .iter()
            .all(|r| r["mountpoint"] != m.to_str().unwrap()),
        "{all}"
    );
}

/// `fusex restart` of a `fusex serve` daemon hands its directory export over with the rest:
/// the node ids and open handles the kernel holds answer in the new daemon. A file held open
/// is written and read across the restart, a directory held open is listed and a name looked
/// up in it once the kernel's cached entries expired (a LOOKUP naming the held directory's node
/// id), files are created and removed, every handle is released in the new daemon, and the
/// source holds exactly what was written. Over the io_uring transport the restart is refused
/// and the export serves on.
#[test]
fn a_serve_daemon_hands_its_directory_export_over() {
    if !require_fuse() {
        return;
    }
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::os::unix::fs::FileExt;
    let w = WorkDir::new("serve-dirs-handover");
    let src = dir(&w.join("src"));
    let m = dir(&w.join("m"));
    dir(&src.join("d"));
    let data = Rng::new(11).bytes(100_000);
    fs::write(src.join("f"), &data).unwrap();
    fs::write(src.join("d/g"), b"g before").unwrap();
    // Enough nodes that their tables go in several messages (1000 entries, 250 descriptors
    // each).
    let many = dir(&src.join("many"));
    for i in 0..1500 {
        fs::write(many.join(format!("{i}")), i.to_string()).unwrap();
    }
    random_image(&w.join("a.img"), MIB, 3);
    fs::write(w.join("a.raw"), b"").unwrap();
    let pid_file = w.join("serve.pid");
    let mut serve = Serve::start(w.path(), &["--pidfile", pid_file.to_str().unwrap()]);
    let _guard = PidGuard(pid_file.clone(), w.path().to_path_buf());
    let mut q = serve.qmp();
    q.add_raw_export(
        "img",
        &w.join("a.img"),
        &w.join("a.raw"),
        json!({"__org.fusex_transport": "legacy"}),
    );
    let t = transport();
    q.ok(
        "block-export-add",
        json!({"type": "__org.fusex_dir", "id": "d", "source": src, "mountpoint": m,
               "writable": true, "__org.fusex_transport": t}),
    );
    let uring = is_fuse_mounted(&m) && t != "legacy" && {
        let list = run(Command::new(fusex_bin()).args(["list", "--json"]));
        let list: Value = serde_json::from_slice(&list.stdout).unwrap();
        row(&list, "mountpoint", m.to_str().unwrap())["transport"] == "io_uring"
    };
    // Held across the restart: a file open for writing, a directory open for listing.
    let mut held = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.join("f"))
        .unwrap();
    held.write_all_at(b"before", 0).unwrap();
    let held_dir = fs::File::open(m.join("d")).unwrap();
    fs::write(m.join("d/new"), b"made before").unwrap();
    // Looked up (the kernel keeps the nodes), their inode numbers noted.
    let inos: Vec<u64> = (0..1500)
        .map(|i| {
            use std::os::unix::fs::MetadataExt;
            fs::symlink_metadata(m.join(format!("many/{i}")))
                .unwrap()
                .ino()
        })
        .collect();
    if uring {
        let r = run_fusex(&w, &["restart".as_ref(), m.as_os_str()], None);
        r.assert_one_error_line("fusex restart of a daemon with an io_uring directory export");
        assert!(r.stderr.contains("io_uring"), "{}", r.stderr);
        assert_bytes_eq(&read_all(&m.join("d/new")), b"made before", 0, "served on");
        return;
    }
    drop(q);
    let new = serve.restart(&w, &m, &pid_file);
    // The held file: written and read through the handle the old daemon opened.
    held.write_all_at(b"after!", 6).unwrap();
    held.sync_all().unwrap();
    let mut back = vec![0; 12];
    held.read_exact_at(&mut back, 0).unwrap();
    assert_eq!(&back, b"beforeafter!");
    held.seek(SeekFrom::Start(100_000)).unwrap();
    held.write_all(b"appended").unwrap();
    // The held directory: its node id is the old daemon's; a LOOKUP in it once the kernel's
    // entries expired (--cache auto: 1 s) reaches the new daemon with that id.
    std::thread::sleep(std::time::Duration::from_millis(1200));
    let listed: std::collections::BTreeSet<String> = fs::read_dir(m.join("d"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(listed, ["g", "new"].map(String::from).into());
    let fd = {
        use std::os::fd::AsRawFd;
        // SAFETY: a NUL-terminated name and a live directory descriptor.
        unsafe { libc::openat(held_dir.as_raw_fd(), c"g".as_ptr(), libc::O_RDONLY) }
    };
    assert!(
        fd >= 0,
        "openat in the held directory: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: openat just returned this descriptor; nothing else owns it.
    let mut g = unsafe { <fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let mut text = String::new();
    g.read_to_string(&mut text).unwrap();
    assert_eq!(text, "g before");
    fs::write(m.join("d/after"), b"made after").unwrap();
    fs::remove_file(m.join("d/new")).unwrap();
    for (i, ino) in inos.iter().enumerate() {
        use std::os::unix::fs::MetadataExt;
        let p = m.join(format!("many/{i}"));
        assert_eq!(
            fs::symlink_metadata(&p).unwrap().ino(),
            *ino,
            "{}",
            p.display()
        );
        if i % 100 == 0 {
            assert_eq!(fs::read_to_string(&p).unwrap(), i.to_string());
        }
    }
    // Every handle the old daemon opened is released in the new one.
    drop((held, held_dir, g));
    // The new daemon knows the directory export's source: an export inside it is refused.
    let mut q = Qmp::connect(&serve.socket);
    q.ok(
        "blockdev-add",
        json!({"driver": "null-co", "node-name": "n-inside", "size": 1 << 20}),
    );
    fs::write(src.join("inside.mnt"), b"").unwrap();
    let e = q.err(
        "block-export-add",
        json!({"type": "fuse", "id": "inside", "node-name": "n-inside",
               "mountpoint": src.join("inside.mnt")}),
    );
    assert!(e.contains("directory export 'd'"), "{e}");
    q.ok("blockdev-del", json!({"node-name": "n-inside"}));
    fs::remove_file(src.join("inside.mnt")).unwrap();
    let ids = q.ok("query-block-exports", json!({}));
    assert_eq!(ids.as_array().unwrap().len(), 2, "{ids}");
    let list = run(Command::new(fusex_bin()).args(["list", "--json"]));
    let list: Value = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(
        row(&list, "mountpoint", m.to_str().unwrap())["pid"],
        new,
        "{list}"
    );
    assert!(
        wait_until(std::time::Instant::now() + TIMEOUT, || {
            let stats = Qmp::connect(&serve.socket).ok("query-block-exports", json!({}));
            stats.as_array().is_some_and(|a| !a.is_empty())
        }),
        "the new daemon answers"
    );
    let mut want = data.clone();
    want[..12].copy_from_slice(b"beforeafter!");
    want.extend_from_slice(b"appended");
    assert_bytes_eq(
        &fs::read(src.join("f")).unwrap(),
        &want,
        0,
        "the source file",
    );
    assert_eq!(fs::read(src.join("d/after")).unwrap(), b"made after");
    assert!(!src.join("d/new").exists());
    let mut q = Qmp::connect(&serve.socket);
    q.ok("quit", json!({}));
    assert!(
        wait_until(std::time::Instant::now() + TIMEOUT * 3, || !pid_alive(new)),
        "quit ends the new daemon"
    );
    assert!(!is_fuse_mounted(&m));
}
