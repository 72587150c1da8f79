//! Fuzz harnesses of fusex: the request decoder of `fuse-abi`, the whole protocol server over
//! an in-memory backend in both framings (`/dev/fuse` and FUSE-over-io_uring) and over a
//! directory export (`dir`), the NBD client's parsers of what a server sends (`nbd`), the qcow2
//! integrity pass over image bytes (`qcow2`), the other formats' and partition tables'
//! opens and requests (`image`), and what a QMP client sends (`qmp`).
//!
//! The harness logic lives here, not in `fuzz_targets/`, so the stable unit tests below run it
//! over the seed inputs (`make unit`), and `make fuzz` runs it under libFuzzer on nightly.
//! Every invariant is an assertion: a violation is a panic, which libFuzzer reports as a crash.

pub mod decode;
pub mod dir;
pub mod image;
pub mod mem;
pub mod nbd;
pub mod qcow2;
pub mod qmp;
pub mod seeds;
pub mod serve;

#[cfg(test)]
mod tests;
