//! The decoder, one block at a time: the blocks every family in
//! `family.rs` is made of, run as its [`DecoderConfig`] says.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bigmodel::device::{DeviceBuffer, Gpu, GpuKind};
use bm_tensor::DType;

use crate::family::{DecoderConfig, Mlp, Norm, Positions, Projections, RopeConfig};
use crate::ops::{self, LayerCache, Mask, Rope};
use crate::quant_config::QuantizeOptions;
use crate::text::TextTokenizer;
use crate::weights::{FolderWeights, LinearWeight, WeightLayout, WeightSource};
use crate::{Error, GenerationConfig, Tensor};

/// Fetches `name` and checks its shape against the config.
pub(crate) fn fetch(
    src: &dyn WeightSource,
    name: &str,
    shape: &[usize],
) -> Result<Arc<Tensor>, Error> {
    let t = src.tensor(name)?;
    if t.shape() != shape {
        return Err(Error::ShapeMismatch {
            name: name.to_string(),
            expected: shape.to_vec(),
            found: t.shape().to_vec(),
        });
    }
    Ok(t)
}

/// Runs `f` between the source's begin/end hooks for `block`.
pub(crate) fn in_block<T>(
    src: &dyn WeightSource,
    block: &str,
    f: impl FnOnce() -> Result<T, Error>,
) -> Result<T, Error> {
    src.begin_block(block)?;
    let out = f();
    src.end_block(block);
    out
}

/// Fetches the weight of linear layer `name` (`[out, inp]` as `nn.Linear`
/// stores it, `[inp, out]` as `Conv1D` does when dense) and checks its shape
/// against the config.
pub(crate) fn fetch_linear(
    src: &dyn WeightSource,
    name: &str,
    [out, inp]: [usize; 2],
    layout: WeightLayout,
) -> Result<LinearWeight, Error> {
    let w = src.linear_weight(name, layout)?;
    let expected = match w {
        LinearWeight::DenseTransposed(_) => [inp, out],
        _ => [out, inp],
    };
    if w.shape() != expected {
        return Err(Error::ShapeMismatch {
            name: name.to_string(),
            expected: expected.to_vec(),
            found: w.shape().to_vec(),
        });
    }
    Ok(w)
}

/// A linear layer's weights: `nn.Linear` or transformers' `Conv1D`
/// (GPT-2), dense or quantized.
struct Linear {
    weight: LinearWeight,
    bias: Option<Arc<Tensor>>,
}

