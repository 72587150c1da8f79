//! A directory export's tables on the restart socket ([`crate::restart`]): the node ids and
//! open handles the kernel holds name descriptors, which go to the successor with the tables
//! ([`dirfs::DirFs::handover`]). The tables come in messages of at most
//! [`crate::restart::MAX_FDS`] descriptors and [`ENTRIES`] entries, so that a tree of any size
//! fits the conversation's message limits: `dirtable` (the rest of the tables), `dirnodes` and
//! `dirfiles` with their entries' descriptors, then `dirend`.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use dirfs::files::FileEntry;
use dirfs::inodes::NodeEntry;
use dirfs::{DirFs, DirHandover};

use crate::restart::{recv, send, Message, MAX_FDS};

/// Most entries a message carries (a node with a file handle is a few hundred bytes of JSON:
/// well within the message limit).
const ENTRIES: usize = 1000;

/// Sends the tables of the directory export `id`, whose queues have let go.
pub fn send_dir(sock: &UnixStream, id: &str, fs: &DirFs) -> io::Result<()> {
    let (mut table, fds) = fs.handover();
    let nodes = std::mem::take(&mut table.nodes);
    let files = std::mem::take(&mut table.files);
    send(
        sock,
        &Message::DirTable {
            id: id.to_string(),
            table,
        },
        &[],
    )?;
    let mut fds = fds.into_iter();
    send_runs(
        sock,
        &nodes,
        |n| n.handle.is_none(),
        &mut fds,
        |nodes| Message::DirNodes { nodes },
    )?;
    send_runs(
        sock,
        &files,
        |_| true,
        &mut fds,
        |files| Message::DirFiles { files },
    )?;
    send(sock, &Message::DirEnd, &[])
}

/// Sends `entries` in [`chunks`], each as the message `message` makes of it with the
/// descriptors of its entries (`has_fd`), taken in order from `fds`.
fn send_runs<T: Clone>(
    sock: &UnixStream,
    entries: &[T],
    has_fd: impl Fn(&T) -> bool,
    fds: &mut impl Iterator<Item = RawFd>,
    message: impl Fn(Vec<T>) -> Message,
) -> io::Result<()> {
    for (run, with) in chunks(entries, has_fd) {
        let these: Vec<RawFd> = fds.by_ref().take(with).collect();
        send(sock, &message(run.to_vec()), &these)?;
    }
    Ok(())
}

/// A directory export's tables and their descriptors, as [`DirFs::take_over`] takes them.
pub type Tables = (DirHandover, Vec<OwnedFd>);

/// A `fusex restart` successor's reading after it sent `release`: every directory export's
/// tables (by export id; `""` for a `fusex mount` daemon's one export), until the message
/// `last` takes as the end (`released`, `servereleased`); any other message is an error.
pub fn recv_released<T>(
    sock: &UnixStream,
    last: impl Fn(&Message) -> Option<T>,
) -> anyhow::Result<(T, BTreeMap<String, Tables>)> {
    use anyhow::Context;
    let mut dirs = BTreeMap::new();
    loop {
        let (msg, _) = recv(sock).context("the old daemon went away before letting go")?;
        if let Some(end) = last(&msg) {
            return Ok((end, dirs));
        }
        match msg {
            Message::DirTable { id, table } => {
                let whole = recv_dir(sock, table).with_context(|| match id.as_str() {
                    "" => "the directory export's tables".to_string(),
                    id => format!("the tables of directory export {id}"),
                })?;
                dirs.insert(id, whole);
            }
            other => return Err(crate::restart::unexpected(&other, "released")),
        }
    }
}

/// `entries` cut into runs of at most [`ENTRIES`] entries of which at most [`MAX_FDS`] carry a
/// descriptor (`has_fd`), with the count of those.
fn chunks<T>(entries: &[T], has_fd: impl Fn(&T) -> bool) -> Vec<(&[T], usize)> {
    let mut out = Vec::new();
    let (mut start, mut with) = (0, 0);
    for (i, e) in entries.iter().enumerate() {
        if i - start == ENTRIES || (has_fd(e) && with == MAX_FDS) {
            out.push((&entries[start..i], with));
            (start, with) = (i, 0);
        }
        with += usize::from(has_fd(e));
    }
    if start < entries.len() {
        out.push((&entries[start..], with));
    }
    out
}

/// The rest of a directory export's tables after its `dirtable` message (`table`): the whole
/// tables and their descriptors, in the order [`DirFs::take_over`] takes them.
fn recv_dir(sock: &UnixStream, mut table: DirHandover) -> io::Result<Tables> {
    let mut node_fds = Vec::new();
    let mut file_fds = Vec::new();
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
    loop {
        match recv(sock)? {
            (Message::DirNodes { nodes }, fds) => {
                if fds.len()
                    != nodes
                        .iter()
                        .filter(|n: &&NodeEntry| n.handle.is_none())
                        .count()
                {
                    return Err(bad("a dirnodes message without its descriptors"));
                }
                table.nodes.extend(nodes);
                node_fds.extend(fds);
            }
            (Message::DirFiles { files }, fds) => {
                let files: Vec<FileEntry> = files;
                if fds.len() != files.len() {
                    return Err(bad("a dirfiles message without its descriptors"));
                }
                table.files.extend(files);
                file_fds.extend(fds);
            }
            (Message::DirEnd, _) => break,
            (other, _) => {
                return Err(io::Error::other(
                    crate::restart::unexpected(&other, "dirend").to_string(),
                ))
            }
        }
    }
    node_fds.extend(file_fds);
    Ok((table, node_fds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_keep_to_both_limits() {
        let v: Vec<bool> = (0..2600).map(|i| i % 3 != 0).collect();
        let c = chunks(&v, |&b| b);
        assert_eq!(c.iter().map(|c| c.0.len()).sum::<usize>(), v.len());
        for (run, with) in &c {
            assert!(run.len() <= ENTRIES);
            assert!(*with <= MAX_FDS);
            assert_eq!(*with, run.iter().filter(|&&b| b).count());
        }
        assert!(chunks::<bool>(&[], |&b| b).is_empty());
        let all: Vec<bool> = vec![true; MAX_FDS * 2 + 1];
        let c = chunks(&all, |&b| b);
        assert_eq!(
            c.iter().map(|c| c.1).collect::<Vec<_>>(),
            [MAX_FDS, MAX_FDS, 1]
        );
    }
}
