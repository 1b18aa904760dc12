//! `cargo xtask bench [--quick] [--with-accelerate] [--prebuilt DIR] [--only SECTIONS]`: the
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

mod baseline;
mod checkpoint;
mod criterion;
mod data_path;
mod date;
mod decode;
mod gpu_rows;
mod inputs;
mod inspect;
mod layout;
mod llama;
mod load;
mod options;
mod planner;
mod prediction;
mod process;
mod report;
mod stats;

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub use options::Options;

use baseline::baseline_python;
use gpu_rows::find_gpus;
use inputs::{write_atomic, write_moe_tree, write_sparse};
use layout::Layout;
use llama::{LlamaShape, write_llama};
use report::{machine, markdown, report_json};

/// Everything the rows share: where things are, what is available.
struct Suite {
    layout: Layout,
    quick: bool,
    /// The sections asked for (`--only`); `None` for all.
    only: Option<Vec<String>>,
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
    /// The MoE tree of the planner bench as a module-tree file, and the
    /// bytes of its tensors.
    moe_tree: Result<(PathBuf, u64), String>,
}

/// The rows of one section of the report.
type Section = fn(&Suite) -> Vec<report::Row>;

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
    let moe_tree = write_moe_tree(&data.join("moe-tree.json"));
    let suite = Suite {
        layout,
        quick: options.quick,
        only: options.only.clone(),
        data,
        cli,
        python,
        gpus,
        gpu_absent,
        model,
        shape,
        sparse,
        moe_tree,
    };

    let mut rows = Vec::new();
    let sections: [(&str, Section); 8] = [
        ("plan", Suite::plan_rows),
        ("checkpoint", Suite::checkpoint_rows),
        ("inspect", Suite::inspect_rows),
        ("load", Suite::load_rows),
        ("prediction", Suite::prediction_rows),
        ("data-path", Suite::data_path_rows),
        ("gpu", Suite::gpu_rows),
        ("decode", Suite::decode_rows),
    ];
    for (name, section) in sections {
        if options.runs(name) {
            rows.extend(section(&suite));
        }
    }

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

impl Suite {
    fn cli(&self) -> Result<&Path, String> {
        self.cli.as_deref().map_err(Clone::clone)
    }
}
