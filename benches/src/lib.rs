//! Criterion benchmarks of the bigmodel workspace; see `benches/*.rs` and
//! `cargo xtask bench`.
