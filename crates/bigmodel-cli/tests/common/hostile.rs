//! The hostile-input corpora's harness: a case is a command line and what
//! it must give; [`judge`] runs the binary with a time limit and says what
//! is wrong with the outcome (a panic, a hang, a signal, an error that is
//! not one paragraph or lacks a needle).

use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{copy_folder, edit_json};

/// What a case must give.
pub enum Expect {
    /// Success.
    Ok,
    /// A failure whose stderr holds every needle.
    Err(Vec<String>),
    /// Success, or a clear failure: either is right (a bound the model
    /// meets first, which a later version may cap instead).
    Settled,
}

pub struct Case {
    /// What the case is, for failures.
    pub name: &'static str,
    /// The command line.
    pub args: Vec<OsString>,
    /// What it must give.
    pub expect: Expect,
}

/// Runs the binary, killing it after `limit`: (exit code, stdout, stderr).
/// A hang or a signal is a failure of the case.
fn run(args: &[OsString], limit: Duration) -> Result<(i32, String, String), String> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_bigmodel"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    // Drained on threads so a full pipe cannot stall the child.
    let out = std::thread::spawn(move || {
        let mut s = Vec::new();
        stdout.read_to_end(&mut s).map(|_| s)
    });
    let err = std::thread::spawn(move || {
        let mut s = Vec::new();
        stderr.read_to_end(&mut s).map(|_| s)
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            break status;
        }
        if Instant::now() > deadline {
            child.kill().ok();
            child.wait().ok();
            return Err(format!("still running after {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = |h: std::thread::JoinHandle<std::io::Result<Vec<u8>>>| {
        String::from_utf8_lossy(&h.join().unwrap().unwrap()).into_owned()
    };
    let (stdout, stderr) = (text(out), text(err));
    match status.code() {
        Some(code) => Ok((code, stdout, stderr)),
        None => Err(format!("killed by a signal ({status}); stderr: {stderr}")),
    }
}

/// The problem with one case's outcome, if any.
fn judge(case: &Case) -> Option<String> {
    let (code, _, stderr) = match run(&case.args, Duration::from_secs(60)) {
        Ok(outcome) => outcome,
        Err(problem) => return Some(problem),
    };
    for bad in [
        "panicked",
        "memory allocation of",
        "capacity overflow",
        "RUST_BACKTRACE",
    ] {
        if stderr.contains(bad) {
            return Some(format!("stderr shows {bad:?}: {stderr}"));
        }
    }
    match &case.expect {
        Expect::Ok | Expect::Settled if code == 0 => None,
        Expect::Ok => Some(format!("exit {code}: {stderr}")),
        Expect::Err(_) if code == 0 => Some("succeeded".into()),
        Expect::Err(_) | Expect::Settled => {
            // One paragraph: warnings may come first, then one error with
            // no blank line in it.
            let error = stderr.find("error: ").map(|i| &stderr[i..]);
            let Some(error) = error else {
                return Some(format!("no \"error: \" on stderr: {stderr}"));
            };
            if error.trim_end().contains("\n\n") || error[1..].contains("\nerror: ") {
                return Some(format!("not one paragraph: {stderr}"));
            }
            let needles: &[String] = match &case.expect {
                Expect::Err(needles) => needles,
                _ => &[],
            };
            let missing: Vec<&String> = needles.iter().filter(|n| !error.contains(*n)).collect();
            (!missing.is_empty()).then(|| format!("lacks {missing:?}: {stderr}"))
        }
    }
}

/// "name (command line): problem" for every case whose outcome is wrong.
pub fn failures(cases: &[Case]) -> Vec<String> {
    cases
        .iter()
        .filter_map(|case| {
            let line: Vec<_> = case.args.iter().map(|a| a.to_string_lossy()).collect();
            judge(case).map(|problem| format!("{} ({}): {problem}", case.name, line.join(" ")))
        })
        .collect()
}

/// A command line of strings and paths.
pub fn os(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Vec<OsString> {
    args.iter().map(|a| a.as_ref().to_os_string()).collect()
}

/// A failure whose error holds every needle.
pub fn err(needles: &[&str]) -> Expect {
    Expect::Err(needles.iter().map(|n| n.to_string()).collect())
}

/// A copy of a fixture folder with config.json edited by `edit`.
pub fn edited_copy(from: &Path, to: &Path, edit: impl FnOnce(&mut Value)) -> PathBuf {
    copy_folder(from, to);
    edit_json(&to.join("config.json"), edit);
    to.to_path_buf()
}

pub fn write(path: &Path, text: impl AsRef<[u8]>) -> PathBuf {
    std::fs::write(path, text).unwrap();
    path.to_path_buf()
}
