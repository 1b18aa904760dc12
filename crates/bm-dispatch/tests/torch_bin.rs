//! Loading PyTorch `.bin` checkpoints (bm-shard's fixtures, written by
//! torch): contiguous tensors are used from the mapping, strided views are
//! gathered, and disk offload writes Accelerate's `.dat` files, whose index
//! cannot point into a `.bin` as it can into a safetensors file.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bm_device::DeviceSet;
use bm_dispatch::{LoadOptions, Model, load_checkpoint_in_model};
use bm_plan::DeviceMap;
use bm_shard::Checkpoint;

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../bm-shard/tests/fixtures/torch")
        .join(rel)
}

fn host_bytes(model: &Model, name: &str) -> Vec<u8> {
    model
        .weight(name)
        .unwrap()
        .bytes
        .to_host()
        .unwrap()
        .to_vec()
}

#[test]
fn views_load_zero_copy_or_gathered_on_the_cpu() {
    let bin = fixture("shared.bin");
    let ckpt = Checkpoint::open(&bin).unwrap();
    let tree = bm_plan::checkpoint::tree_from_tied_tensors(ckpt.tensors(), &ckpt.ties()).unwrap();
    let model = Model::empty(tree, Arc::new(DeviceSet::cpu_only())).unwrap();
    load_checkpoint_in_model(&model, &ckpt, None, &LoadOptions::default()).unwrap();
    for (name, mapped) in [
        ("embed.weight", true),
        ("row", true),
        ("transposed", false),
        ("column", false),
    ] {
        let w = model.weight(name).unwrap();
        assert_eq!(w.bytes.is_mapped(), mapped, "{name}");
        assert_eq!(
            host_bytes(&model, name),
            ckpt.read_as(name, w.meta.dtype).unwrap().as_bytes(),
            "{name}"
        );
    }
    assert!(
        model
            .shares_storage("embed.weight", "lm_head.weight")
            .unwrap()
    );
}

#[test]
fn disk_offload_of_a_bin_writes_dat_files() {
    let dir = fixture("tiny-llama");
    let path = dir.join("config.json");
    let config =
        bm_plan::config::HfConfig::parse(&std::fs::read_to_string(&path).unwrap(), &path).unwrap();
    let tree = bm_plan::hf::tree_from_config(&config).unwrap().tree;
    let ckpt = Checkpoint::open(&dir).unwrap();
    let model = Model::empty(tree, Arc::new(DeviceSet::cpu_only())).unwrap();
    let folder = tempfile::tempdir().unwrap();
    let map = DeviceMap::from_json(&serde_json::json!({"": "disk"})).unwrap();
    let options = LoadOptions {
        offload_folder: Some(folder.path().to_path_buf()),
        ..LoadOptions::default()
    };
    let report = load_checkpoint_in_model(&model, &ckpt, Some(&map), &options).unwrap();
    assert!(report.mapped_in_place.is_empty(), "{report:?}");
    // Every tensor but the tied lm_head (loaded once, with the embedding).
    assert_eq!(report.written_to_folder.len(), 20);
    let index = std::fs::read_to_string(folder.path().join("index.json")).unwrap();
    assert!(!index.contains("safetensors_file"), "{index}");
    for name in [
        "model.embed_tokens.weight",
        "model.layers.1.mlp.up_proj.weight",
    ] {
        assert!(folder.path().join(format!("{name}.dat")).is_file());
        assert_eq!(
            host_bytes(&model, name),
            ckpt.view(name).unwrap().as_bytes(),
            "{name}"
        );
    }
}
