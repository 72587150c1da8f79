//! An export's options in `fusex serve`, whether they come from a QMP request or a config file,
//! become the `fusex mount` options they name and are checked by the same parser, so every
//! option `fusex mount` takes works per export, with the same names, defaults and errors.

use std::collections::HashMap;
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
    let mut parser = mount_parser().lock().unwrap_or_else(|p| p.into_inner());
    // An empty image or mountpoint is the parser's to refuse, so only other paths use a parse
    // of the same words.
    let reusable = !image.is_empty() && !mountpoint.as_os_str().is_empty();
    if let Some(seen) = parser.seen.get(words).filter(|_| reusable) {
        let mut args = seen.clone();
        args.image = image.to_string();
        args.mountpoint = mountpoint.to_path_buf();
        return Ok((args, argv));
    }
    let parsed = parser
        .command
        .try_get_matches_from_mut(&argv[1..])
        .and_then(|m| <MountArgs as clap::FromArgMatches>::from_arg_matches(&m));
    match parsed {
        Ok(args) => {
            if reusable {
                if parser.seen.len() >= SEEN_SETS {
                    parser.seen.clear();
                }
                parser.seen.insert(words.to_vec(), args.clone());
            }
            Ok((args, argv))
        }
        Err(e) => Err(crate::cli::one_line(&e, "fusex mount")),
    }
}

/// How many option sets [`MountParser::seen`] keeps (it starts again when full): a daemon's
/// exports and nodes use a few sets over and over; a client that sends a new set each time
/// costs a parse each time, as before, and no more memory than this.
const SEEN_SETS: usize = 64;

/// The `fusex mount` parser, and what option sets parsed to.
struct MountParser {
    command: clap::Command,
    /// Words already parsed, and their options (image and mountpoint aside, which are plain
    /// paths the parser only copies). A parse was a tenth of the CPU a daemon spends adding
    /// and removing an export (`blockdev-add`'s probe and `block-export-add` each parse);
    /// copying an earlier result costs next to nothing.
    seen: HashMap<Vec<String>, MountArgs>,
}

/// The `fusex mount` parser alone, built once and reused for every export (parsing does not
/// consume it): building the whole command line's parser (every subcommand) for each export a
/// daemon adds was a tenth of the daemon's work per export, and cloning the built one half of
/// what was left of the parse.
fn mount_parser() -> &'static Mutex<MountParser> {
    static PARSER: OnceLock<Mutex<MountParser>> = OnceLock::new();
    PARSER.get_or_init(|| {
        let mount = clap::Command::new("mount").bin_name("fusex mount");
        let mut command = <MountArgs as clap::Args>::augment_args(mount);
        command.build();
        Mutex::new(MountParser {
            command,
            seen: HashMap::new(),
        })
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

    /// What a parse of `argv` gives with a parser of its own, nothing reused.
    fn fresh(image: &str, mountpoint: &str, words: &[&str]) -> MountArgs {
        let command = clap::Command::new("mount").bin_name("fusex mount");
        let mut command = <MountArgs as clap::Args>::augment_args(command);
        let argv = ["mount"]
            .into_iter()
            .chain(words.iter().copied())
            .chain(["--", image, mountpoint]);
        let m = command.try_get_matches_from_mut(argv).unwrap();
        <MountArgs as clap::FromArgMatches>::from_arg_matches(&m).unwrap()
    }

    #[test]
    fn words_parsed_before_give_what_a_fresh_parse_gives() {
        let sets: [&[&str]; 4] = [
            &[],
            &["--writable", "--transport=legacy"],
            &["--format=qcow2", "--no-backing", "--queues=2"],
            &[
                "--fault=read:1:eio",
                "--fault=write:2:eio",
                "--passthrough=off",
            ],
        ];
        for words in sets {
            let owned: Vec<String> = words.iter().map(|w| w.to_string()).collect();
            for (image, mountpoint) in [("/a.raw", "/m1"), ("-b.qcow2", "/x/m2"), ("null:1G", "m3")]
            {
                let (args, argv) = mount_args(image, Path::new(mountpoint), &owned).unwrap();
                assert_eq!(
                    format!("{args:?}"),
                    format!("{:?}", fresh(image, mountpoint, words)),
                    "{words:?} {image} {mountpoint}"
                );
                assert_eq!(&argv[argv.len() - 3..], ["--", image, mountpoint]);
            }
        }
        // An empty mountpoint is still the parser's to refuse, whatever was seen before.
        let e = mount_args("/a.raw", Path::new(""), &[]).unwrap_err();
        assert!(!e.contains('\n'), "{e}");
        // And errors are never remembered.
        for _ in 0..2 {
            assert!(mount_args("/i", Path::new("/m"), &["--queues=x".into()]).is_err());
        }
    }
}
