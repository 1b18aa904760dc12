//! The BERT encoder and sentence-transformers-style embeddings.

use std::path::{Path, PathBuf};

use bm_tensor::DType;

use bigmodel::plan::config::{Family, Float, HfConfig, MAX_POSITIONS};

use crate::config::{found, read_config, read_keys};
use crate::decoder::{fetch, fetch_linear, in_block};
use crate::ops::{self, Heads, LayerCache, Mask};
use crate::text::TextTokenizer;
use crate::weights::{FolderWeights, WeightLayout, WeightSource};
use crate::{Error, Tensor};

/// The encoder architectures this crate runs.
pub const SUPPORTED_ENCODERS: &str =
    "bert (BertModel, e.g. sentence-transformers/all-MiniLM-L6-v2)";

/// What a BERT `config.json` says.
#[derive(Clone, Debug, PartialEq)]
pub struct EncoderConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Encoder layers.
    pub num_layers: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Rows of the position table: the longest input.
    pub max_position_embeddings: usize,
    /// Rows of the token-type table.
    pub type_vocab_size: usize,
    /// LayerNorm epsilon.
    pub layer_norm_eps: f32,
}

impl EncoderConfig {
    /// Reads `dir/config.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<EncoderConfig, Error> {
        EncoderConfig::from_config(&read_config(dir.as_ref(), SUPPORTED_ENCODERS)?)
    }

    /// The encoder a config (read by bm-plan's config reader) describes.
    pub fn from_config(c: &HfConfig) -> Result<EncoderConfig, Error> {
        if c.family != Family::Bert {
            return Err(Error::UnsupportedArchitecture {
                found: found(c.family.model_type(), &c.architectures()?),
                supported: SUPPORTED_ENCODERS,
            });
        }
        let (activation, key) = &c.activation;
        if activation != "gelu" {
            return Err(c
                .error(key, format!("{activation:?} is not supported (only gelu)"))
                .into());
        }
        if let Some(kind) = c.keys.opt_str("position_embedding_type")?
            && kind != "absolute"
        {
            return Err(c
                .error(
                    "position_embedding_type",
                    format!("{kind:?} is not supported"),
                )
                .into());
        }
        let missing = |key: &str| c.error(key, "missing");
        Ok(EncoderConfig {
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            num_layers: c.num_layers,
            num_heads: c.heads,
            max_position_embeddings: c
                .max_positions
                .ok_or_else(|| missing("max_position_embeddings"))?,
            type_vocab_size: c
                .type_vocab_size
                .ok_or_else(|| missing("type_vocab_size"))?,
            layer_norm_eps: c
                .keys
                .opt_f64("layer_norm_eps", Float::Epsilon)?
                .unwrap_or(1e-12) as f32,
        })
    }
}

/// The BERT encoder: config only; blocks take weights at call time.
#[derive(Debug)]
pub struct Encoder {
    config: EncoderConfig,
    dtype: DType,
    prefix: String,
}

impl Encoder {
    /// An encoder computing in `dtype`. `prefix` is prepended to every
    /// module name: `""` for a `BertModel` checkpoint, `"bert."` for one
    /// saved from a task model.
    pub fn new(config: EncoderConfig, dtype: DType, prefix: &str) -> Result<Encoder, Error> {
        ops::check_compute_dtype("encoder compute dtype", dtype)?;
        Ok(Encoder {
            config,
            dtype,
            prefix: prefix.to_string(),
        })
    }

    /// The config.
    pub fn config(&self) -> &EncoderConfig {
        &self.config
    }

    /// Block names in execution order (`embeddings`, `encoder.layer.N`).
    pub fn block_names(&self) -> Vec<String> {
        let mut names = vec![format!("{}embeddings", self.prefix)];
        names.extend(
            (0..self.config.num_layers).map(|i| format!("{}encoder.layer.{i}", self.prefix)),
        );
        names
    }

