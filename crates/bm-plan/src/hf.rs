//! Module trees from Hugging Face `config.json` files, with transformers'
//! module names, class names, parameter shapes and registration order (as
//! of transformers 5.x): the Llama, Mistral, Qwen2, Qwen3, Gemma 2 and
//! Phi-3 causal LMs, GPT-2's `GPT2LMHeadModel` and BERT's `BertModel`.

use bm_tensor::{DType, TensorMeta};
use serde_json::Value;

use crate::Error;
use crate::tree::{ModuleId, ModuleTree, ModuleTreeBuilder};

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

/// A model described by a config.json.
#[derive(Clone, Debug)]
pub struct HfModel {
    /// The family.
    pub family: Family,
    /// The module tree, parameters in the config's dtype.
    pub tree: ModuleTree,
    /// The family's `_no_split_modules`.
    pub no_split: Vec<String>,
    /// The repeated blocks (decoder or encoder layers), in order.
    pub layers: Vec<ModuleId>,
    /// KV-cache elements per token per layer (keys and values), for decoders.
    pub kv_elements_per_token: Option<u64>,
    /// The dtype the weights are stored in (`dtype`/`torch_dtype`, default F32).
    pub dtype: DType,
}

impl HfModel {
    /// KV-cache bytes per decoder layer for `batch` sequences of `seq_len`
    /// tokens in `dtype`, as runtime bytes for [`crate::PlanOptions`].
    pub fn kv_runtime_bytes(
        &self,
        batch: u64,
        seq_len: u64,
        dtype: DType,
    ) -> Option<Vec<(ModuleId, u64)>> {
        let per_token = self.kv_elements_per_token?;
        let bytes = per_token
            .saturating_mul(batch)
            .saturating_mul(seq_len)
            .saturating_mul(dtype.size_in_bytes() as u64);
        Some(self.layers.iter().map(|m| (*m, bytes)).collect())
    }
}

struct Config<'a> {
    obj: &'a serde_json::Map<String, Value>,
}

impl Config<'_> {
    fn usize(&self, key: &str) -> Result<usize, Error> {
        self.opt_usize(key)?
            .ok_or_else(|| Error::Config(format!("missing \"{key}\" (a non-negative integer)")))
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>, Error> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| {
                    Error::Config(format!(
                        "\"{key}\" must be a non-negative integer, found {v}"
                    ))
                }),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool, Error> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(Error::Config(format!(
                "\"{key}\" must be true or false, found {v}"
            ))),
        }
    }

    fn str_or<'b>(&'b self, key: &str, default: &'b str) -> &'b str {
        self.obj
            .get(key)
            .and_then(|v| v.as_str())
            .unwrap_or(default)
    }

    fn f64_or(&self, key: &str, default: f64) -> f64 {
        self.obj
            .get(key)
            .and_then(|v| v.as_f64())
            .unwrap_or(default)
    }
}

fn activation_class(name: &str) -> Result<&'static str, Error> {
    Ok(match name {
        "silu" => "SiLUActivation",
        "swish" => "SiLU",
        "gelu" => "GELUActivation",
        "gelu_new" => "NewGELUActivation",
        "gelu_pytorch_tanh" => "GELUTanh",
        "gelu_fast" => "FastGELUActivation",
        "quick_gelu" => "QuickGELUActivation",
        "relu" => "ReLU",
        other => return Err(Error::Config(format!("unsupported activation {other:?}"))),
    })
}

/// True when `text` looks like a config.json of a supported family.
pub fn is_config(doc: &Value) -> bool {
    doc.get("model_type").and_then(|m| m.as_str()).is_some()
}

