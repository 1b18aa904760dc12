//! CUDA compute of bm-models: every op on a GPU against the CPU op, and the
//! tiny decoders' logits and greedy tokens with every weight on GPU 0
//! against transformers'. Run for real on a GPU machine through `cargo
//! xtask gpu-bundle`; without a GPU each test prints "skipped: no CUDA
//! device" and returns, unless `BM_GPU_TESTS=1`, which makes that a failure.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use bigmodel::device::{DeviceSet, Gpu};
use bm_models::ops::{self, Heads, LayerCache, Mask, Rope};
use bm_models::{
    Backend, CausalLm, Error, FolderWeights, GenerateOptions, Logits, Tensor, WeightSource,
};
use bm_tensor::DType;
use safetensors::SafeTensors;

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let h = i
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(97));
            ((h >> 8) % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}

fn host(dtype: DType, shape: &[usize], seed: u32) -> Tensor {
    Tensor::from_f32(dtype, shape, &values(shape.iter().product(), seed)).unwrap()
}

/// Compares a GPU result with the CPU op's, in units of the dtype's precision.
fn assert_matches(what: &str, gpu: &Tensor, cpu: &Tensor) {
    assert!(
        matches!(gpu.backend(), Backend::Cuda(0)),
        "{what} ran on {:?}",
        gpu.backend()
    );
    assert_eq!(
        (gpu.shape(), gpu.dtype()),
        (cpu.shape(), cpu.dtype()),
        "{what}"
    );
    let tol = match cpu.dtype() {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        _ => 1.6e-2,
    };
    let (g, c) = (gpu.to_host().unwrap().to_f32_vec(), cpu.to_f32_vec());
    for (i, (a, b)) in g.iter().zip(&c).enumerate() {
        assert!(
            (a - b).abs() <= tol * (1.0 + b.abs()),
            "{what} {}[{i}]: GPU {a}, CPU {b}",
            cpu.dtype()
        );
    }
}

#[test]
fn every_op_on_a_gpu_matches_the_cpu_op() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let gpu = set.gpu(0).unwrap();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let (s, hidden, out) = (5, 64, 48);
        let x = host(dtype, &[s, hidden], 1);
        let w = host(dtype, &[out, hidden], 2);
        let bias = host(dtype, &[out], 3);
        let norm_w = host(dtype, &[hidden], 4);
        let norm_b = host(dtype, &[hidden], 5);
        let (gx, gw) = (x.to_gpu(gpu).unwrap(), w.to_gpu(gpu).unwrap());
        let gbias = bias.to_gpu(gpu).unwrap();

        assert_matches(
            "linear",
            &ops::linear(&gx, &gw, Some(&gbias)).unwrap(),
            &ops::linear(&x, &w, Some(&bias)).unwrap(),
        );
        // A host weight with a GPU activation: uploaded for the op.
        assert_matches(
            "linear with a host weight",
            &ops::linear(&gx, &w, None).unwrap(),
            &ops::linear(&x, &w, None).unwrap(),
        );
        let gnw = norm_w.to_gpu(gpu).unwrap();
        assert_matches(
            "rms_norm",
            &ops::rms_norm(&gx, &gnw, 1e-6).unwrap(),
            &ops::rms_norm(&x, &norm_w, 1e-6).unwrap(),
        );
        assert_matches(
            "layer_norm",
            &ops::layer_norm(&gx, &gnw, &norm_b.to_gpu(gpu).unwrap(), 1e-12).unwrap(),
            &ops::layer_norm(&x, &norm_w, &norm_b, 1e-12).unwrap(),
        );
        let rope = Rope::new(16, 10000.0);
        assert_matches(
            "rotary",
            &rope.apply(&gx, 7).unwrap(),
            &rope.apply(&x, 7).unwrap(),
        );
        assert_matches(
            "softmax",
            &ops::softmax(&gx).unwrap(),
            &ops::softmax(&x).unwrap(),
        );
        assert_matches("silu", &ops::silu(&gx).unwrap(), &ops::silu(&x).unwrap());
        assert_matches("gelu", &ops::gelu(&gx).unwrap(), &ops::gelu(&x).unwrap());
        let y = host(dtype, &[s, hidden], 6);
        let gy = y.to_gpu(gpu).unwrap();
        assert_matches(
            "add",
            &ops::add(&gx, &gy).unwrap(),
            &ops::add(&x, &y).unwrap(),
        );
        assert_matches(
            "mul",
            &ops::mul(&gx, &gy).unwrap(),
            &ops::mul(&x, &y).unwrap(),
        );
        let table = host(dtype, &[11, hidden], 7);
        let gtable = table.to_gpu(gpu).unwrap();
        for out_dtype in [DType::F32, dtype] {
            assert_matches(
                "embedding",
                &ops::embedding(&[3, 10, 0, 3], &gtable, out_dtype).unwrap(),
                &ops::embedding(&[3, 10, 0, 3], &table, out_dtype).unwrap(),
            );
        }
        assert_matches(
            "to_dtype",
            &gx.to_dtype(DType::F32).unwrap(),
            &x.to_dtype(DType::F32).unwrap(),
        );
        assert_matches("rows", &gx.rows(1, 3).unwrap(), &x.rows(1, 3).unwrap());

        // Attention over a cache filled in two appends (prefill, one step).
        let heads = Heads {
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
        };
        for mask in [Mask::Bidirectional, Mask::Causal, Mask::SlidingWindow(3)] {
            let (mut cpu_cache, mut gpu_cache) = (LayerCache::new(), LayerCache::new());
            for (step, rows) in [(0u32, 4usize), (1, 1)] {
                let k = host(dtype, &[rows, 32], 10 + step);
                let v = host(dtype, &[rows, 32], 20 + step);
                let q = host(dtype, &[rows, 64], 30 + step);
                cpu_cache.append(&k, &v).unwrap();
                gpu_cache
                    .append(&k.to_gpu(gpu).unwrap(), &v.to_gpu(gpu).unwrap())
                    .unwrap();
                assert_eq!(gpu_cache.len(), cpu_cache.len());
                assert_matches(
                    &format!("attention {mask:?} step {step}"),
                    &ops::attention(&q.to_gpu(gpu).unwrap(), &gpu_cache, heads, mask).unwrap(),
                    &ops::attention(&q, &cpu_cache, heads, mask).unwrap(),
                );
            }
        }
    }
}

