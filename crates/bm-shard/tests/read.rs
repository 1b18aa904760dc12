//! Reading checkpoints: the transformers fixture, every source form, and
//! every kind of bad input (each a clear error naming the culprit).

use std::path::{Path, PathBuf};

use bm_shard::{Checkpoint, Error};
use bm_tensor::DType;
use serde_json::Value;

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

fn fnv1a64(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("{h:016x}")
}

/// A safetensors file from a header JSON and a data buffer.
fn raw_file(dir: &Path, name: &str, json: &str, data: &[u8]) -> PathBuf {
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json.as_bytes());
    bytes.extend_from_slice(data);
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn u8_tensor_file(dir: &Path, name: &str, tensors: &[&str]) -> PathBuf {
    let entries: Vec<String> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| {
            format!(
                r#""{t}":{{"dtype":"U8","shape":[2],"data_offsets":[{},{}]}}"#,
                2 * i,
                2 * i + 2
            )
        })
        .collect();
    raw_file(
        dir,
        name,
        &format!("{{{}}}", entries.join(",")),
        &vec![7; 2 * tensors.len()],
    )
}

fn open_err(path: &Path) -> String {
    let err: Error = Checkpoint::open(path).unwrap_err();
    err.to_string()
}

#[test]
fn transformers_fixture_reads_exactly() {
    let expected: Value =
        serde_json::from_slice(&std::fs::read(fixture("hf_llama_tiny.expected.json")).unwrap())
            .unwrap();
    let expected = expected.as_object().unwrap();
    for source in [
        fixture("hf_llama_tiny"),
        fixture("hf_llama_tiny/model.safetensors.index.json"),
    ] {
        let ckpt = Checkpoint::open(&source).unwrap();
        assert_eq!(ckpt.len(), expected.len(), "{}", source.display());
        assert_eq!(ckpt.files().len(), 3);
        for (name, want) in expected {
            let meta = ckpt.meta(name).unwrap_or_else(|| panic!("{name} missing"));
            assert_eq!(meta.dtype.as_safetensors_str(), want["dtype"], "{name}");
            let shape: Vec<usize> = serde_json::from_value(want["shape"].clone()).unwrap();
            assert_eq!(meta.shape, shape, "{name}");
            assert_eq!(
                fnv1a64(ckpt.view(name).unwrap().as_bytes()),
                want["fnv1a64"],
                "{name}"
            );
            let copy = ckpt.read_as(name, meta.dtype).unwrap();
            assert_eq!(fnv1a64(copy.as_bytes()), want["fnv1a64"], "{name}");
        }
    }
}

#[test]
fn tensors_come_in_shard_then_offset_order_and_cast_on_read() {
    let ckpt = Checkpoint::open(fixture("hf_llama_tiny")).unwrap();
    let files: Vec<&Path> = ckpt
        .tensors()
        .map(|(n, _)| ckpt.file_of(n).unwrap())
        .collect();
    assert!(files.windows(2).all(|w| w[0] <= w[1]), "shard order");
    let name = "model.norm.weight";
    let bf16 = ckpt.view(name).unwrap();
    let f32 = ckpt.read_as(name, DType::F32).unwrap();
    assert_eq!(f32.len(), bf16.len() * 2);
    for (b, f) in bf16.as_bytes().chunks(2).zip(f32.as_bytes().chunks(4)) {
        assert_eq!(&f[2..], b, "bf16 widens by appending zero bits");
        assert_eq!(&f[..2], &[0, 0]);
    }
}

#[test]
fn ints_are_never_cast() {
    let dir = tempfile::tempdir().unwrap();
    let p = raw_file(
        dir.path(),
        "i.safetensors",
        r#"{"ids":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}}"#,
        &5i64.to_le_bytes(),
    );
    let ckpt = Checkpoint::open(&p).unwrap();
    assert_eq!(
        ckpt.read_as("ids", DType::F16).unwrap().as_bytes(),
        5i64.to_le_bytes()
    );
    let e = ckpt.read_as("nope", DType::F16).unwrap_err().to_string();
    assert!(e.contains("no tensor named \"nope\""), "{e}");
}

#[test]
fn flat_index_and_folder_forms() {
    let dir = tempfile::tempdir().unwrap();
    u8_tensor_file(
        dir.path(),
        "part1.safetensors",
        &["linear1.weight", "linear1.bias"],
    );
    u8_tensor_file(dir.path(), "part2.safetensors", &["linear2.weight"]);
    std::fs::write(
        dir.path().join("weight_map.index.json"),
        r#"{"linear1.weight":"part1.safetensors","linear1.bias":"part1.safetensors","linear2.weight":"part2.safetensors"}"#,
    )
    .unwrap();
    for src in [
        dir.path().to_path_buf(),
        dir.path().join("weight_map.index.json"),
    ] {
        let ckpt = Checkpoint::open(&src).unwrap();
        let names: Vec<&str> = ckpt.tensors().map(|(n, _)| n).collect();
        assert_eq!(names, ["linear1.weight", "linear1.bias", "linear2.weight"]);
        assert_eq!(ckpt.total_bytes(), 6);
    }
    // model.safetensors wins over an index, as in Accelerate.
    u8_tensor_file(dir.path(), "model.safetensors", &["only"]);
    assert_eq!(Checkpoint::open(dir.path()).unwrap().len(), 1);
}

