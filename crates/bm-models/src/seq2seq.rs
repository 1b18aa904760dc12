//! T5 (`T5ForConditionalGeneration`), the encoder–decoder family, one
//! block at a time: what its `config.json` means, the blocks (transformers'
//! module names, each between its source's `begin_block`/`end_block`, so
//! any device map runs it), and generation from `decoder_start_token_id`.
//!
//! What T5 does differently from the decoders in `decoder.rs`, as
//! transformers does it: positions enter as a bias on the attention scores,
//! looked up by relative-position bucket (bidirectional in the encoder,
//! causal in the decoder) in a table only block 0 of each stack holds and
//! the other blocks reuse; scores are not scaled (T5 folds the scale into
//! its weights); norms are RMS norms without bias; each decoder block also
//! attends over the encoder's output, whose keys and values it projects
//! once per prompt; and the decoder output is scaled by `d_model^-0.5`
//! before the head when `scale_decoder_outputs` says so.

use std::path::{Path, PathBuf};
use std::time::Instant;

use bigmodel::plan::config::{Family, Float, HfConfig};
use bm_tensor::DType;

use crate::config::{found, read_config};
use crate::decoder::{KvCache, fetch, fetch_linear, in_block};
use crate::family::Activation;
use crate::generation_config::start_token;
use crate::ops::{self, Heads, LayerCache, Mask, Scores};
use crate::sampling::Pcg32;
use crate::text::TextTokenizer;
use crate::weights::{FolderWeights, LinearWeight, WeightLayout, WeightSource};
use crate::{
    Backend, DecoderStart, Error, GenerateOptions, Generation, GenerationConfig,
    SUPPORTED_GENERATORS, Tensor,
};

/// The encoder–decoder architectures this crate runs.
pub const SUPPORTED_SEQ2SEQ: &str = "t5 (T5ForConditionalGeneration)";

/// The checkpoint name of the output head when it is not tied to `shared`.
const OWN_HEAD: &str = "lm_head.weight";

/// The shared token embedding (also the head's weight when tied).
pub(crate) const SHARED: &str = "shared.weight";

/// The module transformers keeps in F32 in an F16 T5 (see [`T5::kept_f32`]).
const KEPT_F32: &str = "wo";

/// What a T5 `config.json` says, in the terms the blocks use.
#[derive(Clone, Debug, PartialEq)]
pub struct T5Config {
    /// Vocabulary size (rows of `shared` and of the head).
    pub vocab_size: usize,
    /// Width of the residual stream (`d_model`).
    pub d_model: usize,
    /// Width of the feed-forward (`d_ff`).
    pub d_ff: usize,
    /// Encoder blocks (`num_layers`).
    pub encoder_layers: usize,
    /// Decoder blocks (`num_decoder_layers`).
    pub decoder_layers: usize,
    /// Attention geometry (`num_heads` of `d_kv`).
    pub heads: Heads,
    /// Buckets of the relative position bias.
    pub relative_buckets: usize,
    /// Distance from which relative positions share the last bucket.
    pub relative_max_distance: usize,
    /// `wo(act(wi_0 x) · wi_1 x)` (`gated-ACT`), else `wo(act(wi x))`.
    pub gated: bool,
    /// The feed-forward's activation.
    pub activation: Activation,
    /// Epsilon of every norm (`layer_norm_epsilon`).
    pub eps: f32,
    /// The decoder output is multiplied by `d_model^-0.5` before the head.
    pub scale_decoder_outputs: bool,
    /// The head is `shared` (`false` when the checkpoint has its own
    /// `lm_head.weight`, which transformers then keeps).
    pub tie_word_embeddings: bool,
    /// The decoder's first input token (see [`DecoderStart`]).
    pub decoder_start_token_id: u32,
    /// Tokens that end generation (`eos_token_id`).
    pub eos_token_ids: Vec<u32>,
}

