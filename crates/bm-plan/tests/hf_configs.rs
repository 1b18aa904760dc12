//! config.json builders against trees exported from real transformers
//! models, and the compat planner against Accelerate's maps on real-size
//! architectures (goldens made with tools/accelerate_plan.py).

use std::collections::HashMap;
use std::path::PathBuf;

use bm_plan::config::HfConfig;
use bm_plan::hf::{HfModel, tree_from_config};
use bm_plan::{Compat, Device, MaxMemory, Mode, ModuleTree, PlanOptions};
use bm_tensor::DType;

fn fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(path)
}

fn read_json(path: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// The model a config file describes.
fn model(path: &std::path::Path) -> HfModel {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    tree_from_config(&HfConfig::parse(&text, path).unwrap()).unwrap()
}

#[test]
fn builders_match_trees_exported_from_transformers() {
    for name in [
        "tiny-llama",
        "tiny-gpt2",
        "tiny-bert",
        "tiny-qwen2",
        "tiny-mistral",
        "tiny-qwen3",
        "tiny-gemma2",
        "tiny-phi3",
        "tiny-t5",
    ] {
        let built = model(&fixture(&format!("configs/{name}.json"))).tree;
        let exported =
            ModuleTree::from_json(&read_json(&fixture(&format!("trees/{name}.tree.json"))))
                .unwrap();
        // Same names, classes, shapes, dtypes, order, persistence and ties.
        assert_eq!(built.to_json(), exported.to_json(), "{name}");
    }
}

/// transformers 5 fuses each MoE layer's experts into two 3-D parameters
/// (`mlp.experts.gate_up_proj`); the builders keep the checkpoint's one
/// module per expert. Everything outside the sparse blocks is the same
/// module for module, and every layer (what Accelerate places) the same
/// size, so the maps are too.
#[test]
fn moe_builders_match_transformers_outside_the_experts_and_in_layer_sizes() {
    use bm_plan::{ModuleSizes, Node, SizeOptions};
    for name in ["tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe"] {
        let built = model(&fixture(&format!("configs/{name}.json")));
        let exported =
            ModuleTree::from_json(&read_json(&fixture(&format!("trees/{name}.tree.json"))))
                .unwrap();
        let tree = &built.tree;
        assert_eq!(tree.parameter_count(), exported.parameter_count(), "{name}");
        let sizes = ModuleSizes::compute(tree, &SizeOptions::default());
        let want = ModuleSizes::compute(&exported, &SizeOptions::default());
        let sparse = |n: &str| n.contains(".mlp") || n.contains(".block_sparse_moe");
        let mut compared = 0;
        for (id, m) in exported.modules().enumerate() {
            if sparse(m.name) {
                continue;
            }
            let Some(Node::Module(b)) = tree.find(m.name) else {
                panic!("{name}: no module {}", m.name);
            };
            assert_eq!(tree.module(b).class, m.class, "{name} {}", m.name);
            let got = sizes.of(Node::Module(b));
            assert_eq!(got, want.of(Node::Module(id)), "{name} {}", m.name);
            compared += 1;
        }
        let layers = built.layers.len();
        assert!(compared > 4 * layers, "{name}: {compared} modules");
        // One experts list per sparse layer, one module per expert.
        let config = HfConfig::parse(
            &std::fs::read_to_string(fixture(&format!("configs/{name}.json"))).unwrap(),
            "config.json",
        )
        .unwrap();
        let moe = config.moe.unwrap();
        let sparse_layers = moe.sparse_layers.iter().filter(|&&s| s).count();
        let lists = bm_plan::expert_lists(tree);
        assert_eq!(lists.len(), sparse_layers, "{name}");
        for &list in &lists {
            assert_eq!(tree.module(list).children.len(), moe.experts, "{name}");
        }
    }
}

#[test]
fn family_defaults() {
    let gpt2 = model(&fixture("configs/gpt2.json"));
    assert_eq!(gpt2.no_split, ["GPT2Block"]);
    assert_eq!(
        gpt2.tree.tied_names(),
        vec![vec!["lm_head.weight", "transformer.wte.weight"]]
    );
    assert_eq!(gpt2.tree.parameter_count(), 124_439_808);
    let llama = model(&fixture("configs/llama-2-7b.json"));
    assert_eq!(llama.no_split, ["LlamaDecoderLayer"]);
    assert!(llama.tree.tied_names().is_empty());
    assert_eq!(llama.tree.parameter_count(), 6_738_415_616);
    assert_eq!(llama.dtype, DType::F16);
    // KV cache: 2 x 4096 values per token per layer.
    let kv = llama.kv_runtime_bytes(1, 4096, DType::F16).unwrap();
    assert_eq!(kv.len(), 32);
    assert_eq!(kv[0].1, 2 * 4096 * 4096 * 2);
    // Parameter counts and no-split classes as transformers reports them
    // (model.num_parameters(), _no_split_modules); Gemma 2 ties by default.
    for (config, params, no_split, tied) in [
        ("qwen3-0.6b", 596_049_920, "Qwen3DecoderLayer", true),
        ("qwen3-8b", 8_190_735_360, "Qwen3DecoderLayer", false),
        ("gemma-2-2b", 2_614_341_888, "Gemma2DecoderLayer", true),
        ("gemma-2-9b", 9_241_705_984, "Gemma2DecoderLayer", true),
        ("phi-3-mini-4k", 3_821_079_552, "Phi3DecoderLayer", false),
        ("mixtral-8x7b", 46_702_792_704, "MixtralDecoderLayer", false),
        (
            "qwen1.5-moe-a2.7b",
            14_315_784_192,
            "Qwen2MoeDecoderLayer",
            false,
        ),
        (
            "qwen3-30b-a3b",
            30_532_122_624,
            "Qwen3MoeDecoderLayer",
            false,
        ),
        // T5's embeddings are always shared by both stacks.
        ("t5-small", 60_506_624, "T5Block", true),
        ("t0pp", 11_003_736_064, "T5Block", true),
    ] {
        let model = model(&fixture(&format!("configs/{config}.json")));
        assert_eq!(model.tree.parameter_count(), params, "{config}");
        assert_eq!(model.no_split, [no_split], "{config}");
        let ties = model.tree.tied_names();
        assert_eq!(!ties.is_empty(), tied, "{config}: {ties:?}");
    }
    let bert = model(&fixture("configs/bert-base.json"));
    assert_eq!(bert.no_split, ["BertEmbeddings", "BertLayer"]);
    assert!(bert.kv_runtime_bytes(1, 1, DType::F32).is_none());
}

#[test]
fn bad_configs_are_clear_errors() {
    let err = |v: serde_json::Value| {
        HfConfig::from_value(v, "config.json")
            .and_then(|c| tree_from_config(&c))
            .unwrap_err()
            .to_string()
    };
    let sizes = serde_json::json!({
        "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2,
    });
    let with = |extra: serde_json::Value| {
        let mut config = sizes.clone();
        for (k, v) in extra.as_object().unwrap() {
            config[k] = v.clone();
        }
        config
    };
    assert!(err(serde_json::json!({"model_type": "bart"})).contains("not supported"));
    assert!(
        err(with(
            serde_json::json!({"model_type": "gemma2", "architectures": ["Gemma2Model"]})
        ))
        .contains("planned as Gemma2ForCausalLM")
    );
    assert!(
        err(serde_json::json!({"model_type": "llama"}))
            .contains("config.json: key \"vocab_size\": missing")
    );
    assert!(
        err(serde_json::json!({"model_type": "llama", "vocab_size": -3}))
            .contains("key \"vocab_size\": expected a positive integer, found -3")
    );
    assert!(
        err(with(
            serde_json::json!({"model_type": "bert", "architectures": ["BertForMaskedLM"]})
        ))
        .contains("not supported")
    );
    assert!(err(serde_json::json!([1])).contains("JSON object"));
}

#[test]
fn compat_planner_matches_accelerate_on_real_architectures() {
    let cases = read_json(&fixture("goldens/goldens.json"));
    let cases = cases.as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let config_path = fixture("goldens").join(case["config"].as_str().unwrap());
        let model = model(&config_path);
        let max_memory = MaxMemory::parse(&case["max_memory"].to_string()).unwrap();
        let options = PlanOptions {
            max_memory,
            max_memory_from_user: true,
            no_split: model.no_split.clone(),
            dtype: case
                .get("dtype")
                .and_then(|d| d.as_str())
                .map(|d| DType::from_torch_str(d).unwrap()),
            mode: Mode::parse(case["mode"].as_str().unwrap()).unwrap(),
            ..PlanOptions::default()
        };
        let plan = bm_plan::plan_with(&model.tree, &options, Compat::Accelerate).unwrap();
        let got: HashMap<String, Device> = plan
            .device_map
            .iter()
            .map(|(n, d)| (n.to_string(), d))
            .collect();
        let want: HashMap<String, Device> = case["expect"]["device_map"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(n, d)| (n.clone(), Device::from_json(d).unwrap()))
            .collect();
        let label = format!("{} {} {}", case["config"], case["mode"], case["max_memory"]);
        assert_eq!(got, want, "{label}");
        let want_memory = MaxMemory::parse(&case["expect"]["max_memory"].to_string()).unwrap();
        assert_eq!(plan.max_memory, want_memory, "{label}");
        // Deterministic traversal order: the keys follow the model.
        bm_plan::check_device_map(&model.tree, &plan.device_map).unwrap();
    }
}
