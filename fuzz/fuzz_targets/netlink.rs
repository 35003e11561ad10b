#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| railover_fuzz::netlink_parse(data));
