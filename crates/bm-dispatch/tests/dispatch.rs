//! Dispatched forwards equal the all-in-memory forward bit for bit, for
//! every placement; hooks, ties, threads and bad input.

mod common;

use std::sync::Arc;

use bm_device::{Device, DeviceSet};
use bm_dispatch::{
    AlignDevicesHook, DispatchOptions, Error, LoadOptions, Model, ModelHook, Placement, Tier,
    cpu_offload, cpu_offload_with_hook, disk_offload, dispatch_model, load_checkpoint_in_model,
};
use bm_plan::DeviceMap;
use bm_shard::Checkpoint;
use bm_tensor::DType;
use common::*;

fn map(json: serde_json::Value) -> DeviceMap {
    DeviceMap::from_json(&json).unwrap()
}

fn reference(ckpt: &Checkpoint, dtype: Option<DType>) -> Vec<u32> {
    let model = Model::empty(tree(), Arc::new(DeviceSet::cpu_only())).unwrap();
    let options = LoadOptions {
        dtype,
        ..LoadOptions::default()
    };
    load_checkpoint_in_model(&model, ckpt, None, &options).unwrap();
    bits(&forward(&model, &input()))
}

fn dispatched(
    devices: DeviceSet,
    ckpt: &Checkpoint,
    device_map: &DeviceMap,
    folder: &std::path::Path,
    dtype: Option<DType>,
) -> Model {
    let model = Model::empty(tree(), Arc::new(devices)).unwrap();
    let load = LoadOptions {
        dtype,
        offload_folder: Some(folder.to_path_buf()),
        ..LoadOptions::default()
    };
    load_checkpoint_in_model(&model, ckpt, Some(device_map), &load).unwrap();
    let options = DispatchOptions {
        offload_dir: Some(folder.to_path_buf()),
        ..DispatchOptions::default()
    };
    dispatch_model(&model, device_map, &options).unwrap();
    model
}

fn placements() -> Vec<(&'static str, usize, serde_json::Value)> {
    vec![
        ("all on cpu", 0, serde_json::json!({"": "cpu"})),
        (
            "all on cpu, hooks forced",
            0,
            serde_json::json!({"0": "cpu", "1": "cpu", "2": "cpu", "3": "cpu", "bn": "cpu", "head": "cpu"}),
        ),
        (
            "cpu + disk",
            0,
            serde_json::json!({"0": "cpu", "1": "disk", "2": "cpu", "3": "disk", "bn": "disk", "head": "cpu"}),
        ),
        ("all on disk", 0, serde_json::json!({"": "disk"})),
        (
            "two emulated gpus",
            2,
            serde_json::json!({"0": 0, "1": 1, "2": 1, "3": 0, "bn": 1, "head": 0}),
        ),
        (
            "emulated gpus + cpu + disk",
            2,
            serde_json::json!({"0": 0, "1": "cpu", "2": "disk", "3": 1, "bn": "disk", "head": "cpu"}),
        ),
    ]
}

#[test]
fn every_placement_matches_the_in_memory_forward_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = Checkpoint::open(write_checkpoint(dir.path())).unwrap();
    for dtype in [None, Some(DType::BF16)] {
        let expected = reference(&ckpt, dtype);
        for (what, gpus, m) in placements() {
            let folder = tempfile::tempdir().unwrap();
            let devices = DeviceSet::emulated(&vec![1 << 20; gpus]);
            let model = dispatched(devices, &ckpt, &map(m.clone()), folder.path(), dtype);
            for _ in 0..2 {
                assert_eq!(
                    bits(&forward(&model, &input())),
                    expected,
                    "{what}, {dtype:?}"
                );
            }
            assert_eq!(model.hf_device_map(), Some(map(m)), "{what}");
            assert!(model.shares_storage("0.weight", "head.weight").unwrap());
        }
    }
}

