//! Block nodes as QMP's `blockdev-add` declares them: a protocol node (`file`, `host_device`,
//! `nbd`, `null-co`) under an optional format node (`raw`, `qcow2`, `vpc`, `vdi`, `vmdk`,
//! `vhdx`), under an optional partition node (fusex's own driver [`PARTITION_DRIVER`]: QEMU has none). fusex
//! serves an image by its path (or URI), so a node is what it takes to name that image and how to
//! open it; the image is opened once when the node is added (to check it as QEMU does, and to
//! learn its size) and again by each export of it.

use serde::Deserialize;
use serde_json::{Map, Value};

use qmp::{parse_args, QmpError};

/// fusex's partition driver, named by QMP's convention for a downstream's own names
/// (`__RFQDN_name`), so no driver QEMU adds can clash: `{"driver": "__org.fusex_partition",
/// "node-name": "p1", "file": "disk", "partition": 1}` is partition 1 of node `disk`. Every
/// partition node over one child shares that child's opened image.
pub const PARTITION_DRIVER: &str = "__org.fusex_partition";

/// What kind of node, with what only that kind has.
#[derive(Clone, Debug, PartialEq)]
pub enum Driver {
    /// An image file (`file`) or block device (`host_device`).
    File { filename: String, device: bool },
    /// An export of an NBD server, as a URI fusex's NBD client takes.
    Nbd { uri: String },
    /// Reads zeroes, drops writes.
    Null { size: u64 },
    /// A raw format node over its `file` child.
    Raw,
    /// A qcow2 format node over its `file` child.
    Qcow2,
    /// One partition (numbered as Linux does) of its `file` child's image.
    Partition { number: u32 },
    /// A VHD format node (QEMU's `vpc`) over its `file` child.
    Vpc,
    /// A VMDK format node over its `file` child (a descriptor or a sparse extent).
    Vmdk,
    /// A VDI format node over its `file` child.
    Vdi,
    /// A VHDX format node over its `file` child.
    Vhdx,
}

impl Driver {
    /// QEMU's name of the driver.
    pub fn name(&self) -> &'static str {
        match self {
            Driver::File { device: false, .. } => "file",
            Driver::File { device: true, .. } => "host_device",
            Driver::Nbd { .. } => "nbd",
            Driver::Null { .. } => "null-co",
            Driver::Raw => "raw",
            Driver::Qcow2 => "qcow2",
            Driver::Partition { .. } => PARTITION_DRIVER,
            Driver::Vpc => "vpc",
            Driver::Vmdk => "vmdk",
            Driver::Vdi => "vdi",
            Driver::Vhdx => "vhdx",
        }
    }
}

/// One node.
#[derive(Clone, Debug)]
pub struct Node {
    pub name: String,
    pub driver: Driver,
    pub read_only: bool,
    /// `cache.direct`: O_DIRECT on the image.
    pub direct: bool,
    /// `cache.no-flush`.
    pub no_flush: bool,
    /// `locking: off` on a file node.
    pub no_locking: bool,
    /// `force-share`.
    pub force_share: bool,
    /// A format node's `file` child.
    pub file: Option<String>,
    /// `backing: null` on a qcow2 node: the backing file the image names is not opened.
    pub no_backing: bool,
    /// `backing: NODE` on a qcow2 node: that node's image backs it, in place of the one its
    /// header names.
    pub backing: Option<String>,
    /// Made by fusex for an object given inline as another node's child (named `#blockN`): it
    /// goes when that node goes.
    pub implicit: bool,
    /// The image's virtual size in bytes, learnt when the node was added.
    pub size: u64,
    /// The `blockdev-add` arguments that made it (None: an inline child, or an export's own
    /// node), which a `fusex restart` successor runs again.
    pub args: Option<Value>,
    /// When it was added, among the daemon's nodes.
    pub order: u64,
    /// An NBD node's `tls-creds`: the TLS credentials object it reads its certificates from.
    pub tls_creds: Option<String>,
    /// A raw node's `offset` and `size`: the byte range of its child it serves.
    pub range: Option<backend::ByteRange>,
    /// A qcow2 node's `cache-size`, `l2-cache-size` and `refcount-cache-size`, resolved to
    /// the two caches' sizes, and its `cache-clean-interval`.
    pub qcow2_cache: backend::qcow2::CacheOptions,
}

/// The members every driver takes (QAPI's `BlockdevOptionsBase`, as QEMU 7.2 has them).
const BASE: &[&str] = &[
    "driver",
    "node-name",
    "discard",
    "cache",
    "read-only",
    "auto-read-only",
    "force-share",
    "detect-zeroes",
];

/// Members QEMU's drivers have that fusex does not act on: named in a refusal, where a member no
/// driver has is "unexpected", as QEMU says.
const UNSUPPORTED: &[(&str, &[&str])] = &[
    (
        "file",
        &[
            "pr-manager",
            "aio-max-batch",
            "drop-cache",
            "x-check-cache-dropped",
        ],
    ),
    (
        "qcow2",
        &[
            "lazy-refcounts",
            "pass-discard-request",
            "pass-discard-snapshot",
            "pass-discard-other",
            "l2-cache-entry-size",
            "encrypt",
            "data-file",
        ],
    ),
    (
        "nbd",
        &["x-dirty-bitmap", "reconnect-delay", "open-timeout"],
    ),
    ("null-co", &["latency-ns"]),
];

/// The members a driver takes besides [`BASE`] that fusex acts on.
fn own_members(driver: &str) -> &'static [&'static str] {
    match driver {
        "file" | "host_device" => &["filename", "locking", "aio"],
        "raw" => &["file", "offset", "size"],
        "qcow2" => &[
            "file",
            "backing",
            "cache-size",
            "l2-cache-size",
            "refcount-cache-size",
            "cache-clean-interval",
            "overlap-check",
        ],
        "vpc" | "vdi" | "vmdk" | "vhdx" => &["file"],
        "nbd" => &["server", "export", "tls-creds", "tls-hostname"],
        "null-co" => &["size", "read-zeroes"],
        PARTITION_DRIVER => &["file", "partition"],
        _ => &[],
    }
}

/// The drivers QEMU's schema has that fusex does not serve, so that naming one is refused as
/// unsupported rather than as unknown.
const OTHER_DRIVERS: &[&str] = &[
    "blkdebug",
    "blklogwrites",
    "blkverify",
    "blkreplay",
    "bochs",
    "cloop",
    "compress",
    "copy-before-write",
    "copy-on-read",
    "dmg",
    "snapshot-access",
    "ftp",
    "ftps",
    "gluster",
    "host_cdrom",
    "http",
    "https",
    "io_uring",
    "iscsi",
    "luks",
    "nfs",
    "null-aio",
    "nvme",
    "parallels",
    "preallocate",
    "qcow",
    "qed",
    "quorum",
    "rbd",
    "replication",
    "ssh",
    "throttle",
    "virtio-blk-vfio-pci",
    "vvfat",
];

