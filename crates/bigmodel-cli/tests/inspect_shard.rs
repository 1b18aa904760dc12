//! `bigmodel inspect` and `bigmodel shard` through the built binary.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../bm-shard/tests/fixtures/hf_llama_tiny")
}

fn bigmodel(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_bigmodel"))
        .args(args)
        .output()
        .unwrap()
}

fn ok_json(args: &[&std::ffi::OsStr]) -> Value {
    let out = bigmodel(args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("--json prints one JSON document")
}

/// Fails with a one-paragraph message on stderr, not a panic.
fn fails(args: &[&std::ffi::OsStr]) -> String {
    let out = bigmodel(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "expected failure: {stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

macro_rules! args {
    ($($a:expr),* $(,)?) => { &[$(std::ffi::OsStr::new($a)),*] };
}

fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn inspect_json_summarises_the_fixture() {
    let v = ok_json(args!["inspect", fixture().as_os_str(), "--json"]);
    assert_eq!(v["tensors"], 21);
    assert_eq!(v["total_bytes"], 45376);
    assert_eq!(v["dtypes"], serde_json::json!({"BF16": 45376}));
    assert_eq!(v["modules"]["lm_head"], 4096);
    assert_eq!(v["modules"]["model"], 45376 - 4096);
    assert_eq!(v["largest_layer"]["name"], "model.layers.0");
    assert_eq!(v["files"].as_array().unwrap().len(), 3);
    let table = bigmodel(args!["inspect", fixture().as_os_str()]);
    assert!(String::from_utf8_lossy(&table.stdout).contains("tensors      21"));
}

#[test]
fn inspect_reads_a_sparse_32_gib_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.safetensors");
    let json = r#"{"w":{"dtype":"F32","shape":[8589934592],"data_offsets":[0,34359738368]}}"#;
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json.as_bytes());
    std::fs::write(&path, &bytes).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(bytes.len() as u64 + (32 << 30))
        .unwrap();
    let v = ok_json(args!["inspect", path.as_os_str(), "--json"]);
    assert_eq!(v["total_bytes"], 32u64 << 30);
}

#[test]
fn shard_then_inspect_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let v = ok_json(args![
        "shard",
        fixture().as_os_str(),
        out.as_os_str(),
        "--max-shard-size",
        "30KB",
        "--json"
    ]);
    assert_eq!(v["total_size"], 45376);
    assert_eq!(v["tensors"], 21);
    assert_eq!(
        listing(&out),
        [
            "config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json"
        ]
    );
    let back = ok_json(args!["inspect", out.as_os_str(), "--json"]);
    assert_eq!(back["tensors"], 21);
    assert_eq!(back["total_bytes"], 45376);

    // --dtype f32 doubles the bf16 bytes; one shard suffices.
    let out32 = dir.path().join("out32");
    let v = ok_json(args![
        "shard",
        out.join("model.safetensors.index.json").as_os_str(),
        out32.as_os_str(),
        "--max-shard-size",
        "1GB",
        "--dtype",
        "f32",
        "--json"
    ]);
    assert_eq!(v["total_size"], 2 * 45376);
    assert_eq!(v["index"], Value::Null);
    assert_eq!(listing(&out32), ["config.json", "model.safetensors"]);
    let back = ok_json(args!["inspect", out32.as_os_str(), "--json"]);
    assert_eq!(back["dtypes"], serde_json::json!({"F32": 2 * 45376}));
}

#[test]
fn shard_refuses_bad_input_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let e = fails(args![
        "shard",
        fixture().as_os_str(),
        out.as_os_str(),
        "--max-shard-size",
        "10 parsecs"
    ]);
    assert!(e.contains("size \"10 parsecs\""), "{e}");
    let e = fails(args![
        "shard",
        fixture().as_os_str(),
        out.as_os_str(),
        "--max-shard-size",
        "1GB",
        "--dtype",
        "int3"
    ]);
    assert!(e.contains("--dtype \"int3\""), "{e}");
    let missing = dir.path().join("missing");
    let e = fails(args![
        "shard",
        missing.as_os_str(),
        out.as_os_str(),
        "--max-shard-size",
        "1GB"
    ]);
    assert!(e.contains("missing"), "{e}");
    assert!(!out.exists());

    // Writing into the checkpoint's own folder would destroy the source.
    let src = dir.path().join("src");
    std::fs::create_dir(&src).unwrap();
    for f in std::fs::read_dir(fixture()).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), src.join(f.file_name())).unwrap();
    }
    let before = listing(&src);
    let e = fails(args![
        "shard",
        src.as_os_str(),
        src.as_os_str(),
        "--max-shard-size",
        "1GB"
    ]);
    assert!(e.contains("holds the checkpoint being read"), "{e}");
    assert_eq!(listing(&src), before);

    // An output folder that cannot be created.
    let blocker = dir.path().join("blocker");
    std::fs::write(&blocker, b"x").unwrap();
    let e = fails(args![
        "shard",
        src.as_os_str(),
        blocker.join("out").as_os_str(),
        "--max-shard-size",
        "1GB"
    ]);
    assert!(e.contains("creating folder"), "{e}");
}

#[test]
fn inspect_errors_are_one_paragraph() {
    let dir = tempfile::tempdir().unwrap();
    let e = fails(args!["inspect", dir.path().as_os_str()]);
    assert!(
        e.contains("neither model.safetensors nor a *.index.json"),
        "{e}"
    );
    let bad = dir.path().join("bad.safetensors");
    std::fs::write(&bad, [255u8; 16]).unwrap();
    let e = fails(args!["inspect", bad.as_os_str(), "--json"]);
    assert!(
        e.contains("bad.safetensors") && e.contains("exceeds"),
        "{e}"
    );
}
