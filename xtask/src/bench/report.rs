//! The report: its rows (a figure, its baseline, their ratio) and the
//! Markdown and JSON files made of them.

use std::fmt::Write as _;
use std::fs;

use serde_json::{Value, json};

use super::Suite;
use super::date::utc_now;

/// What a row's figures measure, for formatting and for the ratio's direction.
#[derive(Clone, Copy)]
pub(super) enum Unit {
    /// Lower is better.
    Seconds,
    /// Lower is better.
    Bytes,
    /// Higher is better (10^9 bytes per second).
    GigabytesPerSecond,
}

impl Unit {
    pub(super) fn name(self) -> &'static str {
        match self {
            Unit::Seconds => "s",
            Unit::Bytes => "bytes",
            Unit::GigabytesPerSecond => "GB/s",
        }
    }

    pub(super) fn format(self, v: f64) -> String {
        match self {
            Unit::Seconds if v < 1e-3 => format!("{:.1} µs", v * 1e6),
            Unit::Seconds if v < 1.0 => format!("{:.2} ms", v * 1e3),
            Unit::Seconds => format!("{v:.3} s"),
            Unit::Bytes if v < (1u64 << 20) as f64 => format!("{:.1} KiB", v / 1024.0),
            Unit::Bytes => format!("{:.0} MiB", v / (1u64 << 20) as f64),
            Unit::GigabytesPerSecond => format!("{v:.2} GB/s"),
        }
    }
}

/// One side of a row: a measured value, or why there is none.
pub(super) enum Cell {
    Value(f64),
    Missing(String),
}

impl Cell {
    pub(super) fn from(result: Result<f64, String>) -> Cell {
        result.map_or_else(Cell::Missing, Cell::Value)
    }

    pub(super) fn value(&self) -> Option<f64> {
        match self {
            Cell::Value(v) => Some(*v),
            Cell::Missing(_) => None,
        }
    }

    pub(super) fn to_json(&self) -> Value {
        match self {
            Cell::Value(v) => json!(v),
            Cell::Missing(why) => json!({ "missing": why }),
        }
    }

    pub(super) fn format(&self, unit: Unit) -> String {
        match self {
            Cell::Value(v) => unit.format(*v),
            Cell::Missing(why) => why.clone(),
        }
    }
}

/// One line of the report: bigmodel's figure, its baseline, their ratio.
pub(super) struct Row {
    pub(super) section: &'static str,
    pub(super) name: String,
    pub(super) unit: Unit,
    pub(super) bigmodel: Cell,
    pub(super) baseline_name: String,
    pub(super) baseline: Cell,
    pub(super) note: String,
}

impl Row {
    pub(super) fn new(section: &'static str, name: impl Into<String>, unit: Unit) -> Row {
        Row {
            section,
            name: name.into(),
            unit,
            bigmodel: Cell::Missing("not measured".into()),
            baseline_name: String::new(),
            baseline: Cell::Missing("not measured".into()),
            note: String::new(),
        }
    }

    pub(super) fn bigmodel(mut self, cell: Cell) -> Row {
        self.bigmodel = cell;
        self
    }

    pub(super) fn baseline(mut self, name: impl Into<String>, cell: Cell) -> Row {
        self.baseline_name = name.into();
        self.baseline = cell;
        self
    }

    pub(super) fn note(mut self, note: impl Into<String>) -> Row {
        self.note = note.into();
        self
    }

    /// How many times better bigmodel is than the baseline: baseline ÷
    /// bigmodel for times and memory, bigmodel ÷ baseline for throughput
    /// (then it is also the share of a ceiling).
    pub(super) fn ratio(&self) -> Option<f64> {
        let (ours, theirs) = (self.bigmodel.value()?, self.baseline.value()?);
        let ratio = match self.unit {
            Unit::Seconds | Unit::Bytes => theirs / ours,
            Unit::GigabytesPerSecond => ours / theirs,
        };
        ratio.is_finite().then_some(ratio)
    }
}

/// The machine, as the report's header states it.
pub(super) struct Machine {
    pub(super) cpu: String,
    pub(super) cores: usize,
    pub(super) ram_bytes: u64,
    pub(super) gpu: String,
    pub(super) os: String,
    pub(super) date: String,
    pub(super) commit: String,
}

