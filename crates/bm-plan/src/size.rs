//! Byte sizes: Accelerate's `convert_file_size_to_int` and human formatting.

use crate::Error;

/// Budgets above this are rejected as absurd (1 EiB): no machine has them and
/// the arithmetic of the planner stays far from overflow.
pub const MAX_BUDGET: u64 = 1 << 60;

/// Accelerate's `convert_file_size_to_int` for a string: `"10GB"` is 10^9
/// bytes, `"10GiB"` is 2^30, and a lowercase final `b` means bits
/// (`"10gb"` = 1.25e9 bytes). There is no TB unit and a bare number is not
/// accepted (pass integers as integers, see [`parse_size_value`]).
pub fn convert_file_size_to_int(size: &str) -> Result<u64, Error> {
    let bad = || Error::BadSize(size.to_string());
    let upper = size.to_uppercase();
    // Python slices the *original* string by the unit's length.
    let (number, scale, bits) = if upper.ends_with("GIB") {
        (&size[..size.len() - 3], (1u64 << 30) as f64, false)
    } else if upper.ends_with("MIB") {
        (&size[..size.len() - 3], (1u64 << 20) as f64, false)
    } else if upper.ends_with("KIB") {
        (&size[..size.len() - 3], (1u64 << 10) as f64, false)
    } else if upper.ends_with("GB") {
        (&size[..size.len() - 2], 1e9, size.ends_with('b'))
    } else if upper.ends_with("MB") {
        (&size[..size.len() - 2], 1e6, size.ends_with('b'))
    } else if upper.ends_with("KB") {
        (&size[..size.len() - 2], 1e3, size.ends_with('b'))
    } else {
        return Err(bad());
    };
    let value = python_float(number).ok_or_else(bad)? * scale;
    if value.is_nan() || value < 0.0 && value.trunc() < 0.0 {
        return Err(bad());
    }
    if !value.is_finite() || value >= u64::MAX as f64 {
        // Python raises OverflowError here ("infGB").
        return Err(Error::BadBudget {
            what: size.to_string(),
            reason: "the size is infinite or too large".into(),
        });
    }
    let bytes = value.trunc() as u64;
    Ok(if bits { bytes / 8 } else { bytes })
}

/// Python's `float(str)`: surrounding whitespace allowed, `inf`/`nan`
/// spellings, and `_` between digits.
fn python_float(text: &str) -> Option<f64> {
    let text = text.trim();
    if text.is_empty() {
        return None;
    }
    let bytes = text.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        if b == b'_' {
            let ok = i > 0
                && i + 1 < bytes.len()
                && bytes[i - 1].is_ascii_digit()
                && bytes[i + 1].is_ascii_digit();
            if !ok {
                return None;
            }
        }
    }
    let cleaned: String = text.chars().filter(|&c| c != '_').collect();
    let lower = cleaned.to_ascii_lowercase();
    let unsigned = lower.trim_start_matches(['+', '-']);
    if lower.len() - unsigned.len() > 1 {
        return None;
    }
    if matches!(unsigned, "inf" | "infinity" | "nan") {
        return lower.parse().ok();
    }
    // Rust also accepts forms Python does not ("inf" handled above); the
    // remaining grammar (digits, '.', exponent) is the same.
    if !unsigned
        .chars()
        .all(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | '+' | '-'))
    {
        return None;
    }
    lower.parse().ok()
}

/// A size value as `max_memory` accepts it: a JSON integer (bytes) or a
/// string for [`convert_file_size_to_int`]. `what` names the key in errors.
pub fn parse_size_value(value: &serde_json::Value, what: &str) -> Result<u64, Error> {
    let bytes = match value {
        serde_json::Value::Number(n) => {
            if let Some(v) = n.as_u64() {
                v
            } else if n.as_i64().is_some() {
                return Err(Error::BadBudget {
                    what: what.to_string(),
                    reason: format!("{n} is negative"),
                });
            } else {
                return Err(Error::BadBudget {
                    what: what.to_string(),
                    reason: format!("{n} is not a whole number of bytes"),
                });
            }
        }
        serde_json::Value::String(s) => convert_file_size_to_int(s)?,
        other => {
            return Err(Error::BadBudget {
                what: what.to_string(),
                reason: format!("expected a byte count or a size string, found {other}"),
            });
        }
    };
    check_budget(bytes, what)
}

