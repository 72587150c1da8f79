//! `fusex serve`: many exports in one daemon, added and removed while it runs. [`Service`] holds
//! the block nodes and exports and runs the QMP commands qemu-storage-daemon has for them
//! (`blockdev-add`, `block-export-add`, ...), with its argument names and error texts, so its
//! clients work unchanged; each export is a [`crate::lifecycle`] export, and one thread
//! ([`supervisor`]) supervises them all. The command line ([`cmdline`]), the config file and the
//! control socket all go through the same commands.

pub mod cmdline;
pub mod config;
pub mod daemon;
pub mod handover;
pub mod node;
pub mod objects;
pub mod options;
pub mod published;
pub mod supervisor;
pub mod takeover;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use serde::Deserialize;
use serde_json::{json, Map, Value};

use qmp::{parse_args, Dispatcher, EventBus, QmpError};

use crate::lifecycle::{self, Event, Owner, Stop};
use node::Node;
use supervisor::{ExportTx, Supervisors};

/// The event fusex sends when an export ends on its own (its image failed, its NBD server is
/// gone, it was unmounted from outside), before `BLOCK_EXPORT_DELETED`; named by QMP's
/// convention for a vendor's own events.
pub const EXPORT_FAILED_EVENT: &str = "__org.fusex_BLOCK_EXPORT_FAILED";

/// The event fusex sends when an export that serves on cannot reach its image for now (its
/// NBD server is unreachable: requests fail with EIO until it is back).
pub const EXPORT_FAILING_EVENT: &str = "__org.fusex_BLOCK_EXPORT_FAILING";

/// The event fusex sends when such an export reaches its image again.
pub const EXPORT_RECOVERED_EVENT: &str = "__org.fusex_BLOCK_EXPORT_RECOVERED";

/// fusex's own export type for a directory tree (QMP's `__RFQDN_name` convention for a
/// downstream's names, as the `__org.fusex_partition` driver): `block-export-add` with this
/// `type`, `source` (the directory) instead of `node-name`, and the `fuse` type's members that
/// mean something for a directory (`mountpoint`, `writable`, `allow-other`, fusex's own).
pub const DIR_EXPORT_TYPE: &str = "__org.fusex_dir";

/// What the daemon's main thread is asked to do.
#[derive(Debug)]
pub enum Control {
    /// `quit`: remove every export and exit.
    Quit,
    /// SIGINT, SIGTERM, or SIGHUP without `--config`: stop every export as `fusex mount` stops
    /// on it, and exit.
    Signal(i32),
    /// SIGHUP with `--config`: apply the config file again.
    Reload,
    /// SIGUSR1: every export writes its statistics.
    Dump,
    /// `fusex restart`: process `pid`, reached through `stream`, has every export open and
    /// asks the daemon to let go of them all.
    HandOver {
        stream: std::os::unix::net::UnixStream,
        pid: u32,
    },
}

/// One export in the table.
struct Entry {
    /// Tells this entry from an earlier export of the same id.
    serial: u64,
    /// Its block node (empty for a directory export, which has none).
    node: String,
    /// A directory export's source directory.
    source: Option<String>,
    /// Its mountpoint and a directory export's source, canonical, for
    /// [`Table::check_nesting`] (None when the mountpoint could not be resolved).
    paths: Option<(PathBuf, Option<PathBuf>)>,
    /// The supervisor's events (None while the export starts).
    tx: Option<ExportTx>,
    shutting_down: bool,
    /// What `fusex ctl list` shows.
    state: crate::runtime::ExportState,
    /// The config file's table this export was made from (None: added over QMP or `fusex
    /// ctl`), which a reload compares.
    config: Option<Value>,
    /// What a `fusex restart` successor gets of it.
    handing: Option<lifecycle::Handing>,
    /// Where its statistics are read (None while it starts).
    meter: Option<crate::metrics::Meter>,
    /// The IOThread objects it names (`iothread`), which cannot be deleted while it lives.
    iothreads: Vec<String>,
}

impl Entry {
    /// An export being mounted: its id is taken, it serves nothing yet.
    fn starting(serial: u64, node: String, source: Option<String>, config: Option<Value>) -> Entry {
        Entry {
            serial,
            node,
            source,
            paths: None,
            tx: None,
            shutting_down: false,
            state: crate::runtime::ExportState {
                state: "starting".into(),
                ..Default::default()
            },
            config,
            handing: None,
            meter: None,
            iothreads: Vec::new(),
        }
    }
}

#[derive(Default)]
struct Table {
    nodes: BTreeMap<String, Node>,
    exports: BTreeMap<String, Entry>,
    /// No new export once the daemon quits.
    quitting: bool,
    /// A `fusex restart` successor is taking every export: nothing may change meanwhile.
    handing_over: bool,
    /// Numbers the nodes in the order they were added (a successor adds them again in it).
    next_order: u64,
    /// The objects (IOThreads, TLS credentials), in the order they were added.
    objects: Vec<objects::Object>,
}

impl Table {
    fn node(&self, name: &str) -> Option<Node> {
        self.nodes.get(name).cloned()
    }

    /// The size of each NBD node, by [`nbd_key`], for a `fusex restart` successor.
    fn nbd_sizes(&self) -> BTreeMap<String, u64> {
        let lookup = |name: &str| self.node(name);
        self.nodes
            .values()
            .filter_map(|n| {
                let (image, _) = n.image(&lookup)?;
                nbd::uri::is_nbd_uri(&image).then(|| (nbd_key(&image, n), n.size))
            })
            .collect()
    }

    /// The export using `node`, directly or through a format node over it.
    fn user_of(&self, node: &str) -> Option<String> {
        if let Some((id, _)) = self.exports.iter().find(|(_, e)| e.node == node) {
            return Some(id.clone());
        }
        self.nodes
            .values()
            .find(|n| n.file.as_deref() == Some(node) || n.backing.as_deref() == Some(node))
            .map(|n| n.name.clone())
    }

    /// Refuses an export's `iothread` that names an IOThread object there is not.
    fn check_iothreads(&self, ids: &[String]) -> Result<(), QmpError> {
        match ids.iter().find(|id| {
            !self
                .objects
                .iter()
                .any(|o| &o.id == *id && o.kind == objects::Kind::IoThread)
        }) {
            Some(id) => Err(objects::iothread_not_found(id)),
            None => Ok(()),
        }
    }