#[test]
fn folder_errors() {
    let dir = tempfile::tempdir().unwrap();
    let e = open_err(dir.path());
    assert!(
        e.contains("holds none of model.safetensors, a *.index.json and pytorch_model.bin"),
        "{e}"
    );
    // pytorch_model.bin is read (see tests/torch.rs), this one is not one.
    std::fs::write(dir.path().join("pytorch_model.bin"), b"pickle").unwrap();
    let e = open_err(dir.path());
    assert!(
        e.contains("pytorch_model.bin: is not a PyTorch checkpoint"),
        "{e}"
    );
    std::fs::write(dir.path().join("a.index.json"), "{}").unwrap();
    std::fs::write(dir.path().join("b.index.json"), "{}").unwrap();
    let e = open_err(dir.path());
    assert!(
        e.contains("more than one *.index.json (a.index.json, b.index.json)"),
        "{e}"
    );
    let e = open_err(&dir.path().join("missing.safetensors"));
    assert!(
        e.contains("missing.safetensors") && e.contains("No such file"),
        "{e}"
    );
}

#[test]
fn index_errors_name_index_shard_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    u8_tensor_file(dir.path(), "s1.safetensors", &["a"]);
    let index = dir.path().join("m.index.json");
    let write_index = |map: &str| {
        std::fs::write(
            &index,
            format!(r#"{{"metadata":{{"total_size":2}},"weight_map":{map}}}"#),
        )
        .unwrap();
    };
    write_index(r#"{"a":"s1.safetensors","b":"s2.safetensors"}"#);
    let e = open_err(&index);
    assert!(
        e.contains("m.index.json") && e.contains("shard \"s2.safetensors\", which does not exist"),
        "{e}"
    );
    write_index(r#"{"a":"s1.safetensors","b":"s1.safetensors"}"#);
    let e = open_err(&index);
    assert!(
        e.contains("tensor \"b\" is not in its shard \"s1.safetensors\""),
        "{e}"
    );
    u8_tensor_file(dir.path(), "s2.safetensors", &["a"]);
    write_index(r#"{"a":"s1.safetensors","c":"s2.safetensors"}"#);
    let e = open_err(&index);
    assert!(e.contains("tensor \"a\" is stored twice"), "{e}");
}

#[test]
fn escaping_shard_paths_are_never_read() {
    let outside = tempfile::tempdir().unwrap();
    let secret = u8_tensor_file(outside.path(), "secret.safetensors", &["s"]);
    let dir = tempfile::tempdir().unwrap();
    let index = dir.path().join("model.safetensors.index.json");
    let rel = Path::new("..")
        .join(outside.path().file_name().unwrap())
        .join("secret.safetensors");
    for (file, why) in [
        (secret.to_string_lossy().into_owned(), "absolute"),
        (rel.to_string_lossy().into_owned(), "`..`"),
    ] {
        std::fs::write(
            &index,
            format!(r#"{{"weight_map":{{"s":{}}}}}"#, Value::from(file.clone())),
        )
        .unwrap();
        let e = open_err(&index);
        assert!(
            e.contains(why) && e.contains("refusing to read it"),
            "{file}: {e}"
        );
    }
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(&secret, dir.path().join("link.safetensors")).unwrap();
        std::fs::write(&index, r#"{"weight_map":{"s":"link.safetensors"}}"#).unwrap();
        let e = open_err(&index);
        assert!(e.contains("outside the folder"), "{e}");
    }
}

#[test]
fn bad_files_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let good = u8_tensor_file(dir.path(), "good.safetensors", &["a", "b"]);
    let bytes = std::fs::read(&good).unwrap();

    let truncated = dir.path().join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() - 1]).unwrap();
    let e = open_err(&truncated);
    assert!(
        e.contains("truncated.safetensors")
            && e.contains("\"b\": data_offsets [2, 4] reach past the end"),
        "{e}"
    );

    let stub = dir.path().join("stub.safetensors");
    std::fs::write(&stub, &bytes[..5]).unwrap();
    assert!(open_err(&stub).contains("too short"));

    let long = dir.path().join("long.safetensors");
    let mut b = bytes.clone();
    b[..8].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
    std::fs::write(&long, &b).unwrap();
    let e = open_err(&long);
    assert!(
        e.contains("long.safetensors") && e.contains("is larger than the file"),
        "{e}"
    );

    let overlap = raw_file(
        dir.path(),
        "overlap.safetensors",
        r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}"#,
        &[0; 3],
    );
    assert!(open_err(&overlap).contains("\"a\" (bytes 0..2) and \"b\" (bytes 1..3) overlap"));

    let not_json = raw_file(dir.path(), "notjson.safetensors", "{\"a\":", &[]);
    assert!(open_err(&not_json).contains("not valid JSON"));

    let dtype = raw_file(
        dir.path(),
        "dtype.safetensors",
        r#"{"w":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}}"#,
        &[0],
    );
    assert!(open_err(&dtype).contains("tensor \"w\": unknown dtype \"Q4\""));

    let latin1 = dir.path().join("latin1.safetensors");
    let mut b = 8u64.to_le_bytes().to_vec();
    b.extend_from_slice(b"{\"\xe9\":1} ");
    std::fs::write(&latin1, b).unwrap();
    let e = open_err(&latin1);
    assert!(
        e.contains("latin1.safetensors") && e.contains("not UTF-8"),
        "{e}"
    );
}

