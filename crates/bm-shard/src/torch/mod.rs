//! PyTorch checkpoints (`pytorch_model.bin` and other `torch.save` files),
//! read without running a line of their pickle.
//!
//! Two layouts are read. The zip archive `torch.save` has written since
//! PyTorch 1.6 holds `<archive>/data.pkl` (the pickled state dict, whose
//! tensors name their storages by key) and one uncompressed record
//! `<archive>/data/<key>` per storage, so a storage is a window of the
//! mapped file. The legacy format (`_use_new_zipfile_serialization=False`,
//! and every file before 1.6) is a run of pickles followed by the storages
//! back to back, each after an 8-byte element count. The tar format of
//! PyTorch before 0.4 is refused with a message saying how to convert it.
//!
//! [`parse`] reads the structure only (the zip's central directory, the
//! pickle, and for the legacy format the 8-byte count before each storage),
//! checks every tensor against its storage, and describes where each
//! tensor's bytes are. A tensor that is a contiguous window of its storage
//! is a byte range of the file; any other view (a transpose, a column
//! slice) keeps its strides and is gathered by [`gather`] when read.
//! Tensors sharing a storage stay shared: two names for the same view have
//! the same range.

mod pickle;
mod zip;

use std::collections::HashMap;
use std::path::Path;

use bm_tensor::TensorMeta;

use crate::Error;
use pickle::{Format, Object, StorageDecl, TensorDecl, Unpickled, Value, unpickle};

/// The 80-bit magic number opening a legacy `torch.save` file.
const LEGACY_MAGIC: i128 = 0x1950a86a20f9469cfc6c;
/// The serialization protocol version legacy files record.
const LEGACY_PROTOCOL: i128 = 1001;

/// One tensor of a PyTorch checkpoint: what it is and where its bytes are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TorchTensor {
    /// Key in the state dict.
    pub name: String,
    /// Dtype and shape.
    pub meta: TensorMeta,
    /// Index of its storage in [`TorchFile::storages`].
    pub storage: usize,
    /// File offset of the tensor's first element.
    pub start: usize,
    /// `None` when the tensor is the contiguous range
    /// `start..start + meta.byte_len()`; otherwise its strides in elements,
    /// for [`gather`].
    pub strides: Option<Vec<usize>>,
}

impl TorchTensor {
    /// The byte range of the file the tensor's elements lie in (exactly its
    /// bytes when contiguous).
    pub fn span(&self) -> std::ops::Range<usize> {
        let elem = self.meta.dtype.size_in_bytes();
        let end = match &self.strides {
            None => self.start + self.meta.byte_len(),
            // Checked against the storage when the file was parsed.
            Some(strides) => {
                let last: usize = self
                    .meta
                    .shape
                    .iter()
                    .zip(strides)
                    .map(|(&n, &s)| (n - 1) * s)
                    .sum();
                self.start + (last + 1) * elem
            }
        };
        self.start..end
    }
}

/// A parsed PyTorch checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TorchFile {
    /// The tensors, in state-dict order.
    pub tensors: Vec<TorchTensor>,
    /// The byte range of every storage the tensors use, in the order the
    /// pickle first names them.
    pub storages: Vec<std::ops::Range<usize>>,
}

/// What kind of file `bytes` opens with, if it is a PyTorch checkpoint.
pub fn looks_like_torch(bytes: &[u8]) -> bool {
    bytes.starts_with(b"PK\x03\x04")
        || bytes.starts_with(&[0x80, 0x02, 0x8a, 0x0a])
        || is_tar(bytes)
}

fn is_tar(bytes: &[u8]) -> bool {
    bytes.get(257..262) == Some(b"ustar")
}

/// Parses the PyTorch checkpoint held in `file` (the whole file, usually a
/// mapping; `path` names it in errors). Reads the structure only; refuses
/// any pickle that asks for more than tensors and plain containers.
pub fn parse(path: &Path, file: &[u8]) -> Result<TorchFile, Error> {
    if file.starts_with(b"PK") {
        parse_zip(path, file)
    } else if file.starts_with(&[0x80, 0x02, 0x8a, 0x0a]) {
        parse_legacy(path, file)
    } else if is_tar(file) {
        Err(Error::torch(
            path,
            None,
            "is a tar archive, the format of PyTorch before 0.4, which is not read: load it with torch.load and save it again with torch.save (or as safetensors)",
        ))
    } else {
        Err(Error::torch(
            path,
            None,
            "is not a PyTorch checkpoint: neither a torch.save zip archive nor a legacy torch.save file",
        ))
    }
}

