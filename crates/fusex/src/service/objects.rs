//! QEMU's user-creatable objects (`--object`, `object-add`, `object-del`), for the kinds an
//! export's command line names:
//!
//! - **IOThreads.** qemu-storage-daemon users give an export its own IOThread (`--object
//!   iothread,id=io0 --export ...,iothread=io0`) so that its I/O leaves the main loop. Every
//!   fusex export already runs on queue threads (shared per CPU), never on the thread that takes
//!   commands, so an IOThread here is a name an export may refer to and nothing more; its tuning
//!   properties (`poll-max-ns`, ...) are checked and kept, not applied.
//! - **X.509 TLS credentials** (`tls-creds-x509`): the directory of PEM files an NBD node's
//!   `tls-creds` names, which fusex's NBD client (rustls) reads under the same file names as
//!   QEMU's (`ca-cert.pem`, `client-cert.pem`, `client-key.pem`).
//!
//! The command lines and QMP scripts written for qemu-storage-daemon run unchanged, with its
//! answers and error texts; the other object types are refused in one line naming the type.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use qmp::{parse_args, QmpError};

/// An IOThread's `qom-type`.
pub const IOTHREAD: &str = "iothread";
/// X.509 TLS credentials' `qom-type`.
pub const TLS_CREDS_X509: &str = "tls-creds-x509";

/// QEMU's other user-creatable object types: named in a refusal, where a type QEMU does not
/// have either is refused with QEMU's own words.
const OTHER_TYPES: &[&str] = &[
    "authz-list",
    "authz-listfile",
    "authz-pam",
    "authz-simple",
    "can-bus",
    "can-host-socketcan",
    "colo-compare",
    "cryptodev-backend",
    "cryptodev-backend-builtin",
    "cryptodev-vhost-user",
    "dbus-vmstate",
    "filter-buffer",
    "filter-dump",
    "filter-mirror",
    "filter-redirector",
    "filter-replay",
    "filter-rewriter",
    "input-barrier",
    "input-linux",
    "main-loop",
    "memory-backend-epc",
    "memory-backend-file",
    "memory-backend-memfd",
    "memory-backend-ram",
    "pef-guest",
    "pr-manager-helper",
    "qtest",
    "rng-builtin",
    "rng-egd",
    "rng-random",
    "s390-pv-guest",
    "secret",
    "secret_keyring",
    "sev-guest",
    "thread-context",
    "throttle-group",
    "tls-cipher-suites",
    "tls-creds-anon",
    "tls-creds-psk",
    "x-remote-object",
    "x-vfio-user-server",
];

/// One object: its id, what it is, and the arguments it was added with (kept in order for a
/// `fusex restart` successor, which adds them again).
#[derive(Clone, Debug, PartialEq)]
pub struct Object {
    pub id: String,
    pub kind: Kind,
    pub args: Value,
}

/// What an object is.
#[derive(Clone, Debug, PartialEq)]
pub enum Kind {
    IoThread,
    TlsCreds(TlsCreds),
}

/// A `tls-creds-x509` object.
#[derive(Clone, Debug, PartialEq)]
pub struct TlsCreds {
    /// Where its PEM files are.
    pub dir: PathBuf,
    /// `endpoint=client` (the default): credentials a client (an NBD node) can use.
    pub client: bool,
    /// `verify-peer` (default on): check the peer's certificate.
    pub verify_peer: bool,
}

/// The members of an `iothread` object, QEMU's `IothreadProperties` (7.2): checked for their
/// types, kept, not applied.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
#[allow(dead_code)] // read for their types and presence only
struct IoThreadProps {
    qom_type: String,
    id: String,
    poll_max_ns: Option<i64>,
    poll_grow: Option<i64>,
    poll_shrink: Option<i64>,
    aio_max_batch: Option<i64>,
    thread_pool_min: Option<i64>,
    thread_pool_max: Option<i64>,
}

#[derive(Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
enum Endpoint {
    Client,
    Server,
}

/// The members of a `tls-creds-x509` object, QEMU's `TlsCredsX509Properties` (7.2).
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct X509Props {
    #[allow(dead_code)] // checked before
    qom_type: String,
    id: String,
    dir: Option<String>,
    endpoint: Option<Endpoint>,
    verify_peer: Option<bool>,
    #[allow(dead_code)] // the only value rustls has: checks certificates as QEMU's default does
    sanity_check: Option<bool>,
    #[allow(dead_code)] // deprecated in QEMU, and meaningless: the files are read when used
    loaded: Option<bool>,
    priority: Option<String>,
    passwordid: Option<String>,
}

