//! What a packager relies on: `fusex --version`, the man pages and shell completions generated
//! from the command line definitions, and `make install PREFIX=...` putting them in place. None of
//! this mounts anything, so none of it needs root or /dev/fuse.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use fusex_e2e::*;

fn text(path: &Path) -> String {
    let bytes = fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(!bytes.is_empty(), "{} is empty", path.display());
    String::from_utf8(bytes).unwrap_or_else(|e| panic!("{}: not UTF-8: {e}", path.display()))
}

#[test]
fn version_names_the_version_and_the_kernel_features() {
    let out = run_ok(Command::new(fusex_bin()).arg("--version"));
    let s = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = s.lines().collect();
    assert_eq!(lines.len(), 5, "{s}");
    assert!(
        lines[0].starts_with("fusex ") && lines[0].contains('.'),
        "{s}"
    );
    assert!(
        lines[1].starts_with("FUSE protocol: fusex speaks 7."),
        "{s}"
    );
    assert!(lines[1].contains("negotiated at mount"), "{s}");
    // Whatever the machine offers, the io_uring line agrees with the kernel parameter.
    let param = fs::read_to_string("/sys/module/fuse/parameters/enable_uring").ok();
    let available = param.as_deref().map(str::trim) == Some("Y");
    assert_eq!(
        lines[2].starts_with("io_uring transport: available"),
        available,
        "{s} (enable_uring: {param:?})"
    );
    // The tests run as root: mount(2) itself.
    assert_eq!(lines[3], "mounting: mount(2) (CAP_SYS_ADMIN held)", "{s}");
    assert!(lines[4].starts_with("passthrough: "), "{s}");
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Without capabilities (a normal user's view): through fusermount3, or not at all.
    if which("setpriv").is_some() {
        let out = run_ok(
            Command::new("setpriv")
                .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
                .arg(fusex_bin())
                .arg("--version"),
        );
        let s = String::from_utf8(out.stdout).unwrap();
        let mounting = s.lines().nth(3).unwrap_or_default();
        assert_eq!(
            mounting.starts_with("mounting: through "),
            which("fusermount3").is_some(),
            "{s}"
        );
        assert!(s.contains("CAP_SYS_ADMIN not held"), "{s}");
    }
}

#[test]
fn man_pages_and_completions_are_generated_with_every_subcommand() {
    let w = WorkDir::new("install-gen");
    let man = w.join("man");
    run_ok(
        Command::new(fusex_bin())
            .arg("generate")
            .arg("man")
            .arg(&man),
    );
    let main = text(&man.join("fusex.1"));
    assert!(main.contains(".TH FUSEX 1"), "{main}");
    for sub in [
        "fusex\\-mount (1)",
        "fusex\\-umount (1)",
        "fusex\\-restart (1)",
    ] {
        assert!(main.contains(sub), "fusex.1 lacks {sub}:\n{main}");
    }
    assert!(
        !main.contains("auto\\-unmount\\-watcher"),
        "hidden subcommand in fusex.1"
    );
    let mount = text(&man.join("fusex-mount.1"));
    for opt in [
        "\\-\\-auto\\-unmount",
        "\\-\\-daemonize",
        "\\-\\-allow\\-other",
    ] {
        assert!(mount.contains(opt), "fusex-mount.1 lacks {opt}");
    }
    text(&man.join("fusex-umount.1"));
    text(&man.join("fusex-restart.1"));

    let comp = w.join("completions");
    for (shell, file) in [
        ("bash", "fusex.bash"),
        ("zsh", "_fusex"),
        ("fish", "fusex.fish"),
    ] {
        run_ok(
            Command::new(fusex_bin())
                .args(["generate", "completions", shell])
                .arg(&comp),
        );
        let script = text(&comp.join(file));
        for word in ["mount", "umount", "auto-unmount", "writable"] {
            assert!(script.contains(word), "{shell} completions lack {word}");
        }
    }
}

/// `make install PREFIX=prefix` of the binary under test; returns the repository's root.
fn make_install(prefix: &Path) -> PathBuf {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    run_ok(
        Command::new("make")
            .arg("-s")
            .arg("-C")
            .arg(&repo)
            .arg("install")
            .arg(format!("PREFIX={}", prefix.display()))
            .arg(format!("INSTALL_BIN={}", fusex_bin().display())),
    );
    repo
}

/// The section names of a 64-bit little-endian ELF file (what `readelf -S` lists).
fn elf_sections(b: &[u8]) -> Vec<String> {
    let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as usize;
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap()) as usize;
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap()) as usize;
    assert_eq!(&b[..5], b"\x7fELF\x02", "a 64-bit ELF file");
    let (shoff, shentsize, shnum, shstrndx) =
        (u64_at(0x28), u16_at(0x3a), u16_at(0x3c), u16_at(0x3e));
    let header = |i: usize| shoff + i * shentsize;
    let strtab = u64_at(header(shstrndx) + 0x18);
    (0..shnum)
        .map(|i| {
            let name = strtab + u32_at(header(i));
            let end = name + b[name..].iter().position(|&c| c == 0).unwrap();
            String::from_utf8_lossy(&b[name..end]).into_owned()
        })
        .collect()
}

