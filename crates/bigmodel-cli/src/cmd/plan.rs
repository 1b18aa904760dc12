//! `bigmodel plan`: where each module of a model goes.

use super::{parse_json, read_json};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use bigmodel::BudgetOrigin;
use bigmodel::device::DeviceSet;
use bigmodel::plan::auto::LedgerUnits;
use bigmodel::plan::config::{Family, HfConfig};
use bigmodel::plan::hf::{HfModel, tree_from_config};
use bigmodel::plan::{
    Calibration, Compat, Device, DeviceMap, Ledger, MaxMemory, Mode, ModuleSizes, ModuleTree, Plan,
    PlanOptions, Prediction, SizeOptions, Workload, check_device_map, human_bytes, predict,
};
use bigmodel::tensor::DType;

use super::CmdResult;

/// Arguments of `bigmodel plan`.
#[derive(clap::Args)]
pub struct Args {
    /// A module tree (bigmodel-module-tree/1), a checkpoint (.safetensors or
    /// PyTorch .bin file, *.index.json or a folder) or an HF config.json (or a
    /// folder with one).
    source: PathBuf,
    /// Budgets: `0=10GiB,1=10GiB,cpu=30GiB,disk=200GB` or a JSON object.
    /// Default: what the machine has free.
    #[arg(long)]
    max_memory: Option<String>,
    /// A class never split across devices (repeatable). Default: the
    /// family's `_no_split_modules` for a config.json.
    #[arg(long = "no-split", value_name = "CLASS")]
    no_split: Vec<String>,
    /// The dtype weights are loaded in: f32, f16, bf16.
    #[arg(long)]
    dtype: Option<String>,
    /// auto, balanced, balanced_low_0 or sequential.
    #[arg(long, default_value = "auto")]
    mode: String,
    /// A mode (as --mode) or a JSON device map to check against the model.
    #[arg(long)]
    device_map: Option<String>,
    #[command(flatten)]
    quantize: super::run::QuantizeArgs,
    /// Keep the buffers of offloaded modules offloaded.
    #[arg(long)]
    offload_buffers: bool,
    /// `accelerate`: compute exactly what Accelerate computes.
    #[arg(long)]
    compat: Option<String>,
    /// Accelerate's `fallback_allocation` (with --compat accelerate).
    #[arg(long)]
    fallback_allocation: bool,
    /// Bytes held back per device for activations: `0=2GiB,cpu=1GiB`.
    #[arg(long)]
    reserve: Option<String>,
    /// Reserve the KV cache for this many tokens (decoder config.json only).
    #[arg(long)]
    max_seq_len: Option<u64>,
    /// Sequences computed together (KV cache, activations, logits).
    #[arg(long, default_value_t = 1)]
    batch_size: u64,
    /// Tokens of the first forward pass; its activation peak is charged to
    /// the devices that compute. Default: --max-seq-len.
    #[arg(long)]
    prompt_len: Option<u64>,
    /// Offloaded layers loaded ahead of the running one at run time; the
    /// default planner keeps room for them on the execution device.
    #[arg(long, default_value_t = 1)]
    prefetch_depth: usize,
    /// Mixture-of-experts models: place experts on their own. The rest of
    /// every layer is placed first, then experts fill the room left beside
    /// their layers, the others go to `cpu` or `disk` (with --compat
    /// accelerate or a map: every expert goes there).
    #[arg(long, value_name = "cpu|disk")]
    experts_on: Option<String>,
    /// Print the planner's decisions and the per-device ledger.
    #[arg(long)]
    explain: bool,
    /// Dry run: allocate the ledger on this machine's devices and free it;
    /// fails naming the device that is short and by how much.
    #[arg(long)]
    verify: bool,
    /// A calibration (`bigmodel devices --calibrate --json`): predict the
    /// plan's speed (JSON key `predicted`).
    #[arg(long, conflicts_with = "calibrate")]
    calibration: Option<PathBuf>,
    /// Calibrate this machine now and predict the plan's speed.
    #[arg(long)]
    calibrate: bool,
    /// `memory` (the default planner) or `speed`: of the placements that
    /// fit, the one with the lowest predicted seconds per token (needs a
    /// calibration).
    #[arg(long, default_value = "memory")]
    objective: String,
    /// Print one JSON document: device_map, max_memory, device_bytes,
    /// ledger.
    #[arg(long)]
    json: bool,
}

