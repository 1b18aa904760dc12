//! One decode step of a Mixtral-style mixture-of-experts model (about 1 GB
//! of F32 weights by default: 6 layers of 8 experts, 2 per token) on the
//! CPU, with its experts on disk and everything else in RAM
//! (`experts_on: disk`, the dispatch fetches only the experts the router
//! picks), against the same model with whole layers on disk (Accelerate's
//! unit of placement).
//!
//! * `moe_decode_token/experts_on_disk` and
//!   `moe_decode_token/layers_on_disk`: one token forward through the
//!   dispatched model; throughput is the offloaded bytes handed to the
//!   blocks per token, so criterion prints their GB/s.
//!
//! A summary line prints tokens/s and bytes streamed per token of both and
//! their ratios, measured in the same run. `BM_BENCH_MOE_LAYERS` changes the
//! layer count (e.g. 2 for a quick run).

mod common;

use std::path::Path;
use std::sync::Arc;

use bigmodel::device::DeviceSet;
use bigmodel::plan::Device;
use bigmodel::{DeviceMapSpec, Options};
use bm_models::{CausalLm, Dispatched, open_causal_lm};
use common::{
    Dims, device_map, layers_from_env, median_seconds, one_token, streamed_per_token, write_decoder,
};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use serde_json::json;

const DIMS: Dims = Dims {
    vocab: 8000,
    hidden: 1024,
    heads: 16,
    kv_heads: 4,
};
const EXPERT_WIDTH: usize = 1408;
const EXPERTS: usize = 8;
const TOP_K: usize = 2;

/// Writes a Mixtral-style checkpoint: each layer's router and experts in
/// Mixtral's names.
fn write_model(dir: &Path, layers: usize) {
    let hidden = DIMS.hidden;
    let experts = |p: &str| {
        let mut tensors = vec![(
            format!("{p}.block_sparse_moe.gate.weight"),
            vec![EXPERTS, hidden],
        )];
        for e in 0..EXPERTS {
            let x = format!("{p}.block_sparse_moe.experts.{e}");
            tensors.extend([
                (format!("{x}.w1.weight"), vec![EXPERT_WIDTH, hidden]),
                (format!("{x}.w2.weight"), vec![hidden, EXPERT_WIDTH]),
                (format!("{x}.w3.weight"), vec![EXPERT_WIDTH, hidden]),
            ]);
        }
        tensors
    };
    let config = json!({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "intermediate_size": EXPERT_WIDTH, "num_local_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
    });
    write_decoder(dir, &DIMS, layers, experts, config);
}

/// The model opened with `place(unit)` for each top unit (layers listed
/// one by one), `experts_on` applied on top.
fn open(
    dir: &Path,
    layers: usize,
    offload: &str,
    place: impl Fn(&str) -> &'static str,
    experts_on: Option<Device>,
) -> Dispatched<CausalLm> {
    let options = Options {
        device_map: Some(DeviceMapSpec::Map(device_map(layers, place))),
        offload_folder: Some(dir.join(offload)),
        force_hooks: true,
        experts_on,
        ..Options::default()
    };
    open_causal_lm(dir, Arc::new(DeviceSet::cpu_only()), &options).unwrap()
}

fn moe_offload(c: &mut Criterion) {
    let layers = layers_from_env("BM_BENCH_MOE_LAYERS", 6);
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), layers);

    let experts = open(
        dir.path(),
        layers,
        "offload-experts",
        |_| "cpu",
        Some(Device::Disk),
    );
    let whole = open(
        dir.path(),
        layers,
        "offload-layers",
        |u| {
            if u.starts_with("model.layers.") {
                "disk"
            } else {
                "cpu"
            }
        },
        None,
    );
    let experts_bytes = streamed_per_token(&experts);
    let whole_bytes = streamed_per_token(&whole);

    let mut group = c.benchmark_group("moe_decode_token");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(experts_bytes));
    group.bench_function("experts_on_disk", |b| {
        b.iter(|| one_token(&experts.model, &experts.weights))
    });
    group.throughput(Throughput::Bytes(whole_bytes));
    group.bench_function("layers_on_disk", |b| {
        b.iter(|| one_token(&whole.model, &whole.weights))
    });
    group.finish();

    let e = median_seconds(5, || one_token(&experts.model, &experts.weights));
    let w = median_seconds(5, || one_token(&whole.model, &whole.weights));
    println!(
        "summary: {layers} layers of {EXPERTS} experts (top {TOP_K}); experts on disk {:.2} tokens/s, \
         {:.1} MB streamed per token; whole layers on disk {:.2} tokens/s, {:.1} MB streamed per \
         token; speed ratio {:.2}, bytes ratio {:.2}",
        1.0 / e,
        experts_bytes as f64 / 1e6,
        1.0 / w,
        whole_bytes as f64 / 1e6,
        w / e,
        whole_bytes as f64 / experts_bytes.max(1) as f64
    );
}

criterion_group!(benches, moe_offload);
criterion_main!(benches);