impl Linear {
    fn load(
        src: &dyn WeightSource,
        name: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Linear, Error> {
        Ok(Linear {
            weight: fetch_linear(
                src,
                &format!("{name}.weight"),
                [out, inp],
                WeightLayout::Linear,
            )?,
            bias: if bias {
                Some(fetch(src, &format!("{name}.bias"), &[out])?)
            } else {
                None
            },
        })
    }

    /// A `Conv1D` module (always with a bias).
    fn load_conv1d(
        src: &dyn WeightSource,
        name: &str,
        out: usize,
        inp: usize,
    ) -> Result<Linear, Error> {
        Ok(Linear {
            weight: fetch_linear(
                src,
                &format!("{name}.weight"),
                [out, inp],
                WeightLayout::Conv1D,
            )?,
            bias: Some(fetch(src, &format!("{name}.bias"), &[out])?),
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor, Error> {
        self.weight.forward(x, self.bias.as_deref())
    }

    /// The weight and bias, when the weight is dense `[out, in]` (what
    /// [`ops::linear_many`] and [`ops::gated_linear`] take).
    fn dense(&self) -> Option<(&Tensor, Option<&Tensor>)> {
        match &self.weight {
            LinearWeight::Dense(w) => Some((w, self.bias.as_deref())),
            _ => None,
        }
    }

    /// `x` through each of `layers`: in one pass ([`ops::linear_many`])
    /// when every weight is dense `[out, in]`, else one layer at a time.
    fn forward_many(layers: &[&Linear], x: &Tensor) -> Result<Vec<Tensor>, Error> {
        match layers.iter().map(|l| l.dense()).collect::<Option<Vec<_>>>() {
            Some(dense) => Ok(ops::linear_many(x, &dense)?),
            None => layers.iter().map(|l| l.forward(x)).collect(),
        }
    }
}

/// The per-layer key/value caches of one generation: one sequence, or a
/// batch of left-padded sequences (time-major, see [`LayerCache`]).
///
/// A layer that runs on an emulated GPU keeps its cache in host memory
/// (emulated GPUs do not compute) and holds as much of that GPU's budget as
/// the cache takes, so a batch too large for the device fails there with
/// the device's out-of-memory error, as it would on a real GPU, whose
/// layers keep their caches in its memory.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<LayerCache>,
    /// Left-padding positions of each sequence of the batch.
    pads: Vec<usize>,
    /// The emulated-GPU budget each layer's cache holds, if any.
    charges: Vec<Option<DeviceBuffer>>,
}

impl KvCache {
    /// Positions cached so far (padding included).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerCache::len)
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.pads.len()
    }

    /// Left-padding positions of each sequence.
    pub(crate) fn pads(&self) -> &[usize] {
        &self.pads
    }

    /// Bytes the caches hold.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(LayerCache::bytes).sum()
    }

    /// Forgets every position from `len` on (see [`LayerCache::truncate`]).
    pub fn truncate(&mut self, len: usize) -> Result<(), Error> {
        for layer in &mut self.layers {
            layer.truncate(len)?;
        }
        Ok(())
    }

    /// Keeps only the sequences whose `keep` entry is true.
    pub fn retain(&mut self, keep: &[bool]) -> Result<(), Error> {
        for layer in &mut self.layers {
            layer.retain(keep)?;
        }
        let mut flags = keep.iter();
        self.pads.retain(|_| *flags.next().unwrap_or(&false));
        Ok(())
    }

    /// The position of each row of the next `steps` positions, time-major:
    /// a sequence's own position, not counting its padding (0 on padding
    /// rows, which nothing attends to), as transformers computes
    /// `position_ids` from a left-padded attention mask.
    pub fn positions(&self, steps: usize) -> Vec<usize> {
        let start = self.len();
        (start..start + steps)
            .flat_map(|t| self.pads.iter().map(move |&pad| t.saturating_sub(pad)))
            .collect()
    }

    /// Empty caches of `layers` layers for one sequence.
    pub(crate) fn with_layers(layers: usize) -> KvCache {
        KvCache {
            layers: (0..layers).map(|_| LayerCache::new()).collect(),
            pads: vec![0],
            charges: (0..layers).map(|_| None).collect(),
        }
    }

    /// Layer `index`'s cache, to append to.
    pub(crate) fn layer_mut(&mut self, index: usize) -> &mut LayerCache {
        &mut self.layers[index]
    }

    /// Makes layer `index`'s cache hold its bytes of `gpu`'s budget when
    /// `gpu` is emulated (growing the hold by doubling, so it is taken
    /// rarely).
    pub(crate) fn charge(&mut self, index: usize, gpu: &Gpu) -> Result<(), Error> {
        if gpu.kind() != GpuKind::Emulated {
            return Ok(());
        }
        let need = self.layers[index].bytes();
        let held = self.charges[index].as_ref().map_or(0, DeviceBuffer::len);
        if need <= held {
            return Ok(());
        }
        // The old hold is returned first, so the new one may use its room;
        // when doubling does not fit, exactly what the cache needs may.
        self.charges[index] = None;
        let hold = gpu.alloc(need.max(2 * held)).or_else(|_| gpu.alloc(need))?;
        self.charges[index] = Some(hold);
        Ok(())
    }
}

/// Which rows of logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// One row per input token.
    All,
    /// Only the last token's row (all greedy decoding needs).
    Last,
}

/// The rotary tables of a config: one set, or LongRoPE's short and long
/// sets with the length that switches between them.
#[derive(Debug)]
struct Rotary {
    short: Rope,
    long: Option<(usize, Rope)>,
}

impl Rotary {
    fn new(rope: &RopeConfig, head_dim: usize) -> Result<Rotary, Error> {
        // Frequencies as transformers computes them, in f32:
        // 1 / (factor_i · theta^(2i / rotary_dim)).
        let frequencies = |factors: Option<&[f32]>| -> Vec<f32> {
            (0..rope.rotary_dim / 2)
                .map(|i| {
                    let base = rope.theta.powf((2 * i) as f32 / rope.rotary_dim as f32);
                    1.0 / (factors.map_or(1.0, |f| f[i]) * base)
                })
                .collect()
        };
        Ok(match &rope.long_rope {
            None if rope.rotary_dim == head_dim => Rotary {
                short: Rope::new(head_dim, rope.theta),
                long: None,
            },
            None => Rotary {
                short: Rope::with_frequencies(head_dim, frequencies(None), 1.0)?,
                long: None,
            },
            Some(l) => Rotary {
                short: Rope::with_frequencies(
                    head_dim,
                    frequencies(Some(&l.short_factor)),
                    l.attention_factor,
                )?,
                long: Some((
                    l.original_max_positions,
                    Rope::with_frequencies(
                        head_dim,
                        frequencies(Some(&l.long_factor)),
                        l.attention_factor,
                    )?,
                )),
            },
        })
    }

