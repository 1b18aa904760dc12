//! Criterion benchmarks of the bigmodel workspace (see `benches/*.rs` and
//! `cargo xtask bench`), and the inputs they and the bench report share:
//! safetensors files of F32 tensors, files of many tiny tensors, and the
//! module trees planned.
//!
//! This library depends on serde_json alone, so `xtask` can use it without
//! building the workspace; the bench targets take the workspace's crates as
//! dev-dependencies.

pub mod many_tensors;
pub mod module_trees;
pub mod safetensors_f32;