#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
struct Cache {
    #[serde(default)]
    direct: bool,
    #[serde(default)]
    no_flush: bool,
}

#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
#[allow(dead_code)] // members QEMU takes and fusex accepts, checked for their type only
struct Base {
    driver: String,
    node_name: Option<String>,
    discard: Option<Discard>,
    cache: Option<Cache>,
    #[serde(default)]
    read_only: bool,
    auto_read_only: Option<bool>,
    #[serde(default)]
    force_share: bool,
    detect_zeroes: Option<DetectZeroes>,
}

#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
enum Discard {
    Ignore,
    Unmap,
}

#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
enum DetectZeroes {
    Off,
    On,
    Unmap,
}

#[derive(Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
enum OnOffAuto {
    On,
    Off,
    Auto,
}

/// A file node's `aio`: how QEMU submits its I/O. fusex submits every node's I/O on the queue's
/// io_uring whichever is named, so the choice changes nothing but is checked as QEMU checks it.
#[derive(Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
enum Aio {
    Threads,
    Native,
    #[serde(rename = "io_uring")]
    IoUring,
}

#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
struct FileMembers {
    filename: String,
    locking: Option<OnOffAuto>,
    aio: Option<Aio>,
}

#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
struct RangeMembers {
    offset: Option<u64>,
    size: Option<u64>,
}

#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
struct NullMembers {
    size: Option<u64>,
    #[allow(dead_code)] // fusex's null node always reads zeroes
    read_zeroes: Option<bool>,
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case", deny_unknown_fields)]
enum SocketAddress {
    Unix {
        path: String,
    },
    Inet {
        host: String,
        port: String,
    },
    #[serde(other)]
    Other,
}

#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
struct NbdMembers {
    server: SocketAddress,
    export: Option<String>,
    tls_creds: Option<String>,
    tls_hostname: Option<String>,
}

/// Finds the TLS credentials an NBD node's `tls-creds` names (see `super::objects`).
pub type TlsOf<'a> = dyn Fn(&str) -> Result<super::objects::TlsCreds, QmpError> + 'a;

/// Reads one `blockdev-add` argument object into nodes: the node itself last, after the nodes it
/// defines inline as children (each named by `auto_name`). `exists` says whether a node name is
/// taken already; `node_of` finds a referenced child.
pub fn parse(
    args: Value,
    path: &str,
    auto_name: &mut dyn FnMut() -> String,
    node_of: &dyn Fn(&str) -> Option<Node>,
    tls_of: &TlsOf<'_>,
) -> Result<Vec<Node>, QmpError> {
    parse_below(args, path, false, auto_name, node_of, tls_of)
}

/// [`parse`] of a node whose parent has `cache.direct` on (`parent_direct`), which QEMU's
/// children inherit.
fn parse_below(
    args: Value,
    path: &str,
    parent_direct: bool,
    auto_name: &mut dyn FnMut() -> String,
    node_of: &dyn Fn(&str) -> Option<Node>,
    tls_of: &TlsOf<'_>,
) -> Result<Vec<Node>, QmpError> {
    let Value::Object(map) = args else {
        return Err(QmpError::generic(format!(
            "Invalid parameter type for '{path}', expected: object"
        )));
    };
    let named = |m: &str| {
        if path.is_empty() {
            m.to_string()
        } else {
            format!("{path}.{m}")
        }
    };
    let base: Base = parse_args(Value::Object(map.clone())).map_err(|e| prefix(e, path))?;
    let driver = base.driver.as_str();
    let own = own_members(driver);
    if own.is_empty() {
        if OTHER_DRIVERS.contains(&driver) {
            return Err(QmpError::generic(format!(
                "fusex does not support driver '{driver}': it serves file, host_device, raw, \
                 qcow2, vpc, vdi, vmdk, vhdx, nbd, null-co and {PARTITION_DRIVER} nodes"
            )));
        }
        return Err(QmpError::generic(format!(
            "Parameter '{}' does not accept value '{driver}'",
            named("driver")
        )));
    }
    let unsupported = UNSUPPORTED
        .iter()
        .find(|(d, _)| *d == driver || (*d == "file" && driver == "host_device"))
        .map_or(&[][..], |(_, m)| *m);
    let mut members = Map::new();
    for (k, v) in &map {
        if BASE.contains(&k.as_str()) {
            continue;
        }
        if own.contains(&k.as_str()) {
            members.insert(k.clone(), v.clone());
        } else if unsupported.contains(&k.as_str()) {
            return Err(QmpError::generic(format!(
                "fusex does not support '{}' on {driver} nodes: leave it out",
                named(k)
            )));
        } else {
            return Err(QmpError::generic(format!(
                "Parameter '{}' is unexpected",
                named(k)
            )));
        }
    }
    let cache = base.cache.unwrap_or(Cache {
        direct: false,
        no_flush: false,
    });
    let mut out = Vec::new();
    let mut node = Node {
        name: String::new(),
        driver: Driver::Raw,
        read_only: base.read_only,
        direct: cache.direct,
        no_flush: cache.no_flush,
        no_locking: false,
        force_share: base.force_share,
        file: None,
        no_backing: false,
        backing: None,
        implicit: !path.is_empty(),
        size: 0,
        args: None,
        order: 0,
        tls_creds: None,
        range: None,
        qcow2_cache: backend::qcow2::CacheOptions::default(),
    };
    node.driver = match driver {
        "file" | "host_device" => {
            let m: FileMembers = parse_args(Value::Object(members)).map_err(|e| prefix(e, path))?;
            if m.aio == Some(Aio::Native) && !(cache.direct || parent_direct) {
                // QEMU's words: Linux AIO is asynchronous only on O_DIRECT files.
                return Err(QmpError::generic(
                    "aio=native was specified, but it requires cache.direct=on, which was not \
                     specified.",
                ));
            }
            node.no_locking = m.locking == Some(OnOffAuto::Off);
            Driver::File {
                filename: m.filename,
                device: driver == "host_device",
            }
        }
        "null-co" => {
            let m: NullMembers = parse_args(Value::Object(members)).map_err(|e| prefix(e, path))?;
            Driver::Null {
                size: m.size.unwrap_or(1 << 30),
            }
        }
        "nbd" => {
            let m: NbdMembers = parse_args(Value::Object(members)).map_err(|e| prefix(e, path))?;
            let tls = m.tls_creds.as_deref().map(tls_of).transpose()?;
            node.tls_creds = m.tls_creds.clone();
            Driver::Nbd {
                uri: nbd_uri(&m, &named("server"), tls.as_ref())?,
            }
        }
        "raw" | "qcow2" | "vpc" | "vdi" | "vmdk" | "vhdx" | PARTITION_DRIVER => {
            let Some(file) = members.get("file").cloned() else {
                return Err(QmpError::generic(format!(
                    "Parameter '{}' is missing",
                    named("file")
                )));
            };
            node.file = Some(match file {
                Value::String(r) => {
                    if node_of(&r).is_none() {
                        return Err(QmpError::generic(format!(
                            "Cannot find device='' nor node-name='{r}'"
                        )));
                    }
                    r
                }
                Value::Object(_) => {
                    let children = parse_below(
                        file,
                        &named("file"),
                        cache.direct || parent_direct,
                        auto_name,
                        node_of,
                        tls_of,
                    )?;
                    let child = children.last().map(|c| c.name.clone()).unwrap_or_default();
                    out.extend(children);
                    child
                }
                _ => {
                    return Err(QmpError::generic(format!(
                        "Invalid parameter type for '{}', expected: object",
                        named("file")
                    )))
                }
            });
            if driver == PARTITION_DRIVER {
                let child = node
                    .file
                    .as_deref()
                    .and_then(|c| node_of(c).or_else(|| out.iter().find(|n| n.name == c).cloned()));
                if child
                    .as_ref()
                    .is_some_and(|c| matches!(c.driver, Driver::Partition { .. }))
                {
                    return Err(QmpError::generic(format!(
                        "'{}' is a partition node: a partition has no partitions of its own",
                        named("file")
                    )));
                }
                if child.is_some_and(|c| c.range.is_some()) {
                    return Err(QmpError::generic(format!(
                        "fusex does not support partitions of a raw node with offset or size \
                         ('{}'): give the partition node the whole image",
                        named("file")
                    )));
                }
                let number = match members.get("partition") {
                    Some(Value::Number(n)) => {
                        n.as_u64().filter(|&n| (1..=u32::MAX as u64).contains(&n))
                    }
                    Some(_) => None,
                    None => {
                        return Err(QmpError::generic(format!(
                            "Parameter '{}' is missing",
                            named("partition")
                        )))
                    }
                };
                let Some(number) = number else {
                    return Err(QmpError::generic(format!(
                        "Parameter '{}' expects a partition number from 1",
                        named("partition")
                    )));
                };
                Driver::Partition {
                    number: number as u32,
                }
            } else {
                match members.get("backing").cloned() {
                    None => {}
                    Some(Value::Null) => node.no_backing = true,
                    Some(Value::String(r)) => {
                        if node_of(&r).is_none() {
                            // qemu-storage-daemon's words.
                            return Err(QmpError::generic(format!(
                                "Could not open backing file: Cannot find device='{r}' nor \
                                 node-name='{r}'"
                            )));
                        }
                        node.backing = Some(r);
                    }
                    Some(b @ Value::Object(_)) => {
                        let children = parse_below(
                            b,
                            &named("backing"),
                            cache.direct || parent_direct,
                            auto_name,
                            node_of,
                            tls_of,
                        )?;
                        node.backing = children.last().map(|c| c.name.clone());
                        out.extend(children);
                    }
                    Some(_) => {
                        return Err(QmpError::generic(format!(
                            "Invalid parameter type for '{}', expected: BlockdevRefOrNull",
                            named("backing")
                        )))
                    }
                }
                if driver == "qcow2" {
                    let mut m = members.clone();
                    m.remove("file");
                    m.remove("backing");
                    node.qcow2_cache = qcow2_members(m, path)?;
                }
                if driver == "raw" {
                    let mut range = members.clone();
                    range.remove("file");
                    let m: RangeMembers =
                        parse_args(Value::Object(range)).map_err(|e| prefix(e, path))?;
                    node.range =
                        (m.offset.is_some() || m.size.is_some()).then(|| backend::ByteRange {
                            offset: m.offset.unwrap_or(0),
                            size: m.size,
                        });
                }
                match driver {
                    "raw" => Driver::Raw,
                    "vpc" => Driver::Vpc,
                    "vdi" => Driver::Vdi,
                    "vhdx" => Driver::Vhdx,
                    "vmdk" => Driver::Vmdk,
                    _ => Driver::Qcow2,
                }
            }
        }
        _ => unreachable!("own_members covers these"),
    };
    node.name = match base.node_name {
        Some(n) => n,
        None if !path.is_empty() => auto_name(),
        None => {
            // qemu-storage-daemon's words.
            return Err(QmpError::generic(
                "'node-name' must be specified for the root node",
            ));
        }
    };
    out.push(node);
    Ok(out)
}

#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
struct Qcow2Members {
    cache_size: Option<u64>,
    l2_cache_size: Option<u64>,
    refcount_cache_size: Option<u64>,
    cache_clean_interval: Option<i64>,
}

/// QAPI's `Qcow2OverlapCheckMode`: which checks `overlap-check` asks for, as a mode.
#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
enum OverlapMode {
    None,
    Constant,
    Cached,
    All,
}

/// QAPI's `Qcow2OverlapCheckFlags`: `overlap-check` as a template and checks one by one.
/// Checked, then not acted on: fusex checks every write against all of the image's metadata,
/// whatever checks this asks for.
#[allow(dead_code)]
#[derive(Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct OverlapChecks {
    template: Option<OverlapMode>,
    main_header: Option<bool>,
    active_l1: Option<bool>,
    active_l2: Option<bool>,
    refcount_table: Option<bool>,
    refcount_block: Option<bool>,
    snapshot_table: Option<bool>,
    inactive_l1: Option<bool>,
    inactive_l2: Option<bool>,
    bitmap_directory: Option<bool>,
}

