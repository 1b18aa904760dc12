//! JSON as the files of this crate need it.
//!
//! Reading: [`Reader`] is a strict RFC 8259 pull parser over text already
//! known to be UTF-8. Headers and indexes are read with it entry by entry,
//! straight into the crate's own types, so reading a 100 MB header costs the
//! parsed tensors and nothing like a `serde_json::Value` tree (which takes
//! several times the text), and a key given twice is seen.
//!
//! Writing: byte for byte as Python's `json.dump(..., indent=2)` writes
//! (`ensure_ascii=True`: non-ASCII characters become `\uXXXX` escapes).

use std::borrow::Cow;

use serde_json::Value;

/// Nesting this deep is refused (serde_json's own limit, counted the same
/// way from the outermost value), so a hostile file cannot exhaust the
/// stack.
const MAX_DEPTH: usize = 128;

/// A strict pull parser; every error is a message with the byte offset.
/// Cloning it saves a position to come back to.
#[derive(Clone)]
pub(crate) struct Reader<'a> {
    text: &'a str,
    pos: usize,
    /// Objects and arrays open around the position.
    depth: usize,
}

/// What the next value is, from its first byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Object,
    Array,
    String,
    Number,
    Literal,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(text: &'a str) -> Self {
        Reader {
            text,
            pos: 0,
            depth: 0,
        }
    }

    fn bytes(&self) -> &'a [u8] {
        self.text.as_bytes()
    }

    fn error(&self, what: &str) -> String {
        format!("{what} at byte {}", self.pos)
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.bytes().get(self.pos) {
            self.pos += 1;
        }
    }

    fn expect(&mut self, byte: u8) -> Result<(), String> {
        self.skip_ws();
        if self.bytes().get(self.pos) == Some(&byte) {
            self.pos += 1;
            Ok(())
        } else {
            Err(self.error(&format!("expected `{}`", byte as char)))
        }
    }

    /// The kind of the next value.
    pub(crate) fn peek(&mut self) -> Result<Kind, String> {
        self.skip_ws();
        match self.bytes().get(self.pos) {
            Some(b'{') => Ok(Kind::Object),
            Some(b'[') => Ok(Kind::Array),
            Some(b'"') => Ok(Kind::String),
            Some(b'-' | b'0'..=b'9') => Ok(Kind::Number),
            Some(b't' | b'f' | b'n') => Ok(Kind::Literal),
            Some(_) => Err(self.error("expected a value")),
            None => Err(self.error("unexpected end of text")),
        }
    }

    /// Consumes the `{` of an object.
    pub(crate) fn begin_object(&mut self) -> Result<(), String> {
        self.expect(b'{')?;
        self.enter()
    }

    fn enter(&mut self) -> Result<(), String> {
        self.depth += 1;
        if self.depth >= MAX_DEPTH {
            return Err(self.error("nesting 128 levels deep or more"));
        }
        Ok(())
    }

    /// The next key of the object being read, or `None` after its `}`.
    /// `first` is true for the first call after [`Reader::begin_object`].
    pub(crate) fn next_key(&mut self, first: bool) -> Result<Option<Cow<'a, str>>, String> {
        self.skip_ws();
        if self.bytes().get(self.pos) == Some(&b'}') {
            self.pos += 1;
            self.depth -= 1;
            return Ok(None);
        }
        if !first {
            self.expect(b',')?;
            self.skip_ws();
        }
        if self.bytes().get(self.pos) != Some(&b'"') {
            return Err(self.error("expected a key"));
        }
        let key = self.string()?;
        self.expect(b':')?;
        Ok(Some(key))
    }

    /// Consumes the `[` of an array.
    pub(crate) fn begin_array(&mut self) -> Result<(), String> {
        self.expect(b'[')?;
        self.enter()
    }

    /// True when the array being read has another element (consuming the
    /// `,` before it), false after its `]`.
    pub(crate) fn next_element(&mut self, first: bool) -> Result<bool, String> {
        self.skip_ws();
        if self.bytes().get(self.pos) == Some(&b']') {
            self.pos += 1;
            self.depth -= 1;
            return Ok(false);
        }
        if !first {
            self.expect(b',')?;
        }
        Ok(true)
    }

    /// Reads a string value.
    pub(crate) fn string(&mut self) -> Result<Cow<'a, str>, String> {
        self.expect(b'"')?;
        let start = self.pos;
        let bytes = self.bytes();
        // Fast path: no escape, borrowed as is.
        let mut i = start;
        while let Some(&b) = bytes.get(i) {
            match b {
                b'"' => {
                    self.pos = i + 1;
                    return Ok(Cow::Borrowed(&self.text[start..i]));
                }
                b'\\' => break,
                0..=0x1f => {
                    self.pos = i;
                    return Err(self.error("control character in a string"));
                }
                _ => i += 1,
            }
        }
        let mut out = String::from(&self.text[start..i]);
        self.pos = i;
        loop {
            let Some(&b) = bytes.get(self.pos) else {
                return Err(self.error("unterminated string"));
            };
            match b {
                b'"' => {
                    self.pos += 1;
                    return Ok(Cow::Owned(out));
                }
                b'\\' => {
                    self.pos += 1;
                    let Some(&e) = bytes.get(self.pos) else {
                        return Err(self.error("unterminated string"));
                    };
                    self.pos += 1;
                    match e {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => out.push(self.unicode_escape()?),
                        _ => {
                            self.pos -= 1;
                            return Err(self.error("invalid escape"));
                        }
                    }
                }
                0..=0x1f => return Err(self.error("control character in a string")),
                _ => {
                    // Copy up to the next quote or backslash in one go; the
                    // text is UTF-8 and both are ASCII, so the cut is valid.
                    let run = bytes[self.pos..]
                        .iter()
                        .position(|&c| c == b'"' || c == b'\\' || c < 0x20)
                        .map_or(bytes.len(), |n| self.pos + n);
                    out.push_str(&self.text[self.pos..run]);
                    self.pos = run;
                }
            }
        }
    }

    fn hex4(&mut self) -> Result<u32, String> {
        let digits = self
            .bytes()
            .get(self.pos..self.pos + 4)
            .filter(|d| d.iter().all(u8::is_ascii_hexdigit))
            .ok_or_else(|| self.error("invalid \\u escape"))?;
        let text = std::str::from_utf8(digits).map_err(|_| self.error("invalid \\u escape"))?;
        let v = u32::from_str_radix(text, 16).map_err(|_| self.error("invalid \\u escape"))?;
        self.pos += 4;
        Ok(v)
    }

    /// The character of a `\uXXXX` escape (after the `u`), joining a
    /// surrogate pair; a lone surrogate is an error, as in serde_json.
    fn unicode_escape(&mut self) -> Result<char, String> {
        let first = self.hex4()?;
        let code = match first {
            0xD800..=0xDBFF => {
                if self.bytes().get(self.pos..self.pos + 2) != Some(b"\\u") {
                    return Err(self.error("lone leading surrogate in a \\u escape"));
                }
                self.pos += 2;
                let second = self.hex4()?;
                if !(0xDC00..=0xDFFF).contains(&second) {
                    return Err(self.error("invalid trailing surrogate in a \\u escape"));
                }
                0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00)
            }
            0xDC00..=0xDFFF => return Err(self.error("lone trailing surrogate in a \\u escape")),
            c => c,
        };
        char::from_u32(code).ok_or_else(|| self.error("invalid \\u escape"))
    }

    /// Reads a number token; returns it as a `u64` when it is a plain
    /// non-negative integer that fits (no sign, fraction or exponent).
    pub(crate) fn number(&mut self) -> Result<Option<u64>, String> {
        self.skip_ws();
        let bytes = self.bytes();
        let start = self.pos;
        let mut i = start;
        let digits = |i: &mut usize| {
            let from = *i;
            while bytes.get(*i).is_some_and(u8::is_ascii_digit) {
                *i += 1;
            }
            *i - from
        };
        let negative = bytes.get(i) == Some(&b'-');
        if negative {
            i += 1;
        }
        let int_start = i;
        let n = digits(&mut i);
        if n == 0 || (n > 1 && bytes[int_start] == b'0') {
            self.pos = int_start;
            return Err(self.error("invalid number"));
        }
        let mut integer = !negative;
        if bytes.get(i) == Some(&b'.') {
            i += 1;
            if digits(&mut i) == 0 {
                self.pos = i;
                return Err(self.error("invalid number"));
            }
            integer = false;
        }
        if let Some(b'e' | b'E') = bytes.get(i) {
            i += 1;
            if let Some(b'+' | b'-') = bytes.get(i) {
                i += 1;
            }
            if digits(&mut i) == 0 {
                self.pos = i;
                return Err(self.error("invalid number"));
            }
            integer = false;
        }
        let token = &self.text[start..i];
        let value = integer
            .then(|| self.text[int_start..i].parse::<u64>().ok())
            .flatten();
        // As serde_json: a number beyond the range of f64 is an error.
        if value.is_none() && !token.parse::<f64>().is_ok_and(f64::is_finite) {
            self.pos = start;
            return Err(self.error("number out of range"));
        }
        self.pos = i;
        Ok(value)
    }

    /// Reads a list of non-negative integers; `None` when the value is
    /// anything else (it is consumed either way).
    pub(crate) fn u64_list(&mut self) -> Result<Option<Vec<u64>>, String> {
        if self.peek()? != Kind::Array {
            self.skip_value()?;
            return Ok(None);
        }
        self.begin_array()?;
        let mut out = Vec::new();
        let mut ok = true;
        let mut first = true;
        while self.next_element(first)? {
            first = false;
            if ok && self.peek()? == Kind::Number {
                match self.number()? {
                    Some(v) => out.push(v),
                    None => ok = false,
                }
            } else {
                ok = false;
                self.skip_value()?;
            }
        }
        Ok(ok.then_some(out))
    }

    /// Skips any value, checking its syntax. Recursion is bounded by the
    /// nesting limit.
    pub(crate) fn skip_value(&mut self) -> Result<(), String> {
        match self.peek()? {
            Kind::Object => {
                self.begin_object()?;
                let mut first = true;
                while self.next_key(first)?.is_some() {
                    first = false;
                    self.skip_value()?;
                }
            }
            Kind::Array => {
                self.begin_array()?;
                let mut first = true;
                while self.next_element(first)? {
                    first = false;
                    self.skip_value()?;
                }
            }
            Kind::String => {
                self.string()?;
            }
            Kind::Number => {
                self.number()?;
            }
            Kind::Literal => {
                let rest = &self.bytes()[self.pos..];
                let len = [&b"true"[..], b"false", b"null"]
                    .iter()
                    .find(|lit| rest.starts_with(lit))
                    .map(|lit| lit.len())
                    .ok_or_else(|| self.error("expected a value"))?;
                self.pos += len;
            }
        }
        Ok(())
    }

    /// Skips a value and returns its text, shortened to `max` bytes, for
    /// messages that show what was found instead of what was expected.
    pub(crate) fn skip_and_show(&mut self, max: usize) -> Result<String, String> {
        self.skip_ws();
        let start = self.pos;
        self.skip_value()?;
        Ok(shorten(&self.text[start..self.pos], max))
    }

    /// Checks that nothing but whitespace follows.
    pub(crate) fn end(&mut self) -> Result<(), String> {
        self.skip_ws();
        if self.pos == self.text.len() {
            Ok(())
        } else {
            Err(self.error("trailing characters"))
        }
    }
}

