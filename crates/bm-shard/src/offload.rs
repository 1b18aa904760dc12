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
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use bm_tensor::{DType, HostBuffer, MmapView, TensorMeta};
use serde_json::{Map, Value};

use crate::index::{open_object, syntax_error};
use crate::json::{Kind, Reader, shorten};
use crate::paths::{Folder, Resolved, resolve_in_folder};
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

    /// Reads one entry (its value not yet consumed) of the index at
    /// `index`.
    fn read(index: &Path, name: &str, r: &mut Reader<'_>) -> Result<OffloadEntry, Error> {
        let bad = |problem: String| Error::index(index, format!("entry {name:?}: {problem}"));
        let syntax = syntax_error(index);
        if r.peek().map_err(syntax)? != Kind::Object {
            let found = r.skip_and_show(SHOWN).map_err(syntax)?;
            return Err(bad(format!("expected an object, found {found}")));
        }
        r.begin_object().map_err(syntax)?;
        let mut dtype: Option<DType> = None;
        let mut shape: Option<Vec<u64>> = None;
        let mut file: Option<String> = None;
        let mut weight_name: Option<String> = None;
        let mut seen: Vec<String> = Vec::new();
        let mut first = true;
        while let Some(key) = r.next_key(first).map_err(syntax)? {
            first = false;
            if !matches!(
                key.as_ref(),
                "dtype" | "shape" | "safetensors_file" | "weight_name"
            ) {
                r.skip_value().map_err(syntax)?;
                continue;
            }
            if seen.iter().any(|k| *k == key) {
                return Err(bad(format!("`{key}` appears twice")));
            }
            seen.push(key.to_string());
            if key == "shape" {
                let mut again = r.clone();
                shape = Some(r.u64_list().map_err(syntax)?.ok_or_else(|| {
                    let found = again.skip_and_show(SHOWN).unwrap_or_default();
                    bad(format!(
                        "`shape` must be a list of non-negative integers, found {found}"
                    ))
                })?);
                continue;
            }
            if r.peek().map_err(syntax)? != Kind::String {
                let found = r.skip_and_show(SHOWN).map_err(syntax)?;
                return Err(bad(format!("`{key}` must be a string, found {found}")));
            }
            let text = r.string().map_err(syntax)?.into_owned();
            match key.as_ref() {
                "dtype" => {
                    dtype = Some(DType::from_torch_str(&text).ok_or_else(|| {
                        bad(format!("unknown dtype {:?}", shorten(&text, SHOWN)))
                    })?);
                }
                "safetensors_file" => file = Some(text),
                _ => weight_name = Some(text),
            }
        }
        if let Some(file) = file {
            return Ok(OffloadEntry::Safetensors {
                file: PathBuf::from(file),
                weight_name: weight_name.unwrap_or_else(|| name.to_string()),
                dtype,
            });
        }
        let dtype = dtype.ok_or_else(|| bad("missing `dtype`".into()))?;
        let shape = shape.ok_or_else(|| bad("missing `shape`".into()))?;
        let shape: Vec<usize> = shape
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<Result<_, _>>()
            .map_err(|_| bad("a dimension does not fit in memory addresses".into()))?;
        let meta = TensorMeta::new(dtype, shape);
        if meta.checked_byte_len().is_none() {
            return Err(bad(format!("shape {:?} of {dtype} overflows", meta.shape)));
        }
        Ok(OffloadEntry::Dat(meta))
    }
}

/// How much of a wrongly typed value an error message shows.
const SHOWN: usize = 60;

/// Path of the `.dat` file of `name`, refusing names that would leave the
/// folder.
pub fn dat_path(folder: &Path, name: &str) -> Result<PathBuf, Error> {
    if name.is_empty() || name.contains(['/', '\\', '\0']) || name == ".." || name == "." {
        return Err(Error::invalid_tensor(
            folder,
            name,
            "cannot be stored in an offload folder: the name is empty or contains a path separator",
        ));
    }
    Ok(folder.join(format!("{name}.dat")))
}

/// Writes one tensor as `<folder>/<name>.dat` (atomically) and returns its
/// index entry. `data` must hold exactly the tensor's bytes. A writer of a
/// folder others may use holds its [`crate::FolderLock`].
pub fn offload_weight(
    folder: &Path,
    name: &str,
    meta: &TensorMeta,
    data: &[u8],
) -> Result<OffloadEntry, Error> {
    Ok(offload_weight_mapped(folder, name, meta, data)?.0)
}

