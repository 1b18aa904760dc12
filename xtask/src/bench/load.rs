//! The load rows: `bigmodel run` against Accelerate's
//! `load_checkpoint_and_dispatch` with the same device map, CPU and disk.

use std::fs;
use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};

use super::Suite;
use super::inputs::write_atomic;
use super::process::{COMMAND_LIMIT, capture};
use super::report::{Cell, Row, Unit};
use super::stats::median_fields;

/// Who loads the model in the load rows.
#[derive(Clone, Copy)]
pub(super) enum Loader {
    /// `bigmodel run`.
    Bigmodel,
    /// Accelerate's `load_checkpoint_and_dispatch` (`bench_accelerate.py load`).
    Accelerate,
}

impl Loader {
    fn name(self) -> &'static str {
        match self {
            Loader::Bigmodel => "bigmodel",
            Loader::Accelerate => "accelerate",
        }
    }
}

impl Suite {
    /// Loads the model with `map` and generates `new_tokens` tokens `runs`
    /// times, each time in a fresh process with an empty offload folder
    /// (whose bytes it adds as `offload_folder_bytes`): `bigmodel run`, or
    /// `bench_accelerate.py load`. Returns the median of each numeric field.
    pub(super) fn load_runs(
        &self,
        loader: Loader,
        map: &Value,
        tag: &str,
        new_tokens: usize,
        runs: usize,
    ) -> Result<Value, String> {
        let cli = match loader {
            Loader::Bigmodel => Some(self.cli()?),
            Loader::Accelerate => {
                self.python()?;
                None
            }
        };
        let (dir, _) = self.model.as_ref().map_err(Clone::clone)?;
        let tag = format!("{}-{tag}", loader.name());
        let map_file = self.data.join(format!("map-{tag}.json"));
        write_atomic(&map_file, map.to_string().as_bytes())?;
        let offload = self.data.join(format!("offload-{tag}"));
        let offload_arg = map_has(map, "disk").then_some(&offload);
        let prompt = self.shape.prompt_ids();
        let new_tokens = new_tokens.to_string();
        let mut answers = Vec::new();
        for _ in 0..runs {
            let _ = fs::remove_dir_all(&offload);
            let mut answer = match cli {
                Some(cli) => {
                    let mut cmd = Command::new(cli);
                    cmd.arg("run")
                        .arg(dir)
                        .args(["--prompt-ids", &prompt])
                        .arg("--device-map")
                        .arg(&map_file)
                        .args(["--max-new-tokens", &new_tokens, "--json"]);
                    if let Some(offload) = offload_arg {
                        cmd.arg("--offload-folder").arg(offload);
                    }
                    let out = capture(&mut cmd, COMMAND_LIMIT)?;
                    serde_json::from_str::<Value>(out.stdout.trim())
                        .map_err(|e| format!("not available: bigmodel run --json: {e}"))?
                }
                None => {
                    let (dir, map_file) = (dir.to_string_lossy(), map_file.to_string_lossy());
                    let mut args = vec![
                        "load",
                        &dir,
                        "--device-map",
                        &map_file,
                        "--prompt-ids",
                        &prompt,
                        "--new-tokens",
                        &new_tokens,
                    ];
                    let offload = offload_arg.map(|o| o.to_string_lossy());
                    if let Some(offload) = &offload {
                        args.extend(["--offload-folder", offload]);
                    }
                    self.baseline(&args)?
                }
            };
            answer["offload_folder_bytes"] = json!(dir_bytes(&offload));
            answers.push(answer);
        }
        let _ = fs::remove_dir_all(&offload);
        Ok(median_fields(&answers))
    }

    pub(super) fn load_rows(&self) -> Vec<Row> {
        eprintln!("== bench: load + first forward");
        let runs = if self.quick { 1 } else { 3 };
        let new_tokens = 4;
        let map = self
            .shape
            .device_map(json!("cpu"), json!("cpu"), json!("disk"));
        if let Ok((dir, _)) = &self.model {
            // Warm the page cache so neither side pays for the first read.
            let _ = fs::read(dir.join("model.safetensors"));
        }
        let ours = self.load_runs(Loader::Bigmodel, &map, "cpu-disk", new_tokens, runs);
        let theirs = self.load_runs(Loader::Accelerate, &map, "cpu-disk", new_tokens, runs);
        let model = match &self.model {
            Ok((_, bytes)) => format!(
                "{}-layer Llama, {:.0} MB F32",
                self.shape.layers,
                *bytes as f64 / 1e6
            ),
            Err(_) => "Llama".into(),
        };
        load_rows_from(&ours, &theirs, &model, runs, new_tokens)
    }
}