/// Reads `object-add`'s arguments (also `--object`'s, converted): an object, or the refusal
/// qemu-storage-daemon gives (or, for a type it has and fusex has not, one naming the type).
pub fn parse(args: Value) -> Result<Object, QmpError> {
    let Value::Object(map) = &args else {
        return Err(QmpError::generic("arguments must be an object"));
    };
    let qom_type = match map.get("qom-type") {
        None => return Err(QmpError::generic("Parameter 'qom-type' is missing")),
        Some(Value::String(s)) => s.as_str(),
        Some(_) => {
            return Err(QmpError::generic(
                "Invalid parameter type for 'qom-type', expected: string",
            ))
        }
    };
    match qom_type {
        IOTHREAD => {
            let props: IoThreadProps = parse_args(args.clone())?;
            Ok(Object {
                id: props.id,
                kind: Kind::IoThread,
                args,
            })
        }
        TLS_CREDS_X509 => {
            let props: X509Props = parse_args(args.clone())?;
            for (member, given) in [
                ("priority", props.priority.is_some()),
                ("passwordid", props.passwordid.is_some()),
            ] {
                if given {
                    return Err(QmpError::generic(format!(
                        "fusex does not support '{member}' on {TLS_CREDS_X509} objects: its TLS \
                         library (rustls) takes no GnuTLS priority string and no encrypted key; \
                         leave it out"
                    )));
                }
            }
            let Some(dir) = props.dir else {
                // QEMU's words.
                return Err(QmpError::generic("Missing 'dir' property value"));
            };
            let client = props.endpoint.unwrap_or(Endpoint::Client) == Endpoint::Client;
            let dir = PathBuf::from(dir);
            let needed: &[&str] = if client {
                &["ca-cert.pem"]
            } else {
                &["ca-cert.pem", "server-cert.pem", "server-key.pem"]
            };
            for f in needed {
                readable(&dir.join(f))?;
            }
            Ok(Object {
                id: props.id,
                kind: Kind::TlsCreds(TlsCreds {
                    dir,
                    client,
                    verify_peer: props.verify_peer.unwrap_or(true),
                }),
                args,
            })
        }
        other if OTHER_TYPES.contains(&other) => Err(QmpError::generic(format!(
            "fusex does not support objects of type '{other}': it has {IOTHREAD} and \
             {TLS_CREDS_X509} objects; leave it out"
        ))),
        other => Err(QmpError::generic(format!(
            "Parameter 'qom-type' does not accept value '{other}'"
        ))),
    }
}

/// QEMU's check of a credentials file, with its words.
fn readable(path: &Path) -> Result<(), QmpError> {
    match std::fs::File::open(path) {
        Ok(_) => Ok(()),
        Err(e) => Err(QmpError::generic(format!(
            "Unable to access credentials {}: {}",
            path.display(),
            super::strerror(&e)
        ))),
    }
}

/// The TLS credentials an NBD node's `tls-creds` names, with QEMU's refusals.
pub fn tls_creds<'a>(objects: &'a [Object], id: &str) -> Result<&'a TlsCreds, QmpError> {
    match objects.iter().find(|o| o.id == id).map(|o| &o.kind) {
        None => Err(QmpError::generic(format!(
            "No TLS credentials with id '{id}'"
        ))),
        Some(Kind::IoThread) => Err(QmpError::generic(format!(
            "Object with id '{id}' is not TLS credentials"
        ))),
        Some(Kind::TlsCreds(c)) if !c.client => Err(QmpError::generic(
            "Expected TLS credentials for a client endpoint",
        )),
        Some(Kind::TlsCreds(c)) => Ok(c),
    }
}

/// An export's `iothread`: one IOThread's id, or a list of them (QEMU 10.1's
/// `BlockExportIothreads`, for an export whose I/O runs on several IOThreads); `fixed` is its
/// `fixed-iothread`. Every id is checked against the objects when the export is added.
pub fn export_iothreads(v: Option<&Value>, fixed: Option<bool>) -> Result<Vec<String>, QmpError> {
    match v {
        None => Ok(Vec::new()),
        Some(Value::String(id)) => Ok(vec![id.clone()]),
        Some(Value::Array(list)) => {
            if fixed == Some(true) {
                // QEMU's words.
                return Err(QmpError::generic(
                    "Cannot use fixed-iothread for a multi-threaded export",
                ));
            }
            if list.is_empty() {
                return Err(QmpError::generic(
                    "Parameter 'iothread' needs at least one IOThread id: give an id, or a list \
                     of them",
                ));
            }
            list.iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(id) => Ok(id.clone()),
                    _ => Err(QmpError::generic(format!(
                        "Invalid parameter type for 'iothread[{i}]', expected: string"
                    ))),
                })
                .collect()
        }
        Some(_) => Err(QmpError::generic(
            "Invalid parameter type for 'iothread', expected: BlockExportIothreads",
        )),
    }
}

/// QEMU's words for an id given twice.
pub fn duplicate(id: &str) -> QmpError {
    QmpError::generic(format!(
        "attempt to add duplicate property '{id}' to object (type 'container')"
    ))
}

/// QEMU's words for an id no object has.
pub fn not_found(id: &str) -> QmpError {
    QmpError::generic(format!("object '{id}' not found"))
}

/// QEMU's words for an export's `iothread` that names no IOThread.
pub fn iothread_not_found(id: &str) -> QmpError {
    QmpError::generic(format!("iothread \"{id}\" not found"))
}

