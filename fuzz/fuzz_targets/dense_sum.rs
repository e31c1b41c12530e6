//! Fuzz target `dense_sum`: see `gradwire_fuzz_logic::collective_targets::dense_sum`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| gradwire_fuzz_logic::collective_targets::dense_sum(data));
