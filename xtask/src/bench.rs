//! `cargo xtask bench [--quick] [--with-accelerate] [--prebuilt DIR]`: the
//! benchmark suite and its report, `target/bench-report.md` and
//! `target/bench-report.json`.
//!
//! Every figure stands next to a baseline measured in the same run (memcpy,
//! Python safetensors, Accelerate, the measured host-to-device ceiling), with
//! the ratio between the two. Rust figures come from the criterion benches of
//! `benches/` (medians read from `target/criterion/**/new/estimates.json`)
//! and from the release `bigmodel` CLI; Python figures from `tools/bench_accelerate.py`.
//!
//! A row whose measurement fails says why ("not available: …") and the other
//! rows still run; nothing here fails because something is slow. The Python
//! baseline runs only with `--with-accelerate`, in `target/bench-venv` (made
//! from `tools/requirements-bench.txt`) or in the interpreter named by
//! `BM_BENCH_PYTHON`.
//!
//! With `--prebuilt DIR` the suite runs from a GPU bundle (`cargo xtask
//! gpu-bundle`) on a machine without a Rust toolchain: the bundle's CLI and
//! bench binaries run as they are (cargo is never invoked), the baseline's
//! scripts come from `DIR/tools/`, and everything the run writes (inputs,
//! criterion results, the report) goes to `DIR/target/`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use crate::gpu;

const HELP: &str = "\
cargo xtask bench [--quick] [--with-accelerate] [--prebuilt DIR]

Runs the benchmark suite and writes target/bench-report.md and
target/bench-report.json: every figure next to its baseline from the same run.

  --quick            criterion --quick, smaller checkpoint and model (minutes)
  --with-accelerate  also run the Python baseline (Accelerate, transformers,
                     safetensors) from target/bench-venv, created from PyPI with
                     tools/requirements-bench.txt; BM_BENCH_PYTHON=/path/to/python
                     uses that interpreter instead of a venv
  --prebuilt DIR     run from a GPU bundle (cargo xtask gpu-bundle) without
                     cargo: DIR/bin/bigmodel, the bench binaries of DIR/benches,
                     the scripts of DIR/tools; writes under DIR/target/
";

const SKIPPED_PYTHON: &str = "skipped: run with --with-accelerate";
const NO_GPU: &str = "no GPU: not measured";

/// The longest any one command may run (a hung command must not stop the
/// report). Cargo gets longer: it may compile first.
const COMMAND_LIMIT: Duration = Duration::from_secs(15 * 60);
const CARGO_LIMIT: Duration = Duration::from_secs(45 * 60);

/// Options of `cargo xtask bench`.
#[derive(Debug, PartialEq)]
pub struct Options {
    quick: bool,
    with_accelerate: bool,
    /// A GPU bundle folder to run from instead of the workspace.
    prebuilt: Option<PathBuf>,
}

impl Options {
    /// Parses the arguments after `bench`; `Ok(None)` means help was printed.
    pub fn parse(args: &[String]) -> Result<Option<Self>, String> {
        let mut options = Options {
            quick: false,
            with_accelerate: false,
            prebuilt: None,
        };
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            let prebuilt = match arg.as_str() {
                "--prebuilt" => Some(args.next().map(String::as_str).unwrap_or("")),
                other => other.strip_prefix("--prebuilt="),
            };
            if let Some(dir) = prebuilt {
                if dir.is_empty() || dir.starts_with("--") {
                    return Err(format!(
                        "cargo xtask bench: --prebuilt needs a bundle folder\n{HELP}"
                    ));
                }
                options.prebuilt = Some(PathBuf::from(dir));
                continue;
            }
            match arg.as_str() {
                "--quick" => options.quick = true,
                "--with-accelerate" => options.with_accelerate = true,
                "--help" | "-h" => {
                    print!("{HELP}");
                    return Ok(None);
                }
                other => {
                    return Err(format!(
                        "cargo xtask bench: unknown option {other:?}\n{HELP}"
                    ));
                }
            }
        }
        Ok(Some(options))
    }
}

/// What a row's figures measure, for formatting and for the ratio's direction.
#[derive(Clone, Copy)]
enum Unit {
    /// Lower is better.
    Seconds,
    /// Lower is better.
    Bytes,
    /// Higher is better (10^9 bytes per second).
    GigabytesPerSecond,
}

impl Unit {
    fn name(self) -> &'static str {
        match self {
            Unit::Seconds => "s",
            Unit::Bytes => "bytes",
            Unit::GigabytesPerSecond => "GB/s",
        }
    }

    fn format(self, v: f64) -> String {
        match self {
            Unit::Seconds if v < 1e-3 => format!("{:.1} µs", v * 1e6),
            Unit::Seconds if v < 1.0 => format!("{:.2} ms", v * 1e3),
            Unit::Seconds => format!("{v:.3} s"),
            Unit::Bytes if v < (1u64 << 20) as f64 => format!("{:.1} KiB", v / 1024.0),
            Unit::Bytes => format!("{:.0} MiB", v / (1u64 << 20) as f64),
            Unit::GigabytesPerSecond => format!("{v:.2} GB/s"),
        }
    }
}

/// One side of a row: a measured value, or why there is none.
enum Cell {
    Value(f64),
    Missing(String),
}

impl Cell {
    fn from(result: Result<f64, String>) -> Cell {
        result.map_or_else(Cell::Missing, Cell::Value)
    }

    fn value(&self) -> Option<f64> {
        match self {
            Cell::Value(v) => Some(*v),
            Cell::Missing(_) => None,
        }
    }

    fn to_json(&self) -> Value {
        match self {
            Cell::Value(v) => json!(v),
            Cell::Missing(why) => json!({ "missing": why }),
        }
    }

    fn format(&self, unit: Unit) -> String {
        match self {
            Cell::Value(v) => unit.format(*v),
            Cell::Missing(why) => why.clone(),
        }
    }
}

/// One line of the report: bigmodel's figure, its baseline, their ratio.
struct Row {
    section: &'static str,
    name: String,
    unit: Unit,
    bigmodel: Cell,
    baseline_name: String,
    baseline: Cell,
    note: String,
}

impl Row {
    fn new(section: &'static str, name: impl Into<String>, unit: Unit) -> Row {
        Row {
            section,
            name: name.into(),
            unit,
            bigmodel: Cell::Missing("not measured".into()),
            baseline_name: String::new(),
            baseline: Cell::Missing("not measured".into()),
            note: String::new(),
        }
    }

    fn bigmodel(mut self, cell: Cell) -> Row {
        self.bigmodel = cell;
        self
    }

    fn baseline(mut self, name: impl Into<String>, cell: Cell) -> Row {
        self.baseline_name = name.into();
        self.baseline = cell;
        self
    }

    fn note(mut self, note: impl Into<String>) -> Row {
        self.note = note.into();
        self
    }

    /// How many times better bigmodel is than the baseline: baseline ÷
    /// bigmodel for times and memory, bigmodel ÷ baseline for throughput
    /// (then it is also the share of a ceiling).
    fn ratio(&self) -> Option<f64> {
        let (ours, theirs) = (self.bigmodel.value()?, self.baseline.value()?);
        let ratio = match self.unit {
            Unit::Seconds | Unit::Bytes => theirs / ours,
            Unit::GigabytesPerSecond => ours / theirs,
        };
        ratio.is_finite().then_some(ratio)
    }
}

/// The sizes of the Llama-style model the load rows use (the demo's shape:
/// about 1 GB of F32 weights; a quarter of that with `--quick`).
struct LlamaShape {
    layers: usize,
    hidden: usize,
    intermediate: usize,
    heads: usize,
    kv_heads: usize,
    vocab: usize,
}

impl LlamaShape {
    fn for_run(quick: bool) -> LlamaShape {
        LlamaShape {
            layers: if quick { 4 } else { 16 },
            hidden: 1024,
            intermediate: 2816,
            heads: 16,
            kv_heads: 4,
            vocab: if quick { 8000 } else { 32000 },
        }
    }

