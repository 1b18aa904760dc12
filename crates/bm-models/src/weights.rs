//! Where blocks get their weights: the [`WeightSource`] trait, and
//! [`FolderWeights`], a source reading a Hugging Face folder's weights
//! (safetensors, or PyTorch `.bin` files) through `bm_shard::Checkpoint`.

use std::path::Path;
use std::sync::Arc;

use bm_shard::{Checkpoint, TensorBytes};
use bm_tensor::{DType, TensorMeta};

use crate::{Error, Tensor};
use bm_compute::{HostBytes, is_compute_dtype};

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

/// The weights of a Hugging Face model folder (`model.safetensors`,
/// `model.safetensors.index.json` and its shards, or their PyTorch
/// counterparts `pytorch_model.bin` and `pytorch_model.bin.index.json`;
/// safetensors win when both are there), read through
/// `bm_shard::Checkpoint`'s mmaps. Tensors already in the wanted dtype are
/// zero-copy windows of the mapping (a strided view in a PyTorch file is
/// gathered); others are cast (PyTorch's rounding) on each fetch.
#[derive(Debug)]
pub struct FolderWeights {
    checkpoint: Checkpoint,
    dtype: Option<DType>,
}

impl FolderWeights {
    /// Maps the weights of `dir`. With `dtype`, float tensors are returned
    /// in that dtype (as `from_pretrained(torch_dtype=...)` would load them).
    pub fn open(dir: impl AsRef<Path>, dtype: Option<DType>) -> Result<FolderWeights, Error> {
        let dir = dir.as_ref();
        if let Some(d) = dtype {
            crate::ops::check_compute_dtype("requested dtype", d)?;
        }
        if !dir.join("model.safetensors").is_file()
            && !dir.join("pytorch_model.bin").is_file()
            && !has_index(dir)
        {
            return Err(Error::MissingWeights {
                dir: dir.to_path_buf(),
            });
        }
        Ok(FolderWeights {
            checkpoint: Checkpoint::open(dir)?,
            dtype,
        })
    }

    /// The checkpoint read.
    pub fn checkpoint(&self) -> &Checkpoint {
        &self.checkpoint
    }

    /// Dtype and shape of `name` as stored, if present.
    pub fn meta(&self, name: &str) -> Option<&TensorMeta> {
        self.checkpoint.meta(name)
    }

    /// True when the folder has a tensor called `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.checkpoint.meta(name).is_some()
    }
}

/// True when `dir` holds a `*.index.json` (which bm-shard will read).
fn has_index(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .filter_map(Result::ok)
            .any(|e| e.file_name().to_string_lossy().ends_with(".index.json"))
    })
}

impl WeightSource for FolderWeights {
    fn tensor(&self, name: &str) -> Result<Arc<Tensor>, Error> {
        let meta = self
            .checkpoint
            .meta(name)
            .ok_or_else(|| Error::MissingTensor {
                name: name.to_string(),
            })?;
        let want = match self.dtype {
            Some(d) => bm_shard::cast_target(meta.dtype, d),
            None => meta.dtype,
        };
        if !is_compute_dtype(want) {
            return Err(Error::UnsupportedDType {
                what: format!("tensor {name}"),
                dtype: want,
            });
        }
        let bytes = if want == meta.dtype {
            match self.checkpoint.bytes(name)? {
                TensorBytes::Mapped(view) => HostBytes::Mapped(view),
                TensorBytes::Gathered(buf) => HostBytes::Owned(buf),
            }
        } else {
            HostBytes::Owned(self.checkpoint.read_as(name, want)?)
        };
        let meta = TensorMeta::new(want, meta.shape.clone());
        Ok(Arc::new(Tensor::from_host(meta, bytes, name)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

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
                .contains("model.safetensors: invalid safetensors file"),
            "{err}"
        );
    }
}
