//! Fuzz target `reference`: see `gradwire_fuzz_logic::std_targets::reference`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| gradwire_fuzz_logic::std_targets::reference(data));
