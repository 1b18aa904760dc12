//! Where the suite's programs come from and where its files go: the
//! workspace (built and benched by cargo) or a GPU bundle run as it is.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::process::{build_cli, target_dir};
use crate::gpu;

/// Where the suite's programs come from and where its files go: the
/// workspace, built and benched by cargo, or a GPU bundle whose binaries
/// run as they are.
pub(super) struct Layout {
    /// The workspace, or the bundle folder.
    pub(super) root: PathBuf,
    /// The cargo that builds and benches; `None` for a bundle, where cargo
    /// is never invoked.
    pub(super) cargo: Option<String>,
}

impl Layout {
    pub(super) fn workspace(root: &Path) -> Layout {
        Layout {
            root: root.to_path_buf(),
            cargo: Some(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())),
        }
    }

    /// The GPU bundle at `dir` (absolute from here on, since commands run
    /// in other folders); fails when `dir` is not one.
    pub(super) fn bundle(dir: &Path) -> Result<Layout, String> {
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
    pub(super) fn output(&self) -> PathBuf {
        self.root.join("target")
    }

    /// A script of the baseline: the bundle keeps them under the same
    /// folder name as the workspace.
    pub(super) fn tool(&self, script: &str) -> PathBuf {
        self.root.join(gpu::TOOLS).join(script)
    }

    /// Where criterion writes the results of `bench_command`'s runs.
    pub(super) fn criterion_dir(&self) -> PathBuf {
        match self.cargo {
            Some(_) => target_dir(&self.root).join("criterion"),
            None => self.output().join("criterion"),
        }
    }

    /// The command that runs criterion bench `bench`: `cargo bench` with
    /// `features`, or the bundle's binary (built with every CUDA feature).
    pub(super) fn bench_command(&self, bench: &str, features: &[&str], quick: bool) -> Command {
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
    pub(super) fn bench_label(&self, bench: &str) -> String {
        match self.cargo {
            Some(_) => format!("cargo bench --bench {bench}"),
            None => format!("{}/{bench} --bench", gpu::BENCHES),
        }
    }

    /// The release CLI and, when its CUDA build failed, why: built by cargo
    /// (see `build_cli`), or the bundle's.
    pub(super) fn cli(&self) -> (Result<PathBuf, String>, Option<String>) {
        match &self.cargo {
            Some(cargo) => build_cli(&self.root, cargo),
            None => (Ok(self.root.join(gpu::CLI)), None),
        }
    }

    /// The commit measured: the workspace's HEAD, or the one the bundle
    /// was built from.
    pub(super) fn commit(&self) -> String {
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
    pub(super) fn command_line(
        &self,
        quick: bool,
        with_accelerate: bool,
        only: Option<&[String]>,
    ) -> String {
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
        if let Some(sections) = only {
            line.push_str(&format!(" --only {}", sections.join(",")));
        }
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            layout.command_line(true, false, None),
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
            layout.command_line(true, true, Some(&["decode".to_string()])),
            "cargo xtask bench --quick --with-accelerate --only decode"
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
}