impl T5Config {
    /// Reads `dir/config.json` and, for the first decoder token,
    /// `dir/generation_config.json` when the folder has one.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<T5Config, Error> {
        let dir = dir.as_ref();
        T5Config::from_folder(&read_config(dir, SUPPORTED_SEQ2SEQ)?, dir)
    }

    /// [`T5Config::from_config`] with folder `dir`'s generation config.
    pub fn from_folder(c: &HfConfig, dir: &Path) -> Result<T5Config, Error> {
        let generation = GenerationConfig::from_dir(dir, &c.keys.token_ids("eos_token_id")?)?;
        T5Config::from_config(c, &generation.decoder_start)
    }

    /// The model a config (read by bm-plan's config reader) describes, with
    /// the head tied to `shared` (see [`T5Config::tie_word_embeddings`]),
    /// starting the decoder from the token `start` says.
    pub fn from_config(c: &HfConfig, start: &DecoderStart) -> Result<T5Config, Error> {
        let (Family::T5, Some(s2s)) = (c.family, &c.seq2seq) else {
            return Err(Error::UnsupportedArchitecture {
                found: found(c.family.model_type(), &c.architectures()?),
                supported: SUPPORTED_SEQ2SEQ,
            });
        };
        let k = &c.keys;
        // Other heads on the T5 stack (an encoder alone, a classifier) have
        // other modules; only the language-model head is run here.
        if let Some(other) = c
            .architectures()?
            .into_iter()
            .find(|a| *a != "T5ForConditionalGeneration")
        {
            return Err(k
                .error(
                    "architectures",
                    format!("{other:?} is not supported (only T5ForConditionalGeneration)"),
                )
                .into());
        }
        // Half the buckets (of each direction, in the encoder) are exact
        // offsets, the rest logarithmic: fewer than 4 leaves no exact one.
        if s2s.relative_buckets < 4 {
            return Err(k
                .error(
                    "relative_attention_num_buckets",
                    format!("{} is fewer than 4", s2s.relative_buckets),
                )
                .into());
        }
        let start = decoder_start(c, start)?;
        Ok(T5Config {
            vocab_size: c.vocab_size,
            d_model: c.hidden_size,
            d_ff: c.intermediate_size,
            encoder_layers: c.num_layers,
            decoder_layers: s2s.decoder_layers,
            heads: Heads {
                heads: c.heads,
                kv_heads: c.kv_heads,
                head_dim: c.head_dim,
            },
            relative_buckets: s2s.relative_buckets,
            relative_max_distance: s2s.relative_max_distance,
            gated: s2s.gated,
            activation: Activation::of(c)?,
            eps: k
                .opt_f64("layer_norm_epsilon", Float::Epsilon)?
                .unwrap_or(1e-6) as f32,
            scale_decoder_outputs: s2s.scale_decoder_outputs,
            tie_word_embeddings: true,
            decoder_start_token_id: start,
            eos_token_ids: k.token_ids("eos_token_id")?,
        })
    }

    /// The head as `weights` hold it: its own `lm_head.weight` when the
    /// checkpoint has one (transformers keeps it rather than tie it), else
    /// `shared`. The one place this is decided, for running and planning.
    pub fn tie_to(mut self, weights: &FolderWeights) -> T5Config {
        self.tie_word_embeddings = !weights.contains(OWN_HEAD);
        self
    }
}

/// The decoder's first input token: generation_config.json's when the
/// folder has one, else config.json's (see [`DecoderStart`]); it must be
/// below `vocab_size`. Errors name the file that decided.
fn decoder_start(c: &HfConfig, start: &DecoderStart) -> Result<u32, Error> {
    const KEY: &str = "decoder_start_token_id";
    let (token, file) = match start {
        DecoderStart::ModelConfig => (start_token(&c.keys)?, None),
        DecoderStart::File { path, token } => (*token, Some(path)),
    };
    let error = |message: String| -> Error {
        match file {
            None => c.keys.error(KEY, message).into(),
            Some(path) => Error::Config {
                path: path.clone(),
                key: KEY.into(),
                message,
            },
        }
    };
    let Some(token) = token else {
        let missing = "missing (and no bos_token_id): generation starts the decoder from it \
                       (T5 uses the pad token, usually 0)";
        return Err(error(match file {
            None => missing.into(),
            Some(_) => format!(
                "{missing}; transformers reads it from this file when the folder has one, \
                 not from config.json"
            ),
        }));
    };
    if token as usize >= c.vocab_size {
        return Err(error(format!(
            "{token} is not below vocab_size {}",
            c.vocab_size
        )));
    }
    Ok(token)
}

/// The two stacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stack {
    Encoder,
    Decoder,
}

impl Stack {
    fn name(self) -> &'static str {
        match self {
            Stack::Encoder => "encoder",
            Stack::Decoder => "decoder",
        }
    }
}

