//! Image bytes of every block-table format (VHD, VDI, VHDX, VMDK) and of partition tables,
//! opened the way an export opens them and then read and written: a hostile image is refused
//! with a one-line error or fails only the requests that touch its bad parts, never a panic,
//! and a write that succeeded reads back as written.
//!
//! The first input byte chooses how to open the image (the input after the first nine bytes,
//! written to a file in a scratch directory): the format (by name, or probed), writable or not,
//! one partition of it or the whole; the next eight bytes choose where the requests go.

use std::cell::RefCell;
use std::path::PathBuf;

use backend::{AnyBackend, BlockBackend, Format, Locking, OpenOptions};
use engine::{Engine, EngineConfig};

/// The bytes one request moves: a 4 KiB block, plus one sector so that requests straddle block
/// and grain boundaries when their offset is not aligned.
const REQUEST: usize = 4096 + 512;

/// What one input gave, for the seed tests.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// The image opened.
    pub opened: bool,
    /// Requests that completed (reads and writes).
    pub done: usize,
    /// Requests that failed (an image error confined to the request).
    pub failed: usize,
}

/// How the first byte opens the image.
#[derive(Clone, Copy, Debug)]
struct Setup {
    format: Format,
    writable: bool,
    partition: Option<u32>,
}

impl Setup {
    fn from_byte(b: u8) -> Setup {
        let format = match b & 7 {
            0 => Format::Vhd,
            1 => Format::Vdi,
            2 => Format::Vhdx,
            3 => Format::Vmdk,
            // Probed, as `--format auto` does: raw when no magic matches.
            _ => Format::Auto,
        };
        Setup {
            format,
            writable: b & 8 != 0,
            partition: (b & 16 != 0).then_some(u32::from(b >> 5) + 1),
        }
    }
}

struct Harness {
    eng: Engine,
    dir: tempfile::TempDir,
}

thread_local! {
    static HARNESS: RefCell<Option<Harness>> = const { RefCell::new(None) };
}

/// The bytes before the image: the setup byte and one byte per request.
pub const PREFIX: usize = 9;

/// Opens `data[PREFIX..]` as the first byte says, and runs the requests the next eight place:
/// reads; on a writable image, two writes, a zeroing and a discard among them, each read back.
pub fn run(data: &[u8]) -> Outcome {
    let Some((&setup, rest)) = data.split_first() else {
        return Outcome::default();
    };
    let Some((picks, image)) = rest.split_first_chunk::<8>() else {
        return Outcome::default();
    };
    HARNESS.with(|h| {
        let mut h = h.borrow_mut();
        let h = h.get_or_insert_with(|| Harness {
            eng: Engine::new(&EngineConfig {
                sq_entries: 8,
                buffers: 2,
                buffer_size: REQUEST,
                ..EngineConfig::default()
            })
            .expect("the fuzz harness needs io_uring"),
            dir: tempfile::tempdir().expect("a scratch directory"),
        });
        h.run(Setup::from_byte(setup), picks, image)
    })
}

