//! Criterion results: running one bench of `benches/` and reading the
//! medians it wrote.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::time::{Duration, SystemTime};

use serde_json::Value;

use super::Suite;
use super::process::{CARGO_LIMIT, capture};

impl Suite {
    /// Runs one criterion bench of `benches/`; returns median nanoseconds
    /// per benchmark id.
    pub(super) fn criterion(
        &self,
        bench: &str,
        features: &[&str],
        env: &[(&str, String)],
    ) -> Result<BTreeMap<String, f64>, String> {
        let mut cmd = self.layout.bench_command(bench, features, self.quick);
        for (k, v) in env {
            cmd.env(k, v);
        }
        // Criterion's file times have at least second resolution everywhere.
        let since = SystemTime::now() - Duration::from_secs(2);
        capture(&mut cmd, CARGO_LIMIT)?;
        let parsed = criterion_results(&self.layout.criterion_dir(), since);
        if parsed.is_empty() {
            return Err(format!(
                "not available: `{}` wrote no criterion results",
                self.layout.bench_label(bench)
            ));
        }
        Ok(parsed)
    }
}

pub(super) fn lookup(results: &BTreeMap<String, f64>, id: &str) -> Result<f64, String> {
    results
        .get(id)
        .copied()
        .ok_or_else(|| format!("not available: the bench reported no `{id}`"))
}

/// Median nanoseconds per benchmark id from criterion's
/// `<dir>/**/new/{benchmark,estimates}.json` written at or after `since`
/// (criterion's `--quick` prints no ids in its bencher lines, so the files
/// are the one source that names every figure).
pub(super) fn criterion_results(dir: &Path, since: SystemTime) -> BTreeMap<String, f64> {
    let mut found = BTreeMap::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(folder) = pending.pop() {
        let Ok(entries) = fs::read_dir(&folder) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            let in_new = folder.file_name().is_some_and(|n| n == "new");
            if !in_new || path.file_name().is_none_or(|n| n != "benchmark.json") {
                continue;
            }
            let fresh = entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t >= since);
            if !fresh {
                continue;
            }
            let read = |p: &Path| -> Option<Value> {
                serde_json::from_str(&fs::read_to_string(p).ok()?).ok()
            };
            let (Some(benchmark), Some(estimates)) =
                (read(&path), read(&folder.join("estimates.json")))
            else {
                continue;
            };
            if let (Some(id), Some(ns)) = (
                benchmark["full_id"].as_str(),
                estimates["median"]["point_estimate"].as_f64(),
            ) {
                found.insert(id.to_string(), ns);
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn criterion_results_read_fresh_medians_by_full_id() {
        let dir = std::env::temp_dir().join(format!("xtask-bench-test-{}", std::process::id()));
        let write = |sub: &str, id: &str, ns: f64| {
            let new = dir.join(sub).join("new");
            fs::create_dir_all(&new).unwrap();
            fs::write(
                new.join("benchmark.json"),
                json!({ "full_id": id }).to_string(),
            )
            .unwrap();
            let estimates = json!({ "median": { "point_estimate": ns } });
            fs::write(new.join("estimates.json"), estimates.to_string()).unwrap();
        };
        write("plan_100b/auto", "plan/100b/auto", 1234.5);
        write("read_to_host/memcpy", "read_to_host/memcpy", 42e6);
        let since = SystemTime::now() - Duration::from_secs(60);
        let found = criterion_results(&dir, since);
        assert_eq!(found.len(), 2);
        assert_eq!(found["plan/100b/auto"], 1234.5);
        assert_eq!(found["read_to_host/memcpy"], 42e6);
        // Results of an earlier run are not this run's figures.
        let later = SystemTime::now() + Duration::from_secs(60);
        assert!(criterion_results(&dir, later).is_empty());
        fs::remove_dir_all(&dir).unwrap();
    }
}