    /// Refuses an export mounted below a directory export's source, and a directory export
    /// whose source holds another export's mountpoint (`paths`: the new export's mountpoint
    /// and source, canonical). Every export of the daemon runs on the same worker threads: a
    /// directory export that reaches another's mount through its source asks that export from
    /// a queue thread, and waits forever when the request lands on that very thread's ring
    /// (seen: `ls -l` of the directory export hung its thread, and every export on it).
    fn check_nesting(&self, paths: &Option<(PathBuf, Option<PathBuf>)>) -> Result<(), QmpError> {
        let Some((mp, src)) = paths else {
            return Ok(());
        };
        for (id, e) in &self.exports {
            let Some((their_mp, their_src)) = &e.paths else {
                continue;
            };
            if let Some(their_src) = their_src.as_ref().filter(|s| crate::dirmode::below(mp, s)) {
                return Err(QmpError::generic(format!(
                    "mountpoint {} lies inside {}, the source of directory export '{id}', which \
                     would reach this export through the threads that serve it: mount it outside \
                     that tree",
                    mp.display(),
                    their_src.display()
                )));
            }
            if let Some(src) = src.as_ref().filter(|s| crate::dirmode::below(their_mp, s)) {
                return Err(QmpError::generic(format!(
                    "source {} holds the mountpoint {} of export '{id}', which this directory \
                     export would reach through the threads that serve it: export a tree \
                     without it",
                    src.display(),
                    their_mp.display()
                )));
            }
        }
        Ok(())
    }
}

/// An export that ended, from the exports' thread.
struct Finished {
    id: String,
    serial: u64,
    error: Option<String>,
    /// Handed to a `fusex restart` successor, which serves it now.
    handed: bool,
}

/// The daemon's exports and nodes, and the commands that change them.
pub struct Service {
    table: Mutex<Table>,
    events: EventBus,
    control: mpsc::Sender<Control>,
    /// The thread that supervises every export.
    supervisors: Supervisors,
    serial: AtomicU64,
    /// Numbers the nodes made for inline children (`#block1`, ...).
    implicit: AtomicU64,
    verbose: u8,
    /// `--config`, which a reload reads again.
    config_path: Mutex<Option<PathBuf>>,
    /// Publishes each export for `fusex list` (None: the runtime directory is unusable).
    publisher: Option<published::Publisher>,
    /// systemd's notification socket, handed to a `fusex restart` successor.
    notify_socket: Mutex<Option<String>>,
    /// The images partition exports share, by the node their partition nodes stand on: opened
    /// by the first export of one of its partitions, closed once the last has ended.
    shared: SharedImages,
}

/// The opened images of [`Service::shared`].
type SharedImages = Arc<Mutex<BTreeMap<String, std::sync::Weak<backend::AnyBackend>>>>;

/// The commands, in the order `query-commands` lists them.
const COMMANDS: &[&str] = &[
    "blockdev-add",
    "blockdev-del",
    "block-export-add",
    "block-export-del",
    "object-add",
    "object-del",
    "query-block",
    "query-block-exports",
    "query-blockstats",
    "query-named-block-nodes",
    "quit",
];

/// fusex's own commands, after [`options::EXTENSION`].
const EXTENSION_COMMANDS: &[&str] = &["export-add", "list", "query-stats", "reload"];