/// T5's relative position bucket of `key - query` (transformers'
/// `_relative_position_bucket`, in f32 as torch computes it): exact
/// buckets for small distances, logarithmic ones up to `max_distance`,
/// then the last; the encoder's buckets are split by direction, the
/// decoder's only see the past.
fn relative_bucket(
    relative: i64,
    bidirectional: bool,
    buckets: usize,
    max_distance: usize,
) -> usize {
    let mut n = buckets as i64;
    let mut bucket = 0;
    let distance = if bidirectional {
        n /= 2;
        if relative > 0 {
            bucket += n;
        }
        relative.abs()
    } else {
        (-relative).max(0)
    };
    let max_exact = n / 2;
    if distance < max_exact {
        return (bucket + distance) as usize;
    }
    let log_ratio = (max_distance as f64 / max_exact as f64).ln() as f32;
    let large = max_exact
        + ((distance as f32 / max_exact as f32).ln() / log_ratio * (n - max_exact) as f32) as i64;
    (bucket + large.min(n - 1)) as usize
}

/// T5: config only; every block takes its weights at call time.
#[derive(Debug)]
pub struct T5 {
    config: T5Config,
    dtype: DType,
}

/// One prompt's decoding state: the encoder's output, each decoder block's
/// self-attention cache (growing by a position per step) and its
/// cross-attention keys and values over the encoder output (projected by
/// the first step, then reused).
#[derive(Debug)]
pub struct Seq2SeqCache {
    encoded: Tensor,
    self_attention: KvCache,
    cross_attention: KvCache,
}

impl Seq2SeqCache {
    /// Decoder positions cached so far.
    pub fn len(&self) -> usize {
        self.self_attention.len()
    }

    /// True before the first decoder step.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the caches hold.
    pub fn bytes(&self) -> usize {
        self.self_attention.bytes() + self.cross_attention.bytes()
    }
}

impl T5 {
    /// A model computing in `dtype` (F32, F16 or BF16).
    pub fn new(config: T5Config, dtype: DType) -> Result<T5, Error> {
        ops::check_compute_dtype("T5 compute dtype", dtype)?;
        Ok(T5 { config, dtype })
    }

    /// The config.
    pub fn config(&self) -> &T5Config {
        &self.config
    }

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The modules T5 computes in F32 when it computes in `dtype`:
    /// transformers keeps the feed-forward output `wo` in F32 when it loads
    /// T5 in F16 (`_keep_in_fp32_modules`, against F16 overflow; F16 alone:
    /// T5 has no `_keep_in_fp32_modules_strict`, so BF16 keeps none).
    pub fn kept_f32(dtype: DType) -> Vec<String> {
        match dtype {
            DType::F16 => vec![KEPT_F32.to_string()],
            _ => Vec::new(),
        }
    }

    /// Block names in execution order, as transformers names the modules.
    pub fn block_names(&self) -> Vec<String> {
        let c = &self.config;
        let mut names = Vec::new();
        for (stack, layers) in [
            (Stack::Encoder, c.encoder_layers),
            (Stack::Decoder, c.decoder_layers),
        ] {
            let s = stack.name();
            names.push(format!("{s}.embed_tokens"));
            names.extend((0..layers).map(|i| format!("{s}.block.{i}")));
            names.push(format!("{s}.final_layer_norm"));
        }
        names.push("lm_head".into());
        names
    }

    /// Block `{stack}.embed_tokens`: the rows of `shared` (tied to it).
    fn embed(&self, src: &dyn WeightSource, stack: Stack, ids: &[u32]) -> Result<Tensor, Error> {
        let c = &self.config;
        in_block(src, &format!("{}.embed_tokens", stack.name()), || {
            let table = fetch(src, SHARED, &[c.vocab_size, c.d_model])?;
            Ok(ops::embedding(ids, &table, self.dtype)?)
        })
    }

    /// T5's layer norm (an RMS norm, no mean, no bias) of module `module`,
    /// in the weight's dtype when that is a half type (transformers'
    /// `T5LayerNorm`: an F32 residual stream, see [`T5::feed_forward`],
    /// goes back to F16 here).
    fn norm(&self, src: &dyn WeightSource, module: &str, x: &Tensor) -> Result<Tensor, Error> {
        let weight = fetch(src, &format!("{module}.weight"), &[self.config.d_model])?;
        let normed = ops::rms_norm(x, &weight, self.config.eps)?;
        match weight.dtype() {
            DType::F16 | DType::BF16 if normed.dtype() != weight.dtype() => {
                Ok(normed.to_dtype(weight.dtype())?)
            }
            _ => Ok(normed),
        }
    }

    /// Linear layer `module` (no bias) on `x`.
    fn linear(
        &self,
        src: &dyn WeightSource,
        module: &str,
        [out, inp]: [usize; 2],
        x: &Tensor,
    ) -> Result<Tensor, Error> {
        fetch_linear(
            src,
            &format!("{module}.weight"),
            [out, inp],
            WeightLayout::Linear,
        )?
        .forward(x, None)
    }

