//! `fusex serve --config FILE`: the exports started at launch, as TOML tables with `fusex
//! mount`'s option names, and what a reload (SIGHUP, `fusex ctl reload`) does with a changed
//! file: new exports start, removed ones stop safely, changed ones are made anew, and each
//! export's outcome is reported. One key belongs to the daemon, not to an export:
//! `metrics-listen` (as `--metrics-listen`, which wins over it), read at start only.
//!
//! ```toml
//! metrics-listen = "127.0.0.1:9100"
//!
//! [[export]]
//! id = "vm1"
//! image = "/srv/images/vm1.qcow2"
//! mountpoint = "/srv/exports/vm1.raw"
//! writable = true
//! transport = "legacy"
//! ```

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use qmp::QmpError;

use super::{Service, Stop};
use crate::lifecycle::Event;

/// One `[[export]]` table: its id and the whole table (compared on reload).
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigExport {
    pub id: String,
    pub table: Map<String, Value>,
}

/// A whole config file: the daemon's keys and the exports.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Config {
    /// `metrics-listen = "ADDR:PORT"`: where Prometheus metrics are served.
    pub metrics_listen: Option<String>,
    pub exports: Vec<ConfigExport>,
}

/// Reads and checks a config file's exports (see [`read_all`]).
pub fn read(path: &Path) -> Result<Vec<ConfigExport>, String> {
    read_all(path).map(|c| c.exports)
}

/// Reads and checks a config file: every export has an id, an image and a mountpoint, ids are
/// unique, and nothing but `metrics-listen` and `[[export]]` tables is in it. Errors name the
/// file and the export.
pub fn read_all(path: &Path) -> Result<Config, String> {
    let shown = path.display();
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("config {shown}: cannot read it: {e}"))?;
    let doc: Value = toml::from_str(&text)
        .map_err(|e| format!("config {shown}: {}", e.to_string().replace('\n', " ")))?;
    let Value::Object(mut top) = doc else {
        return Err(format!("config {shown}: not a TOML document"));
    };
    let exports = top.remove("export").unwrap_or(Value::Array(vec![]));
    let metrics_listen = match top.remove("metrics-listen") {
        None => None,
        Some(Value::String(s)) => Some(s),
        Some(_) => {
            return Err(format!(
                "config {shown}: metrics-listen takes a string: metrics-listen = \"ADDR:PORT\""
            ))
        }
    };
    if let Some(k) = top.keys().next() {
        return Err(format!(
            "config {shown}: unknown key '{k}': the file holds metrics-listen and [[export]] \
             tables only"
        ));
    }
    let Value::Array(list) = exports else {
        return Err(format!(
            "config {shown}: 'export' must be an array of tables: write [[export]]"
        ));
    };
    let mut out: Vec<ConfigExport> = Vec::new();
    for (i, e) in list.into_iter().enumerate() {
        let Value::Object(table) = e else {
            return Err(format!("config {shown}: export {} is not a table", i + 1));
        };
        let field = |k: &str| table.get(k).and_then(Value::as_str).map(str::to_string);
        let id = field("id")
            .ok_or_else(|| format!("config {shown}: export {} has no id (id = \"NAME\")", i + 1))?;
        for k in ["image", "mountpoint"] {
            if field(k).is_none() {
                return Err(format!(
                    "config {shown}: export '{id}' has no {k} ({k} = \"PATH\")"
                ));
            }
        }
        if out.iter().any(|o| o.id == id) {
            return Err(format!("config {shown}: export id '{id}' is given twice"));
        }
        out.push(ConfigExport { id, table });
    }
    Ok(Config {
        metrics_listen,
        exports: out,
    })
}