    /// Block `embeddings`: word + position + token type 0, then LayerNorm.
    pub fn embed(&self, src: &dyn WeightSource, ids: &[u32]) -> Result<Tensor, Error> {
        let c = &self.config;
        if ids.len() > c.max_position_embeddings {
            return Err(Error::SequenceTooLong {
                len: ids.len(),
                max: c.max_position_embeddings,
            });
        }
        let block = format!("{}embeddings", self.prefix);
        in_block(src, &block, || {
            let h = c.hidden_size;
            let word = fetch(
                src,
                &format!("{block}.word_embeddings.weight"),
                &[c.vocab_size, h],
            )?;
            let pos = fetch(
                src,
                &format!("{block}.position_embeddings.weight"),
                &[c.max_position_embeddings, h],
            )?;
            let types = fetch(
                src,
                &format!("{block}.token_type_embeddings.weight"),
                &[c.type_vocab_size, h],
            )?;
            let ln_w = fetch(src, &format!("{block}.LayerNorm.weight"), &[h])?;
            let ln_b = fetch(src, &format!("{block}.LayerNorm.bias"), &[h])?;
            let positions: Vec<u32> = (0..ids.len() as u32).collect();
            let x = ops::add(
                &ops::embedding(ids, &word, self.dtype)?,
                &ops::embedding(&vec![0; ids.len()], &types, self.dtype)?,
            )?;
            let x = ops::add(&x, &ops::embedding(&positions, &pos, self.dtype)?)?;
            Ok(ops::layer_norm(&x, &ln_w, &ln_b, c.layer_norm_eps)?)
        })
    }

    /// Block `encoder.layer.{index}` on `x` (`[seq, hidden]`).
    pub fn layer(&self, src: &dyn WeightSource, index: usize, x: &Tensor) -> Result<Tensor, Error> {
        let c = &self.config;
        let block = format!("{}encoder.layer.{index}", self.prefix);
        in_block(src, &block, || {
            let (h, i) = (c.hidden_size, c.intermediate_size);
            let linear =
                |name: &str, out: usize, inp: usize, x: &Tensor| -> Result<Tensor, Error> {
                    let w = fetch_linear(
                        src,
                        &format!("{block}.{name}.weight"),
                        [out, inp],
                        WeightLayout::Linear,
                    )?;
                    let b = fetch(src, &format!("{block}.{name}.bias"), &[out])?;
                    w.forward(x, Some(&b))
                };
            let norm = |name: &str, x: &Tensor| -> Result<Tensor, Error> {
                let w = fetch(src, &format!("{block}.{name}.weight"), &[h])?;
                let b = fetch(src, &format!("{block}.{name}.bias"), &[h])?;
                Ok(ops::layer_norm(x, &w, &b, c.layer_norm_eps)?)
            };
            let q = linear("attention.self.query", h, h, x)?;
            let mut kv = LayerCache::new();
            kv.append(
                &linear("attention.self.key", h, h, x)?,
                &linear("attention.self.value", h, h, x)?,
            )?;
            let heads = Heads {
                heads: c.num_heads,
                kv_heads: c.num_heads,
                head_dim: h / c.num_heads,
            };
            let context = ops::attention(&q, &kv, heads, Mask::Bidirectional)?;
            let attended = linear("attention.output.dense", h, h, &context)?;
            let x = norm("attention.output.LayerNorm", &ops::add(&attended, x)?)?;
            let inner = ops::gelu(&linear("intermediate.dense", i, h, &x)?)?;
            let out = linear("output.dense", h, i, &inner)?;
            norm("output.LayerNorm", &ops::add(&out, &x)?)
        })
    }

    /// Every block on `ids`: the last hidden state `[ids.len(), hidden]`.
    pub fn forward(&self, src: &dyn WeightSource, ids: &[u32]) -> Result<Tensor, Error> {
        if ids.is_empty() {
            return Err(Error::EmptyInput("token sequence"));
        }
        let mut x = self.embed(src, ids)?;
        for index in 0..self.config.num_layers {
            x = self.layer(src, index, &x)?;
        }
        Ok(x)
    }
}

