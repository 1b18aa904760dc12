//! What the CLI's integration tests share: the built `bigmodel` binary,
//! the fixture folders of the other crates, and the safetensors files the
//! tests read (logits dumps, transformers' references) and write.

// Every test binary compiles this module and uses a part of it.
#![allow(dead_code)]

pub mod hostile;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::{Value, json};

/// A fixture folder or file of bm-models (`crates/bm-models/tests/fixtures/NAME`).
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../bm-models/tests/fixtures")
        .join(name)
}

/// bm-models' tiny Llama (tools/make_tiny_llama.py).
pub fn tiny_llama() -> PathBuf {
    fixture("tiny-llama")
}

/// The built binary run with `args`, no input, its output captured.
pub fn bigmodel<S: AsRef<OsStr>>(args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_bigmodel"))
        .args(args)
        .output()
        .expect("run bigmodel")
}

/// The built binary run with `args` and `stdin` as its input.
pub fn bigmodel_with_stdin(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_bigmodel"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run bigmodel");
    let written = child.stdin.take().unwrap().write_all(stdin.as_bytes());
    // A command that fails on its arguments may exit before it reads its
    // input: the pipe is then closed, and its output says why.
    if let Err(e) = written {
        assert_eq!(
            e.kind(),
            std::io::ErrorKind::BrokenPipe,
            "writing stdin: {e}"
        );
    }
    child.wait_with_output().unwrap()
}

/// Asserts the run succeeded (else shows its stderr).
pub fn succeeds(out: &Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The one JSON document a successful run printed.
pub fn json_of(out: &Output) -> Value {
    succeeds(out);
    serde_json::from_slice(&out.stdout).expect("one JSON document on stdout")
}

/// `bigmodel run MODEL ARGS --json`'s document.
pub fn run_json(model: &Path, args: &[&str]) -> Value {
    let mut all = vec!["run", model.to_str().unwrap()];
    all.extend_from_slice(args);
    all.push("--json");
    let out = bigmodel(&all);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON document on stdout")
}

/// The stderr of a run that failed.
pub fn failure(out: &Output) -> String {
    assert!(!out.status.success(), "succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Asserts the run failed with `needle` in its stderr, and no panic.
pub fn fails(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "succeeded: {stderr}");
    assert!(
        stderr.contains(needle) && !stderr.contains("panicked"),
        "{stderr:?} lacks {needle:?}"
    );
}

/// Asserts `bigmodel ARGS` fails with `needle` in its stderr, and no panic.
pub fn fails_with(args: &[&str], needle: &str) {
    let out = bigmodel(args);
    assert!(!out.status.success(), "{args:?} succeeded");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(needle),
        "{args:?}: {stderr:?} lacks {needle:?}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// A run document's `generated_ids`.
pub fn generated_ids(doc: &Value) -> Vec<u64> {
    doc["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap())
        .collect()
}

/// `--prompt-ids`' form of `ids`: `1,2,3`.
pub fn ids_arg(ids: &[u64]) -> String {
    ids.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
}

/// One tensor of a safetensors file.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub dtype: String,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// The tensors of a safetensors file by name.
pub fn read_safetensors(path: &Path) -> BTreeMap<String, Tensor> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            let shape = v["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            let (a, b) = (
                v["data_offsets"][0].as_u64().unwrap() as usize,
                v["data_offsets"][1].as_u64().unwrap() as usize,
            );
            let tensor = Tensor {
                dtype: v["dtype"].as_str().unwrap().to_string(),
                shape,
                bytes: data[a..b].to_vec(),
            };
            (k.clone(), tensor)
        })
        .collect()
}

/// The one tensor of a safetensors file (a logits dump), with its name.
pub fn only_tensor(path: &Path) -> (String, Tensor) {
    let tensors = read_safetensors(path);
    assert_eq!(tensors.len(), 1, "{}: {:?}", path.display(), tensors.keys());
    tensors.into_iter().next().unwrap()
}

/// A tensor of a model folder's `reference.safetensors` (transformers'
/// prompts, tokens and logits).
pub fn reference_of(model: &Path, name: &str) -> Tensor {
    read_safetensors(&model.join("reference.safetensors"))
        .remove(name)
        .unwrap()
}

/// An I64 tensor of a model folder's `reference.safetensors`.
pub fn reference_ids_of(model: &Path, name: &str) -> Vec<u64> {
    reference_of(model, name)
        .bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u64)
        .collect()
}

