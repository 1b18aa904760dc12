//! CUDA runs of bm-models: the tiny decoders' logits and greedy tokens with
//! every weight on GPU 0 against transformers', directly and through
//! dispatch with CPU and disk offload; the quantized tiny Llama on GPU 0
//! against the CPU's quantized model and bitsandbytes'. Run for real on a GPU machine through
//! `cargo xtask gpu-bundle`; without a GPU each test prints "skipped: no
//! CUDA device" and returns, unless `BM_GPU_TESTS=1`, which makes that a
//! failure.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use bigmodel::device::{DeviceSet, Gpu};
use bm_models::{
    Backend, CausalLm, Error, FolderWeights, GenerateOptions, Logits, T5, T5Config, Tensor,
    WeightSource,
};
use bm_tensor::DType;
use safetensors::SafeTensors;

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

/// One file of the quantized Llama fixtures, embedded.
macro_rules! bnb_file {
    ($folder:literal, $file:literal) => {
        (
            $folder,
            $file,
            include_bytes!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/fixtures/tiny-llama-bnb/",
                $folder,
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
    fixture_file!("tiny-qwen3", "config.json"),
    fixture_file!("tiny-qwen3", "generation_config.json"),
    fixture_file!("tiny-qwen3", "model.safetensors.index.json"),
    fixture_file!("tiny-qwen3", "model-00001-of-00004.safetensors"),
    fixture_file!("tiny-qwen3", "model-00002-of-00004.safetensors"),
    fixture_file!("tiny-qwen3", "model-00003-of-00004.safetensors"),
    fixture_file!("tiny-qwen3", "model-00004-of-00004.safetensors"),
    fixture_file!("tiny-qwen3", "reference.safetensors"),
    fixture_file!("tiny-qwen2-swa", "config.json"),
    fixture_file!("tiny-qwen2-swa", "model.safetensors"),
    fixture_file!("tiny-qwen2-swa", "reference.safetensors"),
    fixture_file!("tiny-gpt2", "config.json"),
    fixture_file!("tiny-gpt2", "model.safetensors"),
    fixture_file!("tiny-gemma2", "config.json"),
    fixture_file!("tiny-gemma2", "model.safetensors"),
    fixture_file!("tiny-phi3", "config.json"),
    fixture_file!("tiny-phi3", "model.safetensors"),
    fixture_file!("tiny-t5", "config.json"),
    fixture_file!("tiny-t5", "model.safetensors"),
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
    for model in [
        "tiny-llama",
        "tiny-qwen2",
        "tiny-mistral",
        "tiny-qwen3",
        "tiny-qwen2-swa",
    ] {
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

/// Largest absolute difference of two logit tensors of one shape.
fn max_diff(gpu: &Tensor, cpu: &Tensor) -> f32 {
    assert_eq!(gpu.shape(), cpu.shape());
    let (g, c) = (gpu.to_host().unwrap().to_f32_vec(), cpu.to_f32_vec());
    g.iter()
        .zip(&c)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max)
}

/// GPT-2 (Conv1D weights, tanh GELU, learned positions), Phi-3 (LongRoPE
/// frequencies, rotary from host tables) and Gemma 2 (soft-capped
/// attention and logits, sliding-window layers) with every weight on GPU 0
/// compute the CPU's logits, over a prefill and a decode step.
#[test]
fn tiny_gpt2_phi3_and_gemma2_on_gpu_match_the_cpu_model() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let root = fixtures();
    for model in ["tiny-gpt2", "tiny-phi3", "tiny-gemma2"] {
        let dir = root.path().join(model);
        let lm = CausalLm::open(&dir, Some(DType::F32)).unwrap();
        let cpu = FolderWeights::open(&dir, Some(DType::F32)).unwrap();
        let gpu = GpuWeights {
            folder: FolderWeights::open(&dir, Some(DType::F32)).unwrap(),
            gpu: set.gpu(0).unwrap().clone(),
            cache: Mutex::new(HashMap::new()),
        };
        let (mut cpu_cache, mut gpu_cache) = (lm.decoder().new_cache(), lm.decoder().new_cache());
        for (step, ids) in [[1u32, 2, 3, 4].as_slice(), &[5]].into_iter().enumerate() {
            let want = lm
                .decoder()
                .forward(&cpu, ids, &mut cpu_cache, Logits::All)
                .unwrap();
            let got = lm
                .decoder()
                .forward(&gpu, ids, &mut gpu_cache, Logits::All)
                .unwrap();
            assert_eq!(got.backend(), Backend::Cuda(0));
            let diff = max_diff(&got, &want);
            println!("{model} on GPU, step {step}: max |diff| {diff:e}");
            assert!(diff <= 1e-4, "{model} step {step}: max |diff| {diff}");
        }
    }
}

/// T5 (relative position bias, unscaled attention, cross-attention) with
/// every weight on GPU 0 computes the CPU's encoder output and decoder
/// logits, over a decoder prefill of three tokens and one step.
#[test]
fn tiny_t5_on_gpu_matches_the_cpu_model() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let root = fixtures();
    let dir = root.path().join("tiny-t5");
    let cpu = FolderWeights::open(&dir, Some(DType::F32)).unwrap();
    let gpu = GpuWeights {
        folder: FolderWeights::open(&dir, Some(DType::F32)).unwrap(),
        gpu: set.gpu(0).unwrap().clone(),
        cache: Mutex::new(HashMap::new()),
    };
    let config = T5Config::from_dir(&dir).unwrap().tie_to(&cpu);
    let t5 = T5::new(config, DType::F32).unwrap();
    let input = [5u32, 6, 7, 8];
    let (cpu_encoded, gpu_encoded) = (
        t5.encode(&cpu, &input).unwrap(),
        t5.encode(&gpu, &input).unwrap(),
    );
    assert_eq!(gpu_encoded.backend(), Backend::Cuda(0));
    let diff = max_diff(&gpu_encoded, &cpu_encoded);
    println!("tiny-t5 encoder on GPU: max |diff| {diff:e}");
    assert!(diff <= 1e-4, "tiny-t5 encoder: max |diff| {diff}");
    let mut cpu_cache = t5.new_cache(cpu_encoded);
    let mut gpu_cache = t5.new_cache(gpu_encoded);
    let start = t5.config().decoder_start_token_id;
    for (step, ids) in [[start, 9, 10].as_slice(), &[11]].into_iter().enumerate() {
        let want = t5.decode(&cpu, ids, &mut cpu_cache).unwrap();
        let got = t5.decode(&gpu, ids, &mut gpu_cache).unwrap();
        assert_eq!(got.backend(), Backend::Cuda(0));
        let diff = max_diff(&got, &want);
        println!("tiny-t5 decoder on GPU, step {step}: max |diff| {diff:e}");
        assert!(diff <= 1e-4, "tiny-t5 step {step}: max |diff| {diff}");
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

#[test]
fn a_steady_state_decode_step_takes_no_memory_from_the_driver() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let gpu = set.gpu(0).unwrap();
    let root = fixtures();
    let dir = root.path().join("tiny-llama");
    let lm = CausalLm::open(&dir, Some(DType::F32)).unwrap();
    let weights = GpuWeights {
        folder: FolderWeights::open(&dir, Some(DType::F32)).unwrap(),
        gpu: gpu.clone(),
        cache: Mutex::new(HashMap::new()),
    };
    let decoder = lm.decoder();
    let mut cache = decoder.new_cache();
    let mut step = |ids: &[u32]| -> u32 {
        let logits = decoder
            .forward(&weights, ids, &mut cache, Logits::Last)
            .unwrap();
        let row = logits.to_host().unwrap().to_f32_vec();
        let best = row
            .iter()
            .enumerate()
            .fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b });
        best.0 as u32
    };
    // The prompt, then identical one-token steps (the KV cache holds 64
    // positions before it grows, far more than these).
    let mut token = step(&[1, 2, 3, 4]);
    let mut counts = Vec::new();
    for _ in 0..8 {
        token = step(&[token]);
        counts.push(gpu.driver_allocations());
    }
    println!("driver allocations after each decode step: {counts:?}");
    // The first steps may grow the pool; after them the pool serves every
    // allocation from what earlier steps freed.
    assert_eq!(counts[2], counts[7], "{counts:?}");
}