    fn config(&self) -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.hidden / self.heads,
            "vocab_size": self.vocab,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "attention_bias": false,
            "mlp_bias": false,
            "tie_word_embeddings": false,
            "torch_dtype": "float32",
            "bos_token_id": 1,
            "eos_token_id": 2,
        })
    }

    /// Every tensor in transformers' order: name, shape, whether it is a norm
    /// weight (ones) rather than a random matrix.
    fn tensors(&self) -> Vec<(String, Vec<usize>, bool)> {
        let (h, i) = (self.hidden, self.intermediate);
        let kv = self.kv_heads * (h / self.heads);
        let mut t = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![self.vocab, h],
            false,
        )];
        for l in 0..self.layers {
            let p = format!("model.layers.{l}");
            t.push((format!("{p}.input_layernorm.weight"), vec![h], true));
            t.push((format!("{p}.self_attn.q_proj.weight"), vec![h, h], false));
            t.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h], false));
            t.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h], false));
            t.push((format!("{p}.self_attn.o_proj.weight"), vec![h, h], false));
            t.push((
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                true,
            ));
            t.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h], false));
            t.push((format!("{p}.mlp.up_proj.weight"), vec![i, h], false));
            t.push((format!("{p}.mlp.down_proj.weight"), vec![h, i], false));
        }
        t.push(("model.norm.weight".into(), vec![h], true));
        t.push(("lm_head.weight".into(), vec![self.vocab, h], false));
        t
    }

    /// Top-level units of the model in order, for device maps.
    fn units(&self) -> Vec<String> {
        let mut u = vec!["model.embed_tokens".to_string()];
        u.extend((0..self.layers).map(|l| format!("model.layers.{l}")));
        u.push("model.norm".into());
        u.push("lm_head".into());
        u
    }

    /// A device map: the embedding, norm and head on `head`, the first half
    /// of the decoder layers on `first`, the second half on `second`.
    fn device_map(&self, head: Value, first: Value, second: Value) -> Value {
        let mut map = serde_json::Map::new();
        for unit in self.units() {
            let place = match unit.strip_prefix("model.layers.") {
                Some(l) if l.parse::<usize>().unwrap_or(0) < self.layers / 2 => first.clone(),
                Some(_) => second.clone(),
                None => head.clone(),
            };
            map.insert(unit, place);
        }
        Value::Object(map)
    }

    /// Prompt ids for the first forward: 32 tokens inside the vocabulary.
    fn prompt_ids(&self) -> String {
        (0..32)
            .map(|k| ((k * 7919 + 3) % self.vocab).to_string())
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Where the suite's programs come from and where its files go: the
/// workspace, built and benched by cargo, or a GPU bundle whose binaries
/// run as they are.
struct Layout {
    /// The workspace, or the bundle folder.
    root: PathBuf,
    /// The cargo that builds and benches; `None` for a bundle, where cargo
    /// is never invoked.
    cargo: Option<String>,
}

impl Layout {
    fn workspace(root: &Path) -> Layout {
        Layout {
            root: root.to_path_buf(),
            cargo: Some(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())),
        }
    }

    /// The GPU bundle at `dir` (absolute from here on, since commands run
    /// in other folders); fails when `dir` is not one.
    fn bundle(dir: &Path) -> Result<Layout, String> {
        let root = fs::canonicalize(dir)
            .map_err(|e| format!("--prebuilt {}: cannot open the folder: {e}", dir.display()))?;
        if !root.join(gpu::CLI).is_file() {
            return Err(format!(
                "--prebuilt {}: not a GPU bundle (it has no {}); make one with `cargo xtask gpu-bundle`",
                dir.display(),
                gpu::CLI
            ));
        }
        Ok(Layout { root, cargo: None })
    }

    /// Where the run's inputs and its report go.
    fn output(&self) -> PathBuf {
        self.root.join("target")
    }

    /// A script of the baseline: the bundle keeps them under the same
    /// folder name as the workspace.
    fn tool(&self, script: &str) -> PathBuf {
        self.root.join(gpu::TOOLS).join(script)
    }

    /// Where criterion writes the results of `bench_command`'s runs.
    fn criterion_dir(&self) -> PathBuf {
        match self.cargo {
            Some(_) => target_dir(&self.root).join("criterion"),
            None => self.output().join("criterion"),
        }
    }

    /// The command that runs criterion bench `bench`: `cargo bench` with
    /// `features`, or the bundle's binary (built with every CUDA feature).
    fn bench_command(&self, bench: &str, features: &[&str], quick: bool) -> Command {
        let mut cmd = match &self.cargo {
            Some(cargo) => {
                let mut c = Command::new(cargo);
                c.args(["bench", "-p", "bigmodel-benches", "--bench", bench]);
                if !features.is_empty() {
                    c.args(["--features", &features.join(",")]);
                }
                c.arg("--");
                c
            }
            None => {
                let mut c = Command::new(self.root.join(gpu::BENCHES).join(bench));
                // What `cargo bench` passes: measure, rather than run each
                // benchmark once as a test.
                c.arg("--bench");
                // Criterion takes its folder from CRITERION_HOME before it
                // would ask `$CARGO metadata`.
                c.env("CRITERION_HOME", self.criterion_dir())
                    .env_remove("CARGO");
                c
            }
        };
        cmd.current_dir(&self.root)
            .args(["--output-format", "bencher", "--noplot"]);
        if quick {
            cmd.arg("--quick");
        }
        cmd
    }

    /// How `bench_command` reads in messages.
    fn bench_label(&self, bench: &str) -> String {
        match self.cargo {
            Some(_) => format!("cargo bench --bench {bench}"),
            None => format!("{}/{bench} --bench", gpu::BENCHES),
        }
    }

    /// The release CLI and, when its CUDA build failed, why: built by cargo
    /// (see `build_cli`), or the bundle's.
    fn cli(&self) -> (Result<PathBuf, String>, Option<String>) {
        match &self.cargo {
            Some(cargo) => build_cli(&self.root, cargo),
            None => (Ok(self.root.join(gpu::CLI)), None),
        }
    }

    /// The commit measured: the workspace's HEAD, or the one the bundle
    /// was built from.
    fn commit(&self) -> String {
        match self.cargo {
            Some(_) => gpu::commit(&self.root),
            None => fs::read_to_string(self.root.join(gpu::COMMIT))
                .ok()
                .map(|c| c.trim().to_string())
                .filter(|c| !c.is_empty())
                .unwrap_or_else(|| "unknown".into()),
        }
    }

    /// The command line of a run, for the report.
    fn command_line(&self, quick: bool, with_accelerate: bool) -> String {
        let mut line = match self.cargo {
            Some(_) => "cargo xtask bench".to_string(),
            None => format!("xtask bench --prebuilt {}", self.root.display()),
        };
        if quick {
            line.push_str(" --quick");
        }
        if with_accelerate {
            line.push_str(" --with-accelerate");
        }
        line
    }
}

/// Everything the rows share: where things are, what is available.
struct Suite {
    layout: Layout,
    quick: bool,
    data: PathBuf,
    /// The release CLI (built with the cuda feature so GPUs are seen).
    cli: Result<PathBuf, String>,
    /// The baseline interpreter, or why there is none.
    python: Result<PathBuf, String>,
    /// GPU descriptions, empty when there is none.
    gpus: Vec<String>,
    /// Why no GPU was found (for the machine line).
    gpu_absent: String,
    /// The Llama-style model the load rows use: folder and tensor bytes.
    model: Result<(PathBuf, u64), String>,
    shape: LlamaShape,
    sparse: Result<PathBuf, String>,
}