    /// The table for a forward pass ending at position `end` (exclusive):
    /// transformers picks LongRoPE's factors per pass, by its last position.
    fn for_pass_ending_at(&self, end: usize) -> &Rope {
        match &self.long {
            Some((original, long)) if end > *original => long,
            _ => &self.short,
        }
    }
}

/// The decoder: config plus rotary tables, no weights. Each block's
/// forward takes its weights from a [`WeightSource`] at call time.
#[derive(Debug)]
pub struct Decoder {
    config: DecoderConfig,
    dtype: DType,
    rotary: Option<Rotary>,
}

impl Decoder {
    /// A decoder computing in `dtype` (F32, F16 or BF16).
    pub fn new(config: DecoderConfig, dtype: DType) -> Result<Decoder, Error> {
        ops::check_compute_dtype("decoder compute dtype", dtype)?;
        let rotary = match &config.positions {
            Positions::Rotary(rope) => Some(Rotary::new(rope, config.heads.head_dim)?),
            Positions::Learned { .. } => None,
        };
        Ok(Decoder {
            config,
            dtype,
            rotary,
        })
    }

    /// The config.
    pub fn config(&self) -> &DecoderConfig {
        &self.config
    }

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Block names in execution order, as transformers names the modules.
    pub fn block_names(&self) -> Vec<String> {
        let n = self.config.names();
        let mut names = vec![n.embed.to_string()];
        names.extend(n.positions.map(str::to_string));
        names.extend((0..self.config.num_layers).map(|i| format!("{}.{i}", n.layers)));
        names.extend([n.final_norm.to_string(), "lm_head".to_string()]);
        names
    }

