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
           every test of the workspace, with and without the cuda feature,
           then bm-compute's unit tests as aarch64 code under qemu-aarch64
           (NEON kernels) when the cross tools are installed
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
    ))?;
    test_aarch64(&cargo)
}

/// The rustup target, C cross toolchain and user-mode emulator that run
/// bm-compute's tests as aarch64 code, so its NEON kernels are tested on an
/// x86 machine (`.ci/run` installs them from Debian's packages).
const AARCH64_TARGET: &str = "aarch64-unknown-linux-gnu";
const AARCH64_LINKER: &str = "aarch64-linux-gnu-gcc";
const AARCH64_EMULATOR: &str = "qemu-aarch64";

/// bm-compute's unit tests built for aarch64 and run under qemu, where the
/// tools are there; otherwise says what is missing and passes.
fn test_aarch64(cargo: &str) -> Result<(), String> {
    if std::env::consts::ARCH == "aarch64" {
        return Ok(()); // The tests above ran natively.
    }
    let has = |program: &str| {
        Command::new(program)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let target_installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .is_ok_and(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .any(|l| l == AARCH64_TARGET)
        });
    let missing: Vec<&str> = [
        (AARCH64_LINKER, has(AARCH64_LINKER)),
        (AARCH64_EMULATOR, has(AARCH64_EMULATOR)),
        (
            "the rustup target aarch64-unknown-linux-gnu",
            target_installed,
        ),
    ]
    .into_iter()
    .filter(|(_, there)| !there)
    .map(|(what, _)| what)
    .collect();
    if !missing.is_empty() {
        eprintln!(
            "skipped: bm-compute's aarch64 (NEON) tests, for want of {}",
            missing.join(", ")
        );
        return Ok(());
    }
    run(Command::new(cargo)
        .current_dir(root())
        .env(
            "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER",
            AARCH64_LINKER,
        )
        .env(
            "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER",
            format!("{AARCH64_EMULATOR} -L /usr/aarch64-linux-gnu"),
        )
        .args([
            "test",
            "-p",
            "bm-compute",
            "--lib",
            "--target",
            AARCH64_TARGET,
        ]))
}