/// Runs the suite and writes the report.
/// `root` is the workspace; `--prebuilt` replaces it with the bundle.
pub fn run(root: &Path, options: Options) -> Result<(), String> {
    let layout = match &options.prebuilt {
        Some(dir) => Layout::bundle(dir)?,
        None => Layout::workspace(root),
    };
    let target = layout.output();
    let data = target.join("bench-data");
    fs::create_dir_all(&data).map_err(|e| format!("creating {}: {e}", data.display()))?;
    let started = Instant::now();

    let (cli, cuda_failure) = layout.cli();
    let (gpus, gpu_absent) = match (&cli, cuda_failure) {
        (_, Some(why)) => (
            Vec::new(),
            format!("not detected: the CUDA build of the CLI failed: {why}"),
        ),
        (Ok(cli), None) => find_gpus(cli),
        (Err(e), None) => (Vec::new(), format!("unknown: {e}")),
    };
    let python = baseline_python(&layout, options.with_accelerate);
    let shape = LlamaShape::for_run(options.quick);
    let model = write_llama(
        &data.join(if options.quick {
            "llama-quick"
        } else {
            "llama"
        }),
        &shape,
    );
    let sparse = write_sparse(&data.join("sparse-64GiB.safetensors"));
    let suite = Suite {
        layout,
        quick: options.quick,
        data,
        cli,
        python,
        gpus,
        gpu_absent,
        model,
        shape,
        sparse,
    };

    let mut rows = Vec::new();
    rows.extend(suite.plan_rows());
    rows.extend(suite.checkpoint_rows());
    rows.extend(suite.inspect_rows());
    rows.extend(suite.load_rows());
    rows.extend(suite.gpu_rows());

    let machine = machine(&suite);
    let elapsed = started.elapsed().as_secs_f64();
    let md = markdown(&suite, &machine, &rows, elapsed);
    let js = report_json(&suite, &machine, &rows, elapsed);
    write_atomic(&target.join("bench-report.md"), md.as_bytes())?;
    write_atomic(
        &target.join("bench-report.json"),
        format!(
            "{}\n",
            serde_json::to_string_pretty(&js).unwrap_or_default()
        )
        .as_bytes(),
    )?;
    print!("{md}");
    eprintln!(
        "bench report: {} and {}",
        target.join("bench-report.md").display(),
        target.join("bench-report.json").display()
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// Rows

impl Suite {
    fn python(&self) -> Result<&Path, String> {
        self.python.as_deref().map_err(Clone::clone)
    }

    fn cli(&self) -> Result<&Path, String> {
        self.cli.as_deref().map_err(Clone::clone)
    }

    /// Runs `tools/bench_accelerate.py ARGS` and parses its JSON.
    fn baseline(&self, args: &[&str]) -> Result<Value, String> {
        let python = self.python()?;
        let script = self.layout.tool("bench_accelerate.py");
        let mut cmd = Command::new(python);
        cmd.arg(&script).args(args).current_dir(&self.layout.root);
        let out = capture(&mut cmd, COMMAND_LIMIT)?;
        serde_json::from_str(out.stdout.trim()).map_err(|e| {
            format!(
                "not available: bench_accelerate.py {}: bad JSON ({e})",
                args[0]
            )
        })
    }

    /// Runs one criterion bench of `benches/`; returns median nanoseconds
    /// per benchmark id.
    fn criterion(
        &self,
        bench: &str,
        features: &[&str],
        env: &[(&str, String)],
    ) -> Result<BTreeMap<String, f64>, String> {
        let mut cmd = self.layout.bench_command(bench, features, self.quick);
        for (k, v) in env {
            cmd.env(k, v);
        }
        // Criterion's file times have at least second resolution everywhere.
        let since = SystemTime::now() - Duration::from_secs(2);
        capture(&mut cmd, CARGO_LIMIT)?;
        let parsed = criterion_results(&self.layout.criterion_dir(), since);
        if parsed.is_empty() {
            return Err(format!(
                "not available: `{}` wrote no criterion results",
                self.layout.bench_label(bench)
            ));
        }
        Ok(parsed)
    }

    fn plan_rows(&self) -> Vec<Row> {
        const S: &str = "Planner (CPU)";
        eprintln!("== bench: planner");
        let ours = self.criterion("plan", &[], &[]);
        let theirs = self.baseline(&["plan", "--repeats", if self.quick { "2" } else { "3" }]);
        let mut rows = Vec::new();
        for (tree, label) in [
            (
                "million_tensors",
                "1,000,000 tensors (1000 × 500 Linear(16,16))",
            ),
            (
                "100b_sequential",
                "100B Sequential(1000 × Linear(10000,10000))",
            ),
            (
                "moe_100k",
                "MoE tree, ~99k modules (48 layers × 512 experts)",
            ),
        ] {
            let accelerate = if tree == "million_tensors" {
                Err("not measured: Accelerate takes minutes on this tree".to_string())
            } else {
                theirs.clone().and_then(|v| {
                    v["trees"][tree]["seconds"]
                        .as_f64()
                        .ok_or_else(|| format!("not available: no Accelerate time for {tree}"))
                })
            };
            for (planner, what) in [
                ("accelerate_compat", "bigmodel --compat accelerate"),
                ("bigmodel_auto", "bigmodel auto"),
            ] {
                let id = format!("plan/{tree}/{planner}");
                let seconds = ours
                    .as_ref()
                    .map_err(Clone::clone)
                    .and_then(|m| lookup(m, &id))
                    .map(|ns| ns * 1e-9);
                rows.push(
                    Row::new(S, format!("{label}: {what}"), Unit::Seconds)
                        .bigmodel(Cell::from(seconds))
                        .baseline(
                            "Accelerate infer_auto_device_map",
                            Cell::from(accelerate.clone()),
                        )
                        .note("sequential mode, budgets of one fifth of the model on GPU 0, GPU 1, CPU"),
                );
            }
        }
        rows
    }

    fn checkpoint_rows(&self) -> Vec<Row> {
        const S: &str = "Checkpoint reading (CPU)";
        eprintln!("== bench: checkpoint read");
        let mib: u64 = if self.quick { 256 } else { 1024 };
        let ours = self.criterion(
            "checkpoint_read",
            &[],
            &[("BM_BENCH_CKPT_MIB", mib.to_string())],
        );
        // The bench reads 64 equal F32 tensors of mib MiB in all.
        let bytes = 64 * ((mib << 20) / 64 / 4 * 4);
        let gbps = |id: String| -> Result<f64, String> {
            let ns = lookup(ours.as_ref().map_err(Clone::clone)?, &id)?;
            Ok(bytes as f64 / ns)
        };
        let mut rows = vec![
            Row::new(
                S,
                format!("read a {mib} MiB checkpoint into fresh host buffers"),
                Unit::GigabytesPerSecond,
            )
            .bigmodel(Cell::from(gbps(format!(
                "read_to_host/checkpoint_read_as_{mib}MiB"
            ))))
            .baseline(
                "memcpy of the same bytes into fresh buffers",
                Cell::from(gbps(format!("read_to_host/memcpy_{mib}MiB"))),
            )
            .note("warm page cache; ratio = share of memcpy speed"),
            Row::new(
                S,
                format!("read a {mib} MiB checkpoint into reused buffers"),
                Unit::GigabytesPerSecond,
            )
            .bigmodel(Cell::from(gbps(format!(
                "read_to_host/checkpoint_read_into_reused_{mib}MiB"
            ))))
            .baseline(
                "memcpy into reused buffers",
                Cell::from(gbps(format!("read_to_host/memcpy_reused_{mib}MiB"))),
            )
            .note("the copy alone, no page faults of new allocations"),
        ];
        let open = ours
            .as_ref()
            .map_err(Clone::clone)
            .and_then(|m| lookup(m, "inspect/open_sparse_64GiB_2048_tensors"))
            .map(|ns| ns * 1e-9);
        let python = self.sparse.clone().and_then(|path| {
            let v = self.baseline(&["inspect", &path.to_string_lossy(), "--repeats", "20"])?;
            v["seconds"]
                .as_f64()
                .ok_or_else(|| "not available: no seconds in the baseline's answer".to_string())
        });
        rows.push(
            Row::new(
                S,
                "open a sparse 64 GiB checkpoint (2048 tensors), in-process",
                Unit::Seconds,
            )
            .bigmodel(Cell::from(open))
            .baseline(
                "safetensors safe_open listing every name, dtype, shape",
                Cell::from(python),
            )
            .note("headers only: the file is sparse; median"),
        );
        rows
    }

    fn inspect_rows(&self) -> Vec<Row> {
        const S: &str = "`bigmodel inspect` (CPU, whole process)";
        eprintln!("== bench: inspect");
        let runs = if self.quick { 5 } else { 11 };
        let mut files = vec![(
            "sparse 64 GiB checkpoint, 2048 tensors".to_string(),
            self.sparse.clone(),
        )];
        files.push(match &self.model {
            Ok((dir, bytes)) => (
                format!("real {:.0} MB Llama checkpoint", *bytes as f64 / 1e6),
                Ok(dir.join("model.safetensors")),
            ),
            Err(e) => ("real Llama checkpoint".into(), Err(e.clone())),
        });
        let mut rows = Vec::new();
        for (label, file) in files {
            let ours = file.clone().and_then(|f| {
                let cli = self.cli()?;
                let mut answer = Value::Null;
                let wall = median_wall(runs, || {
                    let out = capture(
                        Command::new(cli).arg("inspect").arg(&f).arg("--json"),
                        COMMAND_LIMIT,
                    )?;
                    answer = serde_json::from_str(out.stdout.trim())
                        .map_err(|e| format!("not available: bigmodel inspect --json: {e}"))?;
                    Ok(())
                })?;
                Ok((wall, answer))
            });
            let theirs = file.clone().and_then(|f| {
                let python = self.python()?;
                let script = self.layout.tool("bench_accelerate.py");
                let mut answer = Value::Null;
                let wall = median_wall(runs, || {
                    let out = capture(
                        Command::new(python)
                            .arg(&script)
                            .arg("inspect")
                            .arg(&f)
                            .args(["--repeats", "1"]),
                        COMMAND_LIMIT,
                    )?;
                    answer = serde_json::from_str(out.stdout.trim())
                        .map_err(|e| format!("not available: bench_accelerate.py inspect: {e}"))?;
                    Ok(())
                })?;
                Ok((wall, answer))
            });
            let note = match (&ours, &theirs) {
                (Ok((_, a)), Ok((_, b))) => {
                    if a["tensors"] == b["tensors"] && a["total_bytes"] == b["total_bytes"] {
                        format!(
                            "both list {} tensors, {} bytes; median of {runs} runs",
                            a["tensors"], a["total_bytes"]
                        )
                    } else {
                        format!(
                            "DISAGREE: bigmodel {} tensors/{} bytes, Python {} tensors/{} bytes",
                            a["tensors"], a["total_bytes"], b["tensors"], b["total_bytes"]
                        )
                    }
                }
                _ => format!("median of {runs} runs"),
            };
            rows.push(
                Row::new(S, format!("inspect a {label}"), Unit::Seconds)
                    .bigmodel(Cell::from(ours.map(|(w, _)| w)))
                    .baseline(
                        "python + safetensors safe_open listing the same headers",
                        Cell::from(theirs.map(|(w, _)| w)),
                    )
                    .note(format!("{note}; interpreter start-up included, as ours")),
            );
        }
        rows
    }

    /// `bigmodel run` with `map`, median of `runs` runs of each key.
    fn bigmodel_run(
        &self,
        map: &Value,
        tag: &str,
        new_tokens: usize,
        runs: usize,
    ) -> Result<Value, String> {
        let cli = self.cli()?;
        let (dir, _) = self.model.as_ref().map_err(Clone::clone)?;
        let map_file = self.data.join(format!("map-{tag}.json"));
        write_atomic(&map_file, map.to_string().as_bytes())?;
        let offload = self.data.join(format!("offload-bigmodel-{tag}"));
        let mut answers = Vec::new();
        for _ in 0..runs {
            let _ = fs::remove_dir_all(&offload);
            let mut cmd = Command::new(cli);
            cmd.arg("run")
                .arg(dir)
                .args(["--prompt-ids", &self.shape.prompt_ids()])
                .arg("--device-map")
                .arg(&map_file)
                .args(["--max-new-tokens", &new_tokens.to_string(), "--json"]);
            if map_has(map, "disk") {
                cmd.arg("--offload-folder").arg(&offload);
            }
            let out = capture(&mut cmd, COMMAND_LIMIT)?;
            let mut answer = serde_json::from_str::<Value>(out.stdout.trim())
                .map_err(|e| format!("not available: bigmodel run --json: {e}"))?;
            answer["offload_folder_bytes"] = json!(dir_bytes(&offload));
            answers.push(answer);
        }
        let _ = fs::remove_dir_all(&offload);
        Ok(median_fields(&answers))
    }

    /// `bench_accelerate.py load` with `map`, median of `runs` runs.
    fn accelerate_load(
        &self,
        map: &Value,
        tag: &str,
        new_tokens: usize,
        runs: usize,
    ) -> Result<Value, String> {
        self.python()?;
        let (dir, _) = self.model.as_ref().map_err(Clone::clone)?;
        let map_file = self.data.join(format!("map-{tag}.json"));
        write_atomic(&map_file, map.to_string().as_bytes())?;
        let offload = self.data.join(format!("offload-accelerate-{tag}"));
        let mut answers = Vec::new();
        for _ in 0..runs {
            let _ = fs::remove_dir_all(&offload);
            let dir = dir.to_string_lossy();
            let map_file = map_file.to_string_lossy();
            let offload = offload.to_string_lossy();
            let new_tokens = new_tokens.to_string();
            let prompt = self.shape.prompt_ids();
            let mut args = vec![
                "load",
                &dir,
                "--device-map",
                &map_file,
                "--prompt-ids",
                &prompt,
                "--new-tokens",
                &new_tokens,
            ];
            if map_has(map, "disk") {
                args.extend(["--offload-folder", &offload]);
            }
            let mut answer = self.baseline(&args)?;
            answer["offload_folder_bytes"] = json!(dir_bytes(Path::new(offload.as_ref())));
            answers.push(answer);
        }
        let _ = fs::remove_dir_all(&offload);
        Ok(median_fields(&answers))
    }

    fn load_rows(&self) -> Vec<Row> {
        eprintln!("== bench: load + first forward");
        let runs = if self.quick { 1 } else { 3 };
        let new_tokens = 4;
        let map = self
            .shape
            .device_map(json!("cpu"), json!("cpu"), json!("disk"));
        if let Ok((dir, _)) = &self.model {
            // Warm the page cache so neither side pays for the first read.
            let _ = fs::read(dir.join("model.safetensors"));
        }
        let ours = self.bigmodel_run(&map, "cpu-disk", new_tokens, runs);
        let theirs = self.accelerate_load(&map, "cpu-disk", new_tokens, runs);
        let model = match &self.model {
            Ok((_, bytes)) => format!(
                "{}-layer Llama, {:.0} MB F32",
                self.shape.layers,
                *bytes as f64 / 1e6
            ),
            Err(_) => "Llama".into(),
        };
        load_rows_from(&ours, &theirs, &model, runs, new_tokens)
    }

    fn gpu_rows(&self) -> Vec<Row> {
        const S: &str = "GPU";
        let names = [
            (
                "host-to-device ceiling (largest copy, best mode)",
                "pageable copy of the same size",
            ),
            (
                "load to GPU 0, whole model",
                "Accelerate load_checkpoint_and_dispatch, same map",
            ),
            ("load to GPU 0, share of the H2D ceiling", "H2D ceiling"),
            (
                "offloaded forward (half the layers on CPU), streaming rate",
                "Accelerate, same map",
            ),
            (
                "offloaded forward streaming, share of the H2D ceiling",
                "H2D ceiling",
            ),
        ];
        if self.gpus.is_empty() {
            return names
                .iter()
                .map(|(name, baseline)| {
                    Row::new(S, *name, Unit::GigabytesPerSecond)
                        .bigmodel(Cell::Missing(NO_GPU.into()))
                        .baseline(*baseline, Cell::Missing(NO_GPU.into()))
                })
                .collect();
        }
        eprintln!("== bench: GPU");
        let h2d = self
            .criterion("h2d", &["bigmodel/cuda"], &[])
            .and_then(|m| h2d_ceiling(&m));
        let ceiling = h2d.as_ref().map(|c| c.best).map_err(Clone::clone);
        let runs = if self.quick { 1 } else { 3 };
        let model_bytes = self
            .model
            .as_ref()
            .map(|(_, b)| *b as f64)
            .map_err(Clone::clone);
        let resident = self.shape.device_map(json!(0), json!(0), json!(0));
        let load_rate = |r: Result<Value, String>| -> Result<f64, String> {
            let v = r?;
            let s = v["load_seconds"]
                .as_f64()
                .ok_or("not available: no `load_seconds` in the answer")?;
            Ok(model_bytes.clone()? / s / 1e9)
        };
        let our_load = load_rate(self.bigmodel_run(&resident, "gpu", 1, runs));
        let their_load = load_rate(self.accelerate_load(&resident, "gpu", 1, runs));
        let offloaded = self.shape.device_map(json!(0), json!(0), json!("cpu"));
        let stream_rate = |r: Result<Value, String>| -> Result<f64, String> {
            let v = r?;
            let bytes = v["bytes_streamed_per_token"]
                .as_f64()
                .ok_or("not available: no `bytes_streamed_per_token` in the answer")?;
            let s = v["seconds_per_token"]
                .as_f64()
                .ok_or("not available: no `seconds_per_token` in the answer")?;
            Ok(bytes / s / 1e9)
        };
        let our_stream = stream_rate(self.bigmodel_run(&offloaded, "gpu-cpu", 8, runs));
        let their_stream = stream_rate(self.accelerate_load(&offloaded, "gpu-cpu", 8, runs));
        let share =
            |ours: &Result<f64, String>, theirs: &Result<f64, String>| match (theirs, &ceiling) {
                (Ok(t), Ok(c)) => format!(
                    "Accelerate reaches {:.0} % of the ceiling{}",
                    100.0 * t / c,
                    if ours.is_ok() {
                        ""
                    } else {
                        "; bigmodel: not available"
                    }
                ),
                _ => String::new(),
            };
        let h2d_note = match &h2d {
            Ok(c) => format!(
                "{} from {} memory, {}",
                c.label,
                c.mode,
                self.gpus.join("; ")
            ),
            Err(_) => self.gpus.join("; "),
        };
        vec![
            Row::new(S, names[0].0, Unit::GigabytesPerSecond)
                .bigmodel(Cell::from(ceiling.clone()))
                .baseline(
                    names[0].1,
                    Cell::from(h2d.as_ref().map(|c| c.pageable).map_err(Clone::clone)),
                )
                .note(h2d_note),
            Row::new(S, names[1].0, Unit::GigabytesPerSecond)
                .bigmodel(Cell::from(our_load.clone()))
                .baseline(names[1].1, Cell::from(their_load.clone()))
                .note("checkpoint bytes ÷ load_seconds, warm page cache"),
            Row::new(S, names[2].0, Unit::GigabytesPerSecond)
                .bigmodel(Cell::from(our_load.clone()))
                .baseline(names[2].1, Cell::from(ceiling.clone()))
                .note(share(&our_load, &their_load)),
            Row::new(S, names[3].0, Unit::GigabytesPerSecond)
                .bigmodel(Cell::from(our_stream.clone()))
                .baseline(names[3].1, Cell::from(their_stream.clone()))
                .note("bytes_streamed_per_token ÷ seconds_per_token, 8 tokens"),
            Row::new(S, names[4].0, Unit::GigabytesPerSecond)
                .bigmodel(Cell::from(our_stream.clone()))
                .baseline(names[4].1, Cell::from(ceiling.clone()))
                .note(share(&our_stream, &their_stream)),
        ]
    }
}

/// The CPU load rows from the two sides' answers (`bigmodel run --json`
/// keys of the CLI contract; `bench_accelerate.py load` keys).
fn load_rows_from(
    ours: &Result<Value, String>,
    theirs: &Result<Value, String>,
    model: &str,
    runs: usize,
    new_tokens: usize,
) -> Vec<Row> {
    const S: &str = "Load + first forward, CPU + disk offload (CPU)";
    let field = |r: &Result<Value, String>, key: &str| -> Result<f64, String> {
        let v = r.as_ref().map_err(Clone::clone)?;
        v[key]
            .as_f64()
            .ok_or_else(|| format!("not available: no `{key}` in the answer"))
    };
    let sum = |r: &Result<Value, String>| -> Result<f64, String> {
        Ok(field(r, "load_seconds")? + field(r, "first_forward_seconds")?)
    };
    let tokens = match (ours, theirs) {
        (Ok(a), Ok(b)) => {
            let ours = a["generated_ids"]
                .as_array()
                .and_then(|ids| ids.iter().rev().nth(new_tokens - 1))
                .cloned()
                .unwrap_or(Value::Null);
            let agree = if ours.as_f64().is_some() && ours.as_f64() == b["next_token"].as_f64() {
                "agree"
            } else {
                "DISAGREE"
            };
            format!(
                "first generated token: bigmodel {ours}, Accelerate {} ({agree})",
                b["next_token"]
            )
        }
        _ => String::new(),
    };
    let runs_note = format!("{model}; half the layers on disk; median of {runs} run(s)");
    let baseline = "Accelerate load_checkpoint_and_dispatch, same map";
    let offload_note = match (
        field(ours, "offload_folder_bytes"),
        field(theirs, "offload_folder_bytes"),
    ) {
        (Ok(a), Ok(b)) => format!(
            "{runs_note}; offload folder written: bigmodel {}, Accelerate {}",
            Unit::Bytes.format(a),
            Unit::Bytes.format(b)
        ),
        _ => runs_note.clone(),
    };
    vec![
        Row::new(
            S,
            "load (place the weights, prepare the disk offload)",
            Unit::Seconds,
        )
        .bigmodel(Cell::from(field(ours, "load_seconds")))
        .baseline(baseline, Cell::from(field(theirs, "load_seconds")))
        .note(offload_note),
        Row::new(S, "first forward (32-token prompt)", Unit::Seconds)
            .bigmodel(Cell::from(field(ours, "first_forward_seconds")))
            .baseline(baseline, Cell::from(field(theirs, "first_forward_seconds")))
            .note(tokens),
        Row::new(S, "load + first forward", Unit::Seconds)
            .bigmodel(Cell::from(sum(ours)))
            .baseline(baseline, Cell::from(sum(theirs)))
            .note(runs_note),
        Row::new(S, "time per generated token (KV cache)", Unit::Seconds)
            .bigmodel(Cell::from(field(ours, "seconds_per_token")))
            .baseline(baseline, Cell::from(field(theirs, "seconds_per_token")))
            .note(format!("median over {} decode steps", new_tokens - 1)),
        Row::new(S, "peak resident memory (VmHWM)", Unit::Bytes)
            .bigmodel(Cell::from(field(ours, "peak_host_bytes")))
            .baseline(baseline, Cell::from(field(theirs, "peak_host_bytes")))
            .note(match field(theirs, "host_bytes_after_imports") {
                Ok(b) => format!(
                    "the Python process holds {} after importing torch/transformers/accelerate",
                    Unit::Bytes.format(b)
                ),
                Err(_) => String::new(),
            }),
    ]
}

/// The measured host-to-device ceiling of the h2d bench.
struct H2dCeiling {
    best: f64,
    pageable: f64,
    mode: String,
    label: String,
}

/// The best GB/s over modes at the largest size the h2d bench measured on
/// a real GPU (ids `cuda/h2d/<mode>/<size>`), and pageable at that size.
fn h2d_ceiling(results: &BTreeMap<String, f64>) -> Result<H2dCeiling, String> {
    let mut by_size: BTreeMap<u64, Vec<(String, f64)>> = BTreeMap::new();
    for (id, ns) in results {
        let parts: Vec<&str> = id.split('/').collect();
        if let ["cuda", "h2d", mode, size] = parts[..]
            && let Some(bytes) = parse_size(size)
        {
            by_size
                .entry(bytes)
                .or_default()
                .push((mode.to_string(), bytes as f64 / ns));
        }
    }
    let (bytes, modes) = by_size
        .into_iter()
        .next_back()
        .ok_or("not available: the h2d bench measured no CUDA copies")?;
    let (mode, best) = modes
        .iter()
        .cloned()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .ok_or("not available: no h2d modes")?;
    let pageable = modes
        .iter()
        .find(|(m, _)| m == "pageable")
        .map(|(_, v)| *v)
        .ok_or("not available: no pageable h2d figure")?;
    Ok(H2dCeiling {
        best,
        pageable,
        mode,
        label: format!("{} MiB copies", bytes >> 20),
    })
}

/// `64KiB` / `16MiB` → bytes.
fn parse_size(label: &str) -> Option<u64> {
    if let Some(n) = label.strip_suffix("MiB") {
        n.parse::<u64>().ok().map(|n| n << 20)
    } else if let Some(n) = label.strip_suffix("KiB") {
        n.parse::<u64>().ok().map(|n| n << 10)
    } else {
        None
    }
}

fn lookup(results: &BTreeMap<String, f64>, id: &str) -> Result<f64, String> {
    results
        .get(id)
        .copied()
        .ok_or_else(|| format!("not available: the bench reported no `{id}`"))
}

/// Median nanoseconds per benchmark id from criterion's
/// `<dir>/**/new/{benchmark,estimates}.json` written at or after `since`
/// (criterion's `--quick` prints no ids in its bencher lines, so the files
/// are the one source that names every figure).
fn criterion_results(dir: &Path, since: SystemTime) -> BTreeMap<String, f64> {
    let mut found = BTreeMap::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(folder) = pending.pop() {
        let Ok(entries) = fs::read_dir(&folder) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            let in_new = folder.file_name().is_some_and(|n| n == "new");
            if !in_new || path.file_name().is_none_or(|n| n != "benchmark.json") {
                continue;
            }
            let fresh = entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t >= since);
            if !fresh {
                continue;
            }
            let read = |p: &Path| -> Option<Value> {
                serde_json::from_str(&fs::read_to_string(p).ok()?).ok()
            };
            let (Some(benchmark), Some(estimates)) =
                (read(&path), read(&folder.join("estimates.json")))
            else {
                continue;
            };
            if let (Some(id), Some(ns)) = (
                benchmark["full_id"].as_str(),
                estimates["median"]["point_estimate"].as_f64(),
            ) {
                found.insert(id.to_string(), ns);
            }
        }
    }
    found
}

