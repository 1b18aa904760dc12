//! The one reader of Hugging Face `config.json` files, for planning and for
//! running models alike. Pure: it parses JSON text the caller read, and
//! every error names the file and the key.
//!
//! [`HfConfig`] is the typed part every consumer needs: the family, the
//! sizes (each checked positive and sane, so a `num_hidden_layers` of 10^12
//! is an error, not an allocation) and the per-family decisions that used
//! to be made twice (which keys a family uses, default ties, biases,
//! activations, head sizes, rotary dimensions). What only one consumer
//! reads (rope scaling, sliding windows, norms' epsilons) it reads through
//! [`HfConfig::keys`], with the same validation. A new family adds its
//! `model_type`, its key names and its defaults in [`HfConfig::from_value`].

use std::path::{Path, PathBuf};

use bm_tensor::DType;
use serde_json::{Map, Value};

use crate::Error;

/// Most layers a config may declare.
pub const MAX_LAYERS: usize = 10_000;
/// Most attention heads (or key/value heads, or experts) a config may declare.
pub const MAX_HEADS: usize = 10_000;
/// Widest hidden, intermediate or head size a config may declare.
pub const MAX_WIDTH: usize = 1 << 22;
/// Largest vocabulary a config may declare.
pub const MAX_VOCAB: usize = 1 << 24;
/// Longest context (positions, windows) a config may declare.
pub const MAX_POSITIONS: usize = 1 << 27;

/// f32's largest finite value, the bound of the numbers that become f32.
const F32_MAX: f64 = f32::MAX as f64;

/// The range a float key of a config may hold. Every float getter of
/// [`ConfigKeys`] takes one, so no scale, factor or epsilon reaches a
/// shape, a loop or a kernel unchecked: each range lies inside f32's and
/// leaves out what would divide by zero, overflow or take the root of a
/// negative number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Float {
    /// A norm's epsilon (`rms_norm_eps`, `layer_norm_eps`): 0 to 1.
    Epsilon,
    /// A share of a size (`partial_rotary_factor`): above 0, at most 1.
    Fraction,
    /// A multiplier or divisor of activations or frequencies (soft caps,
    /// a query scalar, rope scaling and attention factors): 10^-6 to 10^6.
    Scale,
    /// The base of the rotary frequencies (`rope_theta`): 1 to f32's
    /// largest (below 1 the frequencies grow with the dimension and
    /// overflow).
    Base,
    /// A threshold compared with activations (`llm_int8_threshold`): 0 to
    /// f32's largest.
    NonNegative,
    /// A setting its consumer checks further (sampling settings): any f32.
    Finite,
}

impl Float {
    /// Whether `v` is in the range.
    pub fn admits(self, v: f64) -> bool {
        match self {
            Float::Epsilon => (0.0..=1.0).contains(&v),
            Float::Fraction => v > 0.0 && v <= 1.0,
            Float::Scale => (1e-6..=1e6).contains(&v),
            Float::Base => (1.0..=F32_MAX).contains(&v),
            Float::NonNegative => (0.0..=F32_MAX).contains(&v),
            Float::Finite => v.abs() <= F32_MAX,
        }
    }

    /// The range in words, for errors.
    fn describe(self) -> &'static str {
        match self {
            Float::Epsilon => "from 0 to 1",
            Float::Fraction => "above 0 and at most 1",
            Float::Scale => "from 1e-6 to 1e6",
            Float::Base => "from 1 to 3.4e38 (f32's largest)",
            Float::NonNegative => "from 0 to 3.4e38 (f32's largest)",
            Float::Finite => "within f32's range (±3.4e38)",
        }
    }
}

/// The model families understood.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `LlamaForCausalLM`.
    Llama,
    /// `MistralForCausalLM`.
    Mistral,
    /// `Qwen2ForCausalLM`.
    Qwen2,
    /// `Qwen3ForCausalLM`.
    Qwen3,
    /// `Gemma2ForCausalLM`.
    Gemma2,
    /// `Phi3ForCausalLM`.
    Phi3,
    /// `GPT2LMHeadModel`.
    Gpt2,
    /// `BertModel`.
    Bert,
    /// `MixtralForCausalLM` (mixture of experts).
    Mixtral,
    /// `Qwen2MoeForCausalLM` (mixture of experts with a shared expert).
    Qwen2Moe,
    /// `Qwen3MoeForCausalLM` (mixture of experts, q/k norms).
    Qwen3Moe,
    /// `T5ForConditionalGeneration` (encoder–decoder).
    T5,
}

impl Family {
    /// The config.json key of the number of layers (GPT-2's `n_layer`).
    pub fn layers_key(self) -> &'static str {
        match self {
            Family::Gpt2 => "n_layer",
            Family::T5 => "num_layers",
            _ => "num_hidden_layers",
        }
    }

    /// Every family, with its `model_type`.
    pub const ALL: [(Family, &'static str); 12] = [
        (Family::Llama, "llama"),
        (Family::Mistral, "mistral"),
        (Family::Qwen2, "qwen2"),
        (Family::Qwen3, "qwen3"),
        (Family::Gemma2, "gemma2"),
        (Family::Phi3, "phi3"),
        (Family::Gpt2, "gpt2"),
        (Family::Bert, "bert"),
        (Family::Mixtral, "mixtral"),
        (Family::Qwen2Moe, "qwen2_moe"),
        (Family::Qwen3Moe, "qwen3_moe"),
        (Family::T5, "t5"),
    ];

    /// The family of a `model_type`.
    pub fn from_model_type(model_type: &str) -> Option<Family> {
        Family::ALL
            .iter()
            .find(|(_, name)| *name == model_type)
            .map(|(f, _)| *f)
    }

    /// Its `model_type`.
    pub fn model_type(self) -> &'static str {
        Family::ALL
            .iter()
            .find(|(f, _)| *f == self)
            .map_or("", |(_, name)| name)
    }

    /// True for the families with rotary position embeddings (Llama and
    /// its descendants).
    pub fn is_rotary(self) -> bool {
        !matches!(self, Family::Gpt2 | Family::Bert | Family::T5)
    }

    /// True for the decoder-only causal language models: every family but
    /// BERT (an encoder) and T5 (an encoder–decoder).
    pub fn is_causal_lm(self) -> bool {
        !matches!(self, Family::Bert | Family::T5)
    }

    /// True for the mixture-of-experts families.
    pub fn is_moe(self) -> bool {
        matches!(self, Family::Mixtral | Family::Qwen2Moe | Family::Qwen3Moe)
    }
}