    /// An empty cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        self.new_batch_cache(&[0])
            .expect("a batch of one sequence is not empty")
    }

    /// An empty cache for `pads.len()` sequences, sequence b left-padded
    /// by `pads[b]` positions.
    pub fn new_batch_cache(&self, pads: &[usize]) -> Result<KvCache, Error> {
        Ok(KvCache {
            layers: (0..self.config.num_layers)
                .map(|_| LayerCache::batched(pads))
                .collect::<Result<_, _>>()?,
            pads: pads.to_vec(),
            charges: (0..self.config.num_layers).map(|_| None).collect(),
        })
    }

    /// The embedding blocks (tokens, and learned positions where the family
    /// has them) for `ids`, row r at position `positions[r]`:
    /// `[ids.len(), hidden]`.
    pub fn embed(
        &self,
        src: &dyn WeightSource,
        ids: &[u32],
        positions: &[usize],
    ) -> Result<Tensor, Error> {
        let c = &self.config;
        let n = c.names();
        let x = in_block(src, n.embed, || {
            let table = fetch(src, &c.embedding_weight(), &[c.vocab_size, c.hidden_size])?;
            let x = ops::embedding(ids, &table, self.dtype)?;
            Ok(match c.embed_scale {
                // transformers rounds the factor to the weights' dtype first.
                Some(factor) => {
                    let rounded = Tensor::from_f32(self.dtype, &[1], &[factor])?.to_f32_vec()[0];
                    ops::scale(&x, rounded)?
                }
                None => x,
            })
        })?;
        match (&c.positions, n.positions) {
            (Positions::Learned { max_positions }, Some(block)) => in_block(src, block, || {
                let end = positions.iter().max().map_or(0, |p| p + 1);
                if end > *max_positions {
                    return Err(Error::SequenceTooLong {
                        len: end,
                        max: *max_positions,
                    });
                }
                let table = fetch(
                    src,
                    &format!("{block}.weight"),
                    &[*max_positions, c.hidden_size],
                )?;
                let rows: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
                Ok(ops::add(&x, &ops::embedding(&rows, &table, self.dtype)?)?)
            }),
            _ => Ok(x),
        }
    }

    /// A norm module (`{module}.weight`, and `.bias` for LayerNorm).
    fn norm(&self, src: &dyn WeightSource, module: &str, x: &Tensor) -> Result<Tensor, Error> {
        let h = self.config.hidden_size;
        let weight = fetch(src, &format!("{module}.weight"), &[h])?;
        Ok(match self.config.norm {
            Norm::Rms { eps } => ops::rms_norm(x, &weight, eps)?,
            Norm::RmsPlusOne { eps } => ops::rms_norm_plus_one(x, &weight, eps)?,
            Norm::Layer { eps } => {
                let bias = fetch(src, &format!("{module}.bias"), &[h])?;
                ops::layer_norm(x, &weight, &bias, eps)?
            }
        })
    }

    /// Queries, keys and values of `x`, and the attention output projection.
    fn projections(
        &self,
        src: &dyn WeightSource,
        block: &str,
        x: &Tensor,
    ) -> Result<([Tensor; 3], Linear), Error> {
        let c = &self.config;
        let h = c.hidden_size;
        let (qw, kw) = (
            c.heads.heads * c.heads.head_dim,
            c.heads.kv_heads * c.heads.head_dim,
        );
        let split = |fused: Tensor| -> Result<[Tensor; 3], Error> {
            let parts = ops::split_columns(&fused, &[qw, kw, kw])?;
            Ok(parts.try_into().expect("three widths give three parts"))
        };
        Ok(match c.projections {
            Projections::Separate { qkv_bias, o_bias } => {
                let attn = format!("{block}.self_attn");
                let proj = |name: &str, out: usize| {
                    Linear::load(src, &format!("{attn}.{name}"), out, h, qkv_bias)
                };
                let (q, k, v) = (
                    proj("q_proj", qw)?,
                    proj("k_proj", kw)?,
                    proj("v_proj", kw)?,
                );
                (
                    Linear::forward_many(&[&q, &k, &v], x)?
                        .try_into()
                        .expect("three layers give three outputs"),
                    Linear::load(src, &format!("{attn}.o_proj"), h, qw, o_bias)?,
                )
            }
            Projections::FusedQkv => {
                let attn = format!("{block}.self_attn");
                let qkv = Linear::load(src, &format!("{attn}.qkv_proj"), qw + 2 * kw, h, false)?;
                (
                    split(qkv.forward(x)?)?,
                    Linear::load(src, &format!("{attn}.o_proj"), h, qw, false)?,
                )
            }
            Projections::Conv1D => {
                let attn = format!("{block}.attn");
                let c_attn = Linear::load_conv1d(src, &format!("{attn}.c_attn"), qw + 2 * kw, h)?;
                (
                    split(c_attn.forward(x)?)?,
                    Linear::load_conv1d(src, &format!("{attn}.c_proj"), h, qw)?,
                )
            }
        })
    }

    /// Qwen3's RMS norm over each head of `x` (`[seq, heads * head_dim]`).
    fn head_norm(&self, src: &dyn WeightSource, name: &str, x: Tensor) -> Result<Tensor, Error> {
        let Norm::Rms { eps } = self.config.norm else {
            unreachable!("per-head norms are only configured with RMSNorm")
        };
        let hd = self.config.heads.head_dim;
        let shape = x.shape().to_vec();
        let weight = fetch(src, name, &[hd])?;
        let heads = x.reshape(&[shape.iter().product::<usize>() / hd, hd])?;
        Ok(ops::rms_norm(&heads, &weight, eps)?.reshape(&shape)?)
    }

    /// The MLP of layer `block` on the normed `x`.
    fn mlp(&self, src: &dyn WeightSource, block: &str, x: &Tensor) -> Result<Tensor, Error> {
        let c = &self.config;
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let mlp = format!("{block}.mlp");
        let act = |t: &Tensor| c.activation.apply(t);
        Ok(match c.mlp {
            Mlp::Gated { bias } => {
                let gate = Linear::load(src, &format!("{mlp}.gate_proj"), i, h, bias)?;
                let up = Linear::load(src, &format!("{mlp}.up_proj"), i, h, bias)?;
                let down = Linear::load(src, &format!("{mlp}.down_proj"), h, i, bias)?;
                let gated = match (gate.dense(), up.dense()) {
                    (Some(g), Some(u)) => ops::gated_linear(x, g, u, c.activation.op())?,
                    _ => ops::mul(&act(&gate.forward(x)?)?, &up.forward(x)?)?,
                };
                down.forward(&gated)?
            }
            Mlp::FusedGated => {
                let gate_up = Linear::load(src, &format!("{mlp}.gate_up_proj"), 2 * i, h, false)?;
                let down = Linear::load(src, &format!("{mlp}.down_proj"), h, i, false)?;
                let [gate, up]: [Tensor; 2] = ops::split_columns(&gate_up.forward(x)?, &[i, i])?
                    .try_into()
                    .expect("two widths give two parts");
                down.forward(&ops::mul(&act(&gate)?, &up)?)?
            }
            Mlp::Conv1D => {
                let fc = Linear::load_conv1d(src, &format!("{mlp}.c_fc"), i, h)?;
                let proj = Linear::load_conv1d(src, &format!("{mlp}.c_proj"), h, i)?;
                proj.forward(&act(&fc.forward(x)?)?)?
            }
        })
    }

    /// Block `{layers}.{index}` on `x` (`[seq * batch, hidden]`, time-major,
    /// row r at position `positions[r]`), appending the new positions' keys
    /// and values to layer `index` of `cache`.
    pub fn layer(
        &self,
        src: &dyn WeightSource,
        index: usize,
        x: &Tensor,
        positions: &[usize],
        cache: &mut KvCache,
    ) -> Result<Tensor, Error> {
        let c = &self.config;
        let n = c.names();
        let block = format!("{}.{index}", n.layers);
        let window = c.windows.get(index).copied().flatten();
        in_block(src, &block, || {
            let normed = self.norm(src, &format!("{block}.{}", n.pre_attention), x)?;
            let ([q, k, v], o_proj) = self.projections(src, &block, &normed)?;
            let (q, k) = if c.qk_norm {
                let attn = format!("{block}.self_attn");
                (
                    self.head_norm(src, &format!("{attn}.q_norm.weight"), q)?,
                    self.head_norm(src, &format!("{attn}.k_norm.weight"), k)?,
                )
            } else {
                (q, k)
            };
            let (q, k) = match &self.rotary {
                Some(rotary) => {
                    // transformers picks LongRoPE's factors by the batch's
                    // largest position.
                    let end = positions.iter().max().map_or(0, |p| p + 1);
                    let rope = rotary.for_pass_ending_at(end);
                    (rope.apply_at(&q, positions)?, rope.apply_at(&k, positions)?)
                }
                None => (q, k),
            };
            let layer_cache = &mut cache.layers[index];
            layer_cache.append(&k, &v)?;
            let mask = window.map_or(Mask::Causal, Mask::SlidingWindow);
            let attended = ops::attention_with(&q, layer_cache, c.heads, mask, c.scores)?;
            if let Some(w) = window {
                layer_cache.forget_outside_window(w);
            }
            if let Some(gpu) = src.execution_gpu() {
                cache.charge(index, &gpu)?;
            }
            let mut out = o_proj.forward(&attended)?;
            if let Some(post) = n.post_attention {
                out = self.norm(src, &format!("{block}.{post}"), &out)?;
            }
            let x = ops::add(x, &out)?;

            let normed = self.norm(src, &format!("{block}.{}", n.pre_mlp), &x)?;
            let sparse = c
                .moe
                .as_ref()
                .filter(|m| m.sparse_layers.get(index) == Some(&true));
            let mut out = match sparse {
                Some(moe) => self.sparse_mlp(src, &block, &normed, moe)?,
                None => self.mlp(src, &block, &normed)?,
            };
            if let Some(post) = n.post_mlp {
                out = self.norm(src, &format!("{block}.{post}"), &out)?;
            }
            Ok(ops::add(&x, &out)?)
        })
    }

    /// The final norm block.
    pub fn final_norm(&self, src: &dyn WeightSource, x: &Tensor) -> Result<Tensor, Error> {
        let block = self.config.names().final_norm;
        in_block(src, block, || self.norm(src, block, x))
    }

    /// Block `lm_head`: logits `[seq, vocab]`, soft-capped where the family
    /// does. With tied embeddings it reads the token embedding's weight.
    pub fn lm_head(&self, src: &dyn WeightSource, x: &Tensor) -> Result<Tensor, Error> {
        let c = &self.config;
        in_block(src, "lm_head", || {
            let name = if c.tie_word_embeddings {
                c.embedding_weight()
            } else {
                "lm_head.weight".to_string()
            };
            let w = fetch_linear(
                src,
                &name,
                [c.vocab_size, c.hidden_size],
                WeightLayout::Linear,
            )?;
            let logits = w.forward(x, None)?;
            Ok(match c.final_softcap {
                Some(cap) => ops::softcap(&logits, cap)?,
                None => logits,
            })
        })
    }

    /// Runs every block on `ids`: the next positions of every sequence of
    /// `cache`'s batch, time-major (`ids.len()` a multiple of the batch).
    /// [`Logits::Last`] returns the last position's row of each sequence,
    /// `[batch, vocab]`.
    pub fn forward(
        &self,
        src: &dyn WeightSource,
        ids: &[u32],
        cache: &mut KvCache,
        logits: Logits,
    ) -> Result<Tensor, Error> {
        if ids.is_empty() {
            return Err(Error::EmptyInput("token sequence"));
        }
        let batch = cache.batch();
        if !ids.len().is_multiple_of(batch) {
            return Err(Error::BadOperands {
                op: "decoder forward",
                message: format!("{} ids do not divide into a batch of {batch}", ids.len()),
            });
        }
        let positions = cache.positions(ids.len() / batch);
        let mut x = self.embed(src, ids, &positions)?;
        for index in 0..self.config.num_layers {
            x = self.layer(src, index, &x, &positions, cache)?;
        }
        if logits == Logits::Last && ids.len() > batch {
            x = x.rows(ids.len() - batch, ids.len())?;
        }
        let x = self.final_norm(src, &x)?;
        self.lm_head(src, &x)
    }
}

