//! The safetensors header: an 8-byte little-endian length, then that many
//! bytes of UTF-8 JSON, then the data buffer.
//!
//! The parser reads the JSON entry by entry (see [`crate::json::Reader`])
//! so that every rule of the format gets its own message naming the file
//! and tensor, and so that memory stays a small multiple of the header:
//! the header is at most 100 MB, UTF-8, a JSON object; `__metadata__` maps
//! strings to strings; each tensor has a known dtype, a shape and
//! `data_offsets` whose length matches dtype × shape; no key appears twice;
//! and the tensors, sorted by offset, tile the data buffer exactly (no
//! overlap, no gap, nothing past the end, nothing left over), the rules
//! safetensors itself enforces. Everything is O(n log n) in the number of
//! tensors.

use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;

use bm_tensor::{DType, TensorMeta};

use crate::Error;
use crate::json::{Kind, Reader};

/// The largest header safetensors accepts (bytes of JSON).
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// How much of a wrongly typed value an error message shows.
const SHOWN: usize = 60;

/// One tensor of a safetensors header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderTensor {
    /// Name as stored.
    pub name: String,
    /// Dtype and shape.
    pub meta: TensorMeta,
    /// Byte range relative to the start of the data buffer.
    pub data_offsets: (u64, u64),
}

/// A parsed and validated safetensors header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// Length of the JSON part, as stored in the first 8 bytes.
    pub json_len: u64,
    /// The `__metadata__` entries, in file order.
    pub metadata: Option<Vec<(String, String)>>,
    /// The tensors, sorted by data offset.
    pub tensors: Vec<HeaderTensor>,
}

impl Header {
    /// Offset of the data buffer from the start of the file.
    pub fn data_start(&self) -> u64 {
        8 + self.json_len
    }

    /// Reads and validates the header of the safetensors file at `path`,
    /// reading only the first `8 + json_len` bytes. A FIFO, socket or
    /// device is refused without being opened. Returns the header and the
    /// file's length.
    pub fn read(path: &Path) -> Result<(Header, u64), Error> {
        let mut file = crate::paths::open_regular(path)?;
        Self::read_from(&mut file, path)
    }

    /// [`Header::read`] from a file already open (`path` names it in
    /// errors).
    pub fn read_from(file: &mut File, path: &Path) -> Result<(Header, u64), Error> {
        let file_len = file
            .metadata()
            .map_err(|e| Error::io(path, "reading the size of", e))?
            .len();
        let json_len = check_prefix(path, file_len, |buf| {
            file.read_exact(buf)
                .map_err(|e| Error::io(path, "reading", e))
        })?;
        let mut json = vec![0u8; json_len as usize];
        file.read_exact(&mut json)
            .map_err(|e| Error::io(path, "reading the header of", e))?;
        let header = parse_json(path, &json, json_len, file_len - 8 - json_len)?;
        Ok((header, file_len))
    }

    /// Parses and validates the header of a whole safetensors file held in
    /// memory (`path` only names it in errors).
    pub fn parse(path: &Path, file: &[u8]) -> Result<Header, Error> {
        let file_len = file.len() as u64;
        let json_len = check_prefix(path, file_len, |buf| {
            buf.copy_from_slice(&file[..8]);
            Ok(())
        })?;
        let json = &file[8..8 + json_len as usize];
        parse_json(path, json, json_len, file_len - 8 - json_len)
    }
}

/// Checks the 8-byte prefix against the file length; returns the JSON length.
fn check_prefix(
    path: &Path,
    file_len: u64,
    read_prefix: impl FnOnce(&mut [u8; 8]) -> Result<(), Error>,
) -> Result<u64, Error> {
    if file_len < 8 {
        return Err(Error::header(
            path,
            format!(
                "the file is {file_len} bytes, too short for the 8-byte header length (truncated?)"
            ),
        ));
    }
    let mut prefix = [0u8; 8];
    read_prefix(&mut prefix)?;
    let json_len = u64::from_le_bytes(prefix);
    if json_len > MAX_HEADER_LEN {
        return Err(Error::header(
            path,
            format!("header length {json_len} exceeds the 100000000-byte limit"),
        ));
    }
    if json_len > file_len - 8 {
        return Err(Error::header(
            path,
            format!(
                "header length {json_len} is larger than the file ({file_len} bytes; truncated?)"
            ),
        ));
    }
    Ok(json_len)
}