#[test]
fn make_install_puts_binary_man_pages_and_completions_under_prefix() {
    if which("make").is_none() || which("install").is_none() {
        skip_or_fail("make and install (coreutils) are needed");
        return;
    }
    let w = WorkDir::new("install-prefix");
    let prefix = w.join("prefix");
    make_install(&prefix);
    let bin = prefix.join("bin/fusex");
    // Installed without its debug info (the section names go with it), symbols kept for
    // backtraces; the same program otherwise.
    let installed = fs::read(&bin).unwrap();
    let built = fs::read(fusex_bin()).unwrap();
    let has = |b: &[u8], name: &str| elf_sections(b).iter().any(|s| s == name);
    assert!(has(&built, ".debug_info"), "the build carries debug info");
    assert!(
        !has(&installed, ".debug_info"),
        "installed binary still has debug info"
    );
    assert!(
        installed.len() < built.len(),
        "installed binary not smaller"
    );
    assert!(
        has(&installed, ".symtab"),
        "installed binary lost its symbols"
    );
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        fs::metadata(&bin).unwrap().permissions().mode() & 0o777,
        0o755
    );
    for page in [
        "fusex.1",
        "fusex-mount.1",
        "fusex-umount.1",
        "fusex-restart.1",
    ] {
        assert!(text(&prefix.join("share/man/man1").join(page)).contains(".TH"));
    }
    for script in [
        "share/bash-completion/completions/fusex",
        "share/zsh/site-functions/_fusex",
        "share/fish/vendor_completions.d/fusex.fish",
    ] {
        assert!(text(&prefix.join(script)).contains("umount"), "{script}");
    }
    // The installed binary runs, and is the one built.
    let out = run_ok(Command::new(&bin).arg("--version"));
    let want = run_ok(Command::new(fusex_bin()).arg("--version"));
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("fusex "));
    assert_eq!(out.stdout, want.stdout);
}

