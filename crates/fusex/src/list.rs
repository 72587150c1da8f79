//! `fusex list`: the exports of this host, from what their daemons publish in the runtime
//! directories (`crate::runtime`) and from the mount table.
//!
//! A serving daemon keeps a state file beside its restart socket; an entry counts only while that
//! socket is listening (a killed daemon's files stay behind, and say nothing). A fusex mount with
//! no live daemon is shown as dead, with the command that clears it. An export that is stopping
//! with files still open is no longer in the mount table (it was detached) but is listed from its
//! state file until its daemon exits.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;

use anyhow::Result;
use serde_json::{json, Value};
use transport::MountIdentity;

/// Prints the table (or, with `json`, an array of objects).
pub fn run(json: bool) -> Result<()> {
    let rows = collect();
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, &rows)?;
        writeln!(out)?;
    } else {
        out.write_all(table(&rows).as_bytes())?;
    }
    Ok(())
}

/// The users whose runtime directories to read: this user's, and for root every user with a fusex
/// mount or a runtime directory under `/run/user`.
fn users(mounts: &[transport::MountEntry]) -> BTreeSet<u32> {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let mut uids = BTreeSet::from([euid]);
    if euid == 0 {
        uids.extend(mounts.iter().filter_map(|m| m.user_id));
        if let Ok(dir) = std::fs::read_dir("/run/user") {
            uids.extend(
                dir.flatten()
                    .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok()),
            );
        }
    }
    uids
}

/// Every export: live daemons' states, then fusex mounts no live daemon accounts for.
fn collect() -> Vec<Value> {
    let mounts = transport::fusex_mounts();
    let listening = crate::restart::Listening::read();
    let mut rows = Vec::new();
    let mut served = BTreeSet::new();
    for uid in users(&mounts) {
        let Ok(dir) = crate::runtime::checked(uid, false) else {
            continue;
        };
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path.extension().is_none_or(|x| x != "json") {
                continue;
            }
            let Some(parsed) = crate::files::read_regular(&path)
                .and_then(|t| serde_json::from_str::<crate::runtime::ExportState>(&t).ok())
            else {
                continue;
            };
            let socket = crate::runtime::answering_socket(&dir, &path, Some(&parsed));
            if !listening.has(&socket) {
                continue;
            }
            let Ok(mut state) = serde_json::to_value(crate::runtime::ExportState {
                socket: None,
                ..parsed
            }) else {
                continue;
            };
            state["user"] = uid.into();
            if let Some(key) = path.file_stem().and_then(|s| s.to_str()) {
                served.insert(key.to_string());
            }
            rows.push(state);
        }
    }
    for m in mounts {
        let mp = Path::new(&m.mount_point);
        let key = MountIdentity::of_path(mp)
            .ok()
            .map(|id| crate::runtime::key(&id));
        if key.as_ref().is_some_and(|k| served.contains(k)) {
            continue;
        }
        let state = if listening.daemon_of(&m) {
            // A daemon listens but published no state this user may read (or none at all).
            "serving (no state published)".to_string()
        } else {
            format!(
                "dead: its daemon is gone; `fusex umount {}` clears it",
                m.mount_point
            )
        };
        rows.push(json!({
            "mountpoint": m.mount_point,
            "image": m.source,
            "user": m.user_id,
            "state": state,
        }));
    }
    rows.sort_by(|a, b| a["mountpoint"].as_str().cmp(&b["mountpoint"].as_str()));
    rows
}

/// The rows as aligned columns under a header; `-` where a value is unknown.
fn table(rows: &[Value]) -> String {
    const COLUMNS: [(&str, &str); 6] = [
        ("MOUNTPOINT", "mountpoint"),
        ("IMAGE", "image"),
        ("FORMAT", "format"),
        ("TRANSPORT", "transport"),
        ("PID", "pid"),
        ("STATE", "state"),
    ];
    let cell = |row: &Value, key: &str| match &row[key] {
        Value::String(s) => backend::qcow2::named::shown(s),
        Value::Null => "-".to_string(),
        v => v.to_string(),
    };
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| COLUMNS.iter().map(|(_, k)| cell(r, k)).collect())
        .collect();
    let mut widths: Vec<usize> = COLUMNS.iter().map(|(h, _)| h.len()).collect();
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = COLUMNS.iter().map(|(h, _)| h.to_string()).collect();
    for row in std::iter::once(&header).chain(&cells) {
        let last = row.len() - 1;
        for (i, (c, w)) in row.iter().zip(&widths).enumerate() {
            if i == last {
                out.push_str(c);
            } else {
                out.push_str(&format!("{c:<w$}  "));
            }
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_aligns_columns_and_marks_unknowns() {
        let rows = vec![
            json!({"mountpoint": "/tmp/a.raw", "image": "/img/a.qcow2", "format": "qcow2",
                   "transport": "io_uring", "pid": 42, "state": "serving"}),
            json!({"mountpoint": "/x", "image": "b\u{1b}[2J", "state": "dead"}),
        ];
        let t = table(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("MOUNTPOINT  IMAGE"), "{t}");
        let col = |l: &str, word: &str| l.find(word).unwrap();
        assert_eq!(col(lines[0], "STATE"), col(lines[1], "serving"));
        assert_eq!(col(lines[0], "PID"), col(lines[1], "42"));
        let pid = col(lines[0], "PID");
        assert_eq!(&lines[2][pid..pid + 3], "-  ", "{t}");
        // A name from an image never reaches the terminal raw.
        assert!(!t.contains('\u{1b}'), "{t:?}");
    }
}
