//! Where blocks get their weights: the [`WeightSource`] trait, and
//! [`FolderWeights`], a source reading a Hugging Face folder's safetensors.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bm_tensor::{DType, MmapView, TensorMeta};

use crate::tensor::{HostBytes, is_compute_dtype};
use crate::{Error, Tensor};

/// Supplies tensors by their full transformers name
/// (`model.layers.3.self_attn.q_proj.weight`).
///
/// Models call [`WeightSource::begin_block`] before a block runs, fetch its
/// tensors with [`WeightSource::tensor`], drop them after the block, and call
/// [`WeightSource::end_block`]: the places where an offloading source loads
/// a block's weights onto the execution device and releases them, like
/// Accelerate's pre- and post-forward hooks. Block names are transformers
/// module names (`model.embed_tokens`, `model.layers.0`, `lm_head`,
/// `encoder.layer.2`).
pub trait WeightSource: Sync {
    /// The tensor called `name`, on the backend the block runs on.
    fn tensor(&self, name: &str) -> Result<Arc<Tensor>, Error>;

    /// Called before block `block` fetches its tensors.
    fn begin_block(&self, block: &str) -> Result<(), Error> {
        let _ = block;
        Ok(())
    }

    /// Called after block `block` ran and dropped its tensors.
    fn end_block(&self, block: &str) {
        let _ = block;
    }
}

/// One tensor's place in a safetensors file.
#[derive(Debug)]
struct Entry {
    meta: TensorMeta,
    view: MmapView,
}

/// The safetensors weights of a Hugging Face model folder
/// (`model.safetensors`, or `model.safetensors.index.json` and its shards),
/// memory-mapped. Tensors already in the wanted dtype are zero-copy windows
/// of the mapping; others are cast (PyTorch's rounding) on each fetch.
///
/// This reads safetensors headers itself with the `safetensors` crate; it
/// is the piece to swap for `bm_shard::Checkpoint` once that exists.
#[derive(Debug)]
pub struct FolderWeights {
    dir: PathBuf,
    dtype: Option<DType>,
    entries: HashMap<String, Entry>,
}

impl FolderWeights {
    /// Maps the weights of `dir`. With `dtype`, float tensors are returned
    /// in that dtype (as `from_pretrained(torch_dtype=...)` would load them).
    pub fn open(dir: impl AsRef<Path>, dtype: Option<DType>) -> Result<FolderWeights, Error> {
        let dir = dir.as_ref().to_path_buf();
        if let Some(d) = dtype {
            crate::ops::check_compute_dtype("requested dtype", d)?;
        }
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let files = if single.is_file() {
            vec![single]
        } else if index.is_file() {
            shard_files(&index)?
        } else {
            return Err(Error::MissingWeights { dir });
        };
        let mut entries = HashMap::new();
        for file in files {
            read_header(&file, &mut entries)?;
        }
        Ok(FolderWeights {
            dir,
            dtype,
            entries,
        })
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Dtype and shape of `name` as stored, if present.
    pub fn meta(&self, name: &str) -> Option<&TensorMeta> {
        self.entries.get(name).map(|e| &e.meta)
    }

    /// True when the folder has a tensor called `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }
}

impl WeightSource for FolderWeights {
    fn tensor(&self, name: &str) -> Result<Arc<Tensor>, Error> {
        let entry = self.entries.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
        })?;
        let stored = entry.meta.dtype;
        let want = match self.dtype {
            Some(d) if stored.is_float() => d,
            _ => stored,
        };
        if !is_compute_dtype(want) {
            return Err(Error::UnsupportedDType {
                what: format!("tensor {name}"),
                dtype: want,
            });
        }
        let bytes = if want == stored {
            HostBytes::Mapped(entry.view.clone())
        } else {
            HostBytes::Owned(bm_tensor::cast(entry.view.as_bytes(), stored, want)?)
        };
        let meta = TensorMeta::new(want, entry.meta.shape.clone());
        Ok(Arc::new(Tensor::from_host(meta, bytes, name)?))
    }
}

