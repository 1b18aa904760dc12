//! Quantized weights in a dispatched model. The module tree declares each
//! quantized linear weight in its packed form (bm-plan's `quantize_tree`:
//! one `U8` tensor of codes and quant state), so the planner sizes it and
//! the dispatcher places, offloads and streams it at its packed bytes; a
//! [`LoadTransform`] produces those bytes while loading, one weight at a
//! time (quantizing a dense checkpoint's weight, or repacking a
//! pre-quantized folder's parts); [`PackedWeights::read`] turns the bytes a
//! forward pass receives back into a [`QuantizedTensor`] without a copy.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use bigmodel::plan::quant::{QuantScheme, quantize_tree};
use bigmodel::plan::{Device, DeviceMap, ModuleTree};
use bigmodel::tensor::{DType, HostBuffer, TensorMeta};
use bm_compute::quant::{QuantFormat, QuantizedOnGpu, QuantizedTensor, quantize};
use bm_compute::{HostBytes, SharedDeviceBuffer};
use bm_shard::Checkpoint;

use crate::quant_config::{self, ModuleFilter, QuantizeOptions};
use crate::weights::{FolderWeights, host_bytes, transpose};
use crate::{Error, Tensor};

/// What a dispatched model's quantized weight is.
#[derive(Clone, Debug)]
struct Packed {
    format: QuantFormat,
    /// `[out_features, in_features]`.
    shape: [usize; 2],
    /// The dtype it was quantized from.
    dtype: DType,
    /// Stored `[in, out]` (`Conv1D`): transposed before quantizing.
    transposed: bool,
}

/// Where the packed bytes come from.
#[derive(Debug)]
enum Origin {
    /// A dense checkpoint, quantized while loading.
    OnLoad,
    /// A folder transformers saved from a bitsandbytes model: its
    /// weights, read and checked when the folder was opened.
    Saved(HashMap<String, Arc<QuantizedTensor>>),
}

/// The quantized weights of a dispatched model: the load transform that
/// produces them and what reading them back needs.
#[derive(Debug)]
pub(crate) struct PackedWeights {
    weights: HashMap<String, Packed>,
    origin: Origin,
    compute_dtype: Option<DType>,
}

/// bm-plan's size description of a format.
pub(crate) fn scheme(format: QuantFormat) -> QuantScheme {
    match format {
        QuantFormat::FourBit {
            blocksize,
            double_quant,
            ..
        } => QuantScheme::FourBit {
            blocksize: blocksize as u64,
            double_quant,
        },
        QuantFormat::Int8 { .. } => QuantScheme::Int8,
    }
}

/// Which modules `llm_int8_enable_fp32_cpu_offload` keeps unquantized:
/// those whose weight `map` puts on the CPU or disk (its longest matching
/// key, as [`DeviceMap::device_of`], with the keys read once).
fn offloaded_by(map: &DeviceMap) -> impl Fn(&str) -> bool + '_ {
    let keys: HashMap<&str, Device> = map.iter().collect();
    move |module: &str| {
        let weight = format!("{module}.weight");
        let mut prefix = weight.as_str();
        let device = loop {
            if let Some(d) = keys.get(prefix) {
                break Some(*d);
            }
            match prefix.rfind('.') {
                Some(i) => prefix = &prefix[..i],
                None => break keys.get("").copied(),
            }
        };
        device.is_some_and(|d| !d.is_gpu())
    }
}

