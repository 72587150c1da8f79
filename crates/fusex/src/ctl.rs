//! `fusex ctl`: a small client of a `fusex serve` daemon's control socket, for people (tables)
//! and scripts (`--json`). It speaks the same QMP any client does.

use anyhow::{anyhow, bail, Result};
use serde_json::{json, Value};

use crate::cli::{CtlArgs, CtlCommand};
use crate::qmp_client::{default_socket, Client};

/// Runs `fusex ctl`.
pub fn run(args: CtlArgs) -> Result<()> {
    let path = match &args.control {
        Some(p) => p.clone(),
        None => default_socket(),
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
            let image = if !backend::names_a_path(&image) {
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
