//! `bigmodel run` on the tiny Llama fixture of bm-models: JSON keys, the
//! logits dump against transformers' logits, a CPU + disk map streaming
//! weights with the same output, and bad input; and on the tiny fixture of
//! every other decoder family, with and without disk offload.

mod common;

use std::path::Path;

use common::{
    bigmodel, fails_with, fixture, generated_ids, ids_arg, json_of, max_abs_diff, only_tensor,
    reference_ids_of, reference_of, tiny_llama,
};
use serde_json::{Value, json};

#[test]
fn json_has_every_key_and_greedy_ids_match_transformers() {
    let prompt = ids_arg(&reference_ids_of(&tiny_llama(), "prompt.0"));
    let want = reference_ids_of(&tiny_llama(), "generated.0");
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("logits.safetensors");
    let out = bigmodel(&[
        "run",
        tiny_llama().to_str().unwrap(),
        "--prompt-ids",
        &prompt,
        "--max-new-tokens",
        "8",
        "--dump-logits",
        dump.to_str().unwrap(),
        "--json",
    ]);
    let v = json_of(&out);
    for key in [
        "generated_ids",
        "text",
        "device_map",
        "load_seconds",
        "first_forward_seconds",
        "seconds_per_token",
        "bytes_streamed_per_token",
        "peak_host_bytes",
    ] {
        assert!(v.get(key).is_some(), "missing {key}: {v}");
    }
    let got = generated_ids(&v);
    // Generation stops early at eos (2); transformers' run did not.
    assert!(!got.is_empty() && got.len() <= want.len());
    assert_eq!(got[..], want[..got.len()]);
    assert!(got.len() == want.len() || got.last() == Some(&2));
    assert_eq!(v["bytes_streamed_per_token"], 0);
    assert!(v["peak_host_bytes"].as_u64().unwrap() > 0);

    let (name, dumped) = only_tensor(&dump);
    assert_eq!(
        (name.as_str(), dumped.shape.as_slice()),
        ("logits", &[5, 256][..])
    );
    let want = reference_of(&tiny_llama(), "logits.0");
    assert_eq!(dumped.shape, want.shape);
    let diff = max_abs_diff(&dumped.bytes, &want.bytes);
    assert!(diff <= 1e-4, "max |diff| {diff}");
}

#[test]
fn every_decoder_family_runs_in_memory_and_with_disk_offload() {
    for family in [
        "tiny-gpt2",
        "tiny-qwen3",
        "tiny-qwen2-swa",
        "tiny-gemma2",
        "tiny-phi3",
    ] {
        let model = fixture(family);
        // The longest prompt: past every sliding window.
        let prompt = ids_arg(&reference_ids_of(&model, "prompt.2"));
        let want = reference_ids_of(&model, "generated.2");
        let want_logits = reference_of(&model, "logits.2");
        let dir = tempfile::tempdir().unwrap();
        let dump = dir.path().join("logits.safetensors");
        let offload = dir.path().join("offload");
        let mut streamed = Vec::new();
        // Everything in RAM, then a CPU budget that sends layers to disk.
        for budget in [None, Some("cpu=30KB")] {
            let mut args = vec![
                "run",
                model.to_str().unwrap(),
                "--prompt-ids",
                &prompt,
                "--max-new-tokens",
                "8",
                "--dump-logits",
                dump.to_str().unwrap(),
                "--json",
            ];
            if let Some(budget) = budget {
                args.extend([
                    "--max-memory",
                    budget,
                    "--offload-folder",
                    offload.to_str().unwrap(),
                ]);
            }
            let v = json_of(&bigmodel(&args));
            let got = generated_ids(&v);
            // Generation stops early at eos (2); transformers' run did not.
            assert!(!got.is_empty(), "{family}");
            assert_eq!(got[..], want[..got.len()], "{family} {budget:?}");
            assert!(got.len() == want.len() || got.last() == Some(&2));
            streamed.push(v["bytes_streamed_per_token"].as_u64().unwrap());
            let (name, dumped) = only_tensor(&dump);
            assert_eq!(
                (name.as_str(), &dumped.shape),
                ("logits", &want_logits.shape)
            );
            let diff = max_abs_diff(&dumped.bytes, &want_logits.bytes);
            assert!(diff <= 1e-4, "{family} {budget:?}: max |diff| {diff}");
        }
        assert_eq!(streamed[0], 0, "{family}");
        assert!(streamed[1] > 0, "{family}: nothing went to disk");
    }
}

