//! The offload folder against one written by Accelerate itself.

use std::path::{Path, PathBuf};

use bm_shard::offload::{self, OffloadEntry, OffloadFolder};
use bm_shard::{SaveTensor, ShardOptions, shard_checkpoint};
use bm_tensor::{DType, TensorMeta};

fn accelerate_folder() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/accelerate_offload")
}

#[test]
fn reads_accelerate_folder() {
    let f = OffloadFolder::open(accelerate_folder()).unwrap();
    let names: Vec<&str> = f.names().collect();
    assert_eq!(names, ["w_bf16", "w_fp16", "w_f32", "i64", "b", "f8"]);
    assert_eq!(
        f.meta("w_bf16").unwrap(),
        TensorMeta::new(DType::BF16, [2, 3])
    );
    assert_eq!(f.meta("i64").unwrap(), TensorMeta::new(DType::I64, []));
    assert_eq!(f.meta("f8").unwrap().dtype, DType::F8E4M3);
    // torch.tensor(7) stored as one int64 element.
    assert_eq!(f.view("i64").unwrap().as_bytes(), 7i64.to_le_bytes());
    assert_eq!(f.view("b").unwrap().as_bytes(), [1, 0]);
    // fp8 0.5, -1.0, 2.0 in e4m3fn.
    assert_eq!(f.view("f8").unwrap().as_bytes(), [0x30, 0xB8, 0x40]);
    let wide = f.read_as("w_bf16", DType::F32).unwrap();
    let narrow = f.view("w_bf16").unwrap();
    assert_eq!(&wide.as_bytes()[2..4], &narrow.as_bytes()[..2]);
}

#[test]
fn writer_reproduces_accelerate_bytes() {
    let src = OffloadFolder::open(accelerate_folder()).unwrap();
    let out = tempfile::tempdir().unwrap();
    let mut entries = Vec::new();
    for name in src.names() {
        let meta = src.stored_meta(name).unwrap();
        let entry =
            offload::offload_weight(out.path(), name, meta, src.view(name).unwrap().as_bytes())
                .unwrap();
        entries.push((name.to_string(), entry));
    }
    offload::save_index(out.path(), &entries).unwrap();
    for file in std::fs::read_dir(accelerate_folder()).unwrap() {
        let file = file.unwrap();
        let ours = std::fs::read(out.path().join(file.file_name())).unwrap();
        assert_eq!(
            ours,
            std::fs::read(file.path()).unwrap(),
            "{:?}",
            file.file_name()
        );
    }
    let count = std::fs::read_dir(out.path()).unwrap().count();
    assert_eq!(count, 7, "six .dat files and index.json, no temporary left");
}

#[test]
fn index_merges_like_accelerate() {
    let dir = tempfile::tempdir().unwrap();
    let meta = TensorMeta::new(DType::F32, [1]);
    let a = offload::offload_weight(dir.path(), "a", &meta, &1f32.to_le_bytes()).unwrap();
    offload::save_index(
        dir.path(),
        &[("a".into(), a.clone()), ("b".into(), a.clone())],
    )
    .unwrap();
    let wide = TensorMeta::new(DType::F64, [1]);
    let a2 = offload::offload_weight(dir.path(), "a", &wide, &2f64.to_le_bytes()).unwrap();
    offload::save_index(dir.path(), &[("c".into(), a.clone()), ("a".into(), a2)]).unwrap();
    let idx = offload::load_index(dir.path()).unwrap();
    let names: Vec<&str> = idx.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["a", "b", "c"]);
    assert_eq!(idx[0].1, OffloadEntry::Dat(wide));
    let e = offload::offload_weight(dir.path(), "../x", &meta, &[0; 4])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("\"../x\"") && e.contains("path separator"),
        "{e}"
    );
    let e = offload::offload_weight(dir.path(), "short", &meta, &[0; 3])
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs 4 bytes, 3 given"), "{e}");
}

#[test]
fn reads_transformers_safetensors_entries() {
    let dir = tempfile::tempdir().unwrap();
    let meta = TensorMeta::new(DType::F32, [2]);
    let data: Vec<u8> = [1.5f32, -2.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let weights = dir.path().join("weights");
    shard_checkpoint(
        &[SaveTensor {
            name: "lin.weight",
            meta: &meta,
            data: &data,
        }],
        &weights,
        &ShardOptions {
            max_shard_size: 1 << 20,
            dtype: None,
        },
        &mut |_, _| {},
    )
    .unwrap();
    let file = weights.join("model.safetensors").canonicalize().unwrap();
    let folder = dir.path().join("offload");
    std::fs::create_dir(&folder).unwrap();
    std::fs::write(
        folder.join("index.json"),
        serde_json::json!({
            "w": {"safetensors_file": file, "weight_name": "lin.weight", "dtype": "bfloat16"},
            "plain": {"safetensors_file": file, "weight_name": "lin.weight"},
        })
        .to_string(),
    )
    .unwrap();
    let f = OffloadFolder::open(&folder).unwrap();
    assert_eq!(f.meta("w").unwrap(), TensorMeta::new(DType::BF16, [2]));
    assert_eq!(f.stored_meta("w").unwrap(), &meta);
    assert_eq!(f.view("plain").unwrap().as_bytes(), data);
    // 1.5 and -2.0 are exact in bf16: 0x3FC0, 0xC000.
    assert_eq!(
        f.read_as("w", DType::BF16).unwrap().as_bytes(),
        [0xC0, 0x3F, 0x00, 0xC0]
    );

    std::fs::write(
        folder.join("index.json"),
        serde_json::json!({"w": {"safetensors_file": file, "weight_name": "nope"}}).to_string(),
    )
    .unwrap();
    let e = OffloadFolder::open(&folder).unwrap_err().to_string();
    assert!(
        e.contains("entry \"w\"") && e.contains("has no tensor \"nope\""),
        "{e}"
    );
}

#[test]
fn dat_of_wrong_length_is_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("index.json"),
        r#"{"w":{"dtype":"float32","shape":[4]}}"#,
    )
    .unwrap();
    std::fs::write(dir.path().join("w.dat"), [0u8; 12]).unwrap();
    let e = OffloadFolder::open(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("w.dat holds 12 bytes") && e.contains("needs 16"),
        "{e}"
    );
    let e = OffloadFolder::open(dir.path().join("nowhere"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no index.json"), "{e}");
}