/// Sentence embeddings as sentence-transformers computes them for
/// all-MiniLM-L6-v2: BERT, mean pooling over the tokens, L2 normalisation.
pub struct SentenceEmbedder {
    encoder: Encoder,
    weights: Box<dyn WeightSource + Send>,
    tokenizer: TextTokenizer,
}

impl SentenceEmbedder {
    /// Opens a sentence-transformers or plain BERT folder (config.json,
    /// safetensors, tokenizer.json), computing in `dtype` or, when `None`,
    /// in the stored dtype of the word embeddings.
    pub fn open(dir: impl AsRef<Path>, dtype: Option<DType>) -> Result<SentenceEmbedder, Error> {
        let dir = dir.as_ref();
        let config = EncoderConfig::from_dir(dir)?;
        let probe = FolderWeights::open(dir, None)?;
        let prefix = probe.bert_prefix();
        let dtype = probe.load_dtype(Family::Bert, dtype);
        let weights = FolderWeights::open(dir, Some(dtype))?;
        SentenceEmbedder::with_weights(dir, config, dtype, prefix, Box::new(weights))
    }

    /// An embedder over weights supplied by the caller (an offloading
    /// source); `dir` gives the tokenizer and the sentence-transformers
    /// settings.
    pub fn with_weights(
        dir: impl AsRef<Path>,
        config: EncoderConfig,
        dtype: DType,
        prefix: &str,
        weights: Box<dyn WeightSource + Send>,
    ) -> Result<SentenceEmbedder, Error> {
        let dir = dir.as_ref();
        check_mean_pooling(dir)?;
        let max_len = max_seq_length(dir)?.unwrap_or(config.max_position_embeddings);
        let tokenizer =
            TextTokenizer::open_in(dir, Some(max_len.min(config.max_position_embeddings)))?
                .ok_or_else(|| Error::NoTokenizer {
                    dir: dir.to_path_buf(),
                })?;
        Ok(SentenceEmbedder {
            encoder: Encoder::new(config, dtype, prefix)?,
            weights,
            tokenizer,
        })
    }

    /// The encoder.
    pub fn encoder(&self) -> &Encoder {
        &self.encoder
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// One unit-length embedding per text.
    pub fn embed<S: AsRef<str>>(&self, texts: &[S]) -> Result<Vec<Vec<f32>>, Error> {
        if texts.is_empty() {
            return Err(Error::EmptyInput("list of texts"));
        }
        texts
            .iter()
            .map(|t| {
                let ids = self.tokenizer.encode(t.as_ref(), true)?;
                self.embed_ids(&ids)
            })
            .collect()
    }

    /// The embedding of one tokenised text.
    pub fn embed_ids(&self, ids: &[u32]) -> Result<Vec<f32>, Error> {
        let hidden = self.encoder.forward(self.weights.as_ref(), ids)?;
        Ok(ops::mean_pool_normalize(&hidden)?)
    }
}

/// `sentence_bert_config.json`'s `max_seq_length`, if the folder has one.
fn max_seq_length(dir: &Path) -> Result<Option<usize>, Error> {
    let path = dir.join("sentence_bert_config.json");
    if !bm_shard::exists(&path)? {
        return Ok(None);
    }
    Ok(read_keys(&path)?.opt_count("max_seq_length", MAX_POSITIONS)?)
}

/// Refuses a sentence-transformers folder whose pooling is not mean pooling.
fn check_mean_pooling(dir: &Path) -> Result<(), Error> {
    let path: PathBuf = dir.join("1_Pooling").join("config.json");
    if !bm_shard::exists(&path)? {
        return Ok(());
    }
    let keys = read_keys(&path)?;
    if keys.bool_or("pooling_mode_mean_tokens", false)? {
        Ok(())
    } else {
        Err(keys
            .error("pooling_mode_mean_tokens", "only mean pooling is supported")
            .into())
    }
}