/// Little-endian F32 values.
fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The largest |a - b| of two F32 buffers of the same length.
pub fn max_abs_diff(a: &[u8], b: &[u8]) -> f32 {
    let (a, b) = (floats(a), floats(b));
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// A safetensors file of the header `json` (padded to 8 bytes) and `data`.
pub fn write_raw_safetensors(path: &Path, json: &str, data: &[u8]) {
    let mut json = json.to_string();
    while !json.len().is_multiple_of(8) {
        json.push(' ');
    }
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

/// Writes `tensors` as a safetensors file.
pub fn write_safetensors(path: &Path, tensors: &BTreeMap<String, Tensor>) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, t) in tensors {
        header.insert(
            name.clone(),
            json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [data.len(), data.len() + t.bytes.len()]}),
        );
        data.extend_from_slice(&t.bytes);
    }
    write_raw_safetensors(path, &Value::Object(header).to_string(), &data);
}

/// Copies the files of folder `from` into `to` (created).
pub fn copy_folder(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// Rewrites the JSON file at `path` through `edit`.
pub fn edit_json(path: &Path, edit: impl FnOnce(&mut Value)) {
    let mut doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut doc);
    std::fs::write(path, doc.to_string()).unwrap();
}

/// Medians of `runs` measured `run`s of `model` under `map` (after one
/// unmeasured run that warms the page cache and the CPU), for the timing
/// tests: first forward and seconds per token, and the run's own streamed
/// bytes per token. The prompt is 64 ids below `vocab`; 16 tokens are made.
pub fn measured_runs(
    model: &Path,
    map: &Path,
    offload: &Path,
    runs: usize,
    vocab: usize,
) -> (f64, f64, u64) {
    let prompt: Vec<String> = (0..64).map(|i| (3 + i * 7 % vocab).to_string()).collect();
    let prompt = prompt.join(",");
    let mut first = Vec::new();
    let mut per_token = Vec::new();
    let mut streamed = 0;
    for run in 0..=runs {
        let doc = json_of(&bigmodel(&[
            "run",
            model.to_str().unwrap(),
            "--prompt-ids",
            &prompt,
            "--max-new-tokens",
            "16",
            "--device-map",
            map.to_str().unwrap(),
            "--offload-folder",
            offload.to_str().unwrap(),
            "--json",
        ]));
        if run > 0 {
            first.push(doc["first_forward_seconds"].as_f64().unwrap());
            per_token.push(doc["seconds_per_token"].as_f64().unwrap());
            streamed = doc["bytes_streamed_per_token"].as_u64().unwrap();
        }
    }
    (median(first), median(per_token), streamed)
}

/// The median (the upper one of an even count).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Writes a model folder for the timing tests: `config` as config.json and
/// `shapes` as F32 tensors of small deterministic values (a xorshift stream
/// in `shapes`' order, times `scale_of(name)`; norm weights 1) in
/// model.safetensors. Returns the bytes of the tensors.
pub fn write_random_f32_model(
    dir: &Path,
    config: &Value,
    shapes: Vec<(String, Vec<usize>)>,
    scale_of: impl Fn(&str) -> f32,
) -> u64 {
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut state = 0x9E37_79B9u32;
    let mut tensors = BTreeMap::new();
    let mut total = 0;
    for (name, shape) in shapes {
        let n: usize = shape.iter().product();
        let scale = scale_of(&name);
        let mut bytes = Vec::with_capacity(4 * n);
        for _ in 0..n {
            let v = if name.ends_with("norm.weight") {
                1.0f32
            } else {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                (state as f32 / u32::MAX as f32 - 0.5) * scale
            };
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        total += bytes.len() as u64;
        let dtype = "F32".to_string();
        tensors.insert(
            name,
            Tensor {
                dtype,
                shape,
                bytes,
            },
        );
    }
    write_safetensors(&dir.join("model.safetensors"), &tensors);
    total
}
