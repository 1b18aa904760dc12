//! docs/guide.md as this module's documentation, so that every `rust`
//! block of the guide compiles and runs as a doc test (`cargo test --doc`).
//! Only built for doc tests; the guide's `sh` blocks are run by
//! crates/bigmodel-cli/tests/guide.rs.
//!
#![doc = include_str!("../../../docs/guide.md")]
