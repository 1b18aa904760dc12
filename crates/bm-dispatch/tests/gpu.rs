//! The GPU data path on a CUDA GPU: casts at load run on the GPU and equal
//! the host's bit for bit, streamed weights are ready for the kernels of
//! the forward that takes them, and an out-of-memory load is typed and
//! frees everything. Run for real on a GPU machine through `cargo xtask
//! gpu-bundle`; without a GPU each test prints "skipped: no CUDA device"
//! and returns, unless `BM_GPU_TESTS=1`, which makes that a failure.

mod common;

use std::sync::Arc;

use bm_device::{DeviceBuffer, DeviceSet, Gpu};
use bm_dispatch::{
    Activations, DispatchOptions, Error, GPU_CAST_CHUNK, LoadOptions, Model, ModelBuilder,
    dispatch_model, load_checkpoint_in_model,
};
use bm_plan::{DeviceMap, ModuleTree};
use bm_shard::Checkpoint;
use bm_tensor::DType;
use common::write_safetensors;

fn cuda() -> Option<Arc<DeviceSet>> {
    DeviceSet::cuda_for_gpu_tests().map(Arc::new)
}

fn upload(gpu: &Gpu, bytes: &[u8]) -> DeviceBuffer {
    let mut buf = gpu.alloc(bytes.len()).unwrap();
    buf.copy_from_host(0, bytes).unwrap();
    buf
}

fn download(buf: &DeviceBuffer) -> Vec<u8> {
    let mut out = vec![0u8; buf.len()];
    buf.copy_to_host(0, &mut out).unwrap();
    out
}

/// F32 bit patterns that exercise every rounding and NaN rule: zeros,
/// infinities, the largest finite values, halfway cases of both half
/// types, F16 and F32 subnormals, quiet and signalling NaNs with payloads
/// of either sign, then pseudo-random patterns.
fn f32_patterns() -> Vec<u32> {
    let mut v = vec![
        0x0000_0000,
        0x8000_0000,
        0x7f80_0000,
        0xff80_0000,
        0x7f7f_ffff,
        0xff7f_ffff,
        0x3f80_8000, // 1 + 2^-8: bf16 tie, to even (down)
        0x3f81_8000, // bf16 tie, to even (up)
        0x3f80_1000, // 1 + 2^-11: f16 tie, to even (down)
        0x3f80_3000, // f16 tie, to even (up)
        0x477f_f000, // 65520: rounds to f16 infinity
        0x477f_efff, // just below: 65504
        0x3380_0000, // 2^-24: smallest f16 subnormal
        0x3300_0000, // 2^-25: ties to zero
        0x3300_0001, // just above: rounds up to 2^-24
        0x0000_0001, // smallest f32 subnormal
        0x807f_ffff, // largest negative f32 subnormal
        0x7fc0_0000,
        0xffc0_0000,
        0x7f80_0001, // signalling NaN, low payload
        0x7fa0_0000, // signalling NaN, high payload
        0xffbf_ffff,
        0x7fff_ffff,
    ];
    let mut x = 0x9e37_79b9u32;
    for _ in 0..100_000 {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        v.push(x);
    }
    v
}

#[test]
fn exact_casts_equal_the_host_cast_bit_for_bit() {
    let Some(set) = cuda() else { return };
    let gpu = set.gpu(0).unwrap();
    let all_u16: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
    let f32s: Vec<u8> = f32_patterns()
        .into_iter()
        .flat_map(u32::to_le_bytes)
        .collect();
    let types = [DType::F32, DType::F16, DType::BF16];
    for from in types {
        for to in types {
            if from == to {
                continue;
            }
            let src = if from == DType::F32 { &f32s } else { &all_u16 };
            let count = src.len() / from.size_in_bytes();
            let want = bm_tensor::cast(src, from, to).unwrap();
            let s = upload(gpu, src);
            let mut d = gpu.alloc(count * to.size_in_bytes()).unwrap();
            gpu.cast_exact(&s, from, &mut d, to, count, 0).unwrap();
            let got = download(&d);
            let first_difference = got
                .chunks(to.size_in_bytes())
                .zip(want.as_bytes().chunks(to.size_in_bytes()))
                .position(|(a, b)| a != b);
            assert_eq!(first_difference, None, "{from} -> {to}");
        }
    }
}

/// A model of one module holding `big` (more than two GPU cast chunks of
/// F32) and `small`, declared in `dtype`.
fn two_tensor_tree(big: usize, dtype: DType) -> ModuleTree {
    let mut b = ModelBuilder::new("Pair");
    let m = b.module(ModelBuilder::ROOT, "m", "Pair").unwrap();
    b.param(m, "big", dtype, &[big]).unwrap();
    b.param(m, "small", dtype, &[3]).unwrap();
    b.build().unwrap()
}

