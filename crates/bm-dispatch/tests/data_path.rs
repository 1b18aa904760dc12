//! The GPU data path on emulated GPUs: out-of-memory errors while loading
//! and streaming are typed and leave the accounting where it was.

mod common;

use std::sync::Arc;

use bm_device::{Device, DeviceSet};
use bm_dispatch::{
    Activations, DispatchOptions, Error, LoadOptions, Model, dispatch_model,
    load_checkpoint_in_model,
};
use bm_plan::DeviceMap;
use bm_shard::Checkpoint;
use common::*;

/// Bytes of one layer's weight and bias (F32).
const BLOCK: u64 = ((WIDTH * WIDTH + WIDTH) * 4) as u64;

#[test]
fn out_of_memory_mid_load_names_device_tensor_and_free_bytes_and_frees_everything() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = Checkpoint::open(write_checkpoint(dir.path())).unwrap();
    // A budget with room for layers 0..3 and half of 3.weight.
    let budget = 3 * BLOCK + 512;
    let devices = Arc::new(DeviceSet::emulated(&[1 << 20]));
    devices.gpu(0).unwrap().set_budget(budget).unwrap();
    let model = Model::empty(tree(), Arc::clone(&devices)).unwrap();
    let all_on_gpu = DeviceMap::from_json(&serde_json::json!({"": 0})).unwrap();
    let err = load_checkpoint_in_model(&model, &ckpt, Some(&all_on_gpu), &LoadOptions::default())
        .unwrap_err();
    match &err {
        Error::OutOfDeviceMemory {
            what,
            device,
            requested,
            free,
            ..
        } => {
            assert_eq!(what, "3.weight");
            assert_eq!(*device, Device::Gpu(0));
            assert_eq!(*requested, (WIDTH * WIDTH * 4) as u64);
            assert_eq!(*free, 512);
        }
        other => panic!("expected OutOfDeviceMemory, got {other:?}"),
    }
    assert!(err.is_out_of_device_memory());
    let text = err.to_string();
    assert!(
        text.starts_with(
            "out of memory placing 3.weight on GPU 0: it needs 1024 bytes and 512 bytes are free"
        ),
        "{text}"
    );
    let gpu = devices.gpu(0).unwrap();
    assert_eq!(
        gpu.live_bytes(),
        0,
        "every allocation of the failed load is returned"
    );

    // The accounting is exact: with the budget raised, the same model loads.
    gpu.set_budget(budget + 2 * BLOCK).unwrap();
    load_checkpoint_in_model(&model, &ckpt, Some(&all_on_gpu), &LoadOptions::default()).unwrap();
    assert_eq!(gpu.live_bytes(), 4 * BLOCK + (2 * WIDTH * 4) as u64);
}

#[test]
fn a_streamed_block_that_cannot_fit_is_a_typed_error_and_leaves_the_residents() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = Checkpoint::open(write_checkpoint(dir.path())).unwrap();
    let folder = tempfile::tempdir().unwrap();
    let map = DeviceMap::from_json(
        &serde_json::json!({"0": 0, "1": "cpu", "2": "cpu", "3": "cpu", "bn": 0, "head": 0}),
    )
    .unwrap();
    // Layer 0 and bn (running_mean and the non-persistent scratch) resident,
    // and 100 bytes more: no offloaded layer fits.
    let resident = BLOCK + (2 * WIDTH * 4) as u64;
    let devices = Arc::new(DeviceSet::emulated(&[resident + 100]));
    let model = Model::empty(tree(), Arc::clone(&devices)).unwrap();
    let load = LoadOptions {
        offload_folder: Some(folder.path().to_path_buf()),
        ..LoadOptions::default()
    };
    load_checkpoint_in_model(&model, &ckpt, Some(&map), &load).unwrap();
    let options = DispatchOptions {
        offload_dir: Some(folder.path().to_path_buf()),
        ..DispatchOptions::default()
    };
    dispatch_model(&model, &map, &options).unwrap();
    let gpu = devices.gpu(0).unwrap();
    assert_eq!(gpu.live_bytes(), resident);
    let err = model.enter("1", Activations::default()).unwrap_err();
    match &err {
        Error::OutOfDeviceMemory {
            what, device, free, ..
        } => {
            assert_eq!(what, "1.weight");
            assert_eq!(*device, Device::Gpu(0));
            assert_eq!(*free, 100);
        }
        other => panic!("expected OutOfDeviceMemory, got {other:?}"),
    }
    assert_eq!(model.materialised(), (0, 0));
    assert_eq!(
        gpu.live_bytes(),
        resident,
        "nothing of the failed block stays"
    );
}