fn parse_json(path: &Path, json: &[u8], json_len: u64, data_len: u64) -> Result<Header, Error> {
    let text = std::str::from_utf8(json).map_err(|e| {
        Error::header(
            path,
            format!(
                "the header is not UTF-8 (invalid byte at header offset {})",
                e.valid_up_to()
            ),
        )
    })?;
    let syntax = |e: String| Error::header(path, format!("the header is not valid JSON: {e}"));
    let mut r = Reader::new(text);
    if r.peek().map_err(syntax)? != Kind::Object {
        crate::json::validate(text).map_err(syntax)?;
        return Err(Error::header(path, "the header is not a JSON object"));
    }
    r.begin_object().map_err(syntax)?;
    let mut metadata = None;
    let mut tensors = Vec::new();
    let mut first = true;
    while let Some(name) = r.next_key(first).map_err(syntax)? {
        first = false;
        if name == "__metadata__" {
            if metadata.is_some() {
                return Err(Error::header(path, "`__metadata__` appears twice"));
            }
            metadata = Some(parse_metadata(path, &mut r)?);
        } else {
            tensors.push(parse_tensor(path, name.into_owned(), &mut r)?);
        }
    }
    r.end().map_err(syntax)?;
    check_unique(path, &tensors)?;
    check_layout(path, &mut tensors, data_len)?;
    Ok(Header {
        json_len,
        metadata,
        tensors,
    })
}

fn parse_metadata(path: &Path, r: &mut Reader<'_>) -> Result<Vec<(String, String)>, Error> {
    let syntax = |e: String| Error::header(path, format!("the header is not valid JSON: {e}"));
    if r.peek().map_err(syntax)? != Kind::Object {
        let found = r.skip_and_show(SHOWN).map_err(syntax)?;
        return Err(Error::header(
            path,
            format!("`__metadata__` must be an object of strings, found {found}"),
        ));
    }
    r.begin_object().map_err(syntax)?;
    let mut entries: Vec<(String, String)> = Vec::new();
    let mut first = true;
    while let Some(key) = r.next_key(first).map_err(syntax)? {
        first = false;
        if r.peek().map_err(syntax)? != Kind::String {
            let found = r.skip_and_show(SHOWN).map_err(syntax)?;
            return Err(Error::header(
                path,
                format!("`__metadata__` key {key:?} must map to a string, found {found}"),
            ));
        }
        let value = r.string().map_err(syntax)?.into_owned();
        entries.push((key.into_owned(), value));
    }
    let mut keys: Vec<&str> = entries.iter().map(|(k, _)| k.as_str()).collect();
    keys.sort_unstable();
    if let Some(w) = keys.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::header(
            path,
            format!("`__metadata__` key {:?} appears twice", w[0]),
        ));
    }
    Ok(entries)
}

