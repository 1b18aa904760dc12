//! Reading checkpoints: one safetensors file, an index, or a folder.
//!
//! Opening costs O(n log n) in the number of tensors and memory a small
//! multiple of the headers: tensors are kept in one list, and names are
//! found by binary search in a sorted list of positions.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use bm_tensor::{DType, HostBuffer, MmapView, TensorMeta};

use crate::Error;
use crate::header::Header;
use crate::index::Index;
use crate::paths::{Resolved, open_regular, resolve_in_folder};
use crate::write::SINGLE_FILE;

/// One safetensors file of a checkpoint.
#[derive(Debug)]
pub struct ShardFile {
    /// Path as found (the index's folder joined with the shard name).
    pub path: PathBuf,
    /// The `__metadata__` of its header.
    pub metadata: Option<Vec<(String, String)>>,
    /// Number of tensors read from it.
    pub tensors: usize,
    /// Bytes of tensor data it holds.
    pub data_bytes: u64,
    map: MmapView,
    file: File,
}

#[derive(Debug)]
struct Entry {
    name: String,
    meta: TensorMeta,
    shard: usize,
    /// Byte range in the file (data start already added).
    start: usize,
    end: usize,
}

/// A safetensors checkpoint opened lazily: headers are parsed and validated
/// at [`Checkpoint::open`]; tensor bytes are only read when asked for.
#[derive(Debug)]
pub struct Checkpoint {
    path: PathBuf,
    index: Option<PathBuf>,
    shards: Vec<ShardFile>,
    entries: Vec<Entry>,
    /// Positions in `entries`, sorted by name.
    by_name: Vec<usize>,
}

