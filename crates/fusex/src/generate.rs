//! `fusex generate man|completions`: man pages and shell completions.
//!
//! Completions come straight from the clap definitions. A man page is a hand-written roff page
//! (`crates/fusex/man/PAGE.1.in`: description, examples, signals, exit status, files, see also)
//! into which the generator puts the title line and the OPTIONS section, rendered from the clap
//! definitions under the same headings as `--help`, so options cannot drift from the binary. A
//! subcommand without a hand-written page still gets one (name, synopsis, description, options),
//! so fusex(1) never names a page that is not installed.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use clap::CommandFactory;

use crate::cli::{Cli, Generate};

/// Writes what `what` asks for.
pub fn run(what: Generate) -> Result<()> {
    match what {
        Generate::Man { dir } => man(&dir),
        Generate::Completions { shell, dir } => {
            create(&dir)?;
            let mut cmd = Cli::command();
            let path = clap_complete::generate_to(shell, &mut cmd, "fusex", &dir)
                .with_context(|| format!("writing {shell} completions into {}", dir.display()))?;
            tracing::debug!("wrote {}", path.display());
            Ok(())
        }
    }
}

fn create(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| {
        format!(
            "cannot create {}: give a directory fusex may write",
            dir.display()
        )
    })
}

/// The hand-written pages, by file name without `.1`.
const TEMPLATES: &[(&str, &str)] = &[
    ("fusex", include_str!("../man/fusex.1.in")),
    ("fusex-mount", include_str!("../man/fusex-mount.1.in")),
    ("fusex-umount", include_str!("../man/fusex-umount.1.in")),
    ("fusex-restart", include_str!("../man/fusex-restart.1.in")),
    ("fusex-list", include_str!("../man/fusex-list.1.in")),
    ("fusex-serve", include_str!("../man/fusex-serve.1.in")),
    ("fusex-ctl", include_str!("../man/fusex-ctl.1.in")),
    ("fusex-top", include_str!("../man/fusex-top.1.in")),
];

/// The line of a template that the OPTIONS section replaces.
const OPTIONS_MARK: &str = ".\\\" @OPTIONS@";
/// The line of fusex.1.in that the list of subcommands replaces.
const COMMANDS_MARK: &str = ".\\\" @COMMANDS@";