#[test]
fn offloaded_weights_go_where_the_map_says() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = Checkpoint::open(write_checkpoint(dir.path())).unwrap();
    let folder = tempfile::tempdir().unwrap();
    let m = map(
        serde_json::json!({"0": 0, "1": "cpu", "2": "disk", "3": 1, "bn": "disk", "head": "cpu"}),
    );
    let model = dispatched(
        DeviceSet::emulated(&[1 << 20, 1 << 20]),
        &ckpt,
        &m,
        folder.path(),
        Some(DType::BF16),
    );
    assert_eq!(
        model.placement("0.weight").unwrap(),
        Placement::Resident(Device::Gpu(0))
    );
    assert_eq!(
        model.placement("1.weight").unwrap(),
        Placement::Offloaded(Tier::Cpu)
    );
    assert_eq!(
        model.placement("2.bias").unwrap(),
        Placement::Offloaded(Tier::Disk)
    );
    // Buffers of a disk module stay on the main device, with checkpoint values.
    assert_eq!(
        model.placement("bn.running_mean").unwrap(),
        Placement::Resident(Device::Gpu(0))
    );
    // Cast weights were rewritten in Accelerate's format: .dat + index.
    assert!(folder.path().join("2.weight.dat").is_file());
    let index = std::fs::read_to_string(folder.path().join("index.json")).unwrap();
    assert!(
        index.contains("\"2.weight\": {\n    \"dtype\": \"bfloat16\""),
        "{index}"
    );
    let err = model.to(Device::Cpu).unwrap_err();
    assert_eq!(
        err.to_string(),
        "You can't move a model that has some modules offloaded to cpu or disk."
    );
}

#[test]
fn disk_weights_run_from_the_checkpoint_mapping_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = Checkpoint::open(write_checkpoint(dir.path())).unwrap();
    let folder = tempfile::tempdir().unwrap();
    let model = Model::empty(tree(), Arc::new(DeviceSet::cpu_only())).unwrap();
    let m = map(serde_json::json!({"": "disk"}));
    let load = LoadOptions {
        offload_folder: Some(folder.path().to_path_buf()),
        ..LoadOptions::default()
    };
    let report = load_checkpoint_in_model(&model, &ckpt, Some(&m), &load).unwrap();
    assert!(report.written_to_folder.is_empty(), "{report:?}");
    assert!(report.mapped_in_place.contains(&"1.weight".to_string()));
    let index = std::fs::read_to_string(folder.path().join("index.json")).unwrap();
    assert!(index.contains("safetensors_file"), "{index}");
    let options = DispatchOptions {
        offload_dir: Some(folder.path().to_path_buf()),
        ..DispatchOptions::default()
    };
    dispatch_model(&model, &m, &options).unwrap();
    let mut g = model
        .enter("1", bm_dispatch::Activations::default())
        .unwrap();
    let w = g.weight("weight").unwrap();
    assert!(w.bytes.is_mapped(), "used from the mmap without a copy");
    drop(g);
}

#[test]
fn next_block_is_prefetched_while_one_computes() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = Checkpoint::open(write_checkpoint(dir.path())).unwrap();
    let folder = tempfile::tempdir().unwrap();
    let m =
        map(serde_json::json!({"0": 0, "1": "cpu", "2": "cpu", "3": "cpu", "bn": 0, "head": 0}));
    let model = dispatched(
        DeviceSet::emulated(&[1 << 20]),
        &ckpt,
        &m,
        folder.path(),
        None,
    );
    let g = model
        .enter("1", bm_dispatch::Activations::default())
        .unwrap();
    // Block 1's two tensors are held; block 2's arrive from the worker.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while model.materialised().0 < 4 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(model.materialised().0, 4);
    g.exit(bm_dispatch::Activations::default()).unwrap();
    // Block 1 released; block 2 waits, prefetched, for its forward.
    assert_eq!(model.materialised().0, 2);
    // With a resident budget, offloaded weights stay across calls.
    model.set_resident_budget(1 << 20);
    forward(&model, &input());
    let (_, bytes) = model.materialised();
    assert_eq!(bytes, 3 * (WIDTH * WIDTH + WIDTH) as u64 * 4);
    model.set_resident_budget(0);
    assert_eq!(model.materialised().0, 0);
}

