//! The VMDK text descriptor: `key=value` lines (`createType`, `parentCID`, ...) and extent
//! lines (`RW 2097152 SPARSE "disk-s001.vmdk"`), either a file of its own or embedded in a
//! hosted sparse extent. Everything in it is untrusted: its size, the number of extents and
//! every number are bounded, and names are kept as written for the caller's path policy.

/// The largest descriptor read (VMware's own are a few hundred bytes).
pub const MAX_DESCRIPTOR: u64 = 1 << 20;

/// The most extents a descriptor may list (a 2 TiB disk in 2 GiB extents needs 1024).
pub const MAX_EXTENTS: usize = 4096;

/// The largest disk a descriptor may describe, in 512-byte sectors (QEMU's own limit for
/// VMDK is far below: what `off_t` addresses).
pub const MAX_SECTORS: u64 = (i64::MAX as u64) >> 9;

/// A text descriptor conventionally starts with this line (VMware's and QEMU's).
pub const MAGIC: &[u8] = b"# Disk DescriptorFile";

/// How much of a file's start [`recognised`] looks at: as much as `qemu-img` looks at when it
/// probes a file's format (measured with qemu-img 7.2: a `version=` line ending past byte 512
/// makes the file raw to it), so `--format auto` calls the same files VMDK as QEMU does.
pub const PROBE_BYTES: usize = 512;

/// Whether `head` (a file's first bytes) starts like a text descriptor: with [`MAGIC`], or
/// with comment lines (`#`) and blank lines and then a `version=1`, `2` or `3` line, complete
/// within the first [`PROBE_BYTES`] (a line may end in CR LF). QEMU accepts a descriptor
/// without the header comment, so such files are VMDK too; the rule is QEMU's except that
/// empty lines are skipped as well as lines of blanks (QEMU 7.2 stops at an empty line).
pub fn recognised(head: &[u8]) -> bool {
    let head = &head[..head.len().min(PROBE_BYTES)];
    if head.starts_with(MAGIC) {
        return true;
    }
    let mut rest = head;
    // Only complete lines count: a version line cut off by the window is not one.
    while let Some(nl) = rest.iter().position(|&b| b == b'\n') {
        let line = &rest[..nl];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        rest = &rest[nl + 1..];
        if line.starts_with(b"#") || line.iter().all(|&b| b == b' ' || b == b'\t') {
            continue;
        }
        return matches!(line, b"version=1" | b"version=2" | b"version=3");
    }
    false
}

/// How an extent may be accessed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Read and write.
    ReadWrite,
    /// Read only: writes into it fail.
    ReadOnly,
    /// Neither: its range reads as an error.
    NoAccess,
}

/// What kind of extent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExtentKind {
    /// A hosted sparse extent file (`KDMV` header, grain directory and tables).
    Sparse,
    /// A flat file (or part of one from an offset); `VMFS` is the same on a host file.
    Flat,
    /// Reads zeroes; nothing stored.
    Zero,
}

/// One extent line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Extent {
    /// RW, RDONLY or NOACCESS.
    pub access: Access,
    /// Its length in 512-byte sectors.
    pub sectors: u64,
    /// SPARSE, FLAT/VMFS or ZERO.
    pub kind: ExtentKind,
    /// The file it names, as written (None for ZERO).
    pub file: Option<String>,
    /// Where a flat extent starts in its file, in sectors.
    pub offset: u64,
}

/// A parsed descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Descriptor {
    /// `createType`, as written.
    pub create_type: String,
    /// The extents in guest order.
    pub extents: Vec<Extent>,
    /// `parentFileNameHint` or a `parentCID` other than `ffffffff`: a delta link.
    pub has_parent: bool,
}

impl Descriptor {
    /// The disk's size in sectors (the extents' sum, checked at parse).
    pub fn sectors(&self) -> u64 {
        self.extents.iter().map(|e| e.sectors).sum()
    }
}

/// The createTypes fusex serves.
pub const CREATE_TYPES: &[&str] = &[
    "monolithicSparse",
    "twoGbMaxExtentSparse",
    "monolithicFlat",
    "twoGbMaxExtentFlat",
    "vmfs",
    "streamOptimized",
];

