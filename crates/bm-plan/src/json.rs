//! A pull reader over JSON text, for documents too large to build as a
//! `serde_json::Value` first (a module tree of a 100k-module MoE model is
//! ~10 MB). It hands out borrowed strings (a copy only when a string has
//! escapes), validates the whole grammar of RFC 8259 as `serde_json` does,
//! knows the byte offset of every value, and never recurses: skipping a
//! value keeps one byte per open container, so nesting depth costs no stack.

use std::borrow::Cow;

/// A syntax error: what was expected and the byte offset where it was not.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct SyntaxError {
    pub(crate) pos: usize,
    pub(crate) what: &'static str,
}

/// What a value is, from its first byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Object,
    Array,
    String,
    Number,
    Bool,
    Null,
}

/// Reads JSON text front to back.
pub(crate) struct Reader<'a> {
    text: &'a str,
    pos: usize,
}

type Result<T> = std::result::Result<T, SyntaxError>;

impl<'a> Reader<'a> {
    pub(crate) fn new(text: &'a str) -> Self {
        Reader { text, pos: 0 }
    }

    #[inline]
    fn bytes(&self) -> &'a [u8] {
        self.text.as_bytes()
    }

    fn error<T>(&self, what: &'static str) -> Result<T> {
        Err(SyntaxError {
            pos: self.pos,
            what,
        })
    }

    #[inline]
    fn skip_white_space(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.bytes().get(self.pos) {
            self.pos += 1;
        }
    }

    /// The byte offset of the next value (after white space).
    #[inline]
    pub(crate) fn pos(&mut self) -> usize {
        self.skip_white_space();
        self.pos
    }

    /// The kind of the next value; `None` when the next byte starts none
    /// (reading it then gives the syntax error).
    #[inline]
    pub(crate) fn peek(&mut self) -> Option<Kind> {
        self.skip_white_space();
        Some(match self.bytes().get(self.pos)? {
            b'{' => Kind::Object,
            b'[' => Kind::Array,
            b'"' => Kind::String,
            b'-' | b'0'..=b'9' => Kind::Number,
            b't' | b'f' => Kind::Bool,
            b'n' => Kind::Null,
            _ => return None,
        })
    }

    #[inline]
    fn consume(&mut self, byte: u8, what: &'static str) -> Result<()> {
        self.skip_white_space();
        if self.bytes().get(self.pos) == Some(&byte) {
            self.pos += 1;
            Ok(())
        } else {
            self.error(what)
        }
    }

    /// Enters an object; read its members with [`Reader::next_key`].
    #[inline]
    pub(crate) fn begin_object(&mut self) -> Result<()> {
        self.consume(b'{', "expected `{`")
    }

    /// Enters an array; read its items with [`Reader::next_item`].
    #[inline]
    pub(crate) fn begin_array(&mut self) -> Result<()> {
        self.consume(b'[', "expected `[`")
    }

    /// The next key of the object being read (its value comes next), or
    /// `None` after its closing brace. `first` is true until the first call.
    #[inline]
    pub(crate) fn next_key(&mut self, first: &mut bool) -> Result<Option<Cow<'a, str>>> {
        self.skip_white_space();
        match self.bytes().get(self.pos) {
            Some(b'}') => {
                // `{"a":1,}` is refused: a comma must be followed by a key.
                self.pos += 1;
                return Ok(None);
            }
            Some(b',') if !*first => self.pos += 1,
            _ if !*first => return self.error("expected `,` or `}`"),
            _ => {}
        }
        *first = false;
        self.skip_white_space();
        if self.bytes().get(self.pos) != Some(&b'"') {
            return self.error("expected a string key");
        }
        let key = self.string()?;
        self.consume(b':', "expected `:`")?;
        Ok(Some(key))
    }

    /// Whether another item of the array being read follows (then it comes
    /// next); false after its closing bracket.
    #[inline]
    pub(crate) fn next_item(&mut self, first: &mut bool) -> Result<bool> {
        self.skip_white_space();
        match self.bytes().get(self.pos) {
            Some(b']') => {
                self.pos += 1;
                return Ok(false);
            }
            Some(b',') if !*first => self.pos += 1,
            _ if !*first => return self.error("expected `,` or `]`"),
            _ => {}
        }
        *first = false;
        Ok(true)
    }

    /// A string, borrowed from the text unless it has escapes.
    #[inline]
    pub(crate) fn string(&mut self) -> Result<Cow<'a, str>> {
        self.consume(b'"', "expected a string")?;
        let bytes = self.bytes();
        let start = self.pos;
        // Fast path: no escape before the closing quote.
        self.pos = start + find_special(&bytes[start..]);
        match bytes.get(self.pos) {
            Some(b'"') => {
                self.pos += 1;
                return Ok(Cow::Borrowed(&self.text[start..self.pos - 1]));
            }
            Some(b'\\') => {}
            Some(_) => return self.error("control character in a string"),
            None => return self.error("end of input inside a string"),
        }
        let mut owned = String::with_capacity(self.pos - start + 16);
        let mut run = start;
        loop {
            match bytes.get(self.pos) {
                Some(b'"') => {
                    owned.push_str(&self.text[run..self.pos]);
                    self.pos += 1;
                    return Ok(Cow::Owned(owned));
                }
                Some(b'\\') => {
                    owned.push_str(&self.text[run..self.pos]);
                    self.pos += 1;
                    owned.push(self.escape()?);
                    run = self.pos;
                }
                Some(0..=0x1f) => return self.error("control character in a string"),
                Some(_) => self.pos += 1,
                None => return self.error("end of input inside a string"),
            }
        }
    }

    /// The character of the escape after a backslash.
    fn escape(&mut self) -> Result<char> {
        let Some(&byte) = self.bytes().get(self.pos) else {
            return self.error("end of input inside a string");
        };
        self.pos += 1;
        Ok(match byte {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let first = self.hex4()?;
                let code = match first {
                    0xD800..=0xDBFF => {
                        if !self.text[self.pos..].starts_with("\\u") {
                            return self.error("lone surrogate in a \\u escape");
                        }
                        self.pos += 2;
                        let second = self.hex4()?;
                        if !(0xDC00..=0xDFFF).contains(&second) {
                            return self.error("lone surrogate in a \\u escape");
                        }
                        0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00)
                    }
                    0xDC00..=0xDFFF => return self.error("lone surrogate in a \\u escape"),
                    _ => first,
                };
                match char::from_u32(code) {
                    Some(c) => c,
                    None => return self.error("invalid \\u escape"),
                }
            }
            _ => {
                self.pos -= 1;
                return self.error("invalid escape");
            }
        })
    }

    fn hex4(&mut self) -> Result<u32> {
        let mut value = 0;
        for _ in 0..4 {
            let digit = self
                .bytes()
                .get(self.pos)
                .and_then(|b| (*b as char).to_digit(16));
            let Some(digit) = digit else {
                return self.error("invalid \\u escape");
            };
            value = value * 16 + digit;
            self.pos += 1;
        }
        Ok(value)
    }

    /// A number, as its text (validated: `-?int frac? exp?`, finite).
    #[inline]
    pub(crate) fn number(&mut self) -> Result<&'a str> {
        self.skip_white_space();
        let bytes = self.bytes();
        let start = self.pos;
        let digits = |pos: &mut usize| {
            let from = *pos;
            while bytes.get(*pos).is_some_and(u8::is_ascii_digit) {
                *pos += 1;
            }
            *pos > from
        };
        let mut pos = self.pos;
        if bytes.get(pos) == Some(&b'-') {
            pos += 1;
        }
        match bytes.get(pos) {
            Some(b'0') => pos += 1,
            Some(b'1'..=b'9') => {
                digits(&mut pos);
            }
            _ => {
                self.pos = pos;
                return self.error("invalid number");
            }
        }
        let mut integer = true;
        if bytes.get(pos) == Some(&b'.') {
            pos += 1;
            integer = false;
            if !digits(&mut pos) {
                self.pos = pos;
                return self.error("invalid number");
            }
        }
        if let Some(b'e' | b'E') = bytes.get(pos) {
            pos += 1;
            integer = false;
            if let Some(b'+' | b'-') = bytes.get(pos) {
                pos += 1;
            }
            if !digits(&mut pos) {
                self.pos = pos;
                return self.error("invalid number");
            }
        }
        let text = &self.text[start..pos];
        // Integers of up to 19 digits fit an u64 or i64; anything else is
        // refused, as serde_json refuses it, when it overflows an f64.
        if (!integer || pos - start > 19) && !text.parse::<f64>().is_ok_and(f64::is_finite) {
            return self.error("number out of range");
        }
        self.pos = pos;
        Ok(text)
    }

    /// `true` or `false`.
    #[inline]
    pub(crate) fn bool(&mut self) -> Result<bool> {
        self.skip_white_space();
        let rest = &self.text[self.pos..];
        if rest.starts_with("true") {
            self.pos += 4;
            Ok(true)
        } else if rest.starts_with("false") {
            self.pos += 5;
            Ok(false)
        } else {
            self.error("expected `true` or `false`")
        }
    }

    fn literal(&mut self) -> Result<()> {
        let rest = &self.text[self.pos..];
        for word in ["true", "false", "null"] {
            if rest.starts_with(word) {
                self.pos += word.len();
                return Ok(());
            }
        }
        self.error("expected a value")
    }

    /// Skips one value of any kind, validating it.
    pub(crate) fn skip(&mut self) -> Result<()> {
        // The open containers, innermost last: true for an object.
        let mut open: Vec<bool> = Vec::new();
        loop {
            // A value starts here.
            self.skip_white_space();
            match self.bytes().get(self.pos) {
                Some(b'{') => {
                    self.pos += 1;
                    let mut first = true;
                    if self.next_key(&mut first)?.is_some() {
                        open.push(true);
                        continue;
                    }
                }
                Some(b'[') => {
                    self.pos += 1;
                    let mut first = true;
                    if self.next_item(&mut first)? {
                        open.push(false);
                        continue;
                    }
                }
                Some(b'"') => {
                    self.string()?;
                }
                Some(b'-' | b'0'..=b'9') => {
                    self.number()?;
                }
                Some(_) => self.literal()?,
                None => return self.error("end of input where a value was expected"),
            }
            // A value ended: close the containers it ends, then go on with
            // the next member or item.
            loop {
                let Some(&object) = open.last() else {
                    return Ok(());
                };
                let mut first = false;
                let more = if object {
                    self.next_key(&mut first)?.is_some()
                } else {
                    self.next_item(&mut first)?
                };
                if more {
                    break;
                }
                open.pop();
            }
        }
    }

    /// Skips one value, returning its text.
    pub(crate) fn skip_text(&mut self) -> Result<&'a str> {
        let start = self.pos();
        self.skip()?;
        Ok(&self.text[start..self.pos])
    }

    /// Succeeds when nothing but white space is left.
    pub(crate) fn end(&mut self) -> Result<()> {
        self.skip_white_space();
        if self.pos == self.text.len() {
            Ok(())
        } else {
            self.error("trailing characters after the document")
        }
    }
}

