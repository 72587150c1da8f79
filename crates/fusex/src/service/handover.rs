//! `fusex restart` of a `fusex serve` daemon, the old daemon's side: who may ask, what is sent
//! (the daemon's state, then each export's with its descriptors), letting go of every export,
//! and the successor's side of adopting them into its table. The conversation itself is
//! `crate::restart`'s; the new process's side is [`super::takeover`].

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::mpsc;

use serde_json::Value;

use super::supervisor::ExportTx;
use super::{own_node, Control, Entry, Node, Service, Table};
use crate::lifecycle::{self, Event};

/// What every export letting go for a successor left ([`Service::release_all`]).
pub struct LetGo {
    /// Files open on each export, by id.
    pub open_files: BTreeMap<String, u64>,
    /// The directory exports, by id: their tables go to the successor before `servereleased`.
    pub dirs: Vec<(String, std::sync::Arc<dirfs::DirFs>)>,
    /// The exports, waiting to hear whether the successor took them.
    pub releasing: Releasing,
}

/// The exports that let go for a successor, waiting to hear whether it took them.
pub struct Releasing(Vec<ExportTx>);

impl Releasing {
    /// Tells every export whether the successor took it.
    pub fn taken(mut self, taken: bool) {
        for tx in std::mem::take(&mut self.0) {
            let _ = tx.send(Event::Taken(taken));
        }
    }
}

impl Drop for Releasing {
    /// Exports never told count as not taken (they are unmounted, as after a stop): none waits
    /// for an answer that cannot come.
    fn drop(&mut self) {
        for tx in self.0.drain(..) {
            let _ = tx.send(Event::Taken(false));
        }
    }
}

impl Service {
    /// `fusex restart` of any export of this daemon (a connection on its socket): checks who
    /// asks, sends the daemon's state and every export's, and waits for the successor's
    /// `release`, then passes the conversation to the main thread ([`Control::HandOver`]).
    /// Refused (the daemon serves on) when an export cannot be handed over.
    pub(super) fn hand_over(&self, stream: std::os::unix::net::UnixStream) {
        use crate::restart::{greet, recv, Message};
        let refuse = |why: &str| {
            tracing::info!("restart: not handed over: {why}");
            let _ = crate::restart::refuse(&stream, why);
        };
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        let pid = match greet(&stream, euid, "this daemon") {
            Ok(pid) => pid,
            Err(e) => return tracing::info!("restart: not handed over: {e:#}"),
        };
        let sent = {
            let mut t = self.table();
            if t.quitting || t.handing_over {
                return refuse("the daemon is stopping, or already being restarted");
            }
            let mut why = None;
            for (id, e) in &t.exports {
                why = match (&e.tx, &e.handing) {
                    (None, _) => Some(format!("export {id} is still starting")),
                    _ if e.shutting_down => Some(format!("export {id} is being removed")),
                    (_, None) => Some(format!("export {id} cannot be found again by a successor")),
                    (_, Some(h)) => h.refusal.clone(),
                };
                if why.is_some() {
                    break;
                }
            }
            if let Some(why) = why {
                return refuse(&format!(
                    "{why}; fusex serve hands over every export or none"
                ));
            }
            t.handing_over = true;
            self.send_state(&stream, &t)
        };
        tracing::info!(
            "restart: process {pid} asks for every export; they keep being served meanwhile"
        );
        let released = sent.and_then(|()| match recv(&stream) {
            Ok((Message::Release, _)) => Ok(()),
            Ok((other, _)) => Err(crate::restart::unexpected(&other, "release").to_string()),
            Err(e) => Err(format!("process {pid} went away before taking over ({e})")),
        });
        match released {
            Ok(()) => {
                let _ = self.control.send(Control::HandOver { stream, pid });
            }
            Err(e) => {
                tracing::info!("restart: not handed over: {e}");
                self.table().handing_over = false;
            }
        }
    }

