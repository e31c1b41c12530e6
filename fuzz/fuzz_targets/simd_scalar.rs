//! Fuzz target `simd_scalar`: see `gradwire_fuzz_logic::core_targets::simd_scalar`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| gradwire_fuzz_logic::core_targets::simd_scalar(data));