impl Service {
    /// A service with nothing in it; `control` receives `quit`. It starts the thread that
    /// supervises every export, and the reaper thread, which removes ended exports from the
    /// table and sends their events.
    pub fn new(events: EventBus, control: mpsc::Sender<Control>, verbose: u8) -> Arc<Service> {
        let (finished, ended) = mpsc::channel();
        let supervisors = Supervisors::start(finished).expect("starting the exports' thread");
        let service = Arc::new_cyclic(|me: &std::sync::Weak<Service>| Service {
            table: Mutex::new(Table::default()),
            events,
            control,
            supervisors,
            serial: AtomicU64::new(0),
            implicit: AtomicU64::new(0),
            verbose,
            config_path: Mutex::new(None),
            publisher: {
                let me = me.clone();
                published::Publisher::start(Box::new(move |stream| match me.upgrade() {
                    Some(s) => s.hand_over(stream),
                    None => drop(stream),
                }))
                .map_err(|e| tracing::warn!("fusex list will not show the exports: {e}"))
                .ok()
            },
            notify_socket: Mutex::new(None),
            shared: SharedImages::default(),
        });
        let weak = Arc::downgrade(&service);
        std::thread::Builder::new()
            .name("fusex-reaper".into())
            .spawn(move || {
                crate::priority::lower_this_thread();
                for f in ended {
                    match weak.upgrade() {
                        Some(s) => s.reap(f),
                        None => return,
                    }
                }
            })
            .expect("starting the reaper thread");
        service
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        // A panic while holding the lock leaves the table as consistent as any command leaves
        // it (each change is one insert or remove).
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An export ended: it leaves the table, and clients hear of it.
    fn reap(&self, f: Finished) {
        let _in = crate::logging::export_span(&f.id).entered();
        let mut t = self.table();
        let ours = t
            .exports
            .get(&f.id)
            .is_some_and(|e| e.serial == f.serial && e.tx.is_some());
        if !ours {
            // It never started: the command that added it answered with the error.
            return;
        }
        let entry = t.exports.remove(&f.id);
        if f.handed {
            return;
        }
        // A node made for this export alone goes with it.
        let own = own_node(&f.id);
        if t.nodes.get(&own).is_some_and(|n| n.implicit) {
            t.nodes.remove(&own);
        }
        drop(t);
        let asked = entry.is_some_and(|e| e.shutting_down);
        match (&f.error, asked) {
            (e, false) => {
                // Nobody removed it: its image failed, or its mount went away.
                let why = e.clone().unwrap_or_else(|| {
                    "its connection ended: the export was unmounted from outside, or its \
                     connection aborted"
                        .into()
                });
                tracing::error!("export {}: {why}", f.id);
                self.events
                    .emit(EXPORT_FAILED_EVENT, Some(json!({"id": f.id, "error": why})));
            }
            (Some(e), true) => tracing::warn!("export {}: {e}", f.id),
            (None, true) => {}
        }
        tracing::info!("export {} removed", f.id);
        self.events
            .emit("BLOCK_EXPORT_DELETED", Some(json!({"id": f.id})));
    }

    /// How many exports there are (starting, serving or stopping).
    pub fn export_count(&self) -> usize {
        self.table().exports.len()
    }

    /// Stops every export (`how`) and refuses new ones.
    pub fn stop_all(&self, how: Stop) {
        let mut t = self.table();
        t.quitting = true;
        for e in t.exports.values_mut() {
            e.shutting_down = true;
            if let Some(tx) = &e.tx {
                let _ = tx.send(Event::Stop(how));
            }
        }
    }

    /// SIGUSR1: every export writes its statistics.
    pub fn dump_all(&self) {
        for e in self.table().exports.values() {
            if let Some(tx) = &e.tx {
                let _ = tx.send(Event::Dump);
            }
        }
    }

    fn blockdev_add(&self, args: Value) -> Result<Value, QmpError> {
        self.add_node(args, None)
    }

    /// `fusex restart`'s successor adding a node of the old daemon again: an NBD node whose size
    /// `nbd_sizes` holds (`nbd_key`) is not connected to (the old daemon still holds the
    /// server's connections, and a server without multi-conn need not take another); its URI
    /// and TLS files are checked and the size is taken from there.
    pub fn add_node_adopted(
        &self,
        args: Value,
        nbd_sizes: &BTreeMap<String, u64>,
    ) -> Result<Value, QmpError> {
        self.add_node(args, Some(nbd_sizes))
    }

    fn add_node(
        &self,
        args: Value,
        nbd_sizes: Option<&BTreeMap<String, u64>>,
    ) -> Result<Value, QmpError> {
        let given = args.clone();
        let mut nodes = {
            let t = self.table();
            let lookup = |n: &str| t.node(n);
            let tls = |id: &str| objects::tls_creds(&t.objects, id).cloned();
            node::parse(
                args,
                "",
                &mut || {
                    format!(
                        "#block{}",
                        self.implicit.fetch_add(1, Ordering::Relaxed) + 1
                    )
                },
                &lookup,
                &tls,
            )?
        };
        if let Some(top) = nodes.last_mut() {
            top.args = Some(given);
        }
        let mut checked = Vec::with_capacity(nodes.len());
        for mut n in nodes {
            if self.table().nodes.contains_key(&n.name)
                || checked.iter().any(|c: &Node| c.name == n.name)
            {
                return Err(duplicate_node(&n.name));
            }
            n.size = self.probe(&n, &checked, nbd_sizes)?;
            checked.push(n);
        }
        let mut t = self.table();
        if let Some(dup) = checked.iter().find(|n| t.nodes.contains_key(&n.name)) {
            return Err(duplicate_node(&dup.name));
        }
        // Checked again under this lock: another client may have deleted the credentials
        // while the node's server was probed.
        for creds in checked.iter().filter_map(|n| n.tls_creds.as_deref()) {
            objects::tls_creds(&t.objects, creds)?;
        }
        for mut n in checked {
            tracing::debug!(node = %n.name, driver = n.driver.name(), "node added");
            n.order = t.next_order;
            t.next_order += 1;
            t.nodes.insert(n.name.clone(), n);
        }
        Ok(json!({}))
    }

    /// Opens a new node's image as an export of it would (read-only, without locks), to refuse
    /// one that cannot be opened now, as QEMU does, and to learn its size.
    fn probe(
        &self,
        n: &Node,
        earlier: &[Node],
        nbd_sizes: Option<&BTreeMap<String, u64>>,
    ) -> Result<u64, QmpError> {
        let lookup = |name: &str| {
            earlier
                .iter()
                .find(|c| c.name == name)
                .cloned()
                .or_else(|| self.table().node(name))
        };
        let Some((image, format)) = n.image(&lookup) else {
            return Err(QmpError::generic(format!(
                "node '{}' has no image under it",
                n.name
            )));
        };
        if let Some(&size) = nbd_sizes.and_then(|m| m.get(&nbd_key(&image, n))) {
            backend::NbdBackend::validate(&image).map_err(|e| QmpError::generic(e.to_string()))?;
            return Ok(size);
        }
        if let node::Driver::File { filename, .. } = &n.driver {
            // QEMU's text for a file that cannot be opened.
            if let Err(e) = std::fs::File::open(filename) {
                return Err(QmpError::generic(format!(
                    "Could not open '{filename}': {}",
                    strerror(&e)
                )));
            }
        }
        if n.range.is_some() {
            let whole = n.file.as_deref().and_then(lookup).map_or(0, |c| c.size);
            n.check_range(whole)?;
        }
        let mut words = vec!["--no-locking".to_string()];
        // --no-backing: a qcow2 image's backing file is opened by the export (unless `backing:
        // null`); here only the image itself is checked. A VMDK's extent files are the image.
        if format != Some("vmdk") {
            words.push("--no-backing".to_string());
        }
        // Nor its backing chain: each node of one was checked as it was added, and the
        // backing file a header names is opened by the export.
        if format == Some("qcow2") {
            words.push("--backing=none".to_string());
        }
        words.extend(format.map(|f| format!("--format={f}")));
        words.extend(n.part_words());
        let (args, _) = options::mount_args(&image, std::path::Path::new("/"), &words)
            .map_err(QmpError::generic)?;
        let (export, _) = lifecycle::open_export(&args, false)
            .map_err(|e| QmpError::generic(format!("{e:#}")))?;
        let size = {
            use backend::BlockBackend;
            export.backend().size()
        };
        Ok(size)
    }

    fn blockdev_del(&self, args: Value) -> Result<Value, QmpError> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields, rename_all = "kebab-case")]
        struct A {
            node_name: String,
        }
        let a: A = parse_args(args)?;
        let mut t = self.table();
        let Some(n) = t.nodes.get(&a.node_name) else {
            return Err(QmpError::generic(format!(
                "Failed to find node with node-name='{}'",
                a.node_name
            )));
        };
        if let Some(over) = t
            .nodes
            .values()
            .find(|o| o.backing.as_deref() == Some(&a.node_name))
        {
            // qemu-storage-daemon's words.
            return Err(QmpError::generic(format!(
                "Node '{}' is busy: node is used as backing hd of '{}'",
                a.node_name, over.name
            )));
        }
        if n.implicit || t.user_of(&a.node_name).is_some() {
            return Err(QmpError::generic(format!("Node {} is in use", a.node_name)));
        }
        // Inline children (a file, a backing node and theirs) go with their parent.
        let mut gone = vec![a.node_name];
        while let Some(name) = gone.pop() {
            if let Some(n) = t.nodes.remove(&name) {
                gone.extend([n.file, n.backing].into_iter().flatten().filter(|c| {
                    t.nodes.get(c).is_some_and(|c| c.implicit) && t.user_of(c).is_none()
                }));
            }
        }
        Ok(json!({}))
    }

    /// Checks a `block-export-add` request against the table, without mounting anything: its
    /// id, node and the `fusex mount` options it stands for.
    fn plan_export(&self, args: Value) -> Result<Planned, QmpError> {
        let Value::Object(mut map) = args else {
            return Err(QmpError::generic("arguments must be an object"));
        };
        // fusex's own members, as `fusex mount` options.
        let mut words = Vec::new();
        let extensions: Vec<String> = map
            .keys()
            .filter(|k| k.starts_with(options::EXTENSION))
            .cloned()
            .collect();
        for k in extensions {
            let v = map.remove(&k).unwrap_or(Value::Null);
            let name = &k[options::EXTENSION.len()..];
            if name == "backing" {
                // A node's backing chain is its own, as in QEMU.
                return Err(QmpError::generic(format!(
                    "{k} is not an export member: give the qcow2 node a backing node in \
                     blockdev-add"
                )));
            }
            words.extend(options::words(name, &v, &k).map_err(QmpError::generic)?);
        }
        if map.get("type").and_then(Value::as_str) == Some(DIR_EXPORT_TYPE) {
            return self.plan_dir_export(map, words);
        }
        let (a, iothreads) = parse_export(map)?;
        let t = self.table();
        if t.quitting {
            return Err(QmpError::generic("fusex is shutting down"));
        }
        if t.exports.contains_key(&a.id) {
            return Err(id_in_use(&a.id));
        }
        t.check_iothreads(&iothreads)?;
        let Some(n) = t.node(&a.node_name) else {
            return Err(QmpError::generic(format!(
                "Cannot find device='' nor node-name='{}'",
                a.node_name
            )));
        };
        let mountpoint = existing_mountpoint(&a.mountpoint)?;
        let writable = a.writable.unwrap_or(false);
        let lookup = |name: &str| t.node(name);
        // The node and the nodes under it (a partition's format node, a format node's file).
        let mut chain = vec![n.clone()];
        while let Some(c) = chain
            .last()
            .and_then(|l| l.file.as_deref())
            .and_then(&lookup)
        {
            if chain.len() > 3 {
                break;
            }
            chain.push(c);
        }
        if writable && chain.iter().any(|c| c.read_only) {
            // qemu-storage-daemon's words (the node is the one named in the command).
            return Err(QmpError::generic(
                "Cannot export read-only node as writable",
            ));
        }
        let Some((image, format)) = n.image(&lookup) else {
            return Err(QmpError::generic(format!(
                "node '{}' has no image under it",
                n.name
            )));
        };
        let mut all: Vec<String> = format
            .map(|f| format!("--format={f}"))
            .into_iter()
            .collect();
        all.extend(n.part_words());
        if let Some(q) = chain.iter().find(|c| c.driver == node::Driver::Qcow2) {
            all.extend(
                q.backing_levels(&lookup)?
                    .iter()
                    .map(|l| format!("--backing={l}")),
            );
            all.extend(q.qcow2_cache.l2.map(|b| format!("--l2-cache-size={b}")));
            all.extend(
                q.qcow2_cache
                    .refcount
                    .map(|b| format!("--refcount-cache-size={b}")),
            );
            all.extend(
                q.qcow2_cache
                    .clean_interval
                    .map(|s| format!("--cache-clean-interval={s}")),
            );
        }
        let protocol = chain.last().cloned().unwrap_or(n.clone());
        // force-share is the exported node's own (for a partition node, also the node it
        // stands on), as before partition nodes existed.
        let own = if n.partition().is_some() { 2 } else { 1 };
        let force_share = chain.iter().take(own).any(|c| c.force_share);
        for (on, flag) in [
            (writable, "--writable"),
            (a.growable.unwrap_or(false), "--growable"),
            (a.writethrough.unwrap_or(false), "--writethrough"),
            (chain.iter().any(|c| c.direct), "--direct"),
            (protocol.no_locking, "--no-locking"),
            (force_share && !writable, "--force-share"),
            (chain.iter().any(|c| c.no_backing), "--no-backing"),
            (allow_other(a.allow_other), "--allow-other"),
        ] {
            if on {
                all.push(flag.to_string());
            }
        }
        all.extend(words);
        let (mut margs, argv) =
            options::mount_args(&image, &mountpoint, &all).map_err(QmpError::generic)?;
        margs.shared_image = self.shared_image_of(&t, &n);
        Ok(Planned {
            id: a.id,
            node: a.node_name,
            args: margs,
            argv,
            iothreads,
        })
    }

    /// A `block-export-add` of [`DIR_EXPORT_TYPE`]: the `fusex mount SRC_DIR MOUNTPOINT`
    /// options it stands for, checked as `fusex mount` checks them (image-only options are
    /// refused in one line).
    fn plan_dir_export(
        &self,
        map: Map<String, Value>,
        mut words: Vec<String>,
    ) -> Result<Planned, QmpError> {
        let a: DirExportArgs = parse_args(Value::Object(map))?;
        let iothreads = objects::export_iothreads(a.iothread.as_ref(), a.fixed_iothread)?;
        let refuse = |member: &str| {
            QmpError::generic(format!(
                "{member} is for image exports; {} is a directory: drop {member}",
                a.source
            ))
        };
        if a.node_name.is_some() {
            return Err(QmpError::generic(format!(
                "a {DIR_EXPORT_TYPE} export has no block node: give source=DIR, not node-name"
            )));
        }
        if a.growable.is_some() {
            return Err(refuse("growable"));
        }
        if a.writethrough.is_some() {
            return Err(refuse("writethrough"));
        }
        if !crate::dirmode::is_directory(&a.source) {
            return Err(QmpError::generic(format!(
                "source '{}' is not a directory: a {DIR_EXPORT_TYPE} export serves a directory \
                 tree (export an image through a block node, type fuse)",
                a.source
            )));
        }
        {
            let t = self.table();
            if t.quitting {
                return Err(QmpError::generic("fusex is shutting down"));
            }
            if t.exports.contains_key(&a.id) {
                return Err(id_in_use(&a.id));
            }
            t.check_iothreads(&iothreads)?;
        }
        let mountpoint = existing_mountpoint(&a.mountpoint)?;
        let mut all = Vec::new();
        if a.writable.unwrap_or(false) {
            all.push("--writable".to_string());
        }
        if allow_other(a.allow_other) {
            all.push("--allow-other".to_string());
        }
        all.append(&mut words);
        let (margs, argv) =
            options::mount_args(&a.source, &mountpoint, &all).map_err(QmpError::generic)?;
        crate::dirmode::check_args(&margs).map_err(|e| QmpError::generic(format!("{e:#}")))?;
        Ok(Planned {
            id: a.id,
            node: String::new(),
            args: margs,
            argv,
            iothreads,
        })
    }

    /// Checks `block-export-add` requests given together (the command line) against the table
    /// and each other, so that none is mounted when one is wrong.
    pub fn check_exports(&self, requests: &[Value]) -> Result<(), (usize, QmpError)> {
        let mut ids = std::collections::BTreeSet::new();
        for (i, r) in requests.iter().enumerate() {
            let p = self.plan_export(r.clone()).map_err(|e| (i, e))?;
            if !ids.insert(p.id.clone()) {
                return Err((i, id_in_use(&p.id)));
            }
        }
        Ok(())
    }

    fn export_add(&self, args: Value) -> Result<Value, QmpError> {
        let Planned {
            id,
            node,
            args: margs,
            argv,
            iothreads,
        } = self.plan_export(args)?;
        self.launch(id, node, None, margs, argv, iothreads)?;
        Ok(json!({}))
    }

    /// `__org.fusex_export-add` (what `fusex ctl add` and the config file use): an export of
    /// IMAGE at MOUNTPOINT with `fusex mount` options, on a node of its own (`#ID`).
    fn own_export_add(&self, args: Value, config: Option<Value>) -> Result<Value, QmpError> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields, rename_all = "kebab-case")]
        struct A {
            id: String,
            image: String,
            mountpoint: String,
            #[serde(default)]
            options: Map<String, Value>,
            #[serde(default)]
            args: Vec<String>,
        }
        let a: A = parse_args(args)?;
        let mut words = Vec::new();
        for (k, v) in &a.options {
            words.extend(options::words(k, v, k).map_err(QmpError::generic)?);
        }
        for w in &a.args {
            options::check_word(w).map_err(QmpError::generic)?;
        }
        words.extend(a.args.iter().cloned());
        let mountpoint = PathBuf::from(&a.mountpoint);
        let (margs, argv) =
            options::mount_args(&a.image, &mountpoint, &words).map_err(QmpError::generic)?;
        if crate::dirmode::is_directory(&a.image) {
            // A directory export: no block node stands for it.
            crate::dirmode::check_args(&margs).map_err(|e| QmpError::generic(format!("{e:#}")))?;
            return self
                .launch(a.id, String::new(), config, margs, argv, Vec::new())
                .map(|()| json!({}));
        }
        let node = own_node(&a.id);
        {
            let mut t = self.table();
            if t.exports.contains_key(&a.id) {
                return Err(id_in_use(&a.id));
            }
            if t.nodes.contains_key(&node) {
                return Err(duplicate_node(&node));
            }
            t.nodes.insert(node.clone(), Node::of_image(&node, &margs));
        }
        let launched = self.launch(a.id.clone(), node.clone(), config, margs, argv, Vec::new());
        if launched.is_err() {
            let mut t = self.table();
            if !t.exports.contains_key(&a.id) {
                t.nodes.remove(&node);
            }
        }
        launched.map(|()| json!({}))
    }

    /// Enters a checked export in the table and mounts it; returns once it serves.
    fn launch(
        &self,
        id: String,
        node: String,
        config: Option<Value>,
        margs: crate::cli::MountArgs,
        argv: Vec<String>,
        iothreads: Vec<String>,
    ) -> Result<(), QmpError> {
        let _in = crate::logging::export_span(&id).entered();
        // Only a directory export has no node.
        let source = node.is_empty().then(|| margs.image.clone());
        // Resolved before the table is locked: resolving may wait on a slow filesystem.
        let paths = transport::canonical_mountpoint(&margs.mountpoint)
            .ok()
            .map(|mp| {
                let src = source
                    .as_ref()
                    .and_then(|s| std::path::Path::new(s).canonicalize().ok());
                (mp, src)
            });
        let mut t = self.table();
        if t.quitting {
            return Err(QmpError::generic("fusex is shutting down"));
        }
        // Checked again under this lock: another client may have taken the id, or deleted
        // the IOThread, meanwhile.
        if t.exports.contains_key(&id) {
            return Err(id_in_use(&id));
        }
        t.check_iothreads(&iothreads)?;
        t.check_nesting(&paths)?;
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        let mut entry = Entry::starting(serial, node, source, config);
        entry.iothreads = iothreads;
        entry.paths = paths;
        t.exports.insert(id.clone(), entry);
        drop(t);
        // Mounting takes a while (an NBD server may be slow to answer): other commands run
        // meanwhile; the table holds the id.
        match self.start(&id, serial, margs, argv) {
            Ok(tx) => {
                let mut t = self.table();
                if let Some(e) = t.exports.get_mut(&id).filter(|e| e.serial == serial) {
                    e.tx = Some(tx.clone());
                    if t.quitting {
                        let _ = tx.send(Event::Stop(Stop::Safe));
                    }
                }
                Ok(())
            }
            Err(e) => {
                let mut t = self.table();
                if t.exports.get(&id).is_some_and(|e| e.serial == serial) {
                    t.exports.remove(&id);
                }
                Err(QmpError::generic(e))
            }
        }
    }

    /// Mounts an export and starts its supervisor; returns once it serves (or could not).
    fn start(
        &self,
        id: &str,
        serial: u64,
        args: crate::cli::MountArgs,
        argv: Vec<String>,
    ) -> Result<ExportTx, String> {
        let prepared = lifecycle::setup(&args, argv, self.verbose).map_err(|e| format!("{e:#}"))?;
        tracing::info!(
            "export {id}: {}",
            prepared.settled.announce.as_deref().unwrap_or("mounted")
        );
        self.supervise(id, serial, prepared)
    }

    /// Hands a mounted export to the exports' thread, which starts its queues; returns once it
    /// serves (or could not).
    fn supervise(
        &self,
        id: &str,
        serial: u64,
        prepared: lifecycle::Prepared,
    ) -> Result<ExportTx, String> {
        let (ready_tx, ready) = mpsc::sync_channel(1);
        let state = prepared.describe("serving");
        let published = self
            .publisher
            .as_ref()
            .and_then(|p| p.publish(&prepared.mnt, state.clone()));
        let notify_socket = self
            .notify_socket
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let handing = lifecycle::handing(&prepared, notify_socket).map_err(|e| format!("{e:#}"))?;
        let meter = crate::metrics::Meter::of(&prepared);
        let owner = ServiceOwner {
            ready: Some(ready_tx),
            published,
            id: id.to_string(),
            events: self.events.clone(),
        };
        let tx = self.supervisors.add(serial, id, prepared, owner)?;
        ready
            .recv()
            .unwrap_or_else(|_| Err("the export's supervisor ended".into()))?;
        let mut t = self.table();
        if let Some(e) = t.exports.get_mut(id).filter(|e| e.serial == serial) {
            e.state = state;
            e.handing = handing;
            e.meter = Some(meter);
        }
        Ok(tx)
    }

    /// `object-add`: an IOThread or TLS credentials (see [`objects`]).
    pub fn object_add(&self, args: Value) -> Result<Value, QmpError> {
        let o = objects::parse(args)?;
        let mut table = self.table();
        if table.objects.iter().any(|x| x.id == o.id) {
            return Err(objects::duplicate(&o.id));
        }
        table.objects.push(o);
        Ok(json!({}))
    }

    /// `object-del`: refused while an export names the IOThread or a node uses the TLS
    /// credentials.
    fn object_del(&self, args: Value) -> Result<Value, QmpError> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct A {
            id: String,
        }
        let a: A = parse_args(args)?;
        let mut t = self.table();
        let Some(i) = t.objects.iter().position(|o| o.id == a.id) else {
            return Err(objects::not_found(&a.id));
        };
        if let Some((export, _)) = t.exports.iter().find(|(_, e)| e.iothreads.contains(&a.id)) {
            return Err(objects::in_use(&a.id, &format!("export '{export}'")));
        }
        if let Some(n) = t
            .nodes
            .values()
            .find(|n| n.tls_creds.as_deref() == Some(a.id.as_str()))
        {
            return Err(objects::in_use(&a.id, &format!("node '{}'", n.name)));
        }
        t.objects.remove(i);
        Ok(json!({}))
    }

    fn export_del(&self, args: Value) -> Result<Value, QmpError> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields, rename_all = "kebab-case")]
        struct A {
            id: String,
            mode: Option<Mode>,
        }
        #[derive(Deserialize, Clone, Copy)]
        #[serde(rename_all = "kebab-case")]
        enum Mode {
            Safe,
            Hard,
        }
        let a: A = parse_args(args)?;
        let mut t = self.table();
        let Some(e) = t.exports.get_mut(&a.id) else {
            return Err(QmpError::generic(format!("Export '{}' is not found", a.id)));
        };
        let Some(tx) = &e.tx else {
            return Err(QmpError::generic(format!(
                "Export '{}' is still starting: try again once block-export-add returned",
                a.id
            )));
        };
        let how = match a.mode.unwrap_or(Mode::Safe) {
            Mode::Safe => Stop::Safe,
            Mode::Hard => Stop::Hard,
        };
        if e.shutting_down && how == Stop::Safe {
            return Err(QmpError::generic(format!(
                "Export '{}' is already shutting down",
                a.id
            )));
        }
        e.shutting_down = true;
        let _ = tx.send(Event::Stop(how));
        Ok(json!({}))
    }

    /// The statistics of export `id`, or of every export (those still starting have none).
    pub fn metrics(&self, id: Option<&str>) -> Vec<crate::metrics::ExportMetrics> {
        let meters: Vec<_> = {
            let t = self.table();
            t.exports
                .iter()
                .filter(|(eid, _)| id.is_none_or(|i| i == eid.as_str()))
                .filter_map(|(eid, e)| {
                    let m = e.meter.clone()?;
                    Some((eid.clone(), e.node.clone(), e.state.mountpoint.clone(), m))
                })
                .collect()
        };
        // Read outside the table's lock: the backends' statistics may take a system call.
        meters
            .iter()
            .map(|(id, node, mnt, m)| m.read(id, node, mnt))
            .collect()
    }

    /// `__org.fusex_query-stats`: every export's statistics, or one's (`id`).
    fn query_stats(&self, args: Value) -> Result<Value, QmpError> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct A {
            id: Option<String>,
        }
        let a: A = parse_args(args)?;
        let exports = self.metrics(a.id.as_deref());
        if let Some(id) = &a.id {
            if exports.is_empty() {
                return Err(QmpError::generic(format!("Export '{id}' is not found")));
            }
        }
        Ok(json!({
            "exports": exports.iter().map(|m| m.to_json()).collect::<Vec<_>>(),
        }))
    }

    /// `query-blockstats`: with `query-nodes`, one entry per node, the counts of the export
    /// using it on its node; without, none, as qemu-storage-daemon (its exports' block
    /// backends have no name).
    fn query_blockstats(&self, args: Value) -> Result<Value, QmpError> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields, rename_all = "kebab-case")]
        struct A {
            query_nodes: Option<bool>,
        }
        let a: A = parse_args(args)?;
        if a.query_nodes != Some(true) {
            return Ok(json!([]));
        }
        let metrics = self.metrics(None);
        let nodes: Vec<String> = self.table().nodes.keys().cloned().collect();
        Ok(nodes
            .iter()
            .map(|n| crate::metrics::blockstats(n, metrics.iter().find(|m| &m.node == n)))
            .collect::<Vec<_>>()
            .into())
    }

    fn query_exports(&self) -> Value {
        let t = self.table();
        Value::Array(
            t.exports
                .iter()
                .map(|(id, e)| match &e.source {
                    None => json!({
                        "type": "fuse",
                        "id": id,
                        "node-name": e.node,
                        "shutting-down": e.shutting_down,
                    }),
                    // No node: its source instead, as fusex's own member.
                    Some(source) => json!({
                        "type": DIR_EXPORT_TYPE,
                        "id": id,
                        "node-name": "",
                        "shutting-down": e.shutting_down,
                        "__org.fusex_source": source,
                    }),
                })
                .collect(),
        )
    }

    fn query_nodes(&self) -> Value {
        let t = self.table();
        let lookup = |name: &str| t.node(name);
        Value::Array(
            t.nodes
                .values()
                .map(|n| {
                    let file = match &n.driver {
                        node::Driver::Null { size } => {
                            format!("json:{{\"driver\": \"null-co\", \"size\": {size}}}")
                        }
                        _ => n.shown_file(&lookup),
                    };
                    let format = n.driver.name();
                    let levels = n.backing_levels(&lookup).unwrap_or_default();
                    let depth = levels
                        .iter()
                        .filter(|l| **l != backend::qcow2::BackingLevel::None)
                        .count();
                    let mut v = json!({
                        "node-name": n.name,
                        "drv": format,
                        "ro": n.read_only,
                        "file": file,
                        "encrypted": false,
                        "detect_zeroes": "off",
                        "backing_file_depth": 0,
                        "bps": 0, "bps_rd": 0, "bps_wr": 0,
                        "iops": 0, "iops_rd": 0, "iops_wr": 0,
                        "write_threshold": 0,
                        "cache": {"writeback": true, "direct": n.direct, "no-flush": n.no_flush},
                        "image": {
                            "filename": file,
                            "format": if format == "host_device" { "host_device" } else { format },
                            "virtual-size": n.size,
                            "dirty-flag": false,
                        },
                    });
                    v["backing_file_depth"] = depth.into();
                    if let Some(b) = n.backing.as_deref().and_then(&lookup) {
                        v["backing_file"] = b.shown_file(&lookup).into();
                    }
                    v
                })
                .collect(),
        )
    }

    /// The table as `fusex ctl list` shows it: every export with its node and state.
    fn list(&self) -> Value {
        let t = self.table();
        Value::Array(
            t.exports
                .iter()
                .map(|(id, e)| {
                    let mut v = serde_json::to_value(&e.state).unwrap_or(Value::Null);
                    v["id"] = id.clone().into();
                    v["node-name"] = e.node.clone().into();
                    if e.shutting_down {
                        v["state"] = "stopping".into();
                    }
                    v
                })
                .collect(),
        )
    }
}

