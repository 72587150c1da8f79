//! fsx-style random operations: thousands of seeded reads, writes, truncates, hole punches, zero
//! ranges and fsyncs through a growable export, each checked against an in-memory model of the
//! file; then the image itself is compared with the model (a qcow2 image through
//! `qemu-img convert`, and `qemu-img check` must be clean). Runs on whichever transport the suite
//! runs on (`FUSEX_E2E_TRANSPORT`). `FSX_OPS` sets the operation count (default 3000;
//! `make stress` runs more).
//!
//! A failure prints the seed, the operation number and the last operations, so it can be
//! replayed with `FSX_SEED`.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;

use fusex_e2e::*;

/// Largest size the file reaches.
const MAX_SIZE: u64 = 8 * MIB;
/// Largest single read or write.
const MAX_IO: u64 = 256 * 1024;

#[derive(Debug)]
enum Op {
    Read(u64, u64),
    Write(u64, u64),
    Truncate(u64),
    Punch(u64, u64),
    Zero(u64, u64),
    Fsync,
}

struct Fsx {
    rng: Rng,
    model: Vec<u8>,
    /// Raw image semantics. A qcow2 image cannot shrink (EOPNOTSUPP) and its size is a multiple
    /// of 512: it grows to the next one, and a truncate to anything else is EINVAL.
    can_shrink: bool,
    log: Vec<String>,
}

impl Fsx {
    fn pick(&mut self) -> Op {
        let size = self.model.len() as u64;
        let off = |rng: &mut Rng, room: u64| rng.below(room.max(1));
        let len = |rng: &mut Rng| 1 + rng.below(MAX_IO);
        match self.rng.below(100) {
            0..=34 => {
                let o = off(&mut self.rng, size + 4096);
                Op::Read(o, len(&mut self.rng))
            }
            35..=69 => {
                let l = len(&mut self.rng);
                let o = off(&mut self.rng, MAX_SIZE - l);
                Op::Write(o, l)
            }
            70..=77 => Op::Truncate(off(&mut self.rng, MAX_SIZE)),
            78..=87 => {
                let o = off(&mut self.rng, size);
                Op::Punch(o, len(&mut self.rng))
            }
            88..=96 => {
                let o = off(&mut self.rng, size);
                Op::Zero(o, len(&mut self.rng))
            }
            _ => Op::Fsync,
        }
    }

    /// The model after something wrote up to `end`.
    fn grow(&mut self, end: usize) {
        let end = if self.can_shrink {
            end
        } else {
            end.next_multiple_of(512)
        };
        if end > self.model.len() {
            self.model.resize(end, 0);
        }
    }

    /// Applies `op` to the export and to the model, checking what the export returns.
    fn apply(&mut self, f: &File, op: &Op) -> Result<(), String> {
        let size = self.model.len() as u64;
        match *op {
            Op::Read(o, l) => {
                let got = pread_full(f, o, l as usize).map_err(|e| format!("read: {e}"))?;
                let end = (o + l).min(size);
                let want = if o < size {
                    &self.model[o as usize..end as usize]
                } else {
                    &[][..]
                };
                if got != want {
                    let first = got
                        .iter()
                        .zip(want)
                        .position(|(a, b)| a != b)
                        .unwrap_or(got.len().min(want.len()));
                    return Err(format!(
                        "read {} bytes, model has {}; first difference at offset {}",
                        got.len(),
                        want.len(),
                        o + first as u64
                    ));
                }
            }
            Op::Write(o, l) => {
                let data = self.rng.bytes(l as usize);
                f.write_all_at(&data, o)
                    .map_err(|e| format!("write: {e}"))?;
                let end = (o + l) as usize;
                self.grow(end);
                self.model[o as usize..end].copy_from_slice(&data);
            }
            Op::Truncate(n) => {
                if n < size && !self.can_shrink {
                    let r = f.set_len(n).map_err(|e| errno(&e));
                    if r != Err(libc::EOPNOTSUPP) {
                        return Err(format!("shrinking gave {r:?}, not EOPNOTSUPP"));
                    }
                    return Ok(());
                }
                if !self.can_shrink && n > size && n % 512 != 0 {
                    let r = f.set_len(n).map_err(|e| errno(&e));
                    if r != Err(libc::EINVAL) {
                        return Err(format!("truncate to {n} gave {r:?}, not EINVAL"));
                    }
                    return Ok(());
                }
                f.set_len(n).map_err(|e| format!("truncate: {e}"))?;
                self.model.resize(n as usize, 0);
            }
            Op::Punch(o, l) => {
                let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
                fallocate(f, mode, o, l).map_err(|e| format!("punch: {e}"))?;
                let end = (o + l).min(size) as usize;
                if (o as usize) < end {
                    self.model[o as usize..end].fill(0);
                }
            }
            Op::Zero(o, l) => {
                fallocate(f, libc::FALLOC_FL_ZERO_RANGE, o, l)
                    .map_err(|e| format!("zero range: {e}"))?;
                let end = (o + l) as usize;
                self.grow(end);
                self.model[o as usize..end].fill(0);
            }
            Op::Fsync => f.sync_all().map_err(|e| format!("fsync: {e}"))?,
        }
        let now = f.metadata().map_err(|e| format!("fstat: {e}"))?.len();
        if now != self.model.len() as u64 {
            return Err(format!(
                "st_size {now}, model {} after the operation",
                self.model.len()
            ));
        }
        Ok(())
    }
}

