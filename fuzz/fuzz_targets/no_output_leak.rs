//! Fuzz target `no_output_leak`: see `gradwire_fuzz_logic::core_targets::no_output_leak`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| gradwire_fuzz_logic::core_targets::no_output_leak(data));
