//! qemu-storage-daemon's command line, for what fusex supports: `--blockdev` and `--export` (as
//! QEMU's `key=value` options or JSON) become the QMP commands they stand for, `--chardev socket`
//! with `--monitor` a control socket. A documented qemu-storage-daemon FUSE invocation runs with
//! only the program name changed.

use std::collections::BTreeMap;
use std::path::PathBuf;

use qmp::keyval::{self, Kind};
#[cfg(test)]
use serde_json::Map;
use serde_json::Value;

/// The types `--blockdev` values convert to (every value is a string in `key=value` form).
const BLOCKDEV_TYPES: &[(&str, Kind)] = &[
    ("read-only", Kind::Bool),
    ("auto-read-only", Kind::Bool),
    ("force-share", Kind::Bool),
    ("cache.direct", Kind::Bool),
    ("cache.no-flush", Kind::Bool),
    ("read-zeroes", Kind::Bool),
    ("size", Kind::Size),
    ("offset", Kind::Size),
    ("file.read-only", Kind::Bool),
    ("file.auto-read-only", Kind::Bool),
    ("file.force-share", Kind::Bool),
    ("file.cache.direct", Kind::Bool),
    ("file.cache.no-flush", Kind::Bool),
    ("file.read-zeroes", Kind::Bool),
    ("file.size", Kind::Size),
    ("cache-size", Kind::Uint),
    ("l2-cache-size", Kind::Uint),
    ("refcount-cache-size", Kind::Uint),
    ("cache-clean-interval", Kind::Int),
    ("overlap-check.main-header", Kind::Bool),
    ("overlap-check.active-l1", Kind::Bool),
    ("overlap-check.active-l2", Kind::Bool),
    ("overlap-check.refcount-table", Kind::Bool),
    ("overlap-check.refcount-block", Kind::Bool),
    ("overlap-check.snapshot-table", Kind::Bool),
    ("overlap-check.inactive-l1", Kind::Bool),
    ("overlap-check.inactive-l2", Kind::Bool),
    ("overlap-check.bitmap-directory", Kind::Bool),
];

/// The types `--export` values convert to.
const EXPORT_TYPES: &[(&str, Kind)] = &[
    ("writable", Kind::Bool),
    ("writethrough", Kind::Bool),
    ("growable", Kind::Bool),
    ("fixed-iothread", Kind::Bool),
];

/// The types `--object` values convert to: the members of the object types fusex has
/// (`super::objects`), whichever type names them (another type's member is then refused by
/// `object-add` as unexpected).
const OBJECT_TYPES: &[(&str, Kind)] = &[
    ("poll-max-ns", Kind::Int),
    ("poll-grow", Kind::Int),
    ("poll-shrink", Kind::Int),
    ("aio-max-batch", Kind::Int),
    ("thread-pool-min", Kind::Int),
    ("thread-pool-max", Kind::Int),
    ("verify-peer", Kind::Bool),
    ("sanity-check", Kind::Bool),
    ("loaded", Kind::Bool),
];

/// `--blockdev OPTIONS` (`driver` implied first, as in qemu-storage-daemon: `file,filename=X`,
/// or JSON): the `blockdev-add` arguments.
pub fn blockdev(arg: &str) -> Result<Value, String> {
    let mut m = keyval::parse(arg, Some("driver")).map_err(|e| format!("--blockdev {arg}: {e}"))?;
    keyval::convert(&mut m, BLOCKDEV_TYPES).map_err(|e| format!("--blockdev {arg}: {e}"))?;
    Ok(Value::Object(m))
}

/// `--object OPTIONS` (`qom-type` implied first, or JSON): the `object-add` arguments.
pub fn object(arg: &str) -> Result<Value, String> {
    let mut m = keyval::parse(arg, Some("qom-type")).map_err(|e| format!("--object {arg}: {e}"))?;
    keyval::convert(&mut m, OBJECT_TYPES).map_err(|e| format!("--object {arg}: {e}"))?;
    Ok(Value::Object(m))
}

/// `--export OPTIONS`: the `block-export-add` arguments. fusex's own members
/// (`__org.fusex_queues=2`) stay strings, which the `fusex mount` parser reads.
pub fn export(arg: &str) -> Result<Value, String> {
    let mut m = keyval::parse(arg, Some("type")).map_err(|e| format!("--export {arg}: {e}"))?;
    keyval::convert(&mut m, EXPORT_TYPES).map_err(|e| format!("--export {arg}: {e}"))?;
    // An extension switch given as `on`/`off` is a boolean, as QEMU's own are.
    for (k, v) in m.iter_mut() {
        if k.starts_with(super::options::EXTENSION) {
            match v.as_str() {
                Some("on") => *v = Value::Bool(true),
                Some("off") => *v = Value::Bool(false),
                _ => {}
            }
        }
    }
    Ok(Value::Object(m))
}

/// Where a QMP monitor listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ControlSocket {
    /// A unix socket fusex binds (mode 0600) and removes at exit.
    Path(PathBuf),
    /// A listening unix socket the process was handed as this descriptor (`fd=N`), as a parent
    /// that binds it first passes it to qemu-storage-daemon.
    Fd(i32),
}

