//! `bigmodel run`: load a decoder folder under a device map and generate.
//!
//! Also home of what `embed` and `demo` share: turning the placement flags
//! into the facade's options, the device-map table, and the peak resident
//! set.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Instant;

use bigmodel::device::DeviceSet;
use bigmodel::dispatch::LoadProgress;
use bigmodel::plan::{DeviceMap, MaxMemory, Mode, human_bytes};
use bigmodel::tensor::DType;
use bigmodel::{DeviceMapSpec, Options};
use bm_models::{DispatchedWeights, GenerateOptions, Generation, open_causal_lm};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{Value, json};

use super::CmdResult;

/// Arguments of `bigmodel run`.
#[derive(clap::Args)]
pub struct Args {
    /// An HF decoder folder: config.json, safetensors or PyTorch .bin weights
    /// (single or sharded), optionally tokenizer.json.
    model_dir: PathBuf,
    /// The prompt as text (needs the folder's tokenizer.json).
    #[arg(
        long,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    prompt: Option<String>,
    /// The prompt as comma-separated token ids: `1,2,3`.
    #[arg(long)]
    prompt_ids: Option<String>,
    #[command(flatten)]
    placement: PlacementArgs,
    /// The dtype weights are loaded and computed in: f32, f16, bf16.
    /// Default: the stored dtype of the embedding.
    #[arg(long)]
    dtype: Option<String>,
    /// Tokens to generate (greedy; stops early at the config's eos token).
    #[arg(long, default_value_t = 16)]
    max_new_tokens: usize,
    /// Write the first forward's logits (F32, [prompt_len, vocab]) to this
    /// safetensors file, as tensor `logits`.
    #[arg(long)]
    dump_logits: Option<PathBuf>,
    /// Print one JSON document: generated_ids, text, device_map,
    /// load_seconds, first_forward_seconds, seconds_per_token,
    /// bytes_streamed_per_token, peak_host_bytes.
    #[arg(long)]
    json: bool,
}

/// Where the weights go: the flags `run` and `embed` share.
#[derive(clap::Args)]
pub struct PlacementArgs {
    /// `auto`, `balanced`, `balanced_low_0`, `sequential`, or a JSON file
    /// `{module: 0 | "cpu" | "disk"}`.
    #[arg(long, default_value = "auto")]
    device_map: String,
    /// Budgets for a strategy: `0=10GiB,cpu=30GiB` or a JSON object.
    /// Default: what the machine has free.
    #[arg(long)]
    max_memory: Option<String>,
    /// Folder for disk-offloaded weights, required when the map uses disk
    /// (weights needing no conversion are still read from the checkpoint
    /// in place).
    #[arg(long)]
    offload_folder: Option<PathBuf>,
}

impl PlacementArgs {
    /// The facade's options for these flags and `dtype`.
    pub fn options(&self, dtype: Option<DType>) -> Result<Options, String> {
        let device_map = match Mode::parse(&self.device_map) {
            Some(mode) => DeviceMapSpec::Strategy(mode),
            None => DeviceMapSpec::Map(read_device_map(Path::new(&self.device_map))?),
        };
        let max_memory = match &self.max_memory {
            Some(spec) => {
                Some(MaxMemory::parse(spec).map_err(|e| format!("--max-memory {spec:?}: {e}"))?)
            }
            None => None,
        };
        Ok(Options {
            device_map: Some(device_map),
            max_memory,
            dtype,
            offload_folder: self.offload_folder.clone(),
            ..Options::default()
        })
    }
}

/// A byte progress bar for loading, on stderr when it is a terminal and
/// `quiet` is off, and the callback that drives it.
pub fn load_progress_bar(quiet: bool) -> (ProgressBar, LoadProgress) {
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
    };
    if let Ok(style) = ProgressStyle::with_template(
        "loading {bar:40} {binary_bytes}/{binary_total_bytes} {elapsed}",
    ) {
        bar.set_style(style);
    }
    let driven = bar.clone();
    let progress = LoadProgress(Arc::new(move |done, total| {
        driven.set_length(total);
        driven.set_position(done);
    }));
    (bar, progress)
}

fn read_device_map(path: &Path) -> Result<DeviceMap, String> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        format!(
            "--device-map {}: not auto, balanced, balanced_low_0 or sequential, and not a readable JSON file ({e})",
            path.display()
        )
    })?;
    let doc: Value = serde_json::from_str(&text)
        .map_err(|e| format!("{}: invalid JSON: {e}", path.display()))?;
    DeviceMap::from_json(&doc).map_err(|e| format!("{}: {e}", path.display()))
}

/// `--dtype`: f32, f16 or bf16 (or their torch names).
pub fn parse_dtype(text: &str) -> Result<DType, String> {
    DType::from_str(text)
        .ok()
        .filter(|d| matches!(d, DType::F32 | DType::F16 | DType::BF16))
        .ok_or_else(|| {
            format!("--dtype {text:?}: expected f32, f16 or bf16 (or float32, float16, bfloat16)")
        })
}

/// The process's peak resident set (VmHWM) in bytes, where /proc has it.
pub fn peak_host_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The dispatched model's `hf_device_map` as JSON (`{}` when it has none).
pub fn device_map_json(weights: &DispatchedWeights) -> Value {
    weights
        .model()
        .hf_device_map()
        .map(|m| m.to_json())
        .unwrap_or_else(|| json!({}))
}

