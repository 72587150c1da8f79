//! `fusex --version`: the version, and what this machine's kernel offers fusex, learned without
//! mounting anything and without changing any setting (only files are read).

use std::io::Read;
use std::path::Path;

/// What `fusex --version` prints.
pub fn report() -> String {
    let mut s = format!("fusex {}\n", env!("CARGO_PKG_VERSION"));
    s.push_str(&format!(
        "FUSE protocol: fusex speaks 7.{}; the kernel's minor is negotiated at mount (INIT)\n",
        fuse_abi::KERNEL_MINOR_VERSION
    ));
    s.push_str(&match transport::uring_unavailable_reason() {
        None => format!(
            "io_uring transport: available ({} = Y)\n",
            transport::ENABLE_URING_PARAM
        ),
        Some(why) => format!("io_uring transport: not available: {why}\n"),
    });
    let fusermount = find_in_path(transport::fusermount::FUSERMOUNT);
    s.push_str(&match (has_sys_admin(), &fusermount) {
        (true, _) => "mounting: mount(2) (CAP_SYS_ADMIN held)\n".to_string(),
        (false, Some(p)) => format!("mounting: through {} (no CAP_SYS_ADMIN)\n", p.display()),
        (false, None) => format!(
            "mounting: not possible: no CAP_SYS_ADMIN and no {} in PATH (install fuse3)\n",
            transport::fusermount::FUSERMOUNT
        ),
    });
    s.push_str(&format!(
        "passthrough: kernel {}; {}\n",
        passthrough_config(),
        if has_sys_admin() {
            "CAP_SYS_ADMIN held"
        } else {
            "CAP_SYS_ADMIN not held (passthrough needs it: run as root)"
        }
    ));
    s
}

/// Where `PATH` finds the executable `name`, as `fusex mount` would run it.
fn find_in_path(name: &str) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Whether the effective set holds `CAP_SYS_ADMIN` (bit 21 of `CapEff` in /proc/self/status).
fn has_sys_admin() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << 21) != 0)
}

/// Reads a kernel configuration file (plain or gzip), None if it cannot.
type ConfigReader = fn(&Path) -> Option<String>;

/// What the kernel's build configuration says about `CONFIG_FUSE_PASSTHROUGH` (Linux 6.9+), from
/// `/proc/config.gz` or `/boot/config-RELEASE`.
fn passthrough_config() -> String {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let boot = format!("/boot/config-{}", release.trim());
    let sources: [(&str, ConfigReader); 2] = [
        ("/proc/config.gz", |p| gunzip(&std::fs::read(p).ok()?)),
        (&boot, |p| std::fs::read_to_string(p).ok()),
    ];
    for (path, read) in sources {
        let Some(config) = read(Path::new(path)) else {
            continue;
        };
        return match config_value(&config, "CONFIG_FUSE_PASSTHROUGH") {
            Some("y") => format!("has it (CONFIG_FUSE_PASSTHROUGH=y in {path})"),
            Some(v) => format!("lacks it (CONFIG_FUSE_PASSTHROUGH={v} in {path})"),
            None => format!("lacks it (no CONFIG_FUSE_PASSTHROUGH in {path}: Linux 6.9+ has it)"),
        };
    }
    "configuration unknown (no /proc/config.gz or /boot/config-RELEASE; needs Linux 6.9+ \
     with CONFIG_FUSE_PASSTHROUGH)"
        .to_string()
}

/// The value of `key` in a kernel `.config`.
fn config_value<'a>(config: &'a str, key: &str) -> Option<&'a str> {
    config
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
}

/// The contents of a gzip file's first member (RFC 1952: a header, then raw deflate data).
fn gunzip(data: &[u8]) -> Option<String> {
    const FHCRC: u8 = 2;
    const FEXTRA: u8 = 4;
    const FNAME: u8 = 8;
    const FCOMMENT: u8 = 16;
    if data.len() < 10 || data[0..3] != [0x1f, 0x8b, 8] {
        return None;
    }
    let flags = data[3];
    let mut at = 10;
    if flags & FEXTRA != 0 {
        let len = u16::from_le_bytes([*data.get(at)?, *data.get(at + 1)?]) as usize;
        at += 2 + len;
    }
    for flag in [FNAME, FCOMMENT] {
        if flags & flag != 0 {
            at += data.get(at..)?.iter().position(|&b| b == 0)? + 1;
        }
    }
    if flags & FHCRC != 0 {
        at += 2;
    }
    let raw = miniz_oxide::inflate::decompress_to_vec(data.get(at..)?).ok()?;
    let mut s = String::new();
    raw.as_slice().read_to_string(&mut s).ok()?;
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_values_by_exact_key() {
        let c = "CONFIG_FUSE_FS=m\nCONFIG_FUSE_PASSTHROUGH=y\n# CONFIG_FUSE_IO_URING is not set\n";
        assert_eq!(config_value(c, "CONFIG_FUSE_PASSTHROUGH"), Some("y"));
        assert_eq!(config_value(c, "CONFIG_FUSE_FS"), Some("m"));
        assert_eq!(config_value(c, "CONFIG_FUSE_IO_URING"), None);
        assert_eq!(config_value(c, "CONFIG_FUSE"), None);
    }

    #[test]
    fn gunzip_reads_a_member_with_a_file_name() {
        // gzip header with FNAME "c", then raw deflate of the text, then CRC32 and size.
        let text = b"CONFIG_FUSE_PASSTHROUGH=y\n";
        let deflated = miniz_oxide::deflate::compress_to_vec(text, 6);
        let mut gz = vec![0x1f, 0x8b, 8, 8, 0, 0, 0, 0, 0, 3, b'c', 0];
        gz.extend_from_slice(&deflated);
        gz.extend_from_slice(&[0; 8]);
        assert_eq!(gunzip(&gz).as_deref(), Some("CONFIG_FUSE_PASSTHROUGH=y\n"));
        assert_eq!(gunzip(b"not gzip at all"), None);
    }

    #[test]
    fn report_names_every_feature() {
        let r = report();
        assert!(r.starts_with(&format!("fusex {}\n", env!("CARGO_PKG_VERSION"))));
        for what in [
            "FUSE protocol:",
            "io_uring transport:",
            "mounting:",
            "passthrough:",
        ] {
            assert!(r.contains(what), "{r}");
        }
    }
}