/// `tree` with the linear weights `options` quantize in packed form (the
/// modules `skip_modules`, by default the output head and what is tied
/// to it, and `keep_in_fp32_modules` stay dense, and with
/// `llm_int8_enable_fp32_cpu_offload` those `map` offloads), and what the
/// dispatched model needs to produce and read them. `dtype` is what the
/// weights are quantized from; `map` is the device map given, `None` for
/// a strategy.
pub(crate) fn quantize_on_load(
    dir: Option<&Path>,
    tree: &ModuleTree,
    options: &QuantizeOptions,
    dtype: DType,
    map: Option<&DeviceMap>,
) -> Result<(ModuleTree, PackedWeights), Error> {
    if let Some(d) = options.compute_dtype {
        crate::ops::check_compute_dtype("4-bit compute dtype", d)?;
    }
    let skip = options
        .skip_modules
        .clone()
        .unwrap_or_else(|| quant_config::default_skip_modules(dir));
    let skip = ModuleFilter::new("skip_modules", &skip)?;
    let fp32 = ModuleFilter::new("keep_in_fp32_modules", &options.keep_in_fp32_modules)?;
    let offloaded: Box<dyn Fn(&str) -> bool + '_> =
        match (options.llm_int8_enable_fp32_cpu_offload, map) {
            (false, _) => Box::new(|_: &str| false),
            (true, Some(map)) => Box::new(offloaded_by(map)),
            (true, None) => {
                return Err(Error::BadOperands {
                    op: "quantize",
                    message: "llm_int8_enable_fp32_cpu_offload needs a device map (as in \
                          transformers): with a strategy, what the planner offloads depends on \
                          what is quantized"
                        .into(),
                });
            }
        };
    let format = options.format;
    let kept_offloaded = std::cell::Cell::new(false);
    let quantized = quantize_tree(tree, |module| {
        if skip.matches(module) || fp32.matches(module) {
            return None;
        }
        if offloaded(module) {
            kept_offloaded.set(true);
            return None;
        }
        Some(scheme(format))
    });
    let (tree, replaced) = match quantized {
        // Nothing left to quantize (the error about the whole model, not
        // one weight) because the map offloads it: the dense model, as
        // transformers loads it then.
        Err(bigmodel::plan::Error::NotQuantizable { what, .. })
            if what == "(model)" && kept_offloaded.get() =>
        {
            (tree.clone(), Vec::new())
        }
        other => other?,
    };
    let weights = replaced
        .into_iter()
        .map(|w| {
            let packed = Packed {
                format,
                shape: w.shape,
                dtype,
                transposed: w.transposed,
            };
            (w.name, packed)
        })
        .collect();
    Ok((
        tree,
        PackedWeights {
            weights,
            origin: Origin::OnLoad,
            compute_dtype: options.compute_dtype,
        },
    ))
}

/// `tree` with the weights a pre-quantized folder stores quantized in
/// packed form, each in its own format and at the size its checkpoint
/// holds; `None` for a dense folder.
pub(crate) fn saved_quantized(
    folder: &FolderWeights,
    tree: &ModuleTree,
) -> Result<Option<(ModuleTree, PackedWeights)>, Error> {
    let Some(saved) = folder.prequantized() else {
        return Ok(None);
    };
    let (tree, replaced) = quantize_tree(tree, |module| {
        saved
            .get(&format!("{module}.weight"))
            .map(|q| scheme(q.format()))
    })?;
    let mut weights = HashMap::new();
    let mut compute_dtype = None;
    for w in replaced {
        let q = &saved[&w.name];
        if q.shape() != w.shape {
            return Err(Error::ShapeMismatch {
                name: w.name,
                expected: w.shape.to_vec(),
                found: q.shape().to_vec(),
            });
        }
        compute_dtype = q.compute_dtype();
        let packed = Packed {
            format: q.format(),
            shape: w.shape,
            dtype: q.dtype(),
            transposed: w.transposed,
        };
        weights.insert(w.name, packed);
    }
    // A quantized weight the tree has no Linear module for would be lost.
    if let Some(name) = saved.keys().find(|n| !weights.contains_key(*n)) {
        return Err(Error::BadOperands {
            op: "load",
            message: format!(
                "{name} is stored quantized, but the model has no Linear or Conv1D module for it"
            ),
        });
    }
    Ok(Some((
        tree,
        PackedWeights {
            weights,
            origin: Origin::Saved(saved.clone()),
            compute_dtype,
        },
    )))
}

