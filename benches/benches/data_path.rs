//! The GPU data path of issue 12, on CUDA GPU 0 when there is one, else on
//! an emulated GPU (host memory: its "DMA" is a memcpy and it computes on
//! the host; every id then says `emulated`), all in one run so each figure
//! stands next to the pinned host-to-device figure of that run:
//!
//! * `data_path/<gpu>/h2d_pinned`: one copy from page-locked memory onto
//!   the GPU, waited for (256 MiB; 16 MiB emulated): the link's ceiling.
//! * `load_bf16` / `load_bf16_to_f32`: the model's bf16 checkpoint (about
//!   2.2 GB on a CUDA GPU) loaded onto the GPU from a warm page cache, as
//!   stored and cast to F32 on the GPU; throughput = checkpoint bytes.
//! * `decode_cpu_offload` / `decode_disk_offload`: one decode token of the
//!   model with the embedding, two layers, norm and head on the GPU and
//!   every other layer offloaded to CPU RAM or to disk (the checkpoint
//!   itself, warm page cache), streamed each token; throughput = weights
//!   streamed per token.
//! * `stream_disk_direct` against `disk_direct_read`: the disk-offloaded
//!   layers streamed with no compute through the reader pool with
//!   `O_DIRECT` reads (the page cache dropped first, and bypassed), next to
//!   one thread reading the same bytes of the same file with `O_DIRECT` in
//!   16 MiB blocks (`dd iflag=direct`): the share of the disk's sequential
//!   bandwidth the streaming reaches on a cold cache.
//!
//! The model is a Llama-style HF folder written once to `BM_BENCH_DATA_DIR`
//! (a temporary folder without it, rewritten only when its size or config
//! changed) with the maps as `map-cpu-offload.json` and
//! `map-disk-offload.json`. `BM_BENCH_DATA_LAYERS` changes the layer count.
//! A summary prints every figure with its share of the pinned H2D figure,
//! and is written as JSON to the file `BM_BENCH_SUMMARY` names, which is
//! where `cargo xtask bench` reads its data-path rows from.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bigmodel::device::{DeviceSet, GpuKind};
use bigmodel::dispatch::{Activations, DiskReads, LoadOptions, Model, load_checkpoint_in_model};
use bigmodel::plan::DeviceMap;
use bigmodel::shard::Checkpoint;
use bigmodel::tensor::DType;
use bigmodel::{DeviceMapSpec, Options};
use bm_models::{CausalLm, Dispatched, Logits, open_causal_lm};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use serde_json::json;

const MIB: usize = 1 << 20;

/// A Llama-style decoder's sizes.
struct Shape {
    vocab: usize,
    hidden: usize,
    intermediate: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
}

