//! The Llama-family decoder (llama, mistral, qwen2), one block at a time.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use bm_tensor::DType;

use crate::config::ConfigFile;
use crate::ops::{self, Heads, LayerCache, Mask, Rope};
use crate::text::TextTokenizer;
use crate::weights::{FolderWeights, WeightSource};
use crate::{Error, Tensor};

/// The decoder architectures this crate runs.
pub const SUPPORTED_DECODERS: &str =
    "llama, mistral, qwen2 (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)";

/// Which member of the Llama family a config describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecoderArch {
    /// `LlamaForCausalLM`.
    Llama,
    /// `MistralForCausalLM` (sliding-window attention).
    Mistral,
    /// `Qwen2ForCausalLM` (biases on q/k/v).
    Qwen2,
}

/// What a decoder's `config.json` says, in the terms the blocks use.
#[derive(Clone, Debug, PartialEq)]
pub struct DecoderConfig {
    /// Architecture.
    pub arch: DecoderArch,
    /// Vocabulary size (rows of the embedding and of `lm_head`).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Attention geometry.
    pub heads: Heads,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Rotary base.
    pub rope_theta: f32,
    /// Biases on the q/k/v projections.
    pub qkv_bias: bool,
    /// Bias on the attention output projection.
    pub o_bias: bool,
    /// Biases on the MLP projections.
    pub mlp_bias: bool,
    /// `lm_head` shares `model.embed_tokens.weight`.
    pub tie_word_embeddings: bool,
    /// Mistral's attention window, if any.
    pub sliding_window: Option<usize>,
    /// Tokens that end generation (`eos_token_id`).
    pub eos_token_ids: Vec<u32>,
}

impl DecoderConfig {
    /// Reads `dir/config.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<DecoderConfig, Error> {
        DecoderConfig::parse(&ConfigFile::open(dir.as_ref())?)
    }

    /// Parses config JSON already in memory; `path` names it in errors.
    pub fn from_json(
        path: impl Into<PathBuf>,
        json: serde_json::Value,
    ) -> Result<DecoderConfig, Error> {
        DecoderConfig::parse(&ConfigFile::from_value(path.into(), json))
    }

    fn parse(c: &ConfigFile) -> Result<DecoderConfig, Error> {
        let model_type = c.opt_str("model_type").unwrap_or_default();
        let arch = match model_type {
            "llama" => DecoderArch::Llama,
            "mistral" => DecoderArch::Mistral,
            "qwen2" => DecoderArch::Qwen2,
            other => {
                let archs = c
                    .get("architectures")
                    .map(|a| a.to_string())
                    .unwrap_or_default();
                return Err(Error::UnsupportedArchitecture {
                    found: format!("{other} {archs}").trim().to_string(),
                    supported: SUPPORTED_DECODERS,
                });
            }
        };
        let hidden_size = c.usize("hidden_size")?;
        let num_heads = c.usize("num_attention_heads")?;
        let kv_heads = c.opt_usize("num_key_value_heads")?.unwrap_or(num_heads);
        if num_heads % kv_heads != 0 {
            return Err(c.error(
                "num_key_value_heads",
                format!("{kv_heads} does not divide num_attention_heads {num_heads}"),
            ));
        }
        let head_dim = match c.opt_usize("head_dim")? {
            Some(d) => d,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => return Err(c.error("hidden_size", "not a multiple of num_attention_heads")),
        };
        if head_dim % 2 != 0 {
            return Err(c.error("head_dim", format!("{head_dim} is odd; rotary needs pairs")));
        }
        if let Some(act) = c.opt_str("hidden_act") {
            if act != "silu" {
                return Err(c.error(
                    "hidden_act",
                    format!("{act:?} is not supported (only silu)"),
                ));
            }
        }
        // transformers 5 keeps rope settings in rope_parameters; older
        // configs in rope_theta / rope_scaling. Only unscaled rope is run.
        let rope = c.get("rope_parameters").or_else(|| c.get("rope_scaling"));
        let rope_type = rope
            .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
            .and_then(|t| t.as_str())
            .unwrap_or("default");
        if rope_type != "default" {
            return Err(c.error(
                "rope_scaling",
                format!("rope type {rope_type:?} is not supported (only unscaled rope)"),
            ));
        }
        let rope_theta = rope
            .and_then(|r| r.get("rope_theta"))
            .and_then(|t| t.as_f64())
            .or(c.opt_f64("rope_theta")?)
            .unwrap_or(10000.0);
        let attention_bias = c.bool_or("attention_bias", false)?;
        let sliding_window = match arch {
            DecoderArch::Mistral => c.opt_usize("sliding_window")?,
            DecoderArch::Qwen2 if c.bool_or("use_sliding_window", false)? => {
                return Err(c.error(
                    "use_sliding_window",
                    "Qwen2 sliding-window layers are not supported",
                ));
            }
            _ => None,
        };
        Ok(DecoderConfig {
            arch,
            vocab_size: c.usize("vocab_size")?,
            hidden_size,
            intermediate_size: c.usize("intermediate_size")?,
            num_layers: c.usize("num_hidden_layers")?,
            heads: Heads {
                heads: num_heads,
                kv_heads,
                head_dim,
            },
            rms_norm_eps: c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            rope_theta: rope_theta as f32,
            qkv_bias: arch == DecoderArch::Qwen2 || attention_bias,
            o_bias: arch == DecoderArch::Llama && attention_bias,
            mlp_bias: arch == DecoderArch::Llama && c.bool_or("mlp_bias", false)?,
            tie_word_embeddings: c.bool_or("tie_word_embeddings", false)?,
            sliding_window,
            eos_token_ids: c.token_ids("eos_token_id")?,
        })
    }

    fn mask(&self) -> Mask {
        match self.sliding_window {
            Some(w) => Mask::SlidingWindow(w),
            None => Mask::Causal,
        }
    }
}

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

