//! Inputs the rows share, written once under `target/bench-data/`.

use std::fs;
use std::path::{Path, PathBuf};

use bigmodel_benches::module_trees;
use bigmodel_benches::safetensors_f32::{self, layers};

/// A sparse 64 GiB safetensors file of 2048 F32 tensors (header only on
/// disk), the shape `benches/benches/checkpoint_read.rs` opens.
pub(super) fn write_sparse(path: &Path) -> Result<PathBuf, String> {
    let tensors = layers(2048, 32 << 20);
    let len =
        safetensors_f32::header(&tensors, &[]).len() as u64 + safetensors_f32::data_len(&tensors);
    if fs::metadata(path).is_ok_and(|m| m.len() == len) {
        return Ok(path.to_path_buf());
    }
    safetensors_f32::write_sparse(path, &tensors)
        .map_err(|e| format!("not available: writing {}: {e}", path.display()))?;
    Ok(path.to_path_buf())
}

/// The MoE module tree of `benches/benches/plan.rs` as a
/// `bigmodel-module-tree/1` file, and the bytes of its tensors.
pub(super) fn write_moe_tree(path: &Path) -> Result<(PathBuf, u64), String> {
    let tree = module_trees::moe();
    if fs::read(path).is_ok_and(|text| text == tree.json.as_bytes()) {
        return Ok((path.to_path_buf(), tree.bytes));
    }
    write_atomic(path, tree.json.as_bytes()).map_err(|e| format!("not available: {e}"))?;
    Ok((path.to_path_buf(), tree.bytes))
}

/// Writes `bytes` to `PATH.partial` and renames it to `path`.
pub(super) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let partial = path.with_extension("partial");
    fs::write(&partial, bytes).map_err(|e| format!("writing {}: {e}", partial.display()))?;
    fs::rename(&partial, path).map_err(|e| format!("renaming to {}: {e}", path.display()))
}