/// The refusal of `object-del` of an object in use: an IOThread an export names
/// (qemu-storage-daemon 7.2 deletes it, then aborts on the export's next request), TLS
/// credentials a node uses (which a `fusex restart` successor needs to add the node again).
/// `user` says which: "export 'e'", "node 'n'".
pub fn in_use(id: &str, user: &str) -> QmpError {
    QmpError::generic(format!(
        "object '{id}' is in use, can not be deleted: {user} names it (remove that first)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn desc(r: Result<Object, QmpError>) -> String {
        r.expect_err("refused").desc
    }

    #[test]
    fn an_iothread_with_its_properties_is_kept_whole() {
        let args = json!({"qom-type": "iothread", "id": "io0", "poll-max-ns": 0,
                          "poll-grow": 2, "aio-max-batch": 8});
        let t = parse(args.clone()).unwrap();
        assert_eq!(t.id, "io0");
        assert_eq!(t.kind, Kind::IoThread);
        assert_eq!(t.args, args);
    }

    #[test]
    fn mistakes_get_qemus_words() {
        assert_eq!(
            desc(parse(json!({"qom-type": "iothread"}))),
            "Parameter 'id' is missing"
        );
        assert_eq!(
            desc(parse(json!({"id": "x"}))),
            "Parameter 'qom-type' is missing"
        );
        assert_eq!(
            desc(parse(json!({"qom-type": "bogus", "id": "x"}))),
            "Parameter 'qom-type' does not accept value 'bogus'"
        );
        assert_eq!(
            desc(parse(
                json!({"qom-type": "iothread", "id": "x", "bogus": 1})
            )),
            "Parameter 'bogus' is unexpected"
        );
        assert_eq!(
            desc(parse(
                json!({"qom-type": "iothread", "id": "x", "poll-max-ns": "many"})
            )),
            "Invalid parameter type for 'poll-max-ns', expected: integer"
        );
    }

    #[test]
    fn an_export_names_one_iothread_or_a_list() {
        assert_eq!(export_iothreads(None, None).unwrap(), Vec::<String>::new());
        assert_eq!(
            export_iothreads(Some(&json!("io0")), Some(true)).unwrap(),
            ["io0"]
        );
        assert_eq!(
            export_iothreads(Some(&json!(["io0", "io1"])), Some(false)).unwrap(),
            ["io0", "io1"]
        );
        let e = |v: Value, fixed| export_iothreads(Some(&v), fixed).unwrap_err().desc;
        assert_eq!(
            e(json!(["io0"]), Some(true)),
            "Cannot use fixed-iothread for a multi-threaded export"
        );
        assert!(e(json!([]), None).contains("at least one"));
        assert_eq!(
            e(json!(["io0", 3]), None),
            "Invalid parameter type for 'iothread[1]', expected: string"
        );
        assert_eq!(
            e(json!(3), None),
            "Invalid parameter type for 'iothread', expected: BlockExportIothreads"
        );
    }

    #[test]
    fn a_type_qemu_has_and_fusex_has_not_is_named() {
        let d = desc(parse(
            json!({"qom-type": "secret", "id": "s0", "data": "x"}),
        ));
        assert!(d.contains("'secret'") && d.contains("iothread"), "{d}");
    }

    #[test]
    fn tls_credentials_name_a_directory_with_a_ca() {
        let dir = std::env::temp_dir().join(format!("fusex-objects-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let d = dir.to_str().unwrap();
        let x509 = |extra: Value| {
            let mut v = json!({"qom-type": "tls-creds-x509", "id": "t0", "dir": d});
            v.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            parse(v)
        };
        assert_eq!(
            desc(x509(json!({}))),
            format!("Unable to access credentials {d}/ca-cert.pem: No such file or directory")
        );
        std::fs::write(dir.join("ca-cert.pem"), b"").unwrap();
        let o = x509(json!({"verify-peer": false})).unwrap();
        let Kind::TlsCreds(c) = &o.kind else {
            panic!("{o:?}")
        };
        assert!(c.client && !c.verify_peer);
        assert_eq!(c.dir, dir);
        // A server's needs its own certificate and key too.
        assert!(desc(x509(json!({"endpoint": "server"}))).contains("server-cert.pem"));
        assert_eq!(
            desc(x509(json!({"endpoint": "bogus"}))),
            "Parameter 'endpoint' does not accept value 'bogus'"
        );
        assert!(desc(x509(json!({"priority": "NORMAL"}))).contains("'priority'"));
        assert_eq!(
            desc(parse(json!({"qom-type": "tls-creds-x509", "id": "t1"}))),
            "Missing 'dir' property value"
        );
        // What an NBD node's tls-creds may name.
        let objects = vec![
            o.clone(),
            parse(json!({"qom-type": "iothread", "id": "io0"})).unwrap(),
        ];
        assert_eq!(tls_creds(&objects, "t0").unwrap(), c);
        assert_eq!(
            tls_creds(&objects, "io0").unwrap_err().desc,
            "Object with id 'io0' is not TLS credentials"
        );
        assert_eq!(
            tls_creds(&objects, "t9").unwrap_err().desc,
            "No TLS credentials with id 't9'"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
