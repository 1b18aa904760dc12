//! Accelerate's disk-offload folder, byte-compatible.
//!
//! Layout (Accelerate `utils/offload.py`): one `<name>.dat` per tensor
//! holding its raw little-endian bytes with no header (a 0-d tensor is
//! stored as one element), and one `index.json` mapping each name to
//! `{"dtype": "<numpy name>", "shape": [...]}`, written with `indent=2` and
//! no trailing newline, and merged into any existing index. bf16 is
//! `"bfloat16"` (its bits stored as int16); fp8 is `"float8_e4m3fn"` /
//! `"float8_e5m2"`.
//!
//! transformers also writes entries that point into a safetensors file
//! instead, `{"safetensors_file": path, "weight_name": name, "dtype": d}`;
//! [`OffloadFolder`] reads both kinds.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use bm_tensor::{DType, HostBuffer, MmapView, TensorMeta};
use serde_json::{Map, Value};

use crate::{Checkpoint, Error, cast_target};

/// File name of the offload index.
pub const INDEX_FILE: &str = "index.json";

/// One entry of an offload index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OffloadEntry {
    /// Accelerate's own form: the bytes are in `<name>.dat`.
    Dat(TensorMeta),
    /// transformers' form: the tensor lives in a safetensors file.
    Safetensors {
        /// The safetensors file (absolute, as transformers writes it).
        file: PathBuf,
        /// The tensor's name inside that file.
        weight_name: String,
        /// Dtype to convert to on load, if any.
        dtype: Option<DType>,
    },
}

impl OffloadEntry {
    fn to_json(&self) -> Value {
        let mut m = Map::new();
        match self {
            OffloadEntry::Dat(meta) => {
                m.insert("dtype".into(), meta.dtype.as_torch_str().into());
                m.insert(
                    "shape".into(),
                    meta.shape.iter().map(|&d| d as u64).collect(),
                );
            }
            OffloadEntry::Safetensors {
                file,
                weight_name,
                dtype,
            } => {
                m.insert(
                    "safetensors_file".into(),
                    file.to_string_lossy().into_owned().into(),
                );
                m.insert("weight_name".into(), weight_name.clone().into());
                if let Some(d) = dtype {
                    m.insert("dtype".into(), d.as_torch_str().into());
                }
            }
        }
        Value::Object(m)
    }

    fn from_json(index: &Path, name: &str, v: &Value) -> Result<OffloadEntry, Error> {
        let bad = |problem: String| Error::index(index, format!("entry {name:?}: {problem}"));
        let Value::Object(m) = v else {
            return Err(bad(format!("expected an object, found {v}")));
        };
        let dtype = match m.get("dtype") {
            None => None,
            Some(Value::String(s)) => {
                Some(DType::from_torch_str(s).ok_or_else(|| bad(format!("unknown dtype {s:?}")))?)
            }
            Some(other) => return Err(bad(format!("`dtype` must be a string, found {other}"))),
        };
        if let Some(file) = m.get("safetensors_file") {
            let file = file
                .as_str()
                .ok_or_else(|| bad(format!("`safetensors_file` must be a string, found {file}")))?;
            let weight_name = match m.get("weight_name") {
                Some(Value::String(w)) => w.clone(),
                None => name.to_string(),
                Some(other) => {
                    return Err(bad(format!(
                        "`weight_name` must be a string, found {other}"
                    )));
                }
            };
            return Ok(OffloadEntry::Safetensors {
                file: PathBuf::from(file),
                weight_name,
                dtype,
            });
        }
        let dtype = dtype.ok_or_else(|| bad("missing `dtype`".into()))?;
        let shape = m
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|a| {
                a.iter()
                    .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                    .collect::<Option<Vec<usize>>>()
            })
            .ok_or_else(|| bad("`shape` must be a list of non-negative integers".into()))?;
        Ok(OffloadEntry::Dat(TensorMeta::new(dtype, shape)))
    }
}