/// The CPU load rows from the two sides' answers (`bigmodel run --json`
/// keys of the CLI contract; `bench_accelerate.py load` keys).
pub(super) fn load_rows_from(
    ours: &Result<Value, String>,
    theirs: &Result<Value, String>,
    model: &str,
    runs: usize,
    new_tokens: usize,
) -> Vec<Row> {
    const S: &str = "Load + first forward, CPU + disk offload (CPU)";
    let field = |r: &Result<Value, String>, key: &str| -> Result<f64, String> {
        let v = r.as_ref().map_err(Clone::clone)?;
        v[key]
            .as_f64()
            .ok_or_else(|| format!("not available: no `{key}` in the answer"))
    };
    let sum = |r: &Result<Value, String>| -> Result<f64, String> {
        Ok(field(r, "load_seconds")? + field(r, "first_forward_seconds")?)
    };
    let tokens = match (ours, theirs) {
        (Ok(a), Ok(b)) => {
            let ours = a["generated_ids"]
                .as_array()
                .and_then(|ids| ids.iter().rev().nth(new_tokens - 1))
                .cloned()
                .unwrap_or(Value::Null);
            let agree = if ours.as_f64().is_some() && ours.as_f64() == b["next_token"].as_f64() {
                "agree"
            } else {
                "DISAGREE"
            };
            format!(
                "first generated token: bigmodel {ours}, Accelerate {} ({agree})",
                b["next_token"]
            )
        }
        _ => String::new(),
    };
    let runs_note = format!("{model}; half the layers on disk; median of {runs} run(s)");
    let baseline = "Accelerate load_checkpoint_and_dispatch, same map";
    let offload_note = match (
        field(ours, "offload_folder_bytes"),
        field(theirs, "offload_folder_bytes"),
    ) {
        (Ok(a), Ok(b)) => format!(
            "{runs_note}; offload folder written: bigmodel {}, Accelerate {}",
            Unit::Bytes.format(a),
            Unit::Bytes.format(b)
        ),
        _ => runs_note.clone(),
    };
    vec![
        Row::new(
            S,
            "load (place the weights, prepare the disk offload)",
            Unit::Seconds,
        )
        .bigmodel(Cell::from(field(ours, "load_seconds")))
        .baseline(baseline, Cell::from(field(theirs, "load_seconds")))
        .note(offload_note),
        Row::new(S, "first forward (32-token prompt)", Unit::Seconds)
            .bigmodel(Cell::from(field(ours, "first_forward_seconds")))
            .baseline(baseline, Cell::from(field(theirs, "first_forward_seconds")))
            .note(tokens),
        Row::new(S, "load + first forward", Unit::Seconds)
            .bigmodel(Cell::from(sum(ours)))
            .baseline(baseline, Cell::from(sum(theirs)))
            .note(runs_note),
        Row::new(S, "time per generated token (KV cache)", Unit::Seconds)
            .bigmodel(Cell::from(field(ours, "seconds_per_token")))
            .baseline(baseline, Cell::from(field(theirs, "seconds_per_token")))
            .note(format!("median over {} decode steps", new_tokens - 1)),
        Row::new(S, "peak resident memory (VmHWM)", Unit::Bytes)
            .bigmodel(Cell::from(field(ours, "peak_host_bytes")))
            .baseline(baseline, Cell::from(field(theirs, "peak_host_bytes")))
            .note(match field(theirs, "host_bytes_after_imports") {
                Ok(b) => format!(
                    "the Python process holds {} after importing torch/transformers/accelerate",
                    Unit::Bytes.format(b)
                ),
                Err(_) => String::new(),
            }),
    ]
}

/// Bytes of the files under `dir` (0 when it does not exist).
pub(super) fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            _ => e.metadata().map_or(0, |m| m.len()),
        })
        .sum()
}

pub(super) fn map_has(map: &Value, device: &str) -> bool {
    map.as_object()
        .is_some_and(|m| m.values().any(|v| v == device))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_rows_read_the_cli_contract_keys() {
        // `bigmodel run --json` as shared/spec/cli.md lists its keys.
        let ours = Ok(json!({
            "generated_ids": [11, 12, 13, 14],
            "device_map": {"model.embed_tokens": "cpu"},
            "load_seconds": 0.5,
            "first_forward_seconds": 0.25,
            "seconds_per_token": 0.1,
            "bytes_streamed_per_token": 1000,
            "peak_host_bytes": 100.0,
            "offload_folder_bytes": 4096,
        }));
        let theirs = Ok(json!({
            "load_seconds": 2.0,
            "first_forward_seconds": 0.5,
            "seconds_per_token": 0.2,
            "next_token": 11.0,
            "peak_host_bytes": 400.0,
            "offload_folder_bytes": 90 << 20,
            "host_bytes_after_imports": 300.0,
        }));
        let rows = load_rows_from(&ours, &theirs, "m", 1, 4);
        let ratios: Vec<Option<f64>> = rows.iter().map(Row::ratio).collect();
        assert_eq!(
            ratios,
            [Some(4.0), Some(2.0), Some(2.5 / 0.75), Some(2.0), Some(4.0)]
        );
        assert!(rows[1].note.contains("(agree)"), "{}", rows[1].note);
        let offload_note = "bigmodel 4.0 KiB, Accelerate 90 MiB";
        assert!(rows[0].note.contains(offload_note), "{}", rows[0].note);

        let missing: Result<Value, String> = Err("not available: no run".into());
        let rows = load_rows_from(&missing, &theirs, "m", 1, 4);
        assert!(rows.iter().all(|r| r.ratio().is_none()));
        assert!(matches!(&rows[0].bigmodel, Cell::Missing(why) if why == "not available: no run"));
    }
}