/// A checked `block-export-add` request.
struct Planned {
    id: String,
    node: String,
    args: crate::cli::MountArgs,
    argv: Vec<String>,
    /// The IOThread objects it names.
    iothreads: Vec<String>,
}

/// Opens the image under partition nodes once for every export of its partitions: the first
/// export opens it (writable unless a node under the partition is read-only, as QEMU opens a
/// node), the others get the same opened image while any export of it lives.
impl Service {
    /// The image a partition node's export shares with the other partitions of it (opened
    /// once: two writers of one qcow2 image must share it, and the image's locks are taken
    /// once). None for other nodes, and for a partition of an NBD export, which is not shared:
    /// each queue thread keeps one connection per backend, which an export ending there would
    /// close under the others.
    fn shared_image_of(&self, t: &Table, n: &Node) -> Option<lifecycle::SharedImage> {
        let child = n.partition().and(n.file.clone())?;
        let lookup = |name: &str| t.node(name);
        let (image, _) = n.image(&lookup)?;
        if nbd::uri::is_nbd_uri(&image) {
            return None;
        }
        // The node and the nodes under it: writable only if none is read-only.
        let mut read_only = n.read_only;
        let mut under = n.file.clone();
        while let Some(c) = under.as_deref().and_then(&lookup) {
            read_only |= c.read_only;
            under = c.file.clone();
        }
        Some(shared_image(self.shared.clone(), child, !read_only))
    }