impl Shape {
    /// TinyLlama 1.1B (2.2 GB of bf16) on a CUDA GPU; a 60 MB one emulated.
    fn for_gpu(emulated: bool) -> Shape {
        let mut shape = if emulated {
            Shape {
                vocab: 8000,
                hidden: 512,
                intermediate: 1408,
                layers: 12,
                heads: 8,
                kv_heads: 2,
            }
        } else {
            Shape {
                vocab: 32000,
                hidden: 2048,
                intermediate: 5632,
                layers: 22,
                heads: 32,
                kv_heads: 4,
            }
        };
        if let Some(layers) = std::env::var("BM_BENCH_DATA_LAYERS")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            shape.layers = layers;
        }
        shape
    }

    fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, i) = (self.hidden, self.intermediate);
        let kv = self.kv_heads * h / self.heads;
        let mut t = vec![("model.embed_tokens.weight".to_string(), vec![self.vocab, h])];
        for l in 0..self.layers {
            let p = format!("model.layers.{l}");
            t.extend([
                (format!("{p}.input_layernorm.weight"), vec![h]),
                (format!("{p}.self_attn.q_proj.weight"), vec![h, h]),
                (format!("{p}.self_attn.k_proj.weight"), vec![kv, h]),
                (format!("{p}.self_attn.v_proj.weight"), vec![kv, h]),
                (format!("{p}.self_attn.o_proj.weight"), vec![h, h]),
                (format!("{p}.post_attention_layernorm.weight"), vec![h]),
                (format!("{p}.mlp.gate_proj.weight"), vec![i, h]),
                (format!("{p}.mlp.up_proj.weight"), vec![i, h]),
                (format!("{p}.mlp.down_proj.weight"), vec![h, i]),
            ]);
        }
        t.push(("model.norm.weight".to_string(), vec![h]));
        t.push(("lm_head.weight".to_string(), vec![self.vocab, h]));
        t
    }

    fn config(&self) -> serde_json::Value {
        json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16",
            "vocab_size": self.vocab, "hidden_size": self.hidden,
            "intermediate_size": self.intermediate, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
            "rms_norm_eps": 1e-5, "eos_token_id": 2, "tie_word_embeddings": false,
        })
    }

    /// The map: embedding, the first two layers, norm and head on GPU 0,
    /// every other layer on `tier` ("cpu" or "disk").
    fn map(&self, tier: &str) -> serde_json::Value {
        let mut map = serde_json::Map::new();
        map.insert("model.embed_tokens".into(), json!(0));
        for l in 0..self.layers {
            let place = if l < 2 { json!(0) } else { json!(tier) };
            map.insert(format!("model.layers.{l}"), place);
        }
        for name in ["model.norm", "model.rotary_emb", "lm_head"] {
            map.insert(name.into(), json!(0));
        }
        serde_json::Value::Object(map)
    }
}

/// Writes the model folder (config.json, one bf16 model.safetensors of
/// small deterministic values, norms 1) and the two maps, unless a
/// complete one is there already. Returns the checkpoint's byte range of
/// the offloaded layers.
fn write_model(dir: &Path, shape: &Shape) -> std::ops::Range<u64> {
    std::fs::create_dir_all(dir).unwrap();
    let tensors = shape.tensors();
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    let mut offloaded = (usize::MAX, 0);
    for (name, dims) in &tensors {
        let len = 2 * dims.iter().product::<usize>();
        header.insert(
            name.clone(),
            json!({"dtype": "BF16", "shape": dims, "data_offsets": [offset, offset + len]}),
        );
        let layer = name
            .strip_prefix("model.layers.")
            .and_then(|r| r.split('.').next())
            .and_then(|n| n.parse::<usize>().ok());
        if layer.is_some_and(|l| l >= 2) {
            offloaded = (offloaded.0.min(offset), offloaded.1.max(offset + len));
        }
        offset += len;
    }
    let mut header = serde_json::Value::Object(header).to_string();
    while !header.len().is_multiple_of(8) {
        header.push(' ');
    }
    let data_start = (8 + header.len()) as u64;
    let path = dir.join("model.safetensors");
    let complete = std::fs::metadata(&path).is_ok_and(|m| m.len() == data_start + offset as u64)
        && std::fs::read(dir.join("config.json"))
            .is_ok_and(|c| c == shape.config().to_string().as_bytes());
    if !complete {
        let tmp = dir.join("model.safetensors.tmp");
        let mut out =
            std::io::BufWriter::with_capacity(8 * MIB, std::fs::File::create(&tmp).unwrap());
        out.write_all(&(header.len() as u64).to_le_bytes()).unwrap();
        out.write_all(header.as_bytes()).unwrap();
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut values = Vec::with_capacity(8 * MIB);
        for (name, dims) in &tensors {
            let norm = name.ends_with("norm.weight");
            let mut left: usize = dims.iter().product();
            while left > 0 {
                let n = left.min(4 * MIB);
                values.clear();
                for _ in 0..n {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let v = if norm {
                        1.0f32
                    } else {
                        ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
                    };
                    // bf16: the top half of the f32 (truncation is fine for data).
                    values.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
                }
                out.write_all(&values).unwrap();
                left -= n;
            }
        }
        out.into_inner().unwrap().sync_all().unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        std::fs::write(dir.join("config.json"), shape.config().to_string()).unwrap();
    }
    for tier in ["cpu", "disk"] {
        std::fs::write(
            dir.join(format!("map-{tier}-offload.json")),
            serde_json::to_string_pretty(&shape.map(tier)).unwrap(),
        )
        .unwrap();
    }
    data_start + offloaded.0 as u64..data_start + offloaded.1 as u64
}