#[test]
fn a_gpu_with_room_for_one_streamed_block_never_runs_out() {
    // Regression: the prefetch of the next block used to be started before
    // the running block loaded its own weights, and could take their room.
    let dir = tempfile::tempdir().unwrap();
    let ckpt = Checkpoint::open(write_checkpoint(dir.path())).unwrap();
    let expected = reference(&ckpt, None);
    let m =
        map(serde_json::json!({"0": 0, "1": "cpu", "2": "cpu", "3": "cpu", "bn": 0, "head": 0}));
    let resident = {
        let folder = tempfile::tempdir().unwrap();
        let model = dispatched(
            DeviceSet::emulated(&[1 << 20]),
            &ckpt,
            &m,
            folder.path(),
            None,
        );
        model.devices().gpu(0).unwrap().live_bytes()
    };
    let block = (WIDTH * WIDTH + WIDTH) as u64 * 4;
    let activations = 4 * WIDTH as u64 * 4;
    let folder = tempfile::tempdir().unwrap();
    let model = dispatched(
        DeviceSet::emulated(&[resident + block + activations]),
        &ckpt,
        &m,
        folder.path(),
        None,
    );
    for _ in 0..50 {
        assert_eq!(bits(&forward(&model, &input())), expected);
    }
}

#[test]
fn loading_reports_progress_up_to_the_checkpoint_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = Checkpoint::open(write_checkpoint(dir.path())).unwrap();
    let folder = tempfile::tempdir().unwrap();
    let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = Arc::clone(&calls);
    let model = Model::empty(tree(), Arc::new(DeviceSet::cpu_only())).unwrap();
    let load = LoadOptions {
        offload_folder: Some(folder.path().to_path_buf()),
        progress: Some(bm_dispatch::LoadProgress(Arc::new(move |done, total| {
            seen.lock().unwrap().push((done, total))
        }))),
        ..LoadOptions::default()
    };
    let m = map(
        serde_json::json!({"0": "cpu", "1": "disk", "2": "cpu", "3": "disk", "bn": "cpu", "head": "cpu"}),
    );
    load_checkpoint_in_model(&model, &ckpt, Some(&m), &load).unwrap();
    let calls = calls.lock().unwrap();
    let total = ckpt.total_bytes();
    assert!(calls.len() > 2, "{calls:?}");
    assert!(calls.iter().all(|&(_, t)| t == total), "{calls:?}");
    assert!(calls.windows(2).all(|w| w[0].0 <= w[1].0), "{calls:?}");
    assert_eq!(*calls.last().unwrap(), (total, total));
}

#[test]
fn threads_running_one_model_get_identical_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = Checkpoint::open(write_checkpoint(dir.path())).unwrap();
    let expected = reference(&ckpt, None);
    let folder = tempfile::tempdir().unwrap();
    let m = map(
        serde_json::json!({"0": 0, "1": "cpu", "2": "disk", "3": 1, "bn": "disk", "head": "cpu"}),
    );
    let model = dispatched(
        DeviceSet::emulated(&[1 << 20, 1 << 20]),
        &ckpt,
        &m,
        folder.path(),
        None,
    );
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    (0..10)
                        .map(|_| bits(&forward(&model, &input())))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for h in handles {
            for out in h.join().unwrap() {
                assert_eq!(out, expected);
            }
        }
    });
}

#[test]
fn removing_hooks_restores_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = Checkpoint::open(write_checkpoint(dir.path())).unwrap();
    let expected = reference(&ckpt, None);
    let folder = tempfile::tempdir().unwrap();
    let m = map(
        serde_json::json!({"0": "cpu", "1": "disk", "2": "disk", "3": "cpu", "bn": "disk", "head": "cpu"}),
    );
    let model = dispatched(DeviceSet::cpu_only(), &ckpt, &m, folder.path(), None);
    assert!(model.hook("1").unwrap().is_some());
    model.remove_hook("", true).unwrap();
    assert!(model.hook("1").unwrap().is_none());
    assert_eq!(model.hf_device_map(), None);
    for name in ["1.weight", "2.bias", "head.weight"] {
        assert_eq!(
            model.placement(name).unwrap(),
            Placement::Resident(Device::Cpu),
            "{name}"
        );
    }
    assert_eq!(bits(&forward(&model, &input())), expected);
    model.to(Device::Cpu).unwrap();
}