    /// The relative position bias of `queries` positions starting at
    /// `past` over keys `0..past + queries`, from block 0's table, as
    /// [`ops::attention_biased`] takes it: per head, one value per relative
    /// position `key - query` from `-(keys - 1)` to `queries - 1`.
    fn position_bias(
        &self,
        src: &dyn WeightSource,
        attention: &str,
        stack: Stack,
        (past, queries): (usize, usize),
    ) -> Result<Tensor, Error> {
        let c = &self.config;
        let heads = c.heads.heads;
        let table = fetch(
            src,
            &format!("{attention}.relative_attention_bias.weight"),
            &[c.relative_buckets, heads],
        )?
        .to_host()?
        .to_f32_vec();
        let keys = past + queries;
        let span = keys + queries - 1;
        let mut bias = vec![0f32; heads * span];
        for index in 0..span {
            let relative = index as i64 - (keys as i64 - 1);
            let bucket = relative_bucket(
                relative,
                stack == Stack::Encoder,
                c.relative_buckets,
                c.relative_max_distance,
            );
            for h in 0..heads {
                bias[h * span + index] = table[bucket * heads + h];
            }
        }
        Ok(Tensor::from_f32(self.dtype, &[heads, span], &bias)?)
    }

    /// Sub-layer 0 of a block: self-attention over `layer_cache` (the new
    /// positions' keys and values appended first) with the stack's
    /// position `bias` (computed by the first block that runs, block 0,
    /// which holds the table), residual added. On a GPU the bias is moved
    /// there once, in F32 as the attention kernel reads it, and the later
    /// blocks of the forward pass use that copy (again only when a block
    /// runs on another GPU).
    fn self_attention(
        &self,
        src: &dyn WeightSource,
        (stack, block): (Stack, &str),
        x: &Tensor,
        bias: &mut Option<Tensor>,
        layer_cache: &mut LayerCache,
    ) -> Result<Tensor, Error> {
        let c = &self.config;
        let (d, inner) = (c.d_model, c.heads.heads * c.heads.head_dim);
        let attention = format!("{block}.layer.0.SelfAttention");
        let normed = self.norm(src, &format!("{block}.layer.0.layer_norm"), x)?;
        let project =
            |name: &str| self.linear(src, &format!("{attention}.{name}"), [inner, d], &normed);
        let q = project("q")?;
        let past = layer_cache.len();
        layer_cache.append(&project("k")?, &project("v")?)?;
        let bias = match bias {
            Some(b) => b,
            None => {
                let queries = q.shape()[0];
                bias.insert(self.position_bias(src, &attention, stack, (past, queries))?)
            }
        };
        if let (Backend::Cuda(_), Some(gpu)) = (q.backend(), src.execution_gpu())
            && bias.backend() != q.backend()
        {
            *bias = bias.to_dtype(DType::F32)?.to_gpu(&gpu)?;
        }
        let mask = match stack {
            Stack::Encoder => Mask::Bidirectional,
            Stack::Decoder => Mask::Causal,
        };
        let attended = ops::attention_biased(&q, layer_cache, c.heads, (mask, UNSCALED), bias)?;
        let out = self.linear(src, &format!("{attention}.o"), [d, inner], &attended)?;
        Ok(ops::add(x, &out)?)
    }

    /// Sub-layer 1 of a decoder block: attention over the encoder output
    /// (`encoded`), whose keys and values the first step projects into
    /// `layer_cache`; residual added.
    fn cross_attention(
        &self,
        src: &dyn WeightSource,
        block: &str,
        x: &Tensor,
        encoded: &Tensor,
        layer_cache: &mut LayerCache,
    ) -> Result<Tensor, Error> {
        let c = &self.config;
        let (d, inner) = (c.d_model, c.heads.heads * c.heads.head_dim);
        let attention = format!("{block}.layer.1.EncDecAttention");
        let normed = self.norm(src, &format!("{block}.layer.1.layer_norm"), x)?;
        let project = |name: &str, input: &Tensor| {
            self.linear(src, &format!("{attention}.{name}"), [inner, d], input)
        };
        let q = project("q", &normed)?;
        if layer_cache.is_empty() {
            layer_cache.append(&project("k", encoded)?, &project("v", encoded)?)?;
        }
        let attended =
            ops::attention_with(&q, layer_cache, c.heads, Mask::Bidirectional, UNSCALED)?;
        let out = self.linear(src, &format!("{attention}.o"), [d, inner], &attended)?;
        Ok(ops::add(x, &out)?)
    }