/// The distinct shard files an index's `weight_map` names, in first-use order.
fn shard_files(index: &Path) -> Result<Vec<PathBuf>, Error> {
    let json = read_json(index)?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::Json {
            path: index.to_path_buf(),
            message: "no \"weight_map\" object".into(),
        })?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: Vec<PathBuf> = Vec::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| Error::Json {
            path: index.to_path_buf(),
            message: format!("weight_map entry {name:?} is not a file name"),
        })?;
        let path = dir.join(file);
        if !files.contains(&path) {
            files.push(path);
        }
    }
    Ok(files)
}

/// Reads and parses a JSON file.
pub(crate) fn read_json(path: &Path) -> Result<serde_json::Value, Error> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| Error::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// Maps `file` and records where each of its tensors lies.
fn read_header(file: &Path, entries: &mut HashMap<String, Entry>) -> Result<(), Error> {
    let bad = |message: String| Error::Checkpoint {
        path: file.to_path_buf(),
        message,
    };
    let map = MmapView::open(file)?;
    let (header_len, metadata) = safetensors::SafeTensors::read_metadata(map.as_bytes())
        .map_err(|e| bad(format!("invalid safetensors header: {e}")))?;
    let data_start = 8 + header_len;
    for (name, info) in metadata.tensors() {
        let dtype: DType = format!("{:?}", info.dtype)
            .parse()
            .map_err(|_| bad(format!("tensor {name}: unknown dtype {:?}", info.dtype)))?;
        let (start, end) = info.data_offsets;
        let view = map.slice(data_start + start..data_start + end)?;
        let meta = TensorMeta::new(dtype, info.shape.clone());
        if meta.checked_byte_len() != Some(view.len()) {
            return Err(bad(format!(
                "tensor {name}: {} bytes for {dtype} {:?}",
                view.len(),
                meta.shape
            )));
        }
        entries.insert(name, Entry { meta, view });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name)
    }

    #[test]
    fn single_file_tensors_are_zero_copy_views() {
        let w = FolderWeights::open(fixture("tiny-llama"), None).unwrap();
        let t = w.tensor("model.layers.0.self_attn.k_proj.weight").unwrap();
        assert_eq!(t.shape(), [32, 64]);
        assert_eq!(t.dtype(), DType::F32);
        let err = w.tensor("model.layers.9.mlp.up_proj.weight").unwrap_err();
        assert_eq!(
            err.to_string(),
            "tensor model.layers.9.mlp.up_proj.weight not found in the weights"
        );
    }

    #[test]
    fn sharded_folder_is_read_through_its_index_and_cast_on_request() {
        let w = FolderWeights::open(fixture("tiny-qwen2"), Some(DType::BF16)).unwrap();
        assert!(w.contains("model.layers.2.self_attn.q_proj.bias"));
        let t = w.tensor("model.norm.weight").unwrap();
        assert_eq!((t.dtype(), t.shape()), (DType::BF16, &[32][..]));
        let f32 = FolderWeights::open(fixture("tiny-qwen2"), None).unwrap();
        let exact = f32.tensor("model.norm.weight").unwrap().to_f32_vec();
        let rounded = t.to_f32_vec();
        assert!(
            exact
                .iter()
                .zip(&rounded)
                .all(|(a, b)| (a - b).abs() <= a.abs() / 128.0)
        );
    }

    #[test]
    fn folder_without_weights_or_with_a_broken_file_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = FolderWeights::open(dir.path(), None).unwrap_err();
        assert!(err.to_string().contains("no weights"), "{err}");
        std::fs::write(dir.path().join("model.safetensors"), b"garbage!").unwrap();
        let err = FolderWeights::open(dir.path(), None).unwrap_err();
        assert!(
            err.to_string()
                .contains("model.safetensors: invalid safetensors header"),
            "{err}"
        );
    }
}
