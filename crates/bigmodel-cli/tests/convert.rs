//! PyTorch `.bin` checkpoints on the command line: `convert` writes the
//! tensors torch saved (checked against the hashes the fixture script
//! recorded from torch.load, since CI has no torch; tools/torch_bin_parity.py
//! checks transformers' logits locally), `inspect`, `plan` and `run` read
//! `.bin` folders (run against transformers' logits and tokens), and a
//! malicious pickle is refused with nothing run.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{bigmodel, fails, json_of, succeeds};
use serde_json::Value;

fn torch_fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../bm-shard/tests/fixtures/torch")
        .join(rel)
}

/// The built binary run in `cwd` (relative paths resolve there).
fn bigmodel_in(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_bigmodel"))
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("run bigmodel")
}

fn fnv1a64(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("{h:016x}")
}

/// `{name: {dtype, shape, fnv1a64}}` of every safetensors file in `dir`.
fn written_tensors(dir: &Path) -> serde_json::Map<String, Value> {
    let mut out = serde_json::Map::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        assert_eq!(header["__metadata__"], serde_json::json!({"format": "pt"}));
        for (name, t) in header.as_object().unwrap() {
            if name == "__metadata__" {
                continue;
            }
            let (a, b) = (
                t["data_offsets"][0].as_u64().unwrap() as usize,
                t["data_offsets"][1].as_u64().unwrap() as usize,
            );
            let data = &bytes[8 + n + a..8 + n + b];
            out.insert(
                name.clone(),
                serde_json::json!({"dtype": t["dtype"], "shape": t["shape"], "fnv1a64": fnv1a64(data)}),
            );
        }
    }
    out
}

fn expected(key: &str) -> serde_json::Map<String, Value> {
    let all: Value =
        serde_json::from_slice(&std::fs::read(torch_fixture("expected.json")).unwrap()).unwrap();
    all[key].as_object().unwrap().clone()
}

#[test]
fn convert_writes_the_tensors_torch_saved() {
    let dir = tempfile::tempdir().unwrap();
    // Tied embeddings: lm_head.weight is the same storage, written once.
    let out = dir.path().join("llama");
    let v = json_of(&bigmodel(&[
        "convert",
        torch_fixture("tiny-llama").to_str().unwrap(),
        out.to_str().unwrap(),
        "--json",
    ]));
    assert_eq!(
        v["dropped_ties"],
        serde_json::json!([["lm_head.weight", "model.embed_tokens.weight"]])
    );
    let mut want = expected("tiny-llama");
    want.remove("lm_head.weight");
    assert_eq!(written_tensors(&out), want);
    let mut files: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        ["config.json", "model.safetensors", "reference.json"]
    );

    // Sharded input, small shards: every dtype, as torch.load returns it.
    let out = dir.path().join("sharded");
    let v = json_of(&bigmodel(&[
        "convert",
        torch_fixture("sharded").to_str().unwrap(),
        out.to_str().unwrap(),
        "--max-shard-size",
        "100",
        "--json",
    ]));
    assert!(v["files"].as_array().unwrap().len() > 1);
    assert!(out.join("model.safetensors.index.json").is_file());
    assert_eq!(written_tensors(&out), expected("sharded"));

    // Strided views are written gathered, in C order.
    let out = dir.path().join("views");
    succeeds(&bigmodel(&[
        "convert",
        torch_fixture("shared.bin").to_str().unwrap(),
        out.to_str().unwrap(),
    ]));
    let mut want = expected("shared.bin");
    want.remove("lm_head.weight");
    assert_eq!(written_tensors(&out), want);
}

#[test]
fn convert_with_a_dtype_matches_shard() {
    let dir = tempfile::tempdir().unwrap();
    let bin = torch_fixture("tiny-llama");
    let converted = dir.path().join("bf16");
    json_of(&bigmodel(&[
        "convert",
        bin.to_str().unwrap(),
        converted.to_str().unwrap(),
        "--dtype",
        "bf16",
        "--json",
    ]));
    // The same through safetensors: convert, then shard with the cast.
    let f32 = dir.path().join("f32");
    succeeds(&bigmodel(&[
        "convert",
        bin.to_str().unwrap(),
        f32.to_str().unwrap(),
    ]));
    let sharded = dir.path().join("sharded");
    succeeds(&bigmodel(&[
        "shard",
        f32.to_str().unwrap(),
        sharded.to_str().unwrap(),
        "--max-shard-size",
        "50GB",
        "--dtype",
        "bf16",
    ]));
    let got = written_tensors(&converted);
    assert_eq!(got, written_tensors(&sharded));
    assert!(got.values().all(|t| t["dtype"] == "BF16"));
}

