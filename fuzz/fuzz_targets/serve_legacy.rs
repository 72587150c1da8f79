//! Fuzz target: the protocol server, /dev/fuse framing. The logic and its checks are in `fusex_fuzz`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fusex_fuzz::serve::run_legacy(data);
});
