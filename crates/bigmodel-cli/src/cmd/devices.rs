//! `bigmodel devices`: what this process can use, and why not when CUDA
//! is missing.

use bigmodel::device::{Budgets, CudaStatus, DeviceSet, GpuMemory, HostMemory, LibraryReport};
use bigmodel::plan::human_bytes;
use serde_json::{Map, Value, json};

use super::CmdResult;

/// Arguments of `bigmodel devices`.
#[derive(clap::Args)]
pub struct Args {
    /// Write one JSON document to stdout instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Measure what `plan --calibration` needs (CPU and GPU GEMM, copy and
    /// disk rates); with --json the document `plan --calibration` reads.
    #[arg(long)]
    pub calibrate: bool,
    /// Where the disk read rate is measured (the offload folder's file
    /// system). Default: the system's temporary folder.
    #[arg(long, requires = "calibrate")]
    pub offload_folder: Option<std::path::PathBuf>,
    /// Measure only what this fresh process's first CPU ops pay to start
    /// its compute and print the seconds: what --calibrate runs in a few
    /// fresh processes of itself.
    #[arg(long, hide = true, requires = "calibrate")]
    pub startup_only: bool,
}

/// Runs the command.
pub fn run(args: Args) -> CmdResult {
    if args.startup_only {
        println!("{}", super::calibrate::startup_seconds()?);
        return Ok(());
    }
    if args.calibrate {
        let folder = args.offload_folder.unwrap_or_else(std::env::temp_dir);
        let calibration = super::calibrate::calibrate(&folder)?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&calibration.to_json())?);
        } else {
            print!("{}", calibration_table(&calibration));
        }
        return Ok(());
    }
    let set = DeviceSet::probe();
    let info = set.memory_info()?;
    let budgets = bigmodel::device::default_budgets(&info);
    let libraries = set.cuda_libraries();
    let report = Report {
        cuda: set.cuda_status(),
        libraries: &libraries,
        gpus: &info.gpus,
        host: &info.host,
        budgets: &budgets,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report.to_json())?);
    } else {
        print!("{}", report.to_table());
    }
    Ok(())
}

struct Report<'a> {
    cuda: &'a CudaStatus,
    libraries: &'a [LibraryReport],
    gpus: &'a [GpuMemory],
    host: &'a HostMemory,
    budgets: &'a Budgets,
}

impl Report<'_> {
    fn to_json(&self) -> Value {
        let gpus: Vec<Value> = self
            .gpus
            .iter()
            .map(|g| {
                json!({
                    "device": g.device.to_string(),
                    "kind": g.kind.to_string(),
                    "name": g.name,
                    "total_bytes": g.total,
                    "free_bytes": g.free,
                })
            })
            .collect();
        let mut budgets = Map::new();
        for (g, b) in self.gpus.iter().zip(&self.budgets.gpus) {
            budgets.insert(g.device.to_string(), json!(b));
        }
        budgets.insert("cpu".into(), json!(self.budgets.cpu));
        let mut libraries = Map::new();
        for l in self.libraries {
            libraries.insert(
                l.library.key().into(),
                json!({
                    "path": l.path.as_ref().map(|p| p.display().to_string()),
                    "version": l.version,
                    "error": l.error,
                }),
            );
        }
        json!({
            "cuda_compiled": self.cuda.compiled,
            "cuda_driver_found": self.cuda.driver_found,
            "cuda_driver_version": self.cuda.driver_version.map(|(major, minor)| format!("{major}.{minor}")),
            "cuda_error": self.cuda.error,
            "cuda_libraries": libraries,
            "gpus": gpus,
            "cpu_available_bytes": self.host.available,
            "cpu_available_source": self.host.source.to_string(),
            "cpu_limit_bytes": self.host.limit,
            "default_budgets": budgets,
        })
    }

    fn to_table(&self) -> String {
        let mut out = String::new();
        let compiled = if self.cuda.compiled {
            "compiled in"
        } else {
            "not compiled in (build with --features cuda)"
        };
        out.push_str(&format!("CUDA support: {compiled}\n"));
        let driver = match (self.cuda.driver_found, self.cuda.driver_version) {
            (true, Some((major, minor))) => format!("found (CUDA {major}.{minor})"),
            (true, None) => "found".to_string(),
            (false, _) => "not found".to_string(),
        };
        out.push_str(&format!("CUDA driver:  {driver}\n"));
        if let Some(e) = &self.cuda.error {
            out.push_str(&format!("              {e}\n"));
        }
        if self.cuda.driver_found {
            out.push_str("CUDA libraries:\n");
            for l in self.libraries {
                let what = match (&l.path, &l.error) {
                    (Some(path), _) => format!(
                        "{}  {}",
                        l.version.as_deref().unwrap_or("?"),
                        path.display()
                    ),
                    (None, Some(e)) => e.clone(),
                    (None, None) => "not loaded".into(),
                };
                out.push_str(&format!("  {:<9} {what}\n", l.library.key()));
            }
        }
        if self.gpus.is_empty() {
            out.push_str("GPUs:         none\n");
        } else {
            out.push_str("GPUs:\n");
            for (g, budget) in self.gpus.iter().zip(&self.budgets.gpus) {
                out.push_str(&format!(
                    "  {:>3}  {}  free {} of {}  (default budget {})\n",
                    g.device.to_string(),
                    g.name,
                    human_bytes(g.free),
                    human_bytes(g.total),
                    human_bytes(*budget)
                ));
            }
        }
        out.push_str(&format!(
            "CPU RAM available: {} ({}; limit {}; default budget {})\n",
            human_bytes(self.host.available),
            self.host.source,
            human_bytes(self.host.limit),
            human_bytes(self.budgets.cpu)
        ));
        out
    }
}

/// The calibration for people.
fn calibration_table(c: &bigmodel::plan::Calibration) -> String {
    let mut out = String::new();
    out += &format!(
        "cpu: GEMM {:.1} GFLOP/s, one-row linear {:.2} GB/s, small op {:.1} us, memory read {:.2} GB/s\n",
        c.cpu.gemm_flops / 1e9,
        c.cpu.gemv_bytes_per_second / 1e9,
        c.cpu.op_seconds * 1e6,
        c.cpu.memory_bytes_per_second / 1e9
    );
    if let Some(d) = &c.disk {
        let cold = d.cold_bytes_per_second.map_or(
            "not measured (page cache could not be dropped)".into(),
            |r| format!("{:.2} GB/s", r / 1e9),
        );
        out += &format!(
            "disk: read {cold} cold, {:.2} GB/s warm\n",
            d.warm_bytes_per_second / 1e9
        );
    }
    for g in &c.gpus {
        out += &format!(
            "GPU {}: pinned H2D {:.1} GB/s, pageable H2D {:.1} GB/s, GEMM {}, CUDA context {}\n",
            g.ordinal,
            g.pinned_h2d_bytes_per_second / 1e9,
            g.pageable_h2d_bytes_per_second / 1e9,
            g.gemm_flops.map_or("not measured".into(), |f| format!(
                "{:.1} TFLOP/s",
                f / 1e12
            )),
            bigmodel::plan::human_bytes(g.context_bytes)
        );
    }
    if c.gpus.is_empty() {
        out += "no CUDA GPU: nothing measured on GPUs\n";
    }
    out
}
