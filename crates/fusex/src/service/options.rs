//! An export's options in `fusex serve`, whether they come from a QMP request or a config file,
//! become the `fusex mount` options they name and are checked by the same parser, so every
//! option `fusex mount` takes works per export, with the same names, defaults and errors.

use std::path::Path;
use std::sync::{Mutex, OnceLock};

use serde_json::Value;

use crate::cli::MountArgs;

/// The prefix of fusex's own members in QMP requests (QMP's convention for a downstream's
/// extensions, `__RFQDN_name`), so they never clash with a member QEMU adds:
/// `"__org.fusex_transport": "legacy"` is `--transport legacy`.
pub const EXTENSION: &str = "__org.fusex_";

/// `fusex mount` options that belong to the whole process, not to one export of `fusex serve`.
const PROCESS_WIDE: &[&str] = &[
    "daemonize",
    "pid-file",
    "log",
    "log-file",
    "log-format",
    "control",
    "metrics-listen",
];

/// One option given as a key and a JSON value, as the command-line words it stands for:
/// `true` is the switch, `false` nothing, a string or number its value, an array the option
/// repeated.
pub fn words(key: &str, value: &Value, shown: &str) -> Result<Vec<String>, String> {
    if PROCESS_WIDE.contains(&key) {
        return Err(format!(
            "{shown} applies to the whole daemon, not to one export: give it to fusex serve"
        ));
    }
    if matches!(key, "image" | "mountpoint" | "help" | "version" | "verbose") {
        return Err(format!("{shown} is not an export option"));
    }
    let flag = format!("--{key}");
    Ok(match value {
        Value::Bool(true) => vec![flag],
        Value::Bool(false) | Value::Null => vec![],
        Value::String(s) => vec![format!("{flag}={s}")],
        Value::Number(n) => vec![format!("{flag}={n}")],
        Value::Array(items) => {
            let mut v = Vec::new();
            for item in items {
                v.extend(words(key, item, shown)?);
            }
            v
        }
        Value::Object(_) => return Err(format!("{shown} takes a value, not an object")),
    })
}

/// Refuses a `fusex mount` word that names a process-wide option (`--pid-file=/x`).
pub fn check_word(word: &str) -> Result<(), String> {
    let name = word.trim_start_matches('-');
    let name = name.split_once('=').map_or(name, |(n, _)| n);
    if word.starts_with("--") && PROCESS_WIDE.contains(&name) {
        return Err(format!(
            "{word} applies to the whole daemon, not to one export: give it to fusex serve"
        ));
    }
    Ok(())
}

/// Parses `fusex mount IMAGE MOUNTPOINT WORDS...` into its options; also returns the command
/// line (a `fusex restart` successor parses it again). Errors are one line, as `fusex mount`'s.
pub fn mount_args(
    image: &str,
    mountpoint: &Path,
    words: &[String],
) -> Result<(MountArgs, Vec<String>), String> {
    let mut argv = vec!["fusex".to_string(), "mount".to_string()];
    argv.extend(words.iter().cloned());
    // After `--`, so an image or mountpoint starting with a dash is not taken for an option.
    argv.push("--".into());
    argv.push(image.to_string());
    argv.push(mountpoint.to_string_lossy().into_owned());
    let parsed = {
        let mut parser = mount_parser().lock().unwrap_or_else(|p| p.into_inner());
        parser
            .try_get_matches_from_mut(&argv[1..])
            .and_then(|m| <MountArgs as clap::FromArgMatches>::from_arg_matches(&m))
    };
    match parsed {
        Ok(args) => Ok((args, argv)),
        Err(e) => Err(crate::cli::one_line(&e, "fusex mount")),
    }
}

/// The `fusex mount` parser alone, built once and reused for every export (parsing does not
/// consume it): building the whole command line's parser (every subcommand) for each export a
/// daemon adds was a tenth of the daemon's work per export, and cloning the built one half of
/// what was left of the parse.
fn mount_parser() -> &'static Mutex<clap::Command> {
    static PARSER: OnceLock<Mutex<clap::Command>> = OnceLock::new();
    PARSER.get_or_init(|| {
        let mount = clap::Command::new("mount").bin_name("fusex mount");
        let mut mount = <MountArgs as clap::Args>::augment_args(mount);
        mount.build();
        Mutex::new(mount)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn values_become_the_options_they_name() {
        assert_eq!(
            words("writable", &json!(true), "w").unwrap(),
            ["--writable"]
        );
        assert!(words("writable", &json!(false), "w").unwrap().is_empty());
        assert_eq!(words("queues", &json!(2), "q").unwrap(), ["--queues=2"]);
        assert_eq!(
            words("fault", &json!(["read:1:eio", "write:2:eio"]), "f").unwrap(),
            ["--fault=read:1:eio", "--fault=write:2:eio"]
        );
        assert!(words("pid-file", &json!("/x"), "pid-file")
            .unwrap_err()
            .contains("whole daemon"));
        assert!(words("log-format", &json!("json"), "log-format")
            .unwrap_err()
            .contains("whole daemon"));
        assert!(check_word("--log-format=json")
            .unwrap_err()
            .contains("whole daemon"));
    }

    #[test]
    fn the_mount_parser_checks_them() {
        let (args, argv) = mount_args(
            "-odd",
            Path::new("/m"),
            &["--transport=legacy".into(), "--writable".into()],
        )
        .unwrap();
        assert_eq!(args.image, "-odd");
        assert!(args.writable);
        assert_eq!(argv.last().unwrap(), "/m");
        let e = mount_args("/i", Path::new("/m"), &["--transport=bogus".into()]).unwrap_err();
        assert!(e.contains("bogus"), "{e}");
        assert!(!e.contains('\n'));
        let e = mount_args("/i", Path::new("/m"), &["--nonsense".into()]).unwrap_err();
        assert!(e.contains("--nonsense"), "{e}");
        // The parser is reused: nothing of an earlier parse (a switch, an error) carries over.
        let (again, _) = mount_args("/j", Path::new("/n"), &[]).unwrap();
        assert_eq!(again.image, "/j");
        assert!(!again.writable);
        assert_eq!(args.transport, crate::cli::TransportArg::Legacy);
        assert_eq!(again.transport, crate::cli::TransportArg::Auto);
    }
}
