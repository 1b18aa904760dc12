//! PyTorch checkpoints through `Checkpoint`: every fixture torch wrote
//! (tools/make_torch_bin_fixtures.py) reads back the bytes torch.load
//! returns, shared storages and views are honoured, folders follow
//! transformers' rules, and every bad input (malicious pickles first) is a
//! clear error naming the file and record, with nothing executed.

use std::path::{Path, PathBuf};

use bm_shard::{Checkpoint, Format, TensorBytes};
use bm_tensor::DType;
use serde_json::Value;

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/torch")
        .join(rel)
}

fn expected() -> Value {
    serde_json::from_slice(&std::fs::read(fixture("expected.json")).unwrap()).unwrap()
}

fn fnv1a64(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("{h:016x}")
}

/// Every tensor of `ckpt` against `expected[key]`: names in state-dict
/// order, dtype, shape, and the bytes of all three read paths.
fn check_against_torch(ckpt: &Checkpoint, key: &str) {
    let expected = expected();
    let want = expected[key].as_object().unwrap();
    let names: Vec<&str> = ckpt.tensors().map(|(n, _)| n).collect();
    let want_names: Vec<&str> = want.keys().map(String::as_str).collect();
    assert_eq!(names, want_names, "{key}");
    for (name, meta) in ckpt.tensors() {
        let w = &want[name];
        assert_eq!(meta.dtype.as_safetensors_str(), w["dtype"], "{key} {name}");
        let shape: Vec<usize> = w["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(meta.shape, shape, "{key} {name}");
        let hash = w["fnv1a64"].as_str().unwrap();
        assert_eq!(
            fnv1a64(ckpt.bytes(name).unwrap().as_bytes()),
            hash,
            "{key} {name}"
        );
        assert_eq!(
            fnv1a64(ckpt.read_as(name, meta.dtype).unwrap().as_bytes()),
            hash,
            "{key} {name}"
        );
        let mut buf = vec![0u8; meta.byte_len()];
        ckpt.read_into(name, &mut buf).unwrap();
        assert_eq!(fnv1a64(&buf), hash, "{key} {name}");
    }
}

#[test]
fn every_fixture_reads_back_what_torch_load_returns() {
    for file in [
        "plain.bin",
        "shared.bin",
        "float8.bin",
        "protocol4.bin",
        "legacy.bin",
    ] {
        let ckpt = Checkpoint::open(fixture(file)).unwrap();
        assert_eq!(ckpt.files()[0].format, Format::Torch);
        assert_eq!(ckpt.files()[0].metadata, None);
        check_against_torch(&ckpt, file);
    }
    let ckpt = Checkpoint::open(fixture("sharded")).unwrap();
    assert_eq!(
        ckpt.index_path(),
        Some(fixture("sharded/pytorch_model.bin.index.json").as_path())
    );
    assert_eq!(ckpt.files().len(), 2);
    check_against_torch(&ckpt, "sharded");
    let index = Checkpoint::open(fixture("sharded/pytorch_model.bin.index.json")).unwrap();
    assert_eq!(index.len(), 13);
    check_against_torch(
        &Checkpoint::open(fixture("tiny-llama")).unwrap(),
        "tiny-llama",
    );
}

#[test]
fn shared_storages_stay_shared_and_views_keep_their_layout() {
    for file in ["shared.bin", "legacy.bin"] {
        let ckpt = Checkpoint::open(fixture(file)).unwrap();
        // One 4x6 F32 storage under six names.
        assert_eq!(ckpt.total_bytes(), 96, "{file}");
        assert_eq!(ckpt.ties(), [["embed.weight", "lm_head.weight"]], "{file}");
        let embed = ckpt.view("embed.weight").unwrap();
        let tied = ckpt.view("lm_head.weight").unwrap();
        assert_eq!(
            (embed.file_offset(), embed.len()),
            (tied.file_offset(), tied.len())
        );
        // w[2]: a contiguous window 12 elements in, zero-copy.
        let row = ckpt.view("row").unwrap();
        assert_eq!(row.file_offset(), embed.file_offset() + 48);
        assert!(matches!(ckpt.bytes("row").unwrap(), TensorBytes::Mapped(_)));
        // Strided views are gathered, and have no zero-copy view.
        for name in ["transposed", "window", "column"] {
            assert!(matches!(
                ckpt.bytes(name).unwrap(),
                TensorBytes::Gathered(_)
            ));
            let e = ckpt.view(name).unwrap_err().to_string();
            assert!(
                e.contains(file)
                    && e.contains(&format!("tensor {name:?} is a non-contiguous view")),
                "{e}"
            );
        }
        let floats = |name: &str| -> Vec<f32> {
            bytemuck_f32(ckpt.read_as(name, DType::F32).unwrap().as_bytes())
        };
        assert_eq!(floats("column"), [3.0, 9.0, 15.0, 21.0]);
        assert_eq!(floats("window"), [8.0, 9.0, 10.0, 14.0, 15.0, 16.0]);
        assert_eq!(floats("transposed")[..5], [0.0, 6.0, 12.0, 18.0, 1.0]);
        // A cast of a strided view casts the gathered elements.
        let half = ckpt.read_as("column", DType::F16).unwrap();
        let back = bm_tensor::cast(half.as_bytes(), DType::F16, DType::F32).unwrap();
        assert_eq!(bytemuck_f32(back.as_bytes()), [3.0, 9.0, 15.0, 21.0]);
    }
}

fn bytemuck_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn folders_follow_transformers_safetensors_first() {
    let dir = tempfile::tempdir().unwrap();
    let copy = |from: &str, to: &str| std::fs::copy(fixture(from), dir.path().join(to)).unwrap();
    copy("plain.bin", "pytorch_model.bin");
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ckpt.len(), 13);
    assert_eq!(ckpt.format_of("f32"), Some(Format::Torch));
    // pytorch_model.bin beats a .bin index, as in transformers.
    copy(
        "sharded/pytorch_model.bin.index.json",
        "pytorch_model.bin.index.json",
    );
    assert_eq!(Checkpoint::open(dir.path()).unwrap().index_path(), None);
    // A safetensors index beats both.
    let st = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf_llama_tiny");
    for entry in std::fs::read_dir(&st).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "config.json" {
            std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
        }
    }
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(
        ckpt.index_path(),
        Some(dir.path().join("model.safetensors.index.json").as_path())
    );
    assert!(ckpt.files().iter().all(|f| f.format == Format::Safetensors));
    // And model.safetensors beats everything.
    std::fs::copy(
        dir.path().join("model-00003-of-00003.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ckpt.files()[0].path, dir.path().join("model.safetensors"));

    // Only the .bin index: its shards are read.
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture("sharded")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    check_against_torch(&ckpt, "sharded");
    // A file named otherwise is recognised by its first bytes.
    let odd = dir.path().join("weights.data");
    std::fs::copy(fixture("legacy.bin"), &odd).unwrap();
    assert_eq!(Checkpoint::open(&odd).unwrap().len(), 6);
}

/// Opening `rel` fails; the message names the file and contains `want`.
fn refused(rel: &str, want: &str) {
    let path = fixture(rel);
    let e = Checkpoint::open(&path).unwrap_err().to_string();
    assert!(
        e.starts_with(&path.display().to_string()) && e.contains(want),
        "{rel}: {e}"
    );
}

#[test]
fn malicious_pickles_are_refused_by_name_and_never_run() {
    let marker = Path::new("bigmodel-pickle-was-run");
    assert!(!marker.exists());
    for (file, global) in [
        ("malicious_system.bin", "global posix.system is not allowed"),
        (
            "malicious_exec.bin",
            "global __builtin__.exec (builtins.exec) is not allowed",
        ),
        (
            "malicious_eval.bin",
            "global __builtin__.eval (builtins.eval) is not allowed",
        ),
        (
            "malicious_popen.bin",
            "global commands.Popen (subprocess.Popen) is not allowed",
        ),
    ] {
        let stem = file.trim_end_matches(".bin");
        refused(
            &format!("bad/{file}"),
            &format!("record {stem}/data.pkl: byte 180 (GLOBAL): {global}"),
        );
    }
    // Each of them creates this file in the working directory when
    // unpickled by Python (the fixture script checks that).
    assert!(!marker.exists());
}

#[test]
fn bad_input_is_a_clear_error_naming_file_and_record() {
    for (file, want) in [
        (
            "missing_record.bin",
            "record archive/data/7: is missing: archive/data.pkl refers to storage \"7\"",
        ),
        (
            "short_storage.bin",
            "record archive/data/0: holds 32 bytes, but storage \"0\" is declared as 12 elements of torch.FloatStorage (48 bytes)",
        ),
        (
            "past_storage.bin",
            "record archive/data.pkl: tensor \"w\" reaches element 15 of storage \"0\", which has 12 elements of F32",
        ),
        (
            "expanded.bin",
            "tensor \"e\" needs 4000 bytes, more than its storage \"0\" holds (4)",
        ),
        (
            "complex64.bin",
            "record complex64/data.pkl: tensor \"z\" has an unknown torch dtype (torch.ComplexFloatStorage)",
        ),
        (
            "uint16.bin",
            "record uint16/data.pkl: tensor \"u\" has an unknown torch dtype (torch.uint16)",
        ),
        (
            "unsupported_opcode.bin",
            "record archive/data.pkl: byte 2 (EMPTY_SET): opcode not supported",
        ),
        (
            "deep_tuples.bin",
            "byte 34 (TUPLE1): tuples nest more than 32 deep",
        ),
        (
            "memo_missing.bin",
            "byte 2 (BINGET): reads memo entry 7, which was never stored",
        ),
        (
            "self_list.bin",
            "record archive/data.pkl: holds no dict: a state dict (name → tensor) is expected",
        ),
        (
            "huge_shape.bin",
            "tensor \"w\" has a shape too large to address",
        ),
        (
            "huge_storage.bin",
            "is declared as 4611686018427387904 elements of torch.FloatStorage",
        ),
        (
            "big_endian.bin",
            "record archive/byteorder: says the storages are \"big\"",
        ),
        (
            "deflated.bin",
            "is compressed with method 8 (deflate); torch.save stores records uncompressed",
        ),
        (
            "nested.bin",
            "entry \"model\" is a dict, not a tensor: a flat state dict",
        ),
        (
            "tar_format.bin",
            "is a tar archive, the format of PyTorch before 0.4",
        ),
        ("bare_pickle.bin", "is not a PyTorch checkpoint"),
    ] {
        refused(&format!("bad/{file}"), want);
    }
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    for file in ["plain.bin", "legacy.bin", "shared.bin"] {
        let path = fixture(file);
        let bytes = std::fs::read(&path).unwrap();
        for cut in 0..bytes.len() {
            let e = bm_shard::torch::parse(&path, &bytes[..cut]).unwrap_err();
            assert!(e.to_string().contains(file), "{file} cut at {cut}: {e}");
        }
    }
}