/// Bytes of the files under `dir` (0 when it does not exist).
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            _ => e.metadata().map_or(0, |m| m.len()),
        })
        .sum()
}

fn map_has(map: &Value, device: &str) -> bool {
    map.as_object()
        .is_some_and(|m| m.values().any(|v| v == device))
}

/// The first answer with every numeric field replaced by its median over
/// all answers.
fn median_fields(answers: &[Value]) -> Value {
    let mut merged = answers.first().cloned().unwrap_or(Value::Null);
    if let Some(fields) = merged.as_object_mut() {
        for (key, value) in fields.iter_mut() {
            if value.is_number() {
                let mut all: Vec<f64> = answers.iter().filter_map(|a| a[key].as_f64()).collect();
                let integers = answers.iter().all(|a| a[key].is_i64() || a[key].is_u64());
                match median(&mut all) {
                    // Token ids and byte counts stay integers.
                    Some(m) if integers && m.fract() == 0.0 => *value = json!(m as i64),
                    Some(m) => *value = json!(m),
                    None => {}
                }
            }
        }
    }
    merged
}

fn median(values: &mut [f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    Some(if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    })
}

/// Median wall time of `runs` calls of `work` (after one warm-up call).
fn median_wall(runs: usize, mut work: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
    work()?;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let start = Instant::now();
        work()?;
        times.push(start.elapsed().as_secs_f64());
    }
    median(&mut times).ok_or_else(|| "not available: no runs".into())
}