    /// [`Service::shared_image_of`] the node named `node`, for a `fusex restart` successor's
    /// export of it (the nodes were added again already).
    pub(super) fn shared_image_for(&self, node: &str) -> Option<lifecycle::SharedImage> {
        let t = self.table();
        let n = t.node(node)?;
        self.shared_image_of(&t, &n)
    }
}

fn shared_image(images: SharedImages, child: String, writable: bool) -> lifecycle::SharedImage {
    lifecycle::SharedImage(Arc::new(move |image, options| {
        let mut map = images.lock().unwrap_or_else(|p| p.into_inner());
        map.retain(|_, w| w.strong_count() > 0);
        if let Some(open) = map.get(&child).and_then(|w| w.upgrade()) {
            return Ok(open);
        }
        // Force-share is for read-only users: an image opened for writing claims its locks.
        let locking = match options.locking {
            backend::Locking::ForceShare if writable => backend::Locking::Exclusive,
            l => l,
        };
        let whole = Arc::new(backend::open(
            image,
            backend::OpenOptions {
                writable,
                locking,
                partition: None,
                ..options
            },
        )?);
        map.insert(child.clone(), Arc::downgrade(&whole));
        Ok(whole)
    }))
}

/// The export members of `block-export-add` (QEMU's `BlockExportOptions` with its `fuse`
/// variant).
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct ExportArgs {
    id: String,
    node_name: String,
    mountpoint: String,
    writable: Option<bool>,
    writethrough: Option<bool>,
    growable: Option<bool>,
    allow_other: Option<AllowOther>,
}