#[test]
fn cpu_and_disk_offload_match_with_and_without_buffers_and_preload() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = Checkpoint::open(write_checkpoint(dir.path())).unwrap();
    let expected = reference(&ckpt, None);
    for offload_buffers in [false, true] {
        for preload in [vec![], vec!["Linear".to_string()]] {
            let options = DispatchOptions {
                offload_buffers,
                preload_module_classes: preload.clone(),
                ..DispatchOptions::default()
            };
            let devices = Arc::new(DeviceSet::emulated(&[1 << 20]));
            let model = Model::empty(tree(), Arc::clone(&devices)).unwrap();
            load_checkpoint_in_model(&model, &ckpt, None, &LoadOptions::default()).unwrap();
            cpu_offload(&model, Device::Gpu(0), &options).unwrap();
            assert_eq!(
                model.placement("2.weight").unwrap(),
                Placement::Offloaded(Tier::Cpu)
            );
            assert_eq!(
                bits(&forward(&model, &input())),
                expected,
                "cpu_offload {offload_buffers} {preload:?}"
            );

            let folder = tempfile::tempdir().unwrap();
            let model = Model::empty(tree(), devices).unwrap();
            load_checkpoint_in_model(&model, &ckpt, None, &LoadOptions::default()).unwrap();
            disk_offload(&model, folder.path(), Device::Gpu(0), &options).unwrap();
            assert_eq!(
                model.placement("2.weight").unwrap(),
                Placement::Offloaded(Tier::Disk)
            );
            assert!(folder.path().join("3.bias.dat").is_file());
            assert_eq!(
                bits(&forward(&model, &input())),
                expected,
                "disk_offload {offload_buffers} {preload:?}"
            );
        }
    }
}

#[test]
fn hooks_append_replace_and_chain_like_accelerate() {
    let model = Model::empty(tree(), Arc::new(DeviceSet::cpu_only())).unwrap();
    let hook = || Arc::new(AlignDevicesHook::default()) as Arc<dyn ModelHook>;
    let (first, second, third) = (hook(), hook(), hook());
    model.add_hook("1", Arc::clone(&first), false).unwrap();
    model.add_hook("1", Arc::clone(&second), true).unwrap();
    let h = model.hook("1").unwrap().unwrap();
    let chain = h.children().expect("appending makes a SequentialHook");
    assert_eq!(chain.len(), 2);
    assert!(Arc::ptr_eq(&chain[0], &first) && Arc::ptr_eq(&chain[1], &second));
    model.add_hook("1", Arc::clone(&third), false).unwrap();
    let h = model.hook("1").unwrap().unwrap();
    assert!(h.children().is_none() && Arc::ptr_eq(&h, &third));

    // cpu_offload_with_hook: model1 moves to the GPU at its forward, and
    // back to the CPU when model2 (chained) starts.
    let dir = tempfile::tempdir().unwrap();
    let ckpt = Checkpoint::open(write_checkpoint(dir.path())).unwrap();
    let expected = reference(&ckpt, None);
    let devices = Arc::new(DeviceSet::emulated(&[1 << 20]));
    let load = |d: &Arc<DeviceSet>| {
        let m = Arc::new(Model::empty(tree(), Arc::clone(d)).unwrap());
        load_checkpoint_in_model(&m, &ckpt, None, &LoadOptions::default()).unwrap();
        m
    };
    let (m1, m2) = (load(&devices), load(&devices));
    let h1 = cpu_offload_with_hook(Arc::clone(&m1), Device::Gpu(0), None).unwrap();
    assert_eq!(m1.first_param_device(), Some(Device::Cpu));
    let (out, device) = forward_anywhere(&m1, &input());
    assert_eq!(
        (bits(&out), device),
        (expected.clone(), Some(Device::Gpu(0)))
    );
    assert_eq!(m1.first_param_device(), Some(Device::Gpu(0)));
    h1.offload().unwrap();
    assert_eq!(m1.first_param_device(), Some(Device::Cpu));
    let h2 = cpu_offload_with_hook(Arc::clone(&m2), Device::Gpu(0), Some(h1)).unwrap();
    forward_anywhere(&m1, &input());
    assert_eq!(bits(&forward_anywhere(&m2, &input()).0), expected);
    assert_eq!(m1.first_param_device(), Some(Device::Cpu));
    assert_eq!(m2.first_param_device(), Some(Device::Gpu(0)));
    h2.offload().unwrap();
    assert_eq!(m2.first_param_device(), Some(Device::Cpu));
}

// ---- bad input ----

