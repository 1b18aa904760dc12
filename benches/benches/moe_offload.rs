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

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use bigmodel::device::DeviceSet;
use bigmodel::plan::{Device, DeviceMap};
use bigmodel::{DeviceMapSpec, Options};
use bigmodel_benches::safetensors_f32;
use bm_models::{CausalLm, Dispatched, Logits, WeightSource, open_causal_lm};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use serde_json::json;

const VOCAB: usize = 8000;
const HIDDEN: usize = 1024;
const EXPERT_WIDTH: usize = 1408;
const EXPERTS: usize = 8;
const TOP_K: usize = 2;
const HEADS: usize = 16;
const KV_HEADS: usize = 4;

fn layers() -> usize {
    std::env::var("BM_BENCH_MOE_LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6)
}

/// Writes config.json and a single model.safetensors of deterministic
/// small F32 weights (norm weights 1) in Mixtral's checkpoint names.
fn write_model(dir: &Path, layers: usize) {
    let kv = KV_HEADS * HIDDEN / HEADS;
    let mut tensors = vec![("model.embed_tokens.weight".to_string(), vec![VOCAB, HIDDEN])];
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        tensors.extend([
            (format!("{p}.self_attn.q_proj.weight"), vec![HIDDEN, HIDDEN]),
            (format!("{p}.self_attn.k_proj.weight"), vec![kv, HIDDEN]),
            (format!("{p}.self_attn.v_proj.weight"), vec![kv, HIDDEN]),
            (format!("{p}.self_attn.o_proj.weight"), vec![HIDDEN, HIDDEN]),
            (
                format!("{p}.block_sparse_moe.gate.weight"),
                vec![EXPERTS, HIDDEN],
            ),
        ]);
        for e in 0..EXPERTS {
            let x = format!("{p}.block_sparse_moe.experts.{e}");
            tensors.extend([
                (format!("{x}.w1.weight"), vec![EXPERT_WIDTH, HIDDEN]),
                (format!("{x}.w2.weight"), vec![HIDDEN, EXPERT_WIDTH]),
                (format!("{x}.w3.weight"), vec![EXPERT_WIDTH, HIDDEN]),
            ]);
        }
        tensors.extend([
            (format!("{p}.input_layernorm.weight"), vec![HIDDEN]),
            (format!("{p}.post_attention_layernorm.weight"), vec![HIDDEN]),
        ]);
    }
    tensors.push(("model.norm.weight".to_string(), vec![HIDDEN]));
    tensors.push(("lm_head.weight".to_string(), vec![VOCAB, HIDDEN]));

    safetensors_f32::write_random(&dir.join("model.safetensors"), &tensors).unwrap();
    let config = json!({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "dtype": "float32",
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": EXPERT_WIDTH,
        "num_hidden_layers": layers, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "num_local_experts": EXPERTS,
        "num_experts_per_tok": TOP_K, "rms_norm_eps": 1e-5, "eos_token_id": 2,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

/// One token through every block with an empty cache.
fn one_token(lm: &CausalLm, src: &dyn WeightSource) {
    let mut cache = lm.decoder().new_cache();
    let logits = lm
        .decoder()
        .forward(src, &[17], &mut cache, Logits::Last)
        .unwrap();
    std::hint::black_box(logits);
}

/// Median seconds of `runs` calls of `f`.
fn median_seconds(runs: usize, mut f: impl FnMut()) -> f64 {
    let mut times: Vec<f64> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[runs / 2]
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
    let mut map = serde_json::Map::new();
    let mut units: Vec<String> = vec!["model.embed_tokens".into()];
    units.extend((0..layers).map(|l| format!("model.layers.{l}")));
    units.extend(["model.norm", "model.rotary_emb", "lm_head"].map(String::from));
    for unit in units {
        let device = place(&unit);
        map.insert(unit, json!(device));
    }
    let options = Options {
        device_map: Some(DeviceMapSpec::Map(
            DeviceMap::from_json(&serde_json::Value::Object(map)).unwrap(),
        )),
        offload_folder: Some(dir.join(offload)),
        force_hooks: true,
        experts_on,
        ..Options::default()
    };
    open_causal_lm(dir, Arc::new(DeviceSet::cpu_only()), &options).unwrap()
}

/// Offloaded bytes handed to the blocks by one token.
fn streamed_per_token(model: &Dispatched<CausalLm>) -> u64 {
    let before = model.weights.streamed_bytes();
    one_token(&model.model, &model.weights);
    model.weights.streamed_bytes() - before
}

fn moe_offload(c: &mut Criterion) {
    let layers = layers();
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
