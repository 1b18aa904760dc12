//! `bigmodel plan` end to end: JSON keys, the human table, --explain, and
//! clear errors on bad input.

mod common;

use std::path::PathBuf;

use common::{bigmodel, write_raw_safetensors};

fn fixture(path: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../bm-plan/tests/fixtures")
        .join(path)
        .to_string_lossy()
        .into_owned()
}

fn plan(args: &[&str]) -> (bool, String, String) {
    let out = bigmodel(&[&["plan"], args].concat());
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn json_output_has_the_contract_keys_in_traversal_order() {
    let config = fixture("configs/qwen2-0.5b.json");
    let (ok, stdout, stderr) = plan(&[
        &config,
        "--max-memory",
        "0=300MB,1=300MB,cpu=200MB",
        "--compat",
        "accelerate",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let doc: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let map = doc["device_map"].as_object().unwrap();
    // Accelerate's answer (goldens.json) for this case.
    assert_eq!(map["model.embed_tokens"], 1);
    assert_eq!(map["lm_head"], 1);
    assert_eq!(map.keys().next().unwrap(), "model.embed_tokens");
    assert_eq!(doc["max_memory"]["0"], 300_000_000u64);
    assert!(doc["device_bytes"]["1"].as_u64().unwrap() > 0);
    assert!(
        doc["device_bytes"].get("0").is_none(),
        "Accelerate leaves GPU 0 empty here"
    );

    let (ok, stdout, stderr) = plan(&[
        &config,
        "--max-memory",
        "0=300MB,1=300MB,cpu=200MB",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let doc: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert!(
        doc["device_bytes"]["0"].as_u64().unwrap() > 0,
        "bigmodel uses GPU 0: {doc}"
    );
}

#[test]
fn human_table_and_explain() {
    let tree = fixture("trees/tiny-gpt2.tree.json");
    let (ok, stdout, stderr) = plan(&[
        &tree,
        "--max-memory",
        "0=20KB,cpu=1MB",
        "--no-split",
        "GPT2Block",
        "--explain",
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("device") && stdout.contains("placed") && stdout.contains("share"),
        "{stdout}"
    );
    assert!(stdout.lines().any(|l| l.starts_with("0 ")), "{stdout}");
    assert!(stderr.contains("->"), "explain trace on stderr: {stderr}");
    let (ok, _, stderr) = plan(&[
        &tree,
        "--max-memory",
        "0=20KB,cpu=1MB",
        "--compat",
        "accelerate",
        "--explain",
    ]);
    assert!(ok, "{stderr}");
    assert!(stderr.contains("Treating module transformer."), "{stderr}");
}

#[test]
fn bad_input_is_a_clear_error() {
    let config = fixture("configs/gpt2.json");
    for (args, needle) in [
        (
            vec!["--max-memory", "cuda:0=1GB"],
            "Device cuda:0 is not recognized",
        ),
        (
            vec!["--max-memory", "gpu=1GB"],
            "Device gpu is not recognized",
        ),
        (vec!["--max-memory", "0=10TB"], "is not in a valid format"),
        (
            vec!["--max-memory", "0="],
            "bad memory budget for 0: \"\" is not in a valid format",
        ),
        (
            vec!["--max-memory", "mps=1GB"],
            "mps (Apple Metal) is not supported",
        ),
        (vec!["--max-memory", "0=-5"], "negative"),
        (vec!["--max-memory", "0=99999999999GiB"], "too large"),
        (vec!["--max-memory", "0=2000000000GiB"], "1 EiB"),
        (vec!["--mode", "fast"], "expected auto"),
        (vec!["--dtype", "int8"], "expected f32"),
        (vec!["--max-memory", "0=1KB,disk=1KB"], "does not fit"),
    ] {
        let mut all = vec![config.as_str()];
        all.extend(args.iter());
        let (ok, stdout, stderr) = plan(&all);
        assert!(!ok, "{args:?} should fail");
        assert!(stdout.is_empty());
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let dir = tempfile::tempdir().unwrap();
    let bad_tree = dir.path().join("tree.json");
    std::fs::write(&bad_tree, r#"{"format":"bigmodel-module-tree/1","root":{"class":"M","children":[{"name":"a","class":"L","params":[{"name":"w","shape":[-1],"dtype":"F32"}]}]}}"#).unwrap();
    let (ok, _, stderr) = plan(&[bad_tree.to_str().unwrap(), "--max-memory", "cpu=1GB"]);
    assert!(!ok && stderr.contains("a.w"), "{stderr}");
    // A custom map that misses tensors lists them.
    let map = dir.path().join("map.json");
    std::fs::write(&map, r#"{"transformer.wte": 0, "transformer.h": "cpu"}"#).unwrap();
    let (ok, _, stderr) = plan(&[&config, "--device-map", map.to_str().unwrap()]);
    assert!(
        !ok && stderr.contains(
            "does not give any device for the following parameters: transformer.wpe.weight"
        ),
        "{stderr}"
    );
    // An unknown no-split class warns.
    let (ok, _, stderr) = plan(&[
        &config,
        "--max-memory",
        "cpu=1GB",
        "--no-split",
        "NoSuchBlock",
    ]);
    assert!(ok && stderr.contains("NoSuchBlock"), "{stderr}");
}

/// A minimal safetensors file: F32 tensors of the given shapes, zero-filled.
fn write_safetensors(path: &std::path::Path, tensors: &[(&str, &[usize])]) {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, shape) in tensors {
        let bytes = shape.iter().product::<usize>() * 4;
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let text = serde_json::Value::Object(header).to_string();
    write_raw_safetensors(path, &text, &vec![0; offset]);
}

#[test]
fn plans_a_checkpoint_from_its_headers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    write_safetensors(
        &path,
        &[
            ("emb.weight", &[100, 10]),
            ("layers.0.w", &[10, 10]),
            ("layers.1.w", &[10, 10]),
            ("head.weight", &[100, 10]),
        ],
    );
    let run = |budget: &str| {
        let (ok, stdout, stderr) = plan(&[
            path.to_str().unwrap(),
            "--max-memory",
            budget,
            "--no-split",
            "Layer",
            "--json",
        ]);
        assert!(ok, "{stderr}");
        serde_json::from_str::<serde_json::Value>(&stdout).unwrap()
    };
    // 8800 bytes fit on GPU 0 and nothing is offloaded, so nothing is reserved.
    // (The CPU budget also holds the host staging of a model
    // with GPUs.)
    let doc = run("0=9000,cpu=100MB");
    assert_eq!(doc["device_map"], serde_json::json!({"": 0}));
    assert_eq!(doc["device_bytes"]["0"], 8800);
    // With less room the 4000-byte units go to RAM; GPU 0 keeps 4000 bytes
    // to stream them and still holds the layers.
    let doc = run("0=6000,cpu=100MB");
    assert_eq!(
        doc["device_map"],
        serde_json::json!({"emb": "cpu", "layers": 0, "head": "cpu"})
    );
}

#[test]
fn the_ledger_is_in_the_json_and_the_explain_table() {
    let config = fixture("configs/llama-2-7b.json");
    let args = [
        config.as_str(),
        "--max-memory",
        "0=10GiB,1=10GiB,cpu=30GiB",
        "--max-seq-len",
        "4096",
        "--prompt-len",
        "1024",
        "--batch-size",
        "2",
    ];
    let (ok, stdout, stderr) = plan(&[&args[..], &["--json"]].concat());
    assert!(ok, "{stderr}");
    let doc: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let ledger = doc["ledger"].as_object().unwrap();
    let budgets = doc["max_memory"].as_object().unwrap();
    for (device, items) in ledger {
        let total: u64 = items
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_u64().unwrap())
            .sum();
        assert!(
            total <= budgets[device].as_u64().unwrap(),
            "{device}: {items}"
        );
    }
    // Keys and values of 32 layers · 2 · 4096 positions · 4096 wide · 2
    // sequences · 2 bytes, all on the GPUs.
    let kv: u64 = ["0", "1"]
        .iter()
        .map(|d| ledger[*d]["kv_cache"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(kv, 32 * 2 * 4096 * 4096 * 2 * 2);
    assert!(ledger["0"]["activations"].as_u64().unwrap() > 0);
    assert_eq!(
        ledger["cpu"]["staging"],
        ::bigmodel::dispatch::host_staging_bytes()
    );
    let (ok, _, stderr) = plan(&[&args[..], &["--explain"]].concat());
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("ledger for batch 2, prompt 1024 tokens"),
        "{stderr}"
    );
    assert!(
        stderr.contains("kv_cache") && stderr.contains("fits"),
        "{stderr}"
    );
    let (ok, _, stderr) =
        plan(&[&args[..3], &["--prompt-len", "9000", "--max-seq-len", "10"]].concat());
    assert!(
        !ok && stderr.contains("--prompt-len 9000 is longer"),
        "{stderr}"
    );
}

#[test]
fn verify_says_which_device_is_short_and_by_how_much() {
    let config = fixture("configs/llama-2-7b.json");
    // A few GiB fit the host; four TiB of KV cache fit no host.
    let (ok, _, stderr) = plan(&[
        &config,
        "--max-memory",
        "cpu=1GiB,disk=100GB",
        "--max-seq-len",
        "16",
        "--verify",
    ]);
    assert!(ok, "{stderr}");
    assert!(stderr.contains("--verify: fits"), "{stderr}");
    let (ok, _, stderr) = plan(&[
        &config,
        "--max-memory",
        "cpu=10000GiB",
        "--max-seq-len",
        "4096",
        "--batch-size",
        "1000",
        "--verify",
    ]);
    assert!(!ok, "{stderr}");
    assert!(stderr.contains("cpu is short by"), "{stderr}");
    // GPUs the machine does not have cannot be verified.
    let (ok, _, stderr) = plan(&[&config, "--max-memory", "0=100GiB,cpu=1GiB", "--verify"]);
    assert!(!ok && stderr.contains("GPU"), "{stderr}");
}

#[test]
fn a_folder_is_planned_in_the_dtype_run_loads_not_config_json_s() {
    // tiny-llama's F32 weights under a config.json that says float16: `run`
    // loads them in F32 (the checkpoint's dtype), so bigmodel plans F32.
    let dir = tempfile::tempdir().unwrap();
    common::copy_folder(&common::tiny_llama(), dir.path());
    common::edit_json(&dir.path().join("config.json"), |c| {
        c["dtype"] = "float16".into()
    });
    let folder = dir.path().to_string_lossy().into_owned();
    // Elements of the weights, and of rotary's two F32 buffers.
    let (weights, rotary) = (143_808u64, 16u64);
    let f32_bytes = (weights + rotary) * 4;
    let planned = |extra: &[&str]| {
        let (ok, stdout, stderr) = plan(
            &[
                &[folder.as_str(), "--max-memory", "cpu=64MB", "--json"],
                extra,
            ]
            .concat(),
        );
        assert!(ok, "{stderr}");
        serde_json::from_str::<serde_json::Value>(&stdout).unwrap()
    };
    let doc = planned(&[]);
    assert_eq!(doc["device_bytes"]["cpu"], f32_bytes);
    assert_eq!(doc["ledger"]["cpu"]["weights"], f32_bytes);
    // --dtype still decides.
    assert_eq!(
        planned(&["--dtype", "bf16"])["device_bytes"]["cpu"],
        f32_bytes / 2
    );
    // Accelerate sizes in the dtype it is given (none: the model's own,
    // config.json's float16 but for rotary's F32 buffers); the ledger of its
    // map is what loading that map allocates.
    let doc = planned(&["--compat", "accelerate"]);
    assert_eq!(doc["device_bytes"]["cpu"], weights * 2 + rotary * 4);
    assert_eq!(doc["ledger"]["cpu"]["weights"], f32_bytes);
}

/// T5 loaded in F16 keeps its feed-forward outputs `wo` in F32
/// (transformers' `_keep_in_fp32_modules`, as `run` loads it): `plan` sizes
/// them at 4 bytes an element and every other weight at 2, in the placed
/// bytes, the ledger and the table's total.
#[test]
fn a_t5_folder_in_f16_is_planned_with_wo_in_f32() {
    let dir = common::fixture("tiny-t5");
    let folder = dir.to_string_lossy().into_owned();
    let wo: u64 = common::read_safetensors(&dir.join("model.safetensors"))
        .iter()
        .filter(|(name, _)| name.contains(".wo."))
        .map(|(_, t)| t.shape.iter().product::<usize>() as u64)
        .sum();
    assert!(wo > 0);
    let planned = |dtype: &str| {
        let (ok, stdout, stderr) = plan(&[
            &folder,
            "--max-memory",
            "cpu=64MB",
            "--dtype",
            dtype,
            "--json",
        ]);
        assert!(ok, "{stderr}");
        serde_json::from_str::<serde_json::Value>(&stdout).unwrap()
    };
    let f32_bytes = planned("f32")["device_bytes"]["cpu"].as_u64().unwrap();
    let f16_bytes = (f32_bytes - wo * 4) / 2 + wo * 4;
    let doc = planned("f16");
    assert_eq!(doc["device_bytes"]["cpu"], f16_bytes, "{doc}");
    assert_eq!(doc["ledger"]["cpu"]["weights"], f16_bytes, "{doc}");
    // BF16 keeps nothing in F32 (T5 has no `_keep_in_fp32_modules_strict`).
    assert_eq!(planned("bf16")["device_bytes"]["cpu"], f32_bytes / 2);
    let (ok, stdout, stderr) = plan(&[&folder, "--max-memory", "cpu=64MB", "--dtype", "f16"]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains(&format!(
            "{} to place",
            bigmodel::plan::human_bytes(f16_bytes)
        )),
        "{stdout}"
    );
}

/// The JSON says the prefetch depth the plan holds streaming room for: the
/// one asked, or less where its room would leave the GPU nothing of its
/// own (run with it); Accelerate's planner holds none and has no key.
#[test]
fn the_json_says_the_prefetch_depth_the_plan_holds_room_for() {
    let tree = fixture("trees/tiny-gpt2.tree.json");
    let depth = |budgets: &str, extra: &[&str]| {
        let (ok, stdout, stderr) =
            plan(&[&[tree.as_str(), "--max-memory", budgets, "--json"], extra].concat());
        assert!(ok, "{stderr}");
        serde_json::from_str::<serde_json::Value>(&stdout).unwrap()["prefetch_depth"].clone()
    };
    assert_eq!(depth("cpu=1MB", &[]), 1);
    assert_eq!(depth("cpu=1MB", &["--prefetch-depth", "3"]), 3);
    let lowered = depth("0=12KB,cpu=1MB", &["--prefetch-depth", "3"]);
    assert!(lowered.as_u64().unwrap() < 3, "{lowered}");
    assert!(depth("cpu=1MB", &["--compat", "accelerate"]).is_null());
}