    /// The feed-forward sub-layer `{block}.layer.{sub}`, residual added.
    /// A `wo` kept in F32 ([`T5::kept_f32`]) takes its input in F32, and
    /// its F32 output widens the residual sum to F32, as torch promotes
    /// F16 + F32 (the residual stream then stays F32; the norms bring each
    /// sub-layer's input back to F16).
    fn feed_forward(
        &self,
        src: &dyn WeightSource,
        block: &str,
        sub: usize,
        x: &Tensor,
    ) -> Result<Tensor, Error> {
        let c = &self.config;
        let (d, ff) = (c.d_model, c.d_ff);
        let layer = format!("{block}.layer.{sub}");
        let normed = self.norm(src, &format!("{layer}.layer_norm"), x)?;
        let dense = format!("{layer}.DenseReluDense");
        let wi = |name: &str| self.linear(src, &format!("{dense}.{name}"), [ff, d], &normed);
        let hidden = if c.gated {
            ops::mul(&c.activation.apply(&wi("wi_0")?)?, &wi("wi_1")?)?
        } else {
            c.activation.apply(&wi("wi")?)?
        };
        let wo = fetch_linear(
            src,
            &format!("{dense}.wo.weight"),
            [d, ff],
            WeightLayout::Linear,
        )?;
        let out = match &wo {
            LinearWeight::Dense(w) if w.dtype() != hidden.dtype() => {
                wo.forward(&hidden.to_dtype(w.dtype())?, None)?
            }
            _ => wo.forward(&hidden, None)?,
        };
        if out.dtype() == x.dtype() {
            Ok(ops::add(x, &out)?)
        } else {
            Ok(ops::add(
                &x.to_dtype(DType::F32)?,
                &out.to_dtype(DType::F32)?,
            )?)
        }
    }

    /// A stack's final norm block.
    fn final_norm(
        &self,
        src: &dyn WeightSource,
        stack: Stack,
        x: &Tensor,
    ) -> Result<Tensor, Error> {
        let block = format!("{}.final_layer_norm", stack.name());
        in_block(src, &block, || self.norm(src, &block, x))
    }

    /// The encoder on `ids`: its output `[ids.len(), d_model]`, what every
    /// decoder step attends over.
    pub fn encode(&self, src: &dyn WeightSource, ids: &[u32]) -> Result<Tensor, Error> {
        if ids.is_empty() {
            return Err(Error::EmptyInput("encoder input"));
        }
        let mut x = self.embed(src, Stack::Encoder, ids)?;
        let mut bias = None;
        for index in 0..self.config.encoder_layers {
            let block = format!("encoder.block.{index}");
            x = in_block(src, &block, || {
                let mut layer_cache = LayerCache::new();
                let x = self.self_attention(
                    src,
                    (Stack::Encoder, &block),
                    &x,
                    &mut bias,
                    &mut layer_cache,
                )?;
                self.feed_forward(src, &block, 1, &x)
            })?;
        }
        self.final_norm(src, Stack::Encoder, &x)
    }

    /// A decoding state over the encoder output `encoded`.
    pub fn new_cache(&self, encoded: Tensor) -> Seq2SeqCache {
        let layers = self.config.decoder_layers;
        Seq2SeqCache {
            encoded,
            self_attention: KvCache::with_layers(layers),
            cross_attention: KvCache::with_layers(layers),
        }
    }

    /// The decoder on the next positions `ids` of `cache`: logits
    /// `[ids.len(), vocab]`.
    pub fn decode(
        &self,
        src: &dyn WeightSource,
        ids: &[u32],
        cache: &mut Seq2SeqCache,
    ) -> Result<Tensor, Error> {
        if ids.is_empty() {
            return Err(Error::EmptyInput("decoder input"));
        }
        let mut x = self.embed(src, Stack::Decoder, ids)?;
        let mut bias = None;
        for index in 0..self.config.decoder_layers {
            let block = format!("decoder.block.{index}");
            x = in_block(src, &block, || {
                let x = self.self_attention(
                    src,
                    (Stack::Decoder, &block),
                    &x,
                    &mut bias,
                    cache.self_attention.layer_mut(index),
                )?;
                let x = self.cross_attention(
                    src,
                    &block,
                    &x,
                    &cache.encoded,
                    cache.cross_attention.layer_mut(index),
                )?;
                if let Some(gpu) = src.execution_gpu() {
                    cache.self_attention.charge(index, &gpu)?;
                    cache.cross_attention.charge(index, &gpu)?;
                }
                self.feed_forward(src, &block, 2, &x)
            })?;
        }
        let x = self.final_norm(src, Stack::Decoder, &x)?;
        self.lm_head(src, &x)
    }