#[test]
fn mixed_caches_are_refused_with_a_clear_error() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let gpu = set.gpu(0).unwrap();
    let k = host(DType::F32, &[2, 8], 1);
    let mut cache = LayerCache::new();
    cache.append(&k, &k).unwrap();
    let gk = k.to_gpu(gpu).unwrap();
    let err = cache.append(&gk, &gk).unwrap_err();
    assert!(err.to_string().contains("cache is in host memory"), "{err}");
}

/// One fixture file, embedded in the test binary: the GPU bundle runs it on
/// a machine without this source tree.
macro_rules! fixture_file {
    ($model:literal, $file:literal) => {
        (
            $model,
            $file,
            include_bytes!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/fixtures/",
                $model,
                "/",
                $file
            ))
            .as_slice(),
        )
    };
}

const FIXTURES: &[(&str, &str, &[u8])] = &[
    fixture_file!("tiny-llama", "config.json"),
    fixture_file!("tiny-llama", "generation_config.json"),
    fixture_file!("tiny-llama", "model.safetensors"),
    fixture_file!("tiny-llama", "reference.safetensors"),
    fixture_file!("tiny-llama", "tokenizer.json"),
    fixture_file!("tiny-mistral", "config.json"),
    fixture_file!("tiny-mistral", "generation_config.json"),
    fixture_file!("tiny-mistral", "model.safetensors"),
    fixture_file!("tiny-mistral", "reference.safetensors"),
    fixture_file!("tiny-qwen2", "config.json"),
    fixture_file!("tiny-qwen2", "generation_config.json"),
    fixture_file!("tiny-qwen2", "model.safetensors.index.json"),
    fixture_file!("tiny-qwen2", "model-00001-of-00009.safetensors"),
    fixture_file!("tiny-qwen2", "model-00002-of-00009.safetensors"),
    fixture_file!("tiny-qwen2", "model-00003-of-00009.safetensors"),
    fixture_file!("tiny-qwen2", "model-00004-of-00009.safetensors"),
    fixture_file!("tiny-qwen2", "model-00005-of-00009.safetensors"),
    fixture_file!("tiny-qwen2", "model-00006-of-00009.safetensors"),
    fixture_file!("tiny-qwen2", "model-00007-of-00009.safetensors"),
    fixture_file!("tiny-qwen2", "model-00008-of-00009.safetensors"),
    fixture_file!("tiny-qwen2", "model-00009-of-00009.safetensors"),
    fixture_file!("tiny-qwen2", "reference.safetensors"),
];

/// Writes the embedded fixtures into a temporary folder per model.
fn fixtures() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (model, file, bytes) in FIXTURES {
        let folder = dir.path().join(model);
        std::fs::create_dir_all(&folder).unwrap();
        std::fs::write(folder.join(file), bytes).unwrap();
    }
    dir
}

