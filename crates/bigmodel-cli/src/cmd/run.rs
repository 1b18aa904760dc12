//! `bigmodel run`: load a decoder folder under a device map and generate
//! from one prompt or many (batched, greedy or sampled); or a T5 folder,
//! each prompt the encoder's input, generated one at a time.
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
use bigmodel::plan::{DeviceMap, MaxMemory, Mode, Workload, human_bytes};
use bigmodel::shard::Sharing;
use bigmodel::tensor::DType;
use bigmodel::{DeviceMapSpec, Options};
use bm_models::{
    BatchSize, Batched, CausalLm, ChatTemplate, DispatchedWeights, GenerateOptions, Generation,
    GenerationConfig, QuantizeOptions, Sampling, TextTokenizer, open_causal_lm,
    open_causal_lm_quantized, open_seq2seq_lm,
};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{Value, json};

use super::CmdResult;

/// Arguments of `bigmodel run`.
#[derive(clap::Args)]
#[command(group(
    clap::ArgGroup::new("input")
        .required(true)
        .args(["prompt", "prompt_ids", "prompts_file"])
))]
pub struct Args {
    /// An HF decoder or T5 folder: config.json, safetensors or PyTorch .bin
    /// weights (single or sharded), optionally tokenizer.json and
    /// generation_config.json. A T5 prompt is the encoder's input.
    model_dir: PathBuf,
    /// A prompt as text (needs the folder's tokenizer.json); repeat for
    /// several prompts, generated together.
    #[arg(long)]
    prompt: Vec<String>,
    /// A prompt as comma-separated token ids: `1,2,3`; repeat for several.
    #[arg(long)]
    prompt_ids: Vec<String>,
    /// A file of text prompts, one per line.
    #[arg(long)]
    prompts_file: Option<PathBuf>,
    /// Apply the model's chat template: each prompt is a user message (the
    /// template comes from chat_template.jinja or tokenizer_config.json).
    #[arg(long)]
    chat: bool,
    /// With --chat, a system message before each prompt.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// How many prompts run together: a number, or `auto` (all, halved
    /// after each out-of-memory error until a batch fits). Default: all,
    /// or 1 when the model runs on a GPU (batches run on the CPU path).
    #[arg(long)]
    batch_size: Option<String>,
    #[command(flatten)]
    placement: PlacementArgs,
    /// Mixture-of-experts models: place experts on their own. With a
    /// strategy, the rest of every layer is placed first, then experts
    /// fill the room left beside their layers, the others go to `cpu` or
    /// `disk` (disk needs --offload-folder); with a map, every expert goes
    /// there. Only the offloaded experts the router picks are then read.
    #[arg(long, value_name = "cpu|disk")]
    experts_on: Option<String>,
    /// The dtype weights are loaded and computed in: f32, f16, bf16.
    /// Default: the stored dtype of the embedding.
    #[arg(long)]
    dtype: Option<String>,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    quantize: QuantizeArgs,
    /// Write the first forward's logits (F32, [prompt_len, vocab]; T5: the
    /// first decoder step's, [1, vocab]) to this safetensors file, as tensor
    /// `logits` (one prompt only).
    #[arg(long)]
    dump_logits: Option<PathBuf>,
    /// Before loading, plan with the ledger of this generation (the prompt,
    /// --max-new-tokens) and allocate it on the devices (the dry run of
    /// `plan --verify`); stop naming the device that is short, else run
    /// under that plan.
    #[arg(long)]
    verify: bool,
    /// Print one JSON document: generated_ids (a list of lists with
    /// several prompts), text, device_map, load_seconds,
    /// first_forward_seconds, seconds_per_token, bytes_streamed_per_token,
    /// peak_host_bytes, seed (when sampling), batch_size.
    #[arg(long)]
    json: bool,
}