impl std::fmt::Display for ControlSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ControlSocket::Path(p) => write!(f, "{}", p.display()),
            ControlSocket::Fd(n) => write!(f, "fd={n}"),
        }
    }
}

/// `--chardev socket,id=ID,path=PATH|fd=N,server=on[,wait=off]`: the socket a `--monitor`
/// serves.
pub fn chardev(arg: &str) -> Result<(String, ControlSocket), String> {
    let m = keyval::parse(arg, Some("backend")).map_err(|e| format!("--chardev {arg}: {e}"))?;
    let get = |k: &str| m.get(k).and_then(Value::as_str);
    if get("backend") != Some("socket") {
        return Err(format!(
            "--chardev {arg}: fusex supports only socket chardevs (a unix socket for --monitor)"
        ));
    }
    let id = get("id").ok_or_else(|| format!("--chardev {arg}: Parameter 'id' is missing"))?;
    let socket = match (get("path"), get("fd")) {
        (Some(path), None) => ControlSocket::Path(PathBuf::from(path)),
        (None, Some(fd)) => match fd.parse::<i32>() {
            Ok(n) if n > 2 => ControlSocket::Fd(n),
            _ => {
                return Err(format!(
                    "--chardev {arg}: fd={fd} is not a descriptor number above 2 (give the \
                     number of a listening unix socket the daemon inherits)"
                ))
            }
        },
        (Some(_), Some(_)) => {
            return Err(format!("--chardev {arg}: give path=PATH or fd=N, not both"))
        }
        (None, None) => {
            return Err(format!(
                "--chardev {arg}: fusex supports only unix sockets here: give path=PATH (or \
                 fd=N, a listening unix socket it inherits)"
            ))
        }
    };
    for (k, v) in &m {
        let on = |v: &Value| matches!(v.as_str(), Some("on" | "yes" | "true"));
        match k.as_str() {
            "backend" | "id" | "path" | "fd" => {}
            "server" if on(v) => {}
            "server" => {
                return Err(format!(
                    "--chardev {arg}: fusex listens on the socket: give server=on"
                ))
            }
            // fusex never waits for a client before it serves.
            "wait" => {}
            other => {
                return Err(format!(
                    "--chardev {arg}: fusex does not support '{other}' on a chardev"
                ))
            }
        }
    }
    Ok((id.to_string(), socket))
}

/// `--monitor [chardev=]ID[,mode=control]`: the chardev's id.
pub fn monitor(arg: &str) -> Result<String, String> {
    let m = keyval::parse(arg, Some("chardev")).map_err(|e| format!("--monitor {arg}: {e}"))?;
    for (k, v) in &m {
        match (k.as_str(), v.as_str()) {
            ("chardev", _) | ("mode", Some("control")) | ("pretty", Some("off")) => {}
            ("mode", _) => {
                return Err(format!(
                    "--monitor {arg}: fusex has only QMP monitors: give mode=control or leave \
                     mode out"
                ))
            }
            (other, _) => {
                return Err(format!(
                    "--monitor {arg}: fusex does not support '{other}' on a monitor"
                ))
            }
        }
    }
    m.get("chardev")
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| format!("--monitor {arg}: Parameter 'chardev' is missing"))
}

/// The control sockets `--chardev` and `--monitor` ask for, in order.
pub fn monitor_sockets(
    chardevs: &[String],
    monitors: &[String],
) -> Result<Vec<ControlSocket>, String> {
    let mut by_id = BTreeMap::new();
    for c in chardevs {
        let (id, path) = chardev(c)?;
        if by_id.insert(id.clone(), path).is_some() {
            return Err(format!(
                "--chardev: attempt to add duplicate chardev '{id}'"
            ));
        }
    }
    let mut out = Vec::new();
    for m in monitors {
        let id = monitor(m)?;
        let path = by_id
            .remove(&id)
            .ok_or_else(|| format!("--monitor {m}: chardev \"{id}\" not found"))?;
        out.push(path);
    }
    if let Some(id) = by_id.keys().next() {
        return Err(format!(
            "--chardev id={id}: no --monitor uses it (fusex's chardevs are monitor sockets only)"
        ));
    }
    Ok(out)
}