/// The one decision of what loading holds packed: the weights a
/// pre-quantized `folder` stores quantized, or those `quantize` quantizes
/// while loading (both at once is refused), each declared in `tree` at its
/// packed size; `None` when nothing is. `folder` is the opened folder
/// (`None` when it is not pre-quantized and need not be opened); `dtype`
/// what weights are quantized from; `map` the device map given.
pub(crate) fn packed_for_load(
    dir: &Path,
    folder: Option<&FolderWeights>,
    tree: &ModuleTree,
    quantize: Option<&QuantizeOptions>,
    dtype: DType,
    map: Option<&DeviceMap>,
) -> Result<Option<(ModuleTree, PackedWeights)>, Error> {
    let prequantized = folder.filter(|f| f.prequantized().is_some());
    match (quantize, prequantized) {
        (Some(_), Some(_)) => Err(Error::Config {
            path: dir.join("config.json"),
            key: "quantization_config".into(),
            message: "the folder is already quantized with bitsandbytes; load it without \
                      quantize options"
                .into(),
        }),
        (Some(q), None) => quantize_on_load(Some(dir), tree, q, dtype, map).map(Some),
        (None, Some(f)) => saved_quantized(f, tree),
        (None, None) => Ok(None),
    }
}

/// The module tree loading `dir` plans and dispatches, from `tree` (read
/// from its config.json): a pre-quantized folder's linear weights at the
/// packed sizes its checkpoint stores, or with `quantize` those it
/// quantizes while loading (with `llm_int8_enable_fp32_cpu_offload`, not
/// those `map` offloads); `tree` itself otherwise. What `bigmodel plan`
/// plans, so that a plan and its ledger are what loading holds. `dir`
/// `None` (a lone config.json) spares the default skip modules' head only
/// and cannot be pre-quantized.
pub fn load_tree(
    dir: Option<&Path>,
    tree: &ModuleTree,
    quantize: Option<&QuantizeOptions>,
    map: Option<&DeviceMap>,
) -> Result<ModuleTree, Error> {
    let Some(dir) = dir else {
        return match quantize {
            Some(q) => Ok(quantize_on_load(None, tree, q, DType::F32, map)?.0),
            None => Ok(tree.clone()),
        };
    };
    let config = dir.join("config.json");
    let prequantized = bm_shard::exists(&config)?
        && quant_config::read_bnb_checkpoint(&crate::config::read_keys(&config)?)?.is_some();
    let folder = match prequantized {
        true => Some(FolderWeights::open(dir, None).map_err(|e| match e {
            Error::MissingWeights { .. } => Error::Config {
                path: config.clone(),
                key: "quantization_config".into(),
                message: format!(
                    "the model is pre-quantized, and its packed sizes are read from its \
                     checkpoint: {e}"
                ),
            },
            e => e,
        })?),
        false => None,
    };
    Ok(
        match packed_for_load(dir, folder.as_ref(), tree, quantize, DType::F32, map)? {
            Some((tree, _)) => tree,
            None => tree.clone(),
        },
    )
}