/// What SOURCE turned out to be.
enum Source {
    Tree(ModuleTree),
    Checkpoint(ModuleTree),
    Config(Box<HfModel>),
}

impl Source {
    fn tree(&self) -> &ModuleTree {
        match self {
            Source::Tree(t) | Source::Checkpoint(t) => t,
            Source::Config(m) => &m.tree,
        }
    }
}

/// The model a parsed config.json describes; errors name `file` and the key.
impl Args {
    /// Whether planning allocates on a device: `--verify` allocates the
    /// ledger on every GPU, `--calibrate` times transfers.
    pub fn uses_devices(&self) -> bool {
        self.verify || self.calibrate
    }
}

fn config_model(doc: serde_json::Value, file: &Path) -> Result<HfModel, bigmodel::plan::Error> {
    tree_from_config(&HfConfig::from_value(doc, file)?)
}

fn load_source(path: &Path) -> Result<Source, String> {
    let in_context = |e: bigmodel::plan::Error| format!("{}: {e}", path.display());
    let checkpoint = || {
        bigmodel::tree_from_checkpoint(path)
            .map(Source::Checkpoint)
            .map_err(|e| format!("{}: {e}", path.display()))
    };
    if path.is_dir() {
        let config = path.join("config.json");
        if config.is_file() {
            let doc = read_json(&config)?;
            if let Ok(model) = config_model(doc, &config) {
                return Ok(Source::Config(Box::new(model)));
            }
        }
        return checkpoint();
    }
    let is_json = path.extension().is_some_and(|e| e == "json");
    if !is_json {
        return checkpoint();
    }
    let mapped = super::map_text(path)?;
    let text = mapped.text();
    // A module tree is read straight into its types: it can be ~10 MB, and
    // a `serde_json::Value` of it costs many times what planning does.
    if ModuleTree::is_document(text) {
        return ModuleTree::from_json_str(text)
            .map(Source::Tree)
            .map_err(in_context);
    }
    let doc = parse_json(path, text)?;
    if doc.get("model_type").is_some() {
        return config_model(doc, path)
            .map(|m| Source::Config(Box::new(m)))
            .map_err(|e| e.to_string());
    }
    if doc.get("weight_map").is_some() || path.to_string_lossy().ends_with(".index.json") {
        return checkpoint();
    }
    Err(format!(
        "{}: not a module tree (\"format\"), a config.json (\"model_type\") or a checkpoint index (\"weight_map\")",
        path.display()
    ))
}

/// The tensors of `tree`, a `family` model loaded in `dtype`, that loading
/// holds in F32 whatever `dtype`: the family's kept modules (T5's `wo`
/// under F16, [`bm_models::family_kept_f32`]) and `keep`, decided as the
/// facade decides it ([`bigmodel::kept_in_f32`]), so that `plan` and
/// `run --verify` size them as `run` loads them.
pub fn kept_in_f32(
    tree: &ModuleTree,
    family: Family,
    dtype: DType,
    keep: &[String],
) -> HashMap<String, DType> {
    let mut modules = bm_models::family_kept_f32(family, dtype);
    modules.extend_from_slice(keep);
    bigmodel::kept_in_f32(tree, Some(dtype), &modules)
}

/// Default budgets when the user gives none, read from the machine (the
/// planner itself never touches a device): the facade's
/// [`bigmodel::default_max_memory`], Accelerate's with `--compat accelerate`,
/// with the figures they came from.
fn default_max_memory(compat: Compat) -> Result<(MaxMemory, BudgetOrigin), String> {
    bigmodel::default_max_memory_with_origin(&DeviceSet::probe(), compat).map_err(|e| e.to_string())
}

fn parse_dtype(text: &str) -> Result<DType, String> {
    DType::from_str(text)
        .ok()
        .filter(|d| matches!(d, DType::F32 | DType::F16 | DType::BF16))
        .ok_or_else(|| {
            format!("--dtype {text:?}: expected f32, f16 or bf16 (or float32, float16, bfloat16)")
        })
}