/// Builds the model a config.json describes.
pub fn tree_from_config(doc: &Value) -> Result<HfModel, Error> {
    let obj = doc
        .as_object()
        .ok_or_else(|| Error::Config("expected a JSON object".into()))?;
    let cfg = Config { obj };
    let model_type = obj
        .get("model_type")
        .and_then(|m| m.as_str())
        .ok_or_else(|| Error::Config("missing \"model_type\"".into()))?;
    let dtype_name = obj
        .get("dtype")
        .or_else(|| obj.get("torch_dtype"))
        .and_then(|d| d.as_str())
        .unwrap_or("float32");
    let dtype = DType::from_torch_str(dtype_name)
        .filter(|d| d.is_float())
        .ok_or_else(|| Error::Config(format!("unsupported dtype {dtype_name:?}")))?;
    let family = match model_type {
        "llama" => Family::Llama,
        "mistral" => Family::Mistral,
        "qwen2" => Family::Qwen2,
        "qwen3" => Family::Qwen3,
        "gemma2" => Family::Gemma2,
        "phi3" => Family::Phi3,
        "gpt2" => Family::Gpt2,
        "bert" => Family::Bert,
        other => {
            return Err(Error::Config(format!(
                "model_type {other:?} is not supported (supported: llama, mistral, qwen2, qwen3, gemma2, phi3, gpt2, bert); export the model with tools/export_module_tree.py instead"
            )));
        }
    };
    let expected = match family {
        Family::Llama => "LlamaForCausalLM",
        Family::Mistral => "MistralForCausalLM",
        Family::Qwen2 => "Qwen2ForCausalLM",
        Family::Qwen3 => "Qwen3ForCausalLM",
        Family::Gemma2 => "Gemma2ForCausalLM",
        Family::Phi3 => "Phi3ForCausalLM",
        Family::Gpt2 => "GPT2LMHeadModel",
        Family::Bert => "BertModel",
    };
    if let Some(archs) = obj.get("architectures").and_then(|a| a.as_array())
        && !archs.is_empty()
        && !archs.iter().any(|a| a.as_str() == Some(expected))
    {
        return Err(Error::Config(format!(
            "architectures {} are not supported; this family is planned as {expected}",
            Value::Array(archs.clone())
        )));
    }
    match family {
        Family::Gpt2 => gpt2(&cfg, dtype),
        Family::Bert => bert(&cfg, dtype),
        _ => decoder(&cfg, family, dtype),
    }
}

struct B {
    b: ModuleTreeBuilder,
    dtype: DType,
}

impl B {
    fn module(&mut self, parent: ModuleId, name: &str, class: &str) -> Result<ModuleId, Error> {
        self.b.add_module(parent, name, class)
    }

    fn param(&mut self, m: ModuleId, name: &str, shape: &[usize]) -> Result<(), Error> {
        self.b
            .add_param(m, name, TensorMeta::new(self.dtype, shape))
            .map(|_| ())
    }

    fn linear(
        &mut self,
        parent: ModuleId,
        name: &str,
        inputs: usize,
        outputs: usize,
        bias: bool,
    ) -> Result<ModuleId, Error> {
        let m = self.module(parent, name, "Linear")?;
        self.param(m, "weight", &[outputs, inputs])?;
        if bias {
            self.param(m, "bias", &[outputs])?;
        }
        Ok(m)
    }

    fn conv1d(
        &mut self,
        parent: ModuleId,
        name: &str,
        inputs: usize,
        outputs: usize,
    ) -> Result<ModuleId, Error> {
        let m = self.module(parent, name, "Conv1D")?;
        self.param(m, "weight", &[inputs, outputs])?;
        self.param(m, "bias", &[outputs])?;
        Ok(m)
    }

    fn embedding(
        &mut self,
        parent: ModuleId,
        name: &str,
        count: usize,
        dim: usize,
    ) -> Result<ModuleId, Error> {
        let m = self.module(parent, name, "Embedding")?;
        self.param(m, "weight", &[count, dim])?;
        Ok(m)
    }

    fn layer_norm(&mut self, parent: ModuleId, name: &str, dim: usize) -> Result<ModuleId, Error> {
        let m = self.module(parent, name, "LayerNorm")?;
        self.param(m, "weight", &[dim])?;
        self.param(m, "bias", &[dim])?;
        Ok(m)
    }
}

