#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| railover_fuzz::wire_header(data));
