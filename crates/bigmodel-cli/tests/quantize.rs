//! `--quantize` on `run`, `plan`, `embed` and `shard`, on the tiny Llama of
//! tools/make_bnb_fixtures.py: logits against transformers + bitsandbytes',
//! packed bytes streamed and planned, the folder `shard --quantize` writes
//! against the one transformers saved, and bad input.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{
    Tensor, bigmodel, failure, fixture, json_of, max_abs_diff, read_safetensors, write_safetensors,
};
use serde_json::{Value, json};

fn base() -> PathBuf {
    fixture("tiny-llama-bnb/base")
}

/// A device map file putting the decoder layer on disk.
fn disk_map(dir: &Path) -> PathBuf {
    let path = dir.join("map.json");
    let map = json!({
        "model.embed_tokens": "cpu", "model.layers.0": "disk", "model.norm": "cpu",
        "model.rotary_emb": "cpu", "lm_head": "cpu",
    });
    std::fs::write(&path, map.to_string()).unwrap();
    path
}

// `--quantize fp4` is the format of the committed fp4 folder (no double
// quantization, compute in f32), so its logits are transformers'.
#[test]
fn run_quantized_offloaded_matches_bitsandbytes_and_streams_packed_bytes() {
    let reference = read_safetensors(&fixture("tiny-llama-bnb/reference.safetensors"));
    let ids: Vec<String> = reference["prompt.0"]
        .bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()).to_string())
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let map = disk_map(dir.path());
    let run = |quantize: Option<&str>, dump: &Path| {
        let mut args = vec![
            "run".to_string(),
            base().display().to_string(),
            "--prompt-ids".into(),
            ids.join(","),
            "--device-map".into(),
            map.display().to_string(),
            "--offload-folder".into(),
            dir.path().join("offload").display().to_string(),
            "--dtype".into(),
            "f32".into(),
            "--max-new-tokens".into(),
            "2".into(),
            "--dump-logits".into(),
            dump.display().to_string(),
            "--json".into(),
        ];
        if let Some(q) = quantize {
            args.extend(["--quantize".into(), q.into()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        json_of(&bigmodel(&args))
    };
    let dump = dir.path().join("fp4.safetensors");
    let fp4 = run(Some("fp4"), &dump);
    let ours = &read_safetensors(&dump)["logits"].bytes;
    let diff = max_abs_diff(ours, &reference["logits_fp4.0"].bytes);
    assert!(diff <= 1e-3, "max |diff| {diff}");
    let dense = run(None, &dir.path().join("dense.safetensors"));
    let streamed = |v: &Value| v["bytes_streamed_per_token"].as_u64().unwrap();
    // The layer's seven projections at 4.5 bits a value instead of 32.
    assert!(
        streamed(&fp4) > 0 && streamed(&fp4) * 4 < streamed(&dense),
        "fp4 {} dense {}",
        streamed(&fp4),
        streamed(&dense)
    );
}

#[test]
fn plan_sizes_quantized_layers_packed() {
    let config = base().join("config.json");
    let plan = |quantize: Option<&str>| {
        let mut args = vec![
            "plan",
            config.to_str().unwrap(),
            "--max-memory",
            "cpu=1GiB",
            "--json",
        ];
        if let Some(q) = quantize {
            args.extend(["--quantize", q]);
        }
        let v = json_of(&bigmodel(&args));
        v["device_bytes"]["cpu"].as_u64().unwrap()
    };
    let (dense, nf4, int8) = (plan(None), plan(Some("nf4")), plan(Some("int8")));
    assert!(nf4 < int8 && int8 < dense, "{nf4} {int8} {dense}");
    let err = failure(&bigmodel(&[
        "plan",
        config.to_str().unwrap(),
        "--quantize",
        "int4",
    ]));
    assert!(
        err.contains("--quantize: ") && err.contains("\"int4\" (use nf4, fp4 or int8)"),
        "{err}"
    );
}

// A folder transformers saved pre-quantized is planned at the bytes its
// checkpoint stores, not as the dense model its config.json describes:
// every tensor but the 4-bit `quant_map` table (bitsandbytes' own, not
// held) and the JSON quant state, of which the double-quantization offset
// (4 bytes) is held.
#[test]
fn plan_of_a_pre_quantized_folder_counts_its_packed_bytes() {
    let cpu_bytes = |source: &Path, quantize: Option<&str>| {
        let mut args = vec![
            "plan",
            source.to_str().unwrap(),
            "--max-memory",
            "cpu=1GiB",
            // base/config.json says float16 over float32 weights.
            "--dtype",
            "f32",
            "--json",
        ];
        if let Some(q) = quantize {
            args.extend(["--quantize", q]);
        }
        let v = json_of(&bigmodel(&args));
        v["device_bytes"]["cpu"].as_u64().unwrap()
    };
    let dense = cpu_bytes(&base(), None);
    // base/ stores float16: its tensors in float32.
    let stored_dense: u64 = read_safetensors(&base().join("model.safetensors"))
        .values()
        .map(|t| 4 * t.shape.iter().product::<usize>() as u64)
        .sum();
    // The buffers config.json declares that no checkpoint stores (rotary
    // frequencies).
    let buffers = dense - stored_dense;
    for format in ["nf4", "fp4", "int8"] {
        let folder = fixture(&format!("tiny-llama-bnb/{format}"));
        let stored: u64 = read_safetensors(&folder.join("model.safetensors"))
            .iter()
            .map(|(name, Tensor { bytes, .. })| {
                if name.ends_with(".quant_map") && !name.ends_with(".nested_quant_map")
                    || name.contains(".quant_state.")
                    || name.ends_with(".weight_format")
                {
                    0
                } else if name.ends_with(".nested_absmax") {
                    bytes.len() as u64 + 4
                } else {
                    bytes.len() as u64
                }
            })
            .sum();
        let planned = cpu_bytes(&folder, None);
        assert_eq!(planned, stored + buffers, "{format}");
        assert!(planned < dense, "{format}: {planned} vs dense {dense}");
        // The same as planning the dense folder with that format.
        if format != "nf4" {
            assert_eq!(planned, cpu_bytes(&base(), Some(format)), "{format}");
        }
        let err = failure(&bigmodel(&[
            "plan",
            folder.to_str().unwrap(),
            "--quantize",
            "nf4",
        ]));
        assert!(err.contains("already quantized"), "{err}");
    }
    // Its sizes come from the checkpoint: without one it is an error.
    let config_only = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture("tiny-llama-bnb/nf4/config.json"),
        config_only.path().join("config.json"),
    )
    .unwrap();
    let err = failure(&bigmodel(&[
        "plan",
        config_only.path().to_str().unwrap(),
        "--max-memory",
        "cpu=1GiB",
    ]));
    assert!(
        err.contains("quantization_config") && err.contains("pre-quantized"),
        "{err}"
    );
}

// transformers' `llm_int8_enable_fp32_cpu_offload`: with a device map, the
// modules it offloads stay dense; planned and loaded alike.
#[test]
fn fp32_cpu_offload_keeps_offloaded_layers_dense() {
    let dir = tempfile::tempdir().unwrap();
    let base = base();
    let map = disk_map(dir.path());
    let disk_bytes = |extra: &[&str]| {
        let mut args = vec![
            "plan",
            base.to_str().unwrap(),
            "--device-map",
            map.to_str().unwrap(),
            "--json",
        ];
        args.extend(extra);
        let v = json_of(&bigmodel(&args));
        v["device_bytes"]["disk"].as_u64().unwrap()
    };
    let dense = disk_bytes(&[]);
    let packed = disk_bytes(&["--quantize", "int8"]);
    let kept = disk_bytes(&["--quantize", "int8", "--fp32-cpu-offload"]);
    assert!(packed < dense, "{packed} vs {dense}");
    assert_eq!(kept, dense);
    // Loaded so: the run's logits are the dense model's, bit for bit (the
    // only quantized layer is offloaded, the head is skipped).
    let logits = |extra: &[&str], name: &str| {
        let dump = dir.path().join(name);
        let mut args = vec![
            "run",
            base.to_str().unwrap(),
            "--prompt-ids",
            "1,5,9",
            "--max-new-tokens",
            "1",
            "--device-map",
            map.to_str().unwrap(),
            "--offload-folder",
        ];
        let offload = dir.path().join(format!("offload-{name}"));
        args.push(offload.to_str().unwrap());
        args.extend(["--dump-logits", dump.to_str().unwrap(), "--json"]);
        args.extend(extra);
        json_of(&bigmodel(&args));
        read_safetensors(&dump).remove("logits").unwrap().bytes
    };
    assert_eq!(
        logits(
            &["--quantize", "int8", "--fp32-cpu-offload"],
            "kept.safetensors"
        ),
        logits(&[], "dense.safetensors")
    );
    // A strategy cannot say what it would offload.
    let err = failure(&bigmodel(&[
        "plan",
        base.to_str().unwrap(),
        "--quantize",
        "int8",
        "--fp32-cpu-offload",
        "--max-memory",
        "cpu=1GiB",
    ]));
    assert!(
        err.contains("llm_int8_enable_fp32_cpu_offload needs a device map"),
        "{err}"
    );
    let err = failure(&bigmodel(&[
        "plan",
        base.to_str().unwrap(),
        "--fp32-cpu-offload",
    ]));
    assert!(err.contains("--quantize"), "{err}");
}

// transformers saved fp4/ and int8/ after loading base/ in float32 with
// that BitsAndBytesConfig: `shard --quantize --dtype f32` writes the same
// tensors, bit for bit, and a config transformers reads back.
#[test]
fn shard_quantize_writes_what_transformers_saves() {
    let dir = tempfile::tempdir().unwrap();
    for format in ["fp4", "int8"] {
        let out = dir.path().join(format);
        let v = json_of(&bigmodel(&[
            "shard",
            base().to_str().unwrap(),
            out.to_str().unwrap(),
            "--max-shard-size",
            "1GB",
            "--dtype",
            "f32",
            "--quantize",
            format,
            "--json",
        ]));
        assert_eq!(v["files"].as_array().unwrap().len(), 1, "{v}");
        let ours = read_safetensors(&out.join("model.safetensors"));
        let saved = read_safetensors(&fixture(&format!(
            "tiny-llama-bnb/{format}/model.safetensors"
        )));
        assert_eq!(
            ours.keys().collect::<Vec<_>>(),
            saved.keys().collect::<Vec<_>>(),
            "{format}"
        );
        for (name, tensor) in &saved {
            assert!(&ours[name] == tensor, "{format}: {name} differs");
        }
        let config: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        let q = &config["quantization_config"];
        assert_eq!(q["quant_method"], "bitsandbytes");
        assert_eq!(q["load_in_4bit"], format == "fp4");
        assert_eq!(q["load_in_8bit"], format == "int8");
        assert_eq!(config["dtype"], "float32");
        // And bigmodel runs what it wrote without being told.
        json_of(&bigmodel(&[
            "run",
            out.to_str().unwrap(),
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "1",
            "--json",
        ]));
    }
    let again = failure(&bigmodel(&[
        "shard",
        dir.path().join("fp4").to_str().unwrap(),
        dir.path().join("twice").to_str().unwrap(),
        "--max-shard-size",
        "1GB",
        "--quantize",
        "nf4",
    ]));
    assert!(again.contains("already quantized"), "{again}");
}

// tiny-bert is a task model (`bert.` names), whose tree comes from the
// checkpoint (no class names, nothing to quantize); saved as a bare
// BertModel its tree comes from config.json.
#[test]
fn embed_quantized_stays_close_to_dense() {
    let dir = tempfile::tempdir().unwrap();
    let bert = dir.path().join("bert");
    std::fs::create_dir(&bert).unwrap();
    std::fs::copy(
        fixture("tiny-bert").join("tokenizer.json"),
        bert.join("tokenizer.json"),
    )
    .unwrap();
    let config = std::fs::read_to_string(fixture("tiny-bert").join("config.json")).unwrap();
    let mut config: Value = serde_json::from_str(&config).unwrap();
    config["architectures"] = json!(["BertModel"]);
    std::fs::write(bert.join("config.json"), config.to_string()).unwrap();
    let bare = read_safetensors(&fixture("tiny-bert").join("model.safetensors"))
        .into_iter()
        .filter_map(|(name, t)| name.strip_prefix("bert.").map(|n| (n.to_string(), t)))
        .collect();
    write_safetensors(&bert.join("model.safetensors"), &bare);
    let err = failure(&bigmodel(&[
        "embed",
        fixture("tiny-bert").to_str().unwrap(),
        "text",
        "--quantize",
        "nf4",
    ]));
    assert!(err.contains("no Linear or Conv1D module"), "{err}");
    let embed = |quantize: Option<&str>| {
        let mut args = vec![bert.to_str().unwrap(), "a quantized sentence", "--json"];
        args.insert(0, "embed");
        if let Some(q) = quantize {
            args.extend(["--quantize", q]);
        }
        let v = json_of(&bigmodel(&args));
        v["embeddings"][0]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect::<Vec<_>>()
    };
    let dense = embed(None);
    let int8 = embed(Some("int8"));
    // Unit vectors: cosine similarity is the dot product.
    let cosine: f64 = dense.iter().zip(&int8).map(|(a, b)| a * b).sum();
    assert!(cosine > 0.99 && cosine < 1.0 + 1e-9, "cosine {cosine}");
}

/// A safetensors file's tensors by name.
type Tensors = BTreeMap<String, Tensor>;

// A pre-quantized folder with a part missing or unsupported: `plan` and
// `run` end with an error naming the weight and the field, never a panic.
#[test]
fn broken_pre_quantized_folders_are_errors_naming_tensor_and_field() {
    const Q: &str = "model.layers.0.self_attn.q_proj.weight";
    let dir = tempfile::tempdir().unwrap();
    let source = fixture("tiny-llama-bnb/nf4");
    let broken = |name: &str, edit: &dyn Fn(&mut Tensors)| {
        let folder = dir.path().join(name);
        std::fs::create_dir_all(&folder).unwrap();
        std::fs::copy(source.join("config.json"), folder.join("config.json")).unwrap();
        let mut tensors = read_safetensors(&source.join("model.safetensors"));
        edit(&mut tensors);
        write_safetensors(&folder.join("model.safetensors"), &tensors);
        folder
    };
    let state_key = format!("{Q}.quant_state.bitsandbytes__nf4");
    let set_state = |key: &'static str, value: Value| {
        let state_key = state_key.clone();
        move |t: &mut Tensors| {
            let entry = t.get_mut(&state_key).unwrap();
            let mut state: Value = serde_json::from_slice(&entry.bytes).unwrap();
            state[key] = value.clone();
            entry.bytes = state.to_string().into_bytes();
            entry.shape = vec![entry.bytes.len()];
        }
    };
    let cases = [
        (
            broken("no-absmax", &|t| drop(t.remove(&format!("{Q}.absmax")))),
            format!("quantized weight {Q}: absmax: entry {Q}.absmax is missing"),
        ),
        (
            broken("block-48", &set_state("blocksize", json!(48))),
            format!(
                "quantized weight {Q}: blocksize: unsupported quantization: 4-bit block size 48"
            ),
        ),
        (
            broken("int4", &|t| {
                let state = t.remove(&state_key).unwrap();
                t.insert(format!("{Q}.quant_state.bitsandbytes__int4"), state);
            }),
            format!(
                "quantized weight {Q}: quant_state: unsupported quantization: 4-bit quant type \"int4\""
            ),
        ),
    ];
    for (folder, want) in &cases {
        let folder = folder.to_str().unwrap();
        for args in [
            vec!["plan", folder, "--max-memory", "cpu=1GiB"],
            vec![
                "run",
                folder,
                "--prompt-ids",
                "1,2",
                "--max-new-tokens",
                "1",
            ],
        ] {
            let out = bigmodel(&args);
            let err = failure(&out);
            assert!(err.contains(want.as_str()), "{args:?}: {err}");
            assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        }
    }
}