#[test]
fn a_cpu_and_disk_map_streams_weights_and_gives_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let map = json!({
        "model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
        "model.layers.2": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk",
    });
    let map_path = dir.path().join("map.json");
    std::fs::write(&map_path, map.to_string()).unwrap();
    let offload = dir.path().join("offload");
    let model = tiny_llama();
    let common = [
        "run",
        model.to_str().unwrap(),
        "--prompt",
        "Hello, wörld!",
        "--max-new-tokens",
        "6",
        "--json",
    ];
    let in_ram = json_of(&bigmodel(&common));
    let mut args = common.to_vec();
    args.extend([
        "--device-map",
        map_path.to_str().unwrap(),
        "--offload-folder",
        offload.to_str().unwrap(),
    ]);
    let offloaded = json_of(&bigmodel(&args));
    assert_eq!(offloaded["generated_ids"], in_ram["generated_ids"]);
    assert_eq!(offloaded["text"], in_ram["text"]);
    assert_eq!(offloaded["device_map"], map);
    // Layers 1 and 2 and lm_head, F32, per forward pass.
    let layer = 4 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64);
    assert_eq!(
        offloaded["bytes_streamed_per_token"],
        2 * layer + 4 * 256 * 64
    );

    // Human output: the device map table and the timings.
    let human = bigmodel(
        &args[..args.len()]
            .iter()
            .filter(|a| **a != "--json")
            .copied()
            .collect::<Vec<_>>(),
    );
    assert!(human.status.success());
    let text = String::from_utf8_lossy(&human.stdout);
    assert!(
        text.contains("model.layers.1") && text.contains("disk") && text.contains("s/token"),
        "{text}"
    );
}

/// `--experts-on disk` with a RAM budget too small for the model: the
/// planner keeps every layer's attention, norms and router in RAM and
/// refills the room the experts leave with experts, so fewer bytes stream
/// per token than under the whole-layer plan with its experts moved to
/// disk (what `--experts-on` did before, and still does to a given map),
/// and the output is the all-in-RAM output, bit for bit.
#[test]
fn experts_on_disk_refills_ram_and_streams_less_with_the_same_output() {
    for (family, budget) in [
        ("tiny-mixtral", "cpu=80KB"),
        ("tiny-qwen2-moe", "cpu=75KB"),
        ("tiny-qwen3-moe", "cpu=80KB"),
    ] {
        let model = fixture(family);
        let model = model.to_str().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let prompt = ids_arg(&reference_ids_of(Path::new(model), "prompt.2"));
        let run = |extra: &[&str], dump: &str| {
            let dump = dir.path().join(dump);
            let mut args = vec![
                "run",
                model,
                "--prompt-ids",
                &prompt,
                "--max-new-tokens",
                "6",
                "--dump-logits",
                dump.to_str().unwrap(),
                "--json",
            ];
            args.extend(extra);
            let v = json_of(&bigmodel(&args));
            (v, only_tensor(&dump).1.bytes)
        };
        let (in_ram, ram_logits) = run(&[], "ram.safetensors");
        let whole_layers = json_of(&bigmodel(&[
            "plan",
            model,
            "--max-memory",
            budget,
            "--json",
        ]));
        let map_path = dir.path().join("map.json");
        std::fs::write(&map_path, whole_layers["device_map"].to_string()).unwrap();
        let offload = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
        let (moved, moved_logits) = run(
            &[
                "--device-map",
                map_path.to_str().unwrap(),
                "--experts-on",
                "disk",
                "--offload-folder",
                &offload("moved"),
            ],
            "moved.safetensors",
        );
        let (refilled, refilled_logits) = run(
            &[
                "--max-memory",
                budget,
                "--experts-on",
                "disk",
                "--offload-folder",
                &offload("refilled"),
            ],
            "refilled.safetensors",
        );
        for (v, logits) in [(&moved, &moved_logits), (&refilled, &refilled_logits)] {
            assert_eq!(v["generated_ids"], in_ram["generated_ids"], "{family}");
            assert!(*logits == ram_logits, "{family}: logits differ");
        }
        // Some experts kept in RAM beside their layers, some on disk, and
        // every layer's attention in RAM.
        let map = refilled["device_map"].as_object().unwrap();
        let experts = |device: &str| {
            map.iter()
                .filter(|(k, v)| k.contains(".experts") && *v == device)
                .count()
        };
        assert!(
            experts("cpu") > 0 && experts("disk") > 0,
            "{family}: {map:?}"
        );
        assert!(
            map.iter()
                .all(|(k, v)| v == "cpu" || k.contains(".experts") || k == "lm_head"),
            "{family}: {map:?}"
        );
        let streamed = |v: &Value| v["bytes_streamed_per_token"].as_u64().unwrap();
        println!(
            "{family}: {budget}: {} bytes streamed per token with the experts refilled, {} with whole layers planned and their experts moved",
            streamed(&refilled),
            streamed(&moved)
        );
        assert!(
            streamed(&refilled) < streamed(&moved),
            "{family}: {} !< {}",
            streamed(&refilled),
            streamed(&moved)
        );
    }
}

