//! The tiny random decoders against transformers: logits (F32 within 1e-4,
//! F16 and BF16 close to transformers' half runs) and greedy tokens.
//! Llama, Qwen2 (sharded, tied, q/k/v biases) and Mistral (sliding window
//! 6) come from tools/make_tiny_llama.py; GPT-2, Qwen3 (sharded, sliding
//! layers), Qwen2 with sliding layers, Gemma 2 and Phi-3 (LongRoPE,
//! partial rotary) and the mixtures of experts Mixtral (sliding window),
//! Qwen2-MoE (shared expert, a dense layer, sharded) and Qwen3-MoE (every
//! other layer sparse, renormalised weights) from
//! tools/make_family_fixtures.py. Every fixture has a prompt longer than
//! its sliding window.

mod common;

use std::path::Path;

use bm_models::{CausalLm, DecoderConfig, Error, FolderWeights, GenerateOptions, Logits};
use bm_tensor::DType;
use common::{Reference, copy_fixture, edit_json, fixture, max_abs_diff};

/// Logits of every prompt in `dtype` against transformers' (`key`). In
/// F32 `tolerance` is absolute; in half precision it is relative to the
/// largest logit when that exceeds 1 (the format's spacing grows with it).
fn check_logits(model: &str, dtype: DType, key: &str, tolerance: f32) {
    let reference = Reference::of(model);
    let lm = CausalLm::open(fixture(model), Some(dtype)).unwrap();
    let weights = FolderWeights::open(fixture(model), Some(dtype)).unwrap();
    assert!(reference.prompts() >= 3);
    for i in 0..reference.prompts() {
        let ids = reference.ids(&format!("prompt.{i}"));
        let (shape, want) = reference.floats(&format!("{key}.{i}"));
        let mut cache = lm.decoder().new_cache();
        let logits = lm
            .decoder()
            .forward(&weights, &ids, &mut cache, Logits::All)
            .unwrap();
        assert_eq!(logits.shape(), shape.as_slice());
        assert_eq!(logits.dtype(), dtype);
        let diff = max_abs_diff(&logits.to_f32_vec(), &want);
        println!("{model} {dtype} prompt {i}: max |diff| {diff:e}");
        let tolerance = match dtype {
            DType::F32 => tolerance,
            _ => tolerance * want.iter().fold(1f32, |m, v| m.max(v.abs())),
        };
        assert!(
            diff <= tolerance,
            "{model} {dtype} prompt {i}: max |diff| {diff} > {tolerance}"
        );
    }
}

/// Every decoder fixture.
const DECODERS: [&str; 11] = [
    "tiny-llama",
    "tiny-qwen2",
    "tiny-mistral",
    "tiny-gpt2",
    "tiny-qwen3",
    "tiny-qwen2-swa",
    "tiny-gemma2",
    "tiny-phi3",
    "tiny-mixtral",
    "tiny-qwen2-moe",
    "tiny-qwen3-moe",
];

#[test]
fn tiny_gpt2_conv1d_learned_positions_f32_logits_match() {
    check_logits("tiny-gpt2", DType::F32, "logits", 1e-4);
}

#[test]
fn tiny_qwen3_qk_norms_sliding_layers_f32_logits_match() {
    check_logits("tiny-qwen3", DType::F32, "logits", 1e-4);
}

#[test]
fn tiny_qwen2_sliding_layers_f32_logits_match() {
    check_logits("tiny-qwen2-swa", DType::F32, "logits", 1e-4);
}

#[test]
fn tiny_gemma2_softcaps_sandwich_norms_f32_logits_match() {
    check_logits("tiny-gemma2", DType::F32, "logits", 1e-4);
}

#[test]
fn tiny_phi3_fused_longrope_f32_logits_match() {
    check_logits("tiny-phi3", DType::F32, "logits", 1e-4);
}

#[test]
fn tiny_mixtral_experts_f32_logits_match() {
    check_logits("tiny-mixtral", DType::F32, "logits", 1e-4);
}

#[test]
fn tiny_qwen2_moe_shared_expert_dense_layer_f32_logits_match() {
    check_logits("tiny-qwen2-moe", DType::F32, "logits", 1e-4);
}

#[test]
fn tiny_qwen3_moe_sparse_step_renormalised_f32_logits_match() {
    check_logits("tiny-qwen3-moe", DType::F32, "logits", 1e-4);
}

#[test]
fn tiny_llama_f32_logits_match_transformers_within_1e_4() {
    check_logits("tiny-llama", DType::F32, "logits", 1e-4);
}

