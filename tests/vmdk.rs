//! VMDK images with `qemu-img` as the oracle: every subformat qemu-img makes (and a `vmfs`
//! descriptor written by hand) is read back through fusex and compared with the raw image it
//! was converted from; writes through fusex are checked with `qemu-img check` and `qemu-img
//! compare` against a model; streamOptimized (also with its grain directory in a footer) is
//! read-only; hostile images (grain directory and table entries past the end or into
//! metadata, absurd capacities, grain sizes that are not a power of two, descriptors naming
//! files outside their directory, extents needing too many grains in all) are refused in one
//! line or fail only their bad range, as do damaged compressed grains; a descriptor without
//! its header line is probed as qemu-img probes it; a writable export locks every extent file;
//! a partition of a VMDK takes a filesystem; and `fusex serve` serves a `vmdk` node.

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use fusex_e2e::*;
use serde_json::json;

const SIZE: u64 = 64 * MIB;

/// A raw image of [`SIZE`] bytes: random runs between holes, so sparse formats have both.
fn source(w: &WorkDir, seed: u64) -> (PathBuf, Vec<u8>) {
    let path = w.join(format!("src{seed}.raw"));
    let mut data = vec![0u8; SIZE as usize];
    let mut rng = Rng::new(seed);
    for _ in 0..200 {
        let off = rng.below(SIZE - 300_000) as usize;
        let len = 1 + rng.below(200_000) as usize;
        rng.fill(&mut data[off..off + len]);
    }
    fs::write(&path, &data).unwrap();
    (path, data)
}

fn qemu_img(args: &[&str], paths: &[&Path]) {
    run_ok(Command::new("qemu-img").args(args).args(paths));
}

/// `qemu-img convert -O vmdk -o subformat=SUB src DIR/NAME.vmdk`.
fn convert(w: &WorkDir, src: &Path, sub: &str, name: &str) -> PathBuf {
    let out = w.join(format!("{name}.vmdk"));
    qemu_img(
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "vmdk",
            "-o",
            &format!("subformat={sub}"),
        ],
        &[src, &out],
    );
    out
}

/// `qemu-img create -f vmdk -o subformat=SUB IMG SIZE`: an empty image.
fn create(img: &Path, sub: &str, size: u64) {
    run_ok(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "vmdk", "-o"])
            .arg(format!("subformat={sub}"))
            .arg(img)
            .arg(size.to_string()),
    );
}

/// The guest bytes as qemu-img reads them.
fn qemu_raw(w: &WorkDir, img: &Path) -> Vec<u8> {
    let out = w.join(format!(
        "{}.qemu.raw",
        img.file_name().unwrap().to_string_lossy()
    ));
    qemu_img(&["convert", "-f", "vmdk", "-O", "raw"], &[img, &out]);
    read_all(&out)
}