/// A quantized model with every weight on GPU 0: its quantized linear
/// layers run on CUDA reading the packed weight (quantized while loading,
/// and a folder transformers saved pre-quantized), with logits close to the
/// CPU's quantized model and to transformers + bitsandbytes'.
#[test]
fn quantized_tiny_llama_on_gpu_matches_the_cpu_quantized_model() {
    use bigmodel::plan::DeviceMap;
    use bigmodel::{DeviceMapSpec, Options};
    use bm_models::{Dispatched, QuantizeOptions, open_causal_lm, open_causal_lm_quantized};

    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let devices = Arc::new(set);
    let root = tempfile::tempdir().unwrap();
    for (folder, file, bytes) in BNB_FIXTURES {
        let dir = root.path().join(folder);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(file), bytes).unwrap();
    }
    let reference = SafeTensors::deserialize(BNB_REFERENCE).unwrap();
    // 12 tokens: a prefill of 11 rows dequantizes 4-bit weights for a GEMM.
    let ids = reference_ids(&reference, "prompt.2");
    let options = |map: serde_json::Value| Options {
        device_map: Some(DeviceMapSpec::Map(DeviceMap::from_json(&map).unwrap())),
        dtype: Some(DType::F32),
        force_hooks: true,
        ..Options::default()
    };
    let logits = |d: &Dispatched<CausalLm>| {
        let mut cache = d.model.decoder().new_cache();
        // Prefill (several rows: the dequantize-and-GEMM path), then one
        // decode step (one row: the kernels reading the weight packed).
        let prefill = d
            .model
            .decoder()
            .forward(&d.weights, &ids[..ids.len() - 1], &mut cache, Logits::All)
            .unwrap()
            .to_host()
            .unwrap()
            .to_f32_vec();
        let step = d
            .model
            .decoder()
            .forward(&d.weights, &ids[ids.len() - 1..], &mut cache, Logits::All)
            .unwrap()
            .to_host()
            .unwrap()
            .to_f32_vec();
        [prefill, step].concat()
    };
    let max_diff = |a: &[f32], b: &[f32]| {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    };
    for format in ["nf4", "fp4", "int8"] {
        let mut quantize = QuantizeOptions::named(format).unwrap();
        if format == "int8" {
            // The fixture's threshold, so outliers occur.
            quantize.format = bm_compute::quant::QuantFormat::Int8 { threshold: 2.5 };
        }
        let base = root.path().join("base");
        let cpu = Arc::new(DeviceSet::cpu_only());
        let on_cpu = open_causal_lm_quantized(
            &base,
            cpu,
            &options(serde_json::json!({"": "cpu"})),
            &quantize,
        )
        .unwrap();
        let on_gpu = open_causal_lm_quantized(
            &base,
            Arc::clone(&devices),
            &options(serde_json::json!({"": 0})),
            &quantize,
        )
        .unwrap();
        let (want, got) = (logits(&on_cpu), logits(&on_gpu));
        let diff = max_diff(&got, &want);
        println!("{format} quantized on load, GPU vs CPU: max |diff| {diff:e}");
        // Sums in another order; for 8-bit an activation may round to the
        // next int8 code.
        assert!(diff <= 1e-3, "{format}: GPU vs CPU max |diff| {diff}");
    }
    // transformers' pre-quantized folders, on the GPU as saved.
    for format in ["nf4", "fp4", "int8"] {
        let dir = root.path().join(format);
        let d = open_causal_lm(
            &dir,
            Arc::clone(&devices),
            &options(serde_json::json!({"": 0})),
        )
        .unwrap();
        // One token (the packed kernels) and twelve (dequantize and GEMM).
        for prompt in [1, 2] {
            let ids = reference_ids(&reference, &format!("prompt.{prompt}"));
            let mut cache = d.model.decoder().new_cache();
            let got = d
                .model
                .decoder()
                .forward(&d.weights, &ids, &mut cache, Logits::All)
                .unwrap();
            assert_eq!(got.backend(), Backend::Cuda(0), "{format}");
            let want = reference_floats(&reference, &format!("logits_{format}.{prompt}"));
            let diff = max_diff(&got.to_host().unwrap().to_f32_vec(), &want);
            println!(
                "{format} pre-quantized on GPU, prompt {prompt}, vs transformers + \
                 bitsandbytes: max |diff| {diff:e}"
            );
            assert!(diff <= 1e-3, "{format} prompt {prompt}: max |diff| {diff}");
        }
    }
}

/// The quantized Llama fixtures of tools/make_bnb_fixtures.py, embedded.
const BNB_FIXTURES: &[(&str, &str, &[u8])] = &[
    bnb_file!("base", "config.json"),
    bnb_file!("base", "model.safetensors"),
    bnb_file!("nf4", "config.json"),
    bnb_file!("nf4", "model.safetensors"),
    bnb_file!("fp4", "config.json"),
    bnb_file!("fp4", "model.safetensors"),
    bnb_file!("int8", "config.json"),
    bnb_file!("int8", "model.safetensors"),
];

const BNB_REFERENCE: &[u8] = include_bytes!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/tiny-llama-bnb/reference.safetensors"
));