    /// Block `lm_head`: the decoder output, scaled by `d_model^-0.5` where
    /// the config says so, times the head (`shared` when tied).
    fn lm_head(&self, src: &dyn WeightSource, x: &Tensor) -> Result<Tensor, Error> {
        let c = &self.config;
        in_block(src, "lm_head", || {
            let scaled;
            let x = match c.scale_decoder_outputs {
                true => {
                    scaled = ops::scale(x, (c.d_model as f64).powf(-0.5) as f32)?;
                    &scaled
                }
                false => x,
            };
            let name = if c.tie_word_embeddings {
                SHARED
            } else {
                OWN_HEAD
            };
            let w = fetch_linear(src, name, [c.vocab_size, c.d_model], WeightLayout::Linear)?;
            w.forward(x, None)
        })
    }

    /// Greedy (or sampled, as `options.sampling` says) generation for one
    /// encoder input: the encoder once, then the decoder one token per
    /// step from `decoder_start_token_id`, until a stop token or
    /// `max_new_tokens`. With `keep_prompt_logits` the first decoder
    /// step's logits (`[1, vocab]`) are kept. The repetition penalty sees
    /// the decoder's tokens, as transformers' does for encoder–decoders.
    pub fn generate(
        &self,
        src: &dyn WeightSource,
        prompt: &[u32],
        options: &GenerateOptions,
        on_token: &mut dyn FnMut(u32),
    ) -> Result<Generation, Error> {
        options.sampling.check()?;
        if options.max_new_tokens == 0 {
            return Err(Error::BadGenerateOption {
                option: "max_new_tokens",
                message: "must be at least 1".into(),
            });
        }
        let started = Instant::now();
        let encoded = self.encode(src, prompt)?;
        let mut cache = self.new_cache(encoded);
        let mut rng = Pcg32::new(options.sampling.seed, options.first_stream);
        let mut history = vec![self.config.decoder_start_token_id];
        let mut out = Generation {
            tokens: Vec::new(),
            prompt_logits: None,
            step_seconds: Vec::new(),
            capped_to: None,
        };
        let mut step_started = started;
        loop {
            let last = history[history.len() - 1];
            let logits = self.decode(src, &[last], &mut cache)?;
            if options.keep_prompt_logits && out.prompt_logits.is_none() {
                out.prompt_logits = Some(logits.to_host()?);
            }
            let mut row = logits.to_host()?.to_f32_vec();
            let token = options.sampling.choose(&mut row, &history, &mut rng);
            history.push(token);
            out.tokens.push(token);
            on_token(token);
            out.step_seconds.push(step_started.elapsed().as_secs_f64());
            step_started = Instant::now();
            if options.stop_tokens.contains(&token) || out.tokens.len() >= options.max_new_tokens {
                return Ok(out);
            }
        }
    }
}

/// Scores as T5 forms them: `q · k` unscaled.
const UNSCALED: Scores = Scores {
    scale: 1.0,
    softcap: None,
};

/// A T5 model loaded from a Hugging Face folder: the model, its weights,
/// generation defaults and, when the folder has one, its tokenizer.
pub struct Seq2SeqLm {
    t5: T5,
    weights: Box<dyn WeightSource + Send>,
    tokenizer: Option<TextTokenizer>,
    generation: GenerationConfig,
    dir: PathBuf,
}

impl Seq2SeqLm {
    /// Opens `dir` (config.json, safetensors, optional tokenizer.json),
    /// computing in `dtype`, or in the stored dtype of `shared` when `None`.
    pub fn open(dir: impl AsRef<Path>, dtype: Option<DType>) -> Result<Seq2SeqLm, Error> {
        let dir = dir.as_ref();
        let probe = FolderWeights::open(dir, None)?;
        let config = T5Config::from_dir(dir)?.tie_to(&probe);
        let dtype = probe.load_dtype(Family::T5, dtype);
        let weights = FolderWeights::open(dir, Some(dtype))?.keeping_f32(T5::kept_f32(dtype));
        Seq2SeqLm::with_weights(dir, config, dtype, Box::new(weights))
    }

    /// A model over weights supplied by the caller (an offloading source).
    pub fn with_weights(
        dir: impl AsRef<Path>,
        config: T5Config,
        dtype: DType,
        weights: Box<dyn WeightSource + Send>,
    ) -> Result<Seq2SeqLm, Error> {
        let dir = dir.as_ref().to_path_buf();
        let tokenizer = TextTokenizer::open_in(&dir, None)?;
        let generation = GenerationConfig::from_dir(&dir, &config.eos_token_ids)?;
        Ok(Seq2SeqLm {
            t5: T5::new(config, dtype)?,
            weights,
            tokenizer,
            generation,
            dir,
        })
    }

