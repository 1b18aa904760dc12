//! JSON as the files of this crate need it.
//!
//! Reading: the strict pull reader of `bm-json` ([`Reader`]): headers and
//! indexes are read with it entry by entry, straight into the crate's own
//! types, so reading a 100 MB header costs the parsed tensors and nothing
//! like a `serde_json::Value` tree, and a key given twice is seen.
//!
//! Writing: byte for byte as Python's `json.dump(..., indent=2)` writes
//! (`ensure_ascii=True`: non-ASCII characters become `\uXXXX` escapes).

pub(crate) use bm_json::{Kind, Reader, shorten, validate};
use serde_json::Value;

/// Appends `s` as a JSON string the way Python writes it with
/// `ensure_ascii=True`.
pub(crate) fn push_python_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            c => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
    }
    out.push('"');
}

/// Serialises `value` as Python's `json.dumps(value, indent=2)` does.
pub(crate) fn python_indent2(value: &Value) -> String {
    let mut out = String::new();
    write_indented(&mut out, value, 0);
    out
}

fn newline(out: &mut String, depth: usize) {
    out.push('\n');
    for _ in 0..depth {
        out.push_str("  ");
    }
}

fn write_indented(out: &mut String, value: &Value, depth: usize) {
    match value {
        Value::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                newline(out, depth + 1);
                push_python_str(out, k);
                out.push_str(": ");
                write_indented(out, v, depth + 1);
            }
            newline(out, depth);
            out.push('}');
        }
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                newline(out, depth + 1);
                write_indented(out, v, depth + 1);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(_) => out.push_str("{}"),
        Value::Array(_) => out.push_str("[]"),
        Value::String(s) => push_python_str(out, s),
        // Numbers, booleans and null print alike in both languages (this
        // crate writes integers only).
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_python_json_dump() {
        // json.dumps({"b": {"dtype": "float32", "shape": [2, 3]}, "é😀": {"shape": []}, "c\n\"\x01\x7f": {}}, indent=2)
        // (DEL is escaped too: Python keeps only ' '..='~' as is)
        let v: Value = serde_json::from_str(
            r#"{"b":{"dtype":"float32","shape":[2,3]},"é😀":{"shape":[]},"c\n\"\u0001\u007f":{}}"#,
        )
        .unwrap();
        assert_eq!(
            python_indent2(&v),
            "{\n  \"b\": {\n    \"dtype\": \"float32\",\n    \"shape\": [\n      2,\n      3\n    ]\n  },\n  \"\\u00e9\\ud83d\\ude00\": {\n    \"shape\": []\n  },\n  \"c\\n\\\"\\u0001\\u007f\": {}\n}"
        );
    }
}
