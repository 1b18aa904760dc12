//! `bigmodel demo`: the main job for a new user, with no download and no
//! GPU needed. Creates (once, cached) a Llama-style checkpoint of about
//! 1 GB with deterministic random weights, plans it under a budget that
//! forces offloading (GPU + CPU + disk with a GPU, CPU + disk without),
//! loads and runs it, and checks the output against the same model run
//! fully in RAM, bit for bit.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bigmodel::device::DeviceSet;
use bigmodel::plan::{Device, MaxMemory, Mode, human_bytes};
use bigmodel::shard::{
    SaveTensor, ShardOptions, create_temp_folder, shard_checkpoint, write_atomic,
};
use bigmodel::tensor::{DType, TensorMeta};
use bigmodel::{DeviceMapSpec, Options};
use bm_models::{CausalLm, GenerateOptions, Generation, open_causal_lm};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use super::CmdResult;
use super::run::{peak_host_bytes, print_device_map, seconds_per_token};

/// Arguments of `bigmodel demo`.
#[derive(clap::Args)]
pub struct Args {
    /// Tokens to generate.
    #[arg(long, default_value_t = 4)]
    max_new_tokens: usize,
    /// Where the demo checkpoint is kept. Default: $BM_DEMO_DIR, else
    /// $XDG_CACHE_HOME/bigmodel/demo, else ~/.cache/bigmodel/demo.
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Model size: `full` (about 1 GB) or `tiny` (for tests). Default:
    /// $BM_DEMO_SCALE, else full.
    #[arg(long, hide = true)]
    scale: Option<String>,
}

/// The demo model's geometry.
struct Shape {
    name: &'static str,
    vocab: usize,
    hidden: usize,
    intermediate: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    max_shard_size: u64,
}

/// About 976 MB of F32 weights: 16 layers of 44.6 MB and two 131 MB
/// vocabulary matrices.
const FULL: Shape = Shape {
    name: "full",
    vocab: 32000,
    hidden: 1024,
    intermediate: 2816,
    layers: 16,
    heads: 16,
    kv_heads: 4,
    max_shard_size: 256 << 20,
};

const TINY: Shape = Shape {
    name: "tiny",
    vocab: 512,
    hidden: 64,
    intermediate: 160,
    layers: 6,
    heads: 4,
    kv_heads: 2,
    max_shard_size: 64 << 10,
};

/// The prompt every run uses (ids below every shape's vocabulary).
const PROMPT: [u32; 8] = [1, 17, 42, 7, 99, 3, 256, 11];

impl Shape {
    fn config(&self) -> serde_json::Value {
        json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "dtype": "float32",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "hidden_act": "silu",
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": false,
            "bos_token_id": 1,
            "eos_token_id": 2,
        })
    }

    /// Every tensor's name and shape, in transformers' order.
    fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, i) = (self.hidden, self.intermediate);
        let head_dim = h / self.heads;
        let kv = self.kv_heads * head_dim;
        let mut out = vec![("model.embed_tokens.weight".to_string(), vec![self.vocab, h])];
        for l in 0..self.layers {
            let p = format!("model.layers.{l}");
            out.extend([
                (format!("{p}.self_attn.q_proj.weight"), vec![h, h]),
                (format!("{p}.self_attn.k_proj.weight"), vec![kv, h]),
                (format!("{p}.self_attn.v_proj.weight"), vec![kv, h]),
                (format!("{p}.self_attn.o_proj.weight"), vec![h, h]),
                (format!("{p}.mlp.gate_proj.weight"), vec![i, h]),
                (format!("{p}.mlp.up_proj.weight"), vec![i, h]),
                (format!("{p}.mlp.down_proj.weight"), vec![h, i]),
                (format!("{p}.input_layernorm.weight"), vec![h]),
                (format!("{p}.post_attention_layernorm.weight"), vec![h]),
            ]);
        }
        out.push(("model.norm.weight".to_string(), vec![h]));
        out.push(("lm_head.weight".to_string(), vec![self.vocab, h]));
        out
    }
}