impl Checkpoint {
    /// Opens a `.safetensors` file, a `*.index.json` (transformers'
    /// `weight_map` form or Accelerate's flat form), or a folder holding
    /// `model.safetensors` or exactly one `*.index.json`. Reads headers only.
    ///
    /// Files a folder or an index names are resolved inside that folder
    /// (or the Hugging Face cache repository it is a snapshot of) before
    /// anything is opened, and only regular files are opened: see
    /// [`crate::open_regular`].
    pub fn open(path: impl AsRef<Path>) -> Result<Checkpoint, Error> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, "opening", e))?;
        if meta.is_dir() {
            return Self::open_folder(path);
        }
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.ends_with(".json") {
            Self::open_index(path, path, open_regular(path)?)
        } else {
            reject_pickle(path)?;
            Self::from_files(path, None, vec![(path.to_path_buf(), open_regular(path)?)])
        }
    }

    /// Opens the safetensors file an offload index names, already resolved.
    pub(crate) fn open_resolved(file: &Resolved) -> Result<Checkpoint, Error> {
        reject_pickle(&file.named)?;
        Self::from_files(&file.named, None, vec![(file.named.clone(), file.open()?)])
    }

    fn open_folder(folder: &Path) -> Result<Checkpoint, Error> {
        let in_folder = |name: &str| {
            resolve_in_folder(folder, name)
                .map_err(|problem| Error::checkpoint(folder, format!("{name} {problem}")))
        };
        if std::fs::symlink_metadata(folder.join(SINGLE_FILE)).is_ok() {
            let single = in_folder(SINGLE_FILE)?;
            return Self::from_files(folder, None, vec![(single.named.clone(), single.open()?)]);
        }
        let listing = std::fs::read_dir(folder).map_err(|e| Error::io(folder, "listing", e))?;
        let mut indexes = Vec::new();
        let mut pickles = Vec::new();
        for entry in listing {
            let entry = entry.map_err(|e| Error::io(folder, "listing", e))?;
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                continue; // not UTF-8: no name this crate looks for
            };
            if name.ends_with(".index.json") {
                indexes.push(name);
            } else if name.ends_with(".bin") {
                pickles.push(name);
            }
        }
        indexes.sort();
        pickles.sort();
        match indexes.as_slice() {
            [one] => {
                let index = in_folder(one)?;
                Self::open_index(folder, &index.named, index.open()?)
            }
            [] if !pickles.is_empty() => Err(Error::checkpoint(
                folder,
                format!(
                    "holds only PyTorch pickle weights ({}): reading .bin checkpoints is not supported yet; convert them to safetensors",
                    pickles.join(", ")
                ),
            )),
            [] => Err(Error::checkpoint(
                folder,
                "is not a checkpoint folder: it holds neither model.safetensors nor a *.index.json",
            )),
            many => Err(Error::checkpoint(
                folder,
                format!(
                    "holds more than one *.index.json ({}); delete the irrelevant ones or pass one of them",
                    many.join(", ")
                ),
            )),
        }
    }

    fn open_index(opened: &Path, index_path: &Path, mut file: File) -> Result<Checkpoint, Error> {
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)
            .map_err(|e| Error::io(index_path, "reading", e))?;
        let index = Index::parse(index_path, &bytes)?;
        drop(bytes);
        let folder = match index_path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        // A tensor that names each file, for messages.
        let mut named_by: HashMap<&str, &str> = HashMap::new();
        for (tensor, file) in &index.weight_map {
            named_by.entry(file.as_str()).or_insert(tensor.as_str());
        }
        // Resolve every shard name before opening any file. Names that
        // reach the same file (`a` and `./a`, two links to one blob) share
        // it, so its tensors are read once.
        let mut shard_of_name: HashMap<&str, usize> = HashMap::new();
        let mut shard_of_real: HashMap<PathBuf, usize> = HashMap::new();
        let mut resolved: Vec<Resolved> = Vec::new();
        for name in index.shard_files() {
            let shard = resolve_in_folder(folder, name).map_err(|problem| {
                Error::index(
                    index_path,
                    format!(
                        "tensor {:?} names shard {name:?}, which {problem}",
                        named_by[name]
                    ),
                )
            })?;
            reject_pickle(&shard.named)?;
            let k = *shard_of_real.entry(shard.real.clone()).or_insert_with(|| {
                resolved.push(shard);
                resolved.len() - 1
            });
            shard_of_name.insert(name, k);
        }
        let mut files = Vec::with_capacity(resolved.len());
        for shard in &resolved {
            files.push((shard.named.clone(), shard.open()?));
        }
        let ckpt = Self::from_files(opened, Some(index_path.to_path_buf()), files)?;
        for (name, file) in &index.weight_map {
            let found = ckpt.position(name).map(|i| ckpt.entries[i].shard);
            if found != Some(shard_of_name[file.as_str()]) {
                return Err(Error::index(
                    index_path,
                    format!("tensor {name:?} is not in its shard {file:?}"),
                ));
            }
        }
        Ok(ckpt)
    }

    fn from_files(
        opened: &Path,
        index: Option<PathBuf>,
        files: Vec<(PathBuf, File)>,
    ) -> Result<Checkpoint, Error> {
        let mut shards = Vec::with_capacity(files.len());
        let mut entries: Vec<Entry> = Vec::new();
        for (i, (path, mut file)) in files.into_iter().enumerate() {
            let (header, file_len) = Header::read_from(&mut file, &path)?;
            let map = MmapView::map_file(&file, &path)
                .map_err(|e| Error::checkpoint(&path, format!("mapping failed: {e}")))?;
            if map.len() as u64 != file_len {
                return Err(Error::header(
                    &path,
                    "the file changed size while being opened",
                ));
            }
            let base = header.data_start() as usize;
            let data_bytes = file_len - header.data_start();
            let tensors = header.tensors.len();
            entries.reserve(tensors);
            for t in header.tensors {
                entries.push(Entry {
                    name: t.name,
                    meta: t.meta,
                    shard: i,
                    start: base + t.data_offsets.0 as usize,
                    end: base + t.data_offsets.1 as usize,
                });
            }
            shards.push(ShardFile {
                path,
                metadata: header.metadata,
                tensors,
                data_bytes,
                map,
                file,
            });
        }
        let mut by_name: Vec<usize> = (0..entries.len()).collect();
        by_name.sort_unstable_by(|&a, &b| entries[a].name.cmp(&entries[b].name));
        if let Some(w) = by_name
            .windows(2)
            .find(|w| entries[w[0]].name == entries[w[1]].name)
        {
            // The two files in reading order.
            let (a, b) = (w[0].min(w[1]), w[0].max(w[1]));
            return Err(Error::checkpoint(
                opened,
                format!(
                    "tensor {:?} is stored twice, in {} and {}",
                    entries[a].name,
                    shards[entries[a].shard].path.display(),
                    shards[entries[b].shard].path.display()
                ),
            ));
        }
        Ok(Checkpoint {
            path: opened.to_path_buf(),
            index,
            shards,
            entries,
            by_name,
        })
    }

    /// Position of `name` in `entries`, by binary search.
    fn position(&self, name: &str) -> Option<usize> {
        self.by_name
            .binary_search_by(|&i| self.entries[i].name.as_str().cmp(name))
            .ok()
            .map(|k| self.by_name[k])
    }

    /// The path this checkpoint was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The index file, when the checkpoint is sharded.
    pub fn index_path(&self) -> Option<&Path> {
        self.index.as_deref()
    }

    /// The safetensors files, in reading order (sorted shard names).
    pub fn files(&self) -> &[ShardFile] {
        &self.shards
    }

    /// Every tensor with its dtype and shape, in file order then data offset.
    pub fn tensors(&self) -> impl Iterator<Item = (&str, &TensorMeta)> {
        self.entries.iter().map(|e| (e.name.as_str(), &e.meta))
    }

    /// Dtype and shape of one tensor.
    pub fn meta(&self, name: &str) -> Option<&TensorMeta> {
        self.position(name).map(|i| &self.entries[i].meta)
    }

    /// The file holding a tensor.
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.position(name)
            .map(|i| self.shards[self.entries[i].shard].path.as_path())
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when the checkpoint holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Total bytes of tensor data.
    pub fn total_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.data_bytes).sum()
    }

    fn entry(&self, name: &str) -> Result<&Entry, Error> {
        self.position(name)
            .map(|i| &self.entries[i])
            .ok_or_else(|| Error::UnknownTensor {
                name: name.to_string(),
                checkpoint: self.path.clone(),
            })
    }

    /// Checks that the tensor's file still holds its bytes (a mapped file
    /// truncated by another program would fault when read).
    fn check_intact(&self, e: &Entry) -> Result<&ShardFile, Error> {
        let shard = &self.shards[e.shard];
        let len = shard
            .file
            .metadata()
            .map_err(|err| Error::io(&shard.path, "reading the size of", err))?
            .len();
        if len < e.end as u64 {
            return Err(Error::truncated(&shard.path, &e.name, e.end as u64, len));
        }
        Ok(shard)
    }

    /// A zero-copy view of a tensor's bytes (read through the page cache
    /// when touched). Fails, naming the file, when the file has been
    /// truncated since it was opened.
    pub fn view(&self, name: &str) -> Result<MmapView, Error> {
        let e = self.entry(name)?;
        let shard = self.check_intact(e)?;
        shard
            .map
            .slice(e.start..e.end)
            .map_err(|source| Error::tensor(&shard.path, name, source))
    }

    /// Copies a tensor's bytes, as stored, into `dst` (exactly its length).
    /// Uses positioned reads rather than the mapping, which avoids one page
    /// fault per 4 KiB for large tensors.
    pub fn read_into(&self, name: &str, dst: &mut [u8]) -> Result<(), Error> {
        let e = self.entry(name)?;
        let shard = self.check_intact(e)?;
        if dst.len() != e.end - e.start {
            return Err(Error::invalid_tensor(
                &shard.path,
                name,
                format!(
                    "destination holds {} bytes, the tensor {}",
                    dst.len(),
                    e.end - e.start
                ),
            ));
        }
        read_at(&shard.file, &shard.map, dst, e.start)
            .map_err(|err| Error::io(&shard.path, "reading", err))
    }

    /// Reads a tensor into a new aligned host buffer, converting it to
    /// `dtype` when both are float types PyTorch-style casts cover (F64, F32,
    /// F16, BF16). Other tensors (integers, bool, fp8) are returned as
    /// stored: check [`cast_target`] for the dtype of the result.
    pub fn read_as(&self, name: &str, dtype: DType) -> Result<HostBuffer, Error> {
        let e = self.entry(name)?;
        let path = &self.shards[e.shard].path;
        if cast_target(e.meta.dtype, dtype) == e.meta.dtype {
            let mut buf = HostBuffer::zeroed(e.end - e.start)
                .map_err(|source| Error::tensor(path, name, source))?;
            self.read_into(name, buf.as_mut_bytes())?;
            Ok(buf)
        } else {
            let view = self.view(name)?;
            bm_tensor::cast(view.as_bytes(), e.meta.dtype, dtype)
                .map_err(|source| Error::tensor(path, name, source))
        }
    }
}

