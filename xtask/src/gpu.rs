//! `gpu-bundle` and `gpu-test`: everything that must run on a GPU machine,
//! built here and shipped as one folder.
//!
//! The GPU machine has no Rust toolchain and no network, so the bundle
//! holds ready-to-run binaries: every `tests/gpu.rs` and
//! `tests/gpu_compute.rs` integration test of the workspace, every bench,
//! and the `bigmodel` CLI, all built in release mode with the `cuda`
//! feature and stripped; this xtask itself (release, no CUDA needed), so
//! `./xtask bench --prebuilt .` can write the benchmark report there, with
//! the Python scripts of its baseline under `tools/`; the commit it was
//! built from; and `run.sh` (`xtask/src/run.sh`), which runs the tests with
//! `BM_GPU_TESTS=1` (a missing GPU is then a failure, not a skip) and the
//! bench rows inside 8 minutes by default, everything with `--full`, each
//! step under its own time limit, and writes `report.md` (see docs/gpu.md).
//! The folder is then packed into `target/gpu-bundle.tar.gz`, the thing
//! that travels: stripped release binaries compress about 2.5 to 1, and the
//! unpacked folder is over the transfer limit.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What travels to the GPU machine is at most 64 MiB: the checkout's
/// tracked files and the carried archive together.
const TRAVEL_LIMIT_BYTES: u64 = 64 << 20;

/// The archive of the bundle folder, relative to `target/`.
pub const ARCHIVE: &str = "gpu-bundle.tar.gz";

/// The features that turn CUDA on everywhere (bm-device, bm-dispatch, …).
const CUDA_FEATURES: &str = "bigmodel/cuda,bigmodel-cli/cuda";

/// The script that runs the bundle on the GPU machine.
const RUN_SH: &str = include_str!("run.sh");

/// Where the bundle puts things, relative to its folder (`bench --prebuilt`
/// finds them there).
pub const CLI: &str = "bin/bigmodel";
/// The folder of the bench binaries, each named after its bench target.
pub const BENCHES: &str = "benches";
/// The folder of the Python scripts the bench baseline runs.
pub const TOOLS: &str = "tools";
/// The xtask binary.
pub const XTASK: &str = "xtask";
/// A one-line file naming the commit the bundle was built from.
pub const COMMIT: &str = "commit";

/// The files of the workspace's `tools/` that `bench --with-accelerate`
/// needs (bench_accelerate.py imports the planner trees of
/// bench_plan_accelerate.py; the requirements make its venv).
pub const BENCH_TOOLS: [&str; 3] = [
    "bench_accelerate.py",
    "bench_plan_accelerate.py",
    "requirements-bench.txt",
];

/// One executable cargo built, and the name it gets in the bundle.
struct Artifact {
    path: PathBuf,
    name: String,
    /// Cargo's target kinds: "test", "bench", "bin", …
    kinds: Vec<String>,
}

/// Runs `cmd` with `--message-format=json` and returns the executables of
/// the compiler artifacts it reports, named `<package>-<target>`.
fn executables(cmd: &mut Command) -> Result<Vec<Artifact>, String> {
    cmd.arg("--message-format=json-render-diagnostics");
    eprintln!("$ {cmd:?}");
    let out = cmd
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{cmd:?} failed with {}", out.status));
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" {
            continue;
        }
        let Some(exe) = msg["executable"].as_str() else {
            continue;
        };
        let target = msg["target"]["name"].as_str().unwrap_or("unknown");
        // package_id looks like "path+file:///…/crates/bm-device#0.1.0", or
        // "path+file:///…/benches#bigmodel-benches@0.1.0" when the folder
        // and package names differ.
        let tail = msg["package_id"]
            .as_str()
            .and_then(|id| id.rsplit('/').next())
            .unwrap_or("");
        let (folder, fragment) = tail.split_once('#').unwrap_or((tail, ""));
        let package = fragment.split_once('@').map_or(folder, |(name, _)| name);
        // The bench crate's targets keep their own names (h2d, …).
        let name = if package == target || package == "bigmodel-benches" {
            target.to_string()
        } else {
            format!("{package}-{target}")
        };
        let kinds = msg["target"]["kind"]
            .as_array()
            .map(|k| {
                k.iter()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        found.push(Artifact {
            path: PathBuf::from(exe),
            name,
            kinds,
        });
    }
    Ok(found)
}

