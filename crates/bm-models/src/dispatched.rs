//! The reference models running on a dispatched `bigmodel` model: a
//! [`WeightSource`] over [`bigmodel::dispatch::Model`], and the "open a
//! Hugging Face folder with a device map" path that builds one.
//!
//! Each block the models run (`model.layers.3`, `lm_head`, ...) becomes one
//! forward pass of the dispatched model: `begin_block` is
//! [`Model::enter`] (the hook brings offloaded weights to the execution
//! device and starts prefetching the next block), `tensor` is
//! [`Forward::weight`], and `end_block` is [`Forward::exit`] (the weights
//! are released). Host weights (resident buffers and mapped checkpoint or
//! offload files) reach the ops without a copy: the tensor holds the
//! dispatch layer's `Arc` of the bytes.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::ThreadId;

use bigmodel::device::{DeviceBuffer, DeviceSet, GpuKind};
use bigmodel::dispatch::{Activations, Bytes, Forward, Model, Placement, Weight};
use bigmodel::plan::config::{Family, HfConfig};
use bigmodel::tensor::{DType, HostBuffer};

use crate::config::read_config;
use crate::packed::{self, PackedWeights};
use crate::quant_config::QuantizeOptions;
use crate::weights::{FolderWeights, LinearWeight, WeightLayout, WeightSource, family_kept_f32};
use crate::{
    CausalLm, DecoderConfig, EncoderConfig, Error, SUPPORTED_DECODERS, SUPPORTED_ENCODERS,
    SUPPORTED_SEQ2SEQ, SentenceEmbedder, Seq2SeqLm, T5Config, Tensor, ops,
};
use bm_compute::{HostBytes, is_compute_dtype};

/// A block entered by one thread and not yet exited.
struct OpenBlock {
    name: String,
    guard: Forward,
}

struct Inner {
    open: Mutex<HashMap<ThreadId, Vec<OpenBlock>>>,
    model: Arc<Model>,
    dtype: DType,
    streamed: AtomicU64,
    fetches: AtomicU64,
    exit_error: Mutex<Option<bigmodel::dispatch::Error>>,
    /// The linear weights held packed (quantized), if any.
    packed: Option<Arc<PackedWeights>>,
    /// Modules the model computes in F32 whatever `dtype` (loaded so, and
    /// handed out as loaded).
    kept_f32: Vec<String>,
}