#[test]
fn tiny_qwen2_sharded_tied_biased_f32_logits_match() {
    check_logits("tiny-qwen2", DType::F32, "logits", 1e-4);
}

#[test]
fn tiny_mistral_sliding_window_f32_logits_match() {
    check_logits("tiny-mistral", DType::F32, "logits", 1e-4);
}

// Half precision rounds after every op on both sides, in slightly different
// places (transformers rounds q·k and the rope products; we round once per
// op): the logits agree to a few units of the format's last place.
#[test]
fn half_precision_logits_are_close_to_transformers_half_runs() {
    for model in DECODERS {
        check_logits(model, DType::BF16, "logits_bf16", 0.03);
        check_logits(model, DType::F16, "logits_f16", 0.005);
    }
}

#[test]
fn greedy_generation_with_kv_cache_matches_transformers() {
    for model in DECODERS {
        let reference = Reference::of(model);
        let lm = CausalLm::open(fixture(model), None).unwrap();
        for i in 0..reference.prompts() {
            let prompt = reference.ids(&format!("prompt.{i}"));
            let want = reference.ids(&format!("generated.{i}"));
            let options = GenerateOptions {
                max_new_tokens: want.len(),
                keep_prompt_logits: true,
                ..GenerateOptions::default()
            };
            let generation = lm.generate_ids(&prompt, &options).unwrap();
            assert_eq!(generation.tokens, want, "{model} prompt {i}");
            assert_eq!(generation.step_seconds.len(), want.len());
            let logits = generation.prompt_logits.unwrap();
            let vocab = lm.decoder().config().vocab_size;
            assert_eq!(logits.shape(), [prompt.len(), vocab]);
        }
    }
}

/// Sliding-window caches drop old positions as decoding runs past twice
/// the window; learned positions continue from the cache's length. (Not
/// Phi-3: LongRoPE picks its factors by the length of each pass, so a
/// cached run differs from a full one past the switch, in transformers too.)
#[test]
fn cached_decoding_equals_recomputing_the_whole_sequence() {
    for model in ["tiny-mistral", "tiny-qwen3", "tiny-gemma2", "tiny-gpt2"] {
        let lm = CausalLm::open(fixture(model), None).unwrap();
        let weights = FolderWeights::open(fixture(model), None).unwrap();
        let ids: Vec<u32> = (10..30).collect();
        let decoder = lm.decoder();
        let mut full_cache = decoder.new_cache();
        let full = decoder
            .forward(&weights, &ids, &mut full_cache, Logits::All)
            .unwrap();
        let mut cache = decoder.new_cache();
        decoder
            .forward(&weights, &ids[..5], &mut cache, Logits::Last)
            .unwrap();
        for (n, &id) in ids.iter().enumerate().skip(5) {
            let step = decoder
                .forward(&weights, &[id], &mut cache, Logits::Last)
                .unwrap();
            let want = full.rows(n, n + 1).unwrap().to_f32_vec();
            assert!(
                max_abs_diff(&step.to_f32_vec(), &want) < 1e-5,
                "{model} position {n}"
            );
        }
        assert_eq!(cache.len(), ids.len());
    }
}

#[test]
fn text_goes_through_tokenizer_json() {
    let reference = Reference::of("tiny-llama");
    let lm = CausalLm::open(fixture("tiny-llama"), None).unwrap();
    let tokenizer = lm.tokenizer().expect("tiny-llama has a tokenizer.json");
    let prompt = "Hello, wörld!";
    assert_eq!(
        tokenizer.encode(prompt, true).unwrap(),
        reference.ids("text_prompt")
    );
    let want = reference.ids("text_generated");
    let options = GenerateOptions {
        max_new_tokens: want.len(),
        ..GenerateOptions::default()
    };
    let (generation, text) = lm.generate_text(prompt, &options).unwrap();
    assert_eq!(generation.tokens, want);
    assert_eq!(text, tokenizer.decode(&want).unwrap());
    let err = lm.generate_text("", &options).unwrap_err();
    assert_eq!(err.to_string(), "prompt is empty");
}

#[test]
fn generation_stops_at_a_stop_token() {
    let reference = Reference::of("tiny-llama");
    let lm = CausalLm::open(fixture("tiny-llama"), None).unwrap();
    let want = reference.ids("generated.0");
    let options = GenerateOptions {
        max_new_tokens: 8,
        stop_tokens: vec![want[1]],
        ..GenerateOptions::default()
    };
    let generation = lm
        .generate_ids(&reference.ids("prompt.0"), &options)
        .unwrap();
    assert_eq!(generation.tokens, want[..2]);
}

/// Copies a fixture folder so a test can break it.
fn one_token() -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: 1,
        ..Default::default()
    }
}