/// How tokens are chosen: the flags `run` and `chat` share. What they do
/// not say comes from the folder's generation_config.json, as in
/// transformers.
#[derive(clap::Args)]
pub struct SamplingArgs {
    /// Tokens to generate at most (default: generation_config.json's
    /// max_new_tokens or max_length, else 16); never past the model's
    /// max_position_embeddings.
    #[arg(long)]
    max_new_tokens: Option<usize>,
    /// Sample the next token (implied by --temperature, --top-k, --top-p).
    #[arg(long, conflicts_with = "greedy")]
    sample: bool,
    /// Take the most likely token, whatever generation_config.json says.
    #[arg(long)]
    greedy: bool,
    /// Divide the logits by this before sampling (> 0).
    #[arg(long)]
    temperature: Option<f32>,
    /// Sample among the K most likely tokens only (0: all).
    #[arg(long)]
    top_k: Option<usize>,
    /// Sample among the most likely tokens whose probabilities add up to P.
    #[arg(long)]
    top_p: Option<f32>,
    /// Penalise tokens already in the sequence (> 0; 1: none).
    #[arg(long)]
    repetition_penalty: Option<f32>,
    /// The sampling seed: the same seed gives the same tokens. Default: a
    /// random one (reported).
    #[arg(long)]
    seed: Option<u64>,
}

impl SamplingArgs {
    /// The sampling settings: `config`'s, overridden by the flags.
    pub fn sampling(&self, config: &GenerationConfig) -> Result<Sampling, String> {
        let mut s = config.sampling.clone();
        if let Some(t) = self.temperature {
            s.temperature = t;
        }
        if let Some(k) = self.top_k {
            s.top_k = k;
        }
        if let Some(p) = self.top_p {
            s.top_p = p;
        }
        if let Some(r) = self.repetition_penalty {
            s.repetition_penalty = r;
        }
        let warper = self.temperature.is_some() || self.top_k.is_some() || self.top_p.is_some();
        if self.greedy {
            s.do_sample = false;
        } else if self.sample || warper {
            s.do_sample = true;
        }
        s.seed = self.seed.unwrap_or_else(random_seed);
        s.check().map_err(|e| match e {
            bm_models::Error::BadGenerateOption { option, message } => {
                format!("--{}: {message}", option.replace('_', "-"))
            }
            other => other.to_string(),
        })?;
        Ok(s)
    }

    /// New tokens for prompts of at most `longest` tokens: the flag, else
    /// `config`'s, else 16.
    pub fn max_new_tokens(
        &self,
        config: &GenerationConfig,
        longest: usize,
    ) -> Result<usize, String> {
        match self.max_new_tokens {
            Some(0) => Err("--max-new-tokens must be at least 1".into()),
            Some(n) => Ok(n),
            None => config
                .max_new_tokens_for(longest, 16)
                .map_err(|e| e.to_string()),
        }
    }

    /// The seed when sampling, for the report.
    pub fn reported_seed(sampling: &Sampling) -> Option<u64> {
        sampling.do_sample.then_some(sampling.seed)
    }
}

/// A seed nobody chose: the standard library's per-process random keys.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
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
    /// Offloaded layers loaded ahead of the running one (default 1; 0 turns
    /// prefetching off). Give the depth `plan --objective speed` reports
    /// with the map it chose: its room is kept for that depth.
    #[arg(long)]
    prefetch_depth: Option<usize>,
    /// Seconds to wait for another process writing the --offload-folder
    /// (default: as long as it takes; 0 fails at once).
    #[arg(long, value_name = "SECONDS")]
    wait_lock: Option<u64>,
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
            prefetch_depth: self.prefetch_depth,
            offload_sharing: sharing(self.wait_lock),
            ..Options::default()
        })
    }
}