/// A causal LM loaded from a Hugging Face folder: decoder, weights,
/// generation defaults and, when the folder has one, its tokenizer.
/// Generating is in `generate.rs`.
pub struct CausalLm {
    pub(crate) decoder: Decoder,
    pub(crate) weights: Box<dyn WeightSource + Send>,
    pub(crate) tokenizer: Option<TextTokenizer>,
    pub(crate) generation: GenerationConfig,
    pub(crate) dir: PathBuf,
}

impl CausalLm {
    /// Opens `dir` (config.json, safetensors, optional tokenizer.json),
    /// computing in `dtype`, or in the embedding's stored dtype when `None`
    /// (transformers' `dtype="auto"`).
    pub fn open(dir: impl AsRef<Path>, dtype: Option<DType>) -> Result<CausalLm, Error> {
        let dir = dir.as_ref();
        let config = DecoderConfig::from_dir(dir)?;
        let probe = FolderWeights::open(dir, None)?;
        let dtype = probe.load_dtype(config.arch, dtype);
        let weights = FolderWeights::open(dir, Some(dtype))?;
        CausalLm::with_weights(dir, config, dtype, Box::new(weights))
    }

    /// [`CausalLm::open`] with the linear layers quantized while loading
    /// (`--quantize`, Accelerate's `load_and_quantize_model`): each weight
    /// is quantized the first time it is used. `dtype` is the compute dtype
    /// of everything else (and what weights are cast to before quantizing).
    pub fn open_quantized(
        dir: impl AsRef<Path>,
        dtype: DType,
        options: QuantizeOptions,
    ) -> Result<CausalLm, Error> {
        let dir = dir.as_ref();
        let config = DecoderConfig::from_dir(dir)?;
        let weights = FolderWeights::open_quantized(dir, Some(dtype), options)?;
        CausalLm::with_weights(dir, config, dtype, Box::new(weights))
    }

    /// A model over weights supplied by the caller (an offloading source).
    pub fn with_weights(
        dir: impl AsRef<Path>,
        config: DecoderConfig,
        dtype: DType,
        weights: Box<dyn WeightSource + Send>,
    ) -> Result<CausalLm, Error> {
        let dir = dir.as_ref().to_path_buf();
        let tokenizer = TextTokenizer::open_in(&dir, None)?;
        let generation = GenerationConfig::from_dir(&dir, &config.eos_token_ids)?;
        Ok(CausalLm {
            decoder: Decoder::new(config, dtype)?,
            weights,
            tokenizer,
            generation,
            dir,
        })
    }

    /// The decoder.
    pub fn decoder(&self) -> &Decoder {
        &self.decoder
    }

    /// The tokenizer, if the folder has one.
    pub fn tokenizer(&self) -> Option<&TextTokenizer> {
        self.tokenizer.as_ref()
    }
}
