#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| railover_fuzz::receiver_session(data));