fn broken_copy(model: &str, edit: impl FnOnce(&Path)) -> tempfile::TempDir {
    let dir = copy_fixture(model);
    edit(dir.path());
    dir
}

fn edit_config(dir: &Path, key: &str, value: serde_json::Value) {
    edit_json(&dir.join("config.json"), |config| config[key] = value);
}

#[test]
fn bad_folders_and_inputs_give_clear_errors() {
    let no_config = broken_copy("tiny-llama", |d| {
        std::fs::remove_file(d.join("config.json")).unwrap()
    });
    let err = CausalLm::open(no_config.path(), None).err().unwrap();
    assert!(err.to_string().contains("config.json"), "{err}");

    let no_weights = broken_copy("tiny-llama", |d| {
        std::fs::remove_file(d.join("model.safetensors")).unwrap()
    });
    let err = CausalLm::open(no_weights.path(), None).err().unwrap();
    assert!(matches!(err, Error::MissingWeights { .. }), "{err}");

    let bart = broken_copy("tiny-llama", |d| {
        edit_config(d, "model_type", "bart".into())
    });
    let err = CausalLm::open(bart.path(), None).err().unwrap();
    assert!(
        err.to_string().contains(
            "supported are llama, mistral, qwen2, qwen3, gemma2, phi3, gpt2, mixtral, qwen2_moe, qwen3_moe"
        ),
        "{err}"
    );

    let wrong_shape = broken_copy("tiny-llama", |d| {
        edit_config(d, "intermediate_size", 96.into())
    });
    let lm = CausalLm::open(wrong_shape.path(), None).unwrap();
    let err = lm
        .generate_ids(
            &[1, 2],
            &GenerateOptions {
                max_new_tokens: 1,
                ..Default::default()
            },
        )
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "tensor model.layers.0.mlp.gate_proj.weight has shape [128, 64] but the config implies [96, 64]"
    );

    // GPT-2's Conv1D weights are named with their stored [in, out] shape.
    let wide = broken_copy("tiny-gpt2", |d| edit_config(d, "n_inner", 48.into()));
    let lm = CausalLm::open(wide.path(), None).unwrap();
    let err = lm
        .generate_ids(
            &[1, 2],
            &GenerateOptions {
                max_new_tokens: 1,
                ..Default::default()
            },
        )
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "tensor transformer.h.0.mlp.c_fc.weight has shape [16, 64] but the config implies [16, 48]"
    );

    // An expert count or expert width the router and experts disagree with.
    for (model, key, value, wanted) in [
        (
            "tiny-mixtral",
            "num_local_experts",
            4,
            "tensor model.layers.0.block_sparse_moe.gate.weight has shape [8, 16] but the config implies [4, 16]",
        ),
        (
            "tiny-qwen3-moe",
            "moe_intermediate_size",
            10,
            "tensor model.layers.1.mlp.experts.",
        ),
    ] {
        let broken = broken_copy(model, |d| edit_config(d, key, value.into()));
        let lm = CausalLm::open(broken.path(), None).unwrap();
        let err = lm.generate_ids(&[1, 2], &one_token()).unwrap_err();
        assert!(err.to_string().starts_with(wanted), "{model}: {err}");
    }
    let greedy = broken_copy("tiny-qwen2-moe", |d| {
        edit_config(d, "num_experts_per_tok", 9.into())
    });
    let err = CausalLm::open(greedy.path(), None).err().unwrap();
    assert!(
        err.to_string()
            .contains("key \"num_experts_per_tok\": 9 is more than the 8 experts (num_experts)"),
        "{err}"
    );

    let scaled = broken_copy("tiny-llama", |d| {
        edit_config(
            d,
            "rope_parameters",
            serde_json::json!({"rope_type": "yarn", "rope_theta": 1e4}),
        )
    });
    let err = DecoderConfig::from_dir(scaled.path()).unwrap_err();
    assert!(
        err.to_string()
            .contains("rope type \"yarn\" is not supported"),
        "{err}"
    );

    let lm = CausalLm::open(fixture("tiny-llama"), None).unwrap();
    let one = GenerateOptions {
        max_new_tokens: 1,
        ..Default::default()
    };
    assert_eq!(
        lm.generate_ids(&[], &one).unwrap_err().to_string(),
        "prompt is empty"
    );
    assert_eq!(
        lm.generate_ids(&[1, 256], &one).unwrap_err().to_string(),
        "token id 256 is out of the vocabulary (size 256)"
    );
    assert!(CausalLm::open(fixture("tiny-llama"), Some(DType::I32)).is_err());
}