/// `text` cut to at most `max` bytes (on a character boundary), with `…`
/// when cut.
pub(crate) fn shorten(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// Checks that `text` is one JSON value and nothing else; the error says
/// where it is not.
pub(crate) fn validate(text: &str) -> Result<(), String> {
    let mut r = Reader::new(text);
    r.skip_value()?;
    r.end()
}

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

    fn read_string(json: &str) -> Result<String, String> {
        let mut r = Reader::new(json);
        let s = r.string()?.into_owned();
        r.end()?;
        Ok(s)
    }

    #[test]
    fn strings_unescape_like_serde_json() {
        for json in [
            r#""plain""#,
            r#""a\"b\\c\/d\b\f\n\r\t""#,
            r#""\u00e9\ud83d\ude00 é""#,
            r#""x\u0000y""#,
        ] {
            let expected: String = serde_json::from_str(json).unwrap();
            assert_eq!(read_string(json).unwrap(), expected, "{json}");
        }
        for bad in [
            r#""\ud83d""#,
            r#""\ude00""#,
            r#""\ud83dx""#,
            r#""\x""#,
            "\"a\nb\"",
            r#""open"#,
            r#""\u12""#,
        ] {
            assert!(serde_json::from_str::<String>(bad).is_err(), "{bad}");
            assert!(read_string(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn numbers_are_u64_only_when_plain() {
        for (json, expected) in [
            ("0", Some(0)),
            ("18446744073709551615", Some(u64::MAX)),
            ("18446744073709551616", None),
            ("-1", None),
            ("-0", None),
            ("1.0", None),
            ("1e3", None),
        ] {
            let mut r = Reader::new(json);
            assert_eq!(r.number().unwrap(), expected, "{json}");
            r.end().unwrap();
        }
        for bad in ["01", "-", "1.", "1e", ".5", "+1"] {
            assert!(validate(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn validation_agrees_with_serde_json() {
        for json in [
            "{}",
            " [1, {\"a\": [true, false, null]}, \"s\", -2.5e-3] ",
            "{\"a\":1,\"a\":2}",
            "[]",
            "{\"a\" 1}",
            "[1,]",
            "{\"a\":1,}",
            "[1 2]",
            "nul",
            "{} x",
            "",
            "[[[[]]]]",
            "1e308",
            "1e309",
            "[-1e400]",
            "1e-999",
            &"9".repeat(400),
            &"9".repeat(300),
        ] {
            let serde = serde_json::from_str::<Value>(json).is_ok();
            assert_eq!(validate(json).is_ok(), serde, "{json:?}");
        }
        // serde_json's limit, counted the same way.
        for n in [127, 128, 129, 200] {
            let deep = "[".repeat(n) + &"]".repeat(n);
            let in_object = format!("{{\"a\":{}}}", "[".repeat(n) + &"]".repeat(n));
            for json in [deep, in_object] {
                let serde = serde_json::from_str::<Value>(&json).is_ok();
                assert_eq!(validate(&json).is_ok(), serde, "{n}");
                if !serde {
                    assert!(validate(&json).unwrap_err().contains("nesting"));
                }
            }
        }
    }

    #[test]
    fn shown_values_are_shortened() {
        let mut r = Reader::new(r#"{"a": [1, 2, 3, 4, 5, 6]}"#);
        assert_eq!(r.skip_and_show(10).unwrap(), r#"{"a": [1, …"#);
        assert_eq!(shorten("ééé", 3), "é…");
    }
}
