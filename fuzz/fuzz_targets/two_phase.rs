//! Fuzz target `two_phase`: see `gradwire_fuzz_logic::collective_targets::two_phase`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| gradwire_fuzz_logic::collective_targets::two_phase(data));
