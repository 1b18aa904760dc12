//! The GPU rows: the measured host-to-device ceiling, loads to a GPU and
//! offloaded streaming against Accelerate and against that ceiling.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};

use super::Suite;
use super::load::Loader;
use super::process::{COMMAND_LIMIT, capture};
use super::report::{Cell, Row, Unit};

pub(super) const NO_GPU: &str = "no GPU: not measured";

impl Suite {
    pub(super) fn gpu_rows(&self) -> Vec<Row> {
        const S: &str = "GPU";
        let names = [
            (
                "host-to-device ceiling (largest copy, best mode)",
                "pageable copy of the same size",
            ),
            (
                "load to GPU 0, whole model",
                "Accelerate load_checkpoint_and_dispatch, same map",
            ),
            ("load to GPU 0, share of the H2D ceiling", "H2D ceiling"),
            (
                "offloaded forward (half the layers on CPU), streaming rate",
                "Accelerate, same map",
            ),
            (
                "offloaded forward streaming, share of the H2D ceiling",
                "H2D ceiling",
            ),
        ];
        if self.gpus.is_empty() {
            return names
                .iter()
                .map(|(name, baseline)| {
                    Row::new(S, *name, Unit::GigabytesPerSecond)
                        .bigmodel(Cell::Missing(NO_GPU.into()))
                        .baseline(*baseline, Cell::Missing(NO_GPU.into()))
                })
                .collect();
        }
        eprintln!("== bench: GPU");
        let h2d = self
            .criterion("h2d", &["bigmodel/cuda"], &[])
            .and_then(|m| h2d_ceiling(&m));
        let ceiling = h2d.as_ref().map(|c| c.best).map_err(Clone::clone);
        let runs = if self.quick { 1 } else { 3 };
        let model_bytes = self
            .model
            .as_ref()
            .map(|(_, b)| *b as f64)
            .map_err(Clone::clone);
        let resident = self.shape.device_map(json!(0), json!(0), json!(0));
        let load_rate = |r: Result<Value, String>| -> Result<f64, String> {
            let v = r?;
            let s = v["load_seconds"]
                .as_f64()
                .ok_or("not available: no `load_seconds` in the answer")?;
            Ok(model_bytes.clone()? / s / 1e9)
        };
        let our_load = load_rate(self.load_runs(Loader::Bigmodel, &resident, "gpu", 1, runs));
        let their_load = load_rate(self.load_runs(Loader::Accelerate, &resident, "gpu", 1, runs));
        let offloaded = self.shape.device_map(json!(0), json!(0), json!("cpu"));
        let stream_rate = |r: Result<Value, String>| -> Result<f64, String> {
            let v = r?;
            let bytes = v["bytes_streamed_per_token"]
                .as_f64()
                .ok_or("not available: no `bytes_streamed_per_token` in the answer")?;
            let s = v["seconds_per_token"]
                .as_f64()
                .ok_or("not available: no `seconds_per_token` in the answer")?;
            Ok(bytes / s / 1e9)
        };
        let our_stream =
            stream_rate(self.load_runs(Loader::Bigmodel, &offloaded, "gpu-cpu", 8, runs));
        let their_stream =
            stream_rate(self.load_runs(Loader::Accelerate, &offloaded, "gpu-cpu", 8, runs));
        let share =
            |ours: &Result<f64, String>, theirs: &Result<f64, String>| match (theirs, &ceiling) {
                (Ok(t), Ok(c)) => format!(
                    "Accelerate reaches {:.0} % of the ceiling{}",
                    100.0 * t / c,
                    if ours.is_ok() {
                        ""
                    } else {
                        "; bigmodel: not available"
                    }
                ),
                _ => String::new(),
            };
        let h2d_note = match &h2d {
            Ok(c) => format!(
                "{} from {} memory, {}",
                c.label,
                c.mode,
                self.gpus.join("; ")
            ),
            Err(_) => self.gpus.join("; "),
        };
        vec![
            Row::new(S, names[0].0, Unit::GigabytesPerSecond)
                .bigmodel(Cell::from(ceiling.clone()))
                .baseline(
                    names[0].1,
                    Cell::from(h2d.as_ref().map(|c| c.pageable).map_err(Clone::clone)),
                )
                .note(h2d_note),
            Row::new(S, names[1].0, Unit::GigabytesPerSecond)
                .bigmodel(Cell::from(our_load.clone()))
                .baseline(names[1].1, Cell::from(their_load.clone()))
                .note("checkpoint bytes ÷ load_seconds, warm page cache"),
            Row::new(S, names[2].0, Unit::GigabytesPerSecond)
                .bigmodel(Cell::from(our_load.clone()))
                .baseline(names[2].1, Cell::from(ceiling.clone()))
                .note(share(&our_load, &their_load)),
            Row::new(S, names[3].0, Unit::GigabytesPerSecond)
                .bigmodel(Cell::from(our_stream.clone()))
                .baseline(names[3].1, Cell::from(their_stream.clone()))
                .note("bytes_streamed_per_token ÷ seconds_per_token, 8 tokens"),
            Row::new(S, names[4].0, Unit::GigabytesPerSecond)
                .bigmodel(Cell::from(our_stream.clone()))
                .baseline(names[4].1, Cell::from(ceiling.clone()))
                .note(share(&our_stream, &their_stream)),
        ]
    }
}

