//! Fuzz target `peek_frame`: see `gradwire_fuzz_logic::core_targets::peek_frame`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| gradwire_fuzz_logic::core_targets::peek_frame(data));