/// A qcow2 node's own members (besides `file` and `backing`): the cache sizes resolved as QEMU
/// resolves them (any two of the three, `cache-size` the sum), `cache-clean-interval`, and
/// `overlap-check` checked.
/// `cache-size` alone is shared as fusex shares its default budget (¾ L2 tables).
fn qcow2_members(
    mut members: Map<String, Value>,
    path: &str,
) -> Result<backend::qcow2::CacheOptions, QmpError> {
    use backend::qcow2::CacheOptions;
    if let Some(v) = members.remove("overlap-check") {
        // QAPI's `Qcow2OverlapChecks` is a mode or the checks one by one: each form is checked
        // for QEMU's words.
        let named = if path.is_empty() {
            "overlap-check".to_string()
        } else {
            format!("{path}.overlap-check")
        };
        match &v {
            Value::String(_) => {
                parse_args::<OverlapMode>(v.clone()).map_err(|_| {
                    QmpError::generic(format!(
                        "Parameter '{named}' does not accept value '{}'",
                        v.as_str().unwrap_or_default()
                    ))
                })?;
            }
            Value::Object(o) => {
                // QEMU names a template it does not know without the path (as its alternate
                // visitor does), every other fault in the object with it.
                if let Some(t @ Value::String(name)) = o.get("template") {
                    if parse_args::<OverlapMode>(t.clone()).is_err() {
                        return Err(QmpError::generic(format!(
                            "Parameter 'template' does not accept value '{name}'"
                        )));
                    }
                }
                parse_args::<OverlapChecks>(v.clone()).map_err(|e| prefix(e, &named))?;
            }
            _ => {
                return Err(QmpError::generic(format!(
                    "Invalid parameter type for '{named}', expected: Qcow2OverlapChecks"
                )))
            }
        }
    }
    let m: Qcow2Members = parse_args(Value::Object(members)).map_err(|e| prefix(e, path))?;
    // qemu-storage-daemon's words.
    let exceeds = |what: &str| QmpError::generic(format!("{what} may not exceed cache-size"));
    let (l2, refcount) =
        match (m.cache_size, m.l2_cache_size, m.refcount_cache_size) {
            (Some(_), Some(_), Some(_)) => return Err(QmpError::generic(
                "cache-size, l2-cache-size and refcount-cache-size may not be set at the same time",
            )),
            (Some(all), Some(l2), None) => (
                Some(l2),
                Some(
                    all.checked_sub(l2)
                        .ok_or_else(|| exceeds("l2-cache-size"))?,
                ),
            ),
            (Some(all), None, Some(rc)) => (
                Some(
                    all.checked_sub(rc)
                        .ok_or_else(|| exceeds("refcount-cache-size"))?,
                ),
                Some(rc),
            ),
            (Some(all), None, None) => (Some(all / 4 * 3), Some(all / 4)),
            (None, l2, refcount) => (l2, refcount),
        };
    // QEMU reads the interval as an unsigned number of seconds that fits 32 bits: a negative
    // one is a huge one.
    let clean_interval = m
        .cache_clean_interval
        .map(|secs| {
            u32::try_from(secs).map_err(|_| QmpError::generic("Cache clean interval too big"))
        })
        .transpose()?;
    Ok(CacheOptions {
        l2,
        refcount,
        clean_interval,
    })
}