/// Parses descriptor text; the error says what is wrong, in words for a one-line message.
pub fn parse(text: &[u8]) -> Result<Descriptor, String> {
    if text.len() as u64 > MAX_DESCRIPTOR {
        return Err(format!(
            "its descriptor is {} bytes, more than fusex reads ({} KiB)",
            text.len(),
            MAX_DESCRIPTOR >> 10
        ));
    }
    // An embedded descriptor is padded with NULs to its sectors.
    let end = text.iter().position(|&b| b == 0).unwrap_or(text.len());
    let text = std::str::from_utf8(&text[..end])
        .map_err(|_| "its descriptor is not text (not UTF-8)".to_string())?;
    let mut create_type = None;
    let mut has_parent = false;
    let mut extents = Vec::new();
    let mut total: u64 = 0;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let first = line.split_whitespace().next().unwrap_or("");
        if matches!(first, "RW" | "RDONLY" | "NOACCESS") {
            if extents.len() == MAX_EXTENTS {
                return Err(format!(
                    "its descriptor lists more than {MAX_EXTENTS} extents"
                ));
            }
            let e = extent(line).map_err(|why| format!("descriptor line {}: {why}", i + 1))?;
            total = total
                .checked_add(e.sectors)
                .filter(|&t| t <= MAX_SECTORS)
                .ok_or_else(|| "its extents add up to more than a disk can hold".to_string())?;
            extents.push(e);
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            continue; // VMware ignores lines it does not know, and so does fusex
        };
        let value = value.trim().trim_matches('"');
        match key.trim() {
            "createType" => create_type = Some(value.to_string()),
            "parentCID" => has_parent |= !value.eq_ignore_ascii_case("ffffffff"),
            "parentFileNameHint" => has_parent |= !value.is_empty(),
            _ => {}
        }
    }
    let create_type = create_type.ok_or_else(|| "its descriptor has no createType".to_string())?;
    if !CREATE_TYPES.contains(&create_type.as_str()) {
        return Err(format!(
            "its createType {:?} is not one fusex serves ({}): convert it with qemu-img convert",
            crate::qcow2::named::shown(&create_type),
            CREATE_TYPES.join(", ")
        ));
    }
    if extents.is_empty() {
        return Err("its descriptor lists no extents".into());
    }
    Ok(Descriptor {
        create_type,
        extents,
        has_parent,
    })
}