fn parse_tensor(path: &Path, name: String, r: &mut Reader<'_>) -> Result<HeaderTensor, Error> {
    let bad = |problem: String| Error::header(path, format!("tensor {name:?}: {problem}"));
    let syntax = |e: String| Error::header(path, format!("the header is not valid JSON: {e}"));
    if r.peek().map_err(syntax)? != Kind::Object {
        let found = r.skip_and_show(SHOWN).map_err(syntax)?;
        return Err(bad(format!("expected an object, found {found}")));
    }
    r.begin_object().map_err(syntax)?;
    let (mut dtype, mut shape, mut offsets) = (None, None, None);
    let mut first = true;
    while let Some(key) = r.next_key(first).map_err(syntax)? {
        first = false;
        let seen = match key.as_ref() {
            "dtype" => dtype.is_some(),
            "shape" => shape.is_some(),
            "data_offsets" => offsets.is_some(),
            // Other keys are ignored, as safetensors ignores them.
            _ => {
                r.skip_value().map_err(syntax)?;
                continue;
            }
        };
        if seen {
            return Err(bad(format!("`{key}` appears twice")));
        }
        match key.as_ref() {
            "dtype" => {
                if r.peek().map_err(syntax)? != Kind::String {
                    let found = r.skip_and_show(SHOWN).map_err(syntax)?;
                    return Err(bad(format!("`dtype` must be a string, found {found}")));
                }
                let s = r.string().map_err(syntax)?;
                dtype = Some(DType::from_safetensors_str(&s).ok_or_else(|| {
                    bad(format!(
                        "unknown dtype {:?} (expected one of F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL F8_E4M3 F8_E5M2)",
                        crate::json::shorten(&s, SHOWN)
                    ))
                })?);
            }
            "shape" => {
                let mut probe = r.clone();
                let list = r.u64_list().map_err(syntax)?.ok_or_else(|| {
                    let found = probe.skip_and_show(SHOWN).unwrap_or_default();
                    bad(format!(
                        "`shape` must be a list of non-negative integers, found {found}"
                    ))
                })?;
                shape = Some(list);
            }
            _ => {
                let mut probe = r.clone();
                let list = r
                    .u64_list()
                    .map_err(syntax)?
                    .filter(|o| o.len() == 2)
                    .ok_or_else(|| {
                        let found = probe.skip_and_show(SHOWN).unwrap_or_default();
                        bad(format!(
                            "`data_offsets` must be two non-negative integers, found {found}"
                        ))
                    })?;
                offsets = Some((list[0], list[1]));
            }
        }
    }
    let dtype = dtype.ok_or_else(|| bad("missing `dtype`".into()))?;
    let shape = shape.ok_or_else(|| bad("missing `shape`".into()))?;
    let (begin, end) = offsets.ok_or_else(|| bad("missing `data_offsets`".into()))?;
    let shape: Vec<usize> = shape
        .into_iter()
        .map(usize::try_from)
        .collect::<Result<_, _>>()
        .map_err(|_| bad("a dimension does not fit in memory addresses".into()))?;
    if begin > end {
        return Err(bad(format!(
            "data_offsets [{begin}, {end}] end before they begin"
        )));
    }
    let meta = TensorMeta::new(dtype, shape);
    let needed = meta
        .checked_byte_len()
        .ok_or_else(|| bad(format!("shape {:?} of {dtype} overflows", meta.shape)))?;
    if end - begin != needed as u64 {
        return Err(bad(format!(
            "data_offsets [{begin}, {end}] hold {} bytes but {dtype} of shape {:?} needs {needed}",
            end - begin,
            meta.shape
        )));
    }
    Ok(HeaderTensor {
        name,
        meta,
        data_offsets: (begin, end),
    })
}

/// A tensor name given twice is an error (JSON parsers would silently keep
/// one of them).
fn check_unique(path: &Path, tensors: &[HeaderTensor]) -> Result<(), Error> {
    let mut names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    names.sort_unstable();
    match names.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => Err(Error::header(
            path,
            format!("tensor {:?} appears twice in the header", w[0]),
        )),
        None => Ok(()),
    }
}

/// Sorts by offset and checks the tensors tile `0..data_len` exactly.
fn check_layout(path: &Path, tensors: &mut [HeaderTensor], data_len: u64) -> Result<(), Error> {
    tensors.sort_by_key(|t| t.data_offsets);
    if let Some(t) = tensors.iter().find(|t| t.data_offsets.1 > data_len) {
        let (b, e) = t.data_offsets;
        return Err(Error::header(
            path,
            format!(
                "tensor {:?}: data_offsets [{b}, {e}] reach past the end of the data buffer ({data_len} bytes; truncated file?)",
                t.name
            ),
        ));
    }
    let mut covered = 0u64;
    let mut previous: Option<&HeaderTensor> = None;
    for t in tensors.iter() {
        let (b, e) = t.data_offsets;
        if b < covered {
            let p = previous.expect("covered > 0 implies a previous tensor");
            return Err(Error::header(
                path,
                format!(
                    "tensors {:?} (bytes {}..{}) and {:?} (bytes {b}..{e}) overlap",
                    p.name, p.data_offsets.0, p.data_offsets.1, t.name
                ),
            ));
        }
        if b > covered {
            return Err(Error::header(
                path,
                format!(
                    "bytes {covered}..{b} of the data buffer belong to no tensor (gap before {:?})",
                    t.name
                ),
            ));
        }
        covered = e;
        previous = Some(t);
    }
    if covered != data_len {
        return Err(Error::header(
            path,
            format!(
                "the data buffer holds {data_len} bytes but the tensors cover only the first {covered}"
            ),
        ));
    }
    Ok(())
}

/// Position of a dtype in the safetensors crate's `Dtype` enum, which
/// orders the tensors of a file it writes (descending, then by name).
fn safetensors_rank(dtype: DType) -> u8 {
    match dtype {
        DType::Bool => 0,
        DType::U8 => 4,
        DType::I8 => 5,
        DType::F8E5M2 => 6,
        DType::F8E4M3 => 7,
        DType::I16 => 11,
        DType::F16 => 13,
        DType::BF16 => 14,
        DType::I32 => 15,
        DType::F32 => 17,
        DType::F64 => 19,
        DType::I64 => 20,
    }
}

