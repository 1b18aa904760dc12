//! Writing sharded checkpoints as transformers and huggingface_hub do, but
//! atomically: every shard goes to a temporary file first, the index is
//! written last, and shards of an earlier save that the new one does not
//! use are removed.

use std::collections::{HashMap, HashSet};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use bm_tensor::{DType, TensorMeta};

use crate::Error;
use crate::atomic::{AtomicFile, FinishedFile, Opener, open_exclusive, sync_folder, write_atomic};
use crate::checkpoint::cast_target;
use crate::header::{safetensors_order, write_header};
use crate::json::push_python_str;
use crate::lock::{FolderLock, Sharing};

/// File name of the index transformers writes next to safetensors shards.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// File name of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";

/// A tensor to write: its name, dtype and shape, and its bytes as stored.
///
/// Two entries whose `data` is the very same memory (same address and
/// length) are tied, like tensors sharing a storage in PyTorch: the first
/// one is written, the others are dropped and reported.
#[derive(Clone, Copy, Debug)]
pub struct SaveTensor<'a> {
    /// Name in the checkpoint.
    pub name: &'a str,
    /// Dtype and shape of `data`.
    pub meta: &'a TensorMeta,
    /// The bytes, little-endian, C-contiguous.
    pub data: &'a [u8],
}

/// How to shard.
#[derive(Clone, Copy, Debug)]
pub struct ShardOptions {
    /// Largest shard in bytes (huggingface_hub's rule: a shard may exceed it
    /// only by holding a single tensor larger than the limit).
    pub max_shard_size: u64,
    /// Convert F64/F32/F16/BF16 tensors to this dtype on the way; other
    /// dtypes are written as they are.
    pub dtype: Option<DType>,
}

/// One shard written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedShard {
    /// File name inside the output folder.
    pub file_name: String,
    /// Tensors it holds, in file order.
    pub tensors: Vec<String>,
    /// Bytes of tensor data it holds.
    pub data_bytes: u64,
}

/// What [`shard_checkpoint`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedCheckpoint {
    /// The shards, in order.
    pub shards: Vec<SavedShard>,
    /// The index file, when more than one shard was written.
    pub index: Option<PathBuf>,
    /// Bytes of tensor data over all shards (tied tensors counted once).
    pub total_size: u64,
    /// `(dropped, kept)` for each tied tensor that was not written.
    pub dropped_ties: Vec<(String, String)>,
    /// Files of an earlier save that were removed.
    pub removed: Vec<PathBuf>,
}

/// Size and storage identity of one tensor, for [`split_into_shards`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardItem {
    /// Bytes the tensor occupies.
    pub size: u64,
    /// Tensors with the same `Some` storage share their bytes.
    pub storage: Option<usize>,
}

/// huggingface_hub's `split_state_dict_into_shards_factory`: walks the
/// tensors in order; a tensor sharing its storage with an earlier one goes
/// to that one's shard at no cost; a tensor larger than `max` becomes a
/// shard of its own at once; otherwise a new shard starts when the current
/// one would overflow. Returns the shards as lists of item positions (tied
/// items last in their shard) and the total size of distinct storages.
pub fn split_into_shards(items: &[ShardItem], max: u64) -> (Vec<Vec<usize>>, u64) {
    let mut shards: Vec<Vec<usize>> = Vec::new();
    let mut current = Vec::new();
    let mut current_size = 0u64;
    let mut total = 0u64;
    let mut first_of_storage: HashMap<usize, usize> = HashMap::new();
    let mut tied: Vec<(usize, usize)> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        if let Some(storage) = item.storage {
            if let Some(&first) = first_of_storage.get(&storage) {
                tied.push((first, i));
                continue;
            }
            first_of_storage.insert(storage, i);
        }
        total += item.size;
        if item.size > max {
            shards.push(vec![i]);
            continue;
        }
        if current_size + item.size > max && !current.is_empty() {
            shards.push(std::mem::take(&mut current));
            current_size = 0;
        }
        current.push(i);
        current_size += item.size;
    }
    if !current.is_empty() {
        shards.push(current);
    }
    if !tied.is_empty() {
        let shard_of: HashMap<usize, usize> = shards
            .iter()
            .enumerate()
            .flat_map(|(k, s)| s.iter().map(move |&i| (i, k)))
            .collect();
        for (first, other) in tied {
            shards[shard_of[&first]].push(other);
        }
    }
    (shards, total)
}