#[test]
fn a_checkpoint_cast_on_the_gpu_equals_the_host_load() {
    let Some(set) = cuda() else { return };
    let big = 2 * GPU_CAST_CHUNK / 4 + 12_345;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let patterns = f32_patterns();
    let values: Vec<f32> = (0..big)
        .map(|i| f32::from_bits(patterns[i % patterns.len()]))
        .collect();
    write_safetensors(
        &path,
        &[
            ("m.big".into(), vec![big], values),
            ("m.small".into(), vec![3], vec![1.0, f32::NAN, -0.0]),
        ],
    );
    let ckpt = Checkpoint::open(&path).unwrap();
    for dtype in [DType::BF16, DType::F16] {
        let options = LoadOptions {
            dtype: Some(dtype),
            ..LoadOptions::default()
        };
        let host = Model::empty(
            two_tensor_tree(big, DType::F32),
            Arc::new(DeviceSet::cpu_only()),
        )
        .unwrap();
        load_checkpoint_in_model(&host, &ckpt, None, &options).unwrap();
        let on_gpu = Model::empty(two_tensor_tree(big, DType::F32), Arc::clone(&set)).unwrap();
        let map = DeviceMap::from_json(&serde_json::json!({"": 0})).unwrap();
        load_checkpoint_in_model(&on_gpu, &ckpt, Some(&map), &options).unwrap();
        for name in ["m.big", "m.small"] {
            let want = host.weight(name).unwrap();
            let got = on_gpu.weight(name).unwrap();
            assert_eq!(got.meta, want.meta, "{name}");
            assert!(
                got.bytes.to_host().unwrap() == want.bytes.to_host().unwrap(),
                "{name} cast to {dtype} on the GPU differs from the host cast"
            );
        }
    }
    assert_eq!(set.gpu(0).unwrap().live_bytes(), 0);
}

#[test]
fn streamed_weights_are_ready_for_the_kernels_of_the_forward_that_takes_them() {
    let Some(set) = cuda() else { return };
    let gpu = set.gpu(0).unwrap().clone();
    // Eight CPU-offloaded layers of 32 MiB: big enough that a kernel
    // enqueued without waiting for its weight's copy would read it early.
    let (layers, elems) = (8, 8 << 20);
    let mut b = ModelBuilder::new("Stack");
    for l in 0..layers {
        let m = b
            .module(ModelBuilder::ROOT, &l.to_string(), "Layer")
            .unwrap();
        b.param(m, "w", DType::F32, &[elems]).unwrap();
    }
    let tree = b.build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let tensors: Vec<_> = (0..layers)
        .map(|l| {
            let v: Vec<f32> = (0..elems).map(|i| (i % 977) as f32 + l as f32).collect();
            (format!("{l}.w"), vec![elems], v)
        })
        .collect();
    write_safetensors(&path, &tensors);
    let ckpt = Checkpoint::open(&path).unwrap();
    let model = Model::empty(tree, Arc::clone(&set)).unwrap();
    let entries: serde_json::Map<String, serde_json::Value> = (0..layers)
        .map(|l| (l.to_string(), serde_json::json!("cpu")))
        .collect();
    let map = DeviceMap::from_json(&serde_json::Value::Object(entries)).unwrap();
    load_checkpoint_in_model(&model, &ckpt, Some(&map), &LoadOptions::default()).unwrap();
    let options = DispatchOptions {
        main_device: Some(bm_device::Device::Gpu(0)),
        force_hooks: true,
        ..DispatchOptions::default()
    };
    dispatch_model(&model, &map, &options).unwrap();
    for _ in 0..3 {
        for (l, (_, _, values)) in tensors.iter().enumerate() {
            let mut g = model.enter(&l.to_string(), Activations::default()).unwrap();
            let w = g.weight("w").unwrap();
            let bm_dispatch::Bytes::Device(buf) = w.bytes.as_ref() else {
                panic!("layer {l}: the weight is not on the GPU");
            };
            // A kernel on the compute stream reads the weight.
            let mut out = gpu.alloc(elems * 4).unwrap();
            gpu.cast(buf, DType::F32, &mut out, DType::F32, elems, 0)
                .unwrap();
            let got = download(&out);
            let want: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            assert!(got == want, "layer {l}: the kernel read the weight early");
            drop(w);
            g.exit(Activations::default()).unwrap();
        }
    }
}

#[test]
fn out_of_memory_mid_load_on_a_gpu_is_typed_and_frees_everything() {
    let Some(set) = cuda() else { return };
    let gpu = set.gpu(0).unwrap();
    let big = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    write_safetensors(
        &path,
        &[
            ("m.big".into(), vec![big], vec![1.0; big]),
            ("m.small".into(), vec![3], vec![1.0; 3]),
        ],
    );
    let ckpt = Checkpoint::open(&path).unwrap();
    let budget = gpu.budget();
    let before = gpu.live_bytes();
    gpu.set_budget(before + (big as u64) * 2).unwrap();
    let model = Model::empty(two_tensor_tree(big, DType::F32), Arc::clone(&set)).unwrap();
    let map = DeviceMap::from_json(&serde_json::json!({"": 0})).unwrap();
    let err =
        load_checkpoint_in_model(&model, &ckpt, Some(&map), &LoadOptions::default()).unwrap_err();
    gpu.set_budget(budget).unwrap();
    match &err {
        Error::OutOfDeviceMemory { what, free, .. } => {
            assert_eq!(what, "m.big");
            assert_eq!(*free, (big as u64) * 2);
        }
        other => panic!("expected OutOfDeviceMemory, got {other:?}"),
    }
    assert_eq!(gpu.live_bytes(), before);
}