/// Orders tensors as `safetensors.save_file` does: descending dtype in the
/// safetensors enum (so larger alignments come first), then by name. With
/// the 8-byte-padded header this keeps every tensor aligned to its element.
pub(crate) fn safetensors_order(a: (&str, DType), b: (&str, DType)) -> std::cmp::Ordering {
    safetensors_rank(b.1)
        .cmp(&safetensors_rank(a.1))
        .then_with(|| a.0.cmp(b.0))
}

/// Writes a header exactly as the safetensors crate does: the length
/// prefix, then `__metadata__` first, tensors in the given order with
/// consecutive offsets, JSON padded with spaces to a multiple of 8. Returns
/// the data length. The JSON is streamed to `out` (a first pass only counts
/// its bytes, for the prefix), so no copy of it is held, whatever the
/// number of tensors.
pub(crate) fn write_header(
    out: &mut dyn Write,
    metadata: &[(&str, &str)],
    tensors: &[(&str, DType, &[usize])],
) -> std::io::Result<u64> {
    let mut counter = Counter(0);
    let data_len = write_json(&mut counter, metadata, tensors)?;
    let padded = counter.0.next_multiple_of(8);
    out.write_all(&padded.to_le_bytes())?;
    write_json(out, metadata, tensors)?;
    out.write_all(&b"        "[..(padded - counter.0) as usize])?;
    Ok(data_len)
}

/// A writer that only counts.
struct Counter(u64);