fn load_err(
    devices: DeviceSet,
    m: serde_json::Value,
    folder: Option<&std::path::Path>,
) -> (Error, Model) {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = Checkpoint::open(write_checkpoint(dir.path())).unwrap();
    let model = Model::empty(tree(), Arc::new(devices)).unwrap();
    let load = LoadOptions {
        offload_folder: folder.map(|f| f.to_path_buf()),
        ..LoadOptions::default()
    };
    let err = load_checkpoint_in_model(&model, &ckpt, Some(&map(m)), &load).unwrap_err();
    (err, model)
}

#[test]
fn a_map_that_misses_tensors_or_names_unknown_modules_is_refused() {
    let (err, _) = load_err(
        DeviceSet::cpu_only(),
        serde_json::json!({"0": "cpu", "1": "cpu", "2": "cpu", "3": "cpu", "head": "cpu"}),
        None,
    );
    assert_eq!(
        err.to_string(),
        "The device_map provided does not give any device for the following parameters: bn.running_mean"
    );
    let (err, _) = load_err(
        DeviceSet::cpu_only(),
        serde_json::json!({"": "cpu", "encoder": "cpu"}),
        None,
    );
    assert!(
        err.to_string()
            .contains("\"encoder\" does not match any module"),
        "{err}"
    );
    let (err, _) = load_err(DeviceSet::cpu_only(), serde_json::json!({"": 3}), None);
    assert!(
        err.to_string()
            .contains("device 3 is not in the device set"),
        "{err}"
    );
}

#[test]
fn disk_without_an_offload_folder_is_refused() {
    let (err, _) = load_err(
        DeviceSet::cpu_only(),
        serde_json::json!({"": "cpu", "2": "disk"}),
        None,
    );
    assert!(
        err.to_string().starts_with("At least one of the model submodule will be offloaded to disk, please pass along an `offload_folder`."),
        "{err}"
    );
    let model = Model::empty(tree(), Arc::new(DeviceSet::cpu_only())).unwrap();
    let err = dispatch_model(
        &model,
        &map(serde_json::json!({"": "cpu", "2": "disk"})),
        &DispatchOptions::default(),
    )
    .unwrap_err();
    assert!(matches!(err, Error::NoOffloadFolder { .. }), "{err}");
}

#[test]
fn an_offload_folder_that_does_not_match_the_model_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = Checkpoint::open(write_checkpoint(dir.path())).unwrap();
    let folder = tempfile::tempdir().unwrap();
    let meta = bm_tensor::TensorMeta::new(DType::F32, [2]);
    let entry =
        bm_shard::offload::offload_weight(folder.path(), "0.weight", &meta, &[0u8; 8]).unwrap();
    bm_shard::offload::save_index(folder.path(), &[("0.weight".to_string(), entry)]).unwrap();
    let model = Model::empty(tree(), Arc::new(DeviceSet::cpu_only())).unwrap();
    load_checkpoint_in_model(&model, &ckpt, None, &LoadOptions::default()).unwrap();
    let err = disk_offload(
        &model,
        folder.path(),
        Device::Cpu,
        &DispatchOptions::default(),
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("0.weight is F32 [2] there, the model holds F32 [16, 16]"),
        "{err}"
    );
}

#[test]
fn shape_mismatch_uses_accelerates_message() {
    let dir = tempfile::tempdir().unwrap();
    let mut tensors = checkpoint_tensors();
    tensors[1] = ("0.bias".into(), vec![WIDTH + 1], values(1, WIDTH + 1));
    write_safetensors(&dir.path().join("model.safetensors"), &tensors);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let model = Model::empty(tree(), Arc::new(DeviceSet::cpu_only())).unwrap();
    let err = load_checkpoint_in_model(&model, &ckpt, None, &LoadOptions::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "Trying to set a tensor of shape torch.Size([17]) in \"bias\" (which has shape torch.Size([16])), this looks incorrect. (tensor 0.bias)"
    );
}

#[test]
fn gpu_out_of_memory_mid_load_names_the_tensor_and_releases_everything() {
    let capacity = 3 * (WIDTH * WIDTH + WIDTH) as u64 * 4;
    let devices = DeviceSet::emulated(&[capacity]);
    let (err, model) = load_err(devices, serde_json::json!({"": 0}), None);
    let text = err.to_string();
    assert!(text.contains("3.weight on GPU 0"), "{text}");
    assert_eq!(model.devices().gpu(0).unwrap().live_bytes(), 0);
    assert_eq!(model.placement("0.weight").unwrap(), Placement::Meta);
}