/// How a command that writes a folder shares it with other processes: it
/// waits `--wait-lock` seconds for another writer (as long as it takes
/// without the flag), saying on stderr what it waits for and what stale
/// offload-index entries it removed.
pub fn sharing(wait_lock: Option<u64>) -> Sharing {
    Sharing {
        wait: wait_lock.map(std::time::Duration::from_secs),
        notice: Some(Arc::new(|message: &str| eprintln!("{message}"))),
    }
}

/// The device of `--experts-on`: `cpu` or `disk`.
pub fn parse_experts_on(text: &str) -> Result<bigmodel::plan::Device, String> {
    match text {
        "cpu" => Ok(bigmodel::plan::Device::Cpu),
        "disk" => Ok(bigmodel::plan::Device::Disk),
        other => Err(format!("--experts-on {other:?}: expected cpu or disk")),
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
    // A regular file only: reading a FIFO would wait for a writer.
    let bytes = bigmodel::shard::read_regular(path).map_err(|e| {
        format!(
            "--device-map: not auto, balanced, balanced_low_0 or sequential, and not a readable JSON file ({e})"
        )
    })?;
    let doc: Value = serde_json::from_slice(&bytes)
        .map_err(|e| format!("{}: invalid JSON: {e}", path.display()))?;
    DeviceMap::from_json(&doc).map_err(|e| format!("{}: {e}", path.display()))
}

/// `--quantize` and `--fp32-cpu-offload`, the same on every command that
/// loads or plans a model.
#[derive(clap::Args)]
pub struct QuantizeArgs {
    /// Quantize the linear layers while loading (plan: size them so):
    /// nf4, fp4 (bitsandbytes' 4-bit, block size 64, compute in f32) or
    /// int8 (LLM.int8()). A folder saved pre-quantized by bitsandbytes
    /// loads quantized without it.
    #[arg(long, value_name = "nf4|fp4|int8")]
    quantize: Option<String>,
    /// With --quantize and a --device-map file: the modules the map puts on
    /// `cpu` or `disk` stay unquantized, in the load dtype (transformers'
    /// `llm_int8_enable_fp32_cpu_offload`).
    #[arg(long, requires = "quantize")]
    fp32_cpu_offload: bool,
}

impl QuantizeArgs {
    /// The options asked for, with bitsandbytes' and transformers'
    /// defaults, or `None` without `--quantize`.
    pub fn options(&self) -> Result<Option<QuantizeOptions>, String> {
        self.quantize
            .as_deref()
            .map(|q| {
                let mut options = parse_quantize(q)?;
                options.llm_int8_enable_fp32_cpu_offload = self.fp32_cpu_offload;
                Ok(options)
            })
            .transpose()
    }

    /// Whether `--quantize` was given.
    pub fn is_given(&self) -> bool {
        self.quantize.is_some()
    }
}

/// `--quantize`'s value: nf4, fp4 or int8, with bitsandbytes' and
/// transformers' defaults.
pub fn parse_quantize(text: &str) -> Result<QuantizeOptions, String> {
    QuantizeOptions::named(text).map_err(|e| format!("--quantize: {e}"))
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

/// The prompts as text (`--prompt`, `--prompts-file`), or `None` when
/// they are ids.
fn text_prompts(args: &Args) -> Result<Option<Vec<String>>, String> {
    if let Some(path) = &args.prompts_file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("--prompts-file {}: {e}", path.display()))?;
        let lines: Vec<String> = text.lines().map(str::to_string).collect();
        if let Some(n) = lines.iter().position(|l| l.is_empty()) {
            return Err(format!(
                "{}: line {} is empty: give one prompt per line",
                path.display(),
                n + 1
            ));
        }
        if lines.is_empty() {
            return Err(format!("{}: no prompts in the file", path.display()));
        }
        return Ok(Some(lines));
    }
    if args.prompt.iter().any(String::is_empty) {
        return Err("--prompt is empty: give some text".into());
    }
    Ok((!args.prompt.is_empty()).then(|| args.prompt.clone()))
}