/// Path of the `.dat` file of `name`, refusing names that would leave the
/// folder.
pub fn dat_path(folder: &Path, name: &str) -> Result<PathBuf, Error> {
    if name.is_empty() || name.contains(['/', '\\', '\0']) || name == ".." || name == "." {
        return Err(Error::InvalidTensor {
            name: name.to_string(),
            problem: format!(
                "cannot be stored in offload folder {}: the name is empty or contains a path separator",
                folder.display()
            ),
        });
    }
    Ok(folder.join(format!("{name}.dat")))
}

/// Writes one tensor as `<folder>/<name>.dat` (atomically) and returns its
/// index entry. `data` must hold exactly the tensor's bytes.
pub fn offload_weight(
    folder: &Path,
    name: &str,
    meta: &TensorMeta,
    data: &[u8],
) -> Result<OffloadEntry, Error> {
    if Some(data.len()) != meta.checked_byte_len() {
        return Err(Error::InvalidTensor {
            name: name.to_string(),
            problem: format!(
                "{} of shape {:?} needs {} bytes, {} given",
                meta.dtype,
                meta.shape,
                meta.byte_len(),
                data.len()
            ),
        });
    }
    let path = dat_path(folder, name)?;
    std::fs::create_dir_all(folder).map_err(|e| Error::io(folder, "creating folder", e))?;
    crate::write::write_atomic(&path, data)?;
    Ok(OffloadEntry::Dat(meta.clone()))
}

