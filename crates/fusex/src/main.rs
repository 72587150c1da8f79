//! fusex: export disk images as regular files through FUSE. The command line, its logging and
//! its exit status; every command's work is in the library (`lib.rs`).

use fusex::{cli, ctl, daemon, generate, list, logging, serve, service, top, version, watcher};

use clap::Parser;

use cli::{Cli, Command};

fn init_logging(verbose: u8) {
    init_logging_to(verbose, false);
}

/// Logging to [`logging::Sink`] (stderr, or syslog once switched there: `syslog` says it is, and
/// so no colours), in the format [`logging::set_format`] chose.
fn init_logging_to(verbose: u8, syslog: bool) {
    let default = match verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    logging::init(
        default,
        !syslog && std::io::IsTerminal::is_terminal(&std::io::stderr()),
    );
}

/// Starts a daemon command: the log destination chosen (and a `--log-file` opened) before the
/// fork, so a refusal is one line here; the fork (`--daemonize`) before any thread exists
/// (logging starts none); then `run` with the readiness report.
fn detach(
    (log, log_file, format): (
        Option<cli::LogArg>,
        Option<std::path::PathBuf>,
        logging::LogFormat,
    ),
    daemonize: bool,
    verbose: u8,
    run: impl FnOnce(daemon::Readiness) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let dest = match logging::choose_for(log, log_file.as_ref(), daemonize) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("fusex: error: {}", format!("{e:#}").replace('\n', " "));
            std::process::exit(1);
        }
    };
    let ready = if daemonize {
        daemon::daemonize()
    } else {
        Ok(daemon::Readiness::foreground())
    };
    logging::switch(&dest);
    logging::set_format(format);
    let syslog = matches!(dest, logging::Dest::Syslog(_));
    init_logging_to(verbose, syslog);
    ready.and_then(|mut r| {
        r.keep_stderr(!syslog);
        run(r)
    })
}

fn main() {
    logging::ignore_rotation_signal();
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
                    eprintln!("fusex: error: {}", cli::one_line(&e, "").replace('\n', " "));
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
    // A daemon closes what its launcher left open before it opens anything of its own.
    let detaches = match &command {
        Command::Mount(a) => a.daemonize,
        Command::Serve(a) => a.daemonize,
        Command::Restart { .. } => true,
        _ => false,
    };
    if detaches {
        daemon::close_inherited();
    }
    let result = match command {
        Command::Mount(args) => {
            daemonized = args.daemonize;
            // Every line of a mount is about its one export: named as `fusex list` shows it.
            logging::set_process_export(logging::mountpoint_id(&args.mountpoint));
            let log = (args.log, args.log_file.clone(), args.log_format);
            detach(log, args.daemonize, cli.verbose, |r| {
                serve::mount(*args, r, cli.verbose)
            })
        }
        Command::Serve(args) => {
            daemonized = args.daemonize;
            let log = (args.log, args.log_file.clone(), args.log_format);
            detach(log, args.daemonize, cli.verbose, |r| {
                service::daemon::run(*args, r, cli.verbose)
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
        Command::Ctl(args) => {
            init_logging(cli.verbose);
            ctl::run(args)
        }
        Command::Top(args) => {
            init_logging(cli.verbose);
            top::run(args)
        }
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
            // Its daemon's format (it writes to the same stderr), and its export.
            if std::env::var_os(logging::WATCHER_FORMAT_ENV).is_some_and(|v| v == "json") {
                logging::set_format(logging::LogFormat::Json);
            }
            logging::set_process_export(mountpoint.to_string_lossy().into_owned());
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
        if logging::format() == logging::LogFormat::Json {
            // The log is for machines: this line too (it may go to the same file).
            tracing::error!("fusex: error: {msg}");
        } else {
            eprintln!("fusex: error: {msg}");
        }
        std::process::exit(1);
    }
}
