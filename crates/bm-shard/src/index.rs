//! Shard indexes: transformers' `{"metadata":{...},"weight_map":{name: file}}`
//! and Accelerate's flat `{name: file}` form, and the rule that keeps every
//! shard a plain file inside the index's own folder.

use std::path::Path;

use crate::Error;
use crate::json::{Kind, Reader};
use crate::paths::{check_name, normalize};

/// A parsed index: which file holds each tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Index {
    /// `name -> shard file` in file order, the file relative to the index
    /// and normalised (`./a.safetensors` is `a.safetensors`).
    pub weight_map: Vec<(String, String)>,
    /// `metadata.total_size` when present.
    pub total_size: Option<u64>,
}

impl Index {
    /// Parses index JSON (`path` only names it in errors). Shard names are
    /// checked with [`check_shard_name`] and normalised (`./a` is `a`); a
    /// tensor listed twice is an error. Memory stays a small multiple of the
    /// text: entries are read one by one into the map.
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<Index, Error> {
        let syntax = syntax_error(path);
        let mut r = open_object(path, bytes)?;
        let mut weight_map: Option<Vec<(String, String)>> = None;
        let mut total_size: Option<Result<u64, String>> = None;
        // Accelerate's flat form: the whole object is the map. Collected
        // until a `weight_map` shows the transformers form.
        let mut flat: Vec<(String, String)> = Vec::new();
        let mut flat_problem: Option<Error> = None;
        let mut first = true;
        while let Some(key) = r.next_key(first).map_err(syntax)? {
            first = false;
            if key == "weight_map" {
                if weight_map.is_some() {
                    return Err(Error::index(path, "`weight_map` appears twice"));
                }
                if r.peek().map_err(syntax)? != Kind::Object {
                    let found = r.skip_and_show(SHOWN).map_err(syntax)?;
                    return Err(Error::index(
                        path,
                        format!(
                            "`weight_map` must be an object of tensor name to file, found {found}"
                        ),
                    ));
                }
                weight_map = Some(read_map(path, &mut r)?);
                continue;
            }
            if key == "metadata" && r.peek().map_err(syntax)? == Kind::Object {
                let mut again = r.clone();
                total_size = read_total_size(&mut r).map_err(syntax)?;
                if flat_problem.is_none() {
                    let found = again.skip_and_show(SHOWN).map_err(syntax)?;
                    flat_problem = Some(not_a_file(path, &key, &found));
                }
                continue;
            }
            if r.peek().map_err(syntax)? == Kind::String {
                let file = r.string().map_err(syntax)?.into_owned();
                flat.push((key.into_owned(), file));
            } else {
                let found = r.skip_and_show(SHOWN).map_err(syntax)?;
                flat_problem.get_or_insert_with(|| not_a_file(path, &key, &found));
            }
        }
        r.end().map_err(syntax)?;
        let (mut weight_map, total_size) = match weight_map {
            Some(map) => {
                let total_size = total_size.transpose().map_err(|found| {
                    Error::index(
                        path,
                        format!(
                            "`metadata.total_size` must be a non-negative integer, found {found}"
                        ),
                    )
                })?;
                (map, total_size)
            }
            None => match flat_problem {
                Some(e) => return Err(e),
                None => (flat, None),
            },
        };
        for (name, file) in &mut weight_map {
            check_shard_name(path, name, file)?;
            *file = normalize(file);
        }
        let mut names: Vec<&str> = weight_map.iter().map(|(n, _)| n.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::index(
                path,
                format!("tensor {:?} is listed twice", w[0]),
            ));
        }
        Ok(Index {
            weight_map,
            total_size,
        })
    }

    /// The shard files, sorted and deduplicated (Accelerate's order).
    pub fn shard_files(&self) -> Vec<&str> {
        let mut files: Vec<&str> = self.weight_map.iter().map(|(_, f)| f.as_str()).collect();
        files.sort_unstable();
        files.dedup();
        files
    }
}

/// How much of a wrongly typed value an error message shows.
const SHOWN: usize = 60;

fn not_a_file(path: &Path, name: &str, found: &str) -> Error {
    Error::index(
        path,
        format!("tensor {name:?} maps to {found}, expected a shard file name"),
    )
}

/// Opens an index-like file's text (a shard index, an offload
/// `index.json`): UTF-8 whose top level is a JSON object. Returns the
/// reader inside that object; errors name `path`.
pub(crate) fn open_object<'a>(path: &Path, bytes: &'a [u8]) -> Result<Reader<'a>, Error> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        Error::index(
            path,
            format!("not UTF-8 (invalid byte at offset {})", e.valid_up_to()),
        )
    })?;
    let syntax = syntax_error(path);
    let mut r = Reader::new(text);
    if r.peek().map_err(syntax)? != Kind::Object {
        crate::json::validate(text).map_err(syntax)?;
        return Err(Error::index(path, "expected a JSON object"));
    }
    r.begin_object().map_err(syntax)?;
    Ok(r)
}

