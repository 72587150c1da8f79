//! Reading `/proc/self/mountinfo`: is something mounted at a path, and is it FUSE?

use std::path::Path;

/// One line of mountinfo, the parts fusex needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    /// Mount point, unescaped.
    pub mount_point: String,
    /// Filesystem type (e.g. `fuse.fusex`).
    pub fstype: String,
}

/// Undoes mountinfo's octal escapes (`\040` for a space, ...).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 4 <= b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = b[i + 1..i + 4]
                .iter()
                .fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0'));
            if let Ok(v) = u8::try_from(v) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses mountinfo text into entries (lines that do not parse are skipped).
pub fn parse(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let (pre, post) = line.split_once(" - ")?;
            let mount_point = pre.split(' ').nth(4)?;
            let fstype = post.split(' ').next()?;
            Some(MountEntry {
                mount_point: unescape(mount_point),
                fstype: fstype.to_string(),
            })
        })
        .collect()
}

/// The FUSE mount at exactly `path` (already canonical), if any; the last one wins when stacked.
pub fn fuse_mount_at(path: &Path) -> Option<MountEntry> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let want = path.to_string_lossy();
    parse(&text)
        .into_iter()
        .rev()
        .find(|m| m.mount_point == want && (m.fstype == "fuse" || m.fstype.starts_with("fuse.")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fuse_lines_and_escapes() {
        let t = "36 35 98:0 / /mnt1 rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n\
                 40 22 0:45 / /tmp/a\\040b/disk.raw rw,nosuid,nodev - fuse.fusex /img rw,user_id=0\n\
                 garbage\n";
        let e = parse(t);
        assert_eq!(e.len(), 2);
        assert_eq!(e[1].mount_point, "/tmp/a b/disk.raw");
        assert_eq!(e[1].fstype, "fuse.fusex");
        assert_eq!(e[0].fstype, "ext3");
    }

    #[test]
    fn unescape_edge_cases() {
        assert_eq!(unescape("a\\040"), "a ");
        assert_eq!(unescape("a\\04"), "a\\04");
        assert_eq!(unescape("\\"), "\\");
        assert_eq!(unescape("x\\134y"), "x\\y");
    }
}