impl PackedWeights {
    /// True when `name` is held packed.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.weights.contains_key(name)
    }

    /// The quantized weight `name` over its packed bytes, as a forward
    /// pass received them.
    pub(crate) fn read(&self, name: &str, bytes: HostBytes) -> Result<QuantizedTensor, Error> {
        let p = self.weights.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
        })?;
        let mut q = QuantizedTensor::from_packed(name, p.format, p.shape, p.dtype, bytes)?;
        q.set_compute_dtype(self.compute_dtype)?;
        Ok(q)
    }

    /// The quantized weight `name` over its packed bytes on a CUDA GPU.
    pub(crate) fn read_on_gpu(
        &self,
        name: &str,
        bytes: SharedDeviceBuffer,
    ) -> Result<QuantizedOnGpu, Error> {
        let p = self.weights.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
        })?;
        let mut q = QuantizedOnGpu::from_packed(name, p.format, p.shape, bytes)?;
        q.set_compute_dtype(self.compute_dtype)?;
        Ok(q)
    }

    /// The packed bytes of `name`, from the checkpoint.
    fn produce_packed(
        &self,
        name: &str,
        checkpoint: &Checkpoint,
        dtype: DType,
    ) -> Result<HostBuffer, Error> {
        match &self.origin {
            Origin::Saved(saved) => Ok(saved[name].to_packed()?),
            Origin::OnLoad => Ok(self.quantize(name, checkpoint, dtype)?.to_packed()?),
        }
    }

    /// Dense weight `name` of `checkpoint`, its values in `dtype`,
    /// quantized.
    fn quantize(
        &self,
        name: &str,
        checkpoint: &Checkpoint,
        dtype: DType,
    ) -> Result<QuantizedTensor, Error> {
        let p = self.weights.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
        })?;
        let meta = checkpoint.meta(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
        })?;
        let stored = if p.transposed {
            [p.shape[1], p.shape[0]]
        } else {
            p.shape
        };
        if meta.shape != stored {
            return Err(Error::ShapeMismatch {
                name: name.to_string(),
                expected: stored.to_vec(),
                found: meta.shape.clone(),
            });
        }
        let bytes = if meta.dtype == dtype {
            host_bytes(checkpoint.bytes(name)?)
        } else {
            HostBytes::Owned(checkpoint.read_as(name, dtype)?)
        };
        let dense = Tensor::from_host(TensorMeta::new(dtype, meta.shape.clone()), bytes, name)?;
        let dense = if p.transposed {
            transpose(&dense)?
        } else {
            dense
        };
        Ok(quantize(&dense, p.format, name)?)
    }
}

/// A dense folder's linear weights quantized for saving, as the entries
/// transformers writes for a bitsandbytes model (`save_pretrained`), and
/// the `quantization_config` its config.json gets: what `bigmodel shard
/// --quantize` writes, and what `from_pretrained` loads back.
#[derive(Debug)]
pub struct SaveQuantized {
    packed: PackedWeights,
    options: QuantizeOptions,
}

/// One safetensors entry to write: name, dtype and shape, bytes.
pub type OwnedEntry = (String, TensorMeta, Vec<u8>);

impl SaveQuantized {
    /// Decides, from `dir`'s config.json, which weights `options` quantize
    /// (those `open_causal_lm_quantized` would). A folder that is already
    /// quantized is refused.
    pub fn new(dir: &Path, options: &QuantizeOptions) -> Result<SaveQuantized, Error> {
        let folder = FolderWeights::open(dir, None)?;
        if folder.prequantized().is_some() {
            return Err(Error::Config {
                path: dir.join("config.json"),
                key: "quantization_config".into(),
                message: "the folder is already quantized with bitsandbytes".into(),
            });
        }
        let hf = crate::config::read_config(dir, crate::SUPPORTED_DECODERS)?;
        let tree = bigmodel::plan::hf::tree_from_config(&hf)?.tree;
        let (_, packed) = quantize_on_load(Some(dir), &tree, options, DType::F32, None)?;
        Ok(SaveQuantized {
            packed,
            options: options.clone(),
        })
    }

    /// True when checkpoint tensor `name` is written quantized.
    pub fn quantizes(&self, name: &str) -> bool {
        self.packed.contains(name)
    }

    /// The entries of weight `name` of `checkpoint`, quantized from its
    /// values in `dtype`.
    pub fn entries(
        &self,
        name: &str,
        checkpoint: &Checkpoint,
        dtype: DType,
    ) -> Result<Vec<OwnedEntry>, Error> {
        let q = self.packed.quantize(name, checkpoint, dtype)?;
        Ok(q.to_entries(name)
            .into_iter()
            .map(|e| (e.name, e.meta, e.bytes.into_owned()))
            .collect())
    }