/// A JSON object read key by key: values of the wrong type, and counts or
/// sizes that are not positive or beyond sanity, are errors naming the
/// file and the key (dotted for a nested object). A `null` value reads as
/// an absent one, except where a method says otherwise.
#[derive(Clone, Debug)]
pub struct ConfigKeys {
    file: PathBuf,
    prefix: String,
    object: Map<String, Value>,
}

impl ConfigKeys {
    /// Parses `text`, which must hold a JSON object; `file` names it in errors.
    pub fn parse(text: &str, file: impl Into<PathBuf>) -> Result<ConfigKeys, Error> {
        let file = file.into();
        let value = serde_json::from_str(text).map_err(|e| Error::Config {
            file: file.clone(),
            key: String::new(),
            message: format!("invalid JSON: {e}"),
        })?;
        ConfigKeys::from_value(value, file)
    }

    /// The keys of an already parsed `value`, which must be an object.
    pub fn from_value(value: Value, file: impl Into<PathBuf>) -> Result<ConfigKeys, Error> {
        let file = file.into();
        match value {
            Value::Object(object) => Ok(ConfigKeys {
                file,
                prefix: String::new(),
                object,
            }),
            _ => Err(Error::Config {
                file,
                key: String::new(),
                message: "expected a JSON object".into(),
            }),
        }
    }

    /// The file the keys come from.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// An error about `key` of this object.
    pub fn error(&self, key: &str, message: impl Into<String>) -> Error {
        Error::Config {
            file: self.file.clone(),
            key: format!("{}{key}", self.prefix),
            message: message.into(),
        }
    }

    /// The value of `key`; `None` when it is absent or `null`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.object.get(key).filter(|v| !v.is_null())
    }

    /// True when `key` is present (even as `null`).
    pub fn contains(&self, key: &str) -> bool {
        self.object.contains_key(key)
    }

    /// The object under `key` (e.g. `rope_parameters`), whose errors name
    /// `key.inner`.
    pub fn nested(&self, key: &str) -> Result<Option<ConfigKeys>, Error> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(object)) => Ok(Some(ConfigKeys {
                file: self.file.clone(),
                prefix: format!("{}{key}.", self.prefix),
                object: object.clone(),
            })),
            Some(v) => Err(self.error(key, format!("expected an object, found {v}"))),
        }
    }

    /// A count or size: a positive integer of at most `max`.
    pub fn count(&self, key: &str, max: usize) -> Result<usize, Error> {
        self.opt_count(key, max)?
            .ok_or_else(|| self.error(key, "missing"))
    }

    /// [`ConfigKeys::count`], `None` when absent.
    pub fn opt_count(&self, key: &str, max: usize) -> Result<Option<usize>, Error> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        match v.as_u64() {
            Some(n) if n > 0 && n <= max as u64 => Ok(Some(n as usize)),
            Some(n) if n > 0 => Err(self.error(key, format!("{n} is more than the {max} allowed"))),
            _ => Err(self.error(key, format!("expected a positive integer, found {v}"))),
        }
    }

    /// A count whose absence means `default` and whose `null` means none
    /// (transformers' `int | None = default` fields).
    pub fn nullable_count(
        &self,
        key: &str,
        default: Option<usize>,
        max: usize,
    ) -> Result<Option<usize>, Error> {
        match self.object.get(key) {
            None => Ok(default),
            Some(_) => self.opt_count(key, max),
        }
    }

    /// A number in `range`, `None` when absent.
    pub fn opt_f64(&self, key: &str, range: Float) -> Result<Option<f64>, Error> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                let n = v
                    .as_f64()
                    .ok_or_else(|| self.error(key, format!("expected a number, found {v}")))?;
                self.in_range(key, n, range).map(Some)
            }
        }
    }

    /// A number in `range` whose absence means `default` and whose `null`
    /// means none (transformers' `float | None = default` fields).
    pub fn nullable_f64(
        &self,
        key: &str,
        default: Option<f64>,
        range: Float,
    ) -> Result<Option<f64>, Error> {
        match self.object.get(key) {
            None => Ok(default),
            Some(Value::Null) => Ok(None),
            Some(v) => {
                let n = v.as_f64().ok_or_else(|| {
                    self.error(key, format!("expected a number or null, found {v}"))
                })?;
                self.in_range(key, n, range).map(Some)
            }
        }
    }

    /// A list of numbers, each in `range`, `None` when absent.
    pub fn opt_f64s(&self, key: &str, range: Float) -> Result<Option<Vec<f64>>, Error> {
        let Some(values) = self.opt_list(key, "numbers", Value::as_f64)? else {
            return Ok(None);
        };
        for (i, &v) in values.iter().enumerate() {
            if !range.admits(v) {
                return Err(self.error(
                    key,
                    format!(
                        "item {i}: {v} is out of range (expected a number {})",
                        range.describe()
                    ),
                ));
            }
        }
        Ok(Some(values))
    }

    /// `n` of `key` if `range` admits it, else an error naming the range.
    fn in_range(&self, key: &str, n: f64, range: Float) -> Result<f64, Error> {
        match range.admits(n) {
            true => Ok(n),
            false => Err(self.error(
                key,
                format!(
                    "{n} is out of range (expected a number {})",
                    range.describe()
                ),
            )),
        }
    }

    /// A list whose every item `item` reads (a list of `what`), `None` when
    /// absent.
    fn opt_list<'a, T>(
        &'a self,
        key: &str,
        what: &str,
        item: impl Fn(&'a Value) -> Option<T>,
    ) -> Result<Option<Vec<T>>, Error> {
        let bad = |v: &Value| self.error(key, format!("expected a list of {what}, found {v}"));
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| item(v).ok_or_else(|| bad(v)))
                .collect::<Result<_, _>>()
                .map(Some),
            Some(v) => Err(bad(v)),
        }
    }

    /// A string, `None` when absent.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, Error> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.error(key, format!("expected a string, found {v}"))),
        }
    }

    /// A list of strings, `None` when absent.
    pub fn opt_strings(&self, key: &str) -> Result<Option<Vec<&str>>, Error> {
        self.opt_list(key, "strings", Value::as_str)
    }

    /// A list of indices, each below `bound` (e.g. layer numbers), `None`
    /// when absent.
    pub fn opt_indices(&self, key: &str, bound: usize) -> Result<Option<Vec<usize>>, Error> {
        let bad = |v: &Value| {
            self.error(
                key,
                format!("expected a list of integers below {bound}, found {v}"),
            )
        };
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v.as_u64() {
                    Some(n) if n < bound as u64 => Ok(n as usize),
                    _ => Err(bad(v)),
                })
                .collect::<Result<_, _>>()
                .map(Some),
            Some(v) => Err(bad(v)),
        }
    }

    /// `true` or `false`, `default` when absent.
    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool, Error> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.error(key, format!("expected true or false, found {v}"))),
        }
    }

    /// Token ids given as one integer or a list of them; empty when absent.
    pub fn token_ids(&self, key: &str) -> Result<Vec<u32>, Error> {
        let bad = |v: &Value| self.error(key, format!("expected a token id or a list, found {v}"));
        let id = |v: &Value| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| bad(v))
        };
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items.iter().map(id).collect(),
            Some(v) => id(v).map(|n| vec![n]),
        }
    }
}

