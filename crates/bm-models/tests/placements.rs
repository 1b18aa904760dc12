//! The reference models running on dispatched `bigmodel` models: the tiny
//! Llama's (and every other decoder family's) logits against transformers'
//! under an all-CPU map, a CPU + disk map and a host-emulated multi-device
//! map, bit for bit the same under all three and as the plain in-memory
//! run; the tiny BERT and (with BM_MINILM_DIR) all-MiniLM-L6-v2 with half
//! their layers on disk; the tiny T5s (both stacks) the same way.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bigmodel::device::DeviceSet;
use bigmodel::plan::DeviceMap;
use bigmodel::{DeviceMapSpec, Options};
use bm_models::{
    CausalLm, Dispatched, Error, FolderWeights, GenerateOptions, Logits, SentenceEmbedder,
    Seq2SeqLm, open_causal_lm, open_sentence_embedder, open_seq2seq_lm,
};
use bm_tensor::DType;
use safetensors::SafeTensors;
use serde_json::json;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn reference() -> Vec<u8> {
    std::fs::read(fixture("tiny-llama").join("reference.safetensors")).unwrap()
}

fn ids(reference: &[u8], name: &str) -> Vec<u32> {
    let st = SafeTensors::deserialize(reference).unwrap();
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

fn floats(reference: &[u8], name: &str) -> Vec<f32> {
    let st = SafeTensors::deserialize(reference).unwrap();
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn options(map: serde_json::Value, offload: Option<&Path>) -> Options {
    Options {
        device_map: Some(DeviceMapSpec::Map(DeviceMap::from_json(&map).unwrap())),
        offload_folder: offload.map(Path::to_path_buf),
        force_hooks: true,
        ..Options::default()
    }
}

/// The three placements of the tiny Llama (3 layers), every block its own
/// map entry so every decoder layer is a hooked block.
fn placements(offload: &Path) -> Vec<(&'static str, Arc<DeviceSet>, Options)> {
    let cpu = json!({
        "model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
        "model.layers.2": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu",
    });
    let disk = json!({
        "model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
        "model.layers.2": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk",
    });
    let multi = json!({
        "model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1,
        "model.layers.2": "cpu", "model.norm": 1, "model.rotary_emb": 0, "lm_head": "disk",
    });
    vec![
        (
            "all-cpu",
            Arc::new(DeviceSet::cpu_only()),
            options(cpu, None),
        ),
        (
            "cpu+disk",
            Arc::new(DeviceSet::cpu_only()),
            options(disk, Some(&offload.join("disk"))),
        ),
        (
            "emulated 2 GPUs + cpu + disk",
            Arc::new(DeviceSet::emulated(&[1 << 20, 1 << 20])),
            options(multi, Some(&offload.join("multi"))),
        ),
    ]
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn tiny_llama_matches_transformers_and_is_bit_identical_under_every_placement() {
    let reference = reference();
    let in_memory = CausalLm::open(fixture("tiny-llama"), Some(DType::F32)).unwrap();
    let folder = FolderWeights::open(fixture("tiny-llama"), Some(DType::F32)).unwrap();
    let offload = tempfile::tempdir().unwrap();
    for prompt in 0..3 {
        let prompt_ids = ids(&reference, &format!("prompt.{prompt}"));
        let want = floats(&reference, &format!("logits.{prompt}"));
        let mut cache = in_memory.decoder().new_cache();
        let expected = in_memory
            .decoder()
            .forward(&folder, &prompt_ids, &mut cache, Logits::All)
            .unwrap()
            .to_f32_vec();
        for (label, devices, options) in placements(offload.path()) {
            let Dispatched { model, weights } =
                open_causal_lm(fixture("tiny-llama"), devices, &options).unwrap();
            let mut cache = model.decoder().new_cache();
            let logits = model
                .decoder()
                .forward(&weights, &prompt_ids, &mut cache, Logits::All)
                .unwrap()
                .to_f32_vec();
            let diff = logits
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            println!("{label} prompt {prompt}: max |diff| vs transformers {diff:e}");
            assert!(diff <= 1e-4, "{label} prompt {prompt}: {diff}");
            assert_eq!(bits(&logits), bits(&expected), "{label} prompt {prompt}");
        }
    }
}

/// The map units of a config's module tree: the children of the base
/// model (`model`, `transformer`) with its layer list expanded, and the
/// other top-level modules (`lm_head`).
fn units(dir: &Path) -> Vec<String> {
    let path = dir.join("config.json");
    let config =
        bigmodel::plan::config::HfConfig::parse(&std::fs::read_to_string(&path).unwrap(), &path)
            .unwrap();
    let tree = bigmodel::plan::hf::tree_from_config(&config)
        .unwrap()
        .tree
        .to_json();
    let children = |node: &serde_json::Value| -> Vec<serde_json::Value> {
        node["children"].as_array().cloned().unwrap_or_default()
    };
    let mut units = Vec::new();
    for top in children(&tree["root"]) {
        let top_name = top["name"].as_str().unwrap().to_string();
        let below = children(&top);
        if below.is_empty() {
            units.push(top_name);
            continue;
        }
        for child in below {
            let name = format!("{top_name}.{}", child["name"].as_str().unwrap());
            if child["class"] == "ModuleList" {
                for layer in children(&child) {
                    units.push(format!("{name}.{}", layer["name"].as_str().unwrap()));
                }
            } else {
                units.push(name);
            }
        }
    }
    units
}

/// All-CPU, CPU + disk (later layers and the head on disk) and two
/// emulated GPUs + CPU + disk maps over `units`.
fn family_placements(
    units: &[String],
    offload: &Path,
) -> Vec<(&'static str, Arc<DeviceSet>, Options)> {
    let layers: Vec<&String> = units
        .iter()
        .filter(|u| u.rsplit('.').next().unwrap().parse::<usize>().is_ok())
        .collect();
    let map = |place: &dyn Fn(&str) -> serde_json::Value| -> serde_json::Value {
        units
            .iter()
            .map(|u| (u.clone(), place(u)))
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    let layer_index = |u: &str| layers.iter().position(|l| *l == u);
    let cpu = map(&|_| json!("cpu"));
    let disk = map(&|u| match layer_index(u) {
        Some(i) if i >= layers.len() / 2 => json!("disk"),
        _ if u == "lm_head" => json!("disk"),
        _ => json!("cpu"),
    });
    let multi = map(&|u| match layer_index(u) {
        Some(0) => json!(0),
        Some(1) => json!(1),
        Some(_) => json!("cpu"),
        None if u == "lm_head" => json!("disk"),
        None => json!(1),
    });
    vec![
        (
            "all-cpu",
            Arc::new(DeviceSet::cpu_only()),
            options(cpu, None),
        ),
        (
            "cpu+disk",
            Arc::new(DeviceSet::cpu_only()),
            options(disk, Some(&offload.join("disk"))),
        ),
        (
            "emulated 2 GPUs + cpu + disk",
            Arc::new(DeviceSet::emulated(&[1 << 20, 1 << 20])),
            options(multi, Some(&offload.join("multi"))),
        ),
    ]
}

#[test]
fn every_family_matches_transformers_and_is_bit_identical_under_every_placement() {
    for model in [
        "tiny-gpt2",
        "tiny-qwen3",
        "tiny-qwen2-swa",
        "tiny-gemma2",
        "tiny-phi3",
        "tiny-mistral",
        "tiny-mixtral",
        "tiny-qwen2-moe",
        "tiny-qwen3-moe",
    ] {
        let dir = fixture(model);
        let reference = std::fs::read(dir.join("reference.safetensors")).unwrap();
        let in_memory = CausalLm::open(&dir, Some(DType::F32)).unwrap();
        let folder = FolderWeights::open(&dir, Some(DType::F32)).unwrap();
        let offload = tempfile::tempdir().unwrap();
        let units = units(&dir);
        // Every block the decoder runs is its own map entry.
        for block in in_memory.decoder().block_names() {
            assert!(units.contains(&block), "{model}: {block} not in {units:?}");
        }
        let placements = family_placements(&units, offload.path());
        let opened: Vec<_> = placements
            .into_iter()
            .map(|(label, devices, options)| {
                (label, open_causal_lm(&dir, devices, &options).unwrap())
            })
            .collect();
        for prompt in 0..3 {
            let prompt_ids = ids(&reference, &format!("prompt.{prompt}"));
            let want = floats(&reference, &format!("logits.{prompt}"));
            let mut cache = in_memory.decoder().new_cache();
            let expected = in_memory
                .decoder()
                .forward(&folder, &prompt_ids, &mut cache, Logits::All)
                .unwrap()
                .to_f32_vec();
            for (label, Dispatched { model: lm, weights }) in &opened {
                let mut cache = lm.decoder().new_cache();
                let logits = lm
                    .decoder()
                    .forward(weights, &prompt_ids, &mut cache, Logits::All)
                    .unwrap()
                    .to_f32_vec();
                let diff = logits
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(diff <= 1e-4, "{model} {label} prompt {prompt}: {diff}");
                assert_eq!(
                    bits(&logits),
                    bits(&expected),
                    "{model} {label} prompt {prompt}"
                );
            }
        }
        for (label, Dispatched { weights, .. }) in &opened {
            assert_eq!(
                weights.streamed_bytes() > 0,
                *label != "all-cpu",
                "{model} {label}"
            );
        }
    }
}

/// T5: the first decoder step's logits and greedy tokens under the same
/// three placements (both stacks' blocks hooked, the later ones and the
/// head streamed from disk), against transformers and bit for bit the
/// in-memory run.
#[test]
fn t5_matches_transformers_and_is_bit_identical_under_every_placement() {
    for model in ["tiny-t5", "tiny-t5-relu"] {
        let dir = fixture(model);
        let reference = std::fs::read(dir.join("reference.safetensors")).unwrap();
        let in_memory = Seq2SeqLm::open(&dir, Some(DType::F32)).unwrap();
        let offload = tempfile::tempdir().unwrap();
        let units = units(&dir);
        for block in in_memory.model().block_names() {
            assert!(units.contains(&block), "{model}: {block} not in {units:?}");
        }
        let first_step = |lm: &Seq2SeqLm, prompt: &[u32]| -> Vec<f32> {
            let t5 = lm.model();
            let mut cache = t5.new_cache(t5.encode(lm.weights(), prompt).unwrap());
            let start = t5.config().decoder_start_token_id;
            t5.decode(lm.weights(), &[start], &mut cache)
                .unwrap()
                .to_f32_vec()
        };
        for (label, devices, options) in family_placements(&units, offload.path()) {
            let Dispatched { model: lm, weights } =
                open_seq2seq_lm(&dir, devices, &options).unwrap();
            for prompt in 0..4 {
                let prompt_ids = ids(&reference, &format!("prompt.{prompt}"));
                let logits = first_step(&lm, &prompt_ids);
                let want = floats(&reference, &format!("logits.{prompt}"));
                let diff = logits
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(diff <= 1e-4, "{model} {label} prompt {prompt}: {diff}");
                let expected = first_step(&in_memory, &prompt_ids);
                assert_eq!(
                    bits(&logits),
                    bits(&expected),
                    "{model} {label} prompt {prompt}"
                );
                let generated = ids(&reference, &format!("generated.{prompt}"));
                let options = GenerateOptions {
                    max_new_tokens: generated.len(),
                    ..GenerateOptions::default()
                };
                let tokens = lm
                    .generate_ids(&prompt_ids, &options, &mut |_| {})
                    .unwrap()
                    .tokens;
                assert_eq!(tokens, generated, "{model} {label} prompt {prompt}");
            }
            assert_eq!(
                weights.streamed_bytes() > 0,
                label != "all-cpu",
                "{model} {label}"
            );
        }
    }
}

#[test]
fn greedy_generation_streams_offloaded_layers_and_matches_transformers() {
    let reference = reference();
    let offload = tempfile::tempdir().unwrap();
    for (label, devices, options) in placements(offload.path()) {
        let Dispatched { model, weights } =
            open_causal_lm(fixture("tiny-llama"), devices, &options).unwrap();
        assert!(weights.model().hf_device_map().is_some(), "{label}");
        for prompt in 0..3 {
            let want = ids(&reference, &format!("generated.{prompt}"));
            let options = GenerateOptions {
                max_new_tokens: want.len(),
                ..GenerateOptions::default()
            };
            let before = weights.streamed_bytes();
            let generation = model
                .generate_ids(&ids(&reference, &format!("prompt.{prompt}")), &options)
                .unwrap();
            assert_eq!(generation.tokens, want, "{label} prompt {prompt}");
            let per_token = (weights.streamed_bytes() - before) / want.len() as u64;
            // Offloaded per pass: layers 1 and 2 (cpu+disk), or layer 2 and
            // lm_head (multi); lm_head on disk in both offloading maps.
            let layer = 4 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64);
            let lm_head = 4 * 256 * 64;
            let expected = match label {
                "all-cpu" => 0,
                "cpu+disk" => 2 * layer + lm_head,
                _ => layer + lm_head,
            };
            assert_eq!(per_token, expected as u64, "{label}");
        }
    }
}

#[test]
fn one_dispatched_model_runs_from_several_threads_with_the_same_outputs() {
    let reference = reference();
    let offload = tempfile::tempdir().unwrap();
    let (_, devices, options) = placements(offload.path()).remove(1);
    let Dispatched { model, weights } =
        open_causal_lm(fixture("tiny-llama"), devices, &options).unwrap();
    let prompt = ids(&reference, "prompt.2");
    let run = || {
        let mut cache = model.decoder().new_cache();
        bits(
            &model
                .decoder()
                .forward(&weights, &prompt, &mut cache, Logits::All)
                .unwrap()
                .to_f32_vec(),
        )
    };
    let alone = run();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..4).map(|_| s.spawn(run)).collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), alone);
        }
    });
}