/// Deterministic values for tensor `name`: ones for norms, uniform in
/// ±0.05 otherwise, from a splitmix64 stream seeded by the name.
fn values(name: &str, numel: usize) -> Vec<f32> {
    if name.ends_with("norm.weight") {
        return vec![1.0; numel];
    }
    let mut state = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut out = Vec::with_capacity(numel);
    while out.len() < numel {
        let bits = next();
        for half in [bits as u32, (bits >> 32) as u32] {
            if out.len() < numel {
                // 24 random bits mapped to [-0.05, 0.05).
                out.push(((half >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 0.1);
            }
        }
    }
    out
}

fn cache_root(args: &Args) -> Result<PathBuf, String> {
    if let Some(dir) = &args.cache_dir {
        return Ok(dir.clone());
    }
    if let Some(dir) = std::env::var_os("BM_DEMO_DIR") {
        return Ok(PathBuf::from(dir));
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(dir).join("bigmodel/demo"));
    }
    match std::env::var_os("HOME") {
        Some(home) => Ok(PathBuf::from(home).join(".cache/bigmodel/demo")),
        None => Err(
            "no cache folder: set BM_DEMO_DIR, XDG_CACHE_HOME or HOME, or pass --cache-dir".into(),
        ),
    }
}

/// The checkpoint folder of `shape` under `root`, created first if absent:
/// written into a temporary folder that is renamed into place when
/// complete, so an interrupted run never leaves a half-written model.
fn ensure_checkpoint(root: &Path, shape: &Shape) -> Result<PathBuf, String> {
    let dir = root.join(format!("{}-v1", shape.name));
    if dir.join("config.json").is_file() {
        eprintln!("checkpoint: {} (cached)", dir.display());
        return Ok(dir);
    }
    std::fs::create_dir_all(root).map_err(|e| format!("creating {}: {e}", root.display()))?;
    // A fresh folder (never an existing one or a planted link), which a
    // later run removes if this one is killed before the rename.
    let temp = create_temp_folder(root).map_err(|e| e.to_string())?;
    let result = write_checkpoint(temp.path(), shape).and_then(|()| {
        let from = temp.path().display().to_string();
        temp.rename_to(&dir).or_else(|e| {
            // Another demo finished the same folder first: use theirs (this
            // one's folder was removed).
            if dir.join("config.json").is_file() {
                Ok(())
            } else {
                Err(format!("moving {from} to {}: {e}", dir.display()))
            }
        })
    });
    result?;
    eprintln!("checkpoint: {}", dir.display());
    Ok(dir)
}

fn write_checkpoint(dir: &Path, shape: &Shape) -> Result<(), String> {
    let started = Instant::now();
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let specs = shape.tensors();
    let metas: Vec<TensorMeta> = specs
        .iter()
        .map(|(_, s)| TensorMeta::new(DType::F32, s.clone()))
        .collect();
    let total: u64 = metas.iter().map(|m| m.byte_len() as u64).sum();
    let bar = ProgressBar::new(2 * total).with_style(
        ProgressStyle::with_template(
            "creating the demo checkpoint {bar:40} {binary_bytes}/{binary_total_bytes} {elapsed}",
        )
        .map_err(|e| e.to_string())?,
    );
    let data: Vec<Vec<f32>> = specs
        .iter()
        .zip(&metas)
        .map(|((name, _), meta)| {
            let v = values(name, meta.numel());
            bar.inc(meta.byte_len() as u64);
            v
        })
        .collect();
    let tensors: Vec<SaveTensor<'_>> = specs
        .iter()
        .zip(&metas)
        .zip(&data)
        .map(|(((name, _), meta), values)| SaveTensor {
            name,
            meta,
            data: bytemuck::cast_slice(values),
        })
        .collect();
    let options = ShardOptions {
        max_shard_size: shape.max_shard_size,
        dtype: None,
    };
    shard_checkpoint(&tensors, dir, &options, &mut |done, _| {
        bar.set_position(total + done)
    })
    .map_err(|e| format!("writing the demo checkpoint: {e}"))?;
    let config = serde_json::to_string_pretty(&shape.config()).map_err(|e| e.to_string())?;
    write_atomic(&dir.join("config.json"), config.as_bytes()).map_err(|e| e.to_string())?;
    bar.finish_and_clear();
    eprintln!(
        "created {} of weights in {:.1} s",
        human_bytes(total),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn spinner(message: &'static str) -> ProgressBar {
    let bar = ProgressBar::new_spinner().with_message(message);
    if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} {elapsed}") {
        bar.set_style(style);
    }
    bar.enable_steady_tick(Duration::from_millis(100));
    bar
}

/// A budget that forces offloading: with GPUs, a third of the weights on
/// GPU 0 and a third in RAM; without, half in RAM. The rest goes to disk.
fn forcing_budget(devices: &DeviceSet, total: u64) -> Result<MaxMemory, String> {
    let pairs = if devices.gpus().is_empty() {
        vec![(Device::Cpu, total / 2)]
    } else {
        vec![(Device::Gpu(0), total / 3), (Device::Cpu, total / 3)]
    };
    MaxMemory::new(pairs).map_err(|e| e.to_string())
}

fn generate(lm: &CausalLm, tokens: usize) -> Result<Generation, String> {
    let options = GenerateOptions {
        max_new_tokens: tokens,
        keep_prompt_logits: true,
        ..GenerateOptions::default()
    };
    lm.generate_ids(&PROMPT, &options)
        .map_err(|e| e.to_string())
}

/// Runs the command.
pub fn run(args: Args) -> CmdResult {
    let scale = match &args.scale {
        Some(s) => s.clone(),
        None => std::env::var("BM_DEMO_SCALE").unwrap_or_else(|_| "full".into()),
    };
    let shape = match scale.as_str() {
        "full" => &FULL,
        "tiny" => &TINY,
        other => return Err(format!("demo scale {other:?}: expected full or tiny").into()),
    };
    if args.max_new_tokens == 0 {
        return Err("--max-new-tokens must be at least 1".into());
    }
    let root = cache_root(&args)?;
    let dir = ensure_checkpoint(&root, shape)?;
    let total: u64 = shape
        .tensors()
        .iter()
        .map(|(_, s)| 4 * s.iter().product::<usize>() as u64)
        .sum();

    let devices = Arc::new(DeviceSet::probe());
    let offload = dir.join("offload");
    let (bar, progress) = super::run::load_progress_bar(false);
    let options = Options {
        device_map: Some(DeviceMapSpec::Strategy(Mode::Auto)),
        max_memory: Some(forcing_budget(&devices, total)?),
        dtype: Some(DType::F32),
        offload_folder: Some(offload),
        load_progress: Some(progress),
        offload_sharing: super::run::sharing(None),
        ..Options::default()
    };
    let started = Instant::now();
    let dispatched = open_causal_lm(&dir, devices, &options)?;
    let load_seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();

    let bar = spinner("generating with offloaded weights");
    let streamed_before = dispatched.weights.streamed_bytes();
    let offloaded = generate(&dispatched.model, args.max_new_tokens)?;
    let passes = offloaded.step_seconds.len().max(1) as u64;
    let streamed = (dispatched.weights.streamed_bytes() - streamed_before) / passes;
    bar.finish_and_clear();

    let bar = spinner("generating fully in RAM for comparison");
    let in_memory = generate(
        &CausalLm::open(&dir, Some(DType::F32))?,
        args.max_new_tokens,
    )?;
    bar.finish_and_clear();

    println!(
        "model: Llama-style, {} layers, hidden {}, vocab {}, {} of F32 weights",
        shape.layers,
        shape.hidden,
        shape.vocab,
        human_bytes(total)
    );
    print_device_map(&dispatched.weights);
    println!("load time:           {load_seconds:.2} s");
    println!(
        "first forward:       {:.3} s ({} prompt tokens)",
        offloaded.step_seconds[0],
        PROMPT.len()
    );
    println!(
        "time per token:      {:.3} s offloaded, {:.3} s in RAM",
        seconds_per_token(&offloaded),
        seconds_per_token(&in_memory)
    );
    println!("streamed per token:  {}", human_bytes(streamed));
    if let Some(peak) = peak_host_bytes() {
        println!("peak host memory:    {}", human_bytes(peak));
    }
    println!("generated ids:       {:?}", offloaded.tokens);

    let logits_equal = match (&offloaded.prompt_logits, &in_memory.prompt_logits) {
        (Some(a), Some(b)) => {
            let bits = |t: &bm_models::Tensor| -> Vec<u32> {
                t.to_f32_vec().iter().map(|v| v.to_bits()).collect()
            };
            a.shape() == b.shape() && bits(a) == bits(b)
        }
        _ => false,
    };
    if offloaded.tokens != in_memory.tokens || !logits_equal {
        return Err(format!(
            "offloaded output differs from in-memory output: ids {:?} vs {:?}, prompt logits {}",
            offloaded.tokens,
            in_memory.tokens,
            if logits_equal { "equal" } else { "differ" }
        )
        .into());
    }
    println!("OK: offloaded output equals in-memory output");
    Ok(())
}
