//! `bigmodel demo` at the tiny scale (BM_DEMO_SCALE=tiny keeps debug test
//! runs fast; the full ~1 GB model is the same code with bigger numbers):
//! it creates the checkpoint once, offloads part of it to disk, and checks
//! the output against the in-memory run.

use std::process::{Command, Output};

fn demo(cache: &std::path::Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_bigmodel"))
        .arg("demo")
        .args(args)
        .env("BM_DEMO_SCALE", "tiny")
        .env("BM_DEMO_DIR", cache)
        .output()
        .expect("run bigmodel")
}

#[test]
fn tiny_demo_offloads_to_disk_and_equals_the_in_memory_run_then_reuses_its_checkpoint() {
    let cache = tempfile::tempdir().unwrap();
    let first = demo(cache.path(), &[]);
    let stdout = String::from_utf8_lossy(&first.stdout);
    let stderr = String::from_utf8_lossy(&first.stderr);
    assert!(first.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("OK: offloaded output equals in-memory output"),
        "{stdout}"
    );
    assert!(
        stdout.contains("disk"),
        "the budget must force disk offload: {stdout}"
    );
    for line in ["load time:", "time per token:", "streamed per token:"] {
        assert!(stdout.contains(line), "{line} missing: {stdout}");
    }
    assert!(!stdout.contains("streamed per token:  0 B"), "{stdout}");
    assert!(!stderr.contains("(cached)"), "{stderr}");
    let index = cache.path().join("tiny-v1/model.safetensors.index.json");
    assert!(index.is_file(), "the demo checkpoint is sharded");
    let leftovers: Vec<_> = std::fs::read_dir(cache.path())
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    let second = demo(cache.path(), &["--max-new-tokens", "2"]);
    assert!(second.status.success());
    assert!(String::from_utf8_lossy(&second.stderr).contains("(cached)"));
}

#[test]
fn unknown_scale_is_an_error() {
    let cache = tempfile::tempdir().unwrap();
    let out = demo(cache.path(), &["--scale", "huge"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected full or tiny"));
}