fn check(img: &Path) {
    let out = run(Command::new("qemu-img")
        .args(["check", "-f", "vmdk"])
        .arg(img));
    assert!(
        out.status.success(),
        "qemu-img check {}: {}{}",
        img.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn compare(img: &Path, model: &Path) {
    let out = run(Command::new("qemu-img")
        .args(["compare", "-f", "vmdk", "-F", "raw"])
        .arg(img)
        .arg(model));
    assert!(
        out.status.success(),
        "qemu-img compare {} {}: {}",
        img.display(),
        model.display(),
        String::from_utf8_lossy(&out.stdout)
    );
}

const SUBFORMATS: &[&str] = &[
    "monolithicSparse",
    "twoGbMaxExtentSparse",
    "monolithicFlat",
    "twoGbMaxExtentFlat",
    "streamOptimized",
];

#[test]
fn every_subformat_reads_as_its_source() {
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    let w = WorkDir::new("vmdk-read");
    let (src, data) = source(&w, 1);
    for sub in SUBFORMATS {
        let img = convert(&w, &src, sub, sub);
        assert_eq!(qemu_raw(&w, &img), data, "{sub}: qemu-img's own view");
        let mp = w.join(format!("{sub}.export"));
        let m = Mount::start(&w, &img, &mp, &[]);
        assert_bytes_eq(&read_all(&mp), &data, 0, sub);
        let s = m.stop();
        s.assert_clean(sub);
        assert!(
            s.stderr.contains("format vmdk (auto"),
            "{sub}: probed as vmdk: {}",
            s.stderr
        );
    }
}

/// Random writes through fusex (crossing grains and, on the split subformats, extents),
/// then `qemu-img check` and `qemu-img compare` against a model of what was written.
#[test]
fn writes_land_where_qemu_reads_them() {
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    let w = WorkDir::new("vmdk-write");
    // 4.5 GiB: the split subformats get three extents of 2 GiB, 2 GiB and 0.5 GiB.
    let size = 4608 * MIB;
    for sub in [
        "monolithicSparse",
        "twoGbMaxExtentSparse",
        "monolithicFlat",
        "twoGbMaxExtentFlat",
    ] {
        let img = w.join(format!("{sub}.vmdk"));
        create(&img, sub, size);
        let model = w.join(format!("{sub}.model"));
        sparse_image(&model, size);
        let mp = w.join(format!("{sub}.export"));
        let m = Mount::start(&w, &img, &mp, &["--writable"]);
        let f = open_rw(&mp);
        let mf = open_rw(&model);
        let mut rng = Rng::new(7);
        let mut offsets: Vec<u64> = (0..150).map(|_| rng.below(size - (1 << 20))).collect();
        // Across the extent boundaries, the first grain and the last bytes.
        offsets.extend([2 * GIB - 1000, 4 * GIB - 4096, 0, size - 70_000]);
        for off in offsets {
            let len = 1 + rng.below(300_000) as usize;
            let len = len.min((size - off) as usize);
            let buf = rng.bytes(len);
            f.write_all_at(&buf, off).unwrap();
            mf.write_all_at(&buf, off).unwrap();
            if rng.below(4) == 0 {
                let mut back = vec![0u8; len];
                f.read_exact_at(&mut back, off).unwrap();
                assert!(back == buf, "{sub}: read back at {off}");
            }
        }
        // Zeroing a range through FALLOCATE.
        fallocate(&f, libc::FALLOC_FL_ZERO_RANGE, 3 * GIB, 3 * MIB).unwrap();
        mf.write_all_at(&vec![0u8; 3 * MIB as usize], 3 * GIB)
            .unwrap();
        f.sync_all().unwrap();
        drop(f);
        m.stop().assert_clean(sub);
        check(&img);
        compare(&img, &model);
    }
}

#[test]
fn vmfs_and_hand_written_descriptors() {
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    let w = WorkDir::new("vmdk-vmfs");
    // createType vmfs: a VMFS extent, written through fusex; qemu-img is the oracle
    // (qemu-img 7.2 reads a vmfs descriptor with two extents, or whose last line is its
    // extent, with the first extent twice, so this one has one extent and its DDB section).
    let mut want = random_image(&w.join("a-flat.vmdk"), 8 * MIB, 3);
    let desc = w.join("vmfs.vmdk");
    fs::write(
        &desc,
        "# Disk DescriptorFile\nversion=1\nCID=fffffffe\nparentCID=ffffffff\n\
         createType=\"vmfs\"\n\n# Extent description\nRW 16384 VMFS \"a-flat.vmdk\"\n\n\
         # The Disk Data Base\n#DDB\n\nddb.virtualHWVersion = \"4\"\n",
    )
    .unwrap();
    let mp = w.join("vmfs.export");
    let m = Mount::start(&w, &desc, &mp, &["--writable"]);
    assert_bytes_eq(&read_all(&mp), &want, 0, "vmfs");
    let buf = Rng::new(5).bytes(100_000);
    open_rw(&mp).write_all_at(&buf, 4 * MIB - 50_000).unwrap();
    want[4 * MIB as usize - 50_000..4 * MIB as usize + 50_000].copy_from_slice(&buf);
    m.stop().assert_clean("vmfs");
    assert_eq!(qemu_raw(&w, &desc), want, "qemu-img reads what fusex wrote");

    // ZERO, RDONLY and NOACCESS extents, and two FLAT extents in one file at different
    // offsets (qemu-img 7.2 skips lines other than RW and misreads ZERO, so the model is the
    // oracle here).
    let flat = random_image(&w.join("c-flat.img"), 2 * MIB, 6);
    let ro = random_image(&w.join("ro.img"), MIB, 7);
    let desc = w.join("mixed.vmdk");
    fs::write(
        &desc,
        "# Disk DescriptorFile\nversion=1\nCID=fffffffe\nparentCID=ffffffff\n\
         createType=\"monolithicFlat\"\n\nRW 2048 FLAT \"c-flat.img\" 2048\nRW 2048 ZERO\n\
         RDONLY 2048 FLAT \"ro.img\" 0\nRW 2048 FLAT \"c-flat.img\" 0\nNOACCESS 2048 ZERO\n",
    )
    .unwrap();
    let m_ = MIB as usize;
    let mut want = [&flat[m_..], &vec![0u8; m_][..], &ro[..], &flat[..m_]].concat();
    let mp = w.join("mixed.export");
    let m = Mount::start(&w, &desc, &mp, &["--writable"]);
    let f = open_rw(&mp);
    let mut got = vec![0u8; 4 * m_];
    f.read_exact_at(&mut got, 0).unwrap();
    assert_bytes_eq(&got, &want, 0, "mixed");
    let e = f.read_exact_at(&mut [0u8; 512], 4 * MIB + 512).unwrap_err();
    assert_eq!(errno(&e), libc::EIO, "NOACCESS read: {e}");
    f.write_all_at(b"hello", 100).unwrap();
    f.write_all_at(b"world", 3 * MIB + 7).unwrap();
    // The ZERO extent and the read-only one refuse writes; nothing lands anywhere.
    let e = f.write_at(b"x", MIB + 10).unwrap_err();
    assert_eq!(errno(&e), libc::EIO, "{e}");
    let e = f.write_at(b"x", 2 * MIB + 10).unwrap_err();
    assert_eq!(errno(&e), libc::EROFS, "{e}");
    drop(f);
    m.stop();
    want[100..105].copy_from_slice(b"hello");
    want[3 * m_ + 7..3 * m_ + 12].copy_from_slice(b"world");
    let mut c = flat.clone();
    c[m_ + 100..m_ + 105].copy_from_slice(b"hello");
    c[7..12].copy_from_slice(b"world");
    assert_eq!(
        read_all(&w.join("c-flat.img")),
        c,
        "both FLAT extents landed in c-flat.img"
    );
    assert_eq!(
        read_all(&w.join("ro.img")),
        ro,
        "the RDONLY file is untouched"
    );
    // Overlapping FLAT extents in one file are refused.
    fs::write(
        &desc,
        "# Disk DescriptorFile\ncreateType=\"monolithicFlat\"\n\
         RW 2048 FLAT \"c-flat.img\" 0\nRW 2048 FLAT \"c-flat.img\" 1024\n",
    )
    .unwrap();
    let f = Mount::try_start(&w, &desc, &w.join("x.export"), &[])
        .err()
        .expect("refused");
    assert!(f.stderr.contains("overlaps another extent"), "{}", f.stderr);
}

/// A descriptor without the `# Disk DescriptorFile` line (comment lines, then `version=`)
/// is a VMDK to `--format auto`, as to qemu-img, and reads as qemu-img reads it; one whose
/// `version=` line ends past the first 512 bytes is raw to both.
#[test]
fn descriptors_without_the_header_line() {
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    let w = WorkDir::new("vmdk-noheader");
    random_image(&w.join("b-flat.img"), 2 * MIB, 15);
    let body = "CID=fffffffe\r\nparentCID=ffffffff\r\ncreateType=\"monolithicFlat\"\r\n\
                RW 4096 FLAT \"b-flat.img\" 0\r\n";
    let desc = w.join("noheader.vmdk");
    fs::write(
        &desc,
        format!("# written by a script\r\n#\r\nversion=1\r\n{body}"),
    )
    .unwrap();
    let probed = |img: &Path| {
        let out = run_ok(
            Command::new("qemu-img")
                .args(["info", "--output=json"])
                .arg(img),
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["format"].as_str().unwrap().to_string()
    };
    assert_eq!(probed(&desc), "vmdk", "qemu-img probes it as vmdk");
    let want = qemu_raw(&w, &desc);
    assert_eq!(want.len() as u64, 2 * MIB);
    let mp = w.join("noheader.export");
    let m = Mount::start(&w, &desc, &mp, &[]);
    assert_bytes_eq(&read_all(&mp), &want, 0, "no header line");
    let s = m.stop();
    s.assert_clean("no header line");
    assert!(s.stderr.contains("format vmdk (auto"), "{}", s.stderr);
    // Explicitly as vmdk too.
    let m = Mount::start(&w, &desc, &mp, &["--format", "vmdk"]);
    assert_bytes_eq(&read_all(&mp), &want, 0, "--format vmdk");
    m.stop().assert_clean("--format vmdk");
    // The version line past the bytes either looks at: raw to both.
    let late = w.join("late.vmdk");
    fs::write(
        &late,
        format!("{}version=1\r\n{body}", "# padding\r\n".repeat(51)),
    )
    .unwrap();
    assert_eq!(probed(&late), "raw", "qemu-img probes it as raw");
    let mp = w.join("late.export");
    let m = Mount::start(&w, &late, &mp, &[]);
    assert_eq!(read_all(&mp), read_all(&late));
    let s = m.stop();
    s.assert_clean("late version line");
    assert!(s.stderr.contains("format raw (auto"), "{}", s.stderr);
}

/// streamOptimized is read-only; one whose grain directory is in a footer (as a stream
/// writer leaves it) reads the same as qemu-img reads it.
#[test]
fn stream_optimized_with_a_footer() {
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    let w = WorkDir::new("vmdk-stream");
    let (src, data) = source(&w, 5);
    let img = convert(&w, &src, "streamOptimized", "stream");
    let f = fusex_e2e::Mount::try_start(&w, &img, &w.join("rw.export"), &["--writable"])
        .err()
        .expect("refused writable");
    assert!(f.stderr.contains("read-only"), "{}", f.stderr);
    assert_eq!(f.stderr.trim().lines().count(), 1, "{}", f.stderr);
    // Move the grain directory's offset into a footer: header copy behind a footer marker,
    // then the end-of-stream marker.
    let mut bytes = read_all(&img);
    assert_eq!(bytes.len() % 512, 0);
    let header: Vec<u8> = bytes[..512].to_vec();
    bytes[56..64].copy_from_slice(&u64::MAX.to_le_bytes());
    let mut marker = vec![0u8; 512];
    marker[12..16].copy_from_slice(&3u32.to_le_bytes());
    bytes.extend(&marker);
    bytes.extend(&header);
    bytes.extend(vec![0u8; 512]);
    let footed = w.join("footed.vmdk");
    fs::write(&footed, &bytes).unwrap();
    assert_eq!(qemu_raw(&w, &footed), data, "qemu-img reads the footer");
    let mp = w.join("footed.export");
    let m = Mount::start(&w, &footed, &mp, &[]);
    assert_bytes_eq(&read_all(&mp), &data, 0, "footer");
    m.stop().assert_clean("footer");
}

/// The file offset of every grain of a streamOptimized image qemu-img made (its grain
/// marker's), by guest grain (None: not allocated), read through its grain directory.
fn stream_grains(img: &Path) -> Vec<Option<u64>> {
    let b = read_all(img);
    let le64 = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
    let le32 = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as u64;
    let (capacity, grain, gtes, gd) = (le64(12), le64(20), le32(44), le64(56));
    assert_eq!((grain, gtes), (128, 512), "qemu-img's grains and tables");
    assert_ne!(
        gd,
        u64::MAX,
        "qemu-img writes the directory's offset in the header"
    );
    (0..capacity.div_ceil(grain))
        .map(|g| {
            let gt = le32((gd * 512 + 4 * (g / gtes)) as usize) * 512;
            let at = le32((gt + 4 * (g % gtes)) as usize) * 512;
            (gt != 0 && at != 0).then_some(at)
        })
        .collect()
}

/// Damaged compressed grains of a streamOptimized image (a marker naming another grain, a
/// size of 0 or past a grain, data that does not inflate, data inflating past a grain): that
/// grain reads as EIO, every other grain as qemu-img reads the intact image (and a grain
/// repacked whole, the control, reads as its new bytes).
#[test]
fn damaged_stream_grains_fail_only_themselves() {
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    let w = WorkDir::new("vmdk-stream-grains");
    let grain = 64 * KIB as usize;
    let src = w.join("src.raw");
    let mut data = Rng::new(31).bytes(4 * MIB as usize);
    // A hole, so not every grain is allocated.
    data[grain * 10..grain * 12].fill(0);
    fs::write(&src, &data).unwrap();
    let base = convert(&w, &src, "streamOptimized", "base");
    let want = qemu_raw(&w, &base);
    assert!(want == data);
    let grains = stream_grains(&base);
    assert_eq!(grains.len(), 64);
    assert_eq!(grains.iter().filter(|g| g.is_none()).count(), 2);
    let marker = |g: usize| grains[g].unwrap();
    let too_big = miniz_oxide::deflate::compress_to_vec_zlib(&vec![0x5a; 2 * grain], 6);
    let one = miniz_oxide::deflate::compress_to_vec_zlib(&vec![0x5a; grain], 6);
    let cases: Vec<(&str, usize, u64, Vec<u8>)> = vec![
        // The control: a grain repacked whole reads as its new bytes.
        (
            "repacked",
            usize::MAX,
            marker(62) + 8,
            [&(one.len() as u32).to_le_bytes()[..], &one].concat(),
        ),
        // The marker names the next grain's sector.
        ("lba", 3, marker(3), (4u64 * 128).to_le_bytes().to_vec()),
        ("size-0", 5, marker(5) + 8, 0u32.to_le_bytes().to_vec()),
        (
            "size-huge",
            20,
            marker(20) + 8,
            (16u32 << 20).to_le_bytes().to_vec(),
        ),
        // A zlib header that is not one.
        ("not-zlib", 40, marker(40) + 12, vec![0xff, 0xff]),
        (
            "inflates-past",
            63,
            marker(63) + 8,
            [&(too_big.len() as u32).to_le_bytes()[..], &too_big].concat(),
        ),
    ];
    for (name, bad, off, bytes) in cases {
        let img = w.join(format!("{name}.vmdk"));
        fs::copy(&base, &img).unwrap();
        poke(&img, off, &bytes);
        let mp = w.join(format!("{name}.export"));
        let m = Mount::start(&w, &img, &mp, &[]);
        let f = open_ro(&mp);
        for g in 0..grains.len() {
            let mut buf = vec![0u8; grain];
            let r = f.read_exact_at(&mut buf, (g * grain) as u64);
            if g == bad {
                let e = r.expect_err(name);
                assert_eq!(errno(&e), libc::EIO, "{name}: {e}");
            } else if name == "repacked" && g == 62 {
                r.unwrap_or_else(|e| panic!("{name}: grain {g}: {e}"));
                assert!(buf.iter().all(|&b| b == 0x5a), "{name}: grain {g}");
            } else {
                r.unwrap_or_else(|e| panic!("{name}: grain {g}: {e}"));
                assert_bytes_eq(&buf, &want[g * grain..][..grain], (g * grain) as u64, name);
            }
        }
        drop(f);
        m.stop();
    }
}

/// Offsets in a monolithicSparse image made by qemu-img from a source with data in its
/// first grain: (grain directory's file offset, first grain table's file offset).
fn tables(img: &Path) -> (u64, u64) {
    let f = open_ro(img);
    let mut h = [0u8; 512];
    f.read_exact_at(&mut h, 0).unwrap();
    let gd = u64::from_le_bytes(h[56..64].try_into().unwrap()) * 512;
    let mut e = [0u8; 4];
    f.read_exact_at(&mut e, gd).unwrap();
    (gd, u32::from_le_bytes(e) as u64 * 512)
}

fn poke(img: &Path, off: u64, bytes: &[u8]) {
    open_rw(img).write_all_at(bytes, off).unwrap();
}

/// Damaged grain tables and directories: read-only, only the damaged range fails with EIO
/// (the rest reads as qemu-img reads it); writable, the open is refused in one line; the
/// image is never written.
#[test]
fn damaged_tables_fail_only_their_range() {
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    let w = WorkDir::new("vmdk-damaged");
    let (src, data) = source(&w, 9);
    let base = convert(&w, &src, "monolithicSparse", "base");
    let (gd, gt) = tables(&base);
    let header_sectors = 1u32;
    for (name, off, value, bad_range) in [
        // Grain 0's entry far past the end of the file.
        ("grain-past-end", gt, 0xffff_fff0u32, (0, 64 * KIB)),
        // Grain 0's entry pointing at the embedded descriptor (sector 1).
        ("grain-into-descriptor", gt, header_sectors, (0, 64 * KIB)),
        // Grain 1's entry pointing at the grain directory.
        (
            "grain-into-directory",
            gt + 4,
            (gd / 512) as u32,
            (64 * KIB, 128 * KIB),
        ),
        // The first grain table past the end: its 32 MiB fail.
        ("table-past-end", gd, 0xffff_ff00u32, (0, 32 * MIB)),
    ] {
        let img = w.join(format!("{name}.vmdk"));
        fs::copy(&base, &img).unwrap();
        poke(&img, off, &value.to_le_bytes());
        let before = read_all(&img);
        let f = Mount::try_start(&w, &img, &w.join(format!("{name}.rw")), &["--writable"])
            .err()
            .unwrap_or_else(|| panic!("{name}: a writable open must be refused"));
        assert!(f.stderr.contains("read-only only"), "{name}: {}", f.stderr);
        assert_eq!(f.stderr.trim().lines().count(), 1, "{name}: {}", f.stderr);
        let mp = w.join(format!("{name}.export"));
        let m = Mount::start(&w, &img, &mp, &[]);
        let file = open_ro(&mp);
        let mut buf = vec![0u8; 4096];
        let e = file.read_exact_at(&mut buf, bad_range.0).unwrap_err();
        assert_eq!(errno(&e), libc::EIO, "{name}: {e}");
        // Outside the bad range, the image's bytes.
        let (lo, hi) = (bad_range.1, SIZE.min(bad_range.1 + 8 * MIB));
        let mut good = vec![0u8; (hi - lo) as usize];
        file.read_exact_at(&mut good, lo).unwrap();
        assert_bytes_eq(&good, &data[lo as usize..hi as usize], lo, name);
        drop(file);
        m.stop();
        assert!(read_all(&img) == before, "{name}: the image was written");
    }
}

#[test]
fn hostile_headers_and_descriptors_are_refused_in_one_line() {
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    let w = WorkDir::new("vmdk-hostile");
    let (src, _) = source(&w, 11);
    let base = convert(&w, &src, "monolithicSparse", "base");
    let refused = |img: &Path, args: &[&str], want: &str| {
        let f = Mount::try_start(&w, img, &w.join("x.export"), args)
            .err()
            .unwrap_or_else(|| panic!("{}: must be refused", img.display()));
        assert_eq!(f.code, Some(1));
        assert_eq!(f.stderr.trim().lines().count(), 1, "{}", f.stderr);
        assert!(f.stderr.contains(want), "{want}: {}", f.stderr);
    };
    for (name, off, bytes, want) in [
        (
            "capacity",
            12,
            (1u64 << 62).to_le_bytes().to_vec(),
            "capacity",
        ),
        (
            "capacity-table",
            12,
            (1u64 << 45).to_le_bytes().to_vec(),
            "block table",
        ),
        ("grain-96", 20, 96u64.to_le_bytes().to_vec(), "power of two"),
        ("gtes", 44, 0u32.to_le_bytes().to_vec(), "grain table"),
        (
            "gd-past-end",
            56,
            (1u64 << 40).to_le_bytes().to_vec(),
            "past the file's end",
        ),
        (
            "descriptor",
            36,
            (1u64 << 40).to_le_bytes().to_vec(),
            "descriptor",
        ),
    ] {
        let img = w.join(format!("{name}.vmdk"));
        fs::copy(&base, &img).unwrap();
        poke(&img, off, &bytes);
        refused(&img, &[], want);
    }
    // Many small extent files: 40 whose headers and extent lines claim 1 Mi grains (64 GiB)
    // each are refused in one line naming the limit on all of them together (32 Mi), at once
    // and without making a table; 200 whose headers claim 8 Mi grains each but whose extent
    // lines give them one grain are served with one table entry each.
    let split = |name: &str, n: usize, sectors: u64, capacity: u64| {
        let dir = w.join(name);
        fs::create_dir(&dir).unwrap();
        let mut text = "# Disk DescriptorFile\nversion=1\nCID=fffffffe\nparentCID=ffffffff\n\
                        createType=\"twoGbMaxExtentSparse\"\n"
            .to_string();
        for i in 0..n {
            fs::write(
                dir.join(format!("s{i}.vmdk")),
                extent_header(capacity, sectors),
            )
            .unwrap();
            text += &format!("RW {sectors} SPARSE \"s{i}.vmdk\"\n");
        }
        let desc = dir.join("d.vmdk");
        fs::write(&desc, text).unwrap();
        desc
    };
    let t = std::time::Instant::now();
    refused(
        &split("many", 40, 1 << 27, 1 << 27),
        &[],
        "more than 33554432 grain table entries in all",
    );
    assert!(t.elapsed() < std::time::Duration::from_secs(10));
    let claims = split("claims", 200, 128, 1 << 30);
    let mp = w.join("claims.export");
    let m = Mount::start(&w, &claims, &mp, &[]);
    assert!(read_all(&mp) == vec![0u8; 200 * 65536]);
    let status = fs::read_to_string(format!("/proc/{}/status", m.pid())).unwrap();
    let hwm: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
        .unwrap();
    // 200 tables of 8 Mi entries would be 12.5 GiB.
    assert!(hwm < 512 * 1024, "fusex peaked at {hwm} kB");
    m.stop().assert_clean("huge claims");
    // Descriptors naming files outside their directory, a parent, and themselves.
    let outside = w.join("outside");
    fs::create_dir(&outside).unwrap();
    let flat = outside.join("d-flat.vmdk");
    random_image(&flat, MIB, 12);
    let inner = w.join("inner");
    fs::create_dir(&inner).unwrap();
    std::os::unix::fs::symlink(&flat, inner.join("link.vmdk")).unwrap();
    let desc = |name: &str, extra: &str, extent: &str| {
        let p = inner.join(name);
        fs::write(
            &p,
            format!(
                "# Disk DescriptorFile\nversion=1\nCID=fffffffe\n{extra}\
                 createType=\"monolithicFlat\"\nRW 2048 FLAT \"{extent}\" 0\n"
            ),
        )
        .unwrap();
        p
    };
    refused(&desc("abs.vmdk", "", "/etc/passwd"), &[], "absolute path");
    let up = desc("up.vmdk", "", "../outside/d-flat.vmdk");
    refused(&up, &[], "outside its own directory");
    refused(
        &desc("link.vmdk.desc", "", "link.vmdk"),
        &[],
        "outside the descriptor's directory",
    );
    refused(
        &desc("self.vmdk", "", "self.vmdk"),
        &[],
        "descriptor file itself",
    );
    refused(
        &desc("nb.vmdk", "", "missing.img"),
        &["--no-backing"],
        "--no-backing",
    );
    refused(
        &desc("parent.vmdk", "parentCID=12345678\n", "x"),
        &[],
        "delta image",
    );
    // --trust-backing opens what the operator vouches for.
    let mp = w.join("up.export");
    let m = Mount::start(&w, &up, &mp, &["--trust-backing"]);
    assert_eq!(read_all(&mp), read_all(&flat));
    m.stop().assert_clean("trusted");
}

/// A sparse extent's header and grain directory (all 0: nothing allocated): `capacity`
/// sectors in 64 KiB grains, 512 entries a grain table, the directory at sector 1 as long as
/// `served` sectors need.
fn extent_header(capacity: u64, served: u64) -> Vec<u8> {
    let gdes = served.div_ceil(128 * 512);
    let gd_sectors = (gdes * 4).div_ceil(512);
    let mut b = vec![0u8; 512 * (1 + gd_sectors as usize)];
    b[0..4].copy_from_slice(b"KDMV");
    b[4..8].copy_from_slice(&1u32.to_le_bytes());
    b[8..12].copy_from_slice(&1u32.to_le_bytes());
    b[12..20].copy_from_slice(&capacity.to_le_bytes());
    b[20..28].copy_from_slice(&128u64.to_le_bytes());
    b[44..48].copy_from_slice(&512u32.to_le_bytes());
    b[56..64].copy_from_slice(&1u64.to_le_bytes());
    b[64..72].copy_from_slice(&(1 + gd_sectors).to_le_bytes());
    b
}

/// `--partition` on a VMDK: a filesystem on partition 1 of a monolithicSparse disk, made and
/// checked through fusex, is in the image where qemu-img reads it.
#[test]
fn a_partition_of_a_vmdk_takes_a_filesystem() {
    if !require_fuse_and_tools(&["qemu-img", "sfdisk", "mkfs.ext4", "fsck.ext4"]) {
        return;
    }
    let w = WorkDir::new("vmdk-part");
    let raw = w.join("disk.raw");
    sparse_image(&raw, SIZE);
    let mut c = Command::new("sfdisk");
    c.arg("-q").arg(&raw).stdin(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"label: gpt\nsize=20M\nsize=20M\n")
        .unwrap();
    assert!(child.wait().unwrap().success());
    let img = convert(&w, &raw, "monolithicSparse", "disk");
    let mp = w.join("p2.export");
    let m = Mount::start(&w, &img, &mp, &["--writable", "--partition=2"]);
    assert_eq!(fs::metadata(&mp).unwrap().len(), 20 * MIB);
    run_ok(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&mp));
    run_ok(Command::new("fsck.ext4").arg("-fn").arg(&mp));
    m.stop().assert_clean("vmdk partition");
    check(&img);
    let guest = qemu_raw(&w, &img);
    let before = read_all(&raw);
    // Partition 2 starts at 21 MiB (sfdisk aligns the first at 1 MiB).
    let (s, e) = (21 * MIB as usize, 41 * MIB as usize);
    assert_bytes_eq(&guest[..s], &before[..s], 0, "before partition 2");
    assert_bytes_eq(&guest[e..], &before[e..], e as u64, "after partition 2");
    let part = w.join("p2.raw");
    fs::write(&part, &guest[s..e]).unwrap();
    run_ok(Command::new("fsck.ext4").arg("-fn").arg(&part));
}

/// `fusex serve`: a `vmdk` node over a descriptor file, exported writable; what was written
/// is in the image as qemu-img reads it.
#[test]
fn serve_exports_a_vmdk_node() {
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    let w = WorkDir::new("vmdk-serve");
    let (src, mut data) = source(&w, 13);
    let img = convert(&w, &src, "twoGbMaxExtentSparse", "split");
    let serve = Serve::start(w.path(), &[]);
    let mut q = serve.qmp();
    q.ok(
        "blockdev-add",
        json!({"driver": "vmdk", "node-name": "v",
               "file": {"driver": "file", "filename": img}}),
    );
    let mp = w.join("v.export");
    fs::write(&mp, b"").unwrap();
    q.ok(
        "block-export-add",
        json!({"type": "fuse", "id": "v", "node-name": "v", "mountpoint": mp,
               "writable": true}),
    );
    assert_bytes_eq(&read_all(&mp), &data, 0, "served vmdk");
    let f = open_rw(&mp);
    let buf = Rng::new(14).bytes(300_000);
    f.write_all_at(&buf, 10 * MIB + 1).unwrap();
    f.sync_all().unwrap();
    drop(f);
    data[10 * MIB as usize + 1..10 * MIB as usize + 1 + buf.len()].copy_from_slice(&buf);
    q.ok("block-export-del", json!({"id": "v"}));
    q.event("BLOCK_EXPORT_DELETED", "v", TIMEOUT);
    drop(q);
    drop(serve);
    check(&img);
    assert_eq!(qemu_raw(&w, &img), data);
}

/// A writable export of a twoGbMaxExtentSparse image locks the descriptor and every extent
/// file as QEMU does: `qemu-img info` and `qemu-img check` are refused for a lock while it
/// runs, and open the image once it is gone.
#[test]
fn writable_exports_lock_every_extent_file() {
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    let w = WorkDir::new("vmdk-lock");
    let img = w.join("split.vmdk");
    // Three extent files of 2 GiB, 2 GiB and 0.5 GiB.
    create(&img, "twoGbMaxExtentSparse", 4608 * MIB);
    let files: Vec<PathBuf> = std::iter::once(img.clone())
        .chain((1..=3).map(|i| w.join(format!("split-s{i:03}.vmdk"))))
        .collect();
    // QEMU's lock bytes are 100.. and 200..: anything from 100 on.
    let locked = |p: &Path| lock_held(p, 100, 0);
    assert!(files.iter().all(|p| p.exists() && !locked(p)));
    let mp = w.join("split.export");
    let m = Mount::start(&w, &img, &mp, &["--writable"]);
    for p in &files {
        assert!(locked(p), "{} is not locked", p.display());
    }
    for args in [&["info", "-f", "vmdk"][..], &["check", "-f", "vmdk"]] {
        let out = run(Command::new("qemu-img").args(args).arg(&img));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "qemu-img {args:?} ran beside a writable export"
        );
        assert!(err.contains("lock"), "qemu-img {args:?}: {err}");
    }
    m.stop().assert_clean("locked");
    assert!(
        files.iter().all(|p| !locked(p)),
        "a lock outlived the export"
    );
    run_ok(
        Command::new("qemu-img")
            .args(["info", "-f", "vmdk"])
            .arg(&img),
    );
    check(&img);
}

/// A grain directory entry of 0 (no grain table yet, as VMware may leave it): a writable open
/// makes the table (and its redundant twin), and writes there land where qemu-img reads them.
#[test]
fn missing_grain_tables_are_made_for_writing() {
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    let w = WorkDir::new("vmdk-newgt");
    let img = w.join("d.vmdk");
    create(&img, "monolithicSparse", SIZE);
    let f = open_ro(&img);
    let mut h = [0u8; 512];
    f.read_exact_at(&mut h, 0).unwrap();
    let rgd = u64::from_le_bytes(h[48..56].try_into().unwrap()) * 512;
    let gd = u64::from_le_bytes(h[56..64].try_into().unwrap()) * 512;
    drop(f);
    // Tables 1 (guest 32..64 MiB) gone from both directories.
    poke(&img, gd + 4, &0u32.to_le_bytes());
    poke(&img, rgd + 4, &0u32.to_le_bytes());
    let model = w.join("d.model");
    sparse_image(&model, SIZE);
    let mp = w.join("d.export");
    let m = Mount::start(&w, &img, &mp, &["--writable"]);
    let (ef, mf) = (open_rw(&mp), open_rw(&model));
    let mut rng = Rng::new(21);
    for _ in 0..40 {
        let off = 32 * MIB + rng.below(31 * MIB);
        let len = 1 + rng.below(100_000) as usize;
        let buf = rng.bytes(len);
        ef.write_all_at(&buf, off).unwrap();
        mf.write_all_at(&buf, off).unwrap();
    }
    ef.sync_all().unwrap();
    drop(ef);
    m.stop().assert_clean("new grain tables");
    check(&img);
    compare(&img, &model);
    let f = open_ro(&img);
    let mut e = [0u8; 4];
    f.read_exact_at(&mut e, gd + 4).unwrap();
    let mut r = [0u8; 4];
    f.read_exact_at(&mut r, rgd + 4).unwrap();
    assert!(
        u32::from_le_bytes(e) != 0 && u32::from_le_bytes(r) != 0 && e != r,
        "both directories name a new table of their own"
    );
}