/// A size written on the command line: an integer byte count or a string for
/// [`convert_file_size_to_int`].
pub fn parse_size_text(text: &str, what: &str) -> Result<u64, Error> {
    let trimmed = text.trim();
    let bytes = if !trimmed.is_empty() && trimmed.bytes().all(|b| b.is_ascii_digit()) {
        trimmed.parse::<u64>().map_err(|_| Error::BadBudget {
            what: what.to_string(),
            reason: format!("{trimmed} is too large"),
        })?
    } else if let Some(rest) = trimmed.strip_prefix('-')
        && !rest.is_empty()
        && rest.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(Error::BadBudget {
            what: what.to_string(),
            reason: format!("{trimmed} is negative"),
        });
    } else {
        convert_file_size_to_int(trimmed)?
    };
    check_budget(bytes, what)
}

fn check_budget(bytes: u64, what: &str) -> Result<u64, Error> {
    if bytes > MAX_BUDGET {
        return Err(Error::BadBudget {
            what: what.to_string(),
            reason: format!("{bytes} bytes is more than 1 EiB"),
        });
    }
    Ok(bytes)
}

/// Formats a byte count for people: `1.50 GiB`, `512 B`. The one byte
/// formatter of the workspace: every command of the CLI prints sizes with it.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = "B";
    for u in UNITS {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = u;
    }
    format!("{value:.2} {unit}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn convert_file_size_to_int_matches_the_reference_table() {
        let ok: &[(&str, u64)] = &[
            ("10GB", 10_000_000_000),
            ("10GiB", 10_737_418_240),
            ("10gib", 10_737_418_240),
            ("10GIB", 10_737_418_240),
            ("10gb", 1_250_000_000),
            ("10Gb", 1_250_000_000),
            ("1kb", 125),
            ("1.5GB", 1_500_000_000),
            ("10 GB", 10_000_000_000),
            (" 10GB", 10_000_000_000),
            ("1e3MB", 1_000_000_000),
            ("512KiB", 524_288),
            ("0MB", 0),
            // TMU:1065-1094
            ("100MB", 100_000_000),
            ("2GiB", 2 * (1 << 30)),
            ("100KB", 100_000),
        ];
        for (input, want) in ok {
            assert_eq!(convert_file_size_to_int(input).unwrap(), *want, "{input}");
        }
        for bad in [
            "10G", "10TB", "10B", "100", "5MBB", "5k0MB", "-1GB", "nanGB", "infGB", "GB", "",
        ] {
            let err = convert_file_size_to_int(bad).unwrap_err();
            assert!(
                matches!(err, Error::BadSize(_) | Error::BadBudget { .. }),
                "{bad}: {err}"
            );
        }
        assert_eq!(
            convert_file_size_to_int("5MBB").unwrap_err().to_string(),
            "`size` 5MBB is not in a valid format. Use an integer for bytes, or a string with an unit (like '5.0GB')."
        );
    }

    #[test]
    fn integers_pass_through_and_absurd_or_negative_budgets_are_rejected() {
        assert_eq!(parse_size_text("500", "0").unwrap(), 500);
        assert_eq!(parse_size_value(&serde_json::json!(500), "0").unwrap(), 500);
        assert!(
            parse_size_text("-5", "0")
                .unwrap_err()
                .to_string()
                .contains("negative")
        );
        assert!(parse_size_value(&serde_json::json!(-5), "0").is_err());
        assert!(parse_size_value(&serde_json::json!(1.5), "0").is_err());
        assert!(
            parse_size_text("2000000000GiB", "cpu")
                .unwrap_err()
                .to_string()
                .contains("1 EiB")
        );
        // A JSON string without a unit is rejected, as in Accelerate.
        assert!(parse_size_value(&serde_json::json!("100"), "0").is_err());
    }

    #[test]
    fn human_bytes_picks_binary_units() {
        // What `plan`, `run`, `demo`, `inspect`, `shard` and `devices` have
        // always printed (below 1 PiB all formatters of the CLI agreed).
        for (bytes, text) in [
            (0, "0 B"),
            (512, "512 B"),
            (1023, "1023 B"),
            (1024, "1.00 KiB"),
            (1536, "1.50 KiB"),
            (45_376, "44.31 KiB"),
            ((1 << 20) - 1, "1024.00 KiB"),
            (1 << 20, "1.00 MiB"),
            (3 << 30, "3.00 GiB"),
            (10 << 30, "10.00 GiB"),
            (80 << 30, "80.00 GiB"),
            (6_743_000_000, "6.28 GiB"),
            (1 << 40, "1.00 TiB"),
            ((1 << 50) - 1, "1024.00 TiB"),
            (1 << 50, "1.00 PiB"),
            (u64::MAX, "16.00 EiB"),
        ] {
            assert_eq!(human_bytes(bytes), text, "{bytes}");
        }
    }
}