// ---------------------------------------------------------------------------
// Processes

struct Captured {
    stdout: String,
}

/// Runs `cmd` with a time limit, its stdout captured and its stderr both
/// captured and echoed; fails with "not available: …" and the command's own
/// error line when it exits non-zero.
fn capture(cmd: &mut Command, limit: Duration) -> Result<Captured, String> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let name = Path::new(&program)
        .file_name()
        .map_or(program.clone(), |n| n.to_string_lossy().into_owned());
    let args: Vec<String> = cmd
        .get_args()
        .take(2)
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let what = format!("{name} {}", args.join(" "));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("not available: cannot start {what}: {e}"))?;
    let mut stdout = child.stdout.take().expect("stdout is piped");
    let mut stderr = child.stderr.take().expect("stderr is piped");
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut all = Vec::new();
        let mut buf = [0u8; 8192];
        while let Ok(n) = stderr.read(&mut buf) {
            if n == 0 {
                break;
            }
            let _ = std::io::stderr().write_all(&buf[..n]);
            all.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&all).into_owned()
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Ok(status),
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                break Err(format!(
                    "not available: {what} ran past {} s and was stopped",
                    limit.as_secs()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => break Err(format!("not available: waiting for {what}: {e}")),
        }
    };
    let stdout = out_reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    let status = status?;
    if status.success() {
        Ok(Captured { stdout })
    } else {
        Err(format!(
            "not available: {what} failed ({status}): {}",
            error_line(&stderr)
        ))
    }
}

