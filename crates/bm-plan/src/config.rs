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
}

impl Family {
    /// The config.json key of the number of layers (GPT-2's `n_layer`).
    pub fn layers_key(self) -> &'static str {
        match self {
            Family::Gpt2 => "n_layer",
            _ => "num_hidden_layers",
        }
    }

    /// Every family, with its `model_type`.
    pub const ALL: [(Family, &'static str); 8] = [
        (Family::Llama, "llama"),
        (Family::Mistral, "mistral"),
        (Family::Qwen2, "qwen2"),
        (Family::Qwen3, "qwen3"),
        (Family::Gemma2, "gemma2"),
        (Family::Phi3, "phi3"),
        (Family::Gpt2, "gpt2"),
        (Family::Bert, "bert"),
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
        !matches!(self, Family::Gpt2 | Family::Bert)
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

    /// A number, `None` when absent.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>, Error> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.error(key, format!("expected a number, found {v}"))),
        }
    }

    /// A number whose absence means `default` and whose `null` means none
    /// (transformers' `float | None = default` fields).
    pub fn nullable_f64(&self, key: &str, default: Option<f64>) -> Result<Option<f64>, Error> {
        match self.object.get(key) {
            None => Ok(default),
            Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.error(key, format!("expected a number or null, found {v}"))),
        }
    }

    /// A list of numbers, `None` when absent.
    pub fn opt_f64s(&self, key: &str) -> Result<Option<Vec<f64>>, Error> {
        self.opt_list(key, "numbers", Value::as_f64)
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
        let given_head_dim = match rotary {
            true => keys.opt_count("head_dim", MAX_WIDTH)?,
            false => None,
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
            // Only Phi-3's rotary embedding reads the partial factor
            // (transformers' Llama, Qwen and Gemma rotate the whole head).
            Phi3 => Some(partial_rotary_dim(&keys, head_dim)?),
            Gpt2 | Bert => None,
            _ => Some(head_dim),
        };
        let attention_bias = keys.bool_or("attention_bias", false)?;
        let (qkv_bias, o_bias) = match family {
            Mistral | Phi3 => (false, false),
            Qwen2 => (true, false),
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
            _ => keys.bool_or("tie_word_embeddings", matches!(family, Gemma2 | Gpt2))?,
        };
        let (activation_key, default_activation) = match family {
            Gpt2 => ("activation_function", "gelu_new"),
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

/// Phi-3's rotated dimensions: `partial_rotary_factor` (in
/// `rope_parameters`, else at the top level; default 1) of the head, an
/// even number of at least two.
fn partial_rotary_dim(keys: &ConfigKeys, head_dim: usize) -> Result<usize, Error> {
    let nested = keys.nested("rope_parameters")?;
    let factor = match nested.as_ref().map(|p| p.opt_f64("partial_rotary_factor")) {
        Some(Ok(Some(f))) => f,
        Some(Err(e)) => return Err(e),
        _ => keys.opt_f64("partial_rotary_factor")?.unwrap_or(1.0),
    };
    let dim = (head_dim as f64 * factor) as usize;
    if factor <= 0.0 || dim == 0 || dim > head_dim || dim % 2 != 0 {
        return Err(keys.error(
            "partial_rotary_factor",
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
    fn unknown_families_bad_json_and_bad_dtypes_name_the_file() {
        let err = parse(json!({"model_type": "t5", "architectures": ["T5Model"]})).unwrap_err();
        assert!(
            matches!(&err, Error::UnsupportedModel { model_type: Some(t), .. } if t == "t5"),
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
            .opt_f64("factor")
            .unwrap_err();
        assert!(err.to_string().contains("key \"rope.factor\""), "{err}");
        assert_eq!(keys.token_ids("eos").unwrap(), [1, 2]);
        assert!(keys.token_ids("big").is_err());
        assert_eq!(keys.nullable_count("w", Some(4), 10).unwrap(), None);
        assert_eq!(keys.nullable_count("absent", Some(4), 10).unwrap(), Some(4));
    }
}