/// The members of a `block-export-add` of [`DIR_EXPORT_TYPE`]; the image-only ones are here to
/// be refused by name.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct DirExportArgs {
    #[allow(dead_code)] // checked before these are parsed
    r#type: String,
    id: String,
    source: String,
    mountpoint: String,
    writable: Option<bool>,
    allow_other: Option<AllowOther>,
    node_name: Option<String>,
    growable: Option<bool>,
    writethrough: Option<bool>,
    /// IOThread objects' ids (see [`objects`]): one, or a list.
    iothread: Option<Value>,
    fixed_iothread: Option<bool>,
}

#[derive(Deserialize, Clone, Copy, PartialEq)]
#[serde(rename_all = "kebab-case")]
enum AllowOther {
    On,
    Off,
    Auto,
}

/// `allow-other`: `auto` (the default) lets other users in where fusex may (as root).
fn allow_other(a: Option<AllowOther>) -> bool {
    match a.unwrap_or(AllowOther::Auto) {
        AllowOther::On => true,
        AllowOther::Off => false,
        // SAFETY: geteuid has no preconditions.
        AllowOther::Auto => (unsafe { libc::geteuid() }) == 0,
    }
}

/// Checks `type` first, as QEMU's union does, then the fuse export's members; also returns the
/// IOThreads it names.
fn parse_export(mut map: Map<String, Value>) -> Result<(ExportArgs, Vec<String>), QmpError> {
    #[derive(Deserialize)]
    #[serde(rename_all = "kebab-case")]
    enum Kind {
        Nbd,
        VhostUserBlk,
        Fuse,
        Vduse,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "kebab-case")]
    #[allow(dead_code)] // read for their types and presence only
    struct Common {
        r#type: Kind,
        id: String,
        node_name: String,
        iothread: Option<Value>,
        fixed_iothread: Option<bool>,
    }
    let common: Common = parse_args(Value::Object(map.clone()))?;
    match common.r#type {
        Kind::Fuse => {}
        Kind::Nbd => return Err(QmpError::generic("NBD server not running")),
        _ => {
            return Err(QmpError::generic(
                "fusex exports only type 'fuse' (an image's node) and '__org.fusex_dir' (a directory): give one of them",
            ))
        }
    }
    let iothreads = objects::export_iothreads(common.iothread.as_ref(), common.fixed_iothread)?;
    map.remove("type");
    map.remove("iothread");
    map.remove("fixed-iothread");
    Ok((parse_args(Value::Object(map))?, iothreads))
}

