//! `fusex ctl`: a small client of a `fusex serve` daemon's control socket, for people (tables)
//! and scripts (`--json`). It speaks the same QMP any client does.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

use crate::cli::{CtlArgs, CtlCommand};

/// How long a command may take (an export's mount, a safe removal's flush).
const REPLY_TIMEOUT: Duration = Duration::from_secs(300);

/// A connection in command mode.
struct Client {
    out: UnixStream,
    lines: BufReader<UnixStream>,
    events: Vec<Value>,
}

impl Client {
    fn connect(path: &Path) -> Result<Client> {
        let s = UnixStream::connect(path).map_err(|e| {
            anyhow!(
                "cannot reach fusex serve at {} ({e}): is it running? (--control PATH names \
                 another socket)",
                path.display()
            )
        })?;
        s.set_read_timeout(Some(REPLY_TIMEOUT))?;
        let mut c = Client {
            out: s.try_clone()?,
            lines: BufReader::new(s),
            events: Vec::new(),
        };
        let greeting = c.read()?;
        if greeting.get("QMP").is_none() {
            bail!("{} is not a QMP socket", path.display());
        }
        c.execute("qmp_capabilities", json!({}))?;
        Ok(c)
    }

    fn read(&mut self) -> Result<Value> {
        let mut line = String::new();
        if self
            .lines
            .read_line(&mut line)
            .context("reading the reply")?
            == 0
        {
            bail!("fusex serve closed the connection");
        }
        serde_json::from_str(&line).context("the daemon's reply is not JSON")
    }

    fn execute(&mut self, cmd: &str, args: Value) -> Result<Value> {
        let req = json!({"execute": cmd, "arguments": args});
        writeln!(self.out, "{req}").context("sending the command")?;
        loop {
            let m = self.read()?;
            if m.get("event").is_some() {
                self.events.push(m);
                continue;
            }
            if let Some(r) = m.get("return") {
                return Ok(r.clone());
            }
            bail!(
                "{}",
                m["error"]["desc"].as_str().unwrap_or("the daemon refused")
            );
        }
    }

    /// Waits for `BLOCK_EXPORT_DELETED` of `id`.
    fn wait_deleted(&mut self, id: &str) -> Result<()> {
        let is = |e: &Value| e["event"] == "BLOCK_EXPORT_DELETED" && e["data"]["id"] == id;
        while !self.events.iter().any(is) {
            let m = self.read()?;
            if m.get("event").is_some() {
                self.events.push(m);
            }
        }
        Ok(())
    }
}

/// Runs `fusex ctl`.
pub fn run(args: CtlArgs) -> Result<()> {
    let path = match &args.control {
        Some(p) => p.clone(),
        None => default_socket()?,
    };
    let mut c = Client::connect(&path)?;
    let prefix = crate::service::options::EXTENSION;
    match args.command {
        CtlCommand::Add {
            id,
            image,
            mountpoint,
            options,
        } => {
            let mountpoint = std::path::absolute(&mountpoint).unwrap_or(mountpoint);
            // Paths are the client's: the daemon may run elsewhere.
            let image = if image.contains("://") || image.starts_with("null:") {
                image
            } else {
                std::path::absolute(&image)
                    .map(|p| p.to_string_lossy().into_owned())
                    .unwrap_or(image)
            };
            c.execute(
                &format!("{prefix}export-add"),
                json!({"id": id, "image": image, "mountpoint": mountpoint, "args": options}),
            )?;
            print(&args.json, json!({"id": id, "added": true}), || {
                format!("added {id}: {image} at {}", mountpoint.display())
            });
        }
        CtlCommand::Remove { id, force } => {
            let mode = if force { "hard" } else { "safe" };
            c.execute("block-export-del", json!({"id": id, "mode": mode}))?;
            c.wait_deleted(&id)?;
            print(&args.json, json!({"id": id, "removed": true}), || {
                format!("removed {id}")
            });
        }
        CtlCommand::List => {
            let list = c.execute(&format!("{prefix}list"), json!({}))?;
            print(&args.json, list.clone(), || table(&list));
        }
        CtlCommand::Show { id } => {
            let list = c.execute(&format!("{prefix}list"), json!({}))?;
            let one = list
                .as_array()
                .and_then(|l| l.iter().find(|e| e["id"] == id.as_str()))
                .cloned()
                .ok_or_else(|| anyhow!("no export '{id}': fusex ctl list shows them"))?;
            print(&args.json, one.clone(), || {
                let Value::Object(m) = &one else {
                    return String::new();
                };
                m.iter()
                    .map(|(k, v)| format!("{k}: {}", cell(v)))
                    .collect::<Vec<_>>()
                    .join("\n")
            });
        }
        CtlCommand::Reload => {
            let report = c.execute(&format!("{prefix}reload"), json!({}))?;
            print(&args.json, report.clone(), || {
                let rows: Vec<Vec<String>> = report
                    .as_array()
                    .map(|l| {
                        l.iter()
                            .map(|r| vec![cell(&r["id"]), cell(&r["action"]), cell(&r["error"])])
                            .collect()
                    })
                    .unwrap_or_default();
                columns(&["ID", "ACTION", "ERROR"], &rows)
            });
            if report
                .as_array()
                .is_some_and(|l| l.iter().any(|r| r["action"] == "failed"))
            {
                bail!("some exports failed to reload (listed above)");
            }
        }
    }
    Ok(())
}

/// The socket `fusex serve` uses when given none.
fn default_socket() -> Result<PathBuf> {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    Ok(crate::runtime::control_socket(&crate::runtime::dir_for(
        uid,
    )))
}

fn print(json: &bool, v: Value, human: impl FnOnce() -> String) {
    if *json {
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else {
        let text = human();
        if !text.is_empty() {
            println!("{text}");
        }
    }
}

/// A value as a table cell (`-` when absent), with control characters made visible.
fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => backend::qcow2::named::shown(s),
        v => v.to_string(),
    }
}

fn table(list: &Value) -> String {
    let keys = ["id", "mountpoint", "image", "format", "transport", "state"];
    let rows: Vec<Vec<String>> = list
        .as_array()
        .map(|l| {
            l.iter()
                .map(|e| keys.iter().map(|k| cell(&e[*k])).collect())
                .collect()
        })
        .unwrap_or_default();
    columns(
        &["ID", "MOUNTPOINT", "IMAGE", "FORMAT", "TRANSPORT", "STATE"],
        &rows,
    )
}

/// Rows under a header, each column as wide as its widest cell.
fn columns(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut width: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        cells
            .iter()
            .zip(&width)
            .map(|(c, w)| format!("{c:w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let mut out = vec![line(header.iter().map(|h| h.to_string()).collect())];
    out.extend(rows.iter().map(|r| line(r.clone())));
    out.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_and_show_missing_values() {
        let t = table(&json!([
            {"id": "a", "mountpoint": "/m", "image": "/i", "format": "raw",
             "transport": "legacy", "state": "serving"},
            {"id": "longer", "mountpoint": "/n", "state": "starting"}
        ]));
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("ID      MOUNTPOINT"));
        assert!(lines[2].starts_with("longer  /n"));
        assert!(lines[2].contains(" -  "));
    }
}
