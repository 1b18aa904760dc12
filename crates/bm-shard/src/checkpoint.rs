//! Reading checkpoints: one file (safetensors, or PyTorch's `torch.save`
//! format), an index, or a folder.
//!
//! Opening costs O(n log n) in the number of tensors and memory a small
//! multiple of the headers: tensors are kept in one list, and names are
//! found by binary search in a sorted list of positions.

use std::collections::HashMap;
use std::fs::File;
use std::io::{ErrorKind, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use bm_tensor::{DType, HostBuffer, MmapView, TensorMeta};

use crate::Error;
use crate::header::Header;
use crate::index::Index;
use crate::paths::{Folder, Resolved, open_regular, resolve_in_folder};
use crate::torch;
use crate::write::{INDEX_FILE, SINGLE_FILE};

/// transformers' name for an unsharded PyTorch checkpoint.
const TORCH_SINGLE_FILE: &str = "pytorch_model.bin";
/// transformers' name for the index of a sharded PyTorch checkpoint.
const TORCH_INDEX_FILE: &str = "pytorch_model.bin.index.json";

/// The format of one file of a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// A `.safetensors` file.
    Safetensors,
    /// A PyTorch `torch.save` file (`pytorch_model.bin`), read by
    /// [`crate::torch`] without running its pickle.
    Torch,
}

/// One file of a checkpoint.
#[derive(Debug)]
pub struct ShardFile {
    /// Path as found (the index's folder joined with the shard name).
    pub path: PathBuf,
    /// Its format.
    pub format: Format,
    /// The `__metadata__` of a safetensors header (`None` for PyTorch files).
    pub metadata: Option<Vec<(String, String)>>,
    /// Number of tensors read from it.
    pub tensors: usize,
    /// Bytes of tensor data it holds (a shared storage counted once).
    pub data_bytes: u64,
    map: MmapView,
    file: File,
}

#[derive(Debug)]
struct Entry {
    name: String,
    meta: TensorMeta,
    shard: usize,
    /// Byte range in the file (data start already added): exactly the
    /// tensor's bytes, or for a strided view the range its elements span.
    start: usize,
    end: usize,
    /// Strides in elements of a view that is not contiguous (PyTorch files
    /// only); its bytes are gathered when read.
    strides: Option<Vec<usize>>,
}

/// A tensor's bytes as stored, in C order: a zero-copy window of the
/// mapped file, or a host buffer for a view that had to be gathered.
#[derive(Debug)]
pub enum TensorBytes {
    /// A contiguous tensor, straight from the mapping.
    Mapped(MmapView),
    /// A strided view of a PyTorch storage, gathered into C order.
    Gathered(HostBuffer),
}

impl TensorBytes {
    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            TensorBytes::Mapped(v) => v.as_bytes(),
            TensorBytes::Gathered(b) => b.as_bytes(),
        }
    }
}