/// A [`WeightSource`] over a dispatched model. Cheap to clone (clones
/// share the model and the counters), and usable from many threads at
/// once: each thread's open blocks are kept apart.
#[derive(Clone)]
pub struct DispatchedWeights {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for DispatchedWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DispatchedWeights")
            .field("model", &self.inner.model)
            .field("dtype", &self.inner.dtype)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere leaves the maps consistent (entries are moved
    // whole), so a poisoned lock is still usable.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl DispatchedWeights {
    /// A source over `model` whose float weights are handed out in `dtype`
    /// (weights loaded in another dtype, e.g. `keep_in_fp32_modules`, are
    /// converted on each fetch).
    pub fn new(model: Arc<Model>, dtype: DType) -> Result<DispatchedWeights, Error> {
        DispatchedWeights::with_packed(model, dtype, None, Vec::new())
    }

    /// [`DispatchedWeights::new`] over a model whose tree holds the
    /// weights of `packed` in packed form, the weights of modules
    /// `kept_f32` handed out as loaded (F32).
    fn with_packed(
        model: Arc<Model>,
        dtype: DType,
        packed: Option<Arc<PackedWeights>>,
        kept_f32: Vec<String>,
    ) -> Result<DispatchedWeights, Error> {
        ops::check_compute_dtype("dispatched compute dtype", dtype)?;
        Ok(DispatchedWeights {
            inner: Arc::new(Inner {
                open: Mutex::new(HashMap::new()),
                model,
                dtype,
                streamed: AtomicU64::new(0),
                fetches: AtomicU64::new(0),
                exit_error: Mutex::new(None),
                packed,
                kept_f32,
            }),
        })
    }

    /// The dispatched model (its `hf_device_map`, placements, settings).
    pub fn model(&self) -> &Model {
        &self.inner.model
    }

    /// Bytes of offloaded weights (CPU- or disk-offloaded) handed to blocks
    /// so far: what was brought to the execution device.
    pub fn streamed_bytes(&self) -> u64 {
        self.inner.streamed.load(Ordering::Relaxed)
    }

    /// Tensors handed to blocks so far.
    pub fn fetches(&self) -> u64 {
        self.inner.fetches.load(Ordering::Relaxed)
    }

    /// Takes this thread's innermost open block out of the table (so the
    /// lock is not held while weights load) and puts it back after `f`.
    fn with_open_block<T>(
        &self,
        f: impl FnOnce(&mut OpenBlock) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let me = std::thread::current().id();
        let mut block = lock(&self.inner.open)
            .get_mut(&me)
            .and_then(Vec::pop)
            .ok_or(Error::BadOperands {
                op: "dispatched weights",
                message: "a tensor was requested outside any block".into(),
            })?;
        let out = f(&mut block);
        lock(&self.inner.open).entry(me).or_default().push(block);
        out
    }

    /// The name of tensor `name` below `block`: `name` without the block
    /// prefix, or, for a tied tensor owned elsewhere (`lm_head` reading
    /// `model.embed_tokens.weight`), the name of its alias in the block.
    fn local_name(&self, block: &str, name: &str) -> Result<String, Error> {
        let prefix = if block.is_empty() {
            String::new()
        } else {
            format!("{block}.")
        };
        if let Some(local) = name.strip_prefix(&prefix) {
            return Ok(local.to_string());
        }
        let model = &self.inner.model;
        model
            .tree()
            .tensors()
            .filter_map(|t| t.name.strip_prefix(&prefix).map(|l| (t.name, l)))
            .find(|(full, _)| model.shares_storage(full, name).unwrap_or(false))
            .map(|(_, local)| local.to_string())
            .ok_or_else(|| Error::MissingTensor {
                name: format!("{name} (not in block {block} nor tied to one of its tensors)"),
            })
    }

    /// The ops' tensor over a dispatch weight: the same bytes for host
    /// memory and for CUDA memory (the ops then run on that GPU), a host
    /// copy for page-locked memory and emulated GPUs (which do not compute).
    fn to_tensor(&self, name: &str, weight: Weight) -> Result<Arc<Tensor>, Error> {
        let tensor = match weight.bytes.as_ref() {
            Bytes::Device(d) if d.gpu().kind() == GpuKind::Cuda => {
                Tensor::from_shared_device(weight.meta, Arc::new(DeviceWeight(weight.bytes)), name)?
            }
            Bytes::Host(_) | Bytes::Mmap(_) => Tensor::from_host(
                weight.meta,
                HostBytes::Shared(Arc::new(HostWeight(weight.bytes))),
                name,
            )?,
            other => Tensor::from_host(
                weight.meta,
                HostBytes::Owned(HostBuffer::from_bytes(
                    &other.to_host().map_err(Error::Dispatch)?,
                )?),
                name,
            )?,
        };
        if tensor.dtype() != self.inner.dtype
            && is_compute_dtype(tensor.dtype())
            && !bigmodel::dispatch::in_modules(name, &self.inner.kept_f32)
        {
            return Ok(Arc::new(tensor.to_dtype(self.inner.dtype)?));
        }
        Ok(Arc::new(tensor))
    }
}

/// A host-memory dispatch weight seen as bytes. Only built for
/// [`Bytes::Host`] and [`Bytes::Mmap`].
struct HostWeight(Arc<Bytes>);

impl AsRef<[u8]> for HostWeight {
    fn as_ref(&self) -> &[u8] {
        self.0.host().unwrap_or(&[])
    }
}

/// A CUDA-resident dispatch weight seen as a device buffer. Only built for
/// [`Bytes::Device`].
struct DeviceWeight(Arc<Bytes>);

impl AsRef<DeviceBuffer> for DeviceWeight {
    fn as_ref(&self) -> &DeviceBuffer {
        match self.0.as_ref() {
            Bytes::Device(d) => d,
            _ => unreachable!("DeviceWeight is built only over device bytes"),
        }
    }
}

impl DispatchedWeights {
    /// The weight `name` from the open block, counted.
    fn fetch(&self, name: &str) -> Result<Weight, Error> {
        let weight = self.with_open_block(|block| {
            let local = self.local_name(&block.name, name)?;
            block.guard.weight(&local).map_err(|e| match e {
                bigmodel::dispatch::Error::UnknownName(_)
                | bigmodel::dispatch::Error::NotLoaded(_) => Error::MissingTensor {
                    name: name.to_string(),
                },
                other => Error::Dispatch(other),
            })
        })?;
        if matches!(
            self.inner.model.placement(name),
            Ok(Placement::Offloaded(_))
        ) {
            self.inner
                .streamed
                .fetch_add(weight.bytes.len() as u64, Ordering::Relaxed);
        }
        self.inner.fetches.fetch_add(1, Ordering::Relaxed);
        Ok(weight)
    }
}

impl WeightSource for DispatchedWeights {
    fn tensor(&self, name: &str) -> Result<Arc<Tensor>, Error> {
        if self.inner.packed.as_ref().is_some_and(|p| p.contains(name)) {
            return Err(Error::QuantizedNotLinear {
                name: name.to_string(),
            });
        }
        let weight = self.fetch(name)?;
        self.to_tensor(name, weight)
    }

