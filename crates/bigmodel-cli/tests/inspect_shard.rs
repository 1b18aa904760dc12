//! `bigmodel inspect` and `bigmodel shard` through the built binary.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::bigmodel;
use serde_json::Value;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../bm-shard/tests/fixtures/hf_llama_tiny")
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

/// A safetensors file of one-byte U8 tensors named `names`.
fn one_byte_tensors(path: &Path, names: &[&str]) {
    let entries: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            format!(
                "{}:{{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[{i},{}]}}",
                Value::from(*n),
                i + 1
            )
        })
        .collect();
    let mut json = format!("{{{}}}", entries.join(","));
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json.as_bytes());
    bytes.extend(std::iter::repeat_n(1u8, names.len()));
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn inspect_cuts_long_names_in_the_table_and_keeps_them_whole_in_json() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("long.safetensors");
    // Past 65535 characters, padding a table column used to panic.
    let module = "x".repeat(100_000);
    let tensor = format!("{module}.weight");
    one_byte_tensors(&path, &[&tensor, "short.bias"]);
    let out = bigmodel(args!["inspect", path.as_os_str()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.lines().all(|l| l.len() < 300), "{table}");
    assert!(table.contains(&format!("{}...", &module[..96])), "{table}");
    assert!(
        table.contains(&format!("... ({} bytes; whole with --json)", module.len())),
        "{table}"
    );
    let json = ok_json(args!["inspect", path.as_os_str(), "--json"]);
    assert_eq!(json["modules"][&module], 1);
    assert_eq!(json["largest_layer"]["name"], module);
}

#[test]
fn inspect_errors_are_one_paragraph() {
    let dir = tempfile::tempdir().unwrap();
    let e = fails(args!["inspect", dir.path().as_os_str()]);
    assert!(
        e.contains("holds none of model.safetensors, a *.index.json and pytorch_model.bin"),
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

/// A Hugging Face hub cache snapshot of the fixture: every file of
/// `snapshots/REV/` a link to `../../blobs/<name>`.
#[cfg(unix)]
fn hub_snapshot(root: &Path) -> PathBuf {
    let repo = root.join("models--org--llama-tiny");
    let snap = repo.join("snapshots/cafe");
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    for entry in std::fs::read_dir(fixture()).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        let blob = format!("blob-{}", name.to_string_lossy());
        std::fs::copy(entry.path(), repo.join("blobs").join(&blob)).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snap.join(&name)).unwrap();
    }
    snap
}

/// Every file under `dir` with its bytes (links listed as links).
#[cfg(unix)]
fn tree_state(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let meta = std::fs::symlink_metadata(&p).unwrap();
            let state = if meta.is_symlink() {
                format!("-> {}", std::fs::read_link(&p).unwrap().display())
            } else if meta.is_dir() {
                stack.push(p.clone());
                "dir".into()
            } else {
                format!("{:?}", std::fs::read(&p).unwrap())
            };
            out.push((p, state));
        }
    }
    out.sort();
    out
}

#[cfg(unix)]
#[test]
fn shard_reads_a_hub_snapshot_and_never_writes_into_it() {
    let root = tempfile::tempdir().unwrap();
    let snap = hub_snapshot(root.path());
    let repo = root.path().join("models--org--llama-tiny");
    let before = tree_state(&repo);
    // The snapshot itself, through a link to it, and the blobs folder its
    // shards resolve to: all are folders the checkpoint is read from.
    let link = root.path().join("link-to-snapshot");
    std::os::unix::fs::symlink(&snap, &link).unwrap();
    for out in [&snap, &link, &repo.join("blobs")] {
        let e = fails(args!("shard", &snap, out, "--max-shard-size", "20KB"));
        assert!(e.contains("holds the checkpoint being read"), "{e}");
    }
    assert_eq!(tree_state(&repo), before, "the input was modified");
    // Elsewhere it works, side files included (they are links too).
    let out = root.path().join("out");
    let report = ok_json(args!(
        "shard",
        &snap,
        &out,
        "--max-shard-size",
        "20KB",
        "--json"
    ));
    assert!(report["files"].as_array().unwrap().len() > 1);
    let config = std::fs::read(out.join("config.json")).unwrap();
    assert_eq!(
        config,
        std::fs::read(fixture().join("config.json")).unwrap()
    );
    assert!(
        !std::fs::symlink_metadata(out.join("config.json"))
            .unwrap()
            .is_symlink()
    );
    assert_eq!(tree_state(&repo), before);
}

#[test]
fn shard_errors_name_the_input_file_and_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("empty-name.safetensors");
    let mut json = r#"{"":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#.to_string();
    while !json.len().is_multiple_of(8) {
        json.push(' ');
    }
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json.as_bytes());
    bytes.push(1);
    std::fs::write(&input, bytes).unwrap();
    let out = dir.path().join("out");
    let e = fails(args!("shard", &input, &out, "--max-shard-size", "1KB"));
    assert!(
        e.contains("tensor \"\"")
            && e.contains("not a valid safetensors tensor name")
            && e.contains(&format!("read from {}", input.display()))
            && e.contains(&out.display().to_string()),
        "{e}"
    );
}

#[cfg(unix)]
#[test]
fn inspect_refuses_a_fifo_instead_of_waiting_on_it() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("model.safetensors");
    let made = Command::new("mkfifo").arg(&fifo).status();
    assert!(made.is_ok_and(|s| s.success()));
    let mut child = Command::new(env!("CARGO_BIN_EXE_bigmodel"))
        .args([std::ffi::OsStr::new("inspect"), fifo.as_os_str()])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Opening a FIFO for reading blocks until a writer comes: a hang is a
    // failure, not a slow pass.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            panic!("inspect of a FIFO blocked");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success());
    assert!(stderr.contains("is a FIFO, not a regular file"), "{stderr}");
}