#[test]
fn bad_folders_and_maps_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let devices = Arc::new(DeviceSet::cpu_only());
    let none = Options::default();
    let err = open_causal_lm(dir.path(), Arc::clone(&devices), &none).unwrap_err();
    assert!(err.to_string().contains("config.json"), "{err}");

    // A config whose layer width disagrees with the weights.
    for file in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixture("tiny-llama").join(file), dir.path().join(file)).unwrap();
    }
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("tiny-llama").join("config.json")).unwrap(),
    )
    .unwrap();
    config["intermediate_size"] = json!(96);
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let err = open_causal_lm(dir.path(), Arc::clone(&devices), &none).unwrap_err();
    assert!(
        err.to_string()
            .contains("model.layers.0.mlp.gate_proj.weight"),
        "{err}"
    );

    config["intermediate_size"] = json!(128);
    config["model_type"] = json!("bart");
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let err = open_causal_lm(dir.path(), Arc::clone(&devices), &none).unwrap_err();
    assert!(
        matches!(err, Error::UnsupportedArchitecture { .. }) && err.to_string().contains("llama"),
        "{err}"
    );

    // Disk in the map but no offload folder: Accelerate's message.
    let map = json!({"model": "cpu", "lm_head": "disk"});
    let err = open_causal_lm(fixture("tiny-llama"), devices, &options(map, None)).unwrap_err();
    assert!(err.to_string().contains("offload"), "{err}");
}

