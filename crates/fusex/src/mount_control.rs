//! `fusex mount --control PATH`: the control socket of a one-export process, so that `fusex top`
//! and `fusex ctl list`/`show` work on a single mount as on `fusex serve`. It speaks the same QMP
//! and answers the queries; what would change the exports (adding one, removing it) is refused
//! in one line naming what to use instead, and `quit` stops the export as SIGTERM does.

use std::path::Path;
use std::sync::{mpsc, Mutex};

use anyhow::{anyhow, Context, Result};
use qmp::{Dispatcher, QmpError};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::lifecycle::{Event, Prepared, Stop};
use crate::metrics::Meter;
use crate::privileges::Plan;
use crate::service::options::EXTENSION;

/// The one export of the process, as the control socket shows it.
struct MountDispatcher {
    id: String,
    meter: Meter,
    /// What `fusex ctl list` shows.
    shown: Value,
    /// The supervisor's events, for `quit`.
    tx: Mutex<mpsc::Sender<Event>>,
}

impl MountDispatcher {
    fn stats(&self, args: Value) -> Result<Value, QmpError> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct A {
            id: Option<String>,
        }
        let a: A = qmp::parse_args(args)?;
        if let Some(id) = a.id.filter(|i| *i != self.id) {
            return Err(QmpError::generic(format!("Export '{id}' is not found")));
        }
        let m = self.meter.read(&self.id, "", &self.id);
        Ok(json!({ "exports": [m.to_json()] }))
    }

    fn refuse(&self, what: &str) -> Result<Value, QmpError> {
        Err(QmpError::generic(format!(
            "fusex mount serves one export and cannot {what}: use fusex serve for that, or stop \
             this one with fusex umount {}",
            self.id
        )))
    }
}

impl Dispatcher for MountDispatcher {
    fn commands(&self) -> Vec<String> {
        let mut v: Vec<String> = [
            "block-export-add",
            "block-export-del",
            "query-block-exports",
            "query-blockstats",
            "quit",
        ]
        .iter()
        .map(|c| c.to_string())
        .collect();
        v.extend(
            ["list", "query-stats"]
                .iter()
                .map(|c| format!("{EXTENSION}{c}")),
        );
        v
    }

    fn dispatch(&self, name: &str, arguments: Value) -> Result<Value, QmpError> {
        let no_args = |a: &Value| match a.as_object().and_then(|m| m.keys().next()) {
            Some(k) => Err(QmpError::generic(format!("Parameter '{k}' is unexpected"))),
            None => Ok(()),
        };
        match name {
            "query-block-exports" => no_args(&arguments).map(|()| {
                json!([{
                    "type": "fuse",
                    "id": self.id,
                    "node-name": "",
                    "shutting-down": false,
                }])
            }),
            "query-blockstats" => {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields, rename_all = "kebab-case")]
                #[allow(dead_code)]
                struct A {
                    query_nodes: Option<bool>,
                }
                // No block nodes: a one-export process has none, as qemu-storage-daemon has
                // no named block backend for an export.
                qmp::parse_args::<A>(arguments).map(|_| json!([]))
            }
            "block-export-add" => self.refuse("add an export"),
            "block-export-del" => self.refuse("remove its export while it runs"),
            "quit" => no_args(&arguments).map(|()| {
                let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
                let _ = tx.send(Event::Stop(Stop::Signal(libc::SIGTERM)));
                json!({})
            }),
            n => match n.strip_prefix(EXTENSION) {
                Some("list") => no_args(&arguments).map(|()| json!([self.shown])),
                Some("query-stats") => self.stats(arguments),
                _ => Err(QmpError::command_not_found(name)),
            },
        }
    }
}

/// The control socket, serving on a thread of its own; shut down when dropped.
pub struct Control {
    handle: qmp::ShutdownHandle,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Control {
    fn drop(&mut self) {
        self.handle.shutdown();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Binds `path` and serves the control socket of `p` on a thread that keeps only what
/// `privileges` leaves.
pub fn start(
    path: &Path,
    p: &Prepared,
    privileges: Plan,
    tx: mpsc::Sender<Event>,
) -> Result<Control> {
    let id = p.mnt.mountpoint().to_string_lossy().into_owned();
    let mut shown = serde_json::to_value(p.describe("serving")).unwrap_or(Value::Null);
    shown["id"] = id.clone().into();
    let dispatcher = std::sync::Arc::new(MountDispatcher {
        id,
        meter: Meter::of(p),
        shown,
        tx: Mutex::new(tx),
    });
    let server = qmp::Server::bind(path, dispatcher, qmp::ServerConfig::default())
        .map_err(|e| anyhow!("--control {}: {e}", path.display()))?;
    let handle = server.shutdown_handle();
    let shown = path.to_path_buf();
    let thread = std::thread::Builder::new()
        .name("fusex-qmp".into())
        .spawn(move || {
            if let Err(e) = privileges.apply() {
                tracing::warn!("--control: cannot drop privileges, not serving: {e}");
                return;
            }
            if let Err(e) = server.run() {
                tracing::error!("QMP on {}: {e}", shown.display());
            }
        })
        .context("starting the control socket's thread")?;
    Ok(Control {
        handle,
        thread: Some(thread),
    })
}