/// A model's `config.json`: its family, its sizes and the decisions every
/// consumer shares, checked once.
#[derive(Clone, Debug)]
pub struct HfConfig {
    /// Every key, for what only one consumer reads.
    pub keys: ConfigKeys,
    /// The family (`model_type`).
    pub family: Family,
    /// Rows of the token embedding.
    pub vocab_size: usize,
    /// Width of the residual stream (`hidden_size`, GPT-2's `n_embd`).
    pub hidden_size: usize,
    /// Width of the MLP (`intermediate_size`, GPT-2's `n_inner`, default
    /// four times the hidden size).
    pub intermediate_size: usize,
    /// Layers (`num_hidden_layers`, GPT-2's `n_layer`).
    pub num_layers: usize,
    /// Attention heads (`num_attention_heads`, GPT-2's `n_head`).
    pub heads: usize,
    /// Key/value heads (`num_key_value_heads`, default `heads`); divides `heads`.
    pub kv_heads: usize,
    /// Width of one head (`head_dim`, default `hidden_size / heads`,
    /// which must then divide evenly).
    pub head_dim: usize,
    /// Rows of a learned position table (GPT-2's `n_positions`, BERT's
    /// `max_position_embeddings`, default 512); `None` for rotary families.
    pub max_positions: Option<usize>,
    /// Rows of BERT's token-type table (`type_vocab_size`, default 2).
    pub type_vocab_size: Option<usize>,
    /// Dimensions of each head that rotate (even; fewer than `head_dim`
    /// only for Phi-3's `partial_rotary_factor`); `None` without rotary.
    pub rotary_dim: Option<usize>,
    /// Biases on the query, key and value projections.
    pub qkv_bias: bool,
    /// Bias on the attention output projection.
    pub o_bias: bool,
    /// Biases on the MLP projections (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// The output head shares the token embedding (`tie_word_embeddings`;
    /// by default Gemma 2 and GPT-2 tie, the others do not).
    pub tie_word_embeddings: bool,
    /// The MLP activation's name, and the key it was read from.
    pub activation: (String, &'static str),
    /// The mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE).
    pub moe: Option<MoeConfig>,
    /// The encoder–decoder settings (T5).
    pub seq2seq: Option<Seq2SeqConfig>,
}

/// The experts of a mixture-of-experts family, as its config says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeConfig {
    /// Experts per sparse layer (`num_local_experts`; Qwen's `num_experts`).
    pub experts: usize,
    /// Experts each token is routed to (`num_experts_per_tok`), at most
    /// `experts`.
    pub top_k: usize,
    /// Width of one expert's MLP (Mixtral's `intermediate_size`, Qwen's
    /// `moe_intermediate_size`).
    pub expert_intermediate_size: usize,
    /// Width of Qwen2-MoE's sigmoid-gated shared expert
    /// (`shared_expert_intermediate_size`); `None` for the other families.
    pub shared_expert_intermediate_size: Option<usize>,
    /// The top-k routing weights are divided by their sum (Qwen's
    /// `norm_topk_prob`; Mixtral always does).
    pub norm_topk_prob: bool,
    /// Per layer: a sparse (experts) MLP, or a dense one of
    /// `intermediate_size` (Qwen's `mlp_only_layers` and
    /// `decoder_sparse_step`; every Mixtral layer is sparse).
    pub sparse_layers: Vec<bool>,
}