/// Reads `<folder>/index.json` as name → entry, in file order; an absent
/// index is an empty one.
pub fn load_index(folder: &Path) -> Result<Vec<(String, OffloadEntry)>, Error> {
    let path = folder.join(INDEX_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(&path, "reading", e)),
    };
    let text = std::str::from_utf8(&bytes).map_err(|e| {
        Error::index(
            &path,
            format!("not UTF-8 (invalid byte at offset {})", e.valid_up_to()),
        )
    })?;
    let value: Value = serde_json::from_str(text)
        .map_err(|e| Error::index(&path, format!("not valid JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err(Error::index(&path, "expected a JSON object"));
    };
    map.iter()
        .map(|(name, v)| Ok((name.clone(), OffloadEntry::from_json(&path, name, v)?)))
        .collect()
}

/// Accelerate's `save_offload_index`: merges `entries` into
/// `<folder>/index.json` (new values win, existing order kept, new names
/// appended) and writes it atomically, `indent=2`, no trailing newline.
pub fn save_index(folder: &Path, entries: &[(String, OffloadEntry)]) -> Result<(), Error> {
    if entries.is_empty() {
        return Ok(());
    }
    let mut merged = Map::new();
    for (name, entry) in load_index(folder)? {
        merged.insert(name, entry.to_json());
    }
    for (name, entry) in entries {
        merged.insert(name.clone(), entry.to_json());
    }
    std::fs::create_dir_all(folder).map_err(|e| Error::io(folder, "creating folder", e))?;
    let text = crate::json::python_indent2(&Value::Object(merged));
    crate::write::write_atomic(&folder.join(INDEX_FILE), text.as_bytes())
}

/// Where an offloaded tensor's bytes are.
#[derive(Debug)]
enum Source {
    Dat(MmapView),
    File {
        checkpoint: usize,
        weight_name: String,
    },
}

/// An offload folder opened for reading: every `.dat` file is mapped and
/// its length checked, every safetensors file's header read.
#[derive(Debug)]
pub struct OffloadFolder {
    folder: PathBuf,
    names: Vec<String>,
    tensors: HashMap<String, (TensorMeta, DType, Source)>,
    checkpoints: Vec<Checkpoint>,
}

impl OffloadFolder {
    /// Opens `folder`, which must hold an `index.json`.
    pub fn open(folder: impl AsRef<Path>) -> Result<OffloadFolder, Error> {
        let folder = folder.as_ref();
        let index_path = folder.join(INDEX_FILE);
        if !index_path.is_file() {
            return Err(Error::checkpoint(
                folder,
                "is not an offload folder: it has no index.json",
            ));
        }
        let entries = load_index(folder)?;
        let mut checkpoints: Vec<Checkpoint> = Vec::new();
        let mut opened: HashMap<PathBuf, usize> = HashMap::new();
        let mut names = Vec::with_capacity(entries.len());
        let mut tensors = HashMap::with_capacity(entries.len());
        for (name, entry) in entries {
            let (stored, loaded, source) = match entry {
                OffloadEntry::Dat(meta) => {
                    let path = dat_path(folder, &name)?;
                    let view = MmapView::open(&path)
                        .map_err(|e| Error::index(&index_path, format!("entry {name:?}: {e}")))?;
                    if view.len() != meta.byte_len() {
                        return Err(Error::index(
                            &index_path,
                            format!(
                                "entry {name:?}: {} holds {} bytes, {} of shape {:?} needs {}",
                                path.display(),
                                view.len(),
                                meta.dtype,
                                meta.shape,
                                meta.byte_len()
                            ),
                        ));
                    }
                    let dtype = meta.dtype;
                    (meta, dtype, Source::Dat(view))
                }
                OffloadEntry::Safetensors {
                    file,
                    weight_name,
                    dtype,
                } => {
                    let k = match opened.get(&file) {
                        Some(&k) => k,
                        None => {
                            checkpoints.push(Checkpoint::open(&file)?);
                            opened.insert(file.clone(), checkpoints.len() - 1);
                            checkpoints.len() - 1
                        }
                    };
                    let meta = checkpoints[k].meta(&weight_name).cloned().ok_or_else(|| {
                        Error::index(
                            &index_path,
                            format!(
                                "entry {name:?}: {} has no tensor {weight_name:?}",
                                file.display()
                            ),
                        )
                    })?;
                    let loaded = dtype.map_or(meta.dtype, |d| cast_target(meta.dtype, d));
                    (
                        meta,
                        loaded,
                        Source::File {
                            checkpoint: k,
                            weight_name,
                        },
                    )
                }
            };
            names.push(name.clone());
            tensors.insert(name, (stored, loaded, source));
        }
        Ok(OffloadFolder {
            folder: folder.to_path_buf(),
            names,
            tensors,
            checkpoints,
        })
    }

    /// Tensor names in index order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names.iter().map(String::as_str)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// True when the index is empty.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    fn get(&self, name: &str) -> Result<&(TensorMeta, DType, Source), Error> {
        self.tensors.get(name).ok_or_else(|| Error::UnknownTensor {
            name: name.to_string(),
            checkpoint: self.folder.clone(),
        })
    }

    /// Dtype and shape as stored.
    pub fn stored_meta(&self, name: &str) -> Option<&TensorMeta> {
        self.tensors.get(name).map(|t| &t.0)
    }

    /// Dtype and shape as loaded: a transformers entry's `dtype` applied.
    pub fn meta(&self, name: &str) -> Option<TensorMeta> {
        self.tensors
            .get(name)
            .map(|(m, loaded, _)| TensorMeta::new(*loaded, m.shape.clone()))
    }

    /// The stored bytes, zero-copy.
    pub fn view(&self, name: &str) -> Result<MmapView, Error> {
        match &self.get(name)?.2 {
            Source::Dat(v) => Ok(v.clone()),
            Source::File {
                checkpoint,
                weight_name,
            } => self.checkpoints[*checkpoint].view(weight_name),
        }
    }

    /// The tensor as loaded (with the entry's dtype, if any), converted to
    /// `dtype` when both are castable floats (see [`cast_target`]).
    pub fn read_as(&self, name: &str, dtype: DType) -> Result<HostBuffer, Error> {
        let (stored, loaded, _) = self.get(name)?;
        let target = cast_target(*loaded, dtype);
        let view = self.view(name)?;
        let err = |source| Error::Tensor {
            name: name.to_string(),
            source,
        };
        // Casting in one step from the stored dtype is what the two-step
        // PyTorch path gives, except when the entry narrows first.
        let bytes = if *loaded != stored.dtype && target != *loaded {
            let narrowed = bm_tensor::cast(view.as_bytes(), stored.dtype, *loaded).map_err(err)?;
            bm_tensor::cast(narrowed.as_bytes(), *loaded, target).map_err(err)?
        } else {
            bm_tensor::cast(
                view.as_bytes(),
                stored.dtype,
                cast_target(stored.dtype, target),
            )
            .map_err(err)?
        };
        Ok(bytes)
    }
}
