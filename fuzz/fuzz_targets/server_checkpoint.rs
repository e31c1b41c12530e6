//! Fuzz target `server_checkpoint`: see `gradwire_fuzz_logic::collective_targets::server_checkpoint`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    gradwire_fuzz_logic::collective_targets::server_checkpoint(data)
});