/// T5's encoder–decoder settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seq2SeqConfig {
    /// Decoder layers (`num_decoder_layers`, default the encoder's
    /// `num_layers`).
    pub decoder_layers: usize,
    /// Buckets of the relative position bias
    /// (`relative_attention_num_buckets`).
    pub relative_buckets: usize,
    /// Distance from which relative positions share the last bucket
    /// (`relative_attention_max_distance`).
    pub relative_max_distance: usize,
    /// The feed-forward is gated (`feed_forward_proj` is `gated-ACT`):
    /// `wo(act(wi_0 x) · wi_1 x)`, else `wo(act(wi x))`.
    pub gated: bool,
    /// The decoder output is multiplied by `d_model^-0.5` before the head
    /// (`scale_decoder_outputs`; configs older than transformers 5 say so
    /// with `tie_word_embeddings`, absent meaning true).
    pub scale_decoder_outputs: bool,
}

impl HfConfig {
    /// Parses config JSON text; `file` names it in errors.
    pub fn parse(text: &str, file: impl Into<PathBuf>) -> Result<HfConfig, Error> {
        HfConfig::from_keys(ConfigKeys::parse(text, file)?)
    }

    /// Reads an already parsed config; `file` names it in errors.
    pub fn from_value(value: Value, file: impl Into<PathBuf>) -> Result<HfConfig, Error> {
        HfConfig::from_keys(ConfigKeys::from_value(value, file)?)
    }

    fn from_keys(keys: ConfigKeys) -> Result<HfConfig, Error> {
        use Family::*;
        let model_type = keys.opt_str("model_type")?;
        let Some(family) = model_type.and_then(Family::from_model_type) else {
            return Err(Error::UnsupportedModel {
                file: keys.file().to_path_buf(),
                model_type: model_type.map(str::to_string),
                architectures: keys
                    .opt_strings("architectures")?
                    .map_or_else(Vec::new, |a| a.into_iter().map(str::to_string).collect()),
            });
        };
        let (hidden_key, heads_key) = match family {
            Gpt2 => ("n_embd", "n_head"),
            T5 => ("d_model", "num_heads"),
            _ => ("hidden_size", "num_attention_heads"),
        };
        let vocab_size = keys.count("vocab_size", MAX_VOCAB)?;
        let hidden_size = keys.count(hidden_key, MAX_WIDTH)?;
        let num_layers = keys.count(family.layers_key(), MAX_LAYERS)?;
        let heads = keys.count(heads_key, MAX_HEADS)?;
        let intermediate_size = match family {
            Gpt2 => keys
                .opt_count("n_inner", MAX_WIDTH)?
                .unwrap_or(4 * hidden_size),
            T5 => keys.count("d_ff", MAX_WIDTH)?,
            _ => keys.count("intermediate_size", MAX_WIDTH)?,
        };
        let rotary = family.is_rotary();
        let kv_heads = match rotary {
            true => keys
                .opt_count("num_key_value_heads", MAX_HEADS)?
                .unwrap_or(heads),
            false => heads,
        };
        if heads % kv_heads != 0 {
            return Err(keys.error(
                "num_key_value_heads",
                format!("{kv_heads} does not divide {heads_key} {heads}"),
            ));
        }
        let given_head_dim = match family {
            // T5's heads are d_kv wide whatever d_model is.
            T5 => Some(keys.count("d_kv", MAX_WIDTH)?),
            _ if rotary => keys.opt_count("head_dim", MAX_WIDTH)?,
            _ => None,
        };
        let head_dim = match given_head_dim {
            Some(d) => d,
            None if hidden_size % heads == 0 => hidden_size / heads,
            None => {
                return Err(keys.error(
                    hidden_key,
                    format!("{hidden_size} is not a multiple of {heads_key} {heads}"),
                ));
            }
        };
        if rotary && head_dim % 2 != 0 {
            return Err(keys.error("head_dim", format!("{head_dim} is odd; rotary needs pairs")));
        }
        let max_positions = match family {
            Gpt2 => Some(keys.count("n_positions", MAX_POSITIONS)?),
            Bert => Some(
                keys.opt_count("max_position_embeddings", MAX_POSITIONS)?
                    .unwrap_or(512),
            ),
            _ => None,
        };
        let type_vocab_size = match family {
            Bert => Some(keys.opt_count("type_vocab_size", MAX_VOCAB)?.unwrap_or(2)),
            _ => None,
        };
        let rotary_dim = match family {
            Gpt2 | Bert | T5 => None,
            // Only Phi-3's rotary embedding reads the partial factor
            // (transformers' Llama, Qwen and Gemma rotate the whole head);
            // the others' is checked all the same.
            _ => {
                let factor = partial_rotary_factor(&keys)?;
                match family {
                    Phi3 => Some(partial_rotary_dim(&keys, head_dim, factor)?),
                    _ => Some(head_dim),
                }
            }
        };
        let attention_bias = keys.bool_or("attention_bias", false)?;
        let (qkv_bias, o_bias) = match family {
            Mistral | Phi3 | Mixtral | T5 => (false, false),
            Qwen2 => (true, false),
            Qwen2Moe => (keys.bool_or("qkv_bias", true)?, false),
            Gpt2 | Bert => (true, true),
            _ => (attention_bias, attention_bias),
        };
        let mlp_bias = match family {
            Llama => keys.bool_or("mlp_bias", false)?,
            Gpt2 | Bert => true,
            _ => false,
        };
        let tie_word_embeddings = match family {
            Bert => false,
            // transformers 5 always ties T5's head to `shared` (a checkpoint
            // with its own lm_head keeps it: the caller unties those).
            T5 => true,
            _ => keys.bool_or("tie_word_embeddings", matches!(family, Gemma2 | Gpt2))?,
        };
        let seq2seq = match family {
            T5 => Some(seq2seq(&keys, num_layers)?),
            _ => None,
        };
        let (activation_key, default_activation) = match family {
            Gpt2 => ("activation_function", "gelu_new"),
            T5 => ("feed_forward_proj", "relu"),
            // Gemma 2 names it hidden_activation; older configs hidden_act.
            Gemma2 if keys.get("hidden_activation").is_some() => {
                ("hidden_activation", "gelu_pytorch_tanh")
            }
            Gemma2 => ("hidden_act", "gelu_pytorch_tanh"),
            Bert => ("hidden_act", "gelu"),
            _ => ("hidden_act", "silu"),
        };
        let activation = keys
            .opt_str(activation_key)?
            .unwrap_or(default_activation)
            .to_string();
        let activation = match family {
            T5 => t5_activation(&keys, &activation)?,
            _ => activation,
        };
        let moe = match family.is_moe() {
            true => Some(moe(&keys, family, num_layers, intermediate_size)?),
            false => None,
        };
        Ok(HfConfig {
            family,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_layers,
            heads,
            kv_heads,
            head_dim,
            max_positions,
            type_vocab_size,
            rotary_dim,
            qkv_bias,
            o_bias,
            mlp_bias,
            tie_word_embeddings,
            activation: (activation, activation_key),
            moe,
            seq2seq,
            keys,
        })
    }

