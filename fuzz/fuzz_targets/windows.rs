//! Fuzz target `windows`: see `gradwire_fuzz_logic::window_targets::windows`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| gradwire_fuzz_logic::window_targets::windows(data));
