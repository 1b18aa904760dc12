//! `cargo xtask`: project automation that is easier to write in Rust than in
//! shell (the rust-analyzer pattern). Run `cargo xtask help`.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

mod bench;
mod gpu;
mod python;

const HELP: &str = "\
cargo xtask <task>

tasks:
  test     set up the Python interop environment (.venv, from PyPI) and run
           every test of the workspace, with and without the cuda feature
  gpu-bundle  build the GPU integration tests, the benches and the CLI
           (release, stripped, cuda feature) and this xtask into
           target/gpu-bundle/ with a run.sh that runs the tests and the
           bench rows (--full: every bench and the bench report) under
           time limits and writes report.md (< 64 MiB; docs/gpu.md)
  gpu-test build the bundle and run it here; fails when no GPU is present
  bench [--quick] [--with-accelerate] [--prebuilt DIR] [--only SECTIONS]
           run the benchmark suite and write target/bench-report.md and .json:
           every figure next to its baseline from the same run (memcpy, Python
           safetensors, Accelerate with --with-accelerate, the H2D ceiling on a
           GPU); BM_BENCH_PYTHON=/path/to/python reuses an interpreter instead
           of creating target/bench-venv; --prebuilt runs a GPU bundle's
           binaries without cargo; --only runs some sections (plan, checkpoint,
           inspect, load, prediction, data-path, gpu, decode); `cargo xtask bench --help`
           for more
  help     this text
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let task = args.first().map(String::as_str).unwrap_or("help");
    let result = match task {
        "test" => test(),
        "gpu-bundle" => gpu::bundle(&root()).map(|_| ()),
        "gpu-test" => gpu::bundle(&root()).and_then(|dir| gpu::run_bundle(&dir)),
        "bench" => bench::Options::parse(&args[1..])
            .and_then(|options| options.map_or(Ok(()), |o| bench::run(&root(), o))),
        "help" | "--help" | "-h" => {
            print!("{HELP}");
            Ok(())
        }
        other => Err(format!("unknown xtask {other:?}; run `cargo xtask help`")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root (the parent of this crate's folder).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// Runs `cmd`, failing with its description when it exits non-zero.
fn run(cmd: &mut Command) -> Result<(), String> {
    eprintln!("$ {cmd:?}");
    let status = cmd.status().map_err(|e| format!("{cmd:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed with {status}"))
    }
}

fn test() -> Result<(), String> {
    let env = python::prepare(&root())?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let vars = env.vars()?;
    let with_env = |cmd: &mut Command| -> Command {
        let mut c = std::mem::replace(cmd, Command::new(""));
        for (k, v) in &vars {
            c.env(k, v);
        }
        c
    };
    // Without CUDA support compiled in, then with it (the CLI's default).
    run(&mut with_env(
        Command::new(&cargo).current_dir(root()).args([
            "test",
            "--workspace",
            "--no-default-features",
        ]),
    ))?;
    run(&mut with_env(
        Command::new(&cargo)
            .current_dir(root())
            .args(["test", "--workspace"]),
    ))
}