/// The offset of the first `"`, `\\` or control character in `bytes` (its
/// length when there is none), eight bytes at a time: strings are most of a
/// module tree's text.
#[inline]
fn find_special(bytes: &[u8]) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    // A byte of `x` is zero where the high bit of the result is set (the
    // lowest such byte is exact; higher ones may be false alarms).
    let zero_bytes = |x: u64| x.wrapping_sub(ONES) & !x & HIGHS;
    let mut chunks = bytes.chunks_exact(8);
    let mut offset = 0;
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let w = u64::from_le_bytes(word);
        let hits = zero_bytes(w ^ (ONES * u64::from(b'"')))
            | zero_bytes(w ^ (ONES * u64::from(b'\\')))
            // Bytes below 0x20: subtracting 0x20 borrows into the high bit.
            | (w.wrapping_sub(ONES * 0x20) & !w & HIGHS);
        if hits != 0 {
            return offset + (hits.trailing_zeros() / 8) as usize;
        }
        offset += 8;
    }
    let tail = chunks.remainder();
    offset
        + tail
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
            .unwrap_or(tail.len())
}

/// `line L column C` (both from 1) of byte offset `pos`, as serde_json
/// words positions; the column counts characters.
pub(crate) fn line_column(text: &str, pos: usize) -> String {
    let mut end = pos.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let before = &text[..end];
    let line = before.bytes().filter(|b| *b == b'\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[line_start..].chars().count() + 1;
    format!("line {line} column {column}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether the reader accepts `text` as one JSON value.
    fn accepts(text: &str) -> bool {
        let mut r = Reader::new(text);
        r.skip().and_then(|()| r.end()).is_ok()
    }

    #[test]
    fn accepts_exactly_what_serde_json_accepts() {
        let cases = [
            r#"{}"#,
            r#"[]"#,
            r#"{"a":[1,2,{"b":null}],"c":"d"}"#,
            " \n\t{ \"a\" : [ ] , \"b\" : { } } \r\n",
            r#"[0, -0, 1.5, -1.5e10, 2E-3, 1e+2, 123456789012345678901234567890]"#,
            r#"["\"\\\/\b\f\n\r\t", "\u00e9\ud83d\ude00", "é😀"]"#,
            r#"[true, false, null]"#,
            r#"{"a":1,}"#,
            r#"[1,]"#,
            r#"[,1]"#,
            r#"{,}"#,
            r#"{"a" 1}"#,
            r#"{"a":1 "b":2}"#,
            r#"{1:2}"#,
            r#"[01]"#,
            r#"[1.]"#,
            r#"[.5]"#,
            r#"[1e]"#,
            r#"[-]"#,
            r#"[+1]"#,
            r#"[1e400]"#,
            r#"[-1e400]"#,
            r#"["\x"]"#,
            r#"["\u12"]"#,
            r#"["\ud800"]"#,
            r#"["\udc00"]"#,
            r#"["\ud800\u0041"]"#,
            "[\"a\u{1}\"]",
            r#"[tru]"#,
            r#"[nul]"#,
            r#"[True]"#,
            r#"{"a":1}}"#,
            r#"{"a":1} x"#,
            r#"{"a":"#,
            r#"{"a"#,
            r#"["#,
            r#""#,
            r#"   "#,
            r#"[[[[[]]]]]"#,
            r#"[[[[[]]]]"#,
            r#"{"a":[}"#,
            r#"[{]"#,
        ];
        for text in cases {
            let want = serde_json::from_str::<serde_json::Value>(text).is_ok();
            assert_eq!(accepts(text), want, "{text:?}");
        }
    }

    #[test]
    fn strings_are_borrowed_unless_escaped() {
        let mut r = Reader::new(r#"["plain", "tab\there", "\u00e9\ud83d\ude00"]"#);
        r.begin_array().unwrap();
        let mut first = true;
        let mut got = Vec::new();
        while r.next_item(&mut first).unwrap() {
            got.push(r.string().unwrap());
        }
        assert!(matches!(got[0], Cow::Borrowed("plain")));
        assert!(matches!(&got[1], Cow::Owned(s) if s == "tab\there"));
        assert_eq!(got[2], "é😀");
    }

    #[test]
    fn deep_nesting_costs_no_stack() {
        let depth = 1_000_000;
        let text = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        assert!(accepts(&text));
        assert!(!accepts(&text[..text.len() - 1]));
    }

    #[test]
    fn errors_point_at_the_offending_byte() {
        let text = "{\n  \"a\": [1, 2,, 3]\n}";
        let mut r = Reader::new(text);
        let e = r.skip().unwrap_err();
        assert_eq!(e.what, "expected a value");
        assert_eq!(line_column(text, e.pos), "line 2 column 14");
        assert_eq!(line_column("é\né", 5), "line 2 column 2");
    }

    #[test]
    fn special_bytes_are_found_at_every_offset() {
        for len in 0..20 {
            for at in 0..=len {
                for special in [b'"', b'\\', 0x00, 0x1f] {
                    let mut bytes = vec![b'a'; len];
                    // Bytes that look like specials to a careless bit trick.
                    for (i, b) in bytes.iter_mut().enumerate() {
                        *b = [b'a', 0x20, 0x21, 0xff, 0x80, b'#', b']'][i % 7];
                    }
                    if at < len {
                        bytes[at] = special;
                    }
                    assert_eq!(find_special(&bytes), at, "{bytes:?}");
                }
            }
        }
    }

    #[test]
    fn numbers_come_back_as_text() {
        let mut r = Reader::new(" -12.5e3 ");
        assert_eq!(r.number().unwrap(), "-12.5e3");
        r.end().unwrap();
    }
}