    /// The file the config was read from.
    pub fn file(&self) -> &Path {
        self.keys.file()
    }

    /// An error about `key`.
    pub fn error(&self, key: &str, message: impl Into<String>) -> Error {
        self.keys.error(key, message)
    }

    /// The dtype the weights are stored in (`dtype`, older configs'
    /// `torch_dtype`; default F32); a float type.
    pub fn dtype(&self) -> Result<DType, Error> {
        let key = if self.keys.get("dtype").is_some() {
            "dtype"
        } else {
            "torch_dtype"
        };
        let name = self.keys.opt_str(key)?.unwrap_or("float32");
        DType::from_torch_str(name)
            .filter(|d| d.is_float())
            .ok_or_else(|| self.error(key, format!("unsupported dtype {name:?}")))
    }

    /// The `architectures` the config names.
    pub fn architectures(&self) -> Result<Vec<&str>, Error> {
        Ok(self.keys.opt_strings("architectures")?.unwrap_or_default())
    }
}

/// The experts of a MoE family, with transformers' keys and defaults.
fn moe(
    keys: &ConfigKeys,
    family: Family,
    layers: usize,
    intermediate_size: usize,
) -> Result<MoeConfig, Error> {
    let experts_key = match family {
        Family::Mixtral => "num_local_experts",
        // Hub configs say num_experts; transformers 5 saves Qwen3-MoE's as
        // num_local_experts (its attribute map), Qwen2-MoE's as num_experts.
        _ if keys.get("num_experts").is_some() => "num_experts",
        _ if keys.get("num_local_experts").is_some() => "num_local_experts",
        _ => "num_experts",
    };
    let experts = keys.count(experts_key, MAX_HEADS)?;
    let top_k = keys.count("num_experts_per_tok", MAX_HEADS)?;
    if top_k > experts {
        return Err(keys.error(
            "num_experts_per_tok",
            format!("{top_k} is more than the {experts} experts ({experts_key})"),
        ));
    }
    if family == Family::Mixtral {
        return Ok(MoeConfig {
            experts,
            top_k,
            expert_intermediate_size: intermediate_size,
            shared_expert_intermediate_size: None,
            norm_topk_prob: true,
            sparse_layers: vec![true; layers],
        });
    }
    let dense = keys
        .opt_indices("mlp_only_layers", layers)?
        .unwrap_or_default();
    let step = keys
        .opt_count("decoder_sparse_step", MAX_LAYERS)?
        .unwrap_or(1);
    let shared = match family {
        Family::Qwen2Moe => Some(keys.count("shared_expert_intermediate_size", MAX_WIDTH)?),
        _ => None,
    };
    Ok(MoeConfig {
        experts,
        top_k,
        expert_intermediate_size: keys.count("moe_intermediate_size", MAX_WIDTH)?,
        shared_expert_intermediate_size: shared,
        norm_topk_prob: keys.bool_or("norm_topk_prob", false)?,
        sparse_layers: (0..layers)
            .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
            .collect(),
    })
}

