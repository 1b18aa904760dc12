//! One decode step of a Llama-style model (about 400 MB of F32 weights by
//! default) fully in RAM against the same model with half its decoder
//! layers disk-offloaded, both computed on the CPU through bm-models.
//!
//! * `decode_token/in_ram`: the model read through `FolderWeights` (zero
//!   copy from the checkpoint's mapping), one token forward.
//! * `decode_token/cpu_disk_offload`: the model dispatched by
//!   `load_checkpoint_and_dispatch` with layers 6..12 on disk; each block
//!   enters and exits its hooks. Its throughput is the offloaded weights
//!   streamed per token, so criterion prints their GB/s.
//! * `decode_token/disk_offload_bf16` and `decode_token/disk_offload_nf4`:
//!   the same map loaded in BF16, and in BF16 with the linear layers
//!   quantized to NF4 while loading (`--quantize nf4`: the offloaded layers
//!   are stored and streamed packed, dequantized a few rows at a time on
//!   the CPU, 4-bit matmuls computing in F32). A second summary line
//!   compares their bytes streamed per token and tokens/s.
//!
//! A summary line prints tokens/s of both and their ratio, measured in the
//! same run. GPU rows (resident vs CPU-offloaded on a GPU) need a GPU and
//! bm-models' CUDA compute; they print why they are skipped.
//! `BM_BENCH_OFFLOAD_LAYERS` changes the layer count (e.g. 4 for a quick run).

mod common;

use std::path::Path;
use std::sync::Arc;

use bigmodel::device::DeviceSet;
use bigmodel::{DeviceMapSpec, Options};
use bm_models::{
    CausalLm, FolderWeights, QuantizeOptions, open_causal_lm, open_causal_lm_quantized,
};
use common::{
    Dims, device_map, layers_from_env, median_seconds, one_token, streamed_per_token, write_decoder,
};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use serde_json::json;

const DIMS: Dims = Dims {
    vocab: 16000,
    hidden: 768,
    heads: 12,
    kv_heads: 4,
};
const INTERMEDIATE: usize = 2048;

/// Writes a Llama checkpoint.
fn write_model(dir: &Path, layers: usize) {
    let hidden = DIMS.hidden;
    let mlp = |p: &str| {
        vec![
            (
                format!("{p}.mlp.gate_proj.weight"),
                vec![INTERMEDIATE, hidden],
            ),
            (
                format!("{p}.mlp.up_proj.weight"),
                vec![INTERMEDIATE, hidden],
            ),
            (
                format!("{p}.mlp.down_proj.weight"),
                vec![hidden, INTERMEDIATE],
            ),
        ]
    };
    let config = json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "intermediate_size": INTERMEDIATE,
    });
    write_decoder(dir, &DIMS, layers, mlp, config);
}

fn offload(c: &mut Criterion) {
    let layers = layers_from_env("BM_BENCH_OFFLOAD_LAYERS", 12);
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), layers);

    let in_ram = CausalLm::open(dir.path(), None).unwrap();
    let folder = FolderWeights::open(dir.path(), None).unwrap();

    // The second half of the layers on disk.
    let map = device_map(layers, |unit| {
        let layer = unit
            .strip_prefix("model.layers.")
            .map(|l| l.parse::<usize>());
        match layer {
            Some(Ok(l)) if l >= layers / 2 => "disk",
            _ => "cpu",
        }
    });
    let options = Options {
        device_map: Some(DeviceMapSpec::Map(map)),
        offload_folder: Some(dir.path().join("offload")),
        ..Options::default()
    };
    let offloaded = open_causal_lm(dir.path(), Arc::new(DeviceSet::cpu_only()), &options).unwrap();
    let streamed = streamed_per_token(&offloaded);
    let bf16_options = Options {
        dtype: Some(bigmodel::tensor::DType::BF16),
        offload_folder: Some(dir.path().join("offload-bf16")),
        ..options.clone()
    };
    let bf16 = open_causal_lm(dir.path(), Arc::new(DeviceSet::cpu_only()), &bf16_options).unwrap();
    let nf4 = open_causal_lm_quantized(
        dir.path(),
        Arc::new(DeviceSet::cpu_only()),
        &Options {
            offload_folder: Some(dir.path().join("offload-nf4")),
            ..bf16_options.clone()
        },
        &QuantizeOptions::named("nf4").unwrap(),
    )
    .unwrap();
    let (bf16_streamed, nf4_streamed) = (streamed_per_token(&bf16), streamed_per_token(&nf4));

    let mut group = c.benchmark_group("decode_token");
    group.sample_size(10);
    group.throughput(Throughput::Elements(1));
    group.bench_function("in_ram", |b| b.iter(|| one_token(&in_ram, &folder)));
    group.throughput(Throughput::Bytes(streamed));
    group.bench_function("cpu_disk_offload", |b| {
        b.iter(|| one_token(&offloaded.model, &offloaded.weights))
    });
    group.throughput(Throughput::Bytes(bf16_streamed));
    group.bench_function("disk_offload_bf16", |b| {
        b.iter(|| one_token(&bf16.model, &bf16.weights))
    });
    group.throughput(Throughput::Bytes(nf4_streamed));
    group.bench_function("disk_offload_nf4", |b| {
        b.iter(|| one_token(&nf4.model, &nf4.weights))
    });
    group.finish();

    let ram = median_seconds(5, || one_token(&in_ram, &folder));
    let disk = median_seconds(5, || one_token(&offloaded.model, &offloaded.weights));
    println!(
        "summary: {layers} layers; in RAM {:.2} tokens/s, CPU + disk offload {:.2} tokens/s \
         (time ratio offload/RAM {:.3}); {:.1} MB streamed per token at {:.2} GB/s",
        1.0 / ram,
        1.0 / disk,
        disk / ram,
        streamed as f64 / 1e6,
        streamed as f64 / disk / 1e9
    );
    let bf16_time = median_seconds(5, || one_token(&bf16.model, &bf16.weights));
    let nf4_time = median_seconds(5, || one_token(&nf4.model, &nf4.weights));
    println!(
        "summary: disk offload in BF16 {:.2} tokens/s, {:.1} MB streamed per token; with NF4 \
         weights {:.2} tokens/s, {:.1} MB per token ({:.2}x fewer bytes, time ratio NF4/BF16 {:.3})",
        1.0 / bf16_time,
        bf16_streamed as f64 / 1e6,
        1.0 / nf4_time,
        nf4_streamed as f64 / 1e6,
        bf16_streamed as f64 / nf4_streamed as f64,
        nf4_time / bf16_time
    );
    if DeviceSet::probe().gpus().is_empty() {
        println!("gpu rows: skipped: no CUDA device");
    } else {
        println!(
            "gpu rows: skipped: bm-models computes on the CPU only here; resident vs CPU-offloaded GPU rows need its CUDA backend"
        );
    }
}

criterion_group!(benches, offload);
criterion_main!(benches);