/// [`offload_weight`], also returning the file mapped through the
/// descriptor it was written with: the bytes are this process's whatever
/// another process renames over `<name>.dat` afterwards.
pub fn offload_weight_mapped(
    folder: &Path,
    name: &str,
    meta: &TensorMeta,
    data: &[u8],
) -> Result<(OffloadEntry, MmapView), Error> {
    if Some(data.len()) != meta.checked_byte_len() {
        return Err(Error::invalid_tensor(
            folder,
            name,
            format!(
                "{} of shape {:?} needs {} bytes, {} given",
                meta.dtype,
                meta.shape,
                meta.byte_len(),
                data.len()
            ),
        ));
    }
    let path = dat_path(folder, name)?;
    std::fs::create_dir_all(folder).map_err(|e| Error::io(folder, "creating folder", e))?;
    let mut file = crate::AtomicFile::create(&path)?;
    file.write_all(data)
        .map_err(|e| Error::io(&path, "writing", e))?;
    let view = file.commit_and_map()?;
    Ok((OffloadEntry::Dat(meta.clone()), view))
}

/// Makes `<folder>/index.json` safe to write new files under, for a writer
/// holding the folder's [`crate::FolderLock`]: removes the entries of the
/// tensors it is about to rewrite (`rewriting`), so that a process killed
/// after rewriting a `.dat` file leaves no entry describing its old
/// contents, and the entries whose files disagree with them (a `.dat` file
/// missing or of another size, a `safetensors_file` gone), which earlier
/// runs killed mid-write or deleted checkpoints leave. Other entries are
/// kept unread beyond that check. Returns the names of the disagreeing
/// entries removed, for a warning. An index that cannot be parsed is an
/// error naming the folder, which can be deleted.
pub fn prepare_index(
    folder: &Path,
    rewriting: &dyn Fn(&str) -> bool,
) -> Result<Vec<String>, Error> {
    let index_path = folder.join(INDEX_FILE);
    let entries = load_index(folder).map_err(|e| {
        Error::checkpoint(
            folder,
            format!(
                "is an offload folder whose index cannot be used ({e}); it only holds copies of a checkpoint's weights: delete it and run again"
            ),
        )
    })?;
    if entries.is_empty() {
        return Ok(Vec::new());
    }
    let in_folder = Folder::new(folder)
        .map_err(|problem| Error::checkpoint(folder, format!("the folder {problem}")))?;
    let agrees = |name: &str, entry: &OffloadEntry| match entry {
        OffloadEntry::Dat(meta) => in_folder
            .resolve(&format!("{name}.dat"))
            .ok()
            .and_then(|dat| std::fs::metadata(&dat.real).ok())
            .is_some_and(|m| Some(m.len()) == meta.checked_byte_len().map(|n| n as u64)),
        OffloadEntry::Safetensors { file, .. } => resolve_safetensors_file(file).is_ok(),
    };
    let mut kept = Map::new();
    let mut stale = Vec::new();
    let mut dropped = 0;
    for (name, entry) in &entries {
        if rewriting(name) {
            dropped += 1;
        } else if !agrees(name, entry) {
            stale.push(name.clone());
        } else {
            kept.insert(name.clone(), entry.to_json());
        }
    }
    if dropped + stale.len() > 0 {
        if kept.is_empty() {
            match std::fs::remove_file(&index_path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(Error::io(&index_path, "removing", e));
                }
                _ => crate::sync_folder(folder)?,
            }
        } else {
            let text = crate::json::python_indent2(&Value::Object(kept));
            crate::atomic::write_atomic(&index_path, text.as_bytes())?;
        }
    }
    Ok(stale)
}

/// Reads `<folder>/index.json` as name → entry, in file order; an absent
/// index is an empty one. The index itself must be a regular file in the
/// folder (a link out of it is refused), and an entry given twice is an
/// error.
pub fn load_index(folder: &Path) -> Result<Vec<(String, OffloadEntry)>, Error> {
    let path = folder.join(INDEX_FILE);
    match std::fs::symlink_metadata(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(&path, "reading", e)),
        Ok(_) => {}
    }
    let resolved = resolve_in_folder(folder, INDEX_FILE)
        .map_err(|problem| Error::checkpoint(folder, format!("{INDEX_FILE} {problem}")))?;
    let mut bytes = Vec::new();
    resolved
        .open()?
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(&path, "reading", e))?;
    parse_index(&path, &bytes)
}

/// Parses the text of an offload `index.json` (`path` only names it in
/// errors): name → entry in file order; an entry given twice, a shape whose
/// size overflows or a field of the wrong type is an error.
pub fn parse_index(path: &Path, bytes: &[u8]) -> Result<Vec<(String, OffloadEntry)>, Error> {
    let syntax = syntax_error(path);
    let mut r = open_object(path, bytes)?;
    let mut entries = Vec::new();
    let mut first = true;
    while let Some(name) = r.next_key(first).map_err(syntax)? {
        first = false;
        let entry = OffloadEntry::read(path, &name, &mut r)?;
        entries.push((name.into_owned(), entry));
    }
    r.end().map_err(syntax)?;
    let mut names: Vec<&str> = entries.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::index(
            path,
            format!("entry {:?} appears twice", w[0]),
        ));
    }
    Ok(entries)
}

