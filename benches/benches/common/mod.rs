//! What the decode-step benches (`offload`, `moe_offload`) share: the
//! generated decoder checkpoint, device maps over its top units, one token
//! through the model and the median of timed runs.

use std::path::Path;
use std::time::Instant;

use bigmodel::plan::DeviceMap;
use bigmodel_benches::safetensors_f32;
use bm_models::{CausalLm, Dispatched, Logits, WeightSource};
use serde_json::{Value, json};

/// The layer count from environment variable `var`, else `default`.
pub fn layers_from_env(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The sizes every generated decoder has.
pub struct Dims {
    pub vocab: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
}

/// Writes config.json (`config`'s keys and the sizes of `dims`) and a
/// single model.safetensors of deterministic small F32 weights (norm
/// weights 1) in Llama's checkpoint names: each layer's attention, then
/// `feed_forward(prefix)`'s tensors, then its two norms.
pub fn write_decoder(
    dir: &Path,
    dims: &Dims,
    layers: usize,
    feed_forward: impl Fn(&str) -> Vec<(String, Vec<usize>)>,
    mut config: Value,
) {
    let (hidden, kv) = (dims.hidden, dims.kv_heads * dims.hidden / dims.heads);
    let mut tensors = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![dims.vocab, hidden],
    )];
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        tensors.extend([
            (format!("{p}.self_attn.q_proj.weight"), vec![hidden, hidden]),
            (format!("{p}.self_attn.k_proj.weight"), vec![kv, hidden]),
            (format!("{p}.self_attn.v_proj.weight"), vec![kv, hidden]),
            (format!("{p}.self_attn.o_proj.weight"), vec![hidden, hidden]),
        ]);
        tensors.extend(feed_forward(&p));
        tensors.extend([
            (format!("{p}.input_layernorm.weight"), vec![hidden]),
            (format!("{p}.post_attention_layernorm.weight"), vec![hidden]),
        ]);
    }
    tensors.push(("model.norm.weight".to_string(), vec![hidden]));
    tensors.push(("lm_head.weight".to_string(), vec![dims.vocab, hidden]));
    safetensors_f32::write_random(&dir.join("model.safetensors"), &tensors).unwrap();

    let shared = json!({
        "dtype": "float32", "vocab_size": dims.vocab, "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads, "rms_norm_eps": 1e-5, "eos_token_id": 2,
    });
    let keys = config.as_object_mut().expect("config is a JSON object");
    keys.extend(shared.as_object().unwrap().clone());
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

/// The device map placing each top unit of a `layers`-layer decoder
/// (layers one by one) on `place(unit)`.
pub fn device_map(layers: usize, place: impl Fn(&str) -> &'static str) -> DeviceMap {
    let mut units: Vec<String> = vec!["model.embed_tokens".into()];
    units.extend((0..layers).map(|l| format!("model.layers.{l}")));
    units.extend(["model.norm", "model.rotary_emb", "lm_head"].map(String::from));
    let map: serde_json::Map<String, Value> = units
        .into_iter()
        .map(|unit| {
            let device = place(&unit);
            (unit, json!(device))
        })
        .collect();
    DeviceMap::from_json(&Value::Object(map)).unwrap()
}

/// One token through every block with an empty cache.
pub fn one_token(lm: &CausalLm, src: &dyn WeightSource) {
    let mut cache = lm.decoder().new_cache();
    let logits = lm
        .decoder()
        .forward(src, &[17], &mut cache, Logits::Last)
        .unwrap();
    std::hint::black_box(logits);
}

/// Offloaded bytes handed to the blocks by one token.
pub fn streamed_per_token(model: &Dispatched<CausalLm>) -> u64 {
    let before = model.weights.streamed_bytes();
    one_token(&model.model, &model.weights);
    model.weights.streamed_bytes() - before
}

/// Median seconds of `runs` calls of `f`.
pub fn median_seconds(runs: usize, mut f: impl FnMut()) -> f64 {
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