/// fusex.1, and fusex-SUB.1 for every subcommand that is not hidden (clap's own `help`
/// subcommand gets none, and no page names it).
fn man(dir: &Path) -> Result<()> {
    create(dir)?;
    for (name, page) in pages() {
        let path = dir.join(format!("{name}.1"));
        std::fs::write(&path, page).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// The subcommands that get a page: visible ones, without clap's `help`.
fn subcommands(cmd: &clap::Command) -> impl Iterator<Item = &clap::Command> {
    cmd.get_subcommands()
        .filter(|s| !s.is_hide_set() && s.get_name() != "help")
}

/// Every page as (file name without `.1`, roff source).
fn pages() -> Vec<(String, String)> {
    let mut cmd = Cli::command();
    // Built, so global options (-v) and the help flags are on every subcommand.
    cmd.build();
    let mut pages = vec![("fusex".to_string(), page("fusex", &cmd, &cmd))];
    for sub in subcommands(&cmd) {
        let name = format!("fusex-{}", sub.get_name());
        pages.push((name.clone(), page(&name, sub, &cmd)));
    }
    pages
}

/// One page: the template with the title and options filled in, or a page made from `cmd` alone.
fn page(name: &str, cmd: &clap::Command, top: &clap::Command) -> String {
    let version = top.get_version().unwrap_or_default();
    // No hyphenation and a ragged right margin: options and paths stay whole and copyable.
    // groff's man macros turn hyphenation back on at each paragraph from the HY register, so
    // that is set to 0 as well as `.nh`.
    let mut out = format!(
        ".TH {} 1 \"\" \"fusex {version}\" \"User Commands\"\n.nr HY 0\n.nh\n.ad l\n",
        name.to_uppercase()
    );
    let template = TEMPLATES.iter().find(|(n, _)| *n == name).map(|(_, t)| *t);
    let template = match template {
        Some(t) => t.to_string(),
        None => fallback(name, cmd),
    };
    for line in template.lines() {
        match line {
            OPTIONS_MARK => out.push_str(&options(cmd)),
            COMMANDS_MARK => out.push_str(&commands(top)),
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

/// A page for a subcommand without a hand-written one.
fn fallback(name: &str, cmd: &clap::Command) -> String {
    let about = cmd.get_about().map(|a| a.to_string()).unwrap_or_default();
    let long = cmd
        .get_long_about()
        .map(|a| a.to_string())
        .unwrap_or_else(|| about.clone());
    let usage = cmd
        .clone()
        .bin_name(format!("fusex {}", cmd.get_name()))
        .render_usage()
        .to_string();
    let usage = usage.trim_start_matches("Usage:").trim();
    let mut s = String::new();
    let _ = writeln!(
        s,
        ".SH NAME\n{} \\- {}",
        esc(name),
        esc(&lower_first(&about))
    );
    let _ = writeln!(s, ".SH SYNOPSIS\n.B {}", esc(usage));
    let _ = writeln!(s, ".SH DESCRIPTION\n{}", paragraphs(&long));
    let _ = writeln!(s, "{OPTIONS_MARK}\n.SH SEE ALSO\n.BR fusex (1)");
    s
}

/// fusex.1's list of subcommands, each with its summary and page.
fn commands(top: &clap::Command) -> String {
    let mut s = String::new();
    for sub in subcommands(top) {
        let about = sub.get_about().map(|a| a.to_string()).unwrap_or_default();
        let _ = writeln!(
            s,
            ".TP\n.B fusex {}\n{}\nSee\n.BR fusex\\-{} (1).",
            esc(sub.get_name()),
            sentence(&esc(&about)),
            esc(sub.get_name())
        );
    }
    s
}

/// The OPTIONS section: arguments, options without a heading, then a subsection per heading in
/// the order `--help` shows them. Hidden options are left out, as `--help` leaves them out.
fn options(cmd: &clap::Command) -> String {
    let args: Vec<&clap::Arg> = cmd.get_arguments().filter(|a| !a.is_hide_set()).collect();
    let mut s = String::from(".SH OPTIONS\n");
    for arg in args.iter().filter(|a| a.is_positional()) {
        s.push_str(&option(arg));
    }
    for arg in args
        .iter()
        .filter(|a| !a.is_positional() && a.get_help_heading().is_none())
    {
        s.push_str(&option(arg));
    }
    let mut headings: Vec<&str> = Vec::new();
    for h in args.iter().filter_map(|a| a.get_help_heading()) {
        if !headings.contains(&h) {
            headings.push(h);
        }
    }
    for h in headings {
        let _ = writeln!(s, ".SS {}", esc(h));
        for arg in args.iter().filter(|a| a.get_help_heading() == Some(h)) {
            s.push_str(&option(arg));
        }
    }
    s
}

/// One option: its flags and value as the tag, its whole help, its values and its default.
fn option(arg: &clap::Arg) -> String {
    let value = arg
        .get_value_names()
        .and_then(|v| v.first())
        .map(|v| v.to_string())
        .unwrap_or_else(|| arg.get_id().as_str().to_uppercase());
    let mut tag = Vec::new();
    if let Some(c) = arg.get_short() {
        tag.push(format!("\\fB\\-{}\\fR", esc(&c.to_string())));
    }
    if let Some(l) = arg.get_long() {
        tag.push(format!("\\fB\\-\\-{}\\fR", esc(l)));
    }
    let mut tag = tag.join(", ");
    let takes_value = arg.get_action().takes_values();
    if arg.is_positional() {
        tag = format!("\\fI{}\\fR", esc(&value));
    } else if takes_value {
        let _ = write!(tag, " \\fI{}\\fR", esc(&value));
    }
    let help = arg
        .get_long_help()
        .or(arg.get_help())
        .map(|h| h.to_string())
        .unwrap_or_default();
    let mut s = format!(".TP\n{tag}\n{}\n", paragraphs(&help));
    let values: Vec<_> = arg
        .get_possible_values()
        .into_iter()
        .filter(|v| !v.is_hide_set())
        .collect();
    if takes_value && !values.is_empty() {
        s.push_str(".RS\n");
        for v in &values {
            let help = v.get_help().map(|h| h.to_string()).unwrap_or_default();
            let _ = writeln!(
                s,
                ".TP\n.B {}\n{}",
                esc(v.get_name()),
                sentence(&esc(&help))
            );
        }
        s.push_str(".RE\n");
    }
    let defaults: Vec<String> = arg
        .get_default_values()
        .iter()
        .map(|d| d.to_string_lossy().into_owned())
        .collect();
    if takes_value && !arg.is_positional() && !defaults.is_empty() {
        let _ = writeln!(s, ".IP\nDefault: \\fB{}\\fR.", esc(&defaults.join(",")));
    }
    s
}

/// Help text as roff: its paragraphs (blank-line separated) as `.IP` paragraphs inside the
/// current tagged paragraph, each ending as a sentence.
fn paragraphs(text: &str) -> String {
    text.split("\n\n")
        .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|p| !p.is_empty())
        .map(|p| sentence(&esc(&p)))
        .collect::<Vec<_>>()
        .join("\n.IP\n")
}

/// `s`, ending with a full stop unless it already ends a sentence.
fn sentence(s: &str) -> String {
    let s = s.trim_end();
    if s.is_empty() || s.ends_with(['.', '!', '?', ':']) {
        s.to_string()
    } else {
        format!("{s}.")
    }
}

fn lower_first(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_lowercase().chain(c).collect(),
        None => String::new(),
    }
}

/// Text made safe for a roff text line: backslashes and hyphens escaped (so options copy as
/// typed), and a leading `.` or `'` kept from being read as a request.
fn esc(s: &str) -> String {
    let s = s.replace('\\', "\\e").replace('-', "\\-");
    if s.starts_with(['.', '\'']) {
        format!("\\&{s}")
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_template_has_its_options_and_a_subcommand() {
        let mut cmd = Cli::command();
        cmd.build();
        for (name, template) in TEMPLATES {
            assert_eq!(
                template.lines().filter(|l| *l == OPTIONS_MARK).count(),
                1,
                "{name}.1.in needs exactly one {OPTIONS_MARK} line"
            );
            if let Some(sub) = name.strip_prefix("fusex-") {
                assert!(
                    subcommands(&cmd).any(|s| s.get_name() == sub),
                    "{name}.1.in is for a subcommand fusex does not have"
                );
            }
        }
        assert_eq!(
            TEMPLATES[0]
                .1
                .lines()
                .filter(|l| *l == COMMANDS_MARK)
                .count(),
            1
        );
    }

    #[test]
    fn pages_name_no_help_page_and_show_no_hidden_option() {
        let pages = pages();
        let names: Vec<&str> = pages.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names[..2], ["fusex", "fusex-mount"]);
        // A new subcommand gets a generated page, but deserves examples and an exit status.
        for name in &names {
            assert!(
                TEMPLATES.iter().any(|(t, _)| t == name),
                "write crates/fusex/man/{name}.1.in (and list it in TEMPLATES)"
            );
        }
        for (name, page) in &pages {
            assert!(!page.contains("fusex\\-help"), "{name} names fusex-help");
            for hidden in [
                "\\-\\-fault",
                "\\-\\-splice\\-min",
                "\\-\\-fixed\\-files",
                "\\-\\-register\\-buffers",
            ] {
                assert!(!page.contains(hidden), "{name} shows {hidden}");
            }
            assert!(
                !page.contains("docs/"),
                "{name} points into the source tree"
            );
        }
        let mount = &pages[1].1;
        assert!(mount.starts_with(".TH FUSEX-MOUNT 1 "), "{mount}");
        assert!(mount.contains(".SS Image\n"), "{mount}");
        assert!(mount.contains(".TP\n\\fB\\-\\-stop\\-timeout\\fR \\fISECONDS\\fR\n"));
    }

    #[test]
    fn text_is_escaped_for_roff() {
        assert_eq!(esc("--a-b"), "\\-\\-a\\-b");
        assert_eq!(esc(".x 'y"), "\\&.x 'y");
        assert_eq!(esc("'q"), "\\&'q");
        assert_eq!(esc("a\\b"), "a\\eb");
        assert_eq!(sentence("Image format"), "Image format.");
        assert_eq!(sentence("Done."), "Done.");
        assert_eq!(sentence("(needs --writable)"), "(needs --writable).");
    }
}
