//! Every worker residual of an all-reduce as bits, for tests that compare two runs bit for bit
//! (shared by `tests/non_blocking.rs` and the MPI self-test).

use gradwire::CompressedAllReduce;

/// Every worker residual (name order), one after the other, as bits; none without error
/// feedback.
pub fn residual_bits(ar: &CompressedAllReduce) -> Vec<u32> {
    ar.compressor()
        .feedback()
        .map(|fb| {
            fb.residuals()
                .flat_map(|(_, r)| r.iter().map(|x| x.to_bits()))
                .collect()
        })
        .unwrap_or_default()
}
