//! The quantized side of [`FolderWeights`](crate::FolderWeights): the
//! weights of a folder transformers saved from a bitsandbytes model, read
//! in place from the mapping, or weights quantized the first time a linear
//! layer fetches them.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use bm_compute::Tensor;
use bm_compute::quant::{Entry, FourBitType, QuantFormat, QuantizedTensor, quantize};
use bm_shard::Checkpoint;

use crate::Error;
use crate::quant_config::{BnbCheckpoint, ModuleFilter, QuantizeOptions, module_of};
use crate::weights::host_bytes;

/// How a folder's linear weights are quantized.
#[derive(Debug)]
pub(crate) enum FolderQuant {
    /// Saved quantized: every quantized weight, checked when the folder
    /// was opened (its parts are windows of the mapped checkpoint).
    Prequantized(HashMap<String, Arc<QuantizedTensor>>),
    /// Quantized on first fetch, then kept (the quantized model stays in
    /// host memory, as with bitsandbytes; the dense weights stay mapped).
    OnLoad(OnLoad),
}

/// Quantize-on-load settings and what was quantized so far.
#[derive(Debug)]
pub(crate) struct OnLoad {
    pub(crate) options: QuantizeOptions,
    pub(crate) skip: ModuleFilter,
    pub(crate) fp32: ModuleFilter,
    cache: Mutex<HashMap<String, Arc<QuantizedTensor>>>,
}

impl OnLoad {
    /// `skip_modules` must already be resolved to the model's defaults.
    pub(crate) fn new(options: QuantizeOptions, skip: &[String]) -> Result<OnLoad, Error> {
        Ok(OnLoad {
            skip: ModuleFilter::new("skip_modules", skip)?,
            fp32: ModuleFilter::new("keep_in_fp32_modules", &options.keep_in_fp32_modules)?,
            options,
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// True when the module of `weight` is quantized.
    pub(crate) fn quantizes(&self, weight: &str) -> bool {
        let module = module_of(weight);
        !self.skip.matches(module) && !self.fp32.matches(module)
    }

    /// `weight` quantized: from the cache, or `dense` quantized now.
    pub(crate) fn get(
        &self,
        weight: &str,
        dense: impl FnOnce() -> Result<Arc<Tensor>, Error>,
    ) -> Result<Arc<QuantizedTensor>, Error> {
        let cache = || self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(q) = cache().get(weight) {
            return Ok(q.clone());
        }
        // Quantized outside the lock: other weights need not wait.
        let mut q = quantize(dense()?.as_ref(), self.options.format, weight)?;
        q.set_compute_dtype(self.options.compute_dtype)?;
        Ok(cache()
            .entry(weight.to_string())
            .or_insert_with(|| Arc::new(q))
            .clone())
    }
}

/// Reads and checks every quantized weight of a pre-quantized folder.
/// `config_path` names config.json in errors.
pub(crate) fn read_prequantized(
    checkpoint: &Checkpoint,
    config: &BnbCheckpoint,
    config_path: &Path,
) -> Result<HashMap<String, Arc<QuantizedTensor>>, Error> {
    let state_error = |tensor: &str, field: &str, message: String| {
        Error::Compute(bm_compute::Error::QuantState {
            tensor: tensor.to_string(),
            field: field.to_string(),
            message,
        })
    };
    let mut weights = Vec::new();
    for (name, _) in checkpoint.tensors() {
        if let Some((weight, kind)) = name.split_once(".quant_state.bitsandbytes__") {
            if let Err(e) = FourBitType::from_name(kind) {
                return Err(state_error(weight, "quant_state", e.to_string()));
            }
            weights.push(weight.to_string());
        } else if let Some(module) = name.strip_suffix(".SCB") {
            weights.push(format!("{module}.weight"));
        }
    }
    weights.sort();
    weights.dedup();
    let mut out = HashMap::new();
    for weight in weights {
        let mut entries = HashMap::new();
        for key in QuantizedTensor::state_keys(&weight) {
            if let Some(meta) = checkpoint.meta(&key) {
                let bytes = host_bytes(checkpoint.bytes(&key)?);
                entries.insert(
                    key,
                    Entry {
                        meta: meta.clone(),
                        bytes,
                    },
                );
            }
        }
        let q = QuantizedTensor::from_entries(
            &weight,
            &mut entries,
            Some(config.compute_dtype),
            config.threshold,
        )?
        .ok_or_else(|| state_error(&weight, "weight", "has no quant state".into()))?;
        if let Some(extra) = entries.keys().next() {
            return Err(state_error(
                &weight,
                "quant_state",
                format!("unexpected entry {extra}"),
            ));
        }
        let int8 = matches!(q.format(), QuantFormat::Int8 { .. });
        if int8 != config.int8 {
            let (has, says) = if int8 {
                ("8-bit", "load_in_4bit")
            } else {
                ("4-bit", "load_in_8bit")
            };
            return Err(state_error(
                &weight,
                "quant_state",
                format!("is {has} but quantization_config says {says}"),
            ));
        }
        out.insert(weight, Arc::new(q));
    }
    // Parts whose weight has no quant state: a state entry went missing.
    for (name, _) in checkpoint.tensors() {
        if let Some((weight, field)) = QuantizedTensor::state_owner(name)
            && !out.contains_key(&weight)
        {
            return Err(state_error(
                &weight,
                field,
                format!(
                    "entry {name} has no quant_state.bitsandbytes__nf4/__fp4 or SCB entry beside it"
                ),
            ));
        }
    }
    if out.is_empty() {
        return Err(Error::Config {
            path: config_path.to_path_buf(),
            key: "quantization_config".into(),
            message: "declares bitsandbytes quantization, but no weight has a quant state \
                      (quant_state.bitsandbytes__nf4/__fp4 or SCB entries)"
                .into(),
        });
    }
    Ok(out)
}