/// The line of a failed command's stderr that says what went wrong: the
/// first one starting with "error", else the last non-empty one.
fn error_line(stderr: &str) -> String {
    let lines: Vec<&str> = stderr
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let line = lines
        .iter()
        .find(|l| l.to_ascii_lowercase().starts_with("error"))
        .or(lines.last())
        .copied()
        .unwrap_or("no error message");
    let mut s: String = line.chars().take(240).collect();
    if s.len() < line.len() {
        s.push('…');
    }
    s.replace('|', "/")
}

/// Builds the release CLI with the cuda feature (so GPUs are found when
/// present; CUDA is loaded at run time, no toolkit needed). When that build
/// fails it builds without CUDA, so the CPU rows still run, and says why.
fn build_cli(root: &Path, cargo: &str) -> (Result<PathBuf, String>, Option<String>) {
    eprintln!("== bench: building the release bigmodel CLI");
    let build = |features: &[&str]| {
        capture(
            Command::new(cargo)
                .current_dir(root)
                .args(["build", "--release", "-p", "bigmodel-cli"])
                .args(features),
            CARGO_LIMIT,
        )
    };
    let cuda_failure = build(&["--features", "cuda"]).err();
    if let Some(why) = &cuda_failure {
        eprintln!("== bench: the CUDA build of the CLI failed ({why}); building without CUDA");
        if let Err(e) = build(&[]) {
            return (Err(e), cuda_failure);
        }
    }
    let exe = target_dir(root)
        .join("release")
        .join(format!("bigmodel{}", std::env::consts::EXE_SUFFIX));
    if exe.is_file() {
        (Ok(exe), cuda_failure)
    } else {
        let why = format!("not available: {} was not built", exe.display());
        (Err(why), cuda_failure)
    }
}

/// Cargo's target folder.
fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from)
}

/// GPU descriptions from `bigmodel devices --json`, or why there are none.
fn find_gpus(cli: &Path) -> (Vec<String>, String) {
    let answer = capture(Command::new(cli).args(["devices", "--json"]), COMMAND_LIMIT)
        .and_then(|o| serde_json::from_str::<Value>(o.stdout.trim()).map_err(|e| e.to_string()));
    match answer {
        Ok(v) => {
            let gpus: Vec<String> = v["gpus"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|g| g["kind"] == "cuda")
                .map(|g| {
                    format!(
                        "{} ({:.0} GiB)",
                        g["name"].as_str().unwrap_or("GPU"),
                        g["total_bytes"].as_f64().unwrap_or(0.0) / (1u64 << 30) as f64
                    )
                })
                .collect();
            let why = v["cuda_error"]
                .as_str()
                .unwrap_or("no CUDA device")
                .to_string();
            (gpus, why)
        }
        Err(e) => (Vec::new(), format!("unknown: {e}")),
    }
}

/// The baseline interpreter: `BM_BENCH_PYTHON`, else `target/bench-venv`
/// (created and filled from PyPI on first use).
fn baseline_python(layout: &Layout, with_accelerate: bool) -> Result<PathBuf, String> {
    if !with_accelerate {
        return Err(SKIPPED_PYTHON.into());
    }
    let python = match std::env::var_os("BM_BENCH_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => {
            let venv = layout.output().join("bench-venv");
            let python = venv.join("bin").join("python");
            let requirements = layout.tool("requirements-bench.txt");
            eprintln!("== bench: Python baseline in {}", venv.display());
            if !python.exists() {
                crate::run(Command::new("python3").args(["-m", "venv"]).arg(&venv))
                    .map_err(|e| format!("not available: creating the bench venv: {e}"))?;
            }
            crate::run(
                Command::new(&python)
                    .args([
                        "-m",
                        "pip",
                        "install",
                        "--quiet",
                        "--disable-pip-version-check",
                        "-r",
                    ])
                    .arg(&requirements),
            )
            .map_err(|e| format!("not available: installing {}: {e}", requirements.display()))?;
            python
        }
    };
    capture(
        Command::new(&python).args(["-c", "import torch, accelerate, transformers, safetensors"]),
        COMMAND_LIMIT,
    )
    .map_err(|e| format!("{e} (interpreter {})", python.display()))?;
    Ok(python)
}

// ---------------------------------------------------------------------------
// Inputs

/// Writes (once) a Llama-style HF folder with deterministic random F32
/// weights; returns it and its tensor bytes.
fn write_llama(dir: &Path, shape: &LlamaShape) -> Result<(PathBuf, u64), String> {
    let tensors = shape.tensors();
    let data_bytes: u64 = tensors
        .iter()
        .map(|(_, s, _)| 4 * s.iter().product::<usize>() as u64)
        .sum();
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({ "format": "pt" }));
    let mut offset = 0u64;
    for (name, dims, _) in &tensors {
        let len = 4 * dims.iter().product::<usize>() as u64;
        header.insert(
            name.clone(),
            json!({ "dtype": "F32", "shape": dims, "data_offsets": [offset, offset + len] }),
        );
        offset += len;
    }
    let mut header = Value::Object(header).to_string();
    while !header.len().is_multiple_of(8) {
        header.push(' ');
    }
    let file_len = 8 + header.len() as u64 + data_bytes;
    let config = serde_json::to_string_pretty(&shape.config()).unwrap_or_default();

    let weights = dir.join("model.safetensors");
    let config_path = dir.join("config.json");
    let fresh = fs::read_to_string(&config_path).is_ok_and(|c| c == config)
        && fs::metadata(&weights).is_ok_and(|m| m.len() == file_len);
    if fresh {
        return Ok((dir.to_path_buf(), data_bytes));
    }
    eprintln!(
        "== bench: writing a {:.0} MB Llama-style checkpoint to {}",
        data_bytes as f64 / 1e6,
        dir.display()
    );
    // Build beside the final folder and rename, so an interrupted run never
    // leaves a folder that looks complete.
    let partial = dir.with_extension("partial");
    let _ = fs::remove_dir_all(&partial);
    fs::create_dir_all(&partial).map_err(|e| format!("creating {}: {e}", partial.display()))?;
    let write = || -> std::io::Result<()> {
        fs::write(partial.join("config.json"), &config)?;
        let mut f = std::io::BufWriter::with_capacity(
            8 << 20,
            fs::File::create(partial.join("model.safetensors"))?,
        );
        f.write_all(&(header.len() as u64).to_le_bytes())?;
        f.write_all(header.as_bytes())?;
        let mut bytes = Vec::with_capacity(4 << 20);
        for (index, (_, dims, ones)) in tensors.iter().enumerate() {
            let mut left = dims.iter().product::<usize>();
            let mut state =
                0x9E37_79B9_7F4A_7C15u64 ^ (index as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
            while left > 0 {
                let n = left.min(1 << 20);
                bytes.clear();
                for _ in 0..n {
                    let v = if *ones {
                        1.0f32
                    } else {
                        // splitmix64 → uniform in [-0.03, 0.03): std ≈ 0.017,
                        // near transformers' initializer_range of 0.02.
                        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                        let mut z = state;
                        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                        z ^= z >> 31;
                        ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * 0.03
                    };
                    bytes.extend_from_slice(&v.to_le_bytes());
                }
                f.write_all(&bytes)?;
                left -= n;
            }
        }
        f.into_inner().map_err(|e| e.into_error())?.sync_all()
    };
    write().map_err(|e| format!("writing {}: {e}", partial.display()))?;
    let _ = fs::remove_dir_all(dir);
    fs::rename(&partial, dir)
        .map_err(|e| format!("renaming {} to {}: {e}", partial.display(), dir.display()))?;
    Ok((dir.to_path_buf(), data_bytes))
}