#[test]
fn tiny_bert_with_half_its_layers_on_disk_equals_the_in_memory_embeddings() {
    let dir = fixture("tiny-bert");
    let in_memory = SentenceEmbedder::open(&dir, None).unwrap();
    let layers = in_memory.encoder().config().num_layers;
    let mut map = serde_json::Map::new();
    map.insert("bert.embeddings".into(), json!("cpu"));
    for i in 0..layers {
        let place = if i < layers / 2 { "cpu" } else { "disk" };
        map.insert(format!("bert.encoder.layer.{i}"), json!(place));
    }
    map.insert("bert.pooler".into(), json!("cpu"));
    map.insert("classifier".into(), json!("cpu"));
    let offload = tempfile::tempdir().unwrap();
    let Dispatched { model, weights } = open_sentence_embedder(
        &dir,
        Arc::new(DeviceSet::cpu_only()),
        &options(serde_json::Value::Object(map), Some(offload.path())),
    )
    .unwrap();
    let texts = ["a tiny test", "offloaded layers stream from disk"];
    let want = in_memory.embed(&texts).unwrap();
    let got = model.embed(&texts).unwrap();
    for (w, g) in want.iter().zip(&got) {
        assert_eq!(bits(w), bits(g));
    }
    assert!(weights.streamed_bytes() > 0);
}