/// The dtype a tensor stored as `stored` gets when `requested` is asked
/// for: `requested` for F64/F32/F16/BF16 pairs, `stored` otherwise
/// (integers and bool are never cast; fp8 stays quantised).
pub fn cast_target(stored: DType, requested: DType) -> DType {
    let castable = |d| matches!(d, DType::F64 | DType::F32 | DType::F16 | DType::BF16);
    if castable(stored) && castable(requested) {
        requested
    } else {
        stored
    }
}

fn reject_pickle(path: &Path) -> Result<(), Error> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if [".bin", ".pt", ".pth", ".ckpt"]
        .iter()
        .any(|ext| name.ends_with(ext))
    {
        return Err(Error::checkpoint(
            path,
            "PyTorch pickle checkpoints are not supported yet; convert them to safetensors",
        ));
    }
    Ok(())
}

#[cfg(unix)]
fn read_at(file: &File, _map: &MmapView, dst: &mut [u8], offset: usize) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    file.read_exact_at(dst, offset as u64)
}

#[cfg(not(unix))]
fn read_at(_file: &File, map: &MmapView, dst: &mut [u8], offset: usize) -> std::io::Result<()> {
    dst.copy_from_slice(&map.as_bytes()[offset..offset + dst.len()]);
    Ok(())
}