    /// The daemon's state, then every export's with its descriptors, then the end.
    fn send_state(&self, stream: &std::os::unix::net::UnixStream, t: &Table) -> Result<(), String> {
        use crate::restart::{send, ExportHanding, Message, ServeState};
        let mut nodes: Vec<&Node> = t.nodes.values().filter(|n| n.args.is_some()).collect();
        nodes.sort_by_key(|n| n.order);
        let nbd_sizes = t.nbd_sizes();
        let log = crate::logging::stderr_to_hand_over();
        let credentials = t
            .objects
            .iter()
            .any(|o| matches!(o.kind, super::objects::Kind::TlsCreds(_)));
        let state = ServeState {
            version: if credentials {
                crate::restart::OBJECTS_STATE_VERSION
            } else {
                crate::restart::State::version_for(!nbd_sizes.is_empty())
            },
            nbd_sizes,
            argv: std::env::args().collect(),
            cwd: std::env::current_dir()
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default(),
            notify_socket: self
                .notify_socket
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            nodes: nodes.iter().filter_map(|n| n.args.clone()).collect(),
            objects: t.objects.iter().map(|o| o.args.clone()).collect(),
            log_stderr: log.is_some(),
        };
        let io = |e: std::io::Error| format!("sending the state: {e}");
        let fds: Vec<_> = log.into_iter().collect();
        send(stream, &Message::Serve(state), &fds).map_err(io)?;
        for (id, e) in &t.exports {
            let Some(h) = &e.handing else { continue };
            let own = t
                .nodes
                .get(&e.node)
                .is_some_and(|n| n.args.is_none() && n.implicit)
                && e.node == own_node(id);
            let msg = Message::Export(ExportHanding {
                id: id.clone(),
                node: e.node.clone(),
                own_node: own,
                config: e.config.clone(),
                iothreads: e.iothreads.clone(),
                state: h.state.clone(),
            });
            send(stream, &msg, &h.fds()).map_err(io)?;
        }
        send(stream, &Message::ServeEnd, &[]).map_err(io)
    }

    /// Lets go of every export for the successor `pid`: each answers what its queues took and
    /// flushes. Returns the files open on each, by id, the directory exports (whose tables go
    /// to the successor), and [`Releasing`], which says to every export whether the successor
    /// took them (they leave their mounts) or not (unmounted).
    pub fn release_all(&self, pid: u32) -> LetGo {
        type Asked = (
            String,
            ExportTx,
            mpsc::Receiver<lifecycle::Released>,
            mpsc::Receiver<bool>,
        );
        let asked: Vec<Asked> = {
            let t = self.table();
            t.exports
                .iter()
                .filter_map(|(id, e)| {
                    let tx = e.tx.as_ref()?;
                    let (otx, orx) = mpsc::sync_channel(1);
                    let (atx, arx) = mpsc::channel();
                    tx.send(Event::Release {
                        to: lifecycle::ReleaseTo::Channel(otx),
                        pid,
                        accepted: atx,
                    })
                    .ok()?;
                    Some((id.clone(), tx.clone(), orx, arx))
                })
                .collect()
        };
        let mut open = BTreeMap::new();
        let mut dirs = Vec::new();
        let mut taken = Vec::new();
        for (id, tx, orx, arx) in asked {
            let _in = crate::logging::export_span(&id).entered();
            if arx.recv() != Ok(true) {
                tracing::error!("restart: the export would not let go; the successor lacks it");
                continue;
            }
            match orx.recv() {
                Ok(r) => {
                    if let Some(d) = r.dir {
                        dirs.push((id.clone(), d));
                    }
                    open.insert(id, r.open_files);
                    taken.push(tx);
                }
                Err(_) => tracing::error!("restart: the export ended before it let go"),
            }
        }
        LetGo {
            open_files: open,
            dirs,
            releasing: Releasing(taken),
        }
    }

    /// The successor's side: an export taken over from the old daemon, served as if added.
    pub fn adopt(
        &self,
        id: &str,
        node: Option<Node>,
        node_name: &str,
        config: Option<Value>,
        iothreads: Vec<String>,
        prepared: lifecycle::Prepared,
    ) -> Result<(), String> {
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        // What exports added later are checked against (`Table::check_nesting`).
        let source = matches!(prepared.export, lifecycle::Fs::Dir(_))
            .then(|| {
                std::path::Path::new(&prepared.args.image)
                    .canonicalize()
                    .ok()
            })
            .flatten();
        let paths = Some((prepared.mnt.mountpoint().to_path_buf(), source));
        {
            let mut t = self.table();
            if let Some(n) = node {
                t.nodes.insert(n.name.clone(), n);
            }
            let mut entry = Entry::starting(serial, node_name.to_string(), None, config);
            entry.paths = paths;
            // Kept only if the IOThread came across: a predecessor that did not send its
            // objects leaves none to name.
            entry.iothreads = iothreads
                .into_iter()
                .filter(|i| t.objects.iter().any(|o| &o.id == i))
                .collect();
            t.exports.insert(id.to_string(), entry);
        }
        match self.supervise(id, serial, prepared) {
            Ok(tx) => {
                if let Some(e) = self.table().exports.get_mut(id) {
                    e.tx = Some(tx);
                }
                Ok(())
            }
            Err(e) => {
                self.table().exports.remove(id);
                Err(e)
            }
        }
    }

    /// Tells a `fusex restart` successor systemd's socket.
    pub fn set_notify_socket(&self, socket: Option<String>) {
        *self.notify_socket.lock().unwrap_or_else(|p| p.into_inner()) = socket;
    }
}