/// A Hugging Face hub cache repository: `snapshots/REV/` holds links to
/// `../../blobs/HASH`, as huggingface_hub lays it out.
#[cfg(unix)]
fn hub_snapshot(root: &Path) -> PathBuf {
    use std::os::unix::fs::symlink;
    let repo = root.join("models--org--tiny");
    let snap = repo.join("snapshots/0123abcd");
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    let built = tempfile::tempdir().unwrap();
    u8_tensor_file(built.path(), "a", &["a"]);
    u8_tensor_file(built.path(), "b", &["b"]);
    std::fs::write(
        built.path().join("i"),
        r#"{"metadata":{"total_size":4},"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    for (blob, name) in [
        ("a", "model-00001-of-00002.safetensors"),
        ("b", "model-00002-of-00002.safetensors"),
        ("i", "model.safetensors.index.json"),
    ] {
        let hash = format!("{blob}0f1e2d3c");
        std::fs::copy(built.path().join(blob), repo.join("blobs").join(&hash)).unwrap();
        symlink(format!("../../blobs/{hash}"), snap.join(name)).unwrap();
    }
    snap
}

#[cfg(unix)]
#[test]
fn hugging_face_cache_snapshots_open() {
    let root = tempfile::tempdir().unwrap();
    let snap = hub_snapshot(root.path());
    let ckpt = Checkpoint::open(&snap).unwrap();
    assert_eq!(ckpt.len(), 2);
    assert_eq!(
        ckpt.file_of("b").unwrap(),
        snap.join("model-00002-of-00002.safetensors")
    );
    assert_eq!(ckpt.view("a").unwrap().as_bytes(), [7, 7]);
    // A link from the snapshot to a file outside the repository is refused.
    std::fs::write(root.path().join("secret"), b"x").unwrap();
    std::fs::remove_file(snap.join("model-00002-of-00002.safetensors")).unwrap();
    std::os::unix::fs::symlink(
        root.path().join("secret"),
        snap.join("model-00002-of-00002.safetensors"),
    )
    .unwrap();
    let e = open_err(&snap);
    assert!(e.contains("outside the folder"), "{e}");
}

#[test]
fn a_file_truncated_after_opening_is_an_error_not_a_fault() {
    let dir = tempfile::tempdir().unwrap();
    let path = u8_tensor_file(dir.path(), "m.safetensors", &["a", "b"]);
    let ckpt = Checkpoint::open(&path).unwrap();
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    assert_eq!(ckpt.view("a").unwrap().as_bytes(), [7, 7]);
    for e in [
        ckpt.view("b").unwrap_err().to_string(),
        ckpt.read_as("b", DType::U8).unwrap_err().to_string(),
    ] {
        assert!(
            e.contains("m.safetensors")
                && e.contains("tensor \"b\" cannot be read: the file shrank"),
            "{e}"
        );
    }
}

#[cfg(unix)]
#[test]
fn a_fifo_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("model.safetensors");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    assert!(made.is_ok_and(|s| s.success()));
    // Both as the file given and as a folder's model.safetensors: opening
    // it for reading would block until a writer came.
    let e = open_err(&fifo);
    assert!(e.contains("is a FIFO, not a regular file"), "{e}");
    let e = open_err(dir.path());
    assert!(e.contains("model.safetensors is a FIFO, not a file"), "{e}");
    let index = dir.path().join("x.index.json");
    std::fs::rename(&fifo, &index).unwrap();
    let e = open_err(&index);
    assert!(e.contains("is a FIFO"), "{e}");
}

#[test]
fn safetensors_have_no_ties_not_even_empty_tensors_at_one_offset() {
    let dir = tempfile::tempdir().unwrap();
    let p = raw_file(
        dir.path(),
        "e.safetensors",
        r#"{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"c":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
        &[1, 2],
    );
    let ckpt = Checkpoint::open(&p).unwrap();
    assert_eq!(ckpt.len(), 3);
    assert!(ckpt.ties().is_empty());
}
