//! Benchmarks and the ratio report for gradwire (filled by the performance work).
