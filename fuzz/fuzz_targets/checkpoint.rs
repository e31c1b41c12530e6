//! Fuzz target `checkpoint`: see `gradwire_fuzz_logic::std_targets::checkpoint`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| gradwire_fuzz_logic::std_targets::checkpoint(data));