    /// `quantization_config` as transformers writes it for these options
    /// (`BitsAndBytesConfig.to_dict()`).
    pub fn quantization_config(&self) -> serde_json::Value {
        let o = &self.options;
        let (four, kind, double_quant, threshold) = match o.format {
            QuantFormat::FourBit {
                kind, double_quant, ..
            } => (true, kind.name(), double_quant, 6.0),
            QuantFormat::Int8 { threshold } => (false, "fp4", false, f64::from(threshold)),
        };
        let compute = match o.compute_dtype {
            Some(DType::F16) => "float16",
            Some(DType::BF16) => "bfloat16",
            _ => "float32",
        };
        serde_json::json!({
            "_load_in_4bit": four,
            "_load_in_8bit": !four,
            "bnb_4bit_compute_dtype": compute,
            "bnb_4bit_quant_storage": "uint8",
            "bnb_4bit_quant_type": kind,
            "bnb_4bit_use_double_quant": double_quant,
            "llm_int8_enable_fp32_cpu_offload": false,
            "llm_int8_has_fp16_weight": false,
            "llm_int8_skip_modules": o.skip_modules,
            "llm_int8_threshold": threshold,
            "load_in_4bit": four,
            "load_in_8bit": !four,
            "quant_method": "bitsandbytes",
        })
    }
}

impl bigmodel::dispatch::LoadTransform for PackedWeights {
    fn claims(&self, name: &str) -> bool {
        self.contains(name)
    }

    fn reads(&self, name: &str) -> bool {
        matches!(self.origin, Origin::Saved(_))
            && QuantizedTensor::state_owner(name).is_some_and(|(w, _)| self.contains(&w))
    }

    fn produce(
        &self,
        name: &str,
        declared: &TensorMeta,
        checkpoint: &Checkpoint,
        dtype: DType,
    ) -> Result<HostBuffer, Box<dyn std::error::Error + Send + Sync>> {
        let _ = declared;
        Ok(self.produce_packed(name, checkpoint, dtype)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bm_compute::quant::FourBitType;

    // bm-plan sizes packed weights without bm-compute: its length must be
    // the length bm-compute writes.
    #[test]
    fn planner_sizes_equal_packed_lengths() {
        let formats = [
            QuantFormat::FourBit {
                kind: FourBitType::Nf4,
                blocksize: 64,
                double_quant: false,
            },
            QuantFormat::FourBit {
                kind: FourBitType::Fp4,
                blocksize: 128,
                double_quant: true,
            },
            QuantFormat::Int8 { threshold: 6.0 },
        ];
        for format in formats {
            for [rows, cols] in [[1, 1], [3, 5], [48, 71], [64, 4097], [300, 257]] {
                let values: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin()).collect();
                let dense = Tensor::from_f32(DType::BF16, &[rows, cols], &values).unwrap();
                let q = quantize(&dense, format, "w").unwrap();
                let packed = q.to_packed().unwrap();
                assert_eq!(
                    packed.len() as u64,
                    scheme(format).packed_bytes(rows as u64, cols as u64),
                    "{format:?} {rows}x{cols}"
                );
                assert_eq!(packed.len(), format.byte_len(rows, cols));
                let back = QuantizedTensor::from_packed(
                    "w",
                    format,
                    [rows, cols],
                    DType::BF16,
                    HostBytes::Owned(packed),
                )
                .unwrap();
                assert_eq!(
                    back.dequantize(DType::F32).unwrap().to_f32_vec(),
                    q.dequantize(DType::F32).unwrap().to_f32_vec()
                );
            }
        }
        let err = QuantizedTensor::from_packed(
            "w",
            formats[0],
            [2, 64],
            DType::F32,
            HostBytes::Owned(HostBuffer::zeroed(10).unwrap()),
        )
        .unwrap_err();
        assert!(err.to_string().contains("10 bytes for a [2, 64]"), "{err}");
    }
}
