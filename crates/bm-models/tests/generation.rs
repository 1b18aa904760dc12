//! Batched generation and sampling against transformers 5.23 (fixtures
//! from tools/make_generation_fixtures.py): every decoder fixture's three
//! prompts as one left-padded batch give transformers' greedy tokens, each
//! sequence stopping at its own end token, and each equal to its run alone
//! (but Phi-3's, whose LongRoPE factors follow the batch's longest);
//! the logits processors give transformers' scores on a fixture batch;
//! a seed makes sampling reproducible whatever the batch.

mod common;

use bm_models::{CausalLm, GenerateOptions, Sampling};
use bm_tensor::DType;
use common::{Reference, fixture};

const DECODERS: [&str; 8] = [
    "tiny-llama",
    "tiny-qwen2",
    "tiny-mistral",
    "tiny-gpt2",
    "tiny-qwen3",
    "tiny-qwen2-swa",
    "tiny-gemma2",
    "tiny-phi3",
];

#[test]
fn a_left_padded_batch_generates_transformers_tokens_and_each_prompts_own() {
    let reference = Reference::open(fixture("generation/batch.safetensors"));
    let mut mixed = 0;
    for model in DECODERS {
        let lm = CausalLm::open(fixture(model), Some(DType::F32)).unwrap();
        let prompts: Vec<Vec<u32>> = (0..3)
            .map(|i| reference.ids(&format!("{model}.prompt.{i}")))
            .collect();
        let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
        assert!(
            lens.iter().any(|&l| l != lens[0]),
            "{model}: prompts of one length test no padding"
        );
        let options = GenerateOptions {
            max_new_tokens: 10,
            stop_tokens: reference.ids(&format!("{model}.eos")),
            ..GenerateOptions::default()
        };
        let mut streamed = vec![Vec::new(); 3];
        let batch = lm
            .generate_batch(&prompts, &options, &mut |i, token| streamed[i].push(token))
            .unwrap();
        let want: Vec<Vec<u32>> = (0..3)
            .map(|i| reference.ids(&format!("{model}.generated.{i}")))
            .collect();
        let got: Vec<Vec<u32>> = batch.iter().map(|g| g.tokens.clone()).collect();
        assert_eq!(got, want, "{model}: the batch against transformers");
        assert_eq!(streamed, want, "{model}: tokens as they came");
        // The script picks an end token that stops some sequence early.
        assert!(want.iter().any(|w| w.len() < 10), "{model}: {want:?}");
        if want.iter().any(|w| w.len() == 10) {
            mixed += 1;
        }
        // Phi-3's LongRoPE picks its factors by the batch's longest
        // sequence (transformers too), so a short prompt alone may differ.
        if model == "tiny-phi3" {
            continue;
        }
        for (prompt, want) in prompts.iter().zip(&want) {
            let alone = lm.generate_ids(prompt, &options).unwrap();
            assert_eq!(&alone.tokens, want, "{model}: {prompt:?} alone");
        }
    }
    assert!(
        mixed >= 3,
        "batches where one sequence stops and another runs on: {mixed}"
    );
}

#[test]
fn the_logits_processors_give_transformers_scores() {
    let reference = Reference::open(fixture("generation/processors.safetensors"));
    let scores = reference.floats("scores").1;
    let history = reference.ids("input_ids");
    let (rows, vocab, seen) = (4, 64, 12);
    let sampling = Sampling {
        do_sample: true,
        ..Sampling::default()
    };
    let cases = [
        (
            "repetition_penalty=1.3",
            Sampling {
                repetition_penalty: 1.3,
                ..sampling.clone()
            },
        ),
        (
            "temperature=0.7",
            Sampling {
                temperature: 0.7,
                ..sampling.clone()
            },
        ),
        (
            "top_k=5",
            Sampling {
                top_k: 5,
                ..sampling.clone()
            },
        ),
        (
            "top_k=1",
            Sampling {
                top_k: 1,
                ..sampling.clone()
            },
        ),
        (
            "top_p=0.8",
            Sampling {
                top_p: 0.8,
                ..sampling.clone()
            },
        ),
        (
            "top_p=0.3",
            Sampling {
                top_p: 0.3,
                ..sampling.clone()
            },
        ),
        (
            "chain",
            Sampling {
                repetition_penalty: 1.2,
                temperature: 0.8,
                top_k: 10,
                top_p: 0.9,
                ..sampling.clone()
            },
        ),
    ];
    for (name, settings) in cases {
        let want = reference.floats(name).1;
        for r in 0..rows {
            let original = &scores[r * vocab..][..vocab];
            let mut row = original.to_vec();
            settings.process(&mut row, &history[r * seen..][..seen]);
            let want = &want[r * vocab..][..vocab];
            // Which of several equal logits top-p removes first is the
            // order torch.sort happens to give ties (unspecified): equal
            // logits are compared as a multiset, the others one by one.
            let tied = |i: usize| original.iter().filter(|&&v| v == original[i]).count() > 1;
            for i in (0..vocab).filter(|&i| !tied(i)) {
                assert_eq!(
                    row[i].to_bits(),
                    want[i].to_bits(),
                    "{name}, row {r}, token {i}"
                );
            }
            assert_eq!(sorted_bits(&row), sorted_bits(want), "{name}, row {r}");
        }
    }
}