/// An error about a nested object's member, named by its full path.
fn prefix(e: QmpError, path: &str) -> QmpError {
    if path.is_empty() {
        return e;
    }
    let desc = e
        .desc
        .replacen("Parameter '", &format!("Parameter '{path}."), 1)
        .replacen("type for '", &format!("type for '{path}."), 1);
    QmpError::generic(desc)
}

/// The URI fusex's NBD client opens for a `server` and `export`, over TLS with `tls` (the
/// `tls-creds` object's directory, `verify-peer` and the node's `tls-hostname`).
fn nbd_uri(
    m: &NbdMembers,
    what: &str,
    tls: Option<&super::objects::TlsCreds>,
) -> Result<String, QmpError> {
    use nbd::uri::{NbdUri, Tls, Transport};
    let transport = match &m.server {
        SocketAddress::Unix { path } => Transport::Unix(path.into()),
        SocketAddress::Inet { host, port } => Transport::Tcp {
            host: host.clone(),
            port: port.parse().map_err(|_| {
                QmpError::generic(format!(
                    "fusex does not support port '{port}' in '{what}': give a port number"
                ))
            })?,
        },
        SocketAddress::Other => {
            return Err(QmpError::generic(format!(
                "fusex does not support this '{what}' type: give type unix or inet"
            )))
        }
    };
    let uri = NbdUri {
        transport,
        export: m.export.clone().unwrap_or_default(),
        tls: tls.map(|t| Tls {
            certificates: Some(t.dir.clone()),
            verify_peer: t.verify_peer,
            hostname: m.tls_hostname.clone(),
        }),
    };
    uri.check()
        .map_err(|e| QmpError::generic(format!("fusex cannot reach '{what}': {e}")))?;
    Ok(uri.to_string())
}

/// An NBD node's URI as `query-named-block-nodes` shows it: the server and export, without the
/// TLS settings (as QEMU shows a node with `tls-creds`).
fn without_tls(uri: &str) -> String {
    nbd::uri::NbdUri::parse(uri).map_or_else(|_| uri.to_string(), |u| u.without_tls().to_string())
}

impl Node {
    /// The node of an export that names its image itself: the image's protocol node, named
    /// `name` and removed with the export.
    pub fn of_image(name: &str, args: &crate::cli::MountArgs) -> Node {
        let driver = if nbd::uri::is_nbd_uri(&args.image) {
            Driver::Nbd {
                uri: args.image.clone(),
            }
        } else if let Some(size) = args.image.strip_prefix("null:") {
            Driver::Null {
                size: backend::parse_size(size).unwrap_or(0),
            }
        } else {
            Driver::File {
                filename: args.image.clone(),
                device: false,
            }
        };
        Node {
            name: name.to_string(),
            driver,
            read_only: !args.writable,
            direct: args.direct,
            no_flush: false,
            no_locking: args.no_locking,
            force_share: args.force_share,
            file: None,
            no_backing: args.no_backing,
            backing: None,
            implicit: true,
            size: 0,
            args: None,
            order: 0,
            tls_creds: None,
            range: None,
            qcow2_cache: backend::qcow2::CacheOptions::default(),
        }
    }

    /// The image behind a node and its format, as `fusex mount` takes them: (IMAGE, --format),
    /// no format for images that have none (NBD, null),
    /// following a format node to its `file` child.
    pub fn image(
        &self,
        node_of: &dyn Fn(&str) -> Option<Node>,
    ) -> Option<(String, Option<&'static str>)> {
        let protocol = |n: &Node| match &n.driver {
            Driver::File { filename, .. } => Some(filename.clone()),
            Driver::Nbd { uri } => Some(uri.clone()),
            Driver::Null { size } => Some(format!("null:{size}")),
            Driver::Raw
            | Driver::Qcow2
            | Driver::Vpc
            | Driver::Vdi
            | Driver::Vhdx
            | Driver::Vmdk
            | Driver::Partition { .. } => None,
        };
        // NBD and null images have no format of their own: fusex mount takes them as they are.
        match self.driver {
            Driver::Raw => Some((protocol(&node_of(self.file.as_deref()?)?)?, Some("raw"))),
            Driver::Qcow2 => Some((protocol(&node_of(self.file.as_deref()?)?)?, Some("qcow2"))),
            Driver::Vpc => Some((protocol(&node_of(self.file.as_deref()?)?)?, Some("vhd"))),
            Driver::Vmdk => Some((protocol(&node_of(self.file.as_deref()?)?)?, Some("vmdk"))),
            Driver::Vdi => Some((protocol(&node_of(self.file.as_deref()?)?)?, Some("vdi"))),
            Driver::Vhdx => Some((protocol(&node_of(self.file.as_deref()?)?)?, Some("vhdx"))),
            Driver::File { .. } => Some((protocol(self)?, Some("raw"))),
            Driver::Nbd { .. } | Driver::Null { .. } => Some((protocol(self)?, None)),
            Driver::Partition { .. } => node_of(self.file.as_deref()?)?.image(node_of),
        }
    }