    /// The model.
    pub fn model(&self) -> &T5 {
        &self.t5
    }

    /// The weights it reads.
    pub fn weights(&self) -> &dyn WeightSource {
        self.weights.as_ref()
    }

    /// The tokenizer, if the folder has one.
    pub fn tokenizer(&self) -> Option<&TextTokenizer> {
        self.tokenizer.as_ref()
    }

    /// The folder's generation defaults (`generation_config.json`).
    pub fn generation_config(&self) -> &GenerationConfig {
        &self.generation
    }

    /// Generation from the encoder input `prompt` (see [`T5::generate`]).
    pub fn generate_ids(
        &self,
        prompt: &[u32],
        options: &GenerateOptions,
        on_token: &mut dyn FnMut(u32),
    ) -> Result<Generation, Error> {
        self.t5
            .generate(self.weights.as_ref(), prompt, options, on_token)
    }

    /// Token ids of `text`, with the special tokens the tokenizer adds
    /// (T5's `</s>`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, Error> {
        if text.is_empty() {
            return Err(Error::EmptyInput("prompt"));
        }
        self.text_tokenizer()?.encode(text, true)
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, Error> {
        self.text_tokenizer()?.decode(ids)
    }

    fn text_tokenizer(&self) -> Result<&TextTokenizer, Error> {
        self.tokenizer.as_ref().ok_or_else(|| Error::NoTokenizer {
            dir: self.dir.clone(),
        })
    }
}

/// Whether `dir` holds an encoder–decoder (T5) rather than a causal LM;
/// any other family is an unsupported-architecture error listing every
/// family that generates text.
pub fn is_seq2seq(dir: impl AsRef<Path>) -> Result<bool, Error> {
    let c = read_config(dir.as_ref(), SUPPORTED_GENERATORS)?;
    match c.family {
        Family::T5 => Ok(true),
        f if f.is_causal_lm() => Ok(false),
        f => Err(Error::UnsupportedArchitecture {
            found: found(f.model_type(), &c.architectures()?),
            supported: SUPPORTED_GENERATORS,
        }),
    }
}

/// The stored dtype of `shared` (transformers' `dtype="auto"`), F32 when
/// that is not a compute dtype.
#[cfg(test)]
mod tests {
    use super::*;
    use bigmodel::plan::config::ConfigKeys;
    use serde_json::json;

    #[test]
    fn buckets_match_transformers() {
        // transformers' _relative_position_bucket for key - query in
        // -200..=200 (32 buckets, max distance 128), sampled.
        let bidirectional = [
            (-200, 15),
            (-128, 15),
            (-100, 15),
            (-50, 13),
            (-20, 10),
            (-9, 8),
            (-8, 8),
            (-7, 7),
            (-1, 1),
            (0, 0),
            (1, 17),
            (7, 23),
            (8, 24),
            (20, 26),
            (50, 29),
            (127, 31),
            (200, 31),
        ];
        for (relative, want) in bidirectional {
            assert_eq!(relative_bucket(relative, true, 32, 128), want, "{relative}");
        }
        let causal = [
            (-200, 31),
            (-100, 30),
            (-50, 24),
            (-16, 16),
            (-15, 15),
            (-1, 1),
            (0, 0),
            (5, 0),
        ];
        for (relative, want) in causal {
            assert_eq!(
                relative_bucket(relative, false, 32, 128),
                want,
                "{relative}"
            );
        }
    }

    fn t5(extra: serde_json::Value) -> Result<T5Config, Error> {
        let mut c = json!({
            "model_type": "t5", "vocab_size": 32, "d_model": 16, "d_kv": 4, "d_ff": 24,
            "num_layers": 2, "num_heads": 2, "decoder_start_token_id": 0,
        });
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        T5Config::from_config(
            &HfConfig::from_value(c, "t5/config.json").unwrap(),
            &DecoderStart::ModelConfig,
        )
    }

