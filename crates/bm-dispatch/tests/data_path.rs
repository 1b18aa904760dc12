//! The GPU data path on emulated GPUs: out-of-memory errors while loading
//! and streaming are typed and leave the accounting where it was, and with
//! a simulated link the transfers of offloaded blocks hide behind the
//! compute of the blocks before them.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bm_device::{Device, DeviceSet, SimulatedLink};
use bm_dispatch::{
    Activations, DispatchOptions, Error, LoadOptions, Model, ModelBuilder, dispatch_model,
    load_checkpoint_in_model,
};
use bm_plan::DeviceMap;
use bm_shard::Checkpoint;
use bm_tensor::DType;
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

// ---- overlap of transfers with compute (acceptance 8) ----

/// Blocks of the overlap model, and the bytes of each one's weight.
const OVERLAP_BLOCKS: usize = 24;
const OVERLAP_BYTES: usize = 1 << 20;
/// Emulated compute time of a block; the simulated link moves one block's
/// weight in the same time.
const OVERLAP_COMPUTE: Duration = Duration::from_millis(8);

/// `OVERLAP_BLOCKS` modules of one F32 weight each, every one offloaded to
/// the CPU and computed on emulated GPU 0 behind a simulated link, with
/// `prefetch_depth`.
fn overlap_model(dir: &std::path::Path, prefetch_depth: usize) -> Model {
    let elems = OVERLAP_BYTES / 4;
    let mut b = ModelBuilder::new("Stack");
    for l in 0..OVERLAP_BLOCKS {
        let m = b
            .module(ModelBuilder::ROOT, &l.to_string(), "Block")
            .unwrap();
        b.param(m, "w", DType::F32, &[elems]).unwrap();
    }
    let tree = b.build().unwrap();
    let path = dir.join("model.safetensors");
    if !path.exists() {
        let tensors: Vec<_> = (0..OVERLAP_BLOCKS)
            .map(|l| (format!("{l}.w"), vec![elems], values(l as u32, elems)))
            .collect();
        write_safetensors(&path, &tensors);
    }
    let link = SimulatedLink {
        bytes_per_second: OVERLAP_BYTES as f64 / OVERLAP_COMPUTE.as_secs_f64(),
        latency: Duration::ZERO,
    };
    let devices = Arc::new(DeviceSet::emulated_with_link(&[1 << 30], link));
    let model = Model::empty(tree, devices).unwrap();
    let entries: serde_json::Map<String, serde_json::Value> = (0..OVERLAP_BLOCKS)
        .map(|l| (l.to_string(), serde_json::json!("cpu")))
        .collect();
    let map = DeviceMap::from_json(&serde_json::Value::Object(entries)).unwrap();
    let ckpt = Checkpoint::open(&path).unwrap();
    load_checkpoint_in_model(&model, &ckpt, Some(&map), &LoadOptions::default()).unwrap();
    let options = DispatchOptions {
        main_device: Some(Device::Gpu(0)),
        force_hooks: true,
        prefetch_depth,
        ..DispatchOptions::default()
    };
    dispatch_model(&model, &map, &options).unwrap();
    model
}

/// Where the time of one "token" went.
#[derive(Clone, Copy, Debug)]
struct Token {
    total: Duration,
    /// Waiting for weights: entering a block and taking its weight.
    waiting: Duration,
    /// Running the blocks' compute.
    computing: Duration,
}

/// One "token": every block entered, its weight taken, its compute run on
/// the GPU's compute stream, exited.
fn overlap_token(model: &Model) -> Token {
    let gpu = model.devices().gpu(0).unwrap().clone();
    let (mut waiting, mut computing) = (Duration::ZERO, Duration::ZERO);
    let start = Instant::now();
    for l in 0..OVERLAP_BLOCKS {
        let t = Instant::now();
        let mut g = model.enter(&l.to_string(), Activations::default()).unwrap();
        let w = g.weight("w").unwrap();
        assert_eq!(w.device(), Device::Gpu(0));
        waiting += t.elapsed();
        let t = Instant::now();
        gpu.compute_stream().busy_wait(OVERLAP_COMPUTE).unwrap();
        gpu.compute_stream().synchronize().unwrap();
        computing += t.elapsed();
        drop(w);
        g.exit(Activations::default()).unwrap();
    }
    Token {
        total: start.elapsed(),
        waiting,
        computing,
    }
}

/// A few tokens, after a warm-up one.
fn tokens(model: &Model) -> Vec<Token> {
    overlap_token(model);
    (0..4).map(|_| overlap_token(model)).collect()
}

#[test]
fn prefetch_overlaps_each_blocks_transfer_with_the_previous_blocks_compute() {
    let dir = tempfile::tempdir().unwrap();
    // Without prefetch nothing overlaps: a token is its transfers, then
    // its compute, block after block, so the serial run measures the total
    // transfer time as this machine delivers it.
    let serial = tokens(&overlap_model(dir.path(), 0));
    let ideal = OVERLAP_COMPUTE * OVERLAP_BLOCKS as u32;
    for t in &serial {
        assert!(
            t.total >= (ideal * 2).mul_f64(0.95),
            "without prefetch a token took {:?}, less than transfer + compute ({:?})",
            t.total,
            ideal * 2
        );
    }
    let transfer = serial.iter().map(|t| t.waiting).min().unwrap();
    // With prefetch only the first block's transfer has nothing to hide
    // behind: ideally (blocks + 1) / blocks = 1.04 of the larger total.
    // Each token is measured against its own compute (sleeps overshoot on
    // a busy machine), and the least disturbed token counts.
    let overlapped = tokens(&overlap_model(dir.path(), 1));
    let (ratio, best) = overlapped
        .iter()
        .map(|t| {
            (
                t.total.as_secs_f64() / transfer.max(t.computing).as_secs_f64(),
                t,
            )
        })
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .unwrap();
    assert!(
        ratio <= 1.15,
        "with prefetch a token took {:?}: {ratio:.2} x max(transfer {transfer:?}, compute {:?}); \
         without prefetch, {:?}",
        best.total,
        best.computing,
        serial[0].total
    );
}