fn ops() -> usize {
    std::env::var("FSX_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000)
}

/// Runs the random operations on the export at `mp`; returns the model.
fn run_fsx(m: &Mount, start: Vec<u8>, can_shrink: bool, seed: u64) -> Vec<u8> {
    let seed = std::env::var("FSX_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(seed);
    let f = m.open_rw();
    let mut fsx = Fsx {
        rng: Rng::new(seed),
        model: start,
        can_shrink,
        log: Vec::new(),
    };
    let n = ops();
    for i in 0..n {
        let op = fsx.pick();
        fsx.log.push(format!("{i}: {op:?}"));
        if let Err(e) = fsx.apply(&f, &op) {
            let tail = fsx.log.len().saturating_sub(12);
            panic!(
                "fsx seed {seed}, operation {i} ({op:?}): {e}\nlast operations:\n{}\nfusex stderr:\n{}",
                fsx.log[tail..].join("\n"),
                m.stderr()
            );
        }
    }
    // The whole file at the end, in one pass.
    let all = pread_full(&f, 0, fsx.model.len() + 4096).unwrap();
    assert_bytes_eq(&all, &fsx.model, 0, "the export after the operations");
    fsx.model
}

fn raw_case(tag: &str, extra: &[&str], seed: u64) {
    if !require_fuse() {
        return;
    }
    let w = WorkDir::new(tag);
    let img = w.join("disk.img");
    let start = random_image(&img, 2 * MIB, seed);
    let mut args = vec!["--writable", "--growable"];
    args.extend_from_slice(extra);
    let m = Mount::start(&w, &img, &w.join("export"), &args);
    let model = run_fsx(&m, start, true, seed);
    m.stop().assert_clean("fsx on a raw image");
    assert_bytes_eq(&read_all(&img), &model, 0, "the raw image after fsx");
}

#[test]
fn fsx_raw_image() {
    raw_case("fsx-raw", &["--passthrough", "off"], 81);
}

#[test]
fn fsx_raw_image_default_options() {
    raw_case("fsx-raw-default", &[], 82);
}

fn qemu_img(args: &[&str], files: &[&Path]) {
    let mut c = Command::new("qemu-img");
    c.args(args);
    for f in files {
        c.arg(f);
    }
    run_ok(&mut c);
}

#[test]
fn fsx_qcow2_image() {
    if !require_fuse_and_tools(&["qemu-img"]) {
        return;
    }
    let w = WorkDir::new("fsx-qcow2");
    let raw = w.join("start.raw");
    let start = random_image(&raw, 2 * MIB, 83);
    let img = w.join("disk.qcow2");
    // Small clusters: many cluster boundaries inside the 8 MiB the file reaches.
    qemu_img(
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "qcow2",
            "-o",
            "cluster_size=4096",
        ],
        &[&raw, &img],
    );
    let m = Mount::start(&w, &img, &w.join("export"), &["--writable", "--growable"]);
    let model = run_fsx(&m, start, false, 83);
    m.stop().assert_clean("fsx on a qcow2 image");
    assert_bytes_eq(
        &qcow2_guest_bytes(&w, &img),
        &model,
        0,
        "the qcow2 image after fsx",
    );
}