#[test]
fn minilm_with_half_its_layers_on_disk_matches_sentence_transformers() {
    let Some(dir) = std::env::var_os("BM_MINILM_DIR").map(PathBuf::from) else {
        // Straight to stderr: libtest would capture println! and hide the skip.
        let _ =
            std::io::Write::write_all(&mut std::io::stderr(), b"skipped: BM_MINILM_DIR not set\n");
        return;
    };
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("minilm").join("reference.json")).unwrap(),
    )
    .unwrap();
    let map = json!({
        "embeddings": "cpu", "encoder.layer.0": "cpu", "encoder.layer.1": "cpu",
        "encoder.layer.2": "cpu", "encoder.layer.3": "disk", "encoder.layer.4": "disk",
        "encoder.layer.5": "disk", "pooler": "cpu",
    });
    let offload = tempfile::tempdir().unwrap();
    let Dispatched { model, weights } = open_sentence_embedder(
        &dir,
        Arc::new(DeviceSet::cpu_only()),
        &options(map, Some(offload.path())),
    )
    .unwrap();
    let sentences: Vec<&str> = reference["sentences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    assert!(sentences.len() >= 5);
    let got = model.embed(&sentences).unwrap();
    for (i, want) in reference["embeddings"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        let want: Vec<f64> = want
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let dot: f64 = want.iter().zip(&got[i]).map(|(a, b)| a * *b as f64).sum();
        let norms = want.iter().map(|a| a * a).sum::<f64>().sqrt()
            * got[i]
                .iter()
                .map(|b| (*b as f64).powi(2))
                .sum::<f64>()
                .sqrt();
        let cosine = dot / norms;
        println!("sentence {i}: cosine {cosine}");
        assert!(cosine >= 0.99999, "sentence {i}: cosine {cosine}");
    }
    assert!(weights.streamed_bytes() > 0);
}