/// The node made for an export that names its image itself (`fusex ctl add`, the config file).
fn own_node(id: &str) -> String {
    format!("#{id}")
}

/// `mountpoint` as a path, once it is known to exist: QEMU's error text when it does not, so a
/// client sees the same refusal from both daemons.
fn existing_mountpoint(mountpoint: &str) -> Result<PathBuf, QmpError> {
    match std::fs::metadata(mountpoint) {
        Ok(_) => Ok(PathBuf::from(mountpoint)),
        Err(e) => Err(QmpError::generic(format!(
            "Failed to stat '{mountpoint}': {}",
            strerror(&e)
        ))),
    }
}

/// QEMU's error for an export id that is taken.
fn id_in_use(id: &str) -> QmpError {
    QmpError::generic(format!("Block export id '{id}' is already in use"))
}

/// How [`ServeState::nbd_sizes`](crate::restart::ServeState) names an NBD node: its URI, and
/// the partition of a partition node over it or the range of a raw node with `offset` or
/// `size`.
fn nbd_key(image: &str, n: &Node) -> String {
    match (n.partition(), n.range) {
        (Some(p), _) => format!("{image} partition {p}"),
        (None, Some(r)) => match r.size {
            Some(size) => format!("{image} offset {} size {size}", r.offset),
            None => format!("{image} offset {}", r.offset),
        },
        (None, None) => image.to_string(),
    }
}

