//! Fuzz target: VHD, VDI, VHDX and VMDK images and partition tables opened and served. The logic
//! and its checks are in `fusex_fuzz::image`; the corpus starts from images `qemu-img` made.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fusex_fuzz::image::run(data);
});