#[test]
fn bad_input_is_a_clear_error() {
    let model = tiny_llama();
    let model = model.to_str().unwrap();
    let empty = tempfile::tempdir().unwrap();
    let e = empty.path().to_str().unwrap();
    fails_with(&["run", e, "--prompt-ids", "1"], "config.json");

    // config.json but no weights.
    let no_weights = tempfile::tempdir().unwrap();
    std::fs::copy(
        tiny_llama().join("config.json"),
        no_weights.path().join("config.json"),
    )
    .unwrap();
    fails_with(
        &[
            "run",
            no_weights.path().to_str().unwrap(),
            "--prompt-ids",
            "1",
        ],
        "no weights",
    );

    // Unsupported architecture, and a config disagreeing with the weights.
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(tiny_llama().join("config.json")).unwrap())
            .unwrap();
    std::fs::copy(
        tiny_llama().join("model.safetensors"),
        no_weights.path().join("model.safetensors"),
    )
    .unwrap();
    config["model_type"] = json!("gpt_neox");
    std::fs::write(no_weights.path().join("config.json"), config.to_string()).unwrap();
    fails_with(
        &[
            "run",
            no_weights.path().to_str().unwrap(),
            "--prompt-ids",
            "1",
        ],
        "supported are llama, mistral, qwen2, qwen3, gemma2, phi3, gpt2, mixtral, qwen2_moe, qwen3_moe",
    );
    config["model_type"] = json!("llama");
    config["hidden_size"] = json!(96);
    config["head_dim"] = json!(24);
    std::fs::write(no_weights.path().join("config.json"), config.to_string()).unwrap();
    fails_with(
        &[
            "run",
            no_weights.path().to_str().unwrap(),
            "--prompt-ids",
            "1",
        ],
        "model.embed_tokens.weight",
    );

    // GPT-2's learned positions end at n_positions (32): generation stops
    // there and says so, and a prompt that fills them leaves no room.
    let gpt2 = fixture("tiny-gpt2");
    let out = bigmodel(&[
        "run",
        gpt2.to_str().unwrap(),
        "--prompt-ids",
        &ids_arg(&[3; 30]),
        "--max-new-tokens",
        "8",
        "--json",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("at most 2 new tokens") && stderr.contains("32 positions"),
        "{stderr}"
    );
    assert_eq!(json_of(&out)["generated_ids"].as_array().unwrap().len(), 2);
    fails_with(
        &[
            "run",
            gpt2.to_str().unwrap(),
            "--prompt-ids",
            &ids_arg(&[3; 32]),
        ],
        "sequence of 33 tokens is longer than the model's 32 positions",
    );

    fails_with(&["run", model, "--prompt", ""], "--prompt is empty");
    fails_with(&["run", model, "--prompt-ids", ""], "--prompt-ids is empty");
    fails_with(
        &["run", model, "--prompt-ids", "1,x"],
        "\"x\" is not a token id",
    );
    fails_with(
        &["run", model, "--prompt-ids", "1,999"],
        "token id 999 is out of the vocabulary (size 256)",
    );
    fails_with(
        &["run", model, "--prompt-ids", "1", "--dtype", "i8"],
        "--dtype",
    );
    fails_with(
        &[
            "run",
            model,
            "--prompt-ids",
            "1",
            "--device-map",
            "/no/such/map.json",
        ],
        "--device-map",
    );
    fails_with(
        &[
            "run",
            model,
            "--prompt-ids",
            "1",
            "--max-memory",
            "cpu=lots",
        ],
        "--max-memory",
    );
    let map = empty.path().join("disk.json");
    std::fs::write(&map, r#"{"model": "cpu", "lm_head": "disk"}"#).unwrap();
    fails_with(
        &[
            "run",
            model,
            "--prompt-ids",
            "1",
            "--device-map",
            map.to_str().unwrap(),
        ],
        "offload_folder",
    );
}

#[test]
fn run_verify_plans_with_the_generation_ledger_and_runs_under_it() {
    let model = tiny_llama();
    let out = bigmodel(&[
        "run",
        model.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "4",
        "--max-memory",
        "cpu=10MB",
        "--verify",
        "--json",
    ]);
    let doc = json_of(&out);
    assert_eq!(doc["generated_ids"].as_array().unwrap().len(), 4);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--verify: fits"));
    // A GPU this machine lacks fails the dry run before loading.
    let out = bigmodel(&[
        "run",
        model.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "--max-memory",
        "7=1MB,cpu=10MB",
        "--verify",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("GPU"), "{stderr}");
}

/// `--prefetch-depth` reaches the model that streams: a CPU budget sends
/// layers to disk, and every depth generates the same tokens.
#[test]
fn run_prefetch_depth_reaches_the_model() {
    let model = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    let offload = dir.path().join("offload");
    let mut generated = Vec::new();
    for (flag, depth) in [(None, 1), (Some("0"), 0), (Some("3"), 3)] {
        let mut args = vec![
            "run",
            model.to_str().unwrap(),
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "4",
            "--max-memory",
            "cpu=30KB",
            "--offload-folder",
            offload.to_str().unwrap(),
            "--json",
        ];
        args.extend(flag.iter().flat_map(|d| ["--prefetch-depth", *d]));
        let doc = json_of(&bigmodel(&args));
        assert!(doc["bytes_streamed_per_token"].as_u64().unwrap() > 0);
        assert_eq!(doc["prefetch_depth"], depth, "{flag:?}");
        generated.push(doc["generated_ids"].clone());
    }
    assert!(
        generated.iter().all(|g| *g == generated[0]),
        "{generated:?}"
    );
    let out = bigmodel(&[
        "run",
        model.to_str().unwrap(),
        "--prompt-ids",
        "1",
        "--prefetch-depth",
        "two",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("--prefetch-depth"),
        "{stderr}"
    );
}

/// `run --verify` on a T5 folder loaded in F16 plans its `wo` weights in
/// F32, as it loads them (transformers' `_keep_in_fp32_modules`): a CPU
/// budget of exactly the ledger with `wo` at 4 bytes an element keeps the
/// model in RAM, one byte less sends a block to disk.
#[test]
fn t5_run_verify_plans_wo_in_f32_under_f16() {
    let dir = fixture("tiny-t5");
    let folder = dir.to_str().unwrap();
    let wo: u64 = common::read_safetensors(&dir.join("model.safetensors"))
        .iter()
        .filter(|(name, _)| name.contains(".wo."))
        .map(|(_, t)| t.shape.iter().product::<usize>() as u64)
        .sum();
    // The workload of the run below: one prompt of 2 tokens, 2 new ones.
    let ledger = |dtype: &str| {
        let doc = json_of(&bigmodel(&[
            "plan",
            folder,
            "--dtype",
            dtype,
            "--prompt-len",
            "2",
            "--max-seq-len",
            "4",
            "--max-memory",
            "cpu=1GB",
            "--json",
        ]));
        let cpu = doc["ledger"]["cpu"].as_object().unwrap().clone();
        let total: u64 = cpu.values().map(|v| v.as_u64().unwrap()).sum();
        (cpu["weights"].as_u64().unwrap(), total)
    };
    let (f32_weights, _) = ledger("f32");
    let (f16_weights, f16_total) = ledger("f16");
    let charges = f16_total - f16_weights;
    let weights = (f32_weights - wo * 4) / 2 + wo * 4;
    let offload = tempfile::tempdir().unwrap();
    let map_under = |cpu: u64| {
        let budget = format!("cpu={cpu},disk=1GB");
        let doc = json_of(&bigmodel(&[
            "run",
            folder,
            "--dtype",
            "f16",
            "--prompt-ids",
            "5,6",
            "--max-new-tokens",
            "2",
            "--max-memory",
            &budget,
            "--offload-folder",
            offload.path().to_str().unwrap(),
            "--verify",
            "--json",
        ]));
        doc["device_map"].clone()
    };
    assert_eq!(map_under(weights + charges), json!({"": "cpu"}));
    let tight = map_under(weights + charges - 1);
    assert!(
        tight.as_object().unwrap().values().any(|d| d == "disk"),
        "{tight}"
    );
}

/// `run` on a T5 folder: the prompt is the encoder's input, the decoder
/// generates from `decoder_start_token_id`; `--dump-logits` writes the
/// first decoder step's logits, `[1, vocab]`. The same under a CPU + disk
/// map that streams the decoder from disk.
#[test]
fn t5_takes_the_prompt_as_encoder_input() {
    for model in ["tiny-t5", "tiny-t5-relu"] {
        let dir = fixture(model);
        let prompt = ids_arg(&reference_ids_of(&dir, "prompt.3"));
        let want = reference_ids_of(&dir, "generated.3");
        let want_logits = reference_of(&dir, "logits.3");
        let out_dir = tempfile::tempdir().unwrap();
        let disk_map = out_dir.path().join("map.json");
        std::fs::write(
            &disk_map,
            json!({
                "shared": "cpu", "encoder": "cpu", "decoder.embed_tokens": "cpu",
                "decoder.block": "disk", "decoder.final_layer_norm": "cpu",
                "decoder.dropout": "cpu", "lm_head": "disk",
            })
            .to_string(),
        )
        .unwrap();
        let offload = out_dir.path().join("offload");
        let mut dumps = Vec::new();
        for (label, placement) in [
            ("all-cpu", vec![]),
            (
                "cpu+disk",
                vec![
                    "--device-map",
                    disk_map.to_str().unwrap(),
                    "--offload-folder",
                    offload.to_str().unwrap(),
                ],
            ),
        ] {
            let dump = out_dir.path().join(format!("{label}.safetensors"));
            let mut args = vec![
                "run",
                dir.to_str().unwrap(),
                "--prompt-ids",
                &prompt,
                "--max-new-tokens",
                "8",
                "--json",
                "--dump-logits",
                dump.to_str().unwrap(),
            ];
            args.extend(placement);
            let doc = json_of(&bigmodel(&args));
            assert_eq!(generated_ids(&doc), want, "{model} {label}");
            let streamed = doc["bytes_streamed_per_token"].as_u64().unwrap();
            assert_eq!(streamed > 0, label == "cpu+disk", "{model} {label}");
            let (name, dumped) = only_tensor(&dump);
            assert_eq!(
                (name.as_str(), &dumped.shape),
                ("logits", &want_logits.shape),
                "{model}"
            );
            let diff = max_abs_diff(&dumped.bytes, &want_logits.bytes);
            assert!(diff <= 1e-4, "{model} {label}: {diff}");
            dumps.push(dumped.bytes);
        }
        assert_eq!(dumps[0], dumps[1], "{model}: placements differ");
    }
    // Flags a T5 folder does not take are refused before loading.
    fails_with(
        &[
            "run",
            fixture("tiny-t5").to_str().unwrap(),
            "--prompt-ids",
            "5",
            "--batch-size",
            "2",
        ],
        "--batch-size is not supported for an encoder-decoder (t5) model",
    );
}