    fn execution_gpu(&self) -> Option<bigmodel::device::Gpu> {
        let me = std::thread::current().id();
        let device = lock(&self.inner.open)
            .get(&me)?
            .last()?
            .guard
            .execution_device()?;
        match device {
            bigmodel::device::Device::Gpu(n) => self.inner.model.devices().gpu(n).ok().cloned(),
            bigmodel::device::Device::Cpu => None,
        }
    }

    /// A packed weight arrives as its packed bytes (streamed at that size
    /// when offloaded) and is used in place: host and mapped bytes without
    /// a copy, CUDA-resident ones by the GPU matmul.
    fn linear_weight(&self, name: &str, layout: WeightLayout) -> Result<LinearWeight, Error> {
        let Some(packed) = self.inner.packed.as_ref().filter(|p| p.contains(name)) else {
            return self.tensor(name).map(|t| LinearWeight::dense(t, layout));
        };
        let weight = self.fetch(name)?;
        let bytes = match weight.bytes.as_ref() {
            Bytes::Host(_) | Bytes::Mmap(_) => {
                HostBytes::Shared(Arc::new(HostWeight(weight.bytes.clone())))
            }
            Bytes::Device(d) if d.gpu().kind() == GpuKind::Cuda => {
                let bytes = Arc::new(DeviceWeight(weight.bytes.clone()));
                return Ok(LinearWeight::QuantizedOnGpu(Arc::new(
                    packed.read_on_gpu(name, bytes)?,
                )));
            }
            other => HostBytes::Owned(HostBuffer::from_bytes(
                &other.to_host().map_err(Error::Dispatch)?,
            )?),
        };
        Ok(LinearWeight::Quantized(Arc::new(packed.read(name, bytes)?)))
    }

    fn begin_block(&self, block: &str) -> Result<(), Error> {
        if let Some(e) = lock(&self.inner.exit_error).take() {
            return Err(Error::Dispatch(e));
        }
        let guard = self
            .inner
            .model
            .enter(block, Activations::default())
            .map_err(|e| match e {
                bigmodel::dispatch::Error::UnknownName(_) => Error::BadOperands {
                    op: "dispatched weights",
                    message: format!("block {block} is not a module of the dispatched model"),
                },
                other => Error::Dispatch(other),
            })?;
        lock(&self.inner.open)
            .entry(std::thread::current().id())
            .or_default()
            .push(OpenBlock {
                name: block.to_string(),
                guard,
            });
        Ok(())
    }

