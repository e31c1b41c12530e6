//! Fuzz target `method_state`: see `gradwire_fuzz_logic::state_targets::method_state`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    gradwire_fuzz_logic::state_targets::method_state(data)
});