/// The experts each token of prompt `prompt` picked in each layer
/// (transformers' routers, `experts.N` `[layers, len, top_k]`, -1 for
/// dense layers): per layer, the distinct experts.
fn picked_experts(reference: &[u8], prompt: usize) -> Vec<Vec<i64>> {
    let st = SafeTensors::deserialize(reference).unwrap();
    let t = st.tensor(&format!("experts.{prompt}")).unwrap();
    let per_layer = t.shape()[1] * t.shape()[2];
    let all: Vec<i64> = t
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    all.chunks(per_layer)
        .map(|layer| {
            let mut picked: Vec<i64> = layer.iter().copied().filter(|&e| e >= 0).collect();
            picked.sort_unstable();
            picked.dedup();
            picked
        })
        .collect()
}

#[test]
fn experts_on_disk_stream_only_the_experts_the_router_picks() {
    for model in ["tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe"] {
        let dir = fixture(model);
        let reference = std::fs::read(dir.join("reference.safetensors")).unwrap();
        let config = bm_models::DecoderConfig::from_dir(&dir).unwrap();
        let moe = config.moe.clone().unwrap();
        // Three matrices of [width, hidden] per expert, in F32.
        let expert_bytes = 3 * 4 * (moe.expert_intermediate_size * config.hidden_size) as u64;
        let units = units(&dir);
        let offload = tempfile::tempdir().unwrap();
        let all_cpu = units
            .iter()
            .map(|u| (u.clone(), json!("cpu")))
            .collect::<serde_json::Map<_, _>>();
        let mut experts_on_disk = options(all_cpu.clone().into(), Some(offload.path()));
        experts_on_disk.experts_on = Some(bigmodel::plan::Device::Disk);
        let layers_on_disk = all_cpu
            .iter()
            .map(|(u, d)| {
                let layer = u.rsplit('.').next().unwrap().parse::<usize>().is_ok();
                (u.clone(), if layer { json!("disk") } else { d.clone() })
            })
            .collect::<serde_json::Map<_, _>>();
        let whole_layers = options(layers_on_disk.into(), Some(&offload.path().join("layers")));
        let devices = Arc::new(DeviceSet::cpu_only());
        let experts = open_causal_lm(&dir, Arc::clone(&devices), &experts_on_disk).unwrap();
        let layers = open_causal_lm(&dir, devices, &whole_layers).unwrap();
        let map = experts.weights.model().hf_device_map().unwrap();
        assert!(
            map.iter()
                .any(|(n, d)| n.ends_with(".experts") && d == bigmodel::plan::Device::Disk),
            "{model}: {map:?}"
        );
        for prompt in 0..3 {
            let prompt_ids = ids(&reference, &format!("prompt.{prompt}"));
            let want = floats(&reference, &format!("logits.{prompt}"));
            let mut logits = Vec::new();
            let mut streamed = Vec::new();
            for Dispatched { model: lm, weights } in [&experts, &layers] {
                let before = weights.streamed_bytes();
                let mut cache = lm.decoder().new_cache();
                let out = lm
                    .decoder()
                    .forward(weights, &prompt_ids, &mut cache, Logits::All)
                    .unwrap()
                    .to_f32_vec();
                streamed.push(weights.streamed_bytes() - before);
                logits.push(out);
            }
            assert_eq!(
                bits(&logits[0]),
                bits(&logits[1]),
                "{model} prompt {prompt}"
            );
            let diff = logits[0]
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff <= 1e-4, "{model} prompt {prompt}: {diff}");
            // Exactly the experts transformers' routers picked for these
            // tokens, in every sparse layer; never more than whole layers.
            let picked: usize = picked_experts(&reference, prompt)
                .iter()
                .map(Vec::len)
                .sum();
            assert_eq!(
                streamed[0],
                picked as u64 * expert_bytes,
                "{model} prompt {prompt}"
            );
            assert!(
                streamed[0] < streamed[1],
                "{model} prompt {prompt}: {streamed:?}"
            );
        }
    }
}