    /// transformers 5.23's first decoder token (checked with its
    /// `generate` on tiny-t5 edited each way): generation_config.json
    /// decides when the folder has one, config.json only when it has none;
    /// in each, `decoder_start_token_id`, else `bos_token_id`.
    #[test]
    fn the_first_decoder_token_follows_transformers_precedence() {
        let start = |config: serde_json::Value, file: Option<serde_json::Value>| {
            let mut c = json!({
                "model_type": "t5", "vocab_size": 32, "d_model": 16, "d_kv": 4, "d_ff": 24,
                "num_layers": 2, "num_heads": 2,
            });
            for (k, v) in config.as_object().unwrap() {
                c[k] = v.clone();
            }
            let c = HfConfig::from_value(c, "t5/config.json").unwrap();
            let generation = match file {
                None => GenerationConfig::defaults(&[]),
                Some(file) => {
                    let keys = ConfigKeys::from_value(file, "t5/generation_config.json").unwrap();
                    GenerationConfig::from_keys(&keys, GenerationConfig::defaults(&[])).unwrap()
                }
            };
            T5Config::from_config(&c, &generation.decoder_start)
                .map(|c| c.decoder_start_token_id)
                .map_err(|e| e.to_string())
        };
        let none = json!({});
        let config_start = json!({"decoder_start_token_id": 3});
        assert_eq!(
            start(none.clone(), Some(json!({"decoder_start_token_id": 7}))),
            Ok(7)
        );
        assert_eq!(start(none.clone(), Some(json!({"bos_token_id": 5}))), Ok(5));
        assert_eq!(
            start(config_start.clone(), Some(json!({"bos_token_id": 5}))),
            Ok(5)
        );
        assert_eq!(
            start(
                config_start.clone(),
                Some(json!({"decoder_start_token_id": 7, "bos_token_id": 5}))
            ),
            Ok(7)
        );
        assert_eq!(start(json!({"bos_token_id": 4}), None), Ok(4));
        assert_eq!(
            start(
                json!({"decoder_start_token_id": 3, "bos_token_id": 4}),
                None
            ),
            Ok(3)
        );
        // A generation_config.json naming neither: config.json's token is
        // not used, and the error says so.
        for file in [
            json!({"eos_token_id": 1}),
            json!({"decoder_start_token_id": null}),
        ] {
            let err = start(config_start.clone(), Some(file)).unwrap_err();
            assert!(
                err.starts_with(
                    "t5/generation_config.json: key \"decoder_start_token_id\": missing"
                ) && err.contains("not from config.json"),
                "{err}"
            );
        }
        let err = start(none, None).unwrap_err();
        assert!(
            err.starts_with("t5/config.json: key \"decoder_start_token_id\": missing"),
            "{err}"
        );
        let err = start(config_start, Some(json!({"decoder_start_token_id": 32}))).unwrap_err();
        assert!(
            err.starts_with("t5/generation_config.json")
                && err.contains("32 is not below vocab_size 32"),
            "{err}"
        );
    }

    #[test]
    fn config_reads_t5_keys_and_names_what_it_refuses() {
        let c = t5(json!({"feed_forward_proj": "gated-gelu", "eos_token_id": 1})).unwrap();
        assert!(c.gated && c.activation == Activation::GeluTanh);
        assert_eq!(
            (c.decoder_start_token_id, c.eos_token_ids.clone()),
            (0, vec![1])
        );
        assert_eq!(
            (c.encoder_layers, c.decoder_layers, c.heads.head_dim),
            (2, 2, 4)
        );
        let c = t5(json!({"num_decoder_layers": 1})).unwrap();
        assert!(!c.gated && c.activation == Activation::Relu && c.decoder_layers == 1);

        let err = t5(json!({"decoder_start_token_id": null}))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("t5/config.json") && err.contains("\"decoder_start_token_id\": missing"),
            "{err}"
        );
        // transformers' fallback.
        let c = t5(json!({"decoder_start_token_id": null, "bos_token_id": 3})).unwrap();
        assert_eq!(c.decoder_start_token_id, 3);
        let err = t5(json!({"decoder_start_token_id": 32}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("not below vocab_size 32"), "{err}");
        let err = t5(json!({"feed_forward_proj": "gated-quick_gelu"}))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"feed_forward_proj\"") && err.contains("\"quick_gelu\""),
            "{err}"
        );
        let err = t5(json!({"architectures": ["T5EncoderModel"]}))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"architectures\"") && err.contains("\"T5EncoderModel\""),
            "{err}"
        );
        let err = t5(json!({"relative_attention_num_buckets": 2}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"relative_attention_num_buckets\""), "{err}");
        let llama = HfConfig::from_value(
            json!({"model_type": "llama", "vocab_size": 8, "hidden_size": 8,
                   "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}),
            "config.json",
        )
        .unwrap();
        let err = T5Config::from_config(&llama, &DecoderStart::ModelConfig)
            .unwrap_err()
            .to_string();
        assert!(err.contains("supported are t5"), "{err}");
    }
}
