//! The Python baseline: its interpreter (`BM_BENCH_PYTHON`, else a venv
//! made from `tools/requirements-bench.txt`) and `tools/bench_accelerate.py`.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use super::Suite;
use super::layout::Layout;
use super::process::{COMMAND_LIMIT, capture};
use crate::python;

pub(super) const SKIPPED_PYTHON: &str = "skipped: run with --with-accelerate";

impl Suite {
    pub(super) fn python(&self) -> Result<&Path, String> {
        self.python.as_deref().map_err(Clone::clone)
    }

    /// Runs `tools/bench_accelerate.py ARGS` and parses its JSON.
    pub(super) fn baseline(&self, args: &[&str]) -> Result<Value, String> {
        self.baseline_with_env(args, &[])
    }

    /// [`Suite::baseline`] with the environment variables `env` set.
    pub(super) fn baseline_with_env(
        &self,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Value, String> {
        let python = self.python()?;
        let script = self.layout.tool("bench_accelerate.py");
        let mut cmd = Command::new(python);
        cmd.arg(&script)
            .args(args)
            .envs(env.iter().copied())
            .current_dir(&self.layout.root);
        let out = capture(&mut cmd, COMMAND_LIMIT)?;
        serde_json::from_str(out.stdout.trim()).map_err(|e| {
            format!(
                "not available: bench_accelerate.py {}: bad JSON ({e})",
                args[0]
            )
        })
    }
}

/// The baseline interpreter: `BM_BENCH_PYTHON`, else `target/bench-venv`
/// (created and filled from PyPI on first use).
pub(super) fn baseline_python(layout: &Layout, with_accelerate: bool) -> Result<PathBuf, String> {
    if !with_accelerate {
        return Err(SKIPPED_PYTHON.into());
    }
    let python = match std::env::var_os("BM_BENCH_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => {
            let venv = layout.output().join("bench-venv");
            let requirements = layout.tool("requirements-bench.txt");
            eprintln!("== bench: Python baseline in {}", venv.display());
            let install = [OsStr::new("-r"), requirements.as_os_str()];
            python::venv(&venv, &install).map_err(|e| {
                format!(
                    "not available: making {} from {}: {e}",
                    venv.display(),
                    requirements.display()
                )
            })?
        }
    };
    capture(
        Command::new(&python).args(["-c", "import torch, accelerate, transformers, safetensors"]),
        COMMAND_LIMIT,
    )
    .map_err(|e| format!("{e} (interpreter {})", python.display()))?;
    Ok(python)
}