#[test]
fn run_inspect_and_plan_read_a_bin_folder() {
    let model = torch_fixture("tiny-llama");
    let reference: Value =
        serde_json::from_slice(&std::fs::read(model.join("reference.json")).unwrap()).unwrap();
    let prompt: Vec<String> = reference["prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i.to_string())
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("logits.safetensors");
    let v = json_of(&bigmodel(&[
        "run",
        model.to_str().unwrap(),
        "--prompt-ids",
        &prompt.join(","),
        "--max-new-tokens",
        "6",
        "--dump-logits",
        dump.to_str().unwrap(),
        "--json",
    ]));
    assert_eq!(v["generated_ids"], reference["generated"]);
    let bytes = std::fs::read(&dump).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let got: Vec<f32> = bytes[8 + n..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let want: Vec<f32> = reference["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| row.as_array().unwrap().iter())
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    assert_eq!(got.len(), want.len());
    let diff = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(diff <= 1e-4, "max |diff| {diff}");

    // inspect counts the tied embedding once, as plan sizes it.
    let v = json_of(&bigmodel(&["inspect", model.to_str().unwrap(), "--json"]));
    assert_eq!(
        v["tied"],
        serde_json::json!([["model.embed_tokens.weight", "lm_head.weight"]])
    );
    assert_eq!(v["tensors"], 21);
    let total = v["total_bytes"].as_u64().unwrap();
    let bin = model.join("pytorch_model.bin");
    let v = json_of(&bigmodel(&["plan", bin.to_str().unwrap(), "--json"]));
    let placed: u64 = v["device_bytes"]
        .as_object()
        .unwrap()
        .values()
        .map(|b| b.as_u64().unwrap())
        .sum();
    assert_eq!(placed, total);
}

#[test]
fn a_malicious_pickle_is_refused_and_runs_nothing() {
    for (file, global) in [
        ("malicious_system.bin", "posix.system"),
        ("malicious_exec.bin", "builtins.exec"),
        ("malicious_eval.bin", "builtins.eval"),
        ("malicious_popen.bin", "subprocess.Popen"),
    ] {
        // Each would create this file in the working directory if run.
        let cwd = tempfile::tempdir().unwrap();
        let bin = torch_fixture(&format!("bad/{file}"));
        let out = cwd.path().join("out");
        for args in [
            vec!["inspect", bin.to_str().unwrap()],
            vec!["convert", bin.to_str().unwrap(), out.to_str().unwrap()],
            vec!["plan", bin.to_str().unwrap()],
        ] {
            fails(&bigmodel_in(cwd.path(), &args), global);
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(!cwd.path().join("bigmodel-pickle-was-run").exists());
        assert!(!out.exists(), "convert wrote output for {file}");
    }
}

#[test]
fn convert_refuses_bad_input_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    for (file, needle) in [
        (
            "bad/missing_record.bin",
            "record archive/data/7: is missing",
        ),
        (
            "bad/complex64.bin",
            "unknown torch dtype (torch.ComplexFloatStorage)",
        ),
        ("bad/deflated.bin", "is compressed with method 8 (deflate)"),
    ] {
        let bin = torch_fixture(file);
        fails(
            &bigmodel(&["convert", bin.to_str().unwrap(), out.to_str().unwrap()]),
            needle,
        );
        assert!(!out.exists());
    }
    // The input's own folder is refused, as by shard.
    let folder = dir.path().join("model");
    std::fs::create_dir(&folder).unwrap();
    std::fs::copy(torch_fixture("plain.bin"), folder.join("pytorch_model.bin")).unwrap();
    fails(
        &bigmodel(&[
            "convert",
            folder.to_str().unwrap(),
            folder.to_str().unwrap(),
        ]),
        "holds the checkpoint being read",
    );
    assert_eq!(std::fs::read_dir(&folder).unwrap().count(), 1);
}
