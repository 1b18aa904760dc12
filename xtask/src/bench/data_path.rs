//! The data-path rows: loading and streaming onto CUDA GPU 0, or onto an
//! emulated GPU where there is none (so the rows exist on every machine),
//! each next to the pinned host-to-device copy of the same run, and
//! cold-disk streaming next to a direct read of the same disk
//! (benches/data_path.rs, which writes its figures to `BM_BENCH_SUMMARY`).

use std::fs;

use serde_json::Value;

use super::Suite;
use super::report::{Cell, Row, Unit};

impl Suite {
    /// The data path of benches/data_path.rs: loading and streaming onto
    /// CUDA GPU 0, or an emulated GPU where there is none (so the rows exist
    /// on every machine), each next to the pinned host-to-device copy of
    /// the same run, and cold-disk streaming next to a direct read of the
    /// disk. The bench writes its figures to `BM_BENCH_SUMMARY`.
    pub(super) fn data_path_rows(&self) -> Vec<Row> {
        eprintln!("== bench: data path");
        let summary_path = self.data.join("data-path-summary.json");
        let _ = fs::remove_file(&summary_path);
        let env = [
            ("BM_BENCH_SUMMARY", summary_path.display().to_string()),
            (
                "BM_BENCH_DATA_DIR",
                self.data.join("data-path-model").display().to_string(),
            ),
        ];
        let summary = self
            .criterion("data_path", &["bigmodel/cuda"], &env)
            .and_then(|_| {
                let text = fs::read_to_string(&summary_path)
                    .map_err(|e| format!("not available: {}: {e}", summary_path.display()))?;
                serde_json::from_str(&text).map_err(|e| {
                    format!("not available: {}: bad JSON ({e})", summary_path.display())
                })
            });
        data_path_rows_from(&summary)
    }
}

/// The data-path rows from the summary benches/data_path.rs writes.
fn data_path_rows_from(summary: &Result<Value, String>) -> Vec<Row> {
    const S: &str = "Data path: load and stream onto GPU 0 (an emulated GPU without one)";
    let field = |path: &[&str]| -> Result<f64, String> {
        let v = summary.as_ref().map_err(Clone::clone)?;
        path.iter()
            .fold(v, |v, key| &v[*key])
            .as_f64()
            .ok_or_else(|| format!("not available: no `{}` in the summary", path.join(".")))
    };
    let ceiling = || Cell::from(field(&["h2d_pinned_gbps"]));
    let pinned = "pinned H2D copy, same run";
    let device = match summary {
        Ok(v) if v["device"] == "cuda" => "CUDA GPU 0".to_string(),
        Ok(_) => "emulated GPU: host memory, each copy a memcpy, host compute".to_string(),
        Err(_) => String::new(),
    };
    let checkpoint = field(&["checkpoint_bytes"])
        .map(|b| {
            format!(
                "{device}; {:.2} GB bf16 checkpoint, warm page cache",
                b / 1e9
            )
        })
        .unwrap_or_else(|_| device.clone());
    let decode = |tier: &str| {
        let layers = field(&["offloaded_layers"]).unwrap_or(0.0);
        match field(&["decode", tier, "tokens_per_second"]) {
            Ok(t) => format!("{device}; {layers} layers streamed per token, {t:.2} tokens/s"),
            Err(_) => device.clone(),
        }
    };
    vec![
        Row::new(
            S,
            "load to GPU 0 as stored (bf16)",
            Unit::GigabytesPerSecond,
        )
        .bigmodel(Cell::from(field(&["load_gbps", "load_bf16"])))
        .baseline(pinned, ceiling())
        .note(checkpoint.clone()),
        Row::new(
            S,
            "load to GPU 0 with a cast (bf16 → F32 on the GPU)",
            Unit::GigabytesPerSecond,
        )
        .bigmodel(Cell::from(field(&["load_gbps", "load_bf16_to_f32"])))
        .baseline(pinned, ceiling())
        .note(checkpoint),
        Row::new(
            S,
            "decode, layers offloaded to CPU RAM: weights streamed",
            Unit::GigabytesPerSecond,
        )
        .bigmodel(Cell::from(field(&[
            "decode",
            "cpu_offload",
            "streamed_gbps",
        ])))
        .baseline(pinned, ceiling())
        .note(decode("cpu_offload")),
        Row::new(
            S,
            "decode, layers offloaded to disk (warm cache): weights streamed",
            Unit::GigabytesPerSecond,
        )
        .bigmodel(Cell::from(field(&[
            "decode",
            "disk_offload",
            "streamed_gbps",
        ])))
        .baseline(pinned, ceiling())
        .note(decode("disk_offload")),
        Row::new(
            S,
            "offloaded layers streamed from a cold disk (reader pool, O_DIRECT)",
            Unit::GigabytesPerSecond,
        )
        .bigmodel(Cell::from(field(&["cold_disk_stream_gbps"])))
        .baseline(
            "one thread reading the same bytes with O_DIRECT (dd iflag=direct)",
            Cell::from(field(&["cold_disk_direct_read_gbps"])),
        )
        .note(match field(&["cold_disk_bytes"]) {
            Ok(b) => format!(
                "{device}; {:.0} MB, the goal is ≥ 80 % of the disk",
                b / 1e6
            ),
            Err(_) => device.clone(),
        }),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn data_path_rows_read_the_bench_summary() {
        let summary = json!({
            "device": "emulated",
            "h2d_pinned_gbps": 10.0,
            "checkpoint_bytes": 2.0e9,
            "load_gbps": {"load_bf16": 9.0, "load_bf16_to_f32": 5.0},
            "decode": {
                "cpu_offload": {"streamed_gbps": 8.0, "tokens_per_second": 3.0},
                "disk_offload": {"streamed_gbps": 4.0, "tokens_per_second": 1.5},
            },
            "offloaded_layers": 20,
            "cold_disk_bytes": 1.0e9,
            "cold_disk_stream_gbps": 1.7,
            "cold_disk_direct_read_gbps": 2.0,
        });
        let rows = data_path_rows_from(&Ok(summary.clone()));
        let ratios: Vec<Option<f64>> = rows.iter().map(Row::ratio).collect();
        assert_eq!(
            ratios,
            [Some(0.9), Some(0.5), Some(0.8), Some(0.4), Some(0.85)]
        );
        assert!(rows[0].note.contains("emulated GPU") && rows[0].note.contains("2.00 GB"));
        assert!(rows[3].note.contains("1.50 tokens/s"), "{}", rows[3].note);
        // Where O_DIRECT was refused the cold row says so, the others stay.
        let mut refused = summary;
        refused["cold_disk_stream_gbps"] = Value::Null;
        let rows = data_path_rows_from(&Ok(refused));
        assert_eq!(rows[4].ratio(), None);
        assert!(
            matches!(&rows[4].bigmodel, Cell::Missing(why) if why.contains("cold_disk_stream_gbps"))
        );
        assert_eq!(rows[0].ratio(), Some(0.9));
        // A bench that failed leaves every row missing with its reason.
        let failed = data_path_rows_from(&Err("not available: boom".into()));
        assert_eq!(failed.len(), 5);
        assert!(
            failed
                .iter()
                .all(|r| matches!(&r.bigmodel, Cell::Missing(w) if w == "not available: boom"))
        );
    }
}
