//! JSON written byte for byte as Python's `json.dump(..., indent=2)` writes
//! it (`ensure_ascii=True`: non-ASCII characters become `\uXXXX` escapes).

use serde_json::Value;

/// Serialises `value` with two-space indentation and ASCII-only output.
pub(crate) fn python_indent2(value: &Value) -> String {
    // serde_json's pretty printer indents by two spaces and puts one list
    // element per line, as Python does.
    let text = serde_json::to_string_pretty(value).expect("a Value always serialises");
    // Non-ASCII characters can only occur inside strings, where an escape is
    // equivalent.
    let mut ascii = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_ascii() {
            ascii.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                ascii.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
    ascii
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_python_json_dump() {
        // json.dumps({"b": {"dtype": "float32", "shape": [2, 3]}, "é😀": {"shape": []}}, indent=2)
        let v: Value =
            serde_json::from_str(r#"{"b":{"dtype":"float32","shape":[2,3]},"é😀":{"shape":[]}}"#)
                .unwrap();
        assert_eq!(
            python_indent2(&v),
            "{\n  \"b\": {\n    \"dtype\": \"float32\",\n    \"shape\": [\n      2,\n      3\n    ]\n  },\n  \"\\u00e9\\ud83d\\ude00\": {\n    \"shape\": []\n  }\n}"
        );
    }
}
