//! The planner rows: bigmodel's two planners against Accelerate's
//! `infer_auto_device_map`, in process on the trees of
//! `benches/benches/plan.rs`, and as a whole `bigmodel plan` process on the
//! MoE tree's module-tree file against a whole Python process that reads
//! the same file and plans it with Accelerate, and against Accelerate's
//! planner call alone on that tree, timed in process in the same run.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

use super::Suite;
use super::criterion::lookup;
use super::process::{COMMAND_LIMIT, capture};
use super::report::{Cell, Row, Unit};
use super::stats::median_wall;

const S: &str = "Planner (CPU)";
const ACCELERATE: &str = "Accelerate infer_auto_device_map";
const BUDGETS: &str = "sequential mode, budgets of one fifth of the model on GPU 0, GPU 1, CPU";

impl Suite {
    pub(super) fn plan_rows(&self) -> Vec<Row> {
        eprintln!("== bench: planner");
        let ours = self.criterion("plan", &[], &[]);
        let mut args = vec!["plan", "--repeats", if self.quick { "2" } else { "3" }];
        let tree_file = self
            .moe_tree
            .as_ref()
            .map(|(path, _)| path.to_string_lossy());
        if let Ok(path) = &tree_file {
            args.extend(["--moe-tree", path]);
        }
        let theirs = self.baseline(&args);
        let accelerate = |tree: &str| {
            theirs.clone().and_then(|v| {
                v["trees"][tree]["seconds"]
                    .as_f64()
                    .ok_or_else(|| format!("not available: no Accelerate time for {tree}"))
            })
        };
        let mut rows = Vec::new();
        for (tree, label) in [
            (
                "million_tensors",
                "1,000,000 tensors (1000 × 500 Linear(16,16))",
            ),
            (
                "100b_sequential",
                "100B Sequential(1000 × Linear(10000,10000))",
            ),
            (
                "moe_100k",
                "MoE tree, ~99k modules (48 layers × 512 experts)",
            ),
        ] {
            let accelerate = if tree == "million_tensors" {
                Err("not measured: Accelerate takes minutes on this tree".to_string())
            } else {
                accelerate(tree)
            };
            for (planner, what) in [
                ("accelerate_compat", "bigmodel --compat accelerate"),
                ("bigmodel_auto", "bigmodel auto"),
            ] {
                let id = format!("plan/{tree}/{planner}");
                let seconds = ours
                    .as_ref()
                    .map_err(Clone::clone)
                    .and_then(|m| lookup(m, &id))
                    .map(|ns| ns * 1e-9);
                rows.push(
                    Row::new(S, format!("{label}: {what}"), Unit::Seconds)
                        .bigmodel(Cell::from(seconds))
                        .baseline(ACCELERATE, Cell::from(accelerate.clone()))
                        .note(BUDGETS),
                );
            }
        }
        rows.extend(self.plan_process_rows(accelerate("moe_100k")));
        rows
    }

    /// `tools/bench_accelerate.py plan-file` on the MoE tree file, timed as
    /// a whole process (interpreter, imports, reading the file, building the
    /// model, planning): the wall time and the device map it printed.
    fn accelerate_process(&self, path: &Path, budget: u64) -> Result<(f64, Value), String> {
        let python = self.python()?;
        let script = self.layout.tool("bench_accelerate.py");
        let runs = if self.quick { 1 } else { 3 };
        let mut answer = Value::Null;
        let wall = median_wall(runs, || {
            let mut cmd = Command::new(python);
            cmd.arg(&script)
                .arg("plan-file")
                .arg(path)
                .arg("--budget")
                .arg(budget.to_string())
                .current_dir(&self.layout.root);
            let out = capture(&mut cmd, COMMAND_LIMIT)?;
            answer = serde_json::from_str(out.stdout.trim())
                .map_err(|e| format!("not available: bench_accelerate.py plan-file: {e}"))?;
            Ok(())
        })?;
        Ok((wall, answer))
    }

