//! Reading checkpoints: one safetensors file, an index, or a folder.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use bm_tensor::{DType, HostBuffer, MmapView, TensorMeta};

use crate::Error;
use crate::header::Header;
use crate::index::{Index, resolve_shard};

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
    by_name: HashMap<String, usize>,
}

impl Checkpoint {
    /// Opens a `.safetensors` file, a `*.index.json` (transformers'
    /// `weight_map` form or Accelerate's flat form), or a folder holding
    /// `model.safetensors` or exactly one `*.index.json`. Reads headers only.
    pub fn open(path: impl AsRef<Path>) -> Result<Checkpoint, Error> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, "opening", e))?;
        if meta.is_dir() {
            return Self::open_folder(path);
        }
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.ends_with(".json") {
            Self::open_index(path, path)
        } else {
            reject_pickle(path)?;
            Self::from_files(path, None, vec![(path.to_path_buf(), None)])
        }
    }

    fn open_folder(folder: &Path) -> Result<Checkpoint, Error> {
        let single = folder.join("model.safetensors");
        if single.is_file() {
            return Self::from_files(folder, None, vec![(single, None)]);
        }
        let listing = std::fs::read_dir(folder).map_err(|e| Error::io(folder, "listing", e))?;
        let mut indexes = Vec::new();
        let mut pickles = Vec::new();
        for entry in listing {
            let entry = entry.map_err(|e| Error::io(folder, "listing", e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(".index.json") {
                indexes.push(name);
            } else if name.ends_with(".bin") {
                pickles.push(name);
            }
        }
        indexes.sort();
        match indexes.as_slice() {
            [one] => Self::open_index(folder, &folder.join(one)),
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

    fn open_index(opened: &Path, index_path: &Path) -> Result<Checkpoint, Error> {
        let bytes = std::fs::read(index_path).map_err(|e| Error::io(index_path, "reading", e))?;
        let index = Index::parse(index_path, &bytes)?;
        let folder = index_path.parent().unwrap_or(Path::new("."));
        let folder = if folder.as_os_str().is_empty() {
            Path::new(".")
        } else {
            folder
        };
        // Check every shard name before opening any file.
        let mut files = Vec::new();
        for shard in index.shard_files() {
            let path = resolve_shard(index_path, folder, shard)?;
            reject_pickle(&path)?;
            files.push((path, Some(shard.to_string())));
        }
        let mut ckpt = Self::from_files(opened, Some(index_path.to_path_buf()), files)?;
        for (name, file) in &index.weight_map {
            let found = ckpt
                .by_name
                .get(name)
                .map(|&i| &ckpt.shards[ckpt.entries[i].shard]);
            let expected = folder.join(file);
            if found.is_none_or(|s| s.path != expected) {
                return Err(Error::index(
                    index_path,
                    format!("tensor {name:?} is not in its shard {file:?}"),
                ));
            }
        }
        ckpt.index = Some(index_path.to_path_buf());
        Ok(ckpt)
    }

    fn from_files(
        opened: &Path,
        index: Option<PathBuf>,
        files: Vec<(PathBuf, Option<String>)>,
    ) -> Result<Checkpoint, Error> {
        let mut shards = Vec::with_capacity(files.len());
        let mut entries: Vec<Entry> = Vec::new();
        let mut by_name: HashMap<String, usize> = HashMap::new();
        for (i, (path, _)) in files.into_iter().enumerate() {
            let (header, file_len) = Header::read(&path)?;
            let file = File::open(&path).map_err(|e| Error::io(&path, "opening", e))?;
            let map = MmapView::open(&path)
                .map_err(|e| Error::checkpoint(&path, format!("mapping failed: {e}")))?;
            if map.len() as u64 != file_len {
                return Err(Error::header(
                    &path,
                    "the file changed size while being opened",
                ));
            }
            let base = header.data_start() as usize;
            let data_bytes = file_len - header.data_start();
            for t in &header.tensors {
                if let Some(&other) = by_name.get(&t.name) {
                    let first: &ShardFile = &shards[entries[other].shard];
                    return Err(Error::checkpoint(
                        opened,
                        format!(
                            "tensor {:?} is stored twice, in {} and {}",
                            t.name,
                            first.path.display(),
                            path.display()
                        ),
                    ));
                }
                by_name.insert(t.name.clone(), entries.len());
                entries.push(Entry {
                    name: t.name.clone(),
                    meta: t.meta.clone(),
                    shard: i,
                    start: base + t.data_offsets.0 as usize,
                    end: base + t.data_offsets.1 as usize,
                });
            }
            shards.push(ShardFile {
                path,
                metadata: header.metadata,
                tensors: header.tensors.len(),
                data_bytes,
                map,
                file,
            });
        }
        Ok(Checkpoint {
            path: opened.to_path_buf(),
            index,
            shards,
            entries,
            by_name,
        })
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
        self.by_name.get(name).map(|&i| &self.entries[i].meta)
    }

    /// The file holding a tensor.
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.by_name
            .get(name)
            .map(|&i| self.shards[self.entries[i].shard].path.as_path())
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
        self.by_name
            .get(name)
            .map(|&i| &self.entries[i])
            .ok_or_else(|| Error::UnknownTensor {
                name: name.to_string(),
                checkpoint: self.path.clone(),
            })
    }

    /// A zero-copy view of a tensor's bytes (read through the page cache
    /// when touched).
    pub fn view(&self, name: &str) -> Result<MmapView, Error> {
        let e = self.entry(name)?;
        self.shards[e.shard]
            .map
            .slice(e.start..e.end)
            .map_err(|source| Error::Tensor {
                name: name.to_string(),
                source,
            })
    }

    /// Copies a tensor's bytes, as stored, into `dst` (exactly its length).
    /// Uses positioned reads rather than the mapping, which avoids one page
    /// fault per 4 KiB for large tensors.
    pub fn read_into(&self, name: &str, dst: &mut [u8]) -> Result<(), Error> {
        let e = self.entry(name)?;
        if dst.len() != e.end - e.start {
            return Err(Error::InvalidTensor {
                name: name.to_string(),
                problem: format!(
                    "destination holds {} bytes, the tensor {}",
                    dst.len(),
                    e.end - e.start
                ),
            });
        }
        let shard = &self.shards[e.shard];
        read_at(&shard.file, &shard.map, dst, e.start)
            .map_err(|err| Error::io(&shard.path, "reading", err))
    }

    /// Reads a tensor into a new aligned host buffer, converting it to
    /// `dtype` when both are float types PyTorch-style casts cover (F64, F32,
    /// F16, BF16). Other tensors (integers, bool, fp8) are returned as
    /// stored: check [`cast_target`] for the dtype of the result.
    pub fn read_as(&self, name: &str, dtype: DType) -> Result<HostBuffer, Error> {
        let e = self.entry(name)?;
        let tensor_err = |source| Error::Tensor {
            name: name.to_string(),
            source,
        };
        if cast_target(e.meta.dtype, dtype) == e.meta.dtype {
            let mut buf = HostBuffer::zeroed(e.end - e.start).map_err(tensor_err)?;
            self.read_into(name, buf.as_mut_bytes())?;
            Ok(buf)
        } else {
            let view = self.view(name)?;
            bm_tensor::cast(view.as_bytes(), e.meta.dtype, dtype).map_err(tensor_err)
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