impl Write for Counter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn write_json(
    out: &mut dyn Write,
    metadata: &[(&str, &str)],
    tensors: &[(&str, DType, &[usize])],
) -> std::io::Result<u64> {
    // Strings go through serde_json so that escapes match the safetensors
    // crate's (which serialises with serde_json) byte for byte.
    fn string(out: &mut dyn Write, s: &str) -> std::io::Result<()> {
        serde_json::to_writer(out, s).map_err(std::io::Error::from)
    }
    out.write_all(b"{")?;
    if !metadata.is_empty() {
        out.write_all(b"\"__metadata__\":{")?;
        for (i, (k, v)) in metadata.iter().enumerate() {
            if i > 0 {
                out.write_all(b",")?;
            }
            string(out, k)?;
            out.write_all(b":")?;
            string(out, v)?;
        }
        out.write_all(b"}")?;
    }
    let mut offset = 0u64;
    for (i, &(name, dtype, shape)) in tensors.iter().enumerate() {
        if i > 0 || !metadata.is_empty() {
            out.write_all(b",")?;
        }
        // Shapes are checked not to overflow before anything is written.
        let len = (shape.iter().product::<usize>() * dtype.size_in_bytes()) as u64;
        string(out, name)?;
        out.write_all(b":{\"dtype\":")?;
        string(out, dtype.as_safetensors_str())?;
        out.write_all(b",\"shape\":[")?;
        for (k, d) in shape.iter().enumerate() {
            if k > 0 {
                out.write_all(b",")?;
            }
            write!(out, "{d}")?;
        }
        write!(out, "],\"data_offsets\":[{},{}]}}", offset, offset + len)?;
        offset += len;
    }
    out.write_all(b"}")?;
    Ok(offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(json: &str, data: &[u8]) -> Vec<u8> {
        let mut f = (json.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(json.as_bytes());
        f.extend_from_slice(data);
        f
    }

    fn err(bytes: &[u8]) -> String {
        Header::parse(Path::new("x.safetensors"), bytes)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn parses_a_valid_header_in_offset_order() {
        let json = r#"{"b":{"dtype":"F32","shape":[2],"data_offsets":[2,10]},"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[],"data_offsets":[0,2]}}"#;
        let h = Header::parse(Path::new("x"), &file(json, &[0; 10])).unwrap();
        assert_eq!(h.metadata, Some(vec![("format".into(), "pt".into())]));
        let names: Vec<_> = h.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(h.tensors[1].meta, TensorMeta::new(DType::F32, [2]));
        assert_eq!(h.data_start(), 8 + json.len() as u64);
    }

    #[test]
    fn truncated_and_oversized_lengths_are_named() {
        assert!(err(&[1, 2, 3]).contains("too short"), "{}", err(&[1, 2, 3]));
        let mut f = 1000u64.to_le_bytes().to_vec();
        f.extend_from_slice(b"{}");
        let e = err(&f);
        assert!(
            e.contains("x.safetensors") && e.contains("header length 1000 is larger than the file"),
            "{e}"
        );
        let f = (MAX_HEADER_LEN + 1).to_le_bytes();
        assert!(err(&f).contains("exceeds the 100000000-byte limit"));
    }

    #[test]
    fn non_utf8_and_non_json_headers_are_rejected() {
        let mut f = 4u64.to_le_bytes().to_vec();
        f.extend_from_slice(&[b'{', 0xff, b'}', b' ']);
        assert!(err(&f).contains("not UTF-8"), "{}", err(&f));
        assert!(err(&file("{oops", &[])).contains("not valid JSON"));
        assert!(err(&file("[1]", &[])).contains("not a JSON object"));
    }

    #[test]
    fn bad_tensor_entries_name_the_tensor() {
        let e = err(&file(
            r#"{"w":{"dtype":"F31","shape":[1],"data_offsets":[0,4]}}"#,
            &[0; 4],
        ));
        assert!(e.contains("tensor \"w\": unknown dtype \"F31\""), "{e}");
        let e = err(&file(
            r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
            &[0; 4],
        ));
        assert!(
            e.contains("hold 4 bytes but F32 of shape [2] needs 8"),
            "{e}"
        );
        let e = err(&file(
            r#"{"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
            &[0; 4],
        ));
        assert!(e.contains("`shape` must be"), "{e}");
        let e = err(&file(r#"{"w":{"dtype":"F32","shape":[1]}}"#, &[0; 4]));
        assert!(e.contains("missing `data_offsets`"), "{e}");
        let e = err(&file(r#"{"__metadata__":{"a":1}}"#, &[]));
        assert!(
            e.contains("`__metadata__` key \"a\" must map to a string"),
            "{e}"
        );
    }

    #[test]
    fn offsets_must_tile_the_data_buffer() {
        let two = |a: &str, b: &str, data: usize| {
            err(&file(
                &format!(
                    r#"{{"a":{{"dtype":"U8","shape":[4],"data_offsets":{a}}},"b":{{"dtype":"U8","shape":[4],"data_offsets":{b}}}}}"#
                ),
                &vec![0; data],
            ))
        };
        let e = two("[0,4]", "[2,6]", 6);
        assert!(
            e.contains("tensors \"a\" (bytes 0..4) and \"b\" (bytes 2..6) overlap"),
            "{e}"
        );
        let e = two("[0,4]", "[4,8]", 6);
        assert!(
            e.contains("\"b\": data_offsets [4, 8] reach past the end of the data buffer (6 bytes"),
            "{e}"
        );
        let e = two("[0,4]", "[5,9]", 9);
        assert!(
            e.contains("bytes 4..5 of the data buffer belong to no tensor"),
            "{e}"
        );
        let e = two("[0,4]", "[4,8]", 10);
        assert!(e.contains("cover only the first 8"), "{e}");
    }

    #[test]
    fn encode_matches_the_safetensors_crate() {
        let a = TensorMeta::new(DType::F32, [2]);
        let b = TensorMeta::new(DType::BF16, [3]);
        let mut bytes = Vec::new();
        let len = write_header(
            &mut bytes,
            &[("format", "pt")],
            &[("a", a.dtype, &a.shape), ("b", b.dtype, &b.shape)],
        )
        .unwrap();
        assert_eq!(len, 14);
        let json = r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[3],"data_offsets":[8,14]}}"#;
        let padded = json.len().next_multiple_of(8);
        assert_eq!(
            u64::from_le_bytes(bytes[..8].try_into().unwrap()),
            padded as u64
        );
        assert_eq!(&bytes[8..8 + json.len()], json.as_bytes());
        assert!(bytes[8 + json.len()..].iter().all(|&c| c == b' '));
        let mut whole = bytes.clone();
        whole.extend_from_slice(&[0; 14]);
        let st = safetensors::SafeTensors::deserialize(&whole).unwrap();
        assert_eq!(st.tensor("b").unwrap().shape(), &[3]);
    }

    #[test]
    fn write_order_follows_safetensors() {
        let mut v = [
            ("z", DType::U8),
            ("b", DType::F32),
            ("a", DType::F32),
            ("c", DType::I64),
            ("d", DType::BF16),
        ];
        v.sort_by(|x, y| safetensors_order(*x, *y));
        assert_eq!(v.iter().map(|x| x.0).collect::<String>(), "cabdz");
    }
}