/// A sparse 64 GiB safetensors file of 2048 F32 tensors (header only on
/// disk), the shape `benches/benches/checkpoint_read.rs` opens.
fn write_sparse(path: &Path) -> Result<PathBuf, String> {
    const COUNT: u64 = 2048;
    const EACH: u64 = 32 << 20;
    let entries: Vec<String> = (0..COUNT)
        .map(|i| {
            format!(
                r#""model.layers.{i}.weight":{{"dtype":"F32","shape":[{}],"data_offsets":[{},{}]}}"#,
                EACH / 4,
                i * EACH,
                (i + 1) * EACH
            )
        })
        .collect();
    let mut header = format!("{{{}}}", entries.join(","));
    while !header.len().is_multiple_of(8) {
        header.push(' ');
    }
    let len = 8 + header.len() as u64 + COUNT * EACH;
    if fs::metadata(path).is_ok_and(|m| m.len() == len) {
        return Ok(path.to_path_buf());
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    let partial = path.with_extension("partial");
    let write = || -> std::io::Result<()> {
        let mut f = fs::File::create(&partial)?;
        f.write_all(&bytes)?;
        f.set_len(len)?;
        f.sync_all()
    };
    write().map_err(|e| format!("not available: writing {}: {e}", partial.display()))?;
    fs::rename(&partial, path)
        .map_err(|e| format!("not available: renaming to {}: {e}", path.display()))?;
    Ok(path.to_path_buf())
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let partial = path.with_extension("partial");
    fs::write(&partial, bytes).map_err(|e| format!("writing {}: {e}", partial.display()))?;
    fs::rename(&partial, path).map_err(|e| format!("renaming to {}: {e}", path.display()))
}

// ---------------------------------------------------------------------------
// Report

/// The machine, as the report's header states it.
struct Machine {
    cpu: String,
    cores: usize,
    ram_bytes: u64,
    gpu: String,
    os: String,
    date: String,
    commit: String,
}

fn machine(suite: &Suite) -> Machine {
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or("unknown CPU".into(), |(_, v)| v.trim().to_string());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let ram_bytes = fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024);
    let gpu = if suite.gpus.is_empty() {
        format!("no GPU ({})", suite.gpu_absent)
    } else {
        suite.gpus.join("; ")
    };
    let os = format!(
        "{} {}",
        std::env::consts::OS,
        fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
    );
    Machine {
        cpu,
        cores,
        ram_bytes,
        gpu,
        os,
        date: utc_now(),
        commit: suite.layout.commit(),
    }
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SSZ`.
fn utc_now() -> String {
    utc(SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()))
}

/// Seconds since the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ`.
fn utc(secs: u64) -> String {
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
}

fn markdown(suite: &Suite, m: &Machine, rows: &[Row], elapsed: f64) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# bigmodel benchmark report\n");
    let _ = writeln!(s, "- date: {} (commit {})", m.date, m.commit);
    let _ = writeln!(
        s,
        "- machine: {} cores, {:.1} GiB RAM, {}; {}",
        m.cores,
        m.ram_bytes as f64 / (1u64 << 30) as f64,
        m.cpu,
        m.os
    );
    let _ = writeln!(s, "- GPU: {}", m.gpu);
    let _ = writeln!(
        s,
        "- run: `{}`, {:.0} s; Python baseline: {}",
        suite.layout.command_line(suite.quick, suite.python.is_ok()),
        elapsed,
        match &suite.python {
            Ok(p) => p.display().to_string(),
            Err(e) => e.clone(),
        }
    );
    let _ = writeln!(
        s,
        "\nRatio = how many times better bigmodel is than the baseline of the same row, both measured in this \
         run: baseline ÷ bigmodel for times and memory, bigmodel ÷ baseline for throughput (so against memcpy \
         or the H2D ceiling it is a share of it). Criterion figures are medians. Times on a shared machine \
         are noisy; compare ratios, not absolute figures, across machines."
    );
    let mut section = "";
    for row in rows {
        if row.section != section {
            section = row.section;
            let _ = writeln!(s, "\n## {section}\n");
            let _ = writeln!(
                s,
                "| measurement | bigmodel | baseline | baseline figure | ratio | notes |"
            );
            let _ = writeln!(s, "|---|---|---|---|---|---|");
        }
        let ratio = row.ratio().map_or("—".into(), |r| {
            if r >= 100.0 {
                format!("{r:.0}×")
            } else {
                format!("{r:.2}×")
            }
        });
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} |",
            row.name,
            row.bigmodel.format(row.unit),
            row.baseline_name,
            row.baseline.format(row.unit),
            ratio,
            row.note
        );
    }
    s
}

