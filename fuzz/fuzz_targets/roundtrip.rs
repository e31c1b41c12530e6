//! Fuzz target `roundtrip`: see `gradwire_fuzz_logic::core_targets::roundtrip`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| gradwire_fuzz_logic::core_targets::roundtrip(data));