pub(super) fn machine(suite: &Suite) -> Machine {
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or("unknown CPU".into(), |(_, v)| v.trim().to_string());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let ram_bytes = fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024);
    let gpu = if suite.gpus.is_empty() {
        format!("no GPU ({})", suite.gpu_absent)
    } else {
        suite.gpus.join("; ")
    };
    let os = format!(
        "{} {}",
        std::env::consts::OS,
        fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
    );
    Machine {
        cpu,
        cores,
        ram_bytes,
        gpu,
        os,
        date: utc_now(),
        commit: suite.layout.commit(),
    }
}

pub(super) fn markdown(suite: &Suite, m: &Machine, rows: &[Row], elapsed: f64) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# bigmodel benchmark report\n");
    let _ = writeln!(s, "- date: {} (commit {})", m.date, m.commit);
    let _ = writeln!(
        s,
        "- machine: {} cores, {:.1} GiB RAM, {}; {}",
        m.cores,
        m.ram_bytes as f64 / (1u64 << 30) as f64,
        m.cpu,
        m.os
    );
    let _ = writeln!(s, "- GPU: {}", m.gpu);
    let _ = writeln!(
        s,
        "- run: `{}`, {:.0} s; Python baseline: {}",
        suite
            .layout
            .command_line(suite.quick, suite.python.is_ok(), suite.only.as_deref()),
        elapsed,
        match &suite.python {
            Ok(p) => p.display().to_string(),
            Err(e) => e.clone(),
        }
    );
    let _ = writeln!(
        s,
        "\nRatio = how many times better bigmodel is than the baseline of the same row, both measured in this \
         run: baseline ÷ bigmodel for times and memory, bigmodel ÷ baseline for throughput (so against memcpy \
         or the H2D ceiling it is a share of it). Criterion figures are medians. Times on a shared machine \
         are noisy; compare ratios, not absolute figures, across machines."
    );
    let mut section = "";
    for row in rows {
        if row.section != section {
            section = row.section;
            let _ = writeln!(s, "\n## {section}\n");
            let _ = writeln!(
                s,
                "| measurement | bigmodel | baseline | baseline figure | ratio | notes |"
            );
            let _ = writeln!(s, "|---|---|---|---|---|---|");
        }
        let ratio = row.ratio().map_or("—".into(), |r| {
            if r >= 100.0 {
                format!("{r:.0}×")
            } else {
                format!("{r:.2}×")
            }
        });
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} |",
            row.name,
            row.bigmodel.format(row.unit),
            row.baseline_name,
            row.baseline.format(row.unit),
            ratio,
            row.note
        );
    }
    s
}

pub(super) fn report_json(suite: &Suite, m: &Machine, rows: &[Row], elapsed: f64) -> Value {
    let rows: Vec<Value> = rows
        .iter()
        .map(|r| {
            json!({
                "section": r.section,
                "name": r.name,
                "unit": r.unit.name(),
                "bigmodel": r.bigmodel.to_json(),
                "baseline_name": r.baseline_name,
                "baseline": r.baseline.to_json(),
                "ratio": r.ratio(),
                "note": r.note,
            })
        })
        .collect();
    json!({
        "format": "bigmodel-bench-report/1",
        "date": m.date,
        "commit": m.commit,
        "machine": {
            "cpu": m.cpu,
            "cores": m.cores,
            "ram_bytes": m.ram_bytes,
            "gpu": m.gpu,
            "os": m.os,
        },
        "quick": suite.quick,
        "python": suite.python.as_ref().map_or_else(|e| json!({ "missing": e }), |p| json!(p)),
        "seconds": elapsed,
        "ratio_meaning": "times better than the baseline: baseline/bigmodel for s and bytes, bigmodel/baseline for GB/s",
        "rows": rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_point_the_way_that_favours_bigmodel() {
        let faster = Row::new("s", "t", Unit::Seconds)
            .bigmodel(Cell::Value(0.5))
            .baseline("b", Cell::Value(2.0));
        assert_eq!(faster.ratio(), Some(4.0));
        let share = Row::new("s", "t", Unit::GigabytesPerSecond)
            .bigmodel(Cell::Value(9.0))
            .baseline("b", Cell::Value(10.0));
        assert_eq!(share.ratio(), Some(0.9));
        let missing = Row::new("s", "t", Unit::Bytes).bigmodel(Cell::Value(1.0));
        assert_eq!(missing.ratio(), None);
    }
}
