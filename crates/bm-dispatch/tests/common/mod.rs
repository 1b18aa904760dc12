//! A small deterministic model (an MLP with a buffer-holding module and a
//! tied head), its checkpoint, and its forward pass through the dispatch
//! protocol.
#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;

use bm_device::{Device, DeviceSet};
use bm_dispatch::{Activations, Bytes, Model, ModelBuilder, Tensor, tensor_to_device};
use bm_plan::ModuleTree;
use bm_tensor::{DType, HostBuffer, TensorMeta};

pub const WIDTH: usize = 16;
pub const LAYERS: usize = 4;

/// `Mlp`: `0..LAYERS` Linear(W, W), `bn` (persistent `running_mean`,
/// non-persistent `scratch`), `head` Linear(W, W, no bias) tied to `0.weight`.
pub fn tree() -> ModuleTree {
    let mut b = ModelBuilder::new("Mlp");
    for i in 0..LAYERS {
        b.linear(
            ModelBuilder::ROOT,
            &i.to_string(),
            WIDTH,
            WIDTH,
            true,
            DType::F32,
        )
        .unwrap();
    }
    let bn = b.module(ModelBuilder::ROOT, "bn", "Shift").unwrap();
    b.buffer(bn, "running_mean", DType::F32, &[WIDTH], true)
        .unwrap();
    b.buffer(bn, "scratch", DType::F32, &[WIDTH], false)
        .unwrap();
    b.linear(ModelBuilder::ROOT, "head", WIDTH, WIDTH, false, DType::F32)
        .unwrap();
    b.tie(&["0.weight", "head.weight"]);
    b.build().unwrap()
}

/// Deterministic pseudo-random values.
pub fn values(seed: u32, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(12345);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// Writes a safetensors file of F32 tensors.
pub fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape, vals) in tensors {
        let start = data.len();
        for v in vals {
            data.extend_from_slice(&v.to_le_bytes());
        }
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut text = serde_json::Value::Object(header).to_string();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(&data);
    std::fs::write(path, out).unwrap();
}

/// The model's checkpoint (the tied head stored once, as torch saves it).
pub fn checkpoint_tensors() -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut t = Vec::new();
    for i in 0..LAYERS {
        t.push((
            format!("{i}.weight"),
            vec![WIDTH, WIDTH],
            values(10 + i as u32, WIDTH * WIDTH),
        ));
        t.push((
            format!("{i}.bias"),
            vec![WIDTH],
            values(100 + i as u32, WIDTH),
        ));
    }
    t.push(("bn.running_mean".into(), vec![WIDTH], values(7, WIDTH)));
    t
}

pub fn write_checkpoint(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("model.safetensors");
    write_safetensors(&path, &checkpoint_tensors());
    path
}

/// f32 values of a weight or activation (F32 or BF16), wherever it is.
fn f32s(meta: &TensorMeta, bytes: &[u8]) -> Vec<f32> {
    let bytes = if meta.dtype == DType::F32 {
        bytes.to_vec()
    } else {
        bm_tensor::cast(bytes, meta.dtype, DType::F32)
            .unwrap()
            .as_bytes()
            .to_vec()
    };
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn weight_values(w: &bm_dispatch::Weight) -> Vec<f32> {
    f32s(&w.meta, &w.bytes.to_host().unwrap())
}

fn tensor_values(t: &Tensor) -> Vec<f32> {
    f32s(&t.meta, &t.bytes.as_ref().unwrap().to_host().unwrap())
}

fn tensor_on(values: &[f32], device: Device, devices: &DeviceSet) -> Tensor {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let t = Tensor::new(
        TensorMeta::new(DType::F32, [values.len()]),
        Bytes::Host(HostBuffer::from_bytes(&bytes).unwrap()),
    )
    .unwrap();
    tensor_to_device("test tensor", t, device, devices).unwrap()
}

/// `y = W x (+ b)`, accumulated in f32 in a fixed order.
fn linear(w: &[f32], b: Option<&[f32]>, x: &[f32]) -> Vec<f32> {
    (0..WIDTH)
        .map(|r| {
            let mut acc = b.map_or(0.0, |b| b[r]);
            for c in 0..WIDTH {
                acc += w[r * WIDTH + c] * x[c];
            }
            acc
        })
        .collect()
}

/// Runs one block: enter, compute on its execution device, exit.
fn block(
    model: &Model,
    name: &str,
    x: Tensor,
    f: impl Fn(&mut bm_dispatch::Forward, Vec<f32>) -> Vec<f32>,
) -> Tensor {
    let mut g = model.enter(name, Activations::new(vec![x])).unwrap();
    let x = g.take_inputs().args.remove(0);
    let device = x.device().unwrap();
    if let Some(exec) = g.execution_device() {
        assert_eq!(device, exec, "inputs of {name} are on the execution device");
    }
    let y = f(&mut g, tensor_values(&x));
    let y = tensor_on(&y, device, model.devices());
    g.exit(Activations::new(vec![y])).unwrap().args.remove(0)
}

/// The forward pass from an input on the CPU; the output must come back
/// there.
pub fn forward(model: &Model, input: &[f32]) -> Vec<f32> {
    let (out, device) = forward_anywhere(model, input);
    assert_eq!(device, Some(Device::Cpu), "output back on the input device");
    out
}

/// The forward pass from an input on the CPU, and where the output ends.
pub fn forward_anywhere(model: &Model, input: &[f32]) -> (Vec<f32>, Option<Device>) {
    let devices = Arc::clone(model.devices());
    let x = tensor_on(input, Device::Cpu, &devices);
    let mut root = model.enter("", Activations::new(vec![x])).unwrap();
    let mut x = root.take_inputs().args.remove(0);
    for i in 0..LAYERS {
        x = block(model, &i.to_string(), x, |g, x| {
            let w = weight_values(&g.weight("weight").unwrap());
            let b = weight_values(&g.weight("bias").unwrap());
            linear(&w, Some(&b), &x)
                .into_iter()
                .map(|v| v.max(0.0))
                .collect()
        });
    }
    x = block(model, "bn", x, |g, x| {
        let m = weight_values(&g.weight("running_mean").unwrap());
        let s = weight_values(&g.weight("scratch").unwrap());
        x.iter()
            .zip(&m)
            .zip(&s)
            .map(|((a, b), c)| a - b + c)
            .collect()
    });
    x = block(model, "head", x, |g, x| {
        linear(&weight_values(&g.weight("weight").unwrap()), None, &x)
    });
    let out = root.exit(Activations::new(vec![x])).unwrap().args.remove(0);
    (tensor_values(&out), out.device())
}

pub fn input() -> Vec<f32> {
    values(999, WIDTH)
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
