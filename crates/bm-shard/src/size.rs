//! Parsing `--max-shard-size`.

use crate::Error;

/// Parses a shard size the way huggingface_hub's `parse_size_to_int` does
/// (`"5GB"` = 5·10⁹, `"20mb"` = 2·10⁷: units are case-insensitive and
/// decimal, whitespace allowed, fractional values truncated), extended with
/// plain byte counts (`"1000"`) and the binary units KiB, MiB, GiB and TiB.
pub fn parse_size(input: &str) -> Result<u64, Error> {
    let bad = |problem: String| Error::Size {
        input: input.to_string(),
        problem,
    };
    let s = input.trim();
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return s.parse().map_err(|_| bad("does not fit in 64 bits".into()));
    }
    let upper = s.to_ascii_uppercase();
    let units: [(&str, f64); 8] = [
        ("KIB", 1024.0),
        ("MIB", 1024f64.powi(2)),
        ("GIB", 1024f64.powi(3)),
        ("TIB", 1024f64.powi(4)),
        ("KB", 1e3),
        ("MB", 1e6),
        ("GB", 1e9),
        ("TB", 1e12),
    ];
    let Some((unit, multiplier)) = units.iter().find(|(u, _)| upper.ends_with(u)) else {
        return Err(bad(
            "expected a byte count or a number with a unit: KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)".into(),
        ));
    };
    let number = s[..s.len() - unit.len()].trim();
    let ok_chars = !number.is_empty()
        && number
            .bytes()
            .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'+' | b'-'));
    let value: f64 = match number.parse() {
        Ok(v) if ok_chars => v,
        _ => return Err(bad(format!("{number:?} is not a number"))),
    };
    let bytes = value * multiplier;
    if !(bytes >= 0.0 && bytes < u64::MAX as f64) {
        return Err(bad("must be a non-negative size below 2^64 bytes".into()));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huggingface_hub_cases() {
        assert_eq!(parse_size("1KB").unwrap(), 1_000);
        assert_eq!(parse_size("2MB").unwrap(), 2_000_000);
        assert_eq!(parse_size("3GB").unwrap(), 3_000_000_000);
        assert_eq!(parse_size(" 10 KB ").unwrap(), 10_000);
        assert_eq!(parse_size("20mb").unwrap(), 20_000_000);
        assert_eq!(parse_size("1.5GB").unwrap(), 1_500_000_000);
        assert!(parse_size("1ooKB").is_err());
    }

    #[test]
    fn extensions() {
        assert_eq!(parse_size("512").unwrap(), 512);
        assert_eq!(parse_size("1KiB").unwrap(), 1024);
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
    }

    #[test]
    fn garbage_is_named() {
        for s in [
            "", "abc", "-1GB", "nanGB", "infGB", "5MBB", "5k0MB", "1e400GB", "GB",
        ] {
            let e = parse_size(s).unwrap_err().to_string();
            assert!(e.starts_with(&format!("size {s:?}")), "{s}: {e}");
        }
    }
}