fn report_json(suite: &Suite, m: &Machine, rows: &[Row], elapsed: f64) -> Value {
    let rows: Vec<Value> = rows
        .iter()
        .map(|r| {
            json!({
                "section": r.section,
                "name": r.name,
                "unit": r.unit.name(),
                "bigmodel": r.bigmodel.to_json(),
                "baseline_name": r.baseline_name,
                "baseline": r.baseline.to_json(),
                "ratio": r.ratio(),
                "note": r.note,
            })
        })
        .collect();
    json!({
        "format": "bigmodel-bench-report/1",
        "date": m.date,
        "commit": m.commit,
        "machine": {
            "cpu": m.cpu,
            "cores": m.cores,
            "ram_bytes": m.ram_bytes,
            "gpu": m.gpu,
            "os": m.os,
        },
        "quick": suite.quick,
        "python": suite.python.as_ref().map_or_else(|e| json!({ "missing": e }), |p| json!(p)),
        "seconds": elapsed,
        "ratio_meaning": "times better than the baseline: baseline/bigmodel for s and bytes, bigmodel/baseline for GB/s",
        "rows": rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|a| a.to_string()).collect()
    }

    /// A folder under the system's temp folder, empty, unique to `name`.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("xtask-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn args_of(cmd: &Command) -> Vec<String> {
        cmd.get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn options_parse_prebuilt_in_both_spellings() {
        let o = Options::parse(&strings(&["--prebuilt", "bundle", "--quick"]))
            .unwrap()
            .unwrap();
        assert_eq!(
            o,
            Options {
                quick: true,
                with_accelerate: false,
                prebuilt: Some(PathBuf::from("bundle")),
            }
        );
        let o = Options::parse(&strings(&["--with-accelerate", "--prebuilt=."]))
            .unwrap()
            .unwrap();
        assert_eq!(o.prebuilt, Some(PathBuf::from(".")));
        assert!(o.with_accelerate && !o.quick);
        let o = Options::parse(&[]).unwrap().unwrap();
        assert_eq!(o.prebuilt, None);
    }

    #[test]
    fn options_refuse_prebuilt_without_a_folder() {
        for args in [
            &["--prebuilt"][..],
            &["--prebuilt="],
            &["--prebuilt", "--quick"],
        ] {
            let e = Options::parse(&strings(args)).unwrap_err();
            assert!(
                e.contains("--prebuilt needs a bundle folder"),
                "{args:?}: {e}"
            );
        }
        let e = Options::parse(&strings(&["--prebuild", "x"])).unwrap_err();
        assert!(e.contains("unknown option \"--prebuild\""), "{e}");
    }

    #[test]
    fn a_bundle_must_hold_the_cli() {
        let dir = scratch("not-a-bundle");
        let e = Layout::bundle(&dir).err().unwrap();
        assert!(
            e.contains("not a GPU bundle") && e.contains(gpu::CLI),
            "{e}"
        );
        let e = Layout::bundle(&dir.join("missing")).err().unwrap();
        assert!(e.contains("cannot open the folder"), "{e}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn prebuilt_mode_runs_the_bundle_and_never_cargo() {
        let dir = scratch("bundle");
        fs::create_dir_all(dir.join("bin")).unwrap();
        fs::write(dir.join(gpu::CLI), "").unwrap();
        fs::write(dir.join(gpu::COMMIT), "abc1234\n").unwrap();
        // A relative path works from any folder the commands run in.
        let relative = dir.join("bin").join("..");
        let layout = Layout::bundle(&relative).unwrap();
        let root = fs::canonicalize(&dir).unwrap();
        assert_eq!(layout.root, root);

        let (cli, cuda_failure) = layout.cli();
        assert_eq!(cli.unwrap(), root.join("bin").join("bigmodel"));
        assert!(cuda_failure.is_none());

        let cmd = layout.bench_command("h2d", &["bigmodel/cuda"], true);
        assert_eq!(cmd.get_program(), root.join("benches").join("h2d"));
        assert_eq!(
            args_of(&cmd),
            [
                "--bench",
                "--output-format",
                "bencher",
                "--noplot",
                "--quick"
            ]
        );
        assert_eq!(cmd.get_current_dir(), Some(root.as_path()));
        let envs: Vec<_> = cmd.get_envs().collect();
        let criterion = root.join("target").join("criterion");
        assert!(envs.contains(&(
            std::ffi::OsStr::new("CRITERION_HOME"),
            Some(criterion.as_os_str())
        )));
        assert!(envs.contains(&(std::ffi::OsStr::new("CARGO"), None)));
        assert_eq!(layout.criterion_dir(), criterion);

        assert_eq!(
            layout.tool("bench_accelerate.py"),
            root.join("tools").join("bench_accelerate.py")
        );
        assert_eq!(layout.output(), root.join("target"));
        assert_eq!(layout.commit(), "abc1234");
        assert_eq!(
            layout.command_line(true, false),
            format!("xtask bench --prebuilt {} --quick", root.display())
        );
        fs::remove_file(dir.join(gpu::COMMIT)).unwrap();
        assert_eq!(layout.commit(), "unknown");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn cargo_mode_benches_through_cargo_as_before() {
        let layout = Layout {
            root: PathBuf::from("/ws"),
            cargo: Some("cargo".into()),
        };
        let cmd = layout.bench_command("h2d", &["bigmodel/cuda"], false);
        assert_eq!(cmd.get_program(), "cargo");
        assert_eq!(
            args_of(&cmd),
            [
                "bench",
                "-p",
                "bigmodel-benches",
                "--bench",
                "h2d",
                "--features",
                "bigmodel/cuda",
                "--",
                "--output-format",
                "bencher",
                "--noplot"
            ]
        );
        assert_eq!(cmd.get_envs().count(), 0);
        let plan = layout.bench_command("plan", &[], true);
        assert_eq!(
            args_of(&plan)[5..],
            ["--", "--output-format", "bencher", "--noplot", "--quick"]
        );
        assert_eq!(layout.tool("x.py"), Path::new("/ws/tools/x.py"));
        assert_eq!(
            layout.command_line(true, true),
            "cargo xtask bench --quick --with-accelerate"
        );
    }

    #[test]
    fn the_bundle_ships_every_script_the_baseline_runs() {
        let tools = crate::root().join("tools");
        for script in gpu::BENCH_TOOLS {
            assert!(tools.join(script).is_file(), "tools/{script} is missing");
        }
        // The workspace scripts the baseline imports travel with it.
        let baseline = fs::read_to_string(tools.join("bench_accelerate.py")).unwrap();
        for line in baseline.lines() {
            let Some(module) = line.trim().strip_prefix("import ") else {
                continue;
            };
            let module = module.split([' ', ',']).next().unwrap_or("");
            let script = format!("{module}.py");
            if tools.join(&script).is_file() {
                assert!(
                    gpu::BENCH_TOOLS.contains(&script.as_str()),
                    "bench_accelerate.py imports tools/{script}, which the bundle lacks"
                );
            }
        }
    }

    #[test]
    fn criterion_results_read_fresh_medians_by_full_id() {
        let dir = std::env::temp_dir().join(format!("xtask-bench-test-{}", std::process::id()));
        let write = |sub: &str, id: &str, ns: f64| {
            let new = dir.join(sub).join("new");
            fs::create_dir_all(&new).unwrap();
            fs::write(
                new.join("benchmark.json"),
                json!({ "full_id": id }).to_string(),
            )
            .unwrap();
            let estimates = json!({ "median": { "point_estimate": ns } });
            fs::write(new.join("estimates.json"), estimates.to_string()).unwrap();
        };
        write("plan_100b/auto", "plan/100b/auto", 1234.5);
        write("read_to_host/memcpy", "read_to_host/memcpy", 42e6);
        let since = SystemTime::now() - Duration::from_secs(60);
        let found = criterion_results(&dir, since);
        assert_eq!(found.len(), 2);
        assert_eq!(found["plan/100b/auto"], 1234.5);
        assert_eq!(found["read_to_host/memcpy"], 42e6);
        // Results of an earlier run are not this run's figures.
        let later = SystemTime::now() + Duration::from_secs(60);
        assert!(criterion_results(&dir, later).is_empty());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn ratios_point_the_way_that_favours_bigmodel() {
        let faster = Row::new("s", "t", Unit::Seconds)
            .bigmodel(Cell::Value(0.5))
            .baseline("b", Cell::Value(2.0));
        assert_eq!(faster.ratio(), Some(4.0));
        let share = Row::new("s", "t", Unit::GigabytesPerSecond)
            .bigmodel(Cell::Value(9.0))
            .baseline("b", Cell::Value(10.0));
        assert_eq!(share.ratio(), Some(0.9));
        let missing = Row::new("s", "t", Unit::Bytes).bigmodel(Cell::Value(1.0));
        assert_eq!(missing.ratio(), None);
    }

    #[test]
    fn load_rows_read_the_cli_contract_keys() {
        // `bigmodel run --json` as shared/spec/cli.md lists its keys.
        let ours = Ok(json!({
            "generated_ids": [11, 12, 13, 14],
            "device_map": {"model.embed_tokens": "cpu"},
            "load_seconds": 0.5,
            "first_forward_seconds": 0.25,
            "seconds_per_token": 0.1,
            "bytes_streamed_per_token": 1000,
            "peak_host_bytes": 100.0,
            "offload_folder_bytes": 4096,
        }));
        let theirs = Ok(json!({
            "load_seconds": 2.0,
            "first_forward_seconds": 0.5,
            "seconds_per_token": 0.2,
            "next_token": 11.0,
            "peak_host_bytes": 400.0,
            "offload_folder_bytes": 90 << 20,
            "host_bytes_after_imports": 300.0,
        }));
        let rows = load_rows_from(&ours, &theirs, "m", 1, 4);
        let ratios: Vec<Option<f64>> = rows.iter().map(Row::ratio).collect();
        assert_eq!(
            ratios,
            [Some(4.0), Some(2.0), Some(2.5 / 0.75), Some(2.0), Some(4.0)]
        );
        assert!(rows[1].note.contains("(agree)"), "{}", rows[1].note);
        let offload_note = "bigmodel 4.0 KiB, Accelerate 90 MiB";
        assert!(rows[0].note.contains(offload_note), "{}", rows[0].note);

        let missing: Result<Value, String> = Err("not available: no run".into());
        let rows = load_rows_from(&missing, &theirs, "m", 1, 4);
        assert!(rows.iter().all(|r| r.ratio().is_none()));
        assert!(matches!(&rows[0].bigmodel, Cell::Missing(why) if why == "not available: no run"));
    }

    #[test]
    fn h2d_ceiling_takes_the_best_mode_at_the_largest_size() {
        let mut r = BTreeMap::new();
        // 256 MiB in 10 ms pageable, 5 ms pinned; 1 MiB in 0.01 ms (faster, but smaller).
        r.insert("cuda/h2d/pageable/256MiB".to_string(), 10e6);
        r.insert("cuda/h2d/pinned/256MiB".to_string(), 5e6);
        r.insert("cuda/h2d/pinned/1MiB".to_string(), 1e4);
        r.insert("emulated/h2d/pinned/16MiB".to_string(), 1.0);
        let c = h2d_ceiling(&r).unwrap();
        assert_eq!(c.mode, "pinned");
        assert!((c.best - (256u64 << 20) as f64 / 5e6).abs() < 1e-9);
        assert!((c.pageable - (256u64 << 20) as f64 / 10e6).abs() < 1e-9);
        assert!(h2d_ceiling(&BTreeMap::new()).is_err());
    }

    #[test]
    fn median_fields_takes_the_median_of_numbers_and_keeps_the_rest() {
        let answers = [
            json!({"load_seconds": 3.0, "generated_ids": [5]}),
            json!({"load_seconds": 1.0, "generated_ids": [5]}),
            json!({"load_seconds": 2.0, "generated_ids": [5]}),
        ];
        let m = median_fields(&answers);
        assert_eq!(m["load_seconds"], 2.0);
        let tokens = [json!({"next_token": 7958}), json!({"next_token": 7958})];
        assert!(median_fields(&tokens)["next_token"].is_i64());
        assert_eq!(m["generated_ids"], json!([5]));
    }

    #[test]
    fn civil_dates_come_out_right() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(utc(4_107_542_399), "2100-02-28T23:59:59Z");
    }

    #[test]
    fn device_maps_split_the_layers_in_half() {
        let shape = LlamaShape::for_run(true);
        let map = shape.device_map(json!("cpu"), json!("cpu"), json!("disk"));
        assert_eq!(map["model.layers.1"], "cpu");
        assert_eq!(map["model.layers.2"], "disk");
        assert_eq!(map["lm_head"], "cpu");
        assert!(map_has(&map, "disk"));
        assert_eq!(map.as_object().unwrap().len(), shape.layers + 3);
    }

    #[test]
    fn failed_commands_report_their_error_line() {
        let e = capture(
            Command::new("sh").args([
                "-c",
                "echo noise >&2; echo 'error: no such thing' >&2; exit 3",
            ]),
            Duration::from_secs(10),
        )
        .err()
        .unwrap();
        assert!(e.starts_with("not available:"), "{e}");
        assert!(e.contains("error: no such thing"), "{e}");
    }
}