/// The devices: CUDA when there is a GPU, else one emulated GPU.
fn devices() -> (Arc<DeviceSet>, &'static str) {
    let probed = DeviceSet::probe();
    if probed.gpus().iter().any(|g| g.kind() == GpuKind::Cuda) {
        (Arc::new(probed), "cuda")
    } else {
        (Arc::new(DeviceSet::emulated(&[64 << 30])), "emulated")
    }
}

/// The folder the model lives in, kept when named by `BM_BENCH_DATA_DIR`.
fn data_dir() -> (PathBuf, Option<tempfile::TempDir>) {
    match std::env::var_os("BM_BENCH_DATA_DIR") {
        Some(d) => (PathBuf::from(d), None),
        None => {
            let t = tempfile::tempdir().unwrap();
            (t.path().to_path_buf(), Some(t))
        }
    }
}

/// The model opened over `devices` with the map `map-<tier>-offload.json`.
fn open(dir: &Path, devices: &Arc<DeviceSet>, tier: &str, offload: &Path) -> Dispatched<CausalLm> {
    let text = std::fs::read_to_string(dir.join(format!("map-{tier}-offload.json"))).unwrap();
    let map = DeviceMap::from_json(&serde_json::from_str(&text).unwrap()).unwrap();
    let options = Options {
        device_map: Some(DeviceMapSpec::Map(map)),
        offload_folder: Some(offload.to_path_buf()),
        ..Options::default()
    };
    open_causal_lm(dir, Arc::clone(devices), &options).unwrap()
}

/// One decode token through every block, its logits brought to the host
/// (so a GPU has finished).
fn one_token(lm: &Dispatched<CausalLm>) {
    let mut cache = lm.model.decoder().new_cache();
    let logits = lm
        .model
        .decoder()
        .forward(&lm.weights, &[17], &mut cache, Logits::Last)
        .unwrap();
    std::hint::black_box(logits.to_f32_vec());
}

/// Enters and exits every offloaded layer of `model` (weights streamed in,
/// nothing computed).
fn stream_layers(model: &Model, layers: usize) {
    for l in 2..layers {
        let g = model
            .enter(&format!("model.layers.{l}"), Activations::default())
            .unwrap();
        g.exit(Activations::default()).unwrap();
    }
}

/// Drops `path`'s pages from the page cache (they are clean).
fn drop_cached(path: &Path) {
    use std::os::unix::io::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    // SAFETY: advice on an open descriptor; no memory is touched.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

/// `path` opened for `O_DIRECT` reads, or `None` where the file system
/// refuses them (tmpfs, some sandboxes).
fn open_direct(path: &Path) -> Option<std::fs::File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .ok()
}

/// Reads `range` of `file` with `O_DIRECT` in 16 MiB blocks, one after the
/// other: what `dd iflag=direct bs=16M` does.
fn direct_read(file: &std::fs::File, range: &std::ops::Range<u64>, buf: &mut AlignedBuf) {
    use std::os::unix::fs::FileExt;
    let mut at = range.start / 4096 * 4096;
    while at < range.end {
        let n = file.read_at(buf.as_mut(), at).unwrap();
        if n == 0 {
            break;
        }
        at += n as u64;
    }
}

/// A 16 MiB buffer aligned for `O_DIRECT`.
struct AlignedBuf(Box<[u8]>, usize);

