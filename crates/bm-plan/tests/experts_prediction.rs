//! The speed prediction of a mixture-of-experts model: a layer's experts
//! are costed apart from the rest of it, and only the experts the router
//! picks are fetched, as the runtime fetches them (bm-models' `moe.rs`
//! asks for the picked experts only; `bigmodel run --json` counts what was
//! fetched). Whole layers offloaded stream the rest of the layer too.

use bm_plan::config::HfConfig;
use bm_plan::hf::{HfModel, tree_from_config};
use bm_plan::predict::{Calibration, CpuRates, DiskRates};
use bm_plan::{Device, DeviceMap, PlanOptions, Prediction, Workload, place_experts, predict};

/// A Mixtral of `layers` layers of eight experts, two per token; the
/// embedding and the head 128 KiB each.
fn mixtral(layers: usize) -> HfModel {
    let config = serde_json::json!({
        "model_type": "mixtral",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 512,
        "max_position_embeddings": 128,
        "torch_dtype": "float32",
    });
    tree_from_config(&HfConfig::from_value(config, "config.json").unwrap()).unwrap()
}

/// One expert: three `[128, 64]` f32 matrices.
const EXPERT_BYTES: u64 = 3 * 128 * 64 * 4;

/// A made-up CPU machine whose page cache holds everything unless `cold`.
fn calibration(cold: bool) -> Calibration {
    Calibration {
        cpu: CpuRates {
            gemm_flops: 20e9,
            gemm_weight_bytes_per_second: 8e9,
            bf16_gemm_flops: None,
            bf16_gemm_weight_bytes_per_second: None,
            gemv_bytes_per_second: 4e9,
            gemv_cached_bytes_per_second: 8e9,
            last_level_cache_bytes: 0,
            attention_flops: 2e9,
            attention_score_seconds: 5e-9,
            elementwise_seconds: 1e-9,
            activation_seconds: 3e-9,
            op_seconds: 5e-6,
            memory_bytes_per_second: 8e9,
            tensor_seconds: 1e-6,
            startup_seconds: 3e-3,
        },
        host_available_bytes: if cold { 0 } else { 1 << 40 },
        disk: Some(DiskRates {
            cold_bytes_per_second: Some(50e6),
            warm_bytes_per_second: 2e9,
            first_touch_bytes_per_second: 4e9,
            mapped_tensor_seconds: 20e-6,
        }),
        gpus: Vec::new(),
    }
}

fn workload(prompt_len: u64, max_seq_len: u64) -> Workload {
    Workload {
        batch: 1,
        prompt_len,
        max_seq_len,
        all_logits: false,
    }
}

fn map(entries: serde_json::Value) -> DeviceMap {
    DeviceMap::from_json(&entries).unwrap()
}

fn predicted(model: &HfModel, map: &DeviceMap, w: &Workload, cold: bool) -> Prediction {
    predict(model, map, &PlanOptions::default(), w, &calibration(cold)).unwrap()
}

/// Everything on the CPU but the layers (whole, or their experts) on disk.
fn maps(model: &HfModel) -> (DeviceMap, DeviceMap) {
    let whole = map(serde_json::json!({
        "model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "cpu",
        "model.rotary_emb": "cpu", "lm_head": "cpu",
    }));
    let all_cpu = map(serde_json::json!({"": "cpu"}));
    let apart = place_experts(&model.tree, &all_cpu, Device::Disk).unwrap();
    (whole, apart)
}

#[test]
fn one_row_fetches_its_top_k_experts_per_layer() {
    let model = mixtral(3);
    let (whole, apart) = maps(&model);
    // One pass of one row: exactly two experts a layer.
    let w = workload(1, 2);
    let fetched = predicted(&model, &apart, &w, false).bytes_streamed_per_token;
    assert_eq!(fetched, 3 * 2 * EXPERT_BYTES);
    // Whole layers stream the rest of each layer too, but still only the
    // picked experts are fetched.
    let rest = predicted(&model, &whole, &w, false).bytes_streamed_per_token - fetched;
    let layer_bytes = model
        .tree
        .tensors()
        .filter(|t| t.name.starts_with("model.layers.0."))
        .map(|t| t.meta.numel() as u64 * 4)
        .sum::<u64>();
    assert_eq!(rest, 3 * (layer_bytes - 8 * EXPERT_BYTES));
}

#[test]
fn streamed_bytes_average_the_prompt_and_the_decoding_passes() {
    let model = mixtral(2);
    let (_, apart) = maps(&model);
    // A prompt of 8 rows picks 8 · (1 − (3/4)^8) experts on average;
    // each of the 31 further passes picks 2.
    let w = workload(8, 40);
    let picked = 8.0 * (1.0 - 0.75f64.powi(8)) + 31.0 * 2.0;
    let expected = (2.0 * picked / 32.0 * EXPERT_BYTES as f64).round() as u64;
    assert_eq!(
        predicted(&model, &apart, &w, false).bytes_streamed_per_token,
        expected
    );
}

#[test]
fn experts_apart_are_predicted_faster_than_whole_layers_on_disk() {
    let model = mixtral(3);
    let (whole, apart) = maps(&model);
    let w = workload(8, 40);
    for cold in [false, true] {
        let (whole, apart) = (
            predicted(&model, &whole, &w, cold),
            predicted(&model, &apart, &w, cold),
        );
        // Warm: whole layers hand every expert's tensors out of their
        // mapping; cold: they also read the rest of each layer from disk.
        assert!(
            apart.seconds_per_token < whole.seconds_per_token,
            "cold {cold}: {apart:?} {whole:?}"
        );
    }
    // Cold, a decoding pass reads its six picked experts at 50 MB/s.
    let cold = predicted(&model, &apart, &w, true);
    let read = (3 * 2 * EXPERT_BYTES) as f64 / 50e6;
    assert!(
        cold.seconds_per_token > read && cold.seconds_per_token < 1.5 * read,
        "{cold:?}"
    );
}

#[test]
fn experts_keyed_one_by_one_rest_where_most_of_them_do() {
    let model = mixtral(1);
    let (_, apart) = maps(&model);
    let mut entries: Vec<(String, Device)> = apart
        .iter()
        .filter(|(k, _)| !k.ends_with(".experts"))
        .map(|(k, d)| (k.to_string(), d))
        .collect();
    // Five of the eight on disk.
    for e in 0..8 {
        let on = if e < 3 { Device::Cpu } else { Device::Disk };
        entries.push((format!("model.layers.0.block_sparse_moe.experts.{e}"), on));
    }
    let one_by_one = DeviceMap::from_entries(entries);
    let w = workload(1, 2);
    assert_eq!(
        predicted(&model, &one_by_one, &w, false),
        predicted(&model, &apart, &w, false)
    );
}