/// Builds the bundle into `target/gpu-bundle/` and returns its path.
pub fn bundle(root: &Path) -> Result<PathBuf, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // A target folder of its own, so stripped CUDA builds do not evict the
    // everyday release artifacts of the shared target/ folder.
    let build_dir = root.join("target").join("gpu-build");
    let base = |sub: &str| {
        let mut c = Command::new(&cargo);
        c.current_dir(root)
            .arg(sub)
            .arg("--target-dir")
            .arg(&build_dir)
            .env("CARGO_PROFILE_RELEASE_STRIP", "symbols")
            .env("CARGO_PROFILE_RELEASE_DEBUG", "false")
            .env("CARGO_PROFILE_BENCH_STRIP", "symbols")
            .env("CARGO_PROFILE_BENCH_DEBUG", "false");
        c
    };

    let tests = executables(base("test").args([
        "--release",
        "--workspace",
        "--features",
        CUDA_FEATURES,
        "--no-run",
        "--test",
        "gpu",
        "--test",
        "gpu_compute",
    ]))?;
    let benches = executables(base("bench").args([
        "--workspace",
        "--benches",
        "--features",
        CUDA_FEATURES,
        "--no-run",
    ]))?;
    let bins =
        executables(base("build").args(["--release", "-p", "bigmodel-cli", "--features", "cuda"]))?;
    let cli = bins
        .into_iter()
        .find(|a| a.kinds.iter().any(|k| k == "bin") && a.name.ends_with("bigmodel"))
        .ok_or("cargo build reported no bigmodel binary")?;
    // The bench report's driver: plain CPU code, so no cuda feature.
    let xtask = executables(base("build").args(["--release", "-p", "xtask"]))?
        .into_iter()
        .find(|a| a.kinds.iter().any(|k| k == "bin") && a.name == "xtask")
        .ok_or("cargo build reported no xtask binary")?;

    let dir = root.join("target").join("gpu-bundle");
    if dir.exists() {
        fs::remove_dir_all(&dir).map_err(|e| format!("removing {}: {e}", dir.display()))?;
    }
    let mut total = 0u64;
    let mut copy = |from: &Path, to: &str| -> Result<(), String> {
        let to = dir.join(to);
        if let Some(parent) = to.parent() {
            fs::create_dir_all(parent)
                .map_err(|e| format!("creating {}: {e}", parent.display()))?;
        }
        total += fs::copy(from, &to)
            .map_err(|e| format!("copying {} to {}: {e}", from.display(), to.display()))?;
        Ok(())
    };
    if tests.is_empty() {
        return Err("no tests/gpu.rs integration test found in the workspace".into());
    }
    for t in &tests {
        copy(&t.path, &format!("tests/{}", t.name))?;
    }
    // Bench targets only: `cargo bench` also builds library and binary
    // harnesses, which have nothing to run on a GPU.
    for b in benches
        .iter()
        .filter(|b| b.kinds.iter().any(|k| k == "bench"))
    {
        copy(&b.path, &format!("{BENCHES}/{}", b.name))?;
    }
    copy(&cli.path, CLI)?;
    copy(&xtask.path, XTASK)?;
    for script in BENCH_TOOLS {
        copy(
            &root.join("tools").join(script),
            &format!("{TOOLS}/{script}"),
        )?;
    }
    let commit = format!("{}\n", commit(root));
    fs::write(dir.join(COMMIT), &commit)
        .map_err(|e| format!("writing {}: {e}", dir.join(COMMIT).display()))?;
    total += commit.len() as u64;
    let script = dir.join("run.sh");
    fs::write(&script, RUN_SH).map_err(|e| format!("writing {}: {e}", script.display()))?;
    set_executable(&script)?;
    total += RUN_SH.len() as u64;

    let archive = root.join("target").join(ARCHIVE);
    crate::run(Command::new("tar").current_dir(root.join("target")).args([
        "-czf",
        ARCHIVE,
        "gpu-bundle",
    ]))
    .map_err(|e| format!("packing {}: {e}", archive.display()))?;
    let packed = fs::metadata(&archive)
        .map_err(|e| format!("reading {}: {e}", archive.display()))?
        .len();
    let checkout = tracked_bytes(root)?;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "gpu bundle: {} ({} test binaries, {:.1} MiB), packed into {} ({:.1} MiB; with the \
         checkout's {:.1} MiB of tracked files, {:.1} of the {:.0} MiB that travel)",
        dir.display(),
        tests.len(),
        mib(total),
        archive.display(),
        mib(packed),
        mib(checkout),
        mib(packed + checkout),
        mib(TRAVEL_LIMIT_BYTES),
    );
    if packed + checkout > TRAVEL_LIMIT_BYTES {
        return Err(format!(
            "{} ({packed} bytes) and the checkout's tracked files ({checkout} bytes) are over \
             the {TRAVEL_LIMIT_BYTES}-byte limit of what travels to a GPU machine",
            archive.display()
        ));
    }
    Ok(dir)
}

/// The bytes of the files git tracks in the checkout: they travel to the
/// GPU machine beside the carried archive.
fn tracked_bytes(root: &Path) -> Result<u64, String> {
    let out = Command::new("git")
        .current_dir(root)
        .args(["ls-files", "-z"])
        .output()
        .map_err(|e| format!("running git ls-files: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "git ls-files failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(out
        .stdout
        .split(|&b| b == 0)
        .filter(|name| !name.is_empty())
        .filter_map(|name| {
            fs::symlink_metadata(root.join(String::from_utf8_lossy(name).as_ref())).ok()
        })
        .map(|m| m.len())
        .sum())
}

/// The short hash of the workspace's HEAD, "unknown" without git.
pub fn commit(root: &Path) -> String {
    Command::new("git")
        .current_dir(root)
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or("unknown".into(), |o| {
            String::from_utf8_lossy(&o.stdout).trim().to_string()
        })
}

#[cfg(unix)]
fn set_executable(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("chmod {}: {e}", path.display()))
}

#[cfg(not(unix))]
fn set_executable(_path: &Path) -> Result<(), String> {
    Ok(())
}

/// Runs the bundle's `run.sh` here; fails when it does (no GPU included).
pub fn run_bundle(dir: &Path) -> Result<(), String> {
    crate::run(Command::new(dir.join("run.sh")).current_dir(dir))
        .map_err(|e| format!("{e}; see {}", dir.join("report.md").display()))
}