    fn end_block(&self, block: &str) {
        let me = std::thread::current().id();
        let open = {
            let mut table = lock(&self.inner.open);
            let stack = table.entry(me).or_default();
            let open = stack
                .iter()
                .rposition(|b| b.name == block)
                .map(|i| stack.remove(i));
            if stack.is_empty() {
                table.remove(&me);
            }
            open
        };
        // end_block cannot fail; an exit error is reported by the next
        // begin_block instead of being lost.
        if let Some(open) = open
            && let Err(e) = open.guard.exit(Activations::default())
        {
            lock(&self.inner.exit_error).get_or_insert(e);
        }
    }
}

/// A reference model opened over a dispatched model, with the source it
/// reads through (for the device map and the streaming counters).
pub struct Dispatched<M> {
    /// The model ([`CausalLm`] or [`SentenceEmbedder`]).
    pub model: M,
    /// Its weight source.
    pub weights: DispatchedWeights,
}

impl<M> std::fmt::Debug for Dispatched<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatched")
            .field("weights", &self.weights)
            .finish_non_exhaustive()
    }
}

/// Loads `dir`'s checkpoint onto `tree` under `options` (with `dtype` and
/// the family's no-split classes filled in) and dispatches it. Linear
/// weights are held packed when the folder is pre-quantized or `quantize`
/// is given: the planner sizes them packed and they are produced one at a
/// time while loading. Modules `kept_f32` load in F32 whatever `dtype`
/// and are handed out so.
fn dispatch(
    dir: &Path,
    probe: &FolderWeights,
    (tree, no_split): (bigmodel::plan::ModuleTree, Vec<String>),
    devices: Arc<DeviceSet>,
    options: &bigmodel::Options,
    (dtype, kept_f32): (DType, Vec<String>),
    quantize: Option<&QuantizeOptions>,
) -> Result<DispatchedWeights, Error> {
    let mut options = options.clone();
    options.dtype = Some(dtype);
    options
        .keep_in_fp32_modules
        .extend(kept_f32.iter().cloned());
    if options.no_split_module_classes.is_empty() {
        options.no_split_module_classes = no_split;
    }
    let map = match &options.device_map {
        Some(bigmodel::DeviceMapSpec::Map(map)) => Some(map),
        _ => None,
    };
    let quantized = packed::packed_for_load(dir, Some(probe), &tree, quantize, dtype, map)?;
    let (tree, packed) = match quantized {
        Some((tree, packed)) => {
            let packed = Arc::new(packed);
            options.load_transform = Some(packed.clone());
            (tree, Some(packed))
        }
        None => (tree, None),
    };
    let model = bigmodel::load_checkpoint_and_dispatch(tree, dir, devices, &options)?;
    DispatchedWeights::with_packed(Arc::new(model), dtype, packed, kept_f32)
}

/// A config whose number of layers disagrees with the checkpoint is an
/// error naming the key: loading 9000 configured layers over a checkpoint
/// of 3 would plan and dispatch them all before failing, and 1 over 3
/// would silently drop layers. Checks the planned repeated blocks (a
/// decoder's layers, BERT's, T5's decoder blocks) against the family's
/// layer key.
fn check_layer_count(
    hf: &HfConfig,
    planned: &bigmodel::plan::hf::HfModel,
    weights: &FolderWeights,
) -> Result<(), Error> {
    let layers: Vec<&str> = planned
        .layers
        .iter()
        .map(|&m| planned.tree.module(m).name)
        .collect();
    check_stack(hf, hf.family.layers_key(), planned, &layers, weights)
}