/// The Llama-style causal LMs. Their differences (class prefix, biases,
/// Qwen3's q/k norms, Gemma 2's scaled embedding and four norms, Phi-3's
/// fused projections and partial rotary) as transformers registers them.
fn decoder(cfg: &Config<'_>, family: Family, dtype: DType) -> Result<HfModel, Error> {
    let prefix = match family {
        Family::Llama => "Llama",
        Family::Mistral => "Mistral",
        Family::Qwen2 => "Qwen2",
        Family::Qwen3 => "Qwen3",
        Family::Gemma2 => "Gemma2",
        _ => "Phi3",
    };
    let vocab = cfg.usize("vocab_size")?;
    let hidden = cfg.usize("hidden_size")?;
    let inter = cfg.usize("intermediate_size")?;
    let layers = cfg.usize("num_hidden_layers")?;
    let heads = cfg.usize("num_attention_heads")?;
    if heads == 0 {
        return Err(Error::Config(
            "\"num_attention_heads\" must be positive".into(),
        ));
    }
    let kv_heads = cfg.opt_usize("num_key_value_heads")?.unwrap_or(heads);
    let head_dim = cfg.opt_usize("head_dim")?.unwrap_or(hidden / heads);
    let attention_bias = cfg.bool_or("attention_bias", false)?;
    let (qkv_bias, o_bias) = match family {
        Family::Mistral | Family::Phi3 => (false, false),
        Family::Qwen2 => (true, false),
        _ => (attention_bias, attention_bias),
    };
    let mlp_bias = family == Family::Llama && cfg.bool_or("mlp_bias", false)?;
    let gemma = family == Family::Gemma2;
    let tie = cfg.bool_or("tie_word_embeddings", gemma)?;
    let act = if gemma {
        let key = if cfg.obj.contains_key("hidden_activation") {
            "hidden_activation"
        } else {
            "hidden_act"
        };
        activation_class(cfg.str_or(key, "gelu_pytorch_tanh"))?
    } else {
        activation_class(cfg.str_or("hidden_act", "silu"))?
    };
    // Only Phi-3's rotary embedding reads the partial factor.
    let partial = if family == Family::Phi3 {
        cfg.obj
            .get("rope_parameters")
            .and_then(|r| r.get("partial_rotary_factor"))
            .and_then(|v| v.as_f64())
            .unwrap_or_else(|| cfg.f64_or("partial_rotary_factor", 1.0))
    } else {
        1.0
    };
    let rope_dim = (head_dim as f64 * partial) as usize;

    let mut b = B {
        b: ModuleTreeBuilder::new(format!("{prefix}ForCausalLM")),
        dtype,
    };
    let model = b.module(0, "model", &format!("{prefix}Model"))?;
    if gemma {
        let embed = b.module(model, "embed_tokens", "Gemma2TextScaledWordEmbedding")?;
        b.param(embed, "weight", &[vocab, hidden])?;
        // A scalar created in the default dtype, which is the model's.
        b.b.add_buffer(embed, "embed_scale", TensorMeta::new(dtype, []), false)?;
    } else {
        b.embedding(model, "embed_tokens", vocab, hidden)?;
    }
    let list = b.module(model, "layers", "ModuleList")?;
    let norm_class = format!("{prefix}RMSNorm");
    let mut layer_ids = Vec::with_capacity(layers);
    for i in 0..layers {
        let layer = b.module(list, &i.to_string(), &format!("{prefix}DecoderLayer"))?;
        layer_ids.push(layer);
        let attn = b.module(layer, "self_attn", &format!("{prefix}Attention"))?;
        if family == Family::Phi3 {
            b.linear(attn, "o_proj", heads * head_dim, hidden, false)?;
            b.linear(
                attn,
                "qkv_proj",
                hidden,
                (heads + 2 * kv_heads) * head_dim,
                false,
            )?;
        } else {
            b.linear(attn, "q_proj", hidden, heads * head_dim, qkv_bias)?;
            b.linear(attn, "k_proj", hidden, kv_heads * head_dim, qkv_bias)?;
            b.linear(attn, "v_proj", hidden, kv_heads * head_dim, qkv_bias)?;
            b.linear(attn, "o_proj", heads * head_dim, hidden, o_bias)?;
        }
        if family == Family::Qwen3 {
            for norm in ["q_norm", "k_norm"] {
                let n = b.module(attn, norm, &norm_class)?;
                b.param(n, "weight", &[head_dim])?;
            }
        }
        let mlp = b.module(layer, "mlp", &format!("{prefix}MLP"))?;
        if family == Family::Phi3 {
            b.linear(mlp, "gate_up_proj", hidden, 2 * inter, false)?;
            b.linear(mlp, "down_proj", inter, hidden, false)?;
            b.module(mlp, "activation_fn", act)?;
        } else {
            b.linear(mlp, "gate_proj", hidden, inter, mlp_bias)?;
            b.linear(mlp, "up_proj", hidden, inter, mlp_bias)?;
            b.linear(mlp, "down_proj", inter, hidden, mlp_bias)?;
            b.module(mlp, "act_fn", act)?;
        }
        let norms: &[&str] = if gemma {
            &[
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            ]
        } else {
            &["input_layernorm", "post_attention_layernorm"]
        };
        for norm in norms {
            let n = b.module(layer, norm, &norm_class)?;
            b.param(n, "weight", &[hidden])?;
        }
        if family == Family::Phi3 {
            b.module(layer, "resid_attn_dropout", "Dropout")?;
            b.module(layer, "resid_mlp_dropout", "Dropout")?;
        }
    }
    let norm = b.module(model, "norm", &norm_class)?;
    b.param(norm, "weight", &[hidden])?;
    let rotary = b.module(model, "rotary_emb", &format!("{prefix}RotaryEmbedding"))?;
    // Computed in float32 whatever the model's dtype.
    for buffer in ["inv_freq", "original_inv_freq"] {
        b.b.add_buffer(
            rotary,
            buffer,
            TensorMeta::new(DType::F32, [rope_dim.div_ceil(2)]),
            false,
        )?;
    }
    b.linear(0, "lm_head", hidden, vocab, false)?;
    if tie {
        b.b.tie(&["lm_head.weight", "model.embed_tokens.weight"]);
    }
    Ok(HfModel {
        family,
        tree: b.b.finish()?,
        no_split: vec![format!("{prefix}DecoderLayer")],
        layers: layer_ids,
        kv_elements_per_token: Some(2 * (kv_heads * head_dim) as u64),
        dtype,
    })
}

