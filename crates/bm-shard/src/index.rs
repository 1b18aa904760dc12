//! Shard indexes: transformers' `{"metadata":{...},"weight_map":{name: file}}`
//! and Accelerate's flat `{name: file}` form, and the rule that keeps every
//! shard a plain file inside the index's own folder.

use std::path::{Component, Path, PathBuf};

use serde_json::Value;

use crate::Error;

/// A parsed index: which file holds each tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Index {
    /// `name -> shard file` in file order, the file relative to the index.
    pub weight_map: Vec<(String, String)>,
    /// `metadata.total_size` when present.
    pub total_size: Option<u64>,
}

impl Index {
    /// Parses index JSON (`path` only names it in errors). Shard names are
    /// checked with [`check_shard_name`].
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<Index, Error> {
        let text = std::str::from_utf8(bytes).map_err(|e| {
            Error::index(
                path,
                format!("not UTF-8 (invalid byte at offset {})", e.valid_up_to()),
            )
        })?;
        let value: Value = serde_json::from_str(text)
            .map_err(|e| Error::index(path, format!("not valid JSON: {e}")))?;
        let Value::Object(mut root) = value else {
            return Err(Error::index(path, "expected a JSON object"));
        };
        let (map, total_size) = match root.remove("weight_map") {
            Some(Value::Object(map)) => {
                let total_size = match root.get("metadata").and_then(|m| m.get("total_size")) {
                    None => None,
                    Some(v) => Some(v.as_u64().ok_or_else(|| {
                        Error::index(
                            path,
                            format!(
                                "`metadata.total_size` must be a non-negative integer, found {v}"
                            ),
                        )
                    })?),
                };
                (map, total_size)
            }
            Some(other) => {
                return Err(Error::index(
                    path,
                    format!("`weight_map` must be an object of tensor name to file, found {other}"),
                ));
            }
            // Accelerate's flat form: the whole object is the map.
            None => (root, None),
        };
        let mut weight_map = Vec::with_capacity(map.len());
        for (name, file) in map {
            let Value::String(file) = file else {
                return Err(Error::index(
                    path,
                    format!("tensor {name:?} maps to {file}, expected a shard file name"),
                ));
            };
            check_shard_name(path, &name, &file)?;
            weight_map.push((name, file));
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

/// Rejects shard names that could reach outside the index's folder: empty,
/// absolute, or with a `..` component. (Symbolic links are checked when the
/// file is resolved, see [`resolve_shard`].)
pub fn check_shard_name(index: &Path, tensor: &str, file: &str) -> Result<(), Error> {
    let unsafe_name = |why: &str| {
        Error::index(
            index,
            format!("tensor {tensor:?} names shard {file:?}, which {why}; refusing to read it"),
        )
    };
    if file.is_empty() {
        return Err(unsafe_name("is empty"));
    }
    let p = Path::new(file);
    if p.is_absolute() || file.starts_with('/') || file.starts_with('\\') || p.has_root() {
        return Err(unsafe_name("is an absolute path"));
    }
    if file.contains('\0') {
        return Err(unsafe_name("contains a NUL byte"));
    }
    for c in p.components() {
        match c {
            Component::ParentDir => return Err(unsafe_name("contains `..`")),
            Component::Prefix(_) | Component::RootDir => {
                return Err(unsafe_name("is an absolute path"));
            }
            Component::CurDir | Component::Normal(_) => {}
        }
    }
    if file.split(['/', '\\']).any(|part| part == "..") {
        return Err(unsafe_name("contains `..`"));
    }
    Ok(())
}

/// Joins a checked shard name to the index's folder and makes sure the
/// result exists and, after following symbolic links, still lies inside
/// that folder. Only file metadata is touched, never the contents.
pub fn resolve_shard(index: &Path, folder: &Path, file: &str) -> Result<PathBuf, Error> {
    let joined = folder.join(file);
    let real = match joined.canonicalize() {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::index(
                index,
                format!("shard {file:?} does not exist ({})", joined.display()),
            ));
        }
        Err(e) => return Err(Error::io(&joined, "resolving", e)),
    };
    let real_folder = folder
        .canonicalize()
        .map_err(|e| Error::io(folder, "resolving", e))?;
    if !real.starts_with(&real_folder) {
        return Err(Error::index(
            index,
            format!(
                "shard {file:?} resolves to {}, outside the checkpoint folder {}; refusing to read it",
                real.display(),
                real_folder.display()
            ),
        ));
    }
    if !real.is_file() {
        return Err(Error::index(index, format!("shard {file:?} is not a file")));
    }
    Ok(joined)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[cfg(unix)]
    #[test]
    fn symlinks_out_of_the_folder_are_refused() {
        let outside = tempfile::tempdir().unwrap();
        let target = outside.path().join("t.safetensors");
        std::fs::write(&target, b"x").unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join("link.safetensors")).unwrap();
        let index = dir.path().join("m.index.json");
        let e = resolve_shard(&index, dir.path(), "link.safetensors")
            .unwrap_err()
            .to_string();
        assert!(e.contains("outside the checkpoint folder"), "{e}");
        let e = resolve_shard(&index, dir.path(), "missing.safetensors")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("shard \"missing.safetensors\" does not exist"),
            "{e}"
        );
    }
}