/// A folder's weights, each uploaded to one GPU on first use.
struct GpuWeights {
    folder: FolderWeights,
    gpu: Gpu,
    cache: Mutex<HashMap<String, Arc<Tensor>>>,
}

impl WeightSource for GpuWeights {
    fn tensor(&self, name: &str) -> Result<Arc<Tensor>, Error> {
        if let Some(t) = self.cache.lock().unwrap().get(name) {
            return Ok(Arc::clone(t));
        }
        let t = Arc::new(self.folder.tensor(name)?.to_gpu(&self.gpu)?);
        self.cache
            .lock()
            .unwrap()
            .insert(name.to_string(), Arc::clone(&t));
        Ok(t)
    }
}

fn reference_floats(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn reference_ids(st: &SafeTensors<'_>, name: &str) -> Vec<u32> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

#[test]
fn tiny_decoders_on_gpu_match_transformers() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let gpu = set.gpu(0).unwrap();
    let root = fixtures();
    let fixture = |model: &str| -> PathBuf { root.path().join(model) };
    for model in ["tiny-llama", "tiny-qwen2", "tiny-mistral"] {
        let bytes = std::fs::read(fixture(model).join("reference.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let lm = CausalLm::open(fixture(model), Some(DType::F32)).unwrap();
        let weights = GpuWeights {
            folder: FolderWeights::open(fixture(model), Some(DType::F32)).unwrap(),
            gpu: gpu.clone(),
            cache: Mutex::new(HashMap::new()),
        };
        let prompts = st
            .names()
            .iter()
            .filter(|n| n.starts_with("prompt."))
            .count();
        assert!(prompts >= 3);
        for i in 0..prompts {
            let ids = reference_ids(&st, &format!("prompt.{i}"));
            let want = reference_floats(&st, &format!("logits.{i}"));
            let mut cache = lm.decoder().new_cache();
            let logits = lm
                .decoder()
                .forward(&weights, &ids, &mut cache, Logits::All)
                .unwrap();
            assert_eq!(logits.backend(), Backend::Cuda(0));
            let got = logits.to_host().unwrap().to_f32_vec();
            let diff = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            println!("{model} on GPU, prompt {i}: max |diff| {diff:e}");
            assert!(diff <= 1e-4, "{model} prompt {i}: max |diff| {diff}");

            let tokens = reference_ids(&st, &format!("generated.{i}"));
            let options = GenerateOptions {
                max_new_tokens: tokens.len(),
                ..GenerateOptions::default()
            };
            let generation = lm.decoder().generate(&weights, &ids, &options).unwrap();
            assert_eq!(generation.tokens, tokens, "{model} prompt {i}");
        }
    }
}

/// The tiny Llama loaded through dispatch with GPU 0 as the execution
/// device: all resident, then with one layer CPU-offloaded and one on disk
/// (streamed to GPU 0 for their forward). Both match transformers and each
/// other bit for bit: the same kernels run on the same weights.
#[test]
fn dispatched_tiny_llama_on_gpu_with_cpu_and_disk_offload_matches_transformers() {
    use bigmodel::plan::DeviceMap;
    use bigmodel::{DeviceMapSpec, Options};
    use bm_models::{Dispatched, open_causal_lm};

    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let devices = Arc::new(set);
    let root = fixtures();
    let model_dir = root.path().join("tiny-llama");
    let offload = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(model_dir.join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let placements = [
        serde_json::json!({"": 0}),
        serde_json::json!({
            "model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu",
            "model.layers.2": "disk", "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0,
        }),
    ];
    let mut outputs = Vec::new();
    for map in placements {
        let options = Options {
            device_map: Some(DeviceMapSpec::Map(DeviceMap::from_json(&map).unwrap())),
            offload_folder: Some(offload.path().to_path_buf()),
            dtype: Some(DType::F32),
            force_hooks: true,
            ..Options::default()
        };
        let Dispatched { model, weights } =
            open_causal_lm(&model_dir, Arc::clone(&devices), &options).unwrap();
        let ids = reference_ids(&st, "prompt.1");
        let want = reference_floats(&st, "logits.1");
        let mut cache = model.decoder().new_cache();
        let logits = model
            .decoder()
            .forward(&weights, &ids, &mut cache, Logits::All)
            .unwrap();
        assert_eq!(logits.backend(), Backend::Cuda(0), "{map}");
        let got = logits.to_host().unwrap().to_f32_vec();
        let diff = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        println!("dispatched {map}: max |diff| {diff:e}");
        assert!(diff <= 1e-4, "{map}: max |diff| {diff}");
        outputs.push(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    }
    assert_eq!(outputs[0], outputs[1], "offloading changed the GPU output");
}