fn gpt2(cfg: &Config<'_>, dtype: DType) -> Result<HfModel, Error> {
    let vocab = cfg.usize("vocab_size")?;
    let embd = cfg.usize("n_embd")?;
    let layers = cfg.usize("n_layer")?;
    let positions = cfg.usize("n_positions")?;
    let inner = cfg.opt_usize("n_inner")?.unwrap_or(4 * embd);
    let act = activation_class(cfg.str_or("activation_function", "gelu_new"))?;
    let tie = cfg.bool_or("tie_word_embeddings", true)?;

    let mut b = B {
        b: ModuleTreeBuilder::new("GPT2LMHeadModel"),
        dtype,
    };
    let transformer = b.module(0, "transformer", "GPT2Model")?;
    b.embedding(transformer, "wte", vocab, embd)?;
    b.embedding(transformer, "wpe", positions, embd)?;
    b.module(transformer, "drop", "Dropout")?;
    let h = b.module(transformer, "h", "ModuleList")?;
    let mut layer_ids = Vec::with_capacity(layers);
    for i in 0..layers {
        let block = b.module(h, &i.to_string(), "GPT2Block")?;
        layer_ids.push(block);
        b.layer_norm(block, "ln_1", embd)?;
        let attn = b.module(block, "attn", "GPT2Attention")?;
        b.conv1d(attn, "c_attn", embd, 3 * embd)?;
        b.conv1d(attn, "c_proj", embd, embd)?;
        b.module(attn, "attn_dropout", "Dropout")?;
        b.module(attn, "resid_dropout", "Dropout")?;
        b.layer_norm(block, "ln_2", embd)?;
        let mlp = b.module(block, "mlp", "GPT2MLP")?;
        b.conv1d(mlp, "c_fc", embd, inner)?;
        b.conv1d(mlp, "c_proj", inner, embd)?;
        b.module(mlp, "act", act)?;
        b.module(mlp, "dropout", "Dropout")?;
    }
    b.layer_norm(transformer, "ln_f", embd)?;
    b.linear(0, "lm_head", embd, vocab, false)?;
    if tie {
        b.b.tie(&["lm_head.weight", "transformer.wte.weight"]);
    }
    Ok(HfModel {
        family: Family::Gpt2,
        tree: b.b.finish()?,
        no_split: vec!["GPT2Block".into()],
        layers: layer_ids,
        kv_elements_per_token: Some(2 * embd as u64),
        dtype,
    })
}