/// [`check_layer_count`] for one stack of blocks (`layers`, named
/// `<stem>.0`, `<stem>.1`, ...), configured by `key`. Block `i` is present
/// when the tensor that comes first in block 0 is present under
/// `<stem>.i`.
fn check_stack(
    hf: &HfConfig,
    key: &str,
    planned: &bigmodel::plan::hf::HfModel,
    layers: &[&str],
    weights: &FolderWeights,
) -> Result<(), Error> {
    let tree = &planned.tree;
    let Some(&first) = layers.first() else {
        return Ok(());
    };
    let (Some(stem), Some(suffix)) = (
        first.strip_suffix(".0"),
        tree.state_dict().into_iter().find_map(|t| {
            tree.tensor(t)
                .name
                .strip_prefix(first)?
                .strip_prefix('.')
                .map(str::to_string)
        }),
    ) else {
        return Ok(());
    };
    let tensor_of = |layer: usize| format!("{stem}.{layer}.{suffix}");
    let count = |n: usize| match n {
        1 => "1 layer".to_string(),
        n => format!("{n} layers"),
    };
    let configured = layers.len();
    // Counting stops one past the configured layers: enough to tell.
    let held = (0..=configured)
        .take_while(|&i| weights.contains(&tensor_of(i)))
        .count();
    let message = if held > configured {
        format!(
            "{}, but the checkpoint holds more (it has {})",
            count(configured),
            tensor_of(configured)
        )
    } else if held < configured {
        format!(
            "{}, but the checkpoint holds {held} (it has no {})",
            count(configured),
            tensor_of(held)
        )
    } else {
        return Ok(());
    };
    Err(Error::Config {
        path: hf.file().to_path_buf(),
        key: key.to_string(),
        message,
    })
}

/// Opens the decoder folder `dir` (config.json, safetensors, optional
/// tokenizer.json) as Accelerate's `load_checkpoint_and_dispatch` would:
/// the module tree from config.json, every tensor loaded straight to where
/// `options` (a device map or a strategy with `max_memory`, an offload
/// folder) puts it, hooks on every map entry. Computes in `options.dtype`,
/// or in the stored dtype of the embedding.
pub fn open_causal_lm(
    dir: impl AsRef<Path>,
    devices: Arc<DeviceSet>,
    options: &bigmodel::Options,
) -> Result<Dispatched<CausalLm>, Error> {
    open_decoder(dir.as_ref(), devices, options, None)
}

/// [`open_causal_lm`] with the linear layers quantized while loading, as
/// `quantize` says (Accelerate's `load_and_quantize_model`): each weight is
/// quantized from the compute dtype as it is read, so the model is never
/// whole in full precision in memory, and the planner and the dispatcher
/// size, place and stream it packed. A pre-quantized folder is refused
/// (open it with [`open_causal_lm`]).
pub fn open_causal_lm_quantized(
    dir: impl AsRef<Path>,
    devices: Arc<DeviceSet>,
    options: &bigmodel::Options,
    quantize: &QuantizeOptions,
) -> Result<Dispatched<CausalLm>, Error> {
    open_decoder(dir.as_ref(), devices, options, Some(quantize))
}

fn open_decoder(
    dir: &Path,
    devices: Arc<DeviceSet>,
    options: &bigmodel::Options,
    quantize: Option<&QuantizeOptions>,
) -> Result<Dispatched<CausalLm>, Error> {
    let hf = read_config(dir, SUPPORTED_DECODERS)?;
    let config = DecoderConfig::from_config(&hf)?;
    let probe = FolderWeights::open(dir, None)?;
    let dtype = probe.load_dtype(config.arch, options.dtype);
    let planned = bigmodel::plan::hf::tree_from_config(&hf)?;
    check_layer_count(&hf, &planned, &probe)?;
    let weights = dispatch(
        dir,
        &probe,
        (planned.tree, planned.no_split),
        devices,
        options,
        (dtype, family_kept_f32(config.arch, dtype)),
        quantize,
    )?;
    let model = CausalLm::with_weights(dir, config, dtype, Box::new(weights.clone()))?;
    Ok(Dispatched { model, weights })
}

