//! Where blocks get their weights: the [`WeightSource`] trait, and
//! [`FolderWeights`], a source reading a Hugging Face folder's weights
//! (safetensors, or PyTorch `.bin` files) through `bm_shard::Checkpoint`,
//! pre-quantized by bitsandbytes or quantized while loading.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use bm_compute::quant::{QuantizedOnGpu, QuantizedTensor};
use bm_shard::{Checkpoint, TensorBytes};
use bm_tensor::{DType, TensorMeta};

use bigmodel::plan::config::Family;
use bigmodel::plan::hf::DecoderNames;

use crate::quant_config::{self, QuantizeOptions};
use crate::quantized::{FolderQuant, OnLoad, read_prequantized};
use crate::{Error, Tensor, config};
use bm_compute::{HostBytes, is_compute_dtype};

/// [`FolderWeights::load_dtype`] of the folder `dir`: the dtype opening it
/// loads every float weight in, for a plan to size them in. `None` when
/// `dir` holds no weights (a config.json alone loads nothing; its own
/// dtype stands).
pub fn folder_load_dtype(
    dir: &Path,
    family: Family,
    requested: Option<DType>,
) -> Result<Option<DType>, Error> {
    if requested.is_some() {
        return Ok(requested);
    }
    match FolderWeights::open(dir, None) {
        Ok(weights) => Ok(Some(weights.load_dtype(family, None))),
        Err(Error::MissingWeights { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The modules `family` keeps in F32 when it loads in `dtype`
/// (transformers' `_keep_in_fp32_modules`): T5's `wo` under F16
/// ([`crate::T5::kept_f32`]), none in the other families. Opening a folder
/// loads them so, and a plan of it sizes them so (with
/// [`bigmodel::kept_in_f32`]).
pub fn family_kept_f32(family: Family, dtype: DType) -> Vec<String> {
    match family {
        Family::T5 => crate::T5::kept_f32(dtype),
        _ => Vec::new(),
    }
}

/// How a checkpoint stores a linear layer's weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightLayout {
    /// `nn.Linear`: `[out_features, in_features]`.
    Linear,
    /// transformers' `Conv1D` (GPT-2): `[in_features, out_features]`.
    /// bitsandbytes quantizes it transposed, so quantized it is `[out, in]`.
    Conv1D,
}

/// A linear layer's weight: dense, or quantized in a bitsandbytes format.
#[derive(Clone, Debug)]
pub enum LinearWeight {
    /// F32, F16 or BF16 values, `[out_features, in_features]`.
    Dense(Arc<Tensor>),
    /// F32, F16 or BF16 values, `[in_features, out_features]` (`Conv1D`).
    DenseTransposed(Arc<Tensor>),
    /// Packed codes and scales, `[out_features, in_features]`, dequantized
    /// on the fly by the matmul.
    Quantized(Arc<QuantizedTensor>),
    /// The same, its packed form on a CUDA GPU, read there in place.
    QuantizedOnGpu(Arc<QuantizedOnGpu>),
}

impl LinearWeight {
    /// The shape as held (see each variant).
    pub fn shape(&self) -> &[usize] {
        match self {
            LinearWeight::Dense(t) | LinearWeight::DenseTransposed(t) => t.shape(),
            LinearWeight::Quantized(q) => q.shape(),
            LinearWeight::QuantizedOnGpu(q) => q.shape(),
        }
    }

    /// `x · weightᵀ + bias` (`ops::linear`, `ops::linear_t`,
    /// `ops::linear_quantized` or `ops::linear_quantized_on_gpu`).
    pub fn forward(&self, x: &Tensor, bias: Option<&Tensor>) -> Result<Tensor, Error> {
        Ok(match self {
            LinearWeight::Dense(w) => crate::ops::linear(x, w, bias)?,
            LinearWeight::DenseTransposed(w) => crate::ops::linear_t(x, w, bias)?,
            LinearWeight::Quantized(w) => crate::ops::linear_quantized(x, w, bias)?,
            LinearWeight::QuantizedOnGpu(w) => crate::ops::linear_quantized_on_gpu(x, w, bias)?,
        })
    }

    /// A dense weight stored in `layout`.
    pub(crate) fn dense(t: Arc<Tensor>, layout: WeightLayout) -> LinearWeight {
        match layout {
            WeightLayout::Linear => LinearWeight::Dense(t),
            WeightLayout::Conv1D => LinearWeight::DenseTransposed(t),
        }
    }
}

/// Supplies tensors by their full transformers name
/// (`model.layers.3.self_attn.q_proj.weight`).
///
/// Models call [`WeightSource::begin_block`] before a block runs, fetch its
/// tensors with [`WeightSource::tensor`] (linear layers' weights with
/// [`WeightSource::linear_weight`]), drop them after the block, and call
/// [`WeightSource::end_block`]: the places where an offloading source loads
/// a block's weights onto the execution device and releases them, like
/// Accelerate's pre- and post-forward hooks. Block names are transformers
/// module names (`model.embed_tokens`, `model.layers.0`, `lm_head`,
/// `encoder.layer.2`).
pub trait WeightSource: Sync {
    /// The tensor called `name`, on the backend the block runs on.
    fn tensor(&self, name: &str) -> Result<Arc<Tensor>, Error>;

    /// The weight of a linear layer (`name` ends in `.weight`), stored in
    /// `layout`, which a source may hand out quantized. By default,
    /// [`WeightSource::tensor`].
    fn linear_weight(&self, name: &str, layout: WeightLayout) -> Result<LinearWeight, Error> {
        self.tensor(name).map(|t| LinearWeight::dense(t, layout))
    }

    /// Called before block `block` fetches its tensors.
    fn begin_block(&self, block: &str) -> Result<(), Error> {
        let _ = block;
        Ok(())
    }

    /// Called after block `block` ran and dropped its tensors.
    fn end_block(&self, block: &str) {
        let _ = block;
    }

    /// The GPU the innermost open block executes on, if a GPU: what a
    /// layer's KV cache is charged to. `None` by default (the CPU).
    fn execution_gpu(&self) -> Option<bigmodel::device::Gpu> {
        None
    }
}

/// The weights of a Hugging Face model folder (`model.safetensors`,
/// `model.safetensors.index.json` and its shards, or their PyTorch
/// counterparts `pytorch_model.bin` and `pytorch_model.bin.index.json`;
/// safetensors win when both are there), read through
/// `bm_shard::Checkpoint`'s mmaps. Tensors already in the wanted dtype are
/// zero-copy windows of the mapping (a strided view in a PyTorch file is
/// gathered); others are cast (PyTorch's rounding) on each fetch.
///
/// A folder transformers saved from a bitsandbytes model (a
/// `quantization_config` in config.json) hands its linear weights out
/// quantized, read in place. [`FolderWeights::open_quantized`] quantizes a
/// dense folder's linear weights instead, each the first time it is
/// fetched (one dense tensor at a time is read; the quantized ones are
/// kept).
#[derive(Debug)]
pub struct FolderWeights {
    checkpoint: Checkpoint,
    dtype: Option<DType>,
    quant: Option<FolderQuant>,
    /// Modules whose float weights are read in F32 whatever `dtype`.
    kept_f32: Vec<String>,
}

impl FolderWeights {
    /// Maps the weights of `dir`. With `dtype`, float tensors are returned
    /// in that dtype (as `from_pretrained(torch_dtype=...)` would load them).
    /// A pre-quantized bitsandbytes folder's quant state is checked here.
    pub fn open(dir: impl AsRef<Path>, dtype: Option<DType>) -> Result<FolderWeights, Error> {
        let dir = dir.as_ref();
        if let Some(d) = dtype {
            crate::ops::check_compute_dtype("requested dtype", d)?;
        }
        if !bm_shard::exists(&dir.join("model.safetensors"))?
            && !bm_shard::exists(&dir.join("pytorch_model.bin"))?
        {
            let (found, unlisted) = find_index(dir)?;
            if !found {
                // A `shard` into this folder between its old index and its new.
                if let Some(holder) = bm_shard::writer_of(dir) {
                    return Err(Error::Shard(bm_shard::Error::Locked {
                        folder: dir.to_path_buf(),
                        holder,
                        waited: None,
                    }));
                }
                return Err(Error::MissingWeights {
                    dir: dir.to_path_buf(),
                    unlisted,
                });
            }
        }
        let checkpoint = Checkpoint::open(dir)?;
        let path = dir.join("config.json");
        let config = match bm_shard::exists(&path)? {
            true => Some(config::read_keys(&path)?),
            false => None,
        };
        let bnb = match &config {
            Some(c) => quant_config::read_bnb_checkpoint(c)?,
            None => None,
        };
        let quant = match bnb {
            Some(bnb) => Some(FolderQuant::Prequantized(read_prequantized(
                &checkpoint,
                &bnb,
                &path,
            )?)),
            None => None,
        };
        Ok(FolderWeights {
            checkpoint,
            dtype,
            quant,
            kept_f32: Vec::new(),
        })
    }

    /// These weights with the float tensors of `modules` (matched as a
    /// `keep_in_fp32_modules` list) read in F32 whatever the dtype asked
    /// for: the modules a model computes in F32.
    pub fn keeping_f32(mut self, modules: Vec<String>) -> FolderWeights {
        self.kept_f32 = modules;
        self
    }

    /// Maps the weights of `dir` and quantizes its linear layers as
    /// `options` say (Accelerate's `load_and_quantize_model`), each the
    /// first time it is fetched. Modules `options.skip_modules` names
    /// (by default the output head) stay dense. A folder that is already
    /// quantized is refused.
    pub fn open_quantized(
        dir: impl AsRef<Path>,
        dtype: Option<DType>,
        options: QuantizeOptions,
    ) -> Result<FolderWeights, Error> {
        let dir = dir.as_ref();
        let mut weights = FolderWeights::open(dir, dtype)?;
        if weights.quant.is_some() {
            return Err(Error::Config {
                path: dir.join("config.json"),
                key: "quantization_config".into(),
                message: "the folder is already quantized with bitsandbytes; open it without \
                          quantize options"
                    .into(),
            });
        }
        if let Some(d) = options.compute_dtype {
            crate::ops::check_compute_dtype("4-bit compute dtype", d)?;
        }
        let skip = options
            .skip_modules
            .clone()
            .unwrap_or_else(|| quant_config::default_skip_modules(Some(dir)));
        weights.quant = Some(FolderQuant::OnLoad(OnLoad::new(options, &skip)?));
        Ok(weights)
    }

    /// The weights of a pre-quantized folder, by name; `None` for a dense
    /// folder (also one quantized on load).
    pub(crate) fn prequantized(&self) -> Option<&HashMap<String, Arc<QuantizedTensor>>> {
        match &self.quant {
            Some(FolderQuant::Prequantized(q)) => Some(q),
            _ => None,
        }
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

    /// The prefix of a BERT checkpoint's names: `bert.` when it was saved
    /// from a task model (`BertForMaskedLM`), else none.
    pub(crate) fn bert_prefix(&self) -> &'static str {
        match self.contains("bert.embeddings.word_embeddings.weight") {
            true => "bert.",
            false => "",
        }
    }

    /// The dtype a `family` model over these weights loads and computes
    /// in: `requested`, else the stored dtype of the token embedding
    /// (transformers' `dtype="auto"` read from the checkpoint), F32 when
    /// that is not a float. Every float weight is loaded in it, so this is
    /// also the dtype a plan of the folder sizes them in
    /// ([`folder_load_dtype`]): the one decision for both.
    pub fn load_dtype(&self, family: Family, requested: Option<DType>) -> DType {
        let embedding = match family {
            Family::T5 => crate::seq2seq::SHARED.to_string(),
            Family::Bert => format!("{}embeddings.word_embeddings.weight", self.bert_prefix()),
            decoder => format!("{}.weight", DecoderNames::of(decoder).embed),
        };
        requested.unwrap_or_else(|| {
            self.meta(&embedding)
                .map(|m| m.dtype)
                .filter(|d| is_compute_dtype(*d))
                .unwrap_or(DType::F32)
        })
    }

    /// The tensor `name` as stored, or cast to `dtype`.
    fn dense(&self, name: &str, dtype: Option<DType>) -> Result<Arc<Tensor>, Error> {
        let meta = self
            .checkpoint
            .meta(name)
            .ok_or_else(|| Error::MissingTensor {
                name: name.to_string(),
            })?;
        let want = match dtype {
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
            host_bytes(self.checkpoint.bytes(name)?)
        } else {
            HostBytes::Owned(self.checkpoint.read_as(name, want)?)
        };
        let meta = TensorMeta::new(want, meta.shape.clone());
        Ok(Arc::new(Tensor::from_host(meta, bytes, name)?))
    }
}

/// A checkpoint tensor's bytes as the ops hold them: the mapping, or a
/// gathered copy of a strided PyTorch view.
pub(crate) fn host_bytes(bytes: TensorBytes) -> HostBytes {
    match bytes {
        TensorBytes::Mapped(view) => HostBytes::Mapped(view),
        TensorBytes::Gathered(buf) => HostBytes::Owned(buf),
    }
}

/// A 2-D tensor transposed (same dtype; a copy).
pub(crate) fn transpose(t: &Tensor) -> Result<Tensor, Error> {
    let [rows, cols] = match *t.shape() {
        [r, c] => [r, c],
        ref other => {
            return Err(Error::BadOperands {
                op: "transpose",
                message: format!("shape {other:?} is not a matrix"),
            });
        }
    };
    let v = t.f32_values();
    let transposed: Vec<f32> = (0..cols * rows)
        .map(|i| v[(i % rows) * cols + i / rows])
        .collect();
    Ok(Tensor::from_f32(t.dtype(), &[cols, rows], &transposed)?)
}

/// Whether `dir` holds a `*.index.json` (which bm-shard will read), and
/// whether the folder may not be listed (permission denied), so that only
/// transformers' two index names could be looked up, as bm-shard does then.
fn find_index(dir: &Path) -> Result<(bool, bool), Error> {
    match std::fs::read_dir(dir) {
        Ok(entries) => Ok((
            entries
                .filter_map(Result::ok)
                .any(|e| e.file_name().to_string_lossy().ends_with(".index.json")),
            false,
        )),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            let mut found = false;
            for name in [
                "model.safetensors.index.json",
                "pytorch_model.bin.index.json",
            ] {
                found |= bm_shard::exists(&dir.join(name))?;
            }
            Ok((found, true))
        }
        Err(_) => Ok((false, false)),
    }
}

impl WeightSource for FolderWeights {
    fn tensor(&self, name: &str) -> Result<Arc<Tensor>, Error> {
        match &self.quant {
            Some(FolderQuant::Prequantized(q)) if q.contains_key(name) => {
                Err(Error::QuantizedNotLinear {
                    name: name.to_string(),
                })
            }
            Some(FolderQuant::OnLoad(o)) if o.fp32.matches(quant_config::module_of(name)) => {
                self.dense(name, Some(DType::F32))
            }
            _ if bigmodel::dispatch::in_modules(name, &self.kept_f32) => {
                self.dense(name, Some(DType::F32))
            }
            _ => self.dense(name, self.dtype),
        }
    }

    fn linear_weight(&self, name: &str, layout: WeightLayout) -> Result<LinearWeight, Error> {
        match &self.quant {
            Some(FolderQuant::Prequantized(q)) => match q.get(name) {
                Some(w) => Ok(LinearWeight::Quantized(w.clone())),
                None => self.tensor(name).map(|t| LinearWeight::dense(t, layout)),
            },
            Some(FolderQuant::OnLoad(o)) if o.quantizes(name) => o
                .get(name, || {
                    let t = self.dense(name, self.dtype)?;
                    match layout {
                        WeightLayout::Linear => Ok(t),
                        // bitsandbytes quantizes Conv1D weights as [out, in].
                        WeightLayout::Conv1D => Ok(Arc::new(transpose(&t)?)),
                    }
                })
                .map(LinearWeight::Quantized),
            _ => self.tensor(name).map(|t| LinearWeight::dense(t, layout)),
        }
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
