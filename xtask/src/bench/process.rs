//! Running the commands the suite measures: time limits, captured output,
//! the line that says why a command failed, and the release CLI build.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The longest any one command may run (a hung command must not stop the
/// report). Cargo gets longer: it may compile first.
pub(super) const COMMAND_LIMIT: Duration = Duration::from_secs(15 * 60);
pub(super) const CARGO_LIMIT: Duration = Duration::from_secs(45 * 60);

pub(super) struct Captured {
    pub(super) stdout: String,
}

/// Runs `cmd` with a time limit, its stdout captured and its stderr both
/// captured and echoed; fails with "not available: …" and the command's own
/// error line when it exits non-zero.
pub(super) fn capture(cmd: &mut Command, limit: Duration) -> Result<Captured, String> {
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
pub(super) fn error_line(stderr: &str) -> String {
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
pub(super) fn build_cli(root: &Path, cargo: &str) -> (Result<PathBuf, String>, Option<String>) {
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
        // `cuda` is a default feature of the CLI: leave the defaults out.
        if let Err(e) = build(&["--no-default-features"]) {
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
pub(super) fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

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