/// Opens the T5 folder `dir` (config.json, safetensors, optional
/// tokenizer.json) over a dispatched model, as [`open_causal_lm`] does for
/// decoders: the module tree from config.json (the head tied to `shared`
/// unless the checkpoint has its own `lm_head.weight`), every tensor where
/// `options` puts it, hooks on every map entry. Computes in
/// `options.dtype`, or in the stored dtype of `shared`.
pub fn open_seq2seq_lm(
    dir: impl AsRef<Path>,
    devices: Arc<DeviceSet>,
    options: &bigmodel::Options,
) -> Result<Dispatched<Seq2SeqLm>, Error> {
    let dir = dir.as_ref();
    let mut hf = read_config(dir, SUPPORTED_SEQ2SEQ)?;
    let probe = FolderWeights::open(dir, None)?;
    let config = T5Config::from_folder(&hf, dir)?.tie_to(&probe);
    hf.tie_word_embeddings = config.tie_word_embeddings;
    let dtype = probe.load_dtype(Family::T5, options.dtype);
    let planned = bigmodel::plan::hf::tree_from_config(&hf)?;
    let encoder: Vec<String> = (0..config.encoder_layers)
        .map(|i| format!("encoder.block.{i}"))
        .collect();
    let encoder: Vec<&str> = encoder.iter().map(String::as_str).collect();
    check_stack(&hf, "num_layers", &planned, &encoder, &probe)?;
    let decoder_key = match hf.keys.get("num_decoder_layers") {
        Some(_) => "num_decoder_layers",
        None => "num_layers",
    };
    let decoder: Vec<&str> = planned
        .layers
        .iter()
        .map(|&m| planned.tree.module(m).name)
        .collect();
    check_stack(&hf, decoder_key, &planned, &decoder, &probe)?;
    let weights = dispatch(
        dir,
        &probe,
        (planned.tree, planned.no_split),
        devices,
        options,
        (dtype, family_kept_f32(Family::T5, dtype)),
        None,
    )?;
    let model = Seq2SeqLm::with_weights(dir, config, dtype, Box::new(weights.clone()))?;
    Ok(Dispatched { model, weights })
}

/// Opens the sentence-transformers or BERT folder `dir` over a dispatched
/// model, as [`open_causal_lm`] does for decoders. A checkpoint saved from
/// a task model (`bert.` names) gets its module tree from the checkpoint.
pub fn open_sentence_embedder(
    dir: impl AsRef<Path>,
    devices: Arc<DeviceSet>,
    options: &bigmodel::Options,
) -> Result<Dispatched<SentenceEmbedder>, Error> {
    open_encoder(dir.as_ref(), devices, options, None)
}

/// [`open_sentence_embedder`] with the linear layers quantized while
/// loading, as [`open_causal_lm_quantized`] does for decoders.
pub fn open_sentence_embedder_quantized(
    dir: impl AsRef<Path>,
    devices: Arc<DeviceSet>,
    options: &bigmodel::Options,
    quantize: &QuantizeOptions,
) -> Result<Dispatched<SentenceEmbedder>, Error> {
    open_encoder(dir.as_ref(), devices, options, Some(quantize))
}

fn open_encoder(
    dir: &Path,
    devices: Arc<DeviceSet>,
    options: &bigmodel::Options,
    quantize: Option<&QuantizeOptions>,
) -> Result<Dispatched<SentenceEmbedder>, Error> {
    let hf = read_config(dir, SUPPORTED_ENCODERS)?;
    let config = EncoderConfig::from_config(&hf)?;
    let probe = FolderWeights::open(dir, None)?;
    let prefix = probe.bert_prefix();
    let dtype = probe.load_dtype(Family::Bert, options.dtype);
    let (tree, no_split) = if prefix.is_empty() {
        let planned = bigmodel::plan::hf::tree_from_config(&hf)?;
        check_layer_count(&hf, &planned, &probe)?;
        (planned.tree, planned.no_split)
    } else {
        let tree = bigmodel::tree_from_checkpoint(dir)?;
        (tree, Vec::new())
    };
    let weights = dispatch(
        dir,
        &probe,
        (tree, no_split),
        devices,
        options,
        (dtype, family_kept_f32(Family::Bert, dtype)),
        quantize,
    )?;
    let model =
        SentenceEmbedder::with_weights(dir, config, dtype, prefix, Box::new(weights.clone()))?;
    Ok(Dispatched { model, weights })
}