    /// The `--backing` levels of a qcow2 node whose `backing` names a node (empty when its
    /// header's backing is used): each backing node is a qcow2 or raw node over a file node, or
    /// a file node itself; a qcow2 backing node's own `backing` continues the chain.
    pub fn backing_levels(
        &self,
        node_of: &dyn Fn(&str) -> Option<Node>,
    ) -> Result<Vec<backend::qcow2::BackingLevel>, QmpError> {
        use backend::qcow2::BackingLevel;
        let mut levels = Vec::new();
        let mut cur = self.clone();
        while let Some(name) = cur.backing.clone() {
            let Some(b) = node_of(&name) else {
                return Err(QmpError::generic(format!(
                    "Cannot find device='' nor node-name='{name}'"
                )));
            };
            let filename = |n: &Node| match &n.driver {
                Driver::File { filename, .. } => Some(filename.clone()),
                _ => None,
            };
            let on_file = b
                .file
                .as_deref()
                .and_then(node_of)
                .and_then(|f| filename(&f));
            let unsupported = || {
                QmpError::generic(format!(
                    "fusex does not support node '{name}' ({}) as a backing node: give a qcow2 \
                     or raw node over a file node, or a file node",
                    b.driver.name()
                ))
            };
            match &b.driver {
                Driver::File { filename, .. } => levels.push(BackingLevel::Raw(filename.into())),
                Driver::Raw if b.range.is_none() => {
                    levels.push(BackingLevel::Raw(on_file.ok_or_else(unsupported)?.into()))
                }
                Driver::Qcow2 => {
                    levels.push(BackingLevel::Qcow2(on_file.ok_or_else(unsupported)?.into()));
                    if b.no_backing {
                        levels.push(BackingLevel::None);
                    }
                    cur = b;
                    continue;
                }
                _ => return Err(unsupported()),
            }
            break;
        }
        backend::qcow2::check_chain(&levels).map_err(|e| QmpError::generic(e.to_string()))?;
        Ok(levels)
    }

    /// The `fusex mount` words that bound an export of this node to a part of its image: its
    /// partition, or a raw node's `offset` and `size`.
    pub fn part_words(&self) -> Vec<String> {
        let mut words: Vec<String> = self
            .partition()
            .map(|p| format!("--partition={p}"))
            .into_iter()
            .collect();
        if let Some(r) = self.range {
            words.push(format!("--offset={}", r.offset));
            words.extend(r.size.map(|s| format!("--size={s}")));
        }
        words
    }

    /// Refuses a raw node's range that its child's `whole` bytes do not hold, or whose size is
    /// not a whole number of sectors, in qemu-storage-daemon's words.
    pub fn check_range(&self, whole: u64) -> Result<(), QmpError> {
        let Some(r) = self.range else {
            return Ok(());
        };
        if r.offset > whole {
            return Err(QmpError::generic(format!(
                "Offset ({}) cannot be greater than size of the containing file ({whole})",
                r.offset
            )));
        }
        let Some(size) = r.size else {
            return Ok(());
        };
        if whole - r.offset < size {
            // QEMU's text has the two spaces.
            return Err(QmpError::generic(format!(
                "The sum of offset ({}) and size ({size}) has to be smaller or equal to the  \
                 actual size of the containing file ({whole})",
                r.offset
            )));
        }
        if size % 512 != 0 {
            return Err(QmpError::generic("Specified size is not multiple of 512"));
        }
        Ok(())
    }

    /// The partition this node serves of its child's image (None: the whole image).
    pub fn partition(&self) -> Option<u32> {
        match self.driver {
            Driver::Partition { number } => Some(number),
            _ => None,
        }
    }

    /// The `file` member QEMU's `query-named-block-nodes` shows: the protocol node's file name.
    pub fn shown_file(&self, node_of: &dyn Fn(&str) -> Option<Node>) -> String {
        if let (Driver::Raw, Some(range)) = (&self.driver, self.range) {
            if let Some(shown) = self.shown_range(range, node_of) {
                return shown;
            }
        }
        match &self.driver {
            Driver::File { filename, .. } => filename.clone(),
            Driver::Nbd { uri } => without_tls(uri),
            Driver::Null { .. } => "null-co://".into(),
            Driver::Raw
            | Driver::Qcow2
            | Driver::Vpc
            | Driver::Vdi
            | Driver::Vhdx
            | Driver::Vmdk
            | Driver::Partition { .. } => self
                .file
                .as_deref()
                .and_then(node_of)
                .map(|c| c.shown_file(node_of))
                .unwrap_or_default(),
        }
    }
}

