//! Fuzz target: NBD server bytes (option replies, simple and structured replies) through the
//! client's parsers. The logic and its checks are in `fusex_fuzz::nbd`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fusex_fuzz::nbd::run(data);
});