/// T5's encoder–decoder keys, with transformers' defaults.
fn seq2seq(keys: &ConfigKeys, encoder_layers: usize) -> Result<Seq2SeqConfig, Error> {
    let proj = keys.opt_str("feed_forward_proj")?.unwrap_or("relu");
    let scale_decoder_outputs = match keys.get("scale_decoder_outputs") {
        Some(_) => keys.bool_or("scale_decoder_outputs", true)?,
        None => keys.bool_or("tie_word_embeddings", true)?,
    };
    let relative_buckets = keys
        .opt_count("relative_attention_num_buckets", MAX_POSITIONS)?
        .unwrap_or(32);
    let relative_max_distance = keys
        .opt_count("relative_attention_max_distance", MAX_POSITIONS)?
        .unwrap_or(128);
    // Offsets below half the buckets (the decoder's exact ones) map one to
    // one; the rest spread logarithmically up to the maximum distance,
    // which must lie beyond them (else the logarithm's range is empty or
    // negative, and the buckets computed from it out of the table).
    if relative_max_distance <= relative_buckets / 2 {
        return Err(keys.error(
            "relative_attention_max_distance",
            format!(
                "{relative_max_distance} is not beyond the {} exact offsets of \
                 relative_attention_num_buckets {relative_buckets} (it must be more than half of it)",
                relative_buckets / 2
            ),
        ));
    }
    Ok(Seq2SeqConfig {
        decoder_layers: keys
            .opt_count("num_decoder_layers", MAX_LAYERS)?
            .unwrap_or(encoder_layers),
        relative_buckets,
        relative_max_distance,
        gated: proj.starts_with("gated-"),
        scale_decoder_outputs,
    })
}

/// The activation T5's `feed_forward_proj` (`ACT` or `gated-ACT`) names;
/// `gated-gelu` means the tanh GELU, as transformers keeps it for
/// compatibility.
fn t5_activation(keys: &ConfigKeys, proj: &str) -> Result<String, Error> {
    let parts: Vec<&str> = proj.split('-').collect();
    match parts.as_slice() {
        ["gated", "gelu"] => Ok("gelu_new".into()),
        ["gated", act] | [act] if !act.is_empty() && *act != "gated" => Ok(act.to_string()),
        _ => Err(keys.error(
            "feed_forward_proj",
            format!("{proj:?} is not of the form ACT or gated-ACT (e.g. relu, gated-gelu)"),
        )),
    }
}

/// `partial_rotary_factor` and the key that gave it: in `rope_parameters`,
/// else at the top level; both checked in (0, 1] where present, so a
/// shadowed top-level value is no less checked than the one in effect.
fn partial_rotary_factor(keys: &ConfigKeys) -> Result<Option<(f64, String)>, Error> {
    const KEY: &str = "partial_rotary_factor";
    let top = keys.opt_f64(KEY, Float::Fraction)?;
    let nested = match keys.nested("rope_parameters")? {
        Some(p) => p.opt_f64(KEY, Float::Fraction)?,
        None => None,
    };
    Ok(match (nested, top) {
        (Some(f), _) => Some((f, format!("rope_parameters.{KEY}"))),
        (None, Some(f)) => Some((f, KEY.to_string())),
        (None, None) => None,
    })
}