/// A checkpoint opened lazily: headers (or a PyTorch file's pickle) are
/// parsed and validated at [`Checkpoint::open`]; tensor bytes are only read
/// when asked for.
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
    /// Opens a checkpoint file (`.safetensors`, or a PyTorch `torch.save`
    /// file such as `pytorch_model.bin`), a `*.index.json` (transformers'
    /// `weight_map` form or Accelerate's flat form, naming files of either
    /// format), or a folder. Reads headers (or a PyTorch file's pickle) only.
    ///
    /// A folder is read as transformers reads one. What is opened, in order
    /// of preference: `model.safetensors`; its one safetensors index (any
    /// `*.index.json` but `*.bin.index.json`); `pytorch_model.bin`; its one
    /// `*.bin.index.json`. So safetensors win when both formats are there.
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
            Self::from_files(path, None, vec![(path.to_path_buf(), open_regular(path)?)])
        }
    }

    /// Opens the safetensors file an offload index names, already resolved
    /// (and checked to be a `*.safetensors` name).
    pub(crate) fn open_resolved(file: &Resolved) -> Result<Checkpoint, Error> {
        Self::from_files(&file.named, None, vec![(file.named.clone(), file.open()?)])
    }

    fn open_folder(folder: &Path) -> Result<Checkpoint, Error> {
        let in_folder = |name: &str| {
            resolve_in_folder(folder, name)
                .map_err(|problem| Error::checkpoint(folder, format!("{name} {problem}")))
        };
        // Absent is not the same as out of reach: a name that cannot be
        // looked at (a folder that may not be entered) is an error.
        let present = |name: &str| {
            let path = folder.join(name);
            match std::fs::symlink_metadata(&path) {
                Ok(_) => Ok(true),
                Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::NotADirectory) => {
                    Ok(false)
                }
                Err(e) => Err(Error::io(path, "looking for", e)),
            }
        };
        let open_single = |name: &str| {
            let single = in_folder(name)?;
            Self::from_files(folder, None, vec![(single.named.clone(), single.open()?)])
        };
        if present(SINGLE_FILE)? {
            return open_single(SINGLE_FILE);
        }
        let names: Vec<String> = match std::fs::read_dir(folder) {
            Ok(listing) => listing
                .map(|entry| {
                    let entry = entry.map_err(|e| Error::io(folder, "listing", e))?;
                    // Not UTF-8: no name this crate looks for.
                    Ok(entry.file_name().to_str().map(str::to_string))
                })
                .filter_map(Result::transpose)
                .collect::<Result<_, Error>>()?,
            // A folder that may be entered but not listed: the index names
            // transformers looks up, looked up by name.
            Err(e) if e.kind() == ErrorKind::PermissionDenied => {
                let mut found = Vec::new();
                for name in [INDEX_FILE, TORCH_INDEX_FILE] {
                    if present(name)? {
                        found.push(name.to_string());
                    }
                }
                if found.is_empty() && !present(TORCH_SINGLE_FILE)? {
                    return Err(Error::checkpoint(
                        folder,
                        format!(
                            "permission denied listing the folder (it may be entered but not \
                             listed), and none of {SINGLE_FILE}, {INDEX_FILE}, \
                             {TORCH_SINGLE_FILE} and {TORCH_INDEX_FILE} is there by name"
                        ),
                    ));
                }
                found
            }
            Err(e) => return Err(Error::io(folder, "listing", e)),
        };
        let (torch_indexes, indexes): (Vec<String>, Vec<String>) = names
            .into_iter()
            .filter(|name| name.ends_with(".index.json"))
            .partition(|name| name.ends_with(".bin.index.json"));
        let open_index = |name: String| {
            let index = in_folder(&name)?;
            Self::open_index(folder, &index.named, index.open()?)
        };
        if let Some(index) = only_index(folder, indexes)? {
            return open_index(index);
        }
        if present(TORCH_SINGLE_FILE)? {
            return open_single(TORCH_SINGLE_FILE);
        }
        if let Some(index) = only_index(folder, torch_indexes)? {
            return open_index(index);
        }
        // A writer between removing an old index and writing the new.
        match crate::lock::writer_of(folder) {
            Some(holder) => Err(Error::Locked {
                folder: folder.to_path_buf(),
                holder,
                waited: None,
            }),
            None => Err(Error::checkpoint(
                folder,
                "is not a checkpoint folder: it holds none of model.safetensors, a *.index.json and pytorch_model.bin",
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
        let in_folder = Folder::new(folder)
            .map_err(|problem| Error::index(index_path, format!("its folder {problem}")))?;
        for name in index.shard_files() {
            let shard = in_folder.resolve(name).map_err(|problem| {
                Error::index(
                    index_path,
                    format!(
                        "tensor {:?} names shard {name:?}, which {problem}",
                        named_by[name]
                    ),
                )
            })?;
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
            let (shard, tensors) = if format_of(&path, &mut file)? == Format::Torch {
                open_torch(path, file)?
            } else {
                open_safetensors(path, file)?
            };
            entries.reserve(tensors.len());
            entries.extend(tensors.into_iter().map(|e| Entry { shard: i, ..e }));
            shards.push(shard);
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

    /// The files, in reading order (sorted shard names).
    pub fn files(&self) -> &[ShardFile] {
        &self.shards
    }

    /// A file of this checkpoint (shard or index) that lives in `folder`,
    /// either as named or where its link resolves to (a Hugging Face cache
    /// snapshot's shards are links into `blobs/`); `None` when there is
    /// none or `folder` does not exist. Writers that must never write
    /// beside or over what they read (`shard`'s output folder, an offload
    /// folder) refuse such a folder.
    pub fn file_in_folder(&self, folder: &Path) -> Option<&Path> {
        let folder = folder.canonicalize().ok()?;
        let sources = self
            .shards
            .iter()
            .map(|f| f.path.as_path())
            .chain(self.index_path());
        for source in sources {
            let named_folder = match source.parent() {
                Some(p) if !p.as_os_str().is_empty() => p,
                _ => Path::new("."),
            };
            let real_folder = source
                .canonicalize()
                .ok()
                .and_then(|p| p.parent().map(Path::to_path_buf));
            if named_folder.canonicalize().ok().as_deref() == Some(folder.as_path())
                || real_folder.as_deref() == Some(folder.as_path())
            {
                return Some(source);
            }
        }
        None
    }

    /// The format of the file holding a tensor.
    pub fn format_of(&self, name: &str) -> Option<Format> {
        self.position(name)
            .map(|i| self.shards[self.entries[i].shard].format)
    }

    /// Groups of names for the very same bytes (same file, offset, dtype,
    /// shape and strides), in checkpoint order: tied weights a PyTorch
    /// state dict stores once under several names. Safetensors files never
    /// hold any. Views that only overlap (a row of a matrix) are not ties,
    /// and neither are empty tensors, which have no bytes to share.
    pub fn ties(&self) -> Vec<Vec<&str>> {
        let mut groups: Vec<Vec<&Entry>> = Vec::new();
        // Groups starting at each place of a file.
        let mut at: HashMap<(usize, usize, usize), Vec<usize>> = HashMap::new();
        for e in self.entries.iter().filter(|e| e.start < e.end) {
            let here = at.entry((e.shard, e.start, e.end)).or_default();
            let same = here.iter().copied().find(|&g| {
                let first = groups[g][0];
                first.meta == e.meta && first.strides == e.strides
            });
            match same {
                Some(g) => groups[g].push(e),
                None => {
                    here.push(groups.len());
                    groups.push(vec![e]);
                }
            }
        }
        groups
            .into_iter()
            .filter(|g| g.len() > 1)
            .map(|g| g.into_iter().map(|e| e.name.as_str()).collect())
            .collect()
    }

    /// Every tensor with its dtype and shape, in file order, then data
    /// offset (safetensors) or state-dict order (PyTorch).
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

    /// Total bytes of tensor data (a shared storage counted once).
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
    /// truncated since it was opened, and for a strided view in a PyTorch
    /// file, whose elements are not one range of the file:
    /// [`Checkpoint::bytes`] and [`Checkpoint::read_as`] read every tensor.
    pub fn view(&self, name: &str) -> Result<MmapView, Error> {
        let e = self.entry(name)?;
        if let Some(strides) = &e.strides {
            return Err(Error::checkpoint(
                &self.shards[e.shard].path,
                format!(
                    "tensor {name:?} is a non-contiguous view of its storage (shape {:?}, strides {strides:?}), so it has no zero-copy view; read it with Checkpoint::bytes or Checkpoint::read_as",
                    e.meta.shape
                ),
            ));
        }
        self.window(e)
    }

    /// The mapped bytes `e` spans.
    fn window(&self, e: &Entry) -> Result<MmapView, Error> {
        let shard = self.check_intact(e)?;
        shard
            .map
            .slice(e.start..e.end)
            .map_err(|source| Error::tensor(&shard.path, &e.name, source))
    }

    /// A tensor's bytes as stored, in C order: a zero-copy view of the
    /// mapping, or for a strided view in a PyTorch file a host buffer its
    /// elements are gathered into.
    pub fn bytes(&self, name: &str) -> Result<TensorBytes, Error> {
        let e = self.entry(name)?;
        if e.strides.is_none() {
            return self.window(e).map(TensorBytes::Mapped);
        }
        let mut buf = HostBuffer::zeroed(e.meta.byte_len())
            .map_err(|source| Error::tensor(&self.shards[e.shard].path, name, source))?;
        self.read_into(name, buf.as_mut_bytes())?;
        Ok(TensorBytes::Gathered(buf))
    }

    /// Copies a tensor's bytes, as stored, into `dst` (exactly its length).
    /// Uses positioned reads rather than the mapping, which avoids one page
    /// fault per 4 KiB for large tensors; a strided view is gathered from
    /// the mapping.
    pub fn read_into(&self, name: &str, dst: &mut [u8]) -> Result<(), Error> {
        let e = self.entry(name)?;
        let shard = self.check_intact(e)?;
        let len = e.meta.byte_len();
        if dst.len() != len {
            return Err(Error::invalid_tensor(
                &shard.path,
                name,
                format!("destination holds {} bytes, the tensor {len}", dst.len()),
            ));
        }
        match &e.strides {
            None => read_at(&shard.file, &shard.map, dst, e.start)
                .map_err(|err| Error::io(&shard.path, "reading", err)),
            Some(strides) => {
                let span = self.window(e)?;
                let elem = e.meta.dtype.size_in_bytes();
                torch::gather(span.as_bytes(), &e.meta.shape, strides, elem, dst);
                Ok(())
            }
        }
    }

    /// Reads a tensor into a new aligned host buffer, converting it to
    /// `dtype` when both are float types PyTorch-style casts cover (F64, F32,
    /// F16, BF16). Other tensors (integers, bool, fp8) are returned as
    /// stored: check [`cast_target`] for the dtype of the result.
    pub fn read_as(&self, name: &str, dtype: DType) -> Result<HostBuffer, Error> {
        let e = self.entry(name)?;
        let path = &self.shards[e.shard].path;
        if cast_target(e.meta.dtype, dtype) == e.meta.dtype {
            let mut buf = HostBuffer::zeroed(e.meta.byte_len())
                .map_err(|source| Error::tensor(path, name, source))?;
            self.read_into(name, buf.as_mut_bytes())?;
            Ok(buf)
        } else {
            let bytes = self.bytes(name)?;
            bm_tensor::cast(bytes.as_bytes(), e.meta.dtype, dtype)
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

/// The one index of a kind in a folder, if any.
fn only_index(folder: &Path, mut names: Vec<String>) -> Result<Option<String>, Error> {
    names.sort();
    match names.len() {
        0 => Ok(None),
        1 => Ok(names.pop()),
        _ => Err(Error::checkpoint(
            folder,
            format!(
                "holds more than one *.index.json ({}); delete the irrelevant ones or pass one of them",
                names.join(", ")
            ),
        )),
    }
}

/// A file's format: `.safetensors` by name; a PyTorch file by name
/// (`.bin`, `.pt`, `.pth`, `.ckpt`) or by its first bytes (a zip archive, a
/// legacy torch.save pickle); safetensors otherwise, whose header parser
/// then says what is wrong.
fn format_of(path: &Path, file: &mut File) -> Result<Format, Error> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if name.ends_with(".safetensors") {
        return Ok(Format::Safetensors);
    }
    if [".bin", ".pt", ".pth", ".ckpt"]
        .iter()
        .any(|ext| name.ends_with(ext))
    {
        return Ok(Format::Torch);
    }
    let mut head = Vec::with_capacity(262);
    (&*file)
        .take(262)
        .read_to_end(&mut head)
        .and_then(|_| file.seek(SeekFrom::Start(0)))
        .map_err(|e| Error::io(path, "reading", e))?;
    Ok(if torch::looks_like_torch(&head) {
        Format::Torch
    } else {
        Format::Safetensors
    })
}

fn open_safetensors(path: PathBuf, mut file: File) -> Result<(ShardFile, Vec<Entry>), Error> {
    let (header, file_len) = Header::read_from(&mut file, &path)?;
    let map = map_whole(&path, &file, file_len)?;
    let base = header.data_start() as usize;
    let data_bytes = file_len - header.data_start();
    let entries = header
        .tensors
        .into_iter()
        .map(|t| Entry {
            name: t.name,
            meta: t.meta,
            shard: 0,
            start: base + t.data_offsets.0 as usize,
            end: base + t.data_offsets.1 as usize,
            strides: None,
        })
        .collect::<Vec<_>>();
    let shard = ShardFile {
        path,
        format: Format::Safetensors,
        metadata: header.metadata,
        tensors: entries.len(),
        data_bytes,
        map,
        file,
    };
    Ok((shard, entries))
}

fn open_torch(path: PathBuf, file: File) -> Result<(ShardFile, Vec<Entry>), Error> {
    let file_len = file
        .metadata()
        .map_err(|e| Error::io(&path, "reading the size of", e))?
        .len();
    let map = map_whole(&path, &file, file_len)?;
    let parsed = torch::parse(&path, map.as_bytes())?;
    let entries = parsed
        .tensors
        .into_iter()
        .map(|t| {
            let span = t.span();
            Entry {
                name: t.name,
                meta: t.meta,
                shard: 0,
                start: span.start,
                end: span.end,
                strides: t.strides,
            }
        })
        .collect::<Vec<_>>();
    let shard = ShardFile {
        path,
        format: Format::Torch,
        metadata: None,
        tensors: entries.len(),
        data_bytes: parsed.storages.iter().map(|s| s.len() as u64).sum(),
        map,
        file,
    };
    Ok((shard, entries))
}

/// Maps all `file_len` bytes of an opened file.
fn map_whole(path: &Path, file: &File, file_len: u64) -> Result<MmapView, Error> {
    let map = MmapView::map_file(file, path)
        .map_err(|e| Error::checkpoint(path, format!("mapping failed: {e}")))?;
    if map.len() as u64 != file_len {
        return Err(Error::checkpoint(
            path,
            "the file changed size while being opened",
        ));
    }
    Ok(map)
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