impl Harness {
    fn run(&self, setup: Setup, picks: &[u8; 8], image: &[u8]) -> Outcome {
        let path: PathBuf = self.dir.path().join("image");
        std::fs::write(&path, image).expect("the scratch image");
        let opts = OpenOptions {
            format: setup.format,
            // Named files (VMDK extents, a VHDX parent) stay out: only the input is read.
            no_backing: true,
            writable: setup.writable,
            locking: Locking::Off,
            partition: setup.partition,
            ..OpenOptions::default()
        };
        let b = match backend::open(path.to_str().expect("a UTF-8 scratch path"), opts) {
            Ok(b) => b,
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    !msg.is_empty() && !msg.contains('\n'),
                    "a refusal is one line: {msg:?}"
                );
                return Outcome::default();
            }
        };
        let mut out = Outcome {
            opened: true,
            ..Outcome::default()
        };
        let size = b.size();
        for (i, &p) in picks.iter().enumerate() {
            let off = place(size, p);
            match (setup.writable, i) {
                (true, 1 | 5) => self.write_and_read_back(&b, off, p, &mut out),
                (true, 3) => self.zero_and_read_back(&b, off, false, &mut out),
                (true, 7) => self.zero_and_read_back(&b, off, true, &mut out),
                _ => {
                    self.read(&b, off, &mut out);
                }
            }
        }
        if setup.writable {
            // A failed flush is the image's error, as any other; it must come back, not panic.
            let _ = self.eng.block_on(b.flush(&self.eng));
        }
        out
    }

    /// Reads `REQUEST` bytes at `off` (fewer at the end of the image).
    fn read(&self, b: &AnyBackend, off: u64, out: &mut Outcome) -> Option<Vec<u8>> {
        let want = REQUEST.min((b.size() - off) as usize);
        let buf = self.eng.take_buffer().expect("a free buffer");
        let (r, win) = self
            .eng
            .block_on(b.read_at(&self.eng, buf.slice(0..want), off))
            .expect("the engine runs");
        match r {
            Ok(n) => {
                assert!(n <= want, "read {n} bytes into {want}");
                out.done += 1;
                Some(win.as_slice()[..n].to_vec())
            }
            Err(_) => {
                out.failed += 1;
                None
            }
        }
    }

    /// Writes a pattern at `off`; if the whole write landed, the same range reads back as it.
    fn write_and_read_back(&self, b: &AnyBackend, off: u64, seed: u8, out: &mut Outcome) {
        let want = REQUEST.min((b.size() - off) as usize);
        let mut buf = self.eng.take_buffer().expect("a free buffer");
        let pattern: Vec<u8> = (0..want)
            .map(|i| seed.wrapping_add((i / 512) as u8) ^ 0x5a)
            .collect();
        buf.as_mut_slice()[..want].copy_from_slice(&pattern);
        let (r, _) = self
            .eng
            .block_on(b.write_at(&self.eng, buf.slice(0..want), off))
            .expect("the engine runs");
        match r {
            Ok(n) => {
                assert!(n <= want, "wrote {n} bytes of {want}");
                out.done += 1;
                if n == want {
                    if let Some(back) = self.read(b, off, out) {
                        assert_eq!(back.len(), want, "a short read inside the image");
                        assert!(back == pattern, "a write at {off} read back otherwise");
                    }
                }
            }
            Err(_) => out.failed += 1,
        }
    }
}

impl Harness {
    /// Zeroes (or, with `discard`, deallocates) `REQUEST` bytes at `off`; if that succeeded,
    /// the range reads back as zeroes.
    fn zero_and_read_back(&self, b: &AnyBackend, off: u64, discard: bool, out: &mut Outcome) {
        let want = REQUEST.min((b.size() - off) as usize);
        let r = if discard {
            self.eng.block_on(b.discard(&self.eng, off, want as u64))
        } else {
            self.eng
                .block_on(b.write_zeroes(&self.eng, off, want as u64))
        }
        .expect("the engine runs");
        match r {
            Ok(()) => {
                out.done += 1;
                if let Some(back) = self.read(b, off, out) {
                    assert_eq!(back.len(), want, "a short read inside the image");
                    assert!(
                        back.iter().all(|&x| x == 0),
                        "a {} range at {off} read back otherwise",
                        if discard { "discarded" } else { "zeroed" }
                    );
                }
            }
            Err(_) => out.failed += 1,
        }
    }
}

/// An offset inside an image of `size` bytes chosen by `p`: the start, the end, a sector
/// boundary or the middle of a sector anywhere between.
fn place(size: u64, p: u8) -> u64 {
    if size == 0 {
        return 0;
    }
    let last = size - 1;
    let off = match p >> 6 {
        0 => 0,
        1 => last.saturating_sub(REQUEST as u64 - 1),
        2 => ((last / 64) * u64::from(p & 63)) & !511,
        _ => ((last / 64) * u64::from(p & 63)) | 0x1ff,
    };
    off.min(last)
}