#[test]
fn a_failed_offload_write_leaves_no_index() {
    let folder = tempfile::tempdir().unwrap();
    // A folder where 3.weight.dat goes: the write fails as a full disk
    // would, half-way through the offload.
    std::fs::create_dir(folder.path().join("3.weight.dat")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ckpt = Checkpoint::open(write_checkpoint(dir.path())).unwrap();
    let model = Model::empty(tree(), Arc::new(DeviceSet::cpu_only())).unwrap();
    let load = LoadOptions {
        dtype: Some(DType::F16),
        offload_folder: Some(folder.path().to_path_buf()),
        ..LoadOptions::default()
    };
    let err = load_checkpoint_in_model(
        &model,
        &ckpt,
        Some(&map(serde_json::json!({"": "disk"}))),
        &load,
    )
    .unwrap_err();
    assert!(err.to_string().contains("3.weight.dat"), "{err}");
    assert!(!folder.path().join("index.json").exists());
    // No temporary file is left behind.
    let hidden = std::fs::read_dir(folder.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with('.')
        })
        .count();
    assert_eq!(hidden, 0);
}

#[cfg(unix)]
#[test]
fn offload_writes_never_follow_a_planted_link() {
    let folder = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let victim = outside.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    // Links at the temporary name earlier versions used and at a final name.
    for name in [".3.weight.dat.tmp", "3.bias.dat"] {
        std::os::unix::fs::symlink(&victim, folder.path().join(name)).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let ckpt = Checkpoint::open(write_checkpoint(dir.path())).unwrap();
    let model = Model::empty(tree(), Arc::new(DeviceSet::cpu_only())).unwrap();
    let load = LoadOptions {
        dtype: Some(DType::F16),
        offload_folder: Some(folder.path().to_path_buf()),
        ..LoadOptions::default()
    };
    load_checkpoint_in_model(
        &model,
        &ckpt,
        Some(&map(serde_json::json!({"": "disk"}))),
        &load,
    )
    .unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    let bias = std::fs::symlink_metadata(folder.path().join("3.bias.dat")).unwrap();
    assert!(bias.is_file(), "the link was replaced by the written file");
}

#[test]
fn missing_and_unexpected_keys_are_reported_and_strict_refuses_them() {
    let dir = tempfile::tempdir().unwrap();
    let mut tensors = checkpoint_tensors();
    tensors.retain(|t| t.0 != "3.bias");
    tensors.push(("foo".into(), vec![1], vec![1.0]));
    write_safetensors(&dir.path().join("model.safetensors"), &tensors);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let model = Model::empty(tree(), Arc::new(DeviceSet::cpu_only())).unwrap();
    let report = load_checkpoint_in_model(&model, &ckpt, None, &LoadOptions::default()).unwrap();
    assert_eq!(report.missing, ["3.bias"]);
    assert_eq!(report.unexpected, ["foo"]);
    assert_eq!(model.placement("3.bias").unwrap(), Placement::Meta);
    let strict = LoadOptions {
        strict: true,
        ..LoadOptions::default()
    };
    let err = load_checkpoint_in_model(&model, &ckpt, None, &strict).unwrap_err();
    assert!(
        err.to_string()
            .contains("Missing key(s): 3.bias. Unexpected key(s): foo."),
        "{err}"
    );
}

#[test]
fn integers_are_never_cast_and_keep_in_fp32_modules_stay_f32() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = Checkpoint::open(write_checkpoint(dir.path())).unwrap();
    let model = Model::empty(tree(), Arc::new(DeviceSet::cpu_only())).unwrap();
    let options = LoadOptions {
        dtype: Some(DType::F16),
        keep_in_fp32_modules: vec!["bn".into(), "2".into()],
        ..LoadOptions::default()
    };
    load_checkpoint_in_model(&model, &ckpt, None, &options).unwrap();
    assert_eq!(model.weight("1.weight").unwrap().meta.dtype, DType::F16);
    assert_eq!(model.weight("2.weight").unwrap().meta.dtype, DType::F32);
    assert_eq!(
        model.weight("bn.running_mean").unwrap().meta.dtype,
        DType::F32
    );
    assert!(
        model.weight("2.weight").unwrap().bytes.is_mapped(),
        "no cast: zero-copy"
    );
}
