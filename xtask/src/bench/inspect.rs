//! The `bigmodel inspect` rows: the whole process against Python listing
//! the same headers.

use std::process::Command;

use serde_json::Value;

use super::Suite;
use super::process::{COMMAND_LIMIT, capture};
use super::report::{Cell, Row, Unit};
use super::stats::median_wall;

impl Suite {
    pub(super) fn inspect_rows(&self) -> Vec<Row> {
        const S: &str = "`bigmodel inspect` (CPU, whole process)";
        eprintln!("== bench: inspect");
        let runs = if self.quick { 5 } else { 11 };
        let mut files = vec![(
            "sparse 64 GiB checkpoint, 2048 tensors".to_string(),
            self.sparse.clone(),
        )];
        files.push(match &self.model {
            Ok((dir, bytes)) => (
                format!("real {:.0} MB Llama checkpoint", *bytes as f64 / 1e6),
                Ok(dir.join("model.safetensors")),
            ),
            Err(e) => ("real Llama checkpoint".into(), Err(e.clone())),
        });
        let mut rows = Vec::new();
        for (label, file) in files {
            let ours = file.clone().and_then(|f| {
                let cli = self.cli()?;
                let mut answer = Value::Null;
                let wall = median_wall(runs, || {
                    let out = capture(
                        Command::new(cli).arg("inspect").arg(&f).arg("--json"),
                        COMMAND_LIMIT,
                    )?;
                    answer = serde_json::from_str(out.stdout.trim())
                        .map_err(|e| format!("not available: bigmodel inspect --json: {e}"))?;
                    Ok(())
                })?;
                Ok((wall, answer))
            });
            let theirs = file.clone().and_then(|f| {
                let python = self.python()?;
                let script = self.layout.tool("bench_accelerate.py");
                let mut answer = Value::Null;
                let wall = median_wall(runs, || {
                    let out = capture(
                        Command::new(python)
                            .arg(&script)
                            .arg("inspect")
                            .arg(&f)
                            .args(["--repeats", "1"]),
                        COMMAND_LIMIT,
                    )?;
                    answer = serde_json::from_str(out.stdout.trim())
                        .map_err(|e| format!("not available: bench_accelerate.py inspect: {e}"))?;
                    Ok(())
                })?;
                Ok((wall, answer))
            });
            let note = match (&ours, &theirs) {
                (Ok((_, a)), Ok((_, b))) => {
                    if a["tensors"] == b["tensors"] && a["total_bytes"] == b["total_bytes"] {
                        format!(
                            "both list {} tensors, {} bytes; median of {runs} runs",
                            a["tensors"], a["total_bytes"]
                        )
                    } else {
                        format!(
                            "DISAGREE: bigmodel {} tensors/{} bytes, Python {} tensors/{} bytes",
                            a["tensors"], a["total_bytes"], b["tensors"], b["total_bytes"]
                        )
                    }
                }
                _ => format!("median of {runs} runs"),
            };
            rows.push(
                Row::new(S, format!("inspect a {label}"), Unit::Seconds)
                    .bigmodel(Cell::from(ours.map(|(w, _)| w)))
                    .baseline(
                        "python + safetensors safe_open listing the same headers",
                        Cell::from(theirs.map(|(w, _)| w)),
                    )
                    .note(format!("{note}; interpreter start-up included, as ours")),
            );
        }
        rows
    }
}