fn bert(cfg: &Config<'_>, dtype: DType) -> Result<HfModel, Error> {
    let vocab = cfg.usize("vocab_size")?;
    let hidden = cfg.usize("hidden_size")?;
    let layers = cfg.usize("num_hidden_layers")?;
    let inter = cfg.usize("intermediate_size")?;
    let positions = cfg.opt_usize("max_position_embeddings")?.unwrap_or(512);
    let types = cfg.opt_usize("type_vocab_size")?.unwrap_or(2);
    let act = activation_class(cfg.str_or("hidden_act", "gelu"))?;

    let mut b = B {
        b: ModuleTreeBuilder::new("BertModel"),
        dtype,
    };
    let emb = b.module(0, "embeddings", "BertEmbeddings")?;
    b.embedding(emb, "word_embeddings", vocab, hidden)?;
    b.embedding(emb, "position_embeddings", positions, hidden)?;
    b.embedding(emb, "token_type_embeddings", types, hidden)?;
    b.layer_norm(emb, "LayerNorm", hidden)?;
    b.module(emb, "dropout", "Dropout")?;
    for buffer in ["position_ids", "token_type_ids"] {
        b.b.add_buffer(
            emb,
            buffer,
            TensorMeta::new(DType::I64, [1, positions]),
            false,
        )?;
    }
    let encoder = b.module(0, "encoder", "BertEncoder")?;
    let list = b.module(encoder, "layer", "ModuleList")?;
    let mut layer_ids = Vec::with_capacity(layers);
    for i in 0..layers {
        let layer = b.module(list, &i.to_string(), "BertLayer")?;
        layer_ids.push(layer);
        let attention = b.module(layer, "attention", "BertAttention")?;
        let slf = b.module(attention, "self", "BertSelfAttention")?;
        for name in ["query", "key", "value"] {
            b.linear(slf, name, hidden, hidden, true)?;
        }
        b.module(slf, "dropout", "Dropout")?;
        let out = b.module(attention, "output", "BertSelfOutput")?;
        b.linear(out, "dense", hidden, hidden, true)?;
        b.layer_norm(out, "LayerNorm", hidden)?;
        b.module(out, "dropout", "Dropout")?;
        let intermediate = b.module(layer, "intermediate", "BertIntermediate")?;
        b.linear(intermediate, "dense", hidden, inter, true)?;
        b.module(intermediate, "intermediate_act_fn", act)?;
        let output = b.module(layer, "output", "BertOutput")?;
        b.linear(output, "dense", inter, hidden, true)?;
        b.layer_norm(output, "LayerNorm", hidden)?;
        b.module(output, "dropout", "Dropout")?;
    }
    let pooler = b.module(0, "pooler", "BertPooler")?;
    b.linear(pooler, "dense", hidden, hidden, true)?;
    b.module(pooler, "activation", "Tanh")?;
    Ok(HfModel {
        family: Family::Bert,
        tree: b.b.finish()?,
        no_split: vec!["BertEmbeddings".into(), "BertLayer".into()],
        layers: layer_ids,
        kv_elements_per_token: None,
        dtype,
    })
}
