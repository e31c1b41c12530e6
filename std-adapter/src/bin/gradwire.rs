//! The `gradwire` command-line tool (being written).
fn main() {}
