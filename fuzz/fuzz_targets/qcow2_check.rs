//! Fuzz target: qcow2 image bytes through the integrity pass a writable open runs. The logic and
//! its checks are in `fusex_fuzz::qcow2`; the corpus starts from the damaged-image corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fusex_fuzz::qcow2::run(data);
});