/// Runs the command.
pub fn run(args: Args) -> CmdResult {
    let compat = match args.compat.as_deref() {
        None | Some("auto") | Some("bigmodel") => Compat::Auto,
        Some("accelerate") => Compat::Accelerate,
        Some(other) => return Err(format!("--compat {other:?}: expected accelerate").into()),
    };
    let mut mode_text = args.mode.clone();
    let mut custom_map = None;
    if let Some(map) = &args.device_map {
        if Mode::parse(map).is_some() {
            mode_text = map.clone();
        } else {
            custom_map = Some(PathBuf::from(map));
        }
    }
    let mode = Mode::parse(&mode_text).ok_or_else(|| {
        format!("--mode {mode_text:?}: expected auto, balanced, balanced_low_0 or sequential")
    })?;
    let dtype = args.dtype.as_deref().map(parse_dtype).transpose()?;
    let experts_on = args
        .experts_on
        .as_deref()
        .map(super::run::parse_experts_on)
        .transpose()?;
    if compat == Compat::Accelerate
        && (args.reserve.is_some() || args.max_seq_len.is_some() || args.prompt_len.is_some())
    {
        return Err(
            "--reserve, --max-seq-len and --prompt-len apply to bigmodel's planner, not to --compat accelerate"
                .into(),
        );
    }
    if args.batch_size == 0 || args.max_seq_len == Some(0) || args.prompt_len == Some(0) {
        return Err("--batch-size, --max-seq-len and --prompt-len must be at least 1".into());
    }
    if compat == Compat::Auto && args.fallback_allocation {
        return Err("--fallback-allocation applies to --compat accelerate only".into());
    }

    let quantize = args.quantize.options()?;
    let source = load_source(&args.source)?;
    let custom_map = match custom_map {
        Some(path) => {
            let doc = read_json(&path)?;
            let map = DeviceMap::from_json(&doc).map_err(|e| format!("{}: {e}", path.display()))?;
            Some((path, map))
        }
        None => None,
    };
    // The tree loading would dispatch: packed where a pre-quantized
    // checkpoint stores weights packed, or where --quantize packs them.
    let folder = if args.source.is_dir() {
        Some(args.source.as_path())
    } else {
        args.source.parent()
    };
    let config_folder = folder.filter(|f| f.join("config.json").is_file());
    let loaded = match (&source, &quantize) {
        (Source::Config(_), _) | (_, Some(_)) => Some(
            bm_models::load_tree(
                config_folder,
                source.tree(),
                quantize.as_ref(),
                custom_map.as_ref().map(|(_, map)| map),
            )
            .map_err(|e| format!("{}: {e}", args.source.display()))?,
        ),
        _ => None,
    };
    let tree = loaded.as_ref().unwrap_or(source.tree());
    // `run` loads every float weight of a folder in one dtype (--dtype, else
    // the checkpoint's, whatever config.json says): bigmodel sizes the plan
    // in it, by the decision loading takes. Accelerate's planner sizes in
    // the dtype it is given, as Accelerate does; its map's ledger is what
    // loading it allocates.
    let load_dtype = match (&source, config_folder) {
        (Source::Config(model), Some(folder)) => {
            bm_models::folder_load_dtype(folder, model.family, dtype)
                .map_err(|e| format!("{}: {e}", folder.display()))?
        }
        _ => dtype,
    };
    let plan_dtype = match compat {
        Compat::Auto => load_dtype,
        Compat::Accelerate => dtype,
    };
    // What loading keeps in F32 under a half dtype (T5's `wo` in F16), in
    // whichever dtype the weights come in.
    let special_dtypes = match &source {
        Source::Config(model) => {
            kept_in_f32(tree, model.family, load_dtype.unwrap_or(model.dtype), &[])
        }
        _ => HashMap::new(),
    };

    if let Some((path, map)) = custom_map {
        return check_custom_map(
            tree,
            (&path, map),
            (load_dtype, special_dtypes),
            experts_on,
            args.json,
            source.tree().parameter_count(),
        );
    }

    let (max_memory, budgets) = match &args.max_memory {
        Some(spec) => {
            let given =
                MaxMemory::parse(spec).map_err(|e| format!("--max-memory {spec:?}: {e}"))?;
            (given.clone(), BudgetOrigin::Given(given))
        }
        None => default_max_memory(compat)?,
    };
    let from_user = budgets.is_given();
    let no_split = if args.no_split.is_empty() {
        match &source {
            Source::Config(model) => model.no_split.clone(),
            _ => Vec::new(),
        }
    } else {
        args.no_split.clone()
    };
    let mut warnings = Vec::new();
    for class in &args.no_split {
        if !tree.modules().any(|m| m.class == class) && compat == Compat::Accelerate {
            warnings.push(format!("--no-split {class}: no module has this class"));
        }
    }
    let workload = workload(&args)?;
    let mut options = PlanOptions {
        max_memory,
        max_memory_from_user: from_user,
        no_split,
        dtype: plan_dtype,
        special_dtypes,
        mode,
        offload_buffers: args.offload_buffers,
        fallback_allocation: args.fallback_allocation,
        reserve: match &args.reserve {
            Some(spec) => MaxMemory::parse(spec).map_err(|e| format!("--reserve {spec:?}: {e}"))?,
            None => MaxMemory::default(),
        },
        explain: args.explain,
        prefetch_depth: args.prefetch_depth,
        experts_on,
        ..PlanOptions::default()
    };
    if let Some(workload) = &workload {
        let Source::Config(model) = &source else {
            return Err(
                "--max-seq-len and --prompt-len need a config.json (the ledger's runtime items are computed from it)"
                    .into(),
            );
        };
        if args.max_seq_len.is_some() && !model.shape.decoder {
            return Err(format!(
                "--max-seq-len: {} has no KV cache (not a decoder)",
                args.source.display()
            )
            .into());
        }
        let on_gpu = options.max_memory.gpus().any(|(_, b)| b > 0);
        model
            .runtime_charges(workload, on_gpu, load_dtype.unwrap_or(model.dtype))
            .apply(&mut options);
    }
    let speed = match args.objective.as_str() {
        "memory" => false,
        "speed" => true,
        other => return Err(format!("--objective {other:?}: expected memory or speed").into()),
    };
    if speed && experts_on.is_some() {
        return Err(
            "--objective speed decides where the experts rest; it does not take --experts-on"
                .into(),
        );
    }
    let calibration = match (&args.calibration, args.calibrate) {
        (Some(path), _) => Some(
            Calibration::from_json(&read_json(path)?, &path.display().to_string())
                .map_err(|e| e.to_string())?,
        ),
        (None, true) => Some(super::calibrate::calibrate(&std::env::temp_dir())?),
        (None, false) => None,
    };
    options.overheads = match &calibration {
        Some(c) => bigmodel::overheads_calibrated(&options.max_memory, from_user, c),
        // The GPUs of this machine, when the budgets name any.
        None if options.max_memory.gpus().any(|(_, b)| b > 0) => bigmodel::overheads(
            &options.max_memory,
            &bigmodel::cuda_gpus(&DeviceSet::probe()),
        ),
        None => bigmodel::overheads(&options.max_memory, &[]),
    };
    // Accelerate's planner keeps no ledger: the ledger of its map, whose
    // units are sized on a second thread while the planner runs.
    let loaded = PlanOptions {
        dtype: load_dtype,
        ..options.clone()
    };
    let (plan, units) = std::thread::scope(|scope| {
        let units =
            (compat == Compat::Accelerate).then(|| scope.spawn(|| LedgerUnits::of(tree, &loaded)));
        let plan = bigmodel::plan::plan_with(tree, &options, compat);
        // The map resolved on the tree while the units are still sized.
        let resolved = match (&plan, &units) {
            (Ok(plan), Some(_)) => Some(plan.device_map.resolve(tree)),
            _ => None,
        };
        let units = units.map(|units| match units.join() {
            Ok(units) => units,
            Err(panic) => std::panic::resume_unwind(panic),
        });
        (plan, units.zip(resolved))
    });
    let mut plan = plan.map_err(|e| budgets.explain(e.into()))?;
    if let Some((units, resolved)) = units {
        plan.ledger = units.ledger_resolved(&plan.device_map, &resolved)?;
    }
    let mut default_predicted: Option<Prediction> = None;
    let predicted = match &calibration {
        None if speed => {
            return Err("--objective speed needs --calibration FILE or --calibrate".into());
        }
        None => None,
        Some(c) => {
            let Source::Config(model) = &source else {
                return Err(
                    "a speed prediction needs a config.json (its sizes decide the compute)".into(),
                );
            };
            let workload = workload.ok_or(
                "a speed prediction needs the workload: give --prompt-len (and --max-seq-len)",
            )?;
            if speed {
                let found = bigmodel::plan::fastest(model, tree, &options, &plan, &workload, c)?;
                eprintln!(
                    "objective speed: {:.4} s/token predicted for the default map, {:.4} s/token for the fastest of {} placements searched{}, at prefetch depth {}",
                    found.default.seconds_per_token,
                    found.prediction.seconds_per_token,
                    found.searched,
                    if found.plan.device_map == plan.device_map {
                        " (the default map)"
                    } else {
                        ""
                    },
                    found.plan.prefetch_depth
                );
                default_predicted = Some(found.default);
                // The planner's trace and warnings still explain the default.
                let (trace, info, warnings) = (
                    std::mem::take(&mut plan.trace),
                    std::mem::take(&mut plan.info),
                    std::mem::take(&mut plan.warnings),
                );
                plan = found.plan;
                plan.trace = trace;
                plan.info = info;
                plan.warnings = warnings;
                Some(found.prediction)
            } else {
                Some(predict(model, &plan.device_map, &options, &workload, c)?)
            }
        }
    };
    warnings.extend(plan.warnings.iter().cloned());
    for w in &warnings {
        eprintln!("warning: {w}");
    }
    if args.explain {
        for line in plan.trace.iter().chain(&plan.info) {
            eprintln!("{line}");
        }
        print_ledger(&plan.ledger, &plan.max_memory, workload.as_ref());
    }
    if args.verify {
        let short = bigmodel::verify_ledger(&plan.ledger, &DeviceSet::probe())?;
        if !short.is_empty() {
            let lines: Vec<String> = short.iter().map(|s| s.to_string()).collect();
            return Err(format!("--verify: the plan does not fit: {}", lines.join("; ")).into());
        }
        eprintln!(
            "--verify: fits (the ledger was allocated on every GPU and freed; host memory is available)"
        );
    }
    if args.json {
        let mut doc = plan.to_json();
        // The depth the plan holds streaming room for, which the speed
        // objective may have chosen; Accelerate's planner holds none.
        if compat == Compat::Auto {
            doc["prefetch_depth"] = plan.prefetch_depth.into();
        }
        if let Some(p) = &predicted {
            doc["predicted"] = p.to_json();
        }
        if let Some(p) = &default_predicted {
            doc["predicted_default_map"] = p.to_json();
        }
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print_table(
            tree,
            &plan,
            (plan_dtype, &options.special_dtypes),
            source.tree().parameter_count(),
        );
        if let Some(p) = &predicted {
            println!(
                "predicted: first forward {:.4} s, {:.4} s/token, {} streamed per token",
                p.first_forward_seconds,
                p.seconds_per_token,
                human_bytes(p.bytes_streamed_per_token)
            );
        }
        if let Some(p) = &default_predicted {
            println!(
                "predicted for the default map: first forward {:.4} s, {:.4} s/token, {} streamed per token",
                p.first_forward_seconds,
                p.seconds_per_token,
                human_bytes(p.bytes_streamed_per_token)
            );
        }
    }
    // The process ends here: freeing a large tree's names one by one (a
    // 100k-module tree has ~400k allocations) costs more than planning it.
    std::mem::forget(source);
    Ok(())
}

