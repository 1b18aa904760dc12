//! The tiny random T5 models against transformers (fixtures from
//! tools/make_t5_fixtures.py): the first decoder step's logits in F32
//! within 1e-4 for prompts from 1 to 40 tokens (past the relative
//! buckets' exact and logarithmic ranges), and greedy tokens through the
//! decoder's KV cache against transformers recomputing every step.
//! `tiny-t5` is gated-gelu with its own head, `tiny-t5-relu` relu with the
//! head tied to `shared` and the decoder output scaled; it has more
//! decoder blocks than encoder blocks. F16 and BF16 run and stay close to
//! F32.

mod common;

use bm_models::{GenerateOptions, Seq2SeqLm};
use bm_tensor::DType;
use common::{Reference, copy_fixture, edit_json, fixture, max_abs_diff};

const MODELS: [&str; 2] = ["tiny-t5", "tiny-t5-relu"];

/// The first decoder step's logits for `prompt`: `[1, vocab]`.
fn first_step(lm: &Seq2SeqLm, prompt: &[u32]) -> (Vec<usize>, Vec<f32>) {
    let t5 = lm.model();
    let encoded = t5.encode(lm.weights(), prompt).unwrap();
    let mut cache = t5.new_cache(encoded);
    let start = t5.config().decoder_start_token_id;
    let logits = t5.decode(lm.weights(), &[start], &mut cache).unwrap();
    (
        logits.shape().to_vec(),
        logits.to_host().unwrap().to_f32_vec(),
    )
}

#[test]
fn first_decoder_step_logits_match_transformers_in_f32() {
    for model in MODELS {
        let reference = Reference::of(model);
        let lm = Seq2SeqLm::open(fixture(model), Some(DType::F32)).unwrap();
        assert!(reference.prompts() >= 4);
        for i in 0..reference.prompts() {
            let prompt = reference.ids(&format!("prompt.{i}"));
            let (want_shape, want) = reference.floats(&format!("logits.{i}"));
            let (shape, got) = first_step(&lm, &prompt);
            assert_eq!(shape, want_shape, "{model} prompt {i}");
            let diff = max_abs_diff(&got, &want);
            println!("{model} prompt {i}: max |diff| {diff:e}");
            assert!(diff <= 1e-4, "{model} prompt {i}: {diff}");
        }
    }
}

#[test]
fn greedy_tokens_through_the_cache_match_transformers() {
    for model in MODELS {
        let reference = Reference::of(model);
        let lm = Seq2SeqLm::open(fixture(model), Some(DType::F32)).unwrap();
        for i in 0..reference.prompts() {
            let prompt = reference.ids(&format!("prompt.{i}"));
            let want = reference.ids(&format!("generated.{i}"));
            let options = GenerateOptions {
                max_new_tokens: want.len(),
                keep_prompt_logits: true,
                ..GenerateOptions::default()
            };
            let mut seen = Vec::new();
            let generation = lm
                .generate_ids(&prompt, &options, &mut |t| seen.push(t))
                .unwrap();
            assert_eq!(generation.tokens, want, "{model} prompt {i}");
            assert_eq!(seen, want, "{model} prompt {i}: on_token");
            // The kept logits are the first step's.
            let kept = generation.prompt_logits.unwrap();
            assert_eq!(kept.to_f32_vec(), first_step(&lm, &prompt).1);
        }
        // A stop token ends generation (and is kept).
        let prompt = reference.ids("prompt.0");
        let first = reference.ids("generated.0")[0];
        let options = GenerateOptions {
            max_new_tokens: 8,
            stop_tokens: vec![first],
            ..GenerateOptions::default()
        };
        let generation = lm.generate_ids(&prompt, &options, &mut |_| {}).unwrap();
        assert_eq!(generation.tokens, [first], "{model}");
    }
}

#[test]
fn half_precision_runs_close_to_f32() {
    for model in MODELS {
        let reference = Reference::of(model);
        let prompt = reference.ids("prompt.2");
        let f32_lm = Seq2SeqLm::open(fixture(model), Some(DType::F32)).unwrap();
        let (_, full) = first_step(&f32_lm, &prompt);
        let largest = full.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
        for (dtype, tolerance) in [(DType::F16, 0.02), (DType::BF16, 0.1)] {
            let lm = Seq2SeqLm::open(fixture(model), Some(dtype)).unwrap();
            let (_, half) = first_step(&lm, &prompt);
            let diff = max_abs_diff(&half, &full) / largest;
            println!("{model} {dtype:?}: max relative |diff| {diff:e}");
            assert!(diff <= tolerance, "{model} {dtype:?}: {diff}");
        }
    }
}

/// A config.json with neither `decoder_start_token_id` nor
/// `bos_token_id` runs from generation_config.json's start token, as
/// transformers does, and gives the reference's tokens.
#[test]
fn the_start_token_may_come_from_generation_config_json_alone() {
    let dir = copy_fixture("tiny-t5");
    edit_json(&dir.path().join("config.json"), |c| {
        let c = c.as_object_mut().unwrap();
        c.remove("decoder_start_token_id");
        assert!(c.get("bos_token_id").is_none_or(|v| v.is_null()));
    });
    let lm = Seq2SeqLm::open(dir.path(), Some(DType::F32)).unwrap();
    assert_eq!(lm.model().config().decoder_start_token_id, 0);
    let reference = Reference::of("tiny-t5");
    let want = reference.ids("generated.0");
    let options = GenerateOptions {
        max_new_tokens: want.len(),
        ..GenerateOptions::default()
    };
    let generation = lm
        .generate_ids(&reference.ids("prompt.0"), &options, &mut |_| {})
        .unwrap();
    assert_eq!(generation.tokens, want);
}

#[test]
fn generation_config_start_token_overrides_config_json() {
    let dir = copy_fixture("tiny-t5");
    let generation = dir.path().join("generation_config.json");
    let edit = |start: u32| {
        edit_json(&generation, |g| g["decoder_start_token_id"] = start.into());
    };
    edit(7);
    let lm = Seq2SeqLm::open(dir.path(), Some(DType::F32)).unwrap();
    assert_eq!(lm.model().config().decoder_start_token_id, 7);
    edit(96);
    let err = Seq2SeqLm::open(dir.path(), Some(DType::F32))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("generation_config.json")
            && err.contains("\"decoder_start_token_id\"")
            && err.contains("96 is not below vocab_size 96"),
        "{err}"
    );
}