impl Node {
    /// A raw node serving a byte range of a file node, as QEMU names it: its options as JSON,
    /// members in the order QEMU's dictionary gives them (`offset`, `driver`, `size`, `file`).
    /// None for a range of another kind of node (shown by its child's name instead).
    fn shown_range(
        &self,
        range: backend::ByteRange,
        node_of: &dyn Fn(&str) -> Option<Node>,
    ) -> Option<String> {
        let child = self.file.as_deref().and_then(node_of)?;
        let Driver::File { filename, .. } = &child.driver else {
            return None;
        };
        let size = range
            .size
            .map(|s| format!(", \"size\": {s}"))
            .unwrap_or_default();
        Some(format!(
            "json:{{\"offset\": {}, \"driver\": \"raw\"{size}, \"file\": {{\"driver\": {}, \
             \"filename\": {}}}}}",
            range.offset,
            Value::from(child.driver.name()),
            Value::from(filename.as_str()),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::path::Path;

    fn nodes(args: Value) -> Result<Vec<Node>, String> {
        let mut n = 0;
        let file0 = Node {
            name: "file0".into(),
            driver: Driver::File {
                filename: "/a".into(),
                device: false,
            },
            read_only: false,
            direct: false,
            no_flush: false,
            no_locking: false,
            force_share: false,
            file: None,
            no_backing: false,
            backing: None,
            implicit: false,
            size: 0,
            args: None,
            order: 0,
            tls_creds: None,
            range: None,
            qcow2_cache: backend::qcow2::CacheOptions::default(),
        };
        let lookup = move |name: &str| (name == "file0").then(|| file0.clone());
        let tls = |id: &str| match id {
            "t0" => Ok(crate::service::objects::TlsCreds {
                dir: "/etc/pki/a b".into(),
                client: true,
                verify_peer: true,
            }),
            "tv" => Ok(crate::service::objects::TlsCreds {
                dir: "/pki".into(),
                client: true,
                verify_peer: false,
            }),
            _ => Err(QmpError::generic(format!(
                "No TLS credentials with id '{id}'"
            ))),
        };
        parse(
            args,
            "",
            &mut || {
                n += 1;
                format!("#block{n}")
            },
            &lookup,
            &tls,
        )
        .map_err(|e| e.desc)
    }

    #[test]
    fn nbd_nodes_with_tls_credentials_become_nbds_uris() {
        let uri = |args: Value| match nodes(args).unwrap().pop().unwrap() {
            Node {
                driver: Driver::Nbd { uri },
                tls_creds,
                ..
            } => (uri, tls_creds),
            n => panic!("{n:?}"),
        };
        let (u, creds) = uri(json!({"driver": "nbd", "node-name": "n",
            "server": {"type": "unix", "path": "/run/nbd.sock"}, "export": "disk",
            "tls-creds": "t0", "tls-hostname": "srv.example"}));
        assert_eq!(
            u,
            "nbds+unix:///disk?socket=/run/nbd.sock&tls-certificates=/etc/pki/a%20b&tls-hostname=srv.example"
        );
        assert_eq!(creds.as_deref(), Some("t0"));
        let parsed = nbd::uri::NbdUri::parse(&u).unwrap();
        let tls = parsed.tls.unwrap();
        assert_eq!(tls.certificates.as_deref(), Some(Path::new("/etc/pki/a b")));
        assert_eq!(tls.hostname.as_deref(), Some("srv.example"));
        let (u, _) = uri(json!({"driver": "nbd", "node-name": "n",
            "server": {"type": "inet", "host": "h", "port": "10809"}, "tls-creds": "tv"}));
        assert_eq!(
            u,
            "nbds://h:10809/?tls-certificates=/pki&tls-verify-peer=false"
        );
        assert_eq!(without_tls(&u), "nbd://h:10809/");
        assert_eq!(
            without_tls("nbds+unix:///d?socket=/s&tls-certificates=/p"),
            "nbd+unix:///d?socket=/s"
        );
        assert_eq!(
            nodes(json!({"driver": "nbd", "node-name": "n",
                "server": {"type": "unix", "path": "/s"}, "tls-creds": "nope"}))
            .unwrap_err(),
            "No TLS credentials with id 'nope'"
        );
    }

    /// A raw node serving a byte range is named as QEMU names it: its options as JSON, in
    /// QEMU's member order; without a range, by its file's name.
    #[test]
    fn a_raw_range_is_shown_as_qemu_shows_it() {
        let file0 = nodes(json!({"driver": "file", "node-name": "file0", "filename": "/a \"b\""}))
            .unwrap()
            .remove(0);
        let lookup = |name: &str| (name == "file0").then(|| file0.clone());
        let shown = |extra: Value| {
            let mut args = json!({"driver": "raw", "node-name": "r", "file": "file0"});
            args.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            nodes(args).unwrap().pop().unwrap().shown_file(&lookup)
        };
        assert_eq!(
            shown(json!({"offset": 512, "size": 1024})),
            r#"json:{"offset": 512, "driver": "raw", "size": 1024, "file": {"driver": "file", "filename": "/a \"b\""}}"#
        );
        assert_eq!(
            shown(json!({"offset": 512})),
            r#"json:{"offset": 512, "driver": "raw", "file": {"driver": "file", "filename": "/a \"b\""}}"#
        );
        assert_eq!(shown(json!({})), "/a \"b\"");
    }

    #[test]
    fn a_format_node_over_an_inline_file_node_makes_two() {
        let v = nodes(json!({"driver": "qcow2", "node-name": "q",
                             "file": {"driver": "file", "filename": "/b.qcow2"}}))
        .unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].name, "#block1");
        assert!(v[0].implicit);
        assert_eq!(v[1].file.as_deref(), Some("#block1"));
        assert_eq!(v[1].driver, Driver::Qcow2);
    }

    /// Any two of QEMU's three cache sizes give both caches (`cache-size` is their sum); one
    /// alone gives its cache; `cache-size` alone is split as fusex splits its default budget;
    /// `cache-clean-interval` is checked as QEMU checks it.
    #[test]
    fn qcow2_cache_sizes_resolve_as_qemu_resolves_them() {
        use backend::qcow2::CacheOptions;
        let sizes = |extra: Value| {
            let mut args = json!({"driver": "qcow2", "node-name": "q", "file": "file0"});
            args.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            nodes(args).map(|v| v.last().unwrap().qcow2_cache)
        };
        let both = |l2, refcount| {
            Ok(CacheOptions {
                l2: Some(l2),
                refcount: Some(refcount),
                clean_interval: None,
            })
        };
        assert_eq!(sizes(json!({})), Ok(CacheOptions::default()));
        assert_eq!(
            sizes(json!({"cache-size": 4 << 20, "l2-cache-size": 3 << 20})),
            both(3 << 20, 1 << 20)
        );
        assert_eq!(
            sizes(json!({"cache-size": 4 << 20, "refcount-cache-size": 1 << 20})),
            both(3 << 20, 1 << 20)
        );
        assert_eq!(
            sizes(json!({"cache-size": 4 << 20})),
            both(3 << 20, 1 << 20)
        );
        assert_eq!(
            sizes(json!({"l2-cache-size": 1 << 20})),
            Ok(CacheOptions {
                l2: Some(1 << 20),
                refcount: None,
                clean_interval: None,
            })
        );
        // `cache-clean-interval`: seconds that fit 32 bits, 0 for never; anything else is too
        // big in QEMU's words (a negative number read unsigned is).
        for secs in [0u32, 1, 600, u32::MAX] {
            assert_eq!(
                sizes(json!({"cache-clean-interval": secs})),
                Ok(CacheOptions {
                    clean_interval: Some(secs),
                    ..CacheOptions::default()
                })
            );
        }
        for bad in [json!(-1), json!(1u64 << 32)] {
            assert_eq!(
                sizes(json!({"cache-clean-interval": bad})).unwrap_err(),
                "Cache clean interval too big"
            );
        }
        assert_eq!(
            sizes(json!({"cache-size": 1, "l2-cache-size": 2})).unwrap_err(),
            "l2-cache-size may not exceed cache-size"
        );
        assert_eq!(
            sizes(json!({"cache-size": 1, "refcount-cache-size": 2})).unwrap_err(),
            "refcount-cache-size may not exceed cache-size"
        );
        assert_eq!(
            sizes(json!({"cache-size": 3, "l2-cache-size": 2, "refcount-cache-size": 1}))
                .unwrap_err(),
            "cache-size, l2-cache-size and refcount-cache-size may not be set at the same time"
        );
    }

    /// `overlap-check` takes a mode or checks one by one, refused in QEMU's words when it is
    /// neither; whichever it asks, fusex checks every write against all the metadata.
    #[test]
    fn overlap_check_takes_either_form() {
        let with = |v: Value| {
            nodes(json!({"driver": "qcow2", "node-name": "q", "file": "file0",
                         "overlap-check": v}))
            .map(|_| ())
        };
        for ok in [
            json!("none"),
            json!("all"),
            json!({}),
            json!({"template": "constant", "active-l2": false, "bitmap-directory": true}),
        ] {
            assert_eq!(with(ok.clone()), Ok(()), "{ok}");
        }
        for (bad, why) in [
            (
                json!("most"),
                "Parameter 'overlap-check' does not accept value 'most'",
            ),
            (
                json!({"template": "most"}),
                "Parameter 'template' does not accept value 'most'",
            ),
            (
                json!({"main-header": "yes"}),
                "Invalid parameter type for 'overlap-check.main-header', expected: boolean",
            ),
            (
                json!({"l3": true}),
                "Parameter 'overlap-check.l3' is unexpected",
            ),
            (
                json!(5),
                "Invalid parameter type for 'overlap-check', expected: Qcow2OverlapChecks",
            ),
        ] {
            assert_eq!(with(bad.clone()).unwrap_err(), why, "{bad}");
        }
    }

    #[test]
    fn aio_is_checked_as_qemu_checks_it() {
        for aio in ["threads", "io_uring"] {
            nodes(json!({"driver": "file", "node-name": "f", "filename": "/a", "aio": aio}))
                .unwrap();
        }
        assert_eq!(
            nodes(json!({"driver": "file", "node-name": "f", "filename": "/a", "aio": "bogus"}))
                .unwrap_err(),
            "Parameter 'aio' does not accept value 'bogus'"
        );
        let native = "aio=native was specified, but it requires cache.direct=on, which was not \
                      specified.";
        assert_eq!(
            nodes(json!({"driver": "file", "node-name": "f", "filename": "/a", "aio": "native"}))
                .unwrap_err(),
            native
        );
        nodes(
            json!({"driver": "file", "node-name": "f", "filename": "/a", "aio": "native",
                     "cache": {"direct": true}}),
        )
        .unwrap();
        // A child inherits its parent's cache.direct, as in QEMU.
        let v = nodes(
            json!({"driver": "qcow2", "node-name": "q", "cache": {"direct": true},
                             "file": {"driver": "file", "filename": "/b", "aio": "native"}}),
        )
        .unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(
            nodes(json!({"driver": "qcow2", "node-name": "q",
                         "file": {"driver": "file", "filename": "/b", "aio": "native"}}))
            .unwrap_err(),
            native
        );
    }

    #[test]
    fn errors_name_the_member_as_qemu_does() {
        assert_eq!(
            nodes(json!({"node-name": "x"})).unwrap_err(),
            "Parameter 'driver' is missing"
        );
        assert_eq!(
            nodes(json!({"driver": "vmdkx", "node-name": "x"})).unwrap_err(),
            "Parameter 'driver' does not accept value 'vmdkx'"
        );
        assert_eq!(
            nodes(json!({"driver": "file", "node-name": "x", "filename": "/a", "bogus": 1}))
                .unwrap_err(),
            "Parameter 'bogus' is unexpected"
        );
        assert_eq!(
            nodes(json!({"driver": "raw", "node-name": "x",
                         "file": {"driver": "file", "filename": 3}}))
            .unwrap_err(),
            "Invalid parameter type for 'file.filename', expected: string"
        );
        assert_eq!(
            nodes(json!({"driver": "raw", "node-name": "x", "file": "nope"})).unwrap_err(),
            "Cannot find device='' nor node-name='nope'"
        );
        assert!(nodes(json!({"driver": "dmg", "node-name": "x"}))
            .unwrap_err()
            .contains("does not support driver 'dmg'"));
        assert!(
            nodes(json!({"driver": "qcow2", "node-name": "x", "file": "file0",
                             "lazy-refcounts": true}))
            .unwrap_err()
            .contains("'lazy-refcounts'")
        );
    }

    /// A qcow2 node's `backing` names a node or defines one inline; the chain it makes goes
    /// to the export as `--backing` levels, and what cannot back an image is refused in one
    /// line.
    #[test]
    fn backing_nodes_make_the_chain_of_levels() {
        use backend::qcow2::BackingLevel;
        let v = nodes(
            json!({"driver": "qcow2", "node-name": "top", "file": "file0",
            "backing": {"driver": "qcow2", "file": {"driver": "file", "filename": "/mid"},
                        "backing": {"driver": "raw",
                                    "file": {"driver": "file", "filename": "/base"}}}}),
        )
        .unwrap();
        let all = v.clone();
        let lookup = move |name: &str| all.iter().find(|n| n.name == name).cloned();
        let top = v.last().unwrap();
        assert_eq!(top.name, "top");
        assert_eq!(
            top.backing_levels(&lookup).unwrap(),
            [
                BackingLevel::Qcow2("/mid".into()),
                BackingLevel::Raw("/base".into())
            ]
        );
        assert!(v[..v.len() - 1].iter().all(|n| n.implicit));
        // `backing: null` on a lower level ends the chain there.
        let v = nodes(
            json!({"driver": "qcow2", "node-name": "top", "file": "file0",
            "backing": {"driver": "qcow2", "backing": null,
                        "file": {"driver": "file", "filename": "/mid"}}}),
        )
        .unwrap();
        let all = v.clone();
        let lookup = move |name: &str| all.iter().find(|n| n.name == name).cloned();
        assert_eq!(
            v.last().unwrap().backing_levels(&lookup).unwrap(),
            [BackingLevel::Qcow2("/mid".into()), BackingLevel::None]
        );
        // A file node backs an image as raw; a null node cannot back one.
        let v = nodes(
            json!({"driver": "qcow2", "node-name": "top", "file": "file0",
                             "backing": "file0"}),
        )
        .unwrap();
        let f0 = nodes(json!({"driver": "file", "node-name": "file0", "filename": "/a"})).unwrap();
        let lookup = move |name: &str| f0.iter().find(|n| n.name == name).cloned();
        assert_eq!(
            v[0].backing_levels(&lookup).unwrap(),
            [BackingLevel::Raw("/a".into())]
        );
        let v = nodes(
            json!({"driver": "qcow2", "node-name": "top", "file": "file0",
                             "backing": {"driver": "null-co"}}),
        )
        .unwrap();
        let all = v.clone();
        let lookup = move |name: &str| all.iter().find(|n| n.name == name).cloned();
        let e = v.last().unwrap().backing_levels(&lookup).unwrap_err().desc;
        assert!(e.contains("as a backing node"), "{e}");
        assert_eq!(
            nodes(json!({"driver": "qcow2", "node-name": "x", "file": "file0",
                         "backing": "nope"}))
            .unwrap_err(),
            "Could not open backing file: Cannot find device='nope' nor node-name='nope'"
        );
        assert_eq!(
            nodes(json!({"driver": "qcow2", "node-name": "x", "file": "file0", "backing": 3}))
                .unwrap_err(),
            "Invalid parameter type for 'backing', expected: BlockdevRefOrNull"
        );
    }

    #[test]
    fn raw_nodes_serve_a_byte_range_of_their_file() {
        use backend::ByteRange;
        let v = nodes(json!({"driver": "raw", "node-name": "r", "file": "file0",
                             "offset": 4096, "size": 8192}))
        .unwrap();
        let r = v.last().unwrap();
        assert_eq!(
            r.range,
            Some(ByteRange {
                offset: 4096,
                size: Some(8192)
            })
        );
        assert_eq!(r.part_words(), ["--offset=4096", "--size=8192"]);
        r.check_range(12288).unwrap();
        assert_eq!(
            r.check_range(12287).unwrap_err().desc,
            "The sum of offset (4096) and size (8192) has to be smaller or equal to the  actual \
             size of the containing file (12287)"
        );
        assert_eq!(
            r.check_range(4095).unwrap_err().desc,
            "Offset (4096) cannot be greater than size of the containing file (4095)"
        );
        let v = nodes(json!({"driver": "raw", "node-name": "r", "file": "file0", "size": 1000}))
            .unwrap();
        assert_eq!(v[0].part_words(), ["--offset=0", "--size=1000"]);
        assert_eq!(
            v[0].check_range(1 << 20).unwrap_err().desc,
            "Specified size is not multiple of 512"
        );
        let v = nodes(json!({"driver": "raw", "node-name": "r", "file": "file0"})).unwrap();
        assert_eq!(v[0].range, None);
        assert!(v[0].part_words().is_empty());
        v[0].check_range(0).unwrap();
        let e = nodes(json!({"driver": "raw", "node-name": "r", "file": "file0",
                             "offset": -1}))
        .unwrap_err();
        assert!(e.contains("'offset'"), "{e}");
        // Neither a partition of a range nor a range as a backing node: each would lose it.
        let e = nodes(
            json!({"driver": PARTITION_DRIVER, "node-name": "p", "partition": 1,
                             "file": {"driver": "raw", "offset": 512, "file": "file0"}}),
        )
        .unwrap_err();
        assert!(
            e.contains("partitions of a raw node with offset or size"),
            "{e}"
        );
        let v = nodes(
            json!({"driver": "qcow2", "node-name": "top", "file": "file0",
                             "backing": {"driver": "raw", "size": 512, "file": "file0"}}),
        )
        .unwrap();
        let all = v.clone();
        let lookup = move |name: &str| all.iter().find(|n| n.name == name).cloned();
        let e = v.last().unwrap().backing_levels(&lookup).unwrap_err().desc;
        assert!(e.contains("as a backing node"), "{e}");
    }

    #[test]
    fn partition_nodes_stand_on_a_node_and_name_a_number() {
        let v = nodes(json!({"driver": PARTITION_DRIVER, "node-name": "p",
                             "file": "file0", "partition": 5}))
        .unwrap();
        assert_eq!(v[0].driver, Driver::Partition { number: 5 });
        assert_eq!(v[0].partition(), Some(5));
        assert_eq!(v[0].file.as_deref(), Some("file0"));
        for (bad, want) in [
            (json!(0), "expects a partition number"),
            (json!("1"), "expects a partition number"),
            (json!(1u64 << 40), "expects a partition number"),
        ] {
            let e = nodes(json!({"driver": PARTITION_DRIVER, "node-name": "p",
                                 "file": "file0", "partition": bad}))
            .unwrap_err();
            assert!(e.contains(want), "{e}");
        }
        let e = nodes(json!({"driver": PARTITION_DRIVER, "node-name": "p", "file": "file0"}))
            .unwrap_err();
        assert_eq!(e, "Parameter 'partition' is missing");
        // Not over another partition node, even inline.
        let e = nodes(
            json!({"driver": PARTITION_DRIVER, "node-name": "p", "partition": 1,
                             "file": {"driver": PARTITION_DRIVER, "partition": 2,
                                      "file": "file0"}}),
        )
        .unwrap_err();
        assert!(e.contains("a partition has no partitions"), "{e}");
    }

    #[test]
    fn a_vpc_node_is_a_vhd_image() {
        let v = nodes(json!({"driver": "vpc", "node-name": "v",
                             "file": {"driver": "file", "filename": "/d.vhd"}}))
        .unwrap();
        assert_eq!(v[1].driver, Driver::Vpc);
        let file = v[0].clone();
        let lookup = |n: &str| (n == file.name).then(|| file.clone());
        assert_eq!(v[1].image(&lookup), Some(("/d.vhd".into(), Some("vhd"))));
        let v = nodes(json!({"driver": "vdi", "node-name": "w", "file": "file0"})).unwrap();
        assert_eq!(v[0].driver, Driver::Vdi);
        let v = nodes(json!({"driver": "vhdx", "node-name": "h",
                             "file": {"driver": "file", "filename": "/d.vhdx"}}))
        .unwrap();
        assert_eq!(v[1].driver, Driver::Vhdx);
        let file = v[0].clone();
        let lookup = |n: &str| (n == file.name).then(|| file.clone());
        assert_eq!(v[1].image(&lookup), Some(("/d.vhdx".into(), Some("vhdx"))));
        assert!(nodes(
            json!({"driver": "vpc", "node-name": "x", "file": "file0", "backing": null})
        )
        .unwrap_err()
        .contains("'backing' is unexpected"));
    }

    #[test]
    fn nbd_servers_become_uris() {
        let v = nodes(json!({"driver": "nbd", "node-name": "n", "export": "e",
                             "server": {"type": "unix", "path": "/s"}}))
        .unwrap();
        assert_eq!(
            v[0].driver,
            Driver::Nbd {
                uri: "nbd+unix:///e?socket=/s".into()
            }
        );
        let v = nodes(json!({"driver": "nbd", "node-name": "n",
                             "server": {"type": "inet", "host": "::1", "port": "10809"}}))
        .unwrap();
        assert_eq!(
            v[0].driver,
            Driver::Nbd {
                uri: "nbd://[::1]:10809/".into()
            }
        );
        // Any export name and socket path reach the server as given.
        let v = nodes(
            json!({"driver": "nbd", "node-name": "n", "export": "a?b#c %d",
                             "server": {"type": "unix", "path": "/run/x&y.sock"}}),
        )
        .unwrap();
        let Driver::Nbd { uri } = &v[0].driver else {
            panic!("{:?}", v[0].driver)
        };
        let parsed = nbd::uri::NbdUri::parse(uri).unwrap();
        assert_eq!(parsed.export, "a?b#c %d");
        assert_eq!(
            parsed.transport,
            nbd::uri::Transport::Unix("/run/x&y.sock".into())
        );
        for (server, want) in [
            (
                json!({"type": "inet", "host": "h", "port": "nbd"}),
                "fusex does not support port 'nbd' in 'server': give a port number",
            ),
            (
                json!({"type": "inet", "host": "a/b", "port": "1"}),
                "fusex cannot reach 'server': the host is not a host name or address",
            ),
        ] {
            let e =
                nodes(json!({"driver": "nbd", "node-name": "n", "server": server})).unwrap_err();
            assert_eq!(e, want);
        }
    }

    #[test]
    fn images_follow_the_file_child() {
        let v = nodes(json!({"driver": "raw", "node-name": "r", "file": "file0"})).unwrap();
        let file0 = nodes(json!({"driver": "file", "node-name": "file0", "filename": "/a"}))
            .unwrap()
            .remove(0);
        let lookup = |n: &str| (n == "file0").then(|| file0.clone());
        assert_eq!(v[0].image(&lookup), Some(("/a".into(), Some("raw"))));
        assert_eq!(v[0].shown_file(&lookup), "/a");
    }
}