/// The declared workload: none unless --max-seq-len or --prompt-len is
/// given (then the runtime items are charged).
fn workload(args: &Args) -> Result<Option<Workload>, String> {
    let (prompt_len, max_seq_len) = match (args.prompt_len, args.max_seq_len) {
        (None, None) => return Ok(None),
        (Some(p), None) => (p, p),
        (None, Some(s)) => (s, s),
        (Some(p), Some(s)) if p <= s => (p, s),
        (Some(p), Some(s)) => {
            return Err(format!(
                "--prompt-len {p} is longer than --max-seq-len {s}: the KV cache must hold the prompt"
            ));
        }
    };
    Ok(Some(Workload {
        batch: args.batch_size,
        prompt_len,
        max_seq_len,
        all_logits: false,
    }))
}

/// The ledger as a table on stderr (the `--explain` stream): per device,
/// each item, the total against the budget.
fn print_ledger(ledger: &Ledger, budgets: &MaxMemory, workload: Option<&Workload>) {
    match workload {
        Some(w) => eprintln!(
            "ledger for batch {}, prompt {} tokens, sequences of {} tokens:",
            w.batch, w.prompt_len, w.max_seq_len
        ),
        None => eprintln!(
            "ledger (no workload declared: give --max-seq-len/--prompt-len to charge KV cache, activations and logits):"
        ),
    }
    eprintln!("{:<6} {:<15} {:>12}", "device", "item", "bytes");
    for device in ledger.devices() {
        for (item, bytes) in ledger.items(device) {
            eprintln!(
                "{:<6} {:<15} {:>12}",
                device.to_string(),
                item.key(),
                human_bytes(*bytes)
            );
        }
        let total = ledger.total(device);
        let budget = match budgets.get(device) {
            Some(b) if total <= b => format!("of {} budget: fits", human_bytes(b)),
            Some(b) => format!(
                "of {} budget: short by {}",
                human_bytes(b),
                human_bytes(total - b)
            ),
            None => "(no budget)".into(),
        };
        eprintln!(
            "{:<6} {:<15} {:>12}  {budget}",
            device.to_string(),
            "total",
            human_bytes(total)
        );
    }
}