/// `--batch-size`: a count of at least 1 or `auto`; by default all
/// `prompts`, one at a time `on_gpu` (a layer computed on a GPU takes one
/// sequence at a time).
fn parse_batch_size(text: Option<&str>, prompts: usize, on_gpu: bool) -> Result<BatchSize, String> {
    match text {
        None if on_gpu => Ok(BatchSize::Fixed(1)),
        None => Ok(BatchSize::Fixed(prompts)),
        Some("auto") => Ok(BatchSize::Auto),
        Some(n) => match n.parse::<usize>() {
            Ok(n) if n > 0 => Ok(BatchSize::Fixed(n)),
            _ => Err(format!(
                "--batch-size {n:?}: expected a count of at least 1 or auto"
            )),
        },
    }
}

/// Prints each new piece of a sequence's text as its tokens come, as
/// transformers' `TextStreamer` does: the whole sequence is decoded again
/// and what was not printed yet is printed, unless it ends inside a
/// character (a byte-level token that needs the next one).
pub struct TextStream<'a> {
    lm: &'a CausalLm,
    ids: Vec<u32>,
    printed: usize,
}

impl<'a> TextStream<'a> {
    /// A stream of `lm`'s tokens, nothing printed yet.
    pub fn new(lm: &'a CausalLm) -> TextStream<'a> {
        TextStream {
            lm,
            ids: Vec::new(),
            printed: 0,
        }
    }

    /// Adds a token and prints the text it completes.
    pub fn push(&mut self, token: u32) {
        self.ids.push(token);
        self.print(false);
    }

    /// Prints what is left, even an unfinished character, and a newline
    /// (transformers' `TextStreamer.end`).
    pub fn finish(&mut self) {
        self.print(true);
        println!();
    }

    fn print(&mut self, all: bool) {
        use std::io::Write;
        // A token the tokenizer cannot decode shows in the final text's
        // error; the stream just waits.
        let Ok(text) = self.lm.decode(&self.ids) else {
            return;
        };
        if !all && text.ends_with('\u{FFFD}') {
            return;
        }
        if let Some(new) = text.get(self.printed..) {
            print!("{new}");
            let _ = std::io::stdout().flush();
            self.printed = text.len();
        }
    }
}

/// Seconds of the steps after the first (the decode steps), averaged; the
/// first step's when there is only one.
pub fn seconds_per_token(generation: &Generation) -> f64 {
    decode_seconds_per_token(std::slice::from_ref(&generation.step_seconds))
}

/// [`seconds_per_token`] over several batches' forward passes: the decode
/// steps of all of them averaged, or the first passes' when none has more.
fn decode_seconds_per_token(batches: &[Vec<f64>]) -> f64 {
    let decode: Vec<f64> = batches
        .iter()
        .flat_map(|b| b.iter().skip(1))
        .copied()
        .collect();
    let firsts: Vec<f64> = batches.iter().filter_map(|b| b.first()).copied().collect();
    let steps = if decode.is_empty() { firsts } else { decode };
    match steps.len() {
        0 => 0.0,
        n => steps.iter().sum::<f64>() / n as f64,
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
    while !header.len().is_multiple_of(8) {
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

/// `run --verify`: the map this generation runs under (the strategy
/// planned with the ledger of `workload` grown by `new_tokens`, or the
/// given map), after its ledger was allocated on `devices` and freed.
/// Linear weights are planned packed as loading holds them (a
/// pre-quantized folder, or `quantize`).
fn verified_map(
    dir: &Path,
    options: &Options,
    quantize: Option<&QuantizeOptions>,
    devices: &DeviceSet,
    workload: Workload,
    new_tokens: usize,
) -> Result<(DeviceMap, usize), String> {
    use bigmodel::plan::config::HfConfig;
    use bigmodel::plan::{Compat, PlanOptions};
    let in_dir = |e: &dyn std::fmt::Display| format!("{}: {e}", dir.display());
    let config = dir.join("config.json");
    let text = super::read_text(&config)?;
    let hf = HfConfig::parse(&text, &config).map_err(|e| e.to_string())?;
    let model = bigmodel::plan::hf::tree_from_config(&hf).map_err(|e| e.to_string())?;
    let given_map = match &options.device_map {
        Some(DeviceMapSpec::Map(map)) => Some(map),
        _ => None,
    };
    let tree = bm_models::load_tree(Some(dir), &model.tree, quantize, given_map)
        .map_err(|e| in_dir(&e))?;
    // Sized in the dtype loading will take (the checkpoint's, not config.json's).
    let dtype = bm_models::folder_load_dtype(dir, model.family, options.dtype)
        .map_err(|e| in_dir(&e))?
        .or(options.dtype);
    let special_dtypes = super::plan::kept_in_f32(
        &tree,
        model.family,
        dtype.unwrap_or(model.dtype),
        &options.keep_in_fp32_modules,
    );
    let (max_memory, budgets) = match &options.max_memory {
        Some(m) => (m.clone(), bigmodel::BudgetOrigin::Given(m.clone())),
        None => bigmodel::default_max_memory_with_origin(devices, Compat::Auto)
            .map_err(|e| in_dir(&e))?,
    };
    let from_user = budgets.is_given();
    let workload = Workload {
        max_seq_len: workload.prompt_len + new_tokens as u64,
        ..workload
    };
    let mut plan_options = PlanOptions {
        overheads: bigmodel::overheads(&max_memory, &bigmodel::cuda_gpus(devices)),
        max_memory_from_user: from_user,
        no_split: model.no_split.clone(),
        dtype,
        special_dtypes,
        prefetch_depth: options.prefetch_depth(),
        experts_on: options.experts_on,
        ..PlanOptions::default()
    };
    let on_gpu = max_memory.gpus().any(|(_, b)| b > 0);
    plan_options.max_memory = max_memory;
    model
        .runtime_charges(&workload, on_gpu, dtype.unwrap_or(model.dtype))
        .apply(&mut plan_options);
    let (map, ledger, depth) = match &options.device_map {
        Some(DeviceMapSpec::Map(map)) => {
            let map = match options.experts_on {
                Some(device) => {
                    bigmodel::plan::place_experts(&tree, map, device).map_err(|e| in_dir(&e))?
                }
                None => map.clone(),
            };
            let ledger =
                bigmodel::plan::auto::ledger(&tree, &map, &plan_options).map_err(|e| in_dir(&e))?;
            (map, ledger, plan_options.prefetch_depth)
        }
        Some(DeviceMapSpec::Strategy(mode)) => {
            plan_options.mode = *mode;
            let plan = bigmodel::plan::plan_with(&tree, &plan_options, Compat::Auto)
                .map_err(|e| in_dir(&budgets.explain(e.into())))?;
            bigmodel::check_offload_folder(
                &plan.device_map,
                options.offload_folder.as_deref(),
                &budgets,
            )
            .map_err(|e| in_dir(&e))?;
            (plan.device_map, plan.ledger, plan.prefetch_depth)
        }
        None => return Err("--verify needs a device map or a strategy".into()),
    };
    let short = bigmodel::verify_ledger(&ledger, devices).map_err(|e| in_dir(&e))?;
    if !short.is_empty() {
        let lines: Vec<String> = short.iter().map(|s| s.to_string()).collect();
        return Err(format!(
            "--verify: {} does not fit {} sequence(s) of {} prompt tokens and {new_tokens} new ones: {}",
            dir.display(),
            workload.batch,
            workload.prompt_len,
            lines.join("; ")
        ));
    }
    eprintln!("--verify: fits (the ledger was allocated on every GPU and freed)");
    Ok((map, depth))
}

/// Runs the command.
pub fn run(args: Args) -> CmdResult {
    use std::io::IsTerminal;

    let dtype = args.dtype.as_deref().map(parse_dtype).transpose()?;
    let quantize = args.quantize.options()?;
    let mut options = args.placement.options(dtype)?;
    options.experts_on = args
        .experts_on
        .as_deref()
        .map(parse_experts_on)
        .transpose()?;
    let texts = text_prompts(&args)?;
    let ids: Vec<Vec<u32>> = args
        .prompt_ids
        .iter()
        .map(|p| parse_ids(p))
        .collect::<Result<_, _>>()?;
    let count = texts.as_ref().map_or(ids.len(), Vec::len);
    if args.dump_logits.is_some() && count > 1 {
        return Err("--dump-logits takes one prompt".into());
    }
    // Checked before loading, so a typo costs nothing.
    parse_batch_size(args.batch_size.as_deref(), count, false)?;
    let seq2seq = bm_models::is_seq2seq(&args.model_dir)
        .map_err(|e| format!("{}: {e}", args.model_dir.display()))?;
    if seq2seq {
        refuse_seq2seq_flags(&args)?;
    }

    let template = match args.chat {
        true if texts.is_none() => {
            return Err("--chat takes text prompts (--prompt or --prompts-file)".into());
        }
        true => Some(ChatTemplate::open_in(&args.model_dir)?),
        false => None,
    };

    let devices = Arc::new(DeviceSet::probe());
    if args.verify {
        // Byte-level tokenizers give at most one token per byte.
        let longest = match &texts {
            Some(texts) => texts.iter().map(String::len).max(),
            None => ids.iter().map(Vec::len).max(),
        };
        let batch = match parse_batch_size(args.batch_size.as_deref(), count, false)? {
            BatchSize::Fixed(n) => n.min(count),
            BatchSize::Auto => count,
        };
        let workload = Workload {
            batch: batch.max(1) as u64,
            prompt_len: longest.unwrap_or(1).max(1) as u64,
            max_seq_len: 0,
            all_logits: args.dump_logits.is_some(),
        };
        // The flag, else generate's default (the folder's
        // generation_config.json is read after loading).
        let new_tokens = args.sampling.max_new_tokens.unwrap_or(16);
        let (map, depth) = verified_map(
            &args.model_dir,
            &options,
            quantize.as_ref(),
            &devices,
            workload,
            new_tokens,
        )?;
        // The verified map places the experts already.
        options.device_map = Some(DeviceMapSpec::Map(map));
        options.experts_on = None;
        options.prefetch_depth = Some(depth);
    }
    if seq2seq {
        return run_seq2seq(&args, options, devices, texts, ids);
    }
    let (bar, progress) = load_progress_bar(args.json);
    options.load_progress = Some(progress);
    let started = Instant::now();
    let dispatched = match &quantize {
        Some(q) => open_causal_lm_quantized(&args.model_dir, devices, &options, q),
        None => open_causal_lm(&args.model_dir, devices, &options),
    }
    .map_err(|e| format!("{}: {e}", args.model_dir.display()))?;
    let load_seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let lm = &dispatched.model;
    let weights = &dispatched.weights;
    let on_gpu = weights.model().hf_device_map().is_some_and(|map| {
        map.iter()
            .any(|(_, d)| matches!(d, bigmodel::plan::Device::Gpu(_)))
    });
    let batch_size = parse_batch_size(args.batch_size.as_deref(), count, on_gpu)?;

    let prompts: Vec<Vec<u32>> = match (&texts, &template) {
        (Some(texts), Some(template)) => texts
            .iter()
            .map(|t| {
                let mut messages = Vec::new();
                if let Some(system) = &args.system {
                    messages.push(json!({"role": "system", "content": system}));
                }
                messages.push(json!({"role": "user", "content": t}));
                lm.encode_chat(&template.render(&messages, None, true)?)
            })
            .collect::<Result<_, bm_models::Error>>()?,
        (Some(texts), None) => texts
            .iter()
            .map(|t| lm.encode(t))
            .collect::<Result<_, _>>()?,
        (None, _) => ids,
    };
    let config = lm.generation_config();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let sampling = args.sampling.sampling(config)?;
    let generate = GenerateOptions {
        max_new_tokens: args.sampling.max_new_tokens(config, longest)?,
        stop_tokens: config.eos_token_ids.clone(),
        keep_prompt_logits: args.dump_logits.is_some(),
        sampling,
        first_stream: 0,
    };
    // One prompt's text is printed as it comes, on a terminal.
    let stream =
        count == 1 && !args.json && lm.tokenizer().is_some() && std::io::stdout().is_terminal();
    let mut text_stream = TextStream::new(lm);
    let mut on_token = |_: usize, token: u32| {
        if stream {
            text_stream.push(token);
        }
    };
    let mut on_retry = |size: usize, e: &bm_models::Error| {
        eprintln!("out of memory ({e}); trying a batch size of {size}");
    };
    let streamed_before = weights.streamed_bytes();
    let batched = lm.generate_in_batches(
        &prompts,
        batch_size,
        &generate,
        &mut on_token,
        &mut on_retry,
    )?;
    if stream {
        text_stream.finish();
    }
    let max_positions = lm.decoder().config().max_positions;
    for (i, g) in batched.generations.iter().enumerate() {
        if let (Some(room), Some(max)) = (g.capped_to, max_positions) {
            eprintln!(
                "note: prompt {}: at most {room} new tokens, the room left in the model's {max} positions (max_position_embeddings)",
                i + 1
            );
        }
    }
    report(
        &args,
        &batched,
        lm.tokenizer(),
        Loaded {
            weights,
            load_seconds,
            streamed: weights.streamed_bytes() - streamed_before,
            seed: SamplingArgs::reported_seed(&generate.sampling),
        },
    )
}

/// The flags an encoder–decoder (T5) folder does not take.
fn refuse_seq2seq_flags(args: &Args) -> Result<(), String> {
    let given = [
        ("--chat", args.chat),
        ("--quantize", args.quantize.is_given()),
        ("--experts-on", args.experts_on.is_some()),
        ("--batch-size", args.batch_size.is_some()),
    ];
    match given.iter().find(|(_, on)| *on) {
        Some((flag, _)) => Err(format!(
            "{}: {flag} is not supported for an encoder-decoder (t5) model: its prompts run \
             one at a time, each as the encoder's input",
            args.model_dir.display()
        )),
        None => Ok(()),
    }
}

/// `run` on an encoder–decoder (T5) folder: each prompt is the encoder's
/// input and the decoder generates from `decoder_start_token_id`, one
/// prompt at a time; `--dump-logits` writes the first decoder step's
/// logits (`[1, vocab]`).
fn run_seq2seq(
    args: &Args,
    mut options: Options,
    devices: Arc<DeviceSet>,
    texts: Option<Vec<String>>,
    ids: Vec<Vec<u32>>,
) -> CmdResult {
    let (bar, progress) = load_progress_bar(args.json);
    options.load_progress = Some(progress);
    let started = Instant::now();
    let dispatched = open_seq2seq_lm(&args.model_dir, devices, &options)
        .map_err(|e| format!("{}: {e}", args.model_dir.display()))?;
    let load_seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let lm = &dispatched.model;
    let weights = &dispatched.weights;
    let prompts: Vec<Vec<u32>> = match &texts {
        Some(texts) => texts
            .iter()
            .map(|t| lm.encode(t))
            .collect::<Result<_, _>>()?,
        None => ids,
    };
    let config = lm.generation_config();
    // transformers counts the decoder's start token in max_length.
    let generate = GenerateOptions {
        max_new_tokens: args.sampling.max_new_tokens(config, 1)?,
        stop_tokens: config.eos_token_ids.clone(),
        keep_prompt_logits: args.dump_logits.is_some(),
        sampling: args.sampling.sampling(config)?,
        first_stream: 0,
    };
    let streamed_before = weights.streamed_bytes();
    let mut batched = Batched {
        generations: Vec::with_capacity(prompts.len()),
        batch_size: 1,
        batch_seconds: Vec::with_capacity(prompts.len()),
    };
    for (i, prompt) in prompts.iter().enumerate() {
        let options = GenerateOptions {
            first_stream: i as u64,
            ..generate.clone()
        };
        let generation = lm.generate_ids(prompt, &options, &mut |_| {})?;
        batched.batch_seconds.push(generation.step_seconds.clone());
        batched.generations.push(generation);
    }
    report(
        args,
        &batched,
        lm.tokenizer(),
        Loaded {
            weights,
            load_seconds,
            streamed: weights.streamed_bytes() - streamed_before,
            seed: SamplingArgs::reported_seed(&generate.sampling),
        },
    )
}

/// What `run` reports about the load and the streaming of a generation.
struct Loaded<'a> {
    weights: &'a DispatchedWeights,
    load_seconds: f64,
    /// Bytes streamed while generating.
    streamed: u64,
    seed: Option<u64>,
}

/// Writes `--dump-logits` and prints what `run` generated: one JSON
/// document with `--json`, else the device map, the tokens and text, and
/// the timings.
fn report(
    args: &Args,
    batched: &Batched,
    tokenizer: Option<&TextTokenizer>,
    loaded: Loaded<'_>,
) -> CmdResult {
    // Decoded text, where the folder has a tokenizer.
    let texts_out: Option<Vec<String>> = tokenizer
        .map(|t| {
            batched
                .generations
                .iter()
                .map(|g| t.decode(&g.tokens))
                .collect::<Result<_, _>>()
        })
        .transpose()?;
    let Loaded {
        weights,
        load_seconds,
        streamed,
        seed,
    } = loaded;
    let generations = &batched.generations;
    let count = generations.len();
    let passes: Vec<f64> = batched.batch_seconds.iter().flatten().copied().collect();
    let streamed_per_token = streamed / (passes.len().max(1) as u64);
    if let (Some(path), Some(logits)) = (&args.dump_logits, &generations[0].prompt_logits) {
        write_logits(path, logits.shape(), &logits.to_f32_vec())?;
    }
    let first_forward = passes.first().copied().unwrap_or(0.0);
    let per_token = decode_seconds_per_token(&batched.batch_seconds);
    let peak = peak_host_bytes();
    if args.json {
        let tokens: Vec<&Vec<u32>> = generations.iter().map(|g| &g.tokens).collect();
        let mut doc = json!({
            "generated_ids": if count == 1 { json!(tokens[0]) } else { json!(tokens) },
            "device_map": device_map_json(weights),
            "load_seconds": load_seconds,
            "first_forward_seconds": first_forward,
            "seconds_per_token": per_token,
            "bytes_streamed_per_token": streamed_per_token,
            "peak_host_bytes": peak,
            "batch_size": batched.batch_size,
            "prefetch_depth": weights.model().prefetch_depth(),
        });
        if let Some(texts) = &texts_out {
            doc["text"] = if count == 1 {
                json!(texts[0])
            } else {
                json!(texts)
            };
        }
        if let Some(seed) = seed {
            doc["seed"] = json!(seed);
        }
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print_device_map(weights);
        for (i, g) in generations.iter().enumerate() {
            let label = if count == 1 {
                String::new()
            } else {
                format!("prompt {}: ", i + 1)
            };
            println!("{label}generated ids: {:?}", g.tokens);
            if let Some(texts) = &texts_out {
                println!("{label}text: {:?}", texts[i]);
            }
        }
        if let Some(seed) = seed {
            println!("sampled with seed {seed}");
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
    super::warn_changed_files();
    Ok(())
}