/// The values' bit patterns, sorted: the multiset of values, compared
/// exactly (-inf included).
fn sorted_bits(values: &[f32]) -> Vec<u32> {
    let mut bits: Vec<u32> = values.iter().map(|v| v.to_bits()).collect();
    bits.sort_unstable();
    bits
}

#[test]
fn a_seed_gives_the_same_tokens_in_any_batch_and_top_k_1_is_greedy() {
    let lm = CausalLm::open(fixture("tiny-llama"), Some(DType::F32)).unwrap();
    let reference = Reference::open(fixture("generation/batch.safetensors"));
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| reference.ids(&format!("tiny-llama.prompt.{i}")))
        .collect();
    let sample = |seed: u64, top_k: usize| GenerateOptions {
        max_new_tokens: 12,
        sampling: Sampling {
            do_sample: true,
            // A flat distribution, so different seeds draw differently.
            temperature: 3.0,
            top_k,
            seed,
            ..Sampling::default()
        },
        ..GenerateOptions::default()
    };
    let tokens = |options: &GenerateOptions| -> Vec<Vec<u32>> {
        lm.generate_batch(&prompts, options, &mut |_, _| {})
            .unwrap()
            .into_iter()
            .map(|g| g.tokens)
            .collect()
    };
    let first = tokens(&sample(7, 0));
    assert_eq!(tokens(&sample(7, 0)), first, "same seed, same tokens");
    assert_ne!(tokens(&sample(8, 0)), first, "another seed, other tokens");
    // Prompt 2 alone draws from its own stream, as in the batch.
    let alone = lm
        .generate_batch(
            &prompts[2..],
            &GenerateOptions {
                first_stream: 2,
                ..sample(7, 0)
            },
            &mut |_, _| {},
        )
        .unwrap();
    assert_eq!(alone[0].tokens, first[2]);
    // Top-k 1 leaves one token to draw: the greedy one.
    let greedy = GenerateOptions {
        max_new_tokens: 12,
        ..GenerateOptions::default()
    };
    assert_eq!(tokens(&sample(9, 1)), tokens(&greedy));
}

#[test]
fn bad_settings_and_inputs_are_errors_naming_them() {
    let lm = CausalLm::open(fixture("tiny-llama"), Some(DType::F32)).unwrap();
    let run = |prompts: &[Vec<u32>], options: GenerateOptions| {
        lm.generate_batch(prompts, &options, &mut |_, _| {})
            .unwrap_err()
            .to_string()
    };
    let ok = GenerateOptions {
        max_new_tokens: 2,
        ..GenerateOptions::default()
    };
    let err = run(
        &[vec![1, 2]],
        GenerateOptions {
            sampling: Sampling {
                do_sample: true,
                top_p: 0.0,
                ..Sampling::default()
            },
            ..ok.clone()
        },
    );
    assert!(err.starts_with("top_p: 0 is not in (0, 1]"), "{err}");
    let err = run(
        &[vec![1, 2]],
        GenerateOptions {
            max_new_tokens: 0,
            ..ok.clone()
        },
    );
    assert!(err.starts_with("max_new_tokens"), "{err}");
    assert!(run(&[], ok.clone()).contains("prompts"));
    assert!(run(&[vec![1], vec![]], ok).contains("prompt"));
}

#[test]
fn generation_stops_at_the_models_positions_and_says_so() {
    let lm = CausalLm::open(fixture("tiny-llama"), Some(DType::F32)).unwrap();
    // 128 positions: a prompt of 125 leaves room for 3 new tokens.
    let long: Vec<u32> = (0..125).map(|i| 3 + i % 200).collect();
    let options = GenerateOptions {
        max_new_tokens: 1_000_000_000,
        ..GenerateOptions::default()
    };
    let batch = lm
        .generate_batch(&[long.clone(), vec![5, 6]], &options, &mut |_, _| {})
        .unwrap();
    assert_eq!((batch[0].tokens.len(), batch[0].capped_to), (3, Some(3)));
    assert_eq!(
        (batch[1].tokens.len(), batch[1].capped_to),
        (126, Some(126))
    );
    let full: Vec<u32> = (0..128).map(|i| 3 + i % 200).collect();
    let err = lm.generate_ids(&full, &options).unwrap_err().to_string();
    assert!(
        err.contains("129 tokens") && err.contains("128 positions"),
        "{err}"
    );
}