fn parse_zip(path: &Path, file: &[u8]) -> Result<TorchFile, Error> {
    let records = zip::records(path, file)?;
    let mut by_name = HashMap::with_capacity(records.len());
    for r in &records {
        if by_name.insert(r.name.as_str(), r).is_some() {
            return Err(Error::torch(
                path,
                Some(&r.name),
                "appears twice in the archive",
            ));
        }
    }
    // torch writes every record under one folder, `<archive>/`.
    let pickles: Vec<&zip::Record> = records
        .iter()
        .filter(|r| {
            r.name
                .strip_suffix("/data.pkl")
                .is_some_and(|archive| !archive.is_empty() && !archive.contains('/'))
        })
        .collect();
    let pkl = match pickles.as_slice() {
        [one] => *one,
        [] => {
            return Err(Error::torch(
                path,
                None,
                "is a zip archive without an <archive>/data.pkl record: not a torch.save file",
            ));
        }
        many => {
            return Err(Error::torch(
                path,
                None,
                format!(
                    "holds {} data.pkl records ({}); torch.save writes one",
                    many.len(),
                    many.iter()
                        .map(|r| r.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
    };
    let prefix = &pkl.name[..pkl.name.len() - "data.pkl".len()];
    let byteorder_name = format!("{prefix}byteorder");
    if let Some(r) = by_name.get(byteorder_name.as_str()) {
        let order = r.stored(path, file)?;
        if order != b"little" {
            return Err(Error::torch(
                path,
                Some(&r.name),
                format!(
                    "says the storages are {:?}; only little-endian checkpoints are read (load and save it with torch on a little-endian machine)",
                    String::from_utf8_lossy(order)
                ),
            ));
        }
    }
    let unpickled = unpickle(pkl.stored(path, file)?, Format::Zip)
        .map_err(|e| Error::torch(path, Some(&pkl.name), e))?;
    let mut storages = Vec::with_capacity(unpickled.storages.len());
    for decl in &unpickled.storages {
        let name = format!("{prefix}data/{}", decl.key);
        let record = by_name.get(name.as_str()).ok_or_else(|| {
            Error::torch(
                path,
                Some(&name),
                format!("is missing: {} refers to storage {:?}", pkl.name, decl.key),
            )
        })?;
        let bytes = record.stored(path, file)?;
        let len = check_storage_len(path, &name, decl, bytes.len())?;
        storages.push(record.start..record.start + len);
    }
    tensors(path, &pkl.name, &unpickled, storages)
}

/// The pickle at `*at`, moving `*at` past it.
fn next_pickle(path: &Path, file: &[u8], at: &mut usize, what: &str) -> Result<Unpickled, Error> {
    let u = unpickle(&file[*at..], Format::Legacy)
        .map_err(|e| Error::torch(path, Some(&format!("{what} pickle at offset {at}")), e))?;
    *at += u.end;
    Ok(u)
}

fn parse_legacy(path: &Path, file: &[u8]) -> Result<TorchFile, Error> {
    let mut at = 0;
    let magic = next_pickle(path, file, &mut at, "magic number")?;
    let protocol = next_pickle(path, file, &mut at, "protocol version")?;
    if !matches!(magic.root, Value::Int(LEGACY_MAGIC))
        || !matches!(protocol.root, Value::Int(LEGACY_PROTOCOL))
    {
        return Err(Error::torch(
            path,
            None,
            "starts like a legacy torch.save file but lacks its magic number and protocol 1001",
        ));
    }
    let sys_info = next_pickle(path, file, &mut at, "sys_info")?;
    if lookup(&sys_info, "little_endian").is_some_and(|v| matches!(v, Value::Bool(false))) {
        return Err(Error::torch(
            path,
            None,
            "was saved on a big-endian machine; only little-endian checkpoints are read (load and save it with torch on a little-endian machine)",
        ));
    }
    let main_at = at;
    let main = next_pickle(path, file, &mut at, "state dict")?;
    let keys = next_pickle(path, file, &mut at, "storage keys")?;
    let key_list: Vec<&str> = match &keys.root {
        Value::Object(i) => match &keys.objects[*i] {
            Object::List(items) => items
                .iter()
                .map(|v| match v {
                    Value::Str(s) => Ok(&**s),
                    _ => Err(()),
                })
                .collect::<Result<_, _>>()
                .ok(),
            Object::Dict(_) => None,
        },
        _ => None,
    }
    .ok_or_else(|| {
        Error::torch(
            path,
            None,
            "its list of storage keys is not a list of strings",
        )
    })?;
    // The storages follow the key list in its order, each an 8-byte
    // element count and the elements.
    let mut found: HashMap<&str, std::ops::Range<usize>> = HashMap::new();
    for key in key_list {
        let record = format!("storage {key}");
        let decl = main.storages.iter().find(|d| d.key == key).ok_or_else(|| {
            Error::torch(
                path,
                Some(&record),
                "is listed but no tensor uses it, so its element size is unknown",
            )
        })?;
        let count = file
            .get(at..at + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
            .ok_or_else(|| {
                Error::torch(
                    path,
                    Some(&record),
                    format!("its size at offset {at} is past the end of the file (truncated?)"),
                )
            })?;
        let len = decl
            .ty
            .element_size()
            .and_then(|e| count.checked_mul(e as u64))
            .and_then(|l| usize::try_from(l).ok())
            .filter(|&l| at + 8 + l <= file.len())
            .ok_or_else(|| {
                Error::torch(
                    path,
                    Some(&record),
                    format!("its {count} elements of {} at offset {} run past the end of the file ({} bytes; truncated?)", decl.ty.name(), at + 8, file.len()),
                )
            })?;
        let len = check_storage_len(path, &record, decl, len)?;
        found.insert(key, at + 8..at + 8 + len);
        at += 8 + len;
    }
    let mut storages = Vec::with_capacity(main.storages.len());
    for decl in &main.storages {
        let range = found.get(decl.key.as_str()).ok_or_else(|| {
            Error::torch(
                path,
                Some(&format!("storage {}", decl.key)),
                "is used by a tensor but missing from the file",
            )
        })?;
        storages.push(range.clone());
    }
    tensors(
        path,
        &format!("state dict pickle at offset {main_at}"),
        &main,
        storages,
    )
}

/// A key's value in the root dict of a pickle.
fn lookup<'a>(u: &'a Unpickled, key: &str) -> Option<&'a Value> {
    let Value::Object(i) = u.root else {
        return None;
    };
    match &u.objects[i] {
        Object::Dict(items) => items
            .iter()
            .find(|(k, _)| matches!(k, Value::Str(s) if &**s == key))
            .map(|(_, v)| v),
        Object::List(_) => None,
    }
}

/// A storage record must hold what its declaration says; returns the
/// storage's length in bytes.
fn check_storage_len(
    path: &Path,
    record: &str,
    decl: &StorageDecl,
    len: usize,
) -> Result<usize, Error> {
    let Some(elem) = decl.ty.element_size() else {
        return Ok(len); // no dtype: its tensors are refused by name
    };
    let needed = decl.numel.checked_mul(elem as u64);
    if needed.is_none_or(|n| n > len as u64) {
        return Err(Error::torch(
            path,
            Some(record),
            format!(
                "holds {len} bytes, but storage {:?} is declared as {} elements of {}{}",
                decl.key,
                decl.numel,
                decl.ty.name(),
                needed.map_or(String::new(), |n| format!(" ({n} bytes)"))
            ),
        ));
    }
    // Not larger than `len`, which is a usize.
    Ok(needed.unwrap_or(0) as usize)
}

/// The root dict's entries as tensors, each checked against its storage.
fn tensors(
    path: &Path,
    record: &str,
    u: &Unpickled,
    storages: Vec<std::ops::Range<usize>>,
) -> Result<TorchFile, Error> {
    let fail = |problem: String| Error::torch(path, Some(record), problem);
    let items = match u.root {
        Value::Object(i) => match &u.objects[i] {
            Object::Dict(items) => Some(items),
            Object::List(_) => None,
        },
        _ => None,
    }
    .ok_or_else(|| fail("holds no dict: a state dict (name → tensor) is expected".to_string()))?;
    let mut seen = HashMap::with_capacity(items.len());
    let mut out = Vec::with_capacity(items.len());
    for (key, value) in items {
        let Value::Str(name) = key else {
            return Err(fail(
                "has a key that is not a string; a state dict maps names to tensors".into(),
            ));
        };
        if seen.insert(&**name, ()).is_some() {
            return Err(fail(format!("has the key {name:?} twice")));
        }
        let Value::Tensor(t) = value else {
            let kind = match value {
                Value::Object(i) => match u.objects[*i] {
                    Object::Dict(_) => "a dict",
                    Object::List(_) => "a list",
                },
                Value::Tuple(_) => "a tuple",
                Value::Str(_) => "a str",
                Value::Int(_) => "an int",
                Value::Float => "a float",
                Value::Bool(_) => "a bool",
                Value::None => "None",
                Value::Global(_) | Value::Storage(_) | Value::Tensor(_) => "not a tensor",
            };
            return Err(fail(format!(
                "entry {name:?} is {kind}, not a tensor: a flat state dict (name → tensor), as transformers saves, is expected"
            )));
        };
        let decl = &u.tensors[*t];
        out.push(
            tensor(
                name,
                decl,
                &u.storages[decl.storage],
                &storages[decl.storage],
            )
            .map_err(fail)?,
        );
    }
    Ok(TorchFile {
        tensors: out,
        storages,
    })
}

/// Checks a tensor against its storage and says where its bytes are.
fn tensor(
    name: &str,
    decl: &TensorDecl,
    storage: &StorageDecl,
    bytes: &std::ops::Range<usize>,
) -> Result<TorchTensor, String> {
    let fail = |why: String| format!("tensor {name:?} {why}");
    let dtype = decl.dtype.map_err(|torch| {
        fail(format!(
            "has an unknown torch dtype ({torch}): only the safetensors dtypes F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U8 and BOOL are read"
        ))
    })?;
    let too_large = || fail("has a shape too large to address".to_string());
    let to_usize = |v: &[u64]| -> Result<Vec<usize>, String> {
        v.iter()
            .map(|&x| usize::try_from(x).map_err(|_| too_large()))
            .collect()
    };
    let meta = TensorMeta::new(dtype, to_usize(&decl.shape)?);
    let strides = to_usize(&decl.strides)?;
    let byte_len = meta.checked_byte_len().ok_or_else(too_large)?;
    let elem = dtype.size_in_bytes();
    let storage_elems = (bytes.len() / elem) as u64;
    let key = &storage.key;
    let start_elem = decl.offset;
    if byte_len > bytes.len() {
        return Err(fail(format!(
            "needs {byte_len} bytes, more than its storage {key:?} holds ({}): a view that repeats elements (expand) is not read; save it after .contiguous()",
            bytes.len()
        )));
    }
    let mut last = start_elem;
    if meta.checked_numel() != Some(0) {
        for (&n, &s) in meta.shape.iter().zip(&strides) {
            last = (n as u64 - 1)
                .checked_mul(s as u64)
                .and_then(|x| x.checked_add(last))
                .ok_or_else(too_large)?;
        }
        if last >= storage_elems {
            return Err(fail(format!(
                "reaches element {last} of storage {key:?}, which has {storage_elems} elements of {dtype}"
            )));
        }
    } else if start_elem > storage_elems {
        return Err(fail(format!(
            "starts at element {start_elem} of storage {key:?}, which has {storage_elems}"
        )));
    }
    let start = bytes.start + start_elem as usize * elem;
    let contiguous = meta.checked_numel() == Some(0) || {
        let mut expected = 1usize;
        meta.shape.iter().zip(&strides).rev().all(|(&n, &s)| {
            let ok = n == 1 || s == expected;
            expected *= n;
            ok
        })
    };
    Ok(TorchTensor {
        name: name.to_string(),
        meta,
        storage: decl.storage,
        start,
        strides: (!contiguous).then_some(strides),
    })
}

/// Copies the elements of a strided view into `dst` in C order. `src`
/// starts at the view's first element; `shape` and `strides` (in elements)
/// were checked against it, and `dst` holds exactly the view's bytes.
pub fn gather(src: &[u8], shape: &[usize], strides: &[usize], elem: usize, dst: &mut [u8]) {
    let Some((&inner, outer)) = shape.split_last() else {
        dst.copy_from_slice(&src[..elem]);
        return;
    };
    if dst.is_empty() {
        return;
    }
    let inner_stride = strides[outer.len()];
    let mut index = vec![0usize; outer.len()];
    let mut out = dst.chunks_exact_mut(inner * elem);
    loop {
        let base: usize = index.iter().zip(strides).map(|(i, s)| i * s).sum();
        let row = out.next().expect("dst holds numel elements");
        if inner_stride == 1 {
            row.copy_from_slice(&src[base * elem..(base + inner) * elem]);
        } else {
            for (j, e) in row.chunks_exact_mut(elem).enumerate() {
                let at = (base + j * inner_stride) * elem;
                e.copy_from_slice(&src[at..at + elem]);
            }
        }
        // Odometer over the outer dimensions, last fastest.
        let mut d = outer.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < outer[d] {
                break;
            }
            index[d] = 0;
        }
    }
}