/// The `__org.fusex_export-add` arguments of a config export: a relative image or mountpoint is
/// taken from the config file's directory.
fn request(e: &ConfigExport, base: &Path) -> Value {
    let mut options = e.table.clone();
    let mut take = |k: &str| -> String {
        options
            .remove(k)
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default()
    };
    let (id, mut image, mountpoint) = (take("id"), take("image"), take("mountpoint"));
    let from_base = |p: &str| base.join(p).to_string_lossy().into_owned();
    // `null:SIZE` and NBD URIs are not paths; a mountpoint always is.
    if backend::names_a_path(&image) {
        image = from_base(&image);
    }
    let mountpoint = from_base(&mountpoint);
    json!({"id": id, "image": image, "mountpoint": mountpoint, "options": options})
}

impl Service {
    /// Remembers the config file at `path` (for reloads) and starts its exports, as [`read`]
    /// returned them; the first that cannot start is the error, naming it.
    pub fn load_config(&self, path: &Path, exports: &[ConfigExport]) -> Result<(), String> {
        let path = self.remember_config(path);
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        for e in exports {
            self.own_export_add(request(e, &base), Some(Value::Object(e.table.clone())))
                .map_err(|err| {
                    format!("config {}: export '{}': {}", path.display(), e.id, err.desc)
                })?;
        }
        Ok(())
    }

    /// Remembers the config file for reloads (alone: a `fusex restart` successor took its
    /// exports over); returns the path as remembered, absolute.
    pub fn remember_config(&self, path: &Path) -> PathBuf {
        let path = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        *self.config_path.lock().unwrap_or_else(|p| p.into_inner()) = Some(path.clone());
        path
    }