/// A JSON object from a map (for tests).
#[cfg(test)]
fn obj(v: Value) -> Map<String, Value> {
    v.as_object().cloned().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn qsd_documented_fuse_invocation() {
        assert_eq!(
            blockdev("driver=file,node-name=file0,filename=/a,,b.img").unwrap(),
            json!({"driver": "file", "node-name": "file0", "filename": "/a,b.img"})
        );
        assert_eq!(
            blockdev("driver=qcow2,node-name=q,file.driver=file,file.filename=/q,read-only=on")
                .unwrap(),
            json!({"driver": "qcow2", "node-name": "q", "read-only": true,
                   "file": {"driver": "file", "filename": "/q"}})
        );
        // The driver may come first without its key, as qemu-storage-daemon takes it; a raw
        // node's offset and size take QEMU's size suffixes.
        assert_eq!(
            blockdev("raw,node-name=r,file=file0,offset=1M,size=4k").unwrap(),
            json!({"driver": "raw", "node-name": "r", "file": "file0",
                   "offset": 1048576, "size": 4096})
        );
        // A qcow2 node's cache sizes are integers (no suffix, as QEMU has them), its overlap
        // checks a mode or on/off switches.
        assert_eq!(
            blockdev("qcow2,node-name=q,file=f,l2-cache-size=0x100000,refcount-cache-size=65536,overlap-check.template=none,overlap-check.main-header=on")
                .unwrap(),
            json!({"driver": "qcow2", "node-name": "q", "file": "f",
                   "l2-cache-size": 1048576, "refcount-cache-size": 65536,
                   "overlap-check": {"template": "none", "main-header": true}})
        );
        assert_eq!(
            blockdev("qcow2,node-name=q,file=f,cache-size=1M").unwrap_err(),
            "--blockdev qcow2,node-name=q,file=f,cache-size=1M: Parameter 'cache-size' expects \
             integer"
        );
        // Its clean interval is a signed integer there (QEMU then finds a negative one too big).
        assert_eq!(
            blockdev("qcow2,node-name=q,file=f,cache-clean-interval=-1").unwrap(),
            json!({"driver": "qcow2", "node-name": "q", "file": "f", "cache-clean-interval": -1})
        );
        assert_eq!(
            blockdev("qcow2,node-name=q,file=f,cache-clean-interval=1.5").unwrap_err(),
            "--blockdev qcow2,node-name=q,file=f,cache-clean-interval=1.5: Parameter \
             'cache-clean-interval' expects integer"
        );
        assert_eq!(
            blockdev("node-name=x,file").unwrap_err(),
            "--blockdev node-name=x,file: Expected '=' after parameter 'file'"
        );
        assert_eq!(
            obj(export("type=fuse,id=e,node-name=n,mountpoint=/m,writable=on,__org.fusex_transport=legacy,__org.fusex_auto-unmount=on").unwrap()),
            obj(json!({"type": "fuse", "id": "e", "node-name": "n", "mountpoint": "/m",
                       "writable": true, "__org.fusex_transport": "legacy",
                       "__org.fusex_auto-unmount": true}))
        );
        assert_eq!(
            monitor_sockets(
                &["socket,id=mon0,path=/q.sock,server=on,wait=off".into()],
                &["chardev=mon0".into()]
            )
            .unwrap(),
            [ControlSocket::Path(PathBuf::from("/q.sock"))]
        );
        // The man page's Python example: a socket the parent bound, passed by number.
        assert_eq!(
            monitor_sockets(
                &["socket,fd=7,server=on,id=char1".into()],
                &["chardev=char1".into()]
            )
            .unwrap(),
            [ControlSocket::Fd(7)]
        );
    }

    /// `--object` values take their types as QEMU's visitor gives them (its words for a bad
    /// one, as qemu-storage-daemon 7.2 prints them); the id stays text.
    #[test]
    fn object_members_convert_to_their_types() {
        assert_eq!(
            object("iothread,id=7,poll-max-ns=32768,poll-grow=0x10").unwrap(),
            json!({"qom-type": "iothread", "id": "7", "poll-max-ns": 32768, "poll-grow": 16})
        );
        assert_eq!(
            object("tls-creds-x509,id=t0,dir=/p,verify-peer=off,endpoint=client").unwrap(),
            json!({"qom-type": "tls-creds-x509", "id": "t0", "dir": "/p",
                   "verify-peer": false, "endpoint": "client"})
        );
        assert_eq!(
            object("iothread,id=io0,poll-grow=x").unwrap_err(),
            "--object iothread,id=io0,poll-grow=x: Parameter 'poll-grow' expects integer"
        );
        assert!(object("tls-creds-x509,id=t0,verify-peer=maybe").is_err());
        // JSON, as QEMU takes it too.
        assert_eq!(
            object(r#"{"qom-type": "iothread", "id": "io1"}"#).unwrap(),
            json!({"qom-type": "iothread", "id": "io1"})
        );
    }

    #[test]
    fn what_fusex_lacks_is_named() {
        assert!(chardev("stdio,id=x").unwrap_err().contains("only socket"));
        assert!(chardev("socket,id=x,host=h,port=1")
            .unwrap_err()
            .contains("path=PATH"));
        assert!(chardev("socket,id=x,fd=1,server=on")
            .unwrap_err()
            .contains("above 2"));
        assert!(chardev("socket,id=x,fd=fdname,server=on")
            .unwrap_err()
            .contains("fd=fdname"));
        assert!(chardev("socket,id=x,fd=5,path=/q,server=on")
            .unwrap_err()
            .contains("not both"));
        assert!(monitor("chardev=x,mode=readline")
            .unwrap_err()
            .contains("mode=control"));
        assert!(monitor_sockets(&[], &["chardev=x".into()])
            .unwrap_err()
            .contains("\"x\" not found"));
        assert!(blockdev("driver=null-co,size=lots")
            .unwrap_err()
            .contains("'size'"));
    }
}