/// A linear layer's weights.
struct Linear {
    weight: Arc<Tensor>,
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
            weight: fetch(src, &format!("{name}.weight"), &[out, inp])?,
            bias: if bias {
                Some(fetch(src, &format!("{name}.bias"), &[out])?)
            } else {
                None
            },
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor, Error> {
        Ok(ops::linear(x, &self.weight, self.bias.as_deref())?)
    }
}

/// The per-layer key/value caches of one generation.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<LayerCache>,
}

impl KvCache {
    /// Positions cached so far.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerCache::len)
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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

/// The decoder: config plus rotary tables, no weights. Each block's
/// forward takes its weights from a [`WeightSource`] at call time.
#[derive(Debug)]
pub struct Decoder {
    config: DecoderConfig,
    dtype: DType,
    rope: Rope,
}

impl Decoder {
    /// A decoder computing in `dtype` (F32, F16 or BF16).
    pub fn new(config: DecoderConfig, dtype: DType) -> Result<Decoder, Error> {
        ops::check_compute_dtype("decoder compute dtype", dtype)?;
        let rope = Rope::new(config.heads.head_dim, config.rope_theta);
        Ok(Decoder {
            config,
            dtype,
            rope,
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
        let mut names = vec!["model.embed_tokens".to_string()];
        names.extend((0..self.config.num_layers).map(|i| format!("model.layers.{i}")));
        names.extend(["model.norm".to_string(), "lm_head".to_string()]);
        names
    }

    /// An empty cache for one generation.
    pub fn new_cache(&self) -> KvCache {
        KvCache {
            layers: (0..self.config.num_layers)
                .map(|_| LayerCache::new())
                .collect(),
        }
    }

    /// Block `model.embed_tokens`: `[ids.len(), hidden]`.
    pub fn embed(&self, src: &dyn WeightSource, ids: &[u32]) -> Result<Tensor, Error> {
        let c = &self.config;
        in_block(src, "model.embed_tokens", || {
            let table = fetch(
                src,
                "model.embed_tokens.weight",
                &[c.vocab_size, c.hidden_size],
            )?;
            Ok(ops::embedding(ids, &table, self.dtype)?)
        })
    }

    /// Block `model.layers.{index}` on `x` (`[seq, hidden]`), appending the
    /// new positions' keys and values to `cache`.
    pub fn layer(
        &self,
        src: &dyn WeightSource,
        index: usize,
        x: &Tensor,
        cache: &mut LayerCache,
    ) -> Result<Tensor, Error> {
        let c = &self.config;
        let block = format!("model.layers.{index}");
        in_block(src, &block, || {
            let (h, i) = (c.hidden_size, c.intermediate_size);
            let Heads {
                heads,
                kv_heads,
                head_dim,
            } = c.heads;
            let attn = format!("{block}.self_attn");
            let mlp = format!("{block}.mlp");
            let input_norm = fetch(src, &format!("{block}.input_layernorm.weight"), &[h])?;
            let q_proj = Linear::load(
                src,
                &format!("{attn}.q_proj"),
                heads * head_dim,
                h,
                c.qkv_bias,
            )?;
            let k_proj = Linear::load(
                src,
                &format!("{attn}.k_proj"),
                kv_heads * head_dim,
                h,
                c.qkv_bias,
            )?;
            let v_proj = Linear::load(
                src,
                &format!("{attn}.v_proj"),
                kv_heads * head_dim,
                h,
                c.qkv_bias,
            )?;
            let o_proj = Linear::load(
                src,
                &format!("{attn}.o_proj"),
                h,
                heads * head_dim,
                c.o_bias,
            )?;

            let start = cache.len();
            let normed = ops::rms_norm(x, &input_norm, c.rms_norm_eps)?;
            let q = self.rope.apply(&q_proj.forward(&normed)?, start)?;
            let k = self.rope.apply(&k_proj.forward(&normed)?, start)?;
            cache.append(&k, &v_proj.forward(&normed)?)?;
            let attended = ops::attention(&q, cache, c.heads, c.mask())?;
            let x = ops::add(x, &o_proj.forward(&attended)?)?;

            let post_norm = fetch(
                src,
                &format!("{block}.post_attention_layernorm.weight"),
                &[h],
            )?;
            let gate = Linear::load(src, &format!("{mlp}.gate_proj"), i, h, c.mlp_bias)?;
            let up = Linear::load(src, &format!("{mlp}.up_proj"), i, h, c.mlp_bias)?;
            let down = Linear::load(src, &format!("{mlp}.down_proj"), h, i, c.mlp_bias)?;
            let normed = ops::rms_norm(&x, &post_norm, c.rms_norm_eps)?;
            let act = ops::mul(&ops::silu(&gate.forward(&normed)?)?, &up.forward(&normed)?)?;
            Ok(ops::add(&x, &down.forward(&act)?)?)
        })
    }

    /// Block `model.norm`.
    pub fn final_norm(&self, src: &dyn WeightSource, x: &Tensor) -> Result<Tensor, Error> {
        let c = &self.config;
        in_block(src, "model.norm", || {
            let w = fetch(src, "model.norm.weight", &[c.hidden_size])?;
            Ok(ops::rms_norm(x, &w, c.rms_norm_eps)?)
        })
    }

    /// Block `lm_head`: logits `[seq, vocab]`. With tied embeddings it reads
    /// `model.embed_tokens.weight`.
    pub fn lm_head(&self, src: &dyn WeightSource, x: &Tensor) -> Result<Tensor, Error> {
        let c = &self.config;
        in_block(src, "lm_head", || {
            let name = if c.tie_word_embeddings {
                "model.embed_tokens.weight"
            } else {
                "lm_head.weight"
            };
            let w = fetch(src, name, &[c.vocab_size, c.hidden_size])?;
            Ok(ops::linear(x, &w, None)?)
        })
    }

    /// Runs every block on `ids` (the positions after those in `cache`).
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
        let mut x = self.embed(src, ids)?;
        for (index, layer_cache) in cache.layers.iter_mut().enumerate() {
            x = self.layer(src, index, &x, layer_cache)?;
        }
        if logits == Logits::Last && ids.len() > 1 {
            x = x.rows(ids.len() - 1, ids.len())?;
        }
        let x = self.final_norm(src, &x)?;
        self.lm_head(src, &x)
    }

    /// Greedy decoding with the KV cache: the prompt in one forward pass,
    /// then one token per pass.
    pub fn generate(
        &self,
        src: &dyn WeightSource,
        prompt: &[u32],
        options: &GenerateOptions,
    ) -> Result<Generation, Error> {
        if prompt.is_empty() {
            return Err(Error::EmptyInput("prompt"));
        }
        let mut cache = self.new_cache();
        let mut tokens = Vec::with_capacity(options.max_new_tokens);
        let mut step_seconds = Vec::with_capacity(options.max_new_tokens);
        let mut prompt_logits = None;
        let mut input = prompt.to_vec();
        while tokens.len() < options.max_new_tokens {
            let started = Instant::now();
            let want = if options.keep_prompt_logits && prompt_logits.is_none() {
                Logits::All
            } else {
                Logits::Last
            };
            let logits = self.forward(src, &input, &mut cache, want)?;
            let rows = logits.shape()[0];
            let next = argmax(&logits.rows(rows - 1, rows)?.to_host()?.f32_values());
            if want == Logits::All {
                prompt_logits = Some(logits);
            }
            step_seconds.push(started.elapsed().as_secs_f64());
            tokens.push(next);
            if options.stop_tokens.contains(&next) {
                break;
            }
            input = vec![next];
        }
        Ok(Generation {
            tokens,
            prompt_logits,
            step_seconds,
        })
    }
}

/// First index of the largest value (as `torch.argmax`).
fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// How to generate.
#[derive(Clone, Debug, Default)]
pub struct GenerateOptions {
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
    /// Tokens that end generation (kept in the output), usually the config's
    /// `eos_token_id`; empty to always generate `max_new_tokens`.
    pub stop_tokens: Vec<u32>,
    /// Keep the prompt's full logits (`[prompt_len, vocab]`, F32 values in
    /// the compute dtype) from the first forward pass.
    pub keep_prompt_logits: bool,
}

/// What greedy generation produced.
#[derive(Debug)]
pub struct Generation {
    /// The new tokens (the prompt is not repeated).
    pub tokens: Vec<u32>,
    /// The first forward pass's logits, when asked for.
    pub prompt_logits: Option<Tensor>,
    /// Wall time of each forward pass; the first one is the prompt's.
    pub step_seconds: Vec<f64>,
}

/// A causal LM loaded from a Hugging Face folder: decoder, weights and,
/// when the folder has one, its tokenizer.
pub struct CausalLm {
    decoder: Decoder,
    weights: Box<dyn WeightSource + Send>,
    tokenizer: Option<TextTokenizer>,
    dir: PathBuf,
}

impl CausalLm {
    /// Opens `dir` (config.json, safetensors, optional tokenizer.json),
    /// computing in `dtype`, or in the embedding's stored dtype when `None`
    /// (transformers' `dtype="auto"`).
    pub fn open(dir: impl AsRef<Path>, dtype: Option<DType>) -> Result<CausalLm, Error> {
        let dir = dir.as_ref();
        let config = DecoderConfig::from_dir(dir)?;
        let probe = FolderWeights::open(dir, None)?;
        let dtype = match dtype {
            Some(d) => d,
            None => probe
                .meta("model.embed_tokens.weight")
                .map(|m| m.dtype)
                .filter(|d| bm_compute::is_compute_dtype(*d))
                .unwrap_or(DType::F32),
        };
        let weights = FolderWeights::open(dir, Some(dtype))?;
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
        Ok(CausalLm {
            decoder: Decoder::new(config, dtype)?,
            weights,
            tokenizer,
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

    /// Greedy generation from token ids.
    pub fn generate_ids(
        &self,
        prompt: &[u32],
        options: &GenerateOptions,
    ) -> Result<Generation, Error> {
        self.decoder
            .generate(self.weights.as_ref(), prompt, options)
    }

    /// Greedy generation from text: returns the generation and its new
    /// tokens decoded.
    pub fn generate_text(
        &self,
        prompt: &str,
        options: &GenerateOptions,
    ) -> Result<(Generation, String), Error> {
        let tokenizer = self.tokenizer.as_ref().ok_or_else(|| Error::NoTokenizer {
            dir: self.dir.clone(),
        })?;
        if prompt.is_empty() {
            return Err(Error::EmptyInput("prompt"));
        }
        let ids = tokenizer.encode(prompt, true)?;
        let generation = self.generate_ids(&ids, options)?;
        let text = tokenizer.decode(&generation.tokens)?;
        Ok((generation, text))
    }
}