/// `systemd-analyze verify` accepts `contrib/fusex@.service` and `contrib/fusex-serve.service`
/// without a warning, with its
/// `ExecStart` and `Documentation=man:fusex(1)` pointing at a `make install` prefix.
#[test]
fn systemd_unit_verifies_against_an_installed_prefix() {
    if which("systemd-analyze").is_none() || which("make").is_none() {
        skip_or_fail("systemd-analyze (systemd) and make are needed");
        return;
    }
    let w = WorkDir::new("install-unit");
    let prefix = w.join("prefix");
    let repo = make_install(&prefix);
    let unit = text(&repo.join("contrib/fusex@.service"));
    assert!(unit.contains("Type=notify"), "{unit}");
    assert!(
        unit.contains("ExecStart=/usr/local/bin/fusex mount "),
        "{unit}"
    );
    let serve = text(&repo.join("contrib/fusex-serve.service"));
    assert!(serve.contains("Type=notify"), "{serve}");
    assert!(
        serve.contains("ExecReload=/bin/kill -HUP $MAINPID"),
        "{serve}"
    );
    assert!(
        serve.contains("ExecStart=/usr/local/bin/fusex serve --config "),
        "{serve}"
    );
    let installed = prefix.join("bin/fusex");
    let units = w.join("units");
    fs::create_dir(&units).unwrap();
    for (name, unit, instance) in [
        ("fusex@.service", unit, "fusex@vm1.service"),
        ("fusex-serve.service", serve, "fusex-serve.service"),
    ] {
        let unit = unit.replace("/usr/local/bin/fusex", installed.to_str().unwrap());
        fs::write(units.join(name), unit).unwrap();
        let out = run(Command::new("systemd-analyze")
            .arg("verify")
            .arg(units.join(instance))
            .env("MANPATH", prefix.join("share/man")));
        assert!(
            out.status.success() && out.stderr.is_empty(),
            "systemd-analyze verify {name}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// `fusex ARGS` with the help wrapped as for a terminal `columns` wide (None: COLUMNS unset), with
/// no terminal on stdin, stdout or stderr; returns stdout.
fn help(args: &[&str], columns: Option<&str>) -> String {
    let mut cmd = Command::new(fusex_bin());
    cmd.args(args);
    match columns {
        Some(c) => cmd.env("COLUMNS", c),
        None => cmd.env_remove("COLUMNS"),
    };
    let out = run_ok(&mut cmd);
    assert!(
        out.stderr.is_empty(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn widest(text: &str) -> usize {
    text.lines().map(|l| l.chars().count()).max().unwrap_or(0)
}

/// `fusex mount --help` groups its options under headings, `-h` is one short entry per option,
/// neither shows the switches that exist for tests and benchmarks (which still parse), and help
/// is wrapped to COLUMNS without a terminal, at most 100 columns wide.
#[test]
fn mount_help_is_grouped_wrapped_and_hides_test_switches() {
    let long = help(&["mount", "--help"], Some("80"));
    let short = help(&["mount", "-h"], Some("80"));
    for heading in [
        "Arguments:",
        "Image:",
        "Access:",
        "Caching and durability:",
        "Queues and performance:",
        "Transport:",
        "NBD:",
        "Stopping and failures:",
        "Daemon, logging and statistics:",
    ] {
        assert!(
            long.lines().any(|l| l == heading),
            "--help lacks {heading}:\n{long}"
        );
        assert!(
            short.lines().any(|l| l == heading),
            "-h lacks {heading}:\n{short}"
        );
    }
    for option in [
        "--writable",
        "--stop-timeout",
        "--nbd-timeout",
        "--daemonize",
        "--queues",
    ] {
        assert!(short.contains(option), "-h lacks {option}:\n{short}");
    }
    for hidden in ["--fault", "--splice-min", "--fixed-files"] {
        assert!(!short.contains(hidden), "-h shows {hidden}:\n{short}");
        assert!(!long.contains(hidden), "--help shows {hidden}:\n{long}");
    }
    // --handoff's hidden value (--cache has an always of its own).
    for text in [&short, &long] {
        let handoff = text
            .split("\n      --")
            .filter(|o| o.starts_with("handoff"))
            .collect::<String>();
        assert!(!handoff.is_empty(), "help lacks --handoff:\n{text}");
        assert!(
            !handoff.contains("always"),
            "help shows --handoff always:\n{handoff}"
        );
    }
    // A benchmark knob: --help (where bench/ looks for the options its targets need), not -h.
    assert!(!short.contains("--io-path"), "-h shows --io-path:\n{short}");
    assert!(
        long.contains("--io-path"),
        "--help lacks --io-path:\n{long}"
    );
    // Summaries only: the long explanations and value lists are --help's.
    assert!(!short.contains("Possible values:"), "{short}");
    assert!(
        short.lines().count() * 2 < long.lines().count(),
        "-h is not a summary: {} lines against --help's {}",
        short.lines().count(),
        long.lines().count()
    );
    // No measurement in the help (they are in docs/), and no path of the source tree.
    for figure in ["IOPS", "QD1", "docs/"] {
        assert!(!long.contains(figure), "--help holds {figure}:\n{long}");
    }
    for args in [
        &["--help"][..],
        &["mount", "--help"],
        &["mount", "-h"],
        &["umount", "--help"],
        &["restart", "--help"],
    ] {
        let text = help(args, Some("80"));
        assert!(
            widest(&text) <= 80,
            "{args:?} wider than 80 columns:\n{text}"
        );
        // Wide or unknown terminals: capped at 100 columns.
        for columns in [Some("300"), None] {
            let text = help(args, columns);
            assert!(
                widest(&text) <= 100,
                "{args:?} with COLUMNS={columns:?} wider than 100 columns:\n{text}"
            );
        }
    }
    assert!(widest(&long) > 70, "--help not filling 80 columns:\n{long}");

    // The hidden switches still parse: the refusal is about the missing IMAGE, not about them.
    let out = run(Command::new(fusex_bin()).args([
        "mount",
        "--fault",
        "write:3:eio",
        "--io-path",
        "ring",
        "--splice-min",
        "0",
        "--fixed-files",
        "off",
        "--handoff",
        "always",
    ]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("<IMAGE>"), "{err}");
    assert!(
        !err.contains("unexpected") && !err.contains("invalid"),
        "{err}"
    );
}

/// The sections every installed page has, and those fusex(1) and fusex-mount(1) add.
const SECTIONS: &[&str] = &[
    "NAME",
    "SYNOPSIS",
    "DESCRIPTION",
    "OPTIONS",
    "EXAMPLES",
    "EXIT STATUS",
    "SEE ALSO",
];
const DAEMON_SECTIONS: &[&str] = &["SIGNALS", "FILES", "ENVIRONMENT"];

/// The `name(section)` references in rendered man page text.
fn page_refs(text: &str) -> Vec<(String, String)> {
    let mut refs = Vec::new();
    for (i, _) in text.match_indices('(') {
        let name: String = text[..i]
            .chars()
            .rev()
            .take_while(|c| c.is_ascii_alphanumeric() || "-_.@".contains(*c))
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        let rest = &text[i + 1..];
        let Some(end) = rest.find(')') else { continue };
        let section = &rest[..end];
        if !name.is_empty() && section.len() == 1 && section.chars().all(|c| c.is_ascii_digit()) {
            refs.push((name, section.to_string()));
        }
    }
    refs
}

/// Every page `make install` puts in place renders without a single groff or man warning, at 80
/// columns, with the sections of a real man page, and every fusex page any of them names is
/// installed too (there is no fusex-help(1), so none names it).
#[test]
fn installed_man_pages_render_cleanly_and_name_only_installed_pages() {
    for tool in ["make", "install", "man", "groff"] {
        if which(tool).is_none() {
            skip_or_fail(&format!(
                "{tool} is needed (make deps installs man-db and groff-base)"
            ));
            return;
        }
    }
    let w = WorkDir::new("install-man");
    let prefix = w.join("prefix");
    make_install(&prefix);
    let man1 = prefix.join("share/man/man1");
    let mut pages: Vec<String> = fs::read_dir(&man1)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    pages.sort();
    for want in [
        "fusex.1",
        "fusex-mount.1",
        "fusex-restart.1",
        "fusex-umount.1",
        "fusex-serve.1",
        "fusex-ctl.1",
    ] {
        assert!(
            pages.iter().any(|p| p == want),
            "{want} not installed: {pages:?}"
        );
    }
    for page in &pages {
        let path = man1.join(page);
        // Every groff warning (-ww), formatting for a terminal.
        let out = run(Command::new("groff")
            .args(["-ww", "-man", "-Tutf8", "-z"])
            .arg(&path));
        assert!(
            out.status.success() && out.stderr.is_empty(),
            "groff -ww on {page}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        // What a reader sees: man's own checks, 80 columns, plain text (no terminal).
        let out = run(Command::new("man")
            .arg("--warnings")
            .arg("-l")
            .arg(&path)
            .env("MANWIDTH", "80")
            .env("MANPAGER", "cat")
            .env("PAGER", "cat")
            .env("LC_ALL", "C")
            // man-db's seccomp sandbox fails in some containers (SIGSYS); nothing to guard here.
            .env("MAN_DISABLE_SECCOMP", "1"));
        let rendered = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success() && out.stderr.is_empty(),
            "man --warnings -l {page}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let sections: &[&str] = if page == "fusex.1" || page == "fusex-mount.1" {
            &[SECTIONS, DAEMON_SECTIONS].concat()
        } else {
            SECTIONS
        };
        for section in sections {
            assert!(
                rendered.lines().any(|l| l == *section),
                "{page} lacks the {section} section (write it in crates/fusex/man/):\n{rendered}"
            );
        }
        assert!(
            widest(&rendered) <= 80,
            "{page} is wider than 80 columns:\n{rendered}"
        );
        // Options and paths are never hyphenated across lines (they would not copy as typed).
        let hyphenated: Vec<&str> = rendered
            .lines()
            .filter(|l| {
                l.ends_with('-')
                    && l.trim_end_matches('-')
                        .ends_with(|c: char| c.is_ascii_alphabetic())
            })
            .collect();
        assert!(hyphenated.is_empty(), "{page} hyphenates: {hyphenated:?}");
        assert!(
            !rendered.contains("docs/"),
            "{page} points into the source tree"
        );
        for (name, section) in page_refs(&rendered) {
            if name.starts_with("fusex") {
                let named = prefix.join(format!("share/man/man{section}/{name}.{section}"));
                assert!(
                    named.is_file(),
                    "{page} names {name}({section}), which is not installed"
                );
            }
        }
        assert!(
            page_refs(&rendered)
                .iter()
                .any(|(n, _)| n.starts_with("fusex")),
            "{page} names no other fusex page"
        );
    }
    // fusex-mount(1) lists the options under the headings --help uses, and none of the hidden
    // ones.
    let out = run(Command::new("man")
        .arg("-l")
        .arg(man1.join("fusex-mount.1"))
        .env("MANWIDTH", "80")
        .env("MANPAGER", "cat")
        .env("LC_ALL", "C")
        // man-db's seccomp sandbox fails in some containers (SIGSYS); nothing to guard here.
        .env("MAN_DISABLE_SECCOMP", "1"));
    let mount = String::from_utf8_lossy(&out.stdout);
    for heading in [
        "Image",
        "Access",
        "Queues and performance",
        "Stopping and failures",
    ] {
        assert!(
            mount
                .lines()
                .any(|l| l.trim() == heading && l.starts_with("   ")),
            "fusex-mount(1) lacks the {heading} group:\n{mount}"
        );
    }
    for option in ["--stop-timeout SECONDS", "--writable", "-U, --force-share"] {
        assert!(mount.contains(option), "fusex-mount(1) lacks {option}");
    }
    for hidden in [
        "--fault",
        "--splice-min",
        "--fixed-files",
        "--register-buffers",
    ] {
        assert!(!mount.contains(hidden), "fusex-mount(1) shows {hidden}");
    }
    for signal in ["SIGUSR1", "SIGUSR2", "SIGALRM", "SIGTERM, SIGINT, SIGHUP"] {
        assert!(mount.contains(signal), "fusex-mount(1) lacks {signal}");
    }
    for example in [
        "nbd+unix:///exp?socket=",
        "fusex@vm1",
        "vm.qcow2",
        "~/disk.raw",
    ] {
        assert!(
            mount.contains(example),
            "fusex-mount(1) lacks the {example} example"
        );
    }
}
