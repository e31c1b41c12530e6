//! Fuzz target `decode`: see `gradwire_fuzz_logic::core_targets::decode`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| gradwire_fuzz_logic::core_targets::decode(data));