/// QEMU's error for a node name that is taken.
fn duplicate_node(name: &str) -> QmpError {
    QmpError::generic(format!("Duplicate nodes with node-name='{name}'"))
}

/// An I/O error as QEMU words it (`strerror`, without Rust's " (os error N)").
fn strerror(e: &std::io::Error) -> String {
    let s = e.to_string();
    match s.find(" (os error") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

impl Dispatcher for Service {
    fn commands(&self) -> Vec<String> {
        let mut v: Vec<String> = COMMANDS.iter().map(|c| c.to_string()).collect();
        v.extend(
            EXTENSION_COMMANDS
                .iter()
                .map(|c| format!("{}{c}", options::EXTENSION)),
        );
        v
    }

    fn dispatch(&self, name: &str, arguments: Value) -> Result<Value, QmpError> {
        let no_args = |a: &Value| match a.as_object().and_then(|m| m.keys().next()) {
            Some(k) => Err(QmpError::generic(format!("Parameter '{k}' is unexpected"))),
            None => Ok(()),
        };
        let changes = !name.starts_with("query-")
            && !matches!(
                name.strip_prefix(options::EXTENSION),
                Some("list" | "query-stats")
            );
        if changes && self.table().handing_over {
            return Err(QmpError::generic(
                "fusex serve is handing its exports to a new process (fusex restart): try again \
                 once it serves",
            ));
        }
        match name {
            "blockdev-add" => self.blockdev_add(arguments),
            "blockdev-del" => self.blockdev_del(arguments),
            "block-export-add" => self.export_add(arguments),
            "block-export-del" => self.export_del(arguments),
            "object-add" => self.object_add(arguments),
            "object-del" => self.object_del(arguments),
            "query-block-exports" => no_args(&arguments).map(|()| self.query_exports()),
            "query-blockstats" => self.query_blockstats(arguments),
            "query-named-block-nodes" => {
                // QEMU's optional `flat` changes only what a backing chain shows.
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                #[allow(dead_code)]
                struct A {
                    flat: Option<bool>,
                }
                parse_args::<A>(arguments).map(|_| self.query_nodes())
            }
            // QEMU lists the block backends a name or a device holds: an export's has neither,
            // and qemu-storage-daemon has no devices, so its answer is always empty; so is ours.
            "query-block" => no_args(&arguments).map(|()| json!([])),
            "quit" => no_args(&arguments).map(|()| {
                let _ = self.control.send(Control::Quit);
                json!({})
            }),
            n => match n.strip_prefix(options::EXTENSION) {
                Some("list") => no_args(&arguments).map(|()| self.list()),
                Some("export-add") => self.own_export_add(arguments, None),
                Some("reload") => no_args(&arguments).and_then(|()| self.reload()),
                Some("query-stats") => self.query_stats(arguments),
                _ => Err(QmpError::command_not_found(name)),
            },
        }
    }
}

/// A `fusex serve` export's supervisor reports readiness to the command that added it.
struct ServiceOwner {
    ready: Option<mpsc::SyncSender<Result<(), String>>>,
    published: Option<published::Published>,
    /// The export's id and the clients' events, for [`Owner::trouble`].
    id: String,
    events: EventBus,
}

impl Owner for ServiceOwner {
    fn serving(&mut self) {
        if let Some(r) = self.ready.take() {
            let _ = r.send(Ok(()));
        }
    }

    fn failed(&mut self, why: &str) {
        if let Some(r) = self.ready.take() {
            let _ = r.send(Err(why.to_string()));
        }
    }

    fn state(&mut self, state: &str) {
        if let Some(p) = &mut self.published {
            p.set_state(state);
        }
    }

    fn stopping(&mut self) {}

    fn not_serving(&mut self) {}

    fn reloading(&mut self) {}

    fn handed_over(&mut self, _pid: u32) {}

    fn trouble(&mut self, why: Option<&str>) {
        match why {
            Some(w) => {
                tracing::error!("export {}: {w}", self.id);
                self.events.emit(
                    EXPORT_FAILING_EVENT,
                    Some(json!({"id": self.id, "error": w})),
                );
            }
            None => {
                tracing::info!("export {}: the image serves again", self.id);
                self.events
                    .emit(EXPORT_RECOVERED_EVENT, Some(json!({"id": self.id})));
            }
        }
    }
}
