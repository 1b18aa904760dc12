//! The facade plans, loads and dispatches in one call.

use std::sync::Arc;

use bigmodel::device::{Device, DeviceSet};
use bigmodel::dispatch::{ModelBuilder, Placement, Tier};
use bigmodel::plan::{MaxMemory, Mode};
use bigmodel::tensor::DType;
use bigmodel::{DeviceMapSpec, Options, load_checkpoint_and_dispatch};

#[test]
fn auto_map_over_an_emulated_gpu_cpu_and_disk() {
    let dir = tempfile::tempdir().unwrap();
    let side = 64;
    let layers = 6;
    let b = linear_stack(&dir.path().join("model.safetensors"), layers, side);

    let layer = (side * side * 4) as u64;
    let options = Options {
        device_map: Some(DeviceMapSpec::Strategy(Mode::Sequential)),
        max_memory: Some(
            MaxMemory::new([
                // One resident layer plus room to stream two offloaded
                // ones (the running layer and the prefetched next one).
                (bigmodel::plan::Device::Gpu(0), 3 * layer + 1),
                (bigmodel::plan::Device::Cpu, 2 * layer + 1),
            ])
            .unwrap(),
        ),
        offload_folder: Some(dir.path().join("offload")),
        ..Options::default()
    };
    let devices = Arc::new(DeviceSet::emulated(&[1 << 20]));
    let model =
        load_checkpoint_and_dispatch(b.build().unwrap(), dir.path(), devices, &options).unwrap();
    let map = model.hf_device_map().unwrap();
    assert!(
        map.iter().any(|(_, d)| d == bigmodel::plan::Device::Disk),
        "{map:?}"
    );
    assert_eq!(
        model.placement("0.weight").unwrap(),
        Placement::Resident(Device::Gpu(0))
    );
    assert_eq!(
        model.placement("5.weight").unwrap(),
        Placement::Offloaded(Tier::Disk)
    );

    let err = DeviceMapSpec::parse("fastest").unwrap_err();
    assert_eq!(
        err.to_string(),
        "If passing a string for `device_map`, please choose 'auto', 'balanced', 'balanced_low_0' or 'sequential'."
    );
}

#[test]
fn trees_from_a_pytorch_checkpoint_tie_names_over_one_storage() {
    let bin = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../bm-shard/tests/fixtures/torch/shared.bin");
    let tree = bigmodel::tree_from_checkpoint(&bin).unwrap();
    // The transpose and the slices share the storage too, but are other
    // tensors: only the two names for the same view are one.
    assert_eq!(tree.tied_names(), [["embed.weight", "lm_head.weight"]]);
}

/// A checkpoint of `layers` F32 Linear(side, side) layers at `path`, and
/// its model.
fn linear_stack(path: &std::path::Path, layers: usize, side: usize) -> ModelBuilder {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    let mut b = ModelBuilder::new("Sequential");
    for i in 0..layers {
        b.linear(
            ModelBuilder::ROOT,
            &i.to_string(),
            side,
            side,
            false,
            DType::F32,
        )
        .unwrap();
        let start = data.len();
        data.extend((0..side * side).flat_map(|k| (k as f32).to_le_bytes()));
        header.insert(
            format!("{i}.weight"),
            serde_json::json!({"dtype": "F32", "shape": [side, side], "data_offsets": [start, data.len()]}),
        );
    }
    let text = serde_json::Value::Object(header).to_string();
    let mut file = (text.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(text.as_bytes());
    file.extend_from_slice(&data);
    std::fs::write(path, file).unwrap();
    b
}

#[test]
fn an_offload_folder_holding_the_checkpoint_is_refused_and_left_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    // A Hugging Face cache layout: the snapshot's file is a link into blobs/.
    let repo = dir.path().join("models--test--tiny");
    let blobs = repo.join("blobs");
    let snapshot = repo.join("snapshots").join("0a1b2c");
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::create_dir_all(&snapshot).unwrap();
    std::os::unix::fs::symlink("../../blobs/0123abcd", snapshot.join("model.safetensors")).unwrap();
    let listing = |p: &std::path::Path| {
        let mut names: Vec<_> = std::fs::read_dir(p)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        names
    };
    for folder in [&snapshot, &blobs] {
        let b = linear_stack(&blobs.join("0123abcd"), 2, 8);
        let before = (listing(&snapshot), listing(&blobs));
        let options = Options {
            device_map: Some(DeviceMapSpec::Map(
                bigmodel::plan::DeviceMap::from_json(&serde_json::json!({"": "disk"})).unwrap(),
            )),
            offload_folder: Some(folder.clone()),
            ..Options::default()
        };
        let devices = Arc::new(DeviceSet::emulated(&[]));
        let Err(err) =
            load_checkpoint_and_dispatch(b.build().unwrap(), &snapshot, devices, &options)
        else {
            panic!("offloading into the checkpoint's folder must be refused");
        };
        let message = err.to_string();
        assert!(
            message.contains(&folder.display().to_string()) && message.contains("another folder"),
            "{message}"
        );
        assert_eq!(
            (listing(&snapshot), listing(&blobs)),
            before,
            "nothing written"
        );
    }
}

/// `keep_in_fp32_modules` under a half dtype: the planner sizes those
/// weights in F32, as loading stores them (transformers' `special_dtypes`
/// for `_keep_in_fp32_modules`). The GPU holds the four layers in F16
/// (a quarter of its budget each); with layer 0 in F32 they do not fit, and layer
/// 1 is offloaded (sized all in F16, everything stayed on the GPU).
#[test]
fn modules_kept_in_f32_are_planned_in_f32() {
    let dir = tempfile::tempdir().unwrap();
    let side = 64;
    let b = linear_stack(&dir.path().join("model.safetensors"), 4, side);
    let layer = (side * side * 4) as u64;
    let options = Options {
        device_map: Some(DeviceMapSpec::Strategy(Mode::Sequential)),
        max_memory: Some(
            MaxMemory::new([
                (bigmodel::plan::Device::Gpu(0), 2 * layer + 1),
                (bigmodel::plan::Device::Cpu, 100 * layer),
            ])
            .unwrap(),
        ),
        dtype: Some(DType::F16),
        keep_in_fp32_modules: vec!["0".into()],
        ..Options::default()
    };
    let devices = Arc::new(DeviceSet::emulated(&[1 << 20]));
    let model =
        load_checkpoint_and_dispatch(b.build().unwrap(), dir.path(), devices, &options).unwrap();
    let map = model.hf_device_map().unwrap();
    assert_eq!(
        model.placement("0.weight").unwrap(),
        Placement::Resident(Device::Gpu(0)),
        "{map:?}"
    );
    assert_eq!(
        model.placement("1.weight").unwrap(),
        Placement::Offloaded(Tier::Cpu),
        "{map:?}"
    );
}