impl AlignedBuf {
    fn new() -> AlignedBuf {
        let raw = vec![0u8; 16 * MIB + 4096].into_boxed_slice();
        let skip = raw.as_ptr().align_offset(4096);
        AlignedBuf(raw, skip)
    }

    fn as_mut(&mut self) -> &mut [u8] {
        let skip = self.1;
        &mut self.0[skip..skip + 16 * MIB]
    }
}

fn gbps(bytes: u64, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// Median of `runs` timings of `f`.
fn median(runs: usize, mut f: impl FnMut()) -> Duration {
    let mut t: Vec<Duration> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    t.sort();
    t[runs / 2]
}

fn data_path(c: &mut Criterion) {
    let (devices, kind) = devices();
    let emulated = kind == "emulated";
    let shape = Shape::for_gpu(emulated);
    let (dir, _keep) = data_dir();
    let offloaded_range = write_model(&dir, &shape);
    let ckpt_path = dir.join("model.safetensors");
    let ckpt_bytes = std::fs::metadata(&ckpt_path).unwrap().len();
    let gpu = devices.gpu(0).unwrap().clone();
    let mut group = c.benchmark_group(format!("data_path/{kind}"));
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(if emulated { 3 } else { 5 }));

    // The link's ceiling: one pinned copy, waited for.
    let h2d_bytes = if emulated { 16 * MIB } else { 256 * MIB };
    let mut pinned = devices.alloc_pinned(h2d_bytes).unwrap();
    pinned.as_mut_slice().unwrap().fill(7);
    let mut dst = gpu.alloc_on(h2d_bytes, gpu.copy_stream()).unwrap();
    let mut h2d = || {
        dst.copy_from_pinned(0, &pinned, 0..h2d_bytes, gpu.copy_stream())
            .unwrap()
            .synchronize()
            .unwrap()
    };
    group.throughput(Throughput::Bytes(h2d_bytes as u64));
    group.bench_function("h2d_pinned", |b| b.iter(&mut h2d));
    let h2d_gbps = gbps(h2d_bytes as u64, median(5, &mut h2d));
    drop(dst);

    // Loading the whole checkpoint onto the GPU (warm page cache).
    let ckpt = Checkpoint::open(&ckpt_path).unwrap();
    std::hint::black_box(std::fs::read(&ckpt_path).unwrap().len());
    let config =
        bigmodel::plan::config::HfConfig::parse(&shape.config().to_string(), "config.json")
            .unwrap();
    let tree = bigmodel::plan::hf::tree_from_config(&config).unwrap().tree;
    let all_on_gpu = DeviceMap::from_json(&json!({"": 0})).unwrap();
    let mut load_rates = Vec::new();
    for (name, dtype) in [("load_bf16", DType::BF16), ("load_bf16_to_f32", DType::F32)] {
        let options = LoadOptions {
            dtype: Some(dtype),
            ..LoadOptions::default()
        };
        let mut load = || {
            let model = Model::empty(tree.clone(), Arc::clone(&devices)).unwrap();
            load_checkpoint_in_model(&model, &ckpt, Some(&all_on_gpu), &options).unwrap();
        };
        group.throughput(Throughput::Bytes(ckpt_bytes));
        group.bench_function(name, |b| b.iter(&mut load));
        load_rates.push((name, gbps(ckpt_bytes, median(3, &mut load))));
    }

    // Decode tokens with most layers streamed from CPU RAM or disk.
    let offload = tempfile::tempdir().unwrap();
    let mut decode_rates = Vec::new();
    for tier in ["cpu", "disk"] {
        let lm = open(&dir, &devices, tier, offload.path());
        let before = lm.weights.streamed_bytes();
        one_token(&lm);
        let streamed = lm.weights.streamed_bytes() - before;
        group.throughput(Throughput::Bytes(streamed));
        group.bench_function(format!("decode_{tier}_offload"), |b| {
            b.iter(|| one_token(&lm))
        });
        let t = median(3, || one_token(&lm));
        decode_rates.push((tier, gbps(streamed, t), 1.0 / t.as_secs_f64()));
    }

    // Cold disk: the reader pool with direct reads against one thread
    // reading the same bytes directly, alternated; nothing where the file
    // system refuses O_DIRECT (the pool would then read through the cache).
    let disk_bytes = offloaded_range.end - offloaded_range.start;
    let cold = open_direct(&ckpt_path).map(|file| {
        let lm = open(&dir, &devices, "disk", offload.path());
        let model = lm.weights.model();
        model.set_disk_reads(DiskReads::Direct);
        let mut buf = AlignedBuf::new();
        group.throughput(Throughput::Bytes(disk_bytes));
        group.bench_function("disk_direct_read", |b| {
            b.iter(|| direct_read(&file, &offloaded_range, &mut buf))
        });
        group.bench_function("stream_disk_direct", |b| {
            b.iter(|| {
                drop_cached(&ckpt_path);
                stream_layers(model, shape.layers)
            })
        });
        let (mut disk, mut streamed) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            disk.push(median(1, || direct_read(&file, &offloaded_range, &mut buf)));
            drop_cached(&ckpt_path);
            streamed.push(median(1, || stream_layers(model, shape.layers)));
        }
        disk.sort();
        streamed.sort();
        (gbps(disk_bytes, disk[1]), gbps(disk_bytes, streamed[1]))
    });
    group.finish();
    let (disk, streamed) = (cold.map(|c| c.0), cold.map(|c| c.1));

    let summary = json!({
        "device": kind,
        "h2d_pinned_gbps": h2d_gbps,
        "h2d_bytes": h2d_bytes,
        "checkpoint_bytes": ckpt_bytes,
        "load_gbps": load_rates.iter().map(|(n, r)| (n.to_string(), json!(r))).collect::<serde_json::Map<_, _>>(),
        "decode": decode_rates.iter().map(|(tier, rate, tokens)| (format!("{tier}_offload"), json!({
            "streamed_gbps": rate, "tokens_per_second": tokens,
        }))).collect::<serde_json::Map<_, _>>(),
        "offloaded_layers": shape.layers.saturating_sub(2),
        "cold_disk_bytes": disk_bytes,
        "cold_disk_stream_gbps": streamed,
        "cold_disk_direct_read_gbps": disk,
    });
    if let Some(path) = std::env::var_os("BM_BENCH_SUMMARY") {
        std::fs::write(&path, format!("{summary:#}\n")).unwrap();
    }
    println!(
        "\nsummary ({kind} GPU 0{}): pinned H2D {h2d_gbps:.2} GB/s",
        if emulated {
            ": host memory, a memcpy per copy, host compute"
        } else {
            ""
        }
    );
    let share = |v: f64| format!("{v:.2} GB/s = {:.0} % of pinned H2D", 100.0 * v / h2d_gbps);
    for (name, rate) in &load_rates {
        println!(
            "  {name}: {} ({:.2} GB checkpoint, warm page cache)",
            share(*rate),
            ckpt_bytes as f64 / 1e9
        );
    }
    for (tier, rate, tokens) in &decode_rates {
        println!(
            "  decode, layers 2..{} offloaded to {tier}: weights streamed at {}, {tokens:.2} tokens/s",
            shape.layers,
            share(*rate)
        );
    }
    match cold {
        Some((disk, streamed)) => println!(
            "  cold disk: reader pool with O_DIRECT {streamed:.3} GB/s, one-thread O_DIRECT read {disk:.3} GB/s: {:.0} % of the disk's sequential bandwidth ({:.0} MB)",
            100.0 * streamed / disk,
            disk_bytes as f64 / 1e6
        ),
        None => println!(
            "  cold disk: not measured, {} refuses O_DIRECT (set BM_BENCH_DATA_DIR to a folder on a disk)",
            ckpt_path.display()
        ),
    }
}

criterion_group!(benches, data_path);
criterion_main!(benches);
