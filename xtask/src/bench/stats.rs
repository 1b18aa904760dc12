//! Medians: of numbers, of the fields of repeated answers, of wall times.

use std::time::Instant;

use serde_json::{Value, json};

/// The first answer with every numeric field replaced by its median over
/// all answers.
pub(super) fn median_fields(answers: &[Value]) -> Value {
    let mut merged = answers.first().cloned().unwrap_or(Value::Null);
    if let Some(fields) = merged.as_object_mut() {
        for (key, value) in fields.iter_mut() {
            if value.is_number() {
                let mut all: Vec<f64> = answers.iter().filter_map(|a| a[key].as_f64()).collect();
                let integers = answers.iter().all(|a| a[key].is_i64() || a[key].is_u64());
                match median(&mut all) {
                    // Token ids and byte counts stay integers.
                    Some(m) if integers && m.fract() == 0.0 => *value = json!(m as i64),
                    Some(m) => *value = json!(m),
                    None => {}
                }
            }
        }
    }
    merged
}

pub(super) fn median(values: &mut [f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    Some(if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    })
}

/// Median wall time of `runs` calls of `work` (after one warm-up call).
pub(super) fn median_wall(
    runs: usize,
    mut work: impl FnMut() -> Result<(), String>,
) -> Result<f64, String> {
    work()?;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let start = Instant::now();
        work()?;
        times.push(start.elapsed().as_secs_f64());
    }
    median(&mut times).ok_or_else(|| "not available: no runs".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_fields_takes_the_median_of_numbers_and_keeps_the_rest() {
        let answers = [
            json!({"load_seconds": 3.0, "generated_ids": [5]}),
            json!({"load_seconds": 1.0, "generated_ids": [5]}),
            json!({"load_seconds": 2.0, "generated_ids": [5]}),
        ];
        let m = median_fields(&answers);
        assert_eq!(m["load_seconds"], 2.0);
        let tokens = [json!({"next_token": 7958}), json!({"next_token": 7958})];
        assert!(median_fields(&tokens)["next_token"].is_i64());
        assert_eq!(m["generated_ids"], json!([5]));
    }
}