fn check_custom_map(
    tree: &ModuleTree,
    (path, map): (&Path, DeviceMap),
    (dtype, special_dtypes): (Option<DType>, HashMap<String, DType>),
    experts_on: Option<Device>,
    json: bool,
    parameters: u64,
) -> CmdResult {
    let warnings = check_device_map(tree, &map).map_err(|e| format!("{}: {e}", path.display()))?;
    for w in &warnings {
        eprintln!("warning: {w}");
    }
    let map = match experts_on {
        Some(device) => bigmodel::plan::place_experts(tree, &map, device)?,
        None => map,
    };
    let plan = Plan {
        device_bytes: map.bytes_per_device(
            tree,
            &ModuleSizes::compute(
                tree,
                &SizeOptions {
                    dtype,
                    special_dtypes: special_dtypes.clone(),
                    ..SizeOptions::default()
                },
            ),
        ),
        device_map: map,
        ..Plan::default()
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&plan.to_json())?);
    } else {
        print_table(tree, &plan, (dtype, &special_dtypes), parameters);
    }
    Ok(())
}

/// The plan as a table; `parameters` is the model's count (a quantized
/// tree holds packed bytes, not parameters).
fn print_table(
    tree: &ModuleTree,
    plan: &Plan,
    (dtype, special_dtypes): (Option<DType>, &HashMap<String, DType>),
    parameters: u64,
) {
    let total: u64 = plan.device_bytes.iter().map(|(_, b)| b).sum();
    let sizes = ModuleSizes::compute(
        tree,
        &SizeOptions {
            dtype,
            special_dtypes: special_dtypes.clone(),
            ..SizeOptions::default()
        },
    );
    println!(
        "{} modules, {} tensors, {} parameters, {} to place",
        tree.modules().len(),
        tree.tensors().len(),
        parameters,
        human_bytes(sizes.total())
    );
    println!(
        "{:<6} {:>12} {:>12} {:>7}  first .. last",
        "device", "placed", "budget", "share"
    );
    let mut devices: Vec<Device> = plan.device_bytes.iter().map(|(d, _)| *d).collect();
    for d in plan.max_memory.devices() {
        if !devices.contains(&d) {
            devices.push(d);
        }
    }
    devices.sort();
    for d in devices {
        let placed = plan
            .device_bytes
            .iter()
            .find(|(x, _)| *x == d)
            .map(|(_, b)| *b)
            .unwrap_or(0);
        let budget = plan
            .max_memory
            .get(d)
            .map(human_bytes)
            .unwrap_or_else(|| "-".into());
        let share = if total > 0 {
            placed as f64 * 100.0 / total as f64
        } else {
            0.0
        };
        let names: Vec<&str> = plan
            .device_map
            .iter()
            .filter(|(_, x)| *x == d)
            .map(|(n, _)| n)
            .collect();
        let span = match (names.first(), names.last()) {
            (Some(f), Some(l)) if f == l => display_name(f).to_string(),
            (Some(f), Some(l)) => format!("{} .. {}", display_name(f), display_name(l)),
            _ => "-".into(),
        };
        println!(
            "{:<6} {:>12} {:>12} {:>6.1}%  {span}",
            d.to_string(),
            human_bytes(placed),
            budget,
            share
        );
    }
}

fn display_name(name: &str) -> &str {
    if name.is_empty() {
        "(whole model)"
    } else {
        name
    }
}
