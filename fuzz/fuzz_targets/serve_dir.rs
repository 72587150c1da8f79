//! Fuzz target: request sequences through the request server to a directory export of a
//! scratch tree. The logic and its checks are in `fusex_fuzz::dir`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fusex_fuzz::dir::run(data);
});
