//! Any bytes, through every reader of untrusted files: as a safetensors
//! file, a shard index, an Accelerate offload index, a module-tree
//! document and a config.json (as the planner builds a model from it).
//! Each reader must return `Ok` or an `Err` naming the file (the module
//! tree: saying it is one), never panic; and what it accepts must be what
//! the reference accepts: a header we accept, the safetensors crate accepts
//! with the same tensors; an index, a module tree or a config we accept is
//! one JSON object to serde_json, with safe shard names, and every module
//! and tensor of an accepted tree is found by its name.
//!
//! Run from the repository root (nightly and `cargo install cargo-fuzz`):
//!
//! ```text
//! cargo +nightly fuzz run parse_header_and_index \
//!     fuzz/corpus/parse_header_and_index fuzz/seeds/parse_header_and_index \
//!     -- -dict=fuzz/json.dict -max_len=4096 -max_total_time=600
//! ```
//!
//! `fuzz/seeds/` is the small committed corpus (one file per input kind and
//! each past finding); `fuzz/corpus/` is where libFuzzer grows its own and
//! is not committed.

#![no_main]

use std::path::Path;

use bm_plan::config::HfConfig;
use bm_plan::hf::tree_from_config;
use bm_plan::{ModuleTree, Node};
use bm_shard::offload::{OffloadEntry, parse_index};
use bm_shard::{Header, Index, check_shard_name};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    header(data);
    shard_index(data);
    offload_index(data);
    module_tree(data);
    config(data);
});

fn header(data: &[u8]) {
    let path = Path::new("fuzz.safetensors");
    let header = match Header::parse(path, data) {
        Ok(header) => header,
        Err(e) => {
            assert!(e.to_string().starts_with("fuzz.safetensors: "), "{e}");
            return;
        }
    };
    let data_len = data.len() as u64 - header.data_start();
    let mut covered = 0;
    for t in &header.tensors {
        assert_eq!(t.data_offsets.0, covered);
        assert_eq!(
            t.data_offsets.1 - t.data_offsets.0,
            t.meta.byte_len() as u64
        );
        covered = t.data_offsets.1;
    }
    assert_eq!(covered, data_len);
    let reference = safetensors::SafeTensors::deserialize(data)
        .unwrap_or_else(|e| panic!("we accept a header safetensors refuses: {e:?}"));
    assert_eq!(reference.len(), header.tensors.len());
    for t in &header.tensors {
        let r = reference.tensor(&t.name).unwrap();
        assert_eq!(r.shape(), t.meta.shape.as_slice(), "{}", t.name);
        assert_eq!(
            format!("{:?}", r.dtype()),
            t.meta.dtype.as_safetensors_str(),
            "{}",
            t.name
        );
        let start = (header.data_start() + t.data_offsets.0) as usize;
        assert_eq!(r.data().as_ptr(), data[start..].as_ptr(), "{}", t.name);
    }
}

fn shard_index(data: &[u8]) {
    let path = Path::new("fuzz.index.json");
    match Index::parse(path, data) {
        Ok(index) => {
            let value: serde_json::Value =
                serde_json::from_slice(data).expect("an accepted index is JSON");
            assert!(value.is_object());
            let mut names: Vec<&str> = index.weight_map.iter().map(|(n, _)| n.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), index.weight_map.len(), "a tensor listed twice");
            for (name, file) in &index.weight_map {
                check_shard_name(path, name, file).unwrap();
                assert!(!Path::new(file).is_absolute());
                assert!(!file.split(['/', '\\']).any(|p| p == ".."));
            }
        }
        Err(e) => assert!(e.to_string().starts_with("fuzz.index.json: "), "{e}"),
    }
}

fn offload_index(data: &[u8]) {
    let path = Path::new("index.json");
    match parse_index(path, data) {
        Ok(entries) => {
            let value: serde_json::Value =
                serde_json::from_slice(data).expect("an accepted index is JSON");
            assert_eq!(value.as_object().map(|o| o.len()), Some(entries.len()));
            for (_, entry) in &entries {
                if let OffloadEntry::Dat(meta) = entry {
                    assert!(meta.checked_byte_len().is_some());
                }
            }
        }
        Err(e) => assert!(e.to_string().starts_with("index.json: "), "{e}"),
    }
}

fn module_tree(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match ModuleTree::from_json_str(text) {
        Ok(tree) => {
            let value: serde_json::Value =
                serde_json::from_str(text).expect("an accepted module tree is JSON");
            assert!(value.is_object());
            for (m, module) in tree.modules().iter().enumerate() {
                assert_eq!(tree.find(&module.name), Some(Node::Module(m)));
            }
            for (t, tensor) in tree.tensors().iter().enumerate() {
                assert_eq!(tree.find(&tensor.name), Some(Node::Tensor(t)));
            }
        }
        Err(e) => assert!(e.to_string().starts_with("invalid module tree"), "{e}"),
    }
}

/// A config.json: accepted only if it is a JSON object to serde_json; the
/// model built from an accepted one has the layers it says, and its KV
/// cache size for absurd requests saturates instead of wrapping.
fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let config = match HfConfig::parse(text, "config.json") {
        Ok(config) => config,
        Err(e) => {
            assert!(e.to_string().starts_with("config.json: "), "{e}");
            return;
        }
    };
    let value: serde_json::Value = serde_json::from_str(text).expect("an accepted config is JSON");
    assert!(value.is_object());
    // Up to 10000 layers are valid; building that many per input would
    // only slow the search (unit tests cover the bound).
    if config.num_layers > 64 {
        return;
    }
    match tree_from_config(&config) {
        Ok(model) => {
            assert_eq!(model.layers.len(), config.num_layers);
            if let Some(per_layer) = model.kv_runtime_bytes(u64::MAX, u64::MAX, model.dtype) {
                assert_eq!(per_layer.len(), config.num_layers);
            }
        }
        Err(e) => assert!(e.to_string().starts_with("config.json: "), "{e}"),
    }
}