#[test]
fn auto_batch_size_halves_when_the_kv_cache_outgrows_an_emulated_gpu() {
    use bigmodel::device::DeviceSet;
    use bigmodel::plan::DeviceMap;
    use bigmodel::{DeviceMapSpec, Options};
    use bm_models::{BatchSize, open_causal_lm};
    use std::sync::Arc;

    let reference = Reference::open(fixture("generation/batch.safetensors"));
    let prompts: Vec<Vec<u32>> = (0..8)
        .map(|i| reference.ids(&format!("tiny-llama.prompt.{}", i % 3)))
        .collect();
    // Every block on the GPU (so no weight streams through it), each its
    // own map entry (so each layer runs in its own hooked block).
    let map = serde_json::json!({
        "model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0,
        "model.layers.2": 0, "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0,
    });
    let options = Options {
        device_map: Some(DeviceMapSpec::Map(DeviceMap::from_json(&map).unwrap())),
        force_hooks: true,
        ..Options::default()
    };
    let open = |budget: u64| {
        let devices = Arc::new(DeviceSet::emulated(&[budget]));
        let lm = open_causal_lm(fixture("tiny-llama"), Arc::clone(&devices), &options).unwrap();
        (lm, devices)
    };
    let weights = open(1 << 30).1.gpu(0).unwrap().live_bytes();
    // The 3 layers' caches take 768 bytes a position a sequence: 8
    // sequences of 12 + 10 positions take 135 KB, 4 take 68 KB, 2 take
    // 34 KB (held in steps that double: 37 KB).
    let (lm, devices) = open(weights + 45_000);
    let generate = GenerateOptions {
        max_new_tokens: 10,
        ..GenerateOptions::default()
    };
    let mut retries = Vec::new();
    let auto = lm
        .model
        .generate_in_batches(
            &prompts,
            BatchSize::Auto,
            &generate,
            &mut |_, _| {},
            &mut |size, e| retries.push((size, e.to_string())),
        )
        .unwrap();
    assert_eq!(auto.batch_size, 2);
    assert_eq!(auto.batch_seconds.len(), 4);
    let sizes: Vec<usize> = retries.iter().map(|(s, _)| *s).collect();
    assert_eq!(sizes, [4, 2], "{retries:?}");
    assert!(retries[0].1.contains("budget"), "{retries:?}");
    // Nothing of the failed tries stays allocated.
    assert_eq!(devices.gpu(0).unwrap().live_bytes(), weights);
    let cpu = CausalLm::open(fixture("tiny-llama"), Some(DType::F32)).unwrap();
    let alone = cpu
        .generate_in_batches(
            &prompts,
            BatchSize::Fixed(3),
            &generate,
            &mut |_, _| {},
            &mut |_, _| unreachable!("the CPU has no budget"),
        )
        .unwrap();
    let tokens =
        |g: &[bm_models::Generation]| g.iter().map(|g| g.tokens.clone()).collect::<Vec<_>>();
    assert_eq!(tokens(&auto.generations), tokens(&alone.generations));
    // A fixed size that does not fit is the device's error, not retried.
    let err = lm
        .model
        .generate_in_batches(
            &prompts,
            BatchSize::Fixed(8),
            &generate,
            &mut |_, _| {},
            &mut |_, _| unreachable!("a fixed size is not retried"),
        )
        .unwrap_err();
    assert!(bigmodel::OutOfMemory::is_out_of_memory(&err), "{err}");
    // Even one sequence that does not fit ends in Accelerate's error.
    let (tiny, _) = open(weights + 3_000);
    let err = tiny
        .model
        .generate_in_batches(
            &prompts,
            BatchSize::Auto,
            &generate,
            &mut |_, _| {},
            &mut |_, _| {},
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("No executable batch size found, reached zero"),
        "{err}"
    );
}

#[test]
fn a_conversation_reuses_its_cache_and_gives_a_fresh_generations_tokens() {
    for model in ["tiny-llama", "tiny-mistral"] {
        let lm = CausalLm::open(fixture(model), Some(DType::F32)).unwrap();
        let options = GenerateOptions {
            max_new_tokens: 5,
            ..GenerateOptions::default()
        };
        let mut conversation = lm.new_conversation();
        let first: Vec<u32> = vec![1, 15, 27, 100, 3];
        let reply = lm
            .generate_in_conversation(&mut conversation, &first, &options, &mut |_, _| {})
            .unwrap();
        assert_eq!(
            reply.tokens,
            lm.generate_ids(&first, &options).unwrap().tokens
        );
        assert_eq!(conversation.cached_tokens().len(), first.len() + 4);
        // The next turn: the reply and a new message after it.
        let mut second = first.clone();
        second.extend(&reply.tokens);
        second.extend([40, 41, 42, 43, 44, 45, 46, 47]);
        let again = lm
            .generate_in_conversation(&mut conversation, &second, &options, &mut |_, _| {})
            .unwrap();
        assert_eq!(
            again.tokens,
            lm.generate_ids(&second, &options).unwrap().tokens,
            "{model}: second turn"
        );
        // A history that leaves the cached one early (an edited message):
        // rewound, or (Mistral's window dropped the prefix) started afresh.
        let edited: Vec<u32> = vec![1, 15, 99, 5, 6, 7, 8];
        let third = lm
            .generate_in_conversation(&mut conversation, &edited, &options, &mut |_, _| {})
            .unwrap();
        assert_eq!(
            third.tokens,
            lm.generate_ids(&edited, &options).unwrap().tokens,
            "{model}: edited history"
        );
    }
}