/// Phi-3's rotated dimensions: `factor` (default 1) of the head, an even
/// number of at least two.
fn partial_rotary_dim(
    keys: &ConfigKeys,
    head_dim: usize,
    factor: Option<(f64, String)>,
) -> Result<usize, Error> {
    let Some((factor, key)) = factor else {
        return Ok(head_dim);
    };
    // At most head_dim, since the factor is at most 1.
    let dim = (head_dim as f64 * factor) as usize;
    if dim == 0 || !dim.is_multiple_of(2) {
        return Err(keys.error(
            &key,
            format!("{factor} of head_dim {head_dim} is not an even number of dimensions"),
        ));
    }
    Ok(dim)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<HfConfig, Error> {
        HfConfig::from_value(v, "m/config.json")
    }

    fn llama(extra: Value) -> Value {
        let mut c = json!({
            "model_type": "llama", "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
        });
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    }

    #[test]
    fn counts_and_sizes_are_positive_and_sane() {
        let c = parse(llama(json!({}))).unwrap();
        assert_eq!((c.heads, c.kv_heads, c.head_dim), (4, 4, 4));
        assert_eq!(c.rotary_dim, Some(4));
        for (key, value, wanted) in [
            (
                "num_hidden_layers",
                json!(0),
                "expected a positive integer, found 0",
            ),
            (
                "num_hidden_layers",
                json!(1_000_000_000_000u64),
                "more than the 10000 allowed",
            ),
            (
                "vocab_size",
                json!(-3),
                "expected a positive integer, found -3",
            ),
            ("hidden_size", json!(16.5), "expected a positive integer"),
            (
                "intermediate_size",
                json!("24"),
                "expected a positive integer",
            ),
            (
                "num_key_value_heads",
                json!(3),
                "3 does not divide num_attention_heads 4",
            ),
            ("head_dim", json!(5), "5 is odd"),
        ] {
            let err = parse(llama(json!({ key: value }))).unwrap_err().to_string();
            assert!(
                err.starts_with(&format!("m/config.json: key \"{key}\": ")) && err.contains(wanted),
                "{key}={value}: {err}"
            );
        }
        let err = parse(llama(json!({"hidden_size": 18})))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("18 is not a multiple of num_attention_heads 4"),
            "{err}"
        );
    }

    #[test]
    fn families_decide_their_keys_and_defaults_once() {
        let gpt2 = parse(json!({
            "model_type": "gpt2", "vocab_size": 8, "n_embd": 8, "n_layer": 1, "n_head": 2,
            "n_positions": 16,
        }))
        .unwrap();
        assert_eq!(gpt2.intermediate_size, 32);
        assert_eq!(gpt2.max_positions, Some(16));
        assert!(gpt2.tie_word_embeddings && gpt2.rotary_dim.is_none());
        assert_eq!(gpt2.activation, ("gelu_new".into(), "activation_function"));
        let gemma = parse(llama(
            json!({"model_type": "gemma2", "hidden_activation": "gelu"}),
        ))
        .unwrap();
        assert!(gemma.tie_word_embeddings);
        assert_eq!(gemma.activation, ("gelu".into(), "hidden_activation"));
        let phi3 = parse(llama(
            json!({"model_type": "phi3", "partial_rotary_factor": 0.5}),
        ))
        .unwrap();
        assert_eq!(phi3.rotary_dim, Some(2));
        let err = parse(llama(
            json!({"model_type": "phi3", "partial_rotary_factor": 0.1}),
        ))
        .unwrap_err();
        assert!(err.to_string().contains("not an even number"), "{err}");
        let bert = parse(json!({
            "model_type": "bert", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 8,
        }))
        .unwrap();
        assert_eq!(
            (bert.max_positions, bert.type_vocab_size),
            (Some(512), Some(2))
        );
    }

    #[test]
    fn partial_rotary_factors_are_checked_wherever_they_are() {
        let phi3 = |extra: Value| {
            let mut c = llama(extra);
            c["model_type"] = json!("phi3");
            parse(c)
        };
        // In effect, shadowed by rope_parameters, or unused (Llama): each
        // value is checked, and the error names the key that holds it.
        for (config, key) in [
            (
                phi3(json!({"partial_rotary_factor": 1e30})),
                "\"partial_rotary_factor\"",
            ),
            (
                phi3(json!({"partial_rotary_factor": 1e30,
                            "rope_parameters": {"partial_rotary_factor": 0.5}})),
                "\"partial_rotary_factor\"",
            ),
            (
                phi3(json!({"rope_parameters": {"partial_rotary_factor": -0.5}})),
                "\"rope_parameters.partial_rotary_factor\"",
            ),
            (
                parse(llama(json!({"partial_rotary_factor": 1e30}))),
                "\"partial_rotary_factor\"",
            ),
            (
                parse(llama(json!({"partial_rotary_factor": 0}))),
                "\"partial_rotary_factor\"",
            ),
        ] {
            let err = config.unwrap_err().to_string();
            assert!(
                err.contains(&format!("key {key}: "))
                    && err.contains("out of range (expected a number above 0 and at most 1)"),
                "{err}"
            );
        }
        let c = phi3(json!({"partial_rotary_factor": 1.0,
                            "rope_parameters": {"partial_rotary_factor": 0.5}}))
        .unwrap();
        assert_eq!(c.rotary_dim, Some(2));
        let err = phi3(json!({"rope_parameters": {"partial_rotary_factor": 0.75}})).unwrap_err();
        assert!(
            err.to_string()
                .contains("key \"rope_parameters.partial_rotary_factor\": 0.75 of head_dim 4"),
            "{err}"
        );
        // GPT-2 has no rotary embedding: the key is not its.
        let gpt2 = parse(json!({
            "model_type": "gpt2", "vocab_size": 8, "n_embd": 8, "n_layer": 1, "n_head": 2,
            "n_positions": 16, "partial_rotary_factor": 1e30,
        }));
        assert!(gpt2.is_ok());
    }

    #[test]
    fn float_ranges_stay_inside_f32_and_away_from_zero_divisors() {
        let keys = ConfigKeys::from_value(
            json!({"eps": 0.0, "big": 1e39, "neg": -1.0, "tiny": 1e-7, "one": 1.0,
                   "list": [1.0, 0.0], "cap": null}),
            "c.json",
        )
        .unwrap();
        assert_eq!(keys.opt_f64("eps", Float::Epsilon).unwrap(), Some(0.0));
        assert_eq!(keys.opt_f64("one", Float::Base).unwrap(), Some(1.0));
        assert_eq!(keys.opt_f64("absent", Float::Scale).unwrap(), None);
        for (key, range) in [
            ("big", Float::Finite),
            ("big", Float::Base),
            ("big", Float::NonNegative),
            ("neg", Float::Epsilon),
            ("neg", Float::NonNegative),
            ("eps", Float::Fraction),
            ("eps", Float::Scale),
            ("tiny", Float::Scale),
            ("tiny", Float::Base),
        ] {
            let err = keys.opt_f64(key, range).unwrap_err().to_string();
            assert!(
                err.starts_with(&format!("c.json: key \"{key}\": "))
                    && err.contains("out of range"),
                "{key} {range:?}: {err}"
            );
        }
        let err = keys.opt_f64s("list", Float::Scale).unwrap_err().to_string();
        assert!(
            err.contains("key \"list\": item 1: 0 is out of range"),
            "{err}"
        );
        assert_eq!(
            keys.nullable_f64("cap", Some(3.0), Float::Scale).unwrap(),
            None
        );
        assert_eq!(
            keys.nullable_f64("absent", Some(3.0), Float::Scale)
                .unwrap(),
            Some(3.0)
        );
        let err = keys
            .nullable_f64("eps", Some(3.0), Float::Scale)
            .unwrap_err();
        assert!(
            err.to_string().contains("key \"eps\": 0 is out of range"),
            "{err}"
        );
    }

    #[test]
    fn moe_families_read_their_experts_and_sparse_layers() {
        let mixtral = parse(llama(json!({
            "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
        })))
        .unwrap();
        let moe = mixtral.moe.unwrap();
        assert_eq!(
            (moe.experts, moe.top_k, moe.expert_intermediate_size),
            (8, 2, 24)
        );
        assert!(moe.norm_topk_prob && moe.sparse_layers == [true, true]);
        let qwen2 = |extra: Value| {
            let mut c = llama(json!({
                "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 12, "shared_expert_intermediate_size": 20,
                "num_hidden_layers": 4,
            }));
            for (k, v) in extra.as_object().unwrap() {
                c[k] = v.clone();
            }
            parse(c)
        };
        let c = qwen2(json!({"decoder_sparse_step": 2, "mlp_only_layers": [3]})).unwrap();
        let moe = c.moe.unwrap();
        assert_eq!(moe.sparse_layers, [false, true, false, false]);
        assert_eq!(moe.shared_expert_intermediate_size, Some(20));
        assert!(!moe.norm_topk_prob && c.qkv_bias && !c.o_bias);
        for (extra, wanted) in [
            (
                json!({"num_experts_per_tok": 5}),
                "key \"num_experts_per_tok\": 5 is more than the 4 experts (num_experts)",
            ),
            (
                json!({"mlp_only_layers": [4]}),
                "key \"mlp_only_layers\": expected a list of integers below 4, found 4",
            ),
            (
                json!({"shared_expert_intermediate_size": null}),
                "key \"shared_expert_intermediate_size\": missing",
            ),
        ] {
            let err = qwen2(extra).unwrap_err().to_string();
            assert!(err.contains(wanted), "{err}");
        }
        // transformers 5 saves Qwen3-MoE's expert count as num_local_experts.
        let qwen3 = parse(llama(json!({
            "model_type": "qwen3_moe", "num_local_experts": 8, "num_experts": null,
            "num_experts_per_tok": 8, "moe_intermediate_size": 12, "norm_topk_prob": true,
        })))
        .unwrap();
        assert_eq!(
            qwen3.moe.map(|m| (m.experts, m.norm_topk_prob)),
            Some((8, true))
        );
    }

    #[test]
    fn t5_reads_its_own_keys() {
        let t5 = |extra: Value| {
            let mut c = json!({
                "model_type": "t5", "vocab_size": 32, "d_model": 16, "d_kv": 6, "d_ff": 24,
                "num_layers": 2, "num_heads": 2,
            });
            for (k, v) in extra.as_object().unwrap() {
                c[k] = v.clone();
            }
            parse(c)
        };
        let c =
            t5(json!({"feed_forward_proj": "gated-gelu", "tie_word_embeddings": false})).unwrap();
        assert_eq!(
            (c.hidden_size, c.head_dim, c.intermediate_size),
            (16, 6, 24)
        );
        assert_eq!(c.activation, ("gelu_new".into(), "feed_forward_proj"));
        let s = c.seq2seq.unwrap();
        assert_eq!(
            (
                s.decoder_layers,
                s.relative_buckets,
                s.relative_max_distance
            ),
            (2, 32, 128)
        );
        assert!(s.gated && !s.scale_decoder_outputs && c.tie_word_embeddings);
        let c = t5(
            json!({"num_decoder_layers": 3, "scale_decoder_outputs": true,
                          "tie_word_embeddings": false}),
        )
        .unwrap();
        assert_eq!(c.activation.0, "relu");
        let s = c.seq2seq.unwrap();
        assert!(!s.gated && s.scale_decoder_outputs && s.decoder_layers == 3);
        let err = t5(json!({"feed_forward_proj": "gated-gelu-x"})).unwrap_err();
        assert!(
            err.to_string().contains("not of the form ACT or gated-ACT"),
            "{err}"
        );
        let err = t5(json!({"d_kv": 0})).unwrap_err();
        assert!(err.to_string().contains("key \"d_kv\""), "{err}");
        // The logarithmic buckets need a range beyond the exact ones.
        for distance in [1, 16] {
            let err = t5(json!({"relative_attention_max_distance": distance})).unwrap_err();
            assert!(
                err.to_string().contains(&format!(
                    "key \"relative_attention_max_distance\": {distance} is not beyond the 16 exact offsets"
                )),
                "{err}"
            );
        }
        assert!(t5(json!({"relative_attention_max_distance": 17})).is_ok());
    }

    #[test]
    fn unknown_families_bad_json_and_bad_dtypes_name_the_file() {
        let err = parse(json!({"model_type": "bart", "architectures": ["BartModel"]})).unwrap_err();
        assert!(
            matches!(&err, Error::UnsupportedModel { model_type: Some(t), .. } if t == "bart"),
            "{err}"
        );
        assert!(err.to_string().starts_with("m/config.json: "), "{err}");
        let err = HfConfig::parse("{", "x.json").unwrap_err().to_string();
        assert!(err.starts_with("x.json: invalid JSON"), "{err}");
        let err = HfConfig::parse("[1]", "x.json").unwrap_err().to_string();
        assert!(err.contains("expected a JSON object"), "{err}");
        let c = parse(llama(json!({"torch_dtype": "int8"}))).unwrap();
        let err = c.dtype().unwrap_err().to_string();
        assert!(
            err.contains("key \"torch_dtype\": unsupported dtype \"int8\""),
            "{err}"
        );
        assert_eq!(
            parse(llama(json!({}))).unwrap().dtype().unwrap(),
            DType::F32
        );
    }

    #[test]
    fn keys_read_nested_objects_lists_and_token_ids() {
        let keys = ConfigKeys::from_value(
            json!({"rope": {"factor": "x"}, "eos": [1, 2], "big": 5_000_000_000u64, "w": null}),
            "c.json",
        )
        .unwrap();
        let err = keys
            .nested("rope")
            .unwrap()
            .unwrap()
            .opt_f64("factor", Float::Scale)
            .unwrap_err();
        assert!(err.to_string().contains("key \"rope.factor\""), "{err}");
        assert_eq!(keys.token_ids("eos").unwrap(), [1, 2]);
        assert!(keys.token_ids("big").is_err());
        assert_eq!(keys.nullable_count("w", Some(4), 10).unwrap(), None);
        assert_eq!(keys.nullable_count("absent", Some(4), 10).unwrap(), Some(4));
    }
}
