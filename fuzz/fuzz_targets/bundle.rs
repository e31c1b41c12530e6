//! Fuzz target `bundle`: see `gradwire_fuzz_logic::std_targets::bundle`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| gradwire_fuzz_logic::std_targets::bundle(data));
