//! Fuzz target: what a control-socket client sends, through the QMP session and QEMU's
//! key=value option syntax. The logic and its checks are in `fusex_fuzz::qmp`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fusex_fuzz::qmp::run(data);
});