    /// `bigmodel plan TREE.json --json` on the MoE tree file, the whole
    /// process from start to exit: one row next to the whole Accelerate
    /// process on the same file, one next to Accelerate's planner alone
    /// (timed in process on the model built from that file).
    fn plan_process_rows(&self, accelerate_in_process: Result<f64, String>) -> Vec<Row> {
        let runs = if self.quick { 5 } else { 11 };
        let theirs = self.moe_tree.clone().and_then(|(path, bytes)| {
            eprintln!("== bench: Accelerate as a whole process on the MoE tree file");
            self.accelerate_process(&path, bytes / 5)
        });
        let their_map = theirs.as_ref().ok().map(|(_, v)| &v["device_map"]);
        let mut rows = Vec::new();
        for (compat, what) in [
            (Some("accelerate"), "bigmodel --compat accelerate"),
            (None, "bigmodel auto"),
        ] {
            let ours = self.moe_tree.clone().and_then(|(path, bytes)| {
                let cli = self.cli()?;
                let budget = bytes / 5;
                let mut answer = Value::Null;
                let wall = median_wall(runs, || {
                    let mut cmd = Command::new(cli);
                    cmd.arg("plan")
                        .arg(&path)
                        .arg("--max-memory")
                        .arg(format!("0={budget},1={budget},cpu={budget}"))
                        .args(["--mode", "sequential", "--json"]);
                    if let Some(compat) = compat {
                        cmd.args(["--compat", compat]);
                    }
                    let out = capture(&mut cmd, COMMAND_LIMIT)?;
                    answer = serde_json::from_str(out.stdout.trim())
                        .map_err(|e| format!("not available: bigmodel plan --json: {e}"))?;
                    Ok(())
                })?;
                Ok((wall, answer))
            });
            let mut note = format!("{BUDGETS}; bigmodel: median of {runs} processes");
            if let (Some(_), Ok((_, answer)), Some(theirs)) = (compat, &ours, their_map) {
                note.push_str(if same_entries(&answer["device_map"], theirs) {
                    "; the device maps agree"
                } else {
                    "; the device maps DISAGREE"
                });
            }
            let size = match &self.moe_tree {
                Ok((path, _)) => std::fs::metadata(path).map_or(String::new(), |m| {
                    format!(", {:.1} MB", m.len() as f64 / 1e6)
                }),
                Err(_) => String::new(),
            };
            let wall = ours.map(|(wall, _)| wall);
            let name = format!(
                "MoE tree file (98,738 modules{size}), whole `bigmodel plan --json` process: {what}"
            );
            rows.push(
                Row::new(S, name.clone(), Unit::Seconds)
                    .bigmodel(Cell::from(wall.clone()))
                    .baseline(
                        "Accelerate, whole Python process on the same file (read, build, plan)",
                        Cell::from(theirs.as_ref().map(|(wall, _)| *wall).map_err(Clone::clone)),
                    )
                    .note(note.clone()),
            );
            // The target of issue 11: our whole process against their
            // planner call alone, both timed in this run.
            rows.push(
                Row::new(S, name, Unit::Seconds)
                    .bigmodel(Cell::from(wall))
                    .baseline(
                        "Accelerate's infer_auto_device_map alone, in process, on the model built from the same file",
                        Cell::from(accelerate_in_process.clone()),
                    )
                    .note(note),
            );
        }
        rows
    }
}

/// Whether two JSON objects hold the same entries in the same order.
fn same_entries(a: &Value, b: &Value) -> bool {
    match (a.as_object(), b.as_object()) {
        (Some(a), Some(b)) => a.len() == b.len() && a.iter().eq(b.iter()),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn device_maps_agree_only_entry_for_entry_in_order() {
        let a = json!({"a": 0, "b": "cpu"});
        assert!(same_entries(&a, &json!({"a": 0, "b": "cpu"})));
        assert!(!same_entries(&a, &json!({"b": "cpu", "a": 0})));
        assert!(!same_entries(&a, &json!({"a": 0, "b": "disk"})));
        assert!(!same_entries(&a, &json!({"a": 0})));
        assert!(!same_entries(&a, &json!(null)));
    }
}