/// transformers' shard name: `model.safetensors` alone, else
/// `model-0000k-of-0000n.safetensors`.
pub fn shard_file_name(k: usize, n: usize) -> String {
    if n == 1 {
        SINGLE_FILE.to_string()
    } else {
        format!("model-{k:05}-of-{n:05}.safetensors")
    }
}

/// True for names this writer produces for sharded output.
fn is_numbered_shard(name: &str) -> bool {
    let Some(rest) = name
        .strip_prefix("model-")
        .and_then(|r| r.strip_suffix(".safetensors"))
    else {
        return false;
    };
    let b = rest.as_bytes();
    b.len() == 14
        && b[..5].iter().all(u8::is_ascii_digit)
        && &b[5..9] == b"-of-"
        && b[9..].iter().all(u8::is_ascii_digit)
}

/// Writes `tensors` into `out_dir` as a checkpoint transformers loads:
/// shards split by huggingface_hub's rule, safetensors metadata
/// `{"format":"pt"}`, and, when sharded, `model.safetensors.index.json`
/// (`{"metadata":{"total_size"},"weight_map"}`, sorted, indent 2, trailing
/// newline). `progress(done, total)` is called as bytes are written.
///
/// All shards are written to temporary files first; only when every one is
/// complete are they renamed into place, after any earlier index is removed
/// and before the new index is written. On failure the temporary files are
/// removed and `out_dir` holds what it held before (or, if renaming itself
/// fails, no index). `out_dir` must not hold the tensors' source files.
///
/// The whole write, commit and stale-shard removal happen under the
/// folder's [`FolderLock`] (waiting as long as another writer takes), so
/// two writers into one folder never mix or remove each other's shards: the
/// second one's output replaces the first's whole. A caller that writes
/// side files too takes the lock first, with its own [`Sharing`].
pub fn shard_checkpoint(
    tensors: &[SaveTensor<'_>],
    out_dir: &Path,
    options: &ShardOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<SavedCheckpoint, Error> {
    shard_with(tensors, out_dir, options, progress, &open_exclusive)
}

fn shard_with(
    tensors: &[SaveTensor<'_>],
    out_dir: &Path,
    options: &ShardOptions,
    progress: &mut dyn FnMut(u64, u64),
    open_temp: Opener<'_>,
) -> Result<SavedCheckpoint, Error> {
    let out_dtypes = validate(tensors, out_dir, options)?;
    // Storage identity: the same address and length means the same bytes.
    let mut storage_ids: HashMap<(usize, usize), usize> = HashMap::new();
    let mut first_with_storage: Vec<usize> = Vec::new();
    let items: Vec<ShardItem> = tensors
        .iter()
        .zip(&out_dtypes)
        .enumerate()
        .map(|(i, (t, &dtype))| {
            let storage = (!t.data.is_empty()).then(|| {
                let next = first_with_storage.len();
                let id = *storage_ids
                    .entry((t.data.as_ptr() as usize, t.data.len()))
                    .or_insert(next);
                if id == next {
                    first_with_storage.push(i);
                }
                id
            });
            ShardItem {
                // Checked by validate.
                size: (t.meta.numel() * dtype.size_in_bytes()) as u64,
                storage,
            }
        })
        .collect();
    let tied_to = |i: usize| {
        items[i]
            .storage
            .map(|s| first_with_storage[s])
            .filter(|&first| first != i)
    };
    let (mut groups, total_size) = split_into_shards(&items, options.max_shard_size);
    if groups.is_empty() {
        groups.push(Vec::new());
    }
    let mut dropped_ties = Vec::new();
    for group in &mut groups {
        for &i in group.iter() {
            if let Some(first) = tied_to(i) {
                dropped_ties.push((tensors[i].name.to_string(), tensors[first].name.to_string()));
            }
        }
        group.retain(|&i| tied_to(i).is_none());
        group.sort_by(|&a, &b| {
            safetensors_order(
                (tensors[a].name, out_dtypes[a]),
                (tensors[b].name, out_dtypes[b]),
            )
        });
    }

    let _lock = FolderLock::acquire(out_dir, &Sharing::default())?;
    let n = groups.len();
    let names: Vec<String> = (1..=n).map(|k| shard_file_name(k, n)).collect();
    let mut done = 0u64;
    let mut shards = Vec::with_capacity(n);
    // Dropping these on an error removes every temporary file.
    let mut finished = Vec::with_capacity(n);
    for (k, group) in groups.iter().enumerate() {
        let (file, data_bytes) = write_shard(
            &out_dir.join(&names[k]),
            group,
            tensors,
            &out_dtypes,
            open_temp,
            &mut |bytes| {
                done += bytes;
                progress(done, total_size);
            },
        )?;
        finished.push(file);
        shards.push(SavedShard {
            file_name: names[k].clone(),
            tensors: group.iter().map(|&i| tensors[i].name.to_string()).collect(),
            data_bytes,
        });
    }

    // Commit: no index may point at a mix of old and new shards.
    let index_path = out_dir.join(INDEX_FILE);
    remove_if_present(&index_path)?;
    for file in finished {
        file.rename_into_place()?;
    }
    let index = if n > 1 {
        let mut weight_map: Vec<(&str, &str)> = shards
            .iter()
            .flat_map(|s| s.tensors.iter().map(|t| (t.as_str(), s.file_name.as_str())))
            .collect();
        weight_map.sort_unstable();
        write_atomic(&index_path, index_json(total_size, &weight_map).as_bytes())?;
        Some(index_path)
    } else {
        sync_folder(out_dir)?;
        None
    };
    let removed = remove_stale(out_dir, &names)?;
    Ok(SavedCheckpoint {
        shards,
        index,
        total_size,
        dropped_ties,
        removed,
    })
}

/// transformers' index: `json.dumps({"metadata": {"total_size": n},
/// "weight_map": {...}}, indent=2, sort_keys=True) + "\n"`, written straight
/// from the sorted map (no JSON tree, whatever the number of tensors).
fn index_json(total_size: u64, sorted_map: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(64 + sorted_map.len() * 80);
    out.push_str(&format!(
        "{{\n  \"metadata\": {{\n    \"total_size\": {total_size}\n  }},\n  \"weight_map\": {{"
    ));
    for (i, (name, file)) in sorted_map.iter().enumerate() {
        out.push_str(if i == 0 { "\n    " } else { ",\n    " });
        push_python_str(&mut out, name);
        out.push_str(": ");
        push_python_str(&mut out, file);
    }
    out.push_str(if sorted_map.is_empty() {
        "}\n}\n"
    } else {
        "\n  }\n}\n"
    });
    out
}

/// Checks names and lengths; returns the dtype each tensor is written
/// with.
fn validate(
    tensors: &[SaveTensor<'_>],
    out_dir: &Path,
    options: &ShardOptions,
) -> Result<Vec<DType>, Error> {
    let mut seen = HashSet::new();
    tensors
        .iter()
        .map(|t| {
            let bad = |problem: String| Error::invalid_tensor(out_dir, t.name, problem);
            if t.name.is_empty() || t.name == "__metadata__" {
                return Err(bad(
                    "cannot be written: it is not a valid safetensors tensor name".into(),
                ));
            }
            if !seen.insert(t.name) {
                return Err(bad("is given twice".into()));
            }
            let expected = t
                .meta
                .checked_byte_len()
                .ok_or_else(|| bad(format!("shape {:?} overflows", t.meta.shape)))?;
            if t.data.len() != expected {
                return Err(bad(format!(
                    "{} of shape {:?} needs {expected} bytes, {} given",
                    t.meta.dtype,
                    t.meta.shape,
                    t.data.len()
                )));
            }
            let dtype = options
                .dtype
                .map_or(t.meta.dtype, |d| cast_target(t.meta.dtype, d));
            if TensorMeta::new(dtype, t.meta.shape.clone())
                .checked_byte_len()
                .is_none()
            {
                return Err(bad(format!(
                    "shape {:?} overflows as {dtype}",
                    t.meta.shape
                )));
            }
            Ok(dtype)
        })
        .collect()
}

/// Elements converted per step when casting, to bound the scratch buffer.
const CAST_CHUNK_ELEMENTS: usize = 1 << 18;

fn write_shard(
    dest: &Path,
    group: &[usize],
    tensors: &[SaveTensor<'_>],
    out_dtypes: &[DType],
    open_temp: Opener<'_>,
    progress: &mut dyn FnMut(u64),
) -> Result<(FinishedFile, u64), Error> {
    let header_tensors: Vec<(&str, DType, &[usize])> = group
        .iter()
        .map(|&i| {
            (
                tensors[i].name,
                out_dtypes[i],
                tensors[i].meta.shape.as_slice(),
            )
        })
        .collect();
    let io_err = |e| Error::io(dest, "writing", e);
    let mut out = AtomicFile::create_with(dest, open_temp)?;
    let data_len = write_header(&mut out, &[("format", "pt")], &header_tensors).map_err(io_err)?;
    drop(header_tensors);
    let mut scratch = Vec::new();
    for &i in group {
        let (src, to) = (&tensors[i], out_dtypes[i]);
        if src.meta.dtype == to {
            out.write_all(src.data).map_err(io_err)?;
            progress(src.data.len() as u64);
            continue;
        }
        let (from_size, to_size) = (src.meta.dtype.size_in_bytes(), to.size_in_bytes());
        for chunk in src.data.chunks(CAST_CHUNK_ELEMENTS * from_size) {
            scratch.resize(chunk.len() / from_size * to_size, 0);
            bm_tensor::cast_into(chunk, src.meta.dtype, &mut scratch, to)
                .map_err(|source| Error::tensor(dest, src.name, source))?;
            out.write_all(&scratch).map_err(io_err)?;
            progress(scratch.len() as u64);
        }
    }
    Ok((out.finish()?, data_len))
}

fn remove_if_present(path: &Path) -> Result<bool, Error> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io(path, "removing", e)),
    }
}

/// Removes `model-XXXXX-of-YYYYY.safetensors` files (and `model.safetensors`)
/// that the save just finished did not write. A symbolic link of such a
/// name is removed as a link (unlinking never follows it: what it points to
/// is untouched); a folder of such a name is left alone.
fn remove_stale(out_dir: &Path, written: &[String]) -> Result<Vec<PathBuf>, Error> {
    let written: HashSet<&str> = written.iter().map(String::as_str).collect();
    let listing = std::fs::read_dir(out_dir).map_err(|e| Error::io(out_dir, "listing", e))?;
    let mut removed = Vec::new();
    for entry in listing {
        let entry = entry.map_err(|e| Error::io(out_dir, "listing", e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours = is_numbered_shard(&name) || name == SINGLE_FILE;
        // file_type() does not follow links.
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if ours && !is_dir && !written.contains(name.as_str()) {
            let path = entry.path();
            remove_if_present(&path)?;
            removed.push(path);
        }
    }
    removed.sort();
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(shards: &[Vec<usize>], labels: &[&str]) -> Vec<Vec<String>> {
        shards
            .iter()
            .map(|s| s.iter().map(|&i| labels[i].to_string()).collect())
            .collect()
    }

    fn plain(sizes: &[u64]) -> Vec<ShardItem> {
        sizes
            .iter()
            .map(|&size| ShardItem {
                size,
                storage: None,
            })
            .collect()
    }

    const LAYERS: [&str; 5] = ["layer_1", "layer_2", "layer_3", "layer_4", "layer_5"];

    #[test]
    fn hub_multiple_shards() {
        let (shards, total) = split_into_shards(&plain(&[6, 10, 30, 2, 2]), 10);
        assert_eq!(
            names(&shards, &LAYERS),
            [
                vec!["layer_1"],
                vec!["layer_3"],
                vec!["layer_2"],
                vec!["layer_4", "layer_5"]
            ]
        );
        assert_eq!(total, 50);
    }

    #[test]
    fn hub_single_shard() {
        let (shards, total) = split_into_shards(&plain(&[6, 10, 30, 2, 2]), 100);
        assert_eq!(names(&shards, &LAYERS), [LAYERS.to_vec()]);
        assert_eq!(total, 50);
    }

    #[test]
    fn hub_tensor_same_storage() {
        let items: Vec<ShardItem> = [1u64, 2, 1, 2, 1]
            .iter()
            .map(|&v| ShardItem {
                size: v,
                storage: Some(v as usize),
            })
            .collect();
        let (shards, total) = split_into_shards(&items, 1);
        assert_eq!(
            names(&shards, &LAYERS),
            [
                vec!["layer_2", "layer_4"],
                vec!["layer_1", "layer_3", "layer_5"]
            ]
        );
        assert_eq!(total, 3);
    }

    #[test]
    fn accelerate_save_model_for_test() {
        // ModelForTest state dict sizes with max_shard_size=100 -> [96],[40],[100].
        let (shards, total) = split_into_shards(&plain(&[48, 16, 16, 16, 16, 16, 8, 80, 20]), 100);
        assert_eq!(shards, [vec![0, 1, 2, 3], vec![4, 5, 6], vec![7, 8]]);
        assert_eq!(total, 236);
    }

    #[test]
    fn shard_names() {
        assert_eq!(shard_file_name(1, 1), "model.safetensors");
        assert_eq!(shard_file_name(2, 3), "model-00002-of-00003.safetensors");
        assert!(is_numbered_shard("model-00002-of-00003.safetensors"));
        assert!(!is_numbered_shard("model-0002-of-00003.safetensors"));
        assert!(!is_numbered_shard("model.safetensors.index.json"));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn disk_full_leaves_the_folder_untouched() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("keep.txt"), b"x").unwrap();
        let meta = TensorMeta::new(DType::U8, [64]);
        let data = [[1u8; 64], [2u8; 64], [3u8; 64]];
        let tensors: Vec<SaveTensor<'_>> = ["a", "b", "c"]
            .iter()
            .zip(&data)
            .map(|(name, d)| SaveTensor {
                name,
                meta: &meta,
                data: d,
            })
            .collect();
        let options = ShardOptions {
            max_shard_size: 64,
            dtype: None,
        };
        // The second shard's file is /dev/full: every write fails with ENOSPC.
        let opened = std::cell::Cell::new(0);
        let opener = |p: &Path| {
            opened.set(opened.get() + 1);
            if opened.get() == 2 {
                std::fs::File::options().write(true).open("/dev/full")
            } else {
                open_exclusive(p)
            }
        };
        let err = shard_with(&tensors, dir.path(), &options, &mut |_, _| {}, &opener)
            .unwrap_err()
            .to_string();
        assert!(err.contains("model-00002-of-00003.safetensors"), "{err}");
        assert!(err.contains("No space left on device"), "{err}");
        let left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, ["keep.txt"]);
    }
}