/// The measured host-to-device ceiling of the h2d bench.
pub(super) struct H2dCeiling {
    pub(super) best: f64,
    pub(super) pageable: f64,
    pub(super) mode: String,
    pub(super) label: String,
}

/// The best GB/s over modes at the largest size the h2d bench measured on
/// a real GPU (ids `cuda/h2d/<mode>/<size>`), and pageable at that size.
pub(super) fn h2d_ceiling(results: &BTreeMap<String, f64>) -> Result<H2dCeiling, String> {
    let mut by_size: BTreeMap<u64, Vec<(String, f64)>> = BTreeMap::new();
    for (id, ns) in results {
        let parts: Vec<&str> = id.split('/').collect();
        if let ["cuda", "h2d", mode, size] = parts[..]
            && let Some(bytes) = parse_size(size)
        {
            by_size
                .entry(bytes)
                .or_default()
                .push((mode.to_string(), bytes as f64 / ns));
        }
    }
    let (bytes, modes) = by_size
        .into_iter()
        .next_back()
        .ok_or("not available: the h2d bench measured no CUDA copies")?;
    let (mode, best) = modes
        .iter()
        .cloned()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .ok_or("not available: no h2d modes")?;
    let pageable = modes
        .iter()
        .find(|(m, _)| m == "pageable")
        .map(|(_, v)| *v)
        .ok_or("not available: no pageable h2d figure")?;
    Ok(H2dCeiling {
        best,
        pageable,
        mode,
        label: format!("{} MiB copies", bytes >> 20),
    })
}

/// `64KiB` / `16MiB` → bytes.
pub(super) fn parse_size(label: &str) -> Option<u64> {
    if let Some(n) = label.strip_suffix("MiB") {
        n.parse::<u64>().ok().map(|n| n << 20)
    } else if let Some(n) = label.strip_suffix("KiB") {
        n.parse::<u64>().ok().map(|n| n << 10)
    } else {
        None
    }
}

/// GPU descriptions from `bigmodel devices --json`, or why there are none.
pub(super) fn find_gpus(cli: &Path) -> (Vec<String>, String) {
    let answer = capture(Command::new(cli).args(["devices", "--json"]), COMMAND_LIMIT)
        .and_then(|o| serde_json::from_str::<Value>(o.stdout.trim()).map_err(|e| e.to_string()));
    match answer {
        Ok(v) => {
            let gpus: Vec<String> = v["gpus"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|g| g["kind"] == "cuda")
                .map(|g| {
                    format!(
                        "{} ({:.0} GiB)",
                        g["name"].as_str().unwrap_or("GPU"),
                        g["total_bytes"].as_f64().unwrap_or(0.0) / (1u64 << 30) as f64
                    )
                })
                .collect();
            let why = v["cuda_error"]
                .as_str()
                .unwrap_or("no CUDA device")
                .to_string();
            (gpus, why)
        }
        Err(e) => (Vec::new(), format!("unknown: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn h2d_ceiling_takes_the_best_mode_at_the_largest_size() {
        let mut r = BTreeMap::new();
        // 256 MiB in 10 ms pageable, 5 ms pinned; 1 MiB in 0.01 ms (faster, but smaller).
        r.insert("cuda/h2d/pageable/256MiB".to_string(), 10e6);
        r.insert("cuda/h2d/pinned/256MiB".to_string(), 5e6);
        r.insert("cuda/h2d/pinned/1MiB".to_string(), 1e4);
        r.insert("emulated/h2d/pinned/16MiB".to_string(), 1.0);
        let c = h2d_ceiling(&r).unwrap();
        assert_eq!(c.mode, "pinned");
        assert!((c.best - (256u64 << 20) as f64 / 5e6).abs() < 1e-9);
        assert!((c.pageable - (256u64 << 20) as f64 / 10e6).abs() < 1e-9);
        assert!(h2d_ceiling(&BTreeMap::new()).is_err());
    }
}
