//! fusex: export disk images as regular files through FUSE.

mod affinity;
mod cli;
mod daemon;
mod files;
mod generate;
mod lifecycle;
mod list;
mod logging;
mod memory;
mod notify;
mod passthrough;
mod privileges;
mod restart;
mod runtime;
mod serve;
mod timeout;
mod version;
mod watcher;

use clap::Parser;

use cli::{Cli, Command};

fn init_logging(verbose: u8) {
    init_logging_to(verbose, false);
}

/// Logging to [`logging::Sink`] (stderr, or syslog once switched there: `syslog` says it is, and
/// so no colours).
fn init_logging_to(verbose: u8, syslog: bool) {
    let default = match verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(logging::Sink)
        .with_target(false)
        .with_ansi(!syslog && std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// A command-line error as the one line every other refusal is (`fusex: error: what: what to
/// do`, exit 1), instead of clap's error, tip and usage over several lines with exit 2.
fn argument_error(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    // The message runs until the tip, the usage or the pointer to --help; a list it introduces
    // (missing arguments, possible values) is on the lines after its first.
    let end = |l: &&str| {
        l.starts_with("tip: ") || l.starts_with("Usage: ") || l.starts_with("For more information")
    };
    let what = lines
        .iter()
        .take_while(|l| !end(l))
        .map(|l| l.trim_start_matches("error: "))
        .collect::<Vec<_>>()
        .join(" ");
    let tip = lines
        .iter()
        .find_map(|l| l.strip_prefix("tip: "))
        .map(|t| format!(" ({t})"))
        .unwrap_or_default();
    // "Usage: fusex mount [OPTIONS] <IMAGE> <MOUNTPOINT>": the command whose --help to point at;
    // without a usage line, the subcommand given, if it is one.
    let command = lines
        .iter()
        .find_map(|l| l.strip_prefix("Usage: "))
        .map(|u| {
            u.split(' ')
                .take_while(|w| !w.starts_with(['[', '<']))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .or_else(|| {
            let sub = std::env::args().nth(1)?;
            ["mount", "umount", "restart"]
                .contains(&sub.as_str())
                .then(|| format!("fusex {sub}"))
        })
        .unwrap_or_else(|| "fusex".to_string());
    let what = what.trim_end_matches(':');
    format!("{what}{tip}: run {command} --help")
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            match e.kind() {
                // Help and version as clap prints them; a bare `fusex` shows the help too.
                ErrorKind::DisplayHelp
                | ErrorKind::DisplayVersion
                | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => e.exit(),
                _ => {
                    eprintln!("fusex: error: {}", argument_error(&e).replace('\n', " "));
                    std::process::exit(1);
                }
            }
        }
    };
    let mut daemonized = false;
    if cli.version {
        print!("{}", version::report());
        return;
    }
    let Some(command) = cli.command else {
        // arg_required_else_help covers a bare `fusex`; `fusex -v` lands here.
        eprintln!("fusex: error: no command given: run fusex --help");
        std::process::exit(1);
    };
    let result = match command {
        Command::Mount(args) => {
            // Chosen (and a --log-file opened) before the fork: a refusal is one line here.
            let dest = match logging::choose(&args) {
                Ok(d) => d,
                Err(e) => {
                    eprintln!("fusex: error: {}", format!("{e:#}").replace('\n', " "));
                    std::process::exit(1);
                }
            };
            daemonized = args.daemonize;
            // Fork before any thread exists (logging starts no threads).
            let ready = if args.daemonize {
                daemon::daemonize()
            } else {
                Ok(daemon::Readiness::foreground())
            };
            logging::switch(&dest);
            let syslog = matches!(dest, logging::Dest::Syslog(_));
            init_logging_to(cli.verbose, syslog);
            ready.and_then(|mut r| {
                r.keep_stderr(!syslog);
                serve::mount(*args, r, cli.verbose)
            })
        }
        Command::Restart { mountpoint } => {
            // The new daemon outlives this command: fork it off, as --daemonize does, and
            // return with its report (exit 1 and one line when the old daemon keeps serving).
            daemonized = true;
            let ready = daemon::daemonize();
            init_logging(cli.verbose);
            ready.and_then(|r| serve::restart(mountpoint, r))
        }
        Command::List { json } => list::run(json),
        Command::Generate { what } => {
            init_logging(cli.verbose);
            generate::run(what)
        }
        Command::Umount { mountpoint, force } => {
            init_logging(cli.verbose);
            serve::umount(mountpoint, force)
        }
        Command::AutoUnmountWatcher {
            mountpoint,
            mount_id,
            unique,
            dev,
        } => {
            init_logging(cli.verbose);
            watcher::run(
                &mountpoint,
                transport::MountIdentity::from_parts(
                    mount_id,
                    unique,
                    (libc::major(dev), libc::minor(dev)),
                ),
            )
        }
    };
    if let Err(e) = result {
        if daemonized {
            // The waiting parent already printed the error the child reported.
            std::process::exit(1);
        }
        // One line: the problem and what to do.
        let msg = format!("{e:#}").replace('\n', " ");
        eprintln!("fusex: error: {msg}");
        std::process::exit(1);
    }
}