/// Prints the device map: each entry, its device and the bytes it holds.
pub fn print_device_map(weights: &DispatchedWeights) {
    let Some(map) = weights.model().hf_device_map() else {
        eprintln!("device map: none (all on the CPU)");
        return;
    };
    let tree = weights.model().tree();
    let bytes_under = |name: &str| -> u64 {
        tree.tensors()
            .iter()
            .filter(|t| {
                name.is_empty()
                    || t.name == name
                    || t.name.starts_with(name) && t.name[name.len()..].starts_with('.')
            })
            .map(|t| t.meta.byte_len() as u64)
            .sum()
    };
    println!("{:<32} {:>6} {:>12}", "module", "device", "bytes");
    for (name, device) in map.iter() {
        let shown = if name.is_empty() {
            "(whole model)"
        } else {
            name
        };
        println!(
            "{shown:<32} {:>6} {:>12}",
            device.to_string(),
            human_bytes(bytes_under(name))
        );
    }
}

/// Token ids from `1,2,3`.
fn parse_ids(text: &str) -> Result<Vec<u32>, String> {
    if text.trim().is_empty() {
        return Err("--prompt-ids is empty: give at least one token id".into());
    }
    text.split(',')
        .map(|part| {
            part.trim()
                .parse::<u32>()
                .map_err(|_| format!("--prompt-ids: {part:?} is not a token id"))
        })
        .collect()
}

/// Seconds of the steps after the first (the decode steps), averaged; the
/// first step's when there is only one.
pub fn seconds_per_token(generation: &Generation) -> f64 {
    let steps = &generation.step_seconds;
    match steps.len() {
        0 => 0.0,
        1 => steps[0],
        n => steps[1..].iter().sum::<f64>() / (n - 1) as f64,
    }
}

/// Writes `logits` (F32 values of shape `shape`) as a one-tensor
/// safetensors file, atomically (bm-shard's writer).
fn write_logits(path: &Path, shape: &[usize], values: &[f32]) -> Result<(), String> {
    let data_len = values.len() * 4;
    let mut header = json!({
        "logits": {"dtype": "F32", "shape": shape, "data_offsets": [0, data_len]}
    })
    .to_string();
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut bytes = Vec::with_capacity(8 + header.len() + data_len);
    bytes.extend_from_slice(&(header.len() as u64).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for v in values {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    if path.file_name().is_none() {
        return Err(format!("--dump-logits {}: not a file path", path.display()));
    }
    bigmodel::shard::write_atomic(path, &bytes).map_err(|e| e.to_string())
}

/// Runs the command.
pub fn run(args: Args) -> CmdResult {
    let dtype = args.dtype.as_deref().map(parse_dtype).transpose()?;
    let mut options = args.placement.options(dtype)?;
    let prompt_ids = args.prompt_ids.as_deref().map(parse_ids).transpose()?;
    if args.prompt.as_deref() == Some("") {
        return Err("--prompt is empty: give some text".into());
    }
    if args.max_new_tokens == 0 {
        return Err("--max-new-tokens must be at least 1".into());
    }

    let (bar, progress) = load_progress_bar(args.json);
    options.load_progress = Some(progress);
    let started = Instant::now();
    let dispatched = open_causal_lm(&args.model_dir, Arc::new(DeviceSet::probe()), &options)
        .map_err(|e| format!("{}: {e}", args.model_dir.display()))?;
    let load_seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let lm = &dispatched.model;
    let weights = &dispatched.weights;

    let generate = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        stop_tokens: lm.decoder().config().eos_token_ids.clone(),
        keep_prompt_logits: args.dump_logits.is_some(),
    };
    let streamed_before = weights.streamed_bytes();
    let (generation, text) = match (&prompt_ids, &args.prompt) {
        (Some(ids), _) => {
            let generation = lm.generate_ids(ids, &generate)?;
            let text = match lm.tokenizer() {
                Some(t) => Some(t.decode(&generation.tokens)?),
                None => None,
            };
            (generation, text)
        }
        (None, Some(prompt)) => {
            let (generation, text) = lm.generate_text(prompt, &generate)?;
            (generation, Some(text))
        }
        (None, None) => return Err("give --prompt TEXT or --prompt-ids 1,2,3".into()),
    };
    let passes = generation.step_seconds.len().max(1) as u64;
    let streamed_per_token = (weights.streamed_bytes() - streamed_before) / passes;

    if let (Some(path), Some(logits)) = (&args.dump_logits, &generation.prompt_logits) {
        write_logits(path, logits.shape(), &logits.to_f32_vec())?;
    }
    let first_forward = generation.step_seconds.first().copied().unwrap_or(0.0);
    let per_token = seconds_per_token(&generation);
    let peak = peak_host_bytes();
    if args.json {
        let mut doc = json!({
            "generated_ids": generation.tokens,
            "device_map": device_map_json(weights),
            "load_seconds": load_seconds,
            "first_forward_seconds": first_forward,
            "seconds_per_token": per_token,
            "bytes_streamed_per_token": streamed_per_token,
            "peak_host_bytes": peak,
        });
        if let Some(text) = &text {
            doc["text"] = json!(text);
        }
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print_device_map(weights);
        println!("generated ids: {:?}", generation.tokens);
        if let Some(text) = &text {
            println!("text: {text:?}");
        }
        println!(
            "load: {load_seconds:.3} s, first forward: {first_forward:.3} s, {per_token:.4} s/token"
        );
        println!(
            "streamed per token: {}, peak host memory: {}",
            human_bytes(streamed_per_token),
            peak.map(human_bytes).unwrap_or_else(|| "unknown".into())
        );
    }
    Ok(())
}