/// Resolves the `safetensors_file` of a transformers entry. transformers
/// writes it as the checkpoint shard's own path (absolute, or relative to
/// the working directory), so it is not confined to the offload folder;
/// instead the name must be a `*.safetensors` file without `..`, and any
/// symbolic link must stay inside that file's own folder (or its Hugging
/// Face cache repository). So `/etc/passwd`, or a shard linked to it, is
/// refused before it is opened. The error completes "..., which ...".
fn resolve_safetensors_file(file: &Path) -> Result<Resolved, String> {
    let refuse = |why: &str| format!("{why}; refusing to read it");
    let Some(name) = file.file_name().and_then(|n| n.to_str()) else {
        return Err(refuse("names no file"));
    };
    if !name.ends_with(".safetensors") {
        return Err(refuse("is not a *.safetensors file"));
    }
    if file
        .components()
        .any(|c| c == std::path::Component::ParentDir)
    {
        return Err(refuse("contains `..`"));
    }
    let folder = match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    resolve_in_folder(folder, name)
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
    crate::atomic::write_atomic(&folder.join(INDEX_FILE), text.as_bytes())
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
    /// Opens `folder`, which must hold an `index.json`. Every `.dat` file is
    /// resolved inside the folder (a link leading out of it is refused) and
    /// must be a regular file of exactly the entry's size; every
    /// `safetensors_file` must be a `*.safetensors` name without `..` whose
    /// links stay in its own folder (or Hugging Face cache repository).
    /// Nothing refused is opened.
    pub fn open(folder: impl AsRef<Path>) -> Result<OffloadFolder, Error> {
        Self::open_some(folder.as_ref(), &|_| true)
    }

    /// [`OffloadFolder::open`] for the entries `wanted` keeps: the others
    /// are neither opened nor checked (a run reads only what it uses).
    pub fn open_some(folder: &Path, wanted: &dyn Fn(&str) -> bool) -> Result<OffloadFolder, Error> {
        let index_path = folder.join(INDEX_FILE);
        if std::fs::symlink_metadata(&index_path).is_err() {
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
        let in_folder = Folder::new(folder)
            .map_err(|problem| Error::checkpoint(folder, format!("the folder {problem}")))?;
        for (name, entry) in entries.into_iter().filter(|(name, _)| wanted(name)) {
            let bad =
                |problem: String| Error::index(&index_path, format!("entry {name:?}: {problem}"));
            let disagrees = |problem: String| {
                bad(format!(
                    "{problem}; the offload folder {} disagrees with its files (a write into it was interrupted, or a file was removed): delete it, it only holds copies of a checkpoint's weights",
                    folder.display()
                ))
            };
            let (stored, loaded, source) = match entry {
                OffloadEntry::Dat(meta) => {
                    let path = dat_path(folder, &name)?;
                    let file_name = format!("{name}.dat");
                    let dat = in_folder
                        .resolve(&file_name)
                        .map_err(|problem| disagrees(format!("{file_name} {problem}")))?;
                    let view =
                        MmapView::map_file(&dat.open()?, &path).map_err(|e| bad(e.to_string()))?;
                    let needed = meta.checked_byte_len().unwrap_or(usize::MAX);
                    if view.len() != needed {
                        return Err(disagrees(format!(
                            "{} holds {} bytes, {} of shape {:?} needs {needed}",
                            path.display(),
                            view.len(),
                            meta.dtype,
                            meta.shape,
                        )));
                    }
                    let dtype = meta.dtype;
                    (meta, dtype, Source::Dat(view))
                }
                OffloadEntry::Safetensors {
                    file,
                    weight_name,
                    dtype,
                } => {
                    let resolved = resolve_safetensors_file(&file).map_err(|problem| {
                        bad(format!(
                            "safetensors_file {:?}, which {problem}",
                            file.display().to_string()
                        ))
                    })?;
                    let k = match opened.get(&resolved.real) {
                        Some(&k) => k,
                        None => {
                            checkpoints.push(Checkpoint::open_resolved(&resolved)?);
                            opened.insert(resolved.real.clone(), checkpoints.len() - 1);
                            checkpoints.len() - 1
                        }
                    };
                    let meta = checkpoints[k].meta(&weight_name).cloned().ok_or_else(|| {
                        bad(format!("{} has no tensor {weight_name:?}", file.display()))
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

    /// The stored bytes, zero-copy. Fails, naming the file, when it has
    /// been truncated since the folder was opened.
    pub fn view(&self, name: &str) -> Result<MmapView, Error> {
        match &self.get(name)?.2 {
            Source::Dat(v) => match v.check_intact() {
                Ok(()) => Ok(v.clone()),
                Err(bm_tensor::Error::Truncated { path, needed, len }) => {
                    Err(Error::truncated(&path, name, needed, len))
                }
                Err(e) => Err(Error::tensor(v.path(), name, e)),
            },
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
        let err = |source| Error::tensor(view.path(), name, source);
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