/// One extent line: `ACCESS SECTORS TYPE ["FILE" [OFFSET]]`.
fn extent(line: &str) -> Result<Extent, String> {
    let (head, quoted) = match line.find('"') {
        Some(q) => (&line[..q], Some(&line[q + 1..])),
        None => (line, None),
    };
    let mut words = head.split_whitespace();
    let access = match words.next() {
        Some("RW") => Access::ReadWrite,
        Some("RDONLY") => Access::ReadOnly,
        _ => Access::NoAccess,
    };
    let sectors: u64 = words
        .next()
        .and_then(|s| s.parse().ok())
        .ok_or("an extent without a size in sectors")?;
    let kind = match words.next() {
        Some("SPARSE") => ExtentKind::Sparse,
        Some("FLAT") | Some("VMFS") => ExtentKind::Flat,
        Some("ZERO") => ExtentKind::Zero,
        Some(other) => {
            return Err(format!(
                "extent type {} is not one fusex serves (SPARSE, FLAT, VMFS, ZERO)",
                crate::qcow2::named::shown(other)
            ))
        }
        None => return Err("an extent without a type".into()),
    };
    if words.next().is_some() {
        return Err("unexpected words before the file name".into());
    }
    let (file, offset) = match quoted {
        None if kind == ExtentKind::Zero => (None, 0),
        None => return Err("an extent without a file name".into()),
        Some(rest) => {
            let close = rest
                .find('"')
                .ok_or("a file name without its closing quote")?;
            let name = &rest[..close];
            if name.is_empty() {
                return Err("an empty file name".into());
            }
            let tail = rest[close + 1..].trim();
            let offset = if tail.is_empty() {
                0
            } else {
                tail.parse::<u64>()
                    .map_err(|_| "an extent offset that is not a number")?
            };
            if offset != 0 && kind != ExtentKind::Flat {
                return Err("an offset on an extent that is not flat".into());
            }
            if offset > MAX_SECTORS {
                return Err("an extent offset past what a file can hold".into());
            }
            (Some(name.to_string()), offset)
        }
    };
    if sectors == 0 {
        return Err("an extent of 0 sectors".into());
    }
    Ok(Extent {
        access,
        sectors,
        kind,
        file,
        offset,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_are_recognised_by_their_first_lines() {
        for yes in [
            &b"# Disk DescriptorFile\nversion=1\n"[..],
            b"# Disk DescriptorFile",
            b"version=1\nCID=fffffffe\n",
            b"version=3\r\ncreateType=\"vmfs\"\r\n",
            b"# made by hand\n#\n\n  \t\nversion=2\n",
            b"#\r\nversion=1\r\n",
        ] {
            assert!(recognised(yes), "{}", String::from_utf8_lossy(yes));
        }
        for no in [
            &b""[..],
            b"version=1",
            b"version=4\n",
            b"version = 1\n",
            b" version=1\n",
            b"version=1 \n",
            b"CID=fffffffe\nversion=1\n",
            b"\0\0\0\0version=1\n",
            b"# a comment without its end",
        ] {
            assert!(!recognised(no), "{}", String::from_utf8_lossy(no));
        }
        // Bounded: a version line past the first PROBE_BYTES is not looked at.
        let mut late = b"# comment\n".repeat(PROBE_BYTES / 10);
        late.extend_from_slice(b"version=1\n");
        assert!(!recognised(&late));
        let mut early = b"# comment\n".repeat(PROBE_BYTES / 10 - 1);
        early.extend_from_slice(b"version=1\n");
        assert!(early.len() <= PROBE_BYTES && recognised(&early));
    }

    const TWO_GB: &str = "# Disk DescriptorFile\nversion=1\nCID=12345678\nparentCID=ffffffff\n\
        createType=\"twoGbMaxExtentSparse\"\n\n# Extent description\n\
        RW 4192256 SPARSE \"d-s001.vmdk\"\nRDONLY 2048 SPARSE \"d s002.vmdk\"\n\
        RW 100 ZERO\nNOACCESS 8 FLAT \"f.img\" 16\n\n#DDB\nddb.virtualHWVersion = \"4\"\n";

    #[test]
    fn extents_and_keys() {
        let d = parse(TWO_GB.as_bytes()).unwrap();
        assert_eq!(d.create_type, "twoGbMaxExtentSparse");
        assert!(!d.has_parent);
        assert_eq!(d.sectors(), 4192256 + 2048 + 100 + 8);
        assert_eq!(d.extents[1].file.as_deref(), Some("d s002.vmdk"));
        assert_eq!(d.extents[1].access, Access::ReadOnly);
        assert_eq!(d.extents[2].kind, ExtentKind::Zero);
        assert_eq!(d.extents[3].offset, 16);
        assert_eq!(d.extents[3].access, Access::NoAccess);
    }

    #[test]
    fn hostile_descriptors_are_refused() {
        let with = |l: &str| format!("createType=\"monolithicFlat\"\n{l}\n");
        for (line, want) in [
            ("RW 99999999999999999999 FLAT \"a\"", "without a size"),
            ("RW 9223372036854775807 FLAT \"a\"", "more than a disk"),
            ("RW 8 SPARSE \"a\" 5", "not flat"),
            ("RW 8 FLAT \"a", "closing quote"),
            ("RW 8 VMFSSPARSE \"a\"", "not one fusex serves"),
            ("RW 8 FLAT", "without a file name"),
            ("RW 0 FLAT \"a\"", "0 sectors"),
            ("RW 8 FLAT \"\"", "empty file name"),
        ] {
            let e = parse(with(line).as_bytes()).unwrap_err();
            assert!(e.contains(want), "{line}: {e}");
        }
        let e = parse(b"createType=\"custom\"\nRW 8 ZERO\n").unwrap_err();
        assert!(e.contains("not one fusex serves"), "{e}");
        let e = parse(b"RW 8 ZERO\n").unwrap_err();
        assert!(e.contains("no createType"), "{e}");
        let e = parse(b"createType=\"vmfs\"\n").unwrap_err();
        assert!(e.contains("no extents"), "{e}");
        let many = format!(
            "createType=\"vmfs\"\n{}",
            "RW 1 ZERO\n".repeat(MAX_EXTENTS + 1)
        );
        assert!(parse(many.as_bytes()).unwrap_err().contains("more than"));
        assert!(parse(&vec![b'#'; MAX_DESCRIPTOR as usize + 1])
            .unwrap_err()
            .contains("more than fusex reads"));
        let d = parse(b"createType=\"vmfs\"\nparentCID=1234\nRW 1 ZERO\n").unwrap();
        assert!(d.has_parent);
        assert!(parse(b"createType=\"vmfs\"\nRW 1 ZERO\n\0\0garbage\xff").is_ok());
    }
}

#[cfg(test)]
mod props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any bytes: no panic, and what parses stays within the bounds.
        #[test]
        fn any_text_parses_or_is_refused(text in proptest::collection::vec(any::<u8>(), 0..2048)) {
            if let Ok(d) = parse(&text) {
                prop_assert!(d.sectors() <= MAX_SECTORS);
                prop_assert!(d.extents.len() <= MAX_EXTENTS);
            }
        }

        /// Extent lines built from random words.
        #[test]
        fn random_extent_lines(words in proptest::collection::vec(
            prop_oneof![
                Just("RW".to_string()), Just("SPARSE".to_string()), Just("FLAT".to_string()),
                Just("ZERO".to_string()), Just("\"f\"".to_string()), Just("\"".to_string()),
                any::<u64>().prop_map(|n| n.to_string()),
            ], 0..6)) {
            let text = format!("createType=\"vmfs\"\n{}\n", words.join(" "));
            let _ = parse(text.as_bytes());
        }
    }
}
