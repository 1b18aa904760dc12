//! The strict JSON pull reader the bigmodel crates read their files with
//! (safetensors headers, indexes, offload indexes, module trees).
//!
//! [`Reader`] reads RFC 8259 text already known to be UTF-8 front to back,
//! accepting exactly what serde_json accepts. Callers read documents entry
//! by entry straight into their own types, so a 100 MB header or a 10 MB
//! module tree costs the parsed values and nothing like a
//! `serde_json::Value` tree (which takes several times the text); strings
//! are borrowed from the text unless they have escapes, a key given twice is
//! seen, and every error says the byte offset where the text is wrong.

use std::borrow::Cow;

/// Nesting this deep is refused (serde_json's own limit, counted the same
/// way from the outermost value), so a hostile file cannot exhaust the
/// stack and what is accepted is what serde_json accepts.
const MAX_DEPTH: usize = 128;

/// A strict pull parser; every error is a message with the byte offset.
/// Cloning it saves a position to come back to.
#[derive(Clone, Debug)]
pub struct Reader<'a> {
    text: &'a str,
    pos: usize,
    /// Objects and arrays open around the position.
    depth: usize,
    /// The depth refused: [`MAX_DEPTH`] but in a [`Reader::part`].
    limit: usize,
    /// The greatest depth reached.
    deepest: usize,
}

/// What the next value is, from its first byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `{`
    Object,
    /// `[`
    Array,
    /// `"`
    String,
    /// `-` or a digit.
    Number,
    /// `true`, `false` or `null`.
    Literal,
}

impl<'a> Reader<'a> {
    /// A reader at the start of `text`.
    pub fn new(text: &'a str) -> Self {
        Reader {
            text,
            pos: 0,
            depth: 0,
            limit: MAX_DEPTH,
            deepest: 0,
        }
    }

    /// A reader of `text` from byte `pos` (a place between two values, as
    /// [`Reader::offset`] gives them) for a document read in two parts,
    /// the first by another reader: this one does not know how deep `pos`
    /// is, so it starts as deep as a document may nest and can close that
    /// many objects and arrays; [`Reader::join`] checks the real nesting.
    pub fn part(text: &'a str, pos: usize) -> Self {
        Reader {
            text,
            pos,
            depth: MAX_DEPTH,
            limit: 2 * MAX_DEPTH,
            deepest: MAX_DEPTH,
        }
    }

    /// Continues where `part` stopped, when `part` (a [`Reader::part`])
    /// started where this reader is: false, and nothing changed, when the
    /// two together nest [`MAX_DEPTH`] levels deep or more (reading on from
    /// here finds where) or `part` closed more than is open here.
    pub fn join(&mut self, part: &Reader<'a>) -> bool {
        if self.depth + (part.deepest - MAX_DEPTH) >= MAX_DEPTH
            || self.depth + part.depth < MAX_DEPTH
        {
            return false;
        }
        self.depth = self.depth + part.depth - MAX_DEPTH;
        self.deepest = self.deepest.max(self.depth + part.deepest - MAX_DEPTH);
        self.pos = part.pos;
        true
    }

    /// The byte offset of the next value (white space skipped), for
    /// messages about it.
    #[inline]
    pub fn pos(&mut self) -> usize {
        self.skip_ws();
        self.pos
    }

    /// The byte offset reached; after an error, where the error is.
    #[inline]
    pub fn offset(&self) -> usize {
        self.pos
    }