/// The error of a JSON syntax problem in the index-like file at `path`.
pub(crate) fn syntax_error(path: &Path) -> impl Fn(String) -> Error + Copy + '_ {
    move |e| Error::index(path, format!("not valid JSON: {e}"))
}

/// Reads `{name: file, ...}` (the `{` not yet consumed).
fn read_map(path: &Path, r: &mut Reader<'_>) -> Result<Vec<(String, String)>, Error> {
    let syntax = syntax_error(path);
    r.begin_object().map_err(syntax)?;
    let mut map = Vec::new();
    let mut first = true;
    while let Some(name) = r.next_key(first).map_err(syntax)? {
        first = false;
        if r.peek().map_err(syntax)? != Kind::String {
            let found = r.skip_and_show(SHOWN).map_err(syntax)?;
            return Err(not_a_file(path, &name, &found));
        }
        let file = r.string().map_err(syntax)?.into_owned();
        map.push((name.into_owned(), file));
    }
    Ok(map)
}

/// Reads the `metadata` object (the `{` not yet consumed) for its
/// `total_size`: `Err(text shown)` when that is not a non-negative integer.
fn read_total_size(r: &mut Reader<'_>) -> Result<Option<Result<u64, String>>, String> {
    r.begin_object()?;
    let mut total = None;
    let mut first = true;
    while let Some(key) = r.next_key(first)? {
        first = false;
        if key != "total_size" {
            r.skip_value()?;
            continue;
        }
        let mut again = r.clone();
        let value = match r.peek()? {
            Kind::Number => r.number()?,
            _ => {
                r.skip_value()?;
                None
            }
        };
        total = Some(match value {
            Some(v) => Ok(v),
            None => Err(again.skip_and_show(SHOWN)?),
        });
    }
    Ok(total)
}

/// Rejects shard names that could reach outside the index's folder as
/// text: empty, absolute, with a `..` component or a NUL byte. (Where a
/// name leads through symbolic links is checked when the checkpoint is
/// opened, before any shard is read.)
pub fn check_shard_name(index: &Path, tensor: &str, file: &str) -> Result<(), Error> {
    check_name(file).map_err(|problem| {
        Error::index(
            index,
            format!("tensor {tensor:?} names shard {file:?}, which {problem}"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn parse(s: &str) -> Result<Index, Error> {
        Index::parse(Path::new("m.index.json"), s.as_bytes())
    }

    #[test]
    fn reads_both_forms() {
        let hf = parse(
            r#"{"metadata":{"total_size":12},"weight_map":{"b":"2.safetensors","a":"1.safetensors","c":"1.safetensors"}}"#,
        )
        .unwrap();
        assert_eq!(hf.total_size, Some(12));
        assert_eq!(hf.weight_map[0], ("b".into(), "2.safetensors".into()));
        assert_eq!(hf.shard_files(), ["1.safetensors", "2.safetensors"]);
        let flat = parse(r#"{"linear1.weight":"part1.safetensors"}"#).unwrap();
        assert_eq!(flat.total_size, None);
        assert_eq!(flat.weight_map.len(), 1);
    }

    #[test]
    fn malformed_indexes_name_the_key() {
        let e = parse(r#"{"weight_map":[1]}"#).unwrap_err().to_string();
        assert!(
            e.starts_with("m.index.json: invalid index: `weight_map` must be"),
            "{e}"
        );
        let e = parse(r#"{"metadata":{"total_size":1},"x":"a"}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("tensor \"metadata\" maps to"), "{e}");
        let e = parse("{").unwrap_err().to_string();
        assert!(e.contains("not valid JSON"), "{e}");
        let e = Index::parse(Path::new("i.json"), b"\xff")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not UTF-8"), "{e}");
    }

    #[test]
    fn escaping_shard_names_are_refused() {
        for (file, why) in [
            ("/etc/passwd", "absolute"),
            ("../secret.safetensors", "`..`"),
            ("sub/../../x", "`..`"),
            ("..\\x", "`..`"),
            ("", "empty"),
        ] {
            let e = parse(&format!(
                r#"{{"weight_map":{{"w":{}}}}}"#,
                Value::from(file)
            ))
            .unwrap_err()
            .to_string();
            assert!(e.contains("tensor \"w\"") && e.contains(why), "{file}: {e}");
        }
        assert!(parse(r#"{"weight_map":{"w":"./sub/x.safetensors"}}"#).is_ok());
    }
}