    /// Applies the config file as it is now; per export what happened.
    pub fn reload(&self) -> Result<Value, QmpError> {
        let Some(path) = self
            .config_path
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        else {
            return Err(QmpError::generic(
                "fusex serve was started without --config: there is nothing to reload",
            ));
        };
        let wanted = read(&path).map_err(QmpError::generic)?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        // What the config made before: id -> its table.
        let running: Vec<(String, Value)> = {
            let t = self.table();
            t.exports
                .iter()
                .filter_map(|(id, e)| e.config.clone().map(|c| (id.clone(), c)))
                .collect()
        };
        let mut report = Vec::new();
        let mut gone = Vec::new();
        for (id, table) in &running {
            match wanted.iter().find(|w| &w.id == id) {
                Some(w) if Value::Object(w.table.clone()) == *table => {
                    report.push(json!({"id": id, "action": "unchanged"}));
                }
                Some(_) => gone.push((id.clone(), "recreated")),
                None => gone.push((id.clone(), "removed")),
            }
        }
        // Removed and changed exports stop safely first (a changed one may keep its mountpoint).
        for (id, _) in &gone {
            self.stop_one(id);
        }
        let deadline = Instant::now() + RELOAD_STOP_WAIT;
        while gone
            .iter()
            .any(|(id, _)| self.table().exports.contains_key(id))
        {
            if Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        for (id, action) in &gone {
            if self.table().exports.contains_key(id) {
                report.push(json!({"id": id, "action": "failed",
                                   "error": "the old export did not stop in time"}));
            } else if *action == "removed" {
                report.push(json!({"id": id, "action": "removed"}));
            }
        }
        for w in &wanted {
            let was = running.iter().any(|(id, _)| id == &w.id);
            let recreate = gone.iter().any(|(id, a)| id == &w.id && *a == "recreated");
            if was && !recreate {
                continue;
            }
            if self.table().exports.contains_key(&w.id) {
                if !was {
                    report.push(json!({"id": w.id, "action": "failed",
                        "error": "an export of that id exists (added over QMP): remove it first"}));
                }
                continue;
            }
            let action = if recreate { "recreated" } else { "added" };
            match self.own_export_add(request(w, &base), Some(Value::Object(w.table.clone()))) {
                Ok(_) => report.push(json!({"id": w.id, "action": action})),
                Err(e) => report.push(json!({"id": w.id, "action": "failed", "error": e.desc})),
            }
        }
        for r in &report {
            let (id, action) = (
                r["id"].as_str().unwrap_or(""),
                r["action"].as_str().unwrap_or(""),
            );
            let _in = crate::logging::export_span(id).entered();
            match r["error"].as_str() {
                // The span names the export (text: `export ID: reload: ...`).
                Some(e) => tracing::error!("reload: {e}"),
                None => tracing::info!("reload: {action}"),
            }
        }
        Ok(Value::Array(report))
    }

    /// Stops one export safely (a reload removing it).
    fn stop_one(&self, id: &str) {
        let mut t = self.table();
        if let Some(e) = t.exports.get_mut(id) {
            e.shutting_down = true;
            if let Some(tx) = &e.tx {
                let _ = tx.send(Event::Stop(Stop::Safe));
            }
        }
    }
}

/// How long a reload waits for the exports it removes to stop.
const RELOAD_STOP_WAIT: Duration = Duration::from_secs(30);

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<ConfigExport>, String> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.toml");
        std::fs::write(&p, text).unwrap();
        read(&p).map_err(|e| e.replace(&p.display().to_string(), "F"))
    }

    #[test]
    fn exports_and_their_mistakes() {
        let v = parse(
            "[[export]]\nid = \"a\"\nimage = \"a.img\"\nmountpoint = \"a.raw\"\nwritable = true\n",
        )
        .unwrap();
        assert_eq!(v[0].id, "a");
        assert_eq!(v[0].table["writable"], true);
        let r = request(&v[0], Path::new("/etc/fusex"));
        assert_eq!(r["image"], "/etc/fusex/a.img");
        assert_eq!(r["mountpoint"], "/etc/fusex/a.raw");
        assert_eq!(r["options"], json!({"writable": true}));
        // Only paths are taken from the config's directory: not `null:` and NBD images, and
        // always the mountpoint, whatever its name.
        for (image, mountpoint) in [("null:1G", "null:m"), ("nbd://host/e", "nbd:m")] {
            let v = parse(&format!(
                "[[export]]\nid = \"n\"\nimage = \"{image}\"\nmountpoint = \"{mountpoint}\"\n"
            ))
            .unwrap();
            let r = request(&v[0], Path::new("/etc/fusex"));
            assert_eq!(r["image"], image);
            assert_eq!(r["mountpoint"], format!("/etc/fusex/{mountpoint}"));
        }
        assert!(parse("[[export]]\nimage = \"a\"\nmountpoint = \"b\"\n")
            .unwrap_err()
            .contains("has no id"));
        assert!(parse("[[export]]\nid = \"a\"\nmountpoint = \"b\"\n")
            .unwrap_err()
            .contains("'a' has no image"));
        assert!(parse("exports = 1\n")
            .unwrap_err()
            .contains("unknown key 'exports'"));
        assert!(parse(
            "[[export]]\nid=\"a\"\nimage=\"x\"\nmountpoint=\"y\"\n\
             [[export]]\nid=\"a\"\nimage=\"x\"\nmountpoint=\"z\"\n"
        )
        .unwrap_err()
        .contains("given twice"));
        assert!(parse("[[export]\n").unwrap_err().starts_with("config F: "));
        assert!(parse("").unwrap().is_empty());
    }

    #[test]
    fn metrics_listen_is_a_daemon_key() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.toml");
        std::fs::write(
            &p,
            "metrics-listen = \"127.0.0.1:9100\"\n[[export]]\nid = \"a\"\nimage = \"x\"\n\
             mountpoint = \"y\"\n",
        )
        .unwrap();
        let c = read_all(&p).unwrap();
        assert_eq!(c.metrics_listen.as_deref(), Some("127.0.0.1:9100"));
        assert_eq!(c.exports.len(), 1);
        assert!(parse("metrics-listen = 9100\n")
            .unwrap_err()
            .contains("takes a string"));
    }
}