    fn bytes(&self) -> &'a [u8] {
        self.text.as_bytes()
    }

    #[cold]
    #[inline(never)]
    fn error(&self, what: &str) -> String {
        format!("{what} at byte {}", self.pos)
    }

    #[inline]
    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.bytes().get(self.pos) {
            self.pos += 1;
        }
    }

    #[inline]
    fn expect(&mut self, byte: u8) -> Result<(), String> {
        self.skip_ws();
        if self.bytes().get(self.pos) == Some(&byte) {
            self.pos += 1;
            Ok(())
        } else {
            Err(self.expected(byte))
        }
    }

    #[cold]
    #[inline(never)]
    fn expected(&self, byte: u8) -> String {
        self.error(&format!("expected `{}`", byte as char))
    }

    /// The kind of the next value.
    #[inline]
    pub fn peek(&mut self) -> Result<Kind, String> {
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
    #[inline]
    pub fn begin_object(&mut self) -> Result<(), String> {
        self.expect(b'{')?;
        self.enter()
    }

    #[inline]
    fn enter(&mut self) -> Result<(), String> {
        self.depth += 1;
        self.deepest = self.deepest.max(self.depth);
        if self.depth >= self.limit {
            return Err(self.error("nesting 128 levels deep or more"));
        }
        Ok(())
    }

    /// The next key of the object being read, or `None` after its `}`.
    /// `first` is true for the first call after [`Reader::begin_object`].
    #[inline(always)]
    pub fn next_key(&mut self, first: bool) -> Result<Option<Cow<'a, str>>, String> {
        self.skip_ws();
        match self.bytes().get(self.pos) {
            Some(b'}') => {
                self.pos += 1;
                self.depth -= 1;
                return Ok(None);
            }
            Some(b',') if !first => {
                self.pos += 1;
                self.skip_ws();
            }
            _ if !first => return Err(self.expected(b',')),
            _ => {}
        }
        if self.bytes().get(self.pos) != Some(&b'"') {
            return Err(self.error("expected a key"));
        }
        self.pos += 1;
        let key = self.string_body()?;
        self.expect(b':')?;
        Ok(Some(key))
    }

    /// Consumes the `[` of an array.
    #[inline]
    pub fn begin_array(&mut self) -> Result<(), String> {
        self.expect(b'[')?;
        self.enter()
    }

    /// True when the array being read has another element (consuming the
    /// `,` before it), false after its `]`.
    #[inline]
    pub fn next_element(&mut self, first: bool) -> Result<bool, String> {
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
    #[inline(always)]
    pub fn string(&mut self) -> Result<Cow<'a, str>, String> {
        self.expect(b'"')?;
        self.string_body()
    }

    /// The rest of a string after its opening quote.
    #[inline(always)]
    fn string_body(&mut self) -> Result<Cow<'a, str>, String> {
        let start = self.pos;
        let bytes = self.bytes();
        // Fast path: no escape, borrowed as is.
        let i = start + find_special(&bytes[start..]);
        if bytes.get(i) == Some(&b'"') {
            self.pos = i + 1;
            // SAFETY: `start` follows an ASCII quote and `i` is at one, in
            // text that is UTF-8: both are character boundaries.
            return Ok(Cow::Borrowed(unsafe { self.text.get_unchecked(start..i) }));
        }
        self.string_escaped(start, i)
    }

    /// A string from `start` with an escape, a control character or no end
    /// at `i`.
    #[inline(never)]
    fn string_escaped(&mut self, start: usize, i: usize) -> Result<Cow<'a, str>, String> {
        let bytes = self.bytes();
        if let Some(0..=0x1f) = bytes.get(i) {
            self.pos = i;
            return Err(self.error("control character in a string"));
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
                    let run = self.pos + find_special(&bytes[self.pos..]);
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
    #[inline]
    pub fn number(&mut self) -> Result<Option<u64>, String> {
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
        // Anything but an integer of up to 19 digits is refused, as
        // serde_json refuses it, when it overflows an f64.
        if (!integer || i - start > 19)
            && !self.text[start..i].parse::<f64>().is_ok_and(f64::is_finite)
        {
            self.pos = start;
            return Err(self.error("number out of range"));
        }
        self.pos = i;
        Ok(integer
            .then(|| self.text[int_start..i].parse::<u64>().ok())
            .flatten())
    }

    /// Reads `true` or `false`, or `null` as `None`.
    #[inline]
    pub fn bool(&mut self) -> Result<Option<bool>, String> {
        self.skip_ws();
        let rest = &self.bytes()[self.pos..];
        for (word, value) in [
            (&b"true"[..], Some(true)),
            (b"false", Some(false)),
            (b"null", None),
        ] {
            if rest.starts_with(word) {
                self.pos += word.len();
                return Ok(value);
            }
        }
        Err(self.error("expected `true`, `false` or `null`"))
    }

    // Plain tokens. A caller that knows how a writer lays a value out reads
    // it with these, each true or `Some` only when the text goes on as
    // expected (white space skipped first) and consuming no more otherwise,
    // and falls back to the general calls from a clone of the reader taken
    // before: what they accept the general calls accept too, with the same
    // result, and nothing else.

    /// Consumes `token` (a punctuation mark, or a key with its quotes).
    #[inline(always)]
    pub fn take<const N: usize>(&mut self, token: &[u8; N]) -> bool {
        self.skip_ws();
        let found = self.bytes().get(self.pos..self.pos + N) == Some(token);
        if found {
            self.pos += N;
        }
        found
    }

    /// A string with no escape, borrowed.
    #[inline(always)]
    pub fn plain_string(&mut self) -> Option<&'a str> {
        self.skip_ws();
        let bytes = self.bytes();
        if bytes.get(self.pos) != Some(&b'"') {
            return None;
        }
        let start = self.pos + 1;
        let end = start + find_special(&bytes[start..]);
        if bytes.get(end) != Some(&b'"') {
            return None;
        }
        self.pos = end + 1;
        // SAFETY: `start` follows an ASCII quote and `end` is at one, in
        // text that is UTF-8: both are character boundaries.
        Some(unsafe { self.text.get_unchecked(start..end) })
    }

    /// A non-negative integer of at most 19 digits with no sign, fraction
    /// or exponent: what [`Reader::number`] gives as `Some` without
    /// parsing it as a float.
    #[inline(always)]
    pub fn plain_u64(&mut self) -> Option<u64> {
        self.skip_ws();
        let bytes = self.bytes();
        let mut i = self.pos;
        let mut value = 0u64;
        while let Some(&b) = bytes.get(i).filter(|b| b.is_ascii_digit()) {
            if i - self.pos == 19 {
                return None;
            }
            value = value * 10 + u64::from(b - b'0');
            i += 1;
        }
        let digits = i - self.pos;
        let leading_zero = digits > 1 && bytes[self.pos] == b'0';
        if digits == 0 || leading_zero || matches!(bytes.get(i), Some(b'.' | b'e' | b'E')) {
            return None;
        }
        self.pos = i;
        Some(value)
    }

    /// Notes a value `levels` deep read with the plain tokens, as
    /// [`Reader::begin_object`] and [`Reader::begin_array`] would have:
    /// false, and nothing noted, where they would refuse it as too deep.
    #[inline(always)]
    pub fn passed_nested(&mut self, levels: usize) -> bool {
        if self.depth + levels >= self.limit {
            return false;
        }
        self.deepest = self.deepest.max(self.depth + levels);
        true
    }

    /// Reads a list of non-negative integers; `None` when the value is
    /// anything else (it is consumed either way).
    pub fn u64_list(&mut self) -> Result<Option<Vec<u64>>, String> {
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
    pub fn skip_value(&mut self) -> Result<(), String> {
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
    pub fn skip_and_show(&mut self, max: usize) -> Result<String, String> {
        self.skip_ws();
        let start = self.pos;
        self.skip_value()?;
        Ok(shorten(&self.text[start..self.pos], max))
    }

    /// Checks that nothing but whitespace follows.
    #[inline]
    pub fn end(&mut self) -> Result<(), String> {
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
pub fn shorten(text: &str, max: usize) -> String {
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
pub fn validate(text: &str) -> Result<(), String> {
    let mut r = Reader::new(text);
    r.skip_value()?;
    r.end()
}

/// The line and column (both from 1; the column in characters) of byte
/// offset `pos` of `text`, for messages about a document people edit.
pub fn line_column(text: &str, pos: usize) -> (usize, usize) {
    let mut end = pos.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let before = &text[..end];
    let line = before.bytes().filter(|b| *b == b'\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    (line, before[line_start..].chars().count() + 1)
}

/// The offset of the first `"`, `\\` or control character in `bytes` (its
/// length when there is none), eight bytes at a time: strings are most of
/// the text of a header or a module tree.
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

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

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
    fn a_part_read_apart_joins_where_it_ends_and_nests_as_one_read() {
        let text = r#"{"a":[[1],[2,[3]]],"z":0}"#;
        let mut first = Reader::new(text);
        first.begin_object().unwrap();
        assert_eq!(first.next_key(true).unwrap().unwrap(), "a");
        first.begin_array().unwrap();
        assert!(first.next_element(true).unwrap());
        first.skip_value().unwrap();
        // The rest, read without knowing what encloses it.
        let mut part = Reader::part(text, first.offset());
        assert!(part.next_element(false).unwrap());
        part.skip_value().unwrap();
        assert!(!part.next_element(false).unwrap());
        assert_eq!(part.next_key(false).unwrap().unwrap(), "z");
        part.skip_value().unwrap();
        assert!(part.next_key(false).unwrap().is_none());
        assert!(first.join(&part));
        first.end().unwrap();
        assert_eq!(first.depth, 0);

        // Nesting counts both parts: refused where one reader refuses.
        for inner in [26, 27, 28, 40] {
            let text =
                "[".repeat(100) + "0," + &"[".repeat(inner) + &"]".repeat(inner) + &"]".repeat(100);
            let mut first = Reader::new(&text);
            for _ in 0..100 {
                first.begin_array().unwrap();
            }
            assert!(first.next_element(true).unwrap());
            first.skip_value().unwrap();
            let mut part = Reader::part(&text, first.offset());
            assert!(part.next_element(false).unwrap());
            part.skip_value().unwrap();
            for _ in 0..100 {
                assert!(!part.next_element(false).unwrap());
            }
            assert_eq!(first.join(&part), validate(&text).is_ok(), "{inner}");
        }
        // A part that closes more than is open does not join.
        let mut first = Reader::new("[0]");
        first.begin_array().unwrap();
        let mut part = Reader::part("[0]]]", 1);
        part.skip_value().unwrap();
        assert!(!part.next_element(false).unwrap());
        assert!(!part.next_element(false).unwrap());
        assert!(!first.join(&part));
    }

    #[test]
    fn plain_tokens_accept_only_what_the_general_calls_read_the_same() {
        for text in [
            "0",
            "7",
            "42 ",
            " 1234567890123456789",
            "12345678901234567890",
            "99999999999999999999",
            "00",
            "01",
            "-1",
            "1.5",
            "1e3",
            "2E1",
            "3,",
            "9]",
            "x",
            "",
            "\"a\"",
            "\"\"",
            " \"w\\u0041\"",
            "\"tab\tx\"",
            "\"unterminated",
            "\"caf\u{e9}\" ",
        ] {
            let mut plain = Reader::new(text);
            match plain.plain_u64() {
                Some(v) => {
                    let mut general = Reader::new(text);
                    assert_eq!(general.number(), Ok(Some(v)), "{text:?}");
                    assert_eq!(plain.offset(), general.offset(), "{text:?}");
                }
                None => {
                    assert_eq!(plain.offset(), text.len() - text.trim_start().len());
                }
            }
            let mut plain = Reader::new(text);
            match plain.plain_string() {
                Some(s) => {
                    let mut general = Reader::new(text);
                    assert_eq!(general.string().as_deref(), Ok(s), "{text:?}");
                    assert_eq!(plain.offset(), general.offset(), "{text:?}");
                }
                None => {
                    assert_eq!(plain.offset(), text.len() - text.trim_start().len());
                }
            }
        }
        assert_eq!(Reader::new(" 42,").plain_u64(), Some(42));
        assert_eq!(
            Reader::new("9999999999999999999").plain_u64(),
            Some(9_999_999_999_999_999_999)
        );
        assert_eq!(Reader::new(" \"a b\"").plain_string(), Some("a b"));
        let mut r = Reader::new(" {\"a\":[]}");
        assert!(!r.take(b"{\"b\""));
        assert_eq!(r.offset(), 1);
        assert!(r.take(b"{\"a\"") && r.take(b":") && r.take(b"[") && r.take(b"]"));
        assert!(r.passed_nested(2));
        assert!(!r.passed_nested(MAX_DEPTH));
    }

    #[test]
    fn shown_values_are_shortened() {
        let mut r = Reader::new(r#"{"a": [1, 2, 3, 4, 5, 6]}"#);
        assert_eq!(r.skip_and_show(10).unwrap(), r#"{"a": [1, …"#);
        assert_eq!(shorten("ééé", 3), "é…");
    }

    #[test]
    fn grammar_edge_cases_agree_with_serde_json() {
        for json in [
            r#"[0, -0, 1.5, -1.5e10, 2E-3, 1e+2, 123456789012345678901234567890]"#,
            r#"["\"\\\/\b\f\n\r\t", "\u00e9\ud83d\ude00", "é😀"]"#,
            r#"[true, false, null]"#,
            r#"[,1]"#,
            r#"{,}"#,
            r#"{1:2}"#,
            r#"{"a":1 "b":2}"#,
            r#"[01]"#,
            r#"[1e400]"#,
            r#"[-1e400]"#,
            r#"[1.5e308]"#,
            r#"["\ud800\u0041"]"#,
            "[\"a\u{1}\"]",
            r#"[tru]"#,
            r#"[True]"#,
            r#"{"a":1}}"#,
            r#"{"a":"#,
            r#"{"a"#,
            "   ",
            r#"{"a":[}"#,
            r#"[{]"#,
        ] {
            let serde = serde_json::from_str::<Value>(json).is_ok();
            assert_eq!(validate(json).is_ok(), serde, "{json:?}");
        }
    }

    #[test]
    fn strings_are_borrowed_unless_escaped() {
        let mut r = Reader::new(r#"["plain", "tab\there"]"#);
        r.begin_array().unwrap();
        assert!(r.next_element(true).unwrap());
        assert!(matches!(r.string().unwrap(), Cow::Borrowed("plain")));
        assert!(r.next_element(false).unwrap());
        assert!(matches!(r.string().unwrap(), Cow::Owned(s) if s == "tab\there"));
        assert!(!r.next_element(false).unwrap());
    }

    #[test]
    fn special_bytes_are_found_at_every_offset() {
        for len in 0..20 {
            for at in 0..=len {
                for special in [b'"', b'\\', 0x00, 0x1f] {
                    // Bytes that look like specials to a careless bit trick.
                    let mut bytes: Vec<u8> = (0..len)
                        .map(|i| [b'a', 0x20, 0x21, 0xff, 0x80, b'#', b']'][i % 7])
                        .collect();
                    if at < len {
                        bytes[at] = special;
                    }
                    assert_eq!(find_special(&bytes), at, "{bytes:?}");
                }
            }
        }
    }

    #[test]
    fn errors_and_positions_point_at_the_offending_byte() {
        let text = "{\n  \"a\": [1, 2,, 3]\n}";
        let mut r = Reader::new(text);
        let e = r.skip_value().unwrap_err();
        assert_eq!(e, "expected a value at byte 15");
        assert_eq!(line_column(text, r.offset()), (2, 14));
        assert_eq!(line_column("é\né", 5), (2, 2));
        let mut r = Reader::new(" [null, true] ");
        assert_eq!(r.pos(), 1);
        r.begin_array().unwrap();
        assert!(r.next_element(true).unwrap());
        assert_eq!(r.bool().unwrap(), None);
        assert!(r.next_element(false).unwrap());
        assert_eq!(r.bool().unwrap(), Some(true));
    }
}
