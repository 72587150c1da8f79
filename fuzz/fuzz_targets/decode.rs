//! Fuzz target: the request decoder (fuse-abi), both framings. The logic and its checks are in `fusex_fuzz`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fusex_fuzz::decode::run(data);
});
